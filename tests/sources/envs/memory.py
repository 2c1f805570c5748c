from __future__ import annotations

from collections.abc import Iterator

import pytest

from fenced.backends.memory import MemoryBackend
from tests.helpers import unique_name
from tests.sources.envs.base import BackendEnv


class MemoryEnv(BackendEnv):
    name = "memory"
    cross_process = False
    min_ttl = 0.3


def make_env(request: pytest.FixtureRequest) -> Iterator[BackendEnv]:
    name = unique_name("mem")
    yield MemoryEnv(f"memory://{name}")
    MemoryBackend.reset(name)
