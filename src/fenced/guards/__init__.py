"""Guards: make a resource reject writes that carry a stale fencing token.

One module per kind of resource, each imported on its own (they need different clients):

- ``fenced.guards.sql`` — ``SQLGuard`` (a fence table) and ``RowGuard`` (a token column), for
  sqlite3, psycopg 3, PyMySQL/asyncmy and SQLAlchemy, inside the caller's own transaction;
- ``fenced.guards.redis`` — ``RedisGuard`` / ``AsyncRedisGuard``: one Lua script per write;
- ``fenced.guards.etcd`` — ``EtcdGuard`` / ``AsyncEtcdGuard``: one transaction per write;
- ``fenced.guards.zookeeper`` — ``ZooKeeperGuard`` / ``AsyncZooKeeperGuard``: one ``multi``
  per write, checking the mark znode's version;
- ``fenced.guards.dynamodb`` — ``DynamoDBGuard`` / ``AsyncDynamoDBGuard``: one conditional
  request (or transaction) per write;
- ``fenced.guards.s3`` — ``S3VersionStore``: versions named by token, committed by a
  conditional PUT of a mark object;
- ``fenced.guards.streams`` — ``FencedStreamConsumer``: fenced claim, read and commit of a
  Redis Streams consumer group;
- ``fenced.guards.files`` — ``FileGuard`` (a new file per token) and ``HighWaterFile``;
- ``fenced.guards.asgi`` — ``FencingMiddleware`` for HTTP services, with SQLite, PostgreSQL
  and Redis fence stores; ``fenced.guards.httpx`` — ``FencingAuth`` for the client side.

``fenced.guards.registry`` opens the guards that a URL can name (``redis://``,
``postgresql://``, ``sqlite:////PATH``, ``etcd://``, ``file:///DIR``) for the CLI, the check
kit and the groups: ``open_guard(url, resource, lock=...)``.

Every guard accepts a token at least as high as the resource's high-water mark (and raises
the mark to it) and rejects a lower one with :class:`~fenced.StaleTokenError`, in one atomic
step in the resource itself.
"""

from ._plan import GroupGuard, GroupItem, GroupState

__all__ = ["GroupGuard", "GroupItem", "GroupState"]
