"""Adversarial review of the lease core, the sync portal and the CLI: each test is a bug found.

Every test here failed before its fix (see the git log of this file). Waits are bounded: a call
that could hang runs in a daemon thread joined with a timeout, never with a fixed sleep.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import SplitResult

import pytest

import fenced
from fenced import _clock
from fenced._backend import Grant, LostCallback
from fenced._state import LeaseState, Phase
from fenced.backends.memory import MemoryBackend
from fenced.guards import _sql_plan
from fenced.guards.sql import RowGuard
from tests.helpers import async_wait_for, wait_for

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent


def _bounded(fn: Callable[[], T], timeout: float = 5.0) -> T:
    """Run ``fn`` in a daemon thread; fail (instead of hanging the suite) if it does not return."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:
            out.append(("err", exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"call did not return within {timeout} s (hung)")
    kind, value = out[0]
    if kind == "err":
        raise value
    result: T = value
    return result


# -- test sources: the memory source with one behaviour changed ----------------------------


class _TestSource(MemoryBackend):
    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> MemoryBackend:
        return cls((await MemoryBackend.open(url, options))._store)


class CappedSource(_TestSource):
    """Grants a shorter lease than asked (as ZooKeeper does when it negotiates the session)."""

    scheme: ClassVar[str] = "capped"
    cap: ClassVar[float] = 0.6

    async def acquire(
        self,
        name: str,
        *,
        request_id: str,
        ttl: float,
        deadline: float | None,
        on_lost: LostCallback,
    ) -> Grant:
        return await super().acquire(
            name,
            request_id=request_id,
            ttl=min(ttl, CappedSource.cap),
            deadline=deadline,
            on_lost=on_lost,
        )

    async def renew(self, grant: Grant) -> Grant:
        await asyncio.sleep(0.05)  # a real source answers after a round trip, not instantly
        return await super().renew(grant)


class GatedSource(_TestSource):
    """Renewals wait at a gate, like a renewal whose reply is still on the network."""

    scheme: ClassVar[str] = "gated"
    gate: ClassVar[asyncio.Event | None] = None

    async def renew(self, grant: Grant) -> Grant:
        if GatedSource.gate is not None:
            await GatedSource.gate.wait()
        return await super().renew(grant)


class GoneAfterGrantSource(_TestSource):
    """Grants, then becomes unreachable: every renew and release fails."""

    scheme: ClassVar[str] = "goneaftergrant"

    async def renew(self, grant: Grant) -> Grant:
        raise fenced.BackendUnavailable("the source went away")

    async def release(self, grant: Grant) -> bool:
        raise fenced.BackendUnavailable("the source went away")


def _register(register_scheme: Callable[[str, str], None], cls: type[_TestSource]) -> None:
    register_scheme(cls.scheme, f"tests.test_review_core:{cls.__name__}")


# -- the sync portal -------------------------------------------------------------------------


def test_close_fails_an_acquire_waiting_in_another_thread(memory_url: str) -> None:
    """Bug: close() stopped the loop under a waiting acquire, whose thread then hung forever."""
    with fenced.connect(memory_url) as holder:
        held = holder.lock("x", ttl=30)
        held.acquire()
        locks = fenced.connect(memory_url)
        waiter = locks.lock("x", ttl=30)
        outcome: list[BaseException | fenced.FencingToken] = []

        def wait_in_acquire() -> None:
            try:
                outcome.append(waiter.acquire())
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=wait_in_acquire, daemon=True)
        thread.start()
        wait_for(lambda: holder.status("x").waiters == 1, what="the waiter to queue")
        _bounded(locks.close)
        thread.join(5)
        assert not thread.is_alive(), "acquire still blocked after its connection was closed"
        assert isinstance(outcome[0], fenced.BackendUnavailable), outcome
        assert holder.status("x").waiters == 0  # it left the queue
        assert held.held


def test_close_from_on_lost_callback_does_not_wedge_the_connection(memory_url: str) -> None:
    """Bug: close() from on_lost stopped the loop thread but not the loop: every later call hung."""
    errors: list[BaseException] = []
    locks = fenced.connect(memory_url)

    def on_lost(_lease: fenced.Lease) -> None:
        try:
            locks.close()
        except BaseException as exc:
            errors.append(exc)

    lease = locks.lock("x", ttl=0.3, auto_renew=False, on_lost=on_lost)
    lease.acquire()
    assert lease.lost.wait(5)
    wait_for(lambda: errors, what="the callback to run")
    assert isinstance(errors[0], RuntimeError) and "callback" in str(errors[0])
    # The connection still works, and closes normally afterwards.
    assert _bounded(lambda: locks.status("x")).name == "x"
    _bounded(locks.close)
    with pytest.raises(fenced.BackendUnavailable):
        _bounded(lambda: locks.status("x"))


def test_interrupted_acquire_never_leaves_the_grant_held(memory_url: str) -> None:
    """Bug: Ctrl-C while acquire() waits, at the instant the grant arrives, dropped the result
    but kept the grant, renewed by the keepalive forever: the caller believed it had no lock.

    The interrupt is timed deterministically: the grant's bookkeeping (``_held.add``, on the
    loop thread) sends SIGINT to the waiting main thread and waits until it has been raised.
    """
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    main = threading.main_thread().ident
    assert main is not None
    raised = threading.Event()
    fired = threading.Event()

    class InterruptOnGrant(weakref.WeakSet[fenced.AsyncLease]):
        def add(self, item: fenced.AsyncLease) -> None:
            super().add(item)
            if not fired.is_set():
                fired.set()
                signal.pthread_kill(main, signal.SIGINT)
                raised.wait(5)

    with fenced.connect(memory_url) as holder, fenced.connect(memory_url) as locks:
        held = holder.lock("x", ttl=30)
        held.acquire()
        locks.aio._held = InterruptOnGrant()
        lease = locks.lock("x", ttl=30)

        def release_when_queued() -> None:
            wait_for(lambda: holder.status("x").waiters == 1, what="the waiter to queue")
            held.release()

        helper = threading.Thread(target=release_when_queued, daemon=True)
        helper.start()
        with pytest.raises(KeyboardInterrupt):
            try:
                lease.acquire()
            finally:
                raised.set()
        helper.join(5)
        assert fired.is_set()
        # The grant made for the interrupted call is given back, not kept alive.
        wait_for(lambda: holder.status("x").holder is None, what="the grant to be given back")
        assert lease.phase is Phase.RELEASED and not lease.held


# -- the lease core --------------------------------------------------------------------------


def test_renewal_is_scheduled_within_a_shortened_grant() -> None:
    """Bug: the keepalive waited ttl/3 of the ttl *asked for* even when the source granted less."""
    state = LeaseState(ttl=30)
    state.start_acquiring()
    state.granted(Grant(fenced.FencingToken("x", 1), "r", 3.0, 100.0))
    assert state.renew_delay(100.0) <= 1.0 + 1e-9  # a third of the 3 s actually granted
    assert state.renew_delay(100.0) < state.remaining(100.0)
    state.renew_failed(100.5)
    assert state.renew_delay(100.5) <= 0.3 + 1e-9  # and retries at a tenth of it


def test_keepalive_holds_a_lease_the_source_shortened(
    register_scheme: Callable[[str, str], None],
) -> None:
    _register(register_scheme, CappedSource)
    with fenced.connect("capped://review-capped") as locks:
        lease = locks.lock("x", ttl=3)
        lease.acquire()
        # Held for 3x the granted 0.6 s: it is renewed in time, not declared lost at 0.55 s.
        assert not lease.lost.wait(1.8), lease.lost_cause
        assert lease.held
        assert lease.release()
    MemoryBackend.reset("review-capped")


async def test_late_renew_failure_of_an_old_grant_does_not_lose_the_new_one(
    register_scheme: Callable[[str, str], None],
) -> None:
    """Bug: a renew() in flight across release()+acquire() marked the *new* grant lost."""
    _register(register_scheme, GatedSource)
    GatedSource.gate = asyncio.Event()
    try:
        async with fenced.connect_async("gated://review-gated") as locks:
            lease = locks.lock("x", ttl=30, auto_renew=False)
            first = await lease.acquire()
            renewing = asyncio.create_task(lease.renew())
            await asyncio.sleep(0)  # let it reach the gate
            await lease.release()
            second = await lease.acquire()
            assert second > first
            GatedSource.gate.set()
            with pytest.raises(fenced.LeaseLostError):
                await renewing  # the old grant is gone: that renewal fails ...
            assert not lease.lost.is_set()  # ... but the new grant is not lost
            assert lease.phase is Phase.HELD and lease.held and lease.token == second
            assert await lease.release()
    finally:
        GatedSource.gate = None
        MemoryBackend.reset("review-gated")


async def test_late_renew_failure_of_the_current_grant_still_loses_it(
    register_scheme: Callable[[str, str], None],
) -> None:
    """The fix above must not hide a real loss: the renewed copy of a grant is the same grant."""
    _register(register_scheme, GatedSource)
    gate = GatedSource.gate = asyncio.Event()
    try:
        async with fenced.connect_async("gated://review-gated2") as locks:
            lease = locks.lock("x", ttl=30, auto_renew=False)
            await lease.acquire()
            slow = asyncio.create_task(lease.renew())
            await asyncio.sleep(0)  # let it reach the gate
            GatedSource.gate = None
            await lease.renew()  # a later renewal replaces the grant with its renewed copy
            backend = locks.backend
            assert isinstance(backend, MemoryBackend)
            backend._store.locks["x"].holder = None  # the source revokes the grant
            gate.set()
            with pytest.raises(fenced.LeaseLostError):
                await slow
            assert lease.lost.is_set() and lease.phase is Phase.LOST
    finally:
        GatedSource.gate = None
        MemoryBackend.reset("review-gated2")


async def test_reacquire_with_the_same_request_id_is_not_lost_by_the_old_grants_expiry(
    memory_url: str,
) -> None:
    """Bug: the source's lost-notification for the expired first grant (same request id)
    arrived just after the second grant and marked the new grant lost."""
    async with fenced.connect_async(memory_url) as locks:
        lease = locks.lock("x", ttl=0.3, auto_renew=False, request_id="job-1")
        first = await lease.acquire()
        server_expiry = _clock.now() + 0.3
        await asyncio.wait_for(lease.lost.wait(), 5)  # the local watchdog: lost
        while _clock.now() <= server_expiry:  # bounded: the source's own expiry passes too
            await asyncio.sleep(0.01)
        second = await lease.acquire(timeout=5)  # the source expires the first grant now
        assert second > first
        await asyncio.sleep(0)  # let the notification about the first grant arrive
        await asyncio.sleep(0)
        assert not lease.lost.is_set(), lease.lost.cause
        assert lease.held
        assert await lease.release()


async def test_aclose_fails_an_acquire_in_flight_promptly(memory_url: str) -> None:
    """Bug: an acquire queued on a connection being closed waited for the holder's expiry
    (forever, while it renews) and then retried on the closed connection."""
    async with fenced.connect_async(memory_url) as holder:
        held = holder.lock("x", ttl=30)
        await held.acquire()
        locks = await fenced.connect_async(memory_url).open()
        task = asyncio.create_task(locks.lock("x", ttl=30).acquire())

        async def queued() -> bool:
            return (await holder.status("x")).waiters == 1

        await async_wait_for(queued, what="the waiter to queue")
        await locks.aclose()
        with pytest.raises(fenced.BackendUnavailable):
            await asyncio.wait_for(task, 3)
        assert (await holder.status("x")).waiters == 0
        assert held.held


# -- the CLI -----------------------------------------------------------------------------------

_CLI_WITH_TEST_SOURCE = (
    "import sys\n"
    "from fenced import _backend\n"
    "_backend.register_backend('goneaftergrant', 'tests.test_review_core:GoneAfterGrantSource')\n"
    "from fenced.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _fenced_lock(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    return subprocess.run(
        [sys.executable, "-c", _CLI_WITH_TEST_SOURCE, "lock", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_lost_lease_exits_75_even_if_release_fails() -> None:
    """Bug: the failed release in ``finally`` replaced the documented 75 with 69."""
    out = _fenced_lock(
        ["x", "--url", "goneaftergrant://cli", "--ttl", "0.5", "--grace", "1", "--", "sleep", "30"]
    )
    assert out.returncode == 75, (out.returncode, out.stderr)
    assert "lost" in out.stderr


def test_cli_keeps_the_commands_status_if_only_the_release_fails() -> None:
    """The command ran to its end with the lease held: its status counts, with a warning."""
    out = _fenced_lock(["x", "--url", "goneaftergrant://cli", "--", "sh", "-c", "exit 3"])
    assert out.returncode == 3, (out.returncode, out.stderr)
    assert "release" in out.stderr


def test_cli_ctrl_c_right_after_the_command_started_stops_the_command(
    monkeypatch: pytest.MonkeyPatch, memory_url: str
) -> None:
    """Bug: the signal handlers were installed only after the command started: a Ctrl-C in
    between ended `fenced lock` (releasing the lock) and left the command running unlocked.
    The Ctrl-C is delivered deterministically, the instant Popen returns."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    from fenced import cli

    started: list[subprocess.Popen[bytes]] = []

    class InterruptedRightAfterStart(subprocess.Popen[bytes]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(cli.subprocess, "Popen", InterruptedRightAfterStart)
    code: int | None = None
    try:
        try:
            code = cli.main(["lock", "x", "--url", memory_url, "--", "sleep", "30"])
        except KeyboardInterrupt:
            code = None
        assert started
        assert started[0].poll() is not None, "the command was left running without the lock"
        assert code == 128 + signal.SIGINT  # it was passed the Ctrl-C, and died of it
        with fenced.connect(memory_url) as locks:
            assert locks.status("x").holder is None
    finally:
        for child in started:
            if child.poll() is None:
                child.kill()
                child.wait()


# -- the SQL row guard -----------------------------------------------------------------------


def _jobs_with_text_token_column() -> sqlite3.Connection:
    """A table whose token column the application made itself, as TEXT."""
    db = sqlite3.connect(":memory:", isolation_level=None)
    db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, state TEXT, fencing_token TEXT)")
    db.execute("INSERT INTO jobs (id, state) VALUES (1, 'new')")
    return db


def _stale_write_is_refused(db: sqlite3.Connection, guard: RowGuard) -> bool:
    """The checker: after token 10 wrote, token 3 is refused and 10's data is intact."""
    guard.update(db, "jobs:10", key={"id": 1}, values={"state": "by 10"})
    try:
        guard.update(db, "jobs:3", key={"id": 1}, values={"state": "by 3 (stale)"})
    except fenced.StaleTokenError as exc:
        assert exc.high_water == fenced.FencingToken("jobs", 10)
        return bool(db.execute("SELECT state FROM jobs").fetchone()[0] == "by 10")
    return False


def test_row_guard_on_a_text_token_column_refuses_stale_tokens() -> None:
    """Bug: SQLite compared a TEXT token column as text ('10' <= '3'): jobs:3 overwrote jobs:10."""
    db = _jobs_with_text_token_column()
    guard = RowGuard("jobs", lock="jobs")
    assert _stale_write_is_refused(db, guard)
    assert guard.high_water(db, {"id": 1}) == fenced.FencingToken("jobs", 10)


def test_text_comparison_planted_back_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker above fails on the unfixed comparison (the planted bug)."""
    monkeypatch.setattr(_sql_plan, "_as_int", lambda _d, expr, stored=False: expr)
    _sql_plan._row_write_sql.cache_clear()
    try:
        assert not _stale_write_is_refused(_jobs_with_text_token_column(), RowGuard("jobs"))
    finally:
        _sql_plan._row_write_sql.cache_clear()


def test_row_guard_install_refuses_a_token_column_that_cannot_hold_tokens() -> None:
    with pytest.raises(fenced.ConfigurationError, match="64-bit integer"):
        RowGuard("jobs").install(_jobs_with_text_token_column())
    db = sqlite3.connect(":memory:", isolation_level=None)
    db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, fencing_token BIGINT)")
    RowGuard("jobs").install(db)  # any INTEGER-affinity type is fine


def test_row_guard_install_refuses_narrow_or_text_token_columns_on_postgresql(
    pg_dsn: str,
) -> None:
    """text <= bigint raised a raw psycopg error at every write; int4 overflowed at 2**31
    (a ZooKeeper zxid token is above 2**32): install now says so, as ConfigurationError."""
    import psycopg

    with psycopg.connect(pg_dsn, autocommit=True) as db:
        for type_ in ("TEXT", "INTEGER", "DOUBLE PRECISION"):
            db.execute("DROP TABLE IF EXISTS jobs")
            db.execute(f"CREATE TABLE jobs (id INTEGER PRIMARY KEY, fencing_token {type_})")
            with pytest.raises(fenced.ConfigurationError, match="64-bit integer"):
                RowGuard("jobs").install(db)
        db.execute("DROP TABLE jobs")
        db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, fencing_token BIGINT)")
        RowGuard("jobs").install(db)
        db.execute("INSERT INTO jobs (id) VALUES (1)")
        big = fenced.FencingToken("jobs", fenced.MAX_TOKEN)
        assert RowGuard("jobs").update(db, big, key={"id": 1}) == big
