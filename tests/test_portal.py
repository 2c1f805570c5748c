"""The portal: how synchronous calls reach fenced's event loop, and the caller-driven path.

A portal made with ``drive=True`` (the sync API on sources that declare ``caller_driven``)
runs a call on the caller's thread while its loop thread is idle, and hands it to the loop
thread when it must wait. Each test below also runs against a planted bug in that path, to
show it can fail.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import fenced
from fenced import _portal
from fenced._portal import Portal
from fenced.backends.etcd import EtcdBackend
from fenced.backends.memory import MemoryBackend
from fenced.backends.sqlite import SQLiteBackend
from fenced.backends.zookeeper import ZooKeeperBackend
from tests.helpers import bounded, wait_for
from tests.sources import InterruptedAfterGrant, ReleaseFindsItGone, register_source


@pytest.fixture
def portal() -> Iterator[Portal]:
    p = Portal("fenced-test", drive=True)
    assert p.drive, "this Python's asyncio lacks what caller-driven calls need"
    yield p
    p.stop()


def _wait_until_idle(portal: Portal) -> None:
    """Until the loop thread waits in select() (its plan made, the loop's lock given up) with
    no wake-up on its way: a call it runs first drains any wake-up already sent."""
    portal.run_sync(lambda: None)
    wait_for(
        lambda: portal._selector.wakes_at > 0 and not portal._loop_lock.locked(),
        what="the loop thread to wait",
    )


async def _ident() -> int:
    return threading.get_ident()


def test_sources_that_declare_it_are_driven_by_the_caller() -> None:
    assert SQLiteBackend.caller_driven and MemoryBackend.caller_driven
    # Client libraries with threads or loop hooks of their own stay on the loop thread.
    assert not EtcdBackend.caller_driven and not ZooKeeperBackend.caller_driven


def test_a_call_runs_on_the_callers_thread_while_the_loop_is_idle(portal: Portal) -> None:
    assert portal.call(_ident()) == threading.get_ident()
    hop = Portal("fenced-test-hop")
    try:
        assert hop.call(_ident()) == hop.thread.ident
    finally:
        hop.stop()


def test_a_call_that_must_wait_is_finished_by_the_loop_thread(portal: Portal) -> None:
    async def wait_then_ident() -> tuple[int, int]:
        before = threading.get_ident()
        await asyncio.sleep(0.01)  # a timer: only the loop thread waits for those
        return before, threading.get_ident()

    before, after = portal.call(wait_then_ident())
    assert before == threading.get_ident() and after == portal.thread.ident


def test_a_busy_loop_sends_other_callers_through_the_loop_thread(portal: Portal) -> None:
    """While one caller runs the loop's work, another's call goes by the loop thread, and
    both finish."""
    inside, go = threading.Event(), threading.Event()

    async def hold_the_loop() -> int:
        inside.set()
        assert go.wait(5)  # blocks inline, holding the loop, as an SQLite transaction may
        return threading.get_ident()

    first: list[int] = []
    holder = threading.Thread(target=lambda: first.append(portal.call(hold_the_loop())))
    holder.start()
    assert inside.wait(5)
    second: list[int] = []
    other = threading.Thread(target=lambda: second.append(portal.call(_ident())))
    other.start()
    wait_for(lambda: len(portal.loop._ready) > 0, what="the second call to be queued")  # type: ignore[attr-defined]
    go.set()
    holder.join(5)
    other.join(5)
    assert first == [holder.ident] and second == [portal.thread.ident]


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-never-wakes"])
def test_a_timer_armed_by_a_driven_call_wakes_the_loop_thread(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, planted: bool
) -> None:
    """A keepalive armed while the caller ran the loop must still fire: the loop thread was
    asleep with no deadline, and only the caller knew of the new timer."""
    if planted:
        monkeypatch.setattr(Portal, "_needs_loop_thread", lambda self, loop, queued: False)
    with fenced.connect(sqlite_url) as locks:
        assert locks._portal.drive
        lease = locks.lock("x", ttl=0.4)
        lease.acquire()
        lost = lease.lost.wait(1.5)  # nearly four lease lengths, with no call meanwhile
        if planted:
            assert not lease.held  # never renewed: the planted bug is caught
        else:
            assert not lost and lease.held, lease.lost_cause
            assert lease.release()


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-sigint-inline"])
@pytest.mark.usefixtures("sigint_raises")
def test_ctrl_c_during_a_driven_acquire_never_leaves_the_grant_held(
    register_scheme: Callable[[str, str], None],
    memory_url: str,
    monkeypatch: pytest.MonkeyPatch,
    planted: bool,
) -> None:
    """SIGINT between the source's grant and the client's record of it (on the caller's own
    thread) is held back to the end of the call: the call raises KeyboardInterrupt and the
    grant is given back, as when Ctrl-C hits a caller waiting for the loop thread."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    if planted:
        monkeypatch.setattr(_portal._SigintGate, "enter", staticmethod(lambda ident: None))
    register_source(register_scheme, InterruptedAfterGrant)
    with fenced.connect(memory_url.replace("memory://", "sigint://")) as locks:
        lease = locks.lock("x", ttl=30)
        # The loop thread idle, so that this thread runs the acquire itself.
        _wait_until_idle(locks._portal)
        InterruptedAfterGrant.armed = True
        with pytest.raises(KeyboardInterrupt):
            lease.acquire()
        holder = locks.status("x").holder
        if planted:
            assert holder is not None  # raised mid-acquire: the grant is left held
        else:
            wait_for(lambda: locks.status("x").holder is None, what="the grant to be given back")
            assert not lease.held


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-held-sigint-waits"])
@pytest.mark.usefixtures("sigint_raises")
def test_ctrl_c_held_back_while_driving_stops_the_wait_that_follows(
    portal: Portal, monkeypatch: pytest.MonkeyPatch, planted: bool
) -> None:
    """Bug (CI, `fenced lock` on a busy lock): Ctrl-C struck while the caller drove its acquire
    (queued at the source by then), was held back, and the caller then waited for the grant,
    which never came: the process hung. A held-back Ctrl-C ends the call before it waits."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    if planted:

        def wait_begins(self: Any) -> bool:
            self.waiting = True
            return False

        monkeypatch.setattr(_portal._SigintGate, "wait_begins", wait_begins)
    finished: list[bool] = []

    async def queue_then_wait() -> None:
        signal.raise_signal(signal.SIGINT)  # on this (the driving, main) thread: held back
        await asyncio.sleep(2)  # the wait for a grant; only the loop thread waits for timers
        finished.append(True)

    _wait_until_idle(portal)
    with pytest.raises(KeyboardInterrupt):
        portal.call(queue_then_wait())
    if planted:
        assert finished == [True]  # it sat out the whole wait: caught
    else:
        assert finished == []  # cancelled without waiting


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-no-driver-check"])
def test_a_blocking_call_from_on_lost_on_a_driving_thread_fails_instead_of_hanging(
    register_scheme: Callable[[str, str], None],
    memory_url: str,
    monkeypatch: pytest.MonkeyPatch,
    planted: bool,
) -> None:
    """on_lost may run on the thread whose call found the loss (here: release); a blocking
    fenced call from it would wait for the loop that thread is running."""
    if planted:
        monkeypatch.setattr(
            Portal,
            "running_loop_code",
            lambda self, ident=None: threading.get_ident() == self._thread_id,
        )
    register_source(register_scheme, ReleaseFindsItGone)
    errors: list[BaseException] = []
    locks = fenced.connect(memory_url.replace("memory://", "gone://"))

    def on_lost(lease: fenced.Lease) -> None:
        try:
            locks.status("x")
        except BaseException as exc:
            errors.append(exc)

    lease = locks.lock("x", ttl=30, on_lost=on_lost)

    def acquire_and_release() -> bool:
        lease.acquire()
        # The loop thread idle (the acquire woke it to arm the keepalive), so that this
        # thread runs the release, and the on_lost it triggers, itself.
        _wait_until_idle(locks._portal)
        return lease.release()

    if planted:
        with pytest.raises(AssertionError, match="hung"):
            bounded(acquire_and_release, timeout=2)
        return  # the connection is wedged for good: that is the bug
    assert bounded(acquire_and_release) is False
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    locks.close()


def test_calls_from_many_threads_all_complete(sqlite_url: str) -> None:
    """Eight threads share one connection: driven calls, hops and the keepalive interleave."""
    with fenced.connect(sqlite_url) as locks:
        tokens: list[int] = []
        failures: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                for _ in range(25):
                    with locks.lock("shared", ttl=5, timeout=20) as lease:
                        tokens.append(lease.token.value)
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not failures and not any(t.is_alive() for t in threads)
        assert sorted(tokens) == list(range(1, 201))


def test_stop_from_a_driving_thread_is_refused(portal: Portal) -> None:
    async def stop_inside() -> Any:
        try:
            portal.stop()
        except RuntimeError as exc:
            return exc
        return None

    assert isinstance(portal.call(stop_inside()), RuntimeError)
    assert not portal.closed and portal.call(_ident()) == threading.get_ident()


def test_sigint_handler_is_restored_after_a_driven_call(portal: Portal) -> None:
    before = signal.getsignal(signal.SIGINT)
    portal.call(_ident())
    assert signal.getsignal(signal.SIGINT) is before
