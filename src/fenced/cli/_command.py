"""Starting the command of ``fenced lock`` and ``fenced elect``: in a process group of its
own (so that stopping it stops the whole job, not only its head), in the supervisor's session
(the terminal stays usable: prompts, editors), and never outliving the supervisor — through
``fenced/cli/_supervised.py``, which runs first in the child (see there why not ``preexec_fn``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["Command", "spawn"]

_FIRST = str(Path(__file__).with_name("_supervised.py"))


class Command:
    """A supervised command: ``proc`` is its first process (its pid is the group's id)."""

    def __init__(self, proc: subprocess.Popen[bytes], pipe: int) -> None:
        self.proc = proc
        self._pipe: int | None = pipe

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def pgid(self) -> int:
        """The command's process group: what to kill to stop all of it."""
        return self.proc.pid

    def start(self) -> None:
        """Let the command run (it waits for this, so that its supervisor can first record it)."""
        if self._pipe is not None:
            with contextlib.suppress(OSError):  # it died already: its status tells
                os.write(self._pipe, b"g")

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)

    def finish(self, *, kill_rest: bool) -> None:
        """The supervisor is done with the command: the watchdog left in its group exits, or
        with ``kill_rest`` SIGKILLs what is left of the group (as when the supervisor dies)."""
        if self._pipe is None:
            return
        if not kill_rest:
            with contextlib.suppress(OSError):
                os.write(self._pipe, b"d")
        os.close(self._pipe)
        self._pipe = None
        _take_terminal_back(self.proc.pid)


def _take_terminal_back(pgid: int) -> None:
    try:
        tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return
    try:
        if os.tcgetpgrp(tty) == pgid:
            old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
            try:
                os.tcsetpgrp(tty, os.getpgrp())
            finally:
                signal.signal(signal.SIGTTOU, old)
    except (OSError, ValueError):  # ValueError: signal.signal off the main thread
        pass
    finally:
        os.close(tty)


def spawn(
    cmd: Sequence[str], env: Mapping[str, str], prefix: str, *, new_session: bool = False
) -> Command:
    """Start ``cmd`` held at its first instruction until :meth:`Command.start`. ``prefix``
    begins the line printed if it cannot be run (exit status 127: not found, 126: not
    executable). ``new_session``: no controlling terminal (``setsid``), as a daemon."""
    read, write = os.pipe()  # both ends close-on-exec; only ``read`` is passed on
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                "-B",
                _FIRST,
                str(read),
                str(os.getpgrp()),
                prefix,
                "--",
                *cmd,
            ],
            env=dict(env),
            pass_fds=(read,),
            start_new_session=new_session,
            process_group=None if new_session else 0,
        )
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return Command(proc, write)
