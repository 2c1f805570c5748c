"""The lease state machine, with no I/O: phases, deadlines and what the holder may assume.

The driver (``lease.py``) feeds it events (granted, renewed, lost, released) and asks it two
questions: how long is the lease *surely* still held, and when to renew next.
"""

from __future__ import annotations

import enum
import math
import re
from typing import Final

from .backend import Grant
from .errors import ConfigurationError, LockError

__all__ = [
    "DEFAULT_TTL",
    "MAX_TIMEOUT",
    "MAX_TTL",
    "MIN_TTL",
    "LeaseState",
    "Phase",
    "check_lock_delay",
    "check_request_id",
    "check_timeout",
    "check_ttl",
    "default_safety_margin",
]

DEFAULT_TTL: Final = 10.0
MIN_TTL: Final = 0.1
"""Seconds. Below this a lease is gone before a round trip and a renewal can be made."""
MAX_TTL: Final = 86_400.0
"""Seconds (one day). A longer lease only delays recovery from a dead holder."""
MAX_TIMEOUT: Final = 31_536_000.0
"""Seconds (a year) an acquire may wait; ``None`` waits without limit."""


def _seconds(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return None if math.isnan(number) else number


def _shown(value: object) -> str:
    """A refused value in no language's syntax (the message may reach curl, JavaScript and
    Java users through fenced serve): 30 for 30.0, 2.5, inf, 'abc'."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return repr(value)


def check_ttl(ttl: object) -> float:
    """``ttl`` as float seconds, or :class:`~fenced.ConfigurationError` naming the bounds."""
    number = _seconds(ttl)
    if number is None or not MIN_TTL <= number <= MAX_TTL:
        raise ConfigurationError(
            f"ttl must be from {MIN_TTL:g} to {MAX_TTL:g} seconds, not {_shown(ttl)}"
        )
    return number


_REQUEST_ID_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}")


def check_request_id(request_id: object) -> str:
    """A client-chosen request id: 1-64 characters of ``A-Z a-z 0-9 _ . : -`` (sources keep it
    in keys and node names, so nothing that could reach into another key), or
    :class:`~fenced.ConfigurationError`."""
    if not isinstance(request_id, str) or not _REQUEST_ID_RE.fullmatch(request_id):
        raise ConfigurationError(
            f"request_id must be 1-64 characters of A-Z a-z 0-9 _ . : - "
            f"(starting with a letter, digit or _), not {str(request_id)[:80]!r}"
        )
    return request_id


def check_lock_delay(delay: object) -> float:
    """A lock-delay in seconds: a finite number in [0, 3600]."""
    seconds = _seconds(delay)
    if seconds is None or not 0 <= seconds <= 3600:
        raise ConfigurationError(f"lock_delay must be from 0 to 3600 seconds, not {_shown(delay)}")
    return float(seconds)


def check_timeout(timeout: object) -> float | None:
    """``timeout`` as float seconds (or None: no limit), or ConfigurationError."""
    if timeout is None:
        return None
    number = _seconds(timeout)
    if number is None or not 0 <= number <= MAX_TIMEOUT:
        raise ConfigurationError(
            f"timeout must be from 0 to {MAX_TIMEOUT:.0f} seconds (a year), or none for no "
            f"limit; not {_shown(timeout)}"
        )
    return number


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
    """Phases and timing of one lease; every time is on the ``fenced._core.clock.now`` clock."""

    __slots__ = ("_failed_since", "grant", "lost_cause", "phase", "safety_margin", "ttl")

    def __init__(self, ttl: float, safety_margin: float | None = None) -> None:
        ttl = check_ttl(ttl)
        margin = default_safety_margin(ttl) if safety_margin is None else _seconds(safety_margin)
        if margin is None or not 0 <= margin < ttl:
            raise ConfigurationError(
                f"safety_margin must be a number of seconds in [0, ttl), not {safety_margin!r}"
            )
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

    def remaining_of(self, grant: Grant, now: float) -> float:
        """How long ``grant`` would surely be held if it were taken now (may be <= 0)."""
        return grant.sent_at + min(self.ttl, grant.ttl) - self.safety_margin - now

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
