"""Who leads an election, read from its lock's status: the pure part of leader election
(:mod:`fenced.election` is the public module; ``Locks.elect``/``observe`` are the core's).

It lives in the core, below the lease and the facades that offer ``elect``/``observe``, so
the core never imports the election module above it (issue 27: no upward import, no cycle).
"""

from __future__ import annotations

import dataclasses

from .backend import LockStatus
from .token import FencingToken

__all__ = ["Leader", "LeaderChanges", "leader_value"]


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
