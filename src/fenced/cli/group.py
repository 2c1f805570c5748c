"""``fenced group status|remove|add GROUP``: a replicated group's configuration and members."""

from __future__ import annotations

import argparse

from ._common import Subparsers, _examples, _HelpFormatter, _source_arguments, _url, _verbose

NAME = "group"


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    group = sub.add_parser(
        "group",
        parents=[_verbose()],
        help="a replicated group's configuration and members (fenced.replicated)",
        epilog=_examples(
            "fenced group status orders",
            "fenced group status orders --member a=sqlite:////var/lib/app/a.db --json",
        ),
        formatter_class=_HelpFormatter,
    )
    group.add_argument("action", choices=("status", "remove", "add"))
    group.add_argument("name", metavar="GROUP", help="the group (its lock's name)")
    group.add_argument("names", nargs="*", metavar="MEMBER", help="members to remove or add")
    group.add_argument(
        "--member",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="how to reach a member: redis://h:p/db, postgresql://..., mysql://user@h:p/db, "
        "sqlite:////abs/path.db, etcd://h:p, or NAME=@FILE: the URL read from FILE (mode 600 "
        "if it has a password), off the command line (repeat; status shows these members' "
        "marks)",
    )
    group.add_argument("--resource", help="the members' guarded resource (default: GROUP)")
    _source_arguments(group)
    group.add_argument("--json", action="store_true", help="print JSON (status)")
    return group


def run(args: argparse.Namespace) -> int:
    from ._group import run_group

    return run_group(args, _url(args))
