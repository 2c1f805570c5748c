"""An asyncio event loop on virtual time: when nothing is ready, the clock jumps to the next
timer instead of sleeping, so a simulated minute takes microseconds, and a run is a pure
function of the code and the seed (asyncio runs ready callbacks in FIFO order and timers by
time, then by the order they were made)."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Mapping
from typing import Any

__all__ = ["Stuck", "VirtualLoop"]


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
    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(seconds, 0.0)
