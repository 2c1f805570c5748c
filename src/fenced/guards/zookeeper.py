"""ZooKeeper as the fenced resource: writes to znodes, each ONE ``multi`` that checks the mark.

Junqueira's note asks what a master fences when the resource is ZooKeeper itself ("an obvious
candidate"): here, the znodes it writes. ::

    zk = KazooClient("127.0.0.1:2181"); zk.start()
    guard = ZooKeeperGuard(zk, "scheduler")
    guard.set("/scheduler/plan", b"...", token=lease.token)     # StaleTokenError if fenced off
    guard.delete("/scheduler/old", token=lease.token)

The resource's mark is one znode, ``<root>/marks/<resource>`` (default root ``/fenced``),
whose data is ``<lock>\\n<19-digit token>``. A write is one ZooKeeper transaction (``multi``),
applied atomically or not at all::

    read the mark node: (lock, m) at version v      # m: the highest token accepted
    refuse now if token < m (StaleTokenError) or lock differs (WrongLockError)
    multi:  set mark = token if version == v   (or: check version == v, when token == m;
                                                or: create the mark node, when there is none)
            the caller's create / set / delete
    a failed version check (another writer moved the mark meanwhile): read again, decide again

The comparison is made on a mark read at version ``v``, and the multi applies only if the
mark is still at version ``v``: check and write are one atomic step (optimistic, like etcd's
compare on a value). The mark only grows, so the retries end.

**Sessions.** The caution in the note is a client that silently gets a *new session* (its old
one expired while it was paused or cut off) and carries on as master. This guard does not rely
on the session at all: the mark is a persistent znode and every write carries the token, so a
client on its second session is refused exactly like one on its first once a later holder has
raised the mark (tested: a session expired under the holder, kazoo reconnects, the stale write
is refused). Ephemeral nodes and session ids are liveness, never safety.

**Reserved paths.** No guarded operation (``set``, ``create``, ``delete``, every op of a
``transaction``) may touch fenced's nodes, whichever ``root`` the guard has and whatever chroot
its client uses. A path is judged as the server will see it (the client's chroot prepended,
empty parts dropped, as kazoo does) and refused if it lies under the guard's own ``root``, has
a component ``fenced`` (the default root and the lock source's ``/fenced/locks``, under any
chroot), or names a mark of any root (a component ``marks`` followed by one starting ``r-``).
So no guard can rewrite or delete another resource's mark, nor its own.

A mark that does not parse is :class:`~fenced.CorruptMarkError` and refuses every write; so is
a mark node that is missing, or lower, after this guard has seen it (deleted outside fenced,
perhaps created again lower: the mark would restart below tokens already accepted).
:class:`AsyncZooKeeperGuard` runs the same code on a worker thread (kazoo is a threaded
client; its calls block).
"""

from __future__ import annotations

import asyncio
import threading
from itertools import pairwise
from typing import Any, Final
from urllib.parse import quote

from kazoo.exceptions import (
    BadVersionError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    RolledBackError,
)

from .._clients import kazoo_errors as _kazoo_errors
from .._core.errors import (
    BackendUnavailable,
    ConfigurationError,
    CorruptMarkError,
    FenceConflictError,
    InvalidTokenError,
    ResourceNotFoundError,
    StaleTokenError,
    WrongLockError,
)
from .._core.signing import TokenVerifier
from .._core.token import MAX_TOKEN, FencingToken, TokenLike, validate_lock_name
from ._sql_plan import validate_resource  # (the one rule for resource names)
from ._token_arg import lock_keyword

__all__ = ["AsyncZooKeeperGuard", "ZooKeeperGuard"]

_RETRIES: Final = 50  # mark moves under a writer; each retry reads the newer mark
NAMESPACE: Final = "fenced"
"""A path component no guarded operation may contain, under any chroot: fenced's own nodes
(the default root ``/fenced``, the lock source's ``/fenced/locks``)."""
MARKS: Final = "marks"
MARK_PREFIX: Final = "r-"
"""A mark is ``<root>/marks/r-<resource>``: a component ``marks`` followed by one starting
``r-`` is a mark of some root, and reserved whatever the guard's own root is."""
# Unanswered: the source's reading (an expired session too: the guard owns none).
_GONE: Final = (*_kazoo_errors.UNREACHABLE, *_kazoo_errors.SESSION_LOST)


def _encode(lock: str, value: int) -> bytes:
    return f"{lock}\n{value:019d}".encode()


class ZooKeeperGuard:
    """Fenced writes to znodes for ``resource``, with the mark in ZooKeeper (see the module).

    ``client``: a started ``KazooClient`` (yours: the guard never stops it). ``lock``: the
    lock whose tokens are accepted (default: the resource name). ``root``: fenced's reserved
    subtree. ``verify``: check signed tokens before the mark (see ``fenced._core.signing``).
    """

    @lock_keyword()
    def __init__(
        self,
        client: Any,
        resource: str,
        *,
        lock: str | None = None,
        root: str = "/fenced",
        verify: TokenVerifier | None = None,
    ) -> None:
        validate_resource(resource)
        if (
            not isinstance(root, str)
            or not root.startswith("/")
            or any(part in ("", ".", "..") for part in root[1:].split("/"))
        ):
            raise ConfigurationError(
                f"root must be an absolute znode path like '/fenced', not {root!r}"
            )
        self.client = client
        self.resource = resource
        try:
            self.lock = validate_lock_name(resource if lock is None else lock)
        except InvalidTokenError as exc:
            raise ConfigurationError(f"lock of {resource!r}: {exc}; pass lock=") from None
        self.root = root
        self.verifier = verify
        # percent-encoded: one path segment for any resource name, never "." or ".."
        self.mark_path = f"{root}/{MARKS}/{MARK_PREFIX}{quote(resource, safe='')}"
        # the root as the server sees it: under the client's chroot (kazoo prepends it)
        self._root_parts = _parts(f"{_chroot(client)}{root}")
        self._seen: tuple[str, int, int] | None = None
        # the highest mark this guard has seen: once seen, the mark node may not vanish
        self._highest: int | None = None
        self._saw_lock = threading.Lock()
        self._present: set[str] = set()  # znodes set() found existing: try set_data first

    def __repr__(self) -> str:
        return f"ZooKeeperGuard({self.resource!r}, lock={self.lock!r}, root={self.root!r})"

    # -- the mark -------------------------------------------------------------------------------

    def _accepts(self, token: int, mark: int) -> bool:
        return mark <= token

    def _parse(self, raw: bytes) -> tuple[str, int]:
        try:
            lock, digits = raw.decode("ascii").split("\n")
            value = int(digits)
            if len(digits) != 19 or not digits.isdigit() or not 0 < value <= MAX_TOKEN:
                raise ValueError(digits)
            validate_lock_name(lock)
        except Exception as exc:  # undecodable, malformed, out of range, a bad lock name
            raise CorruptMarkError(self.resource, f"mark node holds {raw[:60]!r}") from exc
        return lock, value

    def _read_mark(self) -> tuple[str, int, int] | None:
        """(lock, mark, version) of the mark node, or None if the resource was never fenced."""
        # What this guard had seen accepted when the read was sent: the read reflects it. A
        # write of another thread on this guard that lands while the read is on its way is
        # not a step back of the mark (found racing two threads on one guard).
        highest = self._highest
        try:
            raw, stat = self.client.get(self.mark_path)
        except NoNodeError:
            if highest is not None:
                # Deleted outside fenced (a guarded write cannot reach it): creating it
                # again would accept tokens below ones already accepted. Fail closed.
                raise CorruptMarkError(
                    self.resource,
                    f"the mark node {self.mark_path!r} is gone, after this guard saw token "
                    f"{highest} accepted",
                ) from None
            return None
        lock, value = self._parse(raw)
        if highest is not None and value < highest:
            # Marks only grow: deleted and created again lower (by a guard that never saw it)
            raise CorruptMarkError(
                self.resource,
                f"the mark went back to {value}, after this guard saw token {highest} accepted",
            )
        self._saw(value)
        return lock, value, stat.version

    def _saw(self, value: int) -> None:
        with self._saw_lock:  # (threads share a guard: the highest seen never goes down)
            if self._highest is None or value > self._highest:
                self._highest = value

    def high_water(self) -> FencingToken | None:
        """The highest token accepted so far, or None if never fenced."""
        try:
            got = self._read_mark()
        except _GONE as exc:
            raise BackendUnavailable(f"ZooKeeper unavailable: {type(exc).__name__}") from exc
        return None if got is None else FencingToken(got[0], got[1])

    # -- writes ---------------------------------------------------------------------------------

    def _path(self, path: object) -> str:
        """``path``, if a guarded operation may touch it (relative to the client's chroot)."""
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
            raise ConfigurationError(f"a znode path is an absolute str path, not {path!r}")
        if path.rstrip("/") == "" or path.endswith("/"):
            raise ConfigurationError(f"invalid znode path {path!r}")
        if any(part in (".", "..") for part in path.split("/")):
            raise ConfigurationError(f"a znode path has no '.' or '..' parts: {path!r}")
        self._check_absolute(path, _parts(f"{_chroot(self.client)}{path}"))
        return path

    def _check_absolute(self, shown: str, parts: tuple[str, ...]) -> None:
        """Refuse a path (its components as the server sees them) in fenced's nodes."""
        why = None
        if parts[: len(self._root_parts)] == self._root_parts:
            why = f"is in this guard's root {self.root!r}"
        elif NAMESPACE in parts:
            why = f"has a component {NAMESPACE!r} (fenced's namespace)"
        elif any(a == MARKS and b.startswith(MARK_PREFIX) for a, b in pairwise(parts)):
            why = f"names a fenced mark ('{MARKS}/{MARK_PREFIX}...')"
        if why is not None:
            raise ConfigurationError(
                f"{shown!r} {why}: a guarded write may not touch fenced's reserved nodes"
            )

    def _write(self, token: TokenLike, ops: Any) -> FencingToken:
        """Run the caller's ops (a function adding them to a kazoo transaction) in one multi
        with the mark's check-and-raise; retry while the mark moves under us."""
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        try:
            return self._write_once_or_retry(tok, ops)
        except _GONE as exc:
            raise BackendUnavailable(
                f"ZooKeeper unavailable while writing {self.resource!r}: {type(exc).__name__} "
                "(the write may or may not have been applied)"
            ) from exc

    def _write_once_or_retry(self, tok: FencingToken, ops: Any) -> FencingToken:
        # The mark as this guard last left it: a holder writing again needs no read (one round
        # trip). Only a version check that passes makes a decision final, and marks only grow,
        # so a stale cache can cost a retry, never a wrong acceptance.
        seen = self._seen
        for _ in range(_RETRIES):
            cached, got = seen is not None, seen if seen is not None else self._read_mark()
            seen = None
            if got is not None:
                lock, mark, _ = got
                if cached and (lock != tok.lock or not self._accepts(tok.value, mark)):
                    self._seen = None
                    continue  # a refusal is decided on what the node holds now
                if lock != tok.lock:
                    raise WrongLockError(
                        f"{self.resource!r} is fenced by lock {lock!r}; token {tok} belongs to "
                        f"lock {tok.lock!r}"
                    )
                if not self._accepts(tok.value, mark):
                    raise StaleTokenError(tok, FencingToken(lock, mark), self.resource)
            else:
                self.client.ensure_path(self.mark_path.rsplit("/", 1)[0])
            t = self.client.transaction()
            if got is None:
                t.create(self.mark_path, _encode(tok.lock, tok.value))
            elif tok.value > got[1]:
                t.set_data(self.mark_path, _encode(tok.lock, tok.value), version=got[2])
            else:
                t.check(self.mark_path, got[2])
            path, racy = ops(t)
            results = t.commit()
            failed = [r for r in results if isinstance(r, Exception)]
            if not failed:
                self._saw(tok.value)
                if got is None:
                    self._seen = (tok.lock, tok.value, 0)
                elif tok.value > got[1]:
                    self._seen = (tok.lock, tok.value, got[2] + 1)
                else:
                    self._seen = got
                return tok
            if isinstance(results[0], BadVersionError | NodeExistsError | NoNodeError):
                self._seen = None
                continue  # the mark moved (or appeared) since we read it: decide again
            why = next((r for r in results[1:] if not isinstance(r, RolledBackError)), failed[0])
            if racy and isinstance(why, NodeExistsError | NoNodeError):
                self._present.discard(path)
                continue  # set(): the znode appeared or went since we looked
            raise _data_error(why, path)
        raise FenceConflictError(
            f"the mark of {self.resource!r} kept moving while writing with {tok}; try again"
        )

    def fence(self, token: TokenLike) -> None:
        """Raise the mark to ``token`` without writing (fence on acquire)."""
        self._write(token, lambda t: (None, False))

    def set(self, path: str, data: bytes, *, token: TokenLike) -> FencingToken:
        """Set ``path``'s data (creating the znode, and its parents, if missing) iff the token
        is not stale; one multi with the mark check. Returns the accepted token."""
        path = self._path(path)
        data = _data(data)

        def ops(t: Any) -> tuple[str, bool]:
            # (known to exist: set_data in the multi, no look first; a NoNode sends us round
            # again, and then we look)
            if path in self._present or self.client.exists(path) is not None:
                self._present.add(path)
                t.set_data(path, data)
            else:
                self.client.ensure_path(path.rsplit("/", 1)[0] or "/")
                t.create(path, data)
            return path, True

        return self._write(token, ops)

    def create(self, path: str, data: bytes = b"", *, token: TokenLike) -> FencingToken:
        """Create ``path`` (its parent must exist) iff the token is not stale;
        :class:`~fenced.FencedError` subclasses for refusals, ``ConfigurationError`` if it
        exists."""
        path = self._path(path)
        data = _data(data)

        def ops(t: Any) -> tuple[str, bool]:
            t.create(path, data)
            return path, False

        return self._write(token, ops)

    def transaction(self, build: Any, *, token: TokenLike) -> FencingToken:
        """Your own operations in the fenced ``multi``: ``build(t)`` adds ``create``,
        ``set_data``, ``delete`` or ``check`` to the kazoo transaction ``t`` (after the mark's
        check), and all are applied or none. A path in the reserved subtree is refused before
        anything is sent. ``build`` may run again if the mark moves meanwhile."""

        def ops(t: Any) -> tuple[str, bool]:
            # build() gets a transaction of its own: it cannot reach the mark's op, and every
            # op it adds is checked (its path as kazoo made it: chroot prepended, normalised)
            # before any is sent.
            scratch = self.client.transaction()
            build(scratch)
            for op in scratch.operations:
                path = getattr(op, "path", None)
                if not isinstance(path, str):
                    raise ConfigurationError(f"not a znode operation: {op!r}")
                self._check_absolute(path, _parts(path))
            t.operations.extend(scratch.operations)
            return "(the transaction's paths)", False

        return self._write(token, ops)

    def delete(self, path: str, *, token: TokenLike) -> FencingToken:
        """Delete ``path`` (it must exist and have no children) iff the token is not stale."""
        path = self._path(path)

        def ops(t: Any) -> tuple[str, bool]:
            t.delete(path)
            return path, False

        return self._write(token, ops)


def _chroot(client: Any) -> str:
    """The chroot kazoo prepends to every path of ``client`` ("" for none)."""
    chroot = getattr(client, "chroot", None)
    return chroot if isinstance(chroot, str) else ""


def _parts(path: str) -> tuple[str, ...]:
    """A path's components as kazoo sends it: ``//`` collapsed, so ``/a//b`` is ``/a/b``."""
    return tuple(part for part in path.split("/") if part)


def _data(data: object) -> bytes:
    if not isinstance(data, bytes):
        raise ConfigurationError(f"znode data must be bytes, not {type(data).__name__}")
    return data


def _data_error(exc: Exception, path: object) -> Exception:
    if isinstance(exc, NoNodeError):
        return ResourceNotFoundError(f"no znode {path!r} (or its parent)")
    if isinstance(exc, NodeExistsError):
        return ConfigurationError(f"znode {path!r} exists already")
    if isinstance(exc, NotEmptyError):
        return ConfigurationError(f"znode {path!r} has children")
    return exc


class AsyncZooKeeperGuard:
    """:class:`ZooKeeperGuard` for asyncio: the same code, each call on a worker thread."""

    @lock_keyword()
    def __init__(self, client: Any, resource: str, *, lock: str | None = None, **kw: Any) -> None:
        self.sync = ZooKeeperGuard(client, resource, lock=lock, **kw)
        self.resource = self.sync.resource

    async def fence(self, token: TokenLike) -> None:
        await asyncio.to_thread(self.sync.fence, token)

    async def set(self, path: str, data: bytes, *, token: TokenLike) -> FencingToken:
        return await asyncio.to_thread(lambda: self.sync.set(path, data, token=token))

    async def create(self, path: str, data: bytes = b"", *, token: TokenLike) -> FencingToken:
        return await asyncio.to_thread(lambda: self.sync.create(path, data, token=token))

    async def delete(self, path: str, *, token: TokenLike) -> FencingToken:
        return await asyncio.to_thread(lambda: self.sync.delete(path, token=token))

    async def high_water(self) -> FencingToken | None:
        return await asyncio.to_thread(self.sync.high_water)
