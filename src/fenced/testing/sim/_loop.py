"""An asyncio event loop on virtual time: when nothing is ready, the clock jumps to the next
timer instead of sleeping, so a simulated minute takes microseconds, and a run is a pure
function of the code and the seed (asyncio runs ready callbacks in FIFO order and timers by
time, then by the order they were made)."""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import selectors
from asyncio import format_helpers
from collections.abc import Mapping
from typing import Any

__all__ = ["Stuck", "VirtualLoop"]

_copy_context = contextvars.copy_context


class _Handle(asyncio.Handle):
    """asyncio's ``Handle``, made in one frame: the stock constructor asks the loop whether it
    is in debug mode for every callback (this loop never is), and a seed makes ~600 of them."""

    __slots__ = ()

    def __init__(self, callback: Any, args: Any, loop: Any, context: Any) -> None:
        self._context = _copy_context() if context is None else context
        self._loop = loop
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._repr = None
        self._source_traceback = None


class _Timer(asyncio.TimerHandle):
    """asyncio's ``TimerHandle`` made and cancelled in one frame each (see ``_Handle``); it
    is scheduled from birth (``call_at`` pushes it on the heap at once)."""

    __slots__ = ()

    def __init__(self, when: float, callback: Any, args: Any, loop: Any, context: Any) -> None:
        self._context = _copy_context() if context is None else context
        self._loop = loop
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._repr = None
        self._source_traceback = None
        self._when = when
        self._scheduled = True

    def cancel(self) -> None:
        # (the loop's count of cancelled timers is not kept: this loop never reads it)
        self._cancelled = True
        self._callback = None
        self._args = None  # type: ignore[assignment]


def _failed(handle: Any, exc: BaseException) -> None:
    """What asyncio's ``Handle._run`` does with a callback that raised."""
    cb = format_helpers._format_callback_source(handle._callback, handle._args)
    handle._loop.call_exception_handler(
        {"message": f"Exception in callback {cb}", "exception": exc, "handle": handle}
    )


class Stuck(RuntimeError):
    """Every task waits for something no timer will ever bring: the simulated system hangs."""


class _JumpingSelector(selectors.BaseSelector):
    """Never waits: ``select(timeout)`` moves the loop's clock ``timeout`` ahead. Nothing is
    ever readable (the simulation has no real I/O; asyncio's own wake-up pipe is never used,
    since nothing calls ``call_soon_threadsafe``)."""

    def __init__(self, loop: VirtualLoop) -> None:
        self._loop = loop
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(
            fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data
        )
        self._keys[key.fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Stuck("no task can run and no timer is set")
        self._loop.advance(timeout)
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    """asyncio's loop with its own timer queue and iteration (``_run_once``): the simulator
    spends most of its time in the loop's machinery, and the stock one pays for real I/O, a
    selector call per iteration and timers compared in Python. Timers run by time, then in
    the order they were made; ready callbacks in FIFO order."""

    def __init__(self) -> None:
        self._now = 0.0
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._made = 0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(seconds, 0.0)

    def call_at(  # type: ignore[override]
        self, when: float, callback: Any, *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        if self._closed:  # type: ignore[attr-defined]
            raise RuntimeError("Event loop is closed")
        timer = _Timer(when, callback, args, self, context)
        self._made += 1
        heapq.heappush(self._timers, (when, self._made, timer))
        return timer

    def call_later(  # type: ignore[override]
        self, delay: float, callback: Any, *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        # (call_at's body, not a call to it: a frame less for the commonest timer)
        if self._closed:  # type: ignore[attr-defined]
            raise RuntimeError("Event loop is closed")
        when = self._now + delay
        timer = _Timer(when, callback, args, self, context)
        self._made += 1
        heapq.heappush(self._timers, (when, self._made, timer))
        return timer

    def call_soon(  # type: ignore[override]
        self, callback: Any, *args: Any, context: Any = None
    ) -> asyncio.Handle:
        if self._closed:  # type: ignore[attr-defined]
            raise RuntimeError("Event loop is closed")
        handle = _Handle(callback, args, self, context)
        self._ready.append(handle)  # type: ignore[attr-defined]
        return handle

    def _run_once(self) -> None:
        # Iterations until the loop is told to stop, not one: run_forever's own loop does
        # exactly this (an iteration, then the check), at a Python call per iteration.
        timers, ready = self._timers, self._ready  # type: ignore[attr-defined]
        pop, popleft = heapq.heappop, ready.popleft
        while True:
            if not ready and not self._stopping:  # type: ignore[attr-defined]
                while timers and timers[0][2]._cancelled:
                    pop(timers)[2]._scheduled = False  # type: ignore[attr-defined]
                if not timers:
                    raise Stuck("no task can run and no timer is set")
                if timers[0][0] > self._now:
                    self._now = timers[0][0]  # nothing to do until then: jump
            end = self._now + 1e-9  # (asyncio's: the monotonic clock's resolution)
            while timers and timers[0][0] < end:
                timer = pop(timers)[2]
                timer._scheduled = False  # type: ignore[attr-defined]
                ready.append(timer)
            # (Handle._run inlined, a frame less per callback; one that raises goes to the
            # exception handler as in asyncio's own loop.)
            for _ in range(len(ready)):
                handle = popleft()
                if handle._cancelled:
                    continue
                try:
                    handle._context.run(handle._callback, *handle._args)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:
                    _failed(handle, exc)
            handle = None  # (as asyncio's: no cycle kept through a raised exception)
            if self._stopping:  # type: ignore[attr-defined]
                return

    def close(self) -> None:
        self._timers.clear()
        super().close()
