"""``fenced serve`` with keys: a request id is no oracle. A key allowed on a lock's prefix that
names a request id it guessed (a client may choose its own, ``job-17``) gets, for every verb,
byte for byte the answer an id nobody uses gets — not a 403 saying "another key's grant" —
on both lanes (the fast lane and the FastAPI routes) and on the new and the old paths; the
grant's owner keeps every answer of its own. (As Consul's ACLs filter what a token may not
read into "not found", and GitHub answers 404 for a repository one may not see.)

The real app, in process (``httpx.ASGITransport``), on a real SQLite source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from fenced.server._app import ServerSettings, create_app
from fenced.server._auth import load_api_keys
from tests.server.gateway import write_keys

ALICE, BOB = "fk_alice_secret_00000000000000", "fk_bob_secret_0000000000000000"
ADMIN = "fk_admin_secret_0000000000000"


def _app(tmp_path: Path, fast: bool) -> Any:
    keys = write_keys(
        tmp_path / "keys.toml",
        [
            {"id": "alice", "secret": ALICE, "prefixes": ["shared/"], "verbs": ["acquire"]},
            {"id": "bob", "secret": BOB, "prefixes": ["shared/"], "verbs": ["acquire"]},
            {"id": "admin", "secret": ADMIN, "verbs": ["admin"]},
        ],
    )
    settings = ServerSettings(
        url=f"sqlite:///{tmp_path / ('fast' if fast else 'slow')}.db",
        api_keys=load_api_keys(keys),
        fast_lane=fast,
    )
    return create_app(settings)


def _probes(token: str, rid: str) -> list[tuple[str, dict[str, Any]]]:
    """Every request by request id a key can make: (verb, body)."""
    lease = {"token": token, "request_id": rid}
    return [
        ("acquire", {"ttl": 30, "request_id": rid}),  # try once
        ("acquire", {"ttl": 30, "request_id": rid, "timeout": 0.2}),  # waits in line
        ("renew", lease),
        ("renew", {**lease, "ttl": 30}),
        ("renew", {"token": token, "lease_id": rid}),
        ("release", lease),
        ("release", {"token": token, "lease_id": rid}),
    ]


def _answer(r: httpx.Response) -> tuple[int, bytes, list[tuple[str, str]]]:
    # (the headers but the date, which the moment sets)
    kept = [(k, v) for k, v in r.headers.multi_items() if k.lower() != "date"]
    return r.status_code, r.content, kept


@pytest.mark.parametrize("fast", [True, False], ids=["fast-lane", "fastapi"])
@pytest.mark.parametrize("old", [False, True], ids=["paths", "old-paths"])
async def test_another_keys_request_id_is_answered_as_an_unknown_one(
    tmp_path: Path, fast: bool, old: bool
) -> None:
    app = _app(tmp_path, fast)
    sep = "/" if old else "/-/"
    lock = "/v1/locks/shared/job"
    as_ = {k: {"authorization": f"Bearer {v}"} for k, v in (("alice", ALICE), ("bob", BOB))}

    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c,
    ):

        async def post(verb: str, body: dict[str, Any], who: str) -> httpx.Response:
            return await c.post(f"{lock}{sep}{verb}", content=json.dumps(body), headers=as_[who])

        got = (await post("acquire", {"ttl": 30, "request_id": "job-17"}, "alice")).json()
        token = got["token"]
        assert token == "shared/job:1"
        # bob guesses alice's id, and names one nobody uses: the same answers, byte for byte
        for (verb, foreign), (_, unknown) in zip(
            _probes(token, "job-17"), _probes(token, "job-99"), strict=True
        ):
            a = _answer(await post(verb, foreign, "bob"))
            b = _answer(await post(verb, unknown, "bob"))
            assert a == b, (verb, foreign, a, b)
            assert a[0] != 403 and b"another key" not in a[1], (verb, a)
        # nothing changed: alice's grant is live, and every answer of hers is hers
        status = (await c.get(lock, headers=as_["alice"])).json()
        assert status["token"] == token and status["holder"] == "job-17", status
        assert status["last_token"] == token  # (no grant was made for bob meanwhile)
        lease = {"token": token, "request_id": "job-17"}
        renewed = await post("renew", lease, "alice")
        assert renewed.status_code == 200 and renewed.json()["ttl"] == 30, renewed.text
        again = (await post("acquire", {"request_id": "job-17"}, "alice")).json()
        assert again["token"] == token  # (her retry: the same grant)
        assert (await post("release", lease, "alice")).json() == {"released": True}
        # the lock free, bob's "job-17" is a grant of his own, with the next token
        bobs = (await post("acquire", {"ttl": 30, "request_id": "job-17"}, "bob")).json()
        assert bobs["token"] == "shared/job:2", bobs
        # and now alice's renewal of her old id is the lost lease it is (410), not bob's
        late = await post("renew", lease, "alice")
        assert late.status_code == 410 and late.json()["error"] == "lease_lost", late.text
        # operators still count each use of a foreign id as a refusal (the metrics are theirs
        # alone): bob's 7 probes, and alice's late renewal (her id is now bob's grant's)
        metrics = await c.get("/metrics", headers={"authorization": f"Bearer {ADMIN}"})
        line = 'fenced_refused_requests_total{reason="forbidden"}'
        counted = [x for x in metrics.text.splitlines() if x.startswith(line)]
        assert counted == [f"{line} 8.0"], counted


def _seen(dashboard: dict[str, Any]) -> dict[str, Any]:
    """What a dashboard answer tells, but the time passing (the grants' time left)."""
    out = dict(dashboard)
    out["locks"] = [{k: v for k, v in lock.items() if k != "remaining"} for lock in out["locks"]]
    return out


async def test_nothing_a_key_reads_moves_for_another_keys_request_id(tmp_path: Path) -> None:
    """Bob (no metrics verb) probes with alice's request id and with one nobody uses: his
    dashboard (its counters, locks, transitions, ttls) and the lock's status read the same
    after either. The server-wide counters, in which the first counts as a refusal, are
    /metrics's: null for him, shown to a key that may read /metrics."""
    app = _app(tmp_path, True)
    lock = "/v1/locks/shared/job"
    as_ = {
        k: {"authorization": f"Bearer {v}"}
        for k, v in (("alice", ALICE), ("bob", BOB), ("admin", ADMIN))
    }
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c,
    ):

        async def seen() -> tuple[dict[str, Any], dict[str, Any]]:
            dash = (await c.get("/v1/dashboard", headers=as_["bob"])).json()
            status = (await c.get(lock, headers=as_["bob"])).json()
            status.pop("remaining")
            return _seen(dash), status

        got = await c.post(f"{lock}/-/acquire", json={"ttl": 60, "request_id": "job-17"},
                           headers=as_["alice"])  # fmt: skip
        token = got.json()["token"]
        before = await seen()
        for probe in range(len(_probes(token, "x"))):
            after = {}
            before = await seen()  # (without the fix, the counters of the probe before)
            for rid in ("job-17", "job-99"):
                verb, body = _probes(token, rid)[probe]
                await c.post(f"{lock}/-/{verb}", json=body, headers=as_["bob"])
                after[rid] = await seen()
            assert after["job-17"] == after["job-99"] == before, (probe, after, before)
        assert before[0]["counters"] is None, before[0]["counters"]
        # the operators' view: a key with the metrics verb (here admin) sees the counters, and
        # each foreign probe counted as a refusal there
        counters = (await c.get("/v1/dashboard", headers=as_["admin"])).json()["counters"]
        assert counters["fenced_refused_requests_total{forbidden}"] == 7, counters
