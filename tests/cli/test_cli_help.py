"""Every example in every ``--help`` of the ``fenced`` command runs as shown.

The examples are read from the help texts themselves (the ``examples:`` section of each
epilog), so a help text cannot start lying later: a new example is run as soon as it is
written. Each command's examples run in order, in a temporary directory of their own, with
``$FENCED_URL`` naming a temporary SQLite file; machine paths (``/var/lib/app``) are moved into
the temporary directory and ``source.url`` holds the source's URL, nothing else is changed.
``# exit N`` after an example is the status it must end with (default 0).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fenced.cli import main
from tests.helpers import ROOT

FENCED = [sys.executable, "-m", "fenced"]
# The width argparse wraps to: a process whose output is a pipe wraps to 80 columns; the texts
# made in this process (below) are told the same, whatever terminal pytest runs in.
COLUMNS = {"COLUMNS": "80"}


def _help_process(*command: str) -> str:
    """``fenced COMMAND --help`` as a user's shell runs it: a process of its own."""
    out = subprocess.run(
        [*FENCED, *command, "--help"],
        capture_output=True, text=True, timeout=60, check=True, env={**os.environ, **COLUMNS},
    )  # fmt: skip
    return out.stdout


def _help(*command: str) -> str:
    """The same text, printed by ``fenced.cli.main`` in this process. The test modules are
    collected in every xdist worker (and once more before them): one ``fenced`` process per
    command there cost each worker ~15 processes, 2 s of CPU and 5 s of its start; the texts
    are checked against the real process's in the test (test_every_help_example_runs_as_shown,
    test_the_top_level_help_lists_every_command)."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as env, contextlib.redirect_stdout(out):
        env.setenv("COLUMNS", COLUMNS["COLUMNS"])
        try:
            main([*command, "--help"])
        except SystemExit as exc:
            assert exc.code in (0, None), exc.code
    return out.getvalue()


def _commands(text: str) -> list[str]:
    """The subcommands, as the top-level help ``text`` lists them."""
    listed = re.findall(r"^    ([a-z][a-z-]*)  ", text, flags=re.M)
    assert "lock" in listed, "the top-level help lists no commands"
    return listed


def examples(text: str) -> list[tuple[str, int]]:
    """``(command line, expected exit status)`` of each example in a help text."""
    section = text.partition("\nexamples:\n")[2]
    found = []
    for line in section.splitlines():
        if not line.startswith("  "):
            break  # the end of the section
        line = line.strip()
        if line.startswith("fenced "):
            expected = re.search(r"#\s*exit (\d+)", line)
            found.append((line, int(expected.group(1)) if expected else 0))
    return found


HELPS = {"": _help(), **{c: _help(c) for c in _commands(_help())}}


def test_the_commands_that_need_examples_have_them() -> None:
    for command in ("", "lock", "status", "release", "check-token", "keygen", "write", "elect"):
        assert examples(HELPS[command]), f"fenced {command} --help has no example"
    assert "exit status" in HELPS["lock"]  # fenced lock --help lists its exit statuses


def test_the_top_level_help_lists_every_command() -> None:
    """The real ``fenced --help`` is the text the examples were collected from, and lists the
    same commands."""
    text = _help_process()
    assert text == HELPS[""]
    assert sorted(_commands(text)) == sorted(c for c in HELPS if c)


@pytest.mark.parametrize("command", sorted(c for c in HELPS if examples(HELPS[c])))
def test_every_help_example_runs_as_shown(command: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/locks.db"
    (tmp_path / "source.url").write_text(url + "\n")
    (tmp_path / "source.url").chmod(0o600)
    bin_dir = tmp_path / "bin"  # `fenced` inside the examples' shell commands: this checkout's
    bin_dir.mkdir()
    (bin_dir / "fenced").write_text(f'#!/bin/sh\nexec {sys.executable} -m fenced "$@"\n')
    (bin_dir / "fenced").chmod(0o755)
    env = dict(os.environ, FENCED_URL=url, HOME=str(tmp_path))
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = f"{ROOT / 'src'}{os.pathsep}{ROOT}"
    for key in ("FENCED_URL_FILE", "FENCED_SIGNING_KEY", "FENCED_VERIFY_KEY", "FENCING_TOKEN"):
        env.pop(key, None)
    shown = _help_process(*([command] if command else []))  # (what a user's --help prints)
    assert shown == HELPS[command], f"fenced {command} --help differs from the collected text"
    for line, expected in examples(shown):
        shell = line.replace("/var/lib/app", str(tmp_path))
        out = subprocess.run(
            ["sh", "-c", shell], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == expected, f"{line!r}: {out.stdout}{out.stderr}"
        assert "Traceback" not in out.stderr, out.stderr
