"""The hot path's shape (issue 28 §1): what makes ``fenced serve`` cheaper per grant, each
property checked on real objects (a real event loop, real sockets and pipes)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from pathlib import Path

import httpx
import pytest

from fenced.server._app import ServerSettings, create_app
from fenced.server._http import _Coalescing
from fenced.server._run import _PerTurnHandler


class _Counting(asyncio.Transport):
    """A real socket transport's writes, counted (the transport itself does the writing)."""

    def __init__(self, inner: asyncio.Transport) -> None:
        super().__init__()
        self.inner, self.writes = inner, 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes += 1
        self.inner.write(data)

    def is_closing(self) -> bool:
        return self.inner.is_closing()

    def close(self) -> None:
        self.inner.close()


async def test_an_answer_written_in_parts_leaves_in_one_write() -> None:
    """uvicorn writes an answer's head and body apart: two packets and two wake-ups of the
    client. Written in one turn of the loop, they leave in one write, in order; close()
    sends what is held before closing."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
    counting = _Counting(transport)
    out = _Coalescing(counting, loop)
    out.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    out.write(b"{}")
    assert counting.writes == 0  # (held until the turn ends)
    await asyncio.sleep(0)  # (one turn of the loop, not a wait for time)
    assert counting.writes == 1
    out.write(b"last")
    out.close()  # (held bytes first)
    assert counting.writes == 2
    theirs.setblocking(False)
    got = b""
    async with asyncio.timeout(30):  # (a bound, not a wait: it ends at the close)
        while piece := await loop.sock_recv(theirs, 65536):
            got += piece
    theirs.close()
    assert got == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}last"


async def test_transition_lines_leave_once_per_turn_and_others_at_once() -> None:
    """Each grant and release logs a line at the default level; written one system call
    each, they were a quarter of a busy server's CPU. fenced's info lines made in one turn
    leave together when it ends; any other line (uvicorn's last one before it re-raises
    SIGTERM, a warning) at once, with those before it."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    handler = _PerTurnHandler(w)
    handler.setFormatter(logging.Formatter("%(message)s"))

    def read() -> bytes:
        try:
            return os.read(r, 65536)
        except BlockingIOError:
            return b""

    def record(name: str, level: int, msg: str) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, msg, None, None)

    try:
        for i in range(3):
            handler.handle(record("fenced.server", logging.INFO, f"granted {i}"))
        assert read() == b""
        await asyncio.sleep(0)  # (the turn ends)
        assert read() == b"granted 0\ngranted 1\ngranted 2\n"
        handler.handle(record("fenced.server", logging.INFO, "released"))
        handler.handle(record("uvicorn.error", logging.INFO, "Application shutdown complete."))
        assert read() == b"released\nApplication shutdown complete.\n"
        handler.handle(record("fenced.server", logging.WARNING, "refused"))
        assert read() == b"refused\n"
    finally:
        handler.close()
        os.close(r)
        os.close(w)


@pytest.mark.asyncio
async def test_the_hot_path_is_answered_before_the_middleware_stack(tmp_path: Path) -> None:
    """acquire and release of a well-formed request are answered by the fast lane in front
    of Starlette's middleware stack (never built while only they come); anything else goes
    through the whole stack and is answered as FastAPI answers it."""
    app = create_app(ServerSettings(url=f"sqlite:///{tmp_path / 'locks.db'}"))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        for _ in range(3):
            g = (await client.post("/v1/locks/a/-/acquire", json={"ttl": 30})).json()
            r = await client.post(
                "/v1/locks/a/-/release",
                json={"token": g["token"], "request_id": g["request_id"]},
            )
            assert r.json() == {"released": True}
            assert r.headers["content-type"] == "application/json"
            assert int(r.headers["content-length"]) == len(r.content)
        assert app.middleware_stack is None  # (the stack was never needed)
        bad = await client.post("/v1/locks/a/-/acquire", json={"ttl": "thirty"})
        assert bad.status_code == 400 and bad.json()["error"] == "invalid_request"
        assert app.middleware_stack is not None
        metrics = (await client.get("/metrics")).text
    counts = [
        line
        for line in metrics.splitlines()
        if line.startswith("fenced_request_seconds_count")
        and 'route="/v1/locks/{name:lock}/-/acquire"' in line
    ]
    assert counts and float(counts[0].split()[-1]) == 4.0, counts  # (both paths timed)
    assert json.loads(json.dumps(g))["lock"] == "a"


@pytest.mark.asyncio
async def test_the_dashboard_has_an_icon_and_names_its_tile_truly(tmp_path: Path) -> None:
    """Issue 29 §4: a browser asks for /favicon.ico on every load (a 404 was a console error
    each time); the tile of fenced_leases_tracked counts the grants this gateway tracks, not
    renewals."""
    app = create_app(ServerSettings(url=f"sqlite:///{tmp_path / 'locks.db'}"))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        icon = await client.get("/favicon.ico")
        assert icon.status_code == 200, icon.text
        assert icon.headers["content-type"] == "image/svg+xml"
        assert icon.content.startswith(b"<svg") and icon.content.endswith(b"</svg>")
        page = (await client.get("/")).text
        assert '<link rel="icon" type="image/svg+xml" href="/favicon.ico">' in page
        assert "grants tracked by this gateway" in page and "renewed here" not in page
        assert "/favicon.ico" not in (await client.get("/openapi.json")).json()["paths"]
