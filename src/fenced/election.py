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
    from ._lease import AsyncLease, AsyncLocks, AsyncLostCallback, FenceTarget, NotFenced

__all__ = ["AsyncLeadership", "Leader", "leader_value"]


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
    def lost(self) -> asyncio.Event:
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
) -> AsyncLeadership:
    lease = locks.lock(
        name,
        ttl=ttl,
        timeout=timeout,
        on_lost=on_lost,
        description=value or None,
        fence=fence,
        fence_errors=fence_errors,
    )
    await lease.acquire()
    return AsyncLeadership(lease, value)


async def observe(locks: AsyncLocks, name: str, *, interval: float = 0.1) -> AsyncIterator[Leader]:
    last: tuple[int, bool] | None = None  # (highest epoch seen, whether it leads now)
    while True:
        status = await locks.status(name)
        token = status.token
        if token is not None and (last is None or token.value > last[0]):
            who, value = leader_value(status.owner)
            last = (token.value, True)
            yield Leader(name, token, value, who)
        elif token is None and (last is None or last[1]):
            last = (last[0] if last else 0, False)
            yield Leader(name, None, None, None)
        await asyncio.sleep(interval)
