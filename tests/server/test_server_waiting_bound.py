"""``--max-waiting-per-client``: the acquires one client may have waiting (long polls) at
once. Each place is given back however its acquire ends — granted, timed out, the client
gone, the request cancelled, the server stopping — or a worker pool would be locked out for
good; one client's bound leaves another's alone; an acquire answered at once never counts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from fenced.server._app import ServerSettings, create_app
from fenced.server._auth import load_api_keys
from tests.server.test_direct_lane import Served, read_answer, request, serving
from tests.server.test_server_fast_lane import OTHER, SECRET, keys_file


def _settings(tmp_path: Path, **kw: Any) -> ServerSettings:
    return ServerSettings(url=f"sqlite:///{tmp_path / 'locks.db'}", max_waiting_per_client=2, **kw)


async def _until(cond: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(10):  # (bounded: the server works on its own tasks)
        while not cond():
            await asyncio.sleep(0.01)


def _held(served: Served) -> dict[str, int]:
    return dict(served.app.state.waiting.held)


async def _wait_on(served: Served, lock: str, rid: str, timeout: float = 30, **h: str) -> Any:
    """A waiting acquire of ``lock`` on a connection of its own: (reader, writer)."""
    reader, writer = await served.connect()
    body = json.dumps({"ttl": 10, "timeout": timeout, "request_id": rid}).encode()
    writer.write(request(f"/v1/locks/{lock}/-/acquire", body, **h))
    await writer.drain()
    return reader, writer


async def _take(served: Served, lock: str, **h: str) -> dict[str, Any]:
    reader, writer = await served.connect()
    writer.write(request(f"/v1/locks/{lock}/-/acquire", b'{"ttl": 30, "request_id": "h"}', **h))
    status, _, body = await read_answer(reader)
    writer.close()
    assert status == b"HTTP/1.1 200 OK", body
    answer: dict[str, Any] = json.loads(body)
    return answer


async def _at_bound(served: Served, lock: str, who: str, **h: str) -> list[Any]:
    """Two waiting acquires of ``lock`` (held), then a third refused 429."""
    conns = [await _wait_on(served, lock, f"w{i}", **h) for i in range(2)]
    await _until(lambda: _held(served).get(who) == 2, "two places taken")
    reader, writer = await _wait_on(served, lock, "w9", **h)
    status, headers, body = await read_answer(reader)
    writer.close()
    assert status == b"HTTP/1.1 429 Too Many Requests", body
    assert (b"retry-after", b"1") in headers
    assert json.loads(body)["error"] == "too_many_waiting"
    return conns


WHO = "address 127.0.0.1"


async def test_a_place_is_given_back_when_its_acquire_is_granted(tmp_path: Path) -> None:
    async with serving(_settings(tmp_path)) as served:
        held = await _take(served, "g")
        conns = await _at_bound(served, "g", WHO)
        reader, writer = await served.connect()
        writer.write(request("/v1/locks/g/-/release", json.dumps(
            {"token": held["token"], "request_id": "h"}).encode()))  # fmt: skip
        assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
        await _until(lambda: _held(served).get(WHO) == 1, "the granted one's place back")
        # The rightful next one waits again (under the bound) and is granted in its turn.
        again = await _wait_on(served, "g", "w-again")
        await _until(lambda: _held(served).get(WHO) == 2, "waiting again")
        for _, writer in [*conns, again]:
            writer.close()
        await _until(lambda: _held(served) == {}, "every place back")


async def test_a_place_is_given_back_when_its_acquire_times_out(tmp_path: Path) -> None:
    async with serving(_settings(tmp_path)) as served:
        await _take(served, "t")
        conns = [await _wait_on(served, "t", f"w{i}", timeout=0.5) for i in range(2)]
        for reader, writer in conns:
            status, _, body = await read_answer(reader)
            assert status == b"HTTP/1.1 409 Conflict" and b'"timeout"' in body, body
            writer.close()
        assert _held(served) == {}
        conns = await _at_bound(served, "t", WHO)  # (the bound whole again)
        for _, writer in conns:
            writer.close()


async def test_a_place_is_given_back_when_its_client_leaves(tmp_path: Path) -> None:
    async with serving(_settings(tmp_path)) as served:
        await _take(served, "d")
        for _, writer in await _at_bound(served, "d", WHO):
            writer.close()
        await _until(lambda: _held(served) == {}, "the places of clients gone")
        waiters = (await served.app.state.gateway.backend.status("d")).waiters
        assert waiters == 0  # (they left the queue too)
        for _, writer in await _at_bound(served, "d", WHO):
            writer.close()


async def test_a_place_is_given_back_when_its_request_is_cancelled(tmp_path: Path) -> None:
    app: Any = create_app(_settings(tmp_path))
    transport = httpx.ASGITransport(app=app, client=("10.0.0.7", 4000))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c,
    ):
        assert (await c.post("/v1/locks/c/-/acquire", json={"ttl": 30})).status_code == 200
        who = "address 10.0.0.7"

        def waiting(rid: str) -> Awaitable[httpx.Response]:
            return c.post("/v1/locks/c/-/acquire", json={"timeout": 30, "request_id": rid})

        tasks = [asyncio.create_task(waiting(f"w{i}")) for i in range(2)]
        await _until(lambda: app.state.waiting.held.get(who) == 2, "two waiting")
        refused = await waiting("w9")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _until(lambda: app.state.waiting.held == {}, "the cancelled ones' places")
        again = asyncio.create_task(waiting("w-again"))
        await _until(lambda: app.state.waiting.held.get(who) == 1, "waiting again")
        again.cancel()
        await asyncio.gather(again, return_exceptions=True)


async def test_a_place_is_given_back_when_the_server_stops(tmp_path: Path) -> None:
    async with serving(_settings(tmp_path)) as served:
        await _take(served, "s")
        conns = await _at_bound(served, "s", WHO)
        # What SIGTERM does under fenced serve (_run.serve): uvicorn's graceful stop, and the
        # gateway's stopping, which answers long polls 503 at once.
        served.server.should_exit = True
        served.app.state.gateway.stopping.set()
        for reader, writer in conns:
            status, _, body = await read_answer(reader)
            assert status == b"HTTP/1.1 503 Service Unavailable", body
            writer.close()
        assert _held(served) == {}


async def test_the_bound_is_one_keys_and_leaves_anothers_alone(tmp_path: Path) -> None:
    """Counted per API key (as watches are): key "one" at its bound is refused, key "two"
    (another client, the same address) still waits and is granted; an acquire of "one"
    answered at once is served at its bound, and is not a place."""
    keys = load_api_keys(str(keys_file(tmp_path)))
    async with serving(_settings(tmp_path, api_keys=keys)) as served:
        one = {"authorization": f"Bearer {SECRET}"}
        two = {"authorization": f"Bearer {OTHER}"}
        held = await _take(served, "reports/k", **one)
        conns = await _at_bound(served, "reports/k", "key one", **one)
        reader, writer = await _wait_on(served, "reports/k", "t1", **two)
        await _until(lambda: _held(served).get("key two") == 1, "two's acquire waiting")
        conns.append((reader, writer))
        free = await _take(served, "reports/free", **one)  # (at once: served, no place)
        assert free["token"] == "reports/free:1" and _held(served)["key one"] == 2
        # A try-once (no timeout) of the held lock at the bound: its own answer, 409 timeout.
        r1, w1 = await served.connect()
        w1.write(request("/v1/locks/reports/k/-/acquire", b'{"request_id": "once"}', **one))
        status, _, body = await read_answer(r1)
        w1.close()
        assert status == b"HTTP/1.1 409 Conflict" and json.loads(body)["error"] == "timeout"
        # A release: the first in line ("one"'s first) is granted, and its place given back.
        r2, w2 = await served.connect()
        w2.write(request("/v1/locks/reports/k/-/release", json.dumps(
            {"token": held["token"], "request_id": "h"}).encode(), **one))  # fmt: skip
        assert (await read_answer(r2))[0] == b"HTTP/1.1 200 OK"
        w2.close()
        status, _, body = await read_answer(conns[0][0])
        assert status == b"HTTP/1.1 200 OK" and json.loads(body)["request_id"] == "w0", body
        await _until(lambda: _held(served).get("key one") == 1, "its place back")
        for _, writer in conns:
            writer.close()


async def test_no_bound_with_zero(tmp_path: Path) -> None:
    """``--max-waiting-per-client 0``: no bound (a place is still counted, and given back)."""
    settings = ServerSettings(url=f"sqlite:///{tmp_path / 'locks.db'}", max_waiting_per_client=0)
    async with serving(settings) as served:
        await _take(served, "z")
        conns = [await _wait_on(served, "z", f"w{i}") for i in range(5)]
        await _until(lambda: _held(served).get(WHO) == 5, "five waiting")
        for _, writer in conns:
            writer.close()
        await _until(lambda: _held(served) == {}, "every place back")
