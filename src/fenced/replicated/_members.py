"""Members of a replicated group: one guarded resource each, keeping two marks and the data.

A member keeps, for one group, in the resource itself:

* the **lock mark**: the guard's own high-water mark (the same one ``fence=[guard]`` raises),
  so a stale holder is refused here exactly as by the plain guard;
* the **epoch mark**: the highest configuration epoch it has been told of;
* the **holder**: the text of the last lock token a change presented (signed, if signing is
  on), so that a read repair or a state transfer can present the current fence's own token;
* the **data**: key -> (stamp, value or deleted), where a stamp orders every write ever made
  to the group (see :func:`stamp`).

Every change is ONE atomic step in the resource (a Lua script, a transaction, an etcd txn):
the lock token is checked against the lock mark and the epoch against the epoch mark, both
raised, and each item applied only if its stamp is newer than the stored one, or nothing at
all. A refusal raises :class:`~fenced.StaleTokenError` or :class:`~fenced.StaleEpochError`,
or :class:`~fenced.MemberBehindError` when the epoch mark is below ``since``: a member that
came back empty (mark 0) must not be raised into a configuration it holds none of the data of.

Adapters exist for the guards fenced ships: :class:`RedisMember` (``RedisGuard`` or
``AsyncRedisGuard``), :class:`SQLMember` (``SQLGuard`` and a function that opens a sqlite3,
psycopg, PyMySQL or SQLAlchemy connection) and :class:`AsyncSQLMember` (the same, async:
psycopg, asyncmy, SQLAlchemy), :class:`EtcdMember` (``EtcdGuard`` or ``AsyncEtcdGuard``).
Blocking clients run on worker threads, so the members of a group are written in parallel.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, Protocol, TypeVar, runtime_checkable

from .._core.errors import (
    BackendUnavailable,
    ConfigurationError,
    CorruptMarkError,
    InvalidTokenError,
    member_behind_error,
    stale_epoch_error,
)
from .._core.token import FencingToken

__all__ = [
    "AsyncSQLMember",
    "EtcdMember",
    "Item",
    "Member",
    "RedisMember",
    "SQLMember",
    "Snapshot",
    "as_member",
    "stamp",
]

T = TypeVar("T")

STAMP_DIGITS: Final = 19


def stamp(token: int, seq: int) -> str:
    """The stamp of a write: (lock token, the writer's sequence number), as 38 digits, so that
    the order of stamps is the order of their text (Lua, SQL and etcd compare text)."""
    return f"{token:0{STAMP_DIGITS}d}{seq:0{STAMP_DIGITS}d}"


def stamp_token(s: str) -> int:
    return int(s[:STAMP_DIGITS])


@dataclasses.dataclass(frozen=True, slots=True)
class Item:
    """One key's state: its stamp and its value (None: deleted)."""

    key: str
    stamp: str
    value: bytes | None


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    """What a member holds: its marks and the items asked for (all, or some keys)."""

    token: int  # lock mark (0: never fenced)
    epoch: int  # epoch mark (0: never)
    items: dict[str, Item]
    holder: str | None = None  # the last token a change presented, as text (None: unknown)

    def holder_token(self, lock: str) -> FencingToken | None:
        """The stored holder's token if it is the one at the lock mark (signed if it was),
        else None: the mark was raised by some other path (a plain guard's fence)."""
        if not self.holder:
            return None
        try:
            token = FencingToken.parse(self.holder, lock)
        except InvalidTokenError:
            return None  # (a damaged copy: the caller falls back as if none was kept)
        return token if token.value == self.token else None


@runtime_checkable
class Member(Protocol):
    """What a group needs of a member (async; adapters wrap sync clients)."""

    async def apply(
        self,
        token: FencingToken | None,
        epoch: int,
        items: Sequence[Item],
        *,
        reset: bool = False,
        since: int = 0,
    ) -> None:
        """In one atomic step: refuse a token below the lock mark (StaleTokenError), an epoch
        below the epoch mark (StaleEpochError), or an epoch mark below ``since``
        (MemberBehindError: the member was never fenced in the configuration the change is
        made in, so it lost its state); else raise both marks, keep ``token`` as the holder,
        and apply each item whose stamp is newer than the stored one. ``token`` None: only
        the epoch (no items). ``reset``: first forget every item held (state transfer to a
        member joining: what it took while outside the configuration must not come back).
        A member whose ``apply`` takes no ``since`` still works, unprotected against coming
        back empty."""
        ...

    async def read(self, keys: Sequence[str] | None = None) -> Snapshot:
        """Both marks and the items of ``keys`` (None: all), at one instant."""
        ...

    async def aclose(self) -> None: ...


_refused_epoch = stale_epoch_error
_refused_behind = member_behind_error


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class _Threaded:
    """Runs a sync client's calls on one thread of its own (a connection stays on it)."""

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    async def _run(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn)

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=False)


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


# -- SQL (SQLite, PostgreSQL, MySQL/MariaDB) ------------------------------------------------


class SQLMember:
    """A member on a SQL database, through a :class:`~fenced.guards.sql.SQLGuard` and
    ``connect()``, which opens a blocking connection the guard takes (sqlite3, psycopg 3,
    PyMySQL, a SQLAlchemy ``Connection``); :class:`AsyncSQLMember` takes an async one.
    One transaction per change, the guard's own plan (:meth:`SQLGuard.apply_group
    <fenced.guards.sql.SQLGuard.apply_group>`): the lock fence, the epoch mark, the items,
    all or nothing, on a connection of the guard's fencer (:attr:`fencer`, which keeps one
    unless ``keep_connection=False``), run on a worker thread (``asyncio.to_thread``, the one
    offload of blocking clients). Tables ``fenced_group_epochs``, ``fenced_group_data`` and
    ``fenced_group_holders`` are made on each new connection's first use."""

    def __init__(
        self, guard: Any, connect: Callable[[], Any], group: str, *, keep_connection: bool = True
    ) -> None:
        from ..guards.sql import SQLFencer

        self.guard = guard
        self.resource: str = guard.resource
        self.fencer = SQLFencer(
            guard, connect, keep_connection=keep_connection, setup=guard.install_group
        )
        self._group = group

    @property
    def keep_connection(self) -> bool:
        return self.fencer.keep_connection

    def _apply(self, change: dict[str, Any]) -> None:
        with self.fencer.connections.connection() as conn:
            self.guard.apply_group(conn, **change)

    def _read(self, keys: Sequence[str] | None) -> Snapshot:
        with self.fencer.connections.connection() as conn:
            return _snapshot(self.guard.read_group(conn, group=self._group, keys=keys))

    async def apply(
        self,
        token: FencingToken | None,
        epoch: int,
        items: Sequence[Item],
        *,
        reset: bool = False,
        since: int = 0,
    ) -> None:
        change = _change(self._group, token, epoch, items, reset, since)
        await asyncio.to_thread(self._apply, change)

    async def read(self, keys: Sequence[str] | None = None) -> Snapshot:
        return await asyncio.to_thread(self._read, keys)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.fencer.close)

    def __repr__(self) -> str:
        return f"SQLMember({self.resource!r})"


class AsyncSQLMember:
    """:class:`SQLMember` over an async ``connect()`` (``psycopg.AsyncConnection.connect``,
    ``asyncmy.connect``, a SQLAlchemy ``AsyncEngine.connect``): the guard's async fencer
    (:meth:`SQLGuard.afencer <fenced.guards.sql.SQLGuard.afencer>`) on the group's own loop,
    no thread."""

    def __init__(
        self,
        guard: Any,
        connect: Callable[[], Awaitable[Any]],
        group: str,
        *,
        keep_connection: bool = True,
    ) -> None:
        from ..guards.sql import AsyncSQLFencer

        self.guard = guard
        self.resource: str = guard.resource
        self.fencer = AsyncSQLFencer(
            guard, connect, keep_connection=keep_connection, setup=guard.ainstall_group
        )
        self._group = group

    async def apply(
        self,
        token: FencingToken | None,
        epoch: int,
        items: Sequence[Item],
        *,
        reset: bool = False,
        since: int = 0,
    ) -> None:
        change = _change(self._group, token, epoch, items, reset, since)
        async with self.fencer.connections.connection() as conn:
            await self.guard.aapply_group(conn, **change)

    async def read(self, keys: Sequence[str] | None = None) -> Snapshot:
        async with self.fencer.connections.connection() as conn:
            return _snapshot(await self.guard.aread_group(conn, group=self._group, keys=keys))

    async def aclose(self) -> None:
        await self.fencer.aclose()

    def __repr__(self) -> str:
        return f"AsyncSQLMember({self.resource!r})"


def _change(
    group: str,
    token: FencingToken | None,
    epoch: int,
    items: Sequence[Item],
    reset: bool,
    since: int,
) -> dict[str, Any]:
    """A member's change as ``SQLGuard.apply_group``'s keywords (refused before anything is
    sent if it has items but no token)."""
    if token is None and items:
        raise ConfigurationError("items are written only with a lock token")
    rows = [(i.key, i.stamp, i.value) for i in items]
    return {
        "token": token, "group": group, "epoch": epoch, "items": rows, "reset": reset,
        "since": since,
    }  # fmt: skip


def _snapshot(state: Any) -> Snapshot:
    items = {k: Item(k, s, v) for k, s, v in state.items}
    return Snapshot(state.token, state.epoch, items, state.holder)


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


def as_member(spec: Any, group: str) -> Member:
    """A member from what the caller gave: a Member, a Redis or etcd guard, an ``SQLFencer``
    (``SQLGuard(...).fencer(connect)``), or a ``(SQLGuard, connect)`` pair."""
    from ..guards import etcd as etcd_guard
    from ..guards import redis as redis_guard
    from ..guards import sql as sql_guard

    if isinstance(spec, (redis_guard.RedisGuard, redis_guard.AsyncRedisGuard)):
        return RedisMember(spec, group)
    if isinstance(spec, (etcd_guard.EtcdGuard, etcd_guard.AsyncEtcdGuard)):
        return EtcdMember(spec, group)
    if isinstance(spec, sql_guard.SQLFencer):
        return SQLMember(spec.guard, spec.connect, group)
    if isinstance(spec, sql_guard.AsyncSQLFencer):
        return AsyncSQLMember(spec.guard, spec.connect, group)
    if (
        isinstance(spec, tuple)
        and len(spec) == 2
        and isinstance(spec[0], sql_guard.SQLGuard)
        and callable(spec[1])
    ):
        return SQLMember(spec[0], spec[1], group)
    if isinstance(spec, Member):
        return spec
    raise ConfigurationError(
        f"not a group member: {spec!r} (give a RedisGuard, an EtcdGuard, "
        "SQLGuard(...).fencer(connect) or .afencer(async_connect), or a Member)"
    )


def members_of(specs: Mapping[str, Any], group: str) -> dict[str, Member]:
    return {name: as_member(spec, group) for name, spec in specs.items()}


def _no_map(exc: BaseException) -> None:
    return None  # (the guard's transport errors are fenced errors already)
