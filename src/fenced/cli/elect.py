"""``fenced elect NAME -- COMMAND``: run a command only while this process leads NAME."""

from __future__ import annotations

import argparse

from .._core import sync as _sync
from .._core.errors import ConfigurationError
from .._core.token import validate_lock_name
from ._common import (
    Subparsers,
    _examples,
    _from_source,
    _grace,
    _HelpFormatter,
    _shared_source_url,
    _source_arguments,
    _ttl,
    _verbose,
)

NAME = "elect"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    elect = sub.add_parser(
        "elect",
        parents=[_verbose()],
        help="run a command only while this process leads NAME (HA failover with fencing)",
        usage="fenced elect NAME [options] -- COMMAND ...",
        description=(
            "Campaign for leadership of NAME; once elected, run --fence-cmd (with the previous "
            "leader's FENCED_PREVIOUS_VALUE, _HOST, _OWNER, _PID, _PGID, _EPOCH, or "
            "FENCED_PREVIOUS_KNOWN=0 if there was none, and FENCING_TOKEN in its environment) "
            "until it succeeds (each attempt killed at --fence-timeout), then COMMAND with "
            "FENCING_TOKEN set to this leader's epoch; COMMAND dies with fenced elect, even by "
            "kill -9. When leadership is no longer sure, COMMAND is stopped (SIGTERM "
            "at --term-grace seconds left, SIGKILL at 0) before any successor can be elected. "
            "Without --fence-cmd it refuses to run unless --no-fence is given. See "
            "docs/failover.md."
        ),
        epilog=_examples(
            "fenced elect db-primary --ttl 5 --fence-cmd 'echo fence \"$FENCED_PREVIOUS_HOST\"'"
            " -- sh -c 'echo \"leading as $FENCING_TOKEN\"'",
        ),
        formatter_class=_HelpFormatter,
    )
    elect.add_argument("name", help="the election's (lock's) name")
    elect.add_argument("--value", default=None, help="what observers see (default: host name)")
    elect.add_argument("--ttl", type=_ttl, default=10.0, help="leadership lease ttl (10)")
    elect.add_argument("--fence-cmd", help="shell command that fences the previous leader")
    elect.add_argument(
        "--no-fence", action="store_true", help="run without a fence command (unsafe)"
    )
    elect.add_argument(
        "--fence-timeout", type=_grace, default=60.0, help="give up fencing after S s (60)"
    )
    elect.add_argument(
        "--term-grace", type=_grace, default=1.0,
        help="SIGTERM the command this many seconds before leadership may end (1)",
    )  # fmt: skip
    elect.add_argument(
        "--poison", metavar="DIR", help="watch DIR for a poison pill naming a later epoch"
    )
    elect.add_argument(
        "--lock-delay", type=_grace, default=0.0,
        help="after this leader's lease expires, elect nobody for S more seconds (0)",
    )  # fmt: skip
    _source_arguments(elect)
    return elect


def run(args: argparse.Namespace) -> int:
    import socket

    from ._elect import run_elected
    from ._hide import hide_secrets

    # First: the commands' /proc/$PPID/environ must not show the source's secrets.
    hide_secrets()
    cmd = list(args.cmd)
    if not cmd:
        raise ConfigurationError("elect: no command given (fenced elect NAME -- COMMAND ...)")
    if args.fence_cmd is None and not args.no_fence:
        raise ConfigurationError(
            "elect: no --fence-cmd: without one an old leader may still be running its command "
            "when this one starts; give a fence command, or --no-fence to run unfenced"
        )
    validate_lock_name(args.name)
    if args.term_grace >= args.ttl:
        raise ConfigurationError("elect: --term-grace must be shorter than --ttl")
    url = _shared_source_url(args, "elect")
    with _from_source(args), _sync.connect(url, connect_timeout=max(args.timeout, 0.1)) as locks:
        return run_elected(
            locks,
            args.name,
            cmd,
            value=args.value if args.value is not None else socket.gethostname(),
            ttl=args.ttl,
            fence_cmd=args.fence_cmd,
            fence_timeout=args.fence_timeout,
            term_grace=args.term_grace,
            poison_dir=args.poison,
            lock_delay=args.lock_delay,
        )
