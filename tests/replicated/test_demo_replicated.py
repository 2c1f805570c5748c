"""``fenced demo --replicated`` runs the scenario of the issue with real processes and says
whether it came out as the theory says — and says no when the members do not fence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

PLANT = """
from fenced.guards import sql

def _no_lock_fence(self, conn, **kw):
    return _real(self, conn, **{**kw, "token": None})  # the token never checked

_real = sql.SQLGuard.apply_group
sql.SQLGuard.apply_group = _no_lock_fence
"""


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-no-lock-fence"])
def test_the_replicated_demo_refuses_the_paused_writer_everywhere(
    tmp_path: Path, planted: bool
) -> None:
    env = dict(os.environ, NO_COLOR="1")
    if planted:
        (tmp_path / "sitecustomize.py").write_text(PLANT)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT / "src")])
    out = subprocess.run(
        [sys.executable, "-m", "fenced", "demo", "--replicated", "--dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if planted:
        assert out.returncode == 65, out.stdout + out.stderr
        assert "did not behave as expected" in out.stdout
        return
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert text.count("REFUSED") == 5  # a, b after the resume; a, b, c once c is back
    assert "removed by configuration 2 = {a, b}" in text
    assert "configuration 3 = {a, b, c}" in text
    assert text.count("balance = 250   token mark 2   epoch 3") == 3
