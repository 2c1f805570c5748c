"""Deterministic simulation of fencing (``fenced sim``): fenced's real lease core and guard on
a virtual-time event loop, a simulated token source, network and resource, every choice
drawn from one seed — the same seed gives the same run, byte for byte. See docs/testing.md.
"""

from __future__ import annotations

from ..._backend import register_backend
from ._loop import Stuck, VirtualLoop
from ._run import SeedsResult, run_seeds, shrink
from ._world import FAULTS, SIM_PLANTS, Config, Outcome, SimBackend, simulate

register_backend("sim", SimBackend)

__all__ = [
    "FAULTS",
    "SIM_PLANTS",
    "Config",
    "Outcome",
    "SeedsResult",
    "Stuck",
    "VirtualLoop",
    "run_seeds",
    "shrink",
    "simulate",
]
