"""``fenced.testing.sim``: fenced's real lease core and SQL guard, and its real replicated
group, on virtual time. The same seed gives the same trace byte for byte (in this process and
in another with a different hash seed); 2,000 seeds in all (lease, group and gateway) pass
every checker in CI, 10,000 or more in ``make test-long`` (FENCED_SIM_SEEDS); every plant the
simulator plays is caught within its own seed budget (the replicated bug of issue 25, a member
restarted empty counted as holding the writes, within 1,000 seeds); a failing seed prints its
replay command, which fails the same way."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from fenced._core import clock as _clock
from fenced.testing.sim import SIM_PLANTS, Config, plant_system, run_seeds, shrink, simulate
from tests.helpers import ROOT

# A bounded seeded run in CI: 2,000 seeds in all, 1,600 of the lease system, 200 of the group's
# and 200 of the gateways' (tests/kit/test_sim_gateway.py; a group seed costs about 3.5 lease
# seeds, a gateway seed about 2.5: docs/benchmarks.md), ~24 CPU-seconds. The long randomized run
# (10,000 seeds and more, same 8:1:1 split) is `make test-long` (FENCED_SIM_SEEDS, FENCED_SIM_START).
# The plants' budgets below are their own (200 and 1,000 seeds), not a share of these.
CI_SEEDS = int(os.environ.get("FENCED_SIM_SEEDS", "2000"))
START = int(os.environ.get("FENCED_SIM_START", "0"))
GROUP_SEEDS = CI_SEEDS // 10
GATEWAY_SEEDS = CI_SEEDS // 10
LEASE_SEEDS = CI_SEEDS - GROUP_SEEDS - GATEWAY_SEEDS
# Each system's seeds in parts, each a test of its own: under ``pytest -n 2`` the two workers
# share them (tests/conftest.py hands them out first), one process each, instead of one worker
# running them all on a pool of two beside the other worker's tests. Alone, a part uses both.
LEASE_PARTS, OTHER_PARTS = 4, 2
JOBS = 1 if "PYTEST_XDIST_WORKER" in os.environ else 2


def part_of(total: int, parts: int, part: int) -> tuple[int, int]:
    """The first seed and the count of part ``part`` of ``total`` seeds from START (the last
    part takes the remainder): the parts together are the seeds START .. START + total - 1."""
    size = total // parts
    count = total - size * (parts - 1) if part == parts - 1 else size
    return START + part * size, count


def test_a_seed_replays_byte_for_byte() -> None:
    first, again = simulate(Config(seed=7)), simulate(Config(seed=7))
    assert first.trace_text() == again.trace_text()
    assert len(first.trace) > 30 and first.ok
    assert simulate(Config(seed=8)).trace_text() != first.trace_text()
    assert _clock.now.__module__ == "fenced._core.clock"  # (the real clock is back)


def test_a_seed_replays_byte_for_byte_in_another_process() -> None:
    code = "from fenced.testing.sim import Config, simulate; print(simulate(Config(seed=7)).trace_text(), end='')"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == simulate(Config(seed=7)).trace_text()


def test_a_group_seed_replays_byte_for_byte() -> None:
    first = simulate(Config(seed=7, system="group"))
    assert first.trace_text() == simulate(Config(seed=7, system="group")).trace_text()
    ops = {e["op"] for e in first.trace}
    assert {"grant", "ack", "read", "record", "nemesis"} <= ops and first.ok
    # The nemesis wipes no member while the first configuration is being made (it did in
    # seed 1113: no member of configuration 1 at its epoch, beyond any replication's faults).
    assert simulate(Config(seed=1113, system="group")).ok


def test_the_parts_cover_every_seed_once() -> None:
    for total, parts in ((LEASE_SEEDS, LEASE_PARTS), (GROUP_SEEDS, OTHER_PARTS), (7, 4)):
        seeds: list[int] = []
        for p in range(parts):
            first, count = part_of(total, parts, p)
            seeds += range(first, first + count)
        assert seeds == list(range(START, START + total))


@pytest.mark.parametrize("part", range(LEASE_PARTS))
@pytest.mark.timeout(600)  # bounded work (a seed count), not a wait: ~15 s CPU a part
def test_the_lease_systems_seeds_hold_every_invariant(part: int) -> None:
    first, count = part_of(LEASE_SEEDS, LEASE_PARTS, part)
    result = run_seeds(Config(seed=0), first, count, jobs=JOBS)
    assert result.seeds == count and result.failed == [], result.failed[:10]


@pytest.mark.parametrize("part", range(OTHER_PARTS))
@pytest.mark.timeout(600)  # bounded work (a seed count), not a wait
def test_group_seeds_hold_every_invariant(part: int) -> None:
    """The replicated group under every fault, members wiped and restarted included: no
    acknowledged write lost, no stale write acknowledged, members' marks only rise."""
    first, count = part_of(GROUP_SEEDS, OTHER_PARTS, part)
    result = run_seeds(Config(seed=0, system="group"), first, count, jobs=JOBS)
    assert result.seeds == count and result.failed == [], result.failed[:10]


@pytest.mark.parametrize("plant", list(SIM_PLANTS))
def test_every_plant_is_caught_within_the_seed_budget(plant: str) -> None:
    cfg = Config(seed=0, plant=plant, system=plant_system(plant))
    result = run_seeds(cfg, 0, 200, jobs=1, stop_at_first=True)
    assert result.failed, f"{plant} survived {result.seeds} seeds"
    found = simulate(Config(seed=result.failed[0], plant=plant, system=cfg.system))
    assert not found.ok and found.short_trace()


@pytest.mark.parametrize("plant", ["no-fence", "check-then-write"])
def test_a_shrunk_seed_keeps_its_violation_and_its_replay_shows_the_plant(plant: str) -> None:
    """Shrinking must not cut a run down until nothing got through: "nothing checked" fails
    with no bug at all. The shrunk run keeps a kind of violation the original had, and the
    same run with no plant passes."""
    result = run_seeds(Config(seed=0, plant=plant), 0, 200, jobs=1, stop_at_first=True)
    assert result.failed
    original = simulate(Config(seed=result.failed[0], plant=plant))
    small = shrink(original.config)
    kinds = {v.checker for v in original.violations} - {"nothing checked"}
    assert kinds & {v.checker for v in small.violations}, [str(v) for v in small.violations]
    assert simulate(dataclasses.replace(small.config, plant="")).ok


def test_the_replicated_bug_is_found_within_a_thousand_seeds_and_the_fix_holds() -> None:
    """Issue 25's bug planted back (a member restarted empty ignores ``since=``, so it is
    counted as holding the acknowledged writes): the simulator loses an acknowledged write
    within 1,000 seeds, from several starting seeds; the same seeds with the fix hold."""
    for start in (3000, 5000):  # (from 0: the test above)
        planted = Config(seed=0, system="group", plant="empty-member-counted")
        result = run_seeds(planted, start, 1000, jobs=1, stop_at_first=True)
        assert result.failed, f"survived seeds {start}..{start + result.seeds - 1}"
        seed = result.failed[0]
        found = simulate(Config(seed=seed, system="group", plant="empty-member-counted"))
        assert any(v.checker == "lost-write" for v in found.violations), found.violations
        assert any(e["op"] == "nemesis" and e["kind"] == "wipe" for e in found.trace)
        assert simulate(Config(seed=seed, system="group")).ok


def test_a_failing_run_prints_a_replay_command_that_fails_again() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = [sys.executable, "-m", "fenced.cli", "sim", "--seeds", "200", "--jobs", "1"]
    out = subprocess.run(
        [*run, "--plant", "off-by-one"], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 65, out.stdout + out.stderr
    replay = next(line for line in out.stdout.splitlines() if line.startswith("replay: "))
    assert "VIOLATION" in out.stdout and "--plant off-by-one" in replay
    argv = replay.removeprefix("replay: fenced ").split()
    again = subprocess.run(
        [sys.executable, "-m", "fenced.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert again.returncode == 65 and "VIOLATION" in again.stdout
    clean = subprocess.run(
        [*run, "--seeds", "50"], capture_output=True, text=True, env=env, timeout=300
    )
    assert clean.returncode == 0 and "every invariant held" in clean.stdout, (
        clean.stdout + clean.stderr
    )


def test_a_stuck_simulation_is_reported_not_hung() -> None:
    """A client whose process never resumes (a planted fault of the harness itself): the
    loop finds nothing left to run and says so, rather than spinning."""
    from fenced.testing.sim import Stuck, VirtualLoop

    loop = VirtualLoop()
    try:
        import asyncio

        with pytest.raises(Stuck):
            loop.run_until_complete(asyncio.Event().wait())
    finally:
        loop.close()


def test_the_group_checkers_catch_a_lost_and_a_stale_write_and_pass_the_rightful() -> None:
    """Hand-made histories: a read older than an acknowledged write, and a write acknowledged
    with a lower token after a higher one was, are each named; the rightful histories pass."""
    from fenced.replicated import stamp
    from fenced.testing.sim._group import check_history

    def ev(worker: str, op: str, mono: float, **fields: object) -> dict[str, object]:
        return {"worker": worker, "op": op, "mono": mono, **fields}

    acked = ev("c1", "ack", 1.0, key="x", stamp=stamp(3, 1), token=3, sent=0.9)
    newer = ev("c2", "ack", 2.0, key="x", stamp=stamp(4, 1), token=4, sent=1.9)
    rightful = [
        acked,
        newer,
        ev("c3", "read", 2.2, key="x", stamp=stamp(4, 1), sent=2.1),
        ev("c3", "read", 1.05, key="x", stamp=stamp(3, 1), sent=1.01),  # (before c2's ack)
    ]
    assert check_history(rightful) == []
    lost = [acked, newer, ev("c3", "read", 2.2, key="x", stamp=stamp(3, 1), sent=2.1)]
    (v,) = check_history(lost)
    assert v.checker == "lost-write" and "c2 had acknowledged" in str(v)
    gone = [acked, ev("final", "read", 3.0, key="x", stamp="", sent=2.5)]
    assert [v.checker for v in check_history(gone)] == ["lost-write"]
    stale = [newer, ev("c1", "ack", 2.5, key="x", stamp=stamp(3, 2), token=3, sent=2.4)]
    (v,) = check_history(stale)
    assert v.checker == "stale-write" and "token 3" in str(v)


def test_the_cli_finds_the_planted_replicated_bug_and_its_replay_fails_again() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = [sys.executable, "-m", "fenced.cli", "sim", "--jobs", "1", "--start", "31"]
    out = subprocess.run(
        [*run, "--seeds", "5", "--plant", "empty-member-counted"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 65, out.stdout + out.stderr
    assert "VIOLATION lost-write" in out.stdout
    assert "fenced.replicated" not in out.stderr  # (its routine warnings stay quiet in a run)
    replay = next(line for line in out.stdout.splitlines() if line.startswith("replay: "))
    assert "--system group" in replay and "--plant empty-member-counted" in replay
    argv = replay.removeprefix("replay: fenced ").split()
    again = subprocess.run(
        [sys.executable, "-m", "fenced.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert again.returncode == 65 and "VIOLATION lost-write" in again.stdout
    # A plant of one system with the other is refused, one line, exit 2 (configuration).
    wrong = subprocess.run(
        [*run, "--seeds", "1", "--system", "lease", "--plant", "empty-member-counted"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert wrong.returncode == 2 and "group plant" in wrong.stderr, wrong.stderr


def test_a_client_that_raises_is_a_violation_not_a_lost_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client raising what fenced never raises (here planted: a RuntimeError in a round) is
    reported like any violation, in both systems, instead of ending its task silently."""
    from fenced.testing.sim import _group, _world

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("planted")

    monkeypatch.setattr(_world, "_round", boom)
    monkeypatch.setattr(_group.GroupRun, "read", boom)
    for system in ("lease", "group"):
        outcome = simulate(Config(seed=3, system=system))
        errors = [v for v in outcome.violations if v.checker == "error"]
        assert errors and "RuntimeError: planted" in str(errors[0]), (system, outcome.violations)


# Seeds' traces as they were before the simulator was made faster (issue 28 §4): the loop's
# speed-ups must not move a single event. A change that means to alter runs (a new fault, a new
# event) updates these with bench/sim_digests.py's --save run over 500 seeds of each system.
PINNED = {
    ("lease", 7): "fbc8c39b8eeaf87e",
    ("lease", 1113): "0cf4d07d7cf78a88",
    # (re-pinned at the merge of the simulator's speed-ups with the kit's and the members'
    # restructure, made in parallel: seed 7's group run moved; every group seed still holds,
    # each plant is still found)
    ("group", 7): "f9be932a2f591d73",
    ("group", 1113): "c5c2ba833bde4ed9",
    # (re-pinned at session 10's merge of the request-id oracle's fix: a request naming another
    # key's request id is answered as an unknown one, which moves the gateway runs; seeds 0-299
    # of the gateway system all hold, and test_sim_gateway's plants are still found; and in
    # session 11 (w3i-close): a client's second release attempt is a retry, which the gateway
    # that released the grant answers True — seed 7's run moved, 1113's did not; seeds 0-499
    # all hold, the plants are still found)
    ("gateway", 7): "3b5ba065f0899993",
    ("gateway", 1113): "bfbe698721c3b5b4",
}


@pytest.mark.parametrize(("system", "seed"), list(PINNED))
def test_a_seeds_trace_is_the_pinned_one(system: str, seed: int) -> None:
    import hashlib

    outcome = simulate(Config(seed=seed, system=system))
    digest = hashlib.sha256(outcome.trace_text().encode()).hexdigest()[:16]
    assert outcome.ok and digest == PINNED[system, seed]


def test_a_quiet_end_turns_message_faults_off() -> None:
    """The world keeps "delay" and "loss" as flags for speed: a run that ends its faults (the
    group's and the gateways' quiet end) turns them off too, and the set cannot change in place."""
    from fenced.testing.sim import VirtualLoop
    from fenced.testing.sim._world import _World

    loop = VirtualLoop()
    try:
        w = _World(Config(seed=1, system="group"), loop)
        assert any(w._lost() for _ in range(2000))  # (3 % of messages)
        assert any(w._delay() > 0.005 for _ in range(2000))  # (5 % late, up to 2 ttls)
        w.faults = set()
        assert not any(w._lost() for _ in range(2000))
        assert all(w._delay() <= 0.005 for _ in range(2000))
        with pytest.raises(AttributeError):
            w.faults.add("loss")  # type: ignore[attr-defined]
    finally:
        loop.close()
