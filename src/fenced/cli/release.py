"""``fenced release NAME --force``: free a lock whoever holds it."""

from __future__ import annotations

import argparse

from .._core import sync as _sync
from .._core.token import FencingToken, validate_lock_name
from ._common import (
    EXIT_USAGE,
    Subparsers,
    _examples,
    _from_source,
    _HelpFormatter,
    _say,
    _shared_source_url,
    _source_arguments,
    _verbose,
)

NAME = "release"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    release = sub.add_parser(
        "release",
        parents=[_verbose()],
        help="free a lock whoever holds it (--force): for a holder that is stuck or gone",
        description=(
            "Free NAME whoever holds it. The freed grant's token still protects the data: "
            "guarded resources refuse it once the next holder has written, and its holder "
            "learns of the loss (at its next renewal at the latest). Whatever that holder "
            "does without a guard is not protected: use it for a holder that is stuck or gone."
        ),
        epilog=_examples(
            "fenced release nightly --force",
            "# only if grant 7 still holds it (as fenced status shows it)",
            "fenced release nightly --force --token nightly:7",
        ),
        formatter_class=_HelpFormatter,
    )
    release.add_argument("name", metavar="NAME", help="the lock")
    release.add_argument(
        "--force", action="store_true", help="required: say you mean it (there is no other kind)"
    )
    release.add_argument(
        "--token", help="only if this grant still holds it, e.g. nightly:7 (as fenced status shows)"
    )
    _source_arguments(release)
    return release


def run(args: argparse.Namespace) -> int:
    if not args.force:
        _say("release: --force is required (it frees the lock from whoever holds it)")
        return EXIT_USAGE
    name = validate_lock_name(args.name)
    token = None if args.token is None else FencingToken.parse(args.token, lock=name)
    url = _shared_source_url(args, "release")  # (another process's lock is out of its reach)
    with _from_source(args), _sync.connect(url, connect_timeout=max(args.timeout, 0.1)) as locks:
        freed = locks.force_release(name, token)
    if freed is None:
        which = f" by {token}" if token is not None else ""
        print(f"{name}: not held{which}; nothing released")
        return 0
    who = freed.owner or freed.holder
    print(f"{name}: released {freed.token} (held by {who})")
    return 0
