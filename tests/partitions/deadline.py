"""The set-up the deadline tests share (test_etcd_deadline.py, test_zookeeper_deadline.py): a
holder and a waiter, each a real ``fenced`` client process in a namespace of its own; the
waiter's link to the member it talks to is cut once it is queued, and what it reports is how
long ``acquire(timeout=)`` took to give up."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

from fenced.testing.netns import NetLab, Node
from fenced.testing.partitions import _python_env
from tests.helpers import wait_for

TIMEOUT = 2.0

_CLIENT = """
import asyncio, sys, time, fenced
async def main():
    async with fenced.connect_async(sys.argv[1]) as locks:
        lease = locks.lock("d", ttl=float(sys.argv[3]))
        if sys.argv[2] == "hold":
            await lease.acquire()
            print("held", flush=True)
            await asyncio.sleep(60)
            return
        print("waiting", flush=True)
        start = time.monotonic()
        try:
            await lease.acquire(timeout=float(sys.argv[4]))
        except (%s) as exc:
            print(f"timeout {time.monotonic() - start:.3f} {type(exc).__name__}", flush=True)
asyncio.run(main())
"""


def time_to_give_up(
    lab: NetLab,
    *,
    holder_url: str,
    waiter_url: str,
    cut_from: Node,
    queued: Callable[[], bool],
    ttl: float,
    gives_up_with: tuple[str, ...] = ("LockTimeout",),
) -> float:
    """Seconds the waiter's ``acquire(timeout=TIMEOUT)`` took to give up, its link to
    ``cut_from`` cut once ``queued()`` says it is in the queue (waited for, bounded)."""
    client = _CLIENT % ", ".join(f"fenced.{name}" for name in gives_up_with)
    holder = lab.run(lab.add("c1"), [sys.executable, "-c", client, holder_url, "hold", str(ttl)],
                     stdout=subprocess.PIPE, env=_python_env())  # fmt: skip
    assert holder.proc.stdout is not None and holder.proc.stdout.readline() == b"held\n"
    lab.add("c2")
    waiter = lab.run("c2", [sys.executable, "-c", client, waiter_url, "wait", str(ttl), str(TIMEOUT)],
                     stdout=subprocess.PIPE, env=_python_env())  # fmt: skip
    assert waiter.proc.stdout is not None and waiter.proc.stdout.readline() == b"waiting\n"
    wait_for(queued, 10, "the waiter in the queue")
    lab.partition(["c2"], [cut_from.name])  # its member goes silent before its deadline
    line = waiter.proc.stdout.readline().decode()
    assert line.startswith("timeout "), line
    return float(line.split()[1])
