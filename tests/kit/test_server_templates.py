"""A run's PostgreSQL and MariaDB servers copy one bootstrap (``FENCED_TEST_TEMPLATES``,
made by tests/conftest.py): one initdb / mariadb-install-db a run, not one a server (0.4-0.7 s
of CPU each), and each copy is a server of its own, as durable as one bootstrapped alone."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fenced.testing.servers import MariaDBServer, PostgresServer


@pytest.fixture
def templates(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="fenced-test-templates-"))
    os.chmod(root, 0o711)  # (the servers' users reach their templates)
    monkeypatch.setenv("FENCED_TEST_TEMPLATES", str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _sql(server: Any) -> Callable[[str], list[tuple[Any, ...]]]:
    """Run one statement on ``server`` (autocommit) and return its rows."""

    def run(statement: str) -> list[tuple[Any, ...]]:
        if isinstance(server, PostgresServer):
            import psycopg

            with psycopg.connect(server.dsn, autocommit=True) as conn:
                cur = conn.execute(statement)
                return list(cur.fetchall()) if cur.description else []
        import pymysql

        conn = pymysql.connect(
            host="127.0.0.1", port=server.port, user="root", database="fenced", autocommit=True
        )
        try:
            with conn.cursor() as cur:
                cur.execute(statement)
                return list(cur.fetchall())
        finally:
            conn.close()

    return run


@pytest.mark.parametrize(
    ("cls", "bootstrap"), [(PostgresServer, "_initdb"), (MariaDBServer, "_install_db")]
)
def test_the_servers_of_a_run_copy_one_bootstrap_and_stay_apart(
    templates: Path, monkeypatch: pytest.MonkeyPatch, cls: type[Any], bootstrap: str
) -> None:
    made: list[Path] = []
    real = getattr(cls, bootstrap)

    def counted(self: Any, data: Path) -> None:
        made.append(data)
        real(self, data)

    monkeypatch.setattr(cls, bootstrap, counted)
    with cls() as first, cls() as second:
        assert len(made) == 1 and made[0].is_relative_to(templates), made
        _sql(first)("CREATE TABLE kept (v INT)")
        _sql(first)("INSERT INTO kept VALUES (7)")
        # apart: the second server's copy has none of what the first wrote
        with pytest.raises(Exception, match="kept"):
            _sql(second)("SELECT v FROM kept")
        # durable: the copy is a server of its own, its commits survive kill -9
        first.restart(kill=True)
        assert _sql(first)("SELECT v FROM kept") == [(7,)]
    with cls() as third:  # a later server copies the same template: no bootstrap again
        assert len(made) == 1
        assert _sql(third)("SELECT 1") == [(1,)]


def _mapped(pid: int, path: Path) -> bool:
    """Whether process ``pid`` maps the file ``path`` (its /proc maps)."""
    return str(path) in Path(f"/proc/{pid}/maps").read_text()


def test_the_zookeeper_servers_of_a_run_map_one_class_archive(templates: Path) -> None:
    """The run's first ZooKeeper makes the class-data archive (once), and every server maps
    it: each JVM does not load and verify ZooKeeper's classes from the jars again."""
    from fenced.testing.servers import ZooKeeperServer

    with ZooKeeperServer() as first, ZooKeeperServer() as second:
        archive = templates / "zookeeper.jsa"
        assert archive.exists()
        for server in (first, second):
            assert server.proc is not None and _mapped(server.proc.pid, archive)
            assert "-XX:SharedArchiveFile=" + str(archive) in server.command()
        made = archive.stat().st_mtime_ns
    with ZooKeeperServer() as third:  # (made once a run, not again)
        assert archive.stat().st_mtime_ns == made
        assert third.proc is not None and _mapped(third.proc.pid, archive)


def test_a_zookeeper_starts_and_serves_with_an_archive_that_does_not_fit(
    templates: Path,
) -> None:
    """An archive of another JDK (here: garbage bytes) is ignored by the JVM, not fatal:
    the server starts and serves as it would without one."""
    from kazoo.client import KazooClient

    from fenced.testing.servers import ZooKeeperServer

    (templates / "zookeeper.jsa.tried").touch()
    (templates / "zookeeper.jsa").write_bytes(b"not an archive" * 100)
    with ZooKeeperServer() as server:
        assert server.proc is not None and not _mapped(server.proc.pid, templates / "zookeeper.jsa")
        client = KazooClient(hosts=server.hosts)
        client.start(timeout=20)
        try:
            client.create("/written", b"x")
            assert client.get("/written")[0] == b"x"
        finally:
            client.stop()
            client.close()
