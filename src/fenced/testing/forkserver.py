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
its children fork from a single-threaded process; each child starts its own. A module that
starts a thread when imported retires the zygote it was imported in (the next spawn starts
another), and that module's spawns are real execs (``subprocess.Popen``) from then on. Nothing
is configured at import (logging, signal handlers): a child configures what its command does.
The zygote imports with the cyclic collector off and freezes what it made (``gc.freeze``, as
``fenced serve`` does over its own imports), so no child walks those objects again.

The environment a Python start-up reads (``PYTHON*``, ``LD_*``, the locale) must agree with
the zygote's: a zygote serves only spawns that agree with it there (a caller starts another,
or falls back to ``subprocess.Popen``: a real exec). A ``python -m`` zygote is started with
those variables alone, never with a spawn's whole environment: a child's ``os.environ`` is its
own, but ``/proc/PID/environ`` (``ps e``) shows its zygote's start-up environment, and
``/proc/PID/cmdline`` its zygote's command line (``python -m fenced.testing.forkserver``, or the
command that forked it), never another spawn's variables or arguments. A child has only its
stdin, stdout and stderr of the descriptors (as ``close_fds``); ``tempfile`` looks for its
directory again (``TMPDIR``). One zygote serves every working directory: it has no directory on
its path (as ``python -P``) but while it imports a spawn's modules (that spawn's directory
first, as the child's path has it); a module it has from elsewhere than the child's path finds
it (another directory's of the same name) is imported by the child itself, as ``python -m``
there would. What no fork can give: every child of a zygote has that zygote's hash seed
(``PYTHONHASHSEED`` unset: one random seed for all, not one each). A child killed by SIGINT
(an uncaught KeyboardInterrupt) dies of SIGINT, as Python does.

Protocol (a Unix socket pair, one JSON line a message): the parent sends a spawn request with
an id and the child's stdin, stdout and stderr as SCM_RIGHTS; the zygote answers with that id
and the pid once the child is in its own process group. An answer to a request the parent gave
up on (none in 60 s) is never taken for another's: that child is killed. A child's exit is
reported without reaping it (waitid WNOWAIT), and reaped only when the parent says it has seen
it, so the pid stays the child's (a zombie) for as long as the parent may signal it, as with
``subprocess.Popen``. When the parent's end of the socket closes (at its exit, or its death:
SIGKILL too), or the parent dies while a process it forked still holds that end, the zygote
kills what is left of its children and exits: no orphan. (A process forked from the parent
closes its copies of the parent's ends at once.)

``FENCED_FORKSERVER=0`` starts every such process with ``subprocess.Popen`` instead (the check
kit's workers also with ``FENCED_CHECK_FORKSERVER=0``).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
import importlib
import importlib.machinery
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
    "Unfit",
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
# there): a zygote serves only spawns that agree with it on these, and is started with these
# alone.
_STARTUP_ENV = ("PYTHON", "LD_", "LC_", "LANG")

_Key = tuple[str, tuple[tuple[str, str], ...]]


class Unfit(OSError):
    """This zygote cannot fork that spawn (a module it imported started a thread): start it
    with a real exec instead. ``started``: the thread started importing this spawn's modules."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message)
        self.started = started


def enabled(opt_out: str = FORKSERVER_ENV) -> bool:
    """Whether spawns go through a zygote: not when ``$FENCED_FORKSERVER`` (or ``opt_out``)
    is ``0``, nor where there is no ``fork``."""
    return (
        hasattr(os, "fork")
        and os.environ.get(FORKSERVER_ENV, "1") != "0"
        and os.environ.get(opt_out, "1") != "0"
    )


def _startup_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_ENV)}


def startup_key(env: Mapping[str, str], cwd: str) -> _Key:
    """What a zygote and a spawn it serves must agree on: the environment a Python start-up
    reads (``PYTHONPATH`` as the path it makes: an entry twice is once), and the working
    directory only where ``PYTHONPATH`` has a relative entry (else one zygote serves every
    directory)."""
    startup = _startup_env(env)
    entries = startup.get("PYTHONPATH", "").split(os.pathsep) if "PYTHONPATH" in startup else []
    if entries:
        startup["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(entries))
    relative = any(not os.path.isabs(entry) for entry in entries)
    return (cwd if relative else ""), tuple(sorted(startup.items()))


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

    answer_timeout = 60.0
    """How long :meth:`spawn` waits for the zygote's answer (its imports included)."""

    def __init__(self, env: Mapping[str, str] | None, cwd: str, warm: Sequence[str] = ()) -> None:
        """A zygote started with ``python -m`` that imports ``warm`` first, with the start-up
        variables of ``env`` alone, in ``cwd`` (or ``/`` when empty: a zygote has no directory on
        its path); or (``env`` None) this very process forked, which must have no thread
        (:func:`fork_this_process`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0
        # What it agrees with: the start-up environment it was started with (this process's).
        self.key = startup_key(os.environ if env is None else env, cwd)
        if env is None:
            self.pid = os.fork()
            if self.pid == 0:
                ours.close()
                _forked_zygote(theirs.fileno(), warm)  # (never returns)
        else:
            with open(os.devnull, "r+b") as devnull:
                # (``warm`` is imported at its first spawn, with that spawn's path: a module in
                # its directory, as the child's path would find it)
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(theirs.fileno())],
                    stdin=devnull,
                    stdout=devnull,  # (not the parent's: a reader of it would wait for it)
                    pass_fds=(theirs.fileno(),),
                    # (what a Python start-up reads, which a spawn must agree on anyway: not a
                    # spawn's variables, which /proc/PID/environ shows each of its children)
                    env=_startup_env(env),
                    cwd=cwd or "/",
                    start_new_session=True,  # (a terminal's ^C is the parent's to handle)
                )
            self.pid = self.proc.pid
        theirs.close()
        self.sock = ours
        self.reader = ours.makefile("rb")
        self.lock = threading.Lock()  # one message written at a time
        self.changed = threading.Condition()
        self.replies: dict[int, dict[str, Any]] = {}
        self.asked = 0  # (the last request's id)
        self.given_up: set[int] = set()  # requests whose answer no one waits for any more
        self.exits: dict[int, int] = {}
        self.children: set[int] = set()
        self.reaped: set[int] = set()
        self.dead = False
        self.retired = False  # (it has a thread: it forks no more; its children live on)
        self.forked = 0
        self.warm = list(warm)
        self.owner = os.getpid()  # (a forked copy of this process gets no exit reports)
        threading.Thread(target=self._read, name="fenced-forkserver", daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):  # (a reset: the zygote died with a request unread)
            for line in self.reader:
                self._handle(json.loads(line))
        with self.changed:  # the zygote is gone: its children were killed with it
            self.dead = True
            for pid in self.children - set(self.exits):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                self.exits[pid] = -signal.SIGKILL
            self.changed.notify_all()

    def _handle(self, message: dict[str, Any]) -> None:
        """One message of the zygote's: an exit, or an answer to a request."""
        reap = None
        with self.changed:
            if "exit" in message:
                self.exits[message["exit"]] = message["status"]
                if message["exit"] in self.reaped:  # (a given-up request's child)
                    reap = message["exit"]
            elif "pid" in message and message["id"] not in self.given_up:
                # (a pid used again: what was known of it was another process's)
                self.exits.pop(message["pid"], None)
                self.reaped.discard(message["pid"])
                self.replies[message["id"]] = message
            elif "pid" in message:
                # No one waits for this answer (its request timed out): its child is no
                # one's. Killed, then reaped: never taken for another request's.
                self.given_up.discard(message["id"])
                self.exits.pop(message["pid"], None)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(message["pid"], signal.SIGKILL)
                self.reaped.add(message["pid"])
            elif message["id"] in self.given_up:
                self.given_up.discard(message["id"])  # (an error: nothing to undo)
            else:
                self.replies[message["id"]] = message
            self.changed.notify_all()
        if reap is not None:
            with contextlib.suppress(OSError):
                self._send({"reap": reap})

    def _send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        data = json.dumps(message).encode() + b"\n"
        with self.lock:
            if fds:
                socket.send_fds(self.sock, [data], list(fds))
            else:
                self.sock.sendall(data)

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
        The zygote imports ``warm`` and ``module`` first, if it has not yet (another caller's
        zygote). :class:`Unfit` when this zygote cannot fork it (start it with a real exec)."""
        request: dict[str, Any] = {"module": module, "argv": list(argv), "env": dict(env)}
        request.update(cwd=cwd, warm=list(dict.fromkeys([*self.warm, *warm])))
        if prelude is not None:
            request["prelude"] = prelude
        with self.changed:
            if self.dead:
                raise OSError("the fork server is gone")
            self.asked += 1
            request["id"] = ask = self.asked
        self._send(request, fds)
        with self.changed:
            if not self.changed.wait_for(
                lambda: ask in self.replies or self.dead, self.answer_timeout
            ):
                self.given_up.add(ask)  # (its answer, if it comes: that child is killed)
                raise OSError(f"the fork server did not answer in {self.answer_timeout:g} s")
            if ask not in self.replies:
                raise OSError("the fork server is gone")
            reply = self.replies.pop(ask)
            if "error" in reply:
                if reply.get("unfit"):
                    self.retired = True
                    message = f"the fork server cannot fork {module}: {reply['error']}"
                    raise Unfit(message, bool(reply.get("started")))
                raise OSError(f"the fork server could not start {module}: {reply['error']}")
            pid: int = reply["pid"]
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
            with contextlib.suppress(OSError):
                self._send({"reap": pid})
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

    def _forget(self) -> None:
        """In a process forked from this one: close its copy of this end, so that the zygote
        still sees it close when the process that started it dies (a copy held open kept the
        zygote and its children alive for as long as the copy lived). Never a shutdown: that
        would end the parent's children too."""
        with contextlib.suppress(OSError):
            os.close(self.sock.detach())


_zygotes: dict[_Key, ForkServer] = {}
_here: ForkServer | None = None  # (the zygote forked from this process)
_retired: list[ForkServer] = []  # (forks no more; closed at exit)
_unforkable: set[str] = set()  # modules that start a thread when imported: real execs
_zygotes_lock = threading.Lock()
_forked_by_closed = 0


def fork_this_process(warm: Sequence[str] = ()) -> bool:
    """Fork this process into the zygote later spawns are forked from, if it has no thread
    yet (else False: the first spawn starts one with ``python -m``). The zygote then costs no
    start-up and no import of its own (what this process imported; ``warm`` too). It serves
    the spawns whose start-up environment agrees with this process's now (``PYTHONPATH``
    aside: a child puts its own first), in any working directory."""
    global _here
    for name in warm:
        importlib.import_module(name)
    with _zygotes_lock:
        if _here is not None:
            return True
        if threading.active_count() != 1:  # (a thread forked into a child is a lock held)
            return False
        # This interpreter's flags (-W error, -X dev, -O...) would be every child's, and a
        # ``python -m`` child has none: such a process forks no zygote of itself.
        if subprocess._args_from_interpreter_flags():  # type: ignore[attr-defined]
            return False
        _here = ForkServer(None, "", warm)
    return True


def _agrees(zygote: ForkServer, key: _Key) -> bool:
    """Whether ``zygote`` (forked from this process) can serve a spawn of start-up ``key``:
    the same variables, but for ``PYTHONPATH`` (the child's is put first on its path)."""
    path_free = [(k, v) for k, v in key[1] if k != "PYTHONPATH"]
    return path_free == [(k, v) for k, v in zygote.key[1] if k != "PYTHONPATH"]


def server_for(
    env: Mapping[str, str], cwd: str, *, warm: Sequence[str] = (), here: bool = True
) -> ForkServer:
    """The zygote that serves spawns in ``env`` and ``cwd``: this process's own (``here``:
    forked from it, if the start-up environment agrees), or the one for their start-up
    environment, started now (importing ``warm``) if there is none."""
    global _forked_by_closed
    key = startup_key(env, cwd)
    with _zygotes_lock:
        usable = here and _here is not None and not _here.dead and not _here.retired
        if usable and _here is not None and _agrees(_here, key):
            return _here
        zygote = _zygotes.get(key)
        if zygote is None or zygote.dead or zygote.retired:
            if zygote is not None:
                _forked_by_closed += zygote.forked
                if not zygote.dead:
                    _retired.append(zygote)
            zygote = _zygotes[key] = ForkServer(env, key[0], warm)
    return zygote


def forked() -> int:
    """How many processes this process's zygotes have forked (for the testing room's tests)."""
    with _zygotes_lock:
        every = [*_zygotes.values(), *_retired, *([_here] if _here is not None else [])]
        return _forked_by_closed + sum(z.forked for z in every)


def _close_all() -> None:
    global _here
    with _zygotes_lock:
        zygotes = [*_zygotes.values(), *_retired, *([_here] if _here is not None else [])]
        _zygotes.clear()
        _retired.clear()
        _here = None
    for zygote in zygotes:
        zygote.close()


def _forget() -> None:
    """In a child forked from this process (a test's ``os.fork()``, multiprocessing's fork, a
    zygote's child): its parent's zygotes are not its own. It closes its copies of their
    sockets (the zygotes must see the parent's end close when the parent dies); its exit must
    not close them (a shutdown of the shared socket would end the parent's servers), nor may it
    wait on a lock a thread of the parent held at the fork."""
    global _zygotes, _zygotes_lock, _here, _retired
    for zygote in [*_zygotes.values(), *_retired, *([_here] if _here is not None else [])]:
        zygote._forget()
    _zygotes, _zygotes_lock, _here, _retired = {}, threading.Lock(), None, []


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
    its own, forked by this process's zygote for ``env`` (started at the first spawn, importing
    ``warm``), or a real exec when not :func:`enabled` (``opt_out``) or where the zygote cannot
    fork it (:class:`Unfit`). The streams as Popen's: ``subprocess.PIPE``, ``DEVNULL``,
    ``STDOUT`` (stderr), a file, or None (this process's); ``text`` makes the pipes UTF-8 text.
    ``module`` must have ``main(argv)``. With ``prelude``, as ``python -c "PRELUDE; from MODULE
    import main; sys.exit(main(sys.argv[1:]))"`` (``main(argv)`` in both ways); the prelude may
    read ``__parent__``, the pid of the process that starts the child (this one, or the
    zygote)."""
    env = dict(os.environ if env is None else env)
    try:
        where = os.path.abspath(cwd if cwd is not None else os.getcwd())
    except FileNotFoundError:  # (this process's directory was deleted: a real exec starts in it)
        where = ""

    def real_exec() -> Process:
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

    if not enabled(opt_out) or not where or module in _unforkable:
        return real_exec()
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
        forked_prelude = prelude
        if prelude is not None:  # (its ``__parent__``: the zygote, which forks it)
            forked_prelude = f"__parent__ = {zygote.pid}\n{prelude}"
        pid = zygote.spawn(module, argv, env, where, fds, prelude=forked_prelude, warm=warm)
    except Unfit as exc:
        for one in ours:
            if one is not None:
                os.close(one)
        if exc.started:
            _unforkable.add(module)
        return real_exec()
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


def _threads() -> int:
    """This process's threads: the kernel's count (a C library's thread too), else Python's."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _import_frozen(names: Sequence[str]) -> None:
    """Import ``names`` (if any) with the cyclic collector off, then freeze what is there: the
    objects every child inherits stay out of its collections (and its pages shared). A name
    whose import starts a thread: RuntimeError naming it."""
    if not names:
        return
    gc.disable()
    try:
        for name in names:
            importlib.import_module(name)
            if _threads() != 1:  # (a thread forked into a child would be a lock held)
                raise RuntimeError(f"importing {name} started a thread")
    finally:
        gc.freeze()
        gc.enable()


def _where(spec: Any) -> str | tuple[str, ...] | None:
    """Where a module's spec says it comes from (a namespace package: its directories)."""
    if spec is None:
        return None
    if spec.origin not in (None, "namespace"):
        return str(spec.origin)
    return tuple(spec.submodule_search_locations or ())


def _child_first(request: dict[str, Any]) -> list[str]:
    """What ``python -m`` has first on its path in the request's directory and environment:
    its directory, then PYTHONPATH (then the zygote's path: no directory of its own on it)."""
    pythonpath = request["env"].get("PYTHONPATH", "")
    return [request["cwd"], *filter(None, pythonpath.split(os.pathsep))]


def _local(names: Sequence[str], first: list[str]) -> list[str]:
    """The top-level packages the child must import itself: those this zygote has from
    elsewhere than the child's path (``first``, then the zygote's) finds them, among ``names``'
    and those it imported from a directory not on its own path (a spawn's, the parent's
    script's: :data:`_owned`)."""
    path = [*first, *sys.path]
    local = []
    for top in dict.fromkeys([*(name.partition(".")[0] for name in names), *_owned]):
        have = sys.modules.get(top)
        spec = getattr(have, "__spec__", None)
        if spec is None or spec.origin in ("built-in", "frozen"):
            continue  # (not imported yet: it will be, the child's path first)
        if _where(importlib.machinery.PathFinder.find_spec(top, path)) != _where(spec):
            local.append(top)
    return local


_owned: set[str] = set()
"""The top-level modules this zygote imported from a directory not on its own path."""


def _own(entries: Sequence[str], before: set[str]) -> None:
    """Note the top-level modules imported since ``before`` from ``entries``: from under one,
    and not where this zygote's own path finds them (a checkout's virtualenv is under it)."""
    under = tuple(os.path.join(os.path.abspath(entry), "") for entry in entries)
    for name in set(sys.modules) - before:
        where = _where(getattr(sys.modules[name], "__spec__", None))
        places = [where] if isinstance(where, str) else list(where or ())
        if "." in name or not any(str(p).startswith(under) for p in places):
            continue
        if where != _where(importlib.machinery.PathFinder.find_spec(name, sys.path)):
            _owned.add(name)


def _import_for(names: Sequence[str], first: list[str]) -> None:
    """Import ``names`` here (frozen) with ``first`` (a spawn's directory, its PYTHONPATH)
    first on the path, as the child would: noting what came from there."""
    new = [entry for entry in first if entry not in sys.path]
    before, saved = set(sys.modules), sys.path[:]
    sys.path[:0] = new
    try:
        _import_frozen([name for name in names if name not in sys.modules])
    finally:
        sys.path[:] = saved
        for entry in new:  # (one a directory: not kept)
            sys.path_importer_cache.pop(entry, None)
        _own(new, before)


def _findable(name: str, path: list[str]) -> bool:
    """Whether ``name`` is found on ``path`` (a package's parts without importing it)."""
    parts = name.split(".")
    spec = importlib.machinery.PathFinder.find_spec(parts[0], path)
    for n in range(2, len(parts) + 1):
        if spec is None or not spec.submodule_search_locations:
            return False
        where = list(spec.submodule_search_locations)
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:n]), where)
    return spec is not None


def _serve(fd: int, warm: Sequence[str]) -> Callable[[], int] | None:
    """Serve spawn requests on socket ``fd`` until it closes (then None); in a forked child,
    the child's job instead."""
    _import_frozen(warm)
    if _threads() != 1:  # (a thread forked into a child would be a lock held)
        raise RuntimeError("the fork server has a thread before it forks")
    parent = os.getppid()  # (watched too: a process forked from it may hold its end open)
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
    broken = ""  # (why it forks no more: a thread started)

    def send(message: dict[str, Any]) -> None:
        sock.sendall(json.dumps(message).encode() + b"\n")

    def report_exits() -> None:
        for pid in sorted(live):
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                live.discard(pid)
                zombies.add(pid)
                send({"exit": pid, "status": _status(info)})

    def end() -> None:  # the parent is gone: so are its children
        for pid in live | zombies:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        for pid in live | zombies:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        sel.close()
        sock.close()  # (-W error: an unclosed socket's warning at exit is an error)

    while True:
        events = sel.select(1.0)
        if not events and os.getppid() != parent:
            end()  # (its parent died; a process forked from it still holds its end)
            return None
        for key, _ in events:
            if key.data == "wake":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                report_exits()
                continue
            data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 3)
            passed += fds
            if not data:
                end()
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
                # children (unless it is the child's own: found in its directory); nothing it
                # imports may start a thread (it would be a lock held forever in the child).
                wanted = [*request.get("warm", ()), request["module"]]
                first = _child_first(request)
                try:
                    if broken:
                        raise RuntimeError(broken)
                    local = _local(wanted, first)
                    shared = [m for m in wanted if m.partition(".")[0] not in local]
                    for name in set(wanted) - set(shared):  # (the child's own: said here)
                        if not _findable(name, [*first, *sys.path]):
                            raise ModuleNotFoundError(f"No module named {name!r}")
                    _import_for(shared, first)
                except Exception as exc:
                    reply: dict[str, Any] = {"id": request["id"]}
                    reply["error"] = f"{type(exc).__name__}: {exc}"
                    if _threads() != 1:  # (it forks no more: each later spawn is told so)
                        reply.update(unfit=True, started=not broken)
                        broken = broken or f"it has a thread since {exc}"
                    send(reply)
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
                    return _child(request, fds, local)
                with contextlib.suppress(PermissionError):  # (the child may be there first)
                    os.setpgid(pid, pid)
                for one in fds:
                    os.close(one)
                live.add(pid)
                send({"id": request["id"], "pid": pid})
            report_exits()  # (a SIGCHLD may have come while this one was handled)


def _child(request: dict[str, Any], fds: list[int], local: Sequence[str]) -> Callable[[], int]:
    os.setpgid(0, 0)  # its own process group, as start_new_session gave it
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    # Its stdin, stdout and stderr alone, as Popen's close_fds: not the passed descriptors, nor
    # what a zygote forked from a parent process has of that process's.
    os.closerange(3, 1 << 20)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # As ``python -m`` there: its directory first, then PYTHONPATH; what the zygote has of a
    # package found there first is not that package (the child imports its own).
    first = _child_first(request)
    sys.path[:0] = first
    for name in [n for n in sys.modules if n.partition(".")[0] in local]:
        del sys.modules[name]
    for entry in first:  # (what the zygote saw there may be out of date: a fresh look)
        sys.path_importer_cache.pop(entry, None)
    if "tempfile" in sys.modules:  # (the directory it found in the zygote's environment)
        sys.modules["tempfile"].tempdir = None  # type: ignore[attr-defined]
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
        except KeyboardInterrupt:  # (as Python: the traceback, then death by SIGINT)
            with contextlib.suppress(Exception):
                traceback.print_exc()
            return -signal.SIGINT
        except BaseException:
            with contextlib.suppress(Exception):  # (a full disk under its log: still 1)
                traceback.print_exc()
            return 1
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1

    return job


def _die_of(code: int) -> None:
    """A job's death by a signal (``-SIGINT``, as Python's for an uncaught KeyboardInterrupt)."""
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)


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
        # No directory of its own on its path (the script's, the command's): a child puts its
        # own first, and imports itself what the parent had from there. (The interpreter's
        # flags, -P -I included, are none: fork_this_process.)
        _own([sys.path.pop(0) or os.getcwd()], set())
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
        _die_of(code)
        os._exit(code)


def _main() -> None:
    del sys.path[0]  # (``python -m``'s directory, / : a child puts its own first)
    job = _serve(int(sys.argv[1]), sys.argv[2:])
    if job is not None:  # (in a forked child: exit as a ``python -m`` child would)
        code = job()
        sys.stdout.flush()
        if code < 0:
            atexit._run_exitfuncs()
            sys.stderr.flush()
            _die_of(code)
        sys.exit(code)


if __name__ == "__main__":
    _main()
