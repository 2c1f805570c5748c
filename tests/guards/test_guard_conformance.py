"""The rules every guard keeps, checked once against all of them (tests/guards/envs.py).

Each checker returns the violations it saw (an empty list: the rules held), so each is shown
to fail on the planted broken guards too: ``<`` for ``<=``, check-then-write, and a mark
kept in the client. A guard added later joins by adding an environment to ``envs.GUARDS``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fenced
from fenced import (
    AboveCeilingError,
    Ceiling,
    FencedError,
    FencingToken,
    HmacKey,
    InvalidTokenError,
    Keyring,
    SignatureError,
    StaleTokenError,
    WrongLockError,
)
from fenced._core.signing import token_message
from tests.guards.envs import (
    GUARDS,
    LOCK,
    GuardEnv,
    Write,
    make_env,
    refusal_violations,
    tok,
)


@pytest.fixture(params=GUARDS)
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[GuardEnv]:
    yield from make_env(request.param, request, tmp_path)


# -- checkers -----------------------------------------------------------------------------


def sequence_violations(env: GuardEnv, write: Write) -> list[str]:
    """One holder writes twice with its token, a newer one twice, then older tokens again.

    Both sides: each lower token refused (naming both tokens, writing nothing), each equal or
    higher token accepted, and the data always the last accepted write.
    """
    bad: list[str] = []
    expected: str | None = None
    for step, (value, should_pass) in enumerate(
        [(5, True), (5, True), (7, True), (7, True), (6, False), (3, False), (8, True)]
    ):
        text = f"{value}#{step}"
        try:
            write(tok(value), text)
            passed = True
        except FencedError as exc:
            passed = False
            if not isinstance(exc, StaleTokenError):
                bad.append(f"step {step}: token {value} refused with {exc!r}")
            elif exc.token.value != value or exc.high_water is None:
                bad.append(f"step {step}: refusal does not name both tokens: {exc!r}")
        if passed != should_pass:
            verdict = "accepted" if passed else "refused"
            bad.append(f"step {step}: token {value} {verdict}")
        if passed:
            expected = text
        if env.read() != expected:
            bad.append(f"step {step}: data is {env.read()!r}, expected {expected!r}")
    return bad


def reopen_violations(env: GuardEnv, make_write: Callable[[], Write]) -> list[str]:
    """The mark lives in the resource: a restarted client still refuses an older token."""
    make_write()(tok(10), "ten")
    env.reopen()
    write = make_write()
    bad = []
    try:
        write(tok(9), "nine")
        bad.append("after reopening, token 9 was accepted after 10")
    except StaleTokenError:
        pass
    if env.read() != "ten":
        bad.append(f"data after reopen: {env.read()!r}")
    return bad


def interleaving_violations(env: GuardEnv, write_a: Write) -> list[str]:
    """A (token 5) is caught between its check and its write; B (token 7) writes meanwhile.

    Whatever the guard does, the data must end as the write of the highest accepted token.
    ``write_a`` may call the env's ``between`` hook; for a real guard there is no gap, and
    B simply writes before or after A's single atomic step.
    """
    accepted: list[tuple[int, str]] = []
    try:
        write_a(tok(5), "a5")
        accepted.append((5, "a5"))
    except StaleTokenError:
        pass
    final = env.read()
    if any(t == 7 for t, _ in accepted) or final is None:
        return []
    return [] if final == "b7" else [f"token 7 was accepted, but the data ended as {final!r}"]


def racing_violations(env: GuardEnv, rounds: int = 12) -> list[str]:
    """Threads race a lower and a higher token: the data must end as the higher one's."""
    bad = []
    for r in range(rounds):
        low, high = 100 + 2 * r, 101 + 2 * r
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def go(
            value: int, barrier: threading.Barrier = barrier, errors: list[Any] = errors
        ) -> None:
            barrier.wait(10)
            try:
                env.write(tok(value), f"v{value}")
            except StaleTokenError:
                pass
            except BaseException as exc:  # pragma: no cover - shown in the report
                errors.append(exc)

        threads = [threading.Thread(target=go, args=(v,)) for v in (low, high)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            bad.append(f"round {r}: {errors!r}")
        if env.read() != f"v{high}":
            bad.append(f"round {r}: data {env.read()!r} after {low} and {high} raced")
    return bad


# -- the rules, on every guard --------------------------------------------------------------


def test_stale_refused_current_and_equal_accepted(env: GuardEnv) -> None:
    assert sequence_violations(env, env.write) == []


def test_the_mark_survives_a_restarted_client(env: GuardEnv) -> None:
    assert reopen_violations(env, lambda: env.write) == []


def test_no_write_slips_between_check_and_write(env: GuardEnv) -> None:
    env.write(tok(1), "start")

    def write_a(token: FencingToken, value: str) -> None:
        env.write(tok(7), "b7")  # B first, fully
        env.write(token, value)  # then A: must be refused

    assert interleaving_violations(env, write_a) == []
    assert env.high_water() == tok(7)


def test_racing_writers_end_with_the_higher_token(env: GuardEnv) -> None:
    assert racing_violations(env) == []


MALFORMED: list[Any] = [
    *("", "conformance", "conformance:", "conformance:0", "conformance:-1", "x:y:1"),
    *(5, None),
]


def test_malformed_tokens_change_nothing(env: GuardEnv) -> None:
    # Every malformed token on one guard (one set-up, not one per token: 200 set-ups were a
    # sixth of this file's time); each is refused and leaves the data and the mark as they were.
    env.write(tok(3), "three")
    for bad in MALFORMED:
        try:
            env.write(bad, "bad")
        except (InvalidTokenError, TypeError):
            pass
        else:
            pytest.fail(f"the malformed token {bad!r} was accepted")
        assert (env.read(), env.high_water()) == ("three", tok(3)), bad


def test_another_locks_token_changes_nothing(env: GuardEnv) -> None:
    env.write(tok(3), "three")
    with pytest.raises(WrongLockError):
        env.write(FencingToken("other-lock", 10**6), "foreign")
    assert env.read() == "three" and env.high_water() == tok(3)


def test_text_form_of_the_token_is_accepted(env: GuardEnv) -> None:
    env.write(f"{LOCK}:4", "four")
    assert env.read() == "four" and env.high_water() == tok(4)


# -- each checker catches each planted bug ----------------------------------------------------


def test_sequence_check_catches_lt(env: GuardEnv) -> None:
    if env.lt_unobservable:
        pytest.skip(env.lt_unobservable)
    assert sequence_violations(env, env.planted("lt")) != []


def test_reopen_check_catches_a_client_side_mark(env: GuardEnv) -> None:
    assert reopen_violations(env, lambda: env.planted("client_side")) != []


def test_interleaving_check_catches_check_then_write(env: GuardEnv) -> None:
    env.write(tok(1), "start")
    write_a = env.planted("check_then_write", between=lambda: env.write(tok(7), "b7"))
    assert interleaving_violations(env, write_a) != []


# -- signed tokens (fenced._core.signing) ------------------------------------------------------

KEY = HmacKey("k1", b"k" * 32)
OTHER_KEY = HmacKey("k2", b"o" * 32)


def signed(token: FencingToken, key: HmacKey = KEY, kid: str | None = None) -> FencingToken:
    kid = key.kid if kid is None else kid
    return FencingToken(
        token.lock, token.value, (kid, key.sign(token_message(token.lock, token.value, kid)))
    )


def signature_violations(env: GuardEnv, keys: Keyring) -> list[str]:
    """With verify keys, every token but a good signed one is refused before the mark or the
    data move; a good signed stale token is still stale; a good current one is accepted."""
    env.verify_keys = keys
    env.reopen()
    env.write(signed(tok(5)), "five")
    good = signed(tok(9))
    flipped = good.signature[1][:-1] + bytes([good.signature[1][-1] ^ 1])  # type: ignore[index]
    refused = {
        "unsigned": tok(6),
        "forged (last byte flipped)": FencingToken(LOCK, 9, ("k1", flipped)),
        "unknown key": signed(tok(10), OTHER_KEY),
        "another key's signature under k1": signed(tok(11), OTHER_KEY, kid="k1"),
        "re-labelled from another lock": FencingToken(
            LOCK, 12, signed(FencingToken("elsewhere", 12)).signature
        ),
        "moved to another value": FencingToken(LOCK, 13, signed(tok(14)).signature),
        "huge forged": FencingToken(LOCK, 2**63 - 1, ("k1", b"x" * 32)),
        "truncated text": str(signed(tok(15)))[:-1],
    }
    bad = refusal_violations(env, refused, "five", tok(5))
    try:
        env.write(signed(tok(4)), "old")
        bad.append("a good signature on a stale token: accepted")
    except StaleTokenError:
        pass
    try:
        env.write(signed(tok(5)), "five again")  # the holder writes again
        env.write(signed(tok(6)), "six")
    except FencedError as exc:
        bad.append(f"a good signed token was refused: {exc}")
    if env.read() != "six" or env.high_water() != tok(6):
        bad.append("good signed tokens were not accepted")
    return bad


def test_only_well_signed_tokens_pass_when_signing_is_required(env: GuardEnv) -> None:
    if not env.signs:
        pytest.skip(
            "the middleware in front of this store verifies (tests/guards/test_guard_asgi.py)"
        )
    assert signature_violations(env, Keyring([KEY])) == []


class PrefixKeyring(Keyring):
    """PLANTED BUG: compares only the first bytes of a signature."""

    def verify(self, lock: str, value: int, signature: tuple[str, bytes] | None) -> None:
        if signature is None:
            raise SignatureError("unsigned")
        good = KEY.sign(token_message(lock, value, signature[0]))
        if good[:8] != signature[1][:8]:
            raise SignatureError("bad")


class UnsignedPassKeyring(Keyring):
    """PLANTED BUG: an unsigned token skips verification (``required`` ignored)."""

    def verify(self, lock: str, value: int, signature: tuple[str, bytes] | None) -> None:
        if signature is not None:
            super().verify(lock, value, signature)


@pytest.mark.parametrize("planted", [PrefixKeyring, UnsignedPassKeyring])
def test_signature_check_catches_planted_verifiers(env: GuardEnv, planted: type[Keyring]) -> None:
    if not env.signs:
        pytest.skip("this store's middleware verifies signatures")
    assert signature_violations(env, planted([KEY])) != []


class _NoCeiling:
    """PLANTED BUG: a ceiling that never refuses."""

    def verify(self, lock: str, value: int, signature: tuple[str, bytes] | None) -> None:
        return None


def ceiling_violations(env: GuardEnv, make: Callable[[Any], Any], url: str) -> list[str]:
    """A ceiling (for resources that cannot hold a key): tokens the source granted pass, and
    so do tokens at most ``slack`` above the highest grant; a huge forged one is refused
    before the mark or the data move."""
    bad: list[str] = []
    with fenced.connect(url) as locks:
        for _ in range(3):
            with locks.lock(LOCK, ttl=5) as lease:
                granted = lease.token
        env.verify_keys = make(locks)
        env.reopen()
        env.write(granted, "real")
        env.write(tok(granted.value + 2), "within slack")
        for value in (2**62, granted.value + 3):
            try:
                env.write(tok(value), "forged")
                bad.append(f"{value}: accepted")
            except AboveCeilingError:
                pass
            except FencedError as exc:  # (refused, but only because a forged one got in)
                bad.append(f"{value}: {exc}")
        if env.read() != "within slack" or env.high_water() != tok(granted.value + 2):
            bad.append("the data or the mark moved")
    return bad


def test_a_ceiling_refuses_tokens_far_above_the_sources_grants(
    env: GuardEnv, memory_url: str
) -> None:
    if not env.signs:
        pytest.skip("the middleware in front of this store checks tokens")
    assert ceiling_violations(env, lambda locks: Ceiling(locks, slack=2), memory_url) == []


def test_ceiling_check_catches_a_planted_no_op(env: GuardEnv, memory_url: str) -> None:
    if not env.signs:
        pytest.skip("the middleware in front of this store checks tokens")
    assert ceiling_violations(env, lambda locks: _NoCeiling(), memory_url) != []
