"""Redis guard: fenced writes, each ONE Lua script that checks the token, advances the mark, writes.

::

    guard = RedisGuard(redis.Redis(...), "invoices", lock="invoices")
    guard.set("{invoices}:42", payload, token=lease.token)             # StaleTokenError if fenced off
    guard.hset("{invoices}:42:meta", {"state": "paid"}, token=lease.token)
    guard.delete("{invoices}:41", token=lease.token)
    guard.incrby("{invoices}:count", 1, token=lease.token)         # also hincrby, rpush, xadd,
    guard.command("LTRIM", "{invoices}:log", 0, 999, token=lease.token)  # expire, COMMANDS
    guard.eval("return redis.call('INCR', KEYS[1])", ["{invoices}:n"], [], token=lease.token)

The high-water mark lives in Redis itself, in the hash ``fenced:hw:{<resource>}`` (fields
``hw``: the highest accepted token value as a decimal integer; ``lock``: the lock whose tokens
this resource accepts). It has no TTL (every guarded script PERSISTs it), and it is written
inside the same script as the data, so it is exactly as durable as the data: with AOF, both are
in one MULTI/EXEC block of the log, fsynced together.

The guard remembers the highest mark it has seen (from its own accepted writes, stale
refusals and :meth:`~RedisGuard.high_water`) and sends it with every write: a fence hash that is
missing, or holds a lower mark, after that (``DEL``, ``FLUSHDB``, a restored backup) would
restart the mark and let a stale token in, so the script refuses the write instead
(:class:`~fenced.CorruptMarkError`, nothing written) until an operator restores the mark.

Redis runs a script to completion before any other command, so "compare with the mark, advance
the mark, write" cannot interleave with another writer: that is the whole atomicity argument.
A rejected script returns before its first write, so a stale writer changes nothing.

Redis Cluster: a script may only touch keys of one hash slot. The default fence key carries the
hash tag ``{<resource>}``, so name the guarded keys with the same tag (``{invoices}:42``), or
pass ``fence_key=`` with your keys' tag. Keys of another slot fail with CROSSSLOT (a
:class:`~fenced.FencedError`) before anything is written.

The Lua text and the reading of its refusals are written once, as pure functions; the sync
(:class:`RedisGuard`, ``redis.Redis``) and async (:class:`AsyncRedisGuard`, ``redis.asyncio``)
classes only send them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript, Script
from redis.retry import Retry

from .._clients.redis_errors import NATIVE, kind
from .._clients.redis_sockets import NO_MAINT, socket_checked
from .._core.errors import (
    AccessDenied,
    BackendUnavailable,
    ConfigurationError,
    CorruptMarkError,
    FencedError,
    StaleTokenError,
    UnsafeBackendError,
    WrongLockError,
    member_behind_error,
    stale_epoch_error,
)
from .._core.signing import TokenVerifier
from .._core.token import MAX_TOKEN, FencingToken, TokenLike, validate_lock_name
from ._plan import GroupItem, GroupState, check_group_change, checked_group_state
from ._token_arg import lock_keyword, token_keyword

__all__ = ["COMMANDS", "AsyncRedisGuard", "RedisGuard", "default_fence_key"]

Value = bytes | str | int | float
"""What redis-py can send as a value."""
Key = bytes | str

# --- Lua -------------------------------------------------------------------------------------

PRELUDE: Final = """\
-- fenced guard prelude. KEYS[1] = fence hash, ARGV[1] = lock name, ARGV[2] = "<token> <seen>":
-- the token value (canonical decimal, 1 .. 2^63-1) and the highest mark this guard has seen
-- (0: none yet). Lua numbers are doubles, exact only below 2^53, so values are compared as
-- digit strings: by length, then in two halves that are each exact.
local fence, lock = KEYS[1], ARGV[1]
local tok, seen = string.match(ARGV[2], '^(%d+) (%d+)$')
local state = redis.call('HMGET', fence, 'lock', 'hw')
-- A mark without its lock binding, or a binding without its mark, was damaged: fail closed.
if not state[1] ~= not state[2] then
  return redis.error_reply('FENCEDGUARD corrupt ' .. (state[1] and 'no hw field' or 'no lock field'))
end
if state[1] and state[1] ~= lock then return redis.error_reply('FENCEDGUARD lock ' .. state[1]) end
local function cmp(a, b)  -- 1: a > b, 0: equal, -1: a < b
  if #a ~= #b then return (#a > #b) and 1 or -1 end
  local ah, bh = tonumber(string.sub(a, 1, -10)) or 0, tonumber(string.sub(b, 1, -10)) or 0
  local al, bl = tonumber(string.sub(a, -9)), tonumber(string.sub(b, -9))
  if ah ~= bh then return (ah > bh) and 1 or -1 end
  if al ~= bl then return (al > bl) and 1 or -1 end
  return 0
end
local hw = state[2]
local c = 1  -- token vs mark: 1 higher (or no mark yet), 0 equal, -1 lower
if hw then
  if #hw > 19 or not string.find(hw, '^[1-9][0-9]*$')
     or (#hw == 19 and hw > '9223372036854775807') then
    return redis.error_reply('FENCEDGUARD corrupt hw=' .. string.sub(hw, 1, 40))
  end
  -- Marks only grow: one below what this guard saw was reset (restored, rewritten).
  if cmp(hw, seen) < 0 then
    return redis.error_reply('FENCEDGUARD corrupt hw=' .. hw .. ' below ' .. seen .. ', seen before')
  end
  c = cmp(tok, hw)
elseif seen ~= '0' then
  -- The fence hash was deleted (DEL, FLUSHDB, a restore) after this guard saw a mark:
  -- creating it again would restart the mark at 0 and let stale tokens in.
  return redis.error_reply('FENCEDGUARD corrupt mark missing, after this guard saw ' .. seen)
end
if c < 0 then return redis.error_reply('FENCEDGUARD stale ' .. hw) end
if not state[1] then redis.call('HSET', fence, 'lock', lock, 'hw', (c > 0) and tok or hw)
elseif c > 0 then redis.call('HSET', fence, 'hw', tok) end
redis.call('PERSIST', fence)
"""
"""Checks the token against the mark and advances it; returns early (writing nothing) on refusal.

A refusal is an error reply ``FENCEDGUARD <stale|lock|corrupt> <detail>``; an accepted write
returns the write's own reply, so the common path parses no more than the unguarded command."""

_SET_BODY: Final = """\
if ARGV[4] == '' then return redis.call('SET', KEYS[2], ARGV[3]) end
return redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
"""

# unpack() is bounded by Lua's C stack (~8000 values): pass long argument lists in chunks.
_HSET_BODY: Final = """\
local n, i = 0, 3
while i <= #ARGV do
  local j = math.min(i + 999, #ARGV)
  n = n + redis.call('HSET', KEYS[2], unpack(ARGV, i, j))
  i = j + 1
end
return n
"""

_DEL_BODY: Final = """\
local n, i = 0, 2
while i <= #KEYS do
  local j = math.min(i + 999, #KEYS)
  n = n + redis.call('DEL', unpack(KEYS, i, j))
  i = j + 1
end
return n
"""

# The caller's Lua sees its own KEYS and ARGV (the fence key and the token are shifted out into
# locals that shadow the globals) and runs as a function, whose return value is the reply.
_EVAL_TEMPLATE: Final = """\
local KEYS, ARGV = (function(k, a)
  local k2, a2 = {}, {}
  for i = 2, #k do k2[i - 1] = k[i] end
  for i = 3, #a do a2[i - 2] = a[i] end
  return k2, a2
end)(KEYS, ARGV)
return (function()
%s
end)()
"""

# One Redis command on one key, the key its first argument (see COMMANDS): ARGV[3] is the
# command's name, KEYS[2] the key, ARGV[4..] its other arguments.
_COMMAND_BODY: Final = """\
return redis.call(ARGV[3], KEYS[2], unpack(ARGV, 4, #ARGV))
"""

COMMANDS: Final = frozenset(
    {
        # strings and counters
        "APPEND", "DECR", "DECRBY", "GETDEL", "INCR", "INCRBY", "INCRBYFLOAT", "SETRANGE",
        # expiry
        "EXPIRE", "EXPIREAT", "PERSIST", "PEXPIRE", "PEXPIREAT",
        # hashes
        "HDEL", "HINCRBY", "HINCRBYFLOAT", "HSETNX",
        # lists
        "LINSERT", "LPOP", "LPUSH", "LREM", "LSET", "LTRIM", "RPOP", "RPUSH",
        # sets, sorted sets, streams, HyperLogLog, bits
        "SADD", "SREM", "ZADD", "ZINCRBY", "ZREM", "ZREMRANGEBYRANK", "ZREMRANGEBYSCORE",
        "XADD", "XDEL", "XTRIM", "PFADD", "SETBIT",
    }
)  # fmt: skip
"""The writes :meth:`RedisGuard.command` fences: each touches exactly one key, its first
argument, so the guard can check that key (never one of fenced's) and its slot."""

_MAX_ARGS: Final = 7000  # unpack() is bounded by Lua's C stack (~8000 values)

_PRELUDE_START: Final = PRELUDE.partition("\n")[0]

SET_SCRIPT: Final = PRELUDE + _SET_BODY
HSET_SCRIPT: Final = PRELUDE + _HSET_BODY
DEL_SCRIPT: Final = PRELUDE + _DEL_BODY
COMMAND_SCRIPT: Final = PRELUDE + _COMMAND_BODY


# -- a replicated group's member (fenced.replicated.RedisMember) -----------------------------
# The group's keys sit next to the fence key (same hash slot), in the reserved key space, so no
# guarded write can touch them: see group_keys. A change is ONE script: the epoch mark
# checked first (reads only, so a refused change writes nothing), then the PRELUDE (the lock
# token against the guard's own mark: the one rule of every guarded write), then both marks
# raised and the items applied.
# KEYS: 1 fence hash, 2 epoch, 3 stamps hash, 4 data hash, 5 holder.
# ARGV: 1 lock, 2 "<token> <seen>" (the prelude's), 3 epoch, 4 reset (1: forget all items
# first), 5 since, 6 the token's text, then (key, stamp, has, value) per item.
# Epochs are compared as digit strings padded to 19 (Lua numbers are doubles, exact only
# below 2^53: 2^53 and 2^53+1 would compare equal), and a stored epoch that is not 1-19 digits
# is damaged: refused as corrupt, never read as a number (tonumber takes '1e3', ' 7', '0x10').
_GROUP_EPOCH_PARSE: Final = """\
local function epoch_of(s)
  if #s == 0 or #s > 19 or not string.find(s, '^[0-9]+$') then return nil end
  return string.rep('0', 19 - #s) .. s
end
"""
_GROUP_EPOCH_CHECK: Final = (
    _GROUP_EPOCH_PARSE
    + """\
local raw = redis.call('GET', KEYS[2])
local e = raw or '0'
local ep = epoch_of(e)
if not ep then return {'corrupt', string.sub(e, 1, 40)} end
if ep > epoch_of(ARGV[3]) then return {'epoch', e} end
if ep < epoch_of(ARGV[5]) then return {'behind', e} end
-- No epoch mark: the member is new or came back empty, its fence hash gone with it; the mark
-- this guard saw must not refuse the group's state transfer for good (the prelude's 'seen').
if not raw then ARGV[2] = string.match(ARGV[2], '^%d+') .. ' 0' end
"""
)
# (The prelude refused a token below the mark, so ARGV[6] is the holder at the mark now.)
_GROUP_APPLY_BODY: Final = """\
if epoch_of(ARGV[3]) > ep then redis.call('SET', KEYS[2], ARGV[3]) end
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
return {'ok', e}
"""
GROUP_APPLY_SCRIPT: Final = _GROUP_EPOCH_CHECK + PRELUDE + _GROUP_APPLY_BODY

# A change without a lock token (the epoch; with reset, forget every item: a copy from a
# member never written to): KEYS 1 epoch, 2 stamps, 3 data; ARGV: 1 epoch, 2 since, 3 reset.
GROUP_EPOCH_SCRIPT: Final = (
    _GROUP_EPOCH_PARSE
    + """\
local e = redis.call('GET', KEYS[1]) or '0'
local ep = epoch_of(e)
if not ep then return {'corrupt', string.sub(e, 1, 40)} end
if ep > epoch_of(ARGV[1]) then return {'epoch', e} end
if ep < epoch_of(ARGV[2]) then return {'behind', e} end
if epoch_of(ARGV[1]) > ep then redis.call('SET', KEYS[1], ARGV[1]) end
if ARGV[3] == '1' then redis.call('DEL', KEYS[2], KEYS[3]) end
return {'ok', e}
"""
)

# The read, at one instant. KEYS as the change's; ARGV: 1 '1' (all items) or '0' (the keys
# ARGV[2..], in chunks: unpack() is bounded by Lua's C stack).
GROUP_READ_SCRIPT: Final = """\
local m = redis.call('HMGET', KEYS[1], 'lock', 'hw')
local e = redis.call('GET', KEYS[2]) or '0'
local h = redis.call('GET', KEYS[5]) or ''
if ARGV[1] == '1' then
  return {m[1] or '', m[2] or '', e, redis.call('HGETALL', KEYS[3]),
          redis.call('HGETALL', KEYS[4]), h}
end
local st, dt, i = {}, {}, 2
while i <= #ARGV do
  local j = math.min(i + 999, #ARGV)
  local s = redis.call('HMGET', KEYS[3], unpack(ARGV, i, j))
  local d = redis.call('HMGET', KEYS[4], unpack(ARGV, i, j))
  for n = 1, j - i + 1 do
    if s[n] then st[#st + 1] = ARGV[i + n - 1]; st[#st + 1] = s[n] end
    if d[n] then dt[#dt + 1] = ARGV[i + n - 1]; dt[#dt + 1] = d[n] end
  end
  i = j + 1
end
return {m[1] or '', m[2] or '', e, st, dt, h}
"""


def eval_script(lua_body: str) -> str:
    """The full script for :meth:`RedisGuard.eval`: the prelude, then ``lua_body`` as a function."""
    return PRELUDE + _EVAL_TEMPLATE % lua_body


# --- pure request building and reply interpretation -------------------------------------------


NAMESPACE: Final = "fenced:"
"""The key space reserved for fence keys: no guarded write may touch a key that starts with it.

Every fence key is in it (a custom ``fence_key=`` must be too), so one resource's guarded
write can never rewrite another resource's mark. ``fenced:hw:{<resource>}`` is injective in
the resource (a resource name may not contain braces), so no two resources share a mark."""


def default_fence_key(resource: str) -> str:
    """``fenced:hw:{resource}``: the hash tag keeps it in the slot of keys tagged ``{resource}``."""
    return f"{NAMESPACE}hw:{{{resource}}}"


_WRITERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_WRITERS_LOCK = threading.Lock()


def _no_retry_client(client: Any) -> Any:
    """:func:`_make_no_retry_client`, made once per client and shared by its guards (an ASGI
    store makes a guard per resource: one pool each would leak connections)."""
    with _WRITERS_LOCK:
        try:
            writer = _WRITERS.get(client)
        except TypeError:  # not weak-referenceable: one per guard
            return _make_no_retry_client(client)
        if writer is None:
            writer = _make_no_retry_client(client)
            if writer is not client:
                _WRITERS[client] = writer
        return writer


# (client class, the pool classes whose settings can be copied, the sibling's pool, its Retry)
_SIBLINGS: Final[tuple[tuple[Any, tuple[Any, ...], Any, Any], ...]] = (
    (
        redis.asyncio.Redis,
        (redis.asyncio.ConnectionPool, redis.asyncio.BlockingConnectionPool),
        redis.asyncio.ConnectionPool,
        redis.asyncio.retry.Retry,
    ),
    (
        redis.Redis,
        (redis.ConnectionPool, redis.BlockingConnectionPool),
        redis.ConnectionPool,
        Retry,
    ),
)


def _make_no_retry_client(client: Any) -> Any:
    """A client for the guard's scripts that never re-sends a command on its own.

    redis-py re-sends a command whose reply timed out (10 times by default): a guarded
    ``INCRBY`` would be applied several times, and a retry that arrives after a newer holder's
    write is refused although the first attempt was applied. The guard's writes are sent once;
    an unknown outcome is reported as :class:`~fenced.BackendUnavailable`. For a plain client,
    a sibling pool with the same connection settings and no retries is made; a cluster client
    or another kind of pool must itself be configured with ``retry=Retry(NoBackoff(), 0)``.
    """
    pool: Any = getattr(client, "connection_pool", None)
    for client_class, pool_classes, pool_class, retry_class in _SIBLINGS:
        if isinstance(client, client_class) and type(pool) in pool_classes:
            kwargs = {**pool.connection_kwargs, "retry": retry_class(NoBackoff(), 0)}
            kwargs.pop("retry_on_error", None)
            kwargs.pop("retry_on_timeout", None)
            connection_class = pool.connection_class
            if client_class is redis.asyncio.Redis:  # (the blocking client reads its socket)
                # An idle connection the server closed is found before a write is sent on it
                # (the write goes out on a new one), not after (an error, outcome unknown).
                connection_class = socket_checked(connection_class)
                kwargs.update(NO_MAINT)
            sibling = pool_class(
                connection_class=connection_class,
                max_connections=pool.max_connections,
                **kwargs,
            )
            return client_class(connection_pool=sibling)
    retry = getattr(client, "retry", None)
    if retry is None and hasattr(client, "get_retry"):
        retry = client.get_retry()
    if retry is not None and retry.get_retries() > 0:
        raise ConfigurationError(
            f"{type(client).__name__} re-sends timed-out commands ({retry.get_retries()} "
            "retries), which would apply a guarded write twice: create it with "
            "retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0) for the guard"
        )
    return client


@dataclasses.dataclass(slots=True)
class GuardedCall:
    """One fenced write, ready to send: script text, KEYS, ARGV, and how to read the result."""

    script: str
    keys: list[Key]
    args: list[Value]
    token: FencingToken | None  # (None: a group's epoch-only change, no lock token)
    advances: bool = True
    """The script starts with the prelude: when it returns, the mark is at least the token."""


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


REFUSAL: Final = "FENCEDGUARD "
"""The prefix of the error replies by which a guard script refuses a write."""


def refusal(message: str, token: FencingToken, resource: str) -> FencedError | None:
    """The error a guard script's refusal reply stands for; None if it is not one."""
    if not message.startswith(REFUSAL):
        return None
    kind, _, detail = message[len(REFUSAL) :].partition(" ")
    if kind == "stale":
        return StaleTokenError(token, FencingToken(token.lock, int(detail)), resource)
    if kind == "lock":
        return WrongLockError(
            f"resource {resource!r} is fenced by lock {detail!r}; "
            f"token {token} belongs to lock {token.lock!r}"
        )
    return CorruptMarkError(resource, detail)


def parse_state(reply: Sequence[Any], resource: str) -> FencingToken | None:
    """Read ``HMGET fence lock hw`` as the high-water token (None: nothing accepted yet)."""
    lock, hw = reply
    if lock is None and hw is None:
        return None
    if hw is None:
        raise CorruptMarkError(resource, f"lock {_text(lock)[:40]!r} bound, no hw field")
    if lock is None:
        raise CorruptMarkError(resource, f"hw {_text(hw)[:40]!r} without a lock field")
    text = _text(hw)
    if not text.isascii() or not text.isdigit() or text.startswith("0") or len(text) > 19:
        raise CorruptMarkError(resource, f"hw={text[:40]!r}")
    try:
        return FencingToken(_text(lock), int(text))
    except FencedError as exc:
        raise CorruptMarkError(resource, f"lock={_text(lock)[:40]!r} hw={text[:40]!r}") from exc


def check_policy(policy: str) -> None:
    """Refuse an eviction policy that may evict the mark (it has no TTL, so volatile-* is fine)."""
    if policy.startswith("allkeys-"):
        raise UnsafeBackendError(
            f"maxmemory-policy {policy!r} may evict the fence key, which resets the high-water "
            "mark and lets stale writers in; use noeviction or a volatile-* policy"
        )


_NATIVE_ERRORS: Final = NATIVE


def map_error(exc: Exception, resource: str, token: FencingToken | None = None) -> FencedError:
    """Translate a redis-py error (or a guard script's refusal); raise the result ``from exc``."""
    if kind(exc) == "denied":  # (AuthenticationError is a ConnectionError to redis-py)
        return AccessDenied(f"Redis refused this client's credentials for {resource!r}: {exc}")
    if kind(exc) != "refused":  # unreachable, or a read-only replica: not writable now
        return BackendUnavailable(
            f"Redis unavailable for a guarded write on {resource!r} (outcome unknown if the "
            f"request was sent): {exc}"
        )
    if token is not None and isinstance(exc, redis.ResponseError):
        refused = refusal(str(exc), token, resource)
        if refused is not None:
            return refused
    hint = ""
    if "slot" in str(exc).lower():
        hint = " (in Redis Cluster, the fence key and the data keys must share a hash tag)"
    return FencedError(f"Redis refused a guarded write on {resource!r}: {exc}{hint}")


def _cut(resource: str, exc: Exception) -> BackendUnavailable:
    """A write whose connection was closed under it (by another thread): outcome unknown."""
    return BackendUnavailable(
        f"Redis connection closed during a guarded write on {resource!r} (outcome unknown: "
        f"the request may have been applied): {type(exc).__name__}: {exc}"
    )


def _bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _xadd_args(fields: Mapping[Key, Value], id: str) -> list[Value]:
    if not fields:
        raise ConfigurationError("xadd needs at least one field")
    flat: list[Value] = [id]
    for field, value in fields.items():
        flat += (field, value)
    return flat


def _px(px: int | None) -> str:
    if px is None:
        return ""
    if isinstance(px, bool) or not isinstance(px, int) or not 0 < px <= MAX_TOKEN:
        raise ConfigurationError(f"px must be a positive int of milliseconds, not {px!r}")
    return str(px)


class _GuardBase:
    """What both guards share: configuration, token checks and the building of each call."""

    _max_scripts = 256

    def __init__(
        self,
        client: Any,
        resource: str,
        lock: str | None = None,
        *,
        fence_key: str | None = None,
        verify: TokenVerifier | None = None,
    ) -> None:
        self.verifier = verify  # checks each token before the mark (see fenced._core.signing)
        if not isinstance(resource, str) or not resource:
            raise ConfigurationError(f"resource must be a non-empty str, not {resource!r}")
        if fence_key is None and ("{" in resource or "}" in resource):
            raise ConfigurationError(
                f"resource {resource!r} contains a brace: pass fence_key= with your hash tag"
            )
        if fence_key is not None and (
            not isinstance(fence_key, str) or not fence_key.startswith(NAMESPACE)
        ):
            raise ConfigurationError(
                f"fence_key must start with {NAMESPACE!r} (the reserved key space that "
                f"every guard refuses to write), not {fence_key!r}"
            )
        self._client = client
        # Scripts go through a client that never re-sends them (see _no_retry_client).
        self._writer = _no_retry_client(client)
        self.resource = resource
        self.lock = None if lock is None else validate_lock_name(lock)
        self.fence_key = fence_key if fence_key is not None else default_fence_key(resource)
        # Script objects (EVALSHA, then SCRIPT LOAD on NOSCRIPT): the fixed ones, and an LRU
        # of the scripts made from eval() bodies.
        self._fixed = {
            src: self._writer.register_script(src)
            for src in (self.set_script, self.hset_script, self.del_script)
        }
        self._scripts: collections.OrderedDict[str, Any] = collections.OrderedDict()
        # The highest mark this guard has seen, sent with every write: a mark that is missing
        # or lower afterwards was reset outside fenced, and refuses every write (fail closed).
        # (Racing threads may keep a lower value than the highest: less is checked, never more.)
        self._seen = 0
        self._reader: Any = None  # the group read script (made on first use)

    def _saw(self, value: int) -> None:
        if value > self._seen:
            self._seen = value

    def _outcome(self, call: GuardedCall, error: FencedError | None = None) -> None:
        """Remember what a call showed of the mark: a stale refusal names it; a script that
        started with the prelude and returned has raised it to at least the token."""
        if isinstance(error, StaleTokenError):
            if error.high_water is not None:
                self._saw(error.high_water.value)
        elif error is None and call.advances and call.token is not None:
            self._saw(call.token.value)

    def _failed(self, call: GuardedCall, exc: Exception) -> FencedError:
        """The fenced error a call's client error means, its outcome remembered."""
        error = map_error(exc, self.resource, call.token)
        self._outcome(call, error)
        return error

    def _seen_mark(self, found: FencingToken | None, seen: int) -> FencingToken | None:
        """The mark :meth:`high_water` read, checked against ``seen``: the highest this guard
        had seen when it sent the read (a write of another thread landing meanwhile is no
        step back)."""
        if (found.value if found is not None else 0) < seen:
            what = "missing" if found is None else f"at {found.value}"
            raise CorruptMarkError(
                self.resource, f"mark {what}, after this guard saw {seen} (reset?)"
            )
        if found is not None:
            self._saw(found.value)
        return found

    def _key(self, key: object) -> Key:
        if not isinstance(key, (str, bytes)) or not key:
            raise ConfigurationError(f"a guarded key must be a non-empty str or bytes: {key!r}")
        text = _text(key)
        if text == self.fence_key or text.startswith(NAMESPACE):
            raise ConfigurationError(
                f"{key!r} is in fenced's reserved key space {NAMESPACE!r}: a guarded write "
                "may not touch a fence key"
            )
        return key

    def _script(self, source: str) -> Any:
        """The registered script for ``source``."""
        script = self._fixed.get(source)
        if script is not None:
            return script
        script = self._scripts.get(source)
        # (KeyError: another thread moved or dropped the same entry meanwhile; harmless.)
        with contextlib.suppress(KeyError):
            if script is None:
                script = self._writer.register_script(source)
                self._scripts[source] = script
                while len(self._scripts) > self._max_scripts:
                    self._scripts.popitem(last=False)
            else:
                self._scripts.move_to_end(source)
        return script

    def _call(
        self,
        script: str,
        token: TokenLike,
        keys: Iterable[Key],
        args: Iterable[Value],
    ) -> GuardedCall:
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        return GuardedCall(
            script,
            [self.fence_key, *keys],
            [tok.lock, f"{tok.value} {self._seen}", *args],
            tok,
            script.startswith(_PRELUDE_START),
        )

    def _set_call(self, key: Key, value: Value, token: TokenLike, px: int | None) -> GuardedCall:
        return self._call(self.set_script, token, [self._key(key)], [value, _px(px)])

    def _hset_call(self, key: Key, mapping: Mapping[Key, Value], token: TokenLike) -> GuardedCall:
        if not mapping:
            raise ConfigurationError("hset needs a non-empty mapping")
        flat: list[Value] = []
        for field, value in mapping.items():
            flat += (field, value)
        return self._call(self.hset_script, token, [self._key(key)], flat)

    def _delete_call(self, keys: Sequence[Key], token: TokenLike) -> GuardedCall:
        if not keys:
            raise ConfigurationError("delete needs at least one key")
        return self._call(self.del_script, token, [self._key(k) for k in keys], [])

    def _command_call(
        self, name: str, key: Key, args: Sequence[Value], token: TokenLike
    ) -> GuardedCall:
        command = name.upper() if isinstance(name, str) else name
        if command not in COMMANDS:
            raise ConfigurationError(
                f"{name!r} is not a guarded Redis command (one key, the first argument): "
                f"use one of {', '.join(sorted(COMMANDS))}, or eval()"
            )
        if len(args) > _MAX_ARGS:
            raise ConfigurationError(f"{command} with {len(args)} arguments: at most {_MAX_ARGS}")
        return self._call(self.command_script, token, [self._key(key)], [command, *args])

    def _eval_call(
        self,
        lua_body: str,
        keys: Sequence[Key],
        args: Sequence[Value],
        token: TokenLike,
    ) -> GuardedCall:
        if not isinstance(lua_body, str) or not lua_body.strip():
            raise ConfigurationError("eval needs a non-empty Lua body")
        return self._call(
            self.eval_script(lua_body), token, [self._key(k) for k in keys], list(args)
        )

    # -- a replicated group's member: the calls, and the reading of their replies ----------

    def group_keys(self, group: str) -> list[str]:
        """The keys of group ``group``'s member here: epoch mark, stamps hash, data hash,
        holder; ``<fence key>:group:<group>:...``, in the reserved key space and the fence
        key's hash slot."""
        if not isinstance(group, str) or not group:
            raise ConfigurationError(f"a group name is a non-empty str, not {group!r}")
        base = f"{self.fence_key}:group:{group}"
        return [f"{base}:epoch", f"{base}:stamps", f"{base}:data", f"{base}:holder"]

    def _group_call(
        self,
        token: TokenLike | None,
        group: str,
        epoch: int,
        items: Sequence[GroupItem],
        reset: bool,
        since: int,
    ) -> GuardedCall:
        items = check_group_change(group, epoch, since, items)
        keys = self.group_keys(group)
        if token is None:
            if items:
                raise ConfigurationError("items are written only with a lock token")
            args0: list[Value] = [epoch, since, "1" if reset else "0"]
            return GuardedCall(self.group_epoch_script, [*keys[:3]], args0, None, False)
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        args: list[Value] = [epoch, "1" if reset else "0", since, str(tok)]
        for item in items:
            key, stamp, value = item
            args += [key, stamp, "0", ""] if value is None else [key, stamp, "1", value]
        call = self._call(self.group_apply_script, tok, keys, args)
        call.advances = False  # (see _group_outcome)
        return call

    def _group_outcome(self, reply: Any, epoch: int, since: int) -> None:
        # (An accepted change is not remembered as a mark seen: a member restarted empty is
        # told apart by its epoch mark and repaired by the group's state transfer, which a
        # remembered mark would refuse for good. A stale refusal is, as for every write.)
        kind, found = (_text(r) for r in reply)
        if kind == "corrupt":  # (the script refused before writing anything)
            raise CorruptMarkError(self.resource, f"the group's epoch mark {found!r}")
        if kind == "epoch":
            raise stale_epoch_error(self.resource, int(found), epoch)
        if kind == "behind":
            raise member_behind_error(self.resource, int(found), since)

    def _group_read_args(
        self, group: str, keys: Sequence[str] | None
    ) -> tuple[list[Key], list[Value]]:
        if keys is not None and not all(isinstance(k, str) and k for k in keys):
            raise ConfigurationError(f"group keys are non-empty str: {keys!r}")
        args: list[Value] = ["1"] if keys is None else ["0", *keys]
        return [self.fence_key, *self.group_keys(group)], args

    def _group_state(self, reply: Sequence[Any]) -> GroupState:
        # (What is stored, as it is: a member restarted empty reads as marks 0, for the group
        # to repair; see _group_outcome.)
        lock, hw, epoch, stamps, data, holder = reply
        mark = parse_state([lock or None, hw or None], self.resource)
        at = _text(epoch)
        if not at.isascii() or not at.isdigit() or len(at) > 19:
            raise CorruptMarkError(self.resource, f"the group's epoch mark {at[:40]!r}")
        values = {_text(data[i]): _bytes(data[i + 1]) for i in range(0, len(data), 2)}
        items: list[GroupItem] = []
        for i in range(0, len(stamps), 2):
            key = _text(stamps[i])
            items.append((key, _text(stamps[i + 1]), values.get(key)))
        state = GroupState(mark.value if mark else 0, int(at), _text(holder) or None, items)
        return checked_group_state(state, self.resource)

    def _group_reader(self) -> Any:
        """The read script, through the caller's client (a read may be re-sent)."""
        if self._reader is None:
            self._reader = self._client.register_script(self.group_read_script)
        return self._reader

    # Script texts, as attributes so a test can plant a bug in a subclass.
    set_script: str = SET_SCRIPT
    hset_script: str = HSET_SCRIPT
    del_script: str = DEL_SCRIPT
    command_script: str = COMMAND_SCRIPT
    group_apply_script: str = GROUP_APPLY_SCRIPT
    group_epoch_script: str = GROUP_EPOCH_SCRIPT
    group_read_script: str = GROUP_READ_SCRIPT

    @staticmethod
    def eval_script(lua_body: str) -> str:
        return eval_script(lua_body)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(resource={self.resource!r}, fence_key={self.fence_key!r})"


class RedisGuard(_GuardBase):
    """Fenced writes through a synchronous ``redis.Redis`` (or ``redis.RedisCluster``).

    ``lock``: the lock whose tokens are accepted; tokens of any other lock raise
    :class:`~fenced.WrongLockError` before anything is sent. With None, the resource remembers
    the lock of the first token it accepts and refuses other locks' tokens itself.
    ``fence_key``: where the mark lives (default ``fenced:hw:{resource}``).

    Every write raises :class:`~fenced.StaleTokenError` (nothing written) if the resource has
    accepted a higher token, :class:`~fenced.InvalidTokenError` for a malformed token, and
    :class:`~fenced.BackendUnavailable` when Redis cannot be reached.
    """

    @lock_keyword()
    def __init__(
        self,
        client: redis.Redis | redis.RedisCluster,
        resource: str,
        *,
        lock: str | None = None,
        fence_key: str | None = None,
        verify: TokenVerifier | None = None,
    ) -> None:
        super().__init__(client, resource, lock, fence_key=fence_key, verify=verify)

    def _run(self, call: GuardedCall) -> Any:
        script: Script = self._script(call.script)
        try:
            reply = script(keys=call.keys, args=call.args)
        except _NATIVE_ERRORS as exc:
            raise self._failed(call, exc) from exc
        except (ValueError, AttributeError) as exc:
            # redis-py reading a socket that another thread closed meanwhile ("I/O operation
            # on closed file", its parser's buffer gone): the request may have been applied.
            raise _cut(self.resource, exc) from exc
        self._outcome(call)
        return reply

    @token_keyword("px")
    def set(self, key: Key, value: Value, *, token: TokenLike, px: int | None = None) -> bool:
        """``SET key value [PX px]`` if ``token`` is not stale."""
        return bool(self._run(self._set_call(key, value, token, px)))

    @token_keyword()
    def hset(self, key: Key, mapping: Mapping[Key, Value], *, token: TokenLike) -> int:
        """``HSET key field value ...`` if ``token`` is not stale; the number of new fields."""
        return int(self._run(self._hset_call(key, mapping, token)))

    def delete(self, *keys: Key, token: TokenLike) -> int:
        """``DEL keys...`` if ``token`` is not stale; the number of keys removed."""
        return int(self._run(self._delete_call(keys, token)))

    def command(self, name: str, key: Key, *args: Value, token: TokenLike) -> Any:
        """Any write of :data:`COMMANDS` (one key, the first argument), if ``token`` is not
        stale: ``guard.command("LTRIM", "{q}:log", 0, 999, token=t)``; its own reply."""
        return self._run(self._command_call(name, key, args, token))

    def incrby(self, key: Key, amount: int = 1, *, token: TokenLike) -> int:
        """``INCRBY key amount`` if ``token`` is not stale; the new value."""
        return int(self._run(self._command_call("INCRBY", key, [amount], token)))

    def hincrby(self, key: Key, field: Key, amount: int = 1, *, token: TokenLike) -> int:
        """``HINCRBY key field amount`` if ``token`` is not stale; the new value."""
        return int(self._run(self._command_call("HINCRBY", key, [field, amount], token)))

    def rpush(self, key: Key, *values: Value, token: TokenLike) -> int:
        """``RPUSH key values...`` if ``token`` is not stale; the list's new length."""
        return int(self._run(self._command_call("RPUSH", key, values, token)))

    def xadd(
        self,
        key: Key,
        fields: Mapping[Key, Value],
        *,
        token: TokenLike,
        id: str = "*",
    ) -> str:
        """``XADD key id field value ...`` if ``token`` is not stale; the entry's id."""
        return _text(self._run(self._command_call("XADD", key, _xadd_args(fields, id), token)))

    def expire(self, key: Key, seconds: int, *, token: TokenLike) -> bool:
        """``EXPIRE key seconds`` if ``token`` is not stale; False if the key does not exist."""
        return bool(self._run(self._command_call("EXPIRE", key, [seconds], token)))

    @token_keyword()
    def eval(
        self,
        lua_body: str,
        keys: Sequence[Key],
        args: Sequence[Value],
        *,
        token: TokenLike,
    ) -> Any:
        """Run your Lua, after the fence check, in the same script; return its return value.

        Your body sees its own ``KEYS`` and ``ARGV`` (the fence key and token are not in
        them). It must only touch the keys it is given; Redis does not roll back, so raise
        errors before your first write.
        """
        return self._run(self._eval_call(lua_body, keys, args, token))

    def fence(self, token: TokenLike) -> None:
        """Raise the mark to ``token`` and write nothing else (``fence=`` on acquire): every
        lower token is refused from now on. StaleTokenError if a higher one was accepted."""
        self._run(self._eval_call("return 0", [], [], token))

    def high_water(self) -> FencingToken | None:
        """The highest token accepted so far (None if none)."""
        seen = self._seen
        try:
            reply = self._client.hmget(self.fence_key, ["lock", "hw"])
        except _NATIVE_ERRORS as exc:
            raise map_error(exc, self.resource) from exc
        return self._seen_mark(parse_state(reply, self.resource), seen)

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
        """One change of a replicated group's member (:class:`fenced.replicated.RedisMember`),
        ONE script: ``epoch`` checked against the group's epoch mark
        (:class:`~fenced.StaleEpochError`) and that mark against ``since``
        (:class:`~fenced.MemberBehindError`), ``token`` against the lock mark as by every
        guarded write; then both marks raised, the token kept as the holder, every item
        forgotten first if ``reset``, and each ``(key, stamp, value)`` written if its stamp is
        newer than the stored one. A refusal writes nothing. ``token`` None: the epoch mark
        only (and ``reset``), no items."""
        call = self._group_call(token, group, epoch, items, reset, since)
        self._group_outcome(self._run(call), epoch, since)

    def read_group(self, *, group: str, keys: Sequence[str] | None = None) -> GroupState:
        """A group member's marks, holder and items (of ``keys``; None: all), at one instant."""
        fence_keys, args = self._group_read_args(group, keys)
        try:
            reply = self._group_reader()(keys=fence_keys, args=args)
        except _NATIVE_ERRORS as exc:
            raise map_error(exc, self.resource) from exc
        return self._group_state(reply)

    def check_server(self) -> None:
        """Raise :class:`~fenced.UnsafeBackendError` if Redis may evict the fence key."""
        try:
            policy = self._client.config_get("maxmemory-policy")
        except _NATIVE_ERRORS as exc:
            raise map_error(exc, self.resource) from exc
        check_policy(_text(next(iter(policy.values()), "")))

    def close(self) -> None:
        """Close the idle connections of the guard's no-retry pool (the client you passed
        stays open).

        That pool is shared by every guard of one client (see :func:`_no_retry_client`), so a
        connection in use is another guard's write in flight: it is left alone (closing it
        cut that write, outcome unknown). A guard that writes again after ``close`` simply
        reconnects."""
        if self._writer is not self._client:
            self._writer.connection_pool.disconnect(inuse_connections=False)

    def __enter__(self) -> RedisGuard:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncRedisGuard(_GuardBase):
    """:class:`RedisGuard` for ``redis.asyncio.Redis`` (or ``redis.asyncio.RedisCluster``)."""

    @lock_keyword()
    def __init__(
        self,
        client: redis.asyncio.Redis | redis.asyncio.RedisCluster,
        resource: str,
        *,
        lock: str | None = None,
        fence_key: str | None = None,
        verify: TokenVerifier | None = None,
    ) -> None:
        super().__init__(client, resource, lock, fence_key=fence_key, verify=verify)

    async def _run(self, call: GuardedCall) -> Any:
        script: AsyncScript = self._script(call.script)
        try:
            reply = await script(keys=call.keys, args=call.args)
        except _NATIVE_ERRORS as exc:
            raise self._failed(call, exc) from exc
        except (ValueError, AttributeError) as exc:  # (see RedisGuard._run)
            raise _cut(self.resource, exc) from exc
        self._outcome(call)
        return reply

    @token_keyword("px")
    async def set(self, key: Key, value: Value, *, token: TokenLike, px: int | None = None) -> bool:
        """See :meth:`RedisGuard.set`."""
        return bool(await self._run(self._set_call(key, value, token, px)))

    @token_keyword()
    async def hset(self, key: Key, mapping: Mapping[Key, Value], *, token: TokenLike) -> int:
        """See :meth:`RedisGuard.hset`."""
        return int(await self._run(self._hset_call(key, mapping, token)))

    async def delete(self, *keys: Key, token: TokenLike) -> int:
        """See :meth:`RedisGuard.delete`."""
        return int(await self._run(self._delete_call(keys, token)))

    async def command(self, name: str, key: Key, *args: Value, token: TokenLike) -> Any:
        """See :meth:`RedisGuard.command`."""
        return await self._run(self._command_call(name, key, args, token))

    async def incrby(self, key: Key, amount: int = 1, *, token: TokenLike) -> int:
        """See :meth:`RedisGuard.incrby`."""
        return int(await self._run(self._command_call("INCRBY", key, [amount], token)))

    async def hincrby(self, key: Key, field: Key, amount: int = 1, *, token: TokenLike) -> int:
        """See :meth:`RedisGuard.hincrby`."""
        return int(await self._run(self._command_call("HINCRBY", key, [field, amount], token)))

    async def rpush(self, key: Key, *values: Value, token: TokenLike) -> int:
        """See :meth:`RedisGuard.rpush`."""
        return int(await self._run(self._command_call("RPUSH", key, values, token)))

    async def xadd(
        self,
        key: Key,
        fields: Mapping[Key, Value],
        *,
        token: TokenLike,
        id: str = "*",
    ) -> str:
        """See :meth:`RedisGuard.xadd`."""
        args = _xadd_args(fields, id)
        return _text(await self._run(self._command_call("XADD", key, args, token)))

    async def expire(self, key: Key, seconds: int, *, token: TokenLike) -> bool:
        """See :meth:`RedisGuard.expire`."""
        return bool(await self._run(self._command_call("EXPIRE", key, [seconds], token)))

    @token_keyword()
    async def eval(
        self,
        lua_body: str,
        keys: Sequence[Key],
        args: Sequence[Value],
        *,
        token: TokenLike,
    ) -> Any:
        """See :meth:`RedisGuard.eval`."""
        return await self._run(self._eval_call(lua_body, keys, args, token))

    async def fence(self, token: TokenLike) -> None:
        """See :meth:`RedisGuard.fence`."""
        await self._run(self._eval_call("return 0", [], [], token))

    async def high_water(self) -> FencingToken | None:
        """See :meth:`RedisGuard.high_water`."""
        seen = self._seen
        try:
            reply = await self._client.hmget(self.fence_key, ["lock", "hw"])
        except _NATIVE_ERRORS as exc:
            raise map_error(exc, self.resource) from exc
        return self._seen_mark(parse_state(reply, self.resource), seen)

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
        """See :meth:`RedisGuard.apply_group`."""
        call = self._group_call(token, group, epoch, items, reset, since)
        self._group_outcome(await self._run(call), epoch, since)

    async def read_group(self, *, group: str, keys: Sequence[str] | None = None) -> GroupState:
        """See :meth:`RedisGuard.read_group`."""
        fence_keys, args = self._group_read_args(group, keys)
        try:
            reply = await self._group_reader()(keys=fence_keys, args=args)
        except _NATIVE_ERRORS as exc:
            raise map_error(exc, self.resource) from exc
        return self._group_state(reply)

    async def check_server(self) -> None:
        """See :meth:`RedisGuard.check_server`."""
        try:
            policy = await self._client.config_get("maxmemory-policy")
        except _NATIVE_ERRORS as exc:
            raise map_error(exc, self.resource) from exc
        check_policy(_text(next(iter(policy.values()), "")))

    async def aclose(self) -> None:
        """See :meth:`RedisGuard.close`."""
        if self._writer is not self._client:
            # Idle connections only (see there), and taken out of the pool first: redis-py's
            # disconnect(inuse_connections=False) awaits each close while the connection is
            # still on offer, and another guard's write took it and was cut.
            pool = self._writer.connection_pool
            idle = list(pool._available_connections)
            pool._available_connections.clear()  # (no await since the copy: nothing took one)
            await asyncio.gather(*(c.disconnect() for c in idle), return_exceptions=True)

    async def __aenter__(self) -> AsyncRedisGuard:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
