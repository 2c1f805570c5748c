"""The portal's fast mode: callers run the loop's work on their own thread.

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
"""

from __future__ import annotations

import _thread
import asyncio
import functools
import math
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["FastLoop", "available", "probe"]


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


class FastLoop:
    """A ``SelectorEventLoop`` that callers may drive while its own thread is idle."""

    def __init__(self) -> None:
        self.lock = _thread.allocate_lock()
        self.selector = SharedSelector(self.lock)
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
