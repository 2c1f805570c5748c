"""Real network partitions for tests: Linux network namespaces made by the test itself.

A :class:`NetLab` is a private little network. Every node (a cluster member, a client, a
resource server) gets its own namespace with one veth link to a bridge in the lab's *hub*
namespace, and one address ``10.77.0.N/24`` that exists only inside the lab: nothing is
added to the machine's own namespace, so labs of concurrent tests cannot collide.

Faults are made with iproute2 alone (no iptables or nftables needed):

* :meth:`NetLab.partition` puts ``blackhole`` routes to the other side's addresses in each
  node's namespace, both ways: packets are dropped silently, open TCP connections stay open
  and go quiet — what a real partition looks like to a client, unlike a refused connection;
* :meth:`NetLab.link_down` / :meth:`NetLab.link_up` take a node's link down at the bridge
  (its namespace sees its carrier go), for flapping links;
* pausing a member is ``SIGSTOP`` to its real process (:meth:`NetProcess.pause`).

Namespaces are named ``fenced-<pid>-<start>-<lab>-<node>`` after the owning process (pid and
its start time, so a reused pid does not count as alive). :func:`reap_stale` deletes the
namespaces, and kills the processes in them, of owners that are gone — a test killed with
``kill -9`` leaves its lab behind only until the next lab starts. Everything needs root (or
CAP_NET_ADMIN and CAP_SYS_ADMIN) and ``ip`` from iproute2; :func:`unavailable` says why a
machine cannot run labs, for a clean skip.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, TypeVar

from fenced._core.errors import ConfigurationError

__all__ = [
    "Fault",
    "NetLab",
    "NetProcess",
    "Node",
    "reap_stale",
    "unavailable",
]

PREFIX: Final = "fenced-"
SUBNET: Final = "10.77.0"
_CLONE_NEWNET: Final = 0x40000000
_IP_TIMEOUT: Final = 10.0
_MAX_NODES: Final = 200
_T = TypeVar("_T")
_NAME = re.compile(r"^fenced-(\d+)-(\d+)-")


def _ip_binary() -> str | None:
    return shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip", "/bin/ip") if os.path.exists(p)), None
    )


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = _ip_binary()
    if binary is None:
        raise RuntimeError("ip not found: install the Debian package 'iproute2'")
    done = subprocess.run(
        [binary, *args], capture_output=True, text=True, timeout=_IP_TIMEOUT, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return int(fields[19])  # field 22 of stat; fields here start at field 3


def unavailable() -> str | None:
    """Why this machine cannot run a lab (a reason to skip), or None if it can."""
    if not os.path.exists("/proc/self/ns/net"):
        return "no network namespaces in this kernel (/proc/self/ns/net missing)"
    if _ip_binary() is None:
        return "ip not found: install the Debian package 'iproute2'"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    probe = f"{PREFIX}{os.getpid()}-0-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    try:
        veth = _ip(
            "-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb", check=False
        )
        if veth.returncode != 0:
            return f"cannot make a veth pair: {veth.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL every process in namespace ``ns`` (the lab's own servers and clients)."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def reap_stale() -> list[str]:
    """Delete the namespaces of labs whose owner process is gone; return their names."""
    reaped = []
    for ns in _namespaces():
        m = _NAME.match(ns)
        if m is None:
            continue
        pid, ticks = int(m.group(1)), int(m.group(2))
        if ticks != 0 and _start_ticks(pid) == ticks:
            continue  # its owner is alive: not ours to touch
        if ticks == 0 and _start_ticks(pid) is not None:
            continue  # a probe of a live process
        _kill_inside(ns)
        _ip("netns", "del", ns, check=False)
        reaped.append(ns)
    return reaped


def _setns(ns: str) -> None:
    """Move the calling *thread* into namespace ``ns`` (network namespaces are per thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class Node:
    """One namespace of a lab: ``name`` inside the lab, ``ns`` for ``ip netns``."""

    name: str
    ns: str
    addr: str
    link: str  # the hub's end of its veth pair


@dataclass
class Fault:
    """One fault, for the history and the report's timeline (times on time.monotonic)."""

    kind: str  # isolate, split, flap, pause
    detail: str
    start: float
    end: float | None = None
    sides: list[list[str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "detail": self.detail,
            "start": self.start,
            "end": self.end,
            "sides": self.sides,
        }


class NetProcess:
    """A process running in a node's namespace (``ip netns exec`` execs it: same pid)."""

    def __init__(self, node: Node, proc: subprocess.Popen[bytes], log: Path | None) -> None:
        self.node = node
        self.proc = proc
        self.log = log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pause(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def log_tail(self, lines: int = 30) -> str:
        if self.log is None:
            return ""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class NetLab:
    """A private network of namespaces around one bridge; ``with NetLab("t") as lab:``."""

    def __init__(self, name: str = "lab") -> None:
        if not re.fullmatch(r"[a-z0-9]{1,12}", name):
            raise ConfigurationError(f"lab name {name!r}: 1-12 lower-case letters or digits")
        reap_stale()
        ticks = _start_ticks(os.getpid())
        assert ticks is not None
        self._base = f"{PREFIX}{os.getpid()}-{ticks}-{name}"
        self.hub = f"{self._base}-hub"
        self.nodes: dict[str, Node] = {}
        self.processes: list[NetProcess] = []
        self.faults: list[Fault] = []
        self._blackholes: set[tuple[str, str]] = set()  # (from node, to addr)
        self._down: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        _ip("netns", "add", self.hub)
        try:
            _ip("-n", self.hub, "link", "set", "lo", "up")
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    # -- topology ------------------------------------------------------------------------

    def add(self, name: str) -> Node:
        """A new node on the bridge, with the next address; its loopback is up too."""
        if not re.fullmatch(r"[a-z0-9]{1,10}", name) or name in self.nodes or name == "hub":
            raise ConfigurationError(f"node name {name!r}: new, 1-10 lower-case letters or digits")
        n = len(self.nodes) + 1
        if n > _MAX_NODES:
            raise ConfigurationError(f"a lab holds at most {_MAX_NODES} nodes")
        node = Node(name, f"{self._base}-{name}", f"{SUBNET}.{n}", f"v{n}")
        _ip("netns", "add", node.ns)
        self.nodes[name] = node
        # Made inside the hub, the peer moved straight into the node: never in the host's
        # namespace, so interface names cannot clash with anything outside the lab.
        _ip("-n", self.hub, "link", "add", node.link, "type", "veth", "peer", "name", "eth0",
            "netns", node.ns)  # fmt: skip
        _ip("-n", self.hub, "link", "set", node.link, "master", "br0")
        _ip("-n", self.hub, "link", "set", node.link, "up")
        _ip("-n", node.ns, "link", "set", "lo", "up")
        # The local table is looked up first (rule 0) and would accept packets for the
        # node's own address before any fault rule: move it after them.
        _ip("-n", node.ns, "rule", "add", "pref", "100", "lookup", "local")
        _ip("-n", node.ns, "rule", "del", "pref", "0", "lookup", "local")
        _ip("-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", "eth0")
        _ip("-n", node.ns, "link", "set", "eth0", "up")
        return node

    def node(self, name: str) -> Node:
        return self.nodes[name]

    # -- processes -----------------------------------------------------------------------

    def run(
        self,
        node: str | Node,
        argv: Sequence[str],
        *,
        log: Path | None = None,
        env: dict[str, str] | None = None,
        stdout: int | IO[Any] | None = None,
        stdin: int | IO[Any] | None = subprocess.DEVNULL,
    ) -> NetProcess:
        """Start ``argv`` inside ``node``'s namespace, in its own process group."""
        n = node if isinstance(node, Node) else self.nodes[node]
        binary = _ip_binary()
        assert binary is not None
        out: Any = stdout
        fh = None
        if log is not None:
            fh = open(log, "ab")  # noqa: SIM115 - owned by the child
            out = fh
        try:
            proc = subprocess.Popen(
                [binary, "netns", "exec", n.ns, *argv],
                stdout=out,
                stderr=subprocess.STDOUT if log is not None else None,
                stdin=stdin,
                env=env,
                start_new_session=True,
            )
        finally:
            if fh is not None:
                fh.close()
        p = NetProcess(n, proc, log)
        self.processes.append(p)
        return p

    def call(self, node: str | Node, fn: Callable[[], _T], timeout: float = 10.0) -> _T:
        """Run ``fn`` in a thread inside ``node``'s namespace (its sockets are made there)."""
        n = node if isinstance(node, Node) else self.nodes[node]
        box: dict[str, Any] = {}

        def inside() -> None:
            try:
                _setns(n.ns)
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc

        t = threading.Thread(target=inside, name=f"netns:{n.name}", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"call in {n.name} took more than {timeout:g} s")
        if "error" in box:
            raise box["error"]
        value: _T = box["value"]
        return value

    # -- faults --------------------------------------------------------------------------

    def _route(self, op: str, frm: Node, to: Node) -> None:
        key = (frm.name, to.addr)
        if (op == "add") == (key in self._blackholes):
            return
        # Dropped on the way *in* (a policy rule on what arrives from ``to``): the sender's
        # packets leave and vanish, so its connections go silent. A blackhole *route* would
        # fail the sender's own sends at once (EINVAL), which no real partition does.
        _ip("-n", frm.ns, "rule", op, "pref", "10", "from", f"{to.addr}/32", "iif", "eth0",
            "blackhole")  # fmt: skip
        if op == "add":
            self._blackholes.add(key)
        else:
            self._blackholes.discard(key)

    def partition(self, *sides: Iterable[str], kind: str = "split", detail: str = "") -> Fault:
        """Cut every pair of nodes on different sides, both ways (nodes not named keep
        reaching everyone). Heal with :meth:`heal`."""
        groups = [sorted(set(s)) for s in sides]
        with self._lock:
            for i, a in enumerate(groups):
                for b in groups[i + 1 :]:
                    for x in a:
                        for y in b:
                            self._route("add", self.nodes[x], self.nodes[y])
                            self._route("add", self.nodes[y], self.nodes[x])
            fault = Fault(kind, detail or " | ".join(",".join(g) for g in groups),
                          time.monotonic(), sides=groups)  # fmt: skip
            self.faults.append(fault)
            return fault

    def cut(self, a: str, b: str) -> bool:
        """Whether traffic between ``a`` and ``b`` is cut now (either way)."""
        na, nb = self.nodes[a], self.nodes[b]
        return (a, nb.addr) in self._blackholes or (b, na.addr) in self._blackholes

    def heal(self) -> None:
        """Remove every blackhole route and bring every link back up."""
        with self._lock:
            for frm, addr in sorted(self._blackholes):
                with contextlib.suppress(RuntimeError):
                    _ip("-n", self.nodes[frm].ns, "rule", "del", "pref", "10", "from", f"{addr}/32", "iif",
                        "eth0", "blackhole")  # fmt: skip
            self._blackholes.clear()
            for name in sorted(self._down):
                _ip("-n", self.hub, "link", "set", self.nodes[name].link, "up")
            self._down.clear()
            now = time.monotonic()
            for f in self.faults:
                if f.end is None and f.kind != "pause":
                    f.end = now

    def link_down(self, name: str) -> None:
        with self._lock:
            _ip("-n", self.hub, "link", "set", self.nodes[name].link, "down")
            self._down.add(name)

    def link_up(self, name: str) -> None:
        with self._lock:
            _ip("-n", self.hub, "link", "set", self.nodes[name].link, "up")
            self._down.discard(name)

    def flap(
        self, name: str, *, times: int, down: float, up: float, stop: threading.Event | None = None
    ) -> Fault:
        """Take ``name``'s link down for ``down`` s and up for ``up`` s, ``times`` times
        (bounded: at most ``times`` rounds, stopped early by ``stop``). Blocks until done."""
        if times < 1 or times > 1000 or down <= 0 or up < 0:
            raise ConfigurationError("flap: 1..1000 times, down > 0, up >= 0")
        fault = Fault("flap", f"{name} x{times} ({down:g}s down/{up:g}s up)", time.monotonic(),
                      sides=[[name]])  # fmt: skip
        self.faults.append(fault)
        stop = stop or threading.Event()
        try:
            for _ in range(times):
                self.link_down(name)
                if stop.wait(down):
                    break
                self.link_up(name)
                if stop.wait(up):
                    break
        finally:
            self.link_up(name)
            fault.end = time.monotonic()
        return fault

    def pause(self, proc: NetProcess, seconds: float, stop: threading.Event | None = None) -> Fault:
        """SIGSTOP ``proc`` for ``seconds`` (or until ``stop``), then SIGCONT. Blocks."""
        fault = Fault("pause", f"{proc.node.name} SIGSTOP {seconds:g}s", time.monotonic(),
                      sides=[[proc.node.name]])  # fmt: skip
        self.faults.append(fault)
        proc.pause()
        try:
            (stop or threading.Event()).wait(seconds)
        finally:
            proc.resume()
            fault.end = time.monotonic()
        return fault

    def end_faults(self) -> None:
        now = time.monotonic()
        for f in self.faults:
            if f.end is None:
                f.end = now

    # -- teardown ------------------------------------------------------------------------

    def close(self) -> None:
        """Kill the lab's processes and delete its namespaces (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        for p in self.processes:
            p.resume()
            p.kill()
        for node in list(self.nodes.values()):
            _kill_inside(node.ns)
            _ip("netns", "del", node.ns, check=False)
        _ip("netns", "del", self.hub, check=False)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
