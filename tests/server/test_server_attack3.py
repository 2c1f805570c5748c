"""Attacks on ``fenced serve`` from outside (session 4, attack 3): each test is a finding
reproduced against real ``fenced serve`` processes (and real sources behind them), with the
rightful request served beside it."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fenced.server import hash_secret
from fenced.server._app import ServerSettings
from fenced.testing.servers import FencedServer
from tests.helpers import TLS
from tests.server.test_direct_lane import read_answer, request, serving


@pytest.fixture(params=["sqlite", "redis", "postgresql"])
def any_source(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'locks.db'}"
    if request.param == "redis":
        return str(request.getfixturevalue("redis_server").url)
    return str(request.getfixturevalue("pg_dsn"))


@pytest.fixture
def two_gateways(any_source: str) -> Iterator[tuple[FencedServer, FencedServer]]:
    """Two gateways on one source, with different ``--default-ttl``."""
    with (
        FencedServer(any_source, args=["--default-ttl", "2"]) as a,
        FencedServer(any_source, args=["--default-ttl", "30"]) as b,
    ):
        yield a, b  # type: ignore[misc]


def test_a_renewal_without_ttl_keeps_the_ttl_set_through_another_gateway(
    two_gateways: tuple[FencedServer, FencedServer],
) -> None:
    """docs/server.md: a renewal without ttl extends the lease by "the grant's own ttl (as the
    source keeps it, whichever gateway made it)". A grant made through A (ttl 2), renewed
    through B with ttl 60 (the source now keeps 60), then renewed through A without a ttl was
    renewed for A's 2 s — A's own table, stale — and a holder renewing every third of its 60 s
    lost the lease. Now A's renewal keeps 60, and one with a ttl still sets its own."""
    a, b = two_gateways
    name = f"t-{uuid.uuid4().hex[:8]}"
    with httpx.Client(timeout=30) as http:
        grant = http.post(f"{a.url}/v1/locks/{name}/-/acquire", json={"request_id": "r1"}).json()
        assert grant["ttl"] == 2.0  # (A's default)
        lease = {"token": grant["token"], "request_id": "r1"}
        changed = http.post(f"{b.url}/v1/locks/{name}/-/renew", json={**lease, "ttl": 60})
        assert changed.json()["ttl"] == 60.0
        kept = http.post(f"{a.url}/v1/locks/{name}/-/renew", json=lease)
        assert kept.status_code == 200 and kept.json()["ttl"] == 60.0, kept.json()
        assert kept.json()["expires_in"] > 50
        status = http.get(f"{b.url}/v1/locks/{name}").json()
        assert status["remaining"] > 50
        # The other side: a ttl given is the one set, on either gateway, and kept after.
        set_here = http.post(f"{a.url}/v1/locks/{name}/-/renew", json={**lease, "ttl": 5})
        assert set_here.json()["ttl"] == 5.0
        again = http.post(f"{a.url}/v1/locks/{name}/-/renew", json=lease)
        assert again.json()["ttl"] == 5.0
        there = http.post(f"{b.url}/v1/locks/{name}/-/renew", json=lease)
        assert there.json()["ttl"] == 5.0


def test_a_ttl_set_by_a_renewal_outlives_a_gateway_killed_with_sigkill(any_source: str) -> None:
    """A grant made with ttl 2 and renewed with ttl 60; the gateway is killed (SIGKILL) and
    started again, and a renewal without a ttl resumes the grant from the source: it renews
    for the 60 s the holder last asked for (the source kept only the acquire's 2 s on SQLite
    and Redis, and the holder renewing every 20 s lost it), and the lease is still held."""
    name = f"k-{uuid.uuid4().hex[:8]}"
    with FencedServer(any_source, args=["--default-ttl", "2"]) as a, httpx.Client() as http:
        grant = http.post(f"{a.url}/v1/locks/{name}/-/acquire", json={"request_id": "r1"}).json()
        lease = {"token": grant["token"], "request_id": "r1"}
        assert (
            http.post(f"{a.url}/v1/locks/{name}/-/renew", json={**lease, "ttl": 60}).json()["ttl"]
            == 60.0
        )
        a.restart(kill=True)
        resumed = http.post(f"{a.url}/v1/locks/{name}/-/renew", json=lease)
        assert resumed.status_code == 200 and resumed.json()["ttl"] == 60.0, resumed.json()
        status = http.get(f"{a.url}/v1/locks/{name}").json()
        assert status["token"] == grant["token"] and status["remaining"] > 50


def test_a_renewal_on_the_memory_source_lasts_the_ttl_it_answers(tmp_path: Path) -> None:
    """The memory source renewed a grant for its acquire's ttl whatever the renewal asked,
    while the answer said the ttl asked for: ``expires_in`` 60 for a lease that ended after
    2 s (a client's confirmed time, counted from it, outlived the lease). Now the lease lasts
    what the answer says, longer or shorter."""
    with FencedServer("memory://attack3", args=["--default-ttl", "2"]) as a, httpx.Client() as http:
        grant = http.post(f"{a.url}/v1/locks/m/-/acquire", json={"request_id": "r1"}).json()
        lease = {"token": grant["token"], "request_id": "r1"}
        for ttl in (60, 5):
            renewed = http.post(f"{a.url}/v1/locks/m/-/renew", json={**lease, "ttl": ttl}).json()
            assert renewed["ttl"] == ttl
            remaining = http.get(f"{a.url}/v1/locks/m").json()["remaining"]
            assert ttl - 2 < remaining <= ttl, (ttl, remaining)


async def test_a_quiet_watch_stream_sends_keepalives_and_changes(tmp_path: Path) -> None:
    """A ``/-/watch`` stream of a lock that does not change sent nothing after its first event
    (its keepalive came only after a change): idle proxies cut it, and a client gone without a
    word (a NAT's idle drop, a host powered off) was never found — its watch's place held for
    good, and 64 of them refused the key's every later watch (429). Now a comment comes every
    ``watch_keepalive`` s, and a change still comes at once, as an event."""
    settings = ServerSettings(url=f"sqlite:///{tmp_path}/w.db", watch_keepalive=0.3)
    async with serving(settings) as served:
        reader, writer = await served.connect()
        other_reader, other = await served.connect()
        try:
            writer.write(request("/v1/locks/q/-/watch", method="GET"))
            async with asyncio.timeout(10):
                await reader.readuntil(b"event: status\n")
                await reader.readuntil(b"\n\n")  # (the status now)
                await reader.readuntil(b": keepalive\n\n")
                await reader.readuntil(b": keepalive\n\n")
            other.write(request("/v1/locks/q/-/acquire", b'{"ttl": 30, "request_id": "r-1"}'))
            assert (await read_answer(other_reader))[0] == b"HTTP/1.1 200 OK"
            async with asyncio.timeout(10):
                await reader.readuntil(b"event: status\n")
                assert b'"held":true' in await reader.readuntil(b"\n\n")
        finally:  # (an open stream would hold the server's shutdown)
            writer.close()
            other.close()
        gw = served.app.state.gateway
        async with asyncio.timeout(10):  # (its place given back)
            while gw.metrics.watches._value.get() != 0:
                await asyncio.sleep(0.01)


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_quote_in_the_query_string_cannot_forge_an_access_log_field(
    tmp_path: Path, log_format: str
) -> None:
    """uvicorn's access line quotes the request with the query string as sent, and HTTP's
    parser passes a ``"`` in it: ``GET /v1/health?x=" 403 ...`` closed the quoted request early
    and the rest read as the line's next fields. Now a quote and a backslash in the target are
    percent-encoded; a request of the direct lane is logged the same way, and plain requests
    as ever."""
    source = f"sqlite:///{tmp_path / 'locks.db'}"
    args = ["--access-log", "--log-format", log_format]
    with FencedServer(source, args=args) as server:
        forged = b'/v1/health?x="403_forged\\'
        direct = b'/v1/locks/q/-/acquire?y="x'
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" % forged)
            s.sendall(
                b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}" % direct
            )
            s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        assert got.count(b"HTTP/1.1 200 OK") == 3, got
        deadline = time.monotonic() + 10
        while len(lines := _access_lines(server)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # (the log is a file another process writes: polled, bounded)
        tail = server.log_tail()
    assert len(lines) == 3, tail
    assert lines[0].endswith('"GET /v1/health?x=%22403_forged%5C HTTP/1.1" 200'), lines
    assert lines[1].endswith('"POST /v1/locks/q/-/acquire?y=%22x HTTP/1.1" 200'), lines
    assert lines[2].endswith('"GET /v1/health HTTP/1.1" 200'), lines
    assert all(line.count('"') == 2 for line in lines), lines


def _access_lines(server: FencedServer) -> list[str]:
    out = []
    for line in server.log_path.read_text(errors="replace").splitlines():
        if "uvicorn.access" in line:
            out.append(json.loads(line)["message"] if line.startswith("{") else line)
    return out


def test_one_clients_waiting_acquires_are_bounded_as_its_watches_are(tmp_path: Path) -> None:
    """Watches are bounded per client because each costs the server while it is open; a
    waiting acquire (a long poll of up to --max-wait) costs it too — on SQLite each waiter
    beats its row every waiter_ttl/3 — and was not bounded: one client's 500 waiting acquires
    took 0.97 s of the server's CPU a second on the test machine (50: 0.24 s), every other
    client's request slower for it. Now past --max-waiting-per-client, 429 too_many_waiting
    with Retry-After, nothing queued, counted; the ones within it wait and are granted, and
    an acquire of the same client answered at once is served."""
    source = f"sqlite:///{tmp_path / 'locks.db'}"
    with FencedServer(source, args=["--max-waiting-per-client", "4"]) as server:
        url = server.url
        held = httpx.post(
            f"{url}/v1/locks/h/-/acquire", json={"ttl": 60, "request_id": "h"}, verify=TLS
        )
        assert held.status_code == 200
        socks = []
        try:
            for i in range(20):
                body = b'{"ttl": 10, "timeout": 60, "request_id": "w%d"}' % i
                s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
                s.sendall(
                    b"POST /v1/locks/h/-/acquire HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
                socks.append(s)
            # The 16 past the bound are answered at once; the 4 within it wait.
            answers: dict[int, tuple[bytes, bytes]] = {}
            deadline = time.monotonic() + 10
            while len(answers) < 16:
                assert time.monotonic() < deadline, f"{len(answers)} refused"
                for i, s in enumerate(socks):
                    if i not in answers and (got := _answer(s, 0.05)) is not None:
                        answers[i] = got
            waiting = httpx.get(f"{url}/v1/locks/h", verify=TLS).json()["waiters"]
            assert waiting == 4, f"{waiting} waiting acquires of one client"
            assert not any(_answer(s, 0.01) for i, s in enumerate(socks) if i not in answers)
            for head, body in answers.values():
                assert head.startswith(b"HTTP/1.1 429 "), head
                assert b"\r\nretry-after: 1\r\n" in head.lower(), head
                assert json.loads(body)["error"] == "too_many_waiting"
            metrics = httpx.get(f"{url}/metrics", verify=TLS).text
            assert 'fenced_refused_requests_total{reason="too_many_waiting"} 16.0' in metrics
            assert "fenced_acquire_timeouts_total 0.0" in metrics  # (refused, not timed out)
            # The same client's acquire that is answered at once is served at its bound.
            free = httpx.post(f"{url}/v1/locks/free/-/acquire", json={"timeout": 30}, verify=TLS)
            assert free.status_code == 200, free.text
            # The other side: those within the bound were waiting, and one is granted.
            token = held.json()["token"]
            gone = httpx.post(
                f"{url}/v1/locks/h/-/release", json={"token": token, "request_id": "h"}, verify=TLS
            )
            assert gone.json() == {"released": True}
            waiters = [s for i, s in enumerate(socks) if i not in answers]
            deadline = time.monotonic() + 10
            while not (granted := [a for s in waiters if (a := _answer(s, 0.05))]):
                assert time.monotonic() < deadline, "no waiter was granted"
            [(head, body)] = granted  # (one: the lock is held again)
            assert head.startswith(b"HTTP/1.1 200 ") and json.loads(body)["token"] == "h:2", head
        finally:
            for s in socks:
                s.close()


def _answer(s: socket.socket, timeout: float) -> tuple[bytes, bytes] | None:
    """The answer on ``s`` (head with its last CRLF, body); None if none began in time."""
    s.settimeout(timeout)
    try:
        got = s.recv(65536)
    except TimeoutError:
        return None
    s.settimeout(10)  # (begun: the rest follows at once)
    while b"\r\n\r\n" not in got:
        got += s.recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n", body


def test_two_keys_with_one_secret_are_refused_without_quoting_it(tmp_path: Path) -> None:
    """Two keys of the file with the same secret (a copy-paste: ``ops`` may force-release,
    ``ci`` only check): the server started and took the secret for the last of them, so the
    other key's rights silently went with it — or were lost. When in doubt, fail closed: the
    file is refused with one line naming both ids and never the secret; the same file with
    a secret of each is served."""
    secret, other = "the-one-secret-0123456789", "another-secret-0123456789"

    def keys(second: str) -> Path:
        path = tmp_path / "keys.toml"
        path.write_text(
            f'[[keys]]\nid = "ops"\nsha256 = "{hash_secret(secret)}"\nverbs = ["admin"]\n'
            f'[[keys]]\nid = "ci"\nsecret = "{second}"\nverbs = ["check"]\nprefixes = [""]\n'
        )
        path.chmod(0o600)
        return path

    run = [sys.executable, "-m", "fenced", "serve", "--url", f"sqlite:///{tmp_path}/l.db"]
    done = subprocess.run(
        [*run, "--listen", "127.0.0.1:0", "--api-keys", str(keys(secret))],
        capture_output=True,
        text=True,
        timeout=30,  # (served, it would run on: the bug)
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "same secret" in lines[0], done.stderr
    assert "'ops'" in lines[0] and "'ci'" in lines[0]
    assert secret not in done.stderr and hash_secret(secret) not in done.stderr
    with FencedServer(f"sqlite:///{tmp_path}/l.db", args=["--api-keys", str(keys(other))]) as s:
        info = httpx.get(
            f"{s.url}/v1/info", headers={"authorization": f"Bearer {other}"}, verify=TLS
        )
        assert info.status_code == 200
