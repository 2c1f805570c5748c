"""``fenced elect NAME -- COMMAND``: run COMMAND only while this process leads NAME, and
``fenced poison``: the SBD-style fence command that goes with it.

The sequence on winning (docs/failover.md draws it):

1. elected with epoch E (the lease's fencing token, above every earlier leader's);
2. the fence command runs with the previous leader's identity in its environment
   (``FENCED_PREVIOUS_KNOWN``, ``_VALUE``, ``_HOST``, ``_OWNER``, ``_PID``, ``_PGID``,
   ``_EPOCH``; ``FENCING_TOKEN``, ``FENCED_EPOCH``, ``FENCED_LOCK``) — from the source's record
   of the election's last leader, so a successor that came after the old lease expired knows
   it too — retried with backoff while this process still leads, each attempt killed (its
   process group) at the deadline; COMMAND starts only once it has succeeded (never
   otherwise: no fence, no service, as Pacemaker refuses to start resources without a
   fencing device);
3. this leader records itself (compare-and-set; a later leader recorded there means never
   start), then COMMAND runs in its own process group with ``FENCING_TOKEN`` = E, with a
   watchdog in that group that kills it if this process dies (``fenced/cli/_supervised.py``);
4. **self-fencing**: when the lease is no longer surely held, COMMAND is stopped before any
   successor can be granted — SIGTERM when ``remaining()`` falls to ``--term-grace``, SIGKILL
   when it reaches 0 (the source expires the grant a safety margin later); and at once, with
   SIGKILL, when a poison pill with a higher epoch appears in ``--poison DIR``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from .._core import sync as _sync
from .._core.backoff import Backoff
from .._core.errors import FencedError, RecordConflict
from .._core.fork import whoami
from .._core.names import ELECTION_RECORDS
from .._core.token import validate_lock_name
from ._command import Command, spawn
from ._common import child_environment

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


def record_name(name: str) -> str:
    """The source's record of the election ``name``'s last leader that started its command."""
    return ELECTION_RECORDS + name


class _Previous:
    """The holders seen while campaigning: the latest is a leader the fence command must fence
    even if it never got to record itself."""

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.owner: str | None = None


_NONE = {
    "FENCED_PREVIOUS_KNOWN": "0",
    "FENCED_PREVIOUS_EPOCH": "",
    "FENCED_PREVIOUS_OWNER": "",
    "FENCED_PREVIOUS_VALUE": "",
    "FENCED_PREVIOUS_HOST": "",
    "FENCED_PREVIOUS_PID": "",
    "FENCED_PREVIOUS_PGID": "",
}


def previous_env(record: dict[str, Any] | None, seen: _Previous, mine: int) -> dict[str, str]:
    """``FENCED_PREVIOUS_*`` for the leader with epoch ``mine``: the newest earlier leader, from
    the election's record (kept by the source, so known to every successor however late it
    came) or from a holder seen while campaigning if that one is newer. None at all:
    ``FENCED_PREVIOUS_KNOWN=0`` (no leader of this name ever started its command)."""
    from ..election import leader_value

    recorded = record if record is not None and int(record.get("epoch", 0)) < mine else None
    if (
        seen.epoch is not None
        and seen.epoch < mine
        and (recorded is None or seen.epoch > int(recorded["epoch"]))
    ):
        who, value = leader_value(seen.owner)
        pid = _OWNER_PID.search(who or "")
        return dict(
            _NONE,
            FENCED_PREVIOUS_KNOWN="1",
            FENCED_PREVIOUS_EPOCH=str(seen.epoch),
            FENCED_PREVIOUS_OWNER=who or "",
            FENCED_PREVIOUS_VALUE=value or "",
            FENCED_PREVIOUS_HOST=_host_of(who),
            FENCED_PREVIOUS_PID=pid.group(1) if pid else "",
        )
    if recorded is None:
        return dict(_NONE)
    return dict(
        _NONE,
        FENCED_PREVIOUS_KNOWN="1",
        FENCED_PREVIOUS_EPOCH=str(recorded["epoch"]),
        FENCED_PREVIOUS_OWNER=str(recorded.get("owner", "")),
        FENCED_PREVIOUS_VALUE=str(recorded.get("value", "")),
        FENCED_PREVIOUS_HOST=str(recorded.get("host", "")),
        FENCED_PREVIOUS_PID=str(recorded.get("pid", "")),
        FENCED_PREVIOUS_PGID=str(recorded.get("pgid", "")),
    )


def _host_of(who: str | None) -> str:
    """``host`` of ``user@host pid N``."""
    at = (who or "").partition("@")[2]
    return at.partition(" pid ")[0]


def _read_record(locks: _sync.Locks, name: str) -> tuple[int, dict[str, Any] | None]:
    record = locks.read_record(record_name(name))
    if record is None:
        return 0, None
    try:
        doc = json.loads(record.value)
        int(doc["epoch"])
    except (ValueError, KeyError, TypeError):
        # Not ours, or corrupt: nobody can be named, and a fence command told "no previous
        # leader" might skip fencing one that exists. Fail closed.
        raise FencedError(
            f"the record {record_name(name)!r} is not a fenced elect record"
        ) from None
    return record.version, doc


def _record_leader(locks: _sync.Locks, name: str, doc: dict[str, Any]) -> bool:
    """Record this leader (after fencing, before its command starts); False if a later
    leader has recorded itself already (this one was replaced meanwhile: never start)."""
    while True:
        version, current = _read_record(locks, name)
        if current is not None and int(current["epoch"]) > doc["epoch"]:
            return False
        try:
            locks.swap_record(record_name(name), version, json.dumps(doc))
            return True
        except RecordConflict:
            continue  # another leader's swap came first: look again


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
    import socket

    validate_lock_name(record_name(name))
    _read_record(locks, name)  # a source that keeps no records is refused before campaigning
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
    child: Command | None = None
    try:
        _, record = _read_record(locks, name)
        env = child_environment(  # (the leader's command never gets the source's secrets)
            os.environ,
            FENCING_TOKEN=str(epoch),
            FENCED_EPOCH=str(epoch.value),
            FENCED_LOCK=name,
            **previous_env(record, seen, epoch.value),
        )
        if fence_cmd is not None and not _fence(leader, fence_cmd, env, fence_timeout):
            return EXIT_FENCE_FAILED
        # Held at its first instruction until recorded: a successor's fence command learns
        # this command's process group from the record, however late it comes.
        child = spawn(cmd, env, "fenced elect: ")
        doc = {
            "epoch": epoch.value,
            "token": str(epoch.unsigned()),
            "value": value,
            "owner": whoami(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pgid": child.pgid,
        }
        if not _record_leader(locks, name, doc):
            _say("a later leader has recorded itself; not starting the command")
            return EXIT_LEASE_LOST
        if leader.remaining() <= 0:
            _say("leadership ran out before the command started; not starting it")
            return EXIT_LEASE_LOST
        child.start()
        return _supervise(leader, child, term_grace, poison_dir, name)
    finally:
        if child is not None:
            if child.proc.poll() is None:  # never started, or not stopped: nothing may stay
                child.signal(signal.SIGKILL)
                child.proc.wait()
            child.finish(kill_rest=True)
        with contextlib.suppress(FencedError):
            leader.resign()


def _fence(leader: Any, fence_cmd: str, env: dict[str, str], limit: float) -> bool:
    """Run the fence command until it succeeds, while leading and within ``limit`` seconds;
    an attempt still running at that deadline is killed (its whole process group)."""
    deadline = time.monotonic() + limit
    backoff = Backoff(0.5, 10.0)
    attempt = 0
    while True:
        attempt += 1
        fence = spawn(["sh", "-c", fence_cmd], env, "fenced elect: fence command: ")
        fence.start()
        status: int | None = None
        try:
            # Until the deadline, and while still leading (renewals go on meanwhile).
            while (status := fence.proc.poll()) is None:
                left = min(deadline - time.monotonic(), leader.remaining())
                if left <= 0:
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    fence.proc.wait(min(left, 0.05))
        finally:
            if fence.proc.poll() is None:
                fence.signal(signal.SIGKILL)
                fence.proc.wait()
            fence.finish(kill_rest=True)  # nothing it started outlives it
        if status == 0:
            _say(f"fence command succeeded (attempt {attempt}); starting the command")
            return True
        if status is None:
            _say(
                f"fence command still running after {limit:g} s or past leadership; killed it; "
                "not starting the command"
            )
            return False
        left = min(deadline - time.monotonic(), leader.remaining())
        delay = backoff.next(left, whole=True)  # (a whole pause, or give up now)
        if delay is None:
            _say(
                f"fence command failed {attempt} time(s) (last status {status}); "
                "not starting the command"
            )
            return False
        _say(f"fence command failed with status {status}; again in {delay:g} s")
        time.sleep(delay)


def self_fence(child: Command, why: str, *, grace: float) -> None:
    """Stop the service: SIGTERM, then SIGKILL after ``grace`` seconds (0: SIGKILL now)."""
    _say(f"{why}: stopping the command")
    if grace > 0:
        child.signal(signal.SIGTERM)
        try:
            child.proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            pass
    child.signal(signal.SIGKILL)
    child.proc.wait()


def _supervise(
    leader: Any,
    child: Command,
    term_grace: float,
    poison_dir: str | None,
    name: str,
) -> int:
    epoch = leader.epoch.value
    forward = {s: signal.signal(s, lambda signum, _f: child.signal(signum))
               for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
               if signal.getsignal(s) is not signal.SIG_IGN}  # fmt: skip
    try:
        while child.proc.poll() is None:
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
        code = child.proc.returncode
        return code if code >= 0 else 128 - code
    finally:
        for s, handler in forward.items():
            signal.signal(s, handler)
