"""A register over HTTP that fences with the ``Fencing-Token`` header: a resource to point
``fenced check --resource http://...`` at, written the two ways people write it.

    python examples/register_service.py --port 8000 --db /tmp/register.db
    fenced check --resource http://127.0.0.1:8000/register --time 30

``GET``, ``PUT`` and ``DELETE /register``. The default is right: the handler reads or writes
*inside* the fence's transaction (``store.transaction``), so the check, the mark's advance
and the read or write are one step, and a read raises the mark too (a read-modify-write is
fenced from its read). ``--check-then-write`` is the common mistake — the
:class:`~fenced.guards.asgi.FencingMiddleware` checks the header, then the handler writes in
a second step, and reads are not fenced — and ``fenced check`` catches it.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import fenced
from fenced.guards.asgi import FencingMiddleware, SQLiteFenceStore, fencing_exception_handler

LOCK, RESOURCE = "counter", "register"


def make_app(db: str, *, check_then_write: bool = False) -> Any:
    store = SQLiteFenceStore(db)

    def setup(conn: Any) -> None:
        conn.execute("CREATE TABLE IF NOT EXISTS register (id INTEGER PRIMARY KEY, data BLOB)")

    def get_data(conn: Any) -> bytes | None:
        setup(conn)
        row = conn.execute("SELECT data FROM register WHERE id = 1").fetchone()
        return None if row is None else bytes(row[0])

    def put_data(data: bytes) -> Any:
        def put(conn: Any) -> None:
            setup(conn)
            conn.execute("INSERT OR REPLACE INTO register VALUES (1, ?)", (data,))

        return put

    def token_of(request: Request) -> fenced.FencingToken | None:
        sent = request.headers.get("fencing-token")
        return None if sent is None else fenced.FencingToken.parse(sent, LOCK)

    async def read(request: Request) -> Response:
        token = token_of(request)
        if token is None or check_then_write:  # (the mistake: an unfenced read)
            import sqlite3

            with sqlite3.connect(db) as conn:
                data = get_data(conn)
        else:
            data = await store.transaction(RESOURCE, token, get_data)
        return Response(data, 200) if data is not None else Response(b"", 404)

    async def write(request: Request) -> Response:
        body = await request.body()
        if check_then_write:  # the middleware checked already, in its own transaction
            import sqlite3

            with sqlite3.connect(db) as conn:
                put_data(body)(conn)
        else:
            token = token_of(request)
            if token is None:
                return JSONResponse({"error": "a Fencing-Token header is required"}, 428)
            await store.transaction(RESOURCE, token, put_data(body))
        return Response(b"", 204)

    async def reset(request: Request) -> Response:
        import sqlite3

        with sqlite3.connect(db) as conn:
            setup(conn)
            conn.execute("DELETE FROM register")
            with contextlib.suppress(sqlite3.OperationalError):  # (no mark yet)
                conn.execute("DELETE FROM fenced_fences WHERE resource = ?", (RESOURCE,))
        return Response(b"", 204)

    app: Any = Starlette(
        routes=[
            Route("/register", read, methods=["GET"]),
            Route("/register", write, methods=["PUT"]),
            Route("/register", reset, methods=["DELETE"]),
        ],
        exception_handlers={fenced.StaleTokenError: fencing_exception_handler},
    )
    if check_then_write:
        app = FencingMiddleware(
            app,
            store=store,
            lock=LOCK,
            resource=lambda scope: RESOURCE if scope["method"] == "PUT" else None,
        )
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--db", required=True, help="SQLite file for the register and its mark")
    parser.add_argument(
        "--check-then-write", action="store_true", help="the mistake: check, then write"
    )
    args = parser.parse_args()
    app = make_app(args.db, check_then_write=args.check_then_write)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
