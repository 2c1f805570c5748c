"""The check kit: worker processes, nemeses, a history, checkers, a report (``fenced check``).

One :class:`Campaign` (setup → nemesis → teardown → judge) runs a :class:`Workload`: the
locks workload of ``fenced check`` (:func:`run_campaign`) or a replicated group's
(:func:`run_group_campaign`). A *history* is what every process saw, one JSON object a line in
one schema, appended and fsynced as it happens (:class:`History`, read back by
:func:`read_history`). *Checkers* are pure functions over a history; each returns the
violations it found (:func:`check_all` runs them all). A :class:`Resource` is what the
workers read and write under their token (the simulator's too). See docs/testing.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._campaign import (
        ENGINES,
        NEMESES,
        PLANT_NEEDS,
        PLANT_NEMESES,
        PLANTS,
        CampaignResult,
        LocksWorkload,
        default_nemeses,
        faketime_library,
        run_campaign,
    )
    from ._checkers import (
        CHECKERS,
        Violation,
        acknowledged_writes_survive,
        check_all,
        current_holder_is_served,
        grants_do_not_overlap_in_grant_order,
        mark_is_the_highest_accepted,
        no_lost_update,
        no_token_granted_twice,
        only_granted_tokens_accepted,
        tokens_never_decrease_in_acceptance_order,
    )
    from ._engine import Campaign, CampaignError, Fault, ResetError, Workload
    from ._group_campaign import GroupRun, GroupWorkload, run_group_campaign
    from ._history import Event, History, HistoryError, read_history
    from ._plants import plant_role
    from ._resources import Resource, SplitWrite, Volatile, open_resource
    from ._zygote import start_fork_server

# The names load on first use (PEP 562): a worker process of a campaign imports
# fenced.testing.check._worker, and `fenced --help` lists the plants, and neither needs the
# campaign machinery (about 100 ms of imports) that `from fenced.testing.check import X` loads.
_WHERE = {
    "ENGINES": "._campaign",
    "NEMESES": "._campaign",
    "PLANT_NEEDS": "._campaign",
    "PLANT_NEMESES": "._campaign",
    "PLANTS": "._campaign",
    "CampaignResult": "._campaign",
    "LocksWorkload": "._campaign",
    "Campaign": "._engine",
    "CampaignError": "._engine",
    "Fault": "._engine",
    "ResetError": "._engine",
    "Workload": "._engine",
    "GroupRun": "._group_campaign",
    "GroupWorkload": "._group_campaign",
    "run_group_campaign": "._group_campaign",
    "HistoryError": "._history",
    "SplitWrite": "._resources",
    "Volatile": "._resources",
    "default_nemeses": "._campaign",
    "faketime_library": "._campaign",
    "run_campaign": "._campaign",
    "CHECKERS": "._checkers",
    "Violation": "._checkers",
    "acknowledged_writes_survive": "._checkers",
    "check_all": "._checkers",
    "current_holder_is_served": "._checkers",
    "grants_do_not_overlap_in_grant_order": "._checkers",
    "mark_is_the_highest_accepted": "._checkers",
    "no_lost_update": "._checkers",
    "no_token_granted_twice": "._checkers",
    "only_granted_tokens_accepted": "._checkers",
    "tokens_never_decrease_in_acceptance_order": "._checkers",
    "Event": "._history",
    "History": "._history",
    "read_history": "._history",
    "plant_role": "._plants",
    "Resource": "._resources",
    "open_resource": "._resources",
    "start_fork_server": "._zygote",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # (once: later lookups skip __getattr__)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "CHECKERS",
    "ENGINES",
    "NEMESES",
    "PLANTS",
    "PLANT_NEEDS",
    "PLANT_NEMESES",
    "Campaign",
    "CampaignError",
    "CampaignResult",
    "Event",
    "Fault",
    "GroupRun",
    "GroupWorkload",
    "History",
    "HistoryError",
    "LocksWorkload",
    "ResetError",
    "Resource",
    "SplitWrite",
    "Violation",
    "Volatile",
    "Workload",
    "acknowledged_writes_survive",
    "check_all",
    "current_holder_is_served",
    "default_nemeses",
    "faketime_library",
    "grants_do_not_overlap_in_grant_order",
    "mark_is_the_highest_accepted",
    "no_lost_update",
    "no_token_granted_twice",
    "only_granted_tokens_accepted",
    "open_resource",
    "plant_role",
    "read_history",
    "run_campaign",
    "run_group_campaign",
    "start_fork_server",
    "tokens_never_decrease_in_acceptance_order",
]
