"""The etcd guard on a real etcd server.

Every property is checked by a function that can fail, and each is shown failing on a planted
bug: ``<`` instead of ``<=`` (:class:`LtGuard`), check-then-write in two requests
(:class:`CheckThenWriteGuard`), and a mark kept in the client instead of the resource
(:class:`ClientSideMarkGuard`). The resource's own log of accepted tokens is the history of
the data key, read back revision by revision.

The multi-process tests run ``tests.workers.guard_writer`` as their client processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import aetcd
import pytest
from aetcd import rpc

from fenced import (
    BackendUnavailable,
    ConfigurationError,
    CorruptMarkError,
    FencedError,
    FencingToken,
    InvalidTokenError,
    StaleTokenError,
    WrongLockError,
)
from fenced.guards.etcd import (
    RESERVED,
    Accepted,
    AsyncEtcdGuard,
    EtcdGuard,
    decode_value,
    delete_op,
    encode_value,
    put_op,
)
from fenced.testing.servers import EtcdServer
from tests.guards.processes import (
    BAD_TOKENS,
    LOCK,
    figure_8_5_violations,
    history_violations,
    paused_holder,
    race,
)
from tests.helpers import unique_name


def tok(value: int, lock: str = LOCK) -> FencingToken:
    return FencingToken(lock, value)


# --- planted bugs -----------------------------------------------------------------------------


class AsyncLtGuard(AsyncEtcdGuard):
    """Planted bug: ``<`` for ``<=`` — a token equal to the mark is refused."""

    def _accepts(self, token: int, mark: int) -> bool:
        return mark < token


class AsyncCheckThenWriteGuard(AsyncEtcdGuard):
    """Planted bug: read the mark, compare in the client, then write in a second request."""

    between: Callable[[], None] = staticmethod(lambda: None)

    async def write(
        self, ops: Sequence[rpc.RequestOp], token: FencingToken | str | bytes
    ) -> Accepted:
        t = self._token(token)
        high = await self.high_water()
        if high is not None and t.value < high.value:
            raise StaleTokenError(t, high, self.resource)
        self.between()
        request = rpc.TxnRequest()
        request.success.extend(
            [put_op(self.keys.lock, t.lock), put_op(self.keys.hw, encode_value(t.value)), *ops]
        )
        resp = await self._txn(request)
        return Accepted(resp.header.revision, resp.responses[2:])


class AsyncClientSideMarkGuard(AsyncEtcdGuard):
    """Planted bug: the mark lives in the client process, not in the resource."""

    mark = 0

    async def write(
        self, ops: Sequence[rpc.RequestOp], token: FencingToken | str | bytes
    ) -> Accepted:
        t = self._token(token)
        if t.value < self.mark:
            raise StaleTokenError(t, tok(self.mark, t.lock), self.resource)
        self.mark = t.value
        request = rpc.TxnRequest()
        request.success.extend(ops)
        resp = await self._txn(request)
        return Accepted(resp.header.revision, resp.responses)


class AsyncAnyPrefixGuard(AsyncEtcdGuard):
    """Planted bug (the old rule): any prefix is accepted, and only the guard's own prefix and
    the default key spaces are reserved, so a guard can rewrite another prefix's marks."""

    @staticmethod
    def _check_prefix(prefix: object) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ConfigurationError(f"prefix must be a non-empty str, not {prefix!r}")

    def _reserved_spaces(self) -> tuple[bytes, ...]:
        return (self.prefix, *(p for p in RESERVED if p != self.prefix))


class AnyPrefixGuard(EtcdGuard):
    _async_class = AsyncAnyPrefixGuard


class LtGuard(EtcdGuard):
    _async_class = AsyncLtGuard


class CheckThenWriteGuard(EtcdGuard):
    _async_class = AsyncCheckThenWriteGuard


class ClientSideMarkGuard(EtcdGuard):
    _async_class = AsyncClientSideMarkGuard


# --- the resource and its log -------------------------------------------------------------------


async def _history(endpoint: str, key: bytes) -> list[str]:
    """Every value ``key`` has had since it was created, oldest first (walks back by revision)."""
    host, _, port = endpoint.rpartition(":")
    async with aetcd.Client(host, int(port)) as client:
        values: list[str] = []
        resp = await client.kvstub.Range(rpc.RangeRequest(key=key))
        revision = resp.kvs[0].mod_revision if resp.kvs else 0
        while revision > 0:
            resp = await client.kvstub.Range(rpc.RangeRequest(key=key, revision=revision))
            if not resp.kvs:
                break
            kv = resp.kvs[0]
            values.append(kv.value.decode())
            revision = kv.mod_revision - 1 if kv.version > 1 else 0
        return values[::-1]


class Resource:
    """One guarded resource in etcd: its data key; the data's history is the log."""

    def __init__(self, endpoint: str, name: str | None = None) -> None:
        self.endpoint = endpoint
        self.name = name or unique_name("res")
        self.data = f"{self.name}/data"

    def write(self, guard: EtcdGuard, value: int, who: str = "w") -> None:
        guard.put(self.data, f"{value}:{who}", token=tok(value))

    def history(self) -> list[str]:
        return asyncio.run(_history(self.endpoint, self.data.encode()))

    def accepted(self) -> list[int]:
        return [int(v.split(":")[0]) for v in self.history()]

    def value(self) -> str | None:
        history = self.history()
        return history[-1] if history else None

    def snapshot(self) -> list[tuple[bytes, bytes, int]]:
        """Every key of the resource (data and fence keys) with its value and mod revision."""

        async def read() -> list[tuple[bytes, bytes, int]]:
            host, _, port = self.endpoint.rpartition(":")
            async with aetcd.Client(host, int(port)) as client:
                out = []
                for prefix in (
                    f"{self.name}/",
                    f"fenced/hw/{self.name}",
                    f"fenced/lock/{self.name}",
                ):
                    resp = await client.kvstub.Range(
                        rpc.RangeRequest(key=prefix.encode(), range_end=prefix.encode() + b"\xff")
                    )
                    out += [(kv.key, kv.value, kv.mod_revision) for kv in resp.kvs]
                return out

        return asyncio.run(read())


# --- checkers (the same as the Redis guard's, on etcd) --------------------------------------


def sequential_violations(guard_cls: type[EtcdGuard], endpoint: str) -> list[str]:
    """One holder writes twice with its token; a later holder's token; the old one again."""
    res = Resource(endpoint)
    bad: list[str] = []
    with guard_cls(endpoint, res.name, lock=LOCK) as guard:
        for value, should_pass in [
            (5, True),
            (5, True),
            (7, True),
            (7, True),
            (6, False),
            (7, True),
        ]:
            try:
                res.write(guard, value)
                if not should_pass:
                    bad.append(f"stale token {value} accepted")
            except StaleTokenError as exc:
                if should_pass:
                    bad.append(f"token {value} refused (mark {exc.high_water})")
    return bad + history_violations(res.accepted(), res.value())


def interleaved_violations(guard_cls: type[EtcdGuard], endpoint: str) -> list[str]:
    """Two clients, step by step: A (token 6) decides to write, B (token 7) writes, A's lands.

    For a two-step guard, B's write runs in the gap between A's check and A's write. An atomic
    guard has no such gap: the latest point B can come is just before A's one transaction.
    """
    res = Resource(endpoint)
    with (
        guard_cls(endpoint, res.name, lock=LOCK) as a,
        guard_cls(endpoint, res.name, lock=LOCK) as b,
    ):
        res.write(a, 5, "first")

        def b_writes() -> None:
            res.write(b, 7, "B")

        with contextlib.suppress(StaleTokenError):
            if isinstance(a.aio, AsyncCheckThenWriteGuard):
                a.aio.between = b_writes
            else:
                b_writes()
            res.write(a, 6, "A")
        bad = history_violations(res.accepted(), res.value())
        high = a.high_water()
        if high is None or high.value != 7:
            bad.append(f"the mark went back to {high}")
        return bad


def restart_violations(guard_cls: type[EtcdGuard], server: EtcdServer) -> list[str]:
    """After kill -9 and a restart, a new client process must still refuse the old token."""
    res = Resource(server.endpoint)
    with guard_cls(server.endpoint, res.name, lock=LOCK) as guard:
        res.write(guard, 9, "before")
    server.restart(kill=True)
    with guard_cls(server.endpoint, res.name, lock=LOCK) as guard:  # a new process's guard
        with contextlib.suppress(StaleTokenError):
            res.write(guard, 8, "stale")
    return history_violations(res.accepted(), res.value())


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def guard(etcd_server: EtcdServer) -> Iterator[EtcdGuard]:
    with EtcdGuard(etcd_server.endpoint, unique_name("res"), lock=LOCK) as g:
        yield g


@pytest.fixture(scope="module")
def own_server() -> Iterator[EtcdServer]:
    """A server of this module's own, for tests that kill, pause or restart it."""
    with EtcdServer() as server:
        yield server  # type: ignore[misc]


# --- the encoding ------------------------------------------------------------------------------


def test_encoding_byte_order_is_numeric_order() -> None:
    rng = random.Random(7)
    values = [1, 9, 10, 99, 100, 2**53, 2**53 + 1, 2**63 - 2, 2**63 - 1]
    values += [rng.randrange(1, 2**63) for _ in range(2000)]
    values += [rng.randrange(1, 10 ** rng.randrange(1, 19)) for _ in range(2000)]
    for a in values:
        assert len(encode_value(a)) == 19 and decode_value(encode_value(a)) == a
    ordered = sorted(set(values))
    assert sorted(encode_value(v) for v in ordered) == [encode_value(v) for v in ordered]
    # Unpadded decimal text is NOT ordered: the bug the padding prevents.
    assert str(10).encode() < str(9).encode()
    for raw in (b"", b"12", b"x" * 19, b"-" + b"1" * 18, encode_value(2**63), b"9" * 19):
        with pytest.raises(ValueError):
            decode_value(raw)


# --- the basic contract -------------------------------------------------------------------------


def test_stale_refused_current_and_equal_accepted(etcd_server: EtcdServer) -> None:
    assert sequential_violations(EtcdGuard, etcd_server.endpoint) == []


def test_put_delete_write(guard: EtcdGuard, etcd_server: EtcdServer) -> None:
    res = Resource(etcd_server.endpoint, guard.resource)
    assert guard.high_water() is None
    first = guard.put(res.data, "v1", token=tok(9))  # binds the resource, then writes
    second = guard.put(res.data, "v2", token=f"{LOCK}:10")  # the text form works too
    assert second > first > 0
    with pytest.raises(StaleTokenError) as info:
        guard.put(res.data, "stale", token=tok(9))
    assert info.value.token == tok(9) and info.value.high_water == tok(10)
    assert info.value.resource == guard.resource
    # Byte order across a change of length: 99 -> 100 accepted, then 99 refused.
    guard.put(res.data, "v3", token=tok(99))
    guard.put(res.data, "v4", token=tok(100))
    with pytest.raises(StaleTokenError):
        guard.put(res.data, "stale", token=tok(99))
    assert res.history() == ["v1", "v2", "v3", "v4"]
    assert guard.delete(res.data, token=tok(100)) is True
    assert guard.delete(res.data, token=tok(100)) is False
    other, third = f"{guard.resource}/other", f"{guard.resource}/third"
    guard.put(third, "x", token=tok(100))
    accepted = guard.write(
        [put_op(res.data, "a"), put_op(other, "b"), delete_op(third)], token=tok(2**63 - 1)
    )
    assert accepted.replies[2].response_delete_range.deleted == 1
    assert guard.high_water() == tok(2**63 - 1)
    assert res.history() == ["a"]  # the data key's life since it was created again


def test_lock_binding(etcd_server: EtcdServer) -> None:
    """Without ``lock=``, the resource binds to the first token's lock and refuses others."""
    res = Resource(etcd_server.endpoint)
    with EtcdGuard(etcd_server.endpoint, res.name) as unbound:
        unbound.put(res.data, "a", token=tok(10))
        with pytest.raises(WrongLockError):
            unbound.put(res.data, "b", token=FencingToken("other", 10**6))
    with EtcdGuard(etcd_server.endpoint, res.name, lock="other") as wrong:
        with pytest.raises(WrongLockError):
            wrong.put(res.data, "c", token=tok(11))  # refused before anything is sent
        with pytest.raises(WrongLockError):
            wrong.put(res.data, "c", token=FencingToken("other", 11))  # refused by the resource
    assert res.history() == ["a"]


def _etcd_put(endpoint: str, key: str, value: bytes | None) -> None:
    """Set (or, with None, delete) a key directly, as an operator or a bug would."""

    async def go() -> None:
        host, _, port = endpoint.rpartition(":")
        async with aetcd.Client(host, int(port)) as client:
            if value is None:
                await client.delete(key.encode())
            else:
                await client.put(key.encode(), value)

    asyncio.run(go())


CORRUPT_MARKS = [
    b"",
    b" ",
    b"-5",
    b"+5000",
    b"0",
    b"000",
    b"0" * 20,
    b"0" * 18 + b"5x",
    b"9" * 19,
    b"1e3",
    b"000000000000000001\n",
]


@pytest.mark.parametrize("mark", CORRUPT_MARKS, ids=repr)
def test_corrupt_mark_fails_closed(etcd_server: EtcdServer, mark: bytes) -> None:
    """A damaged mark refuses every write (old code accepted any token: bytes sort below it)."""
    res = Resource(etcd_server.endpoint)
    with EtcdGuard(etcd_server.endpoint, res.name, lock=LOCK) as guard:
        res.write(guard, 10, "ten")
        _etcd_put(etcd_server.endpoint, f"fenced/hw/{res.name}", mark)
        for value in (1, 3, 10, 11, 2**63 - 1):
            with pytest.raises(CorruptMarkError, match="corrupt") as info:
                res.write(guard, value, "late")
            assert info.value.resource == res.name
        with pytest.raises(CorruptMarkError):
            guard.high_water()
    assert res.history() == ["10:ten"]


@pytest.mark.parametrize("missing", ["hw", "lock"])
def test_mark_missing_but_bound_fails_closed(etcd_server: EtcdServer, missing: str) -> None:
    """Deleting one fence key is damage, not a fresh resource (the mark would restart at 0)."""
    res = Resource(etcd_server.endpoint)
    with EtcdGuard(etcd_server.endpoint, res.name, lock=LOCK) as guard:
        res.write(guard, 10, "ten")
        _etcd_put(etcd_server.endpoint, f"fenced/{missing}/{res.name}", None)
        for value in (3, 11):
            with pytest.raises(CorruptMarkError):
                res.write(guard, value, "late")
    assert res.history() == ["10:ten"]


def test_no_write_touches_any_fence_key(etcd_server: EtcdServer) -> None:
    """Resource A's guard cannot rewrite B's mark or lock key, by put or by a delete range."""
    a_res, b_res = Resource(etcd_server.endpoint), Resource(etcd_server.endpoint)
    with (
        EtcdGuard(etcd_server.endpoint, a_res.name, lock=LOCK) as a,
        EtcdGuard(etcd_server.endpoint, b_res.name, lock=LOCK) as b,
    ):
        res_b_write = b.put(b_res.data, "b10", token=tok(10))
        assert res_b_write > 0
        wide = delete_op(b"a")
        wide.request_delete_range.range_end = b"\0"
        for attempt in (
            lambda: a.put(f"fenced/hw/{b_res.name}", encode_value(1), token=tok(20)),
            lambda: a.put(f"fenced/lock/{b_res.name}", "x", token=tok(20)),
            lambda: a.delete(f"fenced/hw/{b_res.name}", token=tok(20)),
            lambda: a.put("fenced/other", "x", token=tok(20)),
            lambda: a.write([wide], token=tok(20)),
        ):
            with pytest.raises(ConfigurationError, match="reserved"):
                attempt()
        assert b.high_water() == tok(10)
        with pytest.raises(StaleTokenError):
            b.put(b_res.data, "b3", token=tok(3))


def test_no_guard_touches_the_default_fence_keys_whatever_its_prefix(
    etcd_server: EtcdServer,
) -> None:
    """A guard with another prefix cannot rewrite or delete the default prefix's marks, nor
    the etcd lock source's keys; its writes outside fenced's key spaces are accepted."""
    res, other = Resource(etcd_server.endpoint), Resource(etcd_server.endpoint)
    with (
        EtcdGuard(etcd_server.endpoint, res.name, lock=LOCK) as owner,
        EtcdGuard(etcd_server.endpoint, other.name, lock=LOCK, prefix="fenced/custom/") as attacker,
    ):
        res.write(owner, 10, "ten")
        for attempt in (
            lambda: attacker.delete(f"fenced/hw/{res.name}", token=tok(20)),
            lambda: attacker.delete(f"fenced/lock/{res.name}", token=tok(20)),
            lambda: attacker.put(f"fenced/hw/{res.name}", encode_value(1), token=tok(20)),
            lambda: attacker.delete("/fenced/locks/jobs/holder", token=tok(20)),
            lambda: attacker.write([_range_delete(b"fenced", b"fencee")], token=tok(20)),
            lambda: attacker.write([_range_delete(b"/", b"/g")], token=tok(20)),
        ):
            with pytest.raises(ConfigurationError, match="reserved"):
                attempt()
        assert owner.high_water() == tok(10)
        with pytest.raises(StaleTokenError):
            res.write(owner, 3, "late")
        assert attacker.put(f"{other.name}/fenced/x", "ok", token=tok(20)) > 0  # not a prefix
        assert attacker.put(other.data, "ok", token=tok(20)) > 0
    assert res.history() == ["10:ten"]


def foreign_prefix_violations(
    guard_cls: type[EtcdGuard], endpoint: str, prefixes: tuple[str, str]
) -> list[str]:
    """Guard B (prefix ``prefixes[1]``) holds a mark; guard A (``prefixes[0]``) tries to put and
    delete B's fence keys (one key, a range): each must be refused before anything is sent,
    B's mark must stay, and A's ordinary writes must go through."""
    res, other = Resource(endpoint), Resource(endpoint)
    bad: list[str] = []
    with (
        guard_cls(endpoint, res.name, lock=LOCK, prefix=prefixes[1]) as owner,
        guard_cls(endpoint, other.name, lock=LOCK, prefix=prefixes[0]) as attacker,
    ):
        res.write(owner, 10, "ten")
        hw, lock = (f"{prefixes[1]}{k}/{res.name}" for k in ("hw", "lock"))
        start = prefixes[1].encode()
        for what, attempt in (
            ("put hw", lambda: attacker.put(hw, encode_value(1), token=tok(20))),
            ("put lock", lambda: attacker.put(lock, "other-lock", token=tok(20))),
            ("delete hw", lambda: attacker.delete(hw, token=tok(20))),
            ("delete lock", lambda: attacker.delete(lock, token=tok(20))),
            (
                "delete range",
                lambda: attacker.write([_range_delete(start, start + b"\xff")], token=tok(20)),
            ),
        ):
            try:
                attempt()
                bad.append(f"{what} of another prefix's fence key accepted")
            except ConfigurationError:
                pass
    # A new process's view of B: its guard has seen nothing, so only the mark itself protects.
    with guard_cls(endpoint, res.name, lock=LOCK, prefix=prefixes[1]) as fresh:
        try:
            if fresh.high_water() != tok(10):
                bad.append(f"the mark is now {fresh.high_water()}")
        except CorruptMarkError as exc:
            bad.append(f"the mark was damaged: {exc}")
        with contextlib.suppress(StaleTokenError, CorruptMarkError, WrongLockError):
            res.write(fresh, 3, "late")
            bad.append("a stale token accepted after the mark was rewritten")
        try:
            res.write(fresh, 11, "eleven")  # the rightful holder goes on
        except FencedError as exc:
            bad.append(f"the rightful holder refused: {exc!r}")
    with guard_cls(endpoint, other.name, lock=LOCK, prefix=prefixes[0]) as attacker:
        if attacker.put(other.data, "ok", token=tok(20)) <= 0:
            bad.append("the other guard's own write failed")
    if res.history() != ["10:ten", "11:eleven"]:
        bad.append(f"history {res.history()}")
    return bad


def test_no_guard_touches_another_prefix_fence_keys(etcd_server: EtcdServer) -> None:
    for prefixes in (
        ("fenced/a/", "fenced/b/"),
        ("fenced/", "fenced/b/"),
        ("fenced/a/", "fenced/"),
    ):
        assert foreign_prefix_violations(EtcdGuard, etcd_server.endpoint, prefixes) == []


def test_foreign_prefix_check_catches_any_prefix_guard(etcd_server: EtcdServer) -> None:
    bad = foreign_prefix_violations(AnyPrefixGuard, etcd_server.endpoint, ("app-a/", "app-b/"))
    assert "put hw of another prefix's fence key accepted" in bad, bad
    assert "delete range of another prefix's fence key accepted" in bad, bad


@pytest.mark.parametrize("prefix", ["custom/", "fenced", "/fenced/", "", "Fenced/", None])
def test_prefix_outside_the_reserved_space_is_refused(etcd_server: EtcdServer, prefix: Any) -> None:
    with pytest.raises(ConfigurationError, match="prefix must start with 'fenced/'"):
        EtcdGuard(etcd_server.endpoint, unique_name("res"), lock=LOCK, prefix=prefix)


def test_fence_keys_gone_or_lower_after_being_seen_fail_closed(etcd_server: EtcdServer) -> None:
    """Both fence keys deleted (an operator, a bug) would rebind the mark at 0: the guard that
    saw the mark refuses; so it does once a fresh guard has bound them again lower."""
    res = Resource(etcd_server.endpoint)
    with EtcdGuard(etcd_server.endpoint, res.name, lock=LOCK) as seen:
        res.write(seen, 10, "ten")
        for key in ("hw", "lock"):
            _etcd_put(etcd_server.endpoint, f"fenced/{key}/{res.name}", None)
        for value in (3, 10, 11):
            with pytest.raises(CorruptMarkError, match="gone"):
                res.write(seen, value, "late")
        with pytest.raises(CorruptMarkError):
            seen.high_water()
        with EtcdGuard(etcd_server.endpoint, res.name, lock=LOCK) as fresh:
            res.write(fresh, 4, "four")  # cannot know: binds the mark again at 4
        with pytest.raises(CorruptMarkError, match="went back"):
            res.write(seen, 5, "late")
        with pytest.raises(CorruptMarkError, match="went back"):
            seen.high_water()
    assert res.history() == ["10:ten", "4:four"]


def test_new_holder_after_handoff_and_many_writers(etcd_server: EtcdServer) -> None:
    """Two guards (two processes' views) interleave: each sees the other's mark and adapts."""
    res = Resource(etcd_server.endpoint)
    with (
        EtcdGuard(etcd_server.endpoint, res.name, lock=LOCK) as old,
        EtcdGuard(etcd_server.endpoint, res.name, lock=LOCK) as new,
    ):
        res.write(old, 5, "old")
        res.write(old, 5, "old")
        res.write(new, 9, "new")  # its guess (9) misses, reads 5, writes: two round trips
        with pytest.raises(StaleTokenError) as info:
            res.write(old, 5, "old")  # its cached mark (5) is out of date: refused all the same
        assert info.value.high_water == tok(9)
        res.write(new, 9, "new")
    assert res.accepted() == [5, 5, 9, 9]


@pytest.mark.parametrize("bad", BAD_TOKENS, ids=repr)
def test_malformed_or_foreign_tokens_change_nothing(
    guard: EtcdGuard, etcd_server: EtcdServer, bad: Any
) -> None:
    res = Resource(etcd_server.endpoint, guard.resource)
    res.write(guard, 5, "kept")
    before = res.snapshot()
    expected: type[Exception] = (
        WrongLockError if isinstance(bad, FencingToken) else InvalidTokenError
    )
    for attempt in (
        lambda: guard.put(res.data, "x", token=bad),
        lambda: guard.delete(res.data, token=bad),
        lambda: guard.write([put_op(res.data, "x")], token=bad),
    ):
        with pytest.raises(expected):
            attempt()
    assert res.snapshot() == before


def test_refused_writes_change_nothing(guard: EtcdGuard, etcd_server: EtcdServer) -> None:
    res = Resource(etcd_server.endpoint, guard.resource)
    res.write(guard, 50, "kept")
    guard.put(f"{res.name}/other", "kept", token=tok(50))
    before = res.snapshot()
    for attempt in (
        lambda: guard.put(res.data, "x", token=tok(49)),
        lambda: guard.delete(res.data, token=tok(1)),
        lambda: guard.write(
            [put_op(f"{res.name}/new", "x"), delete_op(f"{res.name}/other")], token=tok(49)
        ),
    ):
        with pytest.raises(StaleTokenError):
            attempt()
    assert res.snapshot() == before  # same values, same mod revisions: nothing was written


def test_bad_arguments(guard: EtcdGuard) -> None:
    hw_key = f"fenced/hw/{guard.resource}"
    for attempt in (
        lambda: guard.put(hw_key, "x", token=tok(1)),
        lambda: guard.put(f"fenced/lock/{guard.resource}", "x", token=tok(1)),
        lambda: guard.put("k", 5, token=tok(1)),  # type: ignore[arg-type]
        lambda: guard.write([_range_delete(b"fenced/", b"fenced0")], token=tok(1)),
        lambda: guard.write([_range_delete(b"a", b"\0")], token=tok(1)),
        lambda: guard.write(
            [rpc.RequestOp(request_range=rpc.RangeRequest(key=b"k"))], token=tok(1)
        ),
    ):
        with pytest.raises(ConfigurationError):
            attempt()
    assert guard.high_water() is None  # nothing was sent
    guard.write(
        [_range_delete(f"{guard.resource}/".encode(), f"{guard.resource}0".encode())], token=tok(1)
    )
    for bad in ("h:x", "h:0", "h:1,,h:2", "u:p@h:1", "etcd+https://h:1", "[::1"):
        with pytest.raises(ConfigurationError):
            EtcdGuard(bad, "r")


def _range_delete(key: bytes, end: bytes) -> rpc.RequestOp:
    op = delete_op(key)
    op.request_delete_range.range_end = end
    return op


async def test_async_guard(etcd_server: EtcdServer) -> None:
    async with aetcd.Client("127.0.0.1", etcd_server.port) as client:
        name = unique_name("res")
        guard = AsyncEtcdGuard(client, name, lock=LOCK)
        assert await guard.high_water() is None
        await guard.put(f"{name}/k", "a", token=tok(2))
        await guard.put(f"{name}/k", "b", token=tok(2))
        with pytest.raises(StaleTokenError):
            await guard.put(f"{name}/k", "stale", token=tok(1))
        with pytest.raises(WrongLockError):
            await guard.delete(f"{name}/k", token=FencingToken("x", 9))
        assert await guard.delete(f"{name}/k", token=tok(3)) is True
        assert await guard.high_water() == tok(3)
        assert (await client.get(f"fenced/hw/{name}".encode())).value == encode_value(3)


async def test_a_write_landing_while_a_request_is_on_its_way_is_no_step_back(
    etcd_server: EtcdServer,
) -> None:
    """Two coroutines on one guard: the one writing 104 learns the mark (103) from a refused
    write, and the other's 105 is accepted while that answer is on its way. The answer then
    shows 103 below the 105 this guard saw accepted — not a mark that went back (the
    ZooKeeper guard's racing writers were refused so: CorruptMarkError). 104 is refused as
    stale, 105 stays."""
    async with aetcd.Client("127.0.0.1", etcd_server.port) as client:
        name = unique_name("res")
        await AsyncEtcdGuard(client, name, lock=LOCK).fence(tok(103))
        guard = AsyncEtcdGuard(client, name, lock=LOCK)
        real, landed = guard._txn, []

        async def txn(*args: Any, **kwargs: Any) -> Any:
            answer = await real(*args, **kwargs)
            if not landed:
                landed.append(True)
                await guard.fence(tok(105))  # (the other coroutine's write, meanwhile)
            return answer

        guard._txn = txn  # type: ignore[method-assign]
        with pytest.raises(StaleTokenError):
            await guard.fence(tok(104))
        assert landed and await guard.high_water() == tok(105)


# --- planted bugs are caught by the same checks --------------------------------------------------


def test_sequential_check_catches_lt(etcd_server: EtcdServer) -> None:
    bad = sequential_violations(LtGuard, etcd_server.endpoint)
    assert any("token 5 refused" in b for b in bad), bad  # the holder's second write


def test_interleaved_writers(etcd_server: EtcdServer) -> None:
    assert interleaved_violations(EtcdGuard, etcd_server.endpoint) == []


def test_interleaved_check_catches_check_then_write(etcd_server: EtcdServer) -> None:
    bad = interleaved_violations(CheckThenWriteGuard, etcd_server.endpoint)
    assert any("accepted after" in b for b in bad), bad
    assert any("mark went back" in b for b in bad), bad


# --- restart and dead server ---------------------------------------------------------------------


def test_restart_keeps_the_mark(own_server: EtcdServer) -> None:
    assert restart_violations(EtcdGuard, own_server) == []


def test_restart_check_catches_client_side_mark(own_server: EtcdServer) -> None:
    bad = restart_violations(ClientSideMarkGuard, own_server)
    assert any("accepted after" in b for b in bad), bad


def test_unavailable_server(own_server: EtcdServer) -> None:
    name = unique_name("res")
    with EtcdGuard(own_server.endpoint, name, lock=LOCK, timeout=0.5) as guard:
        guard.put(f"{name}/k", "a", token=tok(1))
        own_server.pause()  # a hung server: the request times out
        try:
            with pytest.raises(BackendUnavailable):
                guard.put(f"{name}/k", "b", token=tok(1))
        finally:
            own_server.resume()
        own_server.kill()  # a dead server: the connection is refused
        try:
            for attempt in (lambda: guard.put(f"{name}/k", "c", token=tok(1)), guard.high_water):
                with pytest.raises(BackendUnavailable):
                    attempt()
        finally:
            own_server.start()
    guard.close()
    with pytest.raises(BackendUnavailable):  # a closed guard
        guard.put(f"{name}/k", "d", token=tok(1))


# --- separate OS processes -------------------------------------------------------------------


def test_racing_processes_never_accept_out_of_order(etcd_server: EtcdServer) -> None:
    res = Resource(etcd_server.endpoint)
    counts = race(f"etcd:{etcd_server.endpoint}", res.name, writers=4, per_writer=60)
    log = res.accepted()
    assert len(log) == sum(counts) > 0
    assert history_violations(log, res.value()) == []
    with EtcdGuard(etcd_server.endpoint, res.name, lock=LOCK) as guard:
        assert guard.high_water() == tok(max(log))


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_paused_holder_end_to_end(etcd_server: EtcdServer, tmp_path: Path, guarded: bool) -> None:
    res = Resource(etcd_server.endpoint)
    run = paused_holder(
        f"sqlite:///{tmp_path}/locks.db", f"etcd:{etcd_server.endpoint}", res.name, guarded
    )
    bad = figure_8_5_violations(run, res.value())
    if guarded:
        assert bad == []
        assert run["ev1"]["high_water"] == run["t2"]
    else:  # the checker catches the unguarded write
        assert "the paused holder's stale write was accepted" in bad


def test_the_guard_fails_over_to_another_member() -> None:
    """One etcd client layer: the guard uses the source's transport. With a three-member
    cluster, stopping the member it talks to costs at most one write (outcome unknown,
    BackendUnavailable); the next write goes to another member, and the rule still holds."""
    from fenced.testing.servers import EtcdCluster

    with EtcdCluster(3) as cluster:
        endpoints = ",".join(m.endpoint for m in cluster.members)
        res = Resource(cluster.members[0].endpoint)
        with EtcdGuard(endpoints, res.name, lock=LOCK, timeout=2) as guard:
            res.write(guard, 5, "before")
            current = guard.aio._client.current.endpoint  # type: ignore[union-attr]
            victim = next(m for m in cluster.members if m.endpoint == current)
            victim.stop()
            outcomes = []
            for _ in range(3):
                try:
                    guard.put(res.data, "6:after", token=tok(6))
                    outcomes.append("ok")
                except BackendUnavailable:
                    outcomes.append("unknown")
            assert outcomes.count("ok") >= 2, outcomes
            assert outcomes[-1] == "ok"
            with pytest.raises(StaleTokenError):
                guard.put(res.data, "4:stale", token=tok(4))
            assert guard.high_water() == tok(6)
