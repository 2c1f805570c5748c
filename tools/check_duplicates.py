"""Every pair of places in src/ that the `duplicates` command finds sharing six or more same
(or same-shape) lines is an import block or is explained in docs/design.md's table
"Duplication that stays" (issue 27: one piece of code where the logic is the same).

    python tools/check_duplicates.py [SRC_DIR]   # exit 1, with the unexplained pairs

A row of the table names the places as `a` ~ `b` (globs, relative to src/fenced/; either
order), a kind, and why the pair stays. Kinds: ``imports`` (needs no row: every line of
both sides belongs to an import statement), ``parser`` (both sides are the command module's
parser declarations: what reaches past ``def run(`` is shorter than a pair), anything else
(the files only).
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
HEADING = "### Duplication that stays"
_MIN_LINES = 6  # duplicates' default: what makes a pair

_PAIR = re.compile(r"^(D\d+) (\S+):(\d+)-(\d+) ~ (\S+):(\d+)-(\d+)")
_PLACES = re.compile(r"`([^`]+)` ~ `([^`]+)`")
# A line of an import statement: its head, a name (``X,`` / ``X as Y,``) or its closing.
_IMPORT_LINE = re.compile(
    r"^\s*(from \S+ import .*|import \S.*|\)|[A-Za-z_][\w.]*( as \w+)?,?|#.*|)$"
)


@dataclass(frozen=True)
class Side:
    path: str  # relative to src/fenced/
    first: int
    last: int

    def lines(self, package: Path) -> list[str]:
        text = (package / self.path).read_text(encoding="utf-8").splitlines()
        return text[self.first - 1 : self.last]


@dataclass(frozen=True)
class Row:
    a: str
    b: str
    kind: str

    def covers(self, x: Side, y: Side, package: Path) -> bool:
        if not (_match(x.path, self.a) and _match(y.path, self.b)) and not (
            _match(y.path, self.a) and _match(x.path, self.b)
        ):
            return False
        if self.kind == "parser":
            return all(_before_run(s, package) for s in (x, y))
        return True


def _match(path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern)


def _before_run(side: Side, package: Path) -> bool:
    text = (package / side.path).read_text(encoding="utf-8").splitlines()
    starts = [i + 1 for i, line in enumerate(text) if line.startswith("def run(")]
    # (what reaches into run() is shorter than a pair: no duplicate on its own)
    return bool(starts) and side.last - starts[0] + 1 < _MIN_LINES


def rows(design: Path = DESIGN) -> list[Row]:
    """The table's rows: each `a` ~ `b` of a row's first cell, with the row's kind."""
    text = design.read_text(encoding="utf-8")
    if HEADING not in text:
        raise SystemExit(f"{design}: no section {HEADING!r}")
    section = text.split(HEADING, 1)[1].split("\n#", 1)[0]
    found: list[Row] = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not line.startswith("|"):
            continue
        for a, b in _PLACES.findall(cells[0]):
            found.append(Row(a, b, cells[1].strip("`")))
    return found


def pairs(src: Path) -> list[tuple[str, Side, Side]]:
    """The pairs ``duplicates`` lists for ``src`` (every one: --most 200)."""
    tool = shutil.which("duplicates")
    if tool is None:
        raise FileNotFoundError("the duplicates command is not on PATH")
    out = subprocess.run(
        [tool, "--most", "200", "--seconds", "120"],
        cwd=src,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if any(line.startswith(("incomplete:", "(+")) for line in out.splitlines()):
        raise RuntimeError(f"duplicates did not list the whole tree:\n{out}")
    found = []
    for line in out.splitlines():
        m = _PAIR.match(line)
        if m:
            _, p1, f1, l1, p2, f2, l2 = m.groups()
            found.append(
                (
                    line,
                    Side(p1.removeprefix("fenced/"), int(f1), int(l1)),
                    Side(p2.removeprefix("fenced/"), int(f2), int(l2)),
                )
            )
    return found


def is_import_block(side: Side, package: Path) -> bool:
    return all(_IMPORT_LINE.match(line) for line in side.lines(package))


def check(src: Path = ROOT / "src", design: Path = DESIGN) -> list[str]:
    """The pairs neither an import block nor covered by a row of the table."""
    package = src / "fenced"
    table = rows(design)
    unexplained = []
    for line, x, y in pairs(src):
        if is_import_block(x, package) and is_import_block(y, package):
            continue
        if not any(row.covers(x, y, package) for row in table):
            unexplained.append(line)
    return unexplained


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else ROOT / "src"
    unexplained = check(src)
    for line in unexplained:
        print(line)
    if unexplained:
        print(
            f"{len(unexplained)} pairs neither an import block nor in {DESIGN.name}'s "
            f"{HEADING!r}: make them one piece of code, or say there why they stay",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
