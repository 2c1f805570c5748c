"""The contracts the core offers the packages above it (issue 27), used as those packages use
them: a sync facade's loop (``portal``), a sync lease's async lease (``aio``), a writer's
sequence number, and the election's classes, which the core makes without importing
``fenced.election``."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from pathlib import Path

import fenced
import fenced.election
from fenced.guards.sql import SQLGuard
from fenced.replicated import Group, stamp


async def _where() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def test_a_sync_facade_runs_a_coroutine_of_its_async_api_on_its_loop(memory_url: str) -> None:
    with fenced.connect(memory_url) as locks, locks.lock("jobs", ttl=5) as lease:
        assert locks.portal.call(_where()) is locks.loop
        assert locks.portal.call(locks.aio.status("jobs")).token == lease.token
        # The sync lease's async lease is the one its calls run: releasing it releases this.
        assert lease.aio.token == lease.token
        assert locks.portal.call(lease.aio.release()) is True
        assert not lease.held and locks.status("jobs").token is None


def test_a_group_runs_on_its_connections_loop_and_a_writer_counts_its_writes(
    tmp_path: Path,
) -> None:
    def member(name: str) -> object:
        path = str(tmp_path / f"{name}.db")
        return SQLGuard("orders").fencer(lambda: sqlite3.connect(path, check_same_thread=False))

    with fenced.connect(f"sqlite:///{tmp_path}/locks.db") as locks:
        with Group("orders", locks, {n: member(n) for n in "ab"}, timeout=5) as group:
            assert group.portal is locks.portal
            with locks.lock("orders", ttl=5) as lease:
                w = group.writer(lease)
                assert w.aio.seq == 0
                w.set("k", b"1")
                w.set("k", b"2")
                assert w.aio.seq == 2
                snap = group.portal.call(group.aio.member("a").read(["k"]))
                assert snap.items["k"].stamp == stamp(lease.token.value, w.aio.seq)


async def test_the_election_is_the_cores_and_keeps_its_public_names(memory_url: str) -> None:
    async with fenced.connect_async(memory_url) as locks:
        leader = await locks.elect("scheduler", "10.0.0.7", ttl=5)
        assert type(leader) is fenced.election.AsyncLeadership
        seen = locks.observe("scheduler", interval=0.01)
        first = await anext(seen)
        assert (first.epoch, first.value) == (leader.epoch, "10.0.0.7")
        await seen.aclose()
        assert await leader.resign()
        # The functions of fenced.election, the spelling before issue 27, still work.
        again = await fenced.election.elect(locks, "scheduler", "b", ttl=5)
        assert again.epoch.value > leader.epoch.value
        seen = fenced.election.observe(locks, "scheduler", interval=0.01)
        assert (await anext(seen)).value == "b"
        await seen.aclose()
        await again.resign()
    with fenced.connect(memory_url) as sync_locks, sync_locks.elect("s", "v", ttl=5) as lead:
        assert type(lead) is fenced.election.Leadership


def test_the_core_imports_no_room() -> None:
    """Using every part of the core loads neither the election module nor any package above
    the core (what the layer check says from the source, seen in a real interpreter)."""
    code = (
        "import sys, fenced\n"
        "locks = fenced.connect('memory://x')\n"
        "with locks.elect('e', 'v', ttl=5) as lead:\n"
        "    list(zip(range(1), locks.observe('e', interval=0.01)))\n"
        "locks.close()\n"
        "rooms = sorted(m for m in sys.modules if m.split('.')[:2] in (\n"
        "    ['fenced', 'election'], ['fenced', 'replicated'], ['fenced', 'server'],\n"
        "    ['fenced', 'testing'], ['fenced', 'guards']))\n"
        "print(rooms)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
