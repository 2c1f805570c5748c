"""The lease core with no real source: state machine timing, keepalive, loss, retries."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import fenced
from fenced._core import backend as _backend
from fenced._core import clock as _clock
from fenced._core.backend import Backend, Characteristic, Grant, LockStatus
from fenced._core.state import LeaseState, Phase
from fenced.backends.memory import MemoryBackend
from tests.helpers import async_wait_for, bounded, dead_port, wait_for
from tests.sources.variants import (
    CappedSource,
    FlakyBackend,
    GatedSource,
    LateReplies,
    register_source,
)

# The sync facade's cases run with the portal's fast mode on and forced off (``_portal``).
pytestmark = pytest.mark.usefixtures("portal_mode")


def _grant(sent_at: float, ttl: float = 10.0) -> Grant:
    return Grant(fenced.FencingToken("x", 1), "r", ttl, sent_at)


def test_remaining_counts_from_when_the_request_was_sent() -> None:
    state = LeaseState(ttl=10, safety_margin=0.5)
    state.start_acquiring()
    state.granted(_grant(sent_at=100.0))
    assert state.remaining(100.0) == pytest.approx(9.5)
    assert state.remaining(109.0) == pytest.approx(0.5)
    assert state.remaining(109.5) == 0
    # A renewal only ever moves the expiry forward, even if replies arrive out of order.
    state.renewed(_grant(sent_at=105.0))
    state.renewed(_grant(sent_at=103.0))
    assert state.remaining(105.0) == pytest.approx(9.5)
    # The server may grant a shorter lease than asked: the shorter one counts.
    state.renewed(_grant(sent_at=106.0, ttl=2.0))
    assert state.remaining(106.0) == pytest.approx(1.5)


def test_state_transitions() -> None:
    state = LeaseState(ttl=1)
    assert state.remaining(0) == 0 and state.phase is Phase.IDLE
    state.start_acquiring()
    with pytest.raises(fenced.LockError):
        state.start_acquiring()
    state.granted(_grant(0.0, 1.0))
    assert state.lose(fenced.LeaseLostError("x")) is True
    assert state.lose(fenced.LeaseLostError("again")) is False  # fires once
    assert state.remaining(0.0) == 0
    state.released()
    state.start_acquiring()
    state.acquire_failed()
    assert state.phase is Phase.IDLE


def test_default_safety_margin() -> None:
    assert LeaseState(10).safety_margin == pytest.approx(0.15)
    assert LeaseState(0.1).safety_margin == pytest.approx(0.025)
    with pytest.raises(ValueError):
        LeaseState(0)
    with pytest.raises(ValueError):
        LeaseState(1, safety_margin=1)


@pytest.fixture
def flaky(register_scheme: Callable[[str, str], None], memory_url: str) -> str:
    register_scheme("flaky", "tests.sources.variants:FlakyBackend")
    FlakyBackend.fail_renew = False
    FlakyBackend.fail_acquires = 0
    FlakyBackend.acquire_calls = []
    return memory_url.replace("memory://", "flaky://")


def test_lost_reply_retry_is_idempotent(flaky: str) -> None:
    """A grant whose reply was lost is found again by the retry, not taken twice."""
    FlakyBackend.fail_acquires = 2
    with fenced.connect(flaky) as locks, locks.lock("x", ttl=5) as lease:
        assert lease.token.value == 1
        assert len(set(FlakyBackend.acquire_calls)) == 1 and len(FlakyBackend.acquire_calls) == 3
        assert locks.status("x").last_token == lease.token


def test_unreachable_source_while_held_means_lost(flaky: str) -> None:
    with fenced.connect(flaky) as locks:
        lease = locks.lock("x", ttl=0.6)
        lease.acquire()
        FlakyBackend.fail_renew = True
        assert lease.lost.wait(5)
        assert isinstance(lease.lost_cause, fenced.LeaseLostError)
        assert not lease.held


def test_keepalive_survives_a_short_outage(flaky: str) -> None:
    with fenced.connect(flaky) as locks:
        lease = locks.lock("x", ttl=2)
        lease.acquire()
        FlakyBackend.fail_renew = True
        assert not lease.lost.wait(0.8)  # two renewal attempts failed, lease still valid
        FlakyBackend.fail_renew = False
        assert not lease.lost.wait(2.5)  # renewed again before it ran out
        assert lease.held
        lease.release()


async def test_remaining_never_exceeds_ttl_from_send(memory_url: str) -> None:
    async with fenced.connect_async(memory_url) as locks:
        before = _clock.now()
        lease = locks.lock("x", ttl=3)
        await lease.acquire()
        assert lease.remaining() <= 3 - (_clock.now() - before) + 1e-6
        await lease.release()
        assert lease.remaining() == 0 and not lease.held


async def test_lost_signal_is_awaitable(memory_url: str) -> None:
    async with fenced.connect_async(memory_url) as locks:
        lease = locks.lock("x", ttl=0.3, auto_renew=False)
        await lease.acquire()
        cause = await asyncio.wait_for(lease.lost, 5)
        assert isinstance(cause, fenced.LeaseLostError)


def test_never_acquired_token_is_an_error(memory_url: str) -> None:
    with fenced.connect(memory_url) as locks:
        lease = locks.lock("x")
        with pytest.raises(fenced.NotHeldError):
            _ = lease.token
        with pytest.raises(fenced.NotHeldError):
            lease.renew()
        assert lease.release() is False


def test_close_releases_held_leases(memory_url: str) -> None:
    locks = fenced.connect(memory_url)
    lease = locks.lock("x", ttl=30)
    lease.acquire()
    locks.close()
    with fenced.connect(memory_url) as other:
        assert other.status("x").holder is None


def test_unknown_scheme_and_bad_url() -> None:
    with pytest.raises(fenced.ConfigurationError, match="unknown token source scheme"):
        fenced.connect("nosuch://x")
    with pytest.raises(fenced.ConfigurationError):
        fenced.connect("not a url")
    with pytest.raises(fenced.ConfigurationError, match="unknown characteristic"):
        fenced.connect("memory://x", require={"fast"})


def test_characteristics_are_declared_for_every_scheme() -> None:
    """Every registered module exists and declares what it promises (no silent gaps)."""
    for scheme in _backend.known_schemes():
        cls = _backend.backend_class(f"{scheme}://x")
        assert issubclass(cls, Backend)
        assert isinstance(cls.characteristics, frozenset)
        assert all(isinstance(c, Characteristic) for c in cls.characteristics)


def test_lock_status_fields() -> None:
    fields = {f.name for f in dataclasses.fields(LockStatus)}
    assert {"name", "holder", "token", "last_token", "remaining", "waiters"} <= fields


def test_release_that_finds_the_grant_gone_reports_the_loss(
    register_scheme: Callable[[str, str], None], memory_url: str
) -> None:
    register_scheme("gone", "tests.sources.variants:ReleaseFindsItGone")
    seen: list[fenced.Lease] = []
    with fenced.connect(memory_url.replace("memory://", "gone://")) as locks:
        lease = locks.lock("x", ttl=5, on_lost=seen.append)
        with pytest.raises(fenced.LeaseLostError, match="lost while held"):
            with lease:
                pass
        assert lease.lost.is_set() and seen == [lease]
        assert "when it was released" in str(lease.lost_cause)
        # A release that found nothing because it was already released says nothing.
        assert lease.release() is False and seen == [lease]


@pytest.mark.parametrize("late", [1, 2])
def test_acquire_never_returns_a_lease_with_no_time_left(
    register_scheme: Callable[[str, str], None], memory_url: str, late: int
) -> None:
    """A grant that arrives after its lease ran out is given back and asked for again
    (before: lock() returned it already lost, and `fenced lock` ran the command)."""
    register_scheme("late", "tests.sources.variants:LateReplies")
    LateReplies.late = late
    with fenced.connect(memory_url.replace("memory://", "late://")) as locks:
        with locks.lock("x", ttl=5, timeout=5) as lease:
            assert lease.remaining() > 0 and lease.held and not lease.lost.is_set()
            assert lease.token.value == late + 1  # the late grants were released, not kept
            assert locks.status("x").token == lease.token


def test_acquire_gives_up_when_every_grant_arrives_too_late(
    register_scheme: Callable[[str, str], None], memory_url: str
) -> None:
    register_scheme("late", "tests.sources.variants:LateReplies")
    LateReplies.late = 10
    with fenced.connect(memory_url.replace("memory://", "late://")) as locks:
        lease = locks.lock("x", ttl=5, timeout=5)
        with pytest.raises(fenced.LeaseLostError, match="too short"):
            lease.acquire()
        assert not lease.held
        assert locks.status("x").holder is None  # nothing left behind
    LateReplies.late = 0


@pytest.mark.parametrize(
    "ttl", [0, -1, 0.001, 0.099, 86_401, 1e12, 1e300, float("inf"), float("nan"), "5", True]
)
def test_absurd_ttls_are_configuration_errors(memory_url: str, ttl: Any) -> None:
    with fenced.connect(memory_url) as locks, pytest.raises(fenced.ConfigurationError, match="ttl"):
        locks.lock("x", ttl=ttl)


@pytest.mark.parametrize("timeout", [-1, 1e12, float("inf"), float("nan"), "3"])
def test_absurd_timeouts_are_configuration_errors(memory_url: str, timeout: Any) -> None:
    with fenced.connect(memory_url) as locks:
        with pytest.raises(fenced.ConfigurationError, match="timeout"):
            locks.lock("x", timeout=timeout)
        lease = locks.lock("x")
        with pytest.raises(fenced.ConfigurationError, match="timeout"):
            lease.acquire(timeout=timeout)


def test_a_scheme_registered_by_entry_point_is_used(tmp_path: Any) -> None:
    """A third party adds a token source through the ``fenced.backends`` entry-point group."""
    dist = tmp_path / "fenced_plugin_demo-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fenced-plugin-demo\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[fenced.backends]\nplugmem = fenced.backends.memory:MemoryBackend\n"
        # A distribution cannot take one of fenced's own schemes over (and a built-in scheme
        # is found without scanning the installed distributions at all).
        "sqlite = fenced.backends.memory:MemoryBackend\n"
    )
    code = (
        "import fenced\n"
        "from fenced._core.backend import backend_class\n"
        "assert backend_class('sqlite:///x.db').__name__ == 'SQLiteBackend'\n"
        "with fenced.connect('plugmem://x') as locks, locks.lock('j') as lease:\n"
        "    print(lease.token)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "j:1"
    with pytest.raises(fenced.ConfigurationError, match="unknown token source scheme 'plugmem'"):
        fenced.connect("plugmem://x")  # not installed in this process


@pytest.mark.parametrize(
    "url",
    [
        "redis://[::1",
        "postgresql://[",
        "etcd://[::1",
        "memory://x?bogus=1",
        "memory://x?a&b",
        "redis://127.0.0.1:6379/abc",
        "redis://127.0.0.1:6379/0?socket_timeout=-1",
        "postgresql://u@127.0.0.1:5432/db?bogus=1",
        "zookeeper://127.0.0.1:2181/app\x00x",
        "zookeeper://127.0.0.1:2181/a/\ud800",
        "sqlite:////tmp/x.db?busy_timeout=nan",
        "etcd://127.0.0.1:2379?lease_pool=-1",
    ],
)
async def test_bad_urls_are_configuration_errors_sync_and_async(url: str) -> None:
    """Before: raw ValueError (urlsplit), BackendUnavailable (libpq, ZooKeeper) or accepted."""
    with pytest.raises(fenced.ConfigurationError):
        fenced.connect(url, connect_timeout=2)
    with pytest.raises(fenced.ConfigurationError):
        async with fenced.connect_async(url, connect_timeout=2):
            pass


def test_keyword_options_must_have_their_type(memory_url: str, tmp_path: Any) -> None:
    url = f"sqlite:///{tmp_path}/x.db"
    with pytest.raises(fenced.ConfigurationError, match="not text"):
        fenced.connect(url, busy_timeout="5")
    with pytest.raises(fenced.ConfigurationError, match="connect_timeout"):
        fenced.connect(url, connect_timeout=-1)
    with fenced.connect(url + "?busy_timeout=3", busy_timeout=4.0) as locks:  # keyword wins
        assert locks.aio.backend._busy_timeout == 4.0  # type: ignore[attr-defined]


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
        bounded(locks.close)
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
    assert bounded(lambda: locks.status("x")).name == "x"
    bounded(locks.close)
    with pytest.raises(fenced.BackendUnavailable):
        bounded(lambda: locks.status("x"))


@pytest.mark.usefixtures("sigint_raises")
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
    register_source(register_scheme, CappedSource)
    with fenced.connect("capped://review-capped") as locks:
        lease = locks.lock("x", ttl=6)
        lease.acquire()
        # Held for 3x the granted 1.2 s: it is renewed in time (every 0.4 s), not a third of
        # the 6 s asked for (2 s), past the grant's end. (1.2 s, not 0.6: a renewal may be
        # 0.8 s late on a loaded machine and still land in time.)
        assert not lease.lost.wait(3.6), lease.lost_cause
        assert lease.held
        assert lease.release()
    MemoryBackend.reset("review-capped")


async def test_late_renew_failure_of_an_old_grant_does_not_lose_the_new_one(
    register_scheme: Callable[[str, str], None],
) -> None:
    """Bug: a renew() in flight across release()+acquire() marked the *new* grant lost."""
    register_source(register_scheme, GatedSource)
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
    register_source(register_scheme, GatedSource)
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


async def test_an_unopened_async_connection_opens_within_the_acquires_timeout() -> None:
    """Connecting counts against the acquire's timeout (not the 10 s connect_timeout)."""
    with dead_port() as port:
        locks = fenced.connect_async(f"redis://127.0.0.1:{port}/0")
        start = asyncio.get_running_loop().time()
        with pytest.raises(fenced.BackendUnavailable):
            await locks.lock("x", ttl=5).acquire(timeout=1.0)
        took = asyncio.get_running_loop().time() - start
    assert 0.9 <= took < 4.0, took
    await locks.aclose()


def test_demo_output_without_rich(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """rich is only in the cli extra: without it the demo's printer writes plain text."""
    import sys as _sys

    from fenced.cli import _console

    monkeypatch.setitem(_sys.modules, "rich.console", None)
    monkeypatch.setitem(_sys.modules, "rich.panel", None)
    printer = _console.make_printer()
    printer.print("[bold]fenced demo[/bold]: [red]paused[/red] " + str(_console.panel("Run 1")))
    assert capsys.readouterr().out == "fenced demo: paused == Run 1 ==\n"


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-no-null-handler"])
def test_the_library_prints_nothing_in_an_application_without_logging(planted: bool) -> None:
    """Bug: a lost lease's warning reached stderr through Python's last-resort handler in an
    application that configured no logging (and the CLI then reported the loss twice)."""
    code = (
        "import logging, fenced\n"
        + ("logging.getLogger('fenced').handlers.clear()\n" if planted else "")
        + "with fenced.connect('memory://quiet') as locks:\n"
        "    lease = locks.lock('x', ttl=0.2, auto_renew=False)\n"
        "    lease.acquire()\n"
        "    assert lease.lost.wait(5)\n"
        "print('lost')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0 and out.stdout == "lost\n", out.stderr
    if planted:
        assert "lost" in out.stderr  # the planted bug is caught
    else:
        assert out.stderr == ""


def test_cli_output_is_not_hard_wrapped_when_piped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: rich wrapped messages at 80 columns even when stdout was not a terminal."""
    pytest.importorskip("rich")
    import io

    from fenced.cli._console import make_printer

    buffer = io.StringIO()
    monkeypatch.setattr(sys, "stdout", buffer)
    line = "word " * 60
    make_printer().print(line)
    assert buffer.getvalue().count("\n") == 1


def test_an_acquire_refused_in_a_lost_lease_callback_leaves_the_lease_lost() -> None:
    """A blocking call from ``on_lost`` is refused (it would wait for itself); being refused,
    it changes nothing: ``lease.lost`` stays set (it was cleared before the refusal)."""
    refused: list[BaseException] = []

    def on_lost(lease: fenced.Lease) -> None:
        try:
            lease.acquire(timeout=0)
        except RuntimeError as exc:
            refused.append(exc)

    with fenced.connect("memory://") as locks:
        lease = locks.lock("refused-in-callback", ttl=0.2, auto_renew=False, on_lost=on_lost)
        lease.acquire()
        assert lease.lost.wait(10)
        wait_for(lambda: refused, what="the callback's acquire to be refused")
        assert "event loop" in str(refused[0])
        assert lease.lost.is_set() and not lease.held
