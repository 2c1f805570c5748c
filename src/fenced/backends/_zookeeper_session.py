"""The transport under ``zookeeper://``: kazoo driven from asyncio, sessions and lock nodes.

One kazoo client per session, its callbacks delivered into the event loop (``Mailbox``), its
connection state turned into the session's ``connected``/lost signals, and the nodes a
session owns (``Node``). The lock recipe itself is in ``zookeeper.py``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import logging
import math
import os
import re
import select
import socket
import weakref
from collections.abc import Callable
from typing import Any, Final, Protocol

from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    NoNodeError,
    SessionExpiredError,
)
from kazoo.handlers.threading import AsyncResult, KazooTimeoutError, SequentialThreadingHandler
from kazoo.protocol.serialization import Connect
from kazoo.protocol.states import KazooState
from kazoo.retry import KazooRetry

from .._clients import kazoo_errors as _kazoo_errors
from .._core import clock as _clock
from .._core.backend import Grant, LostCallback
from .._core.errors import BackendUnavailable, LeaseLostError, UnsafeBackendError

__all__ = [
    "KAZOO_LOG",
    "UNAVAILABLE",
    "InlineHandler",
    "Mailbox",
    "Node",
    "NodePhase",
    "Session",
    "SessionOwner",
    "describe",
    "ignore",
    "settle",
    "unavailable",
]

logger = logging.getLogger("fenced.zookeeper")

UNAVAILABLE: Final = _kazoo_errors.UNREACHABLE
_CLEANED_KEPT: Final = 1024  # paths the janitor remembers having deleted
"""Errors that say nothing about the session (one reading with the guards': _kazoo_errors)."""


class DebugOnly(logging.LoggerAdapter):  # type: ignore[type-arg]
    """kazoo's own log lines ("Connection dropped: ..." once per retry, many a second while a
    server is down) at debug level: fenced reports what matters once, as a typed error."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        super().log(min(level, logging.DEBUG), msg, *args, **kwargs)

    def isEnabledFor(self, level: int) -> bool:
        return bool(self.logger.isEnabledFor(min(level, logging.DEBUG)))


KAZOO_LOG: Final = DebugOnly(logging.getLogger("fenced.zookeeper.kazoo"), {})


# -- kazoo, bridged to asyncio ----------------------------------------------------------------


class InlineResult(AsyncResult):  # type: ignore[misc]
    """A kazoo result whose callbacks run at once, on the thread that completes it."""

    def _do_callbacks(self) -> None:
        me: Any = self  # kazoo is untyped
        callbacks: list[Callable[[Any], None]] = me._callbacks
        me._callbacks = []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # pragma: no cover - our callbacks only schedule work
                logger.exception("kazoo completion callback failed")


class InlineHandler(SequentialThreadingHandler):  # type: ignore[misc]
    """Runs completion and watch callbacks on kazoo's connection thread, with no worker threads.

    Every callback a fenced client registers only hands a value to an event loop, so none can
    block the connection thread. Running them inline keeps responses and watch events in
    exactly the order the server sent them (ZooKeeper's ordering guarantee, which the waiters
    rely on) and saves two thread hops per request.
    """

    connect_timeout: float | None = None
    """Seconds a TCP connect may take at most (kazoo's own bound is the whole session
    timeout); set by :class:`Session`, see :meth:`Session._hook_connect`."""

    _wake: tuple[int, int] | None = None
    """A pipe that :meth:`stop` writes to, so that a ``select`` in progress returns at once."""

    def start(self) -> None:
        with self._state_change:
            self._running = True
            if self._wake is None:
                self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                weakref.finalize(self, _close_fds, self._wake)
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake[0], 64)  # a stop before this restart

    def stop(self) -> None:
        """Stop, and wake the connection thread from any ``select`` it is in.

        kazoo's stop joins the connection thread, which may be waiting for a server that took
        the connection and never answers (up to the whole connect bound): without the wake a
        timeout the caller gave would be overrun by that wait when it closes the client.
        """
        with self._state_change:
            self._running = False
            if self._wake is not None:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake[1], b"x")

    def async_result(self) -> InlineResult:
        return InlineResult(self)

    def select(
        self, rlist: list[Any], wlist: list[Any], xlist: list[Any], timeout: float | None = None
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """One ``poll(2)`` call; kazoo's own builds and closes an epoll set on every call.

        kazoo calls this at least twice per request (to wait for work, and before each write),
        so the four syscalls saved each time are a good part of a request's client-side cost.
        """
        poller = select.poll()
        masks: dict[int, int] = {}
        owners: dict[int, list[Any]] = {}
        for objs, mask in ((rlist, select.POLLIN), (wlist, select.POLLOUT)):
            for obj in objs:
                fd = obj if isinstance(obj, int) else obj.fileno()
                masks[fd] = masks.get(fd, 0) | mask
                owners.setdefault(fd, []).append(obj)
        for fd, mask in masks.items():
            poller.register(fd, mask)
        wake = self._wake[0] if self._wake is not None else None
        if wake is not None:
            poller.register(wake, select.POLLIN)
        wait_ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        readable: list[Any] = []
        writable: list[Any] = []
        for fd, events in poller.poll(wait_ms):
            if fd == wake:
                continue
            for obj in owners[fd]:
                if obj in rlist and events & READ_EVENTS:
                    readable.append(obj)
                if obj in wlist and events & WRITE_EVENTS:
                    writable.append(obj)
        # Stopped with nothing ready: as if the wait timed out. What is ready still counts:
        # kazoo's stop queues a Close and waits for its reply, and a wake that hid the
        # socket made the loop spin until a ping timed out (~3 s of CPU per close), then
        # drop the connection without the Close, so the server kept the session's nodes
        # (a closed holder's lock) for the whole session timeout.
        return readable, writable, []

    def create_connection(self, *args: Any, **kwargs: Any) -> Any:
        bound, timeout = self.connect_timeout, kwargs.get("timeout")
        if bound is not None and isinstance(timeout, int | float):
            kwargs["timeout"] = min(timeout, bound)
        return super().create_connection(*args, **kwargs)

    def dispatch_callback(self, callback: Any) -> None:
        try:
            callback.func(*callback.args)
        except Exception:  # pragma: no cover - our watchers only schedule work
            logger.exception("kazoo watch callback failed")


def _close_fds(fds: tuple[int, int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


READ_EVENTS: Final = (
    select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR | select.POLLNVAL
)
WRITE_EVENTS: Final = select.POLLOUT | select.POLLHUP | select.POLLERR | select.POLLNVAL


def settle(future: asyncio.Future[Any], result: Any) -> None:
    if future.done():
        return
    exc = result.exception
    if exc is None:
        future.set_result(result.value)
    else:
        future.set_exception(exc)


class Mailbox:
    """Hands work from kazoo's connection thread to the event loop, in order.

    One ``call_soon_threadsafe`` (one write to the loop's self-pipe) per burst rather than
    per item: responses and watch events often arrive several at a time.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = (
            collections.deque()
        )
        self.scheduled = False

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop (from any thread; dropped if the loop is closed)."""
        self.items.append((fn, args))
        if not self.scheduled:
            self.scheduled = True
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
                self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        self.scheduled = False
        items = self.items
        while items:
            fn, args = items.popleft()
            try:
                fn(*args)
            except Exception:  # pragma: no cover - our handlers do not raise
                logger.exception("ZooKeeper event handler failed")

    def future(self, result: Any) -> asyncio.Future[Any]:
        """An asyncio future completed (on the loop) by a kazoo ``IAsyncResult``."""
        future = self.loop.create_future()
        result.rawlink(lambda r: self.post(settle, future, r))
        return future


def ignore(future: asyncio.Future[Any]) -> None:
    """Mark a future's outcome as handled (its error, if any, is not interesting)."""
    if future.done():
        if not future.cancelled():
            future.exception()
    else:
        future.add_done_callback(ignore)


def unavailable(what: str, exc: BaseException) -> BackendUnavailable:
    return BackendUnavailable(f"ZooKeeper {what}: {type(exc).__name__} {exc}".rstrip())


# -- sessions and nodes -----------------------------------------------------------------------


class NodePhase(enum.Enum):
    QUEUED = "queued"
    HELD = "held"
    DONE = "done"  # released, lost or expired


@dataclasses.dataclass(eq=False)
class Node:
    """One acquire call's node, from queueing to release."""

    lock: str
    request_id: str
    session: Session
    parent: str
    prefix: str
    on_lost: list[LostCallback]
    ttl: float
    phase: NodePhase = NodePhase.QUEUED
    path: str | None = None
    seq: int = 0
    czxid: int = 0
    version: int = 0
    session_id: int | None = None
    uncertain: bool = False  # a create was sent and its reply lost
    lower: list[str] | None = None  # names of the nodes queued before ours, nearest last
    gone: set[str] = dataclasses.field(default_factory=set)  # paths seen deleted
    held_preds: set[str] = dataclasses.field(default_factory=set)  # seen released by a holder
    armed: bool = False  # a watch on our own node is known to be set
    arming: bool = False  # a request to set it is on its way
    deleted: bool = False  # our own node is known to be gone
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    grant: Grant | None = None
    expires_at: float = 0.0
    timer: asyncio.TimerHandle | None = None
    own_watch: Callable[[Any], None] = dataclasses.field(default=lambda ev: None)
    pred_watch: Callable[[Any], None] = dataclasses.field(default=lambda ev: None)
    owner: bytes = b""  # the node's data: who queued it (user@host pid N: description)
    # A release of this node's grant raised (path, session id): a second release finishes it.
    unreleased: tuple[str, int] | None = None

    def forget(self) -> None:
        """Our node is gone (session ended, deleted): the next round creates a new one."""
        if self.path is not None:
            self.session.nodes.pop(self.path, None)
        self.path = None
        self.session_id = None
        self.lower = None
        self.armed = False
        self.deleted = False
        self.gone.clear()
        self.held_preds.clear()


class SessionOwner(Protocol):
    """What a :class:`Session` uses of the backend that owns it (``ZooKeeperBackend``):
    named here so that this module does not import the backend's, which imports this one."""

    _hosts: str
    _loop: asyncio.AbstractEventLoop
    _mailbox: Mailbox
    _tick: float | None
    _closed: bool
    _closing: bool

    def _arm(self, node: Node) -> None: ...

    def _lose(self, node: Node, cause: LeaseLostError) -> None: ...


class Session:
    """One ZooKeeper session (one kazoo client) whose timeout is one ttl."""

    def __init__(self, backend: SessionOwner, timeout_ms: int) -> None:
        self.backend = backend
        self.loop = backend._loop
        self.timeout = timeout_ms / 1000  # the negotiated timeout, once connected
        self.session_id: int | None = None
        self.connected = asyncio.Event()
        self.ever_connected = False
        self.proven_at = -math.inf  # send time of the latest request this session answered
        # Send time from which the *leader* surely counts the session alive (a Connect, or a
        # renewal proof): the leader expires no earlier than this + timeout. See
        # ZooKeeperBackend._renewal_proof; a follower's answer alone proves nothing of it.
        self.leader_since = -math.inf
        self._connect_sent = -math.inf  # kazoo thread: send time of the last answered Connect
        self.proving: asyncio.Task[None] | None = None  # a background leader proof
        self.nodes: dict[str, Node] = {}  # path -> node, for nodes of the current session
        self.queued: set[Node] = set()  # nodes whose acquire is waiting
        self.doomed: set[str] = set()  # paths to delete once connected
        # Paths the janitor deleted (not found gone): a release asked again after one that
        # raised learns here that its node was deleted for it. (Bounded: oldest dropped.)
        self.cleaned: dict[str, None] = {}
        self.orphans: set[tuple[str, str]] = (
            set()
        )  # (parent, prefix) of creates whose reply was lost
        self.work = asyncio.Event()
        self.janitor: asyncio.Task[None] | None = None
        self._negotiated_ms = 0
        retry_cap = max(0.05, min(1.0, self.timeout / 5))
        self.handler = InlineHandler()
        self.client = KazooClient(
            hosts=backend._hosts,
            timeout=self.timeout,
            handler=self.handler,
            connection_retry=KazooRetry(
                max_tries=-1, delay=0.02, backoff=2, max_jitter=0.3, max_delay=retry_cap
            ),
            logger=KAZOO_LOG,
        )
        self._hook_connect()
        self.client.add_listener(self._on_state_thread)
        self.client.start_async()

    def _connect_base(self) -> float:
        """The first bound on a connection attempt: a tenth of the session timeout, in
        [0.25 s, 1 s] (a live server answers a Connect in milliseconds)."""
        timeout = self._negotiated_ms / 1000 if self._negotiated_ms > 0 else self.timeout
        return max(0.25, min(1.0, timeout / 10))

    def _hook_connect(self) -> None:
        """Learn the session timeout the server granted, and bound each connection attempt.

        Negotiation: the server clamps the asked-for timeout into [minSessionTimeout,
        maxSessionTimeout]; a holder that counted on more than it got would be unsafe, and
        kazoo keeps it to itself, so failing to learn it is an error, not a fallback.

        Attempts: kazoo waits for the TCP connect and for the Connect's reply as long as the
        whole session timeout. A server may take a connection and never answer it: after a
        kill -9, a Connect sent as the restarting server's port opened got neither a reply
        nor a close, kazoo waited the full 10 s of a 10 s session while the server was
        serving others (2 runs in 20 of the kill -9 test; in one the lease ran out). So
        an attempt waits ``_connect_base()`` at first; each attempt that times out doubles the
        bound (a slow server is still reached), up to kazoo's own; a reply resets it.
        """
        connection: Any = getattr(self.client, "_connection", None)
        invoke = getattr(connection, "_invoke", None)
        if invoke is None:  # pragma: no cover - a kazoo release that moved its internals
            raise UnsafeBackendError("this kazoo version hides the negotiated session timeout")
        self.handler.connect_timeout = self._connect_base()

        def hooked(timeout: float, request: Any, xid: int | None = None) -> Any:
            if not isinstance(request, Connect):
                return invoke(timeout, request, xid)
            bound = self.handler.connect_timeout or timeout
            sent = _clock.now()
            try:
                result = invoke(min(timeout, bound), request, xid)
            except KazooTimeoutError:
                self.handler.connect_timeout = min(bound * 2, timeout)
                raise
            if isinstance(result, tuple):
                self._negotiated_ms = int(result[0].time_out)
                # The leader (re)starts the session's countdown on a Connect: creating a
                # session, or revalidating it on a reconnection, touches it at the leader.
                self._connect_sent = sent
            self.handler.connect_timeout = self._connect_base()
            return result

        connection._invoke = hooked

    # -- state changes (kazoo thread -> loop) --------------------------------------------

    def _on_state_thread(self, state: str) -> None:
        client_id = self.client.client_id
        session_id = client_id[0] if client_id else None
        negotiated = self._negotiated_ms
        connect_sent = self._connect_sent
        with contextlib.suppress(RuntimeError):
            self.backend._mailbox.post(self._on_state, state, session_id, negotiated, connect_sent)

    def _on_state(
        self,
        state: str,
        session_id: int | None,
        negotiated_ms: int,
        connect_sent: float = -math.inf,
    ) -> None:
        if state == KazooState.CONNECTED:
            if self.session_id is not None and session_id != self.session_id:
                self.session_ended("the ZooKeeper session expired")
            if negotiated_ms > 0:
                self.timeout = negotiated_ms / 1000
            self.leader_since = max(self.leader_since, connect_sent)
            self.session_id = session_id
            self.ever_connected = True
            self.connected.set()
            for node in list(self.nodes.values()):
                if node.phase is NodePhase.HELD and not node.armed:
                    self.backend._arm(node)
            if self.doomed or self.orphans:
                self.work.set()
        else:
            self.connected.clear()
            if state == KazooState.LOST and not self.backend._closing:
                self.session_ended("the ZooKeeper session expired or was closed")
        for node in list(self.queued):
            if state != KazooState.CONNECTED:
                node.lower = None  # watches are dropped with the connection: list again
            node.wake.set()

    def session_ended(self, why: str) -> None:
        """Every node of the session is gone: tell holders, send waiters round again."""
        self.session_id = None
        self.proven_at = -math.inf
        self.leader_since = -math.inf
        self.doomed.clear()
        self.cleaned.clear()
        self.orphans.clear()
        nodes, self.nodes = list(self.nodes.values()), {}
        for node in nodes:
            if node.phase is NodePhase.HELD:
                self.backend._lose(node, LeaseLostError(f"lease {describe(node)} lost: {why}"))
            node.forget()
            node.wake.set()

    def proven(self, sent: float, session_id: int | None) -> None:
        """A request sent at ``sent`` was answered by the session that is still current."""
        if session_id is not None and session_id == self.session_id and sent > self.proven_at:
            self.proven_at = sent

    async def tick_time(self) -> float:
        """The ensemble's tickTime in seconds, or a safe upper bound on it (cached).

        Asked with the ``conf`` four-letter word where the servers allow it; else the
        negotiated session timeout / 2: ZooKeeper's minimum session timeout is 2 x tickTime
        unless configured otherwise, so no granted timeout is shorter. An upper bound is what
        the renewal needs (it waits tickTime/2: waiting longer is only slower).
        """
        backend = self.backend
        if backend._tick is None:
            backend._tick = await asyncio.to_thread(conf_tick, backend._hosts) or 0.0
        bound = self.timeout / 2
        return min(backend._tick, bound) if backend._tick > 0 else bound

    def leader_proven(self, sent: float, session_id: int | None) -> None:
        """The leader counts this session alive from ``sent`` on (see ``leader_since``)."""
        if session_id is not None and session_id == self.session_id:
            self.leader_since = max(self.leader_since, sent)
            self.proven(sent, session_id)

    async def wait_connected(self, until: float | None) -> None:
        if self.connected.is_set():
            return
        timeout = None if until is None else until - _clock.now()
        try:
            if timeout is not None and timeout <= 0:
                raise TimeoutError
            async with asyncio.timeout(timeout):
                await self.connected.wait()
        except TimeoutError:
            raise BackendUnavailable(
                f"ZooKeeper at {self.backend._hosts!r} is not reachable"
            ) from None

    def future(self, result: Any) -> asyncio.Future[Any]:
        return self.backend._mailbox.future(result)

    # -- background clean-up ---------------------------------------------------------------

    def discard(self, path: str) -> None:
        self.nodes.pop(path, None)
        self.doomed.add(path)
        self.work.set()
        if self.janitor is None:
            self.janitor = self.loop.create_task(self._janitor(), name="fenced-zk-janitor")

    def discard_prefix(self, parent: str, prefix: str) -> None:
        self.orphans.add((parent, prefix))
        self.work.set()
        if self.janitor is None:
            self.janitor = self.loop.create_task(self._janitor(), name="fenced-zk-janitor")

    async def _janitor(self) -> None:
        """Delete nodes whose owner gave up while the connection was down.

        A node left behind while the session lives would block its lock for good, so every
        node an acquire or release could not delete at once is deleted here, when connected.
        """
        while not self.backend._closed:
            await self.work.wait()
            self.work.clear()
            try:
                await self.connected.wait()
                for parent, prefix in list(self.orphans):
                    children = await self._children(parent)
                    for child in children:
                        if child.startswith(prefix):
                            self.doomed.add(f"{parent}/{child}")
                    self.orphans.discard((parent, prefix))
                for path in list(self.doomed):
                    with contextlib.suppress(NoNodeError, BadVersionError):
                        await self.future(self.client.delete_async(path))
                        self.cleaned[path] = None
                        if len(self.cleaned) > _CLEANED_KEPT:
                            del self.cleaned[next(iter(self.cleaned))]
                    self.doomed.discard(path)
            except (*UNAVAILABLE, SessionExpiredError):
                self.work.set()  # retried at the next connection (or dropped if it expired)
            except Exception:  # pragma: no cover - keep cleaning whatever happens
                logger.exception("ZooKeeper clean-up failed")
                await asyncio.sleep(0.5)
                self.work.set()

    async def _children(self, parent: str) -> list[str]:
        try:
            children: list[str] = await self.future(self.client.get_children_async(parent))
        except NoNodeError:
            return []
        return children


def conf_tick(hosts: str, timeout: float = 0.5) -> float | None:
    """The largest ``tickTime`` (s) the servers of ``hosts`` report to ``conf``; None if none
    answers (``conf`` not allowed by ``4lw.commands.whitelist``, or unreachable)."""
    ticks: list[float] = []
    for host in hosts.split(","):
        name, _, port = host.strip().rpartition(":")
        try:
            with socket.create_connection((name.strip("[]"), int(port)), timeout=timeout) as sock:
                sock.settimeout(timeout)
                sock.sendall(b"conf")
                data = b""
                for _ in range(64):  # bounded: the answer is a few hundred bytes
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    data += chunk
        except (OSError, ValueError):
            continue
        m = re.search(rb"^tickTime=(\d+)$", data, re.MULTILINE)
        if m is not None:
            ticks.append(int(m[1]) / 1000)
    return max(ticks) if ticks else None


def describe(node: Node) -> str:
    token = f" (token {node.grant.token})" if node.grant is not None else ""
    return f"on {node.lock!r}{token}"
