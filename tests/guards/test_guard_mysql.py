"""The SQL guards on a real MariaDB (InnoDB), beyond the guard conformance suite: racing
transactions under REPEATABLE READ and READ COMMITTED in both orders, the snapshot trap a
plain read would fall into, clients that count found rows, a kill -9 of the server, DDIA
Figure 8-5 with a SIGSTOPped process, racing processes, asyncmy, and bad input."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest
from pymysql.constants import CLIENT

import fenced
from fenced import FencingToken
from fenced.guards._sql_plan import FenceSQL
from fenced.guards.sql import Add, RowGuard, SQLGuard
from fenced.testing.servers import MariaDBServer
from tests.guards.processes import (
    LOCK,
    figure_8_5_violations,
    history_violations,
    paused_holder,
    race,
)
from tests.helpers import NO_TLS, asyncmy_args, wait_for

pytestmark = pytest.mark.xdist_group("mariadb")


def tok(value: int, lock: str = "orders") -> FencingToken:
    return FencingToken(lock, value)


@pytest.fixture
def connect(mysql_db: dict[str, Any]) -> Iterator[Any]:
    made: list[pymysql.connections.Connection] = []

    def connect(**extra: Any) -> pymysql.connections.Connection:
        conn = pymysql.connect(**{**mysql_db, **extra})
        made.append(conn)
        return conn

    yield connect
    for c in made:
        if c.open:
            c.close()


def sql(conn: Any, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with conn.cursor() as cur:
        cur.execute(statement, params)
        return list(cur.fetchall()) if cur.description else []


def fence_table(connect: Any) -> SQLGuard:
    guard = SQLGuard("orders")
    conn = connect(autocommit=True)
    guard.install(conn)
    sql(conn, "CREATE TABLE data (id INT PRIMARY KEY, v TEXT) ENGINE=InnoDB")
    return guard


def wait_until_waiting_for_a_lock(connect: Any, conn: Any, what: str) -> None:
    """Wait (20 s at most) until ``conn``'s transaction waits for a row lock.

    INNODB_TRX is a cache that InnoDB refreshes only when nobody has read it for 100 ms
    (every read restarts that clock: trx_i_s_cache), so polls come 0.15 s apart; polled
    faster, it showed the wait's start forever (CI, 2026-11-27: once the test's connections
    stopped costing 30 ms each). One connection for every poll, closed after."""
    poll = connect(autocommit=True)
    query = (
        "SELECT COUNT(*) FROM information_schema.INNODB_TRX "
        "WHERE trx_state = 'LOCK WAIT' AND trx_mysql_thread_id = %s"
    )
    deadline = time.monotonic() + 20
    try:
        while not sql(poll, query, (conn.thread_id(),))[0][0]:
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after 20 s waiting for {what}")
            time.sleep(0.15)
    finally:
        poll.close()


# -- racing transactions ------------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "READ COMMITTED"])
@pytest.mark.parametrize("first", ["higher", "lower"])
def test_two_racing_transactions_cannot_both_pass_out_of_order(
    connect: Any, isolation: str, first: str
) -> None:
    """The first transaction checks its token and holds; the second's check must wait for it
    (it locks the fence row) and then compare with what the first committed."""
    guard = fence_table(connect)
    seed = connect()
    guard.check(seed, token=tok(5))
    seed.commit()
    a, b = connect(), connect()
    for c in (a, b):
        sql(c, f"SET SESSION TRANSACTION ISOLATION LEVEL {isolation}")
        c.begin()
        sql(c, "SELECT COUNT(*) FROM data")  # a snapshot taken before either check
    low, high = tok(6), tok(7)
    one, two = (high, low) if first == "higher" else (low, high)
    guard.check(a, token=one)
    sql(a, "INSERT INTO data VALUES (1, %s)", (str(one.value),))
    outcome: list[object] = []

    def second() -> None:
        try:
            outcome.append(guard.check(b, token=two))
            sql(b, "INSERT INTO data VALUES (2, %s)", (str(two.value),))
            b.commit()
        except Exception as exc:
            b.rollback()
            outcome.append(exc)

    thread = threading.Thread(target=second)
    thread.start()
    wait_until_waiting_for_a_lock(connect, b, "the second check to wait for the row")
    assert not outcome  # it cannot decide while the first holds the row
    a.commit()
    thread.join(20)
    if first == "higher":
        assert isinstance(outcome[0], fenced.StaleTokenError), outcome
        assert outcome[0].high_water == high
        assert sql(connect(), "SELECT id FROM data") == [(1,)]
    else:
        assert outcome == [high]
        assert sorted(sql(connect(), "SELECT id FROM data")) == [(1,), (2,)]
    assert guard.high_water(connect()) == high


def test_the_row_form_races_the_same_way(connect: Any) -> None:
    conn = connect(autocommit=True)
    sql(conn, "CREATE TABLE accounts (id INT PRIMARY KEY, balance INT) ENGINE=InnoDB")
    sql(conn, "INSERT INTO accounts VALUES (1, 0)")
    guard = RowGuard("accounts", lock="orders")
    guard.install(conn)
    a, b = connect(), connect()
    for c in (a, b):
        sql(c, "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        c.begin()
        sql(c, "SELECT * FROM accounts")
    guard.update(a, token=tok(9), key={"id": 1}, values={"balance": Add(10)})
    outcome: list[object] = []

    def second() -> None:
        try:
            outcome.append(guard.update(b, token=tok(8), key={"id": 1}, values={"balance": Add(1)}))
        except Exception as exc:
            outcome.append(exc)
        b.rollback()

    thread = threading.Thread(target=second)
    thread.start()
    wait_until_waiting_for_a_lock(connect, b, "the second write to wait for the row")
    a.commit()
    thread.join(20)
    assert isinstance(outcome[0], fenced.StaleTokenError) and outcome[0].high_water == tok(9)
    assert sql(connect(), "SELECT balance, fencing_token FROM accounts") == [(10, 9)]


class SnapshotReadGuard(SQLGuard):
    """Planted: the refusal's read is a plain SELECT, which under REPEATABLE READ shows the
    transaction's snapshot rather than the mark that refused."""

    def _fence_sql(self, d: Any) -> FenceSQL:
        real = super()._fence_sql(d)
        return dataclasses.replace(real, read=real.read.removesuffix(" FOR UPDATE"))


def _refusal_after_an_old_snapshot(connect: Any, guard: SQLGuard) -> object:
    fence_table(connect)
    seed = connect()
    guard.check(seed, token=tok(3))
    seed.commit()
    old = connect()
    sql(old, "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    old.begin()
    sql(old, "SELECT * FROM fenced_fences")  # the snapshot: mark 3
    newer = connect()
    guard.check(newer, token=tok(7))
    newer.commit()
    try:
        return guard.check(old, token=tok(5))
    except fenced.FencedError as exc:
        return exc
    finally:
        old.rollback()


def test_a_refusal_names_the_mark_that_refused_not_the_snapshot(connect: Any) -> None:
    got = _refusal_after_an_old_snapshot(connect, SQLGuard("orders"))
    assert isinstance(got, fenced.StaleTokenError) and got.high_water == tok(7), got


def test_the_snapshot_trap_test_catches_a_plain_read(connect: Any) -> None:
    got = _refusal_after_an_old_snapshot(connect, SnapshotReadGuard("orders"))
    assert not isinstance(got, fenced.StaleTokenError), got


@pytest.mark.parametrize("form", ["fence", "row"])
def test_clients_that_count_found_rows_get_the_same_verdicts(connect: Any, form: str) -> None:
    """SQLAlchemy's MySQL dialects set CLIENT.FOUND_ROWS: affected-row counts then mean
    matched rows, and a refused upsert reports 1 like an insert. The verdict must not
    depend on it."""
    conn = connect(client_flag=CLIENT.FOUND_ROWS)
    if form == "fence":
        guard = fence_table(connect)

        def write(token: FencingToken) -> None:
            try:
                guard.check(conn, token=token)
                sql(conn, "REPLACE INTO data VALUES (1, %s)", (str(token.value),))
                conn.commit()
            except BaseException:
                conn.rollback()
                raise

        read = "SELECT v FROM data"
    else:
        sql(connect(autocommit=True), "CREATE TABLE data (id INT PRIMARY KEY, v TEXT)")
        row = RowGuard("data", lock="orders")
        row.install(conn)

        def write(token: FencingToken) -> None:
            row.insert_or_update(conn, token=token, key={"id": 1}, values={"v": str(token.value)})

        read = "SELECT v FROM data"
    write(tok(5))
    write(tok(5))  # equal: accepted (no change to count)
    write(tok(6))
    with pytest.raises(fenced.StaleTokenError):
        write(tok(4))
    assert sql(connect(), read) == [("6",)]


# -- durability, processes ----------------------------------------------------------------------


def test_the_mark_survives_kill_9_of_the_server() -> None:
    with MariaDBServer() as db:
        args = {
            "host": "127.0.0.1",
            "port": db.port,
            "user": "root",
            "database": "fenced",
            **NO_TLS,
        }
        guard = SQLGuard("orders")
        conn = pymysql.connect(**args, autocommit=True)
        guard.install(conn)
        conn.begin()
        guard.check(conn, token=tok(10))
        conn.commit()
        conn.close()
        db.restart(kill=True)
        conn = pymysql.connect(**args)
        with pytest.raises(fenced.StaleTokenError):
            guard.check(conn, token=tok(9))
        conn.rollback()
        assert guard.check(conn, token=tok(10)) == tok(10)  # the holder goes on
        conn.commit()
        conn.close()


@pytest.fixture
def mysql_target(mysql_db: dict[str, Any]) -> str:
    conn = pymysql.connect(**mysql_db, autocommit=True)
    sql(conn, "CREATE TABLE data (id INT PRIMARY KEY, v TEXT) ENGINE=InnoDB")
    sql(conn, "CREATE TABLE log (n INT AUTO_INCREMENT PRIMARY KEY, token BIGINT) ENGINE=InnoDB")
    SQLGuard("inv", lock=LOCK).install(conn)
    conn.close()
    return "mysql:mysql://root@127.0.0.1:{port}/{database}".format(**mysql_db)


def _data(mysql_db: dict[str, Any]) -> str | None:
    conn = pymysql.connect(**mysql_db)
    try:
        rows = sql(conn, "SELECT v FROM data WHERE id = 1")
        return rows[0][0] if rows else None
    finally:
        conn.close()


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_figure_8_5_a_paused_process_is_refused(
    mysql_target: str, mysql_db: dict[str, Any], tmp_path: Any, guarded: bool
) -> None:
    run = paused_holder(f"sqlite:///{tmp_path}/locks.db", mysql_target, "inv", guarded)
    bad = figure_8_5_violations(run, _data(mysql_db))
    if guarded:
        assert bad == [], bad
    else:  # the same run without the guard: the stale write lands (the test can fail)
        assert "the paused holder's stale write was accepted" in bad, bad


def test_racing_processes_commit_tokens_in_order(
    mysql_target: str, mysql_db: dict[str, Any]
) -> None:
    accepted = race(mysql_target, "inv", writers=4, per_writer=25)
    conn = pymysql.connect(**mysql_db)
    log = [r[0] for r in sql(conn, "SELECT token FROM log ORDER BY n")]
    conn.close()
    assert sum(accepted) == len(log) > 0
    assert history_violations(log, _data(mysql_db)) == []


# -- asyncmy ------------------------------------------------------------------------------------


def test_asyncmy_is_the_same_guard(mysql_db: dict[str, Any]) -> None:
    import asyncmy

    async def go() -> None:
        conn = await asyncmy.connect(**asyncmy_args(mysql_db), autocommit=True)
        try:
            guard = SQLGuard("orders")
            await guard.ainstall(conn)
            async with conn.cursor() as cur:
                await cur.execute("CREATE TABLE acc (id INT PRIMARY KEY, v TEXT) ENGINE=InnoDB")
            assert await guard.abegin(conn, token=tok(4)) == tok(4)
            await conn.commit()
            with pytest.raises(fenced.ConfigurationError, match="autocommit"):
                await guard.acheck(conn, token=tok(4))  # autocommit, no transaction open
            await conn.begin()
            with pytest.raises(fenced.StaleTokenError):
                await guard.acheck(conn, token=tok(3))
            await conn.rollback()
            assert await guard.ahigh_water(conn) == tok(4)
            row = RowGuard("acc", lock="orders")
            await row.ainstall(conn)
            await row.ainsert_or_update(conn, token=tok(4), key={"id": 1}, values={"v": "a"})
            await row.aupdate(conn, token=tok(5), key={"id": 1}, values={"v": "b"})
            with pytest.raises(fenced.StaleTokenError):
                await row.aupdate(conn, token=tok(4), key={"id": 1}, values={"v": "stale"})
            with pytest.raises(fenced.ResourceNotFoundError):
                await row.aupdate(conn, token=tok(5), key={"id": 2}, values={"v": "x"})
            async with conn.cursor() as cur:
                await cur.execute("SELECT v, fencing_token FROM acc")
                assert await cur.fetchall() == (("b", 5),)
        finally:
            conn.close()

    asyncio.run(go())


# -- bad input ----------------------------------------------------------------------------------


def test_install_refuses_to_commit_the_callers_transaction(connect: Any) -> None:
    conn = connect()
    sql(conn, "CREATE TABLE t (id INT PRIMARY KEY) ENGINE=InnoDB")
    conn.begin()
    sql(conn, "INSERT INTO t VALUES (1)")
    with pytest.raises(fenced.ConfigurationError, match="commits the open transaction"):
        SQLGuard("orders").install(conn)
    conn.rollback()
    assert sql(conn, "SELECT * FROM t") == []  # nothing committed behind the caller's back


def test_a_check_outside_a_transaction_in_autocommit_is_refused(connect: Any) -> None:
    guard = fence_table(connect)
    with pytest.raises(fenced.ConfigurationError, match="autocommit"):
        guard.check(connect(autocommit=True), token=tok(1))


def test_tables_that_would_fail_open_are_refused(connect: Any) -> None:
    conn = connect(autocommit=True)
    sql(conn, "CREATE TABLE myisam_fences (resource VARCHAR(100) PRIMARY KEY) ENGINE=MyISAM")
    with pytest.raises(fenced.ConfigurationError, match="MyISAM"):
        SQLGuard("orders", table="myisam_fences").install(conn)
    sql(
        conn,
        "CREATE TABLE ci_fences (resource VARCHAR(100) COLLATE utf8mb4_general_ci PRIMARY KEY, "
        "lock_name VARCHAR(100) COLLATE utf8mb4_general_ci, token BIGINT, checks BIGINT) "
        "ENGINE=InnoDB",
    )
    with pytest.raises(fenced.ConfigurationError, match="case-insensitively"):
        SQLGuard("orders", table="ci_fences").install(conn)
    sql(
        conn,
        "CREATE TABLE text_fences (resource VARCHAR(100) COLLATE utf8mb4_bin PRIMARY KEY, "
        "lock_name VARCHAR(100) COLLATE utf8mb4_bin, token TEXT, checks BIGINT) ENGINE=InnoDB",
    )
    with pytest.raises(fenced.ConfigurationError, match="not bigint"):
        SQLGuard("orders", table="text_fences").install(conn)
    sql(conn, "CREATE TABLE rows_text (id INT PRIMARY KEY, fencing_token VARCHAR(20))")
    with pytest.raises(fenced.ConfigurationError, match="64-bit"):
        RowGuard("rows_text", lock="orders").install(conn)
    with pytest.raises(fenced.ConfigurationError, match="does not exist"):
        RowGuard("missing", lock="orders").install(conn)
    long = SQLGuard("r" * 701, lock="orders")
    fence_table(connect)
    c = connect()
    with pytest.raises(fenced.ConfigurationError, match="at most 700"):
        long.check(c, token=tok(1))


def test_names_compare_exactly_whatever_the_collation(connect: Any) -> None:
    guard = fence_table(connect)
    conn = connect()
    guard.check(conn, token=tok(5))
    conn.commit()
    with pytest.raises(fenced.WrongLockError):
        SQLGuard("orders", lock="ORDERS").check(conn, token=tok(6, "ORDERS"))
    conn.rollback()
    other = SQLGuard("ORDERS", lock="orders")  # another resource, not the same row
    assert other.check(conn, token=tok(1)) == tok(1)
    conn.commit()
    # a row table whose lock column compares case-insensitively still refuses another lock
    plain = connect(autocommit=True)
    sql(
        plain,
        "CREATE TABLE r (id INT PRIMARY KEY, v TEXT, lk VARCHAR(50) COLLATE utf8mb4_general_ci)",
    )
    rows = RowGuard("r", lock="orders", lock_column="lk")
    rows.install(plain)
    rows.insert_or_update(plain, token=tok(5), key={"id": 1}, values={"v": "a"})
    with pytest.raises(fenced.WrongLockError):
        RowGuard("r", lock="ORDERS", lock_column="lk").insert_or_update(
            plain, token=tok(6, "ORDERS"), key={"id": 1}, values={"v": "b"}
        )
    assert sql(plain, "SELECT v, fencing_token, lk FROM r") == [("a", 5, "orders")]


def test_a_closed_connection_is_backend_unavailable(connect: Any) -> None:
    guard = fence_table(connect)
    conn = connect()
    conn.close()
    with pytest.raises(fenced.BackendUnavailable):
        guard.check(conn, token=tok(1))


# -- identifiers, engines, types and verdicts checked where they are used (issue 25) ----------


def test_a_token_column_under_another_case_is_the_one_checked(connect: Any) -> None:
    """MySQL column names ignore case: ``Fencing_Token SMALLINT`` *is* the guard's token column.
    install() looked it up exactly, missed it, took the failed ADD COLUMN for a racing install
    and never checked its type; without strict mode 40000 was then stored as 32767 and a
    stale 35000 accepted. Refused at install and at use (a guard never installed), nothing
    written; a BIGINT column under another case is used as it is."""
    plain = connect(autocommit=True)
    sql(plain, "CREATE TABLE acct (id INT PRIMARY KEY, v INT, Fencing_Token SMALLINT)")
    sql(plain, "INSERT INTO acct (id, v) VALUES (1, 0)")
    guard = RowGuard("acct", lock="orders")
    with pytest.raises(fenced.ConfigurationError, match="smallint"):
        guard.install(plain)
    loose = connect(autocommit=True, sql_mode="")
    with pytest.raises(fenced.ConfigurationError, match="smallint"):
        guard.update(loose, token=tok(40000), key={"id": 1}, values={"v": 1})
    with pytest.raises(fenced.ConfigurationError, match="smallint"):
        guard.insert_or_update(loose, token=tok(40000), key={"id": 2}, values={"v": 1})
    assert sql(plain, "SELECT id, v, Fencing_Token FROM acct") == [(1, 0, None)]
    sql(plain, "ALTER TABLE acct MODIFY Fencing_Token BIGINT")
    guard.install(plain)  # found under its own case: nothing added
    assert [r[0] for r in sql(plain, "SHOW COLUMNS FROM acct")] == ["id", "v", "Fencing_Token"]
    fresh = connect(autocommit=True, sql_mode="")
    assert guard.update(fresh, token=tok(40000), key={"id": 1}, values={"v": 1}) == tok(40000)
    with pytest.raises(fenced.StaleTokenError):
        guard.update(fresh, token=tok(35000), key={"id": 1}, values={"v": 2})
    assert sql(plain, "SELECT v, Fencing_Token FROM acct") == [(1, 40000)]


def test_values_naming_a_guard_column_under_another_case_are_refused(connect: Any) -> None:
    """``values={"Fencing_Token": 1}`` reached MariaDB as a second assignment of the token
    column: a raw ``pymysql.ProgrammingError 1110``. Refused before any SQL, typed."""
    plain = connect(autocommit=True)
    sql(plain, "CREATE TABLE acct (id INT PRIMARY KEY, v INT)")
    guard = RowGuard("acct", lock="orders")
    guard.install(plain)
    for values in ({"Fencing_Token": 1}, {"ID": 3}, {"v": 1, "V": 2}):
        for upsert in (False, True):
            write = guard.insert_or_update if upsert else guard.update
            with pytest.raises(fenced.ConfigurationError, match="column"):
                write(plain, token=tok(14), key={"id": 1}, values=values)
    assert sql(plain, "SELECT * FROM acct") == []
    assert guard.insert_or_update(plain, token=tok(14), key={"id": 1}, values={"V": 7}) == tok(14)
    assert sql(plain, "SELECT v, fencing_token FROM acct") == [(7, 14)]


def test_every_mysql_error_is_typed_and_says_retry_only_when_a_retry_can_pass(
    connect: Any,
) -> None:
    """A value its column cannot hold (strict mode: 1264 out of range) and a duplicate of the
    caller's own unique key (1062) came out raw, or as "roll back and retry" (which would fail
    the same way for ever): a ConfigurationError, not retryable, nothing written."""
    plain = connect(autocommit=True)
    sql(plain, "CREATE TABLE acct (id INT PRIMARY KEY, small SMALLINT, email VARCHAR(20) UNIQUE)")
    sql(plain, "INSERT INTO acct (id, email) VALUES (1, 'a'), (2, 'b')")
    guard = RowGuard("acct", lock="orders")
    guard.install(plain)
    conn = connect()
    for values in ({"small": 99999}, {"email": "b"}):
        with pytest.raises(fenced.ConfigurationError) as info:
            guard.update(conn, token=tok(5), key={"id": 1}, values=values)
        assert not isinstance(info.value, fenced.FenceConflictError)
        assert "retry" not in str(info.value).replace("a retry would fail", "")
        assert isinstance(info.value.__cause__, pymysql.MySQLError)
    assert sql(plain, "SELECT id, small, email, fencing_token FROM acct ORDER BY id") == [
        (1, None, "a", None),
        (2, None, "b", None),
    ]
    assert guard.update(conn, token=tok(5), key={"id": 1}, values={"small": 7}) == tok(5)


def test_myisam_is_refused_at_use_not_only_by_install(connect: Any) -> None:
    """A fence table or row table made by hand as MyISAM was used as found: a refused
    transaction's writes stayed (ROLLBACK is a no-op) and two holders' transactions
    interleaved (A checks 5, B checks 7 and commits, A writes: data from 5, mark at 7).
    Refused at first use on each connection, nothing written; InnoDB accepted."""
    plain = connect(autocommit=True)
    sql(
        plain,
        "CREATE TABLE fenced_fences (resource VARCHAR(200) CHARACTER SET utf8mb4 COLLATE "
        "utf8mb4_bin NOT NULL PRIMARY KEY, lock_name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE "
        "utf8mb4_bin NOT NULL, token BIGINT NOT NULL, checks BIGINT NOT NULL DEFAULT 0) "
        "ENGINE=MyISAM",
    )
    sql(plain, "CREATE TABLE acct (id INT PRIMARY KEY, v INT, fencing_token BIGINT) ENGINE=MyISAM")
    sql(plain, "INSERT INTO acct (id, v) VALUES (1, 0)")
    conn = connect()
    with pytest.raises(fenced.ConfigurationError, match="MyISAM"):
        SQLGuard("orders").check(conn, token=tok(5))
    conn.rollback()
    rows = RowGuard("acct", lock="orders")
    for write in (rows.update, rows.insert_or_update):
        with pytest.raises(fenced.ConfigurationError, match="MyISAM"):
            write(conn, token=tok(5), key={"id": 1}, values={"v": 1})
    assert sql(plain, "SELECT COUNT(*) FROM fenced_fences") == [(0,)]
    assert sql(plain, "SELECT v, fencing_token FROM acct") == [(0, None)]
    sql(plain, "ALTER TABLE fenced_fences ENGINE=InnoDB")
    sql(plain, "ALTER TABLE acct ENGINE=InnoDB")
    fresh = connect()
    assert SQLGuard("orders").check(fresh, token=tok(5)) == tok(5)
    assert rows.update(fresh, token=tok(5), key={"id": 1}, values={"v": 1}) == tok(5)
    fresh.commit()
    with pytest.raises(fenced.StaleTokenError):
        SQLGuard("orders").check(fresh, token=tok(4))
    fresh.rollback()


@pytest.mark.parametrize("found_rows", [False, True])
def test_an_auto_increment_key_does_not_decide_the_upsert(connect: Any, found_rows: bool) -> None:
    """The upsert's verdict was read from the insert id, which MariaDB sets to the explicit
    AUTO_INCREMENT key on the insert path: ``key={"id": 2}`` read as "refused", and every try
    raised "roll back and retry" with no competitor, the row never written."""
    plain = connect(autocommit=True)
    sql(plain, "CREATE TABLE acct (id BIGINT AUTO_INCREMENT PRIMARY KEY, v INT)")
    rows = RowGuard("acct", lock="orders")
    rows.install(plain)
    conn = connect(client_flag=CLIENT.FOUND_ROWS) if found_rows else connect()
    for key in (2, 1, 3):
        assert rows.insert_or_update(conn, token=tok(10), key={"id": key}, values={"v": key})
    assert rows.insert_or_update(conn, token=tok(10), key={"id": 2}, values={"v": 2}) == tok(10)
    assert rows.insert_or_update(conn, token=tok(11), key={"id": 2}, values={"v": 22}) == tok(11)
    with pytest.raises(fenced.StaleTokenError):
        rows.insert_or_update(conn, token=tok(10), key={"id": 2}, values={"v": 99})
    assert sql(plain, "SELECT id, v, fencing_token FROM acct ORDER BY id") == [
        (1, 1, 10),
        (2, 22, 11),
        (3, 3, 10),
    ]


def test_an_upsert_needs_exactly_its_key_as_the_only_unique_key(connect: Any) -> None:
    """ON DUPLICATE KEY UPDATE acts on whichever unique key a new row collides with: with no
    unique key on the key columns it inserted a second row for a stale writer ("accepted");
    with another unique key it updated another row. Refused; an AUTO_INCREMENT surrogate key
    beside the natural one is fine."""
    plain = connect(autocommit=True)
    sql(plain, "CREATE TABLE nokey (id INT, v INT)")
    sql(plain, "CREATE TABLE twokeys (id INT PRIMARY KEY, email VARCHAR(20) UNIQUE, v INT)")
    sql(
        plain,
        "CREATE TABLE people (n BIGINT AUTO_INCREMENT PRIMARY KEY, email VARCHAR(20) UNIQUE)",
    )
    for table in ("nokey", "twokeys"):
        guard = RowGuard(table, lock="orders")
        guard.install(plain)
        with pytest.raises(fenced.ConfigurationError, match="unique key"):
            guard.insert_or_update(plain, token=tok(5), key={"id": 1}, values={"v": 1})
        assert sql(plain, f"SELECT COUNT(*) FROM {table}") == [(0,)]
    guard = RowGuard("people", key_columns="email", lock="orders")
    guard.install(plain)
    assert guard.insert_or_update(plain, token=tok(5), key={"email": "a"}) == tok(5)
    with pytest.raises(fenced.StaleTokenError):
        guard.insert_or_update(plain, token=tok(4), key={"email": "a"})
    assert sql(plain, "SELECT email, fencing_token FROM people") == [("a", 5)]


def test_asyncmy_checks_tables_and_verdicts_the_same_way(mysql_db: dict[str, Any]) -> None:
    import asyncmy

    async def go() -> None:
        conn = await asyncmy.connect(**asyncmy_args(mysql_db), autocommit=True)
        try:
            async with conn.cursor() as cur:
                await cur.execute("CREATE TABLE acct (id BIGINT AUTO_INCREMENT PRIMARY KEY, v INT)")
                await cur.execute(
                    "CREATE TABLE old (id INT PRIMARY KEY, fencing_token BIGINT) ENGINE=MyISAM"
                )
            rows = RowGuard("acct", lock="orders")
            await rows.ainstall(conn)
            assert await rows.ainsert_or_update(conn, token=tok(10), key={"id": 2}) == tok(10)
            with pytest.raises(fenced.StaleTokenError):
                await rows.ainsert_or_update(conn, token=tok(9), key={"id": 2})
            with pytest.raises(fenced.ConfigurationError, match="MyISAM"):
                await RowGuard("old", lock="orders").aupdate(conn, token=tok(1), key={"id": 1})
            with pytest.raises(fenced.ConfigurationError, match="column"):
                await rows.aupdate(conn, token=tok(10), key={"id": 2}, values={"FENCING_TOKEN": 1})
        finally:
            conn.close()

    asyncio.run(go())


def test_table_names_are_looked_up_as_the_server_compares_them(connect: Any) -> None:
    """Table names are case-sensitive on this server (lower_case_table_names=0), while
    information_schema compares them ignoring case: the look-up for ``ACCT`` must not answer
    for the MyISAM ``acct`` beside it, nor the reverse."""
    plain = connect(autocommit=True)
    if sql(plain, "SELECT @@lower_case_table_names") != [(0,)]:
        pytest.skip("table names are not case-sensitive on this server")
    sql(plain, "CREATE TABLE acct (id INT PRIMARY KEY, fencing_token BIGINT) ENGINE=MyISAM")
    sql(plain, "CREATE TABLE ACCT (id INT PRIMARY KEY, fencing_token BIGINT) ENGINE=InnoDB")
    sql(plain, "INSERT INTO acct (id) VALUES (1)")
    sql(plain, "INSERT INTO ACCT (id) VALUES (1)")
    for first in ("ACCT", "acct"):  # (both orders: the first row information_schema gives)
        conn = connect(autocommit=True)
        for name in (first, "acct" if first == "ACCT" else "ACCT"):
            guard = RowGuard(name, lock="orders")
            if name == "acct":
                with pytest.raises(fenced.ConfigurationError, match="MyISAM"):
                    guard.update(conn, token=tok(5), key={"id": 1})
            else:
                assert guard.update(conn, token=tok(5), key={"id": 1}) == tok(5)
    assert sql(plain, "SELECT fencing_token FROM acct") == [(None,)]
    assert sql(plain, "SELECT fencing_token FROM ACCT") == [(5,)]


@pytest.mark.parametrize("autocommit", [False, True])
def test_a_guarded_transaction_block_on_mysql_is_begin_and_commit(
    connect: Any, autocommit: bool
) -> None:
    """``SQLGuard.transaction`` on PyMySQL (no pipeline: today's form): the rightful token's
    block commits, a stale one's block commits nothing and leaves no transaction open."""
    guard = fence_table(connect)
    conn = connect(autocommit=autocommit)
    with guard.transaction(conn, token=tok(10)):
        sql(conn, "INSERT INTO data VALUES (1, 'ten')")
    with pytest.raises(fenced.StaleTokenError), guard.transaction(conn, token=tok(9)):
        sql(conn, "INSERT INTO data VALUES (2, 'nine')")
    assert not conn.server_status & 1  # (SERVER_STATUS_IN_TRANS)
    other = connect(autocommit=True)
    assert sql(other, "SELECT id, v FROM data") == [(1, "ten")]


# -- SQLGuard.batch: the check raises in the server, one multi-statement request -------------


def _stale_batch_is_never_committed(conn: Any, guard: SQLGuard) -> bool:
    """The rightful token's batch commits; a stale one's (two statements) commits nothing and
    raises StaleTokenError naming the mark; the connection is left with no transaction."""
    sql(conn, "CREATE TABLE IF NOT EXISTS acct (id INT PRIMARY KEY, v INT) ENGINE=InnoDB")
    sql(conn, "INSERT IGNORE INTO acct VALUES (1, 0)")
    conn.commit()
    counts = guard.batch(conn, [("UPDATE acct SET v = %s WHERE id = 1", (10,))], token=tok(10))
    assert counts == [1]
    refused = False
    try:
        guard.batch(
            conn,
            [
                ("UPDATE acct SET v = 9 WHERE id = 1", None),
                ("INSERT INTO acct VALUES (%s, 9)", (9,)),
            ],
            token=tok(9),
        )
    except fenced.StaleTokenError as exc:
        refused = exc.high_water == tok(10)
    rows = sql(conn, "SELECT id, v FROM acct ORDER BY id")
    conn.commit()
    return refused and rows == [(1, 10)] and guard.high_water(conn) == tok(10)


@pytest.mark.parametrize("flags", ["multi", "multi+found-rows", "plain"])
def test_batch_refuses_a_stale_token_and_commits_the_rightful_one(connect: Any, flags: str) -> None:
    """With CLIENT.MULTI_STATEMENTS the whole batch is one request (the check is a compound
    statement that SIGNALs); without it, begin, check, statements, commit. Both: the stale
    batch commits nothing, the rightful one everything; the same holder may write again."""
    from fenced.guards._sql_driver import batch_kind

    flag = {"multi": CLIENT.MULTI_STATEMENTS, "plain": 0}.get(
        flags, CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS
    )
    conn = connect(client_flag=flag)
    guard = SQLGuard("acct", lock="orders")
    guard.install(conn)
    assert batch_kind(conn) == ("block" if flags == "plain" else "multi")
    assert _stale_batch_is_never_committed(conn, guard)
    assert guard.batch(conn, [("UPDATE acct SET v = 11 WHERE id = 1", None)], token=tok(10)) == [1]
    assert not conn.server_status & 1  # no transaction left open
    sql(conn, "BEGIN")
    with pytest.raises(fenced.ConfigurationError, match="already open"):
        guard.batch(conn, [], token=tok(12))
    conn.rollback()


def test_batch_reports_what_the_server_refused_on(connect: Any) -> None:
    """Another lock's row is WrongLockError, a zero mark CorruptMarkError, nothing written;
    a new resource passes; a failing statement of the batch rolls back the check too."""
    conn = connect(client_flag=CLIENT.MULTI_STATEMENTS, autocommit=False)
    guard = SQLGuard("acct", lock="orders")
    guard.install(conn)
    sql(conn, "CREATE TABLE acct (id INT PRIMARY KEY, v INT) ENGINE=InnoDB")
    sql(conn, "ALTER TABLE fenced_fences DROP CONSTRAINT fenced_token_positive")  # (a hand edit)
    sql(conn, "INSERT INTO fenced_fences (resource, lock_name, token) VALUES "
              "('acct', 'someone-else', 5), ('zero', 'orders', 0)")  # fmt: skip
    conn.commit()
    with pytest.raises(fenced.WrongLockError):
        guard.batch(conn, [("INSERT INTO acct VALUES (1, 7)", None)], token=tok(7))
    with pytest.raises(fenced.CorruptMarkError):
        SQLGuard("zero", lock="orders").batch(
            conn, [("INSERT INTO acct VALUES (2, 7)", None)], token=tok(7)
        )
    with pytest.raises(pymysql.err.IntegrityError):  # the batch's own error: nothing kept
        SQLGuard("new", lock="orders").batch(
            conn, [("INSERT INTO acct VALUES (3, 7)", None)] * 2, token=tok(7)
        )
    assert sql(conn, "SELECT * FROM acct") == []
    assert SQLGuard("new", lock="orders").high_water(conn) is None
    SQLGuard("new", lock="orders").batch(
        conn, [("INSERT INTO acct VALUES (3, 7)", None)], token=tok(7)
    )
    assert sql(conn, "SELECT * FROM acct") == [(3, 7)]
    conn.commit()


def test_a_batch_check_that_does_not_raise_is_caught(
    connect: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted: the compound check never SIGNALs. Nothing in the request waits for its
    verdict, so the stale batch commits: the checker above catches it."""
    from fenced.guards import _sql_driver, _sql_plan

    for name in ("mariadb_batch_check", "mariadb_batch_recheck"):  # (the re-check too)
        real = getattr(_sql_plan, name)
        monkeypatch.setattr(
            _sql_driver, name,
            lambda table, real=real: real(table).replace("SIGNAL SQLSTATE", "DO 0; -- SIGNAL SQLSTATE")
            .replace("SET MESSAGE_TEXT = 'fenced: the fence refused the token'; ", "\n"),
        )  # fmt: skip
    conn = connect(client_flag=CLIENT.MULTI_STATEMENTS)
    guard = SQLGuard("acct", lock="orders")
    guard.install(conn)
    assert not _stale_batch_is_never_committed(conn, guard)


# -- SQLGuard.batch: the caller's statements as they come (attack session) -------------------


def _batch_conn(connect: Any, flags: str) -> tuple[Any, SQLGuard]:
    conn = connect(client_flag=CLIENT.MULTI_STATEMENTS if flags == "multi" else 0)
    guard = SQLGuard("acct", lock="orders")
    guard.install(conn)
    sql(conn, "CREATE TABLE acct (id INT PRIMARY KEY, v TEXT) ENGINE=InnoDB")
    sql(conn, "INSERT INTO acct VALUES (1, 'init')")
    conn.commit()
    return conn, guard


@pytest.mark.parametrize("flags", ["multi", "plain"])
def test_batch_statements_ending_in_a_comment_or_a_semicolon_are_all_committed(
    connect: Any, flags: str
) -> None:
    """The guard joins the statements into one request: a statement's trailing ``-- `` or
    ``#`` comment swallowed the rest and the COMMIT (counts returned, nothing committed, the
    fence row left X-locked), a trailing ``;`` was a syntax error. Each is one statement."""
    conn, guard = _batch_conn(connect, flags)
    counts = guard.batch(
        conn,
        [
            ("INSERT INTO acct VALUES (2, %s) -- the second", ("b",)),
            ("INSERT INTO acct VALUES (3, 'c') # the third", None),
            ("INSERT INTO acct VALUES (4, 'd');  ", None),
            ("UPDATE acct SET v = 'e' WHERE id > 1 /* all */", None),
        ],
        token=tok(5),
    )
    assert counts == [1, 1, 1, 3]
    assert not conn.server_status & 1  # no transaction (nor the fence row's lock) left open
    other = connect(autocommit=True)
    assert sql(other, "SELECT id, v FROM acct ORDER BY id") == [
        (1, "init"), (2, "e"), (3, "e"), (4, "e")
    ]  # fmt: skip
    assert guard.high_water(other) == tok(5)


@pytest.mark.parametrize("mode", ["", "NO_BACKSLASH_ESCAPES", "ANSI_QUOTES"])
def test_batch_params_are_values_whatever_the_sql_mode(connect: Any, mode: str) -> None:
    """The parameters are rendered client-side into one request: quotes, backslashes and
    statement separators in a value stay in the value under every quoting mode."""
    conn, guard = _batch_conn(connect, "multi")
    sql(conn, f"SET SESSION sql_mode = '{mode}'")
    evil = ["x'; COMMIT; --", "x\\'; DELETE FROM acct; -- ", '\\"); DROP TABLE acct; #', "\\"]
    statements = [("INSERT INTO acct VALUES (%s, %s)", (10 + i, v)) for i, v in enumerate(evil)]
    assert guard.batch(conn, statements, token=tok(5)) == [1] * len(evil)
    rows = sql(connect(autocommit=True), "SELECT v FROM acct WHERE id >= 10 ORDER BY id")
    assert [r[0] for r in rows] == evil


def test_a_batch_statement_holding_two_is_reported(connect: Any) -> None:
    """One request answers each statement: a "statement" that held two shifted every row
    count by one, silently. Now a ConfigurationError that says what was committed."""
    conn, guard = _batch_conn(connect, "multi")
    with pytest.raises(fenced.ConfigurationError, match="2 results"):
        guard.batch(
            conn,
            [("INSERT INTO acct VALUES (2, 'b'); INSERT INTO acct VALUES (3, 'c')", None)],
            token=tok(5),
        )
    assert not conn.server_status & 1


@pytest.mark.parametrize("flags", ["multi", "plain"])
def test_a_batch_statement_that_commits_lets_no_stale_write_in(connect: Any, flags: str) -> None:
    """The old holder's batch COMMITs in the middle (a COMMIT, or DDL's implicit commit):
    the fence row's lock is released, the new holder (token 6) fences and writes, then the
    old batch's later statements ran in a new transaction and committed over it: a stale
    write. Now the later statements are refused (the multi-statement request re-checks the
    fence before its COMMIT; the block stops at the statement that ended the transaction);
    the rightful holder's batch commits."""
    conn, guard = _batch_conn(connect, flags)
    gate = connect(autocommit=True)
    sql(gate, "SELECT GET_LOCK('gate', 30)")
    outcome: list[object] = []

    def old_holder() -> None:
        try:
            guard.batch(
                conn,
                [
                    ("UPDATE acct SET v = 'old-1' WHERE id = 1", None),
                    ("COMMIT", None),
                    ("DO GET_LOCK('gate', 30)", None),  # (paused here, as by a GC pause)
                    ("UPDATE acct SET v = 'old-2' WHERE id = 1", None),
                ],
                token=tok(5),
            )
            outcome.append("committed")
        except fenced.FencedError as exc:
            outcome.append(exc)

    watch = connect(autocommit=True)
    thread = threading.Thread(target=old_holder)
    thread.start()
    wait_for(
        lambda: outcome
        or sql(watch, "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                      "WHERE STATE = 'User lock' AND ID <> CONNECTION_ID()")[0][0],
        what="the old holder at its pause",
    )  # fmt: skip
    new = connect(client_flag=CLIENT.MULTI_STATEMENTS)
    assert guard.batch(new, [("UPDATE acct SET v = 'new' WHERE id = 1", None)], token=tok(6)) == [1]
    sql(gate, "DO RELEASE_LOCK('gate')")
    thread.join(30)
    assert sql(watch, "SELECT v FROM acct") == [("new",)]
    assert guard.high_water(watch) == tok(6)
    # (never StaleTokenError: the COMMIT wrote the check and 'old-1')
    assert isinstance(outcome[0], fenced.ConfigurationError), outcome
    assert not conn.server_status & 1
    # the rightful holder: its batch (no COMMIT in it) commits
    assert guard.batch(conn, [("UPDATE acct SET v = 'six' WHERE id = 1", None)], token=tok(6)) == [
        1
    ]
    assert sql(watch, "SELECT v FROM acct") == [("six",)]


@pytest.mark.parametrize("mode", ["ORACLE", "TRADITIONAL", "ANSI,NO_BACKSLASH_ESCAPES"])
def test_batch_under_every_sql_mode_takes_the_holder_and_refuses_the_stale(
    connect: Any, mode: str
) -> None:
    """sql_mode=ORACLE parses no ``BEGIN NOT ATOMIC``: the one-request check was a syntax
    error (ProgrammingError 1064) for the rightful holder too. Now the block form then; the
    stale token refused either way, nothing of it written."""
    conn, guard = _batch_conn(connect, "multi")
    sql(conn, f"SET SESSION sql_mode = '{mode}'")
    assert guard.batch(conn, [("UPDATE acct SET v = 'five' WHERE id = 1", None)], token=tok(5)) == [
        1
    ]
    with pytest.raises(fenced.StaleTokenError):
        guard.batch(conn, [("UPDATE acct SET v = 'four' WHERE id = 1", None)], token=tok(4))
    assert not conn.server_status & 1
    other = connect(autocommit=True)
    assert sql(other, "SELECT v FROM acct") == [("five",)]
    assert guard.high_water(other) == tok(5)


def _batch_with_a_newer_holder_in_its_pause(
    connect: Any, conn: Any, guard: SQLGuard, before: list[str], after: tuple[str, ...] = ()
) -> object:
    """The old holder's (token 5) one-request batch: ``before``, a pause (a user lock the
    test holds), then its stale UPDATE; during the pause the newer holder (token 6, another
    connection) fences and writes 'new'. Returns the old batch's outcome."""
    gate = connect(autocommit=True)
    sql(gate, "SELECT GET_LOCK('gate', 30)")
    outcome: list[object] = []

    def old_holder() -> None:
        try:
            guard.batch(
                conn,
                [
                    *((s, None) for s in before),
                    ("DO GET_LOCK('gate', 30)", None),  # (paused here, as by a GC pause)
                    ("UPDATE acct SET v = 'old' WHERE id = 1", None),
                    *((s, None) for s in after),
                ],
                token=tok(5),
            )
            outcome.append("committed")
        except fenced.FencedError as exc:
            outcome.append(exc)

    watch = connect(autocommit=True)
    thread = threading.Thread(target=old_holder)
    thread.start()
    wait_for(
        lambda: outcome
        or sql(watch, "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                      "WHERE STATE = 'User lock' AND ID <> CONNECTION_ID()")[0][0],
        what="the old holder at its pause",
    )  # fmt: skip
    new = connect()
    with guard.transaction(new, token=tok(6)):
        sql(new, "UPDATE acct SET v = 'new' WHERE id = 1")
    sql(gate, "DO RELEASE_LOCK('gate')")
    thread.join(30)
    assert not thread.is_alive()
    return outcome[0]


def test_a_batch_that_turns_autocommit_on_is_told_as_it_ran_never_as_refused(
    connect: Any,
) -> None:
    """The one-request batch turns autocommit on (``SET autocommit = 1``): its later UPDATE
    commits as it runs, over the newer holder's write. The re-check then found the mark
    moved and raised StaleTokenError, which tells the caller nothing was written, and left
    autocommit on. Now the re-check sees autocommit on: a ConfigurationError says the later
    statements committed as they ran, over the newer holder's writes (as they did), and the
    connection's autocommit is as it was found; with nobody newer, the same error (the
    batch returned its counts, as if fenced)."""
    autocommit = False
    conn, guard = _batch_conn(connect, "multi")
    outcome = _batch_with_a_newer_holder_in_its_pause(connect, conn, guard, ["SET autocommit = 1"])
    assert isinstance(outcome, fenced.ConfigurationError), outcome
    assert "committed as it ran, unfenced" in str(outcome)
    assert "over the newer holder's writes" in str(outcome)
    assert bool(conn.get_autocommit()) is autocommit
    watch = connect(autocommit=True)
    assert sql(watch, "SELECT v FROM acct") == [("old",)]  # (as told)
    assert guard.high_water(watch) == tok(6)
    # nobody newer: told all the same, autocommit as found
    statements = [("SET autocommit = 1", None), ("UPDATE acct SET v = 'x' WHERE id = 1", None)]
    with pytest.raises(fenced.ConfigurationError, match="committed as it ran"):
        guard.batch(conn, statements, token=tok(7))
    assert bool(conn.get_autocommit()) is autocommit
    # and the rightful holder's next batch commits, fenced
    assert guard.batch(conn, [("UPDATE acct SET v = 'y' WHERE id = 1", None)], token=tok(7)) == [1]
    assert sql(watch, "SELECT v FROM acct") == [("y",)]
    assert bool(conn.get_autocommit()) is autocommit


def test_a_batch_that_turns_autocommit_on_and_off_again_is_told_never_refused(
    connect: Any,
) -> None:
    """``[SET autocommit = 1, (a newer holder writes), UPDATE, SET autocommit = 0]``: the
    UPDATE commits as it runs, over the newer write; the re-check, which looked only at
    @@autocommit (off again), then found the mark moved: StaleTokenError, which tells the
    caller nothing was written. Now the check sets a savepoint (the witness) that any end
    of its transaction drops, and the re-check's RELEASE of it fails: a ConfigurationError
    (the end may have written), autocommit as found; the rightful holder's batch commits."""
    conn, guard = _batch_conn(connect, "multi")
    outcome = _batch_with_a_newer_holder_in_its_pause(
        connect, conn, guard, ["SET autocommit = 1"], ("SET autocommit = 0",)
    )
    assert isinstance(outcome, fenced.ConfigurationError), outcome
    assert "ended the transaction" in str(outcome)
    assert "over the newer holder's writes" in str(outcome)
    assert not conn.get_autocommit()
    assert not conn.server_status & 1
    watch = connect(autocommit=True)
    assert sql(watch, "SELECT v FROM acct") == [("old",)]  # (as told)
    assert guard.high_water(watch) == tok(6)
    assert guard.batch(conn, [("UPDATE acct SET v = 'y' WHERE id = 1", None)], token=tok(6)) == [1]
    assert sql(watch, "SELECT v FROM acct") == [("y",)]


@pytest.mark.parametrize("end", ["COMMIT", "START TRANSACTION", "CREATE TABLE other (id INT)"])
def test_a_batch_that_ends_its_transaction_with_nobody_newer_is_told_never_returned(
    connect: Any, end: str
) -> None:
    """``[UPDATE, COMMIT | START TRANSACTION | DDL, UPDATE]`` with nobody newer: the end
    committed the check and the first UPDATE, the second ran in a new transaction, and the
    re-check (the fence row still at this token) passed: counts returned, as if fenced.
    Now the re-check's RELEASE of the witness savepoint fails: a ConfigurationError, the
    second UPDATE rolled back; the next batch commits."""
    conn, guard = _batch_conn(connect, "multi")
    statements: list[tuple[str, None]] = [
        ("UPDATE acct SET v = 'a' WHERE id = 1", None),
        (end, None),
        ("UPDATE acct SET v = 'b' WHERE id = 1", None),
    ]
    with pytest.raises(fenced.ConfigurationError, match="ended the transaction"):
        guard.batch(conn, statements, token=tok(5))
    assert not conn.server_status & 1
    watch = connect(autocommit=True)
    assert sql(watch, "SELECT v FROM acct") == [("a",)]
    assert guard.batch(conn, [("UPDATE acct SET v = 'c' WHERE id = 1", None)], token=tok(5)) == [1]
    assert sql(watch, "SELECT v FROM acct") == [("c",)]


def test_a_batch_that_locks_tables_is_told_and_leaves_no_table_locked(connect: Any) -> None:
    """``LOCK TABLES acct WRITE`` among the statements commits the check and the UPDATE
    before it implicitly, then the re-check cannot read the fence table (1100): surfaced as
    a bare OperationalError, and the WRITE lock outlived the guard's rollback (everyone else
    timed out, 1205). Now a ConfigurationError (the witness gone, or the 1100 told as LOCK
    TABLES), the tables unlocked: the next batch on the connection, and others, run."""
    conn, guard = _batch_conn(connect, "multi")
    statements: list[tuple[str, None]] = [
        ("UPDATE acct SET v = 'a' WHERE id = 1", None),
        ("LOCK TABLES acct WRITE", None),
        ("UPDATE acct SET v = 'b' WHERE id = 1", None),
    ]
    with pytest.raises(fenced.ConfigurationError, match="ended the transaction"):
        guard.batch(conn, statements, token=tok(5))
    watch = connect(autocommit=True)
    sql(watch, "SET SESSION lock_wait_timeout = 2")
    assert sql(watch, "SELECT v FROM acct") == [("a",)]  # (not locked out)
    assert guard.batch(conn, [("UPDATE acct SET v = 'c' WHERE id = 1", None)], token=tok(5)) == [1]
    assert sql(watch, "SELECT v FROM acct") == [("c",)]


def test_a_batch_whose_connection_is_lost_after_the_request_went_out_is_told_unknown(
    connect: Any,
) -> None:
    """The one request holds the COMMIT: a read timeout (the connection dropped) while the
    server runs it was a plain BackendUnavailable ("Lost connection"), and the server ran it
    to COMMIT; a retry with the same token applied it twice. Now the error says the outcome
    is unknown (read back first) — and the write did commit, as it may."""
    _, guard = _batch_conn(connect, "multi")
    conn = connect(client_flag=CLIENT.MULTI_STATEMENTS, read_timeout=0.3)
    statements: list[tuple[str, None]] = [
        ("DO SLEEP(1)", None),
        ("UPDATE acct SET v = 'done' WHERE id = 1", None),
    ]
    with pytest.raises(fenced.BackendUnavailable, match="the outcome is unknown"):
        guard.batch(conn, statements, token=tok(5))
    watch = connect(autocommit=True)
    wait_for(lambda: sql(watch, "SELECT v FROM acct") == [("done",)], 20, "the server's COMMIT")
    assert guard.high_water(watch) == tok(5)


def test_a_batch_on_an_autocommit_connection_that_commits_lets_no_stale_write_in(
    connect: Any,
) -> None:
    """In autocommit, the one-request batch's statements after its own COMMIT committed as
    they ran (over the newer holder's write), and the re-check's StaleTokenError said
    nothing was written. Now the request runs with autocommit off (set in it, and back on
    after): the statements after the COMMIT open a transaction the re-check refuses, rolled
    back; the newer write stays."""
    conn, guard = _batch_conn(connect, "multi")
    conn.autocommit(True)
    outcome = _batch_with_a_newer_holder_in_its_pause(connect, conn, guard, ["COMMIT"])
    # (told, never StaleTokenError: the COMMIT wrote the check; what followed is refused)
    assert isinstance(outcome, fenced.ConfigurationError), outcome
    assert "inv" not in str(outcome) and "orders:6 was accepted since" in str(outcome)
    assert "stays committed, unfenced" in str(outcome)  # (what committed as it ran: none)
    watch = connect(autocommit=True)
    assert sql(watch, "SELECT v FROM acct") == [("new",)]
    assert conn.get_autocommit()
    assert not conn.server_status & 1
    assert guard.batch(conn, [("UPDATE acct SET v = 'six' WHERE id = 1", None)], token=tok(6)) == [
        1
    ]
    assert conn.get_autocommit()
    assert sql(watch, "SELECT v FROM acct") == [("six",)]


def test_an_asyncmy_transaction_cancelled_mid_statement_leaves_a_closed_connection_told_so(
    connect: Any, mysql_db: dict[str, Any]
) -> None:
    """A statement of an ``atransaction()`` block is cancelled (a timeout) while the server
    runs it: asyncmy closes the connection. The next ``atransaction()`` on it said "already
    open" (the server status asyncmy last read); now BackendUnavailable, saying it is
    closed. The cancelled transaction committed nothing."""
    import asyncmy

    guard = fence_table(connect)
    gate = connect(autocommit=True)
    sql(gate, "SELECT GET_LOCK('gate', 30)")
    watch = connect(autocommit=True)

    async def main() -> None:
        conn = await asyncmy.connect(**asyncmy_args(mysql_db))

        async def block() -> None:
            async with guard.atransaction(conn, token=tok(5)), conn.cursor() as cur:
                await cur.execute("INSERT INTO data VALUES (1, 'five')")
                await cur.execute("DO GET_LOCK('gate', 30)")  # (held by the test)

        task = asyncio.ensure_future(block())
        deadline = time.monotonic() + 20
        while not sql(watch, "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                             "WHERE STATE = 'User lock'")[0][0]:  # fmt: skip
            assert time.monotonic() < deadline and not task.done(), "the block never waited"
            await asyncio.sleep(0.01)  # (lets the block's task run: polling, not a wait)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(fenced.BackendUnavailable, match="closed"):
            async with guard.atransaction(conn, token=tok(6)):
                pass
        conn.close()

    try:
        asyncio.run(main())
    finally:
        sql(gate, "DO RELEASE_LOCK('gate')")
    assert sql(watch, "SELECT COUNT(*) FROM data") == [(0,)]
