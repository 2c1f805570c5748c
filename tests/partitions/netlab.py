"""What every test of tests/partitions/ shares: skipped (with the reason) where network
namespaces cannot be made, and run on one xdist worker (the ``netns`` group: the labs'
namespaces and bridges are the machine's)."""

from __future__ import annotations

import pytest

from fenced.testing import netns

REASON = netns.unavailable()
MARKS = [
    pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
    pytest.mark.xdist_group("netns"),
]
