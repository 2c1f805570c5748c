"""``fenced serve``: the HTTP API, auth, signing, metrics, shutdown, the loopback rule.

Every server here is a real ``fenced serve`` OS process (``FencedServer``) on a random port in
front of a real source; requests are plain HTTP (httpx), as any language would send them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import fenced
from fenced import cli
from fenced._core.backend import MAX_RECORD
from fenced.guards.sql import SQLGuard
from fenced.testing.servers import FencedServer
from tests.helpers import ROOT, TLS, forged, wait_for
from tests.server.gateway import get, keyed_server, post, until_closed

# -- the API ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FencedServer]:
    """One server for the tests that use lock names of their own and neither count the
    server's totals nor stop it (a `fenced serve` start is ~1 s of CPU)."""
    db = tmp_path_factory.mktemp("shared") / "locks.db"
    with FencedServer(f"sqlite:///{db}") as s:
        yield s  # type: ignore[misc]


def test_acquire_renew_release_round_trip_with_increasing_tokens(server: FencedServer) -> None:
    u = server.url
    a = post(f"{u}/v1/locks/invoices/acquire", {"ttl": 5, "request_id": "a-1"}).json()
    assert a["token"] == "invoices:1" and a["lease_id"] == "a-1" and 0 < a["expires_in"] <= 5
    # a second client is refused while it is held (try once), then granted a higher token
    busy = post(f"{u}/v1/locks/invoices/acquire", {"ttl": 5})
    assert busy.status_code == 409 and busy.json()["error"] == "timeout"
    again = post(f"{u}/v1/locks/invoices/acquire", {"ttl": 5, "request_id": "a-1"}).json()
    assert again["token"] == "invoices:1"  # idempotent by request id: the same grant
    renewed = post(f"{u}/v1/locks/invoices/renew", {"token": "invoices:1", "request_id": "a-1"})
    assert renewed.status_code == 200 and renewed.json()["ttl"] == 5
    wrong = post(f"{u}/v1/locks/invoices/release", {"token": "invoices:1", "request_id": "b"})
    assert wrong.json() == {"released": False}  # fenced: another request id frees nothing
    assert get(f"{u}/v1/locks/invoices").json()["held"] is True
    done = post(f"{u}/v1/locks/invoices/release", {"token": "invoices:1", "request_id": "a-1"})
    assert done.json() == {"released": True}
    lost = post(f"{u}/v1/locks/invoices/renew", {"token": "invoices:1", "request_id": "a-1"})
    assert lost.status_code == 410 and lost.json()["error"] == "lease_lost"
    b = post(f"{u}/v1/locks/invoices/acquire", {"ttl": 5}).json()
    assert b["value"] == 2
    status = get(f"{u}/v1/locks/invoices").json()
    assert status["token"] == "invoices:2" and status["last_token"] == "invoices:2"
    assert get(f"{u}/v1/locks").json() == {"locks": ["invoices"]}


def test_a_waiting_acquire_is_a_long_poll_granted_at_release(shared: FencedServer) -> None:
    u = shared.url
    held = post(f"{u}/v1/locks/q/acquire", {"ttl": 10, "request_id": "h"}).json()
    got: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: got.append(post(f"{u}/v1/locks/q/acquire", {"ttl": 10, "timeout": 20}))
    )
    waiter.start()
    wait_for(lambda: get(f"{u}/v1/locks/q").json()["waiters"] == 1, 10, "the waiter to queue")
    post(f"{u}/v1/locks/q/release", {"token": held["token"], "request_id": "h"})
    waiter.join(20)
    assert got[0].status_code == 200 and got[0].json()["value"] == held["value"] + 1


def test_check_tells_current_stale_and_never_granted(shared: FencedServer) -> None:
    u = shared.url
    first = post(f"{u}/v1/locks/c/acquire", {"request_id": "one"}).json()
    post(f"{u}/v1/locks/c/release", {"token": first["token"], "request_id": "one"})
    second = post(f"{u}/v1/locks/c/acquire").json()
    verdicts = {t: post(f"{u}/v1/check", {"token": t}).json() for t in ("c:1", "c:2", "c:9")}
    assert verdicts["c:2"]["verdict"] == "current" and verdicts["c:2"]["current"]
    assert verdicts["c:1"]["verdict"] == "stale" and verdicts["c:1"]["stale"]
    assert verdicts["c:9"]["verdict"] == "never_granted"
    assert second["token"] == "c:2"
    bad = post(f"{u}/v1/check", {"token": "c:0"})
    assert bad.status_code == 400 and bad.json()["error"] == "invalid_token"


def test_bad_input_gets_a_one_line_400_and_changes_nothing(server: FencedServer) -> None:
    u = server.url
    cases = [
        ("/v1/locks/a//b/acquire", {}),
        ("/v1/locks/x/acquire", {"ttl": 0}),
        ("/v1/locks/x/acquire", {"ttl": "5"}),
        ("/v1/locks/x/acquire", {"timeout": -1}),
        ("/v1/locks/x/acquire", {"request_id": "../../etc"}),
        ("/v1/locks/x/acquire", {"unknown": 1}),
        ("/v1/locks/x/acquire", [1, 2]),
        ("/v1/locks/x/renew", {"token": "y:1", "request_id": "r"}),
        ("/v1/locks/x/release", {"token": "x:1"}),
    ]
    for path, body in cases:
        r = post(u + path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert set(r.json()) == {"error", "message"} and "\n" not in r.json()["message"]
    r = httpx.post(u + "/v1/locks/x/acquire", content=b"{not json", timeout=10, verify=TLS)
    assert r.status_code == 400
    assert get(f"{u}/v1/locks").json() == {"locks": []}


def test_curl_bodies_without_a_json_content_type_are_read_as_json(shared: FencedServer) -> None:
    r = httpx.post(
        f"{shared.url}/v1/locks/curl-bodies/acquire",
        content=b'{"ttl": 10, "timeout": 1}',
        headers={"content-type": "application/x-www-form-urlencoded"},  # what curl -d sends
        timeout=10,
        verify=TLS,
    )
    assert r.status_code == 200 and r.json()["ttl"] == 10


def test_the_served_openapi_document_is_valid_and_covers_the_api(shared: FencedServer) -> None:
    from openapi_spec_validator import validate

    doc = get(f"{shared.url}/openapi.json").json()
    validate(doc)
    paths = set(doc["paths"])
    for expected in (
        "/v1/locks/{name}/-/acquire",
        "/v1/locks/{name}/-/renew",
        "/v1/locks/{name}/-/release",
        "/v1/locks/{name}/-/force-release",
        "/v1/locks/{name}/-/watch",
        "/v1/locks/{name}",
        "/v1/locks",
        "/v1/check",
        "/v1/health",
        "/v1/ready",
        "/metrics",
    ):
        assert expected in paths, expected
    # without keys no security is declared (with keys: test_a_key_outside_its_prefix...)
    assert "securitySchemes" not in doc["components"] and "security" not in json.dumps(doc)
    # A planted error: the validator must be able to fail.
    broken = json.loads(json.dumps(doc))
    broken["paths"]["/v1/check"]["post"]["responses"] = "none"
    with pytest.raises(Exception):  # noqa: B017 - the validator's own error type
        validate(broken)


def test_watch_streams_each_change_and_a_blocking_query_returns_on_change(
    shared: FencedServer,
) -> None:
    u = shared.url
    events: list[dict[str, object]] = []
    first = threading.Event()

    def watch() -> None:
        with httpx.stream("GET", f"{u}/v1/locks/w/-/watch", timeout=30, verify=TLS) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    first.set()
                    if len(events) == 3:
                        return

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    assert first.wait(10)
    version = get(f"{u}/v1/locks/w").json()["version"]
    blocked: list[dict[str, object]] = []
    query = threading.Thread(
        target=lambda: blocked.append(get(f"{u}/v1/locks/w?index={version}&wait=20").json())
    )
    query.start()
    g = post(f"{u}/v1/locks/w/acquire", {"request_id": "w1"}).json()
    post(f"{u}/v1/locks/w/release", {"token": g["token"], "request_id": "w1"})
    t.join(10)
    query.join(10)
    assert [e["held"] for e in events] == [False, True, False]
    assert events[1]["token"] == "w:1"
    assert blocked and blocked[0]["version"] != version


def test_health_ready_and_info(shared: FencedServer) -> None:
    assert get(f"{shared.url}/v1/health").json() == {"status": "ok"}
    assert get(f"{shared.url}/v1/ready").json() == {"status": "ready"}
    info = get(f"{shared.url}/v1/info").json()
    assert info["source"] == "sqlite" and "durable" in info["characteristics"]
    assert info["signing"] is None and info["auth"] is False


def test_metrics_count_grants_checks_and_refusals(server: FencedServer) -> None:
    u = server.url
    g = post(f"{u}/v1/locks/m/acquire").json()
    post(f"{u}/v1/locks/m/acquire")  # timeout
    post(f"{u}/v1/check", {"token": g["token"]})
    post(f"{u}/v1/check", {"token": "m:0"})
    text = get(f"{u}/metrics").text

    def value(sample: str) -> float:
        for line in text.splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        raise AssertionError(f"{sample} not in metrics")

    assert value("fenced_grants_total") == 1
    assert value("fenced_acquire_timeouts_total") == 1
    assert value('fenced_checks_total{result="current"}') == 1
    assert value('fenced_checks_total{result="invalid"}') == 1
    assert value('fenced_request_seconds_count{method="POST",route="/v1/check"}') == 2
    # the SQLite source's own commits: one more per sequential grant and release
    commits = value("fenced_source_commits_total")
    assert commits >= 1
    post(f"{u}/v1/locks/m/release", {"token": g["token"], "lease_id": g["lease_id"]})
    g2 = post(f"{u}/v1/locks/m2/acquire").json()
    text = get(f"{u}/metrics").text
    assert value("fenced_source_commits_total") == commits + 2, g2


# -- auth ------------------------------------------------------------------------------------------

SECRETS = {
    "billing": "fk_billing_secret_000000000000",
    "reader": "fk_reader_secret_0000000000000",
    "ops": "fk_ops_secret_000000000000000000",
}


@pytest.fixture
def keyed(source: str, tmp_path: Path) -> Iterator[FencedServer]:
    with keyed_server(source, tmp_path / "keys.toml", [
        {"id": "billing", "secret": SECRETS["billing"], "prefixes": ["invoices/"],
         "verbs": ["acquire", "check"]},
        {"id": "reader", "secret": SECRETS["reader"], "prefixes": [""], "verbs": ["check"]},
        {"id": "ops", "secret": SECRETS["ops"], "plain": True, "verbs": ["admin"]},
    ]) as s:  # fmt: skip
        yield s


def test_a_key_outside_its_prefix_gets_403_and_changes_nothing(keyed: FencedServer) -> None:
    u, billing = keyed.url, SECRETS["billing"]
    assert post(f"{u}/v1/locks/invoices/a/acquire").status_code == 401
    assert post(f"{u}/v1/locks/invoices/a/acquire", key="fk_wrong_0000000000").status_code == 401
    ok = post(f"{u}/v1/locks/invoices/a/acquire", key=billing)
    assert ok.status_code == 200
    refused = post(f"{u}/v1/locks/payroll/acquire", key=billing)
    assert refused.status_code == 403 and refused.json()["error"] == "forbidden"
    reader = post(f"{u}/v1/locks/invoices/b/acquire", key=SECRETS["reader"])
    assert reader.status_code == 403
    # the reader can read and check, but sees the holder's description, not its request id
    status = get(f"{u}/v1/locks/invoices/a", key=SECRETS["reader"]).json()
    assert status["held"] and status["holder"] == status["owner"]
    assert status["owner"].startswith("billing:") and ok.json()["request_id"] not in str(status)
    doc = get(f"{u}/openapi.json").json()  # (anyone may read it) bearer security declared
    assert "bearer" in json.dumps(doc["components"]["securitySchemes"]).lower()
    assert post(f"{u}/v1/check", {"token": "invoices/a:1"}, key=SECRETS["reader"]).json()["current"]
    # the reader may not free it; ops may
    force = f"{u}/v1/locks/invoices/a/force-release"
    assert post(force, key=SECRETS["reader"]).status_code == 403
    assert post(force, key=billing).status_code == 403
    assert get(f"{u}/v1/locks/invoices/a", key=SECRETS["ops"]).json()["held"] is True
    assert post(force, key=SECRETS["ops"]).json()["released"]["token"] == "invoices/a:1"
    # nothing refused touched a lock: payroll and invoices/b were never created
    assert get(f"{u}/v1/locks", key=SECRETS["ops"]).json() == {"locks": ["invoices/a"]}
    assert get(f"{u}/metrics", key=billing).status_code == 403
    # no secret in the server's log
    log = keyed.log_path.read_text()
    assert not any(secret in log for secret in SECRETS.values())


def test_the_python_client_with_a_key_and_without(keyed: FencedServer) -> None:
    with fenced.connect(keyed.url, api_key=SECRETS["billing"]) as locks:
        with locks.lock("invoices/7", ttl=5) as lease:
            assert lease.token.value == 1
        with pytest.raises(fenced.AccessDenied):
            locks.lock("payroll", ttl=5).acquire(timeout=1)
    with pytest.raises(fenced.AccessDenied) as info:
        fenced.connect(keyed.url, api_key="fk_not_a_key_000000").lock("invoices/1").acquire()
    assert "fk_not_a_key" not in str(info.value)


def test_without_keys_it_refuses_to_listen_beyond_loopback(source: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "fenced.cli", "serve", "--url", source, "--listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert r.returncode == 2
    assert "without --api-keys" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_bad_keys_file_is_one_line_that_quotes_no_secret(source: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nid = "x"\nsecret = "short-secret"\nverbs = ["acquire"]\n')
    r = subprocess.run(
        [sys.executable, "-m", "fenced.cli", "serve", "--url", source, "--api-keys", str(keys)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert r.returncode == 2 and "16+ characters" in r.stderr
    assert "short-secret" not in r.stderr


# -- signing ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def signing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FencedServer, Path]]:
    """One server with an HMAC signing key (and the key's file) for the signing tests, which
    use lock names of their own and count no totals."""
    base = tmp_path_factory.mktemp("signing")
    key_file = base / "signing.key"
    assert cli.main(["keygen", "hmac", "k1", str(key_file)]) == 0
    with FencedServer(f"sqlite:///{base / 'locks.db'}", args=["--signing-key", str(key_file)]) as s:
        yield s, key_file  # type: ignore[misc]


def test_signed_tokens_verify_at_a_guard_and_forged_ones_are_refused_by_check(
    signing: tuple[FencedServer, Path], tmp_path: Path
) -> None:
    server, key_file = signing
    u = server.url
    raw = post(f"{u}/v1/locks/acct/acquire").json()
    assert raw["signed"].startswith("acct:1.k1.")
    keyring = fenced.Keyring([fenced.load_key(str(key_file))])
    import sqlite3

    db = sqlite3.connect(tmp_path / "data.db")
    db.execute("CREATE TABLE t (v TEXT)")
    guard = SQLGuard("acct", verify=keyring)
    guard.install(db)
    with db:  # the signed token, as the client got it, is accepted
        guard.check(db, token=raw["signed"])
        db.execute("INSERT INTO t VALUES ('ok')")
    for bad in (
        "acct:1",
        forged(raw["signed"]),
    ):
        with pytest.raises(fenced.SignatureError), db:
            guard.check(db, token=bad)
        r = post(f"{u}/v1/check", {"token": bad})
        assert r.status_code == 400 and r.json()["error"] == "invalid_token", bad
    assert post(f"{u}/v1/check", {"token": raw["signed"]}).json()["verdict"] == "current"
    # and the Python client's lease carries the signed token
    with fenced.connect(u) as locks:
        post(
            f"{u}/v1/locks/acct/release",
            {"token": raw["signed"], "request_id": raw["request_id"]},
        )
        with locks.lock("acct", ttl=5) as lease:
            assert lease.token.signature is not None and lease.token.value == 2
            keyring.verify("acct", 2, lease.token.signature)


# -- shutdown --------------------------------------------------------------------------------------


def test_sigterm_answers_waiters_at_once_and_leaves_held_leases_to_expire(
    server: FencedServer, source: str
) -> None:
    u = server.url
    held = post(f"{u}/v1/locks/s/acquire", {"ttl": 30, "request_id": "holder"}).json()
    got: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: got.append(post(f"{u}/v1/locks/s/acquire", {"timeout": 50}))
    )
    waiter.start()
    wait_for(lambda: get(f"{u}/v1/locks/s").json()["waiters"] == 1, 10, "the waiter")
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    waiter.join(15)  # well before its 50 s
    assert not waiter.is_alive() and got[0].status_code == 503
    # (uvicorn re-raises the signal once shut down: the status says "ended by SIGTERM")
    assert server.proc.wait(15) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in server.log_path.read_text()
    with fenced.connect(source) as locks:  # the source itself: the grant is still there
        status = locks.status("s")
        assert status.token is not None and status.token.value == held["value"]
        assert status.holder == "holder"


async def test_connections_of_the_listening_socket_send_without_delay() -> None:
    """The server's answers are written in two parts; with Nagle's algorithm on, the second
    waited for the client's delayed ACK (40 ms a request on a keep-alive connection)."""
    import asyncio
    import socket

    from fenced.server._run import listen_socket

    sock = listen_socket("127.0.0.1", 0)
    seen: list[int] = []
    accepted = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock_ = writer.get_extra_info("socket")
        seen.append(sock_.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        accepted.set()
        writer.close()

    server = await asyncio.start_server(handle, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        await asyncio.wait_for(accepted.wait(), 10)
        writer.close()
    assert seen == [1]


# -- TLS, logs, help -------------------------------------------------------------------------------


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def test_https_with_the_servers_tls_options(source: str, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    args = ["--tls-cert", str(cert), "--tls-key", str(key), "--log-format", "json"]
    with FencedServer(source, args=args) as server:
        url = f"https://127.0.0.1:{server.port}"
        with fenced.connect(url, ca_file=str(cert)) as locks:
            with locks.lock("tls", ttl=5) as lease:
                assert lease.token.value == 1
        with pytest.raises(fenced.BackendUnavailable):  # an unknown CA is refused
            fenced.connect(url, connect_timeout=1).close()
        trusted = ssl.create_default_context(cafile=str(cert))
        assert httpx.get(f"{url}/v1/health", verify=trusted, timeout=10).status_code == 200
        with pytest.raises(fenced.ConfigurationError):  # a CA file that is not one: one line
            fenced.connect(url, ca_file=str(tmp_path / "missing.pem"))
        lines = [ln for ln in server.log_path.read_text().splitlines() if ln.startswith("{")]
    events = [json.loads(ln) for ln in lines]
    assert any(e["message"].startswith("granted lock=tls token=1") for e in events), events
    assert all({"time", "level", "logger", "message"} <= set(e) for e in events)


@pytest.mark.parametrize("level", ["info", "warning"])
def test_the_log_level_decides_whether_transitions_are_logged(source: str, level: str) -> None:
    with FencedServer(source, args=["--log-level", level]) as server:
        g = post(f"{server.url}/v1/locks/audit/acquire", {"ttl": 5}).json()
        post(
            f"{server.url}/v1/locks/audit/release", {"token": g["token"], "lease_id": g["lease_id"]}
        )
        server.stop()
        log = server.log_path.read_text()
    lines = [ln for ln in log.splitlines() if "lock=audit" in ln]
    if level == "info":
        assert len(lines) == 2 and "granted" in lines[0] and "released" in lines[1], lines
    else:
        assert lines == []


def test_serve_help_lists_every_option() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "fenced.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert r.returncode == 0
    for option in (
        "--url", "--listen", "--api-keys", "--insecure-no-auth", "--signing-key", "--tls-cert",
        "--tls-key", "--max-wait", "--default-ttl", "--log-format", "--access-log", "--timeout",
        "--log-level",
    ):  # fmt: skip
        assert option in r.stdout, option


def test_with_signing_on_the_signed_token_of_a_dotted_lock_name_renews(
    signing: tuple[FencedServer, Path],
) -> None:
    """Renew and release take the signed token (verified) and refuse the plain one (public:
    a status shows it). A lock name with dots ("a.b.c") must not be taken for a signed token."""
    server, _ = signing
    u = server.url
    g = post(f"{u}/v1/locks/app.jobs.v2/acquire", {"request_id": "r"}).json()
    assert g["token"] == "app.jobs.v2:1" and g["signed"]
    plain = {"token": g["token"], "request_id": "r"}
    r = post(f"{u}/v1/locks/app.jobs.v2/renew", plain)
    assert r.status_code == 400 and r.json()["error"] == "invalid_token"
    signed = {"token": g["signed"], "request_id": "r"}
    assert post(f"{u}/v1/locks/app.jobs.v2/renew", signed).status_code == 200
    bad = {"token": forged(g["signed"]), "request_id": "r"}
    r = post(f"{u}/v1/locks/app.jobs.v2/renew", bad)
    assert r.status_code == 400 and r.json()["error"] == "invalid_token"
    assert post(f"{u}/v1/locks/app.jobs.v2/release", signed).json() == {"released": True}


# -- request size ------------------------------------------------------------------------------


def refused_too_large(server: FencedServer) -> float:
    for line in get(f"{server.url}/metrics").text.splitlines():
        if line.startswith('fenced_refused_requests_total{reason="too_large"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_body_over_the_limit_is_refused_and_changes_nothing(source: str) -> None:
    """413 too_large for a body over --max-request-bytes, declared (Content-Length) or
    streamed (chunked, no length): the lock is not taken, the refusal is counted, and the
    server goes on serving. A body within the limit is served as before."""
    with FencedServer(source, args=["--max-request-bytes", "4096"]) as server:
        u = f"{server.url}/v1/locks/jobs"
        big = {"owner": "x" * 10_000}
        r = httpx.post(f"{u}/acquire", json=big, timeout=30, verify=TLS)
        assert r.status_code == 413, r.text
        assert r.json() == {"error": "too_large", "message": "request body over 4096 bytes"}

        def chunks() -> Iterator[bytes]:
            yield b'{"owner": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        r = httpx.post(
            f"{u}/acquire",
            content=chunks(),
            headers={"content-type": "application/json"},
            verify=TLS,
        )
        assert "content-length" not in r.request.headers  # (sent chunked)
        assert r.status_code == 413, r.text
        assert refused_too_large(server) == 2
        assert get(u).json()["holder"] is None  # nothing was granted
        # Within the limit: served, through the fast lane and through FastAPI alike.
        ok = post(f"{u}/acquire", {"ttl": 30, "owner": "z" * 3000})
        assert ok.status_code == 200, ok.text
        lease = ok.json()
        assert post(f"{u}/release", {"token": lease["token"], "lease_id": lease["lease_id"]}).json()
        bad = post(f"{u}/acquire", {"ttl": "thirty"})
        assert bad.status_code == 400 and bad.json()["error"] == "invalid_request"
        assert refused_too_large(server) == 2


def test_the_largest_record_fits_under_the_default_limit(shared: FencedServer) -> None:
    """The biggest request fenced takes — a 64 Ki-character record, every character escaped
    in JSON — is under the default 1 MiB limit; one byte-heavy body over it is refused."""
    value = "\u2028" * MAX_RECORD
    body = json.dumps({"version": 0, "value": value})  # (ensure_ascii: 6 bytes a character)
    assert MAX_RECORD * 6 < len(body) < 1 << 20
    r = httpx.post(
        f"{shared.url}/v1/records/big/swap",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
        verify=TLS,
    )
    assert r.status_code == 200, r.text
    assert get(f"{shared.url}/v1/records/big").json()["value"] == value
    r = httpx.post(
        f"{shared.url}/v1/records/big/swap",
        content=b" " * (1 << 20) + body.encode(),
        headers={"content-type": "application/json"},
        timeout=30,
        verify=TLS,
    )
    assert r.status_code == 413, r.text


def head_reply(server: FencedServer, head: bytes, chunk: int = 8192) -> bytes:
    """Send a request head (in pieces, as a slow client would) and return what comes back."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        try:
            for i in range(0, len(head), chunk):
                conn.sendall(head[i : i + chunk])
        except OSError:  # (refused mid-way: the server closed the connection)
            pass
        reply = b""
        with contextlib.suppress(OSError):
            while piece := conn.recv(65536):
                reply += piece
        return reply


def test_a_request_head_over_the_bound_is_refused_and_the_server_goes_on(
    shared: FencedServer,
) -> None:
    """uvicorn's httptools protocol holds a request's headers until they end, with no limit:
    fenced's refuses a head over 64 KiB with 431 and closes the connection. A long head within
    it (20 KiB of headers) is served, and so is everything after a refusal."""
    junk = b"".join(b"x-junk-%d: %s\r\n" % (i, b"a" * 1000) for i in range(100))  # ~100 KiB
    head = b"GET /v1/health HTTP/1.1\r\nhost: x\r\n" + junk + b"\r\n"
    # In pieces, and whole in one send (a busy server then reads the complete head at once).
    for chunk in (8192, len(head)):
        reply = head_reply(shared, head, chunk)
        assert reply.startswith(b"HTTP/1.1 431 "), (chunk, reply[:200])
    within = b"".join(b"x-long-%d: %s\r\n" % (i, b"b" * 1000) for i in range(20))
    reply = head_reply(
        shared,
        b"GET /v1/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + within + b"\r\n",
    )
    assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
    assert get(f"{shared.url}/v1/health").json() == {"status": "ok"}


def test_a_post_asking_to_upgrade_to_h2c_is_served_as_http_1_1(shared: FencedServer) -> None:
    """Java's HttpClient and `curl --http2` send `Connection: Upgrade, HTTP2-Settings` and
    `Upgrade: h2c` with a POST; the server ignores the upgrade (as RFC 9110 lets it) and serves
    the request with its body — whole, or with the head and the body in separate reads.
    (httptools stopped at such a head: the body never reached the app, a 400.)"""
    body = b'{"ttl": 30, "request_id": "h2c-1"}'
    for name, whole in ((b"h2c-a", True), (b"h2c-b", False)):
        head = (
            b"POST /v1/locks/%s/-/acquire HTTP/1.1\r\nhost: x\r\n"
            % name
            + b"Connection: Upgrade, HTTP2-Settings, close\r\nUpgrade: h2c\r\n"
            b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        )
        reply = head_reply(shared, head + body, len(head) + len(body) if whole else len(head))
        assert reply.startswith(b"HTTP/1.1 200 "), (whole, reply[:300])
        flat = reply.replace(b" ", b"")
        # The body's own ttl and request id (an acquire without its body takes the defaults).
        assert b'"token":"%s:1"' % name in flat, reply[:300]
        assert b'"request_id":"h2c-1"' in flat and b'"ttl":30.0' in flat, reply[:400]


def test_a_request_that_is_too_slow_is_closed_with_408(source: str) -> None:
    """A connection that sends nothing, a head a piece at a time, or a body that stops half
    way, is held no longer than --read-timeout (a slow client would otherwise keep each
    connection for good); a request that arrives in time is served on the same server."""
    with FencedServer(source, args=["--read-timeout", "1"]) as server:
        port = int(server.url.rsplit(":", 1)[1])
        for first in (b"", b"GET /v1/health HTTP/1.1\r\nhost: x\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                reply, took = until_closed(conn, first)
            assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
            assert 0.9 < took < 5, took
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            started = time.monotonic()
            conn.sendall(
                b"POST /v1/locks/jobs/acquire HTTP/1.1\r\nhost: x\r\n"
                b'content-type: application/json\r\ncontent-length: 100\r\n\r\n{"ttl": '
            )
            reply = b""
            while piece := conn.recv(65536):  # (the server closes it: the body was cut short)
                reply += piece
            took = time.monotonic() - started
        assert reply.startswith(b"HTTP/1.1 408 ") and b'"too_slow"' in reply, reply[:300]
        assert 0.9 < took < 5, took
        assert get(f"{server.url}/v1/locks/jobs").json()["holder"] is None
        assert get(f"{server.url}/v1/health").json() == {"status": "ok"}
        reply = head_reply(
            server, b"GET /v1/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
        )
        assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]


def test_serve_refuses_a_read_timeout_of_zero(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "fenced", "serve", "--read-timeout", "0", "--url", "memory://"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "more than 0 seconds" in r.stderr, r.stderr


def test_serve_raises_its_open_files_limit_to_the_hard_limit(source: str) -> None:
    """Each client holds a connection: a soft limit of 1,024 would refuse the 1,000th, so
    ``fenced serve`` raises its soft limit to the hard one (started here with 256)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    lower = "import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, (256, {}))".format(
        "resource.RLIM_INFINITY" if hard == resource.RLIM_INFINITY else hard
    )
    with FencedServer(source, prelude=lower) as server:
        assert server.proc is not None
        limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
        soft = next(line.split()[3] for line in limits.splitlines() if "open files" in line)
        assert int(soft) > 256, limits
        if hard != resource.RLIM_INFINITY:
            assert int(soft) == hard
