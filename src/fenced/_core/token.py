"""The fencing token: a lock name and a positive 64-bit integer, ordered within one lock."""

from __future__ import annotations

import re
from typing import Any, Final

from .errors import InvalidTokenError, WrongLockError
from .signing import KID_RE, SOURCE_ID_RE, Signature, TokenVerifier, b64, unb64

__all__ = [
    "MAX_NAME",
    "MAX_TOKEN",
    "FencingToken",
    "TokenLike",
    "escape_name",
    "shown",
    "unescape_name",
    "validate_lock_name",
]

MAX_TOKEN: Final = 2**63 - 1
"""The largest token value: every engine we use stores it as a signed 64-bit integer."""

# Segments of A-Z a-z 0-9 _ . : @ + = -, each starting with a letter, digit or _, joined by "/"
# (path-like names, as etcd, ZooKeeper and Consul users write them: "jobs/nightly").
_SEGMENT: Final = r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*"
_NAME: Final = rf"{_SEGMENT}(?:/{_SEGMENT})*"
_NAME_RE: Final = re.compile(_NAME)
# The token's text form: the name, ":", the value in decimal. The value has no ":", so the last
# ":" always separates them ("a:b:7" is lock "a:b", value 7): never ambiguous.
# A signed token appends ".<key id>.<signature>" (v1, unbound) or ".<source id>.<key id>.
# <signature>" (v2, bound to its source; base64url: 43 characters for HMAC-SHA256, 86 for
# Ed25519); none has a ":" or a ".", so the last ":" still ends the name and the dots count
# the parts.
_TEXT_RE: Final = re.compile(
    rf"(?P<lock>{_NAME}):(?P<value>[1-9][0-9]{{0,18}})"
    r"(?:\.(?:(?P<source>[A-Za-z0-9_-]{1,64})\.)?(?P<kid>[A-Za-z0-9_-]{1,32})"
    r"\.(?P<sig>[A-Za-z0-9_-]{43}|[A-Za-z0-9_-]{86}))?"
)
MAX_NAME: Final = 200


def validate_lock_name(name: object) -> str:
    """Return ``name`` if it is a valid lock name, else raise :class:`InvalidTokenError`.

    A name is 1-200 characters: segments of ``A-Z a-z 0-9 _ . : @ + = -`` joined by ``/``, each
    segment starting with a letter, a digit or ``_`` (``jobs/nightly``; not ``/x``, ``x/``,
    ``x//y`` or ``x/.y``). Sources that keep names in paths (etcd keys, ZooKeeper nodes) store
    ``/`` escaped (:func:`escape_name`), so ``jobs`` and ``jobs/nightly`` are two locks that
    never share a key prefix.
    """
    if name.__class__ is str and name in _VALID_NAMES:  # (a str subclass may hash oddly)
        return name
    if not isinstance(name, str) or len(name) > MAX_NAME or not _NAME_RE.fullmatch(name):
        raise InvalidTokenError(
            f"invalid lock name {shown(name)}: use 1-200 characters of A-Z a-z 0-9 _ . : @ + = -, "
            "in segments joined by '/', each starting with a letter, digit or _"
        )
    if name.__class__ is str:
        if len(_VALID_NAMES) >= 4096:
            _VALID_NAMES.clear()
        _VALID_NAMES.add(name)
    return name


def shown(text: object, limit: int = MAX_NAME) -> str:
    """``text`` as an error shows it: its repr, cut to its first ``limit`` characters (with
    its length) when longer, so a 100 KB name never fills a terminal or a log."""
    if isinstance(text, (str, bytes)) and len(text) > limit:
        return f"{text[:limit]!r}... ({len(text)} characters)"
    return repr(text)


# Names seen valid lately: every grant makes a token, and the pattern costs more than a lookup.
_VALID_NAMES: set[str] = set()


def escape_name(name: str) -> str:
    """``name`` as one path segment: ``/`` becomes ``%2F`` (names have no ``%``, so
    :func:`unescape_name` reads it back exactly)."""
    return name.replace("/", "%2F")


def unescape_name(segment: str) -> str:
    return segment.replace("%2F", "/")


class FencingToken:
    """A grant of one lock: strictly greater than every earlier grant of the same lock.

    Tokens of one lock compare by value; comparing tokens of two different locks raises
    :class:`WrongLockError`, because their order means nothing. The canonical text form,
    ``str(token)``, is ``"<lock>:<value>"`` (e.g. ``"invoices:34"``) and is what headers,
    environment variables and logs carry; :meth:`parse` reads it back strictly.

    >>> a = FencingToken("invoices", 33); b = FencingToken.parse("invoices:34")
    >>> a < b, str(b), int(b)
    (True, 'invoices:34', 34)
    """

    __slots__ = ("_lock", "_sig", "_value")

    def __init__(self, lock: str, value: int, signature: Signature | None = None) -> None:
        validate_lock_name(lock)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidTokenError(f"token value must be an int, not {type(value).__name__}")
        if not 1 <= value <= MAX_TOKEN:
            raise InvalidTokenError(f"token value {value} out of range 1..{MAX_TOKEN}")
        if signature is not None:
            if not isinstance(signature, tuple) or len(signature) not in (2, 3):
                raise InvalidTokenError(
                    "a token signature is (key id, signature) or (key id, signature, source id)"
                )
            kid, sig = signature[0], signature[1]
            if len(signature) == 3:
                source = signature[2]
                if not isinstance(source, str) or not SOURCE_ID_RE.fullmatch(source):
                    raise InvalidTokenError(f"malformed source id {source!r} in a signed token")
            if not isinstance(kid, str) or not KID_RE.fullmatch(kid):
                raise InvalidTokenError(f"malformed key id {kid!r} in a signed token")
            if not isinstance(sig, bytes) or len(sig) not in (32, 64):
                raise InvalidTokenError("a token signature is 32 (HMAC) or 64 (Ed25519) bytes")
        self._lock = lock
        self._value = value
        self._sig = signature

    @property
    def signature(self) -> Signature | None:
        """``(key id, signature)`` of a signed token (v1), ``(key id, signature, source id)``
        of one bound to its source (v2; see :mod:`fenced._core.signing`), else None. Equality and
        order ignore it: a token is its lock and value."""
        return self._sig

    def unsigned(self) -> FencingToken:
        return self if self._sig is None else FencingToken(self._lock, self._value)

    @property
    def lock(self) -> str:
        """The name of the lock this token was granted for."""
        return self._lock

    @property
    def value(self) -> int:
        """The token's integer value, ``1 <= value <= 2**63 - 1``."""
        return self._value

    @classmethod
    def parse(cls, text: object, lock: str | None = None) -> FencingToken:
        """Parse the canonical text form ``"<lock>:<value>"``, strictly.

        Rejects (with :class:`InvalidTokenError`) anything but that exact form: surrounding
        whitespace, signs, leading zeros, zero, non-decimal digits and values above
        ``2**63 - 1``. If ``lock`` is given, a token of any other lock raises
        :class:`WrongLockError`.
        """
        if isinstance(text, bytes):
            try:
                text = text.decode("ascii")
            except UnicodeDecodeError:
                raise InvalidTokenError(f"malformed fencing token {shown(text)}") from None
        if not isinstance(text, str):
            raise InvalidTokenError(f"fencing token must be text, not {type(text).__name__}")
        m = _TEXT_RE.fullmatch(text)
        if m is None:
            raise InvalidTokenError(
                f"malformed fencing token {shown(text, 80)}: expected '<lock>:<positive integer>'"
            )
        value = int(m["value"])
        if value > MAX_TOKEN:
            raise InvalidTokenError(f"fencing token value {m['value']} exceeds 2**63-1")
        signature: Signature | None = None
        if m["kid"] is not None:
            sig = unb64(m["sig"])
            signature = (m["kid"], sig) if m["source"] is None else (m["kid"], sig, m["source"])
        token = cls(m["lock"], value, signature)
        if lock is not None:
            token.require_lock(lock)
        return token

    @classmethod
    def coerce(
        cls,
        token: TokenLike,
        lock: str | None = None,
        keys: TokenVerifier | None = None,
    ) -> FencingToken:
        """Accept a token or its text form (as guards do), checking the lock if given, and
        with ``keys`` its signature (:class:`~fenced.SignatureError` if it is missing or not
        good): what every guard does before it touches its mark."""
        if isinstance(token, FencingToken):
            if lock is not None and token._lock != lock:  # (every guarded write: no call)
                token.require_lock(lock)
        else:
            token = cls.parse(token, lock)
        if keys is not None:
            keys.verify(token._lock, token._value, token._sig)
        return token

    def require_lock(self, lock: str) -> FencingToken:
        """Return self if this is a token of ``lock``, else raise :class:`WrongLockError`."""
        if self._lock != lock:
            raise WrongLockError(f"token {self} belongs to lock {self._lock!r}, not {lock!r}")
        return self

    def _other_value(self, other: object) -> int:
        if not isinstance(other, FencingToken):
            raise TypeError(f"cannot compare FencingToken with {type(other).__name__}")
        if other._lock != self._lock:
            raise WrongLockError(f"cannot order tokens of different locks: {self} and {other}")
        return other._value

    def __lt__(self, other: object) -> bool:
        return self._value < self._other_value(other)

    def __le__(self, other: object) -> bool:
        return self._value <= self._other_value(other)

    def __gt__(self, other: object) -> bool:
        return self._value > self._other_value(other)

    def __ge__(self, other: object) -> bool:
        return self._value >= self._other_value(other)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FencingToken):
            return NotImplemented
        return self._lock == other._lock and self._value == other._value

    def __hash__(self) -> int:
        return hash((self._lock, self._value))

    def __int__(self) -> int:
        return self._value

    def __index__(self) -> int:
        return self._value

    def __str__(self) -> str:
        if self._sig is None:
            return f"{self._lock}:{self._value}"
        bound = f"{self._sig[2]}." if len(self._sig) == 3 else ""
        return f"{self._lock}:{self._value}.{bound}{self._sig[0]}.{b64(self._sig[1])}"

    def __repr__(self) -> str:
        signed = "" if self._sig is None else f", signed by {self._sig[0]!r}"
        if self._sig is not None and len(self._sig) == 3:
            signed += f" for source {self._sig[2]!r}"
        return f"FencingToken({self._lock!r}, {self._value}{signed})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (FencingToken, (self._lock, self._value, self._sig))


# A pickle names the class by its module: the public one, which does not move when the
# private modules do (0.2.0's pickles named ``fenced._token``).
FencingToken.__module__ = "fenced"

TokenLike = FencingToken | str | bytes
"""What every guard's ``token=`` takes: a :class:`FencingToken` or its text form (``str``, or
``bytes`` as an HTTP header or a message carries it), checked by :meth:`FencingToken.coerce`.
The one definition (issue 27): the guards import it, and ``fenced.TokenLike`` offers it."""
