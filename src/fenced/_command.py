"""Starting the command of ``fenced lock`` and ``fenced elect``: in a process group of its
own (so that stopping it stops the whole job, not only its head), with the exit statuses a
shell gives when it cannot (127: not found, 126: not executable)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence

__all__ = ["spawn"]


def spawn(
    cmd: Sequence[str], env: Mapping[str, str], say: Callable[[str], None]
) -> subprocess.Popen[bytes] | int:
    """The running command, or the exit status to end with (having said why)."""
    try:
        return subprocess.Popen(list(cmd), env=dict(env), start_new_session=True)
    except FileNotFoundError:
        say(f"command not found: {cmd[0]}")
        return 127
    except PermissionError:
        say(f"cannot execute: {cmd[0]}")
        return 126
