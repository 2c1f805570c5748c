"""Expiry claims: two gateways on one source count a grant's expiry once — the source decides
which, by compare-and-set on the lock's claim record (``Gateway.claim_expiry``). Shown on
every source the server runs on, each gateway with a connection of its own; the whole count
with two in-process gateways on memory:// (the processes' version, over HTTP, is in
test_server_attack2.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from fenced._core.lease import AsyncLocks
from fenced.server import Gateway
from fenced.server._gateway import CLAIMS_KEPT, claim_record


@pytest.fixture(params=["memory", "sqlite", "redis", "postgresql", "etcd", "zookeeper"])
def any_source(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return f"memory://claims-{uuid.uuid4().hex[:8]}"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'locks.db'}"
    if request.param == "postgresql":
        return str(request.getfixturevalue("pg_dsn"))
    server = request.getfixturevalue("zk_server" if request.param == "zookeeper" else
                                     f"{request.param}_server")  # fmt: skip
    if server.proc is None:  # (a failed test left the session's server down)
        server.start()
    return str(server.url)


async def _gateways(url: str) -> AsyncIterator[tuple[Gateway, Gateway]]:
    a = Gateway(AsyncLocks(url), max_wait=10, default_ttl=10)
    b = Gateway(AsyncLocks(url), max_wait=10, default_ttl=10)
    await a.start()
    try:
        await b.start()
        try:
            yield a, b
        finally:
            await b.stop()
    finally:
        await a.stop()


async def test_the_source_lets_one_gateway_claim_each_expiry(any_source: str) -> None:
    """Two gateways claim the same expiries at once, 10 of them: each claimed by exactly one;
    a claim asked again is refused, and one below the values kept (CLAIMS_KEPT) too."""
    name = f"claimed-{uuid.uuid4().hex[:8]}"
    async for a, b in _gateways(any_source):
        for value in range(1, 11):
            won = await asyncio.gather(a.claim_expiry(name, value), b.claim_expiry(name, value))
            assert sorted(won) == [False, True], (value, won)
            assert not await a.claim_expiry(name, value)
        for value in range(11, 11 + CLAIMS_KEPT):  # (the record keeps the highest only)
            assert await b.claim_expiry(name, value)
        assert not await a.claim_expiry(name, 5)  # (below them all: too late to tell)
        record = await a.backend.read_record(claim_record(name))
        assert record is not None and len(record.value) < 20 * CLAIMS_KEPT  # (bounded)


async def test_a_damaged_claim_record_still_lets_one_claim(tmp_path: Path) -> None:
    """A claim record changed by hand (the records API) to something else than a list of
    token values reads as none claimed: the next claim of a value wins once, not twice."""
    name = "damaged"
    async for a, b in _gateways(f"sqlite:///{tmp_path / 'locks.db'}"):
        assert await a.claim_expiry(name, 3)
        record = await a.backend.read_record(claim_record(name))
        assert record is not None
        await a.backend.swap_record(claim_record(name), record.version, '{"not": "a list"}')
        won = await asyncio.gather(a.claim_expiry(name, 4), b.claim_expiry(name, 4))
        assert sorted(won) == [False, True]


def _count(gw: Gateway) -> float:
    return float(gw.metrics.expiries._value.get())


async def _until(cond: Callable[[], bool], renew: Callable[[], object] | None = None) -> None:
    async with asyncio.timeout(20):  # (bounded: the sweeps turn once a second)
        while not cond():
            if renew is not None:
                await renew()  # type: ignore[misc]
            await asyncio.sleep(0.1)


def _settled(a: Gateway, b: Gateway, live: str) -> bool:
    """Both sweeps have settled the dead grant (claimed and counted, or found claimed), and
    A's has forgotten the live one (renewed through B)."""
    return (
        not a._grants and list(b._grants) == [(live, "l")]
        and not a._unclaimed and not b._unclaimed and _count(a) + _count(b) >= 1
    )  # fmt: skip


async def test_two_gateways_count_one_expiry_once_and_leave_a_renewed_lease(
    any_source: str,
) -> None:
    """A grant made through A and renewed once through B, whose holder then dies: counted
    once, by one of the two (the sweeps of both find it ended). A grant made through A and
    kept renewed through B: A's sweep forgets it without counting, it stays held, and its
    renewals through either gateway are accepted. (Not ZooKeeper: a grant cannot move there;
    see test_server_attack2.py.)"""
    if any_source.startswith("zookeeper"):
        pytest.skip("on ZooKeeper a grant lives in the session of the gateway that made it")
    tag = uuid.uuid4().hex[:8]
    dead, live = f"dead-{tag}", f"live-{tag}"
    async for a, b in _gateways(any_source):
        gone, _ = await a.acquire(dead, "d", 1.0, 0, "victim")
        kept, _ = await a.acquire(live, "l", 1.0, 0, "keeper")
        await b.renew(dead, gone.token, "d", 1.0)

        await _until(
            lambda a=a, b=b: _settled(a, b, live),  # type: ignore[misc]
            lambda b=b, kept=kept: b.renew(live, kept.token, "l", 1.0),  # type: ignore[misc]
        )
        assert _count(a) + _count(b) == 1, (list(a.events), list(b.events))
        [event] = [e for g in (a, b) for e in g.events if e.event == "expired"]
        assert (event.lock, event.token) == (dead, str(gone.token))
        for g in (a, b):
            await g.renew(live, kept.token, "l", 1.0)
        status = await a.backend.status(live)
        assert status.token == kept.token and status.holder == "l"
        assert await a.release(live, kept.token, "l")
        assert _count(a) + _count(b) == 1
