"""WSGI middleware that fences HTTP writes (Flask, Django, any WSGI app): the ASGI one's twin.

::

    from fenced.guards.asgi import SQLiteFenceStore
    from fenced.guards.wsgi import FencingWSGIMiddleware

    app.wsgi_app = FencingWSGIMiddleware(                 # Flask; Django: wrap get_wsgi_application()
        app.wsgi_app,
        store=SQLiteFenceStore("/srv/app/fences.db"),
        lock="jobs",
        resource=lambda environ: "jobs" if environ["PATH_INFO"].startswith("/jobs") else None,
    )

The rules, the responses and the stores are those of :mod:`fenced.guards.asgi` (the table
there): a fenced request needs a ``Fencing-Token`` header whose token is checked against the
resource's high-water mark and advances it, in one atomic store operation; a stale token gets
``409`` (``application/problem+json``), none ``428``, a malformed one or one of another lock
``400``, an unreachable store or a corrupt mark ``503``, any other error of the store ``500``
(every one a problem document; the handler never runs on a refused request). The handler
finds ``environ["fenced.token"]``, ``environ["fenced.resource"]`` and
``environ["fenced.store"]``, and a
:class:`~fenced.StaleTokenError` it raises before it starts its response becomes the same 409.

One implementation: the stores are the ASGI middleware's, run on a private event loop (the
same bridge as the synchronous lock API), and the problem responses are built by the same
code. The same honesty note applies: the check guards the request, the handler's own write
comes after it; write through the store's guard for the write itself to be fenced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from .._core.errors import StaleTokenError
from .._core.portal import Portal
from .._core.signing import TokenVerifier
from .._core.token import FencingToken
from .asgi import (
    _OWS,
    DEFAULT_PROBLEM_BASE,
    SAFE_METHODS,
    FenceMetrics,
    FenceStore,
    MiddlewareSettings,
    Problem,
    store_problem,
)

__all__ = ["FencingWSGIMiddleware"]

Environ = dict[str, Any]
StartResponse = Callable[..., Callable[[bytes], object]]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]

_STATUS_TEXT = {
    400: "Bad Request", 409: "Conflict", 428: "Precondition Required",
    500: "Internal Server Error", 503: "Service Unavailable",
}  # fmt: skip


class FencingWSGIMiddleware(MiddlewareSettings):
    """Plain WSGI middleware: fence requests to the routes ``resource(environ)`` names.

    Arguments as :class:`~fenced.guards.asgi.FencingMiddleware`'s, with ``resource`` taking
    the WSGI ``environ``. :meth:`close` stops its event-loop thread; leaving a ``with`` block
    also closes the store.
    """

    def __init__(
        self,
        app: WSGIApp,
        *,
        store: FenceStore,
        lock: str,
        resource: Callable[[Mapping[str, Any]], str | None] | None = None,
        header: str = "Fencing-Token",
        safe_methods: Iterable[str] = SAFE_METHODS,
        metrics: FenceMetrics | None = None,
        problem_base: str = DEFAULT_PROBLEM_BASE,
        verify: TokenVerifier | None = None,
    ) -> None:
        self.app = app
        self.resource = resource if resource is not None else (lambda environ: self.lock)
        self._environ_key = "HTTP_" + header.upper().replace("-", "_")
        MiddlewareSettings.__init__(
            self, store, lock, header, safe_methods, metrics, problem_base, verify
        )
        # The async stores run here; only fenced's code runs on this loop.
        self._portal = Portal("fenced-wsgi")

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD", "GET").upper() in self.safe_methods:
            return self.app(environ, start_response)
        key = self.resource(environ)
        if key is None:
            return self.app(environ, start_response)
        raw_text = environ.get(self._environ_key)
        if raw_text is None:
            missing = self._missing(
                str(environ.get("REQUEST_METHOD")), environ.get("PATH_INFO", ""), key
            )
            return self._problem(start_response, key, missing)
        # (WSGI servers join repeated headers with ","; that fails to parse: 400, as in ASGI.
        # Optional whitespace is not part of the value, whether or not the server kept it.)
        raw = b",".join(v.strip(_OWS) for v in raw_text.encode("latin-1", "replace").split(b","))
        try:
            token = FencingToken.coerce(raw, self.lock, self.verifier)
            self._portal.call(self.store.advance(key, token))
        except Exception as exc:
            return self._problem(start_response, key, store_problem(exc, key, self.lock, raw))
        if self.metrics is not None:
            self.metrics.accepted(key, token)
        environ["fenced.token"] = token
        environ["fenced.resource"] = key
        environ["fenced.store"] = self.store
        started: list[bool] = []

        def tracking_start_response(*args: Any) -> Callable[[bytes], object]:
            started.append(True)
            return start_response(*args)

        try:
            body = self.app(environ, tracking_start_response)
            # A generator app runs its code only when iterated: a refusal raised before its
            # first chunk is still a 409.
            iterator = iter(body)
            first = next(iterator, None)
        except StaleTokenError as exc:
            if started:
                raise
            return self._problem(start_response, key, self._stale_inside(exc, key))
        return _Body(first, iterator, body)

    def _problem(
        self, start_response: StartResponse, resource: str, problem: Problem
    ) -> list[bytes]:
        body = self._refused(resource, problem)
        status = f"{problem.status} {_STATUS_TEXT.get(problem.status, '')}".rstrip()
        start_response(status, [(k.decode(), v.decode()) for k, v in problem.headers(body)])
        return [body]

    def close(self, *, close_store: bool = False) -> None:
        """Stop the middleware's event-loop thread; with ``close_store``, close the store
        first, on the loop it ran on (otherwise the store is yours to close)."""
        # aclose: fenced's stores; close: a store of your own written before issue 27.
        closer = None
        if close_store:
            closer = getattr(self.store, "aclose", None) or getattr(self.store, "close", None)
        if not self._portal.closed:
            self._portal.stop(final=None if closer is None else closer())

    def __enter__(self) -> FencingWSGIMiddleware:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(close_store=True)


class _Body:
    """The app's response, its first chunk already taken (and ``close()`` passed on, as
    PEP 3333 requires)."""

    def __init__(self, first: bytes | None, rest: Iterator[bytes], body: Iterable[bytes]) -> None:
        self._first, self._rest, self._body = first, rest, body

    def __iter__(self) -> Iterator[bytes]:
        if self._first is not None:
            yield self._first
        yield from self._rest

    def close(self) -> None:
        close = getattr(self._body, "close", None)
        if close is not None:
            close()
