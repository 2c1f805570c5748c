"""A private event loop on a daemon thread, and the way to run coroutines on it from others.

The synchronous API (``_sync``) and the synchronous guards drive fenced's asyncio code through
a :class:`Portal`. Only fenced's own code runs on a portal's loop, which is what
:func:`on_private_loop` tells a backend: it may then make short blocking calls (an SQLite
transaction) inline instead of paying for a hop to a worker thread.

**Two modes.** A hop to the loop thread and back costs two thread switches (50-90 µs on a
VM), more than an SQLite transaction. So a portal made with ``drive=True`` lets the calling
thread run the loop's work itself whenever the loop thread is idle: the *fast mode*, which
needs CPython's asyncio internals and lives, alone in fenced, in ``_portal_fast``. It is used
only where its probe finds those internals as expected; otherwise, or with ``drive=False``, or
with ``FENCED_PORTAL=portable`` in the environment (or ``mode="portable"``), the portal runs in
its *portable mode*: a plain ``SelectorEventLoop`` and public asyncio only
(``call_soon_threadsafe``), one hop to the loop thread per call. Both modes run the same
coroutines with the same outcome, interruption and undo rules; only the thread differs.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (C module: signal's enum wrappers are slow)
import _thread
import asyncio
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, Literal, TypeVar

from . import clock as _clock
from . import fork as _fork
from . import portal_fast as _portal_fast
from .errors import BackendUnavailable, ConfigurationError

__all__ = [
    "Portal",
    "PortalMode",
    "commits_per_turn",
    "mark_private",
    "on_private_loop",
    "portal_mode",
]

T = TypeVar("T")

PortalMode = Literal["fast", "portable"]
_MODES: tuple[PortalMode, ...] = ("fast", "portable")


def portal_mode(mode: str | None = None) -> PortalMode:
    """The mode asked for: ``mode`` if given, else ``$FENCED_PORTAL``, else ``"fast"`` (which
    a portal still uses only with ``drive=True`` and where the fast mode's probe passes)."""
    asked = mode if mode is not None else (os.environ.get("FENCED_PORTAL") or "fast")
    for known in _MODES:
        if asked == known:
            return known
    where = "mode" if mode is not None else "FENCED_PORTAL"
    raise ConfigurationError(f"{where} must be 'fast' or 'portable', not {asked!r}")


logger = logging.getLogger("fenced")

_PRIVATE_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_TURN_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def mark_private(loop: asyncio.AbstractEventLoop, *, commit_per_turn: bool = False) -> None:
    """Declare that only fenced's code runs on ``loop`` (a portal's, a server's, a benchmark's).

    ``commit_per_turn``: for a loop serving many concurrent callers (``fenced serve``), a
    source may gather the writes of one turn of the loop into one commit, made on the loop
    itself at the end of the turn (what Redis does with its append-only file before it
    answers), instead of handing each to a worker thread.
    """
    _PRIVATE_LOOPS.add(loop)
    if commit_per_turn:
        _TURN_LOOPS.add(loop)


def commits_per_turn(loop: asyncio.AbstractEventLoop) -> bool:
    """True if ``loop`` was marked private with ``commit_per_turn``."""
    return loop in _TURN_LOOPS


def on_private_loop() -> bool:
    """True when running on a loop marked private: blocking calls there block only fenced."""
    try:
        return asyncio.get_running_loop() in _PRIVATE_LOOPS
    except RuntimeError:
        return False


class Portal:
    """An event loop on a daemon thread, and a way to run coroutines on it from other threads.

    With ``drive=True`` a caller runs its coroutine on its own thread while the loop thread is
    idle (see the module's docstring): for code that does not mind which thread runs it.
    """

    def __init__(
        self,
        name: str,
        *,
        drive: bool = False,
        mode: PortalMode | None = None,
        wait: bool = False,
    ) -> None:
        self._fast: _portal_fast.FastLoop | None = None
        asked = portal_mode(mode)  # (checked even where unused: a typo is said at once)
        if drive and asked == "fast" and _portal_fast.available():
            wait = wait and _portal_fast.waiting_available()
            self._fast = _portal_fast.FastLoop(wait=wait)
            # (asyncio's debug mode checks that only the loop's own thread schedules on it)
            if self._fast.loop.get_debug():
                self._fast.loop.close()
                self._fast = None
        self.loop: asyncio.AbstractEventLoop = (
            self._fast.loop if self._fast is not None else asyncio.SelectorEventLoop()
        )
        # Backends may run short blocking calls inline on this loop: nobody else's code runs on it.
        mark_private(self.loop)
        self._stopping = False
        self._undoing: set[asyncio.Task[object]] = set()
        ready = threading.Event()
        fast = self._fast

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(ready.set)
            if fast is not None:
                fast.run_forever()
            else:
                self.loop.run_forever()

        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()
        ready.wait()
        self._thread_id = self.thread.ident
        self.pid = os.getpid()  # (for messages)
        self._fork_gen = _fork.generation()

    @property
    def drive(self) -> bool:
        """True in the fast mode: callers run their calls themselves while the loop is idle."""
        return self._fast is not None

    @property
    def waits(self) -> bool:
        """True if callers also wait for I/O in the loop's ``select()`` (``wait=True``, where
        the fast mode runs and epoll can nest): each drives its call to the end."""
        return self._fast is not None and self._fast.waits

    @property
    def closed(self) -> bool:
        return self._stopping or self.loop.is_closed()

    def running_loop_code(self, ident: int | None = None) -> bool:
        """True on the thread running this loop's work now (its own, or a driving caller's):
        a blocking call into the portal from there would wait for itself."""
        ident = _thread.get_ident() if ident is None else ident
        return ident == self._thread_id or (self._fast is not None and ident == self._fast.driver)

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
        ident = _thread.get_ident()
        if self.running_loop_code(ident):
            coro.close()
            raise RuntimeError(
                "a blocking fenced call was made on fenced's event loop (in a lost-lease "
                "callback, or a coroutine the portal runs): it would wait for itself"
            )
        # The fast modes run the loop's work on this thread. On the main thread, a signal
        # handler of the application's runs between any two bytecodes: one that raises could
        # land inside asyncio's own bookkeeping (a timer popped and never run: a call waiting
        # forever), and a slow one would stop every keepalive. So there, with any handler of
        # the application's installed, the call hops to the loop thread instead.
        fast = self._fast
        if fast is not None and ident == _MAIN_THREAD and _app_signal_handlers():
            fast = None
        if fast is not None and fast.waits:
            through = self._call_through(fast, ident, coro, undo)
            if through:
                return through[0]
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

        # Ctrl-C (SIGINT, on the main thread) is let through only while this thread waits
        # for the outcome: there the call is cancelled, or undone if it completed. Anywhere
        # else (running the loop's work here, or taking the outcome) it could strike between
        # a grant and its bookkeeping, so it is held back and raised inside the ``try``.
        gate = _SigintGate.enter(ident)
        try:
            try:
                if fast is not None and not fast.waits:
                    driven = fast.try_drive(ident, run, started, lambda: self._stopping)
                    if driven is None:
                        coro.close()
                        raise BackendUnavailable("this fenced connection is closed")
                else:
                    driven = False
                if not driven:
                    try:
                        self.loop.call_soon_threadsafe(start)
                    except RuntimeError:  # closed meanwhile
                        run.close()
                        coro.close()
                        raise BackendUnavailable("this fenced connection is closed") from None
                if gate is not None and gate.wait_begins():
                    raise KeyboardInterrupt
                latch.acquire()
                if gate is not None and gate.leave():
                    raise KeyboardInterrupt
            except BaseException:
                # Interrupted. Decide on the loop thread, where the call ends, so that
                # "cancelled in time" and "completed, so undo it" cannot both miss.
                with contextlib.suppress(RuntimeError):
                    self.loop.call_soon_threadsafe(
                        self._abandon, started, run, coro, result if undo else None, undo
                    )
                raise
        finally:
            if gate is not None:
                gate.leave()
        if error:
            raise error[0]
        return result[0]

    def _call_through(
        self,
        fast: _portal_fast.FastLoop,
        ident: int,
        coro: Coroutine[Any, Any, T],
        undo: Callable[[T], Coroutine[Any, Any, object]] | None,
    ) -> tuple[T] | None:
        """The waiting mode: ``(outcome,)`` if this thread drove the call to its end, None if
        the loop was busy (then the call goes to the loop thread as a hop). ``coro`` runs as
        the task itself (no wrapper, no latch: this thread sees it end). Ctrl-C is let
        through only while this thread waits in ``select()``, and ends the call as a hop's
        does: cancelled, or undone if it completed."""
        started: list[asyncio.Task[T]] = []
        gate = _SigintGate.enter(ident)
        try:
            try:
                driven = fast.drive_through(ident, coro, started, self._closing, gate)
                if driven is None:
                    coro.close()
                    raise BackendUnavailable("this fenced connection is closed")
                if not driven:
                    return None
                if gate is not None and gate.leave():
                    raise KeyboardInterrupt  # held back at the end of the call
            except BaseException:
                with contextlib.suppress(RuntimeError):
                    self.loop.call_soon_threadsafe(self._abandon_task, started, coro, undo)
                raise
        finally:
            if gate is not None:
                gate.leave()
        task = started[0]
        if task.cancelled():  # only stop() cancels a call someone waits for
            raise BackendUnavailable("the fenced connection was closed")
        return (task.result(),)

    def _closing(self) -> bool:
        return self._stopping

    def _abandon_task(
        self,
        started: list[asyncio.Task[T]],
        coro: Coroutine[Any, Any, T],
        undo: Callable[[T], Coroutine[Any, Any, object]] | None,
    ) -> None:
        """:meth:`_abandon` for a call that ran as its own task (:meth:`_call_through`)."""
        if not started:
            coro.close()
            return
        task = started[0]

        def after(_task: object = None) -> None:
            if task.cancelled() or task.exception() is not None:
                return  # (retrieved: not logged as never retrieved)
            if undo is not None:
                job: asyncio.Task[object] = self.loop.create_task(undo(task.result()))
                self._undoing.add(job)
                job.add_done_callback(self._undone)

        if task.done():
            after()
        else:
            task.cancel()
            task.add_done_callback(after)

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

    def stop(self, final: Coroutine[Any, Any, object] | None = None) -> None:
        """Stop the loop and its thread. ``final`` (what closes the objects living on the
        loop) runs there first, while it still can; the loop stops even if it fails."""
        if final is not None:
            if self.closed or self.forked:
                final.close()
            else:
                try:
                    self.call(final)
                except BackendUnavailable:
                    # Another thread's close stopped the loop under this one (its final
                    # had ended: this one waited for it): closed, as asked.
                    if not self._stopping:
                        raise
                finally:
                    self.stop()
                return
        if self.closed:
            return
        if self.forked:
            _fork.left_behind(self)  # the parent's loop and thread: nothing of them runs here
            self._stopping = True
            return
        if self.running_loop_code():
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


class _SigintGate:
    """Python's default SIGINT handler, replaced for one portal call on the main thread: it
    raises KeyboardInterrupt only while the caller waits, and otherwise notes it."""

    __slots__ = ("held", "replaced", "waiting")

    def __init__(self) -> None:
        self.held = False
        self.waiting = False
        self.replaced = True

    def __call__(self, signum: int, frame: object) -> None:
        if self.waiting:
            raise KeyboardInterrupt
        self.held = True

    @staticmethod
    def enter(ident: int) -> _SigintGate | None:
        """A gate in place of the default handler; None off the main thread or when the
        application installed a handler of its own (which is then left alone)."""
        if ident != _MAIN_THREAD or _signal.getsignal(_signal.SIGINT) is not _DEFAULT_SIGINT:
            return None
        gate = _SigintGate()
        _signal.signal(_signal.SIGINT, gate)
        return gate

    def wait_begins(self) -> bool:
        """From now on SIGINT raises; True if one was held back already (while this thread
        drove the call, which may be queued at the source by now): raise it, don't wait."""
        self.waiting = True
        return self.held

    def leave(self) -> bool:
        """Put the default handler back; True if SIGINT arrived while it was held back."""
        self.waiting = False
        if self.replaced:
            self.replaced = False
            _signal.signal(_signal.SIGINT, _DEFAULT_SIGINT)
        return self.held


_MAIN_THREAD = threading.main_thread().ident
_DEFAULT_SIGINT = _signal.default_int_handler
_SIGNALS = tuple(
    int(s) for s in _signal.valid_signals() if s not in (_signal.SIGKILL, _signal.SIGSTOP)
)
# What a signal's handler is when the application installed none: the default, ignored, not
# set from Python, or (SIGINT) Python's own, which the portal's gate stands in for.
_NOT_THE_APPS = frozenset({_signal.SIG_DFL, _signal.SIG_IGN, None, _DEFAULT_SIGINT})


def _app_signal_handlers() -> bool:
    """True if the application installed a Python signal handler (~2 µs: ``_signal``'s C
    ``getsignal`` for each signal; the ``signal`` module's wraps it in an enum, 20× slower)."""
    return not _NOT_THE_APPS.issuperset(map(_signal.getsignal, _SIGNALS))


async def _cancel_all(timeout: float = 5.0) -> None:
    """Cancel every other task on this loop and give them ``timeout`` seconds to finish."""
    me = asyncio.current_task()
    deadline = _clock.now() + timeout
    while (tasks := [t for t in asyncio.all_tasks() if t is not me]) and _clock.now() < deadline:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=max(0.0, deadline - _clock.now()))
