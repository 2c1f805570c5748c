"""The one campaign of the kit: setup → nemesis → teardown → judge, parametrised by a workload.

The workloads are ``_campaign``'s (a lock and a resource: ``fenced check``) and
``_group_campaign``'s (a replicated group). The campaign owns what every workload shares — the
history (``_history``), the seeded schedule of faults dealt as from a deck, the nemesis events,
the clock of the run, stopping at the first violation — and a workload what is its own: its
processes and servers, how each fault is aimed and struck, its final state and its checkers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from ..._core.errors import ConfigurationError
from ._checkers import Checker, Violation
from ._history import Event, History, read_history

__all__ = [
    "INCONCLUSIVE",
    "REPORT_MARK",
    "Campaign",
    "CampaignError",
    "Fault",
    "ResetError",
    "Workload",
    "end_by",
    "prepare_report_dir",
    "undealt",
]

R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class CampaignError(ConfigurationError):
    """A campaign could not run as asked (a worker died by itself, a part would not start):
    nothing was checked."""


class ResetError(CampaignError):
    """The resource's ``reset()`` left it as no run can start from: its mark (or its data)
    still there, so the first holder's writes would be refused and the run blamed on fencing.
    Raised before any worker starts: nothing was checked."""


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

    def is_operation(self, event: Event) -> bool:
        """Whether ``event`` is one operation of the workload (what a run's ``operations``
        count counts: a worker's write, say, not the nemesis' own)."""
        ...

    def judge(
        self, events: list[Event], faults: dict[str, int], seconds: float, short: str = ""
    ) -> R_co:
        """The verdict on the whole history. ``short``, when not empty, says which of the
        counts the run was asked for its time bound ended before (the verdict must then fail
        unless it already does: a slow machine must not pass having tested less)."""
        ...


def short_of_counts(violations: list[Violation], short: str) -> list[Violation]:
    """``violations``, and when the run was short of the counts it was asked for (``short``,
    as :meth:`Workload.judge` gets it) and found nothing, the violation "counts not reached":
    a run that tested less than asked never passes. One rule for every workload's verdict."""
    if short and not violations:
        return [Violation("counts not reached", f"the time bound ended first: {short}")]
    return violations


INCONCLUSIVE = "inconclusive"
"""The verdict's name for a run that dealt some fault asked for no time (not a pass)."""


def undealt(
    violations: list[Violation], nemeses: Sequence[str], faults: Mapping[str, int], seconds: float
) -> list[Violation]:
    """``violations``, and when they are none and some of ``nemeses`` was never dealt, the
    violation "inconclusive": a run that dealt a kind of fault no time proves nothing about
    it, and never passes (a short time, a long ttl, a slow resource). One rule for every
    workload's verdict, as :func:`short_of_counts`."""
    missing = [n for n in nemeses if not faults.get(n)]
    if violations or not missing:
        return violations
    return [
        Violation(
            INCONCLUSIVE,
            f"no {', no '.join(missing)} fault was dealt in {seconds:.1f} s: nothing failed, "
            "and nothing was shown to hold under it; give it more --time",
        )
    ]


REPORT_MARK = ".fenced-check"
"""The file a campaign leaves in its report directory: the kit made it, so a later run may
replace what an earlier one wrote there."""
# What a run writes in its report directory (and replaces when it is there).
_WRITES = ("history.jsonl", "report.html", "resource.db*", "resource.log", "worker-*.log", "stop")


def prepare_report_dir(out: Path) -> None:
    """Make the report directory ``out``, or take one an earlier run made: never one holding
    a file a run would replace that no run of the kit made (a user's ``resource.db`` or
    ``report.html``); a file, or a path that cannot be made, is a one-line error."""
    if out.exists() and not out.is_dir():
        raise ConfigurationError(f"--report {out}: not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(f"--report {out}: cannot make it: {exc.strerror}") from None
    mark = out / REPORT_MARK
    if mark.exists():
        return
    theirs = sorted(p.name for pattern in _WRITES for p in out.glob(pattern))
    if theirs:
        raise ConfigurationError(
            f"--report {out}: it holds {', '.join(theirs[:3])}, which a run would replace, and "
            "no run of fenced check made it: give a new or empty directory"
        )
    try:
        mark.write_text("made by fenced check: a later run replaces its history and report\n")
    except OSError as exc:
        raise ConfigurationError(f"--report {out}: cannot write in it: {exc.strerror}") from None


def end_by(procs: Iterable[Any], deadline: float) -> list[Any]:
    """Wait for each process (a Popen or a forked child) until ``deadline`` (monotonic), and
    SIGKILL the process group of each not ended by then; those it had to kill."""
    killed = []
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            killed.append(p)
    return killed


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, ConfigurationError) else text


class Campaign(Generic[R]):
    """Runs ``workload`` for ``seconds`` under the nemesis drawn from ``seed`` (the same seed,
    the same schedule), writing ``out/history.jsonl``. ``progress(elapsed, what)`` is called
    at each fault; ``stop_at_first`` ends the run once every nemesis has struck and the history
    so far shows a violation of one of the workload's ``prefix_checkers`` (the verdict is still
    every checker over the whole history).

    Counts (``faults``: each nemesis struck at least that many times; ``operations``: at least
    that many of the workload's operations done; ``enough``: a test on the history so far, for
    what a workload's checks need beyond a count, e.g. a refused stale change) make the run end
    as soon as all are reached, and ``seconds`` its bound: a run whose bound ends first is judged
    ``short`` (it fails), so a slow machine tests as much as a fast one, only slower, or says it
    could not."""

    def __init__(
        self,
        workload: Workload[R],
        out: str | Path,
        *,
        seconds: float,
        seed: int = 0,
        progress: Callable[[float, str], None] | None = None,
        stop_at_first: bool = False,
        faults: int = 0,
        operations: int = 0,
        enough: Callable[[list[Event]], bool] | None = None,
    ) -> None:
        if faults < 0 or operations < 0:
            raise ConfigurationError("a campaign's counts of faults and operations must be >= 0")
        self.workload = workload
        self.out = Path(out)
        self.seconds = seconds
        self.seed = seed
        self.progress = progress
        self.stop_at_first = stop_at_first
        self.path = self.out / "history.jsonl"
        self.faults: dict[str, int] = {n: 0 for n in workload.nemeses}
        self.min_faults, self.min_operations, self.enough = faults, operations, enough
        self.operations = 0  # the workload's operations in the history so far
        self._read_to = 0  # (how far the history was read for them)
        self.short = ""  # which counts the time bound ended before (empty: none, or none asked)

    def run(self) -> R:
        w = self.workload
        prepare_report_dir(self.out)
        self.path.unlink(missing_ok=True)
        rng = random.Random(self.seed)
        start = time.monotonic()
        history = History(self.path, "nemesis")
        try:
            w.setup(self.path)
            # A part that dies once the run is under way (a worker's process, the fork server,
            # the resource) ends it with a verdict, not an error: what ran is judged, and the
            # history says why it ended early ("run incomplete": it never passes).
            try:
                # (``seconds`` of faults, counted once the workers are up: starting servers and
                # processes takes seconds of its own on a loaded machine)
                self._nemesis(history, rng, time.monotonic())
            except Exception as exc:
                history.append("aborted", why=f"during the faults: {_one_line(exc)}")
            try:
                w.settle(history)
            except Exception as exc:
                history.append("aborted", why=f"at the end of the run: {_one_line(exc)}")
        finally:
            try:
                w.close()
            finally:
                history.close()
        events = read_history(self.path)
        if self._counted:
            self._count()
            self.short = self._shortfall()
        return w.judge(events, self.faults, time.monotonic() - start, self.short)

    def _nemesis(self, history: History, rng: random.Random, start: float) -> None:
        """Deal faults until ``seconds`` after ``start``."""
        w, faults = self.workload, self.faults
        deck: list[str] = []
        while time.monotonic() - start < self.seconds:
            # (the schedule's own clock, not a synchronisation; never past the time left: a
            # long ttl's pace must not stretch a short run it deals nothing in)
            left = self.seconds - (time.monotonic() - start)
            time.sleep(max(0.0, min(w.pace(rng), left)))
            if time.monotonic() - start >= self.seconds:
                break  # (no fault dealt once the time is up)
            if self._counted and not self._shortfall(self._count()):
                break  # (as much as was asked for was tested)
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

    def _count(self) -> int:
        """The workload's operations in the history so far (read on from where it was)."""
        with open(self.path, "rb") as f:
            f.seek(self._read_to)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # (a line being written: next time)
        self._read_to += len(complete)
        for line in complete.splitlines():
            if self.workload.is_operation(json.loads(line)):
                self.operations += 1
        return self.operations

    def _shortfall(self, operations: int | None = None) -> str:
        """What of the asked-for counts is missing ("" when both are reached)."""
        done = self.operations if operations is None else operations
        missing = [
            f"{kind} {n} of {self.min_faults}"
            for kind, n in self.faults.items()
            if n < self.min_faults
        ]
        if done < self.min_operations:
            missing.append(f"operations {done} of {self.min_operations}")
        if not missing and self.enough is not None and not self.enough(read_history(self.path)):
            missing.append("what the workload's checks need (enough)")
        return ", ".join(missing)

    @property
    def _counted(self) -> bool:
        """Whether the run is measured in counts (then ``seconds`` is only its bound)."""
        return bool(self.min_faults or self.min_operations or self.enough)

    def _caught(self) -> bool:
        """Whether the history so far shows a violation of a prefix checker."""
        if not self.workload.prefix_checkers:
            return False
        events = [e for e in read_history(self.path) if e["op"] != "final"]
        return any(check(events) for check in self.workload.prefix_checkers.values())
