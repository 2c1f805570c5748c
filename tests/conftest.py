"""Fixtures that give tests real servers: one per pytest worker, started on first use."""

from __future__ import annotations

# First, before any test module imports gRPC (aetcd): gRPC's fork support off, as fenced's
# etcd support sets it, so the test servers this process forks cannot crash before exec.
import fenced._clients.grpc  # isort: skip

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import fenced
from fenced.backends.memory import MemoryBackend
from fenced.testing.servers import (
    EtcdServer,
    MariaDBServer,
    MotoServer,
    PostgresServer,
    RedisServer,
    ZooKeeperServer,
)
from tests.helpers import NO_TLS, aws_client, dead_port, unique_name

_PYCACHE: list[str] = []  # the bytecode cache this run made (pytest_configure), removed at exit
_TEMPLATES: list[str] = []  # the run's server data templates (pytest_configure), removed at exit


def pytest_configure(config: pytest.Config) -> None:
    # (xdist registers it; the warm-up's collection runs without xdist, and with
    # --strict-markers the groups set below failed it at its end, after the imports it is for)
    config.addinivalue_line("markers", "xdist_group(name): run these tests on one xdist worker")
    # xdist's loadgroup hands out work units largest group first unless told not to; the
    # order below (pytest_collection_modifyitems) is the one wanted, so it is kept as it is.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    # With bytecode writing off (PYTHONDONTWRITEBYTECODE, set in some CI images) every Python
    # process the suite starts (`fenced` commands, campaign workers, gateways)
    # compiled fenced from source: 80-100 ms of CPU each. Their bytecode goes to one private
    # cache for the run instead (made here, in the first process; inherited by the xdist
    # workers and every child), outside the tree, and is removed at the end.
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        _PYCACHE.append(tempfile.mkdtemp(prefix="fenced-test-pycache-"))  # (mode 700)
        os.environ["PYTHONPYCACHEPREFIX"] = _PYCACHE[0]
        del os.environ["PYTHONDONTWRITEBYTECODE"]
    # One initdb and one mariadb-install-db for the run, copied for each new server
    # (fenced.testing.servers._from_template); made here, in the first process, so that the
    # workers and every child share it. (0o711: the servers' users reach their templates.)
    if not os.environ.get("FENCED_TEST_TEMPLATES"):
        _TEMPLATES.append(tempfile.mkdtemp(prefix="fenced-test-templates-"))
        os.chmod(_TEMPLATES[0], 0o711)
        os.environ["FENCED_TEST_TEMPLATES"] = _TEMPLATES[0]
    _warm_bytecode(config)


def _warm_bytecode(config: pytest.Config) -> None:
    """Before xdist's workers start, collect the tests once in a few processes, so that the
    bytecode of what the tests import and pytest's rewritten test modules are in the cache
    when the workers look. Each worker compiled them all itself, at the same moment as the
    others: 12 of its 19 s of CPU before its first test, in a fresh clone."""
    if (
        not getattr(config.option, "numprocesses", None)
        or hasattr(config, "workerinput")
        or config.option.collectonly
        or os.environ.get("FENCED_TEST_WARMED")
    ):
        return
    os.environ["FENCED_TEST_WARMED"] = "1"  # (inherited: the workers and the warm-up skip it)
    paths: list[str] = []
    for arg in config.args:
        path = arg.split("::")[0]
        if os.path.isdir(path):
            paths += sorted(os.path.join(path, name) for name in os.listdir(path))
        else:
            paths.append(path)
    paths = [p for p in paths if os.path.isdir(p) or p.endswith(".py")]
    jobs = min(len(paths), os.cpu_count() or 1, 4)
    if jobs < 1:
        return
    groups = [paths[i::jobs] for i in range(jobs)]
    cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:xdist"]
    cmd += ["-p", "no:cacheprovider", "--rootdir", str(config.rootpath)]
    procs = [
        subprocess.Popen([*cmd, *group], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for group in groups
    ]
    for proc in procs:  # (a warm-up that fails or hangs costs only the time: the workers
        try:  # compile what it did not)
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _PYCACHE + _TEMPLATES:
        shutil.rmtree(path, ignore_errors=True)


# The units that took 8-131 s (session 8: each area run alone at load ~5, per-test walls),
# handed out first like the ones marked ``slow`` (see pytest_collection_modifyitems); a name
# that no longer matches only loses its place at the front. (The simulator's seed parts,
# first until session 7, now take 2-3 s each.)
LONG_TESTS = (  # (longest first: the order they are handed out in)
    "tests/partitions/test_campaigns.py::",  # (the netns group: 15 tests, 131 s)
    "tests/replicated/test_group_faults.py::",  # (a group: 8 tests, 54 s)
    "tests/powerloss/test_sqlite_source.py::test_fenced_serve_",
    "tests/server/test_server_gateways.py::test_",
    "tests/server/test_server_schema.py::test_the_document_and_the_server_agree",
    "tests/kit/test_check_inventory.py::test_each_bug_of_the_users_service_is_caught",
    "tests/server/test_server_clients.py::test_a_holder_keeps_its_lease_through_a_gateway_restart",
    "tests/guards/test_guard_sql.py::test_pg_restart_keeps_mark",
    "tests/cli/test_elect_failover.py::test_a_poison_pill_stops_a_leader",
    "tests/server/test_server_dashboard.py::test_a_lease_the_source_freed_before",
    "tests/guards/test_guard_sql.py::test_racing_processes_commit_tokens_in_order",
    "tests/guards/test_guard_dynamodb.py::test_racing_processes_commit_tokens_in_order",
    "tests/kit/test_check_campaign.py::test_the_report_renders_the_run_and_its_verdict",
    "tests/kit/test_check_campaign.py::test_a_campaign_with_pauses_and_kills",
)


def _rank(item: pytest.Item) -> int:
    """Where ``item`` is handed out among the long ones: its place in LONG_TESTS, then the
    other tests marked ``slow``; -1 for the rest."""
    for i, prefix in enumerate(LONG_TESTS):
        if item.nodeid.startswith(prefix):
            return i
    return len(LONG_TESTS) if item.get_closest_marker("slow") is not None else -1


def _unit(item: pytest.Item) -> str:
    """The xdist work unit of ``item`` under ``--dist loadgroup``: its xdist_group names
    joined as xdist joins them, or the test itself."""
    names = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args})
    return "_".join(names) if names else item.nodeid


def _module_fixture_group(item: pytest.Item) -> str | None:
    """``module:<file>`` if ``item`` uses a module-scoped fixture of its own test module (a
    ``fenced serve``, a Chromium, a PostgreSQL, a campaign's history): the module's tests that
    share it then run on one worker, which starts it once. Handed out one by one, they ran on
    4-6 of the 6 workers, each starting it again (a replay of the hand-out)."""
    info = getattr(item, "_fixtureinfo", None)  # (pytest's, stable since pytest 3)
    if info is None:
        return None
    module = item.nodeid.split("::")[0]
    for name in info.names_closure:
        for fixture in info.name2fixturedefs.get(name, ()):
            if fixture.scope in ("module", "package") and fixture.baseid == module:
                return f"module:{module}"
    return None


def pytest_itemcollected(item: pytest.Item) -> None:
    """The xdist group of ``item``, set as it is collected: xdist's worker reads the groups in
    its own ``pytest_collection_modifyitems``, which runs before this file's (``trylast``: the
    order below must be the last word), so groups set there came too late (session 8: the
    MySQL regrouping and the source groups set in that hook were not seen by xdist).

    A test run once per source or guard environment (an ``env`` parameter) joins that
    environment's group (one worker starts its servers); the guard suites' MySQL environments
    all join test_guard_mysql.py's group (MariaDB, 6-9 s to start under load and the heaviest
    server, then runs on one worker). Any other test in no group that uses a module-scoped
    fixture of its module joins that module's group (:func:`_module_fixture_group`). The guard
    environments on moto and every test that uses ``moto_server`` join the ``moto`` group."""
    callspec = getattr(item, "callspec", None)
    env = callspec.params.get("env") if callspec is not None else None
    if isinstance(env, str):
        guards = "/guards/" in item.nodeid
        name = f"source-{env}"
        if guards and env.endswith("-mysql"):
            name = "mariadb"
        elif guards and env in _MOTO_ENVS:
            name = "moto"
        item.add_marker(pytest.mark.xdist_group(name))
    elif not any(True for _ in item.iter_markers("xdist_group")):
        group = _module_fixture_group(item)
        if "moto_server" in getattr(item, "fixturenames", ()):
            group = "moto"
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


# The guard environments on moto's server: with every test that uses moto, in the "moto"
# group (one worker starts the emulator, 0.5-0.7 s of CPU, not each of the six).
_MOTO_ENVS = frozenset({"dynamodb", "s3", "dynamodb-async", "s3-async"})


def _mark_units_for_xdist(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``@group`` suffix xdist's ``loadgroup`` reads from each grouped test's id, set
    where xdist's own setting did not take: xdist 3.8 writes ``item._nodeid``, and pytest 9
    keeps the id in ``item._id`` (pytest-dev/pytest-xdist#1386). Without it every group was
    handed out test by test (session 10: the moto group's tests on five workers, five
    emulators; each source group's servers started on every worker). A no-op where xdist's
    own suffix is there (pytest 8), and outside an xdist worker."""
    if not getattr(config.option, "loadgroup", False) or not hasattr(config, "workerinput"):
        return
    for item in items:
        names = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args})
        if not names:
            continue
        suffix = "@" + "_".join(names)
        if item.nodeid.endswith(suffix):
            continue
        if hasattr(item, "_id"):  # (pytest 9: a structured id; parse keeps the string as is)
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(item.nodeid + suffix)
        else:
            item._nodeid = item.nodeid + suffix  # type: ignore[attr-defined]


@pytest.hookimpl(trylast=True)  # (the order: after every other plugin's)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the run for ``pytest -n N --dist loadgroup`` (the groups: pytest_itemcollected):
    the work units (an xdist group, or a single test) in the order xdist hands them out
    (its own reordering off, pytest_configure): units holding a test marked ``slow`` or
    listed in LONG_TESTS first (the partition lab's group, the group nemesis, campaigns, kills
    and schema tests), then groups largest first, then single tests in collection order.
    Longest first: a long unit handed out last ran on one worker while the others idled.
    """
    units = [_unit(item) for item in items]
    size: dict[str, int] = {}
    first: dict[str, int] = {}
    rank: dict[str, int] = {}
    for i, (item, unit) in enumerate(zip(items, units, strict=True)):
        size[unit] = size.get(unit, 0) + 1
        first.setdefault(unit, i)
        r = _rank(item)
        if r >= 0:
            rank[unit] = min(rank.get(unit, r), r)
    order = {id(item): i for i, item in enumerate(items)}
    key = {
        id(item): (
            rank.get(unit, len(LONG_TESTS) + 1),
            -size[unit] if size[unit] > 1 else 0,
            first[unit],
        )
        for item, unit in zip(items, units, strict=True)
    }
    items.sort(key=lambda item: (*key[id(item)], order[id(item)]))
    _mark_units_for_xdist(config, items)


@pytest.fixture
def register_scheme(request: pytest.FixtureRequest) -> Callable[[str, str], None]:
    """Register a token source for a URL scheme for one test (fenced.register_backend)."""

    def register(scheme: str, target: str) -> None:
        request.addfinalizer(fenced.register_backend(scheme, target))

    return register


@pytest.fixture(params=["fast", "portable"])
def portal_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test runs twice: with the sync API's portal in its fast mode (callers drive the
    loop, on CPython's asyncio internals) and forced into its portable mode (public asyncio
    only), through ``FENCED_PORTAL`` as a user would."""
    from fenced._core import portal_fast as _portal_fast

    monkeypatch.setenv("FENCED_PORTAL", request.param)
    if request.param == "fast":
        assert _portal_fast.available(), "this Python's asyncio lacks what the fast mode needs"
    return str(request.param)


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt during the test, even in a run started with SIGINT
    ignored (`make test &` in a script, some CI runners), which would otherwise swallow the
    Ctrl-C a test sends itself. Restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield  # (the tests that need it skip off the main thread)
        return
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture
def lock_name() -> str:
    return unique_name("lock")


@pytest.fixture
def memory_url() -> Iterator[str]:
    name = unique_name("mem")
    yield f"memory://{name}"
    MemoryBackend.reset(name)


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A loopback port that refuses connections throughout the test (tests.helpers.dead_port:
    held, so no other worker's server can start on it meanwhile)."""
    with dead_port() as port:
        yield port


@pytest.fixture
def sqlite_url(tmp_path: object) -> str:
    return f"sqlite:///{tmp_path}/locks.db"


@pytest.fixture(scope="session")
def http_gateways() -> Iterator[dict[str, Any]]:
    """The worker's ``fenced serve`` gateways of the http_* conformance sources, by inner
    source name (tests/sources/envs/_http.py makes them on first use); all killed at the end."""
    gateways: dict[str, Any] = {}
    yield gateways
    for env in gateways.values():
        env.gateway.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server  # type: ignore[misc]


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server  # type: ignore[misc]


@pytest.fixture(scope="session")
def zk_server() -> Iterator[ZooKeeperServer]:
    with ZooKeeperServer() as server:
        yield server  # type: ignore[misc]


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server  # type: ignore[misc]


@pytest.fixture(scope="session")
def mariadb_server() -> Iterator[MariaDBServer]:
    with MariaDBServer() as server:
        yield server  # type: ignore[misc]


@pytest.fixture
def mysql_db(mariadb_server: MariaDBServer) -> Iterator[dict[str, object]]:
    """A fresh database on the worker's MariaDB server (PyMySQL connect arguments, TLS off:
    tests.helpers.NO_TLS; asyncmy_args() for asyncmy), dropped afterwards."""
    import pymysql

    db = unique_name("db").replace("-", "_")
    args: dict[str, object] = {"host": "127.0.0.1", "port": mariadb_server.port, "user": "root"}
    args.update(NO_TLS)
    with pymysql.connect(**args, autocommit=True) as conn:  # type: ignore[arg-type]
        conn.cursor().execute(f"CREATE DATABASE {db}")
    yield {**args, "database": db}
    with pymysql.connect(**args, autocommit=True) as conn:  # type: ignore[arg-type]
        conn.cursor().execute(f"DROP DATABASE IF EXISTS {db}")


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """moto's server mode: the DynamoDB/S3 emulator (no real AWS here)."""
    with MotoServer() as server:
        yield server  # type: ignore[misc]


@pytest.fixture
def dynamodb_table(moto_server: MotoServer) -> Iterator[tuple[object, str]]:
    """A boto3 DynamoDB client on the emulator and a fresh table (hash key ``pk``, a string)."""
    client = aws_client("dynamodb", moto_server.url)
    table = unique_name("t")
    client.create_table(
        TableName=table,
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    yield client, table
    client.delete_table(TableName=table)


@pytest.fixture
def s3_bucket(moto_server: MotoServer) -> Iterator[tuple[object, str]]:
    """A boto3 S3 client on the emulator and a fresh bucket."""
    client = aws_client("s3", moto_server.url)
    bucket = unique_name("b").lower().replace("_", "-")
    client.create_bucket(Bucket=bucket)
    yield client, bucket


# Databases emptied after a test, for the next test of this worker to take (per server port).
# PostgreSQL 15 makes a database by writing the template's ~7 MB through its WAL with fsync
# on: a CREATE + DROP cost ~70 ms of the server's CPU and ~0.4 s of fsync waits, in each of
# some 500 tests; emptying one (its sessions ended, its schemas dropped) costs a third.
_PG_EMPTY: dict[int, list[str]] = {}


def _pg_empty_again(server: PostgresServer, db: str) -> bool:
    """Return ``db`` to the state CREATE DATABASE gives (no session, only an empty
    ``public`` schema, no per-database settings), or False (then it is dropped instead)."""
    import psycopg

    # One session, in the database itself (a backend costs the server ~12 ms of CPU to start:
    # a second one, from the server's own database, only to end the test's sessions, was one
    # too many in each of some 500 tests). A database a session cannot use (a test made it
    # refuse connections, or read-only) raises here: then it is dropped instead.
    url = f"postgresql://postgres@127.0.0.1:{server.port}/{db}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (db,),
        )
        leftovers = conn.execute(
            "SELECT (SELECT count(*) FROM pg_db_role_setting s JOIN pg_database d"
            "        ON s.setdatabase = d.oid WHERE d.datname = %s)"
            " + (SELECT count(*) FROM pg_prepared_xacts WHERE database = %s)",
            (db, db),
        ).fetchone()
        if leftovers is None or leftovers[0]:
            return False
        schemas = conn.execute(
            "SELECT nspname FROM pg_namespace"
            " WHERE nspname NOT LIKE 'pg\\_%' AND nspname <> 'information_schema'"
        ).fetchall()
        for (name,) in schemas:
            conn.execute(f'DROP SCHEMA "{name}" CASCADE')
        conn.execute("CREATE SCHEMA public")
        conn.execute("GRANT ALL ON SCHEMA public TO PUBLIC")
        # As DROP DATABASE did: a checkpoint, so that a later test's kill -9 of the server
        # replays only its own WAL (without, its crash recovery replayed every earlier test's
        # and took longer than the 5 s lease test_reconnects_after_server_restart holds).
        conn.execute("CHECKPOINT")
        # (anything the schemas do not hold, e.g. an extension's objects, refuses reuse)
        extensions = conn.execute("SELECT count(*) FROM pg_extension WHERE extname <> 'plpgsql'")
        row = extensions.fetchone()
        return row is not None and row[0] == 0


@pytest.fixture
def pg_dsn(pg_server: PostgresServer) -> Iterator[str]:
    """An empty database on the worker's PostgreSQL server, as fresh as a new one (an earlier
    test's, emptied, or a new one), emptied or dropped afterwards."""
    import psycopg

    pool = _PG_EMPTY.setdefault(pg_server.port, [])
    if pool:
        db = pool.pop()
    else:
        db = unique_name("db").replace("-", "_")
        with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {db}")
    yield f"postgresql://postgres@127.0.0.1:{pg_server.port}/{db}"
    try:
        reusable = _pg_empty_again(pg_server, db)
    except psycopg.Error:
        reusable = False
    if reusable:
        pool.append(db)
        return
    with psycopg.connect(pg_server.dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
