"""acquire(timeout=) on etcd keeps its deadline when the member it talks to is cut off just
before it: the waiter leaves the queue without making its caller wait for the cut-off member.

Found by the partition campaigns: LockTimeouts of acquire(timeout=3) came back after up to
8.2 s (p90 5.9 s), the leave being awaited through a member that no longer answered (up to
the 2 s request timeout, then the next member, bounded only by ``retry_for``, 5 s).
"""

from __future__ import annotations

import base64
import json
import urllib.request
from collections.abc import Iterator

import pytest

from fenced.testing.netclusters import ETCD_CLIENT, EtcdNetCluster
from fenced.testing.netns import NetLab
from tests.partitions.deadline import TIMEOUT, time_to_give_up
from tests.partitions.netlab import MARKS

pytestmark = MARKS


@pytest.fixture
def cluster() -> Iterator[tuple[NetLab, EtcdNetCluster]]:
    with NetLab("dl") as lab, EtcdNetCluster(lab) as cluster:
        yield lab, cluster


def _keys(lab: NetLab, cluster: EtcdNetCluster) -> int:
    node = cluster.nodes[2]
    body = json.dumps({"key": base64.b64encode(b"\0").decode(), "range_end": "AA==",
                       "count_only": True}).encode()  # fmt: skip

    def ask() -> int:
        req = urllib.request.Request(f"http://{node.addr}:{ETCD_CLIENT}/v3/kv/range", body)
        with urllib.request.urlopen(req, timeout=2) as r:
            return int(json.loads(r.read()).get("count", 0))

    return lab.call(node, ask)


def test_timeout_is_kept_when_the_members_link_is_cut(
    cluster: tuple[NetLab, EtcdNetCluster],
) -> None:
    lab, etcd = cluster
    elapsed = time_to_give_up(
        lab,
        holder_url=etcd.url,
        waiter_url=etcd.url,
        cut_from=etcd.nodes[0],  # the member a client talks to first
        queued=lambda: _keys(lab, etcd) >= 2,  # (the holder's key and the waiter's)
        ttl=30,
    )
    assert elapsed < TIMEOUT + 0.75, f"acquire(timeout={TIMEOUT}) gave up after {elapsed:.2f} s"
