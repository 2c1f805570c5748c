"""Where the CLI finds its token source when given none: one SQLite file for the whole machine.

A lock must exclude every process on the machine that takes it, whoever runs it: a cron job as
root and the application as ``www-data`` must not both "hold" ``nightly`` (a per-user default
did exactly that). So the default is one file, ``/var/tmp/fenced/locks.db``, usable by every
local user, the way ``flock(1)`` users share a lock file:

* ``/var/tmp``, not ``/tmp`` or ``/run``: it survives a reboot, and so must the token counters.
* The directory is made world-writable and sticky (mode 1777, as ``/tmp``): anyone may create
  files there, nobody may remove or replace another user's. The database is made mode 0666
  (SQLite gives its ``-wal`` and ``-shm`` files the database's mode).
* What was found is checked, never trusted: a symlink, or a directory or file that some user
  made with other permissions, is refused with a one-line error naming the fix.

The trust model is flock's: every local user can take, hold and release these locks, and one
with write access to the file could damage its counters. Where that is not acceptable, give an
explicit URL (``--url``, ``FENCED_URL``, or a file named by ``--url-file`` / ``FENCED_URL_FILE``)
to a file in a directory with the right group.
``systemd-tmpfiles`` may remove files in ``/var/tmp`` unused for 30 days; add
``x /var/tmp/fenced`` to ``/etc/tmpfiles.d/fenced.conf`` to keep it (a lost file restarts the
counters: guarded resources then refuse the new, lower tokens: safe, but stuck until an
operator acts).
"""

from __future__ import annotations

import os
import stat

from .errors import ConfigurationError
from .options import SECRET_QUERY_KEYS

__all__ = [
    "MACHINE_DIR",
    "default_url",
    "environment_url",
    "machine_database",
    "read_url_file",
    "require_trusted_path",
]

MACHINE_DIR = "/var/tmp/fenced"
_DATABASE = "locks.db"


def default_url() -> str:
    """``$FENCED_URL`` (or the URL in the file ``$FENCED_URL_FILE`` names), else the
    machine-wide SQLite file (made ready for every user)."""
    found = environment_url()
    if found is not None:
        return found[0]
    # (_FENCED_MACHINE_DIR: for fenced's own tests, which must not touch the real one)
    return f"sqlite:///{machine_database(os.environ.get('_FENCED_MACHINE_DIR', MACHINE_DIR))}"


def environment_url() -> tuple[str, str] | None:
    """The URL the environment gives, and where it came from (``$FENCED_URL``, or
    ``$FENCED_URL_FILE (PATH)``) for messages; None if it gives none."""
    url = os.environ.get("FENCED_URL")
    path = os.environ.get("FENCED_URL_FILE")
    if url and path:
        # Two sources of truth for where the locks live: refuse rather than pick one.
        raise ConfigurationError("both $FENCED_URL and $FENCED_URL_FILE are set: unset one")
    if url:
        return url, "$FENCED_URL"
    if path:
        origin = f"$FENCED_URL_FILE ({path})"
        return read_url_file(path, origin), origin
    return None


def read_url_file(path: str, origin: str) -> str:
    """The token source URL in the file ``path``: its one line that is neither blank nor a
    ``#`` comment. A URL with a password is refused from a file that other users may read or
    write (as ssh refuses such a key): that is what the file is for, keeping the password out
    of ``/proc/PID/cmdline`` and ``ps``. Never puts the URL's password in an error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigurationError(f"{origin}: cannot read {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)  # (the file opened, not a name that may be swapped meanwhile)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigurationError(f"{origin}: {path} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(65_537)
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigurationError(f"{origin}: {path} is not UTF-8 text") from None
    lines = [line.strip() for line in text.splitlines()]
    urls = [line for line in lines if line and not line.startswith("#")]
    if len(data) > 65_536 or len(urls) != 1:
        raise ConfigurationError(
            f"{origin}: {path} must hold one token source URL on a line of its own "
            f"(found {len(urls)} lines that are not blank or # comments)"
        )
    url = urls[0]
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077 and _has_password(url):
        raise ConfigurationError(
            f"{origin}: {path} holds a password and other users may read or change it (mode "
            f"{mode:04o}); run `chmod 600 {path}`"
        )
    return url


def _has_password(url: str) -> bool:
    """A password in the userinfo (``scheme://user:pw@host``) or in the query
    (``?password=``, as libpq takes it)."""
    from urllib.parse import parse_qsl

    _, _, rest = url.partition("://")
    # (conservative: an unencoded '/' in a password must not hide it)
    userinfo, at, _ = rest.split("?", 1)[0].rpartition("@")
    if at and ":" in userinfo:
        return True
    query = url.partition("?")[2]
    return any(key.lower() in SECRET_QUERY_KEYS for key, _ in parse_qsl(query))


def machine_database(directory: str = MACHINE_DIR) -> str:
    """Make ``directory`` (mode 1777) and its ``locks.db`` (mode 0666) if missing, check them,
    and return the database's path. Raises ConfigurationError, naming the fix."""
    try:
        os.mkdir(directory, 0o1777)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigurationError(
            f"cannot create fenced's machine-wide directory {directory}: {exc.strerror}; "
            "give a token source with --url or FENCED_URL"
        ) from None
    else:
        os.chmod(directory, 0o1777)  # (mkdir's mode is cut by the umask)
    # The directory's name must survive a power loss, or the counters go with it (fenced
    # never made it durable before). Also when found: its maker may have died before this.
    _fsync_dir(os.path.dirname(os.path.abspath(directory)))
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigurationError(
            f"{directory} is not a directory (a symlink or a file): refusing to use it as "
            "fenced's machine-wide location; remove it, or give --url / FENCED_URL"
        )
    if stat.S_IMODE(info.st_mode) != 0o1777:
        raise ConfigurationError(
            f"{directory} has mode {stat.S_IMODE(info.st_mode):04o}, not 1777: other users could "
            f"not share its locks; run `chmod 1777 {directory}` or give --url / FENCED_URL"
        )
    path = os.path.join(directory, _DATABASE)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o666)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigurationError(f"cannot create {path}: {exc.strerror}") from None
    else:
        try:
            os.fchmod(fd, 0o666)  # (cut by the umask too)
        finally:
            os.close(fd)
        _fsync_dir(directory)  # (SQLite syncs the names of its journals, not of this file)
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise ConfigurationError(f"{path} is not a regular file (a symlink?): refusing to use it")
    if not os.access(path, os.R_OK | os.W_OK):
        raise ConfigurationError(
            f"{path} (owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}) is not "
            f"writable by this user: run `chmod 0666 {path}` or give --url / FENCED_URL"
        )
    return path


def _fsync_dir(directory: str) -> None:
    """Make the names in ``directory`` durable; where that is not allowed (a directory this
    user may not open, an OS without directory fsync), the directory's owner must have."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_MAX_SYMLINKS = 40  # (as the kernel's ELOOP limit)


def require_trusted_path(path: str | os.PathLike[str], what: str, *, show: bool = True) -> bool:
    """Refuse (ConfigurationError, one line) a ``path`` that another user could redirect: sshd's
    StrictModes rule. Every directory from ``/`` down to ``path`` (``path`` included when it is
    a directory) must be owned by the caller or root and not writable by group or others, except
    a sticky directory (``/tmp``), whose next component must then be owned by the caller or
    root (its owner alone can remove or rename it). A symlink on the way is followed only if it
    is the caller's or root's (it sits in a directory already found trusted, so nobody else
    can swap it). Each component is ``lstat``-ed, never followed blindly. Components not there
    yet end the walk (the caller creates them, in a directory found trusted). A final
    component that is not a directory (a key file, a mark) is left to the caller's own owner
    and mode checks. ``show=False``: the error names no path (one taken from a variable that
    may hold a secret). Returns whether the whole path was there (False: the walk ended at a
    missing component)."""
    if os.name != "posix":
        return True  # (modes and owners mean nothing there)
    me = os.geteuid()
    # (not os.path.abspath: it drops ``link/..`` as text, where the kernel goes to the
    # parent of the link's target; the walk below goes where the kernel goes)
    raw = os.fspath(path)
    parts = [p for p in os.path.join(os.getcwd(), raw).split("/") if p]
    current = "/"
    root = os.lstat(current)
    _check_trusted_dir(current, root, me, what, show)
    sticky_parent = bool(root.st_mode & stat.S_ISVTX)
    links = 0
    while parts:
        part = parts.pop(0)
        if part in (".", ".."):
            # (``current`` is always a real directory, never a symlink's name: its parent
            # is the one walked through already)
            current = os.path.dirname(current) if part == ".." else current
            sticky_parent = bool(os.lstat(current).st_mode & stat.S_ISVTX)
            continue
        here = os.path.join(current, part)
        try:
            info = os.lstat(here)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise ConfigurationError(
                f"{what}: cannot check {_shown(here, show, 'name')} on its path: {exc.strerror}"
            ) from None
        if stat.S_ISLNK(info.st_mode):
            _check_owner(here, info, me, what, show, "symlink")
            links += 1
            if links > _MAX_SYMLINKS:
                raise ConfigurationError(f"{what}: too many symlinks on its path")
            target = os.readlink(here)
            if target.startswith("/"):
                current = "/"
                sticky_parent = bool(root.st_mode & stat.S_ISVTX)
            parts[:0] = [p for p in target.split("/") if p]
            continue
        if not stat.S_ISDIR(info.st_mode):
            if parts:
                raise ConfigurationError(f"{what}: {_shown(here, show, 'file')} is not a directory")
            if sticky_parent:  # (in /tmp: only its owner may remove or replace it)
                _check_owner(here, info, me, what, show, "file")
            return True  # the file itself: the caller checks its owner and mode
        _check_trusted_dir(here, info, me, what, show)
        sticky_parent = bool(info.st_mode & stat.S_ISVTX)
        current = here
    return True


def _shown(path: str, show: bool, kind: str = "directory") -> str:
    return f"the {kind} {path}" if show else f"a {kind}"


def _check_owner(
    path: str, info: os.stat_result, me: int, what: str, show: bool, kind: str
) -> None:
    if info.st_uid not in (me, 0):
        raise ConfigurationError(
            f"{what}: {_shown(path, show, kind)} on its path is owned by another user "
            f"(uid {info.st_uid}), who can redirect it; use a path whose every directory is "
            "yours or root's"
        )


def _check_trusted_dir(path: str, info: os.stat_result, me: int, what: str, show: bool) -> None:
    _check_owner(path, info, me, what, show, "directory")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and not mode & stat.S_ISVTX:
        shown = _shown(path, show)
        fix = f"`chmod go-w {path}`" if show else "`chmod go-w` on it"
        raise ConfigurationError(
            f"{what}: {shown} on its path may be written by other users "
            f"(mode {mode:04o}, no sticky bit), who can redirect it; run {fix}"
        )
