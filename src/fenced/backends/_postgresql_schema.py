"""The SQL of the ``postgresql://`` source: its tables and functions (DDL), statements,
names (schema and prefix), options and the check of the URL's libpq parameters."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from types import MappingProxyType
from typing import Final
from urllib.parse import SplitResult

import psycopg
from psycopg import sql

from .._core.errors import ConfigurationError
from .._core.options import Option, parse_query

__all__ = [
    "DDL",
    "INSTALL_LOCK",
    "MAX_PREFIX",
    "OPTIONS",
    "RENEW_SQL",
    "SESSION_SETUP",
    "STATUS_SQL",
    "Names",
    "check_libpq_query",
    "wake_key",
]

IDENT: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_PREFIX: Final = 29  # channel names are prefix + 34 characters, at most 63 bytes
INSTALL_LOCK: Final = 0x66656E63  # 'fenc': first key of the advisory lock that serialises installs

# The tables and functions. ``{...}`` are identifiers filled in by psycopg.sql; the DDL runs
# without parameters, in one transaction. Every function serialises on the lock's row
# (``FOR UPDATE``), so the queue and the holder of one lock change in one order only.
DDL: Final = """
CREATE TABLE IF NOT EXISTS {locks} (
    name        text PRIMARY KEY,
    last_token  bigint NOT NULL DEFAULT 0 CHECK (last_token >= 0),
    holder      text,
    token       bigint,
    ttl         double precision,
    expires_at  timestamptz
);
-- Who holds it, for operators; shown only while owner_token is the current token (a grant
-- made by fenced 0.1's acquire() leaves them alone).
ALTER TABLE {locks} ADD COLUMN IF NOT EXISTS owner text,
                    ADD COLUMN IF NOT EXISTS owner_token bigint;
-- The last grant its holder released (request id and token), until the lock's next release:
-- a retry of that release, whose reply was lost, is answered true (see {release_as}).
ALTER TABLE {locks} ADD COLUMN IF NOT EXISTS released_holder text,
                    ADD COLUMN IF NOT EXISTS released_token bigint;
CREATE TABLE IF NOT EXISTS {waiters} (
    id          bigserial PRIMARY KEY,
    name        text NOT NULL,
    request_id  text NOT NULL,
    channel     text,
    expires_at  timestamptz NOT NULL
);
-- Versioned records (replicated groups' configurations), changed only by compare-and-set.
CREATE TABLE IF NOT EXISTS {records} (
    name     text PRIMARY KEY,
    version  bigint NOT NULL CHECK (version >= 1),
    value    text NOT NULL
);
CREATE INDEX IF NOT EXISTS {waiters_queue} ON {waiters} (name, id);
CREATE UNIQUE INDEX IF NOT EXISTS {waiters_request} ON {waiters} (name, md5(request_id));

DROP FUNCTION IF EXISTS {acquire}(text, text, double precision, double precision, text, boolean);
DROP FUNCTION IF EXISTS {acquire_as}(
    text, text, double precision, double precision, text, boolean, text);
CREATE FUNCTION {acquire_as}(
    p_name text, p_req text, p_ttl double precision, p_wait_ttl double precision,
    p_channel text, p_enqueue boolean, p_owner text,
    OUT o_status text, OUT o_token bigint, OUT o_hint double precision)
LANGUAGE plpgsql AS $fn$
DECLARE
    r record;
    h record;
    t timestamptz;
    have_head boolean;
BEGIN
    SELECT l.holder, l.token, l.expires_at INTO r FROM {locks} l WHERE l.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO {locks} (name) VALUES (p_name) ON CONFLICT (name) DO NOTHING;
        SELECT l.holder, l.token, l.expires_at INTO r FROM {locks} l WHERE l.name = p_name FOR UPDATE;
    END IF;
    t := clock_timestamp();
    IF r.holder IS NOT NULL AND r.expires_at > t THEN
        IF r.holder = p_req THEN
            -- A retry of a granted request whose reply was lost: the same grant, renewed
            -- (a write, so this answer too is durable before it is sent).
            UPDATE {locks} SET ttl = p_ttl, expires_at = t + make_interval(secs => p_ttl)
             WHERE name = p_name;
            DELETE FROM {waiters} WHERE name = p_name AND md5(request_id) = md5(p_req);
            o_status := 'granted';
            o_token := r.token;
            RETURN;
        END IF;
        o_hint := extract(epoch FROM r.expires_at - t);
    ELSE
        -- Free, or its holder's lease has expired: the head of the queue goes first, unless
        -- it is dead (its place expired); dead heads are dropped one by one (O(1) each).
        LOOP
            SELECT w.id, w.request_id, w.channel, w.expires_at INTO h FROM {waiters} w
             WHERE w.name = p_name ORDER BY w.id LIMIT 1;
            have_head := FOUND;
            EXIT WHEN NOT have_head OR h.expires_at > t;
            DELETE FROM {waiters} WHERE id = h.id;
        END LOOP;
        IF NOT have_head OR h.request_id = p_req THEN
            -- The grant: the counter advances in this same transaction, and is never reset.
            UPDATE {locks}
               SET last_token = last_token + 1, holder = p_req, token = last_token + 1,
                   ttl = p_ttl, expires_at = t + make_interval(secs => p_ttl),
                   owner = p_owner, owner_token = last_token + 1
             WHERE name = p_name
            RETURNING token INTO o_token;
            IF have_head THEN
                DELETE FROM {waiters} WHERE name = p_name AND md5(request_id) = md5(p_req);
            END IF;
            o_status := 'granted';
            RETURN;
        END IF;
        -- An earlier waiter is first in line. If the lock was freed by expiry, nobody has
        -- told it yet: wake it (a release or a leaving waiter has already notified it).
        IF r.holder IS NOT NULL AND h.channel IS NOT NULL THEN
            PERFORM pg_notify(h.channel, p_name || ' ' || md5(h.request_id));
        END IF;
        o_hint := extract(epoch FROM h.expires_at - t);
    END IF;
    o_status := 'wait';
    IF p_enqueue THEN
        -- A place in the queue is not a grant: it need not wait for the disk.
        PERFORM set_config('synchronous_commit', 'off', true);
        INSERT INTO {waiters} (name, request_id, channel, expires_at)
        VALUES (p_name, p_req, p_channel, t + make_interval(secs => p_wait_ttl))
        ON CONFLICT (name, md5(request_id))
        DO UPDATE SET expires_at = excluded.expires_at, channel = excluded.channel;
    END IF;
END
$fn$;

-- The signature of fenced 0.1, kept for its processes while both versions share a database.
CREATE FUNCTION {acquire}(
    p_name text, p_req text, p_ttl double precision, p_wait_ttl double precision,
    p_channel text, p_enqueue boolean,
    OUT o_status text, OUT o_token bigint, OUT o_hint double precision)
LANGUAGE sql AS $fn$
    SELECT * FROM {acquire_as}(p_name, p_req, p_ttl, p_wait_ttl, p_channel, p_enqueue, NULL)
$fn$;

DROP FUNCTION IF EXISTS {release_as}(text, text, bigint, boolean, boolean);
-- p_own: the holder's own release (marked, for its retry), not a force release by someone
-- else (the holder must then hear that it lost the lock). p_retry: a retry of a release
-- whose reply was lost (the client saw it raise): true if that earlier attempt released.
CREATE FUNCTION {release_as}(
    p_name text, p_req text, p_token bigint, p_own boolean, p_retry boolean)
RETURNS boolean LANGUAGE plpgsql AS $fn$
DECLARE
    r record;
    h record;
    t timestamptz;
    mine boolean;
BEGIN
    SELECT l.holder, l.token, l.expires_at, l.released_holder, l.released_token INTO r
      FROM {locks} l WHERE l.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF r.token IS DISTINCT FROM p_token OR r.holder IS DISTINCT FROM p_req THEN
        -- Fenced: never touches another grant. True only if this very grant was released by
        -- its holder's release (an earlier attempt of this one, whose reply was lost); a
        -- grant that expired or was taken over or forced has left no such mark.
        RETURN p_own AND p_retry AND r.released_token = p_token AND r.released_holder = p_req;
    END IF;
    t := clock_timestamp();
    mine := p_own AND r.expires_at > t;
    UPDATE {locks} SET holder = NULL, token = NULL, ttl = NULL, expires_at = NULL,
                       released_holder = CASE WHEN mine THEN p_req END,
                       released_token = CASE WHEN mine THEN p_token END
     WHERE name = p_name;
    SELECT w.request_id, w.channel INTO h FROM {waiters} w
     WHERE w.name = p_name AND w.expires_at > t ORDER BY w.id LIMIT 1;
    IF FOUND AND h.channel IS NOT NULL THEN
        PERFORM pg_notify(h.channel, p_name || ' ' || md5(h.request_id));
    END IF;
    RETURN r.expires_at > t;
END
$fn$;

-- The signature of fenced 0.1 (and of a release without its grant: a force release).
DROP FUNCTION IF EXISTS {release}(text, text, bigint);
CREATE FUNCTION {release}(p_name text, p_req text, p_token bigint)
RETURNS boolean LANGUAGE sql AS $fn$
    SELECT {release_as}(p_name, p_req, p_token, false, false)
$fn$;

DROP FUNCTION IF EXISTS {leave}(text, text);
CREATE FUNCTION {leave}(p_name text, p_req text)
RETURNS void LANGUAGE plpgsql AS $fn$
DECLARE
    r record;
    h record;
    t timestamptz;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    SELECT l.holder, l.expires_at INTO r FROM {locks} l WHERE l.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    DELETE FROM {waiters} WHERE name = p_name AND md5(request_id) = md5(p_req);
    t := clock_timestamp();
    IF FOUND AND (r.holder IS NULL OR r.expires_at <= t) THEN
        SELECT w.request_id, w.channel INTO h FROM {waiters} w
         WHERE w.name = p_name AND w.expires_at > t ORDER BY w.id LIMIT 1;
        IF FOUND AND h.channel IS NOT NULL THEN
            PERFORM pg_notify(h.channel, p_name || ' ' || md5(h.request_id));
        END IF;
    END IF;
END
$fn$;
"""

RENEW_SQL: Final = """
UPDATE {locks} SET ttl = %s::float8, expires_at = clock_timestamp() + make_interval(secs => %s::float8)
 WHERE name = %s::text AND holder = %s::text AND token = %s::bigint AND expires_at > clock_timestamp()
RETURNING token
"""

STATUS_SQL: Final = """
SELECT l.holder, l.token, l.last_token, extract(epoch FROM l.expires_at - c.t)::float8,
       (SELECT count(*) FROM {waiters} w WHERE w.name = %(name)s::text AND w.expires_at > c.t),
       CASE WHEN l.owner_token = l.token THEN l.owner END, l.ttl
  FROM (SELECT clock_timestamp() AS t) c LEFT JOIN {locks} l ON l.name = %(name)s::text
"""

# "on" unless the server asks for more (remote_apply): never weaker, whatever the defaults.
SESSION_SETUP: Final = (
    b"SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit')"
    b" WHEN 'remote_apply' THEN 'remote_apply' ELSE 'on' END, false);"
    b" SET default_transaction_isolation = 'read committed'"
)


def wake_key(name: str, request_id: str) -> str:
    """The NOTIFY payload that wakes one waiter: the same text as the SQL builds."""
    return f"{name} {hashlib.md5(request_id.encode()).hexdigest()}"


def ident_check(max_len: int) -> Callable[[str], str | None]:
    def check(value: str) -> str | None:
        if IDENT.fullmatch(value) and len(value) <= max_len:
            return None
        return f"must be an SQL identifier of at most {max_len} characters (letters, digits, _)"

    return check


OPTIONS: Final = MappingProxyType(
    {
        "schema": Option("str", "public", check=ident_check(63)),
        "prefix": Option("str", "fenced_", check=ident_check(MAX_PREFIX)),
        "connect_timeout": Option("number", 5.0, low=0.1, high=3600),
        "command_timeout": Option("number", 30.0, low=0.1, high=86_400),
        "waiter_ttl": Option("number", 6.0, low=0.1, high=3600),
        "allow_unsafe": Option("bool", False),
    }
)


def check_libpq_query(url: SplitResult) -> None:
    """The URL query belongs to libpq: refuse a parameter it does not know, here, typed.

    (libpq itself would refuse it only when connecting, which surfaced as BackendUnavailable.)
    """
    query = parse_query("postgresql", url.query)
    known = {o.keyword.decode() for o in psycopg.pq.Conninfo.get_defaults()}
    unknown = sorted(set(query) - known)
    if unknown:
        hint = ""
        if set(unknown) & set(OPTIONS):
            hint = " (fenced's own options are keyword arguments of connect(), not URL query)"
        raise ConfigurationError(
            f"unknown PostgreSQL connection parameter(s) {', '.join(map(repr, unknown))} in the "
            f"URL{hint}"
        )


class Names:
    """The SQL statements of one schema and table prefix, rendered once."""

    def __init__(self, schema: str, prefix: str, ddl: str) -> None:
        self.schema = schema
        self.prefix = prefix

        def ident(suffix: str) -> sql.Identifier:
            return sql.Identifier(schema, prefix + suffix)

        names = {
            "locks": ident("locks"),
            "waiters": ident("waiters"),
            "records": ident("records"),
            "waiters_queue": sql.Identifier(prefix + "waiters_queue"),
            "waiters_request": sql.Identifier(prefix + "waiters_request"),
            "acquire": ident("acquire"),
            "acquire_as": ident("acquire_as"),
            "release": ident("release"),
            "release_as": ident("release_as"),
            "leave": ident("leave"),
        }
        body = sql.SQL(ddl).format(**names).as_string(None)
        self.marker = "fenced:" + hashlib.sha256(body.encode()).hexdigest()[:16]
        comment = sql.SQL(
            "COMMENT ON FUNCTION {acquire}(text, text, double precision, double precision, "
            "text, boolean) IS {marker};"
        ).format(acquire=names["acquire"], marker=sql.Literal(self.marker))
        self.ddl = body + "\n" + comment.as_string(None)
        self.acquire_sig = (
            sql.SQL("{}(text, text, double precision, double precision, text, boolean)")
            .format(names["acquire"])
            .as_string(None)
        )

        def render(text: str) -> bytes:
            return sql.SQL(text).format(**names).as_bytes(None)

        self.q_acquire = render(
            "SELECT o_status, o_token, o_hint FROM {acquire_as}"
            "(%s::text, %s::text, %s::float8, %s::float8, %s::text, %s::boolean, %s::text)"
        )
        self.q_release = render(
            "SELECT {release_as}(%s::text, %s::text, %s::bigint, %s::boolean, %s::boolean)"
        )
        self.q_leave = render("SELECT {leave}(%s::text, %s::text)")
        self.q_renew = render(RENEW_SQL)
        self.q_status = render(STATUS_SQL)
        self.q_record = render("SELECT version, value FROM {records} WHERE name = %s")
        self.q_record_insert = render(
            "INSERT INTO {records} (name, version, value) VALUES (%s, 1, %s) "
            "ON CONFLICT (name) DO NOTHING RETURNING version"
        )
        self.q_record_update = render(
            "UPDATE {records} SET version = version + 1, value = %s "
            "WHERE name = %s AND version = %s RETURNING version"
        )
        self.q_names = render("SELECT coalesce(array_agg(name ORDER BY name), '{{}}') FROM {locks}")
