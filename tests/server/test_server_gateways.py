"""Two ``fenced serve`` gateways in front of one etcd: one is killed with SIGKILL while a client
holds the lock through it and three more wait through it. Holders and waiters are real OS
processes using the Python client with both gateways listed.

What must hold: the holder keeps its grant (its renewals go to the other gateway, which
resumes the grant from etcd) for several ttls after the kill; no token is reused; the waiters
are granted in the order they queued (their retries adopt their own places in etcd's queue).
A planted gateway that cannot resume a grant made elsewhere makes the holder lose it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from fenced.testing.servers import EtcdServer, FencedServer
from tests.helpers import ROOT, read_line, unique_name, wait_for
from tests.server.gateway import TLS  # (polled: one TLS context, not one per call)

CLIENT = """
import os, sys, fenced
url, name, role = sys.argv[1:4]
rid = f"{role}-{os.getpid()}"
with fenced.connect(url) as locks:
    lease = locks.lock(name, ttl=2, request_id=rid)
    token = lease.acquire(timeout=120)
    print("token", token.value, "kept-place" if lease.request_id == rid else "requeued", flush=True)
    if role == "holder":
        sys.stdin.readline()
        print("held", lease.held, type(lease.lost_cause).__name__, flush=True)
    print("released", lease.release(), flush=True)
"""

PLANT = (
    'import fenced; fenced.register_backend("etcd", "tests.server.planted_gateway:NoResumeEtcd")'
)


def _client(url: str, name: str, role: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, url, name, role],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
    )


def _gateways(etcd: EtcdServer, prelude: str = "") -> list[FencedServer]:
    if etcd.proc is None:
        etcd.start()
    source = f"{etcd.url}?prefix=/fenced-test/{unique_name('gw')}/"
    env = {"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    pair = [FencedServer(source, env=env, prelude=prelude) for _ in range(2)]
    for g in pair:
        g.start()
    return pair


@pytest.fixture
def gateways(etcd_server: EtcdServer) -> Iterator[list[FencedServer]]:
    pair = _gateways(etcd_server)
    yield pair
    for g in pair:
        g.close()


@pytest.fixture
def planted_gateways(etcd_server: EtcdServer) -> Iterator[list[FencedServer]]:
    pair = _gateways(etcd_server, PLANT)
    yield pair
    for g in pair:
        g.close()


def _waiters(gateway: FencedServer, name: str) -> int:
    got = httpx.get(f"{gateway.url}/v1/locks/{name}", timeout=10, verify=TLS).json()
    return int(got["waiters"] or 0)


def _kill_a_gateway_under_a_holder_and_waiters(
    gateways: list[FencedServer],
) -> tuple[str, list[int], list[str]]:
    """Returns the holder's report after the kill, every token granted in grant order, and
    whether each waiter was granted the place it queued for (or gave a grant back)."""
    a, b = gateways
    url = f"http://127.0.0.1:{a.port},127.0.0.1:{b.port}"  # a first: everyone starts on a
    name = unique_name("lead")
    holder = _client(url, name, "holder")
    procs = [holder]
    try:
        first = int(read_line(holder).split()[1])
        for i in range(3):  # queued one after another: their order is known
            procs.append(_client(url, name, "waiter"))
            wait_for(lambda i=i: _waiters(b, name) == i + 1, 30, f"waiter {i + 1} to queue")
        a.kill()
        time.sleep(3 * 2.0)  # three ttls pass: the holder must keep renewing through b
        assert holder.stdin is not None
        holder.stdin.write("report\n")
        holder.stdin.flush()
        report = read_line(holder)
        tokens, places = [first], []
        for p in procs[1:]:
            _, token, place = read_line(p).split()
            tokens.append(int(token))
            places.append(place)
        for p in procs:
            p.wait(60)
        return report, tokens, places
    finally:
        for p in procs:
            p.kill()


def test_a_gateway_killed_mid_run_costs_holders_and_waiters_nothing(
    gateways: list[FencedServer],
) -> None:
    report, tokens, places = _kill_a_gateway_under_a_holder_and_waiters(gateways)
    assert report == "held True NoneType", report
    # no token reused, and the waiters granted in the order they queued, each in the place it
    # queued for through the dead gateway (its etcd key adopted, no grant given back)
    assert tokens == sorted(tokens) and len(set(tokens)) == 4, tokens
    assert places == ["kept-place"] * 3, places


def test_the_kill_test_catches_a_gateway_that_cannot_resume(
    planted_gateways: list[FencedServer],
) -> None:
    report, _, _ = _kill_a_gateway_under_a_holder_and_waiters(planted_gateways)
    assert report == "held False LeaseLostError", report
