"""The check kit's TCP proxy (``fenced.testing.proxy``) between fenced and a real Redis: a
partition makes a held lease be lost (renewals cannot get through) while the same server,
reached directly, still answers; healing lets a new grant through; a cut resets connections.
A planted proxy whose partition lets bytes through is caught by the same scenario."""

from __future__ import annotations

import socket
import time

import pytest

import fenced
from fenced.testing.proxy import TcpProxy
from fenced.testing.servers import RedisServer


class LeakyProxy(TcpProxy):
    """Planted: partition() does nothing."""

    def partition(self) -> None:
        pass


def _partition_a_holder(redis: RedisServer, proxy_cls: type[TcpProxy]) -> tuple[bool, float]:
    """A lease (ttl 1 s) held through the proxy; the proxy partitions. Returns whether the lease
    was reported lost within 5 s, and how long that took."""
    if redis.proc is None:
        redis.start()
    with proxy_cls("127.0.0.1", redis.port) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}/0?socket_timeout=0.5"
        with fenced.connect(url) as locks:
            name = f"proxy-{time.monotonic_ns()}"
            lease = locks.lock(name, ttl=1.0)
            lease.acquire(timeout=10)
            proxy.partition()
            start = time.monotonic()
            lost = lease.lost.wait(5)
            took = time.monotonic() - start
            with fenced.connect(redis.url) as direct:  # the server itself is fine
                assert direct.status(name) is not None
            proxy.heal()
            if lost:  # after healing, the lock can be taken again through the proxy
                with locks.lock(name, ttl=5, timeout=10) as again:
                    assert again.token.value > lease.token.value
        return lost, took


def test_a_partition_loses_the_lease_and_healing_restores_service(
    redis_server: RedisServer,
) -> None:
    lost, took = _partition_a_holder(redis_server, TcpProxy)
    assert lost and took < 3, took


def test_the_scenario_catches_a_proxy_that_does_not_partition(redis_server: RedisServer) -> None:
    lost, _ = _partition_a_holder(redis_server, LeakyProxy)
    assert not lost


def test_cut_resets_open_connections_and_new_ones_work(redis_server: RedisServer) -> None:
    if redis_server.proc is None:
        redis_server.start()
    with TcpProxy("127.0.0.1", redis_server.port) as proxy:
        s = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        s.sendall(b"PING\r\n")
        assert s.recv(16) == b"+PONG\r\n"
        proxy.cut()
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            for _ in range(50):  # the reset arrives as soon as the proxy has closed its side
                s.sendall(b"PING\r\n")
                if not s.recv(16):
                    raise ConnectionResetError
        s.close()
        t = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        t.sendall(b"PING\r\n")
        assert t.recv(16) == b"+PONG\r\n"
        t.close()


def test_delay_holds_each_chunk(redis_server: RedisServer) -> None:
    if redis_server.proc is None:
        redis_server.start()
    with TcpProxy("127.0.0.1", redis_server.port) as proxy:
        proxy.delay(0.3)
        s = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        start = time.monotonic()
        s.sendall(b"PING\r\n")
        assert s.recv(16) == b"+PONG\r\n"
        assert time.monotonic() - start >= 0.6  # 0.3 s each way
        s.close()
