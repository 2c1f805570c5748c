"""Attacks on ``fenced serve`` from outside (session 3, attack 2): each test is a finding
reproduced against a real ``fenced serve`` process, and the rightful request served beside it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fenced.testing.servers import FencedServer, ZooKeeperServer
from tests.server.gateway import TLS, get, keyed_server, post, until_closed, write_keys

SECRETS = {"alice": "alice-secret-0123456789", "eve": "eve-secret-0123456789ab", "mon": "m" * 20}


@pytest.fixture(params=["sqlite", "redis", "postgresql"])
def any_source(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """SQLite, Redis and PostgreSQL: a gateway's key checks are the same in front of each."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'locks.db'}"
    if request.param == "redis":
        return str(request.getfixturevalue("redis_server").url)
    return str(request.getfixturevalue("pg_dsn"))


@pytest.fixture
def keyed(any_source: str, tmp_path: Path) -> Iterator[FencedServer]:
    with keyed_server(any_source, tmp_path / "keys.toml", [
        {"id": "alice", "secret": SECRETS["alice"], "prefixes": ["a/"],
         "verbs": ["acquire", "check"]},
        {"id": "eve", "secret": SECRETS["eve"], "prefixes": [""], "verbs": ["acquire", "check"]},
        {"id": "mon", "secret": SECRETS["mon"], "verbs": ["metrics"]},
    ]) as s:  # fmt: skip
        yield s


def samples(server: FencedServer) -> dict[str, float]:
    return samples_of(get(f"{server.url}/metrics", key=SECRETS["mon"]).text)


def samples_of(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("fenced_") and "_created" not in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# -- the request bounds on a kept-alive connection ---------------------------------------------


def test_the_head_bound_holds_for_a_kept_alive_connections_second_request(
    server: FencedServer,
) -> None:
    """The 64 KiB bound on a request's head held for a connection's first request only: after
    a request, the next one's head began with ``_in_head`` False, so the read that began it
    was not counted — a second request of ~100 KiB of headers, sent in one piece, was served
    (the bound was 64 KiB plus one read, up to 256 KiB). The first request on the same
    connection is served, and a second within the bound too."""
    port = int(server.url.rsplit(":", 1)[1])
    first = b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n"
    junk = b"".join(b"x-junk-%d: %s\r\n" % (i, b"a" * 1000) for i in range(100))  # ~100 KiB
    within = b"".join(b"x-long-%d: %s\r\n" % (i, b"b" * 1000) for i in range(20))  # ~20 KiB
    for extra, status in ((junk, b"431"), (within, b"200")):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(first)
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
                reply += conn.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
            conn.sendall(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n" + extra + b"\r\n")
            reply = b""
            with contextlib.suppress(OSError):
                while b"\r\n\r\n" not in reply or not reply.endswith((b"}", b"\n")):
                    if not (piece := conn.recv(65536)):
                        break
                    reply += piece
        assert reply.startswith(b"HTTP/1.1 " + status), (status, reply[:200])
    assert get(f"{server.url}/v1/health").json() == {"status": "ok"}


def _answers(port: int, data: bytes, then: bytes = b"") -> tuple[list[bytes], bool]:
    """Send ``data`` in one piece (pipelined requests), then ``then`` once all are answered;
    the status lines of the answers, and whether the server closed the connection."""
    statuses: list[bytes] = []
    reply = b""
    closed = False
    with socket.create_connection(("127.0.0.1", port), timeout=20) as conn:
        conn.sendall(data)
        sent_then = False
        with contextlib.suppress(TimeoutError):
            while True:
                conn.settimeout(3 if statuses else 20)  # (answers come at once: then idle)
                piece = conn.recv(1 << 16)
                if not piece:
                    closed = True
                    break
                reply += piece
                while (end := reply.find(b"\r\n\r\n")) >= 0:
                    head, rest = reply[:end], reply[end + 4 :]
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    if len(rest) < length:
                        break
                    statuses.append(head.split(b"\r\n")[0])
                    reply = rest[length:]
                if then and not sent_then and len(statuses) == data.count(b"HTTP/1.1\r\n"):
                    conn.sendall(then)
                    sent_then = True
    return statuses, closed


def test_pipelined_requests_are_bounded_in_head_size_and_in_number(server: FencedServer) -> None:
    """The head bound counted the head a read began in, and the next head on the connection
    from the next read: a request pipelined behind another in one piece had its head (or its
    first 256 KiB) uncounted — a 100 KiB head was served. And uvicorn queued every request a
    read held and read again after each answer: a thousand small requests sent at once were
    all queued. Now such a head, or a request past MAX_PIPELINED queued, ends the connection
    once the requests before it are answered (an answer then would be taken for theirs);
    pipelining within the bounds is answered, in order, and the connection kept."""
    from fenced.server._http import MAX_PIPELINED

    port = int(server.url.rsplit(":", 1)[1])
    health = b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n"
    big = b"".join(b"x-junk-%d: %s\r\n" % (i, b"a" * 1000) for i in range(100))  # ~100 KiB
    within = b"".join(b"x-long-%d: %s\r\n" % (i, b"b" * 1000) for i in range(20))  # ~20 KiB
    second = b"GET /v1/health HTTP/1.1\r\nhost: x\r\n"

    statuses, closed = _answers(port, health + second + big + b"\r\n")
    assert statuses == [b"HTTP/1.1 200 OK"] and closed, statuses
    statuses, closed = _answers(port, health + second + within + b"\r\n", then=health)
    assert statuses == [b"HTTP/1.1 200 OK"] * 3 and not closed, statuses

    statuses, closed = _answers(port, health * 1000)
    assert closed and 0 < len(statuses) <= MAX_PIPELINED + 1, len(statuses)
    assert set(statuses) == {b"HTTP/1.1 200 OK"}
    statuses, closed = _answers(port, health * 10, then=health)
    assert statuses == [b"HTTP/1.1 200 OK"] * 11 and not closed, statuses
    assert get(f"{server.url}/v1/health").json() == {"status": "ok"}


def test_a_long_poll_on_a_kept_alive_connection_outlives_the_read_timeout(source: str) -> None:
    """The other side of the bound above: between requests the next head is counted, but its
    time is not (a request's answer may take longer than --read-timeout: a long poll)."""
    server = FencedServer(source, args=["--read-timeout", "1"])
    with server:
        u = f"{server.url}/v1/locks/busy/-/acquire"
        assert post(u, {"ttl": 30, "request_id": "holder"}).status_code == 200
        with httpx.Client(timeout=30) as client:
            for _ in range(2):  # (the second request on the same connection)
                r = client.post(u, json={"timeout": 2.5, "request_id": "waiter"})
                assert r.status_code == 409 and r.json()["error"] == "timeout", r.text
        # ... while a second request's head that stalls half way is still closed in time.
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"GET /v1/health HTTP/1.1\r\nhost: x\r\n\r\n")
            reply = b""
            while not reply.endswith(b"}"):
                reply += conn.recv(65536)
            reply, took = until_closed(conn, b"GET /v1/health HTTP/1.1\r\nhost: x\r\n")
        assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
        assert 0.9 < took < 5, took


# -- tenant isolation --------------------------------------------------------------------------


def test_another_keys_request_id_is_answered_as_unknown_and_counts_as_a_refusal_only(
    keyed: FencedServer,
) -> None:
    """Eve (a key on every prefix) names Alice's request id and token on acquire, renew and
    release: answered as an id nobody uses (409, 410, released false: no oracle of the ids
    Alice uses), Alice keeps her grant — and the metrics count three refusals, nothing
    else. (The gateway tried the request under Eve's own id first and counted what that
    found — an acquire timeout, a lost renewal, a release of nothing — before it saw the
    request id was another key's: a scraper saw leases lost that were not.)"""
    u = f"{keyed.url}/v1/locks/a/{uuid.uuid4().hex}/-"  # (a source shared by the session)
    grant = post(f"{u}/acquire", {"ttl": 30, "request_id": "r1"}, key=SECRETS["alice"]).json()
    lease = {"token": grant["token"], "request_id": "r1"}
    before = samples(keyed)
    answers = {"acquire": (409, "timeout"), "renew": (410, "lease_lost"), "release": (200, None)}
    for action, body in (("acquire", {"request_id": "r1"}), ("renew", lease), ("release", lease)):
        r = post(f"{u}/{action}", body, key=SECRETS["eve"])
        assert (r.status_code, r.json().get("error")) == answers[action], (action, r.text)
    after = samples(keyed)
    changed = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    # (fenced_source_commits_total aside: SQLite's try-once commits its look, changing nothing)
    changed = {
        k: v
        for k, v in changed.items()
        if not k.startswith(("fenced_request_seconds", "fenced_source_commits"))
    }
    assert changed == {'fenced_refused_requests_total{reason="forbidden"}': 3.0}, changed
    # Eve reads the lock every way there is: the holder's description, never the request id.
    name = u.split("/v1/locks/")[1][:-2]
    reads = [
        get(f"{keyed.url}/v1/locks/{name}", key=SECRETS["eve"]).text,
        get(f"{keyed.url}/v1/locks/{name}?index=0:free&wait=0.2", key=SECRETS["eve"]).text,
        get(f"{keyed.url}/v1/dashboard?prefix={name}", key=SECRETS["eve"]).text,
    ]
    headers = {"authorization": f"Bearer {SECRETS['eve']}"}
    with httpx.stream("GET", f"{u}/watch", headers=headers, timeout=30, verify=TLS) as watch:
        lines = watch.iter_lines()
        reads.append(next(lines) + next(lines))  # (the event's name, then its data)
    for text in reads:
        assert '"holder":"alice: ' in text, text
        assert "r1" not in text.replace(name, ""), text
    mine = get(f"{keyed.url}/v1/locks/{name}", key=SECRETS["alice"]).json()
    assert mine["holder"] == "r1", mine
    # The rightful holder: renewed and released, counted as such.
    assert post(f"{u}/renew", lease, key=SECRETS["alice"]).status_code == 200
    assert post(f"{u}/release", lease, key=SECRETS["alice"]).json() == {"released": True}
    after = samples(keyed)
    assert after['fenced_renewals_total{result="ok"}'] == 1.0
    assert after['fenced_releases_total{result="released"}'] == 1.0


# -- watches are bounded ---------------------------------------------------------------------------


def _watch_keys(tmp_path: Path) -> str:
    keys = [
        {"id": who, "secret": SECRETS[who], "prefixes": [""], "verbs": verbs}
        for who, verbs in (("alice", ["acquire"]), ("eve", ["acquire"]), ("mon", ["metrics"]))
    ]
    return str(write_keys(tmp_path / "keys.toml", keys))


def test_a_flood_of_watches_is_bounded_per_client_and_per_server(
    source: str, tmp_path: Path
) -> None:
    """Bug: a client could open watches (``/-/watch`` streams, blocking status queries) without
    end, each reading the source four times a second. Now one key (or, without keys, one
    address) may have --max-watches-per-client open (429 ``too_many_watches`` past it) and the
    server --max-watches (503 past it), counted as refused; a watch that ends gives its place
    back, and another client's watches are served meanwhile."""
    args = ["--api-keys", _watch_keys(tmp_path)]
    args += ["--max-watches-per-client", "4", "--max-watches", "6"]

    def auth(who: str) -> dict[str, str]:
        return {"authorization": f"Bearer {SECRETS[who]}"}

    async def flood(u: str) -> None:
        async with httpx.AsyncClient(timeout=30) as c:

            async def watch(who: str, name: str) -> httpx.Response:
                request = c.build_request("GET", f"{u}/v1/locks/{name}/-/watch", headers=auth(who))
                return await c.send(request, stream=True)

            async def metric(name: str) -> float:
                text = (await c.get(f"{u}/metrics", headers=auth("mon"))).text
                return samples_of(text).get(name, 0.0)

            refused = 'fenced_refused_requests_total{reason="too_many_watches"}'
            answers = await asyncio.gather(*(watch("alice", f"a/w{i}") for i in range(60)))
            open_ = [r for r in answers if r.status_code == 200]
            assert len(open_) == 4
            for r in answers:
                if r.status_code != 200:
                    await r.aread()
                    assert r.status_code == 429 and r.json()["error"] == "too_many_watches"
                    assert "\n" not in r.json()["message"] and r.headers["retry-after"] == "1"
                    await r.aclose()
            # a blocking query is a watch too
            version = (await c.get(f"{u}/v1/locks/a/x", headers=auth("alice"))).json()["version"]
            query = f"{u}/v1/locks/a/x?index={version}&wait=5"
            blocked = await c.get(query, headers=auth("alice"))
            assert blocked.status_code == 429 and blocked.json()["error"] == "too_many_watches"
            # another key is served, up to the server's bound
            eves = [await watch("eve", f"e/w{i}") for i in range(2)]
            assert [r.status_code for r in eves] == [200, 200]
            full = await watch("eve", "e/w9")
            await full.aread()
            assert full.status_code == 503 and full.json()["error"] == "too_many_watches"
            assert full.headers["retry-after"] == "1"
            await full.aclose()
            assert await metric("fenced_watches_open") == 6
            assert await metric(refused) == 56 + 1 + 1
            # the open ones work: a grant shows up on its stream
            got = await c.post(f"{u}/v1/locks/a/w0/-/acquire", json={}, headers=auth("alice"))
            assert got.status_code == 200
            async with asyncio.timeout(10):
                async for line in open_[0].aiter_lines():
                    if line.startswith("data:") and '"held":true' in line:
                        break
            # a watch that ends gives its place back: the rightful next one is served
            await open_[0].aclose()
            deadline = time.monotonic() + 20
            while await metric("fenced_watches_open") != 5:
                assert time.monotonic() < deadline, "the closed watch kept its place"
                await asyncio.sleep(0.05)
            short = await c.get(f"{u}/v1/locks/a/x?index={version}&wait=0.2", headers=auth("alice"))
            assert short.status_code == 200 and short.json()["version"] == version
            again = await watch("alice", "a/again")
            assert again.status_code == 200
            for r in [*open_[1:], *eves, again]:
                await r.aclose()
            deadline = time.monotonic() + 20
            while await metric("fenced_watches_open") != 0:
                assert time.monotonic() < deadline, "closed watches kept their places"
                await asyncio.sleep(0.05)

    with FencedServer(source, args=args) as server:
        asyncio.run(flood(server.url))


# -- logs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "fmt"), [((), "text"), (("--log-format", "json"), "json")])
def test_access_log_writes_a_line_per_request_and_only_when_asked(
    source: str, args: tuple[str, ...], fmt: str
) -> None:
    """``--access-log`` wrote nothing: uvicorn's access lines go to ``uvicorn.access``, which
    had no handler (uvicorn's log config is off), so they were dropped. Now one line per
    request, in the chosen format, also at ``--log-level warning`` (asked for by name); and
    none without the option."""

    for n, extra in enumerate(((), ("--access-log",), ("--access-log", "--log-level", "warning"))):
        server = FencedServer(source, args=[*args, *extra])
        with server:
            assert get(f"{server.url}/v1/health?probe=7").status_code == 200
            r = post(f"{server.url}/v1/locks/acc{n}/-/acquire", {"ttl": 5})
            assert r.status_code == 200, r.text
            server.stop()
            log = server.log_path.read_text()
        lines = [ln for ln in log.splitlines() if "/v1/health?probe=7" in ln]
        if not extra:
            assert lines == [], lines
            continue
        assert len(lines) == 1 and "200" in lines[0], log[-2000:]
        if fmt == "json":
            assert json.loads(lines[0])["logger"] == "uvicorn.access"
        grants = [ln for ln in log.splitlines() if f"granted lock=acc{n}" in ln]
        assert len(grants) == (0 if "warning" in extra else 1), grants


_FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^\s"]*)(?=\s|$)')


def _logfmt(message: str) -> tuple[str, dict[str, str]]:
    """A transition line's event and fields, as a logfmt reader takes them (quoted values
    with JSON's escapes); AssertionError if any of it is not a field."""
    event, _, rest = message.partition(" ")
    fields = {}
    at = 0
    for m in _FIELD.finditer(rest):
        assert rest[at : m.start()].strip() == "", rest
        key, value = m.group(1), m.group(2)
        assert key not in fields, (key, rest)
        fields[key] = json.loads(value) if value.startswith('"') else value
        at = m.end()
    assert rest[at:].strip() == "", rest
    return event, fields


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_holder_description_cannot_forge_fields_of_a_transition_line(
    source: str, fmt: str
) -> None:
    """A client's holder description (and a lock name, which may hold "=") reached the
    ``granted lock=... token=N owner=...`` lines as they were: an owner ending
    ``token=999 lock=payroll`` read as the grant of token 999 of payroll to a reader of the
    log. Such text is quoted now (logfmt: double quotes, JSON's escapes): the reader finds the
    real token and the whole description; plain names and descriptions stay bare."""
    forged = 'w1 token=999 lock=payroll owner="root" \\ caf\u00e9'
    args = ["--log-format", "json"] if fmt == "json" else []
    with FencedServer(source, args=args) as server:
        u = server.url
        g = post(f"{u}/v1/locks/x=1/-/acquire", {"ttl": 30, "owner": forged, "request_id": "r"})
        assert g.status_code == 200, g.text
        post(f"{u}/v1/locks/x=1/-/release", {"token": g.json()["token"], "request_id": "r"})
        plain = post(f"{u}/v1/locks/jobs/a/-/acquire", {"ttl": 30, "owner": "w2"}).json()
        server.stop()
        log = server.log_path.read_text()
    if fmt == "json":
        messages = [json.loads(ln)["message"] for ln in log.splitlines() if ln.startswith("{")]
    else:
        messages = [ln.partition(" fenced.server: ")[2] for ln in log.splitlines()]
    lines = [_logfmt(m) for m in messages if m.startswith(("granted ", "released "))]
    assert lines == [
        ("granted", {"lock": "x=1", "token": "1", "owner": forged}),
        ("released", {"lock": "x=1", "token": "1", "owner": forged}),
        ("granted", {"lock": "jobs/a", "token": str(plain["token"]).split(":")[-1], "owner": "w2"}),
    ], lines
    assert "granted lock=jobs/a token=1 owner=w2" in messages  # (bare where it can be)


# -- expiry bookkeeping ----------------------------------------------------------------------------


def _expired(server: FencedServer, lock: str) -> list[dict[str, object]]:
    events = get(f"{server.url}/v1/dashboard").json()["events"]
    return [e for e in events if e["lock"] == lock and e["event"] == "expired"]


def test_an_expiry_of_a_grant_resumed_here_names_its_holder(any_source: str) -> None:
    """A holder renews through a gateway that did not make its grant (here: the same gateway,
    killed with SIGKILL and started again), then dies: the expiry is counted once and shown
    naming the holder, as for a grant made here. (A resumed grant had no description in the
    gateway's table: the "expired" transition said nobody, and so did a "released" one.) The
    holder that keeps renewing through the restarted gateway is not counted."""
    server = FencedServer(any_source)
    with server:
        _resumed_expiry(server, uuid.uuid4().hex)


def _resumed_expiry(server: FencedServer, tag: str) -> None:
    u = f"{server.url}/v1/locks"
    # (6 s, granted and renewed: the grants must outlive the restart, which took over 4 s at
    # load 20; renewed for the same 6 s, because SQLite keeps the later of two ends — and a
    # gateway whose sweep finds the lease held past the ttl it renewed for forgets it as
    # renewed elsewhere, never counting its end)
    dead = post(f"{u}/{tag}/dead/-/acquire", {"ttl": 6, "request_id": "d", "owner": "victim"})
    live = post(f"{u}/{tag}/live/-/acquire", {"ttl": 6, "request_id": "l", "owner": "keeper"})
    given = post(f"{u}/{tag}/given/-/acquire", {"ttl": 30, "request_id": "g", "owner": "giver"})
    server.restart(kill=True)
    r = post(f"{u}/{tag}/given/-/release", {"token": given.json()["token"], "request_id": "g"})
    assert r.json() == {"released": True}, r.text
    events = get(f"{server.url}/v1/dashboard").json()["events"]
    assert [e["owner"] for e in events if e["lock"] == f"{tag}/given"] == ["giver"], events
    for lock, rid, grant in (("dead", "d", dead.json()), ("live", "l", live.json())):
        r = post(
            f"{u}/{tag}/{lock}/-/renew", {"token": grant["token"], "request_id": rid, "ttl": 6}
        )
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 20
    while not _expired(server, f"{tag}/dead"):  # (the sweep: about a second after the end)
        assert time.monotonic() < deadline, get(f"{server.url}/v1/dashboard").json()["events"]
        r = post(
            f"{u}/{tag}/live/-/renew", {"token": live.json()["token"], "request_id": "l", "ttl": 6}
        )
        assert r.status_code == 200, r.text
        time.sleep(0.3)  # (the holder's renewal rhythm, not a wait for the server)
    [event] = _expired(server, f"{tag}/dead")
    assert event["owner"] == "victim", event
    assert _expired(server, f"{tag}/live") == []
    text = get(f"{server.url}/metrics").text
    assert "fenced_expiries_total 1.0" in text, text


@pytest.fixture(params=["sqlite", "redis", "postgresql", "etcd"])
def shared_source(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Every source on which a grant moves between gateways. (Not ZooKeeper: a grant lives
    in the session of the gateway that made it, and another gateway's renewal is refused
    410 — only the gateway that made a grant ever tracks it, so only it counts its expiry.
    Not memory://: one process's.)"""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'locks.db'}"
    if request.param == "postgresql":
        return str(request.getfixturevalue("pg_dsn"))
    server = request.getfixturevalue(f"{request.param}_server")
    if server.proc is None:  # (a failed test left the session's server down)
        server.start()
    return str(server.url)


def test_one_expiry_after_a_renewal_through_another_gateway_is_counted_once(
    shared_source: str,
) -> None:
    """Two gateways on one source. A holder takes a lock through A, renews it once through B
    (its client moved: A did not answer for a moment) and dies. Its one expiry was counted by
    B, the gateway that last had it — and by A too, whose sweep found the grant gone. Now each
    claims the expiry at the source (compare-and-set on a record) and only the one the source
    lets claim it counts it. The other side: a holder that moved the same way and keeps
    renewing through B is never counted, A's sweep leaves its lease alone, and its renewals
    through either gateway are accepted."""
    a, b = FencedServer(shared_source), FencedServer(shared_source)
    tag = uuid.uuid4().hex[:8]
    moved, kept = f"moved-{tag}", f"kept-{tag}"
    with a, b:
        g = post(f"{a.url}/v1/locks/{moved}/-/acquire", {"ttl": 2, "request_id": "m"}).json()
        k = post(f"{a.url}/v1/locks/{kept}/-/acquire", {"ttl": 2, "request_id": "k"}).json()
        lease_k = {"token": k["token"], "request_id": "k", "ttl": 2}
        r = post(
            f"{b.url}/v1/locks/{moved}/-/renew", {"token": g["token"], "request_id": "m", "ttl": 2}
        )
        assert r.status_code == 200, r.text

        def sample(s: FencedServer, name: str) -> float:
            text = get(f"{s.url}/metrics").text
            return float(text.split(f"\n{name} ")[1].split()[0])

        def expiries() -> list[float]:
            return [sample(s, "fenced_expiries_total") for s in (a, b)]

        deadline = time.monotonic() + 30
        # Until both sweeps have settled the dead grant (claimed and counted it, or found
        # another gateway's claim) and A's has forgotten the live one (renewed through B):
        # A tracks nothing, B only the live grant, and the expiry is counted.
        while (
            sample(a, "fenced_leases_tracked") or sample(b, "fenced_leases_tracked") != 1
        ) or sum(expiries()) < 1:
            assert time.monotonic() < deadline, expiries()
            r = post(f"{b.url}/v1/locks/{kept}/-/renew", lease_k)  # (the live holder's rhythm)
            assert r.status_code == 200, r.text
            time.sleep(0.3)
        for _ in range(5):  # (a second count would come within a sweep's turn: none does)
            assert sum(expiries()) == 1, expiries()
            r = post(f"{b.url}/v1/locks/{kept}/-/renew", lease_k)
            assert r.status_code == 200, r.text
            time.sleep(0.3)
        events = [
            e
            for s in (a, b)
            for e in get(f"{s.url}/v1/dashboard").json()["events"]
            if e["event"] == "expired"
        ]
        assert [e["lock"] for e in events] == [moved], events
        # The live one: held, and renewed through either gateway.
        for s in (a, b):
            r = post(f"{s.url}/v1/locks/{kept}/-/renew", lease_k)
            assert r.status_code == 200, r.text
        assert get(f"{a.url}/v1/locks/{kept}").json()["token"] == k["token"]
        r = post(f"{a.url}/v1/locks/{kept}/-/release", {"token": k["token"], "request_id": "k"})
        assert r.json() == {"released": True}
        assert sum(expiries()) == 1


def test_on_zookeeper_a_grant_stays_with_its_gateway_and_its_expiry_is_counted_once(
    zk_server: ZooKeeperServer,
) -> None:
    """ZooKeeper, left out above: a grant lives in the session of the gateway that made it, so
    a renewal through another gateway is refused (410, the grant untouched) and only the
    gateway that made it tracks it: its holder's death is counted once, by that gateway."""
    if zk_server.proc is None:
        zk_server.start()
    a, b = FencedServer(zk_server.url), FencedServer(zk_server.url)
    name = f"zk-{uuid.uuid4().hex[:8]}"
    with a, b:
        g = post(f"{a.url}/v1/locks/{name}/-/acquire", {"ttl": 2, "request_id": "z"}).json()
        lease = {"token": g["token"], "request_id": "z", "ttl": 2}
        assert post(f"{b.url}/v1/locks/{name}/-/renew", lease).status_code == 410
        assert post(f"{a.url}/v1/locks/{name}/-/renew", lease).status_code == 200

        def count(s: FencedServer) -> float:
            return samples_of(get(f"{s.url}/metrics").text)["fenced_expiries_total"]

        deadline = time.monotonic() + 30
        while count(a) < 1:  # (the holder died: A's sweep finds it ended)
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert (count(a), count(b)) == (1, 0)


# -- a keyless server and the web pages its operator opens ------------------------------------


def test_without_keys_a_page_of_another_site_cannot_take_or_free_a_lock(
    server: FencedServer,
) -> None:
    """A web page may send a "simple" cross-site POST (text/plain, no preflight) to
    127.0.0.1: the browser names the page's origin and sends it, with the server's own
    address as its Host — past the DNS-rebinding rule — and the server read the body as
    JSON: the page took locks and force-released them (unread answers, done deeds). Now a
    request whose Origin is another site is refused (403), nothing changed; the server's
    own page (same origin), and clients that send no Origin (curl, the libraries), are
    served. Shown with httpx and with a real Chromium."""
    u, port = server.url, server.port
    held = post(f"{u}/v1/locks/mine/-/acquire", {"ttl": 60, "request_id": "m"})
    assert held.status_code == 200
    simple = {"content-type": "text/plain;charset=UTF-8"}
    for origin in ("http://evil.example", "null", f"http://localhost:{port}", "http://127.0.0.1"):
        h = {**simple, "origin": origin}
        for path, body in (("taken/-/acquire", b'{"ttl": 600}'), ("mine/-/force-release", b"{}")):
            r = httpx.post(f"{u}/v1/locks/{path}", content=body, headers=h, timeout=10, verify=TLS)
            assert r.status_code == 403 and r.json()["error"] == "forbidden", (origin, r.text)
    assert get(f"{u}/v1/locks").json()["locks"] == ["mine"]  # nothing taken
    assert get(f"{u}/v1/locks/mine").json()["token"] == "mine:1"  # nothing freed
    # The server's own page (its origin), and a client that sends no Origin: served.
    own = {**simple, "origin": f"http://127.0.0.1:{port}"}
    r = httpx.post(
        f"{u}/v1/locks/own/-/acquire", content=b"{}", headers=own, timeout=10, verify=TLS
    )
    assert r.status_code == 200, r.text
    assert post(f"{u}/v1/locks/plain/-/acquire", {}).status_code == 200
    # A real browser: a page of origin localhost:PORT (another origin than 127.0.0.1:PORT)
    # posts to 127.0.0.1 as any site could; refused. The dashboard itself still works.
    from tests.cdp import Browser

    with Browser(1280, 800) as b:
        b.call("Page.navigate", url=f"http://localhost:{port}/favicon.ico")
        b.wait_for("document.readyState === 'complete'")
        b.js(
            f"fetch('http://127.0.0.1:{port}/v1/locks/csrf/-/acquire', {{method: 'POST', "
            "mode: 'no-cors', body: '{\"ttl\": 600}'}).then(() => 1, () => 0)"
        )
        assert "csrf" not in get(f"{u}/v1/locks").json()["locks"]
        b.go(f"{u}/")
        b.wait_for("document.body.innerText.includes('mine')")


async def test_without_keys_on_any_address_a_page_of_another_site_is_refused(
    tmp_path: Path,
) -> None:
    """``--insecure-no-auth`` on a LAN address has no Host rule (any name may reach it), but
    a browser on that LAN opening a page of another site would still send its simple
    cross-site POST: the Origin rule holds there too (``same_origin_only``, which `fenced
    serve` sets whenever it has no keys); a client with no Origin, or the server's own
    page, is served."""
    from fenced.server import ServerSettings, create_app

    app = create_app(
        ServerSettings(url=f"sqlite:///{tmp_path / 'locks.db'}", same_origin_only=True)
    )
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://10.1.2.3:7400") as client,
    ):
        simple = {"content-type": "text/plain;charset=UTF-8"}
        foreign = {**simple, "origin": "http://evil.example"}
        r = await client.post("/v1/locks/a/-/acquire", content=b"{}", headers=foreign)
        assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
        assert (await client.get("/v1/locks/a")).json()["token"] is None  # nothing taken
        own = {**simple, "origin": "http://10.1.2.3:7400"}
        r = await client.post("/v1/locks/a/-/acquire", content=b"{}", headers=own)
        assert r.status_code == 200, r.text
        assert (await client.post("/v1/locks/b/-/acquire", json={})).status_code == 200
