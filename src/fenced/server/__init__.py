"""``fenced serve``: the lock service over HTTP, for clients in any language.

A thin, stateless gateway over a token source (any of fenced's): grants, renewals and releases
are decided by the source, so several gateways in front of one etcd, PostgreSQL or Redis serve
the same locks and any of them may die. Its Python client is one more token source scheme:
``fenced.connect("http://127.0.0.1:7400")``. See docs/server.md.
"""

from __future__ import annotations

from ._app import ServerSettings, create_app
from ._auth import ApiKey, Keys, Verb, hash_secret, load_api_keys, new_secret
from ._gateway import ForeignGrant, Gateway, own_id
from ._metrics import Metrics
from ._run import is_loopback, parse_listen, serve

__all__ = [
    "ApiKey",
    "ForeignGrant",
    "Gateway",
    "Keys",
    "Metrics",
    "ServerSettings",
    "Verb",
    "create_app",
    "hash_secret",
    "is_loopback",
    "load_api_keys",
    "new_secret",
    "own_id",
    "parse_listen",
    "serve",
]
