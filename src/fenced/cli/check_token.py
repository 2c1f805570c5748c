"""``fenced check-token TOKEN``: is a token current, stale, or neither."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from .._core import sync as _sync
from .._core.errors import ConfigurationError
from .._core.token import FencingToken
from ._common import (
    EXIT_INVALID_TOKEN,
    EXIT_NOT_CURRENT,
    EXIT_STALE,
    Subparsers,
    _examples,
    _from_source,
    _HelpFormatter,
    _named,
    _source_arguments,
    _source_id,
    _source_id_argument,
    _url,
    _verbose,
    key_file,
)

NAME = "check-token"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    check = sub.add_parser(
        "check-token",
        parents=[_verbose()],
        help="ask the token source whether a token is current (exit 0), stale (77) or neither (78)",
        description=(
            "Ask the token source about TOKEN (as $FENCING_TOKEN carries it): exit 0 if it is "
            "the live grant of its lock, 77 if a later grant exists (stale), 78 if it is "
            "neither (released or expired, and no later grant known), 65 if it is malformed, "
            "above every grant the source knows (never issued), or, with a key, not well "
            "signed by the source (unsigned, forged, or of another source); 2 is a usage error. "
            "A check is a snapshot: a resource that acts on it acts a moment later."
        ),
        epilog=_examples(
            "fenced lock nightly -- sh -c 'fenced check-token \"$FENCING_TOKEN\"'",
            "fenced check-token --json nightly:1    # exit 78: released, no later grant",
            "fenced check-token nightly:99    # exit 65: never granted",
        ),
        formatter_class=_HelpFormatter,
    )
    check.add_argument("token", metavar="TOKEN")
    check.add_argument("--json", action="store_true", help="print the result as JSON")
    check.add_argument(
        "--verify-key",
        metavar="FILE",
        action="append",
        help="verify the token's signature with this key file first: an Ed25519 .pub or an "
        "HMAC key (repeat for rotation); an unsigned, forged or foreign token then exits 65 "
        "(default: $FENCED_VERIFY_KEY, else the key of $FENCED_SIGNING_KEY)",
    )
    _source_id_argument(check)
    check.add_argument(
        "--accept-unbound",
        action="store_true",
        help="with --source-id, also accept tokens signed before the source had an id (v1)",
    )
    _source_arguments(check)
    return check


def run(args: argparse.Namespace) -> int:
    from .._core.signing import Keyring, public_half, read_key, verify_key

    token = FencingToken.parse(args.token)
    url = _url(args)
    options: dict[str, Any] = {"connect_timeout": max(args.timeout, 0.1)}
    # Verifying needs only a public key (or the HMAC secret), never the power to sign:
    # the token is checked locally first, and refused (exit 65) if unsigned, forged or of
    # another source, as guards and fenced serve's /v1/check refuse it.
    keys: list[Any] = []
    if args.verify_key:
        for path in args.verify_key:
            key_file(path, "--verify-key", "$FENCED_VERIFY_KEY")
        keys = [verify_key(path, "--verify-key", path_shown=True) for path in args.verify_key]
    elif os.environ.get("FENCED_VERIFY_KEY"):
        with _named("$FENCED_VERIFY_KEY"):
            keys = [verify_key(os.environ["FENCED_VERIFY_KEY"], "$FENCED_VERIFY_KEY")]
    elif os.environ.get("FENCED_SIGNING_KEY"):
        # (the source's own key, private or public: its public half verifies)
        with _named("$FENCED_SIGNING_KEY"):
            key = read_key(os.environ["FENCED_SIGNING_KEY"], "$FENCED_SIGNING_KEY")
            keys = [public_half(key)]
    source_id = _source_id(args)
    if keys and args.accept_unbound and not source_id:
        raise ConfigurationError(
            "--accept-unbound needs --source-id (or $FENCED_SOURCE_ID): a keyring without a "
            "source accepts unbound tokens only"
        )
    if keys:
        options["verify"] = Keyring(
            keys, source_id=source_id, accept_unbound=args.accept_unbound and bool(source_id)
        )
    elif args.source_id or args.accept_unbound:  # ($FENCED_SOURCE_ID alone: nothing to check)
        raise ConfigurationError("--source-id and --accept-unbound need a key (--verify-key)")
    with _from_source(args), _sync.connect(url, **options) as locks:
        result = locks.check(token)
    verdict = result.verdict.replace("_", "-")
    if args.json:
        doc = {
            "token": str(token.unsigned()),
            "verdict": verdict,
            "current": result.current,
            "stale": result.stale,
            "highest": None if result.highest is None else str(result.highest),
        }
        print(json.dumps(doc))
    else:
        print(f"{token.unsigned()}: {verdict} (highest granted: {result.highest or 'unknown'})")
    if result.never_granted:
        return EXIT_INVALID_TOKEN  # (not a token the source issued; 2 is for usage errors)
    return 0 if result.current else (EXIT_STALE if result.stale else EXIT_NOT_CURRENT)
