"""Planted bugs the power-loss tests must catch (test-only subclasses; the product is unchanged).

``AcksBeforeFsync``: the SQLite source with its commits made ``synchronous=OFF`` (into the
kernel, no fsync) and the WAL fsynced a while later by a background thread: every caller is
told of its grant before the grant is durable. ``kill -9`` cannot tell this from the real
source (the kernel keeps what was written); a power cut can.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from typing import Any

from fenced.backends.sqlite import SQLiteBackend

FSYNC_EVERY = 0.05  # the window a real bug leaves open (a "lazy" fsync), seconds


class _NoSync(sqlite3.Connection):
    """Every ``PRAGMA synchronous=...`` becomes ``OFF``: commits write, never fsync."""

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.upper().replace(" ", "").startswith("PRAGMASYNCHRONOUS="):
            sql = "PRAGMA synchronous=OFF"
        return super().execute(sql, *args)


class AcksBeforeFsync(SQLiteBackend):
    """Planted: acknowledges each commit before its fsync (see module doc)."""

    def _connect(self, shared: bool = False) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path,
            timeout=0,
            isolation_level=None,
            check_same_thread=not shared,
            factory=_NoSync,
        )
        conn.execute("PRAGMA journal_mode=WAL").fetchall()
        conn.execute("PRAGMA synchronous=FULL").fetchall()  # (made OFF)
        if not getattr(self, "_syncer", None):
            self._syncer = threading.Thread(target=self._lazy_fsync, daemon=True)
            self._syncer.start()
        return conn

    def _lazy_fsync(self) -> None:
        stop = threading.Event()
        while not stop.wait(FSYNC_EVERY):
            with contextlib.suppress(OSError):
                fd = os.open(self.path + "-wal", os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
