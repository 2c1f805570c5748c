"""The check kit: worker processes, nemeses, a history, checkers, a report (``fenced check``).

A *history* is what workers saw, one JSON object a line, appended and fsynced as it happens
(:class:`History`). *Checkers* are pure functions over a history; each returns the
violations it found (:func:`check_all` runs them all). See docs/testing.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._campaign import (
        ENGINES,
        NEMESES,
        PLANT_NEEDS,
        PLANTS,
        CampaignResult,
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
    from ._history import Event, History, read_history
    from ._plants import plant_role
    from ._resources import Resource, open_resource

# The names load on first use (PEP 562): a worker process of a campaign imports
# fenced.testing.check._worker, and `fenced --help` lists the plants, and neither needs the
# campaign machinery (about 100 ms of imports) that `from fenced.testing.check import X` loads.
_WHERE = {
    "ENGINES": "._campaign",
    "NEMESES": "._campaign",
    "PLANT_NEEDS": "._campaign",
    "PLANTS": "._campaign",
    "CampaignResult": "._campaign",
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
    "CampaignResult",
    "Event",
    "History",
    "Resource",
    "Violation",
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
    "tokens_never_decrease_in_acceptance_order",
]
