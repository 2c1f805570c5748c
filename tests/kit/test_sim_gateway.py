"""``fenced sim --system gateway``: ``fenced serve``'s real grant bookkeeping (``Gateway``) in
two or three gateways sharing one simulated source, on virtual time. A seed replays byte for
byte; 200 seeds hold every invariant in CI (a tenth of FENCED_SIM_SEEDS: 1,000 and more in
``make test-long``); each planted gateway bug is found by the checker
that names it, within 200 seeds, and the same seed without the plant holds; the CLI takes
``--workload gateway`` and its replay command fails again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fenced.testing.sim import Config, run_seeds, simulate
from fenced.testing.sim._gateways import GatewayRun
from tests.helpers import ROOT
from tests.kit.test_sim import GATEWAY_SEEDS, JOBS, OTHER_PARTS, part_of

GATEWAY = Config(seed=0, system="gateway")


def test_a_gateway_seed_replays_byte_for_byte() -> None:
    first = simulate(Config(seed=7, system="gateway"))
    assert first.ok, [str(v) for v in first.violations]
    assert first.trace_text() == simulate(Config(seed=7, system="gateway")).trace_text()
    ops = {e["op"] for e in first.trace}
    # the real Gateway noted its transitions; clients wrote; intruders tried; faults hit
    assert {"granted", "released", "expired", "grant", "write", "intruded", "nemesis"} <= ops
    gateways = {e["worker"] for e in first.trace if e["op"] == "granted"} - {"source"}
    assert len(gateways) >= 2, gateways  # (grants made through more than one gateway)


@pytest.mark.parametrize("part", range(OTHER_PARTS))
@pytest.mark.timeout(600)  # bounded work (a seed count), not a wait
def test_gateway_seeds_hold_every_invariant(part: int) -> None:
    """Gateways restarted, clocks jumping, requests lost, repeated and reordered, another
    tenant's request ids: no retry makes a second grant, no key moves another's grant, every
    expiry is counted once by the gateway that last had the grant, the resource's guard holds."""
    first, count = part_of(GATEWAY_SEEDS, OTHER_PARTS, part)
    result = run_seeds(GATEWAY, first, count, jobs=JOBS)
    assert result.seeds == count and result.failed == [], result.failed[:10]


@pytest.mark.parametrize(
    ("plant", "checker"),
    [
        ("gw-release-any-key", "foreign-request"),
        ("gw-retry-new-grant", "retry-new-grant"),
        ("gw-expiry-recounted", "expiry-count"),
        ("gw-late-duplicate-granted", "retry-new-grant"),
    ],
)
def test_each_gateway_plant_is_named_by_its_checker(plant: str, checker: str) -> None:
    planted = Config(seed=0, system="gateway", plant=plant)
    result = run_seeds(planted, 500, 200, jobs=1, stop_at_first=True)
    assert result.failed, f"{plant} survived {result.seeds} seeds"
    seed = result.failed[0]
    found = simulate(Config(seed=seed, system="gateway", plant=plant))
    assert checker in {v.checker for v in found.violations}, [str(v) for v in found.violations]
    assert simulate(Config(seed=seed, system="gateway")).ok


def test_the_gateway_checkers_can_fail() -> None:
    """Each of the gateway's own checkers, fed what a bug would do, names it."""
    outcome = simulate(Config(seed=7, system="gateway"))
    assert outcome.ok
    # (a run's checkers again, on its noted transitions with one expiry counted twice)
    from fenced.testing.sim import _gateways

    run = object.__new__(GatewayRun)
    run.noted = [("g1", "expired", "orders", 3, 1.0), ("g1", "expired", "orders", 3, 2.0)]
    run.noted += [("g2", "released", "stock", 4, 1.0), ("g2", "expired", "stock", 4, 2.0)]
    run.w = type("W", (), {"trace": [], "cfg": Config(seed=0)})()
    run.source = type("S", (), {"ended": {("stock", 9): ("expired", 1.0, "")}})()
    run.noted += [("g3", "granted", "stock", 9, 0.0)]
    run.gateways = [type("G", (), {"name": n})() for n in ("g1", "g2", "g3")]
    run.stopped = 10.0
    messages = [str(v) for v in _gateways.GatewayRun._expiries(run)]
    assert messages == [
        "expiry-count: g1 counted orders:3's expiry 2 times",
        "expiry-count: g2 counted stock:4 as expired, a grant it released",
        "expiry-count: stock:9 expired, and g3, which made or last renewed it, never counted it",
    ]


def test_the_cli_runs_the_gateway_workload_and_replays_a_planted_bug() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    run = [sys.executable, "-m", "fenced.cli", "sim", "--jobs", "1"]
    clean = subprocess.run(
        [*run, "--workload", "gateway", "--seeds", "10"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert clean.returncode == 0 and "every invariant held" in clean.stdout, clean.stderr
    out = subprocess.run(
        [*run, "--seeds", "50", "--plant", "gw-release-any-key"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 65, out.stdout + out.stderr
    assert "VIOLATION foreign-request" in out.stdout
    assert "fenced.server" not in out.stderr  # (the gateways' log lines stay quiet)
    replay = next(line for line in out.stdout.splitlines() if line.startswith("replay: "))
    assert "--system gateway" in replay and "--plant gw-release-any-key" in replay
    again = subprocess.run(
        [sys.executable, "-m", "fenced.cli", *replay.removeprefix("replay: fenced ").split()],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert again.returncode == 65 and "VIOLATION foreign-request" in again.stdout


def test_a_gateway_that_raises_is_a_violation(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the HTTP layer would answer with a 500 (an exception no route expects) is a
    violation of the seed, not a request that silently went unanswered."""
    from fenced.server._gateway import Gateway

    async def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("planted")

    monkeypatch.setattr(Gateway, "release_for", boom)
    outcome = simulate(Config(seed=3, system="gateway"))
    errors = [v for v in outcome.violations if v.checker == "error"]
    assert errors and "RuntimeError: planted" in str(errors[0]), outcome.violations
