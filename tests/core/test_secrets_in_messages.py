"""No secret of a URL reaches a message, a log line or stdout: a password in the userinfo, a
secret query parameter (libpq's password/sslpassword, the http:// source's api_key), a
fragment, or text that is no URL at all (a typo, a URL file holding the secret alone)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fenced
from fenced._core.backend import redacted
from tests.helpers import ROOT, wait_for

SECRET = "s3cr3tPW"


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{SECRET}@127.0.0.1:1/0",
        f"postgresql://u:{SECRET}@h/db?sslpassword={SECRET}",
        f"postgresql://u@h/db?password={SECRET}&sslmode=require",
        f"http://127.0.0.1:1/?api_key={SECRET}",
        f"zookeeper://127.0.0.1:1/x#{SECRET}",
        f"redis//:{SECRET}@127.0.0.1:1/0",  # (no "://": a typo)
        SECRET,  # (a URL file holding the secret alone)
    ],
)
def test_redacted_shows_no_secret(url: str) -> None:
    assert SECRET not in redacted(url)


def _fenced(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fenced", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env},
    )


@pytest.mark.parametrize(
    "url",
    [
        f"zookeeper://u:{SECRET}@127.0.0.1:1/x",
        f"zk://u:{SECRET}@127.0.0.1:1/x",
        f"zookeeper://127.0.0.1:1/x#{SECRET}",
        f"redis//:{SECRET}@127.0.0.1:1/0",
    ],
)
def test_a_bad_url_from_the_environment_is_refused_without_its_secret(url: str) -> None:
    out = _fenced("status", "--timeout", "2", FENCED_URL=url)
    assert out.returncode == 2, out.stderr
    assert SECRET not in out.stdout + out.stderr, out.stderr


def test_a_url_file_holding_no_url_is_refused_without_its_content(tmp_path: Path) -> None:
    path = tmp_path / "url"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    out = _fenced("status", "--timeout", "2", "--url-file", str(path))
    assert out.returncode == 2, out.stderr
    assert SECRET not in out.stdout + out.stderr, out.stderr


def test_a_url_file_with_an_api_key_others_may_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "url"
    path.write_text(f"http://127.0.0.1:1/?api_key={SECRET}\n")
    path.chmod(0o644)
    out = _fenced("status", "--timeout", "2", "--url-file", str(path))
    assert out.returncode == 2 and "chmod 600" in out.stderr, out.stderr
    assert SECRET not in out.stdout + out.stderr


@pytest.mark.parametrize("description", [None, "nightly report"])
def test_a_holders_arguments_are_not_shown_to_status_readers(
    tmp_path: Path, description: str | None
) -> None:
    """``fenced lock`` describes its holder by the command's program name (or --description):
    the command's arguments may hold a secret, and every reader of the source sees holders."""
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    ready = tmp_path / "ready"
    extra = [] if description is None else ["--description", description]
    holder = subprocess.Popen(
        [sys.executable, "-m", "fenced", "lock", "job", "--url", url, *extra, "--",
         "sh", "-c", f": --password={SECRET}; touch {ready}; exec sleep 60"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])},
    )  # fmt: skip
    try:
        wait_for(lambda: ready.exists() or holder.poll() is not None, 60, "the holder's command")
        assert ready.exists(), "the holder's command never started"
        shown = _fenced("status", "job", "--url", url)
        assert shown.returncode == 0, shown.stderr
        assert SECRET not in shown.stdout + shown.stderr
        assert (description or "sh") in shown.stdout
    finally:
        holder.kill()
        holder.wait()


# A password holding an unencoded '/', '?' or '#' ends the URL's authority early: urllib then
# reads part of it as the host, port, path, query or fragment, which messages used to show.
MISPLIT = [
    "redis://:abcd/SECRETPW@127.0.0.1:6379/0",
    "redis://:1234/abcdSECRETPW@127.0.0.1:6379/0",
    "redis://:abcd#SECRETPW@127.0.0.1:6379/0",
    "redis://user:1234#abcdSECRETPW@127.0.0.1/0",
    "redis://:1234?abcdSECRETPW@127.0.0.1:6379/0",
    "postgresql://app:pa/ssSECRETPW@127.0.0.1/db",
]


@pytest.mark.parametrize("url", MISPLIT)
def test_a_password_with_a_slash_question_or_hash_is_refused_whole(url: str) -> None:
    """Refused as a ConfigurationError that says how to fix it (percent-encode), showing no
    part of the password (not even what came before the '/'), through the library and the
    CLI; and a URL with an '@' only in its path or query is not taken for one."""
    import fenced

    with pytest.raises(fenced.ConfigurationError, match="percent-encode") as refused:
        fenced.connect(url)
    text = str(refused.value)
    assert "SECRETPW" not in text and "abcd" not in text and "1234" not in text, text
    assert "SECRETPW" not in redacted(url) and "abcd" not in redacted(url)
    result = _fenced("lock", "--url", url, "x", "--", "true")
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "SECRETPW" not in out and "abcd" not in out and "percent-encode" in out, out


def test_an_at_sign_in_a_path_or_query_is_no_password() -> None:
    for url in ("sqlite:////tmp/a@b.db", "redis://h:6379/0?client_name=me@x"):
        assert redacted(url) == url


@pytest.mark.parametrize(
    ("url", "options"),
    [
        (f"http://127.0.0.1:9/?api_key={SECRET}&stray", {}),  # (a malformed query)
        (f"postgresql://u@127.0.0.1:9/db?password={SECRET}&&", {}),
        ("http://127.0.0.1:9/", {"api_key": SECRET.encode()}),  # (an option of a wrong type)
        (f"http://127.0.0.1:9/?api_key={SECRET}&api_key={SECRET}", {}),
    ],
)
def test_a_bad_option_never_shows_a_secret_value(url: str, options: dict[str, object]) -> None:
    with pytest.raises(fenced.ConfigurationError) as caught:
        fenced.connect(url, connect_timeout=2, **options)
    assert SECRET not in str(caught.value) and "\n" not in str(caught.value)
    # the rightful side: a value that is no secret is still shown, to be fixed
    with pytest.raises(fenced.ConfigurationError, match="request_timeout='abc'"):
        fenced.connect("http://127.0.0.1:9/?request_timeout=abc", connect_timeout=2)
