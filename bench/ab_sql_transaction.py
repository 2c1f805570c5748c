"""``SQLGuard.transaction`` of two trees in one run: this tree's against another revision's
(imported as a second package, ``fenced_old``), interleaved transaction by transaction with
the unfenced peer, so that drifting load hits the three alike.

Each transaction is one UPDATE of one row: unfenced (``BEGIN``, the UPDATE, ``COMMIT``), or
inside ``guard.transaction`` of either tree. Reported: the p50 of each, the client's CPU per
transaction (``process_time``), and the median over 20 slices of each ratio. Engines as in
bench_sql_guard.py: SQLite (file, WAL, ``synchronous=FULL``, ``isolation_level=None``),
PostgreSQL and MariaDB (fresh servers, fsync on). On PostgreSQL the two trees use one
connection each (both PREPARE the check under one name).

Run: ``.venv/bin/python bench/ab_sql_transaction.py [--rev REV] [-n N] [ENGINE ...]``
(REV: the revision to compare with, default ``HEAD~1``; N transactions per variant).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SLICES = 20
TOKEN = "accounts:42"
UPDATE = "UPDATE accounts SET balance = %d WHERE id = 1"


def old_tree(rev: str, into: Path) -> None:
    """``src/fenced`` at ``rev``, as the package ``fenced_old`` under ``into``."""
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", rev, "src/fenced"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "src" / "fenced").rename(into / "fenced_old")
    sys.path.insert(0, str(into))


def variants(
    old: Any, new: Any, conns: tuple[Any, Any], begin: Callable[[], object],
    commit: Callable[[], object], execute: tuple[Callable[[str], object], Callable[[str], object]],
) -> dict[str, Callable[[], None]]:  # fmt: skip
    before, after = old.SQLGuard("accounts"), new.SQLGuard("accounts")
    tok_before = old.FencingToken.coerce(TOKEN, "accounts")
    tok_after = new.FencingToken.coerce(TOKEN, "accounts")
    n = iter(range(10**9))

    def unfenced() -> None:
        begin()
        execute[0](UPDATE % next(n))
        commit()

    def guarded_before() -> None:
        with before.transaction(conns[0], token=tok_before):
            execute[0](UPDATE % next(n))

    def guarded_after() -> None:
        with after.transaction(conns[1], token=tok_after):
            execute[1](UPDATE % next(n))

    return {"unfenced": unfenced, "before": guarded_before, "after": guarded_after}


def interleave(ops: dict[str, Callable[[], None]], n: int) -> None:
    for op in ops.values():
        for _ in range(20):
            op()
    names = list(ops)
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu = dict.fromkeys(names, 0.0)
    for i in range(n):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            c0, t0 = time.process_time(), time.perf_counter()
            ops[name]()
            t1, c1 = time.perf_counter(), time.process_time()
            wall[name].append(t1 - t0)
            cpu[name] += c1 - c0

    def ratio(a: str, b: str) -> float:
        size = max(1, n // SLICES)
        return statistics.median(
            statistics.fmean(wall[a][i : i + size]) / statistics.fmean(wall[b][i : i + size])
            for i in range(0, n - size + 1, size)
        )

    p50 = {k: statistics.median(v) * 1e6 for k, v in wall.items()}
    print("  p50 µs: " + ", ".join(f"{k} {p50[k]:.1f}" for k in names))
    print(
        "  client CPU µs per transaction: "
        + ", ".join(f"{k} {cpu[k] / n * 1e6:.1f}" for k in names)
    )
    print(
        f"  median of {SLICES} slices: before ÷ unfenced {ratio('before', 'unfenced'):.3f}, "
        f"after ÷ unfenced {ratio('after', 'unfenced'):.3f}, "
        f"after ÷ before {ratio('after', 'before'):.3f}"
    )


def run(engine: str, n: int, old: Any, new: Any) -> None:
    from fenced.testing.servers import MariaDBServer, PostgresServer

    print(f"{engine} (n={n}, load average {os.getloadavg()[0]:.1f})")
    if engine == "SQLite":
        with tempfile.TemporaryDirectory() as d:
            conn = sqlite3.connect(os.path.join(d, "b.db"), isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER)")
            conn.execute("INSERT INTO accounts VALUES (1, 0)")
            new.SQLGuard("accounts").install(conn)
            cur = conn.cursor()
            ops = variants(
                old, new, (conn, conn), lambda: cur.execute("BEGIN IMMEDIATE"),
                lambda: cur.execute("COMMIT"), (conn.execute, conn.execute),
            )  # fmt: skip
            interleave(ops, n)
            conn.close()
    elif engine == "PostgreSQL":
        import psycopg

        with PostgresServer() as server:
            a = psycopg.connect(server.dsn, autocommit=True)
            b = psycopg.connect(server.dsn, autocommit=True)
            a.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance BIGINT)")
            a.execute("INSERT INTO accounts VALUES (1, 0)")
            new.SQLGuard("accounts").install(a)
            ops = variants(
                old, new, (a, b), lambda: a.execute("BEGIN"), lambda: a.execute("COMMIT"),
                (a.execute, b.execute),
            )  # fmt: skip
            interleave(ops, n)
            a.close()
            b.close()
    else:
        import pymysql

        with MariaDBServer() as server:
            conn = pymysql.connect(
                host="127.0.0.1", port=server.port, user="root", database="fenced"
            )

            def execute(sql: str) -> None:
                with conn.cursor() as cur:
                    cur.execute(sql)

            execute("CREATE TABLE accounts (id INT PRIMARY KEY, balance BIGINT) ENGINE=InnoDB")
            execute("INSERT INTO accounts VALUES (1, 0)")
            conn.commit()
            new.SQLGuard("accounts").install(conn)
            # (autocommit off, PyMySQL's default: the unfenced transaction opens at its UPDATE)
            ops = variants(old, new, (conn, conn), lambda: None, conn.commit, (execute, execute))
            interleave(ops, n)
            conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD~1")
    parser.add_argument("-n", type=int, default=2000)
    parser.add_argument("engines", nargs="*", default=["SQLite", "PostgreSQL", "MariaDB"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fenced-ab-") as d:
        old_tree(args.rev, Path(d))
        import fenced_old.guards.sql as old  # type: ignore[import-not-found]

        import fenced.guards.sql as new

        print(f"SQLGuard.transaction: before = {args.rev}, after = this tree")
        for engine in args.engines:
            run(engine, args.n, old, new)


if __name__ == "__main__":
    main()
