"""``zookeeper://host:port[,host:port...][/chroot]``: locks in ZooKeeper, token = the node's czxid.

Each lock is a persistent node ``/fenced/locks/<name>``; every acquire creates one ephemeral
sequential child under it, named ``<request id>.<nonce>-<sequence>``. The child with the lowest
sequence holds the lock; every other one watches only the child just before it (no herd). The
fencing token is the holder's ``czxid``, the zxid of the transaction that created its node:
global to the ensemble, strictly increasing, and never reused across restarts or a re-created
lock node (the sequence suffix is *not* used: it restarts when the parent is re-created).

The lease is a ZooKeeper session. A backend opens one session per distinct ttl, with the ttl as
its session timeout, so the server itself removes a holder's node once the holder has been
silent for its ttl (paused, crashed or cut off). A live holder that stops renewing gives the
node up at ``sent_at + ttl`` on its own timer. ``Grant.ttl`` is the smaller of the ttl asked for
and the timeout the server negotiated, so the holder never counts on more than the server gives.

kazoo is thread-based. Its callbacks run on kazoo's connection thread (see :class:`InlineHandler`)
and only hand results to the backend's event loop (see :class:`Mailbox`); the loop is never
blocked on a kazoo call. See ``docs/backend-zookeeper.md`` for the safety argument.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import re
from types import MappingProxyType
from typing import Any, ClassVar, Final
from urllib.parse import SplitResult, quote, unquote

from kazoo.exceptions import (
    BadVersionError,
    KazooException,
    NodeExistsError,
    NoNodeError,
    SessionExpiredError,
)
from kazoo.protocol.states import EventType

from .._core import clock as _clock
from .._core.backend import (
    Backend,
    Characteristic,
    Grant,
    LockStatus,
    LostCallback,
    Record,
    lock_timeout,
    redacted,
)
from .._core.errors import (
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    LeaseLostError,
    RecordConflict,
)
from .._core.options import Option
from .._core.state import DEFAULT_TTL
from .._core.token import FencingToken, escape_name, unescape_name
from ._zookeeper_session import (
    UNAVAILABLE,
    Mailbox,
    Node,
    NodePhase,
    Session,
    describe,
    ignore,
    unavailable,
)

__all__ = ["ROOT", "ZooKeeperBackend", "node_prefix", "parse_node"]

logger = logging.getLogger("fenced.zookeeper")

ROOT: Final = "/fenced/locks"
"""Where lock nodes live, under the URL's chroot path if it has one.

The chroot is applied by fenced as a path prefix rather than by kazoo, so that it is created
when missing (a kazoo chroot must exist beforehand)."""

_NODE_RE: Final = re.compile(r"(?P<rid>.*)\.(?P<nonce>[0-9a-f]{8})-(?P<seq>-?[0-9]+)")
_RELEASED: Final = b"released"
"""Data a holder writes to its node in the same transaction that deletes it (see release)."""
_ARM_DELAY: Final = 0.05
"""Seconds after a grant before its holder's node is watched (see ``_grant``)."""
_LEAVE_WAIT: Final = 0.25
"""Seconds a timed-out acquire waits for its waiter node's deletion, at most (see _withdraw)."""
_PING_SLACK: Final = 0.05
"""Seconds added to tickTime/2 between a renewal's first two syncs: the leader's ping loop
waits tickTime/2 between rounds, plus its own scheduling (see ``_renewal_proof``)."""
_PLANT_FOLLOWER_RENEW = False
"""Test plant only: renew with one read a follower may answer alone (the old, unsafe renewal),
so that the partition campaign can show it catches it."""
_RESET_SEQ: Final = 2**30
"""After a release at this sequence number, try to re-create the (empty) lock node: ZooKeeper's
sequence is a signed 32-bit counter per parent node and would wrap after 2**31."""


def node_prefix(request_id: str, nonce: str) -> str:
    """The name of an acquire's node up to the sequence ZooKeeper appends.

    The request id is percent-encoded (so any text is a legal node name and can be read back);
    the nonce is fresh per acquire call, so a path is never reused by a later acquire.
    """
    return f"{quote(request_id, safe='')}.{nonce}-"


def parse_node(name: str) -> tuple[str, str, int] | None:
    """``(request_id, nonce, sequence)`` of one of our node names, or None for any other name."""
    m = _NODE_RE.fullmatch(name)
    if m is None:
        return None
    return unquote(m["rid"]), m["nonce"], int(m["seq"])


def _serial(a: int, b: int) -> int:
    """``a - b`` in 32-bit serial arithmetic (negative: ``a`` was created before ``b``).

    Correct even after the sequence counter wraps, as long as coexisting nodes are less than
    2**31 child changes apart.
    """
    return ((a - b + 2**31) % 2**32) - 2**31


# -- the backend ------------------------------------------------------------------------------


def _bad_path_char(c: str) -> bool:
    """A character ZooKeeper refuses in a path (its PathUtils.validatePath)."""
    o = ord(c)
    return o <= 0x1F or 0x7F <= o <= 0x9F or 0xD800 <= o <= 0xF8FF or 0xFFF0 <= o <= 0xFFFF


_OPTIONS: Final = MappingProxyType(
    {"connect_timeout": Option("number", 10.0, low=0, low_open=True, high=3600)}
)


class ZooKeeperBackend(Backend):
    """Sequential ephemeral nodes, one watch per waiter, czxid as the token; see the module doc."""

    scheme: ClassVar[str] = "zookeeper"
    option_schema = _OPTIONS
    knows_highest = False  # no counter: the highest grant is the holder's, while held
    characteristics: ClassVar[frozenset[Characteristic]] = frozenset(
        {
            Characteristic.LINEARIZABLE,
            Characteristic.DURABLE,
            Characteristic.FIFO,
            Characteristic.DISTRIBUTED,
            Characteristic.SERVER_EXPIRY,
            Characteristic.LOST_NOTIFICATION,
        }
    )

    def __init__(self, hosts: str, connect_timeout: float, chroot: str = "") -> None:
        self._hosts = hosts
        self._root = chroot + ROOT
        self._connect_timeout = connect_timeout
        self._loop = asyncio.get_running_loop()
        self._mailbox = Mailbox(self._loop)
        self._random = random.Random()
        self._sessions: dict[int, Session] = {}
        self._default: Session | None = None
        self._held: dict[tuple[str, str], Node] = {}
        self._last_tokens: dict[str, int] = {}
        self._closed = False
        self._closing = False
        self._leaving: set[asyncio.Task[None]] = set()  # timed-out waiters' deletes
        self._tick: float | None = None  # the ensemble's tickTime (s); 0: not given by conf

    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> ZooKeeperBackend:
        connect_timeout = cls.options(url, options)["connect_timeout"]
        hosts = url.netloc
        if not hosts or "@" in hosts or url.fragment:
            raise ConfigurationError(
                "expected zookeeper://host:port[,host:port...][/chroot] (no credentials or "
                f"fragment), got {redacted(url.geturl())!r}"
            )
        for host in hosts.split(","):
            _, _, port = host.rpartition(":")
            if not host or (":" in host and not port.isdigit()):
                raise ConfigurationError(f"bad ZooKeeper host in {redacted(url.geturl())!r}")
        chroot = url.path.rstrip("/")
        if chroot and (
            any(part in ("", ".", "..") for part in chroot[1:].split("/"))
            or any(_bad_path_char(c) for c in chroot)
        ):
            raise ConfigurationError(
                f"bad ZooKeeper chroot {url.path!r}: no empty, '.' or '..' parts, and no "
                "control, surrogate or private-use characters"
            )
        backend = cls(hosts, float(connect_timeout), chroot)
        try:
            session = backend._session_for(DEFAULT_TTL)
            backend._default = session
            await session.wait_connected(_clock.now() + backend._connect_timeout)
            await session.future(session.client.ensure_path_async(backend._root))
        except BaseException as exc:
            await backend.aclose()
            if isinstance(exc, KazooException):
                raise unavailable("is not usable", exc) from exc
            raise
        return backend

    # -- acquire ---------------------------------------------------------------------------

    async def acquire(
        self,
        name: str,
        *,
        request_id: str,
        ttl: float,
        deadline: float | None,
        on_lost: LostCallback,
        owner: str = "",
    ) -> Grant:
        self._check_open()
        held = self._held.get((name, request_id))
        if held is not None and held.grant is not None and _clock.now() < held.expires_at:
            if on_lost not in held.on_lost:
                held.on_lost.append(on_lost)
            return held.grant  # a retry of a grant whose reply was lost: the same grant
        prefix = node_prefix(request_id, f"{self._random.getrandbits(32):08x}")
        if len(prefix) > 1000:
            raise ConfigurationError(
                f"request id too long for a ZooKeeper node name: {request_id!r}"
            )
        session = self._session_for(ttl)
        parent = f"{self._root}/{escape_name(name)}"
        node = Node(name, request_id, session, parent, prefix, [on_lost], ttl)
        node.owner = owner.encode()
        post = self._mailbox.post
        node.own_watch = lambda ev: post(self._on_own_event, node, ev)
        node.pred_watch = lambda ev: post(_on_pred_event, node, ev)
        session.queued.add(node)
        granted = False
        try:
            sent_at = await self._wait_turn(session, node, deadline)
            granted = True
        except KazooException as exc:
            raise BackendError(f"ZooKeeper refused to queue for {name!r}: {exc!r}") from exc
        finally:
            session.queued.discard(node)
            if not granted:
                self._abandon(node)
        return self._grant(node, ttl, sent_at)

    def _session_for(self, ttl: float) -> Session:
        timeout_ms = max(1, round(ttl * 1000))
        session = self._sessions.get(timeout_ms)
        if session is None:
            session = self._sessions[timeout_ms] = Session(self, timeout_ms)
        return session

    def _connect_until(self, s: Session, deadline: float | None) -> float:
        """How long an acquire waits for its session's connection.

        A new session (its first ttl) gets ``connect_timeout``, but with a deadline at most a
        second past it: opening a session is not counted against a lock timeout. A dropped
        connection may come back with the session, and the waiter's place, intact: it is
        waited for up to the session timeout, or the deadline.
        """
        now = _clock.now()
        if not s.ever_connected:
            until = now + self._connect_timeout
            return until if deadline is None else min(until, max(deadline, now + 1.0))
        until = now + max(s.timeout, 1.0)
        return until if deadline is None else min(until, deadline)

    async def _wait_turn(self, s: Session, node: Node, deadline: float | None) -> float:
        """Queue ``node`` and wait until it is the lowest; return the grant's ``sent_at``."""
        trouble_since: float | None = None
        while True:
            self._check_open()
            if not s.connected.is_set():
                await s.wait_connected(self._connect_until(s, deadline))
            if node.path is not None and (node.deleted or node.session_id != s.session_id):
                node.forget()
            try:
                sent_at = await self._next_step(s, node, deadline)
                if sent_at is not None:
                    sent_at = await self._leader_backed(s, node, sent_at)
            except (*UNAVAILABLE, SessionExpiredError) as exc:
                if isinstance(exc, SessionExpiredError):
                    node.forget()
                node.lower = None
                now = _clock.now()
                trouble_since = trouble_since or now
                if self._closed or now - trouble_since > max(s.timeout, 1.0):
                    raise unavailable("request failed", exc) from exc
                if deadline is not None and now >= deadline:
                    await self._withdraw(node)
                    raise unavailable("request failed before the timeout", exc) from exc
                continue
            if sent_at is not None:
                return sent_at
            trouble_since = None

    async def _next_step(self, s: Session, node: Node, deadline: float | None) -> float | None:
        """One round of the protocol: the ``sent_at`` of the grant, or None to go round again."""
        if node.path is None:
            if node.uncertain:
                listed = await self._find_lost_create(s, node)
            else:
                listed = None
            if listed is None:
                # Trying once: a lock visibly held is not worth a node written and deleted.
                if (
                    deadline is not None
                    and _clock.now() >= deadline
                    and any(parse_node(c) for c in await s._children(node.parent))
                ):
                    raise lock_timeout(node.lock)
                listed = await self._create(s, node)
                if listed is None:
                    return None
            children, sent = listed
            return self._place(s, node, children, sent)
        if node.lower is None:
            sent, sid = _clock.now(), s.session_id
            children = await s._children(node.parent)
            s.proven(sent, sid)
            return self._place(s, node, children, sent)
        if not node.lower:
            return await self._confirm(s, node)
        pred = f"{node.parent}/{node.lower[-1]}"
        if pred in node.gone:
            if len(node.lower) == 1 or pred in node.held_preds:
                # Nothing below the predecessor is left: it was the last node below ours,
                # or it had held the lock (so everything below it was gone already).
                node.lower = []
                fresh = self._fresh_proof(s, node)
                return fresh if fresh is not None else await self._confirm(s, node)
            node.lower = None  # it left without holding: one listing tells what is left
            return None
        if deadline is not None and _clock.now() >= deadline:
            await self._withdraw(node)
            raise lock_timeout(node.lock)
        node.wake.clear()
        sent, sid = _clock.now(), s.session_id
        stat = await s.future(s.client.exists_async(pred, watch=node.pred_watch))
        s.proven(sent, sid)
        if stat is None:
            node.gone.add(pred)
            return None
        if not await _sleep(node.wake, deadline):
            await self._withdraw(node)
            raise lock_timeout(node.lock)
        return None

    async def _create(self, s: Session, node: Node) -> tuple[list[str], float] | None:
        """Create our node and list the queue in one round trip (ZooKeeper keeps a session's
        requests in order, so the listing includes the new node)."""
        client = s.client
        sent = _clock.now()
        node.uncertain = True
        created = s.future(
            client.create_async(
                f"{node.parent}/{node.prefix}",
                node.owner,
                ephemeral=True,
                sequence=True,
                include_data=True,
            )
        )
        listed = s.future(client.get_children_async(node.parent))
        try:
            path, stat = await created
        except NoNodeError:
            node.uncertain = False
            ignore(listed)
            with contextlib.suppress(NodeExistsError):
                await s.future(client.ensure_path_async(node.parent))
            return None
        except BaseException:
            ignore(listed)
            raise
        node.uncertain = False
        if stat.ephemeralOwner != s.session_id:  # made by a session we no longer have
            ignore(listed)
            s.discard(path)
            return None
        self._adopt(s, node, path, stat)
        children: list[str] = await listed
        s.proven(sent, node.session_id)
        return children, sent

    async def _find_lost_create(self, s: Session, node: Node) -> tuple[list[str], float] | None:
        """After a create whose reply was lost: find the node it may have made, by its prefix."""
        sent, sid = _clock.now(), s.session_id
        children = await s._children(node.parent)
        node.uncertain = False
        for child in children:
            if child.startswith(node.prefix):
                path = f"{node.parent}/{child}"
                stat = await s.future(s.client.exists_async(path, watch=node.own_watch))
                if stat is None or stat.ephemeralOwner != s.session_id:
                    return None
                self._adopt(s, node, path, stat)
                node.armed = True
                s.proven(sent, sid)
                return children, sent
        return None

    def _adopt(self, s: Session, node: Node, path: str, stat: Any) -> None:
        parsed = parse_node(path.rsplit("/", 1)[1])
        assert parsed is not None
        node.path = path
        node.seq = parsed[2]
        node.czxid = stat.czxid
        node.version = stat.version
        node.session_id = stat.ephemeralOwner
        node.lower = None
        node.gone.clear()
        node.deleted = False
        s.nodes[path] = node

    def _place(self, s: Session, node: Node, children: list[str], sent: float) -> float | None:
        """Find our place in a listing; the grant's ``sent_at`` if we are first."""
        assert node.path is not None
        own = node.path.rsplit("/", 1)[1]
        if own not in children:
            node.forget()
            return None
        lower = []
        for child in children:
            parsed = parse_node(child)
            if parsed is not None and _serial(parsed[2], node.seq) < 0:
                lower.append((_serial(parsed[2], node.seq), child))
        lower.sort()
        node.lower = [child for _, child in lower]
        if not node.lower:
            return sent
        if not node.armed and not node.arming:
            self._arm(node)  # a waiter needs it to take the lock without a round trip
        return None

    def _fresh_proof(self, s: Session, node: Node) -> float | None:
        """The last predecessor's deletion was just seen: may we grant without a round trip?

        Yes if the watch on our own node is set (so its deletion would have been seen first:
        ZooKeeper sends events in order) and this session answered a request recently: the
        server keeps the session, and so our node, for its timeout after that request.
        """
        if not node.armed or node.deleted or node.session_id != s.session_id:
            return None
        if _clock.now() - s.proven_at > min(node.ttl, s.timeout) / 4:
            return None
        return s.proven_at

    async def _confirm(self, s: Session, node: Node) -> float | None:
        """Check our own node still exists; its request's send time is the grant's ``sent_at``."""
        assert node.path is not None
        sent, sid = _clock.now(), s.session_id
        stat = await s.future(s.client.exists_async(node.path, watch=node.own_watch))
        if not _still_ours(node, stat, same_session=True):
            return None
        s.proven(sent, sid)
        return sent

    def _arm(self, node: Node) -> None:
        """Set a watch on our own node, without waiting: its deletion means the lease is gone."""
        s = node.session
        if node.path is None:
            return
        sent, sid = _clock.now(), s.session_id
        node.arming = True
        future = s.future(s.client.exists_async(node.path, watch=node.own_watch))

        def armed(f: asyncio.Future[Any]) -> None:
            node.arming = False
            if f.cancelled() or f.exception() is not None:
                return  # the connection dropped: re-armed when it is back
            stat = f.result()
            if node.path is None or node.session_id != sid:
                return
            if stat is None or stat.czxid != node.czxid:
                self._node_deleted(node)
            else:
                node.armed = True
                s.proven(sent, sid)

        future.add_done_callback(armed)

    def _on_own_event(self, node: Node, event: Any) -> None:
        if node.path is None or event.path != node.path or node.phase is NodePhase.DONE:
            return
        node.armed = False
        if event.type == EventType.DELETED:
            self._node_deleted(node)
        elif event.type != EventType.NONE and node.session.connected.is_set():
            self._arm(node)  # data changed by someone: keep watching
        # NONE: the connection dropped; the watch is set again when it is back.

    def _node_deleted(self, node: Node) -> None:
        node.deleted = True
        node.armed = False
        if node.phase is NodePhase.HELD:
            node.session.nodes.pop(node.path or "", None)
            self._lose(node, LeaseLostError(f"lease {describe(node)} lost: its node was deleted"))
        node.wake.set()

    def _grant(self, node: Node, ttl: float, sent_at: float) -> Grant:
        s = node.session
        token = FencingToken(node.lock, self._token_value(node))
        grant = Grant(token, node.request_id, min(ttl, s.timeout), sent_at, handle=node)
        node.grant = grant
        node.phase = NodePhase.HELD
        node.lower = None
        node.expires_at = sent_at + grant.ttl
        node.timer = self._loop.call_later(
            max(0.0, node.expires_at - _clock.now()), self._on_timer, node
        )
        self._held[(node.lock, node.request_id)] = node
        if token.value > self._last_tokens.get(node.lock, 0):
            self._last_tokens[node.lock] = token.value
        if s.connected.is_set() and node.session_id == s.session_id:
            # The lock node's data: its last grant, for status() after a release or an
            # expiry (the holder's node is gone then), as the sources with a counter know it.
            # Not awaited (no round trip added to the grant); the session keeps it before
            # the release, and a successor's grant comes after the release or the expiry.
            ignore(s.future(s.client.set_async(node.parent, str(token.value).encode())))
        if not node.armed and not node.arming:
            # Watch our node for deletion, unless the lock is released at once: most
            # critical sections are short, and the watch would cost them a request.
            self._loop.call_later(_ARM_DELAY, self._arm_if_held, node)
        return grant

    def _arm_if_held(self, node: Node) -> None:
        s = node.session
        if (
            node.phase is NodePhase.HELD
            and not node.armed
            and not node.arming
            and s.connected.is_set()
            and node.session_id == s.session_id
        ):
            self._arm(node)

    def _token_value(self, node: Node) -> int:
        """The fencing token of a granted node: its czxid (see the module docstring)."""
        return node.czxid

    def _on_timer(self, node: Node) -> None:
        node.timer = None
        if node.phase is not NodePhase.HELD:
            return
        left = node.expires_at - _clock.now()
        if left > 0:
            node.timer = self._loop.call_later(left, self._on_timer, node)
            return
        self._expire(node)

    def _expire(self, node: Node) -> None:
        """Not renewed in time: give the node up and tell the holder."""
        self._lose(node, LeaseLostError(f"lease {describe(node)} expired: not renewed in time"))
        s = node.session
        if node.path is not None and node.session_id == s.session_id:
            s.discard(node.path)

    def _end_hold(self, node: Node) -> None:
        """The grant ``node`` held is over (lost or released): no renewal timer, not held."""
        node.phase = NodePhase.DONE
        if node.timer is not None:
            node.timer.cancel()
            node.timer = None
        if self._held.get((node.lock, node.request_id)) is node:
            del self._held[(node.lock, node.request_id)]

    def _lose(self, node: Node, cause: LeaseLostError) -> None:
        if node.phase is not NodePhase.HELD:
            return
        self._end_hold(node)
        for callback in node.on_lost:
            try:
                callback(cause)
            except Exception:
                logger.exception("lost-lease callback failed")

    async def _withdraw(self, node: Node) -> None:
        """Leave the queue (timeout): delete our waiter node now if we can, else later."""
        s = node.session
        path = node.path
        if path is None or node.session_id != s.session_id:
            node.forget()
            return
        node.forget()
        if not s.connected.is_set():
            s.discard(path)
            return
        leaving = self._loop.create_task(self._leave(s, path), name="fenced-zk-leave")
        self._leaving.add(leaving)
        leaving.add_done_callback(self._leaving.discard)
        # Wait a little for the node to go (so the queue is tidy when acquire returns), never
        # long: through a server cut off just before the deadline, the delete waits until
        # kazoo notices the dead connection (seen: 0.71 s past a 3 s timeout). The timeout
        # the caller gave is kept; the delete goes on in the background (as on etcd).
        await asyncio.wait({leaving}, timeout=_LEAVE_WAIT)

    async def _leave(self, s: Session, path: str) -> None:
        try:
            await s.future(s.client.delete_async(path))
        except (NoNodeError, SessionExpiredError):
            pass
        except KazooException:
            s.discard(path)  # the connection dropped: deleted once it is back
        except BaseException:  # the backend closed meanwhile (its session goes with it)
            s.discard(path)
            raise

    def _abandon(self, node: Node) -> None:
        """An acquire ended without a grant (error, cancellation): its node must not stay."""
        s = node.session
        if node.path is not None:
            path = node.path
            same_session = node.session_id == s.session_id
            node.forget()
            if same_session:
                s.discard(path)
        elif node.uncertain:
            node.uncertain = False
            s.discard_prefix(node.parent, node.prefix)

    # -- renew / release -------------------------------------------------------------------

    async def renew(self, grant: Grant) -> Grant:
        self._check_open()
        node = self._node_of(grant)
        if node is None or node.phase is not NodePhase.HELD or node.path is None:
            raise LeaseLostError(f"lease {grant.token} is no longer held")
        s = node.session
        if _clock.now() >= node.expires_at:
            self._expire(node)
            raise LeaseLostError(f"lease {grant.token} expired before it was renewed")
        if node.session_id != s.session_id:
            raise LeaseLostError(f"lease {grant.token} lost with its ZooKeeper session")
        if not s.connected.is_set():
            raise BackendUnavailable("ZooKeeper connection lost; the session may still be alive")
        sid = s.session_id
        try:
            sent, stat = await self._renewal_proof(s, node.path, node.own_watch)
        except SessionExpiredError as exc:
            raise LeaseLostError(f"lease {grant.token} lost with its ZooKeeper session") from exc
        except KazooException as exc:
            raise unavailable("renewal failed", exc) from exc
        if node.phase is not NodePhase.HELD:
            raise LeaseLostError(f"lease {grant.token} was lost while renewing")
        if stat is None or stat.czxid != node.czxid or s.session_id != sid:
            self._node_deleted(node)
            raise LeaseLostError(f"lease {grant.token} is gone: its node was deleted")
        node.armed = True
        if _PLANT_FOLLOWER_RENEW:
            s.proven(sent, sid)
        else:
            s.leader_proven(sent, sid)
        node.expires_at = max(node.expires_at, sent + grant.ttl)
        renewed = dataclasses.replace(grant, sent_at=sent)
        if node.grant is None or sent > node.grant.sent_at:
            node.grant = renewed
        return renewed

    async def _leader_backed(self, s: Session, node: Node, sent_at: float) -> float | None:
        """A grant's ``sent_at``, moved back to when the leader surely counts the session from.

        The listing or read that made us first may come from a follower cut off from the
        leader, which may be counting the session down from long before. The session's last
        leader proof (its Connect, a renewal) is used if it is recent (a third of the lease,
        when a renewal would be due anyway); else a fresh proof is made first (tickTime/2 and
        three round trips: a session idle for a third of its timeout pays it once).
        None: our node is gone, go round again.
        """
        if _PLANT_FOLLOWER_RENEW:
            return sent_at
        age, limit = _clock.now() - s.leader_since, min(node.ttl, s.timeout) / 3
        if age <= limit:
            if age > limit / 2:
                self._prove_in_background(s)  # so that a busy session's grants never wait
            return min(sent_at, s.leader_since)
        assert node.path is not None
        sid = s.session_id
        sent, stat = await self._renewal_proof(s, node.path, node.own_watch)
        if not _still_ours(node, stat, same_session=s.session_id == sid):
            return None
        s.leader_proven(sent, sid)
        return sent

    def _prove_in_background(self, s: Session) -> None:
        if s.proving is not None and not s.proving.done():
            return

        async def prove() -> None:
            sid = s.session_id
            with contextlib.suppress(KazooException):
                sent, _ = await self._renewal_proof(s, self._root, None)
                s.leader_proven(sent, sid)

        s.proving = self._loop.create_task(prove(), name="fenced-zk-proof")

    async def _renewal_proof(self, s: Session, path: str, watch: Any) -> tuple[float, Any]:
        """Prove through the leader that it counts the session alive from ``sent`` on.

        Returns ``(sent, stat of path)``. A follower answers reads on its own, even cut off
        from the leader, and only the leader expires sessions; it refreshes a session when a
        follower's reply to its ping (every tickTime/2) lists the session as active, never on
        a request the follower forwards. So: ``sync`` A at ``sent``; after A's reply, wait
        tickTime/2 (+ slack), so that the leader pings the follower between handling A and
        handling ``sync`` B; once B has answered, the follower has replied to that ping (it
        does so before handling B's reply: one ordered stream), listing our session as active
        since A reached it; ``sync`` C then travels behind that reply, so C's answer proves
        the leader applied it, and the session expires at the leader no earlier than
        ``sent`` + timeout. The read of ``path`` after C is as new as C. The argument is in
        docs/backend-zookeeper.md.
        """
        if _PLANT_FOLLOWER_RENEW:
            sent = _clock.now()
            return sent, await s.future(s.client.exists_async(path, watch=watch))
        tick = await s.tick_time()
        sent = _clock.now()
        await s.future(s.client.sync_async(path))  # A
        wait = tick / 2 + _PING_SLACK
        await asyncio.sleep(wait)  # the protocol's wait for one leader ping, not a test sleep
        await s.future(s.client.sync_async(path))  # B
        c = s.future(s.client.sync_async(path))  # C, then the read it orders
        read = s.future(s.client.exists_async(path, watch=watch))
        try:
            await c
        finally:
            ignore(read)
        return sent, await read

    async def resume(self, name: str, token: FencingToken, request_id: str, ttl: float) -> Grant:
        """Refused: a grant lives exactly as long as the ZooKeeper session (of the gateway)
        that made it, and no other session can keep it alive."""
        raise LeaseLostError(
            f"lease on {name!r} (token {token}) was granted through another ZooKeeper session: "
            "on ZooKeeper a grant lives and dies with the gateway that made it"
        )

    async def release(self, grant: Grant) -> bool:
        self._check_open()
        node = self._node_of(grant)
        if node is not None and node.unreleased is not None:
            return await self._release_again(node)
        if node is None or node.phase is not NodePhase.HELD or node.path is None:
            return False
        self._end_hold(node)
        s = node.session
        path, version, seq = node.path, node.version, node.seq
        same_session = node.session_id == s.session_id
        session_id = node.session_id
        node.forget()
        if not same_session or session_id is None:
            return False  # the session, and the node with it, is gone
        node.unreleased = (path, session_id)  # (until it answers: asked again, finished)
        if not s.connected.is_set():
            s.discard(path)
            raise BackendUnavailable(
                "ZooKeeper connection lost: the lock is released once it is back (if this "
                "connection is closed first, when its ZooKeeper session ends)"
            )
        released = await self._delete_own(s, path, version, seq, node.parent)
        node.unreleased = None
        return released

    async def _release_again(self, node: Node) -> bool:
        """A release of ``node``'s grant raised (the connection was down, or the reply lost):
        finish it. The node is ephemeral and its path names one acquire call: while its
        session lives, only a delete takes it away. Still there: deleted now, True. Deleted
        by the session's janitor (the release handed to it): True. Its session ended: False
        (the node went with it, perhaps before the release). Found gone otherwise (the lost
        reply's delete, or a force release: nothing tells which): False, the safe side."""
        assert node.unreleased is not None
        path, session_id = node.unreleased
        s = node.session
        if s.session_id != session_id:
            node.unreleased = None
            return False
        if path in s.cleaned:
            node.unreleased = None
            del s.cleaned[path]
            return True
        if not s.connected.is_set():
            s.discard(path)
            raise BackendUnavailable(
                "ZooKeeper connection lost: the lock is released once it is back (if this "
                "connection is closed first, when its ZooKeeper session ends)"
            )
        try:
            await s.future(s.client.delete_async(path))
        except NoNodeError:
            deleted = path in s.cleaned  # (the janitor, meanwhile)
            s.cleaned.pop(path, None)
            node.unreleased = None
            return deleted
        except SessionExpiredError:
            node.unreleased = None
            return False
        except KazooException as exc:
            s.discard(path)
            raise unavailable(_RELEASE_FAILED, exc) from exc
        s.doomed.discard(path)
        node.unreleased = None
        return True

    async def _delete_own(self, s: Session, path: str, version: int, seq: int, parent: str) -> bool:
        """Delete exactly our node: one transaction marks it released, then deletes it.

        The path names one acquire call (request id, nonce, sequence), so no other grant can
        own it, and both steps check its version. The mark fires the watch of the node queued
        behind ours as a data change: it then knows that ours was deleted *by a holder*, so
        every node below it is gone too, and it takes the lock without listing the queue.
        """
        txn = s.client.transaction()
        txn.set_data(path, _RELEASED, version=version)
        txn.delete(path, version=version + 1)
        try:
            results = await s.future(txn.commit_async())
        except SessionExpiredError:
            return False
        except KazooException as exc:
            s.discard(path)
            raise unavailable(_RELEASE_FAILED, exc) from exc
        if any(isinstance(r, Exception) for r in results):
            if not isinstance(results[0], BadVersionError):
                return False  # gone already (expired or deleted): nothing was changed
            # Someone else wrote to our node (only fenced should): it is still ours by its
            # path, and must not stay behind to block the lock.
            try:
                await s.future(s.client.delete_async(path))
            except NoNodeError:
                return False
            except KazooException as exc:
                s.discard(path)
                raise unavailable(_RELEASE_FAILED, exc) from exc
        if seq >= _RESET_SEQ or seq < 0:
            # Re-create the lock node (if empty) so its sequence counter starts again; the
            # tokens are czxids, which keep growing across a re-created parent.
            ignore(s.future(s.client.delete_async(parent)))
        return True

    def _node_of(self, grant: Grant) -> Node | None:
        node = grant.handle
        if isinstance(node, Node) and node.session.backend is self:
            return node
        return None

    # -- status / close --------------------------------------------------------------------

    async def lock_names(self) -> list[str]:
        self._check_open()
        s = self._status_session()
        try:
            children = await s.future(s.client.get_children_async(self._root))
            return sorted(unescape_name(c) for c in children)
        except KazooException as exc:
            raise unavailable("listing failed", exc) from exc

    async def status(self, name: str) -> LockStatus:
        self._check_open()
        s = self._status_session()
        try:
            found = await self._holder_node(s, name)
        except KazooException as exc:
            raise unavailable("status failed", exc) from exc
        if found is not None:
            return found[0]
        last_value = max(await self._recorded_last(s, name), self._last_tokens.get(name, 0))
        return LockStatus(
            name=name,
            holder=None,
            token=None,
            last_token=FencingToken(name, last_value) if last_value else None,
            remaining=None,
            waiters=0,
        )

    async def _recorded_last(self, s: Session, name: str) -> int:
        """The last grant recorded in the lock node's data (0: none recorded)."""
        try:
            data, _ = await s.future(s.client.get_async(f"{self._root}/{escape_name(name)}"))
        except NoNodeError:
            return 0
        except KazooException as exc:
            raise unavailable("status failed", exc) from exc
        text = bytes(data).decode(errors="replace")
        return int(text) if text.isdigit() else 0

    def _record_path(self, name: str) -> str:
        # Beside the locks' root, not under it: lock_names() does not list records.
        return f"{self._root}-records/{escape_name(name)}"

    async def read_record(self, name: str) -> Record | None:
        self._check_open()
        s = self._status_session()
        path = self._record_path(name)
        try:
            await s.future(s.client.sync_async(path))  # then the read sees every swap before it
            data, stat = await s.future(s.client.get_async(path))
        except NoNodeError:
            return None
        except KazooException as exc:
            raise unavailable("reading a record failed", exc) from exc
        return Record(name, stat.version + 1, data.decode())

    async def swap_record(self, name: str, version: int, value: str) -> Record:
        # A znode's version counts its sets since it was created (0 at creation): the
        # record's version is one more. Records are never deleted.
        self._check_open()
        s = self._status_session()
        path = self._record_path(name)
        data = value.encode()
        try:
            if version == 0:
                await s.future(s.client.create_async(path, data, makepath=True))
            else:
                await s.future(s.client.set_async(path, data, version=version - 1))
        except (NodeExistsError, NoNodeError, BadVersionError) as exc:
            found = await self.read_record(name)
            raise RecordConflict(name, version, 0 if found is None else found.version) from exc
        except KazooException as exc:
            raise unavailable("swapping a record failed", exc) from exc
        return Record(name, version + 1, value)

    async def _holder_node(self, s: Session, name: str) -> tuple[LockStatus, str, int] | None:
        """The holder's status, node path and node version (None: not held)."""
        parent = f"{self._root}/{escape_name(name)}"
        # sync first: the listing then reflects every write committed before this call.
        synced = s.future(s.client.sync_async(parent))
        children = await s._children(parent)
        ignore(synced)
        for _ in range(3):
            queue = _queue_order(children)
            if not queue:
                return None
            holder, request_id = queue[0]
            path = f"{parent}/{holder}"
            try:
                data, stat = await s.future(s.client.get_async(path))
            except NoNodeError:  # it just left: look again
                children = await s._children(parent)
                continue
            token = FencingToken(name, stat.czxid)
            last = max(token.value, self._last_tokens.get(name, 0))
            mine = self._find_local(path)
            remaining = None
            if mine is not None and mine.phase is NodePhase.HELD:
                remaining = max(0.0, mine.expires_at - _clock.now())
            status = LockStatus(
                name=name,
                holder=request_id,
                token=token,
                last_token=FencingToken(name, last),
                remaining=remaining,
                waiters=len(queue) - 1,
                owner=bytes(data).decode(errors="replace") or None,
            )
            return status, path, stat.version
        return None

    async def force_release(
        self, name: str, token: FencingToken | None = None
    ) -> LockStatus | None:
        """Delete the holder's node (checking its version: exactly that grant). Its session's
        watch tells the holder at once; the next waiter's watch wakes it."""
        self._check_open()
        s = self._status_session()
        try:
            for _ in range(5):
                found = await self._holder_node(s, name)
                if found is None:
                    return None
                status, path, version = found
                if token is not None and status.token != token:
                    return None
                try:
                    await s.future(s.client.delete_async(path, version=version))
                except (NoNodeError, BadVersionError):
                    continue  # it changed hands meanwhile: look again
                return status
        except KazooException as exc:
            raise unavailable("force release failed", exc) from exc
        raise BackendUnavailable(f"{name!r} kept changing hands while being released")

    def _find_local(self, path: str) -> Node | None:
        for s in self._sessions.values():
            node = s.nodes.get(path)
            if node is not None:
                return node
        return None

    def _status_session(self) -> Session:
        candidates = [self._default, *self._sessions.values()]
        for s in candidates:
            if s is not None and s.connected.is_set():
                return s
        raise BackendUnavailable(f"ZooKeeper at {self._hosts!r} is not reachable")

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing = True
        sessions = list(self._sessions.values())
        for s in sessions:
            for node in list(s.nodes.values()):
                if node.phase is NodePhase.HELD:
                    self._lose(node, LeaseLostError(f"lease {describe(node)}: connection closed"))
            for node in list(s.queued):
                node.wake.set()
            if s.janitor is not None:
                s.janitor.cancel()
            s.connected.set()  # wake anyone waiting for the connection: they see it closed
        for task in [*self._leaving, *(s.proving for s in sessions if s.proving is not None)]:
            task.cancel()  # closing the session deletes its nodes
        await asyncio.to_thread(_stop_clients, [s.client for s in sessions])


# Retried only while the backend is open: aclose stops the janitor, and the ephemeral node goes
# when the session ends (at once if the close reaches the server, else at its expiry).
_RELEASE_FAILED: Final = (
    "release failed (retried in the background while this connection is open; if it is "
    "closed first, the node goes when its ZooKeeper session ends)"
)


def _stop_clients(clients: list[Any]) -> None:
    for client in clients:
        try:
            client.stop()
            client.close()
        except Exception:  # pragma: no cover - closing is best effort
            logger.debug("closing a kazoo client failed", exc_info=True)


def _still_ours(node: Node, stat: Any, *, same_session: bool) -> bool:
    """Our own node, read again (``stat``), is the one we queued with, in the same session:
    armed (its watch is set); else forgotten (the lease is gone: go round again)."""
    if stat is None or stat.czxid != node.czxid or not same_session:
        node.forget()
        return False
    node.armed = True
    return True


def _on_pred_event(node: Node, event: Any) -> None:
    if event.type == EventType.CHANGED:
        # Only a holder's release writes a lock node, in the transaction that deletes it.
        node.held_preds.add(event.path)
        node.gone.add(event.path)
    elif event.type == EventType.DELETED:
        node.gone.add(event.path)
    node.wake.set()


async def _sleep(event: asyncio.Event, deadline: float | None) -> bool:
    """Wait for ``event`` until ``deadline``; False if the deadline came first."""
    if event.is_set():
        return True
    if deadline is None:
        await event.wait()
        return True
    timeout = deadline - _clock.now()
    if timeout <= 0:
        return False
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


def _queue_order(children: list[str]) -> list[tuple[str, str]]:
    """``(child, request_id)`` of our nodes in a listing, in queue order (oldest first)."""
    parsed = [(c, p) for c in children if (p := parse_node(c)) is not None]
    if not parsed:
        return []
    ref = parsed[0][1][2]  # any member is a valid reference in serial arithmetic
    parsed.sort(key=lambda cp: _serial(cp[1][2], ref))
    return [(c, p[0]) for c, p in parsed]
