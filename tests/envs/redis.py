"""The Redis token source under the conformance suite: the session server (AOF always)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fenced.testing.servers import RedisServer
from tests.envs.base import BackendEnv
from tests.helpers import unique_name


class RedisEnv(BackendEnv):
    name = "redis"
    cross_process = True
    min_ttl = 0.5

    def __init__(self, server: RedisServer) -> None:
        # A key prefix per test keeps tests apart on the shared server.
        super().__init__(server.url, key_prefix=unique_name("t") + ":")
        self.server = server

    def restart(self) -> None:
        self.server.restart(kill=True)

    @property
    def can_stop(self) -> bool:
        return True

    def stop(self) -> None:
        self.server.kill()

    def start(self) -> None:
        self.server.start()


def make_env(request: pytest.FixtureRequest) -> Iterator[BackendEnv]:
    server: RedisServer = request.getfixturevalue("redis_server")
    if server.proc is None:  # a failed test may have left it stopped
        server.start()
    yield RedisEnv(server)
