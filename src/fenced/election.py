"""Leader election with epochs, on any token source (``locks.elect`` / ``locks.observe``).

A leadership is a lease on the election's name, taken through the one lease core: its
**epoch** is the lease's fencing token, so every leader's epoch is strictly greater than
every earlier leader's, on every source, across expiry, resignation, restarts and failover —
and a resource that keeps a high-water mark of epochs refuses every earlier leader::

    async with await locks.elect("scheduler", value="10.0.0.7:8080", ttl=10,
                                 fence=[jobs_guard]) as leader:
        # jobs_guard's mark is at leader.epoch already: a paused old leader is refused there
        # even before this leader writes anything.
        await run_scheduler(epoch=leader.epoch, stop=leader.lost)

The scenario that makes epochs necessary: leader A (epoch 7) stops for a GC pause longer
than its ttl; B is elected with epoch 8 and fences the job table; A wakes up and writes with
epoch 7 — refused, because 7 < 8. Without the epoch both would write.

``observe`` reports who leads, from any process, without campaigning: a :class:`Leader` each
time the leadership changes, in epoch order, never backwards. It reads the source's status
every ``interval`` seconds, so a leadership shorter than that can be missed — the next one's
epoch then shows the gap.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING

from ._token import FencingToken

if TYPE_CHECKING:
    from ._backend import LockStatus
    from ._lease import (
        AsyncLease,
        AsyncLocks,
        AsyncLostCallback,
        FenceTarget,
        LostSignal,
        NotFenced,
    )
    from ._sync import Lease

__all__ = ["AsyncLeadership", "Leader", "LeaderChanges", "Leadership", "leader_value"]


@dataclasses.dataclass(frozen=True, slots=True)
class Leader:
    """Who leads ``name`` now: ``epoch`` is the leader's fencing token, ``value`` what it
    advertised (``elect(value=...)``), ``owner`` its ``user@host pid N``. With no leader
    (the last one resigned or expired), all three are None."""

    name: str
    epoch: FencingToken | None
    value: str | None
    owner: str | None


def leader_value(owner: str | None) -> tuple[str | None, str | None]:
    """Split a holder's ``owner`` (``user@host pid N: value``) into (who, value)."""
    if owner is None:
        return None, None
    who, sep, value = owner.partition(": ")
    return who, (value if sep else "")


class AsyncLeadership:
    """This process leads ``name`` until :meth:`resign`, or until its lease is lost
    (``lost`` is set and ``on_lost`` called, as for a lease: stop acting as leader then)."""

    def __init__(self, lease: AsyncLease, value: str) -> None:
        self._lease = lease
        self.value = value

    @property
    def name(self) -> str:
        return self._lease.name

    @property
    def epoch(self) -> FencingToken:
        """This leadership's fencing token: strictly greater than every earlier leader's."""
        return self._lease.token

    @property
    def lease(self) -> AsyncLease:
        return self._lease

    @property
    def lost(self) -> LostSignal:
        """Set when leadership is lost (``await leadership.lost`` waits for it)."""
        return self._lease.lost

    @property
    def held(self) -> bool:
        return self._lease.held

    @property
    def not_fenced(self) -> list[NotFenced]:
        """The ``fence=`` targets that could not be fenced (``fence_errors="report"``)."""
        return self._lease.not_fenced

    def remaining(self) -> float:
        """Seconds this process surely still leads (0 once it may not)."""
        return self._lease.remaining()

    async def resign(self) -> bool:
        """Step down now: the next candidate is elected at once (no ttl to wait out)."""
        return await self._lease.release()

    async def __aenter__(self) -> AsyncLeadership:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.resign()

    def __repr__(self) -> str:
        return f"<AsyncLeadership {self.name!r} epoch={self._lease.token} value={self.value!r}>"


async def elect(
    locks: AsyncLocks,
    name: str,
    value: str = "",
    *,
    ttl: float,
    timeout: float | None = None,
    fence: Iterable[FenceTarget] = (),
    fence_errors: str = "raise",
    on_lost: AsyncLostCallback | None = None,
    lock_delay: float = 0.0,
) -> AsyncLeadership:
    lease = locks.lock(
        name,
        ttl=ttl,
        timeout=timeout,
        on_lost=on_lost,
        description=value or None,
        fence=fence,
        fence_errors=fence_errors,
        lock_delay=lock_delay,
    )
    await lease.acquire()
    return AsyncLeadership(lease, value)


class LeaderChanges:
    """What ``observe`` yields, from successive statuses of the election's lock: a new
    :class:`Leader` when the epoch rises or leadership ends, nothing otherwise (the one
    decision both the async and the sync observers make)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._epoch = 0
        self._leading: bool | None = None

    def update(self, status: LockStatus) -> Leader | None:
        token = status.token
        if token is not None and token.value > self._epoch:
            self._epoch, self._leading = token.value, True
            who, value = leader_value(status.owner)
            return Leader(self.name, token, value, who)
        if token is None and self._leading is not False:
            self._leading = False
            return Leader(self.name, None, None, None)
        return None


async def observe(locks: AsyncLocks, name: str, *, interval: float = 0.1) -> AsyncIterator[Leader]:
    changes = LeaderChanges(name)
    while True:
        change = changes.update(await locks.status(name))
        if change is not None:
            yield change
        await asyncio.sleep(interval)


class Leadership:
    """:class:`AsyncLeadership` through a synchronous :class:`~fenced.Locks`: ``lost`` is a
    :class:`threading.Event`."""

    def __init__(self, lease: Lease, value: str) -> None:
        self._lease = lease
        self.value = value

    name = property(lambda self: self._lease.name)
    epoch = property(lambda self: self._lease.token, doc="This leadership's fencing token.")
    lease = property(lambda self: self._lease)
    lost = property(lambda self: self._lease.lost, doc="Set when leadership is lost.")
    held = property(lambda self: self._lease.held)
    not_fenced = property(lambda self: self._lease.not_fenced)

    def remaining(self) -> float:
        return self._lease.remaining()

    def resign(self) -> bool:
        return self._lease.release()

    def __enter__(self) -> Leadership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.resign()

    def __repr__(self) -> str:
        return f"<Leadership {self.name!r} epoch={self._lease.token} value={self.value!r}>"
