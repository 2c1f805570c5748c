"""``etcd://host:port[,host:port,...]``: locks in an etcd v3 cluster; the token is a revision.

Every waiter puts its own key ``<prefix><lock>/<request_id>`` bound to its own etcd lease;
keys are ordered by the revision that created them (``create_revision``), and the lowest holds
the lock, as in etcd's ``concurrency.Mutex``. The token is the holder key's create_revision:
etcd's revision counter is raft-replicated, persisted, and only ever grows, so tokens are
linearizable, durable and strictly increasing per lock. Each waiter watches only the key just
before its own (no thundering herd, no polling) and re-checks when it is deleted.

Safety, step by step (see docs/backend-etcd.md for the full argument):

* grant = a linearizable transaction that sees the waiter's own key with its create_revision
  (so its lease is alive: a key bound to an expired lease is deleted, etcd#11456) and no key
  with a lower create_revision;
* release = ``If(create_revision(key) == token) Then(delete key)``, so a retried release never
  deletes a newer grant of the same request id (etcd#22082);
* acquire is idempotent: ``If(create_revision(key) == 0) Then(put) Else(get)`` finds a retried
  request's own key instead of queueing twice.

Hot path: when the lock is free an acquire is one transaction (create the key and read the
two newest keys of the lock) and a release is one transaction. Leases are recycled: after a
release deleted its key, the lease (alive, now bound to nothing) is kept for the next acquire
while it is fresh, so no LeaseGrant/LeaseRevoke pair is paid per acquire.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import math
from collections.abc import Awaitable
from types import MappingProxyType
from typing import Any, ClassVar, Final, TypeVar
from urllib.parse import SplitResult

from .._clients import grpc as _grpc  # noqa: F401  (first: gRPC reads it when imported)

# isort: split
from aetcd import rpc

from .._clients.etcd_conn import EtcdClient, LeaseNotFound, WatchHandle, cancelling
from .._core import clock as _clock
from .._core.backend import Backend, Characteristic, Grant, LockStatus, LostCallback, Record
from .._core.errors import (
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    LeaseLostError,
    LockTimeout,
    RecordConflict,
)
from .._core.options import Option
from .._core.token import FencingToken, escape_name, unescape_name

__all__ = [
    "EtcdBackend",
    "check_txn",
    "create_txn",
    "parse_endpoints",
    "release_txn",
]

T = TypeVar("T")

DEFAULT_PREFIX = "/fenced/locks/"
DEFAULT_PORT = 2379
MAX_LEASE_TTL = 9_000_000_000  # etcd's MaxLeaseTTL, in seconds

_CREATE = rpc.Compare.CREATE
_VERSION = rpc.Compare.VERSION
_EQUAL = rpc.Compare.EQUAL
_GREATER = rpc.Compare.GREATER
_BY_CREATE = rpc.RangeRequest.CREATE
_ASCEND = rpc.RangeRequest.ASCEND
_LEAVE_WAIT = 0.25  # seconds acquire waits for a timed-out waiter's key to go, at most
_DESCEND = rpc.RangeRequest.DESCEND


def _queue(
    lock_prefix: bytes, order: Any, *, limit: int, keys_only: bool = False, before: int = 0
) -> rpc.RangeRequest:
    """A lock's queue (its waiters' keys), by creation, in ``order``: the first ``limit``
    (only those created before revision ``before``, if given)."""
    return rpc.RangeRequest(
        key=lock_prefix,
        range_end=range_end(lock_prefix),
        max_create_revision=before - 1 if before else 0,
        sort_target=_BY_CREATE,
        sort_order=order,
        limit=limit,
        keys_only=keys_only,
    )


# -- the requests, as pure functions of their inputs ------------------------------------------


def range_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with ``prefix``."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _range_of(key: bytes, member: Any, timeout: float) -> Any:
    return member.kv.Range(rpc.RangeRequest(key=key), timeout=timeout)


def _note_last(last_key: bytes | None, compare: Any, value: bytes) -> list[Any]:
    """A nested transaction that records a grant in the lock's ``last`` key if ``compare``
    (evaluated, as every compare of a transaction, before any of its writes) shows that the
    grant is being made: the lock's last token then survives its release and its expiry, as
    on the sources with a counter. No extra round trip: one more put in a transaction that
    is sent anyway."""
    if last_key is None:
        return []
    put = rpc.RequestOp(request_put=rpc.PutRequest(key=last_key, value=value))
    return [rpc.RequestOp(request_txn=rpc.TxnRequest(compare=[compare], success=[put]))]


def create_txn(
    key: bytes,
    lock_prefix: bytes,
    lease_id: int,
    owner: bytes = b"",
    last_key: bytes | None = None,
) -> Any:
    """Join the queue once: create ``key`` (its value: the holder's description) unless it
    exists, and read the queue's tail.

    Then: the two newest keys of the lock (the new key, and the one just before it, if any);
    and, if the queue was empty (the key is granted at once), ``last_key`` put with an empty
    value: its mod_revision, the transaction's revision, is the new key's create_revision,
    the token. Else (a retry: the key exists): the key itself, with its create_revision and
    lease.
    """
    empty = rpc.Compare(
        key=lock_prefix,
        range_end=range_end(lock_prefix),
        target=_CREATE,
        result=_EQUAL,
        create_revision=0,  # (a compare over an empty range compares a zero key)
    )
    return rpc.TxnRequest(
        compare=[rpc.Compare(key=key, target=_CREATE, result=_EQUAL, create_revision=0)],
        success=[
            rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=owner, lease=lease_id)),
            rpc.RequestOp(request_range=_queue(lock_prefix, _DESCEND, limit=2, keys_only=True)),
            *_note_last(last_key, empty, b""),
        ],
        failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=key, keys_only=True))],
    )


def check_txn(key: bytes, revision: int, lock_prefix: bytes, last_key: bytes | None = None) -> Any:
    """Is ``key`` (created at ``revision``) still there, and which key is just before it?

    Succeeds only if the own key exists with that create_revision, which proves its lease is
    alive; then returns the newest key created before it (none: the caller holds the lock,
    and ``last_key`` is set to the token, ``revision``).
    """
    first = rpc.Compare(  # every key of the lock created at or after ours: none before it
        key=lock_prefix,
        range_end=range_end(lock_prefix),
        target=_CREATE,
        result=_GREATER,
        create_revision=revision - 1,
    )
    return rpc.TxnRequest(
        compare=[rpc.Compare(key=key, target=_CREATE, result=_EQUAL, create_revision=revision)],
        success=[
            rpc.RequestOp(
                request_range=_queue(
                    lock_prefix, _DESCEND, limit=1, keys_only=True, before=revision
                )
            ),
            *_note_last(last_key, first, str(revision).encode()),
        ],
        failure=[],
    )


def swap_txn(key: bytes, version: int, value: bytes) -> Any:
    """Put ``value`` at ``key`` if the key's etcd version (its number of puts since it was
    created; 0: absent) is ``version``; else read it. Records are never deleted, so the
    etcd version is the record's version."""
    return rpc.TxnRequest(
        compare=[rpc.Compare(key=key, target=_VERSION, result=_EQUAL, version=version)],
        success=[rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value))],
        failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=key, keys_only=True))],
    )


def release_txn(key: bytes, revision: int) -> Any:
    """Delete ``key`` only if it is still the one created at ``revision`` (etcd#22082)."""
    return rpc.TxnRequest(
        compare=[rpc.Compare(key=key, target=_CREATE, result=_EQUAL, create_revision=revision)],
        success=[rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))],
        failure=[],
    )


# -- URL and options ----------------------------------------------------------------------------


def parse_endpoints(url: SplitResult) -> list[str]:
    """``host:port`` strings from ``etcd://h1:p1,h2:p2`` (default port 2379)."""
    # The registry picked this backend by the scheme's base (etcd, etcd3); only the
    # transport suffix is checked here.
    _, _, transport = url.scheme.lower().partition("+")
    if transport not in ("", "http"):
        raise ConfigurationError(
            f"unsupported etcd URL scheme {url.scheme!r}: use etcd:// (TLS is not supported yet)"
        )
    netloc = url.netloc
    if "@" in netloc:
        raise ConfigurationError("etcd:// does not support user names or passwords yet")
    if url.path not in ("", "/"):
        raise ConfigurationError(
            f"etcd:// takes no path ({url.path!r}); set the key prefix with the prefix option"
        )
    endpoints = []
    for part in netloc.split(","):
        part = part.strip()
        if not part:
            raise ConfigurationError(f"empty endpoint in etcd URL {url.geturl()!r}")
        if part.startswith("["):
            host, sep, rest = part[1:].partition("]")
            if not sep or (rest and not rest.startswith(":")):
                raise ConfigurationError(f"bad etcd endpoint {part!r}")
            port_text = rest[1:] if rest else ""
            host = f"[{host}]"
        else:
            host, _, port_text = part.partition(":")
        if not host:
            raise ConfigurationError(f"bad etcd endpoint {part!r}: no host")
        port = DEFAULT_PORT
        if port_text:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise ConfigurationError(f"bad etcd endpoint {part!r}: port must be 1-65535")
            port = int(port_text)
        endpoints.append(f"{host}:{port}")
    return endpoints


_OPTIONS: Final = MappingProxyType(
    {
        "prefix": Option("str", DEFAULT_PREFIX, check=lambda v: None if v else "must not be empty"),
        "timeout": Option("number", 2.0, low=0, low_open=True, high=3600),
        "retry_for": Option("number", 5.0, low=0, low_open=True, high=86_400),
        "lease_pool": Option("int", 16, low=0, high=10_000),
    }
)


def lease_seconds(ttl: float) -> int:
    """etcd leases have whole-second TTLs: round up, never down."""
    if not (math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"ttl must be positive, got {ttl!r}")
    seconds = max(1, math.ceil(ttl - 1e-9))
    if seconds > MAX_LEASE_TTL:
        raise ConfigurationError(f"ttl {ttl} exceeds etcd's maximum lease TTL {MAX_LEASE_TTL}")
    return seconds


# -- state ---------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False, slots=True)
class _Lease:
    """An etcd lease as this client knows it."""

    id: int
    ttl: int
    """The TTL the server granted (or last renewed to), seconds; may exceed the asked one."""
    refreshed_at: float
    """:func:`_clock.now` taken before the grant or last successful keepalive was sent."""
    asked: int = 0
    """The TTL this backend asked for (the lease pool's key); 0 for an adopted lease."""
    owned: bool = True
    """Granted by this backend (only such a lease is recycled after its key is deleted)."""


@dataclasses.dataclass(eq=False, slots=True)
class _Hold:
    """One key in one lock's queue: ``Grant.handle`` once granted."""

    key: bytes
    revision: int
    lease: _Lease
    released: bool = False
    release_sent: bool = False  # a release was sent (perhaps applied, its reply lost)


class _Vanished(Exception):
    """The waiter's own key is gone (its lease expired or was revoked): queue again."""


class EtcdBackend(Backend):
    """Fenced locks in etcd v3; see the module docstring."""

    scheme: ClassVar[str] = "etcd"
    characteristics: ClassVar[frozenset[Characteristic]] = frozenset(
        {
            Characteristic.LINEARIZABLE,
            Characteristic.DURABLE,
            Characteristic.FIFO,
            Characteristic.DISTRIBUTED,
            Characteristic.SERVER_EXPIRY,
        }
    )

    option_schema = _OPTIONS
    knows_highest = False  # no counter: the highest grant is the holder's, while held

    def __init__(self, client: EtcdClient, *, prefix: bytes, lease_pool: int) -> None:
        self._client = client
        self._prefix = prefix
        self._pool_size = lease_pool
        self._pool: dict[int, list[_Lease]] = {}
        self._holds: dict[bytes, _Hold] = {}
        # Keys this backend put in a lock's queue and may still have there, not granted: a
        # waiter's, or one whose leave is in flight or failed. aclose deletes them (with
        # their leases): left behind, the closed connection was granted the lock for its ttl.
        self._queued: dict[bytes, _Hold] = {}
        self._closing = False

    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> EtcdBackend:
        endpoints = parse_endpoints(url)
        opts = cls.options(url, options)
        client = EtcdClient(endpoints, timeout=opts["timeout"], retry_for=opts["retry_for"])
        try:
            # Fail early on an unreachable cluster or an endpoint that is not etcd.
            await client.call(
                lambda m, t: m.maintenance.Status(rpc.StatusRequest(), timeout=t),
                what="status",
            )
        except BaseException:
            await client.close()
            raise
        return cls(client, prefix=opts["prefix"].encode(), lease_pool=opts["lease_pool"])

    # -- small helpers -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        # (closing: a waiter whose key aclose deleted must not queue again)
        return self._closing or self._client.closed

    def _lock_prefix(self, name: str) -> bytes:
        # "/" in a name is escaped: the prefix of "jobs" must not cover "jobs/nightly"'s keys.
        return self._prefix + escape_name(name).encode() + b"/"

    async def _txn(self, request: Any, what: str, deadline: float | None = None) -> Any:
        return await self._client.call(
            lambda m, t: m.kv.Txn(request, timeout=t), what=what, deadline=deadline
        )

    # -- leases --------------------------------------------------------------------------------

    async def _new_lease(self, seconds: int, deadline: float | None) -> _Lease:
        sent = _clock.now()
        reply = await self._client.call(
            lambda m, t: m.lease.LeaseGrant(rpc.LeaseGrantRequest(TTL=seconds), timeout=t),
            what="lease grant",
            deadline=deadline,
        )
        if reply.error:
            raise BackendError(f"etcd lease grant failed: {reply.error}")
        return _Lease(reply.ID, reply.TTL, sent, asked=seconds)

    def _pooled_lease(self, seconds: int) -> _Lease | None:
        """A recycled lease still fresh enough that the holder gets most of its ttl."""
        pool = self._pool.get(seconds)
        now = _clock.now()
        while pool:
            lease = pool.pop()
            if now - lease.refreshed_at <= lease.ttl / 4:
                return lease
            self._client.spawn(self._revoke(lease.id))
        return None

    def _recycle(self, lease: _Lease) -> None:
        """Keep a lease that no key is bound to any more (its key was deleted by us), or revoke it.

        Only a lease this backend granted itself is kept: an adopted one may still be in use
        by another client of the same request id, whose renewals must then fail.
        """
        pool = self._pool.setdefault(lease.asked, [])
        fresh = _clock.now() - lease.refreshed_at <= lease.ttl / 4
        if lease.owned and fresh and len(pool) < self._pool_size and not self._client.closed:
            pool.append(lease)
        else:
            self._client.spawn(self._revoke(lease.id))

    async def _revoke(self, lease_id: int) -> None:
        with contextlib.suppress(LeaseNotFound):
            await self._client.call(
                lambda m, t: m.lease.LeaseRevoke(rpc.LeaseRevokeRequest(ID=lease_id), timeout=t),
                what="lease revoke",
            )

    async def _keep_waiting(self, lease: _Lease, wake: asyncio.Event, gone: list[bool]) -> None:
        """Keep a waiter's lease alive (every ttl/3); on its loss, wake the waiter."""
        while True:
            await asyncio.sleep(max(0.0, lease.refreshed_at + lease.ttl / 3 - _clock.now()))
            sent = _clock.now()
            try:
                ttl = await self._client.keepalive(lease.id)
            except BackendError:
                await asyncio.sleep(min(max(lease.ttl / 10, 0.05), 1.0))
                continue
            if ttl <= 0:
                gone.append(True)
                wake.set()
                return
            lease.ttl = ttl
            lease.refreshed_at = max(lease.refreshed_at, sent)

    # -- acquire -------------------------------------------------------------------------------

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
        seconds = lease_seconds(ttl)
        lock_prefix = self._lock_prefix(name)
        key = lock_prefix + request_id.encode()
        stale_leases = 0
        while True:
            lease = self._pooled_lease(seconds)
            pooled = lease is not None
            if lease is None:
                lease = await self._new_lease(seconds, deadline)
            try:
                reply = await self._txn(
                    create_txn(key, lock_prefix, lease.id, owner.encode(), self._last_key(name)),
                    "acquire",
                    deadline,
                )
            except LeaseNotFound:
                # A recycled lease had expired or was revoked by someone: take a fresh one.
                stale_leases += 1
                if not pooled and stale_leases > 3:
                    raise BackendError("etcd keeps losing freshly granted leases") from None
                continue
            except (LockTimeout, asyncio.CancelledError):
                # Maybe the key was created: revoking the lease removes it from the queue.
                # (A CancelledError here is this task's: the transport turns gRPC's own.)
                self._client.spawn(self._revoke(lease.id))
                raise
            # (Unavailable: it is unknown whether the key was created with this lease. The
            # lease is dropped, not recycled: it expires, or a retry of this request adopts it.)
            if reply.succeeded:
                hold = _Hold(key, reply.header.revision, lease)
                tail = reply.responses[1].response_range.kvs
                self._holds[key] = hold
                if len(tail) < 2:  # the new key is the only one: held at once
                    return self._grant(name, request_id, hold)
                before: Any = tail[1]
                seen = reply.header.revision
            elif reply.responses[0].response_range.kvs[0].lease == lease.id:
                # Our own put: an attempt whose reply was lost ("request timed out", a dead
                # member) was applied, and the failover replayed the transaction. The key is
                # bound to this lease, which must neither be pooled nor treated as adopted.
                kv = reply.responses[0].response_range.kvs[0]
                hold, before, seen = _Hold(key, kv.create_revision, lease), None, 0
                self._holds[key] = hold
            else:
                self._recycle(lease)  # unused: the request's key exists already
                kv = reply.responses[0].response_range.kvs[0]
                adopted = await self._adopt(key, kv, deadline)
                if adopted is None:
                    continue  # its lease just ended: the key is gone, queue afresh
                hold, before, seen = adopted, None, 0
            try:
                await self._wait(hold, lock_prefix, before, seen, deadline)
            except _Vanished:
                self._forget(hold)
                continue
            return self._grant(name, request_id, hold)

    async def _adopt(self, key: bytes, kv: Any, deadline: float | None) -> _Hold | None:
        """A retried acquire found its own key: take over its lease (and keep it alive)."""
        known = self._holds.get(key)
        if known is not None and known.revision == kv.create_revision and not known.released:
            hold = known
        else:
            hold = _Hold(key, kv.create_revision, _Lease(kv.lease, 1, _clock.now(), owned=False))
        sent = _clock.now()
        ttl = await self._client.keepalive(hold.lease.id, deadline=deadline)
        if ttl <= 0:
            return None
        hold.lease.ttl = ttl
        hold.lease.refreshed_at = max(hold.lease.refreshed_at, sent)
        self._holds[key] = hold
        return hold

    def _grant(self, name: str, request_id: str, hold: _Hold) -> Grant:
        return Grant(
            token=FencingToken(name, hold.revision),
            request_id=request_id,
            ttl=float(hold.lease.ttl),
            sent_at=hold.lease.refreshed_at,
            handle=hold,
        )

    def _forget(self, hold: _Hold) -> None:
        if self._holds.get(hold.key) is hold:
            del self._holds[hold.key]

    async def _check(self, hold: _Hold, lock_prefix: bytes, deadline: float | None) -> Any:
        """The key just before ours, or None if we hold the lock; _Vanished if ours is gone."""
        last_key = self._last_prefix + lock_prefix[len(self._prefix) : -1]  # (escaped name)
        request = check_txn(hold.key, hold.revision, lock_prefix, last_key)
        reply = await self._txn(request, "check", deadline)
        if not reply.succeeded:
            raise _Vanished
        kvs = reply.responses[0].response_range.kvs
        return (kvs[0] if kvs else None), reply.header.revision

    async def _wait(
        self,
        hold: _Hold,
        lock_prefix: bytes,
        before: Any,
        seen: int,
        deadline: float | None,
    ) -> None:
        """Wait in the queue until ``hold`` is the lowest key; return once it holds.

        ``before`` is the key just before ours as seen at revision ``seen`` (None: unknown,
        check first). Raises _Vanished if our key disappears, LockTimeout at the deadline
        (after leaving the queue), BackendUnavailable if etcd cannot be reached.
        """
        wake = asyncio.Event()  # set by the watch, or by the lease keeper when our lease is gone
        gone: list[bool] = []
        keeper = asyncio.create_task(
            self._keep_waiting(hold.lease, wake, gone), name="fenced-etcd-waiter-lease"
        )
        watch: WatchHandle | None = None
        watched: tuple[bytes, int] | None = None
        leave = True  # leave the queue on the way out unless granted/vanished/unreachable
        self._queued[hold.key] = hold
        try:
            need_check = before is None
            while True:
                if need_check:
                    before, seen = await self._check(hold, lock_prefix, deadline)
                    if before is None:
                        leave = False
                        self._unqueue(hold)  # granted
                        return
                need_check = True
                if deadline is not None and _clock.now() >= deadline:
                    raise LockTimeout(_timeout_message(lock_prefix))
                target = (before.key, before.create_revision)
                if watch is None or watch.fired or watched != target:
                    if watch is not None:
                        watch.cancel()
                    wake.clear()
                    watch = self._client.current.hub().watch_delete(before.key, wake)
                    watched = target
                    try:
                        registered = await self._until(watch.created, deadline)
                    except BackendUnavailable:
                        await asyncio.sleep(0.05)  # the stream broke: look again elsewhere
                        continue
                    except TimeoutError:
                        raise LockTimeout(_timeout_message(lock_prefix)) from None
                    if registered > seen and not await self._still_there(watch, before):
                        continue  # it went between our look and the watch: look again
                if gone:
                    continue  # the check will find our key gone
                try:
                    await self._until(wake.wait(), deadline)
                except TimeoutError:
                    raise LockTimeout(_timeout_message(lock_prefix)) from None
                wake.clear()
        except BackendUnavailable:
            leave = False  # keep our place: a retry of this request adopts the key
            raise
        except _Vanished:
            leave = False
            self._unqueue(hold)
            raise
        finally:
            keeper.cancel()
            if watch is not None:
                watch.cancel()
            if leave:
                self._forget(hold)
                leaving = self._client.spawn(self._leave(hold))
                if not cancelling():
                    # Wait a little for the key to go (so the queue is tidy when acquire
                    # returns), never long: a member cut off just before the deadline would
                    # hold the caller past its timeout for up to retry_for (seen: a 3 s
                    # timeout answered after 8 s). The leave goes on in the background.
                    await asyncio.wait({leaving}, timeout=_LEAVE_WAIT)

    async def _still_there(self, watch: WatchHandle, before: Any) -> bool:
        """Does ``before`` still exist at or after the revision ``watch`` was registered at?

        Only decides whether to wait on the watch or look again (never whether we hold the
        lock), so a serializable read of the watch's own member is enough: its state is at
        least as new as the watch registration. Any doubt answers False (look again).
        """
        request = rpc.RangeRequest(key=before.key, keys_only=True, serializable=True)
        try:
            reply = await watch.member.kv.Range(request, timeout=self._client.timeout)
        except asyncio.CancelledError:
            if cancelling():
                raise
            return False  # the member's channel was closed under the call
        except Exception:
            return False
        return bool(reply.kvs) and reply.kvs[0].create_revision == before.create_revision

    async def _until(self, aw: Awaitable[T], deadline: float | None) -> T:
        if deadline is None:
            return await aw
        async with asyncio.timeout(max(0.0, deadline - _clock.now())):
            return await aw

    async def _leave(self, hold: _Hold) -> None:
        """Give up a place in the queue (timeout, cancellation): delete the key, keep the lease."""
        try:
            reply = await self._txn(release_txn(hold.key, hold.revision), "leave queue")
        except (BackendError, asyncio.CancelledError):
            return  # the key goes when its lease (no longer kept alive) expires, or aclose
        self._unqueue(hold)
        if reply.succeeded:
            self._recycle(hold.lease)

    def _unqueue(self, hold: _Hold) -> None:
        if self._queued.get(hold.key) is hold:
            del self._queued[hold.key]

    async def _drop(self, hold: _Hold) -> None:
        """aclose's leave: the key deleted with its lease (an adopted lease is not ours to
        revoke: the key alone then)."""
        if hold.lease.owned:
            await self._revoke(hold.lease.id)  # (deletes the key with it)
        else:
            await self._txn(release_txn(hold.key, hold.revision), "leave queue")

    # -- renew / release / status --------------------------------------------------------------

    async def renew(self, grant: Grant) -> Grant:
        self._check_open()
        hold: _Hold = grant.handle
        if hold.released:
            raise LeaseLostError(f"lease {grant.token} was released")
        sent = _clock.now()
        ttl = await self._client.keepalive(hold.lease.id)
        if ttl <= 0:
            raise LeaseLostError(
                f"lease on {grant.token.lock!r} (token {grant.token}) is gone: its etcd lease "
                f"{hold.lease.id:x} expired or was revoked"
            )
        hold.lease.ttl = ttl
        hold.lease.refreshed_at = max(hold.lease.refreshed_at, sent)
        return dataclasses.replace(grant, sent_at=sent, ttl=float(ttl))

    async def resume(self, name: str, token: FencingToken, request_id: str, ttl: float) -> Grant:
        """Adopt the holder's key (``create_revision`` = token) and its etcd lease, which any
        client of the cluster may keep alive or revoke: a gateway takes over another's grant."""
        self._check_open()
        key = self._lock_prefix(name) + request_id.encode()
        got = await self._client.call(functools.partial(_range_of, key), what="resume")
        if not got.kvs or got.kvs[0].create_revision != token.value:
            raise LeaseLostError(f"lease on {name!r} (token {token}) is no longer held")
        hold = await self._adopt(key, got.kvs[0], None)
        if hold is None:
            raise LeaseLostError(f"lease on {name!r} (token {token}): its etcd lease expired")
        return self._grant(name, request_id, hold)

    async def release(self, grant: Grant) -> bool:
        self._check_open()
        hold: _Hold = grant.handle
        if hold.released:
            return False
        request = self._release_request(hold)
        retried = hold.release_sent  # (a release of this grant raised: this is its retry)

        def send(member: Any, timeout: float) -> Any:
            nonlocal retried
            retried = retried or hold.release_sent
            hold.release_sent = True
            return member.kv.Txn(request, timeout=timeout)

        reply = await self._client.call(send, what="release")
        hold.released = True
        self._forget(hold)
        if reply.succeeded:
            deleted = bool(reply.responses and reply.responses[0].response_delete_range.deleted)
        elif retried:
            # An earlier attempt (of this call, or of one that raised), whose reply was lost,
            # may have deleted the key.
            deleted = await self._deleted_by_us(hold)
        else:
            return False  # expired, or already released: nothing of ours to delete
        if deleted:
            self._recycle(hold.lease)
        return deleted

    async def _deleted_by_us(self, hold: _Hold) -> bool:
        """After a retried release found nothing to delete: was the key deleted by an earlier
        attempt of that release (True), or did the grant end otherwise (False)?

        A key that expired went with its lease, and a force release revokes the lease too;
        our release deletes the key and keeps the lease. So: the key gone (not re-created by
        another client of the request id) and its lease still alive is our own release. When
        in doubt (the lease gone since, e.g. a long partition), False: a loss reported that
        was not one is safe, a release claimed for a grant already lost is not.
        """
        got = await self._client.call(functools.partial(_range_of, hold.key), what="release")
        if got.kvs:
            return False  # the key exists anew: another grant's, not to be touched
        lease_id = hold.lease.id
        info = await self._client.call(
            lambda m, t: m.lease.LeaseTimeToLive(
                rpc.LeaseTimeToLiveRequest(ID=lease_id), timeout=t
            ),
            what="release",
        )
        return bool(info.TTL > 0)

    def _release_request(self, hold: _Hold) -> Any:
        return release_txn(hold.key, hold.revision)

    async def force_release(
        self, name: str, token: FencingToken | None = None
    ) -> LockStatus | None:
        """Delete the holder's key if it is still that grant (``create_revision`` compared in
        one transaction), then revoke its etcd lease, so that the holder's next keepalive
        fails (a deleted key alone would not tell it). The lease is that grant's alone: a
        lease is only recycled by its holder's own release, which finds the key gone."""
        self._check_open()
        for _ in range(5):
            status = await self._held_by(name, token)
            if status is None or status.token is None or status.holder is None:
                return None
            key = self._lock_prefix(name) + status.holder.encode()
            got = await self._client.call(functools.partial(_range_of, key), what="force release")
            if not got.kvs or got.kvs[0].create_revision != status.token.value:
                continue
            lease_id = got.kvs[0].lease
            request = release_txn(key, status.token.value)
            attempts = 0

            def send(member: Any, timeout: float, request: Any = request) -> Any:
                nonlocal attempts
                attempts += 1
                return member.kv.Txn(request, timeout=timeout)

            reply = await self._client.call(send, what="force release")
            if not reply.succeeded:
                # Retried, and the key is gone: an earlier attempt whose reply was lost may
                # have deleted it. Its lease is revoked all the same, so that the holder
                # learns of it (else its keepalives go on succeeding, and it believes it
                # holds a lock another client may be granted).
                retried_gone = (
                    attempts > 1
                    and not (
                        await self._client.call(
                            functools.partial(_range_of, key), what="force release"
                        )
                    ).kvs
                )
                if not retried_gone:
                    continue  # released or expired meanwhile: look again
            if lease_id:
                await self._revoke(lease_id)
            return status
        raise BackendUnavailable(f"{name!r} kept changing hands while being released")

    async def lock_names(self) -> list[str]:
        self._check_open()
        prefix = self._prefix
        request = rpc.RangeRequest(key=prefix, range_end=range_end(prefix), keys_only=True)
        reply = await self._client.call(lambda m, t: m.kv.Range(request, timeout=t), what="list")
        # Keys are <prefix><escaped name>/<waiter>: the escaped name has no '/'.
        names = {
            unescape_name(kv.key[len(prefix) :].split(b"/", 1)[0].decode(errors="replace"))
            for kv in reply.kvs
        }
        # ... and the locks granted before, free now (as the sources with a counter list them)
        last = self._last_prefix
        request = rpc.RangeRequest(key=last, range_end=range_end(last), keys_only=True)
        reply = await self._client.call(lambda m, t: m.kv.Range(request, timeout=t), what="list")
        names.update(
            unescape_name(kv.key[len(last) :].decode(errors="replace")) for kv in reply.kvs
        )
        return sorted(n for n in names if n)

    async def status(self, name: str) -> LockStatus:
        self._check_open()
        lock_prefix = self._lock_prefix(name)
        request = _queue(lock_prefix, _ASCEND, limit=1)
        reply = await self._client.call(lambda m, t: m.kv.Range(request, timeout=t), what="status")
        if not reply.kvs:
            last = await self._last_token(name)
            return LockStatus(name, None, None, last, None, waiters=0)
        kv = reply.kvs[0]
        remaining: float | None = None
        if kv.lease:
            info = await self._client.call(
                lambda m, t: m.lease.LeaseTimeToLive(
                    rpc.LeaseTimeToLiveRequest(ID=kv.lease), timeout=t
                ),
                what="lease time-to-live",
            )
            remaining = float(max(info.TTL, 0))
        token = FencingToken(name, kv.create_revision)
        return LockStatus(
            name=name,
            holder=kv.key[len(lock_prefix) :].decode(errors="replace"),
            token=token,
            last_token=token,
            remaining=remaining,
            waiters=max(0, reply.count - 1),
            owner=kv.value.decode(errors="replace") or None,
        )

    @property
    def _last_prefix(self) -> bytes:
        # Beside the locks' prefix, outside its range (a lock's range holds only its queue).
        return self._prefix.rstrip(b"/") + b".last/"

    def _last_key(self, name: str) -> bytes:
        """The lock's last grant: its value the token, or empty for "this key's mod_revision"
        (a grant made by the transaction that created the holder's key)."""
        return self._last_prefix + escape_name(name).encode()

    async def _last_token(self, name: str) -> FencingToken | None:
        request = rpc.RangeRequest(key=self._last_key(name))
        reply = await self._client.call(lambda m, t: m.kv.Range(request, timeout=t), what="status")
        if not reply.kvs:
            return None  # never granted (or granted only by a fenced before 0.2)
        kv = reply.kvs[0]
        return FencingToken(name, int(kv.value) if kv.value else kv.mod_revision)

    def _record_key(self, name: str) -> bytes:
        # Beside the locks' prefix, outside its range: lock_names() does not list records.
        return self._prefix.rstrip(b"/") + b".records/" + escape_name(name).encode()

    async def read_record(self, name: str) -> Record | None:
        self._check_open()
        request = rpc.RangeRequest(key=self._record_key(name))
        reply = await self._client.call(
            lambda m, t: m.kv.Range(request, timeout=t), what="read record"
        )
        if not reply.kvs:
            return None
        kv = reply.kvs[0]
        return Record(name, kv.version, kv.value.decode())

    async def swap_record(self, name: str, version: int, value: str) -> Record:
        self._check_open()
        reply = await self._txn(
            swap_txn(self._record_key(name), version, value.encode()), "swap record"
        )
        if not reply.succeeded:
            kvs = reply.responses[0].response_range.kvs
            raise RecordConflict(name, version, kvs[0].version if kvs else 0)
        return Record(name, version + 1, value)

    async def aclose(self) -> None:
        if self._client.closed:
            return
        # No acquire queues from now on, and the keys still queued go while calls can still
        # run (closing the client cancels a waiter's background leave, and a waiter cut off by
        # the close keeps its place for a retry that never comes).
        self._closing = True
        queued = list(self._queued.values())
        self._queued.clear()
        pooled = [lease for pool in self._pool.values() for lease in pool]
        self._pool.clear()
        if pooled or queued:
            with contextlib.suppress(Exception, TimeoutError):
                async with asyncio.timeout(1.0):
                    await asyncio.gather(
                        *(self._drop(hold) for hold in queued),
                        *(self._revoke(lease.id) for lease in pooled),
                        return_exceptions=True,
                    )
        await self._client.close()


def _timeout_message(lock_prefix: bytes) -> str:
    return f"etcd lock {lock_prefix.decode(errors='replace')!r} not acquired before the timeout"
