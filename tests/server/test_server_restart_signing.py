"""A holder through ``http://`` whose ``fenced serve`` restarts signing differently (signing
newly on, a rotated key, another source id): the server refuses its grant's token (400
``invalid_token``) at the next renewal. That is a final loss at once, its reason kept, in one
log line: ``lost`` set with a LeaseLostError saying the server refused the token, a ``with``
block ending in LeaseLostError, ``release()`` returning False, ``fenced lock`` one line.
Before: a traceback per renewal until the ttl ran out, a loss "expired: renewals failed", the
``with`` block ending in InvalidTokenError, ``release()`` raising it. Real ``fenced serve``
processes (with API keys) on SQLite; the holder's renewal the real background one."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fenced
from fenced.testing.servers import FencedServer
from tests.server.test_server_trust import A, _keys_file

_RESTARTS = {
    # args before the restart, args after it
    "signing-newly-on": ([], ["--signing-key", "k1.key", "--source-id", "prod"]),
    "key-rotated": (
        ["--signing-key", "k1.key", "--source-id", "prod"],
        ["--signing-key", "k2.key", "--source-id", "prod"],
    ),
    "source-id-changed": (
        ["--signing-key", "k1.key", "--source-id", "prod"],
        ["--signing-key", "k1.key", "--source-id", "prod2"],
    ),
}


def _server(tmp_path: Path, before: list[str]) -> FencedServer:
    for kid in ("k1", "k2"):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "fenced",
                "keygen",
                "ed25519",
                kid,
                str(tmp_path / f"{kid}.key"),
            ],
            check=True,
            capture_output=True,
        )
    keys = ["--api-keys", str(_keys_file(tmp_path))]
    return FencedServer(
        f"sqlite:///{tmp_path / 'l.db'}",
        args=keys + [str(tmp_path / a) if a.endswith(".key") else a for a in before],
    )


def _restart(server: FencedServer, tmp_path: Path, after: list[str]) -> None:
    server.args = server.args[:2] + [str(tmp_path / a) if a.endswith(".key") else a for a in after]
    server.restart()


@pytest.mark.parametrize("change", list(_RESTARTS))
def test_a_renewal_the_restarted_server_refuses_is_a_loss_at_once(
    tmp_path: Path, change: str, caplog: pytest.LogCaptureFixture
) -> None:
    before, after = _RESTARTS[change]
    with _server(tmp_path, before) as server, fenced.connect(server.url, api_key=A) as locks:
        ttl = 6.0  # renewals every 2 s; the loss must come well before the ttl runs out
        lease = locks.lock("l", ttl=ttl)
        with (
            pytest.raises(fenced.LeaseLostError) as ended,
            caplog.at_level(logging.DEBUG, "fenced"),
        ):
            with lease:
                _restart(server, tmp_path, after)
                restarted = time.monotonic()
                assert lease.lost.wait(ttl), "the loss was not reported"
                took = time.monotonic() - restarted
        cause = lease.lost_cause
        assert isinstance(cause, fenced.LeaseLostError), repr(cause)
        assert "refused" in str(cause) and "invalid_token" in str(cause), str(cause)
        assert "renewals failed" not in str(cause)
        assert took < ttl * 2 / 3, took  # at the next renewal (every ttl/3), not at expiry
        assert ended.value.__cause__ is cause
        assert lease.release() is False
        records = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(records) == 1, [r.getMessage() for r in records]
        assert records[0].exc_info is None and "\n" not in records[0].getMessage()
        # The rightful case: a new grant from the restarted server renews and releases.
        again = locks.lock("l2", ttl=ttl, auto_renew=False)
        again.acquire(timeout=10)
        assert again.renew() > 0
        assert again.release() is True


def test_fenced_lock_reports_the_refused_renewal_in_one_line(tmp_path: Path) -> None:
    before, after = _RESTARTS["signing-newly-on"]
    with _server(tmp_path, before) as server:
        env = {**os.environ, "FENCED_API_KEY": A}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fenced",
                "lock",
                "--url",
                server.url,
                "--ttl",
                "4",
                "l",
                "--",
                sys.executable,
                "-c",
                "print('held', flush=True); import time; time.sleep(12)",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
            _restart(server, tmp_path, after)
            _, err = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode != 0
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert any("refused" in line and "invalid_token" in line for line in lines), err
    assert len(lines) <= 2, err


def test_a_holder_whose_api_key_was_revoked_loses_its_lease_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server restarted without the holder's API key: its renewal is refused (401), which
    asking again cannot change: a loss at once naming the refusal; the ``with`` block ends in
    LeaseLostError (the refused release does not hide it)."""
    with _server(tmp_path, []) as server, fenced.connect(server.url, api_key=A) as locks:
        ttl = 6.0
        lease = locks.lock("l", ttl=ttl)
        with (
            pytest.raises(fenced.LeaseLostError) as ended,
            caplog.at_level(logging.DEBUG, "fenced"),
        ):
            with lease:
                keys = tmp_path / "keys.toml"
                keys.write_text(keys.read_text().replace(A, "secret-zzzzzzzzzzzzzzzz"))
                server.restart()
                restarted = time.monotonic()
                assert lease.lost.wait(ttl), "the loss was not reported"
                took = time.monotonic() - restarted
        cause = lease.lost_cause
        assert isinstance(cause, fenced.LeaseLostError), repr(cause)
        assert "AccessDenied" in str(cause) and "renewals failed" not in str(cause), str(cause)
        assert isinstance(cause.__cause__, fenced.AccessDenied)
        assert took < ttl * 2 / 3, took
        assert ended.value.__cause__ is cause
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
