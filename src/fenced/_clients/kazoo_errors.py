"""What a kazoo (ZooKeeper) error means, decided once for the ZooKeeper source and guards.

Each side maps the kind to its own error: for the source an expired session is a lost lease
(its ephemeral nodes are gone); for a guard, which owns no session, it is one more way the
request went unanswered.
"""

from __future__ import annotations

from typing import Final, Literal

from kazoo.exceptions import (
    ConnectionClosedError,
    ConnectionLoss,
    OperationTimeoutError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError

__all__ = ["SESSION_LOST", "UNREACHABLE", "kind"]

UNREACHABLE: Final = (
    ConnectionLoss,
    ConnectionClosedError,
    OperationTimeoutError,
    KazooTimeoutError,
)
"""Errors that say nothing about the session: the request may or may not have been applied."""

SESSION_LOST: Final = (SessionExpiredError,)
"""The session is gone: the server dropped it (and its ephemeral nodes)."""


def kind(exc: BaseException) -> Literal["unreachable", "session-lost", "refused"]:
    """``unreachable`` (outcome unknown), ``session-lost``, or ``refused`` (the server
    answered no: a version, a missing node, an ACL...)."""
    if isinstance(exc, UNREACHABLE):
        return "unreachable"
    if isinstance(exc, SESSION_LOST):
        return "session-lost"
    return "refused"
