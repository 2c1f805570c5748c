"""``fenced poison DIR NAME --epoch E``: the SBD-style fence command of ``fenced elect``."""

from __future__ import annotations

import argparse

from .._core.token import validate_lock_name
from ._common import Subparsers, _examples, _grace, _HelpFormatter

NAME = "poison"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    poison = sub.add_parser(
        "poison",
        help="fence an old leader SBD-style: write a poison pill its fenced elect obeys",
        description=(
            "Write DIR/NAME.pill with EPOCH (atomically, fsynced), then wait --wait seconds "
            "for the old leader's fenced elect (--poison DIR) to see it and kill its command. "
            'Use as --fence-cmd \'fenced poison DIR "$FENCED_LOCK" --epoch "$FENCED_EPOCH"\'.'
        ),
        epilog=_examples("fenced poison . db-primary --epoch 7 --wait 0"),
        formatter_class=_HelpFormatter,
    )
    poison.add_argument("dir", metavar="DIR", help="the shared directory the leaders watch")
    poison.add_argument("name", help="the election's name")
    poison.add_argument("--epoch", type=int, required=True, help="the new leader's epoch")
    poison.add_argument("--wait", type=_grace, default=1.0, help="seconds to wait after (1)")
    return poison


def run(args: argparse.Namespace) -> int:
    from ._elect import poison

    validate_lock_name(args.name)
    poison(args.dir, args.name, args.epoch, args.wait)
    return 0
