"""Where the machine lacks FUSE, the power-loss tests skip with the reason (never fail)."""

from __future__ import annotations

import os
import shutil

import pytest

from fenced.testing import powerloss


def test_each_missing_piece_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    real_exists, real_which = os.path.exists, shutil.which
    monkeypatch.setattr(os.path, "exists", lambda p: p != "/dev/fuse" and real_exists(p))
    assert "no /dev/fuse" in (powerloss.unavailable() or "")
    monkeypatch.setattr(os.path, "exists", real_exists)
    monkeypatch.setattr(os, "access", lambda p, mode: True)
    monkeypatch.setattr(shutil, "which", lambda n: None if n == "fusermount3" else real_which(n))
    assert "fusermount3" in (powerloss.unavailable() or "")
    with pytest.raises(RuntimeError, match="fusermount3"):
        powerloss.PowerLossMount("/nonexistent/mnt", "/nonexistent/state").mount()
