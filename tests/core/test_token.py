from __future__ import annotations

import pickle

import pytest

import fenced
from fenced import FencingToken, InvalidTokenError, WrongLockError


def test_canonical_text_round_trip() -> None:
    t = FencingToken("invoices", 34)
    assert str(t) == "invoices:34"
    assert FencingToken.parse("invoices:34") == t
    assert FencingToken.parse(b"invoices:34") == t
    assert int(t) == 34 and t.value == 34 and t.lock == "invoices"
    assert FencingToken.parse("a:b:7").lock == "a:b"  # the value follows the last colon
    assert FencingToken.parse(f"x:{2**63 - 1}").value == fenced.MAX_TOKEN
    assert pickle.loads(pickle.dumps(t)) == t
    assert repr(t) == "FencingToken('invoices', 34)"


@pytest.mark.parametrize(
    "text",
    [
        "",
        "invoices",
        "invoices:",
        ":5",
        "invoices:0",
        "invoices:-1",
        "invoices:+1",
        "invoices:007",
        "invoices:1.0",
        "invoices:0x10",
        "invoices:1e3",
        " invoices:5",
        "invoices:5 ",
        "invoices:5\n",
        "invoices: 5",
        "inv oices:5",
        "invoices:٣",  # a non-ASCII digit
        f"x:{2**63}",
        f"x:{10**30}",
        "x:" + "9" * 5000,
        "é:5",
    ],
)
def test_parse_rejects(text: str) -> None:
    with pytest.raises(InvalidTokenError):
        FencingToken.parse(text)


@pytest.mark.parametrize("value", [0, -1, 2**63, True, 1.0, "5", None])
def test_constructor_rejects(value: object) -> None:
    with pytest.raises(InvalidTokenError):
        FencingToken("x", value)  # type: ignore[arg-type]


def test_parse_rejects_non_text() -> None:
    for bad in (5, None, b"\xff:1", ["x:1"]):
        with pytest.raises(InvalidTokenError):
            FencingToken.parse(bad)


def test_wrong_lock() -> None:
    with pytest.raises(WrongLockError):
        FencingToken.parse("payroll:5", lock="invoices")
    with pytest.raises(WrongLockError):
        FencingToken.coerce(FencingToken("payroll", 5), lock="invoices")
    assert FencingToken.coerce("invoices:5", lock="invoices").value == 5
    assert issubclass(WrongLockError, InvalidTokenError)


def test_ordering_within_one_lock_only() -> None:
    a, b = FencingToken("x", 1), FencingToken("x", 2)
    assert a < b and b > a and a <= a and b >= a and a != b
    assert sorted([b, a]) == [a, b]
    other = FencingToken("y", 1)
    assert other != a  # equality across locks is just False
    for op in (lambda: a < other, lambda: a <= other, lambda: a > other, lambda: a >= other):
        with pytest.raises(WrongLockError):
            op()
    with pytest.raises(TypeError):
        _ = a < 5  # type: ignore[operator]
    assert len({a, FencingToken("x", 1), other}) == 2


def test_stale_token_error_carries_both_tokens() -> None:
    err = fenced.StaleTokenError(FencingToken("x", 3), FencingToken("x", 4), "doc")
    assert err.token.value == 3 and err.high_water is not None and err.high_water.value == 4
    assert "x:3" in str(err) and "x:4" in str(err) and "doc" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert again.token == err.token and again.high_water == err.high_water


def test_error_tree() -> None:
    for cls in (
        fenced.InvalidTokenError,
        fenced.StaleTokenError,
        fenced.LockTimeout,
        fenced.LeaseLostError,
        fenced.BackendUnavailable,
        fenced.ConfigurationError,
        fenced.ResourceNotFoundError,
        fenced.UnsafeBackendError,
        fenced.NotHeldError,
    ):
        assert issubclass(cls, fenced.FencedError)
    assert issubclass(fenced.LockTimeout, TimeoutError)
    assert issubclass(fenced.BackendUnavailable, ConnectionError)


def test_signed_text_forms_v1_and_v2_and_what_they_refuse() -> None:
    """v1 ``lock:value.kid.sig`` and v2 (bound) ``lock:value.source.kid.sig``, strictly."""
    sig = "A" * 43
    v1 = FencingToken.parse(f"a.b:7.k1.{sig}")
    assert v1.lock == "a.b" and v1.signature is not None and len(v1.signature) == 2
    v2 = FencingToken.parse(f"a.b:7.prod.k1.{sig}")
    assert v2.signature is not None and v2.signature[0] == "k1" and v2.signature[2:] == ("prod",)
    assert str(v2) == f"a.b:7.prod.k1.{sig}" and "prod" in repr(v2)
    assert pickle.loads(pickle.dumps(v2)).signature == v2.signature
    for bad in (
        f"x:7..k1.{sig}",  # an empty source id
        f"x:7.a.b.k1.{sig}",  # two source ids
        f"x:7.{'s' * 65}.k1.{sig}",  # a source id too long
        f"x:7.pr od.k1.{sig}",
        f"x:7.prod.k1.{sig}.",
        "x:7.prod.k1",  # no signature
    ):
        with pytest.raises(InvalidTokenError):
            FencingToken.parse(bad)
    raw = b"\0" * 32
    for signature in (("k1", raw, ""), ("k1", raw, "p.q"), ("k1", raw, 5), ("k1", raw, "p", "x"),
                      ("k1",), ["k1", raw]):  # fmt: skip
        with pytest.raises(InvalidTokenError):
            FencingToken("x", 7, signature)  # type: ignore[arg-type]


def test_a_pickled_token_names_the_public_module() -> None:
    """A token pickled (a task queue, multiprocessing) names ``fenced.FencingToken``, which
    stays where it is when private modules move (they moved once: 0.2.0's named
    ``fenced._token``); it comes back equal, its lock and value intact."""
    token = FencingToken("jobs", 42)
    data = pickle.dumps(token)
    assert b"fenced\x94\x8c\x0cFencingToken" in data or b"cfenced\nFencingToken" in data
    assert b"_core" not in data
    assert pickle.loads(data) == token
