"""``SQLGuard.transaction()`` / ``atransaction()`` whose block ends its own transaction, off
psycopg's ride: sqlite3, PyMySQL and asyncmy on MariaDB, SQLAlchemy Core and ORM (sync and
async) over SQLite, PostgreSQL and MariaDB — real servers.

The attack: the old holder's block commits (``conn.commit()``, a ``COMMIT`` statement, DDL on
MariaDB) midway, which releases the fence row; a newer holder fences and writes; then the old
block writes again. That later write must never commit (the savepoint witness is gone, what
is open is rolled back, StaleTokenError), and the newer holder's write stays. The other
sides: a block that ends its transaction with nobody newer is a ConfigurationError with
nothing after the end committed; a block that does not end it commits as before."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import fenced
from fenced import ConfigurationError, FencingToken, StaleTokenError
from fenced.guards.sql import SQLGuard
from tests.helpers import asyncmy_args

ENDS = ["commit()", "COMMIT"]


def tok(value: int) -> FencingToken:
    return FencingToken("acct", value)


class Base(DeclarativeBase):
    pass


class Acct(Base):
    __tablename__ = "acct"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    v: Mapped[str] = mapped_column(sa.String(20))


@dataclass
class Driver:
    """One way to run ``transaction()``'s block: its connections and statements."""

    connect: Callable[[], Any]  # a connection (or session) of this kind
    write: Callable[[Any, str], None]  # acct row 1's v := value, in the block
    end: Callable[[Any, str], None]  # "commit()", "COMMIT" or "DDL", in the block
    read: Callable[[], str]  # acct row 1's v, committed
    close: Callable[[Any], None]
    is_async: bool = False


# -- the drivers ---------------------------------------------------------------------------


def _sqlite(path: Path, **kw: Any) -> Driver:
    import sqlite3

    def connect() -> Any:
        return sqlite3.connect(path, timeout=20, **kw)

    def end(c: Any, how: str) -> None:
        c.commit() if how == "commit()" else c.execute(how)

    def read() -> str:
        with sqlite3.connect(path) as c:
            return str(c.execute("SELECT v FROM acct WHERE id = 1").fetchone()[0])

    setup = sqlite3.connect(path, isolation_level=None)
    setup.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v TEXT)")
    setup.execute("INSERT INTO acct VALUES (1, 'init')")
    SQLGuard("acct").install(setup)
    setup.close()
    return Driver(
        connect, lambda c, v: c.execute("UPDATE acct SET v = ? WHERE id = 1", (v,)), end, read,
        lambda c: c.close(),
    )  # fmt: skip


def _mysql_sql(c: Any, statement: str, params: tuple[Any, ...] = ()) -> list[Any]:
    with c.cursor() as cur:
        cur.execute(statement, params)
        return list(cur.fetchall()) if cur.description else []


_DDL = "CREATE TABLE IF NOT EXISTS ddl_inside (i INT) ENGINE=InnoDB"


def _mysql_setup(db: dict[str, Any]) -> Callable[[], str]:
    with pymysql.connect(**db, autocommit=True) as c:
        _mysql_sql(c, "CREATE TABLE acct (id INT PRIMARY KEY, v VARCHAR(20)) ENGINE=InnoDB")
        _mysql_sql(c, "INSERT INTO acct VALUES (1, 'init')")
        SQLGuard("acct").install(c)

    def read() -> str:
        with pymysql.connect(**db, autocommit=True) as c:
            return str(_mysql_sql(c, "SELECT v FROM acct WHERE id = 1")[0][0])

    return read


def _pymysql(db: dict[str, Any], autocommit: bool) -> Driver:
    read = _mysql_setup(db)

    def end(c: Any, how: str) -> None:
        c.commit() if how == "commit()" else _mysql_sql(c, _DDL if how == "DDL" else how)

    return Driver(
        lambda: pymysql.connect(**db, autocommit=autocommit),
        lambda c, v: _mysql_sql(c, "UPDATE acct SET v = %s WHERE id = 1", (v,)) and None,
        end, read, lambda c: c.close(),
    )  # fmt: skip


def _sa_setup(engine: sa.Engine) -> Callable[[], str]:
    Base.metadata.create_all(engine)
    with engine.connect() as c:
        c.execute(sa.text("INSERT INTO acct (id, v) VALUES (1, 'init')"))
        c.commit()
        SQLGuard("acct").install(c)

    def read() -> str:
        with engine.connect() as c:
            return str(c.execute(sa.text("SELECT v FROM acct WHERE id = 1")).scalar_one())

    return read


def _sa_end(c: Any, how: str) -> None:
    if how == "commit()":
        c.commit()
    else:
        c.execute(sa.text(_DDL if how == "DDL" else how))


def _sa_core(engine: sa.Engine) -> Driver:
    read = _sa_setup(engine)

    def write(c: Any, v: str) -> None:
        c.execute(sa.text("UPDATE acct SET v = :v WHERE id = 1"), {"v": v})

    return Driver(engine.connect, write, _sa_end, read, lambda c: c.close())


def _sa_orm(engine: sa.Engine) -> Driver:
    read = _sa_setup(engine)

    def write(s: Session, v: str) -> None:
        row = s.get(Acct, 1)
        assert row is not None
        row.v = v
        s.flush()

    return Driver(lambda: Session(engine), write, _sa_end, read, lambda s: s.close())


def _asyncmy(db: dict[str, Any], autocommit: bool) -> Driver:
    import asyncmy

    read = _mysql_setup(db)

    async def connect() -> Any:
        return await asyncmy.connect(**asyncmy_args(db), autocommit=autocommit)

    async def execute(c: Any, statement: str, params: tuple[Any, ...] = ()) -> None:
        async with c.cursor() as cur:
            await cur.execute(statement, params)

    async def end(c: Any, how: str) -> None:
        if how == "commit()":
            await c.commit()
        else:
            await execute(c, _DDL if how == "DDL" else how)

    async def close(c: Any) -> None:
        c.close()

    return Driver(
        connect, lambda c, v: execute(c, "UPDATE acct SET v = %s WHERE id = 1", (v,)),  # type: ignore[arg-type,return-value]
        end, read, close, is_async=True,  # type: ignore[arg-type]
    )  # fmt: skip


def _sa_async(url: str, sync_url: str, orm: bool) -> Driver:
    read = _sa_setup(sa.create_engine(sync_url))
    engine = create_async_engine(url)

    async def connect() -> Any:
        return AsyncSession(engine) if orm else await engine.connect()

    async def write(c: Any, v: str) -> None:
        if orm:
            row = await c.get(Acct, 1)
            row.v = v
            await c.flush()
        else:
            await c.execute(sa.text("UPDATE acct SET v = :v WHERE id = 1"), {"v": v})

    async def end(c: Any, how: str) -> None:
        if how == "commit()":
            await c.commit()
        else:
            await c.execute(sa.text(how))

    async def close(c: Any) -> None:
        await c.close()
        if engine.sync_engine.pool.checkedout() == 0:  # (each asyncio.run has its own loop)
            await engine.dispose()

    return Driver(connect, write, end, read, close, is_async=True)  # type: ignore[arg-type]


SYNC = [
    "sqlite3-autocommit",
    "sqlite3-deferred",
    "pymysql",
    "pymysql-autocommit",
    "sa-core-sqlite",
    "sa-core-postgresql",
    "sa-core-mariadb",
    "sa-orm-sqlite",
    "sa-orm-postgresql",
    "sa-orm-mariadb",
]
ASYNC = [
    "asyncmy",
    "asyncmy-autocommit",
    "sa-async-core-postgresql",
    "sa-async-core-mariadb",
    "sa-async-orm-postgresql",
    "sa-async-orm-mariadb",
]


def _urls(request: pytest.FixtureRequest, engine: str, tmp_path: Path) -> tuple[str, str]:
    """(sync URL, async URL) of ``engine`` for SQLAlchemy."""
    if engine == "sqlite":
        return f"sqlite:///{tmp_path}/app.db", ""
    if engine == "postgresql":
        dsn = request.getfixturevalue("pg_dsn")
        return (
            dsn.replace("postgresql://", "postgresql+psycopg://"),
            dsn.replace("postgresql://", "postgresql+psycopg://"),
        )
    db = request.getfixturevalue("mysql_db")
    tail = "root@127.0.0.1:{port}/{database}".format(**db)
    return f"mysql+pymysql://{tail}", f"mysql+asyncmy://{tail}"


def _marks(name: str) -> Any:
    group = "mariadb" if "mysql" in name or "mariadb" in name else "sql"
    return pytest.param(name, marks=pytest.mark.xdist_group(group), id=name)


@pytest.fixture
def driver(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Driver]:
    name: str = request.param
    made: list[sa.Engine] = []
    if name.startswith("sqlite3"):
        level = None if name.endswith("autocommit") else ""
        yield _sqlite(tmp_path / "guarded.db", isolation_level=level)
        return
    if name.startswith(("pymysql", "asyncmy")):
        db = request.getfixturevalue("mysql_db")
        autocommit = name.endswith("autocommit")
        yield (_pymysql if name.startswith("pymysql") else _asyncmy)(db, autocommit)
        return
    engine_name = name.rsplit("-", 1)[1]
    sync_url, async_url = _urls(request, engine_name, tmp_path)
    if name.startswith("sa-async"):
        yield _sa_async(async_url, sync_url, orm="-orm-" in name)
        return
    engine = sa.create_engine(sync_url)
    made.append(engine)
    yield (_sa_orm if "-orm-" in name else _sa_core)(engine)
    for e in made:
        e.dispose()


# -- the scenarios, run the same on every driver ------------------------------------------


async def _maybe(value: Any) -> Any:
    return await value if isinstance(value, Awaitable) else value


async def _block(d: Driver, token: int, steps: Callable[[Any], Awaitable[None]]) -> object:
    """One ``transaction()`` (or ``atransaction()``) of ``steps``; its outcome: "committed"
    or the FencedError it raised."""
    guard = SQLGuard("acct")
    c = await _maybe(d.connect())
    try:
        if d.is_async:
            async with guard.atransaction(c, token=tok(token)):
                await steps(c)
        else:
            with guard.transaction(c, token=tok(token)):
                await steps(c)
        return "committed"
    except fenced.FencedError as exc:
        return exc
    finally:
        await _maybe(d.close(c))


def _run(d: Driver, end: str | None, newer: bool) -> object:
    """The old holder (token 5) writes 'old-1', ends its transaction with ``end`` (None: does
    not), a newer holder (token 6, another connection) then writes 'new' if ``newer``, and
    the old holder writes 'old-2'. Returns the old holder's outcome."""

    async def old(c: Any) -> None:
        await _maybe(d.write(c, "old-1"))
        if end is not None:
            await _maybe(d.end(c, end))
        if newer:
            assert await _block(d, 6, lambda n: _maybe(d.write(n, "new"))) == "committed"
        await _maybe(d.write(c, "old-2"))

    return asyncio.run(_block(d, 5, old))


def _high_water(d: Driver) -> Any:
    async def read() -> Any:
        c = await _maybe(d.connect())
        try:
            if d.is_async:
                return await SQLGuard("acct").ahigh_water(c)
            return SQLGuard("acct").high_water(c)
        finally:
            await _maybe(d.close(c))

    return asyncio.run(read())


ALL = [_marks(n) for n in SYNC + ASYNC]


@pytest.mark.parametrize("end", ENDS)
@pytest.mark.parametrize("driver", ALL, indirect=True)
def test_a_block_that_commits_midway_lets_no_stale_write_in(driver: Driver, end: str) -> None:
    """After the block's own end a newer holder fences and writes: the old block's later
    write is rolled back (the witness is gone), StaleTokenError; the newer write stays. Its
    message never claims more than the guard knows: what committed as it ran stays."""
    outcome = _run(driver, end, newer=True)
    assert isinstance(outcome, StaleTokenError), outcome
    assert "stays committed, unfenced" in str(outcome)
    assert outcome.high_water == tok(6)
    assert driver.read() == "new"
    assert _high_water(driver) == tok(6)


@pytest.mark.parametrize("end", ENDS)
@pytest.mark.parametrize("driver", ALL, indirect=True)
def test_a_block_that_commits_midway_with_nobody_newer_is_told_so(driver: Driver, end: str) -> None:
    """Nobody newer: ConfigurationError ("ended the transaction"); what ran before the end
    was committed (fenced), what ran after it was not."""
    outcome = _run(driver, end, newer=False)
    assert isinstance(outcome, ConfigurationError), outcome
    assert "ended the transaction" in str(outcome)
    assert "stays committed, unfenced" in str(outcome)
    assert driver.read() == "old-1"
    assert _high_water(driver) == tok(5)


@pytest.mark.parametrize("driver", ALL, indirect=True)
def test_a_block_that_does_not_end_its_transaction_commits_as_before(driver: Driver) -> None:
    assert _run(driver, None, newer=False) == "committed"
    assert driver.read() == "old-2"
    assert _high_water(driver) == tok(5)
    # (and the connection is left as it was found: the next holder's block commits too)
    assert _run(driver, None, newer=False) == "committed"


DDL = [_marks(n) for n in ("pymysql", "pymysql-autocommit", "asyncmy", "sa-core-mariadb")]


@pytest.mark.parametrize("driver", DDL, indirect=True)
def test_ddl_inside_the_block_on_mariadb_commits_implicitly_and_is_caught(
    driver: Driver,
) -> None:
    """DDL commits the open transaction implicitly on MariaDB: the same end as a COMMIT."""
    outcome = _run(driver, "DDL", newer=True)
    assert isinstance(outcome, StaleTokenError), outcome
    assert driver.read() == "new"


def test_pymysql_in_autocommit_gets_its_autocommit_back(mysql_db: dict[str, Any]) -> None:
    """The guard runs an autocommit connection's block with autocommit off (so a statement
    after an end opens a transaction the witness refuses): set back after, either way."""
    d = _pymysql(mysql_db, autocommit=True)
    guard = SQLGuard("acct")
    c = pymysql.connect(**mysql_db, autocommit=True)
    try:
        with guard.transaction(c, token=tok(5)):
            d.write(c, "x")
            assert not c.get_autocommit()
        assert c.get_autocommit()
        with pytest.raises(ConfigurationError), guard.transaction(c, token=tok(5)):
            c.commit()
            d.write(c, "y")
        assert c.get_autocommit()
        assert d.read() == "x"
    finally:
        c.close()


def test_psycopg_is_untouched_by_the_witness(pg_dsn: str) -> None:
    """psycopg keeps its ride (the recheck with COMMIT, no savepoint): its block that commits
    midway is refused as before (the check for the other drivers does not reach it)."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        guard = SQLGuard("acct")
        guard.install(c)
        c.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v TEXT)")
        c.execute("INSERT INTO acct VALUES (1, 'init')")
        with pytest.raises(ConfigurationError, match="ended the transaction"):
            with guard.transaction(c, token=tok(5)):
                c.execute("UPDATE acct SET v = 'a'")
                c.commit()
                c.execute("UPDATE acct SET v = 'b'")
        assert c.execute("SELECT v FROM acct").fetchall() == [("a",)]


def test_sqlite_autocommit_after_the_end_is_told_as_it_ran(tmp_path: Path) -> None:
    """sqlite3 with ``isolation_level=None``: the guard runs the block DEFERRED, so a write
    after an end opens a transaction (rolled back above); a statement sqlite3 opens none
    for (DDL), or any once the block sets ``isolation_level`` back to None, commits as it
    runs: told so, never as "rolled back"; the level is None again after the block."""
    import sqlite3

    d = _sqlite(tmp_path / "guarded.db", isolation_level=None)
    c = d.connect()
    guard = SQLGuard("acct")
    try:
        with pytest.raises(ConfigurationError, match="committed as it ran, unfenced"):
            with guard.transaction(c, token=tok(5)):
                d.write(c, "a")
                c.execute("COMMIT")
                c.isolation_level = None
                d.write(c, "b")
        assert d.read() == "b"  # (as told)
        assert c.isolation_level is None
        with pytest.raises(ConfigurationError, match="other than INSERT, UPDATE, DELETE"):
            with guard.transaction(c, token=tok(5)):
                c.execute("COMMIT")
                c.execute("CREATE TABLE made_after_the_end (i INTEGER)")
                d.write(c, "c")
        assert d.read() == "b"
        assert c.isolation_level is None and not c.in_transaction
        with sqlite3.connect(tmp_path / "guarded.db") as other:
            assert other.execute("SELECT count(*) FROM made_after_the_end").fetchone() == (0,)
    finally:
        c.close()


def _in_mode(d: Driver, mode: str) -> Driver:
    """``d``'s connections with ``sql_mode`` set (PyMySQL or asyncmy)."""
    connect = d.connect

    async def aconnect() -> Any:
        c = await connect()
        async with c.cursor() as cur:
            await cur.execute(f"SET SESSION sql_mode = '{mode}'")
        return c

    def sconnect() -> Any:
        c = connect()
        _mysql_sql(c, f"SET SESSION sql_mode = '{mode}'")
        return c

    return Driver(aconnect if d.is_async else sconnect, d.write, d.end, d.read, d.close, d.is_async)


@pytest.mark.xdist_group("mariadb")
@pytest.mark.parametrize("mode", ["ORACLE", "TRADITIONAL", "ANSI,NO_BACKSLASH_ESCAPES"])
@pytest.mark.parametrize("kind", ["pymysql", "asyncmy"])
def test_the_witness_rides_on_mariadb_under_every_sql_mode(
    mysql_db: dict[str, Any], mode: str, kind: str
) -> None:
    """On MariaDB the witness rides in compound statements with the check and the COMMIT;
    sql_mode=ORACLE parses none (a syntax error before anything ran): the statements then go
    one by one. Either way the block commits, and one that ends its transaction midway lets
    no stale write in."""
    d = _in_mode((_pymysql if kind == "pymysql" else _asyncmy)(mysql_db, False), mode)
    assert _run(d, None, newer=False) == "committed"
    assert d.read() == "old-2"
    outcome = _run(d, "COMMIT", newer=True)
    assert isinstance(outcome, StaleTokenError), outcome
    assert d.read() == "new"
    assert _high_water(d) == tok(6)


@pytest.mark.xdist_group("mariadb")
def test_a_block_that_sets_sql_mode_oracle_still_commits_and_is_still_fenced(
    mysql_db: dict[str, Any],
) -> None:
    """The check rode in a compound statement; the block then sets sql_mode=ORACLE, so the
    riding COMMIT is a syntax error (nothing ran): RELEASE and COMMIT go one by one."""
    d = _pymysql(mysql_db, False)
    guard = SQLGuard("acct")
    c = d.connect()
    try:
        with guard.transaction(c, token=tok(5)):
            d.write(c, "oracle")
            _mysql_sql(c, "SET SESSION sql_mode = 'ORACLE'")
        assert d.read() == "oracle"
        with pytest.raises(ConfigurationError, match="ended the transaction"):
            with guard.transaction(c, token=tok(5)):
                _mysql_sql(c, "SET SESSION sql_mode = 'TRADITIONAL'")
                c.commit()
                _mysql_sql(c, "SET SESSION sql_mode = 'ORACLE'")
                d.write(c, "after the end")
        assert d.read() == "oracle"
        assert not c.server_status & 1
    finally:
        c.close()


@pytest.mark.xdist_group("mariadb")
def test_the_witness_costs_no_statement_of_its_own_on_mariadb(mysql_db: dict[str, Any]) -> None:
    """The server's count of statements sent by the client (``Questions``): the guarded
    transaction of one UPDATE sends as many as the unfenced one (the check with the
    savepoint, the UPDATE, the release with the COMMIT)."""
    d = _pymysql(mysql_db, False)
    guard = SQLGuard("acct")
    c = d.connect()

    def questions() -> int:
        return int(_mysql_sql(c, "SHOW SESSION STATUS LIKE 'Questions'")[0][1])

    def sent(transaction: Callable[[], None]) -> int:
        before = questions()
        transaction()
        return questions() - before - 1  # (the SHOW itself)

    def guarded() -> None:
        with guard.transaction(c, token=tok(5)):
            d.write(c, "guarded")

    def unfenced() -> None:
        d.write(c, "unfenced")
        _mysql_sql(c, "UPDATE acct SET v = 'also' WHERE id = 1")  # (the check's peer)
        c.commit()

    try:
        guarded()  # (the first use of the table on a connection verifies it: not counted)
        assert sent(guarded) == sent(unfenced) == 3
    finally:
        c.close()


@pytest.mark.parametrize("driver", [_marks(n) for n in SYNC if n.startswith("sa-")], indirect=True)
def test_a_savepoint_of_sqlalchemys_left_open_in_the_block_is_committed_with_it(
    driver: Driver,
) -> None:
    """``begin_nested()`` left open at the block's end: released before the witness (as
    SQLAlchemy's commit would), then the whole committed, as before the witness."""

    async def old(c: Any) -> None:
        await _maybe(driver.write(c, "outer"))
        c.begin_nested()
        await _maybe(driver.write(c, "nested"))

    assert asyncio.run(_block(driver, 5, old)) == "committed"
    assert driver.read() == "nested"


@pytest.mark.xdist_group("mariadb")
@pytest.mark.parametrize("mode", ["TRADITIONAL", "ORACLE"])
@pytest.mark.parametrize("kind", ["pymysql", "asyncmy"])
def test_a_rollback_to_the_witness_on_mariadb_keeps_the_fence(
    mysql_db: dict[str, Any], mode: str, kind: str
) -> None:
    """The block's ``ROLLBACK TO SAVEPOINT fenced_transaction``: the witness is set after
    the check (riding or one by one), so the rollback undoes the block's work only: the
    fence row stays locked (a newer holder waits) and the mark is the block's token."""
    d = _in_mode((_pymysql if kind == "pymysql" else _asyncmy)(mysql_db, False), mode)
    other = pymysql.connect(**mysql_db, autocommit=True)

    async def steps(c: Any) -> None:
        await _maybe(d.write(c, "undone"))
        if d.is_async:
            async with c.cursor() as cur:
                await cur.execute("ROLLBACK TO SAVEPOINT fenced_transaction")
        else:
            _mysql_sql(c, "ROLLBACK TO SAVEPOINT fenced_transaction")
        with pytest.raises(pymysql.err.OperationalError):  # (locked: 1205 at once)
            _mysql_sql(
                other,
                "SELECT token FROM fenced_fences WHERE resource = %s FOR UPDATE NOWAIT",
                ("acct",),
            )
        await _maybe(d.write(c, "kept"))

    try:
        assert asyncio.run(_block(d, 5, steps)) == "committed"
        assert d.read() == "kept"
        assert _high_water(d) == tok(5)
    finally:
        other.close()


# -- statements after the end that commit as they run: never told as rolled back -----------


async def _late_sqlite_script(c: Any) -> None:
    c.executescript("UPDATE acct SET v = 'old-2' WHERE id = 1;")


async def _late_sqlite_cte(c: Any) -> None:
    # (sqlite3 opens no transaction for a statement that starts with WITH)
    c.execute("WITH n(v) AS (SELECT 'old-2') UPDATE acct SET v = (SELECT v FROM n) WHERE id = 1")


async def _late_pymysql_autocommit(c: Any) -> None:
    c.autocommit(True)
    _mysql_sql(c, "UPDATE acct SET v = 'old-2' WHERE id = 1")


async def _late_pymysql_set_autocommit(c: Any) -> None:
    _mysql_sql(c, "SET autocommit = 1")
    _mysql_sql(c, "UPDATE acct SET v = 'old-2' WHERE id = 1")


async def _late_asyncmy_autocommit(c: Any) -> None:
    await c.autocommit(True)
    async with c.cursor() as cur:
        await cur.execute("UPDATE acct SET v = 'old-2' WHERE id = 1")


async def _late_sa_autocommit(c: Any) -> None:
    c.execution_options(isolation_level="AUTOCOMMIT")
    c.execute(sa.text("UPDATE acct SET v = 'old-2' WHERE id = 1"))


async def _late_sa_several(c: Any) -> None:
    c.exec_driver_sql("COMMIT; UPDATE acct SET v = 'old-2' WHERE id = 1")


AS_THEY_RUN = [
    ("sqlite3-deferred", _late_sqlite_script),
    ("sqlite3-autocommit", _late_sqlite_script),
    ("sqlite3-deferred", _late_sqlite_cte),
    ("sqlite3-autocommit", _late_sqlite_cte),
    ("pymysql", _late_pymysql_autocommit),
    ("pymysql", _late_pymysql_set_autocommit),
    ("asyncmy", _late_asyncmy_autocommit),
    ("sa-core-sqlite", _late_sa_autocommit),
    ("sa-core-mariadb", _late_sa_autocommit),
    ("sa-core-postgresql", _late_sa_several),
]


@pytest.mark.parametrize(
    ("driver", "late"),
    [
        pytest.param(n, f, marks=_marks(n).marks, id=f"{n}-{f.__name__.removeprefix('_late_')}")
        for n, f in AS_THEY_RUN
    ],
    indirect=["driver"],
)
def test_a_stale_write_that_committed_as_it_ran_is_told_so_never_as_rolled_back(
    driver: Driver, late: Callable[[Any], Awaitable[None]]
) -> None:
    """After the block's end a newer holder fences and writes; the old block's later write
    then commits as it runs (autocommit turned on, executescript(), a WITH statement sqlite3
    opens no transaction for, several statements in one message). No check at the end can
    take it back: the guard, which can tell (autocommit on, or no transaction open, at the
    block's end), says so in a ConfigurationError (never a refusal: a StaleTokenError tells
    the caller nothing was written), and the write is there, as told."""

    async def old(c: Any) -> None:
        await _maybe(driver.write(c, "old-1"))
        await _maybe(driver.end(c, "commit()"))
        assert await _block(driver, 6, lambda n: _maybe(driver.write(n, "new"))) == "committed"
        await late(c)

    outcome = asyncio.run(_block(driver, 5, old))
    assert isinstance(outcome, ConfigurationError), outcome
    assert "committed as it ran, unfenced" in str(outcome)
    assert "over the newer holder's writes" in str(outcome)
    assert "was rolled back" not in str(outcome)
    assert driver.read() == "old-2"  # (as told)


def test_psycopg_several_statements_in_one_message_after_the_end_are_told_as_they_ran(
    pg_dsn: str,
) -> None:
    """psycopg's ride: a message of several statements after the block's end commits as it
    runs (BEGIN; UPDATE; COMMIT): no transaction open at the block's end, told so."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        guard = SQLGuard("acct")
        guard.install(c)
        c.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v TEXT)")
        c.execute("INSERT INTO acct VALUES (1, 'init')")
        with pytest.raises(ConfigurationError) as caught:
            with guard.transaction(c, token=tok(5)):
                c.execute("UPDATE acct SET v = 'a'")
                c.commit()
                with psycopg.connect(pg_dsn) as n, guard.transaction(n, token=tok(6)):
                    n.execute("UPDATE acct SET v = 'new'")
                c.execute("UPDATE acct SET v = 'b'; COMMIT")
        assert "committed as it ran, unfenced" in str(caught.value)
        assert "was rolled back" not in str(caught.value)
        assert c.execute("SELECT v FROM acct").fetchall() == [("b",)]


@pytest.mark.parametrize("driver", [_marks("pymysql"), _marks("asyncmy")], indirect=True)
def test_a_block_that_turns_autocommit_on_leaves_it_off_as_found(driver: Driver) -> None:
    """A connection the guard found with autocommit off, whose block turned it on: off again
    after the transaction (either way it ends)."""

    async def run(ok: bool) -> bool:
        c = await _maybe(driver.connect())
        guard = SQLGuard("acct")
        try:
            try:
                if driver.is_async:
                    async with guard.atransaction(c, token=tok(5)):
                        await c.autocommit(True)
                        if not ok:
                            raise RuntimeError("the block's")
                else:
                    with guard.transaction(c, token=tok(5)):
                        c.autocommit(True)
                        if not ok:
                            raise RuntimeError("the block's")
            except (fenced.FencedError, RuntimeError):
                pass
            return bool(c.get_autocommit())
        finally:
            await _maybe(driver.close(c))

    assert asyncio.run(run(True)) is False
    assert asyncio.run(run(False)) is False


@pytest.mark.parametrize("level", ["", None])
def test_a_rollback_to_the_witness_on_sqlite_keeps_the_fence(tmp_path: Path, level: Any) -> None:
    """sqlite3: the witness is a savepoint set after the check (inside a BEGIN), so the
    block's ``ROLLBACK TO SAVEPOINT fenced_transaction`` undoes its own work only: the mark
    is the block's token when it commits, and an older token is refused after it."""
    d = _sqlite(tmp_path / "guarded.db", isolation_level=level)
    guard = SQLGuard("acct")
    c = d.connect()
    try:
        with guard.transaction(c, token=tok(3)):
            d.write(c, "three")
        with guard.transaction(c, token=tok(5)):
            d.write(c, "undone")
            c.execute("ROLLBACK TO SAVEPOINT fenced_transaction")
            d.write(c, "five")
        assert d.read() == "five"
        assert guard.high_water(c) == tok(5)
        with pytest.raises(StaleTokenError), guard.transaction(c, token=tok(3)):
            d.write(c, "stale")
        assert d.read() == "five"
    finally:
        c.close()


# -- what ran before the end: told only as the guard knows it ---------------------------------

ROLLED_BACK = "what ran before the end was rolled back"
NEVER_CLAIMED = "before the end was committed"  # (unless the guard knows: psycopg's txid)


@pytest.mark.parametrize("end", ["ROLLBACK", "RELEASE SAVEPOINT fenced_transaction"])
@pytest.mark.parametrize("driver", ALL, indirect=True)
def test_a_block_whose_end_rolled_back_is_never_told_committed(driver: Driver, end: str) -> None:
    """The block rolls its transaction back (a ROLLBACK, as a caught deadlock's does), or
    releases the witness itself (the guard's RELEASE then fails, its rollback undoes the
    whole transaction), then writes again. The error said "what ran before the end was
    committed, fenced": nothing was. The fence row (none: a first fence) shows the check's
    transaction never committed: told as rolled back."""
    outcome = _run(driver, end, newer=False)
    assert isinstance(outcome, ConfigurationError), outcome
    assert ROLLED_BACK in str(outcome)
    assert NEVER_CLAIMED not in str(outcome)
    assert driver.read() == "init"
    assert _high_water(driver) is None


@pytest.mark.parametrize("driver", ALL, indirect=True)
def test_a_block_that_committed_midway_is_told_committed_or_rolled_back(driver: Driver) -> None:
    """The block commits midway (nobody newer): the fence row holds the token, which this
    transaction or another of the same token may have committed: the guard says "committed
    or rolled back", never a commit it cannot know (off psycopg's ride)."""
    outcome = _run(driver, "COMMIT", newer=False)
    assert isinstance(outcome, ConfigurationError), outcome
    assert "committed or rolled back, depending on how it ended" in str(outcome)
    assert driver.read() == "old-1"


def test_sqlite_insert_or_rollback_caught_in_the_block_is_told_rolled_back(
    tmp_path: Path,
) -> None:
    """``INSERT OR ROLLBACK`` fails and rolls back the whole transaction, fence included; the
    block catches it and writes on (in a new transaction). Told as rolled back (the mark
    below the token: 3 committed before, 5 rolled back), nothing of 5 committed."""
    import sqlite3

    d = _sqlite(tmp_path / "guarded.db")
    guard = SQLGuard("acct")
    c = d.connect()
    try:
        with guard.transaction(c, token=tok(3)):
            d.write(c, "three")
        with pytest.raises(ConfigurationError) as caught, guard.transaction(c, token=tok(5)):
            d.write(c, "five")
            with pytest.raises(sqlite3.IntegrityError):
                c.execute("INSERT OR ROLLBACK INTO acct VALUES (1, 'dup')")
            d.write(c, "after")
        assert ROLLED_BACK in str(caught.value)
        assert NEVER_CLAIMED not in str(caught.value)
        assert d.read() == "three"
        assert guard.high_water(c) == tok(3)
    finally:
        c.close()


@pytest.mark.parametrize("how", ["rollback()", "commit()", "commit() and a newer holder"])
def test_psycopg_tells_what_became_of_the_checked_transaction(pg_dsn: str, how: str) -> None:
    """psycopg's ride: the refusal read asks txid_status of the transaction the check ran
    in: a block's conn.rollback() is told as rolled back (was: "committed, fenced"), its
    conn.commit() as committed, fenced (definite), with or without a newer holder: then a
    ConfigurationError naming the newer token (was StaleTokenError, though 'a' committed)."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        guard = SQLGuard("acct")
        guard.install(c)
        c.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v TEXT)")
        c.execute("INSERT INTO acct VALUES (1, 'init')")
        with pytest.raises(fenced.FencedError) as caught:
            with guard.transaction(c, token=tok(5)):
                c.execute("UPDATE acct SET v = 'a'")
                c.rollback() if how == "rollback()" else c.commit()
                if how.endswith("newer holder"):
                    with psycopg.connect(pg_dsn) as n, guard.transaction(n, token=tok(6)):
                        n.execute("UPDATE acct SET v = 'new'")
                c.execute("UPDATE acct SET v = 'b'")
        said = str(caught.value)
        if how == "rollback()":
            assert isinstance(caught.value, ConfigurationError), caught.value
            assert ROLLED_BACK in said and NEVER_CLAIMED not in said
            assert c.execute("SELECT v FROM acct").fetchall() == [("init",)]
        else:
            stale = how.endswith("newer holder")
            # (committed: never StaleTokenError, which says nothing of the call was written)
            assert isinstance(caught.value, ConfigurationError), caught.value
            assert ("was accepted since" in said) is stale
            assert "what ran before the end was committed, fenced" in said
            assert c.execute("SELECT v FROM acct").fetchall() == [("new" if stale else "a",)]
