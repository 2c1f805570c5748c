"""fenced: distributed locks that hand out fencing tokens, and guards that make resources
reject writes from stale lock holders.

    >>> import fenced
    >>> with fenced.connect("memory://doc") as locks:
    ...     with locks.lock("invoices", ttl=10) as lease:
    ...         print(lease.token)
    invoices:1
"""

from ._backend import Backend, Characteristic, Grant, LockStatus, register_backend
from ._errors import (
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    CorruptMarkError,
    FenceConflictError,
    FencedError,
    InvalidTokenError,
    LeaseLostError,
    LockError,
    LockTimeout,
    NotHeldError,
    ResourceNotFoundError,
    StaleTokenError,
    UnsafeBackendError,
    WrongLockError,
)
from ._lease import DEFAULT_TTL, AsyncLease, AsyncLocks, LostSignal, connect_async
from ._state import Phase
from ._sync import Lease, Locks, connect
from ._token import MAX_TOKEN, FencingToken

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TTL",
    "MAX_TOKEN",
    "AsyncLease",
    "AsyncLocks",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "Characteristic",
    "ConfigurationError",
    "CorruptMarkError",
    "FenceConflictError",
    "FencedError",
    "FencingToken",
    "Grant",
    "InvalidTokenError",
    "Lease",
    "LeaseLostError",
    "LockError",
    "LockStatus",
    "LockTimeout",
    "Locks",
    "LostSignal",
    "NotHeldError",
    "Phase",
    "ResourceNotFoundError",
    "StaleTokenError",
    "UnsafeBackendError",
    "WrongLockError",
    "__version__",
    "connect",
    "connect_async",
    "register_backend",
]
