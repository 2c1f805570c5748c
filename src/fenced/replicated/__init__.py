"""Epoch fencing across a replicated resource, reconfigured through the token source.

::

    group = fenced.replicated.Group(
        "orders", source=locks,
        members={"a": RedisGuard(r1, "orders"), "b": RedisGuard(r2, "orders"),
                 "c": SQLGuard("orders").fencer(lambda: sqlite3.connect("c.db"))},
    )
    with locks.lock("orders", ttl=10) as lease:
        writer = group.writer(lease)        # fences every member with the token, recovers them
        writer.set("order:17", b"paid")     # acknowledged once every member accepted it
    group.read("order:17")                  # linearizable: newest of all members, repaired
    group.reconfigure(remove=["b"])         # ordered by the token source (compare-and-set)
    group.add("d", RedisGuard(r4, "orders"))  # state transfer, then a configuration with it

The protocol, its invariants and its costs: docs/replicated.md. The same code runs sync (this
module's :class:`Group`) and async (:class:`AsyncGroup`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Mapping
from typing import Any

from .._core.errors import ChangeRefusedError, MemberBehindError
from .._core.portal import Portal
from .._core.sync import Lease, Locks
from .._core.token import FencingToken
from ._group import RECORD_PREFIX, AsyncGroup, AsyncWriter, Configuration, MemberStatus
from ._members import (
    AsyncSQLMember,
    EtcdMember,
    Item,
    Member,
    RedisMember,
    Snapshot,
    SQLMember,
    stamp,
)

__all__ = [
    "RECORD_PREFIX",
    "AsyncGroup",
    "AsyncSQLMember",
    "AsyncWriter",
    "ChangeRefusedError",
    "Configuration",
    "EtcdMember",
    "Group",
    "Item",
    "Member",
    "MemberBehindError",
    "MemberStatus",
    "RedisMember",
    "SQLMember",
    "Snapshot",
    "Writer",
    "stamp",
]


class Group:
    """The synchronous :class:`AsyncGroup`, on the connection's private loop (see there)."""

    def __init__(
        self,
        name: str,
        source: Locks,
        members: Mapping[str, Any],
        *,
        on_failure: str = "remove",
        min_members: int = 1,
        timeout: float = 10.0,
    ) -> None:
        # The loop of the connection it was made on, kept: in a child forked after it was
        # made, every call raises (its members' connections are the parent's).
        self._portal: Portal = source.portal
        self.aio = AsyncGroup(
            name,
            source.aio,
            members,
            on_failure=on_failure,
            min_members=min_members,
            timeout=timeout,
        )

    @property
    def name(self) -> str:
        return self.aio.name

    def configuration(self) -> Configuration:
        """See :meth:`AsyncGroup.configuration`."""
        return self._portal.call(self.aio.configuration())

    def reconfigure(
        self, *, add: Mapping[str, Any] | Iterable[str] = (), remove: Iterable[str] = ()
    ) -> Configuration:
        """See :meth:`AsyncGroup.reconfigure`."""
        return self._portal.call(self.aio.reconfigure(add=add, remove=list(remove)))

    def add(self, name: str, member: Any) -> Configuration:
        """Add a member: copy the data to it, then a configuration that includes it."""
        return self.reconfigure(add={name: member})

    def remove(self, *names: str) -> Configuration:
        """Remove members (fenced too, when they can be reached)."""
        return self.reconfigure(remove=names)

    def read(self, key: str) -> bytes | None:
        """See :meth:`AsyncGroup.read`."""
        return self._portal.call(self.aio.read(key))

    def status(self) -> tuple[Configuration, list[MemberStatus]]:
        """See :meth:`AsyncGroup.status`."""
        return self._portal.call(self.aio.status())

    def fence(self, token: FencingToken) -> Configuration:
        """See :meth:`AsyncGroup.fence`."""
        return self._portal.call(self.aio.fence(token))

    def async_fence(self, token: FencingToken) -> Awaitable[Configuration]:
        """:meth:`AsyncGroup.fence`, for ``locks.lock(name, fence=[group])``: the group runs on
        the connection's loop, where the lease fences its targets."""
        return self.aio.fence(token)

    def writer(self, lease: Lease) -> Writer:
        """See :meth:`AsyncGroup.writer`."""
        return Writer(self, self._portal.call(self.aio.writer(lease.aio)))

    @property
    def portal(self) -> Portal:
        """The loop the group runs on (its connection's, see :attr:`fenced.Locks.portal`):
        ``group.portal.call(coro)`` runs a coroutine of :attr:`aio` there."""
        return self._portal

    def close(self) -> None:
        """Close the members' own connections (the guards you gave stay yours); safe while
        other threads use the group: see :meth:`AsyncGroup.aclose`."""
        if not self._portal.closed:
            self._portal.call(self.aio.aclose())

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Group({self.name!r})"


class Writer:
    """The synchronous :class:`AsyncWriter`."""

    def __init__(self, group: Group, aio: AsyncWriter) -> None:
        self._portal = group.portal
        self.aio = aio

    @property
    def token(self) -> Any:
        return self.aio.token

    @property
    def configuration(self) -> Configuration | None:
        return self.aio.configuration

    def set(self, key: str, value: bytes | str) -> None:
        """See :meth:`AsyncWriter.set`."""
        self._portal.call(self.aio.set(key, value))

    def delete(self, key: str) -> None:
        """See :meth:`AsyncWriter.delete`."""
        self._portal.call(self.aio.delete(key))

    def read(self, key: str) -> bytes | None:
        """See :meth:`AsyncWriter.read`."""
        return self._portal.call(self.aio.read(key))
