"""The one shape every guard is written in: a sans-I/O *plan* and thin sync/async drivers.

A plan is a generator. It yields each request it needs sent to the resource (an SQL
statement, an etcd transaction, ...), receives the reply (or has the driver's mapped error
thrown in, so it can decide what a failure means), and finally returns its answer or raises a
fenced error. All the deciding — what to send, whether a reply means accepted, stale, another
lock's resource or a damaged mark — lives in the plan, written once. A driver only sends:

    value = drive(plan, send, map_error)          # send(request) -> reply
    value = await adrive(plan, asend, map_error)  # await asend(request) -> reply

``map_error(exc)`` turns a client library's exception into a fenced error (thrown into the
plan, with the native error as ``__cause__``) or returns None (the native error propagates
unchanged, the plan is closed); with ``map_error=None`` every error is thrown into the plan as
it is (the AWS plans read the service's error codes there). A guard for a new resource writes its plan and one ``send``
per client library (sync, async); see ``_sql_plan``/``_sql_driver`` and ``etcd``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar, runtime_checkable

from .._core.errors import ConfigurationError, CorruptMarkError, FencedError
from .._core.token import MAX_TOKEN

__all__ = [
    "STAMP_WIDTH",
    "GroupGuard",
    "GroupItem",
    "GroupState",
    "GuardPlan",
    "adrive",
    "check_group_change",
    "checked_group_state",
    "drive",
    "step",
]

T = TypeVar("T")
Req = TypeVar("Req")
Rep = TypeVar("Rep")

GuardPlan = Generator[Req, Rep, T]
MapError = Callable[[BaseException], FencedError | None]


class Done:
    """The plan's answer (a sentinel wrapper, so that any request type can be yielded)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def step(
    plan: Generator[Any, Any, Any],
    reply: Any,
    exc: BaseException | None,
    map_error: MapError | None,
    *,
    first: bool = False,
) -> Any:
    """Advance ``plan`` with one outcome; return its next request, or :class:`Done`."""
    try:
        if exc is None:
            return next(plan) if first else plan.send(reply)
        if map_error is None:
            return plan.throw(exc)
        mapped = map_error(exc)
        if mapped is None:
            plan.close()
            raise exc
        mapped.__cause__ = exc  # as 'raise mapped from exc'
        return plan.throw(mapped)
    except StopIteration as stop:
        return Done(stop.value)


def drive(
    plan: Generator[Any, Any, T], send: Callable[[Any], Any], map_error: MapError | None
) -> T:
    """Run ``plan`` with a blocking ``send``."""
    # (The step() machine inlined for replies, the hot path of every guarded write.)
    try:
        request = next(plan)
        while True:
            try:
                reply = send(request)
            except Exception as exc:
                request = step(plan, None, exc, map_error)
                if isinstance(request, Done):
                    return request.value  # type: ignore[no-any-return]
                continue
            request = plan.send(reply)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


async def adrive(
    plan: Generator[Any, Any, T],
    send: Callable[[Any], Awaitable[Any]],
    map_error: MapError | None,
) -> T:
    """Run ``plan`` with an async ``send``."""
    request = step(plan, None, None, map_error, first=True)
    while not isinstance(request, Done):
        try:
            reply, err = await send(request), None
        except Exception as exc:
            reply, err = None, exc
        request = step(plan, reply, err, map_error)
    value: T = request.value
    return value


# -- what a replicated group's member asks of a guard (fenced.replicated) -------------------
# Each guard that can hold a member offers ``apply_group(token=, group=, epoch=, items=,
# reset=, since=)`` (one atomic step: the lock token against the guard's own mark, the epoch
# against the group's epoch mark, both raised, the newer items written; or nothing) and
# ``read_group(group=, keys=) -> GroupState`` (SQLGuard, RedisGuard, EtcdGuard and their async
# twins). These are the types they share.

GroupItem = tuple[str, str, "bytes | None"]
"""One item of a group's change: key, stamp (text that orders writes), value (None: deleted)."""


@runtime_checkable
class GroupGuard(Protocol):
    """A guard that can hold a replicated group's member: the group contract above. Its
    calls are awaited on an async guard and blocking on a sync one; ``SQLGuard``'s take the
    connection first (and its awaited twins are ``aapply_group``/``aread_group``)."""

    @property
    def resource(self) -> str: ...

    def apply_group(self, *args: Any, **kwargs: Any) -> Any: ...

    def read_group(self, *args: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class GroupState:
    """What a guard's ``read_group`` read, at one instant: both marks, the holder, the items."""

    token: int  # the lock mark (0: never fenced)
    epoch: int  # the epoch mark (0: never)
    holder: str | None  # the text of the last token a change presented (None: none kept)
    items: list[GroupItem]


STAMP_WIDTH: Final = 38
"""A stamp is (token, sequence) as 19 + 19 digits: members compare stamps as text (Lua, SQL,
etcd), which is their order only at this one width ("9" sorts after "10")."""


def check_group_change(
    group: object, epoch: object, since: object, items: object
) -> list[GroupItem]:
    """The arguments of an ``apply_group``, checked before anything is sent: a non-empty group
    name, ``epoch`` and ``since`` ints in 0 .. 2^63-1, items ``(key, 38-digit stamp, bytes |
    None)``. A bad one is a :class:`~fenced.ConfigurationError` (a float epoch stored would
    damage the member's mark for good; a short stamp would sort wrong)."""
    if not isinstance(group, str) or not group:
        raise ConfigurationError(f"a group name is a non-empty str, not {group!r}")
    for name, value in (("epoch", epoch), ("since", since)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKEN:
            raise ConfigurationError(f"{name} is an int from 0 to 2**63-1, not {value!r}")
    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
        raise ConfigurationError(f"group items are a list of (key, stamp, value): {items!r}")
    checked: list[GroupItem] = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 3:
            key, stamp, value = item
            if (
                isinstance(key, str)
                and key
                and isinstance(stamp, str)
                and len(stamp) == STAMP_WIDTH
                and stamp.isascii()
                and stamp.isdigit()
                and (value is None or isinstance(value, bytes))
            ):
                checked.append((key, stamp, value))
                continue
        raise ConfigurationError(
            f"a group item is (key: str, stamp: {STAMP_WIDTH} digits, value: bytes | None), "
            f"not {item!r}"[:300]
        )
    return checked


def checked_group_state(state: GroupState, resource: str) -> GroupState:
    """``state`` as read, if every item's stamp is 38 digits whose token (the first 19) is at
    most the lock mark: every item is written by a change whose token, raised into the mark in
    the same step, is at least its stamp's. Else the member is damaged (a hand edit, a restore
    of the data without its fence): :class:`~fenced.CorruptMarkError`. A stamp ahead of every
    writer would otherwise win every comparison: later writes acknowledged but skipped there,
    and the damaged value read and repaired onto every member."""
    for key, stamp, _ in state.items:
        if not (len(stamp) == STAMP_WIDTH and stamp.isascii() and stamp.isdigit()):
            raise CorruptMarkError(resource, f"group item {key[:40]!r}: stamp {stamp[:60]!r}")
        if int(stamp[: STAMP_WIDTH // 2]) > state.token:
            raise CorruptMarkError(
                resource,
                f"group item {key[:40]!r}: stamp {stamp!r} is ahead of the lock mark {state.token}",
            )
    return state
