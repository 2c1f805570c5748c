"""etcd guard: fenced ``put``/``delete``, each ONE etcd transaction that checks, advances, writes.

::

    async with aetcd.Client("127.0.0.1", 2379) as client:
        guard = AsyncEtcdGuard(client, "invoices")
        await guard.put("invoices/42", payload, token=lease.token)   # StaleTokenError if fenced off

    with EtcdGuard("127.0.0.1:2379", "invoices") as guard:      # sync: same code, private loop
        guard.put("invoices/42", payload, token=lease.token)

The resource keeps two keys next to the data: ``<prefix>hw/<resource>``, the highest accepted
token value, and ``<prefix>lock/<resource>``, the lock whose tokens it accepts. Both are plain
etcd keys (no lease), replicated and fsynced by Raft with the data: exactly as durable as it.

One write is one ``Txn``. etcd applies a transaction atomically at one revision, so no other
writer can come between the comparison and the writes::

    if value(lock key) == lock and value(hw key) == enc(m):       # m: a mark known to be <= token
        put hw key = enc(token); the caller's put/delete              # accepted
    else:
        get lock key; get hw key                                      # refused: report why

The comparison is an *equality* with a mark the client has already read, strictly decoded and
found to be at most the token. An ordering compare (``value(hw) < enc(token + 1)``) cannot
fail closed: etcd compares bytes, and a damaged mark such as ``b""``, ``b"-5"``, ``b"0"`` or
a valid mark with bytes appended sorts below every encoded token, so it would let any writer
in. Equality with a well-formed encoding is never true of a damaged value: the failure branch
returns it, the client refuses to decode it, and the write raises
:class:`~fenced.CorruptMarkError` (nothing written).

``m`` is the mark this guard last saw (at first, the token itself: the common case is a holder
writing again). If the mark moved, the failure branch's reads give the new one; if it is still
at most the token, the write is sent again with it, otherwise it is stale. So a holder's
repeated writes take one round trip, and the first write after a handoff two. The mark only
grows, so the retries end.

etcd ANDs the compares of a transaction, and a VALUE compare against a key that does not exist
is always false. The first write to a resource therefore fails (writing nothing), sees both
fence keys missing, creates them with one create-if-absent transaction (``create_revision ==
0``; the mark starts at ``enc(0)``, below every token) and tries again. A resource with only
*one* of its two fence keys was damaged (a deleted mark while the lock binding remains would
otherwise restart the mark at 0): that is :class:`~fenced.CorruptMarkError` too.

Every guard's ``prefix`` (default ``fenced/``) must start with ``fenced/``, and no guarded put
or delete (nor a delete range) may touch a key in ``fenced/`` or in the etcd lock source's
``/fenced/``, whatever the guard's own prefix: so no guard can rewrite or delete any fence key
(its own, another resource's, another prefix's) nor a holder's key. The keys
``<prefix>hw/<resource>`` and ``<prefix>lock/<resource>`` are distinct for distinct resources.
(Before, any prefix was accepted and only the default key spaces were reserved: a guard with
prefix ``a/`` could rewrite the marks of a guard with prefix ``b/``. A prefix outside
``fenced/`` is now a ConfigurationError; move such marks by copying both keys.) Both fence keys missing after this guard
saw the mark is :class:`~fenced.CorruptMarkError` too (binding them again would restart the
mark at 0).

Encoding: token values are written as 19-digit zero-padded decimals (``2**63 - 1`` has 19
digits), readable in ``etcdctl get``; anything else stored in the mark is corrupt.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

from .._clients import grpc as _grpc  # noqa: F401  (first: gRPC reads it when imported)

# isort: split
import aetcd
from aetcd import rpc

from .._clients import grpc_errors as _grpc_errors
from .._clients.etcd_conn import EtcdClient, Member, check_grpc_usable
from .._core.errors import (
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    CorruptMarkError,
    FenceConflictError,
    FencedError,
    StaleTokenError,
    WrongLockError,
    member_behind_error,
    stale_epoch_error,
)
from .._core.portal import Portal
from .._core.signing import TokenVerifier
from .._core.token import MAX_TOKEN, FencingToken, TokenLike, validate_lock_name
from ..backends.etcd import parse_endpoints, range_end
from ._plan import GroupItem, GroupState, GuardPlan, adrive, checked_group_state
from ._token_arg import lock_keyword, token_keyword

__all__ = [
    "MAX_TXN_OPS",
    "Accepted",
    "AsyncEtcdGuard",
    "EtcdGuard",
    "check_txn",
    "decode_value",
    "delete_op",
    "encode_value",
    "put_op",
]

Key = bytes | str

WIDTH: Final = 19
"""Digits of the largest token value, ``2**63 - 1``: every encoded value has this many."""

DEFAULT_TIMEOUT: Final = 10.0

MAX_TXN_OPS: Final = 128
"""etcd's ``--max-txn-ops`` default: the most operations one branch of a transaction may have
(a nested transaction gets what its parent's largest branch leaves)."""


def encode_value(value: int) -> bytes:
    """A token value as 19 zero-padded decimal digits: byte order equals numeric order."""
    return b"%019d" % value


def decode_value(raw: bytes) -> int:
    """Read a value written by :func:`encode_value` (0: the mark of a fresh resource)."""
    if len(raw) != WIDTH or not raw.isascii() or not raw.isdigit() or int(raw) > MAX_TOKEN:
        raise ValueError(f"not an encoded token value: {raw[:40]!r}")
    return int(raw)


def _bytes(key: Key) -> bytes:
    return key.encode() if isinstance(key, str) else key


@dataclasses.dataclass(frozen=True, slots=True)
class FenceKeys:
    """The two keys that fence one resource."""

    hw: bytes
    lock: bytes

    @property
    def all(self) -> tuple[bytes, bytes]:
        return (self.hw, self.lock)

    @classmethod
    def of(cls, resource: str, prefix: str) -> FenceKeys:
        return cls(f"{prefix}hw/{resource}".encode(), f"{prefix}lock/{resource}".encode())


# --- pure request building ----------------------------------------------------------------------


# (Sub-messages are filled in place: passing them to a constructor would copy them.)


def put_op(key: Key, value: bytes | str, lease: int = 0) -> rpc.RequestOp:
    """A put, for :meth:`AsyncEtcdGuard.write`."""
    op = rpc.RequestOp()
    put = op.request_put
    put.key = _bytes(key)
    put.value = _bytes(value)
    put.lease = lease
    return op


def delete_op(key: Key) -> rpc.RequestOp:
    """A delete of one key, for :meth:`AsyncEtcdGuard.write`."""
    op = rpc.RequestOp()
    op.request_delete_range.key = _bytes(key)
    return op


def get_op(key: bytes) -> rpc.RequestOp:
    op = rpc.RequestOp()
    op.request_range.key = key
    return op


def accept_compare(keys: FenceKeys, mark: int) -> rpc.Compare:
    """True when the stored mark is exactly ``enc(mark)`` (false if missing or damaged)."""
    return rpc.Compare(
        key=keys.hw,
        target=rpc.Compare.VALUE,
        result=rpc.Compare.EQUAL,
        value=encode_value(mark),
    )


def write_txn(
    keys: FenceKeys, token: FencingToken, mark: int, ops: Sequence[rpc.RequestOp]
) -> rpc.TxnRequest:
    """The one transaction of a fenced write, valid while the mark is ``mark`` (<= token)."""
    request = rpc.TxnRequest()
    bound = request.compare.add()
    bound.key = keys.lock
    bound.target = rpc.Compare.VALUE
    bound.result = rpc.Compare.EQUAL
    bound.value = token.lock.encode()
    request.compare.append(accept_compare(keys, mark))
    request.success.append(put_op(keys.hw, encode_value(token.value)))
    request.success.extend(ops)
    request.failure.extend([get_op(keys.lock), get_op(keys.hw)])
    return request


def _create_if_absent(key: bytes, value: bytes) -> rpc.RequestOp:
    op = rpc.RequestOp()
    txn = op.request_txn
    absent = txn.compare.add()
    absent.key = key
    absent.target = rpc.Compare.CREATE
    absent.result = rpc.Compare.EQUAL
    absent.create_revision = 0
    txn.success.append(put_op(key, value))
    return op


def bind_txn(keys: FenceKeys, lock: str) -> rpc.TxnRequest:
    """Create the lock key (``lock``) and the mark (0) where absent; read the lock key back."""
    request = rpc.TxnRequest()
    request.success.extend(
        [
            _create_if_absent(keys.lock, lock.encode()),
            _create_if_absent(keys.hw, encode_value(0)),
            get_op(keys.lock),
        ]
    )
    return request


def state_txn(keys: FenceKeys) -> rpc.TxnRequest:
    """Read the lock key and the mark at one revision."""
    request = rpc.TxnRequest()
    request.success.extend([get_op(keys.lock), get_op(keys.hw)])
    return request


def check_txn(request: rpc.TxnRequest, max_ops: int, what: str) -> None:
    """Refuse, before it is sent, a transaction etcd would refuse as a whole: more operations in
    a branch than ``max_ops`` (etcd's ``--max-txn-ops``) allows, or a key written twice (or
    inside a range it deletes) in one branch. :class:`~fenced.ConfigurationError`, one line:
    a fenced write is one atomic step, it cannot be split to fit.

    The rules are etcd's own (``checkTxnRequest``, ``checkIntervals`` in its v3rpc): a
    nested transaction's budget is ``max_ops`` less its parent's largest branch, and the
    then/else branches of a nested transaction may write the same key (only one runs)."""
    _check_size(request, max_ops, max_ops, what)
    for branch in (request.success, request.failure):
        _check_intervals(branch, what)


def _check_size(request: rpc.TxnRequest, budget: int, max_ops: int, what: str) -> None:
    size = max(len(request.compare), len(request.success), len(request.failure))
    if size > budget:
        where = "" if budget == max_ops else f", {budget} left inside the enclosing transaction"
        raise ConfigurationError(
            f"{what}: {size} operations in one transaction, etcd takes at most {max_ops} "
            f"(--max-txn-ops{where}); one atomic step cannot be split"
        )
    for op in (*request.success, *request.failure):
        if op.WhichOneof("request") == "request_txn":
            _check_size(op.request_txn, budget - size, max_ops, what)


def _deleted(key: bytes, deletes: Sequence[tuple[bytes, bytes]]) -> bool:
    for start, end in deletes:
        if key == start or (end and start <= key and (end == b"\0" or key < end)):
            return True
    return False


def _check_intervals(
    ops: Sequence[rpc.RequestOp], what: str
) -> tuple[set[bytes], list[tuple[bytes, bytes]]]:
    """The keys ``ops`` put and the ranges they delete; raise on a key written twice."""
    deletes = [
        (op.request_delete_range.key, op.request_delete_range.range_end)
        for op in ops
        if op.WhichOneof("request") == "request_delete_range"
    ]
    puts: set[bytes] = set()

    def add(key: bytes, allowed: set[bytes] = set()) -> None:  # noqa: B006  (never changed)
        if (key in puts and key not in allowed) or _deleted(key, deletes):
            raise ConfigurationError(
                f"{what}: key {key[:60]!r} written twice (or inside a range it deletes) in one "
                "transaction, which etcd refuses; give each key once"
            )
        puts.add(key)

    for op in ops:
        if op.WhichOneof("request") == "request_txn":
            then_puts, then_deletes = _check_intervals(op.request_txn.success, what)
            else_puts, else_deletes = _check_intervals(op.request_txn.failure, what)
            for key in then_puts:
                add(key)
            for key in else_puts:
                add(key, then_puts)
            deletes += then_deletes + else_deletes
    for op in ops:
        if op.WhichOneof("request") == "request_put":
            add(op.request_put.key)
    return puts, deletes


# --- pure reply interpretation -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """One transaction a guard plan asks for; ``write``: it may change keys (sent once)."""

    txn: rpc.TxnRequest
    write: bool


UNBOUND: Final = object()
"""The write found both fence keys missing: create them (:func:`bind_txn`), then try again."""


@dataclasses.dataclass(frozen=True, slots=True)
class Accepted:
    """An accepted write: the revision it happened at and the replies of the caller's ops."""

    revision: int
    replies: Sequence[rpc.ResponseOp]


GUARD_NAMESPACE: Final = "fenced/"
"""Every guard's ``prefix`` starts with it, so every fence key lies in it."""

RESERVED: Final = (GUARD_NAMESPACE.encode(), b"/fenced/")
"""Key spaces no guarded write may touch, whatever the guard's prefix: the one every guard's
fence keys live in (``prefix`` must start with ``fenced/``), and the etcd lock source's default
(``/fenced/locks/``)."""


def _wrong_lock(stored: bytes, token: FencingToken, resource: str) -> WrongLockError:
    return WrongLockError(
        f"resource {resource!r} is fenced by lock {stored.decode(errors='replace')!r}; "
        f"token {token} belongs to lock {token.lock!r}"
    )


def read_mark(lock_kvs: Sequence[Any], hw_kvs: Sequence[Any], resource: str) -> Any:
    """The stored (lock, mark value), or :data:`UNBOUND`; raise if the fence keys are damaged."""
    if not lock_kvs and not hw_kvs:
        return UNBOUND
    if not hw_kvs:
        raise CorruptMarkError(resource, "the lock key is bound but the mark key is missing")
    if not lock_kvs:
        raise CorruptMarkError(resource, "the mark key exists without its lock key")
    raw = hw_kvs[0].value
    try:
        value = decode_value(raw)
    except ValueError:
        raise CorruptMarkError(resource, f"mark {raw[:40]!r}") from None
    return lock_kvs[0].value, value


def interpret_write(resp: rpc.TxnResponse, token: FencingToken, resource: str) -> Any:
    """:class:`Accepted`, :data:`UNBOUND`, or the current mark value (<= token) to retry with.

    Raises the refusal the reply reports: stale, another lock's resource, or a corrupt mark.
    """
    if resp.succeeded:
        return Accepted(resp.header.revision, resp.responses[1:])
    return interpret_found(resp, token, resource)


def interpret_found(resp: rpc.TxnResponse, token: FencingToken, resource: str) -> Any:
    """From the reads of (lock key, hw key): :data:`UNBOUND` or the mark value; raise if wrong."""
    found = read_mark(
        resp.responses[0].response_range.kvs, resp.responses[1].response_range.kvs, resource
    )
    if found is UNBOUND:
        return UNBOUND
    lock, value = found
    if lock != token.lock.encode():
        raise _wrong_lock(lock, token, resource)
    return value


def interpret_bind(resp: rpc.TxnResponse, token: FencingToken, resource: str) -> None:
    """Raise if the resource turned out to be bound to another lock."""
    stored = resp.responses[2].response_range.kvs[0].value
    if stored != token.lock.encode():
        raise _wrong_lock(stored, token, resource)


def interpret_state(resp: rpc.TxnResponse, resource: str) -> FencingToken | None:
    """The high-water token from :func:`state_txn`'s reply (None: nothing accepted yet)."""
    found = read_mark(
        resp.responses[0].response_range.kvs, resp.responses[1].response_range.kvs, resource
    )
    if found is UNBOUND or found[1] == 0:
        return None
    lock, value = found
    try:
        return FencingToken(lock.decode(), value)
    except (UnicodeDecodeError, FencedError):
        raise CorruptMarkError(resource, f"lock key {lock[:40]!r}") from None


def map_error(exc: Exception, resource: str) -> FencedError:
    """Translate a gRPC/aetcd error; the caller raises the result ``from exc``."""
    if _grpc_errors.kind(exc) == "unreachable":  # (one reading with the etcd source's)
        return BackendUnavailable(
            f"etcd unavailable for a guarded write on {resource!r} (outcome unknown if the "
            f"request was sent): {exc}"
        )
    detail = exc.details() if isinstance(exc, rpc.AioRpcError) else str(exc)
    return FencedError(f"etcd refused a guarded write on {resource!r}: {detail}")


# --- a replicated group's member: pure request building ------------------------------------------

STAMP_WIDTH: Final = 2 * WIDTH
"""A group item's stamp: 38 digits (the writer's token and sequence number, 19 each)."""


@dataclasses.dataclass(frozen=True, slots=True)
class GroupKeys:
    """The keys of one group's member: its epoch mark, holder, and the prefix of its data."""

    epoch: bytes
    holder: bytes
    data: bytes

    @classmethod
    def of(cls, base: bytes) -> GroupKeys:
        return cls(base + b"epoch", base + b"holder", base + b"data/")


def _segment(name: str) -> str:
    """``name`` as one path segment of a group's keys: ``%`` and ``/`` escaped (injective)."""
    return name.replace("%", "%25").replace("/", "%2F")


def _count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKEN:
        raise ConfigurationError(f"{name} is an int from 0 to 2**63-1, not {value!r}")


def _newest(items: Sequence[GroupItem]) -> dict[str, GroupItem]:
    """One item per key, the newest (the first of equal stamps): what applying them one by one
    keeps, and etcd refuses a key put twice in one transaction. Checked before anything is sent."""
    newest: dict[str, GroupItem] = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 3):
            raise ConfigurationError(f"a group item is (key, stamp, value): {item!r}")
        key, stamp, value = item
        if not isinstance(key, str) or not key:
            raise ConfigurationError(f"a group item's key is a non-empty str: {key!r}")
        if not (isinstance(stamp, str) and len(stamp) == STAMP_WIDTH and stamp.isdigit()):
            raise ConfigurationError(f"a group item's stamp is {STAMP_WIDTH} digits: {stamp!r}")
        if value is not None and not isinstance(value, bytes):
            raise ConfigurationError(f"a group item's value is bytes or None: {value!r}")
        held = newest.get(key)
        if held is None or held[1] < stamp:
            newest[key] = item
    return newest


def _item_value(stamp: str, value: bytes | None) -> bytes:
    return stamp.encode() + (b"0" if value is None else b"1" + value)


def _group_item(key: str, raw: bytes, resource: str) -> GroupItem:
    stamp, flag = raw[:STAMP_WIDTH], raw[STAMP_WIDTH : STAMP_WIDTH + 1]
    if len(stamp) != STAMP_WIDTH or not stamp.isdigit() or flag not in (b"0", b"1"):
        raise CorruptMarkError(resource, f"group item {key[:40]!r}: {raw[:60]!r}")
    return key, stamp.decode(), raw[STAMP_WIDTH + 1 :] if flag == b"1" else None


def group_txn(
    gk: GroupKeys,
    token: FencingToken | None,
    epoch: int,
    items: Mapping[str, GroupItem],
    state: GroupState,
    revisions: Mapping[str, int],
    reset: bool,
) -> rpc.TxnRequest:
    """The nested transaction of a group's change, valid while what was read (``state``,
    ``revisions``) is unchanged: the epoch key compared (its value; with ``reset``, its
    revision: every change puts it, so no change at all came in), each changed key's revision
    compared; then the epoch raised, the holder kept, the items written."""
    inner = rpc.TxnRequest()
    if state.epoch and reset:
        inner.compare.append(
            rpc.Compare(
                key=gk.epoch,
                target=rpc.Compare.MOD,
                result=rpc.Compare.EQUAL,
                mod_revision=revisions[""],
            )
        )
    elif state.epoch:
        inner.compare.append(
            rpc.Compare(
                key=gk.epoch,
                target=rpc.Compare.VALUE,
                result=rpc.Compare.EQUAL,
                value=encode_value(state.epoch),
            )
        )
    else:
        inner.compare.append(
            rpc.Compare(
                key=gk.epoch,
                target=rpc.Compare.CREATE,
                result=rpc.Compare.EQUAL,
                create_revision=0,
            )
        )
    inner.success.append(put_op(gk.epoch, encode_value(max(epoch, state.epoch))))
    if token is not None:  # (the outer transaction refuses a token below the mark)
        inner.success.append(put_op(gk.holder, str(token).encode()))
    if reset:
        # Keys held and not copied are deleted one by one (etcd refuses a put inside a range
        # deleted by the same transaction); the copied ones are overwritten.
        for key, _, _ in state.items:
            if key not in items:
                inner.success.append(delete_op(gk.data + key.encode()))
        for key, stamp, value in items.values():
            inner.success.append(put_op(gk.data + key.encode(), _item_value(stamp, value)))
    else:
        held = {key: stamp for key, stamp, _ in state.items}
        for key, stamp, value in items.values():
            if key in held and held[key] >= stamp:
                continue
            inner.compare.append(
                rpc.Compare(
                    key=gk.data + key.encode(),
                    target=rpc.Compare.MOD,
                    result=rpc.Compare.EQUAL,
                    mod_revision=revisions.get(key, 0),
                )
            )
            inner.success.append(put_op(gk.data + key.encode(), _item_value(stamp, value)))
    inner.failure.append(get_op(gk.epoch))
    return inner


# --- the guards ---------------------------------------------------------------------------------


class AsyncEtcdGuard:
    """Fenced writes to etcd, through an ``aetcd.Client`` or the etcd source's transport.

    :meth:`open` makes the guard its own connection to one or several members (the transport
    the ``etcd://`` source uses: failover to the next member when one fails; a write is sent
    once, reads are retried). An ``aetcd.Client`` you pass stays yours and talks to one
    endpoint.

    ``lock``: the lock whose tokens are accepted; any other lock's token raises
    :class:`~fenced.WrongLockError` before anything is sent. With None, the resource is bound
    to the lock of the first token it accepts and refuses other locks' tokens itself.
    ``prefix``: where the fence keys live, in ``fenced/`` (e.g. ``fenced/billing/``); ``timeout``: seconds per request (a timed-out
    write raises :class:`~fenced.BackendUnavailable` and may or may not have happened).
    """

    _bind_attempts = 3
    _max_attempts = 64
    _owns_client = False

    @classmethod
    @lock_keyword()
    def open(
        cls,
        endpoints: str,
        resource: str,
        *,
        lock: str | None = None,
        prefix: str = "fenced/",
        timeout: float | None = DEFAULT_TIMEOUT,
        verify: TokenVerifier | None = None,
        max_txn_ops: int = MAX_TXN_OPS,
    ) -> AsyncEtcdGuard:
        """A guard with its own connection to ``"h1:p1,h2:p2"`` (close it with :meth:`aclose`)."""
        guard = cls(
            etcd_client(endpoints, timeout),
            resource,
            lock=lock,
            prefix=prefix,
            timeout=timeout,
            verify=verify,
            max_txn_ops=max_txn_ops,
        )
        guard._owns_client = True
        return guard

    async def aclose(self) -> None:
        """Close the connection :meth:`open` made (a client you passed is left open)."""
        if self._owns_client and isinstance(self._client, EtcdClient):
            await self._client.close()

    async def __aenter__(self) -> AsyncEtcdGuard:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    @lock_keyword()
    def __init__(
        self,
        client: aetcd.Client | EtcdClient,
        resource: str,
        *,
        lock: str | None = None,
        prefix: str = "fenced/",
        timeout: float | None = DEFAULT_TIMEOUT,
        verify: TokenVerifier | None = None,
        max_txn_ops: int = MAX_TXN_OPS,
    ) -> None:
        self.verifier = verify  # checks each token before the mark (see fenced._core.signing)
        if not isinstance(resource, str) or not resource:
            raise ConfigurationError(f"resource must be a non-empty str, not {resource!r}")
        if isinstance(max_txn_ops, bool) or not isinstance(max_txn_ops, int) or max_txn_ops < 4:
            raise ConfigurationError(
                f"max_txn_ops is etcd's --max-txn-ops (an int >= 4), not {max_txn_ops!r}"
            )
        self.max_txn_ops = max_txn_ops  # what the server accepts: larger writes are refused here
        self._check_prefix(prefix)
        self._client = client
        self.resource = resource
        self.lock = None if lock is None else validate_lock_name(lock)
        self.prefix = prefix.encode()
        self.keys = FenceKeys.of(resource, prefix)
        self.timeout = timeout
        self._mark: int | None = None  # the mark this guard saw last (a hint, never trusted)
        self._highest = 0  # the highest mark seen: once seen, the fence keys may not vanish
        self._reserved = self._reserved_spaces()
        self._template: tuple[FencingToken, int, rpc.TxnRequest] | None = None

    @staticmethod
    def _check_prefix(prefix: object) -> None:
        if not isinstance(prefix, str) or not prefix.startswith(GUARD_NAMESPACE):
            raise ConfigurationError(
                f"prefix must start with {GUARD_NAMESPACE!r} (fenced's reserved key space, which "
                f"no guard may write: a fence key anywhere else could be rewritten by a guard "
                f"with another prefix), not {prefix!r}"
            )

    def _reserved_spaces(self) -> tuple[bytes, ...]:
        """The key spaces this guard refuses to write (its own prefix lies in the first)."""
        return RESERVED

    def _token(self, token: TokenLike) -> FencingToken:
        return FencingToken.coerce(token, self.lock, self.verifier)

    def _key(self, key: object) -> bytes:
        if not isinstance(key, (str, bytes)) or not key:
            raise ConfigurationError(f"a guarded key must be a non-empty str or bytes: {key!r}")
        raw = _bytes(key)
        for prefix in self._reserved:
            if raw.startswith(prefix):
                raise ConfigurationError(
                    f"{key!r} is in fenced's reserved key space {prefix!r}: a guarded write "
                    "may not touch a fence key"
                )
        return raw

    def _check_op(self, op: Any) -> None:
        """Only puts and deletes, and none that touches the reserved key space."""
        kind = op.WhichOneof("request") if isinstance(op, rpc.RequestOp) else None
        if kind == "request_put":
            self._key(op.request_put.key)
            return
        if kind == "request_delete_range":
            start, end = op.request_delete_range.key, op.request_delete_range.range_end
            self._key(start)
            # [start, end) meets [prefix, prefix_end) unless it lies wholly before it (start is
            # outside the prefix, so it cannot lie after it). range_end b"\0" is "to the end".
            for prefix in self._reserved:
                if end and (end == b"\0" or end > prefix) and start < prefix:
                    raise ConfigurationError(
                        f"the delete range from {start!r} covers fenced's reserved key space "
                        f"{prefix!r}"
                    )
            return
        raise ConfigurationError(f"a guarded write takes put_op/delete_op requests, not {op!r}")

    def _accepts(self, token: int, mark: int) -> bool:
        """The fencing rule, applied to a mark read from etcd; a hook so tests can plant ``<``."""
        return mark <= token

    def _epoch_accepts(self, stored: int, epoch: int) -> bool:
        """A group's epoch rule, applied to the epoch mark read from etcd (the change's
        compare then holds the mark to it); a hook so tests can plant a bug."""
        return stored <= epoch

    def _request(
        self, token: FencingToken, mark: int, ops: Sequence[rpc.RequestOp]
    ) -> rpc.TxnRequest:
        """:func:`write_txn`, from a copy of a per-(token, mark) template (5× cheaper to make)."""
        template = self._template
        if template is None or template[0] != token or template[1] != mark:
            template = (token, mark, write_txn(self.keys, token, mark, ()))
            self._template = template
        request = rpc.TxnRequest()
        request.CopyFrom(template[2])
        request.success.extend(ops)
        return request

    async def _txn(self, request: rpc.TxnRequest, *, write: bool = True) -> rpc.TxnResponse:
        client = self._client
        check_grpc_usable()
        if isinstance(client, EtcdClient):
            # The etcd source's own transport: several members, failover. A write is sent
            # once (a re-sent write could be refused after it was applied); a read retries.
            def txn(member: Member, timeout: float) -> Any:
                return member.kv.Txn(request, timeout=timeout)

            what = f"guarded {'write' if write else 'read'} on {self.resource!r}"
            try:
                if write:
                    return await client.call_once(txn, what=what)
                return await client.call(txn, what=what)
            except BackendUnavailable:
                raise
            except BackendError as exc:
                raise FencedError(str(exc)) from exc
        try:
            await client.connect()
            return await client.kvstub.Txn(request, timeout=self.timeout, metadata=client.metadata)
        except (rpc.AioRpcError, aetcd.exceptions.ClientError) as exc:
            raise map_error(exc, self.resource) from exc

    def write_plan(
        self, token: FencingToken, ops: Sequence[rpc.RequestOp], *, forget: bool = False
    ) -> GuardPlan[Request, rpc.TxnResponse, Accepted]:
        """The fenced write as a plan (see ``_plan``): yields ``(txn, is_write)`` requests.

        Sends the write with the mark it expects (a guess it would accept: the last mark it
        saw, or the token); from a refusal's reads it learns the real mark and tries again
        with it, binds a fresh resource, or raises stale / another lock / corrupt.
        ``forget``: judge the mark as a new guard would (what this one saw is neither used nor
        raised): a group member that came back empty, repaired by the group's state transfer.
        """
        guess = self._mark if self._mark is not None else token.value
        # A guess the rule would refuse is not sent: read the real mark first.
        mark: int | None = guess if self._accepts(token.value, guess) else None
        binds = 0
        # Each retry saw the mark move (it only grows) or created the fence keys: bounded.
        for _ in range(self._max_attempts):
            # What this guard had seen accepted when the request was sent (its answer reflects
            # it): another coroutine's write landing meanwhile is no step back of the mark.
            seen = 0 if forget else self._highest
            if mark is None:
                resp = yield Request(state_txn(self.keys), write=False)
                outcome = interpret_found(resp, token, self.resource)
            else:
                resp = yield Request(self._request(token, mark, ops), write=True)
                outcome = interpret_write(resp, token, self.resource)
                if isinstance(outcome, Accepted):
                    self._mark = token.value
                    if not forget:
                        self._highest = max(self._highest, token.value)
                    return outcome
            if outcome is UNBOUND and seen:
                raise self._vanished()
            if outcome is UNBOUND:
                binds += 1
                if binds > self._bind_attempts:
                    break
                bind = yield Request(bind_txn(self.keys, token.lock), write=True)
                interpret_bind(bind, token, self.resource)
                mark = 0
                continue
            if outcome < seen:  # marks only grow: this one was reset
                raise self._vanished(outcome)
            self._mark = outcome
            if not forget:
                self._highest = max(self._highest, outcome)
            if not self._accepts(token.value, outcome):
                high = FencingToken(token.lock, outcome) if outcome else None
                raise StaleTokenError(token, high, self.resource)
            mark = outcome
        raise FenceConflictError(
            f"the fence of {self.resource!r} kept changing while writing with {token}; retry"
        )

    async def _send(self, request: Request) -> rpc.TxnResponse:
        return await self._txn(request.txn, write=request.write)

    @token_keyword()
    async def write(self, ops: Sequence[rpc.RequestOp], *, token: TokenLike) -> Accepted:
        """Apply ``ops`` (see :func:`put_op`, :func:`delete_op`) in one fenced transaction."""
        tok = self._token(token)
        for op in ops:
            self._check_op(op)
        if len(ops) >= self.max_txn_ops:
            raise ConfigurationError(
                f"{self._what('write')}: {len(ops)} operations, etcd takes at most "
                f"{self.max_txn_ops - 1} in one fenced write (--max-txn-ops {self.max_txn_ops}, "
                "one of them the mark's own put); one atomic step cannot be split"
            )
        if len(ops) > 1:  # (one op cannot repeat a key)
            check_txn(write_txn(self.keys, tok, 0, ops), self.max_txn_ops, self._what("write"))
        # (Transport errors are already fenced errors here: they pass through the plan.)
        return await adrive(self.write_plan(tok, ops), self._send, lambda exc: None)

    async def fence(self, token: TokenLike) -> None:
        """Raise the mark to ``token`` and write nothing else (``fence=`` on acquire): every
        lower token is refused from now on. StaleTokenError if a higher one was accepted."""
        await self.write([], token=token)

    @token_keyword()
    async def put(self, key: Key, value: bytes | str, *, token: TokenLike, lease: int = 0) -> int:
        """Put ``key = value`` if ``token`` is not stale; return the write's revision."""
        if not isinstance(value, (str, bytes)):
            raise ConfigurationError(f"an etcd value must be str or bytes, not {value!r}")
        return (await self.write([put_op(self._key(key), value, lease)], token=token)).revision

    @token_keyword()
    async def delete(self, key: Key, *, token: TokenLike) -> bool:
        """Delete ``key`` if ``token`` is not stale; True if it existed."""
        accepted = await self.write([delete_op(self._key(key))], token=token)
        return bool(accepted.replies[0].response_delete_range.deleted > 0)

    async def high_water(self) -> FencingToken | None:
        """The highest token accepted so far (None if none)."""
        seen = self._highest  # (as in write_plan: what the answer must reflect)
        found = interpret_state(await self._txn(state_txn(self.keys), write=False), self.resource)
        if found is None and seen:
            raise self._vanished()
        if found is not None:
            if found.value < seen:
                raise self._vanished(found.value)
            self._highest = max(self._highest, found.value)
        return found

    def _what(self, kind: str) -> str:
        return f"a guarded {kind} on {self.resource!r}"

    # -- a replicated group's member (fenced.replicated.EtcdMember) --------------------------
    # The group's keys are in the guard's reserved prefix (no guarded write can touch them):
    # <prefix>group/<resource>/<group>/epoch, .../holder and .../data/<key> (resource and group
    # with '%' and '/' escaped as %25 and %2F; value: the
    # 38-digit stamp, then 1 and the bytes, or 0 for deleted). One change is ONE transaction:
    # the guard's own fenced write (write_plan: the lock token against the mark, raised), whose
    # one operation is a nested transaction that compares the epoch key and each changed key's
    # revision with what was just read, and writes. A nested compare that fails (someone wrote
    # meanwhile) is read again and retried.

    _group_attempts = 20

    def group_keys(self, group: str) -> GroupKeys:
        if not isinstance(group, str) or not group:
            raise ConfigurationError(f"a group name is a non-empty str, not {group!r}")
        # Resource and group are one path segment each ('/' and '%' escaped): unescaped,
        # resource "a/b" group "c" and resource "a" group "b/c" shared every key, and one
        # group's data range held another's epoch mark. Names without them are unchanged.
        base = f"group/{_segment(self.resource)}/{_segment(group)}/"
        return GroupKeys.of(self.prefix + base.encode())

    async def read_group(self, *, group: str, keys: Sequence[str] | None = None) -> GroupState:
        """A group member's marks, holder and items (of ``keys``; None: all), at one revision."""
        if keys is not None and not all(isinstance(k, str) and k for k in keys):
            raise ConfigurationError(f"group keys are non-empty str: {keys!r}")
        state, _ = await self._group_read(self.group_keys(group), keys)
        return state

    async def _group_read(
        self, gk: GroupKeys, keys: Sequence[str] | None
    ) -> tuple[GroupState, dict[str, int]]:
        """The state, and the mod revision of each item read (of the epoch key under "")."""
        request = state_txn(self.keys)
        request.success.extend([get_op(gk.epoch), get_op(gk.holder)])
        # Many keys are read as the whole range (etcd caps a transaction's operations, and a
        # read must be one snapshot: it is not split), then filtered.
        whole = keys is None or len(request.success) + len(keys) > self.max_txn_ops
        if whole:
            op = rpc.RequestOp()
            op.request_range.key = gk.data
            op.request_range.range_end = range_end(gk.data)
            request.success.append(op)
        else:
            request.success.extend(get_op(gk.data + k.encode()) for k in keys or ())
        resp = await self._txn(request, write=False)
        # (What is stored, as it is: a member restarted empty reads as marks 0, for the group
        # to repair; its change's fenced write is what fails closed, as every write does.)
        mark = interpret_state(resp, self.resource)
        epoch_kvs = resp.responses[2].response_range.kvs
        try:
            epoch = decode_value(epoch_kvs[0].value) if epoch_kvs else 0
        except ValueError:
            raise CorruptMarkError(self.resource, "the group's epoch mark") from None
        holder_kvs = resp.responses[3].response_range.kvs
        holder = holder_kvs[0].value.decode(errors="replace") if holder_kvs else None
        wanted = None if keys is None else set(keys)
        items: list[GroupItem] = []
        revisions = {"": epoch_kvs[0].mod_revision if epoch_kvs else 0}
        for reply in resp.responses[4:]:
            for kv in reply.response_range.kvs:
                key = kv.key[len(gk.data) :].decode()
                if wanted is not None and key not in wanted:
                    continue
                items.append(_group_item(key, kv.value, self.resource))
                revisions[key] = kv.mod_revision
        state = GroupState(mark.value if mark else 0, epoch, holder, items)
        return checked_group_state(state, self.resource), revisions

    async def apply_group(
        self,
        *,
        token: TokenLike | None,
        group: str,
        epoch: int,
        items: Sequence[GroupItem] = (),
        reset: bool = False,
        since: int = 0,
    ) -> None:
        """One change of a replicated group's member (:class:`fenced.replicated.EtcdMember`),
        ONE transaction: ``token`` checked against the lock mark as every guarded write is,
        ``epoch`` against the group's epoch mark (:class:`~fenced.StaleEpochError`) and that
        mark against ``since`` (:class:`~fenced.MemberBehindError`); then both marks raised,
        the token kept as the holder, every item forgotten first if ``reset``, and each
        ``(key, stamp, value)`` written if its stamp is newer than the stored one (a key given
        twice: its newest item). A refusal writes nothing. ``token`` None: the epoch mark only
        (and ``reset``), no items.
        A change larger than one transaction may be (``max_txn_ops``) is refused before
        anything is sent: :class:`~fenced.ConfigurationError`."""
        tok = None if token is None else self._token(token)
        _count("epoch", epoch)
        _count("since", since)
        if tok is None and items:
            raise ConfigurationError("items are written only with a lock token")
        gk = self.group_keys(group)
        newest = _newest(items)
        what = self._what(f"change of group {group!r}")
        # The nested transaction's budget is what the fenced write's own branches leave (2);
        # its writes: the epoch, the holder, one per item (a copy also deletes what it drops,
        # counted once read).
        needed = 1 + (tok is not None) + len(newest)
        if needed > self.max_txn_ops - 2:
            raise ConfigurationError(
                f"{what}: {len(newest)} items need {needed} operations in one transaction, etcd "
                f"takes at most {self.max_txn_ops - 2} there (--max-txn-ops {self.max_txn_ops}); "
                "one atomic step cannot be split"
            )
        for _ in range(self._group_attempts):
            state, revisions = await self._group_read(gk, None if reset else list(newest))
            if not self._epoch_accepts(state.epoch, epoch):
                raise stale_epoch_error(self.resource, state.epoch, epoch)
            if state.epoch < since:  # (the compare below holds the epoch to what was read)
                raise member_behind_error(self.resource, state.epoch, since)
            inner = group_txn(gk, tok, epoch, newest, state, revisions, reset)
            if tok is None:
                check_txn(inner, self.max_txn_ops, what)
                resp = await self._txn(inner, write=True)
                done = resp.succeeded
            else:
                op = rpc.RequestOp()
                op.request_txn.CopyFrom(inner)
                check_txn(write_txn(self.keys, tok, 0, [op]), self.max_txn_ops, what)
                # A member whose epoch mark is gone lost its state (or is new): its fence keys
                # may be gone with it, which the group's state transfer repairs; a mark this
                # guard saw must not refuse that for good (as the Redis script's). The epoch
                # key's absence is compared in the same transaction.
                plan = self.write_plan(tok, [op], forget=state.epoch == 0)
                accepted = await adrive(plan, self._send, lambda exc: None)
                done = accepted.replies[0].response_txn.succeeded
            if done:
                return
        raise BackendUnavailable(
            f"member {self.resource!r}: its keys kept changing while being written"
        )

    def _vanished(self, now: int | None = None) -> CorruptMarkError:
        """The mark went back (deleted, or reset below what this guard saw): damage."""
        what = "both fence keys are gone" if now is None else f"the mark went back to {now}"
        return CorruptMarkError(
            self.resource, f"{what}, after this guard saw token {self._highest} accepted"
        )


def etcd_client(endpoints: str, timeout: float | None = DEFAULT_TIMEOUT) -> EtcdClient:
    """The etcd source's transport for ``"h1:p1,h2:p2"`` or ``"etcd://h1:p1,h2:p2"``."""
    url = endpoints if "://" in endpoints else f"etcd://{endpoints}"
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigurationError(
            f"etcd endpoints must be host:port[,host:port...]: {exc}"
        ) from None
    per_call = DEFAULT_TIMEOUT if timeout is None else timeout
    return EtcdClient(parse_endpoints(parts), timeout=per_call, retry_for=per_call)


class EtcdGuard:
    """The synchronous :class:`AsyncEtcdGuard`: the same code, run on a private loop thread.

    ``endpoint`` is ``host:port``, or several (``h1:p1,h2:p2``, also as ``etcd://...``): the
    guard talks to the cluster through the etcd source's own transport, and moves to the next
    member when one fails. It owns that connection: close it with :meth:`close` or a ``with``
    block.
    """

    _async_class: type[AsyncEtcdGuard] = AsyncEtcdGuard

    @lock_keyword()
    def __init__(
        self,
        endpoint: str,
        resource: str,
        *,
        lock: str | None = None,
        prefix: str = "fenced/",
        timeout: float | None = DEFAULT_TIMEOUT,
        verify: TokenVerifier | None = None,
        max_txn_ops: int = MAX_TXN_OPS,
    ) -> None:
        self._portal = Portal("fenced-etcd-guard")
        try:
            # AsyncEtcdGuard.open, made on the loop thread that will run it.
            self.aio = self._portal.run_sync(
                lambda: self._async_class.open(
                    endpoint,
                    resource,
                    lock=lock,
                    prefix=prefix,
                    timeout=timeout,
                    verify=verify,
                    max_txn_ops=max_txn_ops,
                )
            )
        except BaseException:
            self._portal.stop()
            raise

    @property
    def resource(self) -> str:
        return self.aio.resource

    @property
    def portal(self) -> Portal:
        """The guard's loop thread: ``guard.portal.call(coro)`` runs a coroutine of
        :attr:`aio` there (as :attr:`fenced.Locks.portal`)."""
        return self._portal

    @token_keyword()
    def write(self, ops: Sequence[rpc.RequestOp], *, token: TokenLike) -> Accepted:
        """See :meth:`AsyncEtcdGuard.write`."""
        return self._portal.call(self.aio.write(ops, token=token))

    def fence(self, token: TokenLike) -> None:
        """See :meth:`AsyncEtcdGuard.fence`."""
        self._portal.call(self.aio.fence(token))

    @token_keyword()
    def put(self, key: Key, value: bytes | str, *, token: TokenLike, lease: int = 0) -> int:
        """See :meth:`AsyncEtcdGuard.put`."""
        return self._portal.call(self.aio.put(key, value, token=token, lease=lease))

    @token_keyword()
    def delete(self, key: Key, *, token: TokenLike) -> bool:
        """See :meth:`AsyncEtcdGuard.delete`."""
        return self._portal.call(self.aio.delete(key, token=token))

    def high_water(self) -> FencingToken | None:
        """See :meth:`AsyncEtcdGuard.high_water`."""
        return self._portal.call(self.aio.high_water())

    def apply_group(
        self,
        *,
        token: TokenLike | None,
        group: str,
        epoch: int,
        items: Sequence[GroupItem] = (),
        reset: bool = False,
        since: int = 0,
    ) -> None:
        """See :meth:`AsyncEtcdGuard.apply_group`."""
        self._portal.call(
            self.aio.apply_group(
                token=token, group=group, epoch=epoch, items=items, reset=reset, since=since
            )
        )

    def read_group(self, *, group: str, keys: Sequence[str] | None = None) -> GroupState:
        """See :meth:`AsyncEtcdGuard.read_group`."""
        return self._portal.call(self.aio.read_group(group=group, keys=keys))

    def close(self) -> None:
        if not self._portal.closed:
            self._portal.stop(final=self.aio.aclose())

    def __enter__(self) -> EtcdGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdGuard(resource={self.resource!r})"
