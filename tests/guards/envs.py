"""Every guard behind one small interface, for the guard conformance suite.

A :class:`GuardEnv` guards one data item in one real resource. ``write(token, value)`` is a
guarded write through the real guard; ``raw_write(value)`` writes the item without any
fencing (what a client that skips the guard does); ``read()`` reads the item;
``reopen()`` drops every guard and connection object and makes new ones on the same
resource (a restarted client). ``planted(bug)`` returns a broken ``write`` for the same
resource, so the suite can show that each of its checkers catches that bug:

* ``"lt"`` — ``<`` for ``<=``: a holder's second write with its own token is refused;
* ``"check_then_write"`` — read the mark, compare in the client, then write separately (the
  hook ``between`` runs in the gap, where another writer can slip in);
* ``"client_side"`` — the mark kept in the client process, not in the resource.

The last two are built here once from ``high_water``/``raw_write``; ``"lt"`` is planted in
each guard's own comparison (its SQL, Lua, compare hook), so it runs the guard's real path.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aetcd
import psycopg
import pytest
import redis

from fenced import FencingToken, InvalidTokenError, StaleTokenError
from fenced.guards.dynamodb import DynamoDBGuard
from fenced.guards.etcd import AsyncEtcdGuard, EtcdGuard
from fenced.guards.files import FileGuard, HighWaterFile
from fenced.guards.redis import SET_SCRIPT, RedisGuard, eval_script
from fenced.guards.s3 import S3VersionStore
from fenced.guards.sql import RowGuard, SQLGuard
from fenced.guards.zookeeper import ZooKeeperGuard
from tests.guards.planted import LessThanGuard, LessThanRowGuard
from tests.helpers import asyncmy_args, unique_name

LOCK = "conformance"
Write = Callable[[FencingToken, str], None]


def tok(value: int, lock: str = LOCK) -> FencingToken:
    return FencingToken(lock, value)


class GuardEnv:
    name = "base"
    verify_keys: Any = None  # set, then reopen(): the guards check tokens with it (verify=)
    signs = True  # False: a store whose middleware, not the store, verifies signatures
    # Why a ``<`` planted in the guard's comparison changes no verdict here (None: it does).
    lt_unobservable: str | None = None

    def write(self, token: FencingToken | str, value: str) -> None:
        raise NotImplementedError

    def raw_write(self, value: str) -> None:
        raise NotImplementedError

    def read(self) -> str | None:
        raise NotImplementedError

    def high_water(self) -> FencingToken | None:
        raise NotImplementedError

    def reopen(self) -> None:
        raise NotImplementedError

    def planted_lt(self) -> Write:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def planted(self, bug: str, between: Callable[[], None] = lambda: None) -> Write:
        if bug == "lt":
            return self.planted_lt()
        if bug == "check_then_write":

            def check_then_write(token: FencingToken, value: str) -> None:
                mark = self.high_water()
                if mark is not None and token.value < mark.value:
                    raise StaleTokenError(token, mark, self.name)
                between()
                self.raw_write(value)

            return check_then_write
        if bug == "client_side":
            seen: list[int] = [0]

            def client_side(token: FencingToken, value: str) -> None:
                if token.value < seen[0]:
                    raise StaleTokenError(token, tok(seen[0]), self.name)
                seen[0] = token.value
                self.raw_write(value)

            return client_side
        raise ValueError(bug)

    def reopened_planted(self, bug: str) -> Write:
        """The planted write, as a restarted client would make it (fresh state)."""
        return self.planted(bug)


def refusal_violations(
    env: GuardEnv, refused: dict[str, Any], data: str, mark: FencingToken
) -> list[str]:
    """Each of ``refused`` (what it is -> the token) written: each must raise
    InvalidTokenError, with the data still ``data`` and the mark still ``mark``."""
    bad: list[str] = []
    for what, token in refused.items():
        try:
            env.write(token, what)
            bad.append(f"{what}: accepted")
        except InvalidTokenError:
            pass
        if env.read() != data or env.high_water() != mark:
            bad.append(f"{what}: the data or the mark moved")
    return bad


# -- SQL ----------------------------------------------------------------------------------


class _SQLEnv(GuardEnv):
    """A table ``data`` (id, v) in SQLite or PostgreSQL; one connection in manual mode."""

    def __init__(self, kind: str, target: str, *, mysql: dict[str, Any] | None = None) -> None:
        self.kind = kind
        self.target = target
        self.mysql = mysql or {}
        self.table = unique_name("data").replace("-", "_")
        self._local = threading.local()
        self._all: list[Any] = []
        self.setup()

    @property
    def conn(self) -> Any:
        """This thread's connection (racing writers each need their own transaction)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
            self._all.append(conn)
        return conn

    def _connect(self) -> Any:
        if self.kind == "sqlite":
            conn = sqlite3.connect(
                self.target, isolation_level=None, timeout=20, check_same_thread=False
            )
            conn.execute("PRAGMA journal_mode=WAL")
            return conn
        if self.kind == "mysql":
            return MySQLConn(self.mysql)
        return psycopg.connect(self.target, autocommit=True)

    def q(self, sql: str) -> str:
        if self.kind == "mysql":
            sql = sql.replace(
                "ON CONFLICT (id) DO UPDATE SET v = excluded.v",
                "ON DUPLICATE KEY UPDATE v = VALUES(v)",
            )
        return sql if self.kind == "sqlite" else sql.replace("?", "%s")

    def begin(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE" if self.kind == "sqlite" else "BEGIN")

    def setup(self) -> None:
        raise NotImplementedError

    def read(self) -> str | None:
        row = self.conn.execute(f"SELECT v FROM {self.table} WHERE id = 1").fetchone()
        return None if row is None else row[0]

    def reopen(self) -> None:
        self._drop()

    def _drop(self) -> None:
        """Close every connection (each thread makes a new one on its next use)."""
        for conn in self._all:
            conn.close()
        self._all.clear()
        self._local = threading.local()

    def close(self) -> None:
        self._drop()


class MySQLConn:
    """A PyMySQL connection in autocommit mode, spoken to like the others (``execute`` with
    ``?`` already turned into ``%s``); the guards get the PyMySQL connection itself."""

    def __init__(self, args: dict[str, Any]) -> None:
        import pymysql

        self.raw = pymysql.connect(**args, autocommit=True)

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        cur = self.raw.cursor()
        cur.execute(sql, params)
        return cur

    def close(self) -> None:
        self.raw.close()


def _raw(conn: Any) -> Any:
    return conn.raw if isinstance(conn, MySQLConn) else conn


class SQLFenceEnv(_SQLEnv):
    """:class:`SQLGuard`: the fence table, checked first in the caller's transaction."""

    guard_class: type[SQLGuard] = SQLGuard

    def setup(self) -> None:
        self.guard = self.guard_class(self.table, lock=LOCK, verify=self.verify_keys)
        self.guard.install(_raw(self.conn))
        self.conn.execute(f"CREATE TABLE {self.table} (id INTEGER PRIMARY KEY, v TEXT)")

    def _transaction(self, guard: SQLGuard | None, token: Any, value: str) -> None:
        self.begin()
        try:
            if guard is not None:
                guard.check(_raw(self.conn), token=token)
            self.conn.execute(
                self.q(
                    f"INSERT INTO {self.table} (id, v) VALUES (1, ?) "
                    "ON CONFLICT (id) DO UPDATE SET v = excluded.v"
                ),
                (value,),
            )
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def write(self, token: FencingToken | str, value: str) -> None:
        self._transaction(self.guard, token, value)

    def raw_write(self, value: str) -> None:
        self._transaction(None, None, value)

    def high_water(self) -> FencingToken | None:
        return self.guard.high_water(_raw(self.conn))

    def reopen(self) -> None:
        super().reopen()
        self.guard = self.guard_class(self.table, lock=LOCK, verify=self.verify_keys)

    def planted_lt(self) -> Write:
        guard = LessThanGuard(self.table, lock=LOCK)
        return lambda token, value: self._transaction(guard, token, value)


class SQLPipelineEnv(SQLFenceEnv):
    """:meth:`SQLGuard.transaction` on PostgreSQL: the check riding with BEGIN, the write,
    the recheck riding with COMMIT. (The planted guard keeps the awaited check: its plant is
    in the plan; the ride's own plants are in tests/guards/test_guard_sql.py.)"""

    def _transaction(self, guard: SQLGuard | None, token: Any, value: str) -> None:
        if guard is None or guard is not self.guard:
            super()._transaction(guard, token, value)
            return
        with guard.transaction(self.conn, token=token):
            self.conn.execute(
                self.q(
                    f"INSERT INTO {self.table} (id, v) VALUES (1, ?) "
                    "ON CONFLICT (id) DO UPDATE SET v = excluded.v"
                ),
                (value,),
            )


class SQLRowEnv(_SQLEnv):
    """:class:`RowGuard`: the token column in the guarded row, one conditional upsert."""

    def setup(self) -> None:
        self.conn.execute(f"CREATE TABLE {self.table} (id INTEGER PRIMARY KEY, v TEXT)")
        self.guard = RowGuard(self.table, lock=LOCK, verify=self.verify_keys)
        self.guard.install(_raw(self.conn))

    def write(self, token: FencingToken | str, value: str) -> None:
        self.guard.insert_or_update(
            _raw(self.conn), token=token, key={"id": 1}, values={"v": value}
        )

    def raw_write(self, value: str) -> None:
        self.conn.execute(
            self.q(
                f"INSERT INTO {self.table} (id, v) VALUES (1, ?) "
                "ON CONFLICT (id) DO UPDATE SET v = excluded.v"
            ),
            (value,),
        )

    def high_water(self) -> FencingToken | None:
        try:
            return self.guard.high_water(_raw(self.conn), {"id": 1})
        except LookupError:
            return None

    def reopen(self) -> None:
        super().reopen()
        self.guard = RowGuard(self.table, lock=LOCK, verify=self.verify_keys)

    def planted_lt(self) -> Write:
        guard = LessThanRowGuard(self.table, lock=LOCK)
        return lambda token, value: bool(
            guard.insert_or_update(_raw(self.conn), token=token, key={"id": 1}, values={"v": value})
        )  # type: ignore[func-returns-value]


# -- Redis --------------------------------------------------------------------------------


class RedisEnv(GuardEnv):
    name = "redis"

    def __init__(self, port: int) -> None:
        self.port = port
        self.resource = unique_name("res")
        self.key = f"{{{self.resource}}}:data"
        self.reopen()

    def reopen(self) -> None:
        if hasattr(self, "guard"):
            self.close()
        self.client = redis.Redis(port=self.port)
        self.guard = RedisGuard(self.client, self.resource, lock=LOCK, verify=self.verify_keys)

    def write(self, token: FencingToken | str, value: str) -> None:
        self.guard.set(self.key, value, token=token)

    def raw_write(self, value: str) -> None:
        self.client.set(self.key, value)

    def read(self) -> str | None:
        raw = self.client.get(self.key)
        return None if raw is None else raw.decode()

    def high_water(self) -> FencingToken | None:
        return self.guard.high_water()

    def planted_lt(self) -> Write:
        class LtRedisGuard(RedisGuard):
            set_script = SET_SCRIPT.replace("if c < 0 then", "if c <= 0 then")

        assert LtRedisGuard.set_script != SET_SCRIPT, "re-plant the bug"
        guard = LtRedisGuard(self.client, self.resource, lock=LOCK)
        return lambda token, value: bool(guard.set(self.key, value, token=token))  # type: ignore[func-returns-value]

    def close(self) -> None:
        self.guard.close()
        self.client.close()


class _OnOneLoop:
    """Runs an async guard's coroutines on one event loop of the env's, one at a time (the
    suite's racing threads then take turns: the atomicity shown is the resource's)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._turn = threading.Lock()

    def run(self, coro: Any) -> Any:
        with self._turn:
            return self.loop.run_until_complete(coro)

    def close(self, *closing: Any) -> None:
        """``aclose()`` each of ``closing`` that is not None, then end the loop."""
        for obj in closing:
            if obj is not None:
                self.run(obj.aclose())
        self.loop.close()


class AsyncRedisEnv(GuardEnv):
    """:class:`AsyncRedisGuard` (``redis.asyncio``): the same Lua, sent by the async twin."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.resource = unique_name("res")
        self.key = f"{{{self.resource}}}:data"
        self.on = _OnOneLoop()
        self.sync = redis.Redis(port=port)
        self.reopen()

    def reopen(self) -> None:
        import redis.asyncio as aioredis

        from fenced.guards.redis import AsyncRedisGuard

        old = getattr(self, "client", None)
        if old is not None:
            self.on.run(old.aclose())
        self.client = aioredis.Redis(port=self.port)
        self.guard = AsyncRedisGuard(self.client, self.resource, lock=LOCK, verify=self.verify_keys)

    def write(self, token: FencingToken | str, value: str) -> None:
        self.on.run(self.guard.set(self.key, value, token=token))

    def raw_write(self, value: str) -> None:
        self.sync.set(self.key, value)

    def read(self) -> str | None:
        raw = self.sync.get(self.key)
        return None if raw is None else raw.decode()

    def high_water(self) -> FencingToken | None:
        return self.on.run(self.guard.high_water())  # type: ignore[no-any-return]

    def planted_lt(self) -> Write:
        from fenced.guards.redis import AsyncRedisGuard

        class Lt(AsyncRedisGuard):
            set_script = SET_SCRIPT.replace("if c < 0 then", "if c <= 0 then")

        guard = Lt(self.client, self.resource, lock=LOCK)
        return lambda token, value: bool(self.on.run(guard.set(self.key, value, token=token)))  # type: ignore[func-returns-value]

    def close(self) -> None:
        self.on.run(self.guard.aclose())
        self.on.run(self.client.aclose())
        self.on.close()
        self.sync.close()


class _StoreEnv(GuardEnv):
    """An ASGI middleware's store: ``transaction(resource, token, fn)`` runs ``fn`` in one
    transaction with the fence check. Subclasses make the store (``_store``) and the write
    (``_put``); the store verifies no signature (the middleware in front of it does)."""

    signs = False

    def _store(self, guard_class: type[SQLGuard]) -> Any:
        raise NotImplementedError

    def _put(self, value: str) -> Callable[[Any], Any]:
        raise NotImplementedError

    def _start(self) -> None:
        self.on = _OnOneLoop()
        self.store = self._store(SQLGuard)

    def reopen(self) -> None:
        self.on.run(self.store.aclose())
        self.store = self._store(SQLGuard)

    def _write(self, store: Any, token: FencingToken | str, value: str) -> None:
        tok_ = FencingToken.coerce(token, LOCK)
        self.on.run(store.transaction("item", tok_, self._put(value)))

    def write(self, token: FencingToken | str, value: str) -> None:
        self._write(self.store, token, value)

    def high_water(self) -> FencingToken | None:
        return self.on.run(self.store.high_water("item", LOCK))  # type: ignore[no-any-return]

    def planted_lt(self) -> Write:
        store = self._planted = self._store(LessThanGuard)
        return lambda token, value: self._write(store, token, value)

    def close(self) -> None:
        self.on.close(self.store, getattr(self, "_planted", None))


class SQLiteStoreEnv(_StoreEnv):
    """The ASGI middleware's :class:`SQLiteFenceStore`: ``fn(conn)`` on a sqlite3 connection."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        with sqlite3.connect(self.path) as db:
            db.execute("CREATE TABLE IF NOT EXISTS data (id INTEGER PRIMARY KEY, v TEXT)")
        db.close()
        self._start()

    def _store(self, guard_class: type[SQLGuard]) -> Any:
        from fenced.guards.asgi import SQLiteFenceStore

        class Store(SQLiteFenceStore):
            pass

        Store.guard_class = guard_class
        return Store(self.path)

    def _put(self, value: str) -> Callable[[sqlite3.Connection], None]:
        def fn(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO data VALUES (1, ?) ON CONFLICT (id) DO UPDATE SET v = excluded.v",
                (value,),
            )

        return fn

    def raw_write(self, value: str) -> None:
        with sqlite3.connect(self.path, isolation_level=None) as db:
            self._put(value)(db)
        db.close()

    def read(self) -> str | None:
        with sqlite3.connect(self.path) as db:
            row = db.execute("SELECT v FROM data WHERE id = 1").fetchone()
        db.close()
        return None if row is None else row[0]


# -- etcd ---------------------------------------------------------------------------------


class EtcdEnv(GuardEnv):
    name = "etcd"

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.resource = unique_name("res")
        self.key = f"{self.resource}/data"
        self.guard = EtcdGuard(endpoint, self.resource, lock=LOCK, verify=self.verify_keys)

    def reopen(self) -> None:
        self.guard.close()
        self.guard = EtcdGuard(self.endpoint, self.resource, lock=LOCK, verify=self.verify_keys)

    def write(self, token: FencingToken | str, value: str) -> None:
        self.guard.put(self.key, value, token=token)

    def _client_call(self, make: Callable[[aetcd.Client], Any]) -> Any:
        async def go() -> Any:
            host, _, port = self.endpoint.rpartition(":")
            async with aetcd.Client(host, int(port)) as client:
                return await make(client)

        return asyncio.run(go())

    def raw_write(self, value: str) -> None:
        self._client_call(lambda c: c.put(self.key.encode(), value.encode()))

    def read(self) -> str | None:
        got = self._client_call(lambda c: c.get(self.key.encode()))
        return None if got is None else got.value.decode()

    def high_water(self) -> FencingToken | None:
        return self.guard.high_water()

    def planted_lt(self) -> Write:
        class AsyncLt(AsyncEtcdGuard):
            def _accepts(self, token: int, mark: int) -> bool:
                return mark < token

        class Lt(EtcdGuard):
            _async_class = AsyncLt

        guard = Lt(self.endpoint, self.resource, lock=LOCK)
        self._planted = guard
        return lambda token, value: bool(guard.put(self.key, value, token=token))  # type: ignore[func-returns-value]

    def close(self) -> None:
        self.guard.close()
        planted = getattr(self, "_planted", None)
        if planted is not None:
            planted.close()


# -- ZooKeeper ----------------------------------------------------------------------------


class ZooKeeperEnv(GuardEnv):
    """:class:`ZooKeeperGuard`: a znode written in one multi with the mark's version check."""

    name = "zookeeper"

    def __init__(self, hosts: str) -> None:
        self.hosts = hosts
        self.resource = unique_name("res")
        self.path = f"/data/{self.resource}/item"
        self._clients: list[Any] = []
        self.client = self._client()
        self.guard = ZooKeeperGuard(self.client, self.resource, lock=LOCK, verify=self.verify_keys)

    def _client(self) -> Any:
        from kazoo.client import KazooClient

        client = KazooClient(hosts=self.hosts)
        client.start(timeout=20)
        self._clients.append(client)
        return client

    def reopen(self) -> None:
        self.close()
        self.client = self._client()
        self.guard = ZooKeeperGuard(self.client, self.resource, lock=LOCK, verify=self.verify_keys)

    def write(self, token: FencingToken | str, value: str) -> None:
        self.guard.set(self.path, value.encode(), token=token)

    def raw_write(self, value: str) -> None:
        if self.client.exists(self.path) is None:
            self.client.create(self.path, value.encode(), makepath=True)
        else:
            self.client.set(self.path, value.encode())

    def read(self) -> str | None:
        from kazoo.exceptions import NoNodeError

        try:
            return self.client.get(self.path)[0].decode()  # type: ignore[no-any-return]
        except NoNodeError:
            return None

    def high_water(self) -> FencingToken | None:
        return self.guard.high_water()

    def planted_lt(self) -> Write:
        class Lt(ZooKeeperGuard):
            def _accepts(self, token: int, mark: int) -> bool:
                return mark < token

        guard = Lt(self.client, self.resource, lock=LOCK)
        return lambda token, value: bool(guard.set(self.path, value.encode(), token=token))

    def close(self) -> None:
        for c in self._clients:
            c.stop()
            c.close()
        self._clients.clear()


# -- DynamoDB (moto's server mode) ---------------------------------------------------------


class DynamoDBEnv(GuardEnv):
    """:class:`DynamoDBGuard`, mark in the item: one conditional PutItem per write."""

    name = "dynamodb"

    def __init__(self, client: Any, table: str) -> None:
        self.client, self.table = client, table
        self.key = {"pk": {"S": unique_name("item")}}
        self.guard = DynamoDBGuard(client, table, lock=LOCK, verify=self.verify_keys)

    def reopen(self) -> None:
        self.guard = DynamoDBGuard(self.client, self.table, lock=LOCK, verify=self.verify_keys)

    def write(self, token: FencingToken | str, value: str) -> None:
        self.guard.put_item({**self.key, "v": {"S": value}}, token=token)

    def raw_write(self, value: str) -> None:
        self.client.update_item(
            TableName=self.table,
            Key=self.key,
            UpdateExpression="SET v = :v",
            ExpressionAttributeValues={":v": {"S": value}},
        )

    def read(self) -> str | None:
        item = self.client.get_item(TableName=self.table, Key=self.key, ConsistentRead=True)
        v = item.get("Item", {}).get("v")
        return None if v is None else str(v["S"])

    def high_water(self) -> FencingToken | None:
        return self.guard.high_water(self.key)

    def planted_lt(self) -> Write:
        class Lt(DynamoDBGuard):
            def _condition(self) -> str:
                return super()._condition().replace(" <= ", " < ")

        guard = Lt(self.client, self.table, lock=LOCK)
        return lambda token, value: bool(
            guard.put_item({**self.key, "v": {"S": value}}, token=token)
        )


# -- S3 (moto's server mode) ---------------------------------------------------------------


class S3Env(GuardEnv):
    """:class:`S3VersionStore`: a version object per write, the mark swapped with If-Match."""

    name = "s3"

    def __init__(self, client: Any, bucket: str) -> None:
        self.client, self.bucket = client, bucket
        self.store = S3VersionStore(client, bucket, lock=LOCK, verify=self.verify_keys)

    def reopen(self) -> None:
        self.store = S3VersionStore(self.client, self.bucket, lock=LOCK, verify=self.verify_keys)

    def write(self, token: FencingToken | str, value: str) -> None:
        self.store.publish("item", value.encode(), token=token)

    def raw_write(self, value: str) -> None:
        # Unfenced: overwrite the current version object in place (no mark, no condition),
        # or make the first one, as a client that ignores the rule would.
        current = self.store.latest("item")
        key = f"item/{current.filename if current else '0000000000000000001.000000'}"
        self.client.put_object(Bucket=self.bucket, Key=key, Body=value.encode())
        if current is None:
            doc = {"lock": LOCK, "token": 1, "version": "0000000000000000001.000000"}
            self.client.put_object(
                Bucket=self.bucket, Key="item/.mark", Body=json.dumps(doc).encode()
            )

    def read(self) -> str | None:
        try:
            return self.store.read("item")[1].decode()
        except LookupError:
            return None

    def high_water(self) -> FencingToken | None:
        return self.store.high_water("item")

    def planted_lt(self) -> Write:
        class Lt(S3VersionStore):
            def _accepts(self, token: int, mark: int) -> bool:
                return mark < token

        store = Lt(self.client, self.bucket, lock=LOCK)
        return lambda token, value: bool(store.publish("item", value.encode(), token=token))  # type: ignore[func-returns-value]


# -- files --------------------------------------------------------------------------------


class FileGuardEnv(GuardEnv):
    name = "files"
    guard_class: type[FileGuard] = FileGuard

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.guard = FileGuard(directory, lock=LOCK, verify=self.verify_keys)

    def reopen(self) -> None:
        self.guard = FileGuard(self.directory, lock=LOCK, verify=self.verify_keys)

    def write(self, token: FencingToken | str, value: str) -> None:
        self.guard.write("item", value.encode(), token=token)

    def raw_write(self, value: str) -> None:
        # Unfenced: a version with a token above everything, as a client that ignores the
        # rule would publish (the highest name wins for readers).
        rdir = self.directory / "item"
        rdir.mkdir(exist_ok=True)
        (rdir / f"{2**62:019d}.{os.getpid() % 10**6:06d}").write_bytes(value.encode())

    def read(self) -> str | None:
        try:
            return self.guard.read("item")[1].decode()
        except LookupError:
            return None

    def high_water(self) -> FencingToken | None:
        mark = self.guard.high_water("item")
        return None if mark is None or mark.value >= 2**62 else mark

    def planted_lt(self) -> Write:
        class Lt(FileGuard):
            def _accepts(self, token: int, newest: int) -> bool:
                return token > newest

        guard = Lt(self.directory, lock=LOCK)
        return lambda token, value: bool(guard.write("item", value.encode(), token=token))  # type: ignore[func-returns-value]


class AsyncFileGuardEnv(FileGuardEnv):
    """:class:`AsyncFileGuard`: the same guard from asyncio, through a worker thread."""

    def __init__(self, directory: Path) -> None:
        self.on = _OnOneLoop()
        super().__init__(directory)
        self.reopen()

    def reopen(self) -> None:
        from fenced.guards.files import AsyncFileGuard

        super().reopen()
        self.aguard = AsyncFileGuard(self.directory, lock=LOCK, verify=self.verify_keys)

    def write(self, token: FencingToken | str, value: str) -> None:
        self.on.run(self.aguard.write("item", value.encode(), token=token))

    def read(self) -> str | None:
        try:
            return self.on.run(self.aguard.read("item"))[1].decode()  # type: ignore[no-any-return]
        except LookupError:
            return None

    def close(self) -> None:
        self.on.close()


class HighWaterFileEnv(GuardEnv):
    name = "high-water-file"

    def __init__(self, directory: Path) -> None:
        self.data = directory / "data.txt"
        self.mark_path = directory / "mark"
        self.mark = HighWaterFile(self.mark_path, lock=LOCK, verify=self.verify_keys)

    def reopen(self) -> None:
        self.mark = HighWaterFile(self.mark_path, lock=LOCK, verify=self.verify_keys)

    def _hold_and_write(self, mark: HighWaterFile, token: Any, value: str) -> None:
        with mark.hold(token=token):
            self.raw_write(value)

    def write(self, token: FencingToken | str, value: str) -> None:
        self._hold_and_write(self.mark, token, value)

    def raw_write(self, value: str) -> None:
        self.data.write_text(value)

    def read(self) -> str | None:
        return self.data.read_text() if self.data.exists() else None

    def high_water(self) -> FencingToken | None:
        return self.mark.current()

    def planted_lt(self) -> Write:
        class Lt(HighWaterFile):
            def _accepts(self, token: int, mark: int) -> bool:
                return token > mark

        mark = Lt(self.mark_path, lock=LOCK)
        return lambda token, value: self._hold_and_write(mark, token, value)


# -- the async guards -----------------------------------------------------------------------
# Each runs on the env's own event loop (_OnOneLoop); reads and unfenced writes go through a
# plain client, so what is checked is the async guard's own path.

_INSERT = "INSERT INTO {t} (id, v) VALUES (1, ?) ON CONFLICT (id) DO UPDATE SET v = excluded.v"


class _AsyncSQL:
    """One async connection (psycopg's AsyncConnection, asyncmy) or a SQLAlchemy AsyncEngine
    over either, made on first use on ``on``'s loop; ``transaction(body)`` runs
    ``await body(conn)`` between BEGIN and COMMIT (ROLLBACK if it raises)."""

    def __init__(self, kind: str, target: str, mysql: dict[str, Any], sa: bool) -> None:
        self.kind, self.target, self.mysql, self.sa = kind, target, mysql, sa
        self.on = _OnOneLoop()
        self.conn: Any = None
        self.engine: Any = None

    async def _open(self) -> Any:
        if self.sa:
            from sqlalchemy.ext.asyncio import create_async_engine

            if self.engine is None:
                url = (
                    self.target.replace("postgresql://", "postgresql+psycopg://")
                    if self.kind == "postgresql"
                    else "mysql+asyncmy://root@{host}:{port}/{database}".format(**self.mysql)
                )
                self.engine = create_async_engine(url)
            return self.engine
        if self.conn is None:
            if self.kind == "postgresql":
                self.conn = await psycopg.AsyncConnection.connect(self.target, autocommit=True)
            else:
                import asyncmy

                self.conn = await asyncmy.connect(**asyncmy_args(self.mysql), autocommit=True)
        return self.conn

    async def execute(self, conn: Any, sql: str, params: tuple[Any, ...]) -> None:
        if self.sa:
            await conn.exec_driver_sql(sql, params)
        elif self.kind == "postgresql":
            await conn.execute(sql, params)
        else:
            async with conn.cursor() as cur:
                await cur.execute(sql, params)

    async def _transaction(self, body: Callable[[Any], Any]) -> Any:
        opened = await self._open()
        if self.sa:
            async with opened.begin() as conn:
                return await body(conn)
        if self.kind == "postgresql":
            async with opened.transaction():
                return await body(opened)
        await opened.begin()
        try:
            result = await body(opened)
        except BaseException:
            await opened.rollback()
            raise
        await opened.commit()
        return result

    async def _outside(self, body: Callable[[Any], Any]) -> Any:
        opened = await self._open()
        if not self.sa:
            return await body(opened)
        async with opened.connect() as conn:
            return await body(conn)

    def transaction(self, body: Callable[[Any], Any]) -> Any:
        return self.on.run(self._transaction(body))

    def outside(self, body: Callable[[Any], Any]) -> Any:
        """``await body(conn)`` with no transaction of the env's open (autocommit)."""
        return self.on.run(self._outside(body))

    def reset(self) -> None:
        """Drop the connection (a restarted client): the next use connects again."""
        if self.engine is not None:
            self.on.run(self.engine.dispose())
        elif self.conn is not None:
            closed = self.conn.close()  # (psycopg's is awaited; asyncmy's is not)
            if asyncio.iscoroutine(closed):
                self.on.run(closed)
        self.conn = self.engine = None

    def close(self) -> None:
        self.reset()
        self.on.close()


class _Awaited(_SQLEnv):
    """An SQL env whose guard is awaited on ``self.aio`` (its plain connections stay for the
    unfenced writes and the reads): a restarted client drops both."""

    aio: _AsyncSQL

    def reopen(self) -> None:
        super().reopen()
        self.aio.reset()

    def close(self) -> None:
        super().close()
        self.aio.close()


class AsyncSQLFenceEnv(_Awaited, SQLFenceEnv):
    """``SQLGuard.acheck`` in the caller's async transaction: psycopg's AsyncConnection,
    asyncmy, or a SQLAlchemy AsyncConnection over either (``sa``)."""

    def __init__(self, kind: str, target: str, *, sa: bool, mysql: dict[str, Any] | None = None):
        self.aio = _AsyncSQL(kind, target, mysql or {}, sa)
        super().__init__(kind, target, mysql=mysql)

    def _transaction(self, guard: SQLGuard | None, token: Any, value: str) -> None:
        if guard is None:  # (the unfenced write: the plain connection)
            super()._transaction(None, None, value)
            return

        async def body(conn: Any) -> None:
            await guard.acheck(conn, token=token)
            await self.aio.execute(conn, self.q(_INSERT.format(t=self.table)), (value,))

        self.aio.transaction(body)

    def high_water(self) -> FencingToken | None:
        return self.aio.outside(self.guard.ahigh_water)  # type: ignore[no-any-return]


class AsyncSQLRowEnv(_Awaited, SQLRowEnv):
    """``RowGuard.ainsert_or_update``: the conditional upsert, awaited (psycopg's
    AsyncConnection, asyncmy; autocommit, one statement)."""

    def __init__(self, kind: str, target: str, *, mysql: dict[str, Any] | None = None) -> None:
        self.aio = _AsyncSQL(kind, target, mysql or {}, sa=False)
        super().__init__(kind, target, mysql=mysql)

    def _upsert(self, guard: RowGuard, token: Any, value: str) -> None:
        async def body(conn: Any) -> None:
            await guard.ainsert_or_update(conn, token=token, key={"id": 1}, values={"v": value})

        self.aio.outside(body)

    def write(self, token: FencingToken | str, value: str) -> None:
        self._upsert(self.guard, token, value)

    def high_water(self) -> FencingToken | None:
        async def body(conn: Any) -> FencingToken | None:
            try:
                return await self.guard.ahigh_water(conn, {"id": 1})
            except LookupError:
                return None

        return self.aio.outside(body)  # type: ignore[no-any-return]

    def planted_lt(self) -> Write:
        guard = LessThanRowGuard(self.table, lock=LOCK)
        return lambda token, value: self._upsert(guard, token, value)


class PostgresStoreEnv(_StoreEnv):
    """The ASGI middleware's :class:`PostgresFenceStore`: ``await fn(conn)`` on a psycopg
    AsyncConnection."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.fences = unique_name("fences").replace("-", "_")
        self.table = unique_name("data").replace("-", "_")
        with psycopg.connect(dsn, autocommit=True) as db:
            db.execute(f"CREATE TABLE {self.table} (id INTEGER PRIMARY KEY, v TEXT)")
        self._start()

    def _store(self, guard_class: type[SQLGuard]) -> Any:
        from fenced.guards.asgi import PostgresFenceStore

        class Store(PostgresFenceStore):
            pass

        Store.guard_class = guard_class
        return Store(self.dsn, table=self.fences)

    def _put(self, value: str) -> Callable[[Any], Any]:
        async def fn(conn: Any) -> None:
            await conn.execute(_INSERT.format(t=self.table).replace("?", "%s"), (value,))

        return fn

    def raw_write(self, value: str) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as db:
            db.execute(_INSERT.format(t=self.table).replace("?", "%s"), (value,))

    def read(self) -> str | None:
        with psycopg.connect(self.dsn, autocommit=True) as db:
            row = db.execute(f"SELECT v FROM {self.table} WHERE id = 1").fetchone()
        return None if row is None else row[0]


class RedisStoreEnv(AsyncRedisEnv):
    """The ASGI middleware's :class:`RedisFenceStore`: its guard for the resource writes the
    data key in the fence script; its ``high_water`` reads the mark."""

    signs = False

    def reopen(self) -> None:
        import redis.asyncio as aioredis

        from fenced.guards.asgi import RedisFenceStore

        old = getattr(self, "store", None)
        if old is not None:
            self.on.run(old.aclose())
            self.on.run(self.client.aclose())
        self.client = aioredis.Redis(port=self.port)
        self.store = RedisFenceStore(self.client)
        self.guard = self.store.guard(self.resource, LOCK)

    def write(self, token: FencingToken | str, value: str) -> None:
        tok_ = FencingToken.coerce(token, LOCK)
        self.on.run(self.store.guard(self.resource, tok_.lock).set(self.key, value, token=tok_))

    def high_water(self) -> FencingToken | None:
        return self.on.run(self.store.high_water(self.resource, LOCK))  # type: ignore[no-any-return]

    def planted_lt(self) -> Write:
        from fenced.guards.asgi import RedisFenceStore
        from fenced.guards.redis import AsyncRedisGuard

        class Lt(AsyncRedisGuard):
            set_script = SET_SCRIPT.replace("if c < 0 then", "if c <= 0 then")

        store = self._planted = RedisFenceStore(self.client)
        store.guard_class = Lt  # (the store makes its guards from it)

        def write(token: FencingToken, value: str) -> None:
            self.on.run(store.guard(self.resource, token.lock).set(self.key, value, token=token))

        return write

    def close(self) -> None:
        self.on.close(self.store, getattr(self, "_planted", None), self.client)
        self.sync.close()


class AsyncEtcdEnv(EtcdEnv):
    """:class:`AsyncEtcdGuard` itself (its own connection, :meth:`~AsyncEtcdGuard.open`), not
    through the sync facade's portal."""

    def __init__(self, endpoint: str) -> None:
        self.on = _OnOneLoop()
        self.endpoint = endpoint
        self.resource = unique_name("res")
        self.key = f"{self.resource}/data"
        self.aguard = self._open(AsyncEtcdGuard)

    def _open(self, cls: type[AsyncEtcdGuard]) -> AsyncEtcdGuard:
        async def go() -> AsyncEtcdGuard:  # (made on the loop it is used on)
            return cls.open(self.endpoint, self.resource, lock=LOCK, verify=self.verify_keys)

        return self.on.run(go())  # type: ignore[no-any-return]

    def reopen(self) -> None:
        self.on.run(self.aguard.aclose())
        self.aguard = self._open(AsyncEtcdGuard)

    def write(self, token: FencingToken | str, value: str) -> None:
        self.on.run(self.aguard.put(self.key, value, token=token))

    def high_water(self) -> FencingToken | None:
        return self.on.run(self.aguard.high_water())  # type: ignore[no-any-return]

    def planted_lt(self) -> Write:
        class AsyncLt(AsyncEtcdGuard):
            def _accepts(self, token: int, mark: int) -> bool:
                return mark < token

        guard = self._planted_guard = self._open(AsyncLt)
        return lambda token, value: bool(self.on.run(guard.put(self.key, value, token=token)))  # type: ignore[func-returns-value]

    def close(self) -> None:
        self.on.close(self.aguard, getattr(self, "_planted_guard", None))


class AsyncZooKeeperEnv(ZooKeeperEnv):
    """:class:`AsyncZooKeeperGuard`: the sync guard's calls on a worker thread."""

    def __init__(self, hosts: str) -> None:
        self.on = _OnOneLoop()
        super().__init__(hosts)
        self.aguard = self._async(ZooKeeperGuard)

    def _async(self, sync_class: type[ZooKeeperGuard]) -> Any:
        from fenced.guards.zookeeper import AsyncZooKeeperGuard

        guard = AsyncZooKeeperGuard(self.client, self.resource, lock=LOCK, verify=self.verify_keys)
        if sync_class is not ZooKeeperGuard:  # (the planted comparison, in the guard it wraps)
            guard.sync = sync_class(self.client, self.resource, lock=LOCK)
        return guard

    def reopen(self) -> None:
        ZooKeeperEnv.close(self)  # (not self.close(): that ends the env's loop too)
        self.client = self._client()
        self.guard = ZooKeeperGuard(self.client, self.resource, lock=LOCK, verify=self.verify_keys)
        self.aguard = self._async(ZooKeeperGuard)

    def write(self, token: FencingToken | str, value: str) -> None:
        self.on.run(self.aguard.set(self.path, value.encode(), token=token))

    def high_water(self) -> FencingToken | None:
        return self.on.run(self.aguard.high_water())  # type: ignore[no-any-return]

    def planted_lt(self) -> Write:
        class Lt(ZooKeeperGuard):
            def _accepts(self, token: int, mark: int) -> bool:
                return mark < token

        guard = self._async(Lt)
        return lambda token, value: bool(
            self.on.run(guard.set(self.path, value.encode(), token=token))
        )

    def close(self) -> None:
        super().close()
        self.on.close()


class _AioClient:
    """An aiobotocore client (an async context manager) entered on ``on``'s loop."""

    def __init__(self, on: _OnOneLoop, kind: str, url: str) -> None:
        from tests.helpers import aio_aws_client

        self.on = on
        self.cm = aio_aws_client(kind, url)
        self.client = on.run(self.cm.__aenter__())

    def close(self) -> None:
        self.on.run(self.cm.__aexit__(None, None, None))


class AsyncDynamoDBEnv(DynamoDBEnv):
    """:class:`AsyncDynamoDBGuard` on aiobotocore: the same request plans, awaited."""

    def __init__(self, client: Any, table: str, url: str) -> None:
        self.on = _OnOneLoop()
        self.aio = _AioClient(self.on, "dynamodb", url)
        super().__init__(client, table)
        self.reopen()

    def reopen(self) -> None:
        from fenced.guards.dynamodb import AsyncDynamoDBGuard

        self.aguard = AsyncDynamoDBGuard(
            self.aio.client, self.table, lock=LOCK, verify=self.verify_keys
        )

    def write(self, token: FencingToken | str, value: str) -> None:
        self.on.run(self.aguard.put_item({**self.key, "v": {"S": value}}, token=token))

    def high_water(self) -> FencingToken | None:
        return self.on.run(self.aguard.high_water(self.key))  # type: ignore[no-any-return]

    def planted_lt(self) -> Write:
        from fenced.guards.dynamodb import AsyncDynamoDBGuard

        class Lt(AsyncDynamoDBGuard):
            def _condition(self) -> str:
                return super()._condition().replace(" <= ", " < ")

        guard = Lt(self.aio.client, self.table, lock=LOCK)
        return lambda token, value: bool(
            self.on.run(guard.put_item({**self.key, "v": {"S": value}}, token=token))
        )

    def close(self) -> None:
        self.aio.close()
        self.on.close()


class AsyncS3Env(S3Env):
    """:class:`AsyncS3VersionStore` on aiobotocore: the same request plans, awaited."""

    def __init__(self, client: Any, bucket: str, url: str) -> None:
        self.on = _OnOneLoop()
        self.aio = _AioClient(self.on, "s3", url)
        super().__init__(client, bucket)
        self.reopen()

    def reopen(self) -> None:
        from fenced.guards.s3 import AsyncS3VersionStore

        super().reopen()  # (the sync store: raw_write's and read's view of the bucket)
        self.astore = AsyncS3VersionStore(
            self.aio.client, self.bucket, lock=LOCK, verify=self.verify_keys
        )

    def write(self, token: FencingToken | str, value: str) -> None:
        self.on.run(self.astore.publish("item", value.encode(), token=token))

    def high_water(self) -> FencingToken | None:
        return self.on.run(self.astore.high_water("item"))  # type: ignore[no-any-return]

    def planted_lt(self) -> Write:
        from fenced.guards.s3 import AsyncS3VersionStore

        class Lt(AsyncS3VersionStore):
            def _accepts(self, token: int, mark: int) -> bool:
                return mark < token

        store = Lt(self.aio.client, self.bucket, lock=LOCK)
        return lambda token, value: bool(
            self.on.run(store.publish("item", value.encode(), token=token))
        )  # type: ignore[func-returns-value]

    def close(self) -> None:
        self.aio.close()
        self.on.close()


class StreamEnv(GuardEnv):
    """:class:`FencedStreamConsumer` (``aio``: :class:`AsyncFencedStreamConsumer`): the item
    is the consumer group's progress. A write adds an entry holding the value to the stream
    and commits it with the token (XACK and the progress moved, in the guard's script); a
    read is the value of the entry the progress names.

    The entry is added and committed in one turn of the env's (threads take turns): a
    consumer commits entries in their stream order, and the progress never moves back to an
    older entry by design, so two racing writers' XADDs must not cross their commits."""

    def __init__(self, port: int, *, aio: bool) -> None:
        self.port, self.aio = port, aio
        self.resource = unique_name("res")
        self.stream = f"{{{self.resource}}}:stream"
        self.sync = redis.Redis(port=port)
        self.sync.xgroup_create(self.stream, "g", id="0", mkstream=True)
        self._turn = threading.Lock()
        self.on = _OnOneLoop()
        self.reopen()

    def _consumer(self, guard_class: Any = None) -> Any:
        from fenced.guards.redis import AsyncRedisGuard
        from fenced.guards.streams import AsyncFencedStreamConsumer, FencedStreamConsumer

        if self.aio:
            import redis.asyncio as aioredis

            client: Any = aioredis.Redis(port=self.port)
            cls, consumer = guard_class or AsyncRedisGuard, AsyncFencedStreamConsumer
        else:
            client = redis.Redis(port=self.port)
            cls, consumer = guard_class or RedisGuard, FencedStreamConsumer
        self._clients.append(client)
        guard = cls(client, self.resource, lock=LOCK, verify=self.verify_keys)
        self._guards.append(guard)
        return consumer(guard, self.stream, "g")

    def _call(self, result: Any) -> Any:
        return self.on.run(result) if self.aio else result

    def reopen(self) -> None:
        if hasattr(self, "_clients"):
            self.close_clients()
        self._clients: list[Any] = []
        self._guards: list[Any] = []
        self.consumer = self._consumer()

    def _commit(self, consumer: Any, token: FencingToken | str, value: str) -> None:
        with self._turn:
            entry = self.sync.xadd(self.stream, {"v": value}).decode()
            self._call(consumer.commit([entry], token=token))

    def write(self, token: FencingToken | str, value: str) -> None:
        self._commit(self.consumer, token, value)

    def raw_write(self, value: str) -> None:
        with self._turn:
            entry = self.sync.xadd(self.stream, {"v": value}).decode()
            self.sync.set(self.consumer.progress_key, entry)

    def read(self) -> str | None:
        progress = self.sync.get(self.consumer.progress_key)
        if progress is None:
            return None
        entries = self.sync.xrange(self.stream, progress, progress)
        return entries[0][1][b"v"].decode() if entries else None

    def high_water(self) -> FencingToken | None:
        return self._call(self.consumer.guard.high_water())  # type: ignore[no-any-return]

    def planted_lt(self) -> Write:
        from fenced.guards.redis import AsyncRedisGuard

        class Lt(AsyncRedisGuard if self.aio else RedisGuard):  # type: ignore[misc]
            @staticmethod
            def eval_script(lua_body: str) -> str:
                real = eval_script(lua_body)
                planted = real.replace("if c < 0 then", "if c <= 0 then")
                assert planted != real, "re-plant the bug"
                return planted

        consumer = self._consumer(Lt)
        return lambda token, value: self._commit(consumer, token, value)

    def close_clients(self) -> None:
        for guard in self._guards:
            self._call(guard.aclose() if self.aio else guard.close())
        for client in self._clients:
            self._call(client.aclose() if self.aio else client.close())

    def close(self) -> None:
        self.close_clients()
        self.on.close()
        self.sync.close()


# -- the fixture --------------------------------------------------------------------------

GUARDS = [
    "sql-fence-sqlite",
    "sql-fence-postgresql",
    "sql-pipeline-postgresql",
    "sql-row-sqlite",
    "sql-row-postgresql",
    "sql-fence-mysql",
    "sql-row-mysql",
    "redis",
    "redis-async",
    "sqlite-store",
    "etcd",
    "zookeeper",
    "dynamodb",
    "s3",
    "files",
    "files-async",
    "high-water-file",
    # the async guards: awaited on an event loop of the env's
    "sql-fence_async-postgresql",  # psycopg's AsyncConnection
    "sql-fence_async-mysql",  # asyncmy
    "sql-fence_sa_async-postgresql",  # SQLAlchemy AsyncConnection (psycopg)
    "sql-fence_sa_async-mysql",  # SQLAlchemy AsyncConnection (asyncmy)
    "sql-row_async-postgresql",
    "sql-row_async-mysql",
    "postgres-store",
    "redis-store",
    "etcd-async",
    "zookeeper-async",
    "dynamodb-async",
    "s3-async",
    "stream-consumer",
    "stream-consumer-async",
]


def make_env(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[GuardEnv]:
    env: GuardEnv
    if kind.startswith("sql-"):
        _, form, engine = kind.split("-")
        mysql = request.getfixturevalue("mysql_db") if engine == "mysql" else None
        target = request.getfixturevalue("pg_dsn") if engine == "postgresql" else ""
        if form in ("fence_async", "fence_sa_async"):
            env = AsyncSQLFenceEnv(engine, target, sa=form == "fence_sa_async", mysql=mysql)
            if form == "fence_sa_async" and engine == "mysql":
                env.lt_unobservable = (
                    "SQLAlchemy's MySQL dialects connect with CLIENT_FOUND_ROWS: the check then "
                    "accepts an equal token from the fence row it locked, not from the "
                    "statement's comparison (the plant is caught on asyncmy's own connection)"
                )
        elif form == "row_async":
            env = AsyncSQLRowEnv(engine, target, mysql=mysql)
        else:
            cls = {"fence": SQLFenceEnv, "pipeline": SQLPipelineEnv}.get(form, SQLRowEnv)
            env = cls(engine, target or str(tmp_path / "guarded.db"), mysql=mysql)
    elif kind == "redis":
        env = RedisEnv(request.getfixturevalue("redis_server").port)
    elif kind == "redis-async":
        env = AsyncRedisEnv(request.getfixturevalue("redis_server").port)
    elif kind == "sqlite-store":
        env = SQLiteStoreEnv(tmp_path / "store.db")
    elif kind == "postgres-store":
        env = PostgresStoreEnv(request.getfixturevalue("pg_dsn"))
    elif kind == "redis-store":
        env = RedisStoreEnv(request.getfixturevalue("redis_server").port)
    elif kind == "etcd-async":
        env = AsyncEtcdEnv(request.getfixturevalue("etcd_server").endpoint)
    elif kind == "zookeeper-async":
        env = AsyncZooKeeperEnv(request.getfixturevalue("zk_server").hosts)
    elif kind == "dynamodb-async":
        env = AsyncDynamoDBEnv(
            *request.getfixturevalue("dynamodb_table"), request.getfixturevalue("moto_server").url
        )
    elif kind == "s3-async":
        env = AsyncS3Env(
            *request.getfixturevalue("s3_bucket"), request.getfixturevalue("moto_server").url
        )
    elif kind.startswith("stream-consumer"):
        port = request.getfixturevalue("redis_server").port
        env = StreamEnv(port, aio=kind.endswith("-async"))
    elif kind == "etcd":
        env = EtcdEnv(request.getfixturevalue("etcd_server").endpoint)
    elif kind == "zookeeper":
        env = ZooKeeperEnv(request.getfixturevalue("zk_server").hosts)
    elif kind == "dynamodb":
        env = DynamoDBEnv(*request.getfixturevalue("dynamodb_table"))
    elif kind == "s3":
        env = S3Env(*request.getfixturevalue("s3_bucket"))
    elif kind == "files":
        env = FileGuardEnv(tmp_path / "files")
    elif kind == "files-async":
        env = AsyncFileGuardEnv(tmp_path / "files")
    else:
        env = HighWaterFileEnv(tmp_path)
    env.name = kind
    try:
        yield env
    finally:
        env.close()
