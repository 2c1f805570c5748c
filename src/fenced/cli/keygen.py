"""``fenced keygen hmac|ed25519 [KEY_ID] FILE``: a key for signed tokens."""

from __future__ import annotations

import argparse
import os
import time

from .._core.errors import ConfigurationError
from ._common import Subparsers, _examples, _HelpFormatter, _verbose

NAME = "keygen"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    keygen = sub.add_parser(
        "keygen",
        parents=[_verbose()],
        help="make a key for signed tokens: hmac (shared) or ed25519 (FILE and FILE.pub)",
        description=(
            "Write a new signing key to FILE (mode 0600; never overwrites). hmac: a shared "
            "secret that signs and verifies. ed25519: the private key for the token source, "
            "and FILE.pub, the public key for resources, which can verify but never sign."
        ),
        epilog=_examples(
            "fenced keygen hmac jobs.key",
            "fenced keygen ed25519 ops-2026 signing.key    # and signing.key.pub",
        ),
        formatter_class=_HelpFormatter,
    )
    keygen.add_argument("kind", choices=["hmac", "ed25519"])
    keygen.add_argument(
        "kid",
        metavar="KEY_ID",
        nargs="?",
        help="the key's id (1-32 of A-Z a-z 0-9 _ -; default: today's date and 6 random "
        "hex digits, e.g. 20261126-3f9a1c), printed; tokens carry it, so keys can rotate",
    )
    keygen.add_argument("file", metavar="FILE")
    return keygen


def run(args: argparse.Namespace) -> int:
    from .._core.signing import Ed25519SigningKey, generate_key, key_text

    kid = args.kid
    if kid is None:
        # Distinct ids for keys made on one day (rotation needs them apart), sortable by age.
        kid = time.strftime("%Y%m%d", time.gmtime()) + "-" + os.urandom(3).hex()
    key = generate_key(args.kind, kid)
    if isinstance(key, Ed25519SigningKey) and os.path.lexists(args.file + ".pub"):
        # (checked first: a refusal must leave no half-made key behind)
        raise ConfigurationError(f"{args.file}.pub exists: fenced keygen never overwrites a key")
    _write_new(args.file, key_text(key), 0o600)
    if isinstance(key, Ed25519SigningKey):
        _write_new(args.file + ".pub", key_text(key.public()), 0o644)
        print(f"{args.file}: new ed25519 key {kid}; its public half: {args.file}.pub")
    else:
        print(f"{args.file}: new hmac key {kid}")
    return 0


def _write_new(path: str, text: str, mode: int) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise ConfigurationError(f"{path} exists: fenced keygen never overwrites a key") from None
    except OSError as exc:
        raise ConfigurationError(f"cannot create {path}: {exc.strerror}") from None
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
