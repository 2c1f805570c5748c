"""A resource adapter of the kind a user writes for ``fenced check --resource
python:MODULE:CLASS``: a register in a SQLite file, fenced by hand in one transaction (used by
tests/kit/test_check_resources.py)."""

from __future__ import annotations

import os
import sqlite3
import threading
import warnings
from collections.abc import Callable

import fenced


class Adapter:
    def __init__(self, lock: str) -> None:
        self.lock = lock
        self.db = sqlite3.connect(os.environ["CHECK_ADAPTER_DB"], timeout=30, isolation_level=None)
        self.db.execute("CREATE TABLE IF NOT EXISTS reg (id INTEGER PRIMARY KEY, data, mark)")

    def _fence(self, token: fenced.FencingToken | None) -> None:
        # The lock's name first: another lock's token (or none) is no token of this register's
        # lock, whatever its value (the kit's impostor nemesis sends both).
        if token is None or token.lock != self.lock:
            raise fenced.InvalidTokenError(f"not a token of lock {self.lock!r}: {token}")
        row = self.db.execute("SELECT mark FROM reg WHERE id = 1").fetchone()
        mark = row[0] if row else 0
        if token.value < mark:
            raise fenced.StaleTokenError(token, fenced.FencingToken(self.lock, mark), "reg")
        self.db.execute(
            "INSERT INTO reg VALUES (1, NULL, ?) ON CONFLICT (id) DO UPDATE SET mark = ?",
            (token.value, token.value),
        )

    def reset(self) -> None:
        self.db.execute("DELETE FROM reg")

    def read(self, token: fenced.FencingToken) -> bytes | None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self._fence(token)
            data = self.db.execute("SELECT data FROM reg WHERE id = 1").fetchone()[0]
        finally:
            self.db.execute("COMMIT")
        return data

    def write(self, token: fenced.FencingToken | None, data: bytes) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self._fence(token)
            self.db.execute("UPDATE reg SET data = ? WHERE id = 1", (data,))
        finally:
            self.db.execute("COMMIT")

    def final(self) -> tuple[bytes | None, int | None]:
        row = self.db.execute("SELECT data, mark FROM reg WHERE id = 1").fetchone()
        return (row[0], row[1]) if row else (None, None)

    def close(self) -> None:
        self.db.close()


class CheckThenWrite(Adapter):
    """The common mistake, in a user's adapter that says its write is two steps
    (``fenced.testing.check.SplitWrite``): the token checked in one transaction, the data
    written in the next. The kit stalls its workers between the two."""

    def _check(self, token: fenced.FencingToken | None) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self._fence(token)
        finally:
            self.db.execute("COMMIT")

    def _store(self, data: bytes) -> None:
        self.db.execute("UPDATE reg SET data = ? WHERE id = 1", (data,))

    def write_steps(
        self, token: fenced.FencingToken | None, data: bytes
    ) -> list[Callable[[], None]]:
        return [lambda: self._check(token), lambda: self._store(data)]

    def write(self, token: fenced.FencingToken | None, data: bytes) -> None:
        for step in self.write_steps(token, data):
            step()


class CrashMidRun(Adapter):
    """A client that takes its process down (tests/kit/test_check_operator.py): the 5th write
    of a worker exits its process."""

    writes = 0

    def write(self, token: fenced.FencingToken, data: bytes) -> None:
        CrashMidRun.writes += 1
        if CrashMidRun.writes == 5:
            os._exit(3)
        super().write(token, data)


class HangWrites(Adapter):
    """A client whose writes never return once the first went through (a hung connection)."""

    writes = 0

    def write(self, token: fenced.FencingToken, data: bytes) -> None:
        HangWrites.writes += 1
        if HangWrites.writes > 1:
            threading.Event().wait()  # (for ever: the kit must bound it, not the adapter)
        super().write(token, data)


class Warns(Adapter):
    """A correct adapter on a deprecated client API: a DeprecationWarning at each write."""

    def write(self, token: fenced.FencingToken, data: bytes) -> None:
        warnings.warn("this client API is deprecated", DeprecationWarning, stacklevel=2)
        super().write(token, data)


class PlainCheckThenWrite(Adapter):
    """The same mistake in a one-step ``write()`` the kit cannot see into (no ``write_steps``):
    the token checked (and the mark raised) in one transaction, the data written in the next,
    right after it (no gap). Only a stall inside the write reaches the window
    (``_worker.InWrite``)."""

    def write(self, token: fenced.FencingToken, data: bytes) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self._fence(token)
        finally:
            self.db.execute("COMMIT")
        self.db.execute("UPDATE reg SET data = ? WHERE id = 1", (data,))


class CaseBlindLock(Adapter):
    """Compares lock names case-blind (``.lower()``, or a MySQL ``*_ci`` fence column): a
    token of lock ``COUNTER`` passes for one of ``counter``, and its value moves the mark."""

    def _fence(self, token: fenced.FencingToken | None) -> None:
        if token is not None and token.lock.lower() == self.lock.lower():
            token = fenced.FencingToken(self.lock, token.value)
        super()._fence(token)


class ReadLockIgnored(Adapter):
    """Writes fenced right, reads fenced by the token's value alone (the lock's name checked
    on the write path only): another lock's token is served, and raises the mark with it."""

    def read(self, token: fenced.FencingToken) -> bytes | None:
        if token is not None and token.lock != self.lock:
            token = fenced.FencingToken(self.lock, token.value)  # (the mistake)
        return super().read(token)


class ReadRefusedMarkMoved(Adapter):
    """Refuses another lock's token on a read, but only after raising the mark with its value
    (and the refusal commits what came before it): the impostor is refused, and the rightful
    holder is refused from then on."""

    def read(self, token: fenced.FencingToken) -> bytes | None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute(  # (the mistake: the mark first, the lock's name after)
                "INSERT INTO reg VALUES (1, NULL, ?) ON CONFLICT (id) DO UPDATE "
                "SET mark = max(mark, ?)",
                (token.value, token.value),
            )
            self._fence(token)
            data = self.db.execute("SELECT data FROM reg WHERE id = 1").fetchone()[0]
        finally:
            self.db.execute("COMMIT")
        return data


class ResetKeepsMark(Adapter):
    """A ``reset()`` that empties the register and keeps its mark (an outside tester's): after
    an earlier run, every token of a fresh source is below it."""

    def reset(self) -> None:
        self.db.execute("UPDATE reg SET data = NULL")


class ResetKeepsHiddenMark(ResetKeepsMark):
    """The same, with a ``final()`` that reports no mark (as an HTTP service without a
    ``Fenced-High-Water`` header): only a fenced request under a low token shows it."""

    def final(self) -> tuple[bytes | None, int | None]:
        return super().final()[0], None


class OffByOne(Adapter):
    """Refuses only tokens two below the mark (``token + 1 < mark``, where ``token < mark``
    belongs): the previous holder's late write gets in (an outside tester's)."""

    def _fence(self, token: fenced.FencingToken | None) -> None:
        if token is None or token.lock != self.lock:
            raise fenced.InvalidTokenError(f"not a token of lock {self.lock!r}: {token}")
        row = self.db.execute("SELECT mark FROM reg WHERE id = 1").fetchone()
        mark = row[0] if row else 0
        if token.value + 1 < mark:  # (the mistake)
            raise fenced.StaleTokenError(token, fenced.FencingToken(self.lock, mark), "reg")
        self.db.execute(
            "INSERT INTO reg VALUES (1, NULL, ?) ON CONFLICT (id) DO UPDATE "
            "SET mark = max(mark, ?)",
            (token.value, token.value),
        )


class UnfencedRead(Adapter):
    """Writes fenced, the read before them not (no mark raised): a late writer gets in after
    the successor read (an outside tester's)."""

    def read(self, token: fenced.FencingToken) -> bytes | None:
        row = self.db.execute("SELECT data FROM reg WHERE id = 1").fetchone()
        return row[0] if row else None
