"""Run the SQL guards' plans on a live connection: sqlite3, psycopg 3 sync and async, PyMySQL
and asyncmy (MySQL/MariaDB) — or a SQLAlchemy ``Connection``/``Session`` over any of them
(and ``AsyncConnection``/``AsyncSession``), whose statements go through ``exec_driver_sql`` in
the caller's SQLAlchemy transaction.

The drivers are deliberately thin: execute each statement a plan yields, hand back the rows,
and translate the driver's errors into fenced's tree at this boundary:

* closed connection, lost or dead server, I/O failure -> :class:`BackendUnavailable`;
* concurrent-transaction refusals (PostgreSQL SQLSTATE class 40 and 55P03, SQLite
  ``SQLITE_BUSY``/``SQLITE_LOCKED``, MySQL deadlock 1213 and lock wait timeout 1205) ->
  :class:`FenceConflictError` (retry the transaction);
* a missing fence table / token column / unique key -> :class:`ConfigurationError`;
* anything else the database refused (a constraint of the caller's data, a value a column
  cannot hold, an already-failed transaction) -> :class:`ConfigurationError`, which no retry
  passes: only the refusals above say retry. The driver's error is the ``__cause__``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import sqlite3
import sys
import weakref
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterator,
    Mapping,
    Sequence,
)
from functools import partial
from typing import Any, Final, NoReturn, TypeVar

from .._clients.pg_errors import kind as pg_kind
from .._clients.sqlite_errors import is_busy, is_unavailable
from .._core.errors import (
    BackendUnavailable,
    ConfigurationError,
    FencedError,
    StaleTokenError,
)
from .._core.token import FencingToken
from ._plan import adrive, drive
from ._sql_plan import (
    AUTOCOMMIT_ON as _AUTOCOMMIT_ON,
)
from ._sql_plan import (
    MYSQL,
    POSTGRESQL,
    RIDE_REFUSED,
    SQLITE,
    STALE_SQLSTATE,
    Dialect,
    DuplicateColumn,
    FenceConflictError,
    FenceSQL,
    Plan,
    Result,
    RowSQL,
    Stmt,
    TableUse,
    accept_plan,
    check_plan,
    check_verdict,
    fence_sql,
    mariadb_batch_check,
    mariadb_batch_recheck,
    pg_pipelined_check,
    pg_ride_refusal_read,
    pg_ride_sql,
    pipelined_refusal,
    row_write_accepted,
    row_write_plan,
    row_write_rest,
    table_use_plan,
)

__all__ = [
    "arun",
    "arun_install",
    "arun_own",
    "arun_transaction",
    "in_transaction",
    "map_error",
    "require_transaction",
    "run",
    "run_install",
    "run_own",
    "run_own_row",
    "run_transaction",
    "sync_dialect",
]

T = TypeVar("T")


def _psycopg() -> Any:
    # psycopg is optional: a connection can only be a psycopg one if psycopg is imported.
    return sys.modules.get("psycopg")


# Which driver a connection belongs to, learnt once per connection type: a guarded write asks
# several times (dialect, open transaction, SQLAlchemy or not), and a chain of isinstance
# checks and module look-ups each time was a measurable share of a guarded write's Python.
_KINDS: dict[type, str] = {}
_KIND_LIMIT = 64  # (types are few; a program making classes on the fly must not grow it)


def _learn_kind(conn: object) -> str:
    if isinstance(conn, sqlite3.Connection):
        return "sqlite3"
    pg = _psycopg()
    if pg is not None:
        if isinstance(conn, pg.Connection):
            return "psycopg"
        if isinstance(conn, pg.AsyncConnection):
            return "psycopg-async"
    mod = sys.modules.get("pymysql.connections")
    if mod is not None and isinstance(conn, mod.Connection):
        return "pymysql"
    mod = sys.modules.get("asyncmy.connection")
    if mod is not None and isinstance(conn, mod.Connection):
        return "asyncmy"
    return ""  # none of ours (a SQLAlchemy object, or unsupported)


def _kind(conn: object) -> str:
    """The driver of ``conn``: "sqlite3", "psycopg", "psycopg-async", "pymysql", "asyncmy",
    or "" for none of them."""
    kind = _KINDS.get(type(conn))
    if kind is None:
        kind = _learn_kind(conn)
        if len(_KINDS) < _KIND_LIMIT:
            _KINDS[type(conn)] = kind
    return kind


def _pymysql_connection(conn: object) -> bool:
    return _kind(conn) == "pymysql"


def _asyncmy_connection(conn: object) -> bool:
    return _kind(conn) == "asyncmy"


# -- MySQL and PostgreSQL tables verified per connection ---------------------------------------

# The tables each driver connection has verified (table_use_plan): once per connection and
# table, so a hand-made MyISAM table, or a SMALLINT or double precision token column, is
# refused at use, not only by install(), for one catalog look-up per connection.
_USED: weakref.WeakKeyDictionary[Any, set[TableUse]] = weakref.WeakKeyDictionary()
# asyncmy's connections take no weak references: by address and server thread id instead
# (a new connection at a freed address has another thread id), the oldest forgotten first
_USED_BY_ID: dict[tuple[int, object], set[TableUse]] = {}
_USED_BY_ID_LIMIT = 1024


def _verified(raw: Any) -> set[TableUse]:
    """The tables ``raw`` has verified (a set to add to)."""
    try:
        return _USED.setdefault(raw, set())
    except TypeError:
        key = (id(raw), raw.thread_id())
        uses = _USED_BY_ID.get(key)
        if uses is None:
            if len(_USED_BY_ID) >= _USED_BY_ID_LIMIT:
                del _USED_BY_ID[next(iter(_USED_BY_ID))]
            uses = _USED_BY_ID[key] = set()
        return uses


def _is_verified(raw: Any, use: TableUse) -> bool:
    """Has ``raw`` verified ``use``? (A look-up only: on every guarded write.)"""
    try:
        uses = _USED.get(raw)
    except TypeError:
        uses = _USED_BY_ID.get((id(raw), raw.thread_id()))
    return uses is not None and use in uses


def _verify_then(raw: Any, d: Dialect, use: TableUse, plan: Plan[T]) -> Generator[Stmt, Result, T]:
    if (yield from table_use_plan(d, use)):
        _verified(raw).add(use)
    return (yield from plan)


def _using(raw: Any, d: Dialect, use: TableUse | None, plan: Plan[T]) -> Plan[T]:
    """``plan``, preceded by the verification of ``use`` if ``raw`` has not passed it yet."""
    if d is SQLITE or use is None or raw is None or _is_verified(raw, use):
        return plan
    return _verify_then(raw, d, use, plan)


def _found_rows(raw: Any) -> bool:
    """Does this MySQL client count found rather than changed rows (CLIENT.FOUND_ROWS)?
    Unknown: assume it does (an ambiguous count is then read out, never trusted)."""
    return bool(getattr(raw, "client_flag", 2) & 2)


# -- SQLAlchemy ------------------------------------------------------------------------------

_SA_DIALECTS = {"sqlite": SQLITE, "postgresql": POSTGRESQL, "mysql": MYSQL, "mariadb": MYSQL}


def sa_connection(conn: object) -> Any:
    """The SQLAlchemy ``Connection`` behind ``conn`` (itself, or a ``Session``'s connection for
    its current transaction, which this begins), or None if ``conn`` is no SQLAlchemy object."""
    if "sqlalchemy" not in sys.modules or _kind(conn):  # (a driver's own connection)
        return None
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    if isinstance(conn, Session):
        return conn.connection()
    if isinstance(conn, Connection):
        return conn
    return None


def sa_connection_kind(conn: object) -> bool:
    """Is ``conn`` a SQLAlchemy ``Connection`` or ``Session`` (without beginning anything)?"""
    if "sqlalchemy" not in sys.modules:
        return False
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    return isinstance(conn, Connection | Session)


def sa_async(conn: object) -> bool:
    """Is ``conn`` a SQLAlchemy ``AsyncConnection`` or ``AsyncSession``?"""
    if "sqlalchemy.ext.asyncio" not in sys.modules:
        return False
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    return isinstance(conn, AsyncConnection | AsyncSession)


def sa_in_transaction(conn: Any) -> bool:
    """A SQLAlchemy Connection or Session: is a transaction open (before we begin one)?"""
    return bool(conn.in_transaction())


def _sa_dialect(sa_conn: Any) -> Dialect:
    d = _SA_DIALECTS.get(sa_conn.dialect.name)
    if d is None:
        raise TypeError(
            f"SQLAlchemy dialect {sa_conn.dialect.name!r}: the SQL guards support sqlite, "
            "postgresql, mysql and mariadb"
        )
    # our statements carry the driver's own markers (? or %s): the driver must take them
    wanted = ("qmark",) if d is SQLITE else ("format", "pyformat")
    if sa_conn.dialect.paramstyle not in wanted:
        raise TypeError(
            f"SQLAlchemy driver {sa_conn.dialect.driver!r} takes {sa_conn.dialect.paramstyle} "
            f"parameters; the SQL guards support {d.name} drivers taking {' or '.join(wanted)} "
            "(sqlite3/aiosqlite, psycopg, PyMySQL, asyncmy)"
        )
    return d


def _sa_map(d: Dialect, sa_conn: Any) -> Callable[[BaseException], FencedError | None]:
    def mapped(exc: BaseException) -> FencedError | None:
        from sqlalchemy import exc as sa_exc

        if isinstance(exc, sa_exc.DBAPIError) and exc.orig is not None:
            return map_error(d, None, exc.orig)
        if isinstance(exc, sa_exc.ResourceClosedError):
            return BackendUnavailable(f"the SQLAlchemy connection is closed: {exc}")
        return None

    return mapped


def _sa_require_transaction(sa_conn: Any) -> None:
    """Refuse an engine in AUTOCOMMIT isolation (the fence would commit on its own)."""
    if sa_conn.closed:
        raise BackendUnavailable("the SQLAlchemy connection is closed")
    raw = sa_conn.connection.driver_connection
    level = sa_conn.get_execution_options().get("isolation_level")
    autocommit = level == "AUTOCOMMIT"
    if isinstance(raw, sqlite3.Connection):
        autocommit = autocommit or (raw.isolation_level is None and not raw.in_transaction)
    elif _pymysql_connection(raw) or _asyncmy_connection(raw):
        autocommit = autocommit or (raw.get_autocommit() and not in_transaction(raw))
    elif hasattr(raw, "autocommit") and hasattr(raw, "info"):  # psycopg
        autocommit = autocommit or (raw.autocommit and not in_transaction(raw))
    if autocommit:
        raise ConfigurationError(
            "SQLGuard.check() needs the caller's transaction: this SQLAlchemy connection runs "
            "in AUTOCOMMIT isolation; use a transactional connection or session"
        )


CHECKED = "fenced.checked"
"""``Session.info`` key: resource -> (token, the innermost ``SessionTransaction`` it was
checked in, savepoint or not). ``require_fence`` forgets a check when that transaction, or
one around it, is rolled back: a savepoint's rollback undoes the fence with the rest."""


def note_checked(conn: Any, resource: str, token: object) -> None:
    """Remember in a SQLAlchemy session that ``resource`` was checked (for require_fence)."""
    session = getattr(conn, "sync_session", conn)
    orm = sys.modules.get("sqlalchemy.orm")
    if orm is not None and isinstance(session, orm.Session):
        made_in = session.get_nested_transaction() or session.get_transaction()
        session.info.setdefault(CHECKED, {})[resource] = (token, made_in)


def sa_install(conn: Any, make_plan: Callable[[Dialect], Plan[T]]) -> T:
    """DDL through SQLAlchemy: in the caller's transaction if one is open (MySQL: refused, DDL
    commits it), else in one of its own that it commits."""
    was_open = sa_in_transaction(conn)
    sa_conn = sa_connection(conn)
    if _sa_dialect(sa_conn) is MYSQL and was_open:
        raise ConfigurationError(
            "install() on MySQL runs DDL, which commits the open transaction: call it "
            "outside a transaction"
        )
    value = run_sa(sa_conn, make_plan)
    if not was_open:
        conn.commit()
    return value


def run_sa(
    sa_conn: Any,
    make_plan: Callable[[Dialect], Plan[T]],
    *,
    need_tx: bool = False,
    use: TableUse | None = None,
) -> T:
    """Run a plan through a SQLAlchemy Connection, in its (auto-begun) transaction."""
    d = _sa_dialect(sa_conn)
    if need_tx:
        _sa_require_transaction(sa_conn)
    raw = sa_conn.connection.driver_connection if d is not SQLITE else None
    found = _found_rows(raw)

    def send(stmt: Stmt) -> Result:
        result = sa_conn.exec_driver_sql(stmt.sql, stmt.params)
        rows = [tuple(r) for r in result.fetchall()] if result.returns_rows else []
        return Result(rows, result.rowcount, found)

    return drive(_using(raw, d, use, make_plan(d)), send, _sa_map(d, sa_conn))


_SYNC_KINDS = (
    "sqlite3.Connection, psycopg.Connection, pymysql.connections.Connection, or (with the "
    "a...() methods) psycopg.AsyncConnection and asyncmy's Connection"
)


_SYNC_DIALECTS = {"sqlite3": SQLITE, "psycopg": POSTGRESQL, "pymysql": MYSQL}
_ASYNC_DIALECTS = {"psycopg-async": POSTGRESQL, "asyncmy": MYSQL}


def sync_dialect(conn: object) -> Dialect:
    """The dialect of a synchronous connection, or a clear TypeError."""
    kind = _kind(conn)
    d = _SYNC_DIALECTS.get(kind)
    if d is not None:
        return d
    if kind == "psycopg-async":
        raise TypeError("an async psycopg connection: use the guard's a...() methods")
    if kind == "asyncmy":
        raise TypeError("an asyncmy connection: use the guard's a...() methods")
    raise TypeError(f"unsupported connection {type(conn).__name__}: use {_SYNC_KINDS}")


def _async_dialect(conn: object) -> Dialect:
    d = _ASYNC_DIALECTS.get(_kind(conn))
    if d is not None:
        return d
    raise TypeError(f"unsupported async connection {type(conn).__name__}: use {_SYNC_KINDS}")


_MYSQL_IN_TRANS = 1  # SERVER_STATUS_IN_TRANS in the server's status flags


def _mysql_open(conn: Any) -> bool:
    return bool(conn.connected if _asyncmy_connection(conn) else conn.open)


def in_transaction(conn: Any) -> bool:
    """Whether a transaction block is open on ``conn`` (any supported driver)."""
    kind = _kind(conn)
    if kind == "pymysql" or kind == "asyncmy":
        return bool(conn.server_status & _MYSQL_IN_TRANS)
    if kind == "sqlite3":
        try:
            return conn.in_transaction  # type: ignore[no-any-return]
        except sqlite3.ProgrammingError:  # closed: let the statement report it
            return False
    status = conn.info.transaction_status
    return bool(status != status.IDLE)


def reusable(conn: Any) -> bool:
    """Whether a connection fenced kept may be lent again: still open, and no transaction
    left open on it (every guarded call ends its own; one left open would hold its locks
    and mix the next call's statements into it)."""
    try:
        if sa_connection_kind(conn) or sa_async(conn):
            return not bool(getattr(conn, "closed", False)) and not sa_in_transaction(conn)
        kind = _kind(conn)
        if kind in ("pymysql", "asyncmy"):
            return _mysql_open(conn) and not in_transaction(conn)
        if kind == "sqlite3":
            return not conn.in_transaction
        if kind in ("psycopg", "psycopg-async"):
            return not (conn.closed or conn.broken) and not in_transaction(conn)
    except Exception:  # (closed under us: sqlite3's ProgrammingError and the like)
        return False
    return False


def require_transaction(conn: Any) -> None:
    """Refuse a fence check that would commit on its own, apart from the caller's writes.

    Drivers in their default mode start a transaction implicitly before the fence's INSERT
    (sqlite3's legacy mode, psycopg without autocommit); only explicit autocommit with no
    transaction open is refused.
    """
    if isinstance(conn, sqlite3.Connection):
        try:
            if conn.in_transaction:
                return
            autocommit = getattr(conn, "autocommit", -1)  # Python 3.12+; -1 = legacy mode
            if autocommit is True or (autocommit == -1 and conn.isolation_level is None):
                raise ConfigurationError(
                    "SQLGuard.check() needs the caller's transaction: the connection is in "
                    "autocommit mode; run it inside 'BEGIN IMMEDIATE' ... 'COMMIT'"
                )
        except sqlite3.ProgrammingError as exc:
            raise BackendUnavailable(f"sqlite3 connection unusable: {exc}") from exc
        return
    if _pymysql_connection(conn) or _asyncmy_connection(conn):
        if not _mysql_open(conn):
            raise BackendUnavailable("the MySQL connection is closed")
        if conn.get_autocommit() and not in_transaction(conn):
            raise ConfigurationError(
                "SQLGuard.check() needs the caller's transaction: the connection is in "
                "autocommit mode; call conn.begin() first"
            )
        return
    if conn.closed:
        raise BackendUnavailable("the psycopg connection is closed")
    if conn.autocommit and not in_transaction(conn):
        raise ConfigurationError(
            "SQLGuard.check() needs the caller's transaction: the connection is in autocommit "
            "mode; run it inside 'with conn.transaction():'"
        )


_MYSQL_CONFLICT = frozenset({1205, 1213})  # lock wait timeout, deadlock: retry the transaction
_MYSQL_GONE = frozenset({0, 1053, 1927, 2003, 2006, 2013, 2055, 4031})
_MYSQL_SCHEMA = frozenset({1054, 1146})  # unknown column, no such table
# a value the column cannot hold (out of range, not a number, too long, truncated)
_MYSQL_VALUE = frozenset({1264, 1265, 1366, 1406})
_MYSQL_INTERRUPTED = frozenset({1317, 1969, 3024})  # KILL QUERY, statement time limits


def _map_mysql(exc: BaseException) -> FencedError | None:
    """Every PyMySQL/asyncmy error as a fenced error: only a concurrent transaction's refusal
    says retry; a refusal that would recur on retry (a duplicate key of the caller's data, a
    value its column cannot hold, SQL the server rejects) is a ConfigurationError."""
    module = type(exc).__module__
    if not module.startswith(("pymysql", "asyncmy")):
        if isinstance(exc, ConnectionError | OSError):  # asyncmy lets socket errors through
            return BackendUnavailable(f"MySQL connection unavailable: {exc}")
        return None
    code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    name = type(exc).__name__
    said = f"{name} {code}: {exc.args[-1] if exc.args else exc}"
    if code in _MYSQL_CONFLICT:
        return FenceConflictError(f"MySQL refused the fence ({said}): roll back and retry")
    if code == 1060:
        return DuplicateColumn(str(exc.args[-1]))
    if code in _MYSQL_SCHEMA:
        return ConfigurationError(f"{said}: has the guard been installed (guard.install())?")
    if code in _MYSQL_GONE or name == "InterfaceError" or str(exc) == "Already closed":
        return BackendUnavailable(f"MySQL connection unavailable: {said}")
    if code in _MYSQL_VALUE:
        return ConfigurationError(
            f"MySQL refused a value ({said}): a column cannot hold it (a token column must be "
            "BIGINT); the transaction must be rolled back, and a retry would fail the same way"
        )
    if code in _MYSQL_INTERRUPTED or (name == "OperationalError" and (code or 0) >= 2000):
        return BackendUnavailable(f"MySQL connection unavailable: {said}")
    return ConfigurationError(
        f"MySQL refused the guard's statement ({said}); the transaction must be rolled back, "
        "and a retry would fail the same way"
    )


def map_error(d: Dialect, conn: Any, exc: BaseException) -> FencedError | None:
    """The fenced error for a driver error raised by one of our statements, or None."""
    if d is MYSQL:
        return _map_mysql(exc)
    if d is SQLITE:
        if isinstance(exc, sqlite3.ProgrammingError) and "closed" in str(exc):
            return BackendUnavailable(f"sqlite3 connection is closed: {exc}")
        if not isinstance(exc, sqlite3.Error):
            return None
        msg = str(exc)
        if is_busy(exc) or "database is locked" in msg:
            return FenceConflictError(
                f"SQLite refused the fence ({getattr(exc, 'sqlite_errorname', msg)}): another "
                "connection holds the write lock or this transaction's snapshot is stale. "
                "Roll back and retry; start fenced transactions with BEGIN IMMEDIATE"
            )
        if is_unavailable(exc):
            return BackendUnavailable(f"SQLite database unavailable: {msg}")
        if msg.startswith("duplicate column name"):
            return DuplicateColumn(msg)
        if msg.startswith(("no such table", "no such column", "table ")) or "ON CONFLICT" in msg:
            return ConfigurationError(f"{msg}: has the guard been installed (guard.install())?")
        if "readonly database" in msg and _sqlite_query_only(conn):
            return ConfigurationError(
                f"SQLite refused the guard's write ({msg}): PRAGMA query_only is on for this "
                "connection (an earlier statement on it set it, e.g. a batch's); set it off"
            )
        return _refused("SQLite", exc)
    what = pg_kind(exc, conn)
    if what is None:
        return None
    if what == "conflict" or getattr(exc, "sqlstate", None) == "57014":
        # (57014: statement_timeout, typically spent waiting for a competitor's row lock)
        return FenceConflictError(
            f"PostgreSQL refused the fence ({type(exc).__name__}: {exc}). The transaction "
            "is aborted: roll back and retry it"
        )
    if what == "unreachable":
        return BackendUnavailable(f"PostgreSQL connection unavailable: {exc}")
    if what == "schema":
        if getattr(exc, "sqlstate", None) == "42703":  # undefined column
            return ConfigurationError(
                f"{exc}: has the guard been installed (guard.install())? Column names are "
                "compared exactly on PostgreSQL (the guard quotes them): give names created "
                "unquoted in lower case"
            )
        return ConfigurationError(f"{exc}: has the guard been installed (guard.install())?")
    if what == "type":
        return ConfigurationError(
            f"{exc}: a column has the wrong type; the token column must be BIGINT "
            "(guard.install() checks it)"
        )
    if what == "read-only":
        return BackendUnavailable(f"PostgreSQL is read-only here (a standby?): {exc}")
    if getattr(exc, "sqlstate", None) == "25P02":
        return ConfigurationError(
            f"{exc}: the transaction had already failed before the guard's statement; "
            "roll it back (the error that failed it is the one to look at)"
        )
    return _refused("PostgreSQL", exc)


def _sqlite_query_only(conn: Any) -> bool:
    """Is PRAGMA query_only on for ``conn``? (Asked on a read-only refusal only.)"""
    try:
        return bool(conn.execute("PRAGMA query_only").fetchone()[0])
    except Exception:
        return False


def _refused(engine: str, exc: BaseException) -> ConfigurationError:
    """A driver error no retry can pass (a constraint of the caller's data, a value its
    column cannot take, SQL the database rejects): typed, and not saying retry."""
    return ConfigurationError(
        f"{engine} refused the guard's statement ({type(exc).__name__}: {exc}); the "
        "transaction must be rolled back, and a retry would fail the same way"
    )


def _exec_sqlite(conn: sqlite3.Connection, stmt: Stmt) -> Result:
    cur = conn.execute(stmt.sql, stmt.params)
    try:
        return Result(cur.fetchall(), cur.rowcount)
    finally:
        cur.close()


def _begin_stmt(conn: Any, stmt: Stmt) -> bytes:
    """``BEGIN; <stmt>`` with the parameters rendered as literals (by psycopg, quoted safely):
    the simple-query protocol carries both in one round trip (it takes no parameters)."""
    if conn.info.parameter_status("standard_conforming_strings") != "on":
        raise ConfigurationError("begin() needs standard_conforming_strings = on")
    rendered: bytes = _render_begin(stmt.sql, stmt.params, conn.info.encoding)
    return rendered


@functools.lru_cache(maxsize=256)
def _render_begin(sql: str, params: tuple[Any, ...], encoding: str) -> bytes:
    # (Rendering with psycopg.sql costs ~50 µs; a holder repeats the same token: cached.)
    pg = _psycopg()
    template = sql.replace("{", "{{").replace("}", "}}").replace("%s", "{}")
    query = pg.sql.SQL(template).format(*map(pg.sql.Literal, params))
    text: str = query.as_string(None)
    return b"BEGIN; " + text.encode(encoding)


def _exec_mysql(conn: Any, stmt: Stmt) -> Result:
    with conn.cursor() as cur:
        cur.execute(stmt.sql, stmt.params)
        rows = list(cur.fetchall()) if cur.description else []
        return Result(rows, cur.rowcount, _found_rows(conn))


async def _aexec_mysql(conn: Any, stmt: Stmt) -> Result:
    async with conn.cursor() as cur:
        await cur.execute(stmt.sql, stmt.params)
        rows = list(await cur.fetchall()) if cur.description else []
        return Result(rows, cur.rowcount, _found_rows(conn))


def _exec_psycopg(conn: Any, stmt: Stmt) -> Result:
    with conn.cursor() as cur:
        cur.execute(stmt.sql, stmt.params)
        return Result(cur.fetchall() if cur.description else [], cur.rowcount)


async def _aexec_psycopg(conn: Any, stmt: Stmt) -> Result:
    async with conn.cursor() as cur:
        await cur.execute(stmt.sql, stmt.params)
        return Result(await cur.fetchall() if cur.description else [], cur.rowcount)


_EXECUTE_BY_KIND: dict[str, Callable[[Any, Stmt], Result]] = {
    "sqlite3": _exec_sqlite,
    "psycopg": _exec_psycopg,
    "pymysql": _exec_mysql,
}


def run_own(
    conn: Any, make_plan: Callable[[Dialect], Plan[T]], *, use: TableUse | None = None
) -> T:
    """Run a one-statement write; if the driver had to open a transaction for it, end it.

    sqlite3 (legacy mode) and psycopg (autocommit off) open a transaction implicitly before a
    write. Left open, the acknowledged write would be lost when the connection closes (and
    SQLite's write lock held meanwhile). So a transaction this call opened is committed on
    success and rolled back on refusal; a transaction the caller had open is left to them.
    """
    sa_conn = sa_connection(conn)
    if sa_conn is not None:  # the caller's unit of work commits, as SQLAlchemy users expect
        return run_sa(sa_conn, make_plan, use=use)
    d = sync_dialect(conn)
    if in_transaction(conn):
        return run(conn, make_plan, use=use, dialect=d)
    try:
        value = run(conn, make_plan, use=use, dialect=d)
    except BaseException:
        if in_transaction(conn):
            _end(conn, commit=False)
        raise
    if in_transaction(conn):
        _end(conn, commit=True)
    return value


def run_own_row(
    conn: Any,
    spec: RowSQL,
    token: FencingToken,
    key: Mapping[str, Any],
    statement: Callable[[Dialect], tuple[Stmt, tuple[Any, ...]]],
    *,
    upsert: bool,
    use: TableUse | None = None,
) -> FencingToken:
    """:class:`RowGuard`'s write (``statement``: see :func:`row_write_stmt`): :func:`run_own`
    of :func:`row_write_plan`, with the plan's first step taken here. The one statement goes
    straight to the driver, and only a reply that does not plainly accept goes on through
    the plan (:func:`row_write_rest`): the plan's machinery around a guarded write was most
    of what it cost above the statement itself (bench/bench_sql_guard.py)."""
    kind = _kind(conn)
    execute = _EXECUTE_BY_KIND.get(kind)
    if execute is None:  # SQLAlchemy, or not a connection we know: the general way
        return run_own(
            conn,
            lambda d: row_write_plan(d, spec, token, key, statement(d), upsert=upsert),
            use=use,
        )
    d = _SYNC_DIALECTS[kind]
    stmt, key_params = statement(d)
    opened = not in_transaction(conn)
    try:
        if use is not None and d is not SQLITE and not _is_verified(conn, use):
            # (after `opened`: without autocommit this look-up opens the transaction we end)
            drive(
                _verify_then(conn, d, use, _nothing()),
                lambda stmt: execute(conn, stmt),
                lambda exc: map_error(d, conn, exc),
            )
        try:
            res = execute(conn, stmt)
        except Exception as exc:
            _raise_mapped(d, conn, exc)
        accepted = token
        if not row_write_accepted(d, res, upsert):
            rest = row_write_rest(d, spec, token, key, key_params, res, upsert=upsert)
            accepted = drive(
                rest, lambda stmt: execute(conn, stmt), lambda exc: map_error(d, conn, exc)
            )
    except BaseException:
        if opened and in_transaction(conn):
            _end(conn, commit=False, d=d)
        raise
    if opened and in_transaction(conn):
        _end(conn, commit=True, d=d)
    return accepted


def _nothing() -> Plan[None]:
    return
    yield  # (a plan of no statements)


async def arun_own(
    conn: Any, make_plan: Callable[[Dialect], Plan[T]], *, use: TableUse | None = None
) -> T:
    """The async :func:`run_own`."""
    if sa_async(conn):
        return await conn.run_sync(  # type: ignore[no-any-return]
            lambda c: run_own(c, make_plan, use=use)
        )
    _async_dialect(conn)
    if in_transaction(conn):
        return await arun(conn, make_plan, use=use)
    try:
        value = await arun(conn, make_plan, use=use)
    except BaseException:
        if in_transaction(conn):
            await _aend(conn, commit=False)
        raise
    if in_transaction(conn):
        await _aend(conn, commit=True)
    return value


def _end(conn: Any, *, commit: bool, d: Dialect | None = None) -> None:
    d = sync_dialect(conn) if d is None else d
    try:
        conn.commit() if commit else conn.rollback()
    except Exception as exc:
        _raise_mapped(d, conn, exc)


async def _aend(conn: Any, *, commit: bool) -> None:
    d = _async_dialect(conn)
    try:
        await (conn.commit() if commit else conn.rollback())
    except Exception as exc:
        _raise_mapped(d, conn, exc)


def _refuse_ddl_in_transaction(conn: Any) -> None:
    if not _mysql_open(conn):
        raise BackendUnavailable("the MySQL connection is closed")
    if in_transaction(conn):
        raise ConfigurationError(
            "install() on MySQL runs DDL, which commits the open transaction: call it "
            "outside a transaction"
        )


def _refuse_open_transaction(conn: Any) -> None:
    _refuse_closed(conn)
    _refuse_open(in_transaction(conn), "begin()")


def _refuse_closed(conn: Any) -> None:
    """A closed psycopg or MySQL connection is BackendUnavailable (its transaction status,
    unknown or as last reported, would otherwise read as a transaction already open)."""
    kind = _kind(conn)
    if kind in ("psycopg", "psycopg-async") and conn.closed:
        raise BackendUnavailable("the psycopg connection is closed")
    if kind == "asyncmy" and not conn.connected:
        # (asyncmy closes a connection whose statement was cancelled mid-way, a timeout's
        # cancellation included: the server rolls back what it had open)
        raise BackendUnavailable(
            "the asyncmy connection is closed (asyncmy closes a connection whose statement "
            "was cancelled, e.g. by a timeout): open another"
        )
    if kind == "pymysql" and not conn.open:
        raise BackendUnavailable("the MySQL connection is closed")


def _refuse_open(already: bool, what: str) -> None:
    if already:
        raise ConfigurationError(
            f"{what} starts the transaction, and one is already open: use check() inside it"
        )


def _raise_mapped(d: Dialect, conn: Any, exc: Exception) -> NoReturn:
    """Raise the fenced error a driver's ``exc`` means (``from exc``), else ``exc`` itself."""
    mapped = map_error(d, conn, exc)
    if mapped is None:
        raise exc
    raise mapped from exc


def _begin_psycopg(conn: Any, stmt: Stmt) -> Result:
    with conn.cursor() as cur:
        cur.execute(_begin_stmt(conn, stmt), prepare=False)  # (two statements)
        cur.nextset()  # past BEGIN's empty result, to the statement's
        return Result(cur.fetchall() if cur.description else [], cur.rowcount)


async def _abegin_psycopg(conn: Any, stmt: Stmt) -> Result:
    async with conn.cursor() as cur:
        await cur.execute(_begin_stmt(conn, stmt), prepare=False)  # (two statements)
        cur.nextset()
        return Result(await cur.fetchall() if cur.description else [], cur.rowcount)


def run(
    conn: Any,
    make_plan: Callable[[Dialect], Plan[T]],
    *,
    need_tx: bool = False,
    begin: bool = False,
    use: TableUse | None = None,
    dialect: Dialect | None = None,
) -> T:
    """Run a plan on a synchronous connection (see the module doc).

    ``begin``: start the caller's transaction with the plan's first statement (PostgreSQL in
    autocommit mode: in one round trip; otherwise BEGIN IMMEDIATE / the driver's own BEGIN;
    SQLAlchemy begins by itself). ``dialect``: the DB-API connection's, known already (no
    SQLAlchemy connection then).
    """
    d = dialect
    if d is None:
        sa_conn = sa_connection(conn)
        if sa_conn is not None:
            return run_sa(sa_conn, make_plan, need_tx=need_tx or begin, use=use)
        d = sync_dialect(conn)
    execute: Callable[[Any, Stmt], Result] = (
        _exec_sqlite if d is SQLITE else _exec_mysql if d is MYSQL else _exec_psycopg
    )
    if not begin:  # the hot path: statements as they are
        if need_tx:
            require_transaction(conn)
        return drive(
            _using(conn, d, use, make_plan(d)),
            lambda stmt: execute(conn, stmt),
            lambda exc: map_error(d, conn, exc),
        )
    begun = True
    _refuse_open_transaction(conn)
    if d is SQLITE or (d is MYSQL and conn.get_autocommit()):
        # (MySQL without autocommit opens the transaction at the fence itself: no BEGIN)
        try:
            conn.execute("BEGIN IMMEDIATE") if d is SQLITE else conn.begin()
        except Exception as exc:
            _raise_mapped(d, conn, exc)
    elif d is POSTGRESQL:
        begun = not conn.autocommit  # psycopg begins by itself then

    def send(stmt: Stmt) -> Result:
        nonlocal begun
        if begun:
            return execute(conn, stmt)
        begun = True
        return _begin_psycopg(conn, stmt)  # BEGIN and the first statement in one round trip

    return drive(_using(conn, d, use, make_plan(d)), send, lambda exc: map_error(d, conn, exc))


async def arun(
    conn: Any,
    make_plan: Callable[[Dialect], Plan[T]],
    *,
    need_tx: bool = False,
    begin: bool = False,
    use: TableUse | None = None,
) -> T:
    """Run a plan on an async connection (``begin``: see :func:`run`)."""
    if sa_async(conn):
        return await conn.run_sync(  # type: ignore[no-any-return]
            lambda c: run(c, make_plan, need_tx=need_tx, begin=begin, use=use)
        )
    d = _async_dialect(conn)
    if begin:
        _refuse_open_transaction(conn)
    elif need_tx:
        require_transaction(conn)
    if d is MYSQL:
        if begin and conn.get_autocommit():
            try:
                await conn.begin()
            except Exception as exc:
                _raise_mapped(d, conn, exc)
        return await adrive(
            _using(conn, d, use, make_plan(d)),
            lambda stmt: _aexec_mysql(conn, stmt),
            lambda e: map_error(d, conn, e),
        )
    begun = not (begin and conn.autocommit)

    async def send(stmt: Stmt) -> Result:
        nonlocal begun
        if begun:
            return await _aexec_psycopg(conn, stmt)
        begun = True
        return await _abegin_psycopg(conn, stmt)

    return await adrive(
        _using(conn, d, use, make_plan(d)), send, lambda exc: map_error(d, conn, exc)
    )


def run_transaction(
    conn: Any, make_plan: Callable[[Dialect], Plan[T]], *, use: TableUse | None = None
) -> T:
    """Run a plan as a transaction of its own: BEGIN (with the plan's first statement where
    the driver can, see :func:`run`), the plan, COMMIT; ROLLBACK if anything fails (the
    plan's refusal included). A connection with a transaction open is refused."""
    if sa_connection_kind(conn):
        if sa_in_transaction(conn):
            raise ConfigurationError(
                "this starts its own transaction, and one is already open on the connection"
            )
        try:
            value = run_sa(sa_connection(conn), make_plan, need_tx=True, use=use)
        except BaseException:
            with contextlib.suppress(Exception):
                conn.rollback()
            raise
        conn.commit()
        return value
    d = sync_dialect(conn)
    try:
        value = run(conn, make_plan, begin=True, use=use, dialect=d)
        _end(conn, commit=True, d=d)  # (failed: not left open, see _commit_or_roll_back)
    except BaseException:
        with contextlib.suppress(Exception):
            if in_transaction(conn):
                conn.rollback()
        raise
    return value


async def arun_transaction(
    conn: Any, make_plan: Callable[[Dialect], Plan[T]], *, use: TableUse | None = None
) -> T:
    """The async :func:`run_transaction` (psycopg async, asyncmy, SQLAlchemy's
    ``AsyncConnection``/``AsyncSession``)."""
    if sa_async(conn):
        return await conn.run_sync(  # type: ignore[no-any-return]
            lambda c: run_transaction(c, make_plan, use=use)
        )
    try:
        value = await arun(conn, make_plan, begin=True, use=use)
        await _aend(conn, commit=True)  # (failed: not left open)
    except BaseException:
        with contextlib.suppress(Exception):
            if in_transaction(conn):
                await conn.rollback()
        raise
    return value


def run_install(conn: Any, make_plan: Callable[[Dialect], Plan[T]]) -> T:
    """Run DDL in the caller's open transaction, or else in one of its own that it commits."""
    if sa_connection_kind(conn):
        return sa_install(conn, make_plan)
    d = sync_dialect(conn)
    if d is MYSQL:
        _refuse_ddl_in_transaction(conn)
        value = run(conn, make_plan)
        _end(conn, commit=True)  # (the checks after the DDL may have opened one)
        return value
    if in_transaction(conn):
        return run(conn, make_plan)
    if d is SQLITE:
        value = run(conn, make_plan)
        if conn.in_transaction:
            conn.commit()
        return value
    if conn.closed:
        raise BackendUnavailable("the psycopg connection is closed")
    try:
        with conn.transaction():
            return run(conn, make_plan)
    except FencedError:
        raise
    except Exception as exc:  # BEGIN/COMMIT themselves failed
        _raise_mapped(d, conn, exc)


async def arun_install(conn: Any, make_plan: Callable[[Dialect], Plan[T]]) -> T:
    """The async :func:`run_install`."""
    if sa_async(conn):
        return await conn.run_sync(lambda c: sa_install(c, make_plan))  # type: ignore[no-any-return]
    d = _async_dialect(conn)
    if d is MYSQL:
        _refuse_ddl_in_transaction(conn)
        value = await arun(conn, make_plan)
        await _aend(conn, commit=True)
        return value
    if in_transaction(conn):
        return await arun(conn, make_plan)
    if conn.closed:
        raise BackendUnavailable("the psycopg connection is closed")
    try:
        async with conn.transaction():
            return await arun(conn, make_plan)
    except FencedError:
        raise
    except Exception as exc:  # BEGIN/COMMIT themselves failed
        _raise_mapped(d, conn, exc)


# -- SQLGuard.transaction: the check rides in the messages the transaction sends anyway ------
#
# On psycopg the unguarded transaction costs three round trips (BEGIN, the statement, COMMIT).
# The guarded one sends the same three: ``BEGIN; EXECUTE <check>`` as one simple-query message,
# the caller's statements, and ``SELECT <recheck>; COMMIT`` as one (the server runs nothing
# of a message after a statement that fails, so a refusing recheck means no COMMIT). The
# logic is one generator (_ride) of steps, run by a sync and an async driver.
#
# The attack it closes: a statement of the block that ends the transaction (COMMIT, ROLLBACK,
# conn.commit()) releases the fence row. During the block psycopg therefore runs the
# connection as non-autocommit, so the statements after such an end open a new transaction,
# which the recheck refuses: it passes only in the transaction the check ran in (by its id),
# whose lock on the fence row kept the mark at this token. Refused: StaleTokenError if a
# newer token was accepted meanwhile, else ConfigurationError (the block ended it), told by
# the fence row read after the rollback. (What ran between two ends of the block's own is
# the caller's: no statement may end it.)

_TUPLES_OK: Final = 2  # (psycopg.pq.ExecStatus.TUPLES_OK)
_BLOCK: Final = "block"  # the step at which the caller's block runs
_ROLLBACK: Final = "rollback"

# The statements each connection has PREPAREd for _ride (names), so that the check is parsed
# and planned once per connection rather than in every transaction.
_PREPARED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


class _Message:
    """A simple-query message (several statements, no parameters); its answer: the rows of
    its last statement (``rows``: one that returns rows), else None."""

    __slots__ = ("rows", "sql")

    def __init__(self, sql: bytes, *, rows: bool = True) -> None:
        self.sql, self.rows = sql, rows


@functools.lru_cache(maxsize=128)
def _ride_name(table: str) -> str:
    """The check's prepared statement's name (per fence table)."""
    digest = hashlib.sha1(table.encode()).hexdigest()[:12]  # (a name, not a secret)
    return f"fenced_check_v1_{digest}"


def _begin_command(conn: Any) -> str:
    """``BEGIN`` with the connection's transaction characteristics, as psycopg would send."""
    words = ["BEGIN"]
    if conn.isolation_level is not None:
        words.append("ISOLATION LEVEL " + conn.isolation_level.name.replace("_", " "))
    if conn.read_only is not None:
        words.append("READ ONLY" if conn.read_only else "READ WRITE")
    if conn.deferrable is not None:
        words.append("DEFERRABLE" if conn.deferrable else "NOT DEFERRABLE")
    return " ".join(words)


@functools.lru_cache(maxsize=256)
def _ride_first(
    table: str,
    resource: str,
    lock: str,
    begin: str,
    prepared: bool,
    prepare: bool,
    encoding: str = "utf-8",
) -> tuple[bytes, bytes]:
    """``BEGIN; [PREPARE …;] <check>`` around the token (a new one at each grant): the
    message is ``head + b"%d" % token + tail``. The resource and lock are rendered as
    literals by psycopg; the token is a validated integer (``FencingToken``). ``encoding``:
    the connection's client encoding, which the server decodes the message by."""
    pg = _psycopg()
    check = pg_ride_sql(table)[0]
    lits = [pg.sql.Literal(v).as_string(None) for v in (resource, lock)] + ["\0"]
    name = _ride_name(table)
    head = f"PREPARE {name}(text, text, bigint) AS {check.format('$1', '$2', '$3')}; "
    head = head if prepare else ""
    body = f"EXECUTE {name}({', '.join(lits)})" if prepared else check.format(*lits)
    # (PREPARE after BEGIN: a statement before it would make BEGIN's isolation level late;
    # a prepared statement outlives the transaction, rolled back or not)
    before, _, after = f"{begin}; {head}{body}".partition("\0")
    return _encoded(before, encoding), _encoded(after, encoding)


@functools.lru_cache(maxsize=1)
def _ride_last() -> tuple[bytes, bytes]:
    """``<recheck>; COMMIT`` around the transaction id (only it changes from one
    transaction to the next): the message is ``head + b"%d" % xid + tail``. Not a prepared
    statement: psycopg deallocates every prepared statement of the session (``DEALLOCATE
    ALL``) after a rollback, a savepoint's included, once it has prepared statements of its
    own, and one inside the block would leave the recheck unknown after the block's work.
    (The recheck names no table: the same for every guard, and ASCII, which every client
    encoding PostgreSQL offers reads alike.)"""
    head, _, tail = pg_ride_sql('"t"')[1].format("\0").partition("\0")
    return head.encode("ascii"), (tail + "; COMMIT").encode("ascii")


def _ride_refusal_read(table: str, resource: str, path: str, xid: int, encoding: str) -> bytes:
    """The message that reads why the recheck refused (:func:`pg_ride_refusal_read`)."""
    pg = _psycopg()
    lits = [pg.sql.Literal(v).as_string(None) for v in (path, resource)]
    return _encoded(pg_ride_refusal_read(table).format(*lits, str(int(xid))), encoding)


_XACT_FATE: Final = {"committed": "committed", "aborted": "rolled back"}  # (txid_status)


def _fate_from_detail(token: FencingToken, detail: str | None) -> str | None:
    """:func:`fate_from_row` of the refusal read's JSON (None: no row)."""
    import json

    if detail is None:
        return fate_from_row(token, None)
    try:
        row = json.loads(detail)
        return fate_from_row(token, (row["lock"], row["token"]))
    except (ValueError, TypeError, KeyError):
        return None


def _recheck_refused(exc: BaseException) -> bool:
    """Is ``exc`` the recheck's refusal (:data:`RIDE_REFUSED`)? Its message holds only the
    recheck and COMMIT, and the marker is the cast's input, quoted in the error."""
    return getattr(exc, "sqlstate", None) == "22P02" and RIDE_REFUSED in str(exc)


def _encoded(text: str, encoding: str) -> bytes:
    """``text`` in the connection's client encoding: the server reads the message in it, so
    UTF-8 bytes on a LATIN1 connection would name another resource (the fence split in two)."""
    try:
        return text.encode(encoding)
    except UnicodeEncodeError as exc:
        raise ConfigurationError(
            f"the resource or lock name cannot be written in the connection's client "
            f"encoding {encoding!r}: {exc.reason}"
        ) from None


def _ride(
    conn: Any, table: str, resource: str, token: FencingToken, use: TableUse, *, block: bool = True
) -> Generator[object, Any, None]:
    """``SQLGuard.transaction`` on psycopg, as steps for a driver: a :class:`Stmt` (its
    :class:`Result`; the driver's error mapped by :func:`map_error`), a :class:`_Message`
    (the rows of its last statement that returns rows; the driver's error as raised),
    ``_ROLLBACK``, and ``_BLOCK`` (the caller's block; its exception thrown in).

    ``block=False``: a transaction of the check alone (``SQLFencer.fence``): ``BEGIN;
    <check>; COMMIT`` in one message (a refused check writes nothing, so its COMMIT commits
    nothing; why it refused is read after it, as :meth:`SQLGuard.check` reads it)."""
    if conn.closed:
        raise BackendUnavailable("the psycopg connection is closed")
    autocommit = conn.autocommit
    if not _is_verified(conn, use):  # once per connection: its answer is needed first
        yield from _verify_then(conn, POSTGRESQL, use, _nothing())
        if not autocommit and in_transaction(conn):
            yield _ROLLBACK  # (a catalog read opened it: nothing to keep)
    # (psycopg must not send a BEGIN of its own before ours: the first message is its BEGIN)
    conn._autocommit = True
    try:
        prepared = conn.prepare_threshold is not None  # (None: the caller wants none, pgbouncer)
        names = _PREPARED.setdefault(conn, set()) if prepared else set()
        begin = _begin_command(conn)
        name = _ride_name(table)
        commit = b"" if block else b"; COMMIT"
        for retry in (False, True):
            head, tail = _ride_first(
                table,
                resource,
                token.lock,
                begin,
                prepared,
                prepared and name not in names,
                conn.info.encoding,
            )
            message = head + b"%d" % token.value + tail + commit
            try:
                rows = yield _Message(message)
                break
            except Exception as exc:
                if in_transaction(conn):
                    yield _ROLLBACK
                state = getattr(exc, "sqlstate", None)
                if prepared and not retry and state in ("26000", "42P05"):
                    # (deallocated: by psycopg after a rollback, by DISCARD ALL; or prepared
                    # already)
                    if state == "26000":
                        names.discard(name)
                    else:
                        names.add(name)
                    continue
                raise _ride_error(conn, resource, token, exc, first=True) from exc
        if prepared:
            names.add(name)
        if not rows or type(rows[0][0]) is not int:
            # refused: the row that refused is locked by this transaction (block=False:
            # committed already, so read as it is now; a mark moved since reads as a race)
            try:
                verdict = Result(rows, len(rows))
                yield from check_verdict(fence_sql(POSTGRESQL, table), resource, token, verdict)
            finally:
                yield _ROLLBACK
        if not block:
            return
        xid, path = int(rows[0][1]), str(rows[0][2])
        # (psycopg opens a transaction for a statement after one that ended ours: see above)
        conn._autocommit = False
        try:
            yield _BLOCK
        except BaseException:
            yield _ROLLBACK
            raise
        if conn.autocommit:  # (psycopg allows it only once the block had ended ours)
            raise ConfigurationError(
                f"transaction(): the block ended the transaction that fenced {resource!r} "
                f"with {token} and turned autocommit on: its statements after that were "
                "committed as they ran, unfenced"
            )
        # (psycopg opens a transaction for the recheck if none is open: read before it)
        definite = None if in_transaction(conn) else "no transaction was open at the block's end"
        head, tail = _ride_last()
        try:
            yield _Message(head + b"%d" % xid + tail, rows=False)
        except Exception as exc:
            yield _ROLLBACK
            if not _recheck_refused(exc):
                raise _ride_error(conn, resource, token, exc) from exc
            # refused, rolled back: why, from the fence row as it is now (autocommit: the
            # read is a transaction of its own)
            conn._autocommit = True
            try:
                read = _ride_refusal_read(table, resource, path, xid, conn.info.encoding)
                found = yield _Message(read)
            except Exception as why:
                raise _ride_error(conn, resource, token, why, first=True) from exc
            detail = None if not found or found[0][0] is None else str(found[0][0])
            # (the checked transaction's fate by its id, else what the fence row says)
            status = found[0][1] if found else None
            fate = _XACT_FATE.get(str(status)) or _fate_from_detail(token, detail)
            raise _ended_or_stale(
                resource, token, pipelined_refusal(resource, token, detail), definite, fate=fate
            ) from exc
    finally:
        conn._autocommit = autocommit


def fence_transaction(
    conn: Any,
    table: str,
    resource: str,
    token: FencingToken,
    use: TableUse,
    otherwise: Callable[[], object],
) -> None:
    """``SQLFencer.fence``: on psycopg (outside a pipeline) ``BEGIN; <check>; COMMIT`` in one
    round trip (:func:`_ride` without a block); elsewhere ``otherwise()``."""
    if _kind(conn) != "psycopg" or not _rides(conn) or in_transaction(conn):
        otherwise()
        return
    drive(_ride(conn, table, resource, token, use, block=False), partial(_ride_io, conn), None)


async def afence_transaction(
    conn: Any,
    table: str,
    resource: str,
    token: FencingToken,
    use: TableUse,
    otherwise: Callable[[], Awaitable[object]],
) -> None:
    """The async :func:`fence_transaction` (``AsyncSQLFencer.fence``)."""
    if _kind(conn) != "psycopg-async" or not _rides(conn) or in_transaction(conn):
        await otherwise()
        return
    steps = _ride(conn, table, resource, token, use, block=False)
    await adrive(steps, partial(_aride_io, conn), None)


def _ride_error(
    conn: Any, resource: str, token: FencingToken, exc: Exception, *, first: bool = False
) -> Exception:
    if first:  # the check's message: its errors are the check's
        mapped: Exception | None = map_error(POSTGRESQL, conn, exc)
        if getattr(exc, "sqlstate", None) == "42883" and "fenced_refuse" in str(exc):
            mapped = None
        if mapped is not None:
            return mapped
    return _pipelined_error(conn, resource, token, exc)


# What the guard can say of the statements that ran after the block ended its transaction.
# It rolls back what is still open, but statements that committed as they ran are past any
# check at the end: never told as rolled back.
AS_RAN_MAYBE: Final = (
    "what ran after the end and is still open was rolled back, but what committed as it ran "
    "(in autocommit, several statements in one message, executescript(), a statement the "
    "driver ran outside a transaction) stays committed, unfenced"
)


def _as_ran_all(why: str) -> str:
    return (
        f"{why}: what ran after the end committed as it ran, unfenced (unless a ROLLBACK "
        "of the block undid it); nothing of it was left for the guard to roll back"
    )


# What the guard can say of the statements that ran BEFORE the end: the block's end may have
# committed them (COMMIT, commit(), DDL on MySQL, autocommit turned on) or rolled them back
# (ROLLBACK, rollback(), a deadlock or an INSERT OR ROLLBACK that undid the transaction, the
# witness released so that the guard's rollback undid it); the guard says which only when it
# knows (the fence row, or PostgreSQL's txid_status), never a commit it cannot know.
COMMITTED: Final = "committed"
ROLLED_BACK: Final = "rolled back"


def _before_end(fate: str | None) -> str:
    if fate == COMMITTED:
        return "what ran before the end was committed, fenced"
    if fate == ROLLED_BACK:
        return (
            "what ran before the end was rolled back, the fence with it (the transaction "
            "that accepted the token did not commit)"
        )
    return (
        "what ran before the end was committed or rolled back, depending on how it ended "
        "(the guard cannot tell which)"
    )


def fate_from_row(token: FencingToken, row: Sequence[Any] | None) -> str | None:
    """What the fence row read after the end (``row``: lock, token; None: no row) says of
    the transaction the check ran in: ROLLED_BACK when no row is there, or this lock's mark
    is below the token (a committed check leaves the mark at the token or above: marks only
    rise); else None (at the token: this transaction or another of the same token; above
    it: a newer holder, either way)."""
    if row is None:
        return ROLLED_BACK
    try:
        lock = row[0].decode() if isinstance(row[0], bytes) else row[0]
        value = int(str(row[1]))
    except (TypeError, ValueError, IndexError, UnicodeDecodeError):
        return None
    return ROLLED_BACK if lock == token.lock and value < token.value else None


BLOCK: Final = "transaction(): a statement of the block"
_ENDS: Final = (
    "(COMMIT, ROLLBACK, commit(), rollback(), autocommit turned on, DDL on MySQL, a deadlock "
    "that rolled it back, the savepoint fenced_transaction released)"
)


def _ended_or_stale(
    resource: str,
    token: FencingToken,
    refusal: Exception,
    definite: str | None = None,
    *,
    fate: str | None = None,
    where: str = BLOCK,
    told: bool = False,
) -> Exception:
    """The recheck's (or the witness's) refusal, from the fence row as it is now
    (``refusal``): the block ended the transaction the check ran in. ``definite``: why the
    guard knows that what ran after the end committed as it ran (:func:`_as_ran`), else None.
    ``fate``: what became of the transaction the check ran in, if the guard knows
    (:func:`fate_from_row`; psycopg: txid_status), else None. ``where``: whose statement.
    Stale (a newer token accepted since): StaleTokenError, which says what may have
    committed; but a ConfigurationError when the guard knows the block's later statements
    committed, or that the end committed the check's transaction (a refusal would tell the
    caller nothing was written), or ``told`` (the caller knows the end may have written:
    MariaDB's batch, whose end no server function tells). Wrong lock, corrupt:
    ``refusal``. Else ConfigurationError."""
    ended = f"{where} ended the transaction {_ENDS} that fenced {resource!r} with {token}"
    after = AS_RAN_MAYBE if definite is None else _as_ran_all(definite)
    before = _before_end(fate)
    if isinstance(refusal, StaleTokenError):
        newer = f"{refusal.high_water or 'a higher token'} was accepted since"
        # (a refusal says nothing of the call was written: not when the end is known to have
        # committed the check and what ran before it)
        if definite is None and fate != COMMITTED and not told:
            return StaleTokenError(
                refusal.token,
                refusal.high_water,
                resource,
                f"{refusal}: {ended}; {before}; {after}",
            )
        return ConfigurationError(
            f"{ended}, and {newer}: {before}; {after}; it may have written over the newer "
            "holder's writes"
        )
    if not isinstance(refusal, FenceConflictError):
        return refusal
    return ConfigurationError(f"{ended}: {before}; {after}")


def _as_ran(conn: Any) -> str | None:
    """Why what ran after the block's end committed as it ran, if the driver connection
    ``conn`` tells (its flags, read before the guard sends anything more): autocommit on,
    or no transaction open, at the block's end. None: it cannot tell."""
    try:
        kind = _kind(conn)
        if kind == "sqlite3":
            auto = _sqlite_autocommits(conn)
        elif kind in ("pymysql", "asyncmy"):
            auto = bool(conn.get_autocommit())
        elif kind in ("psycopg", "psycopg-async"):
            auto = bool(conn.autocommit)
        else:
            return None
        if auto:
            return "the connection was in autocommit at the block's end"
        if not in_transaction(conn):
            return "no transaction was open at the block's end"
    except Exception:  # (closed: the guard's next statement reports it)
        return None
    return None


def _sa_as_ran(sa: Any) -> str | None:
    """:func:`_as_ran` of a SQLAlchemy Connection's driver connection."""
    try:
        return _as_ran(sa.connection.dbapi_connection)
    except Exception:
        return None


def _rides(conn: Any) -> bool:
    """Does ``transaction()`` ride on this psycopg connection? (Not in the caller's pipeline,
    and only with the psycopg whose autocommit flag it knows.)"""
    return (
        isinstance(getattr(conn, "_autocommit", None), bool)
        and conn.pgconn.pipeline_status == 0  # (pq.PipelineStatus.OFF)
    )


def _advance(
    steps: Generator[object, Any, None], reply: Any, error: BaseException | None
) -> object | None:
    """The ride's next step after ``reply`` (or ``error`` thrown in); None when it is done."""
    try:
        return steps.send(reply) if error is None else steps.throw(error)
    except StopIteration:
        return None


def _ride_io(conn: Any, step: object) -> Any:
    if isinstance(step, _Message):
        with conn.cursor() as cur:
            cur.execute(step.sql, prepare=False)  # (several statements: never prepared)
            if not step.rows:
                return None
            rows = []
            while True:  # (the check's rows: the last result with rows; COMMIT may follow)
                if cur.pgresult is not None and cur.pgresult.status == _TUPLES_OK:
                    rows = cur.fetchall()
                if not cur.nextset():
                    return rows
    if step == _ROLLBACK:
        with contextlib.suppress(Exception):
            conn.rollback()
        return None
    try:
        return _exec_psycopg(conn, step)  # type: ignore[arg-type]
    except Exception as exc:
        _raise_mapped(POSTGRESQL, conn, exc)


async def _aride_io(conn: Any, step: object) -> Any:
    if isinstance(step, _Message):
        async with conn.cursor() as cur:
            await cur.execute(step.sql, prepare=False)  # (several statements: never prepared)
            if not step.rows:
                return None
            rows = []
            while True:
                if cur.pgresult is not None and cur.pgresult.status == _TUPLES_OK:
                    rows = await cur.fetchall()
                if not cur.nextset():
                    return rows
    if step == _ROLLBACK:
        with contextlib.suppress(Exception):
            await conn.rollback()
        return None
    try:
        return await _aexec_psycopg(conn, step)  # type: ignore[arg-type]
    except Exception as exc:
        _raise_mapped(POSTGRESQL, conn, exc)


@contextlib.contextmanager
def guarded_transaction(
    conn: Any,
    table: str,
    resource: str,
    token: FencingToken,
    use: TableUse,
    begin: Callable[[], FencingToken],
) -> Iterator[FencingToken]:
    """``SQLGuard.transaction``: on a psycopg connection with no transaction open, the check
    rides with BEGIN and the recheck with COMMIT (:func:`_ride`); in the caller's psycopg
    pipeline, the pipelined form. Elsewhere: ``begin()`` (today's check, awaited), the
    block, COMMIT (ROLLBACK if the block raises)."""
    if sa_connection_kind(conn):
        already = sa_in_transaction(conn)
    else:
        sync_dialect(conn)  # (a clear TypeError for an async or unknown connection)
        _refuse_closed(conn)
        already = in_transaction(conn)
    _refuse_open(already, "transaction()")
    kind = _kind(conn)
    if kind == "sqlite3":  # (a subclass of sqlite3.Connection)
        params = (resource, token.lock, token.value)
        with sqlite_transaction(conn, params, token, fence_sql(SQLITE, table)) as tok:
            yield tok
        return
    if kind != "psycopg":  # PyMySQL, SQLAlchemy: a savepoint witness (see WITNESS)
        back = _no_autocommit(conn) if kind == "pymysql" else False
        try:
            try:
                if kind == "pymysql" and _mariadb(conn):  # (the witness rides: see _Riding)
                    riding = _Riding(table)
                    _refuse_open_transaction(conn)
                    drive(
                        _using(conn, MYSQL, use, check_plan(riding.sql, resource, token)),
                        lambda stmt: riding.send(conn, stmt),
                        lambda exc: map_error(MYSQL, conn, exc),
                    )
                    accepted = token
                else:
                    accepted = begin()
                    riding = None
                    _set_witness(conn)
                yield accepted
            except BaseException:
                with contextlib.suppress(Exception):
                    conn.rollback()
                raise
            if riding is None or not riding.end(conn, resource, token):
                _release_witness(conn, table, resource, token)
                _commit_or_roll_back(conn)
        finally:
            if back:
                _autocommit_back(conn)
            elif kind == "pymysql":
                _autocommit_off_again(conn)
        return
    if not _rides(conn):
        with _pipelined_transaction(conn, table, resource, token, use):
            yield token
        return
    steps = _ride(conn, table, resource, token, use)
    step = _advance(steps, None, None)
    while step is not None:
        if step == _BLOCK:
            try:
                yield token
                step = _advance(steps, None, None)
            except BaseException as exc:  # (the block's: rolled back, raised as it is)
                step = _advance(steps, None, exc)
            continue
        try:
            reply = _ride_io(conn, step)
        except Exception as exc:
            step = _advance(steps, None, exc)
        else:
            step = _advance(steps, reply, None)


# -- transaction() off psycopg's ride: a savepoint witnesses "still the transaction the check
# ran in" --------------------------------------------------------------------------------------
# A statement of the block that ends the transaction (COMMIT, ROLLBACK, conn.commit(), DDL on
# MySQL/MariaDB) releases the fence row: a newer holder may fence and write, and what the block
# ran after the end would commit over it. A savepoint set in the check's transaction lives
# only as long as that transaction (every end drops it), so RELEASE SAVEPOINT before the
# COMMIT fails exactly when the block ended it: then what is still open is rolled back and
# the end raised (StaleTokenError if a newer token was accepted meanwhile, else
# ConfigurationError), as psycopg's recheck does. The witness is set after the check, never
# before it: the block's ROLLBACK TO SAVEPOINT of it then undoes the block's work only (a
# savepoint before the check would undo the fence, the mark back and, on MariaDB, the row
# released). (What ran between two ends of the block's own is not caught: the
# second commits it.)

WITNESS: Final = "fenced_transaction"
_SET_WITNESS: Final = f"SAVEPOINT {WITNESS}"
_RELEASE_WITNESS: Final = f"RELEASE SAVEPOINT {WITNESS}"


def _witness_gone(exc: BaseException) -> bool:
    """Did RELEASE SAVEPOINT fail because the savepoint no longer exists (the transaction it
    was set in ended)? sqlite3, MySQL/MariaDB (1305) and PostgreSQL (3B001), bare or
    wrapped by SQLAlchemy."""
    orig = getattr(exc, "orig", None) or exc
    if getattr(orig, "sqlstate", None) == "3B001":
        return True
    args = getattr(orig, "args", ())
    if args and args[0] == 1305:
        return True
    return isinstance(orig, sqlite3.OperationalError) and "no such savepoint" in str(orig)


def _ended_error(
    resource: str,
    token: FencingToken,
    row: Sequence[Any] | None,
    definite: str | None,
    *,
    note: str = "",
    where: str = BLOCK,
    told: bool = False,
) -> Exception:
    """The error for a block that ended the transaction its check ran in, from the fence row
    read afterwards (``row``: lock, token; None: no row): :func:`_ended_or_stale`.
    ``definite``: :func:`_as_ran`, read before the guard rolled back; ``note``: more on
    what of it was committed as it ran."""
    import json

    detail = (
        None
        if row is None
        else json.dumps({"lock": row[0], "token": None if row[1] is None else str(row[1])})
    )
    refusal = pipelined_refusal(resource, token, detail)
    fate = fate_from_row(token, row)
    error = _ended_or_stale(resource, token, refusal, definite, fate=fate, where=where, told=told)
    if note and definite is None and isinstance(error, ConfigurationError | StaleTokenError):
        message = f"{error} ({note})"
        if isinstance(error, StaleTokenError):
            return StaleTokenError(error.token, error.high_water, resource, message)
        return ConfigurationError(message)
    return error


_SQLITE_DDL_AS_RAN: Final = (
    "but for statements other than INSERT, UPDATE, DELETE and REPLACE, which sqlite3 "
    "with isolation_level None commits as they run"
)


def _sqlite_ended(
    conn: sqlite3.Connection,
    sql: FenceSQL,
    resource: str,
    token: FencingToken,
    exc: Exception,
    deferred: bool,
) -> NoReturn:
    """RELEASE of the witness failed: what is open is rolled back (the transaction is the
    guard's: COMMIT, or ROLLBACK); if the witness is gone, the end raised, else the error
    (:func:`commit_failed`). (Rolled back before a ``deferred`` block's level is set back
    to None, which would commit it.)"""
    # (read before the rollback; the block may have set isolation_level None itself)
    definite = _as_ran(conn)
    with contextlib.suppress(Exception):
        conn.rollback()
    if deferred:
        with contextlib.suppress(Exception):
            conn.isolation_level = None
    if not _witness_gone(exc):
        raise commit_failed(SQLITE, conn, exc, "RELEASE SAVEPOINT") from exc
    try:
        cur = conn.execute(sql.read, (resource,))  # (a read: opens nothing in legacy mode)
        row = cur.fetchone()
        cur.close()
    except Exception as why:
        _raise_mapped(SQLITE, conn, why)
    note = _SQLITE_DDL_AS_RAN if deferred else ""
    raise _ended_error(resource, token, row, definite, note=note) from exc


def _sqlite_commit_failed(conn: sqlite3.Connection, exc: Exception, deferred: bool) -> NoReturn:
    """The guard's COMMIT failed (SQLITE_BUSY: a reader holds SHARED in rollback-journal
    mode; a deferred foreign key; I/O): SQLite leaves the transaction open, the fence and
    the block's writes pending under the write lock, for any later commit() on the
    connection to commit. Rolled back, as the block promised (COMMIT, or ROLLBACK), and
    raised as what it was (:func:`commit_failed`)."""
    with contextlib.suppress(Exception):
        conn.rollback()
    if deferred:
        with contextlib.suppress(Exception):
            conn.isolation_level = None
    raise commit_failed(SQLITE, conn, exc, "COMMIT") from exc


def commit_failed(d: Dialect, conn: Any, exc: Exception, what: str = "COMMIT") -> Exception:
    """The error for the guard's own ``what`` (COMMIT, or the RELEASE before it) that failed,
    once the guard has tried to roll back: what the driver's error means (a conflict: retry;
    the connection lost; else refused), and what became of the transaction, as far as the
    guard knows (rolled back if no transaction is open now; a lost connection's COMMIT may
    have committed)."""
    mapped = map_error(d, conn, exc)
    said = f"{type(exc).__name__}: {exc}"
    if isinstance(mapped, BackendUnavailable):
        return BackendUnavailable(
            f"transaction(): the {what} failed, the database unavailable ({said}): whether "
            "the transaction committed is unknown"
        )
    try:
        still_open = in_transaction(conn)
    except Exception:
        still_open = True
    outcome = (
        "the transaction is still open: roll it back"
        if still_open
        else "the transaction was rolled back, nothing of it committed"
    )
    if isinstance(mapped, FenceConflictError):
        why = (
            "another connection holds a lock on the database (in rollback-journal mode a "
            "reader's SHARED lock keeps a COMMIT from writing)"
            if d is SQLITE
            else "a concurrent transaction conflicted"
        )
        return FenceConflictError(
            f"transaction(): the {what} failed ({said}): {why}; {outcome}: retry it"
        )
    return ConfigurationError(f"transaction(): the {what} failed ({said}); {outcome}")


_PY312: Final = sys.version_info >= (3, 12)  # (sqlite3's autocommit attribute)


def _sqlite_autocommits(conn: sqlite3.Connection) -> bool:
    """Does sqlite3 run every statement in autocommit (no transaction opened for a write)?
    autocommit=True (Python 3.12+), or legacy mode with isolation_level None."""
    autocommit = conn.autocommit if _PY312 else -1  # type: ignore[attr-defined,unused-ignore]
    return autocommit is True or (autocommit == -1 and conn.isolation_level is None)


class SQLiteTransaction(tuple[sqlite3.Cursor, FenceSQL, tuple[str, str, int], FencingToken, bool]):
    """``transaction()`` on a plain ``sqlite3.Connection``: ``BEGIN`` (deferred: its first
    statement, the fence, is a write, so it takes the write lock waiting as ``BEGIN
    IMMEDIATE`` would), the fence's UPDATE (accepted in place: its row count is the verdict;
    else the accepting upsert and its verdict, the plan: a first check, or a refusal),
    ``SAVEPOINT`` (the witness, after the check), the block, ``RELEASE`` and ``COMMIT``, or
    ROLLBACK if the block raises. A RELEASE that finds no savepoint means the block ended the
    transaction (see above). Made of ``(cursor, fence SQL, (resource, lock, value), token,
    deferred)``: one cursor of the connection (made by ``transaction()``) runs the three
    statements (``conn.execute`` would make a cursor for each, a fifth of what the guard
    costs above its SQL). ``deferred``: the connection is in legacy autocommit
    (``isolation_level`` None), and the block runs with ``isolation_level`` ``DEFERRED``, so
    that sqlite3 opens a transaction for a write after one of the block's statements ended
    ours (else it would commit as it ran, past the witness); set back to None after.

    Chosen by ``type(conn) is sqlite3.Connection`` before any other dispatch, and a tuple
    (made without a Python ``__init__``) rather than a generator context manager: in process
    there is no round trip to save, so what the guard costs above its one statement is its
    own Python, a few calls (bench/bench_sql_guard.py: "fence SQL, a with block")."""

    __slots__ = ()

    def __enter__(self) -> FencingToken:
        cur, sql, params, token, deferred = self
        conn = cur.connection
        try:
            # (SAVEPOINT would nest in the caller's transaction: refused, as BEGIN would be)
            _refuse_open(conn.in_transaction, "transaction()")
        except sqlite3.ProgrammingError as exc:  # closed
            _raise_mapped(SQLITE, conn, exc)
        try:
            cur.execute("BEGIN")
            if cur.execute(sql.update, params).rowcount != 1:  # (1: accepted in place)
                # no row yet, or not accepted: the upsert decides, and says why not
                drive(
                    accept_plan(sql, params[0], token),
                    lambda stmt: _exec_sqlite(conn, stmt),
                    lambda exc: map_error(SQLITE, conn, exc),
                )
            cur.execute(_SET_WITNESS)  # (after the check: see above)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                conn.rollback()
            if isinstance(exc, Exception):
                _raise_mapped(SQLITE, conn, exc)
            raise
        if deferred:
            conn.isolation_level = "DEFERRED"
        return token

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        cur = self[0]
        if exc_type is not None:
            conn = cur.connection
            with contextlib.suppress(Exception):
                conn.rollback()
            if self[4]:
                with contextlib.suppress(Exception):
                    conn.isolation_level = None
            return
        try:
            cur.execute(_RELEASE_WITNESS)
        except Exception as e:
            _sqlite_ended(cur.connection, self[1], self[2][0], self[3], e, self[4])
        try:
            cur.execute("COMMIT")
        except Exception as e:
            _sqlite_commit_failed(cur.connection, e, self[4])
        if self[4]:
            cur.connection.isolation_level = None  # (nothing open: no COMMIT made by it)


def sqlite_transaction(
    conn: sqlite3.Connection, params: tuple[str, str, int], token: FencingToken, sql: FenceSQL
) -> SQLiteTransaction:
    """The :class:`SQLiteTransaction` for ``conn`` (its cursor made here)."""
    try:
        cur = conn.cursor()
        deferred = conn.isolation_level is None and not sqlite_autocommit_true(conn)
    except Exception as exc:  # closed
        sqlite_cursor_refused(conn, exc)
    return SQLiteTransaction((cur, sql, params, token, deferred))


def sqlite_autocommit_true(conn: sqlite3.Connection) -> bool:
    """``autocommit=True`` (Python 3.12+), which the isolation level does not change."""
    return _PY312 and conn.autocommit is True  # type: ignore[attr-defined,unused-ignore]


# -- the witness on PyMySQL, asyncmy and SQLAlchemy (a statement of its own each way) ---------


def _no_autocommit(conn: Any) -> bool:
    """PyMySQL in autocommit: run the transaction with autocommit off (SET AUTOCOMMIT = 0 in
    place of BEGIN), so that a statement after one of the block's that ended it opens a
    transaction the witness can refuse, instead of committing as it runs. True: set it back
    after the transaction (:func:`_autocommit_back`)."""
    if not conn.get_autocommit():
        return False
    try:
        conn.autocommit(False)
    except Exception as exc:
        _raise_mapped(MYSQL, conn, exc)
    return True


def _autocommit_back(conn: Any) -> None:
    with contextlib.suppress(Exception):
        if in_transaction(conn):  # (the transaction failed: not to be committed by SET)
            conn.rollback()
        conn.autocommit(True)


def _autocommit_off_again(conn: Any) -> None:
    """The block turned autocommit on (``autocommit(True)``, ``SET autocommit = 1``) on a
    connection the guard found with it off: off again, as found (the transaction is over)."""
    with contextlib.suppress(Exception):
        if conn.get_autocommit():
            conn.autocommit(False)


async def _aautocommit_off_again(conn: Any) -> None:
    with contextlib.suppress(Exception):
        if conn.get_autocommit():
            await conn.autocommit(False)


async def _ano_autocommit(conn: Any) -> bool:
    """:func:`_no_autocommit` on asyncmy."""
    if not conn.get_autocommit():
        return False
    try:
        await conn.autocommit(False)
    except Exception as exc:
        _raise_mapped(MYSQL, conn, exc)
    return True


async def _aautocommit_back(conn: Any) -> None:
    with contextlib.suppress(Exception):
        if in_transaction(conn):
            await conn.rollback()
        await conn.autocommit(True)


def _set_witness(conn: Any) -> None:
    """SAVEPOINT (the witness) in the transaction the check has just run in: PyMySQL, or a
    SQLAlchemy Connection or Session (through its driver, which SQLAlchemy does not watch)."""
    sa = sa_connection(conn)
    try:
        if sa is None:
            _exec_mysql(conn, Stmt(_SET_WITNESS))
        else:
            sa.exec_driver_sql(_SET_WITNESS)
    except Exception as exc:
        _raise_witness_error(conn, sa, exc)


async def _aset_witness(conn: Any) -> None:
    try:
        await _aexec_mysql(conn, Stmt(_SET_WITNESS))
    except Exception as exc:
        _raise_mapped(MYSQL, conn, exc)


def _raise_witness_error(conn: Any, sa: Any, exc: Exception) -> NoReturn:
    if sa is None:
        _raise_mapped(MYSQL, conn, exc)
    mapped = _sa_map(_sa_dialect(sa), sa)(exc)
    if mapped is None:
        raise exc
    raise mapped from exc


def _release_witness(conn: Any, table: str, resource: str, token: FencingToken) -> None:
    """RELEASE the witness before the COMMIT. If it is gone, the block ended the transaction
    the check ran in: roll back what is open (the statements after the end), read the fence
    row, raise the end (:func:`_ended_error`). (A SQLAlchemy Session whose block committed
    begins a new transaction for the RELEASE: refused the same way.)"""
    if sa_connection_kind(conn):
        # A savepoint of SQLAlchemy's (begin_nested) the block left open sits inside the
        # witness: released first, as SQLAlchemy's commit would (RELEASE of the witness
        # would release it too, and SQLAlchemy's own RELEASE of it then fail).
        while (nested := conn.get_nested_transaction()) is not None:
            nested.commit()
    sa = sa_connection(conn)
    # (the driver's flags as the block left them: read before the RELEASE under SQLAlchemy,
    # for which psycopg begins a transaction; a failed statement changes none of PyMySQL's)
    definite = None if sa is None else _sa_as_ran(sa)
    try:
        if sa is None:
            _exec_mysql(conn, Stmt(_RELEASE_WITNESS))
        else:
            sa.exec_driver_sql(_RELEASE_WITNESS)
        return
    except Exception as exc:
        definite = _as_ran(conn) if sa is None else definite
        with contextlib.suppress(Exception):
            conn.rollback()
        if not _witness_gone(exc):
            _raise_witness_error(conn, sa, exc)
        failed = exc
    d = MYSQL if sa is None else _sa_dialect(sa)
    read = fence_sql(d, table).plain_read
    try:
        if sa is None:
            rows = _exec_mysql(conn, Stmt(read, (resource,))).rows
        else:
            rows = [tuple(r) for r in sa_connection(conn).exec_driver_sql(read, (resource,))]
    except Exception as why:
        _raise_witness_error(conn, sa, why)
    finally:
        with contextlib.suppress(Exception):
            conn.rollback()
    raise _ended_error(resource, token, rows[0] if rows else None, definite) from failed


async def _arelease_witness(conn: Any, table: str, resource: str, token: FencingToken) -> None:
    """:func:`_release_witness` on asyncmy."""
    try:
        await _aexec_mysql(conn, Stmt(_RELEASE_WITNESS))
        return
    except Exception as exc:
        definite = _as_ran(conn)  # (before the rollback: see _release_witness)
        with contextlib.suppress(Exception):
            await conn.rollback()
        if not _witness_gone(exc):
            _raise_mapped(MYSQL, conn, exc)
        failed = exc
    read = fence_sql(MYSQL, table).plain_read
    try:
        rows = (await _aexec_mysql(conn, Stmt(read, (resource,)))).rows
    except Exception as why:
        _raise_mapped(MYSQL, conn, why)
    finally:
        with contextlib.suppress(Exception):
            await conn.rollback()
    raise _ended_error(resource, token, rows[0] if rows else None, definite) from failed


# -- on MariaDB the witness rides in the statements sent anyway ----------------------------------
# MariaDB runs a compound statement (BEGIN NOT ATOMIC ... END) outside stored programs, and
# one may hold SAVEPOINT, RELEASE SAVEPOINT and COMMIT. So the check's UPDATE goes as
# ``BEGIN NOT ATOMIC <UPDATE>; SAVEPOINT w; END`` (the compound's affected-row count is the
# UPDATE's, which SAVEPOINT leaves as it is: the verdict reads as before). The savepoint
# after the check, never before: the block's ROLLBACK TO SAVEPOINT w would otherwise undo the
# fence (the mark back, the row released) and leave the witness standing and the COMMIT as ``BEGIN NOT
# ATOMIC RELEASE SAVEPOINT w; COMMIT; END``: a failing RELEASE stops the compound before
# the COMMIT. The unfenced transaction's round trips, no more. sql_mode=ORACLE parses no
# BEGIN NOT ATOMIC: refused as syntax (1064) before anything ran, then the statements go
# one by one (MySQL has no compound statement outside stored programs: one by one always).

_RIDE_SET: Final = f"BEGIN NOT ATOMIC {{}}; {_SET_WITNESS}; END"
_RIDE_COMMIT: Final = f"BEGIN NOT ATOMIC {_RELEASE_WITNESS}; COMMIT; END"


def _mariadb(conn: Any) -> bool:
    """PyMySQL or asyncmy connected to MariaDB (its compound statements carry the witness)."""
    try:
        return "mariadb" in str(conn.get_server_info()).lower()
    except Exception:  # (closed: the statements report it)
        return False


def _syntax(exc: BaseException) -> bool:
    return getattr(exc, "args", (None,))[0] == 1064


class _Riding:
    """The witness riding with the check and the COMMIT on MariaDB (see above)."""

    __slots__ = ("plain", "set", "sql")

    def __init__(self, table: str) -> None:
        self.sql = fence_sql(MYSQL, table)
        self.set = False  # the witness is set (riding, or on its own)
        self.plain = False  # one by one (sql_mode=ORACLE)

    def _first(self, stmt: Stmt) -> bool:
        return not self.set and stmt.sql == self.sql.accept

    def send(self, conn: Any, stmt: Stmt) -> Result:
        if not self._first(stmt):
            return _exec_mysql(conn, stmt)
        self.set = True
        try:
            return _exec_mysql(conn, Stmt(_RIDE_SET.format(stmt.sql), stmt.params))
        except Exception as exc:
            if not (_syntax(exc) and _oracle_mode(conn)):
                raise
        self.plain = True
        res = _exec_mysql(conn, stmt)
        _exec_mysql(conn, Stmt(_SET_WITNESS))  # (after the check: see above)
        return res

    async def asend(self, conn: Any, stmt: Stmt) -> Result:
        if not self._first(stmt):
            return await _aexec_mysql(conn, stmt)
        self.set = True
        try:
            return await _aexec_mysql(conn, Stmt(_RIDE_SET.format(stmt.sql), stmt.params))
        except Exception as exc:
            if not (_syntax(exc) and await _aoracle_mode(conn)):
                raise
        self.plain = True
        res = await _aexec_mysql(conn, stmt)
        await _aexec_mysql(conn, Stmt(_SET_WITNESS))  # (after the check: see above)
        return res

    def end(self, conn: Any, resource: str, token: FencingToken) -> bool:
        """RELEASE and COMMIT in one statement; False: send them one by one instead (ORACLE
        mode, or set by the block since). A gone witness: rolled back, raised."""
        if self.plain:
            return False
        try:
            conn.query(_RIDE_COMMIT)  # (no cursor: nothing to read but the OK)
            return True
        except Exception as exc:
            if _syntax(exc):
                return False
            failed = exc
        definite = _as_ran(conn)  # (before the rollback: see _release_witness)
        _end_refused(conn, failed)
        raise _mysql_ended(conn, self.sql, resource, token, failed, definite)

    async def aend(self, conn: Any, resource: str, token: FencingToken) -> bool:
        if self.plain:
            return False
        try:
            await conn.query(_RIDE_COMMIT)
            return True
        except Exception as exc:
            if _syntax(exc):
                return False
            failed = exc
        definite = _as_ran(conn)
        with contextlib.suppress(Exception):
            await conn.rollback()
        if not _witness_gone(failed):
            _raise_mapped(MYSQL, conn, failed)
        raise await _amysql_ended(conn, self.sql, resource, token, failed, definite)


def _end_refused(conn: Any, exc: Exception) -> None:
    """The RELEASE failed: roll back what is open; raise the error unless the witness is gone."""
    with contextlib.suppress(Exception):
        conn.rollback()
    if not _witness_gone(exc):
        _raise_mapped(MYSQL, conn, exc)


def _mysql_ended(
    conn: Any,
    sql: FenceSQL,
    resource: str,
    token: FencingToken,
    exc: Exception,
    definite: str | None,
) -> Exception:
    """The end, from the fence row read after the rollback (in a read of its own)."""
    try:
        rows = _exec_mysql(conn, Stmt(sql.plain_read, (resource,))).rows
    except Exception as why:
        _raise_mapped(MYSQL, conn, why)
    finally:
        with contextlib.suppress(Exception):
            conn.rollback()
    return _ended_from(rows, resource, token, exc, definite)


def _ended_from(
    rows: Sequence[Any], resource: str, token: FencingToken, exc: Exception, definite: str | None
) -> Exception:
    """:func:`_mysql_ended`'s error (either twin's) from the fence rows read back."""
    error = _ended_error(resource, token, rows[0] if rows else None, definite)
    error.__cause__ = exc
    return error


async def _amysql_ended(
    conn: Any,
    sql: FenceSQL,
    resource: str,
    token: FencingToken,
    exc: Exception,
    definite: str | None,
) -> Exception:
    try:
        rows = (await _aexec_mysql(conn, Stmt(sql.plain_read, (resource,)))).rows
    except Exception as why:
        _raise_mapped(MYSQL, conn, why)
    finally:
        with contextlib.suppress(Exception):
            await conn.rollback()
    return _ended_from(rows, resource, token, exc, definite)


async def _aoracle_mode(conn: Any) -> bool:
    try:
        rows = (await _aexec_mysql(conn, Stmt("SELECT @@SESSION.sql_mode"))).rows
    except Exception:
        return False
    return bool(rows) and "ORACLE" in str(rows[0][0]).upper().split(",")


def sqlite_cursor_refused(conn: sqlite3.Connection, exc: Exception) -> NoReturn:
    """``conn.cursor()`` failed (a closed connection): as fenced's error."""
    _raise_mapped(SQLITE, conn, exc)


@contextlib.asynccontextmanager
async def aguarded_transaction(
    conn: Any,
    table: str,
    resource: str,
    token: FencingToken,
    use: TableUse,
    begin: Callable[[], Awaitable[FencingToken]],
) -> AsyncIterator[FencingToken]:
    """The async :func:`guarded_transaction` (the same :func:`_ride` on a
    ``psycopg.AsyncConnection``), else ``begin()`` (``abegin``), the block, COMMIT."""
    if sa_async(conn):
        already = conn.in_transaction()
    else:
        _async_dialect(conn)
        _refuse_closed(conn)
        already = in_transaction(conn)
    _refuse_open(already, "transaction()")
    if _kind(conn) != "psycopg-async" or not _rides(conn):
        if _kind(conn) == "psycopg-async":  # (in the caller's pipeline: no ride)
            raise ConfigurationError(
                "atransaction() inside a psycopg pipeline: leave the pipeline, or use "
                "abegin() and COMMIT"
            )
        sa = sa_async(conn)  # else asyncmy: a savepoint witness either way (see WITNESS)
        back = False if sa else await _ano_autocommit(conn)
        riding: _Riding | None = None
        try:
            try:
                if not sa and _mariadb(conn):  # (the witness rides: see _Riding)
                    riding = _Riding(table)
                    _refuse_open_transaction(conn)
                    await adrive(
                        _using(conn, MYSQL, use, check_plan(riding.sql, resource, token)),
                        partial(riding.asend, conn),
                        lambda exc: map_error(MYSQL, conn, exc),
                    )
                    accepted = token
                else:
                    accepted = await begin()
                    if sa:
                        await conn.run_sync(_set_witness)
                    else:
                        await _aset_witness(conn)
                yield accepted
            except BaseException:
                with contextlib.suppress(Exception):
                    await conn.rollback()
                raise
            if sa:
                await conn.run_sync(lambda c: _release_witness(c, table, resource, token))
                await _acommit_or_roll_back(conn, conn.commit)
            elif riding is None or not await riding.aend(conn, resource, token):
                await _arelease_witness(conn, table, resource, token)
                await _acommit_or_roll_back(conn, partial(_aend, conn, commit=True))
        finally:
            if back:
                await _aautocommit_back(conn)
            elif not sa:
                await _aautocommit_off_again(conn)
        return
    steps = _ride(conn, table, resource, token, use)
    step = _advance(steps, None, None)
    while step is not None:
        if step == _BLOCK:
            try:
                yield token
                step = _advance(steps, None, None)
            except BaseException as exc:
                step = _advance(steps, None, exc)
            continue
        try:
            step = _advance(steps, await _aride_io(conn, step), None)
        except Exception as exc:
            step = _advance(steps, None, exc)


# -- batch() on psycopg: one pipeline ----------------------------------------------------------
# _RECHECK: the pipeline checks the fence again after the statements, in the same round trip:
# a statement that ended the transaction (COMMIT, ROLLBACK) released the fence row, and what
# ran after it would commit unfenced, over a newer holder's writes. The second check accepts
# only if no newer token has been accepted since (and locks the row till the COMMIT).


# The search_path the first check ran with, set again (for the transaction's rest: SET LOCAL
# ends with the COMMIT) before the second: the statements between may set another (a tenant's
# schema), in which the second check would not find the table or the refusal function. (If a
# statement ended the transaction, the kept path is gone with it: the path stays as it is,
# and the second check refuses, or fails: either way nothing after the end commits.)
# (with the search_path, the id of the transaction the check ran in, both transaction-local:
# a statement of the pipeline that ended that transaction drops them)
_KEEP_PATH: Final = (
    "SELECT set_config('fenced.search_path', current_setting('search_path'), true), "
    "set_config('fenced.xid', pg_catalog.txid_current()::text, true)"
)
_PIPE_ENDED: Final = "fenced: the transaction of the pipeline ended"
# (raises, so that neither the re-check nor the COMMIT runs and what is open is rolled back,
# unless this is still the transaction the check ran in; the cast's argument is not a
# constant, else it would be folded and raise in every case)
_BACK_TO_PATH: Final = (
    "SELECT set_config('search_path', coalesce(nullif("
    "current_setting('fenced.search_path', true), ''), current_setting('search_path')), true), "
    "CASE WHEN pg_catalog.current_setting('fenced.xid', true) = "
    "pg_catalog.txid_current()::text THEN 0 ELSE "
    f"CAST(pg_catalog.concat('{_PIPE_ENDED} ', pg_catalog.txid_current()) AS bigint) END"
)


@contextlib.contextmanager
def _pipelined_transaction(
    conn: Any,
    table: str,
    resource: str,
    token: FencingToken,
    use: TableUse,
    where: str = BLOCK,
) -> Iterator[None]:
    """BEGIN, the raising check (:func:`pg_pipelined_check`), the statements and COMMIT in
    one psycopg pipeline, answered at its sync point; a refusal aborts the transaction in
    the server, so nothing sent is committed. ``batch()``'s form on psycopg: its statements
    are known up front, so all of them go in one round trip."""
    if conn.closed:
        raise BackendUnavailable("the psycopg connection is closed")
    if not _is_verified(conn, use):  # once per connection: its answer is needed first
        opened = not conn.autocommit
        drive(
            _verify_then(conn, POSTGRESQL, use, _nothing()),
            lambda stmt: _exec_psycopg(conn, stmt),
            lambda exc: map_error(POSTGRESQL, conn, exc),
        )
        if opened and in_transaction(conn):
            _end(conn, commit=False, d=POSTGRESQL)  # (a catalog read opened it: nothing to keep)
    params = (resource, token.lock, token.value, table, resource)
    kept = None
    try:
        with conn.pipeline(), conn.transaction():
            conn.execute(pg_pipelined_check(table), params)
            kept = conn.execute(_KEEP_PATH)
            yield
            conn.execute(_BACK_TO_PATH)
            conn.execute(pg_pipelined_check(table), params)  # (_RECHECK)
    except Exception as exc:
        if getattr(exc, "sqlstate", None) == "22P02" and _PIPE_ENDED in str(exc):
            raise _pipeline_ended(conn, table, resource, token, kept, where) from exc
        mapped = _pipelined_error(conn, resource, token, exc, table)
        if mapped is exc:
            raise
        raise mapped from exc


def _pipeline_ended(
    conn: Any, table: str, resource: str, token: FencingToken, kept: Any, where: str
) -> Exception:
    """A statement of the pipeline ended the transaction the check ran in (the xid witness
    of :data:`_BACK_TO_PATH` refused; what was open is rolled back): the error from the fence
    row as it is now and ``txid_status`` of that transaction (committed, rolled back)."""
    xid = None
    with contextlib.suppress(Exception):  # (the witness's row: answered before the end)
        xid = int(kept.fetchone()[1])
    read = fence_sql(POSTGRESQL, table).plain_read
    try:
        with conn.transaction():  # (a read of its own, whatever the autocommit)
            row = conn.execute(read, (resource,)).fetchone()
            status = None
            if xid is not None:
                status = conn.execute("SELECT txid_status(%s)", (xid,)).fetchone()[0]
    except Exception as exc:
        mapped = map_error(POSTGRESQL, conn, exc)
        return mapped if mapped is not None else exc
    import json

    detail = None if row is None else json.dumps({"lock": row[0], "token": str(row[1])})
    refusal = pipelined_refusal(resource, token, detail)
    fate = _XACT_FATE.get(status or "") or fate_from_row(token, row)
    return _ended_or_stale(resource, token, refusal, fate=fate, where=where)


# -- a batch of statements, guarded, in one request where the server allows ----------------

Statement = tuple[str, "Sequence[Any] | Mapping[str, Any] | None"]
_MULTI_STATEMENTS = 1 << 16  # CLIENT.MULTI_STATEMENTS


def batch_kind(conn: Any) -> str:
    """How :func:`guarded_batch` sends a batch on ``conn``: "multi" (MariaDB through PyMySQL
    with CLIENT.MULTI_STATEMENTS: one request), "pipeline" (psycopg: one pipeline) or
    "block" (``transaction()``'s block, statement by statement)."""
    kind = _kind(conn)
    if kind == "psycopg":
        return "pipeline"
    if (
        kind == "pymysql"
        and conn.client_flag & _MULTI_STATEMENTS
        and "mariadb" in conn.get_server_info().lower()
    ):
        return "multi"
    return "block"


def guarded_batch(
    conn: Any,
    table: str,
    resource: str,
    token: FencingToken,
    use: TableUse,
    statements: Sequence[Statement],
    transaction: Callable[[], contextlib.AbstractContextManager[FencingToken]],
) -> list[int]:
    """``SQLGuard.batch``: on MariaDB with multi-statements, ``START TRANSACTION``, the
    raising check (:func:`mariadb_batch_check`), the statements and ``COMMIT`` as ONE
    request: the server runs no statement after the first that fails, so a refused token
    leaves nothing written (rolled back here). Elsewhere ``transaction()``'s block (a psycopg
    pipeline, or begin, check, statements, commit). Returns each statement's row count."""
    how = batch_kind(conn)
    if how == "pipeline":  # (a pipelined cursor's row count is known after the sync)
        _refuse_open(in_transaction(conn), "batch()")
        with _pipelined_transaction(conn, table, resource, token, use, _BATCH):  # (again last)
            cursors = [conn.execute(sql, params) for sql, params in statements]
        return [int(cur.rowcount) for cur in cursors]
    if how == "block":
        return _block_batch(conn, statements, transaction, (table, resource, token))
    _refuse_open(in_transaction(conn), "batch()")
    if not _is_verified(conn, use):  # once per connection: its answer is needed first
        drive(
            _verify_then(conn, MYSQL, use, _nothing()),
            lambda stmt: _exec_mysql(conn, stmt),
            lambda exc: map_error(MYSQL, conn, exc),
        )
        if in_transaction(conn):
            _end(conn, commit=False, d=MYSQL)  # (a catalog read opened it: nothing to keep)
    check = (resource, token.lock, token.value, resource, token.value, token.lock)
    counts: list[int] = []
    extra = 0
    # Found in autocommit: off for the request (in it, no round trip of its own), so that a
    # statement after one of the batch's that ended the transaction opens a transaction the
    # re-check can refuse, and at the re-check autocommit on means the batch turned it on
    # (what ran after that committed as it ran); on again after the COMMIT, or on failure.
    back = bool(conn.get_autocommit())
    lead = 2 if back else 1  # (the answers before the check's: [SET,] START TRANSACTION)
    answered = 0  # (the answers read)
    with conn.cursor() as cur:
        parts = [cur.mogrify(mariadb_batch_check(table), check)]
        parts += [_one_statement(cur.mogrify(sql, params)) for sql, params in statements]
        # (the server has run the whole request before any answer is read, so a statement
        # that ended the transaction is caught in the server: by the re-check, which refuses
        # unless the fence row still holds this token, under this transaction's lock, and
        # autocommit is off)
        parts.append(cur.mogrify(mariadb_batch_recheck(table), (resource, token.value, token.lock)))
        # (each statement ends its line: a trailing "-- " or "#" comment ends there, not
        # swallowing the separator, the statements after it, the re-check and the COMMIT)
        request = "START TRANSACTION;\n" + "\n;\n".join(parts) + "\n;\nCOMMIT"
        if back:
            request = f"SET autocommit = 0;\n{request};\nSET autocommit = 1"
        sent = conn.open  # (closed before: nothing goes out, nothing can commit)
        try:
            cur.execute(request)  # the first answer
            answered = 1
            for _ in range(lead):  # START TRANSACTION's (if SET's came first), the check's
                cur.nextset()
                answered += 1
            for _ in statements:  # (a syntax error now is the caller's statement's)
                cur.nextset()
                answered += 1
                counts.append(cur.rowcount)
            cur.nextset()  # the re-check's
            answered += 1
            if not cur.nextset():  # COMMIT's
                raise ConfigurationError("the batch's COMMIT did not run")
            if back:
                cur.nextset()  # SET autocommit = 1's
            while cur.nextset():  # (a "statement" that held several: counts are off)
                extra += 1
        except Exception as exc:
            failed = answered  # the index of the answer that failed
            code = getattr(exc, "args", (None,))[0]
            ours = code == 1644 and "fenced:" in str(exc)
            turned_on = ours and _AUTOCOMMIT_ON in str(exc)
            with contextlib.suppress(Exception):
                conn.rollback()
            # (a LOCK TABLES of the batch's outlives the rollback and locks everyone else out;
            # after the rollback: UNLOCK TABLES commits what is open. On failure only)
            with contextlib.suppress(Exception), conn.cursor() as unlock:
                unlock.execute("UNLOCK TABLES")
            if back:
                _autocommit_back(conn)
            elif turned_on:
                _autocommit_off_again(conn)  # (as found)
            if ours and (turned_on or failed == lead + len(statements) + 1):
                # the re-check's: a statement of the batch ended the transaction
                definite = _BATCH_AUTOCOMMIT if turned_on else None
                raise _batch_ended(conn, table, resource, token, definite) from exc
            if ours:
                raise _batch_refusal(conn, table, resource, token) from exc
            if code == _MYSQL_NOT_LOCKED and failed > lead:
                # LOCK TABLES among the statements: it committed what was open (the check,
                # what ran before it), and the tables it left out cannot be read after it
                ended = _batch_ended(conn, table, resource, token, None)
                if not isinstance(ended, ConfigurationError):
                    raise ended from exc
                raise ConfigurationError(
                    f"{ended} (LOCK TABLES among the statements: it commits the open "
                    "transaction implicitly, and the guard cannot read the fence table after "
                    "it; the tables were unlocked)"
                ) from exc
            if code == 1064 and failed == lead and _oracle_mode(conn):
                # sql_mode=ORACLE parses no BEGIN NOT ATOMIC: the check was refused as
                # syntax, before anything ran; the block form then, not the holder refused
                return _block_batch(conn, statements, transaction, (table, resource, token))
            # (as the pipeline: in one request the guard cannot tell whose statement failed,
            # so only whole-transaction conditions are mapped; the rest comes as raised)
            mapped = map_error(MYSQL, conn, exc)
            if isinstance(mapped, BackendUnavailable) and sent:
                raise outcome_unknown(mapped) from exc
            if isinstance(mapped, FenceConflictError | BackendUnavailable):
                raise mapped from exc
            raise
    if extra:
        raise ConfigurationError(
            f"batch(): {len(statements)} statements gave {len(statements) + extra} results "
            "(one statement per (sql, params) pair); the batch was committed, its row counts "
            "are unknown"
        )
    return counts


_BATCH_AUTOCOMMIT: Final = "autocommit was on at the batch's re-check"
_MYSQL_NOT_LOCKED: Final = 1100  # (a table not locked with LOCK TABLES)
_BATCH: Final = "batch(): a statement of the batch"


def _fence_row_after_refusal(conn: Any, table: str, resource: str, token: FencingToken) -> Any:
    """The fence row read back after the server refused ``token`` (a read of its own, then
    rolled back): the result, or the error to raise instead if the read failed."""
    read = fence_sql(MYSQL, table).plain_read
    try:
        res = _exec_mysql(conn, Stmt(read, (resource,)))
        _end(conn, commit=False, d=MYSQL)
    except Exception as exc:
        mapped = map_error(MYSQL, conn, exc)
        if mapped is not None:
            return mapped
        return FenceConflictError(f"the fence refused {token} for {resource!r}; reading why: {exc}")
    return res


def _batch_ended(
    conn: Any, table: str, resource: str, token: FencingToken, definite: str | None
) -> Exception:
    """The re-check refused (rolled back): a statement of the batch ended the transaction
    the check ran in; the error from the fence row as it is now (:func:`_ended_error`)."""
    res = _fence_row_after_refusal(conn, table, resource, token)
    if isinstance(res, FencedError):
        return res
    row = res.rows[0] if res.rows else None
    # (never StaleTokenError: a COMMIT, an implicit commit or autocommit turned on wrote the
    # check and what ran before the end, and nothing here tells those from a ROLLBACK)
    return _ended_error(resource, token, row, definite, where=_BATCH, told=True)


def _block_batch(
    conn: Any,
    statements: Sequence[Statement],
    transaction: Callable[[], contextlib.AbstractContextManager[FencingToken]],
    fence: tuple[str, str, FencingToken],
) -> list[int]:
    """``batch`` as ``transaction()``'s block, statement by statement, stopping at one that
    ended the transaction (what follows it would run unfenced). ``fence``: the table, the
    resource, the token."""
    counts: list[int] = []
    with transaction():
        # (SQLAlchemy keeps its own idea of the transaction: ask its driver connection)
        sa = sa_connection(conn)
        driver = conn if sa is None else sa.connection.dbapi_connection
        kind = _kind(driver)
        watch = kind in ("sqlite3", "psycopg", "pymysql")
        for n, (sql, params) in enumerate(statements, 1):
            counts.append(_execute(conn, sql, params))
            if watch and not in_transaction(driver):
                fate = _fate_after_end(driver, _SYNC_DIALECTS[kind], fence)
                raise _ended_transaction(n, fate)
    return counts


def _fate_after_end(driver: Any, d: Dialect, fence: tuple[str, str, FencingToken]) -> str | None:
    """What the end made of the checked transaction, as the fence row read now tells
    (:func:`fate_from_row`: rolled back when the row is gone or below the token), else None.
    A read on the driver connection, on the end only; what it opens is rolled back with the
    rest."""
    table, resource, token = fence
    read = fence_sql(d, table).plain_read
    try:
        if d is SQLITE:
            cur = driver.execute(read, (resource,))
            row = cur.fetchone()
            cur.close()
        else:
            with driver.cursor() as cur:
                cur.execute(read, (resource,))
                row = cur.fetchone()
    except Exception:  # (the guard's rollback, or its next statement, reports a dead one)
        return None
    return fate_from_row(token, row)


def _oracle_mode(conn: Any) -> bool:
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT @@SESSION.sql_mode")
            row = cur.fetchone()
    except Exception:  # (the syntax error is then what the caller gets)
        return False
    return bool(row) and "ORACLE" in str(row[0]).upper().split(",")


def _one_statement(sql: str) -> str:
    """``sql`` without the trailing ``;`` (and blanks) it may end with: the guard joins the
    statements itself, and an empty statement is a syntax error on MariaDB."""
    return sql.rstrip().rstrip(";").rstrip()


def _ended_transaction(n: int, fate: str | None) -> ConfigurationError:
    # (what ran before the end is what the end made of it: never told rolled back unless
    # the fence row says so; a COMMIT wrote the check and the statements before it)
    return ConfigurationError(
        f"batch(): statement {n} ended the transaction (COMMIT, ROLLBACK, or a statement "
        "that commits implicitly such as DDL): the statements after it would not be fenced, "
        f"none of them was run; {_before_end(fate)}; what is open now is rolled back"
    )


def _batch_refusal(conn: Any, table: str, resource: str, token: FencingToken) -> FencedError:
    """The error for the server's refusal of ``token``, from the fence row as it is now (the
    refusing transaction is rolled back: one more round trip, on the refusal only)."""
    import json

    res = _fence_row_after_refusal(conn, table, resource, token)
    if isinstance(res, FencedError):
        return res
    if not res.rows:
        return pipelined_refusal(resource, token, None)
    lock, value = res.rows[0]
    row = {"lock": lock, "token": None if value is None else str(value)}
    return pipelined_refusal(resource, token, json.dumps(row))


def _execute(conn: Any, sql: str, params: Sequence[Any] | Mapping[str, Any] | None) -> int:
    """One statement of a batch on any supported sync connection; its row count."""
    sa = sa_connection(conn)
    if sa is not None:
        return int(sa.exec_driver_sql(sql, params).rowcount)
    if _kind(conn) == "sqlite3":
        cur = conn.execute(sql, () if params is None else params)
        try:
            return int(cur.rowcount)
        finally:
            cur.close()
    with conn.cursor() as cur:
        cur.execute(sql, params)
        return int(cur.rowcount)


def _search_path(conn: Any) -> str:
    try:
        with conn.transaction():
            return str(conn.execute("SHOW search_path").fetchone()[0])
    except Exception:
        return "unknown"


def _pipelined_error(
    conn: Any, resource: str, token: FencingToken, exc: Exception, table: str | None = None
) -> Exception:
    """The fence's refusal (:data:`STALE_SQLSTATE`) as fenced's error; a whole-transaction
    condition (conflict: retry; connection lost) mapped as ``check`` maps it; anything else
    as raised (in one round trip the guard cannot tell whose statement failed)."""
    if getattr(exc, "sqlstate", None) == STALE_SQLSTATE:
        return pipelined_refusal(resource, token, exc.diag.message_detail)  # type: ignore[attr-defined]
    if getattr(exc, "sqlstate", None) == "42883" and "fenced_refuse" in str(exc):
        return ConfigurationError(
            f"{exc}: the pipelined check needs the function guard.install() creates "
            "(run install() again after upgrading fenced)"
        )
    if getattr(exc, "sqlstate", None) == "42P01" and table is not None:
        name = table.rpartition(".")[2].strip('"')
        if f'"{name}"' in str(exc):  # (the fence table's, not one of the caller's)
            return ConfigurationError(
                f"{str(exc).splitlines()[0]}: the fence table is not on this connection's "
                f"search_path ({_search_path(conn)}): has the guard been installed "
                "(guard.install())? A SET search_path run on the connection (a batch's "
                "statement included) stays for the session"
            )
    what = pg_kind(exc, conn)
    if what in ("conflict", "unreachable"):
        mapped = map_error(POSTGRESQL, conn, exc)
        if isinstance(mapped, BackendUnavailable):
            return outcome_unknown(mapped)  # (the pipeline holds the COMMIT)
        if mapped is not None:
            return mapped
    return exc


def outcome_unknown(lost: BackendUnavailable) -> BackendUnavailable:
    """The connection was lost (``lost``) while a request holding the guard's ``COMMIT`` was
    out (MariaDB's one request, psycopg's pipeline): the server may have run it all to the
    COMMIT. Never told as a plain failure, which a retry with the same token would apply
    twice: the caller must read back first."""
    return BackendUnavailable(
        f"{lost}; the outcome is unknown: the request held the COMMIT, which the server may "
        "have run (read back what the call wrote before retrying it)"
    )


def _commit_or_roll_back(conn: Any) -> None:
    """The guard's COMMIT; if it fails, ROLLBACK (a failed COMMIT may leave the transaction
    open: sqlite3 after SQLITE_BUSY, a SQLAlchemy transaction that needs its rollback), then
    the error."""
    try:
        _commit_any(conn)
    except BaseException:
        with contextlib.suppress(Exception):
            conn.rollback()
        raise


async def _acommit_or_roll_back(conn: Any, commit: Callable[[], Awaitable[object]]) -> None:
    """The async :func:`_commit_or_roll_back` (``commit``: the connection's own)."""
    try:
        await commit()
    except BaseException:
        with contextlib.suppress(Exception):
            await conn.rollback()
        raise


def _commit_any(conn: Any) -> None:
    """COMMIT on any supported sync connection (a SQLAlchemy one commits its own way)."""
    kind = _kind(conn)
    if not kind:
        conn.commit()
        return
    _end(conn, commit=True, d=_SYNC_DIALECTS[kind])
