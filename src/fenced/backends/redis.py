"""``redis://host:port/db``: a token source on one Redis server (redis-py asyncio, Lua scripts).

Every state change is one Lua script, so it is atomic on the server:

* **acquire** grants the lock if it is free and nobody is waiting ahead of the caller, taking
  the token from a per-lock counter with ``INCR`` *in the same script*; the counter key is never
  given a TTL and never deleted, so tokens only grow. The holder key (``"<token> <ttl>
  <request id>"``) carries a ``PX`` expiry judged by the server's clock.
* Blocked callers wait FIFO in a per-lock sorted set scored by an arrival number, with a second
  sorted set of heartbeat deadlines (server time), so a waiter that died is skipped. A waiter
  blocks in ``BLPOP`` on its own list. When the lock becomes free (release, an abandoned
  acquire, or an expired holder noticed by anyone), the script grants it straight to the first
  live waiter and pushes the token onto that waiter's list: no polling, and no extra round
  trip for the new holder. A waiter also re-checks at the holder's expiry time and every third
  of its heartbeat period.
* **renew** extends the expiry only if the holder is still this grant (else LeaseLostError);
  **release** deletes the holder only if request id and token match, then hands off.

Redis is *not* a linearizable token source: replication is asynchronous, so a failover can lose
an acknowledged ``INCR`` and hand the same token out twice (Kleppmann, "How to do distributed
locking", 2016). The backend therefore never declares LINEARIZABLE, and it declares DURABLE
only for the configuration it checks on connect (and again after reconnecting): ``appendonly
yes``, ``appendfsync always``, ``no-appendfsync-on-rewrite no``, no replicas, ``role:master``,
and the ``noeviction`` memory policy. Anything else is refused with
:class:`~fenced.UnsafeBackendError` unless ``allow_unsafe_durability=true`` is given, which
logs a warning. See ``docs/backend-redis.md``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, Final, TypeVar
from urllib.parse import SplitResult, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .._clients.redis_errors import DENIED, NATIVE, kind
from .._clients.redis_sockets import NO_MAINT, socket_checked
from .._core import clock as _clock
from .._core.backend import (
    Backend,
    Characteristic,
    Grant,
    LockStatus,
    LostCallback,
    Record,
    UnsureReleases,
    call_bound,
    lock_timeout,
    wait_budget,
)
from .._core.errors import (
    AccessDenied,
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    FencedError,
    LeaseLostError,
    RecordConflict,
    UnsafeBackendError,
)
from .._core.options import Option
from .._core.token import FencingToken

__all__ = ["RedisBackend", "check_server_safety"]

"""A wrong or missing password, a user disabled or without the ACL permissions: no retry mends
them (redis-py makes AuthenticationError a ConnectionError, which connect() would retry)."""

SWAP_RECORD_LUA: Final = """\
local v = tonumber(redis.call('HGET', KEYS[1], 'v') or '0')
if v ~= tonumber(ARGV[1]) then return {0, v} end
redis.call('HSET', KEYS[1], 'v', v + 1, 'value', ARGV[2])
return {1, v + 1}
"""
"""Compare-and-set of a record (a hash: ``v`` its version, ``value``): {1, new version}, or
{0, the version found} with nothing written."""

logger = logging.getLogger("fenced.redis")

T = TypeVar("T")

DEFAULT_PREFIX: Final = "fenced:"
DEFAULT_WAITER_HEARTBEAT: Final = 3.0
"""Seconds after which a waiter that has not re-checked is considered dead and skipped."""


def _first_line(exc: BaseException) -> str:
    """A server's message cut at its first sentence (Redis explains NOAUTH at length)."""
    text = " ".join(str(exc).split())
    return text.split(", otherwise")[0]


def _no_braces(value: str) -> str | None:
    return "must be text without braces" if "{" in value or "}" in value else None


def _cert_reqs(value: str) -> str | None:
    return (
        None if value in ("none", "optional", "required") else "must be none, optional or required"
    )


# The backend's own options, then redis-py's, checked here and passed on as keywords.
_OWN_OPTIONS: Final = frozenset({"allow_unsafe_durability", "key_prefix", "waiter_heartbeat"})
_OPTIONS: Final = MappingProxyType(
    {
        "allow_unsafe_durability": Option("bool", False),
        "key_prefix": Option("str", DEFAULT_PREFIX, check=_no_braces),
        "waiter_heartbeat": Option("number", DEFAULT_WAITER_HEARTBEAT, low=0.1, high=60),
        "db": Option("int", low=0, high=1_000_000),
        "socket_timeout": Option("number", 10.0, low=0, low_open=True, high=3600),
        "socket_connect_timeout": Option("number", 5.0, low=0, low_open=True, high=3600),
        "username": Option("str"),
        "password": Option("str"),
        "client_name": Option("str"),
        "max_connections": Option("int", low=1, high=100_000),
        "ssl_ca_certs": Option("str"),
        "ssl_certfile": Option("str"),
        "ssl_keyfile": Option("str"),
        "ssl_cert_reqs": Option("str", check=_cert_reqs),
        "ssl_check_hostname": Option("bool"),
    }
)


# The lock's keys and the scripts' full layout (the queue's code works on it; see each script
# for what it is given):
# KEYS: 1 token counter (never expires), 2 holder ("<token> <ttl ms> <request id>", then
#       "\n<owner>" if the holder described itself; PX expiry), 3 queue (zset rid -> arrival
#       number), 4 heartbeats (zset rid -> deadline, server ms), 5 arrival counter, 6 waiters'
#       ttls (hash rid -> ttl ms), 7 waiters' owners (hash rid -> owner, for a hand-off)
# ARGV: 1 request id, 2 ttl ms, 3 mode, 4 heartbeat ms, 5 wake-list key prefix
# (fenced 0.1's scripts pass six keys and read "\n<owner>" as part of a request id that is
# never theirs: both versions can share a server while it is upgraded.)
_HOLDER: Final = """
local function holder()
  local v = redis.call('GET', KEYS[2])
  if not v then return nil end
  local token, ttl, rid, owner = string.match(v, '^(%d+) (%d+) ([^\\n]*)\\n?(.*)$')
  return rid, token, ttl, owner
end
"""

# A grant's token: the lock's counter, incremented; as text (exact beyond 2^53). In the
# prelude's grant() and the uncontended fast path alike (Lua: n and token are set).
_NEXT_TOKEN: Final = """  local n = redis.call('INCR', KEYS[1])
  local token
  if n < 9007199254740992 then
    token = string.format('%d', n)
  else
    token = redis.call('GET', KEYS[1])  -- beyond 2^53 a Lua number is not exact
  end
"""

# The prelude forgets waiters whose heartbeat ran out (by the server clock), and defines
# hand_off(): when the lock is free, grant it straight to the first live waiter (its token
# from the counter, its own ttl) and push "token:ttl" onto that waiter's wake list, where its
# BLPOP picks it up - the hand-off costs the new holder no round trip of its own. With nobody
# waiting, it costs one ZCARD.
_PRELUDE: Final = (
    """
local now_ms = nil
local function now()
  if not now_ms then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now_ms
end
local function forget(who)
  redis.call('ZREM', KEYS[3], who)
  redis.call('ZREM', KEYS[4], who)
  redis.call('HDEL', KEYS[6], who)
  redis.call('HDEL', KEYS[7], who)
end
local has_waiters = redis.call('ZCARD', KEYS[3]) > 0
if has_waiters then
  local dead = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now(), 'LIMIT', 0, 100)
  for _, who in ipairs(dead) do forget(who) end
end
local function first()
  while has_waiters do
    local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
    if not head then return nil end
    local ttl = redis.call('HGET', KEYS[6], head)
    if ttl and redis.call('ZSCORE', KEYS[4], head) then return head, ttl end
    forget(head)
  end
  return nil
end
local function grant(who, ttl, owner)
"""
    + _NEXT_TOKEN
    + """  local value = token .. ' ' .. ttl .. ' ' .. who
  if owner and owner ~= '' then value = value .. '\\n' .. owner end
  redis.call('SET', KEYS[2], value, 'PX', ttl)
  return token
end
local function hand_off()
  local head, ttl = first()
  if head then
    local owner = redis.call('HGET', KEYS[7], head)
    forget(head)
    local token = grant(head, ttl, owner)
    local k = ARGV[5] .. head
    redis.call('DEL', k)
    redis.call('RPUSH', k, token .. ':' .. ttl)
    redis.call('PEXPIRE', k, ttl)
  end
end
"""
)

# The uncontended case first, as straight-line code: a free lock with nobody queued is granted
# exactly as grant() would, before the script makes the queue's functions (Lua builds a closure
# per local function per run). Server time is what each code path costs right after AOF
# `always`'s fsync, i.e. cold (docs/backend-redis.md, "Server time"): so one EXISTS answers
# both "free?" and "nobody queued?", and the reply is the bare token (an integer: a table reply
# costs as much as a command), the table form only where a Lua number is not exact (2^53).
# The scripts on the uncontended path get only the keys and arguments that path uses (Redis
# builds the KEYS and ARGV tables element by element on every call: over a quarter of an
# acquire+release's server instructions went there with seven of each); the other paths
# derive the rest of the layout above from the first key (same hash tag, same slot).
_FREE_FAST: Final = (
    """
local ttl = ARGV[2]
if redis.call('EXISTS', KEYS[2], KEYS[3]) == 0 then
"""
    + _NEXT_TOKEN
    + """  local value = token .. ' ' .. ttl .. ' ' .. ARGV[1]
  if ARGV[3] ~= '' then value = value .. '\\n' .. ARGV[3] end
  redis.call('SET', KEYS[2], value, 'PX', ttl)
  if n < 9007199254740992 then return n end
  return {1, token, tonumber(ttl), tonumber(ttl)}
end
"""
)


def _full_layout(key: str, strip: int, args: str) -> str:
    """Lua that rebinds KEYS and ARGV to the full layout (see above) for the code after it,
    from ``key`` (an expression naming one of the lock's keys, ``strip`` characters past its
    base) and ``args`` (the six arguments, as Lua expressions over ``base``)."""
    return f"""
local base = string.sub({key}, 1, -{strip + 1})
local KEYS = {{base .. 'token', base .. 'holder', base .. 'queue', base .. 'hb', base .. 'seq',
  base .. 'ttls', base .. 'owners'}}
local ARGV = {{{args}}}
"""


# KEYS: 1 token counter, 2 holder, 3 queue. ARGV: 1 request id, 2 ttl ms, 3 the caller's owner
# text, 4 heartbeat ms ('wait': join the queue, or refresh the caller's heartbeat, if not
# granted) or 'final' (the deadline has passed: leave the queue instead).
# Returns the token alone (an integer) for a fresh grant of the full ttl; {1, token, pttl, ttl}
# when the caller holds the lock otherwise (a hand-off it has not read yet, a retried request,
# a token past 2^53), else {0, holder pttl, queue length}.
ACQUIRE_LUA: Final = (
    _FREE_FAST
    + _full_layout(
        "KEYS[1]",
        len("token"),
        "ARGV[1], ARGV[2], ARGV[4] == 'final' and 'final' or 'wait', ARGV[4],"
        " base .. 'wake:', ARGV[3]",
    )
    + _HOLDER
    + """
local rid = ARGV[1]
local h_rid, h_token, h_ttl = holder()
if h_rid == rid then
  return {1, h_token, redis.call('PTTL', KEYS[2]), tonumber(h_ttl)}
end
"""
    + _PRELUDE
    + """
if not h_rid then
  local head = first()
  if not head or head == rid then
    if head then forget(rid) end
    local token = grant(rid, ARGV[2], ARGV[6])
    return {1, token, tonumber(ARGV[2]), tonumber(ARGV[2])}
  end
  hand_off()
end
-- Not the holder: a hand-off pushed to us earlier has expired since; drop it before we block.
redis.call('DEL', ARGV[5] .. rid)
if ARGV[3] == 'wait' then
  if not redis.call('ZSCORE', KEYS[3], rid) then
    redis.call('ZADD', KEYS[3], redis.call('INCR', KEYS[5]), rid)
  end
  redis.call('ZADD', KEYS[4], now() + tonumber(ARGV[4]), rid)
  redis.call('HSET', KEYS[6], rid, ARGV[2])
  if ARGV[6] ~= '' then redis.call('HSET', KEYS[7], rid, ARGV[6]) end
else
  forget(rid)
end
return {0, redis.call('PTTL', KEYS[2]), redis.call('ZCARD', KEYS[3])}
"""
)

# An abandoned acquire (cancelled, failed) leaves the queue, and gives back a grant that was
# made for it while it was not listening; then a free lock goes to the next waiter.
# KEYS and ARGV: the full layout (ARGV[2] to [4] unused).
LEAVE_LUA: Final = (
    _HOLDER
    + """
local h_rid = holder()
"""
    + _PRELUDE
    + """
forget(ARGV[1])
redis.call('DEL', ARGV[5] .. ARGV[1])
if h_rid == ARGV[1] then
  redis.call('DEL', KEYS[2])
  h_rid = nil
end
if not h_rid then hand_off() end
return 1
"""
)


# The holder check of release and renew. ARGV[1]: the holder value this client was granted
# with (or ''), so that the usual check is one string comparison (Lua strings are interned: a
# pointer comparison) where a parse costs the pattern matcher's code, cold. Any other value (a
# grant written by another version's script, a release without its grant's value) is parsed
# and checked: request id and token, from ARGV[1] or else from ARGV[2] and ARGV[3].
def _is_holder(otherwise: str) -> str:
    """Lua that runs ``otherwise`` unless KEYS[1] holds this grant (see above)."""
    return f"""
local v = redis.call('GET', KEYS[1])
if v ~= ARGV[1] then
  if not v then
    {otherwise}
  else
    local want_token, want_rid = ARGV[3], ARGV[2]
    if ARGV[1] ~= '' then
      local t, _, r = string.match(ARGV[1], '^(%d+) (%d+) ([^\\n]*)')
      want_token, want_rid = t, r
    end
    local h_token, _, h_rid = string.match(v, '^(%d+) (%d+) ([^\\n]*)\\n?(.*)$')
    if h_rid ~= want_rid or h_token ~= want_token then
      {otherwise}
    end
  end
end
"""


# Not (or no longer) the holder (``v`` is false): was this grant released by an earlier
# attempt of this very release, whose reply was lost (ARGV[2] 'retry': that attempt raised,
# UnsureReleases)? Its holder's own release (the grant's value in ARGV[1]) renames the holder
# key to "released", its remaining ttl with it: that key naming this grant (the same value,
# or the same token and request id) says so. Not a retry: 0 (already released). A grant that
# expired or was taken over leaves none; a force release (no value: ARGV[1] is '') leaves none
# and never finds one: its holder must hear that it lost the lock.
_RELEASED_BEFORE: Final = """
if v == false then
  if ARGV[1] == '' or ARGV[2] ~= 'retry' then return 0 end
  local r = redis.call('GET', string.sub(KEYS[1], 1, -7) .. 'released')
  if r == ARGV[1] then return 1 end
  if not r then return 0 end
  local t, _, id = string.match(ARGV[1], '^(%d+) (%d+) ([^\\n]*)')
  local r_t, _, r_id = string.match(r, '^(%d+) (%d+) ([^\\n]*)')
  if r_t and r_t == t and r_id == id then return 1 end
  return 0
end
"""

# KEYS: 1 holder, 2 queue. ARGV: 1 the grant's holder value or '', then (only without it) 2
# request id, 3 token; with it, 2 'retry' for a retry (see _RELEASED_BEFORE). Returns 1 if it
# was held (and is now released, or was by this release's earlier attempt), else 0. With nobody
# queued it returns before making the queue's functions (see _FREE_FAST).
RELEASE_LUA: Final = (
    _is_holder("v = false")
    + _RELEASED_BEFORE
    + """
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
else  -- (a release by the grant's own value: remembered for its retry, see _RELEASED_BEFORE)
  redis.call('RENAME', KEYS[1], string.sub(KEYS[1], 1, -7) .. 'released')
end
if redis.call('EXISTS', KEYS[2]) == 0 then return 1 end
"""
    + _full_layout("KEYS[1]", len("holder"), "'', '0', 'release', '0', base .. 'wake:', ''")
    + _PRELUDE
    + """
hand_off()
return 1
"""
)

# KEYS: 1 holder. ARGV: 1 the grant's holder value or '', 2 request id, 3 token (as in
# RELEASE_LUA), 4 ttl ms.
RENEW_LUA: Final = (
    _is_holder("return 0")
    + """
local token, ttl, rest
if v then token, ttl, rest = string.match(v, '^(%d+) (%d+) (.*)$') end
if not token or ttl == ARGV[4] then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
else  -- (a new ttl is the grant's own from now: status reports it, a resume renews for it)
  redis.call('SET', KEYS[1], token .. ' ' .. ARGV[4] .. ' ' .. rest, 'PX', ARGV[4])
end
return 1
"""
)

# KEYS (reads only): 1 token counter, 2 holder, 3 heartbeats: the keys it reads (see _FREE_FAST).
STATUS_LUA: Final = (
    _HOLDER
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local h_rid, h_token, h_ttl, h_owner = holder()
local pttl = -1
if h_rid then pttl = redis.call('PTTL', KEYS[2]) end
local last = redis.call('GET', KEYS[1])
local waiters = redis.call('ZCOUNT', KEYS[3], '(' .. now, '+inf')
return {h_rid or '', h_token or '', pttl, last or '', waiters, h_owner or '', h_ttl or ''}
"""
)


async def check_server_safety(client: aioredis.Redis) -> list[str]:
    """What keeps this server from being a durable token source (empty: nothing).

    Checks ``appendonly yes`` + ``appendfsync always`` and ``no-appendfsync-on-rewrite no``
    (an acknowledged ``INCR`` is on disk),
    ``role:master`` with ``connected_slaves:0`` (no replica a failover could promote with an
    older counter), and ``maxmemory-policy noeviction`` (``allkeys-*`` can evict the counter, ``volatile-*`` a
    holder's key).
    """
    try:
        config: dict[str | None, str | None] = await client.config_get("*")
    except rexc.ResponseError as exc:
        if isinstance(exc, DENIED):  # (an ACL: AccessDenied, said as such by the caller)
            raise
        return [f"cannot read the server configuration to verify durability (CONFIG GET: {exc})"]
    info: dict[str, Any] = await client.info("replication")
    persistence: dict[str, Any] = await client.info("persistence")
    return _safety_problems(config, {**info, **persistence})


async def _connection_safety(conn: Any) -> list[str]:
    """:func:`check_server_safety` on one connection just made (before anything else is sent
    on it): the same rule, read with the connection's own commands."""
    await conn.send_command("CONFIG", "GET", "*")
    try:
        reply = await conn.read_response()
    except rexc.ResponseError as exc:
        if isinstance(exc, DENIED):
            raise
        return [f"cannot read the server configuration to verify durability (CONFIG GET: {exc})"]
    config = (
        dict(reply) if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=True))
    )
    info: dict[str, Any] = {}
    for section in ("replication", "persistence"):
        await conn.send_command("INFO", section)
        text = await conn.read_response()
        for line in str(text).splitlines():
            key, colon, value = line.partition(":")
            if colon and not key.startswith("#"):
                info[key] = value
    return _safety_problems(config, info)


def _safety_problems(config: Mapping[Any, Any], info: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    appendonly = config.get("appendonly")
    fsync = config.get("appendfsync")
    if appendonly != "yes":
        problems.append(f"appendonly is {appendonly!r} (needs 'yes')")
    if fsync != "always":
        problems.append(
            f"appendfsync is {fsync!r} (needs 'always'; acknowledged tokens can be lost on a crash)"
        )
    if config.get("no-appendfsync-on-rewrite") == "yes":
        problems.append(
            "no-appendfsync-on-rewrite is 'yes' (writes are not fsynced during a rewrite)"
        )
    policy = config.get("maxmemory-policy") or "noeviction"
    if policy.startswith("allkeys-"):
        problems.append(f"maxmemory-policy is {policy!r} (it can evict the token counter)")
    elif policy != "noeviction":
        # volatile-* cannot evict the counter, but can evict a holder key under memory
        # pressure: the lock would be free while its holder still counts on its ttl.
        problems.append(f"maxmemory-policy is {policy!r} (it can evict a holder's key early)")
    # Appendonly turned on at run time: until the first rewrite ends, writes go to a file the
    # AOF's manifest does not list yet, and a crash loses them. (A first rewrite on a server
    # started with an empty AOF reads the same: refused while it runs.)
    if (
        appendonly == "yes"
        and str(info.get("aof_rewrite_in_progress", "0")) == "1"
        and str(info.get("aof_last_rewrite_time_sec", "-1")) == "-1"
        and str(info.get("aof_base_size", "0")) == "0"
    ):
        problems.append(
            "the append-only file's first rewrite is still running (appendonly turned on at "
            "run time?): writes are not in a durable AOF until it ends"
        )
    if str(info.get("aof_last_write_status", "ok")) != "ok":
        problems.append("the server's last write to its append-only file failed")
    role = info.get("role")
    if role != "master":
        problems.append(f"the server's role is {role!r} (needs 'master')")
    slaves = int(info.get("connected_slaves", 0))
    if slaves:
        problems.append(
            f"{slaves} replica(s) attached (replication is asynchronous: a failover can reuse tokens)"
        )
    return problems


class _RefusedOption(rexc.RedisError):
    """The server refused the connection's handshake for an option of the URL (``CLIENT
    SETNAME`` with a name it cannot take, ``SELECT`` of a database it does not have):
    configuration (raised from :meth:`RedisBackend._on_connect`, turned into
    :class:`~fenced.ConfigurationError` by ``_call``)."""


class _UnsafeServer(rexc.RedisError):
    """A connection just made found the server unsafe: the connection is dropped, nothing is
    sent on it (raised from :meth:`RedisBackend._on_connect`, turned into
    :class:`~fenced.UnsafeBackendError` by ``_call``)."""


async def _own_script(
    conn: Any, script: Any, keys: Sequence[str], args: Sequence[str | int]
) -> Any:
    """One of fenced's scripts on the scripts' own connection (connected first if it is not):
    ``EVALSHA``, and on ``NOSCRIPT`` (the server's script cache emptied: a restart, ``SCRIPT
    FLUSH``; it did not run) ``SCRIPT LOAD`` and ``EVALSHA`` again, as redis-py's Script
    does."""
    if not conn.is_connected:
        await conn.connect()
    command = ("EVALSHA", script.sha, len(keys), *keys, *args)
    await conn.send_packed_command(_packed(command))
    try:
        return await conn.read_response()
    except rexc.NoScriptError:
        await conn.send_command("SCRIPT", "LOAD", script.script)
        script.sha = await conn.read_response()
        await conn.send_command("EVALSHA", script.sha, *command[2:])
        return await conn.read_response()


def _packed(command: Sequence[str | int]) -> bytes:
    """``command`` in the Redis protocol (RESP): what redis-py's ``pack_command`` makes of
    text (UTF-8) and integers, without its encoder's type checks per argument, about a tenth
    of a script call's client CPU. fenced's scripts take only text and integers."""
    parts = [b"*%d\r\n" % len(command)]
    for arg in command:
        if isinstance(arg, str):  # (a str subclass too: an enum.StrEnum request id)
            data = str.encode(arg)
        elif type(arg) is int:
            data = b"%d" % arg
        else:  # (a float would lose its fraction to %d: never guess)
            raise TypeError(f"a script argument is text or an int, not {type(arg).__name__}")
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


async def _never() -> bool:
    return False


def _granted_value(grant: Grant) -> str:
    """The holder value ``grant`` was made with, built from the grant itself (so it names its
    token and request id; its handle holds the rest), if this backend made it; else ''. The
    scripts compare it whole before they parse (see RELEASE_LUA)."""
    if not isinstance(grant.handle, str):
        return ""
    ttl_ms = max(1, round(grant.ttl * 1000))
    return f"{grant.token.value} {ttl_ms} {grant.request_id}{grant.handle}"


def _holder_args(grant: Grant, retry: bool = False) -> tuple[str | int, ...]:
    """ARGV of the holder check (_is_holder): the grant's holder value alone (it names the
    request id and token; then 'retry' for a release's retry), or '', request id and token
    when there is none."""
    value = _granted_value(grant)
    if not value:
        return ("", grant.request_id, grant.token.value)
    return (value, "retry") if retry else (value,)


class RedisBackend(Backend):
    """A Redis token source: FIFO, server-side expiry, durable only when verified so."""

    scheme: ClassVar[str] = "redis"
    option_schema = _OPTIONS
    characteristics: ClassVar[frozenset[Characteristic]] = frozenset(
        {
            Characteristic.DURABLE,
            Characteristic.FIFO,
            Characteristic.DISTRIBUTED,
            Characteristic.SERVER_EXPIRY,
        }
    )

    caller_waits: ClassVar[bool] = True  # (sync callers wait for replies themselves: no hop)

    # The Lua sources, as class attributes so a test can plant a broken variant in a subclass.
    acquire_lua: ClassVar[str] = ACQUIRE_LUA
    leave_lua: ClassVar[str] = LEAVE_LUA
    release_lua: ClassVar[str] = RELEASE_LUA
    renew_lua: ClassVar[str] = RENEW_LUA
    status_lua: ClassVar[str] = STATUS_LUA

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        prefix: str,
        waiter_heartbeat: float,
        allow_unsafe_durability: bool,
        where: str,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._heartbeat = waiter_heartbeat
        self._heartbeat_ms = max(1, round(waiter_heartbeat * 1000))
        # A blocked waiter re-checks (and so heart-beats) this often; the blocking read must
        # also come back well within the client's socket timeout.
        socket_timeout = client.connection_pool.connection_kwargs.get("socket_timeout") or 10.0
        self._recheck = min(waiter_heartbeat / 3, socket_timeout / 2)
        self._socket_timeout: float = socket_timeout
        # Every connection the client makes (the pool's, and the scripts' own) checks the
        # server before anything is sent on it: a server that came back unsafe (a restart
        # with another configuration) is refused on every path, not only where a call
        # happened to notice the restart.
        client.connection_pool.connection_kwargs["redis_connect_func"] = self._on_connect
        # ... and every idle connection is checked at its socket before it is used again.
        pool: Any = client.connection_pool
        pool.connection_class = socket_checked(pool.connection_class)
        self._allow_unsafe = allow_unsafe_durability
        self._warned = False
        self._where = where
        self._closed = False
        # The scripts' own connection (see _script), made on first use; None until then.
        self._own: Any = None
        self._own_busy = False
        self._own_dirty: Callable[[], Awaitable[bool]] = _never
        self._key_cache: dict[str, tuple[list[str], str]] = {}
        self._unsure = UnsureReleases()  # (releases that raised: their next one is a retry)
        self._recheck_safety = False
        self.verified_durable = False
        """True when the last check of the server's configuration found it durable."""
        self._acquire = client.register_script(self.acquire_lua)
        self._leave_script = client.register_script(self.leave_lua)
        self._release = client.register_script(self.release_lua)
        self._renew = client.register_script(self.renew_lua)
        self._status = client.register_script(self.status_lua)
        self._swap = client.register_script(SWAP_RECORD_LUA)

    @property
    def effective_characteristics(self) -> frozenset[Characteristic]:
        """What this connection really promises: without DURABLE if the server failed the
        durability checks and ``allow_unsafe_durability`` let it run anyway."""
        if self.verified_durable:
            return self.characteristics
        return self.characteristics - {Characteristic.DURABLE}

    # -- connecting ----------------------------------------------------------------------

    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> RedisBackend:
        opts = cls.options(url, options)
        own = {k: opts.pop(k) for k in _OWN_OPTIONS}
        client_kwargs = opts
        db_path = url.path.strip("/")
        if db_path:
            if "db" in client_kwargs or not db_path.isdigit():
                raise ConfigurationError(
                    f"redis:// URL path must be /<db number> (and not also db=), got {url.path!r}"
                )
            client_kwargs["db"] = int(db_path)
        scheme = "rediss" if url.scheme.lower().startswith("rediss") else "redis"
        if scheme == "redis" and (tls := sorted(k for k in client_kwargs if k.startswith("ssl"))):
            raise ConfigurationError(
                f"{', '.join(tls)}: TLS options need a rediss:// URL, not redis://"
            )
        native_url = urlunsplit((scheme, url.netloc, "", "", ""))
        try:
            client: aioredis.Redis = aioredis.Redis.from_url(
                native_url,
                decode_responses=True,
                # fenced retries acquire itself (with the same request id); a hidden retry of
                # a release whose reply was lost would turn True into False.
                retry=Retry(NoBackoff(), 0),
                **NO_MAINT,
                **client_kwargs,
            )
        except (TypeError, ValueError) as exc:
            detail = str(exc).replace(url.password, "***") if url.password else str(exc)
            raise ConfigurationError(f"bad redis:// URL or option: {detail}") from None
        where = f"{url.hostname or 'localhost'}:{url.port or 6379}"
        backend = cls(
            client,
            prefix=own["key_prefix"],
            waiter_heartbeat=own["waiter_heartbeat"],
            allow_unsafe_durability=own["allow_unsafe_durability"],
            where=where,
        )
        try:
            await backend._verify_safety()
        except BaseException:
            await client.aclose()
            raise
        return backend

    async def _verify_safety(self) -> None:
        """Refuse (or, if allowed, warn about) a server that cannot keep tokens from repeating."""
        problems = await self._call(lambda: check_server_safety(self._client), verify=False)
        self.verified_durable = not problems
        if problems and not self._allow_unsafe:
            self._recheck_safety = True  # (every call asks again until the server passes)
            raise self._unsafe("; ".join(problems))
        self._recheck_safety = False
        if not problems or self._warned:
            return
        self._warned = True  # (once a backend: a read-only replica re-checks on every call)
        detail = "; ".join(problems)
        logger.warning(
            "redis at %s is not durable (%s); running anyway because allow_unsafe_durability "
            "is set: a crash or failover can hand out a token again",
            self._where,
            detail,
        )

    def _unsafe(self, detail: str) -> UnsafeBackendError:
        return UnsafeBackendError(
            f"redis at {self._where} is not a durable token source: {detail}. Fix the "
            "server configuration, or pass allow_unsafe_durability=true to accept that "
            "tokens may be reused after a crash or failover"
        )

    async def _on_connect(self, conn: Any) -> None:
        """redis-py's handshake on a connection just made, then the server's safety checked
        on it (:func:`check_server_safety`'s rule): an unsafe server is refused before
        anything is sent (or, with ``allow_unsafe_durability``, warned about once)."""
        try:
            await conn.on_connect()
        except rexc.ResponseError as exc:
            if isinstance(exc, DENIED):  # (credentials: said as such by _call)
                raise
            raise _RefusedOption(str(exc)) from exc
        problems = await _connection_safety(conn)
        if not problems:
            return
        if not self._allow_unsafe:
            raise _UnsafeServer("; ".join(problems))
        if self.verified_durable:
            self.verified_durable = False
            logger.warning(
                "redis at %s is no longer durable (%s); running anyway because "
                "allow_unsafe_durability is set",
                self._where,
                "; ".join(problems),
            )

    async def _call(
        self,
        make: Callable[[], Awaitable[T]],
        *,
        verify: bool = True,
        deadline: float | None = None,
    ) -> T:
        """Run one redis-py call, translating its errors into fenced's (an acquire's
        ``deadline`` bounds the safety re-check too)."""
        if self._closed:
            raise BackendUnavailable(f"redis connection to {self._where} is closed")
        try:
            if verify and self._recheck_safety:
                # Refused as unsafe, or a read-only replica answered (a failover?): the
                # server must pass again before anything else is sent.
                await self._bounded(self._verify_safety(), deadline)
            return await make()
        except FencedError:  # already translated (by the safety re-check)
            raise
        except _RefusedOption as exc:
            raise ConfigurationError(
                f"redis at {self._where} refused an option of the connection: {exc}"
            ) from None
        except _UnsafeServer as exc:  # (a connection just made found the server unsafe)
            self.verified_durable = False
            self._recheck_safety = True
            raise self._unsafe(str(exc)) from None
        except NATIVE as exc:
            what = kind(exc)
            if what == "unreachable":  # (the connection made next checks the server: _on_connect)
                raise BackendUnavailable(f"redis at {self._where} unavailable: {exc}") from exc
            if what == "denied":
                raise AccessDenied(
                    f"redis at {self._where} refused fenced's credentials (check the URL's "
                    f"user and password, or the user's ACL): {_first_line(exc)}"
                ) from exc
            if what == "read-only":
                self._recheck_safety = True
                raise UnsafeBackendError(
                    f"redis at {self._where} is a read-only replica (a failover?): {exc}"
                ) from exc
            raise BackendError(f"redis at {self._where}: {exc}") from exc

    def _bound(self, deadline: float | None, after: float = 0.0) -> tuple[float, str]:
        """How long a call may wait for its reply (and what says so): ``socket_timeout``, or
        an acquire's timeout + 1 s if shorter (:func:`~fenced._core.backend.call_bound`, the
        rule every source follows); ``after``: a blocking command's own wait, on top."""
        return call_bound(self._socket_timeout, deadline, after, name="socket_timeout")

    async def _blpop(self, key: str, wait: float, deadline: float | None) -> Any:
        """A waiter's ``BLPOP`` of ``wait`` seconds, its reply bounded like a script's."""
        return await self._bounded(self._client.blpop([key], round(wait, 3)), deadline, wait)

    async def _bounded(self, call: Awaitable[T], deadline: float | None, after: float = 0.0) -> T:
        """``call``'s outcome within :meth:`_bound`; past it, redis-py's TimeoutError (the
        server is unavailable; redis-py dropped the connection when the read was cancelled)."""
        bound, what = self._bound(deadline, after)
        try:
            async with asyncio.timeout(bound) as limit:
                return await call
        except TimeoutError:
            if not limit.expired():
                raise
            raise rexc.TimeoutError(f"no reply within {bound:.3g} s ({what})") from None

    async def _script(
        self,
        script: Any,
        keys: Sequence[str],
        args: Sequence[str | int],
        deadline: float | None = None,
    ) -> Any:
        """Run one of fenced's scripts (one short request): on the backend's own connection
        when no other call is using it, else through redis-py's pool.

        The own connection skips what redis-py's client adds to every command (its pool's
        lock and bookkeeping, observability, the retry wrapper): over a quarter of the client
        CPU of an uncontended acquire+release (docs/benchmarks.md, "the Redis client's
        cost"). Same requests, same errors: redis-py's connection drops itself on any error
        of the socket, timeout or cancellation, and nothing is retried but a script the server
        has forgotten (NOSCRIPT: it did not run). BLPOP, which blocks, always uses the pool.

        Bounded by ``socket_timeout``, and with an acquire's ``deadline`` by one second past
        it (as the other sources bound a call: a last try gets a fair chance to answer).
        """
        if self._own_busy:  # another call is on it: the pool has connections for both
            return await self._bounded(script(keys=keys, args=args), deadline)
        self._own_busy = True
        try:
            conn = self._own
            if conn is None:
                pool: Any = self._client.connection_pool
                # Without a socket timeout of its own: redis-py would then bound every write
                # with asyncio.wait_for, a task per command; one deadline below bounds all.
                kwargs = {**pool.connection_kwargs, "socket_timeout": None}
                conn = self._own = pool.connection_class(**kwargs)
                self._own_dirty = conn.can_read
            elif not conn.is_connected or await self._own_dirty():
                # Dropped after an error or a cancellation, or a reply nobody read, or closed
                # by the server (its idle ``timeout``, a restart, perhaps with another
                # configuration), seen at the socket even before the loop read it
                # (:func:`~fenced._clients.redis_sockets.socket_checked`): start afresh (the new connection checks the server
                # first: _on_connect). Nothing was sent on the old one, so nothing is re-sent.
                await conn.disconnect()
            return await self._bounded(_own_script(conn, script, keys, args), deadline)
        finally:
            self._own_busy = False

    # -- keys ----------------------------------------------------------------------------

    def _keys(self, name: str) -> tuple[list[str], str]:
        cached = self._key_cache.get(name)
        if cached is not None:
            return cached
        if len(self._key_cache) >= 1024:
            self._key_cache.clear()
        # The hash tag keeps one lock's keys in one cluster slot.
        base = f"{self._prefix}{{{name}}}"
        keys = [
            f"{base}:token",
            f"{base}:holder",
            f"{base}:queue",
            f"{base}:hb",
            f"{base}:seq",
            f"{base}:ttls",
            f"{base}:owners",
        ]
        self._key_cache[name] = (keys, f"{base}:wake:")
        return keys, f"{base}:wake:"

    # -- the Backend contract ------------------------------------------------------------

    async def acquire(
        self,
        name: str,
        *,
        request_id: str,
        ttl: float,
        deadline: float | None,
        on_lost: LostCallback,
        owner: str = "",
    ) -> Grant:
        keys, wake_prefix = self._keys(name)
        ttl_ms = max(1, round(ttl * 1000))
        owner = owner.replace("\n", " ")
        # A grant's handle: how the scripts end its holder value, after the request id (see
        # _granted_value).
        tail = f"\n{owner}" if owner else ""
        # Until an outcome is known, assume the server has queued us (or even granted us the
        # lock in a reply we never read): an abandoned acquire must undo that.
        queued = True
        task = asyncio.current_task()
        cancelling = task.cancelling() if task is not None else 0
        try:
            while True:
                sent_at = _clock.now()
                final = deadline is not None and sent_at >= deadline
                args: Sequence[str | int] = (
                    request_id,
                    ttl_ms,
                    owner,
                    "final" if final else self._heartbeat_ms,
                )
                reply = await self._call(
                    functools.partial(self._script, self._acquire, keys[:3], args, deadline),
                    deadline=deadline,
                )
                if type(reply) is int:  # a fresh grant of the full ttl (the fast path)
                    queued = False
                    return Grant(
                        FencingToken(name, reply),
                        request_id,
                        ttl_ms / 1000,
                        sent_at,
                        tail,
                    )
                if int(reply[0]) == 1:
                    queued = False
                    granted_ttl = int(reply[3]) / 1000
                    # A retry of a grant made earlier: it started (ttl - pttl) before this call.
                    started = sent_at + int(reply[2]) / 1000 - granted_ttl
                    return Grant(
                        FencingToken(name, int(reply[1])),
                        request_id,
                        granted_ttl,
                        started,
                        tail,
                    )
                if final:
                    queued = False
                    raise lock_timeout(name)
                holder_pttl = int(reply[1])
                # Re-check when the holder's lease runs out, at the latest.
                expiry = holder_pttl / 1000 + 0.002 if holder_pttl >= 0 else None
                wait = wait_budget(deadline, self._recheck, expiry)
                handed: Any = None
                if wait >= 0.001:
                    handed = await self._call(
                        functools.partial(self._blpop, wake_prefix + request_id, wait, deadline),
                        deadline=deadline,
                    )
                if task is not None and task.cancelling() > cancelling:
                    # Python 3.11's asyncio.wait_for (used by redis-py to send) can swallow a
                    # cancellation that races with the send completing: honour it here, or
                    # a cancelled waiter would wait on forever.
                    raise asyncio.CancelledError
                if handed is not None:
                    # The lock was handed to us after the acquire script sent at ``sent_at``
                    # ran (that script cleared older hand-offs), so ``sent_at`` bounds the
                    # grant's start. If that bound is too stale, ask the server instead.
                    token, _, granted_ms = handed[1].partition(":")
                    granted_ttl = int(granted_ms) / 1000
                    if _clock.now() - sent_at <= granted_ttl / 4:
                        queued = False
                        return Grant(
                            FencingToken(name, int(token)),
                            request_id,
                            granted_ttl,
                            sent_at,
                            tail,
                        )
        except BackendUnavailable:
            # Keep the place in the queue for fenced's retry with the same request id; if it
            # never comes back, its heartbeat runs out and the others skip it.
            queued = False
            raise
        finally:
            if queued:
                await self._leave(keys, wake_prefix, request_id)

    async def _leave(self, keys: list[str], wake_prefix: str, request_id: str) -> None:
        """Leave the queue of an abandoned acquire; a free lock goes to the next waiter."""
        args = (request_id, 0, "leave", self._heartbeat_ms, wake_prefix)
        try:
            await self._call(lambda: self._script(self._leave_script, keys, args))
        except Exception:  # the waiter's heartbeat runs out anyway
            logger.debug("leaving the queue of %s failed", keys[1], exc_info=True)

    async def renew(self, grant: Grant) -> Grant:
        keys, _ = self._keys(grant.token.lock)
        sent_at = _clock.now()
        ttl_ms = max(1, round(grant.ttl * 1000))
        args = (_granted_value(grant), grant.request_id, grant.token.value, ttl_ms)
        ok = await self._call(lambda: self._script(self._renew, keys[1:2], args))
        if not int(ok):
            raise LeaseLostError(f"lease {grant.token} is no longer held")
        return Grant(grant.token, grant.request_id, grant.ttl, sent_at, grant.handle)

    async def release(self, grant: Grant) -> bool:
        keys, _ = self._keys(grant.token.lock)
        args = _holder_args(grant, self._unsure.sending(grant))
        done = await self._call(lambda: self._script(self._release, keys[1:3], args))
        self._unsure.answered(grant)
        return bool(int(done))

    async def lock_names(self) -> list[str]:
        # Every lock ever granted keeps its token counter: "<prefix>{<name>}:token".
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self._prefix) + "{*}:token"

        async def scan() -> list[str]:
            found = set()
            async for key in self._client.scan_iter(match=pattern, count=1000):
                inner = key[len(self._prefix) :]
                if inner.startswith("{") and inner.endswith("}:token"):
                    found.add(inner[1 : -len("}:token")])
            return sorted(found)

        return await self._call(scan)

    async def status(self, name: str) -> LockStatus:
        keys, _ = self._keys(name)
        status_keys = [keys[0], keys[1], keys[3]]
        reply = await self._call(lambda: self._script(self._status, status_keys, ()))
        rid, token, pttl, last, waiters, owner, ttl_ms = reply
        held = bool(rid) and int(pttl) >= 0
        return LockStatus(
            name=name,
            holder=rid if held else None,
            token=FencingToken(name, int(token)) if held else None,
            last_token=FencingToken(name, int(last)) if last else None,
            remaining=int(pttl) / 1000 if held else None,
            waiters=int(waiters),
            owner=(owner or None) if held else None,
            ttl=int(ttl_ms) / 1000 if held and ttl_ms else None,
        )

    def _record_key(self, name: str) -> str:
        # The lock's hash tag, and not ":token": lock_names() does not list it.
        return f"{self._prefix}{{{name}}}:record"

    async def read_record(self, name: str) -> Record | None:
        key = self._record_key(name)
        version, value = await self._call(lambda: self._client.hmget(key, ["v", "value"]))
        return None if version is None else Record(name, int(version), str(value or ""))

    async def swap_record(self, name: str, version: int, value: str) -> Record:
        key = self._record_key(name)
        swapped, found = await self._call(lambda: self._swap(keys=[key], args=[version, value]))
        if not int(swapped):
            raise RecordConflict(name, version, int(found))
        return Record(name, int(found), value)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._own is not None:
                await self._own.disconnect()
            await self._client.aclose()
        except Exception:  # closing a connection to a dead server is not an error
            logger.debug("closing redis client failed", exc_info=True)
