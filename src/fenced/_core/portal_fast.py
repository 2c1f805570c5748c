"""The portal's fast mode: callers run the loop's work on their own thread, and may wait in it.

**This is the only module of fenced's core that touches private asyncio names** (``loop._ready``,
``_scheduled``, ``_timer_cancelled_count``, ``_write_to_self``, ``Handle._run``/``_callback``,
``asyncio._get_running_loop``/``_set_running_loop``): CPython 3.11-3.13's ``SelectorEventLoop``.
:func:`available` probes them once; where they are not as expected (another Python, another
loop), or ``FENCED_PORTAL=portable`` is set, the portal uses its portable mode instead (public
asyncio only: ``call_soon_threadsafe``, a hop to the loop thread per call). See ``_portal``.

A hop to the loop thread and back costs two thread switches (50-90 µs on a VM), more than an
SQLite transaction. So the loop is guarded by one lock (like a GIL for the loop): its thread
holds it at all times except while it waits in ``select()``. A caller that takes the lock
without waiting runs its coroutine as a task of the portal's loop, on its own thread; if the
task has to wait (for I/O, a timer, another thread), the caller hands the loop back and waits
for the loop thread to finish it, exactly as a hop would. So there is still one implementation
of every protocol, and the loop thread still runs keepalives while callers are busy elsewhere.

**Waiting too** (``FastLoop(wait=True)``, for sources whose calls wait for replies: Redis).
Handing the loop back whenever the task waits costs the same two switches as a hop, and a
caller that kept driving while the loop thread also sat in ``select()`` would wake both
threads for every reply (the loop thread then only to find the GIL taken). So the loop thread
waits in an *outer* epoll holding only the loop's own selector (nested epoll); a caller that
takes the loop takes the loop's selector out of that outer epoll (one ``epoll_ctl``), runs the
whole loop (``_run_once``: its own task, other callers' calls, due timers) and waits for its
reply in the loop's selector itself, until its call is done; then it puts the selector back
(one ``epoll_ctl``: readiness that arrived meanwhile wakes the loop thread at once), and wakes
the loop thread only if it left work queued or armed a timer before the one it sleeps to.
Between calls the loop thread owns the loop as before: keepalives fire while callers are in
their own code. Ctrl-C in a driving main thread is let through while it waits in ``select()``.
"""

from __future__ import annotations

import _thread
import asyncio
import functools
import math
import select
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["FastLoop", "WaitingSelector", "available", "probe", "waiting_available"]


class SharedSelector(selectors.DefaultSelector):
    """The loop's selector: the loop thread gives up the loop's lock while it waits in it."""

    def __init__(self, lock: _thread.LockType) -> None:
        super().__init__()
        self._lock = lock
        self.wakes_at = -math.inf
        """When the waiting loop thread will look at its timers next (-inf: it is not waiting)."""
        self.wanted = False
        """True while the loop thread waits for a caller to hand the loop back."""

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self.wakes_at = math.inf if timeout is None else time.monotonic() + timeout
        self._lock.release()
        try:
            ready = super().select(timeout)
        finally:
            if not self._lock.acquire(False):
                # A caller is running the loop's work: it finishes its step, and no caller
                # starts another until this thread has had its turn (timers must not starve).
                self.wanted = True
                self._lock.acquire()
                self.wanted = False
            self.wakes_at = -math.inf
        # A caller may have driven the loop meanwhile and unregistered or replaced a file
        # descriptor: an event for a key that is no longer registered is dropped.
        keys = self.get_map()
        return [(key, events) for key, events in ready if keys.get(key.fd) is key]


class WaitingSelector(SharedSelector):
    """The loop's selector when callers also wait in it (``FastLoop(wait=True)``).

    The loop thread waits in an outer epoll that holds only this one's file descriptor; a
    driving caller takes it out of the outer epoll (:meth:`take`) and waits in this one
    directly, so that a reply wakes only the thread that drives.
    """

    def __init__(self, lock: _thread.LockType) -> None:
        super().__init__(lock)
        self._outer = select.epoll()
        self._fd = self.fileno()
        self._outer.register(self._fd, select.EPOLLIN)
        self.driver: int | None = None
        """The caller driving now (set and read only by the loop lock's holder)."""
        self.gate: Any = None
        """That caller's SIGINT gate (``portal._SigintGate``), if it has one."""

    def take(self) -> None:
        """Out of the loop thread's wait: from now on its ``select()`` sleeps to its timeout."""
        self._outer.modify(self._fd, 0)

    def give_back(self) -> None:
        """Into the loop thread's wait again (ready events already waiting wake it at once)."""
        self._outer.modify(self._fd, select.EPOLLIN)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if self.driver is not None:  # (the loop's lock is held: by the driver, who asks)
            gate = self.gate
            if gate is None:
                return super(SharedSelector, self).select(timeout)
            # Ctrl-C is let through while the caller waits here (held back elsewhere); one
            # held back meanwhile ends the call before it waits (the loop's state is whole
            # here: nothing of this turn is taken yet, and epoll reports it again).
            if gate.wait_begins():
                raise KeyboardInterrupt
            try:
                return super(SharedSelector, self).select(timeout)
            finally:
                gate.waiting = False
        if timeout is not None:  # (as EpollSelector does: at least ``timeout``, in ms)
            timeout = 0.0 if timeout <= 0 else math.ceil(timeout * 1e3) * 1e-3
        self.wakes_at = math.inf if timeout is None else time.monotonic() + timeout
        self._lock.release()
        try:
            woke = self._outer.poll(-1 if timeout is None else timeout, 1)
        except InterruptedError:
            woke = []
        finally:
            if not self._lock.acquire(False):
                self.wanted = True  # a caller drives: it ends its call, then it is our turn
                self._lock.acquire()
                self.wanted = False
            self.wakes_at = -math.inf
        # Read under the lock: what a driver took meanwhile is not reported twice.
        return super(SharedSelector, self).select(0) if woke else []

    def close(self) -> None:
        self._outer.close()
        super().close()


class FastLoop:
    """A ``SelectorEventLoop`` that callers may drive while its own thread is idle."""

    def __init__(self, *, wait: bool = False) -> None:
        self.lock = _thread.allocate_lock()
        self.selector = WaitingSelector(self.lock) if wait else SharedSelector(self.lock)
        self.waits = wait
        """True if a caller drives its call to the end, waiting in ``select()`` itself."""
        self.loop = asyncio.SelectorEventLoop(self.selector)
        self.driver: int | None = None
        """The thread running the loop's work instead of the loop's own thread, if any."""

    def run_forever(self) -> None:
        """The loop thread's body: it holds the loop's lock except while in ``select()``."""
        with self.lock:
            self.loop.run_forever()

    def try_drive(
        self,
        ident: int,
        run: Coroutine[Any, Any, None],
        started: list[asyncio.Task[None]],
        closing: Callable[[], bool],
    ) -> bool | None:
        """If the loop thread is idle, run ``run`` as a task of the loop on this thread, as far
        as it goes without waiting, then hand the loop back (waking its thread if it has work
        sooner than it planned). False if the loop was busy; None if it is closing.
        """
        if self.selector.wanted or not self.lock.acquire(False):
            return False
        loop = self.loop
        saved = asyncio._get_running_loop()
        ready: Any = loop._ready  # type: ignore[attr-defined]
        queued = len(ready)
        try:
            if closing() or not loop.is_running():
                run.close()
                return None
            self.driver = ident
            asyncio._set_running_loop(loop)
            task = loop.create_task(run)
            started.append(task)
            while not task.done():
                step = _take_step(ready, task)
                if step is None:
                    break  # it waits for something: the loop thread takes it from here
                step._run()
        finally:
            asyncio._set_running_loop(saved)
            self.driver = None
            try:
                if self.needs_loop_thread(len(ready) > queued):
                    loop._write_to_self()  # type: ignore[attr-defined]
            finally:
                self.lock.release()
        return True

    def drive_through(
        self,
        ident: int,
        coro: Coroutine[Any, Any, Any],
        started: list[Any],
        closing: Callable[[], bool],
        gate: Any,
    ) -> bool | None:
        """If the loop thread is idle, run the whole loop on this thread until ``coro`` (as a
        task of the loop, appended to ``started``) is done, waiting for I/O in the loop's
        selector here; then hand the loop back. False if the loop was busy (``coro``
        untouched); None if it is closing. ``gate``: this call's SIGINT gate, let through
        while waiting (the KeyboardInterrupt propagates from here, the loop handed back).
        """
        selector = self.selector
        assert isinstance(selector, WaitingSelector)
        if selector.wanted or not self.lock.acquire(False):
            return False
        loop = self.loop
        ready: Any = loop._ready  # type: ignore[attr-defined]
        saved = asyncio._get_running_loop()
        try:
            if closing() or not loop.is_running():
                return None
            selector.take()
            self.driver = selector.driver = ident
            selector.gate = gate
            asyncio._set_running_loop(loop)
            task = loop.create_task(coro)
            started.append(task)
            run_once = loop._run_once  # type: ignore[attr-defined]
            # The task's own next step is run at once when it is first in the queue (a whole
            # turn of the loop, with its poll, only otherwise): fewer turns than run_forever's,
            # the same order (a future's callbacks must run in turn: sock_connect's removes
            # its writer before the task may make a transport on that socket).
            while not task.done():
                if ready and getattr(ready[0]._callback, "__self__", None) is task:
                    ready.popleft()._run()
                else:
                    run_once()
            # What this call left queued (fenced's own callbacks) is run here, not by waking
            # the loop thread for it.
            for _ in range(4):
                if not ready:
                    break
                run_once()
        finally:
            asyncio._set_running_loop(saved)
            selector.gate = None
            self.driver = selector.driver = None
            try:
                selector.give_back()
                wake = not selector.wanted and self.needs_loop_thread(bool(ready))
            finally:
                self.lock.release()
            if wake:  # (after the release: else it wakes only to wait for the lock)
                loop._write_to_self()  # type: ignore[attr-defined]
        return True

    def needs_loop_thread(self, queued_more: bool) -> bool:
        """True if the waiting loop thread must wake now rather than when it planned to:
        this thread queued callbacks (those queued from other threads woke it already), or
        armed a timer due before it planned to look."""
        if queued_more:
            return True
        loop = self.loop
        timers: list[asyncio.TimerHandle] = loop._scheduled  # type: ignore[attr-defined]
        if not timers:
            return False
        # Cancelled timers stay in the heap until the loop thread pops them: let it tidy up.
        if loop._timer_cancelled_count > 1000 + len(timers) // 2:  # type: ignore[attr-defined]
            return True
        return timers[0].when() < self.selector.wakes_at - 0.001


def _take_step(ready: Any, task: asyncio.Task[None]) -> asyncio.Handle | None:
    """Remove and return the next step of ``task`` from the loop's ready queue, if it is there."""
    for handle in ready:
        if getattr(handle._callback, "__self__", None) is task:
            ready.remove(handle)
            return handle  # type: ignore[no-any-return]
    return None


def probe(new_loop: Callable[[], asyncio.AbstractEventLoop]) -> bool:
    """True if loops made by ``new_loop`` have the internals :class:`FastLoop` relies on: a
    task's first step found in ``_ready`` and run by hand, the timer heap, the self-pipe."""
    try:
        loop = new_loop()
    except Exception:
        return False

    async def nothing() -> None:
        pass

    coro = nothing()
    try:
        task = loop.create_task(coro)
        step = _take_step(getattr(loop, "_ready", ()), task)
        if step is not None:
            saved = asyncio._get_running_loop()
            asyncio._set_running_loop(loop)
            try:
                step._run()
            finally:
                asyncio._set_running_loop(saved)
        return (
            task.done()
            and isinstance(getattr(loop, "_scheduled", None), list)
            and isinstance(getattr(loop, "_timer_cancelled_count", None), int)
            and callable(getattr(loop, "_write_to_self", None))
        )
    except Exception:
        return False
    finally:
        coro.close()  # (never started where the probe could not find its step)
        loop.close()


@functools.cache
def available() -> bool:
    """The probe, run once per process on the loop :class:`FastLoop` makes."""
    return probe(lambda: FastLoop().loop)


@functools.cache
def waiting_available() -> bool:
    """:func:`available`, with epoll (nested: Linux) and the loop's ``_run_once`` too."""
    if not hasattr(select, "epoll") or not available():
        return False
    try:
        fast = FastLoop(wait=True)
    except (OSError, ValueError):
        return False
    try:
        return isinstance(fast.selector, selectors.EpollSelector) and callable(
            getattr(fast.loop, "_run_once", None)
        )
    finally:
        fast.loop.close()
