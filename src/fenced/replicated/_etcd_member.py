"""A replicated group's member on etcd: an adapter over the guard's group contract
(:meth:`AsyncEtcdGuard.apply_group <fenced.guards.etcd.AsyncEtcdGuard.apply_group>`,
:meth:`~fenced.guards.etcd.AsyncEtcdGuard.read_group`), where the rule is written once."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from .._core.errors import ConfigurationError
from .._core.token import FencingToken
from ._member_types import Item, Snapshot, snapshot_of

__all__ = ["EtcdMember"]


class EtcdMember:
    """A member on etcd, through an ``AsyncEtcdGuard`` (or the sync ``EtcdGuard``, whose
    blocking calls run on a thread). The group's keys are in the guard's reserved prefix:
    ``<prefix>group/<resource>/<group>/{epoch,holder}`` and ``.../data/<key>``; one change is
    one transaction, the guard's fenced write (see ``AsyncEtcdGuard.apply_group``). A change
    larger than etcd takes in one transaction (``--max-txn-ops``, the guard's
    ``max_txn_ops``) is refused before anything is sent (ConfigurationError)."""

    def __init__(self, guard: Any, group: str) -> None:
        from ..guards import etcd as etcd_guard

        self.guard = guard
        self._sync = isinstance(guard, etcd_guard.EtcdGuard)
        self.resource: str = guard.resource
        self._group = group
        (guard.aio if self._sync else guard).group_keys(group)  # (a bad name fails here)

    async def apply(
        self,
        token: FencingToken | None,
        epoch: int,
        items: Sequence[Item],
        *,
        reset: bool = False,
        since: int = 0,
    ) -> None:
        if token is None and items:
            raise ConfigurationError("items are written only with a lock token")
        kw: dict[str, Any] = {
            "token": token,
            "group": self._group,
            "epoch": epoch,
            "items": [(i.key, i.stamp, i.value) for i in items],
            "reset": reset,
            "since": since,
        }
        if self._sync:
            await asyncio.to_thread(lambda: self.guard.apply_group(**kw))
        else:
            await self.guard.apply_group(**kw)

    async def read(self, keys: Sequence[str] | None = None) -> Snapshot:
        group = self._group
        if self._sync:
            state = await asyncio.to_thread(lambda: self.guard.read_group(group=group, keys=keys))
        else:
            state = await self.guard.read_group(group=group, keys=keys)
        return snapshot_of(state)

    async def aclose(self) -> None:
        pass  # the guard is the caller's to close

    def __repr__(self) -> str:
        return f"EtcdMember({self.resource!r})"
