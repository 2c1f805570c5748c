"""A replicated group's member on etcd: an adapter over the guard's group contract
(:meth:`AsyncEtcdGuard.apply_group <fenced.guards.etcd.AsyncEtcdGuard.apply_group>`,
:meth:`~fenced.guards.etcd.AsyncEtcdGuard.read_group`), where the rule is written once."""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any

from ._member_types import GuardMember

if TYPE_CHECKING:
    from ..guards.etcd import AsyncEtcdGuard, EtcdGuard

__all__ = ["EtcdMember"]


class EtcdMember(GuardMember):
    """A member on etcd, through an ``AsyncEtcdGuard`` (or the sync ``EtcdGuard``, whose
    blocking calls run on a thread). The group's keys are in the guard's reserved prefix:
    ``<prefix>group/<resource>/<group>/{epoch,holder}`` and ``.../data/<key>``; one change is
    one transaction, the guard's fenced write (see ``AsyncEtcdGuard.apply_group``). A change
    larger than etcd takes in one transaction (``--max-txn-ops``, the guard's
    ``max_txn_ops``) is refused before anything is sent (ConfigurationError)."""

    def __init__(self, guard: EtcdGuard | AsyncEtcdGuard, group: str) -> None:
        from ..guards import etcd as etcd_guard

        super().__init__(guard, group)
        self._sync = isinstance(guard, etcd_guard.EtcdGuard)
        aio = guard.aio if isinstance(guard, etcd_guard.EtcdGuard) else guard
        aio.group_keys(group)  # (a bad name fails here)

    async def _call(self, method: str, /, **kw: Any) -> Any:
        call = getattr(self.guard, method)
        if self._sync:
            return await asyncio.to_thread(functools.partial(call, **kw))
        return await call(**kw)
