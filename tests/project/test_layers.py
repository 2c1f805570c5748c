"""The architecture rules (tools/check_layers.py): no upward import, no private reach across
packages. The tree passes with only its listed debts, and each kind of violation is caught."""

from __future__ import annotations

import functools
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import check_layers  # noqa: E402


@functools.cache
def tree_violations() -> list[check_layers.Violation]:
    """The check of src, once for the two tests of the tree (each ran it: 2 s of CPU)."""
    return check_layers.check()


# (the two tests of the tree on one xdist worker, so that the cache above serves both: on two
# workers each ran the check, ~3 s of CPU each in CI)
TREE = pytest.mark.xdist_group("layers-tree")


@TREE
def test_the_tree_has_no_violation_but_its_listed_debts() -> None:
    found = {v.key() for v in tree_violations()}
    allowed = check_layers.allowed()
    assert not found - allowed, "new violations:\n" + "\n".join(sorted(found - allowed))
    assert not allowed - found, "paid debts still listed in tools/layers-allowed.txt:\n" + (
        "\n".join(sorted(allowed - found))
    )


PLANTED = {
    "fenced/__init__.py": "",
    "fenced/_errors.py": "__all__ = ['FencedError']\nclass FencedError(Exception): ...\n",
    "fenced/_lease.py": textwrap.dedent(
        """
        __all__ = ['AsyncLocks']
        class AsyncLocks:
            def __init__(self) -> None:
                self._backend = None
            def _get_backend(self): ...
        def helper(): ...
        """
    ),
    "fenced/election.py": "from ._lease import AsyncLocks\n",
    "fenced/server/__init__.py": "from ._app import create_app\n__all__ = ['create_app']\n",
    "fenced/server/_app.py": "def create_app(): ...\ndef _route(): ...\n",
    "fenced/guards/__init__.py": "",
    "fenced/testing/__init__.py": "",
    "fenced/guards/sql.py": "from .._errors import FencedError\n",
}


@pytest.mark.parametrize(
    ("where", "code", "rule"),
    [
        ("fenced/_clock.py", "from . import election\n", "upward import"),
        ("fenced/guards/x.py", "from ..server import create_app\n", "upward import"),
        ("fenced/testing/x.py", "from ..server._app import create_app\n", "private module"),
        ("fenced/testing/y.py", "from ..server import _app\n", "private module"),
        ("fenced/guards/y.py", "from .._lease import helper\n", "not offered"),
        ("fenced/testing/z.py", "from ..server._app import _route\n", "private name"),
        (
            "fenced/server/z.py",
            "def f(locks):\n    return locks._get_backend()\n",
            "private attribute",
        ),
    ],
)
def test_each_kind_of_violation_is_caught(tmp_path: Path, where: str, code: str, rule: str) -> None:
    for rel, text in {**PLANTED, where: code}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    found = check_layers.check(tmp_path)
    assert [v.rule for v in found] == [rule], found


def test_what_a_package_offers_passes(tmp_path: Path) -> None:
    for rel, text in PLANTED.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    extra = tmp_path / "fenced" / "server" / "gw.py"
    extra.write_text(
        "from .._lease import AsyncLocks\nfrom ..guards.sql import FencedError\n"
        "def f(locks: AsyncLocks):\n    return locks.backend\n"
    )
    assert check_layers.check(tmp_path) == []


@pytest.mark.parametrize(
    "files",
    [
        # A lazy import in a function closes a cycle as surely as one at the top.
        {
            "fenced/_a.py": "def f():\n    from ._b import g\n    return g\n",
            "fenced/_b.py": "from ._a import f\ndef g(): ...\n",
        },
        # So does one only for the type checker, and one through a third module.
        {
            "fenced/_a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from ._c import C\n",
            "fenced/_b.py": "from . import _a\n",
            "fenced/_c.py": "from ._b import _a\nclass C: ...\n",
        },
    ],
)
def test_a_planted_import_cycle_is_caught(tmp_path: Path, files: dict[str, str]) -> None:
    for rel, text in {**PLANTED, **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    found = check_layers.check(tmp_path)
    assert [v.rule for v in found] == ["import cycle"], found
    cycle = found[0].what.split(" -> ")
    assert cycle[0] == cycle[-1] == "fenced._a", found
    assert set(cycle) == {m.replace("/", ".")[:-3] for m in files}, found


@TREE
def test_the_tree_has_no_import_cycle_but_a_listed_one() -> None:
    """Each cycle the check finds in src is listed (as a debt), and none but the one the CLI's
    package split pays: the core's cycles (the lease and the election, the token and the
    signing) are broken."""
    cycles = [v for v in tree_violations() if v.rule == "import cycle"]
    assert [v.module for v in cycles] in ([], ["fenced.cli._demo"]), cycles
