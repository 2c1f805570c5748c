"""A replicated group's member on Redis (see :mod:`fenced.replicated._members`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from .._core.errors import ConfigurationError, CorruptMarkError
from .._core.token import FencingToken
from ._member_types import Item, Snapshot, _as_bytes, _refused_behind, _refused_epoch, _Threaded

__all__ = ["RedisMember"]


# -- Redis --------------------------------------------------------------------------------------

# KEYS: 1 fence hash (the guard's), 2 epoch, 3 stamps hash, 4 data hash, 5 holder.
# ARGV: 1 lock, 2 token (the guard's prelude), 3 epoch, 4 reset (1: forget all items first),
# 5 since, 6 the token's text, then (key, stamp, has, value) per item.
_EPOCH_FIRST: Final = """\
local e = tonumber(redis.call('GET', KEYS[2]) or '0')
if e > tonumber(ARGV[3]) then return {'epoch', tostring(e)} end
if e < tonumber(ARGV[5]) then return {'behind', tostring(e)} end
"""
# (The prelude refused a token below the mark, so ARGV[6] is the holder at the mark now.)
_APPLY_BODY: Final = """\
if tonumber(ARGV[3]) > e then redis.call('SET', KEYS[2], ARGV[3]) end
redis.call('SET', KEYS[5], ARGV[6])
if ARGV[4] == '1' then redis.call('DEL', KEYS[3], KEYS[4]) end
local i = 7
while i <= #ARGV do
  local old = redis.call('HGET', KEYS[3], ARGV[i])
  if (not old) or old < ARGV[i + 1] then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
    if ARGV[i + 2] == '1' then redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 3])
    else redis.call('HDEL', KEYS[4], ARGV[i]) end
  end
  i = i + 4
end
return {'ok', tostring(e)}
"""
_READ_LUA: Final = """\
local m = redis.call('HMGET', KEYS[1], 'lock', 'hw')
local e = redis.call('GET', KEYS[2]) or '0'
local h = redis.call('GET', KEYS[5]) or ''
if #ARGV == 0 then
  return {m[2] or '0', e, redis.call('HGETALL', KEYS[3]), redis.call('HGETALL', KEYS[4]), h}
end
local s, d = redis.call('HMGET', KEYS[3], unpack(ARGV)), redis.call('HMGET', KEYS[4], unpack(ARGV))
local st, dt = {}, {}
for i = 1, #ARGV do
  if s[i] then st[#st + 1] = ARGV[i]; st[#st + 1] = s[i] end
  if d[i] then dt[#dt + 1] = ARGV[i]; dt[#dt + 1] = d[i] end
end
return {m[2] or '0', e, st, dt, h}
"""


class RedisMember(_Threaded):
    """A member on Redis, through a :class:`~fenced.guards.redis.RedisGuard` (sync, run on a
    thread) or ``AsyncRedisGuard``. The group's keys sit next to the guard's fence key (same
    hash slot), in fenced's reserved key space: ``<fence key>:group:<group>:{epoch,stamps,data}``,
    so no guarded write outside the group can change them. Values are bytes (with a client
    that decodes responses, UTF-8 text)."""

    def __init__(self, guard: Any, group: str) -> None:
        from ..guards import redis as redis_guard

        super().__init__(f"fenced-member-{guard.resource}")
        self.guard = guard
        self.resource: str = guard.resource
        self._async = isinstance(guard, redis_guard.AsyncRedisGuard)
        base = f"{guard.fence_key}:group:{group}"
        self._keys = [f"{base}:epoch", f"{base}:stamps", f"{base}:data", f"{base}:holder"]
        self._apply_script = redis_guard.PRELUDE + _APPLY_BODY
        self._full = _EPOCH_FIRST + self._apply_script
        self._epoch_only = guard._writer.register_script(
            "local e = tonumber(redis.call('GET', KEYS[1]) or '0')\n"
            "if e > tonumber(ARGV[1]) then return {'epoch', tostring(e)} end\n"
            "if e < tonumber(ARGV[2]) then return {'behind', tostring(e)} end\n"
            "if tonumber(ARGV[1]) > e then redis.call('SET', KEYS[1], ARGV[1]) end\n"
            "return {'ok', tostring(e)}"
        )
        self._read = guard._client.register_script(_READ_LUA)

    async def _do(self, fn: Callable[[], Any]) -> Any:
        if self._async:
            return await fn()
        return await self._run(fn)

    async def apply(
        self,
        token: FencingToken | None,
        epoch: int,
        items: Sequence[Item],
        *,
        reset: bool = False,
        since: int = 0,
    ) -> None:
        from ..guards import redis as redis_guard

        if token is None:
            if items:
                raise ConfigurationError("items are written only with a lock token")
            script = self._epoch_only
            try:
                reply = await self._do(lambda: script(keys=[self._keys[0]], args=[epoch, since]))
            except redis_guard._NATIVE_ERRORS as exc:
                raise redis_guard.map_error(exc, self.resource) from exc
        else:
            args: list[Any] = [epoch, "1" if reset else "0", since, str(token)]
            for item in items:
                has = item.value is not None
                args += [item.key, item.stamp, "1" if has else "0", item.value if has else ""]
            call = self.guard._call(self._full, token, self._keys, args)
            reply = await self._do(lambda: self.guard._run(call))
        kind, found = (_as_bytes(r).decode() for r in reply)
        if kind == "epoch":
            raise _refused_epoch(self.resource, int(found), epoch)
        if kind == "behind":
            raise _refused_behind(self.resource, int(found), since)

    async def read(self, keys: Sequence[str] | None = None) -> Snapshot:
        from ..guards import redis as redis_guard

        script = self._read
        try:
            hw, epoch, stamps, data, holder = await self._do(
                lambda: script(keys=[self.guard.fence_key, *self._keys], args=list(keys or []))
            )
        except redis_guard._NATIVE_ERRORS as exc:
            raise redis_guard.map_error(exc, self.resource) from exc
        values = {
            _as_bytes(data[i]).decode(): _as_bytes(data[i + 1]) for i in range(0, len(data), 2)
        }
        items = {}
        for i in range(0, len(stamps), 2):
            key = _as_bytes(stamps[i]).decode()
            items[key] = Item(key, _as_bytes(stamps[i + 1]).decode(), values.get(key))
        held = _as_bytes(holder).decode() or None
        return Snapshot(_mark(hw, self.resource), int(_as_bytes(epoch)), items, held)

    async def aclose(self) -> None:
        self._shutdown()

    def __repr__(self) -> str:
        return f"RedisMember({self.resource!r})"


def _mark(raw: Any, resource: str) -> int:
    text = _as_bytes(raw).decode()
    if not text.isdigit():
        raise CorruptMarkError(resource, f"mark {text[:40]!r}")
    return int(text)
