"""tools/move_layers.py on a small tree of the same shape: the modules land in their layer
packages, every kind of import is rewritten (absolute, relative at each depth, whole modules
keeping their names, inside functions, in strings of code, docs), the CLI's root helpers join
the cli package when it is one, the result imports and runs, and a second run changes
nothing. (The whole tree was moved this way too, on a clone: see the commit that adds this.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import move_layers  # noqa: E402

TREE = {
    "src/fenced/__init__.py": "from ._token import FencingToken\n__all__ = ['FencingToken']\n",
    "src/fenced/_token.py": "__all__ = ['FencingToken']\nclass FencingToken:\n    value = 7\n",
    "src/fenced/_clock.py": "__all__ = ['now']\ndef now() -> float:\n    return 1.0\n",
    "src/fenced/_grpc.py": "import os\nos.environ.setdefault('X_FIRST', '1')\n",
    "src/fenced/_lease.py": textwrap.dedent(
        """
        from . import _clock, _grpc  # noqa: F401
        from ._token import FencingToken

        def later() -> float:
            from ._clock import now
            return now() + _clock.now() + FencingToken.value
        """
    ),
    "src/fenced/backends/__init__.py": "",
    "src/fenced/backends/memory.py": "from .. import _clock\nfrom .._lease import later\n",
    "src/fenced/testing/__init__.py": "",
    "src/fenced/testing/sim/__init__.py": "from ... import _clock\nfrom ..._token import (\n"
    "    FencingToken,  # the one token\n)\n",
    "src/fenced/cli/__init__.py": "def main() -> int:\n    from .._elect_cmd import run\n"
    "    return run()\n",
    "src/fenced/_elect_cmd.py": "from . import _clock\nfrom ._lease import later\n"
    "def run() -> int:\n    return int(later() + _clock.now())\n",
    "src/fenced/_unknown.py": "X = 1\n",
    "tests/test_x.py": "import fenced._clock\nfrom fenced import _clock\n"
    "from fenced._lease import later\n"
    "CODE = 'from fenced import _clock\\nprint(_clock.now())'\n"
    "TARGET = 'fenced._clock.now'\n",
    "docs/design.md": "# Design\n\nThe clock is `fenced/_clock.py` (`fenced._clock.now`).\n\n"
    "| layer | modules | what it is |\n|---|---|---|\n| core | old | old |\n\n"
    "`import fenced` (the public API) may be used by every layer above the core.\n",
    "CHANGELOG.md": "- `fenced/_clock.py` was added (history: kept)\n",
}


def _run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "move_layers.py"), "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_move_rewrites_every_import_and_runs_twice_to_the_same_tree(tmp_path: Path) -> None:
    for rel, text in TREE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    git = ["git", "-C", str(tmp_path), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], check=True)
    # The move of the real tree leaves this test's tree as it is (it holds the old names).
    assert "tests/project/test_move_layers.py" in move_layers.NOT_REWRITTEN

    first = _run(tmp_path, "--no-ruff")
    assert "src/fenced/_token.py -> src/fenced/_core/token.py" in first.stdout, first
    assert "src/fenced/_grpc.py -> src/fenced/_clients/grpc.py" in first.stdout
    assert "src/fenced/_elect_cmd.py -> src/fenced/cli/_elect_cmd.py" in first.stdout
    assert "left at the root (not mapped to a layer): src/fenced/_unknown.py" in first.stderr
    src = tmp_path / "src" / "fenced"
    assert not (src / "_token.py").exists() and (src / "_unknown.py").exists()
    read = {rel: (tmp_path / rel).read_text() for rel in (
        "src/fenced/__init__.py", "src/fenced/_core/lease.py", "src/fenced/backends/memory.py",
        "src/fenced/testing/sim/__init__.py", "src/fenced/cli/_elect_cmd.py",
        "src/fenced/cli/__init__.py", "tests/test_x.py", "docs/design.md", "CHANGELOG.md",
    )}  # fmt: skip
    assert "from ._core.token import FencingToken" in read["src/fenced/__init__.py"]
    lease = read["src/fenced/_core/lease.py"]
    assert "from . import clock as _clock, grpc as _grpc" not in lease  # (clients, not core)
    assert "from . import clock as _clock" in lease
    assert "from .._clients import grpc as _grpc  # noqa: F401" in lease
    assert "    from .clock import now" in lease  # inside a function, indented as it was
    assert "from .._core import clock as _clock" in read["src/fenced/backends/memory.py"]
    assert "from .._core.lease import later" in read["src/fenced/backends/memory.py"]
    sim = read["src/fenced/testing/sim/__init__.py"]
    assert "from ..._core import clock as _clock" in sim
    assert "# the one token" in sim and "from ..._core.token import FencingToken" in sim
    assert "from .._core import clock as _clock" in read["src/fenced/cli/_elect_cmd.py"]
    assert "from .._core.lease import later" in read["src/fenced/cli/_elect_cmd.py"]
    assert "from ._elect_cmd import run" in read["src/fenced/cli/__init__.py"]
    tests = read["tests/test_x.py"]
    assert "import fenced._core.clock\n" in tests
    assert "from fenced._core import clock as _clock\n" in tests
    assert "CODE = 'from fenced._core import clock as _clock\\n" in tests
    assert "TARGET = 'fenced._core.clock.now'" in tests
    assert "`fenced/_core/clock.py` (`fenced._core.clock.now`)" in read["docs/design.md"]
    assert "| core | `fenced/_core/`: `clock`, `lease`, `token` |" in read["docs/design.md"]
    assert "| `fenced/cli/_elect_cmd` |" in read["docs/design.md"]  # the module map
    assert read["CHANGELOG.md"] == TREE["CHANGELOG.md"]

    ran = subprocess.run(
        [sys.executable, "-c", "import sys, fenced.cli, fenced.backends.memory, "
         "fenced.testing.sim as s, os\nprint(fenced.cli.main(), os.environ['X_FIRST'])"],
        env={"PYTHONPATH": str(tmp_path / "src")}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ran.stdout.split() == ["10", "1"], ran

    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "moved"], check=True)
    again = _run(tmp_path, "--no-ruff")
    assert "0 modules moved, 0 files rewritten" in again.stdout, again
    status = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    assert status.stdout == ""
