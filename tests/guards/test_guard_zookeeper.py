"""ZooKeeper as the fenced resource (Junqueira's note), beyond the guard conformance suite: a
holder whose session expired and that kazoo quietly gave a new one is still refused; the
reserved subtree; corrupt marks fail closed; create/delete; a kill -9 of the server; asyncio;
fence on acquire with a real lock."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient, KazooState

import fenced
from fenced import FencingToken
from fenced.guards.zookeeper import AsyncZooKeeperGuard, ZooKeeperGuard
from fenced.testing.servers import ZooKeeperServer
from tests.guards.processes import history_violations, race
from tests.helpers import unique_name, wait_for


def tok(value: int) -> FencingToken:
    return FencingToken("master", value)


@pytest.fixture
def clients(zk_server: ZooKeeperServer) -> Iterator[Any]:
    made: list[KazooClient] = []

    def connect() -> KazooClient:
        client = KazooClient(hosts=zk_server.hosts)
        client.start(timeout=20)
        made.append(client)
        return client

    yield connect
    for c in made:
        c.stop()
        c.close()


def close_session(hosts: str, client_id: tuple[int, bytes]) -> None:
    """End session ``client_id`` from outside: a twin takes it over and closes it, until a
    twin finds it gone. (Once is not enough: the holder's reconnection may move the session
    back before the twin's close, and a twin no longer connected closes nothing.)"""
    for _ in range(20):
        twin = KazooClient(hosts=hosts, client_id=client_id)
        twin.start(timeout=20)
        try:
            if twin.client_id[0] != client_id[0]:
                return  # the server knew it no more: a new session was made
        finally:
            twin.stop()
            twin.close()
    raise AssertionError(f"session {client_id[0]:#x} still open after 20 closes")


@pytest.fixture
def resource() -> str:
    return unique_name("res")


def test_a_holder_on_a_new_session_is_refused_like_on_its_old_one(
    zk_server: ZooKeeperServer, clients: Any, resource: str
) -> None:
    """The note's caution: a client whose session expired (paused, cut off) and which kazoo
    silently reconnected with a new session must not slip past the fence."""
    old_client, new_client = clients(), clients()
    old = ZooKeeperGuard(old_client, resource, lock="master")
    new = ZooKeeperGuard(new_client, resource, lock="master")
    old.set(f"/app/{resource}/plan", b"old plan", token=tok(1))
    states: list[str] = []
    old_client.add_listener(states.append)
    first_session = old_client.client_id[0]
    # expire the old holder's session from outside, as the server does after a long pause
    close_session(zk_server.hosts, old_client.client_id)
    wait_for(lambda: KazooState.LOST in states, 30, "the old session to expire")
    new.fence(tok(2))  # the next master fences before anything else
    wait_for(
        lambda: old_client.connected and old_client.client_id[0] != first_session,
        30,
        "kazoo to reconnect the old holder with a new session",
    )
    with pytest.raises(fenced.StaleTokenError) as stale:
        old.set(f"/app/{resource}/plan", b"stale plan", token=tok(1))
    assert stale.value.high_water == tok(2)
    new.set(f"/app/{resource}/plan", b"new plan", token=tok(2))
    assert new_client.get(f"/app/{resource}/plan")[0] == b"new plan"


def test_the_reserved_subtree_and_bad_input(clients: Any, resource: str) -> None:
    client = clients()
    guard = ZooKeeperGuard(client, resource, lock="master")
    other = ZooKeeperGuard(client, "other-" + resource, lock="master")
    other.fence(tok(50))
    for path in ("/fenced", other.mark_path, guard.mark_path, "/fenced/anything"):
        with pytest.raises(fenced.ConfigurationError, match="reserved"):
            guard.set(path, b"x", token=tok(99))
    assert other.high_water() == tok(50)  # another resource's mark untouched
    for path in ("relative", "/trailing/", "", 5):
        with pytest.raises(fenced.ConfigurationError):
            guard.set(path, b"x", token=tok(1))  # type: ignore[arg-type]
    with pytest.raises(fenced.ConfigurationError, match="bytes"):
        guard.set("/x", "text", token=tok(1))  # type: ignore[arg-type]
    with pytest.raises(fenced.InvalidTokenError):
        guard.set("/x", b"x", token="master:0")
    with pytest.raises(fenced.WrongLockError):
        guard.set("/x", b"x", token=FencingToken("another", 5))
    with pytest.raises(fenced.ConfigurationError):
        ZooKeeperGuard(client, resource, root="fenced")
    with pytest.raises(fenced.ConfigurationError):
        ZooKeeperGuard(client, "", lock="master")


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b"master",
        b"master\n-000000000000000005",
        b"master\n0000000000000000000",
        b"master\n+000000000000000005",
        b"master\n5",
        b"\xff\n0000000000000000005",
        b"master\n0000000000000000005\n",
    ],
)
def test_a_corrupt_mark_refuses_every_write(clients: Any, resource: str, damage: bytes) -> None:
    client = clients()
    guard = ZooKeeperGuard(client, resource, lock="master")
    guard.set(f"/app/{resource}", b"kept", token=tok(5))
    client.set(guard.mark_path, damage)
    for value in (1, 5, 10**6):
        with pytest.raises(fenced.CorruptMarkError):
            guard.set(f"/app/{resource}", b"overwritten", token=tok(value))
    assert client.get(f"/app/{resource}")[0] == b"kept"


def test_create_and_delete_are_fenced_too(clients: Any, resource: str) -> None:
    client = clients()
    guard = ZooKeeperGuard(client, resource, lock="master")
    client.ensure_path(f"/app/{resource}")
    path = f"/app/{resource}/job"
    guard.create(path, b"1", token=tok(3))
    with pytest.raises(fenced.ConfigurationError, match="exists"):
        guard.create(path, b"2", token=tok(3))
    with pytest.raises(fenced.StaleTokenError):
        guard.delete(path, token=tok(2))
    assert client.exists(path) is not None  # refused: nothing deleted
    guard.delete(path, token=tok(4))
    assert client.exists(path) is None
    with pytest.raises(fenced.ResourceNotFoundError):
        guard.delete(path, token=tok(4))
    assert guard.high_water() == tok(4)


def test_the_mark_survives_kill_9_of_the_server(tmp_path: Path) -> None:
    with ZooKeeperServer(str(tmp_path / "zk")) as server:
        client = KazooClient(hosts=server.hosts)
        client.start(timeout=20)
        guard = ZooKeeperGuard(client, "jobs", lock="master")
        guard.set("/jobs/plan", b"v10", token=tok(10))
        client.stop()
        client.close()
        server.restart(kill=True)
        client = KazooClient(hosts=server.hosts)
        client.start(timeout=30)
        try:
            guard = ZooKeeperGuard(client, "jobs", lock="master")
            with pytest.raises(fenced.StaleTokenError):
                guard.set("/jobs/plan", b"v9", token=tok(9))
            guard.set("/jobs/plan", b"v10b", token=tok(10))
            assert client.get("/jobs/plan")[0] == b"v10b"
        finally:
            client.stop()
            client.close()


def test_the_async_guard_is_the_same_code(clients: Any, resource: str) -> None:
    guard = AsyncZooKeeperGuard(clients(), resource, lock="master")

    async def go() -> None:
        await guard.set(f"/app/{resource}", b"a", token=tok(2))
        with pytest.raises(fenced.StaleTokenError):
            await guard.set(f"/app/{resource}", b"b", token=tok(1))
        await guard.fence(tok(3))
        assert await guard.high_water() == tok(3)

    asyncio.run(go())


def test_fence_on_acquire_raises_the_znode_mark(
    clients: Any, resource: str, tmp_path: Path
) -> None:
    guard = ZooKeeperGuard(clients(), resource, lock="master")
    with fenced.connect(f"sqlite:///{tmp_path}/locks.db") as locks:
        with locks.lock("master", ttl=5, fence=[guard]) as first:
            assert guard.high_water() == first.token
        with locks.lock("master", ttl=5, fence=[guard]) as second:
            assert guard.high_water() == second.token
            with pytest.raises(fenced.StaleTokenError):
                guard.set(f"/app/{resource}", b"late", token=first.token)


def test_racing_processes_commit_tokens_in_order(zk_server: ZooKeeperServer, clients: Any) -> None:
    """Four processes offer interleaved tokens as fast as they can; each accepted write also
    appends its token to a sequential znode in the same multi: ZooKeeper's own order."""
    resource = unique_name("race")
    accepted = race(f"zookeeper:{zk_server.hosts}", resource, writers=4, per_writer=25)
    client = clients()
    children = sorted(client.get_children(f"/log/{resource}"))
    log = [int(client.get(f"/log/{resource}/{c}")[0]) for c in children]
    data = client.get(f"/data/{resource}")[0].decode()
    assert sum(accepted) == len(log) > 0
    assert history_violations(log, data) == []


def test_a_transaction_of_your_own_is_fenced_and_kept_out_of_the_marks(
    clients: Any, resource: str
) -> None:
    client = clients()
    guard = ZooKeeperGuard(client, resource, lock="master")
    client.ensure_path(f"/app/{resource}")
    guard.transaction(lambda t: t.create(f"/app/{resource}/a", b"1"), token=tok(2))
    with pytest.raises(fenced.StaleTokenError):
        guard.transaction(lambda t: t.create(f"/app/{resource}/b", b"1"), token=tok(1))
    assert client.exists(f"/app/{resource}/b") is None
    with pytest.raises(fenced.ConfigurationError, match="reserved"):
        guard.transaction(lambda t: t.set_data(guard.mark_path, b"x"), token=tok(2))


def test_no_guard_reaches_a_mark_whatever_its_root_or_chroot(
    zk_server: ZooKeeperServer, clients: Any, resource: str
) -> None:
    """Marks under a chroot and under a custom root, attacked through the guarded writes of
    guards with other roots and other chroots (the transaction too): all refused, the marks
    unchanged, a stale token still refused; writes outside fenced's nodes still accepted."""
    tenant = f"/{unique_name('tenant')}"
    plain = clients()
    plain.ensure_path(tenant)
    plain.ensure_path(f"{tenant}/myroot")
    chrooted = KazooClient(hosts=zk_server.hosts + tenant)
    chrooted.start(timeout=20)
    deep = KazooClient(hosts=zk_server.hosts + f"{tenant}/myroot/marks")
    try:
        owner = ZooKeeperGuard(chrooted, resource, lock="master")  # /fenced under the chroot
        custom = ZooKeeperGuard(chrooted, resource, lock="master", root="/myroot")
        owner.fence(tok(5))
        custom.fence(tok(5))
        deep.start(timeout=20)
        attacker = ZooKeeperGuard(plain, "att-" + resource, lock="master", root="/other")
        deep_attacker = ZooKeeperGuard(deep, "att-" + resource, lock="master", root="/elsewhere")
        own_mark = f"{tenant}{owner.mark_path}"  # absolute: the chroot prepended
        custom_mark = f"{tenant}{custom.mark_path}"
        refused: list[tuple[ZooKeeperGuard, str]] = [
            (attacker, own_mark),
            (attacker, custom_mark),
            (attacker, "/" + own_mark.replace("/", "//")),  # kazoo collapses '//'
            (attacker, f"{tenant}/myroot/marks/r-new"),  # a mark of a resource not yet fenced
            (attacker, "/fenced/locks/jobs"),  # the lock source's nodes
            (deep_attacker, "/" + custom.mark_path.rsplit("/", 1)[1]),  # chroot .../marks
            (owner, owner.mark_path),  # its own root, through the chroot
            (owner, "/" + owner.mark_path),
            (custom, "/fenced/marks/r-x"),  # the default root's namespace, from another root
        ]
        for guard, path in refused:
            with pytest.raises(fenced.ConfigurationError, match="reserved"):
                guard.delete(path, token=tok(9))
            with pytest.raises(fenced.ConfigurationError, match="reserved"):
                guard.set(path, b"master\n0000000000000000001", token=tok(9))
            with pytest.raises(fenced.ConfigurationError, match="reserved"):
                guard.create(path + "x", b"", token=tok(9))
            with pytest.raises(fenced.ConfigurationError, match="reserved"):
                guard.transaction(lambda t, p=path: t.delete(p), token=tok(9))
            with pytest.raises(fenced.ConfigurationError, match="reserved"):
                guard.transaction(
                    lambda t, p=path: (t.create(f"{tenant}-ok"), t.set_data(p, b"x")),
                    token=tok(9),
                )
        assert plain.exists(f"{tenant}-ok") is None  # a refused transaction sends nothing
        for guard in (owner, custom):
            assert guard.high_water() == tok(5)
            with pytest.raises(fenced.StaleTokenError):
                guard.set("/app/plan", b"stale", token=tok(4))
        # the rightful writes: the owners' own, and the attackers' outside fenced's nodes
        owner.set("/app/plan", b"v5", token=tok(5))
        assert plain.get(f"{tenant}/app/plan")[0] == b"v5"
        for path in (f"{tenant}/app/marks/plan", f"{tenant}/app/markers/r-1", "/fencedx/r-1"):
            attacker.set(path, b"ok", token=tok(9))
            assert plain.get(path)[0] == b"ok"
        attacker.transaction(lambda t: t.delete(f"{tenant}/app/marks/plan"), token=tok(9))
        assert plain.exists(f"{tenant}/app/marks/plan") is None
        deep_attacker.set("/data", b"ok", token=tok(3))
        assert plain.get(f"{tenant}/myroot/marks/data")[0] == b"ok"
    finally:
        for c in (chrooted, deep):
            c.stop()
            c.close()


def test_a_mark_deleted_after_the_guard_saw_it_is_corrupt(clients: Any, resource: str) -> None:
    """Deleted outside fenced, the mark would restart below the tokens already accepted: the
    guard that saw it refuses every write (and high_water) instead of creating it again."""
    client = clients()
    guard = ZooKeeperGuard(client, resource, lock="master")
    guard.set(f"/app/{resource}", b"v5", token=tok(5))
    client.delete(guard.mark_path)
    for value in (3, 5, 6):
        with pytest.raises(fenced.CorruptMarkError, match="gone"):
            guard.set(f"/app/{resource}", b"late", token=tok(value))
    with pytest.raises(fenced.CorruptMarkError):
        guard.high_water()
    assert client.get(f"/app/{resource}")[0] == b"v5"
    assert client.exists(guard.mark_path) is None  # not recreated
    # an operator's repair (the mark set to at least the highest token) lets writes in again
    client.create(guard.mark_path, b"master\n0000000000000000006")
    with pytest.raises(fenced.StaleTokenError):
        guard.set(f"/app/{resource}", b"late", token=tok(5))
    guard.set(f"/app/{resource}", b"v6", token=tok(6))
    assert client.get(f"/app/{resource}")[0] == b"v6"


def test_a_mark_created_again_lower_is_corrupt(clients: Any, resource: str) -> None:
    """Deleted outside fenced and bound again by a guard that never saw it (a new process),
    the mark is lower than the first guard saw: it refuses instead of taking the low mark."""
    client = clients()
    seen = ZooKeeperGuard(client, resource, lock="master")
    seen.set(f"/app/{resource}", b"v5", token=tok(5))
    client.delete(seen.mark_path)
    fresh = ZooKeeperGuard(client, resource, lock="master")  # cannot know: binds the mark at 2
    fresh.set(f"/app/{resource}", b"v2", token=tok(2))
    with pytest.raises(fenced.CorruptMarkError, match="went back"):
        seen.set(f"/app/{resource}", b"late", token=tok(3))
    with pytest.raises(fenced.CorruptMarkError):
        seen.high_water()
    assert client.get(f"/app/{resource}")[0] == b"v2"


def test_a_write_landing_while_a_read_is_on_its_way_is_no_step_back(
    clients: Any, resource: str
) -> None:
    """Two threads on one guard: the one writing 104 reads the mark (103), and the other's
    105 is accepted while that read's answer is on its way. The read then shows 103 below
    the 105 this guard saw accepted — not a mark that went back (found by the racing
    writers of the conformance suite: CorruptMarkError, a rightful writer refused). 104 is
    refused as stale, 105 stays, and a real step back is still caught."""
    client = clients()
    ZooKeeperGuard(client, resource, lock="master").fence(tok(103))
    guard = ZooKeeperGuard(client, resource, lock="master")  # (it reads before it writes)
    real_get, landed = client.get, []

    def get(path: str, *args: Any, **kwargs: Any) -> Any:
        answer = real_get(path, *args, **kwargs)
        if not landed and path == guard.mark_path:
            landed.append(True)
            guard.fence(tok(105))  # (the other thread's write, between the read and its use)
        return answer

    client.get = get
    try:
        with pytest.raises(fenced.StaleTokenError):
            guard.fence(tok(104))
    finally:
        del client.get
    assert landed and guard.high_water() == tok(105)
    # A real step back (the node set lower behind fenced's back) is still refused.
    client.set(guard.mark_path, real_get(guard.mark_path)[0].replace(b"105", b"101"))
    with pytest.raises(fenced.CorruptMarkError, match="went back to 101"):
        guard.fence(tok(106))
