"""Group commit in the SQLite source: concurrent acquires, renewals and releases of one
process share one transaction and one fsync (see ``SQLiteBackend._drain``).

What must hold: many grants per commit under concurrency; each transaction's error undoes
only its own part; and no caller hears of a grant before it is durable (a process killed with
SIGKILL mid-run never printed a token the file does not have). Both properties are shown to
catch a planted batcher that gets them wrong.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

import fenced
from fenced.backends._sqlite_executor import InBatch, Job, TransactionExecutor
from fenced.backends.sqlite import SQLiteBackend
from tests.helpers import ROOT
from tests.sources.envs.sqlite import read_counters


class SavepointlessExecutor(TransactionExecutor):
    """Planted: a batch in one transaction without savepoints (a failing part keeps what it
    wrote before failing)."""

    def _commit_together(self, items: list[Any]) -> None:
        def together(conn: sqlite3.Connection) -> list[tuple[bool, Any]]:
            conn.execute("BEGIN IMMEDIATE")
            out: list[tuple[bool, Any]] = []
            for job in items:
                try:
                    out.append((True, job.fn(InBatch(conn))))
                except Exception as exc:
                    out.append((False, exc))
            conn.execute("COMMIT")
            return out

        self._settle(items, self.call(together))


class ReportsBeforeCommitExecutor(TransactionExecutor):
    """Planted: tells the callers their outcomes before the batch's commit (and its fsync)."""

    window: ClassVar[float] = 0.2

    def _commit_together(self, items: list[Any]) -> None:
        def together(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            outcomes: list[tuple[bool, Any]] = []
            for job in items:
                try:
                    outcomes.append((True, job.fn(InBatch(conn))))
                except Exception as exc:
                    outcomes.append((False, exc))
            self._settle(items, outcomes)
            time.sleep(self.window)  # (the window a real bug leaves open, made wide)
            conn.execute("COMMIT")

        self.call(together)


class TurnReportsBeforeCommitExecutor(TransactionExecutor):
    """Planted: the per-turn commit (a loop marked ``commit_per_turn``) answers its callers
    first and commits a while later, in another turn."""

    window: ClassVar[float] = 0.2
    _open = False

    def _end_turn(self) -> None:
        loop = asyncio.get_running_loop()
        if self._open:  # the last turn's commit is still to come
            loop.call_later(0.01, self._end_turn)
            return
        jobs, self._turn = self._turn, []
        live = [job for job in jobs if not job.waiter.cancelled()]
        if not live:
            return

        def begin_and_run(conn: sqlite3.Connection) -> Any:
            conn.execute("BEGIN IMMEDIATE")
            return [(True, job.fn(InBatch(conn))) for job in live], conn

        outcomes, conn = self.call(begin_and_run)
        self._open = True
        self._deliver(live, outcomes)

        def commit() -> None:
            conn.execute("COMMIT")
            self._open = False

        loop.call_later(self.window, commit)


class SavepointlessBatches(SQLiteBackend):
    executor_class = SavepointlessExecutor


class ReportsBeforeCommit(SQLiteBackend):
    executor_class = ReportsBeforeCommitExecutor


class TurnReportsBeforeCommit(SQLiteBackend):
    executor_class = TurnReportsBeforeCommitExecutor


async def _sixty_four_clients(locks: fenced.AsyncLocks) -> list[list[int]]:
    """64 clients at once, each taking and releasing its own lock 20 times: their tokens."""

    async def client(i: int) -> list[int]:
        tokens = []
        for _ in range(20):
            async with locks.lock(f"k{i}", ttl=30) as lease:
                tokens.append(lease.token.value)
        return tokens

    return await asyncio.gather(*(client(i) for i in range(64)))


async def test_concurrent_acquires_share_commits(tmp_path: Path) -> None:
    async with fenced.connect_async(f"sqlite:///{tmp_path / 'l.db'}") as locks:
        backend = await locks._get_backend()
        assert isinstance(backend, SQLiteBackend)
        results = await _sixty_four_clients(locks)
    assert all(r == list(range(1, 21)) for r in results)  # every lock's tokens 1..20, in order
    transactions = 64 * 20 * 2
    assert backend.batched > transactions // 2
    assert backend.commits < transactions / 8, (backend.commits, transactions)


async def _run_batch(backend: SQLiteBackend, fns: list[Callable[[Any], Any]]) -> list[Any]:
    """``fns`` as one batch of the worker (run on another thread), their outcomes in order."""
    loop = asyncio.get_running_loop()
    jobs = [Job(fn, loop.create_future(), loop) for fn in fns]
    await asyncio.to_thread(backend._executor._commit_together, jobs)
    return await asyncio.gather(*(job.waiter for job in jobs), return_exceptions=True)


@pytest.mark.parametrize("cls", [SQLiteBackend, SavepointlessBatches], ids=["real", "planted"])
async def test_one_failing_transaction_undoes_only_its_own_part(
    tmp_path: Path, cls: type[SQLiteBackend]
) -> None:
    backend = await cls.open(*_url(tmp_path))
    try:
        await backend._executor.run(
            lambda conn: conn.execute("CREATE TABLE t (v TEXT)"), limit=time.monotonic() + 5
        )

        def writes(v: str) -> Callable[[Any], str]:
            def fn(conn: Any) -> str:
                conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT INTO t VALUES (?)", (v,))
                conn.execute("COMMIT")
                return v

            return fn

        def fails(conn: Any) -> None:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO t VALUES ('half-done')")
            raise RuntimeError("a bug in the middle of a transaction")

        out = await _run_batch(backend, [writes("a"), fails, writes("b")])
        rows = await backend._executor.run(
            lambda conn: sorted(r[0] for r in conn.execute("SELECT v FROM t")),
            limit=time.monotonic() + 5,
        )
    finally:
        await backend.aclose()
    assert out[0] == "a" and isinstance(out[1], RuntimeError) and out[2] == "b"
    if cls is SQLiteBackend:
        assert rows == ["a", "b"]
    else:
        assert rows == ["a", "b", "half-done"]  # the planted batcher keeps the half


def _url(tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    from urllib.parse import urlsplit

    return urlsplit(f"sqlite:///{tmp_path / 'l.db'}"), {}


CHILD = """
import asyncio, sys, fenced
from fenced._core import backend as _backend
if sys.argv[2]:
    _backend.register_backend("sqlite", sys.argv[2])
async def main():
    if sys.argv[3] == "turn":  # as `fenced serve` runs: commits made on the loop, a turn each
        from fenced._core.portal import mark_private
        mark_private(asyncio.get_running_loop(), commit_per_turn=True)
    async with fenced.connect_async(sys.argv[1]) as locks:
        async def client(i):
            while True:
                lease = locks.lock(f"k{i}", ttl=30)
                token = await lease.acquire()
                print(f"k{i}", token.value, flush=True)
                await lease.release()
        await asyncio.gather(*(client(i) for i in range(32)))
asyncio.run(main())
"""


def _killed_mid_run(
    tmp_path: Path, backend: str, mode: str = "worker"
) -> list[tuple[str, int, int]]:
    """A child takes grants on 32 locks at once and prints each; it is killed with SIGKILL
    after 200 lines. Returns (lock, printed token, counter in the file) for every token
    the child printed above what the file kept. ``mode``: "worker" (commits on the worker
    thread, an application's loop) or "turn" (on the loop, a commit per turn)."""
    db = tmp_path / "l.db"
    fenced.connect(f"sqlite:///{db}").close()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, f"sqlite:///{db}", backend, mode],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )
    assert child.stdout is not None
    printed: dict[str, int] = {}
    for _ in range(200):
        name, value = child.stdout.readline().split()
        printed[name] = max(printed.get(name, 0), int(value))
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    for line in child.stdout:  # what was printed before the kill landed
        # (The kill can land between print()'s writes when stdout is unbuffered, as with
        # PYTHONUNBUFFERED in CI: a last "k12" without its value reported no token.)
        parts = line.split()
        if len(parts) == 2:
            printed[parts[0]] = max(printed.get(parts[0], 0), int(parts[1]))
    kept = read_counters(str(db))
    return [(n, v, kept.get(n, 0)) for n, v in printed.items() if v > kept.get(n, 0)]


@pytest.mark.parametrize("mode", ["worker", "turn"])
def test_no_grant_is_reported_before_it_is_durable(tmp_path: Path, mode: str) -> None:
    assert _killed_mid_run(tmp_path, "", mode) == []


@pytest.mark.parametrize(
    ("mode", "plant"),
    [("worker", "ReportsBeforeCommit"), ("turn", "TurnReportsBeforeCommit")],
)
def test_the_crash_check_catches_a_batcher_that_reports_before_commit(
    tmp_path: Path, mode: str, plant: str
) -> None:
    assert _killed_mid_run(tmp_path, f"tests.sources.test_sqlite_group_commit:{plant}", mode)


def _on_a_turn_loop(scenario: Callable[[], Any]) -> Any:
    """Run ``scenario()`` on a fresh loop marked as ``fenced serve`` marks its own."""
    from fenced._core.portal import mark_private

    async def main() -> Any:
        mark_private(asyncio.get_running_loop(), commit_per_turn=True)
        return await scenario()

    return asyncio.run(main())


def test_a_busy_loop_commits_once_for_many_turns_of_writes(tmp_path: Path) -> None:
    # `fenced serve`: the writes of a turn of its loop (and of up to two more turns while they
    # keep coming) share one commit made on the loop itself, with no worker thread.
    async def scenario() -> tuple[list[list[int]], SQLiteBackend, bool]:
        async with fenced.connect_async(f"sqlite:///{tmp_path / 'l.db'}") as locks:
            backend = await locks._get_backend()
            assert isinstance(backend, SQLiteBackend)
            results = await _sixty_four_clients(locks)
            assert backend._executor._per_turn  # (the mode under test)
            return results, backend, backend._executor._pool is None

    results, backend, no_worker = _on_a_turn_loop(scenario)
    assert all(r == list(range(1, 21)) for r in results)
    assert no_worker  # the worker thread was never started
    transactions = 64 * 20 * 2
    # Every transaction went through a turn's commit (one run inline on its own would not
    # be counted: shown on a planted loop that skips the turn), and commits were shared.
    assert backend.batched + (backend.commits - backend.batches) == transactions
    assert backend.commits < transactions / 16, (backend.commits, transactions)


def test_a_turn_commit_gives_back_a_grant_whose_caller_was_cancelled(tmp_path: Path) -> None:
    # Cancelled after the turn's commit granted it, before it could resume: given back.
    async def scenario() -> tuple[Any, Any]:
        async with fenced.connect_async(f"sqlite:///{tmp_path / 'l.db'}") as locks:
            backend = await locks._get_backend()
            assert isinstance(backend, SQLiteBackend)
            task = asyncio.create_task(
                backend.acquire("x", request_id="r", ttl=30, deadline=None, on_lost=print)
            )
            deliver = backend._executor._deliver

            def deliver_then_cancel(jobs: Any, outcomes: Any) -> None:
                deliver(jobs, outcomes)
                task.cancel()  # (the grant is in its future; the task has not run yet)

            backend._executor._deliver = deliver_then_cancel  # type: ignore[method-assign]
            with pytest.raises(asyncio.CancelledError):
                await task
            backend._executor._deliver = deliver  # type: ignore[method-assign]
            # Cancelled before its turn's commit: it is never run.
            early = asyncio.create_task(
                backend.acquire("y", request_id="r", ttl=30, deadline=None, on_lost=print)
            )
            await asyncio.sleep(0)  # (it has joined the turn)
            early.cancel()
            with pytest.raises(asyncio.CancelledError):
                await early
            return await backend.status("x"), await backend.status("y")

    x, y = _on_a_turn_loop(scenario)
    assert x.holder is None and x.last_token == fenced.FencingToken("x", 1)
    assert y.holder is None and y.last_token is None
