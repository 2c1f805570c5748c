"""The WSGI middleware, served by a real WSGI server (wsgiref) and called over HTTP.

Both sides: the current holder's writes pass (again and again), a stale token is refused
(409) and the handler never runs; and the planted middleware that forgets to check is caught.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import httpx
import pytest

from fenced import FencingToken, StaleTokenError
from fenced.guards.asgi import PostgresFenceStore, SQLiteFenceStore
from fenced.guards.wsgi import FencingWSGIMiddleware
from tests.helpers import TLS

LOCK = "jobs"


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


class Recorder:
    """A WSGI app that records the writes it was let through."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, str]] = []

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ["PATH_INFO"]
        if path == "/raise-stale":
            raise StaleTokenError(FencingToken(LOCK, 1), FencingToken(LOCK, 99), "jobs")
        if path == "/generator-stale":
            return self._generator(start_response)
        token = environ.get("fenced.token")
        if environ["REQUEST_METHOD"] == "POST":
            self.writes.append((path, str(token)))
        start_response("200 OK", [("content-type", "text/plain")])
        return [f"ok {token}".encode()]

    @staticmethod
    def _generator(start_response: Any) -> Iterator[bytes]:
        raise StaleTokenError(FencingToken(LOCK, 1), FencingToken(LOCK, 99), "jobs")
        yield b""  # (a generator: its code runs on the first next())


@contextmanager
def serve(app: Any) -> Iterator[str]:
    server: WSGIServer = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


class ForgetfulStore:
    """PLANTED BUG: a store that accepts every token without looking at the mark."""

    async def advance(self, resource: str, token: FencingToken) -> None:
        return None


def post(base: str, path: str, token: str | None) -> httpx.Response:
    headers = {} if token is None else {"Fencing-Token": token}
    return httpx.post(base + path, headers=headers, timeout=10, verify=TLS)


def test_wsgi_middleware_responses_both_sides(tmp_path: Path) -> None:
    app = Recorder()
    store = SQLiteFenceStore(str(tmp_path / "fences.db"))
    with (
        FencingWSGIMiddleware(app, store=store, lock=LOCK) as fenced_app,
        serve(fenced_app) as base,
    ):
        assert post(base, "/jobs/1", "jobs:5").status_code == 200
        assert post(base, "/jobs/1", "jobs:5").text == "ok jobs:5"  # the holder writes again
        assert post(base, "/jobs/1", "jobs:6").status_code == 200
        stale = post(base, "/jobs/1", "jobs:4")
        assert stale.status_code == 409
        assert stale.headers["content-type"] == "application/problem+json"
        problem = json.loads(stale.content)
        assert (problem["token"], problem["high_water"], problem["resource"]) == (
            "jobs:4",
            "jobs:6",
            "jobs",
        )
        assert app.writes == [("/jobs/1", "jobs:5"), ("/jobs/1", "jobs:5"), ("/jobs/1", "jobs:6")]
        assert post(base, "/jobs/1", None).status_code == 428
        assert post(base, "/jobs/1", "jobs:0").status_code == 400
        other = post(base, "/jobs/1", "reports:9")
        assert other.status_code == 400 and json.loads(other.content)["lock"] == LOCK
        assert (
            httpx.get(base + "/jobs/1", timeout=10, verify=TLS).status_code == 200
        )  # safe: no token
        # A refusal the handler itself raises, before its response started, is the same 409.
        assert post(base, "/raise-stale", "jobs:7").status_code == 409
        assert post(base, "/generator-stale", "jobs:7").status_code == 409
    # The mark lives in the store: a new middleware on the same file refuses the stale token.
    store2 = SQLiteFenceStore(str(tmp_path / "fences.db"))
    with FencingWSGIMiddleware(app, store=store2, lock=LOCK) as again, serve(again) as base:
        assert post(base, "/jobs/1", "jobs:6").status_code == 409  # 7 was accepted since
        assert post(base, "/jobs/1", "jobs:7").status_code == 200


def test_wsgi_unreachable_store_is_503(refused_port: int) -> None:
    # (a PostgreSQL port nobody listens on: a SQLite file in a missing directory is a
    # misconfigured store, 500, see tests/guards/test_guard_http_errors.py)
    port = refused_port  # (held throughout: see tests.helpers.dead_port)
    store = PostgresFenceStore(f"postgresql://postgres@127.0.0.1:{port}/x", connect_timeout=1)
    with FencingWSGIMiddleware(Recorder(), store=store, lock=LOCK) as app, serve(app) as base:
        reply = post(base, "/jobs/1", "jobs:1")
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"


def test_wsgi_planted_store_that_never_checks_is_caught() -> None:
    """The same stale request as above, through a store that does not check: it is let
    through and written, which the assertions of the first test would catch."""
    app = Recorder()
    store: Any = ForgetfulStore()
    with (
        FencingWSGIMiddleware(app, store=store, lock=LOCK) as fenced_app,
        serve(fenced_app) as base,
    ):
        post(base, "/jobs/1", "jobs:6")
        stale = post(base, "/jobs/1", "jobs:4")
    with pytest.raises(AssertionError):
        assert stale.status_code == 409
    assert ("/jobs/1", "jobs:4") in app.writes  # the stale write landed: the bug is visible
