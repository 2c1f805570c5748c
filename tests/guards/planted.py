"""Planted broken SQL guards: ``<`` for ``<=``, in the fence-table and the row form.

Shared by the SQL guard's own tests and the guard conformance suite, so the bug is planted
in one place and re-planted in one place when the guards' SQL changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fenced import FencingToken
from fenced.guards._sql_plan import Dialect, FenceSQL, Stmt
from fenced.guards.sql import RowGuard, SQLGuard

__all__ = ["LessThanGuard", "LessThanRowGuard", "plant_lt", "planted_ride"]


def plant_lt(sql: str) -> str:
    """The fence comparison with ``<`` for ``<=``; refuses to plant nothing."""
    # (" <= ?3": SQLite's UPDATE, which accepts in place)
    planted = sql.replace(" <= CAST(", " < CAST(").replace(" <= ?3", " < ?3")
    if sql.startswith(("INSERT", "UPDATE")):  # (a refusal's read has no comparison)
        assert planted != sql, "the fence SQL changed: re-plant the bug"
    return planted


class LessThanGuard(SQLGuard):
    """Planted bug: ``<`` where ``<=`` is right, so the holder's second write is rejected."""

    def _fence_sql(self, d: Dialect) -> FenceSQL:
        real = super()._fence_sql(d)
        return dataclasses.replace(real, accept=plant_lt(real.accept), update=plant_lt(real.update))


class LessThanRowGuard(RowGuard):
    """Planted bug in the row form: ``<`` where ``<=`` is right."""

    def _statement(
        self, token: FencingToken, key: Any, values: Any, upsert: bool
    ) -> Callable[[Dialect], tuple[Stmt, tuple[Any, ...]]]:
        real = super()._statement(token, key, values, upsert)

        def statement(d: Dialect) -> tuple[Stmt, tuple[Any, ...]]:
            stmt, key_params = real(d)
            return Stmt(plant_lt(stmt.sql), stmt.params), key_params

        return statement


@contextlib.contextmanager
def planted_ride(
    monkeypatch: pytest.MonkeyPatch, ride_sql: Callable[[str], tuple[str, str]] | None
) -> Iterator[None]:
    """``transaction()``'s two statements on PostgreSQL (check, recheck) made by
    ``ride_sql(table)`` instead of ``pg_ride_sql`` (None: the real ones); the rendered
    messages are cached, so emptied before and after."""
    from fenced.guards import _sql_driver

    if ride_sql is None:
        yield
        return
    monkeypatch.setattr(_sql_driver, "pg_ride_sql", ride_sql)
    _sql_driver._ride_first.cache_clear()
    _sql_driver._ride_last.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        _sql_driver._ride_first.cache_clear()
        _sql_driver._ride_last.cache_clear()
