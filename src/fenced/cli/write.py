"""``fenced write DIR/NAME``: stdin as a new version of a file, through the files guard."""

from __future__ import annotations

import argparse
import os
import stat
import sys

from .._core.errors import InvalidTokenError, StaleTokenError
from .._core.token import FencingToken, shown, validate_lock_name
from ._common import (
    EXIT_INVALID_TOKEN,
    EXIT_SOFTWARE,
    EXIT_STALE,
    EXIT_USAGE,
    Subparsers,
    _examples,
    _HelpFormatter,
    _say,
    _verbose,
    verify_key_arguments,
    verify_keyring,
)

NAME = "write"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    write = sub.add_parser(
        "write",
        parents=[_verbose()],
        help="store stdin as a new version of DIR/NAME (files guard), if the token is not stale",
        description=(
            "Store standard input as the newest version of DIR/NAME through the files guard: "
            "refused (exit 77, nothing written) if DIR/NAME has a version with a higher token. "
            "Inside `fenced lock` the token comes from $FENCING_TOKEN. With a key "
            "(--verify-key, $FENCED_VERIFY_KEY) the token's signature is checked first: an "
            "unsigned, forged or foreign token exits 65, nothing written (a malformed one too); "
            "a signed token with no key exits 2; an unsigned one with no key is stored. --lock "
            "pins DIR's lock. Plain tools read the newest version at DIR/NAME/current."
        ),
        epilog=_examples(
            "fenced lock reports -- sh -c 'mkdir -p out && date | fenced write out/daily.csv'",
            "fenced write out/daily.csv --token reports:2 < /dev/null",
            "fenced write out/daily.csv --token reports:1 < /dev/null    # exit 77: reports:2 wrote",
        ),
        formatter_class=_HelpFormatter,
    )
    write.add_argument("path", metavar="DIR/NAME", help="the resource: its directory and name")
    write.add_argument(
        "--token", help="the fencing token, e.g. reports:34 (default: $FENCING_TOKEN)"
    )
    write.add_argument(
        "--lock",
        metavar="NAME",
        help="the lock whose tokens DIR takes: a token of another lock is refused (exit 65, "
        "nothing written or recorded), and an empty DIR is claimed for NAME, never for the "
        "first token's lock (default: the token's lock)",
    )
    verify_key_arguments(write, "is refused (exit 65, nothing written)")
    write.add_argument(
        "--insecure-no-verify",
        action="store_true",
        help="store a signed token's write without checking its signature, where no key is "
        "given (anyone can then forge its number and fence out every later holder); without "
        "a key and without this, a signed token is refused (exit 2)",
    )
    return write


def run(args: argparse.Namespace) -> int:
    from ..guards.files import FileGuard

    text = args.token or os.environ.get("FENCING_TOKEN")
    if not text:
        _say("write: no token: pass --token or run inside `fenced lock` ($FENCING_TOKEN)")
        return EXIT_USAGE
    try:
        token = FencingToken.parse(text)
    except InvalidTokenError as exc:  # (malformed: a cut or altered signature too) as
        _say(f"write refused: {exc}")  # check-token says it: 65, not a usage error
        return EXIT_INVALID_TOKEN
    # The same verification as check-token, before anything is touched: a forged token
    # (a real signature, its number raised) would otherwise move the mark for good.
    if args.insecure_no_verify and args.verify_key:
        _say("write: --insecure-no-verify and --verify-key contradict each other: give one")
        return EXIT_USAGE
    if args.lock is not None:
        validate_lock_name(args.lock)
        if token.lock != args.lock:
            _say(
                f"write refused: the token is of lock {shown(token.lock)}, and "
                f"{shown(args.path)} takes lock {args.lock!r} (--lock)"
            )
            return EXIT_INVALID_TOKEN
    keyring = verify_keyring(args)
    if keyring is None and token.signature is not None and not args.insecure_no_verify:
        # Fail closed: a signed token says signing is on, and its signature is all that
        # tells a granted number from a forged one.
        _say(
            "write: the token is signed but no key verifies it: give --verify-key FILE (the "
            "source's .pub, or its HMAC key) or $FENCED_VERIFY_KEY (or --insecure-no-verify)"
        )
        return EXIT_USAGE
    try:
        token = FencingToken.coerce(token, token.lock, keyring)
    except InvalidTokenError as exc:  # (unsigned, forged, unknown key, another source)
        _say(f"write refused: {exc}")
        return EXIT_INVALID_TOKEN
    directory, name = os.path.split(os.path.abspath(args.path))
    if not os.path.isdir(directory):
        _say(f"write: directory {directory} does not exist")
        return EXIT_USAGE
    mode = os.stat(directory).st_mode
    if mode & stat.S_ISVTX and mode & (stat.S_IWOTH | stat.S_IWGRP):
        # The guard marks its whole directory as the resource of one lock: done implicitly
        # on /tmp, it would refuse every other user's and job's writes there. (A sticky
        # directory only its owner may write, 1755, is nobody else's: accepted. One others
        # may write without the sticky bit is refused by the guard: not a trusted path.)
        _say(
            f"write: {directory} is shared (world-writable or sticky, as /tmp is): the files "
            "guard would claim all of it for one lock; write into a directory of your own"
        )
        return EXIT_USAGE
    data = sys.stdin.buffer.read()
    try:
        FileGuard(directory, lock=args.lock or token.lock, verify=keyring).write(
            name, data, token=token
        )
    except StaleTokenError as exc:
        _say(f"write refused: {exc}")
        return EXIT_STALE
    except InvalidTokenError as exc:  # (the guard's own verification: as above)
        _say(f"write refused: {exc}")
        return EXIT_INVALID_TOKEN
    except OSError as exc:  # the file system's word (no space, I/O error, a lock file in
        _say(f"write failed: {exc}")  # the way): one line, no traceback
        return EXIT_SOFTWARE
    return 0
