"""The simulator's determinism, pinned across a change: for seeds ``START`` .. ``START+N-1`` of
each system, a digest of each seed's verdict (its violations) and its trace (``trace_text``),
and the CPU seconds each system took. ``--save FILE`` writes them; ``--compare FILE`` runs
again and names every seed whose verdict or trace differs (exit 1). Used by issue 28 §4
(docs/benchmarks.md): an optimisation of the simulator must not change a single run.

    python bench/sim_digests.py --seeds 500 --save /tmp/before.json
    python bench/sim_digests.py --seeds 500 --compare /tmp/before.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from fenced.testing.sim import Config, simulate

try:  # (as run_seeds runs them, since issue 28 §4; absent before)
    from fenced.testing.sim._run import frozen_heap
except ImportError:
    import contextlib

    frozen_heap = contextlib.nullcontext  # type: ignore[assignment]

SYSTEMS = ("lease", "group", "gateway")


def digests(system: str, start: int, count: int) -> tuple[dict[str, str], float]:
    out: dict[str, str] = {}
    began = time.process_time()
    for seed in range(start, start + count):
        outcome = simulate(Config(seed=seed, system=system))
        h = hashlib.sha256()
        h.update(json.dumps([str(v) for v in outcome.violations]).encode())
        h.update(outcome.trace_text().encode())
        h.update(repr(outcome.virtual_seconds).encode())
        out[str(seed)] = ("ok " if outcome.ok else "FAIL ") + h.hexdigest()[:24]
    return out, time.process_time() - began


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=500)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--save")
    p.add_argument("--compare")
    a = p.parse_args()
    result: dict[str, dict[str, str]] = {}
    for system in a.systems.split(","):
        with frozen_heap():
            result[system], cpu = digests(system, a.start, a.seeds)
        print(f"{system}: {a.seeds} seeds, {cpu:.2f} CPU s, {1000 * cpu / a.seeds:.2f} ms a seed")
    if a.save:
        with open(a.save, "w") as f:
            json.dump(result, f, indent=0, sort_keys=True)
    if a.compare:
        with open(a.compare) as f:
            before = json.load(f)
        differ = [
            (s, seed)
            for s, seeds in result.items()
            for seed, d in seeds.items()
            if before.get(s, {}).get(seed) != d
        ]
        same = sum(len(v) for v in result.values()) - len(differ)
        print(f"identical: {same}; differing: {len(differ)} {differ[:20]}")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
