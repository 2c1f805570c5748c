"""The lease core with no real source: state machine timing, keepalive, loss, retries."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, ClassVar
from urllib.parse import SplitResult

import pytest

import fenced
from fenced import _backend, _clock
from fenced._backend import Backend, Characteristic, Grant, LockStatus, LostCallback
from fenced._state import LeaseState, Phase
from fenced.backends.memory import MemoryBackend


def _grant(sent_at: float, ttl: float = 10.0) -> Grant:
    return Grant(fenced.FencingToken("x", 1), "r", ttl, sent_at)


def test_remaining_counts_from_when_the_request_was_sent() -> None:
    state = LeaseState(ttl=10, safety_margin=0.5)
    state.start_acquiring()
    state.granted(_grant(sent_at=100.0))
    assert state.remaining(100.0) == pytest.approx(9.5)
    assert state.remaining(109.0) == pytest.approx(0.5)
    assert state.remaining(109.5) == 0
    # A renewal only ever moves the expiry forward, even if replies arrive out of order.
    state.renewed(_grant(sent_at=105.0))
    state.renewed(_grant(sent_at=103.0))
    assert state.remaining(105.0) == pytest.approx(9.5)
    # The server may grant a shorter lease than asked: the shorter one counts.
    state.renewed(_grant(sent_at=106.0, ttl=2.0))
    assert state.remaining(106.0) == pytest.approx(1.5)


def test_state_transitions() -> None:
    state = LeaseState(ttl=1)
    assert state.remaining(0) == 0 and state.phase is Phase.IDLE
    state.start_acquiring()
    with pytest.raises(fenced.LockError):
        state.start_acquiring()
    state.granted(_grant(0.0, 1.0))
    assert state.lose(fenced.LeaseLostError("x")) is True
    assert state.lose(fenced.LeaseLostError("again")) is False  # fires once
    assert state.remaining(0.0) == 0
    state.released()
    state.start_acquiring()
    state.acquire_failed()
    assert state.phase is Phase.IDLE


def test_default_safety_margin() -> None:
    assert LeaseState(10).safety_margin == pytest.approx(0.15)
    assert LeaseState(0.1).safety_margin == pytest.approx(0.025)
    with pytest.raises(ValueError):
        LeaseState(0)
    with pytest.raises(ValueError):
        LeaseState(1, safety_margin=1)


class FlakyBackend(MemoryBackend):
    """A memory source whose renewals (or first acquires) can be made to fail."""

    scheme: ClassVar[str] = "flaky"
    fail_renew = False
    fail_acquires = 0
    acquire_calls: ClassVar[list[str]] = []

    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> MemoryBackend:
        return cls((await MemoryBackend.open(url, options))._store)

    async def acquire(
        self,
        name: str,
        *,
        request_id: str,
        ttl: float,
        deadline: float | None,
        on_lost: LostCallback,
    ) -> Grant:
        FlakyBackend.acquire_calls.append(request_id)
        grant = await super().acquire(
            name, request_id=request_id, ttl=ttl, deadline=deadline, on_lost=on_lost
        )
        if FlakyBackend.fail_acquires:
            FlakyBackend.fail_acquires -= 1
            raise fenced.BackendUnavailable("reply lost")  # granted, but the reply never arrived
        return grant

    async def renew(self, grant: Grant) -> Grant:
        if FlakyBackend.fail_renew:
            raise fenced.BackendUnavailable("partitioned")
        return await super().renew(grant)


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch, memory_url: str) -> str:
    monkeypatch.setitem(_backend.SCHEMES, "flaky", "tests.test_lease_core:FlakyBackend")
    FlakyBackend.fail_renew = False
    FlakyBackend.fail_acquires = 0
    FlakyBackend.acquire_calls = []
    return memory_url.replace("memory://", "flaky://")


def test_lost_reply_retry_is_idempotent(flaky: str) -> None:
    """A grant whose reply was lost is found again by the retry, not taken twice."""
    FlakyBackend.fail_acquires = 2
    with fenced.connect(flaky) as locks, locks.lock("x", ttl=5) as lease:
        assert lease.token.value == 1
        assert len(set(FlakyBackend.acquire_calls)) == 1 and len(FlakyBackend.acquire_calls) == 3
        assert locks.status("x").last_token == lease.token


def test_unreachable_source_while_held_means_lost(flaky: str) -> None:
    with fenced.connect(flaky) as locks:
        lease = locks.lock("x", ttl=0.6)
        lease.acquire()
        FlakyBackend.fail_renew = True
        assert lease.lost.wait(5)
        assert isinstance(lease.lost_cause, fenced.LeaseLostError)
        assert not lease.held


def test_keepalive_survives_a_short_outage(flaky: str) -> None:
    with fenced.connect(flaky) as locks:
        lease = locks.lock("x", ttl=2)
        lease.acquire()
        FlakyBackend.fail_renew = True
        assert not lease.lost.wait(0.8)  # two renewal attempts failed, lease still valid
        FlakyBackend.fail_renew = False
        assert not lease.lost.wait(2.5)  # renewed again before it ran out
        assert lease.held
        lease.release()


async def test_remaining_never_exceeds_ttl_from_send(memory_url: str) -> None:
    async with fenced.connect_async(memory_url) as locks:
        before = _clock.now()
        lease = locks.lock("x", ttl=3)
        await lease.acquire()
        assert lease.remaining() <= 3 - (_clock.now() - before) + 1e-6
        await lease.release()
        assert lease.remaining() == 0 and not lease.held


async def test_lost_signal_is_awaitable(memory_url: str) -> None:
    async with fenced.connect_async(memory_url) as locks:
        lease = locks.lock("x", ttl=0.3, auto_renew=False)
        await lease.acquire()
        cause = await asyncio.wait_for(lease.lost, 5)
        assert isinstance(cause, fenced.LeaseLostError)


def test_never_acquired_token_is_an_error(memory_url: str) -> None:
    with fenced.connect(memory_url) as locks:
        lease = locks.lock("x")
        with pytest.raises(fenced.NotHeldError):
            _ = lease.token
        with pytest.raises(fenced.NotHeldError):
            lease.renew()
        assert lease.release() is False


def test_close_releases_held_leases(memory_url: str) -> None:
    locks = fenced.connect(memory_url)
    lease = locks.lock("x", ttl=30)
    lease.acquire()
    locks.close()
    with fenced.connect(memory_url) as other:
        assert other.status("x").holder is None


def test_unknown_scheme_and_bad_url() -> None:
    with pytest.raises(fenced.ConfigurationError, match="unknown token source scheme"):
        fenced.connect("nosuch://x")
    with pytest.raises(fenced.ConfigurationError):
        fenced.connect("not a url")
    with pytest.raises(fenced.ConfigurationError, match="unknown characteristic"):
        fenced.connect("memory://x", require={"fast"})


def test_characteristics_are_declared_for_every_scheme() -> None:
    """Every registered module exists and declares what it promises (no silent gaps)."""
    for scheme in _backend.SCHEMES:
        cls = _backend.backend_class(f"{scheme}://x")
        assert issubclass(cls, Backend)
        assert isinstance(cls.characteristics, frozenset)
        assert all(isinstance(c, Characteristic) for c in cls.characteristics)


def test_lock_status_fields() -> None:
    fields = {f.name for f in dataclasses.fields(LockStatus)}
    assert {"name", "holder", "token", "last_token", "remaining", "waiters"} <= fields


class ReleaseFindsItGone(MemoryBackend):
    """The source had already let the grant go when the holder releases it."""

    scheme: ClassVar[str] = "gone"

    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> MemoryBackend:
        return cls((await MemoryBackend.open(url, options))._store)

    async def release(self, grant: Grant) -> bool:
        await super().release(grant)
        return False


def test_release_that_finds_the_grant_gone_reports_the_loss(
    monkeypatch: pytest.MonkeyPatch, memory_url: str
) -> None:
    monkeypatch.setitem(_backend.SCHEMES, "gone", "tests.test_lease_core:ReleaseFindsItGone")
    seen: list[fenced.Lease] = []
    with fenced.connect(memory_url.replace("memory://", "gone://")) as locks:
        lease = locks.lock("x", ttl=5, on_lost=seen.append)
        with pytest.raises(fenced.LeaseLostError, match="lost while held"):
            with lease:
                pass
        assert lease.lost.is_set() and seen == [lease]
        assert "when it was released" in str(lease.lost_cause)
        # A release that found nothing because it was already released says nothing.
        assert lease.release() is False and seen == [lease]
