"""Attacks on the guards' group contract (``apply_group``/``read_group``) from outside, on
real servers: epochs beyond a double's precision, a damaged epoch mark, malformed arguments,
and two (resource, group) names that must not share keys. Each refusal leaves the member as it
was; each right change next to it is accepted."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from fenced import (
    ConfigurationError,
    CorruptMarkError,
    MemberBehindError,
    StaleEpochError,
    StaleTokenError,
)
from fenced.guards.etcd import EtcdGuard
from fenced.guards.redis import RedisGuard
from fenced.guards.sql import SQLGuard
from fenced.replicated import stamp
from fenced.testing.servers import EtcdServer, RedisServer
from tests.helpers import unique_name


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server  # type: ignore[misc]


@pytest.fixture(scope="module")
def etcd_srv() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server  # type: ignore[misc]


def _redis_guard(srv: RedisServer) -> RedisGuard:
    return RedisGuard(redis.Redis(port=srv.port), unique_name("res"), lock="L")


# -- Redis: the epoch mark compared exactly, and failing closed when damaged -------------------


def test_redis_epoch_above_2_53_is_compared_exactly(redis_srv: RedisServer) -> None:
    # Lua numbers are doubles: 2^53 and 2^53+1 compared equal, so a stale epoch got in.
    g = _redis_guard(redis_srv)
    big = 2**53 + 1
    g.apply_group(token="L:5", group="g", epoch=big, items=[("k", stamp(5, 1), b"new")])
    with pytest.raises(StaleEpochError):
        g.apply_group(token="L:5", group="g", epoch=big - 1, items=[("k", stamp(5, 2), b"old")])
    state = g.read_group(group="g")
    assert (state.epoch, state.items) == (big, [("k", stamp(5, 1), b"new")])
    # The rightful change at the mark (and above it) is accepted; `since` is exact too.
    g.apply_group(token="L:5", group="g", epoch=big, items=[("k", stamp(5, 3), b"v3")])
    with pytest.raises(MemberBehindError):
        g.apply_group(token="L:5", group="g", epoch=2**62, since=big + 1)
    g.apply_group(token="L:5", group="g", epoch=2**63 - 1, since=big)
    assert g.read_group(group="g").epoch == 2**63 - 1
    with pytest.raises(StaleEpochError):
        g.apply_group(token=None, group="g", epoch=2**63 - 2)


DAMAGED = [b"abc", b"", b"-5", b"1e3", b" 7", b"0x10", b"1.5", b"1" * 20]


@pytest.mark.parametrize("token", ["L:5", None], ids=["change", "epoch-only"])
@pytest.mark.parametrize("bad", DAMAGED, ids=[repr(b) for b in DAMAGED])
def test_redis_damaged_epoch_mark_fails_closed(
    redis_srv: RedisServer, bad: bytes, token: str | None
) -> None:
    # Before: tonumber() read '1e3' as 1000, '0x10' as 16, '1.5' (since 0) as accepted and
    # overwritten; 'abc' and '' came back as a bare FencedError quoting the Lua error.
    g = _redis_guard(redis_srv)
    r = redis.Redis(port=redis_srv.port)
    epoch_key, stamps_key, data_key, holder_key = g.group_keys("g")
    r.set(epoch_key, bad)
    items = [("k", stamp(5, 1), b"v")] if token else []
    with pytest.raises(CorruptMarkError, match="epoch mark"):
        g.apply_group(token=token, group="g", epoch=2, items=items, reset=token is None)
    assert r.get(epoch_key) == bad
    assert not r.exists(stamps_key, data_key, holder_key)
    assert r.hget(g.fence_key, "hw") is None  # the lock mark did not move either
    with pytest.raises(CorruptMarkError):
        g.read_group(group="g")
    # The same guard's healthy group next to it is served.
    g.apply_group(token="L:5", group="h", epoch=2, items=[("k", stamp(5, 1), b"v")])
    assert g.read_group(group="h").items == [("k", stamp(5, 1), b"v")]


# -- every kind: a malformed change is refused, typed, before anything is written --------------


@pytest.fixture(params=["sqlite", "redis", "etcd"])
def member_guard(
    request: pytest.FixtureRequest, tmp_path: Path, redis_srv: RedisServer, etcd_srv: EtcdServer
) -> Iterator[tuple[Any, Any, Any]]:
    """(apply, read, damage): the kind's apply_group and read_group, bound to one fresh
    resource, and ``damage(group, key, stamp)``, which rewrites a stored item's stamp by hand."""
    if request.param == "redis":
        g: Any = _redis_guard(redis_srv)
        r = redis.Redis(port=redis_srv.port)

        def damage_redis(group: str, key: str, stamp_text: str) -> None:
            r.hset(g.group_keys(group)[1], key, stamp_text)

        yield g.apply_group, g.read_group, damage_redis
    elif request.param == "etcd":
        with EtcdGuard(f"127.0.0.1:{etcd_srv.port}", unique_name("res"), lock="L") as eg:

            def damage_etcd(group: str, key: str, stamp_text: str) -> None:
                import aetcd

                name = eg.aio.group_keys(group).data + key.encode()

                async def put() -> None:  # (the value: stamp, 1, the bytes b"v" the test wrote)
                    async with aetcd.Client("127.0.0.1", etcd_srv.port) as client:
                        await client.put(name, stamp_text.encode() + b"1v")

                eg.portal.call(put())

            yield eg.apply_group, eg.read_group, damage_etcd
    else:
        path = str(tmp_path / "m.db")
        conn = sqlite3.connect(path, isolation_level=None)
        sg = SQLGuard(unique_name("res"), lock="L")
        sg.install_group(conn)

        def damage_sqlite(group: str, key: str, stamp_text: str) -> None:
            conn.execute(
                "UPDATE fenced_group_data SET stamp = ? WHERE grp = ? AND key = ?",
                (stamp_text, group, key),
            )

        yield (
            lambda **kw: sg.apply_group(conn, **kw),
            lambda **kw: sg.read_group(conn, **kw),
            damage_sqlite,
        )
        conn.close()


BAD_CHANGES: list[tuple[str, dict[str, Any]]] = [
    ("negative epoch", {"epoch": -1}),
    ("text epoch", {"epoch": "7"}),
    ("float epoch", {"epoch": 1.5}),
    ("bool epoch", {"epoch": True}),
    ("epoch above 2^63-1", {"epoch": 2**64}),
    ("negative since", {"since": -3}),
    ("float since", {"since": 0.5}),
    ("short stamp", {"items": [("k", "9", b"v")]}),
    ("stamp not digits", {"items": [("k", "x" * 38, b"v")]}),
    ("text value", {"items": [("k", stamp(5, 1), "v")]}),
    ("empty key", {"items": [("", stamp(5, 1), b"v")]}),
    ("item not a triple", {"items": [("k",)]}),
    ("items a string", {"items": "kv"}),
]


@pytest.mark.parametrize("bad", [c for _, c in BAD_CHANGES], ids=[n for n, _ in BAD_CHANGES])
def test_malformed_group_change_is_refused_before_anything_is_written(
    member_guard: tuple[Any, Any, Any], bad: dict[str, Any]
) -> None:
    # Before (SQL): a float epoch was stored and damaged the member's mark for good, stamps of
    # other widths sorted wrong ("9" above "10"), 2**64 was an OverflowError, a bad item a
    # ValueError; (Redis) a short stamp was taken.
    apply, read, _ = member_guard
    change: dict[str, Any] = {"token": "L:5", "group": "g", "epoch": 1, "items": [], **bad}
    with pytest.raises(ConfigurationError):
        apply(**change)
    state = read(group="g")
    assert (state.token, state.epoch, state.items) == (0, 0, [])
    with pytest.raises(ConfigurationError):
        apply(token="L:5", group="", epoch=1)
    apply(token="L:5", group="g", epoch=1, items=[("k", stamp(5, 1), b"v")])
    state = read(group="g")
    assert (state.token, state.epoch, state.items) == (5, 1, [("k", stamp(5, 1), b"v")])


# -- every kind: a damaged stamp fails closed ------------------------------------------------

DAMAGED_STAMPS = ["zzz", "9", "9" * 38, stamp(6, 1)]


@pytest.mark.parametrize("bad", DAMAGED_STAMPS, ids=["letters", "short", "all nines", "token 6"])
def test_damaged_stamp_is_refused_as_corrupt(member_guard: tuple[Any, Any, Any], bad: str) -> None:
    # Before: a stamp ahead of every writer (here: token 6 > the mark 5) was read as the newest
    # write; the group's later writes were acknowledged but skipped on that member, and the
    # damaged value won every read. A stamp not of 38 digits was a ValueError in the group.
    apply, read, damage = member_guard
    apply(
        token="L:5", group="g", epoch=1, items=[("k", stamp(5, 1), b"v"), ("j", stamp(5, 1), b"w")]
    )
    damage("g", "k", bad)
    with pytest.raises(CorruptMarkError, match="group item 'k'"):
        read(group="g")
    with pytest.raises(CorruptMarkError):
        read(group="g", keys=["k"])
    # The other key, and an item whose stamp is at the mark, are read as they are.
    assert read(group="g", keys=["j"]).items == [("j", stamp(5, 1), b"w")]
    damage("g", "k", stamp(5, 9))
    assert read(group="g", keys=["k"]).items == [("k", stamp(5, 9), b"v")]


def test_group_write_is_not_acknowledged_over_a_damaged_stamp(
    tmp_path: Path, redis_srv: RedisServer
) -> None:
    # The whole group (SQLite source, an SQLite and a Redis member): a stamp ahead of every
    # writer on one member made the next write acknowledged and then lost (the read gave the
    # damaged member's old value). Now the writer refuses before it acknowledges anything.
    import fenced
    from fenced.replicated import Group

    db = tmp_path / "a.db"
    sqlite3.connect(db).close()
    resource = unique_name("grp")
    locks = fenced.connect(f"sqlite:///{tmp_path}/source.db")
    members = {
        "a": SQLGuard(resource).fencer(lambda: sqlite3.connect(db, check_same_thread=False)),
        "b": RedisGuard(redis.Redis(port=redis_srv.port), resource),
    }
    group = Group(resource, locks, members)
    try:
        with locks.lock(resource, ttl=30) as lease:
            group.writer(lease).set("k", b"v1")
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE fenced_group_data SET stamp = ?", ("9" * 38,))
        with locks.lock(resource, ttl=30) as lease, pytest.raises(CorruptMarkError):
            group.writer(lease).set("k", b"v2")
        # Repaired by hand (the stamp put back): the rightful writer is served again.
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE fenced_group_data SET stamp = ?", (stamp(1, 1),))
        with locks.lock(resource, ttl=30) as lease:
            group.writer(lease).set("k", b"v3")
        assert group.read("k") == b"v3"
    finally:
        group.close()
        locks.close()


# -- etcd: two (resource, group) names never share a key ---------------------------------------


def test_etcd_group_keys_are_distinct_for_names_with_slashes(etcd_srv: EtcdServer) -> None:
    # Before: resource "X/b" group "c" and resource "X" group "b/c" were the same keys: one
    # lock's holder wrote data another lock's group read, and overwrote its holder.
    base = unique_name("res")
    endpoint = f"127.0.0.1:{etcd_srv.port}"
    with (
        EtcdGuard(endpoint, f"{base}/b", lock="L") as a,
        EtcdGuard(endpoint, base, lock="M") as b,
    ):
        a.apply_group(token="L:5", group="c", epoch=3, items=[("k", stamp(5, 1), b"from-a")])
        state_b = b.read_group(group="b/c")
        assert (state_b.epoch, state_b.holder, state_b.items) == (0, None, [])
        b.apply_group(token="M:1", group="b/c", epoch=1, items=[("k", stamp(1, 1), b"from-b")])
        state_a = a.read_group(group="c")
        assert (state_a.epoch, state_a.holder) == (3, "L:5")
        assert state_a.items == [("k", stamp(5, 1), b"from-a")]
        assert b.read_group(group="b/c").items == [("k", stamp(1, 1), b"from-b")]
        # One resource: group "g/data/x"'s marks are not items of group "g" (its data range).
        a.apply_group(token="L:5", group="g", epoch=1, items=[("x", stamp(5, 1), b"1")])
        a.apply_group(token="L:5", group="g/data/x", epoch=1, items=[("y", stamp(5, 1), b"2")])
        assert a.read_group(group="g").items == [("x", stamp(5, 1), b"1")]
        assert a.read_group(group="g/data/x").items == [("y", stamp(5, 1), b"2")]
        # A name with '%' is its own too ("a%2Fb" is not "a/b").
        a.apply_group(token="L:5", group="c%2Fd", epoch=1, items=[("z", stamp(5, 1), b"3")])
        assert a.read_group(group="c/d").items == []


# -- fenced group: a malformed member URL is a typed one-line error, its password not shown --

BAD_MEMBER_URLS = [
    "redis://:Sekr3tPw@127.0.0.1:notaport/0",
    "redis://:Sekr3tPw@127.0.0.1:99999/0",
    "rediss://:Sekr3tPw@[::1/0",
    "postgresql://u:Sekr3tPw@[::1/db",
    "etcd://u:Sekr3tPw@127.0.0.1:2379",
    "mysql://root:Sekr3tPw@[::1/db",  # (a well-formed mysql:// URL is a member: memsql)
]


@pytest.mark.parametrize("url", BAD_MEMBER_URLS)
def test_group_cli_refuses_a_malformed_member_url_in_one_line(
    tmp_path: Path, url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a Redis URL with a bad port and any URL with an unclosed '[' were tracebacks
    # (ValueError from urllib), exit 1.
    from fenced.cli import main

    source = f"sqlite:///{tmp_path}/locks.db"
    assert main(["group", "status", "g", "--url", source, "--member", f"a={url}"]) == 2
    out = capsys.readouterr()
    assert "Sekr3tPw" not in out.out + out.err
    assert out.err.startswith("fenced: ") and out.err.count("\n") == 1, out.err


# -- SQLite: a damaged row (SQLite keeps any value in any column) fails closed on apply too --


@pytest.mark.parametrize("bad", [2.5, "abc", "", 2**70], ids=["2.5", "abc", "empty", "2^70"])
@pytest.mark.parametrize("since", [0, 2])
def test_sqlite_damaged_epoch_row_is_never_overwritten(
    tmp_path: Path, bad: object, since: int
) -> None:
    # Before: an epoch of 2.5 compared as a number, so the next change (3) overwrote it as if
    # it were healthy, while read_group called the same row corrupt.
    conn = sqlite3.connect(str(tmp_path / "m.db"), isolation_level=None)
    g = SQLGuard(unique_name("res"), lock="L")
    g.install_group(conn)
    for group in ("g", "h"):
        g.apply_group(conn, token="L:5", group=group, epoch=2, items=[("k", stamp(5, 1), b"v")])
    stored = str(bad) if isinstance(bad, int) else bad  # (2**70 does not fit an INTEGER)
    conn.execute("UPDATE fenced_group_epochs SET epoch = ? WHERE grp = 'g'", (stored,))
    query = "SELECT epoch, typeof(epoch) FROM fenced_group_epochs WHERE grp = 'g'"
    damaged = conn.execute(query).fetchone()  # (as SQLite keeps it: 2^70 becomes a REAL)
    with pytest.raises(CorruptMarkError, match="epoch mark"):
        g.apply_group(conn, token="L:5", group="g", epoch=3, since=since)
    with pytest.raises(CorruptMarkError, match="epoch mark"):
        g.apply_group(conn, token=None, group="g", epoch=3, since=since)
    assert conn.execute(query).fetchone() == damaged
    g.apply_group(conn, token="L:5", group="h", epoch=3, since=since)  # the healthy group
    assert g.read_group(conn, group="h").epoch == 3
    conn.close()


def test_sqlite_item_value_of_another_type_is_corrupt_not_a_type_error(tmp_path: Path) -> None:
    conn = sqlite3.connect(str(tmp_path / "m.db"), isolation_level=None)
    g = SQLGuard(unique_name("res"), lock="L")
    g.install_group(conn)
    g.apply_group(conn, token="L:5", group="g", epoch=1, items=[("k", stamp(5, 1), b"v")])
    assert g.read_group(conn, group="g").items == [("k", stamp(5, 1), b"v")]
    conn.execute("UPDATE fenced_group_data SET value = 'text'")
    with pytest.raises(CorruptMarkError, match="group item 'k'"):
        g.read_group(conn, group="g")
    conn.close()


# -- etcd: a member that came back empty is repaired by the same guard that wrote to it ------


def test_etcd_member_wiped_is_repaired_by_the_guard_that_wrote_to_it(etcd_srv: EtcdServer) -> None:
    # Before: the guard remembered the mark it had seen, so after the member lost every key
    # (a wiped data dir), the group's state transfer through that guard (every live writer's)
    # was CorruptMarkError for good; Redis members already forgot it (by design).
    import aetcd

    async def delete(*keys: bytes) -> None:
        async with aetcd.Client("127.0.0.1", etcd_srv.port) as client:
            if keys:
                for key in keys:
                    await client.delete(key)
            else:
                await client.delete_range(b"\0", b"\0")  # every key: a wiped member

    resource = unique_name("res")
    with EtcdGuard(f"127.0.0.1:{etcd_srv.port}", resource, lock="L") as g:
        g.apply_group(token="L:5", group="g", epoch=2, items=[("k", stamp(5, 1), b"v")])
        g.portal.call(delete())
        with pytest.raises(MemberBehindError):  # a writer's change still refused there
            g.apply_group(token="L:6", group="g", epoch=2, since=2)
        assert g.read_group(group="g").items == []
        g.apply_group(token="L:6", group="g", epoch=3, reset=True, items=[("k", stamp(5, 1), b"v")])
        state = g.read_group(group="g")
        assert (state.token, state.epoch, state.items) == (6, 3, [("k", stamp(5, 1), b"v")])
        # The other side: the fence keys deleted while the epoch mark is still there is
        # damage, not a member that came back empty: refused, nothing written.
        g.portal.call(delete(f"fenced/hw/{resource}".encode(), f"fenced/lock/{resource}".encode()))
        with pytest.raises(CorruptMarkError):
            g.apply_group(token="L:6", group="g", epoch=3, items=[("k", stamp(6, 1), b"w")])
        with pytest.raises(CorruptMarkError):  # (its item's stamp is above the mark now: 0)
            g.read_group(group="g")

        async def value() -> bytes:
            async with aetcd.Client("127.0.0.1", etcd_srv.port) as client:
                got = await client.get(g.aio.group_keys("g").data + b"k")
                assert got is not None
                return bytes(got.value)

        assert g.portal.call(value()) == stamp(5, 1).encode() + b"1v"  # nothing written


def test_redis_member_wiped_is_repaired_by_a_guard_that_saw_a_mark(redis_srv: RedisServer) -> None:
    # Before: once the guard had seen a mark (here: a stale refusal names it), a member that
    # came back empty (FLUSHALL, as a restart without its data) refused the group's state
    # transfer through that guard for good ("mark missing, after this guard saw 7").
    r = redis.Redis(port=redis_srv.port)
    g = _redis_guard(redis_srv)
    g.apply_group(token="L:7", group="g", epoch=2, items=[("k", stamp(7, 1), b"v")])
    stale = RedisGuard(r, g.resource, lock="L")  # (the same member, another guard object)
    with pytest.raises(StaleTokenError):
        stale.apply_group(token="L:6", group="g", epoch=2, items=[("k", stamp(6, 1), b"x")])
    r.flushall()
    with pytest.raises(MemberBehindError):  # a writer's change still refused there
        stale.apply_group(token="L:8", group="g", epoch=2, since=2)
    stale.apply_group(token="L:8", group="g", epoch=3, reset=True, items=[("k", stamp(7, 1), b"v")])
    state = stale.read_group(group="g")
    assert (state.token, state.epoch, state.items) == (8, 3, [("k", stamp(7, 1), b"v")])
    # The other side: the fence hash deleted under a live epoch mark is damage to this guard.
    r.delete(g.fence_key)
    with pytest.raises(CorruptMarkError, match="mark missing"):
        stale.apply_group(token="L:8", group="g", epoch=3, items=[("k", stamp(8, 1), b"w")])
    assert r.hget(g.group_keys("g")[2], "k") == b"v"
