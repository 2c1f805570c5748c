"""``fenced check --plant X`` as a user types it (a real ``fenced`` process, default seed): a
planted bug is reported caught, or the run fails loudly ("plant not exercised"), never exit 0
"every invariant held"; the same command with no plant passes. (An outside tester got exit 0
for ``--plant off-by-one`` and ``--plant write-then-check`` on the default seed.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fenced.cli._common import EXIT_VIOLATION
from fenced.testing.check import PLANTS


def _check(tmp_path: Path, *args: str, time: int = 2) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fenced", "check", "--time", str(time), "--report",
         str(tmp_path / "r"), *args],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_bug_never_passes_on_the_cli(plant: str, tmp_path: Path) -> None:
    run = _check(tmp_path, "--plant", plant)
    assert run.returncode == EXIT_VIOLATION, (run.returncode, run.stdout, run.stderr)
    assert "VIOLATION" in run.stdout and "every invariant held" not in run.stdout, run.stdout


def test_the_same_run_without_a_plant_passes(tmp_path: Path) -> None:
    # (each default fault kind dealt once: 2 s of them deal some none, which is inconclusive)
    run = _check(tmp_path, "--faults", "1", time=90)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert "every invariant held" in run.stdout


@pytest.mark.parametrize("plant", ["off-by-one", "write-then-check"])
def test_the_plants_the_tester_saw_pass_are_caught_by_a_checker(plant: str, tmp_path: Path) -> None:
    """The tester's own command: caught by the checkers that see the mistake (not merely "plant
    not exercised"), and early: the run stops at its first violation (measured 7 s of 10).
    Its 10 s bound by counts (6 stalls, the 90 s bound): at load 26, 10 s dealt 2 stalls and
    missed the window. Any checker that sees a stale write let in counts: the tokens'
    acceptance order (a write one grant behind accepted after the next holder's fenced read
    was acknowledged: the off-by-one itself), the lost update, the acknowledged or refused
    write — which of them sees it first depends on the schedule the load makes."""
    run = _check(tmp_path, "--plant", plant, "--faults", "6", time=90)
    assert run.returncode == EXIT_VIOLATION, (run.stdout, run.stderr)
    seen = {line.split(":")[0].removeprefix("VIOLATION ") for line in run.stdout.splitlines()
            if line.startswith("VIOLATION")}  # fmt: skip
    caught_by = {"acceptance order", "lost update", "acknowledged write", "refused write"}
    assert seen & caught_by, run.stdout
