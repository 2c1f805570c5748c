"""The etcd token source for the conformance suite: the worker's session etcd server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import unique_name
from tests.sources.envs.base import BackendEnv, ServerEnv, session_server


class EtcdEnv(ServerEnv):
    name = "etcd"
    # etcd leases are whole seconds, at least 1 s with the test server's 500 ms election
    # timeout, and the server revokes expired leases on a 500 ms tick.
    min_ttl = 1.0
    survives_fork = False  # gRPC does not survive fork (see check_grpc_usable)


def make_env(request: pytest.FixtureRequest) -> Iterator[BackendEnv]:
    # A fresh key prefix per test: no test sees another's keys, even with a shared lock name.
    server = session_server(request, "etcd_server")
    yield EtcdEnv(server, prefix=f"/fenced-test/{unique_name('t')}/")
