"""What a gRPC error from etcd means, decided once for the etcd source and the etcd guards.

Each side maps the kind to its own error: ``unreachable`` is worth another member for an
idempotent request (the source's reads, keepalives) but, for a guarded write sent once, an
outcome nobody knows (:class:`~fenced.BackendUnavailable`, never "refused").
"""

from __future__ import annotations

from typing import Final, Literal

from . import grpc as _grpc  # noqa: F401  (first: gRPC reads it when imported)

# isort: split
import aetcd.exceptions
import grpc  # type: ignore[import-untyped]
import grpc.aio  # type: ignore[import-untyped]

__all__ = ["RETRYABLE", "UNREACHABLE", "kind"]

RETRYABLE: Final = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
    }
)
"""gRPC codes worth another member. etcd itself answers UNAVAILABLE for "no leader", "leader
changed", "request timed out" and "stopped", RESOURCE_EXHAUSTED for "too many requests"; the
transport answers UNAVAILABLE, CANCELLED (channel closed), UNKNOWN or INTERNAL (stream reset)
when a member dies mid-call: for a request already sent, its outcome is unknown."""

UNREACHABLE: Final = (
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
)
"""aetcd's own wrappers of a connection that failed or timed out (its ``Client`` path)."""


def kind(exc: BaseException) -> Literal["unreachable", "lease-not-found", "refused"]:
    """``unreachable`` (no answer, or a member failing under the call: outcome unknown),
    ``lease-not-found`` (etcd says the lease is gone), or ``refused`` (etcd answered no)."""
    if isinstance(exc, UNREACHABLE):
        return "unreachable"
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in (exc.details() or ""):
            return "lease-not-found"
        if code in RETRYABLE:
            return "unreachable"
    return "refused"
