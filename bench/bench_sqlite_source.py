"""sqlite:// token source vs the bare SQL of the same transactions, and contended handoff.

(a) Uncontended acquire+release, timed op by op and *interleaved* with the peer (so load from
    other processes and disk drift hit both alike). The peer runs the very same statements
    (imported from ``fenced.backends.sqlite``), same pragmas (WAL, synchronous=FULL), on a plain
    ``sqlite3`` connection in the calling thread: two ``BEGIN IMMEDIATE`` transactions, two
    fsyncs. Extra rows split fenced's cost into the SQL, the backend's Python, the lease core,
    and the sync API's portal (driven by the caller's thread when fenced's loop thread is idle;
    a "portable mode" row forces the portal's portable mode (``FENCED_PORTAL=portable``), a
    round trip to the loop thread per call; a "bound" row
    replaces the portal by a bare ``coro.send``, the most the sync layer could ever save).
(b) Contended handoff: 4 OS processes acquire and release one lock in a loop; handoff latency is
    release started -> next holder granted (both read on CLOCK_BOOTTIME, machine-wide). The
    peer is the same SQL hand-rolled as a spin lock (retry the acquire transaction every 1 ms
    under SQLite's busy handler): what one writes without a waiter queue. A second row runs 4
    threads of one process, where a release wakes the next waiter directly instead of by polling.
(c) fsyncs per acquire+release counted with ``strace -f -c`` (when strace is available).

Run: ``.venv/bin/python bench/bench_sqlite_source.py`` (BENCH_N, BENCH_SECONDS to change sizes).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Result, finish, fmt_us, interleaved, table

import fenced
from fenced._core import clock as _clock
from fenced._core.portal import Portal, mark_private
from fenced.backends import sqlite as S

HERE = os.path.abspath(__file__)
T = TypeVar("T")


# -- the peer: the same two transactions, bare ------------------------------------------------


class BareSQL:
    """Exactly the statements of SQLiteBackend's uncontended acquire and release."""

    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None, timeout=S.BUSY_WAIT)
        for pragma in S.PRAGMAS:
            self.conn.execute(pragma).fetchall()
        self.boot = _clock.boot_id()

    def acquire(self, name: str, request_id: str, ttl: float) -> int:
        conn = self.conn
        sent_at = _clock.now()
        conn.execute("BEGIN IMMEDIATE")
        now = _clock.now()
        conn.execute(S.SQL_LOCK_STATE, (name, self.boot, now)).fetchone()
        value: int = conn.execute(S.SQL_NEXT_TOKEN, (name,)).fetchone()[0]
        conn.execute(
            S.SQL_SET_HOLDER, (name, request_id, value, ttl, sent_at + ttl, self.boot, "bench")
        )
        conn.execute("COMMIT")
        return value

    def release(self, name: str, token: int, request_id: str) -> None:
        conn = self.conn
        conn.execute("BEGIN IMMEDIATE")
        now = _clock.now()
        conn.execute(S.SQL_RELEASE, (name, token, request_id, self.boot, now)).fetchone()
        conn.execute("COMMIT")

    def op(self) -> None:
        token = self.acquire("bare", "r", 30.0)
        self.release("bare", token, "r")


async def interleaved_async(
    ours_name: str, ours: Callable[[], Awaitable[object]], peer: Callable[[], object], n: int
) -> tuple[Result, Result]:
    """Like :func:`interleaved`, inside one coroutine (no per-op loop start-up cost)."""
    ra, rb = Result(ours_name), Result("bare SQL")
    clock = time.perf_counter
    for _ in range(50):
        await ours()
        peer()
    for _ in range(n):
        t0 = clock()
        await ours()
        t1 = clock()
        peer()
        t2 = clock()
        ra.samples.append(t1 - t0)
        rb.samples.append(t2 - t1)
    return finish(ra, n), finish(rb, n)


def uncontended(root: str, n: int) -> None:
    path = os.path.join(root, "uncontended.db")
    url = f"sqlite:///{path}"
    bare = BareSQL(path)
    locks = fenced.connect(url)
    lease = locks.lock("reused", ttl=30)

    def sync_with() -> None:
        with locks.lock("sync", ttl=30):
            pass

    def sync_reused() -> None:
        lease.acquire()
        lease.release()

    # A bound, not a design: the sync API with a portal that costs nothing — the lease core's
    # coroutine sent straight on this thread (no task, no Ctrl-C gate, no latch; it would
    # fail on the first coroutine that waits). What the sync layer could at best save.
    def free_portal(coro: Coroutine[Any, Any, T]) -> T:
        portal = locks._portal
        assert portal._fast is not None, "the bound needs the portal's fast mode"
        saved = asyncio._get_running_loop()
        with portal._fast.lock:
            asyncio._set_running_loop(portal.loop)
            try:
                coro.send(None)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            finally:
                asyncio._set_running_loop(saved)
        raise RuntimeError("the bound's coroutine waited: not an uncontended acquire")

    def sync_free_portal() -> None:
        inner = locks.lock("bound", ttl=30)._inner
        free_portal(inner.acquire(None))
        free_portal(inner.finish(None, None))

    # The same in the portal's portable mode (FENCED_PORTAL=portable: public asyncio only,
    # caller-driven calls off): every call hops to the loop thread.
    asked = os.environ.get("FENCED_PORTAL")
    os.environ["FENCED_PORTAL"] = "portable"
    try:
        hopping = fenced.connect(url)
    finally:
        if asked is None:
            del os.environ["FENCED_PORTAL"]
        else:
            os.environ["FENCED_PORTAL"] = asked
    assert not hopping._portal.drive

    def sync_hop() -> None:
        with hopping.lock("hop", ttl=30):
            pass

    rows = interleaved(
        [
            ("sync API: with locks.lock()", sync_with, "bare SQL", bare.op),
            ("sync API: reused lease", sync_reused, "bare SQL", bare.op),
            ("sync API, portable mode (a hop per call)", sync_hop, "bare SQL", bare.op),
            ("bound: sync API with a free portal", sync_free_portal, "bare SQL", bare.op),
        ],
        n,
    )
    hopping.close()
    noop: Callable[[BaseException], None] = lambda exc: None  # noqa: E731

    async def on_loop(private: bool) -> list[tuple[Result, Result]]:
        """The async API on this loop: flagged private, the way the sync API runs it."""
        if private:
            mark_private(asyncio.get_running_loop())
        where = "fenced's loop, no hop" if private else "app loop, worker thread"
        out = []
        async with fenced.connect_async(url) as alocks:

            async def with_lock() -> None:
                async with alocks.lock("async", ttl=30):
                    pass

            out.append(await interleaved_async(f"async API ({where})", with_lock, bare.op, n))
            if private:
                backend = alocks.backend

                async def backend_only() -> None:
                    grant = await backend.acquire(
                        "backend", request_id="r", ttl=30, deadline=None, on_lost=noop
                    )
                    await backend.release(grant)

                out.append(
                    await interleaved_async(f"backend only ({where})", backend_only, bare.op, n)
                )
        return out

    rows += asyncio.run(on_loop(private=False))
    rows += asyncio.run(on_loop(private=True))

    async def empty() -> None:
        return None

    clock = time.perf_counter
    driven = Result("portal call, caller-driven")
    for _ in range(n):
        t0 = clock()
        locks._portal.call(empty())
        driven.samples.append(clock() - t0)
    hopping = Portal("bench-hop")
    hop = Result("portal round trip")
    for _ in range(n):
        t0 = clock()
        hopping.call(empty())
        hop.samples.append(clock() - t0)
    hopping.stop()
    one_tx = Result("bare SQL, 1 transaction")
    for _ in range(n):
        t0 = clock()
        token = bare.acquire("bare1", "r", 30.0)
        one_tx.samples.append(clock() - t0)
        bare.release("bare1", token, "r")
    table(
        f"(a) uncontended acquire+release, {n} interleaved ops each"
        " (ratio = fenced ops/s ÷ bare-SQL ops/s; target ≥ 0.8×)",
        [("acquire+release", ours, peer) for ours, peer in rows],
        note=(
            f"one sync-API call of an empty coroutine (2 per acquire+release): run by the caller's"
            f" thread p50 {fmt_us(driven.p50)}, mean {fmt_us(driven.mean)}; by a hop to fenced's"
            f" loop thread and back p50 {fmt_us(hop.p50)}, mean {fmt_us(hop.mean)};"
            f" one bare transaction with its fsync: p50 {fmt_us(one_tx.p50)},"
            f" mean {fmt_us(one_tx.mean)}"
        ),
    )
    locks.close()
    bare.conn.close()


# -- (b) contended handoff ------------------------------------------------------------------------


def naive_acquire(bare: BareSQL, name: str, request_id: str) -> int:
    """The peer's lock: retry the same acquire transaction every 1 ms until the lock is free."""
    conn = bare.conn
    while True:
        sent_at = _clock.now()
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:
            continue  # busy_timeout expired: try again
        now = _clock.now()
        holder, _, _, expires, boot, _ = conn.execute(
            S.SQL_LOCK_STATE, (name, bare.boot, now)
        ).fetchone()
        if holder is None or boot != bare.boot or expires <= now:
            value: int = conn.execute(S.SQL_NEXT_TOKEN, (name,)).fetchone()[0]
            conn.execute(
                S.SQL_SET_HOLDER, (name, request_id, value, 30.0, sent_at + 30, bare.boot, "b")
            )
            conn.execute("COMMIT")
            return value
        conn.execute("COMMIT")  # read only: no fsync
        time.sleep(0.001)


def contend(kind: str, url: str, seconds: float, ready: Callable[[], None]) -> list[list[Any]]:
    """One contender: connect, wait for the start, then acquire, note the times, release."""
    spans: list[list[Any]] = []
    me = f"{os.getpid()}-{threading.get_ident()}"
    if kind == "fenced":
        with fenced.connect(url) as locks:
            ready()
            end = _clock.now() + seconds
            while _clock.now() < end:
                lease = locks.lock("contended", ttl=30)
                token = lease.acquire(timeout=30)
                granted = released = _clock.now()
                lease.release()
                spans.append([granted, released, token.value, me])
    else:
        bare = BareSQL(url.removeprefix("sqlite:///"))
        bare.conn.execute("PRAGMA busy_timeout = 5000")  # SQLite's own busy handler
        ready()
        end = _clock.now() + seconds
        while _clock.now() < end:
            value = naive_acquire(bare, "naive", me)
            granted = released = _clock.now()
            bare.release("naive", value, me)
            spans.append([granted, released, value, me])
        bare.conn.close()
    return spans


def _process_ready() -> None:
    print("ready", flush=True)
    sys.stdin.readline()  # "go"


def run_processes(kind: str, url: str, seconds: float, n: int = 4) -> list[list[Any]]:
    procs = [
        subprocess.Popen(
            [sys.executable, HERE, "--worker", kind, url, str(seconds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    for p in procs:  # everyone started and connected
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    spans: list[list[Any]] = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 60)
        spans.extend(json.loads(out.strip().splitlines()[-1]))
    return spans


def run_threads(kind: str, url: str, seconds: float, n: int = 4) -> list[list[Any]]:
    spans: list[list[Any]] = []
    mutex = threading.Lock()
    barrier = threading.Barrier(n)

    def one() -> None:
        mine = contend(kind, url, seconds, barrier.wait)
        with mutex:
            spans.extend(mine)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return spans


def handoffs(name: str, spans: list[list[Any]], seconds: float) -> tuple[Result, float]:
    """Release started -> next holder granted, where the next holder is another contender.

    Returns those latencies and the share of grants that went straight back to the releaser
    (barging: the releaser retook the lock although others were waiting).
    """
    spans = sorted(spans, key=lambda s: s[2])
    res = Result(name)
    same = 0
    for (_, released, token, who), (granted, _, nxt, nxt_who) in itertools.pairwise(spans):
        if nxt <= token or granted < released:
            raise AssertionError(f"token {nxt} granted after {token}, or overlapping")
        if who == nxt_who:
            same += 1
        else:
            res.samples.append(granted - released)
    res.ops, res.elapsed = len(spans), seconds
    return res, same / max(1, len(spans) - 1)


def contended(root: str, seconds: float) -> None:
    url = f"sqlite:///{os.path.join(root, 'contended.db')}"
    fenced.connect(url).close()  # create the schema before the race
    rows, barging = [], []
    for label, run in (("4 processes", run_processes), ("4 threads, 1 process", run_threads)):
        ours, ours_same = handoffs(f"fenced, {label}", run("fenced", url, seconds), seconds)
        peer, peer_same = handoffs(f"spin lock, {label}", run("naive", url, seconds), seconds)
        rows.append((label, ours, peer))
        barging.append(f"{label}: fenced {ours_same:.0%}, spin lock {peer_same:.0%}")
    table(
        f"(b) contended: one lock, {seconds:.0f} s per row (ops/s = grants/s;"
        " p50/p99 = release started -> another contender granted)",
        rows,
        note=(
            "grants that went straight back to the releaser although others waited (barging): "
            + "; ".join(barging)
            + ".\npeer: the same SQL hand-rolled as a spin lock (retry the acquire transaction"
            " every 1 ms, SQLite's busy handler): no FIFO, no queue, no async, no renewal; it"
            " wins throughput by barging. fenced hands over FIFO: a release rings the head of"
            " the queue (datagram to its process, or an event in this process); 2 fsynced"
            " commits per grant (release, grant); queueing commits without fsync."
        ),
    )


# -- (c) fsync count --------------------------------------------------------------------------------


FSYNC_SCRIPT = """
import sys, fenced
sys.path.insert(0, {bench_dir!r})
from bench_sqlite_source import BareSQL
n = {n}
if {fenced_side!r}:
    with fenced.connect("sqlite:///{path}") as locks:
        for _ in range(n):
            with locks.lock("f", ttl=30):
                pass
else:
    bare = BareSQL({path!r})
    for _ in range(n):
        bare.op()
"""


def fsyncs(root: str, n: int = 200) -> None:
    if shutil.which("strace") is None:
        print("(c) strace not found: synchronous=FULL in WAL mode = 1 fsync of the WAL per commit,")
        print("    so 2 per acquire+release (plus one per checkpoint, every ~1000 pages).")
        return
    counts = {}
    for side in ("fenced", "bare"):
        path = os.path.join(root, f"fsync-{side}.db")
        fenced.connect(f"sqlite:///{path}").close()  # the schema, for both sides
        base = _count_fsyncs(path, side, 0)
        counts[side] = (_count_fsyncs(path, side, n) - base) / n
    print(
        f"(c) fsync+fdatasync per acquire+release (strace -f -c, {n} ops, start-up subtracted): "
        f"fenced {counts['fenced']:.2f}, bare SQL {counts['bare']:.2f}"
        " (synchronous=FULL: one fsync of the WAL per commit, 2 commits)"
    )


def _count_fsyncs(path: str, side: str, n: int) -> int:
    script = FSYNC_SCRIPT.format(
        bench_dir=os.path.dirname(HERE), n=n, fenced_side=side == "fenced", path=path
    )
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        subprocess.run(
            [
                *("strace", "-f", "-c", "-e", "trace=fsync,fdatasync", "-o", out.name),
                *(sys.executable, "-c", script),
            ],
            check=True,
        )
        text = out.read()
    calls = re.findall(
        r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?f(?:data)?sync$", text, re.M
    )
    return sum(int(c) for c in calls)


def main() -> None:
    n = int(os.environ.get("BENCH_N", "1500"))
    seconds = float(os.environ.get("BENCH_SECONDS", "5"))
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as root:
        uncontended(root, n)
        contended(root, seconds)
        fsyncs(root)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        spans = contend(sys.argv[2], sys.argv[3], float(sys.argv[4]), _process_ready)
        print(json.dumps(spans), flush=True)
    else:
        main()
