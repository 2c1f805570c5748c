"""Small POSIX file-system primitives the file guards are built from.

Everything here is about *making a name appear atomically and durably*: a file is written
under a temporary name, fsync'd, then published under its final name with ``link`` (which
fails if the name exists) or ``rename`` (which replaces it), and the directory is fsync'd so
the new name survives a power loss. Local file systems only: ``flock`` and ``link`` on NFS do
not give the same guarantees.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import stat
import uuid
from collections.abc import Iterator
from typing import Final

from .._core.errors import ConfigurationError

__all__ = [
    "DIR_MODE",
    "LOCK_FILE_MODE",
    "TEMP_PREFIX",
    "TempFile",
    "collect_temps",
    "create_with_content",
    "flocked",
    "fsync_dir",
    "log_stray",
    "make_dirs_durably",
    "mkdir_durably",
    "require_owned",
    "require_unshared_dir",
    "write_all",
]

TEMP_PREFIX: Final = ".tmp-"
_OPEN_FLAGS: Final = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
DIR_MODE: Final = 0o755
"""Directories the guards make: the owner's to write, whatever the umask (0775 under umask
002 let a group member delete the newest version); others may read the versions."""
LOCK_FILE_MODE: Final = 0o600
"""Lock files are the owner's alone: ``flock(LOCK_EX)`` works on a read-only descriptor, so
any user who may *read* a lock file can hold its lock forever and stop every writer."""

logger = logging.getLogger("fenced.guards.files")
_reported: set[tuple[str, str]] = set()  # entries already warned about (then at debug level)


def fsync_dir(path: str) -> None:
    """fsync a directory, making the names created or removed in it durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mkdir_durably(path: str) -> None:
    """Make directory ``path`` (mode :data:`DIR_MODE`) if missing, and make its name durable:
    fsync its parent, also when it already existed (its maker may have died between mkdir and
    that fsync, leaving a name a power loss would take back, and everything written under it
    with it)."""
    try:
        # 0700 first: never, even for an instant, writable by a group the umask lets in
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(path, DIR_MODE)  # (in a trusted parent: nobody else can swap the name)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def make_dirs_durably(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, each directory made (and ``path`` itself) durable
    in its parent (see :func:`mkdir_durably`). Ancestors that already existed are not touched."""
    path = os.path.abspath(path)
    missing = []
    ancestor = os.path.dirname(path)
    while not os.path.isdir(ancestor):
        missing.append(ancestor)
        ancestor = os.path.dirname(ancestor)
    for directory in reversed(missing):
        mkdir_durably(directory)
    mkdir_durably(path)


def _user_name(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def require_owned(path: str, info: os.stat_result, what: str, can: str) -> None:
    """Refuse (ConfigurationError, one line) ``path`` owned by another user than the reader
    or root: its owner can ``can`` (said in the error), whatever its mode."""
    me = os.geteuid()
    if info.st_uid not in (me, 0):
        raise ConfigurationError(
            f"{what} {path} is owned by another user (uid {info.st_uid}), who can {can}; "
            f"remove it or run `chown {_user_name(me)} {path}` (it must be yours or root's)"
        )


def require_unshared_dir(path: str, what: str) -> None:
    """Refuse a directory whose names others may replace: owned by another user than the
    reader or root, or writable by group or others without the sticky bit (anyone who may
    write it can rename or delete any entry, a mark included, and put an old one back)."""
    info = os.stat(path)
    require_owned(path, info, f"the directory of {what}", "rename or delete anything in it")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise ConfigurationError(
            f"the directory of {what}, {path}, may be written by other users (mode "
            f"{mode:04o}, no sticky bit), who can delete or replace {what}; use a directory "
            f"only its owner can write (`chmod go-w {path}`)"
        )


@contextlib.contextmanager
def flocked(path: str) -> Iterator[int]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the ``with`` body.

    flock locks belong to the open file description: every call opens the file anew, so two
    threads of one process exclude each other just like two processes do. The kernel drops
    the lock when the holder dies (even by SIGKILL), so a crashed writer never wedges others.

    The lock file is made mode :data:`LOCK_FILE_MODE` whatever the umask (and one left by an
    older version with a wider mode is narrowed), and one owned by another user than the
    reader or root, or not a regular file, is refused (ConfigurationError) before locking:
    its owner could hold the lock forever.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, LOCK_FILE_MODE)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigurationError(f"lock file {path} is not a regular file")
        require_owned(path, info, "lock file", "hold its lock and stop every writer")
        if stat.S_IMODE(info.st_mode) != LOCK_FILE_MODE and info.st_uid == os.geteuid():
            os.fchmod(fd, LOCK_FILE_MODE)  # (the umask narrowed it, or an older version made it)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """Write every byte of ``data`` to ``fd`` (os.write may write less than asked)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


class TempFile:
    """A uniquely named temporary file in ``directory``, locked while its writer lives.

    The writer holds an exclusive ``flock`` on the temp file from creation until it is
    published or discarded, so :func:`collect_temps` can tell a live writer's temp file (lock
    busy) from one left by a writer that crashed (lock free) without any timestamps.
    """

    __slots__ = ("fd", "name", "path")

    def __init__(self, directory: str, prefix: str = TEMP_PREFIX) -> None:
        # Unpredictable, created with O_EXCL | O_NOFOLLOW: a name planted in advance (a
        # symlink to someone's file) is never opened, followed or truncated.
        self.name = f"{prefix}{uuid.uuid4().hex}"
        self.path = os.path.join(directory, self.name)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            # A collector opened and locked the file in the instant between create and
            # lock: it is about to unlink it. Give it up; the caller retries with a new name.
            os.close(self.fd)
            raise

    def link_to(self, final_path: str) -> None:
        """Publish the (already fsync'd) content under ``final_path``; fails if it exists.

        Raises FileNotFoundError if a collector removed the temp name (see ``__init__``).
        """
        os.link(self.path, final_path, follow_symlinks=False)

    def close(self) -> None:
        """Remove the temp name (if still there), then drop the lock by closing."""
        if self.path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = ""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def collect_temps(
    directory: str, names: list[str] | None = None, pattern: re.Pattern[str] | None = None
) -> int:
    """Remove temp files whose writer is gone (their flock is free); return how many.

    Safe against live writers: a temp file whose writer is alive is locked and is skipped; a
    writer whose fresh temp file is taken in the instant before it locks it notices (its
    ``TempFile()`` or ``link_to`` fails) and retries. Only names starting with
    :data:`TEMP_PREFIX` (or matching ``pattern``) are ever removed, never a published file.

    Never raises for one entry: what cannot be collected (a directory, a symlink, a FIFO, a
    file it may not open or unlink) is left in place and logged (a warning the first time,
    then at debug level), because a caller collecting after its write was accepted must not
    turn that write into a failure.
    """
    if names is None:
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return 0
    removed = 0
    for name in names:
        if not (pattern.fullmatch(name) if pattern else name.startswith(TEMP_PREFIX)):
            continue
        path = os.path.join(directory, name)
        try:
            removed += _collect_one(path)
        except OSError as exc:
            _left_in_place(path, exc.strerror or str(exc))
    return removed


def _collect_one(path: str) -> int:
    # O_NONBLOCK: a FIFO of that name must not block the open; O_NOFOLLOW: nor a symlink
    # lead anywhere (ELOOP).
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _OPEN_FLAGS)
    except FileNotFoundError:
        return 0
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            _left_in_place(path, "not a regular file, so no writer's temp file")
            return 0
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0  # a live writer holds it
        try:
            os.unlink(path)
        except FileNotFoundError:
            return 0
        return 1
    finally:
        os.close(fd)


def _left_in_place(path: str, why: str) -> None:
    log_stray("garbage collection left %s in place: %s", path, why)


def log_stray(template: str, path: str, why: str) -> None:
    """Log an entry left alone (``template % (path, why)``): a warning the first time, then
    at debug level."""
    if len(_reported) > 1024:  # (bounded: a directory full of strays must not grow it)
        _reported.clear()
    level = logging.DEBUG if (template, path) in _reported else logging.WARNING
    _reported.add((template, path))
    logger.log(level, template, path, why)


def create_with_content(directory: str, name: str, data: bytes) -> bool:
    """Create ``directory/name`` holding ``data``, atomically and durably, if it does not exist.

    Returns True if this call created it, False if it existed already (content untouched).
    """
    temp = TempFile(directory)
    try:
        write_all(temp.fd, data)
        os.fsync(temp.fd)
        try:
            temp.link_to(os.path.join(directory, name))
        except FileExistsError:
            return False
        fsync_dir(directory)
        return True
    finally:
        temp.close()
