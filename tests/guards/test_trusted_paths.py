"""Trusted paths (sshd's StrictModes rule) for the file guards and key files: the reproductions
of the third outside attack (another user, uid 65534, controlling a directory on the path), and
the legitimate set-ups that must still work. Run as root (chown, setuid children)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import fenced
from fenced import ConfigurationError, StaleTokenError
from fenced._core.paths import require_trusted_path
from fenced._core.signing import generate_key, key_text, load_key
from fenced.guards.files import FileGuard, HighWaterFile

NOBODY = 65534
SRC = str(Path(fenced.__file__).resolve().parents[1])  # (the fenced under test, in children)
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown and setuid")
pytestmark = as_root


@pytest.fixture
def base() -> Iterator[Path]:
    """A root-owned 0755 directory under /tmp (sticky, root's): a trusted path others can
    enter (pytest's tmp_path is 0700: nobody could not act there)."""
    path = Path(tempfile.mkdtemp(prefix="fenced-trusted-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _theirs(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(mode=mode)
    path.chmod(mode)
    os.chown(path, NOBODY, NOBODY)
    return path


def _as_nobody(command: str) -> None:
    def demote() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    subprocess.run(["sh", "-c", command], preexec_fn=demote, check=True, timeout=60)


def _write(
    path: Path, token: str, data: bytes = b"x", *extra: str, umask: str = "022"
) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": SRC}
    env.pop("FENCED_VERIFY_KEY", None)
    command = f'umask {umask}; exec "$@"'
    args = [sys.executable, "-m", "fenced", "write", str(path), "--token", token, *extra]
    return subprocess.run(
        ["sh", "-c", command, "sh", *args], input=data, env=env, capture_output=True, timeout=60
    )


# -- the rule itself ---------------------------------------------------------------------


def test_trusted_path_accepts_root_and_own_directories_and_pytests_tmp(tmp_path: Path) -> None:
    assert require_trusted_path("/etc/passwd", "x")
    assert require_trusted_path(tmp_path / "missing" / "deeper", "x") is False  # (walk ends)
    assert require_trusted_path(tmp_path, "x")
    root_link = tmp_path / "link"
    root_link.symlink_to(tmp_path)  # (root's symlink in a trusted directory: followed)
    (tmp_path / "file").write_text("")
    assert require_trusted_path(root_link / "file", "x")


def test_trusted_path_refuses_a_directory_another_user_owns_or_may_write(base: Path) -> None:
    theirs = _theirs(base / "theirs")
    with pytest.raises(ConfigurationError, match=r"theirs on its path is owned by another user"):
        require_trusted_path(theirs / "mine" / "key", "key file")
    group = base / "group"
    group.mkdir()
    group.chmod(0o775)
    with pytest.raises(ConfigurationError, match=r"may be written by other users \(mode 0775"):
        require_trusted_path(group / "key", "key file")
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # sticky: accepted, if what is in it is the caller's or root's
    (shared / "mine").mkdir()
    (shared / "mine" / "key").write_text("")
    assert require_trusted_path(shared / "mine" / "key", "x")
    _theirs(shared / "their-dir")
    with pytest.raises(ConfigurationError, match="owned by another user"):
        require_trusted_path(shared / "their-dir" / "key", "x")


def test_trusted_path_refuses_a_symlink_another_user_owns_and_shows_no_path(base: Path) -> None:
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    _as_nobody(f"ln -s {base} {shared}/keys")
    with pytest.raises(
        ConfigurationError, match="a symlink on its path is owned by another user"
    ) as info:
        require_trusted_path(shared / "keys" / "k", "the key file named by $X", show=False)
    assert str(shared) not in str(info.value)


# -- key files ---------------------------------------------------------------------------


def test_key_file_in_a_directory_another_user_owns_is_refused(base: Path) -> None:
    """Reproduction f_keydir: the key's directory was nobody's; nobody swapped signing.pub
    for a retired .pub whose private half they held, and their forged token verified."""
    key = generate_key("ed25519", "cur")
    keys = _theirs(base / "keys")
    pub = keys / "signing.pub"
    pub.write_text(key_text(key.public()))
    pub.chmod(0o644)
    with pytest.raises(ConfigurationError, match=r"keys on its path is owned by another user"):
        load_key(pub)
    own = base / "own"
    own.mkdir(mode=0o755)
    shutil.copy(pub, own / "signing.pub")
    assert load_key(own / "signing.pub").kid == "cur"  # the same key, in a trusted place


# -- FileGuard and fenced write ------------------------------------------------------------


def test_resource_name_planted_as_a_symlink_is_refused_not_followed(base: Path) -> None:
    """Reproduction f_symlink_resdir: a resource name that is a symlink to another directory
    was followed (root's write landed in that directory)."""
    victim = base / "victim"
    victim.mkdir()
    out = base / "out"
    FileGuard(out, lock="rep")
    (out / "daily.csv").symlink_to(victim)
    refused = _write(out / "daily.csv", "rep:1")
    assert refused.returncode == 2, refused.stderr
    assert b"is not a directory (a symlink or a file)" in refused.stderr
    assert list(victim.iterdir()) == []
    nb = _theirs(base / "nb")  # (and in another user's directory: refused before any look)
    _as_nobody(f"mkdir {nb}/out && ln -s {victim} {nb}/out/daily.csv")
    assert _write(nb / "out" / "daily.csv", "rep:1").returncode == 2
    assert list(victim.iterdir()) == []


@pytest.mark.parametrize(("owner", "mode"), [(NOBODY, 0o755), (0, 0o775)])
def test_guard_directory_others_own_or_may_write_is_refused(
    base: Path, owner: int, mode: int
) -> None:
    """Reproductions f_guarddir_other_user and f_root_breaks_service: DIR of `fenced write
    DIR/NAME` owned by nobody, or group-writable: its owner or group moved the resource aside
    and a stale token was accepted (and root's write broke the service's). Refused now, with
    nothing written; the guard's constructor refuses it too."""
    out = base / "out"
    out.mkdir()
    out.chmod(mode)
    os.chown(out, owner, NOBODY)
    refused = _write(out / "daily.csv", "rep:5")
    assert refused.returncode == 2, refused.stderr
    assert b"the file guard's directory" in refused.stderr
    assert list(out.iterdir()) == []
    with pytest.raises(ConfigurationError, match="file guard's directory"):
        FileGuard(out, lock="rep")


def test_guard_under_tmp_owned_by_the_caller_and_sticky_own_directory_accepted(
    base: Path,
) -> None:
    """Legitimate set-ups: a guard in a directory of one's own under /tmp, and a sticky
    directory only its owner may write (1755): nobody else can write it, so not "shared"."""
    sticky = base / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1755)
    assert _write(sticky / "daily.csv", "rep:5", b"new\n").returncode == 0
    stale = _write(sticky / "daily.csv", "rep:2", b"STALE\n")
    assert stale.returncode == 77, stale.stderr
    assert (sticky / "daily.csv" / "current").read_bytes() == b"new\n"
    guard = FileGuard(base / "own" / "deeper", lock="rep")
    guard.write("a", b"1", token="rep:1")
    assert guard.read("a")[1] == b"1"


def test_fenced_lock_record_is_never_followed_read_unbounded_or_printed(base: Path) -> None:
    """Reproductions f_fenced_lock_symlink / _fifo: .fenced-lock as a symlink to a key file
    printed the key in the error; a FIFO hung; /dev/zero ended in a MemoryError traceback."""
    secret = base / "hmac.key"
    secret.write_text("fenced-key hmac k1 c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0\n")
    secret.chmod(0o600)
    for name, plant in (
        ("link", lambda p: p.symlink_to(secret)),
        ("zero", lambda p: p.symlink_to("/dev/zero")),
        ("fifo", lambda p: os.mkfifo(p)),
        ("text", lambda p: p.write_text(secret.read_text())),
    ):
        out = base / name
        out.mkdir(mode=0o755)
        plant(out / ".fenced-lock")
        result = _write(out / "daily.csv", "rep:1")  # (a FIFO: timeout=60 ends a hang)
        assert result.returncode == 2, (name, result.stderr)
        assert b"c2VjcmV0" not in result.stderr and b"Traceback" not in result.stderr
        assert str(out / ".fenced-lock").encode() in result.stderr
        assert len(result.stderr.splitlines()) == 1
    # theirs (nobody's directory): refused before .fenced-lock is looked at
    nb = _theirs(base / "nb")
    _as_nobody(f"ln -s {secret} {nb}/.fenced-lock")
    result = _write(nb / "daily.csv", "rep:1")
    assert result.returncode == 2 and b"c2VjcmV0" not in result.stderr


def test_resource_directories_are_0755_whatever_the_umask_and_a_0775_one_refused(
    base: Path,
) -> None:
    """Reproduction f_umask_resdir: under umask 002 in a setgid directory the resource
    directory came out 2775: a group member deleted the newest version and a stale token was
    accepted. Made 0755 now; one found group-writable is refused."""
    out = base / "out"
    out.mkdir()
    os.chown(out, 0, NOBODY)
    out.chmod(0o2755)
    assert _write(out / "daily.csv", "rep:5", b"new\n", umask="002").returncode == 0
    assert (out / "daily.csv").stat().st_mode & 0o7777 == 0o755
    with pytest.raises(subprocess.CalledProcessError):
        _as_nobody(f"rm -f {out}/daily.csv/0000000000000000005.000000")
    stale = _write(out / "daily.csv", "rep:2", b"STALE\n", umask="002")
    assert stale.returncode == 77, stale.stderr
    (out / "old.csv").mkdir(mode=0o775)
    (out / "old.csv").chmod(0o775)
    refused = _write(out / "old.csv", "rep:5")
    assert refused.returncode == 2 and b"chmod 755" in refused.stderr, refused.stderr


# -- HighWaterFile -----------------------------------------------------------------------


def test_high_water_file_refuses_a_parent_another_user_owns(base: Path) -> None:
    """Reproduction f_hwf_parent: an ancestor of the mark's directory owned by nobody let
    them swap the directory for a symlink to one without a mark: a stale token accepted."""
    nb = _theirs(base / "nb")
    (nb / "db").mkdir(mode=0o755)  # (root's, as the docs advise: only its parent is theirs)
    mark = HighWaterFile(nb / "db" / "accounts.mark", lock="accounts")
    with pytest.raises(ConfigurationError, match=r"nb on its path is owned by another user"):
        mark.check_and_advance(token="accounts:9")
    with pytest.raises(ConfigurationError, match="owned by another user"):
        mark.current()
    # the legitimate set-up: root's directories all the way
    (base / "db").mkdir(mode=0o755)
    good = HighWaterFile(base / "db" / "accounts.mark", lock="accounts")
    good.check_and_advance(token="accounts:9")
    with pytest.raises(StaleTokenError):
        good.check_and_advance(token="accounts:3")
    assert good.check_and_advance(token="accounts:10").value == 10


def test_trusted_path_walks_dot_dot_where_the_kernel_goes(base: Path) -> None:
    """``own/link/../key`` is ``nb/key`` for the kernel (``link`` -> ``nb/x``), not
    ``own/key`` as text: a check of the text would pass a key in nobody's directory."""
    nb = _theirs(base / "nb")
    _as_nobody(f"mkdir -m 755 {nb}/x && echo k > {nb}/key")
    own = base / "own"
    own.mkdir(mode=0o755)
    (own / "link").symlink_to(nb / "x")
    (own / "key").write_text("")
    with pytest.raises(ConfigurationError, match=r"nb on its path is owned by another user"):
        require_trusted_path(f"{own}/link/../key", "key file")
