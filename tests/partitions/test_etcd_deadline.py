"""acquire(timeout=) on etcd keeps its deadline when the member it talks to is cut off just
before it: the waiter leaves the queue without making its caller wait for the cut-off member.

Found by the partition campaigns: LockTimeouts of acquire(timeout=3) came back after up to
8.2 s (p90 5.9 s), the leave being awaited through a member that no longer answered (up to
the 2 s request timeout, then the next member, bounded only by ``retry_for``, 5 s).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest

from fenced.testing import netns
from fenced.testing.netclusters import ETCD_CLIENT, EtcdNetCluster
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
        lease = locks.lock("d", ttl=30)
        if sys.argv[2] == "hold":
            await lease.acquire()
            print("held", flush=True)
            await asyncio.sleep(60)
            return
        print("waiting", flush=True)
        start = time.monotonic()
        try:
            await lease.acquire(timeout=float(sys.argv[3]))
        except fenced.LockTimeout:
            print(f"timeout {time.monotonic() - start:.3f}", flush=True)
asyncio.run(main())
"""


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
    first = etcd.nodes[0]  # the member a client talks to first
    holder = lab.run(lab.add("c1"), [sys.executable, "-c", CLIENT, etcd.url, "hold"],
                     stdout=subprocess.PIPE, env=_python_env())  # fmt: skip
    assert holder.proc.stdout is not None and holder.proc.stdout.readline() == b"held\n"
    lab.add("c2")
    waiter = lab.run("c2", [sys.executable, "-c", CLIENT, etcd.url, "wait", str(TIMEOUT)],
                     stdout=subprocess.PIPE, env=_python_env())  # fmt: skip
    assert waiter.proc.stdout is not None and waiter.proc.stdout.readline() == b"waiting\n"
    wait_for(lambda: _keys(lab, etcd) >= 2, 10, "the waiter's key in the queue")
    lab.partition(["c2"], [first.name])  # its member goes silent before its deadline
    line = waiter.proc.stdout.readline().decode()
    assert line.startswith("timeout "), line
    elapsed = float(line.split()[1])
    assert elapsed < TIMEOUT + 0.75, f"acquire(timeout={TIMEOUT}) gave up after {elapsed:.2f} s"
