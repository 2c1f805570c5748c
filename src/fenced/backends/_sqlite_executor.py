"""Runs transactions on one SQLite file, with group commit: knows nothing of locks.

A transaction is a callable given a connection (``fn(conn) -> T``); it opens its own
``BEGIN IMMEDIATE`` and ends with ``COMMIT``, and must be safe to run again (it is, after
``SQLITE_BUSY``). :meth:`TransactionExecutor.run` answers only after the transaction's
commit returned, so with ``synchronous=FULL`` (the caller's ``connect`` sets it) nothing is
acknowledged before its fsync. Where it runs:

* on fenced's private loop (the synchronous API), inline: nothing else runs there;
* on a loop marked ``commit_per_turn`` (``fenced serve``'s), with ``turn_commits``: the
  transactions (``batch=True``) of a turn of the loop, and of up to ``_TURN_WAITS`` more
  turns while they keep coming, share one commit made on the loop itself (:meth:`_end_turn`);
* elsewhere, on one worker thread: transactions that queued up while the last commit ran
  share the next ``BEGIN IMMEDIATE`` and its one fsync (group commit, :meth:`_drain`), and hear
  their outcome only after it, all in one hand-over to their loop; one transaction's error
  undoes only its own part (savepoints). A transaction alone runs exactly as without batching.

Inside a batch, a transaction sees an :class:`InBatch` connection: its own ``BEGIN IMMEDIATE``
and ``COMMIT`` do nothing, and effects registered with :meth:`after_commit` wait for the
batch's commit.

``SQLITE_BUSY`` (another connection holds the write lock) is retried on the spot for
:data:`BUSY_WAIT` with the back-off :data:`_BUSY_SLEEPS` (SQLite's own busy handler sleeps
1, 2, 5, 10 ms ...: far longer than a short transaction holds the lock, so it is not used:
connections are made with ``timeout=0``), then by :meth:`run` until the caller's ``limit``.

Connections cannot cross ``fork()`` (SQLite: "do not open a database then fork"), nor can
the worker thread: an executor used in another process than the one that made it refuses
with :class:`~fenced.BackendUnavailable`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

from .._clients.sqlite_errors import is_busy
from .._core import clock as _clock
from .._core import fork as _fork
from .._core.backend import commits_per_turn, on_private_loop
from .._core.errors import BackendUnavailable, FencedError

__all__ = ["BUSY_WAIT", "InBatch", "Job", "TransactionExecutor", "retry_limit"]

logger = logging.getLogger("fenced.sqlite")

T = TypeVar("T")

BUSY_WAIT: Final = 0.05
"""Seconds one transaction is retried on the spot while another connection holds the write
lock, before the retry moves to asyncio (on the private loop these retries block its thread;
on a loop that commits per turn, ``fenced serve``'s, there are none: it retries on the loop)."""
_TURN_WAITS: Final = 2
"""Turns of a busy ``commit_per_turn`` loop a commit may wait for more writes (``_end_turn``)."""
_BUSY_SLEEPS: Final = (0.00005, 0.0001, 0.0002, 0.0004, 0.0008, 0.0015)
"""Back-off between those retries. SQLite's own busy handler sleeps 1, 2, 5, 10 ms ...: far
longer than a fenced transaction holds the lock (~0.2 ms), so it is not used (timeout=0)."""


def retry_limit(deadline: float | None, grace: float) -> float | None:
    """Until when a transaction retries a write-locked database (``limit`` of
    :meth:`TransactionExecutor.run`): ``deadline``, but at least ``grace`` from now, so that a
    caller whose deadline is now (a try-once) gets one real attempt and is not refused because
    another process was committing; no deadline: for ever."""
    if deadline is None:
        return None
    return max(deadline, _clock.now() + grace)


class InBatch:
    """A transaction's view of the connection inside a group commit: its own BEGIN and COMMIT
    do nothing (its savepoint and the batch's commit stand in for them), and effects meant
    for after its commit wait for the batch's."""

    __slots__ = ("after", "conn")
    in_transaction = True

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.after: list[Callable[[], None]] = []

    def execute(self, sql: str, params: Any = ()) -> Any:
        if sql in ("BEGIN IMMEDIATE", "COMMIT"):
            return None
        return self.conn.execute(sql, params)


class Job:
    """A transaction waiting for a group commit: its waiter lives on its caller's loop."""

    __slots__ = ("fn", "loop", "orphan", "outcome", "waiter")

    def __init__(
        self, fn: Callable[[Any], Any], waiter: asyncio.Future[Any], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.fn = fn
        self.waiter = waiter
        self.loop = loop
        self.orphan: Callable[[Any], None] | None = None  # set if its caller gave up
        self.outcome: tuple[bool, Any] | None = None  # set once committed (or failed)


class TransactionExecutor:
    """Transactions on the file ``path``, on connections made by ``connect(shared)`` (see the
    module doc). ``shared``: the connection is used by whichever thread runs the private loop.
    ``turn_commits``: on a loop marked ``commit_per_turn``, commit per turn on the loop (else
    the worker thread's group commit, as on an application's loop)."""

    def __init__(
        self,
        path: str,
        connect: Callable[[bool], sqlite3.Connection],
        *,
        turn_commits: bool = True,
    ) -> None:
        self.path = path
        self._connect = connect
        self._turn_commits = turn_commits
        # (connections and the worker thread stay in this process: see _check_process)
        self._fork_gen, self._pid = _fork.generation(), os.getpid()
        # One connection per worker thread, and one (key 0) for fenced's private loop, used by
        # whichever thread runs the loop: the loop's lock lets one at a time in.
        self._conns: dict[int, sqlite3.Connection] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._private_loop: asyncio.AbstractEventLoop | None = None
        self._per_turn = False  # the private loop asked for a group commit per turn
        self._turn: list[Job] = []  # what that loop's turn has gathered so far
        self._turn_seen = self._turn_waits = 0  # (see _end_turn)
        self._public_loop: asyncio.AbstractEventLoop | None = None  # the last other loop seen
        self.closed = False
        # Group commit (see _drain): transactions waiting for the worker thread.
        self._batch_lock = threading.Lock()
        self._pending: list[Job] = []
        self._draining = False
        self.commits = 0  # group commits (worker or per turn), one fsync each (for metrics)
        self.batches = 0  # commits that carried more than one transaction
        self.batched = 0  # the transactions they carried

    # -- the interface ----------------------------------------------------------------------------

    async def run(
        self,
        fn: Callable[[sqlite3.Connection], T],
        *,
        limit: float | None,
        busy: Callable[[], FencedError] | None = None,
        orphan: Callable[[T], None] | None = None,
        batch: bool = False,
    ) -> T:
        """Run a transaction, retrying while the database is write-locked until ``limit``
        (then ``busy()``, or BackendUnavailable); any other SQLite error is BackendUnavailable.
        ``batch``: may share a group commit. ``orphan`` receives the result of a transaction
        that completed after its caller was cancelled (it cannot be stopped halfway)."""
        attempt = 0
        while True:
            self.check_open()
            try:
                # Inline on fenced's private loop (per turn where it asks for group commit),
                # else on the worker: with others (group commit, see _drain) or alone.
                if self._inline():
                    if batch and self._per_turn:
                        return await self._run_this_turn(fn, orphan)
                    return self.call(fn)
                if batch:
                    return await self._run_batched(fn, orphan)
                return await self._on_worker(fn, orphan)
            except sqlite3.Error as exc:
                if not is_busy(exc):
                    raise BackendUnavailable(f"sqlite {self.path}: {exc}") from exc
                if limit is not None and _clock.now() >= limit:
                    if busy is not None:
                        raise busy() from exc
                    raise BackendUnavailable(
                        f"sqlite {self.path}: the database stayed write-locked ({exc})"
                    ) from exc
            # On a loop that commits per turn the retry pauses here, not in call: the loop
            # serves other requests meanwhile. Elsewhere call has already waited BUSY_WAIT.
            per_turn = self._per_turn and asyncio.get_running_loop() is self._private_loop
            await asyncio.sleep(
                _BUSY_SLEEPS[min(attempt, len(_BUSY_SLEEPS) - 1)] if per_turn else 0
            )
            attempt += 1

    def call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` on this thread's connection, or the private loop's when on that loop."""
        if self.closed:
            raise BackendUnavailable(f"sqlite connection to {self.path} is closed")
        self._check_process()
        loop = asyncio._get_running_loop()
        ident = 0 if loop is not None and loop is self._private_loop else threading.get_ident()
        conn = self._conns.get(ident)
        if conn is None:
            conn = self._conns[ident] = self._connect(ident == 0)
        give_up: float | None = None
        attempt = 0
        while True:
            try:
                return fn(conn)
            except BaseException as exc:
                usable = is_busy(exc) if isinstance(exc, sqlite3.Error) else True
                if usable:
                    try:
                        if conn.in_transaction:
                            conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        usable = False
                if not usable:
                    # Broken (I/O error, file replaced, closed): the next call starts afresh.
                    self._conns.pop(ident, None)
                    with contextlib.suppress(sqlite3.Error):
                        conn.close()
                if not usable or not isinstance(exc, sqlite3.Error):
                    raise
                if ident == 0 and self._per_turn:
                    # (``fenced serve``'s loop: never asleep while another process commits;
                    # ``run`` retries after a pause on the loop, serving the rest)
                    raise
                now = _clock.now()
                if give_up is None:
                    give_up = now + BUSY_WAIT
                elif now >= give_up:
                    raise
            time.sleep(_BUSY_SLEEPS[min(attempt, len(_BUSY_SLEEPS) - 1)])
            attempt += 1

    def run_detached(self, fn: Callable[[sqlite3.Connection], Any], what: str) -> None:
        """Best effort, never waiting: run ``fn`` (inline here, or on the worker if it runs);
        a failure is only logged, as "could not ``what``" (what it cleans up must also
        expire by itself)."""

        def quietly() -> None:
            try:
                self.call(fn)
            except (sqlite3.Error, FencedError) as exc:
                logger.debug("could not %s: %r", what, exc)

        if self.closed:
            return
        try:
            if self._pool is None or self._inline():
                quietly()
            else:
                self._pool.submit(quietly)
        except RuntimeError:  # no running loop or executor shut down
            pass

    @staticmethod
    def after_commit(conn: Any, effect: Callable[[], None]) -> None:
        """Run ``effect`` once the transaction on ``conn`` has committed (now, when it has)."""
        if isinstance(conn, InBatch):
            conn.after.append(effect)
        else:
            effect()

    def check_open(self) -> None:
        if self.closed:  # (with the file's name: several sqlite:// files may be in use)
            raise BackendUnavailable(f"sqlite connection to {self.path} is closed")
        self._check_process()

    def _check_process(self) -> None:
        if self._fork_gen != _fork.generation():
            # A forked child shares the parent's connections (SQLite's locks and WAL index
            # would be corrupted) and has no worker thread: refuse, never hang or corrupt.
            # (fenced's own connections open a new source in a child: fenced._core.lease.)
            raise BackendUnavailable(
                f"sqlite connection to {self.path} was opened in process {self._pid} and "
                f"cannot be used in process {os.getpid()} (after fork): open it again here"
            )

    async def aclose(self) -> None:
        """Refuse new transactions, stop the worker and close the connections."""
        self.closed = True
        pool, self._pool = self._pool, None
        if self._fork_gen != _fork.generation():
            # (a forked child's copies are the parent's: never closed here)
            _fork.left_behind(pool, self._conns)
            return
        if pool is not None:
            closing = pool.submit(self._close_thread_connection)
            pool.shutdown(wait=False)
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(closing)
        self._close_thread_connection(0)
        self._close_thread_connection()
        # Connections of other threads (none in normal use) are closed by the garbage collector.

    def _close_thread_connection(self, ident: int | None = None) -> None:
        conn = self._conns.pop(threading.get_ident() if ident is None else ident, None)
        if conn is not None:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    # -- where a transaction runs -----------------------------------------------------------------

    def _inline(self) -> bool:
        """True on fenced's private loop: run transactions right here (see ``on_private_loop``)."""
        loop = asyncio.get_running_loop()
        if loop is self._private_loop:
            return True
        if loop is self._public_loop:  # (asking the registry each time costs a weak reference)
            return False
        if on_private_loop() and (self._turn_commits or not commits_per_turn(loop)):
            self._private_loop = loop
            self._per_turn = commits_per_turn(loop)
            return True
        self._public_loop = loop
        return False

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        """The worker thread (made on first use) that runs transactions for other loops."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="fenced-sqlite"
            )
        return self._pool

    async def _on_worker(
        self, fn: Callable[[sqlite3.Connection], T], orphan: Callable[[T], None] | None
    ) -> T:
        """Run one transaction alone on the worker. ``orphan`` receives the result of one that
        completed after its caller was cancelled (the worker cannot stop mid-transaction)."""
        try:
            future = self._worker().submit(self.call, fn)
        except RuntimeError as exc:  # executor shut down
            raise BackendUnavailable(f"sqlite connection to {self.path} is closed") from exc
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if orphan is not None:
                future.add_done_callback(lambda f: _pass_result(f, orphan))
            raise

    # -- group commit on the worker thread --------------------------------------------------------

    async def _run_batched(
        self, fn: Callable[[sqlite3.Connection], T], orphan: Callable[[T], None] | None
    ) -> T:
        """Queue ``fn`` for the next group commit and wait for its outcome.

        Outcomes come back one call per commit and loop (:meth:`_deliver`), not one thread-safe
        call per transaction: each of those would wake the loop on its own, and the loop would
        resume its callers one at a time while the worker still hands out the rest, so the
        next commit would gather only the first few of them.
        """
        loop = asyncio.get_running_loop()
        job = Job(fn, loop.create_future(), loop)
        with self._batch_lock:
            self._pending.append(job)
            start, self._draining = not self._draining, True
        if start:
            try:
                self._worker().submit(self._drain)
            except RuntimeError as exc:  # executor shut down
                with self._batch_lock:
                    self._draining = False
                raise BackendUnavailable(f"sqlite connection to {self.path} is closed") from exc
        try:
            return await job.waiter  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            if orphan is not None:
                with self._batch_lock:  # (against the worker settling it: see _settle)
                    outcome, job.orphan = job.outcome, orphan
                if outcome is not None and outcome[0]:  # it committed: undo it, on the worker
                    with contextlib.suppress(RuntimeError):  # shut down: it expires by itself
                        self._pool.submit(_guarded, orphan, outcome[1])  # type: ignore[union-attr]
            raise

    def _drain(self) -> None:
        """Group commit, on the worker thread: the transactions that queued up while the last
        commit ran are run together under one ``BEGIN IMMEDIATE`` and one ``COMMIT`` (one
        fsync; see :meth:`_run_together`). Each caller learns its outcome only after
        that commit, so nothing is reported that is not durable; one transaction's error
        undoes only its own part. A transaction alone runs exactly as without batching."""
        while True:
            with self._batch_lock:
                items, self._pending = self._pending, []
                if not items:
                    self._draining = False
                    return
            # (a caller cancelled from now on is undone by _settle or by its own except clause)
            live = [job for job in items if not job.waiter.cancelled()]
            if live:
                self._commit_together(live)

    def _commit_together(self, items: list[Job]) -> None:
        """On the worker: commit ``items`` together, then settle them."""
        self._settle(items, self._run_jobs(items))

    def _settle(self, jobs: list[Job], outcomes: list[tuple[bool, Any]]) -> None:
        """On the worker, after a commit: note each job's outcome, undo at once (before any
        later transaction) what a caller that gave up meanwhile was given, and hand the
        outcomes to their loops."""
        undo = []
        with self._batch_lock:
            for job, outcome in zip(jobs, outcomes, strict=True):
                job.outcome = outcome
                if job.orphan is not None and outcome[0]:
                    undo.append((job.orphan, outcome[1]))
        for orphan, value in undo:
            _guarded(orphan, value)
        self._post(jobs, outcomes)

    def _post(self, jobs: list[Job], outcomes: list[tuple[bool, Any]]) -> None:
        """Hand the outcomes of one commit to their loops: one thread-safe call a loop."""
        loop = jobs[0].loop
        if any(job.loop is not loop for job in jobs):
            for other in {job.loop for job in jobs}:
                pairs = [(j, o) for j, o in zip(jobs, outcomes, strict=True) if j.loop is other]
                self._post([j for j, _ in pairs], [o for _, o in pairs])
            return
        with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
            loop.call_soon_threadsafe(self._deliver, jobs, outcomes)

    def _deliver(self, jobs: list[Job], outcomes: list[tuple[bool, Any]]) -> None:
        """On the callers' loop: resolve each waiter (a cancelled one's is undone elsewhere)."""
        for job, (ok, value) in zip(jobs, outcomes, strict=True):
            waiter = job.waiter
            if waiter.cancelled():
                continue
            if ok:
                waiter.set_result(value)
            else:
                waiter.set_exception(value)

    # -- a commit per turn, on a loop marked commit_per_turn --------------------------------------

    async def _run_this_turn(
        self, fn: Callable[[sqlite3.Connection], T], orphan: Callable[[T], None] | None
    ) -> T:
        """On a loop marked ``commit_per_turn``: join this turn's commit (:meth:`_end_turn`)."""
        loop = asyncio.get_running_loop()
        job = Job(fn, loop.create_future(), loop)
        self._turn.append(job)
        if len(self._turn) == 1:
            # Queued behind everything the loop has ready now: the callers this turn resumes
            # and the requests it reads all get to add their transactions first.
            self._turn_seen, self._turn_waits = 1, 0
            loop.call_soon(self._end_turn)
        try:
            return await job.waiter  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            waiter = job.waiter
            committed = waiter.done() and not waiter.cancelled() and waiter.exception() is None
            if orphan is not None and committed:
                _guarded(orphan, waiter.result())  # committed, then cancelled: undo it
            raise

    def _end_turn(self) -> None:
        """Commit what this turn of the loop gathered, on the loop (one fsync), then answer.

        While each turn keeps bringing more (a busy server), the commit waits for up to
        ``_TURN_WAITS`` more turns, as PostgreSQL's ``commit_delay`` does when others are
        active: the loop is busy anyway, and one commit then carries their writes too."""
        n = len(self._turn)
        if n > self._turn_seen and self._turn_waits < _TURN_WAITS:
            self._turn_seen, self._turn_waits = n, self._turn_waits + 1
            asyncio.get_running_loop().call_soon(self._end_turn)
            return
        jobs, self._turn = self._turn, []
        live = [job for job in jobs if not job.waiter.cancelled()]
        if live:
            self._deliver(live, self._run_jobs(live))

    # -- one commit for several transactions ------------------------------------------------------

    def _run_jobs(self, items: list[Job]) -> list[tuple[bool, Any]]:
        """One commit for ``items`` (the worker's batch, or a turn's): a transaction alone
        runs exactly as without batching; more run together (:meth:`_run_together`)."""
        if len(items) > 1:
            return self._run_together(items)
        try:
            outcomes: list[tuple[bool, Any]] = [(True, self.call(items[0].fn))]
        except BaseException as exc:
            outcomes = [(False, exc)]
        self.commits += 1
        return outcomes

    def _run_together(self, items: list[Job]) -> list[tuple[bool, Any]]:
        """Run ``items`` in one transaction and one commit; each one's outcome, in order."""

        def together(conn: sqlite3.Connection) -> tuple[list[Any], list[Callable[[], None]]]:
            # First all in one go: a transaction that fails is rare, and two savepoint
            # statements for each would cost about as much as its own work. If one fails, the
            # batch is rolled back and run again with a savepoint around each (the
            # transactions are safe to run again: call retries them after SQLITE_BUSY too).
            outcomes: list[tuple[bool, Any]] = []
            after: list[Callable[[], None]] = []
            conn.execute("BEGIN IMMEDIATE")
            part = InBatch(conn)  # (one for all: if one fails, all run again, one apiece)
            try:
                for job in items:
                    outcomes.append((True, job.fn(part)))
                after = part.after
            except Exception:
                conn.execute("ROLLBACK")
                outcomes, after = each_in_a_savepoint(conn)
            conn.execute("COMMIT")
            self.commits += 1
            self.batches += 1
            self.batched += len(items)
            return outcomes, after

        def each_in_a_savepoint(
            conn: sqlite3.Connection,
        ) -> tuple[list[Any], list[Callable[[], None]]]:
            outcomes: list[tuple[bool, Any]] = []
            after: list[Callable[[], None]] = []
            conn.execute("BEGIN IMMEDIATE")
            for job in items:
                part = InBatch(conn)
                conn.execute("SAVEPOINT fenced_part")
                try:
                    outcomes.append((True, job.fn(part)))
                except Exception as exc:
                    conn.execute("ROLLBACK TO fenced_part")  # (if this fails: the whole batch)
                    outcomes.append((False, exc))
                else:
                    after.extend(part.after)
                conn.execute("RELEASE fenced_part")
            return outcomes, after

        try:
            outcomes, after = self.call(together)
        except BaseException as exc:
            return [(False, exc)] * len(items)
        for effect in after:  # (wake-ups, once what they announce is committed)
            with contextlib.suppress(Exception):
                effect()
        return outcomes


def _guarded(handler: Callable[[T], None], value: T) -> None:
    try:
        handler(value)
    except Exception:
        logger.exception("cleaning up after a cancelled sqlite transaction failed")


def _pass_result(future: concurrent.futures.Future[T], handler: Callable[[T], None]) -> None:
    if not future.cancelled() and future.exception() is None:
        try:
            handler(future.result())
        except Exception:
            logger.exception("cleaning up after a cancelled sqlite transaction failed")
