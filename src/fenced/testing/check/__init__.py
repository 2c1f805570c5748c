"""The check kit: worker processes, nemeses, a history, checkers, a report (``fenced check``).

A *history* is what workers saw, one JSON object a line, appended and fsynced as it happens
(:class:`History`). *Checkers* are pure functions over a history; each returns the
violations it found (:func:`check_all` runs them all). See docs/testing.md.
"""

from __future__ import annotations

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
