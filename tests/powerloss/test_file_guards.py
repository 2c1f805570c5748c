"""The file guards through power cuts: no acknowledged guarded write lost, no high-water mark
gone backwards (so a stale writer is still refused after the cut, and the rightful one still
accepted). The token source is the SQLite source on the same power-loss filesystem.
"""

from __future__ import annotations

import os

import pytest

import fenced
from fenced.guards.files import FileGuard, HighWaterFile
from fenced.testing.powerloss import PowerLossMount
from tests.powerloss.history import CYCLE_MARKS, CYCLES, Client, Result, run_cycles

pytestmark = CYCLE_MARKS


def _both_sides(guard: FileGuard, mark: HighWaterFile, name: str, high: int) -> None:
    """After a cut: the token below the acknowledged one refused, the next one accepted."""
    if high > 1:
        with pytest.raises(fenced.StaleTokenError):
            guard.write(name, b"stale", token=f"{guard.lock}:{high - 1}")
        with pytest.raises(fenced.StaleTokenError), mark.hold(token=f"{mark.lock}:{high - 1}"):
            pass
    guard.write(name, b"rightful", token=f"{guard.lock}:{high + 1}")
    with mark.hold(token=f"{mark.lock}:{high + 1}"):
        pass


def test_a_new_guard_directory_survives_the_cut(powerloss: PowerLossMount) -> None:
    """The guard makes its directory (and parents): their names must be durable too."""
    root = powerloss.mountpoint
    guard = FileGuard(root / "a" / "guard", lock="g")
    guard.write("report", b"v5", token="g:5")  # acknowledged: durable from here
    HighWaterFile(root / "a" / "mark", lock="g").check_and_advance(token="g:5")
    powerloss.power_loss()
    again = FileGuard(root / "a" / "guard", lock="g")
    assert again.read("report") == (fenced.FencingToken("g", 5), b"v5")
    _both_sides(again, HighWaterFile(root / "a" / "mark", lock="g"), "report", 5)


def test_a_resource_directory_left_by_a_crashed_writer_is_made_durable(
    powerloss: PowerLossMount,
) -> None:
    """A writer that died between mkdir and its directory fsync left the resource directory
    behind, not durable; the next writer finds it existing and must still make it durable."""
    root = powerloss.mountpoint
    guard = FileGuard(root / "guard", lock="g")
    (root / "guard" / "report").mkdir()  # (what the crashed writer left)
    guard.write("report", b"v7", token="g:7")
    powerloss.power_loss()
    again = FileGuard(root / "guard", lock="g")
    assert again.read("report") == (fenced.FencingToken("g", 7), b"v7")


def test_guarded_writes_under_load_survive_cuts(powerloss: PowerLossMount) -> None:
    root = powerloss.mountpoint
    db = root / "locks.db"
    url = f"sqlite:///{db}"
    fenced.connect(url).close()
    result = Result()
    history: dict[str, list[int]] = {}

    def check(cycle: int) -> None:
        for name, tokens in history.items():
            version = FileGuard(root / "guarded" / name, lock=name).latest("data")
            mark = HighWaterFile(root / "marks" / name, lock=name).current()
            if version is None or version.token.value < tokens[-1]:
                result.lost.append(
                    f"cycle {cycle}: {name} write {tokens[-1]} acked, newest {version}"
                )
            if mark is None or mark.value < tokens[-1]:
                result.lost.append(f"cycle {cycle}: {name} mark {tokens[-1]} acked, now {mark}")

    run_cycles(
        powerloss,
        db,
        lambda: Client("files", url, str(root / "guarded"), str(root / "marks")),
        CYCLES,
        acks_before_cut=lambda cycle: 40 + 30 * cycle,
        check=check,
        history=history,
        result=result,
    )
    print(
        f"\nfile guards: {result.cycles} cuts, {result.acks} acknowledged guarded writes, "
        f"{result.writes} writes, {result.fsyncs} fsyncs; lost {len(result.lost)}"
    )
    assert (result.lost, result.reused, result.corrupt) == ([], [], [])
    # Both sides, after the last cut, on one lock the load used.
    name = next(iter(history))
    high = max(history[name])
    guard = FileGuard(root / "guarded" / name, lock=name)
    _both_sides(guard, HighWaterFile(root / "marks" / name, lock=name), "data", high)


def test_a_planted_writer_without_directory_fsync_is_caught(
    powerloss: PowerLossMount, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The harness catches a guard that skips its directory fsync (the name never durable)."""
    import fenced.guards.files as files

    monkeypatch.setattr(files, "fsync_dir", lambda path: None)  # (the planted bug)
    root = powerloss.mountpoint
    (root / "guard").mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    guard = FileGuard(root / "guard", lock="g")
    guard.write("report", b"v5", token="g:5")
    powerloss.power_loss()
    assert FileGuard(root / "guard", lock="g").latest("report") is None  # lost: caught
