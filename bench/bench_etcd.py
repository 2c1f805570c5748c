"""fenced's etcd lock vs aetcd's own lock recipe (``aetcd.Client.lock``), side by side.

Both run on one asyncio loop against the same single-member etcd server (fsync on), each
client with its own gRPC connection. The peer is aetcd's ``Lock``: a lease per attempt, a
``create_revision == 0`` transaction on one key, a watch on that key for waiters (all of them:
a thundering herd), and a release that compares the value; it hands out no token and keeps no
lease alive. fenced delivers a fencing token, FIFO order and a renewed lease on top.

    .venv/bin/python bench/bench_etcd.py [--quick]

Rows: uncontended acquire+release by one client (ops/s, p50, p99 of one acquire+release),
and contended hand-off with 10 and 100 waiters on one lock (grants/s, and p50/p99 of the
time from a holder starting its release to the next holder's grant).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aetcd
from _common import Result, table

import fenced
from fenced.testing.servers import EtcdServer

TTL = 10


# -- the two lock clients behind one tiny interface ------------------------------------------


class FencedSide:
    def __init__(self, url: str, name: str = "fenced", **options: Any) -> None:
        self.name = name
        self.url = url
        self.options = options

    async def connect(self) -> Any:
        return await fenced.connect_async(self.url, **self.options).open()

    async def close(self, conn: Any) -> None:
        await conn.aclose()

    async def acquire(self, conn: Any, key: str) -> Callable[[], Awaitable[Any]]:
        lease = conn.lock(key, ttl=TTL)
        await lease.acquire()
        return lease.release


class AetcdSide:
    name = "aetcd Lock"

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    async def connect(self) -> Any:
        client = aetcd.Client(host=self.host, port=self.port)
        await client.connect()
        return client

    async def close(self, conn: Any) -> None:
        await conn.close()

    async def acquire(self, conn: Any, key: str) -> Callable[[], Awaitable[Any]]:
        lock = conn.lock(f"/bench/aetcd/{key}".encode(), ttl=TTL)
        if not await lock.acquire(timeout=None):
            raise RuntimeError("aetcd lock not acquired")
        return lock.release


Side = FencedSide | AetcdSide


async def uncontended(side: Side, n: int, warmup: int = 50) -> Result:
    conn = await side.connect()
    key = f"u-{uuid.uuid4().hex[:8]}"
    try:
        for _ in range(warmup):
            release = await side.acquire(conn, key)
            await release()
        res = Result(side.name)
        clock = time.perf_counter
        start = clock()
        for _ in range(n):
            t0 = clock()
            release = await side.acquire(conn, key)
            await release()
            res.samples.append(clock() - t0)
        res.elapsed = clock() - start
        res.ops = n
        return res
    finally:
        await side.close(conn)


@dataclasses.dataclass
class Fairness:
    grantees: list[int] = dataclasses.field(default_factory=list)

    def describe(self, waiters: int) -> str:
        g = self.grantees
        same = sum(1 for a, b in zip(g, g[1:], strict=False) if a == b)
        counts = collections.Counter(g)
        least = min(counts.get(i, 0) for i in range(waiters))
        return (
            f"{100 * same / max(1, len(g) - 1):.0f}% of grants went back to the releasing "
            f"client; grants per client {least}..{max(counts.values(), default=0)}"
        )


async def contended(side: Side, waiters: int, seconds: float) -> tuple[Result, Fairness]:
    """``waiters`` tasks, each with its own connection, take one lock in turn for ``seconds``."""
    conns = await asyncio.gather(*(side.connect() for _ in range(waiters)))
    key = f"c-{uuid.uuid4().hex[:8]}"
    clock = time.perf_counter
    res = Result(side.name)
    fairness = Fairness()
    state: dict[str, Any] = {"released_at": None, "grants": 0, "measuring": False}
    holders = [0]

    async def worker(who: int, conn: Any) -> None:
        while True:
            release = await side.acquire(conn, key)
            now = clock()
            holders[0] += 1
            if holders[0] != 1:
                raise AssertionError("two holders at once")
            if state["measuring"]:
                state["grants"] += 1
                fairness.grantees.append(who)
                if state["released_at"] is not None:
                    res.samples.append(now - state["released_at"])
            holders[0] -= 1
            state["released_at"] = clock()
            await release()

    tasks = [asyncio.create_task(worker(i, c)) for i, c in enumerate(conns)]
    try:
        await asyncio.sleep(min(1.0, seconds / 4))  # let every waiter join the queue
        state["measuring"] = True
        start = clock()
        await asyncio.sleep(seconds)
        state["measuring"] = False
        res.elapsed = clock() - start
        res.ops = state["grants"]
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(side.close(c) for c in conns), return_exceptions=True)
    return res, fairness


async def main(quick: bool) -> None:
    n = 300 if quick else 1500
    secs = 2.0 if quick else 5.0
    with EtcdServer() as server:
        host, port = "127.0.0.1", server.port
        ours = FencedSide(server.url)
        no_pool = FencedSide(server.url, "fenced, lease_pool=0", lease_pool=0)
        peer = AetcdSide(host, port)
        rows: list[tuple[str, Result, Result]] = []
        # Alternate the order so neither side always runs on a warmer server.
        peer_u = await uncontended(peer, n)
        ours_u = await uncontended(ours, n)
        nopool_u = await uncontended(no_pool, n)
        rows.append(("uncontended acquire+release", ours_u, peer_u))
        rows.append(("  (without lease recycling)", nopool_u, peer_u))
        fair: list[str] = []
        for w in (10, 100):
            ours_c, ours_f = await contended(ours, w, secs)
            peer_c, peer_f = await contended(peer, w, secs)
            rows.append((f"contended, {w} waiters: grants/s, hand-off", ours_c, peer_c))
            fair.append(f"{w} waiters: fenced {ours_f.describe(w)}; aetcd {peer_f.describe(w)}")
    table(
        "etcd 3.4 single member (loopback, fsync on): fenced etcd:// vs aetcd's Lock",
        rows,
        note=(
            "uncontended: p50/p99 of one acquire+release. contended: ops/s = grants/s, "
            "p50/p99 = time from a holder starting release to the next grant.\n"
            "fenced: 1 txn to acquire a free lock, 1 txn to release (recycled lease); "
            "a waiter watches only its predecessor.\n"
            "aetcd Lock: LeaseGrant + txn per attempt, every waiter watches the one key "
            "(each release wakes all of them), release txn; no token, leases never revoked.\n"
            "Fairness (a barging lock re-grants to the releasing client without any wake-up):\n"
            + "\n".join(fair)
        ),
    )


if __name__ == "__main__":
    asyncio.run(main("--quick" in sys.argv))
