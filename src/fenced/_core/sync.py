"""The synchronous API: the asyncio implementation, driven on a private event-loop thread.

There is one implementation of every protocol (``lease.py`` and the backends); this module
only carries calls across to the loop thread and back (or, where the source allows it and the
loop is idle, lets the caller's thread run the loop for the call itself: ``portal``). The loop
thread also runs the keepalives, so a sync holder's lease is renewed while its own thread is
busy.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from . import fork as _fork
from .backend import Characteristic, LockStatus, Record, TokenCheck
from .errors import BackendUnavailable, LeaseLostError
from .leadership import Leader, LeaderChanges
from .lease import _UNSET, DEFAULT_TTL, AsyncLease, AsyncLocks, FenceTarget, NotFenced, _wants_token
from .paths import default_url
from .portal import Portal
from .state import Phase
from .token import FencingToken, validate_lock_name

__all__ = ["Leadership", "Lease", "Locks", "connect"]

T = TypeVar("T")
P = ParamSpec("P")

logger = logging.getLogger("fenced")

SyncLostCallback = Callable[["Lease"], None]

_MAKING_EVENTS = threading.Lock()


class Lease:
    """A lease held through a synchronous :class:`Locks`; see :class:`~fenced.AsyncLease`.

    ``lost`` is a :class:`threading.Event`; ``on_lost(lease)`` is called on the thread running
    fenced's loop at that moment (its own, or one driving it in a blocking call), so it must
    not block for long nor call blocking fenced methods (those raise ``RuntimeError`` there).
    """

    def __init__(self, locks: Locks, inner: AsyncLease, on_lost: SyncLostCallback | None) -> None:
        self._locks = locks
        self._inner = inner
        self.on_lost = on_lost
        self._lost: threading.Event | None = None  # made when first asked for (most never are)
        self._fork_gen = _fork.generation()
        inner.add_lost_hook(self._on_inner_lost)

    @property
    def aio(self) -> AsyncLease:
        """The underlying asyncio lease (its methods must run on the connection's loop:
        :meth:`Locks.run`)."""
        return self._inner

    @property
    def lost(self) -> threading.Event:
        """Set when the lease is lost (see :attr:`AsyncLease.lost`); cleared by acquire()."""
        if self._lost is None:
            # Under a lock: the loop's lost-hook may be making it at the same moment.
            with _MAKING_EVENTS:
                if self._lost is None:
                    event = threading.Event()
                    if self._inner.lost.is_set():
                        event.set()
                    self._lost = event
        return self._lost

    def _check_fork(self) -> None:
        # In a forked child the parent's grant stays the parent's: this lease starts over, not
        # held, and may be acquired anew through the child's own connection.
        if self._fork_gen != _fork.generation():
            self._fork_gen = _fork.generation()
            self._locks._check_fork()
            if self._lost is not None:
                self._lost.clear()

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
    def not_fenced(self) -> list[NotFenced]:
        """The ``fence=`` targets that could not be fenced (``fence_errors="report"``)."""
        return self._inner.not_fenced

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
        portal = self._locks._portal
        # (not where the call is refused: a refused acquire leaves a lost lease's event set)
        if self._lost is not None and not portal.running_loop_code():
            self._lost.clear()
        return portal.call(self._inner.acquire(timeout), undo=self._undo_acquire)

    async def _undo_acquire(self, _token: FencingToken) -> None:
        await self._inner.release()

    def renew(self) -> float:
        self._check_fork()
        return self._locks._portal.call(self._inner.renew())

    def release(self) -> bool:
        """Give the lock up; False if it was no longer held. Never frees a later grant. If it
        raises, the lease stays releasable: calling it again (or close()) retries it."""
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
        try:
            self._locks._portal.call(self._inner.finish(exc_type, exc))
        except BackendUnavailable:
            # The connection was closed under the body, and its close released the lease
            # (and said so: ``lost``): the block's outcome is that loss, not the closed call.
            cause = self._inner.lost.cause
            if cause is None:
                raise
            if exc is None:
                raise LeaseLostError(
                    f"lease on {self._inner.name!r} (token {self._inner.token}) was lost while held"
                ) from cause

    def __repr__(self) -> str:
        return repr(self._inner).replace("AsyncLease", "Lease", 1)


class Leadership:
    """:class:`~fenced.election.AsyncLeadership` through a synchronous :class:`Locks`:
    ``lost`` is a :class:`threading.Event`. ``Locks.elect`` makes it; :mod:`fenced.election`
    is its public home."""

    def __init__(self, lease: Lease, value: str) -> None:
        self._lease = lease
        self.value = value

    name = property(lambda self: self._lease.name)
    epoch = property(lambda self: self._lease.token, doc="This leadership's fencing token.")
    lease = property(lambda self: self._lease)
    lost = property(lambda self: self._lease.lost, doc="Set when leadership is lost.")
    held = property(lambda self: self._lease.held)
    not_fenced = property(lambda self: self._lease.not_fenced)

    def remaining(self) -> float:
        return self._lease.remaining()

    def resign(self) -> bool:
        return self._lease.release()

    def __enter__(self) -> Leadership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.resign()

    def __repr__(self) -> str:
        return f"<Leadership {self.name!r} epoch={self._lease.token} value={self.value!r}>"


class Locks:
    """A connection to one token source, for synchronous code: ``with fenced.connect(url) as locks``."""

    def __init__(self, url: str | object, *, require: Iterable[str] = (), **options: Any) -> None:
        self._async = AsyncLocks(url, require=require, **options)
        cls = self._async._cls
        self._portal_now = Portal(
            name=f"fenced-{cls.scheme}",
            drive=cls.caller_driven or cls.caller_waits,
            wait=cls.caller_waits,
        )
        try:
            self._portal_now.call(self._async.open())
        except BaseException:
            self._portal_now.stop()
            raise

    @property
    def _portal(self) -> Portal:
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
            _fork.left_behind(old)
            self._portal_now = Portal(name=old.thread.name, drive=old.drive, wait=old.waits)

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

    @property
    def portal(self) -> Portal:
        """The loop thread this connection runs on: ``locks.portal.call(coro)`` runs a
        coroutine there and returns its outcome, blocking — the way to use what only the
        async API offers (:attr:`aio`, or an object made on it, such as a replicated
        group's member) from synchronous code. Not from an ``on_lost`` callback (those run
        on the loop: ``RuntimeError``). In a child forked after :func:`connect`, a new one."""
        return self._portal

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
        description: str | None = None,
        fence: Iterable[FenceTarget] = (),
        fence_errors: str = "raise",
        lock_delay: float = 0.0,
    ) -> Lease:
        """A lease on ``name`` (not yet acquired): ``with locks.lock("x", ttl=10) as lease``.

        ``description`` is shown to operators with the holder's user, host and pid.
        ``fence=``: resources whose marks are raised to each new token before acquire returns
        (see :meth:`AsyncLocks.lock`)."""
        inner = self._async.lock(
            name,
            ttl=ttl,
            timeout=timeout,
            request_id=request_id,
            safety_margin=safety_margin,
            auto_renew=auto_renew,
            description=description,
            fence=fence,
            fence_errors=fence_errors,
            lock_delay=lock_delay,
        )
        return Lease(self, inner, on_lost)

    def elect(
        self,
        name: str,
        value: str = "",
        *,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        fence: Iterable[FenceTarget] = (),
        fence_errors: str = "raise",
        on_lost: SyncLostCallback | None = None,
        lock_delay: float = 0.0,
    ) -> Leadership:
        """Campaign for leadership of ``name`` until elected (see :mod:`fenced.election`)."""
        lease = self.lock(
            name, ttl=ttl, timeout=timeout, on_lost=on_lost, description=value or None,
            fence=fence, fence_errors=fence_errors, lock_delay=lock_delay,
        )  # fmt: skip
        lease.acquire()
        return Leadership(lease, value)

    def observe(
        self, name: str, *, interval: float = 0.1, stop: threading.Event | None = None
    ) -> Iterator[Leader]:
        """Who leads ``name``, each time it changes (see :mod:`fenced.election`); ends when
        ``stop`` is set (an observer on a thread of its own has no other way out while
        nothing changes)."""
        changes = LeaderChanges(validate_lock_name(name))
        stop = stop or threading.Event()
        while not stop.is_set():
            change = changes.update(self.status(name))
            if change is not None:
                yield change
            stop.wait(interval)

    def locked(
        self, name: str, *, ttl: float = DEFAULT_TTL, timeout: float | None = None, **options: Any
    ) -> Callable[[Callable[P, T]], Callable[P, T]]:
        """Decorate a function to run while holding ``name``: ``@locks.locked("nightly", ttl=60)``.

        Each call acquires (waiting up to ``timeout``), runs the function and releases, as
        ``with locks.lock(...)`` does (LeaseLostError if the lease was lost meanwhile). If the
        function has a parameter named ``token``, the grant's :class:`FencingToken` is passed
        to it by keyword, for the guarded writes it makes.
        """

        def decorate(fn: Callable[P, T]) -> Callable[P, T]:
            if inspect.iscoroutinefunction(fn):
                raise TypeError(
                    f"{fn.__qualname__} is a coroutine function: decorate it with "
                    "AsyncLocks.locked (fenced.connect_async), not Locks.locked"
                )
            pass_token = _wants_token(fn)

            @functools.wraps(fn)
            def run(*args: P.args, **kwargs: P.kwargs) -> T:
                with self.lock(name, ttl=ttl, timeout=timeout, **options) as lease:
                    if pass_token:
                        kwargs["token"] = lease.token
                    return fn(*args, **kwargs)

            return run

        return decorate

    def status(self, name: str) -> LockStatus:
        """Holder, token, highest token and time left of ``name``."""
        return self._portal.call(self._async.status(name))

    def force_release(
        self, name: str, token: FencingToken | str | None = None
    ) -> LockStatus | None:
        """Free ``name`` whoever holds it (see :meth:`AsyncLocks.force_release`)."""
        return self._portal.call(self._async.force_release(name, token))

    def check(self, token: FencingToken | str) -> TokenCheck:
        """Ask the source about ``token`` (see :meth:`AsyncLocks.check`)."""
        return self._portal.call(self._async.check(token))

    def read_record(self, name: str) -> Record | None:
        """The source's record ``name`` (see :meth:`AsyncLocks.read_record`)."""
        return self._portal.call(self._async.read_record(name))

    def swap_record(self, name: str, version: int, value: str) -> Record:
        """Compare-and-set a record (see :meth:`AsyncLocks.swap_record`)."""
        return self._portal.call(self._async.swap_record(name, version, value))

    def lock_names(self) -> list[str]:
        """The names of the locks the source knows, sorted."""
        return self._portal.call(self._async.lock_names())

    def close(self) -> None:
        """Release every lease still held through this connection, close it, stop its thread.

        Safe while other threads use the connection (see :meth:`AsyncLocks.aclose`): their
        new and waiting acquires raise BackendUnavailable, releases in flight finish, and
        once this returns no grant made through it is held, or a warning on the ``fenced``
        logger names each lease it could not release.

        Not from an ``on_lost`` callback (it runs on the thread this would stop): that raises
        RuntimeError and leaves the connection open and working.
        """
        self._check_fork()
        if self._portal.closed:
            return
        if self._portal.running_loop_code():
            raise RuntimeError("a fenced connection cannot be closed from a lost-lease callback")
        self._portal.stop(final=self._async.aclose())

    def __enter__(self) -> Locks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._async).replace("AsyncLocks", "Locks", 1)


def connect(
    url: str | object | None = None, *, require: Iterable[str] = (), **options: Any
) -> Locks:
    """Open a token source by URL: ``sqlite:////abs/path.db``, ``etcd://h:p``, ``postgresql://…`` …

    With no URL, the one the command line uses: ``$FENCED_URL``, else the machine-wide SQLite
    file (``/var/tmp/fenced/locks.db``, shared by every local user).

    Instead of a URL, a client the application already has: ``fenced.connect(redis_client)``
    (redis-py, sync or asyncio), a psycopg connection or pool, a ``KazooClient``. fenced reads
    where it points and opens its own connection there; every safety check still runs.

    ``require`` names characteristics (e.g. ``{"linearizable"}``) that the source must have;
    one lacking any is refused with :class:`~fenced.ConfigurationError`. Signing (every source,
    docs/signing.md): ``signing_key=`` signs each grant, bound to ``source_id=`` (the source's
    stable id) when given; ``verify=`` (a keyring, public keys suffice) checks tokens in
    :meth:`~Locks.check`. Further keyword options go to the backend.
    """
    return Locks(default_url() if url is None else url, require=require, **options)
