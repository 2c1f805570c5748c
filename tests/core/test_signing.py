"""Signed tokens: the text form, the keys, signing in the core and in `fenced lock`.

The guards' side (every guard refuses what is not well signed) is in
tests/guards/test_guard_conformance.py, with planted verifiers it must catch.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fenced
from fenced import FencingToken, HmacKey, InvalidTokenError, Keyring, SignatureError
from fenced._core.signing import (
    Ed25519SigningKey,
    generate_key,
    key_text,
    load_key,
    load_keys,
    token_message,
)
from tests.helpers import TLS, write_key_file

KEY = HmacKey("k1", b"k" * 32)


def sign(token: FencingToken, key: object = KEY) -> FencingToken:
    kid = key.kid  # type: ignore[attr-defined]
    sig = key.sign(token_message(token.lock, token.value, kid))  # type: ignore[attr-defined]
    return FencingToken(token.lock, token.value, (kid, sig))


# (ASCII patterns, drawn from an ASCII alphabet: with hypothesis's default, utf-8, a fresh
# clone's first run mapped all of Unicode through the codec, ~3 s of CPU in each process
# that got there before its cache file was written)
ASCII = st.characters(codec="ascii")
NAMES = st.from_regex(
    r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]{0,20}(/[A-Za-z0-9_][A-Za-z0-9_.-]{0,8}){0,2}",
    fullmatch=True,
    alphabet=ASCII,
)


# (each example tries every one-byte change of its token: ~400 verifications; 100 examples
# in the suite, FENCED_SIGNING_EXAMPLES=2000 in `make test-long`)
@settings(
    max_examples=int(os.environ.get("FENCED_SIGNING_EXAMPLES", "100")),
    deadline=None,
    derandomize=True,
)
@given(
    name=NAMES,
    value=st.integers(1, 2**63 - 1),
    ed=st.booleans(),
    source=st.none() | st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True, alphabet=ASCII),
)
def test_text_form_round_trips_and_any_one_byte_change_is_refused(
    name: str, value: int, ed: bool, source: str | None
) -> None:
    """Unbound (v1) and bound (v2) tokens alike."""
    key = ED if ed else KEY
    token = sign(FencingToken(name, value), key)
    if source is not None:
        token = sign_bound(FencingToken(name, value), source, key)
    text = str(token)
    parsed = FencingToken.parse(text)
    assert parsed == token and parsed.signature == token.signature and str(parsed) == text
    verify_key = key.public() if isinstance(key, Ed25519SigningKey) else key
    ring = Keyring([verify_key], source_id=source)
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
    write_key_file(path, key)
    assert repr(load_key(path)) == "HmacKey(kid='k1')"


def test_connect_with_a_signing_key_signs_every_grant(memory_url: str, tmp_path: Path) -> None:
    path = tmp_path / "signing.key"
    write_key_file(path, KEY)
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


# -- source binding (issue 25 §4) ------------------------------------------------------------


def grant_many(url: str, n: int, **options: object) -> FencingToken:
    """The n-th grant of lock "orders" at ``url`` (a fresh source: tokens 1..n)."""
    with fenced.connect(url, **options) as locks:
        for _ in range(n):
            with locks.lock("orders", ttl=5) as lease:
                token = lease.token
    return token


def test_a_token_of_another_source_sharing_the_key_is_refused(tmp_path: Path) -> None:
    """The issue's case: staging and prod share one Ed25519 key; prod's mark is at 1 and a
    staging token 5 must not move it. Bound to their source ids, staging's tokens are refused
    by prod's guard with the mark and the data unchanged; prod's own are accepted."""
    from fenced.guards.files import FileGuard

    key = tmp_path / "shared.key"
    subprocess.run(
        [sys.executable, "-m", "fenced", "keygen", "ed25519", "k1", str(key)], check=True
    )
    prod = grant_many(f"sqlite:///{tmp_path}/prod.db", 1, signing_key=str(key), source_id="prod")
    staging = grant_many(
        f"sqlite:///{tmp_path}/staging.db", 5, signing_key=str(key), source_id="staging"
    )
    assert str(prod).startswith("orders:1.prod.k1.") and staging.signature is not None
    guard = FileGuard(tmp_path / "data", lock="orders",
                      verify=load_keys([f"{key}.pub"], source_id="prod"))  # fmt: skip
    guard.write("report", b"prod's", token=prod)
    with pytest.raises(SignatureError, match="from source 'staging', not 'prod'"):
        guard.write("report", b"staging's", token=staging)
    with pytest.raises(SignatureError, match="from source 'staging'"):
        guard.write(
            "report", b"staging's", token=str(staging)
        )  # (the text form, as headers carry it)
    assert (
        guard.read("report") == (prod, b"prod's") and guard.high_water("report") == prod
    )  # mark still 1
    # staging's token re-labelled as prod's: the signature covers the source id
    relabelled = FencingToken("orders", 5, (staging.signature[0], staging.signature[1], "prod"))
    with pytest.raises(SignatureError, match="bad signature"):
        guard.write("report", b"x", token=relabelled)
    # its source field stripped (a v1 token with a v2 signature): unbound, and forged anyway
    stripped = FencingToken("orders", 5, staging.signature[:2])
    with pytest.raises(SignatureError, match="not bound to a source"):
        guard.write("report", b"x", token=stripped)
    with pytest.raises(SignatureError, match="bad signature"):
        load_keys([f"{key}.pub"]).verify("orders", 5, stripped.signature)
    assert guard.high_water("report") == prod
    guard.write("report", b"prod's again", token=grant_many(
        f"sqlite:///{tmp_path}/prod.db", 1, signing_key=str(key), source_id="prod"))  # fmt: skip
    assert guard.read("report")[1] == b"prod's again"


def test_a_planted_keyring_that_ignores_the_source_is_caught() -> None:
    """Planted check: a keyring trusting the source id the token claims accepts staging's
    token at prod's resource; the real one refuses it."""
    staging = sign_bound(FencingToken("orders", 5), "staging")

    class TrustsTheClaim(Keyring):
        def verify(self, lock: str, value: int, signature: object) -> None:
            kid, sig, source = signature  # type: ignore[misc]
            if not KEY.verify(token_message(lock, value, kid, source), sig):
                raise SignatureError("bad")

    TrustsTheClaim([KEY], source_id="prod").verify("orders", 5, staging.signature)  # let in
    with pytest.raises(SignatureError):
        Keyring([KEY], source_id="prod").verify("orders", 5, staging.signature)


def sign_bound(token: FencingToken, source: str, key: object = KEY) -> FencingToken:
    kid = key.kid  # type: ignore[attr-defined]
    message = token_message(token.lock, token.value, kid, source)
    return FencingToken(token.lock, token.value, (kid, key.sign(message), source))  # type: ignore[attr-defined]


def test_unbound_tokens_keep_verifying_and_migrate_with_accept_unbound() -> None:
    """The wire format is versioned: v1 (unbound) tokens already handed out keep verifying
    where the keyring names no source; a keyring naming its source refuses them unless
    accept_unbound (the migration), which still refuses other sources' bound tokens."""
    v1 = sign(FencingToken("orders", 3))
    assert FencingToken.parse(str(v1)).signature == v1.signature  # the v1 text form, unchanged
    Keyring([KEY]).verify("orders", 3, v1.signature)
    with pytest.raises(SignatureError, match="not bound to a source"):
        Keyring([KEY], source_id="prod").verify("orders", 3, v1.signature)
    migrating = Keyring([KEY], source_id="prod", accept_unbound=True)
    migrating.verify("orders", 3, v1.signature)
    migrating.verify("orders", 4, sign_bound(FencingToken("orders", 4), "prod").signature)
    with pytest.raises(SignatureError, match="from source 'staging'"):
        migrating.verify("orders", 4, sign_bound(FencingToken("orders", 4), "staging").signature)
    # a bound token at a keyring that names no source: it cannot judge the source, refuses
    with pytest.raises(SignatureError, match="names no source"):
        Keyring([KEY]).verify("orders", 4, sign_bound(FencingToken("orders", 4), "prod").signature)
    # an old key id, retired from the ring: refused, bound or not
    old = HmacKey("old", b"o" * 32)
    with pytest.raises(SignatureError, match="unknown key 'old'"):
        Keyring([KEY], source_id="prod").verify(
            "orders", 4, sign_bound(FencingToken("orders", 4), "prod", old).signature
        )
    for bad in ("", "a b", "x" * 65, "p.q", 5):
        with pytest.raises(fenced.ConfigurationError, match="source_id"):
            Keyring([KEY], source_id=bad)  # type: ignore[arg-type]
    with pytest.raises(fenced.ConfigurationError, match="accept_unbound"):
        Keyring([KEY], accept_unbound=True)


def test_public_and_private_keys_in_the_wrong_place_get_clear_errors(tmp_path: Path) -> None:
    key = tmp_path / "ed.key"
    subprocess.run(
        [sys.executable, "-m", "fenced", "keygen", "ed25519", "e1", str(key)], check=True
    )
    with pytest.raises(fenced.ConfigurationError, match=r"public key \(\.pub\).*private key"):
        fenced.connect(f"sqlite:///{tmp_path}/l.db", signing_key=f"{key}.pub")
    with pytest.raises(fenced.ConfigurationError, match=r"private key.*\.pub"):
        load_keys([str(key)])  # a resource must not hold the private half
    with pytest.raises(fenced.ConfigurationError) as info:
        load_keys([key.read_text()])  # (the key's line itself, as an environment carries it)
    assert key.read_text().split()[4] not in str(info.value)  # (never the key material)
    ring = load_keys([f"{key}.pub"], source_id="prod")
    assert ring.source_id == "prod" and "prod" in repr(ring)


def cli_run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fenced", *args], env=env, capture_output=True, text=True
    )


def test_check_token_refuses_unsigned_and_foreign_tokens_and_needs_only_the_public_key(
    tmp_path: Path,
) -> None:
    """fenced check-token with a key: an unsigned token exits 65, invalid (as /v1/check
    answers 400; 2 is for usage errors), and the key may be the .pub alone (by --verify-key or
    $FENCED_SIGNING_KEY)."""
    key = tmp_path / "ed.key"
    url = f"sqlite:///{tmp_path}/l.db"
    base = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}
    env = {**base, "FENCED_URL": url}
    subprocess.run(
        [sys.executable, "-m", "fenced", "keygen", "ed25519", "e1", str(key)], check=True
    )
    with fenced.connect(url, signing_key=str(key), source_id="prod") as locks:
        lease = locks.lock("orders", ttl=30)
        token = lease.acquire()
        try:
            pub = ["--verify-key", f"{key}.pub", "--source-id", "prod"]
            ok = cli_run("check-token", str(token), *pub, env=env)
            assert ok.returncode == 0 and "current" in ok.stdout, ok.stderr
            plain = cli_run("check-token", str(token.unsigned()), *pub, env=env)
            assert plain.returncode == 65 and "unsigned" in plain.stderr, plain
            foreign = cli_run("check-token", str(token), "--verify-key", f"{key}.pub",
                              "--source-id", "staging", env=env)  # fmt: skip
            assert (
                foreign.returncode == 65 and "from source 'prod', not 'staging'" in foreign.stderr
            )
            # $FENCED_SIGNING_KEY holding the public key: enough to verify (it was refused)
            env_pub = {**env, "FENCED_SIGNING_KEY": f"{key}.pub", "FENCED_SOURCE_ID": "prod"}
            ok = cli_run("check-token", str(token), env=env_pub)
            assert ok.returncode == 0 and "current" in ok.stdout, ok.stderr
            plain = cli_run("check-token", str(token.unsigned()), env=env_pub)
            assert plain.returncode == 65 and "unsigned" in plain.stderr, plain
            # ... and the private one, from the source's environment: its public half
            env_priv = {**env_pub, "FENCED_SIGNING_KEY": str(key)}
            assert cli_run("check-token", str(token), env=env_priv).returncode == 0
            assert cli_run("check-token", str(token.unsigned()), env=env_priv).returncode == 65
            # a private key where a public one is expected: a clear one-line error
            wrong = cli_run("check-token", str(token), "--verify-key", str(key), env=env)
            assert wrong.returncode == 2 and "private key" in wrong.stderr
            assert len(wrong.stderr.strip().splitlines()) == 1
            assert key.read_text().split()[4] not in wrong.stderr
            # without a key, a token is only asked about (nothing to verify with)
            assert cli_run("check-token", str(token.unsigned()), env=env).returncode == 0
            no_key = cli_run("check-token", str(token), "--source-id", "prod", env=env)
            assert no_key.returncode == 2 and "need a key" in no_key.stderr
            # ($FENCED_SOURCE_ID alone, as `fenced lock` uses it: nothing to verify with)
            env_id = {**env, "FENCED_SOURCE_ID": "prod"}
            assert cli_run("check-token", str(token), env=env_id).returncode == 0
        finally:
            lease.release()


def test_check_with_public_keys_only_refuses_unsigned_and_foreign_tokens(tmp_path: Path) -> None:
    """locks.check(token) with verify= (a keyring of .pub keys): a resource that asks the
    source never needs the private key; with the source's own key, unsigned is refused too."""
    key = Ed25519SigningKey("e1", b"\x09" * 32)
    url = f"sqlite:///{tmp_path}/l.db"
    with fenced.connect(url, signing_key=key, source_id="prod") as source:
        with source.lock("orders", ttl=30) as lease:
            token = lease.token
            with pytest.raises(SignatureError, match="unsigned"):
                source.check(token.unsigned())  # (it answered 'current' before)
            ring = Keyring([key.public()], source_id="prod")
            with fenced.connect(url, verify=ring) as resource:
                assert resource.check(token).current
                assert resource.check(str(token)).current
                with pytest.raises(SignatureError, match="unsigned"):
                    resource.check(token.unsigned())
                foreign = sign_bound(token.unsigned(), "staging", key)
                with pytest.raises(SignatureError, match="from source 'staging'"):
                    resource.check(foreign)
            # A ceiling asks the (signing) source with the token's signature: a signed token
            # passes, an unsigned one is refused when it asks (a ceiling is no signature check
            # of its own: below the highest it has seen, it does not ask again).
            fenced.Ceiling(source).verify(token.lock, token.value, token.signature)
            with pytest.raises(SignatureError):
                fenced.Ceiling(source).verify(token.lock, token.value, None)
    with pytest.raises(fenced.ConfigurationError, match="verify="):
        fenced.connect(url, verify="not a keyring")


def test_fenced_serve_binds_its_signatures_to_its_source_id(tmp_path: Path) -> None:
    """fenced serve --source-id: its grants are bound; /v1/check refuses a token signed with
    its own key for another source, and an unsigned one; the http:// source's client gets
    the bound token and its check() goes through /v1/check."""
    import httpx

    from fenced.testing.servers import FencedServer

    key_file = tmp_path / "signing.key"
    write_key_file(key_file, KEY)
    source = f"sqlite:///{tmp_path / 'locks.db'}"
    with FencedServer(source, args=["--signing-key", str(key_file), "--source-id", "prod"]) as s:
        u = s.url  # type: ignore[attr-defined]
        got = httpx.post(f"{u}/v1/locks/acct/acquire", json={}, timeout=30, verify=TLS).json()
        signed = FencingToken.parse(got["signed"])
        assert str(signed).startswith("acct:1.prod.k1.")
        Keyring([KEY], source_id="prod").verify(signed.lock, signed.value, signed.signature)

        def check(text: str) -> httpx.Response:
            return httpx.post(f"{u}/v1/check", json={"token": text}, timeout=30, verify=TLS)

        assert check(str(signed)).json()["verdict"] == "current"
        for bad in (sign_bound(signed.unsigned(), "staging"), sign(signed.unsigned()),
                    signed.unsigned()):  # fmt: skip
            r = check(str(bad))
            assert r.status_code == 400 and r.json()["error"] == "invalid_token", bad
        httpx.post(f"{u}/v1/locks/acct/release",
                   json={"token": got["signed"], "request_id": got["request_id"]}, timeout=30, verify=TLS)  # fmt: skip
        with fenced.connect(u) as locks:
            with locks.lock("acct", ttl=5) as lease:
                assert lease.token.signature is not None and lease.token.signature[2:] == ("prod",)
                assert locks.check(lease.token).current
                with pytest.raises(InvalidTokenError):
                    locks.check(sign_bound(lease.token.unsigned(), "staging"))


def test_check_token_with_the_sources_key_refuses_unsigned_and_verifies_with_the_pub(
    tmp_path: Path,
) -> None:
    """The issue's two cases as reported (no source ids): with $FENCED_SIGNING_KEY set,
    check-token answered 'current' (exit 0) for an unsigned token, and refused the .pub."""
    key = tmp_path / "ed.key"
    url = f"sqlite:///{tmp_path}/l.db"
    base = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}
    subprocess.run(
        [sys.executable, "-m", "fenced", "keygen", "ed25519", "e1", str(key)], check=True
    )
    with fenced.connect(url, signing_key=str(key)) as locks, locks.lock("orders", ttl=30) as lease:
        token = lease.token
        for held in (str(key), f"{key}.pub"):
            env = {**base, "FENCED_URL": url, "FENCED_SIGNING_KEY": held}
            ok = cli_run("check-token", str(token), env=env)
            assert ok.returncode == 0 and "current" in ok.stdout, (held, ok.stderr)
            plain = cli_run("check-token", str(token.unsigned()), env=env)
            assert plain.returncode == 65 and "unsigned" in plain.stderr, (held, plain)


def test_a_replicated_groups_copies_pass_members_that_verify(tmp_path: Path) -> None:
    """A group's state transfer (add) and read repair re-present tokens read from a member:
    members whose guards verify signatures refused them unsigned (ReplicationError), so a
    group with signing could not add a member nor repair one. Now they carry a signature."""
    import sqlite3

    from fenced.guards.sql import SQLGuard
    from fenced.replicated import Group
    from fenced.replicated._members import Item, stamp

    ring = Keyring([KEY], source_id="prod")

    def member(name: str) -> object:
        path = tmp_path / f"{name}.db"
        return SQLGuard("orders", verify=ring).fencer(
            lambda: sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        )

    url = f"sqlite:///{tmp_path}/l.db"
    with fenced.connect(url, signing_key=KEY, source_id="prod") as locks:
        group = Group("orders", source=locks, members={"a": member("a"), "b": member("b")})
        with locks.lock("orders", ttl=10) as lease:
            group.writer(lease).set("k", b"v1")
            token = lease.token
        group.add("c", member("c"))  # the copy to c: under a's mark, signed
        assert [m.name for m in group.status()[1] if m.in_configuration] == ["a", "b", "c"]
        # a key only a has (as after a writer's partial write): a read repairs b and c
        cfg = group.configuration()
        item = Item("only-a", stamp(token.value, 99), b"x")
        locks.portal.call(group.aio.member("a").apply(token, cfg.epoch, [item]))
        assert group.read("only-a") == b"x"
        for name in ("b", "c"):
            snap = locks.portal.call(group.aio.member(name).read(["only-a"]))
            assert snap.items["only-a"].value == b"x"
        # an unsigned or foreign token is still refused by the members
        with pytest.raises(SignatureError):
            locks.portal.call(
                group.aio.member("a").apply(FencingToken("orders", 99), cfg.epoch, [])
            )


async def test_the_http_middlewares_refuse_another_sources_token(tmp_path: Path) -> None:
    """FencingMiddleware and FencingWSGIMiddleware with verify= trusting "prod": a
    staging token signed with the same key is a 400 before the store's mark moves; prod's
    own is let through (the same Keyring every guard uses)."""
    import httpx

    from fenced.guards.asgi import FencingMiddleware, SQLiteFenceStore
    from fenced.guards.wsgi import FencingWSGIMiddleware

    ring = Keyring([KEY], source_id="prod")
    prod, staging = (
        sign_bound(FencingToken("jobs", 1), "prod"),
        sign_bound(FencingToken("jobs", 5), "staging"),
    )

    async def ok_app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async with SQLiteFenceStore(str(tmp_path / "a.db")) as store:
        app = FencingMiddleware(ok_app, store=store, lock="jobs", verify=ring)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            r = await client.post("/x", headers={"Fencing-Token": str(staging)})
            assert r.status_code == 400 and "staging" in r.text
            assert (
                await client.post("/x", headers={"Fencing-Token": str(prod)})
            ).status_code == 200
            r = await client.post("/x", headers={"Fencing-Token": "jobs:2"})
            assert r.status_code == 400 and "unsigned" in r.text

    def ok_wsgi(environ: Any, start_response: Any) -> list[bytes]:
        start_response("200 OK", [])
        return [b"ok"]

    with FencingWSGIMiddleware(
        ok_wsgi, store=SQLiteFenceStore(str(tmp_path / "w.db")), lock="jobs", verify=ring
    ) as wsgi:
        client = httpx.Client(transport=httpx.WSGITransport(app=wsgi), base_url="http://app")
        with client:
            r = client.post("/x", headers={"Fencing-Token": str(staging)})
            assert r.status_code == 400 and "staging" in r.text
            assert client.post("/x", headers={"Fencing-Token": str(prod)}).status_code == 200


def test_naming_a_running_fenced_serve_keeps_its_handed_out_tokens_with_accept_unbound(
    tmp_path: Path,
) -> None:
    """The migration through fenced serve: a lease granted before the server had a source id
    carries an unbound (v1) token; restarted with --source-id and --accept-unbound, the server
    still renews and checks it (and refuses another source's); without --accept-unbound, the
    v1 token is refused (400), as every resource trusting "prod" alone refuses it."""
    import httpx

    from fenced.testing.servers import FencedServer

    key_file = tmp_path / "signing.key"
    write_key_file(key_file, KEY)
    source = f"sqlite:///{tmp_path / 'locks.db'}"
    signing = ["--signing-key", str(key_file)]

    def post(u: str, path: str, body: object) -> httpx.Response:
        return httpx.post(f"{u}{path}", json=body, timeout=30, verify=TLS)

    with FencedServer(source, args=signing) as s:
        got = post(s.url, "/v1/locks/acct/acquire", {"ttl": 60, "request_id": "r1"}).json()  # type: ignore[attr-defined]
    v1 = got["signed"]
    assert (
        FencingToken.parse(v1).signature is not None and len(FencingToken.parse(v1).signature) == 2
    )  # type: ignore[arg-type]
    renew = {"token": v1, "request_id": "r1", "ttl": 60}
    named = [*signing, "--source-id", "prod"]
    with FencedServer(source, args=[*named, "--accept-unbound"]) as s:
        u = s.url  # type: ignore[attr-defined]
        assert post(u, "/v1/locks/acct/renew", renew).status_code == 200
        assert post(u, "/v1/check", {"token": v1}).json()["verdict"] == "current"
        staging = sign_bound(FencingToken.parse(v1).unsigned(), "staging")
        assert post(u, "/v1/check", {"token": str(staging)}).status_code == 400
    with FencedServer(source, args=named) as s:
        u = s.url  # type: ignore[attr-defined]
        r = post(u, "/v1/locks/acct/renew", renew)
        assert r.status_code == 400 and "not bound to a source" in r.text
        assert post(u, "/v1/check", {"token": v1}).status_code == 400


def test_fenced_lock_binds_its_token_to_the_source_id(tmp_path: Path) -> None:
    """`fenced lock --source-id` (or $FENCED_SOURCE_ID) puts a bound token in $FENCING_TOKEN."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}
    env = {**base, "FENCED_URL": f"sqlite:///{tmp_path}/l.db",
           "FENCED_SIGNING_KEY": key_text(KEY).strip()}  # fmt: skip
    echo = ["sh", "-c", 'echo "$FENCING_TOKEN"']
    for args, extra in ((["--source-id", "prod"], {}), ([], {"FENCED_SOURCE_ID": "prod"})):
        out = cli_run("lock", "jobs", *args, "--", *echo, env={**env, **extra})
        token = FencingToken.parse(out.stdout.strip())
        Keyring([KEY], source_id="prod").verify(token.lock, token.value, token.signature)
    bad = cli_run("lock", "jobs", "--source-id", "no such", "--", *echo, env=env)
    assert bad.returncode == 2 and "source_id must be" in bad.stderr


def test_signing_without_a_source_id_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """v1 tokens are valid at every source holding the key: the user is told, once."""
    from fenced._core import lease as _lease

    key = HmacKey("k1", os.urandom(32))
    _lease._warned_unbound = False
    with caplog.at_level(logging.WARNING, logger="fenced"):
        fenced.connect(f"sqlite:///{tmp_path}/a.db", signing_key=key).close()
        fenced.connect(f"sqlite:///{tmp_path}/b.db", signing_key=key).close()
        fenced.connect(f"sqlite:///{tmp_path}/c.db", signing_key=key, source_id="prod").close()
    said = [r for r in caplog.records if "without source_id" in r.getMessage()]
    assert len(said) == 1
