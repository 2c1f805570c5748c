"""Key files other users may read or change are refused, as ssh refuses such a private key.

A secret key (HMAC: it signs and verifies; an Ed25519 private key) in a file that group or
others may read or write, a public key (``.pub``) in a file they may write (whoever swaps it
decides which tokens a resource trusts), and any key file owned by another user (not root,
not the reader: that user can read and replace it, whatever its mode now) is refused with
one line naming the file, its mode and the fix, never the key. Every way a key file is read:
``load_key``/``load_keys``/``verify_key``, ``connect(signing_key=)``, ``fenced serve``,
``lock`` and ``check-token``'s flags and variables. ``fenced keygen`` writes files that
pass; keys given as text are unaffected.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import fenced
from fenced._core.signing import (
    Ed25519SigningKey,
    HmacKey,
    b64,
    key_text,
    load_key,
    load_keys,
    read_key,
    verify_key,
)
from tests.cli.test_cli import run
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX's")

HMAC = HmacKey("k1", b"hmac-secret-material-0123456789!")
ED = Ed25519SigningKey("e1", b"\x07" * 32)
SECRETS = [b64(HMAC._material()), b64(ED._material())]
NOBODY = 65534

SECRET_MODES = [0o644, 0o640, 0o604, 0o620, 0o602, 0o660, 0o666, 0o700 | 0o044]
PUBLIC_LOOSE = [0o664, 0o646, 0o666, 0o620, 0o602]


def _write(path: Path, text: str, mode: int) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
    os.chmod(path, mode)
    return path


def _refusal(exc: BaseException | str) -> str:
    text = str(exc)
    assert len(text.strip().splitlines()) == 1, text
    assert not any(secret in text for secret in SECRETS), text
    return text


@pytest.mark.parametrize("key", [HMAC, ED], ids=["hmac", "ed25519-private"])
@pytest.mark.parametrize("mode", SECRET_MODES, ids=[f"{m:04o}" for m in SECRET_MODES])
def test_a_secret_key_file_others_may_read_or_write_is_refused(
    tmp_path: Path, key: HmacKey | Ed25519SigningKey, mode: int
) -> None:
    path = _write(tmp_path / "s.key", key_text(key), mode)
    for given in (str(path), path):
        with pytest.raises(fenced.ConfigurationError) as caught:
            load_key(given)
        text = _refusal(caught.value)
        assert f"key file {path}" in text and f"mode {mode:04o}" in text, text
        assert f"chmod 600 {path}" in text, text
    with pytest.raises(fenced.ConfigurationError) as caught:
        read_key(str(path), "--signing-key", path_shown=True)
    assert f"chmod 600 {path}" in _refusal(caught.value)
    # a path that may be a secret (a variable's, signing_key='s text): named, not shown
    with pytest.raises(fenced.ConfigurationError) as caught:
        fenced.connect(f"sqlite:///{tmp_path}/l.db", signing_key=str(path))
    text = _refusal(caught.value)
    assert "signing_key=" in text and "chmod 600" in text and str(path) not in text, text
    with pytest.raises(fenced.ConfigurationError) as caught:
        fenced.connect(f"sqlite:///{tmp_path}/l.db", signing_key=path)  # (a Path: shown)
    assert f"chmod 600 {path}" in _refusal(caught.value)
    # where a resource reads it (an HMAC key verifies; an Ed25519 private one is refused
    # there anyway): its mode first, so the fix is named
    for verify in (lambda: load_keys([path]), lambda: verify_key(str(path))):
        with pytest.raises(fenced.ConfigurationError) as caught:
            verify()
        assert f"chmod 600 {path}" in _refusal(caught.value)


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_secret_key_file_only_its_owner_may_read_is_accepted(tmp_path: Path, mode: int) -> None:
    hmac_path = _write(tmp_path / "h.key", key_text(HMAC), mode)
    ed_path = _write(tmp_path / "e.key", key_text(ED), mode)
    assert repr(load_key(hmac_path)) == "HmacKey(kid='k1')"
    assert repr(load_key(str(ed_path))) == "Ed25519SigningKey(kid='e1')"
    assert load_keys([hmac_path]).kids == {"k1"}
    with fenced.connect(f"sqlite:///{tmp_path}/l.db", signing_key=str(ed_path)) as locks:
        with locks.lock("jobs", ttl=5) as lease:
            assert lease.token.signature is not None


@pytest.mark.parametrize("mode", PUBLIC_LOOSE, ids=[f"{m:04o}" for m in PUBLIC_LOOSE])
def test_a_public_key_file_others_may_change_is_refused(tmp_path: Path, mode: int) -> None:
    path = _write(tmp_path / "e.key.pub", key_text(ED.public()), mode)
    for verify in (
        lambda: load_keys([path]),
        lambda: verify_key(str(path)),
        lambda: load_key(path),
    ):
        with pytest.raises(fenced.ConfigurationError) as caught:
            verify()
        text = _refusal(caught.value)
        assert f"key file {path}" in text and f"mode {mode:04o}" in text, text
        assert f"chmod 644 {path}" in text, text


@pytest.mark.parametrize("mode", [0o644, 0o444, 0o640, 0o600, 0o604])
def test_a_public_key_file_all_may_read_is_accepted(tmp_path: Path, mode: int) -> None:
    path = _write(tmp_path / "e.key.pub", key_text(ED.public()), mode)
    assert load_keys([path]).kids == {"e1"}
    assert repr(verify_key(str(path))) == "Ed25519VerifyKey(kid='e1')"


def test_keys_as_text_are_unaffected(tmp_path: Path) -> None:
    """A variable's text has no file mode: only files are checked."""
    assert repr(read_key(key_text(HMAC), "$FENCED_SIGNING_KEY")) == "HmacKey(kid='k1')"
    with fenced.connect(f"sqlite:///{tmp_path}/l.db", signing_key=key_text(ED)) as locks:
        with locks.lock("jobs", ttl=5) as lease:
            assert lease.token.signature is not None


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o002, 0o077])
def test_keygen_writes_files_that_pass(tmp_path: Path, umask: int) -> None:
    """0600 for the secret whatever the umask (0644 for the .pub under the usual umasks;
    tighter under umask 077): each loads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}
    for kind in ("hmac", "ed25519"):
        path = tmp_path / f"{kind}.key"
        subprocess.run(
            ["sh", "-c", f'umask {umask:03o} && exec "$@"', "sh", sys.executable, "-m",
             "fenced", "keygen", kind, "k1", str(path)],
            check=True, capture_output=True, env=env,
        )  # fmt: skip
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, oct(path.stat().st_mode)
        load_key(path)
    pub = tmp_path / "ed25519.key.pub"
    assert stat.S_IMODE(pub.stat().st_mode) == 0o644 & ~umask
    assert load_keys([pub]).kids == {"k1"}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root (chown)")
def test_a_key_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    """Whoever owns a key file can read it and replace it, whatever its mode now: a secret or
    a trusted public key owned by another user (not root, not the reader) is refused (sshd's
    rule for authorized_keys), however tight its mode; the reader's own and root's pass."""
    secret = _write(tmp_path / "s.key", key_text(HMAC), 0o600)
    pub = _write(tmp_path / "e.key.pub", key_text(ED.public()), 0o644)
    for path in (secret, pub):
        os.chown(path, NOBODY, -1)
        with pytest.raises(fenced.ConfigurationError) as caught:
            load_keys([path])
        text = _refusal(caught.value)
        assert f"key file {path}" in text and f"uid {NOBODY}" in text, text
        assert f"chown root {path}" in text, text
        os.chown(path, 0, -1)
        assert load_keys([path]).kids
    # (the group does not matter: only the owner can chmod it open)
    os.chown(secret, 0, NOBODY)
    assert load_keys([secret]).kids == {"k1"}


_AS_ANOTHER_USER = """
import sys
sys.path.insert(0, sys.argv[1])
from fenced._core.errors import ConfigurationError
from fenced._core.signing import load_key
for path in sys.argv[2:]:
    try:
        print(path, "ok", repr(load_key(path)))
    except ConfigurationError as exc:
        print(path, "refused", exc)
"""


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root")
def test_a_reader_that_is_not_root_trusts_its_own_files_and_roots(tmp_path: Path) -> None:
    """Read by a user who is not root (nobody): root's public key readable by all and the
    reader's own secret (0600) pass; root's secret readable by all is refused too."""
    python = shutil.which("python3", path="/usr/bin")
    if python is None:
        pytest.skip("no /usr/bin/python3 for another user")
    lib = Path("/tmp") / f"fenced-keyperm-{os.getpid()}-{tmp_path.name}"
    try:
        shutil.copytree(ROOT / "src" / "fenced", lib / "fenced")
        for dirpath, _, filenames in os.walk(lib):
            os.chmod(dirpath, 0o755)
            for name in filenames:
                os.chmod(os.path.join(dirpath, name), 0o644)
        keys = lib / "keys"
        keys.mkdir(mode=0o755)
        keys.chmod(0o755)
        root_pub = _write(keys / "root.key.pub", key_text(ED.public()), 0o644)
        root_loose = _write(keys / "root.key", key_text(HMAC), 0o644)
        own = _write(keys / "own.key", key_text(HMAC), 0o600)
        os.chown(own, NOBODY, -1)
        probe = subprocess.run(
            [python, "-c", "import sys; assert sys.version_info >= (3, 11)"],
            user=NOBODY, capture_output=True,
        )  # fmt: skip
        if probe.returncode != 0:
            pytest.skip(f"{python} is not Python 3.11+ for another user")
        out = subprocess.run(
            [python, "-c", _AS_ANOTHER_USER, str(lib), str(root_pub), str(root_loose), str(own)],
            user=NOBODY, capture_output=True, text=True, timeout=60, cwd="/",
            env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"},
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
        assert lines[str(root_pub)].startswith("ok"), out.stdout
        assert lines[str(own)].startswith("ok"), out.stdout
        assert lines[str(root_loose)].startswith("refused"), out.stdout
        assert f"chmod 600 {root_loose}" in lines[str(root_loose)], out.stdout
    finally:
        shutil.rmtree(lib, ignore_errors=True)


# -- the command line -----------------------------------------------------------------------


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}


def test_fenced_lock_and_check_token_refuse_a_loose_key_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/l.db"
    loose = _write(tmp_path / "s.key", key_text(HMAC), 0o644)
    writable_pub = _write(tmp_path / "e.key.pub", key_text(ED.public()), 0o666)
    ran = tmp_path / "ran"
    command = ["--", "touch", str(ran)]
    cases = [
        (["lock", "x", "--signing-key", str(loose), *command], {}, f"chmod 600 {loose}"),
        (["lock", "x", *command], {"FENCED_SIGNING_KEY": str(loose)}, "$FENCED_SIGNING_KEY"),
        (["check-token", "x:1", "--verify-key", str(loose)], {}, f"chmod 600 {loose}"),
        (
            ["check-token", "x:1", "--verify-key", str(writable_pub)],
            {},
            f"chmod 644 {writable_pub}",
        ),
        (["check-token", "x:1"], {"FENCED_VERIFY_KEY": str(loose)}, "$FENCED_VERIFY_KEY"),
        (["check-token", "x:1"], {"FENCED_SIGNING_KEY": str(loose)}, "$FENCED_SIGNING_KEY"),
    ]
    for args, env, words in cases:
        out = run(args, url, env, process=False)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr)
        _refusal(out.stderr)
        assert "mode 0" in out.stderr, out.stderr
        if env:  # (a variable's path is named by the variable, never shown)
            assert str(loose) not in out.stderr, out.stderr
    assert not ran.exists()  # refused before the command ran
    loose.chmod(0o600)
    out = run(["lock", "x", "--signing-key", str(loose), *command], url, process=False)
    assert out.returncode == 0 and ran.exists(), out.stderr


def test_fenced_serve_refuses_a_loose_signing_or_verify_key_file(tmp_path: Path) -> None:
    loose = _write(tmp_path / "s.key", key_text(ED), 0o640)
    tight = _write(tmp_path / "t.key", key_text(HMAC), 0o600)
    writable_pub = _write(tmp_path / "e.key.pub", key_text(ED.public()), 0o664)
    loose_hmac = _write(tmp_path / "h.key", key_text(HmacKey("k2", b"z" * 32)), 0o604)
    cases = [
        (["--signing-key", str(loose)], f"chmod 600 {loose}"),
        (["--signing-key", str(tight), "--verify-key", str(writable_pub)], f"chmod 644 {writable_pub}"),
        (["--signing-key", str(tight), "--verify-key", str(loose_hmac)], f"chmod 600 {loose_hmac}"),
    ]  # fmt: skip
    for args, words in cases:
        out = subprocess.run(
            [sys.executable, "-m", "fenced", "serve", "--url", f"sqlite:///{tmp_path}/l.db",
             "--listen", "127.0.0.1:0", *args],
            capture_output=True, text=True, timeout=30, env=_plain_env(),
        )  # fmt: skip
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr)
        _refusal(out.stderr)
        assert b64(b"z" * 32) not in out.stderr, out.stderr
