"""Token sources for tests: the memory source with one behaviour changed.

Registered by scheme with the ``register_scheme`` fixture (or ``fenced.register_backend`` in
a child process), as ``tests.sources.variants:<Class>``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import Callable
from typing import Any, ClassVar
from urllib.parse import SplitResult

import fenced
from fenced._core.backend import Grant, LostCallback
from fenced.backends.memory import MemoryBackend


class _TestSource(MemoryBackend):
    """The memory source, with the acquire contract's signature written once: subclasses
    change what is asked (``_ask``) or what comes back (``_answer``)."""

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
        owner: str = "",
    ) -> Grant:
        grant = await super().acquire(
            name,
            request_id=request_id,
            ttl=self._ask(request_id, ttl),
            deadline=deadline,
            on_lost=on_lost,
            owner=owner,
        )
        return self._answer(grant, ttl)

    def _ask(self, request_id: str, ttl: float) -> float:
        return ttl

    def _answer(self, grant: Grant, ttl: float) -> Grant:
        return grant


class CappedSource(_TestSource):
    """Grants a shorter lease than asked (as ZooKeeper does when it negotiates the session)."""

    scheme: ClassVar[str] = "capped"
    cap: ClassVar[float] = 1.2

    def _ask(self, request_id: str, ttl: float) -> float:
        return min(ttl, CappedSource.cap)

    async def renew(self, grant: Grant) -> Grant:
        await asyncio.sleep(0.05)  # a real source answers after a round trip, not instantly
        return await super().renew(grant)


class GatedSource(_TestSource):
    """Renewals wait at a gate, like a renewal whose reply is still on the network."""

    scheme: ClassVar[str] = "gated"
    gate: ClassVar[asyncio.Event | None] = None

    async def renew(self, grant: Grant) -> Grant:
        if GatedSource.gate is not None:
            await GatedSource.gate.wait()
        return await super().renew(grant)


class GoneAfterGrantSource(_TestSource):
    """Grants, then becomes unreachable: every renew and release fails."""

    scheme: ClassVar[str] = "goneaftergrant"
    process_local: ClassVar[bool] = False  # (run inside one `fenced lock`: the test needs no other)

    async def renew(self, grant: Grant) -> Grant:
        raise fenced.BackendUnavailable("the source went away")

    async def release(self, grant: Grant) -> bool:
        raise fenced.BackendUnavailable("the source went away")


def register_source(register_scheme: Callable[[str, str], None], cls: type[_TestSource]) -> None:
    register_scheme(cls.scheme, f"tests.sources.variants:{cls.__name__}")


class FlakyBackend(_TestSource):
    """A memory source whose renewals (or first acquires) can be made to fail."""

    scheme: ClassVar[str] = "flaky"
    fail_renew = False
    fail_acquires = 0
    acquire_calls: ClassVar[list[str]] = []

    def _ask(self, request_id: str, ttl: float) -> float:
        FlakyBackend.acquire_calls.append(request_id)
        return ttl

    def _answer(self, grant: Grant, ttl: float) -> Grant:
        if FlakyBackend.fail_acquires:
            FlakyBackend.fail_acquires -= 1
            raise fenced.BackendUnavailable("reply lost")  # granted, but the reply never arrived
        return grant

    async def renew(self, grant: Grant) -> Grant:
        if FlakyBackend.fail_renew:
            raise fenced.BackendUnavailable("partitioned")
        return await super().renew(grant)


class ReleaseFindsItGone(_TestSource):
    """The source had already let the grant go when the holder releases it."""

    scheme: ClassVar[str] = "gone"

    async def release(self, grant: Grant) -> bool:
        await super().release(grant)
        return False


class LateReplies(_TestSource):
    """A memory source whose first ``late`` grants arrive after their lease ran out."""

    scheme: ClassVar[str] = "late"
    late = 0

    def _answer(self, grant: Grant, ttl: float) -> Grant:
        if LateReplies.late:
            LateReplies.late -= 1
            # As if the request had been sent a whole ttl ago: nothing surely left of it.
            return dataclasses.replace(grant, sent_at=grant.sent_at - ttl)
        return grant


class InterruptedAfterGrant(_TestSource):
    """SIGINT arrives (once) just after the source granted, before the client recorded it."""

    scheme: ClassVar[str] = "sigint"
    armed = False

    def _answer(self, grant: Grant, ttl: float) -> Grant:
        if InterruptedAfterGrant.armed:
            InterruptedAfterGrant.armed = False
            signal.raise_signal(signal.SIGINT)
        return grant
