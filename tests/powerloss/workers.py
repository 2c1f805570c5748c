"""Client processes for the power-loss tests; each prints every acknowledged grant as a line
``LOCK TOKEN`` on stdout (unbuffered) and runs until killed.

``python -m tests.powerloss.workers library URL MODE [PLANT]``: 64 asyncio clients of the
library on one loop, taking turns on 16 locks. MODE ``worker``: an application's loop (group
commit on the source's worker thread); ``turn``: a loop marked as ``fenced serve`` marks its
own (a commit per turn of the loop); ``sync``: 16 threads of the synchronous API (each
transaction inline on its private loop). PLANT: ``module:Class`` registered for ``sqlite``.

``python -m tests.powerloss.workers http URL``: 64 asyncio HTTP clients of a ``fenced serve``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import fenced
from fenced._core import backend as _backend

CLIENTS = 64
LOCKS = 16


async def _clients(url: str) -> None:
    async with fenced.connect_async(url) as locks:

        async def client(i: int) -> None:
            name = f"k{i % LOCKS}"
            while True:
                try:
                    async with locks.lock(name, ttl=1, timeout=30) as lease:
                        # (written while held: the next holder's line comes after this one;
                        # ttl 1 s: after a cut the dead holders, same boot id, expire soon)
                        sys.stdout.write(f"{name} {lease.token.value}\n")
                        sys.stdout.flush()
                except fenced.FencedError as exc:  # the disk is gone: keep trying until killed
                    sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(client(i) for i in range(CLIENTS)))


def _sync_clients(url: str) -> None:
    """MODE ``sync``: 16 threads of the synchronous API on one ``fenced.connect``, whose
    private loop runs each transaction inline, one at a time (no group commit)."""
    import threading

    out = threading.Lock()
    with fenced.connect(url) as locks:

        def client(i: int) -> None:
            name = f"k{i % LOCKS}"
            while True:
                try:
                    with locks.lock(name, ttl=1, timeout=30) as lease:
                        with out:  # (whole lines: threads share stdout)
                            sys.stdout.write(f"{name} {lease.token.value}\n")
                            sys.stdout.flush()
                except fenced.FencedError as exc:  # the disk is gone: keep trying until killed
                    sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
                    time.sleep(0.05)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


async def _library(url: str, mode: str) -> None:
    if mode == "turn":
        from fenced._core.portal import mark_private

        mark_private(asyncio.get_running_loop(), commit_per_turn=True)
    await _clients(url)


async def _files(url: str, guarded: str, marks: str) -> None:
    """16 clients on 4 locks; each grant writes a version through a FileGuard and advances a
    HighWaterFile, then prints ``LOCK TOKEN`` (acknowledged: both writes returned)."""
    from fenced.guards.files import FileGuard, HighWaterFile

    os.makedirs(marks, exist_ok=True)
    guards = {f"f{i}": FileGuard(os.path.join(guarded, f"f{i}"), lock=f"f{i}") for i in range(4)}
    async with fenced.connect_async(url) as locks:

        def write(name: str, token: fenced.FencingToken) -> None:
            guards[name].write("data", f"{token}".encode() * 100, token=token)
            with HighWaterFile(os.path.join(marks, name), lock=name).hold(token=token):
                pass

        async def client(i: int) -> None:
            name = f"f{i % 4}"
            while True:
                try:
                    async with locks.lock(name, ttl=1, timeout=30) as lease:
                        await asyncio.to_thread(write, name, lease.token)
                        sys.stdout.write(f"{name} {lease.token.value}\n")
                        sys.stdout.flush()
                except (fenced.FencedError, OSError) as exc:
                    sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(client(i) for i in range(16)))


SQL_LOCKS = 4


def sql_setup(db: str) -> None:
    """The user's database: a table per lock fenced by a RowGuard, an SQLGuard fence table,
    and a log of every guarded write."""
    import sqlite3

    from fenced.guards.sql import RowGuard, SQLGuard

    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("CREATE TABLE IF NOT EXISTS writes (lock TEXT, token INTEGER)")
        for i in range(SQL_LOCKS):
            name = f"s{i}"
            conn.execute(f"CREATE TABLE IF NOT EXISTS {name} (id INTEGER PRIMARY KEY, v INTEGER)")
            conn.execute(f"INSERT OR IGNORE INTO {name} (id, v) VALUES (1, 0)")
            SQLGuard(name).install(conn)
            RowGuard(name, lock=name).install(conn)
    finally:
        conn.close()


async def _sql(url: str, db: str, synchronous: str) -> None:
    """16 clients on 4 locks; each grant, in one transaction of the user's SQLite database
    (WAL, ``synchronous`` as given): SQLGuard.check, a row in ``writes``, and a RowGuard
    update; then prints ``LOCK TOKEN`` (acknowledged: the COMMIT returned)."""
    import sqlite3
    import threading

    from fenced.guards.sql import RowGuard, SQLGuard

    local = threading.local()

    def write(name: str, token: fenced.FencingToken) -> None:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = sqlite3.connect(db, isolation_level=None, timeout=30)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("BEGIN IMMEDIATE")
        try:
            SQLGuard(name).check(conn, token=token)
            conn.execute("INSERT INTO writes VALUES (?, ?)", (name, token.value))
            RowGuard(name, lock=name).update(
                conn, token=token, key={"id": 1}, values={"v": token.value}
            )
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    async with fenced.connect_async(url) as locks:

        async def client(i: int) -> None:
            name = f"s{i % SQL_LOCKS}"
            while True:
                try:
                    async with locks.lock(name, ttl=1, timeout=30) as lease:
                        await asyncio.to_thread(write, name, lease.token)
                        sys.stdout.write(f"{name} {lease.token.value}\n")
                        sys.stdout.flush()
                except (fenced.FencedError, OSError, sqlite3.Error) as exc:
                    sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(client(i) for i in range(16)))


def main(argv: list[str]) -> None:
    kind, url = argv[0], argv[1]
    if kind == "library":
        if len(argv) > 3 and argv[3]:
            _backend.register_backend("sqlite", argv[3])
        if argv[2] == "sync":
            _sync_clients(url)
        else:
            asyncio.run(_library(url, argv[2]))
    elif kind == "files":
        asyncio.run(_files(url, argv[2], argv[3]))
    elif kind == "sql":
        asyncio.run(_sql(url, argv[2], argv[3]))
    elif kind == "http":
        asyncio.run(_clients(url))
    else:
        raise SystemExit(f"unknown worker {kind!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
