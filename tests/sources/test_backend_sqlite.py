"""The SQLite token source with real OS processes: exclusion, order, crashes, reboots.

Helper processes run ``python -m tests.sources.envs.sqlite COMMAND`` (see that module). Each checker
here has a planted bug it must catch: the journal checker an overlapping holder, the counter
checker a counter kept in memory instead of in the file.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

import fenced
from fenced._core import clock as _clock
from fenced.backends import sqlite as sqlite_backend
from fenced.backends.sqlite import SQLiteBackend, _relaxed, database_path
from tests.helpers import async_wait_for, unique_name, wait_for
from tests.sources.envs.sqlite import ROOT, Worker, open_journal, read_counters, record

# -- planted bugs -----------------------------------------------------------------------------


class UnpersistedCounterBackend(SQLiteBackend):
    """PLANTED BUG: the counter lives in memory, seeded from the holder rows when first used.

    Within one process its tokens do increase, but holder rows are deleted on release, so a
    process that opens the file while the lock is idle starts again from 1.
    """

    def __init__(self, path: str, options: dict[str, float]) -> None:
        super().__init__(path, options)
        self._counters: dict[str, int] = {}

    def _next_token(self, conn: sqlite3.Connection, name: str) -> int:
        if name not in self._counters:
            row = conn.execute(
                "SELECT COALESCE(MAX(token), 0) FROM fenced_holders WHERE name = ?", (name,)
            ).fetchone()
            self._counters[name] = row[0]
        self._counters[name] += 1
        return self._counters[name]


class NoExclusionBackend(SQLiteBackend):
    """PLANTED BUG: breaks the current holder's grant instead of waiting for it."""

    def _tx_acquire(self, conn: sqlite3.Connection, name: str, *args: Any, **kw: Any) -> Any:
        conn.execute("DELETE FROM fenced_holders WHERE name = ?", (name,))
        return super()._tx_acquire(conn, name, *args, **kw)


class RelaxedGrantBackend(SQLiteBackend):
    """PLANTED BUG: every acquire transaction, grants included, commits without fsync."""

    def _tx_acquire(self, conn: sqlite3.Connection, *args: Any, **kw: Any) -> Any:
        with _relaxed(conn):
            return super()._tx_acquire(conn, *args, **kw)


# -- checkers ---------------------------------------------------------------------------------


def journal_violations(rows: list[tuple[int, int, str, int, int]]) -> list[str]:
    """Check a journal of (pid, token, event, status_token, status_mine) rows in append order.

    Critical sections must not overlap (enter, exit, enter, exit ...), each exit must match
    the open enter, tokens must strictly increase from one section to the next, and the lock's
    own status must name the recording holder, with its token, at entry and at exit.
    """
    problems: list[str] = []
    inside: tuple[int, int] | None = None
    last_token = 0
    for i, (pid, token, event, status_token, mine) in enumerate(rows):
        if status_token != token or not mine:
            problems.append(
                f"row {i}: pid {pid} with token {token} but the lock says {status_token}"
            )
        if event == "enter":
            if inside is not None:
                problems.append(f"row {i}: pid {pid} entered while pid {inside[0]} was inside")
            if token <= last_token:
                problems.append(f"row {i}: token {token} after token {last_token}")
            inside, last_token = (pid, token), max(last_token, token)
        else:
            if inside != (pid, token):
                problems.append(f"row {i}: pid {pid} left (token {token}) but {inside} was inside")
            inside = None
    return problems


def counter_violations(
    url: str, name: str, rng: random.Random, *, rounds: int = 3, backend: str | None = None
) -> list[str]:
    """Kill -9 a process acquiring in a tight loop at a random point, reopen, repeat.

    Every token a process was told it holds is *acknowledged*. A token handed out later, by
    any process, after any crash or reopen, must be greater than all of them.
    """
    extra = ["--backend", backend] if backend else []
    problems: list[str] = []
    acked = 0
    for r in range(rounds):
        with Worker("loop", url, name, "--ttl", "0.5", *extra) as worker:
            tokens = [int(worker.expect("token")) for _ in range(rng.randint(3, 40))]
            tokens += [int(line.split()[1]) for line in worker.kill() if line.startswith("token")]
        for a, b in pairwise(tokens):
            if b <= a:
                problems.append(f"round {r}: token {b} granted after {a} in one process")
        if tokens[0] <= acked:
            problems.append(f"round {r}: token {tokens[0]} granted after {acked} was acknowledged")
        acked = max(acked, *tokens)
        with Worker("once", url, name, "--ttl", "5", *extra) as worker:
            token = int(worker.expect("token").split()[0])
            worker.finish()
        if token <= acked:
            problems.append(f"round {r}, reopened: token {token} after {acked} was acknowledged")
        acked = max(acked, token)
    return problems


def fsync_shortfall(url: str, name: str, backend: str | None = None) -> str | None:
    """Run 2 connections taking turns on a lock under strace; every grant and every release
    must have been followed by an fsync (WAL, synchronous=FULL), queueing need not.
    Returns what is missing, or None."""
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        extra = ["--backend", backend] if backend else []
        proc = subprocess.run(
            [
                *("strace", "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", out.name),
                *(sys.executable, "-m", "tests.sources.envs.sqlite", "contend", url, name, *extra),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        calls = re.findall(
            r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?f(?:data)?sync$", out.read(), re.M
        )
    fsyncs = sum(int(c) for c in calls)
    grants, released = (int(x) for x in proc.stdout.split()[1::2])
    if fsyncs < grants + released:
        return f"{fsyncs} fsyncs for {grants} grants and {released} releases"
    return None


needs_strace = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")


@pytest.fixture
def db(tmp_path: Path) -> str:
    return str(tmp_path / "locks.db")


def url_of(path: str, **query: object) -> str:
    q = "&".join(f"{k}={v}" for k, v in query.items())
    return f"sqlite:///{path}" + (f"?{q}" if q else "")


# -- (1) four processes, one lock ---------------------------------------------------------------


def test_processes_take_turns_with_increasing_tokens(db: str, tmp_path: Path) -> None:
    journal_path = str(tmp_path / "journal.db")
    open_journal(journal_path).close()
    name = unique_name()
    workers = [Worker("journal", url_of(db), name, journal_path, "--count", "25") for _ in range(4)]
    try:
        for w in workers:
            w.expect("ready")
        for w in workers:
            w.finish(timeout=90)
    finally:
        for w in workers:
            w.__exit__(None, None, None)
    journal = open_journal(journal_path)
    rows = journal.execute(
        "SELECT pid, token, event, status_token, status_mine FROM journal ORDER BY seq"
    ).fetchall()
    assert len(rows) == 4 * 25 * 2
    assert len({r[0] for r in rows}) == 4
    assert len({r[1] for r in rows}) == 100
    assert journal_violations(rows) == []


def test_journal_check_catches_a_lock_without_exclusion(
    db: str, tmp_path: Path, register_scheme: Callable[[str, str], None]
) -> None:
    register_scheme("sqlite", "tests.sources.test_backend_sqlite:NoExclusionBackend")
    journal = open_journal(str(tmp_path / "journal.db"))
    name = unique_name()
    with fenced.connect(url_of(db)) as a, fenced.connect(url_of(db)) as b:
        first = a.lock(name, ttl=10)
        first.acquire(timeout=1)
        record(journal, a, first, "enter")
        second = b.lock(name, ttl=10)
        second.acquire(timeout=1)  # must have waited; the planted bug grants at once
        record(journal, b, second, "enter")
        record(journal, b, second, "exit")
        record(journal, a, first, "exit")
    rows = journal.execute(
        "SELECT pid, token, event, status_token, status_mine FROM journal ORDER BY seq"
    ).fetchall()
    problems = journal_violations(rows)
    assert any("entered while" in p for p in problems), problems
    assert any("the lock says" in p for p in problems), problems


# -- (2) a holder killed while holding -------------------------------------------------------------


def test_killed_holder_is_replaced_after_its_ttl_with_a_higher_token(db: str) -> None:
    name = unique_name()
    ttl = 1.0
    with Worker("hold", url_of(db), name, "--ttl", str(ttl)) as worker:
        dead_token = int(worker.expect("token"))
        worker.kill()
    with fenced.connect(url_of(db)) as locks:
        before = _clock.now()
        status = locks.status(name)
        # The lease of the dead process still runs: no grant before it expires.
        assert status.token is not None and status.token.value == dead_token
        assert status.remaining is not None and 0 < status.remaining <= ttl
        with pytest.raises(fenced.LockTimeout):
            locks.lock(name, ttl=5).acquire(timeout=0)
        lease = locks.lock(name, ttl=5)
        token = lease.acquire(timeout=ttl + 10)
        granted = _clock.now()
        assert token.value > dead_token
        assert granted >= before + status.remaining
        assert granted - before < status.remaining + 1.0
        lease.release()


# -- (3) a waiter killed while queued ----------------------------------------------------------------


def test_killed_waiter_does_not_block_the_queue_beyond_its_heartbeat(db: str) -> None:
    name = unique_name()
    waiter_ttl = 0.5
    url = url_of(db, waiter_ttl=waiter_ttl)
    with fenced.connect(url) as locks, fenced.connect(url) as other:
        holder = locks.lock(name, ttl=30)
        holder.acquire()
        with Worker("wait", url, name) as worker:
            worker.expect("waiting")
            wait_for(lambda: locks.status(name).waiters == 1, what="the worker queued")
            worker.kill()
        killed = _clock.now()
        granted: list[float] = []
        late = other.lock(name, ttl=5)

        def wait_in_line() -> None:
            late.acquire(timeout=30)
            granted.append(_clock.now())

        thread = threading.Thread(target=wait_in_line)
        thread.start()
        holder.release()
        thread.join(30)
        assert granted, "the live waiter never got the lock"
        # The dead waiter was first in line; its row expired at most waiter_ttl after its
        # last heartbeat, which was before the kill.
        assert granted[0] - killed < waiter_ttl + 1.0
        assert locks.status(name).waiters == 0
        late.release()


# -- (4) and (5) the counter survives kill -9 at any point ----------------------------------------


def test_counter_never_goes_back_after_kill_mid_acquire_loop(db: str) -> None:
    seed = random.randrange(2**32)
    name = unique_name()
    problems = counter_violations(url_of(db), name, random.Random(seed), rounds=4)
    assert problems == [], f"seed {seed}: {problems}"
    counters = read_counters(db)
    with fenced.connect(url_of(db)) as locks:
        status = locks.status(name)
        assert status.last_token is not None and status.last_token.value == counters[name]
        with locks.lock(name, ttl=5, timeout=10) as lease:
            assert lease.token.value == counters[name] + 1


def test_counter_check_catches_a_counter_that_is_not_persisted(db: str) -> None:
    seed = random.randrange(2**32)
    problems = counter_violations(
        url_of(db),
        unique_name(),
        random.Random(seed),
        rounds=2,
        backend="tests.sources.test_backend_sqlite:UnpersistedCounterBackend",
    )
    assert problems, f"seed {seed}: the planted unpersisted counter went unnoticed"


# -- (6) a reboot -----------------------------------------------------------------------------------


def test_rows_of_an_earlier_boot_are_expired(db: str) -> None:
    name = unique_name()
    with Worker("old-boot", url_of(db), name) as worker:
        old_token = int(worker.expect("token"))
        worker.expect("ready")
        worker.kill()
    raw = sqlite3.connect(db)
    boot, expires = raw.execute(
        "SELECT boot_id, expires_at FROM fenced_holders WHERE name = ?", (name,)
    ).fetchone()
    (queued,) = raw.execute(
        "SELECT count(*) FROM fenced_waiters WHERE name = ?", (name,)
    ).fetchone()
    raw.close()
    # By time alone the rows would still be live: only the boot id says they are gone.
    assert boot != _clock.boot_id() and expires > _clock.now() + 3000
    assert queued == 1
    with fenced.connect(url_of(db)) as locks:
        status = locks.status(name)
        assert status.holder is None and status.waiters == 0
        assert status.last_token is not None and status.last_token.value == old_token
        lease = locks.lock(name, ttl=5)
        assert lease.acquire(timeout=0).value == old_token + 1
        lease.release()


# -- in one process ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "path"),
    [
        ("sqlite:////var/x/locks.db", "/var/x/locks.db"),
        ("sqlite:///./rel/locks.db", "{cwd}/rel/locks.db"),
        ("sqlite:///../locks.db", "{parent}/locks.db"),
    ],
)
def test_url_forms_follow_sqlalchemy(url: str, path: str) -> None:
    import os

    cwd = os.getcwd()
    assert database_path(urlsplit(url)) == path.format(cwd=cwd, parent=os.path.dirname(cwd))


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("sqlite:///var/x/locks.db", "ambiguous.*sqlite:////var/x/locks.db"),
        ("sqlite:///locks.db", "ambiguous.*sqlite:///./locks.db"),
        ("sqlite://rel/locks.db", "host part"),
        ("sqlite://./locks.db", "host part"),
        ("sqlite://locks.db", "host part"),
    ],
)
def test_ambiguous_url_forms_are_refused(url: str, match: str) -> None:
    """Bug: ``sqlite:///x.db`` was absolute here but relative in SQLAlchemy, and
    ``sqlite://rel/x.db`` silently relative: two processes could use two files."""
    with pytest.raises(fenced.ConfigurationError, match=match):
        fenced.connect(url)


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///", "sqlite:///:memory:", "sqlite:///x/"])
def test_url_without_a_file_is_refused(url: str) -> None:
    with pytest.raises(fenced.ConfigurationError):
        fenced.connect(url)


def test_a_missing_directory_is_refused_not_created(tmp_path: Path) -> None:
    """Bug: missing directories were created silently (as root, one at the filesystem root)."""
    target = tmp_path / "typo" / "locks.db"
    with pytest.raises(fenced.ConfigurationError, match="does not exist"):
        fenced.connect(f"sqlite:///{target}")
    assert not target.parent.exists()


def test_options(db: str) -> None:
    with pytest.raises(fenced.ConfigurationError, match="unknown"):
        fenced.connect(url_of(db), nonsense=1)
    with pytest.raises(fenced.ConfigurationError, match="> 0"):
        fenced.connect(url_of(db, waiter_ttl=0))
    with pytest.raises(fenced.ConfigurationError, match="number"):
        fenced.connect(url_of(db, poll_interval="fast"))
    with fenced.connect(url_of(db, waiter_ttl=7), busy_timeout=3) as locks:
        backend = locks.aio.backend
        assert isinstance(backend, SQLiteBackend)
        assert backend._waiter_ttl == 7 and backend._busy_timeout == 3


@pytest.mark.parametrize("mode", ["turn", "worker"])
def test_group_commit_option_selects_the_mode_on_a_per_turn_loop(db: str, mode: str) -> None:
    """``group_commit`` picks how ``fenced serve``'s loop (marked ``commit_per_turn``) commits:
    on the loop once per turn (no worker thread, connection key 0), or on the worker thread's
    group commit as on an application's loop. (Before the option, serve had one mode only.)"""
    from fenced._core.portal import mark_private

    async def run() -> tuple[bool, set[int], int]:
        mark_private(asyncio.get_running_loop(), commit_per_turn=True)
        async with fenced.connect_async(url_of(db, group_commit=mode)) as locks:
            backend = locks.backend
            assert isinstance(backend, SQLiteBackend)
            leases = [locks.lock(f"k{i}", ttl=5) for i in range(8)]
            await asyncio.gather(*(lease.acquire() for lease in leases))
            await asyncio.gather(*(lease.release() for lease in leases))
            return (
                backend._executor._pool is not None,
                set(backend._executor._conns),
                backend.commits,
            )

    worker, conns, commits = asyncio.run(run())
    assert commits >= 1
    if mode == "turn":
        assert (worker, conns) == (False, {0})
    else:
        assert worker and 0 not in conns
    with pytest.raises(fenced.ConfigurationError, match=r"group_commit.*turn or worker"):
        fenced.connect(url_of(db, group_commit="fsync-later"))


async def test_creates_the_file_and_sets_durable_pragmas(tmp_path: Path) -> None:
    path = tmp_path / "locks.db"
    async with fenced.connect_async(url_of(str(path))) as locks:
        backend = locks.backend
        assert isinstance(backend, SQLiteBackend)
        journal, sync = await backend._executor.run(
            lambda c: (
                c.execute("PRAGMA journal_mode").fetchone()[0],
                c.execute("PRAGMA synchronous").fetchone()[0],
            ),
            limit=None,
        )
        assert (journal, sync) == ("wal", 2)  # 2 = FULL: the WAL is fsynced at every commit
    assert path.exists()


def _refuses_files(directory: Path) -> bool:
    try:
        fd, name = tempfile.mkstemp(dir=directory)
    except OSError:
        return directory.is_dir()
    os.close(fd)
    os.unlink(name)
    return False


def test_unusable_files_are_refused_at_once(tmp_path: Path) -> None:
    """Bug: a file that is not a database, or a directory, was retried for the whole
    connect_timeout (10 s by default) before BackendUnavailable. No retry mends them: a
    one-line ConfigurationError at once, whatever connect_timeout is."""
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database" * 100)
    cases = [
        (str(garbage), "not a SQLite database"),
        (str(tmp_path), "is a directory"),
    ]
    # A place this user may not write: a read-only directory (root may write any, but not
    # in sysfs, which refuses new files even to root).
    locked = tmp_path / "read-only"
    locked.mkdir(mode=0o555)
    for place in (locked, Path("/sys")):
        if (place.is_dir() and not os.access(place, os.W_OK)) or _refuses_files(place):
            cases.append((str(place / "locks.db"), "cannot be opened by this user"))
    assert len(cases) > 2, "no read-only place to try"
    for path, message in cases:
        started = time.monotonic()
        with pytest.raises(fenced.ConfigurationError, match=message) as info:
            fenced.connect(url_of(path))  # the default connect_timeout: 10 s
        took = time.monotonic() - started
        assert took < 3, f"{path}: refused after {took:.1f} s"
        assert "\n" not in str(info.value)
        with pytest.raises(fenced.ConfigurationError, match=message):
            fenced.connect(url_of(path), connect_timeout=0.1)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(fenced.ConfigurationError, match="does not exist"):
        fenced.connect(url_of(str(blocker / "locks.db")))  # its parent is a file
    assert garbage.read_bytes() == b"this is not a database" * 100  # left alone


async def test_write_locked_database(db: str) -> None:
    name = unique_name()
    async with fenced.connect_async(url_of(db, busy_timeout=0.3)) as locks:
        backend = locks.backend
        grant = await backend.acquire(
            name, request_id="r", ttl=30, deadline=None, on_lost=lambda exc: None
        )
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process stuck inside a transaction
        try:
            start = _clock.now()
            with pytest.raises(fenced.LockTimeout):
                await locks.lock(unique_name(), ttl=5).acquire(timeout=0.3)
            assert 0.3 <= _clock.now() - start < 3
            with pytest.raises(fenced.BackendUnavailable):
                await backend.release(grant)
            with pytest.raises(fenced.BackendUnavailable):
                await backend.renew(grant)
            status = await locks.status(name)  # readers are not blocked by a writer (WAL)
            assert status.token == grant.token
            async with fenced.connect_async(url_of(db)) as late:  # nor is connecting
                assert (await late.status(name)).token == grant.token
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert await backend.release(grant) is True


_HOLD_WRITE_LOCK = (
    "import sqlite3, sys\n"
    "conn = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
    "conn.execute('BEGIN IMMEDIATE')\n"
    "print('held', flush=True)\n"
    "sys.stdin.readline()\n"
    "conn.execute('COMMIT')\n"
)


async def test_a_try_once_of_a_free_lock_waits_out_another_process_committing(db: str) -> None:
    """Another process inside a write transaction for longer than the 50 ms fenced retried
    on the spot (a commit whose fsync is slow on a busy disk, or a second `fenced serve` on
    the file) made a try-once acquire of a *free* lock raise LockTimeout — `fenced serve`'s
    409 "not acquired" — though nobody held it. Its one look now retries the write-locked
    database for at least 0.25 s (one real attempt), and no longer: the timeout is kept."""
    name = unique_name()
    async with fenced.connect_async(url_of(db, busy_timeout=30)) as locks:
        assert (await locks.status(name)).token is None  # (the file and its tables exist)
        other = subprocess.Popen(
            [sys.executable, "-c", _HOLD_WRITE_LOCK, db],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert other.stdin is not None and other.stdout is not None
        try:
            assert other.stdout.readline() == "held\n"
            start = _clock.now()
            trying = asyncio.ensure_future(locks.lock(name, ttl=5).acquire(timeout=0))
            done, _ = await asyncio.wait({trying}, timeout=0.15)  # (3× the old 50 ms)
            assert not done, trying.exception()  # (was: LockTimeout after 50 ms)
            with pytest.raises(fenced.LockTimeout):  # (write-locked throughout)
                await asyncio.wait_for(trying, 30)
            elapsed = _clock.now() - start
            assert elapsed < 0.25 + 1.0, f"a try-once took {elapsed:.2f} s"  # (busy_timeout 30)
        finally:
            other.stdin.write("\n")
            other.stdin.flush()
            assert other.wait(30) == 0
        token = await locks.lock(name, ttl=5).acquire(timeout=0)
        assert token.value == 1
        start = _clock.now()
        with pytest.raises(fenced.LockTimeout):  # held: refused, and at once
            await locks.lock(name, ttl=5).acquire(timeout=0)
        assert _clock.now() - start < 5


def test_counter_rows_refuse_to_shrink_or_vanish(db: str) -> None:
    name = unique_name()
    with fenced.connect(url_of(db)) as locks, locks.lock(name, ttl=5):
        pass
    raw = sqlite3.connect(db, isolation_level=None)
    try:
        with pytest.raises(sqlite3.IntegrityError, match="only grow"):
            raw.execute("UPDATE fenced_counters SET last_token = 0 WHERE name = ?", (name,))
        with pytest.raises(sqlite3.IntegrityError, match="never deleted"):
            raw.execute("DELETE FROM fenced_counters")
    finally:
        raw.close()
    assert read_counters(db) == {name: 1}


async def test_no_renewal_after_expiry(db: str) -> None:
    name = unique_name()
    noop = lambda exc: None  # noqa: E731
    async with fenced.connect_async(url_of(db)) as locks:
        backend = locks.backend
        grant = await backend.acquire(name, request_id="r", ttl=0.2, deadline=None, on_lost=noop)
        renewed = await backend.renew(grant)
        assert renewed.sent_at > grant.sent_at
        await async_wait_for(lambda: _is_free(locks, name), what="expiry")
        # Nobody took the lock over, but the lease ran out: it must not come back to life.
        with pytest.raises(fenced.LeaseLostError):
            await backend.renew(grant)
        assert await backend.release(grant) is False
        again = await backend.acquire(name, request_id="r", ttl=5, deadline=None, on_lost=noop)
        assert again.token > grant.token
        await backend.release(again)


async def _is_free(locks: fenced.AsyncLocks, name: str) -> bool:
    return (await locks.status(name)).holder is None


@pytest.mark.parametrize("doorbell", [True, False], ids=["doorbell", "no-doorbell"])
def test_release_wakes_waiters_of_this_process_at_once(
    db: str, monkeypatch: pytest.MonkeyPatch, doorbell: bool
) -> None:
    # With every poll 5 s apart, only the in-process wake-up can hand the lock over quickly,
    # also where this process has no doorbell socket (another OS).
    monkeypatch.setattr(SQLiteBackend, "poll_min", 5.0)
    if not doorbell:
        monkeypatch.setattr(sqlite_backend, "my_wake_address", lambda: None)
    name = unique_name()
    url = url_of(db, poll_interval=5, waiter_ttl=60)
    with fenced.connect(url) as locks, fenced.connect(url) as other:
        holder = locks.lock(name, ttl=30)
        holder.acquire()
        granted: list[float] = []
        waiter = other.lock(name, ttl=30)

        def wait_in_line() -> None:
            waiter.acquire(timeout=30)
            granted.append(_clock.now())

        thread = threading.Thread(target=wait_in_line)
        thread.start()
        wait_for(lambda: locks.status(name).waiters == 1, what="waiter queued")
        released = _clock.now()
        holder.release()
        thread.join(30)
        assert granted and granted[0] - released < 1.0
        waiter.release()


def test_release_rings_a_waiter_in_another_process(db: str) -> None:
    # The waiter polls only every 5 s: it can only get the lock sooner if the release rings it.
    name = unique_name()
    url = url_of(db, poll_interval=5, waiter_ttl=60)
    with fenced.connect(url) as locks, Worker("wait", url, name, "--poll-min", "5") as worker:
        holder = locks.lock(name, ttl=30)
        holder.acquire()
        worker.expect("waiting")
        wait_for(lambda: locks.status(name).waiters == 1, what="the worker queued")
        released = _clock.now()
        holder.release()
        token = int(worker.expect("token", timeout=30))
        assert _clock.now() - released < 2.0
        assert token == holder.token.value + 1


async def test_queue_rows_never_relax_durability(db: str) -> None:
    """Waiting commits without fsync (synchronous=NORMAL), but the connection is always put
    back to FULL, so the next grant is fsynced; the expected-contention path still grants."""
    name = unique_name()
    noop = lambda exc: None  # noqa: E731
    async with fenced.connect_async(url_of(db)) as a, fenced.connect_async(url_of(db)) as b:
        ba, bb = a.backend, b.backend
        assert isinstance(ba, SQLiteBackend) and isinstance(bb, SQLiteBackend)
        first = await ba.acquire(name, request_id="a1", ttl=30, deadline=None, on_lost=noop)
        waiting = asyncio.create_task(
            bb.acquire(name, request_id="b1", ttl=30, deadline=None, on_lost=noop)
        )
        await async_wait_for(lambda: _waiters_are(a, name, 1), what="b queued")
        assert await ba.release(first) is True  # b was waiting: a expects contention next time
        second = await waiting
        assert name in ba._contended
        assert await bb.release(second) is True
        # a queues first (no fsync), finds the lock free, and comes back to take it durably.
        third = await ba.acquire(
            name, request_id="a2", ttl=30, deadline=_clock.now() + 5, on_lost=noop
        )
        assert third.token > second.token > first.token
        status = await a.status(name)
        assert status.waiters == 0 and status.token == third.token
        for backend in (ba, bb):
            level = await backend._executor.run(
                lambda c: c.execute("PRAGMA synchronous").fetchone()[0], limit=None
            )
            assert level == 2  # FULL
        await ba.release(third)


@needs_strace
def test_every_grant_and_release_is_fsynced(db: str) -> None:
    assert fsync_shortfall(url_of(db), unique_name()) is None


@needs_strace
def test_fsync_check_catches_grants_committed_without_fsync(db: str) -> None:
    backend = "tests.sources.test_backend_sqlite:RelaxedGrantBackend"
    assert fsync_shortfall(url_of(db), unique_name(), backend) is not None


def test_a_connection_that_cannot_be_made_durable_again_is_closed(db: str) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError, match="restore"), _relaxed(conn):
        conn.close()  # stands for any failure that leaves synchronous=NORMAL behind
    with pytest.raises(sqlite3.ProgrammingError):
        conn.execute("SELECT 1")


async def test_cancelled_waiter_leaves_the_queue(db: str) -> None:
    name = unique_name()
    async with fenced.connect_async(url_of(db)) as locks:
        holder = locks.lock(name, ttl=30)
        await holder.acquire()
        task = asyncio.create_task(locks.lock(name, ttl=5).acquire(timeout=30))
        await async_wait_for(lambda: _waiters_are(locks, name, 1), what="waiter queued")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await async_wait_for(lambda: _waiters_are(locks, name, 0), what="waiter gone")
        await holder.release()
        # The next caller is not stuck behind the cancelled one.
        lease = locks.lock(name, ttl=5)
        await lease.acquire(timeout=0)
        await lease.release()


async def test_a_grant_made_after_its_caller_was_cancelled_is_given_back(db: str) -> None:
    # On an application's loop the transaction runs on a worker thread and cannot be stopped
    # halfway: if it grants after the caller gave up, the grant must not block the lock.
    entered, gate = threading.Event(), threading.Event()

    class Slow(SQLiteBackend):
        def _next_token(self, conn: sqlite3.Connection, name: str) -> int:
            entered.set()
            gate.wait(10)
            return super()._next_token(conn, name)

    backend = await Slow.open(urlsplit(url_of(db)), {})
    try:
        task = asyncio.create_task(
            backend.acquire("x", request_id="r", ttl=30, deadline=None, on_lost=lambda exc: None)
        )
        assert await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        status = await backend.status("x")  # runs on the worker after the give-back
        assert status.holder is None and status.last_token == fenced.FencingToken("x", 1)
    finally:
        gate.set()
        await backend.aclose()


async def _waiters_are(locks: fenced.AsyncLocks, name: str, n: int) -> bool:
    return (await locks.status(name)).waiters == n


async def test_transactions_leave_the_event_loop_free(db: str) -> None:
    # On an application's loop the (blocking) SQLite calls run on a worker thread.
    threads: list[int] = []

    class Probe(SQLiteBackend):
        def _next_token(self, conn: sqlite3.Connection, name: str) -> int:
            threads.append(threading.get_ident())
            return super()._next_token(conn, name)

    backend = await Probe.open(urlsplit(url_of(db)), {})
    try:
        grant = await backend.acquire(
            "x", request_id="r", ttl=5, deadline=None, on_lost=lambda exc: None
        )
        await backend.release(grant)
    finally:
        await backend.aclose()
    assert threads and threading.get_ident() not in threads


def test_a_file_made_by_fenced_0_1_gains_the_owner_column(tmp_path: Path) -> None:
    """Files of fenced 0.1 have no owner column: it is added (nullable, schema version kept),
    and a 0.1 process writing a holder row without it keeps working on the same file."""
    from fenced.backends import _sqlite_schema as schema

    path = tmp_path / "old.db"
    old = sqlite3.connect(path, isolation_level=None)
    old.execute("PRAGMA journal_mode=WAL").fetchall()
    for statement in schema.SCHEMA:
        old.execute(re.sub(r",\s*owner TEXT[^\n]*", "", statement))
    old.execute(f"PRAGMA user_version = {schema.SCHEMA_VERSION}")
    assert "owner" not in [r[1] for r in old.execute("PRAGMA table_info(fenced_holders)")]
    with fenced.connect(f"sqlite:///{path}") as locks:
        with locks.lock("x", ttl=5, description="upgraded") as lease:
            assert (locks.status("x").owner or "").endswith(": upgraded")
        # fenced 0.1's statement, without the owner column, on the upgraded file:
        old.execute(
            "INSERT OR REPLACE INTO fenced_holders (name, request_id, token, ttl, expires_at, "
            "boot_id) VALUES (?, ?, ?, ?, ?, ?)",
            ("y", "r", 1, 5.0, _clock.now() + 5, _clock.boot_id()),
        )
        status = locks.status("y")
        assert status.holder == "r" and status.owner is None
    assert lease.token.value == 1
    assert old.execute("PRAGMA user_version").fetchone()[0] == schema.SCHEMA_VERSION
    old.close()
