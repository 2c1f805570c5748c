"""Checkers of a replicated group's history (``fenced.replicated``): one per invariant.

The history is a list of events (dicts), from every process of a run:

* ``invoke`` / ``complete`` (joined by ``id``): a ``write`` (key, value, stamp, token) or a
  ``read`` (key; the value read on completion); ``ok`` is True, False (refused before
  anything was written anywhere) or ``"unknown"`` (may be on some members). An invoke without
  a completion (its process was killed) is unknown.
* ``apply``: one member's answer to one change (member, token, epoch, stamps, start, end, ok).
* ``config``: a configuration a process read or installed (epoch, members, base, id).
* ``final``: a member's whole state at the end of the run, and the final configuration.

The events are the kit's one schema (``_history``); times are on one clock for every process
of the machine.
"""

from __future__ import annotations

import collections

from ._checkers import Checker, Violation, check_all
from ._history import Event
from ._linearizable import RegisterOp, check_register

__all__ = [
    "GROUP_CHECKERS",
    "acknowledged_writes_on_every_later_member",
    "check_group",
    "configurations_totally_ordered_and_overlapping",
    "members_never_accept_lower_after_higher",
    "no_lost_update_under_the_lock",
    "operations",
    "reads_are_linearizable",
    "something_was_checked",
]


def operations(history: list[Event]) -> list[Event]:
    """Invocations joined with their completions: ``end`` None and ``ok`` "unknown" for an
    operation whose process never said how it ended."""
    done = {e["id"]: e for e in history if e["op"] == "complete"}
    out = []
    for e in history:
        if e["op"] != "invoke":
            continue
        c = done.get(e["id"])
        op = dict(e)
        if c is None:
            op.update(end=None, ok="unknown")
        else:
            op.update(end=c["end"], ok=c["ok"])
            if "value" in c and e["kind"] == "read":
                op["value"] = c["value"]
        out.append(op)
    return out


def members_never_accept_lower_after_higher(history: list[Event]) -> list[Violation]:
    """No member accepts a change with a lower lock token or a lower configuration epoch
    after it accepted (and answered) a higher one."""
    by_member: dict[str, list[Event]] = collections.defaultdict(list)
    for e in history:
        if e["op"] == "apply" and e["ok"] is True and e["token"] is not None:
            by_member[e["member"]].append(e)
    out = []
    for member, applies in by_member.items():
        applies.sort(key=lambda e: e["start"])
        high_token: Event | None = None
        high_epoch: Event | None = None
        ended = sorted(applies, key=lambda e: e["end"])
        j = 0
        for a in applies:
            # Everything answered before this one was sent came before it.
            while j < len(ended) and ended[j]["end"] < a["start"]:
                b = ended[j]
                if high_token is None or b["token"] > high_token["token"]:
                    high_token = b
                if high_epoch is None or b["epoch"] > high_epoch["epoch"]:
                    high_epoch = b
                j += 1
            if high_token is not None and a["token"] < high_token["token"]:
                out.append(
                    Violation(
                        "member order",
                        f"{member} accepted token {a['token']} after {high_token['token']}",
                        (high_token, a),
                    )
                )
            if high_epoch is not None and a["epoch"] < high_epoch["epoch"]:
                out.append(
                    Violation(
                        "member order",
                        f"{member} accepted epoch {a['epoch']} after {high_epoch['epoch']}",
                        (high_epoch, a),
                    )
                )
    return out


def acknowledged_writes_on_every_later_member(history: list[Event]) -> list[Violation]:
    """Every acknowledged write is on every member of the final configuration (with its own
    stamp or a newer one)."""
    finals = {e["member"]: e for e in history if e["op"] == "final"}
    configs = [e for e in history if e["op"] == "final_config"]
    if not configs:
        return [Violation("acknowledged writes", "no final configuration in the history")]
    members = configs[-1]["members"]
    out = []
    for op in operations(history):
        if op["kind"] != "write" or op["ok"] is not True:
            continue
        for m in members:
            state = finals.get(m)
            if state is None:
                out.append(Violation("acknowledged writes", f"no final state of member {m}"))
                continue
            held = state["items"].get(op["key"])
            if held is None or held[0] < op["stamp"]:
                out.append(
                    Violation(
                        "acknowledged writes",
                        f"write {op['value']!r} to {op['key']!r} (stamp {op['stamp']}) was "
                        f"acknowledged but member {m} of configuration "
                        f"{configs[-1]['epoch']} does not have it",
                        (op,),
                    )
                )
    return out


def reads_are_linearizable(history: list[Event]) -> list[Violation]:
    """Per key, the reads and writes form a linearizable register (``_linearizable``)."""
    by_key: dict[str, list[RegisterOp]] = collections.defaultdict(list)
    for op in operations(history):
        if op["ok"] is False:
            continue  # refused before any member took it: it never happened
        if op["kind"] == "read":
            if op["ok"] is not True:
                continue  # a read that did not answer constrains nothing
            by_key[op["key"]].append(
                RegisterOp("read", op["value"], op["start"], op["end"], op["id"])
            )
        else:
            end = op["end"] if op["ok"] is True else None
            by_key[op["key"]].append(RegisterOp("write", op["value"], op["start"], end, op["id"]))
    out = []
    for key, ops in by_key.items():
        why = check_register(ops)
        if why is not None:
            out.append(Violation("linearizable", f"key {key!r}: {why}"))
    return out


def configurations_totally_ordered_and_overlapping(history: list[Event]) -> list[Violation]:
    """One configuration per epoch, each built from the one before (``base`` = epoch - 1),
    and consecutive ones share a member."""
    by_epoch: dict[int, dict[str, Event]] = collections.defaultdict(dict)
    for e in history:
        if e["op"] == "config":
            by_epoch[e["epoch"]][e["id"]] = e
    out = []
    for epoch, seen in sorted(by_epoch.items()):
        if len(seen) > 1:
            out.append(
                Violation(
                    "configurations",
                    f"epoch {epoch} has {len(seen)} different configurations: "
                    + "; ".join(str(c["members"]) for c in seen.values()),
                )
            )
        for c in seen.values():
            if c["base"] != epoch - 1:
                why = f"configuration {epoch} was built from {c['base']}, not {epoch - 1}"
                what = f"{why}: a change skipped the compare-and-set"
                out.append(Violation("configurations", what, (c,)))
            for b in by_epoch.get(epoch - 1, {}).values():
                if not set(b["members"]) & set(c["members"]):
                    why = f"configurations {epoch - 1} {b['members']} and {epoch} {c['members']}"
                    out.append(Violation("configurations", f"{why} share no member", (b, c)))
    return out


def no_lost_update_under_the_lock(history: list[Event]) -> list[Violation]:
    """Writers increment a counter (read, then write ``n+1:...``) under the lock: two
    acknowledged writes of one count mean a stale holder's write slipped in."""
    counts: dict[tuple[str, str], list[Event]] = collections.defaultdict(list)
    for op in operations(history):
        if op["kind"] == "write" and op["ok"] is True and op["value"]:
            counts[(op["key"], op["value"].split(":", 1)[0])].append(op)
    return [
        Violation(
            "lost update",
            f"{len(ops)} acknowledged writes of count {count} to {key!r}: "
            + ", ".join(f"{o['value']} (token {o['token']})" for o in ops),
            tuple(ops),
        )
        for (key, count), ops in counts.items()
        if len(ops) > 1
    ]


def something_was_checked(history: list[Event]) -> list[Violation]:
    ops = operations(history)
    writes = sum(1 for o in ops if o["kind"] == "write" and o["ok"] is True)
    reads = sum(1 for o in ops if o["kind"] == "read" and o["ok"] is True)
    if writes == 0 or reads == 0:
        return [
            Violation(
                "nothing checked", f"{writes} acknowledged writes and {reads} reads: no verdict"
            )
        ]
    return []


GROUP_CHECKERS: dict[str, Checker] = {
    "member order": members_never_accept_lower_after_higher,
    "acknowledged writes": acknowledged_writes_on_every_later_member,
    "linearizable": reads_are_linearizable,
    "configurations": configurations_totally_ordered_and_overlapping,
    "lost update": no_lost_update_under_the_lock,
    "nothing checked": something_was_checked,
}


def check_group(history: list[Event]) -> list[Violation]:
    """Every group checker (:func:`~fenced.testing.check.check_all` with these)."""
    return check_all(history, GROUP_CHECKERS)
