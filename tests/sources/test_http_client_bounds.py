"""The ``http://`` source when its gateway hangs (a real ``fenced serve`` stopped with SIGSTOP:
it accepts connections in the kernel but never answers): an acquire's timeout is honoured
(+ 1 s for a last answer, as on the other sources), every other call is bounded by
``request_timeout``, and the error names what ran out. Before: ``acquire(timeout=2)`` took
12 s, ``acquire(timeout=0)`` 10 s, with ``BackendUnavailable(... ReadTimeout: )``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import fenced
from fenced.testing.servers import FencedServer


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FencedServer]:
    with FencedServer(f"sqlite:///{tmp_path / 'locks.db'}") as s:
        yield s  # type: ignore[misc]


def _timed(fn: object) -> tuple[float, BaseException | None]:
    start = time.monotonic()
    try:
        fn()  # type: ignore[operator]
    except fenced.FencedError as exc:
        return time.monotonic() - start, exc
    return time.monotonic() - start, None


@pytest.mark.parametrize("timeout", [0.0, 2.0])
def test_an_acquire_from_a_hung_gateway_ends_at_its_timeout(
    server: FencedServer, timeout: float
) -> None:
    with fenced.connect(server.url) as locks:
        assert locks.status("free").holder is None  # (the connection is open)
        server.pause()
        try:
            took, err = _timed(lambda: locks.lock("l").acquire(timeout=timeout))
        finally:
            server.resume()
        assert isinstance(err, fenced.BackendUnavailable), err
        assert "no answer within" in str(err) and "the acquire's timeout + 1 s" in str(err)
        assert "\n" not in str(err)
        assert timeout + 0.8 <= took <= timeout + 2.0, took  # (10-12 s before)
        # The rightful case: the gateway answers again, and the same call gets a lock. (Not
        # "l": the request given up on reached the gateway when it woke, and may have been
        # granted; that grant ends with its ttl, as any whose answer was lost.)
        lease = locks.lock("m")
        assert lease.acquire(timeout=timeout).value >= 1
        assert lease.release()


def test_other_calls_to_a_hung_gateway_end_at_request_timeout(server: FencedServer) -> None:
    with fenced.connect(server.url, request_timeout=1.5) as locks:
        lease = locks.lock("l", ttl=30, auto_renew=False)
        lease.acquire()
        server.pause()
        try:
            for call in (lease.renew, lambda: locks.status("l")):
                took, err = _timed(call)
                assert isinstance(err, fenced.BackendUnavailable), err
                assert "no answer within 1.5 s (request_timeout)" in str(err)
                assert 1.3 <= took <= 3.0, took
        finally:
            server.resume()
        assert lease.renew() > 0  # answered again: the lease was never lost
        assert lease.release()


def test_the_lease_core_bounds_a_source_that_ignores_the_deadline(
    server: FencedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backstop: a source whose calls ignore the acquire's deadline (planted: the http
    source's bound made a minute) still gives up at the timeout + 2 s, a typed one line."""
    from fenced.backends.http import HttpBackend

    monkeypatch.setattr(HttpBackend, "_bound", lambda self, wait, deadline: (60.0, "planted"))
    with fenced.connect(server.url) as locks:
        assert locks.status("free").holder is None
        server.pause()
        try:
            took, err = _timed(lambda: locks.lock("l").acquire(timeout=1))
        finally:
            server.resume()
        assert isinstance(err, fenced.BackendUnavailable), err
        assert "within the acquire's timeout + 2 s" in str(err), str(err)
        assert 2.8 <= took <= 4.5, took
        lease = locks.lock("m")
        assert lease.acquire(timeout=5).value >= 1
        assert lease.release()


def test_a_renewal_moves_on_from_a_hung_gateway_to_the_next(tmp_path: Path) -> None:
    """Without a deadline each gateway gets its own ``request_timeout``: a renewal whose
    gateway hangs is sent to the next one (same source) and confirmed there."""
    source = f"sqlite:///{tmp_path / 'shared.db'}"
    with FencedServer(source) as a, FencedServer(source) as b:
        hosts = f"127.0.0.1:{a.port},127.0.0.1:{b.port}"
        with fenced.connect(f"http://{hosts}", request_timeout=1.5) as locks:
            lease = locks.lock("l", ttl=30, auto_renew=False)
            lease.acquire(timeout=5)  # (through a: the first listed)
            a.pause()
            try:
                start = time.monotonic()
                assert lease.renew() > 0
                assert 1.3 <= time.monotonic() - start <= 4.0
            finally:
                a.resume()
            assert lease.release()
