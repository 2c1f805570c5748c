"""A linearizability checker for a register (Wing & Gong's search, with Lowe's memo).

A history of one register: writes of unique values and reads, each with the (system-wide
monotonic) times it was invoked and answered. A write whose outcome is unknown (it failed in
a way that may have left it on some replicas, or its process died) may take effect at any
time after its invocation, or never. The history is linearizable if the operations can be
put in one order that respects real time (an operation answered before another was invoked
comes first) in which every read returns the latest write before it.

The search linearizes one operation at a time: any that no unlinearized operation must
precede; reads only if they return the current value. A state (set of operations done, value)
seen before is not explored again. Histories of a few hundred operations per register, with
the concurrency of a handful of processes, take milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["RegisterOp", "check_register"]


@dataclasses.dataclass(frozen=True, slots=True)
class RegisterOp:
    """``kind`` "write" or "read"; ``value`` written or read (None: never written/deleted);
    ``end`` None for a write of unknown outcome."""

    kind: str
    value: str | None
    start: float
    end: float | None
    id: str = ""


def check_register(
    ops: Sequence[RegisterOp], initial: str | None = None, budget: int = 2_000_000
) -> str | None:
    """None if the history is linearizable; else why not (or that the search ran out)."""
    ops = sorted(ops, key=lambda o: o.start)
    n = len(ops)
    ends = [math.inf if o.end is None else o.end for o in ops]
    required = 0
    for i, o in enumerate(ops):
        if o.end is not None:
            required |= 1 << i
    seen: set[tuple[int, str | None]] = set()
    stack: list[tuple[int, str | None]] = [(0, initial)]
    best = (0, 0)  # (how many required ops linearized, mask): for the message
    explored = 0
    while stack:
        mask, value = stack.pop()
        if (mask, value) in seen:
            continue
        seen.add((mask, value))
        explored += 1
        if explored > budget:
            return f"undecided: the search passed {budget} states"
        if mask & required == required:
            return None
        done = bin(mask & required).count("1")
        if done > best[0]:
            best = (done, mask)
        # The earliest answer among ops not yet linearized: nothing invoked after it may go
        # before it.
        horizon = min((ends[i] for i in range(n) if not mask >> i & 1), default=math.inf)
        for i in range(n):
            if mask >> i & 1:
                continue
            o = ops[i]
            if o.start > horizon:
                break  # (sorted by start: the rest start later still)
            if o.kind == "read":
                if o.value == value:
                    stack.append((mask | 1 << i, value))
            else:
                stack.append((mask | 1 << i, o.value))
    done, mask = best
    pending = [ops[i] for i in range(n) if not mask >> i & 1 and ops[i].end is not None]
    first = min(pending, key=lambda o: o.end or math.inf) if pending else None
    where = f"; stuck before {first.kind} {first.value!r} ({first.id})" if first else ""
    return f"not linearizable: at most {done} of {bin(required).count('1')} operations fit{where}"
