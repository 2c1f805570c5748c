"""``fenced demo``: DDIA Figure 8-5 with real OS processes, fenced and then unfenced.

Client 1 takes the lock and is paused (SIGSTOP, a stand-in for a GC pause or a VM migration)
before it writes. Its lease expires; client 2 takes the lock with a higher token and writes.
Client 1 is resumed (SIGCONT) and writes as if it still held the lock. With the guard the
storage rejects that write; without it, client 2's write is silently overwritten.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue
from typing import Any

from ._console import Printer, make_printer, panel

__all__ = ["as_theory_says", "run_demo", "scenario"]

LOCK = "file-storage"
FILE = "report.txt"
STEP_TIMEOUT = 60.0


# -- the client process ------------------------------------------------------------------


class WorkerExited(RuntimeError):
    """A demo's worker process ended before the step it was expected to report (its
    traceback, if any, is in the message): the demo did not go as it should."""


class _Storage:
    """The protected resource: a table in SQLite (a file path) or PostgreSQL (a DSN)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.is_pg = target.startswith(("postgresql://", "postgres://"))

    def connect(self) -> Any:
        if self.is_pg:
            import psycopg

            return psycopg.connect(self.target, autocommit=True)
        return sqlite3.connect(self.target, isolation_level=None)

    def begin(self, db: Any) -> None:
        db.execute("BEGIN" if self.is_pg else "BEGIN IMMEDIATE")

    def sql(self, text: str) -> str:
        return text.replace("?", "%s") if self.is_pg else text

    def setup(self, fenced_mode: bool) -> None:
        from fenced.guards.sql import SQLGuard

        db = self.connect()
        try:
            if not self.is_pg:
                db.execute("PRAGMA journal_mode=WAL")
            db.execute(
                "CREATE TABLE IF NOT EXISTS files (name TEXT PRIMARY KEY, content TEXT, written_by TEXT)"
            )
            db.execute(self.sql("DELETE FROM files WHERE name = ?"), (FILE,))
            db.execute(self.sql("INSERT INTO files VALUES (?, 'original', 'nobody')"), (FILE,))
            if fenced_mode:
                SQLGuard(LOCK).install(db)
        finally:
            db.close()

    def read(self) -> tuple[str, str]:
        db = self.connect()
        try:
            row = db.execute(
                self.sql("SELECT content, written_by FROM files WHERE name = ?"), (FILE,)
            ).fetchone()
            return str(row[0]), str(row[1])
        finally:
            db.close()


def _client(url: str, target: str, who: str, ttl: float, fenced_mode: bool) -> int:
    """One client: acquire, then obey 'write'/'release' lines on stdin, report JSON on stdout."""
    import fenced
    from fenced.guards.sql import SQLGuard

    storage = _Storage(target)

    def emit(event: str, **data: Any) -> None:
        print(json.dumps({"event": event, "who": who, **data}), flush=True)

    with fenced.connect(url) as locks:
        lease = locks.lock(LOCK, ttl=ttl, timeout=STEP_TIMEOUT)
        token = lease.acquire()
        emit("acquired", token=str(token))
        db = storage.connect()
        for line in sys.stdin:
            command, _, arg = line.strip().partition(" ")
            if command == "write":
                # The client believes it holds the lock: it checked before its pause.
                try:
                    storage.begin(db)
                    if fenced_mode:
                        SQLGuard(LOCK).check(db, token=token)
                    db.execute(
                        storage.sql("UPDATE files SET content = ?, written_by = ? WHERE name = ?"),
                        (arg, f"{who} ({token})", FILE),
                    )
                    db.execute("COMMIT")
                    emit("write-ok", token=str(token))
                except fenced.StaleTokenError as exc:
                    db.execute("ROLLBACK")
                    emit("write-rejected", token=str(exc.token), high_water=str(exc.high_water))
            elif command == "release":
                emit("released", released=lease.release(), lost=lease.lost.is_set())
                return 0
    return 0


# -- the orchestrator --------------------------------------------------------------------


@dataclass
class _Proc:
    who: str
    popen: subprocess.Popen[str]
    events: Queue[dict[str, Any]] = field(default_factory=Queue)

    def start_reader(self) -> None:
        def read() -> None:
            assert self.popen.stdout is not None
            for line in self.popen.stdout:
                try:
                    self.events.put(json.loads(line))
                except json.JSONDecodeError:
                    self.events.put({"event": "output", "line": line.rstrip()})
            self.events.put({"event": "exit"})

        threading.Thread(target=read, daemon=True).start()

    def send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def expect(self, *events: str) -> dict[str, Any]:
        deadline = time.monotonic() + STEP_TIMEOUT
        while True:
            try:
                ev = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except Empty:
                raise RuntimeError(
                    f"{self.who}: no {'/'.join(events)} within {STEP_TIMEOUT} s"
                ) from None
            if ev["event"] in events:
                return ev
            if ev["event"] == "exit":
                err = self.popen.stderr.read() if self.popen.stderr else ""
                raise WorkerExited(f"{self.who} exited early: {err}")

    def close(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGCONT)
            self.popen.kill()
        self.popen.wait()


class _Timeline:
    def __init__(self, console: Printer) -> None:
        self.console = console
        self.t0 = time.monotonic()

    def __call__(self, actor: str, text: str) -> None:
        style = {
            "client 1": "cyan",
            "client 2": "magenta",
            "storage": "yellow",
            "clock": "dim",
        }.get(actor, "white")
        self.console.print(
            f"  [dim]{time.monotonic() - self.t0:6.2f}s[/dim]  [{style}]{actor:<9}[/{style}] {text}"
        )


def _spawn(who: str, url: str, storage: str, ttl: float, fenced_mode: bool) -> _Proc:
    cmd = [sys.executable, "-m", "fenced.cli._demo", "client", url, storage, who, str(ttl)]
    cmd.append("fenced" if fenced_mode else "unfenced")
    popen = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc = _Proc(who, popen)
    proc.start_reader()
    return proc


def scenario(
    console: Printer, url: str, storage_target: str, ttl: float, fenced_mode: bool
) -> dict[str, Any]:
    """One run of Figure 8-5: token source ``url``, resource ``storage_target``."""
    label = "with the fencing guard" if fenced_mode else "WITHOUT the guard"
    console.print(panel(f"Run {1 if fenced_mode else 2}: storage {label}"))
    storage = _Storage(storage_target)
    storage.setup(fenced_mode)

    log = _Timeline(console)
    c1 = _spawn("client 1", url, storage_target, ttl, fenced_mode)
    c2: _Proc | None = None
    try:
        t1 = c1.expect("acquired")["token"]
        log("client 1", f"acquires the lock → token [bold]{t1}[/bold]")
        os.kill(c1.popen.pid, signal.SIGSTOP)
        log("client 1", "[red]paused[/red] by SIGSTOP (think: a long GC pause) before it writes")
        c2 = _spawn("client 2", url, storage_target, ttl, fenced_mode)
        log("client 2", "asks for the lock and waits …")
        t2 = c2.expect("acquired")["token"]
        log("clock", f"client 1's {ttl:g} s lease expired during its pause")
        log("client 2", f"acquires the lock → token [bold]{t2}[/bold]")
        c2.send("write data written by client 2")
        ev = c2.expect("write-ok", "write-rejected")
        ok2 = ev["event"] == "write-ok"
        log("storage", f"{'accepts' if ok2 else 'REJECTS'} client 2's write (token {t2})")
        c2.send("release")
        c2.expect("released")
        c1.send("write data written by client 1")
        os.kill(c1.popen.pid, signal.SIGCONT)
        log("client 1", "[green]resumed[/green] by SIGCONT; believes it holds the lock; writes")
        ev = c1.expect("write-ok", "write-rejected")
        ok1 = ev["event"] == "write-ok"
        if ok1:
            log(
                "storage",
                f"[red]accepts[/red] the stale write ({t1}): client 2's data is lost",
            )
        else:
            log(
                "storage",
                f"[green]rejects[/green] it: {ev['token']} < high-water mark {ev['high_water']}",
            )
        c1.send("release")
        rel = c1.expect("released")
        log("client 1", f"release → {rel['released']}; lease lost: {rel['lost']}")
    finally:
        c1.close()
        if c2 is not None:
            c2.close()
    content, by = storage.read()
    log("storage", f"{FILE}: {content!r} by {by}")
    return {"t1": t1, "t2": t2, "ok1": ok1, "ok2": ok2, "content": content}


def as_theory_says(run: dict[str, Any], fenced_mode: bool) -> bool:
    """Fenced: the stale write rejected, client 2's data kept. Unfenced: it overwrote client 2's."""
    higher = int(run["t2"].rpartition(":")[2]) > int(run["t1"].rpartition(":")[2])
    if fenced_mode:
        return bool(higher and run["ok2"] and not run["ok1"] and "client 2" in run["content"])
    return bool(higher and run["ok2"] and run["ok1"] and "client 1" in run["content"])


@contextlib.contextmanager
def _workdir(directory: str | None, prefix: str) -> Iterator[Path]:
    """A demo's directory: ``directory`` (made if missing, kept afterwards), else a temporary
    one named ``prefix...``, removed afterwards."""
    if directory is not None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def run_demo(directory: str | None = None, ttl: float = 1.0) -> int:
    """Run both scenarios; exit status 0 only if both came out as the theory says."""
    console = make_printer()
    console.print(
        "[bold]fenced demo[/bold]: DDIA Figure 8-5 with real processes. A lock holder is\n"
        "paused past its lease, another client takes the lock and writes, and the\n"
        "first one wakes up and writes too.\n"
    )
    with _workdir(directory, "fenced-demo-") as path:
        url = f"sqlite:///{path / 'locks.db'}"
        fenced_run = scenario(console, url, str(path / "storage-fenced.db"), ttl, fenced_mode=True)
        console.print()
        unfenced_run = scenario(
            console, url, str(path / "storage-unfenced.db"), ttl, fenced_mode=False
        )
    console.print()
    fenced_ok = fenced_run["ok2"] and not fenced_run["ok1"] and "client 2" in fenced_run["content"]
    unfenced_ok = (
        unfenced_run["ok2"] and unfenced_run["ok1"] and "client 1" in unfenced_run["content"]
    )
    if fenced_ok:
        console.print(
            f"[green]✔ fenced:[/green] the stale write ({fenced_run['t1']}) was rejected;\n"
            f"  client 2's data ({fenced_run['t2']}) is intact."
        )
    else:
        console.print(f"[red]✘ fenced run did not behave as expected:[/red] {fenced_run}")
    if unfenced_ok:
        console.print(
            f"[yellow]✔ unfenced:[/yellow] the stale write ({unfenced_run['t1']}) was accepted and\n"
            f"  overwrote client 2's write ({unfenced_run['t2']}): the data is corrupted."
        )
    else:
        console.print(f"[red]✘ unfenced run did not show the corruption:[/red] {unfenced_run}")
    if directory:  # (given, so kept)
        console.print(f"[dim]databases kept in {directory}[/dim]")
    from ._common import EXIT_VIOLATION  # (fenced's own outcomes never use 1)

    return 0 if fenced_ok and unfenced_ok else EXIT_VIOLATION


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "client":
        _, _, url, storage, who, ttl, mode = sys.argv
        sys.exit(_client(url, storage, who, float(ttl), mode == "fenced"))
    sys.exit(run_demo())
