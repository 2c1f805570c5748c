"""The check kit's numbers (issue 13): operations per second of a campaign, time to first
detection of each planted fault by real processes and by the simulator, and the simulator's
seeds per second.

    python bench/bench_check.py [--time 8] [--quick]

Real-process campaigns: 3 workers, ttl 0.5 s, on the embedded SQLite source (source plants:
the source the kit starts), seed 1, the faults that open each plant's window. Simulated: the
first failing seed from 0 (3 clients x 4 rounds, every fault; a group or gateway plant in
its own system), its virtual time to the first
bad event, and the wall time to find it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from fenced.testing.check import PLANTS, run_campaign
from fenced.testing.check._plants import plant_role
from fenced.testing.sim import SIM_PLANTS, Config, plant_system, run_seeds, simulate

NEMESIS = {
    "lease-overestimated": ["pause", "kill"],
    "unfenced-release": ["stall", "pause"],
    "token-in-memory": ["restart", "stall"],
    "counter-not-fsynced": ["restart", "stall"],
}


def _campaign(plant: str, seconds: float, nemesis: list[str]) -> tuple[float | None, float, int]:
    with tempfile.TemporaryDirectory() as d:
        source = None if plant_role(plant) == "source" else f"sqlite:///{d}/locks.db"
        r = run_campaign(
            source, Path(d) / "r", seconds=seconds, ttl=0.5, nemesis=nemesis, seed=1, plant=plant
        )
        return r.first_violation_after, r.ops_per_second, len(r.violations)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time", type=float, default=8.0)
    ap.add_argument("--quick", action="store_true", help="no real-process plants")
    args = ap.parse_args()

    first, ops, _ = _campaign("", 20.0, ["pause", "stall", "kill"])
    print(f"clean campaign, 20 s, pause+stall+kill: {ops:.1f} writes/s, violations: {first}")

    for system, seeds in (("lease", 2000), ("group", 400), ("gateway", 400)):
        for jobs in (1, 2):
            r = run_seeds(Config(seed=0, system=system), 0, seeds, jobs=jobs)
            print(
                f"simulator, {system}: {r.per_second:.0f} seeds/s on {jobs} process(es) "
                f"({seeds} seeds, {len(r.failed)} failed)"
            )
    # The replicated bug planted back: seeds to find it from 20 starting seeds.
    found = []
    for start in range(0, 20_000, 1000):
        cfg = Config(seed=0, system="group", plant="empty-member-counted")
        r = run_seeds(cfg, start, 1000, jobs=1, stop_at_first=True)
        found.append(r.failed[0] - start + 1 if r.failed else None)
    hit = [n for n in found if n is not None]
    print(
        f"empty-member-counted, seeds to find it from 20 starts: min {min(hit)}, median "
        f"{statistics.median(hit)}, max {max(hit)}, missed {found.count(None)}: {found}"
    )

    # The gateway's plants: seeds to the first failure from 10 starting seeds.
    for plant in ("gw-release-any-key", "gw-retry-new-grant", "gw-expiry-recounted"):
        counts = []
        for start in range(0, 10_000, 1000):
            cfg = Config(seed=0, system="gateway", plant=plant)
            r = run_seeds(cfg, start, 1000, jobs=1, stop_at_first=True)
            counts.append(r.failed[0] - start + 1 if r.failed else None)
        got = [n for n in counts if n is not None]
        print(
            f"{plant}, seeds to find it from 10 starts: median {statistics.median(got)}, max "
            f"{max(got)}, missed {counts.count(None)}: {counts}"
        )

    print(
        f"\n{'plant':22} {'real: first violation':>22} {'sim: seeds':>11} {'sim: virtual s':>15} {'sim: wall ms':>13}"
    )
    for plant in [*PLANTS, *(p for p in SIM_PLANTS if p not in PLANTS)]:
        real = "-"
        if plant in PLANTS and not args.quick:
            at, _, n = _campaign(plant, args.time, NEMESIS.get(plant, ["stall"]))
            real = f"{at:.2f} s" if at is not None else ("caught" if n else "MISSED")
        sim_cols = ("-", "-", "-")
        if plant in SIM_PLANTS:
            t = time.perf_counter()
            o = None
            for seed in range(400):
                o = simulate(Config(seed=seed, plant=plant, system=plant_system(plant)))
                if not o.ok:
                    break
            wall = (time.perf_counter() - t) * 1000
            if o is not None and not o.ok:
                bad = [e["mono"] for v in o.violations[:1] for e in v.events if isinstance(e, dict)]
                at_v = f"{min(bad):.2f}" if bad else "?"
                sim_cols = (str(seed + 1), at_v, f"{wall:.0f}")
            else:
                sim_cols = ("MISSED", "-", f"{wall:.0f}")
        print(f"{plant:22} {real:>22} {sim_cols[0]:>11} {sim_cols[1]:>15} {sim_cols[2]:>13}")


if __name__ == "__main__":
    main()
