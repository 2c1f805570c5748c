"""The tables, triggers and statements of the ``sqlite://`` source (see sqlite.py)."""

from __future__ import annotations

from typing import Final

__all__ = [
    "PRAGMAS",
    "SCHEMA",
    "SCHEMA_VERSION",
    "SQL_ADD_OWNER",
    "SQL_DEQUEUE",
    "SQL_ENQUEUE",
    "SQL_HAS_OWNER",
    "SQL_HEAD_WAKE",
    "SQL_LOCK_STATE",
    "SQL_NEXT_TOKEN",
    "SQL_PURGE_WAITERS",
    "SQL_RECORDS",
    "SQL_RECORD_INSERT",
    "SQL_RECORD_READ",
    "SQL_RECORD_UPDATE",
    "SQL_RELEASE",
    "SQL_RENEW",
    "SQL_SET_HOLDER",
    "SQL_STATUS",
]

SCHEMA_VERSION: Final = 1

SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS fenced_counters (
        name TEXT PRIMARY KEY,
        last_token INTEGER NOT NULL CHECK (last_token BETWEEN 1 AND 9223372036854775807)
    ) WITHOUT ROWID""",
    """CREATE TRIGGER IF NOT EXISTS fenced_counters_only_grow
        BEFORE UPDATE OF last_token ON fenced_counters
        WHEN NEW.last_token <= OLD.last_token
        BEGIN SELECT RAISE(ABORT, 'fenced: a token counter may only grow'); END""",
    """CREATE TRIGGER IF NOT EXISTS fenced_counters_are_kept
        BEFORE DELETE ON fenced_counters
        BEGIN SELECT RAISE(ABORT, 'fenced: a token counter is never deleted'); END""",
    """CREATE TABLE IF NOT EXISTS fenced_holders (
        name TEXT PRIMARY KEY,
        request_id TEXT NOT NULL,
        token INTEGER NOT NULL,
        ttl REAL NOT NULL,
        expires_at REAL NOT NULL,
        boot_id TEXT NOT NULL,
        owner TEXT  -- who holds it (user@host pid N: description); NULL from fenced 0.1
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS fenced_waiters (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL,
        request_id TEXT NOT NULL,
        expires_at REAL NOT NULL,
        boot_id TEXT NOT NULL,
        wake BLOB NOT NULL,  -- request id, NUL, doorbell address of its process (if any)
        UNIQUE (name, request_id)
    )""",
    "CREATE INDEX IF NOT EXISTS fenced_waiters_queue ON fenced_waiters (name, seq)",
)

# The statements of the hot paths, as module constants so the benchmark runs the very same SQL.
# ?1 name, ?2 boot id, ?3 now: the holder row (if any) and the first live waiter.
SQL_LOCK_STATE: Final = """
SELECT h.request_id, h.token, h.ttl, h.expires_at, h.boot_id,
       (SELECT w.request_id FROM fenced_waiters AS w
         WHERE w.name = ?1 AND w.boot_id = ?2 AND w.expires_at > ?3
         ORDER BY w.seq LIMIT 1)
  FROM (SELECT 1) LEFT JOIN fenced_holders AS h ON h.name = ?1"""
SQL_NEXT_TOKEN: Final = """
INSERT INTO fenced_counters (name, last_token) VALUES (?, 1)
ON CONFLICT (name) DO UPDATE SET last_token = last_token + 1
RETURNING last_token"""
SQL_SET_HOLDER: Final = """
INSERT OR REPLACE INTO fenced_holders (name, request_id, token, ttl, expires_at, boot_id, owner)
VALUES (?, ?, ?, ?, ?, ?, ?)"""
# A file made by fenced 0.1 gains the owner column (nullable: 0.1 processes still write rows
# without it, so both versions can share the file while it is upgraded; the schema version
# stays 1).
SQL_ADD_OWNER: Final = "ALTER TABLE fenced_holders ADD COLUMN owner TEXT"
SQL_HAS_OWNER: Final = (
    "SELECT count(*) FROM pragma_table_info('fenced_holders') WHERE name = 'owner'"
)
SQL_RELEASE: Final = """
DELETE FROM fenced_holders WHERE name = ?1 AND token = ?2 AND request_id = ?3
RETURNING expires_at, boot_id,
  (SELECT w.wake FROM fenced_waiters AS w
    WHERE w.name = ?1 AND w.boot_id = ?4 AND w.expires_at > ?5
    ORDER BY w.seq LIMIT 1)"""
SQL_RENEW: Final = """
UPDATE fenced_holders SET expires_at = max(expires_at, ?), ttl = ?
 WHERE name = ? AND token = ? AND request_id = ? AND boot_id = ? AND expires_at > ?"""
SQL_ENQUEUE: Final = """
INSERT INTO fenced_waiters (name, request_id, expires_at, boot_id, wake) VALUES (?, ?, ?, ?, ?)
ON CONFLICT (name, request_id) DO UPDATE SET expires_at = excluded.expires_at, wake = excluded.wake"""
SQL_HEAD_WAKE: Final = """
SELECT wake FROM fenced_waiters WHERE name = ? AND boot_id = ? AND expires_at > ?
 ORDER BY seq LIMIT 1"""
SQL_DEQUEUE: Final = "DELETE FROM fenced_waiters WHERE name = ? AND request_id = ?"
SQL_PURGE_WAITERS: Final = (
    "DELETE FROM fenced_waiters WHERE name = ? AND (boot_id != ? OR expires_at <= ?)"
)
SQL_STATUS: Final = """
SELECT (SELECT last_token FROM fenced_counters WHERE name = ?1),
       h.request_id, h.token, h.expires_at, h.boot_id,
       (SELECT count(*) FROM fenced_waiters AS w
         WHERE w.name = ?1 AND w.boot_id = ?2 AND w.expires_at > ?3),
       {owner}, h.ttl
  FROM (SELECT 1) LEFT JOIN fenced_holders AS h ON h.name = ?1"""

PRAGMAS: Final = ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL")

# Records (replicated groups' configurations), made on first use: a file of schema version 1
# may predate them, and a reader must not need the write lock to find there are none.
SQL_RECORDS: Final = """CREATE TABLE IF NOT EXISTS fenced_records (
    name TEXT PRIMARY KEY,
    version INTEGER NOT NULL CHECK (version >= 1),
    value TEXT NOT NULL
) WITHOUT ROWID"""
SQL_RECORD_READ: Final = "SELECT version, value FROM fenced_records WHERE name = ?"
SQL_RECORD_INSERT: Final = (
    "INSERT INTO fenced_records (name, version, value) VALUES (?, 1, ?) "
    "ON CONFLICT (name) DO NOTHING"
)
SQL_RECORD_UPDATE: Final = (
    "UPDATE fenced_records SET version = version + 1, value = ?3 WHERE name = ?1 AND version = ?2"
)
