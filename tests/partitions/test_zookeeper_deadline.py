"""acquire(timeout=) on ZooKeeper keeps its deadline when the server its waiter talks to is
cut off just before it: the timed-out waiter's node is deleted in the background, not awaited
through the cut-off server (found by the partition campaigns: up to 0.71 s past a 3 s
timeout, bounded only by kazoo noticing the dead connection). The etcd twin is
test_etcd_deadline.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fenced.testing.netclusters import ZK_CLIENT, ZooKeeperNetCluster, _ask
from fenced.testing.netns import NetLab
from tests.partitions.deadline import TIMEOUT, time_to_give_up
from tests.partitions.netlab import MARKS

pytestmark = MARKS


@pytest.fixture
def cluster() -> Iterator[tuple[NetLab, ZooKeeperNetCluster]]:
    with NetLab("zd") as lab, ZooKeeperNetCluster(lab) as cluster:
        yield lab, cluster


def _ephemerals(lab: NetLab, cluster: ZooKeeperNetCluster) -> int:
    node = cluster.nodes[2]
    out = lab.call(node, lambda: _ask(node.addr, ZK_CLIENT, b"mntr"), timeout=3).decode()
    for line in out.splitlines():
        if line.startswith("zk_ephemerals_count"):
            return int(line.split()[-1])
    return 0


def test_timeout_is_kept_when_the_servers_link_is_cut(
    cluster: tuple[NetLab, ZooKeeperNetCluster],
) -> None:
    lab, zk = cluster
    first = zk.nodes[0]
    elapsed = time_to_give_up(
        lab,
        holder_url=zk.url,
        waiter_url=f"zookeeper://{first.addr}:{ZK_CLIENT}",  # the waiter talks to it alone
        cut_from=first,
        queued=lambda: _ephemerals(lab, zk) >= 2,
        ttl=4,
        # BackendUnavailable: kazoo noticed the cut before the deadline (fine, in time)
        gives_up_with=("LockTimeout", "BackendUnavailable"),
    )
    assert elapsed < TIMEOUT + 0.5, f"acquire(timeout={TIMEOUT}) gave up after {elapsed:.2f} s"
