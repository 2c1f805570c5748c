"""``fenced status [NAME ...]``: holder, token and time left of locks."""

from __future__ import annotations

import argparse
import json

from .._core import sync as _sync
from .._core.backend import LockStatus, redacted
from .._core.errors import UnsafeBackendError
from .._core.token import validate_lock_name
from ._common import (
    Subparsers,
    _examples,
    _from_source,
    _HelpFormatter,
    _say,
    _shared_source_url,
    _source_arguments,
    _verbose,
)

NAME = "status"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    status = sub.add_parser(
        "status",
        parents=[_verbose()],
        help="show holder, token and time left of locks (all the source knows by default)",
        epilog=_examples("fenced status", "fenced status nightly --json"),
        formatter_class=_HelpFormatter,
    )
    status.add_argument("names", nargs="*", metavar="NAME", help="locks to show (default: all)")
    _source_arguments(status)
    status.add_argument("--json", action="store_true", help="print JSON")
    return status


def _state(status: LockStatus) -> str:
    """held; free (granted before, not now); unused (never granted: a typo, or not yet used)."""
    if status.holder is not None:
        return "held"
    return "free" if status.last_token is not None else "unused"


def run(args: argparse.Namespace) -> int:
    from ..election import leader_value

    url = _shared_source_url(args, "status")  # (it would show another process's locks unused)
    for name in args.names:
        validate_lock_name(name)  # a usage error before anything is contacted
    timeout = max(args.timeout, 0.1)
    try:
        with _from_source(args):
            locks = _sync.connect(url, connect_timeout=timeout)
    except UnsafeBackendError as exc:
        if not url.startswith(("redis:", "rediss:")):
            raise
        # Reading the state of a source that cannot keep its promises is still useful (to see
        # who holds what before fixing it); say so, and read.
        _say(f"warning: {exc}")
        with _from_source(args):
            locks = _sync.connect(url, connect_timeout=timeout, allow_unsafe_durability=True)
    with _from_source(args), locks:
        names = args.names or locks.lock_names()
        statuses = [locks.status(n) for n in names]
    if args.json:
        out = [
            {
                "name": s.name,
                "state": _state(s),
                "held": s.holder is not None,
                "holder": s.holder,
                "owner": s.owner,
                # an election's leader: what it advertised (elect(value=...)), and its epoch
                "value": leader_value(s.owner)[1] if s.holder is not None else None,
                "epoch": s.token.value if s.token else None,
                "token": str(s.token) if s.token else None,
                "last_token": str(s.last_token) if s.last_token else None,
                "remaining": s.remaining,
                "waiters": s.waiters,
            }
            for s in statuses
        ]
        print(json.dumps(out, indent=2))  # always a list, whatever the number of names
        return 0
    header = ("LOCK", "STATE", "TOKEN", "TIME LEFT", "WAITERS", "LAST TOKEN", "HOLDER")
    rows = [
        (
            s.name,
            _state(s),
            str(s.token) if s.token else "-",
            f"{s.remaining:.1f} s" if s.remaining is not None else "-",
            str(s.waiters) if s.waiters is not None else "?",
            str(s.last_token) if s.last_token else "-",
            # who: as the holder described itself, else its request id (a 0.1 client)
            s.owner or s.holder or "-",
        )
        for s in statuses
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if not rows:
        print(f"(no locks known to {redacted(url)})")
    return 0
