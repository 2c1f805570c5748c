"""``pg_dsn`` (tests/conftest.py) hands tests an earlier test's database, emptied: what a test
left there (tables, schemas, sequences, sessions holding locks) must be gone, or the database
dropped instead, so that each test still starts as on a new database."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from fenced.testing.servers import PostgresServer
from tests.conftest import _pg_empty_again
from tests.helpers import unique_name


def _new_db(server: PostgresServer) -> tuple[str, str]:
    db = unique_name("db").replace("-", "_")
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {db}")
    return db, f"postgresql://postgres@127.0.0.1:{server.port}/{db}"


def _objects(url: str) -> list[tuple[str, str]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n"
            " ON c.relnamespace = n.oid WHERE n.nspname NOT LIKE 'pg\\_%'"
            " AND n.nspname <> 'information_schema' ORDER BY 1, 2"
        ).fetchall()
        schemas = conn.execute(
            "SELECT nspname, '' FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%'"
            " AND nspname <> 'information_schema' ORDER BY 1"
        ).fetchall()
    return [(str(a), str(b)) for a, b in rows + schemas]


def test_a_used_database_is_emptied_for_the_next_test(pg_server: PostgresServer) -> None:
    db, url = _new_db(pg_server)
    fresh = _objects(url)
    assert fresh == [("public", "")]
    # What a test leaves: tables, a sequence, another schema, and a session that still holds
    # a lock on a table (in an open transaction) and an advisory lock.
    setup = psycopg.connect(url, autocommit=True)
    setup.execute("CREATE TABLE fenced_fences (resource TEXT PRIMARY KEY, token BIGINT)")
    setup.execute("CREATE SEQUENCE s")
    setup.execute("CREATE SCHEMA tenant; CREATE TABLE tenant.t (x INT)")
    lingering = psycopg.connect(url)
    lingering.execute("LOCK TABLE fenced_fences IN ACCESS EXCLUSIVE MODE")
    lingering.execute("SELECT pg_advisory_lock(7)")
    setup.close()
    try:
        assert _pg_empty_again(pg_server, db) is True
        assert _objects(url) == fresh
        with psycopg.connect(url, autocommit=True) as conn:  # the advisory lock is free again
            assert conn.execute("SELECT pg_try_advisory_lock(7)").fetchone() == (True,)
            conn.execute("CREATE TABLE fenced_fences (resource TEXT PRIMARY KEY)")  # (a test's)
    finally:
        lingering.close()
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


def test_a_database_with_its_own_settings_is_not_reused(pg_server: PostgresServer) -> None:
    db, _ = _new_db(pg_server)
    try:
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f"ALTER DATABASE {db} SET statement_timeout = '1s'")
        assert _pg_empty_again(pg_server, db) is False
    finally:
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


def test_emptying_a_database_takes_one_session(
    pg_server: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each session is a server process to start (~12 ms of the server's CPU): the emptying
    after each of some 500 tests opens one, in the database itself (not a second one from the
    server's own database to end the test's sessions)."""
    db, url = _new_db(pg_server)
    lingering = psycopg.connect(url)  # (a session the test left: ended from inside)
    lingering.execute("SELECT pg_advisory_lock(8)")
    opened: list[str] = []
    real = psycopg.connect

    def connect(conninfo: str = "", **kwargs: Any) -> Any:
        opened.append(conninfo)
        return real(conninfo, **kwargs)

    monkeypatch.setattr(psycopg, "connect", connect)
    try:
        assert _pg_empty_again(pg_server, db) is True
        assert opened == [url]
    finally:
        monkeypatch.undo()
        lingering.close()
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


def test_a_database_that_refuses_sessions_is_dropped_not_reused(
    pg_server: PostgresServer,
) -> None:
    """A test that made its database refuse connections: emptying it fails loudly (the
    fixture then drops it), it is never handed to the next test."""
    db, _ = _new_db(pg_server)
    try:
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f"ALTER DATABASE {db} ALLOW_CONNECTIONS false")
        with pytest.raises(psycopg.OperationalError):
            _pg_empty_again(pg_server, db)
    finally:
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
