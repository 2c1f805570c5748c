"""Which side of a ``fork()`` this process is on, for objects that must not cross one; and
request ids, which must not repeat across one.

Every object that owns a thread, a socket or a grant records :func:`generation` when it is
made; in a forked child the generation has moved on (``os.register_at_fork``), so the object
knows it was inherited — one integer comparison, no system call, on hot paths such as
``lease.remaining()``. What a child inherited is kept alive by :func:`left_behind` and never
used or closed there (closing a shared socket would cut the parent's connection).
"""

from __future__ import annotations

import itertools
import os

__all__ = ["generation", "left_behind", "request_id", "whoami"]

_generation = 0
_LEFT_BEHIND: list[object] = []
_prefix = os.urandom(10).hex()
_counter = itertools.count(1)


def _forked() -> None:
    global _generation, _prefix, _counter
    _generation += 1
    _prefix = os.urandom(10).hex()  # a child must never repeat its parent's ids
    _counter = itertools.count(1)


os.register_at_fork(after_in_child=_forked)


def generation() -> int:
    """A number that changes in a child process after each fork."""
    return _generation


def left_behind(*things: object) -> None:
    """Keep what a forked child inherited alive, so that no finalizer of it runs there."""
    _LEFT_BEHIND.extend(t for t in things if t is not None)


def request_id() -> str:
    """A new id for one acquire, unique across processes: 80 random bits drawn once per
    process (again after a fork) and a counter; 32 hex digits, like a UUID's, at a tenth of
    the cost of ``uuid4()``."""
    return f"{_prefix}{next(_counter) & 0xFFFFFFFFFFFF:012x}"


_whoami: tuple[int, str] | None = None


def whoami() -> str:
    """``user@host pid N`` of this process (made again after a fork: the pid changed)."""
    global _whoami
    if _whoami is None or _whoami[0] != _generation:
        import pwd
        import socket

        try:
            user = pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:  # a uid with no passwd entry (containers)
            user = str(os.geteuid())
        _whoami = (_generation, f"{user}@{socket.gethostname()} pid {os.getpid()}")
    return _whoami[1]
