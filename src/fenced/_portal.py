"""A private event loop on a daemon thread, and the way to run coroutines on it from others.

The synchronous API (``_sync``) and the synchronous guards drive fenced's asyncio code through
a :class:`Portal`. Only fenced's own code runs on a portal's loop, which is what
:func:`on_private_loop` tells a backend: it may then make short blocking calls (an SQLite
transaction) inline instead of paying for a hop to a worker thread.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from . import _clock, _fork
from ._errors import BackendUnavailable

__all__ = ["Portal", "mark_private", "on_private_loop"]

T = TypeVar("T")

logger = logging.getLogger("fenced")

_PRIVATE_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def mark_private(loop: asyncio.AbstractEventLoop) -> None:
    """Declare that only fenced's code runs on ``loop`` (a portal's, or a benchmark's)."""
    _PRIVATE_LOOPS.add(loop)


def on_private_loop() -> bool:
    """True when running on a loop marked private: blocking calls there block only fenced."""
    try:
        return asyncio.get_running_loop() in _PRIVATE_LOOPS
    except RuntimeError:
        return False


class Portal:
    """An event loop on a daemon thread, and a way to run coroutines on it from other threads."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        # Backends may run short blocking calls inline on this loop: nobody else's code runs on it.
        mark_private(self.loop)
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
        self.pid = os.getpid()  # (for messages)
        self._fork_gen = _fork.generation()

    @property
    def closed(self) -> bool:
        return self._stopping or self.loop.is_closed()

    @property
    def forked(self) -> bool:
        """True in a child process forked after this portal started: its thread is not here."""
        return self._fork_gen != _fork.generation()

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
            _fork.left_behind(self)  # the parent's loop and thread: nothing of them runs here
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
