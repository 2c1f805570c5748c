"""A client process for the guard tests: ``python -m tests.workers.guard_writer MODE ...``.

* ``race TARGET RESOURCE FIRST STEP COUNT`` — after a line on stdin, offer tokens FIRST,
  FIRST+STEP, ... (COUNT of them) as fast as possible; print how many were accepted.
* ``holder SOURCE TARGET RESOURCE TTL MODE`` — take lock ``LOCK`` from SOURCE, print the
  token; then each ``write VALUE`` line writes VALUE, guarded (MODE ``guarded``) or not,
  whether or not the lease is still held: the resource must be the one to refuse.

TARGET is ``redis:URL``, ``etcd:HOST:PORT``, ``files:DIR``, ``http:BASE_URL``,
``mysql:mysql://USER@HOST:PORT/DB`` (tables ``data`` and ``log`` made by the test),
``zookeeper:HOSTS``, ``dynamodb:ENDPOINT|TABLE``, ``s3:ENDPOINT|BUCKET`` (moto;
``s3-unfenced:`` plants a store whose mark never refuses) or
``sqlalchemy:URL`` (a table ``data`` made by the test). Events are
JSON lines on stdout (see :class:`tests.guards.processes.Proc`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import fenced
from fenced import FencingToken, StaleTokenError

LOCK: Final = "inv-lock"
STEP_TIMEOUT: Final = 60.0

# A guarded Redis write that also appends its token to a list in the same script: the
# resource's own log of accepted tokens, in the order Redis applied them.
LOG_BODY: Final = """
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[1])
return 1
"""

Writer = Callable[[str, FencingToken, bool], None]
"""write(value, token, guarded)"""


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def plain_write(path: Path, data: bytes) -> None:
    """What an unguarded file writer does: atomic replace, last writer wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def writer(target: str, resource: str) -> Any:
    """The write function for ``target``, connected before the caller starts timing."""
    kind, _, where = target.partition(":")
    if kind == "redis":
        import redis

        from fenced.guards.redis import RedisGuard

        client = redis.Redis.from_url(where)
        guard = RedisGuard(client, resource, lock=LOCK)
        guard.high_water()
        data, log = f"{{{resource}}}:data", f"{{{resource}}}:log"

        def write_redis(value: str, token: FencingToken, guarded: bool) -> None:
            if not guarded:
                client.set(data, value)
            elif value.startswith("log:"):  # a race write: logged in the same script
                guard.eval(LOG_BODY, [data, log], [str(token.value), value[4:]], token=token)
            else:
                guard.set(data, value, token=token)

        try:
            yield write_redis
        finally:
            guard.close()
            client.close()
    elif kind == "etcd":
        from fenced.guards.etcd import EtcdGuard, put_op

        key = f"{resource}/data"
        with EtcdGuard(where, resource, lock=LOCK) as etcd_guard:
            etcd_guard.high_water()

            def write_etcd(value: str, token: FencingToken, guarded: bool) -> None:
                if value.startswith("log:"):
                    value = f"{token.value}:{value[4:]}"
                if guarded:
                    etcd_guard.put(key, value, token=token)
                else:
                    put = put_op(key, value).request_put
                    etcd_guard._portal.call(
                        etcd_guard.aio._client.call(
                            lambda m, t: m.kv.Put(put, timeout=t), what="unguarded put"
                        )
                    )

            yield write_etcd
    elif kind == "files":
        from fenced.guards.files import FileGuard

        def write_file(value: str, token: FencingToken, guarded: bool) -> None:
            if guarded:
                FileGuard(where, lock=LOCK).write(resource, value.encode(), token=token)
            else:
                plain_write(Path(where) / "plain" / resource, value.encode())

        yield write_file
    elif kind == "http":
        import httpx

        from fenced.guards.httpx import FencingAuth

        def write_http(value: str, token: FencingToken, guarded: bool) -> None:
            # A fixed token read before the pause (not the lease, which would refuse to send
            # now that it knows it is lost): the server must be the one to refuse.
            route = "fenced" if guarded else "plain"
            auth = FencingAuth(token) if guarded else None
            with httpx.Client(base_url=where, auth=auth) as client:
                client.put(f"/{route}/{resource}", content=value).raise_for_status()

        yield write_http
    elif kind == "mysql":
        from urllib.parse import urlsplit

        import pymysql

        from fenced.guards.sql import SQLGuard

        url = urlsplit(where)
        conn = pymysql.connect(
            host=url.hostname, port=url.port, user=url.username, database=url.path[1:]
        )
        guard = SQLGuard(resource, lock=LOCK)
        guard.high_water(conn)
        conn.commit()

        def write_mysql(value: str, token: FencingToken, guarded: bool) -> None:
            try:
                with conn.cursor() as cur:
                    if guarded:
                        guard.check(conn, token=token)
                    if value.startswith("log:"):  # a race write: logged in its transaction
                        cur.execute("INSERT INTO log (token) VALUES (%s)", (token.value,))
                        value = f"{token.value}:{value[4:]}"
                    cur.execute(
                        "INSERT INTO data (id, v) VALUES (1, %s) "
                        "ON DUPLICATE KEY UPDATE v = VALUES(v)",
                        (value,),
                    )
                conn.commit()
            except BaseException:
                conn.rollback()
                raise

        try:
            yield write_mysql
        finally:
            conn.close()
    elif kind == "zookeeper":
        from kazoo.client import KazooClient

        from fenced.guards.zookeeper import ZooKeeperGuard

        zk = KazooClient(hosts=where)
        zk.start(timeout=30)
        zk_guard = ZooKeeperGuard(zk, resource, lock=LOCK)
        zk_guard.high_water()
        zk.ensure_path(f"/data/{resource}")
        zk.ensure_path(f"/log/{resource}")

        def write_zk(value: str, token: FencingToken, guarded: bool) -> None:
            if value.startswith("log:"):  # a race write: logged in the same multi
                data = f"{token.value}:{value[4:]}".encode()

                def build(t: Any) -> None:
                    t.set_data(f"/data/{resource}", data)
                    t.create(f"/log/{resource}/e-", str(token.value).encode(), sequence=True)

                zk_guard.transaction(build, token=token)
            elif guarded:
                zk_guard.set(f"/data/{resource}", value.encode(), token=token)
            else:
                zk.ensure_path(f"/plain/{resource}")
                zk.set(f"/plain/{resource}", value.encode())

        try:
            yield write_zk
        finally:
            zk.stop()
            zk.close()
    elif kind in ("dynamodb", "s3", "s3-unfenced"):
        import boto3

        from fenced.guards.dynamodb import DynamoDBGuard
        from fenced.guards.s3 import S3VersionStore

        endpoint, _, container = where.partition("|")
        aws = boto3.client(
            kind[:2] if kind.startswith("s3") else kind,
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )
        ddb = DynamoDBGuard(aws, container, lock=LOCK) if kind == "dynamodb" else None
        store = S3VersionStore(aws, container, lock=LOCK) if kind == "s3" else None
        if kind == "s3-unfenced":  # planted: the mark's token never refuses (the swap stays)

            class Unfenced(S3VersionStore):
                def _accepts(self, token: int, mark: int) -> bool:
                    return True

            store = Unfenced(aws, container, lock=LOCK)
        fence_item = {"pk": {"S": f"fenced#{resource}"}}
        ddb_tx = DynamoDBGuard(aws, container, lock=LOCK, fence_key=fence_item)

        def write_aws(value: str, token: FencingToken, guarded: bool) -> None:
            item = {"pk": {"S": resource if guarded else f"plain-{resource}"}, "v": {"S": value}}
            if ddb is not None and value.startswith("log:"):  # a race write, logged with it
                data = {"pk": {"S": resource}, "v": {"S": f"{token.value}:{value[4:]}"}}
                log = {
                    "TableName": container,
                    "Key": {"pk": {"S": f"log#{resource}"}},
                    "UpdateExpression": "SET tokens = list_append(if_not_exists(tokens, :e), :t)",
                    "ExpressionAttributeValues": {
                        ":e": {"L": []},
                        ":t": {"L": [{"N": str(token.value)}]},
                    },
                }
                ddb_tx.transact(
                    [{"Put": {"TableName": container, "Item": data}}, {"Update": log}],
                    token=token,
                )
            elif ddb is not None and guarded:
                ddb.put_item(item, token=token)
            elif ddb is not None:
                aws.put_item(TableName=container, Item=item)
            elif store is not None and value.startswith("log:"):  # a race write: token first
                store.publish(resource, f"{token.value}:{value[4:]}".encode(), token=token)
            elif store is not None and guarded:
                store.publish(resource, value.encode(), token=token)
            else:
                aws.put_object(Bucket=container, Key=f"plain/{resource}", Body=value.encode())

        yield write_aws
    elif kind == "sqlalchemy":
        import sqlalchemy as sa
        from sqlalchemy.orm import Session

        from fenced.guards.sql import SQLGuard

        engine = sa.create_engine(where)
        sa_guard = SQLGuard(resource, lock=LOCK)

        def write_sa(value: str, token: FencingToken, guarded: bool) -> None:
            with Session(engine) as session:
                if guarded:
                    sa_guard.check(session, token=token)
                session.execute(sa.text("UPDATE data SET v = :v WHERE id = 1"), {"v": value})
                session.commit()

        try:
            yield write_sa
        finally:
            engine.dispose()
    else:
        raise SystemExit(f"unknown target {target!r}")


def race(target: str, resource: str, first: int, step: int, count: int) -> None:
    with writer(target, resource) as write:
        emit(event="ready")
        sys.stdin.readline()
        accepted = 0
        for value in range(first, first + step * count, step):
            # (FenceConflictError: "try again", nothing made current — the S3 store's mark
            # kept moving under many publishers)
            with contextlib.suppress(StaleTokenError, fenced.FenceConflictError):
                write(f"log:pid{os.getpid()}", FencingToken(LOCK, value), True)
                accepted += 1
    emit(event="done", accepted=accepted)


def holder(source: str, target: str, resource: str, ttl: float, how: str) -> None:
    with writer(target, resource) as write, fenced.connect(source) as locks:
        lease = locks.lock(LOCK, ttl=ttl, timeout=STEP_TIMEOUT)
        token = lease.acquire()
        emit(event="acquired", token=str(token))
        for line in sys.stdin:
            cmd, _, arg = line.strip().partition(" ")
            if cmd == "write":
                try:
                    write(arg, token, how == "guarded")
                    emit(event="write-ok")
                except StaleTokenError as exc:
                    emit(event="write-rejected", high_water=str(exc.high_water))
            elif cmd == "quit":
                break


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "race":
        race(argv[1], argv[2], *map(int, argv[3:6]))
    elif mode == "holder":
        holder(argv[1], argv[2], argv[3], float(argv[4]), argv[5])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
