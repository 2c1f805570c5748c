"""The SQL guards on real SQLite files and a real PostgreSQL, and planted bugs they must catch.

Most bodies are parametrized over both engines (``env``). The checkers (``attempt``,
``assert_fenced_history``, the scenarios) are plain functions so the planted-bug tests can run
the very same checks against broken guard variants and assert that they FAIL.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import re
import sqlite3
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

import fenced
from fenced import (
    MAX_TOKEN,
    BackendUnavailable,
    ConfigurationError,
    CorruptMarkError,
    FencingToken,
    InvalidTokenError,
    ResourceNotFoundError,
    StaleTokenError,
    WrongLockError,
)
from fenced.guards import _sql_plan
from fenced.guards._sql_plan import Dialect, FenceSQL, Plan, Stmt
from fenced.guards.sql import Add, FenceConflictError, RowGuard, SQLGuard
from fenced.testing.servers import PostgresServer
from tests.guards.planted import LessThanGuard, LessThanRowGuard, planted_ride
from tests.helpers import unique_name, wait_for

LOCK = "invoices"


def tok(value: int, lock: str = LOCK) -> FencingToken:
    return FencingToken(lock, value)


# -- environments -----------------------------------------------------------------------


@dataclass(frozen=True)
class Env:
    """One database to test on: a SQLite file (WAL, synchronous=FULL) or a PostgreSQL DSN."""

    kind: str  # "sqlite" | "pg"
    target: str

    def connect(self, **kw: Any) -> Any:
        """A connection in manual mode: explicit BEGIN / COMMIT / ROLLBACK statements."""
        if self.kind == "sqlite":
            conn = sqlite3.connect(self.target, isolation_level=None, timeout=20, **kw)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            return conn
        return psycopg.connect(self.target, **{"autocommit": True, **kw})

    def q(self, sql: str) -> str:
        return sql if self.kind == "sqlite" else sql.replace("?", "%s")

    def begin(self, conn: Any) -> None:
        conn.execute("BEGIN IMMEDIATE" if self.kind == "sqlite" else "BEGIN")

    def setup(self, guard: SQLGuard) -> None:
        """The fence table plus the guarded data: a ledger row and a notes table."""
        with self.connect() as conn:
            guard.install(conn)
            conn.execute("CREATE TABLE IF NOT EXISTS ledger (id INTEGER PRIMARY KEY, history TEXT)")
            conn.execute("CREATE TABLE IF NOT EXISTS notes (token BIGINT NOT NULL)")
            conn.execute(
                self.q("INSERT INTO ledger (id, history) VALUES (1, '') ON CONFLICT DO NOTHING")
            )
        if self.kind == "sqlite":
            conn.close()


@pytest.fixture(scope="module")
def pg_module_db(pg_server: PostgresServer) -> Iterator[str]:
    """One database for this module on the shared server (CREATE DATABASE costs ~1 s)."""
    db = unique_name("sqlguard").replace("-", "_")
    with psycopg.connect(pg_server.dsn, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {db}")
    yield f"postgresql://postgres@127.0.0.1:{pg_server.port}/{db}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as c:
        c.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


@pytest.fixture
def pg_dsn(pg_module_db: str) -> str:
    """A DSN whose search_path is a fresh schema: every test gets its own empty tables."""
    schema = unique_name("s").replace("-", "_")
    with psycopg.connect(pg_module_db, autocommit=True) as c:
        c.execute(f"CREATE SCHEMA {schema}")
    return make_conninfo(pg_module_db, options=f"-c search_path={schema}")


@pytest.fixture(params=["sqlite", "pg"])
def env(request: pytest.FixtureRequest, tmp_path: Any) -> Env:
    if request.param == "sqlite":
        return Env("sqlite", str(tmp_path / "guarded.db"))
    return Env("pg", request.getfixturevalue("pg_dsn"))


@pytest.fixture
def conn(env: Env) -> Iterator[Any]:
    c = env.connect()
    yield c
    c.close()


# -- the checkers -----------------------------------------------------------------------


def attempt(
    env: Env, conn: Any, guard: SQLGuard, token: object, stale: list[StaleTokenError] | None = None
) -> bool:
    """One fenced transaction: write a note, check the fence, append to the ledger, commit.

    Returns True if it committed, False if the fence rejected it as stale (rolled back; the
    error is appended to ``stale`` if given).
    """
    env.begin(conn)
    try:
        conn.execute(
            env.q("INSERT INTO notes (token) VALUES (?)"), (int(str(token).split(":")[-1]),)
        )
        accepted = guard.check(conn, token=token)  # type: ignore[arg-type]
        conn.execute(
            env.q("UPDATE ledger SET history = history || ? WHERE id = 1"), (f",{int(accepted)}",)
        )
    except StaleTokenError as exc:
        conn.execute("ROLLBACK")
        if stale is not None:
            stale.append(exc)
        return False
    except FenceConflictError as exc:  # neither accepted nor a clean stale verdict
        conn.execute("ROLLBACK")
        raise AssertionError(f"token {token} not accepted: {exc}") from exc
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return True


def history(env: Env, conn: Any) -> list[int]:
    """The tokens of the committed fenced writes, in commit order (the ledger row's appends)."""
    (text,) = conn.execute("SELECT history FROM ledger WHERE id = 1").fetchone()
    return [int(x) for x in text.split(",") if x]


def notes(conn: Any) -> list[int]:
    return sorted(r[0] for r in conn.execute("SELECT token FROM notes").fetchall())


def assert_fenced_history(hist: list[int]) -> None:
    """The fencing invariant: accepted tokens, in commit order, never go down."""
    for earlier, later in zip(hist, hist[1:], strict=False):
        assert later >= earlier, f"token {later} committed after {earlier}: history {hist}"


def scenario_equal_repeated(env: Env, guard: SQLGuard) -> None:
    """The current holder writes many times with the same token: every write is accepted."""
    env.setup(guard)
    conn = env.connect()
    try:
        for _ in range(3):
            assert attempt(env, conn, guard, tok(5)), "equal token rejected"
        assert history(env, conn) == [5, 5, 5]
    finally:
        conn.close()


def scenario_stale_and_current(env: Env, guard: SQLGuard) -> None:
    env.setup(guard)
    conn = env.connect()
    try:
        assert attempt(env, conn, guard, tok(5))
        assert not attempt(env, conn, guard, tok(4)), "stale token accepted"
        assert attempt(env, conn, guard, tok(5)), "current token rejected"
        assert attempt(env, conn, guard, "invoices:9"), "higher token rejected"
        assert not attempt(env, conn, guard, tok(5)), "old token accepted after a higher one"
        assert not attempt(env, conn, guard, tok(8)), "old token accepted after a higher one"
        assert history(env, conn) == [5, 5, 9]
        assert notes(conn) == [5, 5, 9], "a rejected transaction's write was kept"
        assert guard.high_water(conn) == tok(9)
        assert_fenced_history(history(env, conn))
    finally:
        conn.close()


# -- planted bugs -----------------------------------------------------------------------


class CheckThenWriteGuard(SQLGuard):
    """Planted bug: SELECT the mark, compare in Python, then UPDATE it: two statements."""

    def _check_plan(self, d: Dialect, token: FencingToken) -> Plan[FencingToken]:
        p = d.param
        res = yield Stmt(f"SELECT token FROM fenced_fences WHERE resource = {p}", (self.resource,))
        if res.rows and res.rows[0][0] > token.value:
            raise StaleTokenError(token, FencingToken(self.lock, res.rows[0][0]), self.resource)
        yield Stmt(
            f"INSERT INTO fenced_fences (resource, lock_name, token) VALUES ({p}, {p}, {p}) "
            "ON CONFLICT (resource) DO UPDATE SET token = excluded.token",
            (self.resource, token.lock, token.value),
        )
        return token


class TempTableGuard(SQLGuard):
    """Planted bug: the mark is not durable (a TEMP table, gone with the connection)."""

    def _fence_sql(self, d: Dialect) -> FenceSQL:
        real = super()._fence_sql(d)
        create = real.create.replace("CREATE TABLE", "CREATE TEMP TABLE").replace(
            '"fenced_fences"', "fenced_fences"
        )
        return FenceSQL(create, real.accept, real.read)


# -- basic behaviour, both engines ------------------------------------------------------


def test_stale_rejected_and_current_accepted(env: Env) -> None:
    scenario_stale_and_current(env, SQLGuard("invoices"))


def test_equal_token_accepted_repeatedly(env: Env) -> None:
    scenario_equal_repeated(env, SQLGuard("invoices"))


def test_planted_less_than_is_caught(env: Env) -> None:
    with pytest.raises(AssertionError, match="not accepted"):
        scenario_equal_repeated(env, LessThanGuard("invoices"))
    with pytest.raises(AssertionError, match="not accepted"):
        scenario_stale_and_current(env, LessThanGuard("invoices", table="other_fences"))


def test_stale_error_carries_mark_and_commits_nothing(env: Env, conn: Any) -> None:
    guard = SQLGuard("invoices")
    env.setup(guard)
    assert attempt(env, conn, guard, tok(7))
    env.begin(conn)
    conn.execute(env.q("INSERT INTO notes (token) VALUES (?)"), (6,))
    with pytest.raises(StaleTokenError) as info:
        guard.check(conn, token=tok(6))
    conn.execute("ROLLBACK")
    assert info.value.token == tok(6)
    assert info.value.high_water == tok(7)
    assert info.value.resource == "invoices"
    assert notes(conn) == [7]
    assert guard.high_water(conn) == tok(7)


def test_max_token_boundary(env: Env, conn: Any) -> None:
    guard = SQLGuard("invoices")
    env.setup(guard)
    assert attempt(env, conn, guard, tok(MAX_TOKEN - 1))
    assert attempt(env, conn, guard, f"invoices:{MAX_TOKEN}")
    assert not attempt(env, conn, guard, tok(MAX_TOKEN - 1))
    assert guard.high_water(conn) == tok(MAX_TOKEN)


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ("invoices", InvalidTokenError),
        ("invoices:", InvalidTokenError),
        ("invoices:abc", InvalidTokenError),
        (" invoices:5", InvalidTokenError),
        ("invoices:05", InvalidTokenError),
        ("invoices:0", InvalidTokenError),
        ("invoices:-3", InvalidTokenError),
        (f"invoices:{MAX_TOKEN + 1}", InvalidTokenError),
        ("invoices:99999999999999999999999", InvalidTokenError),
        (12, InvalidTokenError),
        (None, InvalidTokenError),
        ("billing:9", WrongLockError),
        (FencingToken("billing", 9), WrongLockError),
    ],
)
def test_bad_tokens_write_nothing(env: Env, conn: Any, bad: object, error: type) -> None:
    guard = SQLGuard("invoices")
    env.setup(guard)
    assert attempt(env, conn, guard, tok(5))
    env.begin(conn)
    with pytest.raises(error):
        guard.check(conn, token=bad)  # type: ignore[arg-type]
    conn.execute("ROLLBACK")
    assert guard.high_water(conn) == tok(5)
    assert history(env, conn) == [5]
    assert attempt(env, conn, guard, tok(5))  # the fence still works


def test_token_of_another_lock_rejected_by_the_stored_lock(env: Env, conn: Any) -> None:
    env.setup(SQLGuard("invoices"))
    assert attempt(env, conn, SQLGuard("invoices"), tok(5))
    other = SQLGuard("invoices", lock="billing")  # same resource, misconfigured lock
    env.begin(conn)
    with pytest.raises(WrongLockError, match="fenced by lock 'invoices'"):
        other.check(conn, token=FencingToken("billing", 100))
    conn.execute("ROLLBACK")
    assert SQLGuard("invoices").high_water(conn) == tok(5)


def test_install_is_idempotent_and_missing_install_is_explained(env: Env, conn: Any) -> None:
    guard = SQLGuard("invoices", table="my_fences")
    env.begin(conn)
    with pytest.raises(ConfigurationError, match="install"):
        guard.check(conn, token=tok(1))
    conn.execute("ROLLBACK")
    for _ in range(3):
        guard.install(conn)
    assert guard.high_water(conn) is None
    env.begin(conn)
    guard.check(conn, token=tok(1))
    conn.execute("COMMIT")
    guard.install(conn)
    assert guard.high_water(conn) == tok(1)


def test_resources_are_independent(env: Env, conn: Any) -> None:
    a, b = SQLGuard("invoices"), SQLGuard("orders", lock="invoices")
    env.setup(a)
    assert attempt(env, conn, a, tok(9))
    assert attempt(env, conn, b, tok(2))
    assert a.high_water(conn) == tok(9) and b.high_water(conn) == tok(2)


def test_closed_connection_is_backend_unavailable(env: Env) -> None:
    guard = SQLGuard("invoices")
    env.setup(guard)
    conn = env.connect()
    conn.close()
    with pytest.raises(BackendUnavailable):
        guard.check(conn, token=tok(1))
    with pytest.raises(BackendUnavailable):
        guard.high_water(conn)
    with pytest.raises(BackendUnavailable):
        guard.install(conn)


def test_autocommit_without_transaction_is_refused(env: Env, conn: Any) -> None:
    guard = SQLGuard("invoices")
    env.setup(guard)
    with pytest.raises(ConfigurationError, match="transaction"):
        guard.check(conn, token=tok(1))
    assert guard.high_water(conn) is None


def test_bad_configuration() -> None:
    for table in ("", "a;drop table x", 'x"y', "a.b.c", "1abc", "a b"):
        with pytest.raises(ConfigurationError):
            SQLGuard("invoices", table=table)
    with pytest.raises(ConfigurationError):
        SQLGuard("")
    with pytest.raises(ConfigurationError, match="lock"):
        SQLGuard("invoices eu")  # fine as a resource, not as a lock name
    assert SQLGuard("invoices eu", lock="invoices").resource == "invoices eu"
    assert SQLGuard("invoices/eu").lock == "invoices/eu"  # a path-like lock name is one
    with pytest.raises(TypeError):
        SQLGuard("invoices").check(object(), token=tok(1))


# -- the drivers' own transaction idioms --------------------------------------------------


def test_sqlite_with_block_rolls_back_stale_writes(tmp_path: Any) -> None:
    db = sqlite3.connect(tmp_path / "legacy.db")  # legacy mode: implicit deferred BEGIN
    guard = SQLGuard("invoices")
    guard.install(db)
    db.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total INTEGER)")
    db.execute("INSERT INTO invoices VALUES (1, 100)")
    db.commit()
    with db:
        guard.check(db, token="invoices:8")
        db.execute("UPDATE invoices SET total = 200 WHERE id = 1")
    with pytest.raises(StaleTokenError), db:
        guard.check(db, token="invoices:7")
        db.execute("UPDATE invoices SET total = 300 WHERE id = 1")
    with pytest.raises(StaleTokenError), db:
        db.execute("UPDATE invoices SET total = 400 WHERE id = 1")  # written before the check
        guard.check(db, token="invoices:7")
    assert db.execute("SELECT total FROM invoices").fetchone() == (200,)
    assert not db.in_transaction
    db.close()


def test_psycopg_transaction_idioms(pg_dsn: str) -> None:
    guard = SQLGuard("invoices")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        guard.install(conn)
        conn.execute("CREATE TABLE invoices (id INT PRIMARY KEY, total INT)")
        conn.execute("INSERT INTO invoices VALUES (1, 100)")
        with conn.transaction():
            guard.check(conn, token="invoices:8")
            conn.execute("UPDATE invoices SET total = 200 WHERE id = 1")
        with pytest.raises(StaleTokenError), conn.transaction():
            conn.execute("UPDATE invoices SET total = 300 WHERE id = 1")
            guard.check(conn, token="invoices:7")
    with psycopg.connect(pg_dsn) as conn:  # not autocommit: psycopg BEGINs implicitly
        guard.check(conn, token="invoices:9")
        conn.execute("UPDATE invoices SET total = 500 WHERE id = 1")
        conn.commit()
        with pytest.raises(StaleTokenError):
            guard.check(conn, token="invoices:8")
        conn.rollback()
        assert conn.execute("SELECT total FROM invoices").fetchone() == (500,)
        assert guard.high_water(conn) == tok(9)


def test_users_own_sql_error_is_not_swallowed(pg_dsn: str) -> None:
    guard = SQLGuard("invoices")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        guard.install(conn)
        conn.execute("BEGIN")
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        with pytest.raises(ConfigurationError, match="already failed") as info:
            guard.check(conn, token=tok(1))
        assert isinstance(info.value.__cause__, psycopg.errors.InFailedSqlTransaction)
        conn.execute("ROLLBACK")


# -- isolation levels and SQLite's deferred upgrade -----------------------------------------


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
@pytest.mark.parametrize("mine", [9, 5])
def test_pg_snapshot_isolation_conflict_is_an_error_not_a_pass(
    pg_dsn: str, level: str, mine: int
) -> None:
    env = Env("pg", pg_dsn)
    guard = SQLGuard("invoices")
    env.setup(guard)
    a, b = env.connect(), env.connect()
    try:
        assert attempt(env, b, guard, tok(3))
        a.execute(f"BEGIN ISOLATION LEVEL {level}")
        a.execute("SELECT history FROM ledger").fetchall()  # takes the snapshot
        assert attempt(env, b, guard, tok(7))  # commits after a's snapshot
        with pytest.raises(FenceConflictError) as info:
            guard.check(a, token=tok(mine))
        assert isinstance(info.value.__cause__, psycopg.errors.SerializationFailure)
        a.execute("ROLLBACK")
        assert guard.high_water(a) == tok(7)
        # Without a concurrent writer the same isolation level passes normally.
        a.execute(f"BEGIN ISOLATION LEVEL {level}")
        assert guard.check(a, token=tok(8)) == tok(8)
        a.execute("COMMIT")
        assert guard.high_water(b) == tok(8)
    finally:
        a.close()
        b.close()


def test_sqlite_deferred_transaction_that_read_first_fails_to_upgrade(tmp_path: Any) -> None:
    env = Env("sqlite", str(tmp_path / "deferred.db"))
    guard = SQLGuard("invoices")
    env.setup(guard)
    a, b = env.connect(), env.connect()
    try:
        a.execute("BEGIN")  # DEFERRED
        a.execute("SELECT history FROM ledger").fetchall()  # read snapshot
        assert attempt(env, b, guard, tok(7))
        with pytest.raises(FenceConflictError, match="BEGIN IMMEDIATE") as info:
            guard.check(a, token=tok(9))
        assert isinstance(info.value.__cause__, sqlite3.OperationalError)
        a.execute("ROLLBACK")
        assert guard.high_water(a) == tok(7)
        a.execute("BEGIN IMMEDIATE")
        assert guard.check(a, token=tok(9)) == tok(9)
        a.execute("COMMIT")
    finally:
        a.close()
        b.close()


def test_sqlite_busy_writer_is_a_conflict(tmp_path: Any) -> None:
    env = Env("sqlite", str(tmp_path / "busy.db"))
    guard = SQLGuard("invoices")
    env.setup(guard)
    a = env.connect()
    b = sqlite3.connect(env.target, isolation_level=None, timeout=0.05)
    try:
        a.execute("BEGIN IMMEDIATE")
        b.execute("BEGIN")
        with pytest.raises(FenceConflictError):
            guard.check(b, token=tok(1))
        b.execute("ROLLBACK")
        a.execute("ROLLBACK")
    finally:
        a.close()
        b.close()


# -- races ------------------------------------------------------------------------------

RACE_PROCS = 4
RACE_ROUNDS = 25


def _race_worker(env: Env, counter: Any, barrier: Any, out: Any) -> None:
    """Child process: each round draw a token, wait for the others, then race to commit."""
    guard = SQLGuard("invoices")
    conn = env.connect()
    outcomes: list[tuple[int, bool, int]] = []
    try:
        for _ in range(RACE_ROUNDS):
            with counter.get_lock():
                counter.value += 1
                value = counter.value
            barrier.wait(30)
            stale: list[StaleTokenError] = []
            accepted = attempt(env, conn, guard, tok(value), stale)
            reported = int(stale[0].high_water) if stale and stale[0].high_water else 0
            outcomes.append((value, accepted, reported))
        out.put(("ok", outcomes))
    except BaseException as exc:
        out.put(("error", repr(exc)))
    finally:
        conn.close()


def test_racing_processes_commit_tokens_in_order(env: Env) -> None:
    guard = SQLGuard("invoices")
    env.setup(guard)
    ctx = multiprocessing.get_context("spawn")
    counter = ctx.Value("q", 0)
    barrier = ctx.Barrier(RACE_PROCS)
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_race_worker, args=(env, counter, barrier, out))
        for _ in range(RACE_PROCS)
    ]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=90) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():  # only on failure: never leave a racer behind
                p.kill()
                p.join(10)
    errors = [r[1] for r in results if r[0] != "ok"]
    assert not errors, errors
    outcomes = [o for r in results for o in r[1]]
    accepted = sorted(v for v, ok, _ in outcomes if ok)
    rejected = [v for v, ok, _ in outcomes if not ok]
    for value, ok, reported in outcomes:
        assert ok or reported > value, f"{value} rejected, but the reported mark is {reported}"
    with env.connect() as conn:
        hist = history(env, conn)
        assert_fenced_history(hist)
        assert sorted(hist) == accepted, "committed writes differ from accepted checks"
        assert notes(conn) == accepted, "a rejected transaction left a write behind"
        high = guard.high_water(conn)
        assert high == tok(max(hist))
        # Some tokens must have arrived out of order and been rejected, or the race was idle.
        assert rejected, "no token arrived late: the race did not exercise the fence"
        for late in {min(rejected), max(hist) - 1}:
            assert not attempt(env, conn, guard, tok(late)), f"late token {late} accepted"
        assert history(env, conn) == hist
    if env.kind == "sqlite":
        conn.close()


# A deterministic two-holder race on PostgreSQL. The old holder A (token 5) starts its fenced
# transaction first. The new holder B (token 7) runs its whole transaction while A is inside
# check() - before A's second statement if check() sends several - or, if A's check() is one
# statement, right after it, before A writes and commits. B either finishes or blocks on a
# lock; only then does A go on.

_HOOKS: dict[int, Callable[[], None]] = {}


class _HookCursor(psycopg.Cursor[Any]):
    def execute(self, query: Any, params: Any = None, **kw: Any) -> Any:
        hook = _HOOKS.get(id(self.connection))
        if hook is not None:
            hook()
        return super().execute(query, params, **kw)


def race_two_holders(env: Env, guard: SQLGuard) -> list[int]:
    env.setup(guard)
    a = psycopg.connect(env.target, autocommit=True, cursor_factory=_HookCursor)
    b, monitor = env.connect(), env.connect()
    b_done = threading.Event()
    b_result: list[object] = []

    def run_b() -> None:
        try:
            b_result.append(attempt(env, b, guard, tok(7)))
        except BaseException as exc:
            b_result.append(exc)
        finally:
            b_done.set()

    b_thread = threading.Thread(target=run_b, daemon=True)

    def b_settled() -> bool:
        if b_done.is_set():
            return True
        row = monitor.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (b.info.backend_pid,)
        ).fetchone()
        return row is not None and row[0] == "Lock"

    def let_b_run() -> None:
        if not b_thread.is_alive() and not b_done.is_set():
            b_thread.start()
            wait_for(b_settled, 20, "holder B to commit or block")

    statements = 0

    def before_statement() -> None:
        nonlocal statements
        statements += 1
        if statements == 2:
            let_b_run()

    try:
        assert attempt(env, a, guard, tok(1))  # the fence row exists
        a.execute("BEGIN")
        a.execute("INSERT INTO notes (token) VALUES (5)")
        _HOOKS[id(a)] = before_statement
        try:
            accepted = guard.check(a, token=tok(5))
        except StaleTokenError:
            accepted = None
        finally:
            _HOOKS.pop(id(a), None)
        let_b_run()
        if accepted is None:
            a.execute("ROLLBACK")
        else:
            a.execute("UPDATE ledger SET history = history || ',5' WHERE id = 1")
            a.execute("COMMIT")
        b_thread.join(20)
        assert b_done.is_set(), "holder B never finished"
        assert b_result and not isinstance(b_result[0], BaseException), b_result
        return history(env, monitor)[1:]
    finally:
        a.close()
        b.close()
        monitor.close()


def test_two_holder_race_is_serialized_by_the_fence(pg_dsn: str) -> None:
    hist = race_two_holders(Env("pg", pg_dsn), SQLGuard("invoices"))
    assert hist == [5, 7]  # A locked the fence row first; B waited, then passed
    assert_fenced_history(hist)


def test_planted_check_then_write_is_caught_by_the_race(pg_dsn: str) -> None:
    hist = race_two_holders(Env("pg", pg_dsn), CheckThenWriteGuard("invoices"))
    assert hist == [7, 5]
    with pytest.raises(AssertionError, match="committed after"):
        assert_fenced_history(hist)


def test_concurrent_installs(pg_dsn: str) -> None:
    guard = SQLGuard("invoices")
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def install() -> None:
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                barrier.wait(10)
                guard.install(conn)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=install) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert guard.high_water(conn) is None


# -- durability: restart ---------------------------------------------------------------


def scenario_restart_keeps_mark(env: Env, guard: SQLGuard, restart: Callable[[], None]) -> None:
    env.setup(guard)
    conn = env.connect()
    try:
        guard.install(conn)  # what an application does at start
        assert attempt(env, conn, guard, tok(41))
        assert attempt(env, conn, guard, tok(42))
    finally:
        conn.close()
    restart()
    conn = env.connect()
    try:
        guard.install(conn)  # what an application does at start
        assert not attempt(env, conn, guard, tok(41)), "mark lost across restart"
        assert attempt(env, conn, guard, tok(42))
        assert history(env, conn) == [41, 42, 42]
    finally:
        conn.close()


def test_sqlite_reopen_keeps_mark(tmp_path: Any) -> None:
    scenario_restart_keeps_mark(
        Env("sqlite", str(tmp_path / "r.db")), SQLGuard("invoices"), lambda: None
    )
    with pytest.raises(AssertionError, match="mark lost"):
        scenario_restart_keeps_mark(
            Env("sqlite", str(tmp_path / "planted.db")), TempTableGuard("invoices"), lambda: None
        )


@pytest.fixture(scope="module")
def own_pg() -> Iterator[PostgresServer]:
    """A PostgreSQL of our own, to kill and restart without disturbing the shared one."""
    with PostgresServer() as server:
        yield server  # type: ignore[misc]


def _fresh_db(server: PostgresServer) -> str:
    db = unique_name("db").replace("-", "_")
    with psycopg.connect(server.dsn, autocommit=True) as c:
        c.execute(f"CREATE DATABASE {db}")
    return f"postgresql://postgres@127.0.0.1:{server.port}/{db}"


def test_pg_restart_keeps_mark(own_pg: PostgresServer) -> None:
    def crash_and_restart() -> None:
        own_pg.restart(kill=True)  # kill -9: only what was committed (fsync'd) survives

    scenario_restart_keeps_mark(
        Env("pg", _fresh_db(own_pg)), SQLGuard("invoices"), crash_and_restart
    )
    with pytest.raises(AssertionError, match="mark lost"):
        scenario_restart_keeps_mark(
            Env("pg", _fresh_db(own_pg)), TempTableGuard("invoices"), crash_and_restart
        )


def test_pg_dead_server_is_backend_unavailable(own_pg: PostgresServer) -> None:
    env = Env("pg", _fresh_db(own_pg))
    guard = SQLGuard("invoices")
    env.setup(guard)
    conn = env.connect()
    try:
        assert attempt(env, conn, guard, tok(3))
        conn.execute("BEGIN")
        own_pg.kill()
        with pytest.raises(BackendUnavailable) as info:
            guard.check(conn, token=tok(4))
        assert isinstance(info.value.__cause__, psycopg.Error)
        with pytest.raises(BackendUnavailable):
            guard.check(conn, token=tok(4))
    finally:
        conn.close()
        own_pg.start()
    with env.connect() as conn:
        assert guard.high_water(conn) == tok(3)


def test_pg_terminated_backend_is_backend_unavailable(pg_dsn: str) -> None:
    env = Env("pg", pg_dsn)
    guard = SQLGuard("invoices")
    env.setup(guard)
    with env.connect() as conn, env.connect() as killer:
        conn.execute("BEGIN")
        killer.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        with pytest.raises(BackendUnavailable):
            guard.check(conn, token=tok(1))
        assert guard.high_water(killer) is None


# -- async (psycopg.AsyncConnection) -----------------------------------------------------


async def test_async_check(pg_dsn: str) -> None:
    guard = SQLGuard("invoices")
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await guard.ainstall(conn)
        await guard.ainstall(conn)
        assert await guard.ahigh_water(conn) is None
        for _ in range(2):
            async with conn.transaction():
                assert await guard.acheck(conn, token="invoices:5") == tok(5)
        with pytest.raises(StaleTokenError) as info:
            async with conn.transaction():
                await guard.acheck(conn, token=tok(4))
        assert info.value.high_water == tok(5)
        with pytest.raises(WrongLockError):
            async with conn.transaction():
                await guard.acheck(conn, token="billing:9")
        with pytest.raises(ConfigurationError, match="transaction"):
            await guard.acheck(conn, token=tok(6))
        assert await guard.ahigh_water(conn) == tok(5)
        with pytest.raises(TypeError):
            guard.check(conn, token=tok(6))
    with pytest.raises(BackendUnavailable):
        await guard.acheck(conn, token=tok(6))
    with pytest.raises(BackendUnavailable):
        await guard.ahigh_water(conn)


async def test_async_row_guard(pg_dsn: str) -> None:
    guard = RowGuard("invoices", lock=LOCK)
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await conn.execute("CREATE TABLE invoices (id INT PRIMARY KEY, status TEXT)")
        await conn.execute("INSERT INTO invoices (id, status) VALUES (1, 'new')")
        await guard.ainstall(conn)
        assert await guard.aupdate(
            conn, token=tok(3), key={"id": 1}, values={"status": "a"}
        ) == tok(3)
        with pytest.raises(StaleTokenError):
            await guard.aupdate(conn, token=tok(2), key={"id": 1}, values={"status": "b"})
        with pytest.raises(ResourceNotFoundError):
            await guard.aupdate(conn, token=tok(3), key={"id": 2}, values={"status": "b"})
        await guard.ainsert_or_update(conn, token=tok(4), key={"id": 2}, values={"status": "c"})
        assert await guard.ahigh_water(conn, {"id": 2}) == tok(4)
        rows = await (await conn.execute("SELECT * FROM invoices ORDER BY id")).fetchall()
        assert rows == [(1, "a", 3), (2, "c", 4)]


# -- row form ---------------------------------------------------------------------------


@pytest.fixture
def rows(env: Env, conn: Any) -> RowGuard:
    conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, status TEXT, amount INTEGER)")
    conn.execute("INSERT INTO invoices (id, status, amount) VALUES (1, 'new', 10), (2, 'new', 20)")
    guard = RowGuard("invoices", key_columns=("id",), lock=LOCK)
    guard.install(conn)
    guard.install(conn)  # idempotent
    return guard


def row(conn: Any, env: Env, key: int) -> tuple[Any, ...]:
    return tuple(
        conn.execute(
            env.q("SELECT status, amount, fencing_token FROM invoices WHERE id = ?"), (key,)
        ).fetchone()
    )


def scenario_row_holder_writes_twice(env: Env, conn: Any, guard: RowGuard) -> None:
    """The row's current holder updates it twice with the same token: both are accepted."""
    for status in ("paid", "refunded"):
        try:
            guard.update(conn, token=tok(5), key={"id": 1}, values={"status": status})
        except (StaleTokenError, FenceConflictError) as exc:
            raise AssertionError(f"the holder's write was not accepted: {exc}") from exc
    assert row(conn, env, 1) == ("refunded", 10, 5)


def test_row_holder_writes_twice(env: Env, conn: Any, rows: RowGuard) -> None:
    scenario_row_holder_writes_twice(env, conn, rows)


def test_planted_row_less_than_is_caught(env: Env, conn: Any, rows: RowGuard) -> None:
    with pytest.raises(AssertionError, match="not accepted"):
        scenario_row_holder_writes_twice(env, conn, LessThanRowGuard("invoices", lock=LOCK))


def test_row_null_token_accepts_then_fences(env: Env, conn: Any, rows: RowGuard) -> None:
    assert row(conn, env, 1) == ("new", 10, None)
    assert rows.high_water(conn, {"id": 1}) is None
    assert rows.update(conn, token=tok(5), key={"id": 1}, values={"status": "paid"}) == tok(5)
    assert rows.update(conn, token="invoices:5", key={"id": 1}, values={"amount": 11}) == tok(5)
    assert row(conn, env, 1) == ("paid", 11, 5)
    with pytest.raises(StaleTokenError) as info:
        rows.update(conn, token=tok(4), key={"id": 1}, values={"status": "void", "amount": 0})
    assert info.value.high_water == tok(5)
    assert info.value.resource == "invoices(id=1)"
    assert row(conn, env, 1) == ("paid", 11, 5)
    assert rows.update(conn, token=tok(6), key={"id": 1}) == tok(6)  # bump the token only
    assert row(conn, env, 1) == ("paid", 11, 6)
    assert row(conn, env, 2) == ("new", 20, None)  # other rows untouched


def test_row_stale_vs_missing(env: Env, conn: Any, rows: RowGuard) -> None:
    rows.update(conn, token=tok(9), key={"id": 1}, values={"status": "x"})
    with pytest.raises(StaleTokenError):
        rows.update(conn, token=tok(8), key={"id": 1}, values={"status": "y"})
    with pytest.raises(ResourceNotFoundError, match=r"invoices\(id=3\)"):
        rows.update(conn, token=tok(8), key={"id": 3}, values={"status": "y"})
    with pytest.raises(ResourceNotFoundError):
        rows.high_water(conn, {"id": 3})
    assert conn.execute("SELECT COUNT(*) FROM invoices").fetchone() == (2,)


def test_row_insert_or_update(env: Env, conn: Any, rows: RowGuard) -> None:
    key = {"id": 7}
    assert rows.insert_or_update(conn, token=tok(3), key=key, values={"status": "a", "amount": 1})
    assert row(conn, env, 7) == ("a", 1, 3)
    rows.insert_or_update(conn, token=tok(3), key=key, values={"status": "b", "amount": 2})
    with pytest.raises(StaleTokenError) as info:
        rows.insert_or_update(conn, token=tok(2), key=key, values={"status": "c", "amount": 3})
    assert info.value.high_water == tok(3)
    assert row(conn, env, 7) == ("b", 2, 3)
    rows.insert_or_update(conn, token=tok(4), key={"id": 2}, values={"status": "d", "amount": 4})
    assert row(conn, env, 2) == ("d", 4, 4)


def test_row_relative_updates_are_bound_and_fenced(env: Env, conn: Any, rows: RowGuard) -> None:
    """Bug: only literal values: {"amount": "amount + 1"} stored that text. Add(n) adds in the
    guarded statement itself (a bound number, never SQL): accepted for the holder, refused
    with nothing written for a stale token, and a missing row or NULL counts as 0."""
    assert rows.update(conn, token=tok(5), key={"id": 1}, values={"amount": Add(5)}) == tok(5)
    assert rows.update(conn, token=tok(5), key={"id": 1}, values={"amount": Add(-3)}) == tok(5)
    assert row(conn, env, 1) == ("new", 12, 5)
    with pytest.raises(StaleTokenError):
        rows.update(conn, token=tok(4), key={"id": 1}, values={"amount": Add(100)})
    assert row(conn, env, 1) == ("new", 12, 5)
    rows.insert_or_update(
        conn, token=tok(5), key={"id": 9}, values={"amount": Add(7), "status": "n"}
    )
    rows.insert_or_update(conn, token=tok(6), key={"id": 9}, values={"amount": Add(7)})
    assert row(conn, env, 9) == ("n", 14, 6)
    with pytest.raises(StaleTokenError):
        rows.insert_or_update(conn, token=tok(5), key={"id": 9}, values={"amount": Add(1)})
    assert row(conn, env, 9) == ("n", 14, 6)
    conn.execute(env.q("UPDATE invoices SET amount = NULL WHERE id = ?"), (2,))
    rows.update(conn, token=tok(6), key={"id": 2}, values={"amount": Add(2)})
    assert row(conn, env, 2) == ("new", 2, 6)
    # The amount is a parameter: text that looks like SQL is refused, not run.
    with pytest.raises(fenced.ConfigurationError, match="number"):
        Add("1; DROP TABLE invoices")  # type: ignore[arg-type]
    with pytest.raises(fenced.ConfigurationError, match="number"):
        Add(True)


def test_row_in_a_transaction_rolls_back_with_it(env: Env, conn: Any, rows: RowGuard) -> None:
    rows.update(conn, token=tok(5), key={"id": 1}, values={"status": "paid"})
    env.begin(conn)
    rows.update(conn, token=tok(6), key={"id": 2}, values={"status": "paid"})
    with pytest.raises(StaleTokenError):
        rows.update(conn, token=tok(4), key={"id": 1}, values={"status": "void"})
    conn.execute("ROLLBACK")
    assert row(conn, env, 2) == ("new", 20, None)


def test_row_bad_input(env: Env, conn: Any, rows: RowGuard) -> None:
    rows.update(conn, token=tok(5), key={"id": 1}, values={"status": "paid"})
    for bad, error in [
        ("invoices:0", InvalidTokenError),
        ("invoices:-1", InvalidTokenError),
        (f"invoices:{MAX_TOKEN + 1}", InvalidTokenError),
        ("garbage", InvalidTokenError),
        ("billing:9", WrongLockError),
    ]:
        with pytest.raises(error):
            rows.update(conn, token=bad, key={"id": 1}, values={"status": "void"})
    bad_calls: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"nope": 1}, {"status": "x"}),
        ({"id": None}, {"status": "x"}),
        ({"id": 1}, {"fencing_token": 99}),
        ({"id": 1}, {"id": 3}),
        ({"id": 1}, {"status; DROP TABLE invoices": "x"}),
    ]
    for key, values in bad_calls:
        with pytest.raises(ConfigurationError):
            rows.update(conn, token=tok(6), key=key, values=values)
    assert row(conn, env, 1) == ("paid", 10, 5)


def test_row_lock_column(env: Env, conn: Any, rows: RowGuard) -> None:
    locked = RowGuard("invoices", lock=LOCK, lock_column="fencing_lock")
    locked.install(conn)
    locked.update(conn, token=tok(5), key={"id": 1}, values={"status": "a"})
    other = RowGuard("invoices", lock="billing", lock_column="fencing_lock")
    with pytest.raises(WrongLockError):
        other.update(conn, token=FencingToken("billing", 50), key={"id": 1}, values={"status": "b"})
    assert locked.high_water(conn, {"id": 1}) == tok(5)
    assert other.update(conn, token=FencingToken("billing", 1), key={"id": 2}) == FencingToken(
        "billing", 1
    )


def test_row_install_needs_the_table(env: Env, conn: Any) -> None:
    with pytest.raises(ConfigurationError, match="does not exist"):
        RowGuard("nowhere").install(conn)
    conn.execute("CREATE TABLE plain (id INTEGER PRIMARY KEY)")
    conn.execute("INSERT INTO plain (id) VALUES (1)")
    with pytest.raises(ConfigurationError, match="install"):
        RowGuard("plain").update(conn, token="plain:1", key={"id": 1})
    with pytest.raises(ConfigurationError):
        RowGuard("plain", key_columns=("id",), token_column="id")
    with pytest.raises(ConfigurationError):
        RowGuard("plain", key_columns=())


def test_row_closed_connection(env: Env, rows: RowGuard) -> None:
    conn = env.connect()
    conn.close()
    with pytest.raises(BackendUnavailable):
        rows.update(conn, token=tok(1), key={"id": 1}, values={"status": "x"})


@pytest.mark.parametrize("column_type", ["TEXT", "INTEGER"])
def test_row_guard_on_a_badly_typed_pg_column_is_a_configuration_error(
    pg_dsn: str, column_type: str
) -> None:
    """Without install(), a TEXT or int4 token column gives a typed error, and writes nothing."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(
            f"CREATE TABLE docs (id INTEGER PRIMARY KEY, body TEXT, fencing_token {column_type})"
        )
        c.execute("INSERT INTO docs VALUES (1, 'original', NULL)")
        guard = RowGuard("docs", lock=LOCK)
        token = FencingToken(LOCK, 2**40)  # above int4, as ZooKeeper tokens are
        with pytest.raises(ConfigurationError, match="BIGINT"), c.transaction():
            guard.update(c, token=token, key={"id": 1}, values={"body": "new"})
        assert c.execute("SELECT body FROM docs WHERE id = 1").fetchone() == ("original",)


# -- fail closed on a fence table or token column the guard did not make ------------------


def test_install_refuses_an_existing_fence_table_with_a_text_token(env: Env, conn: Any) -> None:
    """A TEXT token column compares '9' > '10': install and check both refuse the table."""
    conn.execute(
        "CREATE TABLE fenced_fences (resource TEXT PRIMARY KEY, lock_name TEXT NOT NULL, "
        "token TEXT NOT NULL)"
    )
    conn.execute(env.q("INSERT INTO fenced_fences VALUES ('r', ?, '10')"), (LOCK,))
    guard = SQLGuard("r", lock=LOCK)
    with pytest.raises(ConfigurationError, match="token"):
        guard.install(conn)
    for value in (9, 3, 11):
        env.begin(conn)
        with pytest.raises(ConfigurationError, match="token"):
            guard.check(conn, token=tok(value))
        conn.execute("ROLLBACK")
    assert conn.execute("SELECT token FROM fenced_fences").fetchall() == [("10",)]


@pytest.mark.parametrize("mark", [None, 0, -5])
def test_a_null_zero_or_negative_fence_mark_fails_closed(env: Env, conn: Any, mark: Any) -> None:
    conn.execute(
        "CREATE TABLE fenced_fences (resource TEXT PRIMARY KEY, lock_name TEXT NOT NULL, "
        "token BIGINT)"
    )
    conn.execute(env.q("INSERT INTO fenced_fences VALUES ('r', ?, ?)"), (LOCK, mark))
    guard = SQLGuard("r", lock=LOCK)
    guard.install(conn)  # the table's shape is fine; its content is not
    for value in (1, 3, 2**63 - 1):
        env.begin(conn)
        with pytest.raises(CorruptMarkError, match="'r'"):
            guard.check(conn, token=tok(value))
        conn.execute("ROLLBACK")
    with pytest.raises(CorruptMarkError):
        guard.high_water(conn)
    assert conn.execute("SELECT token FROM fenced_fences").fetchall() == [(mark,)]


def test_row_upsert_on_a_text_token_column_never_compares_text(env: Env, conn: Any) -> None:
    """Without install(), token 9 must not pass after 10 (PostgreSQL compared '9' > '10')."""
    conn.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, body TEXT, fencing_token TEXT)")
    guard = RowGuard("docs", lock=LOCK)
    if env.kind == "pg":  # refused at first use: text is never compared with a token
        with pytest.raises(ConfigurationError, match="is text: it must be a 64-bit integer"):
            guard.insert_or_update(conn, token=tok(10), key={"id": 1}, values={"body": "ten"})
        conn.execute("INSERT INTO docs VALUES (1, 'ten', '10')")
    else:  # SQLite compares the CAST value: numeric
        guard.insert_or_update(conn, token=tok(10), key={"id": 1}, values={"body": "ten"})
    with pytest.raises((StaleTokenError, ConfigurationError)):
        guard.insert_or_update(conn, token=tok(9), key={"id": 1}, values={"body": "nine"})
    with pytest.raises((StaleTokenError, ConfigurationError)):
        guard.update(conn, token=tok(9), key={"id": 1}, values={"body": "nine"})
    assert conn.execute("SELECT body FROM docs").fetchall() == [("ten",)]


@pytest.mark.parametrize("stored", [(None, LOCK), (0, LOCK), (-5, None)])
def test_row_mark_missing_but_bound_or_out_of_range_fails_closed(
    env: Env, conn: Any, stored: tuple[Any, Any]
) -> None:
    conn.execute(
        "CREATE TABLE docs (id INTEGER PRIMARY KEY, body TEXT, fencing_token BIGINT, lk TEXT)"
    )
    conn.execute(env.q("INSERT INTO docs VALUES (1, 'original', ?, ?)"), stored)
    guard = RowGuard("docs", lock=LOCK, lock_column="lk")
    for value in (1, 3, 2**63 - 1):
        with pytest.raises(CorruptMarkError):
            guard.update(conn, token=tok(value), key={"id": 1}, values={"body": "new"})
        with pytest.raises(CorruptMarkError):
            guard.insert_or_update(conn, token=tok(value), key={"id": 1}, values={"body": "new"})
    assert conn.execute("SELECT body FROM docs").fetchall() == [("original",)]


def test_row_write_on_a_default_connection_is_committed(env: Env, tmp_path: Any) -> None:
    """sqlite3 and psycopg open a transaction implicitly; the row form commits what it opened
    (an acknowledged write was lost on close), and leaves a caller's own transaction open."""
    with env.connect() as setup:
        setup.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, body TEXT)")
        setup.execute("INSERT INTO docs VALUES (1, 'original')")
        RowGuard("docs", lock=LOCK).install(setup)
    # The drivers' defaults: sqlite3's legacy implicit transactions, psycopg's autocommit off.
    conn = sqlite3.connect(env.target) if env.kind == "sqlite" else psycopg.connect(env.target)
    guard = RowGuard("docs", lock=LOCK)
    guard.update(conn, token=tok(5), key={"id": 1}, values={"body": "five"})
    assert not (conn.in_transaction if env.kind == "sqlite" else conn.info.transaction_status)
    with pytest.raises(StaleTokenError):
        guard.update(conn, token=tok(4), key={"id": 1}, values={"body": "four"})
    assert not (conn.in_transaction if env.kind == "sqlite" else conn.info.transaction_status)
    # Inside the caller's transaction the write stays uncommitted until the caller decides.
    conn.execute("SELECT 1")  # opens one on psycopg; on sqlite3 use an explicit BEGIN
    if env.kind == "sqlite":
        conn.execute("BEGIN")
    guard.update(conn, token=tok(6), key={"id": 1}, values={"body": "six"})
    conn.rollback()
    conn.close()
    with env.connect() as check:
        assert check.execute("SELECT body FROM docs").fetchall() == [("five",)]
    if env.kind == "sqlite":
        check.close()


# -- the SQL row guard -----------------------------------------------------------------------


def _jobs_with_text_token_column() -> sqlite3.Connection:
    """A table whose token column the application made itself, as TEXT."""
    db = sqlite3.connect(":memory:", isolation_level=None)
    db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, state TEXT, fencing_token TEXT)")
    db.execute("INSERT INTO jobs (id, state) VALUES (1, 'new')")
    return db


def _stale_write_is_refused(db: sqlite3.Connection, guard: RowGuard) -> bool:
    """The checker: after token 10 wrote, token 3 is refused and 10's data is intact."""
    guard.update(db, token="jobs:10", key={"id": 1}, values={"state": "by 10"})
    try:
        guard.update(db, token="jobs:3", key={"id": 1}, values={"state": "by 3 (stale)"})
    except fenced.StaleTokenError as exc:
        assert exc.high_water == fenced.FencingToken("jobs", 10)
        return bool(db.execute("SELECT state FROM jobs").fetchone()[0] == "by 10")
    return False


def test_row_guard_on_a_text_token_column_refuses_stale_tokens() -> None:
    """Bug: SQLite compared a TEXT token column as text ('10' <= '3'): jobs:3 overwrote jobs:10."""
    db = _jobs_with_text_token_column()
    guard = RowGuard("jobs", lock="jobs")
    assert _stale_write_is_refused(db, guard)
    assert guard.high_water(db, {"id": 1}) == fenced.FencingToken("jobs", 10)


def test_text_comparison_planted_back_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker above fails on the unfixed comparison (the planted bug)."""
    monkeypatch.setattr(_sql_plan, "_as_int", lambda _d, expr, stored=False: expr)
    _sql_plan._row_write_sql.cache_clear()
    try:
        assert not _stale_write_is_refused(_jobs_with_text_token_column(), RowGuard("jobs"))
    finally:
        _sql_plan._row_write_sql.cache_clear()


def test_row_guard_install_refuses_a_token_column_that_cannot_hold_tokens() -> None:
    with pytest.raises(fenced.ConfigurationError, match="64-bit integer"):
        RowGuard("jobs").install(_jobs_with_text_token_column())
    db = sqlite3.connect(":memory:", isolation_level=None)
    db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, fencing_token BIGINT)")
    RowGuard("jobs").install(db)  # any INTEGER-affinity type is fine


def test_row_guard_install_refuses_narrow_or_text_token_columns_on_postgresql(
    pg_dsn: str,
) -> None:
    """text <= bigint raised a raw psycopg error at every write; int4 overflowed at 2**31
    (a ZooKeeper zxid token is above 2**32): install now says so, as ConfigurationError."""
    import psycopg

    with psycopg.connect(pg_dsn, autocommit=True) as db:
        for type_ in ("TEXT", "INTEGER", "DOUBLE PRECISION"):
            db.execute("DROP TABLE IF EXISTS jobs")
            db.execute(f"CREATE TABLE jobs (id INTEGER PRIMARY KEY, fencing_token {type_})")
            with pytest.raises(fenced.ConfigurationError, match="64-bit integer"):
                RowGuard("jobs").install(db)
        db.execute("DROP TABLE jobs")
        db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, fencing_token BIGINT)")
        RowGuard("jobs").install(db)
        db.execute("INSERT INTO jobs (id) VALUES (1)")
        big = fenced.FencingToken("jobs", fenced.MAX_TOKEN)
        assert RowGuard("jobs").update(db, token=big, key={"id": 1}) == big


def test_begin_starts_the_transaction_and_checks_in_one_step(env: Env) -> None:
    """SQLGuard.begin: BEGIN and the fence together (one round trip on PostgreSQL); both
    sides of the rule, and a connection already in a transaction refused."""
    guard = SQLGuard("ledger", lock=LOCK)
    env.setup(guard)
    conn = env.connect()
    try:
        for value, ok in [(5, True), (5, True), (7, True), (6, False), (7, True)]:
            if ok:
                assert guard.begin(conn, token=tok(value)) == tok(value)
                conn.execute(env.q("UPDATE ledger SET history = ? WHERE id = 1"), (str(value),))
                conn.execute("COMMIT")
            else:
                with pytest.raises(StaleTokenError) as info:
                    guard.begin(conn, token=tok(value))
                assert info.value.high_water == tok(7)
                conn.execute("ROLLBACK")
        assert conn.execute("SELECT history FROM ledger").fetchall() == [("7",)]
        env.begin(conn)
        with pytest.raises(ConfigurationError, match="already open"):
            guard.begin(conn, token=tok(8))
        conn.execute("ROLLBACK")
    finally:
        conn.close()


async def test_abegin_on_an_async_connection(pg_dsn: str) -> None:
    guard = SQLGuard("ledger", lock=LOCK)
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        await guard.ainstall(conn)
        assert await guard.abegin(conn, token=tok(3)) == tok(3)
        await conn.execute("COMMIT")
        with pytest.raises(StaleTokenError):
            await guard.abegin(conn, token=tok(2))
        await conn.execute("ROLLBACK")
        assert await guard.ahigh_water(conn) == tok(3)


class VerifyAfterTheMark(SQLGuard):
    """PLANTED BUG: the token's signature is checked after the mark was raised."""

    def check(self, conn: Any, *, token: Any) -> FencingToken:  # type: ignore[override]
        verifier, self.verifier = self.verifier, None
        try:
            accepted = super().check(conn, token=token)
        finally:
            self.verifier = verifier
        FencingToken.coerce(token, self.lock, self.verifier)
        return accepted


@pytest.mark.parametrize("guard_class", [SQLGuard, VerifyAfterTheMark], ids=["fenced", "planted"])
def test_a_forged_token_never_moves_the_mark(tmp_path: Any, guard_class: type[SQLGuard]) -> None:
    """Verification comes before the mark: a forged huge token leaves it where it was (the
    planted guard that verifies afterwards raises it first: caught)."""
    from fenced import HmacKey, Keyring, SignatureError
    from fenced._core.signing import token_message

    key = HmacKey("k1", b"q" * 32)
    db = sqlite3.connect(tmp_path / "db", isolation_level=None)
    guard = guard_class("invoices", verify=Keyring([key]))
    guard.install(db)
    good = FencingToken("invoices", 5, ("k1", key.sign(token_message("invoices", 5, "k1"))))
    db.execute("BEGIN IMMEDIATE")
    guard.check(db, token=good)
    db.execute("COMMIT")
    forged = FencingToken("invoices", 2**62, ("k1", b"\0" * 32))
    db.execute("BEGIN IMMEDIATE")
    with pytest.raises(SignatureError):
        guard.check(db, token=forged)
    db.execute("COMMIT")  # (a caller that commits anyway: the mark must not have moved)
    mark = guard.high_water(db)
    if guard_class is VerifyAfterTheMark:
        assert mark == FencingToken("invoices", 2**62)  # the planted bug is caught
    else:
        assert mark == FencingToken("invoices", 5)


# -- identifiers as each database compares them (issue 25) ------------------------------------


def test_row_values_naming_a_guard_column_under_another_case_are_refused(
    env: Env, conn: Any, rows: RowGuard
) -> None:
    """SQLite ignores the case of column names: ``values={"Fencing_Token": 1}`` set the token
    column itself. On a new row that value became the mark (a stale 5 then passed after 14);
    on an existing row the write refused itself and said "roll back and retry" on every
    retry. Refused before any SQL, as a ConfigurationError (never retry), on every engine;
    the rightful write with proper values is accepted and the stale one refused after it."""
    before = conn.execute("SELECT * FROM invoices ORDER BY id").fetchall()
    for values in ({"Fencing_Token": 1}, {"ID": 3}, {"status": "a", "STATUS": "b"}):
        for key in ({"id": 7}, {"id": 1}):  # a new row, an existing one
            for write in (rows.insert_or_update, rows.update):
                with pytest.raises(ConfigurationError) as info:
                    write(conn, token=tok(14), key=key, values=values)
                assert not isinstance(info.value, FenceConflictError)
                assert "retry" not in str(info.value)
                if env.kind == "pg" and "Fencing_Token" in values:  # another column there
                    assert "compared exactly" in str(info.value)
    with pytest.raises(ConfigurationError):  # the key column and the token column: one column
        RowGuard("invoices", key_columns=("ID",), token_column="id").update(
            conn, token="invoices:1", key={"ID": 1}
        )
    assert conn.execute("SELECT * FROM invoices ORDER BY id").fetchall() == before
    assert rows.insert_or_update(conn, token=tok(14), key={"id": 7}, values={"status": "a"})
    with pytest.raises(StaleTokenError):
        rows.update(conn, token=tok(5), key={"id": 7}, values={"status": "stale"})
    assert row(conn, env, 7) == ("a", None, 14)


def test_row_install_checks_a_token_column_found_under_another_case(env: Env, conn: Any) -> None:
    """``Fencing_Token TEXT`` *is* the token column on SQLite (and, unquoted, on PostgreSQL).
    install() looked it up exactly, missed it, took the failed ADD COLUMN for a racing install
    and never checked its type (text compares '10' < '9'). Refused; an integer column under
    another case is used as it is."""
    conn.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v INTEGER, Fencing_Token TEXT)")
    guard = RowGuard("acct", lock=LOCK)
    with pytest.raises(ConfigurationError, match="64-bit"):
        guard.install(conn)
    conn.execute("CREATE TABLE acct2 (id INTEGER PRIMARY KEY, v INTEGER, Fencing_Token BIGINT)")
    conn.execute("INSERT INTO acct2 (id, v) VALUES (1, 0)")
    ok = RowGuard("acct2", lock=LOCK)
    ok.install(conn)
    assert ok.update(conn, token=tok(10), key={"id": 1}, values={"v": 1}) == tok(10)
    with pytest.raises(StaleTokenError):
        ok.update(conn, token=tok(9), key={"id": 1}, values={"v": 2})
    assert tuple(conn.execute("SELECT v, fencing_token FROM acct2").fetchone()) == (1, 10)


def test_a_refusal_no_retry_can_pass_is_typed_and_does_not_say_retry(env: Env, conn: Any) -> None:
    """A duplicate of the caller's own unique key came out as the driver's raw error (and
    on MySQL as "roll back and retry", for ever): a ConfigurationError with the driver's
    error as its cause, nothing written; the rightful write then passes."""
    conn.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, email TEXT UNIQUE)")
    conn.execute("INSERT INTO acct (id, email) VALUES (1, 'a'), (2, 'b')")
    guard = RowGuard("acct", lock=LOCK)
    guard.install(conn)
    driver_error = sqlite3.Error if env.kind == "sqlite" else psycopg.Error
    for write in (guard.update, guard.insert_or_update):
        with pytest.raises(ConfigurationError) as info:
            write(conn, token=tok(5), key={"id": 1}, values={"email": "b"})
        assert "retry would fail" in str(info.value)
        assert isinstance(info.value.__cause__, driver_error)
    rows = conn.execute("SELECT id, email, fencing_token FROM acct ORDER BY id").fetchall()
    assert [tuple(r) for r in rows] == [(1, "a", None), (2, "b", None)]
    assert guard.update(conn, token=tok(5), key={"id": 1}, values={"email": "c"}) == tok(5)


def test_a_fence_table_is_verified_by_its_columns_as_sqlite_names_them(tmp_path: Any) -> None:
    """SQLite column names ignore case: a hand-made fence table with ``Token`` has the
    guard's ``token`` column, and it is that column whose type is checked (install() looked
    the names up exactly and reported the columns missing)."""
    conn = sqlite3.connect(tmp_path / "f.db", isolation_level=None)
    conn.execute(
        "CREATE TABLE fenced_fences (Resource TEXT PRIMARY KEY, Lock_Name TEXT NOT NULL, "
        "Token INTEGER NOT NULL)"
    )
    conn.execute("CREATE TABLE text_fences (Resource TEXT PRIMARY KEY, Lock_Name TEXT, Token TEXT)")
    with pytest.raises(ConfigurationError, match="'token' column is TEXT"):
        SQLGuard("invoices", table="text_fences").install(conn)
    guard = SQLGuard("invoices")
    guard.install(conn)
    assert guard.begin(conn, token=tok(10)) == tok(10)
    conn.execute("COMMIT")
    with pytest.raises(StaleTokenError):
        guard.begin(conn, token=tok(9))
    conn.execute("ROLLBACK")
    conn.close()


# -- a mark that is not an exact integer, a token column that cannot hold every token -----


def test_a_sqlite_mark_that_is_not_an_integer_fails_closed(tmp_path: Any) -> None:
    """A REAL 5.5 written by hand (or by a writer other than fenced) into the INTEGER token
    column: the CAST truncated it to 5, so token 5 passed and overwrote the mark. Now every
    token is refused as CorruptMarkError, in the fence table and the row form, nothing is
    written; once the mark is an integer again the rightful token passes."""
    conn = sqlite3.connect(tmp_path / "m.db", isolation_level=None)
    fence = SQLGuard("r", lock=LOCK)
    fence.install(conn)
    conn.execute("INSERT INTO fenced_fences VALUES ('r', ?, 5.5)", (LOCK,))
    conn.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, body TEXT, fencing_token INTEGER)")
    conn.execute("INSERT INTO docs VALUES (1, 'original', 5.5)")
    rows = RowGuard("docs", lock=LOCK)
    rows.install(conn)
    for value in (5, 6):
        conn.execute("BEGIN IMMEDIATE")
        with pytest.raises(CorruptMarkError, match="not an integer"):
            fence.check(conn, token=tok(value))
        conn.execute("ROLLBACK")
        with pytest.raises(CorruptMarkError, match="not an integer"):
            rows.update(conn, token=tok(value), key={"id": 1}, values={"body": "new"})
        with pytest.raises(CorruptMarkError, match="not an integer"):
            rows.insert_or_update(conn, token=tok(value), key={"id": 1}, values={"body": "new"})
    with pytest.raises(CorruptMarkError):
        fence.high_water(conn)
    with pytest.raises(CorruptMarkError):
        rows.high_water(conn, {"id": 1})
    assert conn.execute("SELECT token FROM fenced_fences").fetchall() == [(5.5,)]
    assert conn.execute("SELECT body, fencing_token FROM docs").fetchall() == [("original", 5.5)]
    # repaired by the operator: the rightful token passes, the stale one is refused
    conn.execute("UPDATE fenced_fences SET token = 6")
    conn.execute("UPDATE docs SET fencing_token = 6")
    assert fence.begin(conn, token=tok(6)) == tok(6)
    conn.execute("COMMIT")
    assert rows.update(conn, token=tok(6), key={"id": 1}, values={"body": "six"}) == tok(6)
    conn.execute("BEGIN IMMEDIATE")
    with pytest.raises(StaleTokenError):
        fence.check(conn, token=tok(5))
    conn.execute("ROLLBACK")
    with pytest.raises(StaleTokenError):
        rows.update(conn, token=tok(5), key={"id": 1}, values={"body": "five"})
    assert conn.execute("SELECT body, fencing_token FROM docs").fetchall() == [("six", 6)]
    conn.close()


def test_a_sqlite_real_token_column_fails_closed_at_use(tmp_path: Any) -> None:
    """A REAL token column (refused by install(), used without it) rounds tokens above 2**53
    together: after 2**53 + 1 was stored (as 2**53), the stale 2**53 passed. Now a mark held
    as REAL is never compared: refused as the column's type, nothing written."""
    conn = sqlite3.connect(tmp_path / "r.db", isolation_level=None)
    conn.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, body TEXT, fencing_token REAL)")
    conn.execute("INSERT INTO docs VALUES (1, 'original', NULL)")
    rows = RowGuard("docs", lock=LOCK)
    big = 2**53 + 1
    assert rows.update(conn, token=tok(big), key={"id": 1}, values={"body": "big"}) == tok(big)
    for value in (2**53, big, big + 1):
        with pytest.raises(ConfigurationError, match="64-bit integer"):
            rows.update(conn, token=tok(value), key={"id": 1}, values={"body": "later"})
    assert conn.execute("SELECT body FROM docs").fetchall() == [("big",)]
    conn.execute("CREATE TABLE real_fences (resource TEXT PRIMARY KEY, lock_name TEXT, token REAL)")
    fence = SQLGuard("r", lock=LOCK, table="real_fences")
    conn.execute("BEGIN IMMEDIATE")
    with pytest.raises(ConfigurationError, match="64-bit integer"):
        fence.check(conn, token=tok(big))
    conn.execute("ROLLBACK")
    assert conn.execute("SELECT * FROM real_fences").fetchall() == []
    conn.close()


@pytest.mark.parametrize("type_", ["DOUBLE PRECISION", "REAL", "INTEGER", "SMALLINT", "NUMERIC"])
def test_a_postgresql_token_column_is_verified_at_first_use(pg_dsn: str, type_: str) -> None:
    """install() refuses these token columns, but a table made by hand was used as found: a
    double precision column rounds 2**53 + 1 to 2**53, and then the stale 2**53 passed. Now
    the column's type is verified before a connection's first use of the table (fence table
    and row form, sync and async): ConfigurationError, nothing written; a bigint one passes."""
    import asyncio

    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f"CREATE TABLE docs (id INTEGER PRIMARY KEY, body TEXT, fencing_token {type_})")
        c.execute("INSERT INTO docs VALUES (1, 'original', NULL)")
        c.execute(
            "CREATE TABLE fences (resource TEXT PRIMARY KEY, lock_name TEXT NOT NULL, "
            f"token {type_} NOT NULL)"
        )
        rows, fence = RowGuard("docs", lock=LOCK), SQLGuard("r", lock=LOCK, table="fences")
        for write in (rows.update, rows.insert_or_update):
            with pytest.raises(ConfigurationError, match=f"is {type_.lower()}"):
                write(c, token=tok(2**53 + 1), key={"id": 1}, values={"body": "new"})
        with pytest.raises(ConfigurationError, match=f"is {type_.lower()}"), c.transaction():
            fence.check(c, token=tok(5))
        with pytest.raises(ConfigurationError, match=f"is {type_.lower()}"):
            fence.begin(c, token=tok(5))
        c.execute("ROLLBACK")

        async def async_side() -> None:
            async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as a:
                with pytest.raises(ConfigurationError, match=f"is {type_.lower()}"):
                    await rows.aupdate(a, token=tok(5), key={"id": 1}, values={"body": "new"})
                with pytest.raises(ConfigurationError, match=f"is {type_.lower()}"):
                    async with a.transaction():
                        await fence.acheck(a, token=tok(5))

        asyncio.run(async_side())
        assert c.execute("SELECT body, fencing_token FROM docs").fetchall() == [("original", None)]
        assert c.execute("SELECT * FROM fences").fetchall() == []
        # the same tables with bigint token columns: the rightful token passes, stale refused
        c.execute("ALTER TABLE docs ALTER COLUMN fencing_token TYPE BIGINT")
        c.execute("ALTER TABLE fences ALTER COLUMN token TYPE BIGINT")
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        big = tok(2**53 + 1)
        assert rows.update(c, token=big, key={"id": 1}, values={"body": "big"}) == big
        with pytest.raises(StaleTokenError):
            rows.update(c, token=tok(2**53), key={"id": 1}, values={"body": "stale"})
        with c.transaction():
            assert fence.check(c, token=big) == big
        with pytest.raises(StaleTokenError), c.transaction():
            fence.check(c, token=tok(2**53))
        assert c.execute("SELECT body FROM docs").fetchall() == [("big",)]


# -- SQLGuard.transaction: the check in the same round trip (PostgreSQL pipeline) ----------


def _stale_pipelined_write_is_never_committed(conn: Any, guard: SQLGuard) -> bool:
    """The checker: token 10 writes in a guarded transaction, then the stale 9 tries, with a
    read of its own write inside the block and without; 9 must raise and leave 10's data."""
    conn.execute("CREATE TABLE IF NOT EXISTS acct (id INTEGER PRIMARY KEY, v BIGINT)")
    conn.execute("INSERT INTO acct (id, v) VALUES (1, 0) ON CONFLICT DO NOTHING")
    with guard.transaction(conn, token=tok(10)) as accepted:
        conn.execute("UPDATE acct SET v = 10 WHERE id = 1")
    assert accepted == tok(10)
    refused, param = 0, "?" if isinstance(conn, sqlite3.Connection) else "%s"
    for read_inside in (False, True):
        try:
            with guard.transaction(conn, token=tok(9)):
                conn.execute("UPDATE acct SET v = 9 WHERE id = 1")
                conn.execute(
                    "INSERT INTO acct (id, v) VALUES (?, 9)".replace("?", param),
                    (90 + read_inside,),
                )
                if read_inside:
                    conn.execute("SELECT v FROM acct WHERE id = 1").fetchall()
        except StaleTokenError as exc:
            assert exc.high_water == tok(10)
            refused += 1
    rows = [tuple(r) for r in conn.execute("SELECT id, v FROM acct ORDER BY id").fetchall()]
    return refused == 2 and rows == [(1, 10)] and guard.high_water(conn) == tok(10)


def test_guarded_transaction_refuses_a_stale_token_and_commits_the_rightful_one(
    env: Env, conn: Any
) -> None:
    """On PostgreSQL BEGIN, the check, the caller's statements and COMMIT go in one pipeline
    (the check raises in the server); elsewhere begin() and COMMIT. Both: a stale token
    commits nothing, the rightful one commits everything, the connection is left idle."""
    guard = SQLGuard("acct", lock=LOCK)
    guard.install(conn)
    assert _stale_pipelined_write_is_never_committed(conn, guard)
    assert not (conn.in_transaction if env.kind == "sqlite" else conn.info.transaction_status)
    with guard.transaction(conn, token=tok(11)):
        conn.execute("UPDATE acct SET v = 11 WHERE id = 1")
        if env.kind == "pg":  # results can be read inside the block
            assert conn.execute("SELECT v FROM acct").fetchall() == [(11,)]
    assert conn.execute("SELECT v FROM acct").fetchall() == [(11,)]
    with pytest.raises(ZeroDivisionError), guard.transaction(conn, token=tok(12)):
        conn.execute("UPDATE acct SET v = 12 WHERE id = 1")
        raise ZeroDivisionError  # the block's own error: rolled back, raised as it is
    assert conn.execute("SELECT v FROM acct").fetchall() == [(11,)]
    assert guard.high_water(conn) == tok(11)
    env.begin(conn)
    with pytest.raises(ConfigurationError, match="already open"):
        with guard.transaction(conn, token=tok(13)):
            pass
    conn.execute("ROLLBACK")


def test_batch_refuses_a_stale_token_and_commits_the_rightful_one(env: Env, conn: Any) -> None:
    """``batch`` (one request on MariaDB: tests/guards/test_guard_mysql.py): here a psycopg
    pipeline or begin, check, statements, commit. The stale batch commits nothing, the
    rightful one everything and returns each statement's row count."""
    guard = SQLGuard("acct", lock=LOCK)
    guard.install(conn)
    p = "?" if env.kind == "sqlite" else "%s"
    conn.execute("CREATE TABLE IF NOT EXISTS acct (id INTEGER PRIMARY KEY, v BIGINT)")
    conn.execute("INSERT INTO acct (id, v) VALUES (1, 0), (2, 0)")
    if env.kind == "sqlite":
        conn.commit()
    update = (f"UPDATE acct SET v = {p}", (10,))
    assert guard.batch(
        conn, [update, (f"DELETE FROM acct WHERE id = {p}", (2,))], token=tok(10)
    ) == [2, 1]
    with pytest.raises(StaleTokenError):
        guard.batch(conn, [("UPDATE acct SET v = 9", None)], token=tok(9))
    assert [tuple(r) for r in conn.execute("SELECT id, v FROM acct").fetchall()] == [(1, 10)]
    assert guard.high_water(conn) == tok(10)
    assert not (conn.in_transaction if env.kind == "sqlite" else conn.info.transaction_status)


def test_guarded_transaction_reports_what_the_server_refused_on(pg_dsn: str) -> None:
    """The refusal raised in the server carries the fence row: another lock's row is
    WrongLockError, a zero mark CorruptMarkError, nothing written; a new resource passes."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        guard = SQLGuard("acct", lock=LOCK)
        guard.install(c)
        c.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v BIGINT)")
        c.execute(
            "ALTER TABLE fenced_fences DROP CONSTRAINT fenced_fences_token_check"
        )  # (a hand edit)
        c.execute(
            "INSERT INTO fenced_fences VALUES ('acct', 'someone-else', 5), ('zero', %s, 0)", (LOCK,)
        )
        with pytest.raises(fenced.WrongLockError), guard.transaction(c, token=tok(7)):
            c.execute("INSERT INTO acct VALUES (1, 7)")
        with (
            pytest.raises(CorruptMarkError),
            SQLGuard("zero", lock=LOCK).transaction(c, token=tok(7)),
        ):
            c.execute("INSERT INTO acct VALUES (2, 7)")
        assert c.execute("SELECT * FROM acct").fetchall() == []
        with SQLGuard("new", lock=LOCK).transaction(c, token=tok(7)):
            c.execute("INSERT INTO acct VALUES (3, 7)")
        assert c.execute("SELECT * FROM acct").fetchall() == [(3, 7)]


def test_the_ride_needs_no_refusal_function(pg_dsn: str) -> None:
    """Tables installed by an older fenced lack ``fenced_refuse_v1``: ``transaction()``
    outside a pipeline names no function (its recheck neither), so the rightful write
    commits, a stale one is refused with nothing written, and a block that ended the
    transaction is refused; ``batch``'s pipeline, which calls it, says to run install()."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        guard = SQLGuard("acct", lock=LOCK)
        guard.install(c)
        c.execute("DROP FUNCTION fenced_refuse_v1(regclass, text)")
        c.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v BIGINT)")
        with guard.transaction(c, token=tok(5)):
            c.execute("INSERT INTO acct VALUES (1, 5)")
        with guard.transaction(c, token=tok(6)):
            c.execute("INSERT INTO acct VALUES (2, 6)")
        with pytest.raises(StaleTokenError), guard.transaction(c, token=tok(5)):
            c.execute("INSERT INTO acct VALUES (3, 5)")
        with (
            pytest.raises(ConfigurationError, match="ended the transaction"),
            guard.transaction(c, token=tok(6)),
        ):
            c.execute("COMMIT")
            c.execute("INSERT INTO acct VALUES (4, 6)")
        with pytest.raises(ConfigurationError, match="install"):
            guard.batch(c, [("INSERT INTO acct VALUES (5, 6)", None)], token=tok(6))
        assert c.execute("SELECT id FROM acct ORDER BY id").fetchall() == [(1,), (2,)]
        assert guard.high_water(c) == tok(6)


def _stale_batch_is_never_committed(conn: Any, guard: SQLGuard) -> bool:
    """The checker of ``batch`` (one psycopg pipeline): token 10's batch, then the stale 9's;
    9 must raise and leave 10's data."""
    conn.execute("CREATE TABLE IF NOT EXISTS acct (id INTEGER PRIMARY KEY, v BIGINT)")
    conn.execute("INSERT INTO acct (id, v) VALUES (1, 0) ON CONFLICT DO NOTHING")
    guard.batch(conn, [("UPDATE acct SET v = 10 WHERE id = 1", None)], token=tok(10))
    try:
        guard.batch(
            conn,
            [
                ("UPDATE acct SET v = 9 WHERE id = 1", None),
                ("INSERT INTO acct VALUES (90, 9)", None),
            ],
            token=tok(9),
        )
        refused = False
    except StaleTokenError as exc:
        refused = exc.high_water == tok(10)
    rows = [tuple(r) for r in conn.execute("SELECT id, v FROM acct ORDER BY id").fetchall()]
    return refused and rows == [(1, 10)] and guard.high_water(conn) == tok(10)


def test_a_pipelined_check_that_does_not_raise_is_caught(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: the refusal function returns NULL instead of raising. In ``batch``'s pipeline
    nothing waits for the check's answer, so the stale batch commits: the checker catches it
    (and passes the real check)."""
    from fenced.guards import _sql_driver

    with psycopg.connect(pg_dsn, autocommit=True) as c:
        guard = SQLGuard("acct", lock=LOCK)
        guard.install(c)
        assert _stale_batch_is_never_committed(c, guard)
        c.execute("DROP TABLE acct; DELETE FROM fenced_fences")
        c.execute(
            "CREATE FUNCTION planted_refuse(tbl regclass, res text) RETURNS bigint "
            "LANGUAGE sql VOLATILE AS 'SELECT NULL::bigint'"
        )
        real = _sql_plan.pg_pipelined_check
        monkeypatch.setattr(
            _sql_driver,
            "pg_pipelined_check",
            lambda table: real(table).replace("fenced_refuse_v1(", "planted_refuse("),
        )
        assert not _stale_batch_is_never_committed(c, guard)


def _planted_ride(
    monkeypatch: pytest.MonkeyPatch, plant: Callable[[str, str], tuple[str, str]]
) -> contextlib.AbstractContextManager[None]:
    """``transaction()``'s two statements replaced by ``plant(check, recheck)``."""
    real = _sql_plan.pg_ride_sql
    return planted_ride(monkeypatch, lambda table: plant(*real(table)))


def test_a_riding_check_that_does_not_refuse_is_caught(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: the check that rides with BEGIN accepts any token (its condition dropped).
    The stale transaction commits and lowers the mark: the checker catches it."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        guard = SQLGuard("acct", lock=LOCK)
        guard.install(c)
        with _planted_ride(
            monkeypatch,
            lambda check, recheck: (re.sub(r" WHERE .* RETURNING", " RETURNING", check), recheck),
        ):
            assert not _stale_pipelined_write_is_never_committed(c, guard)


def test_a_riding_recheck_that_does_not_raise_is_caught(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: the recheck that rides with COMMIT never raises (its refusing branch is 0).
    The old holder's statements after its own COMMIT then commit over the new holder's
    write: the same checker as the real guard's catches it."""
    env = Env("pg", pg_dsn)
    with env.connect() as conn:
        with _planted_ride(
            monkeypatch,
            lambda check, recheck: (check, re.sub(r" ELSE .* END$", " ELSE 0 END", recheck)),
        ):
            rows, mark, outcome = _old_holder_commits_midway(env, conn, "transaction")
    assert rows == [("old-2",)] and mark == tok(6) and outcome == "committed"


def test_guarded_transaction_keeps_the_connection_as_it_was(pg_dsn: str) -> None:
    """The ride on psycopg: autocommit and not, with the connection's isolation level, with
    prepared statements (dropped by DEALLOCATE ALL between transactions: prepared again) and
    without (``prepare_threshold=None``, as for pgbouncer: the statements as literals). The
    connection comes back idle with its autocommit setting. A COMMIT inside the block, even
    with no newer holder, is refused at the recheck: what followed it is rolled back."""
    for autocommit, threshold in ((True, 5), (False, 5), (True, None), (False, None)):
        with psycopg.connect(pg_dsn, autocommit=autocommit, prepare_threshold=threshold) as c:
            guard = SQLGuard("acct", lock=LOCK)
            guard.install(c)
            c.execute("DROP TABLE IF EXISTS acct")
            c.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v BIGINT)")
            c.execute("DELETE FROM fenced_fences")
            c.commit()
            c.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            for value in (1, 2):
                with guard.transaction(c, token=tok(10)) as accepted:
                    assert c.autocommit is False  # (psycopg begins again after an end)
                    c.execute("INSERT INTO acct VALUES (%s, 10)", (value,))
                    level = c.execute("SHOW transaction_isolation").fetchone()
                    assert level == ("repeatable read",)
                assert accepted == tok(10)
                assert c.autocommit is autocommit
                assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
                c.execute("DEALLOCATE ALL")
                c.commit()
            with pytest.raises(ZeroDivisionError), guard.transaction(c, token=tok(11)):
                c.execute("INSERT INTO acct VALUES (3, 11)")
                raise ZeroDivisionError
            assert c.autocommit is autocommit
            with (
                pytest.raises(ConfigurationError, match="ended the transaction"),
                guard.transaction(c, token=tok(10)),
            ):
                c.execute("INSERT INTO acct VALUES (4, 10)")
                c.execute("COMMIT")
                c.execute("INSERT INTO acct VALUES (5, 10)")
            assert c.autocommit is autocommit
            rows = c.execute("SELECT id FROM acct ORDER BY id").fetchall()
            assert rows == [(1,), (2,), (4,)]
            assert guard.high_water(c) == tok(10)
            c.commit()


def test_a_fencer_on_psycopg_fences_in_one_message(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SQLFencer.fence`` on psycopg: ``BEGIN; <check>; COMMIT`` in one message (one round
    trip, after the table's first-use verification), autocommit or not, sync and async: the
    current token raises the mark, an equal one passes, a stale one is refused (the mark
    kept, the connection idle)."""
    import asyncio

    from fenced.guards import _sql_driver

    sent: list[object] = []
    real_io, real_aio = _sql_driver._ride_io, _sql_driver._aride_io

    def io(c: Any, s: object) -> Any:
        sent.append(s)
        return real_io(c, s)

    monkeypatch.setattr(_sql_driver, "_ride_io", io)

    async def aio(c: Any, s: object) -> Any:
        sent.append(s)
        return await real_aio(c, s)

    monkeypatch.setattr(_sql_driver, "_aride_io", aio)
    guard = SQLGuard("acct", lock=LOCK)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        guard.install(c)
    for autocommit in (True, False):
        fencer = guard.fencer(
            functools.partial(psycopg.connect, pg_dsn, autocommit=autocommit), keep_connection=True
        )
        fencer.fence(tok(10))  # (the first: the table verified, then the message)
        sent.clear()
        fencer.fence(tok(10))
        fencer.fence(tok(11))
        assert [type(s).__name__ for s in sent] == ["_Message", "_Message"]
        assert all(s.sql.endswith(b"; COMMIT") for s in sent)  # type: ignore[attr-defined]
        with pytest.raises(StaleTokenError) as refused:
            fencer.fence(tok(9))
        assert refused.value.high_water == tok(11)
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            assert guard.high_water(c) == tok(11)
            c.execute("DELETE FROM fenced_fences")
        fencer.close()
        fencer.close()

    async def scenario() -> None:
        afencer = guard.afencer(
            lambda: psycopg.AsyncConnection.connect(pg_dsn, autocommit=True), keep_connection=True
        )
        await afencer.fence(tok(20))
        sent.clear()
        await afencer.fence(tok(21))
        assert [type(s).__name__ for s in sent] == ["_Message"]
        with pytest.raises(StaleTokenError):
            await afencer.fence(tok(20))
        async with afencer.connections.connection() as a:
            assert await guard.ahigh_water(a) == tok(21)
            assert a.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        await afencer.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("threshold", [0, 1])
def test_a_savepoint_rolled_back_inside_the_block_keeps_the_transaction(
    pg_dsn: str, threshold: int
) -> None:
    """psycopg deallocates every prepared statement of the session after a rollback (a
    savepoint's too) once it has prepared statements of its own (``prepare_threshold=0``:
    at once). A nested ``conn.transaction()`` rolled back inside the block must not cost
    the recheck its statement: the block commits, and the next transaction passes too."""
    with psycopg.connect(pg_dsn, autocommit=True, prepare_threshold=threshold) as c:
        guard = SQLGuard("acct", lock=LOCK)
        guard.install(c)
        c.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v BIGINT)")
        for value in (1, 2):
            with guard.transaction(c, token=tok(10)):
                c.execute("INSERT INTO acct VALUES (%s, 10)", (value,))
                with contextlib.suppress(psycopg.errors.UniqueViolation), c.transaction():
                    c.execute("INSERT INTO acct VALUES (%s, 10)", (value,))  # (a duplicate)
                c.execute("INSERT INTO acct VALUES (%s, 10)", (value + 10,))
        assert c.execute("SELECT id FROM acct ORDER BY id").fetchall() == [(1,), (2,), (11,), (12,)]
        assert guard.high_water(c) == tok(10)


def test_begin_on_a_connection_that_prepares_everything(pg_dsn: str) -> None:
    """``begin()`` sends ``BEGIN; <check>`` as one message: with ``prepare_threshold=0``
    psycopg must not try to prepare it (two statements cannot be; it was a
    ConfigurationError); a stale token is still refused."""
    with psycopg.connect(pg_dsn, autocommit=True, prepare_threshold=0) as c:
        guard = SQLGuard("acct", lock=LOCK)
        guard.install(c)
        for value in (10, 10, 11):
            assert guard.begin(c, token=tok(value)) == tok(value)
            c.execute("COMMIT")
        with pytest.raises(StaleTokenError):
            guard.begin(c, token=tok(9))
        c.execute("ROLLBACK")
        assert guard.high_water(c) == tok(11)


def test_a_closed_psycopg_connection_is_backend_unavailable(pg_dsn: str) -> None:
    """``transaction()``, ``atransaction()``, ``begin()`` and a fencer on a closed psycopg
    connection: BackendUnavailable (its unknown transaction status read as "a transaction is
    already open", a ConfigurationError, before)."""
    import asyncio

    guard = SQLGuard("acct", lock=LOCK)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        guard.install(c)
    c = psycopg.connect(pg_dsn, autocommit=True)
    c.close()
    with pytest.raises(BackendUnavailable), guard.transaction(c, token=tok(1)):
        pass
    with pytest.raises(BackendUnavailable):
        guard.begin(c, token=tok(1))
    with pytest.raises(BackendUnavailable):
        guard.fencer(lambda: c).fence(tok(1))

    async def scenario() -> None:
        a = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
        await a.close()
        with pytest.raises(BackendUnavailable):
            async with guard.atransaction(a, token=tok(1)):
                pass

    asyncio.run(scenario())


def test_async_guarded_transaction_is_pipelined_the_same_way(pg_dsn: str) -> None:
    """``atransaction`` on a ``psycopg.AsyncConnection``: the rightful token's block commits,
    a stale one's (with and without a read inside) commits nothing and raises
    StaleTokenError; an open transaction is refused."""
    import asyncio

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as a:
            guard = SQLGuard("acct", lock=LOCK)
            await guard.ainstall(a)
            await a.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v BIGINT)")
            async with guard.atransaction(a, token=tok(10)) as accepted:
                await a.execute("INSERT INTO acct VALUES (1, 10)")
            assert accepted == tok(10)
            for read_inside in (False, True):
                with pytest.raises(StaleTokenError):
                    async with guard.atransaction(a, token=tok(9)):
                        await a.execute("UPDATE acct SET v = 9")
                        if read_inside:
                            await (await a.execute("SELECT v FROM acct")).fetchall()
            assert await (await a.execute("SELECT id, v FROM acct")).fetchall() == [(1, 10)]
            assert await guard.ahigh_water(a) == tok(10)
            async with a.transaction():
                with pytest.raises(ConfigurationError, match="already open"):
                    async with guard.atransaction(a, token=tok(11)):
                        pass

    asyncio.run(scenario())


def _old_holder_commits_midway(
    env: Env, conn: Any, form: str, *, end: str = "COMMIT", **connect: Any
) -> tuple[list[tuple[Any, ...]], FencingToken | None, object]:
    """The old holder's batch (or transaction() block) ends its transaction in the middle
    (``end``: a ``COMMIT`` or ``ROLLBACK`` statement, or psycopg's ``commit()``): the fence
    row is released, the new holder (token 6) fences and writes, and the old holder's later
    statements committed over it (PostgreSQL's pipeline before the recheck: 'old-2' with the
    mark at 6). Returns the data, the mark and the old holder's outcome after the new holder
    has written; ``connect``: the old holder's connection's options."""
    guard = SQLGuard("acct", lock=LOCK)
    guard.install(conn)
    conn.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v TEXT)")
    conn.execute("INSERT INTO acct VALUES (1, 'init')")
    pg = env.kind == "pg"
    gate = env.connect()
    if pg:  # (the old holder pauses after its COMMIT, as by a GC pause, until released)
        gate.execute("SELECT pg_advisory_lock(42)")
    outcome: list[object] = []

    def old_holder() -> None:
        old = env.connect(**(connect if pg else {"check_same_thread": False}))
        try:
            statements: list[tuple[str, None]] = [
                ("UPDATE acct SET v = 'old-1' WHERE id = 1", None),
                (end, None),
                ("SELECT pg_advisory_lock(42)" if pg else "SELECT 1", None),
                ("UPDATE acct SET v = 'old-2' WHERE id = 1", None),
            ]
            if form == "batch":
                guard.batch(old, statements, token=tok(5))
            else:
                with guard.transaction(old, token=tok(5)):
                    for statement, params in statements:
                        if statement == "commit()":
                            old.commit()
                        else:
                            old.execute(statement, params)
            outcome.append("committed")
        except fenced.FencedError as exc:
            outcome.append(exc)
        finally:
            old.close()

    def paused() -> bool:
        q = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'"
        return pg and bool(gate.execute(q).fetchone()[0])

    thread = threading.Thread(target=old_holder)
    thread.start()
    wait_for(lambda: outcome or paused(), 20, "the old holder at its pause")
    assert guard.batch(conn, [("UPDATE acct SET v = 'new' WHERE id = 1", None)], token=tok(6)) == [
        1
    ]
    if pg:
        gate.execute("SELECT pg_advisory_unlock(42)")
    thread.join(30)
    gate.close()
    rows = [tuple(r) for r in conn.execute("SELECT v FROM acct").fetchall()]
    return rows, guard.high_water(conn), outcome[0]


def _no_stale_write_after_the_end(env: Env, conn: Any, form: str, **kw: Any) -> None:
    """Nothing of the old holder's after its end is kept (refused: the pipeline's and the
    ride's recheck; the SQLite batch's block stops at the statement that ended it); the
    rightful holder's batch then commits."""
    rows, mark, outcome = _old_holder_commits_midway(env, conn, form, **kw)
    assert rows == [("new",)]
    assert mark == tok(6)
    # (StaleTokenError says nothing of the call was written: only when the end rolled back
    # the check's transaction; a COMMIT committed it and 'old-1', told so)
    refused = env.kind == "pg" and kw.get("end") == "ROLLBACK"
    assert isinstance(outcome, StaleTokenError if refused else ConfigurationError), outcome
    if env.kind == "pg" and not refused:
        assert "what ran before the end was committed" in str(outcome)
    guard = SQLGuard("acct", lock=LOCK)
    assert guard.batch(conn, [("UPDATE acct SET v = 'six' WHERE id = 1", None)], token=tok(6)) == [
        1
    ]
    assert [tuple(r) for r in conn.execute("SELECT v FROM acct").fetchall()] == [("six",)]


def test_a_batch_statement_that_commits_lets_no_stale_write_in(env: Env, conn: Any) -> None:
    _no_stale_write_after_the_end(env, conn, "batch")


def test_a_psycopg_batch_whose_connection_is_lost_mid_pipeline_is_told_unknown(
    pg_dsn: str,
) -> None:
    """The pipeline holds the COMMIT: a connection lost while it runs was a plain
    BackendUnavailable, which invites a retry with the same token though the server may
    have committed. Now the error says the outcome is unknown (here the server was told to
    end the session, so it rolled back: the caller reads back and sees)."""
    env = Env("pg", pg_dsn)
    with env.connect() as conn, env.connect() as killer:
        conn.autocommit = killer.autocommit = True
        guard = SQLGuard("acct", lock=LOCK)
        guard.install(conn)
        conn.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v INT)")
        conn.execute("INSERT INTO t VALUES ('a', 0)")
        pid = conn.info.backend_pid
        guard.batch(conn, [("SELECT 1", None)], token=tok(5))  # (the table verified)
        asleep = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND query LIKE '%%sleep%%'"

        def kill() -> None:
            wait_for(lambda: killer.execute(asleep, (pid,)).fetchone()[0], 20, "the sleep")
            killer.execute("SELECT pg_terminate_backend(%s)", (pid,))

        thread = threading.Thread(target=kill)
        thread.start()
        statements: list[tuple[str, None]] = [
            ("UPDATE t SET v = 1 WHERE k = 'a'", None),
            ("SELECT pg_sleep(20)", None),
        ]
        with pytest.raises(fenced.BackendUnavailable, match="the outcome is unknown"):
            guard.batch(conn, statements, token=tok(5))
        thread.join(30)
        assert killer.execute("SELECT v FROM t").fetchone() == (0,)


def test_a_search_path_left_by_a_psycopg_batch_is_named_by_the_next_call(pg_dsn: str) -> None:
    """A batch's ``SET search_path = pg_catalog`` stays for the session: the next guarded
    call failed with a bare UndefinedTable. Now a ConfigurationError naming the fence table
    missing from the search_path, and the path; set back, the next batch commits."""
    env = Env("pg", pg_dsn)
    with env.connect() as conn:
        conn.autocommit = True
        guard = SQLGuard("acct", lock=LOCK)
        guard.install(conn)
        path = conn.execute("SHOW search_path").fetchone()[0]
        guard.batch(conn, [("SET search_path = pg_catalog", None)], token=tok(5))
        with pytest.raises(ConfigurationError, match=r"search_path \(pg_catalog\)"):
            guard.batch(conn, [("SELECT 1", None)], token=tok(5))
        conn.execute(f"SET search_path = {path}")
        assert guard.batch(conn, [("SELECT 1", None)], token=tok(5)) == [1]


@pytest.mark.parametrize(("end", "fate"), [("ROLLBACK", "rolled back"), ("COMMIT", "committed")])
def test_a_psycopg_batch_that_ends_its_transaction_midway_is_told_never_returned(
    pg_dsn: str, end: str, fate: str
) -> None:
    """psycopg's pipelined batch ``[UPDATE a, ROLLBACK, UPDATE b]`` returned ``[1, -1, 1]``:
    'a' rolled back, 'b' committed in a transaction of its own, the re-check passing in it.
    Now a witness (the check's transaction id, transaction-local) refuses any other
    transaction before the re-check: a ConfigurationError saying what the end made of the
    check's transaction (txid_status), and 'b' rolled back with the pipeline. Nobody newer
    here; the rightful holder's next batch commits."""
    env = Env("pg", pg_dsn)
    with env.connect() as conn:
        conn.autocommit = True
        guard = SQLGuard("acct", lock=LOCK)
        guard.install(conn)
        conn.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v INT)")
        conn.execute("INSERT INTO t VALUES ('a', 0), ('b', 0)")
        statements: list[tuple[str, None]] = [
            ("UPDATE t SET v = 1 WHERE k = 'a'", None),
            (end, None),
            ("UPDATE t SET v = 1 WHERE k = 'b'", None),
        ]
        with pytest.raises(ConfigurationError, match="ended the transaction") as caught:
            guard.batch(conn, statements, token=tok(5))
        assert f"what ran before the end was {fate}" in str(caught.value)
        a = 1 if end == "COMMIT" else 0
        assert conn.execute("SELECT k, v FROM t ORDER BY k").fetchall() == [("a", a), ("b", 0)]
        assert guard.high_water(conn) == (tok(5) if end == "COMMIT" else None)
        assert guard.batch(conn, [("UPDATE t SET v = 2 WHERE k = 'b'", None)], token=tok(5)) == [1]
        assert conn.execute("SELECT v FROM t WHERE k = 'b'").fetchone() == (2,)


@pytest.mark.parametrize(
    ("end", "autocommit"),
    [("COMMIT", True), ("COMMIT", False), ("ROLLBACK", True), ("commit()", True)],
)
def test_a_commit_in_a_guarded_transaction_lets_no_stale_write_in(
    pg_dsn: str, end: str, autocommit: bool
) -> None:
    """``transaction()`` on psycopg: whatever ends the transaction inside the block, on an
    autocommit connection or not, the statements after it open a new transaction (psycopg
    runs the block without autocommit), which the recheck riding with COMMIT refuses: the
    new holder's write stays."""
    env = Env("pg", pg_dsn)
    with env.connect() as conn:
        _no_stale_write_after_the_end(env, conn, "transaction", end=end, autocommit=autocommit)


def test_a_block_that_ends_the_transaction_and_turns_autocommit_on_is_told_so(
    pg_dsn: str,
) -> None:
    """The block COMMITs, a newer holder writes, then the block turns autocommit on and
    writes: psycopg commits that write as it runs, and no recheck can take it back. Raised as
    what happened (ConfigurationError: "committed as they ran, unfenced"), not as a refusal
    (StaleTokenError said the write was refused while it was in the table)."""
    env = Env("pg", pg_dsn)
    with env.connect() as a, env.connect() as b:
        guard = SQLGuard("acct", lock=LOCK)
        guard.install(a)
        a.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v TEXT)")
        a.execute("INSERT INTO acct VALUES (1, 'start')")
        a.commit()
        with pytest.raises(ConfigurationError, match="committed as they ran, unfenced"):
            with guard.transaction(a, token=tok(20)):
                a.execute("UPDATE acct SET v = 'A20'")
                a.execute("COMMIT")
                with guard.transaction(b, token=tok(21)):
                    b.execute("UPDATE acct SET v = 'B21'")
                a.autocommit = True
                a.execute("UPDATE acct SET v = 'A-after'")
        assert b.execute("SELECT v FROM acct").fetchall() == [("A-after",)]  # (as told)
        assert guard.high_water(b) == tok(21)


def test_a_commit_in_an_async_pipelined_transaction_lets_no_stale_write_in(pg_dsn: str) -> None:
    """The async twin: ``atransaction`` checks again after the block, in the same pipeline."""
    import asyncio

    guard = SQLGuard("acct", lock=LOCK)
    with psycopg.connect(pg_dsn, autocommit=True) as setup:
        guard.install(setup)
        setup.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v TEXT)")
        setup.execute("INSERT INTO acct VALUES (1, 'init')")
    gate = psycopg.connect(pg_dsn, autocommit=True)
    gate.execute("SELECT pg_advisory_lock(42)")

    def paused() -> bool:
        q = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'advisory'"
        return bool(gate.execute(q).fetchone()[0])  # type: ignore[index]

    def new_holder() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as new:
            guard.batch(new, [("UPDATE acct SET v = 'new' WHERE id = 1", None)], token=tok(6))
        gate.execute("SELECT pg_advisory_unlock(42)")

    async def main() -> BaseException | None:
        async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as old:

            async def old_holder() -> None:
                async with guard.atransaction(old, token=tok(5)):
                    await old.execute("UPDATE acct SET v = 'old-1' WHERE id = 1")
                    await old.execute("COMMIT")
                    await old.execute("SELECT pg_advisory_lock(42)")
                    await old.execute("UPDATE acct SET v = 'old-2' WHERE id = 1")

            task = asyncio.ensure_future(old_holder())
            await asyncio.to_thread(wait_for, lambda: task.done() or paused(), 20, "the pause")
            await asyncio.to_thread(new_holder)
            return (await asyncio.gather(task, return_exceptions=True))[0]

    outcome = asyncio.run(main())
    gate.close()
    # (the COMMIT committed the check and 'old-1': told, never a refusal)
    assert isinstance(outcome, ConfigurationError), outcome
    assert "what ran before the end was committed" in str(outcome)
    with psycopg.connect(pg_dsn, autocommit=True) as check:
        assert check.execute("SELECT v FROM acct").fetchall() == [("new",)]
        assert guard.high_water(check) == tok(6)


class _SubConnection(sqlite3.Connection):
    """A sqlite3.Connection subclass: transaction() takes the general dispatch for it."""


@pytest.mark.parametrize("factory", [sqlite3.Connection, _SubConnection])
def test_sqlite_transaction_block_refuses_stale_and_fails_closed_on_either_path(
    tmp_path: Any, factory: type[sqlite3.Connection]
) -> None:
    """``transaction()`` on a plain sqlite3 connection is a direct path (no driver dispatch);
    on a subclass it is the general one. Both: the stale block commits nothing, the rightful
    one commits, the block's error rolls back, a corrupt mark and an open or closed
    connection are refused, and nothing is left open."""
    conn = sqlite3.connect(tmp_path / "t.db", isolation_level=None, factory=factory)
    conn.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v BIGINT)")
    conn.execute("INSERT INTO acct VALUES (1, 0)")
    guard = SQLGuard("acct", lock=LOCK)
    guard.install(conn)
    with guard.transaction(conn, token=tok(10)) as accepted:
        assert accepted == tok(10) and conn.in_transaction
        conn.execute("UPDATE acct SET v = 10")
    with guard.transaction(conn, token=tok(10)):  # the same holder again
        conn.execute("UPDATE acct SET v = 11")
    with pytest.raises(StaleTokenError) as stale, guard.transaction(conn, token=tok(9)):
        conn.execute("UPDATE acct SET v = 9")  # never runs
    assert stale.value.high_water == tok(10)
    with pytest.raises(WrongLockError), guard.transaction(conn, token=tok(12, "other")):
        pass
    with pytest.raises(ZeroDivisionError), guard.transaction(conn, token=tok(12)):
        conn.execute("UPDATE acct SET v = 12")
        raise ZeroDivisionError
    assert conn.execute("SELECT v FROM acct").fetchall() == [(11,)]
    assert guard.high_water(conn) == tok(10) and not conn.in_transaction
    conn.execute("BEGIN")
    with pytest.raises(ConfigurationError, match="already open"):
        with guard.transaction(conn, token=tok(13)):
            pass
    assert conn.in_transaction  # the caller's transaction, left to the caller
    conn.execute("ROLLBACK")
    # A table the guard did not make, with a zero mark: fail closed.
    conn.execute("DROP TABLE fenced_fences")
    conn.execute("CREATE TABLE fenced_fences (resource TEXT PRIMARY KEY, lock_name TEXT, token)")
    conn.execute("INSERT INTO fenced_fences VALUES ('acct', ?, 0)", (LOCK,))
    with pytest.raises(CorruptMarkError), guard.transaction(conn, token=tok(20)):
        conn.execute("UPDATE acct SET v = 20")
    assert conn.execute("SELECT v FROM acct").fetchall() == [(11,)] and not conn.in_transaction
    conn.close()
    with pytest.raises(BackendUnavailable, match="closed"), guard.transaction(conn, token=tok(30)):
        pass
