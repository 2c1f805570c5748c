"""Guarded vs unguarded single writes, one client, on Redis (AOF always) and etcd.

    .venv/bin/python bench/bench_guards_kv.py [--n 2000]

Rows (fenced = the guard, peer = the same write without a guard, same client and server):

* Redis, same token: ``RedisGuard.set`` with the holder's token (the common case: one holder
  writes many times) vs ``SET``.
* Redis, new token each write: every write advances the mark (HSET + SET in one script).
* etcd async: ``AsyncEtcdGuard.put`` (one nested Txn) vs ``aetcd.Client.put``.
* etcd sync: ``EtcdGuard.put`` (the same coroutine through the private loop) vs ``put``
  through the same kind of loop thread.

The two sides of a row alternate call by call, so load from other processes on the machine
hits both alternately; ops/s is computed from the time spent in each side's own calls.
Target: the guarded write takes at most 1.15× the time of the unguarded one (ratio ≥ 0.87 in
ops/s).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import aetcd
import redis
from _common import Result, table

from fenced import FencingToken
from fenced._sync import _Portal
from fenced.guards.etcd import AsyncEtcdGuard, EtcdGuard
from fenced.guards.redis import RedisGuard
from fenced.testing.servers import EtcdServer, RedisServer


def _finish(res: Result) -> Result:
    res.ops = len(res.samples)
    res.elapsed = sum(res.samples)  # ops/s over the time spent in this side's calls only
    return res


def alternate(
    ours: Callable[[], object],
    peer: Callable[[], object],
    *,
    n: int,
    names: tuple[str, str],
    warmup: int = 50,
) -> tuple[Result, Result]:
    """Time ``ours`` and ``peer`` one call each in turn (order swapped every other pair)."""
    for _ in range(warmup):
        ours()
        peer()
    a, b = Result(names[0]), Result(names[1])
    clock = time.perf_counter
    for i in range(n):
        for op, res in ((ours, a), (peer, b)) if i % 2 == 0 else ((peer, b), (ours, a)):
            t0 = clock()
            op()
            res.samples.append(clock() - t0)
    return _finish(a), _finish(b)


async def aalternate(
    ours: Callable[[], Awaitable[object]],
    peer: Callable[[], Awaitable[object]],
    *,
    n: int,
    names: tuple[str, str],
    warmup: int = 50,
) -> tuple[Result, Result]:
    """:func:`alternate` for coroutines."""
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
    return _finish(a), _finish(b)


def bench_redis(n: int) -> list[tuple[str, Result, Result]]:
    rows = []
    with RedisServer() as server:
        client = redis.Redis(host="127.0.0.1", port=server.port)
        guard = RedisGuard(client, "bench", "bench")
        token = FencingToken("bench", 1)
        value = b"x" * 100
        rows.append(
            (
                "Redis set, same token",
                *alternate(
                    lambda: guard.set("{bench}:k", value, token),
                    lambda: client.set("{bench}:k", value),
                    n=n,
                    names=("RedisGuard.set", "SET"),
                ),
            )
        )
        counter = itertools.count(2)
        rows.append(
            (
                "Redis set, new token each",
                *alternate(
                    lambda: guard.set("{bench}:k", value, FencingToken("bench", next(counter))),
                    lambda: client.set("{bench}:k", value),
                    n=n,
                    names=("RedisGuard.set", "SET"),
                ),
            )
        )
        client.close()
    return rows


def bench_etcd(n: int) -> list[tuple[str, Result, Result]]:
    rows = []
    with EtcdServer() as server:

        async def run_async() -> tuple[Result, Result]:
            async with aetcd.Client("127.0.0.1", server.port) as client:
                guard = AsyncEtcdGuard(client, "bench", "bench")
                token = FencingToken("bench", 1)
                value = b"x" * 100
                return await aalternate(
                    lambda: guard.put("bench/k", value, token),
                    lambda: client.put(b"bench/k", value),
                    n=n,
                    names=("AsyncEtcdGuard.put", "aetcd put"),
                )

        rows.append(("etcd put, async", *asyncio.run(run_async())))

        with EtcdGuard(server.endpoint, "bench", "bench") as guard:
            portal = _Portal("bench-etcd")
            client = portal.run_sync(lambda: aetcd.Client("127.0.0.1", server.port))
            token = FencingToken("bench", 1)
            value = b"x" * 100
            rows.append(
                (
                    "etcd put, sync",
                    *alternate(
                        lambda: guard.put("bench/k", value, token),
                        lambda: portal.call(client.put(b"bench/k", value)),
                        n=n,
                        names=("EtcdGuard.put", "put via loop thread"),
                    ),
                )
            )
            portal.call(client.close())
            portal.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="writes per side per row")
    args = parser.parse_args()
    rows = bench_redis(args.n) + bench_etcd(args.n)
    table(
        "fenced guards vs unguarded writes (one client, loopback; ratio = guarded/unguarded ops/s)",
        rows,
        note="Target: ratio ≥ 0.87 (guarded write ≤ 1.15× the unguarded write's time).",
    )
    print()
    for what, ours, peer in rows:
        print(
            f"{what:28s} time ratio (mean) {ours.mean / peer.mean:.3f}×  "
            f"(p50 {ours.p50 / peer.p50:.3f}×)"
        )


if __name__ == "__main__":
    main()
