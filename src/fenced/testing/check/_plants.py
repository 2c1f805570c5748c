"""Planted faults: bugs the kit must catch, so a user can watch it catch them
(``fenced check --plant NAME``) and the kit's own tests can prove every checker can fail.

Each is a mistake people make when they build fencing by hand, put in one place:

- in the **resource** (a hand-written fence over the same SQLite register, ``planted+sqlite``):
  ``no-fence``, ``unfenced-read``, ``off-by-one``, ``check-then-write``, ``mark-in-memory``,
  ``mark-not-raised``, ``write-then-check``, ``hidden-check-then-write``, ``lock-ignored``,
  ``tokenless-ok`` (the ``impostor`` nemesis writes with another lock's token and with none),
  and with signed tokens ``signature-skipped``,
  ``key-id-ignored``, ``source-ignored`` (the ``forge`` nemesis writes with forged tokens);
- in the **worker's use of its lease**: ``lease-overestimated``, ``unfenced-release``;
- in the **token source** (one the kit starts and kills -9 and restarts): ``token-in-memory``
  (fenced serve over ``memory://``), ``counter-not-fsynced`` (Redis without its AOF).

With no plant the same hand-written fence is correct: ``tests/kit/test_check_plants.py`` runs
it clean, so a caught plant is the plant, not the harness.
"""

from __future__ import annotations

import contextlib
import copy
import sqlite3
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from ..._core.errors import ConfigurationError, InvalidTokenError, StaleTokenError
from ..._core.signing import Keyring, TokenVerifier
from ..._core.token import FencingToken
from ._register import KEY, query_of, sqlite_transaction

__all__ = ["PLANTS", "SIGNING_PLANTS", "PlantedSQLite", "plant_role"]

PLANTS: dict[str, str] = {
    "no-fence": "the resource checks no token at all",
    "unfenced-read": "the write is fenced but the read before it is not",
    "off-by-one": "refuses only tokens two below the mark (`token + 1 < mark` for `<=`)",
    "check-then-write": "checks the token in one transaction, writes in the next",
    "mark-in-memory": "each process keeps the mark in its own memory",
    "mark-not-raised": "checks against the mark but never raises it",
    "write-then-check": "writes first, then checks; a refusal leaves the write in place",
    "hidden-check-then-write": "checks in one transaction and writes in the next, back to back "
    "inside one write() (no write_steps: the kit is not told where the seam is)",
    "lock-ignored": "compares a token's value with the mark, never its lock's name",
    "tokenless-ok": "a write that carries no token is written unchecked",
    "signature-skipped": "signing is on, but the resource never verifies a token's signature",
    "key-id-ignored": "a token signed under a key id the resource does not know is let through",
    "source-ignored": "a token well signed for another source is let through (the resource "
    "trusts the source the token names, not its own)",
    "lease-overestimated": "the holder believes its lease lasts twice its ttl",
    "unfenced-release": "release frees the lock whoever holds it (no token)",
    "token-in-memory": "the token source keeps its counter in memory and is restarted",
    "counter-not-fsynced": "the token source (Redis, no AOF) loses its counter on kill -9",
}

_RESOURCE_PLANTS = frozenset(list(PLANTS)[: list(PLANTS).index("source-ignored") + 1])  # (in order)
SIGNING_PLANTS = frozenset({"signature-skipped", "key-id-ignored", "source-ignored"})
_WORKER_PLANTS = frozenset({"lease-overestimated", "unfenced-release"})


def plant_role(name: str) -> str:
    """Where a plant lives: ``resource``, ``worker`` or ``source`` ("" for no plant)."""
    if not name:
        return ""
    if name not in PLANTS:
        raise ConfigurationError(f"no planted fault {name!r}: choose from {', '.join(PLANTS)}")
    if name in _RESOURCE_PLANTS:
        return "resource"
    return "worker" if name in _WORKER_PLANTS else "source"


class PlantedSQLite:
    """The SQLite register of the default resource, fenced by hand in a table
    ``planted_fence(resource, mark)`` — correctly with ``plant=""``, else with the named
    mistake. URL: ``planted+sqlite:///PATH?plant=NAME``."""

    def __init__(self, url: str, lock: str, verify: TokenVerifier | None = None) -> None:
        self.plant = query_of(url).get("plant", "")
        self.verify = verify
        if self.plant and plant_role(self.plant) != "resource":
            raise ConfigurationError(f"{self.plant!r} is not a planted resource fault")
        path = urlsplit(url).path
        self.path = ":memory:" if path == "/:memory:" else path
        self.lock = lock
        self._memory = 0  # mark-in-memory: this process's idea of the mark
        self._conn: sqlite3.Connection | None = None

    @classmethod
    def in_memory(cls, lock: str, plant: str = "") -> PlantedSQLite:
        """The register in an SQLite database in this process's memory, held by one
        connection (the simulator's: ``planted+sqlite:///:memory:``)."""
        return cls(f"planted+sqlite:///:memory:?plant={plant}", lock)

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
        return self._conn

    def reset(self) -> None:
        db = self._db()
        db.execute("CREATE TABLE IF NOT EXISTS fenced_check (id TEXT PRIMARY KEY, data TEXT)")
        db.execute("CREATE TABLE IF NOT EXISTS planted_fence (resource TEXT PRIMARY KEY, mark)")
        db.execute("DELETE FROM fenced_check")
        db.execute("DELETE FROM planted_fence")

    def _stored_mark(self, db: sqlite3.Connection) -> int:
        if self.plant == "mark-in-memory":
            return self._memory
        row = db.execute("SELECT mark FROM planted_fence WHERE resource = ?", (KEY,)).fetchone()
        return 0 if row is None else int(row[0])

    def _fence(self, db: sqlite3.Connection, token: FencingToken | None) -> None:
        """Check ``token`` against the mark and raise the mark (inside the caller's
        transaction), with the plant's mistake if it has one."""
        if token is None:  # (an impostor's write: no token at all)
            raise InvalidTokenError("a write with no fencing token")
        if token.lock != self.lock and self.plant != "lock-ignored":
            raise ConfigurationError(f"token of lock {token.lock!r}, not {self.lock!r}")
        self._verify(token)
        mark = self._stored_mark(db)
        stale = token.value + 1 < mark if self.plant == "off-by-one" else token.value < mark
        if stale:
            raise StaleTokenError(token, FencingToken(self.lock, mark), KEY)
        if self.plant == "mark-not-raised" and mark:
            return
        if self.plant == "mark-in-memory":
            self._memory = max(mark, token.value)
            return
        db.execute(
            "INSERT INTO planted_fence VALUES (?, ?) ON CONFLICT (resource) DO UPDATE "
            "SET mark = max(mark, excluded.mark)",
            (KEY, token.value),
        )

    def _verify(self, token: FencingToken) -> None:
        """The signature, before the mark is touched (a SignatureError refuses the write)."""
        if self.verify is None or self.plant == "signature-skipped":
            return
        signature = token.signature
        kids: frozenset[str] = getattr(self.verify, "kids", frozenset())
        if self.plant == "key-id-ignored" and signature is not None and signature[0] not in kids:
            return  # the mistake: an unknown key id falls through instead of failing
        if self.plant == "source-ignored" and signature is not None and len(signature) == 3:
            # the mistake: the source id the token claims is the one checked against (the
            # same keys, trusting that source: a copy of the keyring with its public field set;
            # the copy shares the cache of good signatures, keyed by source too, and only this
            # plant ever verifies a token bound to a source here)
            trusting = copy.copy(self.verify)
            if isinstance(trusting, Keyring):
                trusting.source_id = signature[2]
            trusting.verify(token.lock, token.value, signature)
            return
        self.verify.verify(token.lock, token.value, signature)

    def read(self, token: FencingToken) -> bytes | None:
        db = self._db()
        with sqlite_transaction(db):
            if self.plant not in ("no-fence", "unfenced-read"):
                self._fence(db, token)
            row = db.execute("SELECT data FROM fenced_check WHERE id = ?", (KEY,)).fetchone()
        return None if row is None else str(row[0]).encode()

    def _put(self, db: sqlite3.Connection, data: bytes) -> None:
        db.execute("INSERT OR REPLACE INTO fenced_check VALUES (?, ?)", (KEY, data.decode()))

    def _check(self, token: FencingToken | None) -> None:
        db = self._db()
        with sqlite_transaction(db):
            self._fence(db, token)

    def _store(self, data: bytes) -> None:
        db = self._db()
        with sqlite_transaction(db):
            self._put(db, data)

    def _write(self, token: FencingToken | None, data: bytes) -> None:
        db = self._db()
        if self.plant == "write-then-check":
            with sqlite_transaction(db):
                self._put(db, data)
            with sqlite_transaction(db):
                self._fence(db, token)
        else:
            with sqlite_transaction(db):
                if self.plant != "no-fence" and (token or self.plant != "tokenless-ok"):
                    self._fence(db, token)
                self._put(db, data)

    def write_steps(self, token: FencingToken | None, data: bytes) -> list[Callable[[], None]]:
        """One step; two with ``check-then-write``: the check (its own transaction), then
        the write (the next one) — a pause between them lets a newer holder write first."""
        if self.plant == "check-then-write":
            return [lambda: self._check(token), lambda: self._store(data)]
        if self.plant == "hidden-check-then-write":  # (the same two, as one step)
            return [lambda: self._check_then_store(token, data)]
        return [lambda: self._write(token, data)]

    def _check_then_store(self, token: FencingToken | None, data: bytes) -> None:
        self._check(token)
        self._store(data)

    def write(self, token: FencingToken | None, data: bytes) -> None:
        for step in self.write_steps(token, data):
            step()

    def crash(self) -> None:
        """``mark-in-memory``: the mark this process kept is gone (the rest is on disk)."""
        self._memory = 0

    def final(self) -> tuple[bytes | None, int | None]:
        with contextlib.ExitStack() as stack:
            if self.path == ":memory:":  # (the simulator's: one connection holds it all)
                db = self._db()
            else:
                db = stack.enter_context(contextlib.closing(sqlite3.connect(self.path)))
            row = db.execute("SELECT mark FROM planted_fence WHERE resource = ?", (KEY,)).fetchone()
            data = db.execute("SELECT data FROM fenced_check WHERE id = ?", (KEY,)).fetchone()
        mark = None if row is None else int(row[0])
        return (None if data is None else str(data[0]).encode()), mark

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def source_plant_server(name: str, base_dir: str) -> Any:
    """The token-source server a source plant needs (not started)."""
    from ..servers import FencedServer, RedisServer

    if name == "token-in-memory":
        return FencedServer("memory://", base_dir, args=["--insecure-no-auth"])
    # The planted mistake: no append-only file, no snapshots — the counter lives in memory.
    return RedisServer(base_dir, extra=["--appendonly", "no"])
