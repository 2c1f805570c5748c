"""A parent that connects, takes a lock, forks, and checks what the child can do.

    python -m tests.workers.fork_scenario URL OPTIONS_JSON MODES SURVIVES(0|1)

MODES is ``sync``, ``async`` or both (``sync,async``). Run in a fresh process by the
conformance suite, so that nothing another test left in the test process (gRPC channels,
threads) is inherited by the child; each mode runs in a process of its own forked from it
before anything connected (only imports inherited), the modes at once: one interpreter
start and one ``import fenced`` for both. Exits 0 when the child
behaved (its own connection; the parent's grant stays the parent's; or, for a source that
does not survive fork, a ConfigurationError at once) and the parent's connection came
through; otherwise prints what went wrong and exits 1.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import fenced

BOUND = 60.0


def in_forked_child(child: Callable[[], None]) -> str:
    """Run ``child()`` in a real forked process; what went wrong there ("" if nothing)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        report = b""
        try:
            child()
        except BaseException:
            report = traceback.format_exc().encode() or b"failed"
        os.write(write_end, report or b"ok")
        os._exit(0)
    os.close(write_end)
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        done, _status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        select.select([read_end], [], [], 0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)
        return f"the forked child hung for {BOUND} s"
    with os.fdopen(read_end, "rb") as f:
        report = f.read().decode(errors="replace")
    return "" if report == "ok" else report or "the child died without a report"


def expect(error: type[BaseException], fn: Callable[[], Any], match: str = "") -> None:
    try:
        fn()
    except error as exc:
        assert match in str(exc), exc
        return
    raise AssertionError(f"{error.__name__} not raised")


def sync_scenario(url: str, options: dict[str, Any], survives: bool) -> str:
    name, other = f"f-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    with fenced.connect(url, **options) as locks:
        held = locks.lock(name, ttl=30)
        parent_token = held.acquire(timeout=30)

        def child() -> None:
            assert not held.held and held.remaining() == 0  # the parent's grant, not ours
            assert held.release() is False  # not ours: nothing is sent
            start = time.monotonic()
            if not survives:
                expect(
                    fenced.ConfigurationError,
                    lambda: locks.lock(other, ttl=5).acquire(timeout=1),
                    "fork",
                )
                expect(fenced.ConfigurationError, lambda: fenced.connect(url, **options), "fork")
                assert time.monotonic() - start < 5
                return
            # The first call opens the child's own connection (its own time bound: an acquire's
            # timeout would bound the open too), and sees the parent's grant.
            assert locks.status(name).token == parent_token
            # (a short wait: the claim is that the call returns, not how long it waits)
            expect(fenced.LockTimeout, lambda: locks.lock(name, ttl=5).acquire(timeout=0.2))
            assert time.monotonic() - start < 15
            with locks.lock(other, ttl=5, timeout=30) as lease:
                assert lease.held and lease.token.lock == other
            assert locks.status(name).token == parent_token
            locks.close()

        problem = in_forked_child(child)
        if problem:
            return problem
        # The parent's connection and grant came through untouched.
        assert held.held and held.renew() > 0
        assert locks.status(name).token == parent_token
        assert held.release() is True
    return ""


def async_scenario(url: str, options: dict[str, Any], survives: bool) -> str:
    name, other = f"f-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    loop = asyncio.new_event_loop()
    locks = fenced.connect_async(url, **options)
    try:
        loop.run_until_complete(locks.open())
        held = locks.lock(name, ttl=30)
        parent_token = loop.run_until_complete(held.acquire(timeout=30))

        async def in_child() -> None:
            assert not held.held
            assert await held.release() is False
            if not survives:
                try:
                    await locks.lock(other, ttl=5).acquire(timeout=1)
                except fenced.ConfigurationError as exc:
                    assert "fork" in str(exc)
                    return
                raise AssertionError("ConfigurationError not raised")
            assert (await locks.status(name)).token == parent_token  # (opens; see sync_scenario)
            try:
                await locks.lock(name, ttl=5).acquire(timeout=0.2)
            except fenced.LockTimeout:
                pass
            else:
                raise AssertionError("LockTimeout not raised")
            async with locks.lock(other, ttl=5, timeout=30) as lease:
                assert lease.held
            assert (await locks.status(name)).token == parent_token
            await locks.aclose()

        problem = in_forked_child(lambda: asyncio.run(in_child()))
        if problem:
            return problem
        assert loop.run_until_complete(held.renew()) > 0
        assert loop.run_until_complete(locks.status(name)).token == parent_token
        assert loop.run_until_complete(held.release()) is True
        return ""
    finally:
        loop.run_until_complete(locks.aclose())
        loop.close()


def run_mode(mode: str, url: str, options: dict[str, Any], survives: bool) -> str:
    """One mode's scenario; what went wrong ("" if nothing)."""
    scenario = sync_scenario if mode == "sync" else async_scenario
    try:
        return scenario(url, options, survives)
    except BaseException:
        return traceback.format_exc()


def main(argv: list[str]) -> int:
    url, options, modes, survives = argv[0], json.loads(argv[1]), argv[2], argv[3] == "1"
    children: list[tuple[str, int, int]] = []
    for mode in modes.split(","):
        read_end, write_end = os.pipe()
        pid = os.fork()  # (nothing connected yet: the mode's process starts as fresh as this one)
        if pid == 0:
            os.close(read_end)
            problem = run_mode(mode, url, options, survives)
            os.write(write_end, problem.encode(errors="replace"))
            os._exit(0)
        os.close(write_end)
        children.append((mode, pid, read_end))
    problems = []
    for mode, pid, read_end in children:
        with os.fdopen(read_end, "rb") as f:  # (to EOF: the mode's process has ended)
            report = f.read().decode(errors="replace")
        _, status = os.waitpid(pid, 0)
        if status != 0 and not report:
            report = f"its process ended with wait status {status}"
        if report:
            problems.append(f"[{mode}] {report}")
    if problems:
        print("\n".join(problems), flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
