"""``POST /v1/locks/{name}/-/abandon``: the gateway's source forgets an acquire its client gave
up (tests/sources/test_abandoned_acquire.py shows why), for the key's own request id only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced.testing.servers import FencedServer
from tests.server.gateway import get, keyed_server, post

SECRETS = {
    "one": "fk_one_secret_00000000000000000",
    "two": "fk_two_secret_00000000000000000",
    "reader": "fk_reader_secret_0000000000000",
}


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[FencedServer]:
    with keyed_server(f"sqlite:///{tmp_path}/locks.db", tmp_path / "keys.toml", [
        {"id": "one", "secret": SECRETS["one"], "verbs": ["acquire", "check"]},
        {"id": "two", "secret": SECRETS["two"], "verbs": ["acquire", "check"]},
        {"id": "reader", "secret": SECRETS["reader"], "verbs": ["check"]},
    ]) as s:  # fmt: skip
        yield s


def test_abandon_forgets_only_the_keys_own_request(keyed: FencedServer) -> None:
    u = keyed.url
    lock = f"{u}/v1/locks/jobs"
    got = post(f"{lock}/-/acquire", {"ttl": 30, "request_id": "r-1"}, key=SECRETS["one"])
    assert got.status_code == 200
    token = got.json()["token"]

    def held() -> bool:
        status = get(lock, key=SECRETS["one"]).json()
        return bool(status["held"]) and status["token"] == token

    # Another key's request of the same id, a key that may not acquire, bad input: refused
    # or a no-op, and the grant stays.
    other = post(f"{lock}/-/abandon", {"request_id": "r-1"}, key=SECRETS["two"])
    assert other.status_code == 200 and other.json() == {"forgotten": True}
    assert (
        post(f"{lock}/-/abandon", {"request_id": "r-1"}, key=SECRETS["reader"]).status_code == 403
    )
    for body in ({"request_id": ""}, {"request_id": "r 1"}, {}, {"request_id": "r-1", "x": 1}):
        bad = post(f"{lock}/-/abandon", body, key=SECRETS["one"])
        assert bad.status_code == 400 and bad.json()["error"] == "invalid_request", body
        assert "\n" not in bad.json()["message"]
    assert held()
    # The key's own request: the grant (made for an acquire its client gave up) goes back.
    mine = post(f"{lock}/-/abandon", {"request_id": "r-1"}, key=SECRETS["one"])
    assert mine.status_code == 200 and mine.json() == {"forgotten": True}
    assert not get(lock, key=SECRETS["one"]).json()["held"]
    again = post(f"{lock}/-/abandon", {"request_id": "r-1"}, key=SECRETS["one"])  # idempotent
    assert again.status_code == 200
    nxt = post(f"{lock}/-/acquire", {"ttl": 30, "request_id": "r-2"}, key=SECRETS["two"])
    assert nxt.status_code == 200 and nxt.json()["value"] > got.json()["value"]
