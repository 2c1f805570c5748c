"""A token source behind ``fenced serve``: the conformance suite over ``http://``.

The gateway is a real OS process (``fenced.testing.servers.FencedServer``) in front of one of
the other test sources. ``restart()`` restarts the source as its own env does *and* kills
the gateway with SIGKILL and starts a new one: a gateway holds no lock state, so nothing may
be lost. ``stop()``/``start()`` take the gateway away (kill -9) and bring it back.

One gateway per inner source per pytest worker, shared by that worker's tests (``http_gateways``
in tests/conftest.py): starting ``fenced serve`` costs 1.5–12 s (imports, under load), and
each http_* test used to pay it. The inner source is the worker's too (a session SQLite file,
an etcd key prefix, a PostgreSQL database); every conformance test uses its own lock names
(``unique_name``), so no test sees another's locks. A test that left the gateway down (a failed
dead-server test) gets it started again before the next one.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fenced._core.backend import Characteristic
from fenced.testing.servers import FencedServer
from tests.helpers import unique_name
from tests.sources.envs.base import BackendEnv, session_server


class HttpEnv(BackendEnv):
    def __init__(self, inner: BackendEnv, gateway: FencedServer, name: str) -> None:
        super().__init__(gateway.url)
        self.inner = inner
        self.gateway = gateway
        self.name = name
        self.min_ttl = max(inner.min_ttl, 0.5)

    @property
    def characteristics(self) -> frozenset[Characteristic]:
        return self.inner.characteristics

    def restart(self) -> None:
        self.gateway.kill()
        self.inner.restart()
        self.gateway.start()

    @property
    def can_stop(self) -> bool:
        return True

    def stop(self) -> None:
        self.gateway.kill()

    def start(self) -> None:
        self.gateway.start()


def inner_url(inner: BackendEnv) -> str:
    """The inner source's URL with its options (a key prefix) in the query."""
    if not inner.options:
        return inner.url
    query = "&".join(f"{k}={v}" for k, v in inner.options.items())
    return f"{inner.url}{'&' if '?' in inner.url else '?'}{query}"


def _shared_inner(request: pytest.FixtureRequest, inner_name: str) -> BackendEnv:
    """The worker's inner source for ``inner_name``, made once (see the module docstring)."""
    if inner_name == "sqlite":
        from tests.sources.envs.sqlite import SQLiteEnv

        factory: pytest.TempPathFactory = request.getfixturevalue("tmp_path_factory")
        path: Path = factory.mktemp("http-sqlite") / "locks.db"
        return SQLiteEnv(str(path))
    if inner_name == "etcd":
        from tests.sources.envs.etcd import EtcdEnv

        server = session_server(request, "etcd_server")
        return EtcdEnv(server, prefix=f"/fenced-test/{unique_name('http')}/")
    if inner_name == "postgresql":
        import psycopg

        from tests.sources.envs.postgresql import PostgreSQLEnv

        server = session_server(request, "pg_server")
        db = unique_name("http").replace("-", "_")
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {db}")
        return PostgreSQLEnv(server, f"postgresql://postgres@127.0.0.1:{server.port}/{db}")
    raise AssertionError(f"no shared {inner_name} source for the http envs")


def make_http_env(request: pytest.FixtureRequest, inner_name: str) -> Iterator[BackendEnv]:
    gateways: dict[str, Any] = request.getfixturevalue("http_gateways")
    env: HttpEnv | None = gateways.get(inner_name)
    if env is None:
        inner = _shared_inner(request, inner_name)
        env = HttpEnv(inner, FencedServer(inner_url(inner)), f"http-{inner_name}")
        gateways[inner_name] = env
    if inner_name in _SERVER_FIXTURE:
        session_server(request, _SERVER_FIXTURE[inner_name])  # up again if a test left it down
    env.gateway.start()  # (a running gateway is left as it is)
    yield env


_SERVER_FIXTURE = {"etcd": "etcd_server", "postgresql": "pg_server"}
