"""``http://`` and ``https://``: a ``fenced serve`` lock service as a token source.

``fenced.connect("http://10.0.0.5:7400,10.0.0.6:7400", api_key=...)`` lists one or more
gateways in front of the same source; a request that cannot reach one goes to the next. The
lease core runs here, in the client, as for every source: it renews through the service, and
a gateway that dies costs its holders nothing (another gateway resumes their grants from the
source). What the source promises (characteristics) is the service's source's, as the
service reports it at ``/v1/info``.

Requests that may be repeated safely (acquire and renew, by request id; reads) move on to the
next gateway after any transport error; a release or force release only when it surely was
not sent (connection refused), because a repeated release whose first reply was lost would
answer False for a grant it did release.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Final
from urllib.parse import SplitResult, quote

import httpx

from .._clients.tls import tls_context
from .._core import clock as _clock
from .._core.backend import (
    Backend,
    Characteristic,
    Grant,
    LockStatus,
    LostCallback,
    Record,
    TokenCheck,
    UnsureReleases,
    call_bound,
    is_header_secret,
)
from .._core.errors import (
    AccessDenied,
    BackendUnavailable,
    ConfigurationError,
    InvalidTokenError,
    LeaseLostError,
    LockTimeout,
    RecordConflict,
)
from .._core.options import Option
from .._core.token import FencingToken

__all__ = ["HttpBackend"]


def _api_key(given: str | None, url: SplitResult) -> tuple[str | None, str]:
    """The API key and where it came from (how errors name it, never showing it)."""
    if given:
        return given, "api_key="
    if os.environ.get("FENCED_API_KEY"):
        return os.environ["FENCED_API_KEY"], "$FENCED_API_KEY"
    return url.password, "the URL's password"


_OPTIONS: Final = MappingProxyType(
    {
        "api_key": Option("str"),
        "request_timeout": Option("number", 10.0, low=0, low_open=True, high=3600),
        "ca_file": Option("str"),
    }
)

# The server's long polls: an acquire asks for at most this long, then asks again.
_POLL: Final = 30.0
# Connections to the gateways, shared by every lease of this connection (acquires waiting in
# long polls hold one each).
_MAX_CONNECTIONS: Final = 256


class HttpBackend(Backend):
    scheme: ClassVar[str] = "http"
    # What the source behind the service has is known after open(): declared here in full,
    # narrowed by effective_characteristics.
    characteristics: ClassVar[frozenset[Characteristic]] = frozenset(Characteristic)
    option_schema: ClassVar[Mapping[str, Option]] = _OPTIONS

    def __init__(self, client: httpx.AsyncClient, bases: list[str], timeout: float) -> None:
        self._client = client
        self._bases = bases
        self._current = 0
        self._timeout = timeout
        self._have: frozenset[Characteristic] = frozenset()
        self._knows_highest = True
        self._unsure = UnsureReleases()  # (releases that raised: their next one is a retry)

    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> HttpBackend:
        opts = cls.options(url, options)
        scheme = "https" if url.scheme.lower().startswith("https") else "http"
        hosts = [h.strip() for h in url.netloc.rpartition("@")[2].split(",") if h.strip()]
        if not hosts:
            raise ConfigurationError(f"{scheme}:// URL names no server")
        path = url.path.rstrip("/")
        bases = [f"{scheme}://{h}{path}" for h in hosts]
        key, where = _api_key(opts.get("api_key"), url)
        headers = {"user-agent": "fenced-python"}
        if key:
            if not is_header_secret(key):  # (never shown: it is the secret)
                raise ConfigurationError(
                    f"{where}: an API key is visible ASCII, blanks inside only, at most 4096 "
                    "characters (an Authorization header carries it); this one is not"
                )
            headers["authorization"] = f"Bearer {key}"
        timeout = opts["request_timeout"]
        client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout),
            verify=tls_context(scheme, opts.get("ca_file")),
            limits=httpx.Limits(
                max_connections=_MAX_CONNECTIONS, max_keepalive_connections=_MAX_CONNECTIONS
            ),
        )
        backend = cls(client, bases, timeout)
        try:
            info = await backend._call("GET", "/v1/info", idempotent=True)
            backend._have = frozenset(
                Characteristic(c) for c in info["characteristics"] if c in _KNOWN
            )
            backend._knows_highest = bool(info["knows_highest"])
        except BaseException:
            await client.aclose()
            raise
        return backend

    @property
    def effective_characteristics(self) -> frozenset[Characteristic]:
        return self._have

    @property
    def knows_highest(self) -> bool:  # type: ignore[override]
        return self._knows_highest

    # -- transport -------------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        idempotent: bool,
        wait: float = 0.0,
        params: dict[str, str] | None = None,
        deadline: float | None = None,
    ) -> Any:
        """One request, moved on to the next gateway when one cannot be reached; the answer's
        JSON, or the error it stands for. Each request is bounded as a whole (connecting,
        sending, waiting for the answer) by :meth:`_bound`: on each gateway tried, or with an
        acquire's deadline, on all of them together."""
        self._check_open()
        bound, what = self._bound(wait, deadline)
        end = None if deadline is None else _clock.now() + bound
        last: Exception | None = None
        for i in range(len(self._bases)):
            base = self._bases[(self._current + i) % len(self._bases)]
            left = bound if end is None else end - _clock.now()
            if left <= 0:
                break
            try:
                # httpx's own timeouts are per phase (a read's resets at every byte):
                # asyncio's bounds the whole request.
                async with asyncio.timeout(left) as limit:
                    reply = await self._client.request(
                        method,
                        base + path,
                        json=body,
                        params=params,
                        timeout=httpx.Timeout(left),
                    )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last = exc  # never sent: safe to send elsewhere
                continue
            except httpx.PoolTimeout as exc:  # congestion here, not a dead server
                raise BackendUnavailable(
                    f"{base}: all {_MAX_CONNECTIONS} connections busy for the whole timeout"
                ) from exc
            except (httpx.TransportError, TimeoutError) as exc:
                if isinstance(exc, TimeoutError) and not limit.expired():
                    raise  # (someone else's timeout: the caller's)
                last = exc
                if isinstance(exc, TimeoutError | httpx.TimeoutException):
                    said = f": {exc}" if str(exc) else ""  # (httpx's own say nothing)
                    last = _Unanswered(f"{base}: no answer within {bound:.3g} s ({what}){said}")
                if idempotent:
                    continue
                raise BackendUnavailable(_describe(last)) from exc
            self._current = (self._current + i) % len(self._bases)
            if reply.status_code == 503 and idempotent and i + 1 < len(self._bases):
                last = BackendUnavailable(_message(reply))
                continue
            return _answer(reply)
        reason = _describe(last) if last is not None else f"no time left ({what})"
        raise BackendUnavailable(
            f"no fenced server answered ({', '.join(self._bases)}): {reason}"
        ) from last

    def _bound(self, wait: float, deadline: float | None) -> tuple[float, str]:
        """How long one call may take in all (and what says so): ``request_timeout`` past a
        long poll's own ``wait``, or an acquire's timeout + 1 s if shorter
        (:func:`~fenced._core.backend.call_bound`, the rule every source follows)."""
        return call_bound(self._timeout, deadline, wait, name="request_timeout")

    # -- the Backend API -------------------------------------------------------------------------

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
        path = f"/v1/locks/{_path(name)}/-/acquire"
        while True:
            now = _clock.now()
            wait = _POLL if deadline is None else max(0.0, min(_POLL, deadline - now))
            body = {"ttl": ttl, "timeout": wait, "request_id": request_id}
            if owner:
                body["owner"] = owner
            sent = _clock.now()
            try:
                got = await self._call(
                    "POST", path, body, idempotent=True, wait=wait, deadline=deadline
                )
            except LockTimeout:
                if deadline is not None and _clock.now() >= deadline:
                    raise
                continue  # one long poll ended: ask again, same request id
            signed = got.get("signed")
            token = FencingToken.parse(signed or got["token"], name)
            ttl_got = float(got["ttl"])
            # A retry after a lost answer gets the grant made earlier: bounded by what the
            # gateway says it has left, not by this request's send time (which was past
            # the source's expiry by the time between the two; found by the simulator's
            # gateway work, tests/sources/test_http_client_retry.py).
            left = min(float(got.get("expires_in", ttl_got)), ttl_got)
            grant = Grant(token, request_id, ttl_got, sent + left - ttl_got)
            if _clock.now() - grant.sent_at <= grant.ttl / 3:
                return grant
            # A long poll: the grant was made near the end of the wait, and ``sent + ttl``
            # (all this client can vouch for) may be long past although the gateway kept the
            # waiter's lease alive. A renewal sent now bounds the lease from now on; without
            # it the lease core would take the grant for expired, give it back and queue again
            # at the end of the line.
            try:
                return await self.renew(grant)
            except LeaseLostError:
                return grant  # it did run out: the lease core gives it back and asks again

    async def renew(self, grant: Grant) -> Grant:
        return await self._renew(grant, grant.ttl)

    async def _renew(self, grant: Grant, ttl: float | None) -> Grant:
        body: dict[str, object] = {"token": str(grant.token), "request_id": grant.request_id}
        if ttl is not None:
            body["ttl"] = ttl
        sent = _clock.now()
        try:
            got = await self._call(
                "POST", f"/v1/locks/{_path(grant.token.lock)}/-/renew", body, idempotent=True
            )
        except InvalidTokenError as exc:
            # Final: a server restarted signing otherwise (newly, another key or source id)
            # never takes this grant's token again.
            raise LeaseLostError(
                f"the fenced server refused the grant's token (400 invalid_token): {exc}"
            ) from exc
        return Grant(grant.token, grant.request_id, float(got["ttl"]), sent, grant.handle)

    async def release(self, grant: Grant) -> bool:
        body: dict[str, object] = {"token": str(grant.token), "request_id": grant.request_id}
        if self._unsure.sending(grant):  # (an earlier release of it raised: it may have
            body["retry"] = True  # released, which the gateway that did remembers)
        try:
            got = await self._call(
                "POST", f"/v1/locks/{_path(grant.token.lock)}/-/release", body, idempotent=False
            )
        except InvalidTokenError:
            self._unsure.answered(grant)
            return False  # (the server no longer takes the grant's token: not released by it)
        self._unsure.answered(grant)
        return bool(got["released"])

    async def status(self, name: str) -> LockStatus:
        got = await self._call("GET", f"/v1/locks/{_path(name)}", idempotent=True)
        return _status(got)

    async def lock_names(self) -> list[str]:
        got = await self._call("GET", "/v1/locks", idempotent=True)
        return list(got["locks"])

    async def force_release(
        self, name: str, token: FencingToken | None = None
    ) -> LockStatus | None:
        body = {"token": str(token)} if token is not None else {}
        got = await self._call(
            "POST", f"/v1/locks/{_path(name)}/-/force-release", body, idempotent=False
        )
        return _status(got["released"]) if got["released"] else None

    async def check(self, token: FencingToken) -> TokenCheck:
        got = await self._call("POST", "/v1/check", {"token": str(token)}, idempotent=True)
        highest = FencingToken.parse(got["highest"]) if got["highest"] else None
        known = self._knows_highest or highest is not None  # (as the server's check)
        return TokenCheck(token, bool(got["current"]), highest, known)

    async def read_record(self, name: str) -> Record | None:
        got = await self._call("GET", f"/v1/records/{_path(name)}", idempotent=True)
        return Record(name, int(got["version"]), got["value"]) if got["version"] else None

    async def swap_record(self, name: str, version: int, value: str) -> Record:
        body = {"version": version, "value": value}
        got = await self._call("POST", f"/v1/records/{_path(name)}/-/swap", body, idempotent=False)
        return Record(name, int(got["version"]), got["value"])

    async def resume(self, name: str, token: FencingToken, request_id: str, ttl: float) -> Grant:
        # (renewed without a ttl: the service keeps the grant's own, which it answers)
        return await self._renew(Grant(token, request_id, ttl, 0.0), None)

    async def aclose(self) -> None:
        self._closed = True
        await self._client.aclose()


_KNOWN: Final = {c.value for c in Characteristic}


def _path(name: str) -> str:
    return quote(name, safe="/:@+=")


class _Unanswered(Exception):
    """A gateway that did not answer within the call's bound (says which bound)."""


def _describe(exc: Exception) -> str:
    """An error of the transport in one line, never an empty message (httpx's timeouts
    have none)."""
    if isinstance(exc, _Unanswered | BackendUnavailable):
        return str(exc)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _message(reply: httpx.Response) -> str:
    try:
        data = reply.json()
        return f"{data['error']}: {data['message']}"
    except Exception:
        return f"HTTP {reply.status_code}"


def _answer(reply: httpx.Response) -> Any:
    """The JSON of a success; a failure as the error the service's code stands for."""
    if reply.status_code == 200:
        try:
            return reply.json()
        except ValueError:
            raise BackendUnavailable("the server's answer is not JSON") from None
    try:
        data = reply.json()
        code, message = str(data["error"]), str(data["message"])
    except Exception:
        code, message = "http_error", f"HTTP {reply.status_code} from {reply.url.host}"
    status = reply.status_code
    if status == 409 and code == "timeout":
        raise LockTimeout(message)
    if status == 409 and code == "conflict":
        raise RecordConflict(str(data["name"]), int(data["expected"]), int(data["current"]))
    if status == 410:
        raise LeaseLostError(message)
    if status in (401, 403):
        raise AccessDenied(f"fenced server refused: {message}")
    if status == 400 and code == "invalid_token":
        raise InvalidTokenError(message)
    if status == 400:
        raise ConfigurationError(message)
    raise BackendUnavailable(f"fenced server: {message} (HTTP {status})")


def _status(d: Mapping[str, Any]) -> LockStatus:
    return LockStatus(
        name=d["name"],
        holder=d["holder"],
        token=FencingToken.parse(d["token"]) if d["token"] else None,
        last_token=FencingToken.parse(d["last_token"]) if d["last_token"] else None,
        remaining=d["remaining"],
        waiters=d["waiters"],
        owner=d["owner"],
    )


class HttpsBackend(HttpBackend):
    scheme: ClassVar[str] = "https"
