"""The replicated-group workload of the one campaign (``_engine``): real replica servers, a
real token source, writer and reader processes, a seeded nemesis, one history, the group
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
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import fenced

from ..._core.errors import ConfigurationError
from ..proxy import TcpProxy
from ..servers import EtcdServer, PostgresServer, RedisServer, Server, ZooKeeperServer, python_env
from . import _zygote
from ._checkers import Checker, Violation
from ._engine import Campaign, CampaignError, Fault, end_by, short_of_counts, undealt
from ._group_checkers import check_group, operations
from ._group_worker import ConfigLog, make_members
from ._history import Event, History, read_history
from ._zygote import Worker

__all__ = ["GroupCluster", "GroupRun", "GroupWorkload", "load_history", "run_group_campaign"]

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
    """Deprecated: :func:`~fenced.testing.check.read_history` reads a directory too."""
    warnings.warn(
        "load_history is deprecated: use fenced.testing.check.read_history",
        DeprecationWarning,
        stacklevel=2,
    )
    return read_history(directory)


class Workers:
    """Worker processes of a run (own process groups; stopped by a stop file, then killed)."""

    def __init__(self, out: Path, cluster: GroupCluster, base: dict[str, Any]) -> None:
        self.out = out
        self.cluster = cluster
        self.base = base
        self.procs: dict[str, Worker] = {}
        self.stop_file = out / "stop"
        self.history = out / "history.jsonl"
        self.env = python_env()

    def spawn(self, proc: str, role: str, **extra: Any) -> Worker:
        config = {
            **self.base,
            "source": self.cluster.source_url,
            "group": GROUP,
            "members": self.cluster.specs(),
            "role": role,
            "proc": proc,
            "history": str(self.history),
            "stop_file": str(self.stop_file),
            **extra,
        }
        with open(self.out / f"{proc}.log", "wb") as log:
            p = _zygote.spawn(
                "fenced.testing.check._group_worker", [json.dumps(config)], env=self.env,
                stderr=log, stdin_pipe=False,
            )  # fmt: skip
        assert p.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(p.stdout, selectors.EVENT_READ)
            line = p.stdout.readline() if sel.select(60) else b""
        if line.strip() != b"ready":
            p.kill()
            raise CampaignError(f"worker {proc} did not start: see {self.out / f'{proc}.log'}")
        self.procs[proc] = p
        return p

    def stop(self, grace: float = 20.0) -> None:
        self.stop_file.touch()
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
        end_by(self.procs.values(), deadline)


def final_state(cluster: GroupCluster, out: Path, attempts: int = 20) -> None:
    """Every member's whole state and the final configuration, read by the runner directly
    (not through the proxies), into the history."""
    history = History(out / "history.jsonl", "final")
    with fenced.connect(cluster.source_url) as locks:
        guards = make_members(cluster.specs(direct=True), GROUP, 5.0)
        group = fenced.replicated.Group(GROUP, locks, guards, timeout=10.0)
        try:
            cfg = group.configuration()
            history.append("final_config", epoch=cfg.epoch, members=list(cfg.members))
            for name in cfg.members:
                snap = group.portal.call(group.aio.member(name).read(None))
                history.append(
                    "final",
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
            history.close()


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


class GroupWorkload:
    """The replicated-group workload of the one campaign (``_engine``): writers and readers
    against a group of ``replicas`` (see the module docstring), judged by the group checkers.
    The arguments are :func:`run_group_campaign`'s."""

    first: frozenset[str] = frozenset()
    prefix_checkers: dict[str, Checker] = {}  # (its checkers need the final state)

    def __init__(
        self,
        out: Path,
        *,
        replicas: Sequence[str] = ("redis", "redis", "redis"),
        source: str = "etcd",
        writers: int = 2,
        readers: int = 1,
        ttl: float = 1.0,
        nemesis: Sequence[str] = NEMESES,
        seed: int = 0,
        plant: str | None = None,
        ops: int = 4,
    ) -> None:
        unknown = set(nemesis) - set(NEMESES)
        if unknown:
            raise ConfigurationError(
                f"unknown nemesis {sorted(unknown)}; known: {', '.join(NEMESES)}"
            )
        self.out, self.replicas, self.source = out, tuple(replicas), source
        self.writers, self.readers, self.ttl = writers, readers, ttl
        self.nemeses = tuple(nemesis)
        self.seed, self.plant, self.ops = seed, plant, ops
        self._servers = contextlib.ExitStack()  # the cluster: up until the final state is read
        self._stack = contextlib.ExitStack()  # the workers and the operator: stopped before
        self.cluster: GroupCluster | None = None
        self.workers: Workers | None = None
        self.op: fenced.replicated.Group | None = None

    def setup(self, history: Path) -> None:
        for old in self.out.glob("history-*.jsonl"):  # (a run's before the one schema)
            old.unlink()
        (self.out / "stop").unlink(missing_ok=True)
        self.cluster = cluster = self._servers.enter_context(
            GroupCluster(self.replicas, self.source)
        )
        base = {"ttl": self.ttl, "seed": self.seed, "plant": self.plant, "ops": self.ops,
                "timeout": 1.0}  # fmt: skip
        self.workers = workers = Workers(self.out, cluster, base)
        self._stack.callback(_heal_all, cluster)
        self._stack.callback(workers.stop)
        for i in range(self.writers):
            workers.spawn(f"w{i + 1}", "writer", seed=self.seed * 100 + i)
        for i in range(self.readers):
            workers.spawn(f"r{i + 1}", "reader", seed=self.seed * 100 + 50 + i)
        self.op = self._stack.enter_context(operator(cluster))

    def pace(self, rng: random.Random) -> float:
        return rng.uniform(0.3, 0.8)

    def healthy(self) -> None:
        pass  # (a writer that died shows as fewer operations: the counts say so)

    def aim(self, kind: str, rng: random.Random) -> Fault | None:
        cluster, workers, op = self.cluster, self.workers, self.op
        assert cluster is not None and workers is not None and op is not None
        writers = {n: p for n, p in workers.procs.items() if n.startswith("w")}
        ttl = self.ttl
        if kind == "pause" and writers:
            holder = _holder(op, list(writers.values()))
            victim = holder or rng.choice(list(writers.values()))
            name = next(n for n, p in writers.items() if p is victim)
            seconds = rng.uniform(2.0, 3.0) * ttl
            return self._outage(
                kind,
                name,
                seconds,
                lambda: os.killpg(victim.pid, signal.SIGSTOP),
                lambda: os.killpg(victim.pid, signal.SIGCONT),
            )
        if kind == "kill" and cluster.killable():
            r = cluster.replicas[rng.choice(cluster.killable())]
            assert r.server is not None
            return self._outage(kind, r.name, rng.uniform(0.3, 1.0), r.server.kill, r.server.start)
        if kind == "partition":
            cut = [n for n, r in cluster.replicas.items() if r.proxy is not None]
            if not cut:
                return None
            r = cluster.replicas[rng.choice(cut)]
            proxy = r.proxy
            assert proxy is not None
            return self._outage(kind, r.name, rng.uniform(1.0, 3.0), proxy.partition, proxy.heal)
        if kind == "reconfigure":
            removed: str | None = None
            with contextlib.suppress(fenced.FencedError):
                members = op.configuration().members
                if len(members) > 1:
                    removed = rng.choice(members)

            def reconfigure() -> None:
                if removed is not None:
                    with contextlib.suppress(fenced.FencedError):
                        op.remove(removed)

            return self._fault(kind, removed or "none", 0.0, reconfigure)
        return None

    def _outage(
        self,
        kind: str,
        victim: str,
        seconds: float,
        cut: Callable[[], object],
        heal: Callable[[], object],
    ) -> Fault:
        """A fault that cuts, lasts ``seconds`` (its length, in the nemesis' thread), heals."""

        def act() -> None:
            cut()
            time.sleep(seconds)
            heal()

        return self._fault(kind, victim, seconds, act)

    def _fault(self, kind: str, victim: str, seconds: float, act: Callable[[], None]) -> Fault:
        cluster, op = self.cluster, self.op
        assert cluster is not None and op is not None

        def strike() -> None:
            act()
            _rejoin(cluster, op)  # members come and go all run long

        return Fault(kind, victim, seconds, strike)

    def settle(self, history: History) -> None:
        cluster, workers, op = self.cluster, self.workers, self.op
        assert cluster is not None and workers is not None and op is not None
        _heal_all(cluster)
        _rejoin(cluster, op)
        operator_history = History(workers.history, "operator")
        try:
            ConfigLog(operator_history)(op.aio)
        finally:
            operator_history.close()
        self._stack.close()  # the operator closed, the workers stopped, the replicas healed
        final_state(cluster, self.out)

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            self._servers.close()

    def is_operation(self, event: Event) -> bool:
        return bool(event["op"] == "complete")  # (a write or a read, answered or not)

    def judge(
        self, events: list[Event], faults: dict[str, int], seconds: float, short: str = ""
    ) -> GroupRun:
        violations = check_group(events)
        violations = undealt(short_of_counts(violations, short), self.nemeses, faults, seconds)
        return GroupRun(violations, group_counts(events), faults, events)


def group_counts(events: list[Event]) -> dict[str, int]:
    """What a group run did: acknowledged writes, reads, configurations, refused changes."""
    ops_done = operations(events)
    return {
        "acknowledged writes": sum(1 for o in ops_done if o["kind"] == "write" and o["ok"] is True),
        "reads": sum(1 for o in ops_done if o["kind"] == "read" and o["ok"] is True),
        "configurations": len({e["epoch"] for e in events if e["op"] == "config"}),
        "refused changes": sum(
            1 for e in events if e["op"] == "apply" and str(e["ok"]).startswith("stale")
        ),
    }


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
    faults_each: int = 0,
    at_least: Mapping[str, int] | None = None,
) -> GroupRun:
    """Run writers and readers against a group of ``replicas`` for ``seconds`` under the
    nemesis (:class:`GroupWorkload` in the one :class:`~fenced.testing.check.Campaign`), then
    check the history. ``faults_each=N``: until every nemesis struck N times instead, with
    ``seconds`` as the bound (:class:`~fenced.testing.check.Campaign`'s ``faults``), and at
    least ``at_least`` of :func:`group_counts` (``{"reads": 20}``, say); a bound that ends
    first is the violation "counts not reached". Returns the verdicts (see :class:`GroupRun`)."""
    out = Path(out)
    workload = GroupWorkload(
        out, replicas=replicas, source=source, writers=writers, readers=readers, ttl=ttl,
        nemesis=nemesis, seed=seed, plant=plant, ops=ops,
    )  # fmt: skip
    minimum = dict(at_least or {})

    def enough(events: list[Event]) -> bool:
        counts = group_counts(events)
        return all(counts[k] >= n for k, n in minimum.items())

    campaign: Campaign[GroupRun] = Campaign(
        workload, out, seconds=seconds, seed=seed, faults=faults_each,
        enough=enough if minimum else None,
    )  # fmt: skip
    return campaign.run()


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
