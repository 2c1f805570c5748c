"""The PostgreSQL token source under test: a fresh database per test on the worker's server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fenced.testing.servers import PostgresServer
from tests.sources.envs.base import BackendEnv, ServerEnv, session_server

__all__ = ["PostgreSQLEnv", "crash", "make_env", "restart"]


def crash(server: PostgresServer) -> None:
    """kill -9 the postmaster and every backend at once, and wait until all are gone."""
    server.kill()


def restart(server: PostgresServer) -> None:
    """A crash (kill -9 of every process) and a start on the same data: crash recovery."""
    server.restart(kill=True)


class PostgreSQLEnv(ServerEnv):
    # Other connections to the session server (other tests' fixtures, fenced backends) are
    # broken by restart() and stop(); fenced's reconnect on their next call.
    name = "postgresql"
    min_ttl = 0.5
    stop_by_kill = True


def make_env(request: pytest.FixtureRequest) -> Iterator[BackendEnv]:
    server = session_server(request, "pg_server")
    yield PostgreSQLEnv(server, request.getfixturevalue("pg_dsn"))
