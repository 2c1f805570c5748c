"""A campaign bounded by counts (``faults=``/``writes=``, ``fenced check --faults N --writes
M``): it ends as soon as each nemesis has struck N times and the workers made M writes, with
``seconds`` only its bound; a bound that ends first fails the run ("counts not reached"), so a
slow machine cannot pass having tested less."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import fenced
from fenced.cli._common import EXIT_VIOLATION
from fenced.testing.check import read_history, run_campaign


def test_a_run_ends_once_its_counts_are_reached(tmp_path: Path) -> None:
    result = run_campaign(
        f"sqlite:///{tmp_path}/locks.db",
        tmp_path / "r",
        seconds=120,  # (the bound: never reached on any machine that does the work)
        ttl=0.5,
        nemesis=["stall", "pause"],
        seed=1,
        workers=2,
        faults=1,
        writes=10,
    )
    assert result.ok, [str(v) for v in result.violations]
    assert result.faults["stall"] >= 1 and result.faults["pause"] >= 1, result.faults
    writes = [e for e in read_history(result.history) if e["op"] == "write"]
    assert len(writes) >= 10
    assert result.seconds < 60, result.seconds  # (stopped at its counts, not at its bound)


def test_a_bound_that_ends_before_the_counts_fails_the_run(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "fenced", "check", "--time", "0.5", "--ttl", "0.5",
         "--workers", "2", "--nemesis", "pause", "--faults", "1", "--writes", "1000000",
         "--report", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == EXIT_VIOLATION, (run.stdout, run.stderr)
    assert "VIOLATION counts not reached" in run.stdout, run.stdout
    assert "of 1000000" in run.stdout and "every invariant held" not in run.stdout


@pytest.mark.parametrize("count", ["-1", "many"])
def test_a_bad_count_is_a_one_line_usage_error(count: str, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "fenced", "check", "--faults", count, "--report",
         str(tmp_path / "r")],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 2 and "--faults" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert not (tmp_path / "r").exists()


def test_negative_counts_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(fenced.ConfigurationError, match="counts"):
        run_campaign(None, tmp_path / "r", seconds=1, faults=-1)
    assert not (tmp_path / "r").exists()
