"""The etcd token source under faults: a 3-member cluster losing its leader, a paused holder
process, a kill -9 restart, and the two known etcd lock bugs (etcd#11456, etcd#22082).

Each invariant check is also run against a planted bug (a backend variant, or a history with
the bug in it) to show that the check can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import aetcd
import grpc
import pytest
from aetcd import rpc

import fenced
from fenced._clients.etcd_conn import EtcdClient
from fenced._core import clock as _clock
from fenced._core.backend import Grant
from fenced.backends.etcd import (
    EtcdBackend,
    lease_seconds,
    parse_endpoints,
    range_end,
)
from fenced.testing.proxy import TcpProxy
from fenced.testing.servers import EtcdCluster, EtcdServer
from tests.helpers import async_wait_for, dead_port, unique_name, wait_for

NOOP: Callable[[BaseException], None] = lambda exc: None  # noqa: E731


@pytest.fixture
def prefix() -> str:
    return f"/fenced-test/{unique_name('e')}/"


# -- planted bugs ------------------------------------------------------------------------------


class PlainDeleteRelease(EtcdBackend):
    """Planted bug: release deletes the key without comparing its create_revision."""

    def _release_request(self, hold: Any) -> Any:
        delete = rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=hold.key))
        return rpc.TxnRequest(compare=[], success=[delete], failure=[])


class NoOwnKeyCheck(EtcdBackend):
    """Planted bug: the grant only looks for lower keys, not whether our own key still exists."""

    async def _check(self, hold: Any, lock_prefix: bytes, deadline: float | None) -> Any:
        request = rpc.RangeRequest(
            key=lock_prefix,
            range_end=range_end(lock_prefix),
            max_create_revision=hold.revision - 1,
            sort_target=rpc.RangeRequest.CREATE,
            sort_order=rpc.RangeRequest.DESCEND,
            limit=1,
        )
        reply = await self._client.call(lambda m, t: m.kv.Range(request, timeout=t), what="x")
        return (reply.kvs[0] if reply.kvs else None), reply.header.revision


class NoQueue(EtcdBackend):
    """Planted bug: a waiter does not wait for the keys before it (grants at once)."""

    async def _wait(self, *args: Any, **kwargs: Any) -> None:
        return None


async def open_backend(cls: type[EtcdBackend], url: str, prefix: str) -> EtcdBackend:
    backend = await cls.open(urlsplit(url), {"prefix": prefix})
    assert isinstance(backend, cls)
    return backend


# -- a guarded resource and the checker of its history ----------------------------------------


@dataclasses.dataclass(frozen=True)
class Write:
    who: int
    token: int
    phase: str  # "start" or "end" of a critical section
    accepted: bool


class Resource:
    """A guarded resource: the token check and the write are one step under one mutex."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self.high_water = 0
        self.log: list[Write] = []

    def write(self, who: int, token: int, phase: str) -> bool:
        with self._mutex:
            accepted = token >= self.high_water
            if accepted:
                self.high_water = token
            self.log.append(Write(who, token, phase, accepted))
            return accepted

    def grants(self) -> int:
        return sum(1 for w in self.log if w.phase == "start")


def check_history(log: list[Write], lost: set[tuple[int, int]]) -> None:
    """Fail (AssertionError) if the lock let two holders in at once or a token went back.

    * each critical section's token is strictly above the previous section's;
    * no section starts while another client is inside its own, unless that one's lease was
      reported lost (then the guard must reject its late writes);
    * every rejected write comes from a lease that was reported lost.
    """
    inside: dict[int, int] = {}
    last = 0
    for w in log:
        if not w.accepted:
            assert (w.who, w.token) in lost, (
                f"client {w.who}'s write with token {w.token} was rejected, yet its lease "
                "was never reported lost"
            )
        if w.phase == "start":
            assert w.token > last, f"token {w.token} granted after token {last}"
            last = w.token
            overlapping = {
                who: tok for who, tok in inside.items() if who != w.who and (who, tok) not in lost
            }
            assert not overlapping, (
                f"client {w.who} (token {w.token}) entered while {overlapping} held the lock"
            )
            inside[w.who] = w.token
        else:
            inside.pop(w.who, None)


def test_history_checker_catches_planted_histories() -> None:
    ok = [Write(1, 5, "start", True), Write(1, 5, "end", True), Write(2, 9, "start", True)]
    check_history(ok, set())
    overlap = [Write(1, 5, "start", True), Write(2, 9, "start", True), Write(1, 5, "end", False)]
    with pytest.raises(AssertionError, match="entered while"):
        check_history(overlap, set())
    check_history(overlap, {(1, 5)})  # allowed once client 1 was told its lease was lost
    backwards = [Write(1, 9, "start", True), Write(1, 9, "end", True), Write(2, 5, "start", False)]
    with pytest.raises(AssertionError):
        check_history(backwards, set())


def lock_loop(
    who: int,
    url: str,
    name: str,
    resource: Resource,
    stop: threading.Event,
    lost: set[tuple[int, int]],
    errors: list[BaseException],
    ttl: float = 2.0,
    **options: Any,
) -> None:
    """One client: acquire, write at the start and end of the section, release; repeat."""

    def on_lost(lease: fenced.Lease) -> None:
        lost.add((who, lease.token.value))

    try:
        with fenced.connect(url, **options) as locks:
            while not stop.is_set():
                lease = locks.lock(name, ttl=ttl, timeout=30, on_lost=on_lost)
                token = lease.acquire().value
                resource.write(who, token, "start")
                resource.write(who, token, "end")
                if lease.lost.is_set():
                    lost.add((who, token))
                lease.release()
    except BaseException as exc:
        errors.append(exc)


def run_clients(
    n: int, url: str, name: str, resource: Resource, **options: Any
) -> tuple[threading.Event, list[threading.Thread], set[tuple[int, int]], list[BaseException]]:
    stop = threading.Event()
    lost: set[tuple[int, int]] = set()
    errors: list[BaseException] = []
    threads = [
        threading.Thread(
            target=lock_loop,
            args=(i, url, name, resource, stop, lost, errors),
            kwargs=options,
            daemon=True,
        )
        for i in range(n)
    ]
    for t in threads:
        t.start()
    return stop, threads, lost, errors


def test_planted_no_queue_is_caught_by_the_history_check(
    etcd_server: EtcdServer, prefix: str, register_scheme: Callable[[str, str], None]
) -> None:
    register_scheme("etcdplanted", f"{__name__}:NoQueue")
    url = f"etcdplanted://{etcd_server.endpoint}"
    resource = Resource()
    stop, threads, lost, errors = run_clients(3, url, unique_name(), resource, prefix=prefix)
    try:
        wait_for(lambda: resource.grants() >= 60 or errors, 20, "grants")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    with pytest.raises(AssertionError):
        check_history(resource.log, lost)


# -- (1) a 3-member cluster loses its leader ---------------------------------------------------


def member_status(endpoint: str) -> Any:
    with grpc.insecure_channel(endpoint) as channel:
        return rpc.MaintenanceStub(channel).Status(rpc.StatusRequest(), timeout=2)


def find_leader(members: list[EtcdServer]) -> EtcdServer | None:
    for m in members:
        if m.proc is None:
            continue
        with contextlib.suppress(grpc.RpcError):
            st = member_status(m.endpoint)
            if st.leader and st.leader == st.header.member_id:
                return m
    return None


@pytest.mark.slow
def test_cluster_leader_killed_tokens_stay_ordered() -> None:
    with EtcdCluster() as cluster:
        wait_for(lambda: find_leader(cluster.members), 15, "a leader")
        leader = find_leader(cluster.members)
        assert leader is not None
        others = [m for m in cluster.members if m is not leader]
        # Every client starts on the leader, so killing it forces each one to fail over.
        url = "etcd://" + ",".join(m.endpoint for m in [leader, *others])
        name = unique_name()
        ttl = 2.0
        resource = Resource()
        with fenced.connect(url, timeout=1.0) as long_locks:
            long = long_locks.lock(unique_name("long"), ttl=ttl)
            long.acquire()
            stop, threads, lost, errors = run_clients(3, url, name, resource, timeout=1.0)
            try:
                wait_for(lambda: resource.grants() >= 20 or errors, 20, "grants before the kill")
                before = resource.grants()
                killed_at = time.monotonic()
                leader.kill()
                wait_for(lambda: find_leader(others), 15, "a new leader")
                wait_for(
                    lambda: resource.grants() >= before + 20 or errors,
                    20,
                    "grants after the leader was killed",
                )
                # Let the long lease outlive its ttl, so it must have been renewed through a
                # surviving member (or been reported lost).
                threading.Event().wait(max(0.0, killed_at + 2 * ttl - time.monotonic()))
            finally:
                stop.set()
                for t in threads:
                    t.join(30)
            assert not errors, errors
            assert not any(t.is_alive() for t in threads)
            check_history(resource.log, lost)
            assert resource.grants() >= before + 20
            status = long_locks.status(long.name)
            if long.lost.is_set():
                # Lost as the client judges it: the renewal could not be confirmed in time.
                # The conservative judgement may come before etcd's own expiry, so etcd may
                # still list the grant for a moment; what matters is that the client no
                # longer believes it holds the lock.
                assert isinstance(long.lost_cause, fenced.LeaseLostError)
                assert not long.held and long.remaining() == 0
                del status
            else:
                # Survived: renewed through another member, and etcd agrees it still holds.
                assert long.held and long.remaining() > 0
                assert status.token == long.token
                assert long.release() is True


# -- (2) a paused holder process -------------------------------------------------------------

PAUSED_CLIENT = r"""
import sys, fenced
url, prefix, name = sys.argv[1:4]
with fenced.connect(url, prefix=prefix) as locks:
    lease = locks.lock(name, ttl=1)
    print("token", lease.acquire().value, flush=True)
    sys.stdin.readline()  # the parent resumed us
    lost = lease.lost.wait(10)
    print("lost" if lost else "held", type(lease.lost_cause).__name__, flush=True)
    print("release", lease.release(), flush=True)
"""


def test_paused_holder_process_loses_its_lease(etcd_server: EtcdServer, prefix: str) -> None:
    name = unique_name()
    child = subprocess.Popen(
        [sys.executable, "-c", PAUSED_CLIENT, etcd_server.url, prefix, name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline().split()
        assert line[0] == "token", line
        paused_token = int(line[1])
        os.kill(child.pid, signal.SIGSTOP)
        with fenced.connect(etcd_server.url, prefix=prefix) as locks:
            lease = locks.lock(name, ttl=5)
            new_token = lease.acquire(timeout=20).value
            assert new_token > paused_token
            os.kill(child.pid, signal.SIGCONT)
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().split() == ["lost", "LeaseLostError"]
            assert child.stdout.readline().split() == ["release", "False"]
            # The stale holder's release did not touch the new grant.
            assert locks.status(name).token == lease.token and lease.held
            resource = Resource()
            assert resource.write(2, new_token, "start")
            assert not resource.write(1, paused_token, "start")
            assert lease.release() is True
        assert child.wait(10) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGCONT)
        child.kill()
        child.wait()
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()


# -- (3) kill -9 and restart of the single server ---------------------------------------------


def test_restart_reuses_no_token_and_the_holder_survives_or_is_told(
    etcd_server: EtcdServer, prefix: str
) -> None:
    name = unique_name()
    ttl = 3.0
    with fenced.connect(etcd_server.url, prefix=prefix) as locks:
        tokens = []
        for _ in range(3):
            with locks.lock(name, ttl=5) as lease:
                tokens.append(lease.token)
        holder = locks.lock(unique_name("held"), ttl=ttl)
        held_token = holder.acquire()
        etcd_server.restart(kill=True)
        with locks.lock(name, ttl=5, timeout=30) as lease:
            assert lease.token > max(tokens)
            assert lease.token.value > held_token.value  # revisions are global in etcd
        # The held lease outlives its ttl across the restart: renewed, or reported lost.
        threading.Event().wait(ttl)
        status = locks.status(holder.name)
        if holder.lost.is_set():
            assert status.token != held_token
        else:
            assert holder.held and status.token == held_token
            assert holder.release() is True


# -- (4) etcd#11456: a waiter whose lease expired while waiting is not granted ----------------


async def expired_waiter_scenario(cls: type[EtcdBackend], url: str, prefix: str) -> None:
    name = unique_name()
    holder = await open_backend(EtcdBackend, url, prefix)
    waiter = await open_backend(cls, url, prefix)
    third = await open_backend(EtcdBackend, url, prefix)
    host, port = url.removeprefix("etcd://").split(":")
    native = aetcd.Client(host=host, port=int(port))
    try:
        g_holder = await holder.acquire(
            name, request_id="holder", ttl=30, deadline=None, on_lost=NOOP
        )
        task = asyncio.create_task(
            waiter.acquire(
                name, request_id="waiter", ttl=30, deadline=_clock.now() + 20, on_lost=NOOP
            )
        )

        async def queued() -> bool:
            return (await third.status(name)).waiters == 1

        await async_wait_for(queued, 10, "the waiter queued")
        # The waiter's lease expires on the server (what etcd's lessor does at expiry is a
        # revoke), deleting its key, while the waiter itself keeps waiting.
        own = await native.get(f"{prefix}{name}/waiter".encode())
        assert own is not None and own.lease
        await native.revoke_lease(own.lease)
        assert await holder.release(g_holder) is True
        g_waiter = await asyncio.wait_for(task, 20)
        # A grant must be backed by a live key: etcd shows the waiter as holder, with that
        # token, and nobody else can take the lock.
        status = await third.status(name)
        assert status.holder == "waiter" and status.token == g_waiter.token, (
            f"granted {g_waiter.token}, but etcd shows holder {status.holder} {status.token}"
        )
        with pytest.raises(fenced.LockTimeout):
            await third.acquire(name, request_id="third", ttl=5, deadline=0.0, on_lost=NOOP)
        assert await waiter.release(g_waiter) is True
    finally:
        await native.close()
        for b in (holder, waiter, third):
            await b.aclose()


async def test_etcd_11456_expired_waiter_is_not_granted(
    etcd_server: EtcdServer, prefix: str
) -> None:
    await expired_waiter_scenario(EtcdBackend, etcd_server.url, prefix)


async def test_etcd_11456_planted_grant_without_own_key_check_is_caught(
    etcd_server: EtcdServer, prefix: str
) -> None:
    with pytest.raises(AssertionError, match="etcd shows holder"):
        await expired_waiter_scenario(NoOwnKeyCheck, etcd_server.url, prefix)


# -- (5) etcd#22082: a retried release cannot delete a newer holder's key ----------------------


async def retried_release_scenario(cls: type[EtcdBackend], url: str, prefix: str) -> None:
    name = unique_name()
    worker = await open_backend(cls, url, prefix)
    observer = await open_backend(EtcdBackend, url, prefix)
    try:
        # A worker with a stable request id takes the lock and releases it, but the reply to
        # the release is lost, so it will send the release again later.
        first = await worker.acquire(
            name, request_id="worker-1", ttl=10, deadline=None, on_lost=NOOP
        )
        assert await worker.release(first) is True
        # Meanwhile the same worker acquires again: the same key, created anew.
        second = await worker.acquire(
            name, request_id="worker-1", ttl=10, deadline=None, on_lost=NOOP
        )
        assert second.token > first.token
        # The retried release (same request as the first one, old create_revision).
        resent = dataclasses.replace(
            first, handle=dataclasses.replace(first.handle, released=False)
        )
        assert await worker.release(resent) is False, "a retried release deleted a newer grant"
        status = await observer.status(name)
        assert status.token == second.token, "the newer grant is gone"
        assert await worker.release(second) is True
    finally:
        await worker.aclose()
        await observer.aclose()


async def test_etcd_22082_retried_release_keeps_the_newer_grant(
    etcd_server: EtcdServer, prefix: str
) -> None:
    await retried_release_scenario(EtcdBackend, etcd_server.url, prefix)


async def test_etcd_22082_planted_plain_delete_release_is_caught(
    etcd_server: EtcdServer, prefix: str
) -> None:
    with pytest.raises(AssertionError, match="deleted a newer grant"):
        await retried_release_scenario(PlainDeleteRelease, etcd_server.url, prefix)


# -- a release whose first reply is lost ---------------------------------------------------------


@contextlib.asynccontextmanager
async def two_ways(
    etcd_server: EtcdServer, prefix: str
) -> AsyncIterator[tuple[TcpProxy, TcpProxy, EtcdBackend]]:
    """A backend with two ways to one etcd (proxies ``near`` and ``far``, in that order): a
    reply ``near`` drops sends the client's retry through ``far``."""
    with (
        TcpProxy("127.0.0.1", etcd_server.port) as near,
        TcpProxy("127.0.0.1", etcd_server.port) as far,
    ):
        url = f"etcd://127.0.0.1:{near.port},127.0.0.1:{far.port}"
        backend = await EtcdBackend.open(urlsplit(url), {"prefix": prefix, "timeout": 1.0})
        yield near, far, backend


async def lost_reply_release(
    etcd_server: EtcdServer, prefix: str, before: Callable[[Grant], Awaitable[None]] | None = None
) -> bool:
    """Release a grant through two proxies to one etcd; the first attempt goes through the
    first, which passes the request on but drops etcd's reply: the client's retry goes
    through the second. ``before``: what happens to the grant first (another client takes
    its key). The release's answer."""
    async with two_ways(etcd_server, prefix) as (near, far, backend):
        try:
            name = unique_name()
            grant = await backend.acquire(name, request_id="w", ttl=30, deadline=None, on_lost=NOOP)
            if before is not None:
                await before(grant)
            near.drop_replies()
            started = time.monotonic()
            answer = await asyncio.wait_for(backend.release(grant), 15)
            assert time.monotonic() - started < 10  # (one attempt's timeout, then the retry)
            assert near.forwarded and far.forwarded
            return answer
        finally:
            near.heal()
            await backend.aclose()


async def test_a_release_whose_reply_was_lost_is_still_a_release(
    etcd_server: EtcdServer, prefix: str
) -> None:
    """The first attempt deleted the key, its reply was lost; the retry finds the key gone.
    That is this release's own doing (its lease is still alive: the key did not expire):
    True, not a lost lease (it answered False, and the lease core reported a loss)."""
    assert await lost_reply_release(etcd_server, prefix) is True


async def test_a_retried_release_of_a_key_taken_over_stays_false(
    etcd_server: EtcdServer, prefix: str
) -> None:
    """The other side: the grant's lease was revoked (its key gone with it) and another
    client took the key (the same request id): the retried release answers False, and the
    other holder's key stays; and without a new holder (the key gone with its lease): False."""
    host, port = etcd_server.endpoint.split(":")
    native = aetcd.Client(host=host, port=int(port))
    other = await open_backend(EtcdBackend, etcd_server.url, prefix)
    taken: list[Grant] = []

    async def take_over(grant: Grant) -> None:
        await native.revoke_lease(grant.handle.lease.id)
        taken.append(
            await other.acquire(
                grant.token.lock, request_id="w", ttl=30, deadline=None, on_lost=NOOP
            )
        )

    async def revoke(grant: Grant) -> None:
        await native.revoke_lease(grant.handle.lease.id)

    try:
        assert await lost_reply_release(etcd_server, prefix, take_over) is False
        assert (await other.status(taken[0].token.lock)).token == taken[0].token
        assert await other.release(taken[0]) is True
        # Its lease revoked, its key gone with it, nobody else's since: False too.
        assert await lost_reply_release(etcd_server, prefix, revoke) is False
    finally:
        await native.close()
        await other.aclose()


async def test_a_release_asked_again_after_one_that_raised_is_a_release(
    etcd_server: EtcdServer, prefix: str
) -> None:
    """A lease's release reaches etcd (the key is deleted) but every reply is lost until the
    call gives up (BackendUnavailable: outcome unknown, the lease stays releasable). Asked
    again once etcd answers, it finds the key gone by its own doing: True, and no loss is
    reported (it answered False and reported the lease lost when it was released)."""
    with TcpProxy("127.0.0.1", etcd_server.port) as proxy:
        url = f"etcd://127.0.0.1:{proxy.port}"
        async with fenced.connect_async(url, prefix=prefix, timeout=0.5, retry_for=1.0) as locks:
            lease = locks.lock(unique_name(), ttl=30)
            await lease.acquire()
            proxy.drop_replies()
            with pytest.raises(fenced.BackendUnavailable):
                await lease.release()
            proxy.heal()
            assert await lease.release() is True
            assert not lease.lost.is_set(), lease.lost.cause
            assert (await locks.status(lease.name)).holder is None


async def test_a_force_release_whose_reply_was_lost_still_revokes_the_holders_lease(
    etcd_server: EtcdServer, prefix: str
) -> None:
    """A force release's delete reaches etcd, its reply is lost, the client's retry finds the
    key gone: it answered "nothing held" and never revoked the holder's lease, whose
    keepalives went on succeeding (the holder believed it held a lock a new client was then
    granted). Now it names what it released and revokes the lease: the holder's next renewal
    is a loss. The other side: a lock nobody holds is still "nothing held"."""
    holder = await open_backend(EtcdBackend, etcd_server.url, prefix)
    async with two_ways(etcd_server, prefix) as (near, _far, forcer):
        try:
            name = unique_name()
            grant = await holder.acquire(name, request_id="h", ttl=30, deadline=None, on_lost=NOOP)
            await forcer.status(name)  # (its first member's connection made)
            # The replies are dropped from its delete on (the second call it makes: the
            # key's range first), so that the delete itself is the request retried.
            client_call = forcer._client.call
            calls: list[str] = []

            async def call(fn: Any, *, what: str, deadline: float | None = None) -> Any:
                calls.append(what)
                if calls.count("force release") == 2:
                    near.drop_replies()
                return await client_call(fn, what=what, deadline=deadline)

            forcer._client.call = call  # type: ignore[method-assign]
            released = await asyncio.wait_for(forcer.force_release(name), 15)
            near.heal()
            assert released is not None and released.token == grant.token
            with pytest.raises(fenced.LeaseLostError):
                await holder.renew(grant)
            assert await forcer.force_release(name) is None
        finally:
            near.heal()
            await forcer.aclose()
            await holder.aclose()


# -- the rest of the contract ----------------------------------------------------------------


async def test_lock_free_is_one_round_trip_and_ttl_is_rounded_up(
    etcd_server: EtcdServer, prefix: str
) -> None:
    backend = await open_backend(EtcdBackend, etcd_server.url, prefix)
    try:
        name = unique_name()
        sent = _clock.now()
        grant = await backend.acquire(name, request_id="a", ttl=1.2, deadline=None, on_lost=NOOP)
        assert grant.ttl == 2.0 and grant.sent_at <= sent + 1.0
        renewed = await backend.renew(grant)
        assert renewed.sent_at >= grant.sent_at and renewed.ttl == 2.0
        assert await backend.release(grant) is True
        with pytest.raises(fenced.LeaseLostError):
            await backend.renew(grant)
        # The next acquire recycles the lease: the same lease id, no LeaseGrant.
        again = await backend.acquire(name, request_id="b", ttl=1.2, deadline=None, on_lost=NOOP)
        assert again.handle.lease.id == grant.handle.lease.id
        assert again.token > grant.token
        await backend.release(again)
    finally:
        await backend.aclose()


async def test_renew_of_an_expired_lease_is_lease_lost(
    etcd_server: EtcdServer, prefix: str
) -> None:
    backend = await open_backend(EtcdBackend, etcd_server.url, prefix)
    host, port = etcd_server.endpoint.split(":")
    native = aetcd.Client(host=host, port=int(port))
    try:
        grant = await backend.acquire(
            unique_name(), request_id="a", ttl=5, deadline=None, on_lost=NOOP
        )
        await native.revoke_lease(grant.handle.lease.id)
        with pytest.raises(fenced.LeaseLostError):
            await backend.renew(grant)
        assert await backend.release(grant) is False
    finally:
        await native.close()
        await backend.aclose()


async def test_waiters_form_a_chain_each_watching_its_predecessor(
    etcd_server: EtcdServer, prefix: str
) -> None:
    n = 5
    backends = [await open_backend(EtcdBackend, etcd_server.url, prefix) for _ in range(n + 1)]
    name = unique_name()
    try:
        first = await backends[0].acquire(
            name, request_id="w0", ttl=10, deadline=None, on_lost=NOOP
        )
        order: list[int] = []

        async def waiter(i: int) -> None:
            grant = await backends[i].acquire(
                name, request_id=f"w{i}", ttl=10, deadline=_clock.now() + 20, on_lost=NOOP
            )
            order.append(i)
            await backends[i].release(grant)

        tasks = []
        for i in range(1, n + 1):
            tasks.append(asyncio.create_task(waiter(i)))

            async def queued(i: int = i) -> bool:
                hub = backends[i]._client.current.hub()
                return (await backends[0].status(name)).waiters == i and len(hub._active) == 1

            await async_wait_for(queued, 10, f"waiter {i} queued and watching")
        # Each waiter watches only the key just before its own: one watch per waiter.
        watched = [list(b._client.current.hub()._active.values()) for b in backends[1:]]
        assert [len(w) for w in watched] == [1] * n
        keys = [w[0].key.rsplit(b"/", 1)[1] for w in watched]
        assert keys == [f"w{i}".encode() for i in range(n)]
        await backends[0].release(first)
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        assert order == list(range(1, n + 1))
    finally:
        for b in backends:
            await b.aclose()


async def test_waiter_that_times_out_leaves_the_queue(etcd_server: EtcdServer, prefix: str) -> None:
    a = await open_backend(EtcdBackend, etcd_server.url, prefix)
    b = await open_backend(EtcdBackend, etcd_server.url, prefix)
    name = unique_name()
    try:
        held = await a.acquire(name, request_id="a", ttl=10, deadline=None, on_lost=NOOP)
        with pytest.raises(fenced.LockTimeout):
            await b.acquire(name, request_id="b", ttl=10, deadline=_clock.now() + 0.3, on_lost=NOOP)
        assert (await a.status(name)).waiters == 0
        # A cancelled waiter leaves too (in the background).
        task = asyncio.create_task(
            b.acquire(name, request_id="c", ttl=10, deadline=None, on_lost=NOOP)
        )

        async def one_waiter() -> bool:
            return (await a.status(name)).waiters == 1

        await async_wait_for(one_waiter, 10, "waiter queued")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        async def no_waiter() -> bool:
            return (await a.status(name)).waiters == 0

        await async_wait_for(no_waiter, 10, "cancelled waiter gone")
        await a.release(held)
    finally:
        await a.aclose()
        await b.aclose()


async def test_retried_acquire_of_a_waiter_keeps_its_place(
    etcd_server: EtcdServer, prefix: str
) -> None:
    a = await open_backend(EtcdBackend, etcd_server.url, prefix)
    b = await open_backend(EtcdBackend, etcd_server.url, prefix)
    c = await open_backend(EtcdBackend, etcd_server.url, prefix)
    name = unique_name()
    key = f"{prefix}{name}/b".encode()
    try:
        held = await a.acquire(name, request_id="a", ttl=10, deadline=None, on_lost=NOOP)
        first_try = asyncio.create_task(
            b.acquire(name, request_id="b", ttl=10, deadline=None, on_lost=NOOP)
        )

        def waiters(n: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                return (await a.status(name)).waiters == n

            return check

        await async_wait_for(waiters(1), 10, "b queued")
        with grpc.insecure_channel(etcd_server.endpoint) as channel:
            place = rpc.KVStub(channel).Range(rpc.RangeRequest(key=key), timeout=2).kvs[0]
        # b's connection breaks mid-wait (its channels closed under it, not b.aclose(), which
        # gives the place up): the acquire fails as unreachable and leaves its key (a retry
        # may come); the retry, over another connection, takes the same key back.
        await b._client.close()
        with pytest.raises(fenced.BackendUnavailable):
            await asyncio.wait_for(first_try, 10)
        retry = asyncio.create_task(
            c.acquire(name, request_id="b", ttl=10, deadline=_clock.now() + 20, on_lost=NOOP)
        )
        await async_wait_for(waiters(1), 10, "still one waiter")
        await a.release(held)
        grant = await asyncio.wait_for(retry, 20)
        assert grant.token.value == place.create_revision  # the same place in the queue
        assert (await a.status(name)).holder == "b"
        assert await c.release(grant) is True
    finally:
        for x in (a, b, c):
            await x.aclose()


async def _a_holds_and_b_waits(
    a: EtcdBackend, b: EtcdBackend, name: str
) -> tuple[Grant, asyncio.Task[Grant]]:
    """``a`` holds ``name``; ``b``'s acquire (no deadline) is queued behind it."""
    held = await a.acquire(name, request_id="a", ttl=10, deadline=None, on_lost=NOOP)
    task = asyncio.create_task(b.acquire(name, request_id="b", ttl=10, deadline=None, on_lost=NOOP))

    async def queued() -> bool:
        return (await a.status(name)).waiters == 1

    await async_wait_for(queued, 10, "b queued")
    return held, task


async def test_closing_under_a_waiter_is_backend_unavailable(
    etcd_server: EtcdServer, prefix: str
) -> None:
    a = await open_backend(EtcdBackend, etcd_server.url, prefix)
    b = await open_backend(EtcdBackend, etcd_server.url, prefix)
    name = unique_name()
    try:
        held, task = await _a_holds_and_b_waits(a, b, name)
        await b.aclose()
        # gRPC cancels the calls of a closed channel with CancelledError: that must surface
        # as the typed error, not as a cancellation of the caller's task.
        with pytest.raises(fenced.BackendUnavailable):
            await asyncio.wait_for(task, 10)
        with pytest.raises(fenced.BackendUnavailable):
            await b.status(name)
        # b's place in the queue went with it: the closed connection is not granted the
        # lock when a releases (it was, blocking live clients for b's ttl)
        assert (await a.status(name)).waiters == 0
        await a.release(held)
        await _granted_at_once(a, name, held.token.value)
    finally:
        await a.aclose()
        await b.aclose()


async def _granted_at_once(a: EtcdBackend, name: str, above: int) -> None:
    """A live acquire gets the free lock within 2 s, with a higher token (both sides)."""
    deadline = _clock.now() + 2.0
    grant = await a.acquire(name, request_id="next", ttl=10, deadline=deadline, on_lost=NOOP)
    assert grant.token.value > above
    assert await a.release(grant) is True


async def test_closing_right_after_a_waiter_was_cancelled_leaves_no_queue_key(
    etcd_server: EtcdServer, prefix: str
) -> None:
    """A cancelled waiter leaves the queue in the background; closing the client cancelled
    that leave and the key stayed for its lease's ttl. aclose deletes it first."""
    a = await open_backend(EtcdBackend, etcd_server.url, prefix)
    b = await open_backend(EtcdBackend, etcd_server.url, prefix)
    name = unique_name()
    try:
        held, task = await _a_holds_and_b_waits(a, b, name)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await b.aclose()
        assert (await a.status(name)).waiters == 0
        await a.release(held)
        await _granted_at_once(a, name, held.token.value)
    finally:
        await a.aclose()
        await b.aclose()


def test_sync_close_under_waiting_threads_leaves_the_lock_to_live_clients(
    etcd_server: EtcdServer, prefix: str
) -> None:
    """The attacker's repro: a connection's threads wait (no timeout, and a 5 s one); the
    connection is closed under them. They get BackendUnavailable, their keys are gone at once,
    and the next live acquire gets the lock as soon as the holder releases."""
    url = etcd_server.url
    name = unique_name()
    with fenced.connect(url, prefix=prefix) as holder:
        h = holder.lock(name, ttl=10)
        h.acquire()
        locks = fenced.connect(url, prefix=prefix)
        errors: list[BaseException] = []

        def waiter(timeout: float | None) -> None:
            try:
                locks.lock(name, ttl=10).acquire(timeout=timeout)
            except BaseException as exc:  # (the test looks at it)
                errors.append(exc)

        threads = [threading.Thread(target=waiter, args=(t,)) for t in (None, 5.0)]
        for t in threads:
            t.start()
        wait_for(lambda: holder.status(name).waiters == 2, 10, "two waiters")
        locks.close()
        for t in threads:
            t.join(10)
        assert [type(e) for e in errors] == [fenced.BackendUnavailable] * 2
        assert holder.status(name).waiters == 0
        token = h.token
        h.release()
        nxt = holder.lock(name, ttl=10)
        nxt.acquire(timeout=2.0)
        assert token is not None and nxt.token is not None and nxt.token.value > token.value
        nxt.release()


async def test_a_channel_closed_under_a_call_is_not_a_cancellation(
    etcd_server: EtcdServer,
) -> None:
    client = EtcdClient([etcd_server.endpoint], timeout=2.0, retry_for=5.0)
    attempts: list[asyncio.Event] = []

    async def first_hangs(member: Any, timeout: float) -> Any:
        started = asyncio.Event()
        attempts.append(started)
        if len(attempts) == 1 or (client.closed is False and len(attempts) == 3):
            call = member.watch_stub.Watch()
            started.set()
            return await call.read()  # never answers
        return await member.kv.Range(rpc.RangeRequest(key=b"x"), timeout=timeout)

    try:
        # A failover reset closes the channel under the call: it is retried, not cancelled.
        task = asyncio.create_task(client.call(first_hangs, what="test"))
        await async_wait_for(_is_set(attempts, 0), 5, "first attempt")
        await client.members[0].reset()
        reply = await asyncio.wait_for(task, 10)
        assert reply.header.revision > 0 and len(attempts) == 2
        # aclose under a call: the typed error.
        task = asyncio.create_task(client.call(first_hangs, what="test"))
        await async_wait_for(_is_set(attempts, 2), 5, "third attempt")
        await client.close()
        with pytest.raises(fenced.BackendUnavailable):
            await asyncio.wait_for(task, 10)
    finally:
        await client.close()


def _is_set(events: list[asyncio.Event], i: int) -> Callable[[], Any]:
    async def check() -> bool:
        return len(events) > i and events[i].is_set()

    return check


def test_failover_past_a_dead_endpoint(etcd_server: EtcdServer, prefix: str) -> None:
    with dead_port() as dead:
        url = f"etcd://127.0.0.1:{dead},{etcd_server.endpoint}"
        with fenced.connect(url, prefix=prefix) as locks, locks.lock(unique_name(), ttl=5) as lease:
            assert lease.held


def test_unreachable_cluster_is_backend_unavailable() -> None:
    with dead_port() as dead, pytest.raises(fenced.BackendUnavailable):
        start = time.monotonic()
        fenced.connect(f"etcd://127.0.0.1:{dead}", retry_for=0.5, connect_timeout=1.5)
    assert 1.4 < time.monotonic() - start < 5  # retried until connect_timeout, not beyond


def test_url_and_options() -> None:
    assert parse_endpoints(urlsplit("etcd://a:1,b,[::1]:3")) == ["a:1", "b:2379", "[::1]:3"]
    assert parse_endpoints(urlsplit("etcd3+http://h:2")) == ["h:2"]
    for bad in [
        "etcd+https://h:1",
        "etcd://u:p@h:1",
        "etcd://h:0",
        "etcd://h:x",
        "etcd://h:1,,h:2",
        "etcd://h:1/path",
    ]:
        with pytest.raises(fenced.ConfigurationError):
            parse_endpoints(urlsplit(bad))
    for options in [{"bogus": 1}, {"timeout": 0}, {"prefix": ""}, {"lease_pool": -1}]:
        with pytest.raises(fenced.ConfigurationError):
            fenced.connect("etcd://127.0.0.1:1", **options)
    with pytest.raises(fenced.ConfigurationError):
        fenced.connect("etcd://127.0.0.1:1?nope=1")
    assert lease_seconds(0.2) == 1 and lease_seconds(1.0) == 1 and lease_seconds(1.01) == 2
    with pytest.raises(fenced.ConfigurationError):
        lease_seconds(1e12)


def test_options_in_the_query_string(etcd_server: EtcdServer, prefix: str) -> None:
    url = f"{etcd_server.url}?prefix={prefix}&timeout=1.5&lease_pool=0"
    name = unique_name()
    with fenced.connect(url) as locks, locks.lock(name, ttl=5):
        key = f"{prefix}{name}/".encode()
        with grpc.insecure_channel(etcd_server.endpoint) as channel:
            reply = rpc.KVStub(channel).Range(
                rpc.RangeRequest(key=key, range_end=range_end(key)), timeout=2
            )
        assert reply.count == 1


# -- review: failover replays and cancelled acquires -------------------------------------

NOOP: Callable[[BaseException], None] = lambda exc: None  # noqa: E731


# -- etcd: a create transaction replayed by the failover -----------------------------------


class LosesFirstAcquireReply(EtcdBackend):
    """A real etcd whose reply to the first acquire transaction is lost after it was applied.

    etcd answers "request timed out" when a proposal was not confirmed in time although it may
    still be applied; the transport then replays the transaction (on the next member). This
    variant applies the transaction for real and then reports exactly that.
    """

    lose = 1

    async def _txn(self, request: Any, what: str, deadline: float | None = None) -> Any:
        if what != "acquire" or self.lose <= 0:
            return await super()._txn(request, what, deadline)
        self.lose -= 1
        attempts = 0

        async def applied_then_lost(member: Any, timeout: float) -> Any:
            nonlocal attempts
            attempts += 1
            reply = await member.kv.Txn(request, timeout=timeout)
            if attempts == 1:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    details="etcdserver: request timed out",
                )
            return reply

        return await self._client.call(applied_then_lost, what=what, deadline=deadline)


async def _open_etcd(cls: type[EtcdBackend], server: EtcdServer, prefix: str) -> EtcdBackend:
    backend = await cls.open(urlsplit(server.url), {"prefix": prefix})
    assert isinstance(backend, cls)
    return backend


async def test_etcd_replayed_create_does_not_pool_the_holders_lease(
    etcd_server: EtcdServer,
) -> None:
    """The replayed create finds the key its first attempt made, bound to *this* lease.

    Bug: it took that for "the key exists already, this lease is unused", put the lease (which
    the held key is bound to) into the reuse pool and adopted the key as someone else's lease.
    The next acquire on the connection then bound its key to the same lease, and releasing
    the first lock revoked that lease (an adopted one is not recycled): the second lock was
    freed under a holder that still counted on it.
    """
    prefix = f"/fenced-review/{unique_name('e')}/"
    backend = await _open_etcd(LosesFirstAcquireReply, etcd_server, prefix)
    observer = await _open_etcd(EtcdBackend, etcd_server, prefix)
    first_lock, second_lock = unique_name(), unique_name()
    try:
        first = await backend.acquire(
            first_lock, request_id="a", ttl=10, deadline=None, on_lost=NOOP
        )
        assert (await observer.status(first_lock)).holder == "a"
        second = await backend.acquire(
            second_lock, request_id="b", ttl=10, deadline=None, on_lost=NOOP
        )
        assert await backend.release(first) is True
        status = await observer.status(second_lock)
        assert status.holder == "b", "releasing one lock freed another lock's holder"
        assert second.handle.lease.id != first.handle.lease.id, "two held keys shared a lease"
        await backend.renew(second)
        assert await backend.release(second) is True
    finally:
        await backend.aclose()
        await observer.aclose()


class SlowAcquireReply(EtcdBackend):
    """A real etcd whose reply to the acquire transaction is slow to come back: the
    transaction is applied at once, and the caller is held up until released by the test."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.applied = asyncio.Event()
        self.reply = asyncio.Event()

    async def _txn(self, request: Any, what: str, deadline: float | None = None) -> Any:
        reply = await super()._txn(request, what, deadline)
        if what == "acquire":
            self.applied.set()
            await self.reply.wait()
        return reply


async def test_etcd_acquire_cancelled_in_flight_leaves_no_key_behind(
    etcd_server: EtcdServer,
) -> None:
    """An acquire cancelled while its create transaction is in flight (applied, reply not yet
    read) must not leave its key to block the lock until the lease's ttl runs out.

    Bug: only a LockTimeout revoked the lease; after a cancellation the key stayed at the
    head of the queue, held by nobody, for the whole ttl (here 30 s).
    """
    prefix = f"/fenced-review/{unique_name('e')}/"
    slow = await _open_etcd(SlowAcquireReply, etcd_server, prefix)
    other = await _open_etcd(EtcdBackend, etcd_server, prefix)
    name = unique_name()
    try:
        task = asyncio.create_task(
            slow.acquire(name, request_id="gone", ttl=30, deadline=None, on_lost=NOOP)
        )
        await _bounded(slow.applied.wait())
        assert (await other.status(name)).holder == "gone"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The lock is free again well before the 30 s ttl.
        grant = await _bounded(
            other.acquire(name, request_id="next", ttl=5, deadline=None, on_lost=NOOP), 5.0
        )
        assert await other.release(grant) is True
    finally:
        await slow.aclose()
        await other.aclose()


async def _bounded(aw: Awaitable[Any], seconds: float = 10.0) -> Any:
    return await asyncio.wait_for(aw, seconds)


pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def test_grpc_fork_support_is_off_unless_the_user_chose(etcd_server: EtcdServer) -> None:
    """gRPC's fork support runs its handlers around every fork of the process — pausing the
    parent's channels, and now and then running gRPC's poller in the child before exec (one
    fork in ~300 here; a test server started that way once never ran). fenced refuses gRPC in
    forked children anyway, so it turns that support off before gRPC is imported, and keeps
    a value the user set. A process holding an etcd lease then forks (a real ``fork()``:
    subprocess with ``group=``, as the test servers are started) without gRPC's handlers
    running, and keeps its lease; with the user's "true" they run (the check can fail)."""
    script = textwrap.dedent(
        f"""
        import os, subprocess, threading
        import fenced
        with fenced.connect({etcd_server.url!r}) as locks:  # (imports gRPC)
            from grpc._cython import cygrpc
            print(os.environ.get("GRPC_ENABLE_FORK_SUPPORT"), cygrpc._GRPC_ENABLE_FORK_SUPPORT)
            lease = locks.lock("fork-support", ttl=10)
            lease.acquire()
            stop = threading.Event()
            def churn():
                while not stop.is_set():
                    locks.status("fork-support")
            t = threading.Thread(target=churn)
            t.start()
            failed = 0
            for _ in range(100):
                child = subprocess.run(["true"], group=os.getgid(), timeout=30)
                failed += child.returncode != 0
            stop.set()
            t.join()
            print("held", lease.held, "failed children", failed)
            lease.release()
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    env["GRPC_VERBOSITY"] = "INFO"  # (gRPC logs its fork handlers' work)

    def run(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", script],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )

    off = run()
    assert off.returncode == 0, off.stderr[-2000:]
    assert off.stdout.split("\n")[:2] == ["false False", "held True failed children 0"], (
        off.stdout + off.stderr[-2000:]
    )
    assert "fork_posix" not in off.stderr, off.stderr[-2000:]
    on = run(GRPC_ENABLE_FORK_SUPPORT="true")
    assert on.stdout.startswith("true True"), on.stdout + on.stderr[-2000:]
    assert "fork_posix" in on.stderr, on.stderr[-2000:]
