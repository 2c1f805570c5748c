"""Checkers: pure functions from a history (see ``_history``) to the violations found.

Each states one invariant of fencing. They look only at the history, so they can judge a
run of any resource and any token source, and a history can be checked again later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from ._history import Event

__all__ = [
    "CHECKERS",
    "Violation",
    "acknowledged_writes_survive",
    "check_all",
    "grants_do_not_overlap_in_grant_order",
    "mark_is_the_highest_accepted",
    "no_lost_update",
    "no_token_granted_twice",
    "tokens_never_decrease_in_acceptance_order",
]


@dataclasses.dataclass(frozen=True)
class Violation:
    checker: str
    message: str
    events: tuple[Any, ...] = ()

    def __str__(self) -> str:
        return f"{self.checker}: {self.message}"


def _final(history: Iterable[Event]) -> Event | None:
    finals = [e for e in history if e["op"] == "final"]
    return finals[-1] if finals else None


def tokens_never_decrease_in_acceptance_order(history: list[Event]) -> list[Violation]:
    """The resource accepted writes in non-decreasing token order (a lower token after a
    higher one is a stale writer let in)."""
    final = _final(history)
    if final is None:
        return [Violation("acceptance order", "no final state of the resource in the history")]
    out = []
    log = final["log"]
    for (t1, v1), (t2, v2) in zip(log, log[1:], strict=False):
        if t2 < t1:
            out.append(
                Violation(
                    "acceptance order",
                    f"token {t2} accepted after token {t1} (values {v1} then {v2})",
                    ((t1, v1), (t2, v2)),
                )
            )
    return out


def mark_is_the_highest_accepted(history: list[Event]) -> list[Violation]:
    """The resource's high-water mark equals the highest token it accepted (a mark lower than
    that lets a stale writer in next; a higher one refuses the current holder)."""
    final = _final(history)
    if final is None or not final["log"]:
        return []
    highest = max(t for t, _ in final["log"])
    if final["mark"] != highest:
        return [
            Violation(
                "mark", f"the resource's mark is {final['mark']}, its highest write {highest}"
            )
        ]
    return []


def no_token_granted_twice(history: list[Event]) -> list[Violation]:
    """Every grant of a lock has a token no other grant of it had."""
    seen: dict[tuple[str, int], Event] = {}
    out = []
    for e in history:
        if e["op"] != "grant":
            continue
        key = (e["lock"], e["token"])
        if key in seen:
            out.append(
                Violation(
                    "token reuse",
                    f"token {e['token']} of {e['lock']!r} granted to {seen[key]['worker']} "
                    f"and to {e['worker']}",
                    (seen[key], e),
                )
            )
        else:
            seen[key] = e
    return out


def no_lost_update(history: list[Event]) -> list[Violation]:
    """A read-modify-write counter: each accepted write's value is one more than the one
    accepted before it (a write built on a value someone else had already replaced is lost)."""
    final = _final(history)
    if final is None:
        return []
    log = [tuple(entry) for entry in final["log"]]
    out = []
    for (ta, a), (tb, b) in zip(log, log[1:], strict=False):
        if b != a + 1:
            out.append(
                Violation(
                    "lost update",
                    f"value {b} (token {tb}) accepted right after {a} (token {ta})",
                    ((ta, a), (tb, b)),
                )
            )
    return out


def acknowledged_writes_survive(history: list[Event]) -> list[Violation]:
    """Every write a worker saw accepted is in the resource's final state, and none it saw
    refused is (a refused write that landed anyway, or an acknowledged one that vanished)."""
    final = _final(history)
    if final is None:
        return []
    kept = {(t, v) for t, v in final["log"]}
    out = []
    for e in history:
        if e["op"] != "write":
            continue
        there = (e["token"], e["value"]) in kept
        if e["ok"] and not there:
            out.append(
                Violation("acknowledged write", f"{e['worker']}'s accepted write {e['value']} "
                          f"(token {e['token']}) is not in the final state", (e,))
            )  # fmt: skip
        if not e["ok"] and there:
            out.append(
                Violation("refused write", f"{e['worker']}'s refused write {e['value']} "
                          f"(token {e['token']}) is in the final state", (e,))
            )  # fmt: skip
    return out


def grants_do_not_overlap_in_grant_order(history: list[Event]) -> list[Violation]:
    """Each grant comes after the one before it (by token) had ended: released, or past the
    time its holder was told it surely held it (``surely_until``). A grant before that means
    the source or the lease's safety bound is wrong. (A paused holder writing after its lease
    ended is the *expected* effect of pauses, which the resource must refuse: it is not this
    checker's business.)"""
    by_lock: dict[str, list[Event]] = {}
    released: dict[tuple[str, int], float] = {}
    for e in history:
        if e["op"] == "grant":
            by_lock.setdefault(e["lock"], []).append(e)
        elif e["op"] == "release" and e.get("released"):
            # From when the release was sent: the source may grant the next holder before
            # the releasing worker hears back and records it.
            released[(e["lock"], e["token"])] = float(e["sent"] if "sent" in e else e["mono"])
    out = []
    for lock, grants in by_lock.items():
        grants.sort(key=lambda e: e["token"])
        for prev, nxt in zip(grants, grants[1:], strict=False):
            ended = min(prev["surely_until"], released.get((lock, prev["token"]), float("inf")))
            if nxt["mono"] < ended:
                out.append(
                    Violation(
                        "overlap",
                        f"{lock!r} token {nxt['token']} granted {ended - nxt['mono']:.3f} s "
                        f"before token {prev['token']}'s lease had surely ended",
                        (prev, nxt),
                    )
                )
    return out


CHECKERS: dict[str, Callable[[list[Event]], list[Violation]]] = {
    "acceptance order": tokens_never_decrease_in_acceptance_order,
    "mark": mark_is_the_highest_accepted,
    "token reuse": no_token_granted_twice,
    "lost update": no_lost_update,
    "acknowledged writes": acknowledged_writes_survive,
    "overlap": grants_do_not_overlap_in_grant_order,
}


def check_all(history: list[Event]) -> list[Violation]:
    return [v for checker in CHECKERS.values() for v in checker(history)]
