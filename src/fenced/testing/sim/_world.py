"""One simulated world: clients running fenced's real lease core (:class:`fenced.AsyncLocks`)
against a simulated token source, writing through a network to a resource fenced by the real
:class:`~fenced.guards.sql.SQLGuard` (or a planted fence) on an in-memory SQLite database —
all on one :class:`VirtualLoop`, every choice drawn from one seeded ``random.Random``.

Faults: ``pause`` (a client stops: its worker and its renewals), ``stall`` (a client stops
between its read and its write), ``crash`` (a client dies; a new one starts), ``source``
(the token source is down for a while, then back with its durable state — the counter and
the grants; without its volatile state if a plant says so), ``resource`` (the same for the
resource), and on every message: delay, loss of the request or the reply, duplication and
reordering. The source's clock runs up to 2 % off the clients' (within the lease core's
safety margin for the ttl used). The history is the check kit's, checked by its checkers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import random
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, ClassVar
from urllib.parse import SplitResult

from ..._core import clock as _clock
from ..._core.backend import (
    Backend,
    Characteristic,
    Grant,
    LockStatus,
    LostCallback,
    Record,
    lock_timeout,
)
from ..._core.errors import (
    BackendUnavailable,
    ConfigurationError,
    FencedError,
    LeaseLostError,
    LockTimeout,
    RecordConflict,
    StaleTokenError,
)
from ..._core.lease import AsyncLease, AsyncLocks
from ..._core.token import FencingToken
from ..check._checkers import Violation, check_all
from ..check._plants import PLANTS, PlantedSQLite, plant_role
from ..check._resources import Resource, SplitWrite, SQLResource, Volatile
from ._loop import Stuck, VirtualLoop

__all__ = ["FAULTS", "SIM_PLANTS", "Config", "Outcome", "simulate"]

LOCK = "counter"
RPC_TIMEOUT = 0.5  # a client gives up on an answer after this long (the message may land later)
FAULTS = (
    "pause", "stall", "crash", "source", "resource", "wipe", "loss", "dup", "delay",
    "gateway", "jump", "foreign",
)  # fmt: skip
# What the simulator runs: fenced's lease core with one SQL-guarded resource ("lease"), or the
# replicated group (fenced.replicated) on members behind real SQL guards ("group"), or the
# grant bookkeeping of several fenced serve gateways sharing one source ("gateway").
SYSTEMS = ("lease", "group", "gateway")
#: The run of each system but "lease", by name: ``_group`` and the package (for "gateway",
#: which imports the server only when asked for) add them, as they build on this module.
SYSTEM_RUNS: dict[str, Callable[[_World], Any]] = {}
# The check kit's plants the simulator can play, plus one of its own. (It has no signed
# tokens, no forger and no impostor, and its source's volatile counter is counter-not-fsynced.)
NOT_SIMULATED = frozenset(
    {
        "token-in-memory", "signature-skipped", "key-id-ignored", "source-ignored",
        "lock-ignored", "tokenless-ok",
        # (its two steps are one to the simulator: it interleaves only at write_steps' seams)
        "hidden-check-then-write",
    }
)  # fmt: skip
SIM_PLANTS: dict[str, str] = {
    **{k: v for k, v in PLANTS.items() if k not in NOT_SIMULATED},
    "clock-fast": "the source's clock runs 30 % fast: leases end before their holders think",
    "empty-member-counted": "(group) a member restarted empty is counted as holding the "
    "acknowledged writes: it ignores since=, the behaviour before MemberBehindError",
    "member-unfenced": "(group) members apply changes without their guard's lock fence",
    "gw-release-any-key": "(gateway) a release finds the grant by its token, whoever's "
    "request id it names: the key check on release is forgotten",
    "gw-retry-new-grant": "(gateway) each gateway gives an acquire a source id of its own, "
    "kept in its memory: a retry through another gateway, or after a restart, asks for a "
    "second grant",
    "gw-expiry-recounted": "(gateway) a release that finds its grant gone counts an expiry "
    "(again, if the sweep counted it)",
    "gw-late-duplicate-granted": "(gateway) no request id is remembered: an acquire delivered "
    "after its grant was released or expired is granted anew, and nobody holds the grant",
}
GROUP_PLANTS = frozenset({"empty-member-counted", "member-unfenced"})
GATEWAY_PLANTS = frozenset(
    {"gw-release-any-key", "gw-retry-new-grant", "gw-expiry-recounted", "gw-late-duplicate-granted"}
)


def plant_system(plant: str) -> str:
    """The system a plant lives in (a group plant needs ``--system group``, a gateway plant
    ``--system gateway``)."""
    if plant in GROUP_PLANTS:
        return "group"
    return "gateway" if plant in GATEWAY_PLANTS else "lease"


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int
    clients: int = 3
    rounds: int = 4
    ttl: float = 1.0
    plant: str = ""
    faults: tuple[str, ...] = FAULTS
    system: str = "lease"

    def replay(self) -> str:
        faults = ",".join(self.faults)
        plant = f" --plant {self.plant}" if self.plant else ""
        system = f" --system {self.system}" if self.system != "lease" else ""
        return (
            f"fenced sim --replay {self.seed} --clients {self.clients} --rounds {self.rounds} "
            f"--faults {faults}{plant}{system}"
        )


@dataclasses.dataclass
class Outcome:
    config: Config
    violations: list[Violation]
    trace: list[dict[str, Any]]
    virtual_seconds: float

    @property
    def ok(self) -> bool:
        return not self.violations

    def trace_text(self, events: list[dict[str, Any]] | None = None) -> str:
        return "".join(json.dumps(e, sort_keys=True) + "\n" for e in (events or self.trace))

    def short_trace(self) -> list[dict[str, Any]]:
        """The events that explain the first violation: those of the clients it names (and
        the faults that hit them, the source or the resource), from two ttls before its
        first event to its last, and the final state."""
        if not self.violations:
            return self.trace
        named = [e for e in self.violations[0].events if isinstance(e, dict) and "mono" in e]
        if not named:  # (it names writes by value: every event up to the end)
            return self.trace
        who = {e["worker"] for e in named}
        start = min(e["mono"] for e in named) - 2 * self.config.ttl
        end = max(e["mono"] for e in named)

        def relevant(e: dict[str, Any]) -> bool:
            if e["op"] == "final" or e["worker"] == "source":  # (and the group's configurations)
                return True
            if not start <= e["mono"] <= end:
                return False
            if e["op"] == "nemesis":  # a fault on one of them, the source, resource or a member
                return e["victim"] in who or not e["victim"].startswith("c")
            return e["worker"] in who

        return [e for e in self.trace if relevant(e)]


class _World:
    def __init__(self, cfg: Config, loop: VirtualLoop) -> None:
        self.cfg = cfg
        self.loop = loop
        self.rng = random.Random(cfg.seed)
        self.trace: list[dict[str, Any]] = []
        self.faults = set(cfg.faults)
        # the source: durable (counter, grants) and whether it is up; its clock's rate
        self.counter = 0
        self.holder: tuple[str, int, float, float] | None = None  # request id, token, expiry, ttl
        self.source_up = True
        self.source_rate = 1.30 if cfg.plant == "clock-fast" else 1 + self.rng.uniform(-0.02, 0.02)
        self.resource_up = True
        self.group: Any = None  # the group's run (system "group")
        self.errors: list[Violation] = []  # clients that raised (see failures)
        self.down: set[str] = set()  # the group's members that are down now
        self.records: dict[str, Record] = {}  # the source's records (durable, as the counter)
        self.freed: asyncio.Future[None] = loop.create_future()  # resolved when it may be free
        if cfg.system == "lease":
            self.resource = self._resource()
            self.resource.reset()
            # Asked at each write and restart: an isinstance of a runtime-checkable Protocol
            # walks the protocol's members each time (~100 us, ~16 a seed: ~10 % of a lease
            # seed's CPU), and the resource is the same for the whole run.
            self.split_writes = isinstance(self.resource, SplitWrite)
            self.volatile = isinstance(self.resource, Volatile)

    def _resource(self) -> Resource:
        """The check kit's resource, in memory: its planted one, or the real SQL guard's."""
        if self.cfg.plant in PLANTS and plant_role(self.cfg.plant) == "resource":
            return PlantedSQLite.in_memory(LOCK, self.cfg.plant)
        return SQLResource.in_memory(LOCK)

    @property
    def faults(self) -> frozenset[str]:
        return self._faults

    @faults.setter
    def faults(self, kinds: set[str] | frozenset[str]) -> None:
        # Asked of every message: kept as two flags, set again when a run ends its faults
        # for a quiet end (a new set); frozen, so that no change in place leaves them stale.
        self._faults = frozenset(kinds)
        self._delays, self._losses = "delay" in kinds, "loss" in kinds

    def now(self) -> float:
        return self.loop._now  # (loop.time()'s value, a call less: the simulator's commonest)

    def record(self, worker: str, op: str, **fields: Any) -> dict[str, Any]:
        event = {"worker": worker, "op": op, "mono": round(self.loop._now, 9), **fields}
        self.trace.append(event)
        return event

    # -- the source, as its server sees it (its own clock) ----------------------------------

    def source_clock(self) -> float:
        return self.now() * self.source_rate

    def _expire(self) -> None:
        if self.holder is not None and self.holder[2] <= self.source_clock():
            self.holder = None

    def try_acquire(self, request_id: str, ttl: float) -> tuple[FencingToken, float] | None:
        """The grant and the time it has left (a retry of a grant made earlier, whose reply
        was lost, has less than its ttl left: it started at the earlier request)."""
        self._expire()
        if self.holder is not None:
            rid, value, expires, _ = self.holder
            left = expires - self.source_clock()
            return (FencingToken(LOCK, value), left) if rid == request_id else None
        self.counter += 1
        self.holder = (request_id, self.counter, self.source_clock() + ttl, ttl)
        self._wake_at_expiry()
        return FencingToken(LOCK, self.counter), ttl

    def renew(self, token: FencingToken) -> None:
        self._expire()
        if self.holder is None or self.holder[1] != token.value:
            raise LeaseLostError(f"lease {token} is no longer held")
        rid, value, _, ttl = self.holder
        self.holder = (rid, value, self.source_clock() + ttl, ttl)
        self._wake_at_expiry()

    def release(self, token: FencingToken | None) -> bool:
        self._expire()
        if self.holder is None or (token is not None and self.holder[1] != token.value):
            return False
        self.holder = None
        self._wake_waiters()
        return True

    def swap_record(self, name: str, version: int, value: str) -> Record:
        current = self.records.get(name)
        found = 0 if current is None else current.version
        if found != version:
            raise RecordConflict(name, version, found)
        record = self.records[name] = Record(name, version + 1, value)
        # (Not the value's random id, which only tells one change from another: the trace
        # stays the same byte for byte.)
        shown = {k: v for k, v in json.loads(value).items() if k != "id"}
        self.record("source", "record", name=name, version=version + 1, value=shown)
        return record

    def _wake_waiters(self) -> None:
        """Tell the clients waiting for the lock it may be free (a push message, delayed
        like any other; lost with the source if it is down)."""
        woken, self.freed = self.freed, self.loop.create_future()
        if self.source_up:
            self.loop.call_later(self._delay(), _resolve, woken)

    def _wake_at_expiry(self) -> None:
        """A grant's expiry frees the lock without a request: wake the waiters then (a renewal
        since makes them find it held still, and wait again)."""
        if self.holder is not None:
            when = self.holder[2] / self.source_rate  # (its expiry, in clients' time)
            self.loop.call_at(max(when, self.now()), self._wake_if_expired)

    def _wake_if_expired(self) -> None:
        self._expire()
        if self.holder is None:  # (renewed since: a later timer is set for the new expiry)
            self._wake_waiters()

    # -- the network -------------------------------------------------------------------------

    def _delay(self) -> float:
        if self._delays and self.rng.random() < 0.05:
            return self.rng.uniform(0.0, 2 * self.cfg.ttl)  # (overtaken by later messages)
        return self.rng.uniform(0.0005, 0.005)

    def _lost(self) -> bool:
        return self._losses and self.rng.random() < 0.03

    def is_up(self, to: str) -> bool:
        if to == "source":
            return self.source_up
        if to == "resource":
            return self.resource_up
        return to not in self.down  # a member of the group

    async def call(self, client: _Client, to: str, apply: Callable[[], Any]) -> Any:
        """Send ``apply`` to the source or the resource and wait for its answer (at most
        RPC_TIMEOUT: then BackendUnavailable, though the request may still land)."""
        if not client.running.is_set():  # (a set Event's wait() returns at once: no coroutine)
            await client.running.wait()  # a stopped process sends nothing
        if client.dead:
            raise BackendUnavailable("sim: this client is dead")
        answer: asyncio.Future[Any] = self.loop.create_future()
        # The client gives up RPC_TIMEOUT after sending. That timer is set only when the
        # answer will not be back by then (lost, late or the server down), known when the
        # message is sent or lands: most messages are answered, and a timer per message set
        # and cancelled was a tenth of the simulator's time.
        give_up = self.now() + RPC_TIMEOUT

        def no_answer() -> None:
            self.loop.call_at(give_up, _no_answer, answer, to)

        def deliver(reply: bool) -> None:
            if not self.is_up(to):
                if reply:
                    no_answer()
                return  # lost with the server
            try:
                result, error = apply(), None
            except FencedError as exc:
                result, error = None, exc
            if not reply:
                return
            if not self._lost() and not client.dead:
                delay = self._delay()
                self.loop.call_later(delay, settle, result, error)
                if self.now() + delay < give_up:
                    return
            no_answer()

        def settle(result: Any, error: BaseException | None) -> None:
            if not answer.done():
                answer.set_exception(error) if error else answer.set_result(result)

        if not self._lost():
            delay = self._delay()
            self.loop.call_later(delay, deliver, True)
            if delay >= RPC_TIMEOUT:
                no_answer()
        else:
            no_answer()
        if "dup" in self.faults and self.rng.random() < 0.03:
            self.loop.call_later(self._delay() + self._delay(), deliver, False)
        return await answer


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _no_answer(answer: asyncio.Future[Any], to: str) -> None:
    if not answer.done():
        answer.set_exception(BackendUnavailable(f"sim: no answer from the {to}"))


class SimBackend(Backend):
    """A client's connection to the simulated source: each call one message each way."""

    scheme: ClassVar[str] = "sim"
    characteristics: ClassVar[frozenset[Characteristic]] = frozenset(
        {Characteristic.LINEARIZABLE, Characteristic.SERVER_EXPIRY}
    )
    caller_driven: ClassVar[bool] = True
    _worlds: ClassVar[dict[str, tuple[_World, _Client]]] = {}

    def __init__(self, world: _World, client: _Client) -> None:
        self.world, self.client = world, client

    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> SimBackend:
        return cls(*cls._worlds[url.netloc])

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
        w = self.world
        while True:
            sent = _clock.now()
            got = await w.call(self.client, "source", lambda: w.try_acquire(request_id, ttl))
            if got is not None:
                token, left = got
                return Grant(token, request_id, ttl, sent + left - ttl)
            if deadline is not None and _clock.now() >= deadline:
                raise lock_timeout(name)
            # Wait for the source's word that it may be free (or poll again, if that is lost).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(w.freed), w.rng.uniform(0.5, 1.0))

    async def renew(self, grant: Grant) -> Grant:
        sent = _clock.now()
        await self.world.call(self.client, "source", lambda: self.world.renew(grant.token))
        return dataclasses.replace(grant, sent_at=sent)

    async def release(self, grant: Grant) -> bool:
        return bool(
            await self.world.call(self.client, "source", lambda: self.world.release(grant.token))
        )

    async def status(self, name: str) -> LockStatus:
        raise NotImplementedError

    async def read_record(self, name: str) -> Record | None:
        w = self.world
        found: Record | None = await w.call(self.client, "source", lambda: w.records.get(name))
        return found

    async def swap_record(self, name: str, version: int, value: str) -> Record:
        w = self.world
        done: Record = await w.call(
            self.client, "source", lambda: w.swap_record(name, version, value)
        )
        return done

    async def lock_names(self) -> list[str]:
        return [LOCK]

    async def aclose(self) -> None:
        pass


@dataclasses.dataclass(eq=False)
class _Client:
    name: str
    running: asyncio.Event
    dead: bool = False
    stall: bool = False


async def acquire(
    w: _World, c: _Client, locks: AsyncLocks, r: int
) -> tuple[AsyncLease, FencingToken] | None:
    """Client ``c``'s lease of round ``r`` and its token, or None (recorded) if not granted."""
    lease = locks.lock(LOCK, ttl=w.cfg.ttl, request_id=f"{c.name}-{r}")
    try:
        token = await lease.acquire(timeout=5 * w.cfg.ttl)
    except (LockTimeout, BackendUnavailable, LeaseLostError) as exc:
        w.record(c.name, "error", step="acquire", error=type(exc).__name__)
        return None
    return lease, token


async def stall_point(w: _World, c: _Client, token: FencingToken) -> None:
    """Where client ``c`` stops if a stall was asked of it: the whole process stops (its
    renewals included) for 1.2-3 ttls."""
    if c.stall:
        c.stall = False
        w.record(c.name, "stalled", lock=LOCK, token=token.value)
        c.running.clear()
        await asyncio.sleep(w.rng.uniform(1.2, 3.0) * w.cfg.ttl)
        c.running.set()


async def _client_loop(w: _World, c: _Client, rounds: int) -> None:
    cfg = w.cfg
    SimBackend._worlds[f"{id(w)}-{c.name}"] = (w, c)
    locks = AsyncLocks(f"sim://{id(w)}-{c.name}")
    for r in range(rounds):
        await c.running.wait()
        got = await acquire(w, c, locks, r)
        if got is None:
            continue
        lease, token = got
        believed = lease.remaining() * (2.0 if cfg.plant == "lease-overestimated" else 1.0)
        w.record(c.name, "grant", lock=LOCK, token=token.value, surely_until=w.now() + believed)
        await _round(w, c, token, lease)
        w.record(c.name, "releasing", lock=LOCK, token=token.value)
        sent = w.now()
        try:
            if cfg.plant == "unfenced-release":
                released = bool(await w.call(c, "source", lambda: w.release(None)))
                await lease.release()  # (its own bookkeeping; the grant is already gone)
            else:
                released = await lease.release()
        except FencedError:
            released = False
        w.record(c.name, "release", lock=LOCK, token=token.value, released=released, sent=sent)


def next_entry(data: bytes | None, token: FencingToken) -> tuple[int, bytes]:
    """The register a client read (``data``: a JSON list of ``[token, value]``, or empty)
    with its next entry appended under ``token``: the value it writes, and the register."""
    entries = json.loads(data) if data else []
    value: int = entries[-1][1] + 1 if entries else 1
    entries.append([token.value, value])
    return value, json.dumps(entries, separators=(",", ":")).encode()


async def _round(w: _World, c: _Client, token: FencingToken, lease: Any) -> None:
    cfg, res = w.cfg, w.resource
    try:
        data = await w.call(c, "resource", lambda: res.read(token))
    except StaleTokenError:
        w.record(c.name, "read", lock=LOCK, token=token.value, ok=False)
        return
    except BackendUnavailable:
        w.record(c.name, "error", lock=LOCK, token=token.value, step="read")
        return
    value, blob = next_entry(data, token)
    w.record(c.name, "read", lock=LOCK, token=token.value, ok=True, value=value - 1)
    await asyncio.sleep(w.rng.uniform(0, cfg.ttl / 4))  # think
    # A resource whose write is several steps sends each as a message; a stall lands before
    # the last (as the check kit's worker stalls).
    steps = (
        list(res.write_steps(token, blob))  # type: ignore[attr-defined]
        if w.split_writes
        else [lambda: res.write(token, blob)]
    )
    for one in steps[:-1]:
        try:
            await w.call(c, "resource", one)
        except (StaleTokenError, BackendUnavailable) as exc:
            # (no answer is not a refusal: the current holder refused is a violation)
            w.record(
                c.name, "write", lock=LOCK, token=token.value, value=value,
                ok=False if isinstance(exc, StaleTokenError) else None, sent=w.now(),
            )  # fmt: skip
            return
    await stall_point(w, c, token)
    sent = w.now()
    ok: bool | None
    try:
        await w.call(c, "resource", steps[-1])
        ok = True
    except StaleTokenError:
        ok = False
    except BackendUnavailable:
        ok = None  # (it may land later: the checkers treat it as unknown)
    w.record(c.name, "write", lock=LOCK, token=token.value, value=value, ok=ok, sent=sent)


async def _nemesis(w: _World, clients: list[_Client], tasks: list[asyncio.Task[None]]) -> None:
    cfg, rng = w.cfg, w.rng
    serial = len(clients)
    async for kind, i in deal(w, ("pause", "stall", "crash", "source", "resource"), clients):
        c = clients[i]
        w.record(
            "nemesis",
            "nemesis",
            kind=kind,
            victim=c.name if kind in ("pause", "stall", "crash") else kind,
        )
        run = functools.partial(_client_loop, w, rounds=cfg.rounds)
        struck, serial = client_fault(w, kind, clients, tasks, i, serial, run)
        if not struck:  # the resource
            w.resource_up = False
            w.loop.call_later(rng.uniform(0.2, 1.0) * cfg.ttl, _restart_resource, w)


async def deal(
    w: _World, kinds: Sequence[str], clients: list[_Client]
) -> AsyncIterator[tuple[str, int]]:
    """The nemesis's schedule in every system: every 0.3-1.5 ttls, a fault of ``kinds`` (those
    the run asks for) and the index of the client it is aimed at."""
    kinds = [k for k in kinds if k in w.faults]
    while kinds:
        await asyncio.sleep(w.rng.uniform(0.3, 1.5) * w.cfg.ttl)
        yield w.rng.choice(kinds), w.rng.randrange(len(clients))


def client_fault(
    w: _World,
    kind: str,
    clients: list[_Client],
    tasks: list[asyncio.Task[None]],
    i: int,
    serial: int,
    run: Callable[[_Client], Coroutine[Any, Any, None]],
) -> tuple[bool, int]:
    """A fault every system has, on client ``i`` or the source: ``pause``, ``stall``,
    ``crash`` (a new client, named after ``serial`` + 1, runs ``run``), ``source``. Whether
    ``kind`` was one of them, and the serial of the last client made."""
    rng, ttl, c = w.rng, w.cfg.ttl, clients[i]
    if kind == "pause":
        c.running.clear()
        w.loop.call_later(rng.uniform(1.2, 3.0) * ttl, c.running.set)
    elif kind == "stall":
        c.stall = True
    elif kind == "crash":
        c.dead = True
        tasks[i].cancel()
        serial += 1
        clients[i] = _Client(f"c{serial}", _running())
        tasks[i] = asyncio.ensure_future(run(clients[i]))
    elif kind == "source":
        w.source_up = False
        w.loop.call_later(rng.uniform(0.2, 2.0) * ttl, _restart_source, w)
    else:
        return False, serial
    return True, serial


async def until_done(tasks: list[asyncio.Task[None]]) -> None:
    """Until every task in ``tasks`` is done (a crashed client's is replaced in the list)."""
    while not all(t.done() for t in tasks):
        pending = [t for t in tasks if not t.done()]
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)


def _restart_source(w: _World) -> None:
    w.source_up = True
    if w.cfg.plant == "counter-not-fsynced":  # nothing it had was on disk
        w.counter, w.holder = 0, None


def _restart_resource(w: _World) -> None:
    w.resource_up = True
    if w.volatile:  # (what it kept only in memory is gone)
        w.resource.crash()  # type: ignore[attr-defined]


def _running() -> asyncio.Event:
    e = asyncio.Event()
    e.set()
    return e


async def _main(w: _World) -> None:
    clients = [_Client(f"c{i + 1}", _running()) for i in range(w.cfg.clients)]
    tasks = [asyncio.ensure_future(_client_loop(w, c, w.cfg.rounds)) for c in clients]
    nemesis = asyncio.ensure_future(_nemesis(w, clients, tasks))
    try:
        await until_done(tasks)
    finally:
        nemesis.cancel()
        for c in clients:
            c.running.set()
    w.errors += failures(tasks)


def failures(tasks: list[asyncio.Task[None]]) -> list[Violation]:
    """A client that raised what fenced never raises (not a FencedError it handles): a bug,
    reported with the seed like any violation rather than lost with its task."""
    out = []
    for t in tasks:
        if t.done() and not t.cancelled() and (exc := t.exception()) is not None:
            out.append(Violation("error", f"a client raised {type(exc).__name__}: {exc}"))
    return out


def simulate(cfg: Config) -> Outcome:
    """Run one seed; the same config gives the same trace, byte for byte.

    For the length of the run, fenced's clock (``fenced._core.clock.now``) in this process is the
    simulation's: run it in a process of its own (``fenced sim``, a test), not beside live
    leases of a real application."""
    if cfg.plant and cfg.plant not in SIM_PLANTS:
        raise ConfigurationError(
            f"no plant {cfg.plant!r} in the simulator: {', '.join(SIM_PLANTS)}"
        )
    if cfg.system not in SYSTEMS:
        raise ConfigurationError(f"no system {cfg.system!r} in the simulator: {', '.join(SYSTEMS)}")
    if cfg.plant and plant_system(cfg.plant) != cfg.system:
        raise ConfigurationError(
            f"the plant {cfg.plant!r} is in the {plant_system(cfg.plant)!r} system, not "
            f"{cfg.system!r}"
        )
    loop = VirtualLoop()
    # (A lost lease, a change left unfinished and completed: routine here.)
    quiet = [logging.getLogger(n) for n in ("fenced", "fenced.replicated", "fenced.server")]
    was_disabled = [q.disabled for q in quiet]
    for q in quiet:
        q.disabled = True
    real_now = _clock.now
    _clock.now = loop.time  # the lease core's clock is the simulation's
    w: _World | None = None
    try:
        w = _World(cfg, loop)
        stuck: list[Violation] = []
        group: Any = None
        if cfg.system in SYSTEM_RUNS:
            group = w.group = SYSTEM_RUNS[cfg.system](w)
        try:
            loop.run_until_complete(_main(w) if group is None else group.main())
        except Stuck as exc:
            stuck.append(
                Violation("stuck", f"the simulated system hung at {loop.time():.3f} s: {exc}")
            )
        if group is not None:
            return Outcome(cfg, stuck + group.check(), w.trace, loop.time())
        data, mark = w.resource.final()
        w.record("checker", "final", lock=LOCK, mark=mark, log=json.loads(data) if data else [])
        violations = stuck + w.errors + check_all(w.trace)
        return Outcome(cfg, violations, w.trace, loop.time())
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        with contextlib.suppress(Exception, Stuck):
            loop.run_until_complete(asyncio.sleep(0))
        loop.close()
        _clock.now = real_now
        for q, was in zip(quiet, was_disabled, strict=True):
            q.disabled = was
        if w is not None:
            if w.group is not None:
                w.group.close()
            else:
                w.resource.close()
            for key in [k for k in SimBackend._worlds if k.startswith(f"{id(w)}-")]:
                del SimBackend._worlds[key]
