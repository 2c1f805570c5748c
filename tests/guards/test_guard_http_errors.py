"""Every error a fence store can raise -> a documented status, as problem+json, nothing passed on.

Each store's mark is corrupted for real (a text in SQLite's INTEGER column, a negative token in
PostgreSQL once its CHECK is dropped, a non-decimal ``hw`` and a fence key of another type in
Redis), its table is taken away, and the middlewares (ASGI in-process and behind uvicorn, WSGI
behind wsgiref) must answer with the table's status and a problem document while the handler
never runs and the damaged mark stays as it was. And the ``Fencing-Token`` value is read
without the optional whitespace around it, whether or not the server strips it.
"""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import httpx
import psycopg
import pytest
import redis
import redis.asyncio

from fenced import CorruptMarkError, FencingToken
from fenced.guards.asgi import (
    PROBLEM_CONTENT_TYPE,
    FencingMiddleware,
    PostgresFenceStore,
    RedisFenceStore,
    SQLiteFenceStore,
)
from fenced.guards.redis import default_fence_key
from fenced.guards.wsgi import FencingWSGIMiddleware
from fenced.testing.servers import RedisServer
from tests.helpers import TLS, serve, unique_name

LOCK = "jobs"


class Handler:
    """An ASGI and WSGI app that counts the requests it was let through."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":  # (uvicorn's: passed through by the middleware)
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        self.calls += 1
        body = str(scope["state"]["fencing_token"]).encode()
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def wsgi(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        self.calls += 1
        start_response("200 OK", [("content-type", "text/plain")])
        return [str(environ["fenced.token"]).encode()]


def problem(status: int, headers: Any, body: bytes) -> dict[str, Any]:
    import json

    assert headers["content-type"] == PROBLEM_CONTENT_TYPE, (status, body)
    doc: dict[str, Any] = json.loads(body)
    assert doc["status"] == status and {"type", "title", "detail"} <= set(doc)
    return doc


# -- the stores, and how to damage each for real -------------------------------------------------


class Kind:
    """One store kind: make a store (outside any loop: the WSGI one runs it on its own),
    damage a resource's mark in ways that must be reported as corrupt, and read it back raw."""

    name = ""

    def make(self) -> Any:
        raise NotImplementedError

    def corruptions(self) -> list[str]:
        raise NotImplementedError

    def corrupt(self, how: str, resource: str) -> None:
        raise NotImplementedError

    def raw(self, resource: str) -> object:
        raise NotImplementedError

    def drop(self) -> None:
        """Take the fence table away (a misconfigured store), if the store has one."""
        raise NotImplementedError


class SQLiteKind(Kind):
    def __init__(self, path: str, synchronous: str) -> None:
        self.path, self.synchronous = path, synchronous
        self.name = f"sqlite-{synchronous.lower()}"

    def make(self) -> Any:
        return SQLiteFenceStore(self.path, synchronous=self.synchronous)  # type: ignore[arg-type]

    def corruptions(self) -> list[str]:
        return ["text", "blob"]

    def corrupt(self, how: str, resource: str) -> None:
        value: object = {"text": "garbage", "blob": b"\x00\x07"}[how]
        with contextlib.closing(sqlite3.connect(self.path, isolation_level=None)) as db:
            db.execute("UPDATE fenced_fences SET token = ? WHERE resource = ?", (value, resource))

    def raw(self, resource: str) -> object:
        with contextlib.closing(sqlite3.connect(self.path)) as db:
            return db.execute(
                "SELECT token FROM fenced_fences WHERE resource = ?", (resource,)
            ).fetchone()

    def drop(self) -> None:
        with contextlib.closing(sqlite3.connect(self.path, isolation_level=None)) as db:
            db.execute("DROP TABLE fenced_fences")


class PostgresKind(Kind):
    name = "postgresql"

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def make(self) -> Any:
        return PostgresFenceStore(self.dsn, pool_size=1)

    def corruptions(self) -> list[str]:
        return ["negative", "zero"]

    def corrupt(self, how: str, resource: str) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as db:
            db.execute(
                "ALTER TABLE fenced_fences DROP CONSTRAINT IF EXISTS fenced_fences_token_check"
            )
            value = -5 if how == "negative" else 0
            db.execute("UPDATE fenced_fences SET token = %s WHERE resource = %s", (value, resource))

    def raw(self, resource: str) -> object:
        with psycopg.connect(self.dsn, autocommit=True) as db:
            return db.execute(
                "SELECT token FROM fenced_fences WHERE resource = %s", (resource,)
            ).fetchone()

    def drop(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as db:
            db.execute("DROP TABLE fenced_fences")


class RedisKind(Kind):
    name = "redis"

    def __init__(self, url: str) -> None:
        self.url = url

    def make(self) -> Any:
        return RedisFenceStore(redis.asyncio.Redis.from_url(self.url))

    def corruptions(self) -> list[str]:
        return ["hw", "type"]

    def corrupt(self, how: str, resource: str) -> None:
        key = default_fence_key(resource)
        with redis.Redis.from_url(self.url) as r:
            if how == "hw":
                r.hset(key, "hw", "garbage")
            else:  # the fence key holds a string where the hash was
                r.delete(key)
                r.set(key, "7")

    def raw(self, resource: str) -> object:
        key = default_fence_key(resource)
        with redis.Redis.from_url(self.url) as r:
            if r.type(key) == b"hash":
                return r.hgetall(key)
            return r.get(key)

    def drop(self) -> None:
        raise NotImplementedError  # (no table: a Redis store cannot be misconfigured so)


KINDS = ["sqlite-full", "sqlite-normal", "postgresql", "redis"]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest, tmp_path: Path) -> Kind:
    name = request.param
    if name.startswith("sqlite"):
        return SQLiteKind(str(tmp_path / "fences.db"), name.removeprefix("sqlite-").upper())
    if name == "postgresql":
        return PostgresKind(request.getfixturevalue("pg_dsn"))
    server: RedisServer = request.getfixturevalue("redis_server")
    return RedisKind(server.url)


@contextlib.asynccontextmanager
async def asgi_client(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        yield client


# -- ASGI: each corruption of each store -> 503 corrupt-mark, nothing passed on ------------------


async def test_asgi_corrupt_mark_of_every_store_is_503_problem(kind: Kind) -> None:
    """The regression: SQLite's text mark raised ConfigurationError, which escaped the
    middleware as a plain-text 500."""
    store = kind.make()
    handler = Handler()
    app = FencingMiddleware(handler, store=store, lock=LOCK, resource=lambda s: s["path"][1:])
    try:
        async with asgi_client(app) as client:
            for how in kind.corruptions():
                resource = unique_name("res")
                r = await client.post(f"/{resource}", headers={"Fencing-Token": "jobs:5"})
                assert r.status_code == 200 and handler.calls == 1  # the rightful one passes
                kind.corrupt(how, resource)
                damaged = kind.raw(resource)
                for value in (4, 5, 6, 10**12):  # lower, equal, higher: all refused
                    r = await client.post(
                        f"/{resource}", headers={"Fencing-Token": f"jobs:{value}"}
                    )
                    assert r.status_code == 503, (how, value, r.status_code, r.text)
                    doc = problem(r.status_code, r.headers, r.content)
                    assert doc["type"].endswith("corrupt-mark") and doc["resource"] == resource
                    assert "retry-after" not in r.headers  # no retry passes until repaired
                assert handler.calls == 1, f"{how}: the handler ran on a corrupt mark"
                assert kind.raw(resource) == damaged, f"{how}: the damaged mark was written"
                with pytest.raises(CorruptMarkError):
                    await store.high_water(resource, LOCK)
                handler.calls = 0
    finally:
        await store.aclose()


async def test_asgi_misconfigured_store_is_500_problem(tmp_path: Path, pg_dsn: str) -> None:
    """A store whose table was taken away answers 500 with a problem document (the error is
    logged); the handler never runs."""
    for kind in (SQLiteKind(str(tmp_path / "f.db"), "FULL"), PostgresKind(pg_dsn)):
        store = kind.make()
        handler = Handler()
        app = FencingMiddleware(handler, store=store, lock=LOCK)
        try:
            async with asgi_client(app) as client:
                ok = await client.post("/x", headers={"Fencing-Token": "jobs:1"})
                assert ok.status_code == 200
                kind.drop()
                r = await client.post("/x", headers={"Fencing-Token": "jobs:2"})
                assert r.status_code == 500, (kind.name, r.text)
                doc = problem(r.status_code, r.headers, r.content)
                assert doc["type"].endswith("fence-misconfigured") and doc["resource"] == LOCK
                assert handler.calls == 1
        finally:
            await store.aclose()


class BrokenStore:
    """A store of the user's own (the FenceStore protocol) whose advance fails unexpectedly."""

    async def advance(self, resource: str, token: FencingToken) -> None:
        raise RuntimeError("disk on fire at /secret/path")


async def test_any_other_store_error_is_500_problem_without_its_text() -> None:
    handler = Handler()
    app = FencingMiddleware(handler, store=BrokenStore(), lock=LOCK)
    async with asgi_client(app) as client:
        r = await client.post("/x", headers={"Fencing-Token": "jobs:1"})
    assert r.status_code == 500
    doc = problem(r.status_code, r.headers, r.content)
    assert doc["type"].endswith("fence-error") and "RuntimeError" in doc["detail"]
    assert "/secret/path" not in r.text  # an unexpected error's text may say too much
    assert handler.calls == 0


# -- WSGI: the same, behind a real WSGI server -----------------------------------------------------


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def wsgi_serve(app: Any) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_wsgi_corrupt_mark_of_every_store_is_503_problem(kind: Kind) -> None:
    handler = Handler()
    with (
        FencingWSGIMiddleware(
            handler.wsgi, store=kind.make(), lock=LOCK, resource=lambda e: e["PATH_INFO"][1:]
        ) as app,
        wsgi_serve(app) as base,
    ):
        for how in kind.corruptions():
            resource = unique_name("res")
            url = f"{base}/{resource}"
            r = httpx.post(url, headers={"Fencing-Token": "jobs:5"}, timeout=10, verify=TLS)
            assert r.status_code == 200 and handler.calls == 1
            kind.corrupt(how, resource)
            damaged = kind.raw(resource)
            for value in (4, 5, 6):
                r = httpx.post(
                    url, headers={"Fencing-Token": f"jobs:{value}"}, timeout=10, verify=TLS
                )
                assert r.status_code == 503, (how, value, r.status_code, r.text)
                assert problem(r.status_code, r.headers, r.content)["type"].endswith("corrupt-mark")
            assert handler.calls == 1 and kind.raw(resource) == damaged
            handler.calls = 0


def test_wsgi_misconfigured_and_broken_stores_are_500_problem(tmp_path: Path) -> None:
    kind = SQLiteKind(str(tmp_path / "f.db"), "FULL")
    handler = Handler()
    with (
        FencingWSGIMiddleware(handler.wsgi, store=kind.make(), lock=LOCK) as app,
        wsgi_serve(app) as base,
    ):
        assert (
            httpx.post(base + "/x", headers={"Fencing-Token": "jobs:1"}, verify=TLS).status_code
            == 200
        )
        kind.drop()
        r = httpx.post(base + "/x", headers={"Fencing-Token": "jobs:2"}, verify=TLS)
        assert r.status_code == 500, r.text
        assert problem(500, r.headers, r.content)["type"].endswith("fence-misconfigured")
    with (
        FencingWSGIMiddleware(handler.wsgi, store=BrokenStore(), lock=LOCK) as app,
        wsgi_serve(app) as base,
    ):
        r = httpx.post(base + "/x", headers={"Fencing-Token": "jobs:3"}, verify=TLS)
        assert r.status_code == 500 and "/secret/path" not in r.text
        assert problem(500, r.headers, r.content)["type"].endswith("fence-error")
    assert handler.calls == 1


# -- optional whitespace around the header's value --------------------------------------------------


def raw_post(base: str, path: str, header_line: bytes) -> tuple[int, bytes]:
    """POST with a header line sent byte for byte (clients strip the whitespace themselves)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
            b"Connection: close\r\n" + header_line + b"\r\n\r\n"
        )
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


WHITESPACE = [
    b"Fencing-Token: jobs:101  ",
    b"Fencing-Token:\tjobs:101\t",
    b"Fencing-Token:jobs:101 \t ",
]


def check_whitespace(base: str, handler: Handler) -> None:
    for line in WHITESPACE:
        status, body = raw_post(base, "/x", line)
        assert (status, body) == (200, b"jobs:101"), (line, status, body)
    status, _ = raw_post(base, "/x", b"Fencing-Token: jobs:100  ")
    assert status == 409  # stripped, and still checked: the stale one is refused
    status, _ = raw_post(base, "/x", b"Fencing-Token: jobs: 102")
    assert status == 400  # whitespace inside the value is not optional whitespace
    assert handler.calls == len(WHITESPACE)


def test_asgi_header_whitespace_is_stripped_behind_uvicorn(tmp_path: Path) -> None:
    """uvicorn with httptools hands the value on with its trailing whitespace (h11 strips it):
    'jobs:101  ' was a 400."""
    handler = Handler()
    store = SQLiteFenceStore(str(tmp_path / "f.db"))
    with serve(FencingMiddleware(handler, store=store, lock=LOCK)) as base:
        check_whitespace(base, handler)


def test_wsgi_header_whitespace_is_stripped_behind_wsgiref(tmp_path: Path) -> None:
    handler = Handler()
    store = SQLiteFenceStore(str(tmp_path / "f.db"))
    with (
        FencingWSGIMiddleware(handler.wsgi, store=store, lock=LOCK) as app,
        wsgi_serve(app) as base,
    ):
        check_whitespace(base, handler)


async def test_refused_store_credentials_are_500_problem_not_503(pg_server: Any) -> None:
    """A store whose credentials its server refuses will never pass: 500 fence-misconfigured
    (it was 503 + Retry-After, inviting retries that cannot succeed); the handler never runs."""
    redis_server = RedisServer()
    with redis_server:
        redis.Redis(port=redis_server.port).config_set("requirepass", "s3cret-pw")
        client = redis.asyncio.Redis.from_url(f"redis://:wrong-pw@127.0.0.1:{redis_server.port}/0")
        stores: list[Any] = [
            PostgresFenceStore(f"postgresql://no_such_role@127.0.0.1:{pg_server.port}/postgres"),
            RedisFenceStore(client),
        ]
        for store in stores:
            handler = Handler()
            app = FencingMiddleware(handler, store=store, lock=LOCK)
            try:
                async with asgi_client(app) as client_:
                    r = await client_.post("/x", headers={"Fencing-Token": "jobs:1"})
                assert r.status_code == 500, (store, r.status_code, r.text)
                doc = problem(r.status_code, r.headers, r.content)
                assert doc["type"].endswith("fence-misconfigured") and "wrong-pw" not in r.text
                assert "retry-after" not in r.headers and handler.calls == 0
            finally:
                await store.aclose()
        await client.aclose()


async def test_an_unusable_sqlite_file_is_500_problem_not_503(tmp_path: Path) -> None:
    """A SQLite store on a file that is not a database, or on a directory, can never open:
    500 fence-misconfigured at once (it was 503 + Retry-After); the file is left as it was."""
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"not a database" * 100)
    for path, says in ((garbage, "not a SQLite database"), (tmp_path, "is a directory")):
        store = SQLiteFenceStore(str(path))
        handler = Handler()
        try:
            async with asgi_client(FencingMiddleware(handler, store=store, lock=LOCK)) as client:
                r = await client.post("/x", headers={"Fencing-Token": "jobs:1"})
            assert r.status_code == 500, (path, r.status_code, r.text)
            doc = problem(r.status_code, r.headers, r.content)
            assert doc["type"].endswith("fence-misconfigured") and says in doc["detail"]
            assert handler.calls == 0
        finally:
            await store.aclose()
    assert garbage.read_bytes() == b"not a database" * 100
