"""``fenced group``: an operator's view and changes of a replicated group (``fenced.replicated``).

The configuration (epoch, members) lives in the token source, so ``status`` needs only the
source; each member's marks and data are shown for the members given with ``--member
NAME=URL`` (every guard URL of :mod:`fenced.guards.registry` that can hold a member:
``redis://host:port/db``, ``postgresql://...``, ``mysql://user@host:port/db``,
``sqlite:////abs/path.db``, ``etcd://host:port``). ``remove`` and ``add`` change the configuration as the library does:
they need every member that stays (to fence it) and every member added (to copy the data to).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from .._core import sync as _sync
from .._core.backend import redacted
from .._core.errors import ConfigurationError
from .._core.paths import read_url_file
from .._core.token import validate_lock_name

__all__ = ["member_from_url", "run_group"]


def member_from_url(url: str, resource: str, timeout: float = 5.0) -> tuple[Any, Any]:
    """A group member (a guard) for ``url``, and what closes it (or None): a guard URL of
    :mod:`fenced.guards.registry` whose kind declares ``group-member`` (``redis://``,
    ``postgresql://``, ``mysql://``, ``sqlite:////PATH``, ``etcd://``)."""
    from ..guards.registry import GuardCharacteristic, guard_schemes, open_guard, parse_guard_url

    parsed = parse_guard_url(url)
    if GuardCharacteristic.GROUP_MEMBER not in parsed.kind.characteristics:
        members = guard_schemes(GuardCharacteristic.GROUP_MEMBER)
        raise ConfigurationError(
            f"a {parsed.scheme}:// guard cannot be a group member: "
            f"{', '.join(s + '://' for s in members)}"
        )
    opened = open_guard(parsed, resource, timeout=timeout)
    close = None if opened.connect is not None else opened.close
    return opened.fence_target(), close


@contextlib.contextmanager
def _group(args: Any, locks: _sync.Locks) -> Iterator[Any]:
    from ..replicated import Group

    members: dict[str, Any] = {}
    closers = []
    try:
        for spec in args.member:
            name, sep, url = spec.partition("=")
            if not sep or not name or not url:
                raise ConfigurationError(
                    f"--member takes NAME=URL or NAME=@FILE, not {redacted(spec)!r}"
                )
            if url.startswith("@"):  # the URL in a file: its password off the command line
                url = read_url_file(url[1:], f"--member {name}")
            guard, close = member_from_url(url, args.resource or args.name, args.timeout)
            members[name] = guard
            if close is not None:
                closers.append(close)
        # (A group object needs a member; with none given, status shows the configuration.)
        group = Group(args.name, locks, members or {"-": _Absent()}, timeout=args.timeout)
        try:
            yield group
        finally:
            group.close()
    finally:
        for close in closers:
            with contextlib.suppress(Exception):
                close()


class _Absent:
    async def apply(self, *a: Any, **k: Any) -> None:
        raise ConfigurationError("no member given")

    async def read(self, keys: Any = None) -> Any:
        raise ConfigurationError("no member given")

    async def aclose(self) -> None:
        pass


def run_group(args: Any, url: str) -> int:
    from ._common import _from_source

    validate_lock_name(args.name)
    with _from_source(args):  # (not the members': their URLs are on the command line)
        locks = _sync.connect(url, connect_timeout=max(args.timeout, 0.1))
    with (
        locks,
        _group(args, locks) as group,
    ):
        if args.action == "status":
            record = locks.read_record(group.aio.record)
            if record is None:
                print(f"group {args.name!r}: no configuration yet (made on first use)")
                return 0
            cfg, members = group.status()
            shown = [m for m in members if m.name != "-"]
            if args.json:
                out = {
                    "group": args.name,
                    "epoch": cfg.epoch,
                    "members": list(cfg.members),
                    "base": cfg.base,
                    "member_status": [_row(m) for m in shown],
                }
                print(json.dumps(out, indent=2))
                return 0
            print(f"group {args.name}: configuration {cfg.epoch} (from {cfg.base}): "
                  f"{', '.join(cfg.members)}")  # fmt: skip
            for m in shown:
                where = "member" if m.in_configuration else "not a member"
                if m.reachable:
                    lost = ""
                    if m.behind:
                        lost = f"  BEHIND: lost its state (`fenced group add {m.name}` copies it)"
                    print(f"  {m.name:<10} {where:<12} token {m.token}  epoch {m.epoch}  "
                          f"{m.keys} keys{lost}")  # fmt: skip
                else:
                    error = m.error
                    if error == "not given to this process":
                        error = "not shown (give --member NAME=URL)"
                    else:
                        error = f"unreachable: {error}"
                    print(f"  {m.name:<10} {where:<12} {error}")
            return 0
        if args.action == "remove":
            cfg = group.remove(*args.names)
        else:
            cfg = group.reconfigure(add=list(args.names))
        print(f"group {args.name}: configuration {cfg.epoch}: {', '.join(cfg.members)}")
        return 0


def _row(m: Any) -> dict[str, Any]:
    return {
        "name": m.name,
        "in_configuration": m.in_configuration,
        "reachable": m.reachable,
        "token": m.token,
        "epoch": m.epoch,
        "keys": m.keys,
        "error": m.error,
        "behind": m.behind,
    }
