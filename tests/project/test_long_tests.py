"""tests/conftest.py's LONG_TESTS hands the suite's longest tests out first; a name that
matches nothing loses its place silently (the simulator's lease seeds, renamed, ran late in
every run until issue 28 §4). Every entry names a test file, and a test in it, that exist."""

from __future__ import annotations

import re

from tests.conftest import LONG_TESTS
from tests.helpers import ROOT


def test_every_long_test_names_a_test_that_exists() -> None:
    missing = []
    for prefix in LONG_TESTS:
        path, _, name = prefix.partition("::")
        file = ROOT / path
        if not file.is_file() or not re.search(
            rf"^(async )?def {re.escape(name)}", file.read_text(), re.M
        ):
            missing.append(prefix)
    assert missing == [], missing
