"""Failover time: the leader is killed (kill -9: its supervisor and its service) → the
successor's service has started. ``fenced elect`` on each source, next to kazoo's
``Election`` on the same ZooKeeper and ``etcdctl elect`` on the same etcd, in one run.

    python bench/bench_failover.py [--runs 20] [--ttl 1] [--etcdctl-runs 2]

Each run uses a fresh election name. A fenced run also times a fence command (``true``)
separately, to show what share of a failover is fencing and what share is waiting for the
old lease to run out. kazoo's session timeout is set to the same ttl. etcdctl 3.4's ``elect``
has no ttl option: its session lasts 60 s, so it runs only a few times.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from fenced.testing import servers

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}

SERVICE = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(1e6)"

KAZOO = """
import os, sys, time
from kazoo.client import KazooClient
hosts, path, marker, timeout = sys.argv[1:5]
zk = KazooClient(hosts=hosts, timeout=float(timeout))
zk.start()
def lead():
    open(marker, "w").write(str(os.getpid()))
    time.sleep(1e6)
zk.Election(path, os.path.basename(marker)).run(lead)
"""


def _wait_file(path: Path, limit: float = 120.0) -> float:
    deadline = time.monotonic() + limit
    while not path.exists() or not path.read_text():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.002)
    return time.monotonic()


def _kill(proc: subprocess.Popen[bytes], marker: Path) -> None:
    for pid in (proc.pid, int(marker.read_text() or 0)):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass
    proc.wait()


def _one(start: Callable[[str, Path], subprocess.Popen[bytes]], tmp: Path, run: str) -> float:
    a_marker, b_marker = tmp / f"a-{run}", tmp / f"b-{run}"
    a = start("a", a_marker)
    _wait_file(a_marker)
    b = start("b", b_marker)
    time.sleep(0.5)  # (b is campaigning)
    killed = time.monotonic()
    _kill(a, a_marker)
    took = _wait_file(b_marker) - killed
    _kill(b, b_marker)
    return took


def fenced_elect(
    url: str, ttl: float, name: str, fence: str | None
) -> Callable[..., subprocess.Popen[bytes]]:
    def start(node: str, marker: Path) -> subprocess.Popen[bytes]:
        fence_args = ["--fence-cmd", fence] if fence else ["--no-fence"]
        return subprocess.Popen(
            [sys.executable, "-m", "fenced.cli", "elect", name, "--url", url, "--ttl", str(ttl),
             "--term-grace", str(ttl / 4), "--value", node, *fence_args, "--",
             sys.executable, "-c", SERVICE, str(marker)],
            env=ENV, start_new_session=True, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    return start


def kazoo_election(hosts: str, ttl: float, path: str) -> Callable[..., subprocess.Popen[bytes]]:
    def start(node: str, marker: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-c", KAZOO, hosts, path, str(marker), str(ttl)],
            env=ENV, start_new_session=True, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    return start


def etcdctl_elect(endpoint: str, name: str) -> Callable[..., subprocess.Popen[bytes]]:
    def start(node: str, marker: Path) -> subprocess.Popen[bytes]:
        # etcdctl prints the key when elected; a shell writes the marker then.
        script = (
            f"ETCDCTL_API=3 etcdctl --endpoints {endpoint} elect {name} {node} | "
            f"(read line; echo $$ > {marker}; cat > /dev/null)"
        )
        return subprocess.Popen(["sh", "-c", script], start_new_session=True)

    return start


def _summary(label: str, times: list[float]) -> str:
    times = sorted(times)
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    return (
        f"{label:34} n={len(times):3}  p50 {statistics.median(times):6.2f} s  "
        f"p99 {p99:6.2f} s  min {times[0]:5.2f}  max {times[-1]:5.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--ttl", type=float, default=1.0)
    ap.add_argument("--etcdctl-runs", type=int, default=2)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    with servers.RedisServer() as r, servers.EtcdServer() as e, servers.PostgresServer() as pg, \
            servers.ZooKeeperServer() as zk:  # fmt: skip
        for s in (r, e, pg, zk):
            s.start()
        sources = {
            "sqlite": f"sqlite:///{tmp}/locks.db",
            "redis": r.url,
            "postgresql": pg.url,
            "etcd": e.url,
            "zookeeper": zk.url,
        }
        t = time.monotonic()
        done = subprocess.run(["sh", "-c", "true"], check=True)
        fence_cost = time.monotonic() - t
        print(f"ttl {args.ttl} s; a fence command `true` takes {fence_cost * 1000:.1f} ms\n")
        for name, url in sources.items():
            times = [
                _one(fenced_elect(url, args.ttl, f"f{name}{i}", "true"), tmp, f"{name}{i}")
                for i in range(args.runs)
            ]
            print(_summary(f"fenced elect on {name}", times), flush=True)
        times = [
            _one(kazoo_election(zk.hosts, args.ttl, f"/kazoo-election-{i}"), tmp, f"kazoo{i}")
            for i in range(args.runs)
        ]
        print(_summary("kazoo Election on zookeeper", times), flush=True)
        if args.etcdctl_runs:
            times = [
                _one(etcdctl_elect(e.endpoint, f"etcdctl-e{i}"), tmp, f"etcdctl{i}")
                for i in range(args.etcdctl_runs)
            ]
            print(_summary("etcdctl elect on etcd (60 s session)", times), flush=True)
        del done


if __name__ == "__main__":
    main()
