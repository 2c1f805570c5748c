"""What every resource of the kit shares, apart from the resources themselves so that the
planted ones (``_plants``) and the real ones (``_resources``, which opens both by URL) stand
on it without importing each other: the :class:`Resource` protocol (public as
``fenced.testing.check.Resource``), which the campaign's workers and the simulator use alike,
and its two optional capabilities."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable
from urllib.parse import parse_qs, urlsplit

from ..._core.token import FencingToken

__all__ = ["KEY", "Resource", "SplitWrite", "Volatile", "query_of", "sqlite_transaction"]


@runtime_checkable
class Resource(Protocol):
    """A register the kit's workers (and the simulator's clients) read and write under their
    token (see ``_resources`` for what each method must do)."""

    def reset(self) -> None:
        """Empty the register and forget the mark (once, before any worker)."""

    def read(self, token: FencingToken) -> bytes | None:
        """The register's bytes (None when empty), read fenced if the resource can."""
        ...

    def write(self, token: FencingToken, data: bytes) -> None:
        """Replace the register unless ``token`` is below the mark, in one atomic step; else
        raise :class:`~fenced.StaleTokenError` and write nothing."""

    def final(self) -> tuple[bytes | None, int | None]:
        """At the end: the register's bytes and the mark (None when it cannot say)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class SplitWrite(Protocol):
    """A resource whose write is several steps (a planted check-then-write): the kit runs
    them one by one, a worker's stall before the last — the window such a resource leaves
    open — and the simulator sends each as a message of its own."""

    def write_steps(self, token: FencingToken, data: bytes) -> Sequence[Callable[[], None]]:
        """The steps of ``write(token, data)``, in order."""
        ...


@runtime_checkable
class Volatile(Protocol):
    """A resource with state its process keeps only in memory (a planted mark in memory)."""

    def crash(self) -> None:
        """Lose what a kill -9 and a restart of the resource's process lose."""


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
