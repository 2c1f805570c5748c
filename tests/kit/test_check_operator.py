"""``fenced check`` as an unlucky operator meets it: killed with SIGKILL or SIGHUP mid-run, its
fork server or a worker crashing, a report directory holding the user's files, a resource
that hangs, a password in a URL, bad input. Real processes, real servers, real signals."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced.testing.servers import free_port
from tests.helpers import ROOT

SERVICE = ROOT / "examples" / "inventory_service.py"


def _fenced(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "fenced", "check", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, out, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""  # gone


def _wait(condition: object, limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)  # (polling /proc: nothing to wait on)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.5):
            return True
    except OSError:
        return False


@pytest.fixture
def reaped() -> Iterator[list[int]]:
    """Pids the test saw: SIGKILLed at its end if still there (a failed test leaves none)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _state(pid) not in ("", "Z"):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("forkserver", "sig"),
    [("1", signal.SIGKILL), ("0", signal.SIGKILL), ("1", signal.SIGHUP)],
)
def test_a_killed_or_hung_up_check_leaves_no_process_behind(
    tmp_path: Path, forkserver: str, sig: signal.Signals, reaped: list[int]
) -> None:
    """kill -9 (or a closed terminal's SIGHUP) of ``fenced check`` while a worker is paused:
    the source it started, the resource command it ran and every worker (the stopped one too)
    die with it: nothing under init, the resource's port free for the next run."""
    port = free_port()
    cmd = f"{sys.executable} {SERVICE} --port {port} --db {tmp_path / 'inv.db'}"
    check = _fenced(
        "--source", "redis", "--resource", f"http://127.0.0.1:{port}/items/w",
        "--resource-cmd", cmd, "--nemesis", "pause", "--time", "120", "--report",
        str(tmp_path / "r"), cwd=tmp_path, env={"FENCED_CHECK_FORKSERVER": forkserver},
    )  # fmt: skip
    reaped.append(check.pid)
    seen: set[int] = set()

    def a_worker_is_paused() -> bool:
        now = _descendants(check.pid)
        seen.update(now)
        reaped.extend(now - set(reaped))
        return _accepts(port) and any(_state(p) == "T" for p in now)

    _wait(a_worker_is_paused, 90, "no worker was paused")
    names = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in seen if _state(p)}
    assert any(b"redis-server" in n for n in names.values()), names
    os.kill(check.pid, sig)
    check.communicate(timeout=60)

    def all_gone() -> bool:
        return all(_state(p) in ("", "Z") for p in seen)

    _wait(all_gone, 30, f"left behind: {[names.get(p) for p in seen if _state(p) not in ('', 'Z')]}")
    assert not _accepts(port)
