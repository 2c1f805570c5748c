"""``fenced serve`` under concurrent clients, side by side with the library and with etcd.

(a) Grants/s (acquire+release, each client on its own lock) at 1, 16 and 64 concurrent
    clients, one asyncio process of clients: through a ``fenced serve`` process on the SQLite
    source (plain HTTP/JSON requests, as any language sends them), the library directly on the
    same kind of file, and etcd's own lock (aetcd ``Lock``, single member, fsync on).
(b) Group commit at 64 clients: grants per fsync, counted by ``strace -f`` on the server
    process (fdatasync + fsync), and grants/s against a single-member etcd's plain ``put``
    at the same concurrency (target ≥ 1.5×; grants per fsync target ≥ 20); the library and
    etcd's ``put`` take turns in short slices, so that the machine's drift hits both alike.
(c) ``--leases N --seconds S`` (default: 2,000 for 20 s; the issue's figure: ``--leases
    10000 --seconds 300``): N leases held through one server process pinned to one core, each
    renewed every ttl/3 over plain HTTP by 32 keep-alive connections (the load generator
    must not be the bottleneck: 10,000 leases of the Python client's lease core over httpx
    need more than this machine's other core); reports false expirations (a renewal refused
    although sent on time: must be 0), the largest gap between two renewals of one lease,
    and the server's memory per lease.

Run: ``.venv/bin/python bench/bench_server.py [--leases N --seconds S] [--only a,b,c]``.

etcd's ``Lock`` here is aetcd's client-side recipe; the server against etcd's server-side lock
service (v3lock), with a load generator independent of fenced, is ``bench_http_peer.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
SLICES = 4  # (b): the library and etcd's put take turns, this many slices each


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


class RawHttp:
    """One keep-alive HTTP/1.1 connection per client, written by hand: the benchmark's load
    generator must cost less than the server (httpx's pool spent more CPU than the server
    at 64 connections and became what was measured)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conns: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    async def post(self, i: int, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if i not in self.conns:
            self.conns[i] = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.conns[i]
        data = json.dumps(body).encode()
        writer.write(
            f"POST {path} HTTP/1.1\r\nhost: b\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n\r\n".encode()
            + data
        )
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1])  # type: ignore[index]
        reply: dict[str, Any] = json.loads(await reader.readexactly(length))
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"{path}: {head.splitlines()[0]!r} {reply}")
        return reply

    async def close(self) -> None:
        for _, writer in self.conns.values():
            writer.close()


def http_side(client: RawHttp) -> Op:
    run = uuid.uuid4().hex[:6]

    async def op(i: int) -> None:
        g = await client.post(i, f"/v1/locks/b{run}-{i}/acquire", {"ttl": 30})
        await client.post(
            i,
            f"/v1/locks/b{run}-{i}/release",
            {"token": g["token"], "request_id": g["request_id"]},
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
    async with fenced.connect_async(f"sqlite:///{root}/direct.db") as locks:
        conn = aetcd.Client(host="127.0.0.1", port=etcd.port)
        await conn.connect()
        try:
            for clients in (1, 16, 64):
                http = RawHttp(gateway.port)  # (fresh: the server closes idle connections)
                try:
                    served = await run_clients(
                        f"fenced serve (sqlite), {clients}", clients, seconds, http_side(http)
                    )
                finally:
                    await http.close()
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
        "plain HTTP/1.1 keep-alive requests from one asyncio process (a connection each); library: fenced.connect_async on a SQLite "
        "file in the same process; etcd Lock: aetcd's recipe on a single-member etcd.",
    )


def source_commits(gateway: FencedServer) -> int:
    """The server's fenced_source_commits_total (the SQLite source's write commits)."""
    text = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    return int(float(re.search(r"^fenced_source_commits_total (\S+)$", text, re.M)[1]))  # type: ignore[index]


async def group_commit(gateway: FencedServer, etcd: EtcdServer, root: str, seconds: float) -> None:
    assert gateway.proc is not None
    # At full speed first: commits counted by the source itself (strace slows the server).
    http = RawHttp(gateway.port)
    try:
        before = source_commits(gateway)
        fast = await run_clients("fenced serve, 64", 64, seconds, http_side(http))
        served_commits = source_commits(gateway) - before
    finally:
        await http.close()
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
    http = RawHttp(gateway.port)
    try:
        served = await run_clients("fenced serve, 64", 64, seconds, http_side(http))
    finally:
        await http.close()
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
    # The library and etcd's put take turns in short slices, so that drift in the machine's
    # speed (a third within an afternoon on this VM) hits both alike.
    conn = aetcd.Client(host="127.0.0.1", port=etcd.port)
    await conn.connect()
    try:
        async with fenced.connect_async(f"sqlite:///{root}/group.db") as locks:
            backend: Any = await locks._get_backend()
            before = backend.commits
            direct, puts = Result("library (sqlite), 64"), Result("etcd put, 64")
            lib_op, put_op = library_side(locks), etcd_put_side(conn)
            for _ in range(SLICES):
                for total, op in ((direct, lib_op), (puts, put_op)):
                    part = await run_clients(total.name, 64, seconds / SLICES, op)
                    total.samples += part.samples
                    total.elapsed += part.elapsed
                    total.ops += part.ops
            commits = backend.commits - before
    finally:
        await conn.close()
    per_fsync = f"{served.ops / fsyncs:.1f}" if fsyncs else "n/a (no strace)"
    table(
        f"(b) group commit: 64 clients, {seconds:.0f} s (target: ≥ 1.5× etcd put, ≥ 20 grants "
        "per fsync)",
        [
            ("grants/s vs single-member etcd put/s", fast, puts),
            ("grants/s vs single-member etcd put/s (server under strace)", served, puts),
            ("grants/s vs single-member etcd put/s", direct, puts),
        ],
        note=f"grants per commit through the server at full speed: "
        f"{fast.ops / max(1, served_commits):.1f} ({fast.ops} grants, {served_commits} commits "
        f"by the source's own count); grants per fsync through the server under strace: "
        f"{per_fsync} ({served.ops} grants, {fsyncs} fsyncs counted by strace -f on the server "
        "process); in the library: "
        f"{direct.ops / max(1, commits):.1f} ({direct.ops} grants, {commits} commits, one fsync "
        "each). Each grant is an acquire and a release transaction.",
    )


# -- (c) many live leases ------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def live_leases(gateway: FencedServer, n: int, seconds: float, ttl: float) -> None:
    """``n`` leases taken and kept alive through plain HTTP by 32 keep-alive connections: every
    lease renewed every ttl/3. A renewal answered 410 is a false expiration (its holder
    renewed on time); the largest gap between two renewals of one lease shows it did."""
    assert gateway.proc is not None
    before = rss_kib(gateway.proc.pid)
    http = RawHttp(gateway.port)
    workers = 32
    held: dict[int, dict[str, Any]] = {}
    last_renewed: dict[int, float] = {}
    worst_gap = 0.0
    expired: list[str] = []
    try:

        async def take(w: int) -> None:
            for i in range(w, n, workers):
                held[i] = await http.post(w, f"/v1/locks/live/{i}/acquire", {"ttl": ttl})
                last_renewed[i] = time.monotonic()

        t0 = time.monotonic()
        await asyncio.gather(*(take(w) for w in range(workers)))
        taken = time.monotonic() - t0
        during = rss_kib(gateway.proc.pid)
        period = ttl / 3
        end = time.monotonic() + seconds
        renewals = 0

        async def keep(w: int) -> None:
            nonlocal worst_gap, renewals
            mine = list(range(w, n, workers))
            while time.monotonic() < end:
                round_start = time.monotonic()
                for k, i in enumerate(mine):
                    # spread each round over the period, as independent holders would be
                    due = round_start + period * k / len(mine)
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    g = held[i]
                    try:
                        await http.post(
                            w,
                            f"/v1/locks/live/{i}/renew",
                            {"token": g["token"], "request_id": g["request_id"]},
                        )
                    except RuntimeError as exc:
                        expired.append(f"{i}: {exc}")
                    now = time.monotonic()
                    worst_gap = max(worst_gap, now - last_renewed[i])
                    last_renewed[i] = now
                    renewals += 1

        t1 = time.monotonic()
        await asyncio.gather(*(keep(w) for w in range(workers)))
        rate = renewals / (time.monotonic() - t1)
        after = rss_kib(gateway.proc.pid)
    finally:
        await http.close()
    print(
        f"(c) {n:,} live leases (ttl {ttl:g} s, each renewed every {ttl / 3:g} s: "
        f"{rate:,.0f} renewals/s) through one `fenced serve` process pinned to one core, "
        f"held {seconds:.0f} s: taken in {taken:.1f} s; false expirations: {len(expired)}; "
        f"largest gap between two renewals of one lease: {worst_gap:.1f} s; server memory "
        f"{before / 1024:.0f} MiB idle, {during / 1024:.0f} MiB with the leases, "
        f"{after / 1024:.0f} MiB at the end: {(after - before) * 1024 / n:,.0f} bytes per lease."
    )
    if expired:
        print("  first expirations:", "; ".join(expired[:3]))


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
                await group_commit(gateway, etcd, root, args.row_seconds * 2)
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
