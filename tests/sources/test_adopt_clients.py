"""A token source opened from a client the application already has, instead of a URL: fenced
connects where the client points, and every safety check of the source still runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
import redis.asyncio
from kazoo.client import KazooClient

import fenced
from fenced._core.adopt import adopt_client
from fenced.testing.servers import PostgresServer, RedisServer, ZooKeeperServer
from tests.helpers import unique_name


def test_a_redis_client_is_a_token_source_with_its_checks(redis_server: RedisServer) -> None:
    name = unique_name()
    client = redis.Redis(port=redis_server.port, db=2)
    with fenced.connect(client) as locks, locks.lock(name, ttl=5) as lease:
        first = lease.token
    # The same server and database as the URL names: one counter.
    with fenced.connect(f"redis://127.0.0.1:{redis_server.port}/2") as by_url:
        with by_url.lock(name, ttl=5) as lease:
            assert lease.token.value == first.value + 1
    client.close()


def test_a_redis_client_of_an_unsafe_server_is_refused_like_its_url() -> None:
    with RedisServer() as server:
        client = redis.Redis(port=server.port)
        client.config_set("appendonly", "no")
        with pytest.raises(fenced.UnsafeBackendError, match="appendonly"):
            fenced.connect(client)
        client.close()


async def test_an_asyncio_redis_client_for_the_asyncio_api(redis_server: RedisServer) -> None:
    client = redis.asyncio.Redis(port=redis_server.port, password=None)
    async with fenced.connect_async(client) as locks, locks.lock(unique_name(), ttl=5) as lease:
        assert lease.token.value == 1
    await client.aclose()


def test_a_psycopg_connection_tcp_and_unix_socket(pg_server: PostgresServer, pg_dsn: str) -> None:
    name = unique_name()
    with psycopg.connect(pg_dsn) as conn, fenced.connect(conn) as locks:
        with locks.lock(name, ttl=5) as lease:
            assert lease.token.value == 1
    db = pg_dsn.rsplit("/", 1)[1]
    with psycopg.connect(
        host=str(pg_server.dir), port=pg_server.port, user="postgres", dbname=db
    ) as conn:
        url, _ = adopt_client(conn)
        assert url.startswith("postgresql://postgres@%2F")  # the socket directory, encoded
        with fenced.connect(conn) as locks, locks.lock(name, ttl=5) as lease:
            assert lease.token.value == 2  # the same database


def test_credentials_are_carried_but_never_shown() -> None:
    client = redis.Redis(host="127.0.0.1", port=1, username="app", password="s3cret p@ss")
    url, options = adopt_client(client)
    assert url == "redis://127.0.0.1:1/0" and options == {
        "username": "app",
        "password": "s3cret p@ss",
    }
    locks = fenced.connect_async(client)
    assert "s3cret" not in repr(locks) and "s3cret" not in locks.url
    client.close()


def test_a_kazoo_client(zk_server: ZooKeeperServer) -> None:
    client = KazooClient(hosts=zk_server.hosts + "/adopted")
    with fenced.connect(client) as locks, locks.lock(unique_name(), ttl=5) as lease:
        assert lease.token.value > 0
    assert adopt_client(client)[0] == f"zookeeper://{zk_server.hosts}/adopted"


def test_an_aetcd_client(etcd_server: Any) -> None:
    import aetcd

    client = aetcd.Client(host="127.0.0.1", port=int(etcd_server.endpoint.rsplit(":", 1)[1]))
    with fenced.connect(client) as locks, locks.lock(unique_name(), ttl=5) as lease:
        assert lease.token.value > 0
    with pytest.raises(fenced.ConfigurationError, match="authenticate"):
        fenced.connect(aetcd.Client(host="127.0.0.1", username="u", password="p"))


@pytest.mark.parametrize("thing", [object(), Path("/tmp"), 42])
def test_anything_else_is_a_configuration_error(thing: Any) -> None:
    with pytest.raises(fenced.ConfigurationError, match="give a URL"):
        fenced.connect(thing)


def test_a_redis_cluster_client_is_refused() -> None:
    cluster = redis.RedisCluster.__new__(redis.RedisCluster)  # (no server needed to be refused)
    with pytest.raises(fenced.ConfigurationError, match="Cluster"):
        adopt_client(cluster)
