"""A user-space TCP proxy for fault injection: put it between a client and a server, then cut
the network between them without touching either process.

    proxy = TcpProxy("127.0.0.1", redis.port).start()
    locks = fenced.connect(f"redis://127.0.0.1:{proxy.port}/0")
    proxy.partition()   # bytes stop flowing both ways; connections stay open (a real partition)
    proxy.drop_replies()  # requests still reach the server, its replies stop (one way)
    proxy.heal()        # they flow again, in order
    proxy.delay(0.2)    # every chunk waits 0.2 s each way
    proxy.cut()         # every connection is reset now (a crashed middlebox, a NAT timeout)

During a partition, new connections are accepted by the kernel but nothing reaches the server
until it heals: the client sees what a dropped network looks like — silence, then its own
timeouts — not a refusal. The proxy runs its own event loop on a thread, so it works the same
from synchronous tests, asyncio tests and the check kit. It needs no privileges (no iptables).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from typing import Any

__all__ = ["TcpProxy"]


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, *, listen_port: int = 0) -> None:
        self.target = (target_host, target_port)
        self.port = listen_port
        self._loop = asyncio.new_event_loop()
        self._flowing: asyncio.Event | None = None
        self._replying: asyncio.Event | None = None  # (server to client only)
        self._delay = 0.0
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self.connections = 0  # accepted so far (for tests)
        # Bytes passed on from clients to the server so far: the check kit's race nemesis
        # waits on it to know a held-back request has just reached the server.
        self.forwarded = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> TcpProxy:
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._listen())
            except BaseException as exc:  # (a port in use: said in start())
                failed.append(exc)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fenced-tcp-proxy", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failed:
            raise failed[0]
        return self

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._replying = asyncio.Event()
        self._replying.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self._thread is None:
            return

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            self._reset_all()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._thread = None
        self._loop.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- faults ----------------------------------------------------------------------------------

    def partition(self) -> None:
        """Stop every byte, both ways, on every connection, new ones included."""
        self._call(lambda: self._flow().clear())

    def drop_replies(self) -> None:
        """Hold every byte from the server, on every connection: requests still arrive and are
        applied, their replies are lost (a request whose outcome the client cannot know)."""
        self._call(lambda: self._reply_flow().clear())

    def heal(self) -> None:
        def both() -> None:
            self._flow().set()
            self._reply_flow().set()

        self._call(both)

    def delay(self, seconds: float) -> None:
        """Hold every chunk ``seconds`` before passing it on (0: no delay)."""
        self._delay = max(0.0, float(seconds))

    def cut(self) -> None:
        """Reset every open connection (RST); new connections are accepted as before."""
        self._call(self._reset_all)

    # -- internals -------------------------------------------------------------------------------

    def _flow(self) -> asyncio.Event:
        assert self._flowing is not None
        return self._flowing

    def _reply_flow(self) -> asyncio.Event:
        assert self._replying is not None
        return self._replying

    def _call(self, fn: Any) -> None:
        done = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                done.set()

        self._loop.call_soon_threadsafe(run)
        done.wait(10)

    def _reset_all(self) -> None:
        for writer in list(self._writers):
            sock = writer.get_extra_info("socket")
            if sock is not None:  # linger 0: close() sends RST, as a broken path does
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()
        self._writers.clear()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(client_w)
        await self._flow().wait()  # partitioned: the server never hears of this connection
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            self._writers.discard(client_w)
            client_w.close()
            return
        self._writers.add(server_w)
        await asyncio.gather(
            self._pump(client_r, server_w, client_w, upstream=True),
            self._pump(server_r, client_w, server_w),
            return_exceptions=True,
        )

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        other: asyncio.StreamWriter,
        *,
        upstream: bool = False,
    ) -> None:
        try:
            while True:
                await self._flow().wait()
                data = await reader.read(65536)
                if not data:
                    break
                if self._delay:
                    await asyncio.sleep(self._delay)
                await self._flow().wait()  # partitioned while this chunk was in flight: held
                if not upstream:
                    await self._reply_flow().wait()
                writer.write(data)
                await writer.drain()
                if upstream:
                    self.forwarded += len(data)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (writer, other):
                self._writers.discard(w)
                with contextlib.suppress(Exception):
                    w.close()
