"""The ZooKeeper token source under the conformance suite: the session server (tick 200 ms)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fenced.testing.servers import ZooKeeperServer
from tests.envs.base import BackendEnv


class ZooKeeperEnv(BackendEnv):
    name = "zookeeper"
    cross_process = True
    # The server's tick is 200 ms, so sessions may be as short as 400 ms; 1 s leaves kazoo's
    # heart-beats (every third of the timeout) room on a busy two-core machine.
    min_ttl = 1.0

    def __init__(self, server: ZooKeeperServer) -> None:
        super().__init__(server.url, connect_timeout=10)
        self.server = server

    def restart(self) -> None:
        self.server.restart(kill=True)

    @property
    def can_stop(self) -> bool:
        return True

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server.start()


def make_env(request: pytest.FixtureRequest) -> Iterator[BackendEnv]:
    server: ZooKeeperServer = request.getfixturevalue("zk_server")
    if server.proc is None:  # a failed test may have left it stopped
        server.start()
    yield ZooKeeperEnv(server)
