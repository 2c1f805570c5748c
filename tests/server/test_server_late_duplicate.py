"""``fenced serve``: a request id names one attempt. An acquire delivered after its grant was
released (or expired) is a late duplicate: the gateway that saw that grant answers it 410
``lease_lost`` instead of a second grant nobody holds (the lock idle for its ttl; outside
tester's ``replay.py``). A retry while the grant lives still returns it. The Python client
never sends a used id for a new attempt: a lease given ``request_id`` uses it for its first
grant only, and a 410 to an acquire is answered by a new attempt under a new id.

A real ``fenced serve`` process on SQLite, the real Python client (``http://``)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

import fenced
from fenced.testing.servers import FencedServer
from tests.helpers import TLS


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FencedServer]:
    base = tmp_path_factory.mktemp("late")
    with FencedServer(f"sqlite:///{base / 'locks.db'}") as s:
        yield s  # type: ignore[misc]


def _post(url: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(url, json=body, timeout=30, verify=TLS)


def test_the_same_request_id_after_its_release_is_answered_ended_not_granted(
    server: FencedServer,
) -> None:
    lock = f"{server.url}/v1/locks/late/replay"
    body = {"ttl": 30, "request_id": "job-17"}
    first = _post(f"{lock}/-/acquire", body).json()
    retry = _post(f"{lock}/-/acquire", body)  # (its answer lost: sent again, before release)
    assert retry.status_code == 200 and retry.json()["token"] == first["token"] == "late/replay:1"
    lease = {"token": first["token"], "request_id": "job-17"}
    assert _post(f"{lock}/-/release", lease).json() == {"released": True}
    late = _post(f"{lock}/-/acquire", {**body, "timeout": 5})  # (a late copy, even waiting)
    assert late.status_code == 410, late.text
    assert late.json()["error"] == "lease_lost" and "new request id" in late.json()["message"]
    status = httpx.get(lock, timeout=30, verify=TLS).json()
    assert status["held"] is False and status["last_token"] == "late/replay:1"  # (no grant 2)
    # a new attempt, under a new id: granted at once, the next token
    new = _post(f"{lock}/-/acquire", {"ttl": 30, "request_id": "job-17b"}).json()
    assert new["token"] == "late/replay:2"
    assert _post(f"{lock}/-/release", {"token": new["token"], "request_id": "job-17b"}).json()


def test_the_python_client_never_reuses_a_request_id_for_a_new_attempt(
    server: FencedServer,
) -> None:
    """A lease given ``request_id``: its first grant uses it; acquired again after its release,
    a new id (before: the same, answered 410 now). A lease given an id whose grant has ended
    already (the 410): a new attempt, under a new id, granted. Seen failing without the lease
    core's change (LeaseLostError out of acquire)."""
    with fenced.connect(server.url) as locks:
        lease = locks.lock("late/python", ttl=30, request_id="job-42")
        one = lease.acquire(timeout=5)
        assert lease.request_id == "job-42"
        assert lease.release() is True
        two = lease.acquire(timeout=5)
        assert two.value == one.value + 1 and lease.request_id not in (None, "job-42")
        assert lease.release() is True
        # another lease named with the ended id (a process started again with its job's id)
        again = locks.lock("late/python", ttl=30, request_id="job-42")
        three = again.acquire(timeout=5)
        assert three.value == two.value + 1 and again.request_id != "job-42"
        assert again.release() is True
