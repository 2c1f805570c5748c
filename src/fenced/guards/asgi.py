"""ASGI middleware that fences HTTP writes: stale ``Fencing-Token`` -> 409 problem+json.

::

    from fenced.guards.asgi import FencingMiddleware, SQLiteFenceStore

    store = SQLiteFenceStore("/srv/app/fences.db")
    app = FencingMiddleware(
        app,                                   # any ASGI app: Starlette, FastAPI, raw
        store=store,
        lock="jobs",
        resource=lambda scope: "jobs" if scope["path"].startswith("/jobs") else None,
    )

For a request to a fenced route (``resource(scope)`` returns a key; read-only methods pass
by default) the middleware reads the ``Fencing-Token`` header and, in ONE atomic store
operation, checks it against the resource's high-water mark and advances the mark:

=================================  ======  ===========================================
request                            status  body (``application/problem+json``, RFC 9457)
=================================  ======  ===========================================
token >= mark                      —       passed on; ``request.state.fencing_token``
token < mark                       409     ``token``, ``high_water``, ``resource``
no header                          428     ``header``
malformed, or token of another     400     ``token`` (as sent), ``lock`` (expected)
lock
store unreachable / conflict       503     (``Retry-After: 1``)
the stored mark is corrupt         503     ``resource`` (no ``Retry-After``: every write
                                           is refused until an operator repairs the mark)
any other error of the store       500     ``resource`` (a misconfigured store, its
(misconfigured, credentials                credentials refused, an unexpected error: logged
refused, unexpected)                       on ``fenced.guards.http``)
=================================  ======  ===========================================

Every refusal is a problem document and nothing is passed on to the app: whatever the store
raises, the request is answered without the handler running. The header's value is read
without the optional whitespace HTTP allows around it (``jobs:7 `` is ``jobs:7``), whether or
not the server stripped it.

**Atomicity, honestly.** The middleware's check-and-advance is atomic in the store, but the
handler's write comes after it, as a second step: a request with token 7 can pass the
middleware, then a request with token 8 can pass *and write*, and then 7's handler writes.
The middleware check turns stale writers away early (before any work is done) and is
enough when the handler's writes are themselves ordered by the same mark; for the write
to be fenced atomically, the handler writes *through the same guard in the same
transaction*: ``await store.transaction(resource, token, fn)`` (SQLite, PostgreSQL) or
``store.guard(resource, lock).set(key, value, token=t)`` (Redis). ``scope["state"]`` carries
``fencing_token``, ``fencing_resource`` and ``fencing_store`` for that.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Final

from .._core.errors import (
    AccessDenied,
    BackendUnavailable,
    ConfigurationError,
    CorruptMarkError,
    FencedError,
    InvalidTokenError,
    StaleTokenError,
    WrongLockError,
)
from .._core.signing import TokenVerifier
from .._core.token import FencingToken, validate_lock_name
from ._stores import FenceStore, PostgresFenceStore, RedisFenceStore, SQLiteFenceStore

__all__ = [
    "PROBLEM_CONTENT_TYPE",
    "FenceMetrics",
    "FenceStore",
    "FencingMiddleware",
    "PostgresFenceStore",
    "Problem",
    "RedisFenceStore",
    "SQLiteFenceStore",
    "fencing_exception_handler",
    "problem_body",
    "problem_for",
    "store_problem",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PROBLEM_CONTENT_TYPE: Final = "application/problem+json"
DEFAULT_PROBLEM_BASE: Final = "tag:fenced,2026:problem:"
SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
_OWS: Final = b" \t"  # optional whitespace around a field value (RFC 9110 5.5): not part of it

logger = logging.getLogger("fenced.guards.http")


def problem_body(
    kind: str, status: int, title: str, detail: str, base: str = DEFAULT_PROBLEM_BASE, **extra: Any
) -> bytes:
    """An RFC 9457 problem document: ``type``, ``title``, ``status``, ``detail`` + extensions."""
    doc = {"type": base + kind, "title": title, "status": status, "detail": detail, **extra}
    return json.dumps(doc, separators=(",", ":")).encode()


class FenceMetrics:
    """Prometheus counters and a gauge for the middleware (needs ``prometheus-client``).

    * ``<prefix>_accepted_total{resource}`` — requests whose token was accepted;
    * ``<prefix>_rejected_total{resource,reason}`` — ``stale``, ``missing``, ``invalid``,
      ``wrong_lock``, ``unavailable``, ``corrupt``, ``error``;
    * ``<prefix>_high_water{resource}`` — the highest token value this process has seen
      accepted, or reported as the mark in a rejection.

    Resource keys become label values: keep them few (a route, not an item id), or pass
    ``label=`` to map a key to a label.
    """

    def __init__(
        self,
        registry: Any = None,
        *,
        prefix: str = "fenced_http",
        label: Callable[[str], str] | None = None,
    ) -> None:
        try:
            import prometheus_client
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "FenceMetrics needs prometheus-client: pip install 'fenced[metrics]'"
            ) from exc
        kw: dict[str, Any] = {} if registry is None else {"registry": registry}
        self._label = label or (lambda key: key)
        self.accepted_total = prometheus_client.Counter(
            f"{prefix}_accepted", "Fenced requests accepted", ["resource"], **kw
        )
        self.rejected_total = prometheus_client.Counter(
            f"{prefix}_rejected", "Fenced requests rejected", ["resource", "reason"], **kw
        )
        self.high_water = prometheus_client.Gauge(
            f"{prefix}_high_water", "Highest fencing token seen", ["resource"], **kw
        )
        self._seen: dict[str, int] = {}

    def _raise_mark(self, resource: str, value: int) -> None:
        label = self._label(resource)
        if value > self._seen.get(label, 0):
            self._seen[label] = value
            self.high_water.labels(label).set(value)

    def accepted(self, resource: str, token: FencingToken) -> None:
        self.accepted_total.labels(self._label(resource)).inc()
        self._raise_mark(resource, token.value)

    def rejected(self, resource: str, reason: str, high_water: FencingToken | None = None) -> None:
        self.rejected_total.labels(self._label(resource), reason).inc()
        if high_water is not None:
            self._raise_mark(resource, high_water.value)


@dataclasses.dataclass(frozen=True)
class Problem:
    """A refusal, ready to send as an RFC 9457 ``application/problem+json`` response."""

    status: int
    reason: str  # metrics label: stale, missing, invalid, wrong_lock, unavailable, corrupt, error
    kind: str  # the last part of the ``type`` URI
    title: str
    detail: str
    extra: dict[str, Any]
    mark: FencingToken | None = None
    retry_after: bool = False

    def body(self, base: str = DEFAULT_PROBLEM_BASE) -> bytes:
        return problem_body(self.kind, self.status, self.title, self.detail, base, **self.extra)

    def headers(self, body: bytes) -> list[tuple[bytes, bytes]]:
        headers = [
            (b"content-type", PROBLEM_CONTENT_TYPE.encode()),
            (b"content-length", str(len(body)).encode()),
        ]
        if self.retry_after:
            headers.append((b"retry-after", b"1"))
        return headers


def problem_for(
    exc: BaseException, resource: str | None, lock: str, sent: bytes | None = None
) -> Problem | None:
    """The problem response for a fenced error (None: not a client-facing refusal).

    Stale -> 409; wrong lock, malformed -> 400; unreachable store, conflicts, a corrupt mark
    -> 503. :class:`~fenced.ConfigurationError`, :class:`~fenced.AccessDenied` and non-fenced
    errors give None: raised by a handler, they are bugs (500); met by the middleware, see
    :func:`store_problem`.
    """
    where = {"resource": resource}
    shown = {"token": sent[:200].decode("latin-1")} if sent is not None else {}
    if isinstance(exc, StaleTokenError):
        seen = exc.high_water
        mark = None if seen is None else FencingToken(seen.lock, seen.value)
        extra = {"token": str(exc.token), "high_water": None if mark is None else str(mark)}
        return Problem(
            409, "stale", "stale-token", "Stale fencing token", str(exc), {**extra, **where}, mark
        )
    if isinstance(exc, WrongLockError):
        return Problem(
            400, "wrong_lock", "wrong-lock", "Fencing token of another lock", str(exc),
            {**shown, "lock": lock, **where},
        )  # fmt: skip
    if isinstance(exc, InvalidTokenError):
        return Problem(
            400, "invalid", "invalid-token", "Invalid fencing token", str(exc),
            {**shown, "lock": lock, **where},
        )  # fmt: skip
    if isinstance(exc, CorruptMarkError):
        return Problem(
            503, "corrupt", "corrupt-mark", "Fence mark corrupt", str(exc), where
        )  # (no Retry-After: no retry passes until an operator repairs the mark)
    if isinstance(exc, ConfigurationError | AccessDenied) or not isinstance(
        exc, BackendUnavailable | FencedError
    ):
        return None  # (the store's own credentials refused: misconfigured, not unavailable)
    return Problem(
        503, "unavailable", "fence-unavailable", "Fence unavailable",
        f"the high-water mark of {resource!r} could not be checked: {exc}", where,
        retry_after=True,
    )  # fmt: skip


def store_problem(
    exc: BaseException, resource: str, lock: str, sent: bytes | None = None
) -> Problem:
    """The problem response for any error met while checking a request's token against the
    store: :func:`problem_for`'s, or else ``500`` (a misconfigured store, an unexpected
    error: logged here, with its traceback). Never None: the middleware answers every
    refusal itself, so the handler never runs on a request whose token was not accepted."""
    problem = problem_for(exc, resource, lock, sent)
    if problem is not None:
        return problem
    logger.error("fence check of %r failed", resource, exc_info=exc)
    misconfigured = isinstance(exc, ConfigurationError | AccessDenied)
    kind = "fence-misconfigured" if misconfigured else "fence-error"
    return Problem(
        500, "error", kind, "Fence check failed",
        f"the high-water mark of {resource!r} could not be checked: "
        + (str(exc) if isinstance(exc, FencedError) else type(exc).__name__),
        {"resource": resource},
    )  # fmt: skip


async def fencing_exception_handler(request: Any, exc: Exception) -> Any:
    """Starlette / FastAPI exception handler: a StaleTokenError from a handler -> 409.

    A handler that writes through the store (``store.transaction(...)``) may find that a
    higher token got in after the middleware's check; register this so that surfaces as the
    same problem response::

        Starlette(..., exception_handlers={StaleTokenError: fencing_exception_handler})
    """
    from starlette.responses import Response

    state = request.scope.get("state") or {}
    token = state.get("fencing_token")
    lock = token.lock if isinstance(token, FencingToken) else ""
    problem = problem_for(exc, state.get("fencing_resource"), lock)
    if problem is None:
        raise exc
    body = problem.body()
    return Response(
        body, problem.status, headers={k.decode(): v.decode() for k, v in problem.headers(body)}
    )


class MiddlewareSettings:
    """What the ASGI and WSGI middlewares share: the store, the lock, the header, the methods
    that pass unfenced, metrics, and how a refusal is counted and written."""

    def __init__(
        self,
        store: FenceStore,
        lock: str,
        header: str,
        safe_methods: Iterable[str],
        metrics: FenceMetrics | None,
        problem_base: str,
        verify: TokenVerifier | None = None,
    ) -> None:
        self.verifier = verify  # checks each token before the mark (see fenced._core.signing)
        self.store = store
        self.lock = validate_lock_name(lock)
        self.header = header
        self.safe_methods = frozenset(m.upper() for m in safe_methods)
        self.metrics = metrics
        self.problem_base = problem_base

    def _missing(self, method: str, path: str, resource: str) -> Problem:
        """The 428 for a request that changes ``resource`` without a token."""
        return Problem(
            428, "missing", "missing-token", "Fencing token required",
            f"{method} {path} changes a fenced resource: send the '{self.header}' header with "
            f"the token of a held '{self.lock}' lease",
            {"header": self.header, "resource": resource},
        )  # fmt: skip

    def _stale_inside(self, exc: StaleTokenError, resource: str) -> Problem:
        """The 409 for a refusal the app raised before it started its response."""
        problem = problem_for(exc, resource, self.lock)
        assert problem is not None
        return problem

    def _refused(self, resource: str, problem: Problem) -> bytes:
        """Count the refusal; its body."""
        if self.metrics is not None:
            self.metrics.rejected(resource, problem.reason, problem.mark)
        return problem.body(self.problem_base)


class FencingMiddleware(MiddlewareSettings):
    """Plain ASGI middleware: fence requests to the routes ``resource(scope)`` names.

    ``store``: a :class:`FenceStore` (``SQLiteFenceStore``, ``PostgresFenceStore``,
    ``RedisFenceStore``). ``lock``: the lock whose tokens are accepted. ``resource``: maps
    an HTTP scope to the key of the resource it writes, or None for "not fenced"; the
    default fences every request with one resource named after the lock. ``safe_methods``
    pass without a token (default GET, HEAD, OPTIONS; pass ``()`` to fence them too).
    Non-HTTP scopes (lifespan, websocket) are passed through untouched.

    A :class:`~fenced.StaleTokenError` raised by the app before it started its response
    (a handler whose own fenced write found a higher token) is answered with the same 409.
    Starlette turns unhandled errors into a 500 itself first: there, register
    :func:`fencing_exception_handler`.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: FenceStore,
        lock: str,
        resource: Callable[[Scope], str | None] | None = None,
        header: str = "Fencing-Token",
        safe_methods: Iterable[str] = SAFE_METHODS,
        metrics: FenceMetrics | None = None,
        problem_base: str = DEFAULT_PROBLEM_BASE,
        verify: TokenVerifier | None = None,
    ) -> None:
        self.app = app
        self.resource = resource if resource is not None else (lambda scope: self.lock)
        self._header_key = header.lower().encode("latin-1")
        MiddlewareSettings.__init__(
            self, store, lock, header, safe_methods, metrics, problem_base, verify
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in self.safe_methods:
            await self.app(scope, receive, send)
            return
        key = self.resource(scope)
        if key is None:
            await self.app(scope, receive, send)
            return
        values = [v for k, v in scope["headers"] if k == self._header_key]
        if not values:
            await self._send_problem(send, key, self._missing(scope["method"], scope["path"], key))
            return
        # Several headers are ambiguous: joined, they fail to parse (400). (Not every server
        # strips the whitespace around a value: httptools keeps it, h11 does not.)
        raw = b",".join(v.strip(_OWS) for v in values)
        try:
            token = FencingToken.coerce(raw, self.lock, self.verifier)
            await self.store.advance(key, token)
        except Exception as exc:
            await self._send_problem(send, key, store_problem(exc, key, self.lock, raw))
            return
        if self.metrics is not None:
            self.metrics.accepted(key, token)
        state = dict(scope.get("state") or {})
        state.update(fencing_token=token, fencing_resource=key, fencing_store=self.store)
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app({**scope, "state": state}, receive, tracking_send)
        except StaleTokenError as exc:
            if started:
                raise
            await self._send_problem(send, key, self._stale_inside(exc, key))

    async def _send_problem(self, send: Send, resource: str, problem: Problem) -> None:
        body = self._refused(resource, problem)
        await send(
            {
                "type": "http.response.start",
                "status": problem.status,
                "headers": problem.headers(body),
            }
        )
        await send({"type": "http.response.body", "body": body})
