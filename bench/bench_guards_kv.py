"""Guarded vs unguarded single writes, one client, on Redis (AOF always) and etcd.

    .venv/bin/python bench/bench_guards_kv.py [--n 2000]

Rows (fenced = the guard, peer = the same write without a guard, same client and server):

* Redis, same token: ``RedisGuard.set`` with the holder's token (the common case: one holder
  writes many times) vs ``SET``.
* Redis, new token each write: every write advances the mark (HSET + SET in one script).
* etcd async: ``AsyncEtcdGuard.put`` (one Txn) vs ``aetcd.Client.put``.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import aetcd
import redis
from _common import Result, table

from fenced import FencingToken
from fenced._core.portal import Portal
from fenced.guards.etcd import AsyncEtcdGuard, EtcdGuard
from fenced.guards.redis import RedisGuard
from fenced.testing.servers import EtcdServer, RedisServer


class Side(Result):
    """A Result that also counts this process's CPU time (all threads) spent in the calls."""

    cpu: float = 0.0


def _finish(res: Side) -> Side:
    res.ops = len(res.samples)
    res.elapsed = sum(res.samples)  # ops/s over the time spent in this side's calls only
    return res


def _pairs(i: int, a: Side, b: Side, ours: Any, peer: Any) -> tuple[tuple[Any, Side], ...]:
    return ((ours, a), (peer, b)) if i % 2 == 0 else ((peer, b), (ours, a))


def alternate(
    ours: Callable[[], object],
    peer: Callable[[], object],
    *,
    n: int,
    names: tuple[str, str],
    warmup: int = 50,
) -> tuple[Side, Side]:
    """Time ``ours`` and ``peer`` one call each in turn (order swapped every other pair)."""
    for _ in range(warmup):
        ours()
        peer()
    a, b = Side(names[0]), Side(names[1])
    clock, cpu = time.perf_counter, time.process_time
    for i in range(n):
        for op, res in _pairs(i, a, b, ours, peer):
            c0, t0 = cpu(), clock()
            op()
            res.samples.append(clock() - t0)
            res.cpu += cpu() - c0
    return _finish(a), _finish(b)


async def aalternate(
    ours: Callable[[], Awaitable[object]],
    peer: Callable[[], Awaitable[object]],
    *,
    n: int,
    names: tuple[str, str],
    warmup: int = 50,
) -> tuple[Side, Side]:
    """:func:`alternate` for coroutines."""
    for _ in range(warmup):
        await ours()
        await peer()
    a, b = Side(names[0]), Side(names[1])
    clock, cpu = time.perf_counter, time.process_time
    for i in range(n):
        for op, res in _pairs(i, a, b, ours, peer):
            c0, t0 = cpu(), clock()
            await op()
            res.samples.append(clock() - t0)
            res.cpu += cpu() - c0
    return _finish(a), _finish(b)


def server_usec(client: redis.Redis, command: str) -> float:
    stats = client.info("commandstats").get(f"cmdstat_{command}", {})
    return float(stats.get("usec_per_call", float("nan")))


Rows = list[tuple[str, Side, Side]]


def bench_redis(n: int, notes: list[str]) -> Rows:
    rows: Rows = []
    with RedisServer() as server:
        client = redis.Redis(host="127.0.0.1", port=server.port)
        guard = RedisGuard(client, "bench", lock="bench")
        value = b"x" * 100
        counter = itertools.count(2)
        cases: list[tuple[str, Callable[[], object]]] = [
            ("Redis set, same token", lambda: guard.set("{bench}:k", value, FENCE_1)),
            (
                "Redis set, new token each",
                lambda: guard.set("{bench}:k", value, token=FencingToken("bench", next(counter))),
            ),
        ]
        for what, guarded in cases:
            client.config_resetstat()
            rows.append(
                (
                    what,
                    *alternate(
                        guarded,
                        lambda: client.set("{bench}:k", value),
                        n=n,
                        names=("RedisGuard.set", "SET"),
                    ),
                )
            )
            notes.append(
                f"{what}: Redis server CPU per call: EVALSHA {server_usec(client, 'evalsha'):.1f} µs"
                f" vs SET {server_usec(client, 'set'):.1f} µs"
            )
        client.close()
    return rows


FENCE_1 = FencingToken("bench", 1)


def bench_etcd(n: int) -> Rows:
    rows: Rows = []
    with EtcdServer() as server:

        async def run_async() -> tuple[Side, Side]:
            async with aetcd.Client("127.0.0.1", server.port) as client:
                guard = AsyncEtcdGuard(client, "bench", lock="bench")
                token = FencingToken("bench", 1)
                value = b"x" * 100
                return await aalternate(
                    lambda: guard.put("bench/k", value, token=token),
                    lambda: client.put(b"bench/k", value),
                    n=n,
                    names=("AsyncEtcdGuard.put", "aetcd put"),
                )

        rows.append(("etcd put, async", *asyncio.run(run_async())))

        with EtcdGuard(server.endpoint, "bench", lock="bench") as guard:
            portal = Portal("bench-etcd")
            client = portal.run_sync(lambda: aetcd.Client("127.0.0.1", server.port))
            token = FencingToken("bench", 1)
            value = b"x" * 100
            rows.append(
                (
                    "etcd put, sync",
                    *alternate(
                        lambda: guard.put("bench/k", value, token=token),
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
    notes: list[str] = []
    rows = bench_redis(args.n, notes) + bench_etcd(args.n)
    table(
        "fenced guards vs unguarded writes (one client, loopback; ratio = guarded/unguarded ops/s)",
        rows,
        note="Target: ratio ≥ 0.87 (guarded write ≤ 1.15× the unguarded write's time).",
    )
    print()
    for what, ours, peer in rows:
        print(
            f"{what:27s} time ratio: mean {ours.mean / peer.mean:.3f}×, "
            f"p50 {ours.p50 / peer.p50:.3f}×;  client CPU per call {ours.cpu / ours.ops * 1e6:.0f}"
            f" vs {peer.cpu / peer.ops * 1e6:.0f} µs"
        )
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
