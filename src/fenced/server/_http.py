"""uvicorn's HTTP protocol with bounds on a request's head (its request line and headers).

uvicorn's httptools protocol keeps whatever a client sends of a request's head until the
blank line that ends it, with no limit of its own (its h11 protocol has one, 16 KiB), and
waits for it for good: one connection sending headers without end would make the server hold
them all, and connections that send nothing, or a header every few seconds, would each be
held open for good. Here a head over ``MAX_HEAD_BYTES`` is answered ``431 Request Header
Fields Too Large``, and one not complete within the read timeout (counted from the
connection's opening or the request's first byte) ``408 Request Timeout``; the connection is
closed, before the app sees anything. (nginx allows 32 KiB of headers and waits 60 s, Node.js
16 KiB; a bearer key and the few headers a client of the API sends fit in well under 4 KiB.)
A body is bounded by the app (``_layers._BodyLimit``: its size and the same read timeout), and
uvicorn stops reading while the app has not taken what it has.

uvicorn writes an answer's head and its body in two writes: two packets (TCP_NODELAY) and two
wake-ups of the client per answer — on a loaded machine a wake-up can hand the core to the
client mid-answer. Here what a connection writes in one turn of the loop goes out in one
write at the end of the turn (``_Coalescing``).

The hot path — acquire, renew and release — is answered by the protocol itself where it can
(``direct``, the app's ``DirectLane``): such a request never becomes an ASGI request. The
protocol keeps it where uvicorn keeps a request's cycle (``_Request``, in its place in the
pipeline), builds no scope, no cycle and no task for it: one task per connection answers
these requests in turn, with uvicorn's flow control, keep-alive (one timer a connection,
looked at when it fires), ``Connection: close`` and HTTP/1.0, access line, and the
disconnect a waiting acquire watches for; its answer goes to the socket as one write, its
head built as uvicorn's ``send`` builds it. A request the lane is not sure of (its body not
whole with its head or by its turn, an ``Expect``, a bad body or key, another route) is
handed to the app as uvicorn would have handed it: its scope, its cycle, its task.
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from .._core import clock as _clock

__all__ = ["BODY_RECEIVED", "MAX_HEAD_BYTES", "MAX_PIPELINED", "READ_TIMEOUT", "http_protocol"]

logger = logging.getLogger("fenced.server")

MAX_HEAD_BYTES = 64 * 1024
MAX_PIPELINED = 64
"""Requests a connection may have sent ahead of their answers (HTTP/1.1 pipelining). uvicorn
parses a whole read (up to 256 KiB) at once and queues every request in it, and read again
after each answer: a client sending small requests without waiting made it queue without
end. Past this many the connection's other requests are dropped and it is closed once those
queued are answered (no client of the API pipelines; one that does sends a few)."""
READ_TIMEOUT = 30.0  # (the default of ``fenced serve --read-timeout``)

BODY_RECEIVED = "fenced.body_received"
"""A scope key this protocol sets once the request's body has arrived whole: reading it then
cannot wait, and the app's read timeout need not be armed (a timer per request)."""

_REFUSAL = b"request line and headers over %d bytes\n" % MAX_HEAD_BYTES


_CONNECTION_UPGRADE = re.compile(rb"(?im)^(connection:[^\r\n]*?)\bupgrade\b")


def _ignore_upgrade(data: bytes, head_end: int | None) -> bytes:
    """``data`` with the ``upgrade`` token blanked in a ``Connection`` header of the head.

    The service speaks HTTP/1.1 only, and a server may ignore an ``Upgrade`` (RFC 9110
    7.8); httptools does not: it stops at the head of such a request, and the body of a
    ``POST`` sent with ``Upgrade: h2c`` (as Java's HttpClient and ``curl --http2`` send)
    never reached the app. Blanking keeps every byte count (the head bound) as it was."""
    head = data if head_end is None else data[:head_end]
    blanked = _CONNECTION_UPGRADE.sub(lambda m: m.group(1) + b" " * 7, head)
    return blanked if head_end is None else blanked + data[head_end:]


Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
"""An answer: its status, its headers (lower case), its body."""


class Direct(Protocol):
    """What the protocol answers itself (``_layers.DirectLane``)."""

    def pick(self, path: str, headers: list[tuple[bytes, bytes]]) -> Any:
        """Something true for a POST (its head read) the lane may answer, else None."""

    def start(
        self,
        picked: Any,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        client: str | None,
        receive: Callable[[], Awaitable[Any]],
    ) -> Awaitable[Answer] | None:
        """The answer to come for a request picked, its whole body read; None: the app's."""

    def finished(self, picked: Any, since: float) -> None:
        """A request picked was answered (``since``: ``clock.now()`` at its start)."""


_DIRECT_PREFIX = b"/v1/locks/"  # (the paths the lane may take start so)


class _Request:
    """A request the direct lane may answer, kept by the protocol where uvicorn keeps a
    request's cycle (``protocol.cycle``, its pipeline): no ASGI scope, no cycle, no event,
    no task of its own. It is answered once it is the connection's first unanswered request
    and its body has arrived whole — else it goes to the app as uvicorn's own request."""

    __slots__ = (
        "body",
        "disconnected",
        "gone",
        "headers",
        "http_version",
        "keep_alive",
        "more_body",
        "path",
        "picked",
        "protocol",
        "query",
        "raw_path",
        "response_complete",
    )

    def __init__(
        self,
        protocol: Any,
        picked: Any,
        path: str,
        raw_path: bytes,
        query: bytes,
        http_version: str,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
    ) -> None:
        self.protocol, self.picked, self.headers = protocol, picked, headers
        self.path, self.raw_path, self.query = path, raw_path, query
        self.http_version, self.keep_alive = http_version, keep_alive
        self.body = b""
        self.more_body = True
        self.response_complete = self.disconnected = False
        self.gone: asyncio.Future[None] | None = None  # (made by a waiting acquire's watch)

    async def receive(self) -> dict[str, Any]:
        """As uvicorn's ``receive`` once the body is read: the client's leaving (a waiting
        acquire watches for it). Reading goes on meanwhile, to see the connection end."""
        if not self.disconnected and not self.response_complete:
            protocol = self.protocol
            protocol.flow.resume_reading()
            gone = self.gone
            if gone is None or gone.done():  # (a watch cancelled before left it cancelled)
                gone = self.gone = protocol.loop.create_future()
            await gone
        return {"type": "http.disconnect"}

    def lost(self) -> None:
        """The connection ended before the answer."""
        if not self.response_complete:
            self.disconnected = True
            if self.gone is not None and not self.gone.done():
                self.gone.set_result(None)


_SERVER_ERROR = (
    500,
    [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21")],
    b"Internal Server Error",
)  # (uvicorn's, when an app fails before answering; the connection closes)


def http_protocol(
    head_timeout: float = READ_TIMEOUT, direct: Direct | None = None
) -> type[asyncio.Protocol] | str:
    """The protocol class for ``uvicorn.Config(http=...)``: httptools with the bounds, or h11
    (which bounds a head's size, not its time) where httptools is not installed. ``direct``:
    the requests it answers without the ASGI app (see the module's doc)."""
    too_slow = b"request line and headers not received within %g s\n" % head_timeout
    try:
        import httptools
        from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
        from uvicorn.protocols.http.httptools_impl import (
            STATUS_LINE,
            HttpToolsProtocol,
            RequestResponseCycle,
        )
    except ImportError:  # (httptools comes with fenced[server]; without it, h11's 16 KiB)
        return "h11"

    class BoundedHeadProtocol(HttpToolsProtocol):
        """Counts a request's head as its bytes arrive, up to the blank line that ends it
        (never its body, nor a request after it), and refuses the request before the parser
        sees a read that takes the head past the bound — whether the head comes in many reads
        or, as on a busy server, in one. Answers the direct lane's requests itself
        (``_Request``); builds the ASGI scope and uvicorn's cycle for the others only."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True  # (a connection starts with a request's head)
            # A request has begun (its first byte, or the connection's opening): only then
            # does the head's time count. Between requests the next head's bytes are counted
            # (``_in_head``), but the time is the keep-alive's (uvicorn's) — or a long poll's.
            self._begun = True
            self._head_bytes = 0
            self._tail = b""  # the last bytes of the head so far: its end may span two reads
            self._head_timer: asyncio.TimerHandle | None = None
            # A read holds more than the head it began in when requests are pipelined: the
            # heads after the first are measured as the parser reads them (``_parsed``), and
            # one still unfinished at the read's end counts from where it began.
            self._parsed = 0
            self._begun_here = False
            self._dropping = False  # (past MAX_PIPELINED: the rest is read, and dropped)
            # The direct lane's requests: one task per connection answers them in turn
            # (``_serve``), woken by ``_wake``; ``_next`` is the one to answer, ``_current``
            # the one being answered, ``_pending`` one begun in this read (its body must
            # arrive whole in it, else it is the app's).
            self._worker: asyncio.Task[None] | None = None
            self._wake: asyncio.Future[None] | None = None
            self._next: _Request | None = None
            self._current: _Request | None = None
            self._pending: _Request | None = None
            # Keep-alive: one timer a connection, looked at when it fires (not one a request):
            # the connection has been idle since ``_idle_at`` (None: a request under way).
            self._idle_at: float | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            # (after uvicorn's flow control took the real transport: reading is not delayed)
            self.transport = _Coalescing(transport, self.loop)  # type: ignore[assignment]
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            if self._current is not None:
                self._current.lost()
            cycle: Any = self.cycle
            if type(cycle) is _Request:
                cycle.lost()
                self.cycle = None  # type: ignore[assignment]  # (uvicorn's part: its own)
            if self._wake is not None:  # (the worker ends)
                self._wake.set_result(None)
                self._wake = None
            if self.timeout_keep_alive_task is not None:
                self.timeout_keep_alive_task.cancel()
                self.timeout_keep_alive_task = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._dropping:
                return  # (the connection closes once what is queued is answered)
            self._idle_at = None  # (as uvicorn, which stops its keep-alive timer here)
            if self._in_head:
                seen = self._tail + data
                end = seen.find(b"\r\n\r\n")
                head_end = None if end < 0 else end + 4 - len(self._tail)  # (within data)
                self._head_bytes += len(data) if head_end is None else head_end
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse(
                        431, "Request Header Fields Too Large", _REFUSAL, "passed %d bytes"
                    )
                    return
                self._tail = seen[-3:]
                if b"pgrade" in data or b"PGRADE" in data:
                    data = _ignore_upgrade(data, head_end)
            self._begun_here = False
            try:  # (uvicorn's data_received, but its keep-alive timer)
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
                return
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
            pending = self._pending
            if pending is not None:  # (its body did not come whole with its head: the app's,
                self._pending = None  # which bounds its time)
                if not self.transport.is_closing():
                    self._to_app(pending)
            if self._in_head and self._begun_here and not self.transport.is_closing():
                # A head begun after another request's end in this read, not ended with it:
                # its bytes so far are at most those after the read's last blank line.
                end = data.rfind(b"\r\n\r\n")
                self._head_bytes = len(data) - (0 if end < 0 else end + 4)
                self._tail = data[-3:]
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._drop("a pipelined request's head passed %d bytes", MAX_HEAD_BYTES)
                    return
            if self._in_head and self._begun:  # (a head begun, not ended: its time counts)
                self._arm_head_timer()

        def on_message_begin(self) -> None:
            if self._dropping:
                return
            # (uvicorn's, but the scope: built once the head is read, if the app answers)
            self.url = b""
            self.expect_100_continue = False
            self.headers = []
            # The timer is armed after the read if the head is still incomplete then: a head
            # that comes whole in one read (nearly all) costs no timer.
            self._in_head = self._begun = self._begun_here = True
            self._parsed = 0

        def on_url(self, url: bytes) -> None:
            if not self._dropping:
                self._parsed += len(url)
                self.url += url

        def on_header(self, name: bytes, value: bytes) -> None:
            if not self._dropping:
                self._parsed += len(name) + len(value) + 4  # (": " and the line's end)
                name = name.lower()  # (uvicorn's on_header)
                if name == b"expect" and value.lower() == b"100-continue":
                    self.expect_100_continue = True
                self.headers.append((name, value))

        def on_headers_complete(self) -> None:
            if self._dropping:
                return
            self._in_head = False
            self._head_bytes, self._tail = 0, b""  # (the next request's head counts afresh)
            self._disarm_head_timer()
            if self._parsed > MAX_HEAD_BYTES:  # (a head that came whole after another)
                self._drop("a pipelined request's head passed %d bytes", MAX_HEAD_BYTES)
                return
            request = None
            if (
                direct is not None
                and self.url.startswith(_DIRECT_PREFIX)
                and not self.expect_100_continue  # (the app's receive sends "100 Continue")
                and self.limit_concurrency is None
                and self.parser.get_method() == b"POST"
                and not self.parser.should_upgrade()
            ):
                request = self._direct_request()
            if request is None:
                self.scope = self._scope()
                super().on_headers_complete()
            else:
                existing, self.cycle = self.cycle, request  # type: ignore[assignment]
                if existing is None or existing.response_complete:
                    self._pending = request  # (answered once its body is whole)
                else:  # (pipelined: answered in its turn, as uvicorn queues its own)
                    self.flow.pause_reading()
                    self.pipeline.appendleft((request, None))  # type: ignore[arg-type]
            if len(self.pipeline) > MAX_PIPELINED:
                self.pipeline.popleft()  # (this one: never answered)
                self._drop("over %d requests pipelined", MAX_PIPELINED)

        def _direct_request(self) -> _Request | None:
            """The request as the direct lane's, if it picks it (its path as uvicorn's
            scope would have it)."""
            assert direct is not None
            url = self.url
            if b"?" in url or b"%" in url or b"#" in url:
                parsed = httptools.parse_url(url)
                raw_path, query = parsed.path, parsed.query or b""
                path = raw_path.decode("ascii")
                if "%" in path:
                    path = urllib.parse.unquote(path)
            else:
                raw_path, query, path = url, b"", url.decode("ascii")
            path = self.root_path + path
            picked = direct.pick(path, self.headers)
            if picked is None:
                return None
            version = self.parser.get_http_version()
            keep_alive = version != "1.0" and self.parser.should_keep_alive()
            return _Request(self, picked, path, raw_path, query, version, self.headers, keep_alive)

        def _scope(self) -> Any:
            """The ASGI scope uvicorn's on_message_begin makes (the rest is its
            on_headers_complete's)."""
            return {
                "type": "http",
                "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
                "http_version": "1.1",
                "server": self.server,
                "client": self.client,
                "scheme": self.scheme,
                "root_path": self.root_path,
                "headers": self.headers,
                "state": self.app_state.copy(),
            }

        def on_body(self, body: bytes) -> None:
            if self._dropping:
                return
            cycle: Any = self.cycle
            if type(cycle) is not _Request:
                super().on_body(body)
            elif not cycle.response_complete:
                cycle.body += body
                if len(cycle.body) > HIGH_WATER_LIMIT:
                    self.flow.pause_reading()

        def on_message_complete(self) -> None:
            if self._dropping:
                return
            # What comes next on this connection is the next request's head: counted from its
            # first byte. (Left to on_message_begin, the read that begins a kept-alive
            # connection's second request went uncounted: its head could be 64 KiB plus one
            # read, up to 256 KiB, and was served.)
            self._in_head, self._begun = True, False
            cycle: Any = self.cycle
            if type(cycle) is not _Request:
                self.scope[BODY_RECEIVED] = True  # type: ignore[literal-required]
                super().on_message_complete()
            elif not cycle.response_complete:
                cycle.more_body = False
                if cycle is self._pending:
                    self._pending = None
                    self._run(cycle)

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            if type(cycle) is not _Request:
                super()._start_asgi_task(cycle, app)
            elif cycle.more_body:  # (its turn came before its whole body: the app's)
                self._to_app(cycle)
            else:
                self._run(cycle)

        def on_response_complete(self) -> None:
            # (uvicorn's, with one keep-alive timer a connection)
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            queued = len(self.pipeline)  # (the next of them starts now, if any)
            self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
            else:
                self._idle_at = self.loop.time()
                if self.timeout_keep_alive_task is None:
                    self.timeout_keep_alive_task = self.loop.call_later(
                        self.timeout_keep_alive, self._keep_alive_over
                    )
            if self.pipeline or self._dropping:
                # (uvicorn reads again after every answer: with requests still queued, each
                # read queued more. Read again once the queue is answered.)
                self.flow.pause_reading()
            if self._dropping and not queued and not self.transport.is_closing():
                self.transport.close()  # (the queued requests answered; the rest dropped)

        def _keep_alive_over(self) -> None:
            """The keep-alive timer: close the connection if it has been idle that long, else
            look again when it would have been."""
            self.timeout_keep_alive_task = None
            idle = self._idle_at
            if idle is None or self.transport.is_closing():
                return  # (a request under way: its answer arms the timer again)
            left = idle + self.timeout_keep_alive - self.loop.time()
            if left > 0:
                self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_over)
            else:
                self.transport.close()

        # -- the direct lane's requests ------------------------------------------------------

        def _run(self, request: _Request) -> None:
            """Answer ``request`` (the connection's first unanswered, its body whole) next."""
            self._next = request
            if self._wake is not None:
                self._wake.set_result(None)
                self._wake = None
            elif self._worker is None:
                self._worker = self.loop.create_task(self._serve())
            # (else the worker is answering the request before it, and takes it next)

        async def _serve(self) -> None:
            """The connection's direct requests, answered in turn: one task a connection,
            not one a request; it ends with the connection."""
            try:
                while True:
                    request = self._next
                    if request is None:
                        if self.transport.is_closing():
                            return
                        self._wake = self.loop.create_future()
                        await self._wake
                        continue
                    self._next = None
                    await self._answer(request)
            finally:
                self._worker = None

        async def _answer(self, request: _Request) -> None:
            assert direct is not None
            self._current = request
            since = _clock.now()
            client = self.client
            started: Awaitable[Answer] | None = None
            try:
                started = direct.start(
                    request.picked,
                    request.headers,
                    request.body,
                    client[0] if client else None,
                    request.receive,
                )
                if started is None:  # (not the lane's after all: the app answers it)
                    self._to_app(request)
                    return
                answer = await started
            except Exception as exc:  # (as uvicorn's cycle: logged, answered 500, closed)
                self.logger.error("Exception in ASGI application\n", exc_info=exc)
                answer = _SERVER_ERROR
                request.keep_alive = False
            finally:
                self._current = None
                if started is not None:
                    direct.finished(request.picked, since)
            await self._write(request, answer)

        async def _write(self, request: _Request, answer: Answer) -> None:
            """What uvicorn's ``send`` does with a response's start and its whole body, in
            one write, and its cycle once the answer is sent."""
            flow = self.flow
            if flow.write_paused and not request.disconnected:
                await flow.drain()
            if request.disconnected:
                return
            status, headers, body = answer
            if self.access_log:
                target = urllib.parse.quote(request.path)
                if request.query:
                    target += "?" + request.query.decode("ascii")
                self.access_logger.info(
                    '%s - "%s %s HTTP/%s" %d',
                    f"{self.client[0]}:{self.client[1]:d}" if self.client else "",
                    "POST",
                    target,
                    request.http_version,
                    status,
                )
            out = [STATUS_LINE[status]]
            for name, value in (*self.server_state.default_headers, *headers):
                out += (name, b": ", value, b"\r\n")
            if not request.keep_alive:
                out.append(b"connection: close\r\n")
            out += (b"\r\n", body)
            self.transport.write_now(b"".join(out))  # type: ignore[attr-defined]
            request.response_complete = True
            if not request.keep_alive:
                self.transport.close()
            self.on_response_complete()

        def _to_app(self, request: _Request) -> None:
            """Hand ``request`` to the app, as uvicorn would have from its head on: its scope,
            its cycle (with the body so far), its task."""
            scope = self._scope()
            scope.update(
                http_version=request.http_version,
                headers=request.headers,
                method="POST",
                path=request.path,
                raw_path=self.root_path.encode("ascii") + request.raw_path,
                query_string=request.query,
            )
            if not request.more_body:
                scope[BODY_RECEIVED] = True
            cycle = RequestResponseCycle(  # (as uvicorn's on_headers_complete makes it)
                scope,
                self.transport,
                self.flow,
                self.logger,
                self.access_logger,
                self.access_log,
                self.server_state.default_headers,
                asyncio.Event(),
                False,  # (no "Expect: 100-continue": the lane leaves those to the app)
                request.keep_alive,
                self.on_response_complete,
            )
            cycle.body = bytearray(request.body)
            cycle.more_body = request.more_body
            cycle.disconnected = request.disconnected
            if request.body or not request.more_body:
                cycle.message_event.set()
            if self.cycle is request:  # type: ignore[comparison-overlap]
                # (its body's next pieces go to its cycle)
                self.cycle = cycle
                self.scope = scope
            super()._start_asgi_task(cycle, self.app)

        def _drop(self, why: str, limit: int) -> None:
            """Take no more of this connection's requests: one past a bound came after others
            (pipelined). Refused with 431 if nothing is left to answer before it; else the
            connection is closed once those are answered (an answer now would be taken for
            theirs)."""
            self._dropping = True
            self._in_head = False
            self._disarm_head_timer()
            if self.pipeline or (self.cycle is not None and not self.cycle.response_complete):
                peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
                logger.warning("closing a connection from %s: " + why, peer, limit)
                self.flow.pause_reading()
            else:
                self._refuse(431, "Request Header Fields Too Large", _REFUSAL, "passed %d bytes")

        def _arm_head_timer(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(head_timeout, self._head_too_slow)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if self._in_head and self._begun:
                self._refuse(408, "Request Timeout", too_slow, "took over %g s")

        def _refuse(self, status: int, reason: str, body: bytes, why: str) -> None:
            self._disarm_head_timer()
            if self.transport.is_closing():
                return
            self._in_head = False  # (what else is in flight goes with the socket)
            peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            limit = MAX_HEAD_BYTES if status == 431 else head_timeout
            logger.warning("refused a request from %s: its head " + why, peer, limit)
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                % (status, reason.encode(), len(body), body)
            )
            self.transport.close()

    return BoundedHeadProtocol


class _Coalescing:
    """A transport whose writes in one turn of the loop go out as one write when the turn
    ends (soon callbacks run in order: before any timer). ``close`` sends what is held
    first; everything else is the transport's."""

    __slots__ = ("_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def flush(self) -> None:
        if self._held:
            data, self._held = b"".join(self._held), []
            if not self._transport.is_closing():
                self._transport.write(data)

    def write_now(self, data: bytes) -> None:
        """Write ``data`` at once (after what is held: in order)."""
        if self._held:
            self._held.append(data)
        elif not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:  # (asked several times a request: not by __getattr__)
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
