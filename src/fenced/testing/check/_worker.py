"""One worker of a check campaign, as its own OS process:

    python -m fenced.testing.check._worker CONFIG_JSON

Loops until its stdin closes (or it is killed): acquire the lock → fenced read of the
register → think → guarded write of the register with one more entry → release; each step
appended to the shared history, with the worker's view of its lease. On SIGUSR1 it stops
itself (SIGSTOP) at its next critical point, between reading and writing (DDIA's GC pause);
SIGUSR2 takes a stall back. The register holds ``[[token, value], ...]``: the whole past of
a read-modify-write counter (see ``_resources``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import fenced
from fenced._core import clock as _clock

from ._history import History, digest
from ._resources import Resource, SplitWrite, open_resource

STALL_INSIDE = signal.SIGRTMIN + 2
"""The nemesis' ask for a stall inside a one-step write (SIGUSR1: before the write)."""


def opaque(resource: str, plant: str) -> bool:
    """Whether the resource's write is one step the kit cannot see into (a user's ``python:``
    adapter without ``write_steps``): its stalls may land inside that write (:class:`InWrite`)."""
    return resource.startswith("python:") or plant == "hidden-check-then-write"


LAB_PLANT_ENV = "FENCED_CHECK_LAB_PLANT"
LAB_THINK_ENV = "FENCED_CHECK_LAB_THINK"
"""The partition lab's: think exactly this long (seconds) between read and write, instead of
up to ttl/4, so that a holder cut off mid-think outlives its lease while it holds it."""


def _entries(data: bytes | None) -> list[list[int]]:
    if not data:
        return []
    loaded = json.loads(data)
    if not isinstance(loaded, list):
        raise ValueError("the register holds no list: was it written by fenced check?")
    return loaded


def main(argv: list[str]) -> None:
    cfg: dict[str, Any] = json.loads(argv[0])
    lock, ttl, plant = cfg["lock"], float(cfg["ttl"]), cfg["plant"]
    rng = random.Random(f"{cfg['seed']}-{cfg['name']}")
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    stall = threading.Event()
    inside_asked = threading.Event()  # (the stall asked for lands inside a one-step write)

    def stall_inside(*_: object) -> None:
        inside_asked.set()
        stall.set()

    def take_back(*_: object) -> None:  # the campaign is ending, or the stall was not taken
        stall.clear()
        inside_asked.clear()

    signal.signal(signal.SIGUSR1, lambda *_: stall.set())
    signal.signal(STALL_INSIDE, stall_inside)
    signal.signal(signal.SIGUSR2, take_back)
    history = History(cfg["history"], cfg["name"])
    print("ready", flush=True)  # (the nemesis signals a worker only once it can take them)

    def critical(token: int, inside: bool = False) -> None:
        if stall.is_set():
            stall.clear()
            where = {"inside": True} if inside else {}
            history.append("stalled", lock=lock, token=token, **where)
            os.kill(os.getpid(), signal.SIGSTOP)  # the nemesis sends SIGCONT later

    _wall_clock_steps(os.environ.get("FENCED_CHECK_CLOCK"))
    verify = None
    if cfg.get("signing_key"):
        from fenced._core.signing import Keyring, load_key, public_half

        # (the resource verifies with the public half: it never needs the power to sign)
        verify = Keyring(
            [public_half(load_key(cfg["signing_key"]))], source_id=cfg.get("source_id")
        )
    resource = open_resource(cfg["resource"], lock, verify)
    # A user's own adapter (python:) writes in steps the kit cannot see: every other stall
    # lands inside its write instead (see InWrite).
    in_write = None
    if opaque(str(cfg["resource"]), plant):  # (which stalls: the nemesis', by its signal)
        in_write = InWrite(stall, critical, inside_asked)
    # Test plant of the partition lab only (fenced.testing.partitions.run_check): a holder
    # that takes no notice of its lease's loss, and thinks long enough to outlive it.
    ignore_loss = os.environ.get(LAB_PLANT_ENV) == "ignore-loss"
    held: list[Any] = []  # [lease, token] while held, until its release returned
    promised: dict[int, float] = {}  # token -> the latest end its remaining() promised

    def note_promise() -> None:
        now, lease_and_token = _clock.now(), held[:]
        if lease_and_token:
            left = lease_and_token[0].remaining()
            if left > 0:
                key = lease_and_token[1]
                promised[key] = max(promised.get(key, 0.0), now + left)

    def promise_now() -> float | None:
        note_promise()
        lease_and_token = held[:]
        return promised.get(lease_and_token[1]) if lease_and_token else None

    def on_lost(_: Any) -> None:  # (on fenced's loop: a line and its fsync, no more)
        lease_and_token = held[:]
        if lease_and_token and not ignore_loss:
            token = lease_and_token[1]
            history.append("lost", lock=lock, token=token, promised=promised.get(token))

    with fenced.connect(
        cfg["source"], signing_key=cfg.get("signing_key"), source_id=cfg.get("source_id")
    ) as locks:
        while not stop.is_set():
            lease = locks.lock(lock, ttl=ttl, on_lost=on_lost)
            try:
                token = lease.acquire(timeout=ttl * 20)
            except fenced.LockTimeout:
                continue
            except fenced.FencedError as exc:  # the source is cut off or restarting
                history.append("error", lock=lock, step="acquire", error=type(exc).__name__)
                stop.wait(ttl / 4)
                continue
            held[:] = [lease, token.value]
            note_promise()
            remaining = lease.remaining()
            surely = remaining * (2.0 if plant == "lease-overestimated" else 1.0)
            history.append(
                "grant", lock=lock, token=token.value, surely_until=_clock.now() + surely,
                remaining=remaining,
            )  # fmt: skip
            try:
                lab_think = float(os.environ.get(LAB_THINK_ENV) or 0) or None
                think = 3 * ttl if ignore_loss else lab_think or ttl / 4
                step(resource, token, lease, history, rng, think, critical, ignore_loss,
                     promise_now, fixed_think=lab_think is not None, in_write=in_write)  # fmt: skip
            except Exception as exc:  # (a user's adapter may raise anything: record, go on)
                history.append("error", lock=lock, token=token.value, error=type(exc).__name__)
            # Said before it is sent: a worker killed while releasing has still let go, and
            # a successor may be granted before release() returns.
            history.append("releasing", lock=lock, token=token.value)
            sent = _clock.now()
            try:
                if plant == "unfenced-release":
                    released = locks.force_release(lock) is not None
                else:
                    released = lease.release()
            except fenced.FencedError:
                released = False
            held[:] = []
            promised.pop(token.value, None)
            history.append("release", lock=lock, token=token.value, released=released, sent=sent)
    resource.close()


class InWrite:
    """Stalls inside a user's one-step write (a ``python:`` adapter's ``write()``): a check
    and a write made as two steps in there (two transactions; a check in memory, then a file
    written) leave a window no stall before the call can reach, however small it is. A stall
    the nemesis asks for inside (:data:`STALL_INSIDE`, every other stall of such a run) stops
    the worker inside its write, just after the first return of the C function its last write
    called most (a database's ``execute``: the check's ``BEGIN``), and again after each C call
    that follows while the nemesis asks (SIGUSR1 before each SIGCONT: single steps). The
    nemesis steps it until the successor's fenced read, blocked while the stopped write holds
    a lock, is answered: that read then lands at the first seam between two transactions,
    after the check. (Before its first write the worker knows no C call: the stall is taken
    before the write.)"""

    def __init__(
        self, stall: threading.Event, critical: Callable[..., None], inside_asked: threading.Event
    ) -> None:
        self.stall, self.critical, self.inside_asked = stall, critical, inside_asked
        self.calls: list[str] = []  # the C functions the last write called, in order

    def wrap(self, write: Callable[[], None], token: int) -> Callable[[], None] | None:
        """``write`` watched (and stopped inside, when a stall is due there), or None: the
        stall is due before the write (the caller's ``critical``)."""
        calls = self.calls
        inside = self.stall.is_set() and self.inside_asked.is_set() and bool(calls)
        if self.stall.is_set():
            self.inside_asked.clear()  # (this stall is taken, here or before the write)
            if not inside:
                return None
        first = max(calls, key=calls.count) if inside else ""
        seen: list[str] = []
        armed = False  # (from the first return of ``first`` on)

        def hook(_frame: Any, event: str, arg: Any) -> None:
            nonlocal armed
            if event == "c_call":
                seen.append(getattr(arg, "__qualname__", ""))
            elif inside and event in ("c_return", "c_exception"):
                armed = armed or seen[-1] == first
                if armed:
                    self.critical(token, True)  # (stops only while a stall is asked for)

        def watched() -> None:
            sys.setprofile(hook)
            try:
                write()
            finally:
                sys.setprofile(None)
                self.calls = seen[:-1]  # (the last: that setprofile's own)

        return watched


def _wall_clock_steps(offset_file: str | None) -> None:
    """The ``clock`` nemesis for a worker: on SIGWINCH, read an offset in seconds from
    ``offset_file`` and add it to ``time.time()`` / ``time.time_ns()`` from then on — the wall
    clock as this process's Python code (fenced's and the resource adapter's) reads it.
    (libfaketime cannot do this for Python: with the monotonic clock left real, it makes
    ``time.sleep`` fail.) fenced's leases read only monotonic clocks, so nothing may change."""
    if not offset_file:
        return
    real_time, real_time_ns = time.time, time.time_ns
    offset = [0.0]

    def read_offset(*_: object) -> None:
        with open(offset_file) as f:
            offset[0] = float(f.read().strip() or 0)

    time.time = lambda: real_time() + offset[0]
    time.time_ns = lambda: real_time_ns() + int(offset[0] * 1e9)
    signal.signal(signal.SIGWINCH, read_offset)


def step(
    resource: Resource,
    token: fenced.FencingToken,
    lease: Any,
    history: History,
    rng: random.Random,
    think: float,
    critical: Callable[[int], None],
    ignore_loss: bool = False,
    promise: Callable[[], float | None] = lambda: None,
    *,
    fixed_think: bool = False,
    in_write: InWrite | None = None,
) -> None:
    """One read-modify-write of the register under ``token``, thinking up to ``think`` s
    (``fixed_think``: exactly that long); ``in_write``: stalls inside a one-step write too."""
    lock = token.lock
    sent = _clock.now()
    try:
        raw = resource.read(token)
    except fenced.StaleTokenError:
        history.append("read", lock=lock, token=token.value, ok=False)
        time.sleep(rng.uniform(0, think))  # (a client backs off before it tries again)
        return
    entries = _entries(raw)
    value = entries[-1][1] + 1 if entries else 1
    # (seen: which bytes, last: their last entry; a later read tells by them a stale write
    # that landed after this one was answered)
    history.append(
        "read", lock=lock, token=token.value, ok=True, value=value - 1, seen=digest(raw),
        last=entries[-1] if entries else None, sent=sent,
    )  # fmt: skip
    entries.append([token.value, value])
    # Think, looking at the lease every 50 ms: renewals move its promised end on (each by
    # about ttl/3), and the end it promised last is what its loss is checked against. (On
    # this thread: a thread of its own stopped sampling after a SIGSTOP in one run.)
    until = time.monotonic() + (think if fixed_think else rng.uniform(0, think))
    for _ in range(100_000):  # (bounded: the think is)
        left = until - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(0.05, left))
        promise()
    data = json.dumps(entries, separators=(",", ":")).encode()
    # A resource whose write is several steps (SplitWrite) stalls before its last one, the
    # write sent with its first; any other stalls before its write is sent.
    steps = (
        list(resource.write_steps(token, data))
        if isinstance(resource, SplitWrite)
        else [lambda: resource.write(token, data)]
    )
    if len(steps) == 1:
        wrapped = in_write.wrap(steps[0], token.value) if in_write is not None else None
        if wrapped is None:
            critical(token.value)
        else:
            steps = [wrapped]
    sent = _clock.now()
    remaining = lease.remaining()
    lost = lease.lost.is_set() and not ignore_loss  # (whether it knew, as it sent)
    promised = promise()  # (the latest end remaining() promised, by then)
    try:
        for one in steps[:-1]:
            one()
        if len(steps) > 1:
            critical(token.value)
        steps[-1]()
        ok: bool | None = True
    except fenced.StaleTokenError:
        ok = False
    except Exception as exc:  # no answer: the write may or may not have landed
        history.append("error", lock=lock, token=token.value, error=type(exc).__name__)
        ok = None
    history.append(
        "write", lock=lock, token=token.value, value=value, ok=ok, sent=sent,
        remaining=remaining, lost=lost, promised=promised,
    )  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
