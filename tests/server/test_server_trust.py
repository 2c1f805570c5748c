"""Trust gaps of ``fenced serve`` (session 9): with signing on, a grant is renewed and released
only with its signed token; fenced's own names at the source are not the clients'; another
tenant's key on every route. Real ``fenced serve`` processes on SQLite, requests over real
sockets on both lanes (a body whole with its head: the direct lane; chunked: the app)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import fenced
from fenced._core.errors import ConfigurationError
from fenced._core.state import check_request_id
from fenced.server._gateway import claim_record
from fenced.testing.servers import FencedServer
from tests.helpers import TLS, forged, wait_for
from tests.server.test_server_attack5 import _post

A, B, OPS = "secret-aaaaaaaaaaaaaaaa", "secret-bbbbbbbbbbbbbbbb", "secret-oooooooooooooooo"


def _signing_key(tmp_path: Path) -> Path:
    key = tmp_path / "sign.key"
    subprocess.run(
        [sys.executable, "-m", "fenced", "keygen", "ed25519", "k1", str(key)],
        check=True,
        capture_output=True,
    )
    return key


def _keys_file(tmp_path: Path, b_prefixes: str = '""') -> Path:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[[keys]]\nid = "a"\nsecret = "{A}"\nverbs = ["acquire", "check"]\nprefixes = [""]\n'
        f'[[keys]]\nid = "b"\nsecret = "{B}"\nverbs = ["acquire", "check"]\n'
        f"prefixes = [{b_prefixes}]\n"
        f'[[keys]]\nid = "ops"\nsecret = "{OPS}"\nverbs = ["admin"]\n'
    )
    return keys


class _Client:
    """Requests as one client (its key's headers, or none) to one server, on one lane."""

    def __init__(self, server: FencedServer, chunked: bool, secret: str | None) -> None:
        self.server, self.chunked = server, chunked
        self.headers = {"host": "127.0.0.1"}
        if secret is not None:
            self.headers["authorization"] = f"Bearer {secret}"

    def post(self, path: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
        answer = _post(
            self.server.port, path, json.dumps(body).encode(), self.chunked, self.headers
        )
        return int(answer[:3]), json.loads(answer[4:])

    def get(self, path: str) -> tuple[int, dict[str, object]]:
        r = httpx.get(self.server.url + path, headers=self.headers, timeout=30, verify=TLS)
        return r.status_code, r.json()


def _as_request_id(text: object) -> str:
    """``text`` as a request id if it is one, else a request id of its own."""
    try:
        return check_request_id(str(text))
    except ConfigurationError:
        return "not-the-holder"


@pytest.fixture(params=["keyless", "keyed"])
def signing_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FencedServer]:
    args = ["--signing-key", str(_signing_key(tmp_path)), "--source-id", "prod"]
    if request.param == "keyed":
        args += ["--api-keys", str(_keys_file(tmp_path))]
    with FencedServer(f"sqlite:///{tmp_path / 'l.db'}", args=args) as server:
        yield server  # type: ignore[misc]


@pytest.mark.parametrize("chunked", [False, True], ids=["direct", "app"])
def test_with_signing_a_reader_of_the_status_cannot_renew_or_release_the_grant(
    signing_server: FencedServer, chunked: bool
) -> None:
    """Signing on: a client that reads the lock's status (its token, its holder) and sends
    them to renew or release is refused — the plain token 400 ``invalid_token`` naming what to
    send, the holder shown never being a request id it could re-acquire the signed token
    with — and the grant is unchanged; the holder's renewal and release with its signed token
    are served. (Keyed: the other key may read and acquire every lock.)"""
    keyed = "--api-keys" in signing_server.args
    holder = _Client(signing_server, chunked, A if keyed else None)
    reader = _Client(signing_server, chunked, B if keyed else None)
    status, grant = holder.post("/v1/locks/inv/-/acquire", {"ttl": 30})
    assert status == 200 and grant["signed"], grant
    rid, signed = str(grant["request_id"]), str(grant["signed"])

    status, seen = reader.get("/v1/locks/inv")
    assert status == 200 and seen["token"] == grant["token"]
    assert seen["holder"] != rid and rid not in json.dumps(seen)
    # Even knowing the request id (leaked, guessed), the token it can read does not serve.
    for verb in ("renew", "release"):
        status, answer = reader.post(
            f"/v1/locks/inv/-/{verb}", {"token": seen["token"], "request_id": rid}
        )
        assert status == 400 and answer["error"] == "invalid_token", answer
        assert "signed" in str(answer["message"]), answer
    # The holder shown is no request id: asking for it hands out no grant (nor its token).
    status, answer = reader.post(
        "/v1/locks/inv/-/acquire", {"request_id": _as_request_id(seen["holder"]), "ttl": 5}
    )
    assert status == 409, answer
    after = reader.get("/v1/locks/inv")[1]
    assert {**after, "remaining": 0} == {**seen, "remaining": 0}  # (nothing changed)

    # The plain token is refused from the holder too: it says what to send.
    status, answer = holder.post(
        "/v1/locks/inv/-/renew", {"token": grant["token"], "request_id": rid}
    )
    assert status == 400 and "'signed'" in str(answer["message"]), answer
    status, answer = holder.post("/v1/locks/inv/-/renew", {"token": signed, "request_id": rid})
    assert status == 200, answer
    status, answer = holder.post("/v1/locks/inv/-/release", {"token": signed, "request_id": rid})
    assert (status, answer) == (200, {"released": True})
    assert holder.get("/v1/locks/inv")[1]["held"] is False


def test_without_signing_a_keyless_status_still_shows_the_request_id(tmp_path: Path) -> None:
    """No signing, no keys (every client one principal, on loopback): the holder shown is the
    request id and the plain token renews, as documented."""
    with FencedServer(f"sqlite:///{tmp_path / 'l.db'}") as server:
        c = _Client(server, False, None)
        _, grant = c.post("/v1/locks/inv/-/acquire", {"ttl": 30, "request_id": "job-1"})
        assert c.get("/v1/locks/inv")[1]["holder"] == "job-1"
        body = {"token": grant["token"], "request_id": "job-1"}
        assert c.post("/v1/locks/inv/-/renew", body)[0] == 200


def _renewed(server: FencedServer, secret: str | None) -> float:
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    text = httpx.get(f"{server.url}/metrics", headers=headers, timeout=30, verify=TLS).text
    for line in text.splitlines():
        if line.startswith('fenced_renewals_total{result="ok"}'):
            return float(line.split()[1])
    return 0.0


def test_the_python_http_source_renews_and_releases_on_a_server_that_signs(
    signing_server: FencedServer,
) -> None:
    """``fenced.connect("http://...")`` against a signing server: its lease's token is the
    signed form, which its renewals and its release send (the plain one would be refused)."""
    keyed = "--api-keys" in signing_server.args
    admin = OPS if keyed else None  # (the metrics' reader)
    options = {"api_key": A} if keyed else {}
    with fenced.connect(signing_server.url, **options) as locks:
        with locks.lock("py", ttl=1.0) as lease:
            assert str(lease.token).startswith("py:1.prod.k1.")
            before = _renewed(signing_server, admin)
            wait_for(lambda: _renewed(signing_server, admin) >= before + 2, 20, "two renewals")
            assert lease.held
        assert locks.status("py").token is None


# -- fenced's own names at the source --------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["direct", "app"])
@pytest.mark.parametrize("keyed", [False, True], ids=["keyless", "keyed"])
def test_fenced_s_own_names_are_no_client_s_locks_or_records(
    tmp_path: Path, chunked: bool, keyed: bool
) -> None:
    """``_fenced-`` names are the server's (the expiry claims, ``_fenced-expired/<hex>``; the
    readiness look): an acquire, renewal, release or record swap there — by a key allowed
    every name — is 403 ``forbidden`` in one line, nothing created or changed; the claim
    record the server wrote is still readable; names beside the namespace are served."""
    args = ["--api-keys", str(_keys_file(tmp_path))] if keyed else []
    with FencedServer(f"sqlite:///{tmp_path / 'l.db'}", args=args) as server:
        c = _Client(server, chunked, B if keyed else None)  # (b: every name, acquire + check)
        # A grant that expires: the gateway claims its expiry in its record (the sweep).
        assert c.post("/v1/locks/x/-/acquire", {"ttl": 0.2})[0] == 200
        claims = "/v1/records/" + claim_record("x")
        wait_for(lambda: c.get(claims)[1]["version"] == 1, 30, "the expiry claimed")
        record = c.get(claims)[1]
        assert json.loads(str(record["value"])) == [1]

        for name in (claim_record("x"), "_fenced-expired/x", "_fenced-ready", "_fenced-a/b"):
            for verb, body in (
                ("acquire", {"ttl": 5}),
                ("renew", {"token": f"{name}:1", "request_id": "r"}),
                ("release", {"token": f"{name}:1", "request_id": "r"}),
            ):
                status, answer = c.post(f"/v1/locks/{name}/-/{verb}", body)
                assert status == 403 and answer["error"] == "forbidden", (name, verb, answer)
                assert "_fenced-" in str(answer["message"]) and "\n" not in str(answer["message"])
            status, answer = c.post(
                f"/v1/records/{name}/-/swap", {"version": 1 if name in claims else 0, "value": "[]"}
            )
            assert status == 403 and answer["error"] == "forbidden", (name, answer)
        assert c.get(claims)[1] == record  # (unchanged, still readable)
        assert not [n for n in c.get("/v1/locks")[1]["locks"] if n.startswith("_fenced-")]

        paths = httpx.get(f"{server.url}/openapi.json", timeout=30, verify=TLS).json()["paths"]
        for path, refused in (
            ("/v1/locks/{name}/-/acquire", True),
            ("/v1/records/{name}/-/swap", True),
            ("/v1/locks/{name}", keyed),
        ):  # (the document says so, keys or not)
            assert ("403" in next(iter(paths[path].values()))["responses"]) is refused, path

        for name in ("fenced-expired/x", "_fenced_expired/x", "_fenced", "a/_fenced-x"):
            status, grant = c.post(f"/v1/locks/{name}/-/acquire", {"ttl": 5})
            assert status == 200, (name, grant)
            body = {"token": grant["token"], "request_id": grant["request_id"]}
            assert c.post(f"/v1/locks/{name}/-/renew", body)[0] == 200
            assert c.post(f"/v1/locks/{name}/-/release", body) == (200, {"released": True})
            assert c.post(f"/v1/records/{name}/-/swap", {"version": 0, "value": "v"})[0] == 200


@pytest.mark.parametrize("kind", ["fenced.elect/", "group/"])
def test_a_record_named_after_a_lock_is_that_lock_s_keys(tmp_path: Path, kind: str) -> None:
    """The records fenced keeps for a lock — an election's last leader (``fenced.elect/X``,
    whose pids and hosts the next leader's fence command kills) and a replicated group's
    configuration (``group/X``) — are read and swapped with the rights on X: a key of
    ``reports/`` keeps those of ``reports/nightly``; a key of the records' prefixes alone
    (``fenced.elect/``, ``group/``) neither reads nor swaps them."""
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[[keys]]\nid = "reports"\nsecret = "{A}"\nverbs = ["acquire"]\n'
        'prefixes = ["reports/"]\n'
        f'[[keys]]\nid = "records"\nsecret = "{B}"\nverbs = ["acquire", "check"]\n'
        'prefixes = ["fenced.elect/", "group/"]\n'
    )
    with FencedServer(f"sqlite:///{tmp_path / 'l.db'}", args=["--api-keys", str(keys)]) as s:
        owner, other = _Client(s, False, A), _Client(s, False, B)
        path = f"/v1/records/{kind}reports/nightly"
        assert other.post(f"{path}/-/swap", {"version": 0, "value": "theirs"})[0] == 403
        assert other.get(path)[0] == 403
        assert owner.post(f"{path}/-/swap", {"version": 0, "value": "mine"})[0] == 200
        assert owner.get(path) == (200, {"name": path[12:], "version": 1, "value": "mine"})
        assert other.post(f"{path}/-/swap", {"version": 1, "value": "theirs"})[0] == 403
        assert owner.get(path)[1]["value"] == "mine"  # (unchanged)
        # A record of the other key's own lock names: its own.
        theirs = f"/v1/records/{kind}group/x"
        assert other.post(f"{theirs}/-/swap", {"version": 0, "value": "v"})[0] == 200
        assert owner.post(f"{theirs}/-/swap", {"version": 1, "value": "w"})[0] == 403


# -- another tenant's key on every route ---------------------------------------------------------


def _checks(server: FencedServer, result: str) -> float:
    text = httpx.get(
        f"{server.url}/metrics", headers={"authorization": f"Bearer {OPS}"}, verify=TLS
    ).text
    for line in text.splitlines():
        if line.startswith(f'fenced_checks_total{{result="{result}"}}'):
            return float(line.split()[1])
    return 0.0


def test_a_check_of_another_tenant_s_token_is_refused_before_it_is_judged(
    tmp_path: Path,
) -> None:
    """``/v1/check`` authorizes before it verifies: another tenant's key (``b``: check on
    ``b/``) sending a token of ``a/x`` — well signed or forged — is 403 either way (no oracle
    of which tokens of a lock it may not see are good), and counts no check; the rightful key's
    check of the same tokens is judged (current; forged 400, counted invalid)."""
    keys = tmp_path / "keys.toml"
    keys.write_text(
        f'[[keys]]\nid = "a"\nsecret = "{A}"\nverbs = ["acquire", "check"]\nprefixes = ["a/"]\n'
        f'[[keys]]\nid = "b"\nsecret = "{B}"\nverbs = ["check"]\nprefixes = ["b/"]\n'
        f'[[keys]]\nid = "ops"\nsecret = "{OPS}"\nverbs = ["admin"]\n'
    )
    args = ["--api-keys", str(keys), "--signing-key", str(_signing_key(tmp_path))]
    with FencedServer(f"sqlite:///{tmp_path / 'l.db'}", args=args) as server:
        a, b = _Client(server, False, A), _Client(server, False, B)
        signed = str(a.post("/v1/locks/a/x/-/acquire", {"ttl": 30})[1]["signed"])
        bad = forged(signed)
        for token in (signed, bad, "a/x:1"):
            status, answer = b.post("/v1/check", {"token": token})
            assert status == 403 and answer["error"] == "forbidden", (token, answer)
        assert _checks(server, "invalid") == 0
        assert a.post("/v1/check", {"token": signed})[1]["verdict"] == "current"
        status, answer = a.post("/v1/check", {"token": bad})
        assert status == 400 and answer["error"] == "invalid_token", answer
        assert _checks(server, "invalid") == 1
        status, answer = b.post("/v1/check", {"token": "not a token"})
        assert status == 400 and answer["error"] == "invalid_token", answer  # (names no lock)


@pytest.mark.parametrize("trusted", [False, True], ids=["default", "forwarded-allow-ips"])
def test_a_local_client_cannot_claim_another_address_unless_its_proxy_is_named(
    tmp_path: Path, trusted: bool
) -> None:
    """uvicorn believes ``X-Forwarded-For`` from 127.0.0.1 unless told otherwise: any local
    process could then name itself any client, be described as it, and get past
    ``--max-waiting-per-client`` with a new address each time. By default `fenced serve`
    believes no one: the owner is the peer, and a second waiting acquire of one peer is
    refused 429 whatever address it names; with ``--forwarded-allow-ips`` the named proxy's
    word is taken (the owner is the forwarded client)."""
    args = ["--max-waiting-per-client", "1"]
    if trusted:
        args += ["--forwarded-allow-ips", "127.0.0.1"]
    with FencedServer(f"sqlite:///{tmp_path / 'x.db'}", args=args) as server:
        url = server.url
        held = httpx.post(
            f"{url}/v1/locks/x/-/acquire",
            json={"ttl": 30},
            headers={"X-Forwarded-For": "10.9.8.7"},
            verify=TLS,
        )
        assert held.status_code == 200
        owner = httpx.get(f"{url}/v1/locks/x", verify=TLS).json()["owner"]
        assert owner == ("http client 10.9.8.7" if trusted else "http client 127.0.0.1")
        with httpx.Client(timeout=10) as one, httpx.Client(timeout=10) as two:
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                first = pool.submit(
                    one.post,
                    f"{url}/v1/locks/x/-/acquire",
                    json={"ttl": 5, "timeout": 3},
                    headers={"X-Forwarded-For": "10.0.0.1"},
                )
                wait_for(lambda: httpx.get(f"{url}/v1/locks/x", verify=TLS).json()["waiters"] == 1)
                second = two.post(
                    f"{url}/v1/locks/x/-/acquire",
                    json={"ttl": 5, "timeout": 1},
                    headers={"X-Forwarded-For": "10.0.0.2"},
                )
                # Trusted: another client, who waits its second and times out (409);
                # believed from no one: the same peer past its bound (429).
                assert second.status_code == (409 if trusted else 429), second.text
                assert first.result().status_code == 409
