"""Move the test modules into one folder per subsystem, and rewrite every reference to them
(issue 27 §5: tests/{core,sources,guards,server,replicated,kit}/, each kind's environment
registry beside its conformance suite).

    python tools/move_tests.py [--root DIR] [--dry-run] [--no-ruff]

Idempotent: a file that is no longer where the table says is skipped, one whose target is
already there is left alone (reported if the two differ), and the rewrites below leave the
new names as they are, so a second run changes nothing. Files added to tests/ later (other
branches) are placed by their name (PATTERNS); what neither the table nor a pattern places
is reported and left where it is.

What moves (``git mv``):
  - the files of TABLE, to their folder (some under a new name: tests/sources.py would
    collide with the package tests/sources/);
  - the folders of FOLDERS, file by file (tests/envs/ -> tests/sources/envs/, the sources'
    environment registry beside their conformance suite, tests/sources/conformance/);
  - any other tests/test_*.py at the root, by PATTERNS.
Each folder gets an ``__init__.py`` (the tests are the package ``tests``: two folders may
hold modules of the same name).

What is rewritten, in tests/, src/, tools/, docs/, bench/, examples/, clients/, README.md,
pyproject.toml and Makefile (CHANGELOG.md is history and keeps its paths):
  - dotted names (``from tests.envs.base import``, ``"tests.sources:FlakyBackend"``,
    ``python -m tests.envs.sqlite``) and paths (``tests/test_sim.py::test_x`` in node ids,
    ``tests/envs/`` and ``tests/test_check_*`` in the docs);
  - in a moved file, ``Path(__file__)``'s parents, so that ROOT stays the repository's root.
Then ruff sorts the imports and formats the Python files it touched.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# The subsystems (docs/testing.md): the core (lease, token, signing, portal, the clients
# layer), the token sources, the guards, `fenced serve`, the replicated groups, the check kit
# and the simulator, the command line, and the project's own checks (layers, docs, the lock).
# tests/powerloss/ and tests/partitions/ stay: each is one kind of fault across the sources
# and guards, with its own doc (docs/verification*.md), not one subsystem's tests.
TABLE: dict[str, str] = {
    # core
    "test_lease_core.py": "core",
    "test_lease_options.py": "core",
    "test_token.py": "core",
    "test_signing.py": "core",
    "test_portal.py": "core",
    "test_backoff.py": "core",
    "test_contracts.py": "core",
    "test_decorators.py": "core",
    "test_client_errors.py": "core",
    "test_connect_default.py": "core",
    "test_fence_on_acquire.py": "core",
    "test_secrets_in_messages.py": "core",
    # token sources
    "test_backend_etcd.py": "sources",
    "test_backend_postgresql.py": "sources",
    "test_backend_redis.py": "sources",
    "test_backend_sqlite.py": "sources",
    "test_backend_zookeeper.py": "sources",
    "test_sqlite_executor.py": "sources",
    "test_sqlite_group_commit.py": "sources",
    "test_http_client_retry.py": "sources",
    "test_adopt_clients.py": "sources",
    "test_end_to_end.py": "sources",
    "_e2e_worker.py": "sources",
    "test_conformance_catches_bugs.py": "sources",
    "sources.py": "sources/variants.py",  # (tests/sources.py would shadow the package)
    # guards
    "test_guard_asgi.py": "guards",
    "test_guard_etcd.py": "guards",
    "test_guard_files.py": "guards",
    "test_guard_http_errors.py": "guards",
    "test_guard_redis.py": "guards",
    "test_guard_sql.py": "guards",
    "test_guard_wsgi.py": "guards",
    "test_guards_paused_holder.py": "guards",
    "test_token_keyword.py": "guards",
    # fenced serve
    "test_server.py": "server",
    "planted_gateway.py": "server",
    # the check kit, the simulator, the test servers
    "test_proxy.py": "kit",
    "test_servers.py": "kit",
    "check_adapter.py": "kit",
    # the command line
    "test_cli.py": "cli",
    "test_supervise.py": "cli",
    "test_elect_failover.py": "cli",
    "test_unix_users.py": "cli",
    # the project's own checks: the layers, the docs' examples and pictures, the lock
    "test_layers.py": "project",
    "test_move_layers.py": "project",
    "test_move_tests.py": "project",
    "test_duplicates.py": "project",  # (another branch's: `duplicates` on src/)
    "test_lock.py": "project",
    "test_import_cost.py": "project",
    "test_readme.py": "project",
    "test_recipes.py": "project",
    "test_pictures.py": "project",
}
# Folders moved whole (file by file, so one added to the old folder later follows).
FOLDERS: dict[str, str] = {
    "envs": "sources/envs",
    "conformance": "sources/conformance",
}
# A test module at the root that the table does not name: its folder by its name.
PATTERNS: tuple[tuple[str, str], ...] = (
    (r"test_guards?_", "guards"),
    (r"test_(server|gateway|dashboard)", "server"),
    (r"test_(backend|source|sqlite|etcd|zookeeper|redis|postgresql|conformance)", "sources"),
    (r"test_(check|sim|kit|proxy|nemesis|campaign)", "kit"),
    (r"test_(replicated|group|member)", "replicated"),
    (r"test_(cli|elect|supervise)", "cli"),
    (r"test_(lease|token|portal|signing|core|clients?_|backoff)", "core"),
    (r"test_(layers|move_|readme|recipes|pictures|docs|lock|duplicates|import_cost)", "project"),
)
# Shared by several folders: they stay at the root of tests/.
STAYS = {
    "__init__.py",
    "conftest.py",
    "helpers.py",  # bounded waits, unique names (65 imports)
    "cdp.py",  # headless Chromium (the server's dashboard, the docs' pictures)
    "png.py",
}

TEXT_PLACES = ("tests", "src", "tools", "docs", "bench", "examples", "clients")
TEXT_FILES = ("README.md", "pyproject.toml", "Makefile")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".ini", ".yml", ".yaml", ".sh", ""}
SKIP_PARTS = {".venv", "node_modules", "__pycache__", ".git", "build", "target"}
NOT_REWRITTEN = {"CHANGELOG.md", "tools/move_tests.py", "tests/project/test_move_tests.py"}


@dataclass(frozen=True)
class Move:
    old: str  # tests/test_sim.py
    new: str  # tests/kit/test_sim.py

    @property
    def depth_change(self) -> int:
        return self.new.count("/") - self.old.count("/")


def _dotted(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def plan(root: Path) -> tuple[list[Move], list[str]]:
    """Every move of the table and the folders (done or not: the rewrites of done ones are
    no-ops), those the patterns make of the root's other test modules, and what stays
    unplaced."""
    tests = root / "tests"
    moves: list[Move] = []
    for name, where in TABLE.items():
        new = where if where.endswith(".py") else f"{where}/{name}"
        moves.append(Move(f"tests/{name}", f"tests/{new}"))
    for old, new in FOLDERS.items():
        moves.append(Move(f"tests/{old}", f"tests/{new}"))  # (the package's names)
    unplaced: list[str] = []
    for path in sorted(tests.glob("*.py")):
        name = path.name
        if name in TABLE or name in STAYS:
            continue
        where = next((w for p, w in PATTERNS if re.match(p, name)), None)
        if where is None:
            unplaced.append(f"tests/{name}")
        else:
            moves.append(Move(f"tests/{name}", f"tests/{where}/{name}"))
    # Those the patterns moved on an earlier run: their old names are still rewritten (in
    # files merged since from branches that knew the old tree).
    for folder in sorted({w for _, w in PATTERNS}):
        for path in sorted((tests / folder).glob("test_*.py")):
            name = path.name
            if name in TABLE or (tests / name).exists():
                continue
            if next((w for p, w in PATTERNS if re.match(p, name)), None) == folder:
                moves.append(Move(f"tests/{name}", f"tests/{folder}/{name}"))
    return moves, unplaced


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True)


_FILE_PARENTS = re.compile(r"Path\(__file__\)(\.resolve\(\))?((?:\.parent\b)+|\.parents\[(\d+)\])")


def deepen(text: str, by: int) -> str:
    """``text`` (a module moved ``by`` folders deeper) with ``Path(__file__)``'s parents
    counted from its new place: the same folder as before."""

    def repl(m: re.Match[str]) -> str:
        n = int(m.group(3)) + 1 if m.group(3) is not None else m.group(2).count(".parent")
        n += by
        tail = ".parent" if n == 1 else f".parents[{n - 1}]"
        return f"Path(__file__){m.group(1) or ''}{tail}"

    return _FILE_PARENTS.sub(repl, text) if by else text


def move_files(root: Path, moves: list[Move], dry_run: bool) -> tuple[list[Path], list[str]]:
    """``git mv`` what is still to move; the files written, and the conflicts left alone."""
    written: list[Path] = []
    conflicts: list[str] = []
    pairs: list[tuple[Move, str, str]] = []
    for move in moves:
        src = root / move.old
        if src.is_dir():
            for f in sorted(p for p in src.rglob("*") if p.is_file()):
                if "__pycache__" in f.parts:
                    continue
                rel = f.relative_to(src).as_posix()
                pairs.append((move, f"{move.old}/{rel}", f"{move.new}/{rel}"))
        elif src.is_file():
            pairs.append((move, move.old, move.new))
    for move, old, new in pairs:
        src, dst = root / old, root / new
        if dst.exists():
            if dst.read_bytes() != src.read_bytes():
                conflicts.append(f"{old} (and {new}: both there, left alone)")
            continue
        print(f"{old} -> {new}")
        if dry_run:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        tracked = subprocess.run(
            ["git", "-C", str(root), "ls-files", "--error-unmatch", old], capture_output=True
        )
        if tracked.returncode == 0:
            _git(root, "mv", old, new)
        else:  # (a file git does not know yet: moved as it is)
            src.rename(dst)
        if dst.suffix == ".py":
            text = dst.read_text()
            moved = deepen(text, move.depth_change)
            if moved != text:
                dst.write_text(moved)
            written.append(dst)
    if not dry_run:
        for move in moves:  # (a folder emptied by the move goes; only caches were left)
            old = root / move.old
            if old.is_dir() and not any(
                p.is_file() and "__pycache__" not in p.parts for p in old.rglob("*")
            ):
                shutil.rmtree(old)
    return written, conflicts


def ensure_packages(root: Path, moves: list[Move], dry_run: bool) -> list[Path]:
    made = []
    for move in moves:
        folder = (root / move.new).parent
        while folder != root / "tests" and folder.is_relative_to(root / "tests"):
            init = folder / "__init__.py"
            if folder.is_dir() and not init.exists():
                print(f"{init.relative_to(root)} (new)")
                if not dry_run:
                    init.write_text("")
                    _git(root, "add", str(init.relative_to(root)))
                    made.append(init)
            folder = folder.parent
    return made


def rewriters(moves: list[Move], root: Path) -> list[tuple[re.Pattern[str], str]]:
    """(pattern, replacement) for every old dotted name and path; none of them matches a new
    name, so they can run again."""
    subs: list[tuple[re.Pattern[str], str]] = []
    for move in sorted(moves, key=lambda m: -len(m.old)):  # (longest names first)
        old_d, new_d = _dotted(move.old), _dotted(move.new)
        # A name whose new name starts with it (tests.sources -> tests.sources.variants) is
        # only taken whole: ``tests.sources.envs`` is not it.
        stop = r"(?![\w.])" if new_d.startswith(old_d + ".") else r"(?!\w)"
        subs.append((re.compile(rf"(?<![\w.]){re.escape(old_d)}{stop}"), new_d))
        if move.old.endswith(".py"):
            subs.append((re.compile(rf"(?<![\w/.]){re.escape(move.old)}(?!\w)"), move.new))
        else:  # a folder: its path, followed by / or the end of the word
            subs.append((re.compile(rf"(?<![\w/.]){re.escape(move.old)}(?=/|(?!\w))"), move.new))
    # A prefix written in the docs (``tests/test_check_*``, ``tests/test_sim``): rewritten
    # when every module it names went to the same folder.
    by_stem: dict[str, str] = {}
    for move in moves:
        name = move.old.removeprefix("tests/")
        if "/" not in name and name.startswith("test_"):
            by_stem[name.removesuffix(".py")] = move.new.rsplit("/", 1)[0]

    def prefix(m: re.Match[str]) -> str:
        stem = m.group(1)
        folders = {f for s, f in by_stem.items() if s.startswith(stem)}
        return f"{folders.pop()}/{stem}" if len(folders) == 1 else m.group(0)

    subs.append((re.compile(r"(?<![\w/.])tests/(test_\w*)(?!\w*\.py)"), prefix))  # type: ignore[arg-type]
    return subs


def text_files(root: Path) -> list[Path]:
    found = [root / f for f in TEXT_FILES if (root / f).is_file()]
    for place in TEXT_PLACES:
        base = root / place
        if not base.is_dir():
            continue
        for p in sorted(base.rglob("*")):
            rel = p.relative_to(root)
            if SKIP_PARTS & set(rel.parts) or not p.is_file() or p.suffix not in TEXT_SUFFIXES:
                continue
            if rel.as_posix() in NOT_REWRITTEN:
                continue
            found.append(p)
    return found


def rewrite(root: Path, moves: list[Move], dry_run: bool) -> list[Path]:
    subs = rewriters(moves, root)
    changed = []
    for path in text_files(root):
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        new = text
        for pattern, repl in subs:
            new = pattern.sub(repl, new)
        if new != text:
            changed.append(path)
            print(f"rewritten: {path.relative_to(root)}")
            if not dry_run:
                path.write_text(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    ap.add_argument("--no-ruff", action="store_true", help="leave the imports' order as it is")
    args = ap.parse_args(argv)
    root: Path = args.root.resolve()
    moves, unplaced = plan(root)
    written, conflicts = move_files(root, moves, args.dry_run)
    made = ensure_packages(root, moves, args.dry_run)
    changed = rewrite(root, moves, args.dry_run)
    for item in unplaced:
        print(f"not placed (no table entry, no name pattern): {item}", file=sys.stderr)
    for item in conflicts:
        print(f"not moved: {item}", file=sys.stderr)
    touched = sorted({str(p) for p in (*written, *made, *changed) if p.suffix == ".py"})
    if touched and not args.dry_run and not args.no_ruff:
        ruff = [sys.executable, "-m", "ruff"]
        subprocess.run([*ruff, "check", "-q", "--fix", "--select", "I", *touched], check=False)
        subprocess.run([*ruff, "format", "-q", *touched], check=False)
    return 1 if conflicts else 0


if __name__ == "__main__":
    sys.exit(main())
