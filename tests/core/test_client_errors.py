"""One reading of each client library's errors for the sources and the guards (the clients
layer): a gRPC error the etcd source's transport takes for a member failing under the call
(outcome unknown) is never, for the etcd guard, "etcd refused the write"."""

from __future__ import annotations

import grpc  # type: ignore[import-untyped]
import grpc.aio  # type: ignore[import-untyped]
import pytest

from fenced import BackendUnavailable, FencedError
from fenced._clients.grpc_errors import RETRYABLE, kind
from fenced.guards.etcd import map_error


def _rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize("code", list(grpc.StatusCode), ids=lambda c: c.name)
def test_the_etcd_guard_reads_grpc_codes_as_the_source_does(code: grpc.StatusCode) -> None:
    exc = _rpc_error(code, "stream reset")
    mapped = map_error(exc, "res")
    if code in RETRYABLE:  # the source fails over: nobody knows whether the write happened
        assert kind(exc) == "unreachable"
        assert isinstance(mapped, BackendUnavailable), mapped
        assert "outcome unknown" in str(mapped)
    else:
        assert kind(exc) == "refused"
        assert type(mapped) is FencedError and "refused" in str(mapped)


def test_lease_not_found_is_its_own_kind() -> None:

    assert kind(_rpc_error(grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")) == (
        "lease-not-found"
    )
    assert kind(_rpc_error(grpc.StatusCode.NOT_FOUND, "key")) == "refused"


def test_the_zookeeper_guard_reads_kazoo_errors_as_the_source_does() -> None:
    """A ZooKeeper operation timeout was BackendUnavailable for the source but escaped the
    guard as a raw kazoo error: both now read kazoo through ``fenced._clients.kazoo_errors``."""
    from kazoo.exceptions import BadVersionError, OperationTimeoutError, SessionExpiredError

    from fenced._clients.kazoo_errors import kind as kazoo_kind
    from fenced.backends._zookeeper_session import UNAVAILABLE
    from fenced.guards import zookeeper as zk_guard

    gone = zk_guard._GONE
    for cls in (*UNAVAILABLE, SessionExpiredError):
        assert issubclass(cls, gone), cls  # the guard says BackendUnavailable for each
    assert kazoo_kind(OperationTimeoutError()) == "unreachable"
    assert kazoo_kind(SessionExpiredError()) == "session-lost"
    assert kazoo_kind(BadVersionError()) == "refused"
    assert not issubclass(BadVersionError, gone)
