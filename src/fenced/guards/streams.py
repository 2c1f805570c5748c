"""Fenced commits for message consumers: Redis Streams consumer groups.

At-least-once consumers read a message, process it, then *commit* their progress (``XACK``).
After a rebalance — the owner of a stream (or of a partition of the work) paused past its
lease, and a new owner claimed its pending messages with ``XAUTOCLAIM`` — the old owner can
wake up and acknowledge messages the new owner is still processing: they leave the pending
list, and if the new owner then crashes they are lost. Its progress record can also move
backwards. The remedy is the fencing token on the commit::

    guard = RedisGuard(r, "orders-stream")                  # the mark, as for any Redis write
    consumer = FencedStreamConsumer(guard, "orders", "billing")
    with locks.lock("orders-stream", ttl=10) as lease:      # ownership of the stream's work
        stalled = consumer.claim("worker-1", token=lease.token)    # the last owner's pending ones
        fresh = consumer.read("worker-1", token=lease.token, count=10)
        ...process...
        consumer.commit([id for id, _ in stalled + fresh], token=lease.token)   # StaleTokenError

``claim`` and ``read`` are fenced too, and that matters as much as the commit: the new owner's
``claim`` raises the mark *in the same script* that moves the stalled entries to it
(``XAUTOCLAIM``), so from that instant the old owner's commit is refused. A plain
``XAUTOCLAIM`` before the new owner's first fenced write would leave a window in which the old
owner's late ``XACK`` still passes (the tests show it: that is the unguarded run's loss).

``commit`` is one Lua script: the guard's fence check (the same mark every guarded write of the
resource uses, so results written with the same token through the guard are fenced alike),
then ``XACK`` of the ids and the progress key moved forward to the highest id (stream ids
compared as the numbers (milliseconds, sequence); only canonical ids, as Redis returns them,
are taken: ``0001-0`` is refused), all or nothing. A refused commit acknowledges nothing:
the new owner's pending entries stay pending. Async: :class:`AsyncFencedStreamConsumer` on an
``AsyncRedisGuard``, the same script.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

from .._core.errors import ConfigurationError
from .._core.token import TokenLike

__all__ = ["AsyncFencedStreamConsumer", "FencedStreamConsumer"]

_ID_RE: Final = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
_ID_PART_MAX: Final = 2**64 - 1

CLAIM_BODY: Final = """
return redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
"""
"""KEYS: stream. ARGV: group, consumer, min idle ms, start id, count."""

READ_BODY: Final = """
return redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', KEYS[1], '>')
"""
"""KEYS: stream. ARGV: group, consumer, count (never BLOCK: not allowed in a script)."""

COMMIT_BODY: Final = """
local function parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  if not ms then return nil end
  return (string.gsub(ms, '^0+(%d)', '%1')), (string.gsub(seq, '^0+(%d)', '%1'))
end
local function older(am, as, bm, bs)
  if #am ~= #bm then return #am < #bm end
  if am ~= bm then return am < bm end
  if #as ~= #bs then return #as < #bs end
  return as < bs
end
local hm, hs = parts(ARGV[2])
local last = redis.call('GET', KEYS[2])
local forward = true
if last then
  local lm, ls = parts(last)
  if not lm then
    return redis.error_reply('FENCEDGUARD corrupt progress=' .. string.sub(last, 1, 40))
  end
  forward = older(lm, ls, hm, hs)
end
local acked = 0
if #ARGV > 2 then
  acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3))
end
if forward then
  redis.call('SET', KEYS[2], ARGV[2])
end
return acked
"""
"""KEYS: stream, progress key. ARGV: group, the highest id, the ids to acknowledge (all
canonical: checked before sending). Ids compare as numbers, written as decimal strings without
leading zeros, shorter first (no float rounding of 64-bit ms); a stored progress with leading
zeros (written before ids were checked) compares by its value too and is replaced by the next
commit past it. A progress that is no id at all is refused before anything is acknowledged."""


def _ids(ids: Sequence[str | bytes]) -> list[str]:
    out = []
    for i in ids:
        text = i.decode("ascii", "replace") if isinstance(i, bytes) else i
        # Canonical only, as Redis writes them: '0001-0' names entry 1-0 to XACK, but as text
        # it would sort after '2-0', and the progress record would move backwards.
        m = _ID_RE.fullmatch(text) if isinstance(text, str) else None
        if m is None or any(
            (p != "0" and p.startswith("0")) or int(p) > _ID_PART_MAX for p in m.groups()
        ):
            raise ConfigurationError(
                f"a stream entry id is 'ms-seq' in canonical decimal (as Redis returns it: "
                f"no leading zeros, each part below 2**64), not {i!r}"
            )
        out.append(text)
    if not out:
        raise ConfigurationError("commit() needs at least one entry id")
    return out


def _highest(ids: list[str]) -> str:
    return max(ids, key=lambda i: tuple(int(p) for p in i.split("-")))


class _Base:
    def __init__(
        self, guard: Any, stream: str, group: str, *, progress_key: str | None = None
    ) -> None:
        for what, value in (("stream", stream), ("group", group)):
            if not isinstance(value, str) or not value:
                raise ConfigurationError(f"{what} must be a non-empty str, not {value!r}")
        self.guard, self.stream, self.group = guard, stream, group
        self.progress_key = progress_key or f"{stream}:fenced-progress:{group}"

    def _call(self, ids: Sequence[str | bytes]) -> tuple[str, list[str], list[str]]:
        checked = _ids(ids)
        return (
            COMMIT_BODY,
            [self.stream, self.progress_key],
            [self.group, _highest(checked), *checked],
        )

    def _claim_call(
        self, consumer: str, min_idle_ms: int, count: int, start: str
    ) -> tuple[str, list[str], list[str]]:
        _check_consumer(consumer)
        if not isinstance(count, int) or not 0 < count <= 10_000:
            raise ConfigurationError(f"count must be 1-10000, not {count!r}")
        if not isinstance(min_idle_ms, int) or min_idle_ms < 0:
            raise ConfigurationError(f"min_idle_ms must be >= 0, not {min_idle_ms!r}")
        _ids([start])
        args = [self.group, consumer, str(min_idle_ms), start, str(count)]
        return CLAIM_BODY, [self.stream], args

    def _read_call(self, consumer: str, count: int) -> tuple[str, list[str], list[str]]:
        _check_consumer(consumer)
        if not isinstance(count, int) or not 0 < count <= 10_000:
            raise ConfigurationError(f"count must be 1-10000, not {count!r}")
        return READ_BODY, [self.stream], [self.group, consumer, str(count)]

    @staticmethod
    def _progress(raw: Any) -> str | None:
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


Entry = tuple[str, dict[bytes, bytes]]


def _entries(raw: Any) -> list[Entry]:
    out = []
    for entry_id, fields in raw or []:
        if fields is None:  # an entry deleted from the stream while pending
            continue
        eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        flat = list(fields)
        out.append((eid, dict(zip(flat[::2], flat[1::2], strict=True))))
    return out


def _claimed(raw: Any) -> list[Entry]:
    return _entries(raw[1]) if raw else []


def _read(raw: Any) -> list[Entry]:
    return _entries(raw[0][1]) if raw else []


def _check_consumer(consumer: object) -> None:
    if not isinstance(consumer, str) or not consumer:
        raise ConfigurationError(f"consumer must be a non-empty str, not {consumer!r}")


class FencedStreamConsumer(_Base):
    """Fenced ``XACK`` + progress for consumer group ``group`` of ``stream``, on a
    :class:`~fenced.guards.redis.RedisGuard` (whose mark and lock it uses)."""

    def claim(
        self,
        consumer: str,
        *,
        token: TokenLike,
        min_idle_ms: int = 0,
        count: int = 100,
        start: str = "0-0",
    ) -> list[Entry]:
        """Raise the mark to ``token`` and ``XAUTOCLAIM`` pending entries idle at least
        ``min_idle_ms`` to ``consumer``, in one script: from then on the entries' previous
        owner cannot commit. Returns the claimed (id, fields)."""
        body, keys, args = self._claim_call(consumer, min_idle_ms, count, start)
        return _claimed(self.guard.eval(body, keys, args, token=token))

    def read(self, consumer: str, *, token: TokenLike, count: int = 10) -> list[Entry]:
        """``XREADGROUP`` new entries for ``consumer`` iff ``token`` is not stale (never
        blocks: wait with ``XREAD BLOCK`` or a sleep outside, then call again)."""
        body, keys, args = self._read_call(consumer, count)
        return _read(self.guard.eval(body, keys, args, token=token))

    def commit(self, ids: Sequence[str | bytes], *, token: TokenLike) -> int:
        """Acknowledge ``ids`` and move the progress to the highest, iff ``token`` is not
        stale (:class:`~fenced.StaleTokenError`: nothing acknowledged). Returns how many of
        the ids were pending and are now acknowledged."""
        body, keys, args = self._call(ids)
        return int(self.guard.eval(body, keys, args, token=token))

    def progress(self) -> str | None:
        """The highest id committed so far, or None."""
        return self._progress(self.guard._client.get(self.progress_key))


class AsyncFencedStreamConsumer(_Base):
    """:class:`FencedStreamConsumer` on an :class:`~fenced.guards.redis.AsyncRedisGuard`."""

    async def claim(
        self,
        consumer: str,
        *,
        token: TokenLike,
        min_idle_ms: int = 0,
        count: int = 100,
        start: str = "0-0",
    ) -> list[Entry]:
        body, keys, args = self._claim_call(consumer, min_idle_ms, count, start)
        return _claimed(await self.guard.eval(body, keys, args, token=token))

    async def read(self, consumer: str, *, token: TokenLike, count: int = 10) -> list[Entry]:
        body, keys, args = self._read_call(consumer, count)
        return _read(await self.guard.eval(body, keys, args, token=token))

    async def commit(self, ids: Sequence[str | bytes], *, token: TokenLike) -> int:
        body, keys, args = self._call(ids)
        return int(await self.guard.eval(body, keys, args, token=token))

    async def progress(self) -> str | None:
        return self._progress(await self.guard._client.get(self.progress_key))
