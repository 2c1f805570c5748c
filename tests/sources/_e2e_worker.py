"""Client processes for the end-to-end tests: M guarded read-modify-write updates under a lock.

python -m tests.sources._e2e_worker SOURCE_URL STORAGE LOCK M [N]

N client processes (default 1), all forked from this one before anything connected: each is
an OS process of its own with its own connections, and they run at once; the interpreter
start and the imports (0.3-0.5 s of CPU) are paid once, not N times. Exits 1 if any failed
(its traceback on stderr).
"""

from __future__ import annotations

import os
import sqlite3
import sys
import traceback
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


def run_processes(url: str, storage: str, lock: str, m: int, n: int) -> int:
    if storage.startswith("postgresql://"):
        import psycopg  # noqa: F401  (once, before the forks)
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                main(url, storage, lock, m)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = [status for status in (os.waitpid(pid, 0)[1] for pid in pids) if status != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    n = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    sys.exit(run_processes(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), n))
