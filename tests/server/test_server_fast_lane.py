"""The server's fast lane (acquire, renew, release without FastAPI's layers) answers exactly
what the FastAPI routes answer: the same script of requests — good ones, and every kind of
bad body, key and name — sent to two apps on two fresh sources, one with the lane and one
without, gets the same statuses and bodies; good requests take the lane, bad ones do not."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, assume, example, given, seed, settings
from hypothesis import strategies as st

from fenced.server._app import ServerSettings, _FastLane, create_app
from fenced.server._auth import load_api_keys
from tests.server.test_server_fuzz import bodies, headers

SECRET, OTHER = "s3cret-key-number-one", "s3cret-key-number-two"

# (method, path, body as raw bytes or JSON-able, key)
SCRIPT: list[tuple[str, str, Any, str | None]] = [
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5, "request_id": "r-1"}, SECRET),
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5, "request_id": "r-1"}, SECRET),  # same grant
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5}, SECRET),  # busy: 409
    ("POST", "/v1/locks/inv/acquire", None, SECRET),  # no body: defaults, busy
    ("POST", "/v1/locks/inv/acquire", b"", SECRET),
    ("POST", "/v1/locks/inv/acquire", b" \n", SECRET),  # whitespace is not "no body"
    ("POST", "/v1/locks/inv/acquire", b"{not json", SECRET),
    ("POST", "/v1/locks/inv/acquire", b"[1, 2]", SECRET),
    ("POST", "/v1/locks/inv/acquire", b"null", SECRET),
    ("POST", "/v1/locks/inv/acquire", {"ttl": "5"}, SECRET),  # strict: no strings for floats
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5, "extra": 1}, SECRET),
    ("POST", "/v1/locks/inv/acquire", {"ttl": -1}, SECRET),
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5, "request_id": "bad id!"}, SECRET),
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5, "timeout": True}, SECRET),
    ("POST", "/v1/locks/a%20b/acquire", {"ttl": 5}, SECRET),  # invalid lock name
    ("POST", "/v1/locks/dir/sub/acquire", {"ttl": 5, "request_id": "r-2"}, SECRET),
    ("POST", "/v1/locks//acquire", {"ttl": 5}, SECRET),
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5}, None),  # no key: 401
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5}, "unknown-key"),
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5}, OTHER),  # outside its prefix: 403
    ("POST", "/v1/locks/inv/renew", {"token": "inv:1", "request_id": "r-1"}, SECRET),
    ("POST", "/v1/locks/inv/renew", {"token": "inv:1", "request_id": "r-1", "ttl": 7}, SECRET),
    ("POST", "/v1/locks/inv/renew", {"token": "inv:1"}, SECRET),  # no request id
    ("POST", "/v1/locks/inv/renew", {"token": "inv:0", "request_id": "r-1"}, SECRET),
    ("POST", "/v1/locks/inv/renew", {"token": "other:1", "request_id": "r-1"}, SECRET),
    ("POST", "/v1/locks/inv/renew", {"token": 1, "request_id": "r-1"}, SECRET),
    ("POST", "/v1/locks/inv/renew", None, SECRET),
    ("POST", "/v1/locks/inv/renew", {"token": "inv:1", "request_id": "r-1"}, OTHER),
    ("POST", "/v1/locks/inv/release", {"token": "inv:1", "request_id": "nope"}, SECRET),
    ("POST", "/v1/locks/inv/release", {"token": "inv:1", "lease_id": "r-1"}, SECRET),
    ("POST", "/v1/locks/inv/renew", {"token": "inv:1", "request_id": "r-1"}, SECRET),  # 410
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5, "owner": "me", "timeout": 1}, SECRET),
    ("POST", "/v1/locks/inv/force-release", None, SECRET),  # another route: not the lane's
    ("GET", "/v1/locks/inv", None, SECRET),
    # A release asked again (its answer lost): true from the gateway that released it; the
    # same without "retry" is a release of a grant already released: false.
    (
        "POST",
        "/v1/locks/inv/release",
        {"token": "inv:1", "request_id": "r-1", "retry": True},
        SECRET,
    ),
    ("POST", "/v1/locks/inv/release", {"token": "inv:1", "request_id": "r-1"}, SECRET),
    (
        "POST",
        "/v1/locks/inv/release",
        {"token": "inv:1", "request_id": "r-1", "retry": None},
        SECRET,
    ),
    ("POST", "/v1/locks/inv/release", {"token": "inv:1", "request_id": "r-1", "retry": 1}, SECRET),
    (
        "POST",
        "/v1/locks/inv/release",
        {"token": "inv:1", "request_id": "r-1", "retry": "yes"},
        SECRET,
    ),
    ("POST", "/v1/locks/inv/renew", {"token": "inv:2", "request_id": "r-1", "retry": True}, SECRET),
]
# Taken by the lane: bodies that validate, from a key allowed on the lock — including the
# handlers' own refusals (a ttl out of range, a bad request id or lock name, another lock's
# token), answered there by the same code. Bad bodies, missing or wrong keys, other routes: not.
GOOD = {0, 1, 2, 3, 4, 11, 12, 14, 15, 20, 21, 22, 23, 24, 28, 29, 30, 31, 34, 35, 36}


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(
        f'[[keys]]\nid = "one"\nsecret = "{SECRET}"\nverbs = ["acquire", "admin"]\n'
        f'[[keys]]\nid = "two"\nsecret = "{OTHER}"\nverbs = ["acquire"]\n'
        'prefixes = ["reports/"]\n'
    )
    return path


def lane_of(app: Any) -> _FastLane | None:
    layer = getattr(app, "front", None) or app.middleware_stack
    while layer is not None and not isinstance(layer, _FastLane):
        layer = getattr(layer, "app", None)
    return layer


def normal(body: bytes) -> Any:
    """The answer without what differs by the moment (time left) or by chance (generated ids,
    numbered per process)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body

    def clean(x: Any) -> Any:
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                if k in ("expires_in", "remaining") and v is not None:
                    v = "<time>"
                elif k in ("request_id", "lease_id", "holder") and isinstance(v, str):
                    v = v if v.startswith("r-") else "<generated>"
                elif k == "message" and isinstance(v, str):
                    v = re.sub(r"[0-9a-f]{16,}", "<id>", v)
                out[k] = clean(v)
            return out
        return x

    return clean(doc)


def counters(text: str) -> dict[str, str]:
    """The metrics that count (not latencies, not creation times)."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith("fenced_") and "_seconds" not in name and "_created" not in name:
            out[name] = value
    return out


async def run_script(tmp_path: Path, fast: bool) -> tuple[list[tuple[int, Any]], set[int]]:
    settings = ServerSettings(
        url=f"sqlite:///{tmp_path / ('fast' if fast else 'slow')}.db",
        api_keys=load_api_keys(keys_file(tmp_path)),
        fast_lane=fast,
    )
    app = create_app(settings)
    answers, taken = [], set()
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        lane = None
        for i, (method, path, body, key) in enumerate(SCRIPT):
            before = lane.taken if lane is not None else 0
            headers = {"authorization": f"Bearer {key}"} if key else {}
            if isinstance(body, bytes):
                content = body
            else:
                content = json.dumps(body).encode() if body is not None else b""
            r = await client.request(method, path, content=content, headers=headers)
            answers.append((r.status_code, normal(r.content)))
            lane = lane_of(app)  # (built at the first request)
            if lane is not None and lane.taken > before:
                taken.add(i)
        metrics = await client.get("/metrics", headers={"authorization": f"Bearer {SECRET}"})
        answers.append((metrics.status_code, counters(metrics.text)))
    return answers, taken


@pytest.mark.asyncio
async def test_the_fast_lane_answers_what_fastapi_answers(tmp_path: Path) -> None:
    slow, none = await run_script(tmp_path, fast=False)
    fast, taken = await run_script(tmp_path, fast=True)
    assert none == set()  # (no lane in that app)
    for i, (a, b) in enumerate(zip(slow[:-1], fast[:-1], strict=True)):
        assert a == b, f"request {i} {SCRIPT[i][:2]}: FastAPI {a}, fast lane {b}"
    # and the same counters afterwards: every refusal counted once, by whichever path took it
    assert slow[-1] == fast[-1] and slow[-1][0] == 200
    assert fast[-1][1]['fenced_refused_requests_total{reason="unauthenticated"}'] == "2.0"
    statuses = [status for status, _ in fast]
    assert statuses.count(200) >= 8 and {400, 401, 403, 409, 410} <= set(statuses)
    assert taken == GOOD
    # the release asked again: true; without "retry" (or with null): false; 1, "yes": 400
    assert [fast[i] for i in (34, 35, 36)] == [(200, {"released": x}) for x in (True, False, False)]
    assert {fast[i][0] for i in (37, 38, 39)} == {400}


@pytest.mark.asyncio
async def test_the_comparison_catches_a_lane_that_answers_differently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: a lane that lets a bad ttl through as the default (as a sloppy parser would)."""
    original = _FastLane._model

    def sloppy(lane: Any, body: bytes) -> Any:
        try:
            data = json.loads(body)
        except ValueError:
            return original(lane, body)
        if isinstance(data, dict) and isinstance(data.get("ttl"), str):
            data.pop("ttl")
            return lane.model.model_validate(data).__dict__
        return original(lane, body)

    monkeypatch.setattr(_FastLane, "_model", staticmethod(sloppy))
    slow, _ = await run_script(tmp_path, fast=False)
    fast, _ = await run_script(tmp_path, fast=True)
    # the answer to request 9, and the counters (that refusal went uncounted)
    assert [i for i, (a, b) in enumerate(zip(slow, fast, strict=True)) if a != b] == [
        9,
        len(SCRIPT),
    ]


@pytest.mark.asyncio
async def test_the_comparison_catches_a_lane_that_counts_a_refusal_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: the lane's first version looked keys up through the counting path, so a bad
    key was counted there and again by FastAPI."""
    from fenced.server._app import _find_key
    from fenced.server._auth import Verb
    from fenced.server._wire import ApiError

    def counting(self: Any, headers: Any, name: str) -> Any:
        auth = [v for k, v in headers if k == b"authorization"]
        if len(auth) != 1:
            return False
        try:
            key = _find_key(self.keys, self.gw, auth[0].decode("latin-1"))
        except ApiError:
            return False
        return key if key is not None and key.allows(Verb.ACQUIRE, name) else False

    monkeypatch.setattr(_FastLane, "_key", counting)
    slow, _ = await run_script(tmp_path, fast=False)
    fast, _ = await run_script(tmp_path, fast=True)
    assert slow[:-1] == fast[:-1]  # every answer the same ...
    assert slow[-1] != fast[-1]  # ... and the double count caught in the counters


EXAMPLES = int(os.environ.get("FENCED_FUZZ_EXAMPLES", "250"))


def _short_lease(body: Any) -> bool:
    """A body asking for a lease short enough to expire between the two apps' answers."""
    if not isinstance(body, dict):
        return False
    ttl = body.get("ttl")
    return isinstance(ttl, int | float) and not isinstance(ttl, bool) and ttl < 30


def test_random_requests_get_the_same_answer_with_and_without_the_lane(tmp_path: Path) -> None:
    """Differential fuzz: the same random request (the API fuzz's bodies and headers, on the
    lane's three routes) to an app with the lane and to one without, in the same state."""
    _differential(tmp_path)


def test_the_differential_fuzz_catches_a_lane_that_takes_whitespace_for_no_body(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: the lane's first version, which read a blank body as "no body" (FastAPI: 400)."""
    original = _FastLane._model

    def blank_is_empty(lane: Any, body: bytes) -> Any:
        return original(lane, b"" if not body.strip() else body)

    monkeypatch.setattr(_FastLane, "_model", staticmethod(blank_is_empty))
    with pytest.raises(AssertionError, match="/v1/locks/inv/acquire"):
        _differential(tmp_path)


def _differential(tmp_path: Path) -> None:
    loop = asyncio.new_event_loop()
    apps, clients, lifespans = [], [], []
    for fast in (True, False):
        app = create_app(
            ServerSettings(
                url=f"sqlite:///{tmp_path / f'{fast}.db'}",
                api_keys=load_api_keys(keys_file(tmp_path)),
                max_wait=0.05,
                default_ttl=3600,  # (no lease may expire between the two apps' answers)
                fast_lane=fast,
            )
        )
        lifespan = app.router.lifespan_context(app)
        loop.run_until_complete(lifespan.__aenter__())
        apps.append(app)
        lifespans.append(lifespan)
        transport = httpx.ASGITransport(app=app)
        clients.append(httpx.AsyncClient(transport=transport, base_url="http://t"))
    key = {"authorization": f"Bearer {SECRET}"}
    keyed = st.one_of(st.just(key), st.just(key), headers)  # (mostly a key that may)

    async def both(verb: str, name: str, body: Any, hdrs: dict[str, Any]) -> None:
        raw = {"content": body} if isinstance(body, bytes) else {"json": body}
        path = f"/v1/locks/{name}/{verb}"
        a, b = [await c.post(path, headers=hdrs, **raw) for c in clients]
        assert (a.status_code, normal(a.content)) == (b.status_code, normal(b.content)), (
            path, body, hdrs, a.text, b.text,
        )  # fmt: skip

    @seed(20261125)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        database=None,
    )
    @given(
        st.sampled_from(["acquire", "renew", "release"]),
        st.sampled_from(["inv", "reports/daily", "a b", "x" * 300]),
        st.one_of(bodies, st.sampled_from([b" ", b"\n", b"\t{}", b"{} ", b"{}{}", b"0"])),
        keyed,
    )
    @example("acquire", "inv", b" ", key)  # (the lane's first version answered this wrongly)
    @example("acquire", "inv", b"", key)
    def fuzz(verb: str, name: str, body: Any, hdrs: dict[str, Any]) -> None:
        assume(not _short_lease(body))
        loop.run_until_complete(both(verb, name, body, hdrs))

    async def metrics() -> list[dict[str, str]]:
        auth = {"authorization": f"Bearer {SECRET}"}
        return [counters((await c.get("/metrics", headers=auth)).text) for c in clients]

    try:
        fuzz()
        fast, slow = loop.run_until_complete(metrics())
        assert fast == slow  # every refusal counted once, whichever path answered it
    finally:
        for client, lifespan in zip(clients, lifespans, strict=True):
            loop.run_until_complete(client.aclose())
            loop.run_until_complete(lifespan.__aexit__(None, None, None))
        loop.close()
