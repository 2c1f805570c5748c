"""``locks.lock(name, fence=[...])``: on each grant, before acquire returns, every listed
resource's high-water mark is raised to the new token. A holder paused (SIGSTOP, a real OS
process) past its ttl is then refused by an SQL table, a Redis key and a directory of files
that the new holder never wrote to; the new holder is accepted by all three. A resource that
cannot be fenced gives the grant back (FenceError) or is reported, never skipped silently."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import redis

import fenced
from fenced.guards.files import FileGuard
from fenced.guards.redis import RedisGuard
from fenced.guards.sql import SQLGuard
from fenced.testing.servers import RedisServer
from tests.helpers import ROOT, unique_name

OLD_HOLDER = """
import sqlite3, sys, redis, fenced
from fenced.guards.files import FileGuard
from fenced.guards.redis import RedisGuard
from fenced.guards.sql import SQLGuard
url, db, redis_url, key, files, lock = sys.argv[1:7]
with fenced.connect(url) as locks:
    lease = locks.lock(lock, ttl=1.0)
    token = lease.acquire()
    print(token, flush=True)
    sys.stdin.readline()  # (SIGSTOPped here past its ttl, then told to go on)
    results = []
    conn = sqlite3.connect(db)
    try:
        with conn:
            SQLGuard(lock).check(conn, token=token)
            conn.execute("INSERT INTO jobs VALUES ('old holder')")
        results.append("sql:written")
    except fenced.StaleTokenError:
        results.append("sql:refused")
    for name, write in (
        ("redis", lambda: RedisGuard(redis.Redis.from_url(redis_url), key, lock).set(key, b"old", token=token)),
        ("files", lambda: FileGuard(files, lock=lock).write("report", b"old", token=token)),
    ):
        try:
            write()
            results.append(name + ":written")
        except fenced.StaleTokenError:
            results.append(name + ":refused")
    print(" ".join(results), flush=True)
"""


def _setup(tmp_path: Path, lock: str) -> Path:
    db = tmp_path / "jobs.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE jobs (who TEXT)")
        SQLGuard(lock).install(conn)
    return db


def test_a_paused_holder_is_refused_where_the_new_holder_never_wrote(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    if redis_server.proc is None:
        redis_server.start()
    lock, key = unique_name("jobs"), unique_name("key")
    db, files = _setup(tmp_path, lock), tmp_path / "files"
    FileGuard(files, lock=lock).write("report", b"v0", token=fenced.FencingToken(lock, 1))
    url = f"sqlite:///{tmp_path}/locks.db"
    old = subprocess.Popen(
        [sys.executable, "-c", OLD_HOLDER, url, str(db), redis_server.url, key, str(files), lock],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )  # fmt: skip
    try:
        assert old.stdout is not None and old.stdin is not None
        old_token = fenced.FencingToken.parse(old.stdout.readline().strip())
        os.kill(old.pid, signal.SIGSTOP)  # a GC pause, longer than its 1 s lease
        client = redis.Redis.from_url(redis_server.url)
        targets = [
            SQLGuard(lock).fencer(lambda: sqlite3.connect(db, isolation_level=None)),
            RedisGuard(client, key, lock=lock),
            FileGuard(files, lock=lock),
        ]
        with fenced.connect(url) as locks:
            lease = locks.lock(lock, ttl=5, fence=targets)
            new_token = lease.acquire(timeout=30)  # after the old lease expired
            assert new_token > old_token and lease.not_fenced == []
            # Fenced, though nothing was written: every mark is at the new token already.
            with sqlite3.connect(db) as conn:
                assert SQLGuard(lock).high_water(conn) == new_token
            assert RedisGuard(client, key, lock=lock).high_water() == new_token
            assert FileGuard(files, lock=lock).high_water("report") == new_token
            assert FileGuard(files, lock=lock).read("report")[1] == b"v0"  # content unchanged
            os.kill(old.pid, signal.SIGCONT)
            old.stdin.write("go\n")
            old.stdin.flush()
            assert old.stdout.readline().split() == [
                "sql:refused",
                "redis:refused",
                "files:refused",
            ]
            # ... and the new holder is accepted by all three.
            conn = sqlite3.connect(db)
            with conn:
                SQLGuard(lock).check(conn, token=new_token)
            conn.close()
            RedisGuard(client, key, lock=lock).set(key, b"new", token=new_token)
            FileGuard(files, lock=lock).write("report", b"new", token=new_token)
            lease.release()
        assert old.wait(30) == 0
    finally:
        old.kill()


def test_a_resource_that_cannot_be_fenced_gives_the_grant_back(
    tmp_path: Path, refused_port: int
) -> None:
    lock = unique_name("jobs")
    db = _setup(tmp_path, lock)
    dead = RedisGuard(redis.Redis(port=refused_port, socket_connect_timeout=0.5), "k", lock=lock)
    good = SQLGuard(lock).fencer(lambda: sqlite3.connect(db, isolation_level=None))
    with fenced.connect(f"sqlite:///{tmp_path}/locks.db") as locks:
        with pytest.raises(fenced.FenceError) as caught:
            locks.lock(lock, ttl=5, fence=[good, dead]).acquire(timeout=5)
        assert len(caught.value.not_fenced) == 1 and caught.value.not_fenced[0].target is dead
        assert isinstance(caught.value.not_fenced[0].error, fenced.BackendUnavailable)
        assert locks.status(lock).holder is None  # given back: the next one is not kept waiting
        lease = locks.lock(lock, ttl=5, fence=[good, dead], fence_errors="report")
        token = lease.acquire(timeout=5)
        assert lease.held and [m.target for m in lease.not_fenced] == [dead]
        with sqlite3.connect(db) as conn:
            assert SQLGuard(lock).high_water(conn) == token  # the reachable one was fenced
        lease.release()


def test_fence_targets_are_checked_when_the_lock_is_made(tmp_path: Path) -> None:
    with fenced.connect(f"sqlite:///{tmp_path}/locks.db") as locks:
        with pytest.raises(fenced.ConfigurationError, match="fence"):
            locks.lock("x", fence=[object()])
        with pytest.raises(fenced.ConfigurationError, match="fence_errors"):
            locks.lock("x", fence=[], fence_errors="ignore")


async def test_async_guards_and_callables_are_fence_targets(tmp_path: Path) -> None:
    seen: list[fenced.FencingToken] = []

    async def remember(token: fenced.FencingToken) -> None:
        seen.append(token)

    async with fenced.connect_async(f"sqlite:///{tmp_path}/locks.db") as locks:
        async with locks.lock("jobs", ttl=5, fence=[remember, seen.append]) as lease:
            assert seen == [lease.token, lease.token]
