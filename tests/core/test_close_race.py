"""``Locks.close()`` from one thread while other threads acquire and release through the same
connection (the sync API, both portal modes, on real sources): once close() returns, no grant
made through that connection is still held at the source, and every call racing with it ends
with a typed error (BackendUnavailable), never a hang.

Found by an attacker (F5): close() released the leases it saw held when it began, then
closed the connection; an acquire granted meanwhile, or a release in flight when the
connection closed under it, left its grant held at the source until its ttl ran out.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import fenced
from fenced.testing.servers import RedisServer
from tests.helpers import unique_name

THREADS = 6
ROUNDS = 4  # close() comes at a different moment of the threads' loops each round


@pytest.fixture(params=["redis", "postgresql", "sqlite", "etcd", "zookeeper"])
def source(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    kind = request.param
    if kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        yield server.url, {"key_prefix": unique_name("t") + ":"}
    elif kind == "postgresql":
        yield request.getfixturevalue("pg_dsn"), {}
    elif kind in ("etcd", "zookeeper"):
        yield request.getfixturevalue(f"{'zk' if kind == 'zookeeper' else kind}_server").url, {}
    else:
        yield f"sqlite:///{tmp_path}/locks.db", {}


def _race(url: str, options: dict[str, Any], names: list[str]) -> list[BaseException]:
    """THREADS threads acquire and release ``names`` in a loop through one connection; the
    main thread closes it once each thread has made a few grants. Returns what the threads
    raised (after close() returned, each thread ends within its call's bound)."""
    locks = fenced.connect(url, **options)
    started = threading.Barrier(THREADS + 1)
    grants = [0] * THREADS
    going = threading.Event()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        lease = locks.lock(names[i % len(names)], ttl=60, timeout=30)
        started.wait()
        try:
            while True:
                lease.acquire()
                grants[i] += 1
                if grants[i] == 3:
                    going.set()
                lease.release()
        except BaseException as exc:  # (the end: the connection was closed under it)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
    for t in threads:
        t.start()
    started.wait()
    assert going.wait(30), "no thread got its grants"
    locks.close()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a call racing with close() hangs"
    return errors


@pytest.mark.usefixtures("portal_mode")
def test_close_while_threads_acquire_leaves_no_grant_held(
    source: tuple[str, dict[str, Any]],
) -> None:
    url, options = source
    names = [unique_name("close") for _ in range(3)]
    with fenced.connect(url, **options) as observer:
        for _ in range(ROUNDS):
            errors = _race(url, options, names)
            held = {n: s.holder for n in names if (s := observer.status(n)).holder is not None}
            assert not held, f"grants still held after close() returned: {held}"
            assert errors and all(isinstance(e, fenced.BackendUnavailable) for e in errors), [
                repr(e) for e in errors
            ]


async def _arace(url: str, options: dict[str, Any], names: list[str]) -> list[BaseException]:
    """:func:`_race` with the asyncio API: tasks on the application's loop (where SQLite runs
    its transactions on a worker thread), aclose() from one more task."""
    locks = await fenced.connect_async(url, **options).open()
    grants = [0] * THREADS
    going = asyncio.Event()
    errors: list[BaseException] = []

    async def worker(i: int) -> None:
        lease = locks.lock(names[i % len(names)], ttl=60, timeout=30)
        try:
            while True:
                await lease.acquire()
                grants[i] += 1
                if grants[i] == 3:
                    going.set()
                await lease.release()
        except Exception as exc:
            errors.append(exc)

    tasks = [asyncio.create_task(worker(i)) for i in range(THREADS)]
    async with asyncio.timeout(30):
        await going.wait()
    await locks.aclose()
    async with asyncio.timeout(30):  # (a call racing with aclose() must not hang)
        await asyncio.gather(*tasks)
    return errors


async def test_aclose_while_tasks_acquire_leaves_no_grant_held(
    source: tuple[str, dict[str, Any]],
) -> None:
    url, options = source
    names = [unique_name("close") for _ in range(3)]
    async with fenced.connect_async(url, **options) as observer:
        for _ in range(ROUNDS):
            errors = await _arace(url, options, names)
            held = {
                n: s.holder for n in names if (s := await observer.status(n)).holder is not None
            }
            assert not held, f"grants still held after aclose() returned: {held}"
            assert errors and all(isinstance(e, fenced.BackendUnavailable) for e in errors), [
                repr(e) for e in errors
            ]


def test_close_names_the_leases_it_could_not_release(caplog: pytest.LogCaptureFixture) -> None:
    """The source down at close() (killed): close() still returns, and says on the ``fenced``
    logger which leases stay held until their ttl, by name and token (the server, back,
    still has that grant). Both sides: a close that could release everything says nothing."""
    name, other = unique_name("kept"), unique_name("freed")
    with RedisServer() as server:
        with caplog.at_level(logging.WARNING, logger="fenced"):
            with fenced.connect(server.url, socket_timeout=0.5) as locks:
                locks.lock(other, ttl=60).acquire()
            assert not [r for r in caplog.records if "could not be released" in r.message]
            locks = fenced.connect(server.url, socket_timeout=0.5)
            token = locks.lock(name, ttl=60).acquire()
            server.kill()
            began = time.monotonic()
            locks.close()
            assert time.monotonic() - began < 10
        (said,) = [r.message for r in caplog.records if "could not be released" in r.message]
        assert f"{name!r} (token {token})" in said and "until its ttl runs out" in said
        server.start()
        with fenced.connect(server.url) as observer:
            assert observer.status(name).token == token  # (held, as it said)
            assert observer.status(other).holder is None
