"""Closing a replicated group while it is in use, with real members (a Redis server paused with
SIGSTOP, SQLite files): as the lease core's close() (tests/core/test_close_race.py), a call in
flight on another thread is stopped with a typed error, a member that hangs costs one bound,
not the close for ever, a second close (at the same time, or after an interrupted one) ends
what the first began, and a call after close is refused, typed, without reopening anything."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis

import fenced
from fenced.guards.redis import RedisGuard
from fenced.guards.sql import SQLGuard
from fenced.replicated import Group, RedisMember, Snapshot, SQLMember
from fenced.testing.servers import PostgresServer, RedisServer
from tests.helpers import wait_for

pytestmark = pytest.mark.xdist_group("replicated-close")

BOUND = 3.0  # what a close may take with a member hung (its bound, and some load)


class NotedMember(RedisMember):
    """A real Redis member that says when a read has started (so the test knows a call is in
    flight on the paused server, without sleeping for it)."""

    def __init__(self, guard: RedisGuard, group: str) -> None:
        super().__init__(guard, group)
        self.reading = threading.Event()

    async def read(self, keys: Sequence[str] | None = None) -> Snapshot:
        self.reading.set()
        return await super().read(keys)


def sqlite_member(tmp: Path, name: str) -> Any:
    path = str(tmp / f"{name}.db")
    return SQLGuard("orders").fencer(lambda: sqlite3.connect(path, check_same_thread=False))


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as s:
        yield s  # type: ignore[misc]


@pytest.fixture
def locks(tmp_path: Path) -> Iterator[fenced.Locks]:
    with fenced.connect(f"sqlite:///{tmp_path}/locks.db") as source:
        yield source


def make_group(
    locks: fenced.Locks, server: RedisServer, tmp_path: Path
) -> tuple[Group, NotedMember, redis.Redis]:
    client = redis.Redis(port=server.port)
    noted = NotedMember(RedisGuard(client, "orders-a"), "orders")
    # timeout 30: a call that ends within BOUND was stopped by the close, not its own bound
    group = Group("orders", locks, {"a": noted, "b": sqlite_member(tmp_path, "b")}, timeout=30)
    with locks.lock("orders", ttl=30) as lease:
        group.writer(lease).set("k", b"v")  # (both members fenced and written: the right side)
    assert group.read("k") == b"v"
    noted.reading.clear()
    return group, noted, client


def read_in_thread(group: Group) -> tuple[threading.Thread, list[BaseException | bytes | None]]:
    out: list[BaseException | bytes | None] = []

    def run() -> None:
        try:
            out.append(group.read("k"))
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_close_stops_a_read_in_flight_on_a_hung_member(
    locks: fenced.Locks, server: RedisServer, tmp_path: Path
) -> None:
    group, noted, client = make_group(locks, server, tmp_path)
    server.pause()
    try:
        t, out = read_in_thread(group)
        assert noted.reading.wait(10)
        started = time.monotonic()
        group.close()
        closed_in = time.monotonic() - started
        t.join(BOUND)
        stopped_in = time.monotonic() - started
        assert not t.is_alive(), "the read in flight outlived the close"
        assert closed_in < BOUND and stopped_in < BOUND, (closed_in, stopped_in)
        assert isinstance(out[0], fenced.BackendUnavailable), repr(out[0])
        assert "closed" in str(out[0])
        # After close: refused, typed, at once (not a raw RuntimeError of a shut-down pool).
        with pytest.raises(fenced.BackendUnavailable, match="closed"):
            group.read("k")
        with pytest.raises(fenced.BackendUnavailable, match="closed"):
            group.configuration()
    finally:
        server.resume()
        client.close()


def test_two_closes_at_once_both_end_within_the_bound(
    locks: fenced.Locks, server: RedisServer, tmp_path: Path
) -> None:
    group, noted, client = make_group(locks, server, tmp_path)
    server.pause()
    try:
        t, out = read_in_thread(group)
        assert noted.reading.wait(10)
        errors: list[BaseException] = []

        def close() -> None:
            try:
                group.close()
            except BaseException as exc:
                errors.append(exc)

        started = time.monotonic()
        closers = [threading.Thread(target=close, daemon=True) for _ in range(2)]
        for c in closers:
            c.start()
        for c in closers:
            c.join(BOUND * 2)
        assert not any(c.is_alive() for c in closers), "a close hangs"
        assert time.monotonic() - started < BOUND
        assert errors == []
        t.join(BOUND)
        assert isinstance(out[0], fenced.BackendUnavailable), repr(out[0])
    finally:
        server.resume()
        client.close()


async def test_an_interrupted_close_is_finished_by_the_next(
    server: RedisServer, tmp_path: Path
) -> None:
    async with fenced.connect_async(f"sqlite:///{tmp_path}/locks.db") as locks:
        group = fenced.replicated.AsyncGroup(
            "orders",
            locks,
            {"a": RedisGuard(redis.Redis(port=server.port), "orders-a"),
             "b": sqlite_member(tmp_path, "b")},
            timeout=30,
        )  # fmt: skip
        assert await group.read("k") is None
        server.pause()
        try:
            reading = asyncio.ensure_future(group.read("k"))
            await asyncio.sleep(0)  # (its first step: the configuration, then the members)
            closing = asyncio.ensure_future(group.aclose())
            await asyncio.sleep(0)
            closing.cancel()  # interrupted (a timeout around it, Ctrl-C)
            with pytest.raises(asyncio.CancelledError):
                await closing
            started = time.monotonic()
            await asyncio.wait_for(group.aclose(), BOUND)  # ends what the first began
            assert time.monotonic() - started < BOUND
            with pytest.raises(fenced.BackendUnavailable):
                await asyncio.wait_for(reading, BOUND)
            with pytest.raises(fenced.BackendUnavailable, match="closed"):
                await group.read("k")
        finally:
            server.resume()


def test_a_member_that_cannot_close_costs_the_bound_and_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A PostgreSQL member whose server hangs (its postmaster SIGSTOPped: a new connection
    never gets its answer) under more calls in flight than the loop has worker threads: the
    member's own close (on a worker thread too) cannot even start. The group's close ends
    within its bound all the same and names the member; it hung for ever."""
    psycopg = pytest.importorskip("psycopg")
    with PostgresServer() as server, fenced.connect(f"sqlite:///{tmp_path}/locks.db") as locks:
        pg: PostgresServer = server  # type: ignore[assignment]
        connecting: list[int] = []

        def connect() -> Any:
            connecting.append(threading.get_ident())  # (a worker thread, about to hang)
            return psycopg.connect(pg.dsn, autocommit=True)

        member = SQLMember(
            SQLGuard("orders"),
            connect,
            "orders",
            keep_connection=False,  # (each call connects: each hangs once the server does)
        )
        group = Group("orders", locks, {"a": member, "b": sqlite_member(tmp_path, "b")}, timeout=30)
        assert group.read("k") is None  # (the right side: both members answer)
        pg.pause()
        try:
            # Every worker thread of the loop hung in a connect (asyncio.to_thread's pool:
            # min(32, cores + 4) threads); more reads queue behind them.
            workers = min(32, (os.cpu_count() or 1) + 4)
            connecting.clear()
            readers = [read_in_thread(group) for _ in range(workers + 2)]
            wait_for(lambda: len(set(connecting)) >= workers, timeout=10)
            closer = threading.Thread(target=group.close, daemon=True)
            started = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="fenced.replicated"):
                closer.start()
                closer.join(BOUND * 2)
            assert not closer.is_alive(), "close hangs on a member that cannot close"
            assert time.monotonic() - started < BOUND
            assert "could not be closed" in caplog.text and "'a'" in caplog.text
            for t, out in readers:
                t.join(BOUND)
                assert out and isinstance(out[0], fenced.BackendUnavailable), out
        finally:
            pg.resume()


# -- the group and its connection: closed in either order ------------------------------------


def _member_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("fenced-member-"))


def _open_members(pg_dsn: str) -> int:
    """The members' PostgreSQL connections open now (their application_name, as the server
    counts them)."""
    psycopg = pytest.importorskip("psycopg")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'fenced-member'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def group_on(locks: fenced.Locks, server: RedisServer, pg_dsn: str) -> tuple[Group, redis.Redis]:
    """A group with a Redis member (its own thread) and a PostgreSQL one (its own kept
    connection), both used: a write through each."""
    psycopg = pytest.importorskip("psycopg")
    client = redis.Redis(port=server.port)
    pg = SQLGuard("orders").fencer(
        lambda: psycopg.connect(pg_dsn, autocommit=True, application_name="fenced-member")
    )
    group = Group("orders", locks, {"a": RedisGuard(client, "orders-a"), "b": pg})
    with locks.lock("orders", ttl=30) as lease:
        group.writer(lease).set("k", b"v")
    return group, client


def test_closing_the_connection_first_closes_its_groups(
    server: RedisServer, pg_dsn: str, tmp_path: Path
) -> None:
    """The connection closed (its ``with`` block left) before the group: the group's members'
    own connections and threads stayed open (the group's close then did nothing: the
    connection's loop was gone). Now the connection closes its groups first: the member's
    thread ends, its PostgreSQL connection is closed, and the group's next use raises
    BackendUnavailable ("closed"), its close a no-op; the guards given stay the caller's."""
    threads, conns = _member_threads(), _open_members(pg_dsn)
    with fenced.connect(f"sqlite:///{tmp_path}/locks.db") as locks:
        group, client = group_on(locks, server, pg_dsn)
        assert _member_threads() == threads + 1 and _open_members(pg_dsn) == conns + 1
    try:
        wait_for(lambda: _member_threads() == threads, timeout=BOUND, what="the thread's end")
        wait_for(
            lambda: _open_members(pg_dsn) == conns, timeout=BOUND, what="the connection closed"
        )
        with pytest.raises(fenced.BackendUnavailable, match="closed"):
            group.read("k")
        group.close()
        assert client.ping()  # (the caller's client, open)
    finally:
        client.close()


def test_closing_the_group_first_then_its_connection(
    server: RedisServer, pg_dsn: str, tmp_path: Path
) -> None:
    """The other order, as before: the group's close closes its members; the connection's
    close then closes nothing twice and raises nothing."""
    threads, conns = _member_threads(), _open_members(pg_dsn)
    with fenced.connect(f"sqlite:///{tmp_path}/locks.db") as locks:
        group, client = group_on(locks, server, pg_dsn)
        group.close()
        wait_for(lambda: _member_threads() == threads, timeout=BOUND, what="the thread's end")
        assert _open_members(pg_dsn) == conns
        with pytest.raises(fenced.BackendUnavailable, match="closed"):
            group.read("k")
        assert locks.status("orders").holder is None  # (the connection, still working)
    client.close()


async def test_an_async_group_closes_with_its_connection_and_not_on_a_closed_one(
    tmp_path: Path,
) -> None:
    """The same with the async API; and a group made on a connection already closed is
    refused at once (BackendUnavailable), not made to leak what it would open."""
    locks = fenced.connect_async(f"sqlite:///{tmp_path}/locks.db")
    group = fenced.replicated.AsyncGroup("orders", locks, {"b": sqlite_member(tmp_path, "b")})
    assert await group.read("k") is None
    await locks.aclose()
    with pytest.raises(fenced.BackendUnavailable, match="closed"):
        await group.read("k")
    with pytest.raises(fenced.BackendUnavailable, match="closed"):
        fenced.replicated.AsyncGroup("orders", locks, {"b": sqlite_member(tmp_path, "b")})
