"""What the commands share: exit statuses, the parser and its help layout, the types of
numbers on the command line, the token source's URL (--url, --url-file, $FENCED_URL,
$FENCED_URL_FILE) and --timeout, --source-id, the signing key, one-line errors and logging."""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn, TypeAlias

from .._core.backend import redacted
from .._core.errors import AccessDenied, BackendUnavailable, ConfigurationError, UnsafeBackendError
from .._core.paths import default_url, environment_url, read_url_file
from .._core.state import MAX_TIMEOUT, MAX_TTL, MIN_TTL, check_timeout, check_ttl

# argparse names no public type for what add_subparsers() returns
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

EXIT_USAGE = 2
EXIT_INVALID_TOKEN = 65  # EX_DATAERR: check-token: malformed, never issued, or not well signed
EXIT_REFUSED = 65  # EX_DATAERR: fenced group: a change refused for the group's state (safety)
EXIT_UNAVAILABLE = 69
EXIT_SOFTWARE = 70
EXIT_LEASE_LOST = 75
EXIT_INCONCLUSIVE = 75  # EX_TEMPFAIL: fenced check dealt a fault asked for no time: try longer
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
         hold), or the run was cut short by a part that died midway (run incomplete);
         fenced demo: the run did not behave as fencing should; check-token: the
         token is invalid: malformed, never issued by the source, or not well signed;
         fenced write: refused, the token is not well signed (unsigned, forged, of another
         source) where a key is given; nothing written;
         fenced group remove/add: the change was refused for safety (it would keep no member
         holding the acknowledged writes, or fewer than min_members); nothing changed
  69     the token source (fenced group: a member) could not be reached (EX_UNAVAILABLE)
  70     another fenced error (EX_SOFTWARE)
  75     the lease was lost while the command ran; the command was terminated (EX_TEMPFAIL);
         fenced elect: leadership no longer sure, or a poison pill: the command was stopped;
         fenced check: inconclusive, a fault asked for was never dealt (give it more --time)
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


def _whole(text: str, what: str, low: int, high: int, bounds: str) -> int:
    """A whole number from ``low`` to ``high``: else "not WHAT: 'text'" or "BOUNDS, not N"."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{bounds}, not {value}")
    return value


def _exit_code(text: str) -> int:
    return _whole(text, "an exit status", 0, 255, "an exit status is 0-255")


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
    return _whole(text, "a number of bytes", 1024, 1 << 30, "a body limit is 1024 bytes to 1 GiB")


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
    """An epilog's examples: tests/cli/test_cli_help.py runs every line that starts with
    ``fenced`` (in a temporary directory, on a temporary source), so none can go stale.
    ``# exit N`` after a command is the status it is expected to end with (default 0)."""
    return "examples:\n" + "".join(f"  {line}\n" for line in lines)


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


def _verbose() -> argparse.ArgumentParser:
    """-v also after the subcommand (fenced lock -v ...), without overriding one given before:
    the parent of the commands that take it."""
    common = _Parser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    return common


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


def key_file(value: str, flag: str, env: str) -> None:
    """Refuse a key's text given where a key file is expected: a command line is visible to
    every local user (``ps``, /proc/PID/cmdline), and the text may be the secret itself."""
    from .._core.signing import is_key_text

    if is_key_text(value):
        raise ConfigurationError(
            f"{flag} takes a key file, not the key itself (a command line is visible to every "
            f"local user): give its file, or the key's text in {env}"
        )


def _signing_key(args: argparse.Namespace) -> Any:
    """The key of --signing-key, else of $FENCED_SIGNING_KEY (None: tokens are not signed),
    read before the source is reached, so its errors are not taken for the source's."""
    from .._core.signing import read_key

    if args.signing_key:
        key_file(args.signing_key, "--signing-key", "$FENCED_SIGNING_KEY")
        return read_key(args.signing_key, "--signing-key", path_shown=True)
    if os.environ.get("FENCED_SIGNING_KEY"):
        with _named("$FENCED_SIGNING_KEY"):
            return read_key(os.environ["FENCED_SIGNING_KEY"], "$FENCED_SIGNING_KEY")
    return None


def verify_keys(args: argparse.Namespace) -> list[Any]:
    """The keys a command verifies tokens with (check-token, write): --verify-key FILE
    (repeatable), else $FENCED_VERIFY_KEY, else the public half of $FENCED_SIGNING_KEY's key;
    [] when none is given. Errors name the flag or the variable, never a key's text."""
    from .._core.signing import public_half, read_key, verify_key

    if args.verify_key:
        for path in args.verify_key:
            key_file(path, "--verify-key", "$FENCED_VERIFY_KEY")
        return [verify_key(path, "--verify-key", path_shown=True) for path in args.verify_key]
    if os.environ.get("FENCED_VERIFY_KEY"):
        with _named("$FENCED_VERIFY_KEY"):
            return [verify_key(os.environ["FENCED_VERIFY_KEY"], "$FENCED_VERIFY_KEY")]
    if os.environ.get("FENCED_SIGNING_KEY"):
        # (the source's own key, private or public: its public half verifies)
        with _named("$FENCED_SIGNING_KEY"):
            return [public_half(read_key(os.environ["FENCED_SIGNING_KEY"], "$FENCED_SIGNING_KEY"))]
    return []


def verify_key_arguments(parser: argparse.ArgumentParser, refused: str) -> None:
    """--verify-key FILE, --source-id, --accept-unbound: how a command verifies tokens."""
    parser.add_argument(
        "--verify-key",
        metavar="FILE",
        action="append",
        help="verify the token's signature with this key file first: an Ed25519 .pub or an "
        f"HMAC key (repeat for rotation); an unsigned, forged or foreign token then {refused} "
        "(default: $FENCED_VERIFY_KEY, else the key of $FENCED_SIGNING_KEY)",
    )
    _source_id_argument(parser)
    parser.add_argument(
        "--accept-unbound",
        action="store_true",
        help="with --source-id, also accept tokens signed before the source had an id (v1)",
    )


def verify_keyring(args: argparse.Namespace) -> Any:
    """The Keyring of :func:`verify_keys`, bound to --source-id (else $FENCED_SOURCE_ID) and
    --accept-unbound; None without a key (then --source-id and --accept-unbound, which would
    mean nothing, are refused)."""
    from .._core.signing import Keyring

    keys = verify_keys(args)
    source_id = _source_id(args)
    if keys and args.accept_unbound and not source_id:
        raise ConfigurationError(
            "--accept-unbound needs --source-id (or $FENCED_SOURCE_ID): a keyring without a "
            "source accepts unbound tokens only"
        )
    if not keys:
        if args.source_id or args.accept_unbound:  # ($FENCED_SOURCE_ID alone: nothing to check)
            raise ConfigurationError("--source-id and --accept-unbound need a key (--verify-key)")
        return None
    return Keyring(
        keys, source_id=source_id, accept_unbound=args.accept_unbound and bool(source_id)
    )


#: Secrets fenced reads from the environment that a command run by `fenced lock` or `fenced
#: elect` never gets: the signing key (it would sign any token: any lock, any value) and the
#: API key of fenced serve (it takes and releases locks). $FENCED_URL and $FENCED_VERIFY_KEY
#: are dropped only when they hold a secret (see :func:`child_environment`).
CHILD_SECRETS = ("FENCED_SIGNING_KEY", "FENCED_API_KEY")


def child_environment(base: Mapping[str, str], **extra: str) -> dict[str, str]:
    """The environment of a command fenced runs holding a lock: ``base`` and ``extra``
    without the source's secrets. The command gets its token, never the power to mint one
    or the source's credentials (nor do its children, its ``env`` dumps, a CI log): no
    $FENCED_SIGNING_KEY, no $FENCED_API_KEY, no $FENCED_URL holding a password or a secret
    query parameter (a URL without one is kept: a nested `fenced check-token` uses it; give
    a command that needs the credentials $FENCED_URL_FILE, kept), no $FENCED_VERIFY_KEY
    holding an HMAC key's text (it signs too; one naming a file or holding a .pub line is
    kept: a nested `fenced write` verifies with it)."""
    from .._core.signing import is_key_text, is_public_key_text

    env = {k: v for k, v in base.items() if k not in CHILD_SECRETS}
    url = env.get("FENCED_URL")
    if url is not None and redacted(url) != url:
        del env["FENCED_URL"]
    verify = env.get("FENCED_VERIFY_KEY")
    if verify is not None and is_key_text(verify) and not is_public_key_text(verify):
        del env["FENCED_VERIFY_KEY"]
    env.update(extra)
    return env


def _source_options(args: argparse.Namespace, key: Any) -> dict[str, Any]:
    """connect()'s signing options of a command that signs: the key, --source-id and
    --accept-unbound. Those two mean nothing without a key, and --accept-unbound nothing
    without a source id (an unbound keyring accepts only unbound tokens anyway): refused,
    not silently ignored ($FENCED_SOURCE_ID alone is shared configuration, and may be set
    where nothing signs)."""
    accept_unbound = bool(getattr(args, "accept_unbound", False))
    if key is None:
        if args.source_id or accept_unbound:
            given = "--source-id" if args.source_id else "--accept-unbound"
            raise ConfigurationError(
                f"{given} needs a signing key (--signing-key or $FENCED_SIGNING_KEY): "
                "without one, tokens are not signed"
            )
        return {}
    source_id = _source_id(args)
    if accept_unbound and source_id is None:
        raise ConfigurationError(
            "--accept-unbound needs --source-id (or $FENCED_SOURCE_ID): a source without an id "
            "signs and accepts unbound tokens only"
        )
    options: dict[str, Any] = {"signing_key": key, "source_id": source_id}
    if accept_unbound:
        options["accept_unbound"] = True
    return options


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


def _shared_source_url(args: argparse.Namespace, command: str) -> str:
    """The token source's URL (as :func:`_url` finds it) for a command whose lock must exclude
    other processes: refused, naming where the URL came from, if the source keeps its locks
    inside one process."""
    url = _url(args)
    with _from_source(args):
        _require_shared_source(url, command)
    return url


def _require_shared_source(url: str, command: str) -> None:
    """A lock held by a process of its own must exclude other processes: refuse a source
    whose locks live inside one process (memory://), where every `fenced lock` would hold."""
    from .._core.backend import backend_class

    if backend_class(url).process_local:
        raise ConfigurationError(
            f"{command}: {redacted(url)} keeps its locks inside one process, so it cannot "
            "exclude another process; use a shared source (sqlite:////path, etcd://, ...)"
        )


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
