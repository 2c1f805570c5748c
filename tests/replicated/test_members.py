"""Each kind of group member keeps two marks (lock token, configuration epoch) and the data,
and changes them in one atomic step: both sides of each mark, on real servers, and the marks
survive a kill -9 of the server."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import fenced
from fenced import FencingToken
from fenced.guards.etcd import EtcdGuard
from fenced.guards.redis import RedisGuard
from fenced.guards.sql import SQLGuard
from fenced.replicated import Item, Member, stamp
from fenced.replicated._members import as_member
from fenced.testing.servers import EtcdServer, MariaDBServer, PostgresServer, RedisServer
from tests.helpers import NO_TLS, unique_name

KINDS = [
    "redis",
    "postgresql",
    "mariadb",
    "sqlalchemy-postgresql",
    "sqlite",
    "etcd",
    # async SQL members: the guard's async drivers on the group's loop, no thread
    "psycopg-async",
    "asyncmy",
    "sqlalchemy-async",
]


SERVERS: dict[str, tuple[str, type[Any]]] = {  # kind: (the session fixture, the server class)
    "redis": ("redis_server", RedisServer),
    "postgresql": ("pg_server", PostgresServer),
    "sqlalchemy-postgresql": ("pg_server", PostgresServer),
    "psycopg-async": ("pg_server", PostgresServer),
    "sqlalchemy-async": ("pg_server", PostgresServer),
    "etcd": ("etcd_server", EtcdServer),
    "mariadb": ("mariadb_server", MariaDBServer),
    "asyncmy": ("mariadb_server", MariaDBServer),
}
# Tests that kill or restart the server use one kept apart from the worker's session server
# (which gateways and other modules' tests hold connections to): one of each class for this
# module, shared by those tests (each kills it and leaves it running again; 16 server starts a
# run before). The others share the session server (a lock name and a group of their own:
# nothing of another test is seen).
OWN_SERVER = {
    "test_marks_and_data_survive_a_kill_of_the_server",
    "test_an_unreachable_member_is_a_typed_error",
}


class Made:
    """A member of one kind (its own lock name and group) and the plain guard, on the
    worker's server of that kind, or on this module's killable one (``own=True``)."""

    def __init__(self, kind: str, tmp: Path, shared: Any = None, *, own: bool = False) -> None:
        self.kind = kind
        self.resource = unique_name("res")
        self.group = unique_name("g")
        self.tmp = tmp
        self._closers: list[Callable[[], None]] = []
        self._owned = own
        self.server: Any = shared
        self.guard = self._guard()

    def _guard(self) -> Any:
        if self.kind == "redis":
            return RedisGuard(redis.Redis(port=self.server.port), self.resource)
        if self.kind == "etcd":
            g = EtcdGuard(f"127.0.0.1:{self.server.port}", self.resource)
            self._closers.append(g.close)
            return g
        if self.kind == "postgresql":
            import psycopg

            dsn = self.server.dsn
            return SQLGuard(self.resource).fencer(lambda: psycopg.connect(dsn, autocommit=True))
        if self.kind == "sqlalchemy-postgresql":
            import sqlalchemy

            url = self.server.dsn.replace("postgresql://", "postgresql+psycopg://", 1)
            engine = sqlalchemy.create_engine(url)
            self._closers.append(engine.dispose)
            return SQLGuard(self.resource).fencer(engine.connect)
        if self.kind == "mariadb":
            import pymysql

            port = self.server.port
            # (PyMySQL's default: autocommit off, the transaction opened by the first statement)
            return SQLGuard(self.resource).fencer(
                lambda: pymysql.connect(
                    host="127.0.0.1", port=port, user="root", database="fenced", **NO_TLS
                )
            )
        if self.kind == "psycopg-async":
            import psycopg

            dsn = self.server.dsn
            return SQLGuard(self.resource).afencer(
                lambda: psycopg.AsyncConnection.connect(dsn, autocommit=True)
            )
        if self.kind == "sqlalchemy-async":
            from sqlalchemy.ext.asyncio import create_async_engine
            from sqlalchemy.pool import NullPool

            url = self.server.dsn.replace("postgresql://", "postgresql+psycopg://", 1)
            # (NullPool: each test's asyncio.run is a loop of its own)
            aengine = create_async_engine(url, poolclass=NullPool)
            self._closers.append(lambda: asyncio.run(aengine.dispose()))
            return SQLGuard(self.resource).afencer(aengine.connect)
        if self.kind == "asyncmy":
            import asyncmy

            port = self.server.port
            return SQLGuard(self.resource).afencer(
                lambda: asyncmy.connect(host="127.0.0.1", port=port, user="root", database="fenced")
            )
        path = str(self.tmp / "member.db")
        return SQLGuard(self.resource).fencer(
            lambda: sqlite3.connect(path, check_same_thread=False)
        )

    def member(self, group: str | None = None) -> Member:
        return as_member(self.guard, group or self.group)

    def restart(self) -> None:
        assert self._owned or self.server is None, "a shared server is never restarted"
        if self.server is not None:
            self.server.restart(kill=True)
        self.guard = self._guard()

    def close(self) -> None:
        for c in self._closers:
            c()


@pytest.fixture(scope="module")
def killable_servers() -> Iterator[dict[type[Any], Any]]:
    """This module's servers for the tests that kill them, by class, started on first use."""
    servers: dict[type[Any], Any] = {}
    yield servers
    for server in servers.values():
        server.close()


@pytest.fixture(params=KINDS)
def made(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Made]:
    kind: str = request.param
    shared = None
    own = kind in SERVERS and request.function.__name__ in OWN_SERVER
    if own:
        # (looked up here, not a parameter: this module's other tests are not tied to it,
        # nor, through tests/conftest.py's module groups, to one xdist worker)
        killable = request.getfixturevalue("killable_servers")
        cls = SERVERS[kind][1]
        if cls not in killable:
            killable[cls] = cls()
        shared = killable[cls]
    elif kind in SERVERS:
        shared = request.getfixturevalue(SERVERS[kind][0])
    if shared is not None and shared.proc is None:  # (left down by a failed test)
        shared.start()
    m = Made(kind, tmp_path, shared, own=own)
    try:
        yield m
    finally:
        m.close()


def run(aw: Any) -> Any:
    return asyncio.run(aw)


def tok(made: Made, value: int) -> FencingToken:
    return FencingToken(made.resource, value)


def test_a_lower_token_is_refused_and_writes_nothing_the_holder_is_accepted(made: Made) -> None:
    async def go() -> None:
        m = made.member()
        await m.apply(tok(made, 5), 1, [Item("k", stamp(5, 1), b"five")])
        with pytest.raises(fenced.StaleTokenError):
            await m.apply(tok(made, 4), 1, [Item("k", stamp(4, 9), b"stale")])
        await m.apply(tok(made, 5), 1, [Item("k", stamp(5, 2), b"again")])  # equal: accepted
        snap = await m.read(None)
        assert snap.token == 5 and snap.items["k"].value == b"again"
        await m.apply(tok(made, 7), 1, [])  # a fence alone raises the mark
        with pytest.raises(fenced.StaleTokenError):
            await m.apply(tok(made, 5), 1, [Item("k", stamp(5, 3), b"late")])
        snap = await m.read(["k"])
        assert snap.token == 7 and snap.items["k"].value == b"again"
        await m.aclose()

    run(go())


def test_a_member_below_since_is_refused_and_nothing_moves_one_at_since_is_accepted(
    made: Made,
) -> None:
    """A member that came back empty (epoch 0) refuses a change that needs it in the
    configuration already: no mark moves, no item lands, no holder is kept. At ``since`` (or
    with a state transfer, since 0) it is accepted and keeps the holder's token."""

    async def go() -> None:
        m = made.member()
        for token in (tok(made, 5), None):  # a writer's change, and an epoch-only one
            items = [Item("k", stamp(5, 1), b"v")] if token else []
            with pytest.raises(fenced.MemberBehindError) as caught:
                await m.apply(token, 3, items, since=3)
            assert (caught.value.found, caught.value.needed) == (0, 3)
            snap = await m.read(None)
            assert (snap.token, snap.epoch, snap.items, snap.holder) == (0, 0, {}, None)
        await m.apply(tok(made, 5), 3, [Item("k", stamp(5, 1), b"v")], reset=True)  # a copy
        await m.apply(tok(made, 6), 3, [Item("k", stamp(6, 1), b"w")], since=3)
        await m.apply(None, 4, [], since=3)  # a change's fence: at 3, raised to 4
        with pytest.raises(fenced.MemberBehindError):
            await m.apply(tok(made, 6), 6, [], since=5)
        snap = await m.read(None)
        assert (snap.token, snap.epoch, snap.items["k"].value) == (6, 4, b"w")
        assert snap.holder == str(tok(made, 6)) and snap.holder_token(made.resource) == tok(made, 6)
        await m.aclose()

    run(go())


def test_a_state_transfer_replaces_everything_the_member_held(made: Made) -> None:
    """reset=True (a member joining): what it held is gone, the copy is there as it was, even
    an item older than one it held (etcd: no put inside a range the same transaction
    deletes, which etcd refuses)."""

    async def go() -> None:
        m = made.member()
        held = [Item("k", stamp(4, 9), b"outside"), Item("gone", stamp(4, 1), b"x")]
        await m.apply(tok(made, 4), 2, held)
        copy = [Item("k", stamp(3, 1), b"copied"), Item("new", stamp(3, 2), None)]
        await m.apply(tok(made, 5), 3, copy, reset=True)
        snap = await m.read(None)
        assert snap.epoch == 3 and snap.token == 5
        assert {k: (i.stamp, i.value) for k, i in snap.items.items()} == {
            "k": (stamp(3, 1), b"copied"),
            "new": (stamp(3, 2), None),
        }
        await m.apply(tok(made, 5), 3, [], reset=True)  # an empty copy empties it
        assert (await m.read(None)).items == {}
        await m.apply(tok(made, 5), 3, held)
        # A copy from a member never written to: no token, no items; the epoch raised.
        await m.apply(None, 4, [], reset=True)
        snap = await m.read(None)
        assert (snap.token, snap.epoch, snap.items) == (5, 4, {})
        await m.aclose()

    run(go())


def test_a_lower_epoch_is_refused_and_writes_nothing(made: Made) -> None:
    async def go() -> None:
        m = made.member()
        await m.apply(tok(made, 3), 2, [Item("k", stamp(3, 1), b"v")])
        await m.apply(None, 4, [])  # an operator's change: epoch only
        with pytest.raises(fenced.StaleEpochError) as caught:
            await m.apply(tok(made, 9), 3, [Item("k", stamp(9, 1), b"old config")])
        assert caught.value.found == 4
        snap = await m.read(None)
        assert snap.epoch == 4 and snap.items["k"].value == b"v"
        assert snap.token == 3  # refused before the lock mark moved
        await m.apply(tok(made, 9), 4, [Item("k", stamp(9, 1), b"new")])
        assert (await m.read(["k"])).items["k"].value == b"new"
        await m.aclose()

    run(go())


def test_an_older_item_never_overwrites_a_newer_one_and_deletes_are_kept(made: Made) -> None:
    async def go() -> None:
        m = made.member()
        await m.apply(
            tok(made, 2), 1, [Item("a", stamp(2, 5), b"new"), Item("b", stamp(2, 6), None)]
        )
        await m.apply(
            tok(made, 2), 1, [Item("a", stamp(2, 4), b"older"), Item("c", stamp(1, 1), b"c")]
        )
        snap = await m.read(None)
        assert snap.items["a"].value == b"new"
        assert snap.items["b"].value is None and snap.items["b"].stamp == stamp(2, 6)
        assert snap.items["c"].value == b"c"
        assert set((await m.read(["a", "zz"])).items) == {"a"}
        await m.aclose()

    run(go())


def test_the_member_and_the_plain_guard_share_one_lock_mark(made: Made) -> None:
    """``fence=[guard]`` on acquire and the group fence the same mark: a stale holder is
    refused by either path."""

    async def go() -> None:
        m = made.member()
        await m.apply(tok(made, 10), 1, [])
        await m.aclose()

    run(go())
    guard = made.guard

    def fence(token: FencingToken) -> None:
        done = guard.fence(token)
        if asyncio.iscoroutine(done):  # (an async fencer: on a loop of its own here)
            run(done)

    with pytest.raises(fenced.StaleTokenError):
        fence(tok(made, 9))
    fence(tok(made, 11))

    async def after() -> None:
        m = made.member()
        with pytest.raises(fenced.StaleTokenError):
            await m.apply(tok(made, 10), 1, [])
        await m.aclose()

    run(after())


def test_marks_and_data_survive_a_kill_of_the_server(made: Made) -> None:
    async def before() -> None:
        m = made.member()
        await m.apply(tok(made, 8), 3, [Item("k", stamp(8, 1), b"kept")])
        await m.aclose()

    run(before())
    made.restart()

    async def after() -> None:
        m = made.member()
        snap = await m.read(None)
        assert (snap.token, snap.epoch, snap.items["k"].value) == (8, 3, b"kept")
        with pytest.raises(fenced.StaleTokenError):
            await m.apply(tok(made, 7), 3, [])
        with pytest.raises(fenced.StaleEpochError):
            await m.apply(tok(made, 8), 2, [])
        await m.aclose()

    run(after())


def test_an_unreachable_member_is_a_typed_error(made: Made) -> None:
    if made.server is None:
        pytest.skip("a file has no server to stop")
    if made.kind == "etcd":  # the claim is the error's type: not the default's 10 s of retries
        made.guard = EtcdGuard(f"127.0.0.1:{made.server.port}", made.resource, timeout=2.0)
        made._closers.append(made.guard.close)
    made.server.kill()

    async def go() -> None:
        m = made.member()
        with pytest.raises(fenced.BackendUnavailable):
            async with asyncio.timeout(30):
                await m.apply(tok(made, 1), 1, [])
        await m.aclose()

    run(go())
    made.server.start()


def test_items_only_with_a_token() -> None:
    m = as_member(SQLGuard("x").fencer(lambda: sqlite3.connect(":memory:")), "g")
    with pytest.raises(fenced.ConfigurationError):
        asyncio.run(m.apply(None, 1, [Item("k", stamp(1, 1), b"v")]))
    with pytest.raises(fenced.ConfigurationError):
        as_member(object(), "g")


def test_a_read_is_one_snapshot_on_postgresql(pg_server: PostgresServer) -> None:
    """The marks, the holder and the items come from one instant: a change committed between
    the read's statements is seen whole or not at all (PostgreSQL's READ COMMITTED gives each
    statement its own snapshot, so the read asks for REPEATABLE READ)."""
    import psycopg

    pg, g = pg_server, unique_name("g")  # (the worker's server: a group of its own)
    guard = SQLGuard(unique_name("res"))
    one, two = FencingToken(guard.resource, 1), FencingToken(guard.resource, 2)
    writer = psycopg.connect(pg.dsn, autocommit=True)
    guard.install_group(writer)
    guard.apply_group(writer, token=one, group=g, epoch=1, items=[("k", stamp(1, 1), b"1")])
    statements = 0

    class Interleaved(psycopg.Connection[Any]):
        def cursor(self, *args: Any, **kw: Any) -> Any:
            nonlocal statements
            statements += 1
            if statements == 3:  # after the fence's mark was read: a change commits
                guard.apply_group(
                    writer, token=two, group=g, epoch=2, items=[("k", stamp(2, 1), b"2")]
                )
            return super().cursor(*args, **kw)

    reader = Interleaved.connect(pg.dsn, autocommit=True)
    try:
        state = guard.read_group(reader, group=g)
        assert statements > 3  # (the change did come in mid-read)
        assert (state.token, state.epoch, state.holder, state.items) == (
            1, 1, str(one), [("k", stamp(1, 1), b"1")],
        )  # fmt: skip
        state = guard.read_group(reader, group=g)
        assert (state.token, state.epoch, state.items[0][2]) == (2, 2, b"2")
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("epoch_type", ["TEXT", "BIGINT"])
def test_a_group_table_made_by_hand_with_a_text_epoch_is_refused(
    tmp_path: Path, epoch_type: str
) -> None:
    """A text epoch column would compare '10' below '9' and let an old configuration's
    writer in: the member refuses the table, typed, and writes nothing; a right one is used."""
    path = tmp_path / "m.db"
    with sqlite3.connect(path) as db:
        db.execute(f"CREATE TABLE fenced_group_epochs (grp TEXT PRIMARY KEY, epoch {epoch_type})")
    m = as_member(SQLGuard("x").fencer(lambda: sqlite3.connect(path)), "g")
    token = FencingToken("x", 1)
    if epoch_type == "TEXT":
        with pytest.raises(fenced.ConfigurationError, match="'epoch' column is TEXT"):
            run(m.apply(token, 9, []))
        with sqlite3.connect(path) as db:
            assert db.execute("SELECT count(*) FROM fenced_group_epochs").fetchone() == (0,)
    else:
        run(m.apply(token, 9, []))
        assert run(m.read(None)).epoch == 9
    run(m.aclose())


@pytest.mark.parametrize("kind", ["mariadb", "postgresql"])
def test_racing_changes_leave_the_highest_epoch_and_refuse_only_lower_ones(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """Changes of many epochs race on one member, each on its own connection: every change is
    accepted or refused as stale (or told to retry), and the epoch mark ends at the highest
    epoch accepted."""
    import threading

    # (the worker's server of that kind: a lock name and a group of their own)
    server: Any = request.getfixturevalue("mariadb_server" if kind == "mariadb" else "pg_server")
    g = unique_name("g")
    if kind == "mariadb":
        import pymysql

        def connect() -> Any:
            return pymysql.connect(
                host="127.0.0.1", port=server.port, user="root", database="fenced", **NO_TLS
            )
    else:
        import psycopg

        def connect() -> Any:
            return psycopg.connect(server.dsn, autocommit=True)

    guard = SQLGuard(unique_name("res"))
    first = connect()
    guard.install_group(first)
    first.close()
    accepted: list[int] = []
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    epochs = [e for e in range(1, 13) for _ in range(2)]
    start = threading.Barrier(len(epochs))

    def change(epoch: int) -> None:
        conn = connect()
        try:
            start.wait(60)  # (all connected first: the changes race, not the connects)
            # (epoch-only changes: a lock token would serialise them on the fence row)
            guard.apply_group(conn, token=None, group=g, epoch=epoch)
            with lock:
                accepted.append(epoch)
                outcomes["ok"] = outcomes.get("ok", 0) + 1
        except (fenced.StaleEpochError, fenced.FenceConflictError) as exc:
            with lock:
                outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
        finally:
            conn.close()

    threads = [threading.Thread(target=change, args=(e,)) for e in reversed(epochs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(outcomes.values()) == len(epochs), outcomes
    conn = connect()
    try:
        final = guard.read_group(conn, group=g).epoch
    finally:
        conn.close()
    # (a change that read the mark before a higher one committed, then wrote its own
    # lower epoch over it, would leave the mark below an accepted epoch)
    assert final == max(accepted), (final, sorted(accepted), outcomes)


def test_a_change_of_many_items_and_of_one_key_twice_keeps_the_newest(made: Made) -> None:
    """A state transfer of hundreds of keys lands whole; a key given twice in one change ends
    as its newest item (an older one given after it does not overwrite it)."""

    async def go() -> None:
        m = made.member()
        # (etcd takes 128 operations in one transaction: a larger change is refused, typed,
        # see test_an_etcd_change_too_large_for_one_transaction_is_refused_whole)
        n = 100 if made.kind == "etcd" else 450  # (SQL: more than one statement of rows)
        copy = [Item(f"k{i}", stamp(3, i + 1), str(i).encode()) for i in range(n)]
        await m.apply(tok(made, 3), 1, copy, reset=True)
        snap = await m.read(None)
        assert {k: i.value for k, i in snap.items.items()} == {i.key: i.value for i in copy}
        twice = [
            Item("a", stamp(4, 2), b"newer"),
            Item("a", stamp(4, 1), b"older"),
            Item("b", stamp(4, 1), b"older"),
            Item("b", stamp(4, 2), None),
        ]
        await m.apply(tok(made, 4), 1, twice)
        snap = await m.read(["a", "b"])
        assert (snap.items["a"].value, snap.items["b"].value) == (b"newer", None)
        assert snap.items["b"].stamp == stamp(4, 2)
        await m.aclose()

    run(go())


def test_an_etcd_change_too_large_for_one_transaction_is_refused_whole(
    etcd_server: EtcdServer,
) -> None:
    """etcd refuses a transaction of more than --max-txn-ops (128) operations, and a change
    is one atomic step (never split): a change that needs more is refused before anything is
    sent, typed, one line, and the member is unchanged; one at the limit is applied. A read
    of many keys is one snapshot still (the whole range, filtered)."""
    resource = unique_name("res")

    def t(value: int) -> FencingToken:
        return FencingToken(resource, value)

    def items(n: int, st: int, prefix: str = "k") -> list[Item]:
        return [Item(f"{prefix}{i}", stamp(st, i + 1), b"%d" % st) for i in range(n)]

    async def go(guard: EtcdGuard) -> None:
        m = as_member(guard, "g")
        # The fenced write's own branches take 2: the change has 126, the epoch and the
        # holder take 2 of them, 124 items.
        await m.apply(t(5), 1, items(124, 5))
        held = await m.read(None)
        assert (held.token, held.epoch, len(held.items)) == (5, 1, 124)
        with pytest.raises(fenced.ConfigurationError, match="125 items need 127 operations"):
            await m.apply(t(6), 2, items(125, 6))
        # A copy deletes what it does not carry: 100 new keys + 124 deletes, refused.
        with pytest.raises(fenced.ConfigurationError, match="operations in one transaction"):
            await m.apply(t(6), 2, items(100, 6, "new"), reset=True)
        assert await m.read(None) == held  # nothing was written
        # A copy of the same 124 keys (nothing to delete) is at the limit: applied.
        await m.apply(t(6), 2, items(124, 6), reset=True)
        snap = await m.read([f"k{i}" for i in range(300)])  # (more keys than one txn reads)
        assert (snap.token, snap.epoch, len(snap.items)) == (6, 2, 124)
        assert {i.value for i in snap.items.values()} == {b"6"}
        await m.aclose()

    with EtcdGuard(etcd_server.endpoint, resource) as guard:
        asyncio.run(go(guard))


def test_a_redis_read_of_many_keys_is_one_script(redis_server: RedisServer) -> None:
    """Lua's unpack() is bounded (about 8000 values): a read of more keys than that is read
    in chunks inside the one script, not refused by Lua with an untyped error."""
    resource = unique_name("res")
    guard = RedisGuard(redis.Redis(port=redis_server.port), resource)

    async def go() -> None:
        m = as_member(guard, "g")
        token = FencingToken(resource, 1)
        await m.apply(token, 1, [Item(f"k{i}", stamp(1, i + 1), b"v") for i in range(3)])
        snap = await m.read([f"k{i}" for i in range(10_000)])
        assert sorted(snap.items) == ["k0", "k1", "k2"] and snap.token == 1
        assert (await m.read([])).items == {}  # (no keys: no items)
        await m.aclose()

    asyncio.run(go())
