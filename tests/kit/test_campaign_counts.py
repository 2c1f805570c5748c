"""A campaign measured in faults (``Campaign(faults=N, enough=...)``): it ends once every
nemesis struck N times with what the workload's checks need in the history, and is judged
``short`` when its time bound ends first (a run too slow to deal its faults tested less than
asked, and must not pass)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import fenced
from fenced.testing.check import Campaign, Fault
from fenced.testing.check._checkers import Checker
from fenced.testing.check._history import Event, History


class Deck:
    """A workload whose faults strike at once, its operation one history event each turn."""

    nemeses = ("a", "b")
    first: frozenset[str] = frozenset()
    prefix_checkers: dict[str, Checker] = {}

    def __init__(self, can_strike: Callable[[str], bool] = lambda kind: True) -> None:
        self.can_strike = can_strike
        self.history: History | None = None

    def setup(self, history: Path) -> None:
        self.history = History(history, "w1")

    def pace(self, rng: random.Random) -> float:
        return 0.01

    def healthy(self) -> None:
        assert self.history is not None
        self.history.append("op")

    def aim(self, kind: str, rng: random.Random) -> Fault | None:
        return Fault(kind, "w1", 0.0, lambda: None) if self.can_strike(kind) else None

    def settle(self, history: History) -> None:
        pass

    def close(self) -> None:
        if self.history is not None:
            self.history.close()

    def is_operation(self, event: Event) -> bool:
        return bool(event["op"] == "op")

    def judge(
        self, events: list[Event], faults: dict[str, int], seconds: float, short: str = ""
    ) -> str:
        return short


def ops(events: list[Event]) -> int:
    return sum(1 for e in events if e["op"] == "op")


def test_it_ends_once_every_fault_struck_with_enough_operations(tmp_path: Path) -> None:
    start = time.monotonic()
    camp: Campaign[str] = Campaign(
        Deck(), tmp_path, seconds=30, faults=3, enough=lambda events: ops(events) >= 10
    )
    assert camp.run() == ""  # (nothing short)
    assert time.monotonic() - start < 15  # (the 30 s bound never reached)
    assert min(camp.faults.values()) >= 3, camp.faults


@pytest.mark.parametrize("short", ["faults", "operations"])
def test_a_bound_that_ends_first_fails_the_run(tmp_path: Path, short: str) -> None:
    workload = Deck(can_strike=lambda kind: short != "faults" or kind == "a")
    camp: Campaign[str] = Campaign(
        workload, tmp_path, seconds=0.5, faults=1,
        enough=lambda events: short != "operations",
    )  # fmt: skip
    verdict = camp.run()
    assert verdict == (
        "b 0 of 1" if short == "faults" else "what the workload's checks need (enough)"
    )


def test_counts_are_not_negative(tmp_path: Path) -> None:
    with pytest.raises(fenced.ConfigurationError, match="must be >= 0"):
        Campaign(Deck(), tmp_path, seconds=1, faults=-1)
