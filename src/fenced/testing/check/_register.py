"""What every resource of the kit shares, apart from the resources themselves so that the
planted ones (``_plants``) and the real ones (``_resources``, which opens both by URL) stand
on it without importing each other."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator
from urllib.parse import parse_qs, urlsplit

__all__ = ["KEY", "query_of", "sqlite_transaction"]

KEY = "fenced-check"
"""The one row (key) of a resource the kit's workers read and write."""


def query_of(url: str) -> dict[str, str]:
    """A URL's query parameters, the last of each name."""
    return {k: v[-1] for k, v in parse_qs(urlsplit(url).query).items()}


@contextlib.contextmanager
def sqlite_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    conn.execute("BEGIN IMMEDIATE")  # the writer's lock first: no upgrade deadlock
    try:
        yield
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
