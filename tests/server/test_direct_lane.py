"""The direct lane: acquire, renew and release answered by ``fenced serve``'s HTTP protocol
itself (``fenced.server._http``, ``DirectLane``), over real sockets. The spec is what the
server answers without it (every request through uvicorn's ASGI cycle and the app): the same
bytes (but the date), the same counters, in the same order on a pipelined connection; a
request the lane is not sure of (its body not whole yet, a bad body, a refused Host) goes
to the app as before."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from fenced.server._app import ServerSettings, create_app
from fenced.server._auth import load_api_keys
from fenced.server._http import http_protocol
from fenced.server._run import listen_socket
from tests.server.test_server_fast_lane import GOOD, SCRIPT, SECRET, counters, keys_file, normal

Answer = tuple[bytes, list[tuple[bytes, bytes]], bytes]  # status line, headers, body


class Served:
    """``create_app(settings)`` behind uvicorn with fenced's protocol, on a loopback port."""

    def __init__(
        self, settings: ServerSettings, direct: bool, access_log: bool = False, **config: Any
    ) -> None:
        app: Any = create_app(settings)
        self.app = app
        protocol = http_protocol(settings.read_timeout, app.direct if direct else None)
        uvicorn_config = uvicorn.Config(
            self.app,
            log_config=None,
            lifespan="on",
            http=protocol,
            access_log=access_log,
            **{"proxy_headers": False, **config},  # (as `fenced serve` runs it by default)
        )
        self.server = uvicorn.Server(uvicorn_config)
        self.sock = listen_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]

    @property
    def direct_taken(self) -> int:
        return int(self.app.direct.taken)

    @property
    def lane_taken(self) -> int:
        return int(self.app.front.taken)

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


@contextlib.asynccontextmanager
async def serving(
    settings: ServerSettings, direct: bool = True, access_log: bool = False, **config: Any
) -> AsyncIterator[Served]:
    served = Served(settings, direct, access_log, **config)
    task = asyncio.create_task(served.server.serve(sockets=[served.sock]))
    try:
        async with asyncio.timeout(30):
            while not served.server.started:
                await asyncio.sleep(0.01)
        yield served
    finally:
        served.server.should_exit = True
        await task


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    """One answer; its status line with any interim answer (100 Continue) before it."""
    interim = b""
    head = await reader.readuntil(b"\r\n\r\n")
    while head.startswith(b"HTTP/1.1 1"):
        interim, head = interim + head, await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    headers = [tuple(line.split(b": ", 1)) for line in lines[1:]]
    length = next(int(v) for k, v in headers if k == b"content-length")
    return interim + lines[0], headers, await reader.readexactly(length)  # type: ignore[return-value]


def request(
    path: str, body: bytes | None = None, *, method: str = "POST", version: str = "1.1", **h: str
) -> bytes:
    headers = {"host": "127.0.0.1", **{k.replace("_", "-"): v for k, v in h.items()}}
    if body is not None:
        headers["content-length"] = str(len(body))
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"{method} {path} HTTP/{version}\r\n{head}\r\n".encode() + (body or b"")


def comparable(answer: Answer) -> tuple[bytes, list[tuple[bytes, bytes]], Any]:
    """Without what differs by the moment: the date, times left (and so the length: read
    whole by it), generated ids."""
    status, headers, body = answer
    return status, [(k, v) for k, v in headers if k not in _MOMENT], normal(body)


_MOMENT = (b"date", b"content-length")


def script_request(method: str, path: str, body: Any, key: str | None) -> bytes:
    content = body if isinstance(body, bytes) else (json.dumps(body).encode() if body else b"")
    auth = {"authorization": f"Bearer {key}"} if key else {}
    return request(path, content, method=method, **auth)


async def run_script(tmp_path: Path, direct: bool) -> tuple[list[Any], set[int], int]:
    """SCRIPT over one kept-alive connection; the answers, the requests the direct lane
    took, and how many the ASGI fast lane took."""
    settings = ServerSettings(
        url=f"sqlite:///{tmp_path / ('direct' if direct else 'asgi')}.db",
        api_keys=load_api_keys(keys_file(tmp_path)),
    )
    answers: list[Any] = []
    taken = set()
    async with serving(settings, direct) as served:
        reader, writer = await served.connect()
        for i, (method, path, body, key) in enumerate(SCRIPT):
            before = served.direct_taken
            writer.write(script_request(method, path, body, key))
            answers.append(comparable(await read_answer(reader)))
            if served.direct_taken > before:
                taken.add(i)
        writer.write(request("/metrics", method="GET", authorization=f"Bearer {SECRET}"))
        status, _, text = await read_answer(reader)
        answers.append((status, counters(text.decode())))
        writer.close()
        return answers, taken, served.lane_taken


async def test_the_direct_lane_answers_byte_for_byte_what_the_app_answers(
    tmp_path: Path,
) -> None:
    """Every kind of good and bad request of the lane's routes, over a socket: the same
    status line, headers and body (but the date and what differs by chance) and the same
    counters with the direct lane as without it; the good ones are taken by it (and no
    longer by the ASGI fast lane), the rest are not."""
    with_direct, taken, lane_taken = await run_script(tmp_path, direct=True)
    without, not_taken, asgi_taken = await run_script(tmp_path, direct=False)
    assert with_direct == without
    assert taken == GOOD and not not_taken
    assert lane_taken == asgi_taken == len(GOOD)  # (the fast lane counts the direct ones too)


async def test_a_pipelined_mix_of_direct_and_app_requests_is_answered_in_order(
    tmp_path: Path,
) -> None:
    """Six requests in one write — direct, app, a bad body (the app's), direct, app, direct —
    come back in the order they were sent, each the answer to its own request."""
    async with serving(ServerSettings(url=f"sqlite:///{tmp_path}/p.db")) as served:
        reader, writer = await served.connect()
        writer.write(
            request("/v1/locks/p/-/acquire", b'{"ttl": 30, "request_id": "r-1"}')
            + request("/v1/locks/p", method="GET")
            + request("/v1/locks/p/-/acquire", b'{"ttl": "30"}')
            + request("/v1/locks/p/-/release", b'{"token": "p:1", "request_id": "r-1"}')
            + request("/v1/health", method="GET")
            + request("/v1/locks/p/-/acquire", b'{"ttl": 30, "request_id": "r-2"}')
        )
        got = [await read_answer(reader) for _ in range(6)]
        writer.close()
    statuses = [status for status, _, _ in got]
    bodies = [json.loads(body) for _, _, body in got]
    assert (
        statuses
        == [b"HTTP/1.1 200 OK"] * 2 + [b"HTTP/1.1 400 Bad Request"] + [b"HTTP/1.1 200 OK"] * 3
    )
    assert bodies[0]["token"] == "p:1" and bodies[0]["request_id"] == "r-1"
    assert bodies[1]["token"] == "p:1" and bodies[1]["held"] is True
    assert bodies[2]["error"] == "invalid_request"
    assert bodies[3] == {"released": True}
    assert bodies[4] == {"status": "ok"}
    assert bodies[5]["token"] == "p:2" and bodies[5]["request_id"] == "r-2"
    assert served.direct_taken == 3


async def test_a_body_arriving_in_pieces_goes_to_the_app_and_is_answered(
    tmp_path: Path,
) -> None:
    """The lane answers only a request whose body has arrived whole; one whose body comes in
    pieces is the app's (which bounds its time and size), answered once whole — never judged
    by its first piece: a JSON object followed by junk is a bad body (400), not a grant."""
    async with serving(ServerSettings(url=f"sqlite:///{tmp_path}/b.db")) as served:
        reader, writer = await served.connect()
        first = b'{"ttl": 30, "request_id": "r-1"}'
        for rest, status in ((b"xx", b"400 Bad Request"), (b"  ", b"200 OK")):
            whole = request("/v1/locks/b/-/acquire", first + rest)
            writer.write(whole[: -len(rest)])
            async with asyncio.timeout(10):  # (until the server has read the head)
                while not _body_pending(served):
                    await asyncio.sleep(0.005)
            writer.write(rest)
            got, _, body = await read_answer(reader)
            assert got == b"HTTP/1.1 " + status, body
        assert json.loads(body)["token"] == "b:1"
        assert (served.direct_taken, served.lane_taken) == (0, 1)
        writer.write(request("/v1/locks/b/-/release", b'{"token": "b:1", "request_id": "r-1"}'))
        got, _, body = await read_answer(reader)
        assert json.loads(body) == {"released": True}
        assert (served.direct_taken, served.lane_taken) == (1, 2)
        writer.close()


def _app_only(raw: bytes) -> bool:
    """A request the direct lane leaves to the app (see the parameters below)."""
    words = (b"expect", b"x-forwarded", b"evil.example", b"      ")
    return any(word in raw for word in words)


def _body_pending(served: Served) -> bool:
    """A connection's current request has its head read and not all its body."""
    cycles = [getattr(c, "cycle", None) for c in served.server.server_state.connections]
    return any(cycle is not None and cycle.more_body for cycle in cycles)


@pytest.mark.parametrize(
    "raw",
    [
        request("/v1/locks/k/-/acquire", b'{"ttl": 30}', version="1.0"),
        request("/v1/locks/k/-/acquire", b'{"ttl": 30}', connection="close"),
        request("/v1/locks/k/-/acquire", b'{"ttl": 30}', expect="100-continue"),
        request("/v1/locks/k/-/acquire", b'{"ttl": 30}', x_forwarded_for="10.1.2.3"),
        request("/v1/locks/k/-/acquire", b'{"ttl": 30}' + b" " * 100),  # over the limit
        request("/v1/locks/k/-/acquire", b'{"ttl": 30}', host="evil.example"),
        request("/v1/locks/k/-/acquire", b'{"ttl": 30}', origin="http://evil.example"),
        request("/v1/locks/k/-/acquire", b'{"ttl": 30}', origin="http://127.0.0.1"),
        request("/v1/locks/k/-/acquire?x=1", b'{"ttl": 30}'),
        request("/v1/locks/k%2F/-/acquire", b'{"ttl": 30}'),
    ],
    ids=[
        "http1.0",
        "close",
        "expect",
        "forwarded",
        "too-large",
        "dns-host",
        "foreign-origin",
        "own-origin",
        "query",
        "quoted",
    ],
)
async def test_the_edges_of_http_are_answered_as_the_app_answers_them(
    tmp_path: Path, raw: bytes
) -> None:
    """HTTP/1.0 and ``Connection: close`` (the answer says close, and the connection ends),
    an ``Expect``, a forwarded client (whose address the app's proxy-headers middleware puts
    in the owner), a body over the limit, the Host and Origin rules of a keyless loopback
    server (refused and counted; its own origin served): the same bytes and the same
    counters with the direct lane as without it."""
    got, owners = {}, {}
    for direct in (True, False):
        settings = ServerSettings(
            url=f"sqlite:///{tmp_path}/{direct}.db",
            max_request_bytes=64,
            loopback_hosts_only=True,
        )
        async with serving(settings, direct) as served:
            reader, writer = await served.connect()
            writer.write(raw)
            answer = await read_answer(reader)
            closing = (b"connection", b"close") in answer[1]
            closed = await reader.read() == b"" if closing else None  # (the server ended it)
            writer.close()
            gw = served.app.state.gateway
            metrics = gw.metrics.render()
            text = metrics.decode() if isinstance(metrics, bytes) else metrics
            got[direct] = (comparable(answer), closed, counters(text))
            owners[direct] = [e.owner for e in gw.events]
            if direct:
                taken = served.direct_taken
    assert got[True] == got[False] and owners[True] == owners[False]
    assert taken == (raw.startswith(b"POST /v1/locks/k") and not _app_only(raw))
    if b"x-forwarded-for" in raw:  # (not believed: no --forwarded-allow-ips)
        assert owners[True] == ["http client 127.0.0.1"]


async def test_a_forwarded_client_is_believed_only_from_a_named_proxy(tmp_path: Path) -> None:
    """With ``--forwarded-allow-ips`` (uvicorn's proxy-headers middleware on) the client an
    ``X-Forwarded-For`` names is the owner, with the direct lane as without it."""
    raw = request("/v1/locks/k/-/acquire", b'{"ttl": 30}', x_forwarded_for="10.1.2.3")
    owners = {}
    for direct in (True, False):
        settings = ServerSettings(url=f"sqlite:///{tmp_path}/{direct}.db")
        config = {"proxy_headers": True, "forwarded_allow_ips": "127.0.0.1"}
        async with serving(settings, direct, **config) as served:
            reader, writer = await served.connect()
            writer.write(raw)
            assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
            writer.close()
            owners[direct] = [e.owner for e in served.app.state.gateway.events]
    assert owners[True] == owners[False] == ["http client 10.1.2.3"]


async def test_the_access_log_says_what_it_says_for_the_app(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``--access-log`` a request the direct lane answers is logged as uvicorn logs the
    app's answers: the same line (but the client's port), at the same level."""
    lines = {}
    for direct in (True, False):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="uvicorn.access"):
            settings = ServerSettings(url=f"sqlite:///{tmp_path}/{direct}.db")
            async with serving(settings, direct, access_log=True) as served:
                reader, writer = await served.connect()
                writer.write(request("/v1/locks/a/-/acquire", b'{"ttl": 30}'))
                writer.write(request("/v1/locks/a/-/acquire", b'{"ttl": 30}', version="1.0"))
                assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
                assert (await read_answer(reader))[0] == b"HTTP/1.1 409 Conflict"
                writer.close()
                taken = served.direct_taken
        lines[direct] = [
            (r.levelname, re.sub(r":\d+ - ", ":<port> - ", r.getMessage()))
            for r in caplog.records
            if r.name == "uvicorn.access"
        ]
        assert taken == (2 if direct else 0)
    assert lines[True] == lines[False] and len(lines[True]) == 2
    assert lines[True][1] == (
        "INFO",
        '127.0.0.1:<port> - "POST /v1/locks/a/-/acquire HTTP/1.0" 409',
    )


async def test_a_waiting_acquire_taken_directly_leaves_the_queue_when_its_client_goes(
    tmp_path: Path,
) -> None:
    """A long poll answered by the direct lane watches its connection as the app's did: the
    client hangs up while waiting, the acquire leaves the queue, and the lock released by
    its holder is free — not granted to a client that is gone. The holder's own requests and
    a waiter that stays are served as ever."""
    async with serving(ServerSettings(url=f"sqlite:///{tmp_path}/w.db")) as served:
        gw = served.app.state.gateway
        reader, writer = await served.connect()
        writer.write(request("/v1/locks/w/-/acquire", b'{"ttl": 30, "request_id": "r-1"}'))
        assert json.loads((await read_answer(reader))[2])["token"] == "w:1"
        _, gone = await served.connect()
        gone.write(request("/v1/locks/w/-/acquire", b'{"timeout": 30, "request_id": "r-2"}'))
        async with asyncio.timeout(10):
            while gw._waiting != 1:  # (queued)
                await asyncio.sleep(0.005)
        gone.close()
        async with asyncio.timeout(10):
            while gw._waiting != 0:  # (left the queue: its client went)
                await asyncio.sleep(0.005)
        writer.write(request("/v1/locks/w/-/release", b'{"token": "w:1", "request_id": "r-1"}'))
        assert json.loads((await read_answer(reader))[2]) == {"released": True}
        writer.write(request("/v1/locks/w", method="GET"))
        assert json.loads((await read_answer(reader))[2])["held"] is False
        # A waiter that stays gets the lock when it is released.
        writer.write(request("/v1/locks/w/-/acquire", b'{"ttl": 30, "request_id": "r-3"}'))
        assert json.loads((await read_answer(reader))[2])["token"] == "w:2"
        stay_reader, stay = await served.connect()
        stay.write(request("/v1/locks/w/-/acquire", b'{"timeout": 30, "request_id": "r-4"}'))
        async with asyncio.timeout(10):
            while gw._waiting != 1:
                await asyncio.sleep(0.005)
        writer.write(request("/v1/locks/w/-/release", b'{"token": "w:2", "request_id": "r-3"}'))
        assert json.loads((await read_answer(reader))[2]) == {"released": True}
        assert json.loads((await read_answer(stay_reader))[2])["token"] == "w:3"
        assert served.direct_taken == 6  # (four acquires, two releases; not the status)
        writer.close()
        stay.close()


def _protocols(served: Served) -> list[Any]:
    return list(served.server.server_state.connections)


async def _until(check: Any, what: str, bound: float = 10.0) -> None:
    """Wait (bounded) until ``check()`` is true."""
    async with asyncio.timeout(bound):
        while not check():
            await asyncio.sleep(0.005)


@pytest.mark.parametrize("whole_in_time", [True, False], ids=["whole-in-queue", "in-pieces"])
async def test_a_queued_direct_request_is_answered_directly_only_if_whole_at_its_turn(
    tmp_path: Path, whole_in_time: bool
) -> None:
    """A request pipelined behind a waiting acquire, its body sent in two pieces (a whole
    JSON object, then more): whole before its turn, the direct lane answers it; still in
    pieces at its turn, the app does (which bounds its time) — never judged by its first
    piece: an object followed by junk is a bad body (400), not a grant. Either way the
    answers come in order, each its own request's."""
    async with serving(ServerSettings(url=f"sqlite:///{tmp_path}/q.db")) as served:
        gw = served.app.state.gateway
        holder_reader, holder = await served.connect()
        holder.write(request("/v1/locks/q/-/acquire", b'{"ttl": 30, "request_id": "h"}'))
        assert json.loads((await read_answer(holder_reader))[2])["token"] == "q:1"
        reader, writer = await served.connect()
        rest = b"  " if whole_in_time else b"xx"
        second = request("/v1/locks/x/-/acquire", b'{"ttl": 30, "request_id": "r-x"}' + rest)
        writer.write(
            request("/v1/locks/q/-/acquire", b'{"timeout": 30, "request_id": "w"}')
            + second[: -len(rest)]
        )
        await _until(lambda: gw._waiting == 1, "queued")
        await _until(lambda: any(p.pipeline for p in _protocols(served)), "piped")
        if whole_in_time:
            writer.write(rest)
            await _until(lambda: _queued_whole(served), "whole")
        before = (served.direct_taken, served.lane_taken)
        holder.write(request("/v1/locks/q/-/release", b'{"token": "q:1", "request_id": "h"}'))
        assert json.loads((await read_answer(holder_reader))[2]) == {"released": True}
        first = json.loads((await read_answer(reader))[2])
        assert first["token"] == "q:2" and first["request_id"] == "w"
        if not whole_in_time:
            await _until(lambda: _body_pending(served), "the app reads the body")
            writer.write(rest)
        status, _, body = await read_answer(reader)
        if whole_in_time:
            assert status == b"HTTP/1.1 200 OK" and json.loads(body)["token"] == "x:1"
        else:
            assert status == b"HTTP/1.1 400 Bad Request", body
        # (the waiting acquire was counted when it began; the release, and the second if
        # the lane answered it, now)
        direct, lane = served.direct_taken - before[0], served.lane_taken - before[1]
        assert (direct, lane) == ((2, 2) if whole_in_time else (1, 1))
        writer.close()
        holder.close()


def _queued_whole(served: Served) -> bool:
    """A connection has one request queued, its body whole."""
    return any(len(p.pipeline) == 1 and not p.pipeline[0][0].more_body for p in _protocols(served))


RENEW_M = b'{"token": "m:1", "request_id": "r-1"}'


async def test_a_pipelined_mix_with_requests_the_lane_declines_is_answered_in_order(
    tmp_path: Path,
) -> None:
    """Direct requests, requests the lane declines once it has read their body (a bad body,
    a missing and a wrong key: answered by the app) and app routes, eight in one write:
    answered in the order sent, the lane's refusals counted once, by the app."""
    settings = ServerSettings(
        url=f"sqlite:///{tmp_path}/m.db", api_keys=load_api_keys(keys_file(tmp_path))
    )
    auth = {"authorization": f"Bearer {SECRET}"}
    async with serving(settings) as served:
        reader, writer = await served.connect()
        writer.write(
            request("/v1/locks/m/-/acquire", b'{"ttl": 30, "request_id": "r-1"}', **auth)
            + request("/v1/locks/m/-/acquire", b'{"ttl": 30', **auth)
            + request("/v1/locks/m/-/renew", b'{"token": "m:1", "request_id": "r-1"}')
            + request(
                "/v1/locks/m/-/renew",
                b'{"token": "m:1", "request_id": "r-1"}',
                authorization="Bearer nope",
            )
            + request("/v1/locks/m", method="GET", **auth)
            + request("/v1/locks/m/-/renew", b'{"token": "m:1", "request_id": "r-1"}', **auth)
            + request("/v1/health", method="GET")
            + request("/v1/locks/m/-/release", b'{"token": "m:1", "request_id": "r-1"}', **auth)
        )
        got = [await read_answer(reader) for _ in range(8)]
        writer.write(request("/metrics", method="GET", **auth))
        metrics = (await read_answer(reader))[2].decode()
        writer.close()
    statuses = [status.split(b" ")[1] for status, _, _ in got]
    assert statuses == [b"200", b"400", b"401", b"401", b"200", b"200", b"200", b"200"]
    bodies = [json.loads(body) for _, _, body in got]
    assert bodies[0]["token"] == "m:1" and bodies[4]["held"] is True
    assert set(bodies[5]) == {"ttl", "expires_in"} and bodies[7] == {"released": True}
    assert counters(metrics)['fenced_refused_requests_total{reason="unauthenticated"}'] == "2.0"
    assert served.direct_taken == 3


async def test_a_client_leaving_mid_pipeline_takes_its_waiting_acquire_out_of_the_queue(
    tmp_path: Path,
) -> None:
    """A waiting acquire with more requests pipelined behind it, then the client hangs up:
    the acquire leaves the queue (the lock, released, is free: granted to nobody gone), the
    requests behind it are never served, and the connection's task ends with it."""
    async with serving(ServerSettings(url=f"sqlite:///{tmp_path}/d.db")) as served:
        gw = served.app.state.gateway
        holder_reader, holder = await served.connect()
        holder.write(request("/v1/locks/d/-/acquire", b'{"ttl": 30, "request_id": "h"}'))
        assert json.loads((await read_answer(holder_reader))[2])["token"] == "d:1"
        _, gone = await served.connect()
        gone.write(
            request("/v1/locks/d/-/acquire", b'{"timeout": 30, "request_id": "w"}')
            + request("/v1/locks/e/-/acquire", b'{"ttl": 30, "request_id": "e"}')
            + request("/v1/locks/f/-/acquire", b'{"ttl": 30, "request_id": "f"}')
        )
        await _until(lambda: gw._waiting == 1, "queued")
        await _until(lambda: sum(len(p.pipeline) for p in _protocols(served)) == 2, "piped")
        (protocol,) = [p for p in _protocols(served) if p.pipeline]
        task = protocol._worker
        assert task is not None and task in _serving_tasks()
        gone.close()
        await _until(lambda: gw._waiting == 0, "left the queue: its client went")
        await _until(lambda: protocol not in _protocols(served), "the connection ended")
        await _until(task.done, "the connection's task ended")
        holder.write(request("/v1/locks/d/-/release", b'{"token": "d:1", "request_id": "h"}'))
        assert json.loads((await read_answer(holder_reader))[2]) == {"released": True}
        for name in ("d", "e", "f"):  # (d free: not granted to "w"; e and f never served)
            holder.write(request(f"/v1/locks/{name}", method="GET"))
            assert json.loads((await read_answer(holder_reader))[2])["held"] is False
        holder.close()


def _serving_tasks() -> list[asyncio.Task[Any]]:
    """The protocol's per-connection tasks still running."""
    return [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "").endswith("BoundedHeadProtocol._serve")
    ]


async def test_a_client_that_does_not_read_holds_the_server_back_not_its_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flow control: a client pipelining acquires and reading none of the answers. Once the
    socket's buffers are full the server stops writing (and so answering, and reading) —
    its buffer for the connection stays near the transport's high-water mark instead of
    holding every answer; when the client reads, every answer comes, in order."""
    from fenced.server import _http

    most = [0]  # (the most the server held for the connection after a write)
    for method in ("write_now", "flush"):
        writes = getattr(_http._Coalescing, method)

        def measured(self: Any, *data: bytes, writes: Any = writes) -> None:
            writes(self, *data)
            most[0] = max(most[0], self._transport.get_write_buffer_size())

        monkeypatch.setattr(_http._Coalescing, method, measured)
    n, name = 600, "n" * 150
    async with serving(ServerSettings(url=f"sqlite:///{tmp_path}/s.db")) as served:
        served.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        served.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", served.port))
        reader, writer = await asyncio.open_connection(sock=client)

        async def send() -> None:
            for i in range(n):
                writer.write(request(f"/v1/locks/{name}{i}/-/acquire", b'{"ttl": 30}'))
                await writer.drain()

        sending = asyncio.create_task(send())
        try:
            # Until the server waits for the client to read — or, without flow control,
            # holds more than the transport's high-water mark and a few answers.
            await _until(
                lambda: most[0] > 80 * 1024 or any(map(_waiting_to_write, _protocols(served))),
                "held back",
            )
            assert served.direct_taken < n
            assert 64 * 1024 <= most[0] <= 80 * 1024, most[0]
            for i in range(n):
                _, _, body = await read_answer(reader)
                assert json.loads(body)["lock"] == f"{name}{i}"
            await sending
        finally:
            sending.cancel()
            writer.transport.abort()  # (what the server holds for it goes with it)


def _waiting_to_write(protocol: Any) -> bool:
    """The connection's task waits for the client to read what it has written (flow
    control's drain, in the write of an answer)."""
    task = protocol._worker
    coro = task.get_coro() if task is not None else None
    while coro is not None:
        if getattr(coro, "__qualname__", "").endswith("._write"):
            return True
        coro = getattr(coro, "cr_await", None)
    return False


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "app"])
async def test_keep_alive_closes_a_connection_idle_that_long_and_only_then(
    tmp_path: Path, direct: bool
) -> None:
    """One keep-alive timer a connection, looked at when it fires: requests spaced closer
    than the keep-alive (1 s here) keep the connection however long it lasts, and so does
    a long poll; idle for the keep-alive after its last answer, it is closed — as uvicorn's
    timer, re-armed at every answer, did. (Keep-alive 1 s against a spacing of 0.25 s: a
    loop 0.2 s late — a loaded machine — let the timer fire on a request not yet read, and
    closed the connection, when they were 0.5 s and 0.3 s.)"""
    settings = ServerSettings(url=f"sqlite:///{tmp_path}/k.db")
    async with serving(settings, direct, timeout_keep_alive=1.0) as served:
        loop = asyncio.get_running_loop()
        reader, writer = await served.connect()
        for i in range(10):  # (2.25 s in all, more than twice the keep-alive)
            if i:
                await asyncio.sleep(0.25)  # (the spacing is what is tested)
            writer.write(request(f"/v1/locks/k{i}/-/acquire", b'{"ttl": 30}'))
            assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
        # A long poll outlasting the keep-alive (k0 is held): the timer finds the connection
        # busy; the answer arms it again.
        writer.write(request("/v1/locks/k0/-/acquire", b'{"timeout": 1.5}'))
        assert (await read_answer(reader))[0] == b"HTTP/1.1 409 Conflict"
        last = loop.time()
        async with asyncio.timeout(10):
            assert await reader.read() == b""  # (closed by the server)
        # (from the server's write of the answer, which came a little before `last`: 0.9997 s
        # was seen; a timer armed at the request, or closing early, is 0.5 s or less here)
        assert 0.9 <= loop.time() - last < 4.0
        writer.close()


async def test_a_verb_that_fails_is_answered_500_and_closed_as_the_app_answers_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A verb raising (a bug) mid-request: the direct lane answers what uvicorn answers for
    an app that raised — the same 500 bytes, the connection closed, the error logged — and
    the server goes on serving other connections."""
    got = {}
    for direct in (True, False):
        settings = ServerSettings(url=f"sqlite:///{tmp_path}/{direct}.db")
        async with serving(settings, direct) as served:
            lanes = served.app.front.lanes

            async def boom(*args: Any) -> Any:
                raise RuntimeError("planted")

            lanes["acquire"] = dataclasses.replace(lanes["acquire"], handle=boom)
            caplog.clear()
            reader, writer = await served.connect()
            writer.write(request("/v1/locks/b/-/acquire", b'{"ttl": 30}'))
            answer = await read_answer(reader)
            assert await reader.read() == b""  # (closed)
            writer.close()
            got[direct] = comparable(answer)
            assert any("Exception in ASGI application" in r.getMessage() for r in caplog.records)
            reader, writer = await served.connect()
            writer.write(request("/v1/health", method="GET"))
            assert (await read_answer(reader))[0] == b"HTTP/1.1 200 OK"
            writer.close()
    assert got[True] == got[False]
    assert got[True][0] == b"HTTP/1.1 500 Internal Server Error"


@pytest.mark.parametrize(
    "number", [30.0, 29.99987, 1e-05, 5.5e-05, 2.5e-07, 0.0, 86400.0, 1e16, 1e22, 123456789.123]
)
def test_the_lanes_answers_are_the_bytes_pydantic_writes(number: float) -> None:
    """The verbs write their answers without models: the same bytes as GrantOut's,
    RenewOut's and ReleaseOut's ``model_dump_json`` (a float below 1e-4 without an
    exponent, as pydantic writes it; a string that needs escaping escaped as it does)."""
    from fenced.server._wire import (
        RELEASED,
        GrantOut,
        ReleaseOut,
        RenewOut,
        grant_json,
        renew_json,
    )

    for text in ("jobs/nightly", 'a"b\\c', "caf\u00e9\n"):
        model = GrantOut(
            lock=text, token=f"{text}:7", value=7, signed=None if number > 1 else text,
            request_id="r-1", lease_id="r-1", ttl=number, expires_in=number,
        )  # fmt: skip
        made = grant_json(text, f"{text}:7", 7, model.signed, "r-1", number, number)
        assert made == model.model_dump_json().encode()
    assert (
        renew_json(number, number)
        == RenewOut(ttl=number, expires_in=number).model_dump_json().encode()
    )
    assert (
        tuple(ReleaseOut(released=b).model_dump_json().encode() for b in (True, False)) == RELEASED
    )
