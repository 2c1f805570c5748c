"""``fenced demo``: DDIA Figure 8-5 with real processes, fenced and unfenced."""

from __future__ import annotations

import argparse

from ._common import Subparsers, _ttl, _verbose

NAME = "demo"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    demo = sub.add_parser(
        "demo",
        parents=[_verbose()],
        help="reproduce DDIA Figure 8-5: a paused lock holder's write, fenced and unfenced",
    )
    demo.add_argument("--dir", help="keep the demo's databases in this directory")
    demo.add_argument("--ttl", type=_ttl, default=1.0, help="lease ttl in seconds (1)")
    demo.add_argument(
        "--replicated",
        action="store_true",
        help="three replicas, a crash and reconfiguration: epoch fencing (fenced.replicated)",
    )
    return demo


def run(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    if args.replicated:
        from ._demo_replicated import run_replicated_demo

        return run_replicated_demo(directory=args.dir, ttl=args.ttl)
    return run_demo(directory=args.dir, ttl=args.ttl)
