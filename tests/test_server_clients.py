"""Clients that are not Python, against a real ``fenced serve``: the curl lines of
docs/server.md, and the Node client of examples/ writing through fenced's HTTP guard — up to
DDIA Figure 8-5 with the holder (node, stopped with SIGSTOP) and the writer (curl) as separate
non-Python processes."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fenced.testing.servers import FencedServer, free_port
from tests.helpers import ROOT, wait_for


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} not installed (make test installs it when run as root)")
    return path


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FencedServer]:
    with FencedServer(f"sqlite:///{tmp_path / 'locks.db'}") as s:
        yield s  # type: ignore[misc]


@pytest.fixture(params=["guarded"])
def storage(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """examples/storage_service.py as its own process: files behind fenced's HTTP guard
    (or, planted, without it)."""
    port = free_port()
    plant = ["--no-fencing"] if request.param == "unguarded" else []
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples" / "storage_service.py"),
            "--port",
            str(port),
            "--dir",
            str(tmp_path / "storage"),
            *plant,
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )

    def up() -> bool:
        assert proc.poll() is None, "the storage service exited"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(up, 30, "the storage service")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


def _doc_curl_lines() -> list[str]:
    text = (ROOT / "docs" / "server.md").read_text()
    section = text.split("## Try it with curl", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None
    return [line for line in block[1].splitlines() if line.startswith("curl ")]


def test_the_curl_lines_of_the_docs_work_as_they_say(server: FencedServer) -> None:
    _need("curl")
    lines = _doc_curl_lines()
    assert len(lines) == 5
    out = []
    for line in lines:
        args = shlex.split(line.replace("localhost:7400", f"127.0.0.1:{server.port}"))
        r = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (line, r.stderr)
        out.append(json.loads(r.stdout))
    grant, renewed, status, check, released = out
    assert grant["token"] == "invoices:1" and grant["request_id"] == "job-17"
    assert renewed["ttl"] == 10
    assert status["held"] and status["token"] == "invoices:1"
    assert check["verdict"] == "current"
    assert released == {"released": True}


class Node:
    """examples/fenced_client.mjs as a real process; its lines read one by one."""

    def __init__(self, server: str, lock: str, storage: str, data: str, ttl: float) -> None:
        self.proc = subprocess.Popen(
            [
                _need("node"),
                str(ROOT / "examples" / "fenced_client.mjs"),
                server,
                lock,
                storage,
                data,
                str(ttl),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def line(self) -> str:
        assert self.proc.stdout is not None
        got = self.proc.stdout.readline().strip()
        if not got:
            self.proc.kill()
            assert self.proc.stderr is not None
            raise AssertionError(f"node said nothing; stderr: {self.proc.stderr.read()}")
        return got

    def say(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def test_the_node_client_takes_a_lock_and_writes_through_the_http_guard(
    server: FencedServer, storage: str
) -> None:
    node = Node(server.url, "files", f"{storage}/files/report", "from node", ttl=5)
    try:
        assert node.line() == "token 1"
        node.say("write")
        assert node.line().startswith("write 200 stored report with files:1")
        node.say("release")
        assert node.line() == "released true"
    finally:
        node.close()
    assert httpx.get(f"{storage}/files/report", timeout=10).text == "from node"


def test_figure_8_5_with_a_node_holder_and_a_curl_writer(
    server: FencedServer, storage: str
) -> None:
    """Client 1 (node) gets token 1 and is stopped (a GC pause) past its lease; client 2
    (curl) gets token 2 and writes; client 1 wakes and writes with token 1: refused (409),
    nothing written; client 2's data stays."""
    stale, data = _figure_8_5(server, storage)
    assert stale.startswith("write 409") and "has accepted files:2" in stale, stale
    assert data == "client 2's write"


@pytest.mark.parametrize("storage", ["unguarded"], indirect=True)
def test_figure_8_5_catches_a_storage_service_without_the_guard(
    server: FencedServer, storage: str
) -> None:
    """Planted: the same service without fenced's guard. The paused writer's write lands
    over the current holder's: the test above would fail."""
    stale, data = _figure_8_5(server, storage)
    assert stale.startswith("write 200") and data == "stale write from client 1"


def _figure_8_5(server: FencedServer, storage: str) -> tuple[str, str]:
    """Returns client 1's write line after its pause, and what the storage holds at the end."""
    curl = _need("curl")
    target = f"{storage}/files/ledger"
    one = Node(server.url, "files", target, "stale write from client 1", ttl=1)
    try:
        assert one.line() == "token 1"
        one.say("write paused")  # its check passes; the pause falls before the write
        assert one.line() == "checked"
        os.kill(one.proc.pid, signal.SIGSTOP)  # paused: no renewals, no writes
        r = subprocess.run(  # client 2 waits in line until client 1's lease has expired
            [
                curl,
                "-s",
                "-X",
                "POST",
                f"{server.url}/v1/locks/files/-/acquire",
                "-d",
                '{"ttl": 30, "timeout": 20, "request_id": "client-2"}',
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert json.loads(r.stdout)["token"] == "files:2", r.stdout
        wrote = subprocess.run(
            [
                curl,
                "-s",
                "-w",
                " %{http_code}",
                "-X",
                "PUT",
                target,
                "-H",
                "Fencing-Token: files:2",
                "--data-binary",
                "client 2's write",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert wrote.stdout.endswith(" 200"), wrote.stdout  # the current holder: accepted
        os.kill(one.proc.pid, signal.SIGCONT)  # client 1 wakes up, believing it holds
        one.say("resume")
        line = one.line()
        while not line.startswith("write"):  # ("lost ...": its renewal found the lease gone)
            line = one.line()
    finally:
        one.close()
    return line, httpx.get(target, timeout=10).text


# -- the node client when renewals cannot be confirmed -----------------------------------------


def test_the_node_client_reports_lost_when_its_gateway_goes_away_and_stops_writing(
    server: FencedServer, storage: str
) -> None:
    """Bug: a renewal that could not reach the server (a gateway restart) was an unhandled
    rejection: node died with exit 1 ("fetch failed"). Now: "lost", no write after it."""
    target = f"{storage}/files/gone"
    node = Node(server.url, "files", target, "after the gateway left", ttl=1)
    try:
        assert node.line() == "token 1"
        assert server.proc is not None
        server.proc.kill()  # SIGKILL: its port refuses connections from now on
        server.proc.wait(10)
        lost = node.line()
        assert lost.startswith("lost no answer"), lost  # (connection refused, or no answer)
        node.say("write")
        assert node.line() == "write skipped: the lease is lost"
        assert node.proc.poll() is None, "node exited"
        node.say("release")
        assert node.line().startswith("released unknown")
        assert node.proc.wait(10) == 0
    finally:
        node.close()
    assert httpx.get(target, timeout=10).status_code == 404  # nothing written


class _Front:
    """A real HTTP front (as a load balancer) passing requests to a fenced server, until
    told to answer renewals with 503 (its upstream "unavailable")."""

    def __init__(self, upstream: str) -> None:
        import http.server
        import threading

        front = self
        self.refuse_renewals = False

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if front.refuse_renewals and self.path.endswith("/renew"):
                    status, payload = 503, b'{"error":"unavailable","message":"no upstream"}'
                else:
                    r = httpx.post(upstream + self.path, content=body, timeout=60)
                    status, payload = r.status_code, r.content
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_the_node_client_takes_a_503_renewal_as_lost(server: FencedServer, storage: str) -> None:
    """Bug: every renewal answer but 410 was ignored: after a 503 the client went on
    believing it held, and wrote. Now a 503 is "lost" and nothing is written after it; the
    same client through the same front writes while its renewals are confirmed."""
    front = _Front(server.url)
    target = f"{storage}/files/front"
    node = Node(front.url, "files", target, "through the front", ttl=1)
    try:
        assert node.line() == "token 1"
        node.say("write")  # renewals confirmed: the rightful write is made
        assert node.line().startswith("write 200")
        front.refuse_renewals = True
        lost = node.line()
        assert lost.startswith("lost 503"), lost
        node.say("write")
        assert node.line() == "write skipped: the lease is lost"
    finally:
        node.close()
        front.close()
    assert httpx.get(target, timeout=10).text == "through the front"
