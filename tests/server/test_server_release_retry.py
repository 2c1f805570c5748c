"""A release through ``fenced serve`` whose answer was lost, asked again: the gateway released
the grant and answered, the answer never reached the client (a proxy in between drops the
server's replies), the lease core asked again once the network healed. The gateway found the
grant no longer held and answered False: the client reported a loss that had not happened.
It now answers True for a grant it released (by request id and token, for the rest of the
grant's ttl), and still False for a grant taken over before the release."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import httpx
import pytest

import fenced
from fenced.testing.proxy import TcpProxy
from fenced.testing.servers import FencedServer
from tests.helpers import unique_name

Step = Callable[[fenced.AsyncLocks, str], Awaitable[None]]


async def asked_again(
    server: FencedServer, before: Step | None = None
) -> tuple[bool, fenced.AsyncLease, fenced.LockStatus]:
    """Release a lease through a proxy that passes the release on and drops the answer (the
    call raises BackendUnavailable: its outcome unknown), heal, ask again: its answer, the
    lease, and the lock's status then. ``before``: what happens to the lock before the
    release (another client takes it over)."""
    port = urlsplit(server.url).port
    assert port is not None
    name = unique_name()
    with TcpProxy("127.0.0.1", port) as proxy:
        async with (
            fenced.connect_async(f"http://127.0.0.1:{proxy.port}", request_timeout=1.0) as locks,
            fenced.connect_async(server.url) as other,
        ):
            lease = locks.lock(name, ttl=30)
            await lease.acquire()
            if before is not None:
                await before(other, name)
            proxy.drop_replies()
            sent = proxy.forwarded
            with pytest.raises(fenced.BackendUnavailable):
                await lease.release()
            assert proxy.forwarded > sent  # (the release reached the server)
            proxy.heal()
            released = await lease.release()
            return released, lease, await other.status(name)


def _sample(server: FencedServer, family: str, result: str) -> float:
    """``family{result=...}`` as the server's /metrics says it."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    lines = [x for x in text.splitlines() if x.startswith(family + "{")]
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if f'result="{result}"' in x)


def _released_total(server: FencedServer) -> float:
    """``fenced_releases_total{result="released"}`` as the server's /metrics says it."""
    return _sample(server, "fenced_releases_total", "released")


def _retries(server: FencedServer, result: str) -> float:
    """``fenced_release_retries_total{result=...}``."""
    return _sample(server, "fenced_release_retries_total", result)


async def test_a_release_whose_answer_was_lost_asked_again_is_a_release(
    server: FencedServer,
) -> None:
    """True, no loss reported, the lock free; and the release counted once, the retry
    answered from the gateway's memory counted as such."""
    before, remembered = _released_total(server), _retries(server, "remembered")
    released, lease, status = await asked_again(server)
    assert released is True
    assert not lease.lost.is_set(), lease.lost.cause
    assert status.holder is None
    assert _released_total(server) == before + 1
    assert _retries(server, "remembered") == remembered + 1


async def test_a_release_asked_again_after_a_takeover_stays_false(server: FencedServer) -> None:
    """The other side: an operator force-released the lock and another client took it before
    the release arrived: asked again, False, the loss reported, the new holder's grant kept."""

    async def take_over(other: fenced.AsyncLocks, name: str) -> None:
        assert await other.force_release(name) is not None
        await other.lock(name, ttl=30).acquire()

    remembered, not_held = _retries(server, "remembered"), _retries(server, "not_held")
    released, lease, status = await asked_again(server, take_over)
    assert released is False
    assert lease.lost.is_set()
    assert status.holder is not None
    assert _retries(server, "not_held") == not_held + 1  # (the retry: answered false)
    assert _retries(server, "remembered") == remembered
