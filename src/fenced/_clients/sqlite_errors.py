"""What a ``sqlite3`` error means, decided once for the SQLite source and the SQLite guards."""

from __future__ import annotations

import errno
import os
import sqlite3
import tempfile
from typing import Final

__all__ = [
    "BUSY_CODES",
    "UNAVAILABLE_CODES",
    "is_busy",
    "is_unavailable",
    "primary_code",
    "unusable",
]

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


_CORRUPT, _CANTOPEN, _NOTADB = 11, 14, 26
_DENIED: Final = frozenset({3, 8, 23, 1032, 1544})
"""Extended codes no retry mends: SQLITE_PERM, SQLITE_READONLY (plain, DBMOVED, DIRECTORY),
SQLITE_AUTH. (READONLY_RECOVERY, _CANTLOCK, _CANTINIT, _ROLLBACK wait for a writer: retried.)"""
_NEVER: Final = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR})
"""What opening a file can fail with that no retry mends (EMFILE, ENOSPC... may pass)."""


def unusable(path: str, exc: BaseException | None, *, read_only: bool = False) -> str | None:
    """Why opening the database ``path`` failed with ``exc`` and can never succeed as things
    are (one line), or None if a retry might: not a database, damaged, a directory, a file
    or directory this user may not use."""
    if not isinstance(exc, sqlite3.Error):
        return None
    code = primary_code(exc)
    if os.path.isdir(path):
        return f"{path} is a directory, not a SQLite database file"
    if code == _NOTADB:
        return f"{path} is not a SQLite database (left as it is)"
    if code == _CORRUPT:
        return f"{path} is a damaged SQLite database ({exc})"
    directory = os.path.dirname(path)
    denied = getattr(exc, "sqlite_errorcode", None) in _DENIED
    if code == _CANTOPEN or denied:
        why = _denied(path, directory, read_only)
        if why is not None or denied:
            return (
                f"{path} cannot be opened by this user ({why or exc}): fenced needs to "
                f"{'read' if read_only else 'write'} it, and its -wal and -shm files in "
                f"{directory}"
            )
    return None


def _denied(path: str, directory: str, read_only: bool) -> str | None:
    """Why this user can never open ``path`` as SQLite needs to (None: it can, or it is not
    known why not). sqlite3 reports only "unable to open database file", whatever the cause,
    and ``os.access`` says yes to root where a filesystem still refuses, so the file and a
    scratch file beside it are opened as SQLite would (never the database's own name
    created: another process may be creating it right now)."""
    try:
        if os.path.exists(path):
            os.close(os.open(path, os.O_RDONLY if read_only else os.O_RDWR))
        if not read_only:
            fd, probe = tempfile.mkstemp(dir=directory, prefix=".fenced-probe-")
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        if exc.errno in _NEVER:
            return exc.strerror
    return None
