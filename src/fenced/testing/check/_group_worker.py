"""One process of a replicated-group campaign: a writer (takes the lock, increments a counter
through the group) or a reader. Run as ``python -m fenced.testing.check._group_worker CONFIG``.

Every step is appended to the campaign's history (``_history``: the kit's one schema, each
event fsynced), with :func:`fenced._core.clock.now` times, before and after it happens; a
process killed mid-step leaves an invocation without its completion, which the checkers treat
as an unknown outcome.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fenced
from fenced.replicated import AsyncGroup, Group, Item, Member, Snapshot

from ..._core import clock as _clock
from ...replicated.planted import apply_plant
from ._history import History


class ConfigLog:
    """Writes each configuration a process has seen to the history once (by epoch)."""

    def __init__(self, history: History) -> None:
        self.history = history
        self._seen: set[int] = set()

    def __call__(self, group: AsyncGroup) -> None:
        for c in group.observed:
            if c.epoch not in self._seen:
                self._seen.add(c.epoch)
                self.history.append(
                    "config", epoch=c.epoch, members=list(c.members), base=c.base, id=c.id
                )


class Traced:
    """A member that logs each change it is asked for, and its answer."""

    def __init__(self, name: str, inner: Member, history: History) -> None:
        self.name, self.inner, self.history = name, inner, history

    async def apply(
        self,
        token: Any,
        epoch: int,
        items: Sequence[Item],
        *,
        reset: bool = False,
        since: int = 0,
    ) -> None:
        start = _clock.now()
        ok: Any = True
        try:
            await self.inner.apply(token, epoch, items, reset=reset, since=since)
        except fenced.StaleTokenError:
            ok = "stale token"
            raise
        except fenced.StaleEpochError:
            ok = "stale epoch"
            raise
        except BaseException as exc:
            ok = f"error: {type(exc).__name__}"
            raise
        finally:
            self.history.append(
                "apply",
                member=self.name,
                token=None if token is None else token.value,
                epoch=epoch,
                stamps=[i.stamp for i in items],
                start=start,
                end=_clock.now(),
                ok=ok,
            )

    async def read(self, keys: Sequence[str] | None = None) -> Snapshot:
        return await self.inner.read(keys)

    async def aclose(self) -> None:
        await self.inner.aclose()


def make_members(specs: list[dict[str, Any]], group: str, timeout: float) -> dict[str, Any]:
    """The members the specs name, each opened by the guard registry from its URL (the
    grammar of ``fenced group --member``)."""
    from fenced.guards.registry import open_guard

    out: dict[str, Any] = {}
    for spec in specs:
        url = member_url(spec, timeout)
        if spec["kind"] == "sqlite":
            # (the campaign's replica files: made here, as a group member never makes one)
            sqlite3.connect(spec["path"]).close()
        out[spec["name"]] = open_guard(url, group, timeout=timeout).fence_target()
    return out


def member_url(spec: dict[str, Any], timeout: float) -> str:
    """The guard URL of a replica spec (``kind`` and its address)."""
    kind = spec["kind"]
    if kind == "redis":
        return f"redis://127.0.0.1:{spec['port']}"
    if kind == "postgresql":
        # A partitioned replica is found dead within the timeout, not the kernel's minutes.
        keepalive = (
            f"tcp_user_timeout={int(timeout * 1000)}"
            "&keepalives_idle=1&keepalives_interval=1&keepalives_count=2"
        )
        return f"{spec['url']}{'&' if '?' in spec['url'] else '?'}{keepalive}"
    if kind == "sqlite":
        return f"sqlite:///{Path(spec['path']).resolve()}"
    if kind == "etcd":
        return f"etcd://{spec['endpoint']}"
    raise SystemExit(f"unknown member kind {kind!r}")


def traced_group(
    locks: fenced.Locks, config: dict[str, Any], history: History
) -> tuple[Group, dict[str, Any]]:
    guards = make_members(config["members"], config["group"], config["timeout"])
    group = Group(config["group"], locks, guards, timeout=config["timeout"] * 2)
    for name in guards:  # (each member traced, through the group's own way to change one)
        group.aio.add_member(name, Traced(name, group.aio.member(name), history))
    return group, guards


def _stop_here(config: dict[str, Any], point: str, history: History) -> None:
    """Scenario hooks: stop this process (SIGSTOP) at a named point; the runner resumes it."""
    if point in config.get("stop_at", ()):
        history.append("stopped", at=point)
        os.kill(os.getpid(), signal.SIGSTOP)


def read(group: Group, history: History, key: str = "counter") -> tuple[bool, str | None]:
    ident = uuid.uuid4().hex
    history.append("invoke", id=ident, kind="read", key=key, start=_clock.now())
    try:
        raw = group.read(key)
    except fenced.FencedError as exc:
        history.append("complete", id=ident, ok=False, end=_clock.now(), error=str(exc))
        return False, None
    value = None if raw is None else raw.decode()
    history.append("complete", id=ident, ok=True, end=_clock.now(), value=value)
    return True, value


def writer(config: dict[str, Any], history: History) -> None:
    rng = random.Random(config["seed"])
    with fenced.connect(config["source"]) as locks:
        group, _ = traced_group(locks, config, history)
        configs = ConfigLog(history)
        rounds = 0
        while not os.path.exists(config["stop_file"]):
            if config.get("rounds") is not None and rounds >= config["rounds"]:
                break
            rounds += 1
            try:
                with locks.lock(config["group"], ttl=config["ttl"], timeout=5) as lease:
                    history.append("granted", token=lease.token.value)
                    w = group.writer(lease)
                    configs(group.aio)
                    for i in range(config["ops"]):
                        ok, value = read(group, history)
                        if not ok:
                            break
                        _stop_here(config, "after_read", history)
                        count = int(value.split(":", 1)[0]) + 1 if value else 1
                        new = f"{count}:{history.worker}:{rounds}.{i}"
                        ident = uuid.uuid4().hex
                        stamp_next = fenced.replicated.stamp(w.token.value, w.aio.seq + 1)
                        history.append(
                            "invoke",
                            id=ident,
                            kind="write",
                            key="counter",
                            value=new,
                            stamp=stamp_next,
                            token=w.token.value,
                            start=_clock.now(),
                        )
                        try:
                            w.set("counter", new)
                            outcome: Any = True
                        except fenced.FencedError as exc:
                            outcome = "unknown"  # it may be on some members
                            history.append("note", error=f"{type(exc).__name__}: {exc}")
                        history.append("complete", id=ident, ok=outcome, end=_clock.now())
                        configs(group.aio)
                        if outcome is not True:
                            break
                        time.sleep(rng.uniform(0, config.get("think", 0.02)))
            except fenced.FencedError as exc:
                history.append("note", error=f"{type(exc).__name__}: {exc}")
            configs(group.aio)
            time.sleep(rng.uniform(0, 0.05))


def reader(config: dict[str, Any], history: History) -> None:
    rng = random.Random(config["seed"])
    with fenced.connect(config["source"]) as locks:
        group, _ = traced_group(locks, config, history)
        configs = ConfigLog(history)
        while not os.path.exists(config["stop_file"]):
            read(group, history)
            configs(group.aio)
            time.sleep(rng.uniform(0, 0.05))


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    if config.get("plant"):
        apply_plant(config["plant"])
    history = History(config["history"], config["proc"])
    print("ready", flush=True)
    if config["role"] == "writer":
        writer(config, history)
    else:
        reader(config, history)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
