"""The ``fenced`` command, run as real processes against the embedded SQLite source."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import fenced
from tests.helpers import PROCESS_START, ROOT, wait_for

FENCED = [sys.executable, "-m", "fenced"]
FENCED_SHELL = f"{sys.executable} -m fenced"  # the same, inside `sh -c`


# Commands that start no child run in this process (main(), as `python -m fenced` calls it):
# a `python -m fenced` costs ~0.3 s of CPU to start, and the claims here are the command's
# exit status and words. `lock` and `write` (a child, stdin) run as real processes, as does
# each other command at least once (process=True), and every test that signals one. A
# `lock` that must end before its command starts (usage errors, timeouts, an unreachable
# source) is asked for in-process with process=False.


def run(
    args: list[str],
    url: str,
    env_extra: dict[str, str] | None = None,
    *,
    process: bool | None = None,
    **kw: object,
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, FENCED_URL=url, **(env_extra or {}))
    if process is None:
        process = kw != {} or args[0] in ("lock", "write")
    if not process:
        return _in_process(args, env)
    return subprocess.run(FENCED + args, env=env, capture_output=True, text=True, timeout=60, **kw)  # type: ignore[call-overload, no-any-return]


def _in_process(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """main(args) with ``env`` as the environment: its exit status, stdout and stderr."""
    from fenced.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_env, root = dict(os.environ), logging.getLogger()
    saved_log = (root.level, list(root.handlers))
    os.environ.clear()
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as exc:  # (argparse's usage errors, --version)
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        root.setLevel(saved_log[0])  # (main() sets the CLI's handler and level on the root)
        for handler in [h for h in root.handlers if h not in saved_log[1]]:
            root.removeHandler(handler)
    return subprocess.CompletedProcess(["fenced", *args], code, out.getvalue(), err.getvalue())


def test_lock_exports_token_and_passes_exit_code(sqlite_url: str) -> None:
    out = run(
        ["lock", "job", "--ttl", "5", "--", "sh", "-c", 'echo "$FENCING_TOKEN"; exit 7'], sqlite_url
    )
    assert out.returncode == 7, out.stderr
    first = fenced.FencingToken.parse(out.stdout.strip(), lock="job")
    out = run(["lock", "job", "--", "sh", "-c", 'echo "$FENCING_TOKEN $FENCED_LOCK"'], sqlite_url)
    assert out.returncode == 0, out.stderr
    token, lock = out.stdout.split()
    assert fenced.FencingToken.parse(token, lock="job") > first and lock == "job"
    with fenced.connect(sqlite_url) as locks:
        assert locks.status("job").holder is None  # released on exit


def test_lock_timeout_has_its_own_exit_status(sqlite_url: str) -> None:
    """Bug: a lock timeout exited 1, the same as the command's own ``false``."""
    with fenced.connect(sqlite_url) as locks, locks.lock("busy", ttl=30):
        out = run(["lock", "busy", "--timeout", "0.2", "--", "true"], sqlite_url, process=False)
        assert out.returncode == 124 and "not acquired" in out.stderr
        nonblock = run(["lock", "-n", "busy", "--", "true"], sqlite_url, process=False)
        assert nonblock.returncode == 124 and "within 0 s" in nonblock.stderr
        chosen = run(["lock", "busy", "-n", "-E", "9", "--", "true"], sqlite_url, process=False)
        assert chosen.returncode == 9
    assert (
        run(
            ["lock", "busy", "-n", "--timeout", "1", "--", "true"], sqlite_url, process=False
        ).returncode
        == 2
    )
    assert (
        run(["lock", "busy", "-E", "256", "--", "true"], sqlite_url, process=False).returncode == 2
    )
    assert run(["lock", "busy", "--", "false"], sqlite_url).returncode == 1  # the command's


def test_version(sqlite_url: str) -> None:
    out = run(["--version"], sqlite_url, process=True)
    assert out.returncode == 0 and out.stdout.strip() == f"fenced {fenced.__version__}"


def test_the_version_is_cut_in_the_changelog() -> None:
    """The running version has its own dated section, right under an Unreleased one (before:
    0.1.0 while incompatible changes sat under Unreleased)."""
    import re

    headings = re.findall(r"^## (.+)$", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert headings[0] == "Unreleased"
    assert re.fullmatch(rf"{re.escape(fenced.__version__)} - \d{{4}}-\d{{2}}-\d{{2}}", headings[1])
    assert fenced.__version__ != "0.1.0"


def test_lock_usage_errors(sqlite_url: str) -> None:
    assert run(["lock", "x"], sqlite_url, process=False).returncode == 2
    assert (
        run(["lock", "x", "--ttl", "-1", "--", "true"], sqlite_url, process=False).returncode == 2
    )
    bad_name = run(["lock", "bad name", "--", "true"], sqlite_url, process=False)
    assert bad_name.returncode == 2 and "invalid lock name" in bad_name.stderr
    assert run(["lock", "x", "--", "/no/such/command"], sqlite_url).returncode == 127
    bad_url = run(["lock", "x", "--url", "nosuch://x", "--", "true"], sqlite_url, process=False)
    assert bad_url.returncode == 2 and "unknown token source" in bad_url.stderr


def test_lost_lease_terminates_the_command(sqlite_url: str, tmp_path: Path) -> None:
    """SIGSTOP the `fenced lock` process past its ttl: on resume it kills the job and exits 75."""
    marker = tmp_path / "child.pid"
    script = f'echo $$ > {marker}; trap "echo terminated >> {marker}.log; exit 143" TERM; while :; do sleep 0.05; done'
    env = dict(os.environ, FENCED_URL=sqlite_url)
    proc = subprocess.Popen(
        [*FENCED, "lock", "lost", "--ttl", "1", "--grace", "5", "--", "sh", "-c", script],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: marker.exists() and marker.read_text().strip(),
            PROCESS_START,
            "the job to start",
        )
        os.kill(proc.pid, signal.SIGSTOP)
        with fenced.connect(sqlite_url) as locks:
            lease = locks.lock("lost", ttl=10)
            lease.acquire(timeout=20)  # granted once the paused holder's lease expired
            os.kill(proc.pid, signal.SIGCONT)
            assert proc.wait(30) == 75
            assert lease.held  # the old holder's exit did not free the new grant
            lease.release()
        assert "lost" in proc.stderr.read()  # type: ignore[union-attr]
        assert (tmp_path / "child.pid.log").read_text().strip() == "terminated"
        child = int(marker.read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()


def test_status(sqlite_url: str) -> None:
    with fenced.connect(sqlite_url) as locks, locks.lock("s1", ttl=30) as lease:
        out = run(["status", "s1", "--json"], sqlite_url)
        assert out.returncode == 0, out.stderr
        (data,) = json.loads(out.stdout)  # always a list, even for one name
        assert data["held"] is True and data["token"] == str(lease.token)
        assert data["state"] == "held" and 0 < data["remaining"] <= 30
        table = run(["status", "s1", "s2"], sqlite_url)
        assert table.returncode == 0 and "held" in table.stdout
        # A lock never granted is told apart from one granted and released.
        assert "unused" in table.stdout.splitlines()[2]


def test_status_of_unreachable_source() -> None:
    # (--timeout 1: the default 10 s is the same retry loop, waited ten times longer)
    out = run(
        ["status", "x", "--timeout", "1"],
        "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1",
        process=True,
    )
    assert out.returncode == 69, (out.returncode, out.stderr)


@pytest.mark.parametrize(
    "option",
    [
        ["--ttl", "0.001"],
        ["--ttl", "0"],
        ["--ttl", "-1"],
        ["--ttl", "inf"],
        ["--ttl", "1e400"],
        ["--ttl", "nan"],
        ["--ttl", "1e12"],
        ["--ttl", "ten"],
        ["--timeout", "-1"],
        ["--timeout", "nan"],
        ["--timeout", "1e300"],
        ["--grace", "inf"],
    ],
)
def test_absurd_numbers_are_usage_errors_before_anything_runs(
    sqlite_url: str, tmp_path: Path, option: list[str]
) -> None:
    """Exit 2 with one line on stderr, and the command never starts (before: --ttl 0.001 ran
    it under a lease that was already lost, then exited 75)."""
    marker = tmp_path / "ran"
    out = run(["lock", "job", *option, "--", "touch", str(marker)], sqlite_url, process=False)
    assert out.returncode == 2, out
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert not marker.exists()


def test_help_documents_every_exit_status() -> None:
    out = subprocess.run([*FENCED, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for code in ("0", "2", "69", "70", "75", "124", "126", "127", "130"):
        assert f"  {code} " in out.stdout or f": {code}" in out.stdout, code


@pytest.mark.parametrize(
    "url",
    [
        "redis://[::1",
        "postgresql://[",
        "etcd://[::1",
        "redis://127.0.0.1:99999/0",
        "memory://x?bogus=1",
        "redis://127.0.0.1:6379/abc",
        "redis://127.0.0.1:6379/0?socket_timeout=-1",
        "redis://127.0.0.1:6379/0?socket_timeout=1&socket_timeout=2",
        "postgresql://u@127.0.0.1:5432/db?no_such_libpq_option=1",
        "sqlite:////tmp/x.db?waiter_ttl=soon",
        "zookeeper://127.0.0.1:2181/a/\x01b",
        "nosuch://x",
    ],
)
def test_bad_urls_are_usage_errors_on_one_line(sqlite_url: str, url: str) -> None:
    url = url.replace("\\x01", "\x01")
    for args in (
        ["lock", "x", "--url", url, "--timeout", "5", "--", "true"],
        ["status", "--url", url],
    ):
        out = run(args, sqlite_url, process=False)  # (refused before any child)
        assert out.returncode == 2, (url, out)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert out.stderr.startswith("fenced: ")


def test_status_lists_every_lock_the_source_knows(sqlite_url: str) -> None:
    with fenced.connect(sqlite_url) as locks:
        with locks.lock("alpha", ttl=30):
            pass
        held = locks.lock("beta", ttl=30)
        held.acquire()
        out = run(["status"], sqlite_url)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split()[:3] == ["LOCK", "STATE", "TOKEN"]
        rows = {line.split()[0]: line.split() for line in lines[1:]}
        assert rows["alpha"][1] == "free" and rows["beta"][1] == "held"
        assert rows["beta"][2] == str(held.token)
        listed = json.loads(run(["status", "--json"], sqlite_url).stdout)
        assert [entry["name"] for entry in listed] == ["alpha", "beta"]
        (one,) = json.loads(run(["status", "--json", "beta"], sqlite_url).stdout)
        assert one["token"] == str(held.token) and one["held"] is True
        held.release()
    assert run(["status", "bad name"], sqlite_url).returncode == 2


def test_status_of_an_empty_source(tmp_path: Path) -> None:
    out = run(["status"], f"sqlite:///{tmp_path}/empty.db")
    assert out.returncode == 0 and "no locks known" in out.stdout


# `fenced` with the time its main() took written to a file: the interpreter's start and the
# imports of fenced and the source's client library come before the deadline is set (on a
# loaded machine they took 2-8 s: redis-py's import alone 1 s).
_TIMED_CLI = (
    "import sys, time\n"
    "from fenced.cli import main\n"
    "import fenced.backends.redis, fenced.backends.postgresql, fenced.backends.zookeeper\n"
    "start = time.monotonic()\n"
    "try:\n"
    "    code = main(sys.argv[2:])\n"
    "finally:\n"
    "    open(sys.argv[1], 'w').write(repr(time.monotonic() - start))\n"
    "sys.exit(code)\n"
)


def test_unreachable_source_honours_the_timeout_with_one_line(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Redis/PostgreSQL gave up after 0.4 s, etcd took 5.3 s and ZooKeeper 10.2 s with
    --timeout 3 (printing 16-19 client log lines); each now retries until the deadline."""
    took_file = tmp_path / "took"
    timed = [sys.executable, "-c", _TIMED_CLI, str(took_file)]
    for url in (
        "redis://127.0.0.1:1/0",
        "postgresql://u@127.0.0.1:1/db",
        "zookeeper://127.0.0.1:1",
    ):
        # (1 s: the early give-ups took 0.4 s; ZooKeeper overran a 3 s deadline by 7 s)
        args = ["lock", "x", "--url", url, "--timeout", "1", "--", "true"]
        out = subprocess.run(
            timed + args, env=dict(os.environ, FENCED_URL=sqlite_url), capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
        took = float(took_file.read_text())
        assert out.returncode == 69, out
        assert 0.9 <= took <= 3.0, (url, took)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        verbose = run(  # (in this process: it gives up before any child)
            ["lock", "-v", "x", "--url", url, "--timeout", "0.5", "--", "true"],
            sqlite_url,
            process=False,
        )
        assert verbose.returncode == 69 and len(verbose.stderr.splitlines()) > 1


# -- the CLI -----------------------------------------------------------------------------------

_CLI_WITH_TEST_SOURCE = (
    "import sys\n"
    "from fenced._core import backend as _backend\n"
    "_backend.register_backend('goneaftergrant', 'tests.sources.variants:GoneAfterGrantSource')\n"
    "from fenced.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def _fenced_lock(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    return subprocess.run(
        [sys.executable, "-c", _CLI_WITH_TEST_SOURCE, "lock", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_lost_lease_exits_75_even_if_release_fails() -> None:
    """Bug: the failed release in ``finally`` replaced the documented 75 with 69."""
    out = _fenced_lock(
        ["x", "--url", "goneaftergrant://cli", "--ttl", "0.5", "--grace", "1", "--", "sleep", "30"]
    )
    assert out.returncode == 75, (out.returncode, out.stderr)
    assert "lost" in out.stderr


def test_cli_keeps_the_commands_status_if_only_the_release_fails() -> None:
    """The command ran to its end with the lease held: its status counts, with a warning."""
    out = _fenced_lock(["x", "--url", "goneaftergrant://cli", "--", "sh", "-c", "exit 3"])
    assert out.returncode == 3, (out.returncode, out.stderr)
    assert "release" in out.stderr


@pytest.mark.usefixtures("sigint_raises")
def test_cli_ctrl_c_right_after_the_command_started_stops_the_command(
    monkeypatch: pytest.MonkeyPatch, sqlite_url: str
) -> None:
    """Bug: the signal handlers were installed only after the command started: a Ctrl-C in
    between ended `fenced lock` (releasing the lock) and left the command running unlocked.
    The Ctrl-C is delivered deterministically, the instant Popen returns."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    from fenced import cli

    started: list[subprocess.Popen[bytes]] = []

    class InterruptedRightAfterStart(subprocess.Popen[bytes]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(subprocess, "Popen", InterruptedRightAfterStart)
    code: int | None = None
    try:
        try:
            code = cli.main(["lock", "x", "--url", sqlite_url, "--", "sleep", "30"])
        except KeyboardInterrupt:
            code = None
        assert started
        assert started[0].poll() is not None, "the command was left running without the lock"
        assert code == 128 + signal.SIGINT  # it was passed the Ctrl-C, and died of it
        with fenced.connect(sqlite_url) as locks:
            assert locks.status("x").holder is None
    finally:
        for child in started:
            if child.poll() is None:
                child.kill()
                child.wait()


@pytest.mark.parametrize("planted", [False, True], ids=["fenced", "planted-close-before-dequeue"])
def test_ctrl_c_while_waiting_exits_130_quietly_and_leaves_the_queue(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, planted: bool
) -> None:
    """Bug: Ctrl-C on a waiting `fenced lock` printed a KeyboardInterrupt traceback (and the
    close marked the connection closed before the waiter left the queue, so its row stayed
    until it expired). Ctrl-C as a terminal sends it: SIGINT to the foreground group, with
    stdout and stderr on a pseudo-terminal."""
    import pty

    # A long waiter_ttl: the planted bug's row must still be there when it is looked for.
    env = dict(os.environ, FENCED_URL=f"{sqlite_url}?waiter_ttl=30")
    # Ctrl-C must reach it as from a terminal even if this test run started with SIGINT
    # ignored (`make test &`), which the CLI would inherit (and keep: it was told to).
    sigint = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    env["PYTHONPATH"] = f"{ROOT / 'src'}{os.pathsep}{ROOT}"
    plant = (  # the waiter's row is left to expire, as before the fix
        "from fenced.backends import sqlite as s; "
        "s.SQLiteBackend._forget = lambda self, name, rid: None; "
    )
    code = f"{sigint}{plant if planted else ''}import sys; from fenced.cli import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", code]
    master, slave = pty.openpty()
    with fenced.connect(sqlite_url) as locks, locks.lock("busy", ttl=30):
        proc = subprocess.Popen(
            [*command, "lock", "busy", "--", "true"],
            env=env,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        os.close(slave)
        try:
            wait_for(lambda: locks.status("busy").waiters == 1, PROCESS_START, "the CLI to queue")
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(30) == 130
        finally:
            if proc.poll() is None:
                proc.kill()
        output = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(master, 4096):
                output += chunk
        os.close(master)
        waiters = locks.status("busy").waiters
    if planted:
        assert waiters == 1  # the row outlives the interrupted waiter: caught
        return
    assert b"Traceback" not in output and output.strip() == b"", output
    assert waiters == 0


def test_fenced_write_fences_a_shell_job_end_to_end(sqlite_url: str, tmp_path: Path) -> None:
    """`fenced lock` jobs fenced without Python: `fenced write DIR/NAME` stores stdin as a
    version with $FENCING_TOKEN; an older token is refused (exit 77, nothing written)."""
    target = tmp_path / "daily.csv"
    job = f"echo first | {FENCED_SHELL} write {target}"
    out = run(["lock", "reports", "--", "sh", "-c", job], sqlite_url)
    assert out.returncode == 0, out.stderr
    out = run(["lock", "reports", "--", "sh", "-c", job.replace("first", "second")], sqlite_url)
    assert out.returncode == 0, out.stderr
    assert (target / "current").read_text() == "second\n"
    stale = run(["write", str(target), "--token", "reports:1"], sqlite_url, input="stale\n")
    assert stale.returncode == 77 and "refused" in stale.stderr and "reports:2" in stale.stderr
    assert (target / "current").read_text() == "second\n"
    assert len(list(target.glob("0*"))) == 2  # nothing written by the stale writer
    no_token = run(["write", str(target)], sqlite_url, input="x")
    assert no_token.returncode == 2 and "token" in no_token.stderr


def test_release_force_frees_a_stuck_holder(sqlite_url: str) -> None:
    """An operator frees a lock held by a stuck process: `fenced release --force NAME`,
    optionally only if a given grant still holds it; without --force it refuses."""
    with fenced.connect(sqlite_url) as locks:
        stuck = locks.lock("nightly", ttl=30, description="stuck job")
        token = stuck.acquire()
        refused = run(["release", "nightly"], sqlite_url, process=True)
        assert refused.returncode == 2 and "--force" in refused.stderr
        other = run(["release", "--force", "nightly", "--token", "nightly:99"], sqlite_url)
        assert other.returncode == 0 and "not held by nightly:99" in other.stdout
        assert locks.status("nightly").token == token
        out = run(["release", "--force", "nightly"], sqlite_url)
        assert out.returncode == 0, out.stderr
        assert f"released {token}" in out.stdout and "stuck job" in out.stdout
        assert locks.status("nightly").holder is None
        again = run(["release", "--force", "nightly"], sqlite_url)
        assert again.returncode == 0 and "not held" in again.stdout


def test_another_fenced_error_exits_70(sqlite_url: str, tmp_path: Path) -> None:
    """Exit 70 (EX_SOFTWARE) for a fenced error that is none of the others: here a damaged
    mark (a version name the files guard could not have written), which fails closed."""
    target = tmp_path / "report.txt"
    target.mkdir()
    (target / "0000000000000000000.000000").write_bytes(b"?")
    out = run(["write", str(target), "--token", "jobs:5"], sqlite_url, input="x")
    assert out.returncode == 70, out.stderr
    assert "corrupt" in out.stderr.lower() and len(out.stderr.splitlines()) == 1


def test_fenced_write_errors_are_one_line_never_a_traceback(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A file where the resource's directory belongs: exit 2 naming it; a file-system error
    (here the resource's lock file is a directory): exit 70, one line (both were a raw
    traceback and exit 1)."""
    (tmp_path / "report.txt").write_text("a plain file\n")
    out = run(["write", str(tmp_path / "report.txt"), "--token", "jobs:5"], sqlite_url, input="x")
    assert out.returncode == 2 and "not a directory" in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) == 1 and (tmp_path / "report.txt").read_text() != "x"
    (tmp_path / "daily.csv" / ".lock").mkdir(parents=True)
    out = run(["write", str(tmp_path / "daily.csv"), "--token", "jobs:5"], sqlite_url, input="x")
    assert out.returncode == 70 and "write failed" in out.stderr, out.stderr
    assert len(out.stderr.splitlines()) == 1


def test_check_token_exit_statuses(sqlite_url: str) -> None:
    """`fenced check-token`: 0 current, 77 stale, 78 neither, 65 malformed or never issued,
    2 a usage error (before: 2 for both, so a script could not tell them apart)."""
    with fenced.connect(sqlite_url) as locks:
        first = locks.lock("jobs", ttl=30)
        t1 = first.acquire()
        assert run(["check-token", str(t1)], sqlite_url, process=True).returncode == 0
        first.release()
        assert run(["check-token", str(t1)], sqlite_url).returncode == 78
        with locks.lock("jobs", ttl=30) as second:
            stale = run(["check-token", "--json", str(t1)], sqlite_url)
            assert stale.returncode == 77
            doc = json.loads(stale.stdout)
            assert doc["verdict"] == "stale" and doc["highest"] == str(second.token)
        # invalid tokens exit 65 (EX_DATAERR), apart from usage errors (2)
        forged = run(["check-token", "jobs:999999"], sqlite_url)
        assert forged.returncode == 65 and "never-granted" in forged.stdout
        assert run(["check-token", "jobs:0"], sqlite_url).returncode == 65
        assert run(["check-token", "jobs:1", "--no-such-option"], sqlite_url).returncode == 2


def test_quiet_nonblocking_lock_is_silent_for_cron(sqlite_url: str) -> None:
    """`fenced lock -n -q -E 0` while held: exit 0 and nothing on stderr (cron mails any
    output), as `flock -n -E 0`; without -q the line is still there for people; errors are
    never silenced."""
    with fenced.connect(sqlite_url) as locks, locks.lock("cron", ttl=30):
        quiet = run(
            ["lock", "-n", "-q", "-E", "0", "cron", "--", "true"], sqlite_url, process=False
        )
        assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == ""
        loud = run(["lock", "-n", "-E", "0", "cron", "--", "true"], sqlite_url, process=False)
        assert loud.returncode == 0 and "not acquired within 0 s" in loud.stderr
        assert (
            run(
                ["lock", "--quiet", "-n", "cron", "--", "true"], sqlite_url, process=False
            ).returncode
            == 124
        )
    # the rightful run: acquired, the command runs
    ran = run(["lock", "-n", "-q", "-E", "0", "cron", "--", "echo", "ran"], sqlite_url)
    assert ran.returncode == 0 and ran.stdout == "ran\n"
    bad = run(
        ["lock", "-q", "cron", "--url", "nosuch://x", "--", "true"], sqlite_url, process=False
    )
    assert bad.returncode == 2 and "unknown token source" in bad.stderr


def test_url_from_a_file(sqlite_url: str, tmp_path: Path) -> None:
    """--url-file / $FENCED_URL_FILE: the URL out of /proc/PID/cmdline. A file holding a
    password that other users may read is refused (as ssh refuses such a key), without
    printing the password; the same file at mode 600 is used."""
    source = tmp_path / "source.url"
    source.write_text(f"# the nightly jobs' source\n{sqlite_url}\n")
    source.chmod(0o644)  # no password: readable is fine
    env = {k: v for k, v in os.environ.items() if k != "FENCED_URL"}
    out = subprocess.run([*FENCED, "lock", "a", "--url-file", str(source), "--", "true"],
                         env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    with fenced.connect(sqlite_url) as locks:
        assert locks.status("a").last_token is not None  # the file's source was used
    env["FENCED_URL_FILE"] = str(source)
    out = subprocess.run([*FENCED, "status", "--json"], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and json.loads(out.stdout)[0]["name"] == "a", out.stderr

    secret = tmp_path / "secret.url"
    secret.write_text("redis://:hunter2-secret@127.0.0.1:1/0\n")
    secret.chmod(0o640)
    for args, extra in (
        (["status", "--url-file", str(secret)], {}),
        (["status"], {"FENCED_URL_FILE": str(secret)}),
    ):
        out = subprocess.run([*FENCED, *args], env={**env, **extra}, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert "chmod 600" in out.stderr and "hunter2" not in out.stderr + out.stdout
        assert len(out.stderr.splitlines()) == 1
    secret.chmod(0o600)  # now it is read, and the source tried (nothing listens on port 1)
    out = subprocess.run([*FENCED, "status", "--timeout", "1", "--url-file", str(secret)],
                         env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 69 and "hunter2" not in out.stderr, out.stderr
    assert f"(token source from --url-file {secret})" in out.stderr
    both = subprocess.run([*FENCED, "status"], env={**env, "FENCED_URL": sqlite_url},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert both.returncode == 2 and "unset one" in both.stderr
    two = tmp_path / "two.url"
    two.write_text(f"{sqlite_url}\n{sqlite_url}\n")
    out = run(["status", "--url-file", str(two)], sqlite_url)
    assert out.returncode == 2 and "one token source URL" in out.stderr
    assert run(["status", "--url", sqlite_url, "--url-file", str(two)], sqlite_url).returncode == 2


def test_errors_name_the_environment_variable_that_caused_them(tmp_path: Path) -> None:
    out = run(["status"], "nosuch://x")
    assert out.returncode == 2 and "(token source from $FENCED_URL)" in out.stderr, out.stderr
    out = run(["lock", "x", "--timeout", "1", "--", "true"], "redis://127.0.0.1:1/0", process=False)
    assert out.returncode == 69 and "$FENCED_URL" in out.stderr, out.stderr
    # given on the command line, or not about the source: no mention of the variable
    out = run(["status", "--url", "nosuch://x"], f"sqlite:///{tmp_path}/l.db")
    assert out.returncode == 2 and "FENCED_URL" not in out.stderr
    out = run(["lock", "bad name", "--", "true"], f"sqlite:///{tmp_path}/l.db", process=False)
    assert out.returncode == 2 and "FENCED_URL" not in out.stderr
    out = run(
        ["group", "status", "g", "--member", "a=sqlite:///rel.db"], f"sqlite:///{tmp_path}/l.db"
    )
    assert out.returncode == 2 and "FENCED_URL" not in out.stderr, out.stderr
    # the key variables likewise, and a missing file in words, not as Python's exception
    for command, variable in (
        (["lock", "x", "--", "true"], "FENCED_SIGNING_KEY"),
        (["check-token", "x:1"], "FENCED_SIGNING_KEY"),
        (["check-token", "x:1"], "FENCED_VERIFY_KEY"),
    ):
        out = run(
            command, f"sqlite:///{tmp_path}/l.db", env_extra={variable: "/no/such.key"},
            process=False,
        )  # fmt: skip
        assert out.returncode == 2 and f"${variable}" in out.stderr, out.stderr
        assert "cannot read the key file" in out.stderr and "/no/such.key" not in out.stderr
        assert "FENCED_URL" not in out.stderr and "Errno" not in out.stderr, out.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--listen", "127.0.0.1:0", "--signing-key", "KEY"],
        ["serve", "--listen", "127.0.0.1:0", "--signing-key", "FILE", "--verify-key", "KEY"],
        ["check-token", "--verify-key", "KEY", "x:1"],
        ["lock", "x", "--signing-key", "KEY", "--", "true"],
    ],
)
def test_a_key_given_as_text_on_the_command_line_is_refused_unshown(
    sqlite_url: str, tmp_path: Path, args: list[str]
) -> None:
    """A key's text where a key file goes is on every local user's `ps`: refused, one line
    naming the flag and the variable to use, the secret never echoed (an outside tester saw
    serve's --verify-key error print the whole HMAC secret)."""
    key = tmp_path / "k"
    assert run(["keygen", "hmac", "k1", str(key)], sqlite_url, process=True).returncode == 0
    text = key.read_text().strip()
    given = [text if a == "KEY" else str(key) if a == "FILE" else a for a in args]
    out = run(given, sqlite_url, process=False)
    assert out.returncode == 2, out.stderr
    assert "takes a key file, not the key itself" in out.stderr, out.stderr
    assert text.split()[-1] not in out.stderr + out.stdout
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_log_lines_say_fenced_once(sqlite_url: str, tmp_path: Path) -> None:
    """Bug: `fenced: fenced: signing without source_id ...` (the logger's name repeated)."""
    key = tmp_path / "k"
    assert run(["keygen", "hmac", "k1", str(key)], sqlite_url, process=True).returncode == 0
    env = {k: v for k, v in os.environ.items() if k != "FENCED_SOURCE_ID"}
    env["FENCED_URL"] = sqlite_url
    out = subprocess.run([*FENCED, "lock", "a", "--signing-key", str(key), "--", "true"],
                         env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith("fenced: signing without"), out.stderr
    assert "fenced: fenced" not in out.stderr


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["lock", "x", "--timeout", "1e9", "--", "true"], "a timeout is 0 to 31536000 seconds"),
        (["lock", "x", "--timeout", "-1", "--", "true"], "not '-1'"),
        (["status", "--timeout", "-3"], "a timeout is 0 to"),
        (["lock", "x", "--ttl", "0", "--", "true"], "a ttl is 0.1 to 86400 seconds, not '0'"),
        (["poison", ".", "x", "--epoch", "seven"], "not a whole number: 'seven'"),
    ],
)
def test_cli_messages_speak_no_python(sqlite_url: str, args: list[str], words: str) -> None:
    """Bug: `timeout must be None or a number ... not 1000000000.0` (None, a float's repr)."""
    out = run(args, sqlite_url, process=False)  # (refused before any child)
    assert out.returncode == 2 and words in out.stderr, out.stderr
    for python in ("None", "int value", "float value", ".0 "):
        assert python not in out.stderr, out.stderr


def test_keygen_without_a_key_id(sqlite_url: str, tmp_path: Path) -> None:
    """`fenced keygen hmac FILE`, as the top-level help shows it: a key with a fresh id."""
    made = []
    for name in ("a.key", "b.key"):
        out = run(["keygen", "hmac", str(tmp_path / name)], sqlite_url)
        assert out.returncode == 0, out.stderr
        kid = (tmp_path / name).read_text().split()[3]
        assert kid in out.stdout
        made.append(kid)
    assert made[0] != made[1]  # two keys of one day: apart, so they can rotate
    out = run(["keygen", "ed25519", "ops-1", str(tmp_path / "e.key")], sqlite_url)
    assert out.returncode == 0 and (tmp_path / "e.key.pub").read_text().split()[3] == "ops-1"
    assert run(["keygen", "hmac", str(tmp_path / "a.key")], sqlite_url).returncode == 2


def test_a_password_in_the_query_is_never_printed(sqlite_url: str) -> None:
    """libpq takes ?password=: masked like user:password@ in every message."""
    for url in ("memory://x?password=hunter2-secret", "memory://x?a=1&PWD=hunter2-secret"):
        out = run(["status", "--url", url], sqlite_url)
        assert out.returncode == 2 and "memory://x?" in out.stderr, out.stderr
        assert "hunter2" not in out.stderr + out.stdout


def test_group_members_urls_from_files_and_never_their_passwords(
    sqlite_url: str, tmp_path: Path
) -> None:
    """`fenced group --member NAME=@FILE`: a member's URL (and password) off the command line,
    with the same rule as --url-file; a bad member URL never prints its password."""
    member = tmp_path / "a.url"
    member.write_text("redis://:hunter2-secret@127.0.0.1:1/0\n")
    member.chmod(0o644)
    out = run(["group", "status", "g", "--member", f"a=@{member}"], sqlite_url, process=True)
    assert out.returncode == 2 and "chmod 600" in out.stderr, out.stderr
    assert "hunter2" not in out.stderr
    db = tmp_path / "a.db"
    sqlite3.connect(db).close()
    member.write_text(f"sqlite:///{db}\n")
    out = run(["group", "status", "g", "--member", f"a=@{member}"], sqlite_url)
    assert out.returncode == 0, out.stderr
    # (a mysql:// member is valid: a malformed one, and a spec without its name, are not)
    for spec in ("a=mysql://u:hunter2-secret@[h/db", "redis://:hunter2-secret@h"):
        out = run(["group", "status", "g", "--member", spec], sqlite_url)
        assert out.returncode == 2 and "hunter2" not in out.stderr, out.stderr


def test_keygen_refused_for_an_existing_pub_leaves_no_half_made_key(tmp_path: Path) -> None:
    """`FILE.pub` exists: refused (exit 2) before the private key is written, so a second try
    does not find a lone private key in the way."""
    (tmp_path / "k.pub").write_text("someone else's\n")
    out = subprocess.run(
        [*FENCED, "keygen", "ed25519", str(tmp_path / "k")], capture_output=True, text=True
    )
    assert out.returncode == 2 and "k.pub exists" in out.stderr, out.stderr
    assert not (tmp_path / "k").exists()
