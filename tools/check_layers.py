"""The architecture rules of src/fenced, checked from the source (no imports are run).

    python tools/check_layers.py          # exit 1 and one line per violation, if any

The layers, bottom to top (docs/design.md draws them): a module may import from its own layer
and the layers below, never above.

  core      the token, errors, clock, backend contract, lease state, the one async lease core,
            the sync facade, signing (fenced/_*.py but the ones named below)
  clients   adapters of client libraries: what their errors mean (_grpc_errors, _pg_errors,
            _kazoo_errors, ...), and the etcd transport (_etcd_conn) sources and guards share
  plugins   backends/ (one module a scheme) and guards/ (one module a resource)
  rooms     election, replicated/, server/, testing/ (they stand on what is below)
  cli       the command line (the cli/ package, and __main__)

And between packages (core, clients, backends, guards, election, replicated, server, testing,
cli), only what a package *offers*:
  - no import of another package's private module, except a core/clients module's names that
    its ``__all__`` lists (its declared contract);
  - no import of a private name (``_x``) from another package;
  - no ``obj._x`` on an attribute that only another package defines (its private state).

And no import cycle: every import between fenced's modules counts (at the top, in a function,
under ``TYPE_CHECKING``), so the modules can be read, tested and moved bottom-up.

ALLOWED lists the violations that stood when this check was written (wave 3): each is a debt
to pay (issue 27), and a new one fails ``make test``; a listed one that no longer occurs must be
taken off the list (the check says so), so the list only shrinks.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"

LAYERS = ("core", "clients", "plugins", "rooms", "cli")

_CLIENTS = {
    "_grpc",
    "_grpc_errors",
    "_etcd_conn",
    "_kazoo_errors",
    "_pg_errors",
    "_redis_errors",
    "_sqlite_errors",
}
_CLI = {"cli", "__main__"}  # (the command line's own modules are in the cli/ package)


_LAYER_PACKAGES = {"_core": "core", "_clients": "clients", "cli": "cli"}


# Private names of other libraries that a module uses, which the attribute rule would take for
# a fenced package's (the rule knows only fenced's own definitions).
_ASYNCIO_INTERNALS = {
    # (the fast mode, alone; "_callback", "_run_once": the simulator's loop makes asyncio handles
    # and turns too, 2026-11)
    "fenced._core.portal_fast": {"_run", "_ready", "_scheduled", "_callback", "_run_once"},
}


def package_of(module: str) -> str:
    """The package a module belongs to for these rules: ``fenced.guards.sql`` -> guards.

    Both trees are understood: the root private modules of today (``fenced._core.token``), and the
    layer packages tools/move_layers.py makes of them (``fenced._core.token``,
    ``fenced._clients.grpc_errors``, the ``fenced.cli`` package)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "facade"  # fenced/__init__.py re-exports the public API of every layer
    head = parts[1]
    if head in _LAYER_PACKAGES:
        return _LAYER_PACKAGES[head]
    if len(parts) == 2:
        if head in _CLIENTS:
            return "clients"
        if head in _CLI:
            return "cli"
        if head == "election":
            return "election"
        if head in ("backends", "guards", "replicated", "server", "testing"):
            return head
        return "core"
    return head


def layer_of(package: str) -> int:
    return {
        "core": 0,
        "clients": 1,
        "backends": 2,
        "guards": 2,
        "election": 3,
        "replicated": 3,
        "server": 3,
        "testing": 3,
        "cli": 4,
        # The public API (``import fenced``): any layer above the core may use it; the facade
        # itself re-exports every layer and is not held to the order.
        "facade": 1,
    }[package]


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    rule: str
    what: str

    def key(self) -> str:
        """What identifies a violation in ALLOWED: no line number, which moves with edits."""
        return f"{self.module}: {self.rule}: {self.what.split(' (of ')[0]}"


def modules(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for path in sorted((src / "fenced").rglob("*.py")):
        rel = path.relative_to(src).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _all_of(tree: ast.Module) -> set[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                value = node.value
                if isinstance(value, ast.List | ast.Tuple):
                    return {
                        e.value
                        for e in value.elts
                        if isinstance(e, ast.Constant) and isinstance(e.value, str)
                    }
    return None


def _defined_private_attrs(tree: ast.Module, nodes: list[ast.AST] | None = None) -> set[str]:
    """Private attribute names a module defines: methods, class attributes, self._x = ...
    (``nodes``: the tree's nodes, walked once by the caller)"""
    names: set[str] = set()
    for node in ast.walk(tree) if nodes is None else nodes:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name.startswith("_"):
                names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if node.attr.startswith("_"):
                names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            if node.id.startswith("_"):
                names.add(node.id)
        elif isinstance(node, ast.arg) and node.arg.startswith("_"):
            names.add(node.arg)
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def imports_of(
    m: str,
    tree: ast.Module,
    is_package: bool,
    mods: dict[str, Path],
    nodes: list[ast.AST] | None = None,
) -> dict[str, int]:
    """The fenced modules ``m`` imports (each with the line of its first import): a module
    named in ``from X import name`` counts, else X itself. A package's parents, which Python
    imports on the way, do not (every module would then import the facade, and it them).
    (``nodes``: the tree's nodes, walked once by the caller)"""
    out: dict[str, int] = {}
    for node in ast.walk(tree) if nodes is None else nodes:
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = _resolve(m, is_package, node.level, node.module)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.append(full if full in mods else base)
        else:
            targets = [alias.name for alias in node.names]
        for target in targets:
            if target in mods and target != m:
                out.setdefault(target, node.lineno)
    return out


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import cycles: each strongly connected component of more than one module, as one
    cycle through it that starts at its first module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, {})))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return [_one_cycle(graph, set(c), c[0]) for c in sorted(components)]


def _one_cycle(graph: dict[str, dict[str, int]], members: set[str], start: str) -> list[str]:
    """A shortest cycle from ``start`` back to itself inside one component (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph.get(node, {})):
                if nxt not in members:
                    continue
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if nxt not in parent:
                    parent[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return [start, start]  # not reached: a component of two or more has a cycle through each


def check(src: Path = SRC) -> list[Violation]:
    mods = modules(src)
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in mods.items()}
    # Each tree walked once for the three passes below (walking it three times was 60 % of
    # the check's 2.5 s of CPU, session 9).
    walked = {m: list(ast.walk(t)) for m, t in trees.items()}
    graph = {
        m: imports_of(m, t, mods[m].name == "__init__.py", mods, walked[m])
        for m, t in trees.items()
    }
    exports = {m: _all_of(t) for m, t in trees.items()}
    # Which packages define each private attribute name.
    definers: dict[str, set[str]] = {}
    for m, t in trees.items():
        for name in _defined_private_attrs(t, walked[m]):
            definers.setdefault(name, set()).add(package_of(m))
    found: list[Violation] = []
    for m in trees:
        pkg = package_of(m)
        is_package = mods[m].name == "__init__.py"
        for node in walked[m]:
            found.extend(_check_node(m, pkg, is_package, node, mods, exports, definers))
    for cycle in cycles(graph):
        found.append(
            Violation(cycle[0], graph[cycle[0]][cycle[1]], "import cycle", " -> ".join(cycle))
        )
    return sorted(set(found), key=lambda v: (v.module, v.line, v.rule, v.what))


def _check_node(
    m: str,
    pkg: str,
    is_package: bool,
    node: ast.AST,
    mods: dict[str, Path],
    exports: dict[str, set[str] | None],
    definers: dict[str, set[str]],
) -> Iterator[Violation]:
    if isinstance(node, ast.ImportFrom):
        target = _resolve(m, is_package, node.level, node.module)
        if not target.startswith("fenced"):
            return
        for alias in node.names:
            full = f"{target}.{alias.name}"
            imported = full if full in mods else target
            yield from _check_import(m, pkg, node.lineno, imported, alias.name, mods, exports)
    elif isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.startswith("fenced"):
                yield from _check_import(m, pkg, node.lineno, alias.name, None, mods, exports)
    elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
        if node.attr.startswith("__") and node.attr.endswith("__"):
            return
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            return
        if isinstance(base, ast.Call) and getattr(base.func, "id", None) == "super":
            return
        if node.attr in _ASYNCIO_INTERNALS.get(m, ()):
            return  # the portal's fast mode drives asyncio's own loop (docs/design.md)
        owners = definers.get(node.attr, set())
        if owners and pkg not in owners and "facade" not in owners:
            yield Violation(
                m, node.lineno, "private attribute", f".{node.attr} (of {'/'.join(sorted(owners))})"
            )


def _check_import(
    m: str,
    pkg: str,
    line: int,
    imported: str,
    name: str | None,
    mods: dict[str, Path],
    exports: dict[str, set[str] | None],
) -> Iterator[Violation]:
    if imported not in mods:
        return
    other = package_of(imported)
    if pkg != "facade" and layer_of(other) > layer_of(pkg):
        yield Violation(m, line, "upward import", f"{imported} ({other} above {pkg})")
    if other == pkg:
        return
    is_module_import = name is None or imported.endswith(f".{name}")
    private_module = any(p.startswith("_") and p != "__init__" for p in imported.split(".")[1:])
    dunder = name is not None and name.startswith("__") and name.endswith("__")
    if not is_module_import and name is not None and name.startswith("_") and not dunder:
        yield Violation(m, line, "private name", f"{name} from {imported}")
        return
    if private_module:
        offered = exports.get(imported)
        if other in ("core", "clients") and not is_module_import:
            if offered is not None and name in offered:
                return
            yield Violation(m, line, "not offered", f"{name} from {imported} (not in its __all__)")
        elif other in ("core", "clients") and is_module_import:
            # `from . import _fork`, `from .._core import clock`: a core module used as a
            # whole is its contract.
            return
        else:
            what = f"{name} from {imported}" if name and not is_module_import else imported
            yield Violation(m, line, "private module", f"{what} (a private module of {other})")


ALLOWED_FILE = ROOT / "tools" / "layers-allowed.txt"


def allowed() -> set[str]:
    if not ALLOWED_FILE.exists():
        return set()
    return {
        line.strip()
        for line in ALLOWED_FILE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }


def main(argv: list[str]) -> int:
    found = check()
    if "--write-allowed" in argv:
        keys = sorted({v.key() for v in found})
        ALLOWED_FILE.write_text(
            "# Architecture debts that stood when tools/check_layers.py was written: each is to\n"
            "# be paid (issue 27); the list may only shrink.\n" + "\n".join(keys) + "\n"
        )
        print(f"{len(keys)} written to {ALLOWED_FILE.relative_to(ROOT)}")
        return 0
    ok = allowed()
    new = [v for v in found if v.key() not in ok]
    gone = sorted(ok - {v.key() for v in found})
    paths = modules()
    for v in new:
        print(f"{paths[v.module].relative_to(ROOT)}:{v.line}: {v.rule}: {v.what}")
    for key in gone:
        print(f"no longer occurs, take it off tools/layers-allowed.txt: {key}")
    return 1 if new or gone else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
