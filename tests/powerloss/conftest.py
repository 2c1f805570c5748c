"""A power-loss filesystem per test (skipped, with the reason, where FUSE is missing)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced.testing.powerloss import PowerLossMount, unavailable


@pytest.fixture
def powerloss(tmp_path: Path) -> Iterator[PowerLossMount]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    with PowerLossMount(tmp_path / "mnt", tmp_path / "disk.pickle") as mount:
        yield mount
