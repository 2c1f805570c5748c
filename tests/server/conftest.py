"""A ``fenced serve`` process on an SQLite source of the test's own, for the server's tests
(a module with other needs defines its own ``source`` or ``server``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced.testing.servers import FencedServer


@pytest.fixture
def source(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'locks.db'}"


@pytest.fixture
def server(source: str) -> Iterator[FencedServer]:
    with FencedServer(source) as s:
        yield s  # type: ignore[misc]
