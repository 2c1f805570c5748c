"""The one back-off of fenced's retry loops (``fenced._core.backoff.Backoff``): doubling pauses up
to a cap, never past the caller's deadline, or none when a whole pause would not fit."""

from __future__ import annotations

import pytest

from fenced._core.backoff import Backoff


def test_doubles_up_to_the_cap() -> None:
    b = Backoff(0.05, 0.3)
    assert [b.next() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]


def test_never_past_the_deadline() -> None:
    b = Backoff(0.5, 1.0)
    assert b.next(0.2) == 0.2  # cut: the last attempt is made at the deadline
    assert b.next(0) is None  # no time left: give up
    assert b.next(-1.0) is None


def test_a_whole_pause_or_none() -> None:
    b = Backoff(0.5, 10.0)
    assert b.next(2.0, whole=True) == 0.5
    assert b.next(1.0, whole=True) is None  # 1.0 s of pause would wake at the deadline
    assert b.next(5.0, whole=True) == 2.0


@pytest.mark.parametrize(("first", "cap"), [(0, 1), (-1, 1), (2, 1)])
def test_bad_bounds(first: float, cap: float) -> None:
    with pytest.raises(ValueError):
        Backoff(first, cap)
