"""The HTTP/JSON API of ``fenced serve`` (FastAPI on Starlette; OpenAPI at ``/openapi.json``).

Every answer that is not a success is ``{"error": <code>, "message": <one line>}`` with a
fitting status: 400 invalid_request / invalid_token, 401 unauthenticated, 403 forbidden,
404 not_found, 408 too_slow, 409 timeout, 410 lease_lost, 413 too_large, 429
too_many_watches / too_many_waiting (with Retry-After), 503 unavailable.
A refused request changes nothing. See docs/server.md.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import hashlib
import inspect
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.utils import create_model_field
from starlette.background import BackgroundTask
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path
from starlette.types import Receive

from .. import __version__
from .._core import clock as _clock
from .._core.backend import Grant, LockStatus, TokenCheck
from .._core.errors import (
    BackendUnavailable,
    ConfigurationError,
    FencedError,
    InvalidTokenError,
    LeaseLostError,
    LockTimeout,
    RecordConflict,
)
from .._core.lease import AsyncLocks, check_description
from .._core.names import ELECTION_RECORDS, GROUP_RECORDS
from .._core.signing import Keyring, SignatureError
from .._core.state import DEFAULT_TTL, check_request_id, check_timeout, check_ttl
from .._core.token import MAX_NAME, FencingToken, validate_lock_name
from ._auth import ApiKey, Keys, Verb
from ._gateway import READY_LOCK, RESERVED, Gateway, client_id
from ._http import READ_TIMEOUT
from ._layers import DirectLane, _BodyLimit, _FastLane, _Lane, _Service, _Timing
from ._metrics import CONTENT_TYPE_LATEST
from ._wire import (
    _ERRORS,
    RELEASED,
    AcquireIn,
    Answer,
    ApiError,
    CheckIn,
    CheckOut,
    DashboardOut,
    ErrorOut,
    ForceIn,
    ForceOut,
    GrantOut,
    InfoOut,
    LeaseIn,
    ListOut,
    RecordOut,
    ReleaseIn,
    ReleaseOut,
    RenewOut,
    StatusOut,
    SwapIn,
    _bearer_secret,
    _error,
    error_answer,
    grant_json,
    ok,
    renew_json,
)

__all__ = ["ServerSettings", "create_app"]

logger = logging.getLogger("fenced.server")


@dataclasses.dataclass
class ServerSettings:
    """How one server runs. ``url`` and ``options`` open the token source (as
    :func:`fenced.connect_async` does); ``api_keys`` None means no authentication (the CLI
    then listens on loopback only unless told otherwise)."""

    url: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    api_keys: Keys | None = None
    max_wait: float = 60.0
    """The longest one acquire request waits (a long poll); a client wanting longer asks again."""
    default_ttl: float = DEFAULT_TTL
    watch_interval: float = 0.25
    """How often a watch looks at the source for changes made elsewhere (expiry, another
    gateway); changes made through this server are seen at once."""
    watch_keepalive: float = 15.0
    """Seconds a ``/-/watch`` stream may be quiet: then it sends a comment (``: keepalive``),
    so idle proxies keep it and a client gone without a word is found by the write."""
    readiness_timeout: float = 2.0
    fast_lane: bool = True
    """acquire/renew/release of well-formed requests skip FastAPI's routing and validation
    layers (the same handlers and rules; see ``_FastLane``). False: every request through
    FastAPI (to compare the two)."""
    max_request_bytes: int = 1 << 20
    """A request body over this many bytes is refused (413 too_large) before it is held in
    memory. The largest request fenced takes is a 64 Ki-character record (JSON-escaped, under
    400 KiB); etcd caps a request at 1.5 MiB, Consul a KV value at 512 KiB."""
    loopback_hosts_only: bool = False
    """Refuse (403) requests whose ``Host`` is a dotted DNS name other than ``*.localhost``
    (an address, ``localhost`` or a single-label name is served). Against DNS rebinding: a
    web page the operator opens can point a name of its own at 127.0.0.1 and, being
    same-origin with it then, read the dashboard's data (request ids, on a server without
    keys) and take or release locks. Implies :attr:`same_origin_only`. ``fenced serve`` sets
    it when it has no API keys and listens on loopback."""
    same_origin_only: bool = False
    """Refuse (403) a request whose ``Origin`` is another site than its ``Host``: a page's
    cross-site "simple" POST (no preflight) reaches the server unasked, and with no API keys
    its unread answer still took or freed a lock. ``fenced serve`` sets it whenever it has no
    API keys (on loopback, and with ``--insecure-no-auth`` elsewhere)."""
    max_watches_per_client: int = 64
    """Watches (``/-/watch`` streams and blocking status queries) one client may have open at
    once — an API key, or without keys an address; one more is refused 429
    ``too_many_watches``. Each watch reads the source every ``watch_interval``: unbounded,
    one client could make the server read it without end (Consul bounds a client's
    connections at 200)."""
    max_watches: int = 1024
    """Watches open on this server, all clients together; one more is refused 503
    ``too_many_watches``."""
    max_waiting_per_client: int = 256
    """Acquires one client (counted as watches are: an API key, or without keys an address)
    may have waiting at once — long polls, each queued at the source and beating its place
    there; one more that would wait is refused 429 ``too_many_waiting`` (one answered at once
    is served). 0: no bound. A worker pool sharing one key waits as one client: raise it."""
    read_timeout: float = READ_TIMEOUT
    """Seconds a request's body may take to arrive (408 after that); the same bound holds for
    its head, in the HTTP protocol (``_http``). A long poll's wait is not counted: it starts
    once the request has arrived."""


RETRY_AFTER = {"retry-after": "1"}
"""On a refusal that passes once the client has fewer places (a watch, a waiting acquire)."""
_RETRY_HEADER: dict[str, Any] = {
    "Retry-After": {
        "description": "Seconds to wait before asking again",
        "schema": {"type": "integer"},
    }
}
_TOO_MANY_WATCHES: dict[int | str, dict[str, Any]] = {
    429: {"model": ErrorOut, "headers": _RETRY_HEADER, "description": "too_many_watches: the "
          "client's watches open reach --max-watches-per-client"},
    503: {"model": ErrorOut, "description": "unavailable, or too_many_watches: the server's "
          "reach --max-watches (with Retry-After)"},
}  # fmt: skip
_TOO_MANY_WAITING: dict[int | str, dict[str, Any]] = {
    429: {"model": ErrorOut, "headers": _RETRY_HEADER, "description": "too_many_waiting: the "
          "client's acquires waiting reach --max-waiting-per-client (an acquire answered at "
          "once is served)"},
}  # fmt: skip


def client_name(key: ApiKey | None, peer: str | None) -> str:
    """Whom a per-client bound counts a request against: its API key, or on a server without
    keys its peer's address. One identity for watches and waiting acquires alike."""
    return f"key {key.id}" if key is not None else f"address {peer or '?'}"


class _Places:
    """The places of one kind (watches, waiting acquires) the clients hold now: at most
    ``per_client`` a client (0: no bound; past it 429 ``code``) and ``total`` in all (0: no
    bound; past it 503 ``code``), refusals counted in fenced_refused_requests_total. A place
    taken is given back by the function :meth:`take` returns (once, whoever calls it)."""

    def __init__(
        self, gw: Gateway, what: str, code: str, per_client: int, total: int = 0, gauge: Any = None
    ) -> None:
        self.gw, self.what, self.code = gw, what, code
        self.per_client, self.total, self.gauge = per_client, total, gauge
        self.held: dict[str, int] = {}  # client -> its places now
        self.count = 0

    def full(self, who: str) -> bool:
        """True if ``who`` holds its bound of places."""
        return bool(self.per_client) and self.held.get(who, 0) >= self.per_client

    def refusal(self, who: str) -> ApiError:
        """The 429 for ``who`` at its bound (counted)."""
        return self._refused(
            429, f"{who} has {self.held.get(who, 0)} {self.what}, the limit of one client: "
            "let one end first",
        )  # fmt: skip

    def _refused(self, status: int, message: str) -> ApiError:
        self.gw.metrics.refused.labels(self.code).inc()
        refused = ApiError(status, self.code, message)
        refused.headers.update(RETRY_AFTER)
        return refused

    def take(self, who: str) -> Callable[[], None]:
        """Take a place for ``who``, or raise ApiError (429 at its bound, 503 at the server's)."""
        if self.total and self.count >= self.total:
            raise self._refused(
                503, f"this server has {self.total} {self.what}, its limit: try later"
            )
        if self.full(who):
            raise self.refusal(who)
        self.held[who] = self.held.get(who, 0) + 1
        self.count += 1
        if self.gauge is not None:
            self.gauge.inc()
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                self.count -= 1
                if self.gauge is not None:
                    self.gauge.dec()
                left = self.held[who] - 1
                if left:
                    self.held[who] = left
                else:
                    del self.held[who]

        return give_back


# -- routes -----------------------------------------------------------------------------------------
#
# A lock name may contain "/" (``jobs/nightly``), so "/v1/locks/jobs/watch" could be lock
# ``jobs/watch`` or the watch of ``jobs``. Actions therefore follow a segment "-", which no
# name can hold (each of its segments starts with a letter, digit or _): GitLab's "/-/".
# ``{name:lock}`` never matches such a segment, so no name swallows an action and every
# path means one thing.


class _LockNameConvertor(Convertor[str]):
    regex = r"(?!-(?:/|$))[^/]*(?:/(?!-(?:/|$))[^/]*)*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("lock", _LockNameConvertor())

# The lock-name grammar of validate_lock_name, for the OpenAPI document.
NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*(/[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*)*$"
READY_CACHE = 1.0
"""Seconds one look at the source answers /v1/ready for (it takes no key: bounded load)."""
DASHBOARD_LOCKS = 500
"""The most locks one dashboard answer reads the status of."""
PLAIN_REFUSED = (
    "this server signs its grants: renew and release take the grant's signed token (the "
    "acquire answer's 'signed'), not the plain {token}, with its request id"
)
"""Why a renewal or release with the plain token is refused when signing is on."""


def record_lock(name: str) -> str:
    """The lock whose keys may read and swap the record ``name``: the records fenced keeps for
    a lock — an election's last leader (``fenced.elect/X``: the hosts and pids the next
    leader's fence command stops) and a replicated group's configuration (``group/X``) — are
    X's; any other record is its own name's."""
    for prefix in (ELECTION_RECORDS, GROUP_RECORDS):
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix) :]
    return name


def _expires_in(grant: Grant) -> float:
    """Seconds the grant has left, from when its request was sent (never below 0)."""
    return max(0.0, grant.sent_at + grant.ttl - _clock.now())


def _grant_out(name: str, rid: str, grant: Grant, signed: FencingToken) -> GrantOut:
    return GrantOut(
        lock=name,
        token=str(grant.token),
        value=grant.token.value,
        signed=str(signed) if signed.signature else None,
        request_id=rid,
        lease_id=rid,
        ttl=grant.ttl,
        expires_in=_expires_in(grant),
    )


def _status_out(status: LockStatus, key: ApiKey | None, ids: bool = True) -> StatusOut:
    """``status`` as ``key`` may see it: the request id of the key's own grants only, and on a
    server without keys every grant's unless ``ids`` is False (signing on: with a request id a
    retried acquire hands out the grant's signed token, which renews and releases it)."""
    held = status.token is not None
    holder = client_id(key, status.holder) if ids or key is not None else None
    if holder is None and status.holder is not None:
        holder = status.owner or ("(another key's grant)" if key else "(held)")
    version = (
        f"{status.token.value}:held"
        if status.token
        else (f"{status.last_token.value}:free" if status.last_token else "0:free")
    )
    return StatusOut(
        name=status.name,
        held=held,
        token=str(status.token) if status.token else None,
        last_token=str(status.last_token) if status.last_token else None,
        remaining=status.remaining,
        waiters=status.waiters,
        owner=status.owner,
        holder=holder,
        version=version,
    )


def _check_out(result: TokenCheck) -> CheckOut:
    return CheckOut(
        token=str(result.token.unsigned()),
        lock=result.token.lock,
        current=result.current,
        highest=str(result.highest) if result.highest else None,
        stale=result.stale,
        never_granted=result.never_granted,
        verdict=result.verdict,  # type: ignore[arg-type]
    )


# -- who is asking --------------------------------------------------------------------------------

_bearer = HTTPBearer(auto_error=False, description="An API key's secret, if the server has keys.")


async def _principal(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> ApiKey | None:
    """The API key of the request (None when the server has no keys); 401 without one."""
    return _find_key(
        request.app.state.keys, request.app.state.gateway, request.headers.get("authorization")
    )


def _find_key(keys: Keys | None, gw: Gateway, authorization: str | None) -> ApiKey | None:
    """The API key an ``Authorization`` header names (None without keys); ApiError 401."""
    if keys is None:
        return None
    secret = _bearer_secret(authorization)
    if secret is None:
        gw.metrics.refused.labels("unauthenticated").inc()
        raise ApiError(401, "unauthenticated", "send Authorization: Bearer <API key>")
    key = keys.find(secret)
    if key is None:
        gw.metrics.refused.labels("unauthenticated").inc()
        raise ApiError(401, "unauthenticated", "unknown API key")
    return key


Principal = Annotated[ApiKey | None, Depends(_principal)]


# -- the app ---------------------------------------------------------------------------------------


# FastAPI 0.16x asks on every request whether OpenTelemetry has been set up (environment
# lookups, ~8 % of a grant's CPU in a profile); fenced serve's metrics are its Prometheus ones.
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI).parameters
    else {}
)


def _twin(app: FastAPI, endpoint: Callable[..., Any], path: str) -> APIRoute:
    """``endpoint``'s route, built once, also at ``path`` (out of the document): the same
    handler, models and dependencies. FastAPI's analysis of an endpoint (its parameters'
    models, its dependencies) is most of what building the app costs, and every ``fenced
    serve`` pays it at start; a second ``add_api_route`` of the same endpoint did it again."""
    route = next(r for r in app.router.routes if isinstance(r, APIRoute) and r.endpoint is endpoint)
    twin = copy.copy(route)
    twin.path = path
    twin.path_regex, twin.path_format, twin.param_convertors = compile_path(path)
    twin.include_in_schema = False
    return twin


def create_app(settings: ServerSettings) -> FastAPI:
    """The ASGI app of ``fenced serve``; run it with any ASGI server (the CLI uses uvicorn)."""
    locks = AsyncLocks(settings.url, **settings.options)
    gw = Gateway(locks, max_wait=settings.max_wait, default_ttl=settings.default_ttl)
    keys = settings.api_keys
    watches = _Places(
        gw, "watches open", "too_many_watches", settings.max_watches_per_client,
        settings.max_watches, gw.metrics.watches,
    )  # fmt: skip
    waiting = _Places(gw, "acquires waiting", "too_many_waiting", settings.max_waiting_per_client)
    verifier = locks.verifier  # (its key's public half, bound to its source id)
    signing = locks.signing_key_id is not None
    # Retired keys (fenced serve --verify-key): their tokens' renewals and releases are
    # counted, so an operator sees when no grant made under one is live any more.
    signing_kid = locks.signing_key_id[0] if locks.signing_key_id else None
    retired_kids = sorted(verifier.kids - {signing_kid}) if isinstance(verifier, Keyring) else []
    for kid in retired_kids:
        gw.metrics.retired_key.labels(kid)  # (shown at 0 from the start)
    if retired_kids:
        logger.info(
            "also verifying the tokens of key(s) %s (--verify-key)", ", ".join(retired_kids)
        )

    def status_out(status: LockStatus, key: ApiKey | None) -> StatusOut:
        return _status_out(status, key, ids=not signing)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = _Service(
        title="fenced",
        version=__version__,
        summary="A lock service that hands out fencing tokens.",
        description=(
            "Locks with leases and **fencing tokens**: every grant returns a token strictly "
            "greater than every earlier grant of that lock. Send it with every write; the "
            "resource refuses a lower one. Authentication (when configured): "
            "`Authorization: Bearer <secret>`."
        ),
        lifespan=lifespan,
        docs_url=None,  # (Swagger UI loads scripts from a CDN: not on an air-gapped host)
        redoc_url=None,
        # (not responses=_ERRORS: FastAPI builds a model field for every error of every
        # route at start, used only by the document; _document declares them when first asked)
        **_NO_NATIVE_TELEMETRY,
    )
    app.state.gateway = gw
    app.state.keys = keys
    app.state.watches, app.state.waiting = watches, waiting  # (tests read them)
    app.loopback_hosts_only = settings.loopback_hosts_only
    app.same_origin_only = settings.same_origin_only or settings.loopback_hosts_only

    # -- errors ------------------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        gw.metrics.refused.labels("invalid").inc()
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "request"
        return _error(400, "invalid_request", f"{where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        if (
            exc.status_code == 400
        ):  # (FastAPI's "error parsing the body": a bad body, as documented)
            gw.metrics.refused.labels("invalid").inc()
            code = "invalid_request"
        answer = _error(exc.status_code, code, str(exc.detail))
        answer.headers.update(exc.headers or {})  # (a 405's Allow: RFC 9110 requires it)
        return answer

    def fail(exc: BaseException) -> ApiError:
        """A library error as an API answer (the source's own words, never a secret)."""
        if isinstance(exc, RecordConflict):
            extra = {"name": exc.name, "expected": exc.expected, "current": exc.current}
            return ApiError(409, "conflict", str(exc), extra)
        if isinstance(exc, LockTimeout):
            return ApiError(409, "timeout", str(exc))
        if isinstance(exc, LeaseLostError):
            return ApiError(410, "lease_lost", str(exc))
        if isinstance(exc, InvalidTokenError):
            gw.metrics.refused.labels("invalid").inc()
            return ApiError(400, "invalid_token", str(exc))
        if isinstance(exc, ConfigurationError):
            gw.metrics.refused.labels("invalid").inc()
            return ApiError(400, "invalid_request", str(exc))
        if isinstance(exc, BackendUnavailable):
            return ApiError(503, "unavailable", str(exc))
        return ApiError(503, "unavailable", f"{type(exc).__name__}: {exc}")

    async def call(aw: Awaitable[Any]) -> Any:
        try:
            return await aw
        except FencedError as exc:
            raise fail(exc) from exc

    # -- auth --------------------------------------------------------------------------------

    def allow(key: ApiKey | None, verb: Verb, name: str | None = None) -> None:
        if key is not None and not key.allows(verb, name):
            gw.metrics.refused.labels("forbidden").inc()
            what = f" on {name!r}" if name else ""
            raise ApiError(403, "forbidden", f"key {key.id!r} may not {verb.value}{what}")

    def clients(name: str) -> None:
        """403 if ``name`` is one the server keeps at its source (``RESERVED``): the expiry
        claims' records are its count of expiries across gateways, taken by compare-and-set;
        a client writing them could make an expiry uncounted or counted twice."""
        if name.startswith(RESERVED):
            gw.metrics.refused.labels("forbidden").inc()
            raise ApiError(
                403, "forbidden", f"{name!r}: names starting with {RESERVED!r} are fenced "
                "serve's own (its records are readable at /v1/records); choose another name",
            )  # fmt: skip

    def readable(key: ApiKey | None, name: str) -> None:
        if key is not None and not key.sees(name):
            gw.metrics.refused.labels("forbidden").inc()
            raise ApiError(403, "forbidden", f"key {key.id!r} may not read {name!r}")

    def lock_name(name: str) -> str:
        try:
            return validate_lock_name(name)
        except InvalidTokenError as exc:
            gw.metrics.refused.labels("invalid").inc()
            raise ApiError(400, "invalid_request", str(exc)) from None

    def parse(token: str, name: str | None, keys_: Keyring | None = None) -> FencingToken:
        try:
            return FencingToken.coerce(token, name, keys_)
        except InvalidTokenError as exc:
            raise fail(exc) from None

    def lease_args(name: str, fields: Any, key: ApiKey | None) -> tuple[str, FencingToken, str]:
        """A renewal's or release's lock name, token and request id, checked, for ``key``;
        ``fields``: the body's (LeaseIn's, as a mapping)."""
        name = lock_name(name)
        allow(key, Verb.ACQUIRE, name)
        clients(name)
        lease_id = fields.get("lease_id")
        rid = fields.get("request_id")
        rid = rid if rid is not None else lease_id
        if rid is None:
            raise ApiError(400, "invalid_request", "request_id (or lease_id) is required")
        try:
            check_request_id(rid)
            if lease_id is not None:  # (both given: both must be good, and agree)
                check_request_id(lease_id)
                if lease_id != rid:
                    raise ConfigurationError("request_id and lease_id differ: give one")
            ttl = fields.get("ttl")
            if ttl is not None:  # (a release takes no ttl, but a bad one is refused)
                check_ttl(ttl)
        except ConfigurationError as exc:
            raise fail(exc) from None
        token = parse(fields["token"], name)
        if signing and token.signature is None:
            # The plain token is public (a status shows it): with signing on, the signed one,
            # which only the grant's answer carried, proves the grant with its request id.
            raise fail(SignatureError(PLAIN_REFUSED.format(token=token)))
        if token.signature is not None and verifier is not None:
            try:  # (a signed one must be this server's)
                verifier.verify(token.lock, token.value, token.signature)
            except InvalidTokenError as exc:
                raise fail(exc) from None
            if retired_kids and token.signature[0] != signing_kid:
                gw.metrics.retired_key.labels(token.signature[0]).inc()
        return name, token, rid

    # -- locks -------------------------------------------------------------------------------

    @app.post(
        "/v1/locks/{name:lock}/-/acquire",
        response_model=GrantOut,
        responses={
            409: {"model": ErrorOut, "description": "timeout: not granted in time"},
            410: {
                "model": ErrorOut,
                "description": "lease_lost: this request id's grant has ended (a late duplicate)",
            },
            **_TOO_MANY_WAITING,
        },
        tags=["locks"],
        summary="Acquire a lock (a long poll while it waits)",
    )
    async def acquire(
        name: str,
        request: Request,
        key: Principal,
        body: Annotated[AcquireIn | None, Body()] = None,
    ) -> GrantOut:
        client = request.client.host if request.client else None
        return await do_acquire(name, body or AcquireIn(), key, client, request.receive)

    def acquire_args(
        name: str, fields: Any, key: ApiKey | None, client: str | None
    ) -> tuple[str, str, float, float, str]:
        """An acquire's lock name, request id, ttl, wait and holder description, checked;
        ``fields``: the body's (AcquireIn's, as a mapping)."""
        name = lock_name(name)
        allow(key, Verb.ACQUIRE, name)
        clients(name)
        try:
            ttl = fields.get("ttl")
            ttl = check_ttl(ttl if ttl is not None else settings.default_ttl)
            timeout = fields.get("timeout")
            timeout = check_timeout(timeout if timeout is not None else 0.0)
            given = fields.get("request_id")  # ("" is a bad id, not an absent one)
            rid = check_request_id(gw.new_request_id() if given is None else given)
            described = check_description(fields.get("owner"))
        except ConfigurationError as exc:
            raise fail(exc) from None
        owner = described or f"http client {client or '?'}"
        if key is not None:
            owner = f"{key.id}: {owner}"
        return name, rid, ttl, min(timeout or 0.0, settings.max_wait), owner[:200]

    async def take_grant(
        name: str, rid: str, ttl: float, wait: float, owner: str,
        key: ApiKey | None, client: str | None, receive: Receive,
    ) -> tuple[Grant, FencingToken]:  # fmt: skip
        """An acquire's grant, through the route or the lane: a waiting one within its
        client's bound (``--max-waiting-per-client``)."""
        who = client_name(key, client)
        if wait and waiting.full(who):
            # At its bound, a client's acquire is served if it is answered at once (tried
            # once, nothing queued); one that would wait is refused. (Each waiting one costs
            # the server and the source until it ends: 500 of one client took a second of
            # the server's CPU a second.)
            try:
                return await gw.acquire_for(key, name, rid, ttl, 0.0, owner, count_timeout=False)
            except LockTimeout:
                raise waiting.refusal(who) from None
            except FencedError as exc:
                raise fail(exc) from exc
        give_back = waiting.take(who) if wait else None
        try:
            # Only a waiting acquire (a long poll) watches for the client leaving or a shutdown.
            got: tuple[Grant, FencingToken] = await call(
                gw.acquire_for(
                    key, name, rid, ttl, wait, owner,
                    waiting=(lambda granting: _unless_gone(receive, gw, granting)) if wait else None,
                )
            )  # fmt: skip
            return got
        finally:  # (granted, timed out, client gone, cancelled, server stopping: its place back)
            if give_back is not None:
                give_back()

    async def do_acquire(
        name: str, body: AcquireIn, key: ApiKey | None, client: str | None, receive: Receive
    ) -> GrantOut:
        name, rid, ttl, wait, owner = acquire_args(name, body.__dict__, key, client)
        grant, signed = await take_grant(name, rid, ttl, wait, owner, key, client, receive)
        return _grant_out(name, rid, grant, signed)

    # The lane's verbs (``_layers``): the same checks and calls as the routes', the answer
    # written as bytes (the routes' models' JSON), no model on the way. ``fields``: the
    # body's, as a mapping; ``client``: the peer's address.

    async def acquire_now(
        name: str, fields: Any, key: ApiKey | None, client: str | None, receive: Receive
    ) -> Answer:
        try:
            name, rid, ttl, wait, owner = acquire_args(name, fields, key, client)
            grant, signed = await take_grant(name, rid, ttl, wait, owner, key, client, receive)
        except ApiError as exc:
            return error_answer(exc)
        token = grant.token
        return ok(
            grant_json(
                name,
                str(token),
                token.value,
                str(signed) if signed.signature else None,
                rid,
                grant.ttl,
                _expires_in(grant),
            )
        )

    async def renew_now(
        name: str, fields: Any, key: ApiKey | None, client: str | None, receive: Receive
    ) -> Answer:
        try:
            name, token, rid = lease_args(name, fields, key)
            grant = await call(gw.renew_for(key, name, token, rid, fields.get("ttl")))
        except ApiError as exc:
            return error_answer(exc)
        return ok(renew_json(grant.ttl, _expires_in(grant)))

    async def release_now(
        name: str, fields: Any, key: ApiKey | None, client: str | None, receive: Receive
    ) -> Answer:
        try:
            name, token, rid = lease_args(name, fields, key)
            retry = fields.get("retry") is True
            released = await call(gw.release_for(key, name, token, rid, retry=retry))
        except ApiError as exc:
            return error_answer(exc)
        return ok(RELEASED[0] if released else RELEASED[1])

    @app.post(
        "/v1/locks/{name:lock}/-/renew",
        response_model=RenewOut,
        responses={410: {"model": ErrorOut, "description": "lease_lost: the grant has ended"}},
        tags=["locks"],
        summary="Renew a lease (any gateway in front of the same source can)",
    )
    async def renew(name: str, body: LeaseIn, key: Principal) -> RenewOut:
        # (also the fast lane's: Principal is an ApiKey | None to a plain call)
        name, token, rid = lease_args(name, body.__dict__, key)
        grant = await call(gw.renew_for(key, name, token, rid, body.ttl))  # (lease_args checked it)
        return RenewOut(ttl=grant.ttl, expires_in=_expires_in(grant))

    @app.post(
        "/v1/locks/{name:lock}/-/release",
        response_model=ReleaseOut,
        tags=["locks"],
        summary="Release a grant (fenced: never frees a later grant)",
    )
    async def release(name: str, body: ReleaseIn, key: Principal) -> ReleaseOut:
        name, token, rid = lease_args(name, body.__dict__, key)
        released = await call(gw.release_for(key, name, token, rid, retry=body.retry is True))
        return ReleaseOut(released=released)

    @app.post(
        "/v1/locks/{name:lock}/-/force-release",
        response_model=ForceOut,
        tags=["admin"],
        summary="Free a lock whoever holds it (operators; its token stays fenced)",
    )
    async def force_release(
        name: str, key: Principal, body: Annotated[ForceIn | None, Body()] = None
    ) -> ForceOut:
        name = lock_name(name)
        allow(key, Verb.ADMIN, name)
        token = parse(body.token, name) if body and body.token is not None else None
        freed = await call(gw.force_release(name, token))
        return ForceOut(released=status_out(freed, key) if freed else None)

    def watch_slot(key: ApiKey | None, request: Request) -> Callable[[], None]:
        """Take a watch's place, or refuse it (429 past the client's bound, 503 past the
        server's: counted as refused ``too_many_watches``); the function gives it back (once,
        whatever calls it)."""
        return watches.take(client_name(key, request.client.host if request.client else None))

    @app.get(
        "/v1/locks/{name:lock}/-/watch",
        tags=["locks"],
        summary="Server-sent events: the lock's status now and at every change",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}, **_TOO_MANY_WATCHES},
    )
    async def watch(name: str, request: Request, key: Principal) -> StreamingResponse:
        name = lock_name(name)
        readable(key, name)
        await call(gw.backend.status(name))  # unreachable source: 503 now, not a dead stream
        give_back = watch_slot(key, request)

        async def events() -> AsyncIterator[bytes]:
            changes = gw.changes(name, settings.watch_interval)
            # A comment every ``watch_keepalive`` s while the lock does not change (it was sent
            # only after a change: a quiet stream sent nothing). Idle proxies and NATs keep
            # the connection, and a client gone without a word is found by the write failing
            # — its watch's place given back — rather than held for good.
            following: asyncio.Future[LockStatus] | None = None
            try:
                while True:
                    if following is None:
                        following = asyncio.ensure_future(anext(changes))
                    done, _ = await asyncio.wait({following}, timeout=settings.watch_keepalive)
                    if not done:
                        yield b": keepalive\n\n"
                        continue
                    try:
                        status = following.result()
                    except StopAsyncIteration:
                        break
                    following = None
                    data = status_out(status, key).model_dump_json()
                    yield f"event: status\ndata: {data}\n\n".encode()
            except FencedError as exc:
                msg = json.dumps({"error": "unavailable", "message": str(exc)})
                yield f"event: error\ndata: {msg}\n\n".encode()
            finally:
                give_back()  # (first: a cancelled scope may cancel the awaits below too)
                if following is not None:
                    following.cancel()
                    with contextlib.suppress(BaseException):
                        await following
                with contextlib.suppress(BaseException):
                    await changes.aclose()

        # (given back when the stream ends, and after the response in any case: a stream
        # never started runs no finally)
        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"cache-control": "no-store"},
            background=BackgroundTask(give_back),
        )

    @app.get(
        "/v1/locks/{name:lock}",
        response_model=StatusOut,
        tags=["locks"],
        summary="Status of one lock; with index and wait, a blocking query (Consul's)",
        responses=_TOO_MANY_WATCHES,
    )
    async def status(
        name: str,
        request: Request,
        key: Principal,
        index: Annotated[
            str | None, Query(max_length=64, description="A version seen before")
        ] = None,
        wait: Annotated[float, Query(ge=0, le=600, description="Seconds to wait for a change")] = 0,
    ) -> StatusOut:
        name = lock_name(name)
        readable(key, name)
        deadline = _clock.now() + min(wait, settings.max_wait)
        out = status_out(await call(gw.backend.status(name)), key)
        if index is None or out.version != index or wait <= 0:
            return out

        async def until_changed() -> StatusOut:
            async for st in gw.changes(name, settings.watch_interval):
                now_out = status_out(st, key)
                if now_out.version != index:
                    return now_out
            raise BackendUnavailable("server shutting down")

        give_back = watch_slot(key, request)
        try:
            async with asyncio.timeout(max(0.0, deadline - _clock.now())):
                changed: StatusOut = await call(_unless_gone(request.receive, gw, until_changed()))
                return changed
        except TimeoutError:
            return status_out(await call(gw.backend.status(name)), key)
        finally:
            give_back()

    @app.get("/v1/locks", response_model=ListOut, tags=["locks"], summary="Names of all locks")
    async def list_locks(key: Principal) -> ListOut:
        names = await call(gw.backend.lock_names())
        return ListOut(locks=[n for n in names if key is None or key.sees(n)])

    # -- records -----------------------------------------------------------------------------

    @app.get(
        "/v1/records/{name:lock}",
        response_model=RecordOut,
        tags=["records"],
        summary="A versioned record (a replicated group's configuration)",
    )
    async def read_record(name: str, key: Principal) -> RecordOut:
        name = lock_name(name)
        readable(key, record_lock(name))
        record = await call(gw.backend.read_record(name))
        if record is None:
            return RecordOut(name=name, version=0, value=None)
        return RecordOut(name=name, version=record.version, value=record.value)

    @app.post(
        "/v1/records/{name:lock}/-/swap",
        response_model=RecordOut,
        responses={409: {"model": ErrorOut, "description": "conflict: the record changed"}},
        tags=["records"],
        summary="Compare-and-set a record: store value if it is at version now",
    )
    async def swap_record(name: str, body: SwapIn, key: Principal) -> RecordOut:
        name = lock_name(name)
        allow(key, Verb.ACQUIRE, record_lock(name))
        clients(name)
        record = await call(gw.backend.swap_record(name, body.version, body.value))
        return RecordOut(name=name, version=record.version, value=record.value)

    # The paths before "/-/" (POST /v1/locks/{name}/acquire ...): still served, unambiguous
    # because only actions take a POST; not in the document. (GET .../watch is lock status.)
    for path, legacy in (
        ("/v1/locks/{name:lock}/acquire", acquire),
        ("/v1/locks/{name:lock}/renew", renew),
        ("/v1/locks/{name:lock}/release", release),
        ("/v1/locks/{name:lock}/force-release", force_release),
        ("/v1/records/{name:lock}/swap", swap_record),
    ):
        app.router.routes.append(_twin(app, legacy, path))

    # -- tokens ------------------------------------------------------------------------------

    @app.post(
        "/v1/check",
        response_model=CheckOut,
        tags=["tokens"],
        summary="Is this token the current grant of its lock? (Chubby's CheckSequencer)",
        description=(
            "A check and a later write are two steps: the answer may be stale by the time the "
            "resource writes. Safe use: a resource that keeps its own high-water mark. Without "
            "one, check inside the resource's own critical section and keep it short; see "
            "docs/server.md. With signing on, an unsigned or forged token is refused (400)."
        ),
    )
    async def check(body: CheckIn, key: Principal) -> CheckOut:
        # Authorized before it is judged: a key learns nothing (good signature or forged,
        # counted or not) of tokens of locks it may not check.
        allow(key, Verb.CHECK)
        try:
            token = FencingToken.parse(body.token)
            allow(key, Verb.CHECK, token.lock)
            if verifier is not None:
                token = FencingToken.coerce(token, None, verifier)
        except InvalidTokenError as exc:
            gw.metrics.checks.labels("invalid").inc()
            raise ApiError(400, "invalid_token", str(exc)) from None
        result = await call(gw.check(token))
        return _check_out(result)

    # -- the server --------------------------------------------------------------------------

    def info() -> InfoOut:
        backend = gw.backend
        signer = locks.signing_key_id
        return InfoOut(
            version=__version__,
            source=backend.scheme,
            characteristics=sorted(c.value for c in backend.effective_characteristics),
            knows_highest=backend.knows_highest,
            signing={"kid": signer[0], "algorithm": signer[1]} if signer else None,
            max_wait=settings.max_wait,
            default_ttl=settings.default_ttl,
            auth=keys is not None,
        )

    @app.get(
        "/v1/info",
        response_model=InfoOut,
        tags=["server"],
        summary="What this server is (with keys: for any key, never anonymous)",
    )
    async def get_info(key: Principal) -> InfoOut:
        return info()

    # Readiness is for probes, which have no key: it answers anyone, with nothing but yes or
    # no, and asks the source at most once a second however many ask (one shared look).
    readiness: dict[str, Any] = {"at": -1.0, "look": None}

    async def look() -> str | None:
        try:
            async with asyncio.timeout(settings.readiness_timeout):
                await gw.backend.status(READY_LOCK)
        except (FencedError, TimeoutError) as exc:
            # (the details to the log: the answer goes to anyone, without a key)
            logger.warning("not ready: token source: %s", exc or "timed out")
            return "the token source does not answer"
        return None

    async def source_trouble() -> str | None:
        now = _clock.now()
        if readiness["look"] is None or now - readiness["at"] >= READY_CACHE:
            readiness["at"] = now
            readiness["look"] = asyncio.ensure_future(look())
        trouble: str | None = await asyncio.shield(readiness["look"])
        return trouble

    @app.get("/v1/health", tags=["server"], summary="Liveness: the process answers")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/v1/ready",
        tags=["server"],
        summary="Readiness: the token source answers",
        responses={503: {"model": ErrorOut}},
    )
    async def ready() -> dict[str, str]:
        if gw.stopping.is_set():
            raise ApiError(503, "unavailable", "shutting down")
        trouble = await source_trouble()
        if trouble is not None:
            raise ApiError(503, "unavailable", trouble)
        return {"status": "ready"}

    @app.get("/metrics", tags=["server"], summary="Prometheus metrics", response_class=Response)
    async def metrics(key: Principal) -> Response:
        allow(key, Verb.METRICS)
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/dashboard", response_model=DashboardOut, tags=["server"], include_in_schema=True)
    async def dashboard_data(
        key: Principal,
        prefix: Annotated[
            str, Query(max_length=MAX_NAME, description="Only locks whose name starts so")
        ] = "",
    ) -> DashboardOut:
        names = [n for n in await call(gw.backend.lock_names()) if key is None or key.sees(n)]
        # (filtered before the statuses are read: a page showing jobs/ costs jobs/'s locks,
        # and the first DASHBOARD_LOCKS are those with the prefix, not the first of all)
        matching = [n for n in names if n.startswith(prefix)]
        shown = matching[:DASHBOARD_LOCKS]
        statuses = await call(asyncio.gather(*(gw.backend.status(n) for n in shown)))
        # The counters are the server's, across keys — /metrics's data: a key without the
        # metrics verb gets none (null). A refusal counted for another key's request id, and
        # not for an unknown one, told any key which ids it guessed are in use.
        counted = key is None or key.allows(Verb.METRICS)
        counters: dict[str, float] = {}
        for family in gw.metrics.registry.collect() if counted else ():
            for sample in family.samples:
                if sample.name.endswith("_total") or sample.name in (
                    "fenced_acquires_waiting",
                    "fenced_leases_tracked",
                ):
                    label = ",".join(f"{v}" for v in sample.labels.values())
                    counters[sample.name + (f"{{{label}}}" if label else "")] = sample.value
        return DashboardOut(
            locks=[status_out(s, key) for s in statuses],
            counters=counters if counted else None,
            events=[e.json() for e in reversed(gw.events) if key is None or key.sees(e.lock)],
            info=info(),
            truncated=len(matching) > len(shown),
            total=len(names),
            ttls=gw.ttls({s.name: s.token for s in statuses if s.token is not None}),
        )

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        # (browsers ask for it on every load: a 404 was a console error each time)
        return Response(_FAVICON, media_type="image/svg+xml", headers=_FAVICON_HEADERS)

    page = resources.files("fenced.server").joinpath("dashboard.html").read_text()
    page_headers = {"cache-control": "no-store", **_page_policy(page)}

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers=page_headers)

    routes = {
        r.path.rsplit("/", 1)[1]: r
        for r in app.routes
        if isinstance(r, APIRoute) and r.path.startswith("/v1/locks/{name:lock}/-/")
    }
    lanes: dict[str, _Lane] = {
        "acquire": _Lane(routes["acquire"], AcquireIn, acquire_now),
        "renew": _Lane(routes["renew"], LeaseIn, renew_now),
        "release": _Lane(routes["release"], ReleaseIn, release_now),
    }
    app.openapi = lambda: _document(app, keyed=keys is not None)  # type: ignore[method-assign]
    app.add_middleware(_Timing, gateway=gw)
    app.add_middleware(  # (outermost)
        _BodyLimit, limit=settings.max_request_bytes, timeout=settings.read_timeout, gateway=gw
    )
    if settings.fast_lane:  # (in front of the whole stack, with the same body bounds)
        bounds = _BodyLimit(
            app.through_stack, settings.max_request_bytes, settings.read_timeout, gw
        )
        app.front = _FastLane(app.through_stack, lanes, keys, gw, bounds)
        app.direct = DirectLane(app, app.front, settings.max_request_bytes)
    return app


# A padlock in the dashboard's green: the icon of the tab an operator keeps open.
_FAVICON = (
    b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
    b'<path d="M4 7V5a4 4 0 0 1 8 0v2" fill="none" stroke="#1f7a44" stroke-width="2"/>'
    b'<rect x="2" y="7" width="12" height="8" rx="1.5" fill="#1f7a44"/></svg>'
)
_FAVICON_HEADERS = {"cache-control": "max-age=86400"}


def _page_policy(page: str) -> dict[str, str]:
    """Headers that let the dashboard run its own script and style and nothing else: lock
    names and holder descriptions come from clients, and the page is written with
    textContent — should markup ever slip in, no inline handler or script of it runs (only
    the page's own, by hash), it loads nothing from elsewhere, and no other site can frame
    the page an operator types an API key into."""

    def digest(tag: str) -> str:
        body = page.split(f"<{tag}>", 1)[1].split(f"</{tag}>", 1)[0]
        return "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"

    policy = (
        f"default-src 'none'; script-src {digest('script')}; style-src {digest('style')}; "
        "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return {
        "content-security-policy": policy,
        "x-content-type-options": "nosniff",
        "referrer-policy": "no-referrer",
    }


API_VERSION = "1"
"""The version of the API the document describes (``/v1``): the package's version is for
clients with a key (``/v1/info``), not for anyone who asks."""


def _declare_errors(app: FastAPI) -> None:
    """What ``FastAPI(responses=_ERRORS)`` did at start, done for the document only: every
    documented route's responses are the error answers, then its own (its own answer to a
    status wins), each with a model its field, named and ordered as FastAPI does.
    (Idempotent: a second call finds every error declared and every field built.)"""
    for route in app.router.routes:
        if not isinstance(route, APIRoute) or not route.include_in_schema:
            continue  # (the document describes these alone)
        route.responses = {**_ERRORS, **route.responses}
        built = route.response_fields
        route.response_fields = {
            code: built.get(code)
            or create_model_field(
                name=f"Response_{code}_{route.unique_id}",
                type_=response["model"],
                mode="serialization",
            )
            for code, response in route.responses.items()
            if response.get("model")
        }


_WRITES = ("/-/acquire", "/-/renew", "/-/release", "/-/swap")
"""The routes that refuse a name of the server's own (403), with keys or without."""


def _document(app: FastAPI, keyed: bool) -> dict[str, Any]:
    """The OpenAPI document, made to say what the server does (tests/server/test_server_schema.py
    runs schemathesis against it): 400 where FastAPI would declare 422, the lock-name
    grammar on every ``name``, and bearer security only on a server with keys."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    _declare_errors(app)
    doc = get_openapi(
        title=app.title,
        version=API_VERSION,
        summary=app.summary,
        description=app.description,
        routes=app.routes,
    )
    schemas = doc.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    if not keyed:
        doc.get("components", {}).pop("securitySchemes", None)
    for path, item in doc["paths"].items():
        for op in item.values():
            op["responses"].pop("422", None)
            if not keyed:
                op.pop("security", None)
                op["responses"].pop("401", None)
                if not path.endswith(_WRITES):  # (a "_fenced-" name is refused there: 403)
                    op["responses"].pop("403", None)
            for param in op.get("parameters", []):
                if param["name"] == "name" and param["in"] == "path":
                    param["schema"] = {
                        "type": "string",
                        "pattern": NAME_PATTERN,
                        "maxLength": MAX_NAME,
                        "title": "Name",
                    }
                    param["description"] = (
                        "A lock name: segments of A-Z a-z 0-9 _ . : @ + = - joined by '/', "
                        "each starting with a letter, digit or _; 1-200 characters"
                    )
    app.openapi_schema = doc
    return doc


async def _unless_gone(receive: Receive, gw: Gateway, aw: Awaitable[Any]) -> Any:
    """Run ``aw`` unless the client hangs up or the server stops first (then it is cancelled:
    a waiting acquire leaves the queue; a grant made meanwhile is the same request id's, which
    the client's retry gets back)."""
    work = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnected(receive))
    stop = asyncio.ensure_future(gw.stopping.wait())
    try:
        await asyncio.wait({work, gone, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        stop.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        raise ApiError(503, "unavailable", "server shutting down" if stop.done() else "client gone")
    return work.result()


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
