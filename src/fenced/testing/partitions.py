"""A partition campaign: real clusters, real clients, real partitions, in a :class:`NetLab`.

:func:`run_campaign` starts a three-member etcd or ZooKeeper cluster with one member per
namespace, a guarded resource (a SQLite database under :class:`~fenced.guards.sql.SQLGuard`,
or a Redis in its own namespace under :class:`~fenced.guards.redis.RedisGuard`) and client
processes, each in its own namespace, that loop: acquire one lock from the cluster with the
public fenced API, hold it (sampling ``remaining()`` and ``lease.lost``), write through the
guard to a register that keeps its whole past, release. Meanwhile a nemesis, bounded in
count and time, isolates the leader, splits the cluster 2/1 with the lock holder on the
minority side, flaps a member's link and pauses a member with SIGSTOP.

Every event goes to ``history-<client>.jsonl`` (one ``O_APPEND`` write each, so a killed
client loses nothing the kernel has) with ``time.monotonic()`` times: one clock for the
machine, shared with the nemesis's fault intervals. :func:`check` reads them with the
register's final state and returns the violations of:

* **tokens rising** — a grant that began after another ended has the higher token;
* **no stale write accepted** — the register's accepted tokens never go down;
* **no acknowledged write lost** — every acknowledged write is in the register;
* **the holder can write** — a refusal names a token lower than one already granted;
* **leases exclusive** — while ``remaining()`` > 0 no higher token was granted to anyone
  (a lease is "surely held"; fencing refuses the writes of an overlap all the same);
* **loss learnt in time** — a client that still believes it holds the lease (its
  ``lease.lost`` not set) at time t had promised, by some earlier ``remaining()``, to hold
  it until at least t − ``LOSS_SLACK``; its ``lost`` is set by then too.

Plants (``plant=``): ``ignore-loss`` (clients that never look at ``lease.lost`` and keep
writing), ``unguarded`` (writes without the guard's check), ``zk-follower-renew`` (the old
ZooKeeper renewal: one read that a cut-off follower answers alone): the checks must fail.

:func:`run_check` runs ``fenced check`` itself in a lab, each of its workers in a namespace
of its own, and checks *loss learnt in time* on the kit's history too
(:func:`check_kit_losses`; its plant: ``lab_plant="ignore-loss"``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from fenced._core.errors import ConfigurationError

__all__ = [
    "LAB_PLANTS",
    "LOSS_SLACK",
    "Campaign",
    "CheckRun",
    "check",
    "check_kit_losses",
    "kit_losses",
    "run_campaign",
    "run_check",
]

LOCK: Final = "partitioned"
RESOURCE: Final = "register"
LOSS_SLACK: Final = 0.25
"""Scheduling slack (s) between a lease's promised end and ``lost`` being set: the renewal's
timeout fires on the event loop of a process sharing loaded cores."""
PLANTS: Final = ("ignore-loss", "unguarded", "zk-follower-renew")
NEMESES: Final = ("split-minority-holder", "isolate-leader", "pause", "flap")
KNOWN_OPEN: Final[dict[str, tuple[str, ...]]] = {}
"""Findings the campaign reports apart (``Campaign.known``) because they are open issues of a
source, documented in docs/verification-partitions.md; every other finding is a violation."""
MAX_OPS: Final = 10_000  # per client: a bound on its loop besides its deadline


# -- the client process ---------------------------------------------------------------------


class _History:
    def __init__(self, path: str, client: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.client = client

    def __call__(self, kind: str, **fields: Any) -> None:
        event = {"t": time.monotonic(), "client": self.client, "kind": kind, **fields}
        os.write(self.fd, (json.dumps(event) + "\n").encode())


class _SQLRegister:
    def __init__(self, path: str, unguarded: bool) -> None:
        from fenced.guards.sql import SQLGuard

        self.db = sqlite3.connect(path, timeout=10, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.guard = SQLGuard(RESOURCE, lock=LOCK)
        self.unguarded = unguarded

    def write(self, token: Any, value: str) -> None:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            if not self.unguarded:
                self.guard.check(db, token=token)
            db.execute("INSERT INTO reg(token, value) VALUES (?, ?)", (token.value, value))
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")


_REDIS_APPEND: Final = "redis.call('RPUSH', KEYS[1], ARGV[1] .. ':' .. ARGV[2]) return 1"


class _RedisRegister:
    def __init__(self, url: str, unguarded: bool) -> None:
        import redis

        from fenced.guards.redis import RedisGuard

        self.client = redis.Redis.from_url(url, socket_timeout=5)
        self.guard = RedisGuard(self.client, RESOURCE, lock=LOCK)
        self.unguarded = unguarded

    def write(self, token: Any, value: str) -> None:
        if self.unguarded:
            self.client.rpush("{register}:log", f"{token.value}:{value}")
        else:
            self.guard.eval(_REDIS_APPEND, ["{register}:log"], [token.value, value], token=token)


async def _client(args: argparse.Namespace) -> None:
    import fenced
    from fenced import BackendUnavailable, LeaseLostError, LockTimeout, StaleTokenError

    record = _History(args.history, args.name)
    plants = set(filter(None, (args.plant or "").split(",")))
    unguarded = "unguarded" in plants
    kind, _, where = args.resource.partition(":")
    register = _SQLRegister(where, unguarded) if kind == "sql" else _RedisRegister(where, unguarded)
    ignore_loss = "ignore-loss" in plants
    if "zk-follower-renew" in plants:
        from fenced.backends import zookeeper

        zookeeper._PLANT_FOLLOWER_RENEW = True
    end = time.monotonic() + args.duration
    record("ready")
    async with fenced.connect_async(args.source, connect_timeout=10) as locks:
        for op in range(MAX_OPS):
            if time.monotonic() >= end:
                break
            lease = locks.lock(LOCK, ttl=args.ttl, safety_margin=args.safety_margin)
            started = time.monotonic()
            record("acquiring")  # (a waiter: the nemesis splits when one is queued)
            try:
                wait = min(args.acquire_timeout, max(end - started, 0.1))
                token = await lease.acquire(timeout=wait)
            except (LockTimeout, BackendUnavailable, LeaseLostError) as exc:
                record("acquire-failed", start=started, error=type(exc).__name__)
                continue
            record("grant", start=started, token=token.value, remaining=lease.remaining())
            lost_at: list[float] = []

            def on_lost(_: BaseException, box: list[float] = lost_at) -> None:
                box.append(time.monotonic())

            lease.add_lost_hook(on_lost)
            # A client that ignores its loss also holds on for longer, as such a client would
            # (its stale writes then meet the next holder's).
            hold_end = time.monotonic() + args.hold + (3 * args.ttl if ignore_loss else 0.0)
            n = 0
            while time.monotonic() < min(hold_end, end + 3 * args.ttl) and n < 1000:
                n += 1
                believes = ignore_loss or not lease.lost.is_set()
                record("sample", token=token.value, remaining=lease.remaining(), believes=believes)
                if lost_at and not ignore_loss:
                    record("lost", token=token.value, at=lost_at[0])
                    break
                if believes:
                    value = f"{args.name}.{op}.{n}"
                    w0 = time.monotonic()
                    try:
                        await asyncio.to_thread(register.write, token, value)
                    except StaleTokenError:
                        record("write", start=w0, token=token.value, value=value, result="refused")
                    except Exception as exc:  # unknown outcome: recorded, not acknowledged
                        record("write", start=w0, token=token.value, value=value,
                               result="unknown", error=type(exc).__name__)  # fmt: skip
                    else:
                        record("write", start=w0, token=token.value, value=value, result="ok")
                await asyncio.sleep(args.every)
            if not lease.lost.is_set():
                record("releasing", token=token.value)
                with contextlib.suppress(Exception):
                    await lease.release()
            elif lost_at and ignore_loss:
                record("lost-ignored", token=token.value, at=lost_at[0])
    record("done")


# -- the campaign ---------------------------------------------------------------------------


@dataclass
class Campaign:
    source: str  # etcd | zookeeper
    resource: str  # sql | redis
    dir: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    register: list[tuple[int, str]] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    known: list[str] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    setup: float = 0.0  # seconds to start the cluster, resource, gateways

    def counts(self) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for e in self.events:
            k = e["kind"] if e["kind"] != "write" else f"write-{e['result']}"
            kinds[k] = kinds.get(k, 0) + 1
        kinds["faults"] = len(self.faults)
        return kinds

    def summary(self) -> str:
        c = self.counts()
        return (
            f"{self.source}+{self.resource}: {c.get('grant', 0)} grants, "
            f"{c.get('write-ok', 0)} writes accepted, {c.get('write-refused', 0)} refused, "
            f"{c.get('write-unknown', 0)} unknown, {c.get('lost', 0)} leases lost, "
            f"{len(self.faults)} faults ({', '.join(sorted({f['kind'] for f in self.faults}))}) "
            f"in {self.end - self.start:.1f} s (+{self.setup:.1f} s setup); "
            + (
                "every invariant held"
                if not self.violations
                else f"{len(self.violations)} violations"
            )
            + (f" ({len(self.known)} known open: {self.known[0]})" if self.known else "")
        )


def _python_env() -> dict[str, str]:
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])  # the directory holding ``fenced``
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


def _read_events(directory: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(directory.glob("history-*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))  # a torn last line of a killed client
    events.sort(key=lambda e: e["t"])
    return events


def _lock_state(directory: Path, fresh: float) -> tuple[str | None, set[str]]:
    """The client that holds the lock now and was granted it less than ``fresh`` s ago (so
    a partition begun now cuts it off for most of its hold), and the clients waiting in an
    acquire now, by their own histories."""
    current: dict[str, float | None] = {}
    waiting: set[str] = set()
    for e in _read_events(directory):
        if e["kind"] == "acquiring":
            waiting.add(e["client"])
        elif e["kind"] in ("grant", "acquire-failed", "done"):
            waiting.discard(e["client"])
        if e["kind"] == "grant":
            current[e["client"]] = e["t"]
        elif e["kind"] in ("releasing", "lost", "lost-ignored", "done"):
            current[e["client"]] = None
    now = time.monotonic()
    held = [c for c, t in current.items() if t is not None and now - t < fresh]
    return (held[-1] if held else None), waiting


def _holder(directory: Path, fresh: float) -> str | None:
    """The fresh holder of :func:`_lock_state`."""
    return _lock_state(directory, fresh)[0]


def _ready(directory: Path, clients: int) -> bool:
    ready: int = sum(e["kind"] == "ready" for e in _read_events(directory))
    return ready >= clients


def _wait_for(cond: Any, timeout: float, stop: threading.Event) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        value = cond()
        if value:
            return value
        stop.wait(0.05)  # a poll interval, bounded by the deadline
    return None


def run_campaign(
    source: str = "etcd",
    resource: str = "sql",
    *,
    clients: int = 3,
    duration: float = 14.0,
    ttl: float = 1.5,
    hold: float = 2.0,
    plant: str | None = None,
    nemeses: tuple[str, ...] = NEMESES,
    directory: str | None = None,
    gateways: bool = False,
    safety_margin: float | None = None,
    shared: tuple[Any, Any] | None = None,
) -> Campaign:
    """Run one bounded campaign and check it; see the module's docstring.

    ``shared=(lab, cluster)``: run in that lab, on that started cluster of ``source`` (left
    running), instead of a lab and cluster of its own: campaigns in a row save the cluster's
    start. Its nodes get names of their own; its faults are healed at its end as always.
    """
    from fenced.testing.netclusters import EtcdNetCluster, RedisNet, ZooKeeperNetCluster
    from fenced.testing.netns import NetLab

    if plant is not None and not set(plant.split(",")) <= set(PLANTS):
        raise ConfigurationError(f"plant {plant!r}: some of {', '.join(PLANTS)}, comma-separated")
    if not set(nemeses) <= set(NEMESES) or not nemeses:
        raise ConfigurationError(f"nemeses {nemeses!r}: some of {', '.join(NEMESES)}")
    if not 1 <= clients <= 20 or not 1 <= duration <= 3600:
        raise ConfigurationError("clients 1..20, duration 1..3600 s")
    d = Path(directory or tempfile.mkdtemp(prefix="fenced-partitions-"))
    d.mkdir(parents=True, exist_ok=True)
    camp = Campaign(source, resource, d)
    with contextlib.ExitStack() as stack:
        if shared is None:
            lab = stack.enter_context(NetLab(source[:4] + resource[:3]))
            cluster = (EtcdNetCluster if source == "etcd" else ZooKeeperNetCluster)(lab)
        else:
            lab, cluster = shared
        tag = _free_tag(lab)
        first_fault = len(lab.faults)
        redis = None
        procs: list[Any] = []
        setup_start = time.monotonic()
        try:
            if shared is None:
                cluster.start()
            if resource == "redis":
                redis = RedisNet(lab, f"r1{tag}")
                res = f"redis:{redis.url}"
            else:
                db = d / "register.db"
                conn = sqlite3.connect(db, isolation_level=None)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("CREATE TABLE reg(n INTEGER PRIMARY KEY, token INTEGER, value TEXT)")
                from fenced.guards.sql import SQLGuard

                SQLGuard(RESOURCE, lock=LOCK).install(conn)
                conn.close()
                res = f"sql:{db}"
            gateway_of: dict[str, str] = {}
            urls = {}
            if gateways:
                for gw in _start_gateways(lab, [f"g1{tag}", f"g2{tag}"], cluster.url, d):
                    procs.append(gw)
                    urls[gw.node.name] = f"http://{gw.node.addr}:{GATEWAY_PORT}"
            nodes = [lab.add(f"c{i + 1}{tag}") for i in range(clients)]
            camp.start = time.monotonic()
            camp.setup = camp.start - setup_start
            for i, node in enumerate(nodes):
                url = cluster.url
                if gateways:
                    gateway_of[node.name] = g = f"g{i % 2 + 1}{tag}"
                    url = urls[g]
                argv = [
                    sys.executable, "-m", "fenced.testing.partitions", "client",
                    "--name", node.name, "--source", url, "--resource", res,
                    "--history", str(d / f"history-{node.name}.jsonl"),
                    "--duration", str(duration), "--ttl", str(ttl), "--hold", str(hold),
                    "--acquire-timeout", str(_queue_wait(clients, hold, ttl)),
                    "--every", "0.1", *(["--plant", plant] if plant else []),
                    *([] if safety_margin is None else ["--safety-margin", str(safety_margin)]),
                ]  # fmt: skip
                procs.append(lab.run(node, argv, log=d / f"{node.name}.log", env=_python_env()))
            stop = threading.Event()
            if _wait_for(lambda: _ready(d, clients), 30, stop) is None:
                camp.violations.append("clients not ready in 30 s")
            # The resource stays reachable from both sides (DDIA Figure 8-5: the cut-off
            # holder can still write; only its guard may stop it).
            skip = {m.name for m in cluster.nodes} | ({redis.node.name} if redis else set())
            others = [n for n in lab.nodes if n not in skip]
            _nemesis(lab, cluster, lambda: _holder(d, 0.5), others, duration, ttl, nemeses,
                     gateway_of=gateway_of, lock_state=lambda: _lock_state(d, 0.5),
                     split_wait=_queue_wait(clients, hold, ttl))  # fmt: skip
            deadline = time.monotonic() + ttl + hold + 20
            for p in procs:
                if p.node.name in gateway_of.values():
                    continue  # stopped with the lab
                with contextlib.suppress(Exception):
                    p.proc.wait(max(deadline - time.monotonic(), 0.1))
                if p.alive():
                    camp.violations.append(f"client {p.node.name} did not stop by itself")
                    p.kill()
                elif p.proc.returncode != 0:
                    camp.violations.append(
                        f"client {p.node.name} exited {p.proc.returncode}: {p.log_tail(5)}"
                    )
            camp.end = time.monotonic()
            lab.end_faults()
            camp.faults = [f.as_dict() for f in lab.faults[first_fault:]]
            if redis is not None:
                found = lab.call(redis.node, lambda: _redis_log(redis.url))
            else:
                found = _sql_log(d / "register.db")
            camp.register = found
        finally:
            if shared is None:
                cluster.close()
            else:
                for p in procs:
                    if p.alive():
                        p.kill()  # its gateways: the lab goes on
            if redis is not None:
                redis.close()
    camp.events = _read_events(d)
    open_issues = KNOWN_OPEN.get(source, ())
    for finding in check(camp.events, camp.register):
        (camp.known if finding.startswith(open_issues) else camp.violations).append(finding)
    (d / "faults.json").write_text(json.dumps(camp.faults))
    (d / "register.json").write_text(json.dumps(camp.register))
    (d / "violations.json").write_text(json.dumps({"violations": camp.violations,
                                                   "known": camp.known}))  # fmt: skip
    return camp


def _free_tag(lab: Any, first: str = "c1") -> str:
    """A suffix for a campaign's node names not yet used in ``lab`` ("" for the first): its
    first node is named ``first`` + the suffix."""
    tag: str
    for tag in ("", *"bcdefghijklmnopqrstuvwxyz"):
        if f"{first}{tag}" not in lab.nodes:
            return tag
    raise ConfigurationError("too many campaigns in one lab")


GATEWAY_PORT: Final = 7400


@dataclass
class CheckRun:
    """A ``fenced check`` run inside a lab: its exit status, report directory and faults;
    ``violations`` of the lab's own check of the kit's history (:func:`check_kit_losses`),
    ``placement`` (worker -> node, every worker the kit started), ``split_clients`` (each
    split's minority clients, by node: the lock holder's, while the others stayed on the
    majority side)."""

    returncode: int
    report: Path
    faults: list[dict[str, Any]]
    output: str
    violations: list[str] = field(default_factory=list)
    placement: dict[str, str] = field(default_factory=dict)
    split_clients: list[list[str]] = field(default_factory=list)
    losses: int = 0  # leases the workers learnt were lost while they held them
    checked_late: list[float] = field(default_factory=list)  # of those (not stopped): kit_losses
    losses_releasing: int = 0  # ... learnt when their release, begun in time, returned
    slowest_release: float = 0.0  # seconds from a release's send to its return


LAB_PLANTS: Final = ("ignore-loss",)
"""Plants of :func:`run_check` (in the kit's worker, through its environment): ``ignore-loss``,
a holder that takes no notice of its lease's loss and thinks for 3 ttls before its write."""


def run_check(
    source: str = "etcd",
    resource: str = "sql",
    *,
    seconds: float = 12.0,
    ttl: float = 1.5,
    workers: int = 3,
    client_nodes: int | None = None,
    kit_nemesis: str = "pause",
    plant: str = "",
    lab_plant: str = "",
    nemeses: tuple[str, ...] = NEMESES,
    gateway: bool = False,
    directory: str | None = None,
    think: float | None = None,
    shared: tuple[Any, Any] | None = None,
) -> CheckRun:
    """``fenced check`` (its public command line) run in a namespace of its own (``ck``)
    against a 3-member cluster in the lab, its workers in namespaces of their own: worker N
    in node ``w((N-1) mod client_nodes)+1`` (default: one node per worker), through
    ``FENCED_CHECK_NETNS``. Meanwhile this module's nemesis partitions the cluster around
    them: each split cuts the lock holder's node off with one member while the other workers
    stay on the majority side. Each fault is also written to the check's ``history.jsonl``
    as a ``nemesis`` event, so its HTML report draws the partitions on its timeline; the
    kit's history is then checked for losses learnt in time (:func:`check_kit_losses`).
    ``gateway``: a ``fenced serve`` in every node (the kit's and each worker's, on
    127.0.0.1) in front of the cluster, the workers' source: a split cuts the holder's
    gateway off with it, the others' stay on the majority side. ``think``: how long the
    workers think between read and write (the kit's is up to ttl/4, over before a lease can
    end): at 2 ttls a holder cut off mid-think outlives its lease while it holds it, and
    learns of its loss then. ``shared=(lab, cluster)``: in that lab, on that started cluster
    of ``source`` (left running), as :func:`run_campaign`'s: its nodes get names of their own
    (``ck<tag>``, ``w1<tag>``, ...) and its gateways are stopped at its end.
    """
    from fenced.testing.check._campaign import NETNS_ENV
    from fenced.testing.check._history import History, read_history
    from fenced.testing.check._worker import LAB_PLANT_ENV, LAB_THINK_ENV
    from fenced.testing.netclusters import EtcdNetCluster, RedisNet, ZooKeeperNetCluster
    from fenced.testing.netns import NetLab

    if not set(nemeses) <= set(NEMESES) or not nemeses:
        raise ConfigurationError(f"nemeses {nemeses!r}: some of {', '.join(NEMESES)}")
    if lab_plant and lab_plant not in LAB_PLANTS:
        raise ConfigurationError(f"lab plant {lab_plant!r}: one of {', '.join(LAB_PLANTS)}")
    spread = workers if client_nodes is None else client_nodes
    if not 1 <= workers <= 20 or not 1 <= spread <= workers:
        raise ConfigurationError("workers 1..20, client_nodes 1..workers")
    d = Path(directory or tempfile.mkdtemp(prefix="fenced-partitions-check-"))
    d.mkdir(parents=True, exist_ok=True)
    report = d / "report"
    history = report / "history.jsonl"
    with contextlib.ExitStack() as stack:
        if shared is None:
            lab = stack.enter_context(NetLab("ck" + source[:4]))
            cluster = (EtcdNetCluster if source == "etcd" else ZooKeeperNetCluster)(lab)
        else:
            lab, cluster = shared
        tag = _free_tag(lab, "ck")
        first_fault = len(lab.faults)
        redis = None
        gateways: list[Any] = []
        try:
            if shared is None:
                cluster.start()
            if resource == "redis":
                redis = RedisNet(lab, f"rk{tag}")  # (not a campaign's r1<tag>)
                res = redis.url
            else:
                res = f"sqlite:///{(d / 'register.db').resolve()}?table=fenced_check"
            node = lab.add(f"ck{tag}")
            homes = [lab.add(f"w{i + 1}{tag}") for i in range(spread)]
            url = cluster.url
            if gateway:
                # A gateway beside each client, as on its host: cut off with it, or not.
                names = [node.name] + [h.name for h in homes]
                gateways = _start_gateways(lab, names, url, d, local=True)
                url = f"http://127.0.0.1:{GATEWAY_PORT}"
            argv = [
                sys.executable, "-m", "fenced", "check", "--source", url, "--resource", res,
                "--time", str(seconds), "--ttl", str(ttl), "--workers", str(workers),
                "--nemesis", kit_nemesis, "--report", str(report),
                *(["--plant", plant] if plant else []),
            ]  # fmt: skip
            env = {**_python_env(), NETNS_ENV: ",".join(h.ns for h in homes)}
            if lab_plant:
                env[LAB_PLANT_ENV] = lab_plant
            if think is not None:
                env[LAB_THINK_ENV] = str(think)
            out_log = d / "check.log"
            proc = lab.run(node, argv, log=out_log, env=env)
            stop = threading.Event()

            def started() -> bool:
                try:
                    return '"op":"grant"' in history.read_text()
                except OSError:
                    return False

            def holder() -> str | None:
                """The node of the worker granted the lock in the last 0.5 s and holding it."""
                who = _kit_holder(history, 0.5)
                return None if who is None else homes[(int(who[1:]) - 1) % spread].name

            split_clients: list[list[str]] = []
            if _wait_for(started, 60, stop) and proc.alive():
                faults = History(history, "nemesis")
                clients = {h.name for h in homes}

                def on_fault(kind: str, detail: str, length: float) -> None:
                    # One lane, "network", for every fault of the lab; the kind (which the
                    # report shows as the band's title) carries the detail.
                    faults.append("nemesis", kind=f"{kind} {detail}", victim="network",
                                  seconds=length)  # fmt: skip

                skip = {m.name for m in cluster.nodes} | ({redis.node.name} if redis else set())
                others = [n for n in lab.nodes if n not in skip]
                # (The kit deals faults for --time from when its workers are up, after
                # this: the lab's end first.)
                _nemesis(lab, cluster, holder, others, max(seconds - 3.0, 1.0), ttl,
                         nemeses, on_fault=on_fault)  # fmt: skip
                faults.close()
                split_clients = [
                    sorted(set(f.sides[0]) & clients)
                    for f in lab.faults[first_fault:]
                    if f.kind == "split"
                ]
            try:
                code = proc.proc.wait(seconds + 120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = -9
            lab.end_faults()
            events = read_history(history) if history.exists() else []
            # Every worker the kit started (each has its log), not only those that acted: a
            # worker that waited out the whole run for its turn was placed all the same.
            logged = {p.stem.removeprefix("worker-") for p in report.glob("worker-w*.log")}
            serials = sorted(
                {w for w in {e["worker"] for e in events} | logged if w[1:].isdigit()},
                key=lambda w: int(w[1:]),
            )
            letting_go = set()
            releasing = 0
            for e in events:
                if e["op"] == "releasing":
                    letting_go.add((e["worker"], e["token"]))
                elif e["op"] == "lost" and (e["worker"], e["token"]) in letting_go:
                    releasing += 1
            lost = sum(e["op"] == "lost" for e in events) - releasing
            violations, checked = kit_losses(events)
            slowest = max((e["mono"] - e["sent"] for e in events if e["op"] == "release"),
                          default=0.0)  # fmt: skip
            return CheckRun(
                code, report, [f.as_dict() for f in lab.faults[first_fault:]],
                out_log.read_text(errors="replace"), violations,
                {w: homes[(int(w[1:]) - 1) % spread].name for w in serials},
                split_clients, lost, checked, releasing, slowest,
            )  # fmt: skip
        finally:
            if shared is None:
                cluster.close()
            else:
                for g in gateways:
                    if g.alive():
                        g.kill()  # (the lab goes on)
            if redis is not None:
                redis.close()


def _kit_holder(path: Path, fresh: float) -> str | None:
    """The kit's worker granted the lock less than ``fresh`` s ago and not releasing it, by
    the kit's history (its times are ``fenced._core.clock.now()``)."""
    from fenced._core import clock as _clock

    current: dict[str, float | None] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError:
        return None
    for line in lines:
        if b'"op":"grant"' in line or b'"op":"releasing"' in line or b'"op":"lost"' in line:
            with contextlib.suppress(ValueError):
                e = json.loads(line)
                current[e["worker"]] = e["mono"] if e["op"] == "grant" else None
    now = _clock.now()
    held = [w for w, t in current.items() if t is not None and now - t < fresh]
    return held[-1] if held else None


def check_kit_losses(events: list[dict[str, Any]]) -> list[str]:
    """The violations of loss learnt in time (see :func:`kit_losses`)."""
    return kit_losses(events)[0]


def kit_losses(events: list[dict[str, Any]]) -> tuple[list[str], list[float]]:
    """**Loss learnt in time**, on ``fenced check``'s history (see the module docstring):
    a worker that holds its lease learns it is lost (a ``lost`` event) no later than
    ``LOSS_SLACK`` after the end its ``remaining()`` had promised, and sends no write
    believing it holds (``lost`` false) later than that. From its ``releasing`` on it holds
    nothing (a release cut off from the source returns when its request gives up, and
    reports the loss then: not a belief, left out). Leases of workers the kit's own nemesis
    stopped (``pause``, ``stall``) are left out too: a stopped process learns nothing until
    it runs again. Returns the violations, and for each loss that was checked (learnt while
    held, not stopped) how late it came after the promised end (< 0: before it)."""
    stopped: dict[str, list[tuple[float, float]]] = {}
    stalled = set()
    for e in events:
        if e["op"] == "nemesis" and e.get("kind") == "pause":
            # (its SIGCONT comes after ``seconds``, give or take the kit's scheduling)
            stopped.setdefault(e["victim"], []).append((e["mono"], e["mono"] + e["seconds"] + 0.5))
        elif e["op"] == "stalled":
            stalled.add((e["worker"], e["token"]))

    def excused(worker: str, token: int, a: float, b: float) -> bool:
        return (worker, token) in stalled or any(
            p0 < b and a < p1 for p0, p1 in stopped.get(worker, [])
        )

    bad: list[str] = []
    checked: list[float] = []
    promise: dict[tuple[str, int], float] = {}
    reported: set[tuple[str, int]] = set()
    for e in sorted(events, key=lambda e: e["mono"]):
        if e["op"] not in ("grant", "write", "lost", "releasing") or "token" not in e:
            continue
        key = (e["worker"], e["token"])
        if e["op"] == "grant" and "remaining" in e:
            promise[key] = e["mono"] + e["remaining"]
        elif e["op"] == "releasing":
            promise.pop(key, None)  # (it has let go: see above)
        elif key not in promise or key in reported:
            continue
        elif e["op"] == "write" and "lost" in e:
            promise[key] = max(promise[key], e.get("promised") or 0.0)
            if e["remaining"] > 0:
                promise[key] = max(promise[key], e["sent"] + e["remaining"])
            late = e["sent"] - promise[key]
            if not e["lost"] and late > LOSS_SLACK and not excused(*key, promise[key], e["sent"]):
                reported.add(key)
                bad.append(
                    f"loss not learnt: {key[0]} sent a write with token {key[1]} believing it "
                    f"held the lease, {late:.2f} s after remaining() said it would end"
                )
        elif e["op"] == "lost":
            promise[key] = max(promise[key], e.get("promised") or 0.0)
            late = e["mono"] - promise[key]
            if excused(*key, promise[key], e["mono"]):
                continue
            checked.append(late)
            if late > LOSS_SLACK:
                reported.add(key)
                bad.append(
                    f"loss learnt late: {key[0]} learnt token {key[1]}'s lease was lost "
                    f"{late:.2f} s after remaining() said it would end"
                )
    return bad, checked


def _start_gateways(
    lab: Any, names: list[str], source_url: str, d: Path, *, local: bool = False
) -> list[Any]:
    """``fenced serve`` in a node of its own each (started together, then awaited), in front
    of the cluster, without API keys: the lab's network is reachable from nowhere else.
    ``local``: in the named nodes, which exist already, on their 127.0.0.1 (a gateway beside
    its clients, reachable from them alone)."""
    started = []
    for name in names:
        node = lab.node(name) if local else lab.add(name)
        listen = f"{'127.0.0.1' if local else node.addr}:{GATEWAY_PORT}"
        argv = [
            sys.executable, "-m", "fenced", "serve", "--url", source_url,
            "--listen", listen, "--insecure-no-auth",
        ]  # fmt: skip
        started.append(lab.run(node, argv, log=d / f"{name}.log", env=_python_env()))
    deadline = time.monotonic() + 30
    for gw in started:
        assert gw.log is not None
        while "fenced serve: listening on" not in gw.log.read_text(errors="replace"):
            if not gw.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"fenced serve did not start:\n{gw.log_tail()}")
            time.sleep(0.05)  # a poll interval, bounded by the deadline
    return started


def _redis_log(url: str) -> list[tuple[int, str]]:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5)
    out = []
    for raw in client.lrange("{register}:log", 0, -1):
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        tok, _, value = text.partition(":")
        out.append((int(tok), value))
    return out


def _sql_log(path: Path) -> list[tuple[int, str]]:
    conn = sqlite3.connect(path)
    try:
        return [
            (int(t), str(v)) for t, v in conn.execute("SELECT token, value FROM reg ORDER BY n")
        ]
    finally:
        conn.close()


def _nemesis(
    lab: Any,
    cluster: Any,
    holder: Callable[[], str | None],
    others: list[str],
    duration: float,
    ttl: float,
    nemeses: tuple[str, ...],
    *,
    gateway_of: dict[str, str] | None = None,
    on_fault: Callable[[str, str, float], None] | None = None,
    lock_state: Callable[[], tuple[str | None, set[str]]] | None = None,
    split_wait: float = 6.0,
) -> None:
    """Faults, one after another, until ``duration`` is up (each bounded in time).

    ``others`` are the nodes that are not members (clients, gateways, resources);
    ``holder()`` names the client node holding the lock now (None: no one, or not known);
    ``on_fault(kind, victim, seconds)`` is told of each fault as it begins;
    ``lock_state()`` names the fresh holder and the clients waiting for the lock (a split
    then waits, up to ``split_wait`` s, for the moment that tests the holder's renewal: see
    :func:`_split_target`; a round of the lock through every client, whose sessions stay
    where they are).
    """
    stop = threading.Event()
    end = time.monotonic() + duration
    members = [n.name for n in cluster.nodes]
    gateway_of = gateway_of or {}
    # A split lasts long enough that a cut-off holder's lease runs out and the majority
    # grants the lock again; an isolated leader, long enough for a new election (500 ms).
    lengths = {"split-minority-holder": ttl * 2 + 0.5, "isolate-leader": ttl + 0.5,
               "pause": ttl, "flap": ttl + 0.3}  # fmt: skip
    # Every kind runs at least once, even past ``end`` (never past ``hard_end``).
    hard_end = end + sum(lengths[k] for k in nemeses) + 5.0
    done: set[str] = set()
    for i in range(64):  # bounded in count as well as time
        now = time.monotonic()
        if now >= hard_end or (now + 1.0 >= end and done >= set(nemeses)):
            break
        kind = nemeses[i % len(nemeses)]
        if kind in done and now + 1.0 >= end:
            continue  # only the kinds not yet seen, past the end
        length = lengths[kind] if kind not in done else min(lengths[kind], end - now)
        done.add(kind)
        if kind == "isolate-leader":
            leader = cluster.leader(timeout=5)
            if on_fault:
                on_fault("net-isolate", f"leader {leader} alone", length)
            lab.partition([leader], [m for m in members if m != leader] + others,
                          kind="isolate", detail=f"leader {leader} isolated")  # fmt: skip
            stop.wait(length)
            lab.heal()
        elif kind == "split-minority-holder":
            leader = cluster.leader(timeout=5)
            target = None
            if lock_state is not None:
                target = _wait_for(
                    lambda lead=leader: _split_target(
                        lab, cluster, lead, lock_state, gateway_of, ttl
                    ),
                    min(split_wait, max(end - now - 2.0, 1.0)), stop,
                )  # fmt: skip
            if target is None:  # not seen in time: the fresh holder, where it is
                who = _wait_for(holder, min(4.0, end - time.monotonic()), stop)
                if who is None:
                    continue
                follower = next(m for m in members if m != leader)
                # Its lock session's follower, where the source can tell (ZooKeeper): cut
                # off *with* it (else it is a plain cut from the source).
                serving = getattr(cluster, "serving", None)
                if serving is not None:
                    addr = lab.node(gateway_of.get(who, who)).addr
                    at = serving(addr, _session_ms(ttl)) or serving(addr)
                    if at is not None and at != leader:
                        follower = at
                target = (who, follower, "")
            who, follower, note = target
            minority = [follower, who] + ([gateway_of[who]] if who in gateway_of else [])
            majority = [m for m in members + others if m not in minority]
            detail = f"2/1: {', '.join(minority)} cut off{note}"
            if on_fault:
                on_fault("net-split", detail, length)
            lab.partition(minority, majority, kind="split", detail=detail)
            stop.wait(length)
            lab.heal()
        elif kind == "flap":
            victim = cluster.leader(timeout=5)
            if on_fault:
                on_fault("net-flap", f"{victim}'s link", length)
            lab.flap(victim, times=max(1, int(length / 0.6)), down=0.4, up=0.2, stop=stop)
        elif kind == "pause":
            victim = cluster.leader(timeout=5)
            if on_fault:
                on_fault("member-pause", f"{victim} SIGSTOP", length)
            lab.pause(cluster.member(victim), length, stop=stop)
        # Let the cluster settle before the next fault (bounded).
        with contextlib.suppress(Exception):
            cluster.leader(timeout=5)


def _queue_wait(clients: int, hold: float, ttl: float) -> float:
    """Seconds for the lock to go round ``clients`` clients holding ``hold`` s each (plus
    their hand-offs): a waiter's acquire timeout, since one that gives up goes to the back
    of the queue (with 3 s, at 3 clients holding 2 s, one client never held the lock and
    two took turns); and how long a split waits for its moment (each client holds once)."""
    return clients * (hold + ttl / 2) + ttl


def _session_ms(ttl: float) -> int:
    """The timeout (ms) of the ZooKeeper session a fenced client holds a ``ttl`` lock with
    (one session per ttl; its other, default one is idle)."""
    return max(1, round(ttl * 1000))


def _split_target(
    lab: Any,
    cluster: Any,
    leader: str,
    lock_state: Callable[[], tuple[str | None, set[str]]],
    gateway_of: dict[str, str],
    ttl: float,
) -> tuple[str, str, str] | None:
    """(the fresh holder, the follower to cut off with it, a note), once a split now would test
    the holder's renewal, else None. A waiter must be queued on the majority side, or
    nobody is granted the lock while the holder still counts on it, and the overlap a
    wrong renewal makes goes unseen. Where the source tells which member each client's
    lock session talks to (ZooKeeper's ``cons``), that member must be a follower (cut off
    *with* the holder: the case a renewal answered by that server alone gets wrong; a
    holder at the leader is only cut from the source), and the waiter's must be another
    member (one at the cut-off follower loses its server, and maybe its session and place,
    with the split)."""
    who, waiting = lock_state()
    if who is None:
        return None
    mine = gateway_of.get(who, who)
    waiting = {c for c in waiting if gateway_of.get(c, c) != mine}  # (its gateway is cut off)
    if not waiting:
        return None
    sessions = getattr(cluster, "sessions", None)
    note = f" ({', '.join(sorted(waiting))} waiting on the majority side)"
    if sessions is None:
        return who, next(n.name for n in cluster.nodes if n.name != leader), note
    at = sessions(_session_ms(ttl))
    follower = at.get(lab.node(mine).addr)
    if follower is None or follower == leader:
        return None
    ready = {
        c: m
        for c in waiting
        if (m := at.get(lab.node(gateway_of.get(c, c)).addr)) not in (None, follower)
    }
    if not ready:
        return None
    waiters = ", ".join(f"{c} at {m}" for c, m in sorted(ready.items()))
    return who, follower, f" ({waiters} waiting on the majority side)"


# -- the checker ----------------------------------------------------------------------------


def check(events: list[dict[str, Any]], register: list[tuple[int, str]]) -> list[str]:
    """The violations of the campaign's invariants (see the module docstring)."""
    bad: list[str] = []
    grants = [e for e in events if e["kind"] == "grant"]
    # Tokens rising: a grant that began after another was received has a higher token.
    by_end = sorted(grants, key=lambda g: g["t"])
    for i, g in enumerate(by_end):
        for h in by_end[i + 1 :]:
            if h["start"] > g["t"] and h["token"] <= g["token"]:
                bad.append(f"tokens: {h['client']} got {h['token']} after {g['token']} was granted")
    # No stale write accepted: the register's tokens never go down.
    for (a, _), (b, vb) in zip(register, register[1:], strict=False):
        if b < a:
            bad.append(f"stale write accepted: token {b} ({vb}) after {a}")
    # No acknowledged write lost.
    stored = {v for _, v in register}
    for e in events:
        if e["kind"] == "write" and e["result"] == "ok" and e["value"] not in stored:
            bad.append(f"acknowledged write lost: {e['value']} (token {e['token']})")
    # The holder can write: a refusal needs a higher token granted before the write ended.
    for e in events:
        if (
            e["kind"] == "write"
            and e["result"] == "refused"
            and not any(g["token"] > e["token"] and g["t"] <= e["t"] for g in grants)
        ):
            bad.append(f"holder refused: {e['value']} with token {e['token']}")
    # Leases exclusive: remaining() > 0 means "surely held", so no higher token may have
    # been granted to anyone else by then (fencing still refuses the overlap's writes).
    overlapped: set[tuple[str, int]] = set()
    for e in events:
        if e["kind"] != "sample" or e["remaining"] <= 0:
            continue
        key = (e["client"], e["token"])
        if key in overlapped:
            continue
        newer = [g for g in grants if g["token"] > e["token"] and g["t"] < e["t"]]
        if newer:
            overlapped.add(key)
            g = newer[0]
            bad.append(
                f"lease overlap: {e['client']} had remaining()={e['remaining']:.2f} s for token "
                f"{e['token']} {e['t'] - g['t']:.2f} s after {g['client']} was granted "
                f"{g['token']}: it counted on the lease {e['t'] + e['remaining'] - g['t']:.2f} s "
                "into its successor's"
            )
    # Loss learnt in time: belief in the lease never outlives its promise (+ slack).
    promise: dict[tuple[str, int], float] = {}
    for e in events:
        key = (e["client"], e.get("token", -1))
        if e["kind"] in ("grant", "sample"):
            if e["remaining"] > 0:
                promise[key] = max(promise.get(key, 0.0), e["t"] + e["remaining"])
            if e["kind"] == "sample" and e["believes"] and key in promise:
                late = e["t"] - promise[key]
                if late > LOSS_SLACK:
                    bad.append(
                        f"loss not learnt: {e['client']} still believed it held token "
                        f"{e['token']} {late:.2f} s after remaining() said it would end"
                    )
                    promise[key] = float("inf")  # one report per lease
        elif e["kind"] == "lost" and key in promise and e["at"] - promise[key] > LOSS_SLACK:
            bad.append(
                f"loss learnt late: {e['client']} token {e['token']} lost "
                f"{e['at'] - promise[key]:.2f} s after its promise"
            )
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fenced.testing.partitions")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("client")
    c.add_argument("--name", required=True)
    c.add_argument("--source", required=True)
    c.add_argument("--resource", required=True)
    c.add_argument("--history", required=True)
    c.add_argument("--duration", type=float, required=True)
    c.add_argument("--ttl", type=float, required=True)
    c.add_argument("--hold", type=float, required=True)
    c.add_argument("--acquire-timeout", type=float, default=3.0)
    c.add_argument("--every", type=float, default=0.1)
    c.add_argument("--safety-margin", type=float, default=None)
    c.add_argument("--plant")
    r = sub.add_parser("run")
    r.add_argument("--source", choices=("etcd", "zookeeper"), default="etcd")
    r.add_argument("--resource", choices=("sql", "redis"), default="sql")
    r.add_argument("--duration", type=float, default=14.0)
    r.add_argument("--runs", type=int, default=1)
    r.add_argument("--plant", help=f"some of {', '.join(PLANTS)}, comma-separated")
    r.add_argument("--dir")
    r.add_argument("--nemeses", default=",".join(NEMESES))
    r.add_argument("--gateways", action="store_true", help="clients go through fenced serve")
    r.add_argument("--ttl", type=float, default=1.5)
    r.add_argument("--safety-margin", type=float, default=None)
    args = p.parse_args(argv)
    if args.cmd == "client":
        asyncio.run(_client(args))
        return 0
    failed = 0
    for i in range(max(1, min(args.runs, 1000))):
        sub_dir = None if args.dir is None else str(Path(args.dir) / f"run{i}")
        camp = run_campaign(
            args.source, args.resource, duration=args.duration, plant=args.plant,
            directory=sub_dir, nemeses=tuple(args.nemeses.split(",")), gateways=args.gateways,
            ttl=args.ttl, safety_margin=args.safety_margin,
        )  # fmt: skip
        print(json.dumps({"run": i, "summary": camp.summary(), "counts": camp.counts(),
                          "violations": camp.violations[:20], "known": camp.known[:20]}),
              flush=True)  # fmt: skip
        failed += bool(camp.violations)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
