"""A replicated group's writes and reads (``fenced.replicated``) next to the same operations
on one guarded member and on the members unguarded, in one run, on the same Redis servers
(AOF ``appendfsync always``, loopback); and the time a write takes when a member has just
been killed (the writer removes it by a reconfiguration, then writes).

    python bench/bench_replicated.py [--n 400] [--kills 10]

Rows, for 1, 3 and 5 members: a group write (every member, in parallel, acknowledged when all
took it) vs one ``RedisGuard.set`` on one member; vs plain ``SET`` on every member in parallel
(threads, as the group's members run). A group read (every member) vs one plain ``GET``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis

import fenced
from fenced.guards.redis import RedisGuard
from fenced.replicated import Group
from fenced.testing.proxy import TcpProxy
from fenced.testing.servers import RedisServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Result, fmt_us, interleaved, table


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--kills", type=int, default=10)
    args = ap.parse_args(argv)
    servers = [RedisServer().start() for _ in range(5)]
    tmp = tempfile.mkdtemp(prefix="fenced-bench-replicated-")
    pool = concurrent.futures.ThreadPoolExecutor(5)
    try:
        clients = [redis.Redis(port=s.port, socket_timeout=2) for s in servers]
        with fenced.connect(f"sqlite:///{tmp}/locks.db") as locks:
            rows = []
            for size in (1, 3, 5):
                name = f"bench{size}"
                members = {f"m{i}": RedisGuard(clients[i], name) for i in range(size)}
                group = Group(name, locks, members)
                with locks.lock(name, ttl=30) as lease:
                    writer = group.writer(lease)
                    guard = RedisGuard(clients[0], f"{name}-single")
                    token = fenced.FencingToken(f"{name}-single", 1)
                    plain = clients[:size]

                    def unguarded(plain: list[redis.Redis] = plain) -> None:
                        list(pool.map(lambda c: c.set("plain", b"v" * 32), plain))

                    pairs = [
                        (
                            f"group of {size}: write",
                            lambda w=writer: w.set("k", b"v" * 32),
                            "one guarded member",
                            lambda g=guard, t=token: g.set("k1", b"v" * 32, token=t),
                        ),
                        (
                            f"group of {size}: write",
                            lambda w=writer: w.set("k", b"v" * 32),
                            f"{size} unguarded (parallel)",
                            unguarded,
                        ),
                        (
                            f"group of {size}: read",
                            lambda g=group: g.read("k"),
                            "one plain GET",
                            lambda c=clients[0]: c.get("plain"),
                        ),
                    ]
                    for (what, _, _, _), (ours, peer) in zip(
                        pairs, interleaved(pairs, args.n), strict=True
                    ):
                        ours.name = what
                        rows.append((what, ours, peer))
                group.close()
            table(
                "fenced.replicated on Redis (AOF always), one writer, sequential",
                rows,
                note="ratio = fenced ops/s / peer ops/s (1.0 = as fast as the peer)",
            )
            kills = _kill_times(locks, servers, clients, args.kills)
            partitions = _partition_times(locks, servers, max(3, args.kills // 2))
        for label, samples in (
            ("member killed (kill -9): first write after", kills),
            ("member partitioned (socket_timeout 0.5 s): first write after", partitions),
        ):
            r = Result(label, samples)
            print(
                f"{label}: p50 {fmt_us(r.p50)}, p99 {fmt_us(r.p99)}, "
                f"mean {fmt_us(statistics.fmean(samples))} over {len(samples)} runs "
                "(detect, fence the rest at a new epoch, swap the configuration, re-establish, "
                "write)"
            )
    finally:
        pool.shutdown()
        for s in servers:
            s.close()
    return 0


def _kill_times(
    locks: fenced.Locks, servers: list[RedisServer], clients: list[redis.Redis], runs: int
) -> list[float]:
    """3 members; kill -9 one; time the next acknowledged write; restart and add it back."""
    members = {f"m{i}": RedisGuard(clients[i], "killbench") for i in range(3)}
    group = Group("killbench", locks, members)
    out = []
    with locks.lock("killbench", ttl=60) as lease:
        writer = group.writer(lease)
        for i in range(runs):
            writer.set("k", f"{i}")
            victim = servers[2]
            victim.kill()
            t0 = time.perf_counter()
            writer.set("k", f"{i}+")
            out.append(time.perf_counter() - t0)
            assert writer.configuration is not None and "m2" not in writer.configuration.members
            victim.start()
            group.add("m2", members["m2"])
    group.close()
    return out


def _partition_times(locks: fenced.Locks, servers: list[RedisServer], runs: int) -> list[float]:
    """As above, but the member goes silent (a partition through a TCP proxy): the write
    waits for the client's socket timeout before the member is removed."""
    proxy = TcpProxy("127.0.0.1", servers[2].port).start()
    clients = [
        redis.Redis(port=servers[0].port, socket_timeout=0.5),
        redis.Redis(port=servers[1].port, socket_timeout=0.5),
        redis.Redis(port=proxy.port, socket_timeout=0.5, socket_connect_timeout=0.5),
    ]
    members = {f"p{i}": RedisGuard(clients[i], "partbench") for i in range(3)}
    group = Group("partbench", locks, members, timeout=2.0)
    out = []
    try:
        with locks.lock("partbench", ttl=60) as lease:
            writer = group.writer(lease)
            for i in range(runs):
                writer.set("k", f"{i}")
                proxy.partition()
                t0 = time.perf_counter()
                writer.set("k", f"{i}+")
                out.append(time.perf_counter() - t0)
                proxy.heal()
                proxy.cut()  # (the stuck connection is dropped; the next one is fresh)
                group.add("p2", members["p2"])
    finally:
        group.close()
        proxy.close()
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
