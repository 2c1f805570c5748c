"""A lease's options are declared three times on purpose: ``AsyncLease(...)``, ``AsyncLocks.lock``
and ``Locks.lock`` each show them explicitly (``help()``, IDEs, the docs) rather than as
``**options``. This test is what keeps the three lists one: same names, order, kinds, defaults
and types (``on_lost`` aside: its callback is sync on ``Locks``)."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable

import fenced
from fenced import AsyncLease, AsyncLocks, Locks


def _options(fn: Callable[..., object]) -> list[tuple[str, object, object, object]]:
    hints = typing.get_type_hints(fn)
    params = list(inspect.signature(fn).parameters.values())
    start = next(i for i, p in enumerate(params) if p.name == "name") + 1
    return [
        (p.name, p.kind, p.default, None if p.name == "on_lost" else hints.get(p.name))
        for p in params[start:]
    ]


def test_the_lock_options_are_one_list_in_three_places() -> None:
    declared = _options(AsyncLease.__init__)
    assert [name for name, *_ in declared][:2] == ["ttl", "timeout"]
    assert _options(AsyncLocks.lock) == declared
    assert _options(Locks.lock) == declared
    assert Locks.lock is fenced.Locks.lock
