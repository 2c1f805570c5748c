"""What FencingMiddleware adds to a request: a trivial endpoint called in-process, with and without.

    .venv/bin/python bench/bench_guard_asgi.py [--n 3000]

Each row calls the same endpoint directly through ASGI (no server, no sockets: only the
middleware and its store are measured), the fenced and the plain call alternating one by one.
Every fenced call carries a new, higher token, so every call advances (writes) the mark.

Stores:

* SQLite, synchronous=FULL (default): every accepted token fsync'd; runs on the store's
  worker thread (thread hand-off + fsync).
* SQLite, synchronous=NORMAL (WAL): not fsync'd per commit (durable against a process crash,
  not power loss); the commit runs inline on the event loop (~20 µs).
* PostgreSQL (fsync on, synchronous_commit on) and Redis (AOF appendfsync always), loopback.

Target: ≤ 100 µs added p50 with an SQLite store (met with NORMAL; FULL pays an fsync).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import redis.asyncio
from _common import Result, fmt_us, table
from rich.console import Console
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from fenced.guards.asgi import (
    FencingMiddleware,
    PostgresFenceStore,
    RedisFenceStore,
    SQLiteFenceStore,
)
from fenced.testing.servers import PostgresServer, RedisServer

LOCK = "bench"


async def raw_endpoint(scope: Any, receive: Any, send: Any) -> None:
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


def starlette_endpoint() -> Starlette:
    async def ok(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/jobs", ok, methods=["POST"])])


def caller(app: Any, tokens: itertools.count[int] | None) -> Callable[[], Awaitable[None]]:
    """One POST /jobs through ``app``; with ``tokens``, carrying the next fencing token."""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    status: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    base = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/jobs",
        "raw_path": b"/jobs",
        "query_string": b"",
        "root_path": "",
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
    }

    async def call() -> None:
        headers = [(b"host", b"bench")]
        if tokens is not None:
            headers.append((b"fencing-token", f"{LOCK}:{next(tokens)}".encode()))
        await app({**base, "headers": headers}, receive, send)
        if status.pop() != 200:
            raise RuntimeError("request refused")

    return call


async def alternate(
    ours: Callable[[], Awaitable[None]],
    peer: Callable[[], Awaitable[None]],
    n: int,
    names: tuple[str, str],
    warmup: int = 100,
) -> tuple[Result, Result]:
    for _ in range(warmup):
        await ours()
        await peer()
    a, b = Result(names[0]), Result(names[1])
    clock = time.perf_counter
    for i in range(n):
        for op, res in ((ours, a), (peer, b)) if i % 2 == 0 else ((peer, b), (ours, a)):
            t0 = clock()
            await op()
            res.samples.append(clock() - t0)
    for r in (a, b):
        r.ops = len(r.samples)
        r.elapsed = sum(r.samples)
    return a, b


async def run(n: int) -> None:
    rows: list[tuple[str, Result, Result]] = []
    added: list[tuple[str, float]] = []

    async def row(what: str, store: Any, app: Any, name: str, peer_name: str, count: int) -> None:
        mw = FencingMiddleware(app, store=store, lock=LOCK, resource=lambda scope: "jobs")
        ours, peer = await alternate(
            caller(mw, itertools.count(1)), caller(app, None), count, (name, peer_name)
        )
        rows.append((what, ours, peer))
        added.append((what, ours.p50 - peer.p50))

    with tempfile.TemporaryDirectory() as tmp:
        raw, star = raw_endpoint, starlette_endpoint()
        for sync in ("NORMAL", "FULL"):
            for inline in (True, False):
                if sync == "FULL" and inline:
                    continue  # never: an fsync on the event loop
                path = os.path.join(tmp, f"{sync}-{inline}.db")
                async with SQLiteFenceStore(path, synchronous=sync, inline=inline) as store:  # type: ignore[arg-type]
                    where = "inline" if inline else "thread"
                    await row(
                        f"raw ASGI, SQLite {sync} ({where})",
                        store,
                        raw,
                        "+middleware",
                        "raw endpoint",
                        n,
                    )
                    if sync == "NORMAL" and inline:
                        path2 = os.path.join(tmp, "star.db")
                        async with SQLiteFenceStore(path2, synchronous=sync) as store2:  # type: ignore[arg-type]
                            await row(
                                f"Starlette, SQLite {sync} ({where})",
                                store2,
                                star,
                                "+middleware",
                                "Starlette app",
                                n,
                            )
        with PostgresServer() as pg, RedisServer() as rs:
            async with PostgresFenceStore(pg.dsn, pool_size=1) as store:
                await row(
                    "raw ASGI, PostgreSQL",
                    store,
                    raw,
                    "+middleware",
                    "raw endpoint",
                    max(n // 2, 200),
                )
            client = redis.asyncio.Redis.from_url(rs.url)
            try:
                await row(
                    "raw ASGI, Redis (AOF always)",
                    RedisFenceStore(client),
                    raw,
                    "+middleware",
                    "raw endpoint",
                    max(n // 2, 200),
                )
            finally:
                await client.aclose()

    table(
        "fenced.guards.asgi — endpoint with FencingMiddleware vs without (in-process ASGI calls)",
        rows,
        note="ratio = fenced ops/s ÷ plain ops/s; every fenced call advances the mark (a write).",
    )
    console = Console(width=160)
    for what, delta in added:
        console.print(f"added p50 latency, {what}: {fmt_us(delta)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=3000)
    args = parser.parse_args()
    asyncio.run(run(args.n))


if __name__ == "__main__":
    main()
