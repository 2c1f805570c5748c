"""``fenced elect NAME -- COMMAND``: run COMMAND only while this process leads NAME, and
``fenced poison``: the SBD-style fence command that goes with it.

The sequence on winning (docs/failover.md draws it):

1. elected with epoch E (the lease's fencing token, above every earlier leader's);
2. the fence command runs with the previous leader's identity in its environment
   (``FENCED_PREVIOUS_VALUE``, ``_OWNER``, ``_PID``, ``_EPOCH``; ``FENCING_TOKEN``, ``FENCED_EPOCH``,
   ``FENCED_LOCK``), retried with backoff while this process still leads; COMMAND starts only
   once it has succeeded (never otherwise: no fence, no service, as Pacemaker refuses to
   start resources without a fencing device);
3. COMMAND runs in its own process group with ``FENCING_TOKEN`` = E;
4. **self-fencing**: when the lease is no longer surely held, COMMAND is stopped before any
   successor can be granted — SIGTERM when ``remaining()`` falls to ``--term-grace``, SIGKILL
   when it reaches 0 (the source expires the grant a safety margin later); and at once, with
   SIGKILL, when a poison pill with a higher epoch appears in ``--poison DIR``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from . import _sync
from ._command import spawn
from ._errors import FencedError

__all__ = ["poison", "run_elected"]

EXIT_LEASE_LOST = 75
EXIT_FENCE_FAILED = 79
_OWNER_PID = re.compile(r"\bpid (\d+)\b")


def pill_path(directory: str | os.PathLike[str], name: str) -> Path:
    return Path(directory) / (name.replace("/", "%2F") + ".pill")


def poison(directory: str, name: str, epoch: int, wait: float) -> None:
    """Write the pill for ``name`` (epoch ``epoch``, atomically), then wait ``wait`` seconds:
    the time a live old leader needs to see it and kill its service (SBD's msgwait)."""
    path = pill_path(directory, name)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(f"{epoch}\n")
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    time.sleep(wait)


def read_pill(directory: str | None, name: str) -> int:
    if directory is None:
        return 0
    try:
        return int(pill_path(directory, name).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


class _Previous:
    """The latest holder seen while campaigning: the leader the fence command must fence."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.owner: str | None = None

    def env(self, mine: int) -> dict[str, str]:
        from .election import leader_value

        if self.epoch is None or self.epoch >= mine:
            return {"FENCED_PREVIOUS_EPOCH": "", "FENCED_PREVIOUS_OWNER": "",
                    "FENCED_PREVIOUS_VALUE": "", "FENCED_PREVIOUS_PID": ""}  # fmt: skip
        who, value = leader_value(self.owner)
        pid = _OWNER_PID.search(who or "")
        return {
            "FENCED_PREVIOUS_EPOCH": str(self.epoch),
            "FENCED_PREVIOUS_OWNER": who or "",
            "FENCED_PREVIOUS_VALUE": value or "",
            "FENCED_PREVIOUS_PID": pid.group(1) if pid else "",
        }


def _watch_holders(locks: _sync.Locks, name: str, seen: _Previous, stop: threading.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(FencedError):
            status = locks.status(name)
            if status.token is not None and (seen.epoch is None or status.token.value > seen.epoch):
                seen.epoch, seen.owner = status.token.value, status.owner
        stop.wait(0.1)


def _say(text: str) -> None:
    import sys

    print(f"fenced elect: {text}", file=sys.stderr, flush=True)


def run_elected(
    locks: _sync.Locks,
    name: str,
    cmd: list[str],
    *,
    value: str,
    ttl: float,
    fence_cmd: str | None,
    fence_timeout: float,
    term_grace: float,
    poison_dir: str | None,
    lock_delay: float = 0.0,
) -> int:
    seen = _Previous()
    stop_watch = threading.Event()
    watcher = threading.Thread(
        target=_watch_holders, args=(locks, name, seen, stop_watch), daemon=True
    )
    watcher.start()
    try:
        leader = locks.elect(name, value, ttl=ttl, lock_delay=lock_delay)
    finally:
        stop_watch.set()
        watcher.join(5)
    epoch = leader.epoch
    _say(f"elected leader of {name!r} with epoch {epoch}")
    env = dict(
        os.environ,
        FENCING_TOKEN=str(epoch),
        FENCED_EPOCH=str(epoch.value),
        FENCED_LOCK=name,
        **seen.env(epoch.value),
    )
    try:
        if fence_cmd is not None and not _fence(leader, fence_cmd, env, fence_timeout):
            return EXIT_FENCE_FAILED
        if leader.remaining() <= 0:
            _say("leadership ran out before the command started; not starting it")
            return EXIT_LEASE_LOST
        child = spawn(cmd, env, _say)
        if isinstance(child, int):
            return child
        return _supervise(leader, child, term_grace, poison_dir, name)
    finally:
        with contextlib.suppress(FencedError):
            leader.resign()


def _fence(leader: Any, fence_cmd: str, env: dict[str, str], limit: float) -> bool:
    """Run the fence command until it succeeds, while leading and within ``limit`` seconds."""
    deadline = time.monotonic() + limit
    delay = 0.5
    attempt = 0
    while True:
        attempt += 1
        done = subprocess.run(["sh", "-c", fence_cmd], env=env, check=False)
        if done.returncode == 0:
            _say(f"fence command succeeded (attempt {attempt}); starting the command")
            return True
        left = min(deadline - time.monotonic(), leader.remaining())
        if left <= delay:
            _say(
                f"fence command failed {attempt} time(s) (last status {done.returncode}); "
                "not starting the command"
            )
            return False
        _say(f"fence command failed with status {done.returncode}; again in {delay:g} s")
        time.sleep(delay)
        delay = min(delay * 2, 10.0)


def _kill(child: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signum)


def self_fence(child: subprocess.Popen[bytes], why: str, *, grace: float) -> None:
    """Stop the service: SIGTERM, then SIGKILL after ``grace`` seconds (0: SIGKILL now)."""
    _say(f"{why}: stopping the command")
    if grace > 0:
        _kill(child, signal.SIGTERM)
        try:
            child.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass
    _kill(child, signal.SIGKILL)
    child.wait()


def _supervise(
    leader: Any,
    child: subprocess.Popen[bytes],
    term_grace: float,
    poison_dir: str | None,
    name: str,
) -> int:
    epoch = leader.epoch.value
    forward = {s: signal.signal(s, lambda signum, _f: _kill(child, signum))
               for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}  # fmt: skip
    try:
        while child.poll() is None:
            left = leader.remaining()
            if read_pill(poison_dir, name) > epoch:
                self_fence(child, "a poison pill with a higher epoch", grace=0)
                return EXIT_LEASE_LOST
            if left <= term_grace:
                # Before the lease may have ended: SIGKILL lands by remaining() == 0, and the
                # source grants a successor no sooner than a safety margin after that.
                self_fence(child, f"leadership of {name!r} no longer sure", grace=max(left, 0.0))
                return EXIT_LEASE_LOST
            time.sleep(min(0.05, max(left - term_grace, 0.005)))
        return child.returncode if child.returncode >= 0 else 128 - child.returncode
    finally:
        for s, handler in forward.items():
            signal.signal(s, handler)
