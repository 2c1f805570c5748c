"""``pg_dsn`` (tests/conftest.py) hands tests an earlier test's database, emptied: what a test
left there (tables, schemas, sequences, sessions holding locks) must be gone, or the database
dropped instead, so that each test still starts as on a new database."""

from __future__ import annotations

import psycopg

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
