"""etcd refuses a whole transaction of more operations than ``--max-txn-ops`` (128 by
default; a nested transaction gets what its parent leaves) or one that writes a key twice:
the etcd guard refuses such a write itself, before anything is sent, with one typed line
(ConfigurationError), and its rule is etcd's own (checked against a real server). A fenced
write is one atomic step: it is never split to fit."""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd
import pytest
from aetcd import rpc

import fenced
from fenced import FencingToken
from fenced.guards.etcd import (
    MAX_TXN_OPS,
    AsyncEtcdGuard,
    EtcdGuard,
    check_txn,
    delete_op,
    put_op,
)
from fenced.testing.servers import EtcdServer
from tests.helpers import unique_name


def puts(n: int, prefix: str = "k") -> list[rpc.RequestOp]:
    return [put_op(f"{prefix}/{i}", b"v") for i in range(n)]


def nested(n: int) -> rpc.RequestOp:
    op = rpc.RequestOp()
    op.request_txn.success.extend(puts(n, "n"))
    return op


def txn(success: list[rpc.RequestOp], compares: int = 0) -> rpc.TxnRequest:
    request = rpc.TxnRequest()
    for i in range(compares):
        request.compare.append(
            rpc.Compare(
                key=f"c/{i}".encode(),
                target=rpc.Compare.CREATE,
                result=rpc.Compare.EQUAL,
                create_revision=0,
            )
        )
    request.success.extend(success)
    return request


def refused(request: rpc.TxnRequest, max_ops: int = MAX_TXN_OPS) -> bool:
    try:
        check_txn(request, max_ops, "a test")
    except fenced.ConfigurationError:
        return True
    return False


CASES = {
    "128 puts": txn(puts(128)),
    "129 puts": txn(puts(129)),
    "129 compares": txn(puts(1), compares=129),
    "2 + a nested 126": txn([put_op("a", b"1"), nested(126)], compares=2),
    "2 + a nested 127": txn([put_op("a", b"1"), nested(127)], compares=2),
    "a key put twice": txn([put_op("d", b"1"), put_op("d", b"2")]),
    "a key put outside and inside a nested txn": txn([put_op("n/0", b"1"), nested(1)]),
    "a put inside a deleted key": txn([delete_op("d"), put_op("d", b"2")]),
    "a key deleted twice": txn([delete_op("d"), delete_op("d")]),
}


def test_the_rule_is_etcds_own(etcd_server: EtcdServer) -> None:
    """Each case: refused by the guard's check exactly when the server refuses it."""

    async def server_refuses(request: rpc.TxnRequest) -> bool:
        host, port = etcd_server.endpoint.rsplit(":", 1)
        async with aetcd.Client(host, int(port)) as client:
            try:
                await client.kvstub.Txn(request, timeout=10, metadata=client.metadata)
            except rpc.AioRpcError as exc:
                assert exc.code().name == "INVALID_ARGUMENT", exc
                return True
            return False

    async def go() -> dict[str, tuple[bool, bool]]:
        return {name: (refused(r), await server_refuses(r)) for name, r in CASES.items()}

    seen = asyncio.run(go())
    assert {name: mine for name, (mine, _) in seen.items()} == {
        name: theirs for name, (_, theirs) in seen.items()
    }
    assert seen["129 puts"] == (True, True) and seen["128 puts"] == (False, False)
    assert seen["2 + a nested 127"][0] and not seen["2 + a nested 126"][0]


def test_a_write_of_too_many_operations_is_refused_before_anything_is_sent(
    etcd_server: EtcdServer,
) -> None:
    resource = unique_name("res")
    with EtcdGuard(etcd_server.endpoint, resource) as guard:
        guard.fence(FencingToken(resource, 3))
        # The fenced write's own put of the mark takes one of etcd's 128.
        with pytest.raises(
            fenced.ConfigurationError, match="128 operations, etcd takes at most 127"
        ):
            guard.write(puts(128, resource), token=FencingToken(resource, 4))
        assert guard.high_water() == FencingToken(resource, 3)  # nothing was written
        guard.write(puts(127, resource), token=FencingToken(resource, 4))  # at the limit
        assert guard.high_water() == FencingToken(resource, 4)


def test_a_write_of_a_key_twice_is_refused_before_anything_is_sent(
    etcd_server: EtcdServer,
) -> None:
    resource = unique_name("res")
    with EtcdGuard(etcd_server.endpoint, resource) as guard:
        key = f"{resource}/k"
        for ops in (
            [put_op(key, b"1"), put_op(key, b"2")],
            [delete_op(key), put_op(key, b"2")],
        ):
            with pytest.raises(fenced.ConfigurationError, match="written twice"):
                guard.write(ops, token=FencingToken(resource, 2))
        assert guard.high_water() is None  # nothing was written
        guard.write([put_op(key, b"1"), put_op(key + "2", b"2")], token=FencingToken(resource, 2))
        assert guard.high_water() == FencingToken(resource, 2)


def test_a_server_with_another_max_txn_ops_is_told_to_the_guard(etcd_server: EtcdServer) -> None:
    resource = unique_name("res")

    async def go() -> Any:
        guard = AsyncEtcdGuard.open(etcd_server.endpoint, resource, max_txn_ops=8)
        try:
            with pytest.raises(
                fenced.ConfigurationError, match="8 operations, etcd takes at most 7"
            ):
                await guard.write(puts(8, resource), token=FencingToken(resource, 1))
            await guard.write(puts(7, resource), token=FencingToken(resource, 1))
            return await guard.high_water()
        finally:
            await guard.aclose()

    assert asyncio.run(go()) == FencingToken(resource, 1)
    with pytest.raises(fenced.ConfigurationError, match="max_txn_ops"):
        AsyncEtcdGuard.open(etcd_server.endpoint, resource, max_txn_ops=True)
