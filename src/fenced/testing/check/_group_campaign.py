"""A fault campaign against a replicated group (``fenced.replicated``): real replica servers,
a real token source, writer and reader processes, a seeded nemesis, one history, the group
checkers (``_group_checkers``).

:class:`GroupCluster` starts the servers: the source (etcd, ZooKeeper, or an SQLite file) and
one replica per entry of ``replicas`` — ``redis`` (its own redis-server, AOF ``always``),
``postgresql`` (a database of one shared PostgreSQL server), ``etcd`` (its own etcd),
``sqlite`` (a file). Each networked replica is reached by the workers through its own
:class:`~fenced.testing.proxy.TcpProxy`, so the nemesis can cut it off.

The nemesis, drawn from ``seed`` (the same seed, the same schedule; every fault once per
round, in a shuffled order):

- ``pause``: SIGSTOP a writer for 2-3 ttls (past its lease), then SIGCONT: it wakes up and
  writes as if it still held the lock;
- ``kill``: kill -9 a replica server (Redis, etcd), restart it a moment later;
- ``partition``: cut a replica off the workers for 1-3 s; writers remove it (reconfiguration)
  rather than wait;
- ``reconfigure``: remove a member while writes are in flight (an operator's change).

Between faults the nemesis adds back any member missing from the configuration whose server
is up (state transfer, then a configuration with it), so members come and go all run long.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import fenced

from ..proxy import TcpProxy
from ..servers import EtcdServer, PostgresServer, RedisServer, Server, ZooKeeperServer, python_env
from ._checkers import Violation
from ._group_checkers import check_group, operations
from ._group_worker import History, make_members

__all__ = ["GroupCluster", "GroupRun", "load_history", "run_group_campaign"]

NEMESES = ("pause", "kill", "partition", "reconfigure")
GROUP = "orders"


@dataclasses.dataclass
class Replica:
    name: str
    kind: str
    server: Server | None = None
    proxy: TcpProxy | None = None
    spec: dict[str, Any] = dataclasses.field(default_factory=dict)  # through the proxy
    direct: dict[str, Any] = dataclasses.field(default_factory=dict)  # for the runner


class GroupCluster:
    """The servers of a run, started on enter and stopped on exit."""

    def __init__(self, replicas: Sequence[str], source: str = "etcd") -> None:
        self.kinds = list(replicas)
        self.source_kind = source
        self.dir = Path(tempfile.mkdtemp(prefix="fenced-group-"))
        self.servers: list[Server] = []
        self.replicas: dict[str, Replica] = {}
        self.source_url = ""
        self._pg: PostgresServer | None = None

    def __enter__(self) -> GroupCluster:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        if self.source_kind == "etcd":
            self.source_url = self._server(EtcdServer()).url
        elif self.source_kind == "zookeeper":
            self.source_url = self._server(ZooKeeperServer()).url
        elif self.source_kind == "sqlite":
            self.source_url = f"sqlite:///{self.dir}/locks.db"
        else:
            raise ValueError(f"unknown source {self.source_kind!r}")
        for i, kind in enumerate(self.kinds):
            name = "abcdefghij"[i]
            r = Replica(name, kind)
            if kind == "redis":
                r.server = self._server(RedisServer())
                r.direct = {"name": name, "kind": kind, "port": r.server.port}
            elif kind == "etcd":
                r.server = self._server(EtcdServer())
                r.direct = {"name": name, "kind": kind, "endpoint": f"127.0.0.1:{r.server.port}"}
            elif kind == "postgresql":
                if self._pg is None:
                    self._pg = PostgresServer()
                    self._server(self._pg)
                import psycopg

                with psycopg.connect(self._pg.dsn, autocommit=True) as conn:
                    conn.execute(f"CREATE DATABASE replica_{name}")
                r.server = self._pg
                r.direct = {
                    "name": name,
                    "kind": kind,
                    "url": f"postgresql://postgres@127.0.0.1:{self._pg.port}/replica_{name}",
                }
            elif kind == "sqlite":
                r.direct = {"name": name, "kind": kind, "path": str(self.dir / f"{name}.db")}
            else:
                raise ValueError(f"unknown replica kind {kind!r}")
            r.spec = dict(r.direct)
            if r.server is not None:
                r.proxy = TcpProxy("127.0.0.1", r.server.port).start()
                if kind == "redis":
                    r.spec["port"] = r.proxy.port
                elif kind == "etcd":
                    r.spec["endpoint"] = f"127.0.0.1:{r.proxy.port}"
                else:
                    r.spec["url"] = r.direct["url"].replace(
                        f":{r.server.port}/", f":{r.proxy.port}/"
                    )
            self.replicas[name] = r

    def _server(self, server: Server) -> Any:
        server.start()
        self.servers.append(server)
        return server

    def specs(self, direct: bool = False) -> list[dict[str, Any]]:
        return [r.direct if direct else r.spec for r in self.replicas.values()]

    def killable(self) -> list[str]:
        return [n for n, r in self.replicas.items() if r.kind in ("redis", "etcd")]

    def close(self) -> None:
        for r in self.replicas.values():
            if r.proxy is not None:
                r.proxy.close()
        for s in self.servers:
            with contextlib.suppress(Exception):
                s.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclasses.dataclass
class GroupRun:
    violations: list[Violation]
    counts: dict[str, int]
    faults: dict[str, int]
    history: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        return not self.violations


def load_history(directory: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in sorted(directory.glob("history-*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(ValueError):  # a line cut short by a kill
                    events.append(json.loads(line))
    return events


class Workers:
    """Worker processes of a run (own process groups; stopped by a stop file, then killed)."""

    def __init__(self, out: Path, cluster: GroupCluster, base: dict[str, Any]) -> None:
        self.out = out
        self.cluster = cluster
        self.base = base
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stop_file = out / "stop"
        self.env = python_env()

    def spawn(self, proc: str, role: str, **extra: Any) -> subprocess.Popen[bytes]:
        config = {
            **self.base,
            "source": self.cluster.source_url,
            "group": GROUP,
            "members": self.cluster.specs(),
            "role": role,
            "proc": proc,
            "history": str(self.out / f"history-{proc}.jsonl"),
            "stop_file": str(self.stop_file),
            **extra,
        }
        with open(self.out / f"{proc}.log", "wb") as log:
            p = subprocess.Popen(
                [sys.executable, "-m", "fenced.testing.check._group_worker", json.dumps(config)],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        assert p.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(p.stdout, selectors.EVENT_READ)
            line = p.stdout.readline() if sel.select(60) else b""
        if line.strip() != b"ready":
            p.kill()
            raise RuntimeError(f"worker {proc} did not start: see {self.out / f'{proc}.log'}")
        self.procs[proc] = p
        return p

    def stop(self, grace: float = 20.0) -> None:
        self.stop_file.touch()
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def final_state(cluster: GroupCluster, out: Path, attempts: int = 20) -> None:
    """Every member's whole state and the final configuration, read by the runner directly
    (not through the proxies), into the history."""
    history = History(str(out / "history-final.jsonl"), "final")
    with fenced.connect(cluster.source_url) as locks:
        guards = make_members(cluster.specs(direct=True), GROUP, 5.0)
        group = fenced.replicated.Group(GROUP, locks, guards, timeout=10.0)
        try:
            cfg = group.configuration()
            history.log(op="final_config", epoch=cfg.epoch, members=list(cfg.members))
            for name in cfg.members:
                snap = group.portal.call(group.aio.member(name).read(None))
                history.log(
                    op="final",
                    member=name,
                    token=snap.token,
                    epoch=snap.epoch,
                    items={
                        k: [i.stamp, None if i.value is None else i.value.decode()]
                        for k, i in snap.items.items()
                    },
                )
        finally:
            group.close()
            _close_guards(guards)


def _close_guards(guards: dict[str, Any]) -> None:
    for g in guards.values():
        close = getattr(g, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()


@contextlib.contextmanager
def operator(cluster: GroupCluster) -> Iterator[fenced.replicated.Group]:
    """The runner's own view of the group (direct connections), for reconfigurations."""
    with fenced.connect(cluster.source_url) as locks:
        guards = make_members(cluster.specs(direct=True), GROUP, 2.0)
        group = fenced.replicated.Group(GROUP, locks, guards, timeout=4.0)
        try:
            yield group
        finally:
            group.close()
            _close_guards(guards)


def run_group_campaign(
    out: Path,
    *,
    replicas: Sequence[str] = ("redis", "redis", "redis"),
    source: str = "etcd",
    writers: int = 2,
    readers: int = 1,
    seconds: float = 20.0,
    ttl: float = 1.0,
    nemesis: Sequence[str] = NEMESES,
    seed: int = 0,
    plant: str | None = None,
    ops: int = 4,
) -> GroupRun:
    """Run writers and readers against a group of ``replicas`` for ``seconds`` under the
    nemesis, then check the history. Returns the verdicts (see :class:`GroupRun`)."""
    unknown = set(nemesis) - set(NEMESES)
    if unknown:
        raise ValueError(f"unknown nemesis {sorted(unknown)}; known: {', '.join(NEMESES)}")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("history-*.jsonl"):
        old.unlink()
    (out / "stop").unlink(missing_ok=True)
    rng = random.Random(seed)
    faults = {n: 0 for n in nemesis}
    with GroupCluster(replicas, source) as cluster:
        base = {"ttl": ttl, "seed": seed, "plant": plant, "ops": ops, "timeout": 1.0}
        workers = Workers(out, cluster, base)
        try:
            for i in range(writers):
                workers.spawn(f"w{i + 1}", "writer", seed=seed * 100 + i)
            for i in range(readers):
                workers.spawn(f"r{i + 1}", "reader", seed=seed * 100 + 50 + i)
            with operator(cluster) as op:
                try:
                    _nemesis(cluster, workers, op, rng, nemesis, faults, seconds, ttl)
                    _heal_all(cluster)
                    _rejoin(cluster, op)
                finally:
                    History(str(out / "history-operator.jsonl"), "operator").configs(op.aio)
        finally:
            workers.stop()
            _heal_all(cluster)
        final_state(cluster, out)
    history = load_history(out)
    ops_done = operations(history)
    counts = {
        "acknowledged writes": sum(1 for o in ops_done if o["kind"] == "write" and o["ok"] is True),
        "reads": sum(1 for o in ops_done if o["kind"] == "read" and o["ok"] is True),
        "configurations": len({e["epoch"] for e in history if e["op"] == "config"}),
        "refused changes": sum(
            1 for e in history if e["op"] == "apply" and str(e["ok"]).startswith("stale")
        ),
    }
    return GroupRun(check_group(history), counts, faults, history)


def _nemesis(
    cluster: GroupCluster,
    workers: Workers,
    op: fenced.replicated.Group,
    rng: random.Random,
    nemesis: Sequence[str],
    faults: dict[str, int],
    seconds: float,
    ttl: float,
) -> None:
    start = time.monotonic()
    writers = [p for n, p in workers.procs.items() if n.startswith("w")]
    deck: list[str] = []
    while time.monotonic() - start < seconds:
        time.sleep(rng.uniform(0.3, 0.8))  # (the schedule's own pace, not a synchronisation)
        if not deck:  # every fault once per round, in a seeded order: none is left out
            deck = list(nemesis)
            rng.shuffle(deck)
        kind = deck.pop() if deck else None
        if kind == "pause" and writers:
            victim = _holder(op, writers) or rng.choice(writers)
            os.killpg(victim.pid, signal.SIGSTOP)
            time.sleep(rng.uniform(2.0, 3.0) * ttl)
            os.killpg(victim.pid, signal.SIGCONT)
        elif kind == "kill" and cluster.killable():
            r = cluster.replicas[rng.choice(cluster.killable())]
            assert r.server is not None
            r.server.kill()
            time.sleep(rng.uniform(0.3, 1.0))
            r.server.start()
        elif kind == "partition":
            cut = [n for n, r in cluster.replicas.items() if r.proxy is not None]
            if not cut:
                continue
            r = cluster.replicas[rng.choice(cut)]
            assert r.proxy is not None
            r.proxy.partition()
            time.sleep(rng.uniform(1.0, 3.0))
            r.proxy.heal()
        elif kind == "reconfigure":
            with contextlib.suppress(fenced.FencedError):
                cfg = op.configuration()
                if len(cfg.members) > 1:
                    op.remove(rng.choice(cfg.members))
        else:
            continue
        faults[kind] += 1
        _rejoin(cluster, op)


def _holder(op: fenced.replicated.Group, writers: list[Any]) -> Any:
    """The writer holding the group's lock now, if any: pausing it is the fault that matters
    (it wakes past its lease in the middle of its writes; a paused waiter tests little)."""
    try:
        status = op.portal.call(op.aio.source.status(GROUP))
    except fenced.FencedError:
        return None
    found = re.search(r"\bpid (\d+)", status.owner or "") if status.holder else None
    pid = int(found.group(1)) if found else None
    return next((p for p in writers if p.pid == pid), None)


def _heal_all(cluster: GroupCluster) -> None:
    for r in cluster.replicas.values():
        if r.proxy is not None:
            r.proxy.heal()
        if r.server is not None and (r.server.proc is None or r.server.proc.poll() is not None):
            r.server.start()


def _rejoin(cluster: GroupCluster, op: fenced.replicated.Group) -> None:
    """Add back every member missing from the configuration (best effort)."""
    with contextlib.suppress(fenced.FencedError):
        cfg = op.configuration()
        for name in cluster.replicas:
            if name not in cfg.members:
                with contextlib.suppress(fenced.FencedError):
                    op.reconfigure(add=[name])
