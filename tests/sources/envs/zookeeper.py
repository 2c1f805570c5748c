"""The ZooKeeper token source under the conformance suite: the session server (tick 200 ms)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sources.envs.base import BackendEnv, ServerEnv, session_server


class ZooKeeperEnv(ServerEnv):
    name = "zookeeper"
    # The server's tick is 200 ms, so sessions may be as short as 400 ms; 1 s leaves kazoo's
    # heart-beats (every third of the timeout) room on a busy two-core machine.
    min_ttl = 1.0


def make_env(request: pytest.FixtureRequest) -> Iterator[BackendEnv]:
    yield ZooKeeperEnv(session_server(request, "zk_server"), connect_timeout=10)
