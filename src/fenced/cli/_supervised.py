"""The first program of a command that ``fenced lock`` / ``fenced elect`` supervises:
``python -I -S _supervised.py FD PGRP PREFIX -- COMMAND ...``, started by
:func:`fenced.cli._command.spawn` in a new process group. It exists so that the command never
outlives its supervisor: Python code may not run between ``fork`` and ``exec`` in a process
that uses gRPC (the etcd source), so what needs doing in the child is done here, in a fresh
interpreter that imported nothing but the standard library.

1. It waits for a ``g`` on FD, the read end of a pipe whose write end only the supervisor
   holds: the supervisor may first record who will run (``fenced elect`` names the command's
   process group to its successors). End of file there — the supervisor died — and nothing runs.
2. It leaves a watchdog in the command's process group, not a child of the command (a shell's
   ``wait`` must not wait for it): it ignores job-control signals, holds no descriptor but FD,
   and reads it. A ``d`` (the supervisor saw the command end) and it exits; end of file (the
   supervisor was killed, even with SIGKILL) and it SIGKILLs the whole process group at once.
3. If the supervisor had the terminal (it was the foreground job), it hands it to the
   command's group, so prompts (``sudo``, ``ssh``, editors) work as under ``flock``.
4. It becomes COMMAND (``exec``), with the exit statuses a shell gives when it cannot: 127
   not found, 126 not executable.
"""

import os
import signal
import sys

_WATCHDOG_IGNORES = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGPIPE,
)


def _watchdog(fd: int) -> None:
    for signum in _WATCHDOG_IGNORES:
        signal.signal(signum, signal.SIG_IGN)  # only SIGKILL (the supervisor's) ends it
    null = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):  # a reader of the command's output must not wait for the watchdog
        os.dup2(null, std)
    os.closerange(3, fd)
    os.closerange(fd + 1, 65536)
    try:
        said = os.read(fd, 1)
    except OSError:
        said = b""
    if said != b"d":
        os.killpg(0, signal.SIGKILL)  # the supervisor is gone: so is every process of its command
    os._exit(0)


def _take_terminal(supervisor_pgrp: int) -> None:
    try:
        tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:
        return  # no controlling terminal
    try:
        if os.tcgetpgrp(tty) == supervisor_pgrp:  # the supervisor is the foreground job
            old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
            try:
                os.tcsetpgrp(tty, os.getpgrp())
            finally:
                signal.signal(signal.SIGTTOU, old)
    except OSError:
        pass
    finally:
        os.close(tty)


def _dispositions_as_inherited() -> None:
    """Undo what Python's start-up did to signals, so the command gets the dispositions its
    supervisor was given (exec keeps only "ignored"): Python ignores SIGPIPE and SIGXFSZ
    (a command would see EPIPE instead of dying in `cmd | head`), and turns SIGINT into
    KeyboardInterrupt (a Ctrl-C before exec would print a traceback) unless it was ignored."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def main() -> None:
    _dispositions_as_inherited()
    fd, supervisor_pgrp, prefix = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    cmd = sys.argv[5:]
    try:
        go = os.read(fd, 1)
    except OSError:
        go = b""
    if go != b"g":
        os._exit(0)  # the supervisor died (or gave up) before the command could start
    first = os.fork()
    if first == 0:  # the watchdog is a grandchild: not the command's child once it execs
        if os.fork() == 0:
            _watchdog(fd)
        os._exit(0)
    os.waitpid(first, 0)
    os.close(fd)
    _take_terminal(supervisor_pgrp)
    try:
        os.execvp(cmd[0], cmd)
    except FileNotFoundError:
        print(f"{prefix}command not found: {cmd[0]}", file=sys.stderr, flush=True)
        os._exit(127)
    except OSError:  # PermissionError, ENOEXEC, a directory: as a shell says it
        print(f"{prefix}cannot execute: {cmd[0]}", file=sys.stderr, flush=True)
        os._exit(126)


if __name__ == "__main__":
    main()
