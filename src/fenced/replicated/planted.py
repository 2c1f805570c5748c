"""Bugs planted in ``fenced.replicated``, each the omission of one step of the protocol, so
the tests can show that the group checkers catch it (a checker that cannot fail proves
nothing). Applied by name in a campaign's processes; never used outside tests.

They replace steps of the group's own code, so they live beside it (and change with it)
rather than reaching into its private methods from the check kit (issue 27).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from ._group import AsyncGroup, AsyncWriter, Configuration
from ._members import Item

__all__ = ["GROUP_PLANTS", "apply_plant", "plant_patches"]


async def _no_fence_establish(self: AsyncWriter) -> Configuration:
    # Takes the configuration and starts writing: no member is fenced with the new token
    # until its first write reaches it, and nothing is recovered.
    cfg = await self.group.configuration()
    self._cfg = cfg
    return cfg


async def _ack_before_all(self: AsyncWriter, items: Callable[[], list[Item]]) -> None:
    # Acknowledges once the first member of the configuration accepted.
    async with self._lock:
        self._seq += 1
        batch = items()
        cfg = self._cfg or await self.establish()
        first = cfg.members[0]
        await self.group.member(first).apply(self.token, cfg.epoch, batch)
        self.acknowledged += 1


async def _blind_install(self: AsyncGroup, cfg: Configuration, version: int) -> Configuration:
    # Swaps from whatever version the record has now, not the one the change was based on.
    record = await self.source.read_record(self.record)
    now = 0 if record is None else record.version
    await self.source.swap_record(self.record, now, cfg.encode())
    installed = Configuration(now + 1, cfg.members, cfg.base, cfg.id)
    self._observe(installed)
    return installed


def _no_overlap_plan(
    self: AsyncGroup, cfg: Configuration, adding: Any, removing: set[str]
) -> list[str]:
    new = [m for m in cfg.members if m not in removing]
    return new + [m for m in adding if m not in new]


_real_change = AsyncGroup._change


async def _no_overlap_change(
    self: AsyncGroup, cfg: Configuration, new: list[str], token: Any, fence_removed: bool = True
) -> Configuration | None:
    if any(m in cfg.members for m in new):
        return await _real_change(self, cfg, new, token, fence_removed)
    # Nothing kept: nothing to copy from, and the new members start empty.
    epoch = cfg.epoch + 1
    await self._each(new, lambda n, m: m.apply(None, epoch, []))
    return await self._install(
        Configuration(epoch, tuple(new), cfg.epoch, secrets.token_hex(8)), cfg.epoch
    )


GROUP_PLANTS: dict[str, str] = {
    "no-fence-on-takeover": "a new writer writes without fencing and recovering every member",
    "ack-before-all": "a write is acknowledged once one member accepted it",
    "blind-swap": "a configuration change swaps the record without checking its version",
    "no-overlap": "a new configuration may keep no member of the one before",
}


def plant_patches(name: str) -> list[tuple[Any, str, Any]]:
    """The (class, attribute, replacement) pairs that plant ``name`` (for ``setattr``, or a
    test's ``monkeypatch.setattr``, which puts them back)."""
    patches: dict[str, list[tuple[Any, str, Any]]] = {
        "no-fence-on-takeover": [(AsyncWriter, "establish", _no_fence_establish)],
        "ack-before-all": [(AsyncWriter, "_write", _ack_before_all)],
        "blind-swap": [(AsyncGroup, "_install", _blind_install)],
        "no-overlap": [
            (AsyncGroup, "_plan", _no_overlap_plan),
            (AsyncGroup, "_change", _no_overlap_change),
        ],
    }
    if name not in patches:
        raise ValueError(f"unknown group plant {name!r}; known: {', '.join(GROUP_PLANTS)}")
    return patches[name]


def apply_plant(name: str) -> None:
    for owner, attr, value in plant_patches(name):
        setattr(owner, attr, value)
