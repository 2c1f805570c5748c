"""Attacks on ``SQLGuard.transaction`` on psycopg from outside (session 5, attack 5): each
test is a finding reproduced against a real PostgreSQL, the stale writer refused and the
rightful one accepted beside it."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from fenced import ConfigurationError, StaleTokenError
from fenced.guards.sql import SQLGuard

RESOURCE = "café"  # (a resource name is any text: not one byte a character in UTF-8)


def _connect(dsn: str, encoding: str | None = None) -> psycopg.Connection[tuple[object, ...]]:
    conn = psycopg.connect(dsn, autocommit=True)
    if encoding is not None:
        conn.execute(f"SET client_encoding = '{encoding}'")
    return conn


def _prepare(dsn: str) -> SQLGuard:
    guard = SQLGuard(RESOURCE, lock="L")
    with _connect(dsn) as conn:
        guard.install(conn)
        conn.execute("CREATE TABLE writes (token INT)")
    return guard


def _rows(dsn: str) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    with _connect(dsn) as conn:
        fences = conn.execute("SELECT resource, token FROM fenced_fences").fetchall()
        return fences, conn.execute("SELECT token FROM writes ORDER BY 1").fetchall()


@pytest.mark.parametrize("how", ["transaction", "fencer"])
def test_the_fence_is_one_row_whatever_the_connections_client_encoding(
    pg_dsn: str, how: str
) -> None:
    """transaction() (and the fencer, the same message) wrote its BEGIN+check and
    recheck+COMMIT messages as UTF-8 whatever the connection's client encoding: on a LATIN1
    connection the server read the resource 'café' as 'cafÃ©', another row. The fence was
    split: the holder of L:5 fenced 'cafÃ©', and a stale L:3 through a UTF-8 connection was
    accepted and committed on 'café' (high_water on the LATIN1 connection said None). Now
    the messages are in the connection's encoding: one row, L:3 refused, L:6 accepted."""
    guard = _prepare(pg_dsn)
    with _connect(pg_dsn, "LATIN1") as latin1:
        if how == "transaction":
            with guard.transaction(latin1, token="L:5"):
                latin1.execute("INSERT INTO writes VALUES (5)")
        else:
            guard.fencer(lambda: _connect(pg_dsn, "LATIN1")).fence("L:5")
        assert str(guard.high_water(latin1)) == "L:5"
    with _connect(pg_dsn) as utf8:
        with pytest.raises(StaleTokenError), guard.transaction(utf8, token="L:3"):
            utf8.execute("INSERT INTO writes VALUES (3)")
        with guard.transaction(utf8, token="L:6"):
            utf8.execute("INSERT INTO writes VALUES (6)")
    fences, writes = _rows(pg_dsn)
    assert fences == [(RESOURCE, 6)]
    assert writes == ([(5,), (6,)] if how == "transaction" else [(6,)])


def test_the_async_twin_writes_in_the_connections_client_encoding(pg_dsn: str) -> None:
    """atransaction() shares the messages: the same split, the same fix."""
    guard = _prepare(pg_dsn)

    async def run() -> None:
        conn = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
        async with conn:
            await conn.execute("SET client_encoding = 'LATIN1'")
            async with guard.atransaction(conn, token="L:5"):
                await conn.execute("INSERT INTO writes VALUES (5)")

    asyncio.run(run())
    with _connect(pg_dsn) as utf8:
        with pytest.raises(StaleTokenError), guard.transaction(utf8, token="L:3"):
            utf8.execute("INSERT INTO writes VALUES (3)")
    assert _rows(pg_dsn) == ([(RESOURCE, 5)], [(5,)])


def test_a_name_the_client_encoding_cannot_write_is_a_configuration_error(
    pg_dsn: str,
) -> None:
    """A resource name with a character the connection's encoding has not ('😀' on LATIN1):
    a one-line ConfigurationError, nothing written (before: the UTF-8 bytes, another name)."""
    guard = SQLGuard("mood😀", lock="L")
    with _connect(pg_dsn) as conn:
        guard.install(conn)
        conn.execute("CREATE TABLE writes (token INT)")
    with _connect(pg_dsn, "LATIN1") as latin1:
        with pytest.raises(ConfigurationError, match="client encoding"):
            with guard.transaction(latin1, token="L:1"):
                latin1.execute("INSERT INTO writes VALUES (1)")
        assert not latin1.info.transaction_status  # (idle: nothing left open)
    assert _rows(pg_dsn) == ([], [])


@pytest.mark.parametrize("scope", ["LOCAL", "SESSION"])
def test_a_block_that_sets_search_path_commits_the_rightful_write(pg_dsn: str, scope: str) -> None:
    """A schema-per-tenant application sets ``search_path`` inside its transaction (``SET
    LOCAL search_path = tenant``). The check ran with the connection's path and accepted
    L:1; the recheck riding with COMMIT names ``fenced_fences`` (``CAST(... AS regclass)``,
    folded when planned, in either branch) and ``fenced_refuse_v1`` unqualified, resolved
    in the tenant's path: psycopg's UndefinedTable, the rightful write rolled back (and not
    a fenced error). Then the recheck set the check's path for the transaction's rest first;
    now it names no table and no function (a refusal reads the fence row afterwards, in
    the check's path). The session keeps the block's own setting. A stale token is still
    refused there."""
    guard = _prepare(pg_dsn)
    with _connect(pg_dsn) as conn:
        conn.execute("CREATE SCHEMA tenant")
        conn.execute("CREATE TABLE tenant.writes (token INT)")
        with guard.transaction(conn, token="L:1"):
            conn.execute(f"SET {scope} search_path = tenant")
            conn.execute("INSERT INTO writes VALUES (1)")
        kept = conn.execute("SHOW search_path").fetchone()
        assert kept == (("tenant",) if scope == "SESSION" else ('"$user", public',))
        conn.execute("RESET search_path")
        assert conn.execute("SELECT token FROM tenant.writes").fetchall() == [(1,)]
        assert str(guard.high_water(conn)) == "L:1"
        with _connect(pg_dsn) as newer:
            with guard.transaction(newer, token="L:2"):
                pass
        with pytest.raises(StaleTokenError), guard.transaction(conn, token="L:1"):
            conn.execute(f"SET {scope} search_path = tenant")
            conn.execute("INSERT INTO writes VALUES (-1)")
        conn.execute("RESET search_path")
        assert conn.execute("SELECT token FROM tenant.writes").fetchall() == [(1,)]
        # (a block that ended the transaction, in the tenant's path: the recheck still refuses)
        with pytest.raises(ConfigurationError, match="ended the transaction"):
            with guard.transaction(conn, token="L:2"):
                conn.execute(f"SET {scope} search_path = tenant")
                conn.execute("COMMIT")
                conn.execute("INSERT INTO writes VALUES (-2)")
        conn.execute("RESET search_path")
        assert conn.execute("SELECT token FROM tenant.writes").fetchall() == [(1,)]


@pytest.mark.parametrize("scope", ["LOCAL", "SESSION"])
def test_a_batch_that_sets_search_path_commits_the_rightful_write(pg_dsn: str, scope: str) -> None:
    """The same class in ``batch``'s psycopg pipeline: its last check names the fence table
    and the refusal function unqualified, after the caller's statements."""
    guard = _prepare(pg_dsn)
    with _connect(pg_dsn) as conn:
        conn.execute("CREATE SCHEMA tenant")
        conn.execute("CREATE TABLE tenant.writes (token INT)")
        statements = [
            (f"SET {scope} search_path = tenant", None),
            ("INSERT INTO writes VALUES (1)", None),
        ]
        guard.batch(conn, statements, token="L:1")
        conn.execute("RESET search_path")
        assert conn.execute("SELECT token FROM tenant.writes").fetchall() == [(1,)]
        assert str(guard.high_water(conn)) == "L:1"


def test_a_name_ending_a_shift_jis_character_in_a_backslash_stays_one_literal(
    pg_dsn: str,
) -> None:
    """The classic multibyte-escape class (CVE-2006-2313): on a SJIS connection the UTF-8
    bytes of 'Ё' (D0 81) followed by the literal's doubled backslash read as one SJIS
    character (81 5C) and an escaped quote: the resource name's rest left the literal, into
    the SQL. PostgreSQL's default ``backslash_quote = safe_encoding`` refused the message
    (the rightful write lost; with ``on`` the name would have been SQL). Written in the
    client encoding, the name stays one literal: fenced under its own name (read back
    through a UTF-8 connection) and the rightful write committed."""
    name = "Ё\\' || 'x"
    guard = SQLGuard(name, lock="L")
    with _connect(pg_dsn) as conn:
        guard.install(conn)
        conn.execute("CREATE TABLE writes (token INT)")
    with _connect(pg_dsn, "SJIS") as sjis:
        sjis.execute("SET backslash_quote = on")
        with guard.transaction(sjis, token="L:4"):
            sjis.execute("INSERT INTO writes VALUES (4)")
    assert _rows(pg_dsn) == ([(name, 4)], [(4,)])
