"""Signed tokens: the text form, the keys, signing in the core and in `fenced lock`.

The guards' side (every guard refuses what is not well signed) is in
tests/guards/test_guard_conformance.py, with planted verifiers it must catch.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fenced
from fenced import FencingToken, HmacKey, InvalidTokenError, Keyring, SignatureError
from fenced._signing import (
    Ed25519SigningKey,
    generate_key,
    key_text,
    load_key,
    load_keys,
    token_message,
)

KEY = HmacKey("k1", b"k" * 32)


def sign(token: FencingToken, key: object = KEY) -> FencingToken:
    kid = key.kid  # type: ignore[attr-defined]
    sig = key.sign(token_message(token.lock, token.value, kid))  # type: ignore[attr-defined]
    return FencingToken(token.lock, token.value, (kid, sig))


NAMES = st.from_regex(
    r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]{0,20}(/[A-Za-z0-9_][A-Za-z0-9_.-]{0,8}){0,2}", fullmatch=True
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(name=NAMES, value=st.integers(1, 2**63 - 1), ed=st.booleans())
def test_text_form_round_trips_and_any_one_byte_change_is_refused(
    name: str, value: int, ed: bool
) -> None:
    key = ED if ed else KEY
    token = sign(FencingToken(name, value), key)
    text = str(token)
    parsed = FencingToken.parse(text)
    assert parsed == token and parsed.signature == token.signature and str(parsed) == text
    ring = Keyring([key.public() if isinstance(key, Ed25519SigningKey) else key])
    ring.verify(parsed.lock, parsed.value, parsed.signature)
    for i in range(len(text)):
        for replacement in {"0", "A", ":", ".", "_"} - {text[i]}:
            mutated = text[:i] + replacement + text[i + 1 :]
            try:
                other = FencingToken.parse(mutated)
                ring.verify(other.lock, other.value, other.signature)
            except InvalidTokenError:
                continue
            raise AssertionError(f"accepted a mutation of {text!r}: {mutated!r}")


ED = Ed25519SigningKey("e1", b"\x07" * 32)


def test_keyring_rules() -> None:
    token = FencingToken("jobs", 3)
    ring = Keyring([KEY])
    with pytest.raises(SignatureError, match="unsigned"):
        ring.verify("jobs", 3, None)
    Keyring([KEY], required=False).verify("jobs", 3, None)  # (optional: unsigned passes)
    old, new = HmacKey("old", b"o" * 32), HmacKey("new", b"n" * 32)
    rotating = Keyring([old, new])
    for key in (old, new):
        s = sign(token, key)
        rotating.verify(s.lock, s.value, s.signature)
    retired = Keyring([new])
    s = sign(token, old)
    with pytest.raises(SignatureError, match="unknown key 'old'"):
        retired.verify(s.lock, s.value, s.signature)
    with pytest.raises(fenced.ConfigurationError):
        HmacKey("short", b"x" * 16)
    with pytest.raises(fenced.ConfigurationError):
        Keyring([KEY, HmacKey("k1", b"z" * 32)])


def test_keys_never_show_their_secret(tmp_path: Path) -> None:
    key = HmacKey("k1", b"secret-material-" * 2)
    assert "secret" not in repr(key) and "secret" not in repr(Keyring([key]))
    path = tmp_path / "key"
    path.write_text(key_text(key))
    assert repr(load_key(path)) == "HmacKey(kid='k1')"


def test_connect_with_a_signing_key_signs_every_grant(memory_url: str, tmp_path: Path) -> None:
    path = tmp_path / "signing.key"
    path.write_text(key_text(KEY))
    with fenced.connect(memory_url, signing_key=str(path)) as locks:
        with locks.lock("jobs", ttl=5) as lease:
            token = lease.token
    assert token.signature is not None and token.signature[0] == "k1"
    Keyring([KEY]).verify(token.lock, token.value, token.signature)
    public = Ed25519SigningKey("e1", b"\x01" * 32)
    with pytest.raises(fenced.ConfigurationError, match="public key"):
        fenced.connect(memory_url, signing_key=public.public())


def test_keygen_and_fenced_lock_carry_a_signed_token(tmp_path: Path) -> None:
    env = {**os.environ, "FENCED_URL": f"sqlite:///{tmp_path}/l.db"}
    fenced_cmd = [sys.executable, "-m", "fenced"]
    key = tmp_path / "ed.key"
    subprocess.run([*fenced_cmd, "keygen", "ed25519", "ops-1", str(key)], check=True, env=env)
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    again = subprocess.run(
        [*fenced_cmd, "keygen", "ed25519", "ops-1", str(key)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and "never overwrites" in again.stderr
    out = subprocess.run(
        [*fenced_cmd, "lock", "jobs", "--signing-key", str(key), "--", "sh", "-c", 'echo "$FENCING_TOKEN"'],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    token = FencingToken.parse(out.stdout.strip(), lock="jobs")
    ring = load_keys([str(key) + ".pub"])  # the public half: verifies, cannot sign
    ring.verify(token.lock, token.value, token.signature)
    assert isinstance(load_key(str(key) + ".pub"), fenced.Ed25519VerifyKey)
    assert generate_key("hmac", "x").kind == "hmac"


def test_a_ceiling_fails_closed_when_the_source_cannot_say(etcd_server: object) -> None:
    """etcd keeps no counter: for a free lock it cannot say which grant is the highest, so a
    ceiling refuses (when in doubt, fail closed); while the lock is held it can."""
    url = f"etcd://{etcd_server.endpoint}"  # type: ignore[attr-defined]
    with fenced.connect(url) as locks:
        name = f"ceiling-{os.getpid()}-{id(locks)}"
        ceiling = fenced.Ceiling(locks)
        with pytest.raises(fenced.AboveCeilingError, match="unknown"):
            ceiling.verify(name, 1, None)
        with locks.lock(name, ttl=5) as lease:
            ceiling.verify(name, lease.token.value, None)  # the live grant: known, accepted
            with pytest.raises(fenced.AboveCeilingError):
                ceiling.verify(name, lease.token.value + 1, None)
    with pytest.raises(fenced.ConfigurationError):
        fenced.Ceiling(object(), slack=-1)


def test_the_key_id_decides_which_key_verifies() -> None:
    """Planted check: a keyring that tries every key (ignoring the key id) accepts a signature
    of one key labelled with another's id; the real one refuses it."""
    other = HmacKey("k2", b"o" * 32)
    mislabelled = sign(FencingToken("jobs", 4), other)
    mislabelled = FencingToken("jobs", 4, ("k1", other.sign(token_message("jobs", 4, "k1"))))

    class AnyKey(Keyring):
        def verify(self, lock: str, value: int, signature: tuple[str, bytes] | None) -> None:
            assert signature is not None
            message = token_message(lock, value, signature[0])
            if not any(k.verify(message, signature[1]) for k in (KEY, other)):
                raise SignatureError("bad")

    with pytest.raises(SignatureError):
        Keyring([KEY, other]).verify("jobs", 4, mislabelled.signature)
    AnyKey([KEY, other]).verify("jobs", 4, mislabelled.signature)  # the planted bug lets it in


def test_a_signing_key_from_an_environment_variable(tmp_path: Path) -> None:
    """$FENCED_SIGNING_KEY may hold the key line itself (secrets injected as variables)."""
    env = {
        **os.environ,
        "FENCED_URL": f"sqlite:///{tmp_path}/l.db",
        "FENCED_SIGNING_KEY": key_text(KEY).strip(),
    }
    out = subprocess.run(
        [sys.executable, "-m", "fenced", "lock", "jobs", "--", "sh", "-c", 'echo "$FENCING_TOKEN"'],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    token = FencingToken.parse(out.stdout.strip())
    Keyring([KEY]).verify(token.lock, token.value, token.signature)
    assert "fenced-key" not in out.stderr and KEY.kid in out.stdout


async def test_async_check_and_signing(memory_url: str) -> None:
    async with fenced.connect_async(memory_url, signing_key=KEY) as locks:
        async with locks.lock("jobs", ttl=5) as lease:
            assert lease.token.signature is not None
            result = await locks.check(lease.token)
            assert result.current and result.is_highest
        forged = FencingToken("jobs", lease.token.value, ("k1", b"\0" * 32))
        with pytest.raises(SignatureError):
            await locks.check(forged)  # a signed token is checked against the key first
