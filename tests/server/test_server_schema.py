"""The OpenAPI document of ``fenced serve`` against the server itself: schemathesis (its CLI, in
a subprocess) generates requests from the document and checks every answer against it — no
5xx, declared status codes and content types, 405 with ``Allow``, invalid data refused,
``401`` without a key where the document says a key is needed — on a real ``fenced serve``
with and without keys. Bounded: a deterministic run of 10 examples per operation and phase
(``FENCED_SCHEMA_EXAMPLES`` for more).

Before: bearer security declared on a server without keys, ``422`` declared where ``400`` is
sent, ``246.0`` refused for an integer, no ``request_id``/``lease_id`` requirement, no name
pattern, 405 without ``Allow``, a 500 on a record version of 2^63: each found within seconds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from fenced.server import hash_secret
from fenced.testing.servers import FencedServer

ADMIN = "fk_schema_admin_0000000000000"

# positive_data_acceptance is left out on purpose: the server refuses some requests the
# document cannot describe (a token of another lock, a renewal of a grant that is not held).
CHECKS = ["--checks", "all", "--exclude-checks", "positive_data_acceptance"]

# Cases a operation and phase; FENCED_SCHEMA_EXAMPLES=100 is the long run (`make test-long`).
EXAMPLES = int(os.environ.get("FENCED_SCHEMA_EXAMPLES", "10"))


def _schemathesis() -> list[str]:
    """The schemathesis CLI: this interpreter's (the ``test`` extra installs it), or the one
    ``$FENCED_SCHEMATHESIS`` or ``PATH`` names."""
    if importlib.util.find_spec("schemathesis") is not None:
        return [sys.executable, "-m", "schemathesis.cli"]
    found = os.environ.get("FENCED_SCHEMATHESIS") or shutil.which("schemathesis")
    if not found:
        pytest.skip("schemathesis is not installed (pip install 'fenced[test]')")
    return [found]


def _fuzz(server: FencedServer, tmp_path: Path, headers: Sequence[str] = ()) -> None:
    run = subprocess.run(
        [
            *_schemathesis(),
            "run",
            f"{server.url}/openapi.json",
            *CHECKS,
            "--generation-deterministic",
            # A count, not seconds: `--max-time` repeats fuzzing until the time is spent, so
            # what it covered depended on the machine's load (346 cases under load, and it
            # always took its 20 s); 10 a operation is ~550 cases, the same ones each run.
            "--max-examples",
            str(EXAMPLES),
            "--workers",
            "1",
            "--request-timeout",
            "10",
            "--no-color",
            # A watch is an endless event stream: no answer to check (tests/server/test_server.py).
            "--exclude-path-regex",
            "/-/watch$",
            "--report-dir",
            str(tmp_path / "report"),
            *headers,
        ],
        capture_output=True,
        text=True,
        timeout=240 + 10 * EXAMPLES,  # (the long run: more cases)
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-12000:] + run.stderr[-2000:]
    assert "Tested: 1" in run.stdout, run.stdout[-3000:]  # (it did test operations)


@pytest.fixture
def source(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'locks.db'}"


def test_the_document_and_the_server_agree_without_keys(source: str, tmp_path: Path) -> None:
    server = FencedServer(source, args=["--max-wait", "0.5", "--log-level", "warning"])
    with server:
        _fuzz(server, tmp_path)


def test_the_document_and_the_server_agree_with_keys(source: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(f'[[keys]]\nid = "ops"\nsha256 = "{hash_secret(ADMIN)}"\nverbs = ["admin"]\n')
    server = FencedServer(
        source,
        args=["--api-keys", str(keys), "--max-wait", "0.5", "--log-level", "warning"],
    )
    with server:
        _fuzz(server, tmp_path, ["-H", f"Authorization: Bearer {ADMIN}"])
