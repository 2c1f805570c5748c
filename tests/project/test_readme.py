"""The README's examples run as written (paths moved into a temp dir)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_examples(index: int, tmp_path: Path) -> None:
    code = blocks("python")[index].replace("/var/lib/app", str(tmp_path))
    # Twice: on fresh files, then on what the first run left (an example is run again).
    for run in ("fresh", "existing"):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path
        )
        assert out.returncode == 0, f"{run} files: {out.stderr}"


def test_shell_example(tmp_path: Path) -> None:
    (sh,) = [b for b in blocks("sh") if "fenced lock" in b]
    env = dict(os.environ, FENCED_URL=f"sqlite:///{tmp_path}/locks.db", HOME=str(tmp_path))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    out = subprocess.run(["bash", "-euc", sh], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "writing with nightly-report:1" in out.stdout
    assert (tmp_path / "reports" / "report.txt" / "current").exists()  # the guarded write
    assert "free" in out.stdout
