"""Leader election on every token source (``locks.elect`` / ``locks.observe``): one leader
at a time, epochs strictly increasing across resignation, expiry and a restart of the source,
resignation handing over at once, observers seeing each change in epoch order."""

from __future__ import annotations

import threading
import time

import pytest

import fenced
from fenced.election import Leader
from tests.helpers import unique_name, wait_for
from tests.sources.envs.base import BackendEnv


def test_one_leader_at_a_time_and_epochs_only_rise(env: BackendEnv) -> None:
    name = unique_name("elect")
    with env.connect() as a, env.connect() as b:
        first = a.elect(name, "node-a", ttl=max(env.min_ttl, 2.0))
        assert first.value == "node-a" and first.held
        elected: list[fenced.election.Leadership] = []
        waiter = threading.Thread(target=lambda: elected.append(b.elect(name, "node-b", ttl=2.0)))
        waiter.start()
        time.sleep(0.3)  # (a candidate that must not win while the leader holds)
        assert not elected and first.held
        resigned_at = time.monotonic()
        assert first.resign()
        waiter.join(10)
        second = elected[0]
        assert time.monotonic() - resigned_at < 1.5  # resigning hands over at once, no ttl wait
        assert second.epoch > first.epoch and second.value == "node-b"
        assert not first.held
        second.resign()


def test_epochs_rise_across_expiry(env: BackendEnv) -> None:
    name = unique_name("elect")
    ttl = env.min_ttl
    with env.connect() as a, env.connect() as b:
        lease = a.lock(name, ttl=ttl, auto_renew=False, description="node-a")
        old = lease.acquire()  # a leader that stops renewing (as a paused one does)
        new = b.elect(name, "node-b", ttl=ttl, timeout=ttl * 10)
        assert new.epoch > old
        new.resign()


def test_epochs_rise_across_a_source_restart(env: BackendEnv) -> None:
    if env.name == "memory" or not env.cross_process:
        pytest.skip("the memory source does not survive its process")
    name = unique_name("elect")
    with env.connect() as a:
        first = a.elect(name, "a", ttl=2.0)
        epoch = first.epoch
        first.resign()
    try:
        env.restart()
    except NotImplementedError:
        pytest.skip(f"{env.name} cannot be restarted here")
    with env.connect() as b:
        again = b.elect(name, "b", ttl=2.0, timeout=30)
        assert again.epoch > epoch
        again.resign()


def test_observers_see_every_change_in_epoch_order(env: BackendEnv) -> None:
    name = unique_name("elect")
    seen: list[Leader] = []
    stop = threading.Event()

    def watch() -> None:
        with env.connect() as o:
            for leader in o.observe(name, interval=0.05, stop=stop):
                seen.append(leader)

    observer = threading.Thread(target=watch)
    observer.start()
    epochs = []
    with env.connect() as c:
        for i in range(3):
            with c.elect(name, f"node-{i}", ttl=2.0) as leader:
                epochs.append(leader.epoch)
                wait_for(lambda: any(s.epoch == leader.epoch for s in seen), timeout=10)
            wait_for(lambda: seen and seen[-1].epoch is None, timeout=10)
    stop.set()
    observer.join(10)
    assert not observer.is_alive()  # (stopped, its connection closed: nothing left running)
    leaders = [s for s in seen if s.epoch is not None]
    assert [s.epoch for s in leaders] == epochs  # each one, once, in order
    assert [s.value for s in leaders] == ["node-0", "node-1", "node-2"]
    assert all(s.owner and "pid" in s.owner for s in leaders)


async def test_async_election_and_lost_signal(env: BackendEnv) -> None:
    name = unique_name("elect")
    async with env.connect_async() as a:
        leader = await a.elect(name, "x", ttl=2.0)
        changes = a.observe(name, interval=0.05)
        now = await anext(changes)
        await changes.aclose()  # type: ignore[attr-defined]
        assert now.epoch == leader.epoch and now.value == "x"
        assert leader.epoch.lock == name and leader.remaining() > 0
        await leader.resign()
        assert not leader.held


def test_lock_delay_after_expiry_but_not_after_release(env: BackendEnv) -> None:
    """Lock-delay, judged by the source's clock: a grant that expires keeps everyone else out
    for ``lock_delay`` more seconds; a released one is free at once."""
    name = unique_name("delay")
    # The delay in ttls (1.5 s on etcd and ZooKeeper, as before; less where the source's expiry
    # is that precise): an expiry without it ends near one ttl, well short of the bound below.
    ttl, delay = env.min_ttl, 1.5 * env.min_ttl
    with env.connect() as a, env.connect() as b:
        sent = time.monotonic()
        holder = a.lock(name, ttl=ttl, auto_renew=False, lock_delay=delay)
        holder.acquire()  # and then never renewed: it expires
        b.lock(name, ttl=ttl).acquire(timeout=ttl + delay + 30)
        waited = time.monotonic() - sent
        assert waited >= ttl + delay - 0.05, waited  # (not before: the source's clock decides)
        assert holder.remaining() == 0
    with env.connect() as a, env.connect() as b:
        released = a.lock(name, ttl=ttl, lock_delay=30)
        released.acquire(timeout=60)
        t = time.monotonic()
        released.release()
        b.lock(name, ttl=ttl).acquire(timeout=10)
        assert time.monotonic() - t < 2.0  # a release is not held back by the delay
    with env.connect() as c, pytest.raises(fenced.ConfigurationError):
        c.lock(name, lock_delay=-1)


def test_fenced_status_shows_the_leader_and_its_epoch(env: BackendEnv) -> None:
    import json
    import os
    import subprocess
    import sys

    if not env.cross_process:
        pytest.skip("the memory source lives in one process")
    from urllib.parse import urlencode

    from tests.helpers import ROOT

    name = unique_name("elect")
    # (the env's options, e.g. a per-test key prefix, as the URL's query: the CLI's only input)
    url = (
        env.url + ("&" if "?" in env.url else "?") + urlencode(env.options)
        if env.options
        else env.url
    )
    with env.connect() as c, c.elect(name, "10.0.0.7:8080", ttl=5) as leader:
        out = subprocess.run(
            [sys.executable, "-m", "fenced.cli", "status", name, "--json", "--url", url],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        (row,) = json.loads(out.stdout)
        assert row["value"] == "10.0.0.7:8080" and row["epoch"] == leader.epoch.value
