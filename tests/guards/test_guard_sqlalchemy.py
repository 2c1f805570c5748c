"""The SQL guards through SQLAlchemy 2 (Core ``Connection``, ORM ``Session``, ``AsyncSession``)
on SQLite, PostgreSQL (psycopg) and MariaDB (PyMySQL, asyncmy) — real servers: both sides of
the guard, the caller's transaction kept (nothing committed for it), the flush hook refusing a
write without a checked token, the DDL for migrations, an AUTOCOMMIT engine refused."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import fenced
from fenced import FencingToken
from fenced.guards.sql import Add, RowGuard, SQLGuard, require_fence

ENGINES = ["sqlite", "postgresql", "mariadb"]


def tok(value: int) -> FencingToken:
    return FencingToken("orders", value)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    status: Mapped[str] = mapped_column(sa.String(20))


@pytest.fixture(params=ENGINES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/app.db"
    elif request.param == "postgresql":
        yield request.getfixturevalue("pg_dsn").replace("postgresql://", "postgresql+psycopg://")
    else:
        db = request.getfixturevalue("mysql_db")
        yield "mysql+pymysql://root@127.0.0.1:{port}/{database}".format(**db)


@pytest.fixture
def engine(url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(url)
    Base.metadata.create_all(engine)
    with engine.connect() as conn:
        SQLGuard("orders").install(conn)
    yield engine
    engine.dispose()


def statuses(engine: sa.Engine) -> list[tuple[int, str]]:
    with engine.connect() as conn:
        return [
            tuple(r) for r in conn.execute(sa.text("SELECT id, status FROM orders ORDER BY id"))
        ]  # type: ignore[misc]


def test_a_core_connection_refuses_the_stale_and_keeps_the_current(engine: sa.Engine) -> None:
    guard = SQLGuard("orders")
    with engine.connect() as conn:
        assert guard.check(conn, token=tok(5)) == tok(5)
        conn.execute(sa.text("INSERT INTO orders (id, status) VALUES (1, 'new')"))
        conn.commit()
        with pytest.raises(fenced.StaleTokenError) as stale:
            guard.check(conn, token=tok(4))
        assert stale.value.high_water == tok(5)
        conn.rollback()
        guard.check(conn, token=tok(5))  # the holder writes again with its token
        conn.execute(sa.text("UPDATE orders SET status = 'paid' WHERE id = 1"))
        conn.commit()
    assert statuses(engine) == [(1, "paid")]
    with engine.connect() as conn:
        assert guard.high_water(conn) == tok(5)


def test_the_check_stays_in_the_callers_transaction(engine: sa.Engine) -> None:
    guard = SQLGuard("orders")
    with engine.connect() as conn:
        guard.check(conn, token=tok(7))
        conn.rollback()  # nothing was committed behind the caller's back
    with engine.connect() as conn:
        assert guard.high_water(conn) is None


def test_the_flush_hook_refuses_a_write_without_a_checked_token(engine: sa.Engine) -> None:
    guard = SQLGuard("orders")
    Sessions = sessionmaker(engine)
    require_fence(Sessions, guard, ["orders"])
    with Sessions() as session:
        session.add(Order(id=1, status="new"))
        with pytest.raises(fenced.ConfigurationError, match="without a checked token"):
            session.flush()
        session.rollback()
    assert statuses(engine) == []
    with Sessions() as session:
        guard.check(session, token=tok(3))
        session.add(Order(id=1, status="new"))
        session.commit()
    with Sessions() as session:  # a new transaction needs a new check
        session.get(Order, 1).status = "paid"  # type: ignore[union-attr]
        with pytest.raises(fenced.ConfigurationError):
            session.commit()
        session.rollback()
        with pytest.raises(fenced.StaleTokenError):
            guard.check(session, token=tok(2))
        session.rollback()
    assert statuses(engine) == [(1, "new")]


def test_the_row_form_through_a_session(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        conn.execute(sa.text("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER)"))
        conn.execute(sa.text("INSERT INTO accounts VALUES (1, 0)"))
        conn.commit()
        RowGuard("accounts", lock="orders").install(conn)
    rows = RowGuard("accounts", lock="orders")
    with Session(engine) as session:
        rows.update(session, token=tok(5), key={"id": 1}, values={"balance": Add(10)})
        session.rollback()  # the session's unit of work decides: not committed for it
        rows.update(session, token=tok(5), key={"id": 1}, values={"balance": Add(10)})
        session.commit()
        with pytest.raises(fenced.StaleTokenError):
            rows.update(session, token=tok(4), key={"id": 1}, values={"balance": Add(1)})
        session.rollback()
    with engine.connect() as conn:
        assert list(conn.execute(sa.text("SELECT balance, fencing_token FROM accounts"))) == [
            (10, 5)
        ]


def test_the_ddl_for_a_migration_is_what_install_verifies(url: str) -> None:
    engine = sa.create_engine(url)
    try:
        guard = SQLGuard("orders", table="migrated_fences")
        with engine.connect() as conn:
            conn.exec_driver_sql(guard.ddl(engine.dialect.name))
            conn.commit()
            guard.install(conn)  # adopts and verifies the table the migration made
            guard.check(conn, token=tok(1))
            conn.commit()
        with pytest.raises(fenced.ConfigurationError, match="unknown SQL dialect"):
            guard.ddl("oracle")
    finally:
        engine.dispose()


def test_an_autocommit_engine_is_refused(url: str, engine: sa.Engine) -> None:
    auto = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with auto.connect() as conn, pytest.raises(fenced.ConfigurationError, match="AUTOCOMMIT"):
            SQLGuard("orders").check(conn, token=tok(1))
    finally:
        auto.dispose()


@pytest.mark.parametrize(
    ("engine_name", "scheme"), [("postgresql", "postgresql+psycopg"), ("mariadb", "mysql+asyncmy")]
)
def test_an_async_session_is_the_same_guard(
    request: pytest.FixtureRequest, engine_name: str, scheme: str
) -> None:
    if engine_name == "postgresql":
        url = request.getfixturevalue("pg_dsn").replace("postgresql", scheme, 1)
    else:
        url = "{s}://root@127.0.0.1:{port}/{database}".format(
            s=scheme, **request.getfixturevalue("mysql_db")
        )

    async def go() -> None:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                await conn.run_sync(Base.metadata.create_all)
                await conn.commit()
                await SQLGuard("orders").ainstall(conn)
            guard = SQLGuard("orders")
            async with AsyncSession(engine) as session:
                assert await guard.acheck(session, token=tok(5)) == tok(5)
                session.add(Order(id=1, status="new"))
                await session.commit()
                with pytest.raises(fenced.StaleTokenError):
                    await guard.acheck(session, token=tok(4))
                await session.rollback()
            async with engine.connect() as conn:
                got = await conn.execute(sa.text("SELECT status FROM orders"))
                assert list(got) == [("new",)]
                assert await guard.ahigh_water(conn) == tok(5)
        finally:
            await engine.dispose()

    asyncio.run(go())


def test_an_unsupported_connection_or_parameter_style_is_a_clear_error(tmp_path: Path) -> None:
    class Fake:
        pass

    with pytest.raises(TypeError, match="unsupported connection"):
        SQLGuard("orders").check(Fake(), token=tok(1))
    named = sa.create_engine(f"sqlite:///{tmp_path}/n.db", paramstyle="named")
    try:
        with named.connect() as conn, pytest.raises(TypeError, match="named parameters"):
            SQLGuard("orders").check(conn, token=tok(1))
    finally:
        named.dispose()


def test_a_check_in_a_rolled_back_savepoint_no_longer_counts(engine: sa.Engine, url: str) -> None:
    """``begin_nested(); check(5); rollback()`` undoes the fence with the savepoint, but the
    flush hook remembered the check until the outermost transaction ended: after another
    session checked 7 and committed, the first one's flush was allowed and committed a write
    from 5. A check counts while the (sub)transaction that made it is alive; a released
    savepoint's check stays with its parent."""
    guard = SQLGuard("orders")
    Sessions = sessionmaker(engine)
    require_fence(Sessions, guard, ["orders"])
    with Sessions() as session:
        session.connection()  # the outer transaction
        sp = session.begin_nested()
        guard.check(session, token=tok(5))
        sp.rollback()
        if not url.startswith("sqlite"):  # (SQLite: one writer; the outer transaction holds it)
            with Sessions() as other:
                guard.check(other, token=tok(7))
                other.add(Order(id=7, status="from 7"))
                other.commit()
        session.add(Order(id=5, status="from 5"))
        with pytest.raises(fenced.ConfigurationError, match="without a checked token"):
            session.flush()
        session.rollback()
    with Sessions() as session:  # the rightful holder, through a released savepoint
        sp = session.begin_nested()
        guard.check(session, token=tok(8))
        sp.commit()
        inner = session.begin_nested()
        inner.rollback()  # (a later savepoint's rollback does not undo the parent's check)
        session.add(Order(id=8, status="from 8"))
        session.commit()
    want = [(8, "from 8")] if url.startswith("sqlite") else [(7, "from 7"), (8, "from 8")]
    assert statuses(engine) == want


def test_a_guarded_transaction_block_through_a_session(engine: sa.Engine) -> None:
    """``SQLGuard.transaction`` on a ``Session`` (no pipeline: begin(), the block, commit):
    the rightful token's block is committed, a stale one's rolled back."""
    guard = SQLGuard("orders")
    with Session(engine) as s:
        with guard.transaction(s, token=tok(10)):
            s.add(Order(id=1, status="ten"))
        with pytest.raises(fenced.StaleTokenError), guard.transaction(s, token=tok(9)):
            s.add(Order(id=2, status="nine"))
        assert not s.in_transaction()
    assert statuses(engine) == [(1, "ten")]


def test_a_postgresql_double_token_column_is_refused_at_use_through_sqlalchemy(
    pg_dsn: str,
) -> None:
    """The per-connection check of the token column's type runs through SQLAlchemy too: a
    ``double precision`` column made without install() (it rounds tokens above 2**53
    together) is refused with nothing written; a bigint one takes the token."""
    engine = sa.create_engine(pg_dsn.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TABLE docs (id INTEGER PRIMARY KEY, body TEXT, fencing_token DOUBLE PRECISION)"
            )
            conn.exec_driver_sql("INSERT INTO docs VALUES (1, 'original', NULL)")
        guard = RowGuard("docs", lock="orders")
        with Session(engine) as s:
            with pytest.raises(fenced.ConfigurationError, match="double precision"):
                guard.update(s, token=tok(2**53 + 1), key={"id": 1}, values={"body": "new"})
            s.rollback()
        with engine.begin() as conn:
            assert conn.exec_driver_sql("SELECT body FROM docs").all() == [("original",)]
            conn.exec_driver_sql("ALTER TABLE docs ALTER COLUMN fencing_token TYPE BIGINT")
        with Session(engine) as s:
            assert guard.update(s, token=tok(5), key={"id": 1}, values={"body": "five"}) == tok(5)
            s.commit()
    finally:
        engine.dispose()


def test_a_batch_statement_that_ends_the_transaction_stops_the_batch(engine: sa.Engine) -> None:
    """Through SQLAlchemy ``batch`` is the block form; a ``COMMIT`` among its statements
    released the fence and the statements after it ran and committed unfenced (SQLAlchemy's
    own transaction state never saw the COMMIT). Now the block stops there (the driver
    connection is asked); the rightful batch commits."""
    guard = SQLGuard("orders")
    with engine.connect() as conn:
        assert guard.batch(
            conn, [("INSERT INTO orders (id, status) VALUES (1, 'ten')", None)], token=tok(10)
        ) == [1]
        with pytest.raises(fenced.ConfigurationError, match="statement 2 ended the transaction"):
            guard.batch(
                conn,
                [
                    ("UPDATE orders SET status = 'old-1' WHERE id = 1", None),
                    ("COMMIT", None),
                    ("UPDATE orders SET status = 'old-2' WHERE id = 1", None),
                ],
                token=tok(10),
            )
        assert not conn.in_transaction()
    assert statuses(engine) == [(1, "old-1")]  # (committed by the batch's own COMMIT, fenced)
