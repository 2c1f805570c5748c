"""Fenced consumer commits on Redis Streams, with a real Redis and a real consumer process that
is SIGSTOPped mid-batch: after a rebalance (its lease ran out, the next owner claimed its
pending entries with XAUTOCLAIM), its late commit must acknowledge nothing — the new owner's
entries stay pending, the progress does not go back. The same run unguarded loses them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

import fenced
from fenced.guards.redis import AsyncRedisGuard, RedisGuard
from fenced.guards.streams import AsyncFencedStreamConsumer, FencedStreamConsumer
from fenced.testing.servers import RedisServer
from tests.helpers import ROOT, read_line, unique_name

CONSUMER = """
import sys, fenced, redis
from fenced.guards.redis import RedisGuard
from fenced.guards.streams import FencedStreamConsumer
source, port, stream, mode = sys.argv[1:5]
r = redis.Redis(port=int(port))
consumer = FencedStreamConsumer(RedisGuard(r, stream), stream, "g")
with fenced.connect(source) as locks:
    lease = locks.lock(stream, ttl=1)
    token = lease.acquire(timeout=30)
    got = r.xreadgroup("g", "a", {stream: ">"}, count=3)
    ids = [i.decode() for i, _ in got[0][1]]
    print("read", token.value, *ids, flush=True)
    sys.stdin.readline()                       # (SIGSTOPped here, past its lease)
    try:
        if mode == "guarded":
            print("acked", consumer.commit(ids, token=token), flush=True)
        else:
            print("acked", r.xack(stream, "g", *ids), flush=True)
    except fenced.StaleTokenError as exc:
        print("refused", exc.high_water.value, flush=True)
"""


def _stream(r: redis.Redis, n: int = 6) -> str:
    stream = unique_name("orders")
    for i in range(n):
        r.xadd(stream, {"n": str(i)})
    r.xgroup_create(stream, "g", id="0")
    return stream


def _rebalance(
    redis_server: RedisServer, tmp_path: Path, mode: str, claim: str = "fenced"
) -> dict[str, Any]:
    r = redis.Redis(port=redis_server.port)
    stream = _stream(r)
    source = f"sqlite:///{tmp_path}/locks.db"
    a = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, source, str(redis_server.port), stream, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
        start_new_session=True,
    )
    try:
        _, t1, *ids = read_line(a).split()
        os.kill(a.pid, signal.SIGSTOP)  # A paused with three entries read, none committed
        with fenced.connect(source) as locks, locks.lock(stream, ttl=5, timeout=30) as lease:
            # B owns the stream now: it claims A's pending entries (fenced) and works on them
            b = FencedStreamConsumer(RedisGuard(r, stream), stream, "g")
            if claim == "fenced":
                claimed_ids = [i for i, _ in b.claim("b", token=lease.token)]
            else:  # a plain XAUTOCLAIM: the mark is not raised until B's first fenced write
                _, raw, _ = r.xautoclaim(stream, "g", "b", min_idle_time=0, count=10)
                claimed_ids = [i.decode() for i, _ in raw]
            assert a.stdin is not None
            a.stdin.write("commit\n")
            a.stdin.flush()
            os.kill(a.pid, signal.SIGCONT)  # A wakes and commits, late
            late = read_line(a).split()
            pending = r.xpending(stream, "g")["pending"]
            consumer = FencedStreamConsumer(RedisGuard(r, stream), stream, "g")
            try:
                done = consumer.commit(claimed_ids, token=lease.token)
            except fenced.StaleTokenError:
                done = -1
            return {
                "t1": int(t1), "t2": lease.token.value, "ids": ids, "claimed": claimed_ids,
                "late": late, "pending_after_late_commit": pending, "b_acked": done,
                "progress": consumer.progress(),
            }  # fmt: skip
    finally:
        a.kill()
        a.wait()


def test_a_paused_consumer_cannot_ack_the_new_owners_entries(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    run = _rebalance(redis_server, tmp_path, "guarded")
    assert run["t2"] > run["t1"] and run["claimed"] == run["ids"]
    assert run["late"] == ["refused", str(run["t2"])]  # the stale commit acknowledged nothing
    assert run["pending_after_late_commit"] == 3  # B's in-flight entries are still pending
    assert run["b_acked"] == 3 and run["progress"] == run["ids"][-1]


def test_the_same_rebalance_unguarded_loses_the_new_owners_entries(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    run = _rebalance(redis_server, tmp_path, "unguarded")
    assert run["late"] == ["acked", "3"]  # A's late XACK went through ...
    assert run["pending_after_late_commit"] == 0  # ... B's entries left the pending list


def test_a_plain_claim_leaves_the_old_owner_a_window(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Why claim() is fenced: with a plain XAUTOCLAIM, the old owner's fenced commit still
    passes (nobody raised the mark yet) and takes the new owner's entries."""
    run = _rebalance(redis_server, tmp_path, "guarded", claim="plain")
    assert run["late"] == ["acked", "3"] and run["pending_after_late_commit"] == 0


def test_progress_only_moves_forward_and_bad_input(redis_server: RedisServer) -> None:
    r = redis.Redis(port=redis_server.port)
    stream = _stream(r)
    consumer = FencedStreamConsumer(RedisGuard(r, stream), stream, "g")
    token = fenced.FencingToken(stream, 7)
    ids = [i for i, fields in consumer.read("c", token=token, count=6)]
    assert len(ids) == 6 and consumer.read("c", token=token) == []
    assert consumer.commit(ids[3:], token=token) == 3
    assert consumer.commit(ids[:3], token=token) == 3  # an older batch, committed late
    assert consumer.progress() == ids[-1]  # did not go back
    assert consumer.commit(["99999999999999-0"], token=token) == 0
    assert consumer.progress() == "99999999999999-0"  # compared as numbers, not text
    assert consumer.commit(["100000000000000-0"], token=token) == 0
    assert consumer.progress() == "100000000000000-0"
    for bad in ([], ["x"], ["1-2-3"], [5]):
        with pytest.raises(fenced.ConfigurationError):
            consumer.commit(bad, token=token)  # type: ignore[arg-type]
    with pytest.raises(fenced.StaleTokenError):
        consumer.commit(ids[:1], token=fenced.FencingToken(stream, 6))
    with pytest.raises(fenced.StaleTokenError):
        consumer.claim("old", token=fenced.FencingToken(stream, 6))
    for kw in ({"count": 0}, {"min_idle_ms": -1}, {"start": "x"}):
        with pytest.raises(fenced.ConfigurationError):
            consumer.claim("c", token=token, **kw)  # type: ignore[arg-type]
    with pytest.raises(fenced.ConfigurationError):
        consumer.read("", token=token)


def test_the_async_consumer_is_the_same_script(redis_server: RedisServer) -> None:
    import redis.asyncio as aredis

    sync = redis.Redis(port=redis_server.port)
    stream = _stream(sync)
    got = sync.xreadgroup("g", "c", {stream: ">"}, count=2)
    ids = [i.decode() for i, _ in got[0][1]]

    async def go() -> None:
        r = aredis.Redis(port=redis_server.port)
        consumer = AsyncFencedStreamConsumer(AsyncRedisGuard(r, stream), stream, "g")
        assert await consumer.commit(ids, token=fenced.FencingToken(stream, 3)) == 2
        with pytest.raises(fenced.StaleTokenError):
            await consumer.commit(ids, token=fenced.FencingToken(stream, 2))
        assert await consumer.progress() == ids[-1]
        await r.aclose()

    asyncio.run(go())


def test_zero_padded_ids_are_refused_and_progress_keeps_moving(redis_server: RedisServer) -> None:
    """Bug: commit(['0001-0']) after '2-0' set the progress to '0001-0' (longer text, so
    "newer"), and from then on no commit moved it ('3-0' is shorter than '0001-0')."""
    r = redis.Redis(port=redis_server.port)
    stream = unique_name("orders")
    r.xgroup_create(stream, "g", id="0", mkstream=True)
    consumer = FencedStreamConsumer(RedisGuard(r, stream), stream, "g")
    token = fenced.FencingToken(stream, 7)
    consumer.commit(["2-0"], token=token)
    for padded in (["0001-0"], ["2-00"], ["02-5"], [b"0001-0"], ["18446744073709551616-0"]):
        with pytest.raises(fenced.ConfigurationError, match="canonical"):
            consumer.commit(padded, token=token)
        assert consumer.progress() == "2-0"  # nothing written
    consumer.commit(["0-0", "1-0", "10-0"], token=token)  # canonical, compared as numbers
    assert consumer.progress() == "10-0"
    consumer.commit(["9-99"], token=token)
    assert consumer.progress() == "10-0"
    consumer.commit(["18446744073709551615-18446744073709551615"], token=token)
    assert consumer.progress() == "18446744073709551615-18446744073709551615"
    with pytest.raises(fenced.ConfigurationError, match="canonical"):
        consumer.claim("c", token=token, start="00-0")


def test_a_padded_progress_left_by_an_old_version_is_read_as_its_number(
    redis_server: RedisServer,
) -> None:
    """A progress record written with leading zeros (before ids were checked) compares by
    value: the next commit past it moves it (and writes it canonically); one before it does
    not. A progress that is no id at all refuses the commit before anything is acknowledged."""
    r = redis.Redis(port=redis_server.port)
    stream = _stream(r, 3)
    consumer = FencedStreamConsumer(RedisGuard(r, stream), stream, "g")
    token = fenced.FencingToken(stream, 7)
    ids = [i for i, _ in consumer.read("c", token=token, count=3)]
    r.set(consumer.progress_key, "0001-0")
    consumer.commit(["0-5"], token=token)
    assert consumer.progress() == "0001-0"  # 0-5 is before 1-0
    consumer.commit(["2-0"], token=token)
    assert consumer.progress() == "2-0"  # past it: forward, canonical
    r.set(consumer.progress_key, "garbage")
    with pytest.raises(fenced.CorruptMarkError):
        consumer.commit(ids, token=token)
    assert r.xpending(stream, "g")["pending"] == 3  # nothing acknowledged
    assert consumer.progress() == "garbage"
