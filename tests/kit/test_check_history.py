"""The check kit's history and checkers (``fenced.testing.check``) on a real run: worker
processes take a lock from the SQLite source and increment a counter behind ``SQLGuard``,
each step appended to one fsynced history; one worker is stopped with SIGSTOP past its lease
in the middle of its read-modify-write, so its late write must be refused. Every checker
passes on the real history, and each one fails on a history showing the fault it exists for
(the bug planted in the history a faulty resource or source would have produced)."""

from __future__ import annotations

import copy
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fenced.testing.check import CHECKERS, History, HistoryError, check_all, read_history
from fenced.testing.check._group_campaign import load_history
from fenced.testing.check._group_checkers import check_group
from tests.helpers import ROOT

WORKER = """
import sqlite3, sys, time, fenced
from fenced.guards.sql import SQLGuard
from fenced.testing.check import History
url, db, path, name, rounds, pause_flag = sys.argv[1:7]
guard = SQLGuard("counter")
history = History(path, name)
with fenced.connect(url) as locks:
    for i in range(int(rounds)):
        lease = locks.lock("counter", ttl=1.0)
        token = lease.acquire(timeout=60)
        history.append("grant", lock="counter", token=token.value,
                       surely_until=fenced._core.clock.now() + lease.remaining())
        conn = sqlite3.connect(db, timeout=30)
        value = conn.execute("SELECT n FROM counter").fetchone()[0] + 1  # read ...
        if pause_flag.startswith("pause") and i == 1:
            print("paused", flush=True)
            sys.stdin.readline()  # (SIGSTOPped here by the test, then told to go on)
        try:
            with conn:  # ... modify-write, fenced: one transaction with the guard's check
                if pause_flag != "pause-unguarded":  # (the planted fault: no fence check)
                    guard.check(conn, token=token)
                conn.execute("UPDATE counter SET n = ?", (value,))
                conn.execute("INSERT INTO log (token, value) VALUES (?, ?)", (token.value, value))
            history.append("write", lock="counter", token=token.value, value=value, ok=True)
        except fenced.StaleTokenError:
            history.append("write", lock="counter", token=token.value, value=value, ok=False)
        conn.close()
        sent = fenced._core.clock.now()
        released = lease.release()
        history.append("release", lock="counter", token=token.value, released=released, sent=sent)
print("done", flush=True)
"""


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )


@pytest.fixture(scope="module")
def real_history(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("history"), "pause")


def test_the_checkers_catch_a_real_run_without_the_guard(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Planted in the system, not the history: the paused worker writes without the fence
    check, and its stale read-modify-write lands."""
    found = {v.checker for v in check_all(_run(tmp_path_factory.mktemp("h"), "pause-unguarded"))}
    assert {"acceptance order", "lost update"} <= found, found


def _run(tmp: Path, mode: str) -> list[dict[str, Any]]:
    db, path = tmp / "data.db", tmp / "history.jsonl"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE counter (n INTEGER NOT NULL)")
    conn.execute("INSERT INTO counter VALUES (0)")
    conn.execute("CREATE TABLE log (seq INTEGER PRIMARY KEY, token INTEGER, value INTEGER)")
    conn.commit()
    from fenced.guards.sql import SQLGuard

    SQLGuard("counter").install(conn)
    conn.commit()
    url = f"sqlite:///{tmp / 'locks.db'}"
    paused = _spawn(url, str(db), str(path), "w-paused", "3", mode)
    assert paused.stdout is not None
    assert paused.stdout.readline().strip() == "paused"
    os.kill(paused.pid, signal.SIGSTOP)  # past its 1 s lease, holding a value it read
    others = [_spawn(url, str(db), str(path), f"w{i}", "8", "-") for i in range(2)]
    for p in others:
        assert p.wait(120) == 0
    os.kill(paused.pid, signal.SIGCONT)
    assert paused.stdin is not None
    paused.stdin.write("go\n")  # it writes with the token it had before the pause
    paused.stdin.flush()
    assert paused.wait(60) == 0
    with History(path, "checker") as h:
        log = [list(r) for r in conn.execute("SELECT token, value FROM log ORDER BY seq")]
        mark = SQLGuard("counter").high_water(conn)
        h.append("final", lock="counter", mark=mark.value if mark else 0, log=log)
    conn.close()
    return read_history(path)


def test_the_real_history_passes_every_checker(real_history: list[dict[str, Any]]) -> None:
    assert [e for e in real_history if e["op"] == "grant"]
    assert check_all(real_history) == []


def _plant(history: list[dict[str, Any]], fault: str) -> list[dict[str, Any]]:
    """The history a faulty resource or source would have produced."""
    h = copy.deepcopy(history)
    final = next(e for e in reversed(h) if e["op"] == "final")
    log = final["log"]
    grants = [e for e in h if e["op"] == "grant"]
    if fault == "acceptance order":  # a guard comparing with < let a stale write in last
        log.append([log[0][0], log[-1][1] + 1])
    elif fault == "mark":  # the mark kept in memory, lost at a restart
        final["mark"] = log[-1][0] - 1
    elif fault == "token reuse":  # a counter not fsynced: a restart handed a token out again
        h.append({**grants[0], "worker": "w-after-restart", "mono": grants[-1]["mono"] + 1})
    elif fault == "lost update":  # check-then-write: two writers built on the same value
        log.append([log[-1][0], log[-1][1]])
    elif fault == "acknowledged writes":  # an accepted write that the resource did not keep
        del log[-1]
        final["mark"] = max(t for t, _ in log)
    elif fault == "forged token":  # a signature check skipped: a made-up token got in
        write = next(e for e in h if e["op"] == "write" and e["ok"])
        h.append({**write, "token": 10**9, "value": log[-1][1] + 1})
    elif fault == "impostor accepted":  # the token's lock name not compared: another's got in
        write = next(e for e in h if e["op"] == "write" and e["ok"])
        h.append(
            {**write, "worker": "forger", "lock": "counter-elsewhere", "token": 10**9,
             "value": log[-1][1] + 1, "forged": True, "impostor": "another lock's token",
             "header": "counter-elsewhere:1000000000"}
        )  # fmt: skip
    elif fault == "current holder refused":  # tokens compared as strings: "10" < "9"
        last = max((e for e in h if e["op"] == "write" and e["ok"]), key=lambda e: e["token"])
        last["ok"] = False
        log[:] = [entry for entry in log if entry[0] != last["token"]]
    elif fault == "nothing checked":  # a resource that refused everyone, or a dead source
        h = [e for e in h if e["op"] != "write" or not e["ok"]]
    elif fault == "overlap":  # a grant made while the previous lease was surely held
        second = next(g for g in grants if g["token"] == grants[0]["token"] + 1)
        second["mono"] = grants[0]["mono"] + 0.001
        h = [e for e in h if not (e["op"] == "release" and e["token"] == grants[0]["token"])]
    return h


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_each_checker_catches_its_planted_fault(
    real_history: list[dict[str, Any]], name: str
) -> None:
    planted = _plant(real_history, name)
    assert CHECKERS[name](planted), f"{name} missed its fault"


def test_a_stale_write_accepted_after_a_newer_one_was_acknowledged_is_caught(
    real_history: list[dict[str, Any]],
) -> None:
    """The real-time rule of the acceptance order: the final state may not show a stale
    write (a later writer may have replaced the whole register), the history does."""
    h = copy.deepcopy(real_history)
    refused = next(e for e in h if e["op"] == "write" and not e["ok"])
    refused["ok"] = True  # the paused worker's late write, let in
    found = CHECKERS["acceptance order"](h)
    assert any("sent after" in v.message for v in found), found


def test_two_accepted_writes_of_one_value_are_a_lost_update(
    real_history: list[dict[str, Any]],
) -> None:
    h = copy.deepcopy(real_history)
    writes = [e for e in h if e["op"] == "write" and e["ok"]]
    writes[1]["value"] = writes[0]["value"]  # both built on the same read
    assert any("written twice" in v.message for v in CHECKERS["lost update"](h))


def test_the_paused_workers_late_write_was_refused(real_history: list[dict[str, Any]]) -> None:
    late = [e for e in real_history if e["op"] == "write" and e["worker"] == "w-paused"]
    refused = [e for e in late if not e["ok"]]
    assert len(refused) == 1 and late[1] is refused[0]  # its second round: the paused one
    assert refused[0]["token"] < max(e["token"] for e in real_history if e["op"] == "grant")


def test_a_kill_leaves_only_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "h.jsonl"
    with History(path, "w") as h:
        h.append("grant", lock="x", token=1, surely_until=1.0)
    with open(path, "a") as f:
        f.write('{"worker": "w", "op": "wri')  # a line cut short by SIGKILL
    assert [e["op"] for e in read_history(path)] == ["grant"]


def test_a_write_accepted_after_a_newer_fenced_read_was_acknowledged_is_caught(
    real_history: list[dict[str, Any]],
) -> None:
    """A fenced read raised the mark: a write with a lower token, sent after that read was
    answered, is a stale write let in, whatever writes were acknowledged."""
    h = copy.deepcopy(real_history)
    write = next(e for e in h if e["op"] == "write" and e["ok"])
    read = {
        **write, "op": "read", "worker": "w-reader", "token": write["token"] + 1,
        "value": 0, "mono": write["mono"] - 0.001,
    }  # fmt: skip
    write["sent"] = write["mono"]  # (this history's writes were sent as they were answered)
    h.insert(h.index(write), read)
    found = CHECKERS["acceptance order"](h)
    assert any("fenced read with token" in v.message for v in found), found
    # (the same read answered after the write was sent: no violation)
    read["mono"] = write["mono"] + 0.001
    assert not any("fenced read" in v.message for v in CHECKERS["acceptance order"](h))


def test_violation_messages_are_whole_sentences(real_history: list[dict[str, Any]]) -> None:
    """No message stops mid-sentence ("... sent after w2's write with token 77 was")."""
    late = copy.deepcopy(real_history)
    next(e for e in late if e["op"] == "write" and not e["ok"])["ok"] = True  # let in, late
    histories = [late] + [_plant(real_history, name) for name in CHECKERS]
    found = [v for h in histories for v in check_all(h)]
    assert any("sent after" in v.message for v in found)
    for v in found:
        assert not v.message.rstrip().endswith((" was", " were", " is", " after")), v


def test_the_current_holder_refused_and_a_mostly_refusing_resource_are_caught(
    real_history: list[dict[str, Any]],
) -> None:
    """A resource comparing tokens as strings refuses token 10 after 9: no stale write gets
    in, every other checker is satisfied, and the rightful holder is locked out."""
    h = copy.deepcopy(real_history)
    final = next(e for e in h if e["op"] == "final")
    writes = sorted((e for e in h if e["op"] == "write"), key=lambda e: e["token"])
    for e in writes[1:]:
        e["ok"] = False
    final["log"] = [[writes[0]["token"], writes[0]["value"]]]
    final["mark"] = writes[0]["token"]
    found = {v.checker for v in check_all(h)}
    assert {"current holder refused", "mostly refused"} <= found, found
    # A refused *read* of the newest holder is caught the same way.
    g = max((e for e in real_history if e["op"] == "grant"), key=lambda e: e["token"])
    h2 = copy.deepcopy(real_history)
    h2.append({**g, "op": "read", "ok": False, "mono": g["mono"] + 0.01})
    msgs = [v.message for v in CHECKERS["current holder refused"](h2)]
    assert any("fenced read with token" in m for m in msgs), msgs
    # Refused because a higher token had been granted: the expected stale refusal.
    assert not CHECKERS["current holder refused"](real_history)


def test_a_group_history_written_before_the_one_schema_is_still_read(tmp_path: Path) -> None:
    """The group campaigns before the kit's one schema wrote a file a process, events naming
    it ``proc``, times on ``time.monotonic()``: read as the one schema, and judged the same."""
    old = [
        {"op": "invoke", "id": "1", "kind": "write", "key": "counter", "value": "1:w1:1.0",
         "stamp": "s1", "token": 3, "start": 1.0, "proc": "w1"},
        {"op": "complete", "id": "1", "ok": True, "end": 1.5, "proc": "w1"},
        {"op": "invoke", "id": "2", "kind": "write", "key": "counter", "value": "1:w2:1.0",
         "stamp": "s2", "token": 2, "start": 2.0, "proc": "w2"},
        {"op": "complete", "id": "2", "ok": True, "end": 2.5, "proc": "w2"},
    ]  # fmt: skip
    for proc in ("w1", "w2"):
        lines = [json.dumps(e) for e in old if e["proc"] == proc]
        (tmp_path / f"history-{proc}.jsonl").write_text("\n".join(lines) + "\n")
    history = read_history(tmp_path)
    assert sorted(e["worker"] for e in history) == ["w1", "w1", "w2", "w2"]
    assert "proc" not in history[0]
    with pytest.warns(DeprecationWarning):
        assert load_history(tmp_path) == history
    # Two acknowledged writes of count 1: a lost update, caught in the old files too.
    assert "lost update" in {v.checker for v in check_group(history)}


_W1 = '{"op":"grant","worker":"w1","mono":1.0,"lock":"c","token":1,"surely_until":2.0}'
_W2 = '{"op":"grant","worker":"w2","mono":3.0,"lock":"c","token":2,"surely_until":4.0}'


def test_a_file_that_is_not_a_history_is_refused_with_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    path.write_text(f"{_W1}\n[1, 2]\n{_W2}\n")
    with pytest.raises(HistoryError, match=r"history.jsonl:2: not an event"):
        read_history(path)
    path.write_text(f"{_W1}\nnot json\n{_W2}\n")
    with pytest.raises(HistoryError, match=r"history.jsonl:2: not a JSON line"):
        read_history(path)
    # A last line cut short by a kill (no newline after it) is dropped, not an error.
    path.write_text(f'{_W1}\n{{"op":"gra')
    assert [e["worker"] for e in read_history(path)] == ["w1"]


@pytest.mark.parametrize("served", [True, False])
def test_an_impostors_fenced_read_served_or_moving_the_mark_is_caught(
    real_history: list[dict[str, Any]], served: bool
) -> None:
    """An impostor's fenced read (another lock's token, far above any real one): served, it is
    "impostor accepted"; refused with the mark read back at its token, too (a refusal must
    leave the mark where it was); refused with the mark left below it, nothing. Neither makes
    every later write an "acceptance order" violation (an impostor's read is no holder's)."""
    h = copy.deepcopy(real_history)
    final = next(e for e in h if e["op"] == "final")
    at = h.index(next(e for e in h if e["op"] == "write" and e["ok"]))
    read = {
        **h[at], "op": "read", "worker": "impostor", "lock": "COUNTER", "token": 10**9 + 1,
        "ok": served, "forged": True, "impostor": "another lock's token",
        "header": "COUNTER:1000000001",
    }  # fmt: skip
    del read["value"]
    if not served:
        read["mark_after"] = 10**9 + 1
    h.insert(at + 1, read)
    found = check_all(h)
    said = "was served" if served else "was refused, and the resource's mark moved to 1000000001"
    assert [v.checker for v in found] == ["impostor accepted"], [str(v) for v in found]
    assert (
        "a fenced read with another lock's token" in found[0].message and said in found[0].message
    )
    read["mark_after"] = final["mark"]  # (refused, the mark where the holders left it)
    if not served:
        assert check_all(h) == []


def test_a_burst_copy_that_landed_after_a_fenced_read_is_caught_and_the_others_pass() -> None:
    """The race burst sends one stale write again and again: copies accepted before the
    successor's read, refused after it, are no lost update nor a refused write in the final
    state; a look that finds other bytes than the read saw, last written by the stale token,
    is a copy that landed after the read (a check and its write in two steps)."""

    def ev(worker: str, op: str, mono: float, **fields: Any) -> dict[str, Any]:
        return {"worker": worker, "pid": 1, "op": op, "mono": mono, "wall": mono, **fields}

    copy_ = {"lock": "counter", "token": 1, "value": 1, "of": "w1"}
    h = [
        ev("w1", "grant", 0.0, lock="counter", token=1, surely_until=0.5),
        ev("w2", "grant", 0.6, lock="counter", token=2, surely_until=5.0),
        ev("w1", "write", 1.1, lock="counter", token=1, value=1, ok=True, sent=1.0),
        ev("burst", "write", 1.2, **copy_, ok=True, sent=1.05, burst=0),
        ev("w2", "read", 1.3, lock="counter", token=2, ok=True, value=1, seen="aa"),
        ev("burst", "write", 1.35, **copy_, ok=False, sent=1.1, burst=1),
        ev("burst", "look", 1.45, sent=1.4, seen="aa", last=[1, 1], of="w2"),
        ev("w2", "write", 1.6, lock="counter", token=2, value=2, ok=True, sent=1.5),
        ev("kit", "final", 2.0, lock="counter", mark=2, log=[[1, 1], [2, 2]]),
    ]
    assert check_all(h) == []
    h[6]["seen"] = "bb"  # a copy's bytes, after the read was answered
    found = check_all(h)
    assert [v.checker for v in found] == ["acceptance order"], found
    assert "token 1's write (value 1) landed after w2's fenced read with token 2" in str(found[0])
    # (a later holder's fenced read, sent after, sees it the same way; one sent before not)
    del h[6]
    h[1]["surely_until"] = 1.65
    h[-1:-1] = [
        ev("w3", "grant", 1.7, lock="counter", token=3, surely_until=9.0),
        ev("w3", "read", 1.8, lock="counter", token=3, ok=True, value=1, seen="bb",
           last=[1, 1], sent=1.75),
    ]  # fmt: skip
    found = check_all(h)
    assert [v.checker for v in found] == ["acceptance order"], found
    assert "w3's read, sent after" in str(found[0])
    h[-2]["sent"] = 1.25
    assert check_all(h) == []
