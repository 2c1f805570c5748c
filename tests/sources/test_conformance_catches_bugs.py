"""The conformance suite must be able to fail: each planted bug is caught by the test named.

Each mutant is the memory source with one safety rule broken. The suite's own test functions
are run against it and must fail (AssertionError, or pytest's failure for a missing raise).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, ClassVar
from urllib.parse import SplitResult

import pytest

from fenced import FencedError
from fenced._core import clock as _clock
from fenced._core.backend import Grant, LostCallback
from fenced._core.token import FencingToken
from fenced.backends.memory import MemoryBackend, _Lock
from tests.helpers import unique_name
from tests.sources.conformance import test_conformance as suite
from tests.sources.envs.memory import MemoryEnv


class _Mutant(MemoryBackend):
    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> MemoryBackend:
        return cls((await MemoryBackend.open(url, options))._store)


class UnfencedRelease(_Mutant):
    """release() frees the lock whoever holds it (the etcd#22082 class of bug)."""

    async def release(self, grant: Grant) -> bool:
        with self._store.mutex:
            lock = self._store.locks[grant.token.lock]
            freed = lock.holder is not None
            lock.holder = None
            self._wake_head(lock)
            return freed


class CounterNotKept(_Mutant):
    """The token is derived from the current holder only: it restarts when the lock is idle."""

    def _grant(
        self,
        name: str,
        lock: _Lock,
        request_id: str,
        ttl: float,
        sent_at: float,
        on_lost: LostCallback,
        owner: str = "",
    ) -> Grant:
        lock.last_value = 0
        return super()._grant(name, lock, request_id, ttl, sent_at, on_lost, owner)


class RenewAfterExpiry(_Mutant):
    """renew() extends whatever is there: a stale holder renews the new holder's grant."""

    async def renew(self, grant: Grant) -> Grant:
        return dataclasses.replace(grant, sent_at=_clock.now())


class NotIdempotent(_Mutant):
    """A retried acquire with the same request id takes a second grant."""

    async def acquire(
        self,
        name: str,
        *,
        request_id: str,
        ttl: float,
        deadline: float | None,
        on_lost: LostCallback,
        owner: str = "",
    ) -> Grant:
        return await super().acquire(
            name,
            request_id=request_id + unique_name(),
            ttl=ttl,
            deadline=deadline,
            on_lost=on_lost,
            owner=owner,
        )


class LifoWaiters(_Mutant):
    """The newest waiter is served first."""

    def _wake_head(self, lock: _Lock) -> None:
        lock.queue.rotate(-1) if len(lock.queue) > 1 else None
        super()._wake_head(lock)


class SameTokenTwice(_Mutant):
    """Every other grant reuses the previous token."""

    calls: ClassVar[int] = 0

    def _grant(
        self,
        name: str,
        lock: _Lock,
        request_id: str,
        ttl: float,
        sent_at: float,
        on_lost: LostCallback,
        owner: str = "",
    ) -> Grant:
        SameTokenTwice.calls += 1
        if SameTokenTwice.calls % 2 == 0 and lock.last_value:
            lock.last_value -= 1
        return super()._grant(name, lock, request_id, ttl, sent_at, on_lost, owner)


class UnfencedForceRelease(_Mutant):
    """force_release() frees the lock whatever grant holds it, ignoring ``token``."""

    async def force_release(self, name: str, token: FencingToken | None = None) -> Any:
        return await super().force_release(name, None)


class StatusHidesTheHolder(_Mutant):
    """status() never reports a holder: a check cannot tell the live grant from a stale one."""

    async def status(self, name: str) -> Any:
        return dataclasses.replace(await super().status(name), holder=None, token=None)


class OwnerNotKept(_Mutant):
    """The holder's description is dropped: status cannot say who holds the lock."""

    def _grant(
        self,
        name: str,
        lock: _Lock,
        request_id: str,
        ttl: float,
        sent_at: float,
        on_lost: LostCallback,
        owner: str = "",
    ) -> Grant:
        return super()._grant(name, lock, request_id, ttl, sent_at, on_lost, "")


MUTANTS: list[tuple[type[_Mutant], Callable[..., Any]]] = [
    (UnfencedRelease, suite.test_backend_contract),
    (UnfencedRelease, suite.test_expiry_then_takeover_with_higher_token),
    (CounterNotKept, suite.test_tokens_strictly_increase),
    (SameTokenTwice, suite.test_tokens_strictly_increase),
    (RenewAfterExpiry, suite.test_backend_contract),
    (NotIdempotent, suite.test_idempotent_acquire_with_request_id),
    (LifoWaiters, suite.test_fifo_among_waiters),
    (OwnerNotKept, suite.test_status_shows_who_holds_it),
    (StatusHidesTheHolder, suite.test_check_says_current_stale_or_unknown),
    (UnfencedForceRelease, suite.test_force_release_frees_only_that_grant_and_the_holder_learns),
]


@pytest.fixture
def mutant_env(
    request: pytest.FixtureRequest, register_scheme: Callable[[str, str], None]
) -> Iterator[Any]:
    def make(cls: type[_Mutant]) -> MemoryEnv:
        scheme = "m" + cls.__name__.lower().lstrip("_")
        register_scheme(scheme, f"{__name__}:{cls.__name__}")
        return MemoryEnv(f"{scheme}://{unique_name()}")

    yield make


@pytest.mark.parametrize(("mutant", "check"), MUTANTS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_suite_catches_planted_bug(
    mutant: type[_Mutant], check: Callable[..., Any], mutant_env: Any
) -> None:
    env = mutant_env(mutant)
    if asyncio.iscoroutinefunction(check):
        check = _run_async(check)
    # A LockTimeout/LeaseLostError where the suite expected success is a caught bug too.
    with pytest.raises((AssertionError, pytest.fail.Exception, FencedError)):
        check(env)


def _run_async(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda env: asyncio.run(fn(env))


def test_the_same_checks_pass_on_the_correct_source(mutant_env: Any) -> None:
    env = mutant_env(_Mutant)
    for _, check in MUTANTS:
        if asyncio.iscoroutinefunction(check):
            check = _run_async(check)
        check(env)
    assert FencingToken("x", 1)  # the control run above raised nothing
