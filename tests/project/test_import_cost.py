"""Every `fenced ...` command, and every check-kit worker, is a new Python process: what it
imports it pays for each time (the suite starts many). `fenced --version` and `fenced lock`
on an SQLite source load no client library of another source, no server stack, not the check
kit's campaign machinery (its parser used to, for the --plant help), and do not scan the
installed distributions for entry points (a built-in scheme needs none)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fenced.testing.servers import python_env

HEAVY = ("grpc", "aetcd", "kazoo", "psycopg", "fastapi", "uvicorn", "pydantic", "redis", "boto3")
NOT_NEEDED = ("fenced.testing.check._campaign", "importlib.metadata", "fenced.server")

_PROBE = """
import json, sys
from fenced.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""


def _loaded(*args: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=python_env(),
    )
    return set(json.loads(out.stderr.strip().splitlines()[-1]))


@pytest.mark.parametrize("command", [["--version"], ["lock", "x", "--", "true"]])
def test_a_command_on_the_default_kind_of_source_loads_only_what_it_uses(
    command: list[str], tmp_path: Path
) -> None:
    if command[0] == "lock":
        command = ["lock", "--url", f"sqlite:///{tmp_path}/l.db", *command[1:]]
    loaded = _loaded(*command)
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert not heavy, heavy
    assert not loaded & set(NOT_NEEDED), sorted(loaded & set(NOT_NEEDED))
    assert "fenced.cli" in loaded  # (the probe ran the real CLI)


def test_a_check_kit_worker_does_not_load_the_campaign_machinery() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys, fenced.testing.check._worker; print(json.dumps(sorted(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=python_env(),
    )
    loaded = set(json.loads(out.stdout))
    assert "fenced.testing.check._campaign" not in loaded
    assert "fenced.testing.check._report" not in loaded


def test_the_check_kit_still_offers_every_name_it_did() -> None:
    import fenced.testing.check as kit

    for name in kit.__all__:
        assert getattr(kit, name) is not None, name
    assert set(kit.__all__) <= set(dir(kit))
    with pytest.raises(AttributeError):
        kit.no_such_name  # noqa: B018
