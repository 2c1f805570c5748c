"""The errors fenced raises: one base class, each native error mapped to the most specific one.

Hierarchy::

    FencedError
    ├── InvalidTokenError (ValueError)       malformed, out-of-range token text or value
    │   ├── WrongLockError                   a token of another lock (also: comparing tokens of two locks)
    │   └── SignatureError                   signing required, and the token is unsigned or not well signed
    │                                        (defined in fenced._core.signing; exported as fenced.SignatureError)
    ├── StaleTokenError                      the resource has accepted a higher token: this writer is fenced off
    ├── CorruptMarkError                     the resource's stored high-water mark is unreadable: every write is refused
    ├── FenceConflictError                   a concurrent transaction kept the guard from deciding: retry
    ├── ResourceNotFoundError (LookupError)  a guarded row/key/file does not exist (not the same as stale)
    ├── RecordConflict                       a compare-and-set of a record in the source lost: it changed meanwhile
    ├── ReplicationError                     a replicated group could not complete a write, read or change
    │   └── StaleEpochError                  a member has moved to a later configuration than the caller's
    ├── LockError
    │   ├── LockTimeout (TimeoutError)       acquire did not succeed before its timeout
    │   ├── LeaseLostError                   the lease expired or was taken over while held
    │   ├── NotHeldError                     an operation that needs a held lease, on one that is not held
    │   └── FenceError                       granted, but a resource in fence= could not be fenced (the grant was given back)
    ├── BackendError
    │   ├── BackendUnavailable (ConnectionError)  the token source cannot be reached, or the connection is closed
    │   ├── UnsafeBackendError               the server's configuration cannot give the promised safety
    │   └── AccessDenied (PermissionError)   a lock service refused this client's API key (missing, unknown, not allowed),
    │                                        or a source its credentials (wrong password, no such role, no ACL permission)
    └── ConfigurationError (ValueError)      a bad URL, an unknown scheme, or a backend lacking a required characteristic

Native errors of the clients (sqlite3, psycopg, redis, kazoo, grpc) are translated at the
backend or guard boundary with ``raise ... from exc``, so the original stays in ``__cause__``.
"""

from __future__ import annotations

from typing import Any, Protocol


class _Token(Protocol):
    """What an error needs of a token (``_token`` imports this module, not the reverse)."""

    @property
    def lock(self) -> str: ...

    @property
    def value(self) -> int: ...


__all__ = [
    "AccessDenied",
    "BackendError",
    "BackendUnavailable",
    "ChangeRefusedError",
    "ConfigurationError",
    "CorruptMarkError",
    "FenceConflictError",
    "FenceError",
    "FencedError",
    "InvalidTokenError",
    "LeaseLostError",
    "LockError",
    "LockTimeout",
    "MemberBehindError",
    "NotHeldError",
    "RecordConflict",
    "ReplicationError",
    "ResourceNotFoundError",
    "StaleEpochError",
    "StaleTokenError",
    "UnsafeBackendError",
    "WrongLockError",
    "member_behind_error",
    "stale_epoch_error",
]


class FencedError(Exception):
    """Base class of every error fenced raises."""


class InvalidTokenError(FencedError, ValueError):
    """A fencing token that is malformed, out of range, or otherwise unusable."""


class WrongLockError(InvalidTokenError):
    """A token of one lock was offered where a token of another lock is expected."""


class StaleTokenError(FencedError):
    """The resource has already accepted a higher token; this write is rejected.

    ``token`` is the token the writer offered, ``high_water`` the highest token the resource
    has accepted (``None`` if the guard cannot tell), ``resource`` what was guarded.
    """

    def __init__(
        self,
        token: _Token,
        high_water: _Token | None,
        resource: str | None = None,
        message: str | None = None,
    ) -> None:
        self.token = token
        self.high_water = high_water
        self.resource = resource
        if message is None:
            where = f" on {resource!r}" if resource else ""
            seen = f"{high_water}" if high_water is not None else "a higher token"
            message = f"stale fencing token {token}{where}: the resource has accepted {seen}"
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.token, self.high_water, self.resource, str(self)))


class CorruptMarkError(FencedError):
    """The resource's stored high-water mark cannot be read as a token: fail closed.

    Raised for a mark that is missing while the resource is bound to a lock, empty, not a
    canonical decimal, out of range (0, negative, above ``MAX_TOKEN``) or stored in a
    column or value of the wrong type. No write is accepted, whatever its token, until an
    operator repairs the mark (set it to at least the highest token ever granted). This is
    about the *stored* value; a malformed token offered by the caller is
    :class:`InvalidTokenError`. ``resource`` names the guarded resource, ``detail`` what was
    found (truncated).
    """

    def __init__(self, resource: str, detail: str) -> None:
        self.resource = resource
        self.detail = detail
        super().__init__(
            f"the high-water mark of {resource!r} is corrupt ({detail}): every write is "
            "refused until it is repaired"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.resource, self.detail))


class FenceConflictError(FencedError):
    """The database could not evaluate the fence because of a concurrent transaction.

    Raised for PostgreSQL serialization failures and deadlocks (SQLSTATE class 40) and lock
    timeouts (55P03), and for SQLite's ``SQLITE_BUSY``/``SQLITE_LOCKED`` (for example a
    DEFERRED transaction that read first and then could not upgrade to a writer: use
    ``BEGIN IMMEDIATE``). The fence neither passed nor advanced: roll the transaction back
    and retry it. The driver's error is in ``__cause__``.
    """


class RecordConflict(FencedError):
    """A compare-and-set of a record in the token source (``locks.swap_record``) found another
    version than the one it was based on: someone changed it meanwhile. ``current`` is the
    version found (0: no record). Nothing was written; read it again and decide anew."""

    def __init__(self, name: str, expected: int, current: int) -> None:
        super().__init__(
            f"record {name!r} is at version {current}, not {expected}: it changed meanwhile"
        )
        self.name, self.expected, self.current = name, expected, current

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.expected, self.current))


class ReplicationError(FencedError):
    """A replicated group (``fenced.replicated``) could not complete a write, read or change:
    a member could not be reached and could not be removed (the configuration would lose
    every member that holds the acknowledged writes, or drop below ``min_members``).
    ``failed`` maps member names to their errors. A write that raises it was not
    acknowledged: it may be on some members, and the next writer either completes it on
    all or none."""

    def __init__(self, message: str, failed: dict[str, BaseException] | None = None) -> None:
        super().__init__(message)
        self.failed = dict(failed or {})


class ChangeRefusedError(ReplicationError):
    """A change of a replicated group's configuration refused for safety, nothing changed:
    it would leave fewer than ``min_members``, or no member that holds the acknowledged
    writes (those staying lost their state). Not a failure to reach members: the same
    change fails again until the group's state changes (``fenced group`` exits 65)."""


class StaleEpochError(ReplicationError):
    """A member refused a configuration epoch lower than one it has seen: the group was
    reconfigured. Writers and readers reload the configuration and retry by themselves;
    this reaches the caller only if the configuration kept changing until its deadline.
    ``found``: the epoch the member is at, when known."""

    def __init__(self, message: str, found: int | None = None) -> None:
        super().__init__(message)
        self.found = found

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.found))


class MemberBehindError(ReplicationError):
    """A member of a replicated group refused to act in a configuration it was never fenced
    in: its epoch mark (``found``) is below the one the change needs (``needed``). A member of
    configuration E is at epoch E or above unless it lost its state (restarted empty, flushed,
    restored from an old backup), so it holds none of the acknowledged writes: it counts for
    nothing until a reconfiguration copies the data to it (``group.add(name)``)."""

    def __init__(self, message: str, found: int | None = None, needed: int | None = None) -> None:
        super().__init__(message)
        self.found = found
        self.needed = needed

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.found, self.needed))


def stale_epoch_error(resource: str, found: int, epoch: int) -> StaleEpochError:
    """A member's refusal of ``epoch`` below its epoch mark ``found`` (every member kind)."""
    return StaleEpochError(
        f"{resource!r} is at configuration epoch {found}, above {epoch}: the group was "
        "reconfigured",
        found,
    )


def member_behind_error(resource: str, found: int, since: int) -> MemberBehindError:
    """A member's refusal to act at epoch mark ``found``, below ``since`` (every member kind)."""
    return MemberBehindError(
        f"{resource!r} is at configuration epoch {found}, below {since}: it was never fenced in "
        "the current configuration (it lost its state) and holds none of its writes until "
        "a reconfiguration copies the data to it (group.add)",
        found,
        since,
    )


class ResourceNotFoundError(FencedError, LookupError):
    """The guarded row, key or file does not exist (as opposed to existing with a higher token)."""


class LockError(FencedError):
    """Base class of errors about acquiring, holding and releasing a lock."""


class LockTimeout(LockError, TimeoutError):
    """The lock could not be acquired within the timeout."""


class LeaseLostError(LockError):
    """The lease expired or was taken over while it was believed held."""


class NotHeldError(LockError):
    """The operation needs a held lease, and this one is not held."""


class FenceError(LockError):
    """The lock was granted, but ``fence=`` resources could not have their high-water mark
    raised to the new token (``not_fenced``: ``(target, error)`` pairs); the grant was given
    back. ``fence_errors="report"`` returns the lease instead, with ``lease.not_fenced``."""

    def __init__(self, message: str, not_fenced: list[Any]) -> None:
        super().__init__(message)
        self.not_fenced = not_fenced


class BackendError(FencedError):
    """Base class of errors of the token source."""


class BackendUnavailable(BackendError, ConnectionError):
    """The token source cannot be reached, or its connection has been closed."""


class UnsafeBackendError(BackendError):
    """The token source is configured in a way that cannot provide the promised safety."""


class AccessDenied(BackendError, PermissionError):
    """A lock service (``fenced serve``) refused this client: no API key, an unknown one, or one
    not allowed this verb on this lock name; or a token source refused its credentials (a
    wrong or missing password, a role that does not exist or may not log in, a Redis user
    without the ACL permissions). Nothing was changed, and no retry would help: ``connect``
    raises it at once."""


class ConfigurationError(FencedError, ValueError):
    """A bad URL or option, an unknown scheme, or a backend lacking a required characteristic."""
