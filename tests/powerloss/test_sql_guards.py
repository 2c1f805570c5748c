"""SQLGuard and RowGuard on a user's SQLite database (WAL) through power cuts.

The guards put the mark in the user's own transaction, so it is exactly as durable as the
user's commit. ``synchronous=FULL``: nothing acknowledged is lost, no mark goes back.
``synchronous=NORMAL`` (a common setting in WAL mode): a commit is not fsynced, so a power
cut takes back the last commits, their marks *with* their data (never one without the
other), and a token refused before the cut can be accepted after it. Measured here; the
figures are in docs/verification.md.
"""

from __future__ import annotations

import sqlite3

import pytest

import fenced
from fenced.guards.sql import RowGuard, SQLGuard
from fenced.testing.powerloss import PowerLossMount
from tests.powerloss.history import CYCLE_MARKS, CYCLES, Client, Result, run_cycles
from tests.powerloss.workers import SQL_LOCKS, sql_setup

pytestmark = CYCLE_MARKS


def _cycles(powerloss: PowerLossMount, synchronous: str) -> tuple[Result, list[str]]:
    root = powerloss.mountpoint
    db, data = root / "locks.db", root / "app.db"
    url = f"sqlite:///{db}"
    fenced.connect(url).close()
    sql_setup(str(data))
    result, history = Result(), {}  # type: ignore[var-annotated]
    inconsistent: list[str] = []

    def check(cycle: int) -> None:  # (after the token source's own check: always FULL)
        conn = sqlite3.connect(data, isolation_level=None)
        try:
            if conn.execute("PRAGMA integrity_check").fetchone()[0] != "ok":
                result.corrupt.append(f"cycle {cycle}: app.db")
            for i in range(SQL_LOCKS):
                name = f"s{i}"
                acked = max(history.get(name, [0]))
                fence = SQLGuard(name).high_water(conn)
                row = RowGuard(name, lock=name).high_water(conn, {"id": 1})
                logged = conn.execute(
                    "SELECT max(token) FROM writes WHERE lock = ?", (name,)
                ).fetchone()[0]
                marks = {x.value if x is not None else 0 for x in (fence, row)} | {logged or 0}
                if len(marks) != 1:  # the marks and the data they fence, from one commit
                    inconsistent.append(
                        f"cycle {cycle}: {name} fence {fence} row {row} log {logged}"
                    )
                if min(marks) < acked:
                    result.lost.append(f"cycle {cycle}: {name} acked {acked}, kept {min(marks)}")
        finally:
            conn.close()

    run_cycles(
        powerloss,
        db,
        lambda: Client("sql", url, str(data), synchronous),
        CYCLES,
        acks_before_cut=lambda cycle: 40 + 30 * cycle,
        check=check,
        history=history,
        result=result,
    )
    print(
        f"\nSQL guards, synchronous={synchronous}: {result.cycles} cuts, {result.acks} "
        f"acknowledged guarded commits, {result.fsyncs} fsyncs; lost (mark back) "
        f"{len(result.lost)}: {result.lost[:4]}; inconsistent {len(inconsistent)}"
    )
    return result, inconsistent


def test_full_loses_no_acknowledged_write(powerloss: PowerLossMount) -> None:
    result, inconsistent = _cycles(powerloss, "FULL")
    assert (result.lost, result.reused, result.corrupt, inconsistent) == ([], [], [], [])


def test_normal_loses_the_last_commits_marks_and_data_together(powerloss: PowerLossMount) -> None:
    result, inconsistent = _cycles(powerloss, "NORMAL")
    assert result.lost  # (what NORMAL costs: acknowledged writes, and their marks, gone)
    assert (result.reused, result.corrupt, inconsistent) == ([], [], [])


def test_normal_accepts_a_token_refused_before_the_cut(powerloss: PowerLossMount) -> None:
    """The consequence, shown: under NORMAL a stale token refused before the cut is accepted
    after it (its mark went back with the data); under FULL it is still refused."""
    for synchronous in ("FULL", "NORMAL"):
        data = powerloss.mountpoint / f"{synchronous}.db"
        sql_setup(str(data))
        conn = sqlite3.connect(data, isolation_level=None)
        conn.execute(f"PRAGMA synchronous={synchronous}")
        for token in ("s0:5", "s0:7"):
            conn.execute("BEGIN IMMEDIATE")
            SQLGuard("s0").check(conn, token=token)
            conn.execute("COMMIT")
        conn.execute("BEGIN IMMEDIATE")
        with pytest.raises(fenced.StaleTokenError):
            SQLGuard("s0").check(conn, token="s0:6")
        conn.execute("ROLLBACK")
        powerloss.power_loss()
        conn.close()
        again = sqlite3.connect(data, isolation_level=None)
        try:
            again.execute("BEGIN IMMEDIATE")
            if synchronous == "FULL":
                with pytest.raises(fenced.StaleTokenError):
                    SQLGuard("s0").check(again, token="s0:6")
                SQLGuard("s0").check(again, token="s0:8")  # the rightful one: accepted
            else:
                SQLGuard("s0").check(again, token="s0:6")  # refused before the cut
            again.execute("ROLLBACK")
        finally:
            again.close()
