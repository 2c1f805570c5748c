"""The ``http://`` source's TLS context. A plain ``http://`` connection reads no CA bundle:
loading the system's trusted CAs cost ~30 ms of CPU per ``fenced.connect``, 40 % of a test
process's CPU in the http sources' conformance tests, for a context no request used. The
context it gets instead trusts nothing and still verifies (a TLS server reached through it
would be refused, never let through unverified); ``https://`` keeps the system's CAs."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import fenced
from fenced.testing.servers import FencedServer


@pytest.fixture(scope="module")
def server() -> Iterator[FencedServer]:
    with FencedServer("memory://") as s:
        yield s  # type: ignore[misc]


def _client_context(locks: fenced.Locks) -> ssl.SSLContext:
    """The SSL context of the open connection's httpx client (httpcore's pool holds it)."""
    backend: Any = locks._async._backend
    client: httpx.AsyncClient = backend._client
    context: ssl.SSLContext = client._transport._pool._ssl_context  # type: ignore[attr-defined]
    return context


def test_a_plain_http_connection_reads_no_ca_bundle_and_still_verifies(
    server: FencedServer,
) -> None:
    with fenced.connect(server.url) as locks:
        with locks.lock("plain", ttl=5) as lease:  # (the rightful use: granted)
            assert lease.token.value >= 1
        context = _client_context(locks)
    assert context.cert_store_stats()["x509_ca"] == 0  # (~150 before: the system's CAs)
    # Fail closed: were it ever used for TLS, it verifies, and trusts no one.
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_https_and_a_ca_file_keep_their_trust(server: FencedServer, tmp_path: Any) -> None:
    url = server.url.replace("http://", "https://")
    with pytest.raises(fenced.ConfigurationError) as err:  # (a bad CA file: one line, as before)
        fenced.connect(url, ca_file=str(tmp_path / "missing.pem"))
    assert "\n" not in str(err.value)
    with pytest.raises(fenced.ConfigurationError):  # (also on http://: the file is checked)
        fenced.connect(server.url, ca_file=str(tmp_path / "missing.pem"))
    # https:// with no ca_file: the system's trusted CAs, verifying.
    from fenced._clients.tls import tls_context

    system = tls_context("https")
    assert system.cert_store_stats()["x509_ca"] > 0
    assert system.verify_mode == ssl.CERT_REQUIRED and system.check_hostname
