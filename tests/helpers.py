"""Small test helpers: bounded waits on conditions (never a fixed sleep as synchronisation)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable


def unique_name(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def wait_for(
    predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` until truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


async def async_wait_for(
    predicate: Callable[[], Awaitable[object]], timeout: float = 10.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
