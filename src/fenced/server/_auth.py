"""API keys for ``fenced serve``: bearer secrets from a TOML file, each allowed some verbs on
some lock-name prefixes.

.. code-block:: toml

    [[keys]]
    id = "billing"                         # shown in logs and metrics, never the secret
    sha256 = "9f86d081884c7d65..."         # of the secret (or: secret = "...", discouraged)
    prefixes = ["invoices/", "billing"]    # required: lock names starting with one of these; "" = all
    verbs = ["acquire", "check"]           # acquire, check, admin, metrics

``prefixes`` is required with ``acquire`` or ``check`` (no default: ``[""]`` says every lock).

``acquire`` covers acquire, renew, release and reading those locks; ``check`` covers
``/v1/check`` and reading (status, listing, watch); ``admin`` is everything (force release,
the dashboard's data, metrics); ``metrics`` is ``/metrics`` alone (for a scraper).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import secrets
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .._core.backend import is_header_secret
from .._core.errors import ConfigurationError

__all__ = [
    "TAG_LENGTH",
    "ApiKey",
    "Keys",
    "Verb",
    "hash_secret",
    "key_tag",
    "load_api_keys",
    "new_secret",
]


class Verb(enum.StrEnum):
    ACQUIRE = "acquire"
    CHECK = "check"
    ADMIN = "admin"
    METRICS = "metrics"


@dataclasses.dataclass(frozen=True)
class ApiKey:
    id: str
    digest: bytes  # sha256 of the secret: the file need not hold secrets
    prefixes: tuple[str, ...]
    verbs: frozenset[Verb]

    @property
    def tag(self) -> str:
        """This key's mark on the request ids of its grants (``<tag>.<request id>`` at the
        source): a grant belongs to the key that made it, on every gateway that shares the
        keys file (derived from the id alone, never from the secret)."""
        return key_tag(self.id)

    def allows(self, verb: Verb, name: str | None = None) -> bool:
        """True if this key may ``verb`` on lock ``name`` (None: not about one lock)."""
        if Verb.ADMIN in self.verbs:
            return True
        if verb is Verb.METRICS:
            return Verb.METRICS in self.verbs
        if verb not in self.verbs:
            return False
        return name is None or any(name.startswith(p) for p in self.prefixes)

    def sees(self, name: str) -> bool:
        """True if this key may read lock ``name`` (any lock verb on a matching prefix)."""
        return Verb.ADMIN in self.verbs or (
            bool(self.verbs & {Verb.ACQUIRE, Verb.CHECK})
            and any(name.startswith(p) for p in self.prefixes)
        )


def key_tag(key_id: str) -> str:
    """``k`` and 11 hex digits of the SHA-256 of a key id: fits the request-id grammar, one
    fixed length (so ``<tag>.<id>`` splits without doubt)."""
    return "k" + hashlib.sha256(key_id.encode()).hexdigest()[:11]


TAG_LENGTH = 12


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    """A new API secret: 32 random bytes, URL-safe text (``fk_`` marks it as fenced's)."""
    return "fk_" + secrets.token_urlsafe(32)


class Keys:
    """The keys of one server: finds the key a bearer secret belongs to, in constant time per
    key (so a guess learns nothing from timing)."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self.keys = tuple(keys)
        ids = [k.id for k in self.keys]
        if len(set(ids)) != len(ids):
            raise ConfigurationError("API keys file: two keys have the same id")
        if len({k.tag for k in self.keys}) != len(self.keys):  # (44 bits: never, in practice)
            raise ConfigurationError("API keys file: two key ids share a tag; rename one")
        by_secret: dict[bytes, str] = {}
        for k in self.keys:
            # One secret, two keys: ``find`` would take it for one of them, and the other's
            # rights would silently go with it, or be lost. Named by ids, never the secret.
            first = by_secret.setdefault(k.digest, k.id)
            if first != k.id:
                raise ConfigurationError(
                    f"API keys file: keys {first!r} and {k.id!r} have the same secret; "
                    "give each its own"
                )

    def find(self, secret: str) -> ApiKey | None:
        digest = hashlib.sha256(secret.encode(errors="surrogateescape")).digest()
        found = None
        for key in self.keys:  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(key.digest, digest):
                found = key
        return found


def load_api_keys(path: str | Path) -> Keys:
    """Read an API keys file; a malformed one is a one-line :class:`~fenced.ConfigurationError`
    that never quotes a secret."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigurationError(f"cannot read API keys file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"API keys file {path} is not valid TOML: {exc}") from None
    entries = data.get("keys")
    if not isinstance(entries, list) or not entries:
        raise ConfigurationError(f"API keys file {path}: expected one or more [[keys]] tables")
    return Keys(_parse_key(path, i, e) for i, e in enumerate(entries, 1))


def _parse_key(path: str | Path, n: int, entry: Mapping[str, Any]) -> ApiKey:
    where = f"API keys file {path}, key {n}"
    if not isinstance(entry, dict):
        raise ConfigurationError(f"{where}: expected a table")
    unknown = set(entry) - {"id", "sha256", "secret", "prefixes", "verbs"}
    if unknown:
        raise ConfigurationError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    key_id = entry.get("id")
    if not isinstance(key_id, str) or not key_id or len(key_id) > 64 or not key_id.isprintable():
        raise ConfigurationError(f"{where}: 'id' must be 1-64 printable characters")
    if ("sha256" in entry) == ("secret" in entry):
        raise ConfigurationError(f"{where} ({key_id}): give exactly one of 'sha256' or 'secret'")
    if "secret" in entry:
        secret = entry["secret"]
        if not isinstance(secret, str) or len(secret) < 16:
            raise ConfigurationError(f"{where} ({key_id}): 'secret' must be 16+ characters")
        if not is_header_secret(secret):
            # (a client sends it in a header: other characters never arrive as written)
            raise ConfigurationError(
                f"{where} ({key_id}): 'secret' must be visible ASCII (no other characters, "
                "no blanks around it), at most 4096 characters, as an Authorization header "
                "carries it"
            )
        digest = hashlib.sha256(secret.encode()).digest()
    else:
        text = entry["sha256"]
        try:
            digest = bytes.fromhex(text) if isinstance(text, str) else b""
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise ConfigurationError(f"{where} ({key_id}): 'sha256' must be 64 hex digits")
    verbs_given = entry.get("verbs")
    if not isinstance(verbs_given, list) or not verbs_given:
        raise ConfigurationError(f"{where} ({key_id}): 'verbs' must be a non-empty list")
    try:
        verbs = frozenset(Verb(v) for v in verbs_given)
    except ValueError:
        known = ", ".join(v.value for v in Verb)
        raise ConfigurationError(f"{where} ({key_id}): unknown verb; known: {known}") from None
    # A lock verb without prefixes is refused, not taken for every lock (fails closed): the
    # file must say so. admin (every lock) and metrics (none) need none.
    if "prefixes" not in entry and verbs & {Verb.ACQUIRE, Verb.CHECK} and Verb.ADMIN not in verbs:
        raise ConfigurationError(
            f"{where} ({key_id}): no 'prefixes': write prefixes = [\"\"] for every lock, or "
            "the lock-name prefixes it may use"
        )
    prefixes = entry.get("prefixes", [])
    if not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes):
        raise ConfigurationError(f"{where} ({key_id}): 'prefixes' must be a list of strings")
    return ApiKey(key_id, digest, tuple(prefixes), verbs)
