"""``fenced serve`` under concurrent clients, side by side with the library and with etcd.

(a) Grants/s (acquire+release, each client on its own lock) at 1, 16 and 64 concurrent
    clients, one asyncio process of clients: through a ``fenced serve`` process on the SQLite
    source (plain HTTP/JSON requests, as any language sends them), the library directly on the
    same kind of file, and etcd's own lock (aetcd ``Lock``, single member, fsync on).
(b) Group commit at 64 clients: grants per fsync, counted by ``strace -f`` on the server
    process (fdatasync + fsync), and grants/s against a single-member etcd's plain ``put``
    at the same concurrency (target ≥ 1.5×; grants per fsync target ≥ 20).
(c) ``--leases N --seconds S`` (default in CI-sized runs: 2,000 for 20 s; the issue's figure:
    ``--leases 10000 --seconds 300``): N leases held through one server process pinned to one
    core, each renewed by the Python client's lease core every ttl/3; reports false
    expirations (leases lost while their holder kept renewing: must be 0) and the server's
    memory per lease.

Run: ``.venv/bin/python bench/bench_server.py [--leases N --seconds S] [--only a,b,c]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import aetcd
import httpx
from _common import Result, table

import fenced
from fenced.testing.servers import EtcdServer, FencedServer

Op = Callable[[int], Awaitable[None]]


async def run_clients(name: str, clients: int, seconds: float, op: Op) -> Result:
    """``clients`` tasks each looping ``op(i)`` for ``seconds``; per-op latencies."""
    res = Result(name)
    clock = time.perf_counter
    stop = clock() + seconds

    async def one(i: int) -> None:
        while clock() < stop:
            t0 = clock()
            await op(i)
            res.samples.append(clock() - t0)

    start = clock()
    await asyncio.gather(*(one(i) for i in range(clients)))
    res.elapsed = clock() - start
    res.ops = len(res.samples)
    return res


# -- the three sides ------------------------------------------------------------------------------


def http_side(base: str, client: httpx.AsyncClient) -> Op:
    run = uuid.uuid4().hex[:6]

    async def op(i: int) -> None:
        r = await client.post(f"{base}/v1/locks/b{run}-{i}/acquire", json={"ttl": 30})
        g = r.json()
        await client.post(
            f"{base}/v1/locks/b{run}-{i}/release",
            json={"token": g["token"], "request_id": g["request_id"]},
        )

    return op


def library_side(locks: fenced.AsyncLocks) -> Op:
    run = uuid.uuid4().hex[:6]

    async def op(i: int) -> None:
        async with locks.lock(f"l{run}-{i}", ttl=30):
            pass

    return op


def etcd_lock_side(conn: Any) -> Op:
    run = uuid.uuid4().hex[:6]

    async def op(i: int) -> None:
        lock = conn.lock(f"/bench/srv/{run}-{i}".encode(), ttl=30)
        await lock.acquire(timeout=None)
        await lock.release()

    return op


def etcd_put_side(conn: Any) -> Op:
    run = uuid.uuid4().hex[:6]

    async def op(i: int) -> None:
        await conn.put(f"/bench/put/{run}-{i}".encode(), b"x")

    return op


async def throughput(gateway: FencedServer, etcd: EtcdServer, root: str, seconds: float) -> None:
    rows = []
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    async with (
        httpx.AsyncClient(limits=limits, timeout=60) as http,
        fenced.connect_async(f"sqlite:///{root}/direct.db") as locks,
    ):
        conn = aetcd.Client(host="127.0.0.1", port=etcd.port)
        await conn.connect()
        try:
            for clients in (1, 16, 64):
                served = await run_clients(
                    f"fenced serve (sqlite), {clients}",
                    clients,
                    seconds,
                    http_side(gateway.url, http),
                )
                direct = await run_clients(
                    f"library (sqlite), {clients}", clients, seconds, library_side(locks)
                )
                peer = await run_clients(
                    f"etcd Lock, {clients}", clients, seconds, etcd_lock_side(conn)
                )
                rows.append((f"{clients} clients: server vs etcd Lock", served, peer))
                rows.append((f"{clients} clients: library vs etcd Lock", direct, peer))
        finally:
            await conn.close()
    table(
        f"(a) grants/s (acquire+release, a lock per client), {seconds:.0f} s per row",
        rows,
        note="server: one `fenced serve` process (uvicorn) on the SQLite source, clients send "
        "plain HTTP/JSON from one asyncio process; library: fenced.connect_async on a SQLite "
        "file in the same process; etcd Lock: aetcd's recipe on a single-member etcd.",
    )


async def group_commit(gateway: FencedServer, etcd: EtcdServer, seconds: float) -> None:
    assert gateway.proc is not None
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    tracer = None
    if shutil.which("strace"):
        out = tempfile.NamedTemporaryFile(suffix=".strace", delete=False)  # noqa: SIM115
        tracer = subprocess.Popen(
            [
                "strace",
                "-f",
                "-c",
                "-e",
                "trace=fsync,fdatasync",
                "-o",
                out.name,
                "-p",
                str(gateway.proc.pid),
            ],
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # (strace attaches to every thread)
    async with httpx.AsyncClient(limits=limits, timeout=60) as http:
        served = await run_clients("fenced serve, 64", 64, seconds, http_side(gateway.url, http))
    fsyncs = None
    if tracer is not None:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
        with open(out.name) as f:
            text = f.read()
        os.unlink(out.name)
        calls = re.findall(
            r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?f(?:data)?sync$", text, re.M
        )
        fsyncs = sum(int(c) for c in calls)
    conn = aetcd.Client(host="127.0.0.1", port=etcd.port)
    await conn.connect()
    try:
        puts = await run_clients("etcd put, 64", 64, seconds, etcd_put_side(conn))
    finally:
        await conn.close()
    per_fsync = f"{served.ops / fsyncs:.1f}" if fsyncs else "n/a (no strace)"
    table(
        f"(b) group commit: 64 clients, {seconds:.0f} s (target: ≥ 1.5× etcd put, ≥ 20 grants "
        "per fsync)",
        [("grants/s vs single-member etcd put/s", served, puts)],
        note=f"grants per fsync through the server: {per_fsync} ({served.ops} grants, "
        f"{fsyncs} fsyncs counted by strace -f on the server process; each grant is an acquire "
        "and a release transaction).",
    )


# -- (c) many live leases ------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def live_leases(gateway: FencedServer, n: int, seconds: float, ttl: float) -> None:
    assert gateway.proc is not None
    before = rss_kib(gateway.proc.pid)
    lost: list[str] = []
    leases: list[Any] = []
    async with fenced.connect_async(gateway.url, request_timeout=60) as locks:
        sem = asyncio.Semaphore(64)

        async def take(i: int) -> None:
            async with sem:
                lease = locks.lock(
                    f"live/{i}", ttl=ttl, on_lost=lambda lease: lost.append(lease.name)
                )
                await lease.acquire(timeout=120)
                leases.append(lease)

        t0 = time.monotonic()
        await asyncio.gather(*(take(i) for i in range(n)))
        taken = time.monotonic() - t0
        during = rss_kib(gateway.proc.pid)
        start = time.monotonic()
        samples = 0
        while time.monotonic() - start < seconds:
            await asyncio.sleep(min(5.0, seconds))
            samples += 1
        held = sum(1 for lease in leases if lease.held)
        after = rss_kib(gateway.proc.pid)
    print(
        f"(c) {n:,} live leases (ttl {ttl:g} s, renewed every ttl/3 by the client's lease core, "
        f"~{n / (ttl / 3):,.0f} renewals/s) through one server process pinned to one core, "
        f"held {seconds:.0f} s: taken in {taken:.1f} s; false expirations: {len(lost)}; still "
        f"held at the end: {held:,}; server memory {before / 1024:.0f} MiB idle, "
        f"{during / 1024:.0f} MiB with the leases, {after / 1024:.0f} MiB at the end: "
        f"{(after - before) * 1024 / n:,.0f} bytes per lease."
    )


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=20.0, help="(c): how long leases are held")
    p.add_argument("--leases", type=int, default=2000)
    p.add_argument("--ttl", type=float, default=30.0)
    p.add_argument("--row-seconds", type=float, default=float(os.environ.get("BENCH_SECONDS", 4)))
    p.add_argument("--only", default="a,b,c")
    args = p.parse_args()
    parts = set(args.only.split(","))
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/var/tmp")) as root:
        etcd = EtcdServer()
        etcd.start()
        gateway = FencedServer(f"sqlite:///{root}/served.db")
        gateway.start()
        try:
            if "a" in parts:
                await throughput(gateway, etcd, root, args.row_seconds)
            if "b" in parts:
                await group_commit(gateway, etcd, args.row_seconds * 2)
            if "c" in parts:
                gateway.stop()
                pinned = FencedServer(f"sqlite:///{root}/live.db")
                pinned_cmd = pinned.command

                def on_one_core() -> list[str]:
                    return ["taskset", "-c", "0", *pinned_cmd()]

                pinned.command = on_one_core  # type: ignore[method-assign]
                pinned.start()
                try:
                    await live_leases(pinned, args.leases, args.seconds, args.ttl)
                finally:
                    pinned.close()
        finally:
            gateway.close()
            etcd.close()


if __name__ == "__main__":
    asyncio.run(main())
