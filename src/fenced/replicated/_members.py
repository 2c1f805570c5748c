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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from .._core.errors import ConfigurationError
from .._core.token import FencingToken
from ._etcd_member import EtcdMember
from ._member_types import Item, Member, Snapshot, stamp
from ._member_types import stamp_token as stamp_token  # (re-exported: _group reads it here)
from ._redis_member import RedisMember

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
