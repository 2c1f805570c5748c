"""``fenced demo --replicated``: epoch fencing across three replicas, with real processes.

Three replicas (SQLite databases) hold a ledger as one group (``fenced.replicated``). Writer 1
takes the lock, writes to all three and is paused (SIGSTOP). Replica c crashes (its database
file is taken away, as a dead disk or host takes it). Writer 1's lease expires; writer 2 takes
the lock, fences a and b, finds c unreachable and removes it by a new configuration ordered by
the token source, then writes. Writer 1 is resumed and writes as if it still held the lock:
refused by every replica it reaches. Replica c comes back and is added again after catching
up (state transfer); writer 1 tries once more, and c refuses it too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from ._console import Printer, make_printer, panel
from ._demo import WorkerExited, _Proc, _Timeline, _workdir

__all__ = ["run_replicated_demo"]

GROUP = "ledger"
REPLICAS = ("a", "b", "c")


def _member(directory: Path, name: str) -> Any:
    from ..guards.sql import SQLGuard
    from ..replicated import SQLMember

    path = directory / f"replica-{name}.db"

    def connect() -> sqlite3.Connection:
        # mode=rw: a replica whose file is gone is unreachable, not silently recreated empty.
        return sqlite3.connect(f"file:{path}?mode=rw", uri=True, check_same_thread=False)

    # A connection per call: a crashed replica's file is really gone for the next call.
    return SQLMember(SQLGuard(GROUP), connect, GROUP, keep_connection=False)


class _Recorder:
    """A member that remembers its last answer, for the timeline."""

    def __init__(self, name: str, inner: Any, answers: dict[str, str]) -> None:
        self.name, self.inner, self.answers = name, inner, answers

    async def apply(
        self, token: Any, epoch: int, items: Any, *, reset: bool = False, since: int = 0
    ) -> None:
        import fenced

        try:
            await self.inner.apply(token, epoch, items, reset=reset, since=since)
            self.answers[self.name] = "accepted" if items else "fenced"
        except fenced.StaleTokenError as exc:
            self.answers[self.name] = f"REFUSED: token {exc.token} < mark {exc.high_water}"
            raise
        except fenced.StaleEpochError as exc:
            self.answers[self.name] = f"REFUSED: configuration epoch {epoch} < {exc.found}"
            raise
        except fenced.BackendUnavailable:
            self.answers[self.name] = "unreachable (down)"
            raise

    async def read(self, keys: Any = None) -> Any:
        return await self.inner.read(keys)

    async def aclose(self) -> None:
        await self.inner.aclose()


def client(url: str, directory: str, ttl: float) -> int:
    """One writer process: takes the lock, then obeys ``write VALUE`` / ``exit`` on stdin."""
    import fenced
    from fenced.replicated import Group

    def emit(event: str, **data: Any) -> None:
        print(json.dumps({"event": event, **data}), flush=True)

    answers: dict[str, str] = {}
    with fenced.connect(url) as locks:
        members = {n: _Recorder(n, _member(Path(directory), n), answers) for n in REPLICAS}
        group = Group(GROUP, locks, members, timeout=2.0)
        lease = locks.lock(GROUP, ttl=ttl)
        token = lease.acquire(timeout=60)
        emit("acquired", token=str(token))
        writer = group.writer(lease)
        cfg = writer.configuration
        assert cfg is not None
        emit("ready", answers=dict(answers), epoch=cfg.epoch, members=list(cfg.members))
        for line in sys.stdin:
            command, _, value = line.strip().partition(" ")
            if command == "write":
                answers.clear()
                try:
                    writer.set("balance", value)
                    ok = True
                except fenced.FencedError:
                    ok = False
                cfg = writer.configuration
                emit(
                    "written",
                    ok=ok,
                    answers=dict(answers),
                    epoch=cfg.epoch if cfg else None,
                    members=list(cfg.members) if cfg else [],
                )
            elif command == "exit":
                lease.release()
                emit("exited")
                return 0
    return 0


def _spawn(who: str, url: str, directory: Path, ttl: float) -> _Proc:
    cmd = [
        sys.executable,
        "-m",
        "fenced.cli._demo_replicated",
        "client",
        url,
        str(directory),
        str(ttl),
    ]
    popen = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc = _Proc(who, popen)
    proc.start_reader()
    return proc


def _answers(log: _Timeline, answers: dict[str, str]) -> None:
    for name in REPLICAS:
        if name in answers:
            text = answers[name]
            style = "red" if text.startswith("REFUSED") else "dim" if "down" in text else "green"
            log(f"replica {name}", f"[{style}]{text}[/{style}]")


def run_replicated_demo(directory: str | None = None, ttl: float = 1.0) -> int:
    """Run the scenario; exit status 0 only if it came out as the theory says."""
    import fenced
    from fenced.replicated import Group

    console: Printer = make_printer()
    console.print(
        "[bold]fenced demo --replicated[/bold]: one ledger on three replicas, a writer paused\n"
        "past its lease, a replica crash, a new writer, and reconfiguration through the\n"
        "token source.\n"
    )
    with _workdir(directory, "fenced-demo-replicated-") as path:
        for name in REPLICAS:
            (path / f"replica-{name}.db").unlink(missing_ok=True)
            sqlite3.connect(path / f"replica-{name}.db").close()
        url = f"sqlite:///{path / 'locks.db'}"
        console.print(panel("Three replicas a, b, c; configuration 1 = {a, b, c}"))
        log = _Timeline(console)
        w1 = w2 = None
        outcome: dict[str, Any] = {}
        try:
            w1 = _spawn("writer 1", url, path, ttl)
            t1 = w1.expect("acquired")["token"]
            log("writer 1", f"acquires the lock → token [bold]{t1}[/bold]; fences a, b, c")
            w1.expect("ready")
            w1.send("write 100")
            ev = w1.expect("written")
            log("writer 1", f"balance = 100 → {'acknowledged' if ev['ok'] else 'FAILED'}")
            _answers(log, ev["answers"])
            outcome["first"] = ev["ok"]
            os.kill(w1.popen.pid, signal.SIGSTOP)
            log("writer 1", "[red]paused[/red] by SIGSTOP (a long GC pause) before its next write")
            shutil.move(path / "replica-c.db", path / "replica-c.db.crashed")
            log("replica c", "[red]crashes[/red] (its database is gone)")
            w2 = _spawn("writer 2", url, path, ttl)
            log("writer 2", "asks for the lock and waits …")
            t2 = w2.expect("acquired")["token"]
            log("clock", f"writer 1's {ttl:g} s lease expired during its pause")
            log("writer 2", f"acquires the lock → token [bold]{t2}[/bold]; fences the replicas")
            ready = w2.expect("ready")
            _answers(log, ready["answers"])
            log(
                "writer 2",
                f"c is unreachable: removed by configuration {ready['epoch']} = "
                f"{{{', '.join(ready['members'])}}} (a compare-and-set in the token source)",
            )
            w2.send("write 250")
            ev = w2.expect("written")
            log("writer 2", f"balance = 250 → {'acknowledged' if ev['ok'] else 'FAILED'}")
            _answers(log, ev["answers"])
            outcome["second"] = ev["ok"]
            w2.send("exit")
            w2.expect("exited")
            w1.send("write 90")
            os.kill(w1.popen.pid, signal.SIGCONT)
            log("writer 1", "[green]resumed[/green]; believes it holds the lock; balance = 90")
            ev = w1.expect("written")
            _answers(log, ev["answers"])
            log("writer 1", f"→ {'[red]ACKNOWLEDGED[/red]' if ev['ok'] else 'not acknowledged'}")
            outcome["stale"] = ev["ok"]
            shutil.move(path / "replica-c.db.crashed", path / "replica-c.db")
            log("replica c", "restarts, with its old data (balance = 100, token mark " + t1 + ")")
            with fenced.connect(url) as locks:
                group = Group(GROUP, locks, {n: _member(path, n) for n in REPLICAS}, timeout=5.0)
                cfg = group.reconfigure(add=["c"])
                log(
                    "operator",
                    f"adds c back: state copied from a, then configuration {cfg.epoch} = "
                    f"{{{', '.join(cfg.members)}}}",
                )
                w1.send("write 80")
                ev = w1.expect("written")
                log("writer 1", "tries again: balance = 80")
                _answers(log, ev["answers"])
                outcome["stale_again"] = ev["ok"]
                outcome["c_refused"] = ev["answers"].get("c", "").startswith("REFUSED")
                console.print()
                console.print(panel(f"Final state (configuration {cfg.epoch})"))
                states = []
                for name in REPLICAS:
                    snap = group.portal.call(group.aio.member(name).read(None))
                    item = snap.items.get("balance")
                    value = item.value.decode() if item and item.value else None
                    states.append(value)
                    console.print(
                        f"  replica {name}: balance = {value}   token mark {snap.token}   "
                        f"epoch {snap.epoch}"
                    )
                group.close()
            outcome["states"] = states
        except fenced.FencedError as exc:  # (the verdict below says it did not go as it should)
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        except WorkerExited as exc:  # (a worker failed closed, or crashed: the same verdict)
            lines = [line for line in str(exc).splitlines() if line.strip()]
            outcome["error"] = f"{lines[0].split(':')[0]}: {lines[-1]}"
        finally:
            for p in (w1, w2):
                if p is not None:
                    p.close()
    console.print()
    ok = (
        outcome.get("first") is True
        and outcome.get("second") is True
        and outcome.get("stale") is False
        and outcome.get("stale_again") is False
        and outcome.get("c_refused") is True
        and outcome.get("states") == ["250"] * 3
    )
    if ok:
        console.print(
            "[green]✔ fenced:[/green] writer 1's late writes were refused by every replica it\n"
            "  reached; every replica of the final configuration holds writer 2's balance."
        )
        return 0
    console.print(f"[red]✘ the replicated run did not behave as expected:[/red] {outcome}")
    from ._common import EXIT_VIOLATION  # (fenced's own outcomes never use 1)

    return EXIT_VIOLATION


if __name__ == "__main__":
    if sys.argv[1:2] != ["client"]:
        sys.exit(2)  # (the only entry point: fenced demo --replicated starts the rest)
    sys.exit(client(sys.argv[2], sys.argv[3], float(sys.argv[4])))
