"""A check campaign: worker processes on the user's token source, a seeded nemesis, one
history, every checker (see docs/testing.md).

The resource is an embedded SQLite counter behind ``SQLGuard`` in the campaign's directory
(the user's own resources come with the kit's adapters, still to come). The nemesis pauses
workers with SIGSTOP for two ttls (``pause``: anywhere; ``stall``: inside the critical
section, between the read and the guarded write — DDIA's GC pause), kills them with SIGKILL (a replacement starts), and (for a
source reached over TCP) partitions one worker from the source for two ttls through its own
:class:`~fenced.testing.proxy.TcpProxy`, on a schedule drawn from ``seed``: the same seed,
the same schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from ..._errors import ConfigurationError
from ...guards.sql import SQLGuard
from ..proxy import TcpProxy
from ..servers import python_env
from ._checkers import Violation, check_all
from ._history import History, read_history
from ._report import write_report

__all__ = ["NEMESES", "PLANTS", "CampaignResult", "run_campaign"]

NEMESES = ("pause", "stall", "kill", "partition")
PLANTS = ("no-fence", "unfenced-read")


@dataclasses.dataclass
class CampaignResult:
    violations: list[Violation]
    report: Path
    history: Path
    grants: int
    accepted: int
    refused: int
    faults: dict[str, int]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.violations


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return True  # gone: nothing to wait for


def _resume_after(pid: int, seconds: float, limit: float = 30.0) -> None:
    """Once ``pid`` has stopped itself (it may be between two rounds), let it sleep
    ``seconds`` — past its lease — and continue it."""
    deadline = time.monotonic() + limit
    while not _stopped(pid) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(seconds)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGCONT)


def _setup_resource(db: Path) -> None:
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE counter (n INTEGER NOT NULL)")
    conn.execute("INSERT INTO counter VALUES (0)")
    conn.execute("CREATE TABLE log (seq INTEGER PRIMARY KEY, token INTEGER, value INTEGER)")
    SQLGuard("counter").install(conn)
    conn.commit()
    conn.close()


def run_campaign(
    source: str,
    out: str | Path,
    *,
    workers: int = 3,
    seconds: float = 20.0,
    ttl: float = 1.0,
    nemesis: Sequence[str] = NEMESES,
    seed: int = 0,
    plant: str = "",
    progress: Callable[[str], None] | None = None,
) -> CampaignResult:
    unknown = set(nemesis) - set(NEMESES)
    if unknown or (plant and plant not in PLANTS):
        raise ConfigurationError(f"unknown nemesis {sorted(unknown)} or plant {plant!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    db, path = out / "resource.db", out / "history.jsonl"
    for stale in (db, path):
        stale.unlink(missing_ok=True)
    _setup_resource(db)
    rng = random.Random(seed)
    env = python_env()
    serial = 0

    def spawn() -> subprocess.Popen[bytes]:
        nonlocal serial
        serial += 1
        slot: list[TcpProxy] = []
        url = worker_url(slot)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fenced.testing.check._worker",
                url,
                str(db),
                str(path),
                f"w{serial}",
                str(ttl),
                str(seed),
                plant,
            ],
            stdin=subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group: signals reach it alone
        )
        if slot:
            proxies[proc.pid] = slot[0]
        names[proc.pid] = f"w{serial}"
        return proc

    proxies: dict[int, TcpProxy] = {}  # worker pid -> its own way to the source
    names: dict[int, str] = {}  # worker pid -> its name in the history

    def worker_url(pid_slot: list[TcpProxy]) -> str:
        if "partition" not in nemesis:
            return source
        parts = urlsplit(source)
        if not parts.hostname or not parts.port or "," in parts.netloc:
            raise ConfigurationError(
                "the partition nemesis needs a source at one host:port (not a file, not a list)"
            )
        proxy = TcpProxy(parts.hostname, parts.port).start()
        pid_slot.append(proxy)
        netloc = parts.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{proxy.port}"
        return urlunsplit(
            parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host)
        )

    procs = [spawn() for _ in range(workers)]
    history = History(path, "nemesis")
    faults = {n: 0 for n in nemesis}
    stalls: list[threading.Thread] = []
    start = time.monotonic()
    try:
        while time.monotonic() - start < seconds:
            time.sleep(rng.uniform(0.5, 1.5) * ttl)  # (the schedule's own clock, not a sync)
            if not nemesis:
                continue
            kind = rng.choice(list(nemesis))
            i = rng.randrange(len(procs))
            victim = procs[i]
            faults[kind] += 1
            history.append(
                "nemesis",
                kind=kind,
                victim=names[victim.pid],
                seconds=2 * ttl if kind in ("pause", "stall", "partition") else 0,
            )
            if progress:
                progress(f"{time.monotonic() - start:5.1f} s: {kind} {names[victim.pid]}")
            if kind == "pause":
                os.killpg(victim.pid, signal.SIGSTOP)
                time.sleep(2 * ttl)  # past its lease: a successor is granted meanwhile
                os.killpg(victim.pid, signal.SIGCONT)
            elif kind == "stall":  # it stops itself inside its critical section
                os.kill(victim.pid, signal.SIGUSR1)
                stalls.append(
                    threading.Thread(target=_resume_after, args=(victim.pid, 2 * ttl), daemon=True)
                )
                stalls[-1].start()
            elif kind == "partition":
                proxies[victim.pid].partition()  # its renewals cannot reach the source
                time.sleep(2 * ttl)
                proxies[victim.pid].heal()
            else:
                os.killpg(victim.pid, signal.SIGKILL)
                victim.wait()
                old = proxies.pop(victim.pid, None)
                if old is not None:
                    old.close()
                procs[i] = spawn()
    finally:
        for t in stalls:
            t.join(10 * ttl + 10)
        for p in procs:  # (a stall asked for but not yet taken must not stop it for good)
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR2)
                os.killpg(p.pid, signal.SIGCONT)
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()  # finish the current round and stop
        for p in procs:
            try:
                p.wait(30 * ttl + 30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for proxy in proxies.values():
            proxy.close()
        conn = sqlite3.connect(db)
        log = [list(r) for r in conn.execute("SELECT token, value FROM log ORDER BY seq")]
        mark = SQLGuard("counter").high_water(conn)
        conn.close()
        history.append("final", lock="counter", mark=mark.value if mark else 0, log=log)
        history.close()
    events = read_history(path)
    writes = [e for e in events if e["op"] == "write"]
    violations = check_all(events)
    report = write_report(events, violations, out / "report.html")
    return CampaignResult(
        violations=violations,
        report=report,
        history=path,
        grants=sum(1 for e in events if e["op"] == "grant"),
        accepted=sum(1 for e in writes if e["ok"]),
        refused=sum(1 for e in writes if not e["ok"]),
        faults=faults,
        seconds=time.monotonic() - start,
    )
