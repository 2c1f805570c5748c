"""The wire format of ``fenced serve``'s API: the request and answer models (their JSON
Schema is the OpenAPI document's), the error answer, and the bearer header's form."""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.responses import JSONResponse

from .._core.backend import MAX_RECORD
from .._core.state import MAX_TIMEOUT, MAX_TTL, MIN_TTL

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
    token: str = Field(
        description="The grant's token: its signed form when the server signs (the plain one "
        "is then refused), else the plain one.",
        json_schema_extra=_TOKEN,
    )
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


class ReleaseIn(LeaseIn):
    retry: bool | None = Field(
        default=None,
        description="True when this release is asked again because the answer to an earlier "
        "one was lost (it may have released): the gateway that released the grant answers "
        "true again. Without it, a release of a grant already released answers false.",
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
    counters: dict[str, float] | None = Field(
        description="The gateway's counters (all keys'): null for a key without the metrics "
        "verb (they are /metrics's)."
    )
    events: list[dict[str, Any]]
    info: InfoOut
    truncated: bool = Field(description="More locks have the prefix than the answer holds.")
    total: int = Field(0, description="Locks the key may see, whatever their prefix.")
    ttls: dict[str, float] = Field(
        default_factory=dict,
        description="The ttl of each shown grant made or renewed through this gateway "
        "(the dashboard's time-left bar is its share of it).",
    )


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
        self.headers: dict[str, str] = {}  # (e.g. Retry-After on a refusal that may pass)

    def response(self) -> JSONResponse:
        """The error answer, with its headers."""
        answer = _error(self.status, self.code, self.message, self.extra)
        answer.headers.update(self.headers)
        return answer


def _error(
    status: int, code: str, message: str, extra: dict[str, Any] | None = None
) -> JSONResponse:
    return JSONResponse({"error": code, "message": message, **(extra or {})}, status_code=status)


def _bearer_secret(authorization: str | None) -> str | None:
    scheme, _sep, secret = (authorization or "").partition(" ")
    return secret.strip() if scheme.lower() == "bearer" and secret.strip() else None


def _closing(response: JSONResponse) -> JSONResponse:
    """The answer to a request whose body was not read to its end: the connection cannot
    carry another request after it, so it is closed (uvicorn does, on this header)."""
    response.headers["connection"] = "close"
    return response


def _json_head(data: bytes) -> list[tuple[bytes, bytes]]:
    """The headers Starlette's JSON Response sends, without building one."""
    return [(b"content-length", b"%d" % len(data)), (b"content-type", b"application/json")]


# -- the hot path's answers, as bytes -------------------------------------------------------------
#
# The direct lane writes its answers without building a model: the same bytes pydantic's
# ``model_dump_json`` writes for GrantOut, RenewOut and ReleaseOut (tests/server compare
# them). The strings in them are checked before (a lock name's grammar, a request id's, a
# token's form): none needs escaping; one that would is written by json, as pydantic does.

Answer = tuple[int, list[tuple[bytes, bytes]], bytes]
"""An answer: its status, its headers (lower case), its body."""


def _number(x: float) -> str:
    """A float as pydantic writes it: Python's shortest repr, but no exponent below 1e16
    (``0.00001``, not ``1e-05``), and null for inf and nan."""
    text = repr(float(x))
    if "e" in text or "n" in text:  # (rare: tiny or huge, inf, nan)
        if not math.isfinite(x):
            return "null"
        return str(pydantic_core.to_json(float(x)).decode())
    return text


def _string(text: str) -> str:
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    return json.dumps(text, ensure_ascii=False)


def grant_json(
    lock: str, token: str, value: int, signed: str | None, rid: str, ttl: float, left: float
) -> bytes:
    """GrantOut's JSON."""
    return (
        f'{{"lock":{_string(lock)},"token":{_string(token)},"value":{value:d},'
        f'"signed":{"null" if signed is None else _string(signed)},'
        f'"request_id":{_string(rid)},"lease_id":{_string(rid)},'
        f'"ttl":{_number(ttl)},"expires_in":{_number(left)}}}'
    ).encode()


def renew_json(ttl: float, left: float) -> bytes:
    """RenewOut's JSON."""
    return f'{{"ttl":{_number(ttl)},"expires_in":{_number(left)}}}'.encode()


RELEASED = (b'{"released":true}', b'{"released":false}')  # (ReleaseOut's JSON)


def ok(data: bytes) -> Answer:
    return 200, _json_head(data), data


def error_answer(exc: ApiError) -> Answer:
    """The answer ``_error`` makes of ``exc``, as bytes."""
    error = exc.response()  # (its headers too: a refusal's Retry-After)
    return exc.status, error.raw_headers, bytes(error.body)
