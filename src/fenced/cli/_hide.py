"""Keep the source's secrets of `fenced lock` and `fenced elect` from the processes around
them, as ssh-agent and setproctitle do: the command they run is kept from its *own*
environment's secrets (:func:`~fenced.cli._common.child_environment`), but its parent's
start-up environment is still readable at ``/proc/$PPID/environ``, and its memory by ptrace.

Two steps, Linux only (elsewhere nothing is done):

- the values of the secret variables are overwritten in place in the process's initial
  environment block (the memory ``/proc/PID/environ`` reads; its bounds are fields
  env_start and env_end of ``/proc/self/stat``). Python copied the environment into
  ``os.environ`` at start-up, so fenced still reads them there;
- ``prctl(PR_SET_DUMPABLE, 0)``: a process of the same user can then neither read
  ``/proc/PID/environ`` or ``/proc/PID/mem`` nor ptrace it. The process itself still reads
  its own ``/proc/self``; a program it executes is dumpable again.

The limit: a process running as root (CAP_SYS_PTRACE) still reads the memory, where Python
keeps its copy; one of the same user running before this point can read the environment.
Only `fenced serve` keeps a key from the workload entirely (the key stays in the server).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping

from .._core.backend import redacted

_PR_SET_DUMPABLE = 4


def secret_variables(environ: Mapping[str, str]) -> list[str]:
    """The names of the variables of ``environ`` that hold a secret of the source: the
    signing key, fenced serve's API key, a URL with a password or a secret query parameter,
    an HMAC key's text in $FENCED_VERIFY_KEY (as :func:`child_environment` drops them)."""
    from .._core.signing import is_key_text, is_public_key_text
    from ._common import CHILD_SECRETS

    names = [name for name in CHILD_SECRETS if environ.get(name)]
    url = environ.get("FENCED_URL")
    if url and redacted(url) != url:
        names.append("FENCED_URL")
    verify = environ.get("FENCED_VERIFY_KEY")
    if verify and is_key_text(verify) and not is_public_key_text(verify):
        names.append("FENCED_VERIFY_KEY")
    return names


def _environment_block() -> tuple[int, int] | None:
    """[env_start, env_end) of this process's initial environment, from /proc/self/stat."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Fields after the command name (in parentheses, which may hold spaces or ')'): field 3
    # is the first; env_start and env_end are fields 50 and 51.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        start, end = int(fields[50 - 3]), int(fields[51 - 3])
    except (IndexError, ValueError):
        return None
    return (start, end) if 0 < start < end else None


def _wipe_values(names: list[str]) -> int:
    """Overwrite (with '*') the values of the variables ``names`` in the initial
    environment block; how many were overwritten."""
    block = _environment_block()
    if block is None or not names:
        return 0
    start, end = block
    data = ctypes.string_at(start, end - start)
    wanted = {name.encode() + b"=" for name in names}
    wiped = 0
    offset = 0
    while offset < len(data):
        stop = data.find(b"\0", offset)
        if stop < 0:
            stop = len(data)
        entry = data[offset:stop]
        head = entry[: entry.find(b"=") + 1] if b"=" in entry else b""
        if head in wanted and len(entry) > len(head):
            ctypes.memset(start + offset + len(head), ord("*"), len(entry) - len(head))
            wiped += 1
        offset = stop + 1
    return wiped


def _libc_prctl() -> Callable[..., int] | None:
    # (the process's own symbols, libc's among them: ctypes.util.find_library would run
    # /sbin/ldconfig -p, a process of its own, before every command fenced lock starts)
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


def hide_secrets(environ: Mapping[str, str] | None = None) -> None:
    """Before `fenced lock`/`fenced elect` starts a command: wipe the secrets' values from
    the process's /proc environ and make it undumpable (see the module). Best effort, and
    only on Linux: any step that cannot be done is skipped (never a failure of the command)."""
    if not sys.platform.startswith("linux"):
        return
    names = secret_variables(os.environ if environ is None else environ)
    if names:
        _wipe_values(names)
    prctl = _libc_prctl()
    if prctl is not None:
        prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
