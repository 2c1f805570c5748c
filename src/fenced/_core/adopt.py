"""Open a token source from a client the application already has, instead of a URL.

``fenced.connect(redis.Redis(...))``, a psycopg connection or pool, a ``KazooClient``, an
``aetcd.Client``: fenced
reads where the client points (server, database, credentials, TLS) and opens its own
connection there with the settings its protocol needs, so every safety check of the source
still runs (Redis's AOF and replicas, PostgreSQL's ``fsync``). It does not share the client's
sockets, on purpose: fenced's Redis client must never retry a command behind its back (a
retried release could report a held lock as lost) and decodes replies; its ZooKeeper sessions
are one per ttl; its PostgreSQL connection runs with ``synchronous_commit`` forced on.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from .errors import ConfigurationError

__all__ = ["adopt_client"]


def adopt_client(client: object) -> tuple[str, dict[str, Any]]:
    """The URL (and keyword options) of a token source equivalent to ``client``."""
    module = type(client).__module__.split(".", 1)[0]
    adopt = _ADOPTERS.get(module)
    if adopt is None:
        raise ConfigurationError(
            f"cannot open a token source from a {type(client).__module__}."
            f"{type(client).__qualname__}: give a URL, or a redis-py client, a psycopg "
            "connection or pool, a KazooClient or an aetcd client"
        )
    return adopt(client)


def _redis(client: Any) -> tuple[str, dict[str, Any]]:
    if not hasattr(client, "connection_pool"):  # RedisCluster: no single primary to ask
        raise ConfigurationError(
            "a Redis Cluster client cannot be a token source: the counter of a lock lives on "
            "one primary; give a client of that server"
        )
    pool = client.connection_pool
    kw = pool.connection_kwargs
    if "path" in kw:
        raise ConfigurationError("a Redis client on a Unix socket: give a redis:// URL instead")
    scheme = "rediss" if "SSL" in pool.connection_class.__name__ else "redis"
    url = f"{scheme}://{_host(kw.get('host') or 'localhost')}:{int(kw.get('port') or 6379)}/{int(kw.get('db') or 0)}"
    options: dict[str, Any] = {}
    for name in ("username", "password"):
        if kw.get(name):
            options[name] = kw[name]
    return url, options


def _psycopg(client: Any) -> tuple[str, dict[str, Any]]:
    from psycopg.conninfo import conninfo_to_dict

    raw: dict[str, Any]
    if hasattr(client, "conninfo") and hasattr(client, "kwargs"):  # psycopg_pool pools
        raw = dict(conninfo_to_dict(client.conninfo, **(client.kwargs or {})))
    else:  # psycopg.Connection / AsyncConnection
        raw = dict(client.info.get_parameters())
        if client.info.password:
            raw["password"] = client.info.password
    params: dict[str, str] = {k: str(v) for k, v in raw.items() if v not in (None, "")}
    user = quote(params.pop("user", ""), safe="")
    password = params.pop("password", "")
    auth = f"{user}:{quote(password, safe='')}@" if password else (f"{user}@" if user else "")
    host = ",".join(_host(h) for h in params.pop("host", "").split(",") if h)
    port = params.pop("port", "")
    if port and "," not in port and "," not in host:
        host = f"{host}:{port}"
    elif port:
        params["port"] = port
    dbname = quote(params.pop("dbname", ""), safe="")
    query = f"?{urlencode(params)}" if params else ""
    return f"postgresql://{auth}{host}/{dbname}{query}", {}


def _kazoo(client: Any) -> tuple[str, dict[str, Any]]:
    hosts = ",".join(f"{_host(h)}:{p}" for h, p in client.hosts)
    return f"zookeeper://{hosts}{client.chroot or ''}", {}


def _host(host: str) -> str:
    """A host for a URL's netloc: IPv6 in brackets, a socket directory percent-encoded."""
    if host.startswith("/"):
        return quote(host, safe="")
    return f"[{host}]" if ":" in host else host


def _aetcd(client: Any) -> tuple[str, dict[str, Any]]:
    # (aetcd keeps where it points in private attributes; read them, never its channel)
    if getattr(client, "_username", None) or getattr(client, "_password", None):
        raise ConfigurationError(
            "an etcd client with a user name and password: fenced's etcd source does not "
            "authenticate yet; give an etcd:// URL of a member that needs no auth"
        )
    return f"etcd://{_host(str(client._host))}:{int(client._port)}", {}


_ADOPTERS = {
    "aetcd": _aetcd,
    "redis": _redis,
    "psycopg": _psycopg,
    "psycopg_pool": _psycopg,
    "kazoo": _kazoo,
}
