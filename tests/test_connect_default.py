"""`fenced.connect()` with no URL opens the source the command line uses: $FENCED_URL, else the
machine-wide file."""

from __future__ import annotations

from pathlib import Path

import pytest

import fenced


def test_connect_without_a_url_uses_fenced_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCED_URL", f"sqlite:///{tmp_path}/env.db")
    with fenced.connect() as locks, locks.lock("job", ttl=5) as lease:
        assert lease.token.value == 1
    assert (tmp_path / "env.db").exists()


def test_connect_without_a_url_or_fenced_url_uses_the_machine_wide_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FENCED_URL", raising=False)
    monkeypatch.setenv("_FENCED_MACHINE_DIR", str(tmp_path / "machine"))
    with fenced.connect() as locks, locks.lock("job", ttl=5) as lease:
        assert lease.token.value == 1
    assert (tmp_path / "machine" / "locks.db").exists()


async def test_connect_async_without_a_url_uses_fenced_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCED_URL", f"sqlite:///{tmp_path}/env.db")
    async with fenced.connect_async() as locks, locks.lock("job", ttl=5) as lease:
        assert lease.token.value == 1
