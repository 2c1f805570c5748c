"""A key line's fields never reach an error, and a key file that is no regular file is
refused at once. An outside attack found a line with its key id and material swapped
(``fenced-key 1 hmac <secret> ops-2026``) parsed with the secret as key id: the error was
"key id must be ..., not '<the whole secret>'", through ``$FENCED_SIGNING_KEY``,
``--signing-key FILE``, ``connect(signing_key=)`` and ``load_keys`` (which did not even
name the file). And a FIFO given as a key file hung ``load_key`` in ``open()`` for ever."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import fenced
from fenced import ConfigurationError, HmacKey
from fenced._core.signing import (
    Ed25519SigningKey,
    b64,
    load_key,
    parse_key,
    read_key,
    verify_key,
)
from tests.helpers import ROOT

HMAC = HmacKey("ops-2026", b"\x5a" * 32)
ED = Ed25519SigningKey("ops-2026", b"\x07" * 32)


def _clean_env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}
    return {**base, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **extra}


def _bad_lines(key: HmacKey | Ed25519SigningKey) -> dict[str, tuple[str, str]]:
    """Malformed key lines, each with the secret text that must never be shown."""
    secret = b64(key._material())
    kind = key.kind
    return {
        "swapped": (f"fenced-key 1 {kind} {secret} ops-2026", secret),
        # a secret short enough to pass for a key id, with a material that is too short
        "short-secret-as-kid": (f"fenced-key 1 {kind} {secret[:20]} {b64(b'x' * 8)}", secret[:20]),
        # a valid key id, material of the wrong size: the id is not shown either
        "wrong-size": (f"fenced-key 1 {kind} ops-2026 {secret[:22]}", secret[:22]),
        "unknown-kind": (f"fenced-key 1 {secret[:12]} ops-2026 {secret}", secret),
    }


def _assert_hidden(message: str, secret: str) -> None:
    assert secret not in message, message
    assert "ops-2026" not in message, message  # (no field at all until the line is whole)
    assert "\n" not in message


@pytest.mark.parametrize("key", [HMAC, ED], ids=["hmac", "ed25519"])
def test_a_malformed_key_line_never_shows_its_fields(
    key: HmacKey | Ed25519SigningKey, tmp_path: Path, memory_url: str
) -> None:
    for case, (line, secret) in _bad_lines(key).items():
        with pytest.raises(ConfigurationError) as caught:
            parse_key(line, "the line")
        _assert_hidden(str(caught.value), secret)
        assert str(caught.value).startswith("the line"), case

        with pytest.raises(ConfigurationError) as caught:
            read_key(line, "$FENCED_SIGNING_KEY")
        _assert_hidden(str(caught.value), secret)
        assert str(caught.value).startswith("$FENCED_SIGNING_KEY: "), case

        with pytest.raises(ConfigurationError) as caught:
            fenced.connect(memory_url, signing_key=line)
        _assert_hidden(str(caught.value), secret)
        assert str(caught.value).startswith("signing_key=: "), case

        with pytest.raises(ConfigurationError) as caught:
            verify_key(line, "$FENCED_VERIFY_KEY")
        _assert_hidden(str(caught.value), secret)

        path = tmp_path / f"{case}.key"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, (line + "\n").encode())
        os.close(fd)
        for call in (load_key, lambda p: fenced.load_keys([p])):
            with pytest.raises(ConfigurationError) as caught:
                call(path)
            _assert_hidden(str(caught.value), secret)
            assert str(caught.value).startswith(f"key file {path}"), (case, str(caught.value))


def test_a_key_id_given_as_the_secret_is_not_shown() -> None:
    """HmacKey(secret, kid) with its arguments swapped: the secret is not echoed back."""
    secret = b64(b"\x5a" * 32)
    for kid in (secret, secret.encode(), "x" * 33):
        with pytest.raises(ConfigurationError) as caught:
            HmacKey(kid, b"\x5a" * 32)  # type: ignore[arg-type]
        assert secret not in str(caught.value) and "x" * 33 not in str(caught.value)


def test_connect_verify_of_the_wrong_type_does_not_show_it(memory_url: str) -> None:
    text = "fenced-key 1 hmac ops-2026 " + b64(b"\x5a" * 32)
    with pytest.raises(ConfigurationError) as caught:
        fenced.connect(memory_url, verify=text)
    assert b64(b"\x5a" * 32) not in str(caught.value)


def test_the_cli_never_prints_a_swapped_key_line(tmp_path: Path) -> None:
    """`fenced lock` with the swapped line in $FENCED_SIGNING_KEY and in --signing-key FILE:
    exit 2, one line naming the variable or the file, never the secret."""
    line, secret = _bad_lines(HMAC)["swapped"]
    path = tmp_path / "swapped.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, (line + "\n").encode())
    os.close(fd)
    url = f"sqlite:///{tmp_path}/l.db"
    runs = [
        (["--url", url], _clean_env(FENCED_SIGNING_KEY=line), "$FENCED_SIGNING_KEY"),
        (["--url", url, "--signing-key", str(path)], _clean_env(), f"key file {path}"),
    ]
    for args, env, named in runs:
        out = subprocess.run(
            [sys.executable, "-m", "fenced", "lock", "jobs", *args, "--", "true"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert secret not in out.stderr + out.stdout
        assert named in out.stderr and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_as_key_file_is_refused_at_once(tmp_path: Path) -> None:
    """Opened without O_NONBLOCK, a FIFO blocked open() until a writer came: for ever."""
    fifo = tmp_path / "k.pub"
    os.mkfifo(fifo, 0o600)
    errors: list[BaseException] = []

    def load() -> None:
        try:
            fenced.load_keys([fifo])
        except BaseException as exc:  # (reported below)
            errors.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # blocked in open(): let it go before failing
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(10)
        pytest.fail("load_keys blocked opening a FIFO")
    assert len(errors) == 1 and isinstance(errors[0], ConfigurationError), errors
    assert str(errors[0]) == f"key file {fifo} is not a regular file"
    for other in (tmp_path, Path("/dev/null")):  # a directory, a device
        with pytest.raises(ConfigurationError, match="is not a regular file"):
            load_key(other)
