"""``fenced serve`` against etcd's own lock service (v3lock), driven over raw HTTP/1.1.

The peer is the lock a user would pick instead of fenced: etcd's *server-side* lock service
(``/v3/lock/lock``, ``/v3/lock/unlock``, leases by ``/v3/lease/grant``) through etcd's JSON
gateway, not a client-side recipe. Both are driven by the same independent load generator:
asyncio sockets, one keep-alive HTTP/1.1 connection per client, each client looping
acquire+release on its own lock. The generator (``drive``) imports nothing from fenced and
no HTTP library; it runs in its own process (``nice``-able, pinnable with ``--pin``), so that
what is measured is the server, not the client stack.

- fenced: ``POST /v1/locks/{name}/-/acquire {"ttl": 30}`` then ``.../-/release`` with the
  grant's token and request id (2 requests; the grant carries its own lease).
- etcd (``--etcd-lease session``, the default and the stronger peer): one lease per client,
  granted once (as clientv3's ``concurrency.Session`` does), then ``/v3/lock/lock`` with it
  and ``/v3/lock/unlock`` (2 requests). ``--etcd-lease per-lock``: a lease granted for each
  acquire, as fenced's grant has its own (3 requests).

The two take turns in slices (``--slices`` each, fenced first then etcd, for each client
count) in one run, so that the load of a shared machine hits both alike. The servers run
as in production: ``fenced serve`` at its default log level on the embedded SQLite source
(fsync on), etcd single member (fsync on).

Run: ``python bench/bench_http_peer.py [--clients 16,64] [--seconds 4] [--slices 3]
[--nice 0] [--pin CPU] [--before-src DIR] [--fastapi-only] [--fenced-procs N]
[--fenced-args ...]``; ``python bench/bench_http_peer.py drive
--kind fenced|etcd --port P --clients N --seconds S`` runs the generator alone.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

# -- the load generator (stdlib only) --------------------------------------------------------------


class Conn:
    """One keep-alive HTTP/1.1 connection: a POST with a JSON body, its JSON answer."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def post(
        self, path: str, body: dict[str, Any], refusable: bool = False
    ) -> dict[str, Any]:
        data = json.dumps(body).encode()
        self.writer.write(
            b"POST %s HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path.encode(), len(data), data)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = head[9:12]
        length = -1
        chunked = False
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if chunked:
            payload = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                payload += await self.reader.readexactly(size + 2)
                if size == 0:
                    break
                payload = payload[:-2]
        else:
            payload = await self.reader.readexactly(length)
        reply: dict[str, Any] = json.loads(payload) if payload.strip() else {}
        if status == b"409" and refusable:
            return {}
        if status != b"200":
            raise RuntimeError(f"{path}: {head.splitlines()[0]!r} {reply}")
        return reply

    def close(self) -> None:
        self.writer.close()


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


async def drive(kind: str, port: int, clients: int, seconds: float, etcd_lease: str) -> dict:
    """``clients`` connections, each looping acquire+release on its own lock for ``seconds``;
    returns grants/s and latency percentiles."""
    run = uuid.uuid4().hex[:6]
    conns = [await Conn.open(port) for _ in range(clients)]
    leases: list[str] = []
    if kind == "etcd" and etcd_lease == "session":
        leases = [(await c.post("/v3/lease/grant", {"TTL": 30}))["ID"] for c in conns]
    clock = time.perf_counter
    samples: list[float] = []
    refused: list[int] = []
    stop = clock() + seconds

    async def fenced_loop(i: int, c: Conn) -> None:
        path = f"/v1/locks/p{run}-{i}/-/"
        while clock() < stop:
            t0 = clock()
            g = await c.post(path + "acquire", {"ttl": 30}, refusable=True)
            if not g:  # (409 for a free lock: its source was busy past the try-once's time)
                refused.append(1)
                continue
            await c.post(path + "release", {"token": g["token"], "request_id": g["request_id"]})
            samples.append(clock() - t0)

    async def etcd_loop(i: int, c: Conn) -> None:
        name = _b64(f"/bench/peer/{run}-{i}")
        while clock() < stop:
            t0 = clock()
            fresh = not leases
            lease = (await c.post("/v3/lease/grant", {"TTL": 30}))["ID"] if fresh else leases[i]
            held = await c.post("/v3/lock/lock", {"name": name, "lease": lease})
            await c.post("/v3/lock/unlock", {"key": held["key"]})
            if not leases:
                await c.post("/v3/lease/revoke", {"ID": lease})
            samples.append(clock() - t0)

    loop_of = fenced_loop if kind == "fenced" else etcd_loop
    start = clock()
    await asyncio.gather(*(loop_of(i, c) for i, c in enumerate(conns)))
    elapsed = clock() - start
    for lease in leases:
        await conns[0].post("/v3/lease/revoke", {"ID": lease})
    for c in conns:
        c.close()
    samples.sort()
    n = len(samples)
    return {
        "kind": kind,
        "clients": clients,
        "grants": n,
        "refused": len(refused),
        "per_s": n / elapsed,
        "p50_ms": 1000 * samples[n // 2] if n else None,
        "p99_ms": 1000 * samples[min(n - 1, int(n * 0.99))] if n else None,
    }


# -- the side-by-side run (starts the servers with fenced's test fixtures) --------------------


def _run_driver(args: argparse.Namespace, kind: str, port: int, clients: int) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "drive",
        "--kind",
        kind,
        "--port",
        str(port),
        "--clients",
        str(clients),
        "--seconds",
        str(args.seconds),
        "--etcd-lease",
        args.etcd_lease,
    ]
    if args.pin is not None:
        cmd = ["taskset", "-c", args.pin, *cmd]
    if args.nice:
        cmd = ["nice", "-n", str(args.nice), *cmd]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env())
    if out.returncode:
        raise SystemExit(f"the generator failed on {kind} (port {port}): {out.stderr.strip()}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result: dict = json.loads(out.stdout.strip().splitlines()[-1])
    used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result["driver_cpu_us"] = 1e6 * used / max(1, result["grants"])  # (the generator's own)
    return result


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _clean_env() -> dict[str, str]:
    # (the generator imports nothing from fenced: no PYTHONPATH needed, none given)
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# `fenced serve` whose listening socket is shared with other `fenced serve` processes on the
# same port (SO_REUSEPORT: the kernel spreads connections over them), for --fenced-procs.
_REUSE_PORT = (
    "import socket, fenced.server._run as r\n"
    "_listen = r.listen_socket\n"
    "def _shared(host, port):\n"
    "    real = socket.socket\n"
    "    class S(real):\n"
    "        def bind(self, address):\n"
    "            self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
    "            super().bind(address)\n"
    "    socket.socket = S\n"
    "    try:\n"
    "        return _listen(host, port)\n"
    "    finally:\n"
    "        socket.socket = real\n"
    "r.listen_socket = _shared"
)

# `fenced serve` with ServerSettings(fast_lane=False): one stack, FastAPI's, for every request.
_NO_FAST_LANE = (
    "import dataclasses, fenced.server._app as a, fenced.server._run as r\n"
    "r.create_app = lambda s: a.create_app(dataclasses.replace(s, fast_lane=False))"
)


def compare(args: argparse.Namespace) -> None:
    from fenced.testing.servers import EtcdServer, FencedServer, free_port

    with tempfile.TemporaryDirectory(prefix="fenced-peer-") as tmp:
        for sub in ("etcd", "serve"):
            os.mkdir(os.path.join(tmp, sub))
        etcd = EtcdServer(os.path.join(tmp, "etcd"))
        fenced = FencedServer(
            f"sqlite:///{tmp}/locks.db", os.path.join(tmp, "serve"), args=args.fenced_args
        )
        sides = [("fenced", fenced)]
        if args.before_src:  # (another checkout's fenced serve, in the same slices)
            os.mkdir(os.path.join(tmp, "before"))
            before_server = FencedServer(
                f"sqlite:///{tmp}/before.db",
                os.path.join(tmp, "before"),
                args=args.fenced_args,
                env={"PYTHONPATH": os.path.abspath(args.before_src)},
            )
            sides.append(("before", before_server))
        if args.fastapi_only:  # (the same server with every request through FastAPI)
            os.mkdir(os.path.join(tmp, "fastapi"))
            sides.append(
                (
                    "fastapi",
                    FencedServer(
                        f"sqlite:///{tmp}/fastapi.db",
                        os.path.join(tmp, "fastapi"),
                        args=args.fenced_args,
                        prelude=_NO_FAST_LANE,
                    ),
                )
            )
        extra: dict[str, list[FencedServer]] = {}  # (the other processes of a side)
        if args.fenced_procs > 1:  # (N processes of this fenced serve on one port, one file)
            for i in range(args.fenced_procs):
                os.makedirs(os.path.join(tmp, "procs", str(i)))
            port = free_port()
            group = [
                FencedServer(
                    f"sqlite:///{tmp}/procs.db",
                    os.path.join(tmp, "procs", str(i)),
                    port,
                    args=args.fenced_args,
                    prelude=_REUSE_PORT,
                )
                for i in range(args.fenced_procs)
            ]
            sides.append((f"{args.fenced_procs}procs", group[0]))
            extra[f"{args.fenced_procs}procs"] = group[1:]
        sides.append(("etcd", etcd))
        for kind, server in sides:
            server.start()
            for other in extra.get(kind, []):
                other.start()
        try:
            counts = [int(c) for c in args.clients.split(",")]
            rows: dict[tuple[str, int], list[float]] = {}
            cpu: dict[tuple[str, int], list[float]] = {}
            pids = {
                kind: [s.proc.pid for s in (server, *extra.get(kind, []))]  # type: ignore[union-attr]
                for kind, server in sides
            }
            ports = {kind: server.port for kind, server in sides}
            lat: dict[tuple[str, int], list[tuple[float, float]]] = {}
            for kind, port in ports.items():  # warm-up
                warm = argparse.Namespace(**{**vars(args), "seconds": 1.0})
                _run_driver(warm, "etcd" if kind == "etcd" else "fenced", port, 8)
            for s in range(args.slices):
                for clients in counts:
                    for kind, port in ports.items():
                        before = sum(_cpu_seconds(p) for p in pids[kind])
                        load = os.getloadavg()[0]
                        r = _run_driver(args, "etcd" if kind == "etcd" else "fenced", port, clients)
                        used = sum(_cpu_seconds(p) for p in pids[kind]) - before
                        us = 1e6 * used / max(1, r["grants"])
                        cpu.setdefault((kind, clients), []).append(us)
                        rows.setdefault((kind, clients), []).append(r["per_s"])
                        lat.setdefault((kind, clients), []).append((r["p50_ms"], r["p99_ms"]))
                        print(
                            f"slice {s + 1} {kind:6} {clients:3} clients: {r['per_s']:7.0f} "
                            f"grants/s  p50 {r['p50_ms']:.1f} ms  p99 {r['p99_ms']:.1f} ms  "
                            f"server CPU {us:.0f} µs/grant ({used / args.seconds:.2f} cores)  "
                            f"generator CPU {r['driver_cpu_us']:.0f} µs/grant  load {load:.1f}"
                            + (f"  {r['refused']} acquires refused (409)" if r["refused"] else ""),
                            flush=True,
                        )
            print()
            print(
                "| clients | fenced serve grants/s | etcd v3lock grants/s | ratio per slice "
                "| server CPU µs/grant, fenced / etcd |"
            )
            print("|---|---|---|---|---|")
            for clients in counts:
                f, e = rows[("fenced", clients)], rows[("etcd", clients)]
                ratios = [a / b for a, b in zip(f, e, strict=True)]
                print(
                    f"| {clients} | {min(f):,.0f}–{max(f):,.0f} | {min(e):,.0f}–{max(e):,.0f} | "
                    f"{min(ratios):.2f}–{max(ratios):.2f}× | "
                    f"{min(cpu[('fenced', clients)]):.0f}–{max(cpu[('fenced', clients)]):.0f} / "
                    f"{min(cpu[('etcd', clients)]):.0f}–{max(cpu[('etcd', clients)]):.0f} |"
                )
            if len(counts) > 1:
                lo, hi = counts[0], counts[-1]
                falls = [
                    b / a for a, b in zip(rows[("fenced", lo)], rows[("fenced", hi)], strict=True)
                ]
                print(
                    f"\nfenced {hi} ÷ {lo} clients, per slice: "
                    + ", ".join(f"{x:.2f}" for x in falls)
                )
            for other in ("before", "fastapi", f"{args.fenced_procs}procs"):
                if (other, counts[0]) not in rows:
                    continue
                for clients in counts:
                    f, b = rows[("fenced", clients)], rows[(other, clients)]
                    ratios = [a / c for a, c in zip(f, b, strict=True)]
                    cf, cb = cpu[("fenced", clients)], cpu[(other, clients)]
                    print(
                        f"{clients} clients, fenced ÷ {other}: grants/s "
                        f"{min(ratios):.2f}–{max(ratios):.2f}×, CPU µs/grant "
                        f"{min(cf):.0f}–{max(cf):.0f} vs {min(cb):.0f}–{max(cb):.0f}"
                    )
        finally:
            for kind, server in sides:
                server.stop()
                for other in extra.get(kind, []):
                    other.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="compare", choices=["compare", "drive"])
    parser.add_argument("--kind", choices=["fenced", "etcd"])
    parser.add_argument("--port", type=int)
    parser.add_argument("--clients", default="16,64")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--slices", type=int, default=3)
    parser.add_argument("--etcd-lease", choices=["session", "per-lock"], default="session")
    parser.add_argument("--nice", type=int, default=0, help="nice the generator by this much")
    parser.add_argument("--pin", default=None, help="taskset -c CPU for the generator")
    parser.add_argument(
        "--before-src",
        default=None,
        help="a `src` directory of another fenced (e.g. `git archive` of an older commit): "
        "its `fenced serve` runs in the same slices, for a before/after",
    )
    parser.add_argument(
        "--fastapi-only",
        action="store_true",
        help="also the same server without its fast lane (every request through FastAPI)",
    )
    parser.add_argument(
        "--fenced-procs",
        type=int,
        default=1,
        help="also N `fenced serve` processes sharing one port (SO_REUSEPORT) and one file",
    )
    parser.add_argument(
        "--fenced-args", nargs=argparse.REMAINDER, default=[], help="extra `fenced serve` args"
    )
    args = parser.parse_args()
    if args.mode == "drive":
        result = asyncio.run(
            drive(args.kind, args.port, int(args.clients), args.seconds, args.etcd_lease)
        )
        print(json.dumps(result))
    else:
        compare(args)


if __name__ == "__main__":
    main()
