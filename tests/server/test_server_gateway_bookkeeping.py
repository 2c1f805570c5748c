"""``fenced serve``'s grant bookkeeping (``Gateway``, free of HTTP) on the real ``memory://``
source, on the simulator's virtual-time loop (a ttl passes without a real wait, and nothing
else runs): the expiry counts ``fenced sim --system gateway`` found wrong. The source is
made to send no word of a grant's end, as every source but memory:// and ZooKeeper (etcd,
Redis, SQLite, PostgreSQL): the gateway learns of it by its sweep, or not at all.

* A request id granted anew (its first grant ended, its expiry not yet swept) overwrote the
  ended grant in the table: that expiry was never counted. The same through a renewal that
  resumed the new grant. (Through the same gateway such an acquire is now a late duplicate,
  answered as ended: the tests of that are here too.)
* The same release delivered twice: the copy that found the grant gone answered first and
  counted an expiry of a grant the other copy had released.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from fenced import AsyncLocks
from fenced._core import clock as _clock
from fenced._core.backend import Grant
from fenced._core.errors import LeaseLostError, LockTimeout
from fenced.server import _gateway as _gateway_module
from fenced.server._auth import ApiKey, Verb, hash_secret
from fenced.server._gateway import Gateway
from fenced.testing.sim import VirtualLoop

_names = itertools.count()


def _virtual(body: Callable[[str], Awaitable[None]]) -> None:
    """Run ``body(url)`` on a virtual clock (fenced's clock is the loop's meanwhile)."""
    loop = VirtualLoop()
    real = _clock.now
    _clock.now = loop.time
    try:
        loop.run_until_complete(body(f"memory://bookkeeping-{next(_names)}"))
    finally:
        _clock.now = real
        loop.close()


class _Unannounced:
    """The real source, less its word that a grant ended (``on_lost`` never called)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def acquire(self, name: str, **kw: Any) -> Grant:
        grant: Grant = await self.backend.acquire(name, **{**kw, "on_lost": lambda exc: None})
        return grant


async def _gateway(url: str) -> Gateway:
    gw = Gateway(AsyncLocks(url), max_wait=10.0, default_ttl=1.0)
    await gw.start()
    gw._backend = _Unannounced(gw._backend)  # type: ignore[assignment]
    return gw


def _expired(gw: Gateway) -> list[str]:
    return [e.token for e in gw.events if e.event == "expired"]


def test_a_late_duplicate_after_the_expiry_is_told_its_grant_ended_and_counted_once() -> None:
    """The same request id after its grant expired (its expiry not yet swept) was granted
    anew, l:2, held by nobody; now answered as ended (410), nothing granted, and the expiry
    of l:1 counted once, by the sweep."""

    async def body(url: str) -> None:
        gw = await _gateway(url)
        await asyncio.sleep(0.5)  # (a grant sent at 0.0 reads as resumed: never swept)
        first, _ = await gw.acquire("l", "r", 1.0, 0.0, "o")
        await asyncio.sleep(1.2)  # expired at the source; the sweep looks only after 2 s
        with pytest.raises(LeaseLostError, match="has ended"):
            await gw.acquire("l", "r", 1.0, 0.0, "o")
        status = await gw.backend.status("l")
        assert status.token is None and status.last_token == first.token  # (no l:2)
        await asyncio.sleep(2.5)  # swept, claimed at the source, counted
        assert _expired(gw) == ["l:1"]
        assert gw.metrics.expiries._value.get() == 1
        assert gw.metrics.grants._value.get() == 1
        await gw.stop()

    _virtual(body)


def test_a_late_duplicate_after_the_release_is_told_its_grant_ended() -> None:
    """Outside tester: an acquire retried with its request id after that grant's release got
    a second grant (l:2) nobody held, the lock idle for its ttl. Now 410 (LeaseLostError),
    the lock stays free, and a new attempt (a new id) is granted l:2 at once; a retry before
    the release still gets the same grant. Seen failing without the fix (l:2 granted)."""

    async def body(url: str) -> None:
        gw = await _gateway(url)
        first, _ = await gw.acquire("l", "r", 30.0, 0.0, "o")
        retry, _ = await gw.acquire("l", "r", 30.0, 0.0, "o")  # (its answer was lost)
        assert retry.token == first.token and gw.metrics.grants._value.get() == 1
        assert await gw.release("l", first.token, "r")
        for _ in range(2):
            with pytest.raises(LeaseLostError, match="new attempt needs a new request id"):
                await gw.acquire("l", "r", 30.0, 5.0, "o")  # (a waiting one too: no wait)
        status = await gw.backend.status("l")
        assert status.token is None and status.last_token == first.token
        new, _ = await gw.acquire("l", "r2", 30.0, 0.0, "o")
        assert new.token.value == 2 and gw.metrics.grants._value.get() == 2
        # and the late duplicate while another holds the lock: told at once, not queued
        with pytest.raises(LeaseLostError):
            await gw.acquire("l", "r", 30.0, 5.0, "o")
        assert (await gw.backend.status("l")).waiters == 0
        await gw.stop()

    _virtual(body)


def test_a_gateway_forgets_a_request_id_after_its_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/server.md: ids are remembered IDS_KEPT_FOR s after their grant was last granted,
    renewed or released here, the latest IDS_KEPT: after that, the id is a new request."""
    monkeypatch.setattr(_gateway_module, "IDS_KEPT", 2)

    async def body(url: str) -> None:
        gw = await _gateway(url)
        for rid in ("a", "b", "c"):  # (a is the oldest, past the bound of 2)
            got, _ = await gw.acquire("l", rid, 30.0, 0.0, "o")
            assert await gw.release("l", got.token, rid)
        with pytest.raises(LeaseLostError):
            await gw.acquire("l", "b", 30.0, 0.0, "o")
        again, _ = await gw.acquire("l", "a", 30.0, 0.0, "o")  # (forgotten: granted)
        assert again.token.value == 4
        assert await gw.release("l", again.token, "a")
        with pytest.raises(LeaseLostError):  # (c is still remembered)
            await gw.acquire("l", "c", 30.0, 0.0, "o")
        await asyncio.sleep(_gateway_module.IDS_KEPT_FOR + 1)  # (nothing else meanwhile)
        again, _ = await gw.acquire("l", "c", 30.0, 0.0, "o")
        assert again.token.value == 5
        await gw.stop()

    _virtual(body)


class _ReleasedAfterTheLook:
    """The real source; the release of ``grant`` (through another gateway) lands just after
    the gateway's look at the lock's status, before its acquire."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.grant: Grant | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def status(self, name: str) -> Any:
        status = await self.backend.status(name)
        if self.grant is not None:
            assert await self.backend.release(self.grant)
            self.grant = None
        return status


def test_a_late_duplicate_racing_the_release_leaves_no_grant() -> None:
    """The look said the retried grant lived; its release landed before the acquire, which
    was granted l:2: given back at once and answered as ended (never handed out, never
    held for its ttl)."""

    async def body(url: str) -> None:
        gw = await _gateway(url)
        first, _ = await gw.acquire("l", "r", 30.0, 0.0, "o")
        racing = _ReleasedAfterTheLook(gw._backend)
        racing.grant = first
        gw._backend = racing  # type: ignore[assignment]
        with pytest.raises(LeaseLostError):
            await gw.acquire("l", "r", 30.0, 0.0, "o")
        status = await racing.backend.status("l")
        assert status.token is None and status.last_token is not None
        assert status.last_token.value == 2  # (granted, and given back)
        await gw.stop()

    _virtual(body)


def test_a_renewal_that_resumes_a_new_grant_counts_the_ended_ones_expiry() -> None:
    async def body(url: str) -> None:
        one, two = await _gateway(url), await _gateway(url)
        await one.acquire("l", "r", 1.0, 0.0, "o")
        await asyncio.sleep(1.2)
        new, _ = await two.acquire("l", "r", 1.0, 0.0, "o")  # (the retry, through the other)
        await one.renew("l", new.token, "r", 1.0)  # resumes l:2 where l:1 was kept
        await one._count_ended()  # (claimed at the source: see above)
        assert _expired(one) == ["l:1"]
        assert [e.token for e in two.events] == ["l:2"]  # (granted; nothing ended there)
        await one.stop()
        await two.stop()

    _virtual(body)


class _SlowFirstRelease:
    """The real source, with the answer to the first release held back 10 ms (the network):
    a copy of the same release sent after it is answered first."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.first = backend, True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def release(self, grant: Grant) -> bool:
        released: bool = await self.backend.release(grant)
        if self.first:
            self.first = False
            await asyncio.sleep(0.01)
        return released


def test_a_release_delivered_twice_is_not_counted_as_an_expiry() -> None:
    async def body(url: str) -> None:
        gw = await _gateway(url)
        grant, _ = await gw.acquire("l", "r", 5.0, 0.0, "o")
        gw._backend = _SlowFirstRelease(gw._backend)
        answers = await asyncio.gather(
            gw.release("l", grant.token, "r"), gw.release("l", grant.token, "r")
        )
        assert sorted(answers) == [False, True]
        assert [e.event for e in gw.events] == ["granted", "released"]
        assert gw.metrics.expiries._value.get() == 0
        assert not gw._releasing  # (nothing left behind)
        await gw.stop()

    _virtual(body)


def _key(name: str) -> ApiKey:
    return ApiKey(name, bytes.fromhex(hash_secret(name)), ("",), frozenset({Verb.ACQUIRE}))


def test_another_keys_request_id_is_answered_as_unknown_and_changes_nothing() -> None:
    """The key checks, in the gateway rather than the HTTP routes: another key's request id
    is answered as an unknown one (no oracle), counted as a refusal; both sides."""
    alice, bob = _key("alice"), _key("bob")

    async def body(url: str) -> None:
        gw = await _gateway(url)
        grant, _ = await gw.acquire_for(alice, "l", "job", 1.0, 0.0, "o")
        with pytest.raises(LeaseLostError):
            await gw.renew_for(bob, "l", grant.token, "job", 1.0)
        assert await gw.release_for(bob, "l", grant.token, "job") is False
        for wait in (0.0, 0.2):  # (the waiting one waits in line, as any other would)
            with pytest.raises(LockTimeout):
                await gw.acquire_for(bob, "l", "job", 1.0, wait, "o")
        status = await gw.backend.status("l")
        assert status.token == grant.token and status.remaining == pytest.approx(0.8, abs=0.05)
        # the rightful key: the same grant again, renewed, released
        again, _ = await gw.acquire_for(alice, "l", "job", 1.0, 0.0, "o")
        assert again.token == grant.token
        await asyncio.sleep(0.3)
        await gw.renew_for(alice, "l", grant.token, "job", 1.0)
        assert await gw.release_for(alice, "l", grant.token, "job") is True
        assert gw.metrics.refused.labels("forbidden")._value.get() == 4
        await gw.stop()

    _virtual(body)


def test_a_renewal_overtaking_a_release_is_not_counted_as_an_expiry() -> None:
    """The same class: a late renewal finds the grant gone while the release that took it is
    still on its way back — lost, not expired."""

    async def body(url: str) -> None:
        gw = await _gateway(url)
        grant, _ = await gw.acquire("l", "r", 5.0, 0.0, "o")
        gw._backend = _SlowFirstRelease(gw._backend)
        releasing = asyncio.ensure_future(gw.release("l", grant.token, "r"))
        await asyncio.sleep(0.001)  # (the release landed; its answer is on its way)
        with pytest.raises(LeaseLostError):
            await gw.renew("l", grant.token, "r", 5.0)
        assert await releasing is True
        assert [e.event for e in gw.events] == ["granted", "released"]
        await gw.stop()

    _virtual(body)


class _SlowRenewal:
    """The real source, with the answer to a renewal held back 10 ms (the network)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def renew(self, grant: Grant) -> Grant:
        renewed: Grant = await self.backend.renew(grant)
        await asyncio.sleep(0.01)
        return renewed


def test_a_renewal_answered_after_the_release_does_not_bring_the_grant_back() -> None:
    """A renewal sent before the release and answered after it put the released grant back
    in the table, and the sweep counted it as expired later."""

    async def body(url: str) -> None:
        gw = await _gateway(url)
        grant, _ = await gw.acquire("l", "r", 1.0, 0.0, "o")
        gw._backend = _SlowRenewal(gw._backend)
        renewing = asyncio.ensure_future(gw.renew("l", grant.token, "r", 1.0))
        await asyncio.sleep(0.001)  # (the renewal landed; its answer is on its way)
        assert await gw.release("l", grant.token, "r") is True
        await renewing  # (it did renew, before the release: a true answer)
        assert not gw._grants and not gw._busy and not gw._settled
        await asyncio.sleep(4.0)  # the sweep has had its looks
        assert [e.event for e in gw.events] == ["granted", "released"]
        await gw.stop()

    _virtual(body)


class _SlowAcquire:
    """The real source, with the answer to an acquire held back 10 ms (the network)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def acquire(self, name: str, **kw: Any) -> Grant:
        grant: Grant = await self.backend.acquire(name, **kw)
        await asyncio.sleep(0.01)
        return grant


def test_a_retried_acquire_answered_after_the_release_does_not_bring_the_grant_back() -> None:
    """The same class, through acquire: a retry (after a lost answer) that found the grant,
    answered after the holder released it here."""

    async def body(url: str) -> None:
        gw = await _gateway(url)
        grant, _ = await gw.acquire("l", "r", 1.0, 0.0, "o")
        gw._backend = _SlowAcquire(gw._backend)
        retry = asyncio.ensure_future(gw.acquire("l", "r", 1.0, 0.0, "o"))
        await asyncio.sleep(0.001)  # (the retry found the grant; its answer is on its way)
        assert await gw.release("l", grant.token, "r") is True
        again, _ = await retry
        assert again.token == grant.token  # (the same grant: idempotent, true when asked)
        assert not gw._grants and not gw._busy and not gw._settled
        await asyncio.sleep(4.0)  # the sweep has had its looks
        assert [e.event for e in gw.events] == ["granted", "released"]
        await gw.stop()

    _virtual(body)
