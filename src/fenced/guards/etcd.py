"""etcd guard: fenced ``put``/``delete``, each ONE etcd transaction that checks, advances, writes.

::

    async with aetcd.Client("127.0.0.1", 2379) as client:
        guard = AsyncEtcdGuard(client, "invoices")
        await guard.put("invoices/42", payload, lease.token)   # StaleTokenError if fenced off

    with EtcdGuard("127.0.0.1:2379", "invoices") as guard:      # sync: same code, private loop
        guard.put("invoices/42", payload, lease.token)

The resource keeps two keys next to the data: ``<prefix>hw/<resource>``, the highest accepted
token value, and ``<prefix>lock/<resource>``, the lock whose tokens it accepts. Both are plain
etcd keys (no lease), replicated and fsynced by Raft with the data: exactly as durable as it.

One write is one ``Txn`` — etcd applies a transaction atomically at one revision, so no other
writer can come between the comparison and the writes::

    if value(lock key) == lock:                        # the resource is bound to this lock
        if value(hw key) > enc(token):                 # a higher token was accepted: refuse,
            get hw key                                 #   and report the mark
        else:                                          # (also taken when hw key is missing)
            put hw key = enc(token); the caller's put/delete
    else:
        get lock key                                   # unbound (first write) or another lock

Why the comparison is inverted ("refuse if greater" instead of "accept if less or equal"):
etcd's compares are ANDed, and a VALUE compare against a key that does not exist is always
false. Asking "is the mark greater?" puts the missing-mark case in the else branch, with the
accepted writes — the first write needs no second condition and no retry. The lock key is
written once, by a separate create-if-absent transaction, when the first write finds it
missing; the write is then retried (that retry happens at most once per resource's lifetime).

Byte order: etcd compares values as byte strings, not numbers. Token values are written as
19-digit zero-padded decimals (``2**63 - 1`` has 19 digits): for strings of one fixed length
made of the digits ``0-9`` (bytes 0x30-0x39, in order), byte order is numeric order, so
``value(hw) > enc(token)`` is exactly ``high_water > token``. (``"10" < "9"`` bytewise is the
bug this padding prevents.) The padded text stays readable in ``etcdctl get``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Final

import aetcd
from aetcd import rpc

from .._errors import (
    BackendUnavailable,
    ConfigurationError,
    FencedError,
    StaleTokenError,
    WrongLockError,
)
from .._sync import _Portal
from .._token import FencingToken, validate_lock_name

__all__ = [
    "Accepted",
    "AsyncEtcdGuard",
    "EtcdGuard",
    "decode_value",
    "delete_op",
    "encode_value",
    "put_op",
]

Key = bytes | str

WIDTH: Final = 19
"""Digits of the largest token value, ``2**63 - 1``: every encoded value has this many."""

DEFAULT_TIMEOUT: Final = 10.0


def encode_value(value: int) -> bytes:
    """A token value as 19 zero-padded decimal digits: byte order equals numeric order."""
    return b"%019d" % value


def decode_value(raw: bytes) -> int:
    """Read a value written by :func:`encode_value`; ValueError for anything else."""
    if len(raw) != WIDTH or not raw.isdigit() or int(raw) == 0:
        raise ValueError(f"not an encoded token value: {raw[:40]!r}")
    return int(raw)


def _bytes(key: Key) -> bytes:
    return key.encode() if isinstance(key, str) else key


@dataclasses.dataclass(frozen=True, slots=True)
class FenceKeys:
    """The two keys that fence one resource."""

    hw: bytes
    lock: bytes

    @classmethod
    def of(cls, resource: str, prefix: str) -> FenceKeys:
        return cls(f"{prefix}hw/{resource}".encode(), f"{prefix}lock/{resource}".encode())


# --- pure request building ----------------------------------------------------------------------


def put_op(key: Key, value: bytes | str, lease: int = 0) -> rpc.RequestOp:
    return rpc.RequestOp(
        request_put=rpc.PutRequest(key=_bytes(key), value=_bytes(value), lease=lease)
    )


def delete_op(key: Key) -> rpc.RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=_bytes(key)))


def get_op(key: bytes) -> rpc.RequestOp:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key))


def stale_compare(keys: FenceKeys, token: FencingToken) -> rpc.Compare:
    """True when the resource has accepted a higher token than ``token`` (false if no mark)."""
    return rpc.Compare(
        key=keys.hw,
        target=rpc.Compare.VALUE,
        result=rpc.Compare.GREATER,
        value=encode_value(token.value),
    )


def write_txn(
    keys: FenceKeys,
    token: FencingToken,
    ops: Sequence[rpc.RequestOp],
    stale: rpc.Compare | None = None,
) -> rpc.TxnRequest:
    """The one transaction of a fenced write (see the module docstring for its shape)."""
    guarded = rpc.TxnRequest(
        compare=[stale if stale is not None else stale_compare(keys, token)],
        success=[get_op(keys.hw)],
        failure=[put_op(keys.hw, encode_value(token.value)), *ops],
    )
    return rpc.TxnRequest(
        compare=[
            rpc.Compare(
                key=keys.lock,
                target=rpc.Compare.VALUE,
                result=rpc.Compare.EQUAL,
                value=token.lock.encode(),
            )
        ],
        success=[rpc.RequestOp(request_txn=guarded)],
        failure=[get_op(keys.lock)],
    )


def bind_txn(keys: FenceKeys, lock: str) -> rpc.TxnRequest:
    """Create the lock key if it does not exist (create_revision 0 means absent)."""
    return rpc.TxnRequest(
        compare=[
            rpc.Compare(
                key=keys.lock,
                target=rpc.Compare.CREATE,
                result=rpc.Compare.EQUAL,
                create_revision=0,
            )
        ],
        success=[put_op(keys.lock, lock.encode())],
        failure=[get_op(keys.lock)],
    )


def state_txn(keys: FenceKeys) -> rpc.TxnRequest:
    """Read the lock key and the mark at one revision."""
    return rpc.TxnRequest(success=[get_op(keys.lock), get_op(keys.hw)])


# --- pure reply interpretation -------------------------------------------------------------------


UNBOUND: Final = object()
"""The write found no lock key: bind the resource, then try again."""


@dataclasses.dataclass(frozen=True, slots=True)
class Accepted:
    """An accepted write: the revision it happened at and the replies of the caller's ops."""

    revision: int
    replies: Sequence[rpc.ResponseOp]


def _wrong_lock(stored: bytes, token: FencingToken, resource: str) -> WrongLockError:
    return WrongLockError(
        f"resource {resource!r} is fenced by lock {stored.decode(errors='replace')!r}; "
        f"token {token} belongs to lock {token.lock!r}"
    )


def interpret_write(resp: rpc.TxnResponse, token: FencingToken, resource: str) -> Any:
    """:class:`Accepted`, or :data:`UNBOUND`, or raise the refusal the reply reports."""
    if not resp.succeeded:
        kvs = resp.responses[0].response_range.kvs
        if not kvs:
            return UNBOUND
        raise _wrong_lock(kvs[0].value, token, resource)
    guarded = resp.responses[0].response_txn
    if guarded.succeeded:
        raw = guarded.responses[0].response_range.kvs[0].value
        try:
            high_water = FencingToken(token.lock, decode_value(raw))
        except (ValueError, FencedError):
            raise StaleTokenError(
                token,
                None,
                resource,
                f"write with {token} refused: the high-water mark of {resource!r} is not a "
                f"token value ({raw[:40]!r}); repair the fence key by hand",
            ) from None
        raise StaleTokenError(token, high_water, resource)
    return Accepted(resp.header.revision, list(guarded.responses[1:]))


def interpret_bind(resp: rpc.TxnResponse, token: FencingToken, resource: str) -> None:
    """Raise if the resource turned out to be bound to another lock meanwhile."""
    if resp.succeeded:
        return
    kvs = resp.responses[0].response_range.kvs
    if kvs and kvs[0].value != token.lock.encode():
        raise _wrong_lock(kvs[0].value, token, resource)


def interpret_state(resp: rpc.TxnResponse, resource: str) -> FencingToken | None:
    lock_kvs = resp.responses[0].response_range.kvs
    hw_kvs = resp.responses[1].response_range.kvs
    if not hw_kvs:
        return None
    try:
        lock = lock_kvs[0].value.decode() if lock_kvs else ""
        return FencingToken(lock, decode_value(hw_kvs[0].value))
    except (ValueError, IndexError, FencedError) as exc:
        raise FencedError(f"the high-water mark of {resource!r} is corrupt") from exc


_UNAVAILABLE: Final = frozenset(
    {rpc.StatusCode.UNAVAILABLE, rpc.StatusCode.DEADLINE_EXCEEDED, rpc.StatusCode.CANCELLED}
)


def map_error(exc: Exception, resource: str) -> FencedError:
    """Translate a gRPC/aetcd error; the caller raises the result ``from exc``."""
    code = exc.code() if isinstance(exc, rpc.AioRpcError) else None
    if code in _UNAVAILABLE or isinstance(
        exc, (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.ConnectionTimeoutError)
    ):
        return BackendUnavailable(
            f"etcd unavailable for a guarded write on {resource!r} (outcome unknown if the "
            f"request was sent): {exc}"
        )
    detail = exc.details() if isinstance(exc, rpc.AioRpcError) else str(exc)
    return FencedError(f"etcd refused a guarded write on {resource!r}: {detail}")


# --- the guards ---------------------------------------------------------------------------------


class AsyncEtcdGuard:
    """Fenced writes to etcd through an ``aetcd.Client``.

    ``lock``: the lock whose tokens are accepted; any other lock's token raises
    :class:`~fenced.WrongLockError` before anything is sent. With None, the resource is bound
    to the lock of the first token it accepts and refuses other locks' tokens itself.
    ``prefix``: where the fence keys live; ``timeout``: seconds per request (a timed-out
    write raises :class:`~fenced.BackendUnavailable` and may or may not have happened).
    """

    _bind_attempts = 3

    def __init__(
        self,
        client: aetcd.Client,
        resource: str,
        lock: str | None = None,
        *,
        prefix: str = "fenced/",
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        if not isinstance(resource, str) or not resource:
            raise ConfigurationError(f"resource must be a non-empty str, not {resource!r}")
        self._client = client
        self.resource = resource
        self.lock = None if lock is None else validate_lock_name(lock)
        self.keys = FenceKeys.of(resource, prefix)
        self.timeout = timeout

    def _token(self, token: FencingToken | str | bytes) -> FencingToken:
        return FencingToken.coerce(token, self.lock)

    def _key(self, key: object) -> bytes:
        if not isinstance(key, (str, bytes)) or not key:
            raise ConfigurationError(f"a guarded key must be a non-empty str or bytes: {key!r}")
        raw = _bytes(key)
        if raw in (self.keys.hw, self.keys.lock):
            raise ConfigurationError(f"{key!r} is a fence key of {self.resource!r}")
        return raw

    def _stale_compare(self, token: FencingToken) -> rpc.Compare:
        """The refusal condition; a hook so tests can plant an off-by-one."""
        return stale_compare(self.keys, token)

    async def _txn(self, request: rpc.TxnRequest) -> rpc.TxnResponse:
        client = self._client
        try:
            await client.connect()
            return await client.kvstub.Txn(request, timeout=self.timeout, metadata=client.metadata)
        except (rpc.AioRpcError, aetcd.exceptions.ClientError) as exc:
            raise map_error(exc, self.resource) from exc

    async def write(
        self, ops: Sequence[rpc.RequestOp], token: FencingToken | str | bytes
    ) -> Accepted:
        """Apply ``ops`` (see :func:`put_op`, :func:`delete_op`) in one fenced transaction."""
        tok = self._token(token)
        request = write_txn(self.keys, tok, ops, self._stale_compare(tok))
        for _ in range(self._bind_attempts):
            outcome = interpret_write(await self._txn(request), tok, self.resource)
            if outcome is not UNBOUND:
                assert isinstance(outcome, Accepted)
                return outcome
            interpret_bind(await self._txn(bind_txn(self.keys, tok.lock)), tok, self.resource)
        raise FencedError(f"the lock key of {self.resource!r} keeps disappearing")

    async def put(
        self, key: Key, value: bytes | str, token: FencingToken | str | bytes, *, lease: int = 0
    ) -> int:
        """Put ``key = value`` if ``token`` is not stale; return the write's revision."""
        if not isinstance(value, (str, bytes)):
            raise ConfigurationError(f"an etcd value must be str or bytes, not {value!r}")
        return (await self.write([put_op(self._key(key), value, lease)], token)).revision

    async def delete(self, key: Key, token: FencingToken | str | bytes) -> bool:
        """Delete ``key`` if ``token`` is not stale; True if it existed."""
        accepted = await self.write([delete_op(self._key(key))], token)
        return bool(accepted.replies[0].response_delete_range.deleted > 0)

    async def high_water(self) -> FencingToken | None:
        """The highest token accepted so far (None if none)."""
        return interpret_state(await self._txn(state_txn(self.keys)), self.resource)


def _endpoint(endpoint: str) -> tuple[str, int]:
    text = endpoint.split("://", 1)[-1].split(",", 1)[0].rstrip("/")
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigurationError(f"etcd endpoint must be host:port, not {endpoint!r}")
    return host, int(port)


class EtcdGuard:
    """The synchronous :class:`AsyncEtcdGuard`: the same code, run on a private loop thread.

    ``endpoint`` is ``host:port`` (or ``etcd://host:port``); the guard owns its connection:
    close it with :meth:`close` or a ``with`` block.
    """

    def __init__(
        self,
        endpoint: str,
        resource: str,
        lock: str | None = None,
        *,
        prefix: str = "fenced/",
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> None:
        host, port = _endpoint(endpoint)
        self._portal = _Portal("fenced-etcd-guard")
        try:
            self._client: aetcd.Client = self._portal.run_sync(lambda: aetcd.Client(host, port))
            self.aio = AsyncEtcdGuard(self._client, resource, lock, prefix=prefix, timeout=timeout)
        except BaseException:
            self._portal.stop()
            raise

    @property
    def resource(self) -> str:
        return self.aio.resource

    def write(self, ops: Sequence[rpc.RequestOp], token: FencingToken | str | bytes) -> Accepted:
        """See :meth:`AsyncEtcdGuard.write`."""
        return self._portal.call(self.aio.write(ops, token))

    def put(
        self, key: Key, value: bytes | str, token: FencingToken | str | bytes, *, lease: int = 0
    ) -> int:
        """See :meth:`AsyncEtcdGuard.put`."""
        return self._portal.call(self.aio.put(key, value, token, lease=lease))

    def delete(self, key: Key, token: FencingToken | str | bytes) -> bool:
        """See :meth:`AsyncEtcdGuard.delete`."""
        return self._portal.call(self.aio.delete(key, token))

    def high_water(self) -> FencingToken | None:
        """See :meth:`AsyncEtcdGuard.high_water`."""
        return self._portal.call(self.aio.high_water())

    def close(self) -> None:
        if self._portal.loop.is_closed():
            return
        try:
            self._portal.call(self._client.close())
        finally:
            self._portal.stop()

    def __enter__(self) -> EtcdGuard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EtcdGuard(resource={self.resource!r})"
