"""The contract between the lease core and a token source, and the registry of sources by URL scheme.

A backend is written once, as asyncio code. The synchronous API drives the same code on a
private event-loop thread (see ``sync.py``), so there is exactly one implementation of every
protocol. Each backend module lives in ``fenced.backends`` and is imported only when its URL
scheme is used, so a missing optional client library affects only that backend.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import functools
import importlib
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Final
from urllib.parse import SplitResult, urlsplit

from . import clock as _clock
from .errors import BackendUnavailable, ConfigurationError, LeaseLostError, LockTimeout
from .options import SECRET_QUERY_KEYS, Option, merge_options, parse_query
from .portal import commits_per_turn, on_private_loop
from .token import FencingToken

__all__ = [
    "BUILTIN_SCHEMES",
    "ENTRY_POINT_GROUP",
    "MAX_HEADER_SECRET",
    "MAX_OWNER",
    "MAX_RECORD",
    "SECRET_QUERY_KEYS",
    "Backend",
    "Characteristic",
    "Grant",
    "LockStatus",
    "LostCallback",
    "Record",
    "TokenCheck",
    "UnsureReleases",
    "backend_class",
    "call_bound",
    "commits_per_turn",
    "is_header_secret",
    "known_schemes",
    "lock_timeout",
    "on_private_loop",
    "redacted",
    "register_backend",
    "wait_budget",
]


class Characteristic(enum.StrEnum):
    """What a token source promises. ``connect(url, require={...})`` refuses one that lacks any."""

    LINEARIZABLE = "linearizable"
    """Grants and tokens are decided by a linearizable store, across all its replicas and failovers."""
    DURABLE = "durable"
    """An acknowledged grant survives a crash or restart of the source: no token is ever reused."""
    FIFO = "fifo"
    """Blocking waiters are granted the lock in the order they started waiting."""
    DISTRIBUTED = "distributed"
    """Clients on different machines can share the lock."""
    SERVER_EXPIRY = "server_expiry"
    """Lease expiry is judged by the source itself, not by the clients' clocks."""
    LOST_NOTIFICATION = "lost_notification"
    """The source tells the holder as soon as its grant is gone (not only at the next renewal)."""


LostCallback = Callable[[BaseException], None]
"""Called by a backend, from any thread, when it learns a grant is gone before its expiry."""


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    """A lock grant as a backend hands it to the lease core.

    ``sent_at`` is :func:`fenced._core.clock.now` taken just *before* the request that granted (or
    last renewed) the lease was sent: the server started its ``ttl`` no earlier than that, so
    ``sent_at + ttl`` is a safe bound for the holder. ``handle`` is private to the backend.
    """

    token: FencingToken
    request_id: str
    ttl: float
    sent_at: float
    handle: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class TokenCheck:
    """What the token source says about a token (``locks.check(token)``; Chubby's
    ``CheckSequencer``).

    ``current``: it is the live grant of its lock right now. ``highest``: the highest token the
    source has granted for the lock, when it knows it (None: never granted, or not known —
    ZooKeeper forgets a released lock's last grant). A token below ``highest`` is **stale**: a
    later holder exists. A check is a snapshot: by the time a resource acts on it, it may have
    changed (see docs/signing.md for the pattern that narrows the gap).
    """

    token: FencingToken
    current: bool
    highest: FencingToken | None
    highest_known: bool = False
    """True if ``highest`` is surely the highest grant, so that None means the lock was never
    granted (a source with a counter, or a held lock); False if None may mean "not known"."""

    @property
    def stale(self) -> bool:
        """A later grant of the lock exists."""
        return self.highest is not None and self.highest.value > self.token.value

    @property
    def is_highest(self) -> bool:
        return self.highest is not None and self.highest.value == self.token.value

    @property
    def verdict(self) -> str:
        """One word: ``current``; ``stale`` (a later grant exists); ``never_granted`` (above
        every grant known); ``not_current`` (ended, and no later grant known)."""
        if self.current:
            return "current"
        if self.stale:
            return "stale"
        return "never_granted" if self.never_granted else "not_current"

    @property
    def never_granted(self) -> bool:
        """Not a token the source issued (yet) — forged, or from another deployment: above
        its highest grant of the lock, or of a lock it has never granted. Where the source
        cannot know (etcd, ZooKeeper: a free lock's highest grant is forgotten), False."""
        if self.highest is None:
            return self.highest_known
        return self.token.value > self.highest.value


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    """A small versioned record kept by the token source, changed only by compare-and-set
    (:meth:`Backend.swap_record`): the configurations of replicated groups live in these, so
    their changes are totally ordered by the same linearizable, durable store as the grants.

    ``version`` counts the swaps: 1 for the first value, one more for each change, never
    reused (records are never deleted)."""

    name: str
    version: int
    value: str


MAX_RECORD: Final = 65536
"""The longest record value (characters) every source must keep."""


MAX_OWNER: Final = 200
"""The longest holder description a backend must keep (see :meth:`Backend.acquire`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LockStatus:
    """What ``status(name)`` reports about one lock."""

    name: str
    holder: str | None
    """The request id of the current holder, or None when free."""
    token: FencingToken | None
    """The current holder's token, or None when free."""
    last_token: FencingToken | None
    """The highest token ever granted for this lock (None: never granted, or not known). On
    sources that keep no counter (``knows_highest`` False: etcd, ZooKeeper) it is exact only
    while the lock is held; when free, at most what this connection has seen."""
    remaining: float | None
    """Seconds until the current grant expires if not renewed (None when free or not known)."""
    waiters: int | None = None
    owner: str | None = None
    """Who holds it, as the holder described itself (``user@host pid N: description``), or
    None when free or not recorded (a grant made by fenced 0.1)."""
    ttl: float | None = None
    """The current grant's ttl as the source keeps it (what a renewal renews it for), or None
    when free or not known (a source that keeps only the expiry)."""


class Backend(abc.ABC):
    """A token source. Subclasses live in ``fenced.backends.<module>`` and set the class vars.

    Every method may raise :class:`~fenced.BackendUnavailable` for a dead server or closed
    connection; native client errors must be translated at this boundary.
    """

    scheme: ClassVar[str]
    characteristics: ClassVar[frozenset[Characteristic]]
    option_schema: ClassVar[Mapping[str, Option]] = MappingProxyType({})
    """The options this source takes (URL query or keyword); see :func:`options`."""
    knows_highest: ClassVar[bool] = True
    """True if :meth:`status`'s ``last_token`` is the highest grant even when the lock is free
    (the source keeps a counter); False if it is exact only while held."""
    process_local: ClassVar[bool] = False
    """True if the source's locks exist only inside one process (``memory://``): two processes
    both "hold" the same lock. The command line refuses such a source where a lock must
    exclude other processes (``fenced lock``, ``fenced elect``) or see their locks
    (``fenced release``, ``fenced status``)."""
    caller_driven: ClassVar[bool] = False
    """True if this backend's code may run on whichever thread is running fenced's private
    loop (it keeps no state tied to one thread): the synchronous API then runs a call on the
    caller's own thread whenever the loop thread is idle, saving two thread switches (see
    ``_portal``). Leave False for client libraries with threads or loop hooks of their own."""
    caller_waits: ClassVar[bool] = False
    """True if, further, a synchronous caller should wait for this backend's replies in the
    loop's ``select()`` itself, driving the whole loop until its call is done, instead of
    handing a call that waits for I/O back to the loop thread (two thread switches per call;
    see ``_portal_fast``). Implies :attr:`caller_driven`'s promise. Set where measured better:
    a network source whose calls mostly wait for one reply (Redis, PostgreSQL)."""

    @classmethod
    @abc.abstractmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> Backend:
        """Connect to the source named by ``url``. Unknown ``options`` raise ConfigurationError.

        Must be safe to cancel (the core bounds it by the caller's connect timeout): release
        whatever it opened on any exception, CancelledError included.
        """

    _closed: bool = False

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` has run (a backend may derive it from its connection)."""
        return self._closed

    def _check_open(self) -> None:
        """Raise :class:`~fenced.BackendUnavailable` if the connection is closed."""
        if self.closed:
            raise BackendUnavailable(f"{self.scheme}:// connection is closed")

    @classmethod
    def options(
        cls, url: SplitResult, given: Mapping[str, Any], *, query: bool = True
    ) -> dict[str, Any]:
        """``given`` merged over the URL query and checked against :attr:`option_schema`.

        ``query=False`` for a source whose URL query belongs to its client library (libpq).
        """
        from_url = parse_query(cls.scheme, url.query) if query else {}
        return merge_options(cls.scheme, cls.option_schema, from_url, given)

    @abc.abstractmethod
    async def acquire(
        self,
        name: str,
        *,
        request_id: str,
        ttl: float,
        deadline: float | None,
        on_lost: LostCallback,
        owner: str = "",
    ) -> Grant:
        """Grant ``name`` to ``request_id`` for ``ttl`` seconds, waiting FIFO until ``deadline``.

        ``owner`` describes the holder for operators (``user@host pid N: description``, at
        most :data:`MAX_OWNER` characters, printable); the backend keeps it with the grant and
        reports it in :meth:`status`.

        ``deadline`` is on the :func:`fenced._core.clock.now` clock; None waits forever, a deadline
        already past tries once. Raise :class:`~fenced.LockTimeout` when it passes. While
        waiting, the backend keeps the waiter's place alive itself. Must be idempotent: if
        ``request_id`` already holds ``name`` (a retry after a lost reply), return that same
        grant, not a second one. The token must exceed every token ever granted for ``name``.
        ``on_lost`` may be called later, from any thread, if the grant is revoked early.
        """

    @abc.abstractmethod
    async def lock_names(self) -> list[str]:
        """The names of the locks the source knows (held, waited for, or granted before in
        a way the source remembers), sorted: what an operator's listing shows."""

    @abc.abstractmethod
    async def renew(self, grant: Grant) -> Grant:
        """Extend the lease by its ttl; return the grant with the new ``sent_at``.

        Raise :class:`~fenced.LeaseLostError` if the grant is no longer held.
        """

    @abc.abstractmethod
    async def release(self, grant: Grant) -> bool:
        """Give up the grant. Fenced: it never affects a later grant of the same lock.

        Return True if this call released it, False if it was no longer held (expired, taken
        over, or already released).
        """

    @abc.abstractmethod
    async def status(self, name: str) -> LockStatus:
        """Report the current holder and the highest token of ``name``."""

    async def force_release(
        self, name: str, token: FencingToken | None = None
    ) -> LockStatus | None:
        """Free ``name`` whoever holds it: an operator's tool (``fenced release --force``).

        Returns the status of the grant it freed, or None if the lock was not held (or, with
        ``token``, not held by that grant). The freed grant's token keeps protecting the data:
        guarded resources refuse it once the next holder has written. Its holder learns of the
        loss at its next renewal at the latest. This default releases the current grant by its
        own request id and token (so it can never free a later grant), retrying if the holder
        changed meanwhile; a source whose release needs more than that overrides it.
        """
        for _ in range(5):
            status = await self._held_by(name, token)
            if status is None:
                return None
            assert status.token is not None and status.holder is not None
            if await self.release(Grant(status.token, status.holder, 0.0, 0.0)):
                return status
        raise BackendUnavailable(f"{name!r} kept changing hands while being released")

    async def check(self, token: FencingToken) -> TokenCheck:
        """What the source says about ``token`` (:meth:`fenced.AsyncLocks.check`). This default
        reads :meth:`status`; a source that is itself a service asks it directly."""
        status = await self.status(token.lock)
        current = status.token is not None and status.token.value == token.value
        # A source without a counter knows its highest grant only while it is held: then
        # the holder's token is the latest grant, every earlier one having ended.
        highest = status.last_token if self.knows_highest else status.token
        return TokenCheck(token, current, highest, self.knows_highest or highest is not None)

    async def resume(self, name: str, token: FencingToken, request_id: str, ttl: float) -> Grant:
        """Take over a live grant made through another connection to the same source (a lock
        service's other gateway), to renew or release it here; raise
        :class:`~fenced.LeaseLostError` if ``request_id`` no longer holds ``token``.

        The returned grant's ``sent_at`` is 0: nothing is known of when it was last renewed,
        so it must be renewed before anyone relies on it. Its ttl is the grant's own where the
        source keeps it (:attr:`LockStatus.ttl`: a renewal keeps it), else ``ttl``. This
        default suits sources whose grants are rows or keys named by the request id (no
        ``handle``)."""
        status = await self._held_by(name, token)
        if status is None or status.holder != request_id:
            raise LeaseLostError(f"lease on {name!r} (token {token}) is no longer held")
        return Grant(token, request_id, status.ttl or ttl, 0.0)

    async def _held_by(self, name: str, token: FencingToken | None) -> LockStatus | None:
        """The status of ``name`` if it is held (by the grant ``token``, when given)."""
        status = await self.status(name)
        if status.token is None or status.holder is None:
            return None
        if token is not None and status.token != token:
            return None
        return status

    async def read_record(self, name: str) -> Record | None:
        """The record ``name`` (None: never written). Linearizable on a linearizable source:
        it reflects every swap acknowledged before it was asked."""
        raise ConfigurationError(f"the {self.scheme!r} token source keeps no records")

    async def swap_record(self, name: str, version: int, value: str) -> Record:
        """Store ``value`` as version ``version + 1`` if the record is at ``version`` now (0: it
        does not exist); else raise :class:`~fenced.RecordConflict` with the version found.
        One atomic step in the source; a reply lost in transit is for the caller to read back
        (the record's value tells whether its swap landed)."""
        raise ConfigurationError(f"the {self.scheme!r} token source keeps no records")

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close connections. Grants still held are left to expire."""

    @property
    def effective_characteristics(self) -> frozenset[Characteristic]:
        """What this open connection really promises: the class's declaration, less anything
        the server's configuration turned out not to support (and the user allowed anyway)."""
        return self.characteristics


BUILTIN_SCHEMES: Final[Mapping[str, str]] = MappingProxyType(
    {
        "memory": "fenced.backends.memory:MemoryBackend",
        "sqlite": "fenced.backends.sqlite:SQLiteBackend",
        "etcd": "fenced.backends.etcd:EtcdBackend",
        "etcd3": "fenced.backends.etcd:EtcdBackend",
        "zookeeper": "fenced.backends.zookeeper:ZooKeeperBackend",
        "zk": "fenced.backends.zookeeper:ZooKeeperBackend",
        "postgresql": "fenced.backends.postgresql:PostgreSQLBackend",
        "postgres": "fenced.backends.postgresql:PostgreSQLBackend",
        "redis": "fenced.backends.redis:RedisBackend",
        "rediss": "fenced.backends.redis:RedisBackend",
        "http": "fenced.backends.http:HttpBackend",
        "https": "fenced.backends.http:HttpsBackend",
    }
)
"""fenced's own token sources: URL scheme -> ``module:Class``."""

ENTRY_POINT_GROUP: Final = "fenced.backends"
"""Installed distributions add token sources under this entry-point group:
``[project.entry-points."fenced.backends"] myscheme = "mypkg.backend:MyBackend"``."""

_registered: dict[str, str | type[Backend]] = {}
_registry_lock = threading.Lock()


def register_backend(scheme: str, target: str | type[Backend]) -> Callable[[], None]:
    """Make ``scheme://...`` URLs use ``target`` (a Backend class or ``"module:Class"``).

    For plugins that are not installed as a distribution, and for tests (a planted broken
    source joins the conformance suite this way). Returns a function that removes the
    registration again. Registered schemes take precedence over entry points, which take
    precedence over fenced's own.
    """
    if not isinstance(scheme, str) or not _SCHEME_RE.fullmatch(scheme):
        raise ConfigurationError(f"invalid URL scheme {scheme!r}")
    key = scheme.lower()
    with _registry_lock:
        previous = _registered.get(key)
        _registered[key] = target

    def unregister() -> None:
        with _registry_lock:
            if _registered.get(key) is target:
                if previous is None:
                    del _registered[key]
                else:
                    _registered[key] = previous

    return unregister


_SCHEME_RE: Final = re.compile(r"[A-Za-z][A-Za-z0-9.-]{0,31}")


@functools.lru_cache(maxsize=1)
def _entry_points() -> Mapping[str, str]:
    # Imported here: scanning the installed distributions costs 40-70 ms, which a built-in
    # scheme (every `fenced ...` command on the default source) does not need to pay.
    import importlib.metadata

    found: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name.lower(), ep.value)
    return found


def known_schemes() -> list[str]:
    return sorted({*BUILTIN_SCHEMES, *_entry_points(), *_registered})


def lock_timeout(name: str) -> LockTimeout:
    """The error every source raises when an acquire's deadline passes."""
    return LockTimeout(f"lock {name!r} not acquired before the timeout")


def wait_budget(deadline: float | None, *caps: float | None) -> float:
    """How long a waiting acquire may sleep before it looks again: the smallest of ``caps``
    (a heartbeat, a holder's remaining lease...) and the time left before ``deadline``."""
    wait = min((c for c in caps if c is not None), default=float("inf"))
    if deadline is not None:
        wait = min(wait, deadline - _clock.now())
    return wait


LAST_TRY_GRACE: Final = 1.0
"""Seconds a source's call may run past an acquire's deadline: the last try gets a fair
chance to answer (a grant decided just at the deadline is not thrown away as a timeout)."""


class UnsureReleases:
    """The grants whose release raised here (no answer: its outcome unknown), by lock, token
    and request id: the next release of one of them is a *retry*, which a source that marks
    its releases may answer True (its earlier attempt did release). Only a retry: a second
    release of a grant released and answered is False (the contract: "already released").
    At most ``keep`` of them, the oldest forgotten first (its retry answered as a first
    release: False, a loss reported that was not one, never the other way)."""

    def __init__(self, keep: int = 1024) -> None:
        self._keep = keep
        self._sent: dict[tuple[str, int, str], None] = {}

    @staticmethod
    def _key(grant: Grant) -> tuple[str, int, str]:
        return (grant.token.lock, grant.token.value, grant.request_id)

    def sending(self, grant: Grant) -> bool:
        """A release of ``grant`` is about to be sent: True if it is a retry."""
        key = self._key(grant)
        retry = key in self._sent
        self._sent[key] = None
        if len(self._sent) > self._keep:
            del self._sent[next(iter(self._sent))]
        return retry

    def answered(self, grant: Grant) -> None:
        """The release of ``grant`` was answered (whatever the answer)."""
        self._sent.pop(self._key(grant), None)


def call_bound(
    own: float, deadline: float | None, after: float = 0.0, *, name: str
) -> tuple[float, str]:
    """How long one call to a source may take in all, and what says so (for its error).

    The source's own per-call timeout ``own`` (called ``name``: ``socket_timeout``,
    ``request_timeout``...), or, when an acquire's ``deadline`` leaves less, the time left
    + :data:`LAST_TRY_GRACE` (even past the deadline: a try-once still gets that second).
    ``after``: how long the call blocks by design before it can answer (a ``BLPOP``, a long
    poll's wait), added to either bound and not counted against the deadline's grace.
    One rule for every source, so that an acquire's timeout means the same on each.
    """
    if deadline is not None:
        left = max(deadline - _clock.now() - after, 0.0)
        if left + LAST_TRY_GRACE < own:
            return after + left + LAST_TRY_GRACE, "the acquire's timeout + 1 s"
    return after + own, name


def parse_url(url: str) -> SplitResult:
    """``url`` split; a malformed one (``redis://[::1``, a bad port) is a ConfigurationError."""
    if not isinstance(url, str) or "://" not in url:
        shown = redacted(url) if isinstance(url, str) else type(url).__name__
        raise ConfigurationError(
            f"not a token source URL: {shown!r} (expected e.g. sqlite:////abs/path.db)"
        )
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigurationError(f"malformed token source URL {redacted(url)!r}: {exc}") from None
    if _misplit_userinfo(url, parts):
        # (what urllib took for the host, port, path, query or fragment holds part of the
        # password: no message may show any of it)
        raise ConfigurationError(
            f"malformed token source URL {redacted(url)!r}: its user or password holds a '/', "
            "'?' or '#'; percent-encode them (%2F, %3F, %23)"
        )
    try:
        if "," not in parts.netloc:  # (a host list is the source's to parse)
            parts.port  # noqa: B018 - validates the port (urlsplit itself does not)
    except ValueError as exc:
        raise ConfigurationError(f"malformed token source URL {redacted(url)!r}: {exc}") from None
    return parts


def _misplit_userinfo(url: str, parts: SplitResult) -> bool:
    """Did a '/', '?' or '#' in the userinfo end the authority early? Then an '@' follows
    the authority urllib found, which has none, and that authority is no ``host[:port]``: an
    empty host (``redis://:pa/ss@h``), a port that is no number (``redis://u:pa/ss@h``), or
    an '@' in the fragment, which a source URL never has (``redis://u:1234#ss@h``)."""
    if "@" in parts.netloc or "@" not in url.partition("://")[2]:
        return False
    if "@" in parts.fragment:
        return True
    netloc = parts.netloc
    if netloc.startswith("[") or "," in netloc:  # (an IPv6 literal; a host list)
        return False
    host, colon, port = netloc.rpartition(":") if ":" in netloc else (netloc, "", "")
    return bool(colon) and (not host or not port.isdigit())


_SECRET_QUERY: Final = re.compile(
    r"(?i)([?&])(" + "|".join(sorted(SECRET_QUERY_KEYS)) + r")=[^&#]*"
)


_HEADER_SECRET: Final = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")

MAX_HEADER_SECRET: Final = 4096
"""The longest API key: proxies refuse longer header lines (nginx's default buffer holds 8 KiB
for a whole line); the JavaScript and Java clients check the same bound."""


def is_header_secret(secret: str) -> bool:
    """Can ``secret`` (an API key's) travel in an ``Authorization: Bearer`` header as written?
    Visible ASCII, blanks inside only: clients (httpx) send ASCII alone, servers read
    latin-1 and strip the blanks around a value; at most :data:`MAX_HEADER_SECRET`."""
    return len(secret) <= MAX_HEADER_SECRET and _HEADER_SECRET.fullmatch(secret) is not None


def redacted(url: str) -> str:
    """``url`` without its secrets, for messages and logs: the userinfo's password, secret
    query parameters (:data:`SECRET_QUERY_KEYS`), and a fragment. Text that is no URL at all
    (no ``://``: a typo, or a file's content that is not a URL) is not shown past its first
    character: it may be the secret itself."""
    if "://" not in url:
        return f"{url[:1]}…" if len(url) > 1 else url
    scheme, sep, rest = url.partition("://")
    try:
        misplit = _misplit_userinfo(url, urlsplit(url))
    except ValueError:
        misplit = True
    if misplit:  # (the last '@' ends the userinfo, past a '/', '?' or '#' it should not hold)
        userinfo, at, host = rest.rpartition("@")
        userinfo = re.split(r"[:/?#]", userinfo, maxsplit=1)[0] + ":***" if at else userinfo
    else:
        end = len(re.split(r"[/?#]", rest, maxsplit=1)[0])  # (the authority: host, port)
        userinfo, at, host = rest[:end].rpartition("@")
        host += rest[end:]
        if at and ":" in userinfo:
            userinfo = userinfo.split(":", 1)[0] + ":***"
    host, hash_, _fragment = host.partition("#")
    host = _SECRET_QUERY.sub(r"\1\2=***", host)
    return f"{scheme}{sep}{userinfo}{at}{host}{hash_ and '#***'}"


def backend_class(url: str) -> type[Backend]:
    """The backend class for ``url``'s scheme (``etcd+http`` style suffixes are ignored)."""
    scheme = parse_url(url).scheme.lower().split("+", 1)[0]
    # fenced's own schemes before the entry points: no installed distribution takes one over.
    target = _registered.get(scheme) or BUILTIN_SCHEMES.get(scheme) or _entry_points().get(scheme)
    if target is None:
        known = ", ".join(known_schemes())
        raise ConfigurationError(f"unknown token source scheme {scheme!r}; known: {known}")
    if not isinstance(target, str):
        return target
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = module_name.rsplit(".", 1)[-1]
        raise ConfigurationError(
            f"the {scheme!r} token source needs extra packages: pip install 'fenced[{extra}]' ({exc})"
        ) from exc
    cls: type[Backend] = getattr(module, class_name)
    return cls


def check_requirements(
    cls: type[Backend], require: Iterable[str], have: frozenset[Characteristic] | None = None
) -> frozenset[Characteristic]:
    """Refuse (ConfigurationError) a source lacking a required characteristic; return them."""
    wanted: set[Characteristic] = set()
    for item in require:
        try:
            wanted.add(Characteristic(item))
        except ValueError:
            known = ", ".join(c.value for c in Characteristic)
            raise ConfigurationError(f"unknown characteristic {item!r}; known: {known}") from None
    missing = wanted - (cls.characteristics if have is None else have)
    if missing:
        names = ", ".join(sorted(m.value for m in missing))
        which = "token source" if have is None else "connection (as the server is configured)"
        raise ConfigurationError(f"the {cls.scheme!r} {which} is not {names}")
    return frozenset(wanted)
