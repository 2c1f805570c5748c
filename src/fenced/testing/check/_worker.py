"""One worker of a check campaign, as its own OS process:

    python -m fenced.testing.check._worker SOURCE_URL DATA_DB HISTORY NAME TTL SEED [PLANT]

Loops until its stdin closes (or it is killed): acquire the lock ``counter`` → fenced read
of the counter → think → guarded write (``SQLGuard`` in the same transaction) → release; each step appended to the shared history. On SIGUSR1 it stops itself (SIGSTOP)
at its next critical point, after reading and before writing. ``PLANT`` (a fault the checkers must
catch): ``no-fence`` leaves every fence check out; ``unfenced-read`` fences the write only,
so a holder whose lease ended can still write between the next holder's read and write.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import sys
import threading
import time

import fenced
from fenced import _clock
from fenced.guards.sql import SQLGuard

from ._history import History

LOCK = "counter"


def main(argv: list[str]) -> None:
    url, db, path, name, ttl_text, seed_text, *rest = argv
    plant = rest[0] if rest else ""
    ttl = float(ttl_text)
    rng = random.Random(f"{seed_text}-{name}")
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    # SIGUSR1 (the "stall" nemesis): stop this whole process (renewals included) at the next
    # critical point, between reading the counter and the guarded write: DDIA's GC pause.
    stall = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: stall.set())
    signal.signal(signal.SIGUSR2, lambda *_: stall.clear())  # the campaign is ending
    guard = SQLGuard(LOCK)
    history = History(path, name)
    with fenced.connect(url) as locks:
        while not stop.is_set():
            lease = locks.lock(LOCK, ttl=ttl)
            try:
                token = lease.acquire(timeout=ttl * 20)
            except fenced.LockTimeout:
                continue
            history.append(
                "grant", lock=LOCK, token=token.value, surely_until=_clock.now() + lease.remaining()
            )
            conn = sqlite3.connect(db, timeout=30)
            try:
                # A fenced read: the mark is raised to this token *before* reading, so a
                # holder whose lease ended earlier can no longer write under what we read
                # (an unfenced read lets its late write land first: a lost update).
                with conn:
                    if plant not in ("no-fence", "unfenced-read"):
                        guard.check(conn, token=token)
                    value = conn.execute("SELECT n FROM counter").fetchone()[0] + 1
                time.sleep(rng.uniform(0, ttl / 4))  # think
                if stall.is_set():
                    stall.clear()
                    history.append("stalled", lock=LOCK, token=token.value)
                    os.kill(os.getpid(), signal.SIGSTOP)  # the nemesis sends SIGCONT later
                try:
                    with conn:
                        if plant != "no-fence":
                            guard.check(conn, token=token)
                        conn.execute("UPDATE counter SET n = ?", (value,))
                        conn.execute(
                            "INSERT INTO log (token, value) VALUES (?, ?)", (token.value, value)
                        )
                    history.append("write", lock=LOCK, token=token.value, value=value, ok=True)
                except fenced.StaleTokenError:
                    history.append("write", lock=LOCK, token=token.value, value=value, ok=False)
            finally:
                conn.close()
            sent = _clock.now()  # (a successor may be granted before release() returns)
            released = lease.release()
            history.append("release", lock=LOCK, token=token.value, released=released, sent=sent)


if __name__ == "__main__":
    main(sys.argv[1:])
