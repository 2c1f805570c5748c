"""Issue 25 §3: an acknowledged write is never lost, with real servers and real processes.

* A member that comes back empty (Redis with AOF restarted on a wiped directory, an SQLite file
  replaced by an empty one) is below the configuration's epoch: it never counts as holding
  the writes — not for a write, a read, a reconfiguration, nor fence on acquire — until a
  reconfiguration copies the data to it.
* A writer SIGKILLed between its member writes leaves a key on one member only; after a new
  holder fenced the group, reads repair it under the current fence (not the dead writer's
  token, now below the marks).
* With member guards that verify signatures, repair and state transfer present the current
  holder's signed token (kept by the members with their marks), never an unsigned one.
"""

from __future__ import annotations

import shutil
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

import fenced
from fenced.guards.redis import RedisGuard
from fenced.guards.sql import SQLGuard
from fenced.replicated import Group, Item, SQLMember, stamp
from fenced.testing.servers import MariaDBServer, RedisServer
from tests.helpers import NO_TLS, spawn_python, write_key_file

pytestmark = pytest.mark.xdist_group("replicated-acknowledged")

KEY = fenced.HmacKey("k1", b"s" * 32)


class RedisReplica:
    """A member on its own redis-server (AOF, appendfsync always)."""

    def __init__(self, tmp: Path, name: str) -> None:
        (tmp / name).mkdir()
        self.server = RedisServer(str(tmp / name))
        self.server.start()
        self.name = name

    def guard(self, **kw: Any) -> RedisGuard:
        client = redis.Redis(
            host="127.0.0.1", port=self.server.port, socket_timeout=2, socket_connect_timeout=2
        )
        return RedisGuard(client, "orders", **kw)

    def spec(self) -> str:
        return str(self.server.port)

    def kill(self) -> None:
        self.server.kill()

    def start(self) -> None:
        self.server.start()

    def restart_empty(self) -> None:
        self.server.kill()
        for entry in Path(self.server.dir).iterdir():  # the AOF and anything else it kept
            if entry.is_dir():
                shutil.rmtree(entry)
            elif entry.suffix != ".log":
                entry.unlink()
        self.server.start()

    def close(self) -> None:
        self.server.close()


class SQLiteReplica:
    """A member on an SQLite file, opened for each call (mode=rw: a missing file is down)."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.path = tmp / f"{name}.db"
        sqlite3.connect(self.path).close()
        self.name = name

    def guard(self, **kw: Any) -> SQLMember:
        def connect() -> sqlite3.Connection:
            return sqlite3.connect(f"file:{self.path}?mode=rw", uri=True, check_same_thread=False)

        return SQLMember(SQLGuard("orders", **kw), connect, "orders", keep_connection=False)

    def kill(self) -> None:
        self.path.rename(self.path.with_suffix(".down"))

    def start(self) -> None:
        self.path.with_suffix(".down").rename(self.path)

    def restart_empty(self) -> None:
        self.path.unlink()
        sqlite3.connect(self.path).close()

    def spec(self) -> str:
        return str(self.path)

    def close(self) -> None:
        pass


class MariaDBReplica:
    """A member on its own MariaDB server, through PyMySQL (a connection for each call)."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.server = MariaDBServer()  # (its own directory: the server's user must reach it)
        self.server.start()
        self.name = name

    def guard(self, **kw: Any) -> SQLMember:
        import pymysql

        port = self.server.port

        def connect() -> Any:
            return pymysql.connect(
                host="127.0.0.1",
                port=port,
                user="root",
                database="fenced",
                connect_timeout=2,
                **NO_TLS,
            )

        return SQLMember(SQLGuard("orders", **kw), connect, "orders", keep_connection=False)

    def kill(self) -> None:
        self.server.kill()

    def start(self) -> None:
        self.server.start()

    def restart_empty(self) -> None:
        self.server.kill()
        shutil.rmtree(Path(self.server.dir) / "data")  # (start() makes a fresh one)
        self.server.start()

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def locks(tmp_path: Path) -> Iterator[fenced.Locks]:
    with fenced.connect(f"sqlite:///{tmp_path}/locks.db", signing_key=KEY) as source:
        yield source


def replicas(kind: str, tmp: Path, names: str) -> list[Any]:
    make = {"redis": RedisReplica, "mariadb": MariaDBReplica}.get(kind, SQLiteReplica)
    return [make(tmp, n) for n in names]


def status_of(group: Group) -> dict[str, fenced.replicated.MemberStatus]:
    return {m.name: m for m in group.status()[1]}


def state(group: Group, name: str) -> Any:
    return group._portal.call(group.aio.member(name).read(None))


@pytest.mark.parametrize("kind", ["redis", "sqlite", "mariadb"])
def test_a_member_restarted_empty_never_counts_as_holding_acknowledged_writes(
    tmp_path: Path, locks: fenced.Locks, kind: str
) -> None:
    a, b = replicas(kind, tmp_path, "ab")
    group = Group("orders", locks, {"a": a.guard(), "b": b.guard()}, timeout=3)
    try:
        with locks.lock("orders", ttl=30) as lease:
            w = group.writer(lease)
            w.set("order:1", b"paid")  # acknowledged: on a and b
            b.restart_empty()
            assert (state(group, "b").token, state(group, "b").epoch) == (0, 0)
            a.kill()
            # The writer cannot remove a: b, the only member left, holds none of the writes.
            with pytest.raises(fenced.ReplicationError, match="lost their state"):
                w.set("order:2", b"lost?")
            assert group.configuration().members == ("a", "b")
            assert state(group, "b").epoch == 0  # no path raised it meanwhile
            # Nor can an operator.
            with pytest.raises(fenced.ReplicationError, match="lost their state"):
                group.remove("a")
            assert group.configuration().members == ("a", "b")
            assert status_of(group)["b"].behind
            a.start()
            # The rightful path: the writer copies a's data to b, then writes to both.
            assert group.read("order:1") == b"paid"
            w.set("order:2", b"shipped")
            st = status_of(group)
            assert not st["b"].behind and st["b"].keys == 2
        a.kill()
        group.remove("a")
        assert group.configuration().members == ("b",)
        assert group.read("order:1") == b"paid" and group.read("order:2") == b"shipped"
    finally:
        group.close()
        for r in (a, b):
            r.close()


def test_read_fence_on_acquire_and_add_with_a_member_that_came_back_empty(
    tmp_path: Path, locks: fenced.Locks
) -> None:
    a, b, c = replicas("sqlite", tmp_path, "abc")
    group = Group("orders", locks, {n.name: n.guard() for n in (a, b, c)}, timeout=3)
    try:
        # The first configuration's members are raised to its epoch before it exists, so one
        # that comes back empty (0) is told apart.
        assert {m.epoch for m in status_of(group).values()} == {1}
        with locks.lock("orders", ttl=30) as lease:
            group.writer(lease).set("order:1", b"paid")
        c.restart_empty()
        st = status_of(group)
        assert (st["c"].token, st["c"].epoch, st["c"].behind) == (0, 0, True)
        assert not st["a"].behind
        # A read counts a and b only, and does not raise c's marks by repairing it.
        assert group.read("order:1") == b"paid"
        assert state(group, "c").epoch == 0 and state(group, "c").items == {}
        # Fence on acquire: the member that lost its state refuses every change at this
        # epoch (from any holder), so it counts as fenced; its marks stay below.
        with locks.lock("orders", ttl=30, fence=[group]) as lease:
            assert state(group, "a").token == lease.token.value
            assert (state(group, "c").token, state(group, "c").epoch) == (0, 0)
        # An operator's add of a member still in the configuration copies the data to it.
        before = group.configuration().epoch
        group.add("c", c.guard())
        assert group.configuration().epoch == before + 1
        assert state(group, "c").items["order:1"].value == b"paid"
        assert not status_of(group)["c"].behind
    finally:
        group.close()


# A writer in its own process: member b's write never leaves it, a's is announced; the test
# SIGKILLs it there (between the member writes).
HALF_WRITER = """
import asyncio, functools, sqlite3, sys
import redis
import fenced
from fenced.guards.redis import RedisGuard
from fenced.guards.sql import SQLGuard
from fenced.replicated import Group

source, kind, spec_a, spec_b, keyfile = sys.argv[1:6]


class Held:
    def __init__(self, name, inner):
        self.name, self.inner = name, inner

    async def apply(self, token, epoch, items, **kw):
        if items and self.name == "b":
            await asyncio.Event().wait()  # held: the process is killed before it is sent
        await self.inner.apply(token, epoch, items, **kw)
        if items and self.name == "a":
            print("half", flush=True)

    async def read(self, keys=None):
        return await self.inner.read(keys)

    async def aclose(self):
        await self.inner.aclose()


ring = fenced.Keyring([fenced.load_key(keyfile)])


def member(spec):
    if kind == "redis":
        client = redis.Redis(host="127.0.0.1", port=int(spec), socket_timeout=2)
        return RedisGuard(client, "orders", verify=ring)
    connect = functools.partial(sqlite3.connect, spec, check_same_thread=False)
    return SQLGuard("orders", verify=ring).fencer(connect)


guards = {"a": member(spec_a), "b": member(spec_b)}
with fenced.connect(source, signing_key=keyfile) as locks:
    group = Group("orders", locks, guards, timeout=30)
    group.aio._members = {n: Held(n, m) for n, m in group.aio._members.items()}
    with locks.lock("orders", ttl=1) as lease:
        w = group.writer(lease)
        print("token", lease.token, flush=True)
        w.set("order:1", b"paid")
"""


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_reads_after_a_writer_killed_mid_write_are_repaired_under_the_new_fence(
    tmp_path: Path, kind: str, signed: bool
) -> None:
    a, b = replicas(kind, tmp_path, "ab")
    keyfile = tmp_path / "k1.key"
    write_key_file(keyfile, KEY)
    url = f"sqlite:///{tmp_path}/locks.db"
    ring = fenced.Keyring([KEY]) if signed else None
    proc = spawn_python(HALF_WRITER, url, kind, a.spec(), b.spec(), str(keyfile))
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().split()
        assert first[0] == "token", (first, proc.stderr and proc.stderr.read())
        assert proc.stdout.readline().strip() == "half"
        proc.send_signal(signal.SIGKILL)  # between a's write and b's
        proc.wait(10)
        with fenced.connect(url, signing_key=KEY if signed else None) as locks:
            group = Group(
                "orders", locks, {"a": a.guard(verify=ring), "b": b.guard(verify=ring)}, timeout=3
            )
            try:
                assert "order:1" in state(group, "a").items
                assert "order:1" not in state(group, "b").items
                # The dead writer's lease runs out; a new holder fences the group on acquire.
                with locks.lock("orders", ttl=30, fence=[group], timeout=20) as lease:
                    old = fenced.FencingToken.parse(first[1])  # (signed by the source)
                    assert lease.token > old
                    start = time.monotonic()
                    assert group.read("order:1") == b"paid"  # repaired, under lease's fence
                    took = time.monotonic() - start
                    assert took < 2.0, took
                    got = state(group, "b")
                    assert got.items["order:1"].value == b"paid"
                    assert got.token == lease.token.value
                    # The dead writer's token stays refused everywhere.
                    late = Item("order:1", stamp(old.value, 99), b"late")
                    with pytest.raises(fenced.StaleTokenError):
                        group._portal.call(group.aio.member("a").apply(old, 1, [late]))
                    assert group.read("order:1") == b"paid"
            finally:
                group.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        for r in (a, b):
            r.close()


@pytest.mark.parametrize("kind", ["redis", "sqlite"])
def test_signed_members_take_repairs_and_state_transfer_under_the_holders_signed_token(
    tmp_path: Path, locks: fenced.Locks, kind: str
) -> None:
    a, b, c = replicas(kind, tmp_path, "abc")
    ring = fenced.Keyring([KEY])
    group = Group(
        "orders", locks, {"a": a.guard(verify=ring), "b": b.guard(verify=ring)}, timeout=3
    )
    try:
        with locks.lock("orders", ttl=30) as lease:
            group.writer(lease).set("order:1", b"paid")
            # A write that reached a only (as if its writer died there).
            half = Item("order:2", stamp(lease.token.value, 50), b"half")
            group._portal.call(group.aio.member("a").apply(lease.token, 1, [half]))
        # A reader holds no token: the repair presents the one b kept with its mark.
        assert group.read("order:2") == b"half"
        assert state(group, "b").items["order:2"].value == b"half"
        # State transfer to a new member: the same signed token, so its guard takes it.
        group.add("c", c.guard(verify=ring))
        got = state(group, "c")
        assert got.items["order:1"].value == b"paid" and got.token == lease.token.value
        # The other side: an unsigned (forged) token is refused by the same guards, nothing
        # written.
        forged = fenced.FencingToken("orders", lease.token.value + 1000)
        bad = Item("order:1", stamp(forged.value, 1), b"forged")
        with pytest.raises(fenced.SignatureError):
            group._portal.call(group.aio.member("b").apply(forged, 2, [bad]))
        assert group.read("order:1") == b"paid"
    finally:
        group.close()
        for r in (a, b, c):
            r.close()


def test_a_repair_that_cannot_be_signed_fails_at_once_and_says_why(
    tmp_path: Path, locks: fenced.Locks
) -> None:
    a, b = replicas("sqlite", tmp_path, "ab")
    ring = fenced.Keyring([KEY])
    group = Group(
        "orders", locks, {"a": a.guard(verify=ring), "b": b.guard(verify=ring)}, timeout=3
    )
    try:
        with locks.lock("orders", ttl=30) as lease:
            group.writer(lease).set("order:1", b"paid")
            half = Item("order:2", stamp(lease.token.value, 50), b"half")
            group._portal.call(group.aio.member("a").apply(lease.token, 1, [half]))
        # b's mark is raised by a plain guard's fence, outside the group: no signed token at
        # b's mark is kept by any member.
        plain = b.guard(verify=ring)
        fencer = plain.guard.fencer(plain.fencer.connect)
        with locks.lock("orders", ttl=30, fence=[fencer]) as newer:
            start = time.monotonic()
            with pytest.raises(fenced.ReplicationError, match="raised outside the group"):
                group.read("order:2")
            assert time.monotonic() - start < 2.0  # not retried until the deadline
            assert "order:2" not in state(group, "b").items
            # The rightful path: the holder's writer presents its own signed token.
            assert group.writer(newer).read("order:2") == b"half"
            assert state(group, "b").items["order:2"].value == b"half"
    finally:
        group.close()
