"""The Redis token source under the conformance suite: the session server (AOF always)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import unique_name
from tests.sources.envs.base import BackendEnv, ServerEnv, session_server


class RedisEnv(ServerEnv):
    name = "redis"
    min_ttl = 0.5
    stop_by_kill = True


def make_env(request: pytest.FixtureRequest) -> Iterator[BackendEnv]:
    # A key prefix per test keeps tests apart on the shared server.
    yield RedisEnv(session_server(request, "redis_server"), key_prefix=unique_name("t") + ":")
