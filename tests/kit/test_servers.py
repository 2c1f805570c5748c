"""The test servers themselves: a port taken between choosing it and binding it is survived.

(A CI run lost a 3-member etcd cluster to this: member e3's peer port was taken by another
process, and the start waited 30 s for a member that had already exited.)
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fenced.testing import servers
from fenced.testing.servers import EtcdCluster, RedisServer


def test_starting_a_running_server_again_leaves_one_process() -> None:
    # Two tests once started a server inside ``with Server() as s`` (which had started it):
    # the first process was left running after the test, one Redis and one MariaDB a CI run.
    with RedisServer() as server:
        assert server.proc is not None
        first = server.proc.pid
        server.start()
        assert server.proc.pid == first
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)  # stopped with the rest


@contextmanager
def a_taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _first_port_taken(monkeypatch: pytest.MonkeyPatch, taken: int, how_many: int = 1) -> None:
    real = servers.free_port
    handed = {"n": 0}

    def free_port() -> int:
        handed["n"] += 1
        return taken if handed["n"] <= how_many else real()

    monkeypatch.setattr(servers, "free_port", free_port)


def test_a_server_whose_port_was_taken_starts_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    with a_taken_port() as taken:
        _first_port_taken(monkeypatch, taken)
        started = time.monotonic()
        with RedisServer() as server:
            assert server.port != taken
        assert time.monotonic() - started < 20  # no 30 s wait for a process that had exited


def test_an_etcd_cluster_whose_peer_port_was_taken_starts_anyway(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with a_taken_port() as taken:
        _first_port_taken(monkeypatch, taken)  # the first peer port handed out
        with EtcdCluster() as cluster:
            assert taken not in [m.peer_port for m in cluster.members]
            assert cluster.url.startswith("etcd://")


def test_mariadb_starts_on_loopback_and_keeps_committed_rows_across_kill_9() -> None:
    """The MariaDB the MySQL guard (issue 16) will be tested on: a temp datadir, a free port,
    loopback only, and InnoDB's durable commits — a committed row survives kill -9."""
    import pymysql

    from fenced.testing.servers import MariaDBServer

    with MariaDBServer() as db:

        def connect() -> pymysql.connections.Connection:
            return pymysql.connect(host="127.0.0.1", port=db.port, user="root", database="fenced")

        conn = connect()
        with conn.cursor() as cur:
            cur.execute("CREATE TABLE t (k INT PRIMARY KEY, v TEXT) ENGINE=InnoDB")
            cur.execute("INSERT INTO t VALUES (1, 'committed')")
            cur.execute("SELECT @@bind_address")
            assert cur.fetchone() == ("127.0.0.1",)
        conn.commit()
        conn.close()
        db.restart(kill=True)
        conn = connect()
        with conn.cursor() as cur:
            cur.execute("SELECT v FROM t WHERE k = 1")
            assert cur.fetchone() == ("committed",)
        conn.close()
