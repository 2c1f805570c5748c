"""Adversarial review of the SQLite and PostgreSQL token sources: one test per bug found.

Each test drives a real server (or a real SQLite file) into the window where the bug bit and
checks the source's own view of the lock afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import psycopg

from fenced.backends.postgresql import PostgreSQLBackend
from tests.helpers import async_wait_for, unique_name


def _noop(exc: BaseException) -> None:
    pass


@contextlib.asynccontextmanager
async def pg_backends(dsn: str, n: int, **options: Any) -> AsyncIterator[list[PostgreSQLBackend]]:
    opened = [await PostgreSQLBackend.open(urlsplit(dsn), dict(options)) for _ in range(n)]
    try:
        yield opened  # type: ignore[misc]
    finally:
        for backend in opened:
            await backend.aclose()


async def _count(dsn: str, query: str, *params: Any) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute(query.encode(), params)
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


def _blocked_on_row(dsn: str, n: int = 1) -> Callable[[], Awaitable[bool]]:
    """True once ``n`` statements wait for a row lock held by another transaction."""

    async def check() -> bool:
        waiting = await _count(
            dsn,
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype IN ('transactionid', 'tuple')",
        )
        return waiting >= n

    return check


def _fenced_idle(dsn: str) -> Callable[[], Awaitable[bool]]:
    """True once no statement of a fenced connection is running (abandoned ones included)."""

    async def check() -> bool:
        active = await _count(
            dsn,
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'fenced'"
            " AND state <> 'idle'",
        )
        return active == 0

    return check


def _tasks_done(backend: PostgreSQLBackend) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return not backend._tasks

    return check


# -- PostgreSQL ------------------------------------------------------------------------------


async def test_postgresql_acquire_cancelled_while_enqueuing_leaves_the_queue(pg_dsn: str) -> None:
    """A waiter cancelled while its first (enqueuing) statement is in flight must not stay
    queued: its row would head the queue, and every later waiter would wait for it to expire
    (``waiter_ttl``) after the lock is released."""
    name = unique_name()
    async with pg_backends(pg_dsn, 3, waiter_ttl=60) as (holder, cancelled, later):
        grant = await holder.acquire(name, request_id="h", ttl=30, deadline=None, on_lost=_noop)
        async with await psycopg.AsyncConnection.connect(pg_dsn) as blocker:
            await blocker.execute(b"SELECT 1 FROM fenced_locks WHERE name = %s FOR UPDATE", (name,))
            task = asyncio.create_task(
                cancelled.acquire(name, request_id="w", ttl=5, deadline=None, on_lost=_noop)
            )
            await async_wait_for(_blocked_on_row(pg_dsn), what="the acquire to block on the row")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await blocker.commit()  # the abandoned statement now queues "w"
        await async_wait_for(_fenced_idle(pg_dsn), what="the abandoned statement to finish")

        async def left() -> bool:
            return (await holder.status(name)).waiters == 0

        await async_wait_for(left, timeout=5, what="the cancelled waiter to leave the queue")
        # And so the next waiter gets a released lock at once, not after waiter_ttl.
        task = asyncio.create_task(
            later.acquire(name, request_id="c", ttl=5, deadline=None, on_lost=_noop)
        )
        await async_wait_for(lambda: _waiters_are(holder, name, 1), what="c to queue")
        assert await holder.release(grant) is True
        got = await asyncio.wait_for(task, 5)
        assert got.token > grant.token


async def _waiters_are(backend: PostgreSQLBackend, name: str, n: int) -> bool:
    return (await backend.status(name)).waiters == n


async def test_postgresql_retry_after_cancel_keeps_the_grant_it_returns(pg_dsn: str) -> None:
    """Cancelled, then retried under the same request id (the contract's idempotent retry):
    the retry returns the grant the abandoned statement made, so the give-back of that
    "orphan" must not free it behind the holder's back."""
    name = unique_name()
    async with pg_backends(pg_dsn, 1) as (backend,):
        first = await backend.acquire(name, request_id="a", ttl=5, deadline=None, on_lost=_noop)
        assert await backend.release(first) is True
        async with await psycopg.AsyncConnection.connect(pg_dsn) as blocker:
            await blocker.execute(b"SELECT 1 FROM fenced_locks WHERE name = %s FOR UPDATE", (name,))
            task = asyncio.create_task(
                backend.acquire(name, request_id="r", ttl=30, deadline=None, on_lost=_noop)
            )
            await async_wait_for(_blocked_on_row(pg_dsn), what="the acquire to block on the row")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            retry = asyncio.create_task(
                backend.acquire(name, request_id="r", ttl=30, deadline=None, on_lost=_noop)
            )
            await async_wait_for(_blocked_on_row(pg_dsn, 2), what="the retry to block too")
            await blocker.commit()
        grant = await asyncio.wait_for(retry, 10)
        await async_wait_for(_tasks_done(backend), what="background clean-up")
        status = await backend.status(name)
        assert status.holder == "r" and status.token == grant.token, (
            f"the retry returned {grant.token} but the source shows {status}"
        )
        assert await backend.release(grant) is True


async def test_postgresql_abandoned_connection_is_not_closed_under_a_queued_call(
    pg_dsn: str,
) -> None:
    """A cancelled acquire gives its connection up. Another call of the same backend that was
    already queued on that connection must still run on it: closing the socket under it failed
    that call on a healthy server, and left its fd registered in the event loop, so the next
    connection to reuse the fd number failed too ("connection socket closed")."""
    name, other = unique_name(), unique_name()
    async with pg_backends(pg_dsn, 1) as (backend,):
        grant = await backend.acquire(other, request_id="o", ttl=30, deadline=None, on_lost=_noop)
        first = await backend.acquire(name, request_id="a", ttl=5, deadline=None, on_lost=_noop)
        assert await backend.release(first) is True
        conn = backend._conn
        assert conn is not None
        async with await psycopg.AsyncConnection.connect(pg_dsn) as blocker:
            await blocker.execute(b"SELECT 1 FROM fenced_locks WHERE name = %s FOR UPDATE", (name,))
            task = asyncio.create_task(
                backend.acquire(name, request_id="b", ttl=30, deadline=None, on_lost=_noop)
            )
            await async_wait_for(_blocked_on_row(pg_dsn), what="the acquire to block on the row")
            renewal = asyncio.create_task(backend.renew(grant))

            async def renewal_queued() -> bool:
                return bool(conn.lock._waiters)  # type: ignore[attr-defined]

            await async_wait_for(renewal_queued, what="the renewal to queue on the connection")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await blocker.commit()
        renewed = await asyncio.wait_for(renewal, 10)
        assert renewed.token == grant.token
        await async_wait_for(_tasks_done(backend), what="background clean-up")
        # New connections (which may reuse the old fd number) work.
        for i in range(3):
            again = await backend.acquire(
                name, request_id=f"c{i}", ttl=5, deadline=None, on_lost=_noop
            )
            assert await backend.release(again) is True
            backend._drop(backend._conn)  # type: ignore[arg-type]
            await async_wait_for(_tasks_done(backend), what="the close")
        assert await backend.release(grant) is True
