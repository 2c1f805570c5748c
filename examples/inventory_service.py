"""A small inventory service that fences its writers with the ``Fencing-Token`` header, written
with the standard library only (``http.server`` and ``sqlite3``), as a user of fenced would
write it — and with seven realistic bugs you can switch on, one at a time, to watch
``fenced check`` find them in a process it knows nothing about:

    python examples/inventory_service.py --port 8000 --db /tmp/inventory.db [--bug NAME]
    fenced check --resource http://127.0.0.1:8000/items/widgets \\
                 --resource-cmd 'python examples/inventory_service.py --port 8000 --db /tmp/inventory.db'

``GET /items/NAME`` reads an item's record (200, or 404 when there is none), ``PUT`` replaces
it, ``DELETE`` removes it and its high-water mark (a campaign starts from a clean slate). A
request carries ``Fencing-Token: <lock>:<value>`` of the service's lock (``--lock``, default
``counter``, the lock ``fenced check`` takes by default); a token below the item's mark is
refused with 409, a token of another lock or a malformed one with 400, a write with none with
428, and nothing is read or written. Right (no ``--bug``): the check, the mark's advance
and the read or the write are one SQLite transaction (``BEGIN IMMEDIATE``), and the mark is a
row of the same database, so it survives a kill -9 with the data it guards.

``--bug``:

- ``string-tokens``: the mark is kept as text and tokens are compared as strings
  (``"10" < "9"``): from token 10 on, the newest holder is refused;
- ``mark-in-memory``: the mark is a variable of the process; a restart (kill -9, start again on
  the same data) forgets it, and a stale holder's write gets in;
- ``check-then-write``: the write checks and raises the mark in one transaction and writes in a
  second one ``--gap`` seconds later (0.08): a newer holder's read between the two sees the
  record before a write that then lands anyway;
- ``unfenced-reads``: reads check no token and leave the mark alone;
- ``lock-ignored``: the token's lock name is not compared, only its value: a holder of another
  lock (or a client that made one up) moves the mark, and the rightful holder is refused;
- ``tokenless-ok``: a write without a ``Fencing-Token`` is written unchecked;
- ``mark-from-data``: the mark is a variable of the process, rebuilt at start-up from the
  writer's token stored next to each item: a fenced read raised it but wrote nothing, so a
  restart between a newer holder's read and its write lowers it, and a stale write gets in.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BUGS = (
    "string-tokens", "mark-in-memory", "check-then-write", "unfenced-reads", "mark-from-data",
    "lock-ignored", "tokenless-ok",
)  # fmt: skip
VALUE = re.compile(r"[1-9][0-9]{0,18}")  # a token's value, after "<lock>:" (a signature not used)


class Stale(Exception):
    """The request's token is below the item's mark."""


class Inventory:
    def __init__(self, db: str, bug: str = "", gap: float = 0.08, lock: str = "counter") -> None:
        self.db, self.bug, self.gap, self.lock = db, bug, gap, lock
        self.memory: dict[str, int] = {}  # mark-in-memory: the marks, lost on restart
        self.in_memory = bug in ("mark-in-memory", "mark-from-data")
        self.memory_lock = threading.Lock()
        with contextlib.closing(self.connect()) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            # (writer: the token of the item's last write)
            conn.execute(
                "CREATE TABLE IF NOT EXISTS items (name TEXT PRIMARY KEY, data BLOB, writer INTEGER)"
            )
            if bug == "mark-from-data":  # the bug: the marks recovered from the writers' tokens
                for name, writer in conn.execute("SELECT name, writer FROM items"):
                    self.memory[name] = int(writer)
            # (typeless column: string-tokens stores text in it, the right one an integer)
            conn.execute("CREATE TABLE IF NOT EXISTS marks (name TEXT PRIMARY KEY, mark)")

    def connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.db, timeout=30, isolation_level=None)
        conn.execute("PRAGMA synchronous=FULL")  # a committed mark survives a crash
        return conn

    def _fence(self, conn: sqlite3.Connection, name: str, value: int) -> None:
        """Check ``value`` against the item's mark and raise the mark, inside the caller's
        transaction (or, with the bug, in this process's memory)."""
        if self.in_memory:
            with self.memory_lock:
                if value < self.memory.get(name, 0):
                    raise Stale
                self.memory[name] = value
            return
        row = conn.execute("SELECT mark FROM marks WHERE name = ?", (name,)).fetchone()
        if self.bug == "string-tokens":
            if row is not None and str(value) < str(row[0]):  # the bug: "10" < "9"
                raise Stale
            conn.execute("INSERT OR REPLACE INTO marks VALUES (?, ?)", (name, str(value)))
            return
        if row is not None and value < int(row[0]):
            raise Stale
        conn.execute("INSERT OR REPLACE INTO marks VALUES (?, ?)", (name, value))

    def read(self, name: str, value: int | None) -> bytes | None:
        with contextlib.closing(self.connect()) as conn:
            conn.execute("BEGIN IMMEDIATE")  # the writer's lock first: the read is fenced
            try:
                if value is not None and self.bug != "unfenced-reads":
                    self._fence(conn, name, value)
                row = conn.execute("SELECT data FROM items WHERE name = ?", (name,)).fetchone()
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        return None if row is None else bytes(row[0])

    def write(self, name: str, value: int | None, data: bytes) -> None:
        with contextlib.closing(self.connect()) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                if value is not None:  # (None: tokenless-ok's unchecked write)
                    self._fence(conn, name, value)
                if self.bug == "check-then-write":
                    conn.execute("COMMIT")
                    time.sleep(self.gap)  # (whatever the handler does between its two steps)
                    conn.execute("BEGIN IMMEDIATE")
                conn.execute("INSERT OR REPLACE INTO items VALUES (?, ?, ?)", (name, data, value))
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def delete(self, name: str) -> None:
        with contextlib.closing(self.connect()) as conn:
            conn.execute("DELETE FROM items WHERE name = ?", (name,))
            conn.execute("DELETE FROM marks WHERE name = ?", (name,))
        with self.memory_lock:
            self.memory.pop(name, None)

    def mark(self, name: str) -> int | None:
        if self.in_memory:
            return self.memory.get(name)
        with contextlib.closing(self.connect()) as conn:
            row = conn.execute("SELECT mark FROM marks WHERE name = ?", (name,)).fetchone()
        return None if row is None else int(row[0])


def make_server(host: str, port: int, inventory: Inventory) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the kit's client uses it

        def log_message(self, format: str, *args: object) -> None:
            pass  # (quiet: a campaign sends thousands of requests)

        def _item(self) -> str | None:
            m = re.fullmatch(r"/items/([A-Za-z0-9._-]{1,100})", self.path)
            if m is None:
                self._send(404, b"no such path: use /items/NAME\n")
                return None
            return m.group(1)

        def _token(self) -> tuple[bool, int | None]:
            sent = self.headers.get("Fencing-Token")
            if sent is None:
                return True, None
            # The lock's name first, compared whole: a token of another lock is not a smaller
            # or larger token of this one (its value would move this lock's mark). A lock name
            # may hold ":" and ".", the value neither: what follows "<lock>:" up to a "." is it.
            prefix = f"{inventory.lock}:"
            if inventory.bug == "lock-ignored":  # the bug: any lock's name before the value
                prefix = sent.split(".", 1)[0].rpartition(":")[0] + ":"
            if not sent.startswith(prefix):
                self._send(400, b"Fencing-Token of another lock\n")
                return False, None
            value = sent[len(prefix) :].split(".", 1)[0]
            if VALUE.fullmatch(value) is None:
                self._send(400, b"malformed Fencing-Token\n")
                return False, None
            return True, int(value)

        def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            name = self._item()
            ok, value = self._token() if name else (False, None)
            if name is None or not ok:
                return
            try:
                data = inventory.read(name, value)
            except Stale:
                return self._send(409, b"stale fencing token\n")
            mark = inventory.mark(name)
            headers = {} if mark is None else {"Fenced-High-Water": str(mark)}
            if data is None:
                return self._send(404, b"", headers)
            self._send(200, data, headers)

        def do_PUT(self) -> None:
            name = self._item()
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            ok, value = self._token() if name else (False, None)
            if name is None or not ok:
                return
            if value is None and inventory.bug != "tokenless-ok":
                return self._send(428, b"a Fencing-Token header is required\n")
            try:
                inventory.write(name, value, body)
            except Stale:
                return self._send(409, b"stale fencing token\n")
            self._send(204, b"")

        def do_DELETE(self) -> None:
            name = self._item()
            if name is not None:
                inventory.delete(name)
                self._send(204, b"")

    return ThreadingHTTPServer((host, port), Handler)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--db", required=True, help="SQLite file for the items and their marks")
    parser.add_argument("--bug", choices=BUGS, default="", help="switch one bug on")
    parser.add_argument("--gap", type=float, default=0.08, help="check-then-write's gap (s)")
    parser.add_argument("--lock", default="counter", help="the lock whose tokens it takes")
    args = parser.parse_args()
    inventory = Inventory(args.db, args.bug, args.gap, args.lock)
    server = make_server(args.host, args.port, inventory)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
