"""A client process for the end-to-end tests: M guarded read-modify-write updates under a lock.

python -m tests.sources._e2e_worker SOURCE_URL STORAGE LOCK M
"""

from __future__ import annotations

import os
import sqlite3
import sys
from typing import Any

import fenced
from fenced.guards.sql import SQLGuard


def connect_storage(storage: str) -> tuple[Any, str]:
    if storage.startswith("postgresql://"):
        import psycopg

        return psycopg.connect(storage, autocommit=True), "%s"
    return sqlite3.connect(storage, isolation_level=None, timeout=30), "?"


def main(url: str, storage: str, lock: str, m: int) -> None:
    db, p = connect_storage(storage)
    guard = SQLGuard(lock)
    begin = "BEGIN" if p == "%s" else "BEGIN IMMEDIATE"
    with fenced.connect(url) as locks:
        for i in range(m):
            with locks.lock(lock, ttl=10, timeout=120) as lease:
                db.execute(begin)
                try:
                    guard.check(db, token=lease.token)
                    (value,) = db.execute("SELECT value FROM counter WHERE id = 1").fetchone()
                    db.execute(f"UPDATE counter SET value = {p} WHERE id = 1", (value + 1,))
                    db.execute(
                        f"INSERT INTO writes (token, pid, seq) VALUES ({p}, {p}, {p})",
                        (lease.token.value, os.getpid(), i),
                    )
                    db.execute("COMMIT")
                except BaseException:
                    db.execute("ROLLBACK")
                    raise


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
