"""The one campaign of the kit: setup → nemesis → teardown → judge, parametrised by a workload.

The workloads are ``_campaign``'s (a lock and a resource: ``fenced check``) and
``_group_campaign``'s (a replicated group). The campaign owns what every workload shares — the
history (``_history``), the seeded schedule of faults dealt as from a deck, the nemesis events,
the clock of the run, stopping at the first violation — and a workload what is its own: its
processes and servers, how each fault is aimed and struck, its final state and its checkers.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from ..._core.errors import ConfigurationError
from ._checkers import Checker
from ._history import Event, History, read_history

__all__ = ["Campaign", "CampaignError", "Fault", "Workload"]

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class CampaignError(ConfigurationError):
    """A campaign could not run as asked (a worker died by itself, a part would not start):
    nothing was checked."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault, aimed: what it is, at whom (a worker, ``source``, a member...), for how
    long; ``strike`` deals it (and returns once it is over, or under way on its own)."""

    kind: str
    victim: str
    seconds: float
    strike: Callable[[], None]


class Workload(Protocol[R_co]):
    """What a campaign runs. The campaign calls, in order: :meth:`setup`, then until the time
    is up :meth:`pace`, :meth:`healthy` and (with a fault in the deck) :meth:`aim` and the
    fault's ``strike``; then :meth:`settle`, :meth:`close` (always, even after an error) and
    :meth:`judge` over the history."""

    @property
    def nemeses(self) -> Sequence[str]:
        """The faults asked for: each round of the deck deals every one once, shuffled."""
        ...

    @property
    def first(self) -> frozenset[str]:
        """The faults the first round deals first."""
        ...

    @property
    def prefix_checkers(self) -> Mapping[str, Checker]:
        """Checkers whose violations in a prefix of the history stay violations in the whole
        (a run asked to stop at the first violation may stop when one of them finds one)."""
        ...

    def setup(self, history: Path) -> None:
        """Start what the run needs: servers, the resource, the workers (writing to
        ``history``). Raise :class:`CampaignError` (or a ConfigurationError) if a part would
        not start."""

    def pace(self, rng: random.Random) -> float:
        """Seconds to wait before the next fault (the schedule's own clock)."""
        ...

    def healthy(self) -> None:
        """Raise :class:`CampaignError` if a worker died by itself."""

    def aim(self, kind: str, rng: random.Random) -> Fault | None:
        """The fault of ``kind`` aimed now (its draws from ``rng``), or None when it cannot
        strike now (it is not counted)."""
        ...

    def settle(self, history: History) -> None:
        """The faults are over: heal, stop the workers, record the final state."""

    def close(self) -> None:
        """Stop whatever still runs (after :meth:`settle`, or after an error midway)."""

    def judge(self, events: list[Event], faults: dict[str, int], seconds: float) -> R_co:
        """The verdict on the whole history."""
        ...


class Campaign(Generic[R]):
    """Runs ``workload`` for ``seconds`` under the nemesis drawn from ``seed`` (the same seed,
    the same schedule), writing ``out/history.jsonl``. ``progress(elapsed, what)`` is called
    at each fault; ``stop_at_first`` ends the run once every nemesis has struck and the history
    so far shows a violation of one of the workload's ``prefix_checkers`` (the verdict is still
    every checker over the whole history).

    ``faults_each=N`` measures the run in faults rather than time: it ends as soon as every
    nemesis has struck N times and ``enough(history so far)`` holds (the operations the
    checks need), ``seconds`` is then only its bound, and a bound that ends first is a
    :class:`CampaignError` (a run too slow to deal its faults tested less than asked)."""

    def __init__(
        self,
        workload: Workload[R],
        out: str | Path,
        *,
        seconds: float,
        seed: int = 0,
        progress: Callable[[float, str], None] | None = None,
        stop_at_first: bool = False,
        faults_each: int = 0,
        enough: Callable[[list[Event]], bool] | None = None,
    ) -> None:
        if faults_each < 0:
            raise ConfigurationError(f"faults_each {faults_each}: 0 (a run in time) or more")
        self.workload = workload
        self.out = Path(out)
        self.seconds = seconds
        self.faults_each, self.enough = faults_each, enough  # (a run in faults: see above)
        self.seed = seed
        self.progress = progress
        self.stop_at_first = stop_at_first
        self.path = self.out / "history.jsonl"
        self.faults: dict[str, int] = {n: 0 for n in workload.nemeses}

    def run(self) -> R:
        w = self.workload
        self.out.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)
        rng = random.Random(self.seed)
        start = time.monotonic()
        history = History(self.path, "nemesis")
        try:
            w.setup(self.path)
            # (``seconds`` of faults, counted once the workers are up: starting servers and
            # processes takes seconds of its own on a loaded machine)
            self._nemesis(history, rng, time.monotonic())
            w.settle(history)
        finally:
            try:
                w.close()
            finally:
                history.close()
        return w.judge(read_history(self.path), self.faults, time.monotonic() - start)

    def _nemesis(self, history: History, rng: random.Random, start: float) -> None:
        """Deal faults until ``seconds`` after ``start`` (or, with ``faults_each``, until every
        nemesis struck that often)."""
        w, faults = self.workload, self.faults
        deck: list[str] = []
        while time.monotonic() - start < self.seconds:
            if self.faults_each and self._counted():
                return
            time.sleep(w.pace(rng))  # (the schedule's own clock, not a synchronisation)
            if time.monotonic() - start >= self.seconds:
                break  # (no fault dealt once the time is up)
            if self.stop_at_first and all(faults.values()) and self._caught():
                break  # (each nemesis has struck once: a result still counts every kind)
            w.healthy()
            if not w.nemeses:
                continue
            if not deck:  # each round of faults: every nemesis once, in a seeded order
                deck = list(w.nemeses)
                rng.shuffle(deck)
                if not any(faults.values()):  # the first round opens with the workload's first
                    deck.sort(key=lambda k: k in w.first)  # (stable; popped last first)
            kind = deck.pop()
            fault = w.aim(kind, rng)
            if fault is None:
                continue
            faults[kind] += 1
            history.append("nemesis", kind=kind, victim=fault.victim, seconds=fault.seconds)
            if self.progress:
                self.progress(time.monotonic() - start, f"{kind} {fault.victim}")
            fault.strike()
        if self.faults_each and not self._counted():
            raise CampaignError(
                f"the {self.seconds:g} s bound ended before every nemesis struck "
                f"{self.faults_each} times ({faults}) with enough operations"
            )

    def _counted(self) -> bool:
        """Whether a run measured in faults has dealt them all, with enough operations."""
        if min(self.faults.values(), default=0) < self.faults_each:
            return False
        return self.enough is None or self.enough(read_history(self.path))

    def _caught(self) -> bool:
        """Whether the history so far shows a violation of a prefix checker."""
        if not self.workload.prefix_checkers:
            return False
        events = [e for e in read_history(self.path) if e["op"] != "final"]
        return any(check(events) for check in self.workload.prefix_checkers.values())
