"""Shared helpers for the benchmark scripts: timing, percentiles and a ratio table.

Every script runs fenced and its peer side by side in one run, on the same machine and
servers, and prints ops/s, p50 and p99 and the ratio fenced / peer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table


@dataclass
class Result:
    name: str
    samples: list[float] = field(default_factory=list)  # seconds per operation
    elapsed: float = 0.0  # wall time of the whole run
    ops: int = 0

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.elapsed if self.elapsed else 0.0

    def pct(self, q: float) -> float:
        if not self.samples:
            return float("nan")
        s = sorted(self.samples)
        return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]

    @property
    def p50(self) -> float:
        return self.pct(50)

    @property
    def p99(self) -> float:
        return self.pct(99)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else float("nan")


def measure(name: str, op: Callable[[], object], *, n: int, warmup: int = 20) -> Result:
    """Run ``op`` ``n`` times sequentially (after ``warmup`` runs) and time each call."""
    for _ in range(warmup):
        op()
    res = Result(name)
    clock = time.perf_counter
    start = clock()
    for _ in range(n):
        t0 = clock()
        op()
        res.samples.append(clock() - t0)
    res.elapsed = clock() - start
    res.ops = n
    return res


def finish(r: Result, n: int) -> Result:
    """Close a result timed op by op: its elapsed time is the sum of its samples."""
    r.elapsed, r.ops = sum(r.samples), n
    return r


def interleaved(
    pairs: list[tuple[str, Callable[[], object], str, Callable[[], object]]], n: int
) -> list[tuple[Result, Result]]:
    """Time each (ours, peer) pair alternately, op by op, all pairs in one round-robin (so
    load from other processes and disk drift hit both sides alike)."""
    results = [(Result(a), Result(b)) for a, _, b, _ in pairs]
    clock = time.perf_counter
    for _, ours, _, peer in pairs:
        for _ in range(50):
            ours()
            peer()
    for _ in range(n):
        for (_, ours, _, peer), (ra, rb) in zip(pairs, results, strict=True):
            t0 = clock()
            ours()
            t1 = clock()
            peer()
            t2 = clock()
            ra.samples.append(t1 - t0)
            rb.samples.append(t2 - t1)
    return [(finish(ra, n), finish(rb, n)) for ra, rb in results]


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} µs" if seconds < 0.01 else f"{seconds * 1e3:,.1f} ms"


def table(title: str, rows: Sequence[tuple[str, Result, Result]], note: str = "") -> None:
    """Print rows of (what, fenced result, peer result) with the ratio fenced/peer in ops/s."""
    t = Table(title=title, title_justify="left")
    for col in ("what", "fenced", "ops/s", "p50", "p99", "peer", "ops/s", "p50", "p99", "ratio"):
        t.add_column(col, justify="right" if col not in ("what", "fenced", "peer") else "left")
    for what, ours, peer in rows:
        ratio = ours.ops_per_s / peer.ops_per_s if peer.ops_per_s else float("nan")
        t.add_row(
            what,
            ours.name,
            f"{ours.ops_per_s:,.0f}",
            fmt_us(ours.p50),
            fmt_us(ours.p99),
            peer.name,
            f"{peer.ops_per_s:,.0f}",
            fmt_us(peer.p50),
            fmt_us(peer.p99),
            f"{ratio:.2f}×",
        )
    console = Console(width=160)
    console.print(t)
    if note:
        console.print(note)
