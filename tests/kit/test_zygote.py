"""The check kit's fork server (``fenced.testing.check._zygote``): a worker forked from it is
still a real OS process of its own (own process group, own stdin/stdout/log, environment and
working directory; SIGSTOP, SIGCONT and SIGKILL reach it alone; its exit status is its own and
its pid stays its own until it is waited for), without a Python start-up and ``import fenced``
each (~0.15 s of CPU of a worker's ~0.25 s): a campaign's every worker, replacements of
killed ones included, is forked from it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fenced.testing.check import _zygote
from fenced.testing.check._campaign import run_campaign
from fenced.testing.servers import python_env
from tests.helpers import ROOT


def _state(pid: int) -> str:
    """The process's state letter (R, S, T stopped, Z exited and not yet waited for)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:  # (gone: reaped between the open and the read, ESRCH)
        return ""


def _until(predicate: object, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.01)


def _spawn(
    tmp_path: Path, *argv: str, stdin_pipe: bool = True
) -> tuple[_zygote.Worker, dict[str, Any]]:
    env = {**python_env(), "ZYGOTE_TEST": "mine"}
    with open(tmp_path / "log", "wb") as log:
        child = _zygote.spawn(
            "tests.kit.zygote_child", argv, env=env, stderr=log, stdin_pipe=stdin_pipe
        )
    assert isinstance(child, _zygote.Child)  # (not FENCED_CHECK_FORKSERVER=0's Popen)
    assert child.stdout is not None
    return child, json.loads(child.stdout.readline())


def test_a_forked_worker_is_a_process_of_its_own(tmp_path: Path) -> None:
    child, seen = _spawn(tmp_path, "7")
    assert seen["pid"] == child.pid and seen["pgid"] == child.pid  # its own process group
    assert seen["ppid"] != os.getpid()  # the zygote's child, not a start-up of ours
    assert seen["env"] == "mine" and seen["cwd"] == os.getcwd() and seen["argv"] == ["7"]
    os.killpg(child.pid, signal.SIGSTOP)
    _until(lambda: _state(child.pid) == "T")
    os.killpg(child.pid, signal.SIGCONT)
    _until(lambda: _state(child.pid) != "T")
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.05)
    assert child.stdin is not None
    child.stdin.close()  # (as a campaign ends its workers)
    _until(lambda: _state(child.pid) == "Z")  # exited: its pid still its own until waited for
    assert child.wait(10) == 7
    # ...and reaped once it was (the zygote is told so, and waits for it)
    _until(lambda: not Path(f"/proc/{child.pid}").exists() or _state(child.pid) != "Z")
    assert (tmp_path / "log").read_text() == "stdin closed\n"


def test_a_killed_worker_dies_alone_and_its_status_says_so(tmp_path: Path) -> None:
    victim, _ = _spawn(tmp_path, "0")
    other, _ = _spawn(tmp_path, "3")
    os.killpg(victim.pid, signal.SIGKILL)
    assert victim.wait(10) == -signal.SIGKILL
    assert other.poll() is None  # (its sibling, and the zygote, untouched)
    assert other.stdin is not None
    other.stdin.close()
    assert other.wait(10) == 3


def test_two_threads_waiting_for_one_worker_both_get_its_status(tmp_path: Path) -> None:
    child, _ = _spawn(tmp_path, "5")
    got: list[int] = []
    other = threading.Thread(target=lambda: got.append(child.wait(30)))
    other.start()
    assert child.stdin is not None
    child.stdin.close()
    assert child.wait(30) == 5
    other.join(30)
    assert got == [5]


def test_a_worker_that_raises_exits_1_with_its_traceback_in_its_log(tmp_path: Path) -> None:
    child, _ = _spawn(tmp_path, "raise", stdin_pipe=False)  # (/dev/null: read() ends at once)
    assert child.wait(10) == 1
    assert "RuntimeError: a worker's failure" in (tmp_path / "log").read_text()


def test_a_module_that_cannot_be_imported_is_a_clear_error(tmp_path: Path) -> None:
    with open(tmp_path / "log", "wb") as log, pytest.raises(OSError, match="No module named"):
        _zygote.spawn("tests.kit.no_such_worker", [], env=python_env(), stderr=log, stdin_pipe=True)


def test_a_campaigns_workers_and_their_replacements_are_forked(tmp_path: Path) -> None:
    before = _zygote.forked()
    result = run_campaign(
        None, tmp_path / "r", workers=2, ttl=0.5, seconds=90, nemesis=["kill"], seed=3,
        faults=2, writes=6,
    )  # fmt: skip
    assert result.ok, result
    # Every worker, the two first and each killed one's replacement, forked by the zygote.
    assert result.faults["kill"] >= 2
    assert _zygote.forked() - before == 2 + result.faults["kill"]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat_fields(int(entry.name))[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                pass  # (gone meanwhile)
    return found


def _stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def test_fenced_check_forks_its_zygote_from_itself_and_its_workers_from_that(
    tmp_path: Path,
) -> None:
    """``fenced check`` has imported fenced already: its zygote is itself, forked before it
    has a thread (no start-up, no import of its own), and its workers are forked from that
    (the command line they show is the command's, not ``python -m ..._worker``)."""
    argv = [
        sys.executable, "-m", "fenced.cli", "check", "--source", f"sqlite:///{tmp_path}/l.db",
        "--time", "90", "--faults", "1", "--writes", "6", "--ttl", "0.5", "--seed", "3",
        "--workers", "2", "--nemesis", "kill", "--report", str(tmp_path / "r"),
    ]  # fmt: skip
    env = {**python_env(), "PYTHONPATH": str(ROOT / "src")}
    cli = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        own = b"".join(a.encode() + b"\0" for a in argv)  # (its /proc cmdline, once exec'd)
        seen: dict[int, bytes] = {}
        workers: dict[int, bytes] = {}
        deadline = time.monotonic() + 60
        while cli.poll() is None and len(workers) < 2 and time.monotonic() < deadline:
            for pid in _children(cli.pid):
                with contextlib.suppress(OSError):
                    seen[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
                for worker in _children(pid):
                    with contextlib.suppress(OSError):
                        workers[worker] = Path(f"/proc/{worker}/cmdline").read_bytes()
            time.sleep(0.02)  # (watching /proc, bounded by the deadline)
        out, _ = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 0, out
    zygotes = [pid for pid, cmdline in seen.items() if cmdline == own]
    assert len(zygotes) == 1, seen  # forked from the command, not started
    assert len(workers) >= 2 and set(workers.values()) == {own}, workers
