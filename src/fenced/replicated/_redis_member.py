"""A replicated group's member on Redis: an adapter over the guard's group contract
(:meth:`RedisGuard.apply_group <fenced.guards.redis.RedisGuard.apply_group>`,
:meth:`~fenced.guards.redis.RedisGuard.read_group`), where the rule is written once."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ._member_types import GuardMember, _Threaded

if TYPE_CHECKING:
    from ..guards.redis import AsyncRedisGuard, RedisGuard

__all__ = ["RedisMember"]


class RedisMember(GuardMember, _Threaded):
    """A member on Redis, through a :class:`~fenced.guards.redis.RedisGuard` (sync, run on a
    thread) or ``AsyncRedisGuard``. The group's keys sit next to the guard's fence key (same
    hash slot), in fenced's reserved key space: ``<fence key>:group:<group>:{epoch,stamps,data,
    holder}``, so no guarded write outside the group can change them. Values are bytes (with a
    client that decodes responses, UTF-8 text)."""

    def __init__(self, guard: RedisGuard | AsyncRedisGuard, group: str) -> None:
        from ..guards import redis as redis_guard

        GuardMember.__init__(self, guard, group)
        _Threaded.__init__(self, f"fenced-member-{guard.resource}")
        self._async = isinstance(guard, redis_guard.AsyncRedisGuard)
        guard.group_keys(group)  # (a bad group name fails here, typed)

    async def _call(self, method: str, /, **kw: Any) -> Any:
        call = getattr(self.guard, method)
        if self._async:
            return await call(**kw)
        return await self._run(functools.partial(call, **kw))

    async def aclose(self) -> None:
        self._shutdown()
