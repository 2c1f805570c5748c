"""fenced's Redis lock vs redis-py's own ``Lock`` (``redis.lock.Lock``), side by side.

Both run against the same redis-server (``appendonly yes``, ``appendfsync always``: every
acknowledged write is fsynced) on loopback. The peer is redis-py's ``Lock`` with its defaults:
``SET NX PX`` to acquire, a Lua compare-and-delete to release, and a blocked caller that
*polls* with ``sleep=0.1`` s between attempts. It hands out no token and has no queue. fenced
hands out a fencing token (one Lua script: grant + INCR), queues waiters FIFO, and wakes the
next one on release (BLPOP on a per-waiter list) instead of polling.

    .venv/bin/python bench/bench_redis.py [--quick] [--uncontended] [--before REV]
        [--fsync always|everysec] [--layers]

Rows: uncontended acquire+release by one client (sync API and asyncio API; ops/s, p50, p99 of
one acquire+release, alternating between the two sides in rounds); hand-off with 10 and 100
waiters on one lock, each with its own connection, in one asyncio loop (grants/s, and p50/p99
of the time from a holder starting its release to the next holder's grant); and the same
clients looping without pause ("steady"). A second table shows the requests the clients sent
per grant (from INFO commandstats), which is where polling shows, and how often a grant went
back to the client that had just released. Under the uncontended rows: the server's own time
per acquire+release (INFO commandstats: the usec of the commands each side sends itself,
EVALSHA, and SET for redis-py, taken around each round of each side, so the two sides
interleave), and this process's CPU time per acquire+release in the same rounds (the client
side's cost, which the fsyncs hide in the wall-clock rows). ``--uncontended`` runs those rows
only.
``--fsync everysec`` runs the server with ``appendfsync everysec`` instead (fenced then
connects with ``allow_unsafe_durability=true``): the same client code on both sides with the
fsync's 0.1-10 ms out of every acknowledgement, so the wall-clock rows show what the clients
cost. ``--layers`` prints, instead of the usual tables, the client CPU and wall time per
uncontended acquire+release of each layer of fenced's path beside redis-py's ``Lock``, all
interleaved round by round (see :func:`layers`).
``--before REV`` adds fenced's Redis source as it was at git revision ``REV`` (scheme
``redisbefore://``) as a third side of every row, interleaved the same way, so a change is
measured before and after in one run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

import redis
import redis.asyncio as aioredis
from _common import Result, fmt_us, measure, table
from rich.console import Console
from rich.table import Table

import fenced
from fenced.testing.servers import RedisServer

TTL = 10


def backend_at(rev: str) -> type:
    """fenced's RedisBackend as it was at git revision ``rev``: its scripts and its client."""
    root = os.path.join(os.path.dirname(__file__), "..")
    text = subprocess.run(
        ["git", "-C", root, "show", f"{rev}:src/fenced/backends/redis.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    name = "fenced.backends._redis_before"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    try:
        spec = importlib.util.spec_from_file_location(name, f.name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        os.unlink(f.name)
    cls: type = module.RedisBackend
    return cls


def server_commands(port: int, names: tuple[str, ...]) -> int:
    """How many of the commands ``names`` the server has run (INFO commandstats).

    Commands called inside Lua scripts are counted too, so each side names only the commands
    it sends itself and its scripts never call.
    """
    client = redis.Redis(port=port)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(int(stats[f"cmdstat_{n}"]["calls"]) for n in names if f"cmdstat_{n}" in stats)


def server_usec(port: int, side: str) -> int:
    """The server's total time (µs) in the commands one side sends to acquire and release (a
    script's time includes the commands it calls, which INFO also counts under their own
    names: fenced's scripts call SET, so its rounds count EVALSHA alone; BLPOP is not counted:
    it only waits)."""
    names = ("evalsha", "set") if side.startswith("redis-py") else ("evalsha",)
    client = redis.Redis(port=port)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(int(stats[f"cmdstat_{n}"]["usec"]) for n in names if f"cmdstat_{n}" in stats)


# -- the two lock clients behind one tiny interface ------------------------------------------


class FencedSide:
    commands = ("evalsha", "blpop")

    def __init__(self, url: str, name: str = "fenced redis://") -> None:
        self.url = url
        self.name = name

    async def connect(self) -> Any:
        return await fenced.connect_async(self.url, key_prefix="bench:").open()

    async def close(self, conn: Any) -> None:
        await conn.aclose()

    async def acquire(self, conn: Any, key: str) -> Callable[[], Awaitable[Any]]:
        lease = conn.lock(key, ttl=TTL)
        await lease.acquire()
        return lease.release


class RedisPySide:
    name = "redis-py Lock"
    commands = ("evalsha", "set")

    def __init__(self, port: int) -> None:
        self.port = port

    async def connect(self) -> Any:
        return aioredis.Redis(port=self.port)

    async def close(self, conn: Any) -> None:
        await conn.aclose()

    async def acquire(self, conn: Any, key: str) -> Callable[[], Awaitable[Any]]:
        lock = conn.lock(f"bench-native:{key}", timeout=TTL)  # sleep=0.1: its default
        if not await lock.acquire():
            raise RuntimeError("redis-py lock not acquired")
        return lock.release


Side = FencedSide | RedisPySide


ROUNDS = 5  # uncontended runs alternate between the two sides, so load drift hits both


def merge(name: str, parts: list[Result]) -> Result:
    res = Result(name)
    for part in parts:
        res.samples += part.samples
        res.elapsed += part.elapsed
        res.ops += part.ops
    return res


SERVER_US: dict[str, list[float]] = {}
"""Per row name: the server µs per acquire+release of each round (INFO commandstats)."""
CLIENT_US: dict[str, list[float]] = {}
"""Per row name: this process's CPU µs per acquire+release of each round (every thread: the
sync API's loop thread too), where the client side's time goes beside the fsyncs."""


def timed_round(key: str, port: int, run: Callable[[], Result]) -> Result:
    before = server_usec(port, key)
    cpu = time.process_time()
    res = run()
    cpu = time.process_time() - cpu
    SERVER_US.setdefault(key, []).append((server_usec(port, key) - before) / max(res.ops, 1))
    CLIENT_US.setdefault(key, []).append(cpu * 1e6 / max(res.ops, 1))
    return res


async def ameasure(name: str, op: Callable[[], Awaitable[object]], n: int) -> Result:
    res = Result(name)
    clock = time.perf_counter
    start = clock()
    for _ in range(n):
        t0 = clock()
        await op()
        res.samples.append(clock() - t0)
    res.elapsed = clock() - start
    res.ops = n
    return res


async def uncontended(sides: list[Side], n: int, port: int) -> list[Result]:
    key = f"u-{uuid.uuid4().hex[:8]}"
    conns = [await side.connect() for side in sides]
    try:

        def op(side: Side, conn: Any) -> Callable[[], Awaitable[object]]:
            async def run() -> None:
                release = await side.acquire(conn, key)
                await release()

            return run

        ops = [op(side, conn) for side, conn in zip(sides, conns, strict=True)]
        for fn in ops:
            for _ in range(50):
                await fn()
        parts: list[list[Result]] = [[] for _ in sides]
        names = [f"{side.name} (async)" for side in sides]
        for _ in range(ROUNDS):
            for i, fn in enumerate(ops):
                before = await asyncio.to_thread(server_usec, port, names[i])
                cpu = time.process_time()
                res = await ameasure("", fn, n // ROUNDS)
                cpu = time.process_time() - cpu
                spent = await asyncio.to_thread(server_usec, port, names[i]) - before
                SERVER_US.setdefault(names[i], []).append(spent / res.ops)
                CLIENT_US.setdefault(names[i], []).append(cpu * 1e6 / res.ops)
                parts[i].append(res)
        return [merge(name, part) for name, part in zip(names, parts, strict=True)]
    finally:
        for side, conn in zip(sides, conns, strict=True):
            await side.close(conn)


def uncontended_sync(urls: list[tuple[str, str]], port: int, n: int) -> list[Result]:
    """fenced's sides (name, url) and redis-py's ``Lock`` (last), round by round."""
    key = f"s-{uuid.uuid4().hex[:8]}"
    native = redis.Redis(port=port)
    lock = native.lock(f"bench-native:{key}", timeout=TTL)

    def native_op() -> None:
        lock.acquire()
        lock.release()

    sides: list[tuple[str, Callable[[], None]]] = []
    opened = []
    for name, url in urls:
        locks = fenced.connect(url, key_prefix="bench:")
        opened.append(locks)
        lease = locks.lock(key, ttl=TTL)

        def fenced_op(lease: Any = lease) -> None:
            lease.acquire()
            lease.release()

        sides.append((f"{name} (sync)", fenced_op))
    sides.append(("redis-py Lock (sync)", native_op))
    try:
        parts: list[list[Result]] = [[] for _ in sides]
        for r in range(ROUNDS):
            warm = 50 if r == 0 else 0
            for i, (name, op) in enumerate(sides):
                for _ in range(warm):
                    op()
                parts[i].append(
                    timed_round(name, port, lambda op=op: measure("", op, n=n // ROUNDS, warmup=0))
                )
    finally:
        for locks in opened:
            locks.close()
        native.close()
    return [merge(name, part) for (name, _), part in zip(sides, parts, strict=True)]


async def contended(
    side: Side, waiters: int, seconds: float, port: int
) -> tuple[Result, float, float, float]:
    """Steady state: ``waiters`` + 1 clients (own connection each) loop on one lock for ``seconds``.

    A client that releases asks for the lock again at once, so a lock without a queue may
    give itself straight back to the client that just released it. Returns the result (ops =
    grants, samples = time from a holder starting its release to the next grant), requests
    per grant, and the share of grants that went to the client that had just released.
    """
    clients = waiters + 1
    conns = await asyncio.gather(*(side.connect() for _ in range(clients)))
    key = f"c-{uuid.uuid4().hex[:8]}"
    clock = time.perf_counter
    res = Result(side.name)
    state: dict[str, Any] = {
        "released_at": None,
        "last": None,
        "grants": 0,
        "regrants": 0,
        "measuring": False,
        "stop": False,
    }
    holders = [0]

    async def worker(me: int, conn: Any) -> None:
        while not state["stop"]:
            release = await side.acquire(conn, key)
            now = clock()
            holders[0] += 1
            if holders[0] != 1:
                raise AssertionError("two holders at once")
            if state["measuring"]:
                state["grants"] += 1
                state["regrants"] += state["last"] == me
                if state["released_at"] is not None:
                    res.samples.append(now - state["released_at"])
            state["last"] = me
            holders[0] -= 1
            state["released_at"] = clock()
            await release()

    tasks = [asyncio.create_task(worker(i, c)) for i, c in enumerate(conns)]
    try:
        await asyncio.sleep(min(1.0, seconds / 3))  # let every client join in
        commands_before = await asyncio.to_thread(server_commands, port, side.commands)
        state["measuring"] = True
        start, cpu_start = clock(), time.process_time()
        await asyncio.sleep(seconds)
        state["measuring"] = False
        res.elapsed = clock() - start
        cpu = time.process_time() - cpu_start
        commands = await asyncio.to_thread(server_commands, port, side.commands) - commands_before
        res.ops = state["grants"]
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
    finally:
        # Let the workers finish their turn (cancelling redis-py calls is not reliable on
        # Python 3.11: asyncio.wait_for can swallow the cancellation), then cancel stragglers.
        state["stop"] = True
        _, pending = await asyncio.wait(tasks, timeout=30)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(side.close(c) for c in conns), return_exceptions=True)
    grants = max(res.ops, 1)
    return res, commands / grants, state["regrants"] / grants, cpu / grants


async def rounds(
    side: Side, waiters: int, seconds: float, port: int
) -> tuple[Result, float, float, float]:
    """Hand-off: ``waiters`` clients (own connection each) queue on a held lock, then take it once each.

    Each round a gate client holds the lock while the waiters arrive at random moments over
    0.1 s (so a polling client's attempts are spread out, as with independent arrivals);
    then the gate releases and each waiter, once granted, releases at once. Nobody takes the
    lock twice in a round, so every grant is a hand-off to a client that was waiting. Rounds
    repeat for about ``seconds``. ops = grants, elapsed = time from the gate's release to the
    round's last grant, samples = time from a holder starting its release to the next grant.
    """
    conns = await asyncio.gather(*(side.connect() for _ in range(waiters + 1)))
    gate_conn, waiter_conns = conns[0], conns[1:]
    key = f"r-{uuid.uuid4().hex[:8]}"
    clock = time.perf_counter
    res = Result(side.name)
    rng = random.Random(42)
    commands = 0
    cpu = 0.0
    try:
        deadline = clock() + seconds
        while clock() < deadline or res.ops == 0:
            release_gate = await side.acquire(gate_conn, key)
            before = await asyncio.to_thread(server_commands, port, side.commands)
            cpu_start = time.process_time()
            state: dict[str, Any] = {"released_at": None, "last_grant": 0.0, "holders": 0}

            async def waiter(conn: Any, delay: float, st: dict[str, Any] = state) -> None:
                await asyncio.sleep(delay)
                release = await side.acquire(conn, key)
                now = clock()
                st["holders"] += 1
                if st["holders"] != 1:
                    raise AssertionError("two holders at once")
                res.samples.append(now - st["released_at"])
                st["last_grant"] = now
                st["holders"] -= 1
                st["released_at"] = clock()
                await release()

            tasks = [asyncio.create_task(waiter(c, rng.uniform(0, 0.1))) for c in waiter_conns]
            await asyncio.sleep(0.15)  # every waiter has arrived and tried once
            state["released_at"] = start = clock()
            await release_gate()
            await asyncio.gather(*tasks)
            res.elapsed += state["last_grant"] - start
            res.ops += waiters
            cpu += time.process_time() - cpu_start
            commands += await asyncio.to_thread(server_commands, port, side.commands) - before
    finally:
        await asyncio.gather(*(side.close(c) for c in conns), return_exceptions=True)
    return res, commands / max(res.ops, 1), 0.0, cpu / max(res.ops, 1)


async def run_async(
    server: RedisServer,
    url: str,
    n: int,
    secs: float,
    contention: bool = True,
    before: str | None = None,
) -> list[tuple[Any, ...]]:
    ours, peer = FencedSide(url), RedisPySide(server.port)
    theirs = [ours]
    if before:
        theirs.append(FencedSide(url.replace("redis://", "redisbefore://", 1), f"fenced {before}"))
    rows: list[tuple[Any, ...]] = []
    *fenced_u, peer_u = await uncontended([*theirs, peer], n, server.port)
    for side_u in fenced_u:
        rows.append(("uncontended acquire+release", side_u, peer_u, None, None))
    if not contention:
        return rows
    for waiters in (10, 100):
        got = [await rounds(side, waiters, secs, server.port) for side in [*theirs, peer]]
        peer_c, *peer_x = got[-1]
        for side_c, *side_x in got[:-1]:
            rows.append((f"hand-off, {waiters} waiters", side_c, peer_c, side_x, peer_x))
    for waiters in (10, 100):
        got = [await contended(side, waiters, secs, server.port) for side in [*theirs, peer]]
        peer_c, *peer_x = got[-1]
        what = f"steady, {waiters} waiters, re-queue at once"
        for side_c, *side_x in got[:-1]:
            rows.append((what, side_c, peer_c, side_x, peer_x))
    return rows


def print_server_time() -> None:
    t = Table(
        title="Server time per uncontended acquire+release (INFO commandstats: usec of "
        "EVALSHA, + SET for redis-py, per round; the sides alternate round by round)"
    )
    for col in ("who", "median", "rounds (min-max)", "client CPU, median", "(min-max)"):
        t.add_column(col, justify="left" if col == "who" else "right")
    for who, per_round in SERVER_US.items():
        ordered = sorted(per_round)
        cpu = sorted(CLIENT_US.get(who, [0.0]))
        t.add_row(
            who,
            f"{ordered[len(ordered) // 2]:.1f} µs",
            f"{ordered[0]:.1f}-{ordered[-1]:.1f} µs",
            f"{cpu[len(cpu) // 2]:.0f} µs",
            f"{cpu[0]:.0f}-{cpu[-1]:.0f} µs",
        )
    Console(width=160).print(t)


def layers(url: str, port: int, rounds: int, n: int, fsync: str) -> None:
    """Client CPU and wall time per uncontended acquire+release, layer by layer, beside
    redis-py's ``Lock``: every side runs ``n`` acquire+release in a round, and the rounds of all
    sides alternate (the asyncio sides on one loop driven from this thread, the sync sides on
    this thread), so load from other processes hits every side alike. CPU is this process's
    (every thread: the sync API's loop thread too), per acquire+release, median of the rounds.

    The asyncio layers, bottom up: fenced's two scripts sent through redis-py with no fenced
    code (the floor of fenced's calls on redis-py's client), the backend alone
    (``RedisBackend.acquire``/``release``), the lease core (one ``AsyncLease`` reused), and
    ``async with locks.lock()`` (a lease made per acquire); the sync API the same two ways,
    and once more through the portal's hop (``caller_waits`` off: every call to fenced's loop
    thread and back, the sync API before session 8), for the A/B in one run.
    ``BENCH_DRIVEN=1`` adds the sync API with the fast mode's steps only (the caller hands the
    loop back at its first wait): measured worse for Redis (docs/benchmarks.md).
    """
    key = f"l-{uuid.uuid4().hex[:8]}"
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    alocks = run(fenced.connect_async(url, key_prefix="bench:").open())
    backend: Any = alocks.backend
    native_async = aioredis.Redis(port=port)
    lease = alocks.lock(key, ttl=TTL)
    owner = lease.owner

    async def peer_async() -> None:
        lock = native_async.lock(f"bench-native:{key}", timeout=TTL)
        if not await lock.acquire():
            raise RuntimeError("redis-py lock not acquired")
        await lock.release()

    keys, _ = backend._keys(key + "-raw")
    ttl_ms = TTL * 1000
    rid = "bench-raw"
    hb = backend._heartbeat_ms

    async def scripts_only() -> None:
        token = await backend._acquire(keys=keys[:3], args=(rid, ttl_ms, owner, hb))
        value = f"{token} {ttl_ms} {rid}\n{owner}"
        if not await backend._release(keys=keys[1:3], args=(value,)):
            raise RuntimeError("fenced's release script did not release")

    def on_lost(cause: BaseException) -> None:
        pass

    async def backend_only() -> None:
        grant = await backend.acquire(
            key + "-b", request_id=rid, ttl=TTL, deadline=None, on_lost=on_lost, owner=owner
        )
        if not await backend.release(grant):
            raise RuntimeError("fenced's backend did not release")

    async def lease_reused() -> None:
        await lease.acquire()
        await lease.release()

    async def lease_per_acquire() -> None:
        async with alocks.lock(key + "-w", ttl=TTL):
            pass

    locks = fenced.connect(url, key_prefix="bench:")
    native = redis.Redis(port=port)
    sync_lease = locks.lock(key + "-s", ttl=TTL)
    native_lock = native.lock(f"bench-native:{key}-s", timeout=TTL)

    def peer_sync() -> None:
        native_lock.acquire()
        native_lock.release()

    def sync_reused() -> None:
        sync_lease.acquire()
        sync_lease.release()

    def sync_per_acquire() -> None:
        with locks.lock(key + "-sw", ttl=TTL):
            pass

    # The same sync API through the portal's hop (every call to fenced's loop thread and
    # back: the sync API before session 8), for the A/B in one run.
    from fenced.backends.redis import RedisBackend

    class Hop(RedisBackend):
        scheme = "redishop"
        caller_waits = False

    fenced.register_backend("redishop", Hop)
    hlocks = fenced.connect(url.replace("redis://", "redishop://", 1), key_prefix="bench:")
    h_lease = hlocks.lock(key + "-h", ttl=TTL)

    def hop_reused() -> None:
        h_lease.acquire()
        h_lease.release()

    extra_sync = [("sync", "fenced sync Lease reused, hop (before)", hop_reused)]
    if os.environ.get("BENCH_DRIVEN"):  # (an experiment: the fast mode's steps-only drive)

        class Driven(RedisBackend):
            scheme = "redisdriven"
            caller_driven = True
            caller_waits = False

        fenced.register_backend("redisdriven", Driven)
        dlocks = fenced.connect(url.replace("redis://", "redisdriven://", 1), key_prefix="bench:")
        d_lease = dlocks.lock(key + "-d", ttl=TTL)

        def driven_reused() -> None:
            d_lease.acquire()
            d_lease.release()

        extra_sync.append(("sync", "fenced sync Lease reused, steps only", driven_reused))

    def as_sync(fn: Callable[[], Awaitable[None]]) -> Callable[[], None]:
        async def many(count: int, samples: list[float]) -> None:
            clock = time.perf_counter
            for _ in range(count):
                t0 = clock()
                await fn()
                samples.append(clock() - t0)

        def round_of(count: int, samples: list[float]) -> None:
            run(many(count, samples))

        return round_of  # type: ignore[return-value]

    def plain(fn: Callable[[], None]) -> Callable[[int, list[float]], None]:
        def round_of(count: int, samples: list[float]) -> None:
            clock = time.perf_counter
            for _ in range(count):
                t0 = clock()
                fn()
                samples.append(clock() - t0)

        return round_of

    sides: list[tuple[str, str, Any]] = [
        ("async", "redis-py Lock (async)", as_sync(peer_async)),
        ("async", "fenced's 2 scripts via redis-py, no fenced code", as_sync(scripts_only)),
        ("async", "fenced backend alone", as_sync(backend_only)),
        ("async", "fenced lease core (AsyncLease reused)", as_sync(lease_reused)),
        ("async", "fenced async with locks.lock()", as_sync(lease_per_acquire)),
        ("sync", "redis-py Lock (sync)", plain(peer_sync)),
        ("sync", "fenced sync Lease reused", plain(sync_reused)),
        ("sync", "fenced sync with locks.lock()", plain(sync_per_acquire)),
        *[(api, name, plain(fn)) for api, name, fn in extra_sync],
    ]
    cpu: dict[str, list[float]] = {name: [] for _, name, _ in sides}
    wall: dict[str, list[float]] = {name: [] for _, name, _ in sides}
    try:
        for _, _, round_of in sides:
            round_of(50, [])
        for _ in range(rounds):
            for _, name, round_of in sides:
                c0 = time.process_time()
                round_of(n, wall[name])
                cpu[name].append((time.process_time() - c0) * 1e6 / n)
    finally:
        locks.close()
        hlocks.close()
        native.close()
        run(alocks.aclose())
        run(native_async.aclose())
        loop.close()
    t = Table(
        title=f"Client cost per uncontended acquire+release, layer by layer (appendfsync "
        f"{fsync}; {rounds} rounds of {n}, all sides interleaved round by round)"
    )
    for col in (
        "api",
        "who",
        "client CPU (median)",
        "(min-max)",
        "wall p50",
        "ops/s",
        "× redis-py",
    ):
        t.add_column(col, justify="left" if col in ("api", "who") else "right")
    peer_rate = {}
    for api, name, _ in sides:
        rate = len(wall[name]) / sum(wall[name])
        if name.startswith("redis-py"):
            peer_rate[api] = rate
        ordered = sorted(cpu[name])
        t.add_row(
            api,
            name,
            f"{statistics.median(ordered):.0f} µs",
            f"{ordered[0]:.0f}-{ordered[-1]:.0f} µs",
            fmt_us(statistics.median(wall[name])),
            f"{rate:,.0f}",
            f"{rate / peer_rate[api]:.2f}×",
        )
    Console(width=160).print(t)


def fenced_url(server: RedisServer, fsync: str) -> str:
    """fenced's URL for ``server``: a server without ``appendfsync always`` is refused unless
    the caller accepts it (as the user of such a server must)."""
    return server.url if fsync == "always" else server.url + "?allow_unsafe_durability=true"


def main(
    quick: bool,
    contention: bool = True,
    before: str | None = None,
    fsync: str = "always",
    layers_only: bool = False,
) -> None:
    n = 300 if quick else 2000
    secs = 1.5 if quick else 4.0
    if before:
        fenced.register_backend("redisbefore", backend_at(before))
    with RedisServer(extra=["--appendfsync", fsync]) as server:
        url = fenced_url(server, fsync)
        if layers_only:
            layers(url, server.port, 20 if quick else 40, 50 if quick else 100, fsync)
            return
        urls = [("fenced redis://", url)]
        if before:
            urls.append((f"fenced {before}", url.replace("redis://", "redisbefore://", 1)))
        *sync_fenced, sync_peer = uncontended_sync(urls, server.port, n)
        rows = asyncio.run(run_async(server, url, n, secs, contention, before))
    all_rows = [("uncontended acquire+release", side, sync_peer) for side in sync_fenced]
    all_rows += [(what, ours, peer) for what, ours, peer, _, _ in rows]
    table(
        f"Redis 7.0 (loopback, appendonly yes, appendfsync {fsync}): fenced redis:// vs "
        "redis-py Lock",
        all_rows,
        note=(
            "uncontended: p50/p99 of one acquire+release by one client (sync API: the "
            "caller's thread drives fenced's loop and waits for the reply itself; a --before "
            "side from before session 8: one hop to the loop thread and back per call).\n"
            "hand-off: N waiters arrive (spread over 0.1 s) while a gate client holds the lock, "
            "then take it once each: ops/s = grants/s, p50/p99 = from a holder starting its "
            "release to the next grant. steady: N+1 clients loop, re-asking at once after a "
            "release (a lock without a queue then often goes back to the releaser: second "
            "table).\n"
            "fenced: 1 Lua script to acquire (grant + token INCR), 1 to release, which hands the "
            "lock (and its token) straight to the first waiter, blocked in BLPOP: no polling.\n"
            "redis-py Lock: SET NX PX to acquire, Lua compare-and-delete to release; a blocked "
            "caller polls every 0.1 s (its default `sleep`, used as is); no token, no queue."
        ),
    )
    print_server_time()
    if not contention:
        return
    t = Table(
        title="Per grant: requests the clients sent (fenced: EVALSHA, BLPOP; redis-py: SET, "
        "EVALSHA), client CPU (all clients run in this one process), share to the releaser"
    )
    cols = ("what", "fenced", "fenced req", "redis-py req", "fenced CPU", "redis-py CPU")
    for col in (*cols, "fenced: to releaser", "redis-py: to releaser"):
        t.add_column(col, justify="left" if col in ("what", "fenced") else "right")
    for what, ours, _, ours_x, peer_x in rows:
        if ours_x is None:
            continue
        steady = what.startswith("steady")
        t.add_row(
            what,
            ours.name,
            f"{ours_x[0]:.1f}",
            f"{peer_x[0]:.1f}",
            fmt_us(ours_x[2]),
            fmt_us(peer_x[2]),
            f"{ours_x[1]:.0%}" if steady else "-",
            f"{peer_x[1]:.0%}" if steady else "-",
        )
    Console(width=160).print(t)


if __name__ == "__main__":
    argv = sys.argv[1:]
    fsync = argv[argv.index("--fsync") + 1] if "--fsync" in argv else "always"
    if fsync not in ("always", "everysec"):
        sys.exit(f"--fsync: always or everysec, not {fsync!r}")
    main(
        "--quick" in argv,
        contention="--uncontended" not in argv,
        before=argv[argv.index("--before") + 1] if "--before" in argv else None,
        fsync=fsync,
        layers_only="--layers" in argv,
    )
