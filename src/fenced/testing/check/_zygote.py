"""A fork server for the check kit's worker processes (as multiprocessing's forkserver).

A campaign starts dozens of workers (hundreds with the ``kill`` nemesis): as ``python -m``
each paid a Python start-up and ``import fenced`` (~0.15 s of CPU of its ~0.25 s). The zygote
is started once per process that runs campaigns (``python -m fenced.testing.check._zygote``),
imports the workers' modules, and forks each worker from that state: still a real OS process
of its own, in its own process group, SIGSTOPped and SIGKILLed as before, with its own stdin
pipe, stdout pipe and log, environment and working directory.

Fork-safety: the zygote never starts a thread or an event loop (checked before serving), so
its children fork from a single-threaded process; each child starts its own.

Protocol (a Unix socket pair, one JSON line a message): the campaign sends a spawn request
with the child's stdin, stdout and stderr as SCM_RIGHTS; the zygote answers with the pid once
the child is in its own process group. A child's exit is reported without reaping it (waitid
WNOWAIT), and reaped only when the campaign says it has seen it, so the pid stays the child's
(a zombie) for as long as the campaign may signal it, as with ``subprocess.Popen``. When the
campaign's end of the socket closes, the zygote kills what is left of its children and exits.

``FENCED_CHECK_FORKSERVER=0`` starts workers with ``subprocess.Popen`` instead.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, NoReturn

FORKSERVER_ENV = "FENCED_CHECK_FORKSERVER"

WARM = ("fenced.backends.sqlite", "fenced.guards.registry", "fenced.guards.sql")
"""Imported by the zygote at its start, besides each worker's module: what a worker of the
default campaign (SQLite source and register) imports only once it runs (~60 ms of CPU each)."""

_MAX_MESSAGE = 1 << 20
# The environment a Python start-up reads (a child must not differ from a fresh ``python -m``
# there): a zygote serves only spawns that agree with it on these.
_STARTUP_ENV = ("PYTHON", "LD_")


# -- the campaign's side -------------------------------------------------------------------------


class Child:
    """A worker forked by the zygote: the subset of :class:`subprocess.Popen` the campaigns
    use (``pid``, ``stdin``, ``stdout``, ``returncode``, ``poll``, ``wait``, ``kill``)."""

    def __init__(
        self, zygote: _Zygote, pid: int, stdin: IO[bytes] | None, stdout: IO[bytes] | None
    ) -> None:
        self._zygote, self.pid, self.stdin, self.stdout = zygote, pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exited(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._zygote.exited(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            self.returncode = code
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


Worker = Child | subprocess.Popen[bytes]
"""A worker process, as the campaigns hold it."""


class _Zygote:
    def __init__(self, env: Mapping[str, str] | None, cwd: str) -> None:
        """A zygote started with ``python -m`` in ``env`` and ``cwd``; or (``env`` None) this
        very process forked, which must have no thread (:func:`start_fork_server`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0
        if env is None:
            self.pid = os.fork()
            if self.pid == 0:
                ours.close()
                _forked_zygote(theirs.fileno())  # (never returns)
        else:
            with open(os.devnull, "r+b") as devnull:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(theirs.fileno())],
                    stdin=devnull,
                    stdout=devnull,  # (not the campaign's: a reader of it would wait for it)
                    pass_fds=(theirs.fileno(),),
                    env=dict(env),
                    cwd=cwd,
                    start_new_session=True,  # (a terminal's ^C is the campaign's to handle)
                )
            self.pid = self.proc.pid
        theirs.close()
        self.sock = ours
        self.reader = ours.makefile("rb")
        self.lock = threading.Lock()  # one request at a time
        self.changed = threading.Condition()
        self.replies: list[dict[str, Any]] = []
        self.exits: dict[int, int] = {}
        self.children: set[int] = set()
        self.reaped: set[int] = set()
        self.dead = False
        self.forked = 0
        threading.Thread(target=self._read, name="fenced-check-zygote", daemon=True).start()

    def _read(self) -> None:
        for line in self.reader:
            message = json.loads(line)
            with self.changed:
                if "exit" in message:
                    self.exits[message["exit"]] = message["status"]
                else:
                    self.replies.append(message)
                self.changed.notify_all()
        with self.changed:  # the zygote is gone: its children were killed with it
            self.dead = True
            for pid in self.children - set(self.exits):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                self.exits[pid] = -signal.SIGKILL
            self.changed.notify_all()

    def spawn(
        self, module: str, argv: Sequence[str], env: Mapping[str, str], cwd: str,
        fds: tuple[int, int, int],
    ) -> int:  # fmt: skip
        request = {"module": module, "argv": list(argv), "env": dict(env), "cwd": cwd}
        with self.lock:
            with self.changed:
                if self.dead:
                    raise OSError("the check kit's fork server is gone")
            data = json.dumps(request).encode() + b"\n"
            socket.send_fds(self.sock, [data], list(fds))
            with self.changed:
                if not self.changed.wait_for(lambda: self.replies or self.dead, 60):
                    raise OSError("the check kit's fork server did not answer in 60 s")
                if not self.replies:
                    raise OSError("the check kit's fork server is gone")
                reply = self.replies.pop(0)
        if "error" in reply:
            raise OSError(f"the check kit's fork server could not start a worker: {reply['error']}")
        pid: int = reply["pid"]
        with self.changed:
            self.children.add(pid)
            self.forked += 1
        return pid

    def exited(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once it has exited (then it is reaped), else None after
        ``timeout`` seconds (None: no limit)."""
        with self.changed:
            if not self.changed.wait_for(lambda: pid in self.exits, timeout):
                return None
            # (kept: another thread waiting for the same worker gets it too, as with Popen)
            code, first = self.exits[pid], pid not in self.reaped
            self.reaped.add(pid)
            self.children.discard(pid)
            dead = self.dead
        if first and not dead:
            with self.lock, contextlib.suppress(OSError):
                self.sock.sendall(json.dumps({"reap": pid}).encode() + b"\n")
        return code

    def close(self) -> None:
        """Close the campaign's end (the zygote kills its children and exits) and reap it, so
        that its CPU and its children's is counted as this process's children's."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            return
        deadline = time.monotonic() + 10
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() >= deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                return
            time.sleep(0.01)  # (its children's deaths first: at most 10 s, once a process)


_zygotes: dict[tuple[str, tuple[tuple[str, str], ...]], _Zygote] = {}
_zygotes_lock = threading.Lock()
_forked_by_closed = 0


def _startup_key(env: Mapping[str, str], cwd: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return cwd, tuple(sorted((k, v) for k, v in env.items() if k.startswith(_STARTUP_ENV)))


_HERE = ("", ())  # (the key of the zygote forked from this process: it serves every spawn)


def start_fork_server() -> bool:
    """Fork this process into the zygote its campaigns' workers will be forked from, if it has
    no thread yet (else False: the first spawn starts one with ``python -m``). Called first
    thing by ``fenced check``: the zygote then costs no start-up and no import of its own (the
    command has imported fenced; the worker's modules are imported here, once for both)."""
    if os.environ.get(FORKSERVER_ENV, "1") == "0" or not hasattr(os, "fork"):
        return False
    if os.environ.get("FENCED_CHECK_NETNS"):  # (its workers start in namespaces: ip netns exec)
        return False
    for name in ("fenced.testing.check._worker", *WARM):
        importlib.import_module(name)
    with _zygotes_lock:
        if _HERE in _zygotes:
            return True
        if threading.active_count() != 1:  # (a thread forked into a child is a lock held)
            return False
        _zygotes[_HERE] = _Zygote(None, os.getcwd())
    return True


def forked() -> int:
    """How many workers this process's zygotes have forked (for the kit's own tests)."""
    with _zygotes_lock:
        return _forked_by_closed + sum(z.forked for z in _zygotes.values())


def _close_all() -> None:
    with _zygotes_lock:
        zygotes = list(_zygotes.values())
        _zygotes.clear()
    for zygote in zygotes:
        zygote.close()


atexit.register(_close_all)


def spawn(
    module: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    stderr: IO[bytes],
    stdin_pipe: bool,
) -> Worker:
    """Start worker ``python -m module *argv`` in a process group of its own: its stdout a
    pipe, its stderr ``stderr``, its stdin a pipe (``stdin_pipe``) or /dev/null; forked by this
    process's zygote (started at the first spawn), or by ``subprocess.Popen`` when
    ``FENCED_CHECK_FORKSERVER=0`` (or the platform has no fork)."""
    if os.environ.get(FORKSERVER_ENV, "1") == "0" or not hasattr(os, "fork"):
        return subprocess.Popen(
            [sys.executable, "-m", module, *argv],
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=dict(env),
            start_new_session=True,
        )
    cwd = os.getcwd()
    key = _startup_key(env, cwd)
    with _zygotes_lock:
        zygote = _zygotes.get(key) or _zygotes.get(_HERE)
        if zygote is None or zygote.dead:
            if zygote is not None:
                global _forked_by_closed
                _forked_by_closed += zygote.forked
            zygote = _zygotes[key] = _Zygote(env, cwd)
    out_r, out_w = os.pipe()
    if stdin_pipe:
        in_r, in_w = os.pipe()
    else:
        in_r, in_w = os.open(os.devnull, os.O_RDONLY), -1
    try:
        pid = zygote.spawn(module, argv, env, cwd, (in_r, out_w, stderr.fileno()))
    except BaseException:
        for fd in (out_r, in_w):
            if fd >= 0:
                os.close(fd)
        raise
    finally:
        os.close(in_r)
        os.close(out_w)
    stdin = open(in_w, "wb") if stdin_pipe else None  # noqa: SIM115 (the Child owns it)
    return Child(zygote, pid, stdin, open(out_r, "rb"))


# -- the zygote's side ---------------------------------------------------------------------------


def _status(info: Any) -> int:
    """A waitid result as a Popen return code (a signal's death: minus its number)."""
    return int(info.si_status) if info.si_code == os.CLD_EXITED else -int(info.si_status)


def _serve(fd: int) -> Callable[[], int] | None:
    """Serve spawn requests on socket ``fd`` until it closes (then None); in a forked child,
    the child's job instead."""
    for name in WARM:
        importlib.import_module(name)
    if threading.active_count() != 1:  # (a thread forked into a child would be a lock held)
        raise RuntimeError("the check kit's fork server has a thread before it forks")
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (the wake-up byte is the point)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, "sock")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    live: set[int] = set()  # forked, exit not yet reported
    zombies: set[int] = set()  # exit reported, not yet reaped
    buffer, passed = b"", []  # (a request's fds come with its first bytes)

    def send(message: dict[str, Any]) -> None:
        sock.sendall(json.dumps(message).encode() + b"\n")

    def report_exits() -> None:
        for pid in sorted(live):
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                live.discard(pid)
                zombies.add(pid)
                send({"exit": pid, "status": _status(info)})

    while True:
        for key, _ in sel.select():
            if key.data == "wake":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                report_exits()
                continue
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 3)
            passed += fds
            if not data:  # the campaign is gone: so are its workers
                for pid in live | zombies:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                for pid in live | zombies:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, 0)
                return None
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                if "reap" in request:
                    if request["reap"] in zombies:
                        zombies.discard(request["reap"])
                        os.waitpid(request["reap"], 0)
                    continue
                fds, passed = passed[:3], passed[3:]
                # The worker's module is imported here, before the fork, once for all its
                # workers; nothing it imports may start a thread (it would be a lock held
                # forever in the child).
                try:
                    importlib.import_module(request["module"])
                    if threading.active_count() != 1:
                        raise RuntimeError(f"importing {request['module']} started a thread")
                except Exception as exc:
                    send({"error": f"{type(exc).__name__}: {exc}"})
                    for one in fds:
                        os.close(one)
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    sock.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for one in (wake_r, wake_w):
                        os.close(one)
                    return _child(request, fds)
                with contextlib.suppress(PermissionError):  # (the child may be there first)
                    os.setpgid(pid, pid)
                for one in fds:
                    os.close(one)
                live.add(pid)
                send({"pid": pid})
            report_exits()  # (a SIGCHLD may have come while this one was handled)


def _child(request: dict[str, Any], fds: list[int]) -> Callable[[], int]:
    os.setpgid(0, 0)  # its own process group, as start_new_session gave it
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # Where ``python -m`` in that environment would look first (a zygote forked from a
    # campaign's process has that process's path): its directory, then PYTHONPATH.
    first = [request["cwd"], *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:0] = [p for p in dict.fromkeys(first) if p not in sys.path]
    module = importlib.import_module(request["module"])
    argv: list[str] = request["argv"]
    sys.argv = [module.__file__ or request["module"], *argv]

    def job() -> int:
        try:
            code = module.main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            return 1
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1

    return job


def _forked_zygote(fd: int) -> NoReturn:
    """The zygote forked from a campaign's process: as a ``python -m`` zygote, but it leaves
    by ``os._exit``, never through the campaign's own frames and exit handlers."""
    code = 0
    try:
        os.setsid()  # (a terminal's ^C is the campaign's to handle)
        with open(os.devnull, "r+b") as devnull:
            for target in (0, 1):
                os.dup2(devnull.fileno(), target)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH):
            signal.signal(sig, signal.SIG_DFL)  # (a fresh interpreter's, not the command's)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        job = _serve(fd)
        if job is not None:  # (a worker, forked from here)
            code = job()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _main() -> None:
    job = _serve(int(sys.argv[1]))
    if job is not None:  # (in a forked child: exit as a ``python -m`` worker would)
        code = job()
        sys.stdout.flush()
        sys.exit(code)


if __name__ == "__main__":
    _main()
