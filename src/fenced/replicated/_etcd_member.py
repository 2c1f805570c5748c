"""A replicated group's member on etcd (see :mod:`fenced.replicated._members`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any, Final

from .._core.errors import BackendUnavailable, ConfigurationError, CorruptMarkError
from .._core.token import FencingToken
from ._member_types import STAMP_DIGITS, Item, Snapshot, _refused_behind, _refused_epoch

__all__ = ["EtcdMember"]


# -- etcd -----------------------------------------------------------------------------------------


class EtcdMember:
    """A member on etcd, through an ``AsyncEtcdGuard`` (or the sync ``EtcdGuard``, whose own
    loop thread runs it). The group's keys are in the guard's reserved prefix:
    ``<prefix>group/<resource>/<group>/epoch`` and ``.../data/<key>`` (value: stamp, then
    ``1`` and the bytes, or ``0`` for deleted). One outer transaction checks and raises the lock
    mark (the guard's own); inside it, one nested transaction compares the epoch key and each
    changed key's revision with what was just read, and writes. A nested compare that fails
    (someone wrote meanwhile) is read again and retried."""

    _ATTEMPTS: Final = 20

    def __init__(self, guard: Any, group: str) -> None:
        from ..guards import etcd as etcd_guard

        self._sync_guard = guard if isinstance(guard, etcd_guard.EtcdGuard) else None
        self.aio: Any = guard.aio if self._sync_guard is not None else guard
        self.resource: str = self.aio.resource
        base = self.aio.prefix + f"group/{self.resource}/{group}/".encode()
        self._epoch_key = base + b"epoch"
        self._holder_key = base + b"holder"
        self._data = base + b"data/"

    async def _call(self, make: Callable[[], Any]) -> Any:
        if self._sync_guard is None:
            return await make()
        portal = self._sync_guard._portal
        return await asyncio.to_thread(lambda: portal.call(make()))

    async def _snapshot(self, keys: Sequence[str] | None) -> tuple[Snapshot, dict[str, int]]:
        from aetcd import rpc

        from ..backends.etcd import range_end
        from ..guards import etcd as etcd_guard

        request = etcd_guard.state_txn(self.aio.keys)
        request.success.append(etcd_guard.get_op(self._epoch_key))
        request.success.append(etcd_guard.get_op(self._holder_key))
        if keys is None:
            op = rpc.RequestOp()
            op.request_range.key = self._data
            op.request_range.range_end = range_end(self._data)
            request.success.append(op)
        else:
            request.success.extend(etcd_guard.get_op(self._data + k.encode()) for k in keys)
        resp = await self._call(lambda: self.aio._txn(request, write=False))
        mark = etcd_guard.interpret_state(resp, self.resource)
        epoch_kvs = resp.responses[2].response_range.kvs
        try:
            epoch = etcd_guard.decode_value(epoch_kvs[0].value) if epoch_kvs else 0
        except ValueError:
            raise CorruptMarkError(self.resource, "the group's epoch mark") from None
        holder_kvs = resp.responses[3].response_range.kvs
        holder = holder_kvs[0].value.decode(errors="replace") if holder_kvs else None
        items: dict[str, Item] = {}
        # (the epoch key's own revision under b"": every change puts it, see apply)
        revisions: dict[str, int] = {"": epoch_kvs[0].mod_revision if epoch_kvs else 0}
        for reply in resp.responses[4:]:
            for kv in reply.response_range.kvs:
                key = kv.key[len(self._data) :].decode()
                raw = kv.value
                st, flag = (
                    raw[: 2 * STAMP_DIGITS].decode(),
                    raw[2 * STAMP_DIGITS : 2 * STAMP_DIGITS + 1],
                )
                value = raw[2 * STAMP_DIGITS + 1 :] if flag == b"1" else None
                items[key] = Item(key, st, value)
                revisions[key] = kv.mod_revision
        return Snapshot(mark.value if mark else 0, epoch, items, holder), revisions

    async def apply(
        self,
        token: FencingToken | None,
        epoch: int,
        items: Sequence[Item],
        *,
        reset: bool = False,
        since: int = 0,
    ) -> None:
        from aetcd import rpc

        from ..guards import etcd as etcd_guard
        from ..guards._plan import adrive

        if token is None and items:
            raise ConfigurationError("items are written only with a lock token")
        for _ in range(self._ATTEMPTS):
            snap, revisions = await self._snapshot(None if reset else [i.key for i in items])
            if snap.epoch > epoch:
                raise _refused_epoch(self.resource, snap.epoch, epoch)
            if snap.epoch < since:  # (the compare below holds the epoch to what was read)
                raise _refused_behind(self.resource, snap.epoch, since)
            inner = rpc.TxnRequest()
            if snap.epoch and reset:
                # Every change puts the epoch key, so its revision unchanged means no change
                # at all came in meanwhile (a key added too: the copy replaces everything).
                inner.compare.append(
                    rpc.Compare(
                        key=self._epoch_key,
                        target=rpc.Compare.MOD,
                        result=rpc.Compare.EQUAL,
                        mod_revision=revisions[""],
                    )
                )
            elif snap.epoch:
                inner.compare.append(
                    rpc.Compare(
                        key=self._epoch_key,
                        target=rpc.Compare.VALUE,
                        result=rpc.Compare.EQUAL,
                        value=etcd_guard.encode_value(snap.epoch),
                    )
                )
            else:
                inner.compare.append(
                    rpc.Compare(
                        key=self._epoch_key,
                        target=rpc.Compare.CREATE,
                        result=rpc.Compare.EQUAL,
                        create_revision=0,
                    )
                )
            inner.success.append(
                etcd_guard.put_op(self._epoch_key, etcd_guard.encode_value(max(epoch, snap.epoch)))
            )
            if token is not None:  # (the outer transaction refuses a token below the mark)
                inner.success.append(etcd_guard.put_op(self._holder_key, str(token).encode()))
            if reset:
                # Keys held and not copied are deleted one by one (etcd refuses a put inside
                # a range deleted by the same transaction); the copied ones are overwritten.
                copied = {i.key for i in items}
                for key in snap.items:
                    if key not in copied:
                        drop = rpc.RequestOp()
                        drop.request_delete_range.key = self._data + key.encode()
                        inner.success.append(drop)
                for item in items:
                    body = b"0" if item.value is None else b"1" + item.value
                    inner.success.append(
                        etcd_guard.put_op(
                            self._data + item.key.encode(), item.stamp.encode() + body
                        )
                    )
            for item in [] if reset else items:
                held = snap.items.get(item.key)
                if held is not None and held.stamp >= item.stamp:
                    continue
                key = self._data + item.key.encode()
                inner.compare.append(
                    rpc.Compare(
                        key=key,
                        target=rpc.Compare.MOD,
                        result=rpc.Compare.EQUAL,
                        mod_revision=revisions.get(item.key, 0),
                    )
                )
                body = b"0" if item.value is None else b"1" + item.value
                inner.success.append(etcd_guard.put_op(key, item.stamp.encode() + body))
            inner.failure.append(etcd_guard.get_op(self._epoch_key))
            op = rpc.RequestOp()
            op.request_txn.CopyFrom(inner)
            if token is None:
                resp = await self._call(functools.partial(self.aio._txn, inner, write=True))
                done = resp.succeeded
            else:
                tok = self.aio._token(token)
                accepted = await self._call(
                    functools.partial(
                        adrive, self.aio.write_plan(tok, [op]), self.aio._send, _no_map
                    )
                )
                done = accepted.replies[0].response_txn.succeeded
            if done:
                return
        raise BackendUnavailable(
            f"member {self.resource!r}: its keys kept changing while being written"
        )

    async def read(self, keys: Sequence[str] | None = None) -> Snapshot:
        snap, _ = await self._snapshot(keys)
        return snap

    async def aclose(self) -> None:
        pass  # the guard is the caller's to close

    def __repr__(self) -> str:
        return f"EtcdMember({self.resource!r})"


def _no_map(exc: BaseException) -> None:
    return None  # (the guard's transport errors are fenced errors already)
