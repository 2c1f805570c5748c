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
(``direct``, the app's ``DirectLane``): such a request still gets uvicorn's cycle (its place
in a pipeline, keep-alive, flow control, the disconnect a waiting acquire watches for), but
not the trip through the ASGI app's layers, and its answer goes to the socket as one write,
its head built here as uvicorn's ``send`` builds it. A request the lane is not sure of (its
body not whole yet, a bad body or key, another route) goes to the app, unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

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

    def pick(self, scope: Any) -> Any:
        """Something true for a request (its head read) the lane may answer, else None."""

    def answer(
        self, picked: Any, scope: Any, body: bytes, receive: Callable[[], Awaitable[Any]]
    ) -> Awaitable[Answer | None]:
        """The answer to a request picked, its whole body read; None: the app's to answer."""


_DIRECT_PREFIX = b"/v1/locks/"  # (the paths the lane may take start so)


def http_protocol(
    head_timeout: float = READ_TIMEOUT, direct: Direct | None = None
) -> type[asyncio.Protocol] | str:
    """The protocol class for ``uvicorn.Config(http=...)``: httptools with the bounds, or h11
    (which bounds a head's size, not its time) where httptools is not installed. ``direct``:
    the requests it answers without the ASGI app (see the module's doc)."""
    too_slow = b"request line and headers not received within %g s\n" % head_timeout
    try:
        from uvicorn.protocols.http.httptools_impl import (
            STATUS_LINE,
            HttpToolsProtocol,
            RequestResponseCycle,
        )
        from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string
    except ImportError:  # (httptools comes with fenced[server]; without it, h11's 16 KiB)
        return "h11"

    async def _write_whole(cycle: Any, scope: Any, answer: Answer) -> None:
        """What uvicorn's ``send`` does with a response's start and its whole body, in one
        write."""
        status, headers, body = answer
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            return
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        if cycle.access_log:
            cycle.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                get_client_addr(scope),
                scope["method"],
                get_path_with_query_string(scope),
                scope["http_version"],
                status,
            )
        out = [STATUS_LINE[status]]
        for name, value in (*cycle.default_headers, *headers):
            out += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            out.append(b"connection: close\r\n")
        out += (b"\r\n", body)
        cycle.transport.write_now(b"".join(out))
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()

    class BoundedHeadProtocol(HttpToolsProtocol):
        """Counts a request's head as its bytes arrive, up to the blank line that ends it
        (never its body, nor a request after it), and refuses the request before the parser
        sees a read that takes the head past the bound — whether the head comes in many reads
        or, as on a busy server, in one."""

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

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            # (after uvicorn's flow control took the real transport: reading is not delayed)
            self.transport = _Coalescing(transport, self.loop)  # type: ignore[assignment]
            self._arm_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._dropping:
                return  # (the connection closes once what is queued is answered)
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
            super().data_received(data)
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
            super().on_message_begin()
            # The timer is armed after the read if the head is still incomplete then: a head
            # that comes whole in one read (nearly all) costs no timer.
            self._in_head = self._begun = self._begun_here = True
            self._parsed = 0

        def on_url(self, url: bytes) -> None:
            if not self._dropping:
                self._parsed += len(url)
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if not self._dropping:
                self._parsed += len(name) + len(value) + 4  # (": " and the line's end)
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._dropping:
                return
            self._in_head = False
            self._head_bytes, self._tail = 0, b""  # (the next request's head counts afresh)
            self._disarm_head_timer()
            if self._parsed > MAX_HEAD_BYTES:  # (a head that came whole after another)
                self._drop("a pipelined request's head passed %d bytes", MAX_HEAD_BYTES)
                return
            if direct is not None and self.url.startswith(_DIRECT_PREFIX):
                # (uvicorn hands its cycle ``self.app``: this request's is the direct lane)
                app, self.app = self.app, self._answer_directly
                try:
                    super().on_headers_complete()
                finally:
                    self.app = app
            else:
                super().on_headers_complete()
            if len(self.pipeline) > MAX_PIPELINED:
                self.pipeline.popleft()  # (this one: never answered)
                self._drop("over %d requests pipelined", MAX_PIPELINED)

        def on_body(self, body: bytes) -> None:
            if not self._dropping:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._dropping:
                return
            self.scope[BODY_RECEIVED] = True  # type: ignore[literal-required]
            # What comes next on this connection is the next request's head: counted from its
            # first byte. (Left to on_message_begin, the read that begins a kept-alive
            # connection's second request went uncounted: its head could be 64 KiB plus one
            # read, up to 256 KiB, and was served.)
            self._in_head, self._begun = True, False
            super().on_message_complete()

        def on_response_complete(self) -> None:
            queued = len(self.pipeline)  # (uvicorn starts the next of them, if any)
            super().on_response_complete()
            if self.pipeline or self._dropping:
                # (uvicorn reads again after every answer: with requests still queued, each
                # read queued more. Read again once the queue is answered.)
                self.flow.pause_reading()
            if self._dropping and not queued and not self.transport.is_closing():
                self.transport.close()  # (the queued requests answered; the rest dropped)

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

        async def _answer_directly(self, scope: Any, receive: Any, send: Any) -> None:
            """The ASGI app of a request that may be the direct lane's (uvicorn's cycle runs
            it as its app): answered here, or by the app."""
            cycle = send.__self__  # (the request's RequestResponseCycle: ``send`` is its own)
            assert isinstance(cycle, RequestResponseCycle) and direct is not None
            picked = None
            # The body whole (and no "100 Continue" owed first: the app's receive sends it).
            if not (cycle.more_body or cycle.disconnected or cycle.waiting_for_100_continue):
                picked = direct.pick(scope)
            answer = None
            if picked is not None:
                answer = await direct.answer(picked, scope, bytes(cycle.body), receive)
            if answer is None:
                await self.app(scope, receive, send)
                return
            await _write_whole(cycle, scope, answer)

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

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
