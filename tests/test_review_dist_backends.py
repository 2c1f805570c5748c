"""Adversarial review of the etcd, ZooKeeper and Redis token sources: each test here pins a bug
found in review (it failed before the fix) or a safety property checked against a planted
variant that breaks it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest

from fenced.backends.etcd import EtcdBackend
from fenced.testing.servers import EtcdServer
from tests.helpers import unique_name

NOOP: Callable[[BaseException], None] = lambda exc: None  # noqa: E731


# -- etcd: a create transaction replayed by the failover -----------------------------------


class LosesFirstAcquireReply(EtcdBackend):
    """A real etcd whose reply to the first acquire transaction is lost after it was applied.

    etcd answers "request timed out" when a proposal was not confirmed in time although it may
    still be applied; the transport then replays the transaction (on the next member). This
    variant applies the transaction for real and then reports exactly that.
    """

    lose = 1

    async def _txn(self, request: Any, what: str, deadline: float | None = None) -> Any:
        if what != "acquire" or self.lose <= 0:
            return await super()._txn(request, what, deadline)
        self.lose -= 1
        attempts = 0

        async def applied_then_lost(member: Any, timeout: float) -> Any:
            nonlocal attempts
            attempts += 1
            reply = await member.kv.Txn(request, timeout=timeout)
            if attempts == 1:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    details="etcdserver: request timed out",
                )
            return reply

        return await self._client.call(applied_then_lost, what=what, deadline=deadline)


async def _open_etcd(cls: type[EtcdBackend], server: EtcdServer, prefix: str) -> EtcdBackend:
    backend = await cls.open(urlsplit(server.url), {"prefix": prefix})
    assert isinstance(backend, cls)
    return backend


async def test_etcd_replayed_create_does_not_pool_the_holders_lease(
    etcd_server: EtcdServer,
) -> None:
    """The replayed create finds the key its first attempt made, bound to *this* lease.

    Bug: it took that for "the key exists already, this lease is unused", put the lease (which
    the held key is bound to) into the reuse pool and adopted the key as someone else's lease.
    The next acquire on the connection then bound its key to the same lease, and releasing
    the first lock revoked that lease (an adopted one is not recycled): the second lock was
    freed under a holder that still counted on it.
    """
    prefix = f"/fenced-review/{unique_name('e')}/"
    backend = await _open_etcd(LosesFirstAcquireReply, etcd_server, prefix)
    observer = await _open_etcd(EtcdBackend, etcd_server, prefix)
    first_lock, second_lock = unique_name(), unique_name()
    try:
        first = await backend.acquire(
            first_lock, request_id="a", ttl=10, deadline=None, on_lost=NOOP
        )
        assert (await observer.status(first_lock)).holder == "a"
        second = await backend.acquire(
            second_lock, request_id="b", ttl=10, deadline=None, on_lost=NOOP
        )
        assert await backend.release(first) is True
        status = await observer.status(second_lock)
        assert status.holder == "b", "releasing one lock freed another lock's holder"
        assert second.handle.lease.id != first.handle.lease.id, "two held keys shared a lease"
        await backend.renew(second)
        assert await backend.release(second) is True
    finally:
        await backend.aclose()
        await observer.aclose()


class SlowAcquireReply(EtcdBackend):
    """A real etcd whose reply to the acquire transaction is slow to come back: the
    transaction is applied at once, and the caller is held up until released by the test."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.applied = asyncio.Event()
        self.reply = asyncio.Event()

    async def _txn(self, request: Any, what: str, deadline: float | None = None) -> Any:
        reply = await super()._txn(request, what, deadline)
        if what == "acquire":
            self.applied.set()
            await self.reply.wait()
        return reply


async def test_etcd_acquire_cancelled_in_flight_leaves_no_key_behind(
    etcd_server: EtcdServer,
) -> None:
    """An acquire cancelled while its create transaction is in flight (applied, reply not yet
    read) must not leave its key to block the lock until the lease's ttl runs out.

    Bug: only a LockTimeout revoked the lease; after a cancellation the key stayed at the
    head of the queue, held by nobody, for the whole ttl (here 30 s).
    """
    prefix = f"/fenced-review/{unique_name('e')}/"
    slow = await _open_etcd(SlowAcquireReply, etcd_server, prefix)
    other = await _open_etcd(EtcdBackend, etcd_server, prefix)
    name = unique_name()
    try:
        task = asyncio.create_task(
            slow.acquire(name, request_id="gone", ttl=30, deadline=None, on_lost=NOOP)
        )
        await _bounded(slow.applied.wait())
        assert (await other.status(name)).holder == "gone"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The lock is free again well before the 30 s ttl.
        grant = await _bounded(
            other.acquire(name, request_id="next", ttl=5, deadline=None, on_lost=NOOP), 5.0
        )
        assert await other.release(grant) is True
    finally:
        await slow.aclose()
        await other.aclose()


async def _bounded(aw: Awaitable[Any], seconds: float = 10.0) -> Any:
    return await asyncio.wait_for(aw, seconds)


pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
