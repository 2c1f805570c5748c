"""S3 (and compatible object stores) as the fenced resource: the files guard's
:class:`~fenced.guards.files.VersionStore` over conditional writes.

DDIA's advice for a file store — put the token in the file name — as objects::

    store = S3VersionStore(boto3.client("s3"), "reports-bucket", lock="reports")
    store.publish("daily", b"...", token=lease.token)     # StaleTokenError if fenced off
    token, data = store.read("daily")                      # the newest accepted version

Per name, the bucket holds immutable **version objects** ``<prefix><name>/<token:019d>.<seq:06d>``
and one **mark object** ``<prefix><name>/.mark`` (JSON: the lock, the highest token accepted,
and the version that is current). Publishing is::

    read the mark (its ETag E): refuse if token < mark's token, or another lock
    PUT the version object           If-None-Match: *    (never overwrites: a taken name -> next seq)
    PUT the mark -> this version     If-Match: E         (If-None-Match: * for the first one)

The mark's conditional PUT is the commit point: a compare-and-swap on one object, so
publishes are totally ordered by it, and a reader (mark, then the version it names) sees
exactly the committed versions. A publisher that lost the race re-reads the mark and is
refused if it is now stale: its version object was uploaded but is never current (an
*orphan*; :meth:`~S3VersionStore.prune` deletes it). So a stale writer can upload bytes but
can never make them the current version, and a version object, once current, never changes.
``fence(token)`` raises the mark's token alone (fence on acquire).

Which stores support it: the store must enforce ``If-None-Match: *`` and ``If-Match`` on PUT.
Amazon S3 documents both (``If-None-Match`` since August 2024, ``If-Match`` since November
2024); moto, the emulator the tests run against, enforces both. For any other store (MinIO,
R2, Ceph, ...), call :meth:`~S3VersionStore.verify_conditional` once against a bucket: a store
that ignores the headers would silently lose the guarantee, and this checks that it refuses.

:class:`AsyncS3VersionStore` takes an aiobotocore client and awaits it (given a boto3 client,
it runs each request on a worker thread). Both run the same request plans (``_aws``): the
protocol above is written once.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

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
from ._aws import Call, Plan, arun, error_code, is_transport_error, run
from .files import Data, Version

__all__ = ["AsyncS3VersionStore", "S3VersionStore"]

_NAME_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@+=-]{0,199}")
_VERSION_RE: Final = re.compile(r"([0-9]{19})\.([0-9]{6})")
_MARK: Final = ".mark"
_RETRIES: Final = 50


class _Plans:
    """The store's state and its operations as request plans (run by the two classes below)."""

    def __init__(
        self,
        client: Any,
        bucket: str,
        *,
        lock: str,
        prefix: str = "",
        verify: TokenVerifier | None = None,
    ) -> None:
        if not isinstance(bucket, str) or not bucket:
            raise ConfigurationError(f"bucket must be a bucket name, not {bucket!r}")
        if not isinstance(prefix, str) or (prefix and not prefix.endswith("/")):
            raise ConfigurationError(f"prefix must be empty or end with '/', not {prefix!r}")
        try:
            self.lock = validate_lock_name(lock)
        except InvalidTokenError as exc:
            raise ConfigurationError(f"lock of bucket {bucket!r}: {exc}") from None
        self.client, self.bucket, self.prefix, self.verifier = client, bucket, prefix, verify
        # name -> the mark as this store last wrote it (lock, token, current, ETag): a holder
        # publishing again skips the GET; the If-Match on the ETag is what decides, and marks
        # only grow, so a stale entry costs a retry, never a wrong acceptance.
        self._seen: dict[str, tuple[str, int, Version | None, str]] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.bucket!r}, prefix={self.prefix!r}, lock={self.lock!r})"

    # -- keys and the mark ----------------------------------------------------------------------

    def _name(self, name: object) -> str:
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ConfigurationError(
                f"invalid name {name!r}: 1-200 characters of A-Z a-z 0-9 _ . @ + = -, "
                "not starting with a punctuation mark"
            )
        return name

    def _key(self, name: str, leaf: str) -> str:
        return f"{self.prefix}{name}/{leaf}"

    def _where(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{name}"

    def _accepts(self, token: int, mark: int) -> bool:
        return mark <= token

    def _call(self, op: str, *, body: bool = False, **kw: Any) -> Plan[Any]:
        try:
            return (yield Call(op, kw, body))
        except Exception as exc:
            code = _code(exc)
            if code in ("NoSuchBucket",):
                raise ConfigurationError(f"bucket {self.bucket!r} does not exist") from exc
            if code is None and is_transport_error(exc):
                raise BackendUnavailable(
                    f"object store unreachable: {type(exc).__name__}: {exc}"
                ) from exc
            raise

    def _read_mark(self, name: str) -> Plan[tuple[str, int, Version | None, str] | None]:
        """(lock, token, current version, ETag) of ``name``'s mark, or None if never written."""
        try:
            got = yield from self._call(
                "get_object", body=True, Bucket=self.bucket, Key=self._key(name, _MARK)
            )
        except Exception as exc:
            if _code(exc) in ("NoSuchKey", "404"):
                return None
            raise
        raw = got["Body"]
        try:
            doc = json.loads(raw)
            lock, value, current = doc["lock"], doc["token"], doc["version"]
            if set(doc) != {"lock", "token", "version"} or type(value) is not int:
                raise ValueError(doc)
            if not 0 < value <= MAX_TOKEN:
                raise ValueError(value)
            validate_lock_name(lock)
            version = None
            if current is not None:
                m = _VERSION_RE.fullmatch(current)
                if m is None or not 0 < int(m.group(1)) <= value:
                    raise ValueError(current)
                version = Version(FencingToken(lock, int(m.group(1))), int(m.group(2)))
        except Exception as exc:
            raise CorruptMarkError(self._where(name), f"mark object holds {raw[:80]!r}") from exc
        return lock, value, version, got["ETag"]

    def _check(self, name: str, tok: FencingToken, mark: tuple[str, int, Any, str] | None) -> None:
        if mark is None:
            return
        lock, value = mark[0], mark[1]
        if lock != tok.lock:
            raise WrongLockError(
                f"{self._where(name)} is fenced by lock {lock!r}; token {tok} belongs to lock "
                f"{tok.lock!r}"
            )
        if not self._accepts(tok.value, value):
            raise StaleTokenError(tok, FencingToken(lock, value), self._where(name))

    def _swap_mark(
        self, name: str, mark: Any, tok: FencingToken, version: Version | None
    ) -> Plan[str | None]:
        """Compare-and-swap the mark; its new ETag, or None if it changed since it was read."""
        body = json.dumps(
            {
                "lock": tok.lock,
                "token": max(tok.value, mark[1] if mark else 0),
                "version": version.filename
                if version
                else (mark[2].filename if mark and mark[2] else None),
            }
        ).encode()
        cond = {"IfMatch": mark[3]} if mark else {"IfNoneMatch": "*"}
        try:
            got = yield from self._call(
                "put_object", Bucket=self.bucket, Key=self._key(name, _MARK), Body=body, **cond
            )
        except Exception as exc:
            if _code(exc) in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                return None
            raise
        new = version or (mark[2] if mark else None)
        self._seen[name] = (tok.lock, max(tok.value, mark[1] if mark else 0), new, got["ETag"])
        return str(got["ETag"])

    # -- the VersionStore protocol, as plans --------------------------------------------------

    def _publish(self, name: str, data: Data, token: TokenLike) -> Plan[Version]:
        name = self._name(name)
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        body = bytes(data)
        cached = self._seen.pop(name, None)  # as this store last left it: no GET (see _seen)
        for _ in range(_RETRIES):
            mark = cached if cached is not None else (yield from self._read_mark(name))
            if cached is not None and (
                cached[0] != tok.lock or not self._accepts(tok.value, cached[1])
            ):
                cached = None
                continue  # a refusal is decided on what the store holds now
            cached = None
            self._check(name, tok, mark)
            current = mark[2] if mark else None
            seq = current.seq + 1 if current is not None and current.token.value == tok.value else 0
            while True:  # a free name for this token: If-None-Match never overwrites
                version = Version(tok, seq)
                try:
                    yield from self._call(
                        "put_object",
                        Bucket=self.bucket,
                        Key=self._key(name, version.filename),
                        Body=body,
                        IfNoneMatch="*",
                    )
                    break
                except Exception as exc:
                    if _code(exc) not in (
                        "PreconditionFailed",
                        "412",
                        "ConditionalRequestConflict",
                        "409",
                    ):
                        raise
                    seq += 1
            if (yield from self._swap_mark(name, mark, tok, version)):
                return version
            # the mark moved: decide again (the uploaded object is an orphan, never current)
        raise FenceConflictError(f"the mark of {self._where(name)} kept moving; try again")

    def _fence(self, token: TokenLike, names: list[str] | None) -> Plan[None]:
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        for name in names if names is not None else (yield from self._names()):
            name = self._name(name)
            for _ in range(_RETRIES):
                mark = yield from self._read_mark(name)
                self._check(name, tok, mark)
                if (yield from self._swap_mark(name, mark, tok, None)):
                    break
            else:
                raise FenceConflictError(f"the mark of {self._where(name)} kept moving")

    def _latest(self, name: str) -> Plan[Version | None]:
        mark = yield from self._read_mark(self._name(name))
        return mark[2] if mark else None

    def _high_water(self, name: str) -> Plan[FencingToken | None]:
        mark = yield from self._read_mark(self._name(name))
        return FencingToken(mark[0], mark[1]) if mark else None

    def _read(self, name: str) -> Plan[tuple[FencingToken, bytes]]:
        version = yield from self._latest(name)
        if version is None:
            raise ResourceNotFoundError(f"{self._where(name)} has no version")
        return version.token, (yield from self._read_version(name, version))

    def _read_version(self, name: str, version: Version) -> Plan[bytes]:
        key = self._key(self._name(name), version.filename)
        try:
            got = yield from self._call("get_object", body=True, Bucket=self.bucket, Key=key)
        except Exception as exc:
            if _code(exc) in ("NoSuchKey", "404"):
                raise ResourceNotFoundError(
                    f"{self._where(name)}/{version.filename} is gone"
                ) from exc
            raise
        return bytes(got["Body"])

    def _keys(self, prefix: str) -> Plan[list[str]]:
        """Every key under ``prefix`` (ListObjectsV2, page by page)."""
        keys: list[str] = []
        more: dict[str, Any] = {}
        while True:
            page = yield from self._call(
                "list_objects_v2", Bucket=self.bucket, Prefix=prefix, **more
            )
            keys += [obj["Key"] for obj in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return keys
            more = {"ContinuationToken": page["NextContinuationToken"]}

    def _objects(self, name: str) -> Plan[list[tuple[Version, str]]]:
        out = []
        for key in (yield from self._keys(self._key(name, ""))):
            m = _VERSION_RE.fullmatch(key.rsplit("/", 1)[-1])
            if m:
                out.append(
                    (Version(FencingToken(self.lock, int(m.group(1))), int(m.group(2))), key)
                )
        return out

    def _versions(self, name: str) -> Plan[list[Version]]:
        current = yield from self._latest(name)
        if current is None:
            return []
        return sorted(v for v, _ in (yield from self._objects(self._name(name))) if v <= current)

    def _prune(self, name: str, keep: int) -> Plan[list[Version]]:
        if keep < 1:
            raise ConfigurationError("prune keeps at least the current version (keep >= 1)")
        name = self._name(name)
        current = yield from self._latest(name)
        if current is None:
            return []
        older = sorted((v, k) for v, k in (yield from self._objects(name)) if v <= current)
        doomed = older[: max(0, len(older) - keep)]
        for _, key in doomed:
            yield from self._call("delete_object", Bucket=self.bucket, Key=key)
        return [v for v, _ in doomed]

    def _names(self) -> Plan[list[str]]:
        out = []
        for key in (yield from self._keys(self.prefix)):
            rest = key[len(self.prefix) :]
            if rest.endswith("/" + _MARK) and rest.count("/") == 1:
                out.append(rest.split("/", 1)[0])
        return out

    def _verify_conditional(self) -> Plan[None]:
        key = f"{self.prefix}.fenced-probe"
        yield from self._call("put_object", Bucket=self.bucket, Key=key, Body=b"1")
        try:
            conds: tuple[dict[str, Any], ...] = ({"IfNoneMatch": "*"}, {"IfMatch": '"0000"'})
            for cond in conds:
                try:
                    yield from self._call(
                        "put_object", Bucket=self.bucket, Key=key, Body=b"2", **cond
                    )
                except Exception as exc:
                    if _code(exc) in ("PreconditionFailed", "412"):
                        continue
                    raise
                raise ConfigurationError(
                    f"the store behind bucket {self.bucket!r} ignores {next(iter(cond))}: it "
                    "cannot be fenced with conditional writes"
                )
        finally:
            yield from self._call("delete_object", Bucket=self.bucket, Key=key)


class S3VersionStore(_Plans):
    """Token-versioned objects in ``bucket`` under ``prefix`` for the lock ``lock``, on a
    boto3 S3 client (see the module doc)."""

    def publish(self, name: str, data: Data, *, token: TokenLike) -> Version:
        """Store ``data`` as the new current version of ``name`` iff ``token`` is not stale."""
        return run(self.client, self._publish(name, data, token))

    write = publish

    def fence(self, token: TokenLike, names: list[str] | None = None) -> None:
        """Raise the marks of ``names`` (default: every name under the prefix) to ``token``."""
        run(self.client, self._fence(token, names))

    def latest(self, name: str) -> Version | None:
        """The current version of ``name`` (None if never published)."""
        return run(self.client, self._latest(name))

    def high_water(self, name: str) -> FencingToken | None:
        """The highest token ``name``'s mark holds (None if never written)."""
        return run(self.client, self._high_water(name))

    def read(self, name: str) -> tuple[FencingToken, bytes]:
        """The current version's token and content (ResourceNotFoundError if none)."""
        return run(self.client, self._read(name))

    def read_version(self, name: str, version: Version) -> bytes:
        """The content of one version object (ResourceNotFoundError if pruned)."""
        return run(self.client, self._read_version(name, version))

    def versions(self, name: str) -> list[Version]:
        """The version objects up to the current one, oldest first (a stale publish refused
        after its upload leaves an orphan among them that never was current)."""
        return run(self.client, self._versions(name))

    def prune(self, name: str, keep: int = 1) -> list[Version]:
        """Delete versions older than the ``keep`` newest up to the current one (and orphans
        among them). Objects above the current one may be in-flight publishes: kept."""
        return run(self.client, self._prune(name, keep))

    def names(self) -> list[str]:
        """Every name that has a mark under the prefix."""
        return run(self.client, self._names())

    def verify_conditional(self) -> None:
        """Check once that the store enforces ``If-None-Match: *`` and ``If-Match`` (a store
        that ignores them would let a stale writer in); ConfigurationError if it does not."""
        run(self.client, self._verify_conditional())


_code = error_code


class AsyncS3VersionStore(_Plans):
    """:class:`S3VersionStore` for asyncio, on an aiobotocore client (or a boto3 client, each
    request on a worker thread): the same request plans, awaited."""

    async def publish(self, name: str, data: Data, *, token: TokenLike) -> Version:
        return await arun(self.client, self._publish(name, data, token))

    write = publish

    async def fence(self, token: TokenLike, names: list[str] | None = None) -> None:
        await arun(self.client, self._fence(token, names))

    async def latest(self, name: str) -> Version | None:
        return await arun(self.client, self._latest(name))

    async def high_water(self, name: str) -> FencingToken | None:
        return await arun(self.client, self._high_water(name))

    async def read(self, name: str) -> tuple[FencingToken, bytes]:
        return await arun(self.client, self._read(name))

    async def read_version(self, name: str, version: Version) -> bytes:
        return await arun(self.client, self._read_version(name, version))

    async def versions(self, name: str) -> list[Version]:
        return await arun(self.client, self._versions(name))

    async def prune(self, name: str, keep: int = 1) -> list[Version]:
        return await arun(self.client, self._prune(name, keep))

    async def names(self) -> list[str]:
        return await arun(self.client, self._names())

    async def verify_conditional(self) -> None:
        await arun(self.client, self._verify_conditional())
