"""The locks workload of the one campaign (``_engine``), ``fenced check``'s: worker processes on
a token source and a resource, a seeded nemesis, one history, every checker (see
docs/testing.md).

The nemesis, on a schedule drawn from ``seed`` (the same seed, the same schedule):

- ``pause``: SIGSTOP a worker's process group for 1.2-3 ttls, anywhere in its loop;
- ``stall``: the worker stops itself inside its critical section, between its read and its
  guarded write (DDIA's GC pause), until a successor has been granted the lock, and a
  moment more: its late write lands inside the successor's round. In turn: chained (the late
  write right after the successor's fenced read, one grant behind), plain; with a
  ``python:`` adapter's one-step write every other one lands inside that write instead and
  is stepped C call by C call until the successor's fenced read is answered
  (``_worker.InWrite``). No other fault comes before the stalled worker goes on to its late write;
- ``kill``: SIGKILL a worker; a replacement starts;
- ``partition``: cut one worker off the source and the resource for 1.2-3 ttls (its own
  :class:`~fenced.testing.proxy.TcpProxy` on each path reached over TCP);
- ``delay``: hold every byte between one worker and the source and resource for 1.5 ttls
  for 1.2-3 ttls (a write sent while its lease was good arrives after it ended);
- ``restart``: kill -9 and restart the token source, when the kit started it itself
  (``--source redis|etcd|postgresql|zookeeper``);
- ``clock``: step a wall clock up to a minute either way: a worker's (``time.time()`` in the
  worker's Python, on SIGWINCH: fenced's leases read only monotonic clocks, so nothing may
  change), or, when the kit started a PostgreSQL source, the database server's (libfaketime;
  fenced's PostgreSQL source judges expiry by the database's clock, so a forward step ends
  leases early — the overlap checker reports it — and the resource's fence must still hold);
- ``forge`` (with ``signing``): write to the resource through its guard with a token nobody
  was granted — a high value under a forged signature, under a key id the resource does not
  know, or signed well for another source — as a client that edits its token would, or a
  staging source sharing the key; it must be refused;
- ``impostor``: write to the resource, then read it fenced, with a token it must refuse
  whatever the mark: one of another lock (far above any real value; signed well for that lock
  with ``signing``), one malformed (an HTTP resource: a header a lenient parser reads as a
  high value of the lock), and none at all (a write only) — as a client of another lock, a
  buggy client or a script would; the mark read back after each refusal must not have moved;
- ``race`` (a resource reached over TCP): two takeovers timed to land inside the resource.
  First the holder stops itself before its write; every other worker's way to the resource
  is held (its own proxy); once a successor is granted, the old holder goes on, and as soon
  as its write has reached the resource, the successor's held fenced read is let through
  after it (without a burst, below: 2-30 ms; in every other race, the second first,
  0.07-1 ms: at the same instant): a resource whose check and write are two steps lets the
  read in between. Then
  the next holder stops before its write and goes on as soon as its successor's read was
  answered: its write lands between that read and the successor's write (an unfenced read).
  The first takeover is a burst (``_Burst``), and so is a second one on the next holder before
  that: the stale write sent again and again around the successor's read, then a look at the
  register before the successor writes;
- ``resource-restart`` (``resource_cmd``): kill -9 the user's resource process and start it
  again on the same data, with a stale writer ready: a holder stopped before its write, a
  successor's fenced read answered and the successor stopped before its write (every other
  restart, the first too: a mark rebuilt from the data forgets what only a read raised) or
  its write acknowledged, the others held until the old holder's write is in. A mark kept
  only in memory lets that write in;
- ``resource-pause``: SIGSTOP the resource process for 1.2-3 ttls;
- ``resource-partition``, ``resource-delay``: hold (or delay by 1.5 ttls) every worker's way
  to the resource for 1.2-3 ttls.

Faults are dealt as from a deck: each round is a seeded shuffle of every nemesis asked for,
so each is exercised within the first rounds of any campaign; the first round opens with
``race``, ``resource-restart`` and ``stall``, the faults aimed inside the resource.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import selectors
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit, urlunsplit

from ..._core import clock as _clock
from ..._core.backend import redacted
from ..._core.errors import ConfigurationError, StaleTokenError
from .. import parentdeath
from ..proxy import TcpProxy
from ..servers import python_env
from . import _zygote
from ._checkers import CHECKERS, Violation, check_all
from ._engine import (
    INCONCLUSIVE,
    Campaign,
    CampaignError,
    Fault,
    ResetError,
    end_by,
    short_of_counts,
    undealt,
)
from ._history import Event, History, digest
from ._plants import PLANTS, SIGNING_PLANTS, plant_role, source_plant_server
from ._report import write_report
from ._resources import IO_TIMEOUT_ENV, HttpResource, open_resource
from ._worker import STALL_INSIDE
from ._worker import opaque as _opaque
from ._zygote import Worker

__all__ = [
    "ENGINES",
    "NEMESES",
    "PLANTS",
    "PLANT_NEEDS",
    "PLANT_NEMESES",
    "PREFIX_CHECKERS",
    "CampaignError",
    "CampaignResult",
    "LocksWorkload",
    "default_nemeses",
    "run_campaign",
]

NEMESES = (
    "pause", "stall", "kill", "partition", "delay", "restart", "clock", "forge", "impostor",
    "race", "resource-restart", "resource-pause", "resource-partition", "resource-delay",
)  # fmt: skip
ENGINES = ("redis", "etcd", "postgresql", "zookeeper")
_NEEDS_TCP = frozenset({"partition", "delay"})
# The nemeses that act on the resource's side: each worker reaches it through its own proxy.
_RESOURCE_PATH = frozenset({"race", "resource-restart", "resource-partition", "resource-delay"})
_NEEDS_PROCESS = frozenset({"resource-restart", "resource-pause"})
# Where a user's resource hides its bugs: dealt first in a campaign's first round of faults.
_AT_THE_RESOURCE = frozenset({"race", "resource-restart"})
_LASTING = frozenset(
    {
        "pause",
        "stall",
        "partition",
        "delay",
        "resource-pause",
        "resource-partition",
        "resource-delay",
    }
)
# What a plant needs to show itself: at least one of these faults (added when none is asked).
PLANT_NEEDS: dict[str, tuple[str, ...]] = {
    "token-in-memory": ("restart",),
    "counter-not-fsynced": ("restart",),
    "signature-skipped": ("forge",),
    "key-id-ignored": ("forge",),
    "source-ignored": ("forge",),
    "lock-ignored": ("impostor",),
    "tokenless-ok": ("impostor",),
    "check-then-write": ("stall",),
    "off-by-one": ("stall",),  # (a chained stall: the late write one grant behind)
    "write-then-check": ("stall",),
    "hidden-check-then-write": ("stall",),  # (a stall inside the write: _worker.InWrite)
    "lease-overestimated": ("pause", "kill"),
    "unfenced-release": ("stall", "pause"),
}
# A plant's faults when none are asked for: the ones that open its window, dealt often (the
# default mix deals a stall a third of the time, and a plant could go unseen in a short run).
PLANT_NEMESES: dict[str, tuple[str, ...]] = {
    "lease-overestimated": ("pause", "kill"),  # a lease that ends by expiry, not release
    "unfenced-release": ("stall", "pause"),  # a holder that wakes up late and releases
    "token-in-memory": ("restart", "stall"),
    "counter-not-fsynced": ("restart", "stall"),
    "signature-skipped": ("forge", "stall"),
    "key-id-ignored": ("forge", "stall"),
    "source-ignored": ("forge", "stall"),
    "lock-ignored": ("impostor", "stall"),
    "tokenless-ok": ("impostor", "stall"),
}  # (any other plant: stalls, the late writer inside its successor's round)
_FAKETIME_ENGINES = frozenset({"postgresql"})
FAKETIME_LIBS = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
)


@dataclasses.dataclass
class CampaignResult:
    violations: list[Violation]
    report: Path
    history: Path
    grants: int
    accepted: int
    refused: int
    unknown: int
    faults: dict[str, int]
    seconds: float
    first_violation_after: float | None  # seconds from the start to the first bad event
    refused_reads: int = 0
    seed: int = 0
    turned_away: int = 0  # the forger's and the impostor's writes and reads refused (rightly)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # the run's, as recorded

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def inconclusive(self) -> bool:
        """Nothing failed, and nothing was shown to hold either: a fault asked for was never
        dealt (``fenced check`` exits 75, not 0)."""
        return bool(self.violations) and all(v.checker == INCONCLUSIVE for v in self.violations)

    @property
    def ops_per_second(self) -> float:
        return (self.accepted + self.refused + self.unknown) / max(self.seconds, 1e-9)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return True  # gone: nothing to wait for


def _resume_after(
    pid: int,
    name: str,
    path: Path,
    delay: float,
    limit: float,
    chain: Callable[[str], object] | None = None,
    offset: int = 0,
) -> None:
    """Once worker ``pid`` has stopped itself inside its critical section, wait until a
    successor is granted the lock (a higher token in the history), then ``delay`` more, and
    continue it: the late write then lands inside the successor's own round — the window a
    missing fence on the read, or a check apart from its write, leaves open. (After
    ``limit`` seconds it is continued anyway.)

    With ``chain``: wait instead for the successor's fenced read, stall that successor too
    (``chain(its name)``) and continue at once: the late write lands after the successor
    raised the mark by exactly one, and stays the register's last until a third holder reads
    it — the window a fence off by one, or a write made before its check, needs (the
    successor's own write, right behind, would otherwise overwrite the evidence).

    A stall taken inside a user's write (``inside``, see ``_worker.InWrite``) is stepped
    instead, once a successor is granted: continued with a stall asked for again, it stops
    after its next C call, until the successor's fenced read was answered (or its write is
    done). A read waits while the stopped write holds a lock: answered at the write's first
    seam after it, it lies between the write's check and its write."""
    deadline = time.monotonic() + limit
    stalled_at: int | None = None
    inside = False  # (the history is read from ``offset``: where it ended before the SIGUSR1)
    step_at = 0.0  # inside: when to step it on (0: not before a successor's grant)
    while time.monotonic() < deadline:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        offset += len(complete)
        for line in complete.splitlines():
            e = json.loads(line)
            if e["op"] == "stalled" and e["worker"] == name:
                stalled_at, inside = e["token"], bool(e.get("inside"))
            elif inside and e["op"] == "write" and e["worker"] == name:
                deadline, delay = 0.0, 0.0  # stepped through its whole write
            elif stalled_at is None or e.get("token", 0) <= stalled_at or deadline == 0.0:
                continue
            elif inside and e["op"] == "grant":
                delay, step_at = 0.0, time.monotonic() + limit / 16
            elif inside and e["op"] == "read" and e["ok"]:
                deadline = 0.0  # the read is in: the rest of the write follows it
            elif inside:
                continue
            elif chain is None and e["op"] == "grant":
                deadline = 0.0  # a successor holds it now
            elif chain is not None and e["op"] == "read" and e["ok"]:
                chain(e["worker"])  # the successor stops before its write
                deadline, delay = 0.0, 0.0
        if deadline and step_at and time.monotonic() >= step_at:
            # No read yet (it waits on a lock the write holds): one step on. (limit / 16:
            # past SQLite's busy-wait back-off, up to 100 ms, and a read's own time.)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
                os.killpg(pid, signal.SIGCONT)
            step_at = time.monotonic() + limit / 16
        time.sleep(0.005)
    if stalled_at is None or inside:  # never stopped (or stepped): take the stall back
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
    else:
        time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGCONT)


def _register_now(resource: Any) -> tuple[list[Any], int]:
    """The register's entries as the resource holds them now (none if unreadable), and the
    value one more entry would carry: what a forged or impostor write appends to."""
    data, _ = resource.final()
    try:
        entries = json.loads(data) if data else []
    except ValueError:
        entries = []
    return entries, entries[-1][1] + 1 if entries else 1


def _forge(
    resource: Any, lock: str, history: History, rng: random.Random, n: int, key: Any = None
) -> None:
    """One forged write: the register with one more entry, under a token no grant had (far
    above any real one), signed with a made-up signature under the real key id, or under a
    key id the resource does not know (every other time); every fourth (the first of them),
    signed well with the run's real key but for another source (staging sharing prod's key)."""
    from ..._core.errors import FencedError
    from ..._core.signing import token_message
    from ..._core.token import FencingToken

    entries, value = _register_now(resource)
    forged = 1_000_000_000 + n
    kid = "check" if n % 2 else "stolen"
    token = FencingToken(lock, forged, (kid, rng.randbytes(32)))
    if n % 4 == 1 and key is not None:
        elsewhere = key.sign(token_message(lock, forged, key.kid, _OTHER_SOURCE))
        token = FencingToken(lock, forged, (key.kid, elsewhere, _OTHER_SOURCE))
    entries.append([forged, value])
    sent = _clock.now()
    try:
        resource.write(token, json.dumps(entries, separators=(",", ":")).encode())
        ok: bool | None = True
    except FencedError:
        ok = False  # (a SignatureError: refused before the mark, as it must be)
    except Exception:
        ok = None
    history.append("write", lock=lock, token=forged, value=value, ok=ok, sent=sent, forged=True)


IMPOSTORS = ("another lock's token", "a malformed token", "no token")
"""What the ``impostor`` nemesis writes with, in turn (a resource not reached over HTTP gets
no malformed token: its adapter takes a parsed one)."""


def _impostor(resource: Any, lock: str, history: History, n: int, key: Any = None) -> None:
    """One write and one fenced read the resource must refuse whatever its mark (see
    ``impostor``): the write of the register with one more entry, under the ``n``-th of
    :data:`IMPOSTORS` — the value far above any real one, so a resource that lets it in moves
    its mark past every rightful holder — then a read under the same token (not with none: a
    read without a token is the unfenced read ``final()`` makes, and moves no mark). A read
    that serves another lock's token, or a malformed one, lets its value raise the mark as
    surely as a write: the rightful holder is refused from then on."""
    from ..._core.errors import FencedError
    from ..._core.signing import token_message
    from ..._core.token import FencingToken

    entries, value = _register_now(resource)
    forged = 1_000_000_000 + n
    http = isinstance(resource, HttpResource)
    kinds = IMPOSTORS if http else (IMPOSTORS[0], IMPOSTORS[2])
    kind = kinds[(n - 1) % len(kinds)]  # (the first: another lock's, the likeliest in use)
    entries.append([forged, value])
    body = json.dumps(entries, separators=(",", ":")).encode()
    # Another lock's name: one that starts as this one's (a prefix test lets it in), then one
    # that differs only in case (a name compared case-blind: .lower(), a MySQL *_ci column).
    other = f"{lock}-elsewhere"
    if (n - 1) // len(kinds) % 2 == 1 and lock.swapcase() != lock:
        other = lock.swapcase()
    token: FencingToken | None = None
    if kind == IMPOSTORS[0]:
        token = FencingToken(other, forged)
        if key is not None:  # signed well, for that lock: only the lock's name tells it apart
            signature = key.sign(token_message(other, forged, key.kid, _SOURCE_ID))
            token = FencingToken(other, forged, (key.kid, signature, _SOURCE_ID))
    # (a lenient parser reads a value out of these; a strict one refuses them)
    sent = {IMPOSTORS[1]: f"{lock}:+{forged}", IMPOSTORS[2]: None}.get(kind, str(token))
    named = other if token is not None else lock
    ops: list[tuple[str, Callable[[], bool | None]]] = [
        ("write", lambda: resource.write_header(sent, body) if http else _served(
            lambda: resource.write(token, body))),
    ]  # fmt: skip
    if kind != IMPOSTORS[2]:  # (the same token on a fenced read)
        ops.append(
            ("read", lambda: resource.read_header(sent) if http else _served(
                lambda: resource.read(token))),
        )  # fmt: skip
    for op, call in ops:
        at = _clock.now()
        try:
            ok = call()
        except FencedError:
            ok = False  # (refused, as it must be)
        except Exception:
            ok = None
        fields: dict[str, Any] = {"value": value} if op == "write" else {}
        if ok is False:  # (the mark read back: a refusal must not have moved it)
            fields["mark_after"] = _mark_now(resource)
        history.append(
            op, lock=named, token=forged, ok=ok, sent=at, forged=True, impostor=kind,
            header=sent, **fields,
        )  # fmt: skip


def _mark_now(resource: Any) -> int | None:
    """The resource's mark as its ``final()`` reports it now (None: it reports none, or
    could not be read)."""
    try:
        _, mark = resource.final()
    except Exception:
        return None
    return mark if isinstance(mark, int) else None


def _served(call: Callable[[], object]) -> bool:
    """True once ``call()`` returned (an adapter's refusal is its exception)."""
    call()
    return True


def _reset_left_nothing(resource: Any, lock: str, shown: str, key: Any = None) -> None:
    """Raise :class:`ResetError` if ``resource``, just reset, still has a mark or data: what
    its ``final()`` says, then a fenced read and a write of an empty register under the
    lowest token there is (1; signed with ``key`` when the run signs) — refused as stale, the
    reset kept a mark the ``final()`` does not show. Otherwise every worker's first writes are
    refused (a mark from an earlier run is above a fresh source's tokens) and the verdict
    blames fencing for what is the adapter's set-up. Any other error of a probe is left to the
    run to show. (The caller resets again after: the probes raised the mark to 1.)"""
    from ..._core.errors import StaleTokenError
    from ..._core.signing import token_message
    from ..._core.token import FencingToken

    fix = "reset() must clear the resource's mark as well as its data (docs/testing.md)"
    data, mark = resource.final()
    if isinstance(mark, int) and mark > 0:
        raise ResetError(
            f"resource {shown}: its reset() left the mark at {mark} (its final() says so right "
            f"after): the first holder's writes would be refused as stale; {fix}"
        )
    if data and _log(data) != []:
        raise ResetError(
            f"resource {shown}: its reset() left data in the register ({len(data)} bytes, its "
            f"final() says so right after): the run would build on an earlier one's; {fix}"
        )
    token = FencingToken(lock, 1)
    if key is not None:
        token = FencingToken(
            lock, 1, (key.kid, key.sign(token_message(lock, 1, key.kid, _SOURCE_ID)), _SOURCE_ID)
        )
    probes: list[tuple[str, Callable[[], object]]] = [
        ("a fenced read", lambda: resource.read(token)),
        ("a write", lambda: resource.write(token, b"[]")),
    ]
    for what, probe in probes:
        try:
            probe()
        except StaleTokenError:
            raise ResetError(
                f"resource {shown}: its reset() kept a mark: {what} with token 1, the lowest "
                f"there is, was refused as stale right after it; the first holder's writes "
                f"would be refused too, and the run blamed on fencing; {fix}"
            ) from None
        except Exception:
            return  # (the probe's own error: the run shows it, with the workers' writes)


# The run's source id (workers sign for it, the resource trusts it), and another one.
_SOURCE_ID = "check"
_OTHER_SOURCE = "elsewhere"


def _current_holder(path: Path) -> str | None:
    """The worker the history says holds the lock now (granted, not yet releasing)."""
    holder = None
    with open(path, "rb") as f:
        for line in f:
            if b'"op":"grant"' in line or b'"op":"releasing"' in line:
                with contextlib.suppress(ValueError):
                    e = json.loads(line)
                    holder = e["worker"] if e["op"] == "grant" else None
    return holder


def _worker_log(out: Path, name: str) -> Path:
    """Worker ``name``'s log in the run's directory."""
    return out / f"worker-{name}.log"


def _wait_ready(
    proc: Worker, log: Path, limit: float = 60.0, urls: Sequence[str | None] = ()
) -> None:
    """Until the worker says it has its signal handlers (a SIGUSR1 before that kills it)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        line = proc.stdout.readline() if sel.select(limit) else b""
    if line.strip() != b"ready":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        tail = log.read_text(errors="replace").strip().splitlines()
        raise CampaignError(
            f"a worker did not start: {_scrubbed(tail[-1], urls) if tail else 'no output'} "
            f"(see {log})"
        )


def faketime_library() -> str | None:
    """libfaketime's preload library (Debian ``faketime``), or None."""
    return next((p for p in FAKETIME_LIBS if os.path.exists(p)), None)


def _via_proxy(url: str, proxies: list[TcpProxy]) -> str:
    """``url`` with its one host:port replaced by a new proxy's (appended to ``proxies``)."""
    address = _host_port(url)
    if address is None:
        raise ConfigurationError(
            f"partition/delay need a source and resource at one host:port, not {_shown(url)!r}"
        )
    proxy = TcpProxy(*address).start()
    parts = urlsplit(url)
    proxies.append(proxy)
    userinfo = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{proxy.port}"
    return urlunsplit(
        parts._replace(netloc=f"{userinfo[0]}@{host}" if len(userinfo) == 2 else host)
    )


NETNS_ENV = "FENCED_CHECK_NETNS"
"""Comma-separated ``ip netns`` names: worker N starts in the ((N-1) mod count)-th of them
(``ip netns exec``, same pid), so a partition lab can cut some workers off and not others
(:func:`fenced.testing.partitions.run_check`). Unset: every worker in the kit's own."""


def _worker_netns() -> list[str]:
    """The namespaces of :data:`NETNS_ENV`, each checked to exist (a typed one-line error)."""
    from ..netns import _ip_binary

    names = [n.strip() for n in os.environ.get(NETNS_ENV, "").split(",") if n.strip()]
    if names and _ip_binary() is None:
        raise ConfigurationError(f"{NETNS_ENV}: ip not found (Debian package 'iproute2')")
    for name in names:
        # (a name is a file under /run/netns: no path separators, no dot-dot)
        if name in (".", "..") or "/" in name or not os.path.exists(f"/run/netns/{name}"):
            raise ConfigurationError(f"{NETNS_ENV}: no network namespace {name!r} (ip netns list)")
    return names


def _host_port(url: str) -> tuple[str, int] | None:
    """The one host and port ``url`` names, or None (none, several, or a port that is no
    number: ``etcd://a:1,b:2``)."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    return (host, port) if host and port and "," not in parts.netloc else None


def _tcp(url: str) -> bool:
    return _host_port(url) is not None


def _scrubbed(text: str, urls: Sequence[str | None]) -> str:
    """``text`` (an error's message, a log's line: a client library's may quote a URL whole)
    without the passwords of ``urls``."""
    for url in urls:
        with contextlib.suppress(ValueError):
            password = urlsplit(url or "").password
            if password:
                text = text.replace(password, "***")
    return text


def _shown(url: str) -> str:
    """``url`` as a message may show it: no password, no query (fenced's ``redacted``); a
    resource that is no URL (``python:MODULE:CLASS``) as given."""
    return redacted(url).split("?")[0] if "://" in url else url


def _start_engine(name: str, base: str, clock_file: Path | None) -> Any:
    from .. import servers

    kinds: dict[str, type[servers.Server]] = {
        "redis": servers.RedisServer,
        "etcd": servers.EtcdServer,
        "postgresql": servers.PostgresServer,
        "zookeeper": servers.ZooKeeperServer,
    }
    made = kinds[name](base)
    made.die_with_parent = True  # (a kill -9 of the kit leaves no server behind)
    if clock_file is not None:
        made.extra_env = _faketime_env(clock_file)
    return made.start()


def _faketime_env(offset_file: Path) -> dict[str, str]:
    return {
        "LD_PRELOAD": str(faketime_library()),
        "FAKETIME_TIMESTAMP_FILE": str(offset_file),
        "FAKETIME_NO_CACHE": "1",  # read the offset at every call: steps take effect at once
        "DONT_FAKE_MONOTONIC": "1",  # a step of the wall clock, as NTP makes them
    }


def default_nemeses(resource: str, resource_cmd: object, signing: bool = False) -> list[str]:
    """The faults of a campaign given none: pauses, stalls and kills of the workers, and
    writes by impostors (another lock's token, a malformed one, none); with ``signing``,
    forged tokens; with a resource reached over TCP, takeover races timed inside it; with the
    resource's own process (``resource_cmd``), its kill -9 restarts and pauses too."""
    out = ["pause", "stall", "kill", "impostor"]
    if signing:  # (a resource that never verifies a signature passes every other fault)
        out.append("forge")
    if resource and _tcp(resource):
        out.append("race")
    if resource_cmd:
        out += ["resource-restart", "resource-pause"]
    return out


class _Tail:
    """Reads the history as it grows, from where it was when made."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0

    def wait(self, matches: Callable[[Any], bool], limit: float) -> Any:
        """The first new event ``matches`` accepts, or None after ``limit`` seconds."""
        deadline = time.monotonic() + limit
        while True:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            for line in complete.splitlines():
                self.offset += len(line) + 1
                e = json.loads(line)
                if matches(e):
                    return e
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.002)  # (polling a file: the workers write it, not this process)


class _ResourceProcess:
    """The user's resource as a process the kit controls: started with ``cmd`` (its own
    process group), ready when ``host:port`` accepts a connection; killed with SIGKILL and
    started again on the same data; paused with SIGSTOP."""

    def __init__(self, cmd: str | Sequence[str], url: str, log: Path) -> None:
        self.argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
        if not self.argv:
            raise ConfigurationError("--resource-cmd: no command given")
        address = _host_port(url)
        if address is None:
            raise ConfigurationError(
                f"--resource-cmd needs --resource at one host:port, not {_shown(url)!r}"
            )
        self.address = address
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, limit: float = 30.0) -> None:
        # Something answering there already (an earlier run's server left behind) would pass
        # for this command's, and the campaign would test it instead.
        with contextlib.suppress(OSError), socket.create_connection(self.address, 0.5):
            raise CampaignError(
                f"{self.address[0]}:{self.address[1]} already accepts connections before "
                "--resource-cmd ran: stop what listens there, or give the command another port"
            )
        with open(self.log, "ab") as log:
            try:
                self.proc = subprocess.Popen(
                    # (SIGKILLed if the kit dies, even by SIGKILL: none left on the port)
                    parentdeath.argv(self.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    start_new_session=True,  # its own process group: signals reach it alone
                )  # fmt: skip
            except OSError as exc:
                raise CampaignError(f"--resource-cmd: {exc}") from exc
        deadline = time.monotonic() + limit
        while True:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()
                raise CampaignError(
                    f"the resource command exited with status {self.proc.returncode}: "
                    f"{tail[-1] if tail else 'no output'} (see {self.log})"
                )
            with contextlib.suppress(OSError), socket.create_connection(self.address, 0.5):
                return
            if time.monotonic() >= deadline:
                self.stop()
                raise CampaignError(
                    f"the resource command did not listen on {self.address[0]}:"
                    f"{self.address[1]} within {limit:.0f} s (see {self.log})"
                )
            time.sleep(0.02)  # (polling a port the command opens when it is ready)

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def restart(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        self.start()

    def stop(self) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait()


def _last_event(path: Path, name: str) -> Any:
    """Worker ``name``'s last event in the history (None: none yet)."""
    last: Any = None
    with contextlib.suppress(OSError), open(path, "rb") as f:
        for line in f:
            if f'"worker":"{name}"'.encode() in line:
                with contextlib.suppress(ValueError):
                    last = json.loads(line)
    return last


# A worker's last event when it is inside a call to the resource: granted (its read), read
# (its write), stopped inside its write. After any other (none yet, a write answered, a
# release) it waits for the token source: killed there at the run's end, it leaves nothing
# half-done at the resource, and the resource is not what hung.
_AT_RESOURCE: Final = frozenset({"grant", "read", "stalled"})


def _last_step(path: Path, name: str) -> str:
    """Worker ``name``'s last event in the history, as a verdict names it."""
    last = _last_event(path, name)
    if last is None:
        return "none"
    step = f"{last['op']} (token {last['token']})" if "token" in last else str(last["op"])
    where = {
        "read": ": hung in its write",
        "grant": ": hung in its read",
        "release": ": waiting for the lock",
    }
    return step + where.get(last["op"], "")


T = TypeVar("T")


def _bounded(call: Callable[[], T], limit: float, what: str) -> T:
    """``call()`` (made in a thread of its own), or a CampaignError naming ``what`` if it
    has not returned within ``limit`` seconds (the thread is left to its fate: a user's
    adapter may hang for ever, the run may not)."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as exc:  # (raised below, in the caller's thread)
            box.append((False, exc))

    thread = threading.Thread(target=run, name="fenced-check-bounded", daemon=True)
    thread.start()
    thread.join(limit)
    if not box:
        raise CampaignError(f"{what} did not return within {limit:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _stall_victim(pid: int, name: str, tail: _Tail, limit: float) -> Any:
    """Ask worker ``pid`` to stop itself before its next write; its ``stalled`` event, or
    None (the stall taken back) if it did not come within ``limit`` seconds."""
    os.kill(pid, signal.SIGUSR1)
    stalled = tail.wait(lambda e: e["op"] == "stalled" and e["worker"] == name, limit)
    if stalled is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)  # take it back
            if _stopped(pid):  # (it stopped itself just now, after all)
                os.killpg(pid, signal.SIGCONT)
    return stalled


def _wait_forwarded(proxy: TcpProxy | None, before: int, limit: float) -> None:
    """Until ``proxy`` has passed bytes on to the resource since it had passed ``before``."""
    deadline = time.monotonic() + limit
    while proxy is not None and proxy.forwarded == before and time.monotonic() < deadline:
        time.sleep(0.0005)  # (a proxy's counter, moved by its own thread)


def _takeover(
    victim: Worker,
    name: str,
    others: list[TcpProxy],
    mine: TcpProxy | None,
    tail: _Tail,
    ttl: float,
    after: float,
    restart: Callable[[], None] | None,
    read_first: bool = False,
    successors: Sequence[int] = (),
    burst: _Burst | None = None,
) -> None:
    """The ``race`` and ``resource-restart`` nemeses: stop the victim before its write, hold
    every other worker's way to the resource, wait for a successor's grant (``race``) or its
    acknowledged write (``resource-restart``, which then restarts the resource), then let the
    victim's write go and, ``after`` seconds after it reached the resource (``race``) or once
    it was answered, the others' held requests. ``read_first`` (a ``race`` the other way
    round): nothing is held; the victim goes on as soon as its successor's read was answered,
    so its write lands between that read and the successor's write. ``successors`` (the other
    workers' pids, ``resource-restart`` only): the restart comes instead after the successor's
    fenced read and before its write (each of them stops itself before its next write; the one
    granted does, after its read): a mark that only a read raised must survive the restart (a
    mark rebuilt from the data at start-up lets the stale write in, and the successor's write
    then loses it). ``burst`` (a ``race``): the victim's write sent again and again around the
    successor's read instead of that read ``after`` seconds behind it (see :class:`_Burst`)."""
    limit = 4 * ttl + 2
    stalled = _stall_victim(victim.pid, name, tail, limit)
    if stalled is None:
        if restart is not None:
            restart()
        return
    token = stalled["token"]
    successor: Any = None
    try:
        if read_first:
            tail.wait(lambda e: e["op"] == "read" and e["token"] > token, limit)
            return  # (continued below)
        if restart is None:
            for p in others:  # (before any successor can send its read)
                p.partition()
            successor = tail.wait(lambda e: e["op"] == "grant" and e["token"] > token, limit)
            if burst is not None and successor is not None:
                burst = burst if burst.ready(stalled, successor) else None
        elif successors:
            for pid in successors:  # (the victim holds the lock: none is in its write yet)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
            tail.wait(lambda e: e["op"] == "stalled" and e["token"] > token, limit)
            for p in others:  # (the victim's write is the first the restarted resource hears)
                p.partition()
            restart()
        else:
            tail.wait(lambda e: e["op"] == "write" and e["token"] > token and e["ok"], limit)
            for p in others:  # (the victim's write is the first the restarted resource hears)
                p.partition()
            restart()
        before = mine.forwarded if mine is not None else 0
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.pid, signal.SIGCONT)
        if restart is None:
            _wait_forwarded(mine, before, limit)
            if burst is not None and successor is not None:

                def heal() -> None:
                    for p in others:
                        p.heal()

                burst.fire(heal)
            else:
                time.sleep(after)  # (the successor's request follows the victim's in)
        else:
            tail.wait(lambda e: e["op"] == "write" and e["worker"] == name, limit)
    finally:
        for p in others:
            p.heal()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.pid, signal.SIGCONT)
        if burst is not None:
            burst.close()
        for pid in successors:  # (the stalls not taken are taken back; the one taken goes on)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR2)
                os.killpg(pid, signal.SIGCONT)
    if successor is not None:  # its round ends before the next fault (which may stall it)
        who = successor["worker"]
        tail.wait(lambda e: e["op"] in ("write", "releasing") and e["worker"] == who, limit)


BURST_COPIES: Final = 48
"""How many times the ``race`` nemesis sends a stale write again (see :class:`_Burst`)."""


class _Burst:
    """The ``race`` nemesis' burst: the stale holder's write, sent :data:`BURST_COPIES` times
    more under its token (each copy on its own connection, told apart by trailing whitespace
    a JSON reader skips), one every 0.5-1 ms from the instant the holder's own write reached
    the resource, with the successor's held fenced read let through among them. A check and a
    write made in two steps with no gap between them (two transactions back to back) let a
    read in between only when it lands in that gap, microseconds wide: one pair sent at the
    same instant did so 13% of the time by hand; a read among a stream of copies meets many
    gaps. The successor is then stopped before its write (as a stall) while the kit looks at
    the register without a token (``look``): bytes other than its read saw, last written by
    the stale token, are a copy that landed after the read (``_checkers``; so are a later
    holder's read's). Drawn from its
    own seeded generator (the run's schedule of faults stays the seed's); bounded by its
    count and the resource's time limit."""

    def __init__(self, workload: LocksWorkload, victim: str, rng: random.Random) -> None:
        self.workload, self.victim = workload, victim
        self.spacing = rng.uniform(0.0005, 0.001)
        self.slot = rng.randrange(BURST_COPIES // 8, BURST_COPIES // 3)
        self.made: list[Any] = []
        self.copies: list[bytes] = []
        self.token: Any = None
        self.value = 0
        self.successor: tuple[int, str] | None = None

    def ready(self, stalled: Any, successor: Any) -> bool:
        """Make the copies of the victim's write (its register as it read it, one more entry)
        and their connections, before it goes on; False: no burst (the register is not what
        it read, or the resource did not answer)."""
        from ..._core.signing import token_message
        from ..._core.token import FencingToken

        w = self.workload
        read = _event_of(w.path, self.victim, "read", stalled["token"])
        pid = next((p.pid for p in w.procs if w.names[p.pid] == successor["worker"]), None)
        if read is None or pid is None:
            return False
        self.successor = (pid, successor["worker"])
        t, lock = stalled["token"], w.lock
        try:
            self.made = [
                open_resource(w.resource, lock, timeout=w.io_limit) for _ in range(BURST_COPIES)
            ]
            data, _ = _bounded(self.made[0].final, w.io_limit, "the resource's final()")
            entries = json.loads(data) if data else []
        except Exception:  # (the burst is the nemesis' extra: none this time)
            return False
        if (entries[-1][1] if entries else 0) != read.get("value"):
            return False  # (someone else wrote since: the copies would not be the victim's)
        self.value = read["value"] + 1
        base = json.dumps([*entries, [t, self.value]], separators=(",", ":")).encode()
        self.copies = [base + b" " * (k + 1) for k in range(BURST_COPIES)]
        signature = None
        if w.key is not None:
            signature = (
                w.key.kid,
                w.key.sign(token_message(lock, t, w.key.kid, _SOURCE_ID)),
                _SOURCE_ID,
            )
        self.token = FencingToken(lock, t, signature)
        return True

    def fire(self, heal: Callable[[], None]) -> None:
        """The copies, ``heal`` (the successor's read let through) at its slot among them;
        then, once every copy was answered and the successor stopped before its write, the
        look; then the successor goes on."""
        w, lock, token = self.workload, self.workload.lock, self.token
        lane = w.lanes.get("burst") or w.lanes.setdefault("burst", History(w.path, "burst"))
        assert self.successor is not None
        pid, name = self.successor
        limit = 4 * w.ttl + 2
        start = time.monotonic() + 0.002  # (every thread started and waiting by then)

        def send(k: int) -> None:
            time.sleep(max(0.0, start + k * self.spacing - time.monotonic()))
            sent = _clock.now()
            try:
                self.made[k].write(token, self.copies[k])
                ok: bool | None = True
            except StaleTokenError:
                ok = False
            except Exception:
                ok = None
            lane.append("write", lock=lock, token=token.value, value=self.value, ok=ok,
                        sent=sent, burst=k, of=self.victim)  # fmt: skip

        offset = w.path.stat().st_size
        threads = [
            threading.Thread(target=send, args=(k,), name="fenced-check-burst", daemon=True)
            for k in range(BURST_COPIES)
        ]
        for t in threads:
            t.start()
        time.sleep(max(0.0, start + self.slot * self.spacing - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)  # (the successor stops after its read, before its write)
        heal()
        tail = _Tail(w.path)
        tail.offset = offset
        # (its read refused, it never writes: no stall to wait for)
        read = tail.wait(lambda e: e["op"] == "read" and e["worker"] == name, limit)
        stopped = None
        if read is not None and read["ok"] is True:
            stopped = tail.wait(lambda e: e["op"] == "stalled" and e["worker"] == name, limit)
        try:
            if stopped is not None:
                sent = _clock.now()
                data, _ = _bounded(self.made[0].final, w.io_limit, "the resource's final()")
                entries = json.loads(data) if data else []
                lane.append("look", sent=sent, seen=digest(data), last=entries[-1] if entries else None,
                            of=name)  # fmt: skip
        except Exception:  # (no look: nothing judged by it)
            pass
        finally:
            with contextlib.suppress(ProcessLookupError):
                if stopped is None:
                    os.kill(pid, signal.SIGUSR2)  # (the stall not taken: taken back)
                os.killpg(pid, signal.SIGCONT)
        # (the look comes first: a successor stopped past its lease lets a third holder in)
        deadline = time.monotonic() + w.io_limit + 1
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        for made in self.made:
            with contextlib.suppress(Exception):
                made.close()
        self.made = []


def _event_of(path: Path, name: str, op: str, token: int) -> Any:
    """Worker ``name``'s last ``op`` event with ``token`` in the history (None: none)."""
    found: Any = None
    with contextlib.suppress(OSError), open(path, "rb") as f:
        for line in f:
            if f'"worker":"{name}"'.encode() in line and f'"op":"{op}"'.encode() in line:
                with contextlib.suppress(ValueError):
                    e = json.loads(line)
                    if e.get("token") == token:
                        found = e
    return found


class LocksWorkload:
    """The workload of ``fenced check``: worker processes take one lock from a source and
    read-modify-write a register in a resource under its token (``_worker``), under the
    nemeses of the module docstring; judged by every checker of ``_checkers``. The arguments
    are :func:`run_campaign`'s; bad ones raise a ConfigurationError before anything starts."""

    # (and stalls: the window of a fence off by one or a read left unfenced, in any resource)
    first = _AT_THE_RESOURCE | {"stall"}

    def __init__(
        self,
        source: str | None,
        out: Path,
        *,
        resource: str = "",
        lock: str = "counter",
        workers: int = 3,
        ttl: float = 1.0,
        nemesis: Sequence[str] | None = None,
        seed: int = 0,
        plant: str = "",
        signing: bool = False,
        resource_cmd: str | Sequence[str] = "",
        options: dict[str, Any] | None = None,
    ) -> None:
        plant_role(plant)  # (an unknown plant: a typed error first)
        if nemesis is None:
            nemesis = PLANT_NEMESES.get(plant, ("stall",)) if plant else None
        nemesis = list(
            default_nemeses(resource, resource_cmd, signing) if nemesis is None else nemesis
        )
        self.needs = PLANT_NEEDS.get(plant, ())
        if self.needs and not set(self.needs) & set(nemesis):
            nemesis.append(self.needs[0])  # the plant turns on what shows it
        unknown = set(nemesis) - set(NEMESES)
        if unknown:
            raise ConfigurationError(
                f"no nemesis {', '.join(sorted(unknown))}: use {', '.join(NEMESES)}"
            )
        self.role = role = plant_role(plant)
        if role == "resource" and resource:
            raise ConfigurationError(
                f"--plant {plant} plants a fault in the kit's own resource: drop --resource"
            )
        if role == "source" and source:
            raise ConfigurationError(
                f"--plant {plant} plants a fault in a source the kit starts: drop --source"
            )
        if "clock" in nemesis and source in _FAKETIME_ENGINES and faketime_library() is None:
            raise ConfigurationError(
                "stepping a PostgreSQL server's clock needs libfaketime (Debian: apt-get install faketime)"
            )
        self.signing = signing or plant in SIGNING_PLANTS
        if "forge" in nemesis and not self.signing:
            raise ConfigurationError("the forge nemesis needs signed tokens: --signing")
        if set(nemesis) & _NEEDS_PROCESS and not resource_cmd:
            raise ConfigurationError(
                "the resource-restart and resource-pause nemeses act on the resource's process: "
                "give its command (--resource-cmd)"
            )
        if resource_cmd and not resource:
            raise ConfigurationError("--resource-cmd serves a --resource: give its URL too")
        if set(nemesis) & _RESOURCE_PATH and not (resource and _tcp(resource)):
            raise ConfigurationError(
                f"the {', '.join(sorted(set(nemesis) & _RESOURCE_PATH))} nemesis needs a resource "
                "reached at one host:port (--resource http://HOST:PORT/...)"
            )
        self.netns = _worker_netns()  # (before anything starts)
        self.nemeses = tuple(nemesis)
        self.prefix_checkers = {name: CHECKERS[name] for name in PREFIX_CHECKERS}
        self.source, self.resource, self.resource_cmd = source, resource, resource_cmd
        self.out, self.lock, self.workers, self.ttl = out, lock, workers, ttl
        self.seed, self.plant = seed, plant
        # Every option of the run, recorded first in the history (and shown in the report):
        # with the seed, what a failure is reproduced from.
        self.options = {**(options or {}), "seed": seed, "nemesis": list(self.nemeses)}
        self.path = out / "history.jsonl"
        self.scratch = ""
        self.server: Any = None
        self.server_clock: Path | None = None  # the kit-started source's libfaketime offset
        self.forger: Any = None
        self.lanes: dict[str, History] = {}  # the forger's and the impostor's histories
        self.forged = self.impostors = 0
        self.stalls_dealt = 0  # stall faults struck (which kind of stall: their count)
        self.opaque = _opaque(resource, plant)  # (a one-step write the kit cannot see into)
        self.restarts = 0  # resource-restarts struck (odd ones: after the successor's read)
        self.races = 0  # races struck (even ones: at the same instant)
        self.key: Any = None
        self.key_file: Path | None = None
        self.proxies: dict[int, list[TcpProxy]] = {}  # worker pid -> its ways to source, resource
        self.to_resource: dict[int, TcpProxy] = {}  # worker pid -> its own way to the resource
        self.served: _ResourceProcess | None = (
            None  # the user's resource, as a process the kit runs
        )
        self.names: dict[int, str] = {}  # worker pid -> its name in the history
        self.procs: list[Worker] = []
        self.stalls: list[threading.Thread] = []
        self.serial = 0
        self.tcp_resource = False
        self.env: dict[str, str] = {}

    # -- setup ---------------------------------------------------------------------------------

    def setup(self, history: Path) -> None:
        with History(history, "nemesis") as h:
            h.append("run", options=self.options)
        self.scratch = scratch = tempfile.mkdtemp(prefix="fenced-check-")
        nemesis, source, plant = self.nemeses, self.source, self.plant
        if self.role == "source":
            self.server = source_plant_server(plant, scratch)
            self.server.die_with_parent = True  # (a kill -9 of the kit leaves no server behind)
            self.server.start()
            source = (
                # The planted mistake made on purpose: fenced refuses a Redis without AOF unless
                # told to accept that tokens may be reused.
                f"{self.server.url}?allow_unsafe_durability=true"
                if plant == "counter-not-fsynced"
                else f"http://127.0.0.1:{self.server.port}"
            )
        elif source in ENGINES:
            if "clock" in nemesis:
                clock_dir = Path(tempfile.mkdtemp(prefix="fenced-clock-", dir=scratch))
                clock_dir.chmod(0o755)  # (PostgreSQL runs as its own user)
                self.server_clock = clock_dir / "offset"
                self.server_clock.write_text("+0\n")
                self.server_clock.chmod(0o644)
            os.chmod(scratch, 0o711)  # (PostgreSQL runs as its own user, below it)
            (Path(scratch) / "server").mkdir()
            try:
                self.server = _start_engine(
                    str(source), str(Path(scratch) / "server"), self.server_clock
                )
            except Exception as exc:
                raise CampaignError(f"could not start {source}: {exc}") from exc
            source = self.server.url
        elif source is None:
            # The campaign's own source: the machine-wide default is every local user's, and
            # a campaign's hundreds of grants do not belong in it.
            source = f"sqlite:///{Path(scratch) / 'source.db'}"
        self.source = source
        if "restart" in nemesis and self.server is None:
            raise ConfigurationError(
                "the restart nemesis restarts a source the kit started: --source redis|etcd|postgresql|zookeeper"
            )
        if not self.resource:
            db = self.out / "resource.db"
            db.unlink(missing_ok=True)
            # (sqlite:////ABS: the guard URL grammar's absolute path, fenced.guards.registry)
            planted = self.role == "resource"
            scheme = "planted+sqlite://" if planted else "sqlite:///"
            self.resource = f"{scheme}{db.resolve()}" + (f"?plant={plant}" if planted else "")
        resource = self.resource
        self.tcp_resource = _tcp(resource)
        if self.resource_cmd:
            self.served = _ResourceProcess(self.resource_cmd, resource, self.out / "resource.log")
            self.served.start()
        if set(nemesis) & _NEEDS_TCP and not _tcp(source):
            raise ConfigurationError(
                f"partition/delay need a source at one host:port, not {_shown(source)!r}"
            )
        from ..._core import sync as _sync

        with _sync.connect(source, connect_timeout=30):  # a bad source: a typed error, now
            pass

        keyring: Any = None
        if self.signing:
            from ..._core.signing import Keyring, generate_key, key_text

            self.key = generate_key("hmac", "check")
            self.key_file = Path(scratch) / "signing.key"
            # (made 0600: written first and chmod-ed after, it was readable by all meanwhile)
            fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(key_text(self.key))
            keyring = Keyring([self.key], source_id=_SOURCE_ID)

        def reset() -> None:
            made = open_resource(resource, self.lock, timeout=self.io_limit)
            try:
                made.reset()
                _reset_left_nothing(made, self.lock, _shown(resource), self.key)
                made.reset()  # (what the probes wrote: gone again)
            finally:
                made.close()

        try:
            _bounded(reset, self.io_limit, f"resource {_shown(resource)}: its reset()")
        except ConfigurationError:
            raise
        except Exception as exc:  # (any adapter's own error: one line, with its type)
            said = _scrubbed(str(exc), [resource, source])
            raise CampaignError(
                f"resource {_shown(resource)}: {type(exc).__name__}: {said}"
            ) from exc
        if {"forge", "impostor"} & set(nemesis):
            self.forger = open_resource(resource, self.lock, keyring, timeout=self.io_limit)
        self.env = python_env()
        self.env[IO_TIMEOUT_ENV] = f"{self.io_limit:g}"  # (an HTTP resource's bound, in workers)
        try:
            here = os.getcwd()
        except FileNotFoundError:  # (a deleted directory: nothing to import from there)
            here = ""
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.env.get("PYTHONPATH"), here]))
        # Started together, then each waited for: a Python start-up each, side by side (one
        # after the other, a loaded machine's start-ups added up to seconds before any fault).
        self.procs.extend(self._spawn(ready=False) for _ in range(self.workers))
        for p in self.procs:
            _wait_ready(p, _worker_log(self.out, self.names[p.pid]), urls=self._urls)

    def _spawn(self, ready: bool = True) -> Worker:
        self.serial += 1
        serial, nemesis, out = self.serial, self.nemeses, self.out
        ways: list[TcpProxy] = []
        src, res = str(self.source), self.resource
        if set(nemesis) & _NEEDS_TCP:
            src = _via_proxy(src, ways)
        if self.tcp_resource and set(nemesis) & (_NEEDS_TCP | _RESOURCE_PATH):
            res = _via_proxy(res, ways)
            resource_way: TcpProxy | None = ways[-1]
        else:
            resource_way = None
        cfg = {
            "source": src, "resource": res, "history": str(self.path), "name": f"w{serial}",
            "ttl": self.ttl, "seed": self.seed, "plant": self.plant, "lock": self.lock,
            "signing_key": str(self.key_file) if self.key_file else None,
            "source_id": _SOURCE_ID if self.key_file else None,
        }  # fmt: skip
        worker_env = self.env
        if "clock" in nemesis:
            offset = Path(self.scratch) / f"clock-w{serial}"
            offset.write_text("0\n")
            worker_env = {**self.env, "FENCED_CHECK_CLOCK": str(offset)}
        argv = [sys.executable, "-m", "fenced.testing.check._worker", json.dumps(cfg)]
        with open(_worker_log(out, f"w{serial}"), "wb") as log:
            if self.netns:  # (ip execs the worker: the same pid, signals reach it as before)
                from ..netns import _ip_binary

                ns = self.netns[(serial - 1) % len(self.netns)]
                proc: Worker = subprocess.Popen(
                    parentdeath.argv([str(_ip_binary()), "netns", "exec", ns, *argv]),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=worker_env,
                    start_new_session=True,  # its own process group: signals reach it alone
                )
            else:  # forked from the kit's zygote: no Python start-up, no import, each time
                proc = _zygote.spawn(
                    "fenced.testing.check._worker", argv[3:], env=worker_env, stderr=log,
                    stdin_pipe=True,
                )  # fmt: skip
        self.proxies[proc.pid] = ways
        if resource_way is not None:
            self.to_resource[proc.pid] = resource_way
        self.names[proc.pid] = f"w{serial}"
        if ready:
            _wait_ready(proc, _worker_log(out, f"w{serial}"), urls=self._urls)
        return proc

    # -- the nemesis ---------------------------------------------------------------------------

    def pace(self, rng: random.Random) -> float:
        return rng.uniform(0.5, 1.5) * self.ttl

    def healthy(self) -> None:
        for p in self.procs:
            if p.poll() is not None:  # (the kill nemesis waits for its victim: not here)
                log_name = f"worker-{self.names[p.pid]}.log"
                tail = (self.out / log_name).read_text(errors="replace").strip().splitlines()
                raise CampaignError(
                    f"worker {self.names[p.pid]} exited with status {p.returncode}: "
                    f"{_scrubbed(tail[-1], self._urls) if tail else 'no output'} "
                    f"(see {self.out / log_name})"
                )

    def _holding(self, default: int) -> int:
        holder = _current_holder(self.path)
        return next((n for n, p in enumerate(self.procs) if self.names[p.pid] == holder), default)

    def aim(self, kind: str, rng: random.Random) -> Fault:
        ttl, procs, names = self.ttl, self.procs, self.names
        # The victim from the seed alone, never from who holds the lock now (that depends on
        # timing: the same seed then struck other workers, and a verdict did not reproduce).
        # A stall or a takeover waits for its victim's own next write; a pause or a kill of a
        # waiting worker lands when the source may grant it the lock meanwhile.
        i = rng.randrange(len(procs))
        rng.random()  # (the draw that once chose the holder: kept, so the seeds' schedules stay)
        # Past the lease, by a varying margin: a late writer then lands anywhere in its
        # successor's round (between its read and its write too).
        lasts = rng.uniform(1.2, 3.0) * ttl if kind in _LASTING else 0.0
        on_server = kind == "restart" or (
            kind == "clock" and self.server_clock is not None and rng.random() < 0.5
        )
        after = rng.uniform(0.002, 0.03)  # race: the successor's request, that much later
        victim = procs[i]
        who = (
            "source" if on_server
            else "forger" if kind == "forge"
            else "impostor" if kind == "impostor"
            else "resource" if kind.startswith("resource-")
            else names[victim.pid]
        )  # fmt: skip

        def strike() -> None:
            self._strike(kind, i, who, lasts, on_server, after, rng)

        return Fault(kind, who, lasts, strike)

    def _strike(
        self,
        kind: str,
        i: int,
        who: str,
        lasts: float,
        on_server: bool,
        after: float,
        rng: random.Random,
    ) -> None:
        ttl, procs, names, path = self.ttl, self.procs, self.names, self.path
        victim, served, to_resource = procs[i], self.served, self.to_resource
        if kind == "pause":
            os.killpg(victim.pid, signal.SIGSTOP)
            time.sleep(lasts)  # past its lease: a successor is granted meanwhile
            os.killpg(victim.pid, signal.SIGCONT)
        elif kind == "stall":  # it stops itself inside its critical section
            # The stalls go in turn (their count, not a draw: a run's first stall opens the
            # window most mistakes need): chained (see _resume_after: the late write lands one
            # grant behind, after the successor's fenced read: an off-by-one fence, an unfenced
            # read, a write before its check let it in), plain (it lands anywhere in the
            # successor's round), and with an adapter's one-step write every other one inside
            # that write (``_worker.InWrite``).
            rng.random()  # (the draw that once chose a chained stall: kept, so the rest stay)
            self.stalls_dealt += 1
            turns = ("chain", "inside", "plain", "inside") if self.opaque else ("chain", "plain")
            turn = turns[(self.stalls_dealt - 1) % len(turns)]
            chain = self._stall if turn == "chain" else None
            stalled = self._stall(who, rng.uniform(0, ttl / 4), chain, inside=turn == "inside")
            # Over only once its worker goes on to its late write: a fault dealt meanwhile on
            # the stalled worker or its successor (a kill, a pause: one in three aimed at
            # either) closed the window before the write reached it. (A chained successor's
            # own stall is not waited for: the late write it made room for is in.)
            if stalled is not None:
                stalled.join(4 * ttl + 3)  # (its own bound is 4 ttls + 2 s)
        elif kind in ("partition", "delay"):
            for proxy in self.proxies[victim.pid]:
                proxy.partition() if kind == "partition" else proxy.delay(1.5 * ttl)
            time.sleep(lasts)
            for proxy in self.proxies[victim.pid]:
                proxy.heal() if kind == "partition" else proxy.delay(0.0)
        elif kind == "restart":
            self.server.restart(kill=True)
        elif kind in ("race", "resource-restart"):
            assert served is not None or kind == "race"
            mine = to_resource.get(victim.pid)
            others = [w for pid, w in to_resource.items() if pid != victim.pid]
            restart = served.restart if kind == "resource-restart" and served else None
            # Every other resource-restart (the first too) lands between the successor's
            # fenced read and its write; the rest after its acknowledged write.
            successors: list[int] = []
            self.restarts += restart is not None
            if restart is not None and self.restarts % 2 == 1:
                successors = [p.pid for p in procs if p.pid != victim.pid]
            self.races += kind == "race"
            if kind == "race" and self.races % 2 == 0:
                # The second race (and every other): the successor's read at the same instant
                # (0.07-1 ms after the stale write), inside a check-then-write with no gap to
                # speak of (two transactions back to back: measured 13% of such pairs land
                # in between, 0% at the 2-30 ms of the first, which an 80 ms gap needs: the
                # read sent 1 ms behind can be handled before the write's check).
                after /= 30
            burst = None
            if kind == "race":  # (its own generator: the run's schedule stays the seed's)
                burst = _Burst(
                    self, names[victim.pid], random.Random(f"{self.seed}-burst-{self.races}")
                )
            _takeover(
                victim, names[victim.pid], others, mine, _Tail(path), ttl, after, restart,
                successors=successors, burst=burst,
            )  # fmt: skip
            if kind == "race":
                # A second burst on whoever holds it next (one meets the gap of a check and
                # a write back to back about 7 times in 10), then the other way round.
                nxt = procs[self._holding(i)]
                _takeover(
                    nxt, names[nxt.pid], [w for p, w in to_resource.items() if p != nxt.pid],
                    to_resource.get(nxt.pid), _Tail(path), ttl, after, None,
                    burst=_Burst(self, names[nxt.pid], random.Random(f"{self.seed}-burst-{self.races}-2")),
                )  # fmt: skip
                nxt = procs[self._holding(i)]
                _takeover(nxt, names[nxt.pid], [], None, _Tail(path), ttl, after, None, True)
        elif kind == "resource-pause":
            assert served is not None
            served.signal(signal.SIGSTOP)
            time.sleep(lasts)
            served.signal(signal.SIGCONT)
        elif kind in ("resource-partition", "resource-delay"):
            for way in to_resource.values():
                way.partition() if kind == "resource-partition" else way.delay(1.5 * ttl)
            time.sleep(lasts)
            for way in to_resource.values():
                way.heal() if kind == "resource-partition" else way.delay(0.0)
        elif kind == "clock":  # a wall clock jumps up to a minute either way
            step = rng.choice([-1, 1]) * rng.uniform(5 * ttl, 60)
            if on_server:
                assert self.server_clock is not None
                self.server_clock.write_text(f"{step:+.3f}\n")
            else:
                (Path(self.scratch) / f"clock-{who}").write_text(f"{step:.3f}\n")
                os.kill(victim.pid, signal.SIGWINCH)
        elif kind in ("forge", "impostor"):
            assert self.forger is not None
            # (each a lane of its own: "forger", "impostor")
            lane = self.lanes.get(who) or self.lanes.setdefault(who, History(path, who))
            if kind == "forge":
                self.forged += 1
                _forge(self.forger, self.lock, lane, rng, self.forged, self.key)
            else:  # (its own count: each of IMPOSTORS in turn)
                self.impostors += 1
                _impostor(self.forger, self.lock, lane, self.impostors, self.key)
        else:
            os.killpg(victim.pid, signal.SIGKILL)
            victim.wait()
            for proxy in self.proxies.pop(victim.pid, []):
                proxy.close()
            to_resource.pop(victim.pid, None)
            procs[i] = self._spawn()

    def _stall(
        self,
        who: str,
        delay: float = 0.0,
        chain: Callable[[str], object] | None = None,
        inside: bool = False,
    ) -> threading.Thread | None:
        """Have worker ``who`` stop itself before its next write (``inside``: inside it, a
        one-step write's), and continue it later (the thread that will; None: no such
        worker)."""
        pid = next((p.pid for p in self.procs if self.names[p.pid] == who), None)
        if pid is None:
            return None
        # (from where the history ends now: an earlier stall's events are not this one's)
        offset = self.path.stat().st_size
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STALL_INSIDE if inside else signal.SIGUSR1)
        args = (pid, who, self.path, delay, 4 * self.ttl + 2, chain, offset)
        thread = threading.Thread(target=_resume_after, args=args, daemon=True)
        self.stalls.append(thread)
        thread.start()
        return thread

    # -- teardown and verdict ------------------------------------------------------------------

    @property
    def _urls(self) -> list[str | None]:
        """The URLs whose passwords no message of the kit shows."""
        return [self.source, self.resource]

    @property
    def io_limit(self) -> float:
        """Seconds a step at the resource may take (an HTTP request, an adapter's reset() or
        final(), a worker's last round once told to stop): past a resource pause (3 ttls)
        and a delayed write (1.5 ttls), with room for a loaded machine."""
        return 10 * self.ttl + 5

    def _stop_workers(self) -> list[str]:
        """Stop the workers; what hung: each worker that did not end its round within
        :attr:`io_limit` of being told to (killed), with its last step in the history."""
        ttl = self.ttl
        hung: list[str] = []
        for t in self.stalls:
            t.join(10 * ttl + 10)
        self.stalls = []
        for p in self.procs:  # (a stall asked for but not yet taken must not stop it for good)
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGUSR2)
                os.killpg(p.pid, signal.SIGCONT)
        for ways in self.proxies.values():
            for proxy in ways:
                proxy.heal()
                proxy.delay(0.0)
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()  # finish the current round and stop
        deadline = time.monotonic() + self.io_limit  # (one bound for all: they end side by side)
        for p in end_by(self.procs, deadline):
            name = self.names[p.pid]
            last = _last_event(self.path, name)
            if last is None or last.get("op") not in _AT_RESOURCE:
                continue  # (waiting for the lock, e.g. through a partition: not the resource)
            hung.append(
                f"worker {name} did not end its round within {self.io_limit:g} s of the "
                f"run's end (killed); its last step: {_last_step(self.path, name)}"
            )
        for ways in self.proxies.values():
            for proxy in ways:
                proxy.close()
        self.proxies, self.procs = {}, []  # (reaped: their pids are no longer theirs to signal)
        if self.forger is not None:
            self.forger.close()
            self.forger = None
        for lane in self.lanes.values():
            lane.close()
        self.lanes = {}
        return hung

    def settle(self, history: History) -> None:
        hung = self._stop_workers()
        for why in hung:  # (the verdict says what hung: "run incomplete")
            history.append("aborted", why=why)

        def final() -> tuple[bytes | None, int | None]:
            made = open_resource(self.resource, self.lock, timeout=self.io_limit)
            try:
                return made.final()
            finally:
                made.close()

        try:
            data, mark = _bounded(final, self.io_limit, "its final()")
        except Exception as exc:  # (the verdict says so: "run incomplete")
            said = _scrubbed(str(exc), [self.resource, self.source])
            raise CampaignError(
                f"the resource's final state could not be read: {type(exc).__name__}: {said}"
            ) from exc
        history.append("final", lock=self.lock, mark=mark, log=_log(data))

    def close(self) -> None:
        try:
            self._stop_workers()
        finally:
            if self.served is not None:
                self.served.stop()
            if self.server is not None:
                self.server.close()
            if self.scratch:
                shutil.rmtree(self.scratch, ignore_errors=True)

    def is_operation(self, event: Event) -> bool:
        # (a forger's and the race burst's: the nemesis')
        return event["op"] == "write" and not event.get("forged") and event.get("burst") is None

    def judge(
        self, events: list[Event], faults: dict[str, int], seconds: float, short: str = ""
    ) -> CampaignResult:
        writes = [e for e in events if e["op"] == "write" and not e.get("forged")]  # (workers')
        violations = check_all(events)
        needs, plant = self.needs, self.plant
        if needs and not any(faults.get(n) for n in needs):
            violations.append(
                Violation(
                    "plant not exercised",
                    f"--plant {plant} shows only under the {' or '.join(needs)} nemesis, and the "
                    f"run ended before any: give it more --time",
                )
            )
        elif plant and not violations:
            # A planted bug the faults never showed proves nothing either way: never a pass
            # (a user who plants one to watch the kit work must not read "every invariant held").
            violations.append(
                Violation(
                    "plant not exercised",
                    f"--plant {plant} was never caught: the faults of this run ({', '.join(self.nemeses)}, "
                    f"seed {self.seed}) did not open its window; give it more --time or another --seed",
                )
            )
        # (a run short of its counts says so; one that dealt some kind no time: inconclusive)
        violations = undealt(short_of_counts(violations, short), self.nemeses, faults, seconds)
        report = write_report(events, violations, self.out / "report.html", self.options)
        return CampaignResult(
            violations=violations,
            report=report,
            history=self.path,
            grants=sum(1 for e in events if e["op"] == "grant"),
            accepted=sum(1 for e in writes if e["ok"] is True),
            refused=sum(1 for e in writes if e["ok"] is False),
            unknown=sum(1 for e in writes if e["ok"] is None),
            faults=faults,
            seconds=seconds,
            first_violation_after=_first_violation_after(events, violations),
            refused_reads=sum(
                1 for e in events if e["op"] == "read" and e["ok"] is False and not e.get("forged")
            ),
            turned_away=sum(
                1
                for e in events
                if e["op"] in ("write", "read") and e.get("forged") and e["ok"] is False
            ),
            seed=self.seed,
            options=self.options,
        )


def run_campaign(
    source: str | None,
    out: str | Path,
    *,
    resource: str = "",
    lock: str = "counter",
    workers: int = 3,
    seconds: float = 20.0,
    ttl: float = 1.0,
    nemesis: Sequence[str] | None = None,
    seed: int = 0,
    plant: str = "",
    signing: bool = False,
    progress: Callable[[float, str], None] | None = None,
    resource_cmd: str | Sequence[str] = "",
    stop_at_first: bool = False,
    faults: int = 0,
    writes: int = 0,
) -> CampaignResult:
    """Run one campaign of the locks workload (:class:`LocksWorkload`) and check it.
    ``source``: a token-source URL, an engine name the kit
    starts itself (:data:`ENGINES`), or None for a private SQLite source of the campaign's
    own (never the machine-wide default every local user shares). ``resource``: a URL of
    :func:`~fenced.testing.check.open_resource` ("" for an embedded SQLite register in
    ``out``). ``resource_cmd``: the command that serves ``resource`` (a shell-like string or
    an argv list): the kit starts it, restarts and pauses it. ``nemesis``: None for
    :func:`default_nemeses`, or with a plant the faults that show it (:data:`PLANT_NEMESES`);
    a plant adds the fault it needs to any asked for (:data:`PLANT_NEEDS`).
    ``signing``: workers get signed tokens (an HMAC key made for the run) and the resource's
    guard verifies them. ``progress(elapsed, what)`` is called as the run goes.
    ``stop_at_first``: end the run early once every nemesis has struck and the history so
    far shows a violation that later events cannot take back (:data:`PREFIX_CHECKERS`); the
    verdict is still every checker over the whole history, the final state included.
    ``faults``, ``writes``: counts — each nemesis struck at least ``faults`` times and at least
    ``writes`` writes made by the workers (accepted, refused or unanswered) — that end the run
    as soon as both are reached; ``seconds`` is then the run's bound, and a run whose bound
    ends first fails ("counts not reached") unless it already found a violation."""
    out = Path(out)
    options = {
        "source": _recorded(source), "resource": _recorded(resource), "resource_cmd": _shown_cmd(
            resource_cmd), "lock": lock, "workers": workers, "seconds": seconds, "ttl": ttl,
        "plant": plant, "signing": signing, "stop_at_first": stop_at_first, "faults": faults,
        "writes": writes,
    }  # fmt: skip
    workload = LocksWorkload(
        source, out, resource=resource, lock=lock, workers=workers, ttl=ttl, nemesis=nemesis,
        seed=seed, plant=plant, signing=signing, resource_cmd=resource_cmd, options=options,
    )  # fmt: skip
    campaign: Campaign[CampaignResult] = Campaign(
        workload, out, seconds=seconds, seed=seed, progress=progress,
        stop_at_first=stop_at_first, faults=faults, operations=writes,
    )  # fmt: skip
    return campaign.run()


def _recorded(url: str | None) -> str | None:
    """A URL as the history and the report record it: its password never (a resource that is
    no URL, ``python:MODULE:CLASS`` or a file's path, as given)."""
    return redacted(url) if url and "://" in url else url


# An argument of a command that carries a secret: NAME=VALUE with such a NAME (an environment
# variable set by `env`, a DSN), or the value after such an option (--password VALUE).
_SECRET_NAME: Final = re.compile(r"pass|secret|token|key|pwd|dsn|credential|auth", re.I)


def _shown_cmd(cmd: str | Sequence[str]) -> str:
    """``--resource-cmd`` as recorded: any URL in it without its password, any NAME=VALUE
    whose name says secret (``PGPASSWORD=...``, ``DATABASE_DSN=...``) and the value after
    such an option (``--password VALUE``) as ``***``."""
    argv = shlex.split(cmd) if isinstance(cmd, str) else list(cmd)
    shown: list[str] = []
    for i, a in enumerate(argv):
        before = argv[i - 1] if i else ""
        name, eq, _ = a.partition("=")
        if before.startswith("-") and "=" not in before and _SECRET_NAME.search(before):
            a = "***"
        elif eq and _SECRET_NAME.search(name):
            a = f"{name}=***"
        elif "://" in a:
            a = redacted(a)
        shown.append(a)
    return shlex.join(shown)


PREFIX_CHECKERS = ("token reuse", "lost update", "overlap", "forged token", "impostor accepted")
"""The checkers whose violations in a history's prefix stay violations in the whole history
(nothing appended later takes them back), so a run may end at the first
(``run_campaign(stop_at_first=True)``). The others need the final state."""


def _log(data: bytes | None) -> list[list[int]] | None:
    """The register's entries, or None when it holds something the workers did not write
    (every checker that needs the final state then says so)."""
    if not data:
        return []
    try:
        loaded = json.loads(data)
    except ValueError:
        return None
    ok = isinstance(loaded, list) and all(
        isinstance(e, list) and len(e) == 2 and all(type(v) is int for v in e) for e in loaded
    )
    return loaded if ok else None


def _first_violation_after(events: list[Any], violations: list[Violation]) -> float | None:
    """Seconds from the first event to the first moment a violation could be seen: for each
    violation the latest event it names, the earliest of those (None if none names one)."""
    if not events or not violations:
        return None
    t0 = events[0]["mono"]
    by_value = {(e["token"], e["value"]): e["mono"] for e in events if e["op"] == "write"}

    def when(item: Any) -> float | None:
        if isinstance(item, dict) and "mono" in item:
            return float(item["mono"])
        if isinstance(item, tuple | list) and len(item) == 2:
            return by_value.get((int(item[0]), int(item[1])))
        return None

    seen = []
    for v in violations:
        times = [t for t in map(when, v.events) if t is not None]
        if times:
            seen.append(max(times))
    return min(seen) - t0 if seen else None
