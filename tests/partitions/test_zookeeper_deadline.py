"""acquire(timeout=) on ZooKeeper keeps its deadline when the server its waiter talks to is
cut off just before it: the timed-out waiter's node is deleted in the background, not awaited
through the cut-off server (found by the partition campaigns: up to 0.71 s past a 3 s
timeout, bounded only by kazoo noticing the dead connection). The etcd twin is
test_etcd_deadline.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from fenced.testing import netns
from fenced.testing.netclusters import ZK_CLIENT, ZooKeeperNetCluster, _ask
from fenced.testing.netns import NetLab
from fenced.testing.partitions import _python_env
from tests.helpers import wait_for

REASON = netns.unavailable()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
    pytest.mark.xdist_group("netns"),
]
TIMEOUT = 2.0

CLIENT = """
import asyncio, sys, time, fenced
async def main():
    async with fenced.connect_async(sys.argv[1]) as locks:
        lease = locks.lock("d", ttl=4)
        if sys.argv[2] == "hold":
            await lease.acquire()
            print("held", flush=True)
            await asyncio.sleep(60)
            return
        print("waiting", flush=True)
        start = time.monotonic()
        try:
            await lease.acquire(timeout=float(sys.argv[3]))
        except (fenced.LockTimeout, fenced.BackendUnavailable) as exc:
            # BackendUnavailable: kazoo noticed the cut before the deadline (fine, in time)
            print(f"timeout {time.monotonic() - start:.3f} {type(exc).__name__}", flush=True)
asyncio.run(main())
"""


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
    holder = lab.run(lab.add("c1"), [sys.executable, "-c", CLIENT, zk.url, "hold"],
                     stdout=subprocess.PIPE, env=_python_env())  # fmt: skip
    assert holder.proc.stdout is not None and holder.proc.stdout.readline() == b"held\n"
    lab.add("c2")
    only_first = f"zookeeper://{first.addr}:{ZK_CLIENT}"  # the waiter talks to it alone
    waiter = lab.run("c2", [sys.executable, "-c", CLIENT, only_first, "wait", str(TIMEOUT)],
                     stdout=subprocess.PIPE, env=_python_env())  # fmt: skip
    assert waiter.proc.stdout is not None and waiter.proc.stdout.readline() == b"waiting\n"
    wait_for(lambda: _ephemerals(lab, zk) >= 2, 10, "the waiter's node in the queue")
    lab.partition(["c2"], [first.name])  # its server goes silent before its deadline
    line = waiter.proc.stdout.readline().decode()
    assert line.startswith("timeout "), line
    elapsed = float(line.split()[1])
    assert elapsed < TIMEOUT + 0.5, f"acquire(timeout={TIMEOUT}) gave up after {elapsed:.2f} s"
