"""A tiny storage service behind fenced's HTTP guard: DDIA Figure 8-5's "storage".

    python examples/storage_service.py --port 8000 --dir /tmp/storage

``PUT /files/<name>`` stores the body, but only with a ``Fencing-Token`` header of lock
``files`` (``--lock`` names another) that is not lower than any token this service has seen for that file (the high-water
mark is kept durably in ``<dir>/fence.db``, checked and advanced in one step by the
middleware); a stale token gets 409 with a JSON problem and nothing is written.
``GET /files/<name>`` reads. Any language can be the writer: it only sends a header.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from fenced.guards.asgi import FencingMiddleware, SQLiteFenceStore


def make_app(directory: Path, fencing: bool = True, lock: str = "files") -> Any:
    directory.mkdir(parents=True, exist_ok=True)

    async def put(request: Request) -> Response:
        name = request.path_params["name"]
        path = directory / f"{name}.data"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(await request.body())
        os.replace(tmp, path)
        token = getattr(request.state, "fencing_token", None)
        return PlainTextResponse(f"stored {name} with {token}")

    async def get(request: Request) -> Response:
        path = directory / f"{request.path_params['name']}.data"
        if not path.exists():
            return PlainTextResponse("not found", status_code=404)
        return Response(path.read_bytes())

    app = Starlette(
        routes=[
            Route("/files/{name}", put, methods=["PUT"]),
            Route("/files/{name}", get, methods=["GET"]),
        ]
    )
    if not fencing:  # what most services are: any writer that believes it holds the lock wins
        return app
    store = SQLiteFenceStore(str(directory / "fence.db"))
    # One high-water mark per file: the resource is the path.
    return FencingMiddleware(app, store=store, lock=lock, resource=lambda scope: scope["path"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--lock", default="files", help="the lock whose tokens it takes")
    parser.add_argument(
        "--no-fencing", action="store_true", help="no guard: watch a paused writer win"
    )
    args = parser.parse_args()
    uvicorn.run(
        make_app(args.dir, fencing=not args.no_fencing, lock=args.lock),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
