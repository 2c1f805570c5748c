"""Deterministic simulation of fencing (``fenced sim``): fenced's real lease core and guard
(``system="lease"``), its real replicated group on members behind real SQL guards
(``system="group"``), or ``fenced serve``'s real grant bookkeeping in several gateways
(``system="gateway"``), on a virtual-time event loop, with a simulated token source and network,
every choice drawn from one seed — the same seed gives the same run, byte for byte. See
docs/testing.md.
"""

from __future__ import annotations

from typing import Any

from ..._core.backend import register_backend
from . import _group  # noqa: F401  (the "group" system adds its run to SYSTEM_RUNS)
from ._loop import Stuck, VirtualLoop
from ._run import SeedsResult, run_seeds, shrink
from ._world import (
    FAULTS,
    SIM_PLANTS,
    SYSTEM_RUNS,
    SYSTEMS,
    Config,
    Outcome,
    SimBackend,
    plant_system,
    simulate,
)

register_backend("sim", SimBackend)
register_backend("simgw", "fenced.testing.sim._gateways:GwSourceBackend")


def _gateway_run(w: Any) -> Any:
    from ._gateways import GatewayRun  # (it imports the server: only when asked for)

    return GatewayRun(w)


SYSTEM_RUNS["gateway"] = _gateway_run

__all__ = [
    "FAULTS",
    "SIM_PLANTS",
    "SYSTEMS",
    "Config",
    "Outcome",
    "SeedsResult",
    "Stuck",
    "VirtualLoop",
    "plant_system",
    "run_seeds",
    "shrink",
    "simulate",
]
