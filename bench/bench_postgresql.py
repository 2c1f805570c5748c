"""fenced's PostgreSQL lock vs PostgreSQL's own locks, side by side on one server.

Peers:

* ``pg_advisory_lock`` / ``pg_advisory_unlock`` (session level): the native lock. In memory,
  not durable, no token, no lease: a different class of lock, shown for scale.
* hand-written durable locks with a token, the fair baseline, both with two commits per
  acquire+release: ``row lock txn`` (``BEGIN; SELECT ... FOR UPDATE; UPDATE ... RETURNING;
  COMMIT``, then the release ``UPDATE``: 5 round trips) and its tightest form
  ``UPDATE…RETURNING`` (one ``UPDATE ... RETURNING counter`` and the release: 2 round trips,
  no queue, no idempotent retry).
* contended: ``row lock in txn`` holds the counter row locked by an open transaction for the
  whole critical section (``UPDATE ... RETURNING`` waits in the server's lock queue; ``COMMIT``
  releases): durable token, one commit per cycle, but no lease and no expiry.

The variants run interleaved, in rounds, so a change of machine load hits all of them alike.
Every client is an asyncio task in this one process, with its own connection(s), on
loopback: Python's CPU time is in every figure. Run: ``.venv/bin/python bench/bench_postgresql.py``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from _common import Result, table

import fenced
from fenced.testing.servers import PostgresServer

UNCONTENDED_OPS = 1600  # per variant, in ROUNDS rounds
ROUNDS = 8
CONTENDED_ROUNDS = 3
CONTENDED_ROUND_SECONDS = 1.0
WARMUP_SECONDS = 0.3
FSYNC_OPS = 200
LOCK_KEY = 4242

Conn = psycopg.AsyncConnection[tuple[Any, ...]]
Op = Callable[[], Awaitable[object]]


class BenchServer(PostgresServer):
    """The test server, with room for 100 waiters × 2 connections and the peers."""

    def command(self) -> Sequence[str]:
        return [a.replace("max_connections=200", "max_connections=500") for a in super().command()]


async def connect(dsn: str) -> Conn:
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    await conn.execute("SET synchronous_commit = on")
    return conn


HAND_DDL = """
CREATE TABLE IF NOT EXISTS hand_locks (
    name text PRIMARY KEY, counter bigint NOT NULL DEFAULT 0, holder text, expires_at timestamptz
)
"""


# -- uncontended: each variant is (open, op, close) ------------------------------------------


class Variant:
    name = ""

    async def open(self) -> Op:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class FencedLease(Variant):
    """The public API: a lease (with its keepalive task) acquired and released."""

    name = "fenced"

    def __init__(self, url: str) -> None:
        self.url = url

    async def open(self) -> Op:
        self.locks = await fenced.connect_async(self.url).open()
        lease = self.locks.lock("bench-uncontended", ttl=30)

        async def op() -> None:
            await lease.acquire()
            await lease.release()

        return op

    async def close(self) -> None:
        await self.locks.aclose()


class FencedBackend(FencedLease):
    """The token source alone (no lease object, no keepalive task)."""

    name = "fenced source"

    async def open(self) -> Op:
        self.locks = await fenced.connect_async(self.url).open()
        backend = self.locks.backend
        counter = iter(range(10**9))

        async def op() -> None:
            grant = await backend.acquire(
                "bench-source",
                request_id=str(next(counter)),
                ttl=30,
                deadline=None,
                on_lost=lambda e: None,
            )
            await backend.release(grant)

        return op


class Advisory(Variant):
    name = "advisory"

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    async def open(self) -> Op:
        self.conn = conn = await connect(self.dsn)

        async def op() -> None:
            await conn.execute("SELECT pg_advisory_lock(%s)", (LOCK_KEY,), prepare=True)
            await conn.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,), prepare=True)

        return op

    async def close(self) -> None:
        await self.conn.close()


class HandTxn(Advisory):
    name = "row lock txn"

    async def open(self) -> Op:
        self.conn = conn = await connect(self.dsn)
        await conn.execute(HAND_DDL)
        await conn.execute("INSERT INTO hand_locks (name) VALUES ('u') ON CONFLICT DO NOTHING")

        async def op() -> None:
            async with conn.transaction():
                cur = await conn.execute(
                    "SELECT holder, expires_at > now() FROM hand_locks WHERE name = 'u' FOR UPDATE",
                    prepare=True,
                )
                holder, live = await cur.fetchone() or (None, None)
                assert holder is None or not live
                cur = await conn.execute(
                    "UPDATE hand_locks SET counter = counter + 1, holder = 'me',"
                    " expires_at = now() + interval '30 s' WHERE name = 'u' RETURNING counter",
                    prepare=True,
                )
                (token,) = await cur.fetchone() or (0,)
            await conn.execute(
                "UPDATE hand_locks SET holder = NULL WHERE name = 'u' AND counter = %s",
                (token,),
                prepare=True,
            )

        return op


class HandSingle(Advisory):
    name = "UPDATE…RETURNING"

    async def open(self) -> Op:
        self.conn = conn = await connect(self.dsn)
        await conn.execute(HAND_DDL)
        await conn.execute("INSERT INTO hand_locks (name) VALUES ('s') ON CONFLICT DO NOTHING")

        async def op() -> None:
            cur = await conn.execute(
                "UPDATE hand_locks SET counter = counter + 1, holder = 'me',"
                " expires_at = now() + interval '30 s'"
                " WHERE name = 's' AND (holder IS NULL OR expires_at <= now()) RETURNING counter",
                prepare=True,
            )
            (token,) = await cur.fetchone() or (0,)
            await conn.execute(
                "UPDATE hand_locks SET holder = NULL WHERE name = 's' AND counter = %s",
                (token,),
                prepare=True,
            )

        return op


async def uncontended(variants: list[Variant]) -> dict[str, Result]:
    ops = {v.name: await v.open() for v in variants}
    results = {name: Result(name) for name in ops}
    clock = time.perf_counter
    for op in ops.values():
        for _ in range(50):
            await op()
    per_round = UNCONTENDED_OPS // ROUNDS
    for _ in range(ROUNDS):
        for name, op in ops.items():
            res = results[name]
            start = clock()
            for _ in range(per_round):
                t0 = clock()
                await op()
                res.samples.append(clock() - t0)
            res.elapsed += clock() - start
            res.ops += per_round
    for v in variants:
        await v.close()
    return results


async def wal_syncs(admin: Conn) -> int:
    cur = await admin.execute("SELECT wal_sync FROM pg_stat_wal")
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def settled_wal_syncs(admin: Conn) -> int:
    """pg_stat_wal once the closed connections' backends have exited (and flushed their stats)."""
    last = await wal_syncs(admin)
    for _ in range(40):
        await asyncio.sleep(0.05)
        now = await wal_syncs(admin)
        if now == last:
            return now
        last = now
    return last


async def fsyncs_per_op(admin: Conn, variant: Variant) -> float:
    before = await settled_wal_syncs(admin)
    op = await variant.open()
    for _ in range(FSYNC_OPS):
        await op()
    await variant.close()
    return (await settled_wal_syncs(admin) - before) / FSYNC_OPS


# -- contended ------------------------------------------------------------------------------

Cycle = Callable[[], Awaitable[Op]]
"""Acquire; return the coroutine function that releases."""


async def contended_round(cycles: list[Cycle], res: Result) -> None:
    """Every client loops acquire→release on one lock for one round; adds to ``res``."""
    events: list[tuple[float, float]] = []  # (granted at, release sent at)
    stop = asyncio.Event()
    clock = time.perf_counter

    async def client(cycle: Cycle) -> None:
        while not stop.is_set():
            release = await cycle()
            now = clock()
            events.append((now, now))
            await release()

    tasks = [asyncio.create_task(client(c)) for c in cycles]
    await asyncio.sleep(WARMUP_SECONDS)
    start = clock()
    await asyncio.sleep(CONTENDED_ROUND_SECONDS)
    end = clock()
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    events.sort()
    res.ops += sum(1 for granted, _ in events if start <= granted < end)
    res.elapsed += end - start
    for (_, released), (granted, _) in zip(events, events[1:], strict=False):
        if start <= granted < end:
            res.samples.append(granted - released)


async def fenced_cycles(
    url: str, clients: int
) -> tuple[list[Cycle], Callable[[], Awaitable[None]]]:
    conns = [await fenced.connect_async(url).open() for _ in range(clients)]

    def cycle_for(locks: fenced.AsyncLocks) -> Cycle:
        lease = locks.lock("bench-contended", ttl=30)

        async def cycle() -> Op:
            await lease.acquire(timeout=None)
            return lease.release

        return cycle

    async def close() -> None:
        for c in conns:
            await c.aclose()

    return [cycle_for(c) for c in conns], close


async def advisory_cycles(
    dsn: str, clients: int
) -> tuple[list[Cycle], Callable[[], Awaitable[None]]]:
    conns = [await connect(dsn) for _ in range(clients)]

    def cycle_for(conn: Conn) -> Cycle:
        async def release() -> None:
            await conn.execute("SELECT pg_advisory_unlock(%s)", (LOCK_KEY,), prepare=True)

        async def cycle() -> Op:
            await conn.execute("SELECT pg_advisory_lock(%s)", (LOCK_KEY,), prepare=True)
            return release

        return cycle

    async def close() -> None:
        for c in conns:
            await c.close()

    return [cycle_for(c) for c in conns], close


async def txn_cycles(dsn: str, clients: int) -> tuple[list[Cycle], Callable[[], Awaitable[None]]]:
    conns = [await connect(dsn) for _ in range(clients)]
    await conns[0].execute(HAND_DDL)
    await conns[0].execute("INSERT INTO hand_locks (name) VALUES ('c') ON CONFLICT DO NOTHING")

    def cycle_for(conn: Conn) -> Cycle:
        async def release() -> None:
            await conn.execute("COMMIT")

        async def cycle() -> Op:
            await conn.execute("BEGIN")
            await conn.execute(
                "UPDATE hand_locks SET counter = counter + 1 WHERE name = 'c' RETURNING counter",
                prepare=True,
            )
            return release

        return cycle

    async def close() -> None:
        for c in conns:
            await c.close()

    return [cycle_for(c) for c in conns], close


async def contended(url: str, dsn: str, waiters: int) -> dict[str, Result]:
    clients = waiters + 1
    setups = {
        "fenced": await fenced_cycles(url, clients),
        "advisory": await advisory_cycles(dsn, clients),
        "row lock in txn": await txn_cycles(dsn, clients),
    }
    results = {name: Result(name) for name in setups}
    for _ in range(CONTENDED_ROUNDS):
        for name, (cycles, _close) in setups.items():
            await contended_round(cycles, results[name])
    for _cycles, close in setups.values():
        await close()
    return results


async def main() -> None:
    server = BenchServer()
    with server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench")
        dsn = f"postgresql://postgres@127.0.0.1:{server.port}/bench"
        url = dsn
        async with fenced.connect_async(url):  # installs the tables once
            pass

        def variants() -> list[Variant]:
            return [
                FencedLease(url),
                FencedBackend(url),
                Advisory(dsn),
                HandTxn(dsn),
                HandSingle(dsn),
            ]

        u = await uncontended(variants())
        admin = await connect(dsn)
        fsyncs = {v.name: await fsyncs_per_op(admin, v) for v in variants()}
        await admin.close()
        ours = u["fenced"]
        table(
            f"PostgreSQL, uncontended acquire+release, one client, {UNCONTENDED_OPS} ops "
            f"per variant in {ROUNDS} interleaved rounds",
            [
                ("vs native advisory lock", ours, u["advisory"]),
                ("vs hand-written durable txn", ours, u["row lock txn"]),
                ("vs hand-written 1-statement", ours, u["UPDATE…RETURNING"]),
                ("source alone vs 1-statement", u["fenced source"], u["UPDATE…RETURNING"]),
            ],
            note=(
                "WAL fsyncs per acquire+release (pg_stat_wal.wal_sync): "
                + ", ".join(f"{k} {v:.2f}" for k, v in fsyncs.items())
                + ".\nRound trips per acquire+release: fenced 2, advisory 2, row lock txn 5, "
                "UPDATE…RETURNING 2. Advisory locks are in memory, not durable, and give no "
                "token or lease: a different class. The hand-written peers are durable with a "
                "counter, like fenced, but have no FIFO queue, no idempotent retry, no status."
            ),
        )

        rows: list[tuple[str, Result, Result]] = []
        for waiters in (10, 100):
            c = await contended(url, dsn, waiters)
            rows.append((f"{waiters} waiters vs advisory", c["fenced"], c["advisory"]))
            rows.append(
                (f"{waiters} waiters vs row lock in txn", c["fenced"], c["row lock in txn"])
            )
        table(
            f"PostgreSQL, contended handoff on one lock ({CONTENDED_ROUNDS} × "
            f"{CONTENDED_ROUND_SECONDS:.0f} s each, interleaved): ops/s = grants/s, "
            "p50/p99 = release sent → next grant",
            rows,
            note=(
                "fenced per handoff: a durable commit to release (with a NOTIFY to the head "
                "waiter only), then the head's durable commit to grant. PostgreSQL 15 signals "
                "every listening backend of the database on each NOTIFY, so the handoff cost "
                "grows with the number of waiting clients. Fast fsync here (~0.2 ms): slower "
                "disks lower every durable figure, not the advisory lock's."
            ),
        )


if __name__ == "__main__":
    asyncio.run(main())
