"""The SQL guards' statements and decisions, written once as driver-free "plans".

A plan is a generator: it yields each statement (:class:`Stmt`) it needs run, receives the
:class:`Result` (or has the mapped error thrown in), and finally returns its answer or raises
a fenced error. ``_sql_driver`` runs plans on sqlite3, psycopg (sync and async), PyMySQL and
asyncmy with a few lines each, so the SQL and the accept/reject logic exist exactly once.

Identifiers (table and column names) are validated against a conservative pattern and then
double-quoted (backquoted for MySQL); values (tokens, lock names, keys, the user's column
values) are always bound parameters, never interpolated.

MySQL/MariaDB has no ``RETURNING`` on UPDATE and no ``ON CONFLICT … WHERE``: its plans are a
conditional ``UPDATE`` or ``INSERT … ON DUPLICATE KEY UPDATE`` (InnoDB evaluates the condition
on the newest committed row and keeps the row X-locked to the end of the transaction, under
every isolation level) whose affected-row count says "accepted" in the usual case; otherwise a
*locking* read (``FOR UPDATE``: the newest committed row, never the transaction's snapshot)
of the row decides (see :func:`mysql_upsert_accepted`). Each MySQL table is verified before
its first use on a connection (:func:`mysql_use_plan`).

Column names are compared as each database compares them (:func:`ident_key`).
"""

from __future__ import annotations

import decimal
import functools
import re
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn, TypeVar

from .._core.errors import (
    ConfigurationError,
    CorruptMarkError,
    FenceConflictError,
    FencedError,
    ResourceNotFoundError,
    StaleTokenError,
    WrongLockError,
)
from .._core.errors import member_behind_error as refused_behind
from .._core.errors import stale_epoch_error as refused_epoch
from .._core.token import MAX_TOKEN, FencingToken
from ._plan import GroupItem, GroupState, checked_group_state

__all__ = [
    "AUTOCOMMIT_ON",
    "BATCH_WITNESS",
    "MYSQL",
    "MYSQL_MAX_NAME",
    "POSTGRESQL",
    "SQLITE",
    "TRANSACTION_ENDED",
    "Add",
    "Dialect",
    "DuplicateColumn",
    "FenceConflictError",
    "FenceSQL",
    "GroupItem",
    "GroupSQL",
    "GroupState",
    "MySQLUse",
    "Plan",
    "Result",
    "RowSQL",
    "Stmt",
    "TableUse",
    "accept_plan",
    "check_plan",
    "check_verdict",
    "fence_high_water_plan",
    "fence_install_plan",
    "fence_sql",
    "group_apply_plan",
    "group_install_plan",
    "group_read_plan",
    "group_sql",
    "ident_key",
    "mariadb_batch_check",
    "mariadb_batch_recheck",
    "mysql_upsert_accepted",
    "mysql_use_plan",
    "pg_ride_refusal_read",
    "pg_ride_sql",
    "pg_use_plan",
    "quote_ident",
    "quote_table",
    "refusal_plan",
    "row_high_water_plan",
    "row_install_plan",
    "row_write_plan",
    "table_use_plan",
    "validate_resource",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True, eq=False)  # two singletons; identity hash for caches
class Dialect:
    """What differs between the engines: the parameter marker and a few type names."""

    name: str
    param: str
    bigint: str
    cast: str  # CAST(x AS <cast>) to a 64-bit integer


SQLITE: Final = Dialect("sqlite", "?", "INTEGER", "INTEGER")
POSTGRESQL: Final = Dialect("postgresql", "%s", "BIGINT", "BIGINT")
MYSQL: Final = Dialect("mysql", "%s", "BIGINT", "SIGNED")

MYSQL_MAX_NAME: Final = 700
"""The longest resource name the MySQL fence table keys (InnoDB keys are at most 3072 bytes:
768 four-byte characters)."""


def _backquoted(sql: str) -> str:
    """MySQL spelling of our SQL: identifiers are validated ``[A-Za-z0-9_]`` and values are
    bound, so the only double quotes in the text are identifier quotes."""
    return sql.replace('"', "`")


@dataclass(frozen=True, slots=True)
class Stmt:
    """One statement for the driver to execute with bound parameters."""

    sql: str
    params: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class Result:
    """What a statement gave back: its rows (empty if none) and the affected row count."""

    rows: list[tuple[Any, ...]]
    rowcount: int
    # MySQL: the client sets CLIENT.FOUND_ROWS (an upsert's count of 1 is then an insert or
    # an unchanged row alike). True when unknown: the ambiguous count is then read out.
    found_rows: bool = True


Plan = Generator[Stmt, Result, T]

# -- identifiers --------------------------------------------------------------------------

_IDENT_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


def quote_ident(name: object, what: str = "identifier") -> str:
    """Validate an SQL identifier and return it double-quoted (so reserved words work).

    Only ``[A-Za-z_][A-Za-z0-9_]*`` of at most 63 characters is accepted: such a name can
    never close the quotes. Quoted identifiers are case-sensitive: on PostgreSQL, give
    unquoted-created names in lower case.
    """
    if not isinstance(name, str) or not _IDENT_RE.fullmatch(name):
        raise ConfigurationError(
            f"invalid SQL {what} {name!r}: use 1-63 characters of A-Z a-z 0-9 _, "
            "not starting with a digit"
        )
    return f'"{name}"'


def ident_key(d: Dialect, name: str) -> str:
    """``name`` as ``d`` compares a quoted column name: SQLite and MySQL ignore ASCII case
    (``Fencing_Token`` *is* ``fencing_token`` there), PostgreSQL compares quoted names exactly
    (fenced always quotes). Names are ASCII (:func:`quote_ident`), so ``lower`` is ASCII's."""
    return name if d is POSTGRESQL else name.lower()


def same_columns(d: Dialect, names: Sequence[str], what: str) -> None:
    """Refuse two of ``names`` that ``d`` takes for one column (see :func:`ident_key`)."""
    seen: dict[str, str] = {}
    for n in names:
        k = ident_key(d, n)
        if k in seen:
            raise ConfigurationError(f"{what}: {seen[k]!r} and {n!r} are one column on {d.name}")
        seen[k] = n


def quote_table(name: object) -> str:
    """Validate and quote a table name, optionally schema-qualified (``schema.table``)."""
    if not isinstance(name, str):
        raise ConfigurationError(f"table name must be a str, not {type(name).__name__}")
    parts = name.split(".")
    if len(parts) > 2:
        raise ConfigurationError(f"invalid table name {name!r}: at most 'schema.table'")
    return ".".join(quote_ident(p, "table name") for p in parts)


def validate_resource(resource: object) -> str:
    """A resource name is any non-empty text up to 1000 characters without NUL."""
    if not isinstance(resource, str) or not resource or len(resource) > 1000 or "\0" in resource:
        raise ConfigurationError(
            f"invalid resource name {resource!r}: non-empty text, at most 1000 characters"
        )
    return resource


# -- fence-table form ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FenceSQL:
    """The fence table's statements for one dialect and table."""

    create: str
    accept: str  # params: resource, lock, token -> returns the stored token iff accepted
    read: str  # params: resource -> (lock_name, token)
    mysql: bool = False  # accept's verdict is in its affected-row count; read locks the row
    # SQLite: an UPDATE (accept's params) that accepts in place, its row count the verdict
    update: str = ""

    @property
    def plain_read(self) -> str:
        """``read`` without its row lock (MySQL's ``FOR UPDATE``): a read-back after a
        refusal or an end, which must not wait on another holder's lock."""
        return self.read.removesuffix(" FOR UPDATE")


@functools.lru_cache(maxsize=128)
def fence_sql(d: Dialect, table: str) -> FenceSQL:
    """Build the fence-table statements (``table`` already quoted)."""
    if d is MYSQL:
        return _mysql_fence_sql(table)
    p = d.param
    columns = (
        "resource TEXT PRIMARY KEY, lock_name TEXT NOT NULL, "
        f"token {d.bigint} NOT NULL CHECK (token > 0)"
    )
    if d is SQLITE:
        # One b-tree keyed by resource: a fence update dirties a single page.
        create = f"CREATE TABLE IF NOT EXISTS {table} ({columns}) WITHOUT ROWID"
    else:
        # Two first installs racing on CREATE TABLE IF NOT EXISTS can collide on the catalog's
        # unique index; the exception block turns the loser into a no-op, in one statement,
        # which also creates the pipelined check's refusal function (see pg_refuse_ddl).
        create = (
            "DO $fenced$ BEGIN BEGIN "
            f"CREATE TABLE IF NOT EXISTS {table} ({columns}); "
            "EXCEPTION WHEN unique_violation OR duplicate_table THEN NULL; "
            f"END; {pg_refuse_ddl(table)} END $fenced$"
        )
    # The single statement that both checks and advances the high-water mark. The WHERE of
    # DO UPDATE is evaluated on the existing row *after* the row is locked (see sql.py).
    # A NULL, zero or negative mark (a table the guard did not create, or a hand edit) matches
    # no accept condition, so it is refused and reported as corrupt: fail closed. Both sides
    # are compared as integers whatever the column's declared type (see _as_int); a token
    # column that is not an integer column is reported by check_plan from the returned value.
    mark, incoming = _as_int(d, "f.token", stored=True), _as_int(d, "excluded.token")
    accept = (
        f"INSERT INTO {table} AS f (resource, lock_name, token) VALUES ({p}, {p}, {p}) "
        "ON CONFLICT (resource) DO UPDATE SET token = excluded.token "
        f"WHERE {_exact(d, 'f.token')}{mark} > 0 AND {mark} <= {incoming} "
        "AND f.lock_name = excluded.lock_name "
        "RETURNING token"
    )
    read = f"SELECT lock_name, token FROM {table} WHERE resource = {p}"
    if d is not SQLITE:
        return FenceSQL(create, accept, read)
    # SQLite: RETURNING costs more than the rest of the upsert (SQLite keeps the returned rows
    # aside; the driver describes the columns and makes a row): about as much again as an
    # unfenced one-row transaction. So the fence is first this UPDATE, whose row count (1) is
    # the verdict: it accepts only a mark stored as an integer (an INTEGER, NUMERIC or untyped
    # column: a TEXT column stores no integers, a REAL column no integers either), above 0, not
    # above the token, of the same lock, which are the cases the upsert accepts with an int
    # back. Anything else (no row yet, a refusal, a mark to look at) goes to the upsert, which
    # decides as before, under the same write lock (the UPDATE has taken it).
    update = (
        f"UPDATE {table} SET token = ?3 WHERE resource = ?1 AND typeof(token) = 'integer' "
        "AND token > 0 AND token <= ?3 AND lock_name = ?2"
    )
    return FenceSQL(create, accept, read, update=update)


def mysql_upsert_accepted(res: Result) -> bool:
    """Whether an ``INSERT … ON DUPLICATE KEY UPDATE`` of ours plainly accepted, from its
    affected-row count alone: 1 a new row, 2 an existing row changed (its assignments change
    nothing unless the fence condition holds), 0 an existing row left as it was (refused, or
    already these values); with CLIENT.FOUND_ROWS that last case counts 1, like an insert.
    Anything not plainly accepted is decided by a locking read of the row. (The verdict is
    never read from the insert id: an AUTO_INCREMENT column of the user's table writes it.)"""
    return res.rowcount == 2 or (res.rowcount == 1 and not res.found_rows)


def _mysql_fence_sql(table: str) -> FenceSQL:
    """The fence table on MySQL/MariaDB: binary collations (names compare exactly, as
    everywhere else: ``Orders`` is not ``orders``), InnoDB (transactional, row locks).

    The check is one ``INSERT … ON DUPLICATE KEY UPDATE``: a first check inserts the row; later
    ones update it only if the condition holds on the existing row, which InnoDB has X-locked
    (the newest committed version, not a snapshot) until the transaction ends. Assignments run
    left to right on the row as updated so far, so ``checks`` is counted first and ``token`` is
    set last; ``checks`` counts accepted checks, so an accepted check always changes the row
    (affected rows 2) and a refused one never does (see :func:`mysql_upsert_accepted`).
    """
    table = _backquoted(table)
    create = (
        f"CREATE TABLE IF NOT EXISTS {table} ("
        f"resource VARCHAR({MYSQL_MAX_NAME}) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin "
        "NOT NULL PRIMARY KEY, "
        "lock_name VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, "
        "token BIGINT NOT NULL, checks BIGINT NOT NULL DEFAULT 0, "
        "CONSTRAINT fenced_token_positive CHECK (token > 0)) ENGINE=InnoDB"
    )
    mark, incoming = _as_int(MYSQL, "token", stored=True), _as_int(MYSQL, "VALUES(token)")
    cond = (
        f"{mark} > 0 AND {mark} <= {incoming} "
        "AND CAST(lock_name AS BINARY) = CAST(VALUES(lock_name) AS BINARY)"
    )
    accept = (
        f"INSERT INTO {table} (resource, lock_name, token) VALUES (%s, %s, CAST(%s AS SIGNED)) "
        f"ON DUPLICATE KEY UPDATE checks = IF({cond}, checks + 1, checks), "
        f"token = IF({cond}, VALUES(token), token)"
    )
    read = f"SELECT lock_name, token FROM {table} WHERE resource = %s FOR UPDATE"
    return FenceSQL(create, accept, read, mysql=True)


def _bad_type(value: object) -> bool:
    return isinstance(value, bool) or (value is not None and not isinstance(value, int))


def _inexact(value: object) -> bool:
    """A mark that is a number but not a whole one (5.5 written by hand into SQLite's
    INTEGER column, or into a numeric one): no token can be compared with it."""
    if isinstance(value, float):
        return not value.is_integer()
    return isinstance(value, decimal.Decimal) and value != value.to_integral_value()


def _inexact_mark(resource: str, value: object) -> CorruptMarkError:
    return CorruptMarkError(resource, f"token {value!r} is not an integer")


def _type_error(resource: str, value: object) -> ConfigurationError:
    return ConfigurationError(
        f"the token column of {resource!r} holds {type(value).__name__} values: it must be "
        "a 64-bit integer column (BIGINT on PostgreSQL and MySQL, INTEGER on SQLite)"
    )


def _stored_token(lock: object, value: object, resource: str = "?") -> FencingToken:
    if _inexact(value):
        raise _inexact_mark(resource, value)
    if _bad_type(value):
        raise _type_error(resource, value)
    if not isinstance(lock, str) or not isinstance(value, int) or not 0 < value <= MAX_TOKEN:
        raise CorruptMarkError(resource, f"lock {lock!r}, token {value!r}")
    return FencingToken(lock, value)


def _rejection(
    token: FencingToken, resource: str, stored_lock: object, stored_value: object
) -> FencedError:
    """Why a fenced write matched no row although the row exists: wrong lock, stale, or race."""
    if _inexact(stored_value):
        return _inexact_mark(resource, stored_value)
    if _bad_type(stored_value):
        return _type_error(resource, stored_value)
    if stored_value is not None and not 0 < stored_value <= MAX_TOKEN:  # type: ignore[operator]
        return CorruptMarkError(resource, f"token {stored_value!r}")
    if stored_lock is not None and stored_lock != token.lock:
        return WrongLockError(
            f"{resource!r} is fenced by lock {stored_lock!r}; token {token} belongs to "
            f"lock {token.lock!r}"
        )
    if stored_value is None or (isinstance(stored_value, int) and stored_value <= token.value):
        # Only possible if the mark moved or the row changed between our two statements:
        # the fence did not pass, and the caller should retry the whole transaction.
        return FenceConflictError(
            f"the fence of {resource!r} changed concurrently while rejecting {token}; "
            "roll back and retry"
        )
    high = _stored_token(stored_lock if stored_lock is not None else token.lock, stored_value)
    return StaleTokenError(token, high, resource)


def check_plan(sql: FenceSQL, resource: str, token: FencingToken) -> Plan[FencingToken]:
    """Accept ``token`` and raise the mark to it in one statement, or raise why not."""
    if sql.mysql:
        return (yield from _mysql_check_plan(sql, resource, token))
    if sql.update:  # (SQLite: accepted in place, or the upsert decides)
        res = yield Stmt(sql.update, (resource, token.lock, token.value))
        if res.rowcount == 1:
            return token
    return (yield from accept_plan(sql, resource, token))


def accept_plan(sql: FenceSQL, resource: str, token: FencingToken) -> Plan[FencingToken]:
    """The accepting upsert (it inserts a missing row) and its verdict."""
    res = yield Stmt(sql.accept, (resource, token.lock, token.value))
    return (yield from check_verdict(sql, resource, token, res))


def check_verdict(
    sql: FenceSQL, resource: str, token: FencingToken, res: Result
) -> Plan[FencingToken]:
    """The verdict on the accepting upsert's result ``res`` (PostgreSQL, SQLite): ``token``
    if it returned the row, else why not (:func:`refusal_plan`)."""
    if res.rows:
        if type(res.rows[0][0]) is not int:  # a TEXT (or REAL...) token column, adopted
            _stored_token(token.lock, res.rows[0][0], resource)
        return token
    # Rejected. The conflicting row is now locked by us (PostgreSQL locks it even when the
    # DO UPDATE's WHERE is false) or the whole database is (SQLite), so this read reports
    # exactly the mark that rejected us.
    return (yield from refusal_plan(sql, resource, token))


def refusal_plan(sql: FenceSQL, resource: str, token: FencingToken) -> Plan[NoReturn]:
    """Why the accepting upsert refused ``token`` (it returned no row): the row it refused
    on, read and raised as :class:`~fenced.StaleTokenError`, :class:`~fenced.WrongLockError`,
    :class:`~fenced.CorruptMarkError` or :class:`FenceConflictError`."""
    lock, value = yield from _refusing_row(sql, resource, token)
    if value is None:
        raise CorruptMarkError(resource, "the fence row has no token")
    raise _rejection(token, resource, lock, value)


def _refusing_row(sql: FenceSQL, resource: str, token: FencingToken) -> Plan[tuple[Any, Any]]:
    """The (lock, token) of the fence row that refused ``token``: locked by the refusing
    statement, so it is the mark that refused it."""
    res = yield Stmt(sql.read, (resource,))
    if not res.rows:
        raise FenceConflictError(
            f"the fence row of {resource!r} vanished while checking {token}; roll back and retry"
        )
    lock, value = res.rows[0]
    return lock, value


def _mysql_name(resource: str) -> str:
    if len(resource) > MYSQL_MAX_NAME:
        raise ConfigurationError(
            f"resource name of {len(resource)} characters: the MySQL fence table keys at most "
            f"{MYSQL_MAX_NAME}"
        )
    return resource


def _mysql_check_plan(sql: FenceSQL, resource: str, token: FencingToken) -> Plan[FencingToken]:
    """One statement decides (see _mysql_fence_sql); a refusal reads the row it refused on
    (locked by that statement) to say why."""
    first = yield Stmt(sql.accept, (_mysql_name(resource), token.lock, token.value))
    if mysql_upsert_accepted(first):
        return token
    lock, value = yield from _refusing_row(sql, resource, token)
    if first.rowcount == 1 and lock == token.lock and value == token.value:
        # A count of 1 under FOUND_ROWS: inserted by this statement, or found and refused.
        # The row (locked by us) carries our token: inserted (a refused check's row holds a
        # higher mark or another lock). A count of 0 is always a refusal: an accepted check
        # changes the row (``checks``).
        return token
    if value is None:
        raise CorruptMarkError(resource, "the fence row has no token")
    raise _rejection(token, resource, lock, value)


# -- PostgreSQL: the check that raises in the server (pipelined) --------------------------

STALE_SQLSTATE: Final = "FN001"
"""The SQLSTATE of the refusal raised in the server by the pipelined check (class ``FN`` is
no standard class): the transaction is aborted there, and the client maps it to the error
the row's content explains (see :func:`pipelined_refusal`)."""

_REFUSE_FN: Final = "fenced_refuse_v1"


def _refuse_function(table: str) -> str:
    """The refusal function's name, in the fence table's schema if it has one (``table``
    quoted): a function is looked up on the search path as the table is."""
    schema, dot, _ = table.rpartition(".")
    return f"{schema}{dot}{_REFUSE_FN}"


def pg_refuse_ddl(table: str) -> str:
    """The refusal function ``install()`` creates on PostgreSQL (a PL/pgSQL block of the fence
    table's ``DO`` statement, so ``ddl()`` has it too): reads the fence row that refused
    (locked by the refusing statement) and raises :data:`STALE_SQLSTATE` with what it holds as
    JSON in the DETAIL, which aborts the transaction in the server. Created once (a racing
    install's duplicate is a no-op); a role that may not create functions installs the table
    as before, and ``SQLGuard.transaction`` then says what is missing."""
    return (
        "BEGIN "
        f"CREATE FUNCTION {_refuse_function(table)}(tbl regclass, res text) RETURNS bigint "
        "LANGUAGE plpgsql VOLATILE AS $fn$ DECLARE found_row text; BEGIN "
        # (regclass's text is the table's name quoted as needed; no % for the drivers)
        "EXECUTE 'SELECT json_build_object(''lock'', lock_name, ''token'', token::text)::text "
        "FROM ' || tbl::text || ' WHERE resource = $1' INTO found_row USING res; "
        f"RAISE EXCEPTION USING ERRCODE = '{STALE_SQLSTATE}', "
        "MESSAGE = 'fenced: the fence refused the token', "
        "DETAIL = COALESCE(found_row, '{}'); END $fn$; "
        "EXCEPTION WHEN duplicate_function OR unique_violation OR insufficient_privilege "
        "THEN NULL; END;"
    )


@functools.lru_cache(maxsize=128)
def pg_pipelined_check(table: str) -> str:
    """The fence check as one statement that raises in the server when it refuses: the
    accepting upsert (:func:`fence_sql`) in a CTE, and the refusal function called only
    when it returned no row. Params: resource, lock, token, the table, resource."""
    accept = fence_sql(POSTGRESQL, table).accept
    return (
        f"WITH a AS ({accept}) SELECT token FROM a UNION ALL "
        f"SELECT {_refuse_function(table)}(%s::regclass, %s) WHERE NOT EXISTS (SELECT FROM a)"
    )


# -- PostgreSQL: the check riding in the messages a transaction sends anyway ----------------


RIDE_REFUSED: Final = "fenced: the recheck refused transaction"
"""The start of the error the ride's recheck raises (SQLSTATE 22P02, a cast that cannot
succeed): in a message holding only the recheck and ``COMMIT``, the recheck's refusal."""


@functools.lru_cache(maxsize=128)
def pg_ride_sql(table: str) -> tuple[str, str]:
    """``SQLGuard.transaction``'s two statements on PostgreSQL, with ``{0}``… slots for
    ``PREPARE``'s ``$n`` or for literals (``table`` quoted).

    *check* (resource, lock, token): the accepting upsert (:func:`fence_sql`), returning the
    token, the transaction's id and the search_path iff it accepted; it rides in one
    simple-query message with ``BEGIN``. *recheck* (xid): rides with ``COMMIT``, and raises
    (:data:`RIDE_REFUSED`), so that the ``COMMIT`` after it never runs, unless this is still
    the transaction the check ran in (by its id): then the fence row is locked by it and
    holds this token. A statement of the block that ended that transaction is the only way
    to another one. The recheck names nothing (no table, no function): it means the same in
    whatever search_path the block set, and costs one trivial statement (a refusal reads
    the fence row afterwards, :func:`pg_ride_refusal_read`)."""
    accept = fence_sql(POSTGRESQL, table).accept
    parts = accept.split("%s")
    check = "".join(p + (f"{{{i}}}" if i < 3 else "") for i, p in enumerate(parts))
    # (the search_path the check ran with: a refusal of the recheck reads the fence row in it)
    check = check.replace(
        "RETURNING token", "RETURNING token, txid_current(), current_setting('search_path')"
    )
    # (the cast's argument is not a constant: folded when planned, it would raise in the
    # accepting branch too)
    recheck = (
        "SELECT CASE WHEN txid_current_if_assigned() = {0} THEN 0 ELSE "
        f"CAST(concat('{RIDE_REFUSED} ', txid_current_if_assigned()) AS bigint) END"
    )
    return check, recheck


@functools.lru_cache(maxsize=128)
def pg_ride_refusal_read(table: str) -> str:
    """After a refusing recheck (rolled back): the fence row as it is now, as the refusal
    function reports it (JSON; NULL: no row), read in the check's search_path ({0}) for the
    resource ({1}) in a transaction of its own, and ``txid_status`` of the transaction the
    check ran in ({2}: committed, aborted): ``table`` quoted, slots for literals."""
    return (
        "BEGIN; SELECT set_config('search_path', {0}, true); "
        "SELECT (SELECT json_build_object('lock', lock_name, 'token', token::text)::text "
        f"FROM {table} WHERE resource = {{1}}), txid_status({{2}}); ROLLBACK"
    )


# -- MariaDB: the check that raises in the server (one multi-statement request) --------------


@functools.lru_cache(maxsize=128)
def mariadb_batch_check(table: str) -> str:
    """The fence check as one MariaDB compound statement (``BEGIN NOT ATOMIC``) that raises
    :data:`STALE_SQLSTATE` when it refuses, for a multi-statement request: the accepting
    upsert (:func:`fence_sql`), then a read of the row it has X-locked; anything but this
    lock and this token there is a refusal. (Not the upsert's affected-row count: with
    CLIENT.FOUND_ROWS an untouched row counts as one.) MySQL has no compound statement
    outside stored programs. Params: resource, lock, token, resource, token, lock."""
    sql = _mysql_fence_sql(table)
    quoted = _backquoted(table)
    return (
        "BEGIN NOT ATOMIC "
        "DECLARE found_lock VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin; "
        "DECLARE found_token BIGINT; "
        f"{sql.accept}; "
        f"SELECT lock_name, token INTO found_lock, found_token FROM {quoted} "
        "WHERE resource = %s; "
        "IF found_token IS NULL OR found_token <> CAST(%s AS SIGNED) "
        "OR CAST(found_lock AS BINARY) <> CAST(%s AS BINARY) THEN "
        f"SIGNAL SQLSTATE '{STALE_SQLSTATE}' "
        "SET MESSAGE_TEXT = 'fenced: the fence refused the token'; END IF; "
        # (the witness: lives as long as this transaction; the re-check releases it)
        f"SAVEPOINT {BATCH_WITNESS}; END"
    )


BATCH_WITNESS: Final = "fenced_batch"
"""The savepoint the MariaDB batch check sets after accepting: every end of its transaction
(COMMIT, ROLLBACK, an implicit commit, ``SET autocommit = 1``) drops it, so the re-check's
``RELEASE`` fails exactly when a statement of the batch ended the checked transaction."""
TRANSACTION_ENDED: Final = "the checked transaction ended"
"""The batch re-check's refusal when the witness is gone (:func:`mariadb_batch_recheck`)."""


AUTOCOMMIT_ON: Final = "autocommit was turned on"
"""The batch re-check's refusal when autocommit is on (:func:`mariadb_batch_recheck`)."""


@functools.lru_cache(maxsize=128)
def mariadb_batch_recheck(table: str) -> str:
    """The batch's last statement before ``COMMIT``: the fence row, read with its X lock,
    must still hold this lock and this token, else :data:`STALE_SQLSTATE`. A statement of the
    caller's that ended the transaction (``COMMIT``, ``ROLLBACK``, DDL's implicit commit)
    released the row lock: a newer holder may have fenced and written since, and the
    statements after it would commit unfenced. In the normal case the row is already locked
    by this transaction (a primary-key read). Params: resource, token, lock."""
    quoted = _backquoted(table)
    return (
        "BEGIN NOT ATOMIC "
        "DECLARE found_lock VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin; "
        "DECLARE found_token BIGINT; "
        "DECLARE CONTINUE HANDLER FOR NOT FOUND SET found_token = NULL; "
        # (1305: no such savepoint, the witness is gone: told as the re-check's own refusal)
        f"DECLARE EXIT HANDLER FOR 1305 SIGNAL SQLSTATE '{STALE_SQLSTATE}' "
        f"SET MESSAGE_TEXT = 'fenced: {TRANSACTION_ENDED}';\n"
        # (the batch runs with autocommit off: on now, a statement of it turned it on, and
        # what ran after that committed as it ran; refused before the row is read. The
        # line ends before END IF: a planted no-op SIGNAL in a test comments out to it)
        f"IF @@autocommit <> 0 THEN SIGNAL SQLSTATE '{STALE_SQLSTATE}' "
        f"SET MESSAGE_TEXT = 'fenced: {AUTOCOMMIT_ON}';\nEND IF; "
        f"RELEASE SAVEPOINT {BATCH_WITNESS}; "
        f"SELECT lock_name, token INTO found_lock, found_token FROM {quoted} "
        "WHERE resource = %s FOR UPDATE; "
        "IF found_token IS NULL OR found_token <> CAST(%s AS SIGNED) "
        "OR CAST(found_lock AS BINARY) <> CAST(%s AS BINARY) THEN "
        f"SIGNAL SQLSTATE '{STALE_SQLSTATE}' "
        "SET MESSAGE_TEXT = 'fenced: the fence refused the token'; END IF; END"
    )


def pipelined_refusal(resource: str, token: FencingToken, detail: str | None) -> FencedError:
    """The error for the server's refusal of ``token`` (:data:`STALE_SQLSTATE`), from the
    fence row it reported: stale, wrong lock, corrupt, or gone (a race: retry)."""
    import json

    try:
        row = json.loads(detail or "{}")
    except ValueError:
        row = {}
    if not isinstance(row, dict) or "token" not in row:
        return FenceConflictError(
            f"the fence row of {resource!r} vanished while checking {token}; roll back and retry"
        )
    value: object = row["token"]
    if value is None:
        return CorruptMarkError(resource, "the fence row has no token")
    try:
        value = int(str(value))
    except ValueError:
        return CorruptMarkError(resource, f"token {value!r} is not an integer")
    return _rejection(token, resource, row.get("lock"), value)


def fence_high_water_plan(sql: FenceSQL, resource: str) -> Plan[FencingToken | None]:
    # (MySQL's read locks the row for a refusal's report; a look at the mark need not)
    res = yield Stmt(sql.plain_read, (resource,))
    if not res.rows:
        return None
    lock, value = res.rows[0]
    return _stored_token(lock, value, resource)


def fence_install_plan(d: Dialect, sql: FenceSQL, table_name: str) -> Plan[None]:
    """Create the fence table if missing, then verify the table found: never trust it.

    A pre-existing table (made by hand, by an old version, by another tool) must have a
    ``resource`` text key, a ``lock_name`` text column and a 64-bit integer ``token`` column:
    a TEXT token column would compare ``'10' < '9'`` and let stale writers in.
    """
    yield Stmt(sql.create)
    if d is MYSQL:
        yield from _mysql_verify_fence_table(table_name)
        return
    columns = yield from _columns(d, table_name)
    problems = []
    if "resource" not in columns:
        problems.append("no 'resource' column")
    if "lock_name" not in columns:
        problems.append("no 'lock_name' column")
    token_type = columns.get("token")
    if token_type is None:
        problems.append("no 'token' column")
    elif not _is_bigint(d, token_type):
        problems.append(f"its 'token' column is {token_type or '(no type)'}, not a 64-bit integer")
    if problems:
        raise ConfigurationError(
            f"fence table {table_name!r} exists but cannot be used: {'; '.join(problems)} "
            "(drop or rename it, or pass table= to use another)"
        )


def _mysql_table(table_name: str) -> tuple[str | None, str]:
    schema, _, name = table_name.rpartition(".")
    return (schema or None), name


def _mysql_columns(table_name: str) -> Plan[tuple[str | None, dict[str, tuple[str, str]]]]:
    """The table's engine (None: no such table) and its columns' (data type, collation)."""
    schema, name = _mysql_table(table_name)
    where = "TABLE_SCHEMA = COALESCE(%s, DATABASE()) AND TABLE_NAME = %s"
    res = yield Stmt(f"SELECT ENGINE FROM information_schema.TABLES WHERE {where}", (schema, name))
    if not res.rows:
        return None, {}
    engine = str(res.rows[0][0] or "")
    res = yield Stmt(
        "SELECT COLUMN_NAME, DATA_TYPE, COALESCE(COLLATION_NAME, '') "
        f"FROM information_schema.COLUMNS WHERE {where}",
        (schema, name),
    )
    # (column names are case-insensitive on MySQL: keyed as ident_key compares them)
    return engine, {str(r[0]).lower(): (str(r[1]).lower(), str(r[2])) for r in res.rows}


def _not_innodb(table_name: str, engine: str) -> ConfigurationError:
    return ConfigurationError(
        f"table {table_name!r} uses the {engine} engine: a guarded table must be InnoDB "
        "(transactions and row locks; without them a refused transaction keeps its writes)"
    )


@dataclass(frozen=True, slots=True)
class TableUse:
    """A MySQL or PostgreSQL table a guard writes to, verified before its first use on each
    connection (:func:`table_use_plan`; the driver remembers it per connection):
    ``install()`` verifies only the tables it is given, and a table made or altered by hand
    (MyISAM, a SMALLINT or double precision token column) would otherwise be used as found.
    (SQLite's statements themselves refuse a mark that is not an exact integer: see
    :func:`_exact`.)"""

    table_name: str
    token: str | None = None  # the row form's token column; None: a fence table
    keys: tuple[str, ...] | None = None  # the row form's upsert: its key columns


MySQLUse = TableUse  # (its name before PostgreSQL's tables were verified at use too)


def table_use_plan(d: Dialect, use: TableUse) -> Plan[bool]:
    """Verify ``use`` on ``d`` before its first use on a connection (MySQL, PostgreSQL);
    True if verified (remember it), False if there was nothing to verify yet."""
    if d is MYSQL:
        yield from mysql_use_plan(use)
        return True
    if d is POSTGRESQL:
        return (yield from pg_use_plan(use))
    return False


def pg_use_plan(use: TableUse) -> Plan[bool]:
    """Refuse a PostgreSQL token column that is not ``bigint``: a ``double precision`` one
    rounds tokens above 2**53 together (a stale token then compares equal and passes), a
    ``real`` one above 2**24, ``integer``/``smallint`` ones overflow, ``numeric`` ones hold
    fractions. One catalog look-up per connection and table. A table or column that does not
    exist is left to the guard's statement, which reports it (and is looked up again)."""
    res = yield Stmt(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
        "WHERE attrelid = to_regclass(%s) AND attname = %s AND attnum > 0 AND NOT attisdropped",
        (quote_table(use.table_name), "token" if use.token is None else use.token),
    )
    if not res.rows:
        return False
    if res.rows[0][0] != "bigint":
        if use.token is None:
            raise ConfigurationError(
                f"fence table {use.table_name!r} exists but cannot be used: its 'token' column "
                f"is {res.rows[0][0]}, not a 64-bit integer (drop or rename it, or pass table= "
                "to use another)"
            )
        raise _bad_token_type(use.token, use.table_name, res.rows[0][0])
    return True


def mysql_use_plan(use: MySQLUse) -> Plan[None]:
    """Refuse a table the guard cannot fence: not InnoDB (a refused transaction's writes would
    stay, and two holders' transactions would interleave), or a token column that cannot
    hold every token (a SMALLINT clamps 40000 to 32767 without strict mode; then a stale
    35000 passes). Typed, permanent: :class:`~fenced.ConfigurationError`."""
    if use.token is None:
        yield from _mysql_verify_fence_table(use.table_name, at_use=True)
        return
    engine, columns = yield from _mysql_columns(use.table_name)
    if engine is None:
        raise ConfigurationError(
            f"table {use.table_name!r} does not exist (a TEMPORARY table cannot be verified)"
        )
    if engine.lower() != "innodb":
        raise _not_innodb(use.table_name, engine)
    found = columns.get(ident_key(MYSQL, use.token))
    if found is None:
        raise ConfigurationError(
            f"table {use.table_name!r} has no token column {use.token!r}: call guard.install()"
        )
    if found[0] != "bigint":
        raise _bad_token_type(use.token, use.table_name, found[0])
    if use.keys is not None:
        yield from _mysql_upsert_keys(use.table_name, use.keys)


def _mysql_upsert_keys(table_name: str, keys: tuple[str, ...]) -> Plan[None]:
    """``ON DUPLICATE KEY UPDATE`` acts on whichever unique key a new row collides with: the
    row form's upsert is fenced only if the key columns are exactly one unique key and no
    other unique key exists (else it inserts duplicates, or updates another row, and its
    count says "accepted" either way)."""
    schema, name = _mysql_table(table_name)
    res = yield Stmt(
        "SELECT s.INDEX_NAME, s.COLUMN_NAME, c.EXTRA FROM information_schema.STATISTICS s "
        "JOIN information_schema.COLUMNS c ON c.TABLE_SCHEMA = s.TABLE_SCHEMA "
        "AND c.TABLE_NAME = s.TABLE_NAME AND c.COLUMN_NAME = s.COLUMN_NAME "
        "WHERE s.TABLE_SCHEMA = COALESCE(%s, DATABASE()) AND s.TABLE_NAME = %s "
        "AND s.NON_UNIQUE = 0",
        (schema, name),
    )
    indexes: dict[str, set[str]] = {}
    generated: set[str] = set()  # unique keys of one AUTO_INCREMENT column: a new row's own
    for index, column, extra in res.rows:
        indexes.setdefault(str(index), set()).add(str(column).lower())
        if "auto_increment" in str(extra).lower():
            generated.add(str(index))
    wanted = {k.lower() for k in keys}
    others = sorted(
        i
        for i, cols in indexes.items()
        if cols != wanted and not (i in generated and len(cols) == 1)
    )
    if wanted not in indexes.values() or others:
        raise ConfigurationError(
            f"insert_or_update on {table_name!r} needs a primary key or unique key on exactly "
            f"{list(keys)} and no other unique key (MySQL's upsert would act on another: "
            f"{others or 'none on the key columns'})"
        )


def _mysql_verify_fence_table(table_name: str, *, at_use: bool = False) -> Plan[None]:
    engine, columns = yield from _mysql_columns(table_name)
    if engine is None:
        if at_use:
            raise ConfigurationError(
                f"fence table {table_name!r} does not exist: has the guard been installed "
                "(guard.install())?"
            )
        raise ConfigurationError(f"fence table {table_name!r} was not created")
    if engine.lower() != "innodb":
        raise _not_innodb(table_name, engine)
    problems = []
    for text in ("resource", "lock_name"):
        if text not in columns:
            problems.append(f"no {text!r} column")
        elif not columns[text][1].endswith("_bin") and columns[text][0] not in _MYSQL_BINARY:
            problems.append(f"its {text!r} column compares case-insensitively ({columns[text][1]})")
    for number in ("token", "checks"):
        if number not in columns:
            problems.append(f"no {number!r} column")
        elif columns[number][0] != "bigint":
            problems.append(f"its {number!r} column is {columns[number][0]}, not bigint")
    if problems:
        raise ConfigurationError(
            f"fence table {table_name!r} exists but cannot be used: {'; '.join(problems)} "
            "(drop or rename it, or pass table= to use another)"
        )


_MYSQL_BINARY: Final = frozenset({"varbinary", "binary", "blob"})


def _is_bigint(d: Dialect, type_: str) -> bool:
    if d is POSTGRESQL:
        return type_ == "bigint"
    return "INT" in type_.upper()  # SQLite's rule for INTEGER affinity; 64-bit storage


def _columns(d: Dialect, table_name: str) -> Plan[dict[str, str]]:
    """The table's column names and declared types (empty if the table does not exist)."""
    if d is POSTGRESQL:
        res = yield Stmt(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            f"WHERE attrelid = to_regclass({d.param}) AND attnum > 0 AND NOT attisdropped",
            (quote_table(table_name),),
        )
    else:
        schema, _, name = table_name.rpartition(".")
        # Without a schema, SQLite looks the name up as a statement would (temp, main, ...).
        res = yield Stmt(
            f"SELECT name, type FROM pragma_table_info({d.param}{', ' + d.param if schema else ''})",
            (name, schema) if schema else (name,),
        )
    return {ident_key(d, str(r[0])): str(r[1] or "") for r in res.rows}


# -- row form -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)  # identity hash: a cheap cache key
class RowSQL:
    """A row-form table's identifiers, quoted once."""

    table: str  # quoted
    table_name: str  # as given, for messages
    keys: tuple[str, ...]  # raw names
    token: str  # raw name
    lock: str | None  # raw name of the lock column, if any


@functools.lru_cache(maxsize=128)
def _spec_columns(d: Dialect, spec: RowSQL) -> dict[str, str]:
    """The guard's own columns as ``d`` compares names (key -> what it is), refusing a guard
    whose key, token and lock columns are one column on ``d`` (``ID`` and ``id`` on SQLite)."""
    named = [*spec.keys, spec.token, *((spec.lock,) if spec.lock else ())]
    same_columns(d, named, "key, token and lock columns must differ")
    own = {ident_key(d, k): "key column" for k in spec.keys}
    own[ident_key(d, spec.token)] = "token column"
    if spec.lock:
        own[ident_key(d, spec.lock)] = "lock column"
    return own


def _where_key(d: Dialect, spec: RowSQL) -> str:
    return " AND ".join(f"{quote_ident(k)} = {d.param}" for k in spec.keys)


def _key_params(spec: RowSQL, key: Mapping[str, Any]) -> tuple[Any, ...]:
    if type(key) is dict and len(key) == len(spec.keys):  # the usual case, checked cheaply
        try:
            params = tuple([key[k] for k in spec.keys])
        except KeyError:
            pass
        else:
            for v in params:
                if v is None:
                    break
            else:
                return params
    is_mapping = type(key) is dict or isinstance(key, Mapping)
    if not is_mapping or len(key) != len(spec.keys) or any(k not in key for k in spec.keys):
        got = sorted(key) if is_mapping else key
        raise ConfigurationError(
            f"key must give exactly the key columns {list(spec.keys)} of {spec.table_name}, "
            f"got {got!r}"
        )
    params = tuple([key[k] for k in spec.keys])
    if any(v is None for v in params):
        raise ConfigurationError(f"key values must not be None: {dict(key)!r}")
    return params


@dataclass(frozen=True, slots=True)
class Add:
    """A relative write for :class:`~fenced.guards.sql.RowGuard`: ``values={"balance": Add(-25)}``
    sets ``balance = COALESCE(balance, 0) + :amount`` in the same guarded statement (the
    amount is a bound parameter, never SQL text). On insert, a missing row counts as 0."""

    amount: int | float | decimal.Decimal

    def __post_init__(self) -> None:
        if isinstance(self.amount, bool) or not isinstance(
            self.amount, int | float | decimal.Decimal
        ):
            raise ConfigurationError(f"Add() takes a number, not {self.amount!r}")


_NO_COLUMNS: Final = frozenset[str]()


def _value_columns(values: Mapping[str, Any]) -> tuple[str, ...]:
    if type(values) is not dict and not isinstance(values, Mapping):
        raise ConfigurationError(f"values must be a mapping, not {type(values).__name__}")
    return tuple(values)


def _label(spec: RowSQL, key: Mapping[str, Any]) -> str:
    inner = ", ".join(f"{k}={key[k]!r}" for k in spec.keys)
    return f"{spec.table_name}({inner})"


def _as_int(d: Dialect, expr: str, *, stored: bool = False) -> str:
    """``expr`` compared as an integer whatever the token column's declared type.

    The incoming token (a bound parameter, or ``excluded.<token>`` of an upsert, which has the
    column's type) is always cast to a 64-bit integer. A stored value is cast on SQLite only:
    SQLite compares by column affinity, and in a user-made ``TEXT`` column ``'10' <= '9'``
    holds, while a CAST gives it numeric affinity (a no-op on an INTEGER column). On
    PostgreSQL a stored ``text`` compared with ``bigint`` is an error (42883), which becomes a
    :class:`~fenced.ConfigurationError` naming the column's type: refused at first use, never
    compared as text; ``integer`` and ``numeric`` columns compare numerically.
    """
    if stored and d is POSTGRESQL:
        return expr
    return f"CAST({expr} AS {d.cast})"


def _exact(d: Dialect, expr: str) -> str:
    """A guard (ending in ``AND``) that the stored mark ``expr`` is an exact integer, for
    SQLite, where any column holds any value: ``CAST`` truncates a REAL 5.5 to 5 (token 5
    passed and overwrote the mark) and a REAL column rounds tokens above 2**53 together. A
    REAL value, or a text that is not an integer's spelling, matches nothing: the write is
    refused and the read reports the mark (:class:`~fenced.CorruptMarkError` for 5.5, the
    column's type for a REAL column). A TEXT column's ``'10'`` stays usable (it is exact).
    PostgreSQL and MySQL verify the column's type before its first use on a connection."""
    if d is not SQLITE:
        return ""
    return f"typeof({expr}) <> 'real' AND CAST({expr} AS INTEGER) = {expr} AND "


def _row_read(d: Dialect, spec: RowSQL, *, locking: bool = False) -> str:
    """The row's token (and lock). ``locking`` (MySQL, after a write that matched nothing):
    ``FOR UPDATE``, which reads the newest committed row, not the transaction's snapshot."""
    tok = quote_ident(spec.token)
    if d is SQLITE:  # an exact integer (a TEXT column's '10') as int, anything else as stored
        exact = _exact(d, tok).removesuffix(" AND ")
        cols = f"CASE WHEN {exact} THEN CAST({tok} AS INTEGER) ELSE {tok} END"
    else:
        cols = tok
    cols += f", {quote_ident(spec.lock)}" if spec.lock else ""
    sql = f"SELECT {cols} FROM {spec.table} WHERE {_where_key(d, spec)}"
    if d is MYSQL:
        return _backquoted(sql + (" FOR UPDATE" if locking else ""))
    return sql


def _row_guard_clause(d: Dialect, spec: RowSQL, target: str, incoming: str) -> str:
    """``target`` accepts ``incoming``: never fenced (NULL) or not newer, and the same lock."""
    tok = quote_ident(spec.token)
    stored = _as_int(d, f"{target}{tok}", stored=True)
    ordered = f"{_exact(d, target + tok)}{stored} > 0 AND {stored} <= {_as_int(d, incoming)}"
    if not spec.lock:
        return f"({target}{tok} IS NULL OR ({ordered}))"
    # A row whose lock column is set but whose token is NULL lost its mark: corrupt, refused.
    lk = quote_ident(spec.lock)
    if incoming.startswith("excluded."):
        lock_in = f"excluded.{lk}"
    elif incoming.startswith("VALUES("):
        lock_in = f"VALUES({lk})"
    else:
        lock_in = d.param
    same_lock = f"{target}{lk} = {lock_in}"
    if d is MYSQL:  # whatever the column's collation: lock names compare exactly
        same_lock = f"CAST({target}{lk} AS BINARY) = CAST({lock_in} AS BINARY)"
    return (
        f"(({target}{tok} IS NULL AND {target}{lk} IS NULL) OR "
        f"({ordered} AND ({target}{lk} IS NULL OR {same_lock})))"
    )


@functools.lru_cache(maxsize=512)
def _row_write_sql(
    d: Dialect,
    spec: RowSQL,
    columns: tuple[str, ...],
    upsert: bool,
    relative: frozenset[str] = frozenset(),
) -> str:
    """The conditional write's SQL for these value columns (validated here, then cached);
    the ``relative`` ones are added to (:class:`Add`), not set."""
    own = _spec_columns(d, spec)
    for c in columns:
        quote_ident(c, "column name")
        if ident_key(d, c) in own:  # as the database compares names: Fencing_Token too
            raise ConfigurationError(
                f"values may not set {c!r}: it is the {own[ident_key(d, c)]} of the guard"
            )
    same_columns(d, columns, "values")
    p = d.param
    tok = quote_ident(spec.token)

    def set_to(c: str, target: str, value: str) -> str:
        q = quote_ident(c)
        return f"{q} = COALESCE({target}{q}, 0) + {value}" if c in relative else f"{q} = {value}"

    all_cols = [*spec.keys, *columns, spec.token, *((spec.lock,) if spec.lock else ())]
    if d is MYSQL and upsert:
        # (see _mysql_fence_sql) values first, then the token, then the lock: each condition
        # is then evaluated on a row that still says what the first one said
        cond = _row_guard_clause(d, spec, "", "VALUES(" + tok + ")")
        updated = [*columns, spec.token, *((spec.lock,) if spec.lock else ())]
        sets = []
        for c in updated:
            q = quote_ident(c)
            new = f"COALESCE({q}, 0) + VALUES({q})" if c in relative else f"VALUES({q})"
            sets.append(f"{q} = IF({cond}, {new}, {q})")
        return _backquoted(
            f"INSERT INTO {spec.table} ({', '.join(quote_ident(c) for c in all_cols)}) "
            f"VALUES ({', '.join([p] * len(all_cols))}) ON DUPLICATE KEY UPDATE " + ", ".join(sets)
        )
    if not upsert:
        sets = [set_to(c, "", p) for c in columns] + [f"{tok} = {p}"]
        if spec.lock:
            sets.append(f"{quote_ident(spec.lock)} = {p}")
        sql = (
            f"UPDATE {spec.table} SET {', '.join(sets)} "
            f"WHERE {_where_key(d, spec)} AND {_row_guard_clause(d, spec, '', p)}"
        )
        return _backquoted(sql) if d is MYSQL else sql
    updated = [*columns, spec.token, *((spec.lock,) if spec.lock else ())]
    return (
        f"INSERT INTO {spec.table} AS t ({', '.join(quote_ident(c) for c in all_cols)}) "
        f"VALUES ({', '.join([p] * len(all_cols))}) "
        f"ON CONFLICT ({', '.join(quote_ident(k) for k in spec.keys)}) DO UPDATE SET "
        + ", ".join(set_to(c, "t.", f"excluded.{quote_ident(c)}") for c in updated)
        + f" WHERE {_row_guard_clause(d, spec, 't.', 'excluded.' + tok)}"
    )


def row_write_stmt(
    d: Dialect,
    spec: RowSQL,
    token: FencingToken,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    *,
    upsert: bool,
) -> tuple[Stmt, tuple[Any, ...]]:
    """The row form's one conditional statement (UPDATE, or the dialect's upsert), which
    writes only if the token is fresh; and the key's parameters, for a read after it."""
    key_params = _key_params(spec, key)
    columns = _value_columns(values)
    value_params = tuple(values.values())
    relative = _NO_COLUMNS
    for v in value_params:
        if isinstance(v, Add):  # (rare: only then the relative columns are worked out)
            relative = frozenset(c for c in columns if isinstance(values[c], Add))
            value_params = tuple(values[c].amount if c in relative else values[c] for c in columns)
            break
    sql = _row_write_sql(d, spec, columns, upsert, relative)
    lock_params: tuple[Any, ...] = (token.lock,) if spec.lock else ()
    if upsert:
        params = (*key_params, *value_params, token.value, *lock_params)
    else:
        params = (*value_params, token.value, *lock_params, *key_params, token.value, *lock_params)
    return Stmt(sql, params), key_params


def row_write_accepted(d: Dialect, res: Result, upsert: bool) -> bool:
    """True if the statement's reply alone shows the write was accepted (the usual case);
    otherwise :func:`row_write_rest` decides, reading the row where it must."""
    if d is MYSQL and upsert:
        return mysql_upsert_accepted(res)
    return res.rowcount == 1


def row_write_plan(
    d: Dialect,
    spec: RowSQL,
    token: FencingToken,
    key: Mapping[str, Any],
    first: tuple[Stmt, tuple[Any, ...]],
    *,
    upsert: bool,
) -> Plan[FencingToken]:
    """One conditional UPDATE (or INSERT .. ON CONFLICT DO UPDATE) that writes only if fresh:
    ``first``, from :func:`row_write_stmt`.

    Drivers may run that statement themselves and go on with :func:`row_write_rest` only
    when :func:`row_write_accepted` is False: the same three steps as this plan.
    """
    stmt, key_params = first
    res = yield stmt
    if row_write_accepted(d, res, upsert):
        return token
    return (yield from row_write_rest(d, spec, token, key, key_params, res, upsert=upsert))


def row_write_rest(
    d: Dialect,
    spec: RowSQL,
    token: FencingToken,
    key: Mapping[str, Any],
    key_params: tuple[Any, ...],
    res: Result,
    *,
    upsert: bool,
) -> Plan[FencingToken]:
    """After a row-form statement that did not plainly accept: refuse with the row's reason.

    MySQL counts *changed* rows, so an UPDATE that changed nothing may have matched a row
    whose values were already these, and an upsert may report no verdict: a locking read of
    the row tells. Elsewhere a statement that matched no row was refused (or found none).
    """
    if res.rowcount > 1 and not (d is MYSQL and upsert):  # (MySQL's upsert counts 2 a row)
        raise ConfigurationError(
            f"key {dict(key)!r} matched {res.rowcount} rows of {spec.table_name}: the key "
            "columns must identify one row (the transaction must be rolled back)"
        )
    if d is not MYSQL:
        res = yield Stmt(_row_read(d, spec), key_params)
        if not res.rows:
            raise ResourceNotFoundError(f"no row {_label(spec, key)} to update")
        row = res.rows[0]
        if row[0] is None:  # refused with a NULL token: only if the lock column is set
            raise CorruptMarkError(_label(spec, key), f"lock {row[1]!r} bound, token NULL")
        raise _rejection(token, _label(spec, key), row[1] if spec.lock else None, row[0])
    res = yield Stmt(_row_read(MYSQL, spec, locking=True), key_params)
    if not res.rows:
        if not upsert:
            raise ResourceNotFoundError(f"no row {_label(spec, key)} to update")
        raise FenceConflictError(
            f"row {_label(spec, key)} vanished while writing with {token}; roll back and retry"
        )
    row = res.rows[0]
    stored, lock = row[0], (row[1] if spec.lock else None)
    if _inexact(stored):
        raise _inexact_mark(_label(spec, key), stored)
    if _bad_type(stored):
        raise _type_error(_label(spec, key), stored)
    if stored == token.value and lock in (None, token.lock):
        # matched and already so (MySQL counts changed rows), or an insert counted like an
        # unchanged row (FOUND_ROWS): the row, locked by us, carries this token, so the write
        # stands (a refusal leaves a higher token, another lock or a NULL token with a lock)
        return token
    if stored is None:
        raise CorruptMarkError(_label(spec, key), f"lock {lock!r} bound, token NULL")
    raise _rejection(token, _label(spec, key), lock, stored)


def row_high_water_plan(
    d: Dialect, spec: RowSQL, lock: str, key: Mapping[str, Any]
) -> Plan[FencingToken | None]:
    _spec_columns(d, spec)
    key_params = _key_params(spec, key)
    res = yield Stmt(_row_read(d, spec), key_params)
    if not res.rows:
        raise ResourceNotFoundError(f"no row {_label(spec, key)}")
    row = res.rows[0]
    if row[0] is None:
        return None
    return _stored_token(
        row[1] if spec.lock and row[1] is not None else lock, row[0], _label(spec, key)
    )


def row_install_plan(d: Dialect, spec: RowSQL) -> Plan[None]:
    """Add the token (and lock) column if missing; the table itself must exist."""
    _spec_columns(d, spec)
    wanted: Sequence[tuple[str, str]] = [(spec.token, d.bigint)]
    if spec.lock:
        wanted = [*wanted, (spec.lock, "TEXT")]
    # Columns are looked up as the database compares names: a column found under another
    # case is the one the guard's statements will use, so it is the one whose type counts
    # (looked up exactly, it was missed, its ADD COLUMN failed as a duplicate and was taken
    # for a racing install, and a SMALLINT token column went unchecked).
    if d is MYSQL:
        engine, columns = yield from _mysql_columns(spec.table_name)
        if engine is None:
            raise ConfigurationError(f"table {spec.table_name!r} does not exist")
        if engine.lower() != "innodb":
            raise _not_innodb(spec.table_name, engine)
        found = columns.get(ident_key(d, spec.token))
        if found is not None and found[0] != "bigint":
            raise _bad_token_column(spec, found[0])
        types = {
            spec.token: "BIGINT",
            spec.lock or "": "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
        }
        for column, _ in wanted:
            if ident_key(d, column) in columns:
                continue
            try:
                yield Stmt(
                    _backquoted(
                        f"ALTER TABLE {spec.table} ADD COLUMN {quote_ident(column)} {types[column]}"
                    )
                )
            except DuplicateColumn:
                pass  # a concurrent install added it first
        return
    if d is POSTGRESQL:
        res = yield Stmt(f"SELECT to_regclass({d.param})", (spec.table,))
        if not res.rows or res.rows[0][0] is None:
            raise ConfigurationError(f"table {spec.table_name!r} does not exist")
        res = yield Stmt(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
            f"WHERE attrelid = to_regclass({d.param}) AND attname = {d.param} "
            "AND NOT attisdropped",
            (spec.table, spec.token),
        )
        if res.rows and res.rows[0][0] != "bigint":
            raise _bad_token_column(spec, res.rows[0][0])
        for column, type_ in wanted:
            yield Stmt(
                f"ALTER TABLE {spec.table} ADD COLUMN IF NOT EXISTS {quote_ident(column)} {type_}"
            )
        return
    schema, _, name = spec.table_name.rpartition(".")
    res = yield Stmt(
        f"SELECT name, type FROM pragma_table_info({d.param}, {d.param})",
        (name, schema or "main"),
    )
    if not res.rows:
        raise ConfigurationError(f"table {spec.table_name!r} does not exist")
    present = {ident_key(d, str(r[0])): str(r[1]) for r in res.rows}
    token_type = present.get(ident_key(d, spec.token))
    if token_type is not None and "INT" not in token_type.upper():
        raise _bad_token_column(spec, token_type or "(no type)")
    for column, type_ in wanted:
        if ident_key(d, column) in present:
            continue
        try:
            yield Stmt(f"ALTER TABLE {spec.table} ADD COLUMN {quote_ident(column)} {type_}")
        except DuplicateColumn:
            pass  # a concurrent install added it first


def _bad_token_column(spec: RowSQL, type_: object) -> ConfigurationError:
    return _bad_token_type(spec.token, spec.table_name, type_)


def _bad_token_type(token: str, table_name: str, type_: object) -> ConfigurationError:
    # Text compares '10' < '3'; int4 overflows at 2**31; floats round large tokens together.
    return ConfigurationError(
        f"token column {token!r} of {table_name!r} is {type_}: it must be a 64-bit "
        "integer column (BIGINT on PostgreSQL and MySQL, INTEGER on SQLite)"
    )


class DuplicateColumn(ConfigurationError):
    """'duplicate column name': a column added twice (e.g. by racing installs)."""


# -- replicated-group members: several marks checked and raised in one transaction ----------
#
# A member of a replicated group (fenced.replicated) keeps, beside the guard's own fence row,
# the group's configuration epoch mark, the holder's token text and the data items, each
# stamped. One plan checks the lock token against the fence (check_plan, the guard's own
# rule, written once) and the epoch against the epoch mark, raises both and applies each
# item only if its stamp is newer, in the caller's one transaction: all or nothing.

# (GroupItem and GroupState are the contract every guard's group methods share: see _plan.)

MYSQL_MAX_GROUP: Final = 255
_ITEM_ROWS: Final = 200  # rows per item statement (4 parameters each: far below any limit)
MYSQL_MAX_KEY: Final = 500  # (with the group: 3020 bytes of a 3072-byte InnoDB key)


@dataclass(frozen=True, slots=True)
class GroupSQL:
    """The group tables' statements for one dialect (names fixed: ``fenced_group_*``)."""

    create: tuple[str, ...]
    epoch: str  # SQLite/PostgreSQL: (grp, epoch) -> a row iff accepted; MySQL: (epoch, grp)
    epoch_since: str  # (epoch, grp, since, epoch) -> a row iff accepted (not MySQL)
    epoch_ensure: str  # MySQL: (grp,) the row made at 0 if missing, X-locked either way
    epoch_read: str  # (grp,) -> (epoch,); MySQL: the newest committed row, locked
    holder: str  # (grp, token text)
    reset: str  # (grp,)
    item: str  # "{rows}" for rows of (grp, key, stamp, value): each written over an older stamp
    item_row: str
    read_holder: str  # (grp,) -> (token,)
    read_items: str  # (grp,) -> (key, stamp, value)


@functools.lru_cache(maxsize=4)
def group_sql(d: Dialect) -> GroupSQL:
    """Build the group tables' statements for ``d``."""
    p = d.param
    if d is MYSQL:
        text = "CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
        return GroupSQL(
            create=(
                "CREATE TABLE IF NOT EXISTS fenced_group_epochs ("
                f"grp VARCHAR({MYSQL_MAX_GROUP}) {text} PRIMARY KEY, epoch BIGINT NOT NULL, "
                "CONSTRAINT fenced_epoch_positive CHECK (epoch >= 0)) ENGINE=InnoDB",
                "CREATE TABLE IF NOT EXISTS fenced_group_data ("
                f"grp VARCHAR({MYSQL_MAX_GROUP}) {text}, `key` VARCHAR({MYSQL_MAX_KEY}) {text}, "
                "stamp VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin NOT NULL, "
                "value LONGBLOB, PRIMARY KEY (grp, `key`)) ENGINE=InnoDB",
                "CREATE TABLE IF NOT EXISTS fenced_group_holders ("
                f"grp VARCHAR({MYSQL_MAX_GROUP}) {text} PRIMARY KEY, token TEXT NOT NULL) "
                "ENGINE=InnoDB",
            ),
            epoch="UPDATE fenced_group_epochs SET epoch = %s WHERE grp = %s",
            epoch_since="",
            # (an upsert X-locks the row it finds or makes, under every isolation level, so
            # the read below sees the newest committed mark and no one moves it till COMMIT)
            epoch_ensure="INSERT INTO fenced_group_epochs (grp, epoch) VALUES (%s, 0) "
            "ON DUPLICATE KEY UPDATE epoch = epoch",
            epoch_read="SELECT epoch FROM fenced_group_epochs WHERE grp = %s FOR UPDATE",
            holder="INSERT INTO fenced_group_holders (grp, token) VALUES (%s, %s) "
            "ON DUPLICATE KEY UPDATE token = VALUES(token)",
            reset="DELETE FROM fenced_group_data WHERE grp = %s",
            # (assignments run left to right: value is decided on the old stamp, then stamp)
            item="INSERT INTO fenced_group_data (grp, `key`, stamp, value) VALUES {rows} "
            "ON DUPLICATE KEY UPDATE value = IF(stamp < VALUES(stamp), VALUES(value), value), "
            "stamp = IF(stamp < VALUES(stamp), VALUES(stamp), stamp)",
            item_row="(%s, %s, %s, %s)",
            read_holder="SELECT token FROM fenced_group_holders WHERE grp = %s",
            read_items="SELECT `key`, stamp, value FROM fenced_group_data WHERE grp = %s",
        )
    blob = "BLOB" if d is SQLITE else "BYTEA"

    # SQLite keeps any value in any column: a damaged epoch (2.5) compares as a number and
    # would be overwritten; only an integer row is raised, any other is read back as corrupt.
    def whole(alias: str) -> str:
        return f" AND typeof({alias}epoch) = 'integer'" if d is SQLITE else ""

    return GroupSQL(
        create=(
            "CREATE TABLE IF NOT EXISTS fenced_group_epochs ("
            " grp TEXT PRIMARY KEY, epoch BIGINT NOT NULL CHECK (epoch >= 0))",
            "CREATE TABLE IF NOT EXISTS fenced_group_data ("
            f" grp TEXT NOT NULL, key TEXT NOT NULL, stamp TEXT NOT NULL, value {blob},"
            " PRIMARY KEY (grp, key))",
            "CREATE TABLE IF NOT EXISTS fenced_group_holders ("
            "grp TEXT PRIMARY KEY, token TEXT NOT NULL)",
        ),
        # One statement each: a row comes back iff the epoch was accepted (the fence's way).
        epoch=f"INSERT INTO fenced_group_epochs AS f (grp, epoch) VALUES ({p}, {p}) "
        "ON CONFLICT (grp) DO UPDATE SET epoch = excluded.epoch "
        "WHERE f.epoch <= excluded.epoch" + whole("f.") + " RETURNING epoch",
        # With ``since``: only a row already at ``since`` or above may be raised (no row: 0).
        epoch_since=f"UPDATE fenced_group_epochs SET epoch = {p} "
        f"WHERE grp = {p} AND epoch >= {p} AND epoch <= {p}{whole('')} RETURNING epoch",
        epoch_ensure="",
        epoch_read=f"SELECT epoch FROM fenced_group_epochs WHERE grp = {p}",
        holder=f"INSERT INTO fenced_group_holders (grp, token) VALUES ({p}, {p}) "
        "ON CONFLICT (grp) DO UPDATE SET token = excluded.token",
        reset=f"DELETE FROM fenced_group_data WHERE grp = {p}",
        item="INSERT INTO fenced_group_data AS d (grp, key, stamp, value) VALUES {rows} "
        "ON CONFLICT (grp, key) DO UPDATE SET stamp = excluded.stamp, value = excluded.value "
        "WHERE d.stamp < excluded.stamp",
        item_row=f"({p}, {p}, {p}, {p})",
        read_holder=f"SELECT token FROM fenced_group_holders WHERE grp = {p}",
        read_items=f"SELECT key, stamp, value FROM fenced_group_data WHERE grp = {p}",
    )


_GROUP_TABLES: Final = ("fenced_group_epochs", "fenced_group_data", "fenced_group_holders")


def group_install_plan(d: Dialect) -> Plan[None]:
    """Create the group tables if missing (the fence table is the guard's install), then
    verify the tables found, as the fence table's install does: an epoch column that is not
    a 64-bit integer would compare as text (``'10' < '9'``), a MySQL table not InnoDB would
    keep a refused change's writes."""
    for create in group_sql(d).create:
        yield Stmt(create)
    if d is MYSQL:
        for table in _GROUP_TABLES:
            engine, _ = yield from _mysql_columns(table)
            if engine is not None and engine.lower() != "innodb":
                raise _not_innodb(table, engine)
        _, columns = yield from _mysql_columns(_GROUP_TABLES[0])
        epoch_type = columns.get("epoch", ("", ""))[0]
        bigint = epoch_type == "bigint"
    else:
        epoch_type = (yield from _columns(d, _GROUP_TABLES[0])).get("epoch", "")
        bigint = bool(epoch_type) and _is_bigint(d, epoch_type)
    if not bigint:
        raise ConfigurationError(
            f"table {_GROUP_TABLES[0]!r} exists but cannot be used: its 'epoch' column is "
            f"{epoch_type or '(missing)'}, not a 64-bit integer (drop or rename it)"
        )


def _group_epoch(res: Result, resource: str) -> int:
    """The epoch mark read (0: no row); anything but a whole number >= 0 fails closed."""
    if not res.rows:
        return 0
    value = res.rows[0][0]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOKEN:
        raise CorruptMarkError(resource, f"the group's epoch mark {value!r}")
    return value


def _group_names(d: Dialect, group: str, items: Sequence[GroupItem]) -> None:
    if d is MYSQL and (
        len(group) > MYSQL_MAX_GROUP or any(len(k) > MYSQL_MAX_KEY for k, _, _ in items)
    ):
        raise ConfigurationError(
            f"a group name of at most {MYSQL_MAX_GROUP} and keys of at most {MYSQL_MAX_KEY} "
            "characters on MySQL (InnoDB keys are at most 3072 bytes)"
        )


def group_apply_plan(
    d: Dialect,
    fence: FenceSQL,
    resource: str,
    group: str,
    token: FencingToken | None,
    epoch: int,
    items: Sequence[GroupItem],
    *,
    reset: bool = False,
    since: int = 0,
) -> Plan[None]:
    """Inside the caller's transaction: refuse ``token`` below the lock mark (the guard's
    :func:`check_plan`: StaleTokenError, WrongLockError, ...), ``epoch`` below the epoch mark
    (StaleEpochError), or an epoch mark below ``since`` (MemberBehindError); else raise
    both marks, keep ``token``'s text as the holder, forget every item first if ``reset``,
    and write each item whose stamp is newer than the stored one. ``token`` None: the lock
    mark is neither checked nor raised. A refusal raises: the caller rolls back."""
    _group_names(d, group, items)
    g = group_sql(d)
    if token is not None:
        yield from check_plan(fence, resource, token)
    if d is MYSQL:
        yield Stmt(g.epoch_ensure, (group,))
        at = _group_epoch((yield Stmt(g.epoch_read, (group,))), resource)
        if at > epoch:
            raise refused_epoch(resource, at, epoch)
        if at < since:
            raise refused_behind(resource, at, since)
        if epoch > at:
            yield Stmt(g.epoch, (epoch, group))
        if token is not None:
            yield Stmt(g.holder, (group, str(token)))
    else:
        sql, args = (
            (g.epoch_since, (epoch, group, since, epoch))
            if since > 0
            else (g.epoch, (group, epoch))
        )
        keep_holder = token is not None
        if keep_holder and d is POSTGRESQL:
            # The holder rides on the epoch statement (one round trip less); a refusal
            # below rolls it back with the rest.
            sql, args = f"WITH holder AS ({g.holder}) {sql}", (group, str(token), *args)
            keep_holder = False
        res = yield Stmt(sql, args)
        if not res.rows:
            at = _group_epoch((yield Stmt(g.epoch_read, (group,))), resource)
            if at > epoch:
                raise refused_epoch(resource, at, epoch)
            if at < since:
                raise refused_behind(resource, at, since)
            raise FenceConflictError(
                f"the epoch mark of {resource!r} changed concurrently; roll back and retry"
            )
        if keep_holder:
            yield Stmt(g.holder, (group, str(token)))
    if reset:
        yield Stmt(g.reset, (group,))
    # The items in statements of many rows (one round trip for up to _ITEM_ROWS): one item
    # per key, the newest (the first of equal stamps), which is what applying them one by one
    # keeps; PostgreSQL refuses an upsert that meets one row twice.
    newest: dict[str, GroupItem] = {}
    for item in items:
        held = newest.get(item[0])
        if held is None or held[1] < item[1]:
            newest[item[0]] = item
    rows = list(newest.values())
    for at in range(0, len(rows), _ITEM_ROWS):
        chunk = rows[at : at + _ITEM_ROWS]
        sql = g.item.format(rows=", ".join([g.item_row] * len(chunk)))
        yield Stmt(sql, tuple(v for key, st, value in chunk for v in (group, key, st, value)))


def _item_bytes(value: Any, resource: str, key: str) -> bytes | None:
    """A stored item's value: bytes (a BLOB/BYTEA), or None (deleted); anything else (SQLite
    keeps text or numbers in any column) is a damaged row."""
    if value is None or isinstance(value, (bytes, bytearray, memoryview)):
        return None if value is None else bytes(value)
    raise CorruptMarkError(resource, f"group item {key[:40]!r}: value {value!r:.60}")


def group_read_plan(
    d: Dialect, fence: FenceSQL, resource: str, group: str, keys: Sequence[str] | None
) -> Plan[GroupState]:
    """Both marks, the holder and the items of ``keys`` (None: all), read in the caller's
    transaction: one snapshot, where the transaction takes one (PostgreSQL: asked for here,
    its default READ COMMITTED gives each statement its own; MySQL's default REPEATABLE READ
    does; SQLite's transaction does)."""
    if d is POSTGRESQL:
        yield Stmt("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    mark = yield from fence_high_water_plan(fence, resource)
    g = group_sql(d)
    at = _group_epoch((yield Stmt(g.epoch_read.removesuffix(" FOR UPDATE"), (group,))), resource)
    held = yield Stmt(g.read_holder, (group,))
    rows: list[tuple[Any, ...]] = []
    if keys is None or keys:
        query, params = g.read_items, (group,)  # type: tuple[str, tuple[str, ...]]
        if keys is not None:
            column = "`key`" if d is MYSQL else "key"
            query += f" AND {column} IN ({', '.join([d.param] * len(keys))})"
            params = (group, *keys)
        rows = (yield Stmt(query, params)).rows
    state = GroupState(
        mark.value if mark else 0,
        at,
        str(held.rows[0][0]) if held.rows else None,
        [(str(k), str(s), _item_bytes(v, resource, str(k))) for k, s, v in rows],
    )
    return checked_group_state(state, resource)
