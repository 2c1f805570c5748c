"""Many seeds, in parallel; a failing seed shrunk to the smallest run that still fails."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator

from ._world import Config, Outcome, simulate

__all__ = ["SeedsResult", "run_seeds", "shrink"]

_CHUNK = 200


@dataclasses.dataclass
class SeedsResult:
    seeds: int
    failed: list[int]  # the failing seeds, lowest first
    seconds: float

    @property
    def per_second(self) -> float:
        return self.seeds / max(self.seconds, 1e-9)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """For a run of many seeds: what is already in the heap (the imported code: the server's
    and the group's for those systems) set aside from the garbage collector, and its young
    generation collected less often. A seed makes thousands of short-lived cycles (futures,
    tasks, exceptions), and each full collection walked every object the imports made: about
    a tenth of a group or gateway seed's CPU went to collections. Collection only: no run
    changes (bench/sim_digests.py). (No gc.collect() first: in a test process it would walk
    the whole suite's heap at each of the ~30 calls; garbage frozen with the rest is
    collected after ``unfreeze``.)"""
    gc.freeze()
    was = gc.get_threshold()
    gc.set_threshold(10_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*was)
        gc.unfreeze()


def _chunk(args: tuple[Config, int, int]) -> list[int]:
    template, start, count = args
    failed = []
    for seed in range(start, start + count):
        if not simulate(dataclasses.replace(template, seed=seed)).ok:
            failed.append(seed)
    return failed


def run_seeds(
    template: Config,
    start: int,
    count: int,
    *,
    jobs: int = 0,
    stop_at_first: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> SeedsResult:
    """Simulate seeds ``start`` .. ``start + count - 1`` of ``template`` on ``jobs``
    processes (0: one per CPU)."""
    began = time.monotonic()
    jobs = jobs or len(os.sched_getaffinity(0))
    # (One process: seed by seed, so that stop_at_first stops at the first failing seed.)
    size = 1 if jobs == 1 else _CHUNK
    chunks = [
        (template, s, min(size, start + count - s)) for s in range(start, start + count, size)
    ]
    failed: list[int] = []
    done = 0
    results: Iterator[list[int]]
    pool = None
    with frozen_heap():  # (before the fork: the workers inherit it)
        if jobs == 1:
            results = map(_chunk, chunks)
        else:
            pool = multiprocessing.get_context("fork").Pool(jobs)
            results = pool.imap(_chunk, chunks)
        try:
            for (_, _, n), bad in zip(chunks, results, strict=True):
                failed += bad
                done += n
                if progress:
                    progress(done, len(failed))
                if stop_at_first and failed:
                    break
        finally:
            if pool is not None:
                pool.terminate()
    return SeedsResult(done, sorted(failed), time.monotonic() - began)


def shrink(cfg: Config) -> Outcome:
    """The smallest variation of a failing ``cfg`` (fewer rounds, fewer clients, fewer kinds
    of fault; the same seed) that still fails *the same way* — with a violation of a kind the
    original run had — and its run. ("nothing checked" alone is not kept when the original
    had another kind: a run cut down until nothing got through fails with no bug at all.)"""
    best = simulate(cfg)
    if best.ok:
        return best
    kinds = {v.checker for v in best.violations}
    if len(kinds) > 1:
        kinds.discard("nothing checked")
    changed = True
    while changed:
        changed = False
        options = [dataclasses.replace(best.config, rounds=r) for r in range(1, best.config.rounds)]
        options += [
            dataclasses.replace(best.config, clients=n) for n in range(1, best.config.clients)
        ]
        options += [
            dataclasses.replace(
                best.config, faults=tuple(f for f in best.config.faults if f != drop)
            )
            for drop in best.config.faults
        ]
        for option in options:
            tried = simulate(option)
            same = kinds & {v.checker for v in tried.violations}
            if same and len(tried.trace) < len(best.trace):
                best, changed = tried, True
                break
    return best
