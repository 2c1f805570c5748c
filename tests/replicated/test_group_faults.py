"""A replicated group under faults, with real servers and real processes: seeded campaigns
(writers and readers as OS processes; the nemesis SIGSTOPs writers past their ttl, kill -9s
and restarts replicas, partitions replicas through a TCP proxy, reconfigures while writes are
in flight) must keep every invariant; and the planted protocol bugs that need processes and
pauses to show are caught by the same checkers.

``FENCED_GROUP_SECONDS`` and ``FENCED_GROUP_SEEDS`` make the randomized runs longer and more
numerous (CI runs one seed per setup, until each nemesis struck once and the counts the checks
need are reached, bounded by 60 s).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

import fenced
from fenced.testing.check import GroupRun, read_history, run_group_campaign
from fenced.testing.check._group_campaign import GroupCluster, Workers, final_state, operator
from fenced.testing.check._group_checkers import check_group
from tests.helpers import wait_for

# CI's runs are measured in faults: each campaign ends once every nemesis struck FAULTS_EACH
# times (about 8 s; a bound of BOUND s, which ending first fails the run). A long run
# (``FENCED_GROUP_SECONDS``) is measured in seconds instead.
LONG_SECONDS = float(os.environ.get("FENCED_GROUP_SECONDS", "0"))
FAULTS_EACH = 0 if LONG_SECONDS else int(os.environ.get("FENCED_GROUP_FAULTS", "1"))
BOUND = LONG_SECONDS or 60.0
# What _assert_clean asserts, which a run measured in faults also waits for.
AT_LEAST = {"acknowledged writes": 20, "reads": 20, "refused changes": 1}
SEEDS = [int(s) for s in os.environ.get("FENCED_GROUP_SEEDS", "11").split(",")]

pytestmark = pytest.mark.xdist_group("replicated-faults")


def _assert_clean(run: Any, out: Path) -> None:
    assert run.ok, "\n".join(str(v) for v in run.violations[:10]) + f"\n(history in {out})"
    assert run.counts["acknowledged writes"] >= AT_LEAST["acknowledged writes"], run.counts
    assert run.counts["reads"] >= AT_LEAST["reads"], run.counts
    # stale writers were there, refused:
    assert run.counts["refused changes"] >= AT_LEAST["refused changes"], run.counts


def _counted(tmp_path: Path, **kwargs: Any) -> GroupRun:
    """A group campaign measured in faults and the operations the asserts need, BOUND s at most."""
    return run_group_campaign(
        tmp_path, seconds=BOUND, faults_each=FAULTS_EACH, at_least=AT_LEAST, **kwargs
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_redis_replicas_with_etcd_keep_every_invariant_under_the_nemesis(
    tmp_path: Path, seed: int
) -> None:
    run = _counted(tmp_path, replicas=("redis",) * 3, source="etcd", seed=seed)
    _assert_clean(run, tmp_path)
    assert all(n >= 1 for n in run.faults.values()), run.faults
    assert run.counts["configurations"] >= 3, run.counts  # members left and came back


@pytest.mark.parametrize("seed", SEEDS)
def test_postgresql_replicas_with_zookeeper_keep_every_invariant_under_the_nemesis(
    tmp_path: Path, seed: int
) -> None:
    run = _counted(
        tmp_path, replicas=("postgresql",) * 3, source="zookeeper", seed=seed,
        nemesis=("pause", "partition", "reconfigure"),
    )  # fmt: skip
    _assert_clean(run, tmp_path)


def test_mixed_members_keep_every_invariant_under_the_nemesis(tmp_path: Path) -> None:
    run = _counted(
        tmp_path, replicas=("redis", "postgresql", "etcd", "sqlite"), source="sqlite",
        seed=SEEDS[0],
    )  # fmt: skip
    _assert_clean(run, tmp_path)


def _stopped_at(out: Path, proc: str, point: str) -> bool:
    path = out / "history.jsonl"
    if not path.exists():
        return False
    return any(
        e["op"] == "stopped" and e["worker"] == proc and e["at"] == point
        for e in read_history(path)
    )


def _is_stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-no-fence-on-takeover"])
def test_a_paused_writer_cannot_slip_a_write_in_after_a_takeover(
    tmp_path: Path, planted: bool
) -> None:
    """DDIA's scenario on a group: writer 1 reads the counter and is paused past its lease;
    writer 2 takes over, reads the same counter and pauses before writing; writer 1 wakes and
    writes. Fenced on takeover, writer 1 is refused everywhere; without it, its write is
    acknowledged, and writer 2 then writes the same count: a lost update."""
    plant = "no-fence-on-takeover" if planted else None
    with GroupCluster(("redis",) * 3, "etcd") as cluster:
        base = {"ttl": 1.0, "seed": 1, "plant": plant, "ops": 1, "timeout": 2.0, "rounds": 1}
        workers = Workers(tmp_path, cluster, base)
        try:
            w1 = workers.spawn("w1", "writer", stop_at=["after_read"])
            wait_for(lambda: _stopped_at(tmp_path, "w1", "after_read") and _is_stopped(w1.pid),
                     what="writer 1 to stop after its read", timeout=30)  # fmt: skip
            w2 = workers.spawn("w2", "writer", stop_at=["after_read"])
            wait_for(lambda: _stopped_at(tmp_path, "w2", "after_read") and _is_stopped(w2.pid),
                     what="writer 2 to take over and read", timeout=30)  # fmt: skip
            os.kill(w1.pid, signal.SIGCONT)
            assert w1.wait(30) == 0
            os.kill(w2.pid, signal.SIGCONT)
            assert w2.wait(30) == 0
        finally:
            workers.stop()
        final_state(cluster, tmp_path)
    history = read_history(tmp_path)
    found = check_group(history)
    if planted:
        assert any(v.checker == "lost update" for v in found), found
    else:
        assert not found, found
        refused = [e for e in history if e["op"] == "apply" and e["ok"] == "stale token"]
        assert refused and all(e["worker"] == "w1" for e in refused)


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-ack-before-all"])
def test_an_acknowledged_write_survives_losing_any_member(tmp_path: Path, planted: bool) -> None:
    """A write is acknowledged; then the first member's server is killed and the member
    removed. Written to every member before the acknowledgement, the write is still there;
    acknowledged after one member took it, it is gone."""
    plant = "ack-before-all" if planted else None
    with GroupCluster(("redis",) * 3, "etcd") as cluster:
        base = {"ttl": 5.0, "seed": 1, "plant": plant, "ops": 2, "timeout": 2.0, "rounds": 1}
        workers = Workers(tmp_path, cluster, base)
        try:
            w1 = workers.spawn("w1", "writer")
            assert w1.wait(60) == 0
        finally:
            workers.stop()
        first = cluster.replicas["a"]
        assert first.server is not None
        first.server.kill()
        with operator(cluster) as op:
            op.remove("a")
            workers.stop_file.unlink()  # (the writer's round is over; the reader's begins)
            r1 = workers.spawn("r1", "reader")
            wait_for(lambda: _reads(tmp_path, "r1") >= 3, what="reads", timeout=30)
            workers.stop()
        first.server.start()
        final_state(cluster, tmp_path)
        del r1
    found = check_group(read_history(tmp_path))
    if planted:
        assert {"acknowledged writes", "linearizable"} <= {v.checker for v in found}, found
    else:
        assert not found, found


def _reads(out: Path, proc: str) -> int:
    if not (out / "history.jsonl").exists():
        return 0
    history = read_history(out)
    return sum(1 for e in history if e["worker"] == proc and e.get("kind") == "read")


def test_the_campaign_refuses_an_unknown_nemesis(tmp_path: Path) -> None:
    with pytest.raises(fenced.ConfigurationError, match="unknown nemesis"):
        run_group_campaign(tmp_path, nemesis=("meteor",))
    assert not list(tmp_path.iterdir())  # (refused before anything started or was written)
