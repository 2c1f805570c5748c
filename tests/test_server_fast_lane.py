"""The server's fast lane (acquire, renew, release without FastAPI's layers) answers exactly
what the FastAPI routes answer: the same script of requests — good ones, and every kind of
bad body, key and name — sent to two apps on two fresh sources, one with the lane and one
without, gets the same statuses and bodies; good requests take the lane, bad ones do not."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from fenced.server._app import ServerSettings, _FastLane, create_app
from fenced.server._auth import load_api_keys

SECRET, OTHER = "s3cret-key-number-one", "s3cret-key-number-two"

# (method, path, body as raw bytes or JSON-able, key)
SCRIPT: list[tuple[str, str, Any, str | None]] = [
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5, "request_id": "r-1"}, SECRET),
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5, "request_id": "r-1"}, SECRET),  # same grant
    ("POST", "/v1/locks/inv/acquire", {"ttl": 5}, SECRET),  # busy: 409
    ("POST", "/v1/locks/inv/acquire", None, SECRET),  # no body: defaults, busy
    ("POST", "/v1/locks/inv/acquire", b"", SECRET),
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
]
# Taken by the lane: bodies that validate, from a key allowed on the lock — including the
# handlers' own refusals (a ttl out of range, a bad request id or lock name, another lock's
# token), answered there by the same code. Bad bodies, missing or wrong keys, other routes: not.
GOOD = {0, 1, 2, 3, 4, 10, 11, 13, 14, 19, 20, 21, 22, 23, 27, 28, 29, 30}


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(
        f'[[keys]]\nid = "one"\nsecret = "{SECRET}"\nverbs = ["acquire", "admin"]\n'
        f'[[keys]]\nid = "two"\nsecret = "{OTHER}"\nverbs = ["acquire"]\n'
        'prefixes = ["reports/"]\n'
    )
    return path


def lane_of(app: Any) -> _FastLane | None:
    layer = app.middleware_stack
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
    return answers, taken


@pytest.mark.asyncio
async def test_the_fast_lane_answers_what_fastapi_answers(tmp_path: Path) -> None:
    slow, none = await run_script(tmp_path, fast=False)
    fast, taken = await run_script(tmp_path, fast=True)
    assert none == set()  # (no lane in that app)
    for i, (a, b) in enumerate(zip(slow, fast, strict=True)):
        assert a == b, f"request {i} {SCRIPT[i][:2]}: FastAPI {a}, fast lane {b}"
    statuses = [status for status, _ in fast]
    assert statuses.count(200) >= 8 and {400, 401, 403, 409, 410} <= set(statuses)
    assert taken == GOOD


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
            return lane.model.model_validate(data)
        return original(lane, body)

    monkeypatch.setattr(_FastLane, "_model", staticmethod(sloppy))
    slow, _ = await run_script(tmp_path, fast=False)
    fast, _ = await run_script(tmp_path, fast=True)
    assert [i for i, (a, b) in enumerate(zip(slow, fast, strict=True)) if a != b] == [8]
