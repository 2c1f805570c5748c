"""Every planted fault of ``fenced check --plant`` is caught by at least one checker within a
bounded run of real worker processes (6 faults of each kind, and 6 more under a second seed if
the first schedule missed its window; a run ends early once every fault has struck and a
violation that nothing later takes back shows), and the planted resource's hand-written fence, with no
plant, runs clean under the same faults: what is caught is the plant, not the harness."""

from __future__ import annotations

from pathlib import Path

import pytest

from fenced.testing.check import PLANTS, read_history, run_campaign
from fenced.testing.check._plants import plant_role

# The faults that open each plant's window, and the checkers expected to see it.
NEMESIS = {
    "lease-overestimated": ["pause", "kill"],  # a lease that ends by expiry, not release
    "unfenced-release": ["stall", "pause"],  # a holder that wakes up late and releases
    "token-in-memory": ["restart", "stall"],
    "counter-not-fsynced": ["restart", "stall"],
    "signature-skipped": ["forge", "stall"],
    "key-id-ignored": ["forge", "stall"],
    "source-ignored": ["forge", "stall"],
    "lock-ignored": ["impostor", "stall"],
    "tokenless-ok": ["impostor", "stall"],
}
EXPECTED = {
    "no-fence": {"lost update", "acceptance order", "acknowledged write"},
    "unfenced-read": {"lost update", "acknowledged write"},
    "off-by-one": {"lost update", "acceptance order", "acknowledged write"},
    "check-then-write": {"lost update", "acceptance order", "acknowledged write"},
    "mark-in-memory": {"lost update", "acceptance order", "acknowledged write"},
    "mark-not-raised": {"mark", "lost update", "acceptance order", "acknowledged write"},
    "write-then-check": {"refused write", "lost update", "acknowledged write"},
    "hidden-check-then-write": {"lost update", "acceptance order", "acknowledged write"},
    "signature-skipped": {"forged token"},
    "key-id-ignored": {"forged token"},
    "source-ignored": {"forged token"},
    "lock-ignored": {"impostor accepted"},
    "tokenless-ok": {"impostor accepted"},
    "lease-overestimated": {"overlap"},
    "unfenced-release": {"overlap"},
    "token-in-memory": {"token reuse"},
    "counter-not-fsynced": {"token reuse"},
}


def test_every_plant_says_which_checkers_should_see_it() -> None:
    assert set(EXPECTED) == set(PLANTS) and len(PLANTS) >= 10


@pytest.mark.parametrize("plant", list(PLANTS))
def test_the_plant_is_caught(plant: str, tmp_path: Path) -> None:
    """Within 6 faults of each kind; a fault schedule may miss the window, so a second seed gets
    6 more (a bounded run either way: a plant caught in neither fails the test). Counts, not
    seconds: a loaded machine deals as many faults as a quiet one, only slower."""
    for seed in (1, 2):
        source = None if plant_role(plant) == "source" else f"sqlite:///{tmp_path}/locks{seed}.db"
        result = run_campaign(
            source,
            tmp_path / f"r{seed}",
            seconds=90,
            faults=6,
            ttl=0.5,
            nemesis=NEMESIS.get(plant, ["stall"]),
            seed=seed,
            plant=plant,
            stop_at_first=True,  # (the verdict is still the whole run's: the checkers at the end)
        )
        found = {v.checker for v in result.violations} - {"plant not exercised"}
        # (a run that ended early, "run incomplete" on a loaded machine, gets the next seed)
        if found & EXPECTED[plant]:
            break
    assert found, f"{plant} was not caught ({result.grants} grants, {result.accepted} accepted)"
    assert found & EXPECTED[plant], [str(v) for v in result.violations]  # (also: what follows)
    assert result.first_violation_after is not None


def test_a_run_stopped_at_its_first_violation_ends_early_with_the_whole_verdict(
    tmp_path: Path,
) -> None:
    """``stop_at_first``: the run ends once every fault has struck and a violation shows that
    nothing later takes back, well before its seconds; the checkers that need the resource's
    final state still run (acceptance order, acknowledged writes)."""
    for seed in (1, 2):
        result = run_campaign(
            f"sqlite:///{tmp_path}/locks{seed}.db",
            tmp_path / f"r{seed}",
            seconds=60,
            ttl=0.5,
            nemesis=["stall"],
            seed=seed,
            plant="no-fence",
            stop_at_first=True,
        )
        if result.violations:
            break
    found = {v.checker for v in result.violations}
    assert result.seconds < 40, result.seconds  # (caught in 1-5 s: not the 60 s asked for)
    assert found & {"acceptance order", "acknowledged write"}, found  # (final-state checkers)
    assert read_history(result.history)[-1]["op"] == "final"


def test_the_planted_resource_without_a_plant_holds_every_invariant(tmp_path: Path) -> None:
    db = tmp_path / "register.db"
    result = run_campaign(
        f"sqlite:///{tmp_path}/locks.db",
        tmp_path / "r",
        resource=f"planted+sqlite://{db}?plant=",
        seconds=90,
        faults=1,
        writes=20,
        ttl=0.5,
        nemesis=["stall", "pause", "kill", "forge", "impostor"],
        seed=1,
        signing=True,
    )
    assert result.ok, [str(v) for v in result.violations]
    assert result.refused >= 1  # the late writers were there, and turned away
    forged = [e for e in read_history(result.history) if e.get("forged")]
    assert forged and not any(e["ok"] for e in forged)  # forged tokens: refused too
    assert any(e.get("impostor") for e in forged)  # (and another lock's, and none)


def test_a_plant_turns_on_the_fault_that_shows_it(tmp_path: Path) -> None:
    """``--plant signature-skipped`` with only stalls asked for: the run turns on signing and
    the forge nemesis itself (it used to pass silently, exit 0, without ``--nemesis forge``)."""
    result = run_campaign(
        f"sqlite:///{tmp_path}/locks.db",
        tmp_path / "r",
        seconds=90,
        faults=1,
        ttl=0.5,
        nemesis=["stall"],
        seed=1,
        plant="signature-skipped",
        stop_at_first=True,
    )
    assert result.faults.get("forge", 0) >= 1, result.faults
    assert "forged token" in {v.checker for v in result.violations}


def test_a_plant_the_run_never_exercised_does_not_pass(tmp_path: Path) -> None:
    """A run too short for the one fault that shows the plant proves nothing: a violation."""
    result = run_campaign(
        f"sqlite:///{tmp_path}/locks.db",
        tmp_path / "r",
        seconds=0.01,
        ttl=0.5,
        seed=1,
        plant="key-id-ignored",
    )
    assert not result.ok
    assert "plant not exercised" in {v.checker for v in result.violations}


def test_a_campaign_with_no_source_uses_its_own_not_the_machines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``--source``: the campaign's grants go to a private source of its own (tokens from
    1), never to the machine-wide default every local user shares."""
    machine = tmp_path / "machine"
    monkeypatch.delenv("FENCED_URL", raising=False)
    monkeypatch.setenv("_FENCED_MACHINE_DIR", str(machine))
    result = run_campaign(
        None, tmp_path / "r", seconds=90, writes=3, workers=2, ttl=0.5, nemesis=[], seed=1
    )
    assert result.ok and result.grants >= 2, [str(v) for v in result.violations]
    assert not machine.exists()
    grants = [e["token"] for e in read_history(result.history) if e["op"] == "grant"]
    assert min(grants) == 1


def test_signing_turns_on_forged_tokens_by_default(tmp_path: Path) -> None:
    """``signing`` with no nemesis asked for: the default faults include ``forge``, so a
    resource that never verifies a signature (here the planted register's
    ``signature-skipped``, given as the user's resource) is caught, not passed."""
    db = tmp_path / "register.db"
    result = run_campaign(
        f"sqlite:///{tmp_path}/locks.db",
        tmp_path / "r",
        resource=f"planted+sqlite://{db}?plant=signature-skipped",
        seconds=90,
        faults=1,
        ttl=0.5,
        seed=1,
        signing=True,
        stop_at_first=True,
    )
    assert result.faults.get("forge", 0) >= 1, result.faults
    assert "forged token" in {v.checker for v in result.violations}, result.violations
