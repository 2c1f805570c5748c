"""One conformance check over every kind of replicated member (Redis, etcd, SQL; sync and
async guards), both sides of each mark: the stale writer refused with nothing written AND the
rightful one applied. The members are adapters over their guard's group contract
(``apply_group``/``read_group``), so the check is shown to catch a bug planted in that
contract, for Redis (its Lua) and for etcd (its rule hooks)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio

import fenced
from fenced import FencingToken
from fenced.guards.etcd import AsyncEtcdGuard, EtcdGuard
from fenced.guards.redis import GROUP_APPLY_SCRIPT, AsyncRedisGuard, RedisGuard
from fenced.guards.sql import SQLGuard
from fenced.replicated import Item, Member, stamp
from fenced.replicated._members import as_member
from tests.helpers import unique_name
from tests.sources.envs.base import session_server

KINDS = ["redis", "redis-async", "etcd", "etcd-async", "sqlite", "postgresql"]


async def member_violations(member: Member, lock: str) -> list[str]:
    """What ``member`` does that a member must not (empty: conforms)."""
    bad: list[str] = []

    def tok(value: int) -> FencingToken:
        return FencingToken(lock, value)

    async def expect(error: type[Exception], what: str, *args: Any, **kw: Any) -> None:
        try:
            await member.apply(*args, **kw)
        except error:
            return
        except fenced.FencedError as exc:
            bad.append(f"{what}: {type(exc).__name__}: {exc}")
            return
        bad.append(f"{what}: accepted")

    async def state() -> tuple[int, int, dict[str, bytes | None]]:
        try:
            snap = await member.read(None)
        except fenced.CorruptMarkError as exc:  # (a planted bug can leave a stamp above the mark)
            bad.append(f"reads as damaged: {exc}")
            return -1, -1, {}
        return snap.token, snap.epoch, {k: i.value for k, i in snap.items.items()}

    async def accept(what: str, *args: Any, **kw: Any) -> None:
        try:
            await member.apply(*args, **kw)
        except fenced.FencedError as exc:
            bad.append(f"{what}: refused: {type(exc).__name__}: {exc}")

    # The lock mark: the holder accepted, again at an equal token; a lower one refused.
    await accept("the first holder", tok(5), 2, [Item("k", stamp(5, 1), b"five")])
    await accept("the holder again", tok(5), 2, [Item("k", stamp(5, 2), b"again")])
    before = await state()
    if before != (5, 2, {"k": b"again"}):
        bad.append(f"after the holder's writes: {before}")
    await expect(
        fenced.StaleTokenError, "a lower token", tok(4), 2, [Item("k", stamp(4, 9), b"stale")]
    )
    if await state() != before:
        bad.append(f"a lower token changed the member: {await state()}")
    # The epoch mark: a lower epoch refused, and neither mark moved, no item landed.
    await accept("an epoch-only change", None, 3, [])
    before = await state()
    await expect(
        fenced.StaleEpochError, "a lower epoch", tok(6), 2, [Item("k", stamp(6, 1), b"old")]
    )
    if await state() != before:
        bad.append(f"a lower epoch changed the member: {await state()}")
    await expect(fenced.StaleEpochError, "a lower epoch alone", None, 2, [])
    # since: a member below the configuration's epoch refused (it lost its state).
    await expect(
        fenced.MemberBehindError, "below since", tok(6), 4, [Item("k", stamp(6, 1), b"x")], since=4
    )
    if await state() != before:
        bad.append(f"a change above the member's epoch changed it: {await state()}")
    # The rightful writer of the current configuration: applied, both marks raised.
    await accept("the next holder", tok(6), 3, [Item("k", stamp(6, 1), b"six")], since=3)
    await accept("a newer epoch", tok(6), 4, [Item("j", stamp(6, 2), None)])
    after = await state()
    if after != (6, 4, {"k": b"six", "j": None}):
        bad.append(f"after the rightful writes: {after}")
    return bad


# The worker's session server of each kind: no test here stops one, and each uses a lock
# name of its own (every key and row of a guard's group is under it). A server of its own
# per test cost 28 server starts a run.
SERVERS = {"redis": "redis_server", "etcd": "etcd_server", "postgresql": "pg_server"}


class Made:
    """A guard of one kind (a lock name of its own) on the worker's server of that kind."""

    def __init__(self, kind: str, tmp: Path, server: Any) -> None:
        self.kind = kind
        self.lock = unique_name("res")
        self.server: Any = server
        self._closers: list[Callable[[], Any]] = []
        self.tmp = tmp

    def guard(self, redis_class: Any = None, etcd_class: Any = None) -> Any:
        """The guard (a planted class, if given), for ``as_member``."""
        if self.kind == "redis":
            return (redis_class or RedisGuard)(redis.Redis(port=self.server.port), self.lock)
        if self.kind == "redis-async":
            client = redis.asyncio.Redis(port=self.server.port)
            return (redis_class or AsyncRedisGuard)(client, self.lock)
        if self.kind == "etcd":

            class Sync(EtcdGuard):
                _async_class = etcd_class or AsyncEtcdGuard

            g = Sync(self.server.endpoint, self.lock)
            self._closers.append(g.close)
            return g
        if self.kind == "etcd-async":
            return (etcd_class or AsyncEtcdGuard).open(self.server.endpoint, self.lock)
        if self.kind == "postgresql":
            import psycopg

            dsn = self.server.dsn
            return SQLGuard(self.lock).fencer(lambda: psycopg.connect(dsn, autocommit=True))
        path = str(self.tmp / f"{self.lock}.db")
        return SQLGuard(self.lock).fencer(lambda: sqlite3.connect(path, check_same_thread=False))

    def violations(self, **planted: Any) -> list[str]:
        async def go() -> list[str]:
            guard = self.guard(**planted)
            member = as_member(guard, unique_name("g"))
            try:
                return await member_violations(member, self.lock)
            finally:
                await member.aclose()
                if self.kind in ("etcd-async", "redis-async"):
                    await guard.aclose()

        return asyncio.run(go())

    def close(self) -> None:
        for c in self._closers:
            c()


@pytest.fixture
def made(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Made]:
    kind: str = request.param
    fixture = SERVERS.get(kind.removesuffix("-async"))
    server = session_server(request, fixture) if fixture is not None else None
    m = Made(kind, tmp_path, server)
    try:
        yield m
    finally:
        m.close()


@pytest.mark.parametrize("made", KINDS, indirect=True)
def test_every_member_kind_refuses_stale_writers_and_applies_the_rightful_one(made: Made) -> None:
    assert made.violations() == []


# -- planted bugs in the guards' group contract: the check must catch each ------------------

_EPOCH_CHECK = "if ep > epoch_of(ARGV[3]) then return {'epoch', e} end\n"
_TOKEN_CMP = "  c = cmp(tok, hw)\n"  # (the token against the mark: 1 higher, 0 equal, -1 lower)


def _plant(script: str, old: str, new: str) -> str:
    assert old in script, "the group script changed: re-plant the bug"
    return script.replace(old, new)


class _RedisEpochNotCompared:
    group_apply_script = _plant(GROUP_APPLY_SCRIPT, _EPOCH_CHECK, "")


class _RedisTokenInverted:
    group_apply_script = _plant(GROUP_APPLY_SCRIPT, _TOKEN_CMP, "  c = cmp(hw, tok)\n")


class _EtcdEpochNotCompared(AsyncEtcdGuard):
    def _epoch_accepts(self, stored: int, epoch: int) -> bool:
        return True


class _EtcdTokenInverted(AsyncEtcdGuard):
    def _accepts(self, token: int, mark: int) -> bool:
        return mark >= token


REDIS_PLANTS = {"epoch not compared": _RedisEpochNotCompared, "token inverted": _RedisTokenInverted}
ETCD_PLANTS = {"epoch not compared": _EtcdEpochNotCompared, "token inverted": _EtcdTokenInverted}
CAUGHT = {
    "epoch not compared": "a lower epoch: accepted",
    "token inverted": "a lower token: accepted",
}


@pytest.mark.parametrize("plant", sorted(REDIS_PLANTS))
@pytest.mark.parametrize("made", ["redis", "redis-async"], indirect=True)
def test_the_check_catches_a_bug_planted_in_the_redis_group_script(made: Made, plant: str) -> None:
    base = RedisGuard if made.kind == "redis" else AsyncRedisGuard
    planted = type("Planted", (REDIS_PLANTS[plant], base), {})
    assert CAUGHT[plant] in made.violations(redis_class=planted)


@pytest.mark.parametrize("plant", sorted(ETCD_PLANTS))
@pytest.mark.parametrize("made", ["etcd", "etcd-async"], indirect=True)
def test_the_check_catches_a_bug_planted_in_the_etcd_group_txn(made: Made, plant: str) -> None:
    assert CAUGHT[plant] in made.violations(etcd_class=ETCD_PLANTS[plant])


BAD = {
    "epoch below 0": {"epoch": -1},
    "epoch a bool": {"epoch": True},
    "since a str": {"since": "1"},
    "empty group": {"group": ""},
    "item not a triple": {"items": [("k", stamp(1, 1))]},
    "item value a str": {"items": [("k", stamp(1, 1), "v")]},
    "items without a token": {"token": None},
}


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("made", ["redis", "etcd"], indirect=True)
def test_bad_input_to_a_group_change_is_typed_and_writes_nothing(made: Made, bad: str) -> None:
    guard = made.guard()
    token = FencingToken(made.lock, 1)
    change: dict[str, Any] = {
        "token": token,
        "group": "g",
        "epoch": 1,
        "items": [("k", stamp(1, 1), b"v")],
        **BAD[bad],
    }
    with pytest.raises(fenced.ConfigurationError):
        guard.apply_group(**change)
    state = guard.read_group(group="g")
    assert (state.token, state.epoch, state.items) == (0, 0, [])
    guard.apply_group(token=token, group="g", epoch=1, items=[("k", stamp(1, 1), b"v")])
    state = guard.read_group(group="g")
    assert (state.token, state.epoch, state.items) == (1, 1, [("k", stamp(1, 1), b"v")])
