"""``fenced`` builds every command's parser on every run, so a command module imports what it
runs (the check kit, the server, the guards, the replicated groups, rich) only in its ``run``:
else every ``fenced lock`` pays for all of them (building ``fenced check``'s parser imported
the check kit, a tenth of a second, for every command)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = re.compile(
    r"^(fenced\.(testing|server|guards|replicated)|rich|fastapi|starlette|uvicorn|pydantic"
    r"|prometheus_client)(\.|$)"
)
# (the server's stack: 0.55 s of CPU for `fenced serve`, none of it for a command that never serves)
SERVER_STACK = re.compile(r"^(fastapi|starlette|uvicorn|pydantic|prometheus_client)(\.|$)")


def _run_importing(args: list[str], cwd: Path) -> tuple[int, str, set[str]]:
    """``fenced ARGS``: its exit status, stdout, and the modules it imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fenced", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=dict(os.environ, COLUMNS="1000"),  # (help on one line a paragraph)
    )
    names = {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    return done.returncode, done.stdout, names


@pytest.mark.parametrize(
    "args",
    [
        "--help",
        "--version",
        "lock --help",
        "lock job --url {url} -- true",
        "status --url {url}",
        "release job --force --url {url}",
    ],
)
def test_a_command_imports_what_it_runs_only_when_it_runs_it(args: str, tmp_path: Path) -> None:
    argv = args.format(url=f"sqlite:///{tmp_path}/l.db").split()
    code, _, names = _run_importing(argv, tmp_path)
    assert code == 0
    assert sorted(n for n in names if HEAVY.match(n)) == []


def test_check_help_still_lists_the_plants(tmp_path: Path) -> None:
    """The other side: the kit is imported when its plants are shown, and they are."""
    code, out, names = _run_importing(["check", "--help"], tmp_path)
    assert code == 0
    assert "fenced.testing.check" in names
    assert sorted(n for n in names if SERVER_STACK.match(n)) == []
    text = " ".join(re.sub(r"-\s+", "-", out).split())  # (argparse wraps at hyphens)
    assert "plant a fault to see it caught" in text
    assert "no-fence, unfenced-read, off-by-one, check-then-write," in text
