"""``fenced check`` as an unlucky operator meets it: killed with SIGKILL or SIGHUP mid-run, its
fork server or a worker crashing, a report directory holding the user's files, a resource
that hangs, a password in a URL, bad input. Real processes, real servers, real signals."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced.testing.servers import free_port
from tests.helpers import ROOT

SERVICE = ROOT / "examples" / "inventory_service.py"


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with the project's root on the path: a ``python:tests...``
    resource is imported by the kit from there, wherever it runs (CI sets no PYTHONPATH)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def _fenced(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "fenced", "check", *args],
        cwd=cwd,
        env=_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, out, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""  # gone


def _alive(pid: int) -> bool:
    """Whether any thread of ``pid`` has not exited. (Its leader thread alone may show ``Z``
    while another thread of a SIGKILLed process is still in its exit, a ``D`` fsync say: the
    process's sockets close only when the last thread is gone.)"""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return any(_state_of(f"/proc/{pid}/task/{t}/stat") not in ("", "Z", "X") for t in tasks)


def _state_of(stat: str) -> str:
    try:
        with open(stat) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _holders(port: int) -> list[str]:
    """Who listens on 127.0.0.1:``port`` (pid, parent, command line): shown when a port is
    still taken, so a failure says whose it is."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                    inodes.add(cols[9])
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = set()
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):  # (closed meanwhile)
                    links.add(os.readlink(f"/proc/{entry}/fd/{fd}"))
            if any(f"socket:[{i}]" in links for i in inodes):
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()[:120]
                out.append(f"{entry} (ppid {_ppid(int(entry))}, {_state(int(entry))}): {cmd!r}")
        except OSError:
            continue
    return out


def _stat_field(pid: int, index: int, missing: str) -> str:
    """Field ``index`` of /proc/PID/stat after the command's name (``missing``: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[index]
    except (OSError, IndexError):
        return missing


def _ppid(pid: int) -> str:
    return _stat_field(pid, 1, "?")


def _started(pid: int) -> str:
    """The process's start time (with its pid, who it is: a pid may be reused meanwhile)."""
    return _stat_field(pid, 19, "")


def _wait(condition: object, limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)  # (polling /proc: nothing to wait on)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.5):
            return True
    except OSError:
        return False


@pytest.fixture
def reaped() -> Iterator[list[int]]:
    """Pids the test saw: SIGKILLed at its end if still there (a failed test leaves none)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("forkserver", "sig"),
    [("1", signal.SIGKILL), ("0", signal.SIGKILL), ("1", signal.SIGHUP)],
)
def test_a_killed_or_hung_up_check_leaves_no_process_behind(
    tmp_path: Path, forkserver: str, sig: signal.Signals, reaped: list[int]
) -> None:
    """kill -9 (or a closed terminal's SIGHUP) of ``fenced check`` while a worker is paused:
    the source it started, the resource command it ran and every worker (the stopped one too)
    die with it: nothing under init, the resource's port free for the next run."""
    port = free_port()
    cmd = f"{sys.executable} {SERVICE} --port {port} --db {tmp_path / 'inv.db'}"
    check = _fenced(
        "--source", "redis", "--resource", f"http://127.0.0.1:{port}/items/w",
        "--resource-cmd", cmd, "--nemesis", "pause", "--time", "120", "--report",
        str(tmp_path / "r"), cwd=tmp_path, env={"FENCED_CHECK_FORKSERVER": forkserver},
    )  # fmt: skip
    reaped.append(check.pid)
    seen: dict[int, str] = {}

    def a_worker_is_paused() -> bool:
        now = _descendants(check.pid)
        seen.update({p: _started(p) for p in now if p not in seen})
        reaped.extend(now - set(reaped))
        return _accepts(port) and any(_state(p) == "T" for p in now)

    _wait(a_worker_is_paused, 90, "no worker was paused")
    names = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in seen if _state(p)}
    assert any(b"redis-server" in n for n in names.values()), names
    os.kill(check.pid, sig)
    check.communicate(timeout=60)

    def left() -> list[int]:  # (still there, and still the process seen: not a reused pid)
        return [p for p, t in seen.items() if _alive(p) and _started(p) == t]

    def all_gone() -> bool:
        return not left()

    _wait(all_gone, 30, f"left behind: {[names.get(p) for p in left()]}")
    # (bounded: the listening socket is gone once its process's last thread has exited)
    deadline = time.monotonic() + 10
    while _accepts(port):
        assert time.monotonic() < deadline, f"port {port} still taken by: {_holders(port)}"
        time.sleep(0.05)  # (polling a port: nothing to wait on)


def _run(
    *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fenced", "check", *args],
        cwd=cwd,
        env=_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The run's stderr, asserted to be one line and no traceback, exit 2 (usage)."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, (
        done.stderr
    )
    return done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--resource", "redis://:hunter2@127.0.0.1:1/0"),
        ("--resource", "postgresql://u:hunter2@127.0.0.1:1/db"),
        ("--resource", "http://user:hunter2@127.0.0.1:1/x"),
        ("--resource", "http://user:hunter2@127.0.0.1/x", "--resource-cmd", "true",
         "--nemesis", "pause"),
        ("--source", "etcd://u:hunter2@127.0.0.1:1,127.0.0.1:2", "--nemesis", "partition"),
    ],
)  # fmt: skip
def test_no_password_of_a_url_in_an_error(tmp_path: Path, args: tuple[str, ...]) -> None:
    error = _one_line_error(_run(*args, "--time", "1", "--report", "r", cwd=tmp_path))
    assert "hunter2" not in error and ":***@" in error, error


def test_the_source_from_a_file_or_the_environment_as_the_other_commands(tmp_path: Path) -> None:
    """--source-file FILE and $FENCED_URL give the source (a password kept out of the process
    list); the output names where it came from, never the password; a URL file with a
    password that others may read is refused."""
    url = f"sqlite:///{tmp_path / 'src.db'}"
    # (no faults: a run about where its source comes from, not one that could be inconclusive)
    done = _run("--time", "1", "--writes", "2", "--nemesis", "", "--report", "r1", cwd=tmp_path,
                env={"FENCED_URL": url})  # fmt: skip
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "from $FENCED_URL" in done.stdout, done.stdout
    assert (tmp_path / "src.db").exists()  # (the run's grants went there)
    (tmp_path / "src.url").write_text("postgresql://u:hunter2@127.0.0.1:1/db\n")
    (tmp_path / "src.url").chmod(0o644)
    error = _one_line_error(_run("--source-file", "src.url", "--report", "r2", cwd=tmp_path))
    assert "hunter2" not in error and "src.url" in error, error


def test_bad_report_directories_and_host_lists_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("mine\n")
    assert "not a directory" in _one_line_error(_run("--report", "afile", cwd=tmp_path))
    assert "cannot make" in _one_line_error(_run("--report", "afile/sub", cwd=tmp_path))
    error = _one_line_error(
        _run("--source", "etcd://127.0.0.1:1,127.0.0.1:2", "--nemesis", "partition",
             "--report", "r", cwd=tmp_path)
    )  # fmt: skip
    assert "one host:port" in error, error


def test_a_report_directory_holding_the_users_files_is_refused(tmp_path: Path) -> None:
    """--report . where the user keeps a resource.db and a report.html: refused, both as they
    were; a directory an earlier run made is the kit's to write again."""
    mine = {"resource.db": b"my orders table", "report.html": b"<p>my report</p>"}
    for name, data in mine.items():
        (tmp_path / name).write_bytes(data)
    error = _one_line_error(_run("--report", ".", "--time", "1", cwd=tmp_path))
    assert "resource.db" in error, error
    assert {n: (tmp_path / n).read_bytes() for n in mine} == mine
    assert not (tmp_path / "history.jsonl").exists()
    for _ in range(2):  # (the second run: in the directory the first made)
        done = _run("--report", "r", "--time", "1", "--writes", "2", "--nemesis", "", cwd=tmp_path)
        assert done.returncode == 0, (done.stdout, done.stderr)


@pytest.mark.parametrize("forkserver", ["1", "0"])
def test_a_worker_that_crashes_mid_run_ends_in_a_verdict(tmp_path: Path, forkserver: str) -> None:
    """A python: adapter that takes its worker's process down: the run ends with a verdict
    ("run incomplete", which worker, its status), a report, exit 65: not a usage error."""
    done = _run(
        "--resource", "python:tests.kit.check_adapter:CrashMidRun", "--time", "60", "--report",
        "r", cwd=tmp_path, env={"CHECK_ADAPTER_DB": str(tmp_path / "a.db"),
                                "FENCED_CHECK_FORKSERVER": forkserver},
    )  # fmt: skip
    assert done.returncode == 65, (done.stdout, done.stderr)
    assert "run incomplete" in done.stdout and "status 3" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr and (tmp_path / "r" / "report.html").exists()


def test_a_killed_fork_server_ends_in_a_verdict(tmp_path: Path) -> None:
    check = _fenced("--nemesis", "kill", "--time", "20", "--report", "r", cwd=tmp_path)
    try:

        def zygote() -> int | None:
            tree = _children()
            return next((p for p in tree.get(check.pid, []) if tree.get(p)), None)

        history = tmp_path / "r" / "history.jsonl"
        # (once the faults have begun: the workers are all up. A write alone came while the
        # last worker was still starting on a loaded machine, and the kill then ended the
        # set-up, exit 2, not the run)
        _wait(
            lambda: history.exists() and b'"op":"nemesis"' in history.read_bytes(), 60, "no fault"
        )
        pid = zygote()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        out, err = check.communicate(timeout=300)
    finally:
        if check.poll() is None:
            check.kill()
    assert check.returncode == 65, (out, err)
    assert "run incomplete" in out and "Traceback" not in err, (out, err)
    assert (tmp_path / "r" / "report.html").exists()


def test_an_http_resource_that_dies_ends_in_a_verdict(tmp_path: Path) -> None:
    """The user's service dies by itself mid-run (not by the kit's hand): the verdict says the
    final state could not be read; a report; exit 65; no traceback."""
    port = free_port()
    service = subprocess.Popen(
        [sys.executable, str(SERVICE), "--port", str(port), "--db", str(tmp_path / "inv.db")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait(lambda: _accepts(port), 30, "the service did not start")
        check = _fenced("--resource", f"http://127.0.0.1:{port}/items/w", "--nemesis", "pause",
                        "--time", "15", "--report", "r", cwd=tmp_path)  # fmt: skip
        history = tmp_path / "r" / "history.jsonl"
        _wait(lambda: history.exists() and history.read_bytes().count(b'"ok":true') >= 3, 90,
              "no write accepted")  # fmt: skip
        service.kill()
        out, err = check.communicate(timeout=300)
    finally:
        service.kill()
        service.wait()
    assert check.returncode == 65, (out, err)
    assert "final state could not be read" in out and "Traceback" not in err, (out, err)
    assert (tmp_path / "r" / "report.html").exists()


@pytest.mark.parametrize("forkserver", ["1", "0"])
def test_a_deleted_working_directory_is_no_traceback(tmp_path: Path, forkserver: str) -> None:
    """``fenced check`` started in a directory deleted since (its fork server falls back to a
    real exec there, as FENCED_CHECK_FORKSERVER=0 does), killed workers replaced too."""
    gone = tmp_path / "gone"
    gone.mkdir()
    check = subprocess.Popen(
        [sys.executable, "-c", f"import os, sys, runpy; os.rmdir({str(gone)!r}); "
         "sys.argv = ['fenced', 'check', '--nemesis', 'kill', '--writes', '4', '--faults', '1', "
         f"'--time', '90', '--report', {str(tmp_path / 'r')!r}]; "
         "runpy.run_module('fenced', run_name='__main__')"],
        cwd=gone, env=_env({"FENCED_CHECK_FORKSERVER": forkserver}),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, err = check.communicate(timeout=110)
    assert check.returncode == 0 and "every invariant held" in out, (out, err)


def test_a_forked_worker_that_fails_on_a_full_disk_is_not_status_0(tmp_path: Path) -> None:
    """A worker forked by a zygote forked from its parent (as ``fenced check``'s), whose
    stderr is a full disk's (/dev/full), fails: its status says so (1), not 0."""
    script = (
        "import subprocess\n"
        "from fenced.testing import forkserver\n"
        "assert forkserver.fork_this_process(('tests.kit.zygote_child',))\n"
        "with open('/dev/full', 'wb') as full:\n"
        "    child = forkserver.popen('tests.kit.zygote_child', ['0'], stdin=subprocess.DEVNULL,\n"
        "                             stdout=subprocess.PIPE, stderr=full)\n"
        "child.stdout.readline()\n"
        "print(child.wait(30))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert done.stdout.strip() == "1", (done.stdout, done.stderr)


def test_the_interpreters_warning_flags_are_not_the_workers(tmp_path: Path) -> None:
    """``python -W error::DeprecationWarning -m fenced check``: the workers run as ``python -m``
    would start them (as FENCED_CHECK_FORKSERVER=0 does), not under the CLI's -W."""
    done = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-m", "fenced", "check",
         "--resource", "python:tests.kit.check_adapter:Warns", "--writes", "4", "--time", "60",
         "--nemesis", "", "--report", "r"],
        cwd=tmp_path, env=_env({"CHECK_ADAPTER_DB": str(tmp_path / "a.db")}),
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout, done.stderr)


@pytest.mark.parametrize("forkserver", ["1", "0"])
def test_a_hung_write_is_bounded_and_named(tmp_path: Path, forkserver: str) -> None:
    """An adapter whose writes hang (--time 3, ttl 1): the run ends within a bound derived from
    the ttl (10 ttls + 5 s to end the workers' rounds), not 30 ttls + 30 s per worker, and the
    verdict says which worker hung and where."""
    started = time.monotonic()
    done = _run(
        "--resource", "python:tests.kit.check_adapter:HangWrites", "--time", "3", "--nemesis",
        "", "--report", "r", cwd=tmp_path,
        env={"CHECK_ADAPTER_DB": str(tmp_path / "a.db"), "FENCED_CHECK_FORKSERVER": forkserver},
    )  # fmt: skip
    took = time.monotonic() - started
    assert done.returncode == 65, (done.stdout, done.stderr)
    assert "run incomplete" in done.stdout and "hung in its write" in done.stdout, done.stdout
    assert took < 45, took


def test_a_black_hole_http_resource_is_bounded(tmp_path: Path) -> None:
    """A resource that accepts connections and never answers: a one-line error within a bound
    derived from the ttl (--ttl 0.5: 10 s), not httpx's 30 s per request."""
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)
        port = hole.getsockname()[1]
        started = time.monotonic()
        done = _run("--resource", f"http://127.0.0.1:{port}/x", "--ttl", "0.5", "--time", "3",
                    "--report", "r", cwd=tmp_path)  # fmt: skip
        took = time.monotonic() - started
    error = _one_line_error(done)
    assert "did not return within 10 s" in error or "Timeout" in error, error
    assert took < 25, took


def test_no_password_in_an_http_clients_own_message(tmp_path: Path) -> None:
    """httpx quotes the URL whole in its errors ("... for url 'http://user:hunter2@...'"): the
    kit's one line shows none of its password."""
    import http.server
    import threading

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://user:hunter2@127.0.0.1:{server.server_address[1]}/x"
        error = _one_line_error(
            _run("--resource", url, "--time", "1", "--report", "r", cwd=tmp_path)
        )
    finally:
        server.shutdown()
        server.server_close()
    assert "hunter2" not in error and "HTTPStatusError" in error, error
