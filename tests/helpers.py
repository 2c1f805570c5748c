"""Small test helpers: bounded waits on conditions (never a fixed sleep as synchronisation)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path


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


ROOT = Path(__file__).resolve().parent.parent


def spawn_python(code: str, *args: str) -> subprocess.Popen[str]:
    """A real client process running ``code`` (with fenced and the tests importable)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def read_line(proc: subprocess.Popen[str]) -> str:
    """The process's next line of output; fails the test (with its stderr) if it has none."""
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        assert proc.stderr is not None
        proc.kill()
        raise AssertionError(f"client process said nothing; stderr:\n{proc.stderr.read()}")
    return line
