"""fenced's ZooKeeper lock vs kazoo's own ``Lock`` recipe, on one ZooKeeper server.

    .venv/bin/python bench/bench_zookeeper.py [--n 600] [--seconds 3] [--rounds 3]

Rows (fenced = ``zookeeper://`` through the lease API, peer = ``kazoo.recipe.lock.Lock`` on a
plain ``KazooClient``; same server, same machine):

* uncontended acquire+release, one client. fenced async (``AsyncLocks``) and fenced sync
  (``Locks``, i.e. through the private loop thread) are each alternated call by call with the
  native recipe, so load from other processes hits both sides alike; ops/s is computed from
  the time spent in each side's own calls. fenced also hands out a fencing token (the czxid).
* contended handoff: 10 and 100 waiters on one lock, each re-queueing as soon as it has
  released. One client (one ZooKeeper session) per side: fenced waiters are tasks on one
  ``AsyncLocks``, native waiters are threads, each with its own ``Lock`` on one ``KazooClient``.
  ops/s is grants/s; p50/p99 is the release→next-grant latency (from the moment the holder
  calls release to the moment the next holder's acquire returns). The two sides alternate in
  rounds.

Targets: uncontended ≥ 1.0× native; contended grants/s ≥ 2× native with p99 flat as waiters grow.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from _common import Result, table
from kazoo.client import KazooClient
from kazoo.recipe.lock import Lock

import fenced
from fenced.testing.servers import ZooKeeperServer

TTL = 10.0


def _finish(res: Result) -> Result:
    res.ops = len(res.samples)
    res.elapsed = sum(res.samples)
    return res


async def uncontended_async(url: str, hosts: str, n: int) -> tuple[Result, Result]:
    clock = time.perf_counter
    client = KazooClient(hosts=hosts, timeout=TTL)
    client.start()
    native = Lock(client, f"/bench/native-{uuid.uuid4().hex[:8]}")
    name = f"async-{uuid.uuid4().hex[:8]}"
    ours, peer = Result("fenced async"), Result("kazoo Lock")
    async with fenced.connect_async(url) as locks:
        lease = locks.lock(name, ttl=TTL)

        async def fenced_op() -> None:
            await lease.acquire()
            await lease.release()

        def native_op() -> None:
            native.acquire()
            native.release()

        for _ in range(100):
            await fenced_op()
            native_op()
        for i in range(n):
            first_ours = i % 2 == 0
            for side in (0, 1) if first_ours else (1, 0):
                t0 = clock()
                if side == 0:
                    await fenced_op()
                    ours.samples.append(clock() - t0)
                else:
                    native_op()
                    peer.samples.append(clock() - t0)
    client.stop()
    client.close()
    return _finish(ours), _finish(peer)


def uncontended_sync(url: str, hosts: str, n: int) -> tuple[Result, Result]:
    clock = time.perf_counter
    client = KazooClient(hosts=hosts, timeout=TTL)
    client.start()
    native = Lock(client, f"/bench/native-{uuid.uuid4().hex[:8]}")
    name = f"sync-{uuid.uuid4().hex[:8]}"
    ours, peer = Result("fenced sync"), Result("kazoo Lock")
    with fenced.connect(url) as locks:
        lease = locks.lock(name, ttl=TTL)

        def fenced_op() -> None:
            lease.acquire()
            lease.release()

        def native_op() -> None:
            native.acquire()
            native.release()

        ops: tuple[tuple[Callable[[], None], Result], ...] = ((fenced_op, ours), (native_op, peer))
        for _ in range(100):
            fenced_op()
            native_op()
        for i in range(n):
            for op, res in ops if i % 2 == 0 else ops[::-1]:
                t0 = clock()
                op()
                res.samples.append(clock() - t0)
    client.stop()
    client.close()
    return _finish(ours), _finish(peer)


class Handoffs:
    """Grants counted and release→grant latencies, shared by the waiters of one run.

    Each handoff is also split in three, from marks that the patched kazoo connection sets
    (see :func:`trace_kazoo`): release called → the releasing write on the socket, → the
    watch event back from the server, → the next holder's acquire returns.
    """

    current: Handoffs | None = None

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.grants = 0
        self.released_at: float | None = None
        self.sent_at: float | None = None
        self.event_at: float | None = None
        self.latencies: list[float] = []
        self.parts: list[tuple[float, float, float]] = []
        self.started: float | None = None
        self.tokens: list[int] = []
        Handoffs.current = self

    def granted(self, token: int | None = None) -> None:
        now = time.perf_counter()
        self.grants += 1
        if token is not None:
            self.tokens.append(token)
        if self.grants == self.warmup:
            self.started = now
        elif self.grants > self.warmup and self.released_at is not None:
            self.latencies.append(now - self.released_at)
            if self.sent_at is not None and self.event_at is not None:
                self.parts.append(
                    (
                        self.sent_at - self.released_at,
                        self.event_at - self.sent_at,
                        now - self.event_at,
                    )
                )

    def releasing(self) -> None:
        self.sent_at = self.event_at = None
        self.released_at = time.perf_counter()

    def result(self, name: str, ended: float) -> Result:
        res = Result(name, samples=self.latencies)
        res.ops = self.grants - self.warmup
        res.elapsed = ended - (self.started or ended)
        res.parts = self.parts  # type: ignore[attr-defined]
        return res


def trace_kazoo() -> None:
    """Mark when the releasing write leaves and when the next watch event arrives."""
    from kazoo.protocol import connection

    handler = connection.ConnectionHandler
    submit, read_event = handler._submit, handler._read_watch_event

    def traced_submit(self: Any, request: Any, timeout: float, xid: int | None = None) -> Any:
        h = Handoffs.current
        if (
            h is not None
            and h.released_at is not None
            and h.sent_at is None
            and type(request).__name__ in ("Delete", "Transaction")
        ):
            h.sent_at = time.perf_counter()
        return submit(self, request, timeout, xid)

    def traced_event(self: Any, buffer: Any, offset: int) -> Any:
        h = Handoffs.current
        if h is not None and h.sent_at is not None and h.event_at is None:
            h.event_at = time.perf_counter()
        return read_event(self, buffer, offset)

    handler._submit = traced_submit
    handler._read_watch_event = traced_event


def breakdown(res: Result) -> str:
    parts: list[tuple[float, float, float]] = getattr(res, "parts", [])
    if not parts:
        return f"{res.name}: no breakdown"
    cols = [sorted(p[i] for p in parts) for i in range(3)]
    med = [c[len(c) // 2] * 1e3 for c in cols]
    return (
        f"{res.name:>16}: release→write sent {med[0]:.2f} ms, server (write + event) "
        f"{med[1]:.2f} ms, event→granted {med[2]:.2f} ms (medians of {len(parts)})"
    )


async def contended_fenced(url: str, waiters: int, seconds: float, clients: int = 1) -> Result:
    name = f"cont-{uuid.uuid4().hex[:8]}"
    stats = Handoffs(warmup=waiters * 2)
    stop = asyncio.Event()
    conns = [fenced.connect_async(url) for _ in range(clients)]
    for conn in conns:
        await conn.open()

    async def waiter(locks: fenced.AsyncLocks) -> None:
        lease = locks.lock(name, ttl=TTL)
        while not stop.is_set():
            token = await lease.acquire()
            stats.granted(token.value)
            stats.releasing()
            await lease.release()

    tasks = [asyncio.create_task(waiter(conns[i % clients])) for i in range(waiters)]
    await _run_for(seconds, stats, stop)
    ended = time.perf_counter()
    await asyncio.gather(*tasks)
    for conn in conns:
        await conn.aclose()
    tokens = stats.tokens
    assert all(a < b for a, b in zip(tokens, tokens[1:], strict=False)), "tokens not increasing"
    return stats.result(f"fenced ×{waiters}" + (f"/{clients}" if clients > 1 else ""), ended)


async def _run_for(seconds: float, stats: Handoffs, stop: asyncio.Event) -> None:
    deadline = time.monotonic() + 60
    while stats.started is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(seconds)
    stop.set()


def contended_native(hosts: str, waiters: int, seconds: float, clients: int = 1) -> Result:
    path = f"/bench/cont-{uuid.uuid4().hex[:8]}"
    kazoos = [KazooClient(hosts=hosts, timeout=TTL) for _ in range(clients)]
    for client in kazoos:
        client.start()
    stats = Handoffs(warmup=waiters * 2)
    stop = threading.Event()
    ended = 0.0

    def waiter(client: Any) -> None:
        lock = Lock(client, path)
        while not stop.is_set():
            lock.acquire()
            stats.granted()
            stats.releasing()
            lock.release()

    threads = [
        threading.Thread(target=waiter, args=(kazoos[i % clients],), daemon=True)
        for i in range(waiters)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while stats.started is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(seconds)
    stop.set()
    ended = time.perf_counter()
    for t in threads:
        t.join(30)
    for client in kazoos:
        client.stop()
        client.close()
    return stats.result(f"kazoo Lock ×{waiters}" + (f"/{clients}" if clients > 1 else ""), ended)


def merge(results: list[Result]) -> Result:
    out = Result(results[0].name)
    parts: list[tuple[float, float, float]] = []
    for r in results:
        out.samples += r.samples
        out.ops += r.ops
        out.elapsed += r.elapsed
        parts += getattr(r, "parts", [])
    out.parts = parts  # type: ignore[attr-defined]
    return out


def run(coro: Awaitable[Result] | Callable[[], Result]) -> Result:
    if callable(coro):
        return coro()
    return asyncio.run(coro)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=600, help="uncontended pairs per API")
    parser.add_argument("--seconds", type=float, default=3.0, help="per contended round")
    parser.add_argument("--rounds", type=int, default=3, help="contended rounds per side")
    args = parser.parse_args()
    logging.getLogger("kazoo").setLevel(logging.ERROR)  # reconnects while the server starts
    trace_kazoo()
    notes: list[str] = []
    with ZooKeeperServer() as zk:
        setup = KazooClient(hosts=zk.hosts)
        setup.start()
        setup.ensure_path("/bench")
        setup.stop()
        setup.close()
        rows: list[tuple[str, Result, Result]] = []
        ours, peer = asyncio.run(uncontended_async(zk.url, zk.hosts, args.n))
        rows.append(("uncontended acquire+release, async", ours, peer))
        ours, peer = uncontended_sync(zk.url, zk.hosts, args.n)
        rows.append(("uncontended acquire+release, sync", ours, peer))
        for waiters in (10, 100):
            mine: list[Result] = []
            theirs: list[Result] = []
            for _ in range(args.rounds):
                mine.append(asyncio.run(contended_fenced(zk.url, waiters, args.seconds)))
                theirs.append(contended_native(zk.hosts, waiters, args.seconds))
            ours_merged, theirs_merged = merge(mine), merge(theirs)
            rows.append(
                (f"contended, {waiters} waiters (grants/s, handoff)", ours_merged, theirs_merged)
            )
            notes += [breakdown(ours_merged), breakdown(theirs_merged)]
        table(
            "ZooKeeper: fenced zookeeper:// vs kazoo Lock recipe (ratio = fenced/native ops/s)",
            rows,
            note="\n".join(
                [
                    "uncontended: ops/s from the time in each side's own calls, alternated call "
                    "by call; contended: grants/s, p50/p99 = release→next grant. Handoffs:",
                    *notes,
                ]
            ),
        )


if __name__ == "__main__":
    main()
