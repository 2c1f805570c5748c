"""fenced used by several real Unix users: the CLI's machine-wide default, read-only status."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import fenced
from fenced._core.paths import machine_database
from tests.helpers import PROCESS_START, ROOT, wait_for

USERS = ("fenced-test-a", "fenced-test-b")


def test_the_directory_and_file_are_made_for_every_user(tmp_path: Path) -> None:
    directory = tmp_path / "machine"
    old = os.umask(0o077)  # the strictest umask a user may have
    try:
        path = Path(machine_database(str(directory)))
    finally:
        os.umask(old)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o1777
    assert stat.S_IMODE(path.stat().st_mode) == 0o666
    assert machine_database(str(directory)) == str(path)  # found again, and accepted


def test_what_is_found_is_checked_not_trusted(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o1777)
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    with pytest.raises(fenced.ConfigurationError, match="not a directory"):
        machine_database(str(link))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(fenced.ConfigurationError, match="chmod 1777"):
        machine_database(str(private))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    (shared / "locks.db").symlink_to(tmp_path / "target.db")
    with pytest.raises(fenced.ConfigurationError, match="not a regular file"):
        machine_database(str(shared))
    assert not (tmp_path / "target.db").exists()


# -- two real Unix users -------------------------------------------------------------------


def _python_for_others() -> str | None:
    """An interpreter other users can run (this one may live under /root)."""
    for candidate in (sys.executable, "/usr/bin/python3"):
        try:
            probe = subprocess.run(
                [candidate, "-c", "import sys; assert sys.version_info >= (3, 11)"],
                user=USERS[0],
                capture_output=True,
            )
        except OSError:  # not even executable by that user
            continue
        if probe.returncode == 0:
            return candidate
    return None


@pytest.fixture(scope="module")
def two_users() -> Iterator[None]:
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to make two real users")
    for user in USERS:
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user],
                check=True,
            )
    yield


@pytest.fixture
def shared_root(two_users: None, tmp_path: Path) -> Iterator[Path]:
    """A world-readable copy of fenced (this checkout may be private to root) and a place
    for the machine directory, which fenced itself makes."""
    root = Path("/tmp") / f"fenced-two-users-{os.getpid()}-{tmp_path.name}"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    shutil.copytree(ROOT / "src" / "fenced", root / "lib" / "fenced")
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o644)
    root.chmod(0o1777)  # as /var/tmp, where users may make the machine directory
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _fenced_as(
    user: str, python: str, root: Path, *args: str, per_user: bool = False, **kw: object
) -> subprocess.Popen[str]:
    machine = root / (f"machine-{user}" if per_user else "machine")
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(root / "lib"),
        "_FENCED_MACHINE_DIR": str(machine),
        "HOME": "/nonexistent",
    }
    return subprocess.Popen(
        [python, "-m", "fenced", *args],
        user=user,
        env=env,
        cwd=str(root),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("per_user", [False, True], ids=["fenced", "planted-per-user-default"])
def test_two_users_share_the_default_and_exclude_each_other(
    shared_root: Path, per_user: bool
) -> None:
    """Bug: the default was per user, so root's cron job and the app's user both held the
    same lock with token 1. Now the first user's holder keeps the second user out, and the
    second user's grant comes after, with a higher token. (The planted variant gives each
    user a file of their own, as before, and must be caught.)"""
    python = _python_for_others()
    if python is None:
        pytest.skip("no Python >= 3.11 that the test users may run")
    a, b = USERS
    ready = shared_root / "a-holds"
    release = shared_root / "a-may-go"
    holder = _fenced_as(
        a,
        python,
        shared_root,
        "lock",
        "--ttl",
        "30",
        "nightly",
        "--",
        "sh",
        "-c",
        f'echo "$FENCING_TOKEN" > {ready}; while [ ! -e {release} ]; do sleep 0.02; done',
    )
    try:
        wait_for(
            lambda: ready.exists() and ready.read_text().strip(), PROCESS_START, "user a to hold"
        )
        assert ready.read_text().strip() == "nightly:1"
        refused = _fenced_as(
            b, python, shared_root, "lock", "-n", "nightly", "--", "true", per_user=per_user
        )
        _, err = refused.communicate(timeout=30)
        if per_user:
            assert refused.returncode == 0  # both "hold" nightly: the planted bug is caught
            return
        assert refused.returncode == 124, err  # b is kept out while a holds it
        release.touch()
        assert holder.wait(30) == 0, holder.stderr.read() if holder.stderr else ""
    finally:
        release.touch()
        holder.kill()
        holder.wait(10)
    second = _fenced_as(
        b, python, shared_root, "lock", "nightly", "--", "sh", "-c", 'echo "$FENCING_TOKEN"'
    )
    out, err = second.communicate(timeout=30)
    assert second.returncode == 0, err
    assert out.strip() == "nightly:2"  # one counter for both users
    machine = shared_root / "machine"
    owners = {p.name: pwd.getpwuid(p.stat().st_uid).pw_name for p in machine.iterdir()}
    assert owners["locks.db"] == a  # a made it; b could use it
    assert stat.S_IMODE(machine.stat().st_mode) == 0o1777


@pytest.mark.parametrize("writer_open", [True, False], ids=["writer-open", "no-writer"])
def test_status_works_for_a_user_who_can_only_read(shared_root: Path, writer_open: bool) -> None:
    """Bug: `fenced status` failed on a database the user could read but not write (a
    monitoring user). It now reads it, and refuses only to take a lock, with a usage error."""
    python = _python_for_others()
    if python is None:
        pytest.skip("no Python >= 3.11 that the test users may run")
    private = shared_root / "owned-by-root"
    private.mkdir(mode=0o755)
    private.chmod(0o755)
    db = private / "locks.db"
    url = f"sqlite:///{db}"
    with fenced.connect(url) as locks:
        with locks.lock("nightly", ttl=5):
            pass
        held = locks.lock("reports", ttl=60)
        held.acquire()
        if not writer_open:
            held.release()
            locks.close()  # the -wal and -shm files go away with the last writer
            assert not (private / "locks.db-wal").exists()
        db.chmod(0o644)
        status = _fenced_as(USERS[0], python, shared_root, "status", "--json", "--url", url)
        out, err = status.communicate(timeout=30)
        assert status.returncode == 0, err
        shown = {entry["name"]: entry for entry in json.loads(out)}
        assert shown["nightly"]["last_token"] == "nightly:1"
        assert shown["reports"]["held"] is writer_open
        taking = _fenced_as(USERS[0], python, shared_root, "lock", "x", "--url", url, "--", "true")
        _, err = taking.communicate(timeout=30)
        assert taking.returncode == 2 and "read-only" in err, err


def test_a_place_the_user_may_not_write_is_refused_at_once(shared_root: Path) -> None:
    """Bug: a database in a directory the user may not write (or a file it may not read) was
    retried for the whole connect_timeout (10 s) before BackendUnavailable. A real user, not
    root (for whom every permission check passes): a one-line ConfigurationError at once."""
    python = _python_for_others()
    if python is None:
        pytest.skip("no Python >= 3.11 that the test users may run")
    private = shared_root / "root-only"
    private.mkdir(mode=0o755)
    private.chmod(0o755)
    unreadable = private / "unreadable.db"
    with fenced.connect(f"sqlite:///{unreadable}"):
        pass
    unreadable.chmod(0o600)
    probe = (
        "import sys, time, fenced\n"
        "started = time.monotonic()\n"
        "try:\n"
        "    fenced.connect('sqlite:///' + sys.argv[1])\n"
        "except fenced.ConfigurationError as exc:\n"
        "    print(round(time.monotonic() - started, 2), exc)\n"
    )
    for target in (private / "new.db", unreadable):
        done = subprocess.run(
            [python, "-c", probe, str(target)],
            user=USERS[0],
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(shared_root / "lib")},
            cwd=str(shared_root),
            capture_output=True,
            text=True,
            timeout=60,
        )
        took, _, message = done.stdout.strip().partition(" ")
        assert message, (target, done.stdout, done.stderr)
        assert float(took) < 3 and "cannot be opened by this user" in message, message
    assert not (private / "new.db").exists()
