"""One guard registry by URL (``fenced.guards.registry``), used by ``fenced group --member``
and the check kit's ``--resource``: each kind opened from its URL refuses a stale token and
takes the rightful one, against real servers; bad URLs fail with one typed line that never
shows a password; the kit's earlier ``sql+`` spellings still work, deprecated."""

from __future__ import annotations

import sqlite3
import warnings
from pathlib import Path
from typing import Any

import pytest

from fenced import BackendUnavailable, ConfigurationError, FencingToken, StaleTokenError
from fenced.cli._group import member_from_url
from fenced.guards.registry import (
    GUARD_KINDS,
    GuardCharacteristic,
    guard_schemes,
    open_guard,
    parse_guard_url,
)
from fenced.testing.check import open_resource
from fenced.testing.servers import EtcdServer, RedisServer

LOCK = "orders"


def _tok(value: int) -> FencingToken:
    return FencingToken(LOCK, value)


def _both_sides(target: Any) -> None:
    """The rightful holder's token raises the mark; an older one is then refused."""
    target.fence(_tok(7))
    target.fence(_tok(8))
    with pytest.raises(StaleTokenError):
        target.fence(_tok(7))
    target.fence(_tok(8))  # (equal: the holder's next write is taken)


def test_redis_from_its_url(redis_server: RedisServer) -> None:
    opened = open_guard(redis_server.url, "reg-redis", lock=LOCK)
    try:
        opened.client.delete(opened.guard.fence_key)
        _both_sides(opened.fence_target())
    finally:
        opened.close()
    # the guard's no-retry pool, made for the registry's client, is closed with it (it was
    # left connected until garbage collection)
    pool = opened.guard._writer.connection_pool
    assert pool._created_connections >= 1
    assert not any(c._sock for c in pool._available_connections)


def test_etcd_from_its_url(etcd_server: EtcdServer) -> None:
    opened = open_guard(etcd_server.url, "reg-etcd", lock=LOCK)
    try:
        _both_sides(opened.fence_target())
    finally:
        opened.close()


def test_sqlite_from_its_url_never_makes_the_file(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    with pytest.raises(ConfigurationError, match="ambiguous"):
        parse_guard_url(f"sqlite://{db}")  # sqlite:///tmp/...: the source's rule, refused
    opened = open_guard(f"sqlite:///{db}", "reg-sqlite", lock=LOCK)
    with pytest.raises(BackendUnavailable, match="cannot connect"):
        opened.fence_target().fence(_tok(1))
    assert not db.exists()  # a typo must not fence a new empty file
    sqlite3.connect(db).close()
    conn = opened.connect()  # type: ignore[misc]
    opened.guard.install(conn)
    conn.close()
    _both_sides(opened.fence_target())


def test_postgresql_from_its_url(pg_dsn: str) -> None:
    import psycopg

    opened = open_guard(pg_dsn, "reg-pg", lock=LOCK)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        opened.guard.install(conn)
    _both_sides(opened.fence_target())


def test_a_directory_from_its_url(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="lock"):
        open_guard(f"file://{tmp_path}", "register")
    guard = open_guard(f"file://{tmp_path}", "register", lock=LOCK).guard
    guard.write("register", b"a", token=_tok(5))
    with pytest.raises(StaleTokenError):
        guard.write("register", b"b", token=_tok(4))
    guard.write("register", b"c", token=_tok(5))
    assert guard.read("register") == (_tok(5), b"c")


def test_declared_characteristics_and_schemes() -> None:
    assert {
        "redis", "rediss", "postgresql", "postgres", "sqlite", "mysql", "mariadb", "etcd",
        "etcd3", "file",
    } == set(guard_schemes())  # fmt: skip
    # (the URLs `fenced group --member` takes: every kind a replicated group adapts)
    assert "file" not in guard_schemes(GuardCharacteristic.GROUP_MEMBER)
    assert "mysql" in guard_schemes(GuardCharacteristic.GROUP_MEMBER)
    parsed = parse_guard_url("mariadb://u:pw@db:3307/app?charset=utf8mb4")
    assert (parsed.kind.name, parsed.dialect) == ("sql", "mysql")
    assert GuardCharacteristic.CALLER_TRANSACTION in GUARD_KINDS["sql"].characteristics
    assert GuardCharacteristic.MULTI_ENDPOINT in GUARD_KINDS["etcd"].characteristics
    parsed = parse_guard_url(
        "postgresql://u:pw@db:5432/app?sslmode=require&table=t", own=("table",)
    )
    assert parsed.params == {"table": "t"}
    assert parsed.target == "postgresql://u:pw@db:5432/app?sslmode=require"  # libpq's stays
    assert parsed.dialect == "postgresql"


@pytest.mark.parametrize(
    "url",
    [
        "mongodb://u:hunter2-secret@h/db",
        "etcd://",
        "file://host/dir",
        "sqlite:///",
        "mysql://u:hunter2-secret@h",  # (no database)
        "mysql://u:hunter2-secret@h:nope/db",
        "mysql://u:hunter2-secret@h/db?ssl_ca=x",  # (a parameter PyMySQL is not given)
    ],
)
def test_bad_urls_one_typed_line_no_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        parse_guard_url(url)
    assert "\n" not in str(err.value) and "hunter2" not in str(err.value)


def test_the_kits_old_spellings_still_work_deprecated(tmp_path: Path) -> None:
    db = tmp_path / "k.db"
    with pytest.warns(DeprecationWarning, match="sqlite:////"):
        res = open_resource(f"sql+sqlite://{db}?table=t", LOCK)
    res.reset()
    res.write(_tok(3), b"x")
    with pytest.raises(StaleTokenError):
        res.write(_tok(2), b"y")
    assert res.final() == (b"x", 3)
    res.close()
    with pytest.warns(DeprecationWarning, match="postgresql://"):
        parsed = parse_guard_url("sql+postgresql://u@h/d")
    assert parsed.target == "postgresql://u@h/d"


def test_one_url_for_the_kit_and_the_group(tmp_path: Path) -> None:
    """The same ``sqlite:////ABS`` names a kit resource and a group member (before the
    registry the kit refused it and wanted ``sql+sqlite://``)."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        res = open_resource(f"{url}?table=reg", LOCK)
    res.reset()
    res.write(_tok(4), b"kit")
    with pytest.raises(StaleTokenError):
        res.write(_tok(1), b"old")
    res.close()
    member, close = member_from_url(url, "group-res")
    assert close is None
    assert type(member).__name__ == "SQLFencer"
    with pytest.raises(ConfigurationError, match="cannot be a group member"):
        member_from_url(f"file://{tmp_path}", "group-res")


def test_the_kit_refuses_an_unknown_scheme_in_one_line() -> None:
    with pytest.raises(ConfigurationError, match="guard URL") as err:
        open_resource("mongodb://u:hunter2-secret@h/db", LOCK)
    assert "hunter2" not in str(err.value)


def test_the_kits_sql_register_refuses_a_mysql_url_in_one_line() -> None:
    """The registry's ``sql`` kind takes ``mysql://`` (a group member); the kit's register
    is written for SQLite and PostgreSQL, and says so instead of failing in psycopg."""
    with pytest.raises(ConfigurationError, match="sqlite:// or postgresql://") as err:
        open_resource("mysql://u:hunter2-secret@127.0.0.1:1/db", LOCK)
    assert "\n" not in str(err.value) and "hunter2" not in str(err.value)
