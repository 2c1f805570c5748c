"""Guarded vs unguarded single writes, one client, for the guards of issue 16: ZooKeeper
(a znode set), DynamoDB and S3 (on moto's emulator: **emulator figures only**, they say
nothing of AWS's latencies), and the SQL guards through SQLAlchemy (SQLite file, WAL,
synchronous=FULL; and MariaDB). The two sides of a row alternate op by op.

    .venv/bin/python bench/bench_guards_new.py [--n 1000]

Rows:
* ZooKeeper: ``ZooKeeperGuard.set`` (read the mark + one multi: check + set) vs ``client.set``.
* DynamoDB (emulator): ``put_item`` with the fence condition vs a plain ``PutItem``.
* DynamoDB (emulator): ``transact`` (fence item + one Put) vs ``TransactWriteItems`` of the Put.
* S3 (emulator): ``publish`` (GET mark, PUT version If-None-Match, PUT mark If-Match) vs a
  plain ``PutObject``.
* SQLAlchemy: a Core transaction with ``SQLGuard.check`` + one UPDATE vs the UPDATE alone;
  ``RowGuard.update`` vs the plain UPDATE (SQLite and MariaDB).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import boto3
import sqlalchemy as sa
from _common import interleaved, table
from kazoo.client import KazooClient

from fenced import FencingToken
from fenced.guards.dynamodb import AsyncDynamoDBGuard, DynamoDBGuard
from fenced.guards.s3 import AsyncS3VersionStore, S3VersionStore
from fenced.guards.sql import RowGuard, SQLGuard
from fenced.guards.zookeeper import ZooKeeperGuard
from fenced.testing.servers import MariaDBServer, MotoServer, ZooKeeperServer

TOKEN = FencingToken("bench", 42)


def aws(kind: str, url: str) -> object:
    return boto3.client(
        kind,
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )


def zookeeper_pairs(zk: KazooClient) -> list[tuple]:
    guard = ZooKeeperGuard(zk, "bench", lock="bench")
    guard.set("/bench/data", b"0", token=TOKEN)
    zk.ensure_path("/plain/data")
    n = itertools.count()
    return [
        (
            "ZooKeeperGuard.set",
            lambda: guard.set("/bench/data", str(next(n)).encode(), token=TOKEN),
            "KazooClient.set",
            lambda: zk.set("/plain/data", str(next(n)).encode()),
        )
    ]


def moto_pairs(url: str) -> list[tuple]:
    ddb, s3 = aws("dynamodb", url), aws("s3", url)
    ddb.create_table(
        TableName="bench",
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    s3.create_bucket(Bucket="bench-bucket")
    guard = DynamoDBGuard(ddb, "bench", lock="bench", fence_key={"pk": {"S": "fenced#bench"}})
    store = S3VersionStore(s3, "bench-bucket", lock="bench")
    n = itertools.count()

    def item(pk: str) -> dict:
        return {"pk": {"S": pk}, "v": {"S": str(next(n))}}

    def tx_put(pk: str) -> dict:
        return {"Put": {"TableName": "bench", "Item": item(pk)}}

    return [
        (
            "DynamoDBGuard.put_item",
            lambda: guard.put_item(item("a"), token=TOKEN),
            "PutItem",
            lambda: ddb.put_item(TableName="bench", Item=item("b")),
        ),
        (
            "DynamoDBGuard.transact",
            lambda: guard.transact([tx_put("c")], token=TOKEN),
            "TransactWriteItems",
            lambda: ddb.transact_write_items(TransactItems=[tx_put("d")]),
        ),
        (
            "S3VersionStore.publish",
            lambda: store.publish("daily", b"x" * 1024, token=TOKEN),
            "PutObject",
            lambda: s3.put_object(Bucket="bench-bucket", Key="plain", Body=b"x" * 1024),
        ),
    ]


def aio_moto_pairs(url: str, loop: asyncio.AbstractEventLoop, stack: Any) -> list[tuple]:
    """The async guards on aiobotocore clients (made by moto_pairs' table and bucket), each op
    one ``run_until_complete`` on both sides."""
    from aiobotocore.session import get_session

    def client(kind: str) -> Any:
        made = get_session().create_client(
            kind,
            endpoint_url=url,
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )
        return loop.run_until_complete(stack.enter_async_context(made))

    ddb, s3 = client("dynamodb"), client("s3")
    guard = AsyncDynamoDBGuard(ddb, "bench", lock="bench")
    store = AsyncS3VersionStore(s3, "bench-bucket", lock="bench")
    n = itertools.count()
    run = loop.run_until_complete

    def item(pk: str) -> dict:
        return {"pk": {"S": pk}, "v": {"S": str(next(n))}}

    return [
        (
            "AsyncDynamoDBGuard.put_item (aiobotocore)",
            lambda: run(guard.put_item(item("e"), token=TOKEN)),
            "PutItem (aiobotocore)",
            lambda: run(ddb.put_item(TableName="bench", Item=item("f"))),
        ),
        (
            "AsyncS3VersionStore.publish (aiobotocore)",
            lambda: run(store.publish("async", b"x" * 1024, token=TOKEN)),
            "PutObject (aiobotocore)",
            lambda: run(s3.put_object(Bucket="bench-bucket", Key="plain2", Body=b"x" * 1024)),
        ),
    ]


def sqlalchemy_pairs(url: str, label: str) -> list[tuple]:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance BIGINT)")
        conn.exec_driver_sql("INSERT INTO accounts VALUES (1, 0), (2, 0)")
    with engine.connect() as conn:
        SQLGuard("bench").install(conn)
        RowGuard("accounts", lock="bench").install(conn)
    fence, rows = SQLGuard("bench"), RowGuard("accounts", lock="bench")
    update = sa.text("UPDATE accounts SET balance = :b WHERE id = :id")
    conn = engine.connect()
    n = itertools.count()

    def fenced_txn() -> None:
        fence.check(conn, token=TOKEN)
        conn.execute(update, {"b": next(n), "id": 1})
        conn.commit()

    def plain_txn() -> None:
        conn.execute(update, {"b": next(n), "id": 2})
        conn.commit()

    def row_txn() -> None:
        rows.update(conn, token=TOKEN, key={"id": 1}, values={"balance": next(n)})
        conn.commit()

    return [
        (f"{label}: SQLGuard.check + UPDATE", fenced_txn, "UPDATE", plain_txn),
        (f"{label}: RowGuard.update", row_txn, "UPDATE", plain_txn),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    n = ap.parse_args().n
    rows = []
    with ZooKeeperServer() as zks:
        zk = KazooClient(hosts=zks.hosts)
        zk.start(timeout=30)
        for a, b in interleaved(zookeeper_pairs(zk), n):
            rows.append(("ZooKeeper", a, b))
        zk.stop()
    with MotoServer() as moto:
        results = interleaved(moto_pairs(moto.url), n)
        labels = ["DynamoDB (emulator)"] * 2 + ["S3 (emulator)"]
        for (a, b), what in zip(results, labels, strict=True):
            rows.append((what, a, b))
        loop = asyncio.new_event_loop()
        stack = contextlib.AsyncExitStack()
        try:
            results = interleaved(aio_moto_pairs(moto.url, loop, stack), n)
            for (a, b), what in zip(results, ["DynamoDB (emulator)", "S3 (emulator)"], strict=True):
                rows.append((what, a, b))
        finally:
            loop.run_until_complete(stack.aclose())
            loop.close()
    with tempfile.TemporaryDirectory() as d:
        url = f"sqlite:///{os.path.join(d, 'bench.db')}"
        e = sa.create_engine(url)
        with e.connect() as c:
            c.exec_driver_sql("PRAGMA journal_mode=WAL")
        e.dispose()
        for a, b in interleaved(sqlalchemy_pairs(url, "SQLite"), n):
            rows.append(("SQLAlchemy, SQLite", a, b))
    with MariaDBServer() as db:
        url = f"mysql+pymysql://root@127.0.0.1:{db.port}/fenced"
        for a, b in interleaved(sqlalchemy_pairs(url, "MariaDB"), n):
            rows.append(("SQLAlchemy, MariaDB", a, b))
    table(
        "New guards: guarded vs unguarded write, one client (ratio = guarded ops/s ÷ unguarded)",
        rows,
        f"load average (1 min) {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
        "DynamoDB and S3 rows are moto's emulator in-process figures, not AWS",
    )


if __name__ == "__main__":
    main()
