"""The cost of signed tokens (docs/signing.md), each side by side with the unsigned path.

(a) Signing per grant: acquire+release on the SQLite source (sync API), with a signing key
    (HMAC-SHA256, Ed25519) against none, interleaved op by op.
(b) Verification per guarded write: one SQLGuard-fenced UPDATE transaction on SQLite and one
    RedisGuard.set on Redis (AOF always), with verify_keys against none, interleaved.

Target (issue 11): guarded writes with HMAC verification at most 1.05× the unsigned time,
i.e. a ratio (ops/s) of at least 0.95.

Run: ``.venv/bin/python bench/bench_signing.py`` (BENCH_N to change the size).
"""

from __future__ import annotations

import os
import sqlite3
import sys
import tempfile
from collections.abc import Callable, Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import redis
from _common import Result, interleaved, table

import fenced
from fenced import FencingToken, HmacKey, Keyring
from fenced._core.signing import Ed25519SigningKey, token_message
from fenced.guards.redis import RedisGuard
from fenced.guards.sql import SQLGuard
from fenced.testing.servers import RedisServer

N = int(os.environ.get("BENCH_N", "2000"))
HMAC = HmacKey("h1", os.urandom(32))
ED = Ed25519SigningKey("e1", os.urandom(32))


def pair(
    ours: Callable[[], object], peer: Callable[[], object], a: str, b: str
) -> tuple[Result, Result]:
    return interleaved([(a, ours, b, peer)], N)[0]


def signed(token: FencingToken, key: HmacKey | Ed25519SigningKey) -> FencingToken:
    return FencingToken(
        token.lock,
        token.value,
        (key.kid, key.sign(token_message(token.lock, token.value, key.kid))),
    )


def main() -> None:
    root = tempfile.mkdtemp()
    url = f"sqlite:///{root}/locks.db"
    plain = fenced.connect(url)
    rows = []
    for key, label in ((HMAC, "HMAC-SHA256"), (ED, "Ed25519")):
        signing = fenced.connect(url, signing_key=key)

        def with_key(locks: fenced.Locks = signing, name: str = f"s-{label}") -> None:
            with locks.lock(name, ttl=30):
                pass

        def without(name: str = f"p-{label}") -> None:
            with plain.lock(name, ttl=30):
                pass

        ours, peer = pair(with_key, without, f"signed ({label})", "unsigned")
        rows.append((f"acquire+release, SQLite source ({label})", ours, peer))
        signing.close()
    plain.close()

    db = sqlite3.connect(f"{root}/data.db", isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL").fetchall()
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v INTEGER)")
    db.execute("INSERT INTO t VALUES (1, 0)")
    guards = {
        "none": SQLGuard("plain", lock="bench"),
        "HMAC-SHA256": SQLGuard("hmac", lock="bench", verify=Keyring([HMAC])),
        "Ed25519": SQLGuard("ed", lock="bench", verify=Keyring([ED.public()])),
    }
    for guard in guards.values():
        guard.install(db)
    tokens = {
        "none": FencingToken("bench", 5),
        "HMAC-SHA256": signed(FencingToken("bench", 5), HMAC),
        "Ed25519": signed(FencingToken("bench", 5), ED),
    }

    def sql_write(kind: str) -> Callable[[], None]:
        def op() -> None:
            db.execute("BEGIN IMMEDIATE")
            guards[kind].check(db, token=tokens[kind])
            db.execute("UPDATE t SET v = v + 1 WHERE id = 1")
            db.execute("COMMIT")

        return op

    for kind in ("HMAC-SHA256", "Ed25519"):
        ours, peer = pair(sql_write(kind), sql_write("none"), f"verified ({kind})", "unverified")
        rows.append((f"SQLGuard write, SQLite ({kind}), the holder's same token", ours, peer))

    # The first write of every token pays the whole verification (no earlier good answer).
    for kind, key, verify_key in (("HMAC-SHA256", HMAC, HMAC), ("Ed25519", ED, ED.public())):
        pre = [signed(FencingToken("bench2", v), key) for v in range(1, N + 60)]
        counters = {"v": iter(range(N + 60)), "p": iter(range(N + 60))}
        guard_v = SQLGuard(f"fresh-{kind}", lock="bench2", verify=Keyring([verify_key]))
        guard_p = SQLGuard(f"fresh-plain-{kind}", lock="bench2")
        guard_v.install(db)
        guard_p.install(db)

        def first_write(
            guard: SQLGuard,
            counter: Iterator[int],
            token_of: Callable[[int], FencingToken],
        ) -> Callable[[], None]:
            def op() -> None:
                i = next(counter)
                db.execute("BEGIN IMMEDIATE")
                guard.check(db, token=token_of(i))
                db.execute("UPDATE t SET v = v + 1 WHERE id = 1")
                db.execute("COMMIT")

            return op

        ours, peer = pair(
            first_write(guard_v, counters["v"], pre.__getitem__),
            first_write(guard_p, counters["p"], lambda i: FencingToken("bench2", i + 1)),
            f"verified ({kind})",
            "unverified",
        )
        rows.append((f"SQLGuard write, SQLite ({kind}), a new token every write", ours, peer))

    with RedisServer() as server:
        client = redis.Redis(port=server.port)
        rguards = {
            "none": RedisGuard(client, "plain", lock="bench"),
            "HMAC-SHA256": RedisGuard(client, "hmac", lock="bench", verify=Keyring([HMAC])),
            "Ed25519": RedisGuard(client, "ed", lock="bench", verify=Keyring([ED.public()])),
        }

        def redis_write(kind: str) -> Callable[[], None]:
            key = "{" + {"none": "plain", "HMAC-SHA256": "hmac", "Ed25519": "ed"}[kind] + "}:k"
            return lambda: rguards[kind].set(key, "v", token=tokens[kind])

        for kind in ("HMAC-SHA256", "Ed25519"):
            ours, peer = pair(
                redis_write(kind), redis_write("none"), f"verified ({kind})", "unverified"
            )
            rows.append((f"RedisGuard.set, Redis AOF always ({kind})", ours, peer))
        client.close()

    table(
        f"signed tokens, {N} interleaved ops each (ratio = signed ops/s ÷ unsigned; target ≥ 0.95× for HMAC-verified writes)",
        rows,
    )


if __name__ == "__main__":
    main()
