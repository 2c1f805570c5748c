"""The lease state machine, with no I/O: phases, deadlines and what the holder may assume.

The driver (``_lease.py``) feeds it events (granted, renewed, lost, released) and asks it two
questions: how long is the lease *surely* still held, and when to renew next.
"""

from __future__ import annotations

import enum

from ._backend import Grant
from ._errors import LockError

__all__ = ["LeaseState", "Phase", "default_safety_margin"]


class Phase(enum.Enum):
    IDLE = "idle"
    ACQUIRING = "acquiring"
    HELD = "held"
    LOST = "lost"
    RELEASED = "released"


def default_safety_margin(ttl: float) -> float:
    """How much of a lease the holder does not count on.

    Covers the rate difference between the holder's clock and the source's (1 % is far above
    what NTP-disciplined or free-running quartz clocks do) plus a fixed 50 ms for scheduling,
    and never more than a quarter of the lease.
    """
    return min(0.05 + 0.01 * ttl, ttl / 4)


class LeaseState:
    """Phases and timing of one lease; every time is on the ``fenced._clock.now`` clock."""

    __slots__ = ("_failed_since", "grant", "lost_cause", "phase", "safety_margin", "ttl")

    def __init__(self, ttl: float, safety_margin: float | None = None) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be positive, got {ttl!r}")
        margin = default_safety_margin(ttl) if safety_margin is None else safety_margin
        if not 0 <= margin < ttl:
            raise ValueError(f"safety_margin must be in [0, ttl), got {margin!r}")
        self.ttl = float(ttl)
        self.safety_margin = float(margin)
        self.phase = Phase.IDLE
        self.grant: Grant | None = None
        self.lost_cause: BaseException | None = None
        self._failed_since: float | None = None

    def start_acquiring(self) -> None:
        if self.phase in (Phase.ACQUIRING, Phase.HELD):
            raise LockError(f"lease is already {self.phase.value}; a lease is not reentrant")
        self.phase = Phase.ACQUIRING

    def acquire_failed(self) -> None:
        if self.phase is Phase.ACQUIRING:
            self.phase = Phase.IDLE

    def granted(self, grant: Grant) -> None:
        self.phase = Phase.HELD
        self.grant = grant
        self.lost_cause = None
        self._failed_since = None

    def renewed(self, grant: Grant) -> None:
        """A renewal succeeded. Only ever moves the expiry forward."""
        if self.phase is not Phase.HELD or self.grant is None:
            return
        if grant.token != self.grant.token:
            return  # the late reply of a renewal of an earlier grant (released, re-acquired)
        if grant.sent_at >= self.grant.sent_at:
            self.grant = grant
        self._failed_since = None

    def renew_failed(self, now: float) -> None:
        if self._failed_since is None:
            self._failed_since = now

    def lose(self, cause: BaseException) -> bool:
        """Move to LOST; True if this call did it (so the lost signal fires once)."""
        if self.phase is not Phase.HELD:
            return False
        self.phase = Phase.LOST
        self.lost_cause = cause
        return True

    def released(self) -> None:
        self.phase = Phase.RELEASED

    def expires_at(self) -> float:
        """The time until which the lease is surely held (if it is held at all)."""
        if self.grant is None:
            return float("-inf")
        return self.grant.sent_at + min(self.ttl, self.grant.ttl) - self.safety_margin

    def remaining(self, now: float) -> float:
        """Seconds the lease is surely still held: 0 unless HELD."""
        if self.phase is not Phase.HELD:
            return 0.0
        return max(0.0, self.expires_at() - now)

    def renew_delay(self, now: float) -> float:
        """Seconds to wait before the next renewal attempt."""
        if self.grant is None:
            return 0.0
        # Pace renewals by the lease actually granted: a source may grant less than asked
        # (ZooKeeper caps the session timeout), and ttl/3 of the ask could fall past its end.
        ttl = min(self.ttl, self.grant.ttl)
        if self._failed_since is not None:
            # After a failure retry often, but leave the source some room.
            return min(max(ttl / 10, 0.05), 1.0)
        return max(0.0, self.grant.sent_at + ttl / 3 - now)
