"""One convention for every guard: ``token=`` by keyword. 0.1's positional forms still work,
for one release, and say so (DeprecationWarning naming the method); the new form is silent."""

from __future__ import annotations

import sqlite3
import warnings
from pathlib import Path

import pytest
import redis

from fenced import FencingToken, StaleTokenError
from fenced.guards.etcd import EtcdGuard
from fenced.guards.files import FileGuard, HighWaterFile
from fenced.guards.redis import RedisGuard
from fenced.guards.sql import RowGuard, SQLGuard
from fenced.testing.servers import EtcdServer, RedisServer
from tests.helpers import unique_name

LOCK = "jobs"


def tok(value: int) -> FencingToken:
    return FencingToken(LOCK, value)


def test_old_positional_tokens_work_and_warn_the_new_form_is_silent(
    tmp_path: Path, redis_server: RedisServer, etcd_server: EtcdServer
) -> None:
    db = sqlite3.connect(tmp_path / "db.sqlite", isolation_level=None)
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    db.execute("INSERT INTO t VALUES (1, 'a')")
    sql, rows = SQLGuard("t", lock=LOCK), RowGuard("t", lock=LOCK)
    sql.install(db)
    rows.install(db)
    files = FileGuard(tmp_path / "files", lock=LOCK)
    mark = HighWaterFile(tmp_path / "mark", lock=LOCK)
    client = redis.Redis(port=redis_server.port)
    name = unique_name("kw")
    red = RedisGuard(client, name, lock=LOCK)
    etcd = EtcdGuard(etcd_server.endpoint, name, lock=LOCK)

    def in_tx(fn: object) -> None:
        db.execute("BEGIN IMMEDIATE")
        fn()  # type: ignore[operator]
        db.execute("COMMIT")

    old_forms = {
        "SQLGuard.check": lambda: in_tx(lambda: sql.check(db, tok(2))),
        "RowGuard.update": lambda: rows.update(db, tok(2), key={"id": 1}, values={"v": "b"}),
        "FileGuard.write": lambda: files.write("r", b"x", tok(2)),
        "FileGuard.publish": lambda: files.publish("r", tok(2), b"y"),  # 0.1's order
        "FileGuard.claim": lambda: files.claim("r", tok(2)),
        "HighWaterFile.check_and_advance": lambda: mark.check_and_advance(tok(2)),
        "HighWaterFile.hold": lambda: mark.hold(tok(2)).__enter__(),
        "RedisGuard.set": lambda: red.set(f"{{{name}}}:k", "v", tok(2), 60_000),
        "RedisGuard.hset": lambda: red.hset(f"{{{name}}}:h", {"f": 1}, tok(2)),
        "EtcdGuard.put": lambda: etcd.put(f"{name}/k", "v", tok(2)),
        "EtcdGuard.delete": lambda: etcd.delete(f"{name}/k", tok(2)),
    }
    try:
        for method, call in old_forms.items():
            with pytest.warns(DeprecationWarning, match=method.replace(".", r"\.")):
                call()
        assert 0 < client.pttl(f"{{{name}}}:k") <= 60_000  # px still read from its old place
        assert files.read("r") == (tok(2), b"y")  # publish's old order understood
        new_forms = [
            lambda: in_tx(lambda: sql.check(db, token=tok(3))),
            lambda: rows.update(db, token=tok(3), key={"id": 1}, values={"v": "c"}),
            lambda: files.write("r", b"z", token=tok(3)),
            lambda: files.publish("r", b"w", token=tok(3)),
            lambda: files.claim("r", token=tok(3)),
            lambda: HighWaterFile(tmp_path / "mark2", lock=LOCK).check_and_advance(token=tok(3)),
            lambda: red.set(f"{{{name}}}:k", "v", token=tok(3), px=1000),
            lambda: etcd.put(f"{name}/k", "v", token=tok(3)),
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for call in new_forms:
                call()
        # The rule is the same whichever form carried the token.
        with pytest.raises(StaleTokenError), pytest.warns(DeprecationWarning):
            red.set(f"{{{name}}}:k", "stale", tok(1))
        with pytest.raises(TypeError, match="multiple values"):
            red.set(f"{{{name}}}:k", "v", tok(3), token=tok(3))  # type: ignore[misc]
    finally:
        etcd.close()
        client.close()
        db.close()


def test_a_guards_lock_is_lock_by_keyword_and_the_old_position_warns(
    redis_server: RedisServer, etcd_server: EtcdServer
) -> None:
    client = redis.Redis(port=redis_server.port)
    name = unique_name("lockkw")
    try:
        with pytest.warns(DeprecationWarning, match=r"RedisGuard\(\): pass the lock name as lock="):
            old = RedisGuard(client, name, LOCK)  # type: ignore[misc]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            new = RedisGuard(client, name, lock=LOCK)
        assert old.lock == new.lock == LOCK
        with pytest.raises(TypeError, match="multiple values for 'lock'"):
            RedisGuard(client, name, LOCK, lock=LOCK)  # type: ignore[misc]
        with pytest.warns(DeprecationWarning, match=r"EtcdGuard\(\): pass the lock name"):
            etcd = EtcdGuard(etcd_server.endpoint, name, LOCK)  # type: ignore[misc]
        with etcd:
            etcd.put(f"{name}/k", "v", token=tok(5))
            with pytest.raises(StaleTokenError):
                etcd.put(f"{name}/k", "v", token=tok(4))
    finally:
        client.close()
