"""A token source behind ``fenced serve``: the conformance suite over ``http://``.

The gateway is a real OS process (``fenced.testing.servers.FencedServer``) in front of one of
the other test sources. ``restart()`` restarts the source as its own env does *and* kills
the gateway with SIGKILL and starts a new one: a gateway holds no lock state, so nothing may
be lost. ``stop()``/``start()`` take the gateway away (kill -9) and bring it back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from fenced._backend import Characteristic
from fenced.testing.servers import FencedServer
from tests.envs.base import BackendEnv


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


def make_http_env(request: pytest.FixtureRequest, inner_name: str) -> Iterator[BackendEnv]:
    import importlib

    module: Any = importlib.import_module(f"tests.envs.{inner_name}")
    for inner in module.make_env(request):
        gateway = FencedServer(inner_url(inner))
        gateway.start()
        try:
            yield HttpEnv(inner, gateway, f"http-{inner_name}")
        finally:
            gateway.close()
