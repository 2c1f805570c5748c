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


def test_connect_without_a_url_reads_fenced_url_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$FENCED_URL_FILE, as the command line reads it (a password kept out of the environment
    of every process and of its command line); a readable file with a password is refused."""
    monkeypatch.delenv("FENCED_URL", raising=False)
    source = tmp_path / "source.url"
    source.write_text(f"sqlite:///{tmp_path}/file.db\n")
    monkeypatch.setenv("FENCED_URL_FILE", str(source))
    with fenced.connect() as locks, locks.lock("job", ttl=5) as lease:
        assert lease.token.value == 1
    assert (tmp_path / "file.db").exists()
    source.write_text("redis://:hunter2@127.0.0.1:1/0\n")
    source.chmod(0o604)
    with pytest.raises(fenced.ConfigurationError, match="chmod 600") as caught:
        fenced.connect()
    assert "hunter2" not in str(caught.value)
