"""The PostgreSQL token source under test: a fresh database per test on the worker's server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fenced.testing.servers import PostgresServer
from tests.envs.base import BackendEnv


class PostgreSQLEnv(BackendEnv):
    name = "postgresql"
    cross_process = True
    min_ttl = 0.5

    def __init__(self, url: str, request: pytest.FixtureRequest) -> None:
        super().__init__(url)
        self._request = request

    @property
    def server(self) -> PostgresServer:
        server: PostgresServer = self._request.getfixturevalue("pg_server")
        return server

    def restart(self) -> None:
        # kill -9 and start on the same data directory: crash recovery, then the same port.
        # Other connections to this server (other tests' fixtures) reconnect on their next use.
        self.server.restart(kill=True)

    @property
    def can_stop(self) -> bool:
        return True

    def stop(self) -> None:
        self.server.kill()

    def start(self) -> None:
        self.server.start()


def make_env(request: pytest.FixtureRequest) -> Iterator[BackendEnv]:
    dsn: str = request.getfixturevalue("pg_dsn")
    yield PostgreSQLEnv(dsn, request)
