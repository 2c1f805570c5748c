"""uvicorn's HTTP protocol with a bound on a request's head (its request line and headers).

uvicorn's httptools protocol keeps whatever a client sends of a request's head until the
blank line that ends it, and has no limit of its own (its h11 protocol has one, 16 KiB): one
connection sending headers without end would make the server hold them all. Here a head over
``MAX_HEAD_BYTES`` is answered ``431 Request Header Fields Too Large`` and the connection
closed, before the app sees anything. (nginx allows 32 KiB of headers by default, Node.js
16 KiB; a bearer key and the few headers a client of the API sends fit in well under 4 KiB.)
A body is bounded elsewhere: uvicorn stops reading while the app has not taken what it has,
and the app refuses one over ``--max-request-bytes`` (``_app._BodyLimit``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["MAX_HEAD_BYTES", "http_protocol"]

logger = logging.getLogger("fenced.server")

MAX_HEAD_BYTES = 64 * 1024

_REFUSAL = b"request line and headers over %d bytes\n" % MAX_HEAD_BYTES


def http_protocol() -> type[asyncio.Protocol] | str:
    """The protocol class for ``uvicorn.Config(http=...)``: httptools with the bound, or h11
    (which has a bound of its own) where httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # (httptools comes with fenced[server]; without it, h11's 16 KiB)
        return "h11"

    class BoundedHeadProtocol(HttpToolsProtocol):
        """Counts the bytes that arrive while a request's head is incomplete and refuses the
        request once they pass the bound (checked after each read is parsed, so a read that
        also carries the body, or the next request, is never miscounted)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True  # (a connection starts with a request's head)
            self._head_bytes = 0

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._in_head and self._head_bytes > MAX_HEAD_BYTES:
                self._refuse_head()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head = True

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._head_bytes = 0  # (the next request's head counts from here)
            super().on_headers_complete()

        def _refuse_head(self) -> None:
            if self.transport.is_closing():
                return
            self._in_head = False  # (what else is in flight goes with the socket)
            peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            logger.warning(
                "refused a request from %s: its head passed %d bytes", peer, MAX_HEAD_BYTES
            )
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: text/plain; charset=utf-8\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_REFUSAL), _REFUSAL)
            )
            self.transport.close()

    return BoundedHeadProtocol
