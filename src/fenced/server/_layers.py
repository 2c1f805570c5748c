"""The layers a request of ``fenced serve`` passes before a route: the fast lane for the hot
path (in front of Starlette's stack, and in the HTTP protocol itself as ``DirectLane``),
the body bounds and the latency metric (inside it)."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._core import clock as _clock
from ._auth import ApiKey, Keys, Verb
from ._gateway import Gateway
from ._http import BODY_RECEIVED
from ._wire import AcquireIn, Answer, _bearer_secret, _closing, _error, _In

Headers = list[tuple[bytes, bytes]]


class _Service(FastAPI):
    """FastAPI, with the hot path answered before Starlette's middleware stack: ``front``
    (the fast lane) takes each HTTP request first and hands the rest to the whole stack
    (``through_stack``), which answers them as FastAPI always has."""

    front: _FastLane | None = None
    direct: DirectLane | None = None  # (the same lane, for the HTTP protocol: ``_http``)
    loopback_hosts_only = False  # (see ServerSettings)
    same_origin_only = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.loopback_hosts_only or self.same_origin_only) and scope["type"] == "http":
            refusal = self.host_refusal(_host(scope), _header(scope, b"origin"))
            if refusal is not None:
                self.state.gateway.metrics.refused.labels("forbidden").inc()
                await _error(403, "forbidden", refusal)(scope, receive, send)
                return
        front = self.front
        if front is not None and scope["type"] == "http":
            await front(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    def host_refusal(self, host: str | None, origin: str | None) -> str | None:
        """Why the Host and Origin rules of a keyless server refuse a request with these
        headers (the first of each), or None (asked only where one of the two rules is on)."""
        if self.loopback_hosts_only and host is not None and not _names_loopback(host):
            return (
                f"Host {host[:100]!r} is a DNS name: this server has no API keys and "
                "answers requests to localhost, 127.0.0.1 or [::1] (DNS rebinding)"
            )
        if origin is not None and not _same_origin(origin, host):
            # A page of another site may send a "simple" POST (text/plain; no preflight,
            # and bodies are read as JSON whatever their type) to the server: unread, its
            # answer still took or freed a lock. Browsers name the page's origin.
            return (
                f"Origin {origin[:100]!r} is another site: this server has no API keys "
                "and answers its own pages and clients that send no Origin"
            )
        return None

    async def through_stack(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)


def _host(scope: Scope) -> str | None:
    """The request's Host header (None without one: not a browser's request)."""
    return _header(scope, b"host")


def _header(scope: Scope, wanted: bytes) -> str | None:
    """The first header ``wanted`` (lower case) of the request, or None."""
    for name, value in scope.get("headers", ()):
        if name == wanted:
            return str(value.decode("latin-1"))
    return None


def _same_origin(origin: str, host: str | None) -> bool:
    """True if ``origin`` (``scheme://host[:port]``, as browsers send it) names the server
    the request reached (its ``Host``): a page of the server's own (the dashboard)."""
    _, sep, authority = origin.partition("://")
    return bool(sep) and host is not None and authority.lower() == host.lower()


def _names_loopback(host: str) -> bool:
    """False if ``host`` (``name[:port]``, ``[v6][:port]``) is a DNS name that could point
    anywhere — what DNS rebinding needs: a dotted name other than ``*.localhost``. An address
    (the browser connects to it, no name is looked up), ``localhost`` and a single-label name
    (resolved by this machine's own search domains, not the web's) are this machine's."""
    if host.startswith("["):
        return True  # (an IPv6 address)
    name = host.rpartition(":")[0] if host.count(":") == 1 else host
    name = name.lower().rstrip(".")
    if "." not in name or name == "localhost" or name.endswith(".localhost"):
        return True  # (RFC 6761: .localhost is always loopback)
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class _Lane:
    route: APIRoute  # (for the latency metric's route label, as FastAPI's routing sets it)
    model: type[_In]
    handle: Callable[[str, Any, ApiKey | None, str | None, Receive], Awaitable[Answer]]
    """The verb (``_app``): lock name, the body's fields (a mapping), key, client address,
    where a waiting acquire watches for the client leaving; the answer."""
    _latency: list[Any] = dataclasses.field(default_factory=list)

    def latency(self, gw: Gateway) -> Any:
        """The route's latency histogram (its child looked up once, not per request)."""
        if not self._latency:
            self._latency.append(gw.metrics.latency.labels(self.route.path, "POST"))
        return self._latency[0]


_LOCKS = "/v1/locks/"

_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
# (json's own scanner, without json.loads' layers)
_NUMBER, _TEXT, _BOOL = "number", "text", "bool"
_PLAIN: dict[type[_In], tuple[dict[str, str], frozenset[str]]] = {}
"""A body model's fields by kind, and those required: what ``_fields`` takes as they are."""


def _fields(model: type[_In], body: bytes) -> dict[str, Any] | None:
    """The body's fields as ``model`` validates them (a mapping of its fields, absent ones
    None), or None (then FastAPI says what is wrong). A JSON object whose every value is of
    its field's type exactly (a number, a string; an integer made a float, as pydantic
    makes it) is taken as it is; anything else is validated by the model."""
    if not body:  # (only none at all: whitespace is bad JSON)
        return {} if model is AcquireIn else None
    if body[:1] == b"{":
        plain = _PLAIN.get(model)
        if plain is None:
            plain = _PLAIN[model] = _kinds(model)
        try:
            text = body.decode()
            data, end = _scan(text, 0)
        except (ValueError, StopIteration, RecursionError):  # (not UTF-8, not JSON, or nested
            data = None  # deeper than the recursion limit: as json.loads sees it)
        if data is not None and (end == len(text) or not text[end:].strip(" \t\n\r")):
            kinds, required = plain
            for name, value in data.items():
                kind = kinds.get(name)
                if kind is None:
                    break  # (a field the model has not: refused by it)
                if value is None:
                    if name in required:
                        break
                elif type(value) is not str:
                    if kind is _BOOL:
                        if type(value) is not bool:
                            break
                        continue
                    if kind is not _NUMBER or type(value) not in (int, float):
                        break
                    if type(value) is int:
                        if not -(1 << 53) <= value <= 1 << 53:
                            break  # (the model says what a huge integer is)
                        data[name] = float(value)
                elif kind is not _TEXT:
                    break
            else:
                if required <= data.keys():
                    return data  # type: ignore[no-any-return]
    try:
        data = json.loads(body)
        return model.model_validate(data).__dict__ if isinstance(data, dict) else None
    except (ValueError, RecursionError):  # (json's and pydantic's errors; a deep nesting)
        return None


def _kinds(model: type[_In]) -> tuple[dict[str, str], frozenset[str]]:
    """``model``'s fields that are a number (float | None), a string (str | None) or a
    boolean (bool | None)."""
    kinds, required = {}, set()
    for name, field in model.model_fields.items():
        kind = {
            float: _NUMBER,
            float | None: _NUMBER,
            str: _TEXT,
            str | None: _TEXT,
            bool | None: _BOOL,
        }.get(
            field.annotation  # type: ignore[arg-type]
        )
        if kind is None:
            raise TypeError(f"{model.__name__}.{name}: not a number or a string")
        kinds[name] = kind
        if field.is_required():
            required.add(name)
    return kinds, frozenset(required)


def _picked(lanes: dict[str, _Lane], path: str) -> tuple[_Lane, str] | None:
    """The lane and lock name of a POST to ``path``, if it is one of the lanes' routes."""
    if not path.startswith(_LOCKS):
        return None
    name, _, verb = path[len(_LOCKS) :].rpartition("/")
    if name.endswith("/-"):  # (the paths without it are the old ones, still served)
        name = name[:-2]
    lane = lanes.get(verb)
    return None if lane is None or not name else (lane, name)


class _FastLane:
    """acquire, renew and release — a lock service's hot path — without Starlette's
    middleware stack, FastAPI's routing, dependency solving and response-model validation,
    which cost most of such a request's CPU. The routes' checks run (the verbs of ``_app``:
    ``acquire_now`` ...), on the body as its model validates it (``_fields``), with the same
    body bounds (``_BodyLimit.read``: size and read timeout), the same answers (their bytes
    written directly) and the same latency metric. Only a request the lane is
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

    def pick(self, scope: Scope) -> tuple[_Lane, str] | None:
        """The lane and lock name of a request of the lane's routes (by its path), or None."""
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        return _picked(self.lanes, scope.get("path", ""))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        picked = self.pick(scope)
        if picked is None:
            await self.app(scope, receive, send)
            return
        start = _clock.now()
        first = await self.bounds.read(scope, receive, send)
        if first is None:  # (refused: too large or too slow; answered and counted)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        if first["type"] != "http.request":  # (disconnected)
            await self.app(scope, replay, send)
            return
        replayed = True  # (the body is read: a waiting acquire watches for the disconnect)
        answer = await self.answer(picked, scope, first.get("body", b""), replay, start)
        if answer is None:
            replayed = False
            await self.app(scope, replay, send)
            return
        status, headers, data = answer
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def answer(
        self,
        picked: tuple[_Lane, str],
        scope: Scope,
        body: bytes,
        receive: Receive,
        start: float,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """The answer (status, headers, body) to a request of ``picked`` whose ``body`` has
        arrived whole, or None: not the lane's (nothing counted, the body not consumed) —
        then the whole stack answers it. ``receive``: where a waiting acquire watches for
        the client leaving. The one implementation of the lane: behind the ASGI app here,
        and in the HTTP protocol itself (``_http``, ``DirectLane``)."""
        lane, name = picked
        fields = self._model(lane, body)
        key = self._key(scope["headers"], name) if fields is not None else False
        if fields is None or key is False:
            return None
        scope["route"] = lane.route
        self.taken += 1
        try:
            client = scope.get("client")
            return await lane.handle(name, fields, key, client[0] if client else None, receive)
        finally:
            lane.latency(self.gw).observe(_clock.now() - start)

    @staticmethod
    def _model(lane: _Lane, body: bytes) -> dict[str, Any] | None:
        """The body's fields (``_fields``), or None (then FastAPI says what is wrong)."""
        return _fields(lane.model, body)

    def _key(self, headers: Headers, name: str) -> ApiKey | Literal[False] | None:
        """The request's key if it may acquire ``name``; False: let FastAPI refuse it (and
        count the refusal: nothing here touches a metric)."""
        if self.keys is None:
            return None
        auth = [v for k, v in headers if k == b"authorization"]
        secret = _bearer_secret(auth[0].decode("latin-1")) if len(auth) == 1 else None
        key = self.keys.find(secret) if secret is not None else None
        return key if key is not None and key.allows(Verb.ACQUIRE, name) else False


_PROXIED = frozenset({b"x-forwarded-for", b"x-forwarded-proto"})


class DirectLane:
    """The fast lane's requests as the HTTP protocol answers them itself (``_http``), with no
    ASGI scope, no trip through uvicorn's request cycle, the proxy-headers middleware and the
    app: those whose body has arrived whole and within the body limit, which pass the Host
    and Origin rules of a keyless server and name no forwarded client (uvicorn's
    proxy-headers middleware would rewrite the client address an owner is described by).
    The same verbs answer them as the ASGI fast lane's (``_Lane.handle``), with the same
    latency metric; anything else, and anything the lane is not sure of, goes to the app as
    before."""

    def __init__(self, service: _Service, lane: _FastLane, limit: int) -> None:
        self.service, self.lane, self.limit = service, lane, limit
        self.taken = 0  # requests answered here (tests read it)

    def pick(self, path: str, headers: Headers) -> tuple[_Lane, str] | None:
        """The lane and lock name of a ``POST`` to ``path`` with these headers (lower-case
        names) if the lane may answer it once its body is whole, else None."""
        picked = _picked(self.lane.lanes, path)
        if picked is None:
            return None
        host = origin = None
        for header, value in headers:  # (one pass: the first Host and Origin)
            if header in _PROXIED:
                return None
            if header == b"host":
                host = value if host is None else host
            elif header == b"origin":
                origin = value if origin is None else origin
        service = self.service
        if (service.loopback_hosts_only or service.same_origin_only) and service.host_refusal(
            None if host is None else host.decode("latin-1"),
            None if origin is None else origin.decode("latin-1"),
        ):
            return None  # (the app refuses it, and counts the refusal)
        return picked

    def start(
        self,
        picked: tuple[_Lane, str],
        headers: Headers,
        body: bytes,
        client: str | None,
        receive: Receive,
    ) -> Awaitable[Answer] | None:
        """The answer to come (the verb's, not awaited yet) for a request picked whose whole
        ``body`` has arrived; None: the app's to answer (a body over the limit, not well
        formed, a key missing or not allowed: nothing counted, the body not consumed).
        ``receive``: where a waiting acquire watches for the client leaving. Call
        ``finished`` once it is answered."""
        if len(body) > self.limit:
            return None
        lane, name = picked
        fields = self.lane._model(lane, body)
        key = self.lane._key(headers, name) if fields is not None else False
        if fields is None or key is False:
            return None
        self.taken += 1
        self.lane.taken += 1
        return lane.handle(name, fields, key, client, receive)

    def finished(self, picked: tuple[_Lane, str], since: float) -> None:
        """The latency of a request started at ``since`` (``_clock.now()``), answered."""
        picked[0].latency(self.lane.gw).observe(_clock.now() - since)


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
