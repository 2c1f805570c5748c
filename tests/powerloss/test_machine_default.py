"""The CLI's machine-wide default source (``/var/tmp/fenced/locks.db``, made by fenced) keeps
its counters through a power cut: the directory and file fenced makes must be durable names."""

from __future__ import annotations

import pytest

import fenced
from fenced._core.paths import machine_database
from fenced.testing.powerloss import PowerLossMount, unavailable
from tests.sources.envs.sqlite import read_counters

pytestmark = [
    pytest.mark.skipif(unavailable() is not None, reason=unavailable() or ""),
]


def test_the_machine_database_survives_the_cut(powerloss: PowerLossMount) -> None:
    directory = powerloss.mountpoint / "fenced"
    path = machine_database(str(directory))
    with fenced.connect(f"sqlite:///{path}") as locks:
        for _ in range(3):
            with locks.lock("nightly", ttl=5) as lease:
                last = lease.token.value
    powerloss.power_loss()
    assert read_counters(machine_database(str(directory))) == {"nightly": last}
    with fenced.connect(f"sqlite:///{path}") as locks, locks.lock("nightly", ttl=5) as lease:
        assert lease.token.value == last + 1  # (not 1 again)
