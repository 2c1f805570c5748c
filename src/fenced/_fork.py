"""Which side of a ``fork()`` this process is on, for objects that must not cross one.

Every object that owns a thread, a socket or a grant records :func:`generation` when it is
made; in a forked child the generation has moved on (``os.register_at_fork``), so the object
knows it was inherited — one integer comparison, no system call, on hot paths such as
``lease.remaining()``. What a child inherited is kept alive by :func:`left_behind` and never
used or closed there (closing a shared socket would cut the parent's connection).
"""

from __future__ import annotations

import os

__all__ = ["generation", "left_behind"]

_generation = 0
_LEFT_BEHIND: list[object] = []


def _forked() -> None:
    global _generation
    _generation += 1


os.register_at_fork(after_in_child=_forked)


def generation() -> int:
    """A number that changes in a child process after each fork."""
    return _generation


def left_behind(*things: object) -> None:
    """Keep what a forked child inherited alive, so that no finalizer of it runs there."""
    _LEFT_BEHIND.extend(t for t in things if t is not None)
