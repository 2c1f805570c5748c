"""Child processes that die with the process that started them (Linux ``PR_SET_PDEATHSIG``).

A process the testing room starts in a session of its own (a server, a user's resource
command, a check worker) survives its parent's SIGKILL: it is re-parented to init and keeps
its port, its data, and (stopped by a nemesis) its SIGSTOP, for ever. A parent-death signal
set in the child kills it instead. It is set in the child before its program runs: by a tiny
launcher that sets it and execs the command (:func:`argv`; kept across ``execve``), or by a
Python prelude (:data:`PRELUDE`). Not with ``preexec_fn``: that is unsafe in a process with
threads (a campaign has some).

The kernel sends the signal when the *thread* that forked the child ends, not the process:
start such children from a thread that lives as long as they must (the main thread).
Elsewhere than Linux nothing is set.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence

__all__ = ["PRELUDE", "argv", "supported"]

_PR_SET_PDEATHSIG = 1

PRELUDE = (
    "import ctypes as _c, os as _o, signal as _s\n"
    f"_c.CDLL(None).prctl({_PR_SET_PDEATHSIG}, int(_s.SIGKILL), 0, 0, 0)\n"
    "if _o.getppid() != globals().get('__parent__', _o.getppid()):\n"
    "    _o._exit(1)\n"
    "del _c, _o, _s\n"
)
"""Python source a child Python runs first (``python -c``, or a fork server's prelude): it is
SIGKILLed when its parent dies. Given ``__parent__`` (:func:`fenced.testing.forkserver.popen`
defines it), a child whose parent died before the signal was set — during a real exec's
Python start-up, tens of milliseconds — exits at once instead of living on re-parented."""

# The launcher: set the signal, then check the parent is still the one that started it (it may
# have died between the fork and the prctl: no signal would come), then exec the command.
_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    f"ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, int(signal.SIGKILL), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "try:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "except OSError as exc:\n"
    "    print(f'{sys.argv[2]}: {exc.strerror}', file=sys.stderr)\n"
    "    os._exit(127)\n"
)


def supported() -> bool:
    """Whether a parent-death signal can be set here (Linux)."""
    return sys.platform.startswith("linux")


def argv(command: Sequence[str], *, other_user: bool = False) -> list[str]:
    """``command`` run through a launcher: the same process (it execs the command: the same
    pid, signals reach it as before), SIGKILLed when this process's calling thread ends. (As
    it is elsewhere than Linux.) ``other_user``: the command runs as another user, who may
    not be allowed to run this interpreter: util-linux's ``setpriv --pdeathsig`` instead
    (without the launcher's check that the parent is still there)."""
    if not supported():
        return list(command)
    if other_user:
        setpriv = shutil.which("setpriv")
        return [setpriv, "--pdeathsig", "KILL", "--", *command] if setpriv else list(command)
    # (-S -E: no site, no PYTHON* variables: a start-up of a few milliseconds, whatever the
    # environment the command is given)
    return [sys.executable, "-S", "-E", "-c", _LAUNCHER, str(os.getpid()), *command]
