"""The asyncio lease API: the single implementation that the synchronous API also runs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterable
from types import TracebackType
from typing import Any, Final, ParamSpec, TypeVar

from . import clock as _clock
from . import fork as _fork
from .adopt import adopt_client
from .backend import (
    MAX_OWNER,
    MAX_RECORD,
    Backend,
    Characteristic,
    Grant,
    LockStatus,
    Record,
    TokenCheck,
    backend_class,
    check_requirements,
    parse_url,
    redacted,
)
from .backoff import Backoff
from .errors import (
    AccessDenied,
    BackendUnavailable,
    ConfigurationError,
    FencedError,
    FenceError,
    InvalidTokenError,
    LeaseLostError,
    NotHeldError,
)
from .leadership import Leader, LeaderChanges
from .options import Option
from .paths import default_url
from .signing import Keyring, TokenVerifier, check_source_id, signer, token_message
from .state import (
    DEFAULT_TTL,
    MAX_TIMEOUT,
    LeaseState,
    Phase,
    check_lock_delay,
    check_request_id,
    check_timeout,
)
from .token import FencingToken, validate_lock_name

__all__ = [
    "DEFAULT_TTL",
    "AsyncLeadership",
    "AsyncLease",
    "AsyncLocks",
    "AsyncLostCallback",
    "FenceTarget",
    "LostSignal",
    "NotFenced",
    "check_description",
    "connect_async",
]

_MAX_LATE_GRANTS: Final = 3
_FINAL_REFUSALS: Final = (InvalidTokenError, AccessDenied, ConfigurationError)
"""What a renewal may be refused with, besides LeaseLostError (not the holder), that asking
again cannot change: the source no longer takes the grant's token (a ``fenced serve``
restarted with signing newly on, a rotated key, another source id), this client's
credentials, or the request (a ``fenced serve`` restarted with a lower maximum ttl). The lease is lost at once, as the JavaScript and Java clients do;
BackendUnavailable and timeouts are asked again while the lease lasts."""
_ACQUIRE_GRACE: Final = 2.0
"""Seconds past its deadline an acquire's call to its source may take at most (each source
bounds its own by the deadline + 1 s: this is the backstop)."""
_CLOSE_SETTLE: Final = 5.0
"""Seconds close() gives, all together, the acquires and releases in flight to end and then the
leases still held to be released (at once), before it closes the source; the releases get at
least _CLOSE_RELEASE of it. So a close ends within about _CLOSE_SETTLE + _CLOSE_RELEASE + the
source's own close, however many leases (each call is bounded by its source's timeout too)."""
_CLOSE_RELEASE: Final = 1.0
DEFAULT_CONNECT_TIMEOUT: Final = 10.0
"""Seconds opening a connection may take (retrying a source that is down) by default."""
_CONNECT_TIMEOUT: Final = Option("number", low=0, low_open=True, high=MAX_TIMEOUT)

logger = logging.getLogger("fenced")

_UNSET: Final[Any] = object()

P = ParamSpec("P")
T = TypeVar("T")

AsyncLostCallback = Callable[["AsyncLease"], Awaitable[None] | None]

FenceTarget = Any
"""Something ``fence=`` can raise to a new token: an object with a ``fence(token)`` method
(sync or async: every guard of :mod:`fenced.guards` has one, SQL through
``SQLGuard.fencer(connect)``), or a callable ``fn(token)``. An object that lives on the
connection's own loop (a synchronous :class:`fenced.replicated.Group`) offers
``async_fence(token)``, awaited there instead."""


@dataclasses.dataclass(frozen=True, slots=True)
class NotFenced:
    """A ``fence=`` target whose mark could not be raised, and why."""

    target: Any
    error: BaseException

    def __str__(self) -> str:
        return f"{self.target!r}: {type(self.error).__name__}: {self.error}"


async def fence_all(token: FencingToken, targets: tuple[Any, ...]) -> list[NotFenced]:
    """Raise every target's mark to ``token``, all at once; the ones that failed. A
    synchronous ``fence`` runs on a worker thread (it may block on its database)."""

    async def one(target: Any) -> NotFenced | None:
        fn = getattr(target, "async_fence", None) or getattr(target, "fence", target)
        try:
            if hasattr(target, "async_fence") or inspect.iscoroutinefunction(fn):
                await fn(token)
            else:
                result = await asyncio.to_thread(fn, token)
                if inspect.isawaitable(result):
                    await result
        except Exception as exc:  # (each failure is reported, never swallowed)
            return NotFenced(target, exc)
        return None

    results = await asyncio.gather(*(one(t) for t in targets))
    return [r for r in results if r is not None]


class LostSignal:
    """Set when a held lease is lost. ``await lease.lost`` waits for it; returns the cause."""

    __slots__ = ("_cause", "_event")

    def __init__(self) -> None:
        # Made when first waited on: most leases end without anyone waiting on their loss.
        self._event: asyncio.Event | None = None
        self._cause: BaseException | None = None

    def is_set(self) -> bool:
        return self._cause is not None

    @property
    def cause(self) -> BaseException | None:
        """Why the lease was lost (a :class:`~fenced.LeaseLostError`), or None."""
        return self._cause

    async def wait(self) -> BaseException | None:
        if self._cause is None:
            if self._event is None:
                self._event = asyncio.Event()
            await self._event.wait()
        return self._cause

    def __await__(self) -> Generator[Any, None, BaseException | None]:
        return self.wait().__await__()

    def _set(self, cause: BaseException) -> None:
        self._cause = cause
        if self._event is not None:
            self._event.set()

    def _clear(self) -> None:
        self._cause = None
        if self._event is not None:
            self._event.clear()


class AsyncLease:
    """One lock, acquired and held by this client; use ``async with`` or acquire()/release().

    Ordering, shown with two clients of one lock ``"jobs"``::

        a = locks.lock("jobs", ttl=5)     # client A
        ta = await a.acquire()            # jobs:7
        # ... A is paused for longer than 5 s; its lease expires ...
        b = other.lock("jobs", ttl=5)     # client B
        tb = await b.acquire()            # jobs:8   (tb > ta: every grant is higher than all before it)
        # A wakes and writes with ta: a guarded resource that saw tb rejects it (StaleTokenError).
        # A's lease.lost is set, and A's release() returns False without touching B's grant.

    While held, a background task renews the lease about every ``ttl/3``; if renewal is refused
    or cannot succeed before the lease would expire, ``lost`` is set and ``on_lost`` is called.
    """

    def __init__(
        self,
        locks: AsyncLocks,
        name: str,
        *,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        on_lost: AsyncLostCallback | None = None,
        request_id: str | None = None,
        safety_margin: float | None = None,
        auto_renew: bool = True,
        description: str | None = None,
        fence: Iterable[FenceTarget] = (),
        fence_errors: str = "raise",
        lock_delay: float = 0.0,
    ) -> None:
        self._locks = locks
        self.name = validate_lock_name(name)
        self.lock_delay = check_lock_delay(lock_delay)
        self.fence_targets = tuple(fence)
        for target in self.fence_targets:
            if not callable(getattr(target, "fence", target)):
                raise ConfigurationError(
                    f"fence=: {target!r} has no fence(token) and is not callable"
                )
        if fence_errors not in ("raise", "report"):
            raise ConfigurationError(f"fence_errors={fence_errors!r}: 'raise' or 'report'")
        self.fence_errors = fence_errors
        self.not_fenced: list[NotFenced] = []
        self.description = check_description(description)
        self.timeout = check_timeout(timeout)
        self.on_lost = on_lost
        self.auto_renew = auto_renew
        self._request_id = None if request_id is None else check_request_id(request_id)
        self._state = LeaseState(ttl, safety_margin)
        self._last_token: FencingToken | None = None
        # A grant whose release raised (and whether it was held then): release() retries it.
        self._unreleased: tuple[Grant, bool] | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._keepalive_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.lost = LostSignal()
        self._lost_hooks: list[Callable[[BaseException], None]] = []
        self._fork_gen = _fork.generation()

    def add_lost_hook(self, hook: Callable[[BaseException], None]) -> None:
        """Call ``hook(cause)`` (on the loop, before ``on_lost``) each time the lease is lost.

        For wrappers of this lease (the synchronous :class:`~fenced.Lease`); must not block.
        """
        self._lost_hooks.append(hook)

    def _check_fork(self) -> None:
        """In a forked child, start over: the parent's grant, timers and loop stay its own."""
        if self._fork_gen == _fork.generation():
            return
        _fork.left_behind(self._state, self._keepalive, self._watchdog, self._keepalive_timer)
        self._fork_gen = _fork.generation()
        self._state = LeaseState(self._state.ttl, self._state.safety_margin)
        self._last_token = self._unreleased = None
        self._keepalive = self._watchdog = self._keepalive_timer = None
        self._loop = None
        self.lost = LostSignal()

    # -- what the holder may know -------------------------------------------------------

    @property
    def ttl(self) -> float:
        return self._state.ttl

    @property
    def token(self) -> FencingToken:
        """The token of the current (or, after release or loss, the last) grant."""
        self._check_fork()
        if self._last_token is None:
            raise NotHeldError(f"lease on {self.name!r} has never been acquired")
        return self._last_token

    @property
    def request_id(self) -> str | None:
        """The id of the current or last acquire (makes retries idempotent): a ``request_id``
        given to the lease is its first grant's; each later acquire draws a new one."""
        return self._state.grant.request_id if self._state.grant else self._request_id

    @property
    def phase(self) -> Phase:
        return self._state.phase

    @property
    def owner(self) -> str:
        """How this holder describes itself to operators (``fenced status``): ``user@host pid
        N``, and ``: <description>`` when one was given to :meth:`AsyncLocks.lock`."""
        me = _fork.whoami()
        owner = f"{me}: {self.description}" if self.description else me
        return owner[:MAX_OWNER]

    @property
    def held(self) -> bool:
        """True while the lease is surely held: acquired, not released, not lost, not expired."""
        return self.remaining() > 0

    def remaining(self) -> float:
        """Seconds the lease is *surely* still held.

        Counted from when the acquire or last successful renew request was *sent* (the source
        cannot have started the lease earlier), minus ``safety_margin``. 0 when not held.
        """
        self._check_fork()
        return self._state.remaining(_clock.now())

    # -- acquire / renew / release -------------------------------------------------------

    async def acquire(self, timeout: float | None = _UNSET) -> FencingToken:
        """Block until granted (FIFO among waiters) or ``timeout`` seconds pass.

        ``timeout=None`` waits forever, ``0`` tries once. Returns the token, which is strictly
        greater than every token granted for this lock before. Raises
        :class:`~fenced.LockTimeout`; if the source is unreachable, retries with the same
        request id (so a grant whose reply was lost is not taken twice) until the timeout,
        then raises :class:`~fenced.BackendUnavailable`.
        """
        timeout = self.timeout if timeout is _UNSET else check_timeout(timeout)
        self._check_fork()
        start = _clock.now()
        locks = self._locks
        backend = locks._backend  # (open already, nearly always: then no coroutine to await)
        if backend is None or locks._closing or locks._fork_gen != _fork.generation():
            backend = await locks._get_backend(None if timeout is None else start + timeout)
            if locks._closing:  # (close() began while it opened)
                raise locks._closed_error()
        # Counted from here until the grant is in ``_held`` (or the acquire failed), with no
        # await between the check above and this: close() waits for it, or stops it.
        task = locks._call_begins(acquiring=True)
        try:
            self._state.start_acquiring()
            self._loop = asyncio.get_running_loop()
            # A request id names one attempt: the given one is this lease's first grant's; an
            # acquire after that grant (released or lost) is a new attempt, under a new id (a
            # gateway answers the old one's late duplicate as ended: docs/server.md).
            given = self._request_id if self._last_token is None else None
            request_id = given or _fork.request_id()
            deadline = None if timeout is None else start + timeout
            # With no deadline, a dead source is given a bounded time to come back.
            give_up = deadline if deadline is not None else start + max(self.ttl, 5.0)
            backoff = Backoff(0.02, 1.0)
            granted: list[FencingToken] = []  # the grant this acquire's lost-callback is about
            on_lost = self._make_backend_lost_callback(granted)
            late = 0  # grants that arrived with no time left
            try:
                while True:
                    try:
                        # Each source bounds its calls by the deadline (+ 1 s for a last
                        # answer); this is the backstop for one that does not, so that a
                        # user's timeout is honoured whatever the source.
                        async with _until(deadline, self.name, backend.scheme):
                            grant = await backend.acquire(
                                self.name,
                                request_id=request_id,
                                # Lock-delay: the source keeps the grant ``lock_delay`` past
                                # the holder's own view of it (which stays ``ttl``), so after
                                # an expiry no one else is granted it for that long, by the
                                # source's clock; a release frees it at once.
                                ttl=self.ttl + self.lock_delay,
                                deadline=deadline,
                                on_lost=on_lost,
                                owner=self.owner,
                            )
                    except LeaseLostError:
                        # (fenced serve: this request id's grant was made and has ended — its
                        # answer lost until after its ttl: a new attempt, with a new id)
                        late += 1
                        request_id = _fork.request_id()
                        if late >= _MAX_LATE_GRANTS or (
                            deadline is not None and _clock.now() >= deadline
                        ):
                            raise
                        continue
                    except BackendUnavailable:
                        # A closed connection will not come back: only a dead source is retried.
                        # (a whole pause or none: waking at the deadline leaves no time to try)
                        pause = backoff.next(give_up - _clock.now(), whole=True)
                        if self._locks._closing or pause is None:
                            raise
                        logger.debug("acquire %s: source unavailable, retrying", self.name)
                        await asyncio.sleep(pause)
                        continue
                    if self._state.remaining_of(grant, _clock.now()) > 0:
                        break
                    # Granted, but the reply took so long that the lease may already have run
                    # out: never hand out a lease that is not surely held. Give it back (fenced:
                    # it cannot free anyone else's) and ask again, with a new request id.
                    late += 1
                    with contextlib.suppress(FencedError):
                        await backend.release(grant)
                    request_id = _fork.request_id()
                    if late >= _MAX_LATE_GRANTS or (
                        deadline is not None and _clock.now() >= deadline
                    ):
                        raise LeaseLostError(
                            f"lease on {self.name!r} expired before the grant arrived ({late} "
                            f"time(s)): a ttl of {self.ttl:g} s is too short for this source's "
                            "round trip"
                        )
            except BaseException:
                self._state.acquire_failed()
                raise
            if self.lock_delay and grant.ttl < self.ttl + self.lock_delay - 1e-3:
                with contextlib.suppress(FencedError):
                    await backend.release(grant)
                raise ConfigurationError(
                    f"lock_delay={self.lock_delay:g}: the source granted {grant.ttl:g} s, not the "
                    f"{self.ttl + self.lock_delay:g} s (ttl + lock_delay) it needs; lower one of them"
                )
            granted.append(grant.token)
            self._state.granted(grant)
            token = self._last_token = self._locks._sign(grant.token)
            self.lost._clear()
            self._locks._held.add(self)
            if self.fence_targets:
                await self._fence_on_acquire(token)
            if self.auto_renew:
                # A timer, not a task, until the first renewal is due: most critical sections end
                # before that, and a task per acquire is a measurable share of a fast acquire.
                now = _clock.now()
                delay = min(self._state.renew_delay(now), self._state.remaining(now))
                self._keepalive_timer = self._loop.call_later(delay, self._start_keepalive)
            else:
                self._arm_watchdog()
            return token
        except asyncio.CancelledError:
            if locks._stopped_by_close(task):  # (a typed error, not the caller's cancellation)
                raise BackendUnavailable(
                    f"acquire of {self.name!r} ended: the connection to {_redact(locks.url)} "
                    "was closed"
                ) from None
            raise
        finally:
            locks._call_ends(task)

    async def _fence_on_acquire(self, token: FencingToken) -> None:
        """Raise every ``fence=`` resource's mark to the new token before the holder gets it
        (Junqueira: the new holder marks the resource before anything else), so an earlier
        holder is refused there even if this one never writes there. With
        ``fence_errors="raise"`` a failure gives the grant back and raises FenceError."""
        self.not_fenced = await fence_all(token, self.fence_targets)
        if self.not_fenced and self.fence_errors == "raise":
            with contextlib.suppress(FencedError):
                await self.release()
            n, total = len(self.not_fenced), len(self.fence_targets)
            raise FenceError(
                f"{self.name!r}: {n} of {total} resource(s) could not be fenced with {token}, "
                f"so the lock was given back: {self.not_fenced[0]}",
                self.not_fenced,
            ) from self.not_fenced[0].error
        for miss in self.not_fenced:
            logger.warning("lock %s: not fenced with %s: %s", self.name, token, miss)

    async def renew(self) -> float:
        """Renew now; return the new :meth:`remaining`. Raises LeaseLostError if it is gone."""
        self._check_fork()
        grant = self._require_held()
        try:
            try:
                new = await self._locks._backend_or_fail().renew(grant)
            except _FINAL_REFUSALS as exc:
                raise self._refused(exc) from exc
        except LeaseLostError as exc:
            # Only if it is still the grant we renewed: a release() and acquire() may have
            # run while this renewal was in flight, and the new grant is not lost.
            current = self._state.grant
            if current is not None and current.token == grant.token:
                self._mark_lost(exc)
            raise
        self._state.renewed(new)
        if not self.auto_renew:
            self._arm_watchdog()
        return self.remaining()

    async def release(self) -> bool:
        """Give the lock up. Fenced: never frees a later holder's grant.

        Returns True if this call released a grant it still held, False otherwise (already
        released, lost, expired or taken over). Safe to call more than once.

        If it raises (the source unreachable, or the call cancelled), the lease stays
        releasable: calling release() again asks the source again, and so does closing the
        connection (unless the lease's ttl has run out: the source has let it go then).
        Meanwhile ``held`` is False and the lease is not renewed (the release may have
        reached the source, and the caller has given the lease up).
        """
        self._check_fork()
        grant = self._state.grant
        locks = self._locks
        if self._state.phase not in (Phase.HELD, Phase.LOST) or grant is None:
            pending = self._unreleased
            if pending is None or pending[0] is not grant:
                return False
            # A release of this grant that raised: ask again.
            self._unreleased = None
            was_held = pending[1]
            backend = locks._backend_or_fail()
        else:
            backend = locks._backend_or_fail()
            self._stop_timers()
            was_held = self._state.phase is Phase.HELD
            self._state.released()
        # It stays in ``_held`` until the source has answered: close() names it if it gives
        # up waiting for it, and releases it again if this call fails.
        task = locks._call_begins()  # (close() waits for it before it closes the source)
        try:
            released = await backend.release(grant)
        except BaseException:
            # Its outcome is unknown: releasable again, and close() retries it while the
            # source may still hold the grant. Not once its ttl has run out (a lease lost by
            # expiry: the source has let it go as surely as a retry could): close() waiting
            # its bound out on that release again cost a poisoned `fenced elect` 5 s more.
            self._unreleased = (grant, was_held)
            if was_held or _clock.now() < grant.sent_at + grant.ttl:
                locks._held.add(self)
            else:
                locks._held.discard(self)  # (kept in it by close() while it was releasing)
            raise
        finally:
            locks._call_ends(task)
        locks._held.discard(self)
        if was_held and not released:
            # We believed we held it, but the source had already let it go: the critical
            # section just ended ran, at least in part, unprotected. Say so.
            self._signal_lost(
                LeaseLostError(
                    f"lease on {self.name!r} (token {grant.token}) had already expired or been "
                    "taken over when it was released"
                )
            )
        return released and was_held

    async def __aenter__(self) -> AsyncLease:
        await self.acquire()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.finish(exc_type, exc)

    async def finish(self, exc_type: type[BaseException] | None, exc: BaseException | None) -> None:
        """End a ``with`` block: release; if the body succeeded but the lease was lost while
        it ran, raise :class:`~fenced.LeaseLostError` (the block ran partly unprotected)."""
        if exc is None:
            try:
                await self.release()
            except FencedError:
                # A release refused after the lease was lost (credentials revoked, say) must
                # not hide the loss: the block's outcome is the loss.
                if self.lost.cause is None:
                    raise
                logger.debug("release %s after its loss failed", self.name, exc_info=True)
            cause = self.lost.cause
            if cause is not None:
                raise LeaseLostError(
                    f"lease on {self.name!r} (token {self._last_token}) was lost while held"
                ) from cause
        else:
            with contextlib.suppress(Exception):
                await self.release()

    # -- internals -----------------------------------------------------------------------

    def _require_held(self) -> Grant:
        if self._state.phase is Phase.LOST:
            raise LeaseLostError(f"lease on {self.name!r} was lost") from self._state.lost_cause
        if self._state.phase is not Phase.HELD or self._state.grant is None:
            raise NotHeldError(f"lease on {self.name!r} is not held")
        return self._state.grant

    def _start_keepalive(self) -> None:
        self._keepalive_timer = None
        if self._state.phase is Phase.HELD:
            self._keepalive = asyncio.create_task(
                self._keep_alive(), name=f"fenced-keepalive:{self.name}"
            )

    async def _keep_alive(self) -> None:
        backend = self._locks._backend_or_fail()
        state = self._state
        while state.phase is Phase.HELD:
            now = _clock.now()
            remaining = state.remaining(now)
            if remaining <= 0:
                self._mark_lost(LeaseLostError(f"lease on {self.name!r} expired: renewals failed"))
                return
            await asyncio.sleep(min(state.renew_delay(now), remaining))
            if state.phase is not Phase.HELD or state.grant is None:
                return
            grant = state.grant
            try:
                # A renewal that has not come back when the lease runs out cannot save it.
                async with asyncio.timeout(max(state.remaining(_clock.now()), 0.001)):
                    new = await backend.renew(grant)
            except LeaseLostError as exc:
                self._mark_lost(exc)
                return
            except _FINAL_REFUSALS as exc:
                self._mark_lost(self._refused(exc))
                return
            except (BackendUnavailable, TimeoutError) as exc:
                logger.debug("renew %s failed: %r", self.name, exc)
                state.renew_failed(_clock.now())
            except FencedError as exc:  # (a source's error that may pass: asked again)
                logger.warning("renew %s failed: %s: %s", self.name, type(exc).__name__, exc)
                state.renew_failed(_clock.now())
            except Exception as exc:  # a bug in a backend must not silently stop renewals
                logger.exception("renew %s failed unexpectedly", self.name)
                state.renew_failed(_clock.now())
                if state.remaining(_clock.now()) <= 0:
                    self._mark_lost(LeaseLostError(f"lease on {self.name!r}: {exc!r}"))
                    return
            else:
                state.renewed(new)

    def _refused(self, exc: BaseException) -> LeaseLostError:
        """The loss a final refusal of a renewal stands for, its reason kept (as cause)."""
        lost = LeaseLostError(
            f"lease on {self.name!r} lost: the source refused its renewal: "
            f"{type(exc).__name__}: {exc}"
        )
        lost.__cause__ = exc
        return lost

    def _arm_watchdog(self) -> None:
        """Without auto-renew, still report the loss when the lease runs out."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        assert self._loop is not None
        self._watchdog = self._loop.call_later(
            self.remaining(),
            lambda: self._mark_lost(
                LeaseLostError(f"lease on {self.name!r} expired (not renewed)")
            ),
        )

    def _stop_timers(self) -> None:
        if self._keepalive_timer is not None:
            self._keepalive_timer.cancel()
            self._keepalive_timer = None
        task, self._keepalive = self._keepalive, None
        if task is not None and task is not _current_task():
            task.cancel()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _make_backend_lost_callback(
        self, granted: list[FencingToken]
    ) -> Callable[[BaseException], None]:
        loop = asyncio.get_running_loop()

        def lost(cause: BaseException) -> None:
            def on_loop() -> None:
                # Matched by token, not request id: with a caller-chosen request id, a late
                # notice about an earlier grant must not mark a newer grant lost.
                grant = self._state.grant
                if grant is not None and granted and grant.token == granted[0]:
                    self._mark_lost(cause)

            try:
                loop.call_soon_threadsafe(on_loop)
            except RuntimeError:  # loop closed: nobody is left to tell
                pass

        return lost

    def _mark_lost(
        self, cause: BaseException, level: int = logging.WARNING, *, keep_held: bool = False
    ) -> None:
        """Lost to its holder; ``keep_held``: still counted held at the source (close() is
        releasing it: named if interrupted before its release has answered)."""
        if not self._state.lose(cause):
            return
        self._stop_timers()
        if not keep_held:
            self._locks._held.discard(self)
        self._signal_lost(cause, level)

    def _signal_lost(self, cause: BaseException, level: int = logging.WARNING) -> None:
        logger.log(level, "lease on %s (token %s) lost: %s", self.name, self._last_token, cause)
        self.lost._set(cause)
        for hook in self._lost_hooks:
            _call_safely(hook, cause)
        if self.on_lost is not None:
            callback = self.on_lost
            try:
                result = callback(self)
                if inspect.isawaitable(result):
                    task = asyncio.ensure_future(result)
                    task.add_done_callback(_log_task_error)
            except Exception:
                logger.exception("on_lost callback for %s failed", self.name)

    def __repr__(self) -> str:
        return f"<AsyncLease {self.name!r} {self._state.phase.value} token={self._last_token}>"


class AsyncLeadership:
    """This process leads ``name`` until :meth:`resign`, or until its lease is lost
    (``lost`` is set and ``on_lost`` called, as for a lease: stop acting as leader then).
    ``AsyncLocks.elect`` makes it; :mod:`fenced.election` is its public home."""

    def __init__(self, lease: AsyncLease, value: str) -> None:
        self._lease = lease
        self.value = value

    @property
    def name(self) -> str:
        return self._lease.name

    @property
    def epoch(self) -> FencingToken:
        """This leadership's fencing token: strictly greater than every earlier leader's."""
        return self._lease.token

    @property
    def lease(self) -> AsyncLease:
        return self._lease

    @property
    def lost(self) -> LostSignal:
        """Set when leadership is lost (``await leadership.lost`` waits for it)."""
        return self._lease.lost

    @property
    def held(self) -> bool:
        return self._lease.held

    @property
    def not_fenced(self) -> list[NotFenced]:
        """The ``fence=`` targets that could not be fenced (``fence_errors="report"``)."""
        return self._lease.not_fenced

    def remaining(self) -> float:
        """Seconds this process surely still leads (0 once it may not)."""
        return self._lease.remaining()

    async def resign(self) -> bool:
        """Step down now: the next candidate is elected at once (no ttl to wait out)."""
        return await self._lease.release()

    async def __aenter__(self) -> AsyncLeadership:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.resign()

    def __repr__(self) -> str:
        return f"<AsyncLeadership {self.name!r} epoch={self._lease.token} value={self.value!r}>"


class AsyncLocks:
    """A connection to one token source: ``async with fenced.connect_async(url) as locks``."""

    def __init__(self, url: str | object, *, require: Iterable[str] = (), **options: Any) -> None:
        if not isinstance(url, str):  # a client the application already has (see _adopt)
            url, adopted = adopt_client(url)
            options = {**adopted, **options}
        # Signing is the core's, whatever the source: every grant's token leaves signed,
        # bound to the source's id when it has one (stable configuration: v2 tokens).
        self._signer = signer(options.pop("signing_key", None))
        self._source_id = check_source_id(options.pop("source_id", None))
        if self._signer is not None and self._source_id is None:
            _warn_unbound_once()
        accept_unbound = bool(options.pop("accept_unbound", False))
        verify: TokenVerifier | None = options.pop("verify", None)
        if verify is not None and not callable(getattr(verify, "verify", None)):
            # (its type only: a key's text given here by mistake may be the secret)
            raise ConfigurationError(
                f"verify= takes a Keyring (fenced.load_keys), not {type(verify).__name__}"
            )
        # What check() verifies a token with, before asking the source: verify= (public keys
        # suffice), else this connection's own key's public half. With either, an unsigned
        # token is refused, as guards and fenced serve's /v1/check refuse it.
        # accept_unbound widens this connection's own keyring only, one naming its source:
        # anywhere else it would be silently ignored, so it is refused.
        if accept_unbound and (verify is not None or self._signer is None or not self._source_id):
            raise ConfigurationError(
                "accept_unbound=True needs signing_key= and source_id= (and no verify=: give "
                "accept_unbound to that Keyring): a keyring without a source accepts unbound "
                "tokens only"
            )
        self._own_keys: TokenVerifier | None = verify
        if verify is None and self._signer is not None:
            self._own_keys = Keyring(
                [self._signer.public()],
                source_id=self._source_id,
                accept_unbound=accept_unbound,
            )
        self.url = url
        self._cls = backend_class(url)
        self._require = check_requirements(self._cls, require)
        # connect_timeout bounds opening, whatever the source; a source with an option of
        # that name (its per-attempt bound) gets it too.
        given = options.get("connect_timeout", DEFAULT_CONNECT_TIMEOUT)
        try:
            self.connect_timeout = _CONNECT_TIMEOUT.convert(given)
        except ValueError as exc:
            raise ConfigurationError(f"connect_timeout={given!r}: {exc}") from None
        if "connect_timeout" not in self._cls.option_schema:
            options.pop("connect_timeout", None)
        self._options = options
        self._backend: Backend | None = None
        self._opening: asyncio.Lock | None = None
        self._closed = False
        # close() has begun: no new acquire starts; those in flight are stopped, releases in
        # flight awaited, then every lease still held is released (see aclose).
        self._closing = False
        self._in_flight = 0  # acquires and releases running now
        self._acquiring: set[asyncio.Task[Any]] = set()  # the tasks running those acquires
        self._stopped: set[asyncio.Task[Any]] = set()  # those close() cancelled
        self._settled: asyncio.Event | None = None  # set when _in_flight drops to 0 (closing)
        self._close_done: asyncio.Event | None = None
        self._held: weakref.WeakSet[AsyncLease] = weakref.WeakSet()
        # What was built on this connection and closes with it, first (replicated groups):
        # weakly, so that a group the caller dropped is not kept alive by it.
        self._dependents: weakref.WeakSet[Any] = weakref.WeakSet()
        self._dependents_lock = threading.Lock()  # (a sync Group registers from its thread)
        self._fork_gen = _fork.generation()

    def _check_fork(self) -> None:
        """In a forked child: a new connection on first use; the parent's is never touched.

        The inherited backend shares sockets and sessions with the parent: using or closing
        it here would cut or corrupt the parent's connection, so it is kept aside for good.
        """
        if self._fork_gen == _fork.generation():
            return
        _fork.left_behind(self._backend, self._opening, self._held)
        self._fork_gen = _fork.generation()
        self._backend = None
        self._opening = None
        self._held = weakref.WeakSet()
        self._dependents = weakref.WeakSet()  # (the parent's: closing them here would cut it)
        self._dependents_lock = threading.Lock()
        self._in_flight = 0  # (the parent's calls: they do not run here)
        self._acquiring = set()
        self._stopped = set()

    @property
    def characteristics(self) -> frozenset[Characteristic]:
        """What this token source promises (see :class:`~fenced.Characteristic`); once open,
        what this connection promises as the server is configured."""
        if self._backend is not None:
            return self._backend.effective_characteristics
        return self._cls.characteristics

    @property
    def backend(self) -> Backend:
        return self._backend_or_fail()

    # -- what the rooms above (fenced serve, groups) use of a connection ----------------------

    async def opened_backend(self) -> Backend:
        """The open backend, opening it first if needed (as any call would)."""
        return await self._get_backend()

    def close_with(self, dependent: Any) -> None:
        """Close ``dependent`` (something built on this connection that holds connections
        of its own: a replicated group) when this connection closes: its ``aclose()`` is
        awaited first, before the leases are released and the source closed. Kept by a weak
        reference. On a connection closing or closed, :class:`~fenced.BackendUnavailable`:
        nothing built on it now could be closed with it."""
        self._check_fork()
        with self._dependents_lock:  # (aclose sets _closing before it takes them: see there)
            if self._closing or self._closed:
                raise BackendUnavailable(f"the connection to {_redact(self.url)} is closed")
            self._dependents.add(dependent)

    def sign(self, token: FencingToken) -> FencingToken:
        """``token`` as a holder gets it from this connection: signed (bound to the source id,
        if one is set) when a signing key was given, else as it is."""
        return self._sign(token)

    @property
    def verifier(self) -> TokenVerifier | None:
        """What :meth:`check` verifies tokens with before asking the source: ``verify=``, else
        the signing key's public half (bound to the source id); None without either."""
        return self._own_keys

    @property
    def signing_key_id(self) -> tuple[str, str] | None:
        """(key id, algorithm name) of the signing key, or None when tokens are not signed."""
        key = self._signer
        return (key.kid, type(key).__name__) if key is not None else None

    async def open(self) -> AsyncLocks:
        await self._get_backend()
        return self

    def lock(
        self,
        name: str,
        *,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        on_lost: AsyncLostCallback | None = None,
        request_id: str | None = None,
        safety_margin: float | None = None,
        auto_renew: bool = True,
        description: str | None = None,
        fence: Iterable[FenceTarget] = (),
        fence_errors: str = "raise",
        lock_delay: float = 0.0,
    ) -> AsyncLease:
        """A lease on ``name`` (not yet acquired): ``async with locks.lock("x", ttl=10) as lease``.

        ``description`` (e.g. ``"nightly report"``) is shown to operators with the holder's
        user, host and pid while it holds the lock (``fenced status``).

        ``fence=[guard, ...]``: on every grant, before acquire returns, raise each guarded
        resource's high-water mark to the new token (all at once), so every earlier holder
        is refused there even if this holder never writes there. If one cannot be fenced,
        ``fence_errors="raise"`` (the default) gives the grant back and raises
        :class:`~fenced.FenceError`; ``"report"`` returns the lease with the failures in
        ``lease.not_fenced`` (and logs a warning) — never silently.

        ``lock_delay``: after this grant ends by *expiry* (not by release), nobody else is
        granted ``name`` for ``lock_delay`` more seconds, by the source's clock (Chubby's and
        Consul's lock-delay): a buffer for resources that cannot check a token, so that a
        holder that lost its lease has time to stop before the next one starts."""
        return AsyncLease(
            self,
            name,
            ttl=ttl,
            timeout=timeout,
            on_lost=on_lost,
            request_id=request_id,
            safety_margin=safety_margin,
            auto_renew=auto_renew,
            description=description,
            fence=fence,
            fence_errors=fence_errors,
            lock_delay=lock_delay,
        )

    async def elect(
        self,
        name: str,
        value: str = "",
        *,
        ttl: float = DEFAULT_TTL,
        timeout: float | None = None,
        fence: Iterable[FenceTarget] = (),
        fence_errors: str = "raise",
        on_lost: AsyncLostCallback | None = None,
        lock_delay: float = 0.0,
    ) -> AsyncLeadership:
        """Campaign for leadership of ``name`` until elected (or ``timeout``); see
        :mod:`fenced.election`. ``value`` is what observers see (an address, a node name)."""
        lease = self.lock(
            name, ttl=ttl, timeout=timeout, on_lost=on_lost, description=value or None,
            fence=fence, fence_errors=fence_errors, lock_delay=lock_delay,
        )  # fmt: skip
        await lease.acquire()
        return AsyncLeadership(lease, value)

    def observe(self, name: str, *, interval: float = 0.1) -> AsyncIterator[Leader]:
        """Who leads ``name``, each time it changes (see :mod:`fenced.election`)."""
        return self._observe(validate_lock_name(name), interval)

    async def _observe(self, name: str, interval: float) -> AsyncIterator[Leader]:
        changes = LeaderChanges(name)
        while True:
            change = changes.update(await self.status(name))
            if change is not None:
                yield change
            await asyncio.sleep(interval)

    def locked(
        self, name: str, *, ttl: float = DEFAULT_TTL, timeout: float | None = None, **options: Any
    ) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Coroutine[Any, Any, T]]]:
        """Decorate a coroutine function to run while holding ``name`` (see
        :meth:`Locks.locked <fenced.Locks.locked>`): ``@locks.locked("nightly", ttl=60)``."""

        def decorate(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
            if not inspect.iscoroutinefunction(fn):
                raise TypeError(
                    f"{getattr(fn, '__qualname__', fn)!r} is not a coroutine function: decorate "
                    "it with Locks.locked (fenced.connect), not AsyncLocks.locked"
                )
            pass_token = _wants_token(fn)

            @functools.wraps(fn)
            async def run(*args: P.args, **kwargs: P.kwargs) -> T:
                async with self.lock(name, ttl=ttl, timeout=timeout, **options) as lease:
                    if pass_token:
                        kwargs["token"] = lease.token
                    return await fn(*args, **kwargs)

            return run

        return decorate

    async def status(self, name: str) -> LockStatus:
        """Holder, token, highest token and time left of ``name``."""
        backend = await self._get_backend()
        return await backend.status(validate_lock_name(name))

    async def force_release(
        self, name: str, token: FencingToken | str | None = None
    ) -> LockStatus | None:
        """Free ``name`` whoever holds it: an operator's tool (``fenced release --force``).

        Returns the status of the grant freed (its token, who held it), or None if ``name``
        was not held, or with ``token``, not held by that grant. Safe for the data: the freed
        grant's token is refused by every guarded resource once the next holder has written,
        and its holder learns of the loss (at once on ZooKeeper and the memory source, at its
        next renewal, within ``ttl/3``, elsewhere). Not safe for what that holder does without
        a guard: use it for a holder that is stuck or gone.
        """
        backend = await self._get_backend()
        name = validate_lock_name(name)
        tok = None if token is None else FencingToken.coerce(token, name)
        return await backend.force_release(name, tok)

    async def check(self, token: FencingToken | str) -> TokenCheck:
        """Ask the source about ``token`` (Chubby's ``CheckSequencer``): is it the live grant
        of its lock, and which is the highest granted? See :class:`~fenced.TokenCheck`.

        With ``verify=`` (a keyring: public keys suffice) or a signing key, the token is
        checked first (:class:`~fenced.SignatureError` if it is unsigned, forged, or of
        another source), so a forged one cannot pass as stale-but-genuine."""
        tok = FencingToken.coerce(token)
        if self._own_keys is not None:
            self._own_keys.verify(tok.lock, tok.value, tok.signature)
        backend = await self._get_backend()
        return await backend.check(tok)

    async def read_record(self, name: str) -> Record | None:
        """The source's record ``name`` (see :class:`~fenced.Record`), None if never written."""
        backend = await self._get_backend()
        return await backend.read_record(validate_lock_name(name))

    async def swap_record(self, name: str, version: int, value: str) -> Record:
        """Compare-and-set: store ``value`` as the next version if ``name`` is at ``version``
        now (0: not yet written); :class:`~fenced.RecordConflict` if it changed meanwhile.
        Changes of a record are totally ordered by the source (replicated groups keep their
        configurations in records)."""
        validate_lock_name(name)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigurationError(f"a record version is an int >= 0, not {version!r}")
        if not isinstance(value, str) or len(value) > MAX_RECORD:
            raise ConfigurationError(f"a record value is a str of at most {MAX_RECORD} characters")
        backend = await self._get_backend()
        return await backend.swap_record(name, version, value)

    async def lock_names(self) -> list[str]:
        """The names of the locks the source knows, sorted (see ``fenced status``)."""
        backend = await self._get_backend()
        return await backend.lock_names()

    async def aclose(self) -> None:
        """Release every lease still held through this connection, then close it.

        Safe while other tasks (or, through :class:`Locks`, other threads) use the
        connection: from the moment it begins, a new acquire raises
        :class:`~fenced.BackendUnavailable`; an acquire in flight is stopped (raising the
        same; a grant the source made for it is given back, by the source's own undo of an
        abandoned acquire, or released below); releases in flight are awaited (at most
        5 s). Then every lease still held is released, all at once and within 5 s in all,
        and only then is the source closed. A lease released so is lost to its holder
        (``lost`` set, ``on_lost`` called: a ``with`` body still running ends with
        :class:`~fenced.LeaseLostError`). A lease that
        cannot be released (the source unreachable) is named in a warning on the ``fenced``
        logger: its grant stays held at the source until its ttl runs out (unless a release
        that got no answer reached the source after all). Closing does not
        raise for that (like kazoo's ``stop()`` or psycopg's pool ``close()``: it is often
        called on the way out of an error, which it must not replace). An interrupted close
        (a cancellation, a timeout around it) names in the same way what it leaves held.
        """
        self._check_fork()
        if self._closed:
            return
        if self._closing:  # closed by another task now: return when that close has ended
            if self._close_done is not None:
                await self._close_done.wait()
            return
        self._closing = True
        self._close_done = asyncio.Event()
        failed: list[tuple[AsyncLease, BaseException]] = []
        try:
            end = _clock.now() + _CLOSE_SETTLE
            await self._close_dependents()
            await self._settle(end)
            # All at once, and all within one bound: a source that does not answer costs
            # what is left of _CLOSE_SETTLE (at least _CLOSE_RELEASE), not its timeout once
            # per lease.
            end = max(end, _clock.now() + _CLOSE_RELEASE)
            for _ in range(3):  # (releasing one may not add another: a pass or two)
                leases = list(self._held)
                if not leases or _clock.now() >= end:
                    break
                failed = await self._release_all(leases, end)
        except BaseException:
            # Interrupted (Ctrl-C, a cancellation or timeout around aclose()): say what is
            # left held, as a close that could not release it would.
            left = {lease: "its release got no answer" for lease in self._held}
            if left:
                logger.warning(
                    "closing the connection to %s was interrupted: %d lease(s) may still be "
                    "held at the source until their ttl runs out: %s",
                    _redact(self.url),
                    len(left),
                    "; ".join(
                        f"{lease.name!r} (token {lease.token}): {why}"
                        for lease, why in left.items()
                    ),
                )
            raise
        finally:
            self._closed = True
            try:
                if self._backend is not None:
                    await self._backend.aclose()
            finally:
                self._close_done.set()
        if failed:
            logger.warning(
                "closing the connection to %s: %d lease(s) could not be released; each "
                "stays held at the source until its ttl runs out (unless a release that got "
                "no answer reached the source after all): %s",
                _redact(self.url),
                len(failed),
                "; ".join(f"{lease.name!r} (token {lease.token}): {exc}" for lease, exc in failed),
            )

    async def _close_dependents(self) -> None:
        """Close what was built on this connection (:meth:`close_with`), all at once; each
        bounds its own close and never raises for what it holds (a group warns of a member
        it could not close), so an error here is a bug of its own: logged, and the close
        goes on."""
        with self._dependents_lock:  # (_closing is set: none is added after this)
            dependents = list(self._dependents)
        if not dependents:
            return
        results = await asyncio.gather(*(d.aclose() for d in dependents), return_exceptions=True)
        for dependent, result in zip(dependents, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                logger.warning("closing %r with its connection failed: %s", dependent, result)

    async def _release_all(
        self, leases: list[AsyncLease], end: float
    ) -> list[tuple[AsyncLease, BaseException]]:
        """Release ``leases`` concurrently, until ``end`` at most; the ones that failed (those
        still running at ``end`` are stopped, and fail with a TimeoutError)."""
        for lease in leases:
            # Taken from its holder, whose ``with`` body may still be running: that body runs
            # unprotected from here, so the holder learns of it as of any loss (``lost``,
            # on_lost, LeaseLostError at the block's end). (Logged at debug: closing with
            # leases held is ordinary, and what close could not release is warned of.)
            # It stays in ``_held`` until its release has answered: a Ctrl-C anywhere from
            # here on (before its task has even started) leaves it named as held.
            lease._mark_lost(
                LeaseLostError(
                    f"lease on {lease.name!r} released by close() of its connection while held"
                ),
                logging.DEBUG,
                keep_held=True,
            )
        tasks = {asyncio.ensure_future(lease.release()): lease for lease in leases}
        try:
            _done, pending = await asyncio.wait(tasks, timeout=max(end - _clock.now(), 0.0))
        except BaseException:
            # close() interrupted: stop them, so that each is counted held again (and named).
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=1.0)
            raise
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        failed: list[tuple[AsyncLease, BaseException]] = []
        for task, lease in tasks.items():
            if task.cancelled():
                failed.append(
                    (
                        lease,
                        TimeoutError(
                            f"no answer within close's bound ({_CLOSE_SETTLE:g} s in all)"
                        ),
                    )
                )
            elif (exc := task.exception()) is not None:
                failed.append((lease, exc))
        return failed

    def _releasing(self) -> list[AsyncLease]:
        """The leases whose release is running now (they stay in ``_held`` until it ends)."""
        return [
            lease
            for lease in self._held
            if lease._state.phase is not Phase.HELD and lease._unreleased is None
        ]

    def _closed_error(self) -> BackendUnavailable:
        return BackendUnavailable(f"connection to {_redact(self.url)} is closed")

    def _call_begins(self, *, acquiring: bool = False) -> asyncio.Task[Any] | None:
        """Count an acquire or release as in flight (until :meth:`_call_ends`): what close()
        waits for. Returns the task running it (an acquire's: close() may stop it)."""
        self._in_flight += 1
        task = asyncio.current_task()
        if acquiring and task is not None:
            self._acquiring.add(task)
        return task

    def _call_ends(self, task: asyncio.Task[Any] | None) -> None:
        self._in_flight -= 1
        if task is not None:
            self._acquiring.discard(task)
        if not self._in_flight and self._settled is not None:
            self._settled.set()

    def _stopped_by_close(self, task: asyncio.Task[Any] | None) -> bool:
        """True if close() cancelled ``task``'s acquire: that cancellation is taken back (the
        caller gets BackendUnavailable instead)."""
        if task is None or task not in self._stopped:
            return False
        self._stopped.discard(task)
        task.uncancel()
        return True

    async def _settle(self, end: float) -> None:
        """Stop the acquires in flight and wait (until ``end``, by fenced's clock) until
        they and the releases in flight have ended: each acquire's own undo (leaving the
        queue, giving back a grant made for it) runs while the source is still open."""
        me = asyncio.current_task()
        for task in list(self._acquiring):
            if task is not me and not task.done():
                self._stopped.add(task)
                task.cancel()
        if not self._in_flight:
            return
        self._settled = asyncio.Event()
        try:
            async with asyncio.timeout(max(end - _clock.now(), 0.0)):
                await self._settled.wait()
        except TimeoutError:
            releasing = "".join(
                f"; release of {lease.name!r} (token {lease.token})" for lease in self._releasing()
            )
            logger.warning(
                "closing the connection to %s: %d call(s) still running after %g s; closing "
                "anyway%s",
                _redact(self.url),
                self._in_flight,
                _CLOSE_SETTLE,
                releasing,
            )

    async def __aenter__(self) -> AsyncLocks:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _open(self, deadline: float | None) -> Backend:
        """Open the backend, retrying a source that is down (with back-off) until the deadline.

        The deadline is the caller's (an acquire's timeout) or else ``connect_timeout`` from
        now; every attempt is cut off at it (so a client library's own longer connect
        timeout does not count), and a configuration error is raised at once.
        """
        start = _clock.now()
        end = start + self.connect_timeout if deadline is None else deadline
        url = parse_url(self.url)
        backoff = Backoff(0.05, 1.0)
        while True:
            # At least one real attempt, even when the deadline has already passed.
            budget = max(end - _clock.now(), 0.25)
            try:
                async with asyncio.timeout(budget):
                    return await self._cls.open(url, dict(self._options))
            except TimeoutError:
                raise BackendUnavailable(
                    f"{self._cls.scheme} source {_redact(self.url)} not reachable within "
                    f"{_clock.now() - start:.1f} s"
                ) from None
            except BackendUnavailable as exc:
                pause = backoff.next(end - _clock.now())  # the last attempt: at the deadline
                if pause is None:
                    raise
                logger.debug("opening %s: %s; retrying in %.2f s", _redact(self.url), exc, pause)
                await asyncio.sleep(pause)

    async def _get_backend(self, deadline: float | None = None) -> Backend:
        self._check_fork()
        if self._closed or self._closing:
            raise self._closed_error()
        if self._backend is None:
            if self._opening is None:
                self._opening = asyncio.Lock()
            async with self._opening:
                if self._backend is None:
                    backend = await self._open(deadline)
                    try:
                        # A server may fail a check the user opted out of (Redis without
                        # fsync): the requirement is judged again against what it is.
                        check_requirements(
                            self._cls, self._require, backend.effective_characteristics
                        )
                    except BaseException:
                        await backend.aclose()
                        raise
                    self._backend = backend
        return self._backend

    def _sign(self, token: FencingToken) -> FencingToken:
        """The grant's token as the holder gets it: signed when a signing key was given."""
        key = self._signer
        if key is None:
            return token
        source = self._source_id
        signature = key.sign(token_message(token.lock, token.value, key.kid, source))
        if source is None:
            return FencingToken(token.lock, token.value, (key.kid, signature))
        return FencingToken(token.lock, token.value, (key.kid, signature, source))

    def _backend_or_fail(self) -> Backend:
        self._check_fork()
        if self._backend is None or self._closed:
            raise BackendUnavailable(f"connection to {_redact(self.url)} is closed or not open")
        return self._backend

    def __repr__(self) -> str:
        return f"<AsyncLocks {self._cls.scheme} {_redact(self.url)}>"


def connect_async(
    url: str | object | None = None, *, require: Iterable[str] = (), **options: Any
) -> AsyncLocks:
    """Open a token source by URL, for asyncio code: ``async with connect_async(url) as locks``.

    With no URL, the one the command line uses: ``$FENCED_URL``, else the machine-wide SQLite
    file (``/var/tmp/fenced/locks.db``, shared by every local user).

    Instead of a URL, a client the application already has: a redis-py client, a psycopg
    connection or pool, a ``KazooClient`` (fenced opens its own connection where it points).

    ``require`` names characteristics (e.g. ``{"linearizable", "durable"}``) the source must
    have; one lacking any is refused with :class:`~fenced.ConfigurationError`. Signing
    (``signing_key=``, ``source_id=``, ``verify=``): as :func:`fenced.connect`.
    """
    return AsyncLocks(default_url() if url is None else url, require=require, **options)


_warned_unbound = False


def _warn_unbound_once() -> None:
    """Signing without a source id mints v1 tokens, which any source holding the same key can
    mint too: say so once per process (docs/signing.md, "The source's identity")."""
    global _warned_unbound
    if not _warned_unbound:
        _warned_unbound = True
        logger.warning(
            "signing without source_id: these tokens are not bound to this source, so a guard "
            "trusting this key also accepts tokens of any other source that holds it; give "
            "each source its own key, or set source_id (and the guards' source_id)"
        )


def _redact(url: str) -> str:
    return redacted(url)


def check_description(description: object) -> str | None:
    """A holder's description: text, its control characters (newlines included) made spaces,
    cut to fit :data:`MAX_OWNER` with the holder's user, host and pid."""
    if description is None:
        return None
    if not isinstance(description, str):
        raise ConfigurationError(f"description must be text, not {type(description).__name__}")
    clean = "".join(c if c.isprintable() else " " for c in description).strip()
    return clean[:MAX_OWNER] or None


def _wants_token(fn: Callable[..., Any]) -> bool:
    """True if ``fn`` takes a parameter named ``token`` (the decorators pass it the grant's)."""
    try:
        return "token" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


@contextlib.asynccontextmanager
async def _until(deadline: float | None, name: str, scheme: str) -> AsyncIterator[None]:
    """Bound an acquire's call to its source by the deadline + :data:`_ACQUIRE_GRACE`; past
    it, BackendUnavailable (the source's own undo of an abandoned acquire runs as for a
    cancellation)."""
    if deadline is None:
        yield
        return
    try:
        async with asyncio.timeout_at(
            asyncio.get_running_loop().time() + max(deadline - _clock.now(), 0.0) + _ACQUIRE_GRACE
        ) as limit:
            yield
    except TimeoutError:
        if not limit.expired():
            raise
        raise BackendUnavailable(
            f"acquire of {name!r}: the {scheme} source gave no answer within the acquire's "
            f"timeout + {_ACQUIRE_GRACE:g} s"
        ) from None


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


def _call_safely(fn: Callable[[BaseException], None], cause: BaseException) -> None:
    try:
        fn(cause)
    except Exception:
        logger.exception("lease-lost hook failed")


def _log_task_error(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("on_lost callback failed", exc_info=task.exception())
