"""Fence SQL databases against stale holders: SQLite (``sqlite3``), PostgreSQL (psycopg 3, sync
and async) and MySQL/MariaDB (PyMySQL, and asyncmy for asyncio).

Two forms, both checking and advancing the high-water mark in ONE statement inside the
caller's own transaction, so the mark lives in the resource's database and commits (or rolls
back) together with the data it protects:

* :class:`SQLGuard`, the **fence-table form**: one row per resource in a small table
  (``fenced_fences``) holds the highest token accepted. Call :meth:`SQLGuard.check` first in
  the transaction, then write as usual::

      with db:                                     # sqlite3: commit, or roll back on error
          SQLGuard("invoices").check(db, token=lease.token)
          db.execute("UPDATE invoices SET ...")

      with pg.transaction():                       # psycopg 3
          SQLGuard("invoices").check(pg, token=lease.token)
          pg.execute("UPDATE invoices SET ...")

  :meth:`SQLGuard.transaction` is the same as a block (``with guard.transaction(pg,
  token=...):``); on psycopg the check rides in the message that carries BEGIN and a
  recheck in the one that carries COMMIT: no round trip of its own.

* :class:`RowGuard`, the **row form**: the guarded table carries its own ``fencing_token``
  column and each write is one conditional ``UPDATE ... WHERE key AND (fencing_token IS NULL
  OR fencing_token <= :token)``; no extra statement on success.

Why two racing transactions cannot both pass out of order
---------------------------------------------------------
The fence statement is ``INSERT INTO fenced_fences AS f ... ON CONFLICT (resource) DO UPDATE
SET token = excluded.token WHERE f.token > 0 AND f.token <= excluded.token AND f.lock_name =
excluded.lock_name RETURNING token`` (both sides compared as 64-bit integers): a row comes back
iff the token was accepted. A mark that is NULL, zero, negative or not a whole number (a
REAL 5.5 in SQLite) matches nothing and is reported as :class:`~fenced.CorruptMarkError`; a
token column that is not a 64-bit integer column as :class:`~fenced.ConfigurationError`, by
install and at use (PostgreSQL and MySQL verify the column's type before a connection's first
use of a table; on SQLite, where any column holds any value, the statement refuses a mark that
is not stored as an exact integer, so a REAL column's rounded tokens are never compared).
On SQLite an ``UPDATE … WHERE resource = ? AND typeof(token) = 'integer' AND token > 0 AND
token <= ? AND lock_name = ?`` comes first, its row count the verdict (``RETURNING`` costs
SQLite more than the rest of the upsert): it accepts exactly where the upsert accepts with
an integer back; anything else (no row yet, a refusal) goes to the upsert, under the write
lock the UPDATE took.

*PostgreSQL.* DO UPDATE first takes a row lock on the existing fence row (even when its WHERE
turns out false) and evaluates the WHERE on the newest committed version of the row: under
READ COMMITTED, if another transaction has updated the row, the statement waits for that
transaction to end and re-checks against what it committed, never against an old snapshot.
The lock is held until the caller's transaction ends. So of two transactions carrying tokens
5 and 7, whichever locks the row first holds it until it commits or rolls back; the other
waits, then compares with the committed mark. Token 5 can never commit after 7 has: it would
need the row lock that 7's transaction holds until its commit, after which 5 sees 7 and is
rejected. The first insert of a resource's row is protected by the primary-key index: a
concurrent inserter waits for the first and then takes the DO UPDATE path above. Under
REPEATABLE READ and SERIALIZABLE, if the fence row was written by a transaction that committed
after the caller's snapshot, PostgreSQL raises a serialization failure instead of evaluating
the WHERE; this and deadlocks surface as :class:`FenceConflictError` (the transaction is
aborted; retry it), never as a pass. Note that the row lock serializes all fenced
transactions of one resource: that is the price of the guarantee.

*MySQL/MariaDB (InnoDB).* The fence is a conditional ``UPDATE fenced_fences SET token = :t,
checks = checks + 1 WHERE resource = :r AND token > 0 AND token <= :t AND lock_name = :lock``
(names compared as bytes). InnoDB evaluates an UPDATE's WHERE on the newest committed version
of the row — a *locking read*, under REPEATABLE READ as under READ COMMITTED, never the
transaction's snapshot — and keeps the row X-locked until the transaction ends. So, as on
PostgreSQL, of two transactions carrying 5 and 7 the second to reach the row waits for the
first to end and then compares with what it committed: 5 cannot commit after 7. Only when the
UPDATE's affected-row count does not plainly say "accepted" does the guard read the row, with
``SELECT … FOR UPDATE`` (a locking read too: a plain SELECT under REPEATABLE READ would show
the snapshot, perhaps a mark older than the one that refused), to report the refusal (a first
insert is protected by the primary key: a racing inserter waits, then takes the update path).
The ``checks`` counter makes an accepted check always change the row, so its count says so
whether or not the client counts found rows; the verdict is never read from the insert id,
which an AUTO_INCREMENT column of a user's table also writes. Deadlocks (1213) and lock wait
timeouts (1205) surface as :class:`FenceConflictError`. Each table is verified before its
first use on each connection (InnoDB, a BIGINT token column), not only by ``install()``.
``install()`` runs DDL, which commits implicitly, so it refuses to run inside a transaction; it verifies a table it
did not create (InnoDB, binary collations, BIGINT token). The row form is a conditional
UPDATE too; a row it matched but did not change (same values) is told from a refusal by the
same locking read, and an upsert inserts a missing row (no ``ON DUPLICATE KEY UPDATE``, whose
affected-row count cannot tell a refusal from a no-op when the client counts found rows).

*SQLite.* A database has one writer at a time: the write lock is taken at the transaction's
first write and held until it ends, and in WAL mode a transaction may only write if its
snapshot is the newest, so the fence, the caller's writes and the commit are serialized with
every other writer. A DEFERRED transaction that *read first* may be unable to upgrade to a
writer (``SQLITE_BUSY``, or ``SQLITE_BUSY_SNAPSHOT`` in WAL mode, returned without waiting);
that surfaces as :class:`FenceConflictError`, never as a pass. Start fenced transactions with
``BEGIN IMMEDIATE`` (or make ``check`` the first statement, which Python's sqlite3 legacy mode
then opens as a deferred transaction whose first statement is the write) and set a
``timeout``/``busy_timeout``.

A connection in autocommit mode with no transaction open is refused by ``check`` (the fence
would commit alone, apart from the writes it is meant to protect). The row form needs no
transaction: its single statement is the fenced write. Inside the caller's open transaction it
commits with it; otherwise, if the driver opened a transaction for it (sqlite3's legacy mode,
psycopg without autocommit), the row form commits that transaction on success and rolls it
back on refusal, so an acknowledged write is never left uncommitted.

Durability: the mark is an ordinary row committed with the data, so it is exactly as durable as
the data (PostgreSQL with ``fsync``/``synchronous_commit`` on; SQLite with
``synchronous=FULL``; in WAL mode ``NORMAL`` may lose the last transactions at power loss,
data and mark together).
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from .._clients.connections import AsyncConnections, Connections
from .._core.errors import ConfigurationError, InvalidTokenError
from .._core.signing import TokenVerifier
from .._core.token import FencingToken, TokenLike, validate_lock_name
from ._plan import check_group_change
from ._sql_driver import (
    CHECKED,
    SQLiteTransaction,
    afence_transaction,
    aguarded_transaction,
    arun,
    arun_install,
    arun_own,
    arun_transaction,
    fence_transaction,
    guarded_batch,
    guarded_transaction,
    note_checked,
    reusable,
    run,
    run_install,
    run_own_row,
    run_transaction,
    sqlite_autocommit_true,
    sqlite_cursor_refused,
)
from ._sql_plan import (
    MYSQL,
    POSTGRESQL,
    SQLITE,
    Add,
    Dialect,
    FenceConflictError,
    FenceSQL,
    GroupItem,
    GroupState,
    Plan,
    RowSQL,
    Stmt,
    TableUse,
    check_plan,
    fence_high_water_plan,
    fence_install_plan,
    fence_sql,
    group_apply_plan,
    group_install_plan,
    group_read_plan,
    quote_ident,
    quote_table,
    row_high_water_plan,
    row_install_plan,
    row_write_plan,
    row_write_stmt,
    validate_resource,
)
from ._token_arg import token_keyword

__all__ = [
    "Add",
    "AsyncSQLFencer",
    "FenceConflictError",
    "GroupItem",
    "GroupState",
    "RowGuard",
    "SQLFencer",
    "SQLGuard",
    "quote_table",
    "require_fence",
]


# SQLGuard._hot before any token (no token passed is this object; see transaction())
_Hot = tuple[object, tuple[str, str, int], FencingToken]
_COLD: _Hot = (object(), ("", "", 0), FencingToken("cold", 1))


def _lock_name(lock: str, what: str) -> str:
    try:
        return validate_lock_name(lock)
    except InvalidTokenError as exc:
        raise ConfigurationError(f"{what}: {exc}; pass lock='<lock name>'") from None


class SQLGuard:
    """Fence-table guard: the highest token accepted for ``resource`` lives in ``table``.

    ``lock`` is the name of the lock whose tokens are accepted (default: the resource name);
    the fence row also records it, and a token of another lock is rejected with
    :class:`~fenced.WrongLockError`. Tokens may be given as :class:`~fenced.FencingToken` or
    their text form ``"lock:value"``. Call :meth:`install` once (idempotent) to create the
    table. Works with ``sqlite3.Connection``, ``psycopg.Connection``, PyMySQL's ``Connection``
    and a SQLAlchemy ``Connection`` or ``Session`` over any of them; the ``a...`` methods take
    a ``psycopg.AsyncConnection``, an asyncmy connection, or a SQLAlchemy ``AsyncConnection``
    or ``AsyncSession``. Through SQLAlchemy the check runs in the session's transaction and
    nothing is committed for you.
    """

    __slots__ = (
        "_hot",
        "_quoted",
        "_sqlite_sql",
        "_use",
        "lock",
        "resource",
        "table",
        "verifier",
    )

    def __init__(
        self,
        resource: str,
        *,
        lock: str | None = None,
        table: str = "fenced_fences",
        verify: TokenVerifier | None = None,
    ) -> None:
        self.verifier = verify  # checks each token before the mark (see fenced._core.signing)
        self.resource = validate_resource(resource)
        self.lock = _lock_name(resource if lock is None else lock, f"lock of {resource!r}")
        self.table = table
        self._quoted = quote_table(table)
        self._sqlite_sql = fence_sql(SQLITE, self._quoted)  # (transaction()'s direct path)
        self._hot: _Hot = _COLD
        # (verified before first use on each MySQL or PostgreSQL connection)
        self._use = TableUse(table)

    def __repr__(self) -> str:
        return f"SQLGuard({self.resource!r}, lock={self.lock!r}, table={self.table!r})"

    def _fence_sql(self, d: Dialect) -> FenceSQL:
        return fence_sql(d, self._quoted)  # cached: a guard built per call costs no SQL building

    def _check_plan(self, d: Dialect, token: FencingToken) -> Plan[FencingToken]:
        return check_plan(self._fence_sql(d), self.resource, token)

    # -- sync ----------------------------------------------------------------------------

    @token_keyword()
    def check(self, conn: Any, *, token: TokenLike) -> FencingToken:
        """Accept ``token`` inside the caller's open transaction, raising the mark to it.

        Returns the accepted token. Raises :class:`~fenced.StaleTokenError` (with the mark)
        if a higher token was accepted, :class:`~fenced.WrongLockError` for a token of another
        lock, :class:`~fenced.InvalidTokenError` for malformed text, :class:`FenceConflictError`
        if a concurrent transaction prevented the check, :class:`~fenced.BackendUnavailable`
        for a closed connection or dead server. On any error let the transaction roll back.
        """
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        accepted = run(conn, lambda d: self._check_plan(d, tok), need_tx=True, use=self._use)
        note_checked(conn, self.resource, accepted)
        return accepted

    @token_keyword()
    def begin(self, conn: Any, *, token: TokenLike) -> FencingToken:
        """Start the caller's transaction and :meth:`check` the fence, as its first statement.

        On PostgreSQL (autocommit connection) ``BEGIN`` and the fence go in one round trip, so
        the fence costs no round trip of its own; on SQLite this is ``BEGIN IMMEDIATE`` then
        the check. The transaction stays open for the caller's writes and COMMIT; on an error
        it is left open too (roll it back). Refuses a connection already in a transaction.
        """
        return self._begin(conn, FencingToken.coerce(token, self.lock, self.verifier))

    def _begin(self, conn: Any, tok: FencingToken) -> FencingToken:
        accepted = run(conn, lambda d: self._check_plan(d, tok), begin=True, use=self._use)
        note_checked(conn, self.resource, accepted)
        return accepted

    def transaction(
        self, conn: Any, *, token: TokenLike
    ) -> contextlib.AbstractContextManager[FencingToken]:
        """A fenced transaction as a block: ``BEGIN``, the check, your statements, ``COMMIT``.

        ::

            with guard.transaction(pg, token=lease.token):
                pg.execute("UPDATE invoices SET ...")

        On a ``psycopg.Connection`` with no transaction open the check costs no round trip
        of its own: it rides in the message that carries ``BEGIN`` (``BEGIN; EXECUTE
        <check>``, a statement prepared once per connection), and a recheck rides in the
        one that carries ``COMMIT`` (``SELECT <recheck>; COMMIT``): the server runs nothing
        of a message after a statement that fails, so a recheck that refuses means no
        ``COMMIT``. A refused token is raised when the block is entered, before your
        statements run, as :class:`~fenced.StaleTokenError`,
        :class:`~fenced.WrongLockError`, :class:`~fenced.CorruptMarkError` or
        :class:`FenceConflictError`, as :meth:`check` raises them. During the block psycopg
        runs the connection without autocommit, so a statement after one that ended the
        transaction (``COMMIT``, ``ROLLBACK``, ``conn.commit()``) opens a new one, which
        the recheck refuses (rolled back, :class:`~fenced.StaleTokenError`) if a newer
        token was accepted meanwhile. Other errors of the recheck's message come as psycopg
        raises them, except a concurrent-transaction refusal (:class:`FenceConflictError`)
        and a lost connection (:class:`~fenced.BackendUnavailable`). Inside your own psycopg
        pipeline: the pipelined form (see :meth:`batch`).

        Elsewhere (SQLite, MySQL, SQLAlchemy): the check (on ``sqlite3`` straight to the
        driver), a savepoint ``fenced_transaction`` set in its transaction, the block, ``RELEASE
        SAVEPOINT`` and ``COMMIT``, with ``ROLLBACK`` if the block raises (the savepoint set
        after the check, so that a ``ROLLBACK TO`` it never undoes the fence; on MariaDB it
        rides in compound statements with the check and the ``COMMIT``). The savepoint lives only
        as long as the transaction the check ran in, so a statement of the block that ended
        it (``COMMIT``, ``ROLLBACK``, ``commit()``, DDL on MySQL) makes the ``RELEASE`` fail:
        what is open is rolled back and the block raises
        :class:`~fenced.StaleTokenError` if a newer token was accepted meanwhile, else
        :class:`~fenced.ConfigurationError`, as on psycopg; statements after the end that
        committed as they ran (autocommit, several in one message, ``executescript()``) stay
        committed, and where the driver tells so (autocommit on, or no transaction open, at
        the block's end) a :class:`~fenced.ConfigurationError` says they did. Yields the token; the
        transaction is committed once the block has ended without an error. A connection
        already in a transaction is refused.
        """
        if type(conn) is sqlite3.Connection:  # (the in-process path: no dispatch to pay for)
            # The token this guard coerced last, with no verifier, and the fence's parameters
            # made from it: a holder passes the same object for each transaction of a grant,
            # so one identity test stands for coercion, the lock check and the parameters.
            # (What they were made against is compared too: resource and lock by identity,
            # and no verifier now, so assigning one, or another lock, is never skipped.)
            token_, params, tok = self._hot
            if (
                token is not token_
                or self.verifier is not None
                or params[0] is not self.resource
                or params[1] is not self.lock
            ):
                tok = FencingToken.coerce(token, self.lock, self.verifier)
                params = (self.resource, self.lock, tok.value)  # (coerce checked the lock)
                # (a str, or a token: neither changes; a subclass could be anything)
                if self.verifier is None and type(token) in (FencingToken, str):
                    self._hot = (token, params, tok)
            try:
                cur = conn.cursor()  # (one for the guard's three statements)
                # (isolation_level None: the block runs deferred, see SQLiteTransaction)
                deferred = conn.isolation_level is None and not sqlite_autocommit_true(conn)
            except Exception as exc:  # closed
                sqlite_cursor_refused(conn, exc)
            return SQLiteTransaction((cur, self._sqlite_sql, params, tok, deferred))
        return self._transaction(conn, FencingToken.coerce(token, self.lock, self.verifier))

    def _transaction(
        self, conn: Any, tok: FencingToken
    ) -> contextlib.AbstractContextManager[FencingToken]:
        # (its own function: a lambda in transaction() would make cells of its arguments on
        # every call, the direct path's too)
        return guarded_transaction(
            conn, self._quoted, self.resource, tok, self._use, lambda: self._begin(conn, tok)
        )

    def batch(
        self,
        conn: Any,
        statements: Sequence[tuple[str, Sequence[Any] | Mapping[str, Any] | None]],
        *,
        token: TokenLike,
    ) -> list[int]:
        """Run ``statements`` (``(sql, params)`` pairs, in the driver's parameter style) as
        one fenced transaction, in one request where the server allows; returns each
        statement's row count.

        ::

            guard.batch(conn, [("UPDATE stock SET n = n - %s WHERE sku = %s", (1, "A7"))],
                        token=lease.token)

        On MariaDB through PyMySQL with ``client_flag=CLIENT.MULTI_STATEMENTS``: ``START
        TRANSACTION``, a check that raises in the server when it refuses (a compound
        statement, ``BEGIN NOT ATOMIC``), the statements and ``COMMIT`` go as one request;
        the server runs nothing after the first statement that fails, so a refused token
        commits nothing (the transaction is rolled back, the refusal raised as :meth:`check`
        raises it); the request runs with autocommit off, and a statement of the batch that
        turned it on is a :class:`~fenced.ConfigurationError` saying that what ran after it
        committed as it ran (autocommit then as found). On a psycopg connection, one pipeline: ``BEGIN``, a check that raises
        in the server, the statements, the check again and ``COMMIT``. Elsewhere
        (SQLite, MySQL, PyMySQL without multi-statements, SQLAlchemy):
        :meth:`transaction`'s block, statement by statement. No transaction may be open.
        """
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        return guarded_batch(
            conn, self._quoted, self.resource, tok, self._use, statements,
            lambda: self.transaction(conn, token=tok),
        )  # fmt: skip

    def high_water(self, conn: Any) -> FencingToken | None:
        """The highest token accepted so far, or None if the resource was never fenced."""
        return run(conn, lambda d: fence_high_water_plan(self._fence_sql(d), self.resource))

    def fencer(self, connect: Callable[[], Any], *, keep_connection: bool = False) -> SQLFencer:
        """A ``fence=`` target for ``locks.lock(..., fence=[...])``: on each grant it opens a
        connection with ``connect()``, raises the mark to the new token in a transaction of
        its own, commits and closes (a connection is not shared with fenced's thread).
        ``keep_connection``: keep one connection open for the next call (close the fencer
        when done); ``sqlite3`` connections, bound to the thread that made them, one per
        calling thread."""
        return SQLFencer(self, connect, keep_connection=keep_connection)

    def afencer(
        self, connect: Callable[[], Awaitable[Any]], *, keep_connection: bool = False
    ) -> AsyncSQLFencer:
        """:meth:`fencer` over an async ``connect`` (``psycopg.AsyncConnection.connect``,
        ``asyncmy.connect``, a SQLAlchemy ``AsyncEngine.connect``): ``fence`` is a coroutine,
        run on the connection's loop by ``fence=``; ``aclose()`` it when done."""
        return AsyncSQLFencer(self, connect, keep_connection=keep_connection)

    def ddl(self, dialect: str) -> str:
        """The fence table's DDL for ``dialect`` (``sqlite``, ``postgresql``, ``mysql``,
        ``mariadb``), idempotent, for a migration: ``op.execute(guard.ddl(
        op.get_bind().dialect.name))`` in Alembic. :meth:`install` runs the same and verifies."""
        d = _DIALECTS.get(dialect)
        if d is None:
            raise ConfigurationError(
                f"unknown SQL dialect {dialect!r}: sqlite, postgresql, mysql or mariadb"
            )
        return self._fence_sql(d).create

    def install(self, conn: Any) -> None:
        """Create the fence table if missing (idempotent, safe to race).

        Runs in the caller's open transaction if there is one, else in its own, committed.
        """
        run_install(conn, lambda d: fence_install_plan(d, self._fence_sql(d), self.table))

    # -- a replicated group's member (fenced.replicated.SQLMember) ----------------------

    def install_group(self, conn: Any) -> None:
        """:meth:`install`, and the tables of replicated groups' members (``fenced_group_
        epochs``, ``fenced_group_data``, ``fenced_group_holders``) if missing."""
        self.install(conn)
        run_install(conn, group_install_plan)

    def apply_group(
        self,
        conn: Any,
        *,
        token: TokenLike | None,
        group: str,
        epoch: int,
        items: Sequence[GroupItem] = (),
        reset: bool = False,
        since: int = 0,
    ) -> None:
        """One change of a replicated group's member, as a transaction of its own (no
        transaction may be open): ``token`` checked against the lock mark as :meth:`check`
        does, ``epoch`` against the group's epoch mark (:class:`~fenced.StaleEpochError`),
        the epoch mark against ``since`` (:class:`~fenced.MemberBehindError`); then both
        marks raised, the token kept as the holder, every item forgotten first if ``reset``,
        and each ``(key, stamp, value)`` written if its stamp is newer than the stored one.
        All or nothing. ``token`` None: the lock mark is left alone (an epoch-only change)."""
        plan = self._group_change(token, group, epoch, items, reset, since)
        run_transaction(conn, plan, use=self._use)

    def _group_change(
        self,
        token: TokenLike | None,
        group: str,
        epoch: int,
        items: Sequence[GroupItem],
        reset: bool,
        since: int,
    ) -> Callable[[Dialect], Plan[None]]:
        items = check_group_change(group, epoch, since, items)
        tok = None if token is None else FencingToken.coerce(token, self.lock, self.verifier)
        return lambda d: group_apply_plan(
            d, self._fence_sql(d), self.resource, group, tok, epoch, items, reset=reset,
            since=since,
        )  # fmt: skip

    def read_group(self, conn: Any, *, group: str, keys: Sequence[str] | None = None) -> GroupState:
        """A replicated group member's marks, holder and items (of ``keys``; None: all), read
        in one transaction of its own."""
        return run_transaction(conn, self._group_read(group, keys))

    def _group_read(
        self, group: str, keys: Sequence[str] | None
    ) -> Callable[[Dialect], Plan[GroupState]]:
        return lambda d: group_read_plan(d, self._fence_sql(d), self.resource, group, keys)

    async def ainstall_group(self, conn: Any) -> None:
        """:meth:`install_group` on an async connection (psycopg, asyncmy, SQLAlchemy)."""
        await self.ainstall(conn)
        await arun_install(conn, group_install_plan)

    async def aapply_group(
        self,
        conn: Any,
        *,
        token: TokenLike | None,
        group: str,
        epoch: int,
        items: Sequence[GroupItem] = (),
        reset: bool = False,
        since: int = 0,
    ) -> None:
        """:meth:`apply_group` on an async connection (psycopg, asyncmy, SQLAlchemy)."""
        plan = self._group_change(token, group, epoch, items, reset, since)
        await arun_transaction(conn, plan, use=self._use)

    async def aread_group(
        self, conn: Any, *, group: str, keys: Sequence[str] | None = None
    ) -> GroupState:
        """:meth:`read_group` on an async connection (psycopg, asyncmy, SQLAlchemy)."""
        return await arun_transaction(conn, self._group_read(group, keys))

    # -- async (psycopg.AsyncConnection) -------------------------------------------------

    @token_keyword()
    async def acheck(self, conn: Any, *, token: TokenLike) -> FencingToken:
        """:meth:`check` on a ``psycopg.AsyncConnection``."""
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        accepted = await arun(conn, lambda d: self._check_plan(d, tok), need_tx=True, use=self._use)
        note_checked(conn, self.resource, accepted)
        return accepted

    @token_keyword()
    async def abegin(self, conn: Any, *, token: TokenLike) -> FencingToken:
        """:meth:`begin` on a ``psycopg.AsyncConnection``."""
        return await self._abegin(conn, FencingToken.coerce(token, self.lock, self.verifier))

    async def _abegin(self, conn: Any, tok: FencingToken) -> FencingToken:
        accepted = await arun(conn, lambda d: self._check_plan(d, tok), begin=True, use=self._use)
        note_checked(conn, self.resource, accepted)
        return accepted

    def atransaction(
        self, conn: Any, *, token: TokenLike
    ) -> contextlib.AbstractAsyncContextManager[FencingToken]:
        """:meth:`transaction` as ``async with``: the check riding with ``BEGIN`` and the
        recheck with ``COMMIT`` on a ``psycopg.AsyncConnection`` with no transaction open
        (the same steps as the sync form); elsewhere (asyncmy, SQLAlchemy's
        ``AsyncConnection`` or ``AsyncSession``) :meth:`abegin` and the savepoint witness,
        the block, ``RELEASE SAVEPOINT`` and ``COMMIT`` (see :meth:`transaction`)."""
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        return aguarded_transaction(
            conn, self._quoted, self.resource, tok, self._use, lambda: self._abegin(conn, tok)
        )

    async def ahigh_water(self, conn: Any) -> FencingToken | None:
        """:meth:`high_water` on a ``psycopg.AsyncConnection``."""
        return await arun(conn, lambda d: fence_high_water_plan(self._fence_sql(d), self.resource))

    async def ainstall(self, conn: Any) -> None:
        """:meth:`install` on a ``psycopg.AsyncConnection``."""
        await arun_install(conn, lambda d: fence_install_plan(d, self._fence_sql(d), self.table))


_DIALECTS = {"sqlite": SQLITE, "postgresql": POSTGRESQL, "mysql": MYSQL, "mariadb": MYSQL}


def require_fence(target: Any, guard: SQLGuard, tables: Sequence[str]) -> None:
    """Refuse to flush changes to ``tables`` in a SQLAlchemy session transaction in which
    ``guard.check(session, token=...)`` (or ``begin``/``acheck``) has not passed.

    ``target``: a ``Session``, a ``sessionmaker`` or a ``Session`` subclass (for an
    ``AsyncSession``, its ``sync_session``, or ``sessionmaker(class_=AsyncSession)``'s
    ``sync_session_class``). A flush that would insert, update or delete an object mapped to
    one of ``tables`` raises :class:`~fenced.ConfigurationError` before any SQL is sent. A
    check counts while the (sub)transaction that made it is alive: until the session's
    transaction ends, and no longer once a savepoint (``begin_nested``) it was made in, or
    one around it, is rolled back (that undid the fence too); a released savepoint's check
    stays with its parent. This catches a code path that forgot the fence; it does not
    replace it (writes through ``session.execute`` bypass it).
    """
    from sqlalchemy import event
    from sqlalchemy import inspect as sa_inspect

    names = frozenset(tables)
    if not names:
        raise ConfigurationError("require_fence() needs at least one table name")

    def before_flush(session: Any, _context: Any, _instances: Any) -> None:
        if guard.resource in session.info.get(CHECKED, {}):
            return
        for obj in (*session.new, *session.dirty, *session.deleted):
            table = sa_inspect(obj).mapper.local_table
            if getattr(table, "name", None) in names:
                raise ConfigurationError(
                    f"flushing a change to table {table.name!r}, fenced by "
                    f"SQLGuard({guard.resource!r}), without a checked token in this "
                    "transaction: call guard.check(session, token=...) first"
                )

    def after_transaction_end(session: Any, transaction: Any) -> None:
        if transaction.parent is None:
            session.info.pop(CHECKED, None)

    def after_soft_rollback(session: Any, rolled_back: Any) -> None:
        # Forget the checks made in the rolled-back (sub)transaction or inside it.
        checked = session.info.get(CHECKED)
        for resource, (_, made_in) in list((checked or {}).items()):
            t = made_in
            while t is not None and t is not rolled_back:
                t = t.parent
            if t is not None:
                del checked[resource]

    event.listen(target, "before_flush", before_flush)
    event.listen(target, "after_transaction_end", after_transaction_end)
    event.listen(target, "after_soft_rollback", after_soft_rollback)


class SQLFencer:
    """See :meth:`SQLGuard.fencer`: a guard and the connections it opens itself
    (:attr:`connections`, fenced's one connection manager), for a ``fence=`` target and a
    replicated group's member, which borrows them for the guard's ``apply_group`` and
    ``read_group``. Blocking: call it from a worker thread in asyncio (``fence_all`` and
    :class:`~fenced.replicated.SQLMember` do)."""

    def __init__(
        self,
        guard: SQLGuard,
        connect: Callable[[], Any],
        *,
        keep_connection: bool = False,
        setup: Callable[[Any], None] | None = None,
    ) -> None:
        self.guard = guard
        self.connect = connect
        self.keep_connection = keep_connection
        self.connections: Connections[Any] = Connections(
            connect,
            name=f"SQL guard {guard.resource!r}",
            setup=setup,
            idle=1 if keep_connection else 0,
            # (a sqlite3 connection is bound to its thread; calls come from any worker)
            bound=_sqlite3,
            healthy=reusable,
        )

    def fence(self, token: TokenLike) -> None:
        tok = FencingToken.coerce(token, self.guard.lock, self.guard.verifier)
        with self.connections.connection() as conn:
            # BEGIN and the fence, COMMIT: a transaction of its own (on psycopg one message;
            # else the driver's BEGIN, COMMIT and ROLLBACK, SQLAlchemy's included)
            g = self.guard
            fence_transaction(
                conn, g._quoted, g.resource, tok, g._use,
                lambda: run_transaction(conn, lambda d: g._check_plan(d, tok), use=g._use),
            )  # fmt: skip

    def close(self) -> None:
        """Close the connection kept (``keep_connection``); a fencer without one has none."""
        self.connections.close()

    def __repr__(self) -> str:
        return f"SQLFencer({self.guard.resource!r})"


class AsyncSQLFencer:
    """See :meth:`SQLGuard.afencer`: :class:`SQLFencer` over an async ``connect`` (psycopg
    ``AsyncConnection``, asyncmy, SQLAlchemy's ``AsyncConnection``), on the event loop; a
    member borrows its :attr:`connections` for ``aapply_group`` and ``aread_group``."""

    def __init__(
        self,
        guard: SQLGuard,
        connect: Callable[[], Awaitable[Any]],
        *,
        keep_connection: bool = False,
        setup: Callable[[Any], Awaitable[None]] | None = None,
    ) -> None:
        self.guard = guard
        self.connect = connect
        self.keep_connection = keep_connection
        self.connections: AsyncConnections[Any] = AsyncConnections(
            connect,
            name=f"SQL guard {guard.resource!r}",
            setup=setup,
            idle=1 if keep_connection else 0,
            healthy=reusable,
        )

    async def fence(self, token: TokenLike) -> None:
        tok = FencingToken.coerce(token, self.guard.lock, self.guard.verifier)
        async with self.connections.connection() as conn:
            g = self.guard
            await afence_transaction(
                conn, g._quoted, g.resource, tok, g._use,
                lambda: arun_transaction(conn, lambda d: g._check_plan(d, tok), use=g._use),
            )  # fmt: skip

    async def aclose(self) -> None:
        """Close the connection kept (``keep_connection``)."""
        await self.connections.aclose()

    def __repr__(self) -> str:
        return f"AsyncSQLFencer({self.guard.resource!r})"


def _sqlite3(conn: Any) -> bool:
    return isinstance(conn, sqlite3.Connection)


class RowGuard:
    """Row-form guard for a table whose rows carry their own token column.

    ``key_columns`` must identify one row (a primary or unique key). A row whose token column
    is NULL has never been fenced and accepts any token. All rows of the table are fenced by
    tokens of one lock, ``lock`` (default: the table name); with ``lock_column`` set, each
    row also records the lock name and rejects tokens of another lock. :meth:`install` adds
    the token (and lock) column if missing.

    >>> guard = RowGuard("invoices", key_columns=("id",), lock="invoices")   # doctest: +SKIP
    >>> guard.update(db, token=lease.token, key={"id": 42}, values={"status": "paid"})  # doctest: +SKIP
    >>> guard.update(db, token=lease.token, key={"id": 42}, values={"paid": Add(25)})   # doctest: +SKIP

    Values are bound parameters, never SQL: ``{"balance": "balance + 1"}`` writes that text.
    For a relative write use :class:`Add` (``balance = COALESCE(balance, 0) + 1``).
    """

    __slots__ = (
        "_spec",
        "_use",
        "_use_upsert",
        "key_columns",
        "lock",
        "lock_column",
        "table",
        "token_column",
        "verifier",
    )

    def __init__(
        self,
        table: str,
        *,
        key_columns: Sequence[str] | str = ("id",),
        token_column: str = "fencing_token",
        lock: str | None = None,
        lock_column: str | None = None,
        verify: TokenVerifier | None = None,
    ) -> None:
        self.verifier = verify  # checks each token before the mark (see fenced._core.signing)
        key_cols = (key_columns,) if isinstance(key_columns, str) else tuple(key_columns)
        if not key_cols:
            raise ConfigurationError("key_columns must name at least one column")
        for k in key_cols:
            quote_ident(k, "key column")
        quote_ident(token_column, "token column")
        if lock_column is not None:
            quote_ident(lock_column, "lock column")
        names = [*key_cols, token_column, *((lock_column,) if lock_column else ())]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"key, token and lock columns must differ: {names}")
        self.table = table
        self.key_columns = key_cols
        self.token_column = token_column
        self.lock_column = lock_column
        self.lock = _lock_name(table if lock is None else lock, f"lock of table {table!r}")
        self._spec = RowSQL(quote_table(table), table, key_cols, token_column, lock_column)
        # (verified before first use on each MySQL or PostgreSQL connection; a MySQL upsert
        # also needs its keys)
        self._use = TableUse(table, token_column)
        self._use_upsert = TableUse(table, token_column, key_cols)

    def __repr__(self) -> str:
        return (
            f"RowGuard({self.table!r}, key_columns={self.key_columns!r}, "
            f"token_column={self.token_column!r}, lock={self.lock!r})"
        )

    def _statement(
        self, token: FencingToken, key: Mapping[str, Any], values: Mapping[str, Any], upsert: bool
    ) -> Callable[[Dialect], tuple[Stmt, tuple[Any, ...]]]:
        """The conditional write, per dialect (the one place its SQL is chosen)."""
        return lambda d: row_write_stmt(d, self._spec, token, key, values, upsert=upsert)

    def _write(
        self, token: FencingToken, key: Mapping[str, Any], values: Mapping[str, Any], upsert: bool
    ) -> Callable[[Dialect], Plan[FencingToken]]:
        statement = self._statement(token, key, values, upsert)
        return lambda d: row_write_plan(d, self._spec, token, key, statement(d), upsert=upsert)

    # -- sync ----------------------------------------------------------------------------

    @token_keyword()
    def update(
        self,
        conn: Any,
        *,
        token: TokenLike,
        key: Mapping[str, Any],
        values: Mapping[str, Any] | None = None,
    ) -> FencingToken:
        """Write ``values`` to the row ``key`` and set its token, iff the token is not stale.

        One conditional UPDATE. Raises :class:`~fenced.StaleTokenError` (with the row's
        token) if the row carries a higher token and :class:`~fenced.ResourceNotFoundError`
        if there is no such row; nothing is written in either case.
        """
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        statement = self._statement(tok, key, values or {}, False)
        return run_own_row(conn, self._spec, tok, key, statement, upsert=False, use=self._use)

    @token_keyword()
    def insert_or_update(
        self,
        conn: Any,
        *,
        token: TokenLike,
        key: Mapping[str, Any],
        values: Mapping[str, Any] | None = None,
    ) -> FencingToken:
        """Insert the row, or update it like :meth:`update`, in one ``INSERT .. ON CONFLICT``.

        Needs a primary key or unique constraint on exactly ``key_columns``.
        """
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        statement = self._statement(tok, key, values or {}, True)
        return run_own_row(conn, self._spec, tok, key, statement, upsert=True, use=self._use_upsert)

    def high_water(self, conn: Any, key: Mapping[str, Any]) -> FencingToken | None:
        """The row's token (None if never fenced); ResourceNotFoundError if there is no row."""
        return run(conn, lambda d: row_high_water_plan(d, self._spec, self.lock, key))

    def install(self, conn: Any) -> None:
        """Add the token column (and lock column) to the existing table if missing."""
        run_install(conn, lambda d: row_install_plan(d, self._spec))

    # -- async (psycopg.AsyncConnection) -------------------------------------------------

    @token_keyword()
    async def aupdate(
        self,
        conn: Any,
        *,
        token: TokenLike,
        key: Mapping[str, Any],
        values: Mapping[str, Any] | None = None,
    ) -> FencingToken:
        """:meth:`update` on a ``psycopg.AsyncConnection``."""
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        return await arun_own(conn, self._write(tok, key, values or {}, False), use=self._use)

    @token_keyword()
    async def ainsert_or_update(
        self,
        conn: Any,
        *,
        token: TokenLike,
        key: Mapping[str, Any],
        values: Mapping[str, Any] | None = None,
    ) -> FencingToken:
        """:meth:`insert_or_update` on a ``psycopg.AsyncConnection``."""
        tok = FencingToken.coerce(token, self.lock, self.verifier)
        return await arun_own(conn, self._write(tok, key, values or {}, True), use=self._use_upsert)

    async def ahigh_water(self, conn: Any, key: Mapping[str, Any]) -> FencingToken | None:
        """:meth:`high_water` on a ``psycopg.AsyncConnection``."""
        return await arun(conn, lambda d: row_high_water_plan(d, self._spec, self.lock, key))

    async def ainstall(self, conn: Any) -> None:
        """:meth:`install` on a ``psycopg.AsyncConnection``."""
        await arun_install(conn, lambda d: row_install_plan(d, self._spec))
