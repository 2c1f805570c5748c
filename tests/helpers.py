"""Small test helpers: bounded waits on conditions (never a fixed sleep as synchronisation)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

# A bound for waiting on a Python process to start and get going (its interpreter start and
# imports): ~0.3 s quiet, 2-8 s seen on CI's loaded 2 cores. It is for a hang, not speed.
PROCESS_START = 60.0


# One TLS context for the tests' own HTTP calls (verify=TLS): httpx.get/post/stream build a
# client per call, and each client its own context from certifi's bundle (~30-40 ms of CPU;
# ~1 ms given this one). The calls still open a connection each, as before.
TLS = ssl.create_default_context()

# PyMySQL's default TLS mode ("preferred") builds a verifying SSL context for every connection,
# reading the system's CA bundle (~30 ms of CPU), before it learns that the server offers no
# TLS: the test MariaDB serves none (loopback). Its connections say so up front; asyncmy takes
# no such argument (nor builds a context): asyncmy_args() leaves it out.
NO_TLS: dict[str, Any] = {"ssl_disabled": True}


def asyncmy_args(pymysql_args: dict[str, Any]) -> dict[str, Any]:
    """``pymysql_args`` (a ``mysql_db``) as asyncmy's ``connect`` takes them."""
    return {k: v for k, v in pymysql_args.items() if k not in NO_TLS}


def write_key_file(path: Path, key: Any) -> Path:
    """``key``'s key file, as ``fenced keygen`` writes it: mode 0600 (a secret key file that
    other users may read is refused, and the default umask gives 0644)."""
    from fenced._core.signing import key_text

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        os.fchmod(f.fileno(), 0o600)  # (a file that was there keeps its mode otherwise)
        f.write(key_text(key))
    return path


def unique_name(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def forged(signed: str) -> str:
    """``signed`` with one signature character changed, still canonical base64url.

    Changing the *first* character keeps the text a well-formed signature that fails
    to verify; changing the last one could leave stray low bits (a *malformed*
    signature instead, a different error: 1 run in 256 once got that).
    """
    head, _, sig = signed.rpartition(".")
    return f"{head}.{'B' if sig[0] == 'A' else 'A'}{sig[1:]}"


@contextlib.contextmanager
def dead_port() -> Iterator[int]:
    """A loopback port that refuses connections for as long as the block runs.

    Bound here and never listened on: a connection is refused, and no other process can
    bind it meanwhile. ``free_port()`` lets go of its port at once, so another xdist
    worker's server (a Redis, an etcd) could start on it before the test's "nobody is
    there" connection, which then reached a real server.
    """
    with socket.socket() as s:  # (no SO_REUSEADDR: a server's bind with it fails too)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def wait_for(
    predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` until truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


async def async_wait_for(
    predicate: Callable[[], Awaitable[object]], timeout: float = 10.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


ROOT = Path(__file__).resolve().parent.parent


def spawn_python(code: str, *args: str) -> subprocess.Popen[str]:
    """A real client process running ``code`` (with fenced and the tests importable)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def read_line(proc: subprocess.Popen[str]) -> str:
    """The process's next line of output; fails the test (with its stderr) if it has none."""
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        assert proc.stderr is not None
        proc.kill()
        raise AssertionError(f"client process said nothing; stderr:\n{proc.stderr.read()}")
    return line


_PAUSED_HOLDER = """
import json, sys, fenced
url, options, name, ttl = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], float(sys.argv[4])
with fenced.connect(url, **options) as locks:
    lease = locks.lock(name, ttl=ttl, timeout=30)
    print("token", lease.acquire().value, flush=True)
    lost = lease.lost.wait(60)
    print("lost", type(lease.lost_cause).__name__ if lost else None, flush=True)
    try:
        lease.renew()
        print("renew ok", flush=True)
    except fenced.LeaseLostError:
        print("renew LeaseLostError", flush=True)
    print("release", lease.release(), flush=True)
"""


def check_paused_holder_is_fenced_off(
    url: str, *, ttl: float, acquire_timeout: float, **options: object
) -> None:
    """A holder process paused (SIGSTOP) past its ttl: the next holder gets a higher token, and
    the resumed one is told it lost the lease, cannot renew it, and cannot release the new grant.
    """
    import contextlib
    import json
    import signal

    import fenced

    name = unique_name()
    proc = spawn_python(_PAUSED_HOLDER, url, json.dumps(options), name, str(ttl))
    try:
        word, value = read_line(proc).split()
        assert word == "token"
        first = fenced.FencingToken(name, int(value))
        os.kill(proc.pid, signal.SIGSTOP)  # silent for longer than its ttl
        try:
            with fenced.connect(url, **options) as locks:
                lease = locks.lock(name, ttl=10)
                second = lease.acquire(timeout=acquire_timeout)
                assert second > first
                os.kill(proc.pid, signal.SIGCONT)
                assert read_line(proc) == "lost LeaseLostError"
                assert read_line(proc) == "renew LeaseLostError"
                assert read_line(proc) == "release False"
                # The stale holder's release did not touch the new grant.
                assert lease.held and locks.status(name).token == second
                assert lease.release() is True
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait()


T = TypeVar("T")


def bounded(fn: Callable[[], T], timeout: float = 5.0) -> T:
    """Run ``fn`` in a daemon thread; fail (instead of hanging the suite) if it does not return."""
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:
            out.append(("err", exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise AssertionError(f"call did not return within {timeout} s (hung)")
    kind, value = out[0]
    if kind == "err":
        raise value
    result: T = value
    return result


@contextlib.contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run the ASGI ``app`` in uvicorn on a free loopback port; yield its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), 20, "uvicorn to start")
        assert server.started
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


def pattern(value: int, size: int = 256 * 1024) -> bytes:
    """Recognisable data of ``size`` bytes for version ``value`` (a torn write shows)."""
    unit = f"<{value:019d}>".encode()
    return unit * (size // len(unit))


def chromium() -> str:
    """Chromium's path, or skip the test (``make test`` installs Debian's chromium as root)."""
    import shutil

    import pytest

    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium (make test installs Debian's chromium when run as root)")


# What a test's headless Chromium does not need, off: Chromium 156's new headless mode still
# builds and keeps the browser UI's own WebUI pages (the omnibox popup: a renderer of its
# own, ~0.5-0.9 s of CPU a browser, and more while a page is open), and its background
# services (component updates, extensions, network pings). Measured: a browser that opens one
# page and closes, 1.8 -> 1.4 s of CPU (cgroup, every process); one that keeps the
# dashboard open 10 s, 3.7-4.3 -> 3.0 s. (Chromium keeps only the last --disable-features: a
# caller's own must repeat these.)
CHROMIUM_LEAN = (
    "--disable-features=PreloadTopChromeWebUI,WebUIOmniboxPopup,WebUIOmniboxAimPopup,"
    "WebUIOmniboxFullPopup,Translate,OptimizationHints,MediaRouter",
    "--disable-extensions",
    "--disable-component-update",
    "--disable-background-networking",
    "--disable-sync",
    "--disable-default-apps",
    "--no-first-run",
)


def headless(*args: str, budget_ms: int = 0) -> str:
    """Run headless Chromium with ``args`` (``--dump-dom URL``, ``--screenshot=F URL``...);
    its stdout. ``budget_ms``: virtual time for the page's scripts before the DOM is taken."""
    budget = [f"--virtual-time-budget={budget_ms}"] if budget_ms else []
    out = subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            *CHROMIUM_LEAN,
            *budget,
            *args,
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout


@functools.cache
def _aio_session() -> Any:
    """One aiobotocore session per process, as boto3's default session: a new session
    loads and parses the service's JSON model again (~80 ms of CPU a client, against ~5 ms
    from a session that has it), and the guard conformance files make hundreds of clients.
    A session holds no loop or connection (each client has its own), so sharing is safe."""
    from aiobotocore.session import get_session

    return get_session()


def aio_aws_client(kind: str, endpoint: str, *, dead: bool = False) -> Any:
    """The aiobotocore twin of :func:`aws_client`: an async context manager giving the client."""
    from aiobotocore.config import AioConfig

    config = AioConfig(connect_timeout=1, retries={"max_attempts": 1}) if dead else None
    return _aio_session().create_client(
        kind,
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        config=config,
    )


def aws_client(kind: str, endpoint: str, *, dead: bool = False) -> Any:
    """A boto3 client ("dynamodb", "s3") for moto's emulator at ``endpoint`` (test
    credentials); ``dead``: one try, a 1 s connect timeout, for an endpoint nobody serves."""
    import boto3

    extra: dict[str, Any] = {}
    if dead:
        extra["config"] = boto3.session.Config(connect_timeout=1, retries={"max_attempts": 1})
    return boto3.client(
        kind,
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
        **extra,
    )
