"""Guards by URL: the one grammar with which the CLI, the check kit and the groups name a
guarded resource (as ``fenced.connect`` names a token source by URL).

=================================================  ===========  ===========================
URL                                                kind         guard
=================================================  ===========  ===========================
``redis://HOST:PORT/DB``, ``rediss://...``         ``redis``    ``RedisGuard`` (one script)
``postgresql://USER@HOST:PORT/DB`` (``postgres``)  ``sql``      ``SQLGuard`` over psycopg 3
``mysql://USER:PW@HOST:PORT/DB`` (``mariadb``)      ``sql``      ``SQLGuard`` over PyMySQL
``sqlite:////abs/path.db``, ``sqlite:///./rel.db`` ``sql``      ``SQLGuard`` over sqlite3
``etcd://HOST:PORT[,HOST:PORT...]`` (``etcd3``)    ``etcd``     ``EtcdGuard`` (one txn)
``file:///DIR``                                    ``file``     ``FileGuard`` (needs lock=)
=================================================  ===========  ===========================

``sqlite://`` paths read as the ``sqlite://`` token source reads them
(:func:`fenced.backends.sqlite.database_path`: ``sqlite:///path.db`` is ambiguous and
refused), and a guard never creates the database: a typo must not fence an empty new file.

Deprecated spellings, still accepted with a :class:`DeprecationWarning` (the check kit's
before this registry): ``sql+sqlite:///PATH`` (PATH as written, absolute) and
``sql+postgresql://...``.

A caller's own query parameters (the kit's ``?table=``, ``?key=``) are named in ``own=``,
taken off the URL and handed back in :attr:`GuardURL.params`; any other query stays in the
client's URL (``?sslmode=require`` reaches libpq).
"""

from __future__ import annotations

import enum
import sqlite3
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from .._core.backend import redacted
from .._core.errors import ConfigurationError
from .._core.signing import TokenVerifier

__all__ = [
    "GUARD_KINDS",
    "GuardCharacteristic",
    "GuardKind",
    "GuardURL",
    "OpenedGuard",
    "guard_schemes",
    "open_guard",
    "parse_guard_url",
]


class GuardCharacteristic(enum.StrEnum):
    """What a kind of guarded resource offers (declared, as the sources declare theirs)."""

    CALLER_TRANSACTION = "caller-transaction"
    """The caller's own statements commit in the same transaction as the fence check."""
    SCRIPTED = "scripted"
    """A guarded write is one server-side step built by the guard (a script, a txn)."""
    MULTI_ENDPOINT = "multi-endpoint"
    """The URL may list several endpoints of one cluster (comma-separated)."""
    NEEDS_LOCK = "needs-lock"
    """The guard must be told its lock's name (``lock=``) to be opened."""
    EXISTING_ONLY = "existing-only"
    """The resource must already exist; opening never creates it."""
    GROUP_MEMBER = "group-member"
    """It can hold a member of a replicated group (:mod:`fenced.replicated` adapts its guard):
    ``fenced group --member NAME=URL`` takes its URLs."""


_C = GuardCharacteristic


@dataclass(frozen=True)
class GuardKind:
    """One kind of guarded resource: its URL schemes, its guard class and what it offers."""

    name: str
    schemes: tuple[str, ...]
    guard: str
    extra: str
    characteristics: frozenset[GuardCharacteristic]


GUARD_KINDS: Final[Mapping[str, GuardKind]] = MappingProxyType(
    {
        "redis": GuardKind(
            "redis", ("redis", "rediss"), "fenced.guards.redis:RedisGuard", "redis",
            frozenset({_C.SCRIPTED, _C.GROUP_MEMBER}),
        ),
        "sql": GuardKind(
            "sql", ("postgresql", "postgres", "sqlite", "mysql", "mariadb"),
            "fenced.guards.sql:SQLGuard", "postgresql",  # (mysql://: the mysql extra)
            frozenset({_C.CALLER_TRANSACTION, _C.EXISTING_ONLY, _C.GROUP_MEMBER}),
        ),
        "etcd": GuardKind(
            "etcd", ("etcd", "etcd3"), "fenced.guards.etcd:EtcdGuard", "etcd",
            frozenset({_C.SCRIPTED, _C.MULTI_ENDPOINT, _C.GROUP_MEMBER}),
        ),
        "file": GuardKind(
            "file", ("file",), "fenced.guards.files:FileGuard", "",
            frozenset({_C.NEEDS_LOCK}),
        ),
    }
)  # fmt: skip
"""Every kind of guard that can be named by a URL, by kind name."""

_DEPRECATED: Final = {"sql+sqlite": "sqlite", "sql+postgresql": "postgresql"}


def guard_schemes(having: GuardCharacteristic | None = None) -> list[str]:
    """Every scheme :func:`parse_guard_url` takes (the deprecated spellings not included), or
    those of the kinds ``having`` a characteristic."""
    return [
        s
        for kind in GUARD_KINDS.values()
        if having is None or having in kind.characteristics
        for s in kind.schemes
    ]


@dataclass(frozen=True)
class GuardURL:
    """A parsed guard URL. ``target`` is what the client opens: the Redis or libpq URL (the
    caller's own parameters taken off), the SQLite file's path, the etcd endpoints, the
    directory."""

    kind: GuardKind
    scheme: str
    target: str
    params: Mapping[str, str] = field(default_factory=dict)

    @property
    def dialect(self) -> str:
        """``sqlite``, ``postgresql`` or ``mysql`` for the ``sql`` kind; the kind's name
        otherwise."""
        if self.kind.name != "sql":
            return self.kind.name
        return _SQL_DIALECTS.get(self.scheme, "postgresql")


_SQL_DIALECTS: Final = {"sqlite": "sqlite", "mysql": "mysql", "mariadb": "mysql"}
_MYSQL_QUERY: Final = ("charset", "unix_socket")  # (PyMySQL's connect() arguments taken)


def parse_guard_url(url: str, *, own: tuple[str, ...] = ()) -> GuardURL:
    """Parse ``url`` by the module's grammar; :class:`~fenced.ConfigurationError` (one line,
    the URL's password not in it) for a URL it does not know."""
    shown = redacted(url.split("?")[0])
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # ("Invalid IPv6 URL": an unclosed '[')
        raise ConfigurationError(f"guard URL {shown!r}: {exc}") from None
    scheme = parts.scheme.lower()
    old = scheme
    if scheme in _DEPRECATED:
        scheme = _DEPRECATED[scheme]
        hint = "sqlite:////ABS/PATH" if scheme == "sqlite" else "postgresql://..."
        warnings.warn(
            f"the {old}:// guard URL is deprecated: write {hint}", DeprecationWarning, stacklevel=2
        )
    kind = next((k for k in GUARD_KINDS.values() if scheme in k.schemes), None)
    if kind is None:
        raise ConfigurationError(
            f"unknown guard URL {shown!r}: use {', '.join(s + '://' for s in guard_schemes())}"
        )
    query = parse_qsl(parts.query, keep_blank_values=True)
    params = {k: v for k, v in query if k in own}
    rest = urlencode([(k, v) for k, v in query if k not in own])
    if scheme == "sqlite":
        if old == "sql+sqlite":  # the kit's reading: the path as written
            target = parts.path
        else:
            from ..backends.sqlite import database_path

            target = database_path(parts._replace(query=rest))
        if not target.strip("/"):
            raise ConfigurationError(f"guard URL {shown!r} names no database file")
    elif kind.name == "etcd":
        target = f"{scheme}://{parts.netloc}"
        if not parts.netloc:
            raise ConfigurationError(f"guard URL {shown!r} names no endpoint: etcd://HOST:PORT")
    elif scheme in ("mysql", "mariadb"):
        target = urlunsplit(parts._replace(scheme="mysql", query=rest, fragment=""))
        _mysql_arguments(target, shown)  # (a bad port or parameter: refused now, not at use)
    elif kind.name == "file":
        target = parts.path
        if parts.netloc not in ("", "localhost") or not target.strip("/"):
            raise ConfigurationError(f"guard URL {shown!r}: write file:///ABS/DIR")
    else:
        if kind.name == "redis":
            # (redis-py reads the port with int() when it opens the client: a traceback, not
            # a typed error. libpq takes several hosts, "h1:p1,h2:p2": its own to check.)
            try:
                parts.port  # noqa: B018
            except ValueError as exc:
                raise ConfigurationError(f"guard URL {shown!r}: {exc}") from None
        target = urlunsplit(parts._replace(scheme=scheme, query=rest, fragment=""))
    return GuardURL(kind, scheme, target, MappingProxyType(params))


@dataclass
class OpenedGuard:
    """A guard opened from a URL. ``connect`` opens a new connection to a SQL resource (None
    for the other kinds); ``close()`` closes what the registry opened for the guard;
    ``client`` is the client it opened for the guard (Redis), if any."""

    url: GuardURL
    guard: Any
    connect: Callable[[], Any] | None
    close: Callable[[], None]
    client: Any = None

    def fence_target(self) -> Any:
        """What fences a grant or joins a group: the guard itself, or a SQL guard's
        ``fencer(connect)`` (each call on a connection of its own)."""
        if self.connect is not None:
            return self.guard.fencer(self.connect)
        return self.guard


def _nothing() -> None:
    pass


def open_guard(
    url: str | GuardURL,
    resource: str,
    *,
    lock: str | None = None,
    verify: TokenVerifier | None = None,
    timeout: float | None = 5.0,
    own: tuple[str, ...] = (),
) -> OpenedGuard:
    """The guard ``url`` names, fencing ``resource`` (for tokens of ``lock`` when given,
    verified with ``verify`` when given); ``timeout`` bounds connecting and each request
    (None: the client's default)."""
    parsed = url if isinstance(url, GuardURL) else parse_guard_url(url, own=own)
    name = parsed.kind.name
    if name == "redis":
        import redis

        from .redis import RedisGuard

        client = redis.Redis.from_url(
            parsed.target, socket_timeout=timeout, socket_connect_timeout=timeout
        )
        redis_guard = RedisGuard(client, resource, lock=lock, verify=verify)

        def close() -> None:  # (the guard's no-retry pool too: made for this client alone)
            redis_guard.close()
            client.close()

        return OpenedGuard(parsed, redis_guard, None, close, client)
    if name == "sql":
        from .sql import SQLGuard

        connect = _sql_connect(parsed, timeout)
        return OpenedGuard(parsed, SQLGuard(resource, lock=lock, verify=verify), connect,
                           _nothing)  # fmt: skip
    if name == "etcd":
        from .etcd import EtcdGuard

        options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        guard = EtcdGuard(parsed.target, resource, lock=lock, verify=verify, **options)
        return OpenedGuard(parsed, guard, None, guard.close)
    # file
    from .files import FileGuard

    if lock is None:
        raise ConfigurationError("a file:// guard needs the lock's name (lock=)")
    return OpenedGuard(parsed, FileGuard(parsed.target, lock=lock, verify=verify), None,
                       _nothing)  # fmt: skip


def _mysql_arguments(target: str, shown: str) -> dict[str, Any]:
    """PyMySQL's ``connect()`` arguments for a ``mysql://USER:PW@HOST:PORT/DB`` URL."""
    parts = urlsplit(target)
    try:
        port = parts.port or 3306
    except ValueError:
        raise ConfigurationError(f"guard URL {shown!r}: the port is not a number") from None
    database = unquote(parts.path.lstrip("/"))
    if not database or "/" in database:
        raise ConfigurationError(
            f"guard URL {shown!r} names no database: write mysql://USER@HOST:PORT/DB"
        )
    args: dict[str, Any] = {"host": parts.hostname or "localhost", "port": port}
    args["database"] = database
    if parts.username:
        args["user"] = unquote(parts.username)
    if parts.password is not None:
        args["password"] = unquote(parts.password)
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in _MYSQL_QUERY or key in args:
            raise ConfigurationError(
                f"guard URL {shown!r}: unknown or repeated parameter {key!r} "
                f"(mysql:// takes {', '.join(_MYSQL_QUERY)})"
            )
        args[key] = value
    return args


def _sql_connect(parsed: GuardURL, timeout: float | None) -> Callable[[], Any]:
    if parsed.dialect == "mysql":
        args = _mysql_arguments(parsed.target, redacted(parsed.target))
        if timeout is not None:
            wait = max(1, round(timeout))  # (PyMySQL takes whole seconds > 0)
            args.update(connect_timeout=wait, read_timeout=wait, write_timeout=wait)

        def connect_mysql() -> Any:
            import pymysql

            return pymysql.connect(**args)

        return connect_mysql
    if parsed.dialect == "sqlite":
        uri = f"file:{quote(parsed.target)}?mode=rw"  # an existing database only

        def connect_sqlite() -> sqlite3.Connection:
            return sqlite3.connect(
                uri, uri=True, timeout=5.0 if timeout is None else timeout,
                check_same_thread=False,
            )  # fmt: skip

        return connect_sqlite

    def connect_postgresql() -> Any:
        import psycopg

        if timeout is None:
            return psycopg.connect(parsed.target, autocommit=True)
        return psycopg.connect(
            parsed.target, autocommit=True, connect_timeout=max(1, round(timeout))
        )

    return connect_postgresql
