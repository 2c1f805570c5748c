"""Where ``fenced serve``'s CPU per grant goes, layer by layer, in one process (no sockets).

Each row runs ``--clients`` concurrent loops of acquire+release, each on its own lock, on one
event loop marked as ``fenced serve`` marks its own (commits per turn of the loop), against a
fresh SQLite file (fsync on), and reports the process's CPU time per acquire+release:

- ``backend``: the SQLite source's ``acquire``/``release`` alone;
- ``gateway``: through the server's ``Gateway`` (metrics, the grants table, the transition
  log line at the default level, to a file);
- ``app``: the ASGI app (the fast lane and the handlers) called with an HTTP scope, as
  uvicorn would call it — everything of a request but the HTTP parsing and the socket;
- ``protocol``: the HTTP protocol ``fenced serve`` runs (uvicorn's httptools protocol with
  fenced's bounds and its direct lane, ``fenced.server._http``) fed each request's bytes,
  over an in-memory transport — everything but the socket's system calls;
- ``protocol-asgi``: the same protocol without the direct lane (every request through
  uvicorn's ASGI cycle and the app's fast lane: before the direct lane).

The loop is uvloop's where it is installed, as ``fenced serve``'s.

The HTTP layer's share is the rest of ``bench_http_peer.py``'s server CPU per grant.
Run: ``python bench/bench_serve_layers.py [--clients 64] [--seconds 3] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import statistics
import tempfile
import time
from typing import Any

from fenced._core.portal import mark_private
from fenced.server._app import ServerSettings, create_app
from fenced.server._run import setup_logging

_HANDLER: list[Any] = [None]  # (what setup_logging returned)
_URL: list[str | None] = [None]  # (--url: another source than a fresh SQLite file)


async def _run(kind: str, clients: int, seconds: float, tmp: str) -> float:
    mark_private(asyncio.get_running_loop(), commit_per_turn=True)
    url = _URL[0] or f"sqlite:///{tmp}/{kind}-{time.monotonic_ns()}.db"
    app = create_app(ServerSettings(url=url))
    gw = app.state.gateway
    if hasattr(_HANDLER[0], "info_line"):  # (as `fenced serve` sets it up; older ones: not)
        gw.transition_line = functools.partial(
            _HANDLER[0].info_line, logging.getLogger("fenced.server")
        )
    await gw.start()
    backend = gw.backend
    stop = time.monotonic() + seconds
    done = 0

    async def backend_loop(i: int) -> None:
        nonlocal done
        while time.monotonic() < stop:
            g = await backend.acquire(
                f"b{i}", request_id=f"r{i}", ttl=30, deadline=None, on_lost=lambda e: None
            )
            await backend.release(g)
            done += 1

    async def gateway_loop(i: int) -> None:
        nonlocal done
        while time.monotonic() < stop:
            g, _ = await gw.acquire(f"g{i}", f"r{i}", 30, 0, "bench")
            await gw.release(f"g{i}", g.token, f"r{i}")
            done += 1

    async def app_loop(i: int) -> None:
        nonlocal done
        while time.monotonic() < stop:
            g = await _post(app, f"/v1/locks/a{i}/-/acquire", {"ttl": 30})
            await _post(
                app,
                f"/v1/locks/a{i}/-/release",
                {"token": g["token"], "request_id": g["request_id"]},
            )
            done += 1

    async def protocol_loop(i: int) -> None:
        nonlocal done
        conn = _Connection(app, i, direct=kind == "protocol")
        while time.monotonic() < stop:
            g = await conn.post(f"/v1/locks/h{i}/-/acquire", {"ttl": 30})
            await conn.post(
                f"/v1/locks/h{i}/-/release", {"token": g["token"], "request_id": g["request_id"]}
            )
            done += 1

    loop_of = {
        "backend": backend_loop,
        "gateway": gateway_loop,
        "app": app_loop,
        "protocol": protocol_loop,
        "protocol-asgi": protocol_loop,
    }[kind]
    t0 = time.process_time()
    await asyncio.gather(*(loop_of(i) for i in range(clients)))
    used = time.process_time() - t0
    await gw.stop()
    return 1e6 * used / max(1, done)


async def _post(app: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    data = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"bench"),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(data)),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 7400),
        "state": {},
        "fenced.body_received": True,
    }
    sent: list[bytes] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append(message.get("body", b""))

    await app(scope, receive, send)
    reply: dict[str, Any] = json.loads(b"".join(sent))
    return reply


class _Transport(asyncio.Transport):
    """An in-memory transport: what the protocol writes goes to ``sink``."""

    def __init__(self, i: int, sink: Any) -> None:
        super().__init__()
        self.sink, self.closing = sink, False
        self.extra = {"peername": ("127.0.0.1", 40000 + i), "sockname": ("127.0.0.1", 7400)}

    def write(self, data: Any) -> None:
        self.sink(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.extra.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Connection:
    """One client connection to the protocol ``fenced serve`` runs, without a socket."""

    _configs: dict[tuple[int, bool], Any] = {}

    def __init__(self, app: Any, i: int, direct: bool) -> None:
        import uvicorn
        from uvicorn.server import ServerState

        from fenced.server._http import http_protocol

        config = self._configs.get((id(app), direct))
        if config is None:
            protocol = http_protocol(30.0, app.direct if direct else None)
            config = uvicorn.Config(
                app, log_config=None, lifespan="off", http=protocol, access_log=False
            )
            config.load()
            self._configs[(id(app), direct)] = config
        self.state = ServerState()
        protocol_class: Any = config.http_protocol_class
        self.protocol = protocol_class(config=config, server_state=self.state, app_state={})
        self.got = bytearray()
        self.waiter: asyncio.Future[None] | None = None
        self.protocol.connection_made(_Transport(i, self._received))

    def _received(self, data: bytes) -> None:
        self.got += data
        head_end = self.got.find(b"\r\n\r\n")
        if head_end < 0:
            return
        length = int(self.got.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
        if len(self.got) >= head_end + 4 + length and self.waiter is not None:
            self.waiter.set_result(None)

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        self.got.clear()
        self.waiter = asyncio.get_running_loop().create_future()
        self.protocol.data_received(
            b"POST %s HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path.encode(), len(data), data)
        )
        await self.waiter
        if not self.got.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(bytes(self.got))
        reply: dict[str, Any] = json.loads(self.got[self.got.find(b"\r\n\r\n") + 4 :])
        return reply


def _loop_factory() -> Any:
    """uvloop's loop where it is installed, as uvicorn picks it for ``fenced serve``."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default="backend,gateway,app", help="the rows to run")
    parser.add_argument("--log", default=os.devnull, help="where the log lines go")
    parser.add_argument("--level", default="info", help="the log level (the default: info)")
    parser.add_argument(
        "--url",
        default=None,
        help="the source (default: a fresh SQLite file; memory:// leaves the HTTP layers alone)",
    )
    args = parser.parse_args()
    _URL[0] = args.url
    fd = os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 2)  # (setup_logging writes to stderr: the lines go to --log)
    _HANDLER[0] = setup_logging("text", args.level)
    kinds = args.kinds.split(",")
    got: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory(prefix="fenced-layers-") as tmp:
        for _ in range(args.rounds):
            for kind in kinds:  # (interleaved: the machine's load hits each alike)
                with asyncio.Runner(loop_factory=_loop_factory()) as runner:
                    got[kind].append(runner.run(_run(kind, args.clients, args.seconds, tmp)))
    print(f"CPU µs per acquire+release, {args.clients} clients, load {os.getloadavg()[0]:.1f}")
    below = 0.0
    for kind in kinds:
        med = statistics.median(got[kind])
        print(
            f"{kind:8} median {med:6.0f}  (+{med - below:4.0f})  "
            f"all {', '.join(f'{x:.0f}' for x in got[kind])}"
        )
        below = med
    logging.shutdown()


if __name__ == "__main__":
    main()
