"""The PostgreSQL token source under test: a fresh database per test on the worker's server.

``crash(server)`` is a real kill -9 of the whole server. ``PostgresServer.kill`` alone is not:
PostgreSQL's backends call ``setsid()``, so killing the postmaster's process group leaves them
running; they keep answering queries until they notice the postmaster is gone, and the
restart then fails ("pre-existing shared memory block is still in use").
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

from fenced.testing.servers import PostgresServer
from tests.envs.base import BackendEnv

__all__ = ["PostgreSQLEnv", "crash", "make_env", "restart"]


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces, so split after the last ')'.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] == "Z"  # a zombie holds nothing
    except OSError:
        return True


def crash(server: PostgresServer, timeout: float = 10.0) -> None:
    """kill -9 the postmaster and every backend at once, and wait until all are gone."""
    if server.proc is None:
        return
    postmaster = server.proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(postmaster, signal.SIGSTOP)  # no new children from here on
    victims = _children(postmaster)
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.kill()
    deadline = time.monotonic() + timeout
    while not all(_gone(pid) for pid in victims):
        if time.monotonic() > deadline:
            raise RuntimeError(f"PostgreSQL backends {victims} did not die")
        time.sleep(0.005)


def restart(server: PostgresServer) -> None:
    """A crash (kill -9 of every process) and a start on the same data: crash recovery."""
    crash(server)
    server.start()


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
        # Other connections to this session server (other tests' fixtures, fenced backends)
        # are broken by this; fenced's reconnect on their next call, fixtures open new ones.
        restart(self.server)

    @property
    def can_stop(self) -> bool:
        return True

    def stop(self) -> None:
        crash(self.server)

    def start(self) -> None:
        self.server.start()


def make_env(request: pytest.FixtureRequest) -> Iterator[BackendEnv]:
    dsn: str = request.getfixturevalue("pg_dsn")
    yield PostgreSQLEnv(dsn, request)
