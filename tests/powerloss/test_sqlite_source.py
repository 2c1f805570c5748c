"""The SQLite token source through power cuts: load, cut, remount, restart, check.

Invariants after every cut: every acknowledged grant's token is at or under its lock's counter
on disk (so no token is ever handed out twice: each lock's acknowledged tokens rise strictly,
across every cut), and the file passes ``PRAGMA integrity_check``. A planted source that
acknowledges before its fsync is caught; ``kill -9`` alone does not catch it.

``FENCED_POWERLOSS_CYCLES`` sets the cycles per run (default 2: the bounded run of
``make test``); docs/verification.md has the figures of the long runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import fenced
from fenced.testing.powerloss import PowerLossMount
from fenced.testing.servers import FencedServer
from tests.powerloss.history import CYCLE_MARKS, CYCLES, Client, Result, run_cycles

pytestmark = CYCLE_MARKS
# The library's three commit paths: group commit on the worker thread (an application's loop),
# per turn of a loop marked as fenced serve marks its own, and the synchronous API (inline on
# its private loop, one transaction at a time).
LIBRARY_MODES = ["worker", "turn", "sync"]
PLANTED_CYCLES = 2  # (caught at the first cut; the second shows its tokens handed out again)
PLANT = "tests.powerloss.plants:AcksBeforeFsync"


def _report(what: str, result: Result) -> None:
    print(
        f"\n{what}: {result.cycles} cuts, {result.acks} acknowledged grants, "
        f"{result.writes} writes, {result.fsyncs} fsyncs; lost {len(result.lost)}, "
        f"reused {len(result.reused)}, corrupt {len(result.corrupt)}"
    )


def _fresh(db: Path) -> str:
    url = f"sqlite:///{db}"
    fenced.connect(url).close()  # (the schema, made and synced before the first cut)
    return url


@pytest.mark.parametrize("mode", LIBRARY_MODES)
def test_library_loses_no_acknowledged_grant(powerloss: PowerLossMount, mode: str) -> None:
    db = powerloss.mountpoint / "locks.db"
    url = _fresh(db)
    result = run_cycles(powerloss, db, lambda: Client("library", url, mode), CYCLES, seed=1)
    _report(f"library, {mode}", result)
    assert (result.lost, result.reused, result.corrupt) == ([], [], [])
    assert result.acks >= CYCLES * 20


@pytest.mark.parametrize("mode", LIBRARY_MODES)
def test_a_source_that_acknowledges_before_its_fsync_is_caught(
    powerloss: PowerLossMount, mode: str
) -> None:
    db = powerloss.mountpoint / "locks.db"
    url = _fresh(db)
    result = run_cycles(
        powerloss,
        db,
        lambda: Client("library", url, mode, PLANT),
        PLANTED_CYCLES,
        seed=2,
        max_acks=300,
    )
    _report(f"planted, {mode}", result)
    assert result.lost and result.reused, result


# ``fenced serve``'s two group-commit modes (the SQLite source's ``group_commit`` option): a
# commit per turn of its loop (the default), or the worker thread's group commit.
SERVE_MODES = ["turn", "worker"]
# Grants before a cut, at most (bounded run). Each grant through `fenced serve` on the FUSE
# disk costs ~80 ms of CPU (its ~70 writes and 6 fsyncs go through the Python daemon): 50 keeps
# a cut after 27 and 38 grants (seed 3) and 27 for the plant (seed 4), the plant caught at
# its first cut; the long run (FENCED_POWERLOSS_CYCLES) up to 300.
SERVE_MAX_ACKS = 300 if "FENCED_POWERLOSS_CYCLES" in os.environ else 50


@pytest.mark.parametrize("mode", SERVE_MODES)
def test_fenced_serve_loses_no_acknowledged_grant(
    powerloss: PowerLossMount, tmp_path: Path, mode: str
) -> None:
    db = powerloss.mountpoint / "locks.db"
    url = _fresh(db)
    (tmp_path / "serve").mkdir()
    server = FencedServer(f"{url}?group_commit={mode}", str(tmp_path / "serve"))

    def start() -> Client:
        server.start()
        return Client("http", server.url)

    try:
        result = run_cycles(
            powerloss, db, start, CYCLES, seed=3, stop=server.kill, max_acks=SERVE_MAX_ACKS
        )
    finally:
        server.kill()
    _report(f"fenced serve, {mode}", result)
    assert (result.lost, result.reused, result.corrupt) == ([], [], [])
    assert result.acks >= CYCLES * 20


@pytest.mark.parametrize("mode", SERVE_MODES)
def test_fenced_serve_planted_is_caught(
    powerloss: PowerLossMount, tmp_path: Path, mode: str
) -> None:
    db = powerloss.mountpoint / "locks.db"
    url = _fresh(db)
    (tmp_path / "serve").mkdir()
    server = FencedServer(
        f"{url}?group_commit={mode}",
        str(tmp_path / "serve"),
        prelude=f"from fenced._core import backend as _backend; _backend.register_backend('sqlite', {PLANT!r})",
    )

    def start() -> Client:
        server.start()
        return Client("http", server.url)

    try:
        # (one cut: caught there; the tokens handed out again are shown by the library runs)
        result = run_cycles(
            powerloss, db, start, 1, seed=4, stop=server.kill, max_acks=SERVE_MAX_ACKS
        )
    finally:
        server.kill()
    _report(f"fenced serve, planted, {mode}", result)
    assert result.lost, result
