"""``sqlite:////path/locks.db``: the embedded token source, for processes on one machine.

One SQLite file holds three tables:

* ``fenced_counters``: one row per lock with the highest token ever granted. The row is never
  deleted and the value only grows (two triggers refuse anything else), whether the lock is
  held, idle, or its holder and waiter rows have been cleaned up.
* ``fenced_holders``: the current grant of each lock (request id, token, ttl, expiry).
* ``fenced_waiters``: the FIFO queue of blocked callers, ordered by an ``AUTOINCREMENT``
  sequence; each waiter re-stamps (heartbeats) its row while it waits, so the row of a waiter
  that crashed expires and is skipped.

**Durability.** The journal is WAL with ``synchronous=FULL``: every commit that writes a
counter or a holder fsyncs the WAL before it returns, so an acknowledged grant, and with it
the counter value, survives ``kill -9`` at any point and a power loss. A transaction
interrupted by a crash is rolled back when the file is next opened.

**Concurrency.** Every change is one ``BEGIN IMMEDIATE`` transaction, so SQLite serialises
the writers of all processes (LINEARIZABLE on one machine). ``SQLITE_BUSY`` is retried until
the caller's deadline (then :class:`~fenced.LockTimeout` when acquiring; an acquire's look —
a try-once's only one — retries at least 0.25 s, so that a free lock is not refused because
another process was committing) or the ``busy_timeout`` option (then
:class:`~fenced.BackendUnavailable`).

**Expiry** is judged against :func:`fenced._core.clock.now` (``CLOCK_BOOTTIME``, one clock for the
whole machine) and every row carries the boot id it was written under: a row of another boot
is expired, since every process that held it died with the reboot. A renewal succeeds only
while the same token still holds the lock *and* its lease has not run out.

**Cost.** An uncontended acquire is one transaction (read the holder and the head of the
queue, bump the counter, write the holder), a release one (fenced ``DELETE`` on token and
request id): one fsync each. Queue rows need no durability (if a crash loses one, its waiter
died with it), so a caller that has to wait joins the queue in a transaction committed with
``synchronous=NORMAL`` (no fsync); a transaction that grants is always FULL. On fenced's
private loop (the synchronous API) transactions run inline, since nothing else runs there; on
an application's event loop they run on one worker thread per backend, with **group commit**:
the acquires, renewals and releases that queued up while the last commit ran share the next
transaction and its one fsync, and hear their outcome only after it, all in one hand-over to
the loop. ``fenced serve``'s loop (marked ``commit_per_turn``) has no worker: the writes of
a turn of the loop, and of up to two more turns while they keep coming, are committed
together on the loop itself, so no batch waits for the GIL. Running transactions (the
connections, ``BEGIN IMMEDIATE``, ``SQLITE_BUSY`` retries, group commit) is the job of
:mod:`fenced.backends._sqlite_executor`, which knows nothing of locks; this module keeps the
lock protocol: the transactions themselves.

**Waking waiters.** A release wakes the blocked callers of that lock in the same process at
once (an asyncio event per waiter, process-wide per database file), and rings the head of the
queue if it is in another process: each waiting process has a datagram socket in Linux's
abstract namespace, whose address its queue row carries. Rings are hints; waiters also poll the
file with reads (no write, no fsync), backing off from 1 ms to ``poll_interval`` (default
10 ms), and wake at the holder's expiry. Where rings are unavailable (another OS, another
network namespace), polls stay at 1-2 ms for the head of the queue after any change.
(Measured figures: docs/benchmarks.md, "The embedded SQLite source".)

Not DISTRIBUTED: clocks, boot ids and file locks are per machine. Never put the file on a
network filesystem. Processes in different time namespaces (containers with their own
``CLOCK_BOOTTIME`` offset) must not share a file either.

URL forms, as SQLAlchemy's: ``sqlite:////abs/path.db`` names an absolute path,
``sqlite:///./path.db`` a path relative to the working directory at connect time (made
absolute then). ``sqlite:///path.db`` is refused as ambiguous (SQLAlchemy: relative; fenced
0.1: absolute), and so is a host part (``sqlite://rel/path.db``). The directory must exist:
fenced creates none. Options (URL query or keyword): ``waiter_ttl`` (seconds a waiter's
queue row outlives its last heartbeat, default 2), ``poll_interval`` (longest pause between two
polls of a cross-process waiter, default 0.01), ``busy_timeout`` (how long renew, release and
status retry a write-locked database before BackendUnavailable, default 5), ``group_commit``
(``turn``, the default: on a loop marked ``commit_per_turn`` — ``fenced serve``'s — a commit
per turn of the loop; ``worker``: the worker thread's group commit there too, as on an
application's loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import sqlite3
import urllib.parse
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any, ClassVar, Final, TypeVar
from urllib.parse import SplitResult

from .._clients.sqlite_errors import unusable
from .._core import clock as _clock
from .._core.backend import (
    Backend,
    Characteristic,
    Grant,
    LockStatus,
    LostCallback,
    Record,
    lock_timeout,
)
from .._core.errors import (
    BackendUnavailable,
    ConfigurationError,
    FencedError,
    LeaseLostError,
    RecordConflict,
    UnsafeBackendError,
)
from .._core.options import Option
from .._core.token import FencingToken
from ._sqlite_executor import BUSY_WAIT as BUSY_WAIT  # (the benchmark's peer uses it)
from ._sqlite_executor import TransactionExecutor, retry_limit
from ._sqlite_schema import (
    PRAGMAS,
    SCHEMA,
    SCHEMA_VERSION,
    SQL_ADD_OWNER,
    SQL_DEQUEUE,
    SQL_ENQUEUE,
    SQL_HAS_OWNER,
    SQL_HEAD_WAKE,
    SQL_LOCK_STATE,
    SQL_NEXT_TOKEN,
    SQL_PURGE_WAITERS,
    SQL_RECORD_INSERT,
    SQL_RECORD_READ,
    SQL_RECORD_UPDATE,
    SQL_RECORDS,
    SQL_RELEASE,
    SQL_RENEW,
    SQL_SET_HOLDER,
    SQL_STATUS,
)
from ._sqlite_wake import (
    LocalWaiter,
    local_mutex,
    local_waiters,
    my_wake_address,
    notify,
    register,
    ring,
    unregister,
)

__all__ = ["SQLiteBackend", "database_path"]

logger = logging.getLogger("fenced.sqlite")

T = TypeVar("T")

LOOK_GRACE: Final = 0.25
"""Seconds an acquire's look retries a write-locked database at least, even past its deadline
(a try-once's only look): the bound by which a timeout may be overrun, as opening a source."""

POLL_MIN: Final = 0.001
_GROUP_COMMITS: Final = ("turn", "worker")
_OPTIONS: Final = MappingProxyType(
    {
        "waiter_ttl": Option("number", 2.0, low=0, low_open=True, high=3600),
        "poll_interval": Option("number", 0.01, low=0, low_open=True, high=60),
        "busy_timeout": Option("number", 5.0, low=0, low_open=True, high=3600),
        "group_commit": Option(
            "str", "turn", check=lambda v: None if v in _GROUP_COMMITS else "must be turn or worker"
        ),
    }
)


def database_path(url: SplitResult) -> str:
    """The absolute file path named by a ``sqlite://`` URL (see the module docstring).

    SQLAlchemy's forms, minus the ambiguous one: ``sqlite:////abs/path.db`` is absolute and
    ``sqlite:///./rel/path.db`` relative; ``sqlite:///path.db`` is refused, because
    SQLAlchemy reads it as relative and fenced 0.1 read it as absolute, and guessing wrong
    gives two processes two different files, each with its own locks.
    """
    given = f"{url.scheme}://{url.netloc}{url.path}"
    if url.netloc:
        raise ConfigurationError(
            f"sqlite URL {given!r} has a host part; write sqlite:////abs/path.db (absolute) "
            "or sqlite:///./rel/path.db (relative to the working directory)"
        )
    path = url.path
    if ":memory:" in path or url.query.startswith("mode=memory"):
        raise ConfigurationError("an in-memory SQLite database cannot be a token source")
    if path.startswith("//"):  # sqlite:////abs/path.db
        path = "/" + path.lstrip("/")
    elif path.startswith(("/./", "/../")):  # sqlite:///./path.db
        path = path[1:]
    elif path not in ("", "/"):
        rest = path[1:]
        raise ConfigurationError(
            f"sqlite URL {given!r} is ambiguous: SQLAlchemy reads it as the relative path "
            f"{rest!r}, fenced 0.1 read it as /{rest}; write sqlite:////{rest} for the "
            f"absolute path, or sqlite:///./{rest} for a path relative to the working directory"
        )
    if not path or path in ("/", ".", "./") or path.endswith("/"):
        raise ConfigurationError(f"sqlite URL names no file: {given!r}")
    return os.path.realpath(path)  # one name per file: the key of in-process wake-ups


@contextlib.contextmanager
def _relaxed(conn: sqlite3.Connection) -> Iterator[None]:
    """Commit without fsync (synchronous=NORMAL), for queue rows only.

    A waiter's row needs no durability: if a crash loses it, its owner died with it. Counters
    and holders are never written under this. The next FULL commit's fsync of the WAL also
    covers these frames, which precede it in the file. The level cannot change inside a
    transaction, so one left open is rolled back first; if FULL cannot be restored, the
    connection is closed, and the error (never a "busy" one) makes the caller discard it.
    """
    conn.execute("PRAGMA synchronous=NORMAL")
    try:
        yield
    finally:
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            conn.execute("PRAGMA synchronous=FULL")
        except sqlite3.Error as exc:
            # Never let this connection commit a grant without fsync: it must not be reused.
            conn.close()
            raise sqlite3.OperationalError("could not restore synchronous=FULL") from exc


@dataclasses.dataclass(frozen=True, slots=True)
class _Attempt:
    """The outcome of one acquire transaction."""

    grant: Grant | None = None
    fresh: bool = False  # this transaction created the grant (not an idempotent repeat)
    queued: bool = False  # not granted, and our row is (now) in the queue
    retry: bool = False  # queued without fsync but found the lock free: come back for it
    holder_expires: float | None = None  # not granted: when the live holder's lease runs out


@dataclasses.dataclass(frozen=True, slots=True)
class _Poll:
    """What a waiter's read of the lock found."""

    my_turn: bool  # the lock is free and we are first in line (or the line is empty)
    next_in_line: bool  # our row heads the queue
    holder_expires: float | None  # when the live holder's lease runs out, if held
    state: tuple[Any, ...]  # the raw row, to notice any change


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

    option_schema = _OPTIONS
    executor_class: ClassVar[type[TransactionExecutor]] = TransactionExecutor
    """Runs the transactions (tests plant a faulty one here)."""
    # One connection for the loop, whichever thread runs it (see TransactionExecutor.call).
    caller_driven = True
    poll_min: ClassVar[float] = POLL_MIN
    """The first pause between two polls of a waiter, after anything changed."""

    def __init__(self, path: str, options: dict[str, Any]) -> None:
        self.path = path
        self._waiter_ttl = options["waiter_ttl"]
        self._poll_interval = options["poll_interval"]
        self._busy_timeout = options["busy_timeout"]
        # (a commit per turn where the loop allows it, or the worker thread's group commit)
        turn_commits = options.get("group_commit", "turn") == "turn"
        self._boot = _clock.boot_id()
        self._contended: set[str] = set()  # locks that had waiters when we last looked
        self._in_queue: set[tuple[str, str]] = set()  # (lock, request id) rows we may have queued
        # A file this user may read but not write (a monitoring user): status only.
        self.read_only = os.path.exists(path) and not os.access(path, os.W_OK)
        self._sql_status = SQL_STATUS.format(owner="h.owner")
        # Runs the transactions below (connections, busy retries, group commit): see its module.
        self._executor = self.executor_class(path, self._connect, turn_commits=turn_commits)

    @property
    def commits(self) -> int:
        """Commits made (one fsync each), for the server's metrics."""
        return self._executor.commits

    @property
    def batches(self) -> int:
        """Commits that carried more than one transaction (group commit)."""
        return self._executor.batches

    @property
    def batched(self) -> int:
        """The transactions those commits carried."""
        return self._executor.batched

    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> SQLiteBackend:
        backend = cls(database_path(url), cls.options(url, options))
        directory = os.path.dirname(backend.path)
        if not os.path.isdir(directory):  # never made unasked (as root: anywhere at all)
            raise ConfigurationError(
                f"directory {directory} (of {backend.path}) does not exist; fenced creates "
                "no directories: create it, with the permissions its users need"
            )
        try:
            try:
                await backend._executor.run(
                    backend._tx_setup, limit=_clock.now() + backend._busy_timeout
                )
            except BackendUnavailable as exc:
                # connect() retries BackendUnavailable until connect_timeout: an error no
                # retry can mend (not a database, a directory, no permission) is raised now.
                reason = unusable(backend.path, exc.__cause__, read_only=backend.read_only)
                if reason is None:
                    raise
                raise ConfigurationError(reason) from exc.__cause__
        except BaseException:
            await backend.aclose()
            raise
        return backend

    # -- running transactions ----------------------------------------------------------------

    def _connect(self, shared: bool = False) -> sqlite3.Connection:
        if self.read_only:
            return self._connect_read_only(shared)
        conn = sqlite3.connect(
            self.path,
            timeout=0,
            isolation_level=None,
            cached_statements=64,
            check_same_thread=not shared,
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

    def _connect_read_only(self, shared: bool) -> sqlite3.Connection:
        """For a user who may only read the file. SQLite reads a WAL database read-only
        through its ``-shm`` file, which exists while a writer has the database open; with
        none open (no ``-wal`` file either), the file alone is complete, and is opened as
        immutable (no locks, no ``-shm``)."""
        uri = f"file:{urllib.parse.quote(self.path)}?mode=ro"
        for extra in ("", "&immutable=1"):
            if extra and os.path.exists(self.path + "-wal"):
                break  # a writer is at work: its WAL must be read, so immutable would lie
            conn = sqlite3.connect(
                uri + extra,
                uri=True,
                timeout=0,
                isolation_level=None,
                check_same_thread=not shared,
            )
            try:
                conn.execute("PRAGMA user_version").fetchone()
            except sqlite3.OperationalError:
                conn.close()
                continue
            return conn
        raise sqlite3.OperationalError(f"{self.path} is not readable by this user right now")

    def _check_writable(self) -> None:
        if self.read_only:
            raise ConfigurationError(
                f"{self.path} is read-only for this user: it can show status, not take locks"
            )

    def _check_open(self) -> None:
        self._executor.check_open()

    def _forget(self, name: str, request_id: str) -> None:
        """Best effort, never waiting: take an abandoned waiter's row out of the queue (if
        this fails, the row expires by itself)."""
        self._in_queue.discard((name, request_id))
        self._executor.run_detached(
            functools.partial(self._tx_dequeue, name=name, request_id=request_id),
            f"dequeue {request_id} from {name}",
        )

    # -- transactions (each runs in the thread that owns ``conn``) ------------------------------

    def _tx_setup(self, conn: sqlite3.Connection) -> None:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION and (
            self.read_only or conn.execute(SQL_HAS_OWNER).fetchone()[0]
        ):
            self._set_owner_column(conn)
            return  # ready: no need for the write lock (another process may hold it)
        if self.read_only:
            raise ConfigurationError(
                f"{self.path} is read-only for this user and holds no fenced schema "
                f"(version {conn.execute('PRAGMA user_version').fetchone()[0]})"
            )
        conn.execute("BEGIN IMMEDIATE")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise ConfigurationError(
                f"{self.path} was created by a newer fenced (schema {version} > {SCHEMA_VERSION})"
            )
        for statement in SCHEMA:
            conn.execute(statement)
        if not conn.execute(SQL_HAS_OWNER).fetchone()[0]:
            conn.execute(SQL_ADD_OWNER)
        if version < SCHEMA_VERSION:
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
        self._set_owner_column(conn)

    def _set_owner_column(self, conn: sqlite3.Connection) -> None:
        # (a read-only user may look at a fenced 0.1 file, which has no owner column)
        has = conn.execute(SQL_HAS_OWNER).fetchone()[0]
        self._sql_status = SQL_STATUS.format(owner="h.owner" if has else "NULL")

    def _next_token(self, conn: sqlite3.Connection, name: str) -> int:
        """Bump and return the lock's persistent counter (inside the granting transaction)."""
        value: int = conn.execute(SQL_NEXT_TOKEN, (name,)).fetchone()[0]
        return value

    def _tx_acquire(
        self,
        conn: sqlite3.Connection,
        name: str,
        request_id: str,
        ttl: float,
        mode: str,
        owner: str = "",
    ) -> _Attempt:
        """One acquire attempt; joining (or re-stamping our place in) the queue atomically.

        ``mode`` "grant": grant if the lock is free and we are first in line, else queue.
        "queue" (when the lock is expected to be taken): never grant, only queue, committed
        without fsync (queue rows need no durability); if the lock turns out to be free the
        caller comes straight back with "grant". "last" (the deadline has passed): grant or
        change nothing. A transaction that writes nothing commits without an fsync.
        """
        if mode == "queue":  # (without fsync; a context manager only here: not on a grant)
            with _relaxed(conn):
                return self._attempt(conn, name, request_id, ttl, mode, owner)
        return self._attempt(conn, name, request_id, ttl, mode, owner)

    def _attempt(
        self,
        conn: sqlite3.Connection,
        name: str,
        request_id: str,
        ttl: float,
        mode: str,
        owner: str,
    ) -> _Attempt:
        relaxed = mode == "queue"
        sent_at = _clock.now()  # before the transaction: the lease cannot start earlier
        conn.execute("BEGIN IMMEDIATE")
        now = _clock.now()
        boot = self._boot
        holder, token, held_ttl, expires, row_boot, head = conn.execute(
            SQL_LOCK_STATE, (name, boot, now)
        ).fetchone()
        live = holder is not None and row_boot == boot and expires > now
        if live and holder == request_id:  # a retry of a request that was granted
            conn.execute(SQL_DEQUEUE, (name, request_id))  # writes only if it was queued
            conn.execute("COMMIT")
            grant = Grant(FencingToken(name, token), request_id, held_ttl, expires - held_ttl)
            return _Attempt(grant=grant)
        free = not live and (head is None or head == request_id)
        if free and not relaxed:
            value = self._next_token(conn, name)
            conn.execute(
                SQL_SET_HOLDER,
                (name, request_id, value, ttl, sent_at + ttl, boot, owner or None),
            )
            if head is not None:  # it was us, at the head of the queue
                conn.execute(SQL_DEQUEUE, (name, request_id))
            conn.execute("COMMIT")
            grant = Grant(FencingToken(name, value), request_id, ttl, sent_at)
            return _Attempt(grant=grant, fresh=True)
        if mode == "last":
            conn.execute("COMMIT")  # nothing written: no fsync
            return _Attempt(holder_expires=expires if live else None)
        conn.execute(SQL_PURGE_WAITERS, (name, boot, now))  # waiters that died meanwhile
        wake = request_id.encode() + b"\0" + (my_wake_address() or b"")
        conn.execute(SQL_ENQUEUE, (name, request_id, now + self._waiter_ttl, boot, wake))
        conn.execute("COMMIT")
        return _Attempt(queued=True, retry=free, holder_expires=expires if live else None)

    def _tx_dequeue(self, conn: sqlite3.Connection, name: str, request_id: str) -> None:
        """Leave the queue, and ring whoever heads it now (the lock may be free for them)."""
        with _relaxed(conn):
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(SQL_DEQUEUE, (name, request_id))
            head = conn.execute(SQL_HEAD_WAKE, (name, self._boot, _clock.now())).fetchone()
            conn.execute("COMMIT")
        ring(head and head[0], self.path, name)

    def _tx_poll(self, conn: sqlite3.Connection, name: str, request_id: str) -> _Poll:
        """A read (no write lock, no fsync): is it our turn, are we next, who holds it."""
        now = _clock.now()
        boot = self._boot
        row = conn.execute(SQL_LOCK_STATE, (name, boot, now)).fetchone()
        holder, _, _, expires, row_boot, head = row
        live = holder is not None and row_boot == boot and expires > now
        return _Poll(
            my_turn=not live and (head is None or head == request_id),
            next_in_line=head == request_id,
            holder_expires=expires if live else None,
            state=row,
        )

    def _tx_renew(self, conn: sqlite3.Connection, grant: Grant) -> float | None:
        sent_at = _clock.now()
        conn.execute("BEGIN IMMEDIATE")
        now = _clock.now()
        token = grant.token
        cur = conn.execute(
            SQL_RENEW,
            (
                sent_at + grant.ttl,
                grant.ttl,  # (kept: what a renewal without a ttl renews for, on any gateway)
                token.lock,
                token.value,
                grant.request_id,
                self._boot,
                now,
            ),
        )
        renewed = cur.rowcount == 1
        conn.execute("COMMIT")
        return sent_at if renewed else None

    def _tx_release(self, conn: sqlite3.Connection, grant: Grant) -> bool:
        """Fenced release: delete the holder row only if token and request id match."""
        conn.execute("BEGIN IMMEDIATE")
        now = _clock.now()
        name = grant.token.lock
        boot = self._boot
        row = conn.execute(
            SQL_RELEASE, (name, grant.token.value, grant.request_id, boot, now)
        ).fetchone()
        conn.execute("COMMIT")
        if row is None:
            return False
        expires, row_boot, head = row
        if head is None:
            self._contended.discard(name)
        else:
            self._contended.add(name)
            self._executor.after_commit(conn, lambda: ring(head, self.path, name))
        return bool(row_boot == boot and expires > now)

    def _tx_status(self, conn: sqlite3.Connection, name: str) -> LockStatus:
        now = _clock.now()
        last, holder, token, expires, row_boot, waiters, owner, ttl = conn.execute(
            self._sql_status, (name, self._boot, now)
        ).fetchone()
        live = holder is not None and row_boot == self._boot and expires > now
        return LockStatus(
            name=name,
            holder=holder if live else None,
            token=FencingToken(name, token) if live else None,
            last_token=FencingToken(name, last) if last else None,
            remaining=max(0.0, expires - now) if live else None,
            waiters=waiters,
            owner=owner if live else None,
            ttl=ttl if live else None,
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
        owner: str = "",
    ) -> Grant:
        self._check_open()
        self._check_writable()
        key = (self.path, name)
        waiter: LocalWaiter | None = None
        queued = False

        def timeout() -> FencedError:
            return lock_timeout(name)

        def orphan(attempt: _Attempt) -> None:
            # Granted after the caller was cancelled: nobody will use it, so free it now.
            if attempt.fresh and attempt.grant is not None:
                grant = attempt.grant
                with contextlib.suppress(sqlite3.Error, FencedError):
                    self._executor.call(lambda conn: self._tx_release(conn, grant))

        # A caller that found this lock taken last time queues first, without an fsync.
        mode = "queue" if name in self._contended else "grant"
        try:
            while True:
                if deadline is not None and _clock.now() >= deadline:
                    mode = "last"
                elif not queued:
                    queued = True  # before: a cancelled attempt may still run on the worker
                    self._in_queue.add((name, request_id))
                attempt = await self._executor.run(
                    functools.partial(
                        self._tx_acquire,
                        name=name,
                        request_id=request_id,
                        ttl=ttl,
                        mode=mode,
                        owner=owner,
                    ),
                    # A look (a try-once's only one) waits out a write lock held elsewhere
                    # as renew and release do: given up at the deadline (a try-once's: at
                    # once, after BUSY_WAIT), a free lock was refused whenever another
                    # process's commit took that long.
                    limit=self._look_limit(deadline),
                    busy=timeout,
                    orphan=orphan,
                    batch=mode != "queue",  # (queueing commits without fsync: alone)
                )
                if attempt.grant is not None:
                    queued = False  # the granting transaction took us out of the queue
                    self._in_queue.discard((name, request_id))
                    return attempt.grant
                if attempt.retry:
                    mode = "grant"
                    continue
                if mode == "last":
                    raise timeout()  # the finally clause leaves the queue
                self._contended.add(name)
                if waiter is None:
                    waiter = LocalWaiter(asyncio.get_running_loop(), request_id)
                    register(key, waiter)
                mode = await self._await_turn(
                    name, request_id, waiter, deadline, attempt.holder_expires
                )
        finally:
            if waiter is not None:
                unregister(key, waiter)
            if queued:
                self._forget(name, request_id)

    def _look_limit(self, deadline: float | None) -> float | None:
        """Until when an acquire's attempt retries a write-locked database: its deadline, but
        at least :data:`LOOK_GRACE` (one real attempt, as opening a source gets), so that a
        try-once does not call a free lock held because another process was committing."""
        return retry_limit(deadline, min(LOOK_GRACE, float(self._busy_timeout)))

    async def _await_turn(
        self,
        name: str,
        request_id: str,
        waiter: LocalWaiter,
        deadline: float | None,
        holder_expires: float | None,
    ) -> str:
        """Wait until the lock looks ours ("grant"), a heartbeat is due ("queue": re-stamp our
        row) or the deadline has passed ("last"). Polls with reads; a release rings us."""
        heartbeat_at = _clock.now() + self._waiter_ttl / 3
        rung = my_wake_address() is not None
        fastest = min(self.poll_min, self._poll_interval)
        interval = fastest
        seen: tuple[Any, ...] | None = None
        while True:
            waiter.event.clear()  # before the read: a release after it still wakes us
            now = _clock.now()
            if deadline is not None and now >= deadline:
                return "last"
            if now >= heartbeat_at:
                return "queue"
            poll = await self._executor.run(
                lambda conn: self._tx_poll(conn, name, request_id),
                limit=now + self._busy_timeout,
            )
            if poll.my_turn:
                return "grant"
            holder_expires = poll.holder_expires
            if rung:  # releases ring us: polls only cover a lost ring, or a dead head's turn
                interval = max(fastest, min(interval * 2, self._poll_interval))
            elif poll.state != seen:  # something moved, and may soon move again: look soon
                seen, interval = poll.state, fastest
            else:  # next in line: keep looking often; behind others: back off further
                cap = self._poll_interval / 5 if poll.next_in_line else self._poll_interval
                interval = max(fastest, min(interval * 2, cap))
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
        sent_at = await self._executor.run(
            lambda conn: self._tx_renew(conn, grant),
            limit=_clock.now() + self._busy_timeout,
            batch=True,
        )
        if sent_at is None:
            raise LeaseLostError(f"lease {grant.token} is no longer held (expired or taken over)")
        return dataclasses.replace(grant, sent_at=sent_at)

    async def release(self, grant: Grant) -> bool:
        self._check_open()
        return await self._executor.run(
            lambda conn: self._tx_release(conn, grant),
            limit=_clock.now() + self._busy_timeout,
            batch=True,
        )

    async def lock_names(self) -> list[str]:
        self._check_open()

        def names(conn: sqlite3.Connection) -> list[str]:
            rows = conn.execute(
                "SELECT name FROM fenced_counters UNION SELECT name FROM fenced_waiters ORDER BY 1"
            ).fetchall()
            return [r[0] for r in rows]

        return await self._executor.run(names, limit=_clock.now() + self._busy_timeout)

    async def read_record(self, name: str) -> Record | None:
        self._check_open()

        def read(conn: sqlite3.Connection) -> Record | None:
            try:
                row = conn.execute(SQL_RECORD_READ, (name,)).fetchone()
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):
                    return None
                raise
            return None if row is None else Record(name, row[0], row[1])

        return await self._executor.run(read, limit=_clock.now() + self._busy_timeout)

    async def swap_record(self, name: str, version: int, value: str) -> Record:
        self._check_open()
        self._check_writable()

        def swap(conn: sqlite3.Connection) -> int:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute(SQL_RECORDS)
                if version == 0:
                    changed = conn.execute(SQL_RECORD_INSERT, (name, value)).rowcount
                else:
                    changed = conn.execute(SQL_RECORD_UPDATE, (name, version, value)).rowcount
                found = None
                if not changed:
                    row = conn.execute(SQL_RECORD_READ, (name,)).fetchone()
                    found = 0 if row is None else row[0]
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return version + 1 if found is None else -found - 1

        outcome = await self._executor.run(swap, limit=_clock.now() + self._busy_timeout)
        if outcome < 0:
            raise RecordConflict(name, version, -outcome - 1)
        return Record(name, outcome, value)

    async def status(self, name: str) -> LockStatus:
        self._check_open()
        return await self._executor.run(
            lambda conn: self._tx_status(conn, name), limit=_clock.now() + self._busy_timeout
        )

    async def aclose(self) -> None:
        if self._executor.closed:
            return
        # Waiters still queued leave the queue first: woken below, they would find the
        # connection closed and leave their rows to expire (Ctrl-C on `fenced lock`).
        for name, request_id in list(self._in_queue):
            self._forget(name, request_id)
        # (refuse new transactions first: the waiters woken below must find the source closed)
        self._executor.closed = True
        with local_mutex:  # wake our blocked acquires so they see the connection closed
            keys = [key for key in local_waiters if key[0] == self.path]
        for key in keys:
            notify(key)
        await self._executor.aclose()
