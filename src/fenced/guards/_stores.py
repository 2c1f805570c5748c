"""Where the HTTP guard keeps its high-water marks: SQLite, PostgreSQL or Redis.

Every store answers one question atomically, ``await store.advance(resource, token)``:
accept ``token`` if it is >= the highest token accepted for ``resource`` and make it the new
mark, or raise :class:`~fenced.StaleTokenError`. The stores do not re-implement that
statement: they run the project's resource guards —
:class:`fenced.guards.sql.SQLGuard` (one ``INSERT .. ON CONFLICT .. DO UPDATE .. WHERE
token <= excluded.token RETURNING``; on SQLite an ``UPDATE`` that accepts in place first)
and :class:`fenced.guards.redis.AsyncRedisGuard` (one Lua script) — so the mark a request advanced is the same row or hash a handler writes through
when it wants its own write fenced in the same transaction (:meth:`SQLiteFenceStore.transaction`,
:meth:`PostgresFenceStore.transaction`, :meth:`RedisFenceStore.guard`).

Errors: a dead server or closed connection raises :class:`~fenced.BackendUnavailable`; a
concurrent-transaction refusal :class:`~fenced.guards.sql.FenceConflictError`; a resource
already fenced by another lock :class:`~fenced.WrongLockError`; a stored mark that is not a
token (a text or a number out of range in the row, a Redis fence key of another type or
with a non-decimal ``hw``) :class:`~fenced.CorruptMarkError`; a table that cannot be used
:class:`~fenced.ConfigurationError`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import logging
import sqlite3
import threading
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Generic,
    Literal,
    NoReturn,
    Protocol,
    TypeVar,
    runtime_checkable,
)

from .._clients.connections import AsyncConnections
from .._clients.pg_errors import connect_refusal
from .._clients.pg_errors import kind as pg_kind
from .._clients.sqlite_errors import is_busy, unusable
from .._core.errors import BackendUnavailable, ConfigurationError, CorruptMarkError, FencedError
from .._core.token import FencingToken
from ._sql_driver import map_error
from ._sql_plan import POSTGRESQL, SQLITE
from .sql import SQLGuard

if TYPE_CHECKING:
    from .redis import AsyncRedisGuard

__all__ = [
    "FenceStore",
    "PostgresFenceStore",
    "RedisFenceStore",
    "SQLiteFenceStore",
]

logger = logging.getLogger("fenced.guards.http")

T = TypeVar("T")
G = TypeVar("G")

_GUARD_CACHE: Final = 1024


@runtime_checkable
class FenceStore(Protocol):
    """A durable high-water mark per resource, checked and advanced in one atomic step."""

    async def advance(self, resource: str, token: FencingToken) -> None:
        """Accept ``token`` for ``resource`` if >= its mark and raise the mark to it.

        Raises :class:`~fenced.StaleTokenError` (``high_water`` = the mark) if it is lower.
        """
        ...


class _Guards(Generic[G]):
    """A small LRU of guard objects per (resource, lock): they cache their SQL or scripts.

    Used from the event loop and from a store's worker thread at once, hence the mutex.
    """

    def __init__(self, make: Callable[[str, str], G]) -> None:
        self._make = make
        self._cache: collections.OrderedDict[tuple[str, str], G] = collections.OrderedDict()
        self._mutex = threading.Lock()

    def get(self, resource: str, lock: str) -> G:
        key = (resource, lock)
        with self._mutex:
            guard = self._cache.get(key)
            if guard is None:
                guard = self._cache[key] = self._make(resource, lock)
                if len(self._cache) > _GUARD_CACHE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
            return guard

    def all(self) -> list[G]:
        with self._mutex:
            return list(self._cache.values())


def _raise_mapped(exc: BaseException, mapped: BaseException) -> NoReturn:
    """Raise ``mapped`` from ``exc``, or ``exc`` itself unchanged (with its own cause)."""
    if mapped is exc:
        raise exc
    raise mapped from exc


def _map_sqlite(conn: sqlite3.Connection, exc: BaseException) -> BaseException:
    mapped = map_error(SQLITE, conn, exc)
    if mapped is None:
        return exc
    mapped.__cause__ = exc
    return mapped


# -- SQLite -------------------------------------------------------------------------------------


class _CloseAlias:
    """``await store.close()``, the spelling before issue 27 (``close`` is synchronous in
    fenced, ``aclose`` a coroutine): still works, with a DeprecationWarning."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        warnings.warn(
            f"{type(self).__name__}.close() is deprecated: use 'await store.aclose()'",
            DeprecationWarning,
            stacklevel=2,
        )
        await self.aclose()


class SQLiteFenceStore(_CloseAlias):
    """Marks in a SQLite database file (WAL mode), in the fence table of :class:`SQLGuard`.

    ``synchronous``:

    * ``"FULL"`` (default) — every accepted token is fsync'd before the request goes on:
      durable against power loss. The fsync must not stall the event loop, so all work
      runs on the store's one worker thread (SQLite has one writer at a time anyway).
    * ``"NORMAL"`` — WAL commits are not fsync'd (checkpoints are): an accepted token
      survives a crash of the process, but the last ones may be lost at power loss or an OS
      crash. Then a mark could go back while data written elsewhere stays, letting one stale
      writer in. Choose it when the fenced data lives in the same database (written through
      :meth:`transaction`, so it goes back together with the mark) or when that risk is
      acceptable. A commit then costs ~20 µs of CPU, so ``advance`` runs inline on the event
      loop (never waiting for a lock: if another connection holds the write lock it moves to
      the worker thread), and WAL checkpoints run on the worker thread.

    ``inline`` overrides where ``advance`` runs (default: inline iff ``synchronous="NORMAL"``).
    :meth:`transaction` always runs on the worker thread: it runs your code.
    """

    guard_class: type[SQLGuard] = SQLGuard

    def __init__(
        self,
        path: str,
        *,
        table: str = "fenced_fences",
        synchronous: Literal["FULL", "NORMAL"] = "FULL",
        inline: bool | None = None,
        busy_timeout: float = 5.0,
        checkpoint_every: int = 256,
    ) -> None:
        if synchronous not in ("FULL", "NORMAL"):
            raise ConfigurationError(f"synchronous must be 'FULL' or 'NORMAL', not {synchronous!r}")
        self.path = str(path)
        self.table = table
        self.synchronous = synchronous
        self.inline = synchronous == "NORMAL" if inline is None else bool(inline)
        self.busy_timeout = float(busy_timeout)
        self.checkpoint_every = int(checkpoint_every)
        self._guards: _Guards[SQLGuard] = _Guards(self._make_guard)
        self._installer = self.guard_class("fenced-install", lock="fenced", table=table)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None  # used on the worker thread only
        self._inline_conn: sqlite3.Connection | None = None  # used on the loop only
        self._opening: asyncio.Lock | None = None
        self._since_checkpoint = 0

    def _make_guard(self, resource: str, lock: str) -> SQLGuard:
        return self.guard_class(resource, lock=lock, table=self.table)

    def guard(self, resource: str, lock: str) -> SQLGuard:
        """The :class:`SQLGuard` this store uses for ``resource``."""
        return self._guards.get(resource, lock)

    # -- lifecycle ------------------------------------------------------------------------

    def _connect(self, busy_timeout: float) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                self.path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={self.synchronous}")
        except sqlite3.Error as exc:
            reason = unusable(self.path, exc)  # (not a database, a directory, no permission)
            if reason is not None:
                raise ConfigurationError(reason) from exc
            raise BackendUnavailable(f"cannot open SQLite database {self.path!r}: {exc}") from exc
        return conn

    def _open_sync(self) -> None:
        conn = self._connect(self.busy_timeout)
        try:
            self._installer.install(conn)
            if self.inline:
                inline = self._connect(0.0)
                inline.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints: worker thread
                self._inline_conn = inline
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    async def open(self) -> SQLiteFenceStore:
        """Open the database and create the fence table if needed (done on first use too)."""
        if self._conn is not None:
            return self
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._conn is None:
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="fenced-sqlite"
                    )
                await self._in_thread(self._open_sync)
        return self

    async def aclose(self) -> None:
        """Close the connections and stop the worker thread."""
        executor, self._executor = self._executor, None
        if executor is None:
            return

        def close_all() -> None:
            for conn in (self._inline_conn, self._conn):
                if conn is not None:
                    conn.close()
            self._inline_conn = self._conn = None

        await asyncio.get_running_loop().run_in_executor(executor, close_all)
        executor.shutdown(wait=False)

    async def __aenter__(self) -> SQLiteFenceStore:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        if self._executor is None:
            raise BackendUnavailable(f"SQLiteFenceStore({self.path!r}) is closed")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    # -- the fenced transaction -------------------------------------------------------------

    def _run_sync(
        self,
        conn: sqlite3.Connection,
        resource: str,
        token: FencingToken,
        fn: Callable[[sqlite3.Connection], T] | None,
        *,
        begun: bool = False,
    ) -> T | None:
        """BEGIN IMMEDIATE; fence check; ``fn(conn)``; COMMIT — or ROLLBACK on any error."""
        if not begun:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise _map_sqlite(conn, exc) from exc
        guard = self._guards.get(resource, token.lock)
        try:
            try:
                guard.check(conn, token=token)
            except ConfigurationError as exc:
                _raise_mapped(exc, self._damaged(conn, guard, exc))
            result = _call_inside(conn, fn) if fn is not None else None
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error):
                raise _map_sqlite(conn, exc) from exc
            raise
        return result

    @staticmethod
    def _damaged(conn: sqlite3.Connection, guard: SQLGuard, exc: ConfigurationError) -> Exception:
        """``exc``, or :class:`~fenced.CorruptMarkError` when what the guard found is a mark
        that is not an integer: the store made (or verified) the table with an INTEGER token
        column at open, so such a value was written around it (SQLite keeps whatever it is
        given), and it is a damaged mark, not a misconfigured store."""
        try:
            row = conn.execute(
                f"SELECT typeof(token), token FROM {guard._quoted} WHERE resource = ?",
                (guard.resource,),
            ).fetchone()
        except sqlite3.Error:
            return exc
        if row is None or row[0] == "integer":
            return exc
        return CorruptMarkError(guard.resource, f"token {str(row[1])[:40]!r} ({row[0]})")

    async def advance(self, resource: str, token: FencingToken) -> None:
        """Check and advance ``resource``'s mark (see the class docstring for where it runs)."""
        if self._conn is None:
            await self.open()
        inline = self._inline_conn
        if inline is not None:
            try:
                inline.execute("BEGIN IMMEDIATE")  # busy_timeout 0: never waits on the loop
            except sqlite3.Error as exc:
                if not (isinstance(exc, sqlite3.OperationalError) and is_busy(exc)):
                    raise _map_sqlite(inline, exc) from exc
                # another connection is writing: wait for it on the thread, not on the loop
            else:
                self._run_sync(inline, resource, token, None, begun=True)
                self._after_inline_commit()
                return
        conn = self._conn
        assert conn is not None
        await self._in_thread(lambda: self._run_sync(conn, resource, token, None))

    def _after_inline_commit(self) -> None:
        self._since_checkpoint += 1
        if self._since_checkpoint >= self.checkpoint_every and self._executor is not None:
            self._since_checkpoint = 0
            conn = self._conn
            if conn is not None:
                future = self._executor.submit(conn.execute, "PRAGMA wal_checkpoint(PASSIVE)")
                future.add_done_callback(_log_failure)

    async def transaction(
        self, resource: str, token: FencingToken, fn: Callable[[sqlite3.Connection], T]
    ) -> T:
        """Run ``fn(conn)`` on the worker thread in ONE transaction with the fence check.

        ``BEGIN IMMEDIATE``, advance the mark, ``fn(conn)``, ``COMMIT``; if the token is
        stale, ``fn`` is not called; if ``fn`` raises, everything rolls back (the mark too).
        This is how a handler's write is fenced atomically: the middleware's own check was
        an earlier, separate transaction.
        """
        _check_transaction_fn(fn, want_async=False)
        if self._conn is None:
            await self.open()
        conn = self._conn
        assert conn is not None
        result = await self._in_thread(lambda: self._run_sync(conn, resource, token, fn))
        return result  # type: ignore[return-value]

    async def high_water(self, resource: str, lock: str) -> FencingToken | None:
        """The highest token accepted for ``resource`` (None if none)."""
        if self._conn is None:
            await self.open()
        conn = self._conn
        assert conn is not None

        def read() -> FencingToken | None:
            guard = self._guards.get(resource, lock)
            try:
                return guard.high_water(conn)
            except ConfigurationError as exc:
                _raise_mapped(exc, self._damaged(conn, guard, exc))

        return await self._in_thread(read)

    def __repr__(self) -> str:
        return f"SQLiteFenceStore({self.path!r}, synchronous={self.synchronous!r})"


def _check_transaction_fn(fn: Callable[..., Any], *, want_async: bool) -> None:
    """The one contract of ``transaction(resource, token, fn)``, checked before anything runs.

    ``fn(conn)`` runs inside the store's fenced transaction and must not end it. It is a plain
    function for :class:`SQLiteFenceStore` (it runs on the store's worker thread, with the
    ``sqlite3`` connection) and an ``async def`` for :class:`PostgresFenceStore` (awaited on
    the loop, with the ``psycopg.AsyncConnection``).
    """
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
    )
    if not callable(fn) or is_async != want_async:
        kind = "an async def" if want_async else "a plain (non-async) function"
        raise ConfigurationError(f"transaction() needs {kind} taking the connection, not {fn!r}")


_TRANSACTION_CONTROL: Final = frozenset({sqlite3.SQLITE_TRANSACTION, sqlite3.SQLITE_SAVEPOINT})


def _call_inside(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
    """``fn(conn)`` with BEGIN/COMMIT/ROLLBACK/SAVEPOINT denied, so it cannot end the fence.

    SQLite's authorizer sees every statement as it is prepared (``commit()``,
    ``executescript`` and cached statements included: setting it expires them), so a write
    can never escape the fenced transaction into an unfenced one.
    """
    tried: list[int] = []

    def authorize(action: int, *_: object) -> int:
        if action in _TRANSACTION_CONTROL:
            tried.append(action)
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    conn.set_authorizer(authorize)
    try:
        result = fn(conn)
    except sqlite3.DatabaseError as exc:
        if tried:
            raise _ended_inside() from exc
        raise
    finally:
        conn.set_authorizer(None)
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise ConfigurationError("transaction() fn returned an awaitable: pass a plain function")
    if tried or not conn.in_transaction:
        raise _ended_inside()
    return result


def _ended_inside() -> ConfigurationError:
    return ConfigurationError(
        "transaction() fn tried to begin, commit or roll back: the store ends the fenced "
        "transaction itself (everything was rolled back)"
    )


def _log_failure(future: concurrent.futures.Future[Any]) -> None:
    exc = future.exception()
    if exc is not None:
        logger.warning("WAL checkpoint failed: %r", exc)


# -- PostgreSQL ---------------------------------------------------------------------------------


class _AsyncPool(Protocol):
    def connection(self) -> contextlib.AbstractAsyncContextManager[Any]: ...


def _small_pool(dsn: str, size: int, connect_timeout: float) -> AsyncConnections[Any]:
    """Up to ``size`` psycopg AsyncConnections (the one connection manager,
    ``fenced._clients.connections``); broken ones are dropped and replaced."""

    async def connect() -> Any:
        import psycopg

        try:
            return await psycopg.AsyncConnection.connect(
                dsn, connect_timeout=max(1, round(connect_timeout))
            )
        except Exception as exc:
            if type(exc).__module__.startswith("psycopg"):
                refused = connect_refusal(exc)  # (a wrong password: no retry passes)
                if refused is not None:
                    raise refused from exc
                raise BackendUnavailable(f"cannot connect to PostgreSQL: {exc}") from exc
            raise

    def healthy(conn: Any) -> bool:
        if conn.closed or conn.broken:
            return False
        status = conn.info.transaction_status
        return bool(status == status.IDLE)

    # (whatever the caller's fn raised, psycopg's own state says whether the connection is
    # fit to lend again: a block that failed mid-statement leaves it not IDLE)
    return AsyncConnections(
        connect,
        name="PostgreSQL fence store",
        idle=size,
        limit=size,
        healthy=healthy,
        drop_after=lambda exc: False,
    )


class PostgresFenceStore(_CloseAlias):
    """Marks in a PostgreSQL table (the fence table of :class:`SQLGuard`), via psycopg 3.

    ``dsn_or_pool``: a connection string (the store keeps up to ``pool_size`` connections),
    or a pool with an ``async with pool.connection() as conn`` method, such as
    ``psycopg_pool.AsyncConnectionPool``. Each :meth:`advance` is one transaction: BEGIN,
    the fence statement, COMMIT; it is durable when COMMIT returns (with the server's
    default ``synchronous_commit=on``).
    """

    guard_class: type[SQLGuard] = SQLGuard

    def __init__(
        self,
        dsn_or_pool: str | _AsyncPool,
        *,
        table: str = "fenced_fences",
        pool_size: int = 4,
        connect_timeout: float = 5.0,
    ) -> None:
        self.table = table
        self._own_pool: AsyncConnections[Any] | None = None
        self._pool: _AsyncPool
        if isinstance(dsn_or_pool, str):
            self._pool = self._own_pool = _small_pool(dsn_or_pool, pool_size, connect_timeout)
        else:
            self._pool = dsn_or_pool
        self._guards: _Guards[SQLGuard] = _Guards(self._make_guard)
        self._installer = self.guard_class("fenced-install", lock="fenced", table=table)
        self._installed = False

    def _make_guard(self, resource: str, lock: str) -> SQLGuard:
        return self.guard_class(resource, lock=lock, table=self.table)

    def guard(self, resource: str, lock: str) -> SQLGuard:
        """The :class:`SQLGuard` this store uses for ``resource``."""
        return self._guards.get(resource, lock)

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[Any]:
        async with self._pool.connection() as conn:
            if not self._installed:
                await self._installer.ainstall(conn)
                self._installed = True
            yield conn

    async def open(self) -> PostgresFenceStore:
        """Connect and create the fence table if needed (done on first use too)."""
        async with self._connection():
            pass
        return self

    async def aclose(self) -> None:
        """Close the store's own connections (a pool passed in is left to its owner)."""
        if self._own_pool is not None:
            await self._own_pool.aclose()

    async def __aenter__(self) -> PostgresFenceStore:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def transaction(
        self, resource: str, token: FencingToken, fn: Callable[[Any], Awaitable[T]]
    ) -> T:
        """``await fn(conn)`` in ONE transaction with the fence check (see SQLite's).

        ``fn`` must be an ``async def``; if it ends the transaction itself (a raw ``COMMIT``),
        :class:`~fenced.ConfigurationError` is raised, as psycopg does for ``commit()``.
        """
        _check_transaction_fn(fn, want_async=True)
        guard = self._guards.get(resource, token.lock)
        try:
            async with self._connection() as conn, conn.transaction():
                await guard.acheck(conn, token=token)
                result = await fn(conn)
                status = conn.info.transaction_status
                if status not in (status.INTRANS, status.INERROR):
                    raise ConfigurationError(
                        "transaction() fn ended the fenced transaction itself; writes it made "
                        "after that were not fenced: never COMMIT or ROLLBACK inside fn"
                    )
                return result
        except FencedError:
            raise
        except Exception as exc:  # BEGIN/COMMIT themselves failed
            raise _map_psycopg(exc) from exc

    async def advance(self, resource: str, token: FencingToken) -> None:
        """Check and advance ``resource``'s mark in one committed transaction."""
        guard = self._guards.get(resource, token.lock)
        try:
            async with self._connection() as conn, conn.transaction():
                await guard.acheck(conn, token=token)
        except FencedError:
            raise
        except Exception as exc:
            raise _map_psycopg(exc) from exc

    async def high_water(self, resource: str, lock: str) -> FencingToken | None:
        """The highest token accepted for ``resource`` (None if none)."""
        guard = self._guards.get(resource, lock)
        try:
            async with self._connection() as conn:
                value = await guard.ahigh_water(conn)
                await conn.rollback()
                return value
        except FencedError:
            raise
        except Exception as exc:
            raise _map_psycopg(exc) from exc


def _map_psycopg(exc: Exception) -> BaseException:
    """The SQL guards' reading of a psycopg error (``_pg_errors``): a serialization failure,
    deadlock or lock timeout (psycopg's OperationalErrors too) is a conflict to retry, not an
    unavailable server."""
    import psycopg

    if pg_kind(exc) == "conflict":
        mapped = map_error(POSTGRESQL, None, exc)
        if mapped is not None:
            return mapped
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return BackendUnavailable(f"PostgreSQL unavailable: {exc}")
    return exc


# -- Redis ----------------------------------------------------------------------------------------


class RedisFenceStore(_CloseAlias):
    """Marks in Redis, one hash per resource (``fenced:hw:{resource}``), via one Lua script.

    ``client`` is a ``redis.asyncio.Redis``. Durability is the server's: run it with
    ``appendonly yes`` and ``appendfsync always`` for marks that survive power loss
    (``everysec`` may lose the last second). Use :meth:`guard` in a handler to write data
    keys in the same script as the fence check.
    """

    def __init__(self, client: Any) -> None:
        from .redis import AsyncRedisGuard

        self.guard_class: type[AsyncRedisGuard] = AsyncRedisGuard
        self._client = client
        self._guards: _Guards[AsyncRedisGuard] = _Guards(self._make_guard)

    def _make_guard(self, resource: str, lock: str) -> AsyncRedisGuard:
        return self.guard_class(self._client, resource, lock=lock)

    def guard(self, resource: str, lock: str) -> AsyncRedisGuard:
        """The :class:`~fenced.guards.redis.AsyncRedisGuard` for ``resource``: its ``set``,
        ``hset``, ``delete`` and ``eval`` check the token in the same script as the write."""
        return self._guards.get(resource, lock)

    async def advance(self, resource: str, token: FencingToken) -> None:
        """Check and advance ``resource``'s mark: the guard's prelude with an empty body."""
        try:
            await self._guards.get(resource, token.lock).eval("return 1", [], [], token=token)
        except FencedError as exc:
            _raise_mapped(exc, _wrong_type(exc, resource))

    async def high_water(self, resource: str, lock: str) -> FencingToken | None:
        """The highest token accepted for ``resource`` (None if none)."""
        try:
            return await self._guards.get(resource, lock).high_water()
        except FencedError as exc:
            _raise_mapped(exc, _wrong_type(exc, resource))

    async def aclose(self) -> None:
        """Close the guards' own connections (the client belongs to the caller)."""
        guards = self._guards.all()
        if guards:  # (they share one pool per client: closing one closes its idle connections)
            await guards[0].aclose()

    def __repr__(self) -> str:
        return f"RedisFenceStore({self._client!r})"


def _wrong_type(exc: FencedError, resource: str) -> FencedError:
    """A WRONGTYPE reply to the store's empty-bodied script or its HMGET can only be about the
    fence key (no other key is touched): it is not a hash, so the mark is damaged."""
    cause = exc.__cause__
    if type(exc) is FencedError and cause is not None and "WRONGTYPE" in str(cause):
        return CorruptMarkError(resource, "the fence key is not a hash")
    return exc
