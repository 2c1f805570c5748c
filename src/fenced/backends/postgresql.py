"""``postgresql://user@host:port/db``: a durable, linearizable, FIFO token source on PostgreSQL.

Design (details and measurements in ``docs/backend-postgresql.md``):

* One row per lock in ``<prefix>locks`` holds the lock's counter ``last_token`` and its current
  holder. A grant advances the counter *in the same transaction* that records the holder, and
  the row is never reset or deleted, so tokens rise strictly, forever, across restarts.
* Every session sets ``synchronous_commit = on`` itself: a grant is acknowledged only after
  its commit is on disk (and, with synchronous replication, on the standbys the server waits for).
* Expiry is judged only by the database's clock (``clock_timestamp()`` inside the statements).
* Each operation is one call of a PL/pgSQL function, so the uncontended acquire and release are
  one round trip and one transaction each. The functions are installed (idempotently, under an
  advisory lock) by :meth:`PostgreSQLBackend.open`; :meth:`PostgreSQLBackend.schema_sql` gives
  the same DDL for a DBA to run by hand.
* Waiters queue FIFO in ``<prefix>waiters`` (a ``bigserial`` id), with an expiry that they
  renew while waiting, so a dead waiter stops blocking the queue when its row expires. The
  release (or a queued waiter giving up) sends a ``NOTIFY`` in its transaction to the head
  waiter only, on a channel private to the waiter's connection. Waiters also re-check at the
  holder's known expiry time and at their heartbeat, never by blind polling.
* A backend uses one connection for commands and, only once it has had to wait, a second one
  that LISTENs. A broken connection is replaced on the next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import select
from collections.abc import Callable
from typing import Any, ClassVar
from urllib.parse import SplitResult, urlsplit

import psycopg
from psycopg import pq, sql

from .._clients.pg_errors import connect_refusal
from .._clients.pg_errors import kind as pg_kind
from .._core import clock as _clock
from .._core.backend import (
    Backend,
    Characteristic,
    Grant,
    LockStatus,
    LostCallback,
    Record,
    UnsureReleases,
    call_bound,
    lock_timeout,
    wait_budget,
)
from .._core.errors import (
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    LeaseLostError,
    RecordConflict,
    UnsafeBackendError,
)
from .._core.token import FencingToken
from ._postgresql_schema import (
    DDL,
    INSTALL_LOCK,
    OPTIONS,
    SESSION_SETUP,
    Names,
    check_libpq_query,
    wake_key,
)

__all__ = ["PostgreSQLBackend"]

_Conn = psycopg.AsyncConnection[tuple[Any, ...]]
_Row = tuple[Any, ...]

_OWN = "own"
"""The handle of a grant made by this backend's acquire: its release is its holder's own."""


class _Listener:
    """The LISTEN connection: one channel private to this backend, one event per waiter.

    The connection is read by an event-loop reader callback, not by a task, so it costs nothing
    while no notification arrives. If it breaks, every waiter is woken to re-check (and to
    LISTEN again through a new connection before it waits). It is closed once no waiter has
    needed it for ``linger`` seconds: PostgreSQL (up to 18 at least) signals *every* listening
    backend of the database on each NOTIFY, whatever the channel, so idle listeners are not free.
    """

    def __init__(self, backend: PostgreSQLBackend, channel: str, linger: float) -> None:
        self._backend = backend
        self.channel = channel
        self._linger = linger
        self._idle_timer: asyncio.TimerHandle | None = None
        self._conn: _Conn | None = None
        self._fd = -1
        self._lock: asyncio.Lock | None = None
        self._events: dict[str, set[asyncio.Event]] = {}

    @property
    def alive(self) -> bool:
        return self._conn is not None and not self._conn.closed

    def register(self, key: str, event: asyncio.Event) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._events.setdefault(key, set()).add(event)

    def unregister(self, key: str, event: asyncio.Event) -> None:
        events = self._events.get(key)
        if events is not None:
            events.discard(event)
            if not events:
                del self._events[key]
        if not self._events and self.alive and self._idle_timer is None:
            self._idle_timer = asyncio.get_running_loop().call_later(
                self._linger, self._close_if_idle
            )

    def _close_if_idle(self) -> None:
        self._idle_timer = None
        if not self._events:
            self.drop()

    async def ensure(self) -> None:
        """Make sure the channel is LISTENed to (so no later NOTIFY to it can be missed)."""
        if self.alive:
            return
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.alive:
                return
            conn = await self._backend._connect(session=False)
            try:
                conn.add_notify_handler(lambda n: self._dispatch(n.payload))
                listen = sql.SQL("LISTEN {}").format(sql.Identifier(self.channel))
                async with asyncio.timeout(self._backend._connect_timeout):
                    await conn.execute(listen)
                fd = conn.fileno()
                asyncio.get_running_loop().add_reader(fd, self._on_readable)
            except (psycopg.Error, OSError, TimeoutError) as exc:
                await conn.close()
                raise BackendUnavailable(f"PostgreSQL LISTEN failed: {exc}") from exc
            self._conn, self._fd = conn, fd

    def _on_readable(self) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            pgconn = conn.pgconn
            pgconn.consume_input()
            while (n := pgconn.notifies()) is not None:
                self._dispatch(n.extra.decode())
            if pgconn.status != pq.ConnStatus.OK:
                raise psycopg.OperationalError("listener connection lost")
        except (psycopg.Error, OSError, UnicodeDecodeError):
            self.drop()

    def _dispatch(self, payload: str) -> None:
        for event in self._events.get(payload, ()):
            event.set()

    def drop(self) -> None:
        """Forget the connection and wake every waiter to re-check."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._fd)
            self._backend._spawn(conn.close())
        for events in self._events.values():
            for event in events:
                event.set()


def libpq_url(url: SplitResult) -> str:
    """The URL for libpq, exactly as given but for the scheme (libpq knows ``postgresql://``
    and ``postgres://``; a ``+driver`` suffix is dropped). Rebuilt by hand: ``urlunsplit``
    turns ``postgresql:///db`` (no host: the default Unix socket) into ``postgresql:/db``,
    which libpq refuses."""
    text = f"postgresql://{url.netloc}{url.path}"
    if url.query:
        text += f"?{url.query}"
    if url.fragment:
        text += f"#{url.fragment}"
    return text


class PostgreSQLBackend(Backend):
    """Locks in PostgreSQL tables; see the module docstring for the design.

    Options: ``schema`` (default ``public``), ``prefix`` of the table and function names
    (default ``fenced_``), ``connect_timeout`` (s, default 5), ``command_timeout`` (s, default
    30: a statement with no answer by then is abandoned as BackendUnavailable),
    ``waiter_ttl`` (s, default 6: a waiter that stops renewing its place for this long is
    skipped), ``allow_unsafe`` (default False: refuse a server running with ``fsync=off``).
    """

    scheme: ClassVar[str] = "postgresql"
    option_schema = OPTIONS
    characteristics: ClassVar[frozenset[Characteristic]] = frozenset(
        {
            Characteristic.LINEARIZABLE,
            Characteristic.DURABLE,
            Characteristic.FIFO,
            Characteristic.DISTRIBUTED,
            Characteristic.SERVER_EXPIRY,
        }
    )
    _ddl_template: ClassVar[str] = DDL
    caller_waits: ClassVar[bool] = True  # (psycopg's async connection: nothing thread-bound)

    def __init__(
        self,
        conninfo: str,
        *,
        schema: str = "public",
        prefix: str = "fenced_",
        connect_timeout: float = 5.0,
        command_timeout: float = 30.0,
        waiter_ttl: float = 6.0,
        allow_unsafe: bool = False,
    ) -> None:
        self._conninfo = conninfo
        self._names = Names(schema, prefix, self._ddl_template)
        self._connect_timeout = connect_timeout
        self._command_timeout = command_timeout
        self._waiter_ttl = waiter_ttl
        self._heartbeat = waiter_ttl / 3
        self._allow_unsafe = allow_unsafe
        self._conn: _Conn | None = None
        self._connecting: asyncio.Lock | None = None
        self._listener = _Listener(self, f"{prefix}{secrets.token_hex(16)}", linger=waiter_ttl)
        self._tasks: set[asyncio.Task[Any]] = set()
        # Per (name, request id): the marker of a cancelled acquire whose statement may still
        # grant or queue, and the clean-ups (give-back, leave) still running for it. A later
        # acquire of the same request id takes the statement's outcome over (and waits for
        # the clean-ups first), so a give-back never frees the grant that acquire returns.
        self._in_flight: dict[tuple[str, str], object] = {}
        self._cleanups: dict[tuple[str, str], set[asyncio.Task[Any]]] = {}
        # Statements of cancelled acquires still running: their answer may start a clean-up.
        self._late: set[asyncio.Future[Any]] = set()
        self._unsure = UnsureReleases()  # (releases that raised: their next one is a retry)
        self._closed = False

    # -- opening ------------------------------------------------------------------------

    @classmethod
    async def open(cls, url: SplitResult, options: dict[str, Any]) -> PostgreSQLBackend:
        check_libpq_query(url)
        kwargs = cls.options(url, options, query=False)
        conninfo = libpq_url(url)
        backend = cls(conninfo, **kwargs)
        try:
            await backend._install()
        except BaseException:
            await backend.aclose()
            raise
        return backend

    @classmethod
    def schema_sql(cls, schema: str = "public", prefix: str = "fenced_") -> str:
        """The DDL that :meth:`open` runs, for installing by hand (e.g. by a DBA)."""
        opts = cls.options(urlsplit("postgresql://"), {"schema": schema, "prefix": prefix})
        schema, prefix = opts["schema"], opts["prefix"]
        return Names(schema, prefix, cls._ddl_template).ddl

    async def _install(self) -> None:
        """Check the server, then create the tables and functions unless already current."""
        names = self._names
        probe = (
            "SELECT pg_is_in_recovery(), current_setting('fsync'), "
            "to_regnamespace(%s) IS NOT NULL, obj_description(to_regprocedure(%s), 'pg_proc')"
        )
        row = _one(await self._call(probe.encode(), (names.schema, names.acquire_sig)))
        in_recovery, fsync, have_schema, marker = row
        if in_recovery:
            raise BackendUnavailable(
                "PostgreSQL server is a standby (read-only); connect to the primary "
                "(e.g. add target_session_attrs=read-write to the URL)"
            )
        if fsync != "on" and not self._allow_unsafe:
            raise UnsafeBackendError(
                "PostgreSQL runs with fsync=off: a crash can lose granted tokens and reuse "
                "them (pass allow_unsafe=True to use it anyway)"
            )
        if marker == names.marker:
            return
        ddl = names.ddl
        if not have_schema:
            ddl = (
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {};\n")
                .format(sql.Identifier(names.schema))
                .as_string(None)
                + ddl
            )
        conn = await self._command_conn()
        try:
            key = (INSTALL_LOCK, f"{names.schema}.{names.prefix}")
            async with asyncio.timeout(self._command_timeout):
                # A session lock, so that the look below runs in a transaction of its own: only
                # a new transaction is sure to see functions another client installed while we
                # waited (a catalog cache may keep answering "no such function" within one).
                # Installing twice would drop the fresh functions under the calls the first
                # client is already making ("cache lookup failed for function").
                await conn.execute(b"SELECT pg_advisory_lock(%s, hashtext(%s))", key)
                try:
                    cur = await conn.execute(
                        b"SELECT obj_description(to_regprocedure(%s), 'pg_proc')",
                        (names.acquire_sig,),
                    )
                    current = await cur.fetchone()
                    if current is None or current[0] != names.marker:
                        async with conn.transaction():
                            await conn.execute(ddl.encode())
                finally:
                    await conn.execute(b"SELECT pg_advisory_unlock(%s, hashtext(%s))", key)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise ConfigurationError(
                f"cannot create fenced's tables in schema {names.schema!r}: {exc}. Grant CREATE "
                "on the schema, or run PostgreSQLBackend.schema_sql() as its owner"
            ) from exc
        except TimeoutError as exc:
            self._drop(conn)
            raise BackendUnavailable("PostgreSQL did not finish installing in time") from exc
        except psycopg.Error as exc:
            raise self._translate(exc, conn) from exc

    # -- connections --------------------------------------------------------------------

    async def _connect(self, *, session: bool = True) -> _Conn:
        self._check_open()
        try:
            async with asyncio.timeout(self._connect_timeout + 1.0):
                conn = await psycopg.AsyncConnection.connect(
                    self._conninfo,
                    autocommit=True,
                    connect_timeout=max(2, math.ceil(self._connect_timeout)),
                    application_name="fenced",
                )
                if session:
                    # Explicit, so a server or role default of "off" cannot weaken durability.
                    await conn.execute(SESSION_SETUP)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            refused = connect_refusal(exc)
            if refused is not None:  # (connect() would retry BackendUnavailable in vain)
                raise refused from exc
            raise BackendUnavailable(f"cannot connect to PostgreSQL: {exc}") from exc
        return conn

    async def _command_conn(self) -> _Conn:
        conn = self._conn
        if conn is not None and not _looks_dead(conn):
            return conn
        if conn is not None:
            self._drop(conn)
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._conn is None:
                self._conn = await self._connect()
            return self._conn

    def _drop(self, conn: _Conn) -> None:
        """Stop using ``conn``; the next call opens a new connection."""
        if self._conn is conn:
            self._conn = None
        self._spawn(_close_when_idle(conn))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(_forget(self._tasks))
        return task

    def _clean_up(self, key: tuple[str, str], coro: Any) -> None:
        """Run the clean-up of an abandoned acquire; a later acquire of ``key`` waits for it."""
        task = self._spawn(coro)
        pending = self._cleanups.setdefault(key, set())
        pending.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            pending.discard(t)
            if not pending and self._cleanups.get(key) is pending:
                del self._cleanups[key]

        task.add_done_callback(done)

    def _translate(self, exc: psycopg.Error, conn: _Conn) -> BackendError:
        what = pg_kind(exc, conn)
        # For the source, any operational error (a lock timeout too) means: try again,
        # on a fresh connection.
        if what in ("unreachable", "conflict") or isinstance(exc, psycopg.OperationalError):
            self._drop(conn)
            return BackendUnavailable(f"PostgreSQL unavailable: {exc}")
        if what == "read-only":
            self._drop(conn)
            return BackendUnavailable(f"PostgreSQL server is read-only (a standby?): {exc}")
        return BackendError(f"PostgreSQL error: {exc}")

    async def _call(
        self,
        query: bytes,
        params: tuple[Any, ...] | dict[str, Any],
        *,
        bound: tuple[float, str] | None = None,
        late: Callable[[_Row | None], None] | None = None,
    ) -> _Row | None:
        """Run one statement and return its row.

        The statement runs in its own task, so a caller that is cancelled or times out returns
        at once (psycopg would otherwise wait up to 10 s for a server-side cancel). The
        connection is then given up (the next call opens another). On cancellation ``late``
        sees the statement's result when it comes (None if it failed), e.g. to give back a
        grant nobody will take; not on a timeout, which the caller retries under the same
        request id (and so finds that grant by the idempotent path).
        """
        self._check_open()
        seconds, what = bound or (self._command_timeout, "command_timeout")
        conn = await self._command_conn()
        task = asyncio.ensure_future(_fetch(conn, query, params))
        try:
            try:
                async with asyncio.timeout(seconds) as limit:
                    return await asyncio.shield(task)
            except TimeoutError as exc:
                if not limit.expired():
                    raise  # (someone else's timeout: the caller's)
                if task.done():  # answered just as the time ran out
                    return task.result()
                self._abandon(conn, task, None)
                raise BackendUnavailable(
                    f"PostgreSQL did not answer within {seconds:.3g} s ({what})"
                ) from exc
        except asyncio.CancelledError:
            self._abandon(conn, task, late)
            raise
        except psycopg.Error as exc:
            raise self._translate(exc, conn) from exc

    def _abandon(
        self,
        conn: _Conn,
        task: asyncio.Future[_Row | None],
        late: Callable[[_Row | None], None] | None,
    ) -> None:
        if not task.done() and self._conn is conn:
            self._conn = None
        if late is not None and not task.done():
            self._late.add(task)
            task.add_done_callback(self._late.discard)
        if not task.done():  # (still running: aclose must end it, see there)
            self._tasks.add(task)  # type: ignore[arg-type]
            task.add_done_callback(_forget(self._tasks))  # type: ignore[arg-type]

        def done(t: asyncio.Future[_Row | None]) -> None:
            row = None if t.cancelled() or t.exception() is not None else t.result()
            if self._conn is not conn:
                self._spawn(_close_when_idle(conn))
            if late is not None:
                late(row)

        task.add_done_callback(done)

    # -- the Backend API ----------------------------------------------------------------

    async def acquire(
        self,
        name: str,
        *,
        request_id: str,
        ttl: float,
        deadline: float | None,
        on_lost: LostCallback,
        owner: str = "",
    ) -> Grant:
        self._check_open()
        if not isinstance(request_id, str) or not request_id or "\x00" in request_id:
            raise ConfigurationError(
                f"request_id must be a non-empty string without NUL: {request_id!r}"
            )
        if not (math.isfinite(ttl) and ttl > 0):
            raise ConfigurationError(f"ttl must be a positive number of seconds, got {ttl!r}")
        names = self._names
        listener = self._listener
        ident = (name, request_id)
        # A cancelled acquire of this very request may still have a statement in flight:
        # whatever it grants, this call finds by the idempotent path, so it must not be
        # given back; and a give-back or leave already under way goes first.
        self._in_flight.pop(ident, None)
        pending = self._cleanups.get(ident)
        if pending:
            await asyncio.wait(set(pending), timeout=self._command_timeout)
        key = wake_key(name, request_id)
        wake = asyncio.Event()
        listener.register(key, wake)
        queued = False
        marker = object()
        enqueue = False

        def late(row: _Row | None) -> None:
            # The answer to a statement whose caller was cancelled: unless a later acquire of
            # the same request has taken it over, give back its grant or leave its queue place.
            if not self._settled(ident, marker):
                return
            if row is not None and row[0] == "granted":
                grant = Grant(FencingToken(name, row[1]), request_id, ttl, 0.0)
                self._clean_up(ident, self._quiet_release(grant))
            elif row is not None and enqueue:
                self._clean_up(ident, self._quiet_leave(name, request_id))

        try:
            while True:
                now = _clock.now()
                last_try = deadline is not None and now >= deadline
                channel = listener.channel if listener.alive else None
                wake.clear()
                bound = call_bound(self._command_timeout, deadline, name="command_timeout")
                sent_at = _clock.now()
                enqueue = not last_try
                params = (name, request_id, ttl, self._waiter_ttl, channel, enqueue, owner or None)
                self._in_flight[ident] = marker
                row = await self._call(names.q_acquire, params, bound=bound, late=late)
                self._settled(ident, marker)
                status, token, hint = _one(row)
                if status == "granted":
                    queued = False
                    return Grant(FencingToken(name, token), request_id, ttl, sent_at, _OWN)
                queued = queued or not last_try
                if last_try:
                    raise lock_timeout(name)
                if channel is None:
                    # First wait on this connection (or the listener broke): LISTEN, then
                    # re-check at once, so a release between the two cannot be missed.
                    await listener.ensure()
                    continue
                hinted = None if hint is None else max(float(hint), 0.0) + 0.002
                wait = wait_budget(deadline, self._heartbeat, hinted)
                if wait > 0 and not wake.is_set():
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(wait):
                            await wake.wait()
        except asyncio.CancelledError:
            if queued:
                self._clean_up(ident, self._quiet_leave(name, request_id))
            raise
        except BaseException:
            self._settled(ident, marker)  # no answer will come (late is not called)
            if queued:
                with contextlib.suppress(Exception):
                    await self._leave(name, request_id)
            raise
        finally:
            listener.unregister(key, wake)

    async def _leave(self, name: str, request_id: str) -> None:
        """Take a waiter that gave up out of the queue (and wake the next one if free)."""
        await self._call(self._names.q_leave, (name, request_id))

    def _settled(self, ident: tuple[str, str], marker: object) -> bool:
        """Forget the in-flight marker of one acquire statement; False if taken over."""
        if self._in_flight.get(ident) is not marker:
            return False
        del self._in_flight[ident]
        return True

    async def _quiet_leave(self, name: str, request_id: str) -> None:
        with contextlib.suppress(Exception):
            await self._leave(name, request_id)

    async def _quiet_release(self, grant: Grant) -> None:
        with contextlib.suppress(Exception):
            await self.release(grant)

    async def renew(self, grant: Grant) -> Grant:
        sent_at = _clock.now()
        token = grant.token
        row = await self._call(
            self._names.q_renew, (grant.ttl, grant.ttl, token.lock, grant.request_id, token.value)
        )
        if row is None:
            raise LeaseLostError(f"lease {token} is no longer held (expired or taken over)")
        return Grant(token, grant.request_id, grant.ttl, sent_at, grant.handle)

    async def release(self, grant: Grant) -> bool:
        token = grant.token
        # Its holder's own release (a grant made here) is marked, and its retry after a
        # lost reply (the earlier attempt raised: UnsureReleases) finds it released by
        # itself (True). A grant without the handle (a force release's, made from the lock's
        # status; a resumed one) neither marks nor reads the mark.
        own = grant.handle == _OWN
        retry = own and self._unsure.sending(grant)
        params = (token.lock, grant.request_id, token.value, own, retry)
        row = await self._call(self._names.q_release, params)
        if own:
            self._unsure.answered(grant)
        return bool(row is not None and row[0])

    async def lock_names(self) -> list[str]:
        return list(_one(await self._call(self._names.q_names, ()))[0])

    async def status(self, name: str) -> LockStatus:
        row = _one(await self._call(self._names.q_status, {"name": name}))
        holder, token, last, remaining, waiters, owner, ttl = row
        held = holder is not None and remaining is not None and remaining > 0
        return LockStatus(
            name=name,
            holder=holder if held else None,
            token=FencingToken(name, token) if held else None,
            last_token=FencingToken(name, last) if last else None,
            remaining=float(remaining) if held else None,
            waiters=int(waiters),
            owner=owner if held else None,
            ttl=float(ttl) if held and ttl else None,
        )

    async def read_record(self, name: str) -> Record | None:
        row = await self._call(self._names.q_record, (name,))
        return None if row is None else Record(name, int(row[0]), row[1])

    async def swap_record(self, name: str, version: int, value: str) -> Record:
        # One statement each way: an INSERT only where there is none, an UPDATE only from
        # the version the caller read (the row lock orders concurrent swaps).
        if version == 0:
            row = await self._call(self._names.q_record_insert, (name, value))
        else:
            row = await self._call(self._names.q_record_update, (value, name, version))
        if row is None:
            found = await self.read_record(name)
            raise RecordConflict(name, version, 0 if found is None else found.version)
        return Record(name, int(row[0]), value)

    async def aclose(self) -> None:
        if self._closed:
            return
        # The clean-ups in flight first (a cancelled acquire's grant given back, a waiter
        # leaving its queue), while calls still can run: once closed they fail, and a grant
        # stays held until its ttl (seen: close() while threads acquired left grants held).
        if self._late:  # (the answers that may start one: their clean-up starts as each ends)
            await asyncio.wait(set(self._late), timeout=self._command_timeout)
        cleanups = [t for pending in self._cleanups.values() for t in pending]
        if cleanups:
            await asyncio.wait(cleanups, timeout=self._command_timeout)
        self._closed = True
        self._listener.drop()
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await _close_when_idle(conn, timeout=1.0)
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
            await self._end_tasks(1.0)

    async def _end_tasks(self, timeout: float) -> None:
        """Cancel the background tasks left and wait for them to end (at most ``timeout``).

        Not awaited, they were destroyed pending when the loop stopped ("Task was destroyed
        but it is pending!", "Event loop is closed" at exit). psycopg answers a cancelled
        statement by cancelling it at the server and waiting (5 s + 5 s against a hung one);
        cancelled again, it closes the connection: so cancel until each has ended. Tasks the
        ends spawn (a connection's close) are taken along."""
        deadline = _clock.now() + timeout
        while self._tasks and _clock.now() < deadline:
            pending = set(self._tasks)
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=min(0.05, max(0.0, deadline - _clock.now())))


async def _fetch(
    conn: _Conn, query: bytes, params: tuple[Any, ...] | dict[str, Any]
) -> _Row | None:
    cur = await conn.execute(query, params, prepare=True)
    return await cur.fetchone()


async def _close_when_idle(conn: _Conn, timeout: float | None = None) -> None:
    """Close ``conn`` once the calls already queued on it are done (or ``timeout`` passed).

    psycopg's close() does not wait for them: closing the socket under a running call hangs or
    fails it on a healthy server, and leaves its fd registered in the event loop, which then
    breaks the next connection that reuses the fd number ("connection socket closed").
    """
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout), conn.lock:
            await conn.close()
            return
    await conn.close()


def _one(row: _Row | None) -> _Row:
    if row is None:
        raise BackendError("PostgreSQL returned no row where one was expected")
    return row


def _looks_dead(conn: _Conn) -> bool:
    """True if an idle connection has been closed, or is being closed, by the server
    (restart, admin shutdown, ``idle_session_timeout``).

    Costs one non-blocking ``poll``; it lets the first call after a server restart go
    straight to a new connection instead of failing on the stale one. (Not ``select``, which
    cannot watch a file numbered 1024 or above, as in a server with many clients: every
    connection then looked dead, and each call opened a new one.)
    """
    if conn.closed:
        return True
    if conn.lock.locked():  # in use by another call: its own reply is what is readable
        return False
    try:
        pgconn = conn.pgconn
        # The command connection LISTENs to nothing: idle, it has nothing to read unless the
        # server is ending the session (pg_terminate_backend, idle_session_timeout, a
        # shutdown): a FATAL message, then the FIN, maybe moments later. So anything to read
        # means dead. (Reading it instead let the message through as a notice with the
        # connection still OK, and the call went out on the dying session and failed.)
        return pgconn.status != pq.ConnStatus.OK or _readable_now(pgconn.socket)
    except (psycopg.Error, OSError, ValueError):
        return True


def _readable_now(fd: int) -> bool:
    if not hasattr(select, "poll"):  # (Windows: its select has no such limit on numbers)
        return bool(select.select([fd], [], [], 0)[0])
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _forget(tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: background failures are expected and harmless

    return done
