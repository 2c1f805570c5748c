"""The SQLite transaction executor alone (``fenced.backends._sqlite_executor``): no locks, a
counter table on a real file, real threads, a real ``fork()``.

What must hold: a group commit carries many transactions in one commit (one fsync) and
answers none of them before that commit; a transaction that fails in a batch fails alone and
is not acknowledged; ``SQLITE_BUSY`` is retried within the given limits, no longer; a forked
child is refused. Each is shown to catch a planted executor that gets it wrong.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fenced._core import clock as _clock
from fenced._core.errors import BackendUnavailable, FencedError
from fenced._core.portal import mark_private
from fenced.backends._sqlite_executor import BUSY_WAIT, TransactionExecutor, retry_limit
from tests.helpers import async_wait_for
from tests.sources.test_sqlite_group_commit import (
    ReportsBeforeCommitExecutor,
    SavepointlessExecutor,
    TurnReportsBeforeCommitExecutor,
)


def _connector(path: str) -> Callable[[bool], sqlite3.Connection]:
    def connect(shared: bool) -> sqlite3.Connection:
        conn = sqlite3.connect(path, timeout=0, isolation_level=None, check_same_thread=not shared)
        conn.execute("PRAGMA journal_mode=WAL").fetchall()
        conn.execute("PRAGMA synchronous=FULL")
        return conn

    return connect


@pytest.fixture
def path(tmp_path: Path) -> Iterator[str]:
    db = str(tmp_path / "counters.db")
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL").fetchall()
    conn.execute("CREATE TABLE counters (name TEXT PRIMARY KEY, n INTEGER NOT NULL)")
    conn.close()
    yield db


def _bump(name: str) -> Callable[[Any], str]:
    """A transaction: add one to counter ``name`` (made at 1)."""

    def fn(conn: Any) -> str:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "INSERT INTO counters VALUES (?, 1) ON CONFLICT (name) DO UPDATE SET n = n + 1",
            (name,),
        )
        conn.execute("COMMIT")
        return name

    return fn


def _committed(path: str) -> dict[str, int]:
    """What another connection sees: only what was committed."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        return dict(conn.execute("SELECT name, n FROM counters").fetchall())
    finally:
        conn.close()


async def _acknowledged_before_commit(
    ex: TransactionExecutor, names: list[str], start: Callable[[], Awaitable[None]]
) -> list[str]:
    """Run a bump of each of ``names`` at once (``start()`` then lets them commit); each caller,
    the moment it is answered, looks from another connection: the names it did not find."""
    early: list[str] = []

    async def caller(name: str) -> None:
        await ex.run(_bump(name), limit=_clock.now() + 10, batch=True)
        if name not in _committed(ex.path):
            early.append(name)

    tasks = [asyncio.create_task(caller(n)) for n in names]
    await start()
    await asyncio.gather(*tasks)
    return early


class _HeldWorker:
    """Holds ``ex``'s worker thread with a transaction of its own, so that the next ones
    queue up; :meth:`let_go` (once ``n`` have queued) lets them all into one batch."""

    def __init__(self, ex: TransactionExecutor) -> None:
        self.ex = ex
        self.entered, self.gate = threading.Event(), threading.Event()
        self.holding: asyncio.Task[None] | None = None

    def _hold(self, conn: Any) -> None:
        self.entered.set()
        self.gate.wait(10)

    async def __aenter__(self) -> _HeldWorker:
        self.holding = asyncio.create_task(self.ex.run(self._hold, limit=None, batch=True))
        assert await asyncio.to_thread(self.entered.wait, 10)
        return self

    async def let_go(self, n: int) -> None:
        async def queued() -> bool:
            return len(self.ex._pending) == n

        await async_wait_for(queued, what=f"{n} transactions queued behind the held worker")
        self.gate.set()
        assert self.holding is not None
        await self.holding

    async def __aexit__(self, *exc: object) -> None:
        self.gate.set()
        await self.ex.aclose()


@pytest.mark.parametrize(
    "cls", [TransactionExecutor, ReportsBeforeCommitExecutor], ids=["real", "planted"]
)
async def test_worker_group_commit_answers_many_after_one_commit(
    path: str, cls: type[TransactionExecutor]
) -> None:
    # An application's loop: transactions go to the worker thread. One transaction holds the
    # worker while 20 more queue up; they then share one commit, and hear of it after it.
    ex = cls(path, _connector(path))
    names = [f"c{i}" for i in range(20)]
    async with _HeldWorker(ex) as held:
        early = await _acknowledged_before_commit(ex, names, lambda: held.let_go(len(names)))
    if cls is ReportsBeforeCommitExecutor:
        assert early  # the plant answered before its commit: seen
        return
    assert early == []
    assert _committed(path) == dict.fromkeys(names, 1)
    # The holder's commit, then one (one fsync) for all 20.
    assert (ex.commits, ex.batches, ex.batched) == (2, 1, 20)


@pytest.mark.parametrize(
    "cls", [TransactionExecutor, TurnReportsBeforeCommitExecutor], ids=["real", "planted"]
)
def test_turn_commit_answers_a_turns_transactions_after_one_commit(
    path: str, cls: type[TransactionExecutor]
) -> None:
    # A loop marked commit_per_turn (fenced serve's): a turn's transactions share one commit
    # made on the loop itself, no worker thread, and hear of it after it.
    ex = cls(path, _connector(path))
    names = [f"c{i}" for i in range(20)]

    async def main() -> list[str]:
        mark_private(asyncio.get_running_loop(), commit_per_turn=True)

        async def start() -> None:
            return None

        try:
            return await _acknowledged_before_commit(ex, names, start)
        finally:
            await ex.aclose()

    early = asyncio.run(main())
    if cls is TurnReportsBeforeCommitExecutor:
        assert early
        return
    assert early == []
    assert _committed(path) == dict.fromkeys(names, 1)
    assert (ex.commits, ex.batched, ex._pool) == (1, 20, None)


def test_on_the_private_loop_a_transaction_runs_inline(path: str) -> None:
    ex = TransactionExecutor(path, _connector(path))
    threads: list[int] = []

    def fn(conn: Any) -> str:
        threads.append(threading.get_ident())
        return _bump("x")(conn)

    async def main() -> None:
        mark_private(asyncio.get_running_loop())
        try:
            await ex.run(fn, limit=None, batch=True)
            assert ex._pool is None and set(ex._conns) == {0}
        finally:
            await ex.aclose()

    asyncio.run(main())
    assert threads == [threading.get_ident()] and _committed(path) == {"x": 1}


@pytest.mark.parametrize(
    "cls", [TransactionExecutor, SavepointlessExecutor], ids=["real", "planted"]
)
async def test_a_failing_transaction_in_a_batch_fails_alone(
    path: str, cls: type[TransactionExecutor]
) -> None:
    ex = cls(path, _connector(path))

    def fails(conn: Any) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO counters VALUES ('half-done', 1)")
        raise RuntimeError("a bug in the middle of a transaction")

    async with _HeldWorker(ex) as held:
        batch = [_bump("a"), fails, _bump("b")]
        tasks = [asyncio.create_task(ex.run(fn, limit=None, batch=True)) for fn in batch]
        await held.let_go(3)
        out = await asyncio.gather(*tasks, return_exceptions=True)
    assert out[0] == "a" and isinstance(out[1], RuntimeError) and out[2] == "b"
    if cls is SavepointlessExecutor:
        assert "half-done" in _committed(path)  # the plant kept the failed part: seen
        return
    assert _committed(path) == {"a": 1, "b": 1}
    assert (ex.batches, ex.batched) == (1, 3)


class _Busy(FencedError):
    """The caller's own error for "still write-locked at my limit"."""


@pytest.fixture
def write_locked(path: str) -> Iterator[sqlite3.Connection]:
    """Another connection holding the file's write lock (until the test rolls it back)."""
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    yield other
    if other.in_transaction:
        other.execute("ROLLBACK")
    other.close()


def test_call_retries_busy_for_busy_wait_then_gives_up(
    path: str, write_locked: sqlite3.Connection
) -> None:
    ex = TransactionExecutor(path, _connector(path))
    try:
        started = time.monotonic()
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            ex.call(_bump("x"))
        took = time.monotonic() - started
        assert BUSY_WAIT <= took < BUSY_WAIT + 1.0, took
        write_locked.execute("ROLLBACK")
        assert ex.call(_bump("x")) == "x"  # free again: the same executor commits
    finally:
        asyncio.run(ex.aclose())
    assert _committed(path) == {"x": 1}


@pytest.mark.parametrize("busy", [None, _Busy], ids=["unavailable", "callers-error"])
async def test_run_retries_busy_until_its_limit_no_longer(
    path: str, write_locked: sqlite3.Connection, busy: type[FencedError] | None
) -> None:
    ex = TransactionExecutor(path, _connector(path))
    expected = BackendUnavailable if busy is None else busy
    try:
        started = time.monotonic()
        with pytest.raises(expected) as caught:
            await ex.run(_bump("x"), limit=_clock.now() + 0.3, busy=busy, batch=True)
        took = time.monotonic() - started
        assert 0.3 <= took < 0.3 + BUSY_WAIT + 1.0, took
        assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
        if busy is None:
            assert "stayed write-locked" in str(caught.value) and path in str(caught.value)
        write_locked.execute("ROLLBACK")
        assert await ex.run(_bump("x"), limit=_clock.now() + 0.3, batch=True) == "x"
    finally:
        await ex.aclose()
    assert _committed(path) == {"x": 1}  # the refused attempts wrote nothing


async def test_a_limit_already_past_still_gets_its_grace(
    path: str, write_locked: sqlite3.Connection
) -> None:
    # (an acquire's try-once: its deadline is now, yet another process's commit that holds
    # the write lock for a moment must not make it give up at once)
    assert retry_limit(None, 0.3) is None
    ex = TransactionExecutor(path, _connector(path))
    try:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="stayed write-locked"):
            await ex.run(_bump("x"), limit=retry_limit(_clock.now() - 5, 0.3), batch=True)
        took = time.monotonic() - started
        assert 0.3 <= took < 0.3 + BUSY_WAIT + 1.0, took
        write_locked.execute("ROLLBACK")
        assert await ex.run(_bump("x"), limit=retry_limit(_clock.now() - 5, 0.3)) == "x"
    finally:
        await ex.aclose()


async def test_run_commits_once_the_write_lock_is_let_go_before_its_limit(
    path: str, write_locked: sqlite3.Connection
) -> None:
    ex = TransactionExecutor(path, _connector(path))
    tries = 0

    def counted(conn: Any) -> str:
        nonlocal tries
        tries += 1
        return _bump("x")(conn)

    try:
        task = asyncio.create_task(ex.run(counted, limit=_clock.now() + 30))

        async def retrying() -> bool:
            return tries >= 3

        await async_wait_for(retrying, what="retries while write-locked")
        assert not task.done()
        write_locked.execute("ROLLBACK")
        assert await task == "x"
    finally:
        await ex.aclose()
    assert _committed(path) == {"x": 1}


async def test_a_non_busy_error_is_backend_unavailable_at_once(path: str) -> None:
    ex = TransactionExecutor(path, _connector(path))
    try:
        with pytest.raises(BackendUnavailable, match="no such table"):
            await ex.run(lambda c: c.execute("SELECT * FROM nowhere"), limit=_clock.now() + 30)
    finally:
        await ex.aclose()
    with pytest.raises(BackendUnavailable, match="closed"):
        await ex.run(_bump("x"), limit=None)


class _NoForkCheck(TransactionExecutor):
    """Planted: uses the parent's connection in a forked child."""

    def _check_process(self) -> None:
        return None


def _in_the_child(ex: TransactionExecutor) -> int:
    """0: refused, and closing left the parent's connections alone; else what went wrong."""
    try:
        ex.call(lambda c: c.execute("SELECT count(*) FROM counters").fetchone())
        code = 1  # used the parent's connection
    except BackendUnavailable as exc:
        code = 0 if "after fork" in str(exc) else 2
    except BaseException:
        return 3
    try:
        asyncio.run(ex.aclose())
    except BaseException:
        return 4
    return code


@pytest.mark.parametrize("cls", [TransactionExecutor, _NoForkCheck], ids=["real", "planted"])
def test_a_forked_child_is_refused(path: str, cls: type[TransactionExecutor]) -> None:
    ex = cls(path, _connector(path))
    try:
        assert ex.call(_bump("parent")) == "parent"  # the connection exists before the fork
        pid = os.fork()
        if pid == 0:  # the child: only os._exit from here on
            os._exit(_in_the_child(ex))
        _, status = os.waitpid(pid, 0)
        assert ex.call(_bump("parent")) == "parent"  # the parent's executor still works
    finally:
        asyncio.run(ex.aclose())
    assert os.waitstatus_to_exitcode(status) == (1 if cls is _NoForkCheck else 0)
    assert _committed(path) == {"parent": 2}
