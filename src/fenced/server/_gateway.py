"""What one ``fenced serve`` process knows: the token source, the grants made or resumed
here, recent transitions, counters. The HTTP layer (``_app``) only translates.

A gateway keeps **no lock state of its own**: every grant, renewal and release is decided by
the token source behind it, through the same backend contract the library uses. Its table
of grants is a cache of handles (an etcd lease id, a ZooKeeper node): a renewal or release
of a grant made through another gateway *resumes* it from the source
(:meth:`~fenced._core.backend.Backend.resume`), so any gateway can die and its holders carry on
through another.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from .._core import clock as _clock
from .._core.backend import Backend, Grant, LockStatus, TokenCheck
from .._core.errors import (
    AccessDenied,
    BackendUnavailable,
    LeaseLostError,
    LockTimeout,
    RecordConflict,
)
from .._core.lease import AsyncLocks
from .._core.names import SERVER_NAMES
from .._core.token import FencingToken
from ._auth import TAG_LENGTH, ApiKey
from ._metrics import Metrics

__all__ = [
    "READY_LOCK",
    "RESERVED",
    "ForeignGrant",
    "Gateway",
    "Transition",
    "client_id",
    "others_id",
    "own_id",
]

logger = logging.getLogger("fenced.server")

Foreign = Callable[[], Awaitable[bool]]
"""True if a request named another key's grant (``Gateway._foreign``): counted as a refusal,
answered as an unknown id."""


@dataclasses.dataclass(frozen=True, slots=True)
class Transition:
    at: float  # wall clock, for people
    lock: str
    event: str  # granted, released, expired, forced
    token: str
    owner: str | None

    def json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ForeignGrant(AccessDenied):
    """The request id names another key's grant. No longer raised: such a request is answered
    exactly as one naming an unknown id (a 403 told a key which guessed ids were taken); kept
    for code that catches it."""


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


_BARE = re.compile(r"[A-Za-z0-9_.:@+/-]+")

RESERVED = SERVER_NAMES
"""Names the server keeps at its source start so (the expiry claims' records, the readiness
look's lock): no client acquires, renews, releases or swaps one through the API, whatever its
key allows (``_app``); the claims' records are readable."""
READY_LOCK = RESERVED + "ready"
"""The lock whose status the readiness probe reads (never taken)."""
EXPIRY_CLAIMS = RESERVED + "expired/"
"""The records (one a lock, named by its name's hash) in which gateways claim the expiries
they count: the source lets one of them claim each (compare-and-set), so a grant two
gateways tracked is counted once."""
RELEASES_KEPT = 16_384
"""Grants released here a gateway remembers at most (a repeat of a release is answered True
for one ttl of the grant from its release: see ``Gateway.release``): about 6 MB with keys'
request ids, 9.6 MB at the longest lock names and ids (an outside tester's tracemalloc). Past it the oldest is forgotten, and a repeat of its release answers False (as before:
a loss reported that was not one, never the other way)."""
CLAIMS_KEPT = 64
"""Token values a lock's claim record keeps (the highest): a claim of a token below them all
is refused (counted long ago, or too late to tell)."""
IDS_KEPT = 100_000
"""Request ids whose grants a gateway remembers (the latest granted, renewed or released
here): an acquire naming one whose grant has ended is a late duplicate, answered as ended
(410), not granted anew."""
IDS_KEPT_FOR = 600.0
"""Seconds a gateway remembers a request id after it last granted, renewed or released its
grant."""


def claim_record(name: str) -> str:
    """The record in which the expiries of lock ``name`` are claimed (a name of fixed length:
    the lock's may be 200 characters)."""
    return EXPIRY_CLAIMS + hashlib.sha256(name.encode()).hexdigest()[:32]


def _field(text: str) -> str:
    """A client's text as one value of a ``key=value`` log line: bare if it cannot be read
    as more (no space, ``=``, quote, backslash or anything unprintable), else double-quoted
    with JSON's escapes (logfmt's quoting), non-ASCII escaped too."""
    return text if _BARE.fullmatch(text) else json.dumps(text)


class Gateway:
    """The grant bookkeeping of one ``fenced serve`` process, free of HTTP: the ``*_for``
    methods take the caller's API key (None: a server without keys) and are what the routes
    call; the simulator (``fenced sim --system gateway``) drives the same methods on virtual
    time. ``wall`` stamps the transitions shown to people (never a deadline); ``metrics``, if
    given, is where it counts (the simulator's gateways share one: a registry costs more to
    make than a simulated gateway's whole life)."""

    def __init__(
        self,
        locks: AsyncLocks,
        *,
        max_wait: float,
        default_ttl: float,
        events: int = 200,
        wall: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
    ) -> None:
        self.locks = locks
        self.wall = wall
        self.max_wait = max_wait
        self.default_ttl = default_ttl
        self._backend: Backend | None = None
        self.metrics = metrics or Metrics(source_commits=self._source_commits)
        self.events: collections.deque[Transition] = collections.deque(maxlen=events)
        self.stopping = asyncio.Event()
        self._grants: dict[tuple[str, str], Grant] = {}
        self._owners: dict[tuple[str, str], str] = {}
        self._releasing: dict[tuple[str, str, int], int] = {}  # releases under way, by grant
        # Grants released here, until their ttl would have run out: a repeat of the release
        # (its answer lost) is answered True, as the first (see release()).
        self._released_here: collections.OrderedDict[tuple[str, str, int], float] = (
            collections.OrderedDict()
        )
        self._busy: dict[tuple[str, str], int] = {}  # acquires and renewals under way
        self._settled: dict[tuple[str, str], set[int]] = {}  # released/ended meanwhile
        self._changed: dict[str, asyncio.Event] = {}
        # (lock, source id) of grants made, renewed or released here -> (the grant's token
        # value, when last: monotonic), oldest first: a late duplicate of an acquire whose
        # grant ended is told so
        # (an OrderedDict: its oldest is found in O(1); a dict's first entry, once entries are
        # deleted from its front, is found past their dummies: 20.8 against 0.85 µs a call at
        # IDS_KEPT, measured, a 64-client fenced serve bench 0.59-0.93x of the last session)
        self._remembered: collections.OrderedDict[tuple[str, str], tuple[int, float]] = (
            collections.OrderedDict()
        )
        self._sweeper: asyncio.Task[None] | None = None
        self._claims = False  # (the source keeps records: expiries are claimed there)
        self._unclaimed: dict[tuple[str, int], str | None] = {}  # ended, to claim: its owner
        self.loop: asyncio.AbstractEventLoop | None = None
        self.transition_line: Callable[[str], None] | None = None
        """Writes one info line of ``fenced.server``, where ``fenced serve`` set one up that
        costs less than ``logger.info`` (``_run._PerTurnHandler.info_line``)."""
        # The two gauges are read when scraped, not set on every grant and release (each set
        # or inc takes the metric's lock): the hot path only counts.
        self._waiting = 0
        self.metrics.waiting.set_function(lambda: self._waiting)
        self.metrics.tracked.set_function(lambda: len(self._grants))
        self.metrics.releases_remembered.set_function(lambda: len(self._released_here))
        self.metrics.ids_remembered.set_function(lambda: len(self._remembered))
        self._released = self.metrics.releases.labels("released")  # (children looked up once)
        self._not_held = self.metrics.releases.labels("not_held")
        self._renewed = self.metrics.renewals.labels("ok")

    def _source_commits(self) -> int | None:
        n = getattr(self._backend, "commits", None)
        return n if isinstance(n, int) else None

    async def start(self) -> None:
        """Open the source and start the sweep (once: ``fenced serve`` opens it before
        uvicorn's lifespan, which calls this again, so that a failure is one line)."""
        if self._sweeper is not None:
            return
        self.loop = asyncio.get_running_loop()
        await self.locks.open()
        self._backend = await self.locks.opened_backend()
        # (a source that keeps no records — the default raises — cannot tell two gateways'
        # counts apart: each counts what it saw end, as before)
        self._claims = type(self._backend).read_record is not Backend.read_record
        self._sweeper = asyncio.create_task(self._sweep(), name="fenced-server-sweep")

    def halt(self) -> None:
        """Stop at once, as a killed process does: the sweep cancelled, nothing awaited (the
        simulator's gateway crash; :meth:`stop` is the graceful end)."""
        self.stopping.set()
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def stop(self) -> None:
        """Stop answering; leave every grant to expire (never release on a holder's behalf)."""
        self.stopping.set()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        self._grants.clear()
        await self.locks.aclose()  # holds no leases of its own: nothing is released

    @property
    def backend(self) -> Backend:
        assert self._backend is not None
        return self._backend

    # -- grants, by API key (what the routes call) ---------------------------------------------

    async def refuse_others(self, key: ApiKey | None, name: str, request_id: str) -> bool:
        """True (and counted as a refusal) if the lock's holder is another key's grant with
        this request id. Only counted: the request is answered as one naming an unknown id
        (it never reaches that grant: at the source its id is this key's tag and the id), so
        that a key cannot tell which guessed ids another key's grants use."""
        if key is None:
            return False
        status = await self.backend.status(name)
        if status.token is not None and others_id(key, status.holder, request_id):
            self.metrics.refused.labels("forbidden").inc()
            return True
        return False

    async def acquire_for(
        self,
        key: ApiKey | None,
        name: str,
        request_id: str,
        ttl: float,
        wait: float,
        owner: str,
        *,
        waiting: Callable[[Awaitable[Any]], Awaitable[Any]] | None = None,
        count_timeout: bool = True,
    ) -> tuple[Grant, FencingToken]:
        """:meth:`acquire` as ``key``'s grant. A waiting acquire (``wait`` > 0) runs inside
        ``waiting`` (the HTTP layer's watch for the client leaving); one naming another key's
        request id waits in line as any other (its grant would be its own). ``count_timeout``
        False: a LockTimeout is not counted as an acquire timeout (a try-once standing in for
        a waiting acquire its client may not add: a refusal)."""
        granting = self.acquire(
            name,
            own_id(key, request_id),
            ttl,
            wait,
            owner,
            foreign=self._foreign(key, name, request_id),
            count_timeout=count_timeout,
        )
        got: tuple[Grant, FencingToken] = await (
            waiting(granting) if wait and waiting is not None else granting
        )
        return got

    async def renew_for(
        self, key: ApiKey | None, name: str, token: FencingToken, request_id: str, ttl: float | None
    ) -> Grant:
        return await self.renew(
            name, token, own_id(key, request_id), ttl, foreign=self._foreign(key, name, request_id)
        )

    async def release_for(
        self,
        key: ApiKey | None,
        name: str,
        token: FencingToken,
        request_id: str,
        *,
        retry: bool = False,
    ) -> bool:
        return await self.release(
            name,
            token,
            own_id(key, request_id),
            foreign=self._foreign(key, name, request_id),
            retry=retry,
        )

    def _foreign(self, key: ApiKey | None, name: str, request_id: str) -> Foreign | None:
        """What a request of ``key`` that was refused or found its grant gone asks before it
        is counted: True if it named another key's grant — then it counts as a refusal only,
        not as an acquire timeout, a lost renewal or a release of nothing too (a scraper saw
        leases lost that were not). Its answer is an unknown id's all the same."""
        if key is None:
            return None
        return lambda: self.refuse_others(key, name, request_id)

    # -- grants -------------------------------------------------------------------------------

    async def acquire(
        self,
        name: str,
        request_id: str,
        ttl: float,
        wait: float,
        owner: str,
        *,
        foreign: Foreign | None = None,
        count_timeout: bool = True,
    ) -> tuple[Grant, FencingToken]:
        """Grant ``name`` to ``request_id`` (idempotent), waiting FIFO up to ``wait`` seconds;
        LockTimeout after that (counted as a refusal instead if ``foreign`` says so: see
        :meth:`_foreign`). Returns the grant and its token as the holder gets it."""
        try:
            known = self._known((name, request_id)) is not None
            live = await self._live(name, request_id) if known else None
            return await self._acquire(name, request_id, ttl, wait, owner, live)
        except LockTimeout:
            if (foreign is None or not await foreign()) and count_timeout:
                self.metrics.acquire_timeouts.inc()
            raise
        except LeaseLostError:
            # (only a late duplicate: the id is this key's own, never another key's grant)
            self.metrics.late_duplicates.inc()
            raise

    async def _live(self, name: str, request_id: str) -> FencingToken:
        """The token of the live grant of ``request_id``, which this gateway granted, renewed
        or released before; LeaseLostError if that grant has ended (released or expired): an
        acquire naming it is a late duplicate (a retry delivered after the release, a copy
        the network held), and a new grant would sit unheld, the lock idle for its ttl. (As
        Consul's and etcd's idempotent acquires: an id names one attempt.)"""
        status = await self.backend.status(name)
        if status.token is None or status.holder != request_id:
            raise LeaseLostError(
                f"the grant of this request id on {name!r} has ended (released or expired): "
                "a new attempt needs a new request id"
            )
        return status.token

    def _known(self, key: tuple[str, str]) -> int | None:
        """The token value of ``key``'s grant, if this gateway remembers it (seen within
        :data:`IDS_KEPT_FOR` s)."""
        had = self._remembered.get(key)
        return had[0] if had is not None and had[1] >= _clock.now() - IDS_KEPT_FOR else None

    def _seen(self, key: tuple[str, str], token: FencingToken) -> None:
        """``key``'s request id had grant ``token`` here now: remembered (:data:`IDS_KEPT`,
        for :data:`IDS_KEPT_FOR` s)."""
        ids, now = self._remembered, _clock.now()
        ids[key] = (token.value, now)
        ids.move_to_end(key)
        _, (_, at) = next(iter(ids.items()))  # (the oldest: one a call keeps the bounds)
        if len(ids) > IDS_KEPT or at < now - IDS_KEPT_FOR:
            ids.popitem(last=False)

    async def _acquire(
        self,
        name: str,
        request_id: str,
        ttl: float,
        wait: float,
        owner: str,
        live: FencingToken | None = None,
    ) -> tuple[Grant, FencingToken]:
        start = _clock.now()
        key = (name, request_id)
        self._waiting += 1
        self._begin(key)
        grant: Grant | None = None
        try:
            grant = await self.backend.acquire(
                name,
                request_id=request_id,
                ttl=ttl,
                deadline=start + wait,
                on_lost=lambda exc: self._lost(name, request_id, exc),
                owner=owner,
            )
        finally:
            self._waiting -= 1
            stale = self._done(key, grant)
        self.metrics.wait.observe(_clock.now() - start)
        had = self._known(key)
        if grant.token != live and had is not None and had != grant.token.value:
            # A new grant for an id whose grant here ended: the one this retry found live
            # ended before its acquire, or this acquire waited in line while a retry of it
            # was granted (through here) and released. Nobody will hold it: given back.
            with contextlib.suppress(Exception):
                await self.backend.release(grant)
            raise LeaseLostError(
                f"the grant of this request id on {name!r} has ended (released or expired): "
                "a new attempt needs a new request id"
            )
        self._seen(key, grant.token)
        if stale:  # (a retry answered after its grant was released or ended here)
            return grant, self.locks.sign(grant.token)
        known = self._grants.get(key)
        if known is None or known.token != grant.token:  # (a retry's answer is no new grant)
            self.metrics.grants.inc()
        self._supersede(key, grant.token)
        if key not in self._grants:
            self._note(name, "granted", grant.token, owner)
        self._grants[key] = grant
        self._owners[key] = owner
        return grant, self.locks.sign(grant.token)

    async def _grant_of(
        self, name: str, token: FencingToken, request_id: str, ttl: float | None
    ) -> tuple[Grant, str | None]:
        """The grant, from the table or resumed from the source; and, if resumed, its holder's
        description (the source's), for the transitions this gateway shows of it — an
        "expired" or "released" line naming nobody otherwise. ``ttl`` None: the grant's own
        (the source's where it keeps one, else this gateway's default)."""
        grant = self._grants.get((name, request_id))
        if grant is not None and grant.token == token:
            if ttl is None:
                # The table's ttl is the one last set *here*; a renewal through another
                # gateway may have set another since, which the source keeps (renewed with
                # the table's, a 60 s lease became this gateway's 2 s and was lost). One read,
                # for renewals without a ttl only: fenced's clients send theirs.
                status = await self.backend.status(name)
                held = status.token is not None and status.token.value == token.value
                if held and status.holder == request_id and status.ttl:
                    grant = dataclasses.replace(grant, ttl=status.ttl)
            return grant, None
        given = self.default_ttl if ttl is None else ttl
        grant = await self.backend.resume(name, token.unsigned(), request_id, given)
        try:
            status = await self.backend.status(name)
        except Exception:  # (only the description is missed: the resume stands)
            return grant, None
        held = status.token is not None and status.token.value == token.value
        return grant, status.owner if held else None

    async def renew(
        self,
        name: str,
        token: FencingToken,
        request_id: str,
        ttl: float | None,
        *,
        foreign: Foreign | None = None,
    ) -> Grant:
        """Renew the grant; LeaseLostError if it has ended (counted as a refusal instead if
        ``foreign`` says so)."""
        try:
            return await self._renew(name, token, request_id, ttl)
        except LeaseLostError:
            if foreign is None or not await foreign():
                self.metrics.renewals.labels("lost").inc()
            raise

    async def _renew(
        self, name: str, token: FencingToken, request_id: str, ttl: float | None
    ) -> Grant:
        key = (name, request_id)
        self._begin(key)
        new: Grant | None = None
        try:
            # Without a ttl the grant keeps its own: this gateway's table, else the source's
            # (resumed: a grant made through another gateway, whose --default-ttl may differ);
            # this gateway's default only where the source keeps no ttl.
            grant, owner = await self._grant_of(name, token, request_id, ttl)
            if ttl is not None and grant.ttl != ttl:
                grant = dataclasses.replace(grant, ttl=ttl)
            new = await self.backend.renew(grant)
        except LeaseLostError:
            if not self._release_pending(key, token):
                self._ended(key, token)
            raise
        except Exception:
            self.metrics.renewals.labels("error").inc()
            raise
        finally:
            stale = self._done(key, new)
        self._renewed.inc()
        self._seen(key, new.token)
        if stale:  # (its answer came back after the grant was released or ended here:
            return new  # kept again, it would be counted an expiry later)
        self._supersede(key, new.token)
        self._grants[key] = new
        if owner is not None:  # (resumed here)
            self._owners[key] = owner
        return new

    def _begin(self, key: tuple[str, str]) -> None:
        self._busy[key] = self._busy.get(key, 0) + 1

    def _done(self, key: tuple[str, str], grant: Grant | None) -> bool:
        """An acquire or renewal of ``key`` is done; True if its grant was released or ended
        here while it was on its way (sent before the release, answered after it): kept
        again, it would be counted an expiry later (found by ``fenced sim --system
        gateway``)."""
        left = self._busy.pop(key) - 1
        stale = grant is not None and grant.token.value in self._settled.get(key, ())
        if left:
            self._busy[key] = left
        else:
            self._settled.pop(key, None)
        return stale

    def _settle(self, key: tuple[str, str], token: FencingToken) -> None:
        """The grant was released or ended here: acquires and renewals of it under way must
        not put it back in the table when they are answered."""
        if key in self._busy:
            self._settled.setdefault(key, set()).add(token.value)

    async def release(
        self,
        name: str,
        token: FencingToken,
        request_id: str,
        *,
        foreign: Foreign | None = None,
        retry: bool = False,
    ) -> bool:
        """Release the grant; False if it had ended already (counted as a refusal instead if
        ``foreign`` says so). ``retry``: the client asks again because the answer to its
        earlier release was lost; if this gateway released the grant (by request id, the
        source's: the key's tag and the client's id; and token; within the rest of the
        grant's ttl), True again, counted once (the source no longer holds it, and would
        say False). Not a retry: a grant already released is False, as the contract says."""
        key = (name, request_id, token.value)
        if retry:
            until = self._released_here.get(key)
            if until is not None and _clock.now() < until:
                self.metrics.release_retries.labels("remembered").inc()
                return True
        self._releasing[key] = self._releasing.get(key, 0) + 1
        try:
            released = await self._release(name, token, request_id)
        finally:
            if self._releasing[key] == 1:
                del self._releasing[key]
            else:
                self._releasing[key] -= 1
        if released:
            self._released.inc()
        elif foreign is None or not await foreign():
            self._not_held.inc()
        else:
            return released  # (another key's grant: a refusal only)
        if retry:  # (asked again, and not from memory: gone past it, or never released)
            self.metrics.release_retries.labels("released" if released else "not_held").inc()
        return released

    async def _release(self, name: str, token: FencingToken, request_id: str) -> bool:
        key = (name, request_id)
        owner = None
        try:
            grant, owner = await self._grant_of(name, token, request_id, self.default_ttl)
        except LeaseLostError:
            released = False
        else:
            released = await self.backend.release(grant)
        if released:
            self._remember_released((name, request_id, token.value), grant.ttl)
            self._seen(key, token)
            self._supersede(key, token)
            self._settle(key, token)
            self._grants.pop(key, None)
            self._note(name, "released", token, self._owners.pop(key, None) or owner)
        elif not self._release_pending(key, token, mine=1):
            # It ended before: an expiry, if this gateway knew it; a repeat: nothing.
            self._ended(key, token)
        return released

    def _remember_released(self, key: tuple[str, str, int], ttl: float) -> None:
        """Keep ``key`` (lock, request id, token) released here for ``ttl`` from now; the
        oldest forgotten first, once their time is out or past :data:`RELEASES_KEPT`."""
        now = _clock.now()
        kept = self._released_here
        kept[key] = now + ttl
        kept.move_to_end(key)
        while kept:
            oldest, until = next(iter(kept.items()))
            if until > now and len(kept) <= RELEASES_KEPT:
                break
            del kept[oldest]

    def ttls(self, current: dict[str, FencingToken]) -> dict[str, float]:
        """The ttl of each lock's current grant (``current``: lock -> its token) where this
        gateway made or renewed that grant; one pass over the grants it tracks."""
        out = {}
        for (name, _), grant in self._grants.items():
            token = current.get(name)
            if token is not None and token.value == grant.token.value:
                out[name] = grant.ttl
        return out

    async def force_release(self, name: str, token: FencingToken | None) -> LockStatus | None:
        freed = await self.backend.force_release(name, token)
        if freed is not None and freed.token is not None:
            self.metrics.forced.inc()
            self._note(name, "forced", freed.token, freed.owner)
        return freed

    async def check(self, token: FencingToken) -> TokenCheck:
        result = await self.locks.check(token)
        self.metrics.checks.labels(result.verdict).inc()
        return result

    def _lost(self, name: str, request_id: str, exc: BaseException) -> None:
        """The source revoked a grant made here (a session ended, a forced release)."""
        grant = self._grants.get((name, request_id))
        if grant is not None:
            self._ended((name, request_id), grant.token)

    def _release_pending(self, key: tuple[str, str], token: FencingToken, mine: int = 0) -> bool:
        """True if a release of this grant is under way here (besides ``mine``, the caller's
        own): the grant may be found gone because that release took it, and a grant released
        is no expiry — the release settles it. (The same release delivered twice, a renewal
        or the sweep overtaking a release: the copy that found it gone answered first and
        counted an expiry. Found by ``fenced sim --system gateway``.)"""
        return self._releasing.get((*key, token.value), 0) > mine

    def _supersede(self, key: tuple[str, str], token: FencingToken) -> None:
        """``key``'s request id holds ``token`` now: an older grant kept here under the same
        id has ended (its expiry not swept yet: the source was unreachable, or the retry came
        first). Counted now: overwritten, it was never counted at all (found by ``fenced sim
        --system gateway``)."""
        old = self._grants.get(key)
        if old is not None and old.token != token:
            self._ended(key, old.token)

    def _ended(self, key: tuple[str, str], token: FencingToken) -> None:
        """A grant this gateway tracks ended without a release: counted and shown once (a
        later renewal or release of it finds it gone and counts nothing). Where the source
        keeps records, counted only once claimed there (:meth:`_count_ended`, at the
        sweep's next turn): another gateway that tracked the same grant (made here, renewed
        there) finds it ended too, and the source lets one of them count it."""
        grant = self._grants.get(key)
        if grant is None or grant.token.value != token.value:
            return
        del self._grants[key]
        self._settle(key, token)
        owner = self._owners.pop(key, None)
        if self._claims:
            self._unclaimed[(key[0], token.value)] = owner
            return
        self.metrics.expiries.inc()
        self._note(key[0], "expired", token, owner)

    async def _count_ended(self) -> None:
        """Claim at the source each grant found ended here, and count those claimed (one
        the source says another gateway claimed first is its count, not ours). A claim the
        source did not answer stays for the next turn."""
        for (name, value), owner in list(self._unclaimed.items()):
            try:
                claimed = await self.claim_expiry(name, value)
            except (BackendUnavailable, TimeoutError):
                raise  # (the next turn asks again)
            except Exception as exc:  # (a source that refuses the record: a key without
                # rights on it upstream of an http:// source) counted here, as without claims
                logger.warning("expiry of %s:%d not claimed at the source: %s", name, value, exc)
                claimed = True
            del self._unclaimed[(name, value)]
            if claimed:
                self.metrics.expiries.inc()
                self._note(name, "expired", FencingToken(name, value), owner)

    async def claim_expiry(self, name: str, value: int) -> bool:
        """True if this call claimed the expiry of grant ``value`` of lock ``name`` at the
        source, False if another caller (a gateway) did before: compare-and-set on the lock's
        claim record, which keeps the :data:`CLAIMS_KEPT` highest values claimed."""
        record_name = claim_record(name)
        for _ in range(8):  # (each retry: another gateway's claim landed meanwhile)
            record = await self.backend.read_record(record_name)
            version, claimed = (
                (0, []) if record is None else (record.version, _values(record.value))
            )
            if value in claimed or (len(claimed) >= CLAIMS_KEPT and value < claimed[0]):
                return False
            kept = sorted({*claimed, value})[-CLAIMS_KEPT:]
            try:
                await self.backend.swap_record(record_name, version, json.dumps(kept))
            except RecordConflict:
                continue
            return True
        raise BackendUnavailable(f"the expiry claims of {name!r} kept changing")

    async def _sweep(self) -> None:
        """Forget grants not renewed here for longer than their ttl: the table is a cache,
        never the truth. The source says which of them expired (their holders stopped:
        counted in fenced_expiries_total and shown as "expired", once claimed at the source:
        :meth:`_count_ended`) and which live on (renewed through another gateway: forgotten
        silently)."""
        while True:
            await asyncio.sleep(1.0)
            with contextlib.suppress(Exception):  # (an unreachable source: next turn)
                await self._sweep_once()
            if self._unclaimed:
                with contextlib.suppress(Exception):
                    await self._count_ended()

    async def _sweep_once(self) -> None:
        now = _clock.now()
        for key, grant in list(self._grants.items()):
            # (sent_at is 0 for a resumed grant until it is renewed: not forgotten early,
            # because a resume is always followed by that renewal or a release)
            if not grant.sent_at or grant.sent_at + grant.ttl + 1.0 >= now:
                continue
            status = await self.backend.status(key[0])
            if self._grants.get(key) is not grant:
                continue  # (renewed or released here meanwhile)
            # Held is live: every source reports a grant held only until it expires, and its
            # time left may read 0 while it lives (etcd counts whole seconds: a lease of 1 s,
            # renewed through another gateway, read 0 and was counted an expiry here).
            if status.token == grant.token and status.holder == key[1]:
                del self._grants[key]  # still held: renewed through another gateway
                self._owners.pop(key, None)
            elif not self._release_pending(key, grant.token):
                self._ended(key, grant.token)

    # -- transitions and watching ---------------------------------------------------------------

    def _note(self, name: str, event: str, token: FencingToken, owner: str | None) -> None:
        self.events.append(Transition(self.wall(), name, event, str(token.unsigned()), owner))
        line = self.transition_line
        # (the name and the holder's description are the clients': quoted where they could
        # read as more fields, as " token=999" would)
        text = f"{event} lock={_field(name)} token={token.value} owner={_field(owner or '-')}"
        if line is None:
            logger.info("%s", text)
        else:  # (the same line, at less cost)
            line(text)
        changed = self._changed.pop(name, None)
        if changed is not None:
            changed.set()

    async def changes(self, name: str, interval: float) -> AsyncGenerator[LockStatus, None]:
        """The lock's status now, then each time it changes. Changes made here are seen at
        once; changes made through another gateway or by expiry within ``interval``."""
        last: tuple[Any, ...] | None = None
        while not self.stopping.is_set():
            status = await self.backend.status(name)
            seen = (status.token, status.holder, status.last_token)
            if seen != last:
                last = seen
                yield status
            event = self._changed.setdefault(name, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await _first(event.wait(), self.stopping.wait())

    def new_request_id(self) -> str:
        """128 random bits: a request id is the capability to renew and release its grant,
        so the server's must not be guessable from another (``_fork.request_id`` is a
        prefix per process and a counter: fine for ids a process keeps to itself). From
        ``os.urandom``, as ``secrets.token_hex`` (whose layers cost 7 times the call)."""
        return os.urandom(16).hex()


def _values(text: str) -> list[int]:
    """A claim record's token values, sorted; a value that is not a list of integers (written
    by hand through the records API) reads as none: the compare-and-set still lets one claim
    each value from then on."""
    try:
        values = json.loads(text)
    except (ValueError, RecursionError):  # (RecursionError: nested deeper than Python recurses)
        return []
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        return []
    return sorted(values)


async def _first(*aws: Any) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
