"""The ``http://`` source (fenced's client of ``fenced serve``) when an acquire's answer is lost:
the lease core sends the same request id again, and the gateway answers with the grant it
already made. The client dated that grant from the *retry* (``sent + ttl``), past the source's
own expiry by the time between the two — a holder believing it holds after its lease ended.
(The class of the simulator's gateway work: an acquire retried after a lost reply.) A real
``fenced serve`` on SQLite; the lost answer is a transport that drops the first reply."""

from __future__ import annotations

import asyncio
import time

import httpx

from fenced._core.clock import now
from fenced.backends.http import HttpBackend
from fenced.testing.servers import FencedServer


class _LoseFirstAcquireReply(httpx.AsyncBaseTransport):
    """Forwards every request to the real server; the first acquire's answer never arrives
    (the request was carried out: the grant is made)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.lost = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path.endswith("/-/acquire") and not self.lost:
            self.lost = True
            await response.aread()
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_a_retried_acquire_is_dated_from_the_grant_not_from_the_retry(tmp_path: object) -> None:
    with FencedServer(f"sqlite:///{tmp_path}/locks.db") as server:  # type: ignore[attr-defined]

        async def run() -> None:
            client = httpx.AsyncClient(transport=_LoseFirstAcquireReply(), timeout=5.0)
            backend = HttpBackend(client, [server.url], 5.0)
            try:
                kw = {"request_id": "job-1", "ttl": 5.0, "deadline": now(), "on_lost": print}
                try:
                    await backend.acquire("l", **kw)  # type: ignore[arg-type]
                except Exception as exc:  # (BackendUnavailable: the answer was lost)
                    assert "lost" in str(exc)
                else:
                    raise AssertionError("the first answer was not lost")
                await asyncio.sleep(1.5)  # the time between the lost answer and the retry
                grant = await backend.acquire("l", **kw)  # type: ignore[arg-type]
                status = await backend.status("l")
                assert status.remaining is not None and status.holder == "job-1"
                # What the client vouches for must end no later than the grant at the source.
                ends_at_source = now() + status.remaining
                assert grant.sent_at + grant.ttl <= ends_at_source + 0.1, (
                    f"believed {grant.sent_at + grant.ttl - ends_at_source:.2f} s past the source"
                )
                # ... and the rightful holder still holds it, well within its ttl.
                assert grant.sent_at + grant.ttl - now() > 2.0
            finally:
                await client.aclose()

        started = time.monotonic()
        asyncio.run(run())
        assert time.monotonic() - started < 30
