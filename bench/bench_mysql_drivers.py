"""Which asyncio MySQL driver the guards use: asyncmy vs aiomysql, one-row statements on one
connection each to the same MariaDB (``MariaDBServer``), interleaved in rounds.

    pip install aiomysql            # not a dependency of fenced
    python bench/bench_mysql_drivers.py [--n 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from fenced.testing.servers import MariaDBServer


async def p50_us(conn: Any, n: int) -> float:
    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        async with conn.cursor() as cur:
            await cur.execute("SELECT %s", (i,))
            await cur.fetchall()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


async def run(port: int, n: int, rounds: int) -> None:
    import aiomysql
    import asyncmy

    conns = {
        "asyncmy": await asyncmy.connect(
            host="127.0.0.1", port=port, user="root", database="fenced"
        ),
        "aiomysql": await aiomysql.connect(host="127.0.0.1", port=port, user="root", db="fenced"),
    }
    got: dict[str, list[float]] = {name: [] for name in conns}
    for _ in range(rounds):
        for name, conn in conns.items():
            got[name].append(await p50_us(conn, n))
    for name, values in got.items():
        print(f"{name:9s} p50 per statement: {', '.join(f'{v:.0f}' for v in values)} µs")
    a, b = statistics.median(got["asyncmy"]), statistics.median(got["aiomysql"])
    print(f"asyncmy / aiomysql time: {a / b:.2f}x")
    for conn in conns.values():
        conn.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with MariaDBServer() as db:
        asyncio.run(run(db.port, args.n, args.rounds))


if __name__ == "__main__":
    main()
