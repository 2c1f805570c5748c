"""The SQLite token source under the conformance suite, and OS-process helpers for its tests.

``restart()`` simulates a crash of a process that owns connections to the file: a helper OS
process opens the database through fenced, takes a token on every lock, then starts a write
transaction that resets every counter to 1 and deletes every holder, writes enough to spill the
uncommitted pages into the WAL, and is killed with SIGKILL in the middle of it. The next
connection must roll the torn transaction back: every counter is where it was, so no token is
reused. ``restart()`` checks the WAL really held uncommitted frames, and the counters after.

Run as ``python -m tests.sources.envs.sqlite COMMAND ...`` this module is that helper process (and the
worker of ``tests/sources/test_backend_sqlite.py``); every command prints what it did, one line each.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from tests.sources.envs.base import BackendEnv

ROOT = Path(__file__).resolve().parents[3]


class Worker:
    """A helper OS process running one command of this module; its stdout read line by line."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.sources.envs.sqlite", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, prefix: str, timeout: float = 30.0) -> str:
        """The next line starting with ``prefix`` (earlier lines are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"worker printed no {prefix!r} within {timeout} s") from None
            if line is None:
                raise AssertionError(f"worker exited ({self.proc.wait()}) before {prefix!r}")
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def kill(self) -> list[str]:
        """SIGKILL the process; return every line it printed that was not read yet."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._reader.join(10)
        rest = []
        while True:
            line = self.lines.get_nowait() if not self.lines.empty() else None
            if line is None:
                return rest
            rest.append(line)

    def finish(self, timeout: float = 60.0) -> list[str]:
        """Wait for a clean exit; return the lines not read yet."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        code = self.proc.wait(timeout)
        if code != 0:
            raise AssertionError(f"worker exited with {code}")
        self._reader.join(10)
        return [line for line in iter(self.lines.get_nowait, None) if line is not None]

    def __enter__(self) -> Worker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def read_counters(path: str) -> dict[str, int]:
    """Every lock's counter, read with a plain sqlite3 connection."""
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT name, last_token FROM fenced_counters").fetchall())
    except sqlite3.OperationalError:  # no table yet
        return {}
    finally:
        conn.close()


class SQLiteEnv(BackendEnv):
    name = "sqlite"
    cross_process = True
    min_ttl = 0.3

    def __init__(self, path: str) -> None:
        super().__init__(f"sqlite:///{path}")
        self.path = path

    def restart(self) -> None:
        before = read_counters(self.path)
        wal = Path(self.path + "-wal")
        wal_before = wal.stat().st_size if wal.exists() else 0
        with Worker("crash-mid-transaction", self.path) as worker:
            acked = {}  # the tokens the helper was granted before it crashed
            for _ in before:
                name, value = worker.expect("token").split()
                acked[name] = int(value)
            wal_during = int(worker.expect("ready"))
            worker.kill()
        # The crash must have left uncommitted frames in the WAL, or it proved nothing.
        assert wal_during > wal_before + 1_000_000, (wal_before, wal_during)
        after = read_counters(self.path)
        assert set(acked) == set(before)
        lost = {k: (v, after.get(k)) for k, v in acked.items() if after.get(k, 0) < v}
        assert not lost, f"counters went back after the crash: {lost}"


def make_env(request: pytest.FixtureRequest) -> Iterator[BackendEnv]:
    tmp: Path = request.getfixturevalue("tmp_path")
    yield SQLiteEnv(str(tmp / "locks.db"))


# -- the helper process -----------------------------------------------------------------------


def _block() -> None:
    """Wait until the parent closes our stdin (or kills us)."""
    sys.stdin.read()


def _cmd_crash_mid_transaction(args: argparse.Namespace) -> None:
    import fenced

    path = args.path
    with fenced.connect(f"sqlite:///{path}") as locks:
        for name in read_counters(path):
            with locks.lock(name, ttl=30, timeout=30) as lease:
                print("token", name, lease.token.value, flush=True)
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("PRAGMA cache_size=16")  # spill the uncommitted pages into the WAL
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DROP TRIGGER IF EXISTS fenced_counters_only_grow")
        conn.execute("UPDATE fenced_counters SET last_token = 1")
        conn.execute("DELETE FROM fenced_holders")
        conn.execute("CREATE TABLE crash_junk (x BLOB)")
        conn.execute(
            "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < 600) "
            "INSERT INTO crash_junk SELECT randomblob(4000) FROM c"
        )
        print("ready", os.path.getsize(path + "-wal"), flush=True)
        _block()


def _use_backend(target: str | None) -> None:
    """Run the sqlite:// scheme on another class (a planted bug) in this process."""
    if target:
        from fenced._core import backend as _backend

        _backend.register_backend("sqlite", target)


def _cmd_hold(args: argparse.Namespace) -> None:
    import fenced

    _use_backend(args.backend)
    with fenced.connect(args.url) as locks:
        lease = locks.lock(args.name, ttl=args.ttl)
        print("token", lease.acquire(timeout=60).value, flush=True)
        _block()


def _cmd_wait(args: argparse.Namespace) -> None:
    import fenced
    from fenced.backends.sqlite import SQLiteBackend

    if args.poll_min is not None:  # slow polling down: only a ring can wake us early
        SQLiteBackend.poll_min = args.poll_min
    with fenced.connect(args.url) as locks:
        print("waiting", flush=True)
        lease = locks.lock(args.name, ttl=args.ttl)
        print("token", lease.acquire(timeout=60).value, flush=True)
        _block()


def _cmd_loop(args: argparse.Namespace) -> None:
    """Acquire and release as fast as possible, printing each token once it is granted."""
    import fenced

    _use_backend(args.backend)
    with fenced.connect(args.url) as locks:
        for _ in range(args.count):
            lease = locks.lock(args.name, ttl=args.ttl)
            print("token", lease.acquire(timeout=60).value, flush=True)
            lease.release()
    print("done", flush=True)


def _cmd_contend(args: argparse.Namespace) -> None:
    """``threads`` connections take turns on one lock, ``count`` grants each; then a report."""
    import fenced

    _use_backend(args.backend)
    released = []

    def one() -> None:
        with fenced.connect(args.url) as locks:
            for _ in range(args.count):
                lease = locks.lock(args.name, ttl=10)
                lease.acquire(timeout=60)
                released.append(lease.release())

    threads = [threading.Thread(target=one) for _ in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("grants", len(released), "released", sum(released), flush=True)


def _cmd_once(args: argparse.Namespace) -> None:
    """Open the database afresh, take one token, report it and the counter, release, exit."""
    import fenced

    _use_backend(args.backend)
    with fenced.connect(args.url) as locks:
        with locks.lock(args.name, ttl=args.ttl, timeout=60) as lease:
            status = locks.status(args.name)
            last = status.last_token.value if status.last_token else 0
            print("token", lease.token.value, last, flush=True)


JOURNAL_SCHEMA = """CREATE TABLE IF NOT EXISTS journal (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    pid INTEGER NOT NULL, token INTEGER NOT NULL, event TEXT NOT NULL,
    status_token INTEGER NOT NULL, status_mine INTEGER NOT NULL)"""


def open_journal(path: str) -> sqlite3.Connection:
    """The shared append-only log of critical sections (its own file, not the lock database)."""
    journal = sqlite3.connect(path, isolation_level=None, timeout=30)
    journal.execute("PRAGMA journal_mode=WAL")
    journal.execute(JOURNAL_SCHEMA)
    return journal


def record(journal: sqlite3.Connection, locks: Any, lease: Any, event: str) -> None:
    """Append (token, pid, event) to the journal, with what the lock's own status says."""
    status = locks.status(lease.name)
    seen = status.token.value if status.token else 0
    mine = int(status.holder == lease.request_id)
    journal.execute(
        "INSERT INTO journal (pid, token, event, status_token, status_mine) VALUES (?, ?, ?, ?, ?)",
        (os.getpid(), lease.token.value, event, seen, mine),
    )


def _cmd_journal(args: argparse.Namespace) -> None:
    """``count`` critical sections, each journaled on entry and exit."""
    import fenced

    journal = open_journal(args.journal)
    with fenced.connect(args.url) as locks:
        print("ready", flush=True)
        for _ in range(args.count):
            with locks.lock(args.name, ttl=10, timeout=60) as lease:
                record(journal, locks, lease, "enter")
                record(journal, locks, lease, "exit")
    print("done", flush=True)


def _cmd_old_boot(args: argparse.Namespace) -> None:
    """Take the lock and queue a waiter as if under an earlier boot of the machine."""
    import fenced
    from fenced._core import clock as _clock

    real_now = _clock.now
    _clock.boot_id = lambda: "00000000-0000-0000-0000-earlier-boot"  # type: ignore[assignment]
    _clock.now = lambda: real_now() + 1e6  # type: ignore[assignment]
    with fenced.connect(args.url) as locks, fenced.connect(args.url) as other:
        lease = locks.lock(args.name, ttl=3600)
        print("token", lease.acquire(timeout=10).value, flush=True)
        waiter = threading.Thread(
            target=lambda: other.lock(args.name, ttl=10).acquire(timeout=3600), daemon=True
        )
        waiter.start()
        deadline = time.monotonic() + 30
        while locks.status(args.name).waiters != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        print("ready", flush=True)
        _block()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.sources.envs.sqlite")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("crash-mid-transaction")
    p.add_argument("path")
    p.set_defaults(fn=_cmd_crash_mid_transaction)
    for name, fn in [("hold", _cmd_hold), ("wait", _cmd_wait), ("loop", _cmd_loop)]:
        p = sub.add_parser(name)
        p.add_argument("url")
        p.add_argument("name")
        p.add_argument("--ttl", type=float, default=10.0)
        p.add_argument("--count", type=int, default=10**9)
        p.add_argument("--backend", default=None)
        p.add_argument("--poll-min", type=float, default=None)
        p.set_defaults(fn=fn)
    p = sub.add_parser("contend")
    p.add_argument("url")
    p.add_argument("name")
    p.add_argument("--count", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default=None)
    p.set_defaults(fn=_cmd_contend)
    p = sub.add_parser("once")
    p.add_argument("url")
    p.add_argument("name")
    p.add_argument("--ttl", type=float, default=10.0)
    p.add_argument("--backend", default=None)
    p.set_defaults(fn=_cmd_once)
    p = sub.add_parser("journal")
    p.add_argument("url")
    p.add_argument("name")
    p.add_argument("journal")
    p.add_argument("--count", type=int, default=25)
    p.set_defaults(fn=_cmd_journal)
    p = sub.add_parser("old-boot")
    p.add_argument("url")
    p.add_argument("name")
    p.set_defaults(fn=_cmd_old_boot)
    args = parser.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
