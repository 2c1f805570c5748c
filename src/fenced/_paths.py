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
explicit URL (``--url`` or ``FENCED_URL``) to a file in a directory with the right group.
``systemd-tmpfiles`` may remove files in ``/var/tmp`` unused for 30 days; add
``x /var/tmp/fenced`` to ``/etc/tmpfiles.d/fenced.conf`` to keep it (a lost file restarts the
counters: guarded resources then refuse the new, lower tokens: safe, but stuck until an
operator acts).
"""

from __future__ import annotations

import os
import stat

from ._errors import ConfigurationError

__all__ = ["MACHINE_DIR", "default_url", "machine_database"]

MACHINE_DIR = "/var/tmp/fenced"
_DATABASE = "locks.db"


def default_url() -> str:
    """``$FENCED_URL``, else the machine-wide SQLite file (made ready for every user)."""
    url = os.environ.get("FENCED_URL")
    if url:
        return url
    # (_FENCED_MACHINE_DIR: for fenced's own tests, which must not touch the real one)
    return f"sqlite:///{machine_database(os.environ.get('_FENCED_MACHINE_DIR', MACHINE_DIR))}"


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
