"""The ZooKeeper token source beyond the conformance suite: session expiry, paused processes,
server crashes, a re-created lock node, and planted bugs that each check must catch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from kazoo.client import KazooClient

import fenced
from fenced._core import clock as _clock
from fenced._core.backend import Grant
from fenced.backends import zookeeper as zk
from fenced.backends._zookeeper_session import conf_tick
from fenced.backends.zookeeper import ROOT, ZooKeeperBackend, node_prefix, parse_node
from fenced.testing.servers import ZooKeeperServer
from tests.helpers import (
    async_wait_for,
    check_paused_holder_is_fenced_off,
    dead_port,
    unique_name,
    wait_for,
)


def noop(exc: BaseException) -> None:
    pass


@contextlib.contextmanager
def raw_client(hosts: str) -> Iterator[Any]:
    """A plain kazoo client, to look at (and tamper with) the nodes from outside."""
    client = KazooClient(hosts=hosts)
    client.start(timeout=10)
    try:
        yield client
    finally:
        client.stop()
        client.close()


@contextlib.asynccontextmanager
async def backend_of(cls: type[ZooKeeperBackend], url: str) -> AsyncIterator[ZooKeeperBackend]:
    backend = await cls.open(urlsplit(url), {})
    try:
        yield backend
    finally:
        await backend.aclose()


def assert_increasing(tokens: list[int]) -> None:
    """Tokens in grant order must strictly increase: a repeat or a drop is a reused token."""
    assert tokens, "no grants recorded"
    for i, (a, b) in enumerate(zip(tokens, tokens[1:], strict=False)):
        assert a < b, f"grant #{i + 1} has token {b} after {a}: {tokens}"


@pytest.fixture
def own_server() -> Iterator[ZooKeeperServer]:
    """A private server for tests that kill it."""
    with ZooKeeperServer() as s:
        yield s  # type: ignore[misc]


# -- a user-space TCP proxy that can black-hole a client's connection -------------------------


class Proxy:
    """Forwards 127.0.0.1:port to a server; ``pause()`` holds every byte until ``resume()``.

    A paused connection stays open but silent, as in a network partition: the client's
    requests and pings go unanswered, and the server hears nothing from the session.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.closed = False
        self.sockets: list[socket.socket] = []
        self.swallow = threading.Event()  # take the next connection and never answer it
        self.swallowed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
                if self.swallow.is_set():
                    self.swallow.clear()
                    self.sockets.append(client)  # open, silent: neither a reply nor a close
                    self.swallowed.set()
                    continue
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                if self.closed:
                    return
                continue
            self.sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self.flowing.wait()
                if self.closed:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    @property
    def url(self) -> str:
        return f"zookeeper://127.0.0.1:{self.port}"

    def pause(self) -> None:
        self.flowing.clear()

    def reset(self) -> None:
        """Break the open connections (the client sees it at once); new ones may follow."""
        sockets, self.sockets = self.sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def resume(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self.closed = True
        self.flowing.set()
        self.listener.close()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture
def proxy(zk_server: ZooKeeperServer) -> Iterator[Proxy]:
    p = Proxy(zk_server.port)
    yield p
    p.close()


def session_of(lease: fenced.AsyncLease) -> Any:
    grant = lease._state.grant
    assert grant is not None
    return grant.handle.session


# -- (1) session expiry while holding ----------------------------------------------------------


async def test_session_closed_by_the_server_is_reported_at_once(
    proxy: Proxy, zk_server: ZooKeeperServer
) -> None:
    """The server ends the holder's session (as on expiry): the holder hears it long before its
    30 s ttl would run out, and the next holder gets a higher token."""
    name = unique_name()
    async with fenced.connect_async(proxy.url) as locks:
        lease = locks.lock(name, ttl=30)
        first = await lease.acquire()
        session_id, password = session_of(lease).client.client_id
        # Another client takes over the session and closes it: ZooKeeper deletes its nodes. The
        # holder is held silent meanwhile: its reconnection would otherwise move the session
        # back before the thief's close (the close then fails, and nothing ends: seen under
        # load, when the thief's stop came 0.1 s late).
        proxy.pause()
        try:
            thief = KazooClient(hosts=zk_server.hosts, client_id=(session_id, password))
            await asyncio.to_thread(thief.start, 10)
            await asyncio.to_thread(thief.stop)
            thief.close()
        finally:
            proxy.resume()
        start = _clock.now()
        cause = await asyncio.wait_for(lease.lost.wait(), 10)
        assert isinstance(cause, fenced.LeaseLostError)
        assert _clock.now() - start < 10 and not lease.held
        async with fenced.connect_async(zk_server.url) as other:
            async with other.lock(name, ttl=5, timeout=10) as second:
                assert second.token > first
        assert await lease.release() is False


async def check_holder_lapses_before_takeover(proxy: Proxy, direct_url: str, via: str) -> None:
    """The holder's TCP is black-holed: the server expires its session and another client
    takes the lock. At that moment the old holder must no longer count on its lease."""
    name = unique_name()
    async with fenced.connect_async(via) as locks:
        lease = locks.lock(name, ttl=2)
        first = await lease.acquire()
        proxy.pause()
        try:
            async with fenced.connect_async(direct_url) as other:
                second = other.lock(name, ttl=5)
                token = await second.acquire(timeout=20)
                left = lease.remaining()  # read at once: the new holder may write now
                assert token > first
                assert left == 0, f"old holder still counts on {left:.3f} s of a lost lease"
                cause = await asyncio.wait_for(lease.lost.wait(), 10)
                assert isinstance(cause, fenced.LeaseLostError)
                proxy.resume()
                assert await lease.release() is False
                status = await other.status(name)
                assert status.token == token and second.held
                assert await second.release() is True
        finally:
            proxy.resume()


async def test_partitioned_holder_lapses_before_the_takeover(
    proxy: Proxy, zk_server: ZooKeeperServer
) -> None:
    await check_holder_lapses_before_takeover(proxy, zk_server.url, proxy.url)


class IgnoresNegotiatedTimeout(ZooKeeperBackend):
    """Planted bug: the server gave a shorter session than asked (as a maxSessionTimeout
    would), and the holder counts on the ttl it asked for anyway."""

    def _session_for(self, ttl: float) -> Any:
        return super()._session_for(ttl / 2)

    def _grant(self, node: Any, ttl: float, sent_at: float) -> Grant:
        grant = dataclasses.replace(super()._grant(node, ttl, sent_at), ttl=ttl)
        node.grant = grant
        node.expires_at = sent_at + ttl
        return grant


async def test_lapse_check_catches_a_holder_that_counts_on_too_much(
    proxy: Proxy, zk_server: ZooKeeperServer, register_scheme: Callable[[str, str], None]
) -> None:
    register_scheme("zk-clamped", f"{__name__}:{IgnoresNegotiatedTimeout.__name__}")
    with pytest.raises(AssertionError, match="still counts on"):
        await check_holder_lapses_before_takeover(
            proxy, zk_server.url, f"zk-clamped://127.0.0.1:{proxy.port}"
        )


async def test_a_short_blip_keeps_the_session_and_the_lock(
    proxy: Proxy, zk_server: ZooKeeperServer
) -> None:
    """A connection lost for less than the session timeout: the lock is kept throughout."""
    name = unique_name()
    async with (
        fenced.connect_async(proxy.url) as locks,
        fenced.connect_async(zk_server.url) as other,
    ):
        lease = locks.lock(name, ttl=6)
        token = await lease.acquire()
        session = session_of(lease)
        proxy.pause()  # reconnection attempts hang...
        proxy.reset()  # ...after the connection breaks
        try:
            await async_wait_for(
                lambda: _true(not session.connected.is_set()), 10, "the client to see the drop"
            )
            with pytest.raises(fenced.BackendUnavailable):
                await lease.renew()  # the session may be alive, but nothing proves it now
            with pytest.raises(fenced.LockTimeout):
                await other.lock(name, ttl=5).acquire(timeout=0)  # the server keeps the node
        finally:
            proxy.resume()
        await async_wait_for(lambda: _true(session.connected.is_set()), 10, "reconnection")
        assert await lease.renew() > 0
        assert lease.held and not lease.lost.is_set() and lease.token == token
        assert (await other.status(name)).token == token
        assert await lease.release() is True


async def _true(value: bool) -> bool:
    return value


async def test_a_connect_left_unanswered_is_tried_again_promptly(proxy: Proxy) -> None:
    """A server may take a connection and never answer its Connect (seen after a kill -9:
    the restarting server's port was open, the reply never came). kazoo alone waits for it
    as long as the whole session (10 s here) and the lease runs out; the holder gives up on
    it after a fraction of that, connects again and keeps its lease."""
    async with fenced.connect_async(proxy.url) as locks:
        lease = locks.lock(unique_name(), ttl=10)
        token = await lease.acquire()
        session = session_of(lease)
        proxy.swallow.set()
        proxy.reset()  # the connection breaks; the first attempt to reconnect is swallowed
        await async_wait_for(
            lambda: _true(proxy.swallowed.is_set()), 10, "a reconnection attempt swallowed"
        )
        swallowed_at = _clock.now()
        await async_wait_for(
            lambda: _true(session.connected.is_set()), 10, "the session to reconnect"
        )
        # kazoo's own wait would be the session's 10 s; the holder's first bound is 1 s
        assert _clock.now() - swallowed_at < 5  # half the ttl
        assert await lease.renew() > 0
        assert lease.held and not lease.lost.is_set() and lease.token == token
        assert await lease.release() is True


@pytest.mark.parametrize("timeout", [2.0, 4.0])
async def test_a_server_that_never_answers_costs_no_more_than_the_timeout(timeout: float) -> None:
    """A port that takes connections and never answers (a hung server, a half-open proxy):
    ``acquire(timeout=)`` gives up at its deadline, closing included. kazoo's stop joins its
    connection thread, which was blocked in a connect bound that doubles up to the session
    timeout: closing the client overran a 5 s timeout by 2 s until the stop woke it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)  # the kernel completes the handshakes; nobody ever reads
        locks = fenced.connect_async(f"zookeeper://127.0.0.1:{listener.getsockname()[1]}")
        start = time.monotonic()
        with pytest.raises(fenced.BackendUnavailable):
            await locks.lock(unique_name()).acquire(timeout=timeout)
        await locks.aclose()
        elapsed = time.monotonic() - start
    assert elapsed < timeout + 0.5, f"acquire(timeout={timeout}) returned after {elapsed:.2f} s"


def test_closing_a_holder_ends_its_session_at_once(zk_server: ZooKeeperServer) -> None:
    """Closing a connection sends ZooKeeper's Close: the server drops the session's nodes
    then, not a session timeout later. Before: the stop's wake hid the socket from kazoo's
    loop, which spun (~3 s of CPU) until a ping timed out and dropped the connection without
    the Close, so a closed holder's lock stayed taken for its whole ttl (here 20 s)."""
    name = unique_name()
    with fenced.connect(zk_server.url) as other:
        holder = fenced.connect(zk_server.url)
        holder.lock(name, ttl=20).acquire()
        start = time.monotonic()
        holder.close()
        closed = time.monotonic() - start
        lease = other.lock(name, ttl=5)
        lease.acquire(timeout=10)  # half the holder's ttl: only a Close frees it this soon
        freed = time.monotonic() - start
        assert lease.held and lease.release() is True
    assert closed < 1.5, f"close took {closed:.2f} s"
    assert freed < 5, f"the lock was free {freed:.2f} s after the close"


# -- (2) a paused holder process ---------------------------------------------------------------


def test_paused_holder_process_is_fenced_off(zk_server: ZooKeeperServer) -> None:
    # Silent for longer than its session timeout.
    check_paused_holder_is_fenced_off(zk_server.url, ttl=1.5, acquire_timeout=20)


# -- (3) kill -9 of the server ------------------------------------------------------------------


def test_kill_9_reuses_no_token_and_keeps_the_session(own_server: ZooKeeperServer) -> None:
    name = unique_name()
    tokens: list[int] = []
    with fenced.connect(own_server.url) as locks, fenced.connect(own_server.url) as other:
        for _ in range(5):
            with locks.lock(name, ttl=5) as lease:
                tokens.append(lease.token.value)
        holder = locks.lock(unique_name(), ttl=10)
        held = holder.acquire()
        own_server.restart(kill=True)
        # The session was in the server's log: it survives the crash, and so does the grant.
        wait_for(lambda: _renews(holder), 15, "the holder to renew after the restart")
        assert holder.held and not holder.lost.is_set()
        with pytest.raises(fenced.LockTimeout):
            other.lock(holder.name, ttl=5).acquire(timeout=0)
        assert other.status(holder.name).token == held
        assert holder.release() is True
        for _ in range(5):
            with other.lock(name, ttl=5, timeout=30) as lease:
                tokens.append(lease.token.value)
    assert_increasing(tokens)
    assert held.value > tokens[4] and tokens[5] > held.value


def _renews(lease: fenced.Lease) -> bool:
    try:
        lease.renew()
    except fenced.BackendUnavailable:
        return False
    return True


# -- (4) the lock node re-created: why the token is the czxid, not the sequence ----------------


class SequenceTokens(ZooKeeperBackend):
    """Planted bug: the sequence suffix as the token (it restarts with a re-created parent)."""

    def _token_value(self, node: Any) -> int:
        return int(node.seq) + 1


async def parent_recreation_run(cls: type[ZooKeeperBackend], server: ZooKeeperServer) -> None:
    """Grants, then the (empty) lock node deleted and re-created, then more grants."""
    name = unique_name()
    tokens: list[int] = []
    seqs: list[int] = []
    async with backend_of(cls, server.url) as backend:
        for i in range(6):
            if i == 3:
                with raw_client(server.hosts) as raw:
                    raw.delete(f"{ROOT}/{name}")
                    raw.create(f"{ROOT}/{name}")
            grant = await backend.acquire(
                name, request_id=f"r{i}", ttl=5, deadline=None, on_lost=noop
            )
            tokens.append(grant.token.value)
            seqs.append(grant.handle.seq)
            assert await backend.release(grant) is True
    assert seqs[3] < seqs[2], f"the sequence did not restart: {seqs}"  # the scenario happened
    assert_increasing(tokens)


async def test_tokens_increase_across_a_recreated_lock_node(zk_server: ZooKeeperServer) -> None:
    await parent_recreation_run(ZooKeeperBackend, zk_server)


async def test_recreation_check_catches_sequence_tokens(zk_server: ZooKeeperServer) -> None:
    with pytest.raises(AssertionError, match="has token"):
        await parent_recreation_run(SequenceTokens, zk_server)


async def test_a_release_at_a_high_sequence_recreates_the_lock_node(
    zk_server: ZooKeeperServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequences are a 32-bit counter: near the top, an emptied lock node is re-created."""
    monkeypatch.setattr(zk, "_RESET_SEQ", 3)
    name = unique_name()
    seqs, tokens = [], []
    async with backend_of(ZooKeeperBackend, zk_server.url) as backend:
        for i in range(5):
            grant = await backend.acquire(
                name, request_id=f"r{i}", ttl=5, deadline=None, on_lost=noop
            )
            seqs.append(grant.handle.seq)
            tokens.append(grant.token.value)
            assert await backend.release(grant) is True
    assert seqs == [0, 1, 2, 3, 0]
    assert_increasing(tokens)


# -- (5) stale releases --------------------------------------------------------------------------


class ReleaseLowest(ZooKeeperBackend):
    """Planted bug: release deletes the lowest child (the current holder), not its own node."""

    async def release(self, grant: Grant) -> bool:
        s = self._status_session()
        parent = f"{self._root}/{grant.token.lock}"
        children = await s._children(parent)
        queue = zk._queue_order(children)
        if not queue:
            return False
        await s.future(s.client.delete_async(f"{parent}/{queue[0][0]}"))
        grant.handle.phase = zk.NodePhase.DONE
        return True


async def stale_release_run(cls: type[ZooKeeperBackend], server: ZooKeeperServer) -> None:
    """A retried release, and the release of an expired grant, must not free a newer grant."""
    name = unique_name()
    async with backend_of(cls, server.url) as a, backend_of(cls, server.url) as b:
        ga = await a.acquire(name, request_id="a", ttl=5, deadline=None, on_lost=noop)
        assert await a.release(ga) is True
        gb = await b.acquire(name, request_id="b", ttl=5, deadline=_clock.now() + 5, on_lost=noop)
        retried = await a.release(ga)  # the reply of the first release was "lost"
        status = await b.status(name)
        assert retried is False and status.token == gb.token, f"retried release freed {gb.token}"
        assert await b.release(gb) is True
        # The same with a grant that expired (not renewed) before its holder released it.
        lost = asyncio.Event()
        gc = await a.acquire(
            name, request_id="c", ttl=1, deadline=None, on_lost=lambda e: lost.set()
        )
        gd = await b.acquire(name, request_id="d", ttl=5, deadline=_clock.now() + 10, on_lost=noop)
        assert gd.token > gc.token and lost.is_set()
        late = await a.release(gc)
        status = await b.status(name)
        assert late is False and status.token == gd.token, (
            f"expired holder's release freed {gd.token}"
        )
        assert await b.release(gd) is True


async def test_stale_releases_free_nothing(zk_server: ZooKeeperServer) -> None:
    await stale_release_run(ZooKeeperBackend, zk_server)


async def test_stale_release_check_catches_a_release_of_the_lowest_node(
    zk_server: ZooKeeperServer,
) -> None:
    with pytest.raises(AssertionError, match="freed"):
        await stale_release_run(ReleaseLowest, zk_server)


# -- no herd: a release makes only the next waiter act -------------------------------------------


def _packets(server: ZooKeeperServer) -> int:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"mntr")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    for line in data.decode().splitlines():
        key, _, value = line.partition("\t")
        if key == "zk_packets_received":
            return int(value)
    raise AssertionError(f"no zk_packets_received in mntr output: {data[:200]!r}")


class ListingWaiters(ZooKeeperBackend):
    """Planted bug: the naive recipe, every waiter watching the whole queue (a herd)."""

    async def _next_step(self, s: Any, node: Any, deadline: float | None) -> float | None:
        if node.path is None:
            return await super()._next_step(s, node, deadline)
        sent = _clock.now()
        node.wake.clear()
        children = await s.future(s.client.get_children_async(node.parent, watch=node.pred_watch))
        granted = self._place(s, node, children, sent)
        if granted is None and node.path is not None:
            await zk._sleep(node.wake, deadline)
        return granted


async def herd_run(
    cls: type[ZooKeeperBackend],
    server: ZooKeeperServer,
    monkeypatch: pytest.MonkeyPatch,
    waiters: int = 20,
) -> None:
    """Requests the server gets between a release and the next grant must not grow with the
    number of waiters (each waiter watches only its predecessor)."""
    parked = 0
    real_sleep = zk._sleep

    async def counting_sleep(event: asyncio.Event, deadline: float | None) -> bool:
        nonlocal parked
        parked += 1
        try:
            return await real_sleep(event, deadline)
        finally:
            parked -= 1

    monkeypatch.setattr(zk, "_sleep", counting_sleep)
    name = unique_name()
    async with backend_of(cls, server.url) as backend:
        holder = await backend.acquire(name, request_id="h", ttl=10, deadline=None, on_lost=noop)
        granted: list[Grant] = []
        go = asyncio.Event()

        async def wait(i: int) -> None:
            grant = await backend.acquire(
                name, request_id=f"w{i}", ttl=10, deadline=None, on_lost=noop
            )
            granted.append(grant)
            await go.wait()
            await backend.release(grant)

        tasks = [asyncio.create_task(wait(i)) for i in range(waiters)]
        await async_wait_for(lambda: _true(parked == waiters), 20, "every waiter to park")
        before = await asyncio.to_thread(_packets, server)
        assert await backend.release(holder) is True
        await async_wait_for(
            lambda: _true(len(granted) == 1 and parked == waiters - 1), 20, "the next grant"
        )
        after = await asyncio.to_thread(_packets, server)
        go.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    # The release itself, and at most a couple of requests by the next waiter (or a ping).
    assert after - before <= 4, (
        f"{after - before} requests after one release with {waiters} waiters"
    )


async def _queued(backend: Any, name: str, n: int) -> bool:
    return bool((await backend.status(name)).waiters == n)


async def test_a_release_wakes_only_the_next_waiter(
    zk_server: ZooKeeperServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    await herd_run(ZooKeeperBackend, zk_server, monkeypatch)


async def test_herd_check_catches_waiters_that_watch_the_whole_queue(
    zk_server: ZooKeeperServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(AssertionError, match="requests after one release"):
        await herd_run(ListingWaiters, zk_server, monkeypatch)


# -- the node and the token ----------------------------------------------------------------------


async def test_token_is_the_czxid_and_status_reads_the_queue(zk_server: ZooKeeperServer) -> None:
    name = unique_name()
    rid = "job 7/α%"  # any text: it is encoded into the node name
    async with backend_of(ZooKeeperBackend, zk_server.url) as backend:
        grant = await backend.acquire(name, request_id=rid, ttl=5, deadline=None, on_lost=noop)
        with raw_client(zk_server.hosts) as raw:
            children = raw.get_children(f"{ROOT}/{name}")
            parsed = parse_node(children[0])
            assert len(children) == 1 and parsed is not None and parsed[0] == rid
            assert children[0] == f"{node_prefix(rid, parsed[1])}{parsed[2]:010d}"
            stat = raw.exists(f"{ROOT}/{name}/{children[0]}")
            assert grant.token.value == stat.czxid
        status = await backend.status(name)
        assert status.holder == rid and status.token == grant.token
        assert status.remaining is not None and 0 < status.remaining <= 5 and status.waiters == 0
        assert await backend.release(grant) is True
        free = await backend.status(name)
        assert free.holder is None and free.token is None and free.last_token == grant.token


async def test_ttl_is_what_the_session_gives(zk_server: ZooKeeperServer) -> None:
    """The server clamps session timeouts (here to 0.4..60 s); the grant never claims more."""
    name = unique_name()
    async with backend_of(ZooKeeperBackend, zk_server.url) as backend:
        long = await backend.acquire(name, request_id="a", ttl=120, deadline=None, on_lost=noop)
        assert long.ttl == 60.0 and long.handle.session.timeout == 60.0
        assert await backend.release(long)
        short = await backend.acquire(name, request_id="b", ttl=0.3, deadline=None, on_lost=noop)
        assert short.ttl == 0.3 and short.handle.session.timeout == 0.4
        await backend.release(short)


async def test_a_deleted_node_is_reported_lost_at_once(zk_server: ZooKeeperServer) -> None:
    name = unique_name()
    async with fenced.connect_async(zk_server.url) as locks:
        lease = locks.lock(name, ttl=30)
        await lease.acquire()
        with raw_client(zk_server.hosts) as raw:
            (child,) = raw.get_children(f"{ROOT}/{name}")
            raw.delete(f"{ROOT}/{name}/{child}")  # an operator removes the lock by hand
        cause = await asyncio.wait_for(lease.lost.wait(), 10)
        assert isinstance(cause, fenced.LeaseLostError) and "deleted" in str(cause)
        assert await lease.release() is False


async def test_a_create_whose_reply_was_lost_is_found_not_repeated(
    zk_server: ZooKeeperServer,
) -> None:
    """After a connection loss during create, the retry finds the node by its name prefix."""
    name = unique_name()
    async with backend_of(ZooKeeperBackend, zk_server.url) as backend:
        s = backend._session_for(5)
        await s.wait_connected(_clock.now() + 10)
        parent = f"{ROOT}/{name}"
        await s.future(s.client.ensure_path_async(parent))
        node = zk.Node(name, "r", s, parent, node_prefix("r", "0badf00d"), [noop], 5.0)
        node.own_watch = lambda ev: None
        node.pred_watch = lambda ev: None
        # The create reached the server, but its reply never came back.
        path, _ = await s.future(
            s.client.create_async(
                f"{parent}/{node.prefix}", b"", ephemeral=True, sequence=True, include_data=True
            )
        )
        node.uncertain = True
        await backend._wait_turn(s, node, _clock.now() + 5)
        assert node.path == path
        assert await s._children(parent) == [path.rsplit("/", 1)[1]]


async def test_a_cancelled_waiter_leaves_the_queue(zk_server: ZooKeeperServer) -> None:
    name = unique_name()
    async with fenced.connect_async(zk_server.url) as locks:
        holder = locks.lock(name, ttl=10)
        await holder.acquire()
        waiter = asyncio.create_task(locks.lock(name, ttl=10).acquire())
        await async_wait_for(lambda: _queued(locks.backend, name, 1), 10, "the waiter to queue")
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        await async_wait_for(lambda: _queued(locks.backend, name, 0), 10, "the waiter to leave")
        await holder.release()
        async with locks.lock(name, ttl=5, timeout=0):
            pass


async def test_chroot_is_created_and_used(zk_server: ZooKeeperServer) -> None:
    name = unique_name()
    chroot = f"/apps/{unique_name('c')}"
    async with fenced.connect_async(zk_server.url + chroot) as locks:
        async with locks.lock(name, ttl=5) as lease:
            with raw_client(zk_server.hosts) as raw:
                assert len(raw.get_children(f"{chroot}{ROOT}/{name}")) == 1
            assert (await locks.status(name)).token == lease.token


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("zookeeper://", {}),
        ("zookeeper://user:pw@127.0.0.1:2181", {}),
        ("zookeeper://127.0.0.1:2181?x=1", {}),
        ("zookeeper://127.0.0.1:abc", {}),
        ("zookeeper://127.0.0.1:2181/a//b", {}),
        ("zookeeper://127.0.0.1:2181", {"session_timeout": 5}),
        ("zookeeper://127.0.0.1:2181", {"connect_timeout": 0}),
    ],
)
def test_bad_urls_and_options(url: str, options: dict[str, Any]) -> None:
    with pytest.raises(fenced.ConfigurationError):
        fenced.connect(url, **options)


def test_no_server_is_a_typed_error() -> None:
    with dead_port() as dead, pytest.raises(fenced.BackendUnavailable):
        start = time.monotonic()
        fenced.connect(f"zookeeper://127.0.0.1:{dead}", connect_timeout=0.5)
    assert time.monotonic() - start < 10


async def test_a_renewal_is_proven_through_the_leader(zk_server: ZooKeeperServer) -> None:
    """renew() counts from its first sync and waits tickTime/2 (+ slack) before the next two:
    one leader ping falls between them (the argument is in docs/backend-zookeeper.md). The
    tickTime is asked of the server (``conf``); a server that does not answer ``conf`` gives
    the negotiated timeout / 2 (an upper bound: min session timeout = 2 x tickTime)."""
    name = unique_name()
    async with backend_of(ZooKeeperBackend, zk_server.url) as backend:
        grant = await backend.acquire(name, request_id="a", ttl=4, deadline=None, on_lost=noop)
        before = _clock.now()
        renewed = await backend.renew(grant)
        took = _clock.now() - before
        assert backend._tick == 0.2  # the fixture's tickTime=200
        assert took >= 0.2 / 2 + zk._PING_SLACK, took
        assert before <= renewed.sent_at <= before + took - 0.15
        assert renewed.handle.session.leader_since == renewed.sent_at
        await backend.release(renewed)
    with dead_port() as closed:
        assert conf_tick(f"127.0.0.1:{closed}", timeout=0.2) is None


async def test_a_release_asked_again_after_one_that_raised_is_a_release(
    proxy: Proxy, zk_server: ZooKeeperServer
) -> None:
    """A release while the connection is down raises (the session's janitor deletes the node
    once it is back). Asked again, once it has: it answered False, and the lease core
    reported the lease lost ("had already expired or been taken over"), although the node
    was deleted for that very release while its session lived. Now True, no loss; asked
    again while the node is still there, it deletes it itself (True too)."""
    name = unique_name()
    async with (
        fenced.connect_async(zk_server.url) as other,
        fenced.connect_async(proxy.url) as locks,
    ):
        for finished_by_janitor in (True, False):
            lease = locks.lock(name, ttl=10)
            await lease.acquire()
            session = session_of(lease)
            proxy.pause()
            proxy.reset()
            try:
                await async_wait_for(
                    lambda s=session: _true(not s.connected.is_set()), 10, "the drop to be seen"
                )
                with pytest.raises(fenced.BackendUnavailable):
                    await lease.release()
            finally:
                proxy.resume()
            if finished_by_janitor:

                async def freed() -> bool:
                    return (await other.status(name)).token is None

                await async_wait_for(freed, 20, "the janitor to delete the node")
            else:
                await async_wait_for(
                    lambda s=session: _true(s.connected.is_set()), 20, "the connection back"
                )
            assert await lease.release() is True
            assert not lease.lost.is_set(), lease.lost.cause
            assert (await other.status(name)).token is None


async def test_a_release_asked_again_after_its_session_ended_stays_false(
    proxy: Proxy, zk_server: ZooKeeperServer
) -> None:
    """The other side: the connection stays down until the session expires (the node goes
    with it, perhaps before the release): asked again, the release answers False, and the
    lease is reported lost."""
    name = unique_name()
    async with (
        fenced.connect_async(zk_server.url) as other,
        fenced.connect_async(proxy.url) as locks,
    ):
        lease = locks.lock(name, ttl=4)
        await lease.acquire()
        session = session_of(lease)
        proxy.pause()
        proxy.reset()
        try:
            await async_wait_for(
                lambda: _true(not session.connected.is_set()), 10, "the drop to be seen"
            )
            with pytest.raises(fenced.BackendUnavailable):
                await lease.release()

            async def freed() -> bool:
                return (await other.status(name)).token is None

            await async_wait_for(freed, 30, "the session to end")
        finally:
            proxy.resume()
        await async_wait_for(lambda: _true(session.connected.is_set()), 20, "a new session")
        assert await lease.release() is False
        assert lease.lost.is_set()


async def test_a_release_cut_off_then_closed_says_what_happens_to_the_node(
    proxy: Proxy, zk_server: ZooKeeperServer
) -> None:
    """A release while the connection is down is retried by the session's janitor, but only
    while the connection is open: closing stops it. The error said "released once it is back"
    / "retried in the background" without that; it now says that, closed first, the node goes
    when its session ends, which it does (and the lock is free for live clients then)."""
    name = unique_name()
    async with fenced.connect_async(zk_server.url) as other:
        locks = fenced.connect_async(proxy.url)
        lease = locks.lock(name, ttl=4)
        token = await lease.acquire()
        session = session_of(lease)
        proxy.pause()
        proxy.reset()
        try:
            await async_wait_for(
                lambda: _true(not session.connected.is_set()), 10, "the client to see the drop"
            )
            with pytest.raises(fenced.BackendUnavailable) as err:
                await lease.release()
            message = str(err.value)
            assert "closed first" in message and "session ends" in message, message
            assert "\n" not in message
            await locks.aclose()
            assert (await other.status(name)).token == token  # the node is still there...

            async def freed() -> bool:
                return (await other.status(name)).token is None

            await async_wait_for(freed, 30, "the session to end")  # ...until its session ends
        finally:
            proxy.resume()
        again = other.lock(name, ttl=5)
        assert (await again.acquire(timeout=5)).value > token.value
        await again.release()
