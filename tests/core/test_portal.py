"""The portal: how synchronous calls reach fenced's event loop, and the caller-driven path.

A portal made with ``drive=True`` (the sync API on sources that declare ``caller_driven``)
runs, in its fast mode, a call on the caller's thread while its loop thread is idle, and hands
it to the loop thread when it must wait. Each test runs with the fast mode on and forced off
(``FENCED_PORTAL=portable``: public asyncio only); those about the fast path also run against
a planted bug in it, to show they can fail.
"""

from __future__ import annotations

import ast
import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fenced
from fenced._core import portal as _portal
from fenced._core import portal_fast as _portal_fast
from fenced._core.errors import ConfigurationError
from fenced._core.portal import Portal
from fenced.backends.etcd import EtcdBackend
from fenced.backends.memory import MemoryBackend
from fenced.backends.sqlite import SQLiteBackend
from fenced.backends.zookeeper import ZooKeeperBackend
from tests.helpers import bounded, wait_for
from tests.sources.variants import InterruptedAfterGrant, ReleaseFindsItGone, register_source


@pytest.fixture
def portal(portal_mode: str) -> Iterator[Portal]:
    p = Portal("fenced-test", drive=True)
    assert p.drive == (portal_mode == "fast")
    yield p
    p.stop()


def _fast_only(portal_mode: str, planted: bool) -> None:
    if planted and portal_mode != "fast":
        pytest.skip("the planted bug is in the fast mode's path")


def _caller_or_loop(portal: Portal) -> int | None:
    """The thread that runs a call while the loop is idle: the caller's in the fast mode."""
    return threading.get_ident() if portal.drive else portal.thread.ident


def _wait_until_idle(portal: Portal) -> None:
    """Until the loop thread waits in select() (its plan made, the loop's lock given up) with
    no wake-up on its way: a call it runs first drains any wake-up already sent."""
    portal.run_sync(lambda: None)
    fast = portal._fast
    if fast is None:
        return  # (portable: every call goes to the loop thread anyway)
    wait_for(
        lambda: fast.selector.wakes_at > 0 and not fast.lock.locked(),
        what="the loop thread to wait",
    )


async def _ident() -> int:
    return threading.get_ident()


def test_sources_that_declare_it_are_driven_by_the_caller() -> None:
    assert SQLiteBackend.caller_driven and MemoryBackend.caller_driven
    # Client libraries with threads or loop hooks of their own stay on the loop thread.
    assert not EtcdBackend.caller_driven and not ZooKeeperBackend.caller_driven


def test_a_call_runs_on_the_callers_thread_while_the_loop_is_idle(portal: Portal) -> None:
    assert portal.call(_ident()) == _caller_or_loop(portal)
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
    assert before == _caller_or_loop(portal) and after == portal.thread.ident


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
    assert second == [portal.thread.ident]
    assert first == [holder.ident if portal.drive else portal.thread.ident]


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-never-wakes"])
def test_a_timer_armed_by_a_driven_call_wakes_the_loop_thread(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, planted: bool, portal_mode: str
) -> None:
    """A keepalive armed while the caller ran the loop must still fire: the loop thread was
    asleep with no deadline, and only the caller knew of the new timer."""
    _fast_only(portal_mode, planted)
    if planted:
        monkeypatch.setattr(_portal_fast.FastLoop, "needs_loop_thread", lambda self, q: False)
    with fenced.connect(sqlite_url) as locks:
        assert locks._portal.drive == (portal_mode == "fast")
        # (ttl 1 s, not 0.4: a renewal two thirds of a second late still lands in time, as
        # one may on a loaded machine; the planted loop thread never renews at all)
        lease = locks.lock("x", ttl=1.0)
        lease.acquire()
        lost = lease.lost.wait(3.5)  # three and a half lease lengths, with no call meanwhile
        if planted:
            assert not lease.held  # never renewed: the planted bug is caught
            # (taken out before close(), whose release bound is a timer the planted bug
            # would never fire either)
            monkeypatch.undo()
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
    portal_mode: str,
) -> None:
    """SIGINT between the source's grant and the client's record of it (on the caller's own
    thread) is held back to the end of the call: the call raises KeyboardInterrupt and the
    grant is given back, as when Ctrl-C hits a caller waiting for the loop thread."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    _fast_only(portal_mode, planted)
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
    portal: Portal, monkeypatch: pytest.MonkeyPatch, planted: bool, portal_mode: str
) -> None:
    """Bug (CI, `fenced lock` on a busy lock): Ctrl-C struck while the caller drove its acquire
    (queued at the source by then), was held back, and the caller then waited for the grant,
    which never came: the process hung. A held-back Ctrl-C ends the call before it waits."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    if portal_mode != "fast":
        # Nothing is driven there: the coroutine runs on the loop thread, and a signal raised
        # on that thread reaches the waiting main thread only when its wait ends.
        pytest.skip("a Ctrl-C held back while driving: the fast mode's path")
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
    portal_mode: str,
) -> None:
    """on_lost may run on the thread whose call found the loss (here: release); a blocking
    fenced call from it would wait for the loop that thread is running."""
    _fast_only(portal_mode, planted)
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


@pytest.mark.usefixtures("portal_mode")
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
    assert not portal.closed and portal.call(_ident()) == _caller_or_loop(portal)


def test_sigint_handler_is_restored_after_a_call(portal: Portal) -> None:
    before = signal.getsignal(signal.SIGINT)
    portal.call(_ident())
    assert signal.getsignal(signal.SIGINT) is before


# -- the fast mode's probe, and the portable mode it falls back to ------------------------------


def test_the_probe_accepts_this_pythons_selector_loop_and_refuses_others() -> None:
    assert _portal_fast.probe(asyncio.SelectorEventLoop)
    uvloop = pytest.importorskip("uvloop")  # a loop without CPython's internals
    assert not _portal_fast.probe(uvloop.new_event_loop)


def test_a_failed_probe_falls_back_to_the_portable_mode(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an asyncio whose internals are not as expected (here: the self-pipe's private name
    gone, as a later Python might rename it) the probe fails and the portal works without
    them: calls go to the loop thread, locks are granted and released."""
    monkeypatch.delenv("FENCED_PORTAL", raising=False)
    _portal_fast.available.cache_clear()
    try:
        with monkeypatch.context() as m:
            m.delattr(asyncio.selector_events.BaseSelectorEventLoop, "_write_to_self")
            m.delattr(asyncio.base_events.BaseEventLoop, "_write_to_self")
            assert not _portal_fast.available()
        portal = Portal("fenced-test-fallback", drive=True)
        try:
            assert not portal.drive
            assert portal.call(_ident()) == portal.thread.ident
        finally:
            portal.stop()
        with fenced.connect(sqlite_url) as locks:
            assert not locks._portal.drive
            with locks.lock("x", ttl=5) as lease:
                assert lease.token.value == 1
            assert locks.status("x").holder is None
    finally:
        _portal_fast.available.cache_clear()
    assert _portal_fast.available()  # the real probe passes again


def test_an_unknown_portal_mode_is_a_clear_error(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCED_PORTAL", "turbo")
    with pytest.raises(ConfigurationError, match="FENCED_PORTAL must be 'fast' or 'portable'"):
        fenced.connect(sqlite_url)
    with pytest.raises(ConfigurationError, match="FENCED_PORTAL must be"):
        Portal("fenced-test")  # (a portal that would not drive anyway)
    with pytest.raises(ConfigurationError, match="mode must be"):
        Portal("fenced-test", drive=True, mode="turbo")  # type: ignore[arg-type]
    monkeypatch.setenv("FENCED_PORTAL", "portable")
    portal = Portal("fenced-test", drive=True, mode="fast")  # the argument wins
    try:
        assert portal.drive
    finally:
        portal.stop()


# -- the fast mode is the only place that touches asyncio's private names -----------------------

_LOOP_INTERNALS = {"_ready", "_scheduled", "_write_to_self", "_timer_cancelled_count", "_callback"}
_LOOP_INTERNALS |= {"_selector"}
# Outside the core, and said in docs/design.md: the SQLite source asks which loop runs it
# (asyncio exports the name for other loops), the simulator's virtual-time loop is a loop.
_ELSEWHERE = {
    "fenced/backends/_sqlite_executor.py": {"asyncio._get_running_loop"},
    # The simulator's own loop (a subclass of asyncio's base loop, run on the Python the
    # suite pins; its handles are made in one frame for speed: docs/benchmarks.md).
    "fenced/testing/sim/_loop.py": {
        "timer._scheduled",
        "handle._scheduled",
        "heapq.heappop(timers)[2]._scheduled",
        "pop(timers)[2]._scheduled",
        "handle._callback",
    },
}


def _asyncio_private_uses(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue  # fenced's own attributes
        on_asyncio = isinstance(base, ast.Name) and base.id == "asyncio"
        if on_asyncio or node.attr in _LOOP_INTERNALS:
            found.add(ast.unparse(node))
    return found


def test_only_the_fast_mode_touches_asyncios_private_names() -> None:
    root = Path(fenced.__file__).parent
    assert _asyncio_private_uses(
        (root / "_core" / "portal_fast.py").read_text()
    )  # (the scan sees them)
    assert _asyncio_private_uses("loop._ready.append(h)\nasyncio._set_running_loop(x)") == {
        "loop._ready",
        "asyncio._set_running_loop",
    }
    found = {}
    for path in sorted(root.rglob("*.py")):
        where = "fenced/" + path.relative_to(root).as_posix()
        if where == "fenced/_core/portal_fast.py":
            continue
        uses = _asyncio_private_uses(path.read_text()) - _ELSEWHERE.get(where, set())
        if uses:
            found[where] = sorted(uses)
    assert not found, found
