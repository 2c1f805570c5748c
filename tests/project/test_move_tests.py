"""tools/move_tests.py on a small tree of the same shape: the table's files and folders land
in their subsystem folders, a root file the table does not name is placed by its name or
reported, imports, dotted names, paths and ``Path(__file__)``'s parents are rewritten, and a
second run (after a merge brought a new root file and an old import) changes only those."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

TREE = {
    "tests/__init__.py": "",
    "tests/helpers.py": "def wait_for(): ...\n",
    "tests/sources.py": "class Flaky: ...\n",
    "tests/envs/__init__.py": "",
    "tests/envs/base.py": "class BackendEnv: ...\n",
    "tests/conformance/__init__.py": "",
    "tests/conformance/conftest.py": "from tests.envs.base import BackendEnv\n",
    "tests/test_lease_core.py": (
        "from pathlib import Path\n\n"
        "from tests.sources import Flaky\n\n"
        "SRC = Path(__file__).resolve().parent.parent / 'src'\n"
        "TARGET = 'tests.sources:Flaky'\n"
    ),
    "tests/test_sim.py": "START = 1\n",
    "tests/test_sim_gateway.py": "from tests.test_sim import START\n",
    "tests/test_server_x.py": "# see tests/test_sim.py::test_a and tests/envs/base.py\n",
    "tests/test_mystery.py": "",
    "tests/conftest.py": 'LONG = ("tests/test_sim.py::test_a",)\n',
    "docs/testing.md": "`tests/test_sim*` and `tests/envs/` and `tests.sources`\n",
    "CHANGELOG.md": "tests/test_sim.py moved\n",
}


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "move_tests.py"), "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _git(root: Path, *args: str) -> str:
    git = ["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t"]
    return subprocess.run([*git, *args], check=True, capture_output=True, text=True).stdout


def test_the_move_places_rewrites_and_runs_again_to_the_same_tree(tmp_path: Path) -> None:
    for rel, text in TREE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "tree")

    first = _run(tmp_path, "--no-ruff")
    assert first.returncode == 0, first
    assert "tests/test_sim.py -> tests/kit/test_sim.py" in first.stdout  # (by name)
    assert "tests/test_lease_core.py -> tests/core/test_lease_core.py" in first.stdout  # (table)
    assert "not placed (no table entry, no name pattern): tests/test_mystery.py" in first.stderr
    t = tmp_path / "tests"
    assert (t / "test_mystery.py").exists() and not (t / "envs").exists()
    assert (t / "sources/variants.py").exists() and (t / "sources/envs/base.py").exists()
    for folder in ("core", "kit", "server", "sources"):
        assert (t / folder / "__init__.py").exists(), folder
    lease = (t / "core/test_lease_core.py").read_text()
    assert "from tests.sources.variants import Flaky" in lease
    assert "TARGET = 'tests.sources.variants:Flaky'" in lease
    assert "Path(__file__).resolve().parents[2] / 'src'" in lease  # (the same folder)
    assert "from tests.kit.test_sim import START" in (t / "kit/test_sim_gateway.py").read_text()
    assert (t / "sources/conformance/conftest.py").read_text() == (
        "from tests.sources.envs.base import BackendEnv\n"
    )
    assert (t / "server/test_server_x.py").read_text() == (
        "# see tests/kit/test_sim.py::test_a and tests/sources/envs/base.py\n"
    )
    assert (t / "conftest.py").read_text() == 'LONG = ("tests/kit/test_sim.py::test_a",)\n'
    assert (tmp_path / "docs/testing.md").read_text() == (
        "`tests/kit/test_sim*` and `tests/sources/envs/` and `tests.sources.variants`\n"
    )
    assert (tmp_path / "CHANGELOG.md").read_text() == TREE["CHANGELOG.md"]  # (history)

    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "moved")
    second = _run(tmp_path, "--no-ruff")
    assert second.returncode == 0 and second.stdout == "", second
    assert _git(tmp_path, "status", "--porcelain") == ""

    # A merge brings a new root module and a new file written against the old tree.
    (t / "test_guard_new.py").write_text("from tests.test_sim import START\n")
    (t / "kit/test_check_new.py").write_text("from tests.envs.base import BackendEnv\n")
    third = _run(tmp_path, "--no-ruff")
    assert "tests/test_guard_new.py -> tests/guards/test_guard_new.py" in third.stdout, third
    assert (t / "guards/__init__.py").exists()
    assert (t / "guards/test_guard_new.py").read_text() == "from tests.kit.test_sim import START\n"
    assert (t / "kit/test_check_new.py").read_text() == (
        "from tests.sources.envs.base import BackendEnv\n"
    )
