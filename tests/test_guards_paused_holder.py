"""Figure 8-5 end to end for the files and HTTP guards: two real client processes share a lock
(the embedded SQLite source); the first is paused with SIGSTOP past its ttl before it writes.

The Redis, etcd and SQL guards have the same test in their own modules; the runner and the
checker (`paused_holder`, `figure_8_5_violations`) live in tests/guards/processes.py, the
client process in tests/workers/guard_writer.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

import fenced
from fenced.guards.asgi import FencingMiddleware, SQLiteFenceStore
from fenced.guards.files import FileGuard
from tests.guards.processes import LOCK, figure_8_5_violations, paused_holder
from tests.helpers import serve

# -- files --------------------------------------------------------------------------------------


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_files_paused_holder(tmp_path: Path, guarded: bool) -> None:
    target = tmp_path / "store"
    run = paused_holder(f"sqlite:///{tmp_path}/locks.db", f"files:{target}", "report", guarded)
    if guarded:
        _, data = FileGuard(target, lock=LOCK).read("report")
    else:
        data = (target / "plain" / "report").read_bytes()
    bad = figure_8_5_violations(run, data.decode())
    if guarded:
        assert bad == []
        assert run["ev1"]["high_water"] == run["t2"]
        # The rejected write left nothing behind: one version, the current holder's.
        assert [v.token for v in FileGuard(target, lock=LOCK).versions("report")] == [
            fenced.FencingToken.parse(run["t2"])
        ]
    else:
        assert "the paused holder's stale write was accepted" in bad


# -- HTTP -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def fenced_service(tmp_path: Path) -> Iterator[str]:
    """A Starlette service: PUT /fenced/{name} is fenced, PUT /plain/{name} is not."""
    data: dict[str, str] = {}
    store = SQLiteFenceStore(str(tmp_path / "marks.db"))

    async def put(request: Request) -> Response:
        data[request.path_params["name"]] = (await request.body()).decode()
        return PlainTextResponse("ok")

    async def get(request: Request) -> Response:
        return PlainTextResponse(data.get(request.path_params["name"], ""))

    app = Starlette(
        routes=[
            Route("/fenced/{name}", put, methods=["PUT"]),
            Route("/plain/{name}", put, methods=["PUT"]),
            Route("/data/{name}", get, methods=["GET"]),
        ]
    )

    def resource(scope: Any) -> str | None:
        path: str = scope["path"]
        return path if path.startswith("/fenced/") else None

    with serve(FencingMiddleware(app, store=store, lock=LOCK, resource=resource)) as base:
        yield base


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_http_paused_holder(tmp_path: Path, guarded: bool) -> None:
    with fenced_service(tmp_path) as base:
        run = paused_holder(f"sqlite:///{tmp_path}/locks.db", f"http:{base}", "report", guarded)
        data = httpx.get(f"{base}/data/report").text
    bad = figure_8_5_violations(run, data)
    if guarded:
        assert bad == []
        assert run["ev1"]["high_water"] == run["t2"]
    else:
        assert "the paused holder's stale write was accepted" in bad
