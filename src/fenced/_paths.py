"""Where fenced keeps its default embedded token source."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_url"]


def default_url() -> str:
    """``$FENCED_URL``, else an SQLite file in the user's data directory (XDG)."""
    url = os.environ.get("FENCED_URL")
    if url:
        return url
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return f"sqlite:///{Path(base) / 'fenced' / 'locks.db'}"
