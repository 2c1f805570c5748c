"""``@locks.locked(name)``: a function run while holding a lock, sync and async."""

from __future__ import annotations

import pytest

import fenced


def test_a_decorated_function_runs_holding_the_lock_and_gets_its_token(memory_url: str) -> None:
    with fenced.connect(memory_url) as locks:
        seen: list[fenced.FencingToken] = []

        @locks.locked("nightly", ttl=5)
        def job(n: int, *, token: fenced.FencingToken) -> int:
            assert locks.status("nightly").token == token  # held, by this very grant
            seen.append(token)
            return n * 2

        assert job(21) == 42 and job(1) == 2
        assert [t.value for t in seen] == [1, 2]  # a new, higher token per call
        assert locks.status("nightly").holder is None  # released after each

        @locks.locked("plain")
        def no_token() -> str:
            return "ran"

        assert no_token() == "ran" and no_token.__name__ == "no_token"


def test_a_failing_function_releases_and_a_held_lock_times_out(memory_url: str) -> None:
    with fenced.connect(memory_url) as locks, fenced.connect(memory_url) as other:

        @locks.locked("x", ttl=5, timeout=0)
        def boom() -> None:
            raise ValueError("inside")

        with pytest.raises(ValueError, match="inside"):
            boom()
        assert locks.status("x").holder is None
        with other.lock("x", ttl=5):
            with pytest.raises(fenced.LockTimeout):
                boom()


def test_the_decorator_refuses_the_other_kind_of_function(memory_url: str) -> None:
    async def coroutine() -> None:
        pass

    def plain() -> None:
        pass

    with fenced.connect(memory_url) as locks:
        with pytest.raises(TypeError, match=r"AsyncLocks\.locked"):
            locks.locked("x")(coroutine)
    with pytest.raises(TypeError, match=r"Locks\.locked"):
        fenced.connect_async(memory_url).locked("x")(plain)  # type: ignore[arg-type]


async def test_async_decorator(memory_url: str) -> None:
    async with fenced.connect_async(memory_url) as locks:

        @locks.locked("nightly", ttl=5)
        async def job(token: fenced.FencingToken) -> str:
            assert (await locks.status("nightly")).token == token
            return str(token)

        assert await job() == "nightly:1"
        assert await job() == "nightly:2"
        assert (await locks.status("nightly")).holder is None
