"""The one manager of the connections fenced opens for itself and keeps for the next call.

Sync (:class:`Connections`) and async (:class:`AsyncConnections`), for every client fenced
opens connections of on its own: a SQL guard's fencer and the replicated groups' SQL members
(``SQLGuard.fencer``/``afencer``), the PostgreSQL fence store of the ASGI middleware.

A connection is lent to one caller at a time (``with conns.connection() as conn:``). It goes
back for the next caller unless the block failed in a way that may have left it unusable
(``drop_after``; by default a :class:`~fenced.BackendUnavailable`, or any error fenced did
not classify, a cancellation too). A refusal (a stale token, a conflict, bad input) is an
answer of a working connection: the guard rolled its transaction back, so it is kept. ``healthy(conn)`` is asked
too when a connection comes back (e.g. a psycopg connection left inside a transaction is
closed, not lent again). A connection that fails to open, or whose ``setup`` fails, is closed
and reported as :class:`~fenced.BackendUnavailable`, but for what no retry gets past (a
:class:`~fenced.FencedError` raised by ``connect`` or ``setup`` as it is; a psycopg refusal of
the role or the password, :class:`~fenced.AccessDenied`, by ``pg_errors``).

Why not psycopg_pool: it serves psycopg only, while the SQL members and fencers take any
driver the SQL guard takes (sqlite3, PyMySQL, asyncmy, SQLAlchemy); a pool of the caller's
(``psycopg_pool.AsyncConnectionPool``) is still taken where a store accepts one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Generic, TypeVar

from .._core.errors import BackendUnavailable, FencedError
from .pg_errors import connect_refusal

__all__ = ["AsyncConnections", "Connections", "unusable_after"]

C = TypeVar("C")


def unusable_after(exc: BaseException) -> bool:
    """Whether a connection may be unusable after ``exc`` escaped a block using it: it did
    not answer (BackendUnavailable), or the failure is none of fenced's answers (an error
    nobody classified, a cancellation, Ctrl-C in the middle of a statement)."""
    return isinstance(exc, BackendUnavailable) or not isinstance(exc, FencedError)


def _always(conn: Any) -> bool:
    return True


def _never(conn: Any) -> bool:
    return False


def _close_sync(conn: Any) -> None:
    with contextlib.suppress(Exception):
        conn.close()


async def _close_any(conn: Any) -> None:
    with contextlib.suppress(Exception):
        closing = conn.close()
        if inspect.isawaitable(closing):
            await closing


def _opening_failed(name: str, exc: Exception) -> BaseException:
    if isinstance(exc, FencedError):
        return exc
    refused = connect_refusal(exc)  # (a wrong password: AccessDenied, no retry lets it in)
    if refused is not None:
        return refused
    return BackendUnavailable(f"{name}: cannot connect: {exc}")


class _Ledger(Generic[C]):
    """What :class:`Connections` and :class:`AsyncConnections` both keep: the idle
    connections, how many are open, the generation; each wraps it in its own lock."""

    def __init__(
        self,
        name: str,
        idle: int,
        limit: int | None,
        healthy: Callable[[C], bool],
        drop_after: Callable[[BaseException], bool],
    ) -> None:
        self.name = name
        self._idle_max = idle
        self._limit = limit
        self._healthy = healthy
        self._drop_after = drop_after
        self._idle: collections.deque[C] = collections.deque()
        self._open = 0
        self._generation = 0  # (raised by close: what was lent before is not kept after)

    def _full(self) -> bool:
        """No idle connection, and no room for a new one: wait."""
        return not self._idle and self._limit is not None and self._open >= self._limit

    def _take(self) -> C | None:
        """An idle connection, or None after counting the one the caller will open."""
        if self._idle:
            return self._idle.pop()
        self._open += 1
        return None

    def _lendable(self, conn: C, generation: int, broken: bool) -> bool:
        """May ``conn``, given back, be lent again (``_forget`` it once closed if not)?"""
        return not broken and generation == self._generation and self._healthy(conn)

    def _kept(self, conn: C, generation: int, broken: bool) -> bool:
        """Keep ``conn`` idle if it may be lent again and there is room."""
        if len(self._idle) < self._idle_max and self._lendable(conn, generation, broken):
            self._idle.append(conn)
            return True
        return False

    def _drain(self, *more: C) -> list[C]:
        """Forget the idle connections (and ``more``), to be closed by the caller."""
        self._generation += 1
        gone = [*self._idle, *more]
        self._idle = collections.deque()
        self._open -= len(gone)
        return gone


class Connections(_Ledger[C]):
    """Connections made by ``connect()`` (blocking), lent one caller at a time, from any
    thread. ``setup(conn)`` runs once on each new connection. Up to ``idle`` connections are
    kept between calls (0: each call opens one and closes it); ``limit`` bounds how many are
    open at once (None: no bound; a caller beyond it waits). A connection ``bound(conn)`` to
    the thread that made it (``sqlite3``'s, and calls come from any worker thread) is kept
    for that thread only: one per thread, besides the ``idle`` ones."""

    def __init__(
        self,
        connect: Callable[[], C],
        *,
        name: str,
        setup: Callable[[C], None] | None = None,
        idle: int = 1,
        limit: int | None = None,
        bound: Callable[[C], bool] = _never,
        healthy: Callable[[C], bool] = _always,
        drop_after: Callable[[BaseException], bool] = unusable_after,
        close: Callable[[C], None] = _close_sync,
    ) -> None:
        super().__init__(name, idle, limit, healthy, drop_after)
        self._connect = connect
        self._setup = setup
        self._bound = bound
        self._close = close
        self._by_thread: dict[int, C] = {}  # idle bound connections, by their thread
        self._freed = threading.Condition()

    @contextlib.contextmanager
    def connection(self) -> Iterator[C]:
        conn, generation = self._get()
        try:
            yield conn
        except BaseException as exc:
            self._put(conn, generation, broken=self._drop_after(exc))
            raise
        self._put(conn, generation, broken=False)

    def _get(self) -> tuple[C, int]:
        with self._freed:
            generation = self._generation
            mine = self._by_thread.pop(threading.get_ident(), None)
            if mine is not None:
                return mine, generation
            while self._full():
                self._freed.wait()
            generation = self._generation
            conn = self._take()
            if conn is not None:
                return conn, generation
        try:
            conn = self._connect()
        except BaseException as exc:
            self._forget()
            if isinstance(exc, Exception):
                raise _opening_failed(self.name, exc) from exc
            raise
        try:
            if self._setup is not None:
                self._setup(conn)
        except BaseException as exc:
            self._close(conn)
            self._forget()
            if isinstance(exc, Exception):
                raise _opening_failed(self.name, exc) from exc
            raise
        return conn, generation

    def _put(self, conn: C, generation: int, *, broken: bool) -> None:
        me = threading.get_ident()  # (given back on the thread it was taken on)
        with self._freed:
            if not self._bound(conn):
                if self._kept(conn, generation, broken):
                    self._freed.notify()
                    return
            elif (
                self._idle_max
                and me not in self._by_thread
                and self._lendable(conn, generation, broken)
            ):
                self._by_thread[me] = conn  # (this thread's: kept beside the idle ones)
                return
        # (closed, then its place freed: a connection being closed still counts)
        self._close(conn)
        self._forget()

    def _forget(self) -> None:
        with self._freed:
            self._open -= 1
            self._freed.notify()

    def close(self) -> None:
        """Close the idle connections; one lent now is closed when it comes back. A later
        call opens a new one."""
        with self._freed:
            gone = self._drain(*self._by_thread.values())
            self._by_thread = {}
            self._freed.notify_all()
        for conn in gone:
            # (a bound one fails to close from another thread: dropped, its finaliser
            # closes it)
            self._close(conn)


class AsyncConnections(_Ledger[C]):
    """:class:`Connections` for asyncio: ``connect()`` and ``setup(conn)`` are awaited, and
    ``close`` may be a coroutine (psycopg) or not (asyncmy). Used on one event loop."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[C]],
        *,
        name: str,
        setup: Callable[[C], Awaitable[None]] | None = None,
        idle: int = 1,
        limit: int | None = None,
        healthy: Callable[[C], bool] = _always,
        drop_after: Callable[[BaseException], bool] = unusable_after,
        close: Callable[[C], Awaitable[None]] = _close_any,
    ) -> None:
        super().__init__(name, idle, limit, healthy, drop_after)
        self._connect = connect
        self._setup = setup
        self._close = close
        self._freed: asyncio.Condition | None = None  # (made on the loop that uses it)

    def _condition(self) -> asyncio.Condition:
        if self._freed is None:
            self._freed = asyncio.Condition()
        return self._freed

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[C]:
        conn, generation = await self._get()
        try:
            yield conn
        except BaseException as exc:
            await self._put(conn, generation, broken=self._drop_after(exc))
            raise
        await self._put(conn, generation, broken=False)

    async def _get(self) -> tuple[C, int]:
        freed = self._condition()
        async with freed:
            while self._full():
                await freed.wait()
            generation = self._generation
            conn = self._take()
            if conn is not None:
                return conn, generation
        try:
            conn = await self._connect()
        except BaseException as exc:
            await self._forget()
            if isinstance(exc, Exception):
                raise _opening_failed(self.name, exc) from exc
            raise
        try:
            if self._setup is not None:
                await self._setup(conn)
        except BaseException as exc:
            try:
                await self._close(conn)
            finally:
                await self._forget()
            if isinstance(exc, Exception):
                raise _opening_failed(self.name, exc) from exc
            raise
        return conn, generation

    async def _put(self, conn: C, generation: int, *, broken: bool) -> None:
        freed = self._condition()
        async with freed:
            if self._kept(conn, generation, broken):
                freed.notify()
                return
        # (closed, then its place freed: a connection being closed still counts)
        try:
            await self._close(conn)
        finally:
            await self._forget()

    async def _forget(self) -> None:
        freed = self._condition()
        async with freed:
            self._open -= 1
            freed.notify()

    async def aclose(self) -> None:
        """Close the idle connections; one lent now is closed when it comes back. A later
        call opens a new one."""
        freed = self._condition()
        async with freed:
            gone = self._drain()
            freed.notify_all()
        for conn in gone:
            await self._close(conn)
