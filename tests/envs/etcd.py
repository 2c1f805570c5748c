"""The etcd token source for the conformance suite: the worker's session etcd server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fenced.testing.servers import EtcdServer
from tests.envs.base import BackendEnv
from tests.helpers import unique_name


class EtcdEnv(BackendEnv):
    name = "etcd"
    cross_process = True
    # etcd leases are whole seconds, at least 1 s with the test server's 500 ms election
    # timeout, and the server revokes expired leases on a 500 ms tick.
    min_ttl = 1.0

    def __init__(self, server: EtcdServer, **options: object) -> None:
        super().__init__(server.url, **options)
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
    server: EtcdServer = request.getfixturevalue("etcd_server")
    # A fresh key prefix per test: no test sees another's keys, even with a shared lock name.
    yield EtcdEnv(server, prefix=f"/fenced-test/{unique_name('t')}/")
