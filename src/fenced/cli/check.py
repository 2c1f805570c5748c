"""``fenced check``: a stale-writer campaign against a source and a resource (docs/testing.md)."""

from __future__ import annotations

import argparse
import functools
import signal
from collections.abc import Callable

from .._core.backend import redacted
from .._core.errors import ConfigurationError
from .._core.paths import environment_url, read_url_file
from .._core.token import validate_lock_name
from ._common import (
    EXIT_INCONCLUSIVE,
    EXIT_VIOLATION,
    Subparsers,
    _grace,
    _progress_bar,
    _ttl,
    _verbose,
)

NAME = "check"


class _PlantsHelp(argparse.HelpFormatter):
    """Lists the check kit's plants in --plant's help, importing the kit only when the help
    is shown: at parse time every command paid for it (a tenth of a second)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.dest == "plant":
            from ..testing.check import PLANTS

            return f"{action.help}{', '.join(PLANTS)}"
        return action.help


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    check_kit = sub.add_parser(
        "check",
        parents=[_verbose()],
        help="run a stale-writer campaign against a token source and a resource, check it",
        description=(
            "Worker processes take one lock from --source and read-modify-write a register in "
            "--resource under its token (default: an embedded SQLite table behind fenced's SQL "
            "guard), while a seeded nemesis pauses them past their ttl, stalls them between "
            "read and write, kills them, cuts them off or delays their traffic, restarts the "
            "source or steps their clocks. Every step goes to REPORT/history.jsonl, every "
            "checker runs over it, REPORT/report.html draws it. With --resource-cmd the kit "
            "runs the resource's process itself and restarts and pauses it too. Exit 0 if "
            f"every invariant held, {EXIT_VIOLATION} if one did not, {EXIT_INCONCLUSIVE} if "
            "the run was inconclusive (a fault asked for was never dealt: give it more --time) "
            "(docs/testing.md)."
        ),
        formatter_class=_PlantsHelp,
    )
    where = check_kit.add_mutually_exclusive_group()
    where.add_argument(
        "--source",
        help="token source URL, or redis|etcd|postgresql|zookeeper to start one (default: "
        "$FENCED_URL, else the URL in the file $FENCED_URL_FILE, else a private SQLite source "
        "of the campaign's own); other local users can read a command line: give a URL with "
        "a password with --source-file or an environment variable",
    )
    where.add_argument(
        "--source-file",
        "--url-file",
        metavar="FILE",
        help="read the token source URL from FILE (one line; # comments): keeps a password "
        "out of the process list; refused if the URL has a password and FILE is not mode 600",
    )
    check_kit.add_argument(
        "--resource",
        default="",
        help="sqlite:////ABS/PATH, postgresql://..., redis://..., etcd://..., file:///DIR, "
        "http(s)://... or python:MODULE:CLASS (default: an embedded SQLite register)",
    )
    check_kit.add_argument(
        "--resource-cmd",
        default="",
        metavar="COMMAND",
        help="the command that serves --resource (e.g. 'python inventory.py --port 8000'): "
        "the kit starts it, kills -9 and restarts it on the same data, pauses it",
    )
    check_kit.add_argument("--lock", default="counter", help="the lock the workers take")
    check_kit.add_argument(
        "--time",
        type=_grace,
        default=None,
        help=f"seconds of faults (default {DEFAULT_TIME:.0f} x the ttl, at least "
        f"{DEFAULT_TIME:.0f}: enough for every fault kind to be dealt; a run that dealt one "
        f"none exits {EXIT_INCONCLUSIVE}, inconclusive); with --faults or --writes, the run's "
        "bound: a run it ends before their counts fails ('counts not reached')",
    )
    check_kit.add_argument(
        "--faults",
        type=_count,
        default=0,
        metavar="N",
        help="end the run once each nemesis has struck N times (and --writes are done)",
    )
    check_kit.add_argument(
        "--writes",
        type=_count,
        default=0,
        metavar="N",
        help="end the run once the workers made N writes (and --faults have struck)",
    )
    check_kit.add_argument("--workers", type=int, default=3, help="worker processes (3)")
    check_kit.add_argument("--ttl", type=_ttl, default=1.0, help="the workers' lease ttl (1)")
    check_kit.add_argument(
        "--nemesis",
        default=None,
        help="faults, comma-separated: pause, stall (a pause between read and write), kill, "
        "partition, delay, restart (a source the kit started), clock (wall-clock steps), "
        "forge (forged tokens; needs --signing), race (a takeover timed inside a TCP "
        "resource), resource-restart, resource-pause (with --resource-cmd), "
        "resource-partition, resource-delay, impostor (writes with another lock's token, a "
        "malformed one, none) (default: pause,stall,kill,impostor; forge with --signing; race "
        "with a TCP resource; resource-restart,resource-pause with --resource-cmd; with "
        "--plant, the faults that show the plant)",
    )
    check_kit.add_argument(
        "--signing",
        action="store_true",
        help="sign every token (a key made for the run); the resource's guard verifies them",
    )
    check_kit.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (0)")
    check_kit.add_argument("--report", default="fenced-check", help="directory for the history")
    check_kit.add_argument(
        "--plant",
        default="",
        metavar="FAULT",
        help="plant a fault to see it caught (the run stops at the first violation; a plant "
        "no checker caught fails as 'plant not exercised'): ",  # (the plants' names: _PlantsHelp)
    )
    return check_kit


DEFAULT_TIME = 30.0
"""``--time``'s default, times the ttl when it is longer than 1 s (each fault waits for ttls):
every default fault kind dealt at least once — a slow user's resource with its process
(seven kinds, some waiting seconds each for a takeover or a restart) took up to ~25 s."""


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 1_000_000:
        raise argparse.ArgumentTypeError(f"a count 0-1000000, not {text!r}")
    return n


def _source(args: argparse.Namespace) -> tuple[str | None, str]:
    """The source: --source, --source-file, $FENCED_URL, $FENCED_URL_FILE (as the other
    commands take theirs), else None (a private SQLite source); and where it came from when
    the command line does not show it ("" otherwise)."""
    if args.source:
        return str(args.source), ""
    if args.source_file:
        return read_url_file(args.source_file, "--source-file"), f"--source-file {args.source_file}"
    found = environment_url()
    return found if found is not None else (None, "")


def _shifted(tick: Callable[[float, str], None], offset: float, elapsed: float, what: str) -> None:
    tick(offset + elapsed, what)  # (a later round's progress: after the rounds before it)


def run(args: argparse.Namespace) -> int:
    from ..testing.check import NEMESES, plant_role, run_campaign, start_fork_server

    nemesis = None if args.nemesis is None else [n for n in args.nemesis.split(",") if n]
    if nemesis is not None and set(nemesis) - set(NEMESES):
        raise ConfigurationError(f"--nemesis: choose from {', '.join(NEMESES)}")
    if not 1 <= args.workers <= 64:
        raise ConfigurationError("--workers must be 1-64")
    validate_lock_name(args.lock)
    source, origin = _source(args)
    plant_role(args.plant)  # an unknown plant: a usage error before anything starts
    # The workers' fork server, forked from this process before it has a thread (see there).
    start_fork_server()

    def terminated(*_: object) -> None:
        raise KeyboardInterrupt  # (so the campaign stops its workers and the resource it ran)

    signal.signal(signal.SIGTERM, terminated)
    if args.time is None:
        args.time = DEFAULT_TIME * max(1.0, args.ttl)

    signal.signal(signal.SIGHUP, terminated)  # (a closed terminal: clean up as for SIGTERM)
    progress = _progress_bar(args.time)
    # With a plant the run is a demonstration that the kit catches it: it stops at the first
    # violation, and a fault schedule that missed the plant's window gets another seed while
    # --time lasts (halves of it, as the kit's own tests do); never caught: a violation too
    # ("plant not exercised"), never "every invariant held".
    plant = args.plant
    budget = args.time
    share = budget / 2 if plant and budget >= 8 else budget
    seed, spent, seeds = args.seed, 0.0, [args.seed]
    with progress as tick:
        while True:
            result = run_campaign(
                source,
                args.report,
                resource=args.resource,
                lock=args.lock,
                workers=args.workers,
                seconds=min(share, budget - spent),
                ttl=args.ttl,
                nemesis=nemesis,
                seed=seed,
                plant=plant,
                signing=args.signing,
                progress=functools.partial(_shifted, tick, spent),
                resource_cmd=args.resource_cmd,
                stop_at_first=bool(plant),
                faults=args.faults,
                writes=args.writes,
            )
            spent += result.seconds
            caught = {v.checker for v in result.violations} - {"plant not exercised"}
            if not plant or caught or budget - spent < 1.0:
                break
            seed += 1
            seeds.append(seed)
    from ._console import make_printer

    out = make_printer()
    faults = ", ".join(f"{n} {k}" for k, n in result.faults.items()) or "none"
    out.print(
        f"{result.grants} grants, {result.accepted} writes accepted, {result.refused} refused "
        f"(stale), {result.unknown} unanswered, {result.refused_reads} reads refused"
        + (
            f", {result.turned_away} forged or impostor requests refused"
            if result.turned_away
            else ""
        )
        + "; "
        f"{result.ops_per_second:.0f} writes/s; "
        f"faults: {faults}"
    )
    # What reproduces the run: its seed (each half's, with --plant); every option is in the
    # history's first event and the report.
    said = (
        f"seed {seed}"
        if len(seeds) == 1
        else f"seeds {', '.join(map(str, seeds))} (a half each; the verdict is seed {seed}'s)"
    )
    out.print(f"{said}: the same --seed and options deal the same schedule of faults")
    if result.inconclusive:
        for violation in result.violations:
            out.print(f"[bold yellow]INCONCLUSIVE[/bold yellow] {violation.message}")
        out.print(f"report: {result.report}  history: {result.history}")
        return EXIT_INCONCLUSIVE
    for violation in result.violations[:20]:
        out.print(f"[bold red]VIOLATION[/bold red] {violation}")
    if len(result.violations) > 20:
        out.print(f"... and {len(result.violations) - 20} more (see the report)")
    if result.ok:
        out.print("[bold green]every invariant held[/bold green]")
    else:
        first = result.first_violation_after
        when = f", the first {first:.1f} s in" if first is not None else ""
        out.print(f"[bold red]{len(result.violations)} violation(s){when}[/bold red]")
    if origin:  # (a source the command line does not show: say which, without its password)
        out.print(f"source: {redacted(str(source))} (from {origin})")
    out.print(f"report: {result.report}  history: {result.history}")
    return 0 if result.ok else EXIT_VIOLATION
