"""The client side of HTTP fencing, for ``httpx``: send the token, raise on a 409 stale reply.

::

    import httpx, fenced
    from fenced.guards.httpx import FencingAuth

    with fenced.connect(url) as locks, locks.lock("jobs", ttl=30) as lease:
        with httpx.Client(auth=FencingAuth(lease)) as client:
            client.post("https://api/jobs/42", json=...)   # header Fencing-Token: jobs:34

:class:`FencingAuth` adds ``Fencing-Token: <lease.token>`` to every request, and refuses to
send (:class:`~fenced.LeaseLostError` / :class:`~fenced.NotHeldError`) once the lease is not
surely held: a holder that knows it lost the lock should not even try. When the server
answers 409 with a fenced ``application/problem+json`` body, it raises
:class:`~fenced.StaleTokenError` carrying both tokens. For clients that use their own auth,
:func:`check_stale` / :func:`acheck_stale` are ``response`` event hooks doing the same check.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Generator
from typing import Any, Protocol

import httpx

from .. import Phase
from .._core.errors import FencedError, LeaseLostError, NotHeldError, StaleTokenError
from .._core.token import FencingToken

__all__ = ["FencingAuth", "acheck_stale", "check_stale", "stale_error"]

PROBLEM_CONTENT_TYPE = "application/problem+json"


class LeaseLike(Protocol):
    """What FencingAuth needs of a lease: :class:`~fenced.Lease` and :class:`~fenced.AsyncLease`."""

    @property
    def name(self) -> str: ...

    @property
    def token(self) -> FencingToken: ...

    @property
    def held(self) -> bool: ...

    @property
    def phase(self) -> Phase: ...


def _current_token(source: LeaseLike | FencingToken) -> FencingToken:
    if isinstance(source, FencingToken):
        return source
    if source.held:
        return source.token
    phase = source.phase
    if phase is Phase.LOST:
        raise LeaseLostError(f"lease on {source.name!r} was lost: not sending its token")
    if phase is Phase.HELD:  # held as far as the lease knows, but no longer *surely* held
        raise LeaseLostError(
            f"lease on {source.name!r} may have expired (renewals late): not sending its token"
        )
    raise NotHeldError(f"lease on {source.name!r} is not held ({phase.value}): not sending")


def _is_problem(response: httpx.Response) -> bool:
    ctype = response.headers.get("content-type", "")
    # (a media type is case-insensitive, and may carry parameters and whitespace: RFC 9110 8.3.1)
    media = ctype.split(";")[0].strip(" \t").lower()
    return response.status_code == 409 and media == PROBLEM_CONTENT_TYPE


def stale_error(response: httpx.Response) -> StaleTokenError | None:
    """The StaleTokenError a fenced 409 problem response reports, or None if it is not one.

    The response body must have been read. A 409 without the fenced members (``token``) is
    some other conflict and yields None.
    """
    if not _is_problem(response):
        return None
    try:
        doc: Any = json.loads(response.content)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("token"), str):
        return None
    try:
        token = FencingToken.parse(doc["token"])
        mark = doc.get("high_water")
        high_water = FencingToken.parse(mark) if isinstance(mark, str) else None
    except FencedError:
        return None
    resource = doc.get("resource")
    detail = doc.get("detail")
    return StaleTokenError(
        token,
        high_water,
        resource if isinstance(resource, str) else None,
        detail if isinstance(detail, str) and detail else None,
    )


def check_stale(response: httpx.Response) -> None:
    """Sync ``response`` event hook: raise StaleTokenError for a fenced 409 reply."""
    if _is_problem(response):
        response.read()
        err = stale_error(response)
        if err is not None:
            raise err


async def acheck_stale(response: httpx.Response) -> None:
    """Async ``response`` event hook: raise StaleTokenError for a fenced 409 reply."""
    if _is_problem(response):
        await response.aread()
        err = stale_error(response)
        if err is not None:
            raise err


class FencingAuth(httpx.Auth):
    """httpx auth that sends the lease's fencing token and raises on stale replies.

    ``source``: a :class:`~fenced.Lease` / :class:`~fenced.AsyncLease` (its *current* token
    is read for each request, and the request is refused if the lease is not surely held), or
    a fixed :class:`~fenced.FencingToken` (e.g. one received from upstream, forwarded).
    ``check_stale=False`` leaves 409 responses to the caller.
    """

    def __init__(
        self,
        source: LeaseLike | FencingToken,
        *,
        header: str = "Fencing-Token",
        check_stale: bool = True,
    ) -> None:
        self.source = source
        self.header = header
        self.check_stale = check_stale

    def _sign(self, request: httpx.Request) -> None:
        request.headers[self.header] = str(_current_token(self.source))

    def sync_auth_flow(
        self, request: httpx.Request
    ) -> Generator[httpx.Request, httpx.Response, None]:
        self._sign(request)
        response = yield request
        if self.check_stale:
            check_stale(response)

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        self._sign(request)
        response = yield request
        if self.check_stale:
            await acheck_stale(response)
