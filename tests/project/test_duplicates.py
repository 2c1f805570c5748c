"""Logic is written once (issue 27): every pair of places `duplicates` finds in src/ is an
import block or is explained in docs/design.md ("Duplication that stays"); a planted copy
is caught, an import block and an explained pair are not."""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import check_duplicates  # noqa: E402

pytestmark = pytest.mark.skipif(
    shutil.which("duplicates") is None, reason="the duplicates command is not installed"
)

_LOGIC = textwrap.dedent(
    """
    def {name}(conn, resource, token):
        res = conn.execute("SELECT lock, token FROM fence WHERE resource = ?", (resource,))
        if not res.rows:
            raise RuntimeError(f"the fence row of {{resource!r}} vanished while checking")
        lock, value = res.rows[0]
        if value is None:
            raise ValueError("the fence row has no token")
        return lock, value
    """
)

_IMPORTS = textwrap.dedent(
    """
    from .._core.backend import (
        Backend,
        Characteristic,
        Grant,
        LockStatus,
        LostCallback,
        Record,
        lock_timeout,
    )
    """
)

_TABLE = textwrap.dedent(
    """
    # Design

    ### Duplication that stays

    | places | kind | why it stays |
    |---|---|---|
    {rows}

    ## Next
    """
)


def _tree(tmp_path: Path, files: dict[str, str], rows: str = "") -> tuple[Path, Path]:
    src = tmp_path / "src"
    for name, text in files.items():
        path = src / "fenced" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    design = tmp_path / "design.md"
    design.write_text(_TABLE.format(rows=rows))
    return src, design


def test_every_pair_in_src_is_an_import_block_or_explained() -> None:
    unexplained = check_duplicates.check()
    assert not unexplained, (
        "pairs of places neither an import block nor in docs/design.md's 'Duplication that "
        "stays' (make them one piece of code, or add a row saying why they stay):\n"
        + "\n".join(unexplained)
    )


def test_a_planted_copy_of_logic_is_caught(tmp_path: Path) -> None:
    src, design = _tree(
        tmp_path,
        {
            "guards/a.py": _LOGIC.format(name="read_mark"),
            "guards/b.py": "X = 1\n" + _LOGIC.format(name="refusing_row"),
        },
    )
    unexplained = check_duplicates.check(src, design)
    assert len(unexplained) == 1
    assert "guards/a.py" in unexplained[0] and "guards/b.py" in unexplained[0]


def test_a_row_explains_its_pair_and_no_other(tmp_path: Path) -> None:
    files = {
        "guards/a.py": _LOGIC.format(name="read_mark"),
        "guards/b.py": "X = 1\n" + _LOGIC.format(name="refusing_row"),
    }
    row = "| `guards/b.py` ~ `guards/a.py` | twins | planted: both stand |"
    src, design = _tree(tmp_path, files, row)
    assert check_duplicates.check(src, design) == []
    other = "| `guards/a.py` ~ `guards/c.py` | twins | another pair |"
    src, design = _tree(tmp_path / "other", files, other)
    assert len(check_duplicates.check(src, design)) == 1


def test_import_blocks_need_no_row(tmp_path: Path) -> None:
    src, design = _tree(
        tmp_path,
        {
            "backends/a.py": '"""A."""\n' + _IMPORTS + "\nA = Backend\n",
            "backends/b.py": '"""B."""\n\nimport os\n' + _IMPORTS + "\nB = os.sep\n",
        },
    )
    assert check_duplicates.pairs(src), "the planted import blocks are not a pair"
    assert check_duplicates.check(src, design) == []


def test_a_parser_row_covers_only_the_parser(tmp_path: Path) -> None:
    head = textwrap.dedent(
        """
        def add_parser(sub):
            parser = sub.add_parser(
                "{name}",
                help="do {name}",
                description="what {name} does, at length",
            )
            parser.add_argument("--url", help="the source")
            parser.add_argument("--timeout", type=float, help="seconds")
            return parser
        """
    )
    files = {
        "cli/one.py": head.format(name="one") + "\n\ndef run(args):\n    return 0\n",
        "cli/two.py": head.format(name="two") + "\n\ndef run(args):\n    return 1\n",
    }
    row = "| `cli/*.py` ~ `cli/*.py` | `parser` | the command contract |"
    src, design = _tree(tmp_path, files, row)
    assert check_duplicates.pairs(src)
    assert check_duplicates.check(src, design) == []
    logic = {
        "cli/one.py": "def run(args):\n    pass\n" + _LOGIC.format(name="a"),
        "cli/two.py": "def run(args):\n    pass\n" + _LOGIC.format(name="b"),
    }
    src, design = _tree(tmp_path / "logic", logic, row)
    assert len(check_duplicates.check(src, design)) == 1
