"""A replicated group's member on Redis: an adapter over the guard's group contract
(:meth:`RedisGuard.apply_group <fenced.guards.redis.RedisGuard.apply_group>`,
:meth:`~fenced.guards.redis.RedisGuard.read_group`), where the rule is written once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._core.errors import ConfigurationError
from .._core.token import FencingToken
from ._member_types import Item, Snapshot, _Threaded, snapshot_of

__all__ = ["RedisMember"]


class RedisMember(_Threaded):
    """A member on Redis, through a :class:`~fenced.guards.redis.RedisGuard` (sync, run on a
    thread) or ``AsyncRedisGuard``. The group's keys sit next to the guard's fence key (same
    hash slot), in fenced's reserved key space: ``<fence key>:group:<group>:{epoch,stamps,data,
    holder}``, so no guarded write outside the group can change them. Values are bytes (with a
    client that decodes responses, UTF-8 text)."""

    def __init__(self, guard: Any, group: str) -> None:
        from ..guards import redis as redis_guard

        super().__init__(f"fenced-member-{guard.resource}")
        self.guard = guard
        self.resource: str = guard.resource
        self._async = isinstance(guard, redis_guard.AsyncRedisGuard)
        self._group = group
        guard.group_keys(group)  # (a bad group name fails here, typed)

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
        if self._async:
            await self.guard.apply_group(**kw)
        else:
            await self._run(lambda: self.guard.apply_group(**kw))

    async def read(self, keys: Sequence[str] | None = None) -> Snapshot:
        group = self._group
        if self._async:
            state = await self.guard.read_group(group=group, keys=keys)
        else:
            state = await self._run(lambda: self.guard.read_group(group=group, keys=keys))
        return snapshot_of(state)

    async def aclose(self) -> None:
        self._shutdown()

    def __repr__(self) -> str:
        return f"RedisMember({self.resource!r})"
