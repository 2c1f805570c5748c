"""Histories: what every process of a campaign saw, as it happened, in one append-only JSONL
file — one schema for every workload of the kit (locks, replicated groups) and the simulator.

Every line is one event, written with a single ``write`` on a file opened ``O_APPEND`` (so
lines of several processes never interleave) and fsynced before the process goes on (so a
process killed with SIGKILL has recorded everything it did before). Every event has
``worker`` (who saw it: a worker, ``nemesis``, ``forger``, ``impostor``, ``operator``,
``final``), ``pid``,
``op``, ``mono`` (:func:`fenced._core.clock.now`, ``CLOCK_BOOTTIME``: one clock for every
process of the machine; every other time field of an event is on it too) and ``wall`` (the
wall clock, for people); then the fields of its ``op``.

Both workloads: ``nemesis``: a fault (``kind``, ``victim``, ``seconds``); ``error``: a step
that failed (``step``, ``error``).

The locks workload (``_worker``, checked by ``_checkers``):

* ``grant``: ``lock``, ``token``, ``surely_until`` (mono + the lease's ``remaining()``, as
  the worker believes it), ``remaining`` (what ``remaining()`` said)
* ``lost``: ``lock``, ``token``, ``promised`` (the latest end its ``remaining()`` had
  promised, as the worker saw it every 50 ms while it thought): the worker learnt its lease was lost (while
  it held it, or while its release was under way)
* ``releasing``: ``lock``, ``token``, written just before a release is sent (a worker killed
  while releasing has let go all the same)
* ``release``: ``lock``, ``token``, ``released`` (what the source said), ``sent`` (mono when
  the release was sent: the next grant may come before the answer)
* ``write``: ``lock``, ``token``, ``value``, ``ok`` (accepted, refused as stale, or None: no
  answer, it may have landed), ``sent`` (mono when it was sent), ``remaining`` (the worker's
  view of its lease then), ``lost`` (whether it knew its lease lost as it sent), ``promised``
  (as in ``lost``)
* ``read``: ``ok``, ``value`` (the counter read) and ``seen`` (:func:`digest` of the bytes
  read), or ``ok`` False: the fenced read was refused (stale); ``stalled``: the worker
  stopped itself in its critical section
* the ``race`` nemesis' burst (lane ``burst``): each stale ``write`` sent again under the
  stale holder's token, ``burst`` (its copy's number) and ``of`` (the holder); then a
  ``look``: the register read without a token once the burst is over and before the
  successor's write, ``sent``, ``seen`` (:func:`digest`) and ``last`` (its last ``[token,
  value]``, None when empty)
* the forger's and the impostor's ``write`` and ``read``: ``forged`` True; the impostor's
  ``impostor`` (what it sent: another lock's token, a malformed one, none), ``header`` (as
  sent) and, once refused, ``mark_after`` (the resource's mark read back at once)
* ``final``: what the resource holds at the end: ``mark`` (its high-water mark) and ``log``,
  the accepted writes in the resource's own order, as ``[token, value]`` pairs

The group workload (``_group_worker``, checked by ``_group_checkers``):

* ``invoke`` / ``complete`` (joined by ``id``): a ``write`` (``key``, ``value``, ``stamp``,
  ``token``) or a ``read`` (``key``; the ``value`` read on completion), ``start`` / ``end``;
  ``ok`` is True, False (refused before anything was written anywhere) or ``"unknown"``
* ``apply``: one member's answer to one change (``member``, ``token``, ``epoch``, ``stamps``,
  ``start``, ``end``, ``ok``)
* ``config``: a configuration a process read or installed (``epoch``, ``members``, ``base``,
  ``id``); ``granted``, ``note``, ``stopped`` (a scenario's stop point, ``at``)
* ``final`` (``member``, ``token``, ``epoch``, ``items``) and ``final_config``: each member's
  whole state and the configuration at the end

:func:`read_history` is the one loader. It reads too the group histories written before this
schema (a file ``history-PROC.jsonl`` a process, events naming their process ``proc``, no
``mono``) and refuses, with :class:`HistoryError`, a file that is neither.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Final

from ..._core import clock as _clock
from ..._core.errors import ConfigurationError

__all__ = ["Event", "History", "HistoryError", "digest", "read_history"]

Event = dict[str, Any]


def digest(data: bytes | None) -> str:
    """A short digest of a register's bytes as read (None: empty), which tells apart two
    states whose entries are the same (the race burst's copies differ in whitespace only)."""
    return hashlib.blake2b(data or b"", digest_size=8).hexdigest()


class HistoryError(ConfigurationError):
    """A history file the kit cannot judge: a line that is not an event of its schema
    (nothing is checked: a verdict on part of a history would be no verdict)."""


class History:
    """One process's writer of a history: :meth:`append` writes an event and (``fsync``, the
    default) syncs it before it returns."""

    def __init__(self, path: str | Path, worker: str, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.worker = worker
        self.fsync = fsync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, op: str, **fields: Any) -> Event:
        event: Event = {
            "worker": self.worker,
            "pid": os.getpid(),
            "op": op,
            "mono": _clock.now(),
            "wall": time.time(),
        }
        event.update(fields)
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        os.write(self._fd, line)
        if self.fsync:
            os.fsync(self._fd)
        return event

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_history(path: str | Path) -> list[Event]:
    """Every event of a history: a file, or a directory holding ``history.jsonl`` (and the
    ``history-*.jsonl`` of the group campaigns before the one schema). A last line cut short
    by a kill is dropped; any other line that is not an event raises :class:`HistoryError`."""
    path = Path(path)
    if not path.is_dir():
        return _read_file(path)
    files = sorted(path.glob("history-*.jsonl"))
    if (path / "history.jsonl").exists():
        files.insert(0, path / "history.jsonl")
    if not files:
        raise HistoryError(f"{path}: no history.jsonl in the directory")
    return [e for f in files for e in _read_file(f)]


def _read_file(path: Path) -> list[Event]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise HistoryError(f"{path}: cannot read the history: {exc}") from exc
    lines = text.split("\n")
    events = []
    for n, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            if n == len(lines):  # (no newline after it: a write cut short by a kill)
                break
            raise HistoryError(f"{path}:{n}: not a JSON line of a history") from None
        events.append(_upgraded(event, path, n))
    return events


# The fields the checkers compute with, by type (checked wherever they appear): a damaged
# or hand-typed value ("5" for 5, a missing token) must be no verdict, not a TypeError or
# KeyError in a checker, nor a number read as something else.
_TIMES: Final = ("mono", "wall", "sent", "surely_until", "remaining", "promised", "start", "end")
_INTS: Final = ("pid", "token", "mark", "epoch")
# The locks workload's events and what its checkers read in each (always present).
_NEEDS: Final = {
    "grant": ("lock", "token", "surely_until"),
    "write": ("lock", "token", "ok"),
    "read": ("lock", "token", "ok"),
    "look": ("sent", "seen"),
    "releasing": ("lock", "token"),
    "release": ("lock", "token"),
    "lost": ("lock", "token"),
}


def _bad_field(event: Event, legacy: bool) -> str | None:
    """What is wrong with ``event``'s fields (None: nothing)."""
    if not legacy and "mono" not in event:
        return "no 'mono'"
    for name in _NEEDS.get(event["op"], ()):
        if name not in event or (event[name] is None and name != "ok"):  # (ok None: no answer)
            return f"no {name!r}"
    if "lock" in event and not isinstance(event["lock"], str):
        return "'lock' is not a str"
    for name in _TIMES:
        value = event.get(name)
        if value is None and (name != "mono" or legacy):  # (the old group files had none)
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{name!r} is not a number"
        if not math.isfinite(value):
            return f"{name!r} is not finite"
    for name in _INTS:
        value = event.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{name!r} is not an int"
    ok = event.get("ok")  # (a group member's "apply" says why it refused: any text)
    if event["op"] in ("write", "read", "complete") and not (
        ok is None or ok is True or ok is False or ok == "unknown"  # (1 == True: no `in`)
    ):
        return "'ok' is not true, false, null or \"unknown\""
    if event["op"] == "final" and "log" in event:
        log = event["log"]
        if log is not None and not (
            isinstance(log, list)
            and all(
                isinstance(x, list)
                and len(x) == 2
                and isinstance(x[0], int)
                and not isinstance(x[0], bool)
                for x in log
            )
        ):
            return "'log' is not a list of [token, value]"
    return None


def _upgraded(event: Any, path: Path, n: int) -> Event:
    """The event in the one schema (a group event before it named its process ``proc``), or
    a :class:`HistoryError`."""
    legacy = False
    if isinstance(event, dict) and "worker" not in event and isinstance(event.get("proc"), str):
        event = {"worker": event.pop("proc"), **event}
        legacy = True
    if not (
        isinstance(event, dict)
        and isinstance(event.get("op"), str)
        and isinstance(event.get("worker"), str)
    ):
        raise HistoryError(
            f"{path}:{n}: not an event of a fenced check history (an object with 'op' and 'worker')"
        )
    bad = _bad_field(event, legacy)
    if bad is not None:
        raise HistoryError(f"{path}:{n}: a {event['op']!r} event of a history, but {bad}")
    return event
