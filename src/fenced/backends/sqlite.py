"""``sqlite:///path/locks.db``: the embedded token source, for processes on one machine.

One SQLite file holds three tables:

* ``fenced_counters``: one row per lock with the highest token ever granted. The row is never
  deleted and the value only grows (two triggers refuse anything else), whether the lock is
  held, idle, or its holder and waiter rows have been cleaned up.
* ``fenced_holders``: the current grant of each lock (request id, token, ttl, expiry).
* ``fenced_waiters``: the FIFO queue of blocked callers, ordered by an ``AUTOINCREMENT``
  sequence; each waiter re-stamps (heartbeats) its row while it waits, so the row of a waiter
  that crashed expires and is skipped.

**Durability.** The journal is WAL with ``synchronous=FULL``: every commit fsyncs the WAL
before it returns (one fsync per transaction), so an acknowledged grant, and with it the
counter value, survives ``kill -9`` at any point and a power loss. A transaction interrupted
by a crash is rolled back when the file is next opened.

**Concurrency.** Every change is one ``BEGIN IMMEDIATE`` transaction, so SQLite serialises
the writers of all processes (LINEARIZABLE on one machine). ``SQLITE_BUSY`` is retried until
the caller's deadline (then :class:`~fenced.LockTimeout` when acquiring) or the
``busy_timeout`` option (then :class:`~fenced.BackendUnavailable`).

**Expiry** is judged against :func:`fenced._clock.now` (``CLOCK_BOOTTIME``, one clock for the
whole machine) and every row carries the boot id it was written under: a row of another boot
is expired, since every process that held it died with the reboot. A renewal succeeds only
while the same token still holds the lock *and* its lease has not run out.

**Cost.** An uncontended acquire is one transaction (read the holder and the head of the
queue, bump the counter, write the holder), a release one (fenced ``DELETE`` on token and
request id). On fenced's private loop (the synchronous API) these run inline, since nothing
else runs there; on an application's event loop they run on one worker thread per backend.

**Waking waiters.** A release wakes the blocked callers of that lock in the same process at
once (an asyncio event per waiter, process-wide per database file). Callers in other processes
poll the file with cheap reads (no write, no fsync) at an adaptive interval, from 1 ms after
anything changed up to ``poll_interval`` (default 10 ms), and at the holder's expiry.

Not DISTRIBUTED: clocks, boot ids and file locks are per machine. Never put the file on a
network filesystem. Processes in different time namespaces (containers with their own
``CLOCK_BOOTTIME`` offset) must not share a file either.

URL forms: ``sqlite:///abs/path.db`` and ``sqlite:////abs/path.db`` name an absolute path;
``sqlite://relative/path.db``, ``sqlite://./path.db`` and ``sqlite:///./path.db`` a path
relative to the working directory at connect time (made absolute then). Missing parent
directories are created. Options (URL query or keyword): ``waiter_ttl`` (seconds a waiter's
queue row outlives its last heartbeat, default 2), ``poll_interval`` (longest pause between two
polls of a cross-process waiter, default 0.01), ``busy_timeout`` (how long renew, release and
status retry a write-locked database before BackendUnavailable, default 5).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Final, TypeVar
from urllib.parse import SplitResult, parse_qsl

from .. import _clock
from .._backend import Backend, Characteristic, Grant, LockStatus, LostCallback, on_private_loop
from .._errors import (
    BackendUnavailable,
    ConfigurationError,
    FencedError,
    LeaseLostError,
    LockTimeout,
    UnsafeBackendError,
)
from .._token import FencingToken

__all__ = ["SQLiteBackend", "database_path"]

logger = logging.getLogger("fenced.sqlite")

T = TypeVar("T")

SCHEMA_VERSION: Final = 1

SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS fenced_counters (
        name TEXT PRIMARY KEY,
        last_token INTEGER NOT NULL CHECK (last_token BETWEEN 1 AND 9223372036854775807)
    ) WITHOUT ROWID""",
    """CREATE TRIGGER IF NOT EXISTS fenced_counters_only_grow
        BEFORE UPDATE OF last_token ON fenced_counters
        WHEN NEW.last_token <= OLD.last_token
        BEGIN SELECT RAISE(ABORT, 'fenced: a token counter may only grow'); END""",
    """CREATE TRIGGER IF NOT EXISTS fenced_counters_are_kept
        BEFORE DELETE ON fenced_counters
        BEGIN SELECT RAISE(ABORT, 'fenced: a token counter is never deleted'); END""",
    """CREATE TABLE IF NOT EXISTS fenced_holders (
        name TEXT PRIMARY KEY,
        request_id TEXT NOT NULL,
        token INTEGER NOT NULL,
        ttl REAL NOT NULL,
        expires_at REAL NOT NULL,
        boot_id TEXT NOT NULL
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS fenced_waiters (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL,
        request_id TEXT NOT NULL,
        expires_at REAL NOT NULL,
        boot_id TEXT NOT NULL,
        UNIQUE (name, request_id)
    )""",
    "CREATE INDEX IF NOT EXISTS fenced_waiters_queue ON fenced_waiters (name, seq)",
)

# The statements of the hot paths, as module constants so the benchmark runs the very same SQL.
# ?1 name, ?2 boot id, ?3 now: the holder row (if any) and the first live waiter.
SQL_LOCK_STATE: Final = """
SELECT h.request_id, h.token, h.ttl, h.expires_at, h.boot_id,
       (SELECT w.request_id FROM fenced_waiters AS w
         WHERE w.name = ?1 AND w.boot_id = ?2 AND w.expires_at > ?3
         ORDER BY w.seq LIMIT 1)
  FROM (SELECT 1) LEFT JOIN fenced_holders AS h ON h.name = ?1"""
SQL_NEXT_TOKEN: Final = """
INSERT INTO fenced_counters (name, last_token) VALUES (?, 1)
ON CONFLICT (name) DO UPDATE SET last_token = last_token + 1
RETURNING last_token"""
SQL_SET_HOLDER: Final = """
INSERT OR REPLACE INTO fenced_holders (name, request_id, token, ttl, expires_at, boot_id)
VALUES (?, ?, ?, ?, ?, ?)"""
SQL_RELEASE: Final = """
DELETE FROM fenced_holders WHERE name = ? AND token = ? AND request_id = ?
RETURNING expires_at, boot_id"""
SQL_RENEW: Final = """
UPDATE fenced_holders SET expires_at = max(expires_at, ?)
 WHERE name = ? AND token = ? AND request_id = ? AND boot_id = ? AND expires_at > ?"""
SQL_ENQUEUE: Final = """
INSERT INTO fenced_waiters (name, request_id, expires_at, boot_id) VALUES (?, ?, ?, ?)
ON CONFLICT (name, request_id) DO UPDATE SET expires_at = excluded.expires_at"""
SQL_DEQUEUE: Final = "DELETE FROM fenced_waiters WHERE name = ? AND request_id = ?"
SQL_PURGE_WAITERS: Final = (
    "DELETE FROM fenced_waiters WHERE name = ? AND (boot_id != ? OR expires_at <= ?)"
)
SQL_STATUS: Final = """
SELECT (SELECT last_token FROM fenced_counters WHERE name = ?1),
       h.request_id, h.token, h.expires_at, h.boot_id,
       (SELECT count(*) FROM fenced_waiters AS w
         WHERE w.name = ?1 AND w.boot_id = ?2 AND w.expires_at > ?3)
  FROM (SELECT 1) LEFT JOIN fenced_holders AS h ON h.name = ?1"""

PRAGMAS: Final = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL")
"""Set on every connection (the benchmark's bare-SQL peer uses the same)."""

BUSY_WAIT: Final = 0.05
"""Seconds one statement waits inside SQLite for another process's write lock. Short, because
on the private loop the wait blocks the loop thread; longer waits are retried from asyncio."""

POLL_MIN: Final = 0.001
_OPTIONS: Final = {"waiter_ttl": 2.0, "poll_interval": 0.01, "busy_timeout": 5.0}
_SQLITE_BUSY: Final = (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED (any extended code)


def database_path(url: SplitResult) -> str:
    """The absolute file path named by a ``sqlite://`` URL (see the module docstring)."""
    netloc, path = url.netloc, url.path
    if netloc:  # sqlite://relative/path.db, sqlite://./path.db
        path = netloc + path
    elif path.startswith(("/./", "/../")):  # sqlite:///./path.db
        path = path[1:]
    elif path.startswith("//"):  # sqlite:////abs/path.db (SQLAlchemy's absolute form)
        path = "/" + path.lstrip("/")
    if not path or path in ("/", ".", "./") or path.endswith("/"):
        raise ConfigurationError(f"sqlite URL names no file: {url.geturl()!r}")
    if ":memory:" in path or url.query.startswith("mode=memory"):
        raise ConfigurationError("an in-memory SQLite database cannot be a token source")
    return os.path.abspath(path)


def _parse_options(url: SplitResult, options: dict[str, Any]) -> dict[str, float]:
    given: dict[str, Any] = dict(parse_qsl(url.query, keep_blank_values=True))
    given.update(options)
    unknown = sorted(set(given) - set(_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"unknown sqlite option(s) {unknown}; known: {', '.join(sorted(_OPTIONS))}"
        )
    parsed = dict(_OPTIONS)
    for key, value in given.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigurationError(f"sqlite option {key}={value!r} is not a number") from None
        if not 0 < number < float("inf"):
            raise ConfigurationError(f"sqlite option {key} must be positive, got {value!r}")
        parsed[key] = number
    return parsed


def _is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _SQLITE_BUSY
    return "locked" in str(exc)


@dataclasses.dataclass(frozen=True, slots=True)
class _Attempt:
    """The outcome of one acquire transaction."""

    grant: Grant | None = None
    fresh: bool = False  # this transaction created the grant (not an idempotent repeat)
    timed_out: bool = False
    holder_expires: float | None = None  # while queued: when the live holder's lease runs out


class _LocalWaiter:
    """A blocked acquire in this process, woken by releases made in this process."""

    __slots__ = ("event", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.event = asyncio.Event()


_local_mutex = threading.Lock()
_local_waiters: dict[tuple[str, str], set[_LocalWaiter]] = {}


def _register(key: tuple[str, str], waiter: _LocalWaiter) -> None:
    with _local_mutex:
        _local_waiters.setdefault(key, set()).add(waiter)


def _unregister(key: tuple[str, str], waiter: _LocalWaiter) -> None:
    with _local_mutex:
        waiters = _local_waiters.get(key)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del _local_waiters[key]


def _notify(key: tuple[str, str]) -> None:
    """Wake every blocked acquire of this lock in this process (from any thread)."""
    with _local_mutex:
        waiters = list(_local_waiters.get(key, ()))
    for waiter in waiters:
        with contextlib.suppress(RuntimeError):  # its loop is closed: it is gone
            waiter.loop.call_soon_threadsafe(waiter.event.set)


class SQLiteBackend(Backend):
    """Locks in one SQLite file, shared by every process on this machine (see module doc)."""

    scheme: ClassVar[str] = "sqlite"
    characteristics: ClassVar[frozenset[Characteristic]] = frozenset(
        {
            Characteristic.DURABLE,
            Characteristic.FIFO,
            Characteristic.SERVER_EXPIRY,
            Characteristic.LINEARIZABLE,
        }
    )

    poll_min: ClassVar[float] = POLL_MIN
    """The first pause between two polls of a waiter, after anything changed."""

    def __init__(self, path: str, options: dict[str, float]) -> None:
        self.path = path
        self._waiter_ttl = options["waiter_ttl"]
        self._poll_interval = options["poll_interval"]
        self._busy_timeout = options["busy_timeout"]
        self._boot = _clock.boot_id()
        self._conns: dict[int, sqlite3.Connection] = {}  # one connection per thread
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> SQLiteBackend:
        backend = cls(database_path(url), _parse_options(url, options))
        try:
            os.makedirs(os.path.dirname(backend.path), exist_ok=True)
        except OSError as exc:
            raise BackendUnavailable(f"cannot create the directory of {backend.path}") from exc
        try:
            await backend._transact(backend._tx_setup, limit=_clock.now() + backend._busy_timeout)
        except BaseException:
            await backend.aclose()
            raise
        return backend

    # -- running transactions ----------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, timeout=BUSY_WAIT, isolation_level=None, cached_statements=64
        )
        try:
            for pragma in PRAGMAS:
                conn.execute(pragma).fetchall()
            mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
            if str(mode).lower() != "wal":
                raise UnsafeBackendError(f"{self.path}: could not enable WAL (journal_mode={mode})")
        except BaseException:
            conn.close()
            raise
        return conn

    def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` on this thread's connection (in the thread that owns it)."""
        if self._closed:
            raise BackendUnavailable(f"sqlite connection to {self.path} is closed")
        ident = threading.get_ident()
        conn = self._conns.get(ident)
        if conn is None:
            conn = self._conns[ident] = self._connect()
        try:
            return fn(conn)
        except BaseException as exc:
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.Error) and not _is_busy(exc):
                # The connection may be broken (I/O error, file replaced): start afresh.
                self._conns.pop(ident, None)
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
            raise

    async def _run(
        self,
        fn: Callable[[sqlite3.Connection], T],
        orphan: Callable[[T], None] | None = None,
    ) -> T:
        """Run one short transaction: inline on fenced's private loop, else on the worker.

        ``orphan`` receives the result of a transaction that completed after its caller was
        cancelled (the worker cannot be interrupted mid-transaction).
        """
        if on_private_loop():
            return self._call(fn)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="fenced-sqlite"
            )
        try:
            future = self._executor.submit(self._call, fn)
        except RuntimeError as exc:  # executor shut down
            raise BackendUnavailable(f"sqlite connection to {self.path} is closed") from exc
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if orphan is not None:
                future.add_done_callback(lambda f: _pass_result(f, orphan))
            raise

    async def _transact(
        self,
        fn: Callable[[sqlite3.Connection], T],
        *,
        limit: float | None,
        busy: Callable[[], FencedError] | None = None,
        orphan: Callable[[T], None] | None = None,
    ) -> T:
        """Run a transaction, retrying while the database is write-locked until ``limit``."""
        while True:
            self._check_open()
            try:
                return await self._run(fn, orphan)
            except sqlite3.Error as exc:
                if not _is_busy(exc):
                    raise BackendUnavailable(f"sqlite {self.path}: {exc}") from exc
                if limit is not None and _clock.now() >= limit:
                    if busy is not None:
                        raise busy() from exc
                    raise BackendUnavailable(
                        f"sqlite {self.path}: the database stayed write-locked ({exc})"
                    ) from exc
            await asyncio.sleep(0)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendUnavailable(f"sqlite connection to {self.path} is closed")

    def _forget(self, name: str, request_id: str) -> None:
        """Best effort, never waiting: take an abandoned waiter's row out of the queue."""
        key = (self.path, name)

        def dequeue(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(SQL_DEQUEUE, (name, request_id))
            conn.execute("COMMIT")
            _notify(key)

        def quietly() -> None:
            try:
                self._call(dequeue)
            except (sqlite3.Error, FencedError) as exc:  # it expires by itself
                logger.debug("could not dequeue %s from %s: %r", request_id, name, exc)

        if self._closed:
            return
        try:
            if on_private_loop() or self._executor is None:
                quietly()
            else:
                self._executor.submit(quietly)
        except RuntimeError:  # no running loop or executor shut down
            pass

    # -- transactions (each runs in the thread that owns ``conn``) ------------------------------

    def _tx_setup(self, conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise ConfigurationError(
                f"{self.path} was created by a newer fenced (schema {version} > {SCHEMA_VERSION})"
            )
        for statement in SCHEMA:
            conn.execute(statement)
        if version < SCHEMA_VERSION:
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")

    def _next_token(self, conn: sqlite3.Connection, name: str) -> int:
        """Bump and return the lock's persistent counter (inside the granting transaction)."""
        value: int = conn.execute(SQL_NEXT_TOKEN, (name,)).fetchone()[0]
        return value

    def _tx_acquire(
        self, conn: sqlite3.Connection, name: str, request_id: str, ttl: float, final: bool
    ) -> _Attempt:
        sent_at = _clock.now()  # before the transaction: the lease cannot start earlier
        conn.execute("BEGIN IMMEDIATE")
        now = _clock.now()
        boot = self._boot
        holder, token, held_ttl, expires, row_boot, head = conn.execute(
            SQL_LOCK_STATE, (name, boot, now)
        ).fetchone()
        live = holder is not None and row_boot == boot and expires > now
        if live and holder == request_id:  # a retry of a request that was granted
            conn.execute(SQL_DEQUEUE, (name, request_id))
            conn.execute("COMMIT")
            grant = Grant(FencingToken(name, token), request_id, held_ttl, expires - held_ttl)
            return _Attempt(grant=grant)
        if not live and (head is None or head == request_id):
            value = self._next_token(conn, name)
            conn.execute(SQL_SET_HOLDER, (name, request_id, value, ttl, sent_at + ttl, boot))
            if head is not None:  # it was us, at the head of the queue
                conn.execute(SQL_DEQUEUE, (name, request_id))
            conn.execute("COMMIT")
            grant = Grant(FencingToken(name, value), request_id, ttl, sent_at)
            return _Attempt(grant=grant, fresh=True)
        if final:
            conn.execute(SQL_DEQUEUE, (name, request_id))
            conn.execute("COMMIT")
            return _Attempt(timed_out=True)
        # Join the queue, or stamp our place in it; clear out waiters that died meanwhile.
        conn.execute(SQL_PURGE_WAITERS, (name, boot, now))
        conn.execute(SQL_ENQUEUE, (name, request_id, now + self._waiter_ttl, boot))
        conn.execute("COMMIT")
        return _Attempt(holder_expires=expires if live else None)

    def _tx_poll(
        self, conn: sqlite3.Connection, name: str, request_id: str
    ) -> tuple[bool, float | None, tuple[Any, ...]]:
        """A read (no write lock, no fsync): is it our turn, and when does the holder expire."""
        now = _clock.now()
        boot = self._boot
        row = conn.execute(SQL_LOCK_STATE, (name, boot, now)).fetchone()
        holder, _, _, expires, row_boot, head = row
        live = holder is not None and row_boot == boot and expires > now
        my_turn = not live and (head is None or head == request_id)
        return my_turn, (expires if live else None), row

    def _tx_renew(self, conn: sqlite3.Connection, grant: Grant) -> float | None:
        sent_at = _clock.now()
        conn.execute("BEGIN IMMEDIATE")
        now = _clock.now()
        token = grant.token
        cur = conn.execute(
            SQL_RENEW,
            (sent_at + grant.ttl, token.lock, token.value, grant.request_id, self._boot, now),
        )
        renewed = cur.rowcount == 1
        conn.execute("COMMIT")
        return sent_at if renewed else None

    def _tx_release(self, conn: sqlite3.Connection, grant: Grant) -> bool:
        conn.execute("BEGIN IMMEDIATE")
        now = _clock.now()
        token = grant.token
        rows = conn.execute(SQL_RELEASE, (token.lock, token.value, grant.request_id)).fetchall()
        conn.execute("COMMIT")
        return any(boot == self._boot and expires > now for expires, boot in rows)

    def _tx_status(self, conn: sqlite3.Connection, name: str) -> LockStatus:
        now = _clock.now()
        last, holder, token, expires, row_boot, waiters = conn.execute(
            SQL_STATUS, (name, self._boot, now)
        ).fetchone()
        live = holder is not None and row_boot == self._boot and expires > now
        return LockStatus(
            name=name,
            holder=holder if live else None,
            token=FencingToken(name, token) if live else None,
            last_token=FencingToken(name, last) if last else None,
            remaining=max(0.0, expires - now) if live else None,
            waiters=waiters,
        )

    # -- the Backend API -------------------------------------------------------------------------

    async def acquire(
        self,
        name: str,
        *,
        request_id: str,
        ttl: float,
        deadline: float | None,
        on_lost: LostCallback,
    ) -> Grant:
        self._check_open()
        key = (self.path, name)
        waiter: _LocalWaiter | None = None
        queued = False

        def timeout() -> FencedError:
            return LockTimeout(f"lock {name!r} not acquired before the timeout")

        def orphan(attempt: _Attempt) -> None:
            # Granted after the caller was cancelled: nobody will use it, so free it now.
            if attempt.fresh and attempt.grant is not None:
                grant = attempt.grant
                with contextlib.suppress(sqlite3.Error, FencedError):
                    self._call(lambda conn: self._tx_release(conn, grant))
                _notify(key)

        try:
            while True:
                final = deadline is not None and _clock.now() >= deadline
                attempt = await self._transact(
                    functools.partial(
                        self._tx_acquire, name=name, request_id=request_id, ttl=ttl, final=final
                    ),
                    limit=deadline,
                    busy=timeout,
                    orphan=orphan,
                )
                if attempt.grant is not None or attempt.timed_out:
                    queued = False
                    if attempt.grant is not None:
                        return attempt.grant
                    raise timeout()
                queued = True
                if waiter is None:
                    waiter = _LocalWaiter(asyncio.get_running_loop())
                    _register(key, waiter)
                await self._await_turn(name, request_id, waiter, deadline, attempt.holder_expires)
        finally:
            if waiter is not None:
                _unregister(key, waiter)
            if queued:
                self._forget(name, request_id)

    async def _await_turn(
        self,
        name: str,
        request_id: str,
        waiter: _LocalWaiter,
        deadline: float | None,
        holder_expires: float | None,
    ) -> None:
        """Wait (polling with reads) until the lock looks ours, a heartbeat or the deadline is due."""
        heartbeat_at = _clock.now() + self._waiter_ttl / 3
        fastest = min(self.poll_min, self._poll_interval)
        interval = fastest
        seen: tuple[Any, ...] | None = None
        while True:
            waiter.event.clear()  # before the read: a release after it still wakes us
            now = _clock.now()
            if now >= heartbeat_at or (deadline is not None and now >= deadline):
                return
            my_turn, holder_expires, state = await self._transact(
                lambda conn: self._tx_poll(conn, name, request_id),
                limit=now + self._busy_timeout,
            )
            if my_turn:
                return
            if state != seen:  # something moved: things may move again soon
                seen, interval = state, fastest
            else:
                interval = min(interval * 2, self._poll_interval)
            wake = min(now + interval, heartbeat_at)
            if deadline is not None:
                wake = min(wake, deadline)
            if holder_expires is not None:
                wake = min(wake, holder_expires)
            delay = wake - _clock.now()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await waiter.event.wait()
            self._check_open()

    async def renew(self, grant: Grant) -> Grant:
        self._check_open()
        sent_at = await self._transact(
            lambda conn: self._tx_renew(conn, grant), limit=_clock.now() + self._busy_timeout
        )
        if sent_at is None:
            raise LeaseLostError(f"lease {grant.token} is no longer held (expired or taken over)")
        return dataclasses.replace(grant, sent_at=sent_at)

    async def release(self, grant: Grant) -> bool:
        self._check_open()
        released = await self._transact(
            lambda conn: self._tx_release(conn, grant), limit=_clock.now() + self._busy_timeout
        )
        _notify((self.path, grant.token.lock))
        return released

    async def status(self, name: str) -> LockStatus:
        self._check_open()
        return await self._transact(
            lambda conn: self._tx_status(conn, name), limit=_clock.now() + self._busy_timeout
        )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with _local_mutex:  # wake our blocked acquires so they see the connection closed
            keys = [key for key in _local_waiters if key[0] == self.path]
        for key in keys:
            _notify(key)
        executor, self._executor = self._executor, None
        if executor is not None:
            closing = executor.submit(self._close_thread_connection)
            executor.shutdown(wait=False)
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(closing)
        self._close_thread_connection()
        # Connections of other threads (none in normal use) are closed by the garbage collector.

    def _close_thread_connection(self) -> None:
        conn = self._conns.pop(threading.get_ident(), None)
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()


def _pass_result(future: concurrent.futures.Future[T], handler: Callable[[T], None]) -> None:
    if not future.cancelled() and future.exception() is None:
        try:
            handler(future.result())
        except Exception:
            logger.exception("cleaning up after a cancelled sqlite transaction failed")
