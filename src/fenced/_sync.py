"""The synchronous API: the asyncio implementation, driven on a private event-loop thread.

There is one implementation of every protocol (``_lease.py`` and the backends); this module
only carries calls across to the loop thread and back. The loop thread also runs the
keepalives, so a sync holder's lease is renewed while its own thread is busy.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar

from . import _clock
from ._backend import Characteristic, LockStatus
from ._errors import BackendUnavailable
from ._lease import _UNSET, DEFAULT_TTL, AsyncLease, AsyncLocks, _left_behind
from ._state import Phase
from ._token import FencingToken

__all__ = ["Lease", "Locks", "connect"]

T = TypeVar("T")

logger = logging.getLogger("fenced")

SyncLostCallback = Callable[["Lease"], None]


class _Portal:
    """An event loop on a daemon thread, and a way to run coroutines on it from other threads."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        # Backends may run short blocking calls inline on this loop: nobody else's code runs on it.
        self.loop._fenced_private = True  # type: ignore[attr-defined]
        self._stopping = False
        self._undoing: set[asyncio.Task[object]] = set()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()
        ready.wait()
        self._thread_id = self.thread.ident
        self.pid = os.getpid()

    @property
    def closed(self) -> bool:
        return self._stopping or self.loop.is_closed()

    @property
    def forked(self) -> bool:
        """True in a child process forked after this portal started: its thread is not here."""
        return self.pid != os.getpid()

    def call(
        self,
        coro: Coroutine[Any, Any, T],
        *,
        undo: Callable[[T], Coroutine[Any, Any, object]] | None = None,
    ) -> T:
        """Run ``coro`` on the loop and wait for its outcome.

        The outcome is handed over through a bare lock that the loop releases (cheaper than a
        ``concurrent.futures.Future``). If the wait is interrupted (KeyboardInterrupt, or an
        exception from a signal handler), the call is cancelled, and if it completes anyway
        (its result was on its way) the result goes to ``undo`` on the loop: an acquire nobody
        will see is released, not kept alive by its keepalive.
        """
        if self.closed:  # first: once the loop thread has ended, its id may be reused
            coro.close()
            raise BackendUnavailable("this fenced connection is closed")
        if self.forked:  # the loop thread stayed in the parent: waiting would hang forever
            coro.close()
            raise BackendUnavailable(
                f"this fenced object was made in process {self.pid}, before a fork; "
                "make a new one in this process"
            )
        if _thread.get_ident() == self._thread_id:
            coro.close()
            raise RuntimeError("a blocking fenced call was made from a lost-lease callback")
        latch = _thread.allocate_lock()
        latch.acquire()
        result: list[T] = []
        error: list[BaseException] = []
        started: list[asyncio.Task[None]] = []

        async def runner() -> None:
            try:
                result.append(await coro)
            except asyncio.CancelledError:  # only stop() cancels a call someone waits for
                error.append(BackendUnavailable("the fenced connection was closed"))
            except BaseException as exc:
                error.append(exc)
            finally:
                latch.release()

        run = runner()

        def start() -> None:
            started.append(self.loop.create_task(run))

        try:
            self.loop.call_soon_threadsafe(start)
        except RuntimeError:  # closed meanwhile
            run.close()
            coro.close()
            raise BackendUnavailable("this fenced connection is closed") from None
        try:
            latch.acquire()
        except BaseException:
            # Interrupted while waiting. Decide on the loop thread, where the call ends, so
            # that "cancelled in time" and "completed, so undo it" cannot both miss.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(
                    self._abandon, started, run, coro, result if undo else None, undo
                )
            raise
        if error:
            raise error[0]
        return result[0]

    def _abandon(
        self,
        started: list[asyncio.Task[None]],
        run: Coroutine[Any, Any, None],
        coro: Coroutine[Any, Any, T],
        result: list[T] | None,
        undo: Callable[[T], Coroutine[Any, Any, object]] | None,
    ) -> None:
        if not started:  # interrupted before it was even scheduled
            run.close()
            coro.close()
            return

        def after(_task: object = None) -> None:
            if undo is not None and result:
                job: asyncio.Task[object] = self.loop.create_task(undo(result[0]))
                self._undoing.add(job)
                job.add_done_callback(self._undone)

        task = started[0]
        if task.done():
            after()
        else:
            task.cancel()
            task.add_done_callback(after)

    def _undone(self, job: asyncio.Task[object]) -> None:
        self._undoing.discard(job)
        if not job.cancelled() and job.exception() is not None:
            logger.warning("undoing an interrupted call failed: %r", job.exception())

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
        if self.closed:
            return
        if self.forked:
            _left_behind(self)  # the parent's loop and thread: nothing of them runs here
            self._stopping = True
            return
        if threading.current_thread() is self.thread:
            raise RuntimeError("a fenced connection cannot be closed from a lost-lease callback")
        self._stopping = True  # from now on call() refuses: nothing new is queued on the loop
        # Calls still running (an acquire waiting in another thread) are cancelled, so their
        # callers get BackendUnavailable instead of waiting forever on a stopped loop.
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


async def _cancel_all(timeout: float = 5.0) -> None:
    """Cancel every other task on this loop and give them ``timeout`` seconds to finish."""
    me = asyncio.current_task()
    deadline = _clock.now() + timeout
    while (tasks := [t for t in asyncio.all_tasks() if t is not me]) and _clock.now() < deadline:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=max(0.0, deadline - _clock.now()))


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
        self._pid = os.getpid()
        inner.add_lost_hook(self._on_inner_lost)

    def _check_fork(self) -> None:
        # In a forked child the parent's grant stays the parent's: this lease starts over, not
        # held, and may be acquired anew through the child's own connection.
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._locks._check_fork()
            self.lost.clear()

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
        self._check_fork()
        return self._inner.held

    @property
    def lost_cause(self) -> BaseException | None:
        return self._inner.lost.cause

    def remaining(self) -> float:
        """Seconds the lease is surely still held (see :meth:`AsyncLease.remaining`)."""
        self._check_fork()
        return self._inner.remaining()

    def acquire(self, timeout: float | None = _UNSET) -> FencingToken:
        """Block until granted or ``timeout`` (None: forever, 0: try once); return the token.

        If interrupted (Ctrl-C), the lock is not left held: a grant that arrives anyway is
        released.
        """
        self._check_fork()
        self.lost.clear()
        return self._locks._portal.call(self._inner.acquire(timeout), undo=self._undo_acquire)

    async def _undo_acquire(self, _token: FencingToken) -> None:
        await self._inner.release()

    def renew(self) -> float:
        self._check_fork()
        return self._locks._portal.call(self._inner.renew())

    def release(self) -> bool:
        """Give the lock up; False if it was no longer held. Never frees a later grant."""
        self._check_fork()
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
        self._check_fork()
        self._locks._portal.call(self._inner.finish(exc_type, exc))

    def __repr__(self) -> str:
        return repr(self._inner).replace("AsyncLease", "Lease", 1)


class Locks:
    """A connection to one token source, for synchronous code: ``with fenced.connect(url) as locks``."""

    def __init__(self, url: str, *, require: Iterable[str] = (), **options: Any) -> None:
        self._async = AsyncLocks(url, require=require, **options)
        self._portal_now = _Portal(name=f"fenced-{self._async._cls.scheme}")
        try:
            self._portal_now.call(self._async.open())
        except BaseException:
            self._portal_now.stop()
            raise

    @property
    def _portal(self) -> _Portal:
        self._check_fork()
        return self._portal_now

    def _check_fork(self) -> None:
        """In a child forked after connect(): a new loop thread and, lazily, a new connection.

        Nothing the parent made is used or closed here (a closed socket or a finished
        session would cut the parent's connection too): it is kept aside for good. Grants
        the parent holds stay the parent's.
        """
        if self._portal_now.forked:
            old = self._portal_now
            _left_behind(old)
            self._portal_now = _Portal(name=old.thread.name)

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
        """Holder, token, highest token and time left of ``name``."""
        return self._portal.call(self._async.status(name))

    def lock_names(self) -> list[str]:
        """The names of the locks the source knows, sorted."""
        return self._portal.call(self._async.lock_names())

    def close(self) -> None:
        """Release every lease still held through this connection, close it, stop its thread.

        Not from an ``on_lost`` callback (it runs on the thread this would stop): that raises
        RuntimeError and leaves the connection open and working.
        """
        self._check_fork()
        if self._portal.closed:
            return
        if threading.current_thread() is self._portal.thread:
            raise RuntimeError("a fenced connection cannot be closed from a lost-lease callback")
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
