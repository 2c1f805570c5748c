"""The hot path's shape (issue 28 §1): what makes ``fenced serve`` cheaper per grant, each
property checked on real objects (a real event loop, real sockets and pipes)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from pathlib import Path

import httpx
import pytest

from fenced.server._app import ServerSettings, create_app
from fenced.server._http import _Coalescing
from fenced.server._run import _PerTurnHandler


class _Counting(asyncio.Transport):
    """A real socket transport's writes, counted (the transport itself does the writing)."""

    def __init__(self, inner: asyncio.Transport) -> None:
        super().__init__()
        self.inner, self.writes = inner, 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes += 1
        self.inner.write(data)

    def is_closing(self) -> bool:
        return self.inner.is_closing()

    def close(self) -> None:
        self.inner.close()


async def test_an_answer_written_in_parts_leaves_in_one_write() -> None:
    """uvicorn writes an answer's head and body apart: two packets and two wake-ups of the
    client. Written in one turn of the loop, they leave in one write, in order; close()
    sends what is held before closing."""
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    transport, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
    counting = _Counting(transport)
    out = _Coalescing(counting, loop)
    out.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    out.write(b"{}")
    assert counting.writes == 0  # (held until the turn ends)
    await asyncio.sleep(0)  # (one turn of the loop, not a wait for time)
    assert counting.writes == 1
    out.write(b"last")
    out.close()  # (held bytes first)
    assert counting.writes == 2
    theirs.setblocking(False)
    got = b""
    async with asyncio.timeout(30):  # (a bound, not a wait: it ends at the close)
        while piece := await loop.sock_recv(theirs, 65536):
            got += piece
    theirs.close()
    assert got == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}last"


async def test_transition_lines_leave_once_per_turn_and_others_at_once() -> None:
    """Each grant and release logs a line at the default level; written one system call
    each, they were a quarter of a busy server's CPU. fenced's info lines made in one turn
    leave together when it ends; any other line (uvicorn's last one before it re-raises
    SIGTERM, a warning) at once, with those before it."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    handler = _PerTurnHandler(w)
    handler.setFormatter(logging.Formatter("%(message)s"))

    def read() -> bytes:
        try:
            return os.read(r, 65536)
        except BlockingIOError:
            return b""

    def record(name: str, level: int, msg: str) -> logging.LogRecord:
        return logging.LogRecord(name, level, __file__, 1, msg, None, None)

    try:
        for i in range(3):
            handler.handle(record("fenced.server", logging.INFO, f"granted {i}"))
        assert read() == b""
        await asyncio.sleep(0)  # (the turn ends)
        assert read() == b"granted 0\ngranted 1\ngranted 2\n"
        handler.handle(record("fenced.server", logging.INFO, "released"))
        handler.handle(record("uvicorn.error", logging.INFO, "Application shutdown complete."))
        assert read() == b"released\nApplication shutdown complete.\n"
        handler.handle(record("fenced.server", logging.WARNING, "refused"))
        assert read() == b"refused\n"
    finally:
        handler.close()
        os.close(r)
        os.close(w)


@pytest.mark.asyncio
async def test_the_hot_path_is_answered_before_the_middleware_stack(tmp_path: Path) -> None:
    """acquire and release of a well-formed request are answered by the fast lane in front
    of Starlette's middleware stack (never built while only they come); anything else goes
    through the whole stack and is answered as FastAPI answers it."""
    app = create_app(ServerSettings(url=f"sqlite:///{tmp_path / 'locks.db'}"))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        for _ in range(3):
            g = (await client.post("/v1/locks/a/-/acquire", json={"ttl": 30})).json()
            r = await client.post(
                "/v1/locks/a/-/release",
                json={"token": g["token"], "request_id": g["request_id"]},
            )
            assert r.json() == {"released": True}
            assert r.headers["content-type"] == "application/json"
            assert int(r.headers["content-length"]) == len(r.content)
        assert app.middleware_stack is None  # (the stack was never needed)
        bad = await client.post("/v1/locks/a/-/acquire", json={"ttl": "thirty"})
        assert bad.status_code == 400 and bad.json()["error"] == "invalid_request"
        assert app.middleware_stack is not None
        metrics = (await client.get("/metrics")).text
    counts = [
        line
        for line in metrics.splitlines()
        if line.startswith("fenced_request_seconds_count")
        and 'route="/v1/locks/{name:lock}/-/acquire"' in line
    ]
    assert counts and float(counts[0].split()[-1]) == 4.0, counts  # (both paths timed)
    assert json.loads(json.dumps(g))["lock"] == "a"


@pytest.mark.asyncio
async def test_the_dashboard_has_an_icon_and_names_its_tile_truly(tmp_path: Path) -> None:
    """Issue 29 §4: a browser asks for /favicon.ico on every load (a 404 was a console error
    each time); the tile of fenced_leases_tracked counts the grants this gateway tracks, not
    renewals."""
    app = create_app(ServerSettings(url=f"sqlite:///{tmp_path / 'locks.db'}"))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        icon = await client.get("/favicon.ico")
        assert icon.status_code == 200, icon.text
        assert icon.headers["content-type"] == "image/svg+xml"
        assert icon.content.startswith(b"<svg") and icon.content.endswith(b"</svg>")
        page = (await client.get("/")).text
        assert '<link rel="icon" type="image/svg+xml" href="/favicon.ico">' in page
        assert "grants tracked by this gateway" in page and "renewed here" not in page
        assert "/favicon.ico" not in (await client.get("/openapi.json")).json()["paths"]


async def test_a_head_that_comes_whole_costs_no_timer_and_a_slow_one_is_still_refused() -> None:
    """The head's read timeout was a timer armed at each request's first byte and cancelled
    at its blank line (a timer per request on the hot path). It is armed only when a read
    ends with a head begun and not ended: requests whose head comes whole in one read cost
    none; a head cut short on a kept-alive connection is still refused with 408 in time."""
    import time

    import uvicorn

    from fenced.server._http import http_protocol
    from fenced.server._run import listen_socket

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        assert scope["type"] == "http"
        head = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", b"2")],
        }
        await send(head)  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    limit = 0.75  # (the head's bound: uvicorn's own timers use other delays)
    loop = asyncio.get_running_loop()
    armed = 0
    call_later = loop.call_later

    def counting(delay: float, *args: object, **kwargs: object) -> asyncio.TimerHandle:
        nonlocal armed
        armed += delay == limit
        return call_later(delay, *args, **kwargs)  # type: ignore[arg-type]

    config = uvicorn.Config(app, log_config=None, lifespan="off", http=http_protocol(limit))
    server = uvicorn.Server(config)
    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    loop.call_later = counting  # type: ignore[method-assign]
    try:
        async with asyncio.timeout(30):
            while not server.started:
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(5):
                writer.write(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 "), head
                assert await reader.readexactly(2) == b"ok"
            assert armed == 1, armed  # (the connection's opening only)
            writer.write(b"GET /x HTTP/1.1\r\nhost:")  # (and nothing more)
            started = time.monotonic()
            reply = await reader.read()  # (until the server closes the connection)
            took = time.monotonic() - started
            writer.close()
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        assert armed == 2 and limit * 0.9 < took < limit + 5, (armed, took)
    finally:
        loop.call_later = call_later  # type: ignore[method-assign]
        server.should_exit = True
        await serving


@pytest.mark.asyncio
async def test_the_gauges_are_read_when_scraped_not_set_per_grant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fenced_acquires_waiting and fenced_leases_tracked were set (a lock taken each time)
    three times per acquire and once per release; they are now read when scraped, and say
    the same: an acquire waiting, the grants this gateway tracks."""
    from prometheus_client import values

    sets = 0
    real_set = values.MutexValue.set

    def counted_set(self: values.MutexValue, value: float, *a: object) -> None:
        nonlocal sets
        sets += 1
        real_set(self, value, *a)

    app = create_app(ServerSettings(url=f"sqlite:///{tmp_path / 'locks.db'}"))
    transport = httpx.ASGITransport(app=app)

    def gauge(text: str, name: str) -> float:
        return float(next(ln.split()[1] for ln in text.splitlines() if ln.startswith(name + " ")))

    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        monkeypatch.setattr(values.MutexValue, "set", counted_set)
        g = (await client.post("/v1/locks/a/-/acquire", json={"ttl": 30})).json()
        assert sets == 0, sets
        text = (await client.get("/metrics")).text
        assert gauge(text, "fenced_leases_tracked") == 1
        assert gauge(text, "fenced_acquires_waiting") == 0
        waiting = asyncio.ensure_future(
            client.post("/v1/locks/a/-/acquire", json={"ttl": 30, "timeout": 30})
        )
        async with asyncio.timeout(30):  # (a bound: the waiter shows once it is queued)
            while gauge((await client.get("/metrics")).text, "fenced_acquires_waiting") != 1:
                await asyncio.sleep(0.01)
        r = await client.post(
            "/v1/locks/a/-/release", json={"token": g["token"], "request_id": g["request_id"]}
        )
        assert r.json() == {"released": True}
        second = (await asyncio.wait_for(waiting, 30)).json()
        text = (await client.get("/metrics")).text
        assert gauge(text, "fenced_acquires_waiting") == 0
        assert gauge(text, "fenced_leases_tracked") == 1  # (the second grant)
        await client.post(
            "/v1/locks/a/-/release",
            json={"token": second["token"], "request_id": second["request_id"]},
        )
        assert gauge((await client.get("/metrics")).text, "fenced_leases_tracked") == 0
        assert sets == 0, sets


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_transition_line_is_written_as_before_without_looking_up_its_caller(
    fmt: str, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two lines a grant at the default level: each walked the stack for its caller's file
    and line, looked up the thread and process, and formatted its second's date and time,
    none of which a line of `fenced serve` shows. The lines read as they did."""
    import re

    from fenced.server._run import setup_logging

    walks = 0
    real_find = logging.Logger.findCaller

    def counted_find(self: logging.Logger, *a: object, **kw: object) -> object:
        nonlocal walks
        walks += 1
        return real_find(self, *a, **kw)  # type: ignore[arg-type]

    saved = {n: getattr(logging, n) for n in ("_srcfile", "logThreads", "logProcesses")}
    saved["logMultiprocessing"] = logging.logMultiprocessing
    loggers = [logging.getLogger(n) for n in ("fenced", "uvicorn.error")]
    kept = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    monkeypatch.setattr(logging.Logger, "findCaller", counted_find)
    try:
        setup_logging(fmt, "info")
        log = logging.getLogger("fenced.server")
        for token in (7, 8):  # (the same second's date and time, or the next one's)
            log.info("%s lock=%s token=%s owner=%s", "granted", "jobs/a", token, "-")
        for lg in loggers:
            for h in lg.handlers:
                h.flush()
    finally:
        for lg, (handlers, level, propagate) in zip(loggers, kept, strict=True):
            lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
        for name, value in saved.items():
            setattr(logging, name, value)
    lines = capfd.readouterr().err.splitlines()[-2:]
    assert walks == 0, walks
    for line, token in zip(lines, (7, 8), strict=True):
        message = f"granted lock=jobs/a token={token} owner=-"
        if fmt == "text":
            stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
            assert re.fullmatch(rf"{stamp} INFO fenced\.server: {re.escape(message)}", line), line
        else:
            out = json.loads(line)
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", out.pop("time")), line
            assert out == {"level": "info", "logger": "fenced.server", "message": message}


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_transition_written_straight_to_the_handler_reads_as_through_logging(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fenced serve` writes its transitions (two a grant) straight to its own handler,
    without a LogRecord and the logging machinery around it: the line is the one
    ``logger.info`` writes through the same handler; the logger's level still decides; a
    filter on the way sends the line through ``logger.info`` (which applies it)."""
    import re

    from fenced.server._run import setup_logging

    r, w = os.pipe()
    os.set_blocking(r, False)
    saved = {
        n: getattr(logging, n)
        for n in ("_srcfile", "logThreads", "logProcesses", "logMultiprocessing")
    }
    loggers = [logging.getLogger(n) for n in ("fenced", "uvicorn.error")]
    kept = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    records = 0
    real_init = logging.LogRecord.__init__

    def counted_init(self: logging.LogRecord, *a: object, **kw: object) -> None:
        nonlocal records
        records += 1
        real_init(self, *a, **kw)  # type: ignore[arg-type]

    try:
        handler = setup_logging(fmt, "info")
        handler.setStream(os.fdopen(w, "w", closefd=False))  # (a pipe for stderr)
        log = logging.getLogger("fenced.server")
        log.info("%s lock=%s token=%s owner=%s", "released", "jobs/a", 7, "-")
        monkeypatch.setattr(logging.LogRecord, "__init__", counted_init)
        handler.info_line(log, "released lock=jobs/a token=7 owner=-")
        assert records == 0
        logging.getLogger("fenced").setLevel(logging.WARNING)
        handler.info_line(log, "granted lock=jobs/a token=8 owner=-")  # (not written)
        logging.getLogger("fenced").setLevel(logging.INFO)
        handler.addFilter(lambda rec: "token=9" not in rec.getMessage())
        handler.info_line(log, "granted lock=jobs/a token=9 owner=-")  # (filtered out)
        handler.info_line(log, "granted lock=jobs/a token=10 owner=-")
        assert records == 2  # (both through logging: the filter applies)
        handler.flush()
        written = os.read(r, 65536).decode().splitlines()
    finally:
        monkeypatch.undo()
        for lg, (handlers, level, propagate) in zip(loggers, kept, strict=True):
            lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
        for name, value in saved.items():
            setattr(logging, name, value)
        os.close(r)
        os.close(w)
    assert len(written) == 3, written
    if fmt == "text":
        stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")
        assert [stamp.sub("", line) for line in written] == [
            "INFO fenced.server: released lock=jobs/a token=7 owner=-",
            "INFO fenced.server: released lock=jobs/a token=7 owner=-",
            "INFO fenced.server: granted lock=jobs/a token=10 owner=-",
        ], written
        assert all(stamp.match(line) for line in written)
    else:
        lines = [json.loads(line) for line in written]
        assert all(re.fullmatch(r"[\d-]{10}T[\d:]{8}\.\d{3}Z", x.pop("time")) for x in lines)
        assert (
            lines[0]
            == lines[1]
            == {
                "level": "info",
                "logger": "fenced.server",
                "message": "released lock=jobs/a token=7 owner=-",
            }
        )
        assert lines[2]["message"] == "granted lock=jobs/a token=10 owner=-"


_HOLD_WRITE_LOCK = (
    "import sqlite3, sys\n"
    "conn = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
    "conn.execute('BEGIN IMMEDIATE')\n"
    "print('held', flush=True)\n"
    "sys.stdin.readline()\n"
    "conn.execute('COMMIT')\n"
)


@pytest.mark.asyncio
async def test_the_servers_loop_never_sleeps_while_another_process_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server commits on its loop. When another process held the file's write lock (a
    second gateway, `fenced lock` on the same file), each attempt slept on that loop, up to
    50 ms at a time, and every other request of the server waited. It now pauses between
    attempts on the loop, which answers the others meanwhile; the try-once gives up after its
    one real attempt (0.25 s), and is granted once the other process has committed."""
    import subprocess
    import sys
    import threading
    import time

    from fenced._core.portal import mark_private
    from fenced.backends import _sqlite_executor

    mark_private(asyncio.get_running_loop(), commit_per_turn=True)  # (as fenced serve's)
    db = tmp_path / "locks.db"
    app = create_app(ServerSettings(url=f"sqlite:///{db}"))
    transport = httpx.ASGITransport(app=app)
    loop_thread = threading.get_ident()
    # (the SQLite source's transaction executor's sleeps, no one else's)
    backend_call = _sqlite_executor.TransactionExecutor.call.__code__
    asleep = 0
    real_sleep = time.sleep

    def counted_sleep(seconds: float) -> None:
        nonlocal asleep
        caller = sys._getframe(1).f_code
        asleep += threading.get_ident() == loop_thread and caller is backend_call
        real_sleep(seconds)

    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        assert (await client.get("/v1/locks/a")).status_code == 200  # (the file exists)
        monkeypatch.setattr(time, "sleep", counted_sleep)  # (the one time module)
        other = subprocess.Popen(
            [sys.executable, "-c", _HOLD_WRITE_LOCK, str(db)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert other.stdin is not None and other.stdout is not None
        try:
            assert other.stdout.readline() == "held\n"
            trying = asyncio.ensure_future(client.post("/v1/locks/a/-/acquire", json={}))
            answered_meanwhile = 0  # (the loop answers others while the acquire waits)
            while not trying.done() and answered_meanwhile < 20:
                assert (await client.get("/v1/health")).status_code == 200
                answered_meanwhile += not trying.done()
            assert answered_meanwhile > 0
            # a try-once gives up after its one real attempt (0.25 s) of a write-locked file
            refused = await asyncio.wait_for(trying, 30)
            assert refused.status_code == 409, refused.text
        finally:
            other.stdin.write("\n")
            other.stdin.flush()
            assert other.wait(30) == 0
        granted = await client.post("/v1/locks/a/-/acquire", json={})
        assert granted.status_code == 200 and granted.json()["value"] == 1, granted.text
    assert asleep == 0, asleep


def test_the_metrics_without_a_lock_expose_what_prometheus_client_exposes() -> None:
    """The hot path's histograms and counters take no lock and find a bucket by bisection:
    the same exposition as prometheus_client's own for the same observations — on every
    bucket bound exactly, between them, past the last, at 0, below it, inf and NaN."""
    import random

    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from fenced.server._metrics import _LATENCY, Metrics

    ours = Metrics()
    registry = CollectorRegistry()
    theirs = Histogram(
        "fenced_request_seconds", "x", ["route", "method"], buckets=_LATENCY, registry=registry
    )
    grants = Counter("fenced_grants", "x", registry=registry)
    rng = random.Random(7)
    values = [*_LATENCY, 0.0, -1.0, 31.0, 1e-9, float("inf"), float("nan")]
    values += [rng.random() * 40 for _ in range(500)]
    for value in values:
        for histogram in (ours.latency, theirs):
            histogram.labels("/v1/locks/{name:lock}/-/acquire", "POST").observe(value)
        ours.grants.inc()
        grants.inc()

    def samples(text: bytes, prefixes: tuple[str, ...]) -> list[str]:
        return sorted(
            line
            for line in text.decode().splitlines()
            if line.startswith(prefixes) and "_created" not in line
        )

    wanted = ("fenced_request_seconds", "fenced_grants")
    assert samples(ours.render(), wanted) == samples(generate_latest(registry), wanted)
    assert len(samples(ours.render(), wanted)) == len(_LATENCY) + 4
    with pytest.raises(ValueError, match="missing label values"):
        ours.latency.observe(1.0)  # (a labelled metric's parent: as prometheus_client)
