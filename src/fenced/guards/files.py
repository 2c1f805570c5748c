"""File guards: versioned files named by their fencing token, and a high-water file.

:class:`FileGuard` is DDIA's "put the fencing token in the file name", done so that it holds
under concurrency and crashes. Each write of resource ``name`` creates a *new* immutable
file ``<directory>/<name>/<token:019d>.<seq:06d>``; readers take the highest name, so the
newest version is the one with the highest token, whatever order the writes arrived in.
``<directory>/<name>/current`` is a symlink to the newest version, so plain tools read it too
(``cat /srv/reports/daily.csv/current``). A
write whose token is lower than the newest published version is rejected and leaves nothing
behind. The versions themselves are the high-water mark: it lives in the resource, exactly
as durable as the data.

Write path, and why it is atomic (one machine, any number of processes and threads):

1. the data goes to a uniquely named temp file in the resource directory, which is
   fsync'd (no lock held: big or slow writes do not serialize writers);
2. an exclusive ``flock`` on ``<name>/.lock`` is taken; under it the directory is listed,
   the token is compared with the newest published version (``token >= newest``), and the
   temp file is published under its version name with ``link`` (which never replaces an
   existing name), then the directory is fsync'd; then the lock is released.

Every publish happens inside that critical section, so "is my token >= the newest?" and
"publish" cannot interleave with another writer's publish: the newest version a writer
compared against is still the newest when its own name appears. Rejected writers unlink
their temp file. The kernel releases a flock when its holder dies (even by SIGKILL), and a
version name only ever appears, via ``link``, for a complete fsync'd file, so a crash leaves
the old versions, or the old versions plus the complete new one, never a partial file.
Temp files of dead writers are ignored by readers and removed by later writes (a live
writer keeps its temp file flocked, which is how a collector tells them apart); what cannot
be removed is logged and left, never failing a write that was accepted.

:meth:`FileGuard.claim`, the fenced read, reads the newest version and publishes its copy
under the new token in one critical section under the same lock, so neither a write nor a
prune can come between the two.

Equal tokens: a token equal to the newest is accepted (the holder of that grant writing
again) and creates the next *sub-version* ``<token>.<seq+1>``; nothing is ever overwritten,
and two writers that both hold the same token each get their own version. Readers see the
highest ``(token, seq)``.

Limits: local file systems only (``flock``/``link`` semantics on NFS are weaker); every
write lists the resource directory, so keep the number of versions bounded with
:meth:`FileGuard.prune`. A writer paused (SIGSTOP) inside the few-syscall critical section
delays the other writers of that resource until it resumes; it cannot make them wrong.

:class:`HighWaterFile` is the other form: one small file holding ``lock:value`` for a
resource that is updated in place elsewhere. ``with mark.hold(token=t): <write>`` checks and
durably advances the mark and keeps the lock across the caller's write, so check and write
are one step for every writer that goes through the same file.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import re
import stat
from collections.abc import Iterable, Iterator
from typing import Any, Final, Protocol, overload, runtime_checkable

from .._core.errors import (
    ConfigurationError,
    CorruptMarkError,
    InvalidTokenError,
    ResourceNotFoundError,
    StaleTokenError,
    WrongLockError,
)
from .._core.paths import require_trusted_path
from .._core.signing import TokenVerifier
from .._core.token import MAX_TOKEN, FencingToken, TokenLike, validate_lock_name
from ._files_fs import (
    DIR_MODE,
    TEMP_PREFIX,
    TempFile,
    collect_temps,
    create_with_content,
    flocked,
    fsync_dir,
    log_stray,
    logger,
    make_dirs_durably,
    mkdir_durably,
    require_owned,
    require_unshared_dir,
    write_all,
)
from ._token_arg import token_keyword, warn_positional

__all__ = ["AsyncFileGuard", "FileGuard", "HighWaterFile", "Version", "VersionStore"]

_NAME_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@+=-]{0,199}")
_VERSION_RE: Final = re.compile(r"([0-9]{19})\.([0-9]{6,})")
_LOCK_FILE: Final = ".lock"
CURRENT: Final = "current"
"""``<directory>/<name>/current``: a symlink to the newest version, for plain tools."""
_LOCK_NAME_FILE: Final = ".fenced-lock"
_LOCK_NAME_MAX: Final = 1024  # (a lock name and a newline: never a device read for ever)
_RETRIES: Final = 16

Data = bytes | bytearray | memoryview


@dataclasses.dataclass(frozen=True, order=True)
class Version:
    """One published version of a resource: its token and its sub-version number.

    ``seq`` counts writes that carried the same token (0 for the first). Versions order by
    ``(token, seq)``; the newest version is the greatest.
    """

    token: FencingToken
    seq: int = 0

    @property
    def filename(self) -> str:
        """The version's file (or object key) name: zero-padded so names sort numerically."""
        return f"{self.token.value:019d}.{self.seq:06d}"


@runtime_checkable
class VersionStore(Protocol):
    """What a token-versioned store offers; :class:`FileGuard` is the local-disk one.

    An object store with conditional writes maps onto it: :class:`fenced.guards.s3.
    S3VersionStore` (version objects ``<name>/<token:019d>.<seq:06d>`` created with
    ``If-None-Match: *``, a mark object swapped with ``If-Match``).
    """

    lock: str

    def publish(self, name: str, data: Data, *, token: TokenLike) -> Version:
        """Store ``data`` as a new version of ``name`` if ``token`` >= the newest version.

        Raises :class:`~fenced.StaleTokenError` (and stores nothing) if it is lower.
        """
        ...

    def latest(self, name: str) -> Version | None:
        """The newest published version of ``name``, or None if it has none."""
        ...

    def versions(self, name: str) -> list[Version]:
        """Every published version of ``name``, oldest first."""
        ...

    def read_version(self, name: str, version: Version) -> bytes:
        """The content of one version; ResourceNotFoundError if it does not exist (any more)."""
        ...

    def prune(self, name: str, keep: int) -> list[Version]:
        """Delete all but the ``keep`` (>= 1) newest versions; return the deleted ones."""
        ...


def _point_current(rdir: str, filename: str) -> None:
    """Point ``<name>/current`` at the version just published (a relative symlink, replaced
    with one rename), so that ``cat reports/daily.csv/current`` reads the newest version.
    Done under the resource's lock, so it always moves forward; after a crash it may name
    the version before the newest until the next write (``read()`` is never misled).

    The version is published already: a link that cannot be moved (something else in the
    way) is logged and left, never turned into a failure of the accepted write."""
    temp = os.path.join(rdir, f".current-{os.getpid()}")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        os.symlink(filename, temp)
        os.replace(temp, os.path.join(rdir, CURRENT))
    except OSError as exc:
        logger.warning("%s/%s not moved to %s: %s", rdir, CURRENT, filename, exc)
        with contextlib.suppress(OSError):  # (our link, if made: not left behind)
            os.unlink(temp)


def _collect_leftovers(rdir: str, names: list[str], own: str) -> None:
    """Collect the temp files of dead writers seen in ``names`` (after an accepted write:
    :func:`collect_temps` skips and logs what it cannot remove, never raises for it)."""
    leftovers = [n for n in names if n.startswith(TEMP_PREFIX) and n != own]
    if leftovers:
        collect_temps(rdir, leftovers)


def _read_version_file(rdir: str, version: tuple[int, int]) -> bytes:
    """A version's content, read under the resource lock (no prune can remove it then)."""
    with open(os.path.join(rdir, f"{version[0]:019d}.{version[1]:06d}"), "rb") as f:
        return f.read()


def _read_lock_name(marker: str) -> str | None:
    """The lock recorded in ``.fenced-lock``, or None if it holds no lock name. Opened
    O_NOFOLLOW (a symlink planted there is never read: it led to a key file once) and
    O_NONBLOCK (a FIFO never hangs), a regular file of the caller's or root's only, read
    bounded. Its content is never put in an error: only its name."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(marker, flags)
    except OSError as exc:
        why = "it is a symlink: remove it" if exc.errno == errno.ELOOP else exc.strerror
        raise ConfigurationError(f"cannot read {marker}: {why}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigurationError(f"{marker} is not a regular file: remove it")
        require_owned(marker, info, "the guard's lock record", "choose the lock it accepts")
        data = os.read(fd, _LOCK_NAME_MAX + 1)
    finally:
        os.close(fd)
    try:
        return data.decode("ascii").strip() if len(data) <= _LOCK_NAME_MAX else None
    except UnicodeDecodeError:
        return None


def _validate_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigurationError(
            f"invalid resource name {name!r}: use 1-200 characters of A-Z a-z 0-9 _ . @ + = -, "
            "not starting with a punctuation mark"
        )
    return name


def _as_view(data: object) -> memoryview:
    if isinstance(data, str) or not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"data must be bytes-like, not {type(data).__name__}")
    return memoryview(data)


def _parse_versions(names: Iterable[str], resource: str = "") -> list[tuple[int, int]]:
    """The (token value, seq) of every version file name among ``names``.

    A version name whose token is 0 or above ``MAX_TOKEN`` was never published by a guard:
    the mark it would stand for is unknown, so it raises :class:`~fenced.CorruptMarkError`
    (fail closed) rather than being ignored or trusted.
    """
    found = []
    for entry in names:
        m = _VERSION_RE.fullmatch(entry)
        if m is not None:
            value = int(m[1])
            if not 0 < value <= MAX_TOKEN:
                raise CorruptMarkError(resource or entry, f"version file {entry!r}")
            found.append((value, int(m[2])))
    return found


class FileGuard:
    """Token-versioned files in ``directory``: ``write(name, data, token)``, ``read(name)``.

    ``lock`` is the lock whose tokens this directory accepts; it is recorded in
    ``<directory>/.fenced-lock`` on first use, and opening the directory with another lock
    raises :class:`~fenced.ConfigurationError` (tokens of two locks cannot be ordered).
    Offering a token of another lock raises :class:`~fenced.WrongLockError`; malformed ones,
    :class:`~fenced.InvalidTokenError`. See the module docstring for the atomicity argument.

    >>> guard = FileGuard("/srv/reports", lock="reports")          # doctest: +SKIP
    >>> guard.write("daily.csv", b"...", token=lease.token)               # doctest: +SKIP
    Version(token=FencingToken('reports', 34), seq=0)
    >>> guard.read("daily.csv")                                     # doctest: +SKIP
    (FencingToken('reports', 34), b'...')
    """

    precheck_bytes: int = 1 << 20
    """Writes at least this big check the token before writing the data too (a stale writer
    then fails fast instead of writing a big temp file first). The check that counts is the
    one under the lock."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        lock: str,
        verify: TokenVerifier | None = None,
    ) -> None:
        self.verifier = verify  # checks each token before the mark (see fenced._core.signing)
        self.lock = validate_lock_name(lock)
        self.directory = os.fspath(directory)
        self._known_dirs: set[str] = set()
        # A trusted path (sshd's StrictModes rule): checked before anything is made under it,
        # and once more with the directories made, once per guard: nobody else can change a
        # trusted path, so writes need not check it again.
        what = "the file guard's directory"
        require_trusted_path(self.directory, what)
        make_dirs_durably(self.directory)  # (a name only in memory: lost with the power)
        require_trusted_path(self.directory, what)
        if not create_with_content(self.directory, _LOCK_NAME_FILE, f"{lock}\n".encode()):
            recorded = _read_lock_name(os.path.join(self.directory, _LOCK_NAME_FILE))
            if recorded != lock:
                raise ConfigurationError(
                    f"{self.directory} is fenced by another lock than {lock!r} (the lock named "
                    f"in {os.path.join(self.directory, _LOCK_NAME_FILE)})"
                )

    # -- the write path ---------------------------------------------------------------------

    @token_keyword()
    def write(self, name: str, data: Data, *, token: TokenLike) -> Version:
        """Store ``data`` as the newest version of ``name`` if ``token`` >= its newest version.

        Returns the new :class:`Version` once it is durable. Raises StaleTokenError (with the
        newest version's token as ``high_water``) and leaves nothing behind if the token is
        lower; InvalidTokenError / WrongLockError for a bad token.
        """
        return self._publish(name, data, token)

    @overload
    def publish(self, name: str, data: Data, *, token: TokenLike) -> Version: ...

    @overload
    def publish(self, name: str, token: TokenLike, data: Data, /) -> Version: ...

    def publish(
        self, name: str, *args: Any, token: TokenLike | None = None, data: Data | None = None
    ) -> Version:
        """:class:`VersionStore` spelling of :meth:`write`: ``publish(name, data, token=t)``.

        (0.1 had the token before the data, ``publish(name, token, data)``: still accepted
        for one release, with a DeprecationWarning.)"""
        if len(args) == 2 and token is None and data is None:
            warn_positional(f"{type(self).__qualname__}.publish")
            token, data = args
        elif len(args) == 1 and data is None and token is not None:
            (data,) = args
        elif args or token is None or data is None:
            raise TypeError("publish(name, data, *, token): give the data and token=")
        return self._publish(name, data, token)

    def _publish(self, name: str, data: Data, token: TokenLike) -> Version:
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        view = _as_view(data)
        rdir = self._resource_dir(_validate_name(name), create=True)
        if view.nbytes >= self.precheck_bytes:
            self._reject_if_stale(name, tok, self._newest(os.listdir(rdir), name))
        for _ in range(_RETRIES):
            try:
                temp = TempFile(rdir)
            except BlockingIOError:  # a collector grabbed the fresh temp file: take another
                continue
            try:
                self._write_temp(temp.fd, view)
                os.fsync(temp.fd)
                with self._resource_lock(rdir):
                    names = os.listdir(rdir)
                    version = self._link_locked(rdir, name, names, tok, temp)
            finally:
                temp.close()
            if version is None:
                continue  # a collector removed our temp name: write it again
            _collect_leftovers(rdir, names, temp.name)
            return version
        raise OSError(f"could not publish {name!r} in {rdir}: temp files kept disappearing")

    def _link_locked(
        self, rdir: str, name: str, names: list[str], tok: FencingToken, temp: TempFile
    ) -> Version | None:
        """Under the resource lock (``names`` listed under it): check ``tok`` against the
        newest version and publish the fsync'd ``temp`` as the next version; None if the
        temp name was taken by a collector."""
        newest = self._newest(names, name)
        self._reject_if_stale(name, tok, newest)
        seq = newest[1] + 1 if newest is not None and newest[0] == tok.value else 0
        version = Version(tok, seq)
        self._checked(name, version)
        try:
            temp.link_to(os.path.join(rdir, version.filename))
        except FileNotFoundError:
            return None
        _point_current(rdir, version.filename)
        fsync_dir(rdir)
        self._published(name, version)
        return version

    def _reject_if_stale(
        self, name: str, token: FencingToken, newest: tuple[int, int] | None
    ) -> None:
        if newest is not None and not self._accepts(token.value, newest[0]):
            raise StaleTokenError(token, FencingToken(self.lock, newest[0]), name)

    # -- hooks (overridden only by tests and planted-bug variants) -------------------------

    def _accepts(self, token: int, newest: int) -> bool:
        """The fencing rule: a token equal to the newest is accepted, a lower one is not."""
        return token >= newest

    def _resource_lock(self, rdir: str) -> contextlib.AbstractContextManager[object]:
        return flocked(os.path.join(rdir, _LOCK_FILE))

    def _write_temp(self, fd: int, data: memoryview) -> None:
        write_all(fd, data)

    def _checked(self, name: str, version: Version) -> None:
        """Called under the lock after the check passed, before the version is published."""

    def _published(self, name: str, version: Version) -> None:
        """Called under the lock once the version is published and durable."""

    # -- reading ----------------------------------------------------------------------------

    def latest(self, name: str) -> Version | None:
        """The newest published version of ``name``, or None if it has none."""
        rdir = self._resource_dir(_validate_name(name), create=False)
        try:
            newest = self._newest(os.listdir(rdir), name)
        except FileNotFoundError:
            return None
        return None if newest is None else Version(FencingToken(self.lock, newest[0]), newest[1])

    def high_water(self, name: str) -> FencingToken | None:
        """The highest token ``name`` has accepted (the newest version's), or None."""
        v = self.latest(name)
        return None if v is None else v.token

    def read(self, name: str) -> tuple[FencingToken, bytes]:
        """The newest complete version of ``name``: ``(token, data)``.

        Raises :class:`~fenced.ResourceNotFoundError` if ``name`` has no version. Never
        returns a partial file: version names only appear for complete, fsync'd files.
        """
        for _ in range(_RETRIES):
            v = self.latest(name)
            if v is None:
                raise ResourceNotFoundError(f"{name!r} has no version in {self.directory}")
            try:
                return v.token, self.read_version(name, v)
            except ResourceNotFoundError:
                continue  # pruned between listing and opening: look again
        raise ResourceNotFoundError(f"{name!r}: versions kept disappearing while reading")

    def read_version(self, name: str, version: Version) -> bytes:
        """The content of one version of ``name``."""
        try:
            with open(self.path(name, version), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise ResourceNotFoundError(f"{name!r} has no version {version.filename}") from None

    def path(self, name: str, version: Version) -> str:
        """The file of one version (immutable: safe to open directly until it is pruned)."""
        rdir = self._resource_dir(_validate_name(name), create=False)
        version.token.require_lock(self.lock)
        return os.path.join(rdir, version.filename)

    def versions(self, name: str) -> list[Version]:
        """Every published version of ``name``, oldest first."""
        rdir = self._resource_dir(_validate_name(name), create=False)
        try:
            found = _parse_versions(os.listdir(rdir), name)
        except FileNotFoundError:
            return []
        return [Version(FencingToken(self.lock, v), s) for v, s in sorted(found)]

    # -- housekeeping -----------------------------------------------------------------------

    def prune(self, name: str, keep: int = 1) -> list[Version]:
        """Delete all but the ``keep`` newest versions of ``name``; return what was deleted.

        ``keep`` must be >= 1: the newest version *is* the high-water mark, and deleting it
        would let a stale writer in again.
        """
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, not {keep!r}")
        rdir = self._resource_dir(_validate_name(name), create=False)
        if not os.path.isdir(rdir):
            return []
        with self._resource_lock(rdir):
            existing = sorted(_parse_versions(os.listdir(rdir), name))
            doomed = existing[:-keep]
            for value, seq in doomed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(rdir, f"{value:019d}.{seq:06d}"))
            if doomed:
                fsync_dir(rdir)
        return [Version(FencingToken(self.lock, v), s) for v, s in doomed]

    def collect_garbage(self, name: str) -> int:
        """Remove temp files left by crashed writers of ``name``; return how many.

        Writes do this on their own when they see such files; live writers are never hurt.
        """
        return collect_temps(self._resource_dir(_validate_name(name), create=False))

    # -- internals --------------------------------------------------------------------------

    @staticmethod
    def _newest(names: Iterable[str], resource: str = "") -> tuple[int, int] | None:
        found = _parse_versions(names, resource)
        return max(found) if found else None

    @token_keyword()
    def claim(self, name: str, *, token: TokenLike) -> bytes | None:
        """Raise ``name``'s mark to ``token`` without changing what it holds; return what it
        holds (None if it has no version). A file's mark is its newest version's token, so
        this publishes the newest data again under ``token`` (a token equal to the mark
        publishes nothing; a lower one raises StaleTokenError). For a read-modify-write whose
        read must be fenced, and for ``fence=`` on acquire.

        The read and the publish are one step under the resource's lock, the lock every
        write and :meth:`prune` take: no version can land between them (it would be lost to
        the claimer) and the version being copied cannot be pruned under it. The copy is
        written and fsync'd under the lock, so writers of ``name`` wait for it (they are
        stale then, bar the claimer itself); readers never do."""
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        rdir = self._resource_dir(_validate_name(name), create=True)
        for _ in range(_RETRIES):
            with self._resource_lock(rdir):
                names = os.listdir(rdir)
                newest = self._newest(names, name)
                data = None if newest is None else _read_version_file(rdir, newest)
                if newest is not None and newest[0] >= tok.value:
                    if newest[0] > tok.value:
                        raise StaleTokenError(tok, FencingToken(self.lock, newest[0]), name)
                    return data  # (already fenced with this token)
                try:
                    temp = TempFile(rdir)
                except BlockingIOError:  # a collector grabbed it (see write): take another
                    continue
                try:
                    write_all(temp.fd, data or b"")
                    os.fsync(temp.fd)
                    version = self._link_locked(rdir, name, names, tok, temp)
                finally:
                    temp.close()
            if version is None:
                continue
            _collect_leftovers(rdir, names, temp.name)
            return data
        raise OSError(f"could not publish {name!r} in {rdir}: temp files kept disappearing")

    def fence(self, token: TokenLike, names: Iterable[str] | None = None) -> None:
        """:meth:`claim` every file of the directory (or ``names``): ``fence=`` on acquire.

        Entries of the directory that are not resources (not a directory, or a name the guard
        never gives one, such as ``a b``) are skipped and logged. Every resource is claimed
        even if one cannot be: the first error is raised after all the others are fenced
        (the rest are logged), never leaving those after it unfenced."""
        if names is None:
            names = self._resource_names()
        errors: list[Exception] = []
        for name in names:
            try:
                self.claim(name, token=token)
            except Exception as exc:  # (each one: fence the others first)
                if errors:
                    logger.warning("fence: %r not fenced either: %s", name, exc)
                errors.append(exc)
        if errors:
            raise errors[0]

    def _resource_names(self) -> list[str]:
        names = []
        for entry in sorted(os.listdir(self.directory)):
            if entry.startswith("."):
                continue  # (the guard's own files: .fenced-lock)
            if not os.path.isdir(os.path.join(self.directory, entry)):
                why = "not a directory"
            elif not _NAME_RE.fullmatch(entry):
                why = "not a name the guard gives a resource"
            else:
                names.append(entry)
                continue
            log_stray("fence skipped %s: %s", os.path.join(self.directory, entry), why)
        return names

    def _resource_dir(self, name: str, *, create: bool) -> str:
        rdir = os.path.join(self.directory, name)
        if rdir not in self._known_dirs:
            if create:
                # Durable even when it existed: its maker may have died before its fsync.
                mkdir_durably(rdir)
            try:
                info = os.lstat(rdir)  # (a symlink is never followed: it is refused)
            except FileNotFoundError:
                if create:
                    raise
                return rdir  # (nothing to read yet: the caller finds it missing)
            if not stat.S_ISDIR(info.st_mode):
                raise ConfigurationError(
                    f"{rdir} is not a directory (a symlink or a file): the file guard keeps "
                    f"the versions of {name!r} in a directory of that name"
                )
            # Checked once per guard and resource (never on the hot path; in the guard's
            # trusted directory nobody else can swap it): its owner, or anyone who may write
            # it, could plant versions, hold its lock file, or delete the mark they stand for.
            require_owned(rdir, info, "resource directory", "change or delete its versions")
            mode = stat.S_IMODE(info.st_mode)
            if mode & 0o022:
                raise ConfigurationError(
                    f"resource directory {rdir} may be written by other users (mode "
                    f"{mode:04o}), who can delete its newest version; run "
                    f"`chmod {DIR_MODE:o} {rdir}`"
                )
            self._known_dirs.add(rdir)
        return rdir

    def __repr__(self) -> str:
        return f"FileGuard({self.directory!r}, lock={self.lock!r})"


class AsyncFileGuard:
    """:class:`FileGuard` for asyncio code: the same implementation, each call run on a worker
    thread (``asyncio.to_thread``), because writing, fsync and ``flock`` block.

    As with any work handed to a thread, a write whose caller is cancelled may still complete
    (it is then a normal, fenced write: a later holder's token still wins). ``sync`` is the
    :class:`FileGuard` underneath.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        lock: str,
        verify: TokenVerifier | None = None,
    ) -> None:
        self.sync = FileGuard(directory, lock=lock, verify=verify)
        self.lock = self.sync.lock
        self.directory = self.sync.directory

    async def write(self, name: str, data: Data, *, token: TokenLike) -> Version:
        """See :meth:`FileGuard.write`."""
        return await asyncio.to_thread(self.sync.write, name, data, token=token)

    async def read(self, name: str) -> tuple[FencingToken, bytes]:
        """See :meth:`FileGuard.read`."""
        return await asyncio.to_thread(self.sync.read, name)

    async def latest(self, name: str) -> Version | None:
        return await asyncio.to_thread(self.sync.latest, name)

    async def high_water(self, name: str) -> FencingToken | None:
        return await asyncio.to_thread(self.sync.high_water, name)

    async def versions(self, name: str) -> list[Version]:
        return await asyncio.to_thread(self.sync.versions, name)

    async def prune(self, name: str, keep: int = 1) -> list[Version]:
        return await asyncio.to_thread(self.sync.prune, name, keep)

    async def publish(self, name: str, data: Data, *, token: TokenLike) -> Version:
        """See :meth:`FileGuard.publish` (the :class:`VersionStore` spelling of write)."""
        return await asyncio.to_thread(self.sync.publish, name, data, token=token)

    async def read_version(self, name: str, version: Version) -> bytes:
        return await asyncio.to_thread(self.sync.read_version, name, version)

    async def claim(self, name: str, *, token: TokenLike) -> bytes | None:
        """See :meth:`FileGuard.claim`: the fenced read."""
        return await asyncio.to_thread(self.sync.claim, name, token=token)

    async def fence(self, token: TokenLike, names: Iterable[str] | None = None) -> None:
        """See :meth:`FileGuard.fence`: ``fence=`` on acquire."""
        names = None if names is None else list(names)  # (an iterator: consumed here)
        await asyncio.to_thread(self.sync.fence, token, names)

    async def collect_garbage(self, name: str) -> int:
        return await asyncio.to_thread(self.sync.collect_garbage, name)

    def path(self, name: str, version: Version) -> str:
        """See :meth:`FileGuard.path`; not a coroutine: it only joins names (no I/O)."""
        return self.sync.path(name, version)

    def __repr__(self) -> str:
        return repr(self.sync).replace("FileGuard", "AsyncFileGuard", 1)


class HighWaterFile:
    """A durable high-water mark in one small file, for a resource updated in place elsewhere.

    The file holds the canonical token text ``lock:value``; it is only ever replaced
    atomically (a uniquely named temp file, created O_EXCL | O_NOFOLLOW and written under the
    lock, fsync, rename, fsync the directory), so it is never seen half-written, and never
    written through a symlink. ``<path>.lock`` is the ``flock`` every writer takes.

    Keep it in a directory only its user can write: a directory owned by another user, or
    writable by group or others without the sticky bit (they could delete the mark or put an
    old one back), and a mark or lock file owned by another user, are refused
    (ConfigurationError).

    * ``with mark.hold(token=t): write()`` — check, advance durably, and keep the lock across
      your write: check and write are one step for everyone using this file. The mark is
      advanced *before* your write, so a crash in between leaves the mark ahead of the data
      (harmless: a stale writer is still refused), never behind it.
    * ``mark.check_and_advance(token=token)`` — the same check and advance, releasing the lock at
      once: your later write is a second step. Use it to gate something that is itself
      ordered or idempotent, not for in-place writes that a slower writer could overwrite.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, lock: str, verify: TokenVerifier | None = None
    ) -> None:
        self.verifier = verify  # checks each token before the mark (see fenced._core.signing)
        self.lock = validate_lock_name(lock)
        self.path = os.path.abspath(os.fspath(path))
        self._dir, base = os.path.split(self.path)
        self._lock_path = self.path + ".lock"
        self._temp_prefix = f".{base}.tmp-"
        self._temp_pattern = re.compile(re.escape(self._temp_prefix) + "[0-9a-f]{32}")
        self._dir_trusted = False

    def _check_dir(self) -> None:
        """The mark's directory and every parent: a trusted path (see
        :func:`~fenced._core.paths.require_trusted_path`), walked once (nobody else can
        change a trusted path); the directory itself on every call, one stat, as before (its
        owner may have opened it to others since)."""
        if not self._dir_trusted:
            what = f"the high-water file {self.path}"
            self._dir_trusted = require_trusted_path(self._dir, what)
        require_unshared_dir(self._dir, f"the high-water file {os.path.basename(self.path)}")

    def current(self) -> FencingToken | None:
        """The mark: the highest token accepted so far, or None if none was.

        The mark file is never a symlink (the guard replaces it with ``rename``, which does
        not follow one): a symlink there was planted, and is refused as a corrupt mark
        rather than followed to a file someone else chose."""
        # A directory others could write, or one on its path, would let them delete or
        # replace the mark (and put an old one back): refused, as a mark of another user is.
        self._check_dir()
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError:
            if os.path.islink(self.path):
                raise CorruptMarkError(self.path, "high-water file is a symlink") from None
            raise
        with open(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CorruptMarkError(self.path, "high-water file is not a regular file")
            require_owned(self.path, info, "high-water file", "set the mark to any value")
            text = f.read()
        try:
            return FencingToken.parse(text.rstrip(b"\n"), self.lock)
        except WrongLockError as exc:
            raise WrongLockError(f"high-water file {self.path}: {exc}") from exc
        except InvalidTokenError as exc:
            raise CorruptMarkError(self.path, f"high-water file holds {text[:40]!r}") from exc

    @token_keyword()
    def check_and_advance(self, *, token: TokenLike) -> FencingToken:
        """Accept ``token`` if >= the mark and make it the mark (durably); return it."""
        with self.hold(token=token) as accepted:
            return accepted

    def fence(self, token: TokenLike) -> None:
        """``fence=`` on acquire: :meth:`check_and_advance`."""
        self.check_and_advance(token=token)

    @contextlib.contextmanager
    @token_keyword()
    def hold(self, *, token: TokenLike) -> Iterator[FencingToken]:
        """Check and advance the mark, then hold the lock for the ``with`` body (your write)."""
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        self._check_dir()  # (before its lock file is opened there)
        with self._locked():
            mark = self.current()
            if mark is not None and not self._accepts(tok.value, mark.value):
                raise StaleTokenError(tok, mark, self.path)
            if mark is None or tok.value != mark.value:
                self._store(tok)
            yield tok

    # hooks, as in FileGuard
    def _accepts(self, token: int, mark: int) -> bool:
        return token >= mark

    def _locked(self) -> contextlib.AbstractContextManager[object]:
        return flocked(self._lock_path)

    def _store(self, token: FencingToken) -> None:
        # A unique temp name, created O_EXCL | O_NOFOLLOW: a name planted in a shared
        # directory (a symlink to someone's file) is never followed, truncated or renamed
        # into the mark's place; rename replaces the mark's *name*, never what it points to.
        for _ in range(_RETRIES):
            try:
                temp = TempFile(self._dir, self._temp_prefix)
            except BlockingIOError:  # a collector grabbed the fresh temp file: take another
                continue
            try:
                write_all(temp.fd, f"{token}\n".encode())
                os.fsync(temp.fd)
                try:
                    os.rename(temp.path, self.path)
                except FileNotFoundError:
                    continue  # a collector removed our temp name: write it again
            finally:
                temp.close()
            fsync_dir(self._dir)
            # Temp files of writers that died before their rename (never a live one's).
            collect_temps(self._dir, pattern=self._temp_pattern)
            return
        raise OSError(f"could not replace {self.path}: temp files kept disappearing")

    def __repr__(self) -> str:
        return f"HighWaterFile({self.path!r}, lock={self.lock!r})"
