"""Partition campaigns around real 3-member etcd and ZooKeeper clusters, clients in their own
namespaces, writing through the SQL and Redis guards (fenced.testing.partitions); and the
same campaign with planted clients, which it must catch. Bounded: ~10 s of faults each.

``FENCED_PARTITION_RUNS=N`` (and ``FENCED_PARTITION_SECONDS``) runs the long version, whose
figures are in docs/verification-partitions.md (for ``fenced check`` in the lab too: its
gateway runs alternate between etcd and ZooKeeper).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fenced.testing.check import read_history
from fenced.testing.netclusters import EtcdNetCluster, ZooKeeperNetCluster
from fenced.testing.netns import NetLab
from fenced.testing.partitions import LOSS_SLACK, run_campaign, run_check
from tests.partitions.netlab import MARKS

pytestmark = MARKS
RUNS = int(os.environ.get("FENCED_PARTITION_RUNS", "1"))
SECONDS = float(os.environ.get("FENCED_PARTITION_SECONDS", "8"))
TTL = float(os.environ.get("FENCED_PARTITION_TTL", "1"))  # the long runs: 1.5
CHECK_SECONDS = float(os.environ.get("FENCED_PARTITION_SECONDS", "6"))  # fenced check's runs
# fenced check's own nemesis in the lab: wall clocks stepping, which stop no process. A kit
# pause (or stall) of the cut-off holder excuses its loss from the check (a stopped process
# learns nothing), and under load the one split of a 6 s run could leave no loss measured
# ("1 losses learnt holding ([] s late, unpaused)": the one was a paused worker's).
KIT_NEMESIS = "clock"


@pytest.fixture(scope="module")
def shared() -> Iterator[Callable[[str], tuple[Any, Any]]]:
    """One lab and cluster per source for the whole module, started on first use: each
    campaign in it heals its faults and names its nodes apart (``run_campaign(shared=)``),
    and saves a cluster's start."""
    with contextlib.ExitStack() as stack:
        made: dict[str, tuple[Any, Any]] = {}

        def get(source: str) -> tuple[Any, Any]:
            if source not in made:
                lab = stack.enter_context(NetLab(f"{source[:4]}mod"))
                kind = EtcdNetCluster if source == "etcd" else ZooKeeperNetCluster
                cluster = stack.enter_context(kind(lab))
                made[source] = (lab, cluster)
            return made[source]

        yield get


@pytest.mark.timeout(120 + RUNS * (SECONDS + 60))  # the long runs take their time
@pytest.mark.parametrize(
    ("source", "resource", "gateways"),
    [("etcd", "sql", True), ("zookeeper", "redis", False)],
    ids=["etcd-sql-via-fenced-serve", "zookeeper-redis"],
)
def test_campaign_keeps_every_invariant(
    source: str,
    resource: str,
    gateways: bool,
    tmp_path: Path,
    shared: Callable[[str], tuple[Any, Any]],
) -> None:
    """Clients in their own namespaces; with ``gateways``, through two ``fenced serve``
    gateways, the lock holder's on the minority side of each split with it."""
    for run in range(RUNS):
        camp = run_campaign(
            source, resource, duration=SECONDS, gateways=gateways, ttl=TTL,
            directory=str(tmp_path / f"{run}"), shared=shared(source),
        )  # fmt: skip
        print(camp.summary())
        assert not camp.violations, camp.summary() + "\n" + "\n".join(camp.violations[:20])
        counts = camp.counts()
        assert counts.get("grant", 0) >= 2 and counts.get("write-ok", 0) >= 10, camp.summary()
        kinds = {f["kind"] for f in camp.faults}
        assert {"isolate", "split", "pause", "flap"} <= kinds, camp.summary()


def test_planted_clients_are_caught(
    tmp_path: Path, shared: Callable[[str], tuple[Any, Any]]
) -> None:
    """Clients that ignore their lease's loss and write without the guard's check: the
    minority holder still believes past its remaining(), and its writes land after the new
    holder's."""
    camp = run_campaign(
        "etcd", "sql", duration=6, ttl=TTL, plant="ignore-loss,unguarded",
        nemeses=("split-minority-holder",), directory=str(tmp_path), shared=shared("etcd"),
    )  # fmt: skip
    print(camp.summary())
    found = "\n".join(camp.violations)
    assert "loss not learnt" in found, found
    assert "stale write accepted" in found, found


def _kit_faults(run: Any) -> set[str]:
    """The kinds of fault the kit's own nemesis dealt in ``run`` (the lab's are the
    ``network`` lane's)."""
    events = read_history(run.report / "history.jsonl")
    return {e["kind"] for e in events if e["op"] == "nemesis" and e["victim"] != "network"}


def _check_summary(run: Any) -> str:
    return (
        f"placement {run.placement}, splits cut off {run.split_clients}, {run.losses} losses "
        f"learnt holding ({run.checked_late} s late, unpaused), {run.losses_releasing} "
        "releasing, slowest release "
        f"{run.slowest_release:.2f} s, lab violations {run.violations}\n{run.output[-2000:]}"
    )


@pytest.mark.timeout(180 + RUNS * (CHECK_SECONDS + 60))
def test_fenced_check_runs_through_the_lab(
    tmp_path: Path, shared: Callable[[str], tuple[Any, Any]]
) -> None:
    """``fenced check`` in a namespace of its own against the etcd cluster, each of its
    workers in a namespace of its own: the lab's nemesis cuts the lock holder's namespace
    off with a minority member while the other workers stay on the majority side, isolates
    the leader, and the kit steps the workers' wall clocks; every kit invariant holds, and so does "a worker learns its lease is lost no
    later than its remaining() said" (checked on the kit's history). Its HTML report draws
    those partitions on its timeline."""
    for i in range(RUNS):
        run = run_check(
            "etcd", "sql", seconds=CHECK_SECONDS, ttl=TTL, directory=str(tmp_path / f"{i}"),
            think=2 * TTL, nemeses=("split-minority-holder", "isolate-leader"),
            kit_nemesis=KIT_NEMESIS, shared=shared("etcd"),
        )  # fmt: skip
        summary = _check_summary(run)
        print(summary)
        assert run.returncode == 0, summary
        assert "every invariant held" in run.output
        assert run.violations == [], summary
        # Really split: three workers in three namespaces, a split took one of them alone.
        assert len(set(run.placement.values())) == 3, summary
        assert any(len(side) == 1 for side in run.split_clients), summary
        # The cut-off holder, thinking 2 ttls, lost its lease while it held it: checked, in
        # time (nothing stopped it: KIT_NEMESIS).
        assert run.checked_late and max(run.checked_late) <= LOSS_SLACK, summary
        page = (run.report / "report.html").read_text()
        assert "net-split 2/1:" in page and "network</text>" in page, "partitions on the timeline"
        assert {f["kind"] for f in run.faults} >= {"split", "isolate"}
        assert KIT_NEMESIS in _kit_faults(run), summary  # (the kit's faults struck too)


@pytest.mark.timeout(180 + RUNS * (CHECK_SECONDS + 60))
def test_fenced_check_through_gateways_on_both_sides(
    tmp_path: Path, shared: Callable[[str], tuple[Any, Any]]
) -> None:
    """The same, the workers going through ``fenced serve`` gateways, one beside each worker
    (and the kit): each split puts the holder's gateway on the minority side with it and
    leaves the others' on the majority side."""
    for i in range(RUNS):
        d = tmp_path / f"{i}"
        source = "zookeeper" if i % 2 else "etcd"
        run = run_check(
            source, "sql", seconds=CHECK_SECONDS, ttl=TTL, directory=str(d), gateway=True,
            think=2 * TTL, nemeses=("split-minority-holder",), kit_nemesis=KIT_NEMESIS,
            shared=shared(source),
        )  # fmt: skip
        summary = _check_summary(run)
        print(summary)
        assert run.returncode == 0 and "every invariant held" in run.output, summary
        assert run.violations == [], summary
        assert any(len(side) == 1 for side in run.split_clients), summary
        assert run.checked_late and max(run.checked_late) <= LOSS_SLACK, summary
        assert KIT_NEMESIS in _kit_faults(run), summary
        gateway_log = d / f"{sorted(run.placement.values())[0]}.log"  # (w1<tag>'s)
        assert "fenced serve: listening on http://127.0.0.1:" in gateway_log.read_text()


@pytest.mark.timeout(180)
def test_fenced_check_planted_loss_ignored_is_caught(
    tmp_path: Path, shared: Callable[[str], tuple[Any, Any]]
) -> None:
    """Planted: workers that take no notice of their lease's loss and think for 3 ttls; cut
    off on the minority side, the holder writes believing it holds after its remaining()
    ran out: the lab's check of the kit's history reports it (the fence refuses the write,
    so the kit's own invariants hold)."""
    run = run_check(
        "etcd", "sql", seconds=6, ttl=TTL, directory=str(tmp_path), kit_nemesis="",
        lab_plant="ignore-loss", nemeses=("split-minority-holder",), shared=shared("etcd"),
    )  # fmt: skip
    summary = _check_summary(run)
    print(summary)
    assert any(v.startswith("loss not learnt") for v in run.violations), summary


def test_planted_zookeeper_follower_renewal_is_caught(
    tmp_path: Path, shared: Callable[[str], tuple[Any, Any]]
) -> None:
    """The old ZooKeeper renewal (one read, which a follower cut off with the holder answers
    alone until it notices the split): the holder's remaining() outlives its session at the
    leader, and the campaign reports the overlap as a violation (on the fixed renewal, the
    zookeeper campaign above has none)."""
    summaries = []
    # An overlap needs the holder's session at a follower and a waiter queued at another
    # member: the split waits for that moment (partitions._split_target), so one campaign
    # catches it; a second only for a run whose sessions never made that moment (all at one
    # member: the split then cuts the holder off as it is).
    for run in range(2):
        camp = run_campaign(
            "zookeeper", "sql", duration=8, ttl=TTL, plant="zk-follower-renew",
            nemeses=("split-minority-holder",), directory=str(tmp_path / f"{run}"),
            shared=shared("zookeeper"),
        )  # fmt: skip
        print(camp.summary())
        summaries.append(camp.summary())
        assert not camp.known, camp.known
        if any(v.startswith("lease overlap") for v in camp.violations):
            return
    pytest.fail("the old renewal was not caught in 2 runs:\n" + "\n".join(summaries))
