"""The names fenced keeps at a token source for itself, in one place: ``fenced serve`` refuses
clients the first kind and authorizes the records of the others by the lock they belong to
(``fenced.server._app``)."""

from __future__ import annotations

from typing import Final

__all__ = ["ELECTION_RECORDS", "GROUP_RECORDS", "SERVER_NAMES"]

SERVER_NAMES: Final = "_fenced-"
"""``fenced serve``'s own locks and records (its expiry claims, its readiness look): no client
acquires, renews, releases or swaps one through its API."""
ELECTION_RECORDS: Final = "fenced.elect/"
"""``fenced elect NAME`` keeps its last leader (host, pids: what the next leader's fence
command stops) in the record ``fenced.elect/NAME``."""
GROUP_RECORDS: Final = "group/"
"""A replicated group ``NAME`` keeps its configuration in the record ``group/NAME``."""
