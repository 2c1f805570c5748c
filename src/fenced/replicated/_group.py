"""The replicated group: configurations in the token source, the writer, reads, reconfiguration.

Written once, as asyncio; :mod:`fenced.replicated` drives it from sync code through the
connection's private loop. See docs/replicated.md for the protocol and its invariants.

**Configuration.** A record in the token source (``locks.swap_record``) named after the group
holds ``{"members": [...], "base": E-1, "id": ...}``; its version is the configuration's
**epoch**. A change is a compare-and-set from the version it was derived from, so changes
are totally ordered, and each is built from its predecessor (``base``).

**Changing it** (:meth:`AsyncGroup.reconfigure`), from epoch E to E+1:

1. every member kept is fenced at epoch E+1 (it refuses epoch E from now on), in a step that
   requires it to be at E already — all must be reached, and at least one kept member must
   be at E: it holds every write acknowledged so far. A member below E lost its state (it
   came back empty): it is never counted as holding anything, and gets a copy in step 3;
2. members removed are fenced too when they can be reached (best effort);
3. each member added, and each kept member that lost its state, gets the state of a kept
   member at E (state transfer), at epoch E+1, in place of anything it held (what it took
   while outside the configuration is forgotten);
4. the record is swapped from E to E+1.

A write acknowledged at epoch E was accepted by *every* member of E (write-all), so a kept
member at E, once fenced at E+1, holds all of them, and so does a member it was copied to. No
write at epoch E can be acknowledged after step 1 (a kept member refuses it). Every member of
configuration E is at epoch E or above (the first configuration's members are raised to 1
before it is made), unless it lost its state: so writes, fences and repairs at E carry
``since=E`` and such a member refuses them, and reads do not count it.

**Writing** (:class:`AsyncWriter`), under a lease with token T: fence every member at (T, E);
recover (every member gets, per key, the newest item any member holds); then each write goes
to every member and is acknowledged only when all accepted. A member that cannot be reached
is removed by a reconfiguration first (``on_failure="remove"``) or the write fails.

**Reading** (:meth:`AsyncGroup.read`) asks every member of the current configuration and
returns the newest item; members behind it get it first (read repair, as ABD), so no later
read can return an older value. That is what makes reads linearizable although a write in
flight may have reached only some members.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Final, TypeVar

from .._core import clock as _clock
from .._core.errors import (
    BackendUnavailable,
    ChangeRefusedError,
    ConfigurationError,
    CorruptMarkError,
    FencedError,
    InvalidTokenError,
    MemberBehindError,
    RecordConflict,
    ReplicationError,
    StaleEpochError,
    StaleTokenError,
)
from .._core.lease import AsyncLease, AsyncLocks
from .._core.names import GROUP_RECORDS
from .._core.token import FencingToken, validate_lock_name
from ._members import Item, Member, Snapshot, as_member, stamp, stamp_token

__all__ = ["RECORD_PREFIX", "AsyncGroup", "AsyncWriter", "Configuration", "MemberStatus"]

T = TypeVar("T")

logger = logging.getLogger("fenced.replicated")

RECORD_PREFIX: Final = GROUP_RECORDS  # (one place for the names fenced keeps at a source)
_SETTLE: Final = 0.05  # first pause before looking again at a change in progress
_CLOSE_BOUND: Final = 2.0  # seconds aclose() waits for the members' own closes, all together


@dataclasses.dataclass(frozen=True, slots=True)
class Configuration:
    """One configuration of a group: its ``epoch`` (the record's version) and ``members``.
    ``base`` is the epoch it was derived from (always ``epoch - 1``)."""

    epoch: int
    members: tuple[str, ...]
    base: int = 0
    id: str = ""

    def encode(self) -> str:
        return json.dumps(
            {"members": list(self.members), "base": self.base, "id": self.id},
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, epoch: int, text: str, group: str) -> Configuration:
        try:
            data = json.loads(text)
            members = tuple(str(m) for m in data["members"])
            base, ident = int(data["base"]), str(data.get("id", ""))
        except (ValueError, KeyError, TypeError) as exc:
            # Fail closed: a configuration nobody can read names no members to write to.
            raise CorruptMarkError(f"group {group}", f"configuration record: {exc}") from None
        return cls(epoch, members, base, ident)


@dataclasses.dataclass(frozen=True, slots=True)
class MemberStatus:
    """What ``group.status()`` reports of one member."""

    name: str
    in_configuration: bool
    reachable: bool
    token: int | None = None
    epoch: int | None = None
    keys: int | None = None
    error: str | None = None
    behind: bool = False
    """Its epoch mark is below the configuration's: it lost its state (restarted empty,
    flushed) and counts for nothing until a reconfiguration copies the data to it."""


class AsyncGroup:
    """A group of replicas of one data set, fenced by the lock ``name`` (see the module doc).

    ``members``: name -> a guard (``RedisGuard``, ``EtcdGuard``, ``SQLGuard(...).fencer(connect)``)
    or a :class:`~fenced.replicated.Member`; the names every process uses for the same replica
    must agree. The first configuration, made when the group is first used, has them all.
    ``on_failure``: ``"remove"`` (a member that fails a write is removed by reconfiguration
    before the write is acknowledged) or ``"fail"`` (the write fails). ``min_members``: a
    configuration never gets smaller. ``timeout``: seconds for each call to a member, and for a
    whole operation to settle while the configuration changes under it.
    """

    def __init__(
        self,
        name: str,
        source: AsyncLocks,
        members: Mapping[str, Any],
        *,
        on_failure: str = "remove",
        min_members: int = 1,
        timeout: float = 10.0,
    ) -> None:
        self.name = validate_lock_name(name)
        if on_failure not in ("remove", "fail"):
            raise ConfigurationError(f"on_failure is 'remove' or 'fail', not {on_failure!r}")
        if isinstance(min_members, bool) or not isinstance(min_members, int) or min_members < 1:
            raise ConfigurationError(f"min_members is an int >= 1, not {min_members!r}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigurationError(f"timeout is a number of seconds > 0, not {timeout!r}")
        if not members:
            raise ConfigurationError("a group needs at least one member")
        self.source = source
        self.on_failure = on_failure
        self.min_members = min_members
        self.timeout = float(timeout)
        self.record = RECORD_PREFIX + self.name
        self._members: dict[str, Member] = {}
        for member_name, spec in members.items():
            self._check_member_name(member_name)
            self._members[member_name] = as_member(spec, self.name)
        self._initial = tuple(members)
        # Closing: the member calls in flight (stopped by aclose), and the one close that
        # every aclose() awaits (a second, or one after an interrupted first, ends it).
        self._calls: set[asyncio.Future[Any]] = set()
        self._closing = False
        self._close_task: asyncio.Future[None] | None = None
        self.observed: list[Configuration] = []
        """Every configuration this process has read or installed, in order (for checkers)."""
        # Closed with its connection: closed first, the members' connections and threads
        # stayed open (the connection's loop, where they would close, is gone by then). On
        # a closed connection, BackendUnavailable (the members made above have opened
        # nothing yet: they connect on first use).
        source.close_with(self)

    @staticmethod
    def _check_member_name(name: object) -> None:
        if not isinstance(name, str) or not name or len(name) > 100 or not name.isprintable():
            raise ConfigurationError(f"a member name is a short printable str, not {name!r}")

    def member(self, name: str) -> Member:
        try:
            return self._members[name]
        except KeyError:
            raise ConfigurationError(
                f"member {name!r} of group {self.name!r} is in the configuration, but this "
                f"process was not given it (members= has {sorted(self._members)})"
            ) from None

    def add_member(self, name: str, spec: Any) -> None:
        """Tell this process how to reach ``name`` (a member another process added)."""
        self._check_member_name(name)
        self._members[name] = as_member(spec, self.name)

    # -- calls to members, bounded -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closing:
            raise BackendUnavailable(f"group {self.name!r} is closed")

    async def _bounded(self, aw: Awaitable[T], what: str) -> T:
        """``aw`` (a call to a member) within ``timeout``; stopped by :meth:`aclose`."""
        if self._closing:
            if inspect.iscoroutine(aw):
                aw.close()  # (never started: no "never awaited" warning)
            self._check_open()
        call = asyncio.ensure_future(aw)
        self._calls.add(call)
        try:
            async with asyncio.timeout(self.timeout):
                return await call
        except TimeoutError:
            raise BackendUnavailable(f"{what}: no answer within {self.timeout} s") from None
        except asyncio.CancelledError:
            # Stopped by aclose (the call, not its caller, was cancelled): say so, typed.
            current = asyncio.current_task()
            if self._closing and call.cancelled() and not (current and current.cancelling()):
                raise BackendUnavailable(
                    f"group {self.name!r} was closed while {what} had not answered"
                ) from None
            raise
        finally:
            self._calls.discard(call)

    async def _fence(
        self, names: Iterable[str], token: FencingToken | None, epoch: int, *, since: int
    ) -> tuple[dict[str, BaseException], dict[str, BaseException]] | None:
        """Fence the members named with ``token`` at ``epoch`` (each refusing one below
        ``since``). None if one is at a later epoch already (another change got further);
        a member refusing the token raises its :class:`StaleTokenError`; else the members
        behind (:class:`MemberBehindError`: they lost their state), and those that failed
        otherwise, each with its error."""
        outcomes = await self._each(names, functools.partial(_apply, token, epoch, [], since=since))
        failed = {n: e for n, e in outcomes.items() if isinstance(e, BaseException)}
        if any(isinstance(e, StaleEpochError) for e in failed.values()):
            return None
        for e in failed.values():
            if isinstance(e, StaleTokenError):
                raise e
        behind: dict[str, BaseException] = {
            n: e for n, e in failed.items() if isinstance(e, MemberBehindError)
        }
        return behind, {n: e for n, e in failed.items() if n not in behind}

    async def _each(
        self, names: Iterable[str], call: Callable[[str, Member], Awaitable[T]]
    ) -> dict[str, T | BaseException]:
        """``call`` on every member named, in parallel; each outcome or error."""
        names = list(names)

        async def one(n: str) -> T:
            return await self._bounded(call(n, self.member(n)), f"member {n!r}")

        results = await asyncio.gather(*(one(n) for n in names), return_exceptions=True)
        self._check_open()  # (closed meanwhile: that, not each member's "closed", is the error)
        out: dict[str, T | BaseException] = {}
        for n, r in zip(names, results, strict=True):
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r  # (CancelledError, KeyboardInterrupt)
            out[n] = r
        return out

    # -- configurations --------------------------------------------------------------------

    async def configuration(self) -> Configuration:
        """The current configuration (the first is made, with every member given, if none)."""
        while True:
            self._check_open()
            record = await self.source.read_record(self.record)
            if record is not None:
                cfg = Configuration.decode(record.version, record.value, self.name)
                self._observe(cfg)
                return cfg
            first = Configuration(1, self._initial, 0, secrets.token_hex(8))
            # Every member of configuration E is at epoch E or above unless it lost its state;
            # so the first one's members are raised to 1 before it exists, and one that comes
            # back empty later (epoch 0) is told apart from one that holds the writes.
            raised = await self._each(first.members, functools.partial(_apply, None, 1, []))
            if all(isinstance(r, BaseException) for r in raised.values()):
                failed = {n: r for n, r in raised.items() if isinstance(r, BaseException)}
                raise ReplicationError(
                    f"group {self.name!r}: cannot make the first configuration, no member "
                    f"answered: {_first(failed)}",
                    failed,
                )
            if await self._install(first, 0) is not None:
                return first

    def _observe(self, cfg: Configuration) -> None:
        if not self.observed or self.observed[-1].epoch != cfg.epoch:
            self.observed.append(cfg)

    async def _install(self, cfg: Configuration, version: int) -> Configuration | None:
        """Swap the record from ``version`` to ``cfg``; None if another change came first."""
        try:
            await self.source.swap_record(self.record, version, cfg.encode())
        except RecordConflict:
            # A lost reply to our own swap looks the same: the id tells.
            record = await self.source.read_record(self.record)
            if record is None or record.version != cfg.epoch:
                return None
            if Configuration.decode(record.version, record.value, self.name).id != cfg.id:
                return None
        self._observe(cfg)
        logger.info("group %s: configuration %d: %s", self.name, cfg.epoch, list(cfg.members))
        return cfg

    async def reconfigure(
        self,
        *,
        add: Mapping[str, Any] | Iterable[str] = (),
        remove: Iterable[str] = (),
        token: FencingToken | None = None,
        base: Configuration | None = None,
        fence_removed: bool = True,
    ) -> Configuration:
        """Move to a new configuration: the current members, less ``remove``, plus ``add``
        (names, or name -> guard for members this process does not know yet). See the module
        doc for the steps. ``token``: the caller's lock token (a writer's), raised on the
        members with the epoch; None for an operator. ``base``: change only from this
        configuration (else from the current one, read first). ``fence_removed``: tell the
        members removed (False when they are removed because they did not answer). Raises
        :class:`~fenced.ConfigurationError` if no current member would stay, and
        :class:`~fenced.ReplicationError` if a member that stays cannot be fenced.
        """
        if isinstance(add, Mapping):
            for n, spec in add.items():
                self.add_member(n, spec)
        adding = list(add)
        removing = set(remove)
        deadline = _clock.now() + self.timeout
        while True:
            cfg = base if base is not None else await self.configuration()
            new = self._plan(cfg, adding, removing)
            result = await self._change(cfg, new, token, fence_removed)
            if result is not None:
                return result
            if base is not None:
                raise StaleEpochError(
                    f"group {self.name!r} changed from configuration {base.epoch} meanwhile"
                )
            if _clock.now() >= deadline:
                raise StaleEpochError(f"group {self.name!r} kept changing while reconfiguring")

    def _plan(self, cfg: Configuration, adding: Sequence[str], removing: set[str]) -> list[str]:
        unknown = removing - set(cfg.members)
        if unknown:
            raise ConfigurationError(
                f"not members of group {self.name!r} (configuration {cfg.epoch}): {sorted(unknown)}"
            )
        new = [m for m in cfg.members if m not in removing]
        new += [m for m in adding if m not in new]
        for m in adding:
            self.member(m)
        if not any(m in cfg.members for m in new):
            raise ConfigurationError(
                f"a new configuration of {self.name!r} must keep a member of the current one "
                "(only they are known to hold every acknowledged write)"
            )
        if len(new) < self.min_members:
            raise ChangeRefusedError(
                f"group {self.name!r} would have {len(new)} members, below min_members="
                f"{self.min_members}"
            )
        return new

    async def _change(
        self,
        cfg: Configuration,
        new: list[str],
        token: FencingToken | None,
        fence_removed: bool = True,
    ) -> Configuration | None:
        epoch = cfg.epoch + 1
        kept = [m for m in new if m in cfg.members]
        added = [m for m in new if m not in cfg.members]
        removed = [m for m in cfg.members if m not in new]
        # A kept member must be at this configuration's epoch already: one below it was never
        # fenced in it (it came back empty) and is refused, in the same atomic step, rather
        # than raised into the next configuration as if it held the writes.
        fenced = await self._fence(kept, token, epoch, since=cfg.epoch)
        if fenced is None:
            return None  # another change got further: start again from the record
        behind, failed = fenced
        if failed:
            raise ReplicationError(
                f"group {self.name!r}: members {sorted(failed)} cannot be fenced for "
                f"configuration {epoch}; remove them too",
                failed,
            )
        holders = [m for m in kept if m not in behind]
        if not holders:
            raise ChangeRefusedError(
                f"group {self.name!r}: no member of configuration {cfg.epoch} that stays "
                f"holds its writes: {sorted(behind)} lost their state (epoch marks below "
                f"{cfg.epoch}); bring back a member that holds them first",
                dict(behind),
            )
        # Removed members are told when they can be: a writer still using them is refused.
        # (Only one at this epoch already: a removed member that came back empty must not
        # be raised to the new epoch, which a concurrent change keeping it would count.)
        if fence_removed:
            await self._each(removed, functools.partial(_apply, None, epoch, [], since=cfg.epoch))
        # Members added, and kept members that lost their state, get a copy of a holder's.
        copy_to = added + [m for m in kept if m in behind]
        if copy_to:
            if behind:
                logger.warning(
                    "group %s: %s lost their state; copying the data to them from %s",
                    self.name,
                    sorted(behind),
                    holders[0],
                )
            snap = await self._bounded(self.member(holders[0]).read(None), f"member {holders[0]!r}")
            carry = self._fence_token(snap, [token])
            items = list(snap.items.values())
            loaded = await self._each(
                copy_to, functools.partial(_apply, carry, epoch, items, reset=True)
            )
            bad = {n: e for n, e in loaded.items() if isinstance(e, BaseException)}
            if any(isinstance(e, StaleEpochError) for e in bad.values()):
                return None
            if bad:
                raise ReplicationError(
                    f"group {self.name!r}: cannot copy the data to {sorted(bad)} under "
                    f"{carry!r}: {_first(bad)}",
                    bad,
                )
        return await self._install(
            Configuration(epoch, tuple(new), cfg.epoch, secrets.token_hex(8)), cfg.epoch
        )

    async def _settle(self, cfg: Configuration, seen_epoch: int, attempt: int) -> None:
        """A member is at a later epoch than the record: a change is under way. Wait for it;
        if it stays unfinished (its maker died between fencing and the swap), finish it with
        the same members, so the group cannot stay stuck."""
        await asyncio.sleep(min(_SETTLE * (2**attempt), 0.5))
        if attempt >= 6:
            current = await self.configuration()
            if current.epoch == cfg.epoch and seen_epoch > cfg.epoch:
                logger.warning(
                    "group %s: a change to epoch %d was left unfinished; completing it",
                    self.name,
                    seen_epoch,
                )
                with contextlib.suppress(FencedError):
                    await self._change(current, list(current.members), None)

    # -- reads -----------------------------------------------------------------------------

    async def read(self, key: str) -> bytes | None:
        """The value of ``key`` (None: never written, or deleted), linearizable: it asks every
        member of the current configuration, and brings any member behind the newest value up
        to it before returning (read repair, under the current fence: the holder's token each
        member kept with its mark). A member that lost its state (its epoch mark below the
        configuration's) is not counted, nor repaired. Raises
        :class:`~fenced.ReplicationError` if a member cannot be reached (remove it with
        :meth:`reconfigure`)."""
        item = await self.read_item(key)
        return None if item is None else item.value

    async def read_item(self, key: str, token: FencingToken | None = None) -> Item | None:
        """:meth:`read`, as the item (its stamp too). ``token``: the caller's lock token (a
        writer's), one more the repair may present."""
        _check_key(key)
        deadline = _clock.now() + self.timeout
        attempt = 0
        while True:
            cfg = await self.configuration()
            snaps = await self._each(cfg.members, lambda n, m: m.read([key]))
            failed = {n: s for n, s in snaps.items() if isinstance(s, BaseException)}
            if failed:
                raise ReplicationError(
                    f"group {self.name!r}: cannot read {sorted(failed)}: {_first(failed)}",
                    failed,
                )
            got: dict[str, Snapshot] = {n: s for n, s in snaps.items() if isinstance(s, Snapshot)}
            ahead = max(s.epoch for s in got.values())
            if ahead > cfg.epoch:
                if _clock.now() >= deadline:
                    raise StaleEpochError(
                        f"group {self.name!r}: configuration {cfg.epoch} kept being changed "
                        f"while reading (a member is at epoch {ahead})"
                    )
                await self._settle(cfg, ahead, attempt)
                attempt += 1
                continue
            # A member below the configuration's epoch was never fenced in it (it lost its
            # state): neither what it holds nor what it lacks counts, and it is not repaired
            # (it refuses: a reconfiguration copies the data to it).
            current = {n: s for n, s in got.items() if s.epoch >= cfg.epoch}
            if not current:
                raise ReplicationError(
                    f"group {self.name!r}: every member of configuration {cfg.epoch} lost its "
                    f"state (epoch marks {sorted(s.epoch for s in got.values())})",
                    {},
                )
            items = [s.items[key] for s in current.values() if key in s.items]
            if not items:
                return None
            best = max(items, key=lambda i: i.stamp)
            behind = [
                n
                for n, s in current.items()
                if key not in s.items or s.items[key].stamp < best.stamp
            ]
            if not behind:
                return best
            refused = await self._repair(cfg, best, behind, current, token)
            if not refused:
                return best
            if _clock.now() >= deadline:
                what = (
                    f"group {self.name!r}: read of {key!r}: {sorted(refused)} kept refusing "
                    f"the repair with its newest value (written under token "
                    f"{stamp_token(best.stamp)}) for {self.timeout} s: {_first(refused)}"
                )
                if all(isinstance(e, StaleEpochError) for e in refused.values()):
                    raise StaleEpochError(what)
                raise ReplicationError(what, refused)
            # A newer holder or configuration came between the read and the repair.
            await asyncio.sleep(min(_SETTLE * (2**attempt), 0.5))
            attempt += 1

    def _fence_token(
        self, snap: Snapshot, known: Iterable[FencingToken | None]
    ) -> FencingToken | None:
        """The token to present at a member (whose state is ``snap``) for a repair or a state
        transfer, which copy writes already made rather than make new ones: the current
        fence's own. That is the holder's token the member kept with its mark (signed, if it
        was: only the token source signs, and it is presented as it was granted), else the
        highest of ``known`` (the caller's, other members' holders) at or above its mark.
        Failing both (the mark was raised by a plain guard's fence, or before holders were
        kept), the mark's value unsigned: a guard that verifies signatures refuses it, and
        the caller says so."""
        held = snap.holder_token(self.name)
        if held is not None:
            return held
        usable = [t for t in known if t is not None and t.value >= snap.token]
        if usable:
            return max(usable, key=lambda t: (t.value, t.signature is not None))
        return FencingToken(self.name, snap.token) if snap.token else None

    async def _repair(
        self,
        cfg: Configuration,
        best: Item,
        behind: list[str],
        current: Mapping[str, Snapshot],
        token: FencingToken | None,
    ) -> dict[str, BaseException]:
        """Write ``best`` (with its own stamp) to the members behind, under the current fence
        (its writer may be long gone, its token below the marks): the item is already on a
        member of this configuration, so this copies a write, as the next holder's recovery
        would. Returns the refusals (a newer writer or configuration came: read again)."""
        known = [token, *(s.holder_token(self.name) for s in current.values())]
        writer = FencingToken(self.name, stamp_token(best.stamp))

        def one(n: str, m: Member) -> Awaitable[None]:
            tok = self._fence_token(current[n], known) or writer
            return _apply(tok, cfg.epoch, [best], n, m, since=cfg.epoch)

        done = await self._each(behind, one)
        bad = {n: e for n, e in done.items() if isinstance(e, BaseException)}
        if not bad:
            return {}
        for n, e in bad.items():
            if isinstance(e, InvalidTokenError):
                raise ReplicationError(
                    f"group {self.name!r}: cannot repair {n!r}: {type(e).__name__}: {e} (its "
                    f"guard verifies signatures, and no signed token at its mark "
                    f"{current[n].token} is known here: the mark was raised outside the group; "
                    "the next group.writer completes the write)",
                    bad,
                )
        if all(
            isinstance(e, (StaleTokenError, StaleEpochError, MemberBehindError))
            for e in bad.values()
        ):
            return bad
        raise ReplicationError(
            f"group {self.name!r}: cannot repair {sorted(bad)}: {_first(bad)}", bad
        )

    # -- status --------------------------------------------------------------------------

    async def status(self) -> tuple[Configuration, list[MemberStatus]]:
        """The configuration and what each member known here holds (marks, keys)."""
        cfg = await self.configuration()
        names = list(dict.fromkeys([*cfg.members, *self._members]))
        known = [n for n in names if n in self._members]
        snaps = await self._each(known, lambda n, m: m.read(None))
        out = []
        for n in names:
            s = snaps.get(n)
            if isinstance(s, Snapshot):
                live = sum(1 for i in s.items.values() if i.value is not None)
                member = n in cfg.members
                behind = member and s.epoch < cfg.epoch
                out.append(MemberStatus(n, member, True, s.token, s.epoch, live, behind=behind))
            else:
                error = "not given to this process" if s is None else f"{type(s).__name__}: {s}"
                out.append(MemberStatus(n, n in cfg.members, False, error=error))
        return cfg, out

    async def fence(self, token: FencingToken) -> Configuration:
        """Raise every member of the current configuration to ``token`` at the current epoch,
        so that every earlier holder is refused on all of them, whether or not this holder
        ever writes: what ``locks.lock(name, fence=[group])`` calls (fence on acquire).
        A member that lost its state refuses (its marks stay below) and counts as fenced: it
        takes no change at this epoch from anyone until a reconfiguration copies the data to
        it. :class:`~fenced.ReplicationError` if a member cannot be fenced (the others are),
        or if every member lost its state; :class:`~fenced.StaleTokenError` if a later holder
        fenced them first."""
        if not isinstance(token, FencingToken) or token.lock != self.name:
            raise ConfigurationError(
                f"group {self.name!r} is fenced by tokens of the lock {self.name!r}, not {token!r}"
            )
        for _ in range(10):
            cfg = await self.configuration()
            fenced = await self._fence(cfg.members, token, cfg.epoch, since=cfg.epoch)
            if fenced is None:
                continue  # a change is under way: fence its members instead
            # A member that lost its state refuses every change at this epoch, from any
            # holder, until a reconfiguration copies the data to it: as good as fenced.
            behind, failed = fenced
            if behind and len(behind) == len(cfg.members):
                raise ReplicationError(
                    f"group {self.name!r}: every member of configuration {cfg.epoch} lost "
                    f"its state: {_first(behind)}",
                    behind,
                )
            if failed:
                raise ReplicationError(
                    f"group {self.name!r}: members {sorted(failed)} cannot be fenced with "
                    f"{token}: {_first(failed)}",
                    failed,
                )
            return cfg
        raise ReplicationError(
            f"group {self.name!r}: the configuration kept changing while fencing with {token}",
            {},
        )

    async def writer(self, lease: AsyncLease) -> AsyncWriter:
        """A writer for the holder of ``lease`` (of the lock named like the group), ready: every
        member fenced with the lease's token and brought up to date (see :class:`AsyncWriter`)."""
        w = AsyncWriter(self, lease)
        await w.establish()
        return w

    async def aclose(self) -> None:
        """Close the members' own connections (the guards given stay the caller's).

        Safe while other tasks (or, through :class:`~fenced.replicated.Group`, other
        threads) use the group: from the moment it begins, every call raises
        :class:`~fenced.BackendUnavailable` ("closed"), and the member calls in flight are
        stopped (their callers get the same at once; a write so stopped was not
        acknowledged, as any write that raises). The members close all at once, within
        2 s in all: one that does not (a member hung) is named in a warning on the
        ``fenced.replicated`` logger, and left. A second close, at the same time or after
        an interrupted one, waits for the same close to end; closing never raises for a
        member (it is often called on the way out of an error).
        """
        if self._close_task is None:
            self._closing = True
            for call in list(self._calls):
                call.cancel()
            self._close_task = asyncio.ensure_future(self._close_members())
        # Shielded: a close interrupted (cancelled, a timeout around it) goes on to its end.
        await asyncio.shield(self._close_task)

    async def _close_members(self) -> None:
        closes = {asyncio.ensure_future(m.aclose()): n for n, m in self._members.items()}
        if not closes:
            return
        done, pending = await asyncio.wait(closes, timeout=_CLOSE_BOUND)
        for task in pending:
            task.cancel()
        failed = {closes[t]: t.exception() for t in done if not t.cancelled() and t.exception()}
        for task in pending:
            failed[closes[task]] = TimeoutError(f"no answer within {_CLOSE_BOUND:g} s")
        if failed:
            logger.warning(
                "group %s: closing: %d member(s) could not be closed (their connections may "
                "stay open until the process ends): %s",
                self.name,
                len(failed),
                "; ".join(f"{n!r}: {type(e).__name__}: {e}" for n, e in sorted(failed.items())),
            )


class AsyncWriter:
    """Writes of one lease holder to every member of the group's current configuration.

    Made by :meth:`AsyncGroup.writer`, which has fenced every member with the lease's token
    (a paused earlier holder is refused on all of them from then on, whether or not this
    writer ever writes there) and recovered them. One write at a time: each is acknowledged
    only once every member of the configuration accepted it. A write that raises was not
    acknowledged; :class:`~fenced.StaleTokenError` means a later holder exists.
    """

    def __init__(self, group: AsyncGroup, lease: AsyncLease) -> None:
        if lease.name != group.name:
            raise ConfigurationError(
                f"group {group.name!r} is fenced by the lock {group.name!r}, not {lease.name!r}"
            )
        self.group = group
        self.token = lease.token
        self._seq = 0
        self._cfg: Configuration | None = None
        self._lock = asyncio.Lock()
        self.acknowledged = 0

    @property
    def configuration(self) -> Configuration | None:
        return self._cfg

    @property
    def seq(self) -> int:
        """The sequence number of this writer's latest write: its item's stamp is
        ``stamp(token.value, seq)``, and the next write's is one more."""
        return self._seq

    async def establish(self) -> Configuration:
        """Fence every member of the current configuration with this writer's token, remove
        (or fail on) members that cannot be reached, and give every member the newest item of
        each key that any member holds."""
        g = self.group
        deadline = _clock.now() + g.timeout
        attempt = 0
        while True:
            cfg = await g.configuration()
            fenced = await g._each(
                cfg.members, functools.partial(_apply, self.token, cfg.epoch, [], since=cfg.epoch)
            )
            retry = await self._handle(cfg, fenced, attempt, deadline)
            if retry:
                attempt += 1
                continue
            snaps = await g._each(cfg.members, lambda n, m: m.read(None))
            retry = await self._handle(cfg, snaps, attempt, deadline)
            if retry:
                attempt += 1
                continue
            # (A member that lost its state after the fence is refused by the fill below.)
            got = [s for s in snaps.values() if isinstance(s, Snapshot) and s.epoch >= cfg.epoch]
            newest: dict[str, Item] = {}
            for s in got:
                for item in s.items.values():
                    held = newest.get(item.key)
                    if held is None or held.stamp < item.stamp:
                        newest[item.key] = item
            todo: dict[str, list[Item]] = {}
            for n, snap in snaps.items():
                if isinstance(snap, Snapshot):  # (_handle raised or retried for errors)
                    todo[n] = [
                        i
                        for k, i in newest.items()
                        if k not in snap.items or snap.items[k].stamp < i.stamp
                    ]
            # A stamp carries its writer's token: ours must sort above all of them.
            self._seq = max(
                [self._seq]
                + [
                    int(i.stamp[19:])
                    for i in newest.values()
                    if stamp_token(i.stamp) == self.token.value
                ]
            )
            filled = await g._each(
                [n for n in todo if todo[n]],
                functools.partial(_apply_each, self.token, cfg.epoch, todo),
            )
            retry = await self._handle(cfg, filled, attempt, deadline)
            if retry:
                attempt += 1
                continue
            self._cfg = cfg
            return cfg

    async def _handle(
        self,
        cfg: Configuration,
        outcomes: Mapping[str, object],
        attempt: int,
        deadline: float,
    ) -> bool:
        """Act on the members' refusals and failures: True to start over, False if all went
        well; raise if this writer is fenced off or cannot go on."""
        g = self.group
        errors = {n: e for n, e in outcomes.items() if isinstance(e, BaseException)}
        if not errors:
            return False
        for e in errors.values():
            if isinstance(e, StaleTokenError):
                raise e  # a later holder fenced this member: this writer is done
        if _clock.now() >= deadline:
            raise ReplicationError(
                f"group {g.name!r}: no settled configuration within {g.timeout} s: "
                f"{_first(errors)}",
                dict(errors),
            )
        stale = [e for e in errors.values() if isinstance(e, StaleEpochError)]
        if stale:
            await g._settle(cfg, _epoch_in(stale[0], cfg.epoch + 1), attempt)
            return True
        unreachable = {n: e for n, e in errors.items() if _unreachable(e)}
        behind = {n: e for n, e in errors.items() if isinstance(e, MemberBehindError)}
        for n, e in errors.items():
            if n not in unreachable and n not in behind:
                raise e  # a corrupt mark, another lock's resource...: fail closed
        if unreachable and g.on_failure != "remove":
            raise ReplicationError(
                f"group {g.name!r}: members {sorted(unreachable)} failed: {_first(unreachable)}",
                dict(unreachable),
            )
        # A new configuration without the members that failed; members that lost their state
        # stay, and get a copy of the data of one that holds it (never counted as holders).
        try:
            await g.reconfigure(remove=unreachable, token=self.token, base=cfg, fence_removed=False)
        except StaleEpochError:
            pass  # someone else changed it first: start over from the record
        except (ConfigurationError, ReplicationError) as exc:
            raise ReplicationError(
                f"group {g.name!r}: members {sorted(errors)} failed and the configuration "
                f"cannot be changed around them ({exc}): {_first(errors)}",
                dict(errors),
            ) from exc
        return True

    async def _write(self, items: Callable[[], list[Item]]) -> None:
        async with self._lock:
            g = self.group
            self._seq += 1
            batch = items()
            deadline = _clock.now() + g.timeout
            attempt = 0
            while True:
                cfg = self._cfg
                if cfg is None:
                    cfg = await self.establish()
                done = await g._each(
                    cfg.members,
                    functools.partial(_apply, self.token, cfg.epoch, batch, since=cfg.epoch),
                )
                if not await self._handle(cfg, done, attempt, deadline):
                    self.acknowledged += 1
                    return
                attempt += 1
                # The configuration changed (or a member was removed): fence and recover the
                # new one, then send the same write again (its stamp makes that idempotent).
                self._cfg = None

    async def set(self, key: str, value: bytes | str) -> None:
        """Write ``key = value`` to every member; return once all accepted (acknowledged)."""
        _check_key(key)
        data = value.encode() if isinstance(value, str) else value
        if not isinstance(data, bytes):
            raise ConfigurationError(f"a value is bytes or str, not {type(value).__name__}")
        await self._write(lambda: [Item(key, stamp(self.token.value, self._seq), data)])

    async def delete(self, key: str) -> None:
        """Delete ``key`` on every member (acknowledged as :meth:`set`)."""
        _check_key(key)
        await self._write(lambda: [Item(key, stamp(self.token.value, self._seq), None)])

    async def read(self, key: str) -> bytes | None:
        """:meth:`AsyncGroup.read` (a holder reads as anyone does: from every member; its
        token is one a read repair may present)."""
        _check_key(key)
        item = await self.group.read_item(key, self.token)
        return None if item is None else item.value


def _check_key(key: object) -> None:
    if not isinstance(key, str) or not key or len(key) > 1000 or "\0" in key:
        raise ConfigurationError(f"a key is a non-empty str (at most 1000, no NUL), not {key!r}")


def _first(errors: Mapping[str, BaseException]) -> str:
    name, exc = next(iter(errors.items()))
    return f"{name}: {type(exc).__name__}: {exc}"


def _epoch_in(exc: StaleEpochError, default: int) -> int:
    return exc.found if exc.found is not None else default


def _unreachable(exc: BaseException) -> bool:
    """A member that did not answer (as opposed to one that refused)."""
    return isinstance(exc, BackendUnavailable) or not isinstance(exc, FencedError)


_TAKES_SINCE: dict[type, bool] = {}


def _takes_since(member: Member) -> bool:
    """Whether ``member.apply`` takes ``since`` (a Member written before it existed does not:
    it works, without the refusal of a member that came back empty)."""
    kind = type(member)
    known = _TAKES_SINCE.get(kind)
    if known is None:
        try:
            params = list(inspect.signature(member.apply).parameters.values())
        except (TypeError, ValueError):
            params = []
        known = any(p.name == "since" or p.kind is p.VAR_KEYWORD for p in params)
        _TAKES_SINCE[kind] = known
    return known


def _apply(
    token: FencingToken | None,
    epoch: int,
    items: Sequence[Item],
    name: str,
    member: Member,
    *,
    reset: bool = False,
    since: int = 0,
) -> Awaitable[None]:
    if since and _takes_since(member):
        return member.apply(token, epoch, items, reset=reset, since=since)
    return member.apply(token, epoch, items, reset=reset)


def _apply_each(
    token: FencingToken | None,
    epoch: int,
    items: Mapping[str, Sequence[Item]],
    name: str,
    member: Member,
) -> Awaitable[None]:
    return _apply(token, epoch, items[name], name, member, since=epoch)
