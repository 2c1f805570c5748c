"""A fork server for the testing room's Python processes (as multiprocessing's forkserver).

A test run starts hundreds of Python processes: the check kit's workers, ``fenced serve``
behind :class:`~fenced.testing.servers.FencedServer`, the tests' own workers. As ``python -m``
each paid a Python start-up and its imports (``fenced serve``: ~0.8 s of CPU, 0.3 s of it
FastAPI). A *zygote* is started once per process that starts them (``python -m
fenced.testing.forkserver``, or forked from that process itself), imports their modules, and
forks each child from that state: still a real OS process of its own, in its own process
group, SIGSTOPped and SIGKILLed as before, with its own stdin, stdout and stderr, environment
and working directory, running the same ``main(argv)`` that ``python -m MODULE`` (or ``python
-c PRELUDE...``) runs.

Fork-safety: the zygote never starts a thread or an event loop (checked before each fork), so
its children fork from a single-threaded process; each child starts its own. Nothing is
configured at import (logging, signal handlers): a child configures what its command does.
The zygote imports with the cyclic collector off and freezes what it made (``gc.freeze``, as
``fenced serve`` does over its own imports), so no child walks those objects again.

The environment a Python start-up reads (``PYTHON*``, ``LD_*``, the locale) must agree with
the zygote's: a zygote serves only spawns that agree with it there (a caller starts another,
or falls back to ``subprocess.Popen``: a real exec).

Protocol (a Unix socket pair, one JSON line a message): the parent sends a spawn request with
the child's stdin, stdout and stderr as SCM_RIGHTS; the zygote answers with the pid once the
child is in its own process group. A child's exit is reported without reaping it (waitid
WNOWAIT), and reaped only when the parent says it has seen it, so the pid stays the child's (a
zombie) for as long as the parent may signal it, as with ``subprocess.Popen``. When the
parent's end of the socket closes (at its exit, or its death: SIGKILL too), the zygote kills
what is left of its children and exits: no orphan.

``FENCED_FORKSERVER=0`` starts every such process with ``subprocess.Popen`` instead (the check
kit's workers also with ``FENCED_CHECK_FORKSERVER=0``).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
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
import types
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, NoReturn

__all__ = [
    "FORKSERVER_ENV",
    "Child",
    "ForkServer",
    "Process",
    "enabled",
    "fork_this_process",
    "forked",
    "popen",
    "server_for",
    "spawn",
    "startup_key",
]

FORKSERVER_ENV = "FENCED_FORKSERVER"

_MAX_MESSAGE = 1 << 20
# The environment a Python start-up reads (a child must not differ from a fresh ``python``
# there): a zygote serves only spawns that agree with it on these.
_STARTUP_ENV = ("PYTHON", "LD_", "LC_", "LANG")


def enabled(opt_out: str = FORKSERVER_ENV) -> bool:
    """Whether spawns go through a zygote: not when ``$FENCED_FORKSERVER`` (or ``opt_out``)
    is ``0``, nor where there is no ``fork``."""
    return (
        hasattr(os, "fork")
        and os.environ.get(FORKSERVER_ENV, "1") != "0"
        and os.environ.get(opt_out, "1") != "0"
    )


def startup_key(env: Mapping[str, str], cwd: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """What a zygote and a spawn it serves must agree on: the working directory and the
    environment a Python start-up reads."""
    return cwd, tuple(sorted((k, v) for k, v in env.items() if k.startswith(_STARTUP_ENV)))


# -- the parent's side ---------------------------------------------------------------------------


class Child:
    """A process forked by a zygote: the subset of :class:`subprocess.Popen` the testing room
    uses (``pid``, ``stdin``, ``stdout``, ``stderr``, ``returncode``, ``poll``, ``wait``,
    ``kill``, ``terminate``, ``send_signal``)."""

    def __init__(
        self,
        zygote: ForkServer,
        pid: int,
        stdin: IO[Any] | None = None,
        stdout: IO[Any] | None = None,
        stderr: IO[Any] | None = None,
    ) -> None:
        self._zygote, self.pid = zygote, pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exited(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._zygote.exited(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout or 0.0)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # (as Popen: not once its exit is seen, when the pid may be another process's)
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Process = Child | subprocess.Popen[bytes]
"""A child process, as the testing room holds it."""


class ForkServer:
    """One zygote and this process's end of its socket."""

    def __init__(self, env: Mapping[str, str] | None, cwd: str, warm: Sequence[str] = ()) -> None:
        """A zygote started with ``python -m`` in ``env`` and ``cwd`` that imports ``warm``
        first; or (``env`` None) this very process forked, which must have no thread
        (:func:`fork_this_process`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0
        if env is None:
            self.pid = os.fork()
            if self.pid == 0:
                ours.close()
                _forked_zygote(theirs.fileno(), warm)  # (never returns)
        else:
            with open(os.devnull, "r+b") as devnull:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(theirs.fileno()), *warm],
                    stdin=devnull,
                    stdout=devnull,  # (not the parent's: a reader of it would wait for it)
                    pass_fds=(theirs.fileno(),),
                    env=dict(env),
                    cwd=cwd,
                    start_new_session=True,  # (a terminal's ^C is the parent's to handle)
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
        self.owner = os.getpid()  # (a forked copy of this process gets no exit reports)
        threading.Thread(target=self._read, name="fenced-forkserver", daemon=True).start()

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
        self,
        module: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        fds: tuple[int, int, int],
        *,
        prelude: str | None = None,
        warm: Sequence[str] = (),
    ) -> int:
        """Fork ``module.main(argv)`` with stdin, stdout and stderr ``fds``; its pid. With
        ``prelude`` (Python source), as ``python -c "PRELUDE; from MODULE import main;
        sys.exit(main(sys.argv[1:]))" *argv``: the prelude runs first, in a fresh ``__main__``.
        The zygote imports ``warm`` and ``module`` first, if it has not yet (another caller's zygote)."""
        request = {"module": module, "argv": list(argv), "env": dict(env), "cwd": cwd}
        request["warm"] = list(warm)
        if prelude is not None:
            request["prelude"] = prelude
        with self.lock:
            with self.changed:
                if self.dead:
                    raise OSError("the fork server is gone")
            data = json.dumps(request).encode() + b"\n"
            socket.send_fds(self.sock, [data], list(fds))
            with self.changed:
                if not self.changed.wait_for(lambda: self.replies or self.dead, 60):
                    raise OSError("the fork server did not answer in 60 s")
                if not self.replies:
                    raise OSError("the fork server is gone")
                reply = self.replies.pop(0)
        if "error" in reply:
            raise OSError(f"the fork server could not start {module}: {reply['error']}")
        pid: int = reply["pid"]
        with self.changed:
            self.children.add(pid)
            self.forked += 1
        return pid

    def exited(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once it has exited (then it is reaped), else None after
        ``timeout`` seconds (None: no limit)."""
        if os.getpid() != self.owner:
            # A forked copy of the process that started it (no reader thread, no reports):
            # as Popen there, which cannot wait for what is not its child, an exit at once.
            return 0
        with self.changed:
            if not self.changed.wait_for(lambda: pid in self.exits, timeout):
                return None
            # (kept: another thread waiting for the same child gets it too, as with Popen)
            code, first = self.exits[pid], pid not in self.reaped
            self.reaped.add(pid)
            self.children.discard(pid)
            dead = self.dead
        if first and not dead:
            with self.lock, contextlib.suppress(OSError):
                self.sock.sendall(json.dumps({"reap": pid}).encode() + b"\n")
        return code

    def close(self) -> None:
        """Close this end (the zygote kills its children and exits) and reap it, so that its
        CPU and its children's is counted as this process's children's."""
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


_zygotes: dict[tuple[str, tuple[tuple[str, str], ...]], ForkServer] = {}
_zygotes_lock = threading.Lock()
_forked_by_closed = 0
_HERE = ("", ())  # (the key of the zygote forked from this process: it serves every spawn)


def fork_this_process(warm: Sequence[str] = ()) -> bool:
    """Fork this process into the zygote later spawns are forked from, if it has no thread
    yet (else False: the first spawn starts one with ``python -m``). The zygote then costs no
    start-up and no import of its own (what this process imported; ``warm`` too)."""
    for name in warm:
        importlib.import_module(name)
    with _zygotes_lock:
        if _HERE in _zygotes:
            return True
        if threading.active_count() != 1:  # (a thread forked into a child is a lock held)
            return False
        # This interpreter's flags (-W error, -X dev, -O...) would be every child's, and a
        # ``python -m`` child has none: such a process forks no zygote of itself.
        if subprocess._args_from_interpreter_flags():  # type: ignore[attr-defined]
            return False
        _zygotes[_HERE] = ForkServer(None, "", warm)  # (its cwd: this process's, whatever it is)
    return True


def server_for(
    env: Mapping[str, str], cwd: str, *, warm: Sequence[str] = (), here: bool = True
) -> ForkServer:
    """The zygote that serves spawns in ``env`` and ``cwd``: this process's own (``here``:
    forked from it, which serves every spawn), or the one for their start-up environment,
    started now in ``env`` and ``cwd`` (importing ``warm``) if there is none."""
    global _forked_by_closed
    key = startup_key(env, cwd)
    with _zygotes_lock:
        zygote = _zygotes.get(key) or (_zygotes.get(_HERE) if here else None)
        if zygote is None or zygote.dead:
            if zygote is not None:
                _forked_by_closed += zygote.forked
            zygote = _zygotes[key] = ForkServer(env, cwd, warm)
    return zygote


def forked() -> int:
    """How many processes this process's zygotes have forked (for the testing room's tests)."""
    with _zygotes_lock:
        return _forked_by_closed + sum(z.forked for z in _zygotes.values())


def _close_all() -> None:
    with _zygotes_lock:
        zygotes = list(_zygotes.values())
        _zygotes.clear()
    for zygote in zygotes:
        zygote.close()


def _forget() -> None:
    """In a child forked from this process (a test's ``os.fork()``, a zygote's child): its
    parent's zygotes are not its own. Its exit must not close them (a shutdown of the shared
    socket would end the parent's servers), nor may it wait on a lock a thread of the parent
    held at the fork."""
    global _zygotes, _zygotes_lock
    _zygotes, _zygotes_lock = {}, threading.Lock()


atexit.register(_close_all)
os.register_at_fork(after_in_child=_forget)


_Stream = int | IO[Any] | None


def popen(
    module: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: _Stream = None,
    stdout: _Stream = None,
    stderr: _Stream = None,
    text: bool = False,
    prelude: str | None = None,
    warm: Sequence[str] = (),
    opt_out: str = FORKSERVER_ENV,
) -> Process:
    """``subprocess.Popen([sys.executable, "-m", module, *argv], ...)`` in a process group of
    its own, forked by this process's zygote for ``env`` and ``cwd`` (started at the first
    spawn, importing ``warm``), or a real exec when not :func:`enabled` (``opt_out``). The
    streams as Popen's: ``subprocess.PIPE``, ``DEVNULL``, ``STDOUT`` (stderr), a file, or None
    (this process's); ``text`` makes the pipes UTF-8 text. ``module`` must have ``main(argv)``.
    With ``prelude``, as ``python -c "PRELUDE; from MODULE import main;
    sys.exit(main(sys.argv[1:]))"`` (``main(argv)`` in both ways); the prelude may read
    ``__parent__``, the pid of the process that starts the child (this one, or the zygote)."""
    env = dict(os.environ if env is None else env)
    try:
        where = os.path.abspath(cwd if cwd is not None else os.getcwd())
    except FileNotFoundError:  # (this process's directory was deleted: a real exec starts in it)
        where = ""
    if not enabled(opt_out) or not where:
        # (a prelude reads ``__parent__``, the pid of the process that started it: this one)
        command = ["-m", module] if prelude is None else [
            "-c",
            f"import sys\n__parent__ = {os.getpid()}\n{prelude}\n"
            f"from {module} import main\nsys.exit(main(sys.argv[1:]))",
        ]  # fmt: skip
        return subprocess.Popen(
            [sys.executable, *command, *argv],
            stdin=stdin, stdout=stdout, stderr=stderr, text=text, env=env, cwd=where or None,
            start_new_session=True,
        )  # fmt: skip
    zygote = server_for(env, where, warm=warm)
    ours: list[int | None] = [None, None, None]  # (this process's ends of the pipes)
    theirs: list[int] = []
    opened: list[int] = []  # (to close here once the child has its copies)
    try:
        for n, stream in enumerate((stdin, stdout, stderr)):
            if stream == subprocess.PIPE:
                r, w = os.pipe()
                ours[n], fd = (w, r) if n == 0 else (r, w)
                opened.append(fd)
            elif stream == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                opened.append(fd)
            elif stream == subprocess.STDOUT and n == 2:
                fd = theirs[1]
            elif stream is None:
                fd = n
            elif isinstance(stream, int):
                fd = stream
            else:
                fd = stream.fileno()
            theirs.append(fd)
        fds = (theirs[0], theirs[1], theirs[2])
        if prelude is not None:  # (its ``__parent__``: the zygote, which forks it)
            prelude = f"__parent__ = {zygote.pid}\n{prelude}"
        pid = zygote.spawn(module, argv, env, where, fds, prelude=prelude, warm=warm)
    except BaseException:
        for one in ours:
            if one is not None:
                os.close(one)
        raise
    finally:
        for one in opened:
            os.close(one)

    def wrap(n: int) -> IO[Any] | None:
        fd = ours[n]
        if fd is None:
            return None
        if text:  # (its stdin line-buffered: a command line reaches the child as it is sent)
            mode, buffering = ("w", 1) if n == 0 else ("r", -1)
            return open(fd, mode, encoding="utf-8", buffering=buffering)
        return open(fd, "wb" if n == 0 else "rb")

    return Child(zygote, pid, wrap(0), wrap(1), wrap(2))


def spawn(
    module: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    stderr: IO[bytes],
    stdin_pipe: bool,
    opt_out: str = FORKSERVER_ENV,
    warm: Sequence[str] = (),
) -> Process:
    """:func:`popen` with its stdout a pipe, its stderr ``stderr``, its stdin a pipe
    (``stdin_pipe``) or /dev/null (the check kit's workers)."""
    return popen(
        module, argv, env=env, stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=stderr, opt_out=opt_out, warm=warm,
    )  # fmt: skip


# -- the zygote's side ---------------------------------------------------------------------------


def _status(info: Any) -> int:
    """A waitid result as a Popen return code (a signal's death: minus its number)."""
    return int(info.si_status) if info.si_code == os.CLD_EXITED else -int(info.si_status)


def _import_frozen(names: Sequence[str]) -> None:
    """Import ``names`` (if any) with the cyclic collector off, then freeze what is there: the objects
    every child inherits stay out of its collections (and its pages shared)."""
    if not names:
        return
    gc.disable()
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        gc.freeze()
        gc.enable()


def _serve(fd: int, warm: Sequence[str]) -> Callable[[], int] | None:
    """Serve spawn requests on socket ``fd`` until it closes (then None); in a forked child,
    the child's job instead."""
    _import_frozen(warm)
    if threading.active_count() != 1:  # (a thread forked into a child would be a lock held)
        raise RuntimeError("the fork server has a thread before it forks")
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
            if not data:  # the parent is gone: so are its children
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
                # The child's module is imported here, before the fork, once for all its
                # children; nothing it imports may start a thread (it would be a lock held
                # forever in the child).
                try:
                    wanted = [*request.get("warm", ()), request["module"]]
                    _import_frozen([m for m in wanted if m not in sys.modules])
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
    for fd in set(fds):  # (one fd may be passed for two streams: stdout and stderr)
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # Where ``python`` in that environment would look first (a zygote forked from a parent
    # process has that process's path): its directory, then PYTHONPATH.
    first = [request["cwd"], *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:0] = [p for p in dict.fromkeys(first) if p not in sys.path]
    module = importlib.import_module(request["module"])
    argv: list[str] = request["argv"]
    prelude: str | None = request.get("prelude")
    sys.argv = ["-c" if prelude is not None else module.__file__ or request["module"], *argv]

    def job() -> int:
        try:
            if prelude is not None:  # as ``python -c``: run in a fresh __main__, first
                main = types.ModuleType("__main__")
                main.__dict__["__builtins__"] = builtins
                sys.modules["__main__"] = main
                exec(compile(f"import sys\n{prelude}\n", "<string>", "exec"), main.__dict__)
            code = module.main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            with contextlib.suppress(Exception):  # (a full disk under its log: still 1)
                traceback.print_exc()
            return 1
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1

    return job


def _forked_zygote(fd: int, warm: Sequence[str]) -> NoReturn:
    """The zygote forked from a parent process: as a ``python -m`` zygote, but it leaves by
    ``os._exit``, never through the parent's own frames and exit handlers."""
    code = 1  # (until the zygote, or its child's job, says otherwise)
    try:
        os.setsid()  # (a terminal's ^C is the parent's to handle)
        with open(os.devnull, "r+b") as devnull:
            for target in (0, 1):
                os.dup2(devnull.fileno(), target)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH):
            signal.signal(sig, signal.SIG_DFL)  # (a fresh interpreter's, not the command's)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        job = _serve(fd, warm)
        code = 0 if job is None else job()  # (a job: a child, forked from here)
    except BaseException:
        with contextlib.suppress(Exception):  # (its stderr may be a full disk's file)
            traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _main() -> None:
    job = _serve(int(sys.argv[1]), sys.argv[2:])
    if job is not None:  # (in a forked child: exit as a ``python -m`` child would)
        code = job()
        sys.stdout.flush()
        sys.exit(code)


if __name__ == "__main__":
    _main()
