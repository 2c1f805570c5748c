"""The etcd transport (clients layer): gRPC channels to the members, failover, watches.

Used by the ``etcd://`` source and the etcd guards alike (what a gRPC error means is
:mod:`fenced._clients.grpc_errors`'s).

The protocol messages and stubs are aetcd's (``aetcd.rpc``, generated from etcd's own
``rpc.proto``); the session logic of ``aetcd.Client`` is not used, because the lock protocol
needs what it does not offer: range options (sort, limit, max_create_revision) inside a
transaction, several endpoints with failover, and many concurrent watches on one stream.

Every call goes to the current member; on a connection error, a timeout or an etcd
"no leader"/"leader changed" reply, the next member is tried (round-robin, with a short
back-off after each full round) until the operation's patience runs out, then
:class:`~fenced.BackendUnavailable` is raised ``from`` the last gRPC error. Only idempotent
requests go through :meth:`EtcdClient.call`, so retrying one on another member is safe.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from . import grpc as _grpc  # noqa: F401  (first: gRPC reads it when imported)

# isort: split
import grpc  # type: ignore[import-untyped]
import grpc.aio  # type: ignore[import-untyped]
from aetcd import rpc

from .._core import clock as _clock
from .._core import fork as _fork
from .._core.backoff import Backoff
from .._core.errors import BackendError, BackendUnavailable, ConfigurationError, LockTimeout
from . import grpc_errors as _grpc_errors

__all__ = [
    "EtcdClient",
    "LeaseNotFound",
    "Member",
    "WatchHandle",
    "cancelling",
    "check_grpc_usable",
]

_grpc_started: tuple[int, int] | None = None
"""(fork generation, pid) of the process that first opened a gRPC channel (inherited by forks)."""


def check_grpc_usable() -> None:
    """Refuse gRPC in a process forked after gRPC started; note its start otherwise.

    gRPC's core does not survive fork: in such a child a new channel crashes the process
    (SIGSEGV, seen here with grpcio 1.7x), and with ``GRPC_ENABLE_FORK_SUPPORT`` the parent's
    channels are shut down instead (its leases are lost). A clear error at once is the only
    safe answer: open etcd connections in processes started by ``spawn``/``forkserver``, or
    in the parent only after forking (Celery: ``worker_process_init``).
    """
    global _grpc_started
    if _grpc_started is None:
        _grpc_started = (_fork.generation(), os.getpid())
    elif _grpc_started[0] != _fork.generation():
        raise ConfigurationError(
            f"etcd cannot be used in this process: it was forked from process "
            f"{_grpc_started[1]} after that process started gRPC, and gRPC does not survive "
            "fork; connect to etcd only in processes started with spawn/forkserver, or "
            "before any etcd use in the parent"
        )


logger = logging.getLogger("fenced.etcd")

T = TypeVar("T")

# Reconnect quickly after a member comes back (gRPC's default first back-off is 1 s).
_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # Find a dead peer under an open watch stream. etcd refuses pings more often than every
    # 5 s (--grpc-keepalive-min-time), and any ping while no call is open.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
)


class LeaseNotFound(BackendError):
    """etcd says the lease does not exist (expired, revoked, or never granted)."""


def cancelling() -> bool:
    """True if the current task is being cancelled (as opposed to gRPC's own CancelledError)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class WatchHandle:
    """One watch for the deletion of one key, on one member's shared watch stream.

    ``created`` resolves to the store revision at which the watch was registered (events
    after it are delivered). The watch fires (``fired`` becomes True and the waiter's
    ``wake`` event is set) when the key is deleted, when the server cancels the watch, or
    when the stream breaks: the waiter must look again in every case.
    """

    __slots__ = ("_hub", "_wake", "cancelled", "created", "fired", "key", "watch_id")

    def __init__(self, hub: _WatchHub, key: bytes, wake: asyncio.Event) -> None:
        self._hub = hub
        self._wake = wake
        self.key = key
        self.created: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.fired = False
        self.watch_id: int | None = None
        self.cancelled = False

    @property
    def member(self) -> Member:
        """The member whose watch stream carries this watch."""
        return self._hub.member

    def cancel(self) -> None:
        """Stop watching (idempotent)."""
        if not self.cancelled:
            self.cancelled = True
            self._hub._cancel(self)

    def _fire(self) -> None:
        self.fired = True
        self._wake.set()


class _WatchHub:
    """One bidirectional Watch stream on one member, multiplexing many watches.

    etcd answers create requests on a stream in the order they were sent, so a FIFO of
    pending creates maps each "created" response (and its server-chosen watch id) to its
    handle without waiting for one create before sending the next.
    """

    def __init__(self, member: Member) -> None:
        self.member = member
        self._requests: asyncio.Queue[rpc.WatchRequest | None] = asyncio.Queue()
        self._pending: collections.deque[WatchHandle] = collections.deque()
        self._active: dict[int, WatchHandle] = {}
        self.dead = False
        # "hasleader": a member that loses its leader (partitioned away) ends the stream
        # instead of silently sending no more events (etcd's WithRequireLeader).
        call = member.watch_stub.Watch(self._request_stream(), metadata=(("hasleader", "true"),))
        self._call: Any = call
        self._reader = asyncio.create_task(self._read(call), name="fenced-etcd-watch")

    async def _request_stream(self) -> AsyncIterator[rpc.WatchRequest]:
        while True:
            request = await self._requests.get()
            if request is None:
                return
            yield request

    def watch_delete(self, key: bytes, wake: asyncio.Event) -> WatchHandle:
        """Watch ``key`` for its deletion, from the revision the server registers it at.

        ``wake`` is set when the watch fires (see :class:`WatchHandle`).
        """
        handle = WatchHandle(self, key, wake)
        if self.dead:
            handle.created.set_exception(BackendUnavailable("etcd watch stream is closed"))
            handle._fire()
            return handle
        create = rpc.WatchCreateRequest(key=key, filters=[rpc.WatchCreateRequest.NOPUT])
        self._pending.append(handle)
        self._requests.put_nowait(rpc.WatchRequest(create_request=create))
        return handle

    def _cancel(self, handle: WatchHandle) -> None:
        if handle.watch_id is not None and self._active.pop(handle.watch_id, None) is not None:
            cancel = rpc.WatchCancelRequest(watch_id=handle.watch_id)
            if not self.dead:
                self._requests.put_nowait(rpc.WatchRequest(cancel_request=cancel))
        # A handle still pending is cancelled when its "created" response arrives.

    async def _read(self, call: Any) -> None:
        error: BaseException | None = None
        try:
            async for response in call:
                self._on_response(response)
        except asyncio.CancelledError:
            error = BackendUnavailable("etcd watch stream closed")
            raise
        except Exception as exc:
            error = exc
        finally:
            self._shutdown(error)

    def _on_response(self, response: Any) -> None:
        if response.created:
            if not self._pending:  # not ours (cannot happen): ignore it
                return
            handle = self._pending.popleft()
            if response.canceled:
                handle.created.set_exception(
                    BackendUnavailable(f"etcd refused a watch: {response.cancel_reason}")
                )
                handle.created.exception()  # mark retrieved: the waiter may be gone
                handle._fire()
                return
            handle.watch_id = response.watch_id
            handle.created.set_result(response.header.revision)
            if handle.cancelled:
                cancel = rpc.WatchCancelRequest(watch_id=response.watch_id)
                self._requests.put_nowait(rpc.WatchRequest(cancel_request=cancel))
                return
            self._active[response.watch_id] = handle
            return
        handle_or_none = self._active.get(response.watch_id)
        if handle_or_none is None:
            return
        if response.canceled or response.compact_revision or response.events:
            # Only DELETE events are sent (NOPUT filter); the server cancelling the watch
            # (compaction, overload) also means "look again".
            handle_or_none._fire()
            handle_or_none.cancel()

    def _shutdown(self, error: BaseException | None) -> None:
        if self.dead:
            return
        self.dead = True
        cause = BackendUnavailable(f"etcd watch stream to {self.member.endpoint} ended")
        if error is not None:
            cause.__cause__ = error
        while self._pending:
            handle = self._pending.popleft()
            if not handle.created.done():
                handle.created.set_exception(cause)
                handle.created.exception()  # mark retrieved: the waiter may be gone
            handle._fire()
        for handle in self._active.values():
            handle._fire()
        self._active.clear()
        self._requests.put_nowait(None)

    async def close(self) -> None:
        self._shutdown(None)
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader


class Member:
    """One etcd member: a lazily opened channel, its stubs and its watch stream."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._channel: grpc.aio.Channel | None = None
        self._hub: _WatchHub | None = None
        self.kv: Any = None
        self.lease: Any = None
        self.watch_stub: Any = None
        self.maintenance: Any = None

    def open(self) -> Member:
        if self._channel is None:
            check_grpc_usable()
            channel = grpc.aio.insecure_channel(self.endpoint, options=_CHANNEL_OPTIONS)
            self._channel = channel
            self.kv = rpc.KVStub(channel)
            self.lease = rpc.LeaseStub(channel)
            self.watch_stub = rpc.WatchStub(channel)
            self.maintenance = rpc.MaintenanceStub(channel)
        return self

    def hub(self) -> _WatchHub:
        self.open()
        if self._hub is None or self._hub.dead:
            self._hub = _WatchHub(self)
        return self._hub

    async def reset(self) -> None:
        """Drop the channel (it is reopened on next use): a dead peer's calls fail at once."""
        hub, self._hub = self._hub, None
        channel, self._channel = self._channel, None
        if hub is not None:
            await hub.close()
        if channel is not None:
            await channel.close()


class EtcdClient:
    """Calls to an etcd cluster, failing over between its members."""

    def __init__(self, endpoints: list[str], *, timeout: float, retry_for: float) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.members = [Member(e) for e in endpoints]
        self.timeout = timeout
        self.retry_for = retry_for
        self._current = 0
        self.closed = False
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def current(self) -> Member:
        return self.members[self._current].open()

    def _failed(self, member: Member, exc: grpc.aio.AioRpcError, *, full_wait: bool) -> None:
        """Move on from ``member``; drop its channel if the member itself seems gone or hung.

        (Not for etcd's own "no leader"/"leader changed" answers: that member is alive.)
        """
        if self.members[self._current] is member and len(self.members) > 1:
            self._current = (self._current + 1) % len(self.members)
            logger.debug(
                "etcd: %s failed (%s); now using %s",
                member.endpoint,
                exc.code(),
                self.members[self._current].endpoint,
            )
        code, details = exc.code(), exc.details() or ""
        dead = code == grpc.StatusCode.UNAVAILABLE and not details.startswith("etcdserver:")
        hung = code == grpc.StatusCode.DEADLINE_EXCEEDED and full_wait
        if dead or hung:
            # Calls still queued on that connection fail now, and its watch stream breaks,
            # waking its waiters, who look again through a live member.
            self.spawn(member.reset())

    async def call(
        self,
        fn: Callable[[Member, float], Awaitable[T]],
        *,
        what: str,
        deadline: float | None = None,
    ) -> T:
        """Run an idempotent request, failing over between members.

        Gives up (BackendUnavailable) after ``retry_for`` seconds, or at ``deadline`` if that
        comes first (but not before one round over the members); each attempt is bounded by
        ``timeout``. A request cut short by ``deadline`` itself raises LockTimeout: only
        acquire passes a deadline.
        """
        if self.closed:
            raise BackendUnavailable("etcd connection is closed")
        start = _clock.now()
        give_up = start + self.retry_for
        if deadline is not None:
            give_up = min(give_up, max(deadline, start))
        backoff = Backoff(0.05, 0.5)  # after each full round over the members
        tried = 0
        while True:
            member = self.current
            now = _clock.now()
            # Even past the deadline ("try once") an attempt gets a fair chance to answer.
            attempt_timeout = max(min(self.timeout, give_up - now), min(self.timeout, 1.0))
            try:
                return await fn(member, attempt_timeout)
            except grpc.aio.AioRpcError as exc:
                if self.closed:
                    raise BackendUnavailable("etcd connection is closed") from exc
                if _grpc_errors.kind(exc) == "lease-not-found":
                    raise LeaseNotFound(exc.details() or "lease not found") from exc
                if _grpc_errors.kind(exc) != "unreachable":
                    raise BackendError(
                        f"etcd {what} failed: {exc.code().name}: {exc.details()}"
                    ) from exc
                self._failed(member, exc, full_wait=attempt_timeout >= self.timeout)
                tried += 1
                now = _clock.now()
                if (
                    deadline is not None
                    and now >= deadline
                    and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                ):
                    # The caller's own deadline cut the request short: etcd is slow, not gone.
                    raise LockTimeout(f"etcd {what} did not finish before the timeout") from exc
                if now >= give_up and tried >= len(self.members):
                    raise BackendUnavailable(
                        f"etcd {what}: no member answered ({exc.code().name}: {exc.details()})"
                    ) from exc
                if tried % len(self.members) == 0:
                    await asyncio.sleep(backoff.next(give_up - now) or 0)
            except (asyncio.CancelledError, grpc.aio.UsageError, RuntimeError) as exc:
                # gRPC raises CancelledError in calls whose channel is closed under them (by
                # aclose, or by a failover reset): that is not a cancellation of this task.
                if isinstance(exc, asyncio.CancelledError) and cancelling():
                    raise
                if self.closed:
                    raise BackendUnavailable("etcd connection is closed") from None
                tried += 1
                if _clock.now() >= give_up and tried >= len(self.members):
                    raise BackendUnavailable(f"etcd {what}: channel closed") from None
                await asyncio.sleep(0.01)

    async def call_once(self, fn: Callable[[Member, float], Awaitable[T]], *, what: str) -> T:
        """Run a request that must not be sent twice (a guarded write): one attempt.

        On a failure that may have left the request applied, the member is marked failed
        (the next call goes to the next member: failover) and BackendUnavailable says the
        outcome is unknown; the caller decides whether to retry.
        """
        if self.closed:
            raise BackendUnavailable("etcd connection is closed")
        member = self.current
        try:
            return await fn(member, self.timeout)
        except grpc.aio.AioRpcError as exc:
            if _grpc_errors.kind(exc) != "unreachable":
                raise BackendError(
                    f"etcd {what} failed: {exc.code().name}: {exc.details()}"
                ) from exc
            self._failed(member, exc, full_wait=True)
            raise BackendUnavailable(
                f"etcd {what}: {member.endpoint} failed ({exc.code().name}); outcome unknown, "
                "the next call goes to another member"
            ) from exc
        except (asyncio.CancelledError, grpc.aio.UsageError, RuntimeError) as exc:
            if isinstance(exc, asyncio.CancelledError) and cancelling():
                raise
            raise BackendUnavailable(f"etcd {what}: channel closed; outcome unknown") from None

    async def keepalive(self, lease_id: int, *, deadline: float | None = None) -> int:
        """One LeaseKeepAlive round trip: the lease's new TTL in seconds, 0 if it is gone."""

        async def once(member: Member, timeout: float) -> int:
            call = member.lease.LeaseKeepAlive(
                iter((rpc.LeaseKeepAliveRequest(ID=lease_id),)), timeout=timeout
            )
            try:
                reply = await call.read()
            finally:
                call.cancel()
            if reply is grpc.aio.EOF:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    details="keepalive stream ended without a reply",
                )
            ttl: int = reply.TTL
            return ttl

        return await self.call(once, what="lease keepalive", deadline=deadline)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        """Run cleanup in the background (kept referenced; errors are logged at debug)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("etcd background task failed: %r", task.exception())

    async def close(self) -> None:
        self.closed = True
        for task in list(self._background):
            task.cancel()
        for member in self.members:
            with contextlib.suppress(Exception):
                await member.reset()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
