"""The behaviour every token source must show, run against each of them (see conftest.py).

A capability a source does not declare (``Characteristic``) is skipped by that declaration,
never by catching NotImplementedError.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest

import fenced
from fenced import Characteristic
from tests.helpers import ROOT, async_wait_for, unique_name, wait_for
from tests.sources.envs.base import BackendEnv


def requires(env: BackendEnv, *wanted: Characteristic) -> None:
    missing = [c.value for c in wanted if c not in env.characteristics]
    if missing:
        pytest.skip(f"{env.name} does not declare {', '.join(missing)}")


def test_tokens_strictly_increase(env: BackendEnv) -> None:
    name = unique_name()
    tokens = []
    with env.connect() as locks:
        for _ in range(30):
            with locks.lock(name, ttl=5) as lease:
                tokens.append(lease.token)
        status = locks.status(name)
    assert all(a < b for a, b in zip(tokens, tokens[1:], strict=False)), tokens
    assert len({t.value for t in tokens}) == len(tokens)
    assert all(t.lock == name for t in tokens)
    assert status.holder is None and status.token is None
    if status.last_token is not None:
        assert status.last_token >= tokens[-1]


def test_tokens_increase_across_reconnect(env: BackendEnv) -> None:
    name = unique_name()
    with env.connect() as locks, locks.lock(name, ttl=5) as lease:
        first = lease.token
    with env.connect() as locks, locks.lock(name, ttl=5) as lease:
        assert lease.token > first


def test_a_restart_reuses_no_token_forgets_no_check_and_loses_no_record(env: BackendEnv) -> None:
    """One restart of the source (a kill -9 and a start on the same data; over ``http://`` the
    gateway killed too), three claims (one restart for all: each costs a server start, and
    a ``fenced serve`` start behind the http sources):

    - tokens keep increasing across it;
    - a check still tells the new holder's token (current) from an earlier one (stale), and a
      token above every grant from a real one where it knows;
    - records (a replicated group's configuration) survive it, and a swap from an older
      version is still refused."""
    requires(env, Characteristic.DURABLE)
    name, record = unique_name(), unique_name()
    with env.connect() as locks:
        for _ in range(3):
            with locks.lock(name, ttl=5) as lease:
                before = lease.token
        locks.swap_record(record, 0, "one")
        locks.swap_record(record, 1, "two")
    env.restart()
    with env.connect() as locks, locks.lock(name, ttl=10, timeout=30) as lease:
        assert lease.token > before
        old, now = locks.check(before), locks.check(lease.token)
        assert old.stale and not old.current, old
        assert now.current and not now.stale, now
        forged = locks.check(fenced.FencingToken(name, lease.token.value + 10**6))
        assert forged.never_granted and not forged.current
    with env.connect() as locks:
        wait_for(lambda: _readable(locks, record), what="the source to come back")
        assert locks.read_record(record) == fenced.Record(record, 2, "two")
        with pytest.raises(fenced.RecordConflict):
            locks.swap_record(record, 1, "stale")


def test_tokens_are_independent_per_lock(env: BackendEnv) -> None:
    a, b = unique_name(), unique_name()
    with env.connect() as locks, locks.lock(a, ttl=5) as la, locks.lock(b, ttl=5) as lb:
        assert la.held and lb.held
        with pytest.raises(fenced.WrongLockError):
            _ = la.token < lb.token


def test_expiry_then_takeover_with_higher_token(env: BackendEnv) -> None:
    name = unique_name()
    ttl = env.min_ttl
    with env.connect() as locks_a, env.connect() as locks_b:
        lost_calls: list[fenced.Lease] = []
        a = locks_a.lock(name, ttl=ttl, auto_renew=False, on_lost=lost_calls.append)
        token_a = a.acquire()
        b = locks_b.lock(name, ttl=10)
        token_b = b.acquire(timeout=ttl * 10 + 10)
        assert token_b > token_a
        assert a.lost.wait(ttl * 5 + 5), "the old holder was not told it lost the lease"
        assert isinstance(a.lost_cause, fenced.LeaseLostError)
        # (``lost`` is set, then ``on_lost`` called, on the loop's thread: wait for it)
        wait_for(lambda: lost_calls, what="on_lost to be called")
        assert lost_calls == [a]
        assert not a.held and a.remaining() == 0
        with pytest.raises(fenced.LeaseLostError):
            a.renew()
        # The stale holder's release must not free the new holder's grant.
        assert a.release() is False
        assert b.held
        c = locks_a.lock(name, ttl=5)
        with pytest.raises(fenced.LockTimeout):
            c.acquire(timeout=0)
        status = locks_a.status(name)
        assert status.token == token_b
        assert b.release() is True


def test_repeated_release_is_harmless(env: BackendEnv) -> None:
    name = unique_name()
    with env.connect() as locks:
        a = locks.lock(name, ttl=5)
        a.acquire()
        assert a.release() is True
        assert a.release() is False
        b = locks.lock(name, ttl=5)
        token_b = b.acquire(timeout=0)
        assert a.release() is False
        assert b.held and locks.status(name).token == token_b
        b.release()


def test_keepalive_holds_past_ttl(env: BackendEnv) -> None:
    name = unique_name()
    ttl = max(env.min_ttl, 1.0)
    with env.connect() as locks, env.connect() as other:
        with locks.lock(name, ttl=ttl) as lease:
            stop = threading.Event()
            # The holder is busy for longer than its ttl (the claim): half a ttl past it is
            # at least four renewals (every third of the ttl) that must all have landed.
            stop.wait(ttl * 1.5)
            assert lease.held and not lease.lost.is_set()
            assert 0 < lease.remaining() <= ttl
            with pytest.raises(fenced.LockTimeout):
                other.lock(name, ttl=5).acquire(timeout=0)
        assert lease.remaining() == 0


def test_timeout(env: BackendEnv) -> None:
    name = unique_name()
    with env.connect() as locks, env.connect() as other:
        holder = locks.lock(name, ttl=10)
        holder.acquire()
        start = time.monotonic()
        with pytest.raises(fenced.LockTimeout):
            other.lock(name, ttl=5).acquire(timeout=0)
        with pytest.raises(fenced.LockTimeout):
            other.lock(name, ttl=5).acquire(timeout=0.5)
        elapsed = time.monotonic() - start
        assert 0.5 <= elapsed < 5, elapsed
        holder.release()
        # A waiter that timed out must not be left in the queue to block the next one.
        late = other.lock(name, ttl=5)
        late.acquire(timeout=2)
        late.release()


def test_fifo_among_waiters(env: BackendEnv) -> None:
    requires(env, Characteristic.FIFO)
    name = unique_name()
    n = 4
    order: list[int] = []
    errors: list[BaseException] = []
    conns = [env.connect() for _ in range(n + 1)]
    try:
        holder = conns[0].lock(name, ttl=10)
        holder.acquire()

        def waiter(i: int) -> None:
            try:
                with conns[i + 1].lock(name, ttl=10, timeout=30):
                    order.append(i)
            except BaseException as exc:
                errors.append(exc)

        threads = []
        for i in range(n):
            t = threading.Thread(target=waiter, args=(i,))
            t.start()
            threads.append(t)
            wait_for(lambda i=i: conns[0].status(name).waiters == i + 1, what=f"waiter {i} queued")
        holder.release()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert order == list(range(n))
    finally:
        for c in conns:
            c.close()


def test_a_waiter_that_waits_past_its_ttl_gets_the_grant_it_queued_for(env: BackendEnv) -> None:
    """Bug: over ``http://`` a long poll's grant was dated from when the poll was sent, so a
    waiter that waited longer than its ttl took its grant for expired, gave it back and queued
    again at the end (with a new request id): FIFO lost, one grant wasted."""
    name = unique_name()
    holder_conn, waiter_conn = env.connect(), env.connect()
    try:
        holder = holder_conn.lock(name, ttl=10)
        holder.acquire()
        ttl = max(env.min_ttl, 0.5)  # (1 s on etcd and ZooKeeper: 2 s of waiting, 1 s elsewhere)
        waiter = waiter_conn.lock(name, ttl=ttl, request_id="queued-once")
        result: list[object] = []
        thread = threading.Thread(target=lambda: result.append(waiter.acquire(timeout=30)))
        thread.start()
        wait_for(lambda: holder_conn.status(name).waiters == 1, what="the waiter to queue")
        # The waiter must wait past its ttl (the claim): a grant dated from the poll's send
        # would then look two ttls old: expired a whole ttl ago.
        time.sleep(2 * ttl)
        holder.release()
        thread.join(30)
        assert result and waiter.held, result
        assert waiter.request_id == "queued-once"
        assert waiter.token.value > holder.token.value
        waiter.release()
    finally:
        holder_conn.close()
        waiter_conn.close()


def test_status_remembers_a_released_or_expired_lock(env: BackendEnv) -> None:
    """Every source answers the same for a lock granted before and free now: its last token,
    listed among the locks (before: etcd and ZooKeeper answered "unused", last token none,
    while SQLite, PostgreSQL and Redis remembered it) — after a release, after a grant made
    to a waiter, and after a lease that expired."""
    name = unique_name()
    with env.connect() as locks, env.connect() as other:
        with locks.lock(name, ttl=5) as lease:
            first = lease.token
        status = other.status(name)
        assert status.holder is None and status.token is None
        assert status.last_token == first, status
        assert name in other.lock_names()
        # a grant made to a waiter (queued behind the holder), then released
        holder = locks.lock(name, ttl=5)
        holder.acquire(timeout=5)
        waiter = other.lock(name, ttl=5)
        got: list[fenced.FencingToken] = []
        thread = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=30)))
        thread.start()
        wait_for(lambda: (other.status(name).waiters or 0) >= 1 or got, what="the waiter")
        holder.release()
        thread.join(30)
        assert got and got[0] > first
        waiter.release()
        assert other.status(name).last_token == got[0]
        assert holder.token is not None and other.status(name).last_token > holder.token
    if not env.cross_process:
        return  # (memory://: no other process can hold its locks, nor die holding one)
    # a holder killed (kill -9, `fenced lock` in its own process): its grant expires, and is
    # still the last one
    url = env.url
    if env.options:
        url += ("&" if "?" in url else "?") + "&".join(f"{k}={v}" for k, v in env.options.items())
    script = 'echo "$FENCING_TOKEN"; exec sleep 60'
    holder_proc = subprocess.Popen(
        [sys.executable, "-m", "fenced", "lock", name, "--ttl", str(env.min_ttl), "--url", url,
         "--timeout", "30", "--", "sh", "-c", script],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        expired = fenced.FencingToken.parse(holder_proc.stdout.readline().strip())  # type: ignore[union-attr]
    finally:
        holder_proc.kill()
        holder_proc.wait(30)
        holder_proc.stdout.close()  # type: ignore[union-attr]
    with env.connect() as other:
        wait_for(lambda: other.status(name).holder is None, timeout=60, what="the expiry")
        status = other.status(name)
        assert status.token is None and status.last_token == expired, status
        assert name in other.lock_names()


def test_status_shows_who_holds_it(env: BackendEnv) -> None:
    """Bug: status showed a 32-hex request id. Every source keeps the holder's own description
    (user@host pid N: description) with the grant, also when the grant is a hand-off to a
    waiter, and forgets it when the lock is released."""
    import os

    name = unique_name()
    me = f"pid {os.getpid()}"
    with env.connect() as locks, env.connect() as other:
        first = locks.lock(name, ttl=10, description="nightly report\nline two")
        first.acquire()
        owner = locks.status(name).owner
        assert owner is not None and me in owner and "@" in owner, owner
        assert owner.endswith(": nightly report line two"), owner  # one printable line
        waiter = other.lock(name, ttl=10, description="the next one")
        queued = threading.Thread(target=waiter.acquire, daemon=True)
        queued.start()
        wait_for(lambda: (locks.status(name).waiters or 0) >= 1, what="the waiter to queue")
        first.release()
        queued.join(20)
        assert waiter.held
        handed = locks.status(name)
        assert handed.token == waiter.token and handed.owner is not None
        assert handed.owner.endswith(": the next one"), handed.owner
        waiter.release()
        assert locks.status(name).owner is None
        with locks.lock(name, ttl=10):  # no description: still who and where
            plain = locks.status(name).owner
            assert plain is not None and plain.endswith(me), plain


def test_force_release_frees_only_that_grant_and_the_holder_learns(env: BackendEnv) -> None:
    """An operator's forced release (``fenced release --force``): it frees the current grant,
    never a later one (``token=``), hands the lock on with a higher token, and the old holder
    finds out (lost, at its next renewal at the latest)."""
    name = unique_name()
    with env.connect() as locks, env.connect() as other:
        stuck = locks.lock(name, ttl=1.5)
        first = stuck.acquire()
        assert other.force_release(name, token=fenced.FencingToken(name, first.value + 1)) is None
        assert locks.status(name).token == first  # a different token: nothing freed
        freed = other.force_release(name)
        assert freed is not None and freed.token == first and freed.owner
        assert other.force_release(name) is None  # nothing left to free
        with other.lock(name, ttl=5, timeout=10) as lease:
            assert lease.token > first
            assert stuck.lost.wait(10), "the old holder never learned it lost the lock"
            assert not stuck.held
            assert stuck.release() is False  # and its release frees nothing of the new grant
            assert other.status(name).token == lease.token


def test_path_like_names_are_separate_locks(env: BackendEnv) -> None:
    """Names like paths (``jobs/nightly``), as etcd, ZooKeeper and Consul users write them: a
    lock and the locks "under" it are unrelated locks (a key-prefix or node-path source must
    not let one's queue cover the other's), listed and reported by their own names."""
    base = unique_name()
    names = [base, f"{base}/nightly", f"{base}/nightly/eu-1", f"{base}:x/y"]
    with env.connect() as locks, env.connect() as other:
        held = [locks.lock(n, ttl=10) for n in names]
        for lease in held:
            lease.acquire(timeout=5)  # none of them waits for another
        for n, lease in zip(names, held, strict=True):
            status = other.status(n)
            assert status.token == lease.token and status.waiters == 0, (n, status)
            assert lease.token.value >= 1 and str(lease.token) == f"{n}:{lease.token.value}"
            assert fenced.FencingToken.parse(str(lease.token)) == lease.token
        with pytest.raises(fenced.LockTimeout):
            other.lock(names[1], ttl=10).acquire(timeout=0)
        listed = set(other.lock_names())  # (while held: etcd lists only locks with keys)
        assert set(names) <= listed, listed
        for lease in held:
            lease.release()
    for bad in (f"/{base}", f"{base}/", f"{base}//x", f"{base}/.x", f"{base}/-x"):
        with pytest.raises(fenced.InvalidTokenError):
            fenced.FencingToken(bad, 1)


def test_check_says_current_stale_or_unknown(env: BackendEnv) -> None:
    """``locks.check(token)`` (Chubby's CheckSequencer) on every source: the live grant is
    current; after a takeover the old token is stale; a lock never granted knows no highest.
    etcd and ZooKeeper know the highest grant only while the lock is held (they keep no
    counter), so a released token there is "not current" without being provably stale."""
    name = unique_name()
    with env.connect() as locks, env.connect() as other:
        never = locks.check(fenced.FencingToken(unique_name(), 1))
        assert not never.current and never.highest is None and not never.stale
        first = locks.lock(name, ttl=10)
        t1 = first.acquire()
        now = other.check(t1)
        assert now.current and now.is_highest and not now.stale
        assert other.check(str(t1)).current  # the text form too
        first.release()
        with other.lock(name, ttl=10) as second:
            old = locks.check(t1)
            assert not old.current and old.stale and old.highest == second.token
            assert locks.check(second.token).current
        after = locks.check(second.token)
        assert not after.current and not after.stale
        assert after.highest in (second.token, None)  # (None: etcd, ZooKeeper)


def test_idempotent_acquire_with_request_id(env: BackendEnv) -> None:
    name = unique_name()
    with env.connect() as locks:
        first = locks.lock(name, ttl=5, request_id="req-1")
        token = first.acquire()
        # A retry of the same request (its reply was lost) gets the same grant, not a second one.
        retry = locks.lock(name, ttl=5, request_id="req-1")
        assert retry.acquire(timeout=0) == token
        other = locks.lock(name, ttl=5, request_id="req-2")
        with pytest.raises(fenced.LockTimeout):
            other.acquire(timeout=0)
        assert first.release() is True
        assert retry.release() is False


async def test_backend_contract(env: BackendEnv) -> None:
    """Straight at the backend: idempotent acquire, fenced release, no renewal of a stale grant."""
    name = unique_name()
    async with env.connect_async() as locks:
        backend = locks.backend
        noop = lambda exc: None  # noqa: E731
        g1 = await backend.acquire(name, request_id="r", ttl=5, deadline=None, on_lost=noop)
        g2 = await backend.acquire(name, request_id="r", ttl=5, deadline=None, on_lost=noop)
        assert g1.token == g2.token
        renewed = await backend.renew(g1)
        assert renewed.token == g1.token and renewed.sent_at >= g1.sent_at
        assert await backend.release(g1) is True
        assert await backend.release(g2) is False
        with pytest.raises(fenced.LeaseLostError):
            await backend.renew(g1)
        g3 = await backend.acquire(name, request_id="r2", ttl=5, deadline=None, on_lost=noop)
        assert g3.token > g1.token
        # A late, repeated release or renewal of the old grant must not touch the new one.
        assert await backend.release(g1) is False
        with pytest.raises(fenced.LeaseLostError):
            await backend.renew(g1)
        status = await backend.status(name)
        assert status.token == g3.token and status.holder == "r2"
        assert await backend.release(g3) is True


async def test_async_api(env: BackendEnv) -> None:
    name = unique_name()
    async with env.connect_async() as locks:
        async with locks.lock(name, ttl=5) as lease:
            assert lease.held and 0 < lease.remaining() <= 5
            first = lease.token
        assert lease.remaining() == 0
        lost_seen: list[fenced.AsyncLease] = []

        async def on_lost(lease: fenced.AsyncLease) -> None:
            lost_seen.append(lease)

        a = locks.lock(name, ttl=env.min_ttl, auto_renew=False, on_lost=on_lost)
        ta = await a.acquire()
        assert ta > first
        async with env.connect_async() as other:
            b = other.lock(name, ttl=5)
            tb = await b.acquire(timeout=env.min_ttl * 10 + 10)
            assert tb > ta
            cause = await asyncio.wait_for(a.lost.wait(), env.min_ttl * 5 + 5)
            assert isinstance(cause, fenced.LeaseLostError)
            await async_wait_for(lambda: _true_if(lost_seen), what="on_lost")
            assert await a.release() is False
            assert await b.release() is True


async def _true_if(items: list[object]) -> bool:
    return bool(items)


def test_context_manager_reports_loss(env: BackendEnv) -> None:
    name = unique_name()
    with env.connect() as locks, env.connect() as other, pytest.raises(fenced.LeaseLostError):
        with locks.lock(name, ttl=env.min_ttl, auto_renew=False) as lease:
            other.lock(name, ttl=5).acquire(timeout=env.min_ttl * 10 + 10)
            assert lease.lost.wait(10)


def test_not_reentrant(env: BackendEnv) -> None:
    name = unique_name()
    with env.connect() as locks:
        lease = locks.lock(name, ttl=5)
        lease.acquire()
        with pytest.raises(fenced.LockError):
            lease.acquire(timeout=0)
        lease.release()


def test_require_characteristics(env: BackendEnv) -> None:
    have = env.characteristics
    for c in Characteristic:
        if c in have:
            fenced.connect(env.url, require={c.value}, **env.options).close()
        else:
            with pytest.raises(fenced.ConfigurationError, match=c.value):
                fenced.connect(env.url, require={c.value}, **env.options)


def test_bad_input(env: BackendEnv) -> None:
    with env.connect() as locks:
        for bad in ["", " x", "a b", "/a", "a/", "a//b", "x" * 201, "é"]:
            with pytest.raises(fenced.InvalidTokenError):
                locks.lock(bad)
        with pytest.raises(ValueError):
            locks.lock("ok", ttl=0)
        with pytest.raises(ValueError):
            locks.lock("ok", timeout=-1)


def test_closed_connection_is_a_typed_error(env: BackendEnv) -> None:
    locks = env.connect()
    lease = locks.lock(unique_name(), ttl=5)
    locks.close()
    with pytest.raises(fenced.BackendUnavailable):
        lease.acquire(timeout=1)
    with pytest.raises(fenced.BackendUnavailable):
        locks.status("x")


def test_dead_server_is_a_typed_error(env: BackendEnv) -> None:
    if not env.can_stop:
        pytest.skip(f"{env.name} has no server to stop")
    name = unique_name()
    with env.connect() as locks:
        with locks.lock(name, ttl=5) as lease:
            before = lease.token
        env.stop()
        try:
            with pytest.raises(fenced.BackendUnavailable):
                locks.lock(name, ttl=5).acquire(timeout=1)
        finally:
            env.start()
    with env.connect() as locks, locks.lock(name, ttl=5, timeout=30) as lease:
        assert lease.token > before


# -- fork after connect (Celery prefork, gunicorn --preload, multiprocessing) -----------------


def test_a_forked_child_gets_its_own_connection(env: BackendEnv) -> None:
    """Before: the child's first call waited forever on the parent's loop thread.

    The scenario runs in a fresh process (``tests.workers.fork_scenario``): a test process
    that other tests have used carries their threads and gRPC state into every child it
    forks, which is a hazard of its own (gRPC's fork handlers), not the one tested here.
    Both APIs, sync and async, each in its own process forked from that fresh one at once
    (one interpreter start and ``import fenced`` for both, not one per mode)."""
    if not env.cross_process:
        pytest.skip(f"{env.name} locks live in one process")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.workers.fork_scenario",
            env.url,
            json.dumps(env.options),
            "sync,async",
            "1" if env.survives_fork else "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_records_change_only_by_compare_and_set(env: BackendEnv) -> None:
    """A record (a replicated group's configuration) changes only from the version read:
    a swap from an older version is refused with the version found, and nothing is written."""
    name = unique_name()
    with env.connect() as locks:
        assert locks.read_record(name) is None
        first = locks.swap_record(name, 0, '{"members": ["a"]}')
        assert first == fenced.Record(name, 1, '{"members": ["a"]}')
        with pytest.raises(fenced.RecordConflict) as caught:
            locks.swap_record(name, 0, "lost")
        assert (caught.value.expected, caught.value.current) == (0, 1)
        second = locks.swap_record(name, 1, "ünïcode ✓" * 100)
        assert second.version == 2
        with pytest.raises(fenced.RecordConflict) as caught:
            locks.swap_record(name, 1, "lost")
        assert caught.value.current == 2
        with pytest.raises(fenced.RecordConflict):
            locks.swap_record(name, 7, "ahead")
        assert locks.read_record(name) == second
        assert name not in locks.lock_names()  # records are not locks
        with pytest.raises(fenced.ConfigurationError):
            locks.swap_record(name, -1, "x")
    with env.connect() as other:  # another connection sees the latest
        assert other.read_record(name) == second


def test_racing_swaps_from_one_version_let_exactly_one_win(env: BackendEnv) -> None:
    name = unique_name()
    with env.connect() as locks:
        locks.swap_record(name, 0, "start")
    results: list[str] = []
    go = threading.Barrier(6)

    def racer(i: int) -> None:
        with env.connect() as mine:
            go.wait(timeout=30)
            try:
                mine.swap_record(name, 1, f"racer {i}")
                results.append(f"won {i}")
            except fenced.RecordConflict:
                results.append("lost")

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [r for r in results if r.startswith("won")]
    assert len(results) == 6 and len(winners) == 1, results
    with env.connect() as locks:
        record = locks.read_record(name)
    assert record is not None and record.version == 2
    assert record.value == "racer " + winners[0].split()[1]


def _readable(locks: fenced.Locks, name: str) -> bool:
    try:
        locks.read_record(name)
        return True
    except fenced.BackendUnavailable:
        return False
