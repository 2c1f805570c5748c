"""Figure 8-5 end to end for the files and HTTP guards: two real client processes share a lock
(the embedded SQLite source); the first is paused with SIGSTOP past its ttl before it writes.

The Redis, etcd and SQL guards have the same test in their own modules; the runner and the
checker (`paused_holder`, `figure_8_5_violations`) are shared with the Redis guard's tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
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
from fenced import StaleTokenError
from fenced.guards.asgi import FencingMiddleware, SQLiteFenceStore
from fenced.guards.files import FileGuard
from fenced.guards.httpx import FencingAuth
from tests.test_guard_asgi import serve
from tests.test_guard_redis import LOCK, STEP_TIMEOUT, figure_8_5_violations, paused_holder

# -- files --------------------------------------------------------------------------------------


def _plain_write(path: Path, data: bytes) -> None:
    """What an unguarded writer does: atomic replace, last writer wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_files_paused_holder(tmp_path: Path, guarded: bool) -> None:
    target = tmp_path / "store"
    run = paused_holder(
        __name__, f"sqlite:///{tmp_path}/locks.db", f"files:{target}", "report", guarded
    )
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
        run = paused_holder(
            __name__, f"sqlite:///{tmp_path}/locks.db", f"http:{base}", "report", guarded
        )
        data = httpx.get(f"{base}/data/report").text
    bad = figure_8_5_violations(run, data)
    if guarded:
        assert bad == []
        assert run["ev1"]["high_water"] == run["t2"]
    else:
        assert "the paused holder's stale write was accepted" in bad


# -- the client process ---------------------------------------------------------------------------


def _emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def _write(
    target: str, resource: str, content: str, token: fenced.FencingToken, guarded: bool
) -> None:
    kind, _, where = target.partition(":")
    if kind == "files":
        if guarded:
            FileGuard(where, lock=LOCK).write(resource, content.encode(), token)
        else:
            _plain_write(Path(where) / "plain" / resource, content.encode())
    else:
        # The token was read before the pause (a fixed token, not the lease, which would
        # refuse to send now that it knows it is lost): the server must be the one to refuse.
        route = "fenced" if guarded else "plain"
        with httpx.Client(base_url=where, auth=FencingAuth(token) if guarded else None) as client:
            client.put(f"/{route}/{resource}", content=content).raise_for_status()


def _holder(source: str, target: str, resource: str, ttl: float, how: str) -> None:
    with fenced.connect(source) as locks:
        lease = locks.lock(LOCK, ttl=ttl, timeout=STEP_TIMEOUT)
        token = lease.acquire()
        _emit(event="acquired", token=str(token))
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "write":  # written whether or not the lease is still held
                try:
                    _write(target, resource, arg, token, how == "guarded")
                    _emit(event="write-ok")
                except StaleTokenError as exc:
                    _emit(event="write-rejected", high_water=str(exc.high_water))
            elif cmd == "quit":
                break


if __name__ == "__main__":
    if sys.argv[1] != "holder":
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
    _holder(sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), sys.argv[6])
