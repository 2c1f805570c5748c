"""The testing room's fork server (``fenced.testing.forkserver``) behind ``FencedServer``: a
``fenced serve`` forked from a zygote that has imported its modules runs what the command runs
(its prelude first, ``fenced.cli.main`` with its argv, its environment), in a process group of
its own that pause, kill, restart and stop reach as before; a start-up environment unlike the
zygote's is a real exec; and nothing outlives the process that started them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fenced.testing import forkserver
from fenced.testing.servers import FencedServer, python_env, wait_until

# Run first in the server (its prelude): what the process looks like before the command runs.
_PROBE = """
import gc, logging, os, signal
fresh = (signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL and signal.set_wakeup_fd(-1) == -1
         and not logging.getLogger().handlers)
print("probe", sum(s["collections"] for s in gc.get_stats()), gc.get_freeze_count(),
      gc.isenabled(), os.environ.get("FENCED_PROBE"), " ".join(sys.argv[:2]), __name__,
      os.getpgid(0) == os.getpid(), fresh, file=sys.stderr, flush=True)
"""


def _grant(server: FencedServer, lock: str, request_id: str) -> str:
    r = httpx.post(
        f"{server.url}/v1/locks/{lock}/-/acquire",
        json={"ttl": 30, "request_id": request_id},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    token: str = r.json()["token"]
    return token


def _release(server: FencedServer, lock: str, token: str, request_id: str) -> None:
    r = httpx.post(
        f"{server.url}/v1/locks/{lock}/-/release",
        json={"token": token, "request_id": request_id},
        timeout=30,
    )
    assert r.json() == {"released": True}, r.text


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[-1].split()[0]


def _gone(pid: int) -> bool:
    try:
        return _state(pid) == "Z"  # (an orphaned zygote waits for init to reap it)
    except OSError:
        return True


def test_a_forked_fenced_serve_runs_the_command_its_prelude_first(tmp_path: Path) -> None:
    """The child runs the prelude in a fresh ``__main__`` with the command's argv, in the
    server's environment and its own process group, with a fresh interpreter's signal
    handlers and no logging set up; the zygote's imports were made with the
    collector off and are frozen (as ``fenced serve`` does over its own), the collector on."""
    source = f"sqlite:///{tmp_path / 'l.db'}"
    with FencedServer(source, prelude=_PROBE, env={"FENCED_PROBE": "seen"}) as server:
        assert isinstance(server.proc, forkserver.Child)
        assert _grant(server, "p", "r") == "p:1"
        log = server.log_path.read_text()
    [line] = [ln for ln in log.splitlines() if ln.startswith("probe ")]
    _, runs, frozen, enabled, env, argv0, argv1, name, own_group, fresh = line.split()
    assert (argv0, argv1, name) == ("-c", "serve", "__main__"), line
    assert env == "seen" and own_group == "True", line
    # (a fresh interpreter's signal handlers, no wake-up fd, no logging set up: the zygote's
    # own SIGCHLD handler and wake-up pipe are undone in the child)
    assert fresh == "True", line
    # (the server's stack made the collector run ~110 times when imported with it on)
    assert int(runs) < 100 and int(frozen) > 50_000 and enabled == "True", line


def test_pause_kill_restart_and_stop_reach_a_forked_server(tmp_path: Path) -> None:
    """SIGSTOP and SIGCONT reach it; kill -9 and a restart on the same data reuse no token;
    a graceful stop is its SIGTERM."""
    with FencedServer(f"sqlite:///{tmp_path / 'l.db'}") as server:
        assert isinstance(server.proc, forkserver.Child)
        first = server.proc
        assert _grant(server, "k", "r1") == "k:1"
        _release(server, "k", "k:1", "r1")
        server.pause()  # (the signal lands when the kernel next schedules it: a bounded wait)
        wait_until(lambda: _state(first.pid) == "T", 10, "the paused server to stop")
        server.resume()
        wait_until(lambda: _state(first.pid) != "T", 10, "the resumed server to run")
        server.restart(kill=True)
        assert first.returncode == -signal.SIGKILL
        assert server.proc is not None and server.proc.pid != first.pid
        assert _grant(server, "k", "r2") == "k:2"  # (the mark survived kill -9)
        second = server.proc
        server.stop()
        assert second.returncode == -signal.SIGTERM


def test_a_start_up_environment_unlike_the_zygotes_is_a_real_exec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A variable a Python start-up reads (here PYTHONDONTWRITEBYTECODE; LD_PRELOAD for
    libfaketime), ``fork=False`` and ``FENCED_FORKSERVER=0`` each start it with an exec."""
    source = f"sqlite:///{tmp_path / 'l.db'}"
    for server in (
        FencedServer(source, env={"PYTHONDONTWRITEBYTECODE": "1"}),
        FencedServer(source, fork=False),
    ):
        with server:
            assert isinstance(server.proc, subprocess.Popen)
    monkeypatch.setenv("FENCED_FORKSERVER", "0")
    with FencedServer(source) as server:
        assert isinstance(server.proc, subprocess.Popen)


_STARTER = """
import sys, time
from fenced.testing.servers import FencedServer
server = FencedServer(sys.argv[1]).start()
print(server.proc.pid, flush=True)
time.sleep(120)
"""


def test_the_zygote_and_its_servers_die_with_the_process_that_started_them(
    tmp_path: Path,
) -> None:
    """A test process killed with SIGKILL (no clean-up of its own) leaves no server and no
    zygote behind: the zygote sees its socket close, kills its children and exits."""
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, f"sqlite:///{tmp_path / 'l.db'}"],
        stdout=subprocess.PIPE,
        env=python_env(),
        text=True,
    )
    try:
        assert starter.stdout is not None
        server = int(starter.stdout.readline())
        with open(f"/proc/{server}/stat", encoding="ascii") as f:
            zygote = int(f.read().rsplit(")", 1)[-1].split()[1])
        assert zygote != starter.pid and not _gone(zygote) and not _gone(server)
    finally:
        starter.kill()
        starter.wait()
    wait_until(lambda: _gone(server) and _gone(zygote), 20, "the server and its zygote to exit")


_FORKER = """
import os, sys, httpx
from fenced.testing.servers import FencedServer
server = FencedServer(sys.argv[1]).start()
pid = os.fork()
if pid == 0:
    if sys.argv[2] == "close":  # (its copy of the server: as a Popen's, closed at once)
        server.close()
    sys.exit(0)  # (a forked child's exit runs the exit handlers this process registered)
_, status = os.waitpid(pid, 0)
if sys.argv[2] == "close":
    print(os.waitstatus_to_exitcode(status))
else:
    grant = httpx.post(f"{server.url}/v1/locks/f/-/acquire", json={"ttl": 30}, timeout=30)
    print(os.waitstatus_to_exitcode(status), grant.status_code, grant.json().get("token"))
server.close()
"""


def test_a_forked_copy_of_the_test_process_leaves_its_servers_alone(tmp_path: Path) -> None:
    """A test that forks its process (``os.fork()``) gets a child that exits through the exit
    handlers it inherited: those must not close the parent's zygote (a shutdown of the shared
    socket ended every server of the parent). The parent's server still grants after it."""
    done = subprocess.run(
        [sys.executable, "-c", _FORKER, f"sqlite:///{tmp_path / 'l.db'}", "exit"],
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "200", "f:1"], done.stdout


def test_a_forked_copy_that_closes_its_copy_of_a_server_does_not_hang(tmp_path: Path) -> None:
    """The copy has no reader of the zygote's reports: waiting for the server's exit there
    would never end (a Popen's wait there returns at once: not its child)."""
    starter = subprocess.Popen(
        [sys.executable, "-c", _FORKER, f"sqlite:///{tmp_path / 'l.db'}", "close"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
        start_new_session=True,  # (its group: the copy too, if it hangs)
    )
    try:
        out, err = starter.communicate(timeout=60)
    finally:  # (a hung copy would be left behind: end it with its parent)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(starter.pid, signal.SIGKILL)
        starter.wait()
    assert starter.returncode == 0, err
    assert out.split() == ["0"], out  # (the copy exited 0: its close() returned)


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_child_whose_parent_died_before_its_death_signal_was_set_exits(
    tmp_path: Path, fork: str
) -> None:
    """The parent-death signal is set by the child's prelude: a parent killed before that
    (during a real exec's Python start-up) sends none, and the child lived on re-parented (a
    stopped check worker for ever). The prelude compares its parent with the one that started
    it (``__parent__``, which popen defines in both ways): a stranger, and it exits at once.
    The other side: started by its real parent, it runs."""
    from fenced.testing import parentdeath

    out = tmp_path / "ran"
    code = f"open({str(out)!r}, 'w').close()"
    env = {**python_env(), forkserver.FORKSERVER_ENV: fork}
    (tmp_path / "runs.py").write_text(f"def main(argv):\n    {code}\n    return 0\n")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    child = forkserver.popen("runs", [], env=env, cwd=tmp_path, prelude=parentdeath.PRELUDE)
    assert child.wait(60) == 0 and out.exists()
    out.unlink()
    # A prelude told another parent than its own: as if the real one had died first.
    stranger = "__parent__ = 1\n" + parentdeath.PRELUDE
    done = subprocess.run(
        [sys.executable, "-c", f"{stranger}\n{code}"], env=env, cwd=tmp_path, timeout=60
    )
    assert done.returncode == 1 and not out.exists()


# -- what a child shares with its zygote and its siblings (an outside tester's findings) --------

# A child's view of itself: its variables (as the process shows them), its command line, its
# descriptors, its start-up settings, its parent.
_PROBE_MODULE = """
import json, os, sys, tempfile
def main(argv):
    with open("/proc/self/environ", "rb") as f:
        shown = f.read().decode(errors="replace")
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().decode(errors="replace")
    print(json.dumps({
        "who": WHO, "shown": shown, "cmdline": cmdline, "env": os.environ.get("SECRET"),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd"))[:-1],  # (not listdir's)
        "warnoptions": sys.warnoptions, "hash": hash("fenced"), "tmp": tempfile.gettempdir(),
        "ppid": os.getppid(),
    }), flush=True)
    return 0
"""


def _probe(where: Path, who: str = "probe") -> None:
    where.mkdir(parents=True, exist_ok=True)
    (where / "probe.py").write_text(f"WHO = {who!r}\n{_PROBE_MODULE}")


def _fresh_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """python_env() with a start-up variable of this test's own (Python ignores it): a zygote
    of its own, started by this test's first spawn."""
    return {**python_env(), "PYTHONFENCEDTEST": str(tmp_path), **extra}


def _run_probe(env: dict[str, str], cwd: Path, *argv: str) -> dict[str, object]:
    child = forkserver.popen("probe", argv, env=env, cwd=cwd, stdout=subprocess.PIPE)
    assert isinstance(child, forkserver.Child)
    assert child.stdout is not None
    seen: dict[str, object] = json.loads(child.stdout.read())
    child.stdout.close()
    assert child.wait(30) == 0
    return seen


def test_a_child_shows_no_other_spawns_variables_nor_arguments(tmp_path: Path) -> None:
    """The zygote is started with the start-up variables alone, not its first spawn's whole
    environment: a later child given no secret finds none in ``/proc/self/environ`` (nor does
    the first: only its own ``os.environ`` has it); the command line shown is the zygote's,
    with no spawn's arguments."""
    _probe(tmp_path)
    first = _run_probe(_fresh_env(tmp_path, SECRET="hunter2-test-A"), tmp_path, "arg-of-A")
    later = _run_probe(_fresh_env(tmp_path), tmp_path)
    assert first["env"] == "hunter2-test-A" and later["env"] is None
    for seen in (first, later):
        assert "hunter2" not in str(seen["shown"]) and "arg-of-A" not in str(seen["cmdline"])
        assert "fenced.testing.forkserver" in str(seen["cmdline"])
    assert first["ppid"] == later["ppid"]  # (one zygote)


def test_one_zygote_serves_every_directory_each_child_its_own_module(tmp_path: Path) -> None:
    """A zygote has no directory on its path: a module of the same name in two working
    directories is each child's own (as ``python -m`` there), from one zygote, not one zygote
    a directory kept until the process exits."""
    _probe(tmp_path / "a", "a")
    _probe(tmp_path / "b", "b")
    env = _fresh_env(tmp_path)
    seen = [_run_probe(env, tmp_path / d) for d in ("a", "b", "a")]
    assert [s["who"] for s in seen] == ["a", "b", "a"]
    assert len({s["ppid"] for s in seen}) == 1, seen


def test_a_child_finds_its_own_tmpdir_whatever_the_zygote_found(tmp_path: Path) -> None:
    """A module the zygote imported found its temporary directory there (``tempfile`` keeps
    it): each child looks again in its own environment, and has its three streams alone."""
    lib = tmp_path / "lib"  # (on PYTHONPATH, not in the directory: the zygote imports it)
    lib.mkdir()
    (lib / "findstmp.py").write_text("import tempfile\nTMP = tempfile.gettempdir()\n")
    _probe(tmp_path)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    env = _fresh_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(lib), env["PYTHONPATH"]])
    for name in ("a", "b"):
        child = forkserver.popen(
            "probe", [], env={**env, "TMPDIR": str(tmp_path / name)}, cwd=tmp_path,
            stdout=subprocess.PIPE, warm=("findstmp",),
        )  # fmt: skip
        assert isinstance(child, forkserver.Child) and child.stdout is not None
        seen = json.loads(child.stdout.read())
        child.stdout.close()
        assert child.wait(30) == 0
        assert seen["tmp"] == str(tmp_path / name) and seen["fds"] == [0, 1, 2], seen


_LATE = """
import signal
with open(FIFO) as f:  # (the import waits for the test: an answer later than the limit)
    f.read()
def main(argv):
    signal.pause()
"""

_PIDME = """
import os, sys
def main(argv):
    print(os.getpid(), flush=True)
    sys.stdin.read()
    return 0
"""


def _zygotes_children(zygote: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if entry.name.isdigit() and int(fields[1]) == zygote and fields[0] != "Z":
                found.add(int(entry.name))
    return found


def test_an_answer_after_the_limit_is_never_taken_for_the_next_spawns(tmp_path: Path) -> None:
    """A spawn answered after the limit: its late answer was taken for the next spawn's, so
    that Child had the slow child's pid (kill() and wait() hit the wrong process). Answers
    carry their request's id: the next Child is its own process, and the late one is killed."""
    lib = tmp_path / "lib"  # (on PYTHONPATH, not in the directory: the zygote imports it)
    lib.mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (lib / "late.py").write_text(f"FIFO = {str(fifo)!r}\n{_LATE}")
    (lib / "pidme.py").write_text(_PIDME)
    env = python_env()
    env["PYTHONPATH"] = os.pathsep.join([str(lib), env["PYTHONPATH"]])
    zygote = forkserver.ForkServer(env, "")
    (r, w), (stdin, feed) = os.pipe(), os.pipe()
    try:
        with open(os.devnull, "rb") as devnull:
            nul = devnull.fileno()
            zygote.answer_timeout = 0.5
            with pytest.raises(OSError, match=r"did not answer in 0\.5 s"):
                zygote.spawn("late", [], env, str(tmp_path), (nul, nul, nul))
            zygote.answer_timeout = 60.0
            # The import goes on, the late child is forked and answered for, before the next
            # request is read: its answer comes first.
            with open(fifo, "w") as go:
                go.write("go")
            pid = zygote.spawn("pidme", [], env, str(tmp_path), (stdin, w, nul))
        os.close(w)
        os.close(stdin)
        child = forkserver.Child(zygote, pid)
        with open(r, "rb", closefd=False) as out:
            assert int(out.readline()) == child.pid  # (its own pid, not the late child's)
        # The late child was killed (and reaped): the zygote's only child is the new one.
        wait_until(lambda: _zygotes_children(zygote.pid) == {pid}, 20, "the late child's end")
        child.kill()
        assert child.wait(10) == -signal.SIGKILL
    finally:
        for fd in (r, feed):
            os.close(fd)
        zygote.close()


_THREAD_AT_IMPORT = """
import threading
threading.Thread(target=threading.Event().wait, daemon=True).start()
def main(argv):
    return 0
"""


def test_a_module_that_starts_a_thread_is_a_real_exec_and_the_next_is_forked(
    tmp_path: Path,
) -> None:
    """Importing it leaves a thread in the zygote, which forks no more: that spawn and its
    module's later ones are real execs, and the next spawn of another module is forked by a
    new zygote (every later spawn failed, blamed on its own module)."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "threadimp.py").write_text(_THREAD_AT_IMPORT)
    _probe(tmp_path)
    env = _fresh_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(lib), env["PYTHONPATH"]])
    for _ in range(2):
        exec_ = forkserver.popen("threadimp", [], env=env, cwd=tmp_path)
        assert isinstance(exec_, subprocess.Popen) and exec_.wait(60) == 0
    seen = _run_probe(env, tmp_path)
    assert seen["who"] == "probe"


_SIGINT = """
import sys
def main(argv):
    print("ready", flush=True)
    sys.stdin.read()
    return 0
"""


def test_a_child_killed_by_sigint_reports_minus_sigint(tmp_path: Path) -> None:
    """As Python's own exit on an uncaught KeyboardInterrupt: death by SIGINT, not 1."""
    (tmp_path / "interrupted.py").write_text(_SIGINT)
    child = forkserver.popen(
        "interrupted", [], env=_fresh_env(tmp_path), cwd=tmp_path,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert isinstance(child, forkserver.Child) and child.stdout is not None
    assert child.stdout.readline() == b"ready\n"
    child.send_signal(signal.SIGINT)
    assert child.wait(30) == -signal.SIGINT
    for stream in (child.stdin, child.stdout):
        assert stream is not None
        stream.close()


_FORKS_THEN_DIES = """
import os, signal, subprocess, sys
from fenced.testing import forkserver
child = forkserver.popen("pidme", [], cwd=sys.argv[1], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
pid = int(child.stdout.readline())
copy = os.fork()
if copy == 0:  # (a forked helper, multiprocessing's fork: it outlives its parent)
    signal.pause()
    os._exit(0)
print(pid, child._zygote.pid, copy, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_parent_killed_after_it_forked_leaves_no_child_nor_zygote(tmp_path: Path) -> None:
    """A process forked from the parent held the zygote's socket open: the parent's kill -9
    left its children and the zygote alive as long as the copy lived. The copy closes its
    copies of the sockets (and the zygote watches its parent): both go at once."""
    (tmp_path / "pidme.py").write_text(_PIDME)
    starter = subprocess.Popen(
        [sys.executable, "-c", _FORKS_THEN_DIES, str(tmp_path)],
        stdout=subprocess.PIPE, env=python_env(), text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert starter.stdout is not None
        child, zygote, copy = map(int, starter.stdout.readline().split())
        assert starter.wait(30) == -signal.SIGKILL
        wait_until(lambda: _gone(child) and _gone(zygote), 10, "the child and zygote to exit")
        assert not _gone(copy)  # (the copy lives on: it was not what kept them)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(starter.pid, signal.SIGKILL)
        starter.wait()


_FORKS_ITSELF = """
import json, os, subprocess, sys, tempfile
tempfile.gettempdir()  # (this process found its directory before it forked: as pytest does)
secret = os.open(sys.argv[1], os.O_RDONLY)  # (a descriptor of this process's)
from fenced.testing import forkserver
assert forkserver.fork_this_process()
def parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:  # (gone meanwhile)
        return 0
[here] = [int(p) for p in os.listdir("/proc") if p.isdigit() and parent(p) == os.getpid()]
def run(cwd, **extra):
    child = forkserver.popen("probe", [], env={**os.environ, **extra}, cwd=cwd,
                             stdout=subprocess.PIPE)
    seen = json.loads(child.stdout.read())
    child.wait()
    seen["here"] = seen["ppid"] == here
    return seen
other = sys.argv[2]
print(json.dumps([
    run(other),  # (its own directory's module, not the one beside this script)
    run(other, TMPDIR=other),
    run(other, PYTHONWARNINGS="error", PYTHONHASHSEED="0"),
]))
"""


def test_a_zygote_forked_from_its_parent_serves_only_spawns_that_agree_with_it(
    tmp_path: Path,
) -> None:
    """``fork_this_process`` (``fenced check``'s way) made a zygote that served every spawn
    as its parent was: the parent's warning filters, hash seed and temporary directory, its
    open descriptors, its script's directory on the path. Now a child of it has its own
    directory's modules, its own TMPDIR and its three streams alone; a start-up environment
    unlike the parent's is another zygote's (as ``python`` itself would run it)."""
    home, other = tmp_path / "home", tmp_path / "other"
    _probe(home, "home")  # (beside the script: its directory is first on its path)
    _probe(other, "other")
    (home / "forks.py").write_text(_FORKS_ITSELF)
    secret = tmp_path / "secret"
    secret.write_text("the parent's")
    # (no interpreter flag set by the environment: such a process forks no zygote of itself)
    env = {k: v for k, v in python_env().items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run(
        [sys.executable, str(home / "forks.py"), str(secret), str(other)],
        cwd=home, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    same, tmpdir, strict = json.loads(done.stdout)
    assert same["who"] == "other" and same["here"] and same["fds"] == [0, 1, 2], same
    assert tmpdir["tmp"] == str(other) and tmpdir["here"], tmpdir
    # As a real exec in that environment: warnings are errors, the hash seed is 0.
    real = subprocess.run(
        [sys.executable, "-c", "import probe; probe.main([])"], cwd=other, capture_output=True,
        env={**env, "PYTHONWARNINGS": "error", "PYTHONHASHSEED": "0"}, text=True, timeout=60,
    )  # fmt: skip
    expected = json.loads(real.stdout)
    assert not strict["here"], strict
    assert (strict["warnoptions"], strict["hash"]) == (["error"], expected["hash"]), strict
