"""The pinned test environment (requirements/dev.lock) holds what pyproject.toml asks for.

`make test` installs the lock, not pyproject's ranges, so a dependency added to or tightened in
pyproject.toml without `make lock` would be missing or too old in CI; this test says so first.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def _pins(text: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)", line)
        if m:
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def _wanted(pyproject: dict[str, object], extra: str) -> list[Requirement]:
    """Every requirement the `extra` pulls in, following `fenced[...]` self-references."""
    project = pyproject["project"]
    assert isinstance(project, dict)
    extras: dict[str, list[str]] = project["optional-dependencies"]
    out = [Requirement(r) for r in project.get("dependencies", [])]
    seen: set[str] = set()
    todo = [extra]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in extras[name]:
            req = Requirement(line)
            if canonicalize_name(req.name) == "fenced":
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def check_lock(pyproject_text: str, lock_text: str) -> list[str]:
    pins = _pins(lock_text)
    env = default_environment()
    problems = []
    for req in _wanted(tomllib.loads(pyproject_text), "dev"):
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None:
            problems.append(f"{req.name} is not in the lock")
        elif not req.specifier.contains(pinned, prereleases=True):
            problems.append(f"{req.name}=={pinned} does not satisfy {req}")
    return problems


def test_the_lock_pins_every_test_dependency_within_pyprojects_range() -> None:
    problems = check_lock(
        (ROOT / "pyproject.toml").read_text(), (ROOT / "requirements/dev.lock").read_text()
    )
    assert not problems, "requirements/dev.lock is stale; run `make lock`: " + "; ".join(problems)


def test_the_lock_check_fails_on_a_new_or_tightened_dependency() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    lock = (ROOT / "requirements/dev.lock").read_text()
    added = pyproject.replace('"pytest>=8",', '"pytest>=8",\n    "no-such-package-xyz>=1",')
    assert added != pyproject
    assert check_lock(added, lock) == ["no-such-package-xyz is not in the lock"]
    tightened = pyproject.replace('"pytest>=8"', '"pytest>=999"')
    assert tightened != pyproject
    assert any("pytest==" in p for p in check_lock(tightened, lock))
