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
psycopg or PyMySQL connection), :class:`EtcdMember` (``EtcdGuard`` or ``AsyncEtcdGuard``).
Sync clients run on a thread of their own per member, so the members of a group are written
in parallel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .._core.errors import BackendUnavailable, ConfigurationError, FencedError
from .._core.token import FencingToken
from ._etcd_member import EtcdMember
from ._member_types import Item, Member, Snapshot, _Threaded, stamp
from ._member_types import stamp_token as stamp_token  # (re-exported: _group reads it here)
from ._redis_member import RedisMember

__all__ = [
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


# -- SQL (SQLite, PostgreSQL, MySQL/MariaDB) ------------------------------------------------


class SQLMember(_Threaded):
    """A member on a SQL database, through a :class:`~fenced.guards.sql.SQLGuard` and
    ``connect()``, which opens a connection the guard takes (sqlite3, psycopg 3, PyMySQL, a
    SQLAlchemy ``Connection``).
    One transaction per change, the guard's own plan (:meth:`SQLGuard.apply_group
    <fenced.guards.sql.SQLGuard.apply_group>`): the lock fence, the epoch mark, the items,
    all or nothing. Tables ``fenced_group_epochs``, ``fenced_group_data`` and
    ``fenced_group_holders`` are made on first use."""

    def __init__(
        self, guard: Any, connect: Callable[[], Any], group: str, *, keep_connection: bool = True
    ) -> None:
        super().__init__(f"fenced-member-{guard.resource}")
        self.keep_connection = keep_connection  # False: connect for each change or read
        self.guard = guard
        self.resource: str = guard.resource
        self._connect = connect
        self._group = group
        self._conn: Any = None

    def _connection(self) -> Any:
        if self._conn is None:
            conn = self._connect()
            try:
                self.guard.install_group(conn)
            except BaseException:
                with contextlib.suppress(Exception):
                    conn.close()
                raise
            self._conn = conn
        return self._conn

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def _guarded(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(conn)`` (the guard maps the driver's errors and rolls back); a connection
        that failed to open or broke is dropped (the next call reconnects), reported as
        BackendUnavailable."""
        try:
            conn = self._connection()
        except FencedError:
            raise
        except Exception as exc:
            raise BackendUnavailable(f"member {self.resource!r}: {exc}") from exc
        try:
            return fn(conn)
        except BackendUnavailable:
            self._drop()
            raise
        except FencedError:
            raise
        except Exception as exc:
            self._drop()
            raise BackendUnavailable(f"member {self.resource!r}: {exc}") from exc
        finally:
            if not self.keep_connection:
                self._drop()

    def _apply(
        self,
        conn: Any,
        token: FencingToken | None,
        epoch: int,
        items: Sequence[Item],
        reset: bool,
        since: int,
    ) -> None:
        self.guard.apply_group(
            conn,
            token=token,
            group=self._group,
            epoch=epoch,
            items=[(i.key, i.stamp, i.value) for i in items],
            reset=reset,
            since=since,
        )

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
        await self._run(
            lambda: self._guarded(lambda c: self._apply(c, token, epoch, items, reset, since))
        )

    def _read(self, conn: Any, keys: Sequence[str] | None) -> Snapshot:
        state = self.guard.read_group(conn, group=self._group, keys=keys)
        items = {k: Item(k, s, v) for k, s, v in state.items}
        return Snapshot(state.token, state.epoch, items, state.holder)

    async def read(self, keys: Sequence[str] | None = None) -> Snapshot:
        return await self._run(lambda: self._guarded(lambda c: self._read(c, keys)))

    async def aclose(self) -> None:
        await self._run(self._drop)
        self._shutdown()

    def __repr__(self) -> str:
        return f"SQLMember({self.resource!r})"


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
        "SQLGuard(...).fencer(connect), or a Member)"
    )


def members_of(specs: Mapping[str, Any], group: str) -> dict[str, Member]:
    return {name: as_member(spec, group) for name, spec in specs.items()}
