"""Cost of the SQL guard: a one-row UPDATE transaction, fenced vs unfenced.

Engines: SQLite (file, WAL, synchronous=FULL), PostgreSQL (a fresh ``PostgresServer``,
fsync=on, synchronous_commit=on) and MariaDB (a fresh ``MariaDBServer``, InnoDB,
innodb_flush_log_at_trx_commit=1; PyMySQL), one sequential client each. Each transaction is
``BEGIN; [fence]; UPDATE accounts SET balance = ? WHERE id = 1; COMMIT``:

* unfenced - no fence (the peer);
* SQLGuard - ``SQLGuard.check`` (one extra INSERT .. ON CONFLICT DO UPDATE .. RETURNING);
* SQLGuard.begin - ``SQLGuard.begin``: BEGIN and the fence in one round trip (PostgreSQL);
* RowGuard - the UPDATE itself carries the fence (``RowGuard.update``);
* SQLGuard.transaction - ``with guard.transaction(conn, token=...)``: on PostgreSQL the check
  rides with BEGIN (``BEGIN; EXECUTE <check>``, one message), the UPDATE, and the recheck
  with COMMIT (``EXECUTE <recheck>; COMMIT``): the unfenced transaction's three round trips;
  on SQLite ``BEGIN IMMEDIATE``, the check, the UPDATE, COMMIT; elsewhere ``begin`` + COMMIT;
* ride SQL by hand - (PostgreSQL) the same three messages sent straight through psycopg, no
  fenced code: the floor of SQLGuard.transaction;
* pipelined form - (PostgreSQL) SQLGuard.transaction as it was before the ride (2026-11-26),
  now ``batch``'s form: BEGIN, the raising check, the UPDATE, the check again and COMMIT in
  one psycopg pipeline;
* unfenced, pipelined - (PostgreSQL) the unfenced transaction in one pipeline too: the peer of
  SQLGuard.transaction when the application pipelines its own transactions;
* SQLGuard.batch - (MariaDB, PyMySQL with CLIENT.MULTI_STATEMENTS) ``guard.batch(conn,
  [(UPDATE, params)], token=...)``: START TRANSACTION, a compound check that SIGNALs when it
  refuses, the UPDATE and COMMIT as one request;
* unfenced, one request - (MariaDB) the unfenced transaction as one multi-statement request
  too: the peer of SQLGuard.batch when the application batches its own transactions;
* +SELECT 1 - unfenced plus one trivial statement: the price of any extra statement (on
  PostgreSQL, of one extra round trip), to explain the SQLGuard figure;
* fence SQL by hand - unfenced plus SQLGuard's own statement sent straight through the driver,
  no fenced code: the floor of the fence-table form (what the statement itself costs);
* row SQL by hand - RowGuard's conditional UPDATE sent straight through the driver instead of
  the plain UPDATE: the floor of the row form.

Variants are interleaved transaction by transaction, so drifting load hits them alike; the
client's CPU time per transaction is measured too (``process_time``), since on a busy machine
wall-clock differences of a few µs of Python get stretched by CPU contention.
Target: fenced time <= 1.10x unfenced. Run: ``.venv/bin/python bench/bench_sql_guard.py``.
"""

from __future__ import annotations

import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import psycopg

sys.path.insert(0, os.path.dirname(__file__))
from _common import Result, fmt_us, table

from fenced import FencingToken
from fenced.guards._sql_driver import _pipelined_transaction, _ride_first, _ride_last
from fenced.guards._sql_plan import MYSQL, POSTGRESQL, SQLITE, Dialect, _row_write_sql, fence_sql
from fenced.guards.sql import RowGuard, SQLGuard
from fenced.testing.servers import MariaDBServer, PostgresServer

TOKEN = FencingToken("accounts", 42)
SLICES = 20
VARIANTS = (
    "unfenced",
    "SQLGuard",
    "SQLGuard.begin",
    "RowGuard",
    "SQLGuard.transaction",
    "ride SQL by hand",
    "pipelined form",
    "unfenced, pipelined",
    "SQLGuard.batch",
    "unfenced, one request",
    "+SELECT 1",
    "fence SQL by hand",
    "row SQL by hand",
)


class Run:
    """Wall-clock samples and total client CPU time of each variant."""

    def __init__(self) -> None:
        self.results = {name: Result(name) for name in VARIANTS}
        self.cpu = dict.fromkeys(VARIANTS, 0.0)
        self.pairs: dict[str, tuple[float, float, float, float]] = {}
        """Guard -> (median slice ratio, p50 ratio, its CPU µs, the peer's CPU µs) when run
        alone with the peer, A/B op by op as the other benchmarks do (see measure)."""

    def cpu_us(self, name: str) -> float:
        return self.cpu[name] / self.results[name].ops * 1e6

    def slice_ratios(self, name: str) -> list[float]:
        """Mean time / unfenced mean time, in each of SLICES consecutive slices."""
        a, b = self.results[name].samples, self.results["unfenced"].samples
        size = max(1, len(a) // SLICES)
        return [
            statistics.fmean(a[i : i + size]) / statistics.fmean(b[i : i + size])
            for i in range(0, len(a) - size + 1, size)
        ]


def interleaved(variants: dict[str, Callable[[], object]], n: int) -> Run:
    """Time ``n`` transactions of each variant, interleaved one by one in rotating order."""
    for op in variants.values():
        for _ in range(20):
            op()
    run = Run()
    names = list(variants)
    wall, cpu = time.perf_counter, time.process_time
    for i in range(n):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            op = variants[name]
            c0, t0 = cpu(), wall()
            op()
            t1, c1 = wall(), cpu()
            run.results[name].samples.append(t1 - t0)
            run.cpu[name] += c1 - c0
    for r in run.results.values():
        r.elapsed = sum(r.samples)
        r.ops = len(r.samples)
    return run


PAIRED = (
    ("SQLGuard", "unfenced"),
    ("RowGuard", "unfenced"),
    ("SQLGuard.transaction", "unfenced"),
    ("fence SQL by hand", "unfenced"),
    ("SQLGuard.transaction", "fence SQL by hand"),
    ("SQLGuard.transaction", "unfenced, pipelined"),
    ("ride SQL by hand", "unfenced"),
    ("pipelined form", "unfenced"),
    ("SQLGuard.transaction", "pipelined form"),
    ("SQLGuard.begin", "unfenced"),
    ("SQLGuard.batch", "unfenced"),
    ("SQLGuard.batch", "unfenced, one request"),
)


def measure(variants: dict[str, Callable[[], object]], n: int) -> Run:
    """All variants in rotation (the floors beside each guard), then each guard alone with the
    peer, A/B. In the rotation every transaction follows five others' code, which evicts the
    guard's Python from the CPU caches: the same few µs of it then cost several times more
    (the peer's code is small). The A/B pair is how the other benchmarks, and the targets,
    measure a guarded write against an unguarded one; both are reported."""
    run = interleaved(variants, n)
    for name, peer in PAIRED:
        if peer not in variants or name not in variants:
            continue
        # (the peer timed under the name "unfenced": slice_ratios divides by it)
        pair = interleaved({"unfenced": variants[peer], name: variants[name]}, n)
        ratio = statistics.median(pair.slice_ratios(name))
        p50 = pair.results[name].p50 / pair.results["unfenced"].p50
        run.pairs[f"{name} vs {peer}"] = (ratio, p50, pair.cpu_us(name), pair.cpu_us("unfenced"))
    return run


def by_hand(d: Dialect, guard: SQLGuard, rows: RowGuard) -> tuple[str, tuple[Any, ...], str]:
    """The guards' own statements (fence: its params; row: its SQL), to send without fenced."""
    fence = fence_sql(d, guard._quoted).accept
    row = _row_write_sql(d, rows._spec, ("balance",), False)
    return fence, (guard.resource, TOKEN.lock, TOKEN.value), row


def ride_by_hand(conn: Any, guard: SQLGuard) -> tuple[bytes, bytes, bytes]:
    """SQLGuard.transaction's messages on PostgreSQL (its statements prepared on ``conn`` by
    one guarded transaction first): ``BEGIN; EXECUTE <check>``, and ``EXECUTE <recheck>(`` /
    ``…); COMMIT`` around the transaction id."""
    with guard.transaction(conn, token=TOKEN):
        pass
    t = guard._quoted
    head, tail = _ride_first(t, guard.resource, TOKEN.lock, "BEGIN", True, False)
    first = head + b"%d" % TOKEN.value + tail
    head, tail = _ride_last(t, guard.resource)
    return first, head, tail


def make_ops(
    conn: Any, begin: str, q: Callable[[str], str], d: Dialect
) -> dict[str, Callable[[], object]]:
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
        guard.check(conn, token=TOKEN)
        conn.execute(update, (next(counter),))
        conn.execute("COMMIT")

    def fence_begin() -> None:
        guard.begin(conn, token=TOKEN)  # BEGIN and the fence together: one round trip on PostgreSQL
        conn.execute(update, (next(counter),))
        conn.execute("COMMIT")

    def row_form() -> None:
        conn.execute(begin)
        rows.update(conn, token=TOKEN, key={"id": 1}, values={"balance": next(counter)})
        conn.execute("COMMIT")

    def fence_transaction() -> None:
        with guard.transaction(conn, token=TOKEN):
            conn.execute(update, (next(counter),))

    def pipelined_form() -> None:
        with _pipelined_transaction(conn, guard._quoted, guard.resource, TOKEN, guard._use):
            conn.execute(update, (next(counter),))

    def unfenced_pipelined() -> None:
        with conn.pipeline(), conn.transaction():
            conn.execute(update, (next(counter),))

    def one_more_statement() -> None:
        conn.execute(begin)
        conn.execute("SELECT 1").fetchall()
        conn.execute(update, (next(counter),))
        conn.execute("COMMIT")

    fence, fence_params, row = by_hand(d, guard, rows)
    ride = ride_by_hand(conn, guard) if d is POSTGRESQL else None

    def ride_sql_by_hand() -> None:
        assert ride is not None
        first, head, tail = ride
        cur = conn.execute(first)
        cur.nextset()
        xid = cur.fetchone()[1]
        conn.execute(update, (next(counter),))
        conn.execute(head + b"%d" % xid + tail)

    def fence_by_hand() -> None:
        conn.execute(begin)
        conn.execute(fence, fence_params).fetchall()
        conn.execute(update, (next(counter),))
        conn.execute("COMMIT")

    def row_by_hand() -> None:
        conn.execute(begin)
        conn.execute(row, (next(counter), TOKEN.value, 1, TOKEN.value))
        conn.execute("COMMIT")

    return {
        "unfenced": unfenced,
        "SQLGuard": fence_table,
        "SQLGuard.begin": fence_begin,
        "RowGuard": row_form,
        "SQLGuard.transaction": fence_transaction,
        **({"unfenced, pipelined": unfenced_pipelined} if d is POSTGRESQL else {}),
        **({"ride SQL by hand": ride_sql_by_hand} if d is POSTGRESQL else {}),
        **({"pipelined form": pipelined_form} if d is POSTGRESQL else {}),
        "+SELECT 1": one_more_statement,
        "fence SQL by hand": fence_by_hand,
        "row SQL by hand": row_by_hand,
    }


def report(engine: str, run: Run) -> list[str]:
    base = run.results["unfenced"]
    lines = []
    for name in VARIANTS[1:]:
        r = run.results[name]
        if not r.samples:
            continue
        lines.append(
            f"{engine:10s} {name:14s} time / unfenced: median of {SLICES} slices "
            f"{statistics.median(run.slice_ratios(name)):.3f}x, mean {r.mean / base.mean:.3f}x, "
            f"p50 {r.p50 / base.p50:.3f}x ({fmt_us(r.p50 - base.p50)}); client CPU "
            f"{run.cpu_us(name):.0f} µs vs {run.cpu_us('unfenced'):.0f} µs per transaction"
        )
    for name, (ratio, p50, cpu, peer_cpu) in run.pairs.items():
        lines.append(
            f"{engine:10s} {name} alone (A/B): median of {SLICES} slices "
            f"{ratio:.3f}x, p50 {p50:.3f}x; client CPU {cpu:.0f} µs vs {peer_cpu:.0f} µs per "
            "transaction"
        )
    return lines


def bench_sqlite(n: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="fenced-bench-sql-") as d:
        conn = sqlite3.connect(os.path.join(d, "bench.db"), isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        try:
            return measure(make_ops(conn, "BEGIN IMMEDIATE", lambda s: s, SQLITE), n)
        finally:
            conn.close()


def bench_postgres(n: int) -> Run:
    with PostgresServer() as server, psycopg.connect(server.dsn, autocommit=True) as conn:
        return measure(make_ops(conn, "BEGIN", lambda s: s.replace("?", "%s"), POSTGRESQL), n)


def make_mysql_ops(conn: Any) -> dict[str, Callable[[], object]]:
    """The same five transactions through PyMySQL (a cursor per statement, as users write),
    autocommit off (PyMySQL's default): a transaction opens at its first statement, so the
    peer is UPDATE + COMMIT and no variant sends BEGIN."""
    guard, rows = SQLGuard("accounts"), RowGuard("accounts", lock="accounts")
    guard.install(conn)

    def run(sql: str, params: tuple[Any, ...] = ()) -> None:
        with conn.cursor() as cur:
            cur.execute(sql, params)
            cur.fetchall()

    run("CREATE TABLE IF NOT EXISTS accounts (id INT PRIMARY KEY, balance BIGINT) ENGINE=InnoDB")
    run("INSERT IGNORE INTO accounts (id, balance) VALUES (1, 0)")
    conn.commit()
    rows.install(conn)
    update = "UPDATE accounts SET balance = %s WHERE id = 1"
    counter = iter(range(10**9))

    def unfenced() -> None:
        run(update, (next(counter),))
        conn.commit()

    def fence_table() -> None:
        guard.check(conn, token=TOKEN)
        run(update, (next(counter),))
        conn.commit()

    def fence_begin() -> None:
        guard.begin(conn, token=TOKEN)
        run(update, (next(counter),))
        conn.commit()

    def row_form() -> None:
        # the whole transaction: a guarded write outside an open transaction commits itself
        rows.update(conn, token=TOKEN, key={"id": 1}, values={"balance": next(counter)})

    def fence_transaction() -> None:
        with guard.transaction(conn, token=TOKEN):
            run(update, (next(counter),))

    def one_more_statement() -> None:
        run("SELECT 1")
        run(update, (next(counter),))
        conn.commit()

    def fence_batch() -> None:
        guard.batch(conn, [(update, (next(counter),))], token=TOKEN)

    def unfenced_one_request() -> None:
        with conn.cursor() as cur:
            cur.execute(f"START TRANSACTION; {update % next(counter)}; COMMIT")
            while cur.nextset():
                pass

    fence, fence_params, row = by_hand(MYSQL, guard, rows)

    def fence_by_hand() -> None:
        run(fence, fence_params)
        run(update, (next(counter),))
        conn.commit()

    def row_by_hand() -> None:
        run(row, (next(counter), TOKEN.value, 1, TOKEN.value))
        conn.commit()

    return {
        "unfenced": unfenced,
        "SQLGuard": fence_table,
        "SQLGuard.begin": fence_begin,
        "RowGuard": row_form,
        "SQLGuard.transaction": fence_transaction,
        "SQLGuard.batch": fence_batch,
        "unfenced, one request": unfenced_one_request,
        "+SELECT 1": one_more_statement,
        "fence SQL by hand": fence_by_hand,
        "row SQL by hand": row_by_hand,
    }


def bench_mysql(n: int) -> Run:
    import pymysql

    with MariaDBServer() as server:
        from pymysql.constants import CLIENT

        conn = pymysql.connect(
            host="127.0.0.1", port=server.port, user="root", database="fenced",
            client_flag=CLIENT.MULTI_STATEMENTS,  # (SQLGuard.batch's one request; others alike)
        )  # fmt: skip
        try:
            return measure(make_mysql_ops(conn), n)
        finally:
            conn.close()


_N = os.environ.get("FENCED_BENCH_N")  # transactions per variant, for a shorter run
ENGINES = {"SQLite": (bench_sqlite, 5000), "PostgreSQL": (bench_postgres, 3000)}
ENGINES["MariaDB"] = (bench_mysql, 3000)
if _N:
    ENGINES = {k: (f, int(_N)) for k, (f, _) in ENGINES.items()}


def main() -> None:
    load_before = os.getloadavg()[0]
    notes: list[str] = []
    rows: list[tuple[str, Result, Result]] = []
    only = sys.argv[1:]  # engine names to run (default: all)
    for engine, (bench, n) in ENGINES.items():
        if only and engine not in only:
            continue
        run = bench(n)
        for name in VARIANTS[1:]:
            if not run.results[name].samples:
                continue
            rows.append((f"{engine}: 1-row UPDATE txn", run.results[name], run.results["unfenced"]))
        notes += report(engine, run)
    notes.append(
        f"load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, "
        f"on {os.cpu_count()} CPUs; target: fenced time <= 1.10x unfenced"
    )
    table(
        "SQL guard: fenced vs unfenced one-row UPDATE transaction (ratio = fenced ops/s ÷ unfenced)",
        rows,
        "\n".join(notes),
    )


if __name__ == "__main__":
    main()
