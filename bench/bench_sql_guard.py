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
  with COMMIT (``SELECT <recheck>; COMMIT``): the unfenced transaction's three round trips;
  on SQLite ``BEGIN``, the check, ``SAVEPOINT`` (the witness), the UPDATE, ``RELEASE``,
  ``COMMIT``; on MariaDB the check with the witness in one compound statement,
  the UPDATE, the witness's release with COMMIT in another: again three statements;
  elsewhere ``begin``, ``SAVEPOINT``, the block, ``RELEASE SAVEPOINT``, COMMIT;
* ride SQL by hand - (PostgreSQL) the same three messages sent straight through psycopg, no
  fenced code: the floor of SQLGuard.transaction's SQL;
* ride: ... - (PostgreSQL) the ride taken apart by hand (see ``ride_parts``): two trivial
  ``SELECT 1`` riding in the first and last messages (the floor of *any* design that rides
  a check and a recheck there), the check alone, the recheck alone, a new token every time,
  the recheck as it was before session 7, and a row-lock check; each A/B against its peer,
  and the WAL each form writes per transaction (``pg_walinspect``);
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
* +SELECT 1 - unfenced plus one trivial statement sent on its own: the price of one extra
  statement *and its round trip* (the SQLGuard figure's), not of a statement riding in a
  message sent anyway (``ride: 2 SELECT 1``);
* fence SQL by hand - unfenced plus SQLGuard's own statement sent straight through the driver,
  no fenced code: the floor of the fence-table form (what the statement itself costs). On
  SQLite that is the fence's UPDATE, its row count read as the verdict (a refusal raises);
* fence SQL, a with block - (SQLite) the same statements behind a minimal ``with`` block, nothing
  else checked: the floor of a block-shaped API such as SQLGuard.transaction;
* fence SQL, one cursor - (SQLite) fence SQL by hand with BEGIN, the UPDATE and COMMIT on one
  cursor, as SQLGuard.transaction sends them (``conn.execute`` makes a cursor per statement);
* fence SQL + witness, one cursor - (SQLite) fence SQL, one cursor with the savepoint witness
  SQLGuard.transaction sends since session 11 (``SAVEPOINT`` after the fence, ``RELEASE``
  before ``COMMIT``): the floor of the design that catches a block ending its transaction;
* fence upsert by hand - (SQLite) the accepting upsert (``INSERT .. ON CONFLICT DO UPDATE ..
  RETURNING``) by hand, its row fetched: the fence SQL until session 8, when the UPDATE took
  its place on the accepting path (the upsert now inserts a first row and explains a refusal);
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
from collections.abc import Callable, Iterator, Sequence
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
    "fence SQL, a with block",
    "fence SQL, one cursor",
    "fence SQL + witness, one cursor",
    "fence upsert by hand",
    "row SQL by hand",
    "ride: 2 SELECT 1",
    "ride: check only",
    "ride: recheck only",
    "ride: token moving",
    "ride: recheck before",
    "ride: row-lock check",
)
RIDE_PARTS = VARIANTS[-6:]


class Run:
    """Wall-clock samples and total client CPU time of each variant."""

    def __init__(self) -> None:
        self.results = {name: Result(name) for name in VARIANTS}
        self.cpu = dict.fromkeys(VARIANTS, 0.0)
        self.wal: list[str] = []  # (PostgreSQL: wal_per_transaction's lines)
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
    ("fence SQL, a with block", "fence SQL by hand"),
    ("SQLGuard.transaction", "fence SQL, a with block"),
    ("fence upsert by hand", "unfenced"),
    ("SQLGuard.transaction", "fence SQL, one cursor"),
    ("fence SQL + witness, one cursor", "unfenced"),
    ("SQLGuard.transaction", "fence SQL + witness, one cursor"),
    ("SQLGuard.transaction", "unfenced, pipelined"),
    ("ride SQL by hand", "unfenced"),
    ("pipelined form", "unfenced"),
    ("SQLGuard.transaction", "pipelined form"),
    ("SQLGuard.begin", "unfenced"),
    ("SQLGuard.batch", "unfenced"),
    ("SQLGuard.batch", "unfenced, one request"),
    ("ride: 2 SELECT 1", "unfenced"),
    ("ride SQL by hand", "ride: 2 SELECT 1"),
    ("ride: check only", "ride: 2 SELECT 1"),
    ("ride: recheck only", "ride: 2 SELECT 1"),
    ("ride: token moving", "ride SQL by hand"),
    ("ride SQL by hand", "ride: recheck before"),
    ("ride: row-lock check", "ride SQL by hand"),
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
    """The guards' own statements (fence: its params; row: its SQL), to send without fenced;
    the fence's on SQLite is its UPDATE (the accepting path)."""
    fence = fence_sql(d, guard._quoted).update or fence_sql(d, guard._quoted).accept
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
    head, tail = _ride_last()
    return first, head, tail


def ride_parts(
    conn: Any, guard: SQLGuard, update: str, counter: Iterator[int]
) -> dict[str, Callable[[], object]]:
    """The ride (PostgreSQL) taken apart, by hand, each with the unfenced transaction's three
    round trips: two trivial statements riding in its first and last messages (the floor of
    *any* design that rides statements there), the check riding alone (COMMIT sent bare),
    the recheck riding alone (a trivial ``txid_current()`` rides with BEGIN for its xid),
    and the whole ride with a new token every time (the mark moves; elsewhere it stays).
    Two forms measured against it: the recheck as it was before session 7 (the check's
    search_path set, then a CASE calling the refusal function) and a check that, when the
    mark already equals the token, locks the row (``FOR NO KEY UPDATE``) instead of writing
    a new version of it (a CTE; the upsert otherwise; safe: tests/guards/
    test_guard_sql_ride_races.py; not kept, not cheaper)."""
    t = guard._quoted
    head, tail = _ride_first(t, guard.resource, TOKEN.lock, "BEGIN", True, False)
    first = head + b"%d" % TOKEN.value + tail
    last_head, last_tail = _ride_last()
    moving = "accounts-moving"  # (its own fence row: the others' mark stays at TOKEN)
    m_head, m_tail = _ride_first(t, moving, TOKEN.lock, "BEGIN", True, False)
    m_last_head, m_last_tail = _ride_last()
    tokens = iter(range(1000, 10**12))
    lits = f"'{guard.resource}', '{TOKEN.lock}', {TOKEN.value}"
    before = (
        "SELECT set_config('search_path', 'public', true); "
        "SELECT CASE WHEN txid_current_if_assigned() = {} THEN 0 "
        f"ELSE fenced_refuse_v1(CAST('{t}' AS regclass), '{guard.resource}') END; COMMIT"
    )
    conn.execute(
        "PREPARE bench_row_lock(text, text, bigint) AS "
        f"WITH held AS (SELECT token FROM {t} AS f WHERE resource = $1 AND lock_name = $2 "
        "AND token = $3 FOR NO KEY UPDATE), "
        f"a AS (INSERT INTO {t} AS f (resource, lock_name, token) SELECT $1, $2, $3 "
        "WHERE NOT EXISTS (SELECT FROM held) ON CONFLICT (resource) DO UPDATE "
        "SET token = excluded.token WHERE f.token > 0 "
        "AND f.token <= CAST(excluded.token AS BIGINT) AND f.lock_name = excluded.lock_name "
        "RETURNING token) "
        "SELECT token, txid_current(), current_setting('search_path') FROM held UNION ALL "
        "SELECT token, txid_current(), current_setting('search_path') FROM a"
    )
    row_lock = f"BEGIN; EXECUTE bench_row_lock({lits})".encode()

    def two_selects() -> None:
        cur = conn.execute("BEGIN; SELECT 1")
        cur.nextset()
        cur.fetchall()
        conn.execute(update, (next(counter),))
        conn.execute("SELECT 1; COMMIT")

    def check_only() -> None:
        cur = conn.execute(first)
        cur.nextset()
        cur.fetchone()
        conn.execute(update, (next(counter),))
        conn.execute("COMMIT")

    def recheck_only() -> None:
        cur = conn.execute("BEGIN; SELECT txid_current()")
        cur.nextset()
        xid = cur.fetchone()[0]
        conn.execute(update, (next(counter),))
        conn.execute(last_head + b"%d" % xid + last_tail)

    def token_moving() -> None:
        cur = conn.execute(m_head + b"%d" % next(tokens) + m_tail)
        cur.nextset()
        xid = cur.fetchone()[1]
        conn.execute(update, (next(counter),))
        conn.execute(m_last_head + b"%d" % xid + m_last_tail)

    def recheck_before() -> None:
        cur = conn.execute(first)
        cur.nextset()
        xid = cur.fetchone()[1]
        conn.execute(update, (next(counter),))
        conn.execute(before.format(xid).encode())

    def row_lock_check() -> None:
        cur = conn.execute(row_lock)
        cur.nextset()
        xid = cur.fetchone()[1]
        conn.execute(update, (next(counter),))
        conn.execute(last_head + b"%d" % xid + last_tail)

    ops = (two_selects, check_only, recheck_only, token_moving, recheck_before, row_lock_check)
    return dict(zip(RIDE_PARTS, ops, strict=True))


def wal_per_transaction(
    conn: Any, variants: dict[str, Callable[[], object]], names: Sequence[str], n: int = 200
) -> list[str]:
    """The WAL each form writes per transaction (``pg_walinspect`` over ``n`` transactions of
    it alone): records and bytes, and the heap records by type (a new tuple version of the
    fence row is an UPDATE or HOT_UPDATE; a row lock a LOCK)."""
    conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    lines = []
    for name in names:
        if name not in variants:
            continue
        start = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]
        for _ in range(n):
            variants[name]()
        stats = conn.execute(
            'SELECT "resource_manager/record_type", count, combined_size FROM '
            "pg_get_wal_stats(%s, pg_current_wal_flush_lsn(), true) WHERE count > 0",
            (start,),
        ).fetchall()
        records = sum(c for _, c, _ in stats) / n
        size = sum(b for _, _, b in stats) / n
        heap = ", ".join(
            f"{kind.split('/')[-1]} {c / n:.2f}"
            for kind, c, _ in sorted(stats)
            if kind.startswith(("Heap/", "Btree/", "Transaction/"))
        )
        lines.append(
            f"PostgreSQL {name:22s} WAL per transaction: {records:.2f} records, "
            f"{size:.0f} bytes ({heap})"
        )
    return lines


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
    parts = ride_parts(conn, guard, update, counter) if d is POSTGRESQL else {}

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
        if d is SQLITE:  # (the UPDATE's row count is its verdict)
            if conn.execute(fence, fence_params).rowcount != 1:
                raise RuntimeError("refused")
        else:
            conn.execute(fence, fence_params).fetchall()
        conn.execute(update, (next(counter),))
        conn.execute("COMMIT")

    def fence_one_cursor() -> None:
        cur = conn.cursor()
        cur.execute(begin)
        if cur.execute(fence, fence_params).rowcount != 1:
            raise RuntimeError("refused")
        conn.execute(update, (next(counter),))
        cur.execute("COMMIT")

    def fence_witness_one_cursor() -> None:
        cur = conn.cursor()
        cur.execute(begin)
        if cur.execute(fence, fence_params).rowcount != 1:
            raise RuntimeError("refused")
        cur.execute("SAVEPOINT w")
        conn.execute(update, (next(counter),))
        cur.execute("RELEASE w")
        cur.execute("COMMIT")

    upsert = fence_sql(d, guard._quoted).accept

    def upsert_by_hand() -> None:
        conn.execute(begin)
        conn.execute(upsert, fence_params).fetchall()
        conn.execute(update, (next(counter),))
        conn.execute("COMMIT")

    def row_by_hand() -> None:
        conn.execute(begin)
        conn.execute(row, (next(counter), TOKEN.value, 1, TOKEN.value))
        conn.execute("COMMIT")

    class Block:
        """The fence SQL by hand behind a ``with`` block, its verdict read, nothing else: what any
        block-shaped API costs above the bare statements (two Python calls a transaction)."""

        def __enter__(self) -> None:
            conn.execute(begin)
            if conn.execute(fence, fence_params).rowcount != 1:
                raise RuntimeError("refused")

        def __exit__(self, *exc: object) -> None:
            conn.execute("COMMIT" if exc[0] is None else "ROLLBACK")

    def fence_with_block() -> None:
        with Block():
            conn.execute(update, (next(counter),))

    return {
        "unfenced": unfenced,
        "SQLGuard": fence_table,
        "SQLGuard.begin": fence_begin,
        "RowGuard": row_form,
        "SQLGuard.transaction": fence_transaction,
        **({"unfenced, pipelined": unfenced_pipelined} if d is POSTGRESQL else {}),
        **({"ride SQL by hand": ride_sql_by_hand} if d is POSTGRESQL else {}),
        **({"pipelined form": pipelined_form} if d is POSTGRESQL else {}),
        **parts,
        "+SELECT 1": one_more_statement,
        "fence SQL by hand": fence_by_hand,
        **({"fence SQL, a with block": fence_with_block} if d is SQLITE else {}),
        **({"fence SQL, one cursor": fence_one_cursor} if d is SQLITE else {}),
        **({"fence SQL + witness, one cursor": fence_witness_one_cursor} if d is SQLITE else {}),
        **({"fence upsert by hand": upsert_by_hand} if d is SQLITE else {}),
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
    return lines + run.wal


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
        ops = make_ops(conn, "BEGIN", lambda s: s.replace("?", "%s"), POSTGRESQL)
        run = measure(ops, n)
        forms = ("unfenced", "SQLGuard.transaction", "ride SQL by hand", *RIDE_PARTS)
        run.wal = wal_per_transaction(conn, ops, forms)
        return run


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
