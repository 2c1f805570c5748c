"""HTTP fencing: FencingMiddleware, its stores (SQLite, PostgreSQL, Redis), the httpx client.

Stores run against real engines (a SQLite file, the worker's PostgreSQL and Redis servers);
the middleware runs in-process through ``httpx.ASGITransport`` and once behind a real uvicorn
server. Planted bugs (a store whose fence uses ``<`` instead of ``<=``; a handler that writes
after the middleware's check instead of through the store) must make the same checks fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

import fenced
from fenced import (
    BackendUnavailable,
    ConfigurationError,
    FencingToken,
    LeaseLostError,
    NotHeldError,
    StaleTokenError,
    WrongLockError,
)
from fenced.guards.asgi import (
    PROBLEM_CONTENT_TYPE,
    FenceMetrics,
    FenceStore,
    FencingMiddleware,
    PostgresFenceStore,
    RedisFenceStore,
    SQLiteFenceStore,
    fencing_exception_handler,
)
from fenced.guards.httpx import FencingAuth, acheck_stale, check_stale, stale_error
from fenced.guards.redis import AsyncRedisGuard
from fenced.guards.sql import SQLGuard
from fenced.testing.servers import RedisServer
from tests.guards.planted import plant_lt
from tests.helpers import forged, serve, unique_name

LOCK = "jobs"


def tok(value: int, lock: str = LOCK) -> FencingToken:
    return FencingToken(lock, value)


# -- planted bugs -----------------------------------------------------------------------------


class LtSQLGuard(SQLGuard):
    """PLANTED BUG: the fence statement uses ``<`` where ``<=`` belongs."""

    def _fence_sql(self, d: Any) -> Any:
        sql = super()._fence_sql(d)
        return dataclasses.replace(sql, accept=plant_lt(sql.accept), update=plant_lt(sql.update))


class LtRedisGuard(AsyncRedisGuard):
    """PLANTED BUG: the Lua fence rejects an equal token (``c <= 0`` for ``c < 0``)."""

    @staticmethod
    def eval_script(lua_body: str) -> str:
        good = AsyncRedisGuard.eval_script(lua_body)
        bad = good.replace("if c < 0 then", "if c <= 0 then")
        assert bad.count("if c <= 0 then") == 1, "the guard's Lua changed: re-plant the bug"
        return bad


class LtSQLiteStore(SQLiteFenceStore):
    guard_class = LtSQLGuard


class LtPostgresStore(PostgresFenceStore):
    guard_class = LtSQLGuard


class LtRedisStore(RedisFenceStore):
    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self.guard_class = LtRedisGuard


# -- store fixtures ---------------------------------------------------------------------------


@dataclasses.dataclass
class StoreKit:
    """How to make (and re-make, as after a restart) one kind of store on one engine."""

    kind: str
    make: Callable[[bool], Awaitable[Any]]  # planted -> store
    cleanup: list[Callable[[], Awaitable[None]]] = dataclasses.field(default_factory=list)

    async def store(self, planted: bool = False) -> Any:
        s = await self.make(planted)
        self.cleanup.append(s.aclose)
        return s


STORE_KINDS = ["sqlite-full", "sqlite-normal", "postgresql", "redis"]


@pytest.fixture(params=STORE_KINDS)
async def kit(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreKit]:
    kind = request.param
    clients: list[Any] = []
    if kind.startswith("sqlite"):
        path = str(tmp_path / "fences.db")
        sync = "FULL" if kind == "sqlite-full" else "NORMAL"

        async def make(planted: bool) -> Any:
            cls = LtSQLiteStore if planted else SQLiteFenceStore
            return await cls(path, synchronous=sync).open()  # type: ignore[arg-type]

    elif kind == "postgresql":
        dsn = request.getfixturevalue("pg_dsn")

        async def make(planted: bool) -> Any:
            cls = LtPostgresStore if planted else PostgresFenceStore
            return await cls(dsn).open()

    else:
        server: RedisServer = request.getfixturevalue("redis_server")

        async def make(planted: bool) -> Any:
            client = redis.asyncio.Redis.from_url(server.url)
            clients.append(client)
            return (LtRedisStore if planted else RedisFenceStore)(client)

    k = StoreKit(kind, make)
    yield k
    for close in reversed(k.cleanup):
        await close()
    for client in clients:
        await client.aclose()


# -- the stores: both sides of the rule ---------------------------------------------------------


async def check_rule(store: Any, resource: str) -> None:
    """Equal accepted, higher accepted, lower rejected with both tokens; marks independent."""
    assert isinstance(store, FenceStore)
    await store.advance(resource, tok(5))
    await store.advance(resource, tok(5))
    await store.advance(resource, tok(7))
    with pytest.raises(StaleTokenError) as info:
        await store.advance(resource, tok(6))
    assert (info.value.token, info.value.high_water, info.value.resource) == (
        tok(6),
        tok(7),
        resource,
    )
    assert await store.high_water(resource, LOCK) == tok(7)
    await store.advance(resource + "-other", tok(1))  # its own mark
    assert await store.high_water(resource + "-other", LOCK) == tok(1)


async def test_store_rule(kit: StoreKit) -> None:
    await check_rule(await kit.store(), unique_name("res"))


async def test_store_planted_strict_comparison_is_caught(kit: StoreKit) -> None:
    with pytest.raises((StaleTokenError, fenced.FencedError)):
        await check_rule(await kit.store(planted=True), unique_name("res"))


async def test_store_mark_survives_a_new_store(kit: StoreKit) -> None:
    resource = unique_name("res")
    first = await kit.store()
    await first.advance(resource, tok(40))
    await first.aclose()
    second = await kit.store()
    with pytest.raises(StaleTokenError):
        await second.advance(resource, tok(39))
    await second.advance(resource, tok(40))


async def test_store_close_is_the_old_spelling_of_aclose(kit: StoreKit) -> None:
    resource = unique_name("res")
    store = await kit.store()
    await store.advance(resource, tok(5))
    with pytest.warns(DeprecationWarning, match=r"await store\.aclose\(\)"):
        await store.close()
    second = await kit.store()
    with pytest.raises(StaleTokenError):
        await second.advance(resource, tok(4))
    await second.aclose()


async def test_store_refuses_a_token_of_another_lock(kit: StoreKit) -> None:
    store, resource = await kit.store(), unique_name("res")
    await store.advance(resource, tok(3, "alpha"))
    with pytest.raises(WrongLockError):
        await store.advance(resource, tok(99, "beta"))
    assert await store.high_water(resource, "alpha") == tok(3, "alpha")


async def test_store_concurrent_advances_end_at_the_maximum(kit: StoreKit) -> None:
    store, resource = await kit.store(), unique_name("res")
    values = [17, 3, 44, 44, 12, 40, 1, 29, 50, 8, 50, 33, 2, 47, 21]
    results = await asyncio.gather(
        *(store.advance(resource, tok(v)) for v in values), return_exceptions=True
    )
    for v, r in zip(values, results, strict=True):
        if r is not None:
            assert isinstance(r, StaleTokenError), r
            assert r.high_water is not None and r.high_water.value > v
    assert await store.high_water(resource, LOCK) == tok(50)


# -- stores: engine specifics ------------------------------------------------------------------


async def test_sqlite_transaction_is_one_step_with_the_fence(tmp_path: Path) -> None:
    path = str(tmp_path / "app.db")
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE jobs (id TEXT PRIMARY KEY, body TEXT, token INTEGER)")
    async with SQLiteFenceStore(path) as store:

        def write(body: str, value: int) -> Callable[[sqlite3.Connection], int]:
            def fn(conn: sqlite3.Connection) -> int:
                conn.execute(
                    "INSERT INTO jobs VALUES ('a', ?, ?) ON CONFLICT(id) DO UPDATE SET "
                    "body = excluded.body, token = excluded.token",
                    (body, value),
                )
                return value

            return fn

        assert await store.transaction("jobs", tok(5), write("five", 5)) == 5
        called: list[int] = []
        with pytest.raises(StaleTokenError):
            await store.transaction("jobs", tok(4), lambda conn: called.append(4))
        assert called == []  # a stale token never reaches the write

        def failing(conn: sqlite3.Connection) -> None:
            write("nine", 9)(conn)
            raise RuntimeError("handler bug")

        with pytest.raises(RuntimeError):
            await store.transaction("jobs", tok(9), failing)
        assert await store.high_water("jobs", LOCK) == tok(5)  # rolled back with the data
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT body, token FROM jobs").fetchall() == [("five", 5)]


async def test_sqlite_transaction_fn_cannot_end_the_fenced_transaction(tmp_path: Path) -> None:
    """fn got an autocommit connection: a COMMIT inside it let later writes land unfenced,
    and an async fn was silently never run while the mark committed. Both are refused now,
    with everything rolled back."""
    path = str(tmp_path / "fences.db")
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE jobs (id TEXT PRIMARY KEY, body TEXT)")
    async with SQLiteFenceStore(path) as store:

        def escapes(how: str) -> Callable[[sqlite3.Connection], None]:
            def fn(conn: sqlite3.Connection) -> None:
                conn.execute("INSERT INTO jobs VALUES ('a', 'before')")
                if how == "commit":
                    conn.commit()
                elif how == "execute":
                    conn.execute("COMMIT")
                elif how == "script":
                    conn.executescript("COMMIT; INSERT INTO jobs VALUES ('b', 'after');")
                else:
                    conn.execute("SAVEPOINT s")
                conn.execute("INSERT INTO jobs VALUES ('c', 'unfenced')")

            return fn

        for value, how in enumerate(["commit", "execute", "script", "savepoint"], start=5):
            with pytest.raises(ConfigurationError, match="begin, commit or roll back"):
                await store.transaction("jobs", tok(value), escapes(how))

        async def async_fn(conn: Any) -> None:
            conn.execute("INSERT INTO jobs VALUES ('d', 'async')")

        with pytest.raises(ConfigurationError, match="plain"):
            await store.transaction("jobs", tok(20), async_fn)
        with pytest.raises(ConfigurationError, match="awaitable"):
            await store.transaction("jobs", tok(21), lambda conn: async_fn(conn))
        assert await store.high_water("jobs", LOCK) is None  # no mark committed alone
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT * FROM jobs").fetchall() == []


async def test_postgres_transaction_fn_contract(pg_dsn: str) -> None:
    import psycopg

    with psycopg.connect(pg_dsn, autocommit=True) as db:
        db.execute("CREATE TABLE jobs (id TEXT PRIMARY KEY, body TEXT)")
    async with PostgresFenceStore(pg_dsn, pool_size=1) as store:
        with pytest.raises(ConfigurationError, match="async def"):
            await store.transaction("jobs", tok(5), lambda conn: None)

        async def commits(conn: Any) -> None:
            await conn.execute("INSERT INTO jobs VALUES ('a', 'x')")
            await conn.execute("COMMIT")

        with pytest.raises(ConfigurationError, match="ended the fenced transaction"):
            await store.transaction("jobs", tok(6), commits)


async def test_postgres_store_reads_a_conflict_as_the_sql_guards_do(pg_dsn: str) -> None:
    """A serialization failure (or deadlock) inside the store's transaction is a conflict to
    retry, as SQLGuard says (FenceConflictError) — not "PostgreSQL unavailable" (psycopg
    derives it from OperationalError, which the store read as a dead server)."""
    from fenced.guards.sql import FenceConflictError

    async def conflicts(conn: Any) -> None:
        # (the server itself raises SQLSTATE 40001, as under SERIALIZABLE contention)
        await conn.execute(
            "DO $$ BEGIN RAISE EXCEPTION 'planted' USING ERRCODE = 'serialization_failure'; END $$"
        )

    async with PostgresFenceStore(pg_dsn, pool_size=1) as store:
        with pytest.raises(FenceConflictError):
            await store.transaction("jobs", tok(5), conflicts)
        await store.advance("jobs", tok(5))  # the rightful holder goes on
        with pytest.raises(fenced.StaleTokenError):
            await store.advance("jobs", tok(4))


async def test_postgres_transaction_is_one_step_with_the_fence(pg_dsn: str) -> None:
    import psycopg

    with psycopg.connect(pg_dsn, autocommit=True) as db:
        db.execute("CREATE TABLE jobs (id TEXT PRIMARY KEY, body TEXT, token BIGINT)")
    async with PostgresFenceStore(pg_dsn, pool_size=2) as store:

        async def write(conn: Any) -> str:
            await conn.execute("INSERT INTO jobs VALUES ('a', 'five', 5)")
            return "ok"

        assert await store.transaction("jobs", tok(5), write) == "ok"

        async def failing(conn: Any) -> None:
            await conn.execute("UPDATE jobs SET body = 'nine', token = 9")
            raise RuntimeError("handler bug")

        with pytest.raises(RuntimeError):
            await store.transaction("jobs", tok(9), failing)
        with pytest.raises(StaleTokenError):
            await store.transaction("jobs", tok(4), write)
        assert await store.high_water("jobs", LOCK) == tok(5)
    with psycopg.connect(pg_dsn) as db:
        assert db.execute("SELECT body, token FROM jobs").fetchall() == [("five", 5)]


async def test_redis_guard_writes_in_the_same_script(redis_server: RedisServer) -> None:
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        store, resource = RedisFenceStore(client), unique_name("res")
        await store.advance(resource, tok(5))
        guard = store.guard(resource, LOCK)
        key = f"{{{resource}}}:data"
        assert await guard.set(key, "five", token=tok(5))
        with pytest.raises(StaleTokenError):
            await guard.set(key, "four", token=tok(4))
        assert await client.get(key) == b"five"
    finally:
        await client.aclose()


async def test_sqlite_normal_never_waits_for_a_lock_on_the_event_loop(tmp_path: Path) -> None:
    path = str(tmp_path / "fences.db")
    async with SQLiteFenceStore(path, synchronous="NORMAL") as store:
        assert store.inline
        await store.advance("r", tok(1))
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another writer holds the write lock
        try:
            task = asyncio.create_task(store.advance("r", tok(2)))
            loop_turns = 0
            while loop_turns < 20:  # the loop keeps turning while the advance waits
                await asyncio.sleep(0)
                loop_turns += 1
            assert not task.done()
        finally:
            other.execute("COMMIT")
            other.close()
        await asyncio.wait_for(task, 10)
        assert await store.high_water("r", LOCK) == tok(2)


async def test_dead_engines_raise_backend_unavailable(refused_port: int) -> None:
    port = refused_port  # (held throughout: see tests.helpers.dead_port)
    pg = PostgresFenceStore(f"postgresql://postgres@127.0.0.1:{port}/x", connect_timeout=1)
    with pytest.raises(BackendUnavailable):
        await pg.advance("r", tok(1))
    client = redis.asyncio.Redis(
        host="127.0.0.1", port=port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    try:
        with pytest.raises(BackendUnavailable):
            await RedisFenceStore(client).advance("r", tok(1))
    finally:
        await client.aclose()
    # (a directory that does not exist is no dead engine: refused at once, as the source does)
    sqlite_store = SQLiteFenceStore("/nonexistent-dir/x/fences.db")
    with pytest.raises(ConfigurationError, match="No such file or directory"):
        await sqlite_store.advance("r", tok(1))
    await sqlite_store.aclose()


async def test_postgres_store_recovers_after_a_server_restart(pg_server: Any, pg_dsn: str) -> None:
    store = PostgresFenceStore(pg_dsn, pool_size=1)
    try:
        await store.advance("r", tok(3))
        await asyncio.to_thread(pg_server.restart)
        with contextlib.suppress(BackendUnavailable):  # the pooled connection died with it
            await store.advance("r", tok(4))
        await store.advance("r", tok(5))  # a fresh connection
        with pytest.raises(StaleTokenError):
            await store.advance("r", tok(2))
    finally:
        await store.aclose()


# -- the middleware ----------------------------------------------------------------------------


def jobs_resource(scope: Any) -> str | None:
    return "jobs" if scope["path"].startswith("/jobs") else None


class Gate:
    """Makes one request's handler wait (deterministic interleaving of two requests)."""

    def __init__(self) -> None:
        self.pause_value: int | None = None
        self.reached = asyncio.Event()
        self.go = asyncio.Event()

    async def maybe_wait(self, token: FencingToken) -> None:
        if token.value == self.pause_value:
            self.reached.set()
            await self.go.wait()


def make_app(
    store: Any, db_path: str | None, gate: Gate | None = None, *, through_store: bool = True
) -> Starlette:
    """A Starlette app whose POST /jobs/{id} writes a row, fenced by the middleware.

    ``through_store=False`` is the two-step pattern: the handler trusts the middleware's
    check and writes directly (the planted bug the atomicity test must catch).
    """
    gate = gate or Gate()

    async def post_job(request: Request) -> JSONResponse:
        token: FencingToken = request.state.fencing_token
        resource: str = request.state.fencing_resource
        body = (await request.body()).decode()
        job = request.path_params["id"]
        await gate.maybe_wait(token)

        def write(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO jobs VALUES (?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                "body = excluded.body, token = excluded.token",
                (job, body, token.value),
            )

        if db_path is not None:
            if through_store:
                await request.state.fencing_store.transaction(resource, token, write)
            else:
                with sqlite3.connect(db_path) as conn:
                    write(conn)
        return JSONResponse(
            {"token": str(token), "resource": resource, "state": sorted(request.state._state)}
        )

    async def get_job(request: Request) -> PlainTextResponse:
        return PlainTextResponse("read " + request.path_params["id"])

    async def free(request: Request) -> PlainTextResponse:
        return PlainTextResponse("not fenced")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        yield {"from_lifespan": "yes"}

    inner = Starlette(
        routes=[
            Route("/jobs/{id}", post_job, methods=["POST", "PUT"]),
            Route("/jobs/{id}", get_job, methods=["GET"]),
            Route("/free", free, methods=["POST"]),
        ],
        lifespan=lifespan,
        exception_handlers={StaleTokenError: fencing_exception_handler},
    )
    inner.add_middleware(FencingMiddleware, store=store, lock=LOCK, resource=jobs_resource)
    return inner


def app_db(tmp_path: Path) -> str:
    path = str(tmp_path / "app.db")
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, body TEXT, token INTEGER)"
        )
    return path


@contextlib.asynccontextmanager
async def client_for(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        yield client


def problem(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"] == PROBLEM_CONTENT_TYPE
    doc: dict[str, Any] = response.json()
    assert doc["status"] == response.status_code
    assert {"type", "title", "status", "detail"} <= set(doc)
    return doc


async def test_middleware_responses(tmp_path: Path) -> None:
    db = app_db(tmp_path)
    async with SQLiteFenceStore(db) as store, client_for(make_app(store, db)) as client:
        r = await client.post("/jobs/a", content="x")
        assert r.status_code == 428
        assert problem(r)["header"] == "Fencing-Token"

        for bad in ["jobs:0", "jobs:-1", "jobs", "jobs:12x", "7", "jobs:99999999999999999999"]:
            r = await client.post("/jobs/a", headers={"Fencing-Token": bad})
            assert r.status_code == 400, bad
            assert problem(r)["type"].endswith("invalid-token") and problem(r)["token"] == bad

        r = await client.post("/jobs/a", headers={"Fencing-Token": "other:5"})
        assert r.status_code == 400 and problem(r)["type"].endswith("wrong-lock")
        assert problem(r)["lock"] == LOCK

        r = await client.post(
            "/jobs/a", headers=[("Fencing-Token", "jobs:5"), ("Fencing-Token", "jobs:6")]
        )
        assert r.status_code == 400  # ambiguous

        r = await client.post("/jobs/a", headers={"Fencing-Token": "jobs:8"}, content="eight")
        assert r.status_code == 200, r.text
        assert r.json()["token"] == "jobs:8" and r.json()["resource"] == "jobs"
        assert {"fencing_token", "fencing_resource", "fencing_store"} <= set(r.json()["state"])

        r = await client.post("/jobs/a", headers={"Fencing-Token": "jobs:8"}, content="eight again")
        assert r.status_code == 200  # equal token accepted

        r = await client.post("/jobs/a", headers={"Fencing-Token": "jobs:7"}, content="seven")
        assert r.status_code == 409
        doc = problem(r)
        assert (
            doc["token"] == "jobs:7" and doc["high_water"] == "jobs:8" and doc["resource"] == "jobs"
        )
        assert doc["type"].endswith("stale-token") and doc["title"] == "Stale fencing token"

        r = await client.put("/jobs/a", headers={"Fencing-Token": "jobs:9"}, content="nine")
        assert r.status_code == 200

        assert (await client.get("/jobs/a")).text == "read a"  # reads pass without a token
        assert (await client.post("/free")).text == "not fenced"  # unfenced routes pass
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT body, token FROM jobs").fetchall() == [("nine", 9)]


async def test_unavailable_store_gives_503(refused_port: int) -> None:
    port = refused_port  # (held throughout: see tests.helpers.dead_port)
    store = PostgresFenceStore(f"postgresql://postgres@127.0.0.1:{port}/x", connect_timeout=1)
    async with client_for(make_app(store, None)) as client:
        r = await client.post("/jobs/a", headers={"Fencing-Token": "jobs:1"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert problem(r)["type"].endswith("fence-unavailable")


async def test_safe_methods_are_configurable(tmp_path: Path) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await PlainTextResponse("ok")(scope, receive, send)

    async with SQLiteFenceStore(str(tmp_path / "f.db")) as store:
        strict = FencingMiddleware(app, store=store, lock=LOCK, safe_methods=())
        async with client_for(strict) as client:
            assert (await client.get("/anything")).status_code == 428
            assert (
                await client.get("/anything", headers={"fencing-token": "jobs:1"})
            ).status_code == 200
            r = await client.get("/anything", headers={"Fencing-Token": "jobs:1"})
            assert r.status_code == 200  # header names are case-insensitive; equal token


# -- the same checks over every store, and the planted `<` store, through HTTP ---------------


async def http_rule_check(store: Any) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        token = scope["state"]["fencing_token"]
        await PlainTextResponse(str(token))(scope, receive, send)

    mw = FencingMiddleware(
        app, store=store, lock=LOCK, resource=lambda scope: scope["path"].strip("/")
    )
    path = "/" + unique_name("res")
    async with client_for(mw) as client:

        async def post(value: int) -> httpx.Response:
            return await client.post(path, headers={"Fencing-Token": f"jobs:{value}"})

        assert (await post(5)).text == "jobs:5"
        r = await post(5)
        assert r.status_code == 200, f"equal token refused: {r.status_code} {r.text}"
        assert (await post(9)).status_code == 200
        r = await post(8)
        assert r.status_code == 409 and (problem(r)["token"], problem(r)["high_water"]) == (
            "jobs:8",
            "jobs:9",
        )


async def test_http_rule_on_every_store(kit: StoreKit) -> None:
    await http_rule_check(await kit.store())


async def test_http_planted_bug_store_is_caught(kit: StoreKit) -> None:
    with pytest.raises(AssertionError, match="equal token refused"):
        await http_rule_check(await kit.store(planted=True))


# -- atomicity of the handler's write ------------------------------------------------------------


async def interleaved_writes(tmp_path: Path, through_store: bool) -> list[tuple[str, int]]:
    """Request A (7) passes the middleware, then stops; B (8) passes and writes; A resumes."""
    db = app_db(tmp_path)
    gate = Gate()
    gate.pause_value = 7
    async with (
        SQLiteFenceStore(db) as store,
        client_for(make_app(store, db, gate, through_store=through_store)) as client,
    ):
        a = asyncio.create_task(
            client.post("/jobs/x", headers={"Fencing-Token": "jobs:7"}, content="A")
        )
        await asyncio.wait_for(gate.reached.wait(), 10)
        b = await client.post("/jobs/x", headers={"Fencing-Token": "jobs:8"}, content="B")
        assert b.status_code == 200
        gate.go.set()
        ra = await asyncio.wait_for(a, 10)
        if through_store:
            assert ra.status_code == 409, ra.text  # A's own fenced write found 8
            assert problem(ra)["high_water"] == "jobs:8"
    with sqlite3.connect(db) as conn:
        rows: list[tuple[str, int]] = conn.execute("SELECT body, token FROM jobs").fetchall()
    return rows


async def test_handler_writing_through_the_store_is_fenced_atomically(tmp_path: Path) -> None:
    assert await interleaved_writes(tmp_path, through_store=True) == [("B", 8)]


async def test_planted_bug_check_in_middleware_then_write_is_caught(tmp_path: Path) -> None:
    # The same interleaving against a handler that writes outside the store's transaction:
    # the stale request A overwrites B's data. This is why the docs insist on transaction().
    assert await interleaved_writes(tmp_path, through_store=False) == [("A", 7)]


async def test_raw_app_stale_error_before_response_becomes_409(tmp_path: Path) -> None:
    async with SQLiteFenceStore(str(tmp_path / "f.db")) as store:

        async def app(scope: Any, receive: Any, send: Any) -> None:
            state = scope["state"]
            await state["fencing_store"].advance(state["fencing_resource"], tok(100))
            await state["fencing_store"].advance(state["fencing_resource"], state["fencing_token"])

        async with client_for(FencingMiddleware(app, store=store, lock=LOCK)) as client:
            r = await client.post("/", headers={"Fencing-Token": "jobs:3"})
        assert r.status_code == 409 and problem(r)["high_water"] == "jobs:100"


# -- non-http scopes -----------------------------------------------------------------------------


async def test_non_http_scopes_pass_through_untouched(tmp_path: Path) -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)
        if scope["type"] == "lifespan":
            message = await receive()
            assert message["type"] == "lifespan.startup"
            await send({"type": "lifespan.startup.complete"})

    store = SQLiteFenceStore(str(tmp_path / "f.db"))
    mw = FencingMiddleware(app, store=store, lock=LOCK, safe_methods=())
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "lifespan.startup"}

    async def send(message: Any) -> None:
        sent.append(message)

    lifespan = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    websocket = {"type": "websocket", "path": "/ws", "headers": [], "asgi": {"version": "3.0"}}
    await mw(lifespan, receive, send)
    await mw(websocket, receive, send)
    assert seen[0] is lifespan and seen[1] is websocket
    assert sent == [{"type": "lifespan.startup.complete"}]
    await store.aclose()


# -- a real server: uvicorn on a random port -----------------------------------------------------


def test_real_server_with_sync_client_and_leases(tmp_path: Path, memory_url: str) -> None:
    db = app_db(tmp_path)
    store = SQLiteFenceStore(db)  # opened lazily on the server's loop
    app = make_app(store, db)

    @contextlib.asynccontextmanager
    async def lifespan(app_: Starlette) -> AsyncIterator[dict[str, Any]]:
        yield {"from_lifespan": "yes"}
        await store.aclose()

    app.router.lifespan_context = lifespan
    with (
        serve(app) as base,
        fenced.connect(memory_url) as locks,
        httpx.Client(base_url=base) as client,
    ):
        with locks.lock(LOCK, ttl=10) as old:
            old_token = old.token
        with locks.lock(LOCK, ttl=10) as lease:
            r = client.post("/jobs/r", content="new", auth=FencingAuth(lease))
            assert r.status_code == 200 and r.json()["token"] == str(lease.token)
            # lifespan state reaches the handler next to the fencing keys
            assert {"from_lifespan", "fencing_token"} <= set(r.json()["state"])
            with pytest.raises(StaleTokenError) as info:
                client.post("/jobs/r", content="stale", auth=FencingAuth(old_token))
            assert info.value.token == old_token and info.value.high_water == lease.token
            assert info.value.resource == "jobs"
        with pytest.raises(NotHeldError):  # released: refuses to send
            client.post("/jobs/r", auth=FencingAuth(lease))
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT body FROM jobs").fetchall() == [("new",)]


# -- the httpx client ----------------------------------------------------------------------------


def echo_app(calls: list[Any], status: int = 200, body: dict[str, Any] | None = None) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        headers = dict(scope["headers"])
        calls.append(headers.get(b"fencing-token"))
        payload = json.dumps(body or {}).encode()
        ctype = PROBLEM_CONTENT_TYPE if status == 409 else "application/json"
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", ctype.encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    return app


STALE_BODY = {
    "type": "tag:fenced,2026:problem:stale-token",
    "title": "Stale fencing token",
    "status": 409,
    "detail": "stale",
    "token": "jobs:7",
    "high_water": "jobs:8",
    "resource": "jobs",
}


async def test_async_client_sends_the_token_and_refuses_without_a_held_lease(
    memory_url: str,
) -> None:
    calls: list[Any] = []
    async with fenced.connect_async(memory_url) as locks:
        lease = locks.lock(LOCK, ttl=10)
        auth = FencingAuth(lease)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=echo_app(calls)), base_url="http://t"
        ) as client:
            with pytest.raises(NotHeldError):  # never acquired
                await client.post("/", auth=auth)
            await lease.acquire()
            await client.post("/", auth=auth)
            assert calls == [str(lease.token).encode()]
            await lease.release()
            with pytest.raises(NotHeldError):
                await client.post("/", auth=auth)

            short = locks.lock(LOCK, ttl=0.3, auto_renew=False)
            await short.acquire()
            await asyncio.wait_for(short.lost.wait(), 10)
            with pytest.raises(LeaseLostError):
                await client.post("/", auth=FencingAuth(short))
        assert len(calls) == 1  # nothing was sent without a held lease


async def test_async_client_raises_stale_on_a_fenced_409() -> None:
    calls: list[Any] = []
    transport = httpx.ASGITransport(app=echo_app(calls, 409, STALE_BODY))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        with pytest.raises(StaleTokenError) as info:
            await client.post("/", auth=FencingAuth(tok(7)))
        assert (info.value.token, info.value.high_water, info.value.resource) == (
            tok(7),
            tok(8),
            "jobs",
        )
        r = await client.post("/", auth=FencingAuth(tok(7), check_stale=False))
        assert r.status_code == 409 and stale_error(r) is not None
    hooked = httpx.AsyncClient(
        transport=transport, base_url="http://t", event_hooks={"response": [acheck_stale]}
    )
    async with hooked:
        with pytest.raises(StaleTokenError):
            await hooked.post("/")


def test_sync_event_hook_and_foreign_409s() -> None:
    def transport(body: dict[str, Any]) -> httpx.MockTransport:
        return httpx.MockTransport(
            lambda request: httpx.Response(
                409,
                headers={"content-type": PROBLEM_CONTENT_TYPE},
                content=json.dumps(body).encode(),
            )
        )

    with httpx.Client(
        transport=transport(STALE_BODY), event_hooks={"response": [check_stale]}
    ) as c:
        with pytest.raises(StaleTokenError) as info:
            c.post("http://t/")
        assert (info.value.token, info.value.high_water) == (tok(7), tok(8))
    other_conflict = {"type": "about:blank", "title": "Conflict", "status": 409}
    with httpx.Client(
        transport=transport(other_conflict), event_hooks={"response": [check_stale]}
    ) as c:
        assert c.post("http://t/").status_code == 409  # not a fenced problem: left alone
    with httpx.Client(transport=transport(other_conflict), auth=FencingAuth(tok(3))) as c:
        assert c.post("http://t/").status_code == 409


# -- metrics ---------------------------------------------------------------------------------------


async def test_metrics(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    metrics = FenceMetrics(registry)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await PlainTextResponse("ok")(scope, receive, send)

    async with SQLiteFenceStore(str(tmp_path / "f.db")) as store:
        mw = FencingMiddleware(app, store=store, lock=LOCK, metrics=metrics)
        async with client_for(mw) as client:
            for value in (3, 3, 5, 4):
                await client.post("/", headers={"Fencing-Token": f"jobs:{value}"})
            await client.post("/")
            await client.post("/", headers={"Fencing-Token": "nope"})

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"resource": LOCK, **labels})

    assert sample("fenced_http_accepted_total") == 3
    assert sample("fenced_http_rejected_total", reason="stale") == 1
    assert sample("fenced_http_rejected_total", reason="missing") == 1
    assert sample("fenced_http_rejected_total", reason="invalid") == 1
    assert sample("fenced_http_high_water") == 5


def test_fastapi_app_if_installed(tmp_path: Path) -> None:
    fastapi = pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    api = fastapi.FastAPI()

    @api.post("/jobs/{job}")
    async def post(job: str, request: Request) -> dict[str, str]:
        return {"token": str(request.state.fencing_token)}

    store = SQLiteFenceStore(str(tmp_path / "f.db"))
    api.add_middleware(FencingMiddleware, store=store, lock=LOCK, resource=jobs_resource)
    with TestClient(api) as client:
        assert client.post("/jobs/a", headers={"Fencing-Token": "jobs:2"}).json() == {
            "token": "jobs:2"
        }
        assert client.post("/jobs/a", headers={"Fencing-Token": "jobs:1"}).status_code == 409


async def test_middleware_with_verify_keys_takes_only_well_signed_tokens(tmp_path: Path) -> None:
    """The header must carry a token signed by a key the middleware holds: unsigned, forged
    and unknown-key tokens get 400 before the mark moves; a signed stale one still 409."""
    from fenced import HmacKey, Keyring
    from fenced._core.signing import token_message
    from fenced.guards.asgi import FencingMiddleware

    key = HmacKey("k1", b"s" * 32)

    def signed(value: int, k: HmacKey = key) -> str:
        sig = k.sign(token_message("jobs", value, k.kid))
        return str(FencingToken("jobs", value, (k.kid, sig)))

    async def ok(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async with SQLiteFenceStore(str(tmp_path / "f.db")) as store:
        app = FencingMiddleware(ok, store=store, lock="jobs", verify=Keyring([key]))
        async with client_for(app) as client:

            async def post(token: str) -> httpx.Response:
                return await client.post("/x", headers={"Fencing-Token": token})

            assert (await post(signed(5))).status_code == 200
            for bad in ("jobs:6", forged(signed(7)), signed(8, HmacKey("k9", b"o" * 32))):
                reply = await post(bad)
                assert reply.status_code == 400, bad
                assert problem(reply)["type"].endswith("invalid-token")
            assert (await post(signed(4))).status_code == 409
            assert await store.high_water("jobs", "jobs") == FencingToken("jobs", 5)


def test_client_reads_a_fenced_409_whatever_the_media_type_case() -> None:
    """A media type is case-insensitive and may carry parameters (a proxy may rewrite it):
    'Application/Problem+JSON ; charset=utf-8' is the same problem document."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = json.dumps(STALE_BODY).encode()
        ctype = b"Application/Problem+JSON ; charset=utf-8"
        headers = [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 409, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    with serve(app) as base, httpx.Client(auth=FencingAuth(tok(7))) as client:
        with pytest.raises(StaleTokenError) as info:
            client.post(base + "/jobs/1")
        assert (info.value.token, info.value.high_water) == (tok(7), tok(8))
