"""`fenced lock` and `fenced elect` keep the source's secrets out of their commands'
environment, but a command could read them from its parent: ``/proc/$PPID/environ`` shows
the environment fenced started with (an outside attack found it, as root and as an ordinary
user). The values are overwritten in place, and the process is made undumpable, so a
process of the same user can read neither its environ nor its memory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced._core.signing import HmacKey, key_text
from tests.helpers import ROOT

NOBODY = 65534
# what the command prints: its parent's environ, one variable a line (or the error)
READ_PARENT = "tr '\\0' '\\n' < /proc/$PPID/environ"

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux")


def _secrets() -> dict[str, str]:
    return {
        "FENCED_SIGNING_KEY": key_text(HmacKey("hk", b"\x11" * 32)).strip(),
        "FENCED_API_KEY": "api-secret-hunter2",
        "FENCED_VERIFY_KEY": key_text(HmacKey("vk", b"\x22" * 32)).strip(),
    }


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FENCED_", "FENCING_"))}
    return {**base, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **extra}


def _assert_hidden(output: str, secrets: dict[str, str]) -> None:
    for name, value in secrets.items():
        assert value not in output, name
    assert "hunter2" not in output and "pw-secret" not in output


@linux_only
def test_fenced_lock_command_cannot_read_the_secrets_from_its_parents_environ(
    tmp_path: Path,
) -> None:
    """As root (which may read any process's environ): the parent's environ still names
    the variables (the read worked), but their values are overwritten."""
    secrets = {**_secrets(), "FENCED_URL": f"sqlite:///{tmp_path}/l.db?password=pw-secret"}
    out = subprocess.run(
        [sys.executable, "-m", "fenced", "lock", "jobs", "--url", f"sqlite:///{tmp_path}/l.db",
         "--source-id", "prod", "--", "sh", "-c", READ_PARENT],
        env=_env(**secrets), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    _assert_hidden(out.stdout + out.stderr, secrets)
    seen = dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)
    for name in ("FENCED_SIGNING_KEY", "FENCED_API_KEY", "FENCED_VERIFY_KEY"):
        assert set(seen[name]) == {"*"}, (name, seen[name])
    assert seen["PYTHONPATH"] == _env()["PYTHONPATH"]  # (what is no secret is left alone)


@linux_only
def test_fenced_elect_commands_cannot_read_the_secrets_from_their_parents_environ(
    tmp_path: Path,
) -> None:
    secrets = _secrets()
    fence_out = tmp_path / "fence.txt"
    out = subprocess.run(
        [sys.executable, "-m", "fenced", "elect", "svc", "--url", f"sqlite:///{tmp_path}/l.db",
         "--fence-cmd", f"{READ_PARENT} > {fence_out}", "--", "sh", "-c", READ_PARENT],
        env=_env(**secrets), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for text in (out.stdout, fence_out.read_text()):
        assert "FENCED_SIGNING_KEY=*" in text  # (the read worked)
        _assert_hidden(text, secrets)


# an interpreter the ordinary user may run (the venv's may live in root's home): fenced's
# core, sqlite and HMAC signing need nothing outside the standard library
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture
def nobody_home() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root, to run as another user")
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"no {SYSTEM_PYTHON}")
    home = Path(tempfile.mkdtemp(prefix="fenced-nobody-"))
    os.chown(home, NOBODY, NOBODY)
    # (a copy of fenced the user may read: the checkout may sit in a directory only root
    # enters, as CI's fresh clone under a 0700 mktemp directory does)
    shutil.copytree(ROOT / "src" / "fenced", home / "src" / "fenced",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@linux_only
def test_fenced_lock_of_an_ordinary_user_is_unreadable_to_its_command(nobody_home: Path) -> None:
    """`fenced lock` and its command both run as uid 65534, the key given to that user: the
    kernel would let the command read its parent's environ and memory; made undumpable, the
    parent's /proc/PID/environ and /proc/PID/mem are refused to it."""
    secrets = _secrets()
    probe = (
        f"{READ_PARENT}; echo environ=$?; "
        "head -c1 /proc/$PPID/mem 2>/dev/null; echo mem=$?; echo uid=$(id -u)"
    )
    out = subprocess.run(
        [SYSTEM_PYTHON, "-m", "fenced", "lock", "jobs", "--url",
         f"sqlite:///{nobody_home}/l.db", "--source-id", "prod", "--", "sh", "-c", probe],
        env=_env(**secrets, HOME=str(nobody_home), PYTHONPATH=str(nobody_home / "src")),
        cwd=nobody_home, preexec_fn=_as_nobody,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "uid=65534" in out.stdout
    _assert_hidden(out.stdout + out.stderr, secrets)
    assert "Permission denied" in out.stderr and "environ=0" not in out.stdout, out
    assert "mem=0" not in out.stdout


@linux_only
def test_hidden_process_still_reads_its_own_proc_self(nobody_home: Path) -> None:
    """After hide_secrets() an ordinary user's process still reads what fenced reads of its
    own /proc/self (stat, status, fd: subprocess's close_fds lists it in the child), and
    os.environ keeps the secrets' real values; only its own environ and mem, now root's,
    are refused to it (fenced reads neither)."""
    secrets = _secrets()
    code = (
        "import os, subprocess; from fenced.cli._hide import hide_secrets; hide_secrets(); "
        "open('/proc/self/stat').read(); open('/proc/self/status').read(); "
        "os.listdir('/proc/self/fd'); os.readlink('/proc/self/exe'); "
        "fds = subprocess.run(['ls', '/proc/self/fd'], capture_output=True, text=True, "
        "check=True, close_fds=True).stdout.split(); "
        "print(os.environ['FENCED_API_KEY'], len(fds) > 0)"
    )
    out = subprocess.run(
        [SYSTEM_PYTHON, "-c", code], env=_env(**secrets, PYTHONPATH=str(nobody_home / "src")),
        cwd=nobody_home,
        preexec_fn=_as_nobody, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["api-secret-hunter2", "True"]
