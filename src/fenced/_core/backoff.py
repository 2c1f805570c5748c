"""The one back-off of fenced's retry loops: doubling pauses, capped, bounded by a deadline.

Each loop says how much time it has left (``left``, from a monotonic clock) and gets the next
pause, cut so that it does not sleep past its deadline — or, with ``whole=True``, ``None``
when the full pause would not fit (an attempt made as the deadline strikes would have no time
to finish: give up now). ``None`` also when no time is left at all.
"""

from __future__ import annotations

__all__ = ["Backoff"]


class Backoff:
    """``first``, then twice the last pause, never above ``cap``."""

    __slots__ = ("_cap", "_next")

    def __init__(self, first: float, cap: float) -> None:
        if not 0 < first <= cap:
            raise ValueError(f"back-off needs 0 < first <= cap, not {first!r}, {cap!r}")
        self._next = first
        self._cap = cap

    def next(self, left: float | None = None, *, whole: bool = False) -> float | None:
        """The next pause in seconds; ``left``: seconds to the caller's deadline (None: none)."""
        delay = self._next
        self._next = min(delay * 2, self._cap)
        if left is None:
            return delay
        if left <= 0 or (whole and delay >= left):
            return None
        return min(delay, left)
