"""The ``fenced`` command: ``demo``, ``lock NAME -- COMMAND``, ``status [NAME ...]``.

Exit statuses of ``fenced lock``: the command's own status when it ran to the end with the
lease held; 1 if the lock was not acquired within ``--timeout`` (as ``flock -w``); 75
(EX_TEMPFAIL) if the lease was lost while the command ran (the command is then terminated);
69 (EX_UNAVAILABLE) if the token source cannot be reached; 2 for usage errors; 126/127 if the
command cannot be run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import shlex
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from . import __version__, _clock, _sync
from ._backend import LockStatus, redacted
from ._command import Command, spawn
from ._errors import (
    AccessDenied,
    BackendUnavailable,
    ConfigurationError,
    FencedError,
    InvalidTokenError,
    LockTimeout,
    ReplicationError,
    StaleTokenError,
    UnsafeBackendError,
)
from ._paths import default_url, environment_url, read_url_file
from ._state import MAX_TIMEOUT, MAX_TTL, MIN_TTL, check_timeout, check_ttl
from ._token import FencingToken, validate_lock_name

__all__ = ["EXIT_LEASE_LOST", "EXIT_TIMEOUT", "EXIT_UNAVAILABLE", "EXIT_VIOLATION", "main"]

EXIT_USAGE = 2
EXIT_INVALID_TOKEN = 65  # EX_DATAERR: check-token: malformed, never issued, or not well signed
EXIT_UNAVAILABLE = 69
EXIT_SOFTWARE = 70
EXIT_LEASE_LOST = 75
EXIT_VIOLATION = 65  # EX_DATAERR: fenced check / sim found a violation in what it ran
EXIT_STALE = 77  # EX_NOPERM: a guarded write refused, the writer's token is stale
EXIT_NOT_CURRENT = 78  # check-token: released or expired, and no later grant known
EXIT_TIMEOUT = 124  # as timeout(1): not 1, which commands use for their own failures
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it

EXIT_STATUSES = """\
exit status (fenced's own outcomes never use 1, which commands use for their own failures):
  0      success (fenced lock: the command's own status when it ran to the end holding the lock)
  2      usage or configuration error (bad option, URL, lock name, number; credentials the
         source refused; a source whose settings cannot keep fenced's promises)
  65     fenced check, fenced sim: a violation was found (an invariant of fencing did not
         hold); fenced demo: the run did not behave as fencing should; check-token: the
         token is invalid: malformed, never issued by the source, or not well signed
  69     the token source (fenced group: a member) could not be reached (EX_UNAVAILABLE)
  70     another fenced error (EX_SOFTWARE)
  75     the lease was lost while the command ran; the command was terminated (EX_TEMPFAIL);
         fenced elect: leadership no longer sure, or a poison pill: the command was stopped
  77     fenced write: refused, the token is older than the newest version; check-token: stale
  78     check-token: the token is not current, and no later grant is known
  79     fenced elect: the fence command never succeeded; the command was not started
  124    the lock was not acquired within --timeout / -n (change it with -E, as flock -E)
  126    the command could not be executed
  127    the command was not found
  130    interrupted (Ctrl-C) while waiting for the lock
"""


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, not {text!r}")
    return value


def _exit_code(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an exit status: {text!r}") from None
    if not 0 <= value <= 255:
        raise argparse.ArgumentTypeError(f"an exit status is 0-255, not {value}")
    return value


def _ttl(text: str) -> float:
    value = _number(text)
    try:
        return check_ttl(value)
    except ConfigurationError:
        # (the library's message speaks of Python values; a command line speaks of seconds)
        raise argparse.ArgumentTypeError(
            f"a ttl is {MIN_TTL:g} to {MAX_TTL:g} seconds, not {text!r}"
        ) from None


def _timeout(text: str) -> float:
    value = _number(text)
    try:
        checked = check_timeout(value)
    except ConfigurationError:
        raise argparse.ArgumentTypeError(
            f"a timeout is 0 to {MAX_TIMEOUT:.0f} seconds (a year), not {text!r}"
        ) from None
    assert checked is not None
    return checked


def _read_timeout(text: str) -> float:
    value = _timeout(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a read timeout is more than 0 seconds, not {text!r}")
    return value


def _body_limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of bytes: {text!r}") from None
    if not 1024 <= value <= 1 << 30:
        raise argparse.ArgumentTypeError(f"a body limit is 1024 bytes to 1 GiB, not {value}")
    return value


def _grace(text: str) -> float:
    value = _number(text)
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be from 0 to 3600 seconds, not {text!r}")
    return value


class _HelpFormatter(argparse.HelpFormatter):
    """Descriptions wrapped, as argparse does; an epilog (exit statuses, examples) as laid out."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _examples(*lines: str) -> str:
    """An epilog's examples: tests/test_cli_help.py runs every line that starts with
    ``fenced`` (in a temporary directory, on a temporary source), so none can go stale.
    ``# exit N`` after a command is the status it is expected to end with (default 0)."""
    return "examples:\n" + "".join(f"  {line}\n" for line in lines)


LOCK_EXIT_STATUSES = """\
exit status (fenced's own outcomes never use 1, which commands use for their own failures):
  N      the command's own status, when it ran to the end holding the lock
  2      usage or configuration error (bad option, URL, lock name, number; credentials refused)
  69     the token source could not be reached (EX_UNAVAILABLE)
  70     another fenced error (EX_SOFTWARE)
  75     the lease was lost while the command ran; the command was terminated (EX_TEMPFAIL)
  124    the lock was not acquired within --timeout / -n (change it with -E, as flock -E)
  126    the command could not be executed
  127    the command was not found
  130    interrupted (Ctrl-C) while waiting for the lock
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line (``fenced: error: ...``) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        # argparse names Python types ("invalid int value: 'x'"): say what is expected instead
        message = message.replace("invalid int value", "not a whole number").replace(
            "invalid float value", "not a number"
        )
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_URL_HELP = (
    "token source URL (default: $FENCED_URL, else the URL in the file $FENCED_URL_FILE, else "
    "/var/tmp/fenced/locks.db, shared by every user of this machine); other local users can "
    "read a command line: give a URL with a password with --url-file or an environment variable"
)


def _url_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help=_URL_HELP)
    where.add_argument(
        "--url-file",
        metavar="FILE",
        help="read the token source URL from FILE (one line; # comments): keeps a password "
        "out of the process list; refused if the URL has a password and FILE is not mode 600",
    )


def _url(args: argparse.Namespace) -> str:
    """The token source's URL: --url, --url-file, $FENCED_URL, $FENCED_URL_FILE, else the
    machine's. Notes where it came from in ``args.url_origin``, for errors it causes."""
    # None while the origin is on the command line, or named by the error itself (a URL file's)
    args.url_origin = None
    if args.url:
        return str(args.url)
    if args.url_file:
        url = read_url_file(args.url_file, "--url-file")
        args.url_origin = f"--url-file {args.url_file}"
        return url
    found = environment_url()
    if found is not None:
        args.url_origin = found[1]
        return found[0]
    return default_url()


def _source_arguments(parser: argparse.ArgumentParser) -> None:
    """--url and --timeout, for the subcommands that only talk to the token source."""
    _url_arguments(parser)
    parser.add_argument(
        "--timeout",
        type=_timeout,
        default=10.0,
        help="give up reaching the source after this many seconds (10)",
    )


def _source_id_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source-id",
        metavar="ID",
        help="the token source's stable id (e.g. prod): signatures are bound to it, so a "
        "resource trusting it refuses another source's tokens; default: $FENCED_SOURCE_ID",
    )


def _source_id(args: argparse.Namespace) -> str | None:
    return args.source_id or os.environ.get("FENCED_SOURCE_ID") or None


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
    # -v also after the subcommand (fenced lock -v ...), without overriding one given before.
    common = _Parser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="reproduce DDIA Figure 8-5: a paused lock holder's write, fenced and unfenced",
    )
    demo.add_argument("--dir", help="keep the demo's databases in this directory")
    demo.add_argument("--ttl", type=_ttl, default=1.0, help="lease ttl in seconds (1)")
    demo.add_argument(
        "--replicated",
        action="store_true",
        help="three replicas, a crash and reconfiguration: epoch fencing (fenced.replicated)",
    )

    lock = sub.add_parser(
        "lock",
        parents=[common],
        help="run a command while holding a lock (like flock(1)); exports FENCING_TOKEN",
        usage="fenced lock NAME [options] -- COMMAND [ARGS ...]",
        description=(
            "Take the lock NAME from the token source (renewing its lease in the background), "
            "run COMMAND with FENCING_TOKEN and FENCED_LOCK in its environment, release the "
            "lock when it ends. If the lease is lost meanwhile, COMMAND is terminated. Give "
            "FENCING_TOKEN to what the command writes (fenced write, a guard), so that a run "
            "that lost its lease cannot overwrite a later one's work."
        ),
        epilog=LOCK_EXIT_STATUSES
        + "\n"
        + _examples(
            "# cron: skip this run, silently and successfully, while the last one holds the lock",
            "fenced lock -n -q -E 0 nightly --ttl 120 -- sh -c 'echo \"report as $FENCING_TOKEN\"'",
            "# wait at most 30 s for the lock; the write is refused if a later holder wrote",
            "fenced lock nightly --timeout 30 -- sh -c 'mkdir -p out && date | fenced write out/report.csv'",
            "# a URL with a password: from a file (mode 600), never on the command line",
            "fenced lock nightly --url-file source.url -- true",
        ),
        formatter_class=_HelpFormatter,
    )
    lock.add_argument("name", help="lock name")
    _url_arguments(lock)
    lock.add_argument("--ttl", type=_ttl, default=10.0, help="lease ttl in seconds (10)")
    wait = lock.add_mutually_exclusive_group()
    wait.add_argument(
        "--timeout",
        type=_timeout,
        default=None,
        help="give up after this many seconds (default: wait)",
    )
    wait.add_argument(
        "-n",
        "--nonblock",
        dest="timeout",
        action="store_const",
        const=0.0,
        help="fail at once if the lock is held (--timeout 0)",
    )
    lock.add_argument(
        "-E",
        "--conflict-exit-code",
        type=_exit_code,
        default=EXIT_TIMEOUT,
        metavar="N",
        help=f"exit status when the lock is not acquired in time ({EXIT_TIMEOUT})",
    )
    lock.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="say nothing when the lock is not acquired in time (errors are still reported); "
        "with -n -E 0, a skipped cron run is silent",
    )
    lock.add_argument(
        "--signing-key",
        metavar="FILE",
        help="sign the token with this key file (fenced keygen); default: $FENCED_SIGNING_KEY",
    )
    _source_id_argument(lock)
    lock.add_argument(
        "--grace",
        type=_grace,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL on lease loss (5)",
    )
    lock.add_argument(
        "--lock-delay",
        type=_grace,
        default=0.0,
        help="if this lease expires (not released), grant nobody the lock for S more seconds (0)",
    )
    lock.add_argument(
        "--new-session",
        action="store_true",
        help="run the command in a session of its own, without the terminal (as setsid)",
    )

    release = sub.add_parser(
        "release",
        parents=[common],
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

    check = sub.add_parser(
        "check-token",
        parents=[common],
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

    keygen = sub.add_parser(
        "keygen",
        parents=[common],
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

    write = sub.add_parser(
        "write",
        parents=[common],
        help="store stdin as a new version of DIR/NAME (files guard), if the token is not stale",
        description=(
            "Store standard input as the newest version of DIR/NAME through the files guard: "
            "refused (exit 77, nothing written) if DIR/NAME has a version with a higher token. "
            "Inside `fenced lock` the token comes from $FENCING_TOKEN. Plain tools read the "
            "newest version at DIR/NAME/current."
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

    serve = sub.add_parser(
        "serve",
        parents=[common],
        help="run the lock service over HTTP for clients in any language (docs/server.md)",
        description=(
            "Serve the locks of one token source over HTTP/JSON (OpenAPI at /openapi.json, a "
            "dashboard at /, Prometheus metrics at /metrics). Stateless: run several in front "
            "of one etcd, PostgreSQL or Redis and any may die. Without --api-keys it listens "
            "on loopback only, unless --insecure-no-auth. On SIGTERM it stops answering; held "
            "leases are left to expire, never released on their holders' behalf."
        ),
    )
    _source_arguments(serve)
    serve.add_argument(
        "--listen",
        default="127.0.0.1:7400",
        metavar="HOST:PORT",
        help="address to listen on (127.0.0.1:7400; port 0 picks one and prints it)",
    )
    serve.add_argument(
        "--api-keys",
        metavar="FILE",
        help="TOML file of API keys, each allowed verbs on lock-name prefixes (docs/server.md)",
    )
    serve.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="allow listening beyond loopback without --api-keys (anyone reaching it may lock)",
    )
    serve.add_argument(
        "--signing-key",
        metavar="FILE",
        help="sign every token with this key (fenced keygen); default: $FENCED_SIGNING_KEY",
    )
    _source_id_argument(serve)
    serve.add_argument(
        "--accept-unbound",
        action="store_true",
        help="with --source-id, also accept its key's unbound (v1) tokens in /v1/check and "
        "renewals: while naming a running source (docs/signing.md, migrating)",
    )
    serve.add_argument("--tls-cert", metavar="FILE", help="serve HTTPS with this certificate")
    serve.add_argument("--tls-key", metavar="FILE", help="the certificate's private key")
    serve.add_argument(
        "--max-wait",
        type=_timeout,
        default=60.0,
        help="longest one acquire request waits before answering 409 timeout (60)",
    )
    serve.add_argument(
        "--default-ttl", type=_ttl, default=10.0, help="lease seconds when a client gives none (10)"
    )
    serve.add_argument(
        "--read-timeout",
        type=_read_timeout,
        default=30.0,
        metavar="SECONDS",
        help="answer 408 and close when a request's head, or its body, takes longer to arrive (30)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=_body_limit,
        default=1 << 20,
        metavar="N",
        help="refuse a request body over N bytes with 413, before holding it (1048576)",
    )
    serve.add_argument(
        "--log-format", choices=["text", "json"], default="text", help="log lines (text)"
    )
    serve.add_argument("--access-log", action="store_true", help="log every request")
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning"],
        default="info",
        help="info (default): a line per grant, release, expiry and forced release; warning: "
        "only problems (the transition lines cost a quarter to a third of a busy server's "
        "throughput)",
    )

    check_kit = sub.add_parser(
        "check",
        parents=[common],
        help="run a stale-writer campaign against a token source and a resource, check it",
        description=(
            "Worker processes take one lock from --source and read-modify-write a register in "
            "--resource under its token (default: an embedded SQLite table behind fenced's SQL "
            "guard), while a seeded nemesis pauses them past their ttl, stalls them between "
            "read and write, kills them, cuts them off or delays their traffic, restarts the "
            "source or steps their clocks. Every step goes to REPORT/history.jsonl, every "
            "checker runs over it, REPORT/report.html draws it. With --resource-cmd the kit "
            "runs the resource's process itself and restarts and pauses it too. Exit 0 if "
            f"every invariant held, {EXIT_VIOLATION} if one did not (docs/testing.md)."
        ),
    )
    check_kit.add_argument(
        "--source",
        help="token source URL, or redis|etcd|postgresql|zookeeper to start one "
        "(default: a private SQLite source of the campaign's own)",
    )
    check_kit.add_argument(
        "--resource",
        default="",
        help="sqlite:////ABS/PATH, postgresql://..., redis://..., etcd://..., file:///DIR, "
        "http(s)://... or python:MODULE:CLASS (default: an embedded SQLite register)",
    )
    check_kit.add_argument(
        "--resource-cmd",
        default="",
        metavar="COMMAND",
        help="the command that serves --resource (e.g. 'python inventory.py --port 8000'): "
        "the kit starts it, kills -9 and restarts it on the same data, pauses it",
    )
    check_kit.add_argument("--lock", default="counter", help="the lock the workers take")
    check_kit.add_argument("--time", type=_grace, default=20.0, help="seconds of faults (20)")
    check_kit.add_argument("--workers", type=int, default=3, help="worker processes (3)")
    check_kit.add_argument("--ttl", type=_ttl, default=1.0, help="the workers' lease ttl (1)")
    check_kit.add_argument(
        "--nemesis",
        default=None,
        help="faults, comma-separated: pause, stall (a pause between read and write), kill, "
        "partition, delay, restart (a source the kit started), clock (wall-clock steps), "
        "forge (forged tokens; needs --signing), race (a takeover timed inside a TCP "
        "resource), resource-restart, resource-pause (with --resource-cmd), "
        "resource-partition, resource-delay (default: pause,stall,kill; race with a TCP "
        "resource; resource-restart,resource-pause with --resource-cmd)",
    )
    check_kit.add_argument(
        "--signing",
        action="store_true",
        help="sign every token (a key made for the run); the resource's guard verifies them",
    )
    check_kit.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (0)")
    check_kit.add_argument("--report", default="fenced-check", help="directory for the history")
    check_kit.add_argument(
        "--plant",
        default="",
        metavar="FAULT",
        help="plant a fault to see it caught: " + ", ".join(_plant_names()),
    )

    elect = sub.add_parser(
        "elect",
        parents=[common],
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

    sim = sub.add_parser(
        "sim",
        help="simulate fencing deterministically over many seeds (virtual time)",
        description=(
            "fenced's real lease core and SQL guard (--system lease), its real replicated "
            "group on members behind real SQL guards (--system group), or fenced serve's real "
            "grant bookkeeping in several gateways (--system gateway), with a simulated token "
            "source and network on a virtual-time event loop: pauses, stalls, crashes, source, "
            "resource, member and gateway restarts, members wiped (back empty), lost, "
            "duplicated, delayed and reordered messages, clock skew and jumps, another "
            "tenant's request ids. Each seed is one run, the same seed "
            "the same run byte for byte; checkers judge it. A failing seed is shrunk and "
            f"printed with the command that replays it. Exit 0 if every seed passed, {EXIT_VIOLATION} if one "
            "failed."
        ),
    )
    sim.add_argument("--seeds", type=int, default=10_000, help="how many seeds (10000)")
    sim.add_argument("--start", type=int, default=0, help="the first seed (0)")
    sim.add_argument("--jobs", type=int, default=0, help="processes (default: one per CPU)")
    sim.add_argument("--clients", type=int, default=3, help="simulated clients (3)")
    sim.add_argument("--rounds", type=int, default=4, help="rounds per client (4)")
    sim.add_argument("--faults", default="", help="comma-separated subset of the faults (all)")
    sim.add_argument("--plant", default="", metavar="FAULT", help="plant a fault, to see it caught")
    sim.add_argument("--replay", type=int, metavar="SEED", help="run one seed and print its trace")
    sim.add_argument(
        "--system",
        "--workload",
        choices=("lease", "group", "gateway"),
        help="what to simulate: lease (default), group (fenced.replicated) or gateway (fenced "
        "serve's grant bookkeeping, several gateways on one source); a plant implies its own",
    )

    group = sub.add_parser(
        "group",
        parents=[common],
        help="a replicated group's configuration and members (fenced.replicated)",
        epilog=_examples(
            "fenced group status orders",
            "fenced group status orders --member a=sqlite:////var/lib/app/a.db --json",
        ),
        formatter_class=_HelpFormatter,
    )
    group.add_argument("action", choices=("status", "remove", "add"))
    group.add_argument("name", metavar="GROUP", help="the group (its lock's name)")
    group.add_argument("names", nargs="*", metavar="MEMBER", help="members to remove or add")
    group.add_argument(
        "--member",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="how to reach a member: redis://h:p/db, postgresql://..., sqlite:////abs/path.db, "
        "etcd://h:p, or NAME=@FILE: the URL read from FILE (mode 600 if it has a password), "
        "off the command line (repeat; status shows these members' marks)",
    )
    group.add_argument("--resource", help="the members' guarded resource (default: GROUP)")
    _source_arguments(group)
    group.add_argument("--json", action="store_true", help="print JSON (status)")

    status = sub.add_parser(
        "status",
        parents=[common],
        help="show holder, token and time left of locks (all the source knows by default)",
        epilog=_examples("fenced status", "fenced status nightly --json"),
        formatter_class=_HelpFormatter,
    )
    status.add_argument("names", nargs="*", metavar="NAME", help="locks to show (default: all)")
    _source_arguments(status)
    status.add_argument("--json", action="store_true", help="print JSON")
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
    try:
        if args.command == "demo":
            from ._demo import run_demo

            if args.replicated:
                from ._demo_replicated import run_replicated_demo

                return run_replicated_demo(directory=args.dir, ttl=args.ttl)
            return run_demo(directory=args.dir, ttl=args.ttl)
        if args.command == "lock":
            return _cmd_lock(args)
        if args.command == "status":
            return _cmd_status(args)
        if args.command == "write":
            return _cmd_write(args)
        if args.command == "release":
            return _cmd_release(args)
        if args.command == "keygen":
            return _cmd_keygen(args)
        if args.command == "check-token":
            return _cmd_check_token(args)
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "check":
            return _cmd_check(args)
        if args.command == "group":
            from ._group_cmd import run_group

            return run_group(args, _url(args))
        if args.command == "sim":
            return _cmd_sim(args)
        if args.command == "elect":
            return _cmd_elect(args)
        if args.command == "poison":
            from ._elect_cmd import poison

            validate_lock_name(args.name)
            poison(args.dir, args.name, args.epoch, args.wait)
            return 0
    except InvalidTokenError as exc:
        code = EXIT_INVALID_TOKEN if args.command == "check-token" else EXIT_USAGE
        return _fail(code, str(exc), exc, args.verbose)
    except (ConfigurationError, AccessDenied, UnsafeBackendError) as exc:
        # The caller's configuration (a URL, a password, a server's settings): no retry mends it.
        return _fail(EXIT_USAGE, _with_origin(str(exc), exc), exc, args.verbose)
    except BackendUnavailable as exc:
        text = _with_origin(f"token source unavailable: {exc}", exc)
        return _fail(EXIT_UNAVAILABLE, text, exc, args.verbose)
    except ReplicationError as exc:  # members of a replicated group could not be reached
        return _fail(EXIT_UNAVAILABLE, str(exc), exc, args.verbose)
    except KeyboardInterrupt:  # Ctrl-C while waiting: the connection left the queue on close
        return EXIT_INTERRUPTED
    except FencedError as exc:
        return _fail(EXIT_SOFTWARE, str(exc), exc, args.verbose)
    raise AssertionError(args.command)  # pragma: no cover


@contextlib.contextmanager
def _from_source(args: argparse.Namespace) -> Iterator[None]:
    """Marks the errors of reaching and using the token source with where its URL came from
    when the command line does not show it ($FENCED_URL, a URL file)."""
    try:
        yield
    except (ConfigurationError, AccessDenied, UnsafeBackendError, BackendUnavailable) as exc:
        origin = getattr(args, "url_origin", None)
        if origin and not hasattr(exc, "fenced_url_origin"):
            exc.fenced_url_origin = origin  # type: ignore[union-attr]
        raise


@contextlib.contextmanager
def _named(variable: str) -> Iterator[None]:
    """A configuration error caused by an environment variable's value names the variable."""
    try:
        yield
    except ConfigurationError as exc:
        if variable in str(exc):
            raise
        raise ConfigurationError(f"{variable}: {exc}") from None


def _signing_key(args: argparse.Namespace) -> Any:
    """The key of --signing-key, else of $FENCED_SIGNING_KEY (None: tokens are not signed),
    read before the source is reached, so its errors are not taken for the source's."""
    from ._signing import read_key

    if args.signing_key:
        return read_key(args.signing_key, args.signing_key)
    if os.environ.get("FENCED_SIGNING_KEY"):
        with _named("$FENCED_SIGNING_KEY"):
            return read_key(os.environ["FENCED_SIGNING_KEY"], "$FENCED_SIGNING_KEY")
    return None


def _with_origin(text: str, exc: BaseException) -> str:
    origin = getattr(exc, "fenced_url_origin", None)
    return f"{text} (token source from {origin})" if origin else text


def _one_line(text: str) -> str:
    """Client libraries' messages span lines (libpq's hints): fenced prints one line each."""
    return " ".join(text.split())


def _say(text: str) -> None:
    print(f"fenced: {_one_line(text)}", file=sys.stderr, flush=True)


def _fail(code: int, text: str, exc: BaseException, verbose: bool) -> int:
    _say(text)
    if verbose:  # the chain of causes, one line each
        cause = exc.__cause__ or exc.__context__
        while cause is not None:
            _say(f"  caused by {type(cause).__name__}: {cause}")
            cause = cause.__cause__ or cause.__context__
    return code


class _Once(logging.Filter):
    """Without -v, only fenced's own warnings, each message once (a client library's retries
    would repeat the same line many times a second)."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("fenced"):
            return False
        text = record.getMessage()
        if text in self._seen:
            return False
        self._seen.add(text)
        return True


class _LogFormatter(logging.Formatter):
    """``fenced: MESSAGE`` for fenced's own logger, ``fenced: redis: MESSAGE`` for its parts,
    ``fenced: kazoo.client: MESSAGE`` for a client library's (never ``fenced: fenced: ...``)."""

    def format(self, record: logging.LogRecord) -> str:
        part = "" if record.name == "fenced" else record.name.removeprefix("fenced.")
        text = "fenced: " + (f"{part}: " if part else "") + record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def _setup_logging(verbose: bool) -> None:
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_fenced_cli", False)]:
        root.removeHandler(old)  # (main() called again in one process: one handler only)
    handler = logging.StreamHandler(sys.stderr)
    handler._fenced_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(_LogFormatter())
    if verbose:
        root.setLevel(logging.DEBUG)
    else:
        root.setLevel(logging.WARNING)
        handler.addFilter(_Once())
    root.addHandler(handler)


def _cmd_lock(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if not cmd:
        _say("lock: no command given (fenced lock NAME -- COMMAND ...)")
        return EXIT_USAGE
    validate_lock_name(args.name)  # (before the URL: its errors name where the URL came from)
    url = _url(args)
    with _from_source(args):
        _require_shared_source(url, "lock")
    # --timeout bounds everything before the command starts, reaching the source included.
    deadline = None if args.timeout is None else _clock.now() + args.timeout
    connect_timeout = None if args.timeout is None else max(args.timeout, 0.1)
    options: dict[str, Any] = {}
    if connect_timeout is not None:
        options["connect_timeout"] = connect_timeout
    key = _signing_key(args)
    if key is not None:
        options["signing_key"] = key  # FENCING_TOKEN then carries the signed form
        options["source_id"] = _source_id(args)
    with _from_source(args), _sync.connect(url, **options) as locks:
        remaining = None if deadline is None else max(0.0, deadline - _clock.now())
        lease = locks.lock(
            args.name,
            ttl=args.ttl,
            timeout=remaining,
            description=shlex.join(cmd),
            lock_delay=args.lock_delay,
        )
        try:
            token = lease.acquire()
        except LockTimeout:
            if not args.quiet:
                _say(f"lock: {args.name!r} not acquired within {args.timeout:g} s")
            return int(args.conflict_exit_code)
        try:
            code = _run_holding(lease, str(token), cmd, args.grace, args.new_session)
        except BaseException:
            with contextlib.suppress(FencedError):
                lease.release()
            raise
        try:
            lease.release()
        except FencedError as exc:
            # The command's outcome stands (75 if the lease was lost while it ran): a failed
            # release must not turn it into 69. The grant simply expires after its ttl.
            _say(f"lock: could not release {args.name!r} ({exc}); it expires by itself")
        if code != EXIT_LEASE_LOST and lease.lost.is_set():
            # The release found the grant gone (taken over, force-released, expired) before
            # any renewal noticed: the command ran, at least in part, without the lock — as
            # the library's `with locks.lock(...)` raises LeaseLostError.
            _say(f"lock: lease on {args.name!r} (token {token}) was lost while the command ran")
            return EXIT_LEASE_LOST
        return code


def _require_shared_source(url: str, command: str) -> None:
    """A lock held by a process of its own must exclude other processes: refuse a source
    whose locks live inside one process (memory://), where every `fenced lock` would hold."""
    from ._backend import backend_class

    if backend_class(url).process_local:
        raise ConfigurationError(
            f"{command}: {redacted(url)} keeps its locks inside one process, so it cannot "
            "exclude another process; use a shared source (sqlite:////path, etcd://, ...)"
        )


def _run_holding(
    lease: _sync.Lease, token: str, cmd: list[str], grace: float, new_session: bool = False
) -> int:
    env = dict(os.environ, FENCING_TOKEN=token, FENCED_LOCK=lease.name)
    # The handlers go in before the command starts: a Ctrl-C or SIGTERM in between would
    # otherwise end `fenced lock` (releasing the lock) and leave the command running.
    child: Command | None = None
    early: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if child is None:
            early.append(signum)  # passed on as soon as the command exists
        else:
            child.signal(signum)

    # A signal ignored when fenced started (`fenced lock ... &` in a script ignores SIGINT)
    # stays ignored, for fenced and for the command, as for any program started so.
    previous = {
        s: signal.signal(s, forward)
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        if signal.getsignal(s) is not signal.SIG_IGN
    }
    try:
        if early:
            return 128 + early[0]
        if lease.remaining() <= 0:
            # Never start the command unless the lease is surely held right now.
            _say(f"lock: lease on {lease.name!r} ran out before the command started")
            return EXIT_LEASE_LOST
        child = spawn(cmd, env, "fenced: lock: ", new_session=new_session)
        for signum in early:
            child.signal(signum)
        child.start()
        return _supervise(lease, token, child, grace)
    finally:
        if child is not None:
            # Whatever the command left in its process group (a background job) is killed too,
            # before the release: it holds the token, and the next holder gets the lock now.
            # (Under flock(1) it would hold the lock; fenced cannot hold it for it.)
            child.finish(kill_rest=True)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(lease: _sync.Lease, token: str, child: Command, grace: float) -> int:
    """Wait for the command; if the lease is lost first, terminate it (SIGTERM, then SIGKILL)."""
    finished = threading.Event()
    lease.on_lost = lambda _lease: finished.set()

    def wait_child() -> None:
        child.proc.wait()
        finished.set()

    threading.Thread(target=wait_child, daemon=True).start()

    if lease.lost.is_set():
        finished.set()
    finished.wait()
    if child.proc.poll() is None and lease.lost.is_set():
        _say(
            f"lock: lease on {lease.name!r} (token {token}) lost: {lease.lost_cause}; "
            "terminating the command"
        )
        child.signal(signal.SIGTERM)
        try:
            child.proc.wait(grace)
        except subprocess.TimeoutExpired:
            child.signal(signal.SIGKILL)
            child.proc.wait()
        return EXIT_LEASE_LOST
    code = child.proc.wait()
    if lease.lost.is_set():
        _say(f"lock: lease on {lease.name!r} (token {token}) was lost while the command ran")
        return EXIT_LEASE_LOST
    return code if code >= 0 else 128 - code


def _cmd_check_token(args: argparse.Namespace) -> int:
    from ._signing import Keyring, public_half, read_key, verify_key

    token = FencingToken.parse(args.token)
    url = _url(args)
    options: dict[str, Any] = {"connect_timeout": max(args.timeout, 0.1)}
    # Verifying needs only a public key (or the HMAC secret), never the power to sign:
    # the token is checked locally first, and refused (exit 65) if unsigned, forged or of
    # another source, as guards and fenced serve's /v1/check refuse it.
    keys: list[Any] = []
    if args.verify_key:
        keys = [verify_key(path) for path in args.verify_key]
    elif os.environ.get("FENCED_VERIFY_KEY"):
        with _named("$FENCED_VERIFY_KEY"):
            keys = [verify_key(os.environ["FENCED_VERIFY_KEY"], "$FENCED_VERIFY_KEY")]
    elif os.environ.get("FENCED_SIGNING_KEY"):
        # (the source's own key, private or public: its public half verifies)
        with _named("$FENCED_SIGNING_KEY"):
            key = read_key(os.environ["FENCED_SIGNING_KEY"], "$FENCED_SIGNING_KEY")
            keys = [public_half(key)]
    source_id = _source_id(args)
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


def _cmd_keygen(args: argparse.Namespace) -> int:
    from ._signing import Ed25519SigningKey, generate_key, key_text

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


def _cmd_release(args: argparse.Namespace) -> int:
    if not args.force:
        _say("release: --force is required (it frees the lock from whoever holds it)")
        return EXIT_USAGE
    name = validate_lock_name(args.name)
    token = None if args.token is None else FencingToken.parse(args.token, lock=name)
    url = _url(args)
    with _from_source(args):
        _require_shared_source(url, "release")  # (another process's lock is out of its reach)
    with _from_source(args), _sync.connect(url, connect_timeout=max(args.timeout, 0.1)) as locks:
        freed = locks.force_release(name, token)
    if freed is None:
        which = f" by {token}" if token is not None else ""
        print(f"{name}: not held{which}; nothing released")
        return 0
    who = freed.owner or freed.holder
    print(f"{name}: released {freed.token} (held by {who})")
    return 0


def _cmd_write(args: argparse.Namespace) -> int:
    from .guards.files import FileGuard

    text = args.token or os.environ.get("FENCING_TOKEN")
    if not text:
        _say("write: no token: pass --token or run inside `fenced lock` ($FENCING_TOKEN)")
        return EXIT_USAGE
    token = FencingToken.parse(text)
    directory, name = os.path.split(os.path.abspath(args.path))
    if not os.path.isdir(directory):
        _say(f"write: directory {directory} does not exist")
        return EXIT_USAGE
    mode = os.stat(directory).st_mode
    if mode & (stat.S_IWOTH | stat.S_ISVTX):
        # The guard marks its whole directory as the resource of one lock: done implicitly
        # on /tmp, it would refuse every other user's and job's writes there.
        _say(
            f"write: {directory} is shared (world-writable or sticky, as /tmp is): the files "
            "guard would claim all of it for one lock; write into a directory of your own"
        )
        return EXIT_USAGE
    data = sys.stdin.buffer.read()
    try:
        FileGuard(directory, lock=token.lock).write(name, data, token=token)
    except StaleTokenError as exc:
        _say(f"write refused: {exc}")
        return EXIT_STALE
    return 0


def _state(status: LockStatus) -> str:
    """held; free (granted before, not now); unused (never granted: a typo, or not yet used)."""
    if status.holder is not None:
        return "held"
    return "free" if status.last_token is not None else "unused"


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .server import ServerSettings, is_loopback, load_api_keys, parse_listen, serve
    except ImportError as exc:
        raise ConfigurationError(
            f"fenced serve needs extra packages: pip install 'fenced[server]' ({exc})"
        ) from None
    host, port = parse_listen(args.listen)
    keys = load_api_keys(args.api_keys) if args.api_keys else None
    if keys is None and not is_loopback(host) and not args.insecure_no_auth:
        raise ConfigurationError(
            f"refusing to listen on {host} without --api-keys: anyone who reaches it could "
            "take and release locks (give --api-keys FILE, or --insecure-no-auth)"
        )
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigurationError("--tls-cert and --tls-key go together")
    options: dict[str, object] = {"connect_timeout": args.timeout}
    key_file = args.signing_key or os.environ.get("FENCED_SIGNING_KEY")
    if key_file:
        options["signing_key"] = key_file
        options["source_id"] = _source_id(args)
        options["accept_unbound"] = args.accept_unbound
    settings = ServerSettings(
        url=_url(args),
        options=options,
        api_keys=keys,
        max_wait=args.max_wait,
        default_ttl=args.default_ttl,
        max_request_bytes=args.max_request_bytes,
        read_timeout=args.read_timeout,
    )
    serve(
        settings,
        host,
        port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        log_format=args.log_format,
        log_level=args.log_level,
        access_log=args.access_log,
    )
    return 0


def _plant_names() -> list[str]:
    from .testing.check._plants import PLANTS

    return list(PLANTS)


def _cmd_check(args: argparse.Namespace) -> int:
    from .testing.check import NEMESES, run_campaign
    from .testing.check._plants import plant_role

    nemesis = None if args.nemesis is None else [n for n in args.nemesis.split(",") if n]
    if nemesis is not None and set(nemesis) - set(NEMESES):
        raise ConfigurationError(f"--nemesis: choose from {', '.join(NEMESES)}")
    if not 1 <= args.workers <= 64:
        raise ConfigurationError("--workers must be 1-64")
    validate_lock_name(args.lock)
    plant_role(args.plant)  # an unknown plant: a usage error before anything starts

    def terminated(*_: object) -> None:
        raise KeyboardInterrupt  # (so the campaign stops its workers and the resource it ran)

    signal.signal(signal.SIGTERM, terminated)
    progress = _progress_bar(args.time)
    with progress as tick:
        result = run_campaign(
            args.source,
            args.report,
            resource=args.resource,
            lock=args.lock,
            workers=args.workers,
            seconds=args.time,
            ttl=args.ttl,
            nemesis=nemesis,
            seed=args.seed,
            plant=args.plant,
            signing=args.signing,
            progress=tick,
            resource_cmd=args.resource_cmd,
        )
    from ._console import make_printer

    out = make_printer()
    faults = ", ".join(f"{n} {k}" for k, n in result.faults.items()) or "none"
    out.print(
        f"{result.grants} grants, {result.accepted} writes accepted, {result.refused} refused "
        f"(stale), {result.unknown} unanswered, {result.refused_reads} reads refused; "
        f"{result.ops_per_second:.0f} writes/s; "
        f"faults: {faults}"
    )
    for violation in result.violations[:20]:
        out.print(f"[bold red]VIOLATION[/bold red] {violation}")
    if len(result.violations) > 20:
        out.print(f"... and {len(result.violations) - 20} more (see the report)")
    if result.ok:
        out.print("[bold green]every invariant held[/bold green]")
    else:
        first = result.first_violation_after
        when = f", the first {first:.1f} s in" if first is not None else ""
        out.print(f"[bold red]{len(result.violations)} violation(s){when}[/bold red]")
    out.print(f"report: {result.report}  history: {result.history}")
    return 0 if result.ok else EXIT_VIOLATION


def _cmd_elect(args: argparse.Namespace) -> int:
    import socket

    from ._elect_cmd import run_elected

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
    url = _url(args)
    with _from_source(args):
        _require_shared_source(url, "elect")
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


def _cmd_sim(args: argparse.Namespace) -> int:
    from .testing.sim import FAULTS, SIM_PLANTS, Config, plant_system, run_seeds, shrink, simulate

    faults = tuple(f for f in args.faults.split(",") if f) or FAULTS
    if set(faults) - set(FAULTS):
        raise ConfigurationError(f"--faults: choose from {', '.join(FAULTS)}")
    if args.plant and args.plant not in SIM_PLANTS:
        raise ConfigurationError(f"--plant: choose from {', '.join(SIM_PLANTS)}")
    if not 1 <= args.clients <= 16 or not 1 <= args.rounds <= 1000 or args.seeds < 1:
        raise ConfigurationError("--clients must be 1-16, --rounds 1-1000, --seeds at least 1")
    system = args.system or plant_system(args.plant)
    if args.plant and plant_system(args.plant) != system:
        raise ConfigurationError(
            f"--plant {args.plant} is a {plant_system(args.plant)} plant, not a {system} one"
        )
    template = Config(0, args.clients, args.rounds, plant=args.plant, faults=faults, system=system)
    if args.replay is not None:
        outcome = simulate(dataclasses.replace(template, seed=args.replay))
        sys.stdout.write(outcome.trace_text())
        for violation in outcome.violations:
            print(f"VIOLATION {violation}")
        print("every invariant held" if outcome.ok else f"{len(outcome.violations)} violation(s)")
        return 0 if outcome.ok else EXIT_VIOLATION
    with _progress_bar(args.seeds) as tick:
        result = run_seeds(
            template,
            args.start,
            args.seeds,
            jobs=args.jobs,
            stop_at_first=True,
            progress=lambda done, bad: tick(done, f"{done} seeds, {bad} failed"),
        )
    print(f"{result.seeds} seeds in {result.seconds:.1f} s ({result.per_second:.0f} seeds/s)")
    if not result.failed:
        print("every invariant held")
        return 0
    first = dataclasses.replace(template, seed=result.failed[0])
    small = shrink(first)
    short = small.short_trace()
    print(
        f"seed {first.seed} failed; shrunk to {small.config.clients} clients x "
        f"{small.config.rounds} rounds; the {len(short)} events behind the first violation:"
    )
    sys.stdout.write(small.trace_text(short))
    for violation in small.violations:
        print(f"VIOLATION {violation}")
    print(f"replay: {small.config.replay()}")
    return EXIT_VIOLATION


class _progress_bar:
    """A rich progress bar over the campaign's seconds, on stderr (nothing without rich or a
    terminal); the context value is the campaign's ``progress`` callback."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Callable[[float, str], None]:
        try:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
        except ImportError:
            return lambda elapsed, what: None
        if not sys.stderr.isatty():
            return lambda elapsed, what: None
        self._bar = Progress(
            TextColumn("fenced check"), BarColumn(), TextColumn("{task.description}"),
            TimeRemainingColumn(), transient=True,
        )  # fmt: skip
        self._bar.start()
        self._task = self._bar.add_task("starting", total=self.seconds)

        def tick(elapsed: float, what: str) -> None:
            self._bar.update(self._task, completed=min(elapsed, self.seconds), description=what)

        return tick

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def _cmd_status(args: argparse.Namespace) -> int:
    from .election import leader_value

    url = _url(args)
    with _from_source(args):
        _require_shared_source(url, "status")  # (it would show another process's locks unused)
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
