"""``fenced.testing.sim``: fenced's real lease core and SQL guard on virtual time. The same
seed gives the same trace byte for byte (in this process and in another with a different
hash seed); 10,000 seeds pass every checker; every plant the simulator plays is caught within
the CI seed budget; a failing seed prints its replay command, which fails the same way."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from fenced import _clock
from fenced.testing.sim import SIM_PLANTS, Config, run_seeds, shrink, simulate
from tests.helpers import ROOT

CI_SEEDS = int(os.environ.get("FENCED_SIM_SEEDS", "10000"))


def test_a_seed_replays_byte_for_byte() -> None:
    first, again = simulate(Config(seed=7)), simulate(Config(seed=7))
    assert first.trace_text() == again.trace_text()
    assert len(first.trace) > 30 and first.ok
    assert simulate(Config(seed=8)).trace_text() != first.trace_text()
    assert _clock.now.__module__ == "fenced._clock"  # (the real clock is back)


def test_a_seed_replays_byte_for_byte_in_another_process() -> None:
    code = "from fenced.testing.sim import Config, simulate; print(simulate(Config(seed=7)).trace_text(), end='')"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == simulate(Config(seed=7)).trace_text()


@pytest.mark.xdist_group("sim-seeds")
def test_ten_thousand_seeds_hold_every_invariant() -> None:
    result = run_seeds(Config(seed=0), 0, CI_SEEDS, jobs=2)
    assert result.seeds == CI_SEEDS and result.failed == [], result.failed[:10]


@pytest.mark.parametrize("plant", list(SIM_PLANTS))
def test_every_plant_is_caught_within_the_seed_budget(plant: str) -> None:
    result = run_seeds(Config(seed=0, plant=plant), 0, 200, jobs=1, stop_at_first=True)
    assert result.failed, f"{plant} survived {result.seeds} seeds"
    found = simulate(Config(seed=result.failed[0], plant=plant))
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
