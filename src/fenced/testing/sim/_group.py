"""The replicated group in the simulator (``fenced sim --system group``): fenced's real
:class:`~fenced.replicated.AsyncGroup` (configurations, writers, read repair, reconfiguration,
members that lost their state) in every client, on members that run the real
:class:`~fenced.guards.sql.SQLGuard`'s member transactions (what
:class:`~fenced.replicated.SQLMember` runs), each on an in-memory SQLite database, reached
through the simulated network; configurations are records in the simulated token source.

Faults, besides the clients' and the network's: ``resource`` (a member is down for a while,
then back with its data), ``wipe`` (a member crashes and comes back empty: its database is
gone), ``source``. An operator adds back members removed or behind now and then. At most one
member of the configuration has lost its state at a time (no system survives losing every
copy). The checkers, on what the clients saw and what the members accepted:

* ``lost-write``: a read returns the last write acknowledged before it began, or a newer one;
  so does a final read of every key, after the faults end;
* ``stale-write``: a write acknowledged with a token below one acknowledged before it was sent;
* ``member-order``: no member accepts a lower lock token, or a lower epoch, than one it accepted
  (since it last lost its state).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from typing import Any

from ..._core.errors import (
    ConfigurationError,
    FencedError,
)
from ..._core.lease import AsyncLocks
from ..._core.token import FencingToken
from ...guards.sql import SQLGuard
from ...replicated import (
    RECORD_PREFIX,
    AsyncGroup,
    Configuration,
    Item,
    Snapshot,
    stamp,
)
from ..check._checkers import Violation
from ._world import (
    LOCK,
    SYSTEM_RUNS,
    SimBackend,
    _Client,
    _running,
    _World,
    acquire,
    client_fault,
    deal,
    failures,
    stall_point,
    until_done,
)

__all__ = ["GroupRun"]

KEYS = ("x", "y")
GROUP_TIMEOUT = 3.0  # the group's bound on an operation settling (virtual seconds)


class _Replica:
    """One member's server: the SQL guard's member transactions (``SQLGuard.apply_group`` and
    ``read_group``, what a :class:`~fenced.replicated.SQLMember` runs), run when a message
    arrives, on the sim's own thread."""

    def __init__(self, run: GroupRun, name: str) -> None:
        self.run, self.name = run, name
        self.guard = SQLGuard(LOCK)
        self._conn: sqlite3.Connection | None = None
        self.accepted = (0, 0)  # the highest (token, epoch) it accepted since it lost its state

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = _memory_db()
            self.guard.install_group(conn)
            self._conn = conn
        return self._conn

    def apply(
        self,
        token: FencingToken | None,
        epoch: int,
        items: Sequence[Item],
        reset: bool,
        since: int,
    ) -> None:
        plant = self.run.w.cfg.plant
        if plant == "empty-member-counted":
            since = 0  # (the planted bug: the member never says it is behind)
        # (Planted: no lock fence, the change is applied whatever its token.)
        fence = None if plant == "member-unfenced" else token
        self.guard.apply_group(
            self._db(),
            token=fence,
            group=LOCK,
            epoch=epoch,
            items=[(i.key, i.stamp, i.value) for i in items],
            reset=reset,
            since=since,
        )
        self.run.accepted(self, 0 if token is None else token.value, epoch)

    def read(self, keys: Sequence[str] | None) -> Snapshot:
        state = self.guard.read_group(self._db(), group=LOCK, keys=keys)
        items = {k: Item(k, s, v) for k, s, v in state.items}
        return Snapshot(state.token, state.epoch, items, state.holder)

    def wipe(self) -> None:
        self.close()  # (an in-memory database: closing it loses everything)
        self.accepted = (0, 0)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def _memory_db() -> sqlite3.Connection:
    return sqlite3.connect(":memory:", isolation_level=None)


class _SimMember:
    """A client's connection to a member: each call one message each way."""

    def __init__(self, run: GroupRun, client: _Client, name: str) -> None:
        self.w, self.client, self.replica = run.w, client, run.replicas[name]

    async def apply(
        self,
        token: FencingToken | None,
        epoch: int,
        items: Sequence[Item],
        *,
        reset: bool = False,
        since: int = 0,
    ) -> None:
        if token is None and items:
            raise ConfigurationError("items are written only with a lock token")
        r = self.replica
        await self.w.call(self.client, r.name, lambda: r.apply(token, epoch, items, reset, since))

    async def read(self, keys: Sequence[str] | None = None) -> Snapshot:
        r = self.replica
        result: Snapshot = await self.w.call(self.client, r.name, lambda: r.read(keys))
        return result

    async def aclose(self) -> None:
        pass


class GroupRun:
    def __init__(self, w: _World) -> None:
        self.w = w
        count = w.rng.choice((2, 3))
        self.replicas = {n: _Replica(self, n) for n in (f"m{i + 1}" for i in range(count))}
        self.violations: list[Violation] = []
        self.tasks: list[asyncio.Task[None]] = []

    # -- what members accept ------------------------------------------------------------

    def accepted(self, r: _Replica, token: int, epoch: int) -> None:
        top_token, top_epoch = r.accepted
        if (token and token < top_token) or epoch < top_epoch:
            event = self.w.record(r.name, "accepted", token=token, epoch=epoch)
            self.violations.append(
                Violation(
                    "member-order",
                    f"member {r.name} accepted (token {token}, epoch {epoch}) after "
                    f"(token {top_token}, epoch {top_epoch})",
                    (event,),
                )
            )
        r.accepted = (max(token, top_token), max(epoch, top_epoch))

    def configuration(self) -> Configuration | None:
        record = self.w.records.get(RECORD_PREFIX + LOCK)
        return None if record is None else Configuration.decode(record.version, record.value, LOCK)

    # -- clients ------------------------------------------------------------------------

    def group(self, c: _Client) -> AsyncGroup:
        key = f"{id(self.w)}-{c.name}"
        SimBackend._worlds[key] = (self.w, c)
        members = {n: _SimMember(self, c, n) for n in self.replicas}
        return AsyncGroup(LOCK, AsyncLocks(f"sim://{key}"), members, timeout=GROUP_TIMEOUT)

    async def read(self, c: _Client, group: AsyncGroup, key: str, token: Any = None) -> None:
        sent = self.w.now()
        try:
            item = await group.read_item(key, token)
        except FencedError as exc:
            self.w.record(c.name, "error", step="read", key=key, error=type(exc).__name__)
            return
        self.w.record(c.name, "read", key=key, stamp=item.stamp if item else "", sent=sent)

    async def client(self, c: _Client) -> None:
        w, cfg = self.w, self.w.cfg
        group = self.group(c)
        locks = group.source
        for r in range(cfg.rounds):
            await c.running.wait()
            if w.rng.random() < 0.25:
                await self.read(c, group, w.rng.choice(KEYS))
                continue
            got = await acquire(w, c, locks, r)
            if got is None:
                continue
            lease, token = got
            w.record(c.name, "grant", token=token.value)
            try:
                writer = await group.writer(lease)
                for i in range(w.rng.randint(1, 3)):
                    key = w.rng.choice(KEYS)
                    await stall_point(w, c, token)  # (between two writes)
                    sent = w.now()
                    await writer.set(key, f"{token.value}.{r}.{i}")
                    done = stamp(token.value, writer.seq)
                    w.record(c.name, "ack", key=key, stamp=done, token=token.value, sent=sent)
                if w.rng.random() < 0.5:
                    await self.read(c, group, w.rng.choice(KEYS), token)
            except FencedError as exc:
                w.record(c.name, "error", step="write", token=token.value, error=type(exc).__name__)
            try:
                await lease.release()
            except FencedError:
                pass
            w.record(c.name, "release", token=token.value)

    async def operator(self) -> None:
        """Adds back, now and then, members removed or behind (as ``fenced group add``)."""
        w = self.w
        op = _Client("op", _running())
        group = self.group(op)
        while True:
            await asyncio.sleep(w.rng.uniform(1.0, 3.0) * w.cfg.ttl)
            try:
                _, members = await group.status()
                back = [
                    m.name for m in members if m.reachable and (m.behind or not m.in_configuration)
                ]
                if back:
                    w.record("op", "add", members=back)
                    await group.reconfigure(add=back)
            except FencedError as exc:
                w.record("op", "error", step="add", error=type(exc).__name__)

    # -- faults -------------------------------------------------------------------------

    def may_wipe(self, name: str) -> bool:
        """At most one member of the configuration without the data at a time."""
        cfg = self.configuration()
        if cfg is None:  # (unless the first one is being made: its members are raised first)
            return all(r.read([]).epoch == 0 for r in self.replicas.values())
        if name not in cfg.members:
            return True
        if len(cfg.members) < 2 or any(m in self.w.down for m in cfg.members):
            return False
        # Every member of it at its epoch, and none beyond: no member lost its state, and no
        # change is under way (one could have counted this member already, as it was).
        for m, r in self.replicas.items():
            try:
                epoch = r.read([]).epoch
            except FencedError:
                return False
            if epoch > cfg.epoch or (m in cfg.members and epoch < cfg.epoch):
                return False
        return True

    async def nemesis(self, clients: list[_Client]) -> None:
        w, cfg, rng = self.w, self.w.cfg, self.w.rng
        serial = len(clients)
        kinds = ("pause", "stall", "crash", "source", "resource", "wipe")
        async for kind, i in deal(w, kinds, clients):
            c = clients[i]
            member = rng.choice(sorted(self.replicas))
            if kind in ("resource", "wipe") and member in w.down:
                continue
            if kind == "wipe" and not self.may_wipe(member):
                continue
            victim = {"pause": c.name, "stall": c.name, "crash": c.name, "source": "source"}
            w.record("nemesis", "nemesis", kind=kind, victim=victim.get(kind, member))
            struck, serial = client_fault(w, kind, clients, self.tasks, i, serial, self.client)
            if not struck:  # a member
                w.down.add(member)
                if kind == "wipe":
                    self.replicas[member].wipe()
                w.loop.call_later(rng.uniform(0.2, 1.5) * cfg.ttl, w.down.discard, member)

    # -- the run ------------------------------------------------------------------------

    async def main(self) -> None:
        w = self.w
        clients = [_Client(f"c{i + 1}", _running()) for i in range(w.cfg.clients)]
        self.tasks = [asyncio.ensure_future(self.client(c)) for c in clients]
        background = [
            asyncio.ensure_future(self.nemesis(clients)),
            asyncio.ensure_future(self.operator()),
        ]
        try:
            await until_done(self.tasks)
        finally:
            for t in background:
                t.cancel()
            for c in clients:
                c.running.set()
        self.violations += failures(self.tasks)
        # The faults end: every member up (with what it kept), messages arrive; a last reader.
        w.down.clear()
        w.source_up = True
        w.faults = set()
        final = _Client("final", _running())
        group = self.group(final)
        for key in KEYS:
            sent = w.now()
            try:
                item = await group.read_item(key)
            except FencedError as exc:
                event = w.record("final", "error", step="read", key=key, error=f"{exc}")
                self.violations.append(
                    Violation("lost-write", f"the final read of {key!r} failed: {exc}", (event,))
                )
                continue
            w.record("final", "read", key=key, stamp=item.stamp if item else "", sent=sent)

    def check(self) -> list[Violation]:
        return self.violations + check_history(self.w.trace)

    def close(self) -> None:
        for r in self.replicas.values():
            r.close()


def check_history(trace: list[dict[str, Any]]) -> list[Violation]:
    """The group's checkers on what the clients saw (the first violation of each)."""
    acks = [e for e in trace if e["op"] == "ack"]
    return _lost_write(trace, acks) + _stale_write(acks)


def _lost_write(trace: list[dict[str, Any]], acks: list[dict[str, Any]]) -> list[Violation]:
    for read in (e for e in trace if e["op"] == "read"):
        before = [a for a in acks if a["key"] == read["key"] and a["mono"] < read["sent"]]
        if not before:
            continue
        last = max(before, key=lambda a: a["stamp"])
        if last["stamp"] > read["stamp"]:  # (stamps sort as their text; "" is nothing)
            got = read["stamp"] or "nothing"
            return [
                Violation(
                    "lost-write",
                    f"{read['worker']}'s read of {read['key']!r} returned {got}, older than "
                    f"the write {last['worker']} had acknowledged before it (stamp "
                    f"{last['stamp']})",
                    (last, read),
                )
            ]
    return []


def _stale_write(acks: list[dict[str, Any]]) -> list[Violation]:
    for a in acks:
        newer = [b for b in acks if b["token"] > a["token"] and b["mono"] < a["sent"]]
        if newer:
            return [
                Violation(
                    "stale-write",
                    f"{a['worker']}'s write with token {a['token']} was acknowledged, sent "
                    f"after {newer[0]['worker']}'s with token {newer[0]['token']} was",
                    (newer[0], a),
                )
            ]
    return []


SYSTEM_RUNS["group"] = GroupRun
