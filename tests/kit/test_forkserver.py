"""The testing room's fork server (``fenced.testing.forkserver``) behind ``FencedServer``: a
``fenced serve`` forked from a zygote that has imported its modules runs what the command runs
(its prelude first, ``fenced.cli.main`` with its argv, its environment), in a process group of
its own that pause, kill, restart and stop reach as before; a start-up environment unlike the
zygote's is a real exec; and nothing outlives the process that started them."""

from __future__ import annotations

import contextlib
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
