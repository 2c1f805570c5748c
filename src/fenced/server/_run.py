"""Running the app: uvicorn on a socket bound here (so ``--listen 127.0.0.1:0`` can report the
port it got), TLS by uvicorn's own options, logs as text or JSON lines."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import ipaddress
import json
import logging
import socket
import sys
import time
from typing import Any

from .._core.errors import ConfigurationError, FencedError
from .._core.portal import mark_private
from ._app import ServerSettings, create_app
from ._http import http_protocol

__all__ = ["parse_listen", "serve"]


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:7400`` for IPv6) or ``PORT`` alone (loopback)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not 0 <= number <= 65535:
        raise ConfigurationError(f"--listen: expected HOST:PORT, not {text!r}")
    return host, number


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Seconds:
    """A second's date and time, formatted once for all the lines of that second (a busy
    server writes two lines a grant)."""

    __slots__ = ("_convert", "_form", "_second", "_text")

    def __init__(self, form: str, convert: Any) -> None:
        self._form, self._convert = form, convert
        self._second, self._text = -1, ""

    def __call__(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._second, self._text = second, time.strftime(self._form, self._convert(second))
        return self._text


def _millis(created: float) -> int:
    return int((created - int(created)) * 1000)  # (as LogRecord.msecs)


class _TextLines(logging.Formatter):
    """``%(asctime)s %(levelname)s %(name)s: %(message)s``, logging's default time form."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._seconds = _Seconds("%Y-%m-%d %H:%M:%S", time.localtime)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return f"{self._seconds(record.created)},{int(record.msecs):03d}"

    def line(self, created: float, level: str, name: str, message: str) -> str:
        """What ``format`` makes of a record with these, and no exception."""
        return f"{self._seconds(created)},{_millis(created):03d} {level} {name}: {message}"


class _JsonLines(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._seconds = _Seconds("%Y-%m-%dT%H:%M:%S", time.gmtime)

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": f"{self._seconds(record.created)}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info).splitlines()[-1]
        return json.dumps(out)

    def line(self, created: float, level: str, name: str, message: str) -> str:
        """What ``format`` makes of a record with these, and no exception."""
        return json.dumps(
            {
                "time": f"{self._seconds(created)}.{_millis(created):03d}Z",
                "level": level.lower(),
                "logger": name,
                "message": message,
            }
        )


class _PerTurnHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Log lines to stderr, written once per turn of the event loop for all the lines the
    turn made (at once where no loop runs). stderr writes each line as it comes: one system
    call per grant and per release was a quarter of a busy server's CPU at the default log
    level. A line waits at most for the turn that made it to end; only fenced's own lines
    below warning wait (the transitions): any other line — uvicorn's, among them its last,
    written just before it re-raises SIGTERM — goes out at once, with those before it."""

    def __init__(self, fd: int | None = None) -> None:
        raw = io.FileIO(sys.stderr.fileno() if fd is None else fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            io.BufferedWriter(raw, 1 << 16), encoding="utf-8", errors="backslashreplace"
        )
        super().__init__(stream)
        self._pending = False
        self._may_wait = False

    def emit(self, record: logging.LogRecord) -> None:
        self._may_wait = record.levelno < logging.WARNING and record.name.startswith("fenced")
        super().emit(record)

    def flush(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or not self._may_wait:
            super().flush()
            return
        if not self._pending:
            self._pending = True
            loop.call_soon(self.flush_now)

    def flush_now(self) -> None:
        self._pending = False
        super().flush()

    def info_line(self, logger: logging.Logger, message: str) -> None:
        """``logger.info("%s", message)`` where ``logger``'s lines come only to this handler
        through its parent, with no filter on the way (as ``setup_logging`` sets fenced's):
        the same line, without a LogRecord and the logging machinery around it — a busy
        server logs two transitions a grant. Anything else goes through ``logger.info``."""
        if not logger.isEnabledFor(logging.INFO):
            return
        parent = logger.parent
        formatter = self.formatter
        if (
            logger.handlers
            or logger.filters
            or not logger.propagate
            or parent is None
            or len(parent.handlers) != 1
            or parent.handlers[0] is not self
            or parent.filters
            or parent.propagate
            or self.filters
            or self.level > logging.INFO
            or not isinstance(formatter, _OWN_FORMATS)  # (a tuple: ``X | Y`` is made per call)
        ):
            logger.info("%s", message)
            return
        created = time.time()
        with self.lock:  # type: ignore[union-attr]  # (the formatter's second: one at a time)
            try:
                line = formatter.line(created, "INFO", logger.name, message)
                self.stream.write(line + self.terminator)
            except Exception:  # (as emit: a broken stream is reported, never raised)
                self.handleError(logging.makeLogRecord({"msg": message}))
                return
            self._may_wait = logger.name.startswith("fenced")
            self.flush()


_OWN_FORMATS = (_TextLines, _JsonLines)


def setup_logging(fmt: str, level: str = "info") -> _PerTurnHandler:
    """Send fenced's and uvicorn's lines to stderr as ``fmt`` says; returns the handler."""
    handler = _PerTurnHandler()
    handler.setFormatter(_JsonLines() if fmt == "json" else _TextLines())
    # No line shows the caller's file, thread or process: a record need not look them up
    # (the logging HOWTO's "Optimization"; the process is the server's).
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    for name in ("fenced", "uvicorn.error", "uvicorn.access"):
        log = logging.getLogger(name)
        log.handlers[:] = [handler]
        # (uvicorn writes access lines only with --access-log: asked for, they are written
        # whatever the level; without a handler here they went nowhere — uvicorn's own
        # log config is off — and --access-log printed nothing)
        log.setLevel("INFO" if name == "uvicorn.access" else level.upper())
        log.propagate = False
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _QuotedTarget) for f in access.filters):
        access.addFilter(_QuotedTarget())
    return handler


class _QuotedTarget(logging.Filter):
    """uvicorn's access line quotes the request (``"GET /path?query HTTP/1.1"``) with the
    query string as the client sent it: a ``"`` there (which HTTP parsers pass) closed the
    quoted field early, and the rest of the query read as more fields of the line. The
    target's quote and backslash are written percent-encoded, as they would be in a URL."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            target = args[2]
            if '"' in target or "\\" in target:
                target = target.replace("\\", "%5C").replace('"', "%22")
                record.args = (*args[:2], target, *args[3:])
        return True


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket whose connections send small answers at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP;
    # without it every answer of two writes waited 40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    return sock


def raise_file_limit() -> int:
    """Let this process open as many files as its hard limit allows, and return the limit.

    Each client holds a connection (keep-alive, long polls), and a soft limit of 1,024 — the
    usual login default — would refuse the 1,000th; Go's runtime raises it the same way for
    etcd and Consul. Only the soft limit moves, never past the hard one."""
    try:
        import resource
    except ImportError:  # (Windows: no such limit)
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (OSError, ValueError):  # (e.g. over the kernel's nr_open): keep what we have
        return soft
    return wanted


def serve(
    settings: ServerSettings,
    host: str,
    port: int,
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    log_format: str = "text",
    log_level: str = "info",
    access_log: bool = False,
    graceful: int = 5,
    forwarded_allow_ips: str | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT. In-flight requests get ``graceful`` seconds; waiting
    acquires are answered 503 at once; held leases are left to expire. ``X-Forwarded-For``
    and ``-Proto`` are believed only from ``forwarded_allow_ips`` (uvicorn's syntax), by
    default from no one."""
    import uvicorn

    handler = setup_logging(log_format, log_level)
    raise_file_limit()
    sock = listen_socket(host, port)
    bound = sock.getsockname()[1]
    app = create_app(settings)
    # The transitions (two lines a grant) straight to the handler (see _PerTurnHandler.info_line).
    app.state.gateway.transition_line = functools.partial(
        handler.info_line, logging.getLogger("fenced.server")
    )
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=access_log,
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
        timeout_graceful_shutdown=graceful,
        lifespan="on",
        # X-Forwarded-For names the client (its owner, its per-client bounds) only from the
        # proxies the operator names: uvicorn trusts 127.0.0.1 by default, and then any local
        # process could claim any address and get past --max-waiting-per-client.
        proxy_headers=forwarded_allow_ips is not None,
        forwarded_allow_ips=forwarded_allow_ips,
        # (httptools, bounding a request's head; answering the hot path itself)
        http=http_protocol(settings.read_timeout, getattr(app, "direct", None)),
    )
    server = uvicorn.Server(config)
    scheme = "https" if tls_cert else "http"
    shown = f"[{host}]" if ":" in host else host

    # Said once the app has started (the source is open), on stderr, for people and scripts.
    original = server.startup
    not_opened: list[FencedError] = []
    gateway = app.state.gateway

    async def startup(sockets: list[socket.socket] | None = None) -> None:
        # Only fenced's code runs on this loop: the SQLite source may commit there, once per
        # turn of the loop for every write the turn gathered (no worker thread to wait for).
        mark_private(asyncio.get_running_loop(), commit_per_turn=True)
        # The source is opened here, before uvicorn's lifespan (whose start then finds it
        # open): a source that cannot be opened (down, a bad path, refused credentials) is
        # raised after the loop as fenced's typed error, one line and the CLI's exit code,
        # not uvicorn's traceback of its lifespan and exit 3.
        try:
            await gateway.start()
        except FencedError as exc:
            not_opened.append(exc)
            with contextlib.suppress(Exception):
                await gateway.stop()
            server.should_exit = True
            return
        await original(sockets=sockets)
        for handler in logging.getLogger("fenced").handlers:  # (the lines before it first)
            if isinstance(handler, _PerTurnHandler):
                handler.flush_now()
        if server.started:
            print(
                f"fenced serve: listening on {scheme}://{shown}:{bound}",
                file=sys.stderr,
                flush=True,
            )

    server.startup = startup  # type: ignore[method-assign]

    # On SIGTERM/SIGINT, long polls (acquires, watches) end at once with 503 instead of
    # holding the shutdown for the grace period; the lifespan then closes the source.
    handle_exit = server.handle_exit

    def on_exit(sig: int, frame: Any) -> None:
        handle_exit(sig, frame)
        loop = gateway.loop
        if loop is not None:
            loop.call_soon_threadsafe(gateway.stopping.set)

    server.handle_exit = on_exit  # type: ignore[method-assign]
    server.run(sockets=[sock])
    if not_opened:
        raise not_opened[0]
    if not server.started:
        raise SystemExit(70)
