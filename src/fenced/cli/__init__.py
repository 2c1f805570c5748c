"""The ``fenced`` command: one module a command, each with ``NAME``,
``add_parser(subparsers)`` and ``run(args) -> int``; what they share is in ``_common``.

A command module imports only argparse and the light core at the top: what it runs (the
server, the check kit, the simulator, the guards) it imports in ``run``, so that ``fenced
--help`` and ``fenced lock`` do not pay for the rest. The exit statuses are in
``fenced --help`` (``_common.EXIT_STATUSES``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from .. import __version__
from .._core.errors import (
    AccessDenied,
    BackendUnavailable,
    ChangeRefusedError,
    ConfigurationError,
    FencedError,
    InvalidTokenError,
    ReplicationError,
    UnsafeBackendError,
)
from . import (
    check,
    check_token,
    demo,
    elect,
    group,
    keygen,
    lock,
    poison,
    release,
    serve,
    sim,
    status,
    write,
)
from ._common import (
    EXIT_INTERRUPTED,
    EXIT_INVALID_TOKEN,
    EXIT_LEASE_LOST,
    EXIT_REFUSED,
    EXIT_SOFTWARE,
    EXIT_STATUSES,
    EXIT_TIMEOUT,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    EXIT_VIOLATION,
    _examples,
    _fail,
    _Parser,
    _setup_logging,
    _with_origin,
)

__all__ = ["EXIT_LEASE_LOST", "EXIT_TIMEOUT", "EXIT_UNAVAILABLE", "EXIT_VIOLATION", "main"]

# The commands, in the order `fenced --help` lists them.
COMMANDS: tuple[ModuleType, ...] = (
    demo,
    lock,
    release,
    check_token,
    keygen,
    write,
    serve,
    check,
    elect,
    poison,
    sim,
    group,
    status,
)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="fenced",
        description="Locks with fencing tokens, and resources that reject stale writers.",
        epilog=EXIT_STATUSES
        + "\n"
        + _examples(
            "fenced lock nightly --ttl 60 -- sh -c 'echo \"holding nightly as $FENCING_TOKEN\"'",
            "fenced status",
            "fenced keygen hmac jobs.key",
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="log what fenced and its clients do (debug)"
    )
    p.add_argument("--version", action="version", version=f"fenced {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is the command of `fenced lock`, options and all.
    command: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1 :]
    args = _parser().parse_args(argv)
    args.cmd = command
    _setup_logging(args.verbose)
    run = next(c.run for c in COMMANDS if args.command == c.NAME)
    try:
        return int(run(args))
    except InvalidTokenError as exc:
        code = EXIT_INVALID_TOKEN if args.command == "check-token" else EXIT_USAGE
        return _fail(code, str(exc), exc, args.verbose)
    except (ConfigurationError, AccessDenied, UnsafeBackendError) as exc:
        # The caller's configuration (a URL, a password, a server's settings): no retry mends it.
        return _fail(EXIT_USAGE, _with_origin(str(exc), exc), exc, args.verbose)
    except BackendUnavailable as exc:
        text = _with_origin(f"token source unavailable: {exc}", exc)
        return _fail(EXIT_UNAVAILABLE, text, exc, args.verbose)
    except ChangeRefusedError as exc:  # refused for safety (nothing changed): not a retry
        return _fail(EXIT_REFUSED, str(exc), exc, args.verbose)
    except ReplicationError as exc:  # members of a replicated group could not be reached
        return _fail(EXIT_UNAVAILABLE, str(exc), exc, args.verbose)
    except KeyboardInterrupt:  # Ctrl-C while waiting: the connection left the queue on close
        return EXIT_INTERRUPTED
    except FencedError as exc:
        return _fail(EXIT_SOFTWARE, str(exc), exc, args.verbose)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
