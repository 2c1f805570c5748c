"""Real clusters inside a :class:`~fenced.testing.netns.NetLab`: one member per namespace.

* :class:`EtcdNetCluster` — three etcd members (``e1``..), 50 ms heartbeats, 500 ms
  elections, as :class:`~fenced.testing.servers.EtcdCluster` on loopback;
* :class:`ZooKeeperNetCluster` — a three-member ZooKeeper ensemble (``z1``..), 200 ms ticks;
* :class:`RedisNet` — one Redis (AOF, ``appendfsync always``) as a guarded resource.

Members listen on their node's address only; readiness and leadership are asked over the
lab's network from a thread inside a node's namespace (:meth:`NetLab.call`), never by
sleeping. Every wait is bounded.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Final, Self

from fenced.testing.netns import NetLab, NetProcess, Node
from fenced.testing.servers import (
    ServerUnavailable,
    _zookeeper_classpath,
    wait_until,
    zookeeper_cds_args,
)

__all__ = ["EtcdNetCluster", "RedisNet", "ZooKeeperNetCluster"]

ETCD_CLIENT: Final = 2379
ETCD_PEER: Final = 2380
ZK_CLIENT: Final = 2181
REDIS_PORT: Final = 6379


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    # (a network namespace answers slower than loopback: a longer back-off; what a node
    # not up yet raises is a refused or timed-out connection, or a half-written answer)
    wait_until(
        check, timeout, what, interval=(0.05, 0.5), ignore=(OSError, TimeoutError, ValueError)
    )


def _ask(addr: str, port: int, probe: bytes, timeout: float = 1.0, *, once: bool = False) -> bytes:
    """Send ``probe``; read the answer to the server's close (or one chunk: ``once``)."""
    with socket.create_connection((addr, port), timeout=timeout) as s:
        s.sendall(probe)
        if once:
            return s.recv(4096)
        chunks: list[bytes] = []
        while len(chunks) < 64:  # bounded: a 4lw answer is a few hundred bytes
            chunk = s.recv(4096)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


class _Cluster:
    members: list[NetProcess]
    nodes: list[Node]
    what = "cluster"

    def __init__(self, lab: NetLab, size: int, prefix: str) -> None:
        self.lab = lab
        self.dir = Path(tempfile.mkdtemp(prefix=f"fenced-net-{prefix}-"))
        self.nodes = [lab.add(f"{prefix}{i + 1}") for i in range(size)]
        self.members = []

    def member(self, name: str) -> NetProcess:
        return next(m for m in self.members if m.node.name == name)

    def close(self) -> None:
        for m in self.members:
            m.resume()
            m.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def start(self, timeout: float = 30.0) -> Self:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def leader(self, timeout: float = 10.0) -> str:
        """The name of the node that leads now (asked of the members, bounded)."""
        found: list[str] = []

        def check() -> bool:
            found[:] = [n.name for n in self.nodes if self._leads(n)]
            return len(found) == 1

        _wait(check, timeout, f"a single {self.what} leader")
        return found[0]

    def _leads(self, node: Node) -> bool:
        raise NotImplementedError


class EtcdNetCluster(_Cluster):
    what = "etcd"

    def __init__(self, lab: NetLab, size: int = 3) -> None:
        super().__init__(lab, size, "e")
        self.binary = shutil.which("etcd")
        if self.binary is None:
            raise ServerUnavailable("etcd not found: install the Debian package 'etcd-server'")

    def start(self, timeout: float = 30.0) -> EtcdNetCluster:
        assert self.binary is not None
        initial = ",".join(f"{n.name}=http://{n.addr}:{ETCD_PEER}" for n in self.nodes)
        for n in self.nodes:
            client, peer = f"http://{n.addr}:{ETCD_CLIENT}", f"http://{n.addr}:{ETCD_PEER}"
            argv = [
                self.binary,
                "--name", n.name,
                "--data-dir", str(self.dir / n.name),
                "--listen-client-urls", client,
                "--advertise-client-urls", client,
                "--listen-peer-urls", peer,
                "--initial-advertise-peer-urls", peer,
                "--initial-cluster", initial,
                "--initial-cluster-token", f"fenced-net-{self.dir.name}",
                "--initial-cluster-state", "new",
                "--heartbeat-interval", "50",
                "--election-timeout", "500",
                "--logger", "zap",
                "--log-outputs", "stderr",
            ]  # fmt: skip
            self.members.append(self.lab.run(n, argv, log=self.dir / f"{n.name}.log"))
        for n in self.nodes:
            _wait(lambda n=n: self.lab.call(n, lambda: self._healthy(n)), timeout, n.name)  # type: ignore[misc]
        return self

    @staticmethod
    def _healthy(n: Node) -> bool:
        with urllib.request.urlopen(f"http://{n.addr}:{ETCD_CLIENT}/health", timeout=1) as r:
            return b'"health":"true"' in r.read().replace(b" ", b"")

    @staticmethod
    def _status(n: Node) -> dict[str, object]:
        req = urllib.request.Request(
            f"http://{n.addr}:{ETCD_CLIENT}/v3/maintenance/status", data=b"{}", method="POST"
        )
        with urllib.request.urlopen(req, timeout=1) as r:
            status: dict[str, object] = json.loads(r.read())
        return status

    def _leads(self, node: Node) -> bool:
        try:
            st = self.lab.call(node, lambda: self._status(node), timeout=3)
        except (OSError, TimeoutError):
            return False
        header = st.get("header")
        return isinstance(header, dict) and header.get("member_id") == st.get("leader")

    @property
    def url(self) -> str:
        return "etcd://" + ",".join(f"{n.addr}:{ETCD_CLIENT}" for n in self.nodes)


class ZooKeeperNetCluster(_Cluster):
    what = "zookeeper"

    def __init__(self, lab: NetLab, size: int = 3, *, tick_ms: int = 200) -> None:
        super().__init__(lab, size, "z")
        self.java = shutil.which("java")
        if self.java is None:
            raise ServerUnavailable("java not found: install 'default-jre-headless'")
        self.classpath = _zookeeper_classpath()
        self.tick_ms = tick_ms

    def start(self, timeout: float = 60.0) -> ZooKeeperNetCluster:
        assert self.java is not None
        servers = "".join(f"server.{i + 1}={n.addr}:2888:3888\n" for i, n in enumerate(self.nodes))
        for i, n in enumerate(self.nodes):
            d = self.dir / n.name
            (d / "data").mkdir(parents=True)
            (d / "data" / "myid").write_text(f"{i + 1}\n")
            (d / "zoo.cfg").write_text(
                f"tickTime={self.tick_ms}\ninitLimit=20\nsyncLimit=5\n"
                f"dataDir={d / 'data'}\nclientPort={ZK_CLIENT}\nclientPortAddress={n.addr}\n"
                "admin.enableServer=false\n4lw.commands.whitelist=ruok,srvr,stat,mntr,conf,cons\n"
                "maxSessionTimeout=60000\nforceSync=yes\n" + servers
            )
            (d / "log4j.properties").write_text(
                "log4j.rootLogger=WARN, CONSOLE\n"
                "log4j.appender.CONSOLE=org.apache.log4j.ConsoleAppender\n"
                "log4j.appender.CONSOLE.layout=org.apache.log4j.PatternLayout\n"
                "log4j.appender.CONSOLE.layout.ConversionPattern=%d %-5p [%t] %c: %m%n\n"
            )
            argv = [
                self.java, "-Xmx192m", "-XX:+UseSerialGC", "-XX:-UsePerfData",
                "-XX:TieredStopAtLevel=1", *zookeeper_cds_args(self.classpath),
                f"-Dlog4j.configuration=file:{d / 'log4j.properties'}",
                "-Dzookeeper.admin.enableServer=false",
                "-cp", self.classpath,
                "org.apache.zookeeper.server.quorum.QuorumPeerMain", str(d / "zoo.cfg"),
            ]  # fmt: skip
            self.members.append(self.lab.run(n, argv, log=self.dir / f"{n.name}.log"))
        for n in self.nodes:
            _wait(lambda n=n: self._mode(n) in ("leader", "follower"), timeout, n.name)  # type: ignore[misc]
        return self

    def _mode(self, n: Node) -> str:
        try:
            out = self.lab.call(n, lambda: _ask(n.addr, ZK_CLIENT, b"srvr"), timeout=3)
        except (OSError, TimeoutError):
            return ""
        for line in out.decode(errors="replace").splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return ""

    def _leads(self, node: Node) -> bool:
        return self._mode(node) == "leader"

    def serving(self, addr: str, timeout_ms: int | None = None) -> str | None:
        """The member a client at ``addr`` is connected to (4lw ``cons``), or None; with
        ``timeout_ms``, by its session of that negotiated timeout alone (a fenced client
        has one session per ttl besides its default one, maybe at another member)."""
        return self.sessions(timeout_ms).get(addr)

    def sessions(self, timeout_ms: int | None = None) -> dict[str, str]:
        """Client address -> the member its session (of negotiated timeout ``timeout_ms``,
        or any) is connected to, by each member's 4lw ``cons``; one pass over the members."""
        found: dict[str, str] = {}
        for n in self.nodes:
            try:
                out = self.lab.call(n, lambda n=n: _ask(n.addr, ZK_CLIENT, b"cons"), timeout=3)  # type: ignore[misc]
            except (OSError, TimeoutError):
                continue
            for line in out.decode(errors="replace").splitlines():
                # " /10.0.0.5:41234[1](queued=0,...,to=1000,...)"
                addr, _, rest = line.strip().lstrip("/").partition(":")
                to = re.search(r"[(,]to=(\d+)[,)]", rest)
                if not rest or (
                    timeout_ms is not None and (to is None or int(to[1]) != timeout_ms)
                ):
                    continue
                found.setdefault(addr, n.name)
        return found

    @property
    def url(self) -> str:
        return "zookeeper://" + ",".join(f"{n.addr}:{ZK_CLIENT}" for n in self.nodes)


class RedisNet:
    """One Redis in its own node (``r1`` by default), for the guarded resource."""

    def __init__(self, lab: NetLab, name: str = "r1") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServerUnavailable("redis-server not found: install 'redis-server'")
        self.lab = lab
        self.node = lab.add(name)
        self.dir = Path(tempfile.mkdtemp(prefix="fenced-net-redis-"))
        argv = [
            binary, "--bind", self.node.addr, "--port", str(REDIS_PORT), "--dir", str(self.dir),
            "--save", "", "--appendonly", "yes", "--appendfsync", "always",
            "--protected-mode", "no",
        ]  # fmt: skip
        self.proc = lab.run(self.node, argv, log=self.dir / "redis.log")
        n = self.node
        _wait(
            lambda: lab.call(
                n, lambda: _ask(n.addr, REDIS_PORT, b"PING\r\n", once=True)[:5] == b"+PONG"
            ),
            20,
            "redis",
        )

    @property
    def url(self) -> str:
        return f"redis://{self.node.addr}:{REDIS_PORT}/0"

    def close(self) -> None:
        self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
