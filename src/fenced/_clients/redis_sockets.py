"""An asyncio redis-py connection that checks its socket before it is used again, for the
Redis source and the Redis guards alike.

redis-py's asyncio check of an idle connection (``can_read``, at the pool's checkout) looks
only at what the event loop has already read into the connection's StreamReader. If no turn of
the loop has handled the server's FIN since it arrived (the server's ``timeout`` or ``CLIENT
KILL`` just closed the idle connection, and the caller runs on before the loop looks: a
synchronous caller driving fenced's loop itself, or any call right after the close), the
connection looks clean, the request goes out on the dead socket, and the call fails although
it could have gone out on a fresh connection. The blocking redis-py client reads the socket
itself there, as httpcore does for its keep-alive connections (``is_socket_readable``).
"""

from __future__ import annotations

import select
from typing import Any, Final

__all__ = ["NO_MAINT", "socket_checked", "socket_has_news"]

try:  # redis-py 8: its asyncio pool makes no idle check at all while these are on ("auto")
    from redis.maint_notifications import MaintNotificationsConfig

    NO_MAINT: dict[str, Any] = {
        "maint_notifications_config": MaintNotificationsConfig(enabled=False)
    }
    """The keyword that turns redis-py 8's "maintenance notifications" off for a pool: with
    them on, its asyncio pool hands out an idle connection without :func:`socket_checked`'s
    check (or its own), since a notification may be waiting on it."""
except ImportError:  # (redis-py 5-7: no such thing, and the pool checks)
    NO_MAINT = {}

# Anything at all on the socket: a reply nobody read, or the server's FIN or RST.
_NEWS: Final = (
    select.POLLIN
    | select.POLLPRI
    | select.POLLERR
    | select.POLLHUP
    | getattr(select, "POLLRDHUP", 0)
)


def socket_has_news(conn: Any) -> bool:
    """True if ``conn``'s socket holds something the event loop has not read yet: bytes
    nobody asked for, or the server's FIN or RST (it closed the idle connection: its
    ``timeout``, ``CLIENT KILL``, a restart). redis-py's own check looks only at what the
    loop already read into its StreamReader, so a call made before a turn of the loop
    noticed the FIN went out on the dead socket and failed. A zero-timeout ``poll()``:
    under a microsecond."""
    writer = getattr(conn, "_writer", None)
    if writer is None:
        return False
    transport = writer.transport
    if transport.is_closing():
        return True
    # One poller a transport (a reconnect makes a new transport, with a new socket).
    made = conn.__dict__.get("_fenced_poll")
    if made is None or made[0] is not transport:
        sock = transport.get_extra_info("socket")
        if sock is None or sock.fileno() < 0:  # (not fit to send on)
            return True
        poller = select.poll()
        poller.register(sock.fileno(), _NEWS)
        made = conn.__dict__["_fenced_poll"] = (transport, poller)
    return bool(made[1].poll(0))


_CHECKED: dict[type, type] = {}  # redis-py's class -> the checked one
_MADE: set[type] = set()


def socket_checked(cls: type) -> type:
    """``cls`` (a redis-py asyncio connection class) whose idle check also looks at the
    socket (:func:`socket_has_news`): the check redis-py's pool makes before it hands out an
    idle connection, and the Redis source's own connection's (``RedisBackend._script``). A
    connection found with news is dropped and made afresh before anything is sent on it."""
    if cls in _MADE:  # (checked already)
        return cls
    made = _CHECKED.get(cls)
    if made is None:

        async def can_read(self: Any) -> bool:
            return bool(await cls.can_read(self)) or socket_has_news(self)  # type: ignore[attr-defined]

        # (the same name: code that tells TLS by the class's name still can)
        made = type(cls.__name__, (cls,), {"can_read": can_read, "__module__": __name__})
        made.can_read_destructive = can_read  # type: ignore[attr-defined]
        _CHECKED[cls] = made
        _MADE.add(made)
    return made
