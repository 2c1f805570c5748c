"""The resource under test: a register the workers read and write under their token.

The kit needs four things of a resource, and nothing about what it stores:

- ``read(token)``: the register's bytes (None when empty), read *fenced* if the resource can
  (the read raises the mark to ``token``, so no holder older than this one can write under
  what was read — see docs/guards-sql.md, "fence the read too");
- ``write(token, data)``: replace the register if ``token`` is not below the mark, as one
  atomic step; raise :class:`~fenced.StaleTokenError` (and write nothing) if it is;
- ``final()``: at the end, the register's bytes and the resource's high-water mark (None
  when it cannot say), read without a token;
- ``reset()`` (once, in the campaign process, before any worker) and ``close()``.

The workers keep, in the register, the list of every write that built on it (``[[token,
value], ...]``, each value one more than the last): a read-modify-write counter whose whole
past is in the final state, so the checkers can see a lost or a stale write in any resource.

A resource is named by a URL (:func:`open_resource`)::

    sqlite:////ABS/PATH?table=T           a row of table T (default fenced_check) + SQLGuard
    postgresql://USER@HOST:PORT/DB?table=T
    redis://HOST:PORT/DB?key=K            key K (default fenced-check) + RedisGuard (Lua)
    etcd://HOST:PORT[,HOST:PORT]?key=K    key K + EtcdGuard (txn)
    file:///DIR                           versions of DIR/register + FileGuard
    http://HOST:PORT/PATH                 GET/PUT PATH with a Fencing-Token header; 409 = refused
    python:MODULE:CLASS                   CLASS() implements the four methods above
    planted+sqlite:///PATH?plant=NAME     the kit's own planted-bug register (meta-tests)

The guarded ones are the guard URLs of :mod:`fenced.guards.registry` (the grammar of
``fenced group --member`` too), with the kit's ``?table=``/``?key=``; the kit's earlier
``sql+sqlite:///PATH`` and ``sql+postgresql://...`` still work, deprecated. Unlike a group
member, the kit makes the SQLite file if it does not exist (it resets the register anyway).

With no URL the kit uses an embedded SQLite file in the report directory.
"""

from __future__ import annotations

import importlib
import os
import sqlite3
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..._clients.tls import tls_context
from ..._core.backend import redacted
from ..._core.errors import ConfigurationError, StaleTokenError
from ..._core.signing import TokenVerifier
from ..._core.token import FencingToken
from ._register import KEY, Resource, SplitWrite, Volatile, sqlite_transaction

__all__ = ["HttpResource", "Resource", "SQLResource", "SplitWrite", "Volatile", "open_resource"]


class SQLResource:
    """One row ``(id, data)`` of a table, fenced by :class:`~fenced.guards.sql.SQLGuard` in the
    same transaction as the read and the write (SQLite file or PostgreSQL)."""

    def __init__(self, url: str, lock: str, verify: TokenVerifier | None = None) -> None:
        from ...guards.sql import SQLGuard, quote_table

        parsed = _guard_url(url)
        if parsed.kind.name != "sql" or parsed.dialect not in ("sqlite", "postgresql"):
            raise ConfigurationError(
                f"sql resource: the kit's register takes sqlite:// or postgresql://, "
                f"not {parsed.scheme}://"
            )
        self.driver = parsed.dialect
        self.table = parsed.params.get("table", "fenced_check")
        self._quoted = quote_table(self.table)
        # (a file path for SQLite; the libpq URL, without the kit's own query, for PostgreSQL)
        self.target = parsed.target
        self.guard = SQLGuard(KEY, lock=lock, verify=verify)
        self._conn: Any = None
        self.mark_param = "?" if self.driver == "sqlite" else "%s"

    @classmethod
    def in_memory(cls, lock: str, verify: TokenVerifier | None = None) -> SQLResource:
        """The register in an SQLite database in this process's memory, held by one
        connection (the simulator's, whose clients all run in one thread)."""
        made = cls("sqlite:////in-memory", lock, verify)  # (the URL names no file it opens)
        made.target = ":memory:"
        return made

    def _connect(self) -> Any:
        if self._conn is None:
            if self.driver == "sqlite":
                self._conn = sqlite3.connect(self.target, timeout=30, isolation_level=None)
                self._conn.execute("PRAGMA journal_mode=WAL")
            else:
                import psycopg

                self._conn = psycopg.connect(self.target, autocommit=True)
        return self._conn

    def _sql(self, text: str) -> str:
        return text.replace("?", self.mark_param).replace("{t}", self._quoted)

    def reset(self) -> None:
        conn = self._connect()
        conn.execute(self._sql("CREATE TABLE IF NOT EXISTS {t} (id TEXT PRIMARY KEY, data TEXT)"))
        conn.execute(self._sql("DELETE FROM {t} WHERE id = ?"), (KEY,))
        self.guard.install(conn)
        fences = self.guard.table
        conn.execute(self._sql(f"DELETE FROM {fences} WHERE resource = ?"), (KEY,))

    def _get(self, conn: Any) -> bytes | None:
        row = conn.execute(self._sql("SELECT data FROM {t} WHERE id = ?"), (KEY,)).fetchone()
        return None if row is None else str(row[0]).encode()

    def _transaction(self, conn: Any) -> Any:
        if self.driver == "sqlite":
            return sqlite_transaction(conn)
        return conn.transaction()

    def read(self, token: FencingToken) -> bytes | None:
        conn = self._connect()
        with self._transaction(conn):
            self.guard.check(conn, token=token)
            return self._get(conn)

    def write(self, token: FencingToken, data: bytes) -> None:
        conn = self._connect()
        with self._transaction(conn):
            self.guard.check(conn, token=token)
            conn.execute(self._sql("DELETE FROM {t} WHERE id = ?"), (KEY,))
            conn.execute(self._sql("INSERT INTO {t} VALUES (?, ?)"), (KEY, data.decode()))

    def final(self) -> tuple[bytes | None, int | None]:
        conn = self._connect()
        tok = self.guard.high_water(conn)
        return self._get(conn), None if tok is None else tok.value

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class RedisResource:
    """A key behind :class:`~fenced.guards.redis.RedisGuard`: the read is a guarded ``GET``
    (the fence check, the mark's advance and the read in one script)."""

    def __init__(self, url: str, lock: str, verify: TokenVerifier | None = None) -> None:
        from ...guards.registry import open_guard

        parsed = _guard_url(url)
        self.key = parsed.params.get("key", KEY)
        opened = open_guard(parsed, self.key, lock=lock, verify=verify, timeout=None)
        self.guard = opened.guard
        self.client = opened.client

    def reset(self) -> None:
        self.client.delete(self.key, self.guard.fence_key)

    def read(self, token: FencingToken) -> bytes | None:
        got = self.guard.eval("return redis.call('GET', KEYS[1])", [self.key], [], token=token)
        return got if got else None

    def write(self, token: FencingToken, data: bytes) -> None:
        self.guard.set(self.key, data, token=token)

    def final(self) -> tuple[bytes | None, int | None]:
        tok = self.guard.high_water()
        data = self.client.get(self.key)
        return (data if isinstance(data, bytes) else None), None if tok is None else tok.value

    def close(self) -> None:
        self.guard.close()


class EtcdResource:
    """A key behind :class:`~fenced.guards.etcd.EtcdGuard`. A guarded transaction takes only
    writes, so the fenced read is a guarded put of ``KEY.read`` (which raises the mark) and
    then the read: from then on no older holder can write, so what is read stays theirs."""

    def __init__(self, url: str, lock: str, verify: TokenVerifier | None = None) -> None:
        from ...guards.registry import open_guard

        parsed = _guard_url(url)
        self.key = parsed.params.get("key", KEY)
        self.endpoint = parsed.target
        opened = open_guard(parsed, self.key, lock=lock, verify=verify, timeout=None)
        self.guard = opened.guard

    def _txn(self, ops: list[Any], write: bool) -> Any:
        from aetcd import rpc

        txn = rpc.TxnRequest()
        for op in ops:
            txn.success.append(op)
        return self.guard.portal.call(self.guard.aio._txn(txn, write=write))

    def _get(self) -> bytes | None:
        from ...guards.etcd import get_op

        kvs = self._txn([get_op(self.key.encode())], write=False).responses[0].response_range.kvs
        return bytes(kvs[0].value) if kvs else None

    def reset(self) -> None:
        from ...guards.etcd import delete_op

        keys = (self.key.encode(), f"{self.key}.read".encode(), *self.guard.aio.keys.all)
        self._txn([delete_op(k) for k in keys], write=True)

    def read(self, token: FencingToken) -> bytes | None:
        self.guard.put(f"{self.key}.read", str(token.value), token=token)
        return self._get()

    def write(self, token: FencingToken, data: bytes) -> None:
        self.guard.put(self.key, data, token=token)

    def final(self) -> tuple[bytes | None, int | None]:
        tok = self.guard.high_water()
        return self._get(), None if tok is None else tok.value

    def close(self) -> None:
        self.guard.close()


class FileResource:
    """Versions of ``DIR/register`` behind :class:`~fenced.guards.files.FileGuard`.

    A file's mark is its newest version's token: the fenced read is
    :meth:`~fenced.guards.files.FileGuard.claim`, which publishes what it read again under
    its own token (and copies again if a stale writer slipped a version in between).
    """

    def __init__(self, url: str, lock: str, verify: TokenVerifier | None = None) -> None:
        from ...guards.registry import open_guard

        opened = open_guard(_guard_url(url), "register", lock=lock, verify=verify)
        self.guard = opened.guard
        self.dir = Path(opened.url.target)

    def reset(self) -> None:
        for v in self.guard.versions("register"):
            Path(self.guard.path("register", v)).unlink(missing_ok=True)
        self.guard.collect_garbage("register")

    def read(self, token: FencingToken) -> bytes | None:
        return self.guard.claim("register", token=token) or None

    def write(self, token: FencingToken, data: bytes) -> None:
        self.guard.write("register", data, token=token)

    def final(self) -> tuple[bytes | None, int | None]:
        latest = self.guard.latest("register")
        if latest is None:
            return None, None
        return self.guard.read_version("register", latest), latest.token.value

    def close(self) -> None:
        pass


class HttpResource:
    """Any HTTP service that fences on a ``Fencing-Token`` header (as
    :mod:`fenced.guards.asgi` does): ``GET URL`` reads (200 with the bytes, 404 when empty),
    ``PUT URL`` writes (2xx accepted, 409 refused as stale), each with the token; ``DELETE
    URL`` resets; a ``Fenced-High-Water`` response header, if sent, is the mark."""

    def __init__(
        self, url: str, lock: str, verify: TokenVerifier | None = None, timeout: float | None = None
    ) -> None:
        import httpx

        self.url = url
        # A request's bound: the campaign's (derived from its ttl: $FENCED_CHECK_IO_TIMEOUT in
        # its workers), else 30 s; a black hole then ends a run, not hangs it.
        if timeout is None:
            timeout = float(os.environ.get(IO_TIMEOUT_ENV) or 30)
        # (for http://, no CA bundle read: ~30 ms of CPU in each worker that opens one)
        plain = urlsplit(url).scheme.lower() == "http"
        self.client = httpx.Client(timeout=timeout, verify=tls_context("http") if plain else True)
        self._mark: int | None = None

    def _headers(self, token: FencingToken) -> dict[str, str]:
        return {"Fencing-Token": str(token)}

    def _refused(self, response: Any, token: FencingToken) -> None:
        if response.status_code == 409:
            raise StaleTokenError(token, None, redacted(self.url))
        response.raise_for_status()

    def reset(self) -> None:
        r = self.client.delete(self.url)
        if r.status_code not in (200, 204, 404, 405):
            r.raise_for_status()

    def read(self, token: FencingToken) -> bytes | None:
        r = self.client.get(self.url, headers=self._headers(token))
        if r.status_code == 404:
            return None
        self._refused(r, token)
        return r.content or None

    def write(self, token: FencingToken, data: bytes) -> None:
        self._refused(self.client.put(self.url, content=data, headers=self._headers(token)), token)

    def write_header(self, header: str | None, data: bytes) -> bool | None:
        """A PUT with ``header`` as its ``Fencing-Token`` as sent (None: no header), as a
        client that is not a holder sends it: True if accepted (2xx), False if refused (4xx),
        None for any other answer (the kit's ``impostor`` nemesis)."""
        headers = {} if header is None else {"Fencing-Token": header}
        status = self.client.put(self.url, content=data, headers=headers).status_code
        return True if 200 <= status < 300 else False if 400 <= status < 500 else None

    def read_header(self, header: str | None) -> bool | None:
        """A fenced GET with ``header`` as its ``Fencing-Token`` as sent: True if served (2xx,
        or 404: the service looked past the token for the data), False if refused (any other
        4xx), None for any other answer (the ``impostor`` nemesis' reads)."""
        headers = {} if header is None else {"Fencing-Token": header}
        status = self.client.get(self.url, headers=headers).status_code
        served = 200 <= status < 300 or status == 404
        return True if served else False if 400 <= status < 500 else None

    def final(self) -> tuple[bytes | None, int | None]:
        r = self.client.get(self.url)
        mark = r.headers.get("fenced-high-water")
        if r.status_code == 404:
            return None, None
        r.raise_for_status()
        return r.content or None, int(mark) if mark and mark.isdigit() else None

    def close(self) -> None:
        self.client.close()


def _python(spec: str, lock: str) -> Resource:
    target = spec.removeprefix("python:")
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"resource {spec!r}: give python:MODULE:CLASS")
    try:
        factory: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"resource {spec!r}: {exc}") from exc
    made = factory(lock) if _takes_argument(factory) else factory()
    missing = [m for m in ("reset", "read", "write", "final", "close") if not hasattr(made, m)]
    if missing:
        raise ConfigurationError(f"resource {spec!r}: the adapter has no {', '.join(missing)}")
    return made  # type: ignore[no-any-return]


def _takes_argument(factory: Callable[..., Any]) -> bool:
    import inspect

    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


IO_TIMEOUT_ENV = "FENCED_CHECK_IO_TIMEOUT"
"""Seconds an HTTP resource's request may take in a campaign's worker (the campaign sets it)."""


def open_resource(
    spec: str, lock: str, verify: TokenVerifier | None = None, *, timeout: float | None = None
) -> Resource:
    """The resource a URL names (see the module docstring), its guard verifying token
    signatures with ``verify`` when given (an HTTP service verifies for itself, a ``python:``
    adapter as it likes); an HTTP resource's requests bounded by ``timeout`` seconds (default:
    ``$FENCED_CHECK_IO_TIMEOUT``, else 30). Raises :class:`~fenced.ConfigurationError` for a
    URL it does not know."""
    scheme = urlsplit(spec).scheme.lower()
    if spec.startswith("python:"):
        return _python(spec, lock)
    if scheme == "planted+sqlite":
        from ._plants import PlantedSQLite

        return PlantedSQLite(spec, lock, verify)
    if scheme in ("http", "https"):
        return HttpResource(spec, lock, verify, timeout)
    from ...guards.registry import parse_guard_url

    if scheme not in _DEPRECATED_SQL and scheme not in _kit_schemes():
        raise ConfigurationError(
            f"resource {redacted(spec.split('?')[0])!r}: use a guard URL ("
            f"{', '.join(s + '://' for s in _kit_schemes())}), http(s):// or python:MODULE:CLASS"
        )
    kind = parse_guard_url(spec, own=_OWN).kind.name  # (a bad URL: its one-line error)
    return _BY_KIND[kind](spec, lock, verify)


_OWN = ("table", "key")  # the kit's own query parameters (where the register lives)
_DEPRECATED_SQL = ("sql+sqlite", "sql+postgresql")


def _kit_schemes() -> list[str]:
    from ...guards.registry import guard_schemes

    return guard_schemes()


def _guard_url(url: str) -> Any:
    from ...guards.registry import parse_guard_url

    with warnings.catch_warnings():  # (open_resource's caller was warned already, once)
        warnings.simplefilter("ignore", DeprecationWarning)
        return parse_guard_url(url, own=_OWN)


_BY_KIND: dict[str, Callable[[str, str, TokenVerifier | None], Resource]] = {
    "sql": SQLResource,
    "redis": RedisResource,
    "etcd": EtcdResource,
    "file": FileResource,
}
