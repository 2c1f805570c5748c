"""``fenced sim``: fencing simulated over many seeds, in virtual time."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from .._core.errors import ConfigurationError
from ._common import EXIT_VIOLATION, Subparsers, _progress_bar

NAME = "sim"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    sim = sub.add_parser(
        "sim",
        help="simulate fencing deterministically over many seeds (virtual time)",
        description=(
            "fenced's real lease core and SQL guard (--system lease), its real replicated "
            "group on members behind real SQL guards (--system group), or fenced serve's real "
            "grant bookkeeping in several gateways (--system gateway), with a simulated token "
            "source and network on a virtual-time event loop: pauses, stalls, crashes, source, "
            "resource, member and gateway restarts, members wiped (back empty), lost, "
            "duplicated, delayed and reordered messages, clock skew and jumps, another "
            "tenant's request ids. Each seed is one run, the same seed "
            "the same run byte for byte; checkers judge it. A failing seed is shrunk and "
            f"printed with the command that replays it. Exit 0 if every seed passed, {EXIT_VIOLATION} if one "
            "failed."
        ),
    )
    sim.add_argument("--seeds", type=int, default=10_000, help="how many seeds (10000)")
    sim.add_argument("--start", type=int, default=0, help="the first seed (0)")
    sim.add_argument("--jobs", type=int, default=0, help="processes (default: one per CPU)")
    sim.add_argument("--clients", type=int, default=3, help="simulated clients (3)")
    sim.add_argument("--rounds", type=int, default=4, help="rounds per client (4)")
    sim.add_argument("--faults", default="", help="comma-separated subset of the faults (all)")
    sim.add_argument("--plant", default="", metavar="FAULT", help="plant a fault, to see it caught")
    sim.add_argument("--replay", type=int, metavar="SEED", help="run one seed and print its trace")
    sim.add_argument(
        "--system",
        "--workload",
        choices=("lease", "group", "gateway"),
        help="what to simulate: lease (default), group (fenced.replicated) or gateway (fenced "
        "serve's grant bookkeeping, several gateways on one source); a plant implies its own",
    )
    return sim


def run(args: argparse.Namespace) -> int:
    from ..testing.sim import FAULTS, SIM_PLANTS, Config, plant_system, run_seeds, shrink, simulate

    faults = tuple(f for f in args.faults.split(",") if f) or FAULTS
    if set(faults) - set(FAULTS):
        raise ConfigurationError(f"--faults: choose from {', '.join(FAULTS)}")
    if args.plant and args.plant not in SIM_PLANTS:
        raise ConfigurationError(f"--plant: choose from {', '.join(SIM_PLANTS)}")
    if not 1 <= args.clients <= 16 or not 1 <= args.rounds <= 1000 or args.seeds < 1:
        raise ConfigurationError("--clients must be 1-16, --rounds 1-1000, --seeds at least 1")
    system = args.system or plant_system(args.plant)
    if args.plant and plant_system(args.plant) != system:
        raise ConfigurationError(
            f"--plant {args.plant} is a {plant_system(args.plant)} plant, not a {system} one"
        )
    template = Config(0, args.clients, args.rounds, plant=args.plant, faults=faults, system=system)
    if args.replay is not None:
        outcome = simulate(dataclasses.replace(template, seed=args.replay))
        sys.stdout.write(outcome.trace_text())
        for violation in outcome.violations:
            print(f"VIOLATION {violation}")
        print("every invariant held" if outcome.ok else f"{len(outcome.violations)} violation(s)")
        return 0 if outcome.ok else EXIT_VIOLATION
    with _progress_bar(args.seeds) as tick:
        result = run_seeds(
            template,
            args.start,
            args.seeds,
            jobs=args.jobs,
            stop_at_first=True,
            progress=lambda done, bad: tick(done, f"{done} seeds, {bad} failed"),
        )
    print(f"{result.seeds} seeds in {result.seconds:.1f} s ({result.per_second:.0f} seeds/s)")
    if not result.failed:
        print("every invariant held")
        return 0
    first = dataclasses.replace(template, seed=result.failed[0])
    small = shrink(first)
    short = small.short_trace()
    print(
        f"seed {first.seed} failed; shrunk to {small.config.clients} clients x "
        f"{small.config.rounds} rounds; the {len(short)} events behind the first violation:"
    )
    sys.stdout.write(small.trace_text(short))
    for violation in small.violations:
        print(f"VIOLATION {violation}")
    print(f"replay: {small.config.replay()}")
    return EXIT_VIOLATION
