"""The check kit's history and checkers (issue 13; the campaign runner, nemeses schedule and
report build on these).

A *history* is what workers saw, one JSON object a line, appended and fsynced as it happens
(:class:`History`). *Checkers* are pure functions over a history; each returns the
violations it found (:func:`check_all` runs them all). See docs/testing.md.
"""

from __future__ import annotations

from ._campaign import NEMESES, PLANTS, CampaignResult, run_campaign
from ._checkers import (
    CHECKERS,
    Violation,
    acknowledged_writes_survive,
    check_all,
    grants_do_not_overlap_in_grant_order,
    mark_is_the_highest_accepted,
    no_lost_update,
    no_token_granted_twice,
    tokens_never_decrease_in_acceptance_order,
)
from ._history import Event, History, read_history

__all__ = [
    "CHECKERS",
    "NEMESES",
    "PLANTS",
    "CampaignResult",
    "Event",
    "History",
    "Violation",
    "acknowledged_writes_survive",
    "check_all",
    "grants_do_not_overlap_in_grant_order",
    "mark_is_the_highest_accepted",
    "no_lost_update",
    "no_token_granted_twice",
    "read_history",
    "run_campaign",
    "tokens_never_decrease_in_acceptance_order",
]
