"""Terminal output for the command line: rich when installed (``fenced[cli]``), else plain text.

The library itself never prints; only ``fenced demo`` and ``fenced status`` use this.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Protocol, TextIO

__all__ = ["Printer", "make_printer", "panel"]

_MARKUP = re.compile(r"\[/?[a-z ]+\]")


class Printer(Protocol):
    def print(self, *objects: Any) -> None: ...


class _Plain:
    """rich's ``Console.print`` for the markup fenced uses, without rich: the tags removed."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def print(self, *objects: Any) -> None:
        text = " ".join(str(o) for o in objects)
        print(_MARKUP.sub("", text), file=self._stream, flush=True)


def make_printer(*, stderr: bool = False) -> Printer:
    try:
        from rich.console import Console
    except ImportError:
        return _Plain(sys.stderr if stderr else sys.stdout)
    stream = sys.stderr if stderr else sys.stdout
    # Piped or redirected: no hard wrap at rich's default 80 columns (one line stays one line).
    console: Printer = Console(stderr=stderr, highlight=False, soft_wrap=not stream.isatty())
    return console


def panel(title: str) -> Any:
    """A framed heading (rich's Panel), or the title between rules."""
    try:
        from rich.panel import Panel
    except ImportError:
        return f"== {title} =="
    return Panel.fit(title, style="bold")
