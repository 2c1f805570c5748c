"""Waking a waiter of the ``sqlite://`` source: in this process directly, in another process
by a datagram to its doorbell socket. A wake-up is only a hint to look again: the queue in
the database decides who is next."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import uuid

__all__ = [
    "LocalWaiter",
    "Waker",
    "local_mutex",
    "local_waiters",
    "my_wake_address",
    "notify",
    "register",
    "ring",
    "unregister",
]


class LocalWaiter:
    """A blocked acquire in this process, woken when the lock may have become its."""

    __slots__ = ("event", "loop", "request_id")

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str) -> None:
        self.loop = loop
        self.request_id = request_id
        self.event = asyncio.Event()


local_mutex = threading.Lock()
local_waiters: dict[tuple[str, str], set[LocalWaiter]] = {}


def register(key: tuple[str, str], waiter: LocalWaiter) -> None:
    with local_mutex:
        local_waiters.setdefault(key, set()).add(waiter)


def unregister(key: tuple[str, str], waiter: LocalWaiter) -> None:
    with local_mutex:
        waiters = local_waiters.get(key)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del local_waiters[key]


def notify(key: tuple[str, str], request_id: str | None = None) -> None:
    """Wake the blocked acquire ``request_id`` of this lock in this process, or all of them
    (from any thread). Only the head of the queue can take a freed lock: the others are left
    to poll rather than all re-reading the file at once."""
    with local_mutex:
        waiters = [
            w
            for w in local_waiters.get(key, ())
            if request_id is None or w.request_id == request_id
        ]
    for waiter in waiters:
        with contextlib.suppress(RuntimeError):  # its loop is closed: it is gone
            waiter.loop.call_soon_threadsafe(waiter.event.set)


class Waker:
    """This process's doorbell: a datagram socket other processes ring when a lock frees up.

    The head of a queue stores the address in its waiter row; whoever releases the lock (or
    leaves the queue) reads it in the same transaction and, after the commit, sends the
    database path and lock name there. A thread here turns that into :func:`notify`. It is a
    hint only: a lost datagram costs one poll interval, never correctness.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.address = b"\0fenced-sqlite-" + uuid.uuid4().hex.encode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(self.address)  # Linux abstract namespace: no file, gone with us
        except OSError:
            self.sock.close()
            raise
        self.thread = threading.Thread(target=self._run, name="fenced-sqlite-waker", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = self.sock.recv(8192)
            except OSError:
                return
            path, name, request_id = [*data.decode("utf-8", "replace").split("\0"), "", ""][:3]
            notify((path, name), request_id or None)


_waker_mutex = threading.Lock()
_waker_instance: Waker | None = None
_waker_failed = False
_sender: socket.socket | None = None


def my_wake_address() -> bytes | None:
    """This process's doorbell address (made on first use; None where unsupported)."""
    global _waker_instance, _waker_failed
    waker = _waker_instance
    if waker is not None and waker.pid == os.getpid():
        return waker.address
    with _waker_mutex:
        if _waker_instance is None or _waker_instance.pid != os.getpid():  # first, or forked
            if _waker_instance is not None:  # the parent's socket: not ours to read
                _waker_instance.sock.close()
                _waker_instance = None
            if _waker_failed:
                return None
            try:
                _waker_instance = Waker()
            except (OSError, AttributeError):  # no AF_UNIX / abstract names on this platform
                _waker_failed = True
                return None
        return _waker_instance.address


def ring(head: bytes | None, path: str, name: str) -> None:
    """Wake the head of the queue of ``name``, in this or another process (best effort, never
    blocks). ``head`` is its request id, a NUL, and its process's doorbell address."""
    global _sender
    if not head:
        return
    request_id, _, address = head.partition(b"\0")
    waker = _waker_instance
    here = waker is not None and waker.pid == os.getpid() and waker.address == address
    if here or not address:  # ours, or a process without a doorbell: if it is here, wake it
        notify((path, name), request_id.decode("utf-8", "replace"))
        return
    try:
        if _sender is None:
            _sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _sender.setblocking(False)
        _sender.sendto(path.encode() + b"\0" + name.encode() + b"\0" + request_id, address)
    except OSError:  # the waiter's process is gone, or its queue is full: it polls anyway
        pass
