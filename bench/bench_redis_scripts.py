"""Server time of fenced's Redis scripts per uncontended acquire+release, call by call.

Each call's own server time comes from ``SLOWLOG`` (threshold 0), so variants can be
interleaved call by call on one server (AOF ``appendfsync always``) and load drift hits them
all alike; medians per script keep a preempted call from moving the figure. Rows: fenced's
scripts (as in ``src``, or as in a git revision with ``--before REV``), redis-py's ``Lock``
(``SET NX PX`` command + its release script), and the floor of any design with two scripts
(a ``SET NX PX`` script and redis-py's release script).

``--fsync`` repeats the runs with ``appendfsync everysec`` and with ``appendonly no``: the AOF
fsync itself is not in a command's time (Redis 7.0 writes and fsyncs the AOF in the event
loop's ``beforeSleep``, after the command is timed), but a script run right after one, on a
thread that slept through it, runs cold.

``--ablate`` adds the current scripts each without one of the things its uncontended path
does (the `EXISTS`, the `INCR`, the `PX`, the release's queue check): what each one costs.
``--handoff`` measures the contended cycle instead (a waiter queues, the release hands it
the lock, it releases).

    .venv/bin/python bench/bench_redis_scripts.py [--before REV] [--runs N] [--fsync | --handoff] [--ablate]
"""

from __future__ import annotations

import collections
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import redis

from fenced.backends import redis as backend
from fenced.testing.servers import RedisServer

FLOOR_ACQUIRE = """
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""
NATIVE_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


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


def run(
    variants: dict[str, tuple[str, str]],
    rounds: int = 4,
    n: int = 250,
    config: tuple[str, ...] = (),
) -> None:
    """One server; ``rounds`` × ``n`` acquire+release per variant, interleaved call by call."""
    extra = ["--slowlog-log-slower-than", "0", "--slowlog-max-len", "100000", *config]
    with RedisServer(extra=extra) as server:
        c = redis.Redis(port=server.port, decode_responses=True)
        ops: dict[str, Callable[[], None]] = {}
        tags: dict[str, tuple[str, str]] = {}
        for name, (acquire_src, release_src) in variants.items():
            # (a comment makes each variant's scripts distinct, so SLOWLOG tells them apart)
            acquire = c.register_script(f"{acquire_src}\n-- {name}")
            release = c.register_script(f"{release_src}\n-- {name}")
            base = f"bench:{{{name}}}"
            keys = [
                f"{base}:{k}" for k in ("token", "holder", "queue", "hb", "seq", "ttls", "owners")
            ]

            def op(a=acquire, r=release, k=keys, wake=f"{base}:wake:") -> None:
                got = a(keys=k, args=["rid", 10_000, "wait", 3_000, wake, "owner"])
                # The bare token since issue 28 §3, {1, token, pttl, ttl} before.
                token = got if isinstance(got, int) else got[1]
                assert isinstance(got, int) or got[0] == 1, got
                # ARGV[7], the grant's holder value (scripts before issue 28 §3 ignore it).
                value = f"{token} 10000 rid\nowner"
                assert r(keys=k, args=["rid", 0, "release", 3_000, wake, token, value]) == 1

            ops[name] = op
            tags[acquire.sha] = (name, "acquire")
            tags[release.sha] = (name, "release")
            for script in (acquire, release):  # (else the first EVALSHA fails, NOSCRIPT)
                c.script_load(script.script)
        native_release = c.register_script(NATIVE_RELEASE)
        tags[native_release.sha] = ("redis-py Lock", "release")

        def native() -> None:
            assert c.set("bench:native", "tok", nx=True, px=10_000)
            assert native_release(keys=["bench:native"], args=["tok"]) == 1

        ops["redis-py Lock"] = native
        durations: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
        order = list(ops.values())
        for _ in range(rounds):
            c.slowlog_reset()
            for _ in range(n):
                for op in order:
                    op()
            # A script's cost depends on what ran just before it (the caches it finds):
            # rotate the order each round so that no variant always follows the same one.
            order = order[1:] + order[:1]
            for entry in c.slowlog_get(100_000):
                command = entry["command"].decode().split()
                if command[0].upper() == "EVALSHA" and command[1] in tags:
                    durations[tags[command[1]]].append(entry["duration"])
                elif command[0].upper() == "SET" and command[1] == "bench:native":
                    durations[("redis-py Lock", "acquire")].append(entry["duration"])
        c.close()
    for name in ops:
        a = statistics.median(durations[(name, "acquire")])
        r = statistics.median(durations[(name, "release")])
        print(f"  {name:32s} acquire {a:5.1f} + release {r:5.1f} = {a + r:5.1f} µs (medians)")


def run_handoff(variants: dict[str, tuple[str, str]], rounds: int = 4, n: int = 150) -> None:
    """The contended cycle, per variant: A takes the lock, B queues, A's release hands the
    lock to B (B reads it from its wake list, as its BLPOP would), B releases. Server µs of
    the cycle's four scripts, median over cycles, variants interleaved cycle by cycle."""
    extra = ["--slowlog-log-slower-than", "0", "--slowlog-max-len", "100000"]
    with RedisServer(extra=extra) as server:
        c = redis.Redis(port=server.port, decode_responses=True)
        ops: list[Callable[[], None]] = []
        tags: dict[str, str] = {}
        for name, (acquire_src, release_src) in variants.items():
            acquire = c.register_script(f"{acquire_src}\n-- {name}")
            release = c.register_script(f"{release_src}\n-- {name}")
            tags[acquire.sha] = tags[release.sha] = name
            for script in (acquire, release):  # (else the first EVALSHA fails, NOSCRIPT)
                c.script_load(script.script)
            base = f"bench:{{{name}}}"
            keys = [
                f"{base}:{k}" for k in ("token", "holder", "queue", "hb", "seq", "ttls", "owners")
            ]

            def op(a=acquire, r=release, k=keys, wake=f"{base}:wake:") -> None:
                got = a(keys=k, args=["A", 10_000, "wait", 3_000, wake, "a"])
                token = got if isinstance(got, int) else got[1]
                queued = a(keys=k, args=["B", 10_000, "wait", 3_000, wake, "b"])
                assert not isinstance(queued, int) and queued[0] == 0, queued
                value = f"{token} 10000 A\na"
                assert r(keys=k, args=["A", 0, "release", 3_000, wake, token, value]) == 1
                handed = c.lpop(f"{wake}B")
                assert handed is not None, "no hand-off"
                token_b = handed.partition(":")[0]
                value = f"{token_b} 10000 B\nb"
                assert r(keys=k, args=["B", 0, "release", 3_000, wake, token_b, value]) == 1

            ops.append(op)
        cycles: dict[str, list[int]] = collections.defaultdict(list)
        for _ in range(rounds):
            c.slowlog_reset()
            for _ in range(n):
                for op in ops:
                    op()
            ops = ops[1:] + ops[:1]
            # Oldest first; a cycle's four scripts run one after the other.
            run_of: list[tuple[str, int]] = []
            for entry in reversed(c.slowlog_get(100_000)):
                command = entry["command"].decode().split()
                if command[0].upper() == "EVALSHA" and command[1] in tags:
                    run_of.append((tags[command[1]], entry["duration"]))
            for i in range(0, len(run_of) - 3, 4):
                names = {who for who, _ in run_of[i : i + 4]}
                assert len(names) == 1, names
                cycles[names.pop()].append(sum(d for _, d in run_of[i : i + 4]))
        c.close()
    for name, sums in cycles.items():
        print(f"  {name:32s} hand-off cycle (4 scripts) {statistics.median(sums):6.1f} µs (median)")


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
        "- release's queue check": (
            a,
            without(
                r,
                "if redis.call('EXISTS', KEYS[3]) == 0 then return 1 end",
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
    variants["floor: two minimal scripts"] = (
        FLOOR_ACQUIRE,
        NATIVE_RELEASE.replace("KEYS[1]", "KEYS[2]"),
    )
    if "--handoff" in args:
        fenced_only = {k: v for k, v in variants.items() if k.startswith("fenced")}
        for i in range(runs):
            print(f"run {i + 1}, appendfsync always (server µs per contended cycle, SLOWLOG)")
            run_handoff(fenced_only)
        return
    configs: dict[str, tuple[str, ...]] = {"appendfsync always": ()}
    if "--fsync" in args:
        configs["appendfsync everysec"] = ("--appendfsync", "everysec")
        configs["appendonly no"] = ("--appendonly", "no")
    for what, config in configs.items():
        for i in range(runs):
            print(f"run {i + 1}, {what} (server µs per uncontended acquire+release, SLOWLOG)")
            run(variants, config=config)


if __name__ == "__main__":
    main()
