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

# The election is the core's (``Locks.elect``/``observe`` return these): its classes live
# beside the lease they wrap, so the core never imports this module (issue 27: no upward
# import, no cycle). This module is their public home.
from ._core.leadership import Leader, LeaderChanges, leader_value
from ._core.lease import AsyncLeadership, AsyncLocks
from ._core.sync import Leadership

__all__ = ["AsyncLeadership", "Leader", "LeaderChanges", "Leadership", "leader_value"]


# The spellings before issue 27, ``elect(locks, ...)`` and ``observe(locks, ...)``: the
# methods themselves, so that their signatures are written once.
elect = AsyncLocks.elect
observe = AsyncLocks.observe
