"""fenced: distributed locks that hand out fencing tokens, and guards that make resources
reject writes from stale lock holders.

    >>> import fenced
    >>> with fenced.connect("memory://doc") as locks:
    ...     with locks.lock("invoices", ttl=10) as lease:
    ...         print(lease.token)
    invoices:1
"""

import logging as _logging

from ._core.backend import (
    Backend,
    Characteristic,
    Grant,
    LockStatus,
    Record,
    TokenCheck,
    register_backend,
)
from ._core.ceiling import AboveCeilingError, Ceiling
from ._core.errors import (
    AccessDenied,
    BackendError,
    BackendUnavailable,
    ChangeRefusedError,
    ConfigurationError,
    CorruptMarkError,
    FenceConflictError,
    FencedError,
    FenceError,
    InvalidTokenError,
    LeaseLostError,
    LockError,
    LockTimeout,
    MemberBehindError,
    NotHeldError,
    RecordConflict,
    ReplicationError,
    ResourceNotFoundError,
    StaleEpochError,
    StaleTokenError,
    UnsafeBackendError,
    WrongLockError,
)
from ._core.lease import DEFAULT_TTL, AsyncLease, AsyncLocks, LostSignal, connect_async
from ._core.signing import (
    Ed25519SigningKey,
    Ed25519VerifyKey,
    HmacKey,
    Keyring,
    SignatureError,
    load_key,
    load_keys,
    verify_all,
)
from ._core.state import Phase
from ._core.sync import Lease, Locks, connect
from ._core.token import MAX_TOKEN, FencingToken, TokenLike

__version__ = "0.2.0"

# A library never prints by itself: without this, Python's last-resort handler wrote fenced's
# warnings (a lost lease) to stderr in applications that had configured no logging.
_logging.getLogger("fenced").addHandler(_logging.NullHandler())

__all__ = [
    "DEFAULT_TTL",
    "MAX_TOKEN",
    "AboveCeilingError",
    "AccessDenied",
    "AsyncLease",
    "AsyncLocks",
    "Backend",
    "BackendError",
    "BackendUnavailable",
    "Ceiling",
    "ChangeRefusedError",
    "Characteristic",
    "ConfigurationError",
    "CorruptMarkError",
    "Ed25519SigningKey",
    "Ed25519VerifyKey",
    "FenceConflictError",
    "FenceError",
    "FencedError",
    "FencingToken",
    "Grant",
    "HmacKey",
    "InvalidTokenError",
    "Keyring",
    "Lease",
    "LeaseLostError",
    "LockError",
    "LockStatus",
    "LockTimeout",
    "Locks",
    "LostSignal",
    "MemberBehindError",
    "NotHeldError",
    "Phase",
    "Record",
    "RecordConflict",
    "ReplicationError",
    "ResourceNotFoundError",
    "SignatureError",
    "StaleEpochError",
    "StaleTokenError",
    "TokenCheck",
    "TokenLike",
    "UnsafeBackendError",
    "WrongLockError",
    "__version__",
    "connect",
    "connect_async",
    "load_key",
    "load_keys",
    "register_backend",
    "verify_all",
]
