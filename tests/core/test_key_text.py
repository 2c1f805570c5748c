"""Signing keys given as text (``$FENCED_SIGNING_KEY``, ``$FENCED_VERIFY_KEY``,
``signing_key=``) never reach an error: a key line with a blank, a newline or quotes around
it was taken for a file's path, and "cannot read key file <the whole key>" printed the
private key. Blanks around it are dropped; anything else around it is malformed key text,
named by where it came from. And the signing options that mean nothing without a key are
refused, not ignored."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fenced
from fenced import ConfigurationError, FencingToken, HmacKey, Keyring
from fenced._core.signing import Ed25519SigningKey, b64, key_text, read_key, verify_key
from tests.helpers import ROOT, write_key_file

HMAC = HmacKey("h1", b"h" * 32)
ED = Ed25519SigningKey("e1", b"\x07" * 32)


def _material(key: HmacKey | Ed25519SigningKey) -> str:
    return b64(key._material())


def _clean_env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}
    return {**base, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **extra}


def _fenced(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fenced", *args], env=env, capture_output=True, text=True, timeout=60
    )


# (how key lines arrive wrapped: a stray blank, a here-document's newlines, docker --env-file
# and .env loaders keeping quotes, half a quote, a line pasted after its variable's name)
BLANKS = [" {}", "\n{}\n", "\t{} "]
QUOTED = ['"{}"', "'{}'", '"{}', "FENCED_SIGNING_KEY={}", "{};"]


@pytest.mark.parametrize("key", [HMAC, ED], ids=["hmac", "ed25519"])
@pytest.mark.parametrize("wrap", BLANKS + QUOTED)
def test_key_text_in_errors_never_shows_the_key(
    key: HmacKey | Ed25519SigningKey, wrap: str, memory_url: str
) -> None:
    text = wrap.format(key_text(key).strip())
    if wrap in BLANKS:  # harmless: dropped, and the key signs
        with fenced.connect(memory_url, signing_key=text) as locks:
            with locks.lock("jobs", ttl=5) as lease:
                token = lease.token
        assert token.signature is not None and token.signature[0] == key.kid
        Keyring([key.public()]).verify(token.lock, token.value, token.signature)
        return
    with pytest.raises(ConfigurationError) as caught:
        fenced.connect(memory_url, signing_key=text)
    message = str(caught.value)
    assert _material(key) not in message and "\n" not in message
    assert message.startswith("signing_key=: "), message
    with pytest.raises(ConfigurationError) as caught:
        verify_key(text, "$FENCED_VERIFY_KEY")
    assert _material(key) not in str(caught.value)
    assert str(caught.value).startswith("$FENCED_VERIFY_KEY: ")


def test_text_that_is_no_key_line_and_no_file_is_not_shown(tmp_path: Path) -> None:
    """The key material alone (the line cut short), or a secret in standard base64 (with
    '/'), is taken for a path that does not exist: named by its variable, never shown."""
    for secret in (
        _material(HMAC),
        "u/9Jx+2kQ7vZ1mN3pR5tW8yB0cE4gH6j=",
        "hmac h1 " + _material(HMAC),
    ):
        with pytest.raises(ConfigurationError) as caught:
            read_key(secret, "$FENCED_SIGNING_KEY")
        assert secret not in str(caught.value) and _material(HMAC) not in str(caught.value)
        assert str(caught.value) == (
            "cannot read the key file named by $FENCED_SIGNING_KEY: No such file or directory"
        )
    # A path given as one is still shown (it is no secret, and the user needs to see it),
    # and one named by a variable is read like before, blanks around it dropped.
    missing = tmp_path / "fenced-keys" / "gone.key"  # ("fenced-key" in a path: still a path)
    with pytest.raises(ConfigurationError, match=f"cannot read key file {missing}: No such"):
        fenced.load_keys([missing])
    path = tmp_path / "fenced-keys.key"
    write_key_file(path, HMAC)
    assert repr(read_key(f" {path}\n", "$FENCED_SIGNING_KEY")) == repr(HMAC)
    assert verify_key(str(path)).kid == "h1"


@pytest.mark.parametrize(
    ("command", "variable"),
    [
        (["serve", "--listen", "127.0.0.1:0"], "FENCED_SIGNING_KEY"),
        (["lock", "jobs", "--", "true"], "FENCED_SIGNING_KEY"),
        (["check-token", "jobs:1"], "FENCED_SIGNING_KEY"),
        (["check-token", "jobs:1"], "FENCED_VERIFY_KEY"),
    ],
)
def test_the_cli_names_the_variable_and_never_prints_the_key(
    command: list[str], variable: str, tmp_path: Path
) -> None:
    """The issue's commands as reported: a private key with a blank or quotes before it."""
    for wrap in ('"{}"', "'{}'", "x{}"):
        env = _clean_env(**{
            "FENCED_URL": f"sqlite:///{tmp_path}/l.db", variable: wrap.format(key_text(ED).strip())
        })  # fmt: skip
        out = _fenced(*command, env=env)
        assert out.returncode == 2, out.stderr
        assert _material(ED) not in out.stdout + out.stderr
        assert out.stderr.strip().splitlines() == [
            f"fenced: ${variable}: malformed key text: expected the one line 'fenced-key 1 "
            "<kind> <key id> <base64url>' with nothing around it (quotes?)"
        ], out.stderr


def test_the_cli_takes_a_key_line_with_blanks_around_it(tmp_path: Path) -> None:
    env = _clean_env(
        FENCED_URL=f"sqlite:///{tmp_path}/l.db",
        FENCED_SIGNING_KEY=f"  \n{key_text(HMAC)}\n",
        FENCED_SOURCE_ID="prod",
    )
    out = _fenced("lock", "jobs", "--", "sh", "-c", 'echo "$FENCING_TOKEN"', env=env)
    assert out.returncode == 0, out.stderr
    token = FencingToken.parse(out.stdout.strip())
    Keyring([HMAC], source_id="prod").verify(token.lock, token.value, token.signature)
    env["FENCED_VERIFY_KEY"] = f" {key_text(HMAC)}"
    out = _fenced("check-token", str(token), env=env)  # (well signed; released since: 78)
    assert out.returncode == 78 and "not-current" in out.stdout, out.stderr
    out = _fenced("check-token", "jobs:1", env=env)  # (the key is in use: unsigned is refused)
    assert out.returncode == 65, out.stderr


# -- options that mean nothing without a key ---------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--source-id", "prod"], "--source-id needs a signing key"),
        (["serve", "--accept-unbound"], "--accept-unbound needs a signing key"),
        (["serve", "--signing-key", "{key}", "--accept-unbound"], "--accept-unbound needs --source-id"),
        (["lock", "--source-id", "prod", "jobs", "--", "true"], "--source-id needs a signing key"),
        (["check-token", "--verify-key", "{key}", "--accept-unbound", "jobs:1"],
         "--accept-unbound needs --source-id"),
    ],
)  # fmt: skip
def test_signing_options_without_what_they_need_are_refused(
    args: list[str], message: str, tmp_path: Path
) -> None:
    key = tmp_path / "k.key"
    write_key_file(key, HMAC)
    env = _clean_env(FENCED_URL=f"sqlite:///{tmp_path}/l.db")
    out = _fenced(args[0], "--timeout", "5", *(a.format(key=key) for a in args[1:]), env=env)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    # $FENCED_SOURCE_ID is shared configuration: set where nothing signs, it is no error
    out = _fenced("lock", "jobs", "--", "true", env={**env, "FENCED_SOURCE_ID": "prod"})
    assert out.returncode == 0, out.stderr


def test_connect_refuses_accept_unbound_where_it_means_nothing(memory_url: str) -> None:
    for options in (
        {"accept_unbound": True},
        {"accept_unbound": True, "signing_key": HMAC},
        {"accept_unbound": True, "source_id": "prod"},
        {"accept_unbound": True, "signing_key": HMAC, "source_id": "prod",
         "verify": Keyring([HMAC], source_id="prod")},
    ):  # fmt: skip
        with pytest.raises(ConfigurationError, match="accept_unbound=True needs signing_key="):
            fenced.connect(memory_url, **options)
    # the rightful side: the connection's own keyring, naming its source, takes v1 tokens
    with fenced.connect(memory_url, signing_key=HMAC) as unbound:
        with unbound.lock("jobs", ttl=5) as lease:
            v1 = lease.token
    with fenced.connect(
        memory_url, signing_key=HMAC, source_id="prod", accept_unbound=True
    ) as locks:
        assert locks.check(v1).verdict != "invalid"
    with fenced.connect(memory_url, signing_key=HMAC, source_id="prod") as locks:
        with pytest.raises(fenced.InvalidTokenError):
            locks.check(v1)
