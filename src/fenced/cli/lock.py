"""``fenced lock NAME -- COMMAND``: run a command while holding a lock, as flock(1).

Exit statuses (LOCK_EXIT_STATUSES, in its help): the command's own status when it ran to the
end with the lease held; 124 (as timeout(1); -E changes it, as flock -E) if the lock was not
acquired within ``--timeout``; 75 (EX_TEMPFAIL) if the lease was lost while the command ran
(the command is then terminated); 69 (EX_UNAVAILABLE) if the token source cannot be reached;
2 for usage errors; 126/127 if the command cannot be run; 130 on Ctrl-C while waiting.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import threading
from typing import Any

from .._core import clock as _clock
from .._core import sync as _sync
from .._core.errors import FencedError, LockTimeout
from .._core.token import validate_lock_name
from ._command import Command, spawn
from ._common import (
    EXIT_LEASE_LOST,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    Subparsers,
    _examples,
    _exit_code,
    _from_source,
    _grace,
    _HelpFormatter,
    _say,
    _shared_source_url,
    _signing_key,
    _source_id,
    _source_id_argument,
    _source_options,
    _timeout,
    _ttl,
    _url_arguments,
    _verbose,
    child_environment,
)
from ._hide import hide_secrets

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


NAME = "lock"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    lock = sub.add_parser(
        "lock",
        parents=[_verbose()],
        help="run a command while holding a lock (like flock(1)); exports FENCING_TOKEN",
        usage="fenced lock NAME [options] -- COMMAND [ARGS ...]",
        description=(
            "Take the lock NAME from the token source (renewing its lease in the background), "
            "run COMMAND with FENCING_TOKEN and FENCED_LOCK in its environment (and without "
            "the source's secrets: $FENCED_SIGNING_KEY, $FENCED_API_KEY, a $FENCED_URL with a "
            "password, an HMAC key's text in $FENCED_VERIFY_KEY; nor can it read them from "
            "/proc/$PPID/environ), with what a nested fenced write needs to verify its token "
            "($FENCED_SOURCE_ID from --source-id, an Ed25519 key's .pub line in "
            "$FENCED_VERIFY_KEY), release the lock when it "
            "ends. If the lease is lost meanwhile, COMMAND is terminated. Give "
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
        "--description",
        metavar="TEXT",
        help="what operators see as the holder in fenced status and the dashboard (default: "
        "the command's program name; its arguments, which may hold secrets, are never shown)",
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
    return lock


def run(args: argparse.Namespace) -> int:
    # First: the command's /proc/$PPID/environ must not show the source's secrets.
    hide_secrets()
    cmd = list(args.cmd)
    if not cmd:
        _say("lock: no command given (fenced lock NAME -- COMMAND ...)")
        return EXIT_USAGE
    validate_lock_name(args.name)  # (before the URL: its errors name where the URL came from)
    url = _shared_source_url(args, "lock")
    # --timeout bounds everything before the command starts, reaching the source included.
    deadline = None if args.timeout is None else _clock.now() + args.timeout
    connect_timeout = None if args.timeout is None else max(args.timeout, 0.1)
    options: dict[str, Any] = {}
    if connect_timeout is not None:
        options["connect_timeout"] = connect_timeout
    # (with a key, FENCING_TOKEN carries the signed form)
    key = _signing_key(args)
    options.update(_source_options(args, key))
    with _from_source(args), _sync.connect(url, **options) as locks:
        remaining = None if deadline is None else max(0.0, deadline - _clock.now())
        lease = locks.lock(
            args.name,
            ttl=args.ttl,
            timeout=remaining,
            description=args.description or os.path.basename(cmd[0]),
            lock_delay=args.lock_delay,
        )
        try:
            token = lease.acquire()
        except LockTimeout:
            if not args.quiet:
                _say(f"lock: {args.name!r} not acquired within {args.timeout:g} s")
            return int(args.conflict_exit_code)
        try:
            code = _run_holding(
                lease, str(token), cmd, args.grace, args.new_session, _to_verify(args, key)
            )
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


def _to_verify(args: argparse.Namespace, key: Any) -> dict[str, str]:
    """What a nested `fenced write` or `check-token` needs to verify the command's token and
    ask its source, none of it secret: the source id its signature is bound to (--source-id,
    which the command would not see otherwise), an Ed25519 key's public line unless
    $FENCED_VERIFY_KEY is set (an HMAC key is never handed down: it signs too), and --url
    when it holds no secret (--url-file is not: give $FENCED_URL_FILE on purpose)."""
    from .._core.backend import redacted
    from .._core.signing import Ed25519SigningKey, key_text

    env: dict[str, str] = {}
    if args.url and redacted(args.url) == args.url:
        env["FENCED_URL"] = args.url
    if key is None:
        return env
    source_id = _source_id(args)
    if source_id:
        env["FENCED_SOURCE_ID"] = source_id
    if isinstance(key, Ed25519SigningKey) and not os.environ.get("FENCED_VERIFY_KEY"):
        env["FENCED_VERIFY_KEY"] = key_text(key.public()).strip()
    return env


def _run_holding(
    lease: _sync.Lease,
    token: str,
    cmd: list[str],
    grace: float,
    new_session: bool = False,
    to_verify: dict[str, str] | None = None,
) -> int:
    env = child_environment(
        os.environ, **(to_verify or {}), FENCING_TOKEN=token, FENCED_LOCK=lease.name
    )
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
