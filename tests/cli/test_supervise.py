"""The commands that ``fenced lock`` and ``fenced elect`` supervise, with real processes: the
command (and every process of its group) dies with its supervisor, even by SIGKILL; it keeps
the terminal; the fence command is killed at its deadline; every successor learns whom to
fence from the source's record of the last leader; a lease lost before a short command ended
is exit 75; a source that cannot exclude another process is refused; ``fenced write`` never
claims a shared directory. Each has a planted variant (the old code) that the test catches."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fenced
from fenced.testing.servers import EtcdServer
from tests.helpers import ROOT, unique_name, wait_for

BOUND = 5.0  # seconds from the supervisor's SIGKILL to its command's whole group gone

# The planted bug: the command started as before, in a session of its own, with nothing in
# it that notices the supervisor's death (and no terminal).
OLD_SPAWN = """
import os, subprocess
import fenced.cli._command as c, fenced.cli.lock as lock, fenced.cli._elect as e
def spawn(cmd, env, prefix, new_session=False):
    r, w = os.pipe()
    os.close(r)
    return c.Command(subprocess.Popen(list(cmd), env=dict(env), start_new_session=True), w)
c.spawn = lock.spawn = e.spawn = spawn
"""

# The planted bug: the fence command run to its end, however long (no deadline).
OLD_FENCE = """
import subprocess
import fenced.cli._elect as e
e._fence = lambda leader, cmd, env, limit: subprocess.run(["sh", "-c", cmd], env=env).returncode == 0
"""

# The planted bug: the source's record of the last leader not consulted (only holders seen
# while campaigning name the previous leader).
NO_RECORD = """
import fenced.cli._elect as e
_env = e.previous_env
e.previous_env = lambda record, seen, mine: _env(None, seen, mine)
"""


def cli(args: list[str], prelude: str = "", **kw: object) -> subprocess.Popen[str]:
    """`fenced ARGS` in a session of its own (no terminal: it must not take pytest's)."""
    code = f"import sys\n{prelude}\nfrom fenced.cli import main\nsys.exit(main())"
    return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
        [sys.executable, "-c", code, *args],
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,
    )


def alive(pid: int) -> bool:
    """Running (or stopped), not gone or a zombie (init may be slow to reap in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _read_pids(path: Path) -> list[int]:
    wait_for(path.exists, timeout=30, what=f"{path.name} (the command to start)")
    return [int(p) for p in path.read_text().split()]


def _group_script(pids: Path) -> str:
    """A command whose process group has two processes: its shell and a background sleep."""
    return f"sleep 300 & echo $$ $! > {pids}.tmp && mv {pids}.tmp {pids}; wait"


@pytest.mark.parametrize("command", ["lock", "elect"])
@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-old-spawn"])
def test_kill_9_of_the_supervisor_takes_the_command_and_its_group_along(
    tmp_path: Path, sqlite_url: str, command: str, planted: bool
) -> None:
    """Bug: after `kill -9` (the OOM killer, systemd KillMode=process) of `fenced lock` or
    `fenced elect`, the command was reparented to init and ran on while the lock was free
    (or a successor led). Now the watchdog in its group SIGKILLs the group."""
    pids = tmp_path / "pids"
    args = [command, "job", "--url", sqlite_url, "--ttl", "30"]
    if command == "elect":
        args += ["--no-fence"]
    proc = cli([*args, "--", "sh", "-c", _group_script(pids)], OLD_SPAWN if planted else "")
    members: list[int] = []
    try:
        members = _read_pids(pids)
        assert all(alive(p) for p in members)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        killed = time.monotonic()
        if planted:
            with pytest.raises(AssertionError):
                wait_for(lambda: not any(alive(p) for p in members), timeout=BOUND)
            assert all(alive(p) for p in members)  # caught: the command outlived its supervisor
            return
        wait_for(
            lambda: not any(alive(p) for p in members), timeout=BOUND, what="the command to die"
        )
        print(f"group gone {time.monotonic() - killed:.3f} s after the supervisor's SIGKILL")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_all(members)


def test_kill_9_of_fenced_lock_on_etcd_takes_the_command_along(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    """The same through the etcd source, whose gRPC forbids Python between fork and exec in
    the supervisor: the command is started without any (the watchdog runs after exec)."""
    pids = tmp_path / "pids"
    proc = cli(["lock", unique_name("job"), "--url", etcd_server.url, "--ttl", "30", "--",
                "sh", "-c", _group_script(pids)])  # fmt: skip
    members: list[int] = []
    try:
        members = _read_pids(pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        wait_for(lambda: not any(alive(p) for p in members), timeout=BOUND, what="the command")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_all(members)


def test_a_command_that_ends_normally_passes_its_status_and_takes_its_background_job_along(
    tmp_path: Path, sqlite_url: str
) -> None:
    """The other side: when the command ends by itself, `fenced lock` passes its status on,
    and what the command left in its process group (a background job, which holds the token)
    is killed before the lock is released — the next holder gets the lock at once, and a job
    writing with the old token on would be a second writer. (Kept, it went on writing with
    token 1 while token 2 held the lock: found by an outside attack.) A reader of the
    command's output is not held up by the watchdog."""
    pids = tmp_path / "pids"
    script = f"sleep 300 >/dev/null 2>&1 & echo $! > {pids}; echo out; exit 3"
    done = subprocess.run(
        [sys.executable, "-m", "fenced", "lock", "job", "--url", sqlite_url, "--",
         "sh", "-c", script],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True, text=True, timeout=60, start_new_session=True,
    )  # fmt: skip
    (background,) = _read_pids(pids)
    try:
        assert done.returncode == 3, done.stderr
        assert done.stdout == "out\n"
        # Killed before fenced lock returned (it released the lock after): gone by now.
        assert not alive(background)
    finally:
        _kill_all([background])


def test_the_command_gets_the_signal_dispositions_fenced_was_given(
    tmp_path: Path, sqlite_url: str
) -> None:
    """The command starts through a Python wrapper, whose start-up ignores SIGPIPE (and
    SIGXFSZ): inherited through exec, `producer | head` would see EPIPE instead of dying.
    The command gets SIGPIPE and SIGINT at their defaults, as `fenced lock` had them; a SIGINT
    ignored by fenced's starter (`cmd &` in a script) stays ignored."""

    def defaults() -> None:
        # (the runner's own dispositions must not leak in: pytest started by `nohup … &`
        # ignores SIGINT and SIGQUIT, which the "plain" case would then see as fenced's)
        for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)

    def ignored(preexec: str) -> int:
        out = subprocess.run(
            ["sh", "-c", f"{preexec} exec \"$@\"", "sh", sys.executable, "-m", "fenced",
             "lock", "sig", "--url", sqlite_url, "--", "sh", "-c", "grep SigIgn /proc/$$/status"],
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            capture_output=True, text=True, timeout=60, start_new_session=True,
            preexec_fn=defaults,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[1], 16)

    plain = ignored("")
    assert not plain & (1 << (signal.SIGPIPE - 1)), hex(plain)
    assert not plain & (1 << (signal.SIGXFSZ - 1)), hex(plain)
    assert not plain & (1 << (signal.SIGINT - 1)), hex(plain)
    assert ignored("trap '' INT;") & (1 << (signal.SIGINT - 1))


@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a terminal")
@pytest.mark.parametrize(
    ("planted", "options"),
    [(False, []), (True, []), (False, ["--new-session"])],
    ids=["fenced", "planted-old-spawn", "asked-for-a-new-session"],
)
def test_the_command_keeps_the_terminal(sqlite_url: str, planted: bool, options: list[str]) -> None:
    """Bug: the command ran in a session of its own, without a controlling terminal: sudo,
    ssh, psql prompts and editors failed (`/dev/tty: No such device`) where flock works. Now
    it is in the supervisor's session, and the foreground job (Ctrl-C and prompts reach it)."""
    code = (
        f"import sys\n{OLD_SPAWN if planted else ''}\nfrom fenced.cli import main\nsys.exit(main())"
    )
    fenced_cmd = shlex.join([sys.executable, "-c", code, "lock", "tty-job", "--url", sqlite_url, *options,
                             "--", "sh", "-c", "tty && : </dev/tty && echo TTY-OK"])  # fmt: skip
    done = subprocess.run(
        ["script", "-qec", fenced_cmd, "/dev/null"],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True, text=True, timeout=60, start_new_session=True,
    )  # fmt: skip
    if planted or options:
        assert "TTY-OK" not in done.stdout, done.stdout  # caught: /dev/tty cannot be opened
        return
    assert "/dev/pts/" in done.stdout and "TTY-OK" in done.stdout, (done.stdout, done.stderr)
    assert done.returncode == 0


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-no-deadline"])
def test_a_fence_command_that_hangs_is_killed_at_its_deadline(
    tmp_path: Path, sqlite_url: str, planted: bool
) -> None:
    """Bug: `--fence-cmd 'sleep 3600' --fence-timeout 2` was never timed out: leadership was
    renewed for ever, the command never started, no exit 79. Now the fence command's whole
    process group is killed at the deadline and fenced elect exits 79. (A deadline of 1 s
    here: the claim is that there is one, not its size.)"""
    pids, started = tmp_path / "fence-pids", tmp_path / "started"
    fence = f"sleep 3600 & echo $$ $! > {pids}.tmp && mv {pids}.tmp {pids}; wait"
    proc = cli(
        ["elect", "svc", "--url", sqlite_url, "--ttl", "2", "--term-grace", "0.5",
         "--fence-cmd", fence, "--fence-timeout", "1", "--", "touch", str(started)],
        OLD_FENCE if planted else "",
    )  # fmt: skip
    members: list[int] = []
    try:
        members = _read_pids(pids)
        if planted:
            # (4× the 1 s deadline, counted from the fence command's start: fenced's own run
            # exits about 1 s after it; waiting the fenced case's 15 s bound proves no more)
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(4)
            assert all(alive(p) for p in members)  # caught: the fence command runs on
            return
        assert proc.wait(15) == 79
        assert not any(alive(p) for p in members)
        assert not started.exists()
        assert proc.stderr is not None and "not starting the command" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _kill_all(members)


def _env_of(path: Path) -> dict[str, str]:
    wait_for(path.exists, timeout=30, what=path.name)
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.startswith("FENCED_"))


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-no-record"])
def test_every_successor_knows_whom_to_fence(
    tmp_path: Path, sqlite_url: str, planted: bool
) -> None:
    """Bug: FENCED_PREVIOUS_* were empty for a candidate that started after the old lease had
    expired (and for the first leader), so `power-off "$FENCED_PREVIOUS_VALUE"` ran
    `power-off ""`. Now the election's record in the source names the last leader that
    started its command — value, host, supervisor pid, the command's process group, epoch —
    and the first leader is told FENCED_PREVIOUS_KNOWN=0."""
    prelude = NO_RECORD if planted else ""
    a_pids = tmp_path / "a-pids"

    def elect(node: str, command: list[str]) -> subprocess.Popen[str]:
        dump = (
            f"env > {tmp_path}/{node}.env.tmp && mv {tmp_path}/{node}.env.tmp {tmp_path}/{node}.env"
        )
        return cli(
            ["elect", "svc", "--url", sqlite_url, "--value", node, "--ttl", "1",
             "--term-grace", "0.3", "--fence-cmd", dump, "--", *command],
            prelude,
        )  # fmt: skip

    a = elect("a", ["sh", "-c", _group_script(a_pids)])
    b: subprocess.Popen[str] | None = None
    members: list[int] = []
    try:
        members = _read_pids(a_pids)
        first = _env_of(tmp_path / "a.env")
        assert first["FENCED_PREVIOUS_KNOWN"] == "0" and first["FENCED_PREVIOUS_VALUE"] == ""
        os.kill(a.pid, signal.SIGKILL)  # the leader dies; its lease runs out
        a.wait(30)
        with fenced.connect(sqlite_url) as locks:
            wait_for(lambda: locks.status("svc").holder is None, timeout=30, what="expiry")
        b = elect("b", ["true"])  # a candidate that starts after the old lease expired
        env = _env_of(tmp_path / "b.env")
        assert b.wait(30) == 0
        if planted:
            assert env["FENCED_PREVIOUS_VALUE"] == ""  # caught: nobody to fence
            return
        assert env["FENCED_PREVIOUS_KNOWN"] == "1"
        assert env["FENCED_PREVIOUS_VALUE"] == "a"
        assert env["FENCED_PREVIOUS_PID"] == str(a.pid)
        assert env["FENCED_PREVIOUS_PGID"] == str(members[0])  # the shell leads its group
        assert env["FENCED_PREVIOUS_HOST"] == os.uname().nodename
        assert int(env["FENCED_PREVIOUS_EPOCH"]) < int(env["FENCED_EPOCH"])
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        _kill_all(members)


def test_lock_exits_75_when_the_lease_was_lost_before_a_short_command_ended(
    tmp_path: Path, sqlite_url: str
) -> None:
    """Bug: `fenced lock rf2 --ttl 30 -- sh -c 'sleep 3'`, `fenced release --force rf2`
    meanwhile and a second holder: the first still exited 0 (a warning only), because no
    renewal fell inside the command. The library raises LeaseLostError here; the CLI exits 75.
    The other side: a command that ends with its lease held exits with its own status."""
    started, go = tmp_path / "started", tmp_path / "go"
    script = f"touch {started}; while [ ! -e {go} ]; do sleep 0.02; done; exit 0"
    proc = cli(["lock", "rf2", "--url", sqlite_url, "--ttl", "30", "--", "sh", "-c", script])
    try:
        wait_for(started.exists, timeout=30, what="the command to start")
        with fenced.connect(sqlite_url) as locks:
            assert locks.force_release("rf2") is not None
            with locks.lock("rf2", ttl=30, timeout=10):  # a second holder runs
                go.touch()
                assert proc.wait(30) == 75
        assert proc.stderr is not None and "lost" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    started.unlink()
    kept = cli(["lock", "rf2", "--url", sqlite_url, "--ttl", "30", "--", "sh", "-c", script])
    wait_for(started.exists, timeout=30, what="the command to start")
    assert kept.wait(30) == 0


@pytest.mark.parametrize("command", ["lock", "elect", "release", "status"])
def test_a_source_that_cannot_exclude_another_process_is_refused(command: str) -> None:
    """Bug: `fenced lock --url memory://x` in two processes: both held `m` with token m:1.
    A source whose locks live inside one process is refused (exit 2, one line), nothing run;
    so are `release` and `status`, which could only see their own empty process."""
    extra = {"elect": ["--no-fence"], "release": ["--force"]}.get(command, [])
    tail = [] if command in ("release", "status") else ["--", "sh", "-c", "echo RAN"]
    done = subprocess.run(
        [sys.executable, "-m", "fenced", command, "m", "--url", "memory://x", *extra, *tail],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "RAN" not in done.stdout
    assert len(done.stderr.strip().splitlines()) == 1 and "one process" in done.stderr


def test_fenced_write_never_claims_a_shared_directory(tmp_path: Path, sqlite_url: str) -> None:
    """Bug: `fenced write /tmp/report.txt` (the README's example with TMPDIR unset) put the
    files guard's mark on /tmp: all of /tmp belonged to one lock, for every user, and the next
    job's `fenced write /tmp/other.txt` was refused. A world-writable or sticky directory is
    refused (exit 2, nothing written); a directory of one's own is written."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FENCING_TOKEN": "reports:1"}
    refused = subprocess.run(
        [sys.executable, "-m", "fenced", "write", str(shared / "report.txt")],
        input="data", env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "shared" in refused.stderr, refused.stderr
    assert list(shared.iterdir()) == []
    own = tmp_path / "own"
    own.mkdir(mode=0o755)
    written = subprocess.run(
        [sys.executable, "-m", "fenced", "write", str(own / "report.txt")],
        input="data", env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert written.returncode == 0, written.stderr
    assert (own / "report.txt" / "current").read_text() == "data"
