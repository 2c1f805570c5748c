"""Signatures bound to a source (issue 25 §4), checked once against every guard
(tests/guards/envs.py), on its real store: a token of another source signed with the same key,
one whose source field was stripped, one re-labelled to the trusted source, one under a
retired key id, and an unbound (v1) one are refused before the mark or the data move; the
trusted source's own tokens are accepted; the migration (``accept_unbound``) accepts v1 and
still refuses another source. A planted keyring that trusts the source a token names is
caught.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced import FencedError, FencingToken, HmacKey, Keyring, SignatureError
from fenced._core.signing import Signature, split_signature, token_message
from tests.guards.envs import GUARDS, GuardEnv, make_env, refusal_violations, tok

KEY = HmacKey("k1", b"k" * 32)  # shared by prod and staging: the case binding exists for
RETIRED = HmacKey("k0", b"r" * 32)


@pytest.fixture(params=GUARDS)
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[GuardEnv]:
    yield from make_env(request.param, request, tmp_path)


def bound(token: FencingToken, source: str, key: HmacKey = KEY) -> FencingToken:
    sig = key.sign(token_message(token.lock, token.value, key.kid, source))
    return FencingToken(token.lock, token.value, (key.kid, sig, source))


def unbound(token: FencingToken, key: HmacKey = KEY) -> FencingToken:
    sig = key.sign(token_message(token.lock, token.value, key.kid))
    return FencingToken(token.lock, token.value, (key.kid, sig))


def source_violations(env: GuardEnv, keys: Keyring) -> list[str]:
    """A guard trusting source "prod": staging's tokens (same key) and every altered one are
    refused with the mark and the data unchanged; prod's are accepted."""
    env.verify_keys = keys
    env.reopen()
    env.write(bound(tok(1), "prod"), "prod's")
    staging = bound(tok(5), "staging")
    assert staging.signature is not None
    kid, sig, _ = split_signature(staging.signature)
    refused: dict[str, FencingToken | str] = {
        "another source, same key": staging,
        "another source, as text": str(staging),
        "re-labelled to prod": FencingToken(staging.lock, 5, (kid, sig, "prod")),
        "source field stripped": FencingToken(staging.lock, 5, (kid, sig)),
        "source stripped from the text": str(staging).replace(".staging.", "."),
        "unbound (v1)": unbound(tok(5)),
        "a retired key id": bound(tok(5), "prod", RETIRED),
    }
    bad = refusal_violations(env, refused, "prod's", tok(1))
    try:
        env.write(bound(tok(2), "prod"), "prod's next")
    except FencedError as exc:
        bad.append(f"prod's own token was refused: {exc}")
    if env.read() != "prod's next" or env.high_water() != tok(2):
        bad.append("prod's token was not accepted")
    return bad


def test_only_the_trusted_sources_tokens_pass(env: GuardEnv) -> None:
    if not env.signs:
        pytest.skip(
            "the middleware in front of this store verifies (tests/guards/test_guard_asgi.py)"
        )
    assert source_violations(env, Keyring([KEY], source_id="prod")) == []


def test_the_migration_accepts_unbound_tokens_and_still_refuses_another_source(
    env: GuardEnv,
) -> None:
    if not env.signs:
        pytest.skip("the middleware in front of this store verifies")
    env.verify_keys = Keyring([KEY], source_id="prod", accept_unbound=True)
    env.reopen()
    env.write(unbound(tok(3)), "handed out before the source was named")
    with pytest.raises(SignatureError):
        env.write(bound(tok(5), "staging"), "staging's")
    env.write(bound(tok(4), "prod"), "prod's")
    assert env.read() == "prod's" and env.high_water() == tok(4)


class TrustsTheClaim(Keyring):
    """PLANTED BUG: checks the signature against the source the token names."""

    def verify(self, lock: str, value: int, signature: Signature | None) -> None:
        if signature is None:
            raise SignatureError("unsigned")
        kid, sig, source = split_signature(signature)
        if not KEY.verify(token_message(lock, value, kid, source), sig):
            raise SignatureError("bad")


def test_a_keyring_that_trusts_the_tokens_claim_is_caught(env: GuardEnv) -> None:
    if not env.signs:
        pytest.skip("this store's middleware verifies signatures")
    assert source_violations(env, TrustsTheClaim([KEY], source_id="prod")) != []
