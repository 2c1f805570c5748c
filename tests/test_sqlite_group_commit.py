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
from fenced.backends.sqlite import SQLiteBackend, _Job
from tests.envs.sqlite import read_counters
from tests.helpers import ROOT


class SavepointlessBatches(SQLiteBackend):
    """Planted: a batch in one transaction without savepoints (a failing part keeps what it
    wrote before failing)."""

    def _commit_together(self, items: list[Any]) -> None:
        def together(conn: sqlite3.Connection) -> list[tuple[bool, Any]]:
            conn.execute("BEGIN IMMEDIATE")
            out: list[tuple[bool, Any]] = []
            for job in items:
                try:
                    out.append((True, job.fn(_NoTx(conn))))
                except Exception as exc:
                    out.append((False, exc))
            conn.execute("COMMIT")
            return out

        self._settle(items, self._call(together))


class ReportsBeforeCommit(SQLiteBackend):
    """Planted: tells the callers their grants before the batch's commit (and its fsync)."""

    window: ClassVar[float] = 0.2

    def _commit_together(self, items: list[Any]) -> None:
        def together(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            outcomes: list[tuple[bool, Any]] = []
            for job in items:
                try:
                    outcomes.append((True, job.fn(_NoTx(conn))))
                except Exception as exc:
                    outcomes.append((False, exc))
            self._settle(items, outcomes)
            time.sleep(self.window)  # (the window a real bug leaves open, made wide)
            conn.execute("COMMIT")

        self._call(together)


class _NoTx:
    in_transaction = True

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.after: list[Callable[[], None]] = []

    def execute(self, sql: str, params: Any = ()) -> Any:
        return None if sql in ("BEGIN IMMEDIATE", "COMMIT") else self.conn.execute(sql, params)


async def test_concurrent_acquires_share_commits(tmp_path: Path) -> None:
    async with fenced.connect_async(f"sqlite:///{tmp_path / 'l.db'}") as locks:
        backend = await locks._get_backend()
        assert isinstance(backend, SQLiteBackend)

        async def client(i: int) -> list[int]:
            tokens = []
            for _ in range(20):
                async with locks.lock(f"k{i}", ttl=30) as lease:
                    tokens.append(lease.token.value)
            return tokens

        results = await asyncio.gather(*(client(i) for i in range(64)))
    assert all(r == list(range(1, 21)) for r in results)  # every lock's tokens 1..20, in order
    transactions = 64 * 20 * 2
    assert backend.batched > transactions // 2
    assert backend.commits < transactions / 8, (backend.commits, transactions)


async def _run_batch(backend: SQLiteBackend, fns: list[Callable[[Any], Any]]) -> list[Any]:
    """``fns`` as one batch of the worker (run on another thread), their outcomes in order."""
    loop = asyncio.get_running_loop()
    jobs = [_Job(fn, loop.create_future(), loop) for fn in fns]
    await asyncio.to_thread(backend._commit_together, jobs)
    return await asyncio.gather(*(job.waiter for job in jobs), return_exceptions=True)


@pytest.mark.parametrize("cls", [SQLiteBackend, SavepointlessBatches], ids=["real", "planted"])
async def test_one_failing_transaction_undoes_only_its_own_part(
    tmp_path: Path, cls: type[SQLiteBackend]
) -> None:
    backend = await cls.open(*_url(tmp_path))
    try:
        await backend._transact(
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
        rows = await backend._transact(
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
from fenced import _backend
if sys.argv[2]:
    _backend.register_backend("sqlite", sys.argv[2])
async def main():
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


def _killed_mid_run(tmp_path: Path, backend: str) -> list[tuple[str, int, int]]:
    """A child takes grants on 32 locks at once and prints each; it is killed with SIGKILL
    after 200 lines. Returns (lock, printed token, counter in the file) for every token
    the child printed above what the file kept."""
    db = tmp_path / "l.db"
    fenced.connect(f"sqlite:///{db}").close()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, f"sqlite:///{db}", backend],
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


def test_no_grant_is_reported_before_it_is_durable(tmp_path: Path) -> None:
    assert _killed_mid_run(tmp_path, "") == []


def test_the_crash_check_catches_a_batcher_that_reports_before_commit(tmp_path: Path) -> None:
    assert _killed_mid_run(tmp_path, "tests.test_sqlite_group_commit:ReportsBeforeCommit")
