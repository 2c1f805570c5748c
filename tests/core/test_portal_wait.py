"""The portal's waiting callers: a sync call that waits for a reply drives the loop itself.

``Portal(drive=True, wait=True)`` (the sync API on Redis): a caller that finds the loop thread
idle takes the loop's selector out of the loop thread's wait (nested epoll), runs the whole
loop on its own thread until its call is done, waiting in ``select()`` itself, and hands the
loop back. The hard cases: other threads' calls while one drives, and the hand-over when the
driver leaves before them; a keepalive armed by a caller, fired by the loop thread while the
caller is in its own code; Ctrl-C in a driving main thread; replies waking only the driver.
Each against a planted bug, to show the test can fail.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import redis

import fenced
from fenced._core import portal as _portal
from fenced._core import portal_fast as _portal_fast
from fenced._core.errors import BackendUnavailable, LockTimeout
from fenced._core.portal import Portal
from fenced.backends.etcd import EtcdBackend
from fenced.backends.postgresql import PostgreSQLBackend
from fenced.backends.redis import RedisBackend
from fenced.backends.sqlite import SQLiteBackend
from fenced.backends.zookeeper import ZooKeeperBackend
from fenced.testing.servers import RedisServer
from tests.core.test_portal import (
    test_stop_from_a_driving_thread_is_refused as _stop_inside_refused,
)
from tests.helpers import bounded, unique_name, wait_for
from tests.sources.variants import InterruptedAfterGrant

pytestmark = pytest.mark.skipif(
    not _portal_fast.waiting_available(), reason="needs CPython's asyncio internals and epoll"
)


@pytest.fixture
def portal(monkeypatch: pytest.MonkeyPatch) -> Iterator[Portal]:
    monkeypatch.delenv("FENCED_PORTAL", raising=False)
    p = Portal("fenced-test-wait", drive=True, wait=True)
    assert p.waits
    yield p
    p.stop()


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A socket the call waits on, and the other end, from which the test sends its reply."""
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    yield ours, theirs
    ours.close()
    theirs.close()


def _selector(portal: Portal) -> _portal_fast.WaitingSelector:
    assert portal._fast is not None
    selector = portal._fast.selector
    assert isinstance(selector, _portal_fast.WaitingSelector)
    return selector


def _wait_until_idle(portal: Portal) -> None:
    """Until the loop thread sleeps in its wait, with no wake-up on its way."""
    portal.run_sync(lambda: None)
    fast = portal._fast
    assert fast is not None
    wait_for(lambda: fast.selector.wakes_at > 0 and not fast.lock.locked(), what="idle loop")


class Reply:
    """A call that records the threads it ran on and waits for one byte on ``sock``."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.started = threading.Event()
        self.threads: list[int] = []
        self.outcome: list[str] = []

    async def __call__(self) -> list[int]:
        self.threads.append(threading.get_ident())
        self.started.set()
        try:
            await asyncio.get_running_loop().sock_recv(self.sock, 1)
        except asyncio.CancelledError:
            self.outcome.append("cancelled")
            raise
        self.outcome.append("replied")
        self.threads.append(threading.get_ident())
        return self.threads


def _in_thread(portal: Portal, call: Reply) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def target() -> None:
        try:
            out.append(portal.call(call()))
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def test_a_call_that_waits_for_a_reply_is_driven_to_its_end_by_its_caller(
    portal: Portal, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, theirs = pair
    call = Reply(ours)
    _wait_until_idle(portal)
    replier = threading.Thread(target=lambda: (call.started.wait(5), theirs.send(b"x")))
    replier.start()
    me = threading.get_ident()
    assert portal.call(call()) == [me, me]  # before and after its wait: this thread
    replier.join(5)
    assert portal.call(_ident()) == me  # handed back whole: the next call is driven too


async def _ident() -> int:
    return threading.get_ident()


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-never-handed-back"])
def test_other_threads_calls_run_in_the_drivers_loop_and_outlive_it(
    portal: Portal, monkeypatch: pytest.MonkeyPatch, planted: bool
) -> None:
    """T1 drives, waiting for its reply. T2's call, made meanwhile, runs in the loop T1
    drives and ends there. T3's, made meanwhile too, is still waiting when T1's reply comes:
    T1 hands the loop back, and the loop thread finishes T3's."""
    give_back = _portal_fast.WaitingSelector.give_back
    if planted:  # the loop's selector left out of the loop thread's wait
        monkeypatch.setattr(_portal_fast.WaitingSelector, "give_back", lambda self: None)
    socks = [socket.socketpair() for _ in range(3)]
    try:
        for ours, _ in socks:
            ours.setblocking(False)
        calls = [Reply(ours) for ours, _ in socks]
        _wait_until_idle(portal)
        fast = portal._fast
        assert fast is not None
        t1, out1 = _in_thread(portal, calls[0])
        wait_for(lambda: fast.driver == t1.ident, what="T1 to drive")
        t2, out2 = _in_thread(portal, calls[1])
        t3, out3 = _in_thread(portal, calls[2])
        assert calls[1].started.wait(5) and calls[2].started.wait(5)
        assert calls[1].threads == [t1.ident] and calls[2].threads == [t1.ident]
        socks[1][1].send(b"x")
        t2.join(5)
        assert out2 == [[t1.ident, t1.ident]]  # T2's call ended in T1's loop
        socks[0][1].send(b"x")
        t1.join(5)
        assert out1 == [[t1.ident, t1.ident]] and fast.driver is None
        socks[2][1].send(b"x")
        t3.join(2)
        if planted:
            assert t3.is_alive() and out3 == []  # nobody watches the loop's selector: caught
            # Undo the plant, so the portal's stop is not left waiting out its 2 x 10 s bounds.
            assert isinstance(fast.selector, _portal_fast.WaitingSelector)
            give_back(fast.selector)
            t3.join(5)
            assert not t3.is_alive()
            return
        assert out3 == [[t1.ident, portal.thread.ident]]  # finished by the loop thread
    finally:
        for ours, theirs in socks:
            theirs.close()
            if not planted:
                ours.close()  # (planted: T3 still waits on it, in a thread left to die)


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-sigint-held-in-select"])
@pytest.mark.usefixtures("sigint_raises")
def test_ctrl_c_while_the_caller_waits_in_select_ends_the_call(
    portal: Portal,
    pair: tuple[socket.socket, socket.socket],
    monkeypatch: pytest.MonkeyPatch,
    planted: bool,
) -> None:
    """Ctrl-C strikes the main thread while it drives, waiting for a reply that does not
    come: the call raises KeyboardInterrupt at once and its coroutine is cancelled."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    if planted:  # the driver's wait in select() not told of the call's SIGINT gate
        drive = _portal_fast.FastLoop.drive_through
        monkeypatch.setattr(
            _portal_fast.FastLoop,
            "drive_through",
            lambda self, ident, run, started, closing, gate: drive(
                self, ident, run, started, closing, None
            ),
        )
    ours, theirs = pair
    call = Reply(ours)
    selector = _selector(portal)
    main = threading.get_ident()
    sent, ended = threading.Event(), threading.Event()

    def interrupt() -> None:
        if not planted:
            wait_for(lambda: selector.gate is not None and selector.gate.waiting, what="select")
        else:  # (no flag there: the planted driver has no gate, and holds SIGINT throughout)
            wait_for(lambda: selector.driver == main, what="the main thread to drive")
        signal.pthread_kill(main, signal.SIGINT)
        sent.set()
        if not ended.wait(2.0):  # the bound: then the reply comes, and a call still waiting ends
            theirs.send(b"x")

    _wait_until_idle(portal)
    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            portal.call(call())
    finally:
        ended.set()
    took = time.monotonic() - t0
    assert sent.is_set()
    if planted:
        assert took >= 2.0 and call.outcome == ["replied"]  # it sat out the wait: caught
        return
    assert took < 2.0, took
    wait_for(lambda: call.outcome == ["cancelled"], what="the call to be cancelled")
    assert portal.call(_ident()) == main  # the loop was handed back whole


# Run in a process of its own: the count is the loop thread's voluntary context switches,
# and other tests' threads left in a worker (proxies' pumps, clients' loops) wake it for the
# GIL too (a loop of tests in one process once failed the bound).
_COUNT_WAKES = """
import os, sys, time
import fenced
from fenced._core import portal_fast

def switches(thread):
    status = open(f"/proc/self/task/{thread.native_id}/status").read()
    line = next(ln for ln in status.splitlines() if ln.startswith("voluntary_ctxt_switches:"))
    return int(line.split(":")[1])

if sys.argv[2] == "planted":  # the loop's selector left in the loop thread's wait
    portal_fast.WaitingSelector.take = lambda self: None
with fenced.connect(sys.argv[1]) as locks:
    assert locks.portal.waits
    lease = locks.lock(f"wakes-{os.getpid()}", ttl=30)
    lease.acquire()
    lease.release()
    locks.portal.run_sync(lambda: None)
    fast = locks.portal._fast
    deadline = time.monotonic() + 10
    while not (fast.selector.wakes_at > 0 and not fast.lock.locked()):  # (idle, asleep)
        assert time.monotonic() < deadline, "the loop thread never went idle"
        time.sleep(0.001)
    before = switches(locks.portal.thread)
    for _ in range(100):
        lease.acquire()
        lease.release()
    print(switches(locks.portal.thread) - before)
"""


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-loop-thread-waits-too"])
def test_a_reply_wakes_only_the_driving_thread(redis_server: RedisServer, planted: bool) -> None:
    """The design's point: during 100 driven acquire+release the loop thread sleeps (woken at
    most to plan for the first keepalive, a few switches with the GIL); were it still in the
    same wait, each reply would wake it too (and the caller would find it wanting the loop
    back, and hop)."""
    env = {k: v for k, v in os.environ.items() if k != "FENCED_PORTAL"}
    out = subprocess.run(
        [sys.executable, "-c", _COUNT_WAKES, redis_server.url, "planted" if planted else "-"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    woke = int(out.stdout.split()[-1])
    # (measured in a process of its own: 1 on a quiet machine, 1-13 beside four busy loops;
    # planted, 330-500: at least one a reply of the 200. A bound between: fewer than one
    # wake for two replies)
    if planted:
        assert woke >= 200, woke  # caught
    else:
        assert woke <= 100, woke


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-never-wakes"])
def test_a_keepalive_armed_by_a_caller_fires_while_it_is_in_its_own_code(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, planted: bool
) -> None:
    """The acquire (driven by the caller) armed the keepalive; the loop thread slept with no
    deadline. The caller then does its own work (no fenced call) for three lease lengths:
    the loop thread, woken when the caller handed the loop back, renews the lease."""
    monkeypatch.delenv("FENCED_PORTAL", raising=False)
    if planted:
        monkeypatch.setattr(_portal_fast.FastLoop, "needs_loop_thread", lambda self, q: False)
    name = unique_name()
    raw = redis.Redis(port=redis_server.port)
    with fenced.connect(redis_server.url) as locks:
        assert locks.portal.waits
        _wait_until_idle(locks.portal)
        lease = locks.lock(name, ttl=0.5)
        lease.acquire()
        threading.Event().wait(1.5)  # the caller's own work: no call into fenced
        if planted:
            assert lease.remaining() == 0  # never renewed: caught
            return
        assert lease.remaining() > 0 and lease.held, lease.lost_cause
        keys = [k for k in raw.keys(f"*{name}*") if raw.pttl(k) > 0]
        assert keys  # the server's copy was renewed too
        assert lease.release()
    raw.close()


def test_a_driven_acquire_that_times_out_leaves_nothing_behind(redis_server: RedisServer) -> None:
    name = unique_name()
    with fenced.connect(redis_server.url) as mine, fenced.connect(redis_server.url) as theirs:
        held = theirs.lock(name, ttl=30)
        held.acquire()
        lease = mine.lock(name, ttl=30)
        t0 = time.monotonic()
        with pytest.raises(LockTimeout):
            lease.acquire(timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 5
        assert mine.portal._fast is not None and mine.portal._fast.driver is None
        assert held.release()
        assert mine.status(name).holder is None  # the lapsed waiter was not handed the lock
        assert lease.acquire(timeout=5).value > held.token.value
        assert lease.release()


@pytest.mark.usefixtures("sigint_raises")
def test_ctrl_c_during_a_driven_blocking_acquire_leaves_no_grant(
    redis_server: RedisServer,
) -> None:
    """A real wait: the main thread drives an acquire queued behind another holder; Ctrl-C
    ends it; the holder's release then leaves the lock free (the waiter left the queue, or
    the grant handed to it was given back)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    name = unique_name()
    main = threading.get_ident()
    with fenced.connect(redis_server.url) as mine, fenced.connect(redis_server.url) as theirs:
        held = theirs.lock(name, ttl=30)
        held.acquire()
        lease = mine.lock(name, ttl=30)
        selector = _selector(mine.portal)

        raw = redis.Redis(port=redis_server.port)

        def queued() -> bool:  # our waiter in the lock's queue (a sorted set) at the server
            return any(raw.type(k) == b"zset" and raw.zcard(k) > 0 for k in raw.keys(f"*{name}*"))

        def interrupt() -> None:
            wait_for(queued, what="the waiter to be queued")
            wait_for(lambda: selector.gate is not None and selector.gate.waiting, what="select")
            signal.pthread_kill(main, signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            lease.acquire(timeout=10)
        assert not lease.held
        wait_for(lambda: not queued(), what="the waiter to leave the queue")
        assert held.release()
        wait_for(lambda: mine.status(name).holder is None, what="the lock to be free")
        assert lease.acquire(timeout=5).value > held.token.value
        assert lease.release()
        raw.close()


def test_stop_from_another_thread_ends_a_driven_wait(
    portal: Portal, pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, _theirs = pair
    call = Reply(ours)
    thread, out = _in_thread(portal, call)
    assert call.started.wait(5)
    assert portal._fast is not None and portal._fast.driver == thread.ident
    bounded(portal.stop, timeout=15)
    thread.join(5)
    assert len(out) == 1 and isinstance(out[0], BackendUnavailable), out
    assert call.outcome == ["cancelled"]


def test_redis_declares_it_and_a_subclass_may_opt_out(redis_server: RedisServer) -> None:
    assert RedisBackend.caller_waits and PostgreSQLBackend.caller_waits
    # SQLite keeps the steps-only drive (measured: within noise, docs/benchmarks.md session 8);
    # client libraries with threads of their own (gRPC, kazoo) keep the hop.
    assert not SQLiteBackend.caller_waits and not EtcdBackend.caller_waits
    assert not ZooKeeperBackend.caller_waits

    class Hop(RedisBackend):
        scheme = "redishoptest"
        caller_waits = False

    undo = fenced.register_backend("redishoptest", Hop)
    try:
        url = redis_server.url.replace("redis://", "redishoptest://", 1)
        with fenced.connect(url) as locks:
            assert not locks.portal.waits and not locks.portal.drive
            with locks.lock(unique_name(), ttl=5) as lease:
                assert lease.held
    finally:
        undo()


def test_calls_from_many_threads_on_one_redis_connection_all_complete(
    redis_server: RedisServer,
) -> None:
    """Eight threads share one connection to one lock: driven calls, hops into a driver's
    loop, hand-overs to the loop thread and the keepalives interleave; every grant is
    distinct and in order."""
    name = unique_name()
    with fenced.connect(redis_server.url) as locks:
        assert locks.portal.waits
        tokens: list[int] = []
        failures: list[BaseException] = []

        def worker() -> None:
            try:
                for _ in range(15):
                    with locks.lock(name, ttl=5, timeout=30) as lease:
                        tokens.append(lease.token.value)
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not failures and not any(t.is_alive() for t in threads), failures
        assert tokens == sorted(tokens) and len(set(tokens)) == 120


def test_stop_from_inside_a_driven_call_is_refused(portal: Portal) -> None:
    _stop_inside_refused(portal)  # (test_portal's, on a portal whose callers wait)


def test_without_nested_epoll_the_portal_drives_steps_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FENCED_PORTAL", raising=False)
    monkeypatch.setattr(_portal_fast, "waiting_available", lambda: False)
    p = Portal("fenced-test-no-wait", drive=True, wait=True)
    try:
        assert p.drive and not p.waits
        assert p.call(_ident()) == threading.get_ident()
    finally:
        p.stop()
    monkeypatch.setenv("FENCED_PORTAL", "portable")
    p = Portal("fenced-test-portable", drive=True, wait=True)
    try:
        assert not p.drive and not p.waits
        assert p.call(_ident()) == p.thread.ident
    finally:
        p.stop()


_FORK_WHILE_DRIVING = r"""
import os, sys, threading, time
import fenced
from fenced.testing.servers import RedisServer

url, name = sys.argv[1], sys.argv[2]
locks, other = fenced.connect(url), fenced.connect(url)
held = other.lock(name, ttl=30)
held.acquire()
lease = locks.lock(name, ttl=30)
fast = locks.portal._fast
waiter = threading.Thread(target=lambda: lease.acquire(timeout=20), daemon=True)
waiter.start()
deadline = time.monotonic() + 10
while fast.driver != waiter.ident:  # the waiter drives its acquire, the loop's lock held
    assert time.monotonic() < deadline, "the waiter never drove"
    time.sleep(0.01)
pid = os.fork()
if pid == 0:  # the child: the parent's loop (and its lock, taken) left behind, a new one here
    try:
        status = locks.status(name)  # would hang on the inherited lock without a new portal
        assert status.holder is not None and locks.portal.waits
        with locks.lock(name + "-child", ttl=5, timeout=5) as mine:
            assert mine.held
        os._exit(0)
    except BaseException as exc:
        print("child:", repr(exc), flush=True)
        os._exit(1)
_, code = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(code) == 0, code
assert held.release()
waiter.join(20)
assert lease.held, "the parent's waiter did not get the lock after the fork"
assert lease.release()
print("ok")
"""


def test_a_fork_while_another_thread_drives_leaves_the_child_a_working_connection(
    redis_server: RedisServer,
) -> None:
    """The child inherits the loop's lock taken by a thread that does not exist there: it
    must make its own loop (fork.py), not wait for that lock; the parent's driven acquire
    goes on. In a fresh process (forking the test process is a hazard of its own)."""
    out = subprocess.run(
        [sys.executable, "-c", _FORK_WHILE_DRIVING, redis_server.url, unique_name()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


class _WaitingInterruptedAfterGrant(InterruptedAfterGrant):
    scheme = "sigintwait"
    caller_waits = True


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-sigint-inline"])
@pytest.mark.usefixtures("sigint_raises")
def test_ctrl_c_between_grant_and_record_while_driving_gives_the_grant_back(
    memory_url: str, monkeypatch: pytest.MonkeyPatch, planted: bool
) -> None:
    """SIGINT strikes the driving main thread between the source's grant and the client's
    record of it: held back to the end of the call, then KeyboardInterrupt, and the grant
    released. Planted: no gate, the interrupt lands inside the lease core's step."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    monkeypatch.delenv("FENCED_PORTAL", raising=False)
    if planted:
        monkeypatch.setattr(_portal._SigintGate, "enter", staticmethod(lambda ident: None))
    undo = fenced.register_backend("sigintwait", _WaitingInterruptedAfterGrant)
    try:
        with fenced.connect(memory_url.replace("memory://", "sigintwait://")) as locks:
            assert locks.portal.waits
            lease = locks.lock("x", ttl=30)
            _wait_until_idle(locks.portal)
            InterruptedAfterGrant.armed = True
            with pytest.raises(KeyboardInterrupt):
                lease.acquire()
            if planted:
                assert locks.status("x").holder is not None  # left held: caught
                return
            wait_for(lambda: locks.status("x").holder is None, what="the grant given back")
            assert not lease.held
            assert lease.acquire(timeout=5).value == 2 and lease.release()
    finally:
        InterruptedAfterGrant.armed = False
        undo()


_SIGNAL_STORM = r"""
import asyncio, os, random, signal, socket, sys, threading, time
from fenced._core import portal as P

if sys.argv[1] == "planted":  # the fast modes on the main thread, handlers or not
    P._app_signal_handlers = lambda: False


class Alarm(Exception):
    pass


def on_alarm(signum, frame):
    raise Alarm


signal.signal(signal.SIGALRM, on_alarm)
portal = P.Portal("storm", drive=True, wait=True)
assert portal.waits
ours, theirs = socket.socketpair()
ours.setblocking(False)
theirs.setblocking(False)


async def echo():
    loop = asyncio.get_running_loop()
    while True:
        await loop.sock_sendall(theirs, await loop.sock_recv(theirs, 100))


async def work():  # a timer, a send, a reply: what a source's call does
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(2):
        await asyncio.sleep(0.0005)
        await loop.sock_sendall(ours, b"x")
        return await loop.sock_recv(ours, 100)


portal.loop.call_soon_threadsafe(lambda: portal.loop.create_task(echo()))
progress = [time.monotonic()]


def watchdog():  # a call that never ends (a timer lost in asyncio's bookkeeping)
    while time.monotonic() - progress[0] < 5:
        time.sleep(0.1)
    print("hung", flush=True)
    os._exit(3)


threading.Thread(target=watchdog, daemon=True).start()
rng = random.Random(7)
outcomes = {}
for _ in range(1500):
    outcome = "?"
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.00005, 0.002))
            portal.call(work())
            outcome = "ok"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Alarm:
        outcome = "interrupted"
    except Exception as exc:
        print("failed:", repr(exc), flush=True)  # (e.g. a timeout: a lost timer or reply)
        os._exit(4)
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
    progress[0] = time.monotonic()
    try:
        while ours.recv(100):
            pass
    except (BlockingIOError, Alarm):
        pass
assert not portal.running_loop_code(), "the main thread still counts as the loop's"
assert portal.call(work()) == b"x"
print(sorted(outcomes.items()), flush=True)
"""


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-drives-anyway"])
def test_an_applications_raising_signal_handler_never_lands_in_the_loops_bookkeeping(
    planted: bool,
) -> None:
    """A handler of the application's (here SIGALRM's, raising) runs on the main thread
    between any two bytecodes: while that thread drives the loop it could land inside
    asyncio's own bookkeeping (seen: a call waiting forever on a timer popped and never run,
    an fd registered twice, the connection wedged). With such a handler installed the main
    thread hops instead: every call ends, interrupted or done, and the next one works."""
    out = subprocess.run(
        [sys.executable, "-c", _SIGNAL_STORM, "planted" if planted else "fenced"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    clean = out.returncode == 0 and "('ok'," in out.stdout
    if planted:
        assert not clean, out.stdout  # caught: a hang, an error, or a wedged connection
        return
    assert clean, (out.stdout, out.stderr[-2000:])
    assert "('interrupted'," in out.stdout  # (the storm did interrupt calls)
