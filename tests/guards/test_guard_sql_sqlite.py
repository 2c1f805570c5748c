"""SQLGuard on SQLite since session 8: the fence's UPDATE accepts in place (its row count the
verdict), the RETURNING upsert only for a first row or a refusal; ``transaction()`` on a
plain ``sqlite3.Connection`` reuses the token it coerced last.

The UPDATE must accept exactly where the upsert accepts with an integer back, and nowhere
else: every mark shape below is run through the guard and through the upsert alone (the
session-7 form), by ``check()`` and by ``transaction()``, and must end the same way with the
same rows. Planted UPDATEs (no ``typeof``, no ``<=``) are caught by the same comparison.
"""

from __future__ import annotations

import dataclasses
import itertools
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from fenced import (
    ConfigurationError,
    CorruptMarkError,
    FencingToken,
    HmacKey,
    Keyring,
    SignatureError,
    StaleTokenError,
    WrongLockError,
)
from fenced.guards._sql_plan import SQLITE, Dialect, FenceSQL, fence_sql
from fenced.guards.sql import SQLGuard

LOCK = "invoices"


def tok(value: int, lock: str = LOCK) -> FencingToken:
    return FencingToken(lock, value)


def planted(update: str) -> type[SQLGuard]:
    """A guard whose accepting UPDATE is ``update`` (a planted bug, or the reference)."""

    class Planted(SQLGuard):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._sqlite_sql = dataclasses.replace(self._sqlite_sql, update=update)

        def _fence_sql(self, d: Dialect) -> FenceSQL:
            return dataclasses.replace(super()._fence_sql(d), update=update)

    return Planted


UPDATE = fence_sql(SQLITE, '"fenced_fences"').update
# The session-7 guard: an UPDATE that never changes a row, so the RETURNING upsert and its
# verdict decide every check (the reference the UPDATE is held to)
UpsertOnlyGuard = planted(UPDATE.replace("WHERE resource", "WHERE 0 AND resource"))
NO_TYPEOF = UPDATE.replace("typeof(token) = 'integer' AND ", "")
NO_ORDER = UPDATE.replace("AND token <= ?3 ", "")

# (column declaration, stored mark): the guard's own table, and tables it did not make
SHAPES = [
    ("INTEGER NOT NULL CHECK (token > 0)", 10),  # install()'s
    ("BIGINT", 10),
    ("NUMERIC", 10),
    ("", 10),  # no type: any value as given
    ("", "10"),  # an exact integer's text, untyped: the upsert takes it
    ("TEXT", "10"),  # compared as text ('9' > '10'): refused at use
    ("REAL", 10),  # 10.0: no exact tokens above 2**53
    ("", 5.5),
    ("", None),
    ("", 0),
    ("", -3),
    ("BIGINT", 2**63 - 1),
]
TOKENS = [9, 10, 11, 2**63 - 1]
_DB = itertools.count()


def _outcome(
    tmp_path: Path, guard_class: type[SQLGuard], column: str, mark: object, value: int, how: str
) -> tuple[str, list[tuple[Any, ...]]]:
    """What guarding one write with ``value`` over ``mark`` ends in: the error (or "ok") and
    the rows of both tables."""
    path = tmp_path / f"{next(_DB)}.db"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v)")
        conn.execute("INSERT INTO acct VALUES (1, 0)")
        conn.execute(
            "CREATE TABLE fenced_fences (resource TEXT PRIMARY KEY, lock_name TEXT NOT NULL, "
            f"token {column}) WITHOUT ROWID"
        )
        conn.execute("INSERT INTO fenced_fences VALUES ('acct', ?, ?)", (LOCK, mark))
        guard = guard_class("acct", lock=LOCK)
        result = "ok"
        try:
            if how == "transaction":
                with guard.transaction(conn, token=tok(value)):
                    conn.execute("UPDATE acct SET v = ?", (value,))
            else:
                conn.execute("BEGIN IMMEDIATE")
                guard.check(conn, token=tok(value))
                conn.execute("UPDATE acct SET v = ?", (value,))
                conn.execute("COMMIT")
        except Exception as exc:
            result = type(exc).__name__
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        rows = conn.execute("SELECT lock_name, token, typeof(token) FROM fenced_fences").fetchall()
        rows += conn.execute("SELECT v FROM acct").fetchall()
        return result, rows
    finally:
        conn.close()


@pytest.mark.parametrize("how", ["transaction", "check"])
@pytest.mark.parametrize(("column", "mark"), SHAPES)
def test_the_update_accepts_exactly_where_the_upsert_does(
    tmp_path: Path, column: str, mark: object, how: str
) -> None:
    for value in TOKENS:
        expected = _outcome(tmp_path, UpsertOnlyGuard, column, mark, value, how)
        assert _outcome(tmp_path, SQLGuard, column, mark, value, how) == expected, value


@pytest.mark.parametrize(
    ("update", "column", "mark", "value"),
    [(NO_TYPEOF, "TEXT", "10", 9), (NO_ORDER, "BIGINT", 10, 9), (NO_TYPEOF, "", 5.5, 9)],
    ids=["no-typeof-text", "no-order", "no-typeof-real"],
)
@pytest.mark.parametrize("how", ["transaction", "check"])
def test_a_planted_update_is_told_from_the_upsert(
    tmp_path: Path, update: str, column: str, mark: object, value: int, how: str
) -> None:
    """The comparison above catches an UPDATE that accepts where the upsert refuses."""
    assert update != UPDATE
    expected = _outcome(tmp_path, UpsertOnlyGuard, column, mark, value, how)
    assert expected[0] != "ok"  # (the upsert refuses it)
    assert _outcome(tmp_path, planted(update), column, mark, value, how) != expected


def test_a_first_row_and_a_refusal_go_through_the_upsert(tmp_path: Path) -> None:
    """No row yet: the UPDATE changes nothing and the upsert inserts it; a refusal: the
    upsert's verdict says why (the stale block commits nothing, its mark stays)."""
    conn = sqlite3.connect(tmp_path / "t.db", isolation_level=None)
    conn.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v)")
    conn.execute("INSERT INTO acct VALUES (1, 0)")
    guard = SQLGuard("acct", lock=LOCK)
    guard.install(conn)
    with guard.transaction(conn, token=tok(7)):
        conn.execute("UPDATE acct SET v = 7")
    assert conn.execute("SELECT * FROM fenced_fences").fetchall() == [("acct", LOCK, 7)]
    with pytest.raises(StaleTokenError) as stale, guard.transaction(conn, token=tok(6)):
        conn.execute("UPDATE acct SET v = 6")
    assert stale.value.high_water == tok(7)
    with pytest.raises(WrongLockError), guard.transaction(conn, token=tok(8, "other")):
        pass
    assert conn.execute("SELECT v FROM acct").fetchall() == [(7,)] and not conn.in_transaction
    conn.close()


def test_transaction_reuses_a_coerced_token_only_while_what_it_was_checked_against_holds(
    tmp_path: Path,
) -> None:
    """``transaction()`` skips coercing the token object it coerced last, and only that:
    a verifier assigned since, another lock or resource, a new object: checked anew."""
    conn = sqlite3.connect(tmp_path / "t.db", isolation_level=None)
    conn.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v)")
    conn.execute("INSERT INTO acct VALUES (1, 0)")
    guard = SQLGuard("acct", lock=LOCK)
    guard.install(conn)
    held = tok(5)
    for v in (1, 2):  # the same object twice: the second from the cache
        with guard.transaction(conn, token=held):
            conn.execute("UPDATE acct SET v = ?", (v,))
    # a verifier assigned afterwards: the same (unsigned) object is refused, nothing written
    guard.verifier = Keyring([HmacKey("k1", b"q" * 32)])
    with pytest.raises(SignatureError), guard.transaction(conn, token=held):
        conn.execute("UPDATE acct SET v = 3")
    guard.verifier = None
    # another lock: the same object is of the wrong lock now
    guard.lock = "other"
    with pytest.raises(WrongLockError), guard.transaction(conn, token=held):
        conn.execute("UPDATE acct SET v = 4")
    guard.lock = LOCK
    # another resource: its own fence row (a first one: inserted, not the cached row's)
    guard.resource = "acct-2"
    with guard.transaction(conn, token=held):
        pass
    guard.resource = "acct"
    # a text token, twice (its parse is reused): stale both times
    text = f"{LOCK}:4"
    for _ in range(2):
        with pytest.raises(StaleTokenError), guard.transaction(conn, token=text):
            conn.execute("UPDATE acct SET v = 5")
    assert conn.execute("SELECT v FROM acct").fetchall() == [(2,)]
    assert sorted(conn.execute("SELECT * FROM fenced_fences").fetchall()) == [
        ("acct", LOCK, 5),
        ("acct-2", LOCK, 5),
    ]
    conn.close()


# install()'s statement for SQLite up to and including session 8 (the same since the guard was
# written): a database it made is used as it is; a change here needs a migration and a test.
OLD_CREATE = (
    'CREATE TABLE IF NOT EXISTS "fenced_fences" (resource TEXT PRIMARY KEY, lock_name TEXT '
    "NOT NULL, token INTEGER NOT NULL CHECK (token > 0)) WITHOUT ROWID"
)


def test_a_database_installed_by_an_older_version_is_used_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    old = sqlite3.connect(path, isolation_level=None)
    old.execute(OLD_CREATE)
    old.execute("INSERT INTO fenced_fences VALUES ('acct', ?, 10)", (LOCK,))
    old.execute("CREATE TABLE acct (id INTEGER PRIMARY KEY, v)")
    old.execute("INSERT INTO acct VALUES (1, 0)")
    old.close()
    assert fence_sql(SQLITE, '"fenced_fences"').create == OLD_CREATE
    conn = sqlite3.connect(path, isolation_level=None)
    guard = SQLGuard("acct", lock=LOCK)
    guard.install(conn)  # (idempotent: nothing to migrate)
    with pytest.raises(StaleTokenError), guard.transaction(conn, token=tok(9)):
        conn.execute("UPDATE acct SET v = 9")
    with guard.transaction(conn, token=tok(10)):
        conn.execute("UPDATE acct SET v = 10")
    conn.execute("UPDATE fenced_fences SET token = 10.5")  # (a hand edit: fail closed)
    with pytest.raises(CorruptMarkError), guard.transaction(conn, token=tok(11)):
        conn.execute("UPDATE acct SET v = 11")
    assert conn.execute("SELECT v FROM acct").fetchall() == [(10,)]
    conn.close()


@pytest.mark.parametrize("level", ["", None])
def test_a_commit_refused_by_a_reader_rolls_back_and_says_so(tmp_path: Path, level: Any) -> None:
    """Rollback-journal mode: a reader holds SHARED while the holder's block ends, so the
    guard's COMMIT fails (SQLITE_BUSY). SQLite leaves the transaction open: it was left so,
    the fence and the block's write pending under the write lock (the next holder refused,
    a retry "already open", a later unrelated commit() committing the old block), and the
    error blamed a writer. Now the block is rolled back, as a failed block is, and the
    error says the COMMIT failed and nothing of it committed; the next holder commits."""
    from fenced import FenceConflictError

    path = tmp_path / "journal.db"
    setup = sqlite3.connect(path, isolation_level=None)
    setup.execute("CREATE TABLE t (v TEXT)")
    SQLGuard(LOCK).install(setup)
    setup.close()
    guard = SQLGuard(LOCK)
    db = sqlite3.connect(path, timeout=0.05, isolation_level=level)
    reader = sqlite3.connect(path, isolation_level=None)
    try:
        with pytest.raises(FenceConflictError) as caught, guard.transaction(db, token=tok(5)):
            db.execute("INSERT INTO t VALUES ('five')")
            reader.execute("BEGIN")
            reader.execute("SELECT * FROM t").fetchall()  # (SHARED, held to its ROLLBACK)
        assert "the COMMIT failed" in str(caught.value)
        assert "nothing of it committed" in str(caught.value)
        assert not db.in_transaction
        assert db.isolation_level == level
        reader.execute("ROLLBACK")
        db.commit()  # (an unrelated commit later commits nothing of the old block)
        other = sqlite3.connect(path, timeout=5)
        with guard.transaction(other, token=tok(6)):
            other.execute("INSERT INTO t VALUES ('six')")
        other.close()
        assert reader.execute("SELECT v FROM t").fetchall() == [("six",)]
        assert guard.high_water(reader) == tok(6)
        with pytest.raises(StaleTokenError), guard.transaction(db, token=tok(5)):
            db.execute("INSERT INTO t VALUES ('five again')")
    finally:
        db.close()
        reader.close()


@pytest.mark.parametrize("isolation", ["", None])
@pytest.mark.parametrize(
    ("end", "said", "a"),
    [
        ("COMMIT", "committed or rolled back, depending on how it ended", 1),
        ("ROLLBACK", "what ran before the end was rolled back, the fence with it", 0),
    ],
)
def test_a_block_batch_that_ends_its_transaction_never_tells_a_commit_as_rolled_back(
    tmp_path: Path, isolation: str | None, end: str, said: str, a: int
) -> None:
    """``[UPDATE a, COMMIT, UPDATE b]`` on sqlite3 ended with "the open transaction is
    rolled back" while 'a' and the fence had committed. Now what ran before the end is told
    from the fence row: rolled back when it is gone (a ROLLBACK), else "committed or rolled
    back" (the row at the token cannot tell); 'b' never runs. The next batch commits."""
    path = tmp_path / "batch.db"
    conn = sqlite3.connect(path, isolation_level=isolation)
    try:
        guard = SQLGuard("inv")
        guard.install(conn)
        conn.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v INT)")
        conn.execute("INSERT INTO t VALUES ('a', 0), ('b', 0)")
        conn.commit()
        statements = [
            ("UPDATE t SET v = 1 WHERE k = 'a'", ()),
            (end, ()),
            ("UPDATE t SET v = 1 WHERE k = 'b'", ()),
        ]
        with pytest.raises(ConfigurationError, match="statement 2 ended the transaction") as caught:
            guard.batch(conn, statements, token="inv:1")
        assert said in str(caught.value)
        assert "the open transaction is rolled back" not in str(caught.value)
        assert conn.execute("SELECT k, v FROM t ORDER BY k").fetchall() == [("a", a), ("b", 0)]
        assert guard.batch(conn, [("UPDATE t SET v = 2 WHERE k = 'b'", ())], token="inv:1") == [1]
        assert conn.execute("SELECT v FROM t WHERE k = 'b'").fetchone() == (2,)
    finally:
        conn.close()


def test_query_only_left_on_by_a_batch_is_named_by_the_next_call(tmp_path: Path) -> None:
    """A batch that sets ``PRAGMA query_only = 1`` leaves it on for the connection: the next
    guarded call failed with a bare "attempt to write a readonly database". Now a one-line
    ConfigurationError naming the cause; set off, the next batch commits."""
    conn = sqlite3.connect(tmp_path / "qo.db")
    try:
        guard = SQLGuard("inv")
        guard.install(conn)
        conn.execute("CREATE TABLE t (k TEXT PRIMARY KEY, v INT)")
        conn.execute("INSERT INTO t VALUES ('a', 0)")
        conn.commit()
        guard.batch(conn, [("PRAGMA query_only = 1", ())], token="inv:1")
        with pytest.raises(ConfigurationError, match="PRAGMA query_only is on"):
            guard.batch(conn, [("UPDATE t SET v = 1", ())], token="inv:1")
        conn.rollback()
        conn.execute("PRAGMA query_only = 0")
        assert guard.batch(conn, [("UPDATE t SET v = 1", ())], token="inv:1") == [1]
    finally:
        conn.close()
