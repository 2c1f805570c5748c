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
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._core.errors import ConfigurationError
from ._etcd_member import EtcdMember
from ._member_types import GuardMember, Item, Member, Snapshot, stamp
from ._member_types import stamp_token as stamp_token  # (re-exported: _group reads it here)
from ._redis_member import RedisMember

if TYPE_CHECKING:
    from ..guards.sql import SQLGuard

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


class SQLMember(GuardMember):
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
        self,
        guard: SQLGuard,
        connect: Callable[[], Any],
        group: str,
        *,
        keep_connection: bool = True,
    ) -> None:
        from ..guards.sql import SQLFencer

        super().__init__(guard, group)
        self.fencer = SQLFencer(
            guard, connect, keep_connection=keep_connection, setup=guard.install_group
        )

    @property
    def keep_connection(self) -> bool:
        return self.fencer.keep_connection

    async def _call(self, method: str, /, **kw: Any) -> Any:
        def run() -> Any:
            with self.fencer.connections.connection() as conn:
                return getattr(self.guard, method)(conn, **kw)

        return await asyncio.to_thread(run)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.fencer.close)


class AsyncSQLMember(GuardMember):
    """:class:`SQLMember` over an async ``connect()`` (``psycopg.AsyncConnection.connect``,
    ``asyncmy.connect``, a SQLAlchemy ``AsyncEngine.connect``): the guard's async fencer
    (:meth:`SQLGuard.afencer <fenced.guards.sql.SQLGuard.afencer>`) and its awaited group
    contract (``aapply_group``, ``aread_group``) on the group's own loop, no thread."""

    def __init__(
        self,
        guard: SQLGuard,
        connect: Callable[[], Awaitable[Any]],
        group: str,
        *,
        keep_connection: bool = True,
    ) -> None:
        from ..guards.sql import AsyncSQLFencer

        super().__init__(guard, group)
        self.fencer = AsyncSQLFencer(
            guard, connect, keep_connection=keep_connection, setup=guard.ainstall_group
        )

    async def _call(self, method: str, /, **kw: Any) -> Any:
        async with self.fencer.connections.connection() as conn:
            return await getattr(self.guard, "a" + method)(conn, **kw)

    async def aclose(self) -> None:
        await self.fencer.aclose()


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
