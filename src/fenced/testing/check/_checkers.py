"""Checkers: pure functions from a history (see ``_history``) to the violations found.

Each states one invariant of fencing. They look only at the history, so they can judge a
run of any resource and any token source, and a history can be checked again later.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._history import Event

__all__ = [
    "CHECKERS",
    "Checker",
    "Violation",
    "acknowledged_writes_survive",
    "check_all",
    "current_holder_is_served",
    "grants_do_not_overlap_in_grant_order",
    "impostors_refused",
    "mark_is_the_highest_accepted",
    "no_lost_update",
    "no_token_granted_twice",
    "only_granted_tokens_accepted",
    "something_was_checked",
    "the_run_completed",
    "tokens_never_decrease_in_acceptance_order",
]


@dataclasses.dataclass(frozen=True)
class Violation:
    checker: str
    message: str
    events: tuple[Any, ...] = ()

    def __str__(self) -> str:
        return f"{self.checker}: {self.message}"


Checker = Callable[[list[Event]], list[Violation]]
"""A checker: a pure function from a history to the violations it finds."""


def _final(history: Iterable[Event]) -> Event | None:
    finals = [e for e in history if e["op"] == "final"]
    return finals[-1] if finals else None


def _sent(write: Event) -> float:
    """When a write was sent (histories before 0.2 recorded only when it was answered)."""
    return float(write["sent"] if "sent" in write else write["mono"])


def _accepted(history: list[Event]) -> list[Event]:
    return [e for e in history if e["op"] == "write" and e["ok"] is True]


def tokens_never_decrease_in_acceptance_order(history: list[Event]) -> list[Violation]:
    """The resource accepted writes in non-decreasing token order (a lower token after a
    higher one is a stale writer let in): in the final state's own order, and in real time —
    a write sent after a higher token's write was acknowledged must not be accepted."""
    final = _final(history)
    if final is None:
        return [Violation("acceptance order", "no final state of the resource in the history")]
    out = []
    log = final["log"] or []
    for (t1, v1), (t2, v2) in zip(log, log[1:], strict=False):
        if t2 < t1:
            out.append(
                Violation(
                    "acceptance order",
                    f"token {t2} accepted after token {t1} (values {v1} then {v2})",
                    ((t1, v1), (t2, v2)),
                )
            )
    # Acknowledged writes and acknowledged *fenced reads*: a read under token 123 raised the
    # mark, so a write with 122 sent after it was answered must be refused all the same.
    # (An impostor's read served is "impostor accepted", not a grant's read every later write
    # would then be judged against.)
    acked = sorted(
        (
            e
            for e in history
            if e["op"] in ("write", "read") and e.get("ok") is True
            and not (e["op"] == "read" and e.get("impostor"))
        ),
        key=lambda e: e["mono"],
    )  # fmt: skip
    highest: Event | None = None  # the highest-token operation acknowledged so far
    done = 0
    for e in sorted(_accepted(history), key=_sent):
        while done < len(acked) and acked[done]["mono"] < _sent(e):
            if highest is None or acked[done]["token"] > highest["token"]:
                highest = acked[done]
            done += 1
        if highest is not None and e["token"] < highest["token"]:
            what = "write" if highest["op"] == "write" else "fenced read"
            out.append(
                Violation(
                    "acceptance order",
                    f"{e['worker']}'s write with token {e['token']} was accepted, sent after "
                    f"{highest['worker']}'s {what} with token {highest['token']} had been "
                    "acknowledged",
                    (highest, e),
                )
            )
    return out + _changed_after_a_read(history)


def _changed_after_a_read(history: list[Event]) -> list[Violation]:
    """Once a fenced read with token T was answered, only a write with a token of T or more
    may change the register: a later look at it (a fenced read sent after, or the ``race``
    burst's ``look`` without a token) that finds other bytes than that read saw, last written
    by a lower token, saw a stale write that landed after the read (a check and its write in
    two steps, the read in between)."""
    reads = sorted(
        (
            e
            for e in history
            if e["op"] == "read" and e.get("ok") is True and "seen" in e
            and not e.get("forged") and not e.get("impostor")
        ),
        key=lambda e: -e["token"],
    )  # fmt: skip
    looks = [e for e in history if e["op"] == "look"] + [e for e in reads if "sent" in e]
    out = []
    for look in looks:
        last = look.get("last") or [0, 0]
        for r in reads:
            if r["mono"] < look["sent"] and r["token"] > last[0] and r["seen"] != look["seen"]:
                by = "a look at it" if look["op"] == "look" else f"{look['worker']}'s read"
                out.append(
                    Violation(
                        "acceptance order",
                        f"token {last[0]}'s write (value {last[1]}) landed after "
                        f"{r['worker']}'s fenced read with token {r['token']} was answered: "
                        f"{by}, sent after, found other bytes than that read saw, last written "
                        f"by token {last[0]}",
                        (r, look),
                    )
                )
                break
    return out


def mark_is_the_highest_accepted(history: list[Event]) -> list[Violation]:
    """The resource's high-water mark is at least the highest token it accepted (a lower mark
    lets a stale writer in next) and no higher than the highest granted (a fenced read may
    raise it past the last write, nothing else may)."""
    final = _final(history)
    if final is None or final.get("mark") is None:
        return []
    mark = final["mark"]
    accepted = [e["token"] for e in _accepted(history)]
    granted = [e["token"] for e in history if e["op"] == "grant" and e["lock"] == final["lock"]]
    if accepted and mark < max(accepted):
        return [
            Violation("mark", f"the resource's mark is {mark}, below its accepted {max(accepted)}")
        ]
    if granted and mark > max(granted):
        return [
            Violation("mark", f"the resource's mark is {mark}, above every grant ({max(granted)})")
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
    """A read-modify-write counter: no two accepted writes built on the same state (the same
    value), and in the final state each value is one more than the one before (a write built
    on a value someone else had already replaced is a lost update)."""
    out = []
    first: dict[int, Event] = {}
    for e in sorted(_accepted(history), key=lambda e: e["mono"]):
        if e["value"] in first:
            a = first[e["value"]]
            if a["token"] == e["token"] and (
                a.get("burst") is not None or e.get("burst") is not None
            ):
                continue  # (the race burst: one write sent again by its holder, not built twice)
            out.append(
                Violation(
                    "lost update",
                    f"value {e['value']} written twice and accepted twice: by {a['worker']} "
                    f"(token {a['token']}) and by {e['worker']} (token {e['token']})",
                    (a, e),
                )
            )
        else:
            first[e["value"]] = e
    final = _final(history)
    log = [tuple(entry) for entry in (final["log"] or [])] if final else []
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
    if final["log"] is None:
        return [
            Violation(
                "acknowledged write",
                "the resource's final state is not the register the workers wrote",
            )
        ]
    kept = {(t, v) for t, v in final["log"]}
    # (the race burst sends one write again: a copy refused while another got in is no
    # refused write that landed)
    taken = {(e["token"], e["value"]) for e in _accepted(history)}
    out = []
    for e in history:
        if e["op"] != "write":
            continue
        there = (e["token"], e["value"]) in kept
        if e["ok"] is True and not there:
            out.append(
                Violation("acknowledged write", f"{e['worker']}'s accepted write {e['value']} "
                          f"(token {e['token']}) is not in the final state", (e,))
            )  # fmt: skip
        if e["ok"] is False and there and (e["token"], e["value"]) not in taken:
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
        elif e["op"] == "releasing":  # written before the release is sent (it may die next)
            released[(e["lock"], e["token"])] = float(e["mono"])
        elif e["op"] == "release" and (e["lock"], e["token"]) not in released:
            # From when the release was sent, whatever came back: the source may grant the
            # next holder before the releasing worker hears back, and a release whose reply
            # was lost may have been carried out (the holder stopped acting at the send).
            released[(e["lock"], e["token"])] = float(e["sent"] if "sent" in e else e["mono"])

    def belief(e: Event, lock: str) -> tuple[float, float]:
        """When the holder believed it surely held: from hearing of the grant to the end."""
        end = min(e["surely_until"], released.get((lock, e["token"]), float("inf")))
        return e["mono"], end

    out = []
    for lock, grants in by_lock.items():
        grants.sort(key=lambda e: e["token"])
        for prev, nxt in zip(grants, grants[1:], strict=False):
            # Two holders believing at once. (A holder paused between its grant and hearing
            # of it may hear after the next grant, with no time left: no belief, no overlap.)
            (p0, p1), (n0, n1) = belief(prev, lock), belief(nxt, lock)
            if max(p0, n0) < min(p1, n1):
                out.append(
                    Violation(
                        "overlap",
                        f"{lock!r} token {nxt['token']} granted {p1 - n0:.3f} s "
                        f"before token {prev['token']}'s lease had surely ended",
                        (prev, nxt),
                    )
                )
    return out


def only_granted_tokens_accepted(history: list[Event]) -> list[Violation]:
    """Every token the resource accepted was granted by the source (an accepted token nobody
    was granted is a forged or corrupted one let in)."""
    granted = {(e["lock"], e["token"]) for e in history if e["op"] == "grant"}
    out = []
    for e in _accepted(history):
        if (e["lock"], e["token"]) not in granted and not e.get("impostor"):  # (its own)
            out.append(
                Violation("forged token", f"{e['worker']}'s write with token {e['token']} was "
                          "accepted, and no grant had that token", (e,))
            )  # fmt: skip
    return out


def impostors_refused(history: list[Event]) -> list[Violation]:
    """Every write sent with another lock's token, a malformed token or none was refused, and
    every fenced read with another lock's token or a malformed one too: whatever the mark, only
    a token of the resource's own lock may write or read fenced (a resource that ignores the
    lock name lets a holder of any lock move its mark past the rightful holder; a read served
    with such a token raised the mark with it, or read past the fence). A refusal must leave
    the mark where it was: one after which the mark read back (``mark_after``) had reached the
    impostor's token is a violation too; where the resource reports no mark, the rightful
    holder's next write refused says it (:func:`current_holder_is_served`)."""
    out = []
    for e in history:
        if not (e.get("impostor") and e["op"] in ("write", "read")):
            continue
        header = "no header" if e.get("header") is None else repr(e["header"])
        what, done = ("write", "accepted") if e["op"] == "write" else ("fenced read", "served")
        if e.get("ok") is True:
            said = f"was {done}: the resource must refuse it whatever its mark"
        elif _moved_the_mark(e):
            said = (
                f"was refused, and the resource's mark moved to {e['mark_after']} all the same "
                "(read back right after it): a refused token must leave the mark where it was"
            )
        else:
            continue
        out.append(
            Violation("impostor accepted", f"a {what} with {e['impostor']} ({header}) {said}", (e,))
        )
    return out


def _moved_the_mark(e: Event) -> bool:
    """Whether the resource's mark, read back right after an impostor's refused write or read
    (``mark_after``), had reached its token: no real token comes near (the impostors' are
    above 10**9), so the refusal moved it."""
    after = e.get("mark_after")
    return e.get("ok") is False and isinstance(after, int) and after >= e["token"]


def _refused(history: list[Event]) -> list[Event]:
    """The reads and writes the resource refused as stale (forged writes aside: those it must
    refuse)."""
    return [
        e
        for e in history
        if e["op"] in ("read", "write") and e.get("ok") is False and not e.get("forged")
    ]


def current_holder_is_served(history: list[Event]) -> list[Violation]:
    """A resource that refuses everyone never accepts a stale write, and proves nothing: the
    holder of the newest token granted must be able to read and write. A refusal of a token
    when no higher one had been granted (nor a forged one let in) is a violation; so is a run
    in which the resource refused more reads and writes than it served."""
    raisers = sorted(  # (lock, token, when): what may legitimately have raised the mark
        [(e["lock"], e["token"], float(e["mono"])) for e in history if e["op"] == "grant"]
        + [
            # (a forged write or an impostor's read let in raised it: their own violations)
            (e.get("lock") if not e.get("impostor") else "", e["token"], _sent(e))
            for e in history
            if e["op"] in ("write", "read")
            and e.get("forged")
            and (e.get("ok") is not False or _moved_the_mark(e))
        ],
        key=lambda r: r[2],
    )
    out = []
    for e in sorted(_refused(history), key=lambda e: e["mono"]):
        # (A grant is in the history before its holder's first request: a higher mark that
        # came from a real holder shows as an earlier grant.)
        newer = [
            r for r in raisers if r[2] < e["mono"] and r[0] in (e["lock"], "") and r[1] > e["token"]
        ]
        if not newer:
            what = "write" if e["op"] == "write" else "fenced read"
            out.append(
                Violation(
                    "current holder refused",
                    f"{e['worker']}'s {what} with token {e['token']} was refused as stale, "
                    "and no higher token had been granted: the resource refuses its rightful "
                    "holder",
                    (e,),
                )
            )
    # (Reads count too: a resource refusing fenced reads keeps its holders from ever writing.)
    # (the race burst's copies are the nemesis', most of them refused by design)
    ops = [
        e
        for e in history
        if e["op"] in ("read", "write") and not e.get("forged") and e.get("burst") is None
    ]
    refused = sum(1 for e in ops if e.get("ok") is False)
    served = sum(1 for e in ops if e.get("ok") is True)
    if refused >= 3 and refused > served:
        out.append(
            Violation(
                "mostly refused",
                f"{refused} of {len(ops)} reads and writes were refused as stale and only "
                f"{served} served: a resource that refuses its holders proves nothing",
            )
        )
    return out


def something_was_checked(history: list[Event]) -> list[Violation]:
    """At least one write was accepted: a run in which no write got through proves nothing
    (a dead source, a resource refusing everyone) and must not pass."""
    if not _accepted(history):
        return [Violation("nothing checked", "no write was accepted in the whole run")]
    return []


CHECKERS: dict[str, Checker] = {
    "acceptance order": tokens_never_decrease_in_acceptance_order,
    "mark": mark_is_the_highest_accepted,
    "token reuse": no_token_granted_twice,
    "lost update": no_lost_update,
    "acknowledged writes": acknowledged_writes_survive,
    "overlap": grants_do_not_overlap_in_grant_order,
    "forged token": only_granted_tokens_accepted,
    "impostor accepted": impostors_refused,
    "current holder refused": current_holder_is_served,
    "nothing checked": something_was_checked,
}


def the_run_completed(history: list[Event]) -> list[Violation]:
    """The run was not cut short by a part that died under it (a worker's process, the fork
    server, the resource: an ``aborted`` event says which): a run that tested less than it set
    out to never passes, whatever the other checkers found in what did run."""
    return [
        Violation("run incomplete", str(e["why"]), (e,)) for e in history if e["op"] == "aborted"
    ]


def check_all(
    history: list[Event],
    checkers: Mapping[str, Checker] = CHECKERS,
) -> list[Violation]:
    """Every violation ``checkers`` (the locks workload's by default) find in ``history``, and
    an incomplete run's (:func:`the_run_completed`, whatever the workload)."""
    found = [v for checker in checkers.values() for v in checker(history)]
    if the_run_completed not in checkers.values():
        found += the_run_completed(history)
    return found
