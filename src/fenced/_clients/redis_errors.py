"""What a redis-py error means, decided once for the Redis source and the Redis guards.

Each side maps the kind to its own error: a read-only replica is an unsafe *token source*
(it may have lost acknowledged grants in a failover) but, for a guarded write, a resource
that cannot take writes right now.
"""

from __future__ import annotations

from typing import Final, Literal

import redis
import redis.exceptions as rexc

__all__ = ["DENIED", "NATIVE", "UNREACHABLE", "kind"]

DENIED: Final = (
    rexc.AuthenticationError,
    rexc.AuthorizationError,
    rexc.AuthenticationWrongNumberOfArgsError,
    rexc.NoPermissionError,
)
"""The server refused these credentials (a wrong or missing password, an ACL): configuration,
which no retry mends. (redis-py derives the first two from ConnectionError.)"""

UNREACHABLE: Final = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.ClusterDownError,
    rexc.SlotNotCoveredError,
    OSError,
)
"""The server cannot be reached (or answered too late): the outcome of a sent request is unknown."""

NATIVE: Final = (redis.RedisError, rexc.RedisClusterException, OSError)
"""Everything redis-py raises (its cluster client's errors do not all derive from RedisError)."""


def kind(exc: BaseException) -> Literal["unreachable", "read-only", "denied", "refused"]:
    """``unreachable``, ``read-only`` (a replica), ``denied`` (authentication or an ACL), or
    ``refused`` (a reply error: the request arrived and was refused, e.g. a script error,
    WRONGTYPE, CROSSSLOT)."""
    if isinstance(exc, DENIED):
        return "denied"
    if isinstance(exc, rexc.ReadOnlyError):
        return "read-only"
    if isinstance(exc, UNREACHABLE):
        return "unreachable"
    return "refused"
