"""Signed fencing tokens: unforgeable when the user asks for it.

A token that any client can write (``orders:4611686018427387904``) lets one buggy or hostile
client raise a resource's high-water mark so high that every later holder is fenced out
for good. With signing on, the token source's client (the core, for every backend) signs
each grant, and guards given the verify keys refuse any token that is unsigned, badly
signed, cut short or moved to another lock, **before** they touch the mark or the data.

What a signature covers, and its text form, by version:

* **v2, bound to a source** (a source given ``source_id=``, stable configuration such as
  ``prod``): ``fenced-token-v2``, the source id, the lock name, the value and the key id;
  ``<lock>:<value>.<source id>.<key id>.<signature>``. A keyring naming its source
  (``Keyring(keys, source_id="prod")``) refuses a token of any other source, even one signed
  with the same key, and (unless ``accept_unbound=True``, for a migration) every v1 token.
* **v1, unbound** (a source with no ``source_id``; every signed token before issue 25): ``fenced-token-v1``, the
  lock name, the value and the key id; ``<lock>:<value>.<key id>.<signature>``. It cannot be
  moved to another lock, value or key, but two sources sharing a key can pass each other's
  tokens: an unbound key must sign for one source only.

Two kinds of key:

* **HMAC-SHA256** (:class:`HmacKey`, a shared secret of at least 32 bytes): whoever can verify
  can also sign, so give it to resources you trust as much as the token source.
* **Ed25519** (:class:`Ed25519SigningKey` for the token source, :class:`Ed25519VerifyKey`
  for resources; needs ``cryptography``, the ``signing`` extra): resources can verify and
  never mint.

What it protects against: a client that writes through a fenced guard with a token it did not
get from the source (a bug, a replay with an edited number), and with a bound source, a token
of another source. A *hostile* client only if it cannot sign: with a library source (SQLite,
etcd, ZooKeeper, PostgreSQL, Redis) the signing key sits in every lock client, so only
``fenced serve`` holding the key (clients use ``http://``) keeps it from them. What it does
not: a client that writes to the resource *without* the guard library (it never presents a
token at all); and a thief of a signing key.

Keys are files (``fenced keygen``): one line ``fenced-key 1 <kind> <key id> <base64url>``;
``signing_key=`` and ``$FENCED_SIGNING_KEY`` take that line itself too (for secrets injected as
environment variables; blanks around it dropped, anything else around it malformed), or a
key file's path. A key's ``repr`` and every error name the key id only, never the secret,
and never a text that may be one (errors name where it came from); a malformed key line's
errors name none of its fields, not even the key id (swapped, it may be the secret). A key
file must be a regular file (opened non-blocking: a FIFO is refused, never waited on). A key file other users
may read (a secret) or change is refused, as ssh refuses such a key (:func:`load_key`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import stat
from collections.abc import Iterable, Mapping
from typing import Any, Final, Protocol

from .errors import ConfigurationError, InvalidTokenError
from .paths import require_trusted_path

__all__ = [
    "Ed25519SigningKey",
    "Ed25519VerifyKey",
    "HmacKey",
    "Keyring",
    "Signature",
    "SignatureError",
    "SigningKey",
    "TokenVerifier",
    "VerifyKey",
    "generate_key",
    "is_key_text",
    "is_public_key_text",
    "key_text",
    "load_key",
    "load_keys",
    "parse_key",
    "public_half",
    "read_key",
    "same_key",
    "signer",
    "token_message",
    "verify_all",
    "verify_key",
]

KID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,32}")
SOURCE_ID_RE: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DOMAIN: Final = b"fenced-token-v1\0"
_DOMAIN_V2: Final = b"fenced-token-v2\0"

#: A token's signature: ``(key id, signature)`` (v1, unbound) or ``(key id, signature,
#: source id)`` (v2, bound to its source).
Signature = tuple[str, bytes] | tuple[str, bytes, str]
_FILE_MAGIC: Final = "fenced-key 1"


class SignatureError(InvalidTokenError):
    """A token's signature is missing (signing required), wrong, for another lock or value,
    of another source than the one trusted (or unbound where a source is named), or made with
    a key the verifier does not hold (an unknown or retired key id)."""


def token_message(lock: str, value: int, kid: str, source_id: str | None = None) -> bytes:
    """The bytes a signature covers, NUL-separated: v1 (no source) the domain, lock, value and
    key id; v2 the domain, source id, lock, value and key id."""
    tail = lock.encode() + b"\0" + str(value).encode() + b"\0" + kid.encode()
    if source_id is None:
        return _DOMAIN + tail
    return _DOMAIN_V2 + source_id.encode() + b"\0" + tail


def check_source_id(source_id: object) -> str | None:
    """A source id (1-64 of ``A-Z a-z 0-9 _ -``), or None; else :class:`ConfigurationError`."""
    if source_id is None:
        return None
    if not isinstance(source_id, str) or not SOURCE_ID_RE.fullmatch(source_id):
        raise ConfigurationError(
            f"source_id must be 1-64 characters of A-Z a-z 0-9 _ -, not {source_id!r}"
        )
    return source_id


def split_signature(signature: Signature) -> tuple[str, bytes, str | None]:
    """``(key id, signature, source id or None)`` of either form."""
    if len(signature) == 3:
        return signature[0], signature[1], signature[2]
    return signature[0], signature[1], None


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
        # Never shown: a key id in the wrong place may be the secret itself (a key line's
        # fields swapped, HmacKey(secret, kid)).
        raise ConfigurationError(
            "a key id must be 1-32 characters of A-Z a-z 0-9 _ - (the one given is not; "
            "not shown: it may be the secret, e.g. a key line's fields swapped)"
        )
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

    def verify(self, lock: str, value: int, signature: Signature | None) -> None: ...


def verify_all(*verifiers: TokenVerifier) -> TokenVerifier:
    """One ``verify=`` that runs several (e.g. a keyring and a ceiling), in order."""

    class _All:
        def verify(self, lock: str, value: int, signature: Signature | None) -> None:
            for v in verifiers:
                v.verify(lock, value, signature)

        def __repr__(self) -> str:
            return f"verify_all{verifiers!r}"

    return _All()


class Keyring:
    """The verify keys a guard accepts, by key id (several: rotation). ``required`` (the
    default) refuses unsigned tokens too.

    ``source_id``: the token source this resource trusts (see the module docstring). Given,
    a token must be bound to that source (v2); a token of another source is refused even if
    signed with a key held here, and an unbound (v1) one too unless ``accept_unbound`` (while
    tokens signed before the source was named are still in use). Not given, only unbound
    tokens are accepted: a bound token names a source this keyring cannot judge.
    """

    def __init__(
        self,
        keys: Iterable[VerifyKey],
        *,
        required: bool = True,
        source_id: str | None = None,
        accept_unbound: bool = False,
    ) -> None:
        self._keys: dict[str, VerifyKey] = {}
        for key in keys:
            if key.kid in self._keys:
                raise ConfigurationError(f"two keys with the key id {key.kid!r}")
            self._keys[key.kid] = key
        if not self._keys:
            raise ConfigurationError("a keyring needs at least one key")
        self.required = required
        self.source_id = check_source_id(source_id)
        if accept_unbound and source_id is None:
            raise ConfigurationError("accept_unbound needs a source_id (unbound is the default)")
        self.accept_unbound = accept_unbound
        # Signatures already found good: a holder writes many times with one token, and the
        # answer for the same (lock, value, key id, signature, source) and keys never changes.
        self._good: dict[tuple[str, int, str, bytes, str | None], None] = {}

    @property
    def kids(self) -> frozenset[str]:
        return frozenset(self._keys)

    def verify(self, lock: str, value: int, signature: Signature | None) -> None:
        """Raise :class:`SignatureError` unless ``signature`` is a good one for (lock, value)
        from this keyring's source."""
        if signature is None:
            if self.required:
                raise SignatureError(f"unsigned fencing token {lock}:{value}: signing is required")
            return
        kid, sig, source = split_signature(signature)
        seen = (lock, value, kid, sig, source)
        if seen in self._good:
            return
        if source is None:
            if self.source_id is not None and not self.accept_unbound:
                raise SignatureError(
                    f"fencing token {lock}:{value} is not bound to a source (signed without "
                    f"a source id): this resource trusts only source {self.source_id!r}"
                )
        elif self.source_id is None:
            raise SignatureError(
                f"fencing token {lock}:{value} is bound to source {source!r}: this resource "
                "names no source it trusts (give the keyring source_id=; a command, --source-id)"
            )
        elif source != self.source_id:
            raise SignatureError(
                f"fencing token {lock}:{value} is from source {source!r}, not {self.source_id!r}"
            )
        key = self._keys.get(kid)
        if key is None:
            raise SignatureError(f"fencing token {lock}:{value} is signed with unknown key {kid!r}")
        if not key.verify(token_message(lock, value, kid, source), sig):
            raise SignatureError(f"fencing token {lock}:{value}: bad signature (key {kid!r})")
        if len(self._good) >= 4096:
            self._good.clear()
        self._good[seen] = None

    def __repr__(self) -> str:
        bound = "" if self.source_id is None else f", source_id={self.source_id!r}"
        return f"Keyring(kids={sorted(self._keys)!r}, required={self.required}{bound})"


# -- key files ------------------------------------------------------------------------------

_KINDS: Mapping[str, type[HmacKey] | type[Ed25519SigningKey] | type[Ed25519VerifyKey]] = {
    "hmac": HmacKey,
    "ed25519": Ed25519SigningKey,
    "ed25519-public": Ed25519VerifyKey,
}


def key_text(key: HmacKey | Ed25519SigningKey | Ed25519VerifyKey) -> str:
    """The key file's one line."""
    return f"{_FILE_MAGIC} {key.kind} {key.kid} {b64(key._material())}\n"


def load_key(
    path: str | os.PathLike[str], *, where: str | None = None
) -> HmacKey | Ed25519SigningKey | Ed25519VerifyKey:
    """Read a key file written by :func:`key_text` (``fenced keygen``). ``where``: how errors
    name the file (default: its path; a path taken from a variable that may hold the secret
    itself is named by the variable, never shown).

    Refused, as ssh refuses such a private key: a secret key (HMAC, Ed25519 private) in a file
    that group or others may read or write, a public key in one they may write (whoever swaps
    it decides which tokens are trusted), and a key file owned by another user than the
    reader or root (its owner can read and replace it, whatever its mode now). So is a key
    file whose path is not trusted (:func:`~fenced._core.paths.require_trusted_path`): a
    directory on the way that another user owns or may write lets them swap the name for
    another key (a retired one whose private half they hold)."""
    shown = os.fspath(path) if where is None else None
    label = f"key file {shown}" if where is None else f"the key file named by {where}"
    require_trusted_path(path, label, show=shown is not None)
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, for ever,
    # before any check could refuse it (on a regular file it changes nothing).
    flags = os.O_RDONLY | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:  # (its strerror: not Python's repr of the exception)
        raise ConfigurationError(f"cannot read {label}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)  # (the file read, not a name that may be swapped meanwhile)
        if not stat.S_ISREG(info.st_mode):  # (a FIFO, a device, a directory, a socket)
            raise ConfigurationError(f"{label} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(_MAX_KEY_FILE + 1)
    except OSError as exc:  # (a directory: EISDIR on the read)
        raise ConfigurationError(f"cannot read {label}: {exc.strerror}") from None
    finally:
        os.close(fd)
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ConfigurationError(f"{label} is not a fenced key file") from None
    if len(data) > _MAX_KEY_FILE:
        raise ConfigurationError(f"{label} is not a fenced key file")
    key = parse_key(text, label)
    _check_key_file(info, secret=not isinstance(key, Ed25519VerifyKey), label=label, shown=shown)
    return key


_MAX_KEY_FILE: Final = 65_536  # (a key's line is ~100 bytes: not a device read forever)


def _check_key_file(info: os.stat_result, *, secret: bool, label: str, shown: str | None) -> None:
    """Refuse a key file others may read (a secret) or change (any key), or one owned by
    another user than the reader or root. Not where file modes mean nothing (Windows)."""
    if os.name != "posix":
        return
    me = os.geteuid()
    if info.st_uid not in (me, 0):
        # (ssh ignores a private key's mode when another user owns it; sshd's StrictModes
        # refuses authorized_keys owned by another user: a key file is trusted as those are)
        try:
            import pwd

            name = pwd.getpwuid(me).pw_name
        except (ImportError, KeyError):
            name = str(me)
        can = "read and replace" if secret else "replace"
        fix = f"`chown {name} {shown}`" if shown is not None else f"`chown {name}` on that file"
        raise ConfigurationError(
            f"{label} is owned by another user (uid {info.st_uid}), who can {can} it; run "
            f"{fix} (a key file must be yours or root's)"
        )
    mode = stat.S_IMODE(info.st_mode)
    if secret and mode & 0o077:
        fix = f"`chmod 600 {shown}`" if shown is not None else "`chmod 600` on that file"
        raise ConfigurationError(
            f"{label} holds a secret key and other users may read or change it (mode "
            f"{mode:04o}); run {fix}"
        )
    if not secret and mode & 0o022:
        fix = f"`chmod 644 {shown}`" if shown is not None else "`chmod 644` on that file"
        raise ConfigurationError(
            f"{label} holds a public key that other users may change (mode {mode:04o}), "
            f"choosing which tokens are trusted; run {fix}"
        )


def parse_key(text: str, where: str = "the key") -> HmacKey | Ed25519SigningKey | Ed25519VerifyKey:
    """A key from its one-line text (a key file's content, or an environment variable's).

    Errors name ``where`` and what is wrong, never a field of the line (the key id
    included: until the line is parsed whole, any field may be the secret, e.g. the key id
    and the material swapped)."""
    parts = text.strip().split(" ")
    if len(parts) != 5 or " ".join(parts[:2]) != _FILE_MAGIC:
        raise ConfigurationError(
            f"{where} is not a fenced key file (one line '{_FILE_MAGIC} <kind> <key id> "
            "<base64url>')"
        )
    kind = _KINDS.get(parts[2])
    if kind is None:
        raise ConfigurationError(
            f"{where} is not a fenced key file: unknown key kind (not {', '.join(_KINDS)})"
        )
    if not KID_RE.fullmatch(parts[3]):
        raise ConfigurationError(
            f"{where}: the key id is not 1-32 characters of A-Z a-z 0-9 _ - (not shown: "
            "it may be the secret; are the key id and the key material swapped?)"
        )
    try:
        material = unb64(parts[4])
    except InvalidTokenError:
        raise ConfigurationError(f"{where}: the key material is not base64url") from None
    try:
        return kind(parts[3], material)
    except ConfigurationError:  # (the material's size for its kind: said without the line)
        raise ConfigurationError(
            f"{where}: the key material is not a valid {parts[2]} key (wrong size)"
        ) from None


def is_public_key_text(value: str) -> bool:
    """Whether ``value`` is an Ed25519 public key's line (no secret in it): other key text
    (an HMAC key, a private key, a malformed line) may hold a secret."""
    parts = value.strip().split(" ")
    return len(parts) == 5 and " ".join(parts[:3]) == f"{_FILE_MAGIC} ed25519-public"


# Key text, not a path: the magic anywhere, followed by a blank (a path such as
# /etc/fenced-keys/a.key has none after it).
_KEY_TEXT: Final = re.compile(re.escape(_FILE_MAGIC.split(" ")[0]) + r"\s")


def is_key_text(value: str) -> bool:
    """Whether ``value`` is a key's text (its line's magic in it), not a key file's path."""
    return bool(_KEY_TEXT.search(value))


def read_key(key: object, where: str, *, path_shown: bool = False) -> object:
    """A key object as given, or read from its one line (an environment variable's) or its
    key file's path. ``where`` names where a text came from (``$FENCED_SIGNING_KEY``,
    ``signing_key``): errors name it and never the text, which may be the secret itself.
    Blanks around the text are dropped (an .env file's, a here-document's newline); text with
    the key line's magic in it is key text, and anything else around the line (quotes kept
    by docker --env-file or an .env loader) makes it malformed, not a path. A path is shown in
    errors only when it is one for sure: a ``PathLike``, or ``path_shown`` (a command line's
    FILE)."""
    if isinstance(key, os.PathLike):
        return load_key(key)
    if not isinstance(key, str):
        return key
    text = key.strip()
    if _KEY_TEXT.search(text):
        if not text.startswith(_FILE_MAGIC + " "):
            raise ConfigurationError(
                f"{where}: malformed key text: expected the one line '{_FILE_MAGIC} <kind> "
                "<key id> <base64url>' with nothing around it (quotes?)"
            )
        return parse_key(text, f"{where}: the key text")
    if path_shown:
        return load_key(text)
    return load_key(text, where=where)


def public_half(key: object) -> VerifyKey:
    """What verifies ``key``'s signatures: an Ed25519 key's public half, an HMAC key itself."""
    if isinstance(key, Ed25519SigningKey):
        return key.public()
    if not isinstance(key, HmacKey | Ed25519VerifyKey):
        raise ConfigurationError(f"not a key, but {type(key).__name__}")
    return key


def same_key(a: object, b: object) -> bool:
    """Whether two keys verify alike: the same kind, key id and material (an Ed25519 private
    key is taken for its public half)."""
    pa, pb = public_half(a), public_half(b)
    if type(pa) is not type(pb) or pa.kid != pb.kid:
        return False
    assert isinstance(pa, HmacKey | Ed25519VerifyKey) and isinstance(pb, HmacKey | Ed25519VerifyKey)
    return hmac.compare_digest(pa._material(), pb._material())


def verify_key(
    key: object, where: str | None = None, *, path_shown: bool | None = None
) -> VerifyKey:
    """A key a resource verifies with: a key object, a key file's path or its one line. An
    Ed25519 *private* key is refused (a resource verifies with the public half, ``.pub``,
    and must never be able to sign); an HMAC key is both. ``where``: where a text came from
    (``$FENCED_VERIFY_KEY``), named by errors, which never show the text itself. A path
    given as one (``load_keys``, ``--verify-key FILE``: ``path_shown``, the default without
    ``where``) is shown."""
    if path_shown is None:
        path_shown = where is None
    is_path = isinstance(key, os.PathLike) or (isinstance(key, str) and not _KEY_TEXT.search(key))
    if path_shown and is_path:
        where = os.fspath(key).strip()  # type: ignore[call-overload]
    elif where is None:
        where = "the verify key"
    key = read_key(key, where, path_shown=path_shown)
    if isinstance(key, Ed25519SigningKey):
        raise ConfigurationError(
            f"{where} is an Ed25519 private key (key {key.kid!r}): a resource verifies with "
            "its public half (the .pub file fenced keygen wrote) and must not hold the private one"
        )
    if not isinstance(key, HmacKey | Ed25519VerifyKey):
        raise ConfigurationError(f"{where} is not a key, but {type(key).__name__}")
    return key


def load_keys(
    paths: Iterable[str | os.PathLike[str]],
    *,
    required: bool = True,
    source_id: str | None = None,
    accept_unbound: bool = False,
) -> Keyring:
    """A :class:`Keyring` of key files: HMAC keys, or Ed25519 public keys (``.pub``; an
    Ed25519 private key is refused: a resource never needs it). ``source_id``: the token
    source the resource trusts (see :class:`Keyring`)."""
    keys = [verify_key(path) for path in paths]
    return Keyring(keys, required=required, source_id=source_id, accept_unbound=accept_unbound)


def signer(key: object) -> HmacKey | Ed25519SigningKey | None:
    """``connect(signing_key=...)``: a signing key, or a path to its key file, or None."""
    if key is None:
        return None
    key = read_key(key, "signing_key=")
    if isinstance(key, Ed25519VerifyKey):
        raise ConfigurationError(
            f"signing_key: key {key.kid!r} is an Ed25519 public key (.pub): it can verify, "
            "not sign; the token source needs the private key fenced keygen wrote"
        )
    if not isinstance(key, HmacKey | Ed25519SigningKey):
        raise ConfigurationError(
            f"signing_key must be an HMAC or Ed25519 private key (or its key file), not "
            f"{type(key).__name__}"
        )
    return key


def generate_key(kind: str, kid: str) -> HmacKey | Ed25519SigningKey:
    if kind == "hmac":
        return HmacKey(kid, os.urandom(32))
    if kind == "ed25519":
        return Ed25519SigningKey(kid, os.urandom(32))
    raise ConfigurationError(f"unknown key kind {kind!r}: hmac or ed25519")
