"""``memory://NAME``: an in-process token source, for unit tests of code that uses fenced.

Every connection to the same NAME in one process shares one set of locks, across threads and
event loops. Nothing survives the process: it is neither durable nor distributed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import threading
from typing import Any, ClassVar
from urllib.parse import SplitResult

from .._core import clock as _clock
from .._core.backend import (
    Backend,
    Characteristic,
    Grant,
    LockStatus,
    LostCallback,
    Record,
    lock_timeout,
)
from .._core.errors import LeaseLostError, RecordConflict
from .._core.token import FencingToken

__all__ = ["MemoryBackend"]


@dataclasses.dataclass
class _Holder:
    request_id: str
    token: FencingToken
    ttl: float
    expires_at: float
    on_lost: LostCallback
    owner: str = ""


@dataclasses.dataclass(eq=False)
class _Waiter:
    request_id: str
    loop: asyncio.AbstractEventLoop
    wake: asyncio.Event


@dataclasses.dataclass
class _Lock:
    last_value: int = 0
    holder: _Holder | None = None
    queue: collections.deque[_Waiter] = dataclasses.field(default_factory=collections.deque)


class _Store:
    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.locks: dict[str, _Lock] = collections.defaultdict(_Lock)
        self.records: dict[str, Record] = {}


_stores: dict[str, _Store] = {}
_stores_mutex = threading.Lock()


class MemoryBackend(Backend):
    scheme: ClassVar[str] = "memory"
    characteristics: ClassVar[frozenset[Characteristic]] = frozenset(
        {
            Characteristic.LINEARIZABLE,
            Characteristic.FIFO,
            Characteristic.SERVER_EXPIRY,
            Characteristic.LOST_NOTIFICATION,
        }
    )
    caller_driven: ClassVar[bool] = True  # plain Python state, no threads of its own
    process_local: ClassVar[bool] = True  # each process has its own memory://NAME

    def __init__(self, store: _Store) -> None:
        self._store = store
        self._closed = False
        self._waiters: set[_Waiter] = set()  # this connection's, woken (to fail) by aclose

    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> MemoryBackend:
        cls.options(url, options)  # none: refuses any given
        key = url.netloc + url.path
        with _stores_mutex:
            store = _stores.setdefault(key, _Store())
        return cls(store)

    @staticmethod
    def reset(name: str = "") -> None:
        """Forget every lock of ``memory://name`` (for test isolation)."""
        with _stores_mutex:
            _stores.pop(name, None)

    def _expire(self, name: str, lock: _Lock, now: float) -> None:
        holder = lock.holder
        if holder is not None and holder.expires_at <= now:
            lock.holder = None
            holder.on_lost(LeaseLostError(f"lease on {name!r} (token {holder.token}) expired"))

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
        lock.last_value += 1
        token = FencingToken(name, lock.last_value)
        lock.holder = _Holder(request_id, token, ttl, sent_at + ttl, on_lost, owner)
        return Grant(token, request_id, ttl, sent_at)

    def _wake_head(self, lock: _Lock) -> None:
        if lock.queue:
            head = lock.queue[0]
            try:
                head.loop.call_soon_threadsafe(head.wake.set)
            except RuntimeError:  # its loop is gone: drop it and try the next
                lock.queue.popleft()
                self._wake_head(lock)

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
        self._check_open()
        store = self._store
        waiter: _Waiter | None = None
        try:
            while True:
                now = _clock.now()
                with store.mutex:
                    self._check_open()  # under the mutex: aclose cannot slip in unseen
                    lock = store.locks[name]
                    self._expire(name, lock, now)
                    holder = lock.holder
                    if holder is not None and holder.request_id == request_id:
                        return Grant(
                            holder.token, request_id, holder.ttl, holder.expires_at - holder.ttl
                        )
                    first = not lock.queue or (waiter is not None and lock.queue[0] is waiter)
                    if holder is None and first:
                        if waiter is not None:
                            lock.queue.popleft()
                            self._waiters.discard(waiter)
                            waiter = None
                        return self._grant(name, lock, request_id, ttl, now, on_lost, owner)
                    if deadline is not None and now >= deadline:
                        raise lock_timeout(name)
                    if waiter is None:
                        waiter = _Waiter(request_id, asyncio.get_running_loop(), asyncio.Event())
                        lock.queue.append(waiter)
                        self._waiters.add(waiter)
                    waiter.wake.clear()
                    wait_until = holder.expires_at if holder is not None else None
                if deadline is not None:
                    wait_until = deadline if wait_until is None else min(wait_until, deadline)
                timeout = None if wait_until is None else max(0.0, wait_until - _clock.now())
                try:
                    await asyncio.wait_for(waiter.wake.wait(), timeout)
                except TimeoutError:
                    pass
                self._check_open()
        finally:
            if waiter is not None:
                with store.mutex:
                    lock = store.locks[name]
                    was_head = bool(lock.queue) and lock.queue[0] is waiter
                    lock.queue.remove(waiter)
                    self._waiters.discard(waiter)
                    if was_head and lock.holder is None:
                        self._wake_head(lock)

    async def renew(self, grant: Grant) -> Grant:
        self._check_open()
        now = _clock.now()
        with self._store.mutex:
            lock = self._store.locks[grant.token.lock]
            self._expire(grant.token.lock, lock, now)
            holder = lock.holder
            if holder is None or holder.token != grant.token:
                raise LeaseLostError(f"lease {grant.token} is no longer held")
            # (for the ttl the renewal asks, which its answer states: not the acquire's)
            holder.ttl = grant.ttl
            holder.expires_at = now + grant.ttl
            return dataclasses.replace(grant, sent_at=now)

    async def release(self, grant: Grant) -> bool:
        self._check_open()
        with self._store.mutex:
            lock = self._store.locks[grant.token.lock]
            self._expire(grant.token.lock, lock, _clock.now())
            if lock.holder is None or lock.holder.token != grant.token:
                return False
            lock.holder = None
            self._wake_head(lock)
            return True

    async def lock_names(self) -> list[str]:
        self._check_open()
        with self._store.mutex:
            return sorted(self._store.locks)

    async def force_release(
        self, name: str, token: FencingToken | None = None
    ) -> LockStatus | None:
        status = await self.status(name)
        with self._store.mutex:
            lock = self._store.locks[name]
            holder = lock.holder
            if holder is None or holder.token != status.token:
                return None  # (changed since: an operator looks again)
            if token is not None and holder.token != token:
                return None
            lock.holder = None
            self._wake_head(lock)
        holder.on_lost(
            LeaseLostError(f"lease on {name!r} (token {holder.token}) was released by an operator")
        )
        return status

    async def status(self, name: str) -> LockStatus:
        self._check_open()
        now = _clock.now()
        with self._store.mutex:
            lock = self._store.locks[name]
            self._expire(name, lock, now)
            holder = lock.holder
            last = FencingToken(name, lock.last_value) if lock.last_value else None
            return LockStatus(
                name=name,
                holder=holder.request_id if holder else None,
                token=holder.token if holder else None,
                last_token=last,
                remaining=max(0.0, holder.expires_at - now) if holder else None,
                waiters=len(lock.queue),
                owner=(holder.owner or None) if holder else None,
                ttl=holder.ttl if holder else None,
            )

    async def read_record(self, name: str) -> Record | None:
        self._check_open()
        with self._store.mutex:
            return self._store.records.get(name)

    async def swap_record(self, name: str, version: int, value: str) -> Record:
        self._check_open()
        with self._store.mutex:
            current = self._store.records.get(name)
            found = 0 if current is None else current.version
            if found != version:
                raise RecordConflict(name, version, found)
            record = self._store.records[name] = Record(name, version + 1, value)
            return record

    async def aclose(self) -> None:
        with self._store.mutex:
            self._closed = True
            waiters = list(self._waiters)
        for waiter in waiters:  # each sees the closed connection and leaves the queue
            with contextlib.suppress(RuntimeError):  # its loop is gone
                waiter.loop.call_soon_threadsafe(waiter.wake.set)
