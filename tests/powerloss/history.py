"""Running clients through power cuts, and what the invariants say about their history."""

from __future__ import annotations

import os
import queue
import random
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fenced.testing import forkserver
from fenced.testing.powerloss import PowerLossMount, unavailable
from fenced.testing.servers import python_env
from tests.sources.envs.sqlite import read_counters

ROOT = Path(__file__).resolve().parents[2]
CYCLES = int(os.environ.get("FENCED_POWERLOSS_CYCLES", "2"))  # cut cycles per test
CYCLE_MARKS = [  # (the marks of a test that runs CYCLES cut cycles)
    pytest.mark.skipif(unavailable() is not None, reason=unavailable() or ""),
    pytest.mark.timeout(120 + 60 * CYCLES),  # (a cut cycle: seconds, more on a loaded machine)
]


class Client:
    """A worker process (tests.powerloss.workers); its ``LOCK TOKEN`` lines read on a thread."""

    def __init__(self, *args: str) -> None:
        # (forked from the testing room's fork server, which has imported the workers)
        self.proc = forkserver.popen(
            "tests.powerloss.workers",
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env={**python_env(), "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
            warm=("tests.powerloss.workers",),
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def acks(self, n: int, timeout: float) -> list[tuple[str, int]]:
        """The next ``n`` acknowledged grants (fewer if the process ends or time runs out)."""
        out: list[tuple[str, int]] = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            out.extend(_parse(line))
        return out

    def rest(self, timeout: float = 10.0) -> list[tuple[str, int]]:
        """After the kill: every line it printed before it died."""
        self.proc.wait(timeout)
        out: list[tuple[str, int]] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:  # (a pipe still open after that long: a bug, seen in the asserts)
                break
            if line is None:
                break
            out.extend(_parse(line))
        return out


def _parse(line: str) -> list[tuple[str, int]]:
    parts = line.split()
    # (a line cut short by the kill told nobody a whole token)
    return [(parts[0], int(parts[1]))] if len(parts) == 2 and line.endswith("\n") else []


@dataclass
class Result:
    cycles: int = 0
    acks: int = 0  # acknowledged grants seen, all cycles
    writes: int = 0  # filesystem writes served, all cycles
    fsyncs: int = 0
    lost: list[str] = field(default_factory=list)  # acknowledged, then gone after the cut
    reused: list[str] = field(default_factory=list)  # a token acknowledged twice (or lower)
    corrupt: list[str] = field(default_factory=list)


def check_database(db: Path, history: dict[str, list[int]], result: Result, cycle: int) -> None:
    """After a remount: every acknowledged token is at or under its lock's counter."""
    conn = sqlite3.connect(db)
    try:
        check = conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()
    if check != "ok":
        result.corrupt.append(f"cycle {cycle}: {check}")
    counters = read_counters(str(db))
    for name, tokens in history.items():
        if tokens and tokens[-1] > counters.get(name, 0):
            result.lost.append(
                f"cycle {cycle}: {name} token {tokens[-1]} acknowledged, counter {counters.get(name, 0)}"
            )


def record(
    history: dict[str, list[int]], acks: Sequence[tuple[str, int]], result: Result, cycle: int
) -> None:
    for name, token in acks:
        seen = history.setdefault(name, [])
        if seen and token <= seen[-1]:
            result.reused.append(f"cycle {cycle}: {name} token {token} after {seen[-1]}")
        seen.append(token)
    result.acks += len(acks)


def run_cycles(
    powerloss: PowerLossMount,
    db: Path,
    start: Callable[[], Client],
    cycles: int,
    *,
    seed: int = 0,
    stop: Callable[[], None] = lambda: None,
    max_acks: int = 300,
    acks_before_cut: Callable[[int], int] | None = None,
    check: Callable[[int], None] = lambda cycle: None,
    history: dict[str, list[int]] | None = None,
    result: Result | None = None,
) -> Result:
    """``cycles`` times: start the clients (and whatever ``start`` starts), let them take a
    random number of grants (or ``acks_before_cut(cycle)``), cut the power, kill them (and
    ``stop()``), remount, check the token source's database and then ``check(cycle)``.
    ``history`` (lock -> acknowledged tokens) and ``result`` are filled if given."""
    rng = random.Random(seed)
    result = Result() if result is None else result
    history = {} if history is None else history
    for cycle in range(cycles):
        client = start()
        try:
            want = rng.randint(20, max_acks) if acks_before_cut is None else acks_before_cut(cycle)
            acks = client.acks(want, timeout=60)
            assert acks, f"cycle {cycle}: nothing acknowledged before the cut"
            record(history, acks, result, cycle)
            writes, fsyncs, _ = powerloss.cut()
            result.writes += writes
            result.fsyncs += fsyncs
        finally:
            client.proc.kill()
            stop()
        record(history, client.rest(), result, cycle)
        assert client.proc.stdout is not None
        client.proc.stdout.close()
        powerloss.remount()
        check_database(db, history, result, cycle)
        check(cycle)
        result.cycles += 1
    return result
