"""A run that tested nothing does not pass, and a run can be reproduced from its report:
``fenced check`` caps the nemesis's wait by the time left, calls a run that dealt some fault
kind no time "inconclusive" (exit 75, not 0), prints the seed, records the seed and every
option in history.jsonl and report.html, and draws its victims from the seed alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fenced.testing.check import read_history, run_campaign
from tests.helpers import ROOT


def test_a_run_that_dealt_no_fault_is_inconclusive_and_ends_on_time(tmp_path: Path) -> None:
    """ttl 4: the nemesis's first wait is 2-6 s (5.4 s for seed 0), longer than the 1 s asked
    for; it is cut to the time left, no fault is dealt, and the run says so instead of passing."""
    result = run_campaign(
        f"sqlite:///{tmp_path}/locks.db", tmp_path / "r", seconds=1, ttl=4, workers=1, seed=0
    )
    assert not any(result.faults.values()), result.faults
    assert not result.ok and result.inconclusive, [str(v) for v in result.violations]
    assert "no pause, no stall, no kill" in str(result.violations[0]), result.violations
    events = read_history(result.history)
    began = min(e["mono"] for e in events if e["worker"] == "w1")
    final = next(e["mono"] for e in events if e["op"] == "final")
    assert final - began < 4.0, final - began  # (1 s of faults, one round to finish: not 5.4)


def test_the_seed_and_every_option_are_recorded(tmp_path: Path) -> None:
    result = run_campaign(
        f"sqlite:///{tmp_path}/locks.db", tmp_path / "r", seconds=60, faults=1, ttl=0.3,
        nemesis=["stall"], seed=7, workers=2,
    )  # fmt: skip
    assert result.ok, [str(v) for v in result.violations]
    run = read_history(result.history)[0]
    assert run["op"] == "run" and run["options"]["seed"] == 7, run
    assert run["options"]["nemesis"] == ["stall"] and run["options"]["workers"] == 2, run
    assert run["options"]["ttl"] == 0.3 and run["options"]["faults"] == 1, run
    page = result.report.read_text()
    line = page.split("Run again with: <code>")[1].split("</code>")[0]  # (the command's own)
    assert "--nemesis stall" in line and line.endswith("--seed 7"), line


def test_the_same_seed_strikes_the_same_victims(tmp_path: Path) -> None:
    """The victims come from the seed, not from who holds the lock when a fault is dealt
    (timing): two runs of one seed strike the same workers in the same order."""
    struck = []
    for run in ("a", "b"):
        result = run_campaign(
            f"sqlite:///{tmp_path}/locks-{run}.db", tmp_path / run, seconds=60, faults=3,
            ttl=0.3, nemesis=["pause", "kill", "stall"], seed=4,
        )  # fmt: skip
        assert result.ok, [str(v) for v in result.violations]
        events = read_history(result.history)
        struck.append([(e["kind"], e["victim"]) for e in events if e["op"] == "nemesis"])
    n = min(map(len, struck))
    assert n >= 9 and struck[0][:n] == struck[1][:n], struck


def test_the_cli_says_inconclusive_with_its_own_exit_status_and_prints_the_seed(
    tmp_path: Path,
) -> None:
    r = subprocess.run(
        [
            sys.executable, "-m", "fenced.cli", "check", "--time", "0.5", "--ttl", "4",
            "--workers", "1", "--seed", "5", "--report", str(tmp_path / "r"),
        ],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )  # fmt: skip
    assert r.returncode == 75, r.stdout + r.stderr
    assert "INCONCLUSIVE" in r.stdout and "seed 5" in r.stdout, r.stdout
    assert "every invariant held" not in r.stdout, r.stdout


def test_every_workloads_verdict_calls_an_undealt_fault_inconclusive() -> None:
    """The one rule both workloads' ``judge`` apply (the locks' and the replicated group's):
    a kind never dealt makes a clean run inconclusive; a real violation stays the verdict."""
    from fenced.testing.check._checkers import Violation
    from fenced.testing.check._engine import INCONCLUSIVE, undealt

    said = undealt([], ["pause", "kill"], {"pause": 2, "kill": 0}, 3.0)
    assert [v.checker for v in said] == [INCONCLUSIVE] and "no kill fault" in said[0].message
    assert undealt([], ["pause"], {"pause": 1}, 3.0) == []
    real = [Violation("lost update", "value 3 written twice")]
    assert undealt(real, ["kill"], {"kill": 0}, 3.0) == real


def test_the_record_keeps_a_python_resource_and_masks_a_commands_secrets() -> None:
    """What history.jsonl and report.html record to reproduce a run: a ``python:`` resource
    as given (it was cut to "p…" as a possible secret), a URL without its password, and a
    ``--resource-cmd`` without the secrets CI would publish with the report (variables set
    by ``env``, a DSN, the value of a ``--password`` option)."""
    from fenced.testing.check._campaign import _recorded, _shown_cmd

    assert _recorded("python:bugs:Slow") == "python:bugs:Slow"
    assert "hunter2" not in str(_recorded("redis://:hunter2@127.0.0.1:1/0"))
    cmd = (
        "env PGPASSWORD=s3cret-pw 'DATABASE_DSN=host=db password=s3cret-dsn' python svc.py "
        "--password s3cret-opt --port 8000 --db /tmp/d.db --url http://u:s3cret-url@h/x"
    )
    shown = _shown_cmd(cmd)
    assert "s3cret" not in shown, shown
    assert "PGPASSWORD=***" in shown and "--port 8000" in shown and "svc.py" in shown, shown


def test_the_reports_command_line_parses_back_to_the_runs_options() -> None:
    """report.html's "Run again with:" line is a command ``fenced check`` takes, whose options
    are the run's: quoted for a shell (a command with spaces), ``--signing`` with no value, the
    nemeses comma-separated, an option at its default left out (it showed "signing False",
    "nemesis ['pause', ...]": Python's reprs)."""
    import shlex

    from fenced.cli import _parser
    from fenced.testing.check._report import command_line

    options = {
        "source": "redis://:***@db:6379/0", "resource": "http://127.0.0.1:8000/items/a b",
        "resource_cmd": "python inv.py --port 8000 --db 'my inv.db'", "lock": "orders",
        "workers": 3, "seconds": 12.5, "ttl": 2.0, "plant": "", "signing": True,
        "stop_at_first": False, "faults": 2, "writes": 0, "seed": 7,
        "nemesis": ["pause", "stall", "race"],
    }  # fmt: skip
    line = command_line(options)
    assert "False" not in line and "[" not in line and "--workers" not in line, line
    argv = shlex.split(line)
    assert argv[:2] == ["fenced", "check"]
    args = _parser().parse_args(argv[1:])
    assert (args.source, args.resource, args.resource_cmd, args.lock) == (
        options["source"], options["resource"], options["resource_cmd"], "orders"
    )  # fmt: skip
    assert (args.time, args.ttl, args.signing, args.faults, args.writes, args.seed) == (
        12.5, 2.0, True, 2, 0, 7
    )  # fmt: skip
    assert args.nemesis == "pause,stall,race" and args.workers == 3 and not args.plant
