"""``fenced check-token TOKEN``: is a token current, stale, or neither."""

from __future__ import annotations

import argparse
import json
from typing import Any

from .._core import sync as _sync
from .._core.token import FencingToken
from ._common import (
    EXIT_INVALID_TOKEN,
    EXIT_NOT_CURRENT,
    EXIT_STALE,
    Subparsers,
    _examples,
    _from_source,
    _HelpFormatter,
    _source_arguments,
    _url,
    _verbose,
    verify_key_arguments,
    verify_keyring,
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
    verify_key_arguments(check, "exits 65")
    _source_arguments(check)
    return check


def run(args: argparse.Namespace) -> int:
    token = FencingToken.parse(args.token)
    url = _url(args)
    options: dict[str, Any] = {"connect_timeout": max(args.timeout, 0.1)}
    # Verifying needs only a public key (or the HMAC secret), never the power to sign:
    # the token is checked locally first, and refused (exit 65) if unsigned, forged or of
    # another source, as guards and fenced serve's /v1/check refuse it.
    keyring = verify_keyring(args)
    if keyring is not None:
        # Before the source is asked: a forged token is refused at once (65), even with the
        # source down (it was 69, "try later", after the timeout).
        FencingToken.coerce(token, token.lock, keyring)
        options["verify"] = keyring
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
