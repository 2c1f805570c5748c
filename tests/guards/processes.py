"""Guard tests with real client processes (``tests.workers.guard_writer``): the runners and
the checkers of their outcomes, shared by every guard's tests."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import threading
from typing import Any

from fenced import FencingToken
from fenced.testing import forkserver
from tests.helpers import ROOT
from tests.workers.guard_writer import LOCK, STEP_TIMEOUT

__all__ = [
    "BAD_TOKENS",
    "LOCK",
    "STEP_TIMEOUT",
    "Proc",
    "figure_8_5_violations",
    "history_violations",
    "paused_holder",
    "race",
]

WORKER = "tests.workers.guard_writer"


BAD_TOKENS: list[Any] = [
    "inv-lock:0",
    "inv-lock:-1",
    "inv-lock:01",
    " inv-lock:5",
    "inv-lock:5 ",
    "inv-lock:9223372036854775808",
    "inv-lock",
    "",
    b"\xff\xfe",
    5,
    None,
    FencingToken("other-lock", 10**9),
]


def history_violations(log: list[int], data: str | None) -> list[str]:
    """The resource's accepted tokens must never go down, and the data is the last writer's."""
    bad = [f"token {b} accepted after {a}" for a, b in itertools.pairwise(log) if b < a]
    if log and (data is None or int(data.split(":")[0]) != max(log)):
        bad.append(f"data {data!r} is not from the highest accepted token {max(log)}")
    return bad


class Proc:
    """A client process (``python -m WORKER *args``) speaking JSON lines on stdout, commands
    on stdin: forked from the testing room's fork server, which has imported the worker (no
    Python start-up and no ``import fenced`` a client; ``FENCED_FORKSERVER=0``: an exec)."""

    def __init__(self, *args: str) -> None:
        self.popen = forkserver.popen(
            WORKER,
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            warm=(WORKER,),
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with contextlib.suppress(ValueError):
                self.events.put(json.loads(line))
        self.events.put(None)

    def expect(self, *events: str, timeout: float = STEP_TIMEOUT) -> dict[str, Any]:
        try:
            ev = self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {events} from the client after {timeout} s") from None
        if ev is None or ev["event"] not in events:
            self.popen.kill()
            assert self.popen.stderr is not None
            raise AssertionError(
                f"expected {events}, got {ev}; stderr:\n{self.popen.stderr.read()}"
            )
        return ev

    def send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, signal.SIGCONT)
        self.popen.kill()
        self.popen.wait()


def race(target: str, resource: str, writers: int, per_writer: int) -> list[int]:
    """Start ``writers`` processes; writer i offers tokens i+1, i+1+writers, ... all at once.

    Returns how many writes each process saw accepted, in process order.
    """
    procs = [
        Proc("race", target, resource, str(i + 1), str(writers), str(per_writer))
        for i in range(writers)
    ]
    try:
        for p in procs:
            p.expect("ready")
        for p in procs:
            p.send("go")
        return [p.expect("done")["accepted"] for p in procs]
    finally:
        for p in procs:
            p.close()


def paused_holder(source_url: str, target: str, resource: str, guarded: bool) -> dict[str, Any]:
    """Figure 8-5: holder 1 is SIGSTOPped past its ttl, holder 2 writes, holder 1 resumes and writes."""
    mode = "guarded" if guarded else "unguarded"
    c1 = Proc("holder", source_url, target, resource, "1.0", mode)
    c2: Proc | None = None
    try:
        t1 = c1.expect("acquired")["token"]
        os.kill(c1.popen.pid, signal.SIGSTOP)  # before it writes
        c2 = Proc("holder", source_url, target, resource, "1.0", mode)
        t2 = c2.expect("acquired")["token"]  # only after c1's lease ran out
        c2.send("write 2:client-2")
        ok2 = c2.expect("write-ok", "write-rejected")["event"] == "write-ok"
        c2.send("quit")
        c1.send("write 1:client-1")
        os.kill(c1.popen.pid, signal.SIGCONT)
        ev1 = c1.expect("write-ok", "write-rejected")
        c1.send("quit")
        return {"t1": t1, "t2": t2, "ok1": ev1["event"] == "write-ok", "ok2": ok2, "ev1": ev1}
    finally:
        c1.close()
        if c2 is not None:
            c2.close()


def figure_8_5_violations(run: dict[str, Any], data: str | None) -> list[str]:
    bad = []
    if not FencingToken.parse(run["t2"]) > FencingToken.parse(run["t1"]):
        bad.append("the second holder's token is not higher")
    if not run["ok2"]:
        bad.append("the current holder's write was refused")
    if run["ok1"]:
        bad.append("the paused holder's stale write was accepted")
    if data is None or not data.endswith("client-2"):
        bad.append(f"the data is {data!r}, not the current holder's")
    return bad
