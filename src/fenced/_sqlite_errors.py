"""What a ``sqlite3`` error means, decided once for the SQLite source and the SQLite guards."""

from __future__ import annotations

import sqlite3
from typing import Final

__all__ = ["BUSY_CODES", "UNAVAILABLE_CODES", "is_busy", "is_unavailable", "primary_code"]

BUSY_CODES: Final = frozenset({5, 6})
"""SQLITE_BUSY, SQLITE_LOCKED (any extended code): another connection holds a lock; retry."""
UNAVAILABLE_CODES: Final = frozenset({10, 11, 14, 26})
"""SQLITE_IOERR, SQLITE_CORRUPT, SQLITE_CANTOPEN, SQLITE_NOTADB: the file is not usable."""


def primary_code(exc: BaseException) -> int | None:
    """The primary result code of a sqlite3 error (None if the driver gave none)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def is_busy(exc: BaseException) -> bool:
    """True for "the database is locked" in any form (busy, locked, a stale WAL snapshot)."""
    if not isinstance(exc, sqlite3.Error):
        return False
    code = primary_code(exc)
    if code is not None:
        return code in BUSY_CODES
    return "locked" in str(exc)


def is_unavailable(exc: BaseException) -> bool:
    """True when the database file cannot be used (I/O error, corrupt, cannot open)."""
    return isinstance(exc, sqlite3.Error) and primary_code(exc) in UNAVAILABLE_CODES
