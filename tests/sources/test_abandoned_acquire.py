"""An acquire given up after the source was unreachable leaves no dead waiter behind.

A source keeps a waiter's place (or a grant whose reply was lost) across an unavailable
attempt, for the lease core's retry with the same request id. When that retry never comes
(the caller is cancelled in the back-off), the place must go at once: else the lock is
handed to a waiter that has gone, and held from live ones for its whole ttl.

Real servers, a user-space TCP proxy for the blip (its connections reset while it refuses
new ones), real asyncio cancellation: the victim is cancelled exactly in the lease core's
back-off sleep (from the debug line the core logs just before it), with the proxy healed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import fenced
from fenced.testing.proxy import TcpProxy
from fenced.testing.servers import (
    EtcdServer,
    FencedServer,
    PostgresServer,
    RedisServer,
    ZooKeeperServer,
)
from tests.helpers import async_wait_for, unique_name
from tests.sources.envs._http import make_http_env

VICTIM_TTL = 20.0
"""The dead waiter's ttl: what a live waiter waited before the fix (the lock was handed to
the dead waiter and held for it)."""
BOUND = 3.0
"""How long the live waiter may wait after the holder releases: the clean-up is one round
trip (ABANDON_WAIT 0.25 s, then on in the background), the hand-off another; 3 s leaves
room for a loaded 2-core machine and stays far below VICTIM_TTL."""


class OnRetry(logging.Handler):
    """Runs ``action`` on the lease core's "source unavailable, retrying" line for ``name``:
    it is logged in the acquiring task right before its back-off sleep, so a cancellation made
    here lands in that sleep."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.DEBUG)
        self.name_ = name
        self.action: Callable[[], None] | None = None
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "source unavailable, retrying" not in record.getMessage():
            return
        if record.args and record.args[0] != self.name_:  # type: ignore[index]
            return
        self.seen.set()
        action, self.action = self.action, None
        if action is not None:
            action()


@contextlib.contextmanager
def on_retry(name: str) -> Iterator[OnRetry]:
    handler = OnRetry(name)
    logger = logging.getLogger("fenced")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def waiters(locks: fenced.AsyncLocks, name: str, n: int) -> None:
    async def enough() -> bool:
        return (await locks.status(name)).waiters == n

    await async_wait_for(enough, what=f"{n} waiter(s) on {name}")


async def cancelled_in_backoff(
    direct: fenced.AsyncLocks, via: fenced.AsyncLocks, proxy: TcpProxy, *, lost_grant: bool
) -> tuple[float, int | None]:
    """A holds; the victim V (through the proxy) queues, then B (direct). The proxy fails V's
    connection; V is cancelled in the back-off (the proxy healed). With ``lost_grant``, A
    releases *while* V is cut off, so the source hands the lock to V, who never reads it;
    else A releases after V is gone. Returns how long B waited after A's release (or after V's
    cancellation, with ``lost_grant``), and the token V was handed (``lost_grant``)."""
    name = unique_name("abandon")
    a = direct.lock(name, ttl=30)
    await a.acquire()
    victim = via.lock(name, ttl=VICTIM_TTL)
    v_task = asyncio.create_task(victim.acquire())
    await waiters(direct, name, 1)
    b = direct.lock(name, ttl=10)
    b_task = asyncio.create_task(b.acquire(timeout=BOUND + 5))
    await waiters(direct, name, 2)
    handed: int | None = None

    def heal_and_cancel() -> None:
        proxy.heal()
        v_task.cancel()

    with on_retry(name) as hook:
        if not lost_grant:
            hook.action = heal_and_cancel
        proxy.partition()
        proxy.cut()
        async with asyncio.timeout(30):
            await hook.seen.wait()
        if lost_grant:
            assert await a.release()
            status = await direct.status(name)
            assert status.token is not None and status.holder != b.request_id
            handed = status.token.value  # (V's: B is behind it)
            hook.seen.clear()
            hook.action = heal_and_cancel
            async with asyncio.timeout(30):
                await hook.seen.wait()
        async with asyncio.timeout(30):
            with pytest.raises(asyncio.CancelledError):
                await v_task
    start = time.monotonic()
    if not lost_grant:
        assert await a.release()
    try:
        token = await b_task
    except fenced.LockTimeout:
        pytest.fail(
            f"a live waiter waited more than {time.monotonic() - start:.1f} s: the lock went "
            "to the acquire that was given up"
        )
    waited = time.monotonic() - start
    print(f"{name}: the live waiter waited {waited:.3f} s")  # (shown with -s)
    if handed is not None:
        assert token.value > handed  # V's grant was given back, not taken over by B
    await b.release()
    return waited, handed


async def cancelled_while_cut_off(
    direct: fenced.AsyncLocks, via: fenced.AsyncLocks, proxy: TcpProxy
) -> float:
    """As :func:`cancelled_in_backoff`, but the victim is cancelled wherever it is the moment
    its connection is cut (in the source's own reconnecting, as a rule), then the proxy heals.
    Returns how long B waited after A's release."""
    name = unique_name("abandon")
    a = direct.lock(name, ttl=30)
    await a.acquire()
    victim = via.lock(name, ttl=VICTIM_TTL)
    v_task = asyncio.create_task(victim.acquire())
    await waiters(direct, name, 1)
    b = direct.lock(name, ttl=10)
    b_task = asyncio.create_task(b.acquire(timeout=BOUND + 5))
    await waiters(direct, name, 2)
    proxy.partition()
    proxy.cut()
    v_task.cancel()
    async with asyncio.timeout(30):
        with pytest.raises(asyncio.CancelledError):
            await v_task
    proxy.heal()
    start = time.monotonic()
    assert await a.release()
    try:
        await b_task
    except fenced.LockTimeout:
        pytest.fail(f"a live waiter waited more than {time.monotonic() - start:.1f} s")
    waited = time.monotonic() - start
    print(f"{name}: the live waiter waited {waited:.3f} s")  # (shown with -s)
    await b.release()
    return waited


async def timed_out_while_cut_off(
    direct: fenced.AsyncLocks, via: fenced.AsyncLocks, proxy: TcpProxy, *, reset: bool = True
) -> float:
    """The victim's timeout passes while it is cut off (BackendUnavailable; or, without
    ``reset``, a silent network: its wait simply runs out); the proxy heals only after that.
    Returns how long B waited after A's release."""
    name = unique_name("abandon")
    a = direct.lock(name, ttl=30)
    await a.acquire()
    victim = via.lock(name, ttl=VICTIM_TTL)
    v_task = asyncio.create_task(victim.acquire(timeout=2))
    await waiters(direct, name, 1)
    b = direct.lock(name, ttl=10)
    b_task = asyncio.create_task(b.acquire(timeout=BOUND + 25))
    await waiters(direct, name, 2)
    proxy.partition()
    if reset:
        proxy.cut()
    async with asyncio.timeout(30):
        with pytest.raises((fenced.BackendUnavailable, fenced.LockTimeout)):
            await v_task
    proxy.heal()
    start = time.monotonic()
    assert await a.release()
    try:
        async with asyncio.timeout(BOUND + 5):
            await b_task
    except TimeoutError:
        pytest.fail(f"a live waiter waited more than {time.monotonic() - start:.1f} s")
    waited = time.monotonic() - start
    print(f"{name}: the live waiter waited {waited:.3f} s")  # (shown with -s)
    await b.release()
    return waited


CANCEL_BOUND = 2.0
"""How long cancelling an acquire cut off from its source may take: the source's own leave
and the lease core's clean-up wait 0.25 s each at most, the rest goes on in the background
(before: Redis waited for its leave script for socket_timeout, 10 s by default)."""


async def cancel_latency(
    direct: fenced.AsyncLocks, via: fenced.AsyncLocks, proxy: TcpProxy
) -> float:
    """Cancel a waiting acquire whose source went silent (partitioned: no reset, no answer).
    Returns how long the cancellation took; then checks the place went once it healed."""
    name = unique_name("abandon")
    a = direct.lock(name, ttl=30)
    await a.acquire()
    victim = via.lock(name, ttl=VICTIM_TTL)
    v_task = asyncio.create_task(victim.acquire())
    await waiters(direct, name, 1)
    proxy.partition()
    start = time.monotonic()
    v_task.cancel()
    async with asyncio.timeout(30):
        with pytest.raises(asyncio.CancelledError):
            await v_task
    took = time.monotonic() - start
    print(f"{name}: the cancellation took {took:.3f} s")  # (shown with -s)
    proxy.heal()
    await waiters(direct, name, 0)
    await a.release()
    return took


async def lost_grant_in_silence(
    direct: fenced.AsyncLocks, via: fenced.AsyncLocks, proxy: TcpProxy
) -> float:
    """The network goes silent (no reset: the source does not see the victim leave) and A
    releases: the lock goes to the victim, whose answer never arrives. The victim is then
    cancelled, and the network heals. Returns how long B waited after the heal."""
    name = unique_name("abandon")
    a = direct.lock(name, ttl=30)
    await a.acquire()
    victim = via.lock(name, ttl=VICTIM_TTL)
    v_task = asyncio.create_task(victim.acquire())
    await waiters(direct, name, 1)
    b = direct.lock(name, ttl=10)
    b_task = asyncio.create_task(b.acquire(timeout=BOUND + 25))
    await waiters(direct, name, 2)
    proxy.partition()
    assert await a.release()
    handed = await direct.status(name)
    assert handed.token is not None and handed.holder not in (None, b.request_id)
    v_task.cancel()
    async with asyncio.timeout(30):
        with pytest.raises(asyncio.CancelledError):
            await v_task
    proxy.heal()
    start = time.monotonic()
    try:
        async with asyncio.timeout(BOUND + 5):
            token = await b_task
    except TimeoutError:
        pytest.fail(f"a live waiter waited more than {time.monotonic() - start:.1f} s")
    waited = time.monotonic() - start
    print(f"{name}: the live waiter waited {waited:.3f} s")  # (shown with -s)
    assert token.value > handed.token.value
    await b.release()
    return waited


async def lost_grant_is_found_by_the_retry(
    direct: fenced.AsyncLocks, via: fenced.AsyncLocks, proxy: TcpProxy
) -> None:
    """The other side: the victim is *not* given up. A grant made for it while it was cut
    off is what its retry (same request id) returns: one grant, not two."""
    name = unique_name("abandon")
    a = direct.lock(name, ttl=30)
    await a.acquire()
    victim = via.lock(name, ttl=VICTIM_TTL)
    v_task = asyncio.create_task(victim.acquire())
    await waiters(direct, name, 1)
    with on_retry(name) as hook:
        proxy.partition()
        proxy.cut()
        async with asyncio.timeout(30):
            await hook.seen.wait()
        assert await a.release()
        status = await direct.status(name)
        assert status.token is not None
        proxy.heal()
        async with asyncio.timeout(30):
            token = await v_task
    assert token.value == status.token.value
    after = await direct.status(name)
    assert after.holder == victim.request_id and after.token == status.token
    assert after.last_token == status.token  # no second grant
    assert await victim.release()


# -- the sources ------------------------------------------------------------------------------


def _via(url: str, port: int, proxy: TcpProxy) -> str:
    return url.replace(f"127.0.0.1:{port}", f"127.0.0.1:{proxy.port}", 1)


@contextlib.asynccontextmanager
async def _pair(url: str, port: int, own: dict[str, Any], fast: dict[str, Any]) -> Any:
    """A direct connection and one through a proxy (``fast``: options that make a cut-off
    connection fail within a second or so, not the defaults' 5-30 s)."""
    with TcpProxy("127.0.0.1", port) as proxy:
        async with (
            fenced.connect_async(url, **own) as direct,
            fenced.connect_async(_via(url, port, proxy), **own, **fast) as via,
        ):
            yield direct, via, proxy


@pytest.fixture(params=["redis", "etcd", "postgresql", "zookeeper", "http"])
def source(request: pytest.FixtureRequest) -> Callable[[], Any]:
    """The sources that keep an acquire's place across an unavailable attempt (or could be
    left holding a grant whose reply was lost). The victim's place is kept alive for 20-30 s
    (its heartbeat period, its lease), so that before the fix a live waiter surely waits
    that long: the dead place is not skipped by a heartbeat that happens to run out."""
    if request.param == "redis":
        redis: RedisServer = request.getfixturevalue("redis_server")
        own = {"key_prefix": unique_name("t") + ":"}
        fast = {"socket_timeout": 3, "waiter_heartbeat": 30}
        return lambda: _pair(redis.url, redis.port, own, fast)
    if request.param == "etcd":
        etcd: EtcdServer = request.getfixturevalue("etcd_server")
        own = {"prefix": f"/{unique_name('t')}/"}
        return lambda: _pair(etcd.url, etcd.port, own, {"timeout": 0.5, "retry_for": 1})
    if request.param == "http":  # (the worker's gateway in front of SQLite)
        env = next(make_http_env(request, "sqlite"))
        gateway = env.gateway  # type: ignore[attr-defined]

        def http_pair() -> Any:
            return _pair(gateway.url, gateway.port, {}, {"request_timeout": 1})

        http_pair.kind = "http"  # type: ignore[attr-defined]
        return http_pair
    if request.param == "zookeeper":
        zk: ZooKeeperServer = request.getfixturevalue("zk_server")

        def zk_pair() -> Any:
            return _pair(zk.url, zk.port, {}, {"connect_timeout": 2})

        zk_pair.kind = "zookeeper"  # type: ignore[attr-defined]
        return zk_pair
    pg: PostgresServer = request.getfixturevalue("pg_server")
    dsn: str = request.getfixturevalue("pg_dsn")
    fast = {"connect_timeout": 1, "command_timeout": 2, "waiter_ttl": 30}

    def pair() -> Any:
        return _pair(dsn, pg.port, {}, fast)

    pair.kind = "postgresql"  # type: ignore[attr-defined]
    return pair


def backoff(source: Callable[[], Any]) -> None:
    if getattr(source, "kind", "") == "zookeeper":
        pytest.skip(
            "ZooKeeper rides out a cut within the session (the acquire waits for it to come "
            "back): no unavailable attempt reaches the lease core in time"
        )


def hand_off(source: Callable[[], Any], *, reset: bool = True) -> None:
    """Skip a source where nothing is granted to a waiter that is cut off."""
    kind = getattr(source, "kind", "")
    if kind == "postgresql":
        pytest.skip("PostgreSQL grants only to a waiter that asks (no hand-off)")
    if kind == "zookeeper":
        pytest.skip("ZooKeeper grants only to a waiter that asks (its session's node lowest)")
    if kind == "http" and reset:
        pytest.skip("the gateway sees the client leave, and stops waiting for it")


async def test_a_waiter_cancelled_in_the_backoff_does_not_get_the_lock(
    source: Callable[[], Any],
) -> None:
    backoff(source)
    async with source() as (direct, via, proxy):
        waited, _ = await cancelled_in_backoff(direct, via, proxy, lost_grant=False)
    assert waited < BOUND


async def test_a_waiter_cancelled_while_cut_off_does_not_get_the_lock(
    source: Callable[[], Any],
) -> None:
    async with source() as (direct, via, proxy):
        waited = await cancelled_while_cut_off(direct, via, proxy)
    assert waited < BOUND


async def test_a_waiter_timed_out_while_cut_off_does_not_get_the_lock(
    source: Callable[[], Any],
) -> None:
    async with source() as (direct, via, proxy):
        waited = await timed_out_while_cut_off(direct, via, proxy)
    # (the clean-up retries in the background until the proxy heals: its back-off, 1 s at
    # most, on top of the round trip)
    assert waited < BOUND + 1


async def test_a_grant_made_in_a_silent_network_is_given_back_when_given_up(
    source: Callable[[], Any],
) -> None:
    hand_off(source, reset=False)
    async with source() as (direct, via, proxy):
        waited = await lost_grant_in_silence(direct, via, proxy)
    assert waited < BOUND + 1  # (the clean-up retries until the network heals: its back-off)


async def test_a_waiter_timed_out_in_a_silent_network_does_not_get_the_lock(
    source: Callable[[], Any],
) -> None:
    async with source() as (direct, via, proxy):
        waited = await timed_out_while_cut_off(direct, via, proxy, reset=False)
    assert waited < BOUND + 1  # (as above)


async def test_cancelling_an_acquire_cut_off_from_its_source_is_prompt(
    source: Callable[[], Any],
) -> None:
    async with source() as (direct, via, proxy):
        took = await cancel_latency(direct, via, proxy)
    assert took < CANCEL_BOUND


async def test_a_grant_made_while_cut_off_is_given_back_when_given_up(
    source: Callable[[], Any],
) -> None:
    hand_off(source)
    async with source() as (direct, via, proxy):
        waited, _ = await cancelled_in_backoff(direct, via, proxy, lost_grant=True)
    assert waited < BOUND


async def test_a_grant_made_while_cut_off_is_the_retrys(source: Callable[[], Any]) -> None:
    hand_off(source)
    async with source() as (direct, via, proxy):
        await lost_grant_is_found_by_the_retry(direct, via, proxy)


async def test_the_same_request_acquired_again_keeps_its_grant(source: Callable[[], Any]) -> None:
    """A caller-chosen request id, acquired again right after its acquire was given up while
    cut off: the clean-up still under way must not give back the new grant (the new acquire
    waits for it)."""
    from fenced._core import lease as lease_core

    async with source() as (direct, via, proxy):
        name = unique_name("abandon")
        a = direct.lock(name, ttl=30)
        await a.acquire()
        victim = via.lock(name, ttl=VICTIM_TTL, request_id="again-1")
        v_task = asyncio.create_task(victim.acquire())
        await waiters(direct, name, 1)
        proxy.partition()
        proxy.cut()
        v_task.cancel()
        async with asyncio.timeout(30):
            with pytest.raises(asyncio.CancelledError):
                await v_task
        if getattr(source, "kind", "") != "zookeeper":  # (nothing to clean up there)
            assert lease_core._abandoning  # (it goes on: the source is out of reach)
        proxy.heal()
        assert await a.release()
        again = via.lock(name, ttl=VICTIM_TTL, request_id="again-1")
        async with asyncio.timeout(30):
            await again.acquire()

        async def cleaned_up() -> bool:
            return not lease_core._abandoning

        await async_wait_for(cleaned_up, what="the clean-up to end")
        status = await direct.status(name)
        assert status.holder == "again-1" and status.token == again.token
        await again.renew()
        assert await again.release()


async def test_http_a_waiter_given_up_while_the_gateways_source_was_cut_off(
    redis_server: RedisServer,
) -> None:
    """Behind ``fenced serve``: the gateway's own source (Redis) is cut off, the gateway answers
    503, the client is cancelled in its back-off. The place the gateway's source kept for the
    client's retry must go (the client asks the gateway to forget the request), not be handed
    the lock (before: a live waiter waited the victim's whole ttl, 20 s)."""
    prefix = unique_name("t") + ":"
    with TcpProxy("127.0.0.1", redis_server.port) as proxy:
        inner = f"redis://127.0.0.1:{proxy.port}/0?key_prefix={prefix}&socket_timeout=1"
        with FencedServer(f"{inner}&waiter_heartbeat=30") as gateway:
            async with (
                fenced.connect_async(redis_server.url, key_prefix=prefix) as direct,
                fenced.connect_async(gateway.url, request_timeout=2) as via,
            ):
                waited, _ = await cancelled_in_backoff(direct, via, proxy, lost_grant=False)
    assert waited < BOUND
