"""The one rule bounding a call to a token source (``fenced._core.backend.call_bound``): the
source's own per-call timeout, or an acquire's time left + 1 s if shorter; a blocking call's
own wait on top of either. HTTP, Redis and PostgreSQL all bound their calls with it."""

from __future__ import annotations

import pytest

from fenced._core import clock
from fenced._core.backend import LAST_TRY_GRACE, call_bound

NOW = 1000.0


@pytest.fixture(autouse=True)
def frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pure function of the clock: read at a fixed instant, so that bounds compare exactly.
    monkeypatch.setattr(clock, "now", lambda: NOW)


def test_without_a_deadline_the_own_timeout() -> None:
    assert call_bound(10.0, None, name="socket_timeout") == (10.0, "socket_timeout")
    assert call_bound(10.0, None, 3.0, name="request_timeout") == (13.0, "request_timeout")


def test_a_near_deadline_bounds_by_the_time_left_plus_a_second() -> None:
    assert call_bound(10.0, NOW + 2.0, name="command_timeout") == (
        3.0,
        "the acquire's timeout + 1 s",
    )
    assert LAST_TRY_GRACE == 1.0


def test_a_far_deadline_leaves_the_own_timeout() -> None:
    assert call_bound(10.0, NOW + 60.0, name="socket_timeout") == (10.0, "socket_timeout")
    # (equal: the own timeout, the one the user set, is named)
    assert call_bound(3.0, NOW + 2.0, name="socket_timeout") == (3.0, "socket_timeout")


def test_a_passed_deadline_still_gives_the_last_try_its_second() -> None:
    assert call_bound(10.0, NOW - 5.0, name="socket_timeout") == (
        1.0,
        "the acquire's timeout + 1 s",
    )


def test_a_blocking_call_waits_its_own_wait_on_top() -> None:
    # A 4 s BLPOP with 5 s left: 4 s of wait, then 1 s left + 1 s for the reply.
    assert call_bound(10.0, NOW + 5.0, 4.0, name="socket_timeout") == (
        6.0,
        "the acquire's timeout + 1 s",
    )
    # Far from the deadline: the wait, then the own timeout.
    assert call_bound(10.0, NOW + 60.0, 4.0, name="socket_timeout") == (14.0, "socket_timeout")


@pytest.mark.parametrize("left", [-3.0, 0.0, 0.5, 1.0, 2.0, 3.5, 100.0])
@pytest.mark.parametrize("after", [0.0, 0.5, 2.0, 4.0])
@pytest.mark.parametrize("own", [0.2, 0.5, 1.0, 1.5, 10.0])
def test_never_longer_than_the_own_timeout_nor_the_deadline_plus_a_second(
    own: float, after: float, left: float
) -> None:
    bound, what = call_bound(own, NOW + left, after, name="own")
    assert bound <= after + own  # a deadline only ever shortens a call
    assert bound <= max(left, after) + LAST_TRY_GRACE or what == "own"
    assert bound >= after + min(own, LAST_TRY_GRACE)  # the reply always gets its chance
