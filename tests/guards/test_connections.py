"""The one connection manager (``fenced._clients.connections``) that the SQL fencers and
members and the PostgreSQL fence store keep their connections in: a connection is reused
while it answers, dropped when it stops answering (and a new one opened), kept over a
refusal, never lent again with a transaction left open, and the ``limit`` holds — on real
PostgreSQL connections, sync and async."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import fenced
from fenced import FencingToken
from fenced._clients.connections import AsyncConnections, Connections
from fenced.guards.sql import SQLGuard
from fenced.replicated import Item, SQLMember, stamp
from fenced.testing.servers import PostgresServer
from tests.helpers import unique_name


class Opened:
    """``connect`` for the manager, counting the connections it opened."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.made: list[psycopg.Connection[Any]] = []

    def __call__(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self.dsn, autocommit=True)
        self.made.append(conn)
        return conn


def _terminate(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """Kill ``conn``'s server process, as a restart or a network cut would."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))


@pytest.fixture
def opened(pg_dsn: str) -> Iterator[Opened]:
    o = Opened(pg_dsn)
    yield o
    for conn in o.made:
        conn.close()


def test_a_connection_is_kept_over_a_refusal_and_replaced_when_it_stops_answering(
    opened: Opened,
) -> None:
    guard = SQLGuard(unique_name("res"))
    with psycopg.connect(opened.dsn, autocommit=True) as conn:
        guard.install(conn)
    fencer = guard.fencer(opened, keep_connection=True)
    try:
        fencer.fence(FencingToken(guard.resource, 5))
        with pytest.raises(fenced.StaleTokenError):  # (an answer: the connection is fine)
            fencer.fence(FencingToken(guard.resource, 4))
        fencer.fence(FencingToken(guard.resource, 6))
        assert len(opened.made) == 1
        _terminate(opened.dsn, opened.made[0])
        with pytest.raises(fenced.BackendUnavailable):
            fencer.fence(FencingToken(guard.resource, 7))
        fencer.fence(FencingToken(guard.resource, 7))  # on a new connection
        assert len(opened.made) == 2 and opened.made[0].closed
        with pytest.raises(fenced.StaleTokenError):
            fencer.fence(FencingToken(guard.resource, 6))
    finally:
        fencer.close()
    assert all(c.closed for c in opened.made)
    fencer.fence(FencingToken(guard.resource, 8))  # (closed: a later call opens anew)
    fencer.close()


def test_a_fencer_without_keep_connection_keeps_none(opened: Opened) -> None:
    guard = SQLGuard(unique_name("res"))
    with psycopg.connect(opened.dsn, autocommit=True) as conn:
        guard.install(conn)
    fencer = guard.fencer(opened)
    for value in (1, 2):
        fencer.fence(FencingToken(guard.resource, value))
    assert len(opened.made) == 2 and all(c.closed for c in opened.made)


def test_a_connection_left_in_a_transaction_is_never_lent_again(opened: Opened) -> None:
    conns: Connections[psycopg.Connection[Any]] = Connections(
        opened,
        name="test",
        healthy=lambda c: c.info.transaction_status == c.info.transaction_status.IDLE,
    )
    with conns.connection() as conn:
        conn.execute("BEGIN")
    with conns.connection() as again:
        assert again is not conn and conn.closed
    with conns.connection() as third:
        assert third is again  # (idle: kept)
    conns.close()


def test_the_limit_makes_a_caller_wait_for_the_connection(opened: Opened) -> None:
    conns: Connections[psycopg.Connection[Any]] = Connections(opened, name="test", limit=1)
    inside, release, order = threading.Event(), threading.Event(), []

    def first() -> None:
        with conns.connection():
            inside.set()
            release.wait(10)
            order.append("first")

    def second() -> None:
        with conns.connection():
            order.append("second")

    t1 = threading.Thread(target=first)
    t1.start()
    assert inside.wait(10)
    t2 = threading.Thread(target=second)
    t2.start()
    t2.join(0.2)
    assert t2.is_alive() and order == []  # waiting for the one connection
    release.set()
    t1.join(10)
    t2.join(10)
    assert order == ["first", "second"] and len(opened.made) == 1
    conns.close()


def test_a_failed_connect_is_backend_unavailable_and_frees_its_place() -> None:
    calls = 0

    def refuse() -> Any:
        nonlocal calls
        calls += 1
        raise OSError("connection refused")

    conns: Connections[Any] = Connections(refuse, name="db 'x'", limit=1)
    for _ in range(2):  # (the failed one's place is freed: no second caller waits forever)
        with pytest.raises(fenced.BackendUnavailable, match="db 'x': cannot connect"):
            with conns.connection():
                pass
    assert calls == 2


def test_the_async_manager_keeps_replaces_and_bounds(pg_dsn: str) -> None:
    made: list[Any] = []

    async def connect() -> Any:
        conn = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
        made.append(conn)
        return conn

    async def go() -> None:
        conns: AsyncConnections[Any] = AsyncConnections(connect, name="test", limit=1)
        async with conns.connection() as a:
            pass
        async with conns.connection() as b:
            assert b is a
        with pytest.raises(fenced.BackendUnavailable):
            async with conns.connection():
                raise fenced.BackendUnavailable("it stopped answering")
        assert a.closed
        with pytest.raises(fenced.StaleTokenError):
            async with conns.connection() as c:
                raise fenced.StaleTokenError("r", 1, 2)
        async with conns.connection() as d:
            assert d is c and d is not a
        # limit=1: a second caller waits for the first to give the connection back
        order: list[str] = []

        async def user(name: str, hold: float) -> None:
            async with conns.connection():
                order.append(f"{name} in")
                await asyncio.sleep(hold)
                order.append(f"{name} out")

        await asyncio.gather(user("one", 0.05), user("two", 0))
        assert order == ["one in", "one out", "two in", "two out"]
        await conns.aclose()
        assert all(conn.closed for conn in made) and len(made) == 2

    asyncio.run(go())


def test_a_sql_member_keeps_one_connection_and_runs_no_thread_of_its_own(
    opened: Opened,
) -> None:
    """The member is the guard's fencer on worker threads: one connection kept over many
    changes, a broken one replaced, and no thread of the member's own."""
    guard = SQLGuard(unique_name("res"))

    async def go() -> None:
        m = SQLMember(guard, opened, "g")
        try:
            for i in range(1, 6):
                await m.apply(FencingToken(guard.resource, 3), 1, [Item("k", stamp(3, i), b"v")])
            with pytest.raises(fenced.StaleTokenError):
                await m.apply(FencingToken(guard.resource, 2), 1, [])
            assert len(opened.made) == 1
            assert not [t for t in threading.enumerate() if t.name.startswith("fenced-member")]
            _terminate(opened.dsn, opened.made[0])
            with pytest.raises(fenced.BackendUnavailable):
                await m.read(None)
            assert (await m.read(["k"])).items["k"].stamp == stamp(3, 5)
            assert len(opened.made) == 2
        finally:
            await m.aclose()
        assert all(c.closed for c in opened.made)

    asyncio.run(go())


def test_sqlite3_connections_are_kept_one_per_thread(tmp_path: Path) -> None:
    """A ``sqlite3`` connection may only be used on the thread that made it (by default):
    the manager keeps it for that thread, and another thread gets one of its own."""
    path = tmp_path / "m.db"
    made: list[tuple[int, sqlite3.Connection]] = []

    def connect() -> sqlite3.Connection:
        conn = sqlite3.connect(path)  # (check_same_thread: its default, True)
        made.append((threading.get_ident(), conn))
        return conn

    guard = SQLGuard("res")
    with sqlite3.connect(path) as db:
        guard.install(db)
    fencer = guard.fencer(connect, keep_connection=True)
    value = 0

    def fence_three_times() -> None:
        nonlocal value
        for _ in range(3):
            value += 1
            fencer.fence(FencingToken("res", value))

    for _ in range(2):
        t = threading.Thread(target=fence_three_times)
        t.start()
        t.join(30)
    fence_three_times()  # (this thread too)
    # one connection per thread (a thread that ended may hand its ident, and so its
    # connection, to the next: sqlite3 checks the ident)
    idents = {ident for ident, _ in made}
    assert len(made) == len(idents) and threading.get_ident() in idents
    with pytest.raises(fenced.StaleTokenError):
        fencer.fence(FencingToken("res", 1))
    fencer.close()
    fencer.fence(FencingToken("res", value))
    assert len(made) == len(idents) + 1  # (closed: a new one)


def test_a_connection_refused_for_good_is_access_denied_not_unavailable(
    pg_server: PostgresServer,
) -> None:
    """The psycopg classifier decides (``_clients.pg_errors``): a role the server does not
    know is no outage a retry gets past."""
    dsn = f"postgresql://no_such_role@127.0.0.1:{pg_server.port}/postgres"
    fencer = SQLGuard("res").fencer(lambda: psycopg.connect(dsn, autocommit=True))
    with pytest.raises(fenced.AccessDenied):
        fencer.fence(FencingToken("res", 1))
