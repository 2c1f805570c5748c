"""The gateway in the simulator (``fenced sim --system gateway``): ``fenced serve``'s real grant
bookkeeping (:class:`fenced.server._gateway.Gateway`: request ids, API keys, its table of
grants, resumes, its sweep and its count of expiries) in two or three gateways sharing one
simulated token source, as a fleet behind one keys file does. Clients of two tenants (two API
keys, allowed on the same locks, whose request ids collide) acquire through any gateway,
write to real SQL-guarded resources, renew and release through any gateway; an intruder of
each tenant now and then sends another tenant's leaked request id and token.

Faults, besides the network's (``loss``, ``dup``, ``delay``: an acquire retried after a lost
reply, the same request delivered twice, messages overtaking each other) and the clients'
(``pause``, ``crash``): ``gateway`` (a gateway restarts: its requests in flight die, its
table and counters are gone), ``jump`` (the virtual clock leaps ahead: the whole host was
suspended), ``source`` (the source is down for a while) and ``foreign`` (the intruders).

The checkers: the check kit's on each lock's history (the stale writer refused, the current
holder served, no overlap, ...), and the gateway's own:

* ``retry-new-grant``: a request (key, request id) whose grant is live at the source never
  gets a second one: a retried acquire returns the same grant; nor does a late duplicate
  (one delivered after that grant was released or expired) reaching a gateway that granted,
  renewed or released that grant (a gateway remembers the ids it saw; a restarted one, or
  one that never saw the grant, may grant it anew) — unless that gateway gives the new grant
  back at once, unanswered (the release raced its look at the source);
* ``wrong-grant``: a client is answered only with a grant made for its own request;
* ``foreign-request``: another key's request id never renews, releases or is granted a
  grant (at the source, and in the answers);
* ``renewed-after-expiry``: no renewal answered as done for a grant that had ended before
  it was sent;
* ``expiry-count``: a gateway counts a grant's expiry at most once, never one it released,
  and the gateway that last made or renewed a grant that expired counts it (exactly once).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import itertools
import json
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar
from urllib.parse import SplitResult

from ..._core.backend import Backend, Characteristic, Grant, LockStatus, LostCallback, lock_timeout
from ..._core.errors import (
    BackendUnavailable,
    FencedError,
    LeaseLostError,
    LockTimeout,
    StaleTokenError,
)
from ..._core.lease import AsyncLocks
from ..._core.token import FencingToken
from ...server import ApiKey, Gateway, Metrics, Verb, hash_secret, own_id
from ..check._checkers import Violation, check_all
from ..check._resources import SQLResource
from ._world import _Client, _running, _World, failures, next_entry

__all__ = ["GatewayRun"]

LOCKS = ("orders", "stock")
TENANTS = ("a", "b")
MARGIN = 0.05  # of a ttl: what a client takes off the time it was told (the source's clock is
# up to 2 % off the clients')
WAIT = 1.5  # ttls an acquire waits at a gateway (a long poll)

# The client request a gateway is serving (key id, request id, client): the source learns it
# through this, to attribute each change to the request that made it (the checkers' view).
REQUEST: contextvars.ContextVar[tuple[str, str, str] | None] = contextvars.ContextVar(
    "fenced_sim_request", default=None
)


def _key(tenant: str) -> ApiKey:
    return ApiKey(
        f"tenant-{tenant}",
        bytes.fromhex(hash_secret(f"secret-{tenant}")),
        ("",),
        frozenset({Verb.ACQUIRE}),
    )


KEYS = {t: _key(t) for t in TENANTS}


@dataclasses.dataclass(frozen=True)
class _Ask:
    """One round of a client: the lock it asks for, with its key and request id."""

    c: _Client
    key: ApiKey
    lock: str
    rid: str

    @property
    def req(self) -> tuple[str, str, str]:
        """What the source keeps of the request that made a grant (see :class:`_Held`)."""
        return (self.key.id, self.rid, self.c.name)


@dataclasses.dataclass
class _Held:
    source_id: str
    value: int
    expires: float  # on the source's clock
    ttl: float
    req: tuple[str, str, str] | None  # (key id, request id, client) that made it


class _Source:
    """The token source every gateway shares: per lock a durable counter and the live grant,
    expiry judged by its own clock; grants and releases by token, as fenced's real sources."""

    def __init__(self, run: GatewayRun) -> None:
        self.run, self.w = run, run.w
        self.counters: dict[str, int] = dict.fromkeys(LOCKS, 0)
        self.held: dict[str, _Held] = {}
        self.freed: dict[str, asyncio.Future[None]] = {
            n: self.w.loop.create_future() for n in LOCKS
        }
        # (lock, token) -> (how it ended, when, by which gateway); the checkers read it
        self.ended: dict[tuple[str, int], tuple[str, float, str]] = {}
        self.grants: dict[tuple[str, int], tuple[str, str, str] | None] = {}
        # (gateway, lock, key id, request id): a gateway answered a grant, renewal or release
        # of that request as done (it remembers the id); the last grant of each request; and
        # grants made for late duplicates (lock, token) -> (gateway, request)
        self.seen: set[tuple[str, str, str, str]] = set()
        self.last_grant: dict[tuple[str, str, str], int] = {}
        self.late: dict[tuple[str, int], tuple[str, tuple[str, str, str]]] = {}
        self.delivered: set[tuple[str, str, int]] = set()  # (gateway, lock, token) it was told
        self.answered: set[tuple[str, int]] = set()  # and those a client was answered with
        self.releasing: set[tuple[str, str, int]] = set()  # (gateway, lock, token) it released

    def clock(self) -> float:
        return self.w.source_clock()

    def _expire(self, lock: str) -> None:
        h = self.held.get(lock)
        if h is not None and h.expires <= self.clock():
            del self.held[lock]
            when = h.expires / self.w.source_rate
            self.ended[(lock, h.value)] = ("expired", when, "")
            self.w.record("source", "expired", lock=lock, token=h.value, at=round(when, 9))

    def try_acquire(
        self,
        lock: str,
        source_id: str,
        ttl: float,
        req: tuple[str, str, str] | None,
        by: str = "",
    ) -> tuple[int, float] | None:
        self._expire(lock)
        h = self.held.get(lock)
        if h is not None:
            if h.source_id == source_id:
                return h.value, h.expires - self.clock()
            if req is not None and h.req is not None and h.req[:2] == req[:2]:
                self.run.violate(
                    "retry-new-grant",
                    f"{req[2]}'s acquire (request id {req[1]!r}) asked the source for another "
                    f"grant while its own, {lock}:{h.value}, was live",
                    self.w.record("source", "second-grant-asked", lock=lock, token=h.value),
                )
            return None
        self.counters[lock] += 1
        value = self.counters[lock]
        self.held[lock] = _Held(source_id, value, self.clock() + ttl, ttl, req)
        self.grants[(lock, value)] = req
        if req is not None:
            before = self.last_grant.get((lock, req[0], req[1]))
            self.last_grant[(lock, req[0], req[1])] = value
            if (
                before is not None
                and (lock, before) in self.ended
                and (by, lock, req[0], req[1]) in self.seen
            ):
                self.late[(lock, value)] = (by, req)  # (judged at the end: see late_grants)
        self.w.record("source", "granted", lock=lock, token=value, to=_who(req))
        self._wake_at_expiry(lock)
        return value, ttl

    def _mutated(self, what: str, lock: str, h: _Held, req: tuple[str, str, str] | None) -> None:
        """A renewal or release of ``h`` for the request ``req``: it must be the key's own."""
        if req is not None and h.req is not None and req[0] != h.req[0]:
            self.run.violate(
                "foreign-request",
                f"{req[2]} ({req[0]}) {what} {lock}:{h.value}, {h.req[0]}'s grant, with its "
                f"request id {req[1]!r}",
                self.w.record("source", f"foreign-{what}", lock=lock, token=h.value, by=req[2]),
            )

    def renew(self, lock: str, value: int, req: tuple[str, str, str] | None) -> float:
        self._expire(lock)
        h = self.held.get(lock)
        if h is None or h.value != value:
            raise LeaseLostError(f"lease {lock}:{value} is no longer held")
        self._mutated("renewed", lock, h, req)
        h.expires = self.clock() + h.ttl
        self._wake_at_expiry(lock)
        return h.ttl

    def release(self, lock: str, value: int, req: tuple[str, str, str] | None, by: str) -> bool:
        self._expire(lock)
        h = self.held.get(lock)
        if h is None or h.value != value:
            return False
        self._mutated("released", lock, h, req)
        del self.held[lock]
        self.ended[(lock, value)] = ("released", self.w.now(), by)
        self.w.record("source", "released", lock=lock, token=value, by=by)
        self._wake(lock)
        return True

    def status(self, lock: str) -> LockStatus:
        self._expire(lock)
        h = self.held.get(lock)
        last = self.counters[lock]
        return LockStatus(
            name=lock,
            holder=h.source_id if h else None,
            token=FencingToken(lock, h.value) if h else None,
            last_token=FencingToken(lock, last) if last else None,
            remaining=max(0.0, h.expires - self.clock()) if h else None,
        )

    def _wake(self, lock: str) -> None:
        woken, self.freed[lock] = self.freed[lock], self.w.loop.create_future()
        if self.w.source_up:
            self.w.loop.call_later(self.w._delay(), _resolve, woken)

    def _wake_at_expiry(self, lock: str) -> None:
        h = self.held[lock]
        when = h.expires / self.w.source_rate
        self.w.loop.call_at(max(when, self.w.now()), self._wake_if_expired, lock)

    def _wake_if_expired(self, lock: str) -> None:
        self._expire(lock)
        if lock not in self.held:
            self._wake(lock)


def _who(req: tuple[str, str, str] | None) -> str:
    return "-" if req is None else f"{req[2]}/{req[1]}"


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class GwSourceBackend(Backend):
    """A gateway's connection to the simulated source: each call one message each way,
    carrying the client request being served (see REQUEST)."""

    scheme: ClassVar[str] = "simgw"
    characteristics: ClassVar[frozenset[Characteristic]] = frozenset(
        {Characteristic.LINEARIZABLE, Characteristic.SERVER_EXPIRY}
    )
    caller_driven: ClassVar[bool] = True
    _gateways: ClassVar[dict[str, _Gw]] = {}

    def __init__(self, gw: _Gw) -> None:
        self.gw = gw
        self.w, self.source = gw.run.w, gw.run.source

    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> GwSourceBackend:
        return cls(cls._gateways[url.netloc])

    async def _call(self, apply: Callable[[], Any]) -> Any:
        return await self.w.call(self.gw.proc, "source", apply)

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
        s, req, by = self.source, REQUEST.get(), self.gw.name
        while True:
            sent = self.w.now()
            got = await self._call(lambda: s.try_acquire(name, request_id, ttl, req, by))
            if got is not None:
                value, left = got
                s.delivered.add((by, name, value))
                return Grant(FencingToken(name, value), request_id, ttl, sent + left - ttl)
            if deadline is not None and self.w.now() >= deadline:
                raise lock_timeout(name)
            left = 1.0 if deadline is None else max(0.0, deadline - self.w.now())
            try:
                async with asyncio.timeout(min(left, self.w.rng.uniform(0.5, 1.0))):
                    await asyncio.shield(s.freed[name])
            except TimeoutError:
                pass

    async def renew(self, grant: Grant) -> Grant:
        s, req, t = self.source, REQUEST.get(), grant.token
        sent = self.w.now()
        await self._call(lambda: s.renew(t.lock, t.value, req))
        return dataclasses.replace(grant, sent_at=sent)

    async def release(self, grant: Grant) -> bool:
        s, req, t, by = self.source, REQUEST.get(), grant.token, self.gw.name
        s.releasing.add((by, t.lock, t.value))  # (sent: it may be lost, the source down)
        return bool(await self._call(lambda: s.release(t.lock, t.value, req, by)))

    async def status(self, name: str) -> LockStatus:
        s = self.source
        got: LockStatus = await self._call(lambda: s.status(name))
        return got

    async def lock_names(self) -> list[str]:
        return list(LOCKS)

    async def aclose(self) -> None:
        pass


class _SimGateway(Gateway):
    """The real Gateway; its transitions also go to the trace (and a plant, if asked)."""

    run: GatewayRun
    gw_name: str

    def _note(self, name: str, event: str, token: FencingToken, owner: str | None) -> None:
        super()._note(name, event, token, owner)
        self.run.w.record(self.gw_name, event, lock=name, token=token.value)
        self.run.noted.append((self.gw_name, event, name, token.value, self.run.w.now()))

    def _answered(self, name: str) -> None:
        """This gateway answers the request it serves as done: it knows its request id."""
        req = REQUEST.get()
        if req is not None:
            self.run.source.seen.add((self.gw_name, name, req[0], req[1]))

    async def acquire(
        self, name: str, request_id: str, ttl: float, wait: float, owner: str, **kw: Any
    ) -> tuple[Grant, FencingToken]:
        got = await super().acquire(name, request_id, ttl, wait, owner, **kw)
        self._answered(name)
        return got

    async def renew(
        self, name: str, token: FencingToken, request_id: str, ttl: float | None, **kw: Any
    ) -> Grant:
        grant = await super().renew(name, token, request_id, ttl, **kw)
        self.run.w.record(self.gw_name, "gw-renewed", lock=name, token=token.value)
        self._answered(name)
        return grant

    async def release(self, name: str, token: FencingToken, request_id: str, **kw: Any) -> bool:
        released = await super().release(name, token, request_id, **kw)
        if released:
            self._answered(name)
        return released


class _ReleaseAnyKey(_SimGateway):
    async def release_for(
        self,
        key: ApiKey | None,
        name: str,
        token: FencingToken,
        request_id: str,
        *,
        retry: bool = False,
    ) -> bool:
        # (Planted: "release by token" — the holder's source id taken from the source.)
        status = await self.backend.status(name)
        holder = status.holder if status.token == token else None
        return await self.release(name, token, holder or own_id(key, request_id), retry=retry)


class _RetryNewGrant(_SimGateway):
    _ids: dict[str, str]
    _serial: itertools.count[int]

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
        # (Planted: the source id is this gateway's, per acquire; the client's kept in memory.)
        mine = own_id(key, request_id)
        sid = self._ids.setdefault(mine, f"{mine}.{self.gw_name}.{next(self._serial)}")
        grant, signed = await self.acquire(name, sid, ttl, wait, owner)
        # (renewals and releases find it under the client's id, here)
        self._grants[(name, mine)] = self._grants.pop((name, sid), grant)
        return grant, signed


class _ExpiryRecounted(_SimGateway):
    async def release(self, name: str, token: FencingToken, request_id: str, **kw: Any) -> bool:
        released = await super().release(name, token, request_id, **kw)
        if not released:  # (planted: a release finding its grant gone counts an expiry)
            self.metrics.expiries.inc()
            self._note(name, "expired", token, None)
        return released


class _LateDuplicateGranted(_SimGateway):
    async def acquire(
        self, name: str, request_id: str, ttl: float, wait: float, owner: str, **kw: Any
    ) -> tuple[Grant, FencingToken]:
        self._remembered.clear()  # (planted: no id remembered, a late duplicate granted anew)
        return await super().acquire(name, request_id, ttl, wait, owner, **kw)


_PLANTED: dict[str, type[_SimGateway]] = {
    "gw-release-any-key": _ReleaseAnyKey,
    "gw-retry-new-grant": _RetryNewGrant,
    "gw-late-duplicate-granted": _LateDuplicateGranted,
    "gw-expiry-recounted": _ExpiryRecounted,
}


@dataclasses.dataclass(eq=False)
class _Gw:
    """One gateway process: a real Gateway behind the simulated network."""

    run: GatewayRun
    slot: int
    name: str
    proc: _Client
    gateway: _SimGateway | None = None
    tasks: set[asyncio.Task[Any]] = dataclasses.field(default_factory=set)

    async def start(self) -> None:
        w = self.run.w
        url = f"{id(w)}-{self.name.replace('#', '.')}"
        GwSourceBackend._gateways[url] = self
        cls = _PLANTED.get(w.cfg.plant, _SimGateway)
        g = cls(
            AsyncLocks(f"simgw://{url}"),
            max_wait=10.0,
            default_ttl=w.cfg.ttl,
            wall=w.now,
            metrics=_metrics(),  # (the checkers read the transitions, not the counters)
        )
        g.run, g.gw_name = self.run, self.name
        if isinstance(g, _RetryNewGrant):
            g._ids, g._serial = {}, itertools.count(1)
        await g.start()
        self.gateway = g

    def crash(self) -> None:
        self.proc.dead = True
        self.proc.running.set()
        for t in list(self.tasks):
            t.cancel()
        if self.gateway is not None:
            self.gateway.halt()


_METRICS: list[Metrics] = []


def _metrics() -> Metrics:
    """One registry for every simulated gateway of this process (never read: see _note)."""
    if not _METRICS:
        _METRICS.append(Metrics())
    return _METRICS[0]


class _NoAnswer(BackendUnavailable):
    pass


class GatewayRun:
    def __init__(self, w: _World) -> None:
        self.w = w
        self.source = _Source(self)
        self.violations: list[Violation] = []
        self.noted: list[tuple[str, str, str, int, float]] = []  # gateways' transitions
        self.gateways: list[_Gw] = []
        self.retired: list[_Gw] = []
        self.resources = {n: self._resource(n) for n in LOCKS}
        self.tasks: list[asyncio.Task[None]] = []
        self.stopped = float("inf")  # when the gateways stopped (their sweeps with them)

    @staticmethod
    def _resource(lock: str) -> SQLResource:
        res = SQLResource.in_memory(lock)
        res.reset()
        return res

    def violate(self, kind: str, message: str, *events: dict[str, Any]) -> None:
        self.violations.append(Violation(kind, message, events))

    # -- the network between clients and gateways --------------------------------------------

    async def ask(
        self,
        c: _Client,
        slot: int,
        req: tuple[str, str, str],
        make: Callable[[Gateway], Awaitable[Any]],
        timeout: float,
    ) -> Any:
        """Send a request to the gateway at ``slot`` (whichever process answers there when it
        lands) and wait for its answer, at most ``timeout`` (then _NoAnswer; it may still be
        carried out)."""
        w, loop = self.w, self.w.loop
        if not c.running.is_set():  # (as _World.call: a set Event's wait() is a no-op)
            await c.running.wait()
        if c.dead:
            raise BackendUnavailable("sim: this client is dead")
        answer: asyncio.Future[Any] = loop.create_future()

        async def serve(g: _Gw, reply_to: asyncio.Future[Any] | None) -> None:
            # (delivered: the process at the slot now carries it out; ``reply_to`` is None
            # for a duplicate, whose reply nobody waits for)
            if not g.proc.running.is_set():  # (as _World.call)
                await g.proc.running.wait()
            if g.proc.dead or g.gateway is None:
                return
            REQUEST.set(req)
            try:
                result, error = await make(g.gateway), None
            except FencedError as exc:
                result, error = None, exc
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # (what the server's HTTP layer would answer as a 500)
                self.violate("error", f"gateway {g.name} raised {type(exc).__name__}: {exc}")
                return
            if reply_to is None or g.proc.dead or w._lost() or c.dead:
                return
            loop.call_later(w._delay(), _settle, reply_to, result, error)

        def land(reply: bool) -> None:
            g = self.gateways[slot]
            if g.gateway is None:  # (starting: refused, as a port not yet open)
                return
            task = loop.create_task(serve(g, answer if reply else None))
            g.tasks.add(task)
            task.add_done_callback(g.tasks.discard)

        if not w._lost():
            loop.call_later(w._delay(), land, True)
        if "dup" in w.faults and w.rng.random() < 0.03:
            loop.call_later(w._delay() + w._delay(), land, False)
        try:
            async with asyncio.timeout(timeout):
                return await answer
        except TimeoutError:
            raise _NoAnswer(f"sim: no answer from gateway {slot + 1}") from None

    # -- clients ---------------------------------------------------------------------------------

    async def client(self, c: _Client, tenant: str, slot: int, gen: int) -> None:
        w, cfg = self.w, self.w.cfg
        key = KEYS[tenant]
        ttl = cfg.ttl
        for r in range(cfg.rounds):
            await c.running.wait()
            lock = w.rng.choice(LOCKS)
            a = _Ask(c, key, lock, f"w{slot}.{gen}-{r}")
            got = await self._acquire(a)
            if got is None:
                continue
            token, _ = got
            # One write per grant: the register is written whole, and a duplicate of a first
            # write landing after a second, with the same token, would undo it.
            if w.rng.random() < 0.5:
                await asyncio.sleep(w.rng.uniform(0.1, 0.6) * ttl)
                await self._renew(a, token)
            await self._write(c, lock, token)
            await self._release(a, token)

    def _slot(self) -> int:
        return self.w.rng.randrange(len(self.gateways))

    async def _rpc(self, a: _Ask, make: Callable[[Gateway], Awaitable[Any]]) -> Any:
        """:meth:`ask` ``make`` of any gateway, at most an RPC's time."""
        return await self.ask(a.c, self._slot(), a.req, make, RPC)

    async def _acquire(self, a: _Ask) -> tuple[FencingToken, float] | None:
        """Acquire through any gateway; an answer lost: the same request id again, through
        another gateway (up to four tries)."""
        c, key, lock, rid, req = a.c, a.key, a.lock, a.rid, a.req
        w, ttl = self.w, self.w.cfg.ttl
        wait = WAIT * ttl

        async def make(gw: Gateway) -> tuple[int, float]:
            grant, _ = await gw.acquire_for(key, lock, rid, ttl, wait, c.name)
            # (as the HTTP layer answers it: expires_in from the grant's own start)
            return grant.token.value, max(0.0, grant.sent_at + grant.ttl - w.now())

        for attempt in range(4):
            slot = self._slot()
            sent = w.now()
            try:
                value, expires_in = await self.ask(c, slot, req, make, wait + 1.0)
            except LockTimeout:
                w.record(c.name, "error", step="acquire", lock=lock, error="LockTimeout")
                return None
            except LeaseLostError:  # (its grant ended before this retry: a new round, new id)
                w.record(c.name, "error", step="acquire", lock=lock, error="LeaseLostError")
                return None
            except BackendUnavailable as exc:
                w.record(c.name, "error", step="acquire", lock=lock, error=type(exc).__name__)
                if c.dead:
                    return None
                continue  # (the classic: the same request again, after a lost reply)
            believed = sent + expires_in - MARGIN * ttl
            event = w.record(
                c.name, "grant", lock=lock, token=value, rid=rid, gateway=slot + 1,
                attempt=attempt, surely_until=round(believed, 9),
            )  # fmt: skip
            made_for = self.source.grants.get((lock, value))
            self.source.answered.add((lock, value))
            if made_for is None or made_for[:2] != req[:2]:
                self.violate(
                    "wrong-grant",
                    f"{c.name} (request id {rid!r}) was answered with {lock}:{value}, made for "
                    f"{_who(made_for)}",
                    event,
                )
            return FencingToken(lock, value), believed
        return None

    async def _write(self, c: _Client, lock: str, token: FencingToken) -> None:
        w, res = self.w, self.resources[lock]
        to = f"res-{lock}"
        try:
            data = await w.call(c, to, lambda: res.read(token))
        except StaleTokenError:
            w.record(c.name, "read", lock=lock, token=token.value, ok=False)
            return
        except BackendUnavailable:
            return
        value, blob = next_entry(data, token)
        w.record(c.name, "read", lock=lock, token=token.value, ok=True, value=value - 1)
        await asyncio.sleep(w.rng.uniform(0, w.cfg.ttl / 4))
        sent = w.now()
        ok: bool | None
        try:
            await w.call(c, to, lambda: res.write(token, blob))
            ok = True
        except StaleTokenError:
            ok = False
        except BackendUnavailable:
            ok = None
        w.record(c.name, "write", lock=lock, token=token.value, value=value, ok=ok, sent=sent)

    async def _renew(self, a: _Ask, token: FencingToken) -> bool:
        w, c, lock = self.w, a.c, a.lock
        sent = w.now()
        try:
            await self._rpc(a, lambda gw: gw.renew_for(a.key, lock, token, a.rid, w.cfg.ttl))
        except FencedError as exc:
            w.record(c.name, "renewal", lock=lock, token=token.value, ok=False,
                     error=type(exc).__name__)  # fmt: skip
            return False
        event = w.record(c.name, "renewal", lock=lock, token=token.value, ok=True, sent=sent)
        ended = self.source.ended.get((lock, token.value))
        if ended is not None and ended[1] < sent:
            self.violate(
                "renewed-after-expiry",
                f"{c.name}'s renewal of {lock}:{token.value} was answered as done, sent after "
                f"the grant had {ended[0]} (at {ended[1]:.3f})",
                event,
            )
        return True

    async def _release(self, a: _Ask, token: FencingToken) -> None:
        w, c, lock = self.w, a.c, a.lock
        w.record(c.name, "releasing", lock=lock, token=token.value)
        sent = w.now()
        released = False
        for attempt in range(2):  # (a lost answer: once more, as a retry, as fenced's client)
            try:
                release = functools.partial(_release, a.key, lock, token, a.rid, attempt > 0)
                released = await self._rpc(a, release)
                break
            except BackendUnavailable:
                if c.dead:
                    break
            except FencedError:
                break
        w.record(c.name, "release", lock=lock, token=token.value, released=released, sent=sent)

    # -- the intruders: another tenant's leaked request ids -----------------------------------

    async def intruder(self, tenant: str) -> None:
        w, ttl = self.w, self.w.cfg.ttl
        key = KEYS[tenant]
        me = _Client(f"x{tenant}", _running())
        while True:
            await asyncio.sleep(w.rng.uniform(0.4, 1.4) * ttl)
            theirs = [
                (lock, h)
                for lock, h in sorted(self.source.held.items())
                if h.req is not None and h.req[0] != key.id
            ]
            if not theirs:
                continue
            lock, h = w.rng.choice(theirs)
            assert h.req is not None
            rid, token = h.req[1], FencingToken(lock, h.value)
            req = (key.id, rid, me.name)
            verb = w.rng.choice(("renew", "release", "acquire", "acquire-wait"))
            w.record(me.name, "intrude", verb=verb, lock=lock, token=h.value, rid=rid)
            make = _intrusion(verb, key, lock, token, rid, ttl, me.name)
            try:
                got = await self.ask(me, self._slot(), req, make, RPC + ttl)
            except FencedError as exc:
                w.record(me.name, "intruded", verb=verb, ok=False, error=type(exc).__name__)
                continue
            won = (verb == "renew") or (verb == "release" and got is True)
            if verb.startswith("acquire"):
                won = got[0].token.value == h.value  # (a grant of its own, later, is fine)
            event = w.record(me.name, "intruded", verb=verb, ok=won)
            if won:
                self.violate(
                    "foreign-request",
                    f"{me.name} ({key.id}) was answered {verb} done on {lock}:{h.value}, "
                    f"{h.req[0]}'s grant, with its request id {rid!r}",
                    event,
                )

    # -- faults ----------------------------------------------------------------------------------

    async def nemesis(self, clients: list[tuple[_Client, str, int, int]]) -> None:
        w, cfg, rng = self.w, self.w.cfg, self.w.rng
        kinds = [k for k in ("pause", "crash", "gateway", "jump", "source") if k in w.faults]
        while kinds:
            await asyncio.sleep(rng.uniform(0.3, 1.5) * cfg.ttl)
            kind = rng.choice(kinds)
            i = rng.randrange(len(clients))
            c, tenant, slot, gen = clients[i]
            if kind in ("pause", "crash"):
                w.record("nemesis", "nemesis", kind=kind, victim=c.name)
            if kind == "pause":
                c.running.clear()
                w.loop.call_later(rng.uniform(1.2, 3.0) * cfg.ttl, c.running.set)
            elif kind == "crash":
                c.dead = True
                c.running.set()
                self.tasks[i].cancel()
                new = _Client(f"{tenant}{slot}.{gen + 1}", _running())
                clients[i] = (new, tenant, slot, gen + 1)
                self.tasks[i] = asyncio.ensure_future(self.client(new, tenant, slot, gen + 1))
            elif kind == "gateway":
                g = self.gateways[rng.randrange(len(self.gateways))]
                w.record("nemesis", "nemesis", kind=kind, victim=g.name)
                await self.restart(g, rng.uniform(0.05, 0.5) * cfg.ttl)
            elif kind == "jump":
                leap = rng.uniform(0.3, 2.5) * cfg.ttl
                w.record("nemesis", "nemesis", kind=kind, victim="clock", seconds=round(leap, 9))
                w.loop.advance(leap)  # (everything due meanwhile runs late, in order)
            else:
                w.record("nemesis", "nemesis", kind=kind, victim="source")
                w.source_up = False
                w.loop.call_later(rng.uniform(0.2, 2.0) * cfg.ttl, _source_up, w)

    async def restart(self, g: _Gw, down: float) -> None:
        """Kill the gateway's process (its requests in flight and all it kept in memory die)
        and start a new one at the same address after ``down`` seconds."""
        g.crash()
        self.retired.append(g)
        base, _, n = g.name.partition("#")
        new = _Gw(self, g.slot, f"{base}#{int(n or 1) + 1}", _Client(base, _running()))
        self.gateways[g.slot] = new
        await asyncio.sleep(down)
        await new.start()

    # -- the run ---------------------------------------------------------------------------------

    async def main(self) -> None:
        w = self.w
        for i in range(w.rng.choice((2, 3))):
            g = _Gw(self, i, f"g{i + 1}", _Client(f"g{i + 1}", _running()))
            self.gateways.append(g)
            await g.start()
        clients = []
        for i in range(w.cfg.clients):
            tenant, slot = TENANTS[i % 2], i // 2 + 1
            clients.append((_Client(f"{tenant}{slot}", _running()), tenant, slot, 0))
        self.tasks = [asyncio.ensure_future(self.client(*c)) for c in clients]
        background = [asyncio.ensure_future(self.nemesis(clients))]
        if "foreign" in w.faults:
            background += [asyncio.ensure_future(self.intruder(t)) for t in TENANTS]
        try:
            while not all(t.done() for t in self.tasks):
                pending = [t for t in self.tasks if not t.done()]
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in background:
                t.cancel()
            for c, *_ in clients:
                c.running.set()
        self.violations += failures(self.tasks) + failures(background)
        # The faults end; every grant runs out and every gateway's sweep has its look.
        w.source_up = True
        w.faults = set()
        await asyncio.sleep(2 * w.cfg.ttl + 2.2)
        self.stopped = w.now()
        for g in self.gateways:
            if g.gateway is not None:
                await g.gateway.stop()

    def check(self) -> list[Violation]:
        out = list(self.violations)
        for lock in LOCKS:
            data, mark = self.resources[lock].final()
            self.w.record("checker", "final", lock=lock, mark=mark,
                          log=json.loads(data) if data else [])  # fmt: skip
            history = [e for e in self.w.trace if e.get("lock", lock) == lock]
            out += [
                v
                for v in check_all(history)
                if v.checker != "nothing checked"  # (one lock may go unused)
            ]
        if not any(e["op"] == "write" and e["ok"] for e in self.w.trace):
            out.append(Violation("nothing checked", "no write was accepted in the whole run"))
        return out + self._late_grants() + self._expiries()

    def _late_grants(self) -> list[Violation]:
        """A grant the source made for a late duplicate, at a gateway that knew the request,
        and answered to no client (held by nobody), must have been given back by that
        gateway (a release sent: lost, or the source down, it expires), not left to expire —
        unless its answer never reached the gateway (lost: nobody knows of it). (One a
        client was answered with — its retry, still waiting — is held: its own grant.)"""
        out = []
        for (lock, value), (by, req) in sorted(self.source.late.items()):
            how = self.source.ended.get((lock, value), ("held",))[0]
            told = (by, lock, value) in self.source.delivered
            given_back = (by, lock, value) in self.source.releasing
            if not told or given_back or (lock, value) in self.source.answered:
                continue
            if how != "released":
                out.append(Violation(
                    "retry-new-grant",
                    f"{by} granted {lock}:{value} to {_who(req)}, a late duplicate of a request "
                    f"whose grant had ended and which {by} had answered; it was {how}, not "
                    "given back",
                ))  # fmt: skip
        return out[:3]

    def _expiries(self) -> list[Violation]:
        """Each gateway counts a grant's expiry at most once and never one it released; the
        gateway that last made or renewed a grant that expired counts it."""
        out: list[Violation] = []
        counted: dict[tuple[str, str, int], int] = {}
        released: set[tuple[str, str, int]] = set()
        for gname, event, lock, value, _ in self.noted:
            if event == "expired":
                counted[(gname, lock, value)] = counted.get((gname, lock, value), 0) + 1
            elif event == "released":
                released.add((gname, lock, value))
        for (gname, lock, value), n in sorted(counted.items()):
            if n > 1:
                out.append(Violation("expiry-count", f"{gname} counted {lock}:{value}'s expiry "
                                     f"{n} times"))  # fmt: skip
            if (gname, lock, value) in released:
                out.append(Violation("expiry-count", f"{gname} counted {lock}:{value} as expired, "
                                     "a grant it released"))  # fmt: skip
        last = self._last_toucher()
        alive = {g.name for g in self.gateways}
        for (lock, value), (how, when, _) in sorted(self.source.ended.items()):
            g = last.get((lock, value))
            # (a sweep's look: at most a second after a second past the grant's end)
            swept = when + 2.1 + MARGIN * self.w.cfg.ttl < self.stopped
            if how == "expired" and swept and g in alive and not counted.get((g, lock, value)):
                out.append(Violation("expiry-count", f"{lock}:{value} expired, and {g}, which "
                                     "made or last renewed it, never counted it"))  # fmt: skip
        return out[:3]

    def _last_toucher(self) -> dict[tuple[str, int], str]:
        """The gateway that last made or renewed each grant (by its answers in the trace)."""
        out: dict[tuple[str, int], str] = {}
        for gname, event, lock, value, _ in self.noted:
            if event == "granted":
                out[(lock, value)] = gname
        for e in self.w.trace:
            if e["op"] == "gw-renewed":
                out[(e["lock"], e["token"])] = e["worker"]
        return out

    def close(self) -> None:
        for res in self.resources.values():
            res.close()
        for g in self.gateways + self.retired:
            GwSourceBackend._gateways.pop(f"{id(self.w)}-{g.name.replace('#', '.')}", None)


def _release(
    key: ApiKey, lock: str, token: FencingToken, rid: str, retry: bool, gw: Gateway
) -> Awaitable[bool]:
    return gw.release_for(key, lock, token, rid, retry=retry)


def _intrusion(
    verb: str, key: ApiKey, lock: str, token: FencingToken, rid: str, ttl: float, who: str
) -> Callable[[Gateway], Awaitable[Any]]:
    """What an intruder asks a gateway with ``key``: ``verb`` on another key's grant."""
    if verb == "renew":
        return lambda gw: gw.renew_for(key, lock, token, rid, ttl)
    if verb == "release":  # (as a retry too: what a gateway remembers is no way in either)
        return lambda gw: gw.release_for(key, lock, token, rid, retry=True)
    wait = 0.0 if verb == "acquire" else 0.5 * ttl
    return lambda gw: gw.acquire_for(key, lock, rid, ttl, wait, who)


RPC = 0.5 + 0.5  # a client's bound on a renewal's or release's answer (two hops)


def _settle(answer: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if not answer.done():
        answer.set_exception(error) if error else answer.set_result(result)


def _source_up(w: _World) -> None:
    w.source_up = True
