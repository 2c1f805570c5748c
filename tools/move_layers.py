"""Move the root private modules of src/fenced into named layer packages, and rewrite every
reference to them, so that the layers of docs/design.md are folders of the tree (issue 27 §5).

    python tools/move_layers.py [--root DIR] [--dry-run] [--no-ruff] [--docs-only]

What moves where (``git mv``; a module that is not there is skipped, a target that is already
there is left alone, so a second run changes nothing):

  fenced/_core/      the core: _adopt, _backend, _backoff, _ceiling, _clock, _errors, _fork,
                     _leadership, _lease, _options, _paths, _portal, _portal_fast, _signing,
                     _state, _sync, _token -> fenced/_core/<name without its underscore>.py
  fenced/_clients/   what each client library's errors mean and the etcd transport: _grpc,
                     _grpc_errors, _etcd_conn, _kazoo_errors, _pg_errors, _redis_errors,
                     _sqlite_errors -> fenced/_clients/<name without its underscore>.py
  fenced/cli/        the command line's root helpers (_command, _supervised, _console, _demo,
                     _demo_replicated, _elect_cmd, _group_cmd), only if ``fenced/cli/`` is a
                     package by then (issue 27 §5 splits cli.py into one); they keep their
                     names there. While cli is one module they stay at the root: there is no
                     package to put them in, and the split moves them.

Inside a layer package the modules lose their underscore (the package is private already:
``fenced._core.token``); an import that bound the old name keeps binding it
(``from .. import _clock`` becomes ``from .._core import clock as _clock``), so no code but
the imports changes. Any other root private module is reported and left where it is.

What is rewritten, in src/, tests/, bench/, examples/, tools/, docs/, README.md,
pyproject.toml, Makefile and .ci/ (CHANGELOG.md is history and keeps its paths):

  - every import statement, from the syntax tree: absolute (``from fenced._x import a``,
    ``import fenced._x as m``, ``from fenced import _x``) and relative (``from ._x import a``,
    ``from .._x import a``, ``from . import _x, _y``), also inside functions, re-emitted from
    the importing module's new place (a module that moves re-points its own relative imports);
  - then the text: dotted names (``fenced._x.name``: monkeypatch targets, subprocess code,
    logger names, docs) and paths (``fenced/_x.py``, ``src/fenced/_x``);
  - docs/design.md: the layer table and the module map between their markers, written from
    the tree as it is after the move.

Then ruff sorts the imports and formats the files it touched, and tools/check_layers.py runs.
tests/project/test_layers.py's planted trees keep the root layout on purpose (the check reads both):
only its dotted names are rewritten.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CORE = (
    "_adopt",
    "_backend",
    "_backoff",
    "_ceiling",
    "_clock",
    "_errors",
    "_fork",
    "_leadership",
    "_lease",
    "_options",
    "_paths",
    "_portal",
    "_portal_fast",
    "_signing",
    "_state",
    "_sync",
    "_token",
)
CLIENTS = (
    "_etcd_conn",
    "_grpc",
    "_grpc_errors",
    "_kazoo_errors",
    "_pg_errors",
    "_redis_errors",
    "_sqlite_errors",
)
CLI = (
    "_command",
    "_console",
    "_demo",
    "_demo_replicated",
    "_elect_cmd",
    "_group_cmd",
    "_supervised",
)
STAYS = {"__init__", "__main__", "cli"}  # the public facade, ``python -m fenced``, the CLI

TEXT_PLACES = ("src", "tests", "bench", "examples", "tools", "docs", ".ci")
TEXT_FILES = ("README.md", "pyproject.toml", "Makefile")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".ini", ".yml", ".yaml", ".sh", ""}
# History keeps its paths; this script and its test hold the old names on purpose.
NOT_REWRITTEN = {
    "CHANGELOG.md",
    "tools/move_layers.py",
    "tests/project/test_move_layers.py",
    # (they name 0.2.0's module on purpose: what an old pickle holds)
    "src/fenced/_core/token.py",
    "tests/core/test_token.py",
}
ROOT_LAYOUT_KEPT = {"tests/project/test_layers.py"}  # planted trees in the root layout, on purpose

PACKAGE_DOCS = {
    "_core": '''"""The core layer (docs/design.md): the token, the errors, the clock, the backend contract,
the lease state machine, the one async lease core and its sync facade, signing.

Nothing is imported here: each module is imported by its own name, and what a module offers
the layers above is its ``__all__``.
"""
''',
    "_clients": '''"""The clients layer (docs/design.md): what each client library's errors mean, decided once
for the sources, the guards and the members, and the etcd transport they share.

Nothing is imported here: each module is imported by its own name (``_grpc`` first where
gRPC is used: it sets gRPC's environment before gRPC is imported).
"""
''',
}


@dataclass(frozen=True)
class Move:
    old: str  # fenced._token
    new: str  # fenced._core.token

    @property
    def old_path(self) -> str:
        return "src/" + self.old.replace(".", "/") + ".py"

    @property
    def new_path(self) -> str:
        return "src/" + self.new.replace(".", "/") + ".py"


def plan(root: Path) -> tuple[list[Move], list[str]]:
    """Every move this tree calls for (including the done ones, whose rewrites are no-ops),
    and the root private modules nobody mapped."""
    pkg = root / "src" / "fenced"
    cli_is_package = (pkg / "cli" / "__init__.py").exists()
    moves = [Move(f"fenced.{m}", f"fenced._core.{m[1:]}") for m in CORE]
    moves += [Move(f"fenced.{m}", f"fenced._clients.{m[1:]}") for m in CLIENTS]
    if cli_is_package:
        moves += [Move(f"fenced.{m}", f"fenced.cli.{m}") for m in CLI]
    known = {m.old.split(".")[1] for m in moves} | STAYS | (set() if cli_is_package else set(CLI))
    unmapped = sorted(
        p.stem for p in pkg.glob("_*.py") if p.stem not in known and p.stem not in STAYS
    )
    return moves, unmapped


# -- imports, from the syntax tree ---------------------------------------------------------


def module_of(path: str) -> tuple[str, bool] | None:
    """``src/fenced/guards/sql.py`` -> (``fenced.guards.sql``, is a package's __init__)."""
    if not path.startswith("src/") or not path.endswith(".py"):
        return None
    parts = path[len("src/") : -len(".py")].split("/")
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _relative(from_module: str, is_package: bool, target: str) -> tuple[int, str]:
    """(level, module) of a relative import of ``target`` written in ``from_module``."""
    here = from_module.split(".") if is_package else from_module.split(".")[:-1]
    there = target.split(".")
    common = 0
    while common < min(len(here), len(there)) and here[common] == there[common]:
        common += 1
    return len(here) - common + 1, ".".join(there[common:])


def _alias(name: str, asname: str | None) -> str:
    return name if asname is None or asname == name else f"{name} as {asname}"


def rewrite_imports(text: str, path: str, new_path: str, mapping: dict[str, str]) -> str:
    """``text`` (the file at ``path``, going to ``new_path``) with each import that names a
    moved module, or that is relative in a moved module, written for the new tree."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    here = module_of(path)
    there = module_of(new_path)
    moved_file = here is not None and there is not None and here != there
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(lineno: int, col: int) -> int:
        return starts[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode())

    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.ImportFrom):
            new = _import_from(node, here, there, moved_file, mapping)
        else:
            new = _import(node, mapping)
        if new is None:
            continue
        start = offset(node.lineno, node.col_offset)
        assert node.end_lineno is not None and node.end_col_offset is not None
        end = offset(node.end_lineno, node.end_col_offset)
        # Comments inside a parenthesised list go on lines of their own above it.
        comments = re.findall(r"#[^\n]*", text[start:end])
        statement = "\n".join([*comments, *new.split("\n")])
        edits.append((start, end, statement.replace("\n", "\n" + " " * node.col_offset)))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def _import_from(
    node: ast.ImportFrom,
    here: tuple[str, bool] | None,
    there: tuple[str, bool] | None,
    moved_file: bool,
    mapping: dict[str, str],
) -> str | None:
    if node.level > 0:
        if here is None or there is None:
            return None
        target = _resolve(here[0], here[1], node.level, node.module)
    else:
        target = node.module or ""
    if target != "fenced" and not target.startswith("fenced."):
        return None
    groups: list[tuple[str, list[str]]] = []
    changed = False
    for alias in node.names:
        full = f"{target}.{alias.name}"
        if full in mapping:  # a moved module, imported by name from its package
            parent, leaf = mapping[full].rsplit(".", 1)
            item = _alias(leaf, alias.asname or alias.name)
            changed = True
        else:
            parent = _new_name(target, mapping)
            item = _alias(alias.name, alias.asname)
            changed = changed or parent != target
        if groups and groups[-1][0] == parent:
            groups[-1][1].append(item)
        else:
            groups.append((parent, [item]))
    if not changed and not (moved_file and node.level > 0):
        return None
    out = []
    for parent, items in groups:
        if node.level > 0 and there is not None:
            level, rel = _relative(there[0], there[1], parent)
            source = "." * level + rel
        else:
            source = parent
        out.append(f"from {source} import {', '.join(items)}")
    return "\n".join(out)


def _new_name(module: str, mapping: dict[str, str]) -> str:
    for old, new in mapping.items():
        if module == old or module.startswith(old + "."):
            return new + module[len(old) :]
    return module


def _import(node: ast.Import, mapping: dict[str, str]) -> str | None:
    names = [(_new_name(a.name, mapping), a) for a in node.names]
    if all(new == a.name for new, a in names):
        return None
    return "import " + ", ".join(_alias(new, a.asname) for new, a in names)


# -- the text ------------------------------------------------------------------------------


def rewrite_text(text: str, mapping: dict[str, str], paths: bool) -> str:
    for old, new in sorted(mapping.items(), key=lambda kv: -len(kv[0])):
        o_leaf, n_parent, n_leaf = old.split(".")[-1], *new.rsplit(".", 1)
        # `from fenced import _x` in code held in strings (a subprocess's program).
        text = re.sub(
            rf"\bfrom fenced import {re.escape(o_leaf)}\b(?![\w,])",
            f"from {n_parent} import {_alias(n_leaf, o_leaf)}",
            text,
        )
        text = re.sub(rf"(?<![\w.]){re.escape(old)}(?!\w)", new, text)
        if paths:
            o_path, n_path = old.replace(".", "/"), new.replace(".", "/")
            text = re.sub(rf"(?<![\w.]){re.escape(o_path)}(?!\w)", n_path, text)
    return text


def text_files(root: Path) -> Iterable[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in sorted(filter(None, listed.split("\0"))):
        if rel in NOT_REWRITTEN or not (root / rel).is_file():
            continue
        if rel in TEXT_FILES or (
            rel.split("/", 1)[0] in TEXT_PLACES and Path(rel).suffix in TEXT_SUFFIXES
        ):
            yield rel


# -- docs/design.md ------------------------------------------------------------------------

LAYER_ROWS = (
    (
        "core",
        "_core",
        "the token, the errors, the clock, the backend contract, the lease state machine, the "
        "one async lease core and its sync facade (with the election's leaderships, which "
        "`elect` returns), signing and the ceiling verifier",
    ),
    (
        "clients",
        "_clients",
        "what each client library's errors mean, decided once for sources and guards; the "
        "etcd transport (channels, failover, watches) that the etcd source and the etcd "
        "guards share; the one manager of the connections fenced opens for itself",
    ),
)
MAP_START = "<!-- module map: written by tools/move_layers.py from the tree -->"
MAP_END = "<!-- end of the module map -->"


def _first_line(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    except SyntaxError:
        doc = ""
    first = doc.strip().split("\n\n")[0].replace("\n", " ")
    first = re.split(r"(?<=[.:;]) (?=[A-Z(`])", first, maxsplit=1)[0]  # its first sentence
    return first.replace("|", "\\|") or "—"


def layer_table(root: Path) -> str:
    pkg = root / "src" / "fenced"
    rows = ["| layer | modules | what it is |", "|---|---|---|"]
    for layer, folder, what in LAYER_ROWS:
        if (pkg / folder).is_dir():
            names = sorted(p.stem for p in (pkg / folder).glob("*.py") if p.stem != "__init__")
            mods = f"`fenced/{folder}/`: " + ", ".join(f"`{n}`" for n in names)
        else:  # (not moved yet)
            wanted = CORE if layer == "core" else CLIENTS
            names = sorted(p.stem for p in pkg.glob("_*.py") if p.stem in wanted)
            mods = ", ".join(f"`fenced/{n}`" for n in names)
        rows.append(f"| {layer} | {mods} | {what} |")
    rows.append(
        "| plugins | `fenced/backends/` (one module a scheme), `fenced/guards/` (one module a "
        "resource) | token sources and guards |"
    )
    rows.append(
        "| rooms | `fenced/election`, `replicated/`, `server/`, `testing/` | what stands on the "
        "sources and guards |"
    )
    cli = ["`fenced/cli" + ("/`" if (pkg / "cli").is_dir() else "`"), "`__main__`"]
    cli += [f"`{m}`" for m in CLI if (pkg / f"{m}.py").exists()]
    rows.append(f"| cli | {', '.join(cli)} | the command line |")
    return "\n".join(rows) + "\n"


def module_map(root: Path) -> str:
    pkg = root / "src" / "fenced"
    out = [MAP_START, "", "| module | what it is |", "|---|---|"]
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg.parent)
        if "__pycache__" in rel.parts:
            continue
        name = str(rel.with_suffix("")).replace("/__init__", "/")
        out.append(f"| `{name}` | {_first_line(path)} |")
    out += ["", MAP_END]
    return "\n".join(out) + "\n"


def rewrite_design(root: Path) -> bool:
    path = root / "docs" / "design.md"
    if not path.exists():
        return False
    text = path.read_text()
    new = re.sub(
        r"\| layer \| modules \| what it is \|\n(?:\|.*\|\n)+",
        lambda _: layer_table(root),
        text,
        count=1,
    )
    if MAP_START in new:
        head, rest = new.split(MAP_START, 1)
        tail = rest.split(MAP_END, 1)[1]
    else:
        anchor = "`import fenced` (the public API) may be used by every layer above the core.\n"
        if anchor not in new:
            return _write_if_changed(path, text, new)
        head, tail = new.split(anchor, 1)
        head += anchor + (
            "\n### Module map\n\nEvery module of the tree, with the first line of its "
            "docstring.\n\n"
        )
    new = head + module_map(root) + ("\n" + tail.lstrip("\n") if tail.strip() else "")
    return _write_if_changed(path, text, new)


def _write_if_changed(path: Path, old: str, new: str) -> bool:
    if new != old:
        path.write_text(new)
        return True
    return False


# -- the run -------------------------------------------------------------------------------


def git_mv(root: Path, move: Move, dry_run: bool) -> str:
    old, new = root / move.old_path, root / move.new_path
    if not old.exists():
        return "gone" if not new.exists() else "done"
    if new.exists():
        raise SystemExit(f"both {move.old_path} and {move.new_path} exist: resolve by hand")
    if not dry_run:
        new.parent.mkdir(parents=True, exist_ok=True)
        init = new.parent / "__init__.py"
        if not init.exists():
            init.write_text(PACKAGE_DOCS.get(new.parent.name, '"""' + new.parent.name + '"""\n'))
            subprocess.run(["git", "add", str(init.relative_to(root))], cwd=root, check=True)
        subprocess.run(["git", "mv", move.old_path, move.new_path], cwd=root, check=True)
    return "moved"


def ruff(root: Path, files: list[str]) -> None:
    exe = shutil.which("ruff", path=os.path.dirname(sys.executable)) or shutil.which("ruff")
    py = [f for f in files if f.endswith(".py") and (root / f).exists()]
    if not py:
        return
    if exe is None:
        print("ruff not found: sort the imports and format by hand", file=sys.stderr)
        return
    subprocess.run([exe, "check", "--fix", "--select", "I", "-q", *py], cwd=root)
    subprocess.run([exe, "format", "-q", *py], cwd=root, check=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--dry-run", action="store_true", help="say what would move, change nothing")
    ap.add_argument("--no-ruff", action="store_true", help="do not sort imports and format")
    ap.add_argument(
        "--docs-only",
        action="store_true",
        help="only write docs/design.md's layer table and module map from the tree as it is",
    )
    args = ap.parse_args(argv)
    root: Path = args.root.resolve()
    if args.docs_only:
        print("docs/design.md", "written" if rewrite_design(root) else "already true")
        return 0
    moves, unmapped = plan(root)
    mapping = {m.old: m.new for m in moves}
    new_paths = {m.old_path: m.new_path for m in moves}
    for name in unmapped:
        print(f"left at the root (not mapped to a layer): src/fenced/{name}.py", file=sys.stderr)

    touched: list[str] = []
    for rel in text_files(root):
        path = root / rel
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new = text
        if rel.endswith(".py"):
            new = rewrite_imports(new, rel, new_paths.get(rel, rel), mapping)
        new = rewrite_text(new, mapping, paths=rel not in ROOT_LAYOUT_KEPT)
        if new != text:
            touched.append(new_paths.get(rel, rel))
            if not args.dry_run:
                path.write_text(new)
    done = {m.old: git_mv(root, m, args.dry_run) for m in moves}
    for m in moves:
        if done[m.old] == "moved":
            print(f"{m.old_path} -> {m.new_path}")
    if args.dry_run:
        print(f"{len(touched)} files would be rewritten")
        return 0
    if rewrite_design(root):
        touched.append("docs/design.md")
    if not args.no_ruff:
        ruff(root, touched)
    print(
        f"{sum(v == 'moved' for v in done.values())} modules moved, {len(touched)} files rewritten"
    )
    check = root / "tools" / "check_layers.py"
    if check.exists():
        env = {**os.environ, "PYTHONPATH": str(root / "src")}
        return subprocess.run([sys.executable, str(check)], cwd=root, env=env).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
