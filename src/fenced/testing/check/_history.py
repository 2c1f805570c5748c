"""Histories: what each worker saw, as it happened, in one append-only JSONL file.

Every line is one event, written with a single ``write`` on a file opened ``O_APPEND`` (so
lines of several processes never interleave) and fsynced before the worker goes on (so a
worker killed with SIGKILL has recorded everything it did before). Times are
:func:`fenced._core.clock.now` (``CLOCK_BOOTTIME``: one clock for every process of the machine)
and the wall clock (for people).

Events (``op``) and their fields besides ``worker``, ``op``, ``mono``, ``wall``:

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
* ``read``: ``ok`` and ``value`` (the counter read), or ``ok`` False: the fenced read was
  refused (stale); ``error``: a step that failed
  (``step``, ``error``); ``stalled``: the worker stopped itself in its critical section;
  ``nemesis``: a fault (``kind``, ``victim``, ``seconds``)
* ``final``: what the resource holds at the end: ``mark`` (its high-water mark) and ``log``,
  the accepted writes in the resource's own order, as ``[token, value]`` pairs
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ..._core import clock as _clock

__all__ = ["Event", "History", "read_history"]

Event = dict[str, Any]


class History:
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
    """Every complete event of the file (a last line cut short by a kill is dropped)."""
    events = []
    for line in Path(path).read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events
