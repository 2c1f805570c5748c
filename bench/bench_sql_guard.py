"""Cost of the SQL guard: a one-row UPDATE transaction, fenced vs unfenced.

Engines: SQLite (file, WAL, synchronous=FULL) and PostgreSQL (a fresh ``PostgresServer``,
fsync=on, synchronous_commit=on), one sequential client each. Each transaction is
``BEGIN; [fence]; UPDATE accounts SET balance = ? WHERE id = 1; COMMIT``:

* unfenced - no fence (the peer);
* SQLGuard - ``SQLGuard.check`` (one extra INSERT .. ON CONFLICT DO UPDATE .. RETURNING);
* RowGuard - the UPDATE itself carries the fence (``RowGuard.update``).

Variants are interleaved in rounds so drift (other load, checkpoints) hits them alike.
Target: fenced time <= 1.10x unfenced. Run: ``.venv/bin/python bench/bench_sql_guard.py``.
"""

from __future__ import annotations

import os
import sqlite3
import statistics
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import psycopg

sys.path.insert(0, os.path.dirname(__file__))
from _common import Result, fmt_us, measure, table

from fenced import FencingToken
from fenced.guards.sql import RowGuard, SQLGuard
from fenced.testing.servers import PostgresServer

TOKEN = FencingToken("accounts", 42)
ROUNDS = 20


def interleaved(
    variants: dict[str, Callable[[], object]], n: int
) -> tuple[dict[str, Result], dict[str, list[float]]]:
    """Run the variants in ``ROUNDS`` alternating rounds of ``n``; merge each one's samples.

    Also returns, per variant, its mean time / the unfenced mean time in each round: the
    median of those is robust to load that drifts during the run.
    """
    merged = {name: Result(name) for name in variants}
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(ROUNDS):
        order = list(variants.items())
        if r % 2:
            order.reverse()
        this_round = {}
        for name, op in order:
            res = measure(name, op, n=n, warmup=10)
            this_round[name] = res.mean
            m = merged[name]
            m.samples += res.samples
            m.elapsed += res.elapsed
            m.ops += res.ops
        for name, mean in this_round.items():
            ratios[name].append(mean / this_round["unfenced"])
    return merged, ratios


def make_ops(conn: Any, begin: str, q: Callable[[str], str]) -> dict[str, Callable[[], object]]:
    guard, rows = SQLGuard("accounts"), RowGuard("accounts", lock="accounts")
    guard.install(conn)
    conn.execute("CREATE TABLE IF NOT EXISTS accounts (id INTEGER PRIMARY KEY, balance BIGINT)")
    conn.execute(q("INSERT INTO accounts (id, balance) VALUES (1, 0) ON CONFLICT DO NOTHING"))
    rows.install(conn)
    update = q("UPDATE accounts SET balance = ? WHERE id = 1")
    counter = iter(range(10**9))

    def unfenced() -> None:
        conn.execute(begin)
        conn.execute(update, (next(counter),))
        conn.execute("COMMIT")

    def fence_table() -> None:
        conn.execute(begin)
        guard.check(conn, TOKEN)
        conn.execute(update, (next(counter),))
        conn.execute("COMMIT")

    def row_form() -> None:
        conn.execute(begin)
        rows.update(conn, TOKEN, key={"id": 1}, values={"balance": next(counter)})
        conn.execute("COMMIT")

    return {"unfenced": unfenced, "SQLGuard": fence_table, "RowGuard": row_form}


def report(engine: str, res: dict[str, Result], ratios: dict[str, list[float]]) -> list[str]:
    base = res["unfenced"]
    lines = []
    for name in ("SQLGuard", "RowGuard"):
        r = res[name]
        lines.append(
            f"{engine} {name}: time fenced/unfenced: median of {ROUNDS} rounds "
            f"{statistics.median(ratios[name]):.3f}x, overall mean {r.mean / base.mean:.3f}x, "
            f"p50 {r.p50 / base.p50:.3f}x ({fmt_us(r.p50 - base.p50)} per transaction at p50)"
        )
    return lines


def bench_sqlite(n: int) -> tuple[dict[str, Result], dict[str, list[float]]]:
    with tempfile.TemporaryDirectory(prefix="fenced-bench-sql-") as d:
        conn = sqlite3.connect(os.path.join(d, "bench.db"), isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        try:
            return interleaved(make_ops(conn, "BEGIN IMMEDIATE", lambda s: s), n)
        finally:
            conn.close()


def bench_postgres(n: int) -> tuple[dict[str, Result], dict[str, list[float]]]:
    with PostgresServer() as server, psycopg.connect(server.dsn, autocommit=True) as conn:
        return interleaved(make_ops(conn, "BEGIN", lambda s: s.replace("?", "%s")), n)


def main() -> None:
    notes: list[str] = []
    rows: list[tuple[str, Result, Result]] = []
    for engine, run, n in (("SQLite", bench_sqlite, 250), ("PostgreSQL", bench_postgres, 150)):
        res, ratios = run(n)
        for name in ("SQLGuard", "RowGuard"):
            rows.append((f"{engine}: 1-row UPDATE txn", res[name], res["unfenced"]))
        notes += report(engine, res, ratios)
    table(
        "SQL guard: fenced vs unfenced one-row UPDATE transaction (ratio = fenced ops/s ÷ unfenced)",
        rows,
        "\n".join(notes) + "\ntarget: fenced time <= 1.10x unfenced",
    )


if __name__ == "__main__":
    main()
