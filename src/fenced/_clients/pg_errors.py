"""What a psycopg error means, decided once for the PostgreSQL source and the SQL guards."""

from __future__ import annotations

import re
import sys
from typing import Any, Final, Literal

from .._core.errors import AccessDenied, ConfigurationError, FencedError

__all__ = ["Kind", "connect_refusal", "kind"]

Kind = Literal["unreachable", "conflict", "read-only", "schema", "type", "other"]

_UNREACHABLE: Final = frozenset({"57P01", "57P02", "57P03"})  # shutdown, crash, starting up
_CONFLICT: Final = frozenset({"55P03"})  # lock_not_available (lock_timeout); and class 40
_SCHEMA: Final = frozenset({"42P01", "42703", "42P10"})  # undefined table/column, no unique key
_TYPE: Final = frozenset({"42883", "22003"})  # e.g. text <= bigint; an int4 column overflowing


def kind(exc: BaseException, conn: Any = None) -> Kind | None:
    """The kind of a psycopg error (None if ``exc`` is not one).

    ``conflict``: a concurrent transaction kept the statement from deciding (serialization
    failure, deadlock, lock timeout): retry the transaction. ``unreachable``: the connection
    or the server is gone. ``schema``/``type``: the database lacks or mistypes what the
    statement needs. ``read-only``: a standby.
    """
    pg = sys.modules.get("psycopg")
    if pg is None or not isinstance(exc, pg.Error):
        return None
    state = getattr(exc, "sqlstate", None)
    if state is not None and (state.startswith("40") or state in _CONFLICT):
        return "conflict"
    if isinstance(exc, pg.errors.ReadOnlySqlTransaction):
        return "read-only"
    broken = conn is not None and (getattr(conn, "broken", False) or getattr(conn, "closed", False))
    if isinstance(exc, pg.InterfaceError | pg.OperationalError) and (
        state is None or state.startswith("08") or state in _UNREACHABLE or broken
    ):
        return "unreachable"
    if state in _SCHEMA:
        return "schema"
    if state in _TYPE:
        return "type"
    return "other"


# What the server (or libpq) says when it will never let this client in as configured. A
# connection that fails so carries no SQLSTATE in psycopg (libpq reports it as text), so the
# server's English messages are matched; under another lc_messages they are retried as before.
_DENIED_TEXT: Final = (
    "password authentication failed",
    "no password supplied",
    "no pg_hba.conf entry",
    "is not permitted to log in",
    "pg_hba.conf rejects connection",
    "certificate authentication failed",
)
_ROLE_RE: Final = re.compile(r'role "[^"]*" does not exist')
_DATABASE_RE: Final = re.compile(r'database "[^"]*" does not exist')


def connect_refusal(exc: BaseException) -> FencedError | None:
    """AccessDenied / ConfigurationError for a connection no retry will let in, else None."""
    pg = sys.modules.get("psycopg")
    if pg is None or not isinstance(exc, pg.OperationalError):
        return None
    text = " ".join(str(exc).split())  # one line (libpq reports each host tried on its own)
    if any(t in text for t in _DENIED_TEXT) or _ROLE_RE.search(text):
        return AccessDenied(f"PostgreSQL refused this client: {text}")
    missing = _DATABASE_RE.search(text)
    if missing is not None:
        return ConfigurationError(f"PostgreSQL: {missing.group(0)}")
    return None
