"""The Redis token source beyond the conformance suite: crashes, unsafe configurations, paused
processes, wake-ups without polling, and planted bugs that the monotonicity checks must catch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest
import redis

import fenced
from fenced._core import clock as _clock
from fenced._core.backend import Grant, LostCallback
from fenced._core.token import FencingToken
from fenced.backends.redis import ACQUIRE_LUA, LEAVE_LUA, RELEASE_LUA, RENEW_LUA, RedisBackend
from fenced.testing.proxy import TcpProxy
from fenced.testing.servers import RedisServer
from tests.helpers import (
    async_wait_for,
    check_paused_holder_is_fenced_off,
    read_line,
    spawn_python,
    unique_name,
    wait_for,
)

# -- the checker ------------------------------------------------------------------------------


def assert_monotonic(grants: list[int]) -> None:
    """Tokens recorded by holders, in the order they held the lock, must strictly increase.

    Holders append while holding, so the list is in grant order; a repeated or lower token
    means a token was reused (a lost counter) or taken out of order (a racy counter).
    """
    assert grants, "no grants recorded"
    for i, (a, b) in enumerate(zip(grants, grants[1:], strict=False)):
        assert a < b, f"grant #{i + 1} has token {b} after {a}: {grants[max(0, i - 3) : i + 4]}"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A private server for tests that kill or reconfigure it."""
    with RedisServer() as s:
        yield s  # type: ignore[misc]


def _prefix() -> str:
    return unique_name("t") + ":"


# -- crash: kill -9 mid-run reuses no token --------------------------------------------------


def crash_run(server: RedisServer, **options: Any) -> tuple[list[int], int]:
    """Four clients acquire in a loop; the server is killed (-9) and restarted mid-run.

    Returns the grants in order and how many were made before the kill.
    """
    name = unique_name("crash")
    grants: list[int] = []
    stop = threading.Event()
    failures: list[BaseException] = []
    options = {"key_prefix": _prefix(), **options}

    def client() -> None:
        try:
            while not stop.is_set():
                try:
                    locks = fenced.connect(server.url, **options)
                except fenced.BackendUnavailable:  # the server is down right now
                    stop.wait(0.05)
                    continue
                with locks:
                    while not stop.is_set():
                        try:
                            with locks.lock(name, ttl=1, timeout=10) as lease:
                                grants.append(lease.token.value)
                        except (
                            fenced.BackendUnavailable,
                            fenced.LeaseLostError,
                            fenced.LockTimeout,
                        ):
                            continue
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(grants) >= 40, timeout=20, what="grants before the crash")
        server.kill()
        before = len(grants)
        server.start()
        wait_for(lambda: len(grants) >= before + 40, timeout=30, what="grants after the restart")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not failures, failures
    return grants, before


def test_kill_9_mid_run_reuses_no_token(server: RedisServer) -> None:
    grants, before = crash_run(server)
    assert_monotonic(grants)
    assert max(grants[before:]) > max(grants[:before])


def test_crash_check_catches_a_counter_that_is_not_persisted() -> None:
    # Planted bug: no AOF at all (explicitly allowed): the counter restarts after kill -9.
    with RedisServer(extra=["--appendonly", "no"]) as server:
        grants, _ = crash_run(server, allow_unsafe_durability=True)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="after"):
        assert_monotonic(grants)


# -- unsafe configurations are refused -------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (["--appendfsync", "everysec"], "appendfsync"),
        (["--appendonly", "no"], "appendonly"),
        (["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"], "maxmemory-policy"),
        (["--maxmemory", "100mb", "--maxmemory-policy", "volatile-ttl"], "maxmemory-policy"),
        (["--no-appendfsync-on-rewrite", "yes"], "no-appendfsync-on-rewrite"),
    ],
)
def test_refuses_a_server_that_can_lose_tokens(
    extra: list[str], problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    with RedisServer(extra=extra) as server:
        with pytest.raises(fenced.UnsafeBackendError, match=problem):
            fenced.connect(server.url)
        # The opt-out, by keyword and in the URL: runs, with a warning.
        with caplog.at_level(logging.WARNING, logger="fenced.redis"):
            with fenced.connect(server.url, allow_unsafe_durability=True) as locks:  # type: ignore[arg-type]
                with locks.lock(unique_name(), ttl=5) as lease:
                    assert lease.token.value == 1
                backend = locks.aio.backend
                assert backend.verified_durable is False  # type: ignore[attr-defined]
                have = backend.effective_characteristics  # type: ignore[attr-defined]
                assert fenced.Characteristic.DURABLE not in have
        assert any("allow_unsafe_durability" in r.getMessage() for r in caplog.records)
        with fenced.connect(server.url + "?allow_unsafe_durability=true") as locks:
            assert locks.status(unique_name()).holder is None
            assert fenced.Characteristic.DURABLE not in locks.characteristics
        # The opt-out never satisfies a requirement of durability.
        with pytest.raises(fenced.ConfigurationError, match="durable"):
            fenced.connect(server.url, require={"durable"}, allow_unsafe_durability=True)  # type: ignore[arg-type]


def test_refuses_a_server_with_a_replica() -> None:
    with RedisServer() as primary:
        with RedisServer(extra=["--replicaof", "127.0.0.1", str(primary.port)]) as replica:
            native = redis.Redis(port=primary.port)
            wait_for(
                lambda: native.info("replication")["connected_slaves"] == 1,
                what="the replica to attach",
            )
            native.close()
            with pytest.raises(fenced.UnsafeBackendError, match="replica"):
                fenced.connect(primary.url)
            with pytest.raises(fenced.UnsafeBackendError, match="role"):
                fenced.connect(replica.url)
            with fenced.connect(primary.url, allow_unsafe_durability=True) as locks:  # type: ignore[arg-type]
                with locks.lock(unique_name(), ttl=5):
                    pass


def test_same_connection_survives_a_server_restart(server: RedisServer) -> None:
    name = unique_name()
    with fenced.connect(server.url, key_prefix=_prefix()) as locks:  # type: ignore[arg-type]
        with locks.lock(name, ttl=5) as lease:
            before = lease.token
        server.restart(kill=True)
        with locks.lock(name, ttl=5, timeout=10) as lease:
            assert lease.token > before
        assert locks.aio.backend.verified_durable is True  # type: ignore[attr-defined]


def test_rechecks_the_configuration_after_a_reconnect(server: RedisServer) -> None:
    name = unique_name()
    with fenced.connect(server.url, key_prefix=_prefix()) as locks:  # type: ignore[arg-type]
        with locks.lock(name, ttl=5):
            pass
        # The server comes back on the same port and data, but no longer fsyncs every write.
        server.kill()
        server.extra = ["--appendfsync", "everysec"]
        server.start()
        with pytest.raises(fenced.UnsafeBackendError, match="appendfsync"):
            locks.lock(name, ttl=5).acquire(timeout=5)


def test_the_durable_configuration_is_accepted(redis_server: RedisServer) -> None:
    with fenced.connect(redis_server.url, require={"durable", "fifo"}) as locks:
        backend = locks.aio.backend
        assert backend.verified_durable is True  # type: ignore[attr-defined]
        assert backend.effective_characteristics == RedisBackend.characteristics  # type: ignore[attr-defined]


def test_is_not_linearizable(redis_server: RedisServer) -> None:
    with pytest.raises(fenced.ConfigurationError, match="linearizable"):
        fenced.connect(redis_server.url, require={"linearizable"})
    assert fenced.Characteristic.LINEARIZABLE not in RedisBackend.characteristics


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"no_such_option": 1}, "unknown"),
        ({"allow_unsafe_durability": "maybe"}, "True or False"),
        ({"key_prefix": "a{b}"}, "braces"),
        ({"waiter_heartbeat": 0}, "waiter_heartbeat"),
        ({"socket_timeout": -1}, "socket_timeout"),
        ({"client_name": "a b"}, "refused an option of the connection: Client names"),
    ],
)
def test_bad_options(redis_server: RedisServer, options: dict[str, Any], match: str) -> None:
    with pytest.raises(fenced.ConfigurationError, match=match):
        fenced.connect(redis_server.url, **options)


@pytest.mark.parametrize(
    ("query", "match"),
    [("bogus=1", "unknown"), ("socket_timeout=abc", "socket_timeout"), ("key_prefix=a{", "braces")],
)
def test_bad_url_options(redis_server: RedisServer, query: str, match: str) -> None:
    with pytest.raises(fenced.ConfigurationError, match=match):
        fenced.connect(f"{redis_server.url}?{query}")


def test_url_options(redis_server: RedisServer) -> None:
    prefix, name = _prefix(), unique_name()
    url = f"{redis_server.url.rsplit('/', 1)[0]}/3?key_prefix={prefix}&socket_timeout=7"
    with fenced.connect(url) as locks, locks.lock(name, ttl=5):
        pass
    native = redis.Redis(port=redis_server.port, db=3)
    try:
        assert native.get(f"{prefix}{{{name}}}:token") == b"1"
    finally:
        native.close()


# -- paused processes ------------------------------------------------------------------------


def test_paused_holder_is_fenced_off(redis_server: RedisServer) -> None:
    check_paused_holder_is_fenced_off(
        redis_server.url, ttl=1.0, acquire_timeout=10, key_prefix=_prefix()
    )


_WAITER = """
import sys, fenced
url, prefix, name = sys.argv[1], sys.argv[2], sys.argv[3]
with fenced.connect(url, key_prefix=prefix, waiter_heartbeat=0.5) as locks:
    print("waiting", flush=True)
    with locks.lock(name, ttl=5, timeout=60) as lease:
        print("token", lease.token.value, flush=True)
"""


def test_a_paused_waiter_is_skipped(redis_server: RedisServer) -> None:
    prefix, name = _prefix(), unique_name()
    with fenced.connect(
        redis_server.url,
        key_prefix=prefix,  # type: ignore[arg-type]
        waiter_heartbeat=0.5,  # type: ignore[arg-type]
    ) as locks:
        holder = locks.lock(name, ttl=10)
        held = holder.acquire()
        proc = spawn_python(_WAITER, redis_server.url, prefix, name)
        try:
            assert read_line(proc) == "waiting"
            wait_for(lambda: locks.status(name).waiters == 1, what="the process to queue")
            second_lease = locks.lock(name, ttl=5)
            second: list[FencingToken] = []
            thread = threading.Thread(target=lambda: second.append(second_lease.acquire(20)))
            thread.start()
            wait_for(lambda: locks.status(name).waiters == 2, what="the thread to queue")
            os.kill(proc.pid, signal.SIGSTOP)  # the first waiter stops heart-beating
            wait_for(lambda: locks.status(name).waiters == 1, what="the paused waiter to lapse")
            holder.release()
            thread.join(10)
            assert second and second[0] > held  # the live waiter was not stuck behind it
            os.kill(proc.pid, signal.SIGCONT)
            # The resumed waiter queues again, and gets the lock after the thread lets go.
            wait_for(lambda: locks.status(name).waiters == 1, what="the waiter to re-queue")
            assert second_lease.release() is True
            word, value = read_line(proc).split()
            assert word == "token" and int(value) > second[0].value
            assert proc.wait(10) == 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


# -- waking without polling ------------------------------------------------------------------


async def test_release_wakes_the_next_waiter_at_once(redis_server: RedisServer) -> None:
    # The waiter's own re-check interval (heartbeat/3, capped at socket_timeout/2 = 5 s) is
    # far longer than the hand-off may take.
    url, opts = redis_server.url, {"key_prefix": _prefix(), "waiter_heartbeat": 60}
    name = unique_name()
    async with fenced.connect_async(url, **opts) as a, fenced.connect_async(url, **opts) as b:
        holder = a.lock(name, ttl=30)
        await holder.acquire()
        waiter = asyncio.create_task(b.lock(name, ttl=30).acquire(timeout=20))
        await async_wait_for(lambda: _waiters_are(a, name, 1), what="the waiter to queue")
        released_at = _clock.now()
        await holder.release()
        token = await waiter
        assert token > holder.token
        assert _clock.now() - released_at < 1.0


async def test_waiter_rechecks_when_the_holder_expires(redis_server: RedisServer) -> None:
    url, opts = redis_server.url, {"key_prefix": _prefix(), "waiter_heartbeat": 60}
    name = unique_name()
    async with fenced.connect_async(url, **opts) as a, fenced.connect_async(url, **opts) as b:
        holder = a.lock(name, ttl=0.5, auto_renew=False)
        await holder.acquire()
        start = _clock.now()
        token = await b.lock(name, ttl=30).acquire(timeout=15)
        # Nobody released: the waiter re-checked at the holder's expiry, not 20 s later.
        assert token > holder.token
        assert _clock.now() - start < 3.0


async def test_cancelled_waiter_leaves_the_queue(redis_server: RedisServer) -> None:
    url, opts = redis_server.url, {"key_prefix": _prefix()}
    name = unique_name()
    async with fenced.connect_async(url, **opts) as locks:
        holder = locks.lock(name, ttl=30)
        await holder.acquire()
        waiter = asyncio.create_task(locks.lock(name, ttl=30).acquire())
        await async_wait_for(lambda: _waiters_are(locks, name, 1), what="the waiter to queue")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (await locks.status(name)).waiters == 0
        await holder.release()
        # Nobody is left in line: an immediate try gets the lock.
        async with locks.lock(name, ttl=5, timeout=0) as lease:
            assert lease.token > holder.token


class FastPathIgnoresTheQueue(RedisBackend):
    """Planted bug: the uncontended fast path grants a free lock without looking at the queue."""

    acquire_lua: ClassVar[str] = ACQUIRE_LUA.replace(
        "if redis.call('EXISTS', KEYS[2], KEYS[3]) == 0 then",
        "if redis.call('EXISTS', KEYS[2]) == 0 then",
        1,
    )


async def queue_jump_violations(url: str, port: int) -> list[str]:
    """The holder's key expired while a waiter is queued and not looking (between re-checks):
    a newcomer's acquire must hand the lock to the waiter and be refused, although the lock
    is free, which is the uncontended fast path's turf."""
    prefix, name = _prefix(), unique_name()
    base = f"{prefix}{{{name}}}"
    keys = [f"{base}:{k}" for k in ("token", "holder", "queue", "hb", "seq", "ttls", "owners")]
    raw = redis.Redis(port=port, decode_responses=True)
    bad: list[str] = []
    try:
        script = raw.register_script(ACQUIRE_LUA)
        hold = script(keys=keys[:3], args=["A", 60_000, "", 60_000])
        queued = script(keys=keys[:3], args=["B", 60_000, "b", 60_000])
        assert isinstance(hold, int) and queued[0] == 0  # A: a fresh grant (the bare token)
        raw.pexpire(keys[1], 1)  # A's lease runs out (server clock), nobody released
        wait_for(lambda: not raw.exists(keys[1]), what="the holder's key to expire")
        async with fenced.connect_async(url, key_prefix=prefix) as locks:
            try:
                await locks.lock(name, ttl=5, timeout=0).acquire()
                bad.append("a newcomer was granted the lock ahead of the queued waiter")
            except fenced.LockTimeout:
                pass
            status = await locks.status(name)
            if status.holder != "B" or status.owner != "b":
                bad.append(f"held by {status.holder!r} ({status.owner!r}), not the waiter")
        # B's next look finds its grant (the next token) waiting on its list.
        handed = raw.lrange(f"{base}:wake:B", 0, -1)
        if handed != [f"{hold + 1}:60000"]:
            bad.append(f"the waiter's wake list holds {handed}")
    finally:
        raw.close()
    return bad


async def test_a_newcomer_does_not_jump_a_queue_whose_holder_expired(
    redis_server: RedisServer,
) -> None:
    assert await queue_jump_violations(redis_server.url, redis_server.port) == []


async def test_queue_jump_check_catches_a_fast_path_that_ignores_the_queue(
    redis_server: RedisServer, register_scheme: Callable[[str, str], None]
) -> None:
    assert FastPathIgnoresTheQueue.acquire_lua != ACQUIRE_LUA  # the bug is really planted
    register_scheme("redisplanted", f"{__name__}:FastPathIgnoresTheQueue")
    url = redis_server.url.replace("redis://", "redisplanted://", 1)
    bad = await queue_jump_violations(url, redis_server.port)
    assert "a newcomer was granted the lock ahead of the queued waiter" in bad, bad


async def _waiters_are(locks: fenced.AsyncLocks, name: str, n: int) -> bool:
    return (await locks.status(name)).waiters == n


# -- planted bugs: the monotonicity check must catch them ------------------------------------


async def contend(url: str, clients: int, grants_wanted: int, **options: Any) -> list[int]:
    """``clients`` connections take one lock in turns; holders record their tokens in order."""
    name = unique_name("contend")
    grants: list[int] = []

    async def client() -> None:
        async with fenced.connect_async(url, **options) as locks:
            while len(grants) < grants_wanted:
                async with locks.lock(name, ttl=5, timeout=20) as lease:
                    grants.append(lease.token.value)
                    await asyncio.sleep(0)

    await asyncio.gather(*(client() for _ in range(clients)))
    return grants


async def test_tokens_increase_in_grant_order_under_contention(
    redis_server: RedisServer,
) -> None:
    grants = await contend(redis_server.url, 6, 150, key_prefix=_prefix())
    assert_monotonic(grants)


class CounterDeletedWithHolder(RedisBackend):
    """Planted bug: release deletes the token counter along with the holder key."""

    release_lua: ClassVar[str] = RELEASE_LUA.replace(
        "redis.call('RENAME', KEYS[1],",
        "redis.call('DEL', string.sub(KEYS[1], 1, -7) .. 'token')\n  redis.call('RENAME', KEYS[1],",
        1,
    )


_INCR = "local n = redis.call('INCR', KEYS[1])"
_INCR_WITH_TTL = _INCR + " redis.call('PEXPIRE', KEYS[1], ttl)"


class CounterWithTTL(RedisBackend):
    """Planted bug: the token counter expires along with the lease that last used it."""

    acquire_lua: ClassVar[str] = ACQUIRE_LUA.replace(_INCR, _INCR_WITH_TTL)
    release_lua: ClassVar[str] = RELEASE_LUA.replace(_INCR, _INCR_WITH_TTL)
    leave_lua: ClassVar[str] = LEAVE_LUA.replace(_INCR, _INCR_WITH_TTL)


_GRAB_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. ARGV[1], 'PX', ARGV[3])
return 1
"""


class IncrOutsideTheScript(RedisBackend):
    """Planted bug: the token is taken with INCR in its own round trip, before the grab."""

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
        keys, _ = self._keys(name)
        ttl_ms = round(ttl * 1000)
        token = await self._client.incr(keys[0])
        grab = self._client.register_script(_GRAB_LUA)
        while True:
            sent_at = _clock.now()
            if await grab(keys=[keys[1]], args=[request_id, token, ttl_ms]):
                return Grant(FencingToken(name, token), request_id, ttl, sent_at)
            if deadline is not None and sent_at >= deadline:
                raise fenced.LockTimeout(name)
            await asyncio.sleep(0.001)


@pytest.mark.parametrize("variant", [CounterDeletedWithHolder, IncrOutsideTheScript])
async def test_monotonicity_check_catches_planted_bugs(
    redis_server: RedisServer,
    register_scheme: Callable[[str, str], None],
    variant: type[RedisBackend],
) -> None:
    planted = variant.release_lua != RELEASE_LUA or variant.acquire is not RedisBackend.acquire
    assert planted, "the variant is the real backend"
    scheme = "redisplanted"
    register_scheme(scheme, f"{__name__}:{variant.__name__}")
    url = redis_server.url.replace("redis://", f"{scheme}://", 1)
    grants = await contend(url, 6, 150, key_prefix=_prefix())
    with pytest.raises(AssertionError, match="after"):
        assert_monotonic(grants)


async def idle_run(url: str) -> list[int]:
    """Two grants with the lock idle in between for twice the ttl."""
    prefix, name = _prefix(), unique_name()
    grants: list[int] = []
    async with fenced.connect_async(url, key_prefix=prefix) as locks:
        for _ in range(2):
            async with locks.lock(name, ttl=0.3) as lease:
                grants.append(lease.token.value)
            # Anything that expires with a lease has expired before the next grant.
            idle_until = _clock.now() + 0.6
            await async_wait_for(functools.partial(_past, idle_until), what="an idle spell")
    return grants


async def _past(deadline: float) -> bool:
    return _clock.now() >= deadline


async def test_tokens_increase_after_the_lock_sat_idle(redis_server: RedisServer) -> None:
    grants = await idle_run(redis_server.url)
    assert len(grants) == 2
    assert_monotonic(grants)


async def test_monotonicity_check_catches_a_counter_with_a_ttl(
    redis_server: RedisServer, register_scheme: Callable[[str, str], None]
) -> None:
    assert CounterWithTTL.acquire_lua != ACQUIRE_LUA  # the bug is really planted
    scheme = "redisplanted"
    register_scheme(scheme, f"{__name__}:CounterWithTTL")
    url = redis_server.url.replace("redis://", f"{scheme}://", 1)
    grants = await idle_run(url)
    with pytest.raises(AssertionError, match="after"):
        assert_monotonic(grants)


def test_counter_key_never_expires(redis_server: RedisServer) -> None:
    prefix, name = _prefix(), unique_name()
    with fenced.connect(redis_server.url, key_prefix=prefix) as locks:  # type: ignore[arg-type]
        with locks.lock(name, ttl=1):
            pass
    native = redis.Redis(port=redis_server.port, decode_responses=True)
    try:
        keys = native.keys(f"{prefix}*")
        counter = f"{prefix}{{{name}}}:token"
        assert counter in keys
        assert native.ttl(counter) == -1  # no expiry
        assert native.get(counter) == "1"
        assert f"{prefix}{{{name}}}:holder" not in keys  # released
    finally:
        native.close()


def test_tokens_beyond_2_53_and_at_the_maximum(redis_server: RedisServer) -> None:
    prefix, name = _prefix(), unique_name()
    native = redis.Redis(port=redis_server.port)
    counter = f"{prefix}{{{name}}}:token"
    try:
        with fenced.connect(redis_server.url, key_prefix=prefix) as locks:  # type: ignore[arg-type]
            native.set(counter, 2**53 + 5)  # a Lua number is no longer exact here
            with locks.lock(name, ttl=5) as lease:
                assert lease.token.value == 2**53 + 6
            native.set(counter, fenced.MAX_TOKEN - 1)
            with locks.lock(name, ttl=5) as lease:
                assert lease.token.value == fenced.MAX_TOKEN
            # The counter cannot go past 2**63-1: a typed error, and nothing is granted.
            with pytest.raises(fenced.BackendError, match="overflow"):
                locks.lock(name, ttl=5).acquire(timeout=0)
            status = locks.status(name)
            assert status.holder is None and status.last_token.value == fenced.MAX_TOKEN  # type: ignore[union-attr]
    finally:
        native.close()


FENCED_LOCK = (sys.executable, "-m", "fenced", "lock")


def test_a_wrong_or_missing_password_fails_at_once_as_configuration() -> None:
    """Credentials the server refuses are the caller's configuration: no retry for the whole
    connect timeout, no raw server text, no password in the message; the CLI exits 2 at once."""
    with RedisServer() as server:
        redis.Redis(port=server.port).config_set("requirepass", "s3cret-pw")
        where = f"127.0.0.1:{server.port}/0"
        for url in (f"redis://{where}", f"redis://:wrong-pw@{where}"):
            start = time.monotonic()
            # A retry would take the whole connect timeout: well under it means none.
            with pytest.raises(fenced.AccessDenied, match="refused fenced's credentials") as info:
                fenced.connect(url, connect_timeout=60)  # type: ignore[arg-type]
            assert time.monotonic() - start < 20.0
            assert "wrong-pw" not in str(info.value)
            assert "otherwise" not in str(info.value)  # Redis's long NOAUTH hint is cut
            start = time.monotonic()
            out = subprocess.run(
                [*FENCED_LOCK, "--url", url, "--timeout", "60", "j", "--", "true"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert out.returncode == 2, out.stderr
            assert time.monotonic() - start < 30.0  # (a Python start on a loaded machine: seconds)
            assert len(out.stderr.strip().splitlines()) == 1, out.stderr
            assert "wrong-pw" not in out.stderr
        # The right password is served as before.
        with fenced.connect(f"redis://:s3cret-pw@{where}") as locks:
            with locks.lock(unique_name(), ttl=5) as lease:
                assert lease.token.value == 1


def test_an_unsafe_server_is_a_configuration_error_for_the_cli() -> None:
    with RedisServer(extra=["--appendonly", "no"]) as server:
        out = subprocess.run(
            [sys.executable, "-m", "fenced", "lock", "--url", server.url, "j", "--", "true"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, out.stderr
        assert "not a durable token source" in out.stderr
        # ... and `fenced status` still reads it, with the warning.
        out = subprocess.run(
            [sys.executable, "-m", "fenced", "status", "--url", server.url, "j"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "not a durable token source" in out.stderr
        assert "j" in out.stdout


# -- release: one comparison with the grant's holder value, else the parse --------------------


class ReleaseTrustsTheGrantsValue(RedisBackend):
    """Planted bug: a release or renew that brings its grant's holder value acts on the lock
    without comparing it."""

    release_lua: ClassVar[str] = RELEASE_LUA.replace(
        "if v ~= ARGV[1] then", "if ARGV[1] == '' then", 1
    )
    renew_lua: ClassVar[str] = RENEW_LUA.replace("if v ~= ARGV[1] then", "if ARGV[1] == '' then", 1)


def _ignore(_: BaseException) -> None:
    pass


async def release_violations(url: str, port: int) -> list[str]:
    """A stale grant (its lease ran out, the lock went to another) must be refused, by the
    comparison of the holder value and by the parse alike, and the new grant left in place;
    the rightful holder's release is accepted, whether the holder value is the one its grant
    was made with, one written by another version's script (fenced 0.1's hand-off records no
    owner), or the release does not bring it (a Grant without its handle)."""
    prefix, name = _prefix(), unique_name()
    key = f"{prefix}{{{name}}}:holder"
    raw = redis.Redis(port=port, decode_responses=True)
    bad: list[str] = []
    try:
        async with fenced.connect_async(url, key_prefix=prefix) as locks:
            backend = locks.backend

            async def grant(rid: str) -> Grant:
                return await backend.acquire(
                    name, request_id=rid, ttl=60, deadline=None, on_lost=_ignore, owner="o p"
                )

            async def renewed(g: Grant) -> bool:
                try:
                    await backend.renew(g)
                except fenced.LeaseLostError:
                    return False
                return True

            old = await grant("A")
            raw.pexpire(key, 1)  # A's lease runs out
            wait_for(lambda: not raw.exists(key), what="the holder's key to expire")
            new = await grant("B")
            assert new.token.value > old.token.value
            if await renewed(old):
                bad.append("a stale grant (another request id) renewed the lock")
            if await backend.release(old):
                bad.append("a stale grant (another request id) released the lock")
            wrong_token = Grant(old.token, "B", new.ttl, new.sent_at, new.handle)
            if await renewed(wrong_token):
                bad.append("a grant with the holder's request id but a stale token renewed")
            if await backend.release(wrong_token):
                bad.append("a grant with the holder's request id but a stale token released")
            if raw.get(key) != f"{new.token.value} 60000 B\no p":
                bad.append(f"the new grant's holder value is now {raw.get(key)!r}")
            raw.pexpire(key, 10_000)
            if not await renewed(new):
                bad.append("the holder's renew (its grant's value) was refused")
            if raw.pttl(key) <= 10_000:
                bad.append("the holder's renew did not extend its lease")
            if not await backend.release(new):
                bad.append("the holder's release (its grant's value) was refused")
            if raw.exists(key):
                bad.append("the holder's release left the lock held")
            # A holder value written by fenced 0.1's hand-off: no owner part.
            c = await grant("C")
            raw.set(key, f"{c.token.value} 60000 C", px=60_000)
            if not await renewed(c):
                bad.append("a holder value without the owner part was not renewed")
            if not await backend.release(c):
                bad.append("a holder value without the owner part was not released")
            d = await grant("D")
            if not await renewed(Grant(d.token, "D", d.ttl, d.sent_at)):
                bad.append("a renew without the grant's value was refused")
            if not await backend.release(Grant(d.token, "D", d.ttl, d.sent_at)):
                bad.append("a release without the grant's value was refused")
            if raw.exists(key):
                bad.append("the lock is still held")
    finally:
        raw.close()
    return bad


async def test_release_refuses_a_stale_grant_and_accepts_the_holder(
    redis_server: RedisServer,
) -> None:
    assert await release_violations(redis_server.url, redis_server.port) == []


async def test_release_check_catches_a_release_that_trusts_the_grants_value(
    redis_server: RedisServer, register_scheme: Callable[[str, str], None]
) -> None:
    assert ReleaseTrustsTheGrantsValue.release_lua != RELEASE_LUA  # the bug is really planted
    register_scheme("redisplanted", f"{__name__}:ReleaseTrustsTheGrantsValue")
    url = redis_server.url.replace("redis://", "redisplanted://", 1)
    bad = await release_violations(url, redis_server.port)
    assert "a stale grant (another request id) renewed the lock" in bad, bad
    assert "a stale grant (another request id) released the lock" in bad, bad


class ReleaseByValueOnly(RedisBackend):
    """A probe: release and renew accept only the exact holder value (the parse refuses)."""

    release_lua: ClassVar[str] = RELEASE_LUA.replace(
        "if v ~= ARGV[1] then", "if v ~= ARGV[1] then do return 0 end", 1
    )
    renew_lua: ClassVar[str] = RENEW_LUA.replace(
        "if v ~= ARGV[1] then", "if v ~= ARGV[1] then do return 0 end", 1
    )


async def test_every_kind_of_grant_is_released_by_its_holder_value(
    redis_server: RedisServer, register_scheme: Callable[[str, str], None]
) -> None:
    """The holder value a grant's renew and release bring is the one the scripts wrote, for a
    fresh grant (with and without an owner, a newline in it), a retried acquire, a hand-off
    and a grant to a waiter after the holder expired: they never need the parse."""
    register_scheme("redisbyvalue", f"{__name__}:ReleaseByValueOnly")
    url = redis_server.url.replace("redis://", "redisbyvalue://", 1)
    prefix, name = _prefix(), unique_name()
    key = f"{prefix}{{{name}}}:holder"
    raw = redis.Redis(port=redis_server.port, decode_responses=True)
    try:
        async with fenced.connect_async(url, key_prefix=prefix) as locks:
            backend = locks.backend

            async def grant(rid: str, owner: str = "", deadline: float | None = None) -> Grant:
                return await backend.acquire(
                    name, request_id=rid, ttl=30, deadline=deadline, on_lost=_ignore, owner=owner
                )

            async def renew_and_release(g: Grant) -> bool:
                await backend.renew(g)  # LeaseLostError if the value did not match
                return await backend.release(g)

            for owner in ("", "u@h pid 1", "two\nlines"):
                assert await renew_and_release(await grant(f"fresh-{len(owner)}", owner))
            first = await grant("retried", "o")
            again = await grant("retried", "o")  # a retry whose first reply was lost
            assert again.token == first.token
            assert await renew_and_release(again)
            # A hand-off: the waiter is granted by the holder's release, in its BLPOP.
            holder = await grant("H", "h")
            waiter = asyncio.ensure_future(grant("W", "w\nv"))
            await async_wait_for(functools.partial(_waiters_are, locks, name, 1), what="queued")
            assert await backend.release(holder)
            handed = await waiter
            assert await renew_and_release(handed)
            # The holder expires; the waiter's own re-check grants it (the queue's head).
            holder = await grant("H2")
            soon = _clock.now() + 30
            waiter = asyncio.ensure_future(grant("W2", "w2", deadline=soon))
            await async_wait_for(functools.partial(_waiters_are, locks, name, 1), what="queued")
            raw.pexpire(key, 1)
            late = await waiter
            assert late.token.value > holder.token.value
            assert await renew_and_release(late)
            assert not raw.exists(key)
    finally:
        raw.close()


def test_an_uncontended_acquire_and_release_run_the_fewest_commands(
    redis_server: RedisServer,
) -> None:
    """Server time is paid per command a script runs, cold after each fsync (docs/backend-
    redis.md, "Server time"): an uncontended acquire runs EXISTS (holder and queue at once),
    INCR and SET; its release GET, RENAME (the holder key becomes the grant's "released"
    marker, for a retry of the release) and EXISTS (the queue) - no ZCARD, TIME or PTTL."""
    prefix, name = _prefix(), unique_name()
    native = redis.Redis(port=redis_server.port)
    try:
        with fenced.connect(redis_server.url, key_prefix=prefix) as locks:  # type: ignore[arg-type]
            lease = locks.lock(name, ttl=30)
            lease.acquire()
            lease.release()
            native.config_resetstat()
            for _ in range(10):
                lease.acquire()
                lease.release()
            stats = native.info("commandstats")
    finally:
        native.close()
    calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
    calls.pop("config|resetstat", None)
    assert calls == {"evalsha": 20, "exists": 20, "incr": 10, "set": 10, "get": 10, "rename": 10}


def test_the_uncontended_scripts_get_only_the_keys_and_arguments_they_use(
    redis_server: RedisServer,
) -> None:
    """Redis builds a script's KEYS and ARGV tables element by element on every call, which
    was over a quarter of an acquire+release's server instructions with seven of each
    (docs/backend-redis.md, "Server time"): the acquire gets the counter, holder and queue
    keys and four arguments, the release the holder and queue keys and the grant's holder
    value, the renew the holder key and four arguments."""
    prefix, name = _prefix(), unique_name()
    native = redis.Redis(port=redis_server.port)
    threshold = native.config_get("slowlog-log-slower-than")["slowlog-log-slower-than"]
    try:
        with fenced.connect(redis_server.url, key_prefix=prefix) as locks:  # type: ignore[arg-type]
            lease = locks.lock(name, ttl=30)
            lease.acquire()  # (the first call of each script loads it: NOSCRIPT, then EVALSHA)
            lease.renew()
            lease.release()
            native.config_set("slowlog-log-slower-than", 0)
            native.slowlog_reset()
            lease.acquire()
            lease.renew()
            lease.release()
            native.set_response_callback("SLOWLOG GET", lambda r, **_: r)  # the raw entries
            entries = native.execute_command("SLOWLOG GET", 1000)
    finally:
        native.config_set("slowlog-log-slower-than", threshold)
        native.close()
    # Each entry: id, time, µs, [command and arguments], ...; oldest last.
    scripts = [e[3] for e in reversed(entries) if e[3][0].upper() == b"EVALSHA"]
    # EVALSHA sha numkeys keys... args...: (numkeys, number of arguments) per script
    shapes = [(int(c[2]), len(c) - 3 - int(c[2])) for c in scripts]
    assert shapes == [(3, 4), (1, 4), (2, 1)], scripts


# -- the scripts' own connection ---------------------------------------------------------------


async def test_scripts_share_the_own_connection_with_the_pool(redis_server: RedisServer) -> None:
    """Concurrent calls: one runs on the backend's own connection, the others through
    redis-py's pool; every lock's tokens still increase and every release finds its grant."""
    prefix = _prefix()
    async with fenced.connect_async(redis_server.url, key_prefix=prefix) as locks:
        names = [unique_name() for _ in range(4)]
        tokens: dict[str, list[int]] = {name: [] for name in names}
        released: list[bool] = []

        async def loop(name: str) -> None:
            lease = locks.lock(name, ttl=30)
            for _ in range(25):
                tokens[name].append((await lease.acquire()).value)
                released.append(await lease.release())

        await asyncio.gather(*(loop(name) for name in names))
    for name in names:
        assert tokens[name] == list(range(1, 26)), tokens[name]
    assert all(released) and len(released) == 100


async def test_a_forgotten_script_is_loaded_again(redis_server: RedisServer) -> None:
    """SCRIPT FLUSH (or a restart) empties the server's script cache: the own connection gets
    NOSCRIPT (the script did not run), loads it and sends it again."""
    name = unique_name()
    native = redis.Redis(port=redis_server.port)
    try:
        async with fenced.connect_async(redis_server.url, key_prefix=_prefix()) as locks:
            lease = locks.lock(name, ttl=30)
            first = await lease.acquire()
            native.script_flush()
            assert await lease.release() is True
            native.script_flush()
            second = await lease.acquire()
            assert second.value == first.value + 1
            assert await lease.release() is True
    finally:
        native.close()


async def test_a_cut_off_script_leaves_no_reply_for_the_next(redis_server: RedisServer) -> None:
    """An acquire cancelled while its script is on the own connection (the server paused):
    the reply that arrives after the server resumes must not be read as the next script's
    reply. redis-py drops the connection; the next call re-checks the server and reconnects."""
    name = unique_name()
    async with fenced.connect_async(redis_server.url, key_prefix=_prefix()) as locks:
        lease = locks.lock(name, ttl=30)
        first = await lease.acquire()
        assert await lease.release() is True
        backend: Any = locks.backend
        redis_server.pause()
        try:
            task = asyncio.create_task(locks.lock(name, ttl=30).acquire())

            async def sent() -> bool:
                return bool(backend._own_busy)

            await async_wait_for(sent, what="the acquire script on the own connection")
            task.cancel()
        finally:
            redis_server.resume()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = await lease.acquire()
        # The cancelled acquire may have been granted a token before it left: higher, never
        # lower or a reply of another script.
        assert after.value > first.value
        assert await lease.release() is True
        assert (await locks.status(name)).holder is None


async def test_a_script_without_reply_ends_at_socket_timeout(redis_server: RedisServer) -> None:
    """The own connection has no socket timeout of its own (one deadline bounds connect, send
    and reply): a paused server still fails the call at ``socket_timeout``, as unavailable;
    once the server is back the next call reconnects and works."""
    name = unique_name()
    options = {"key_prefix": _prefix(), "socket_timeout": 0.5}
    async with fenced.connect_async(redis_server.url, **options) as locks:
        assert (await locks.status(name)).holder is None  # (the own connection is made)
        redis_server.pause()
        try:
            start = time.monotonic()
            with pytest.raises(fenced.BackendUnavailable, match="socket_timeout"):
                await asyncio.wait_for(locks.status(name), 5)
            assert time.monotonic() - start < 3
        finally:
            redis_server.resume()
        async with locks.lock(name, ttl=30) as lease:
            assert (await locks.status(name)).token == lease.token


@pytest.mark.parametrize(
    "command",
    [
        (
            "EVALSHA",
            "0" * 40,
            3,
            "p:{a}:token",
            "p:{a}:holder",
            "p:{a}:queue",
            "r1",
            10000,
            "",
            3000,
        ),
        ("EVALSHA", "0" * 40, 2, "p:{ü}:holder", "p:{ü}:queue", "7 10000 r1\nme@host: ünï"),
        ("EVALSHA", "0" * 40, 1, "k", "", "r", 2**63 - 1, -1),
        ("EVALSHA", "0" * 40, 0),
    ],
)
def test_scripts_are_packed_as_redis_py_packs_them(command: tuple[str | int, ...]) -> None:
    """The own connection packs fenced's script calls itself (no encoder type checks per
    argument): the bytes must be redis-py's for the same command."""
    from redis.asyncio.connection import Connection

    from fenced.backends.redis import _packed

    assert _packed(command) == b"".join(Connection().pack_command(*command))


@pytest.mark.parametrize("bad", [1.5, True, b"bytes", None])
def test_packing_refuses_what_it_cannot_send_exactly(bad: object) -> None:
    from fenced.backends.redis import _packed

    with pytest.raises(TypeError, match="text or an int"):
        _packed(("EVALSHA", "0" * 40, 0, bad))  # type: ignore[arg-type]


# -- the outside attack of 2026-11-27 (session 7) ---------------------------------------------


def test_a_server_back_unsafe_is_refused_on_every_path_at_once(server: RedisServer) -> None:
    """Every connection the client makes checks the server first: after a restart with
    ``appendfsync everysec``, concurrent acquires (the scripts' own connection busy, so most
    of them on redis-py's pool, which reconnects without a word) are all refused, round after
    round — before, a call that found the own connection busy was granted. And a safe server
    again is accepted."""

    async def attempt(locks: fenced.AsyncLocks, name: str) -> str:
        try:
            async with locks.lock(name, ttl=5, timeout=1) as lease:
                await asyncio.sleep(0.01)
                return f"granted {lease.token}"
        except fenced.FencedError as exc:
            return type(exc).__name__

    async def main() -> None:
        async with fenced.connect_async(server.url, key_prefix=_prefix()) as locks:
            before = await asyncio.gather(*(attempt(locks, f"a{i}") for i in range(4)))
            assert all(r.startswith("granted") for r in before), before
            server.stop()
            server.extra = ["--appendfsync", "everysec"]
            server.start()
            for round_ in range(3):
                got = await asyncio.gather(*(attempt(locks, f"r{round_}-{i}") for i in range(4)))
                assert got == ["UnsafeBackendError"] * 4, (round_, got)
            server.stop()
            server.extra = []
            server.start()
            # (the safe server passes again; the refused rounds may take a moment to clear)
            got = await asyncio.gather(*(attempt(locks, f"s{i}") for i in range(4)))
            assert all(r.startswith("granted") for r in got), got

    asyncio.run(main())


def test_an_acquire_on_a_server_that_stopped_answering_ends_near_its_timeout(
    server: RedisServer,
) -> None:
    """A paused server (SIGSTOP): ``timeout=0.5`` and ``timeout=0`` end within a second past
    the timeout (as the other sources bound a last try), not after ``socket_timeout`` (10 s),
    through the sync API too; and the lock taken before the pause is still the holder's."""
    name = unique_name()
    with fenced.connect(server.url, key_prefix=_prefix()) as locks:  # type: ignore[arg-type]
        with locks.lock(name, ttl=30):
            pass
        server.pause()
        try:
            for timeout in (0.5, 0.0):
                start = time.monotonic()
                with pytest.raises((fenced.BackendUnavailable, fenced.LockTimeout)):
                    locks.lock(unique_name(), ttl=5).acquire(timeout=timeout)
                took = time.monotonic() - start
                assert took < timeout + 2.5, (timeout, took)
        finally:
            server.resume()
        with locks.lock(name, ttl=5, timeout=10) as lease:  # (the source is back)
            assert lease.token.value == 2


def test_a_release_after_the_server_closed_idle_connections_frees_the_lock(
    server: RedisServer,
) -> None:
    """The server closes fenced's idle connections (``CLIENT KILL``, or its ``timeout``):
    the release that follows reconnects and frees the lock (redis-py 8's pool handed out the
    closed connection, and the release failed, leaving the lock held for its whole ttl)."""
    name = unique_name()
    admin = redis.Redis(port=server.port, decode_responses=True)
    with fenced.connect(server.url, key_prefix=_prefix()) as locks:  # type: ignore[arg-type]
        lease = locks.lock(name, ttl=60, auto_renew=False)
        lease.acquire(timeout=5)
        killed = admin.client_kill_filter(skipme=True)
        assert killed >= 1
        assert lease.release() is True
        with locks.lock(name, ttl=5, timeout=0) as again:  # free at once, not in 60 s
            assert again.token.value == 2
    admin.close()


def test_a_str_subclass_request_id_is_sent_as_its_text(redis_server: RedisServer) -> None:
    """``request_id`` an ``enum.StrEnum`` member: accepted as the text it is (the scripts'
    own packing refused it with a bare TypeError)."""
    import enum

    class Job(enum.StrEnum):
        NIGHTLY = "nightly-run-1"

    name = unique_name()
    with fenced.connect(redis_server.url, key_prefix=_prefix()) as locks:  # type: ignore[arg-type]
        with locks.lock(name, ttl=5, request_id=Job.NIGHTLY) as lease:
            assert lease.token.value == 1
            assert locks.status(name).holder == "nightly-run-1"


def test_tls_options_on_a_plain_url_are_a_configuration_error(redis_server: RedisServer) -> None:
    with pytest.raises(fenced.ConfigurationError, match="rediss://"):
        fenced.connect(redis_server.url, ssl_certfile="/nonexistent")


def test_appendonly_turned_on_at_run_time_is_refused_until_its_first_rewrite_ends(
    server: RedisServer,
) -> None:
    """``CONFIG SET appendonly yes`` on a running server: until the AOF's first rewrite ends,
    writes go to a file the manifest does not list, and a crash loses them (tokens handed out
    again after a kill -9: the outside attack saw token 1 twice). CONFIG GET already says
    yes/always then: refused all the same while that rewrite runs; accepted once it ended."""
    admin = redis.Redis(port=server.port)
    admin.config_set("appendonly", "no")
    admin.mset({f"pad{i}": "x" for i in range(60)})
    admin.config_set("rdb-key-save-delay", 50000)  # (the rewrite takes ~3 s: a big dataset)
    admin.config_set("appendonly", "yes")
    try:
        assert admin.info("persistence")["aof_rewrite_in_progress"] == 1
        with pytest.raises(fenced.UnsafeBackendError, match="first rewrite is still running"):
            fenced.connect(server.url, key_prefix=_prefix(), connect_timeout=1)
    finally:
        admin.config_set("rdb-key-save-delay", 0)
    wait_for(lambda: not admin.info("persistence")["aof_rewrite_in_progress"], 30, "the rewrite")
    with fenced.connect(server.url, key_prefix=_prefix()) as locks:  # type: ignore[arg-type]
        with locks.lock(unique_name(), ttl=5, timeout=5) as lease:
            assert lease.token.value == 1
    admin.close()


def test_a_waiter_blocked_when_the_server_stops_answering_ends_near_its_timeout(
    server: RedisServer,
) -> None:
    """B waits in BLPOP for A's lock, then the server is paused: B's ``acquire(timeout=2)``
    ends within a second past it (it took ``socket_timeout``, 10 s); and after a refusal has
    armed the safety re-check (a restart with ``everysec``), a paused server still lets an
    ``acquire(timeout=1)`` end near its timeout (the re-check was unbounded)."""
    name = unique_name()

    async def main() -> None:
        async with fenced.connect_async(server.url, key_prefix=_prefix()) as locks:
            async with locks.lock(name, ttl=30):
                b = asyncio.ensure_future(locks.lock(name, ttl=5).acquire(timeout=2))

                async def queued() -> bool:
                    return (await locks.status(name)).waiters == 1

                await async_wait_for(queued, 10, "B queued")
                start = time.monotonic()
                server.pause()
                try:
                    with pytest.raises((fenced.BackendUnavailable, fenced.LockTimeout)):
                        await b
                    took = time.monotonic() - start
                finally:
                    server.resume()
                assert took < 2 + 2.5, took

    asyncio.run(main())
    with fenced.connect(server.url, key_prefix=_prefix()) as locks:  # type: ignore[arg-type]
        with locks.lock(unique_name(), ttl=5):
            pass
        server.kill()
        server.extra = ["--appendfsync", "everysec"]
        server.start()
        with pytest.raises(fenced.UnsafeBackendError):
            locks.lock(unique_name(), ttl=5).acquire(timeout=1)
        server.pause()
        try:
            start = time.monotonic()
            with pytest.raises(fenced.BackendUnavailable):
                locks.lock(unique_name(), ttl=5).acquire(timeout=1)
            assert time.monotonic() - start < 1 + 2.5
        finally:
            server.resume()


def test_the_opt_out_warns_once_on_a_read_only_replica(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """``allow_unsafe_durability`` on a replica: each acquire is refused (READONLY), and the
    warning that the server is not durable is logged once, not twice a call."""
    with RedisServer(extra=["--replicaof", "127.0.0.1", str(redis_server.port)]) as replica:
        caplog.set_level(logging.WARNING, logger="fenced")
        url = replica.url + "?allow_unsafe_durability=true"
        with fenced.connect(url, key_prefix=_prefix()) as locks:  # type: ignore[arg-type]
            for _ in range(4):
                with pytest.raises(fenced.UnsafeBackendError, match="read-only replica"):
                    locks.lock(unique_name(), ttl=5).acquire(timeout=1)
        warned = [r for r in caplog.records if "is not durable" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in warned]


@pytest.mark.parametrize("denied", ["-info", "-config"])
def test_a_user_the_acl_denies_the_safety_check_is_access_denied(
    redis_server: RedisServer, denied: str
) -> None:
    """A user whose ACL denies ``INFO`` or ``CONFIG`` cannot have the server verified: refused
    as AccessDenied naming the command (it was "unsafe (CONFIG GET: …)", whichever was
    denied), and the password is in no message."""
    user = unique_name("u").replace("-", "")
    admin = redis.Redis(port=redis_server.port)
    admin.execute_command("ACL", "SETUSER", user, "on", ">pw-Secret9", "~*", "&*", "+@all", denied)
    try:
        url = f"redis://{user}:pw-Secret9@127.0.0.1:{redis_server.port}/0"
        with pytest.raises(fenced.AccessDenied, match=denied[1:]) as refused:
            fenced.connect(url, key_prefix=_prefix(), connect_timeout=1)
        assert "pw-Secret9" not in str(refused.value)
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()


# -- an idle connection the server closed ------------------------------------------------------


def _kill_and_wait_for_the_fin(port: int, conn: Any) -> None:
    """``CLIENT KILL`` fenced's connections from another client (blocking: no turn of the
    event loop runs meanwhile), then wait until ``conn``'s socket has the server's FIN. The
    loop has not looked yet: its StreamReader still reads as clean."""
    import select

    admin = redis.Redis(port=port)
    try:
        assert admin.client_kill_filter(skipme=True) >= 1
    finally:
        admin.close()
    sock = conn._writer.transport.get_extra_info("socket")
    readable, _, _ = select.select([sock.fileno()], [], [], 5.0)
    assert readable, "the server's FIN did not arrive"
    assert not conn._reader.at_eof()  # (what redis-py's own check looks at)


async def test_a_script_right_after_the_server_closed_the_own_connection_reconnects(
    server: RedisServer,
) -> None:
    """The server closed the scripts' own connection (``CLIENT KILL``, its ``timeout``) and
    the call comes before a turn of the loop noticed: the check looks at the socket itself,
    so the release goes out on a fresh connection and frees the lock (it was sent on the
    dead one and failed: the lock stayed held for its ttl). Both sides: another client is
    then granted the lock at once, with the next token."""
    name = unique_name()
    async with fenced.connect_async(server.url, key_prefix=_prefix()) as locks:
        lease = locks.lock(name, ttl=60, auto_renew=False)
        await lease.acquire(timeout=5)
        backend: Any = locks.backend
        _kill_and_wait_for_the_fin(server.port, backend._own)
        assert await lease.release() is True
        again = locks.lock(name, ttl=5)
        assert (await again.acquire(timeout=0)).value == 2
        # The status script too (the own connection, killed once more).
        _kill_and_wait_for_the_fin(server.port, backend._own)
        assert (await locks.status(name)).token == again.token
        assert await again.release() is True


async def test_a_pool_call_right_after_the_server_closed_its_connection_reconnects(
    server: RedisServer,
) -> None:
    """The same on redis-py's pool (records, lock names, BLPOP, scripts while the own
    connection is busy): its check at checkout looked only at what the loop had processed."""
    name = unique_name()
    async with fenced.connect_async(server.url, key_prefix=_prefix()) as locks:
        await locks.swap_record(name, 0, "one")
        backend: Any = locks.backend
        pool = backend._client.connection_pool
        (idle,) = pool._available_connections
        _kill_and_wait_for_the_fin(server.port, idle)
        record = await locks.read_record(name)
        assert record is not None and record.value == "one"
        (idle,) = pool._available_connections
        _kill_and_wait_for_the_fin(server.port, idle)
        assert (await locks.swap_record(name, 1, "two")).version == 2


# -- a release whose reply was lost, asked again -----------------------------------------------


class ReleaseForgetsItsOwn(RedisBackend):
    """Planted bug: the release answers 1 for any grant it no longer finds (the marker of an
    earlier attempt not looked at): a lease that expired, or was taken over or force-released,
    would be reported released."""

    release_lua: ClassVar[str] = RELEASE_LUA.replace(
        "if v == false then", "if v == false then do return 1 end", 1
    )


async def asked_again(
    url: str,
    port: int,
    before: Callable[[fenced.AsyncLocks, redis.Redis, str], Any] | None = None,
    after: Callable[[fenced.AsyncLocks, str], Any] | None = None,
) -> tuple[bool, fenced.AsyncLease, fenced.LockStatus]:
    """A lease released through a proxy that passes the release on but drops Redis's reply:
    the call raises (BackendUnavailable, the outcome unknown); asked again once replies
    flow, the release's answer (with the lease and the lock's status then). ``before``: what happens to the grant before the release
    (its key expires, another client takes the lock); ``after``: between the two asks."""
    prefix, name = _prefix(), unique_name()
    raw = redis.Redis(port=port, decode_responses=True)
    try:
        with TcpProxy("127.0.0.1", port) as proxy:
            via = url.replace(f":{port}", f":{proxy.port}", 1)
            opts = {"key_prefix": prefix, "socket_timeout": 1.0}
            async with (
                fenced.connect_async(via, **opts) as locks,
                fenced.connect_async(url, key_prefix=prefix) as other,
            ):
                lease = locks.lock(name, ttl=30)
                await lease.acquire()
                if before is not None:
                    await before(other, raw, name)
                proxy.drop_replies()
                sent = proxy.forwarded
                with pytest.raises(fenced.BackendUnavailable):
                    await lease.release()
                assert proxy.forwarded > sent  # (the release reached the server)
                proxy.heal()
                if after is not None:
                    await after(other, name)
                released = await lease.release()
                return released, lease, await other.status(name)
    finally:
        raw.close()


async def _expire_and_take(other: fenced.AsyncLocks, raw: redis.Redis, name: str) -> None:
    """The grant's key runs out (the server's clock); another client takes the lock."""
    key = next(k for k in raw.scan_iter(match=f"*{{{name}}}:holder"))
    raw.pexpire(key, 1)
    wait_for(lambda: not raw.exists(key), what="the holder's key to expire")
    await other.lock(name, ttl=30).acquire()


async def _force_release(other: fenced.AsyncLocks, raw: redis.Redis, name: str) -> None:
    assert await other.force_release(name) is not None


async def _take(other: fenced.AsyncLocks, name: str) -> None:
    await other.lock(name, ttl=30, timeout=5).acquire()


async def test_a_release_whose_reply_was_lost_asked_again_is_a_release(
    redis_server: RedisServer,
) -> None:
    """The release reached Redis and freed the lock, its reply was lost: asked again, it
    answered False and the lease reported a loss that did not happen. Now True, no loss;
    and so too if another client took the lock in between (its grant untouched)."""
    for after in (None, _take):
        released, lease, status = await asked_again(
            redis_server.url, redis_server.port, after=after
        )
        assert released is True, after
        assert not lease.lost.is_set(), lease.lost.cause
        assert (status.token is not None) is (after is _take)


async def test_a_release_asked_again_after_a_takeover_or_force_release_stays_false(
    redis_server: RedisServer,
) -> None:
    """The other side: the grant expired and another client took the lock, or an operator
    force-released it, before the release arrived: asked again, False and the loss reported,
    and the other holder's grant kept."""
    for before in (_expire_and_take, _force_release):
        released, lease, status = await asked_again(redis_server.url, redis_server.port, before)
        assert released is False, before
        assert lease.lost.is_set(), before
        assert (status.token is not None) is (before is _expire_and_take)


async def test_the_retried_release_check_catches_a_release_that_forgets_its_own(
    redis_server: RedisServer, register_scheme: Callable[[str, str], None]
) -> None:
    assert ReleaseForgetsItsOwn.release_lua != RELEASE_LUA  # (the bug is really planted)
    register_scheme("redisforgets", f"{__name__}:ReleaseForgetsItsOwn")
    url = redis_server.url.replace("redis://", "redisforgets://", 1)
    released, _, _ = await asked_again(url, redis_server.port, _expire_and_take)
    assert released is True  # (what the checks above refuse)
