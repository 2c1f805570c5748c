"""``fenced serve``: a grant belongs to the key that made it; routes mean one thing for every
valid name; integers have ranges; expiries are counted; what a client without a key sees.

Real ``fenced serve`` processes on real sources; plain HTTP requests (httpx).
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import fenced
from fenced.testing.servers import FencedServer
from tests.helpers import TLS, wait_for
from tests.server.gateway import get, post, write_keys

ALICE, BOB, OPS = (
    "fk_alice_secret_00000000000000",
    "fk_bob_secret_0000000000000000",
    "fk_ops_secret_0000000000000000",
)


def _keys(tmp_path: Path) -> Path:
    return write_keys(
        tmp_path / "keys.toml",
        [
            {"id": "alice", "secret": ALICE, "prefixes": ["shared/"], "verbs": ["acquire"]},
            {"id": "bob", "secret": BOB, "prefixes": ["shared/"], "verbs": ["acquire"]},
            {"id": "ops", "secret": OPS, "verbs": ["admin"]},
        ],
    )


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FencedServer]:
    """One ``fenced serve`` for the tests that only ask it things under names of their own (a
    gateway's start-up costs a second of CPU); a test that counts expiries has its own."""
    db = tmp_path_factory.mktemp("grants") / "locks.db"
    with FencedServer(f"sqlite:///{db}") as s:
        yield s  # type: ignore[misc]


_NAMES = itertools.count(1)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FencedServer]:
    """One ``fenced serve`` with alice's, bob's and ops's keys for the module's two tests of
    keys on one gateway (only one of them takes a lock: ``shared/job``)."""
    base = tmp_path_factory.mktemp("keyed")
    with FencedServer(f"sqlite:///{base / 'locks.db'}", args=["--api-keys", str(_keys(base))]) as s:
        yield s  # type: ignore[misc]


# -- a grant belongs to the key that made it ---------------------------------------------------


def test_another_keys_request_id_never_reaches_her_grant_and_changes_nothing(
    keyed: FencedServer,
) -> None:
    """Bug: bob read alice's request id from the status (holder), re-acquired with it (200,
    her grant and token), released her grant (released: true), and alice's next renewal got
    410. Now every use of another key's id is answered as an unknown id's (409, 410,
    released false: no oracle either; tests/server/test_server_request_id_oracle.py),
    nothing changes, and alice holds on."""
    u = keyed.url
    lock = f"{u}/v1/locks/shared/job"
    got = post(f"{lock}/-/acquire", {"ttl": 60, "request_id": "job-1"}, ALICE).json()
    assert got["token"] == "shared/job:1" and got["request_id"] == "job-1"
    lease = {"token": got["token"], "request_id": "job-1"}
    # bob reads the status: the holder's description, never alice's request id
    seen = get(lock, BOB).json()
    assert seen["held"] and seen["holder"] != "job-1" and "job-1" not in str(seen)
    assert seen["holder"].startswith("alice:")
    assert get(lock, ALICE).json()["holder"] == "job-1"  # alice sees her own
    # bob's every use of alice's id: refused as an unknown id, on the new paths and the old
    for path in ("/-/acquire", "/acquire"):
        for body in ({"request_id": "job-1"}, {"request_id": "job-1", "timeout": 0.2}):
            r = post(lock + path, body, BOB)
            assert r.status_code == 409 and r.json()["error"] == "timeout", (path, r.text)
    for verb, answer in (("renew", 410), ("release", 200)):
        for body in (lease, {"token": got["token"], "lease_id": "job-1"}):
            r = post(f"{lock}/-/{verb}", body, BOB)
            assert r.status_code == answer, (verb, r.text)
            assert verb == "renew" or r.json() == {"released": False}, r.text
    assert post(f"{lock}/-/force-release", None, BOB).status_code == 403
    # nothing changed: alice's grant is live, her renewal is accepted, the token is hers
    after = get(lock, ALICE).json()
    assert after["token"] == "shared/job:1" and after["holder"] == "job-1"
    assert after["last_token"] == "shared/job:1"  # no second grant was made
    assert post(f"{lock}/-/renew", lease, ALICE).status_code == 200
    again = post(f"{lock}/-/acquire", {"request_id": "job-1"}, ALICE).json()
    assert again["token"] == "shared/job:1"  # her own retry: the same grant
    # the watch and the dashboard data show bob no request id either
    with httpx.stream(
        "GET", f"{lock}/-/watch", headers={"authorization": f"Bearer {BOB}"}, timeout=30, verify=TLS
    ) as stream:
        first = next(line for line in stream.iter_lines() if line.startswith("data:"))
    assert "job-1" not in first and '"held":true' in first
    assert "job-1" not in get(f"{u}/v1/dashboard", BOB).text
    assert "job-1" not in get(f"{u}/v1/dashboard", OPS).text  # an admin is another key too
    # the rightful holder releases; bob then takes the lock under his own id, with a new token
    assert post(f"{lock}/-/release", lease, ALICE).json() == {"released": True}
    bob = post(f"{lock}/-/acquire", {"request_id": "job-1"}, BOB).json()
    assert bob["token"] == "shared/job:2" and bob["request_id"] == "job-1"
    assert (
        post(f"{lock}/-/renew", {"token": bob["token"], "request_id": "job-1"}, ALICE).status_code
        == 410
    )
    assert get(lock, BOB).json()["holder"] == "job-1"


def test_the_binding_holds_across_gateways_sharing_one_source(source: str, tmp_path: Path) -> None:
    """A grant made through one gateway is out of another key's reach on a second gateway (the
    binding is in the grant at the source, not in one process's memory): answered as an
    unknown id's, the grant untouched."""
    keys = str(_keys(tmp_path))
    a = FencedServer(source, args=["--api-keys", keys])
    b = FencedServer(source, args=["--api-keys", keys])
    with a, b:
        got = post(f"{a.url}/v1/locks/shared/x/-/acquire", {"ttl": 60, "request_id": "r"}, ALICE)
        lease = {"token": got.json()["token"], "request_id": "r"}
        for verb, answer in (("renew", 410), ("release", 200)):
            r = post(f"{b.url}/v1/locks/shared/x/-/{verb}", lease, BOB)
            assert r.status_code == answer, r.text
        assert post(f"{b.url}/v1/locks/shared/x/-/renew", lease, ALICE).status_code == 200
        assert post(f"{b.url}/v1/locks/shared/x/-/release", lease, ALICE).json()["released"]


def test_server_made_request_ids_are_random(shared: FencedServer) -> None:
    """Bug: one prefix per process and a counter: one id told the next. Now 128 random bits."""
    ids = [post(f"{shared.url}/v1/locks/ids/r{i}/-/acquire").json()["request_id"] for i in range(3)]
    assert len({i[:16] for i in ids}) == 3 and all(len(i) == 32 for i in ids), ids


# -- routes: one meaning for every valid name ---------------------------------------------------


def test_a_lock_named_like_an_action_has_its_status_and_actions(shared: FencedServer) -> None:
    """Bug: GET /v1/locks/jobs/watch was the event stream of "jobs", so lock "jobs/watch"
    could not be read (the http:// source timed out on it); GET /v1/locks/foo/acquire was
    the status of "foo/acquire"."""
    u = shared.url
    with fenced.connect(f"http://{u.removeprefix('http://')}") as locks:
        for name in ("jobs/watch", "foo/acquire", "a/renew/release"):
            with locks.lock(name, ttl=30) as lease:
                status = locks.status(name)
                assert status.token == lease.token, name
            assert locks.status(name).token is None
    direct = get(f"{u}/v1/locks/jobs/watch")
    assert direct.status_code == 200 and direct.json()["name"] == "jobs/watch"
    wrong = get(f"{u}/v1/locks/foo/-/acquire")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert post(f"{u}/v1/locks/foo").status_code == 405
    assert post(f"{u}/v1/locks/foo").headers["allow"] == "GET"
    with httpx.stream("GET", f"{u}/v1/locks/jobs/-/watch", timeout=30, verify=TLS) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in stream.iter_lines() if line.startswith("data:"))
    assert '"name":"jobs"' in first


# -- integers: a range each, 400 outside it ----------------------------------------------------


@pytest.mark.parametrize(
    "version,status",
    [
        (2**63, 400),
        (2**64 + 5, 400),
        (-1, 400),
        (1.5, 400),
        (True, 400),
        ("0", 400),
        (0.0, 200),  # (JSON has one number type: 0.0 is the integer 0)
    ],
)
def test_a_record_version_outside_its_range_is_400_and_writes_nothing(
    shared: FencedServer, version: object, status: int
) -> None:
    """Bug: version 2^63 answered a plain-text 500 (SQLite's OverflowError)."""
    n = next(_NAMES)  # (records of this case only: the server is the module's)
    r = post(f"{shared.url}/v1/records/r{n}/-/swap", {"version": version, "value": "v"})
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"] == "invalid_request"
        assert get(f"{shared.url}/v1/records/r{n}").json()["version"] == 0
    # at the top of the range: a conflict (the record is not there), never a 5xx
    top = post(f"{shared.url}/v1/records/top{n}/-/swap", {"version": 2**63 - 1, "value": "v"})
    assert top.status_code == 409


@pytest.mark.parametrize("value", ["9223372036854775808", "9999999999999999999"])
def test_a_token_value_over_the_range_is_400_everywhere(shared: FencedServer, value: str) -> None:
    u, lock = shared.url, f"t{next(_NAMES)}"
    token = f"{lock}:{value}"
    for path, body in (
        ("/v1/check", {"token": token}),
        (f"/v1/locks/{lock}/-/renew", {"token": token, "request_id": "r"}),
        (f"/v1/locks/{lock}/-/release", {"token": token, "request_id": "r"}),
        (f"/v1/locks/{lock}/-/force-release", {"token": token}),
    ):
        r = post(u + path, body)
        assert r.status_code == 400, (path, r.text)
    assert lock not in get(f"{u}/v1/locks").json()["locks"]  # nothing made
    assert get(f"{u}/v1/locks/{lock}").json()["last_token"] is None


# -- expiries: counted and shown ----------------------------------------------------------------


def _metric(u: str, name: str) -> float:
    for line in get(f"{u}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(name)


def test_an_abandoned_lease_is_counted_and_shown_as_expired_once(server: FencedServer) -> None:
    """Bug: a holder that stopped renewing left fenced_expiries_total at 0 and no "expired"
    transition, while a second release of a released grant counted one."""
    u = server.url
    g = post(f"{u}/v1/locks/gone/-/acquire", {"ttl": 0.5, "request_id": "g"}).json()
    wait_for(lambda: _metric(u, "fenced_expiries_total") == 1, 20, "the expiry to be counted")
    events = get(f"{u}/v1/dashboard").json()["events"]
    assert [e["event"] for e in events if e["lock"] == "gone"] == ["expired", "granted"]
    # a late renewal and release of it find it gone: counted as lost, not as a second expiry
    lease = {"token": g["token"], "request_id": "g"}
    assert post(f"{u}/v1/locks/gone/-/renew", lease).status_code == 410
    assert post(f"{u}/v1/locks/gone/-/release", lease).json() == {"released": False}
    # a released grant, released again: not an expiry
    h = post(f"{u}/v1/locks/kept/-/acquire", {"ttl": 60, "request_id": "h"}).json()
    done = {"token": h["token"], "request_id": "h"}
    assert post(f"{u}/v1/locks/kept/-/release", done).json() == {"released": True}
    assert post(f"{u}/v1/locks/kept/-/release", done).json() == {"released": False}
    assert _metric(u, "fenced_expiries_total") == 1


def test_a_lease_renewed_through_another_gateway_is_not_counted_as_expired(
    source: str,
) -> None:
    """The sweep forgets a grant renewed elsewhere silently: it asks the source. (A ttl of 3
    s renewed every 0.25 s: a loaded machine's stall of a second must not end the lease for
    real, which would be an expiry rightly counted.)"""
    a, b = FencedServer(source), FencedServer(source)
    with a, b:
        g = post(f"{a.url}/v1/locks/moved/-/acquire", {"ttl": 3, "request_id": "m"}).json()
        lease = {"token": g["token"], "request_id": "m", "ttl": 3}
        stop = threading.Event()

        def keep() -> None:
            while not stop.wait(0.25):
                post(f"{b.url}/v1/locks/moved/-/renew", lease)

        t = threading.Thread(target=keep)
        t.start()
        try:
            wait_for(lambda: _metric(a.url, "fenced_leases_tracked") == 0, 20, "a's sweep")
            assert _metric(a.url, "fenced_expiries_total") == 0
        finally:
            stop.set()
            t.join()


# -- without a key ------------------------------------------------------------------------------


def test_a_client_without_a_key_sees_only_liveness_and_readiness(keyed: FencedServer) -> None:
    """Bug: /v1/info (version, source, signing key id) answered anyone, and /v1/ready asked
    the source on every call. Now: info needs a key; ready says yes or no, from one look a
    second."""
    u = keyed.url
    assert get(f"{u}/v1/info").status_code == 401
    info = get(f"{u}/v1/info", BOB).json()
    assert info["version"] == fenced.__version__ and info["auth"] is True
    assert get(f"{u}/v1/health").json() == {"status": "ok"}
    answers = [get(f"{u}/v1/ready") for _ in range(20)]
    assert all(r.json() == {"status": "ready"} for r in answers)
    doc = get(f"{u}/openapi.json").json()
    assert doc["info"]["version"] == "1" and fenced.__version__ not in str(doc["info"])


def test_readiness_asks_the_source_at_most_once_a_second(tmp_path: Path) -> None:
    """Anyone may ask /v1/ready: 40 asks in a burst are one or two looks at the source
    (Redis's own command count says so), not 40."""
    import redis

    from fenced.testing.servers import RedisServer

    rs = RedisServer()
    with rs:
        s = FencedServer(rs.url)
        with s, redis.Redis(port=rs.port) as r:

            def commands() -> int:
                stats = r.info("commandstats")
                return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")

            with httpx.Client(base_url=s.url, timeout=30) as client:
                assert client.get("/v1/ready").status_code == 200
                before, start = commands(), time.monotonic()
                for _ in range(40):
                    assert client.get("/v1/ready").status_code == 200
                seconds = time.monotonic() - start
            # A look is 3-4 commands: one a second (and one more at either end), where each
            # ask looking would be 120 or more.
            assert commands() - before <= 4 * (seconds + 2), seconds


# -- never_granted: one definition -------------------------------------------------------------


def test_never_granted_is_one_thing_in_the_server_the_library_and_the_cli(
    server: FencedServer, source: str
) -> None:
    """Bug: /v1/check said never_granted false for a lock that never existed, and true for a
    token above the highest grant of an existing one. Now both are never granted, in
    /v1/check, locks.check() and `fenced check-token` alike; real grants are not."""
    import subprocess
    import sys

    u = server.url
    post(f"{u}/v1/locks/real/-/acquire", {"request_id": "x"})
    cases = {"nowhere:1": True, "real:2": True, "real:1": False}
    with fenced.connect(source) as locks, fenced.connect(u) as remote:
        for token, never in cases.items():
            answer = post(f"{u}/v1/check", {"token": token}).json()
            assert answer["never_granted"] is never, (token, answer)
            assert (answer["verdict"] == "never_granted") is never
            assert locks.check(token).never_granted is never, token
            assert remote.check(token).never_granted is never, token  # (the http:// source)
            cli = subprocess.run(
                [sys.executable, "-m", "fenced", "check-token", "--url", source, token],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert (cli.returncode == 65) is never and ("never-granted" in cli.stdout) is never, (
                token,
                cli.stdout,
                cli.stderr,
            )


@pytest.fixture(params=["sqlite", "redis", "postgresql"])
def shared_source(request: pytest.FixtureRequest, source: str) -> str:
    """A source two gateways share: every kind that keeps a grant's ttl."""
    if request.param == "sqlite":
        return source
    if request.param == "redis":
        return str(request.getfixturevalue("redis_server").url)
    return str(request.getfixturevalue("pg_dsn"))


def test_a_renewal_without_a_ttl_keeps_the_grants_own_through_any_gateway(
    shared_source: str,
) -> None:
    """Bug: a renewal without a ttl through another gateway than the grant's renewed it for
    that gateway's --default-ttl (here 3 s: the holder of a 60 s grant would lose it 3 s
    later). It keeps the grant's own ttl, as the source keeps it; an explicit ttl is that
    ttl, through either gateway (the grant's own gateway ignored it: its table's ttl)."""
    a = FencedServer(shared_source, args=["--default-ttl", "60"])
    b = FencedServer(shared_source, args=["--default-ttl", "3"])
    n = secrets.token_hex(4)  # (a shared server: a name of its own)
    with a, b:
        got = post(f"{a.url}/v1/locks/ttl/{n}/-/acquire", {"request_id": "r"}).json()
        assert got["ttl"] == 60
        lease = {"token": got["token"], "request_id": "r"}
        renewed = post(f"{b.url}/v1/locks/ttl/{n}/-/renew", lease).json()
        assert renewed["ttl"] == 60 and renewed["expires_in"] > 30, renewed
        assert get(f"{a.url}/v1/locks/ttl/{n}").json()["remaining"] > 30
        # (through the grant's own gateway too, now that the other one renewed it)
        assert post(f"{a.url}/v1/locks/ttl/{n}/-/renew", lease).json()["ttl"] == 60
        # an explicit ttl: that ttl, through either gateway (a renewal never shortens a
        # lease at the source: longer ones), and kept by the next renewal there
        for gw, ttl in ((a, 90), (b, 120)):
            r = post(f"{gw.url}/v1/locks/ttl/{n}/-/renew", {**lease, "ttl": ttl}).json()
            assert r["ttl"] == ttl and r["expires_in"] > ttl - 10, (gw.url, r)
            assert get(f"{gw.url}/v1/locks/ttl/{n}").json()["remaining"] > ttl - 10
        assert post(f"{b.url}/v1/locks/ttl/{n}/-/renew", lease).json()["ttl"] == 120
        # the rightful release through the other gateway still goes through
        assert post(f"{b.url}/v1/locks/ttl/{n}/-/release", lease).json()["released"]


def test_a_gateway_over_another_renews_a_resumed_grant_for_its_own_ttl(source: str) -> None:
    """The same through a gateway whose source is another gateway (``http://``): resuming a
    grant made elsewhere, it renewed it for its own --default-ttl; now for the grant's."""
    with FencedServer(source, args=["--default-ttl", "60"]) as a:
        with FencedServer(a.url, args=["--default-ttl", "3"]) as b:
            got = post(f"{a.url}/v1/locks/jobs/y/-/acquire", {"request_id": "r"}).json()
            lease = {"token": got["token"], "request_id": "r"}
            renewed = post(f"{b.url}/v1/locks/jobs/y/-/renew", lease).json()
            assert renewed["ttl"] == 60 and renewed["expires_in"] > 30, renewed
            assert get(f"{a.url}/v1/locks/jobs/y").json()["remaining"] > 30
            r = post(f"{b.url}/v1/locks/jobs/y/-/renew", {**lease, "ttl": 90}).json()
            assert r["ttl"] == 90 and get(f"{a.url}/v1/locks/jobs/y").json()["remaining"] > 80
            assert post(f"{b.url}/v1/locks/jobs/y/-/release", lease).json()["released"]
