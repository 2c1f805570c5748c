"""What every kind of replicated member shares: stamps, items, snapshots, the Member protocol
a group drives, the adapter over a guard's group contract, a sync client's thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol, TypeVar, runtime_checkable

from .._core.errors import ConfigurationError, InvalidTokenError
from .._core.token import FencingToken
from ..guards import GroupGuard

__all__ = [
    "STAMP_DIGITS",
    "GuardMember",
    "Item",
    "Member",
    "Snapshot",
    "change_of",
    "snapshot_of",
    "stamp",
    "stamp_token",
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


class _Threaded:
    """Runs a sync client's calls on one thread of its own (a connection stays on it)."""

    def __init__(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    async def _run(self, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn)

    def _shutdown(self) -> None:
        self._pool.shutdown(wait=False)


def snapshot_of(state: Any) -> Snapshot:
    """The :class:`Snapshot` of what a guard's ``read_group`` returned (a ``GroupState``)."""
    return Snapshot(
        state.token, state.epoch, {k: Item(k, s, v) for k, s, v in state.items}, state.holder
    )


def change_of(
    group: str,
    token: FencingToken | None,
    epoch: int,
    items: Sequence[Item],
    reset: bool,
    since: int,
) -> dict[str, Any]:
    """A member's change as the group contract's keywords (``apply_group``), refused before
    anything is sent if it has items but no token."""
    if token is None and items:
        raise ConfigurationError("items are written only with a lock token")
    rows = [(i.key, i.stamp, i.value) for i in items]
    return {
        "token": token, "group": group, "epoch": epoch, "items": rows, "reset": reset,
        "since": since,
    }  # fmt: skip


class GuardMember:
    """A member that is an adapter over a guard's group contract: ``apply_group(token=,
    group=, epoch=, items=, reset=, since=)`` and ``read_group(group=, keys=)``, where the
    rule (both marks checked and raised, items applied by stamp, in one atomic step) is the
    guard's own, written once. A kind says only how a call reaches its guard (:meth:`_call`:
    awaited, or a blocking call offloaded; on a connection, for SQL)."""

    def __init__(self, guard: GroupGuard, group: str) -> None:
        self.guard = guard
        self.resource: str = guard.resource
        self._group = group

    async def _call(self, method: str, /, **kw: Any) -> Any:
        """``guard.<method>(**kw)``, however this kind of guard is called."""
        raise NotImplementedError

    async def apply(
        self,
        token: FencingToken | None,
        epoch: int,
        items: Sequence[Item],
        *,
        reset: bool = False,
        since: int = 0,
    ) -> None:
        await self._call("apply_group", **change_of(self._group, token, epoch, items, reset, since))

    async def read(self, keys: Sequence[str] | None = None) -> Snapshot:
        return snapshot_of(await self._call("read_group", group=self._group, keys=keys))

    async def aclose(self) -> None:
        pass  # the guard is the caller's to close

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.resource!r})"
