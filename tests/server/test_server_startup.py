"""What ``fenced serve`` does at start, every time a supervisor (or the suite) starts one: the
paths from before "/-/" (``POST /v1/locks/{name}/acquire`` ...) are the documented routes'
twins, built once, not a second FastAPI analysis of the same endpoints; and they still answer
as the documented paths do, out of the OpenAPI document."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.routing import APIRoute

import fenced
from fenced.server import ServerSettings, create_app
from fenced.testing.servers import FencedServer
from tests.helpers import TLS


@pytest.fixture(autouse=True)
def _a_real_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    """These are tests of the command's own start-up: each ``fenced serve`` here is a real
    exec, not forked from the suite's fork server (which has imported its modules)."""
    monkeypatch.setenv("FENCED_FORKSERVER", "0")


LEGACY = {
    "/v1/locks/{name:lock}/acquire": "/v1/locks/{name:lock}/-/acquire",
    "/v1/locks/{name:lock}/renew": "/v1/locks/{name:lock}/-/renew",
    "/v1/locks/{name:lock}/release": "/v1/locks/{name:lock}/-/release",
    "/v1/locks/{name:lock}/force-release": "/v1/locks/{name:lock}/-/force-release",
    "/v1/records/{name:lock}/swap": "/v1/records/{name:lock}/-/swap",
}


def test_an_older_path_is_its_documented_routes_twin_not_built_again(tmp_path: Path) -> None:
    app = create_app(ServerSettings(url=f"sqlite:///{tmp_path / 'l.db'}"))
    routes = {r.path: r for r in app.routes if isinstance(r, APIRoute)}
    for old, new in LEGACY.items():
        twin, documented = routes[old], routes[new]
        # (one analysis: the same handler, dependency tree and body model)
        assert twin.app is documented.app, old
        assert twin.dependant is documented.dependant, old
        assert twin.body_field is documented.body_field, old
        assert twin.methods == documented.methods == {"POST"}
        assert not twin.include_in_schema and documented.include_in_schema
    paths = set(app.openapi()["paths"])  # (written "{name}")
    assert {p.replace(":lock", "") for p in LEGACY.values()} <= paths
    assert not {p.replace(":lock", "") for p in LEGACY} & paths


def test_an_older_path_answers_as_the_documented_one(tmp_path: Path) -> None:
    app = create_app(ServerSettings(url=f"sqlite:///{tmp_path / 'l.db'}", max_wait=0.2))

    async def run() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                mine = {"token": "a:1", "request_id": "r-a"}
                old = (
                    await c.post("/v1/locks/a/acquire", json={"ttl": 60, "request_id": "r-a"})
                ).json()
                new = (await c.post("/v1/locks/b/-/acquire", json={"ttl": 60})).json()
                assert set(old) == set(new) and old["token"] == "a:1", (old, new)
                # The guard on both paths: the held lock refuses a second acquire in time...
                busy = await c.post("/v1/locks/a/acquire", json={"ttl": 60, "timeout": 0})
                assert busy.status_code == 409 and busy.json()["error"] == "timeout"
                foreign = {"token": "a:1", "request_id": "someone-else"}
                refused = await c.post("/v1/locks/a/renew", json=foreign)
                assert 400 <= refused.status_code < 500, refused.text
                # ... and the holder's token renews and releases it; then a:2 is granted.
                renewed = await c.post("/v1/locks/a/renew", json=mine)
                assert renewed.status_code == 200, renewed.text
                released = await c.post("/v1/locks/a/release", json=mine)
                assert released.status_code == 200 and released.json()["released"] is True
                again = (await c.post("/v1/locks/a/acquire", json={"ttl": 60})).json()
                assert again["token"] == "a:2"
                bad = await c.post("/v1/locks/a/acquire", json={"ttl": "x"})
                assert bad.status_code == 400 and bad.json()["error"] == "invalid_request"

    asyncio.run(run())


ERRORS = {"400", "408", "413", "503"}  # (401 and 403 too, on a server with keys)
# The writes that refuse fenced's own names (``_fenced-...``) with 403 on any server.
WRITES = ("/-/acquire", "/-/renew", "/-/release", "/-/swap")


def test_the_error_answers_are_built_for_the_document_not_at_start(tmp_path: Path) -> None:
    app = create_app(ServerSettings(url=f"sqlite:///{tmp_path / 'l.db'}"))
    documented = [r for r in app.routes if isinstance(r, APIRoute) and r.include_in_schema]
    # At start: no route carries a field for the error answers (FastAPI built one for each
    # error of each route, used by nothing but the document).
    assert not [r.path for r in documented if 400 in r.response_fields]
    doc = app.openapi()
    assert app.openapi() is doc  # (built once)
    for path, item in doc["paths"].items():
        for method, op in item.items():
            codes = list(op["responses"])
            # (no keys: 401 never said; 403 only where fenced's own names are refused)
            errors = ERRORS | {"403"} if path.endswith(WRITES) else ERRORS
            assert set(codes) >= errors, (method, path, codes)
            assert not ({"401", "403"} - errors) & set(codes), (method, path)
            for code in errors:
                ref = op["responses"][code]["content"]["application/json"]["schema"]
                assert ref == {"$ref": "#/components/schemas/ErrorOut"}, (method, path, code)
            # FastAPI's order: the answer, the errors, then the route's own (409, 429 ...)
            own = [c for c in codes if c not in errors and c != codes[0]]
            assert codes[: 1 + len(errors)] == [codes[0], *sorted(errors)], (path, codes)
            assert codes[1 + len(errors) :] == own
    acquire = doc["paths"]["/v1/locks/{name}/-/acquire"]["post"]["responses"]
    assert acquire["409"]["description"] == "timeout: not granted in time"
    assert "ErrorOut" in doc["components"]["schemas"]


# Run before `fenced serve`'s own code (FencedServer's prelude): counts the cyclic collector's
# runs, notes the count when the server's first module (uvicorn's or fenced.server) is looked
# for, and says the runs since, what is frozen and whether the collector is on when the
# listening socket is bound (after the imports, before the app is built). (No audit hook: a
# Python one, called for every event, doubled the start's CPU.)
_GC_WATCH = """
import gc, socket
_runs = [0, None]
def _count(phase, info):
    if phase == "start":
        _runs[0] += 1
gc.callbacks.append(_count)
class _Mark:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name in ("uvicorn", "fenced.server") and _runs[1] is None:
            _runs[1] = _runs[0]
        return None
sys.meta_path.insert(0, _Mark)
_bind = socket.socket.bind
def _bound(self, address):
    if _runs[1] is not None:
        print(f"gc-watch: {_runs[0] - _runs[1]} runs {gc.get_freeze_count()} frozen"
              f" {gc.isenabled()} enabled", file=sys.stderr, flush=True)
        _runs[1] = None
    return _bind(self, address)
socket.socket.bind = _bound
"""


def test_the_collector_does_not_walk_the_servers_modules_as_they_are_imported(
    tmp_path: Path,
) -> None:
    """The imports of ``fenced serve`` make ~90,000 objects that live as long as the process;
    the cyclic collector ran over a hundred times as they were made (a start took 50-100 ms,
    7-14 %, more CPU) and walked them all again in each later full collection. Now it is off while they are made, and they are
    frozen (out of every later collection) — and it is on again for what the server makes,
    which still serves (a grant, a renewal, a release)."""
    from fenced.testing.servers import FencedServer

    with FencedServer(f"sqlite:///{tmp_path / 'l.db'}", prelude=_GC_WATCH) as server:
        lock = f"{server.url}/v1/locks/gc/-"
        grant = httpx.post(
            f"{lock}/acquire", json={"ttl": 30, "request_id": "r"}, timeout=30, verify=TLS
        )
        assert grant.status_code == 200 and grant.json()["token"] == "gc:1", grant.text
        lease = {"token": "gc:1", "request_id": "r"}
        assert httpx.post(f"{lock}/renew", json=lease, timeout=30, verify=TLS).status_code == 200
        released = httpx.post(f"{lock}/release", json=lease, timeout=30, verify=TLS)
        assert released.json() == {"released": True}
        server.stop()
        log = server.log_path.read_text()
    [line] = [ln for ln in log.splitlines() if ln.startswith("gc-watch: ")]
    _, runs, _, frozen, _, enabled, _ = line.split()
    assert int(runs) == 0, line
    assert int(frozen) > 50_000, line
    assert enabled == "True", line


@pytest.mark.parametrize(
    ("url", "code", "says"),
    [
        ("redis://127.0.0.1:1/0", 69, "token source unavailable: redis at 127.0.0.1:1"),
        ("sqlite:////nonexistent-dir/x.db", 2, "directory /nonexistent-dir"),
    ],
    ids=["unreachable", "bad-path"],
)
def test_a_source_that_cannot_be_opened_is_one_line_and_the_clis_exit_code(
    url: str, code: int, says: str
) -> None:
    """A real ``fenced serve`` whose source cannot be opened ends with fenced's one line and
    exit code (69 unavailable, 2 configuration), not uvicorn's 25-75 line traceback of its
    lifespan and exit 3."""
    serve = ["serve", "--url", url, "--timeout", "1", "--listen", "127.0.0.1:0"]
    r = subprocess.run(
        [sys.executable, "-m", "fenced", *serve],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    failure = [line for line in r.stderr.splitlines() if "Started server process" not in line]
    assert len(failure) == 1 and failure[0].startswith("fenced: ") and says in failure[0], r.stderr


def test_a_source_that_opens_is_served(tmp_path: Path) -> None:
    """The rightful case, the source opened before uvicorn's lifespan (which finds it open)."""
    with (
        FencedServer(f"sqlite:///{tmp_path / 'l.db'}") as server,
        fenced.connect(server.url) as locks,
    ):
        lease = locks.lock("l")
        assert lease.acquire(timeout=5).value == 1
        assert lease.release()
