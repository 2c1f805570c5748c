"""Signed fencing tokens: unforgeable when the user asks for it.

A token that any client can write (``orders:4611686018427387904``) lets one buggy or hostile
client raise a resource's high-water mark so high that every later holder is fenced out
for good. With signing on, the token source's client (the core, for every backend) signs
each grant, and guards given the verify keys refuse any token that is unsigned, badly
signed, cut short or moved to another lock, **before** they touch the mark or the data.

The signature covers ``fenced-token-v1``, the lock name, the value and the key id, so it
cannot be moved to another lock or value, nor passed off under another key. Its text form
extends the plain one: ``<lock>:<value>.<key id>.<signature, base64url>``.

Two kinds of key:

* **HMAC-SHA256** (:class:`HmacKey`, a shared secret of at least 32 bytes): whoever can verify
  can also sign, so give it to resources you trust as much as the token source.
* **Ed25519** (:class:`Ed25519SigningKey` for the token source, :class:`Ed25519VerifyKey`
  for resources; needs ``cryptography``, the ``signing`` extra): resources can verify and
  never mint.

What it protects against: a client that writes through a fenced guard with a token it did not
get from the source (a bug, a replay with an edited number, a hostile client of the guard
library). What it does not: a client that writes to the resource *without* the guard library
(it never presents a token at all); and a thief of a signing key.

Keys are files (``fenced keygen``): one line ``fenced-key 1 <kind> <key id> <base64url>``;
``signing_key=`` and ``$FENCED_SIGNING_KEY`` take that line itself too (for secrets injected as
environment variables), or a key file's path.
A key's ``repr`` and every error name the key id only, never the secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final, Protocol

from ._errors import ConfigurationError, InvalidTokenError

__all__ = [
    "AboveCeilingError",
    "Ceiling",
    "Ed25519SigningKey",
    "Ed25519VerifyKey",
    "HmacKey",
    "Keyring",
    "SignatureError",
    "SigningKey",
    "TokenVerifier",
    "VerifyKey",
    "generate_key",
    "load_key",
    "load_keys",
    "parse_key",
    "signer",
    "token_message",
    "verify_all",
]

KID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,32}")
_DOMAIN: Final = b"fenced-token-v1\0"
_FILE_MAGIC: Final = "fenced-key 1"


class SignatureError(InvalidTokenError):
    """A token's signature is missing (signing required), wrong, for another lock or value,
    or made with a key the verifier does not hold (an unknown or retired key id)."""


def token_message(lock: str, value: int, kid: str) -> bytes:
    """The bytes a signature covers: domain, lock, value and key id, NUL-separated."""
    return _DOMAIN + lock.encode() + b"\0" + str(value).encode() + b"\0" + kid.encode()


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def unb64(text: str) -> bytes:
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise InvalidTokenError("malformed signature") from None
    if b64(raw) != text:  # one text per signature: no padding, no stray bits
        raise InvalidTokenError("malformed signature")
    return raw


class SigningKey(Protocol):
    kid: str
    kind: str

    def sign(self, message: bytes) -> bytes: ...


class VerifyKey(Protocol):
    kid: str
    kind: str

    def verify(self, message: bytes, signature: bytes) -> bool: ...


def _check_kid(kid: object) -> str:
    if not isinstance(kid, str) or not KID_RE.fullmatch(kid):
        raise ConfigurationError(f"key id must be 1-32 characters of A-Z a-z 0-9 _ -, not {kid!r}")
    return kid


class HmacKey:
    """A shared secret (at least 32 bytes): signs and verifies with HMAC-SHA256."""

    kind = "hmac"
    signature_size = 32

    def __init__(self, kid: str, secret: bytes) -> None:
        self.kid = _check_kid(kid)
        if not isinstance(secret, bytes) or len(secret) < 32:
            raise ConfigurationError(f"HMAC key {kid!r}: the secret must be at least 32 bytes")
        self._secret = secret
        self._mac = hmac.new(secret, digestmod=hashlib.sha256)  # keyed once; copied per use

    def sign(self, message: bytes) -> bytes:
        mac = self._mac.copy()
        mac.update(message)
        return mac.digest()

    def verify(self, message: bytes, signature: bytes) -> bool:
        return hmac.compare_digest(self.sign(message), signature)

    def public(self) -> HmacKey:
        return self  # (whoever verifies an HMAC can also sign)

    def _material(self) -> bytes:
        return self._secret

    def __repr__(self) -> str:
        return f"HmacKey(kid={self.kid!r})"


class Ed25519VerifyKey:
    """An Ed25519 public key: verifies, cannot sign (for resources)."""

    kind = "ed25519-public"
    signature_size = 64

    def __init__(self, kid: str, public: bytes) -> None:
        self.kid = _check_kid(kid)
        ed = _ed25519()
        try:
            self._key = ed.Ed25519PublicKey.from_public_bytes(public)
        except ValueError:
            raise ConfigurationError(f"Ed25519 key {kid!r}: not a 32-byte public key") from None
        self._raw = public

    def verify(self, message: bytes, signature: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self._key.verify(signature, message)
        except InvalidSignature:
            return False
        return True

    def _material(self) -> bytes:
        return self._raw

    def __repr__(self) -> str:
        return f"Ed25519VerifyKey(kid={self.kid!r})"


class Ed25519SigningKey:
    """An Ed25519 private key: signs (for the token source); ``public()`` for resources."""

    kind = "ed25519"
    signature_size = 64

    def __init__(self, kid: str, private: bytes) -> None:
        self.kid = _check_kid(kid)
        ed = _ed25519()
        try:
            self._key = ed.Ed25519PrivateKey.from_private_bytes(private)
        except ValueError:
            raise ConfigurationError(f"Ed25519 key {kid!r}: not a 32-byte private key") from None
        self._raw = private
        from cryptography.hazmat.primitives import serialization

        public = self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self._public = Ed25519VerifyKey(self.kid, public)

    def sign(self, message: bytes) -> bytes:
        return bytes(self._key.sign(message))

    def public(self) -> Ed25519VerifyKey:
        return self._public

    def verify(self, message: bytes, signature: bytes) -> bool:
        return self._public.verify(message, signature)

    def _material(self) -> bytes:
        return self._raw

    def __repr__(self) -> str:
        return f"Ed25519SigningKey(kid={self.kid!r})"


def _ed25519() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise ConfigurationError(
            "Ed25519 keys need the 'cryptography' package: pip install 'fenced[signing]'"
        ) from None
    return ed25519


class TokenVerifier(Protocol):
    """What a guard's ``verify=`` takes: a check of a token before its mark is touched, raising
    a :class:`~fenced.InvalidTokenError` to refuse it (:class:`Keyring`, :class:`Ceiling`,
    :func:`verify_all`)."""

    def verify(self, lock: str, value: int, signature: tuple[str, bytes] | None) -> None: ...


class AboveCeilingError(InvalidTokenError):
    """A token further above the source's highest grant of its lock than a
    :class:`Ceiling` allows (or a token the source cannot vouch for at all)."""


class Ceiling:
    """Refuse a token more than ``slack`` above the highest grant the token source has made
    for its lock: for resources that cannot hold a signing key. An unsigned token then cannot
    raise a mark far beyond what the source issued (the permanent outage a huge forged token
    causes), at the price of asking the source when a token is above the highest it has seen
    (``source.check``: a round trip, on the guard's thread; async guards are briefly blocked).
    When the source cannot say (etcd and ZooKeeper forget a free lock's highest grant), the
    token is refused: when in doubt, fail closed.

    ``slack`` > 0 accepts tokens a little ahead of the last answer without asking again.
    Weaker than signing: a token up to ``slack`` above a real grant still passes, and a writer
    that can reach the source can still get real tokens.
    """

    def __init__(self, source: Any, *, slack: int = 0) -> None:
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise ConfigurationError(f"slack must be an int >= 0, not {slack!r}")
        self._source = source
        self.slack = slack
        self._highest: dict[str, int] = {}

    def verify(self, lock: str, value: int, signature: tuple[str, bytes] | None) -> None:
        if value <= self._highest.get(lock, 0) + self.slack:
            return
        from ._token import FencingToken  # (the token module imports this one)

        result = self._source.check(FencingToken(lock, value))
        if result.highest is not None:
            self._highest[lock] = max(self._highest.get(lock, 0), result.highest.value)
        if result.highest is None or value > result.highest.value + self.slack:
            known = "unknown" if result.highest is None else str(result.highest)
            raise AboveCeilingError(
                f"fencing token {lock}:{value} is above the highest the source granted "
                f"({known}) by more than {self.slack}"
            )

    def __repr__(self) -> str:
        return f"Ceiling(slack={self.slack})"


def verify_all(*verifiers: TokenVerifier) -> TokenVerifier:
    """One ``verify=`` that runs several (e.g. a keyring and a ceiling), in order."""

    class _All:
        def verify(self, lock: str, value: int, signature: tuple[str, bytes] | None) -> None:
            for v in verifiers:
                v.verify(lock, value, signature)

        def __repr__(self) -> str:
            return f"verify_all{verifiers!r}"

    return _All()


class Keyring:
    """The verify keys a guard accepts, by key id (several: rotation). ``required`` (the
    default) refuses unsigned tokens too."""

    def __init__(self, keys: Iterable[VerifyKey], *, required: bool = True) -> None:
        self._keys: dict[str, VerifyKey] = {}
        for key in keys:
            if key.kid in self._keys:
                raise ConfigurationError(f"two keys with the key id {key.kid!r}")
            self._keys[key.kid] = key
        if not self._keys:
            raise ConfigurationError("a keyring needs at least one key")
        self.required = required
        # Signatures already found good: a holder writes many times with one token, and the
        # answer for the same (lock, value, key id, signature) and the same keys never changes.
        self._good: dict[tuple[str, int, str, bytes], None] = {}

    @property
    def kids(self) -> frozenset[str]:
        return frozenset(self._keys)

    def verify(self, lock: str, value: int, signature: tuple[str, bytes] | None) -> None:
        """Raise :class:`SignatureError` unless ``signature`` is a good one for (lock, value)."""
        if signature is None:
            if self.required:
                raise SignatureError(f"unsigned fencing token {lock}:{value}: signing is required")
            return
        kid, sig = signature
        seen = (lock, value, kid, sig)
        if seen in self._good:
            return
        key = self._keys.get(kid)
        if key is None:
            raise SignatureError(f"fencing token {lock}:{value} is signed with unknown key {kid!r}")
        if not key.verify(token_message(lock, value, kid), sig):
            raise SignatureError(f"fencing token {lock}:{value}: bad signature (key {kid!r})")
        if len(self._good) >= 4096:
            self._good.clear()
        self._good[seen] = None

    def __repr__(self) -> str:
        return f"Keyring(kids={sorted(self._keys)!r}, required={self.required})"


# -- key files ------------------------------------------------------------------------------

_KINDS: Mapping[str, type[HmacKey] | type[Ed25519SigningKey] | type[Ed25519VerifyKey]] = {
    "hmac": HmacKey,
    "ed25519": Ed25519SigningKey,
    "ed25519-public": Ed25519VerifyKey,
}


def key_text(key: HmacKey | Ed25519SigningKey | Ed25519VerifyKey) -> str:
    """The key file's one line."""
    return f"{_FILE_MAGIC} {key.kind} {key.kid} {b64(key._material())}\n"


def load_key(path: str | os.PathLike[str]) -> HmacKey | Ed25519SigningKey | Ed25519VerifyKey:
    """Read a key file written by :func:`key_text` (``fenced keygen``)."""
    where = os.fspath(path)
    try:
        text = Path(where).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read key file {where}: {exc}") from None
    return parse_key(text, where)


def parse_key(text: str, where: str = "the key") -> HmacKey | Ed25519SigningKey | Ed25519VerifyKey:
    """A key from its one-line text (a key file's content, or an environment variable's)."""
    parts = text.strip().split(" ")
    if len(parts) != 5 or " ".join(parts[:2]) != _FILE_MAGIC or parts[2] not in _KINDS:
        raise ConfigurationError(f"{where} is not a fenced key file")
    try:
        material = unb64(parts[4])
    except InvalidTokenError:
        raise ConfigurationError(f"{where}: the key material is not base64url") from None
    return _KINDS[parts[2]](parts[3], material)


def load_keys(paths: Iterable[str | os.PathLike[str]], *, required: bool = True) -> Keyring:
    """A :class:`Keyring` of the public halves of the key files (a resource never needs the
    private half of an Ed25519 key)."""
    keys: list[VerifyKey] = []
    for path in paths:
        key = load_key(path)
        keys.append(key.public() if isinstance(key, Ed25519SigningKey) else key)
    return Keyring(keys, required=required)


def signer(key: object) -> HmacKey | Ed25519SigningKey | None:
    """``connect(signing_key=...)``: a signing key, or a path to its key file, or None."""
    if key is None:
        return None
    if isinstance(key, str) and key.startswith(_FILE_MAGIC + " "):
        key = parse_key(key, "the signing key")  # the key itself (an environment variable's)
    elif isinstance(key, str | os.PathLike):
        key = load_key(key)
    if not isinstance(key, HmacKey | Ed25519SigningKey):
        raise ConfigurationError(
            f"signing_key must be an HMAC or Ed25519 private key (or its key file), not "
            f"{type(key).__name__}: a public key can verify, not sign"
        )
    return key


def generate_key(kind: str, kid: str) -> HmacKey | Ed25519SigningKey:
    if kind == "hmac":
        return HmacKey(kid, os.urandom(32))
    if kind == "ed25519":
        return Ed25519SigningKey(kid, os.urandom(32))
    raise ConfigurationError(f"unknown key kind {kind!r}: hmac or ed25519")
