"""Figure 8-5 end to end for the files, HTTP, ZooKeeper, DynamoDB, S3 and SQLAlchemy guards: two
real client processes share a lock (the embedded SQLite source); the first is paused with
SIGSTOP past its ttl before it writes. (DynamoDB and S3 run against moto's server mode.)

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
from fenced.guards.sql import SQLGuard
from tests.guards.processes import LOCK, figure_8_5_violations, paused_holder
from tests.helpers import TLS, serve, unique_name

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
        data = httpx.get(f"{base}/data/report", verify=TLS).text
    bad = figure_8_5_violations(run, data)
    if guarded:
        assert bad == []
        assert run["ev1"]["high_water"] == run["t2"]
    else:
        assert "the paused holder's stale write was accepted" in bad


# -- ZooKeeper, DynamoDB, S3 (moto), SQLAlchemy ------------------------------------------------


def _check(run: dict[str, Any], data: str | None, guarded: bool) -> None:
    bad = figure_8_5_violations(run, data)
    if guarded:
        assert bad == [], bad
        assert run["ev1"]["high_water"] == run["t2"]
    else:  # the same run without the guard: the stale write lands (the test can fail)
        assert "the paused holder's stale write was accepted" in bad, bad


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_zookeeper_paused_holder(tmp_path: Path, zk_server: Any, guarded: bool) -> None:
    from kazoo.client import KazooClient

    resource = unique_name("r")
    run = paused_holder(
        f"sqlite:///{tmp_path}/locks.db", f"zookeeper:{zk_server.hosts}", resource, guarded
    )
    zk = KazooClient(hosts=zk_server.hosts)
    zk.start(timeout=30)
    try:
        path = f"/data/{resource}" if guarded else f"/plain/{resource}"
        _check(run, zk.get(path)[0].decode(), guarded)
    finally:
        zk.stop()
        zk.close()


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_dynamodb_paused_holder(
    tmp_path: Path, moto_server: Any, dynamodb_table: Any, guarded: bool
) -> None:
    client, table = dynamodb_table
    resource = unique_name("r")
    target = f"dynamodb:{moto_server.url}|{table}"
    run = paused_holder(f"sqlite:///{tmp_path}/locks.db", target, resource, guarded)
    key = {"pk": {"S": resource if guarded else f"plain-{resource}"}}
    got = client.get_item(TableName=table, Key=key, ConsistentRead=True)["Item"]["v"]["S"]
    _check(run, got, guarded)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_s3_paused_holder(tmp_path: Path, moto_server: Any, s3_bucket: Any, guarded: bool) -> None:
    from fenced.guards.s3 import S3VersionStore

    client, bucket = s3_bucket
    resource = unique_name("r")
    run = paused_holder(
        f"sqlite:///{tmp_path}/locks.db", f"s3:{moto_server.url}|{bucket}", resource, guarded
    )
    if guarded:
        data = S3VersionStore(client, bucket, lock=LOCK).read(resource)[1]
    else:
        data = client.get_object(Bucket=bucket, Key=f"plain/{resource}")["Body"].read()
    _check(run, data.decode(), guarded)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_sqlalchemy_paused_holder(tmp_path: Path, guarded: bool) -> None:
    import sqlalchemy as sa

    url = f"sqlite:///{tmp_path}/app.db"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE data (id INTEGER PRIMARY KEY, v TEXT)")
        conn.exec_driver_sql("INSERT INTO data VALUES (1, '')")
    with engine.connect() as conn:
        SQLGuard("inv", lock=LOCK).install(conn)
    run = paused_holder(f"sqlite:///{tmp_path}/locks.db", f"sqlalchemy:{url}", "inv", guarded)
    with engine.connect() as conn:
        data = conn.exec_driver_sql("SELECT v FROM data WHERE id = 1").scalar_one()
    engine.dispose()
    _check(run, data, guarded)
