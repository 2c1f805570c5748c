"""The synchronous API: the asyncio implementation, driven on a private event-loop thread.

There is one implementation of every protocol (``_lease.py`` and the backends); this module
only carries calls across to the loop thread and back. The loop thread also runs the
keepalives, so a sync holder's lease is renewed while its own thread is busy.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar

from ._backend import Characteristic, LockStatus
from ._errors import BackendUnavailable
from ._lease import _UNSET, DEFAULT_TTL, AsyncLease, AsyncLocks
from ._state import Phase
from ._token import FencingToken

__all__ = ["Lease", "Locks", "connect"]

T = TypeVar("T")

SyncLostCallback = Callable[["Lease"], None]


class _Portal:
    """An event loop on a daemon thread, and a way to run coroutines on it from other threads."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        # Backends may run short blocking calls inline on this loop: nobody else's code runs on it.
        self.loop._fenced_private = True  # type: ignore[attr-defined]
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()
        ready.wait()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("a blocking fenced call was made from a lost-lease callback")
        if self.loop.is_closed():
            coro.close()
            raise BackendUnavailable("this fenced connection is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            # KeyboardInterrupt etc. while waiting: do not leave the call running behind us.
            future.cancel()
            raise

    def run_sync(self, fn: Callable[[], T]) -> T:
        """Run a plain function on the loop thread (for objects that must be made there)."""
        result: Future[T] = Future()

        def target() -> None:
            try:
                result.set_result(fn())
            except BaseException as exc:
                result.set_exception(exc)

        self.loop.call_soon_threadsafe(target)
        return result.result()

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


class Lease:
    """A lease held through a synchronous :class:`Locks`; see :class:`~fenced.AsyncLease`.

    ``lost`` is a :class:`threading.Event`; ``on_lost(lease)`` is called on fenced's loop
    thread, so it must not block for long nor call blocking fenced methods.
    """

    def __init__(self, locks: Locks, inner: AsyncLease, on_lost: SyncLostCallback | None) -> None:
        self._locks = locks
        self._inner = inner
        self.on_lost = on_lost
        self.lost = threading.Event()
        inner._lost_hooks.append(self._on_inner_lost)

    def _on_inner_lost(self, cause: BaseException) -> None:
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost(self)

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def ttl(self) -> float:
        return self._inner.ttl

    @property
    def token(self) -> FencingToken:
        """The token of the current (or, after release or loss, the last) grant."""
        return self._inner.token

    @property
    def request_id(self) -> str | None:
        return self._inner.request_id

    @property
    def phase(self) -> Phase:
        return self._inner.phase

    @property
    def held(self) -> bool:
        return self._inner.held

    @property
    def lost_cause(self) -> BaseException | None:
        return self._inner.lost.cause

    def remaining(self) -> float:
        """Seconds the lease is surely still held (see :meth:`AsyncLease.remaining`)."""
        return self._inner.remaining()

    def acquire(self, timeout: float | None = _UNSET) -> FencingToken:
        """Block until granted or ``timeout`` (None: forever, 0: try once); return the token."""
        self.lost.clear()
        return self._locks._portal.call(self._inner.acquire(timeout))

    def renew(self) -> float:
        return self._locks._portal.call(self._inner.renew())

    def release(self) -> bool:
        """Give the lock up; False if it was no longer held. Never frees a later grant."""
        return self._locks._portal.call(self._inner.release())

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._locks._portal.call(self._inner.__aexit__(exc_type, exc, tb))

    def __repr__(self) -> str:
        return repr(self._inner).replace("AsyncLease", "Lease", 1)


class Locks:
    """A connection to one token source, for synchronous code: ``with fenced.connect(url) as locks``."""

    def __init__(self, url: str, *, require: Iterable[str] = (), **options: Any) -> None:
        self._async = AsyncLocks(url, require=require, **options)
        self._portal = _Portal(name=f"fenced-{self._async._cls.scheme}")
        try:
            self._portal.call(self._async.open())
        except BaseException:
            self._portal.stop()
            raise

    @property
    def url(self) -> str:
        return self._async.url

    @property
    def characteristics(self) -> frozenset[Characteristic]:
        return self._async.characteristics

    @property
    def aio(self) -> AsyncLocks:
        """The underlying asyncio connection (its methods must run on :attr:`loop`)."""
        return self._async

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._portal.loop

    def lock(
        self,
        name: str,
        *,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        on_lost: SyncLostCallback | None = None,
        request_id: str | None = None,
        safety_margin: float | None = None,
        auto_renew: bool = True,
    ) -> Lease:
        """A lease on ``name`` (not yet acquired): ``with locks.lock("x", ttl=10) as lease``."""
        inner = self._async.lock(
            name,
            ttl=ttl,
            timeout=timeout,
            request_id=request_id,
            safety_margin=safety_margin,
            auto_renew=auto_renew,
        )
        return Lease(self, inner, on_lost)

    def status(self, name: str) -> LockStatus:
        return self._portal.call(self._async.status(name))

    def close(self) -> None:
        """Release every lease still held through this connection, close it, stop its thread."""
        if self._portal.loop.is_closed():
            return
        try:
            self._portal.call(self._async.aclose())
        finally:
            self._portal.stop()

    def __enter__(self) -> Locks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._async).replace("AsyncLocks", "Locks", 1)


def connect(url: str, *, require: Iterable[str] = (), **options: Any) -> Locks:
    """Open a token source by URL: ``sqlite:///path``, ``etcd://h:p``, ``postgresql://…`` …

    ``require`` names characteristics (e.g. ``{"linearizable"}``) that the source must have;
    one lacking any is refused with :class:`~fenced.ConfigurationError`. Further keyword
    options go to the backend.
    """
    return Locks(url, require=require, **options)
