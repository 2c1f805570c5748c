"""Server time of fenced's Redis scripts per uncontended acquire+release, side by side.

``INFO commandstats`` gives each command's total server µs (a script's time includes the
commands it calls); the variants run in blocks of cycles, rotated, on one server (AOF
``appendfsync always``), and the median of the blocks' µs per cycle is printed, so load drift
hits them all alike and a preempted block does not move the figure. Rows: fenced's scripts
(as in ``src``, or as in a git revision with ``--before REV``), redis-py's ``Lock`` (``SET NX
PX`` command + its release script), the floor of any design with two scripts (a ``SET NX
PX`` script and redis-py's release script), and the floor of an acquire with no script (``SET
NX PX`` and ``INCR`` in one ``MULTI``, then the release script).

``--instructions`` counts instead the instructions the server runs per cycle (callgrind,
from reading the command to its propagation to the AOF: CPU work only, deterministic, so
unmoved by the load of a shared machine; needs valgrind).

``--fsync`` repeats the runs with ``appendfsync everysec`` and with ``appendonly no``: the AOF
fsync itself is not in a command's time (Redis 7.0 writes and fsyncs the AOF in the event
loop's ``beforeSleep``, after the command is timed), but a script run right after one, on a
thread that slept through it, runs cold.

``--ablate`` adds the current scripts each without one of the things its uncontended path
does (the `EXISTS`, the `INCR`, the `PX`, the release's marker and its queue check): what
each one costs.
``--handoff`` measures the contended cycle instead (a waiter queues, the release hands it
the lock, it releases).

    .venv/bin/python bench/bench_redis_scripts.py [--before REV] [--runs N] [--instructions]
        [--fsync | --handoff] [--ablate]
"""

from __future__ import annotations

import collections
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import redis

from fenced.backends import redis as backend
from fenced.testing.servers import RedisServer, free_port

FLOOR_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""
NATIVE_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
LAYOUT = ("token", "holder", "queue", "hb", "seq", "ttls", "owners")
Op = Callable[[], None]


def scripts_at(rev: str) -> tuple[str, str]:
    """ACQUIRE_LUA and RELEASE_LUA of src/fenced/backends/redis.py at git revision ``rev``."""
    root = os.path.join(os.path.dirname(__file__), "..")
    text = subprocess.run(
        ["git", "-C", root, "show", f"{rev}:src/fenced/backends/redis.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    try:
        spec = importlib.util.spec_from_file_location("fenced.backends._bench_old", f.name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        os.unlink(f.name)
    return module.ACQUIRE_LUA, module.RELEASE_LUA


class Scripts:
    """One variant's acquire and release, called with the keys and arguments of its version
    (all seven keys before issue 28 §3's second round; the uncontended path's own since)."""

    def __init__(self, c: redis.Redis, name: str, acquire_src: str, release_src: str) -> None:
        # (a comment makes each variant's scripts distinct)
        self.acquire = c.register_script(f"{acquire_src}\n-- {name}")
        self.release = c.register_script(f"{release_src}\n-- {name}")
        for script in (self.acquire, self.release):  # (else the first EVALSHA fails, NOSCRIPT)
            c.script_load(script.script)
        self.full = "ARGV[7]" in release_src or "ARGV[5] .. ARGV[1]" in release_src
        self.floor = acquire_src == FLOOR_ACQUIRE  # its release compares the request id
        base = f"bench:{{{name}}}"
        self.keys = [f"{base}:{k}" for k in LAYOUT]
        self.wake = f"{base}:wake:"

    def grant(self, rid: str, owner: str) -> object:
        if self.full:
            args: list[str | int] = [rid, 10_000, "wait", 3_000, self.wake, owner]
            return self.acquire(keys=self.keys, args=args)
        if self.floor:
            return self.acquire(keys=self.keys[1:2], args=[rid, 10_000])
        return self.acquire(keys=self.keys[:3], args=[rid, 10_000, owner, 3_000])

    def free(self, rid: str, token: int | str, owner: str) -> object:
        value = f"{token} 10000 {rid}\n{owner}" if owner else f"{token} 10000 {rid}"
        if self.full:
            args: list[str | int] = [rid, 0, "release", 3_000, self.wake, token, value]
            return self.release(keys=self.keys, args=args)
        if self.floor:
            return self.release(keys=self.keys[1:2], args=[rid])
        return self.release(keys=self.keys[1:3], args=[value])


def token_of(got: object) -> int | str:
    # The bare token since issue 28 §3, {1, token, pttl, ttl} before.
    if isinstance(got, int):
        return got
    assert isinstance(got, list) and got[0] == 1, got
    token: int | str = got[1]
    return token


def uncontended_ops(c: redis.Redis, variants: dict[str, tuple[str, str]]) -> dict[str, Op]:
    ops: dict[str, Op] = {}
    for name, (acquire_src, release_src) in variants.items():
        s = Scripts(c, name, acquire_src, release_src)

        def op(s: Scripts = s) -> None:
            token = token_of(s.grant("rid", "owner"))
            assert s.free("rid", token, "owner") == 1

        ops[name] = op
    native_release = c.register_script(NATIVE_RELEASE)

    def native() -> None:
        assert c.set("bench:native", "tok", nx=True, px=10_000)
        assert native_release(keys=["bench:native"], args=["tok"]) == 1

    ops["redis-py Lock"] = native

    def multi() -> None:
        # The floor of an acquire with no script: the lock and a token in one MULTI (the INCR
        # runs, and burns a token, even when SET NX fails); no FIFO check, no holder record.
        p = c.pipeline(transaction=True)
        p.set("bench:multi", "tok", nx=True, px=10_000).incr("bench:multi:token")
        ok, _ = p.execute()
        assert ok
        assert native_release(keys=["bench:multi"], args=["tok"]) == 1

    ops["floor: MULTI acquire + release script"] = multi
    return ops


def handoff_ops(c: redis.Redis, variants: dict[str, tuple[str, str]]) -> dict[str, Op]:
    """A takes the lock, B queues, A's release hands the lock to B (B reads it from its wake
    list, as its BLPOP would), B releases: four scripts."""
    ops: dict[str, Op] = {}
    for name, (acquire_src, release_src) in variants.items():
        s = Scripts(c, name, acquire_src, release_src)

        def op(s: Scripts = s) -> None:
            token = token_of(s.grant("A", "a"))
            queued = s.grant("B", "b")
            assert isinstance(queued, list) and queued[0] == 0, queued
            assert s.free("A", token, "a") == 1
            handed = c.lpop(f"{s.wake}B")
            assert isinstance(handed, str), "no hand-off"
            assert s.free("B", handed.partition(":")[0], "b") == 1

        ops[name] = op
    return ops


def usec(c: redis.Redis, names: tuple[str, ...]) -> int:
    stats = c.info("commandstats")
    return sum(int(stats[f"cmdstat_{n}"]["usec"]) for n in names if f"cmdstat_{n}" in stats)


def run(
    make: Callable[[redis.Redis], dict[str, Op]],
    config: tuple[str, ...] = (),
    rounds: int = 40,
    block: int = 25,
) -> None:
    """One server; ``rounds`` blocks of ``block`` cycles per variant, rotated round by round
    (a script's cost depends on what ran just before it: no variant always follows the same
    one); median of the blocks' server µs per cycle (INFO commandstats)."""
    with RedisServer(extra=list(config)) as server:
        c = redis.Redis(port=server.port, decode_responses=True)
        ops = list(make(c).items())
        for _, op in ops:
            for _ in range(block):
                op()
        per_cycle: dict[str, list[float]] = collections.defaultdict(list)
        for _ in range(rounds):
            for name, op in ops:
                # fenced's scripts call SET, which INFO counts under SET as well.
                names = (
                    ("evalsha", "set")
                    if name == "redis-py Lock"
                    else ("evalsha", "exec", "multi")
                    if name.startswith("floor: MULTI")
                    else ("evalsha",)
                )
                before = usec(c, names)
                for _ in range(block):
                    op()
                per_cycle[name].append((usec(c, names) - before) / block)
            ops = ops[1:] + ops[:1]
        c.close()
    for name, values in per_cycle.items():
        q1, _, q3 = statistics.quantiles(values, n=4)
        print(
            f"  {name:32s} {statistics.median(values):6.1f} µs per cycle "
            f"(median of {len(values)} blocks; quartiles {q1:.1f}–{q3:.1f})"
        )


@contextmanager
def callgrind_server() -> Iterator[tuple[redis.Redis, Callable[[], int]]]:
    """redis-server under callgrind, counting the instructions of processCommand (reading a
    command to its AOF propagation); ECHO zeroes the count, PING dumps it. Yields a client
    and a function that returns the instructions since the last call."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind")
    d = tempfile.mkdtemp(prefix="fenced-bench-")
    port = free_port()
    out = os.path.join(d, "cg.out")
    server = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            "--collect-atstart=no",
            "--toggle-collect=processCommand",
            "--zero-before=echoCommand",
            "--dump-before=pingCommand",
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--dir",
            d,
        ],
        cwd=d,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                c = redis.Redis(port=port, decode_responses=True)
                c.echo("ready")
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.2)  # (valgrind starting: nothing to wait on but the port)
        dumps = [0]

        def count() -> int:
            c.ping()
            c.echo("zero")
            dumps[0] += 1
            with open(f"{out}.{dumps[0]}") as f:
                found = re.search(r"^(?:summary|totals):\s+(\d+)", f.read(), re.M)
            assert found is not None
            return int(found.group(1))

        yield c, count
        c.close()
    finally:
        server.terminate()
        server.wait(60)
        shutil.rmtree(d, ignore_errors=True)


def run_instructions(make: Callable[[redis.Redis], dict[str, Op]], n: int = 400) -> None:
    with callgrind_server() as (c, count):
        ops = make(c)
        for name, op in ops.items():
            for _ in range(20):
                op()
            count()
            for _ in range(n):
                op()
            print(f"  {name:32s} {count() / n:9,.0f} instructions per cycle")


def ablations() -> dict[str, tuple[str, str]]:
    """The current scripts, each without one of the things the uncontended path does (none of
    them a usable lock: they measure what each thing costs, so the design's floor)."""
    a, r = backend.ACQUIRE_LUA, backend.RELEASE_LUA

    def without(src: str, old: str, new: str) -> str:
        assert old in src, old
        return src.replace(old, new, 1)

    return {
        "- acquire's EXISTS": (
            without(a, "if redis.call('EXISTS', KEYS[2], KEYS[3]) == 0 then", "if true then"),
            r,
        ),
        "- acquire's INCR": (without(a, "local n = redis.call('INCR', KEYS[1])", "local n = 7"), r),
        "- acquire's PX": (
            without(
                a,
                "redis.call('SET', KEYS[2], value, 'PX', ttl)",
                "redis.call('SET', KEYS[2], value)",
            ),
            r,
        ),
        "- release's marker (DEL, not RENAME)": (
            a,
            without(
                r,
                "redis.call('RENAME', KEYS[1], string.sub(KEYS[1], 1, -7) .. 'released')",
                "redis.call('DEL', KEYS[1])",
            ),
        ),
        "- release's queue check": (
            a,
            without(
                r,
                "if redis.call('EXISTS', KEYS[2]) == 0 then return 1 end",
                "do return 1 end",
            ),
        ),
    }


def main() -> None:
    args = sys.argv[1:]
    runs = int(args[args.index("--runs") + 1]) if "--runs" in args else 3
    variants = {"fenced (src)": (backend.ACQUIRE_LUA, backend.RELEASE_LUA)}
    if "--before" in args:
        rev = args[args.index("--before") + 1]
        variants[f"fenced ({rev})"] = scripts_at(rev)
    if "--ablate" in args:
        variants.update(ablations())
    if "--handoff" in args:
        fenced_only = {k: v for k, v in variants.items() if k.startswith("fenced")}

        def make(c: redis.Redis) -> dict[str, Op]:
            return handoff_ops(c, fenced_only)

        what = "server µs per contended cycle, 4 scripts"
    else:
        variants["floor: two minimal scripts"] = (FLOOR_ACQUIRE, NATIVE_RELEASE)

        def make(c: redis.Redis) -> dict[str, Op]:
            return uncontended_ops(c, variants)

        what = "server µs per uncontended acquire+release"
    if "--instructions" in args:
        print(f"instructions (callgrind), {what.replace('server µs ', '')}")
        run_instructions(make)
        return
    configs: dict[str, tuple[str, ...]] = {"appendfsync always": ()}
    if "--fsync" in args and "--handoff" not in args:
        configs["appendfsync everysec"] = ("--appendfsync", "everysec")
        configs["appendonly no"] = ("--appendonly", "no")
    for config_name, config in configs.items():
        for i in range(runs):
            print(f"run {i + 1}, {config_name} ({what}, INFO commandstats)")
            run(make, config=config)


if __name__ == "__main__":
    main()
