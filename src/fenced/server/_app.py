"""The HTTP/JSON API of ``fenced serve`` (FastAPI on Starlette; OpenAPI at ``/openapi.json``).

Every answer that is not a success is ``{"error": <code>, "message": <one line>}`` with a
fitting status: 400 invalid_request / invalid_token, 401 unauthenticated, 403 forbidden,
404 not_found, 408 too_slow, 409 timeout, 410 lease_lost, 413 too_large, 503 unavailable.
A refused request changes nothing. See docs/server.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Annotated, Any, Literal

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__, _clock
from .._backend import MAX_RECORD, LockStatus, TokenCheck
from .._errors import (
    BackendUnavailable,
    ConfigurationError,
    FencedError,
    InvalidTokenError,
    LeaseLostError,
    LockTimeout,
    RecordConflict,
)
from .._lease import AsyncLocks, check_description
from .._signing import Keyring
from .._state import (
    DEFAULT_TTL,
    MAX_TIMEOUT,
    MAX_TTL,
    MIN_TTL,
    check_request_id,
    check_timeout,
    check_ttl,
)
from .._token import MAX_NAME, FencingToken, validate_lock_name
from ._auth import TAG_LENGTH, ApiKey, Keys, Verb
from ._gateway import Gateway
from ._http import BODY_RECEIVED, READ_TIMEOUT
from ._metrics import CONTENT_TYPE_LATEST

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
    readiness_timeout: float = 2.0
    fast_lane: bool = True
    """acquire/renew/release of well-formed requests skip FastAPI's routing and validation
    layers (the same handlers and rules; see ``_FastLane``). False: every request through
    FastAPI (to compare the two)."""
    max_request_bytes: int = 1 << 20
    """A request body over this many bytes is refused (413 too_large) before it is held in
    memory. The largest request fenced takes is a 64 Ki-character record (JSON-escaped, under
    400 KiB); etcd caps a request at 1.5 MiB, Consul a KV value at 512 KiB."""
    read_timeout: float = READ_TIMEOUT
    """Seconds a request's body may take to arrive (408 after that); the same bound holds for
    its head, in the HTTP protocol (``_http``). A long poll's wait is not counted: it starts
    once the request has arrived."""


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
MAX_INT = (1 << 63) - 1
"""The largest integer the API takes (a record version): SQLite's and PostgreSQL's bigint."""


# -- the wire format ------------------------------------------------------------------------------


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# Stated in the OpenAPI document; checked by fenced's own rules (check_ttl, check_timeout,
# check_request_id), whose one-line messages the answers carry.
_TTL: dict[str, Any] = {"minimum": MIN_TTL, "maximum": MAX_TTL}
_REQUEST_ID: dict[str, Any] = {"pattern": r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}$"}
_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]*"
_TOKEN: dict[str, Any] = {  # (the form FencingToken.parse takes: "<lock>:<value>[.kid.sig]")
    "pattern": rf"^{_SEGMENT}(/{_SEGMENT})*:[1-9][0-9]{{0,18}}"
    r"(\.[A-Za-z0-9_-]{1,32}\.([A-Za-z0-9_-]{43}|[A-Za-z0-9_-]{86}))?$"
}


class AcquireIn(_In):
    ttl: float | None = Field(
        default=None,
        description="Lease seconds (0.1-86400). Default 10.",
        json_schema_extra=_TTL,
    )
    timeout: float | None = Field(
        default=None,
        json_schema_extra={"minimum": 0, "maximum": MAX_TIMEOUT},
        description="Seconds to wait for the lock, FIFO (0 or absent: try once). One request "
        "waits at most the server's max wait (60 s by default) and then answers 409 timeout; "
        "ask again with the same request_id to keep waiting.",
    )
    request_id: str | None = Field(
        default=None,
        description="Your id for this acquire (1-64 of A-Z a-z 0-9 _ . : -). A retry with the "
        "same id and key returns the same grant, never a second one. It is your key's: another "
        "key's request with the same id is refused (403). Generated (random) if absent.",
        json_schema_extra=_REQUEST_ID,
    )
    owner: str | None = Field(
        default=None, description="Who you are, for operators (status, dashboard)."
    )


class GrantOut(BaseModel):
    lock: str
    token: str = Field(description="'<lock>:<value>': send it with every write.")
    value: int
    signed: str | None = Field(description="The token signed by the server (if signing is on).")
    request_id: str
    lease_id: str = Field(description="The same as request_id: it names this grant.")
    ttl: float
    expires_in: float = Field(description="Seconds the lease surely lasts unless renewed.")


class LeaseIn(_In):
    # One of request_id and lease_id (a string) is required; the document says so.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["request_id"], "properties": {"request_id": {"type": "string"}}},
                {"required": ["lease_id"], "properties": {"lease_id": {"type": "string"}}},
            ]
        }
    )
    token: str = Field(description="The grant's token, plain or signed.", json_schema_extra=_TOKEN)
    request_id: str | None = Field(
        default=None, description="The grant's request id.", json_schema_extra=_REQUEST_ID
    )
    lease_id: str | None = Field(
        default=None, description="Accepted in place of request_id.", json_schema_extra=_REQUEST_ID
    )
    ttl: float | None = Field(
        None,
        description="For a renewal through a gateway that did not make the grant.",
        json_schema_extra=_TTL,
    )


class RenewOut(BaseModel):
    ttl: float
    expires_in: float


class ReleaseOut(BaseModel):
    released: bool = Field(
        description="False if the grant had already ended (expired, taken over)."
    )


class ForceIn(_In):
    token: str | None = Field(
        default=None,
        description="Free the lock only if this grant holds it.",
        json_schema_extra=_TOKEN,
    )


class StatusOut(BaseModel):
    name: str
    held: bool
    token: str | None
    last_token: str | None = Field(description="The highest grant known (None: never, or unknown).")
    remaining: float | None
    waiters: int | None
    owner: str | None
    holder: str | None = Field(
        description="Who holds it: the request id to the key that made the grant (to every "
        "client on a server without keys); the holder's description (as owner) to any other "
        "key. A request id is the grant's capability: never shown to another key."
    )
    version: str = Field(description="Changes whenever holder or token changes (for ?index=).")


class ForceOut(BaseModel):
    released: StatusOut | None


class ListOut(BaseModel):
    locks: list[str]


class CheckIn(_In):
    token: str = Field(json_schema_extra=_TOKEN)


class CheckOut(BaseModel):
    token: str
    lock: str
    current: bool = Field(description="It is the live grant of its lock.")
    highest: str | None
    stale: bool = Field(description="A later grant exists: refuse this writer.")
    never_granted: bool = Field(
        description="Not a token the source issued: above its highest grant of the lock, or "
        "of a lock it never granted (forged, or from elsewhere). False where the source cannot "
        "know (etcd, ZooKeeper keep no counter: a free lock's highest grant is forgotten)."
    )
    verdict: Literal["current", "stale", "not_current", "never_granted"]


class ErrorOut(BaseModel):
    error: str
    message: str


class InfoOut(BaseModel):
    version: str
    source: str
    characteristics: list[str]
    knows_highest: bool
    signing: dict[str, str] | None
    max_wait: float
    default_ttl: float
    auth: bool


class DashboardOut(BaseModel):
    locks: list[StatusOut]
    counters: dict[str, float]
    events: list[dict[str, Any]]
    info: InfoOut
    truncated: bool


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorOut, "description": "invalid_request or invalid_token"},
    401: {"model": ErrorOut, "description": "unauthenticated"},
    403: {"model": ErrorOut, "description": "forbidden"},
    408: {"model": ErrorOut, "description": "too_slow: the body took over --read-timeout"},
    413: {"model": ErrorOut, "description": "too_large: a body over --max-request-bytes"},
    503: {"model": ErrorOut, "description": "unavailable: the token source cannot be reached"},
}


class RecordOut(BaseModel):
    name: str
    version: int = Field(description="0: never written; each swap adds one")
    value: str | None


def _integral(value: Any) -> Any:
    """JSON has one number type: ``246.0`` is the integer 246 (JSON Schema says so too); a
    fraction, a bool or a string stays refused (strict)."""
    if type(value) is float and value.is_integer() and abs(value) <= MAX_INT:
        return int(value)
    return value


class SwapIn(_In):
    version: Annotated[int, BeforeValidator(_integral)] = Field(
        ge=0,
        le=MAX_INT,
        description="The version the change is based on (0: none yet; at most 2^63-1)",
    )
    value: str = Field(max_length=MAX_RECORD)


class ApiError(Exception):
    def __init__(
        self, status: int, code: str, message: str, extra: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.extra = extra or {}


def _error(
    status: int, code: str, message: str, extra: dict[str, Any] | None = None
) -> JSONResponse:
    return JSONResponse({"error": code, "message": message, **(extra or {})}, status_code=status)


def own_id(key: ApiKey | None, request_id: str) -> str:
    """The request id a grant has at the source: the key's tag and the client's id, so that a
    grant belongs to the key that made it (on a server without keys, the id itself)."""
    return request_id if key is None else f"{key.tag}.{request_id}"


def client_id(key: ApiKey | None, holder: str | None) -> str | None:
    """The client's request id of a holder's source id, if ``key`` made that grant."""
    if holder is None or key is None:
        return holder
    tag = key.tag
    if len(holder) > TAG_LENGTH and holder[TAG_LENGTH] == "." and holder.startswith(tag):
        return holder[TAG_LENGTH + 1 :]
    return None


def others_id(key: ApiKey, holder: str | None, request_id: str) -> bool:
    """True if ``holder`` (a source id) is ``request_id`` of another key (or of a grant made
    without keys): a request naming it is refused, not served or queued."""
    if holder is None or holder == own_id(key, request_id):
        return False
    return holder == request_id or (
        len(holder) == TAG_LENGTH + 1 + len(request_id)
        and holder[TAG_LENGTH] == "."
        and holder.endswith(request_id)
    )


def _status_out(status: LockStatus, key: ApiKey | None) -> StatusOut:
    held = status.token is not None
    holder = client_id(key, status.holder)
    if holder is None and status.holder is not None:
        holder = status.owner or "(another key's grant)"  # never its request id
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


def _bearer_secret(authorization: str | None) -> str | None:
    scheme, _sep, secret = (authorization or "").partition(" ")
    return secret.strip() if scheme.lower() == "bearer" and secret.strip() else None


Principal = Annotated[ApiKey | None, Depends(_principal)]


# -- the app ---------------------------------------------------------------------------------------


# FastAPI 0.16x asks on every request whether OpenTelemetry has been set up (environment
# lookups, ~8 % of a grant's CPU in a profile); fenced serve's metrics are its Prometheus ones.
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI).parameters
    else {}
)


class _Service(FastAPI):
    """FastAPI, with the hot path answered before Starlette's middleware stack: ``front``
    (the fast lane) takes each HTTP request first and hands the rest to the whole stack
    (``through_stack``), which answers them as FastAPI always has."""

    front: _FastLane | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        front = self.front
        if front is not None and scope["type"] == "http":
            await front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def through_stack(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)


def create_app(settings: ServerSettings) -> FastAPI:
    """The ASGI app of ``fenced serve``; run it with any ASGI server (the CLI uses uvicorn)."""
    locks = AsyncLocks(settings.url, **settings.options)
    gw = Gateway(locks, max_wait=settings.max_wait, default_ttl=settings.default_ttl)
    keys = settings.api_keys
    verifier = locks.verifier  # (its key's public half, bound to its source id)

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
        responses=_ERRORS,
        **_NO_NATIVE_TELEMETRY,
    )
    app.state.gateway = gw
    app.state.keys = keys

    # -- errors ------------------------------------------------------------------------------

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error(exc.status, exc.code, exc.message, exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        gw.metrics.refused.labels("invalid").inc()
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "request"
        return _error(400, "invalid_request", f"{where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
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

    def readable(key: ApiKey | None, name: str) -> None:
        if key is not None and not key.sees(name):
            gw.metrics.refused.labels("forbidden").inc()
            raise ApiError(403, "forbidden", f"key {key.id!r} may not read {name!r}")

    async def refuse_others(key: ApiKey | None, name: str, rid: str) -> None:
        """403 if the lock's holder is another key's grant with this request id: a request id
        is a capability, and it is the key's that made the grant."""
        if key is None:
            return
        status = await call(gw.backend.status(name))
        if status.token is not None and others_id(key, status.holder, rid):
            gw.metrics.refused.labels("forbidden").inc()
            raise ApiError(403, "forbidden", f"request id {rid!r} is another key's grant")

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

    def lease_args(name: str, body: LeaseIn) -> tuple[FencingToken, str]:
        rid = body.request_id if body.request_id is not None else body.lease_id
        if rid is None:
            raise ApiError(400, "invalid_request", "request_id (or lease_id) is required")
        try:
            check_request_id(rid)
            if body.lease_id is not None:  # (both given: both must be good, and agree)
                check_request_id(body.lease_id)
                if body.lease_id != rid:
                    raise ConfigurationError("request_id and lease_id differ: give one")
            if body.ttl is not None:  # (a release takes no ttl, but a bad one is refused)
                check_ttl(body.ttl)
        except ConfigurationError as exc:
            raise fail(exc) from None
        token = parse(body.token, name)
        if token.signature is not None and verifier is not None:  # (plain ones: the request
            try:  # id proves the grant; a signed one must be this server's)
                verifier.verify(token.lock, token.value, token.signature)
            except InvalidTokenError as exc:
                raise fail(exc) from None
        return token, rid

    # -- locks -------------------------------------------------------------------------------

    @app.post(
        "/v1/locks/{name:lock}/-/acquire",
        response_model=GrantOut,
        responses={409: {"model": ErrorOut, "description": "timeout: not granted in time"}},
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

    async def do_acquire(
        name: str, body: AcquireIn, key: ApiKey | None, client: str | None, receive: Receive
    ) -> GrantOut:
        name = lock_name(name)
        allow(key, Verb.ACQUIRE, name)
        try:
            ttl = check_ttl(body.ttl if body.ttl is not None else settings.default_ttl)
            timeout = check_timeout(body.timeout if body.timeout is not None else 0.0)
            given = body.request_id  # ("" is a bad id, not an absent one)
            rid = check_request_id(gw.new_request_id() if given is None else given)
            described = check_description(body.owner)
        except ConfigurationError as exc:
            raise fail(exc) from None
        owner = described or f"http client {client or '?'}"
        if key is not None:
            owner = f"{key.id}: {owner}"
        wait = min(timeout or 0.0, settings.max_wait)
        if wait:  # (checked before it queues: a refused request changes nothing)
            await refuse_others(key, name, rid)
        granting = gw.acquire(name, own_id(key, rid), ttl, wait, owner[:200])
        # Only a waiting acquire (a long poll) watches for the client leaving or a shutdown.
        try:
            grant, signed = await (_unless_gone(receive, gw, granting) if wait else granting)
        except LockTimeout as exc:
            if not wait:  # (a try-once: only a refused grant pays for the look)
                await refuse_others(key, name, rid)
            raise fail(exc) from exc
        except FencedError as exc:
            raise fail(exc) from exc
        return GrantOut(
            lock=name,
            token=str(grant.token),
            value=grant.token.value,
            signed=str(signed) if signed.signature else None,
            request_id=rid,
            lease_id=rid,
            ttl=grant.ttl,
            expires_in=max(0.0, grant.sent_at + grant.ttl - _clock.now()),
        )

    @app.post(
        "/v1/locks/{name:lock}/-/renew",
        response_model=RenewOut,
        responses={410: {"model": ErrorOut, "description": "lease_lost: the grant has ended"}},
        tags=["locks"],
        summary="Renew a lease (any gateway in front of the same source can)",
    )
    async def renew(name: str, body: LeaseIn, key: Principal) -> RenewOut:
        return await do_renew(name, body, key)

    async def do_renew(name: str, body: LeaseIn, key: ApiKey | None) -> RenewOut:
        name = lock_name(name)
        allow(key, Verb.ACQUIRE, name)
        token, rid = lease_args(name, body)
        ttl = None
        if body.ttl is not None:
            try:
                ttl = check_ttl(body.ttl)
            except ConfigurationError as exc:
                raise fail(exc) from None
        try:
            grant = await gw.renew(name, token, own_id(key, rid), ttl)
        except LeaseLostError as exc:
            await refuse_others(key, name, rid)
            raise fail(exc) from exc
        except FencedError as exc:
            raise fail(exc) from exc
        return RenewOut(
            ttl=grant.ttl, expires_in=max(0.0, grant.sent_at + grant.ttl - _clock.now())
        )

    @app.post(
        "/v1/locks/{name:lock}/-/release",
        response_model=ReleaseOut,
        tags=["locks"],
        summary="Release a grant (fenced: never frees a later grant)",
    )
    async def release(name: str, body: LeaseIn, key: Principal) -> ReleaseOut:
        return await do_release(name, body, key)

    async def do_release(name: str, body: LeaseIn, key: ApiKey | None) -> ReleaseOut:
        name = lock_name(name)
        allow(key, Verb.ACQUIRE, name)
        token, rid = lease_args(name, body)
        released = await call(gw.release(name, token, own_id(key, rid)))
        if not released:
            await refuse_others(key, name, rid)
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
        return ForceOut(released=_status_out(freed, key) if freed else None)

    @app.get(
        "/v1/locks/{name:lock}/-/watch",
        tags=["locks"],
        summary="Server-sent events: the lock's status now and at every change",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def watch(name: str, request: Request, key: Principal) -> StreamingResponse:
        name = lock_name(name)
        readable(key, name)
        await call(gw.backend.status(name))  # unreachable source: 503 now, not a dead stream

        async def events() -> AsyncIterator[bytes]:
            changes = gw.changes(name, settings.watch_interval)
            beat = _clock.now()
            try:
                async for status in changes:
                    data = _status_out(status, key).model_dump_json()
                    yield f"event: status\ndata: {data}\n\n".encode()
                    if _clock.now() - beat > 15:
                        beat = _clock.now()
                        yield b": keepalive\n\n"
            except FencedError as exc:
                msg = json.dumps({"error": "unavailable", "message": str(exc)})
                yield f"event: error\ndata: {msg}\n\n".encode()

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={"cache-control": "no-store"}
        )

    @app.get(
        "/v1/locks/{name:lock}",
        response_model=StatusOut,
        tags=["locks"],
        summary="Status of one lock; with index and wait, a blocking query (Consul's)",
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
        out = _status_out(await call(gw.backend.status(name)), key)
        if index is None or out.version != index or wait <= 0:
            return out

        async def until_changed() -> StatusOut:
            async for st in gw.changes(name, settings.watch_interval):
                now_out = _status_out(st, key)
                if now_out.version != index:
                    return now_out
            raise BackendUnavailable("server shutting down")

        try:
            async with asyncio.timeout(max(0.0, deadline - _clock.now())):
                changed: StatusOut = await call(_unless_gone(request.receive, gw, until_changed()))
                return changed
        except TimeoutError:
            return _status_out(await call(gw.backend.status(name)), key)

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
        readable(key, name)
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
        allow(key, Verb.ACQUIRE, name)
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
        app.add_api_route(path, legacy, methods=["POST"], include_in_schema=False)

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
        try:
            token = FencingToken.coerce(body.token, None, verifier)
        except InvalidTokenError as exc:
            gw.metrics.checks.labels("invalid").inc()
            raise ApiError(400, "invalid_token", str(exc)) from None
        allow(key, Verb.CHECK, token.lock)
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
                await gw.backend.status("_fenced-ready")
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
    async def dashboard_data(key: Principal) -> DashboardOut:
        names = [n for n in await call(gw.backend.lock_names()) if key is None or key.sees(n)]
        shown = names[:500]
        statuses = await call(asyncio.gather(*(gw.backend.status(n) for n in shown)))
        counters: dict[str, float] = {}
        for family in gw.metrics.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") or sample.name in (
                    "fenced_acquires_waiting",
                    "fenced_leases_tracked",
                ):
                    label = ",".join(f"{v}" for v in sample.labels.values())
                    counters[sample.name + (f"{{{label}}}" if label else "")] = sample.value
        return DashboardOut(
            locks=[_status_out(s, key) for s in statuses],
            counters=counters,
            events=[e.json() for e in reversed(gw.events) if key is None or key.sees(e.lock)],
            info=info(),
            truncated=len(names) > len(shown),
        )

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        page = resources.files("fenced.server").joinpath("dashboard.html").read_text()
        return HTMLResponse(page, headers={"cache-control": "no-store"})

    routes = {
        r.path.rsplit("/", 1)[1]: r
        for r in app.routes
        if isinstance(r, APIRoute) and r.path.startswith("/v1/locks/{name:lock}/-/")
    }
    lanes: dict[str, _Lane] = {
        "acquire": _Lane(
            routes["acquire"],
            AcquireIn,
            lambda name, body, key, scope, receive: do_acquire(
                name, body, key, (scope.get("client") or (None,))[0], receive
            ),
        ),
        "renew": _Lane(
            routes["renew"],
            LeaseIn,
            lambda name, body, key, scope, receive: do_renew(name, body, key),
        ),
        "release": _Lane(
            routes["release"],
            LeaseIn,
            lambda name, body, key, scope, receive: do_release(name, body, key),
        ),
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
    return app


API_VERSION = "1"
"""The version of the API the document describes (``/v1``): the package's version is for
clients with a key (``/v1/info``), not for anyone who asks."""


def _document(app: FastAPI, keyed: bool) -> dict[str, Any]:
    """The OpenAPI document, made to say what the server does (tests/test_server_schema.py
    runs schemathesis against it): 400 where FastAPI would declare 422, the lock-name
    grammar on every ``name``, and bearer security only on a server with keys."""
    if app.openapi_schema is not None:
        return app.openapi_schema
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
    for item in doc["paths"].values():
        for op in item.values():
            op["responses"].pop("422", None)
            if not keyed:
                op.pop("security", None)
                op["responses"].pop("401", None)
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


@dataclasses.dataclass(frozen=True)
class _Lane:
    route: APIRoute  # (for the latency metric's route label, as FastAPI's routing sets it)
    model: type[_In]
    handle: Callable[[str, Any, ApiKey | None, Scope, Receive], Awaitable[BaseModel]]
    _latency: list[Any] = dataclasses.field(default_factory=list)

    def latency(self, gw: Gateway) -> Any:
        """The route's latency histogram (its child looked up once, not per request)."""
        if not self._latency:
            self._latency.append(gw.metrics.latency.labels(self.route.path, "POST"))
        return self._latency[0]


def _json_head(data: bytes) -> list[tuple[bytes, bytes]]:
    """The headers Starlette's JSON Response sends, without building one."""
    return [(b"content-length", b"%d" % len(data)), (b"content-type", b"application/json")]


_LOCKS = "/v1/locks/"


class _FastLane:
    """acquire, renew and release — a lock service's hot path — without Starlette's
    middleware stack, FastAPI's routing, dependency solving and response-model validation,
    which cost most of such a request's CPU. The same handlers run, with the same body models
    (validated the same way), the same body bounds (``_BodyLimit.read``: size and read
    timeout), the same error answers and the same latency metric. Only a request the lane is
    sure of takes it: a well-formed JSON object that validates, from an authenticated key
    allowed on the lock; anything else (a bad body, no or a wrong key, another route) goes to
    the FastAPI app with its body replayed, which answers it as it always has — one set of
    rules, one set of messages."""

    def __init__(
        self,
        app: ASGIApp,
        lanes: dict[str, _Lane],
        keys: Keys | None,
        gateway: Gateway,
        bounds: _BodyLimit,
    ) -> None:
        self.app, self.lanes, self.keys, self.gw, self.bounds = app, lanes, keys, gateway, bounds
        self.taken = 0  # requests answered here (tests read it)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] != "POST" or not path.startswith(_LOCKS):
            await self.app(scope, receive, send)
            return
        name, _, verb = path[len(_LOCKS) :].rpartition("/")
        if name.endswith("/-"):  # (the paths without it are the old ones, still served)
            name = name[:-2]
        lane = self.lanes.get(verb)
        if lane is None or not name:
            await self.app(scope, receive, send)
            return
        start = _clock.now()
        first = await self.bounds.read(scope, receive, send)
        if first is None:  # (refused: too large or too slow; answered and counted)
            return
        disconnected = first["type"] != "http.request"
        body = b"" if disconnected else first.get("body", b"")
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        model = self._model(lane, body)
        key = self._key(scope, name) if model is not None and not disconnected else False
        if model is None or key is False:
            await self.app(scope, replay, send)
            return
        scope["route"] = lane.route
        self.taken += 1
        replayed = True  # (the body is read: a waiting acquire watches for the disconnect)
        try:
            try:
                out = await lane.handle(name, model, key, scope, replay)
            except ApiError as exc:
                await _error(exc.status, exc.code, exc.message, exc.extra)(scope, replay, send)
                return
            data = out.model_dump_json().encode()
            await send({"type": "http.response.start", "status": 200, "headers": _json_head(data)})
            await send({"type": "http.response.body", "body": data})
        finally:
            lane.latency(self.gw).observe(_clock.now() - start)

    @staticmethod
    def _model(lane: _Lane, body: bytes) -> Any:
        """The body as the route's model, or None (then FastAPI says what is wrong)."""
        if not body and lane.model is AcquireIn:  # (only none at all: whitespace is bad JSON)
            return AcquireIn()
        try:
            data = json.loads(body)
            return lane.model.model_validate(data) if isinstance(data, dict) else None
        except ValueError:  # (json's and pydantic's errors both are)
            return None

    def _key(self, scope: Scope, name: str) -> ApiKey | Literal[False] | None:
        """The request's key if it may acquire ``name``; False: let FastAPI refuse it (and
        count the refusal: nothing here touches a metric)."""
        if self.keys is None:
            return None
        auth = [v for k, v in scope["headers"] if k == b"authorization"]
        secret = _bearer_secret(auth[0].decode("latin-1")) if len(auth) == 1 else None
        key = self.keys.find(secret) if secret is not None else None
        return key if key is not None and key.allows(Verb.ACQUIRE, name) else False


class _BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413 too_large, before more of it than
    that is held: at once by its Content-Length, else (chunked) as soon as the count passes
    the limit; and one not received within ``timeout`` seconds with 408 too_slow. A body
    within both is read here and handed on whole (every route reads its body whole anyway),
    then ``receive`` passes through: a long poll still sees the disconnect."""

    _NO_BODY = frozenset({"GET", "HEAD", "OPTIONS"})

    def __init__(self, app: ASGIApp, limit: int, timeout: float, gateway: Gateway) -> None:
        self.app, self.limit, self.timeout, self.gw = app, limit, timeout, gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in self._NO_BODY:
            await self.app(scope, receive, send)  # (their handlers never keep a body)
            return
        first = await self.read(scope, receive, send)
        if first is None:
            return

        async def replay() -> Message:
            nonlocal first
            if first is not None:
                handed, first = first, None
                return handed
            return await receive()

        await self.app(scope, replay, send)

    async def read(self, scope: Scope, receive: Receive, send: Send) -> Message | None:
        """The request's body as one message to hand on (or the disconnect that came
        instead); None if it was refused here (answered, counted)."""
        declared = [v for k, v in scope["headers"] if k == b"content-length"]
        if declared and declared[0].isdigit() and int(declared[0]) > self.limit:
            await self._refuse(scope, receive, send)
            return None
        if scope.get(BODY_RECEIVED):  # (whole already: nothing to wait for, no timer)
            whole = await receive()
            if whole["type"] != "http.request":
                return whole
            if len(whole.get("body", b"")) > self.limit:
                await self._refuse(scope, receive, send)
                return None
            return {"type": "http.request", "body": whole.get("body", b""), "more_body": False}
        chunks: list[bytes] = []
        size, more, message = 0, True, None
        try:
            async with asyncio.timeout(self.timeout):  # (a body sent a byte at a time)
                while more:
                    message = await receive()
                    if message["type"] != "http.request":  # (the client went away)
                        break
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.limit:
                        break
                    chunks.append(chunk)
                    more = message.get("more_body", False)
        except TimeoutError:
            self.gw.metrics.refused.labels("too_slow").inc()
            text = f"request body not received within {self.timeout:g} s"
            await _closing(_error(408, "too_slow", text))(scope, receive, send)
            return None
        if size > self.limit:
            await self._refuse(scope, receive, send)
            return None
        if message is None or message["type"] == "http.request":
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return message

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.gw.metrics.refused.labels("too_large").inc()
        message = f"request body over {self.limit} bytes"
        await _closing(_error(413, "too_large", message))(scope, receive, send)


def _closing(response: JSONResponse) -> JSONResponse:
    """The answer to a request whose body was not read to its end: the connection cannot
    carry another request after it, so it is closed (uvicorn does, on this header)."""
    response.headers["connection"] = "close"
    return response


class _Timing:
    """Request latency by route template (never by lock name), as a pure ASGI middleware; and
    every POST body read as JSON."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app, self.gw = app, gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (
            scope["method"] == "POST"
            and (b"content-type", b"application/json") not in scope["headers"]
        ):
            # Bodies are JSON whatever the Content-Type says: `curl -d '{...}'` sends a form type.
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        start = _clock.now()
        try:
            await self.app(scope, receive, send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None)
            if path is not None and not path.endswith("/-/watch"):
                self.gw.metrics.latency.labels(path, scope["method"]).observe(_clock.now() - start)
