"""The xdist groups ``tests/conftest.py`` sets are there when xdist reads them.

xdist's worker reads each test's ``xdist_group`` marks in its own
``pytest_collection_modifyitems`` (a plugin registered after the first conftests, a plain
hook): groups set later (in the conftest's ``trylast`` hook, until session 8) never reached it,
and the guards' MySQL environments ran outside the ``mariadb`` group. A plugin registered the
same way reads the marks as xdist does.

And they reach xdist's scheduler (``_group_ids``): under pytest 9.2 and xdist 3.8 none did
(xdist writes the group into ``_nodeid``, which pytest 9.2 no longer reads:
pytest-dev/pytest-xdist#1386), and every group's tests ran spread over all the workers, each
starting the group's servers (the session-10 profile: test_guard_mysql.py's on all six)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT

READER = """
import json


class Reader:  # (as xdist's worker: registered after the first conftests, a plain hook)
    def pytest_collection_modifyitems(self, items):
        groups = {}
        for item in items:
            names = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args})
            groups[item.nodeid] = "_".join(names)
        print("GROUPS " + json.dumps(groups))


def pytest_configure(config):
    config.pluginmanager.register(Reader(), "xdist-like-reader")
"""


def test_the_groups_are_set_before_xdist_reads_them(tmp_path: Path) -> None:
    (tmp_path / "xdist_like_reader.py").write_text(READER)
    path = os.pathsep.join([str(tmp_path), str(ROOT / "src"), str(ROOT)])
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "xdist_like_reader", "-p", "no:cacheprovider",
         "-p", "no:xdist", "--collect-only", "-q", "tests/guards/test_guard_conformance.py",
         "tests/server/test_server.py", "tests/guards/test_guard_s3.py"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": path, "FENCED_TEST_WARMED": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    line = next((x for x in run.stdout.splitlines() if x.startswith("GROUPS ")), None)
    assert line is not None, run.stdout[-3000:] + run.stderr[-3000:]
    groups: dict[str, str] = json.loads(line.removeprefix("GROUPS "))
    mysql = [n for n in groups if "test_guard_conformance" in n and "-mysql" in n]
    assert len(mysql) > 30, mysql  # (the guard suite's MySQL environments)
    assert {groups[n] for n in mysql} == {"mariadb"}
    # the environments on moto's emulator, with every test that uses it: one worker starts it
    moto = [n for n in groups if "test_guard_conformance" in n and ("[s3" in n or "[dynamodb" in n)]
    assert len(moto) > 30, moto
    s3 = [n for n in groups if "test_guard_s3.py" in n]
    assert s3 and {groups[n] for n in moto + s3} == {"moto"}
    others = {groups[n] for n in groups if "test_guard_conformance" in n and n not in mysql + moto}
    assert others and all(g.startswith("source-") for g in others), others
    # a test that shares the module's `fenced serve` runs where the module's others run
    assert groups["tests/server/test_server.py::test_health_ready_and_info"] == (
        "module:tests/server/test_server.py"
    )


def test_xdist_hands_out_a_group_whole_to_one_worker() -> None:
    """A real ``-n 2 --dist loadgroup`` run: the group's tests carry its ``@name`` (what
    xdist's scheduler reads) and all run on one worker. Under pytest 9 with xdist 3.8 the
    suffix xdist writes was lost (pytest-dev/pytest-xdist#1386: ``_nodeid`` became ``_id``),
    and a group's tests were handed out one by one, each worker starting its servers."""
    module = "tests/sources/conformance/test_conformance.py"
    names = [
        "test_repeated_release_is_harmless",
        "test_status_remembers_a_released_or_expired_lock",
        "test_force_release_frees_only_that_grant_and_the_holder_learns",
        "test_tokens_strictly_increase",
    ]
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadgroup", "-v", *(f"{module}::{n}[memory]" for n in names)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": path, "FENCED_TEST_WARMED": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ran = [line.split() for line in run.stdout.splitlines() if " PASSED " in line]
    assert len(ran) == len(names), run.stdout[-3000:]
    assert {r[-1].rsplit("@", 1)[-1] for r in ran} == {"source-memory"}, ran
    assert len({r[0] for r in ran}) == 1, ran  # ([gw0] or [gw1], the same for all)
