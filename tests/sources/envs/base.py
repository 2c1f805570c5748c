"""What the conformance suite needs from each token source under test."""

from __future__ import annotations

from typing import Any

import fenced
from fenced._core.backend import Characteristic, backend_class
from fenced.testing.servers import Server


class BackendEnv:
    """One token source under test. Subclasses live in ``tests/sources/envs/<name>.py``.

    ``url`` names the source; ``options`` are passed to ``fenced.connect``. ``restart()``
    restarts the source on the same data (durable sources: kill -9 then start), and
    ``stop()``/``start()`` take it away and bring it back for dead-server tests.
    """

    name = "base"
    cross_process = True  # can another OS process share these locks?
    min_ttl = 1.0  # the shortest ttl the source honours precisely enough for expiry tests
    survives_fork = True  # False: a child forked after connect() gets a clear error instead

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        self.options = options

    @property
    def characteristics(self) -> frozenset[Characteristic]:
        return backend_class(self.url).characteristics

    def connect(self, **options: Any) -> fenced.Locks:
        return fenced.connect(self.url, **{**self.options, **options})

    def connect_async(self, **options: Any) -> fenced.AsyncLocks:
        return fenced.connect_async(self.url, **{**self.options, **options})

    def restart(self) -> None:
        raise NotImplementedError(f"{self.name} has no restart")

    @property
    def can_stop(self) -> bool:
        return False

    def stop(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError


class ServerEnv(BackendEnv):
    """A source backed by one of the worker's session servers (``fenced.testing.servers``)."""

    stop_by_kill = False  # take the server away with kill -9 instead of a clean stop

    def __init__(self, server: Server, url: str | None = None, **options: Any) -> None:
        super().__init__(url or server.url, **options)  # type: ignore[attr-defined]
        self.server = server

    def restart(self) -> None:
        self.server.restart(kill=True)

    @property
    def can_stop(self) -> bool:
        return True

    def stop(self) -> None:
        if self.stop_by_kill:
            self.server.kill()
        else:
            self.server.stop()

    def start(self) -> None:
        self.server.start()


def session_server(request: Any, fixture: str) -> Any:
    """The worker's session server named by ``fixture``, started if a failed test left it down."""
    server = request.getfixturevalue(fixture)
    if server.proc is None:
        server.start()
    return server
