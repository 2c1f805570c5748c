"""What the tests of ``fenced serve`` share: HTTP calls with a bearer key, and key files."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from fenced.server import hash_secret
from fenced.testing.servers import FencedServer
from tests.helpers import TLS  # (one TLS context for every call: see there)


def post(url: str, body: object = None, key: str | None = None, **kw: Any) -> httpx.Response:
    """POST ``body`` as JSON, with ``key`` (a secret) as the bearer token if given."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url, json=body, headers=headers, timeout=30, verify=TLS, **kw)


def get(url: str, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url, headers=headers, timeout=30, verify=TLS)


def write_keys(path: Path, keys: Sequence[dict[str, Any]]) -> Path:
    """An ``--api-keys`` file at ``path``: one ``[[keys]]`` table per dict (``id``,
    ``secret``, optional ``prefixes``; ``verbs``), the secret stored as its sha256 unless
    ``plain=True`` (the file form that holds the secret itself)."""
    tables = []
    for key in keys:
        lines = [f'id = "{key["id"]}"']
        if key.get("plain"):
            lines.append(f'secret = "{key["secret"]}"')
        else:
            lines.append(f'sha256 = "{hash_secret(key["secret"])}"')
        if "prefixes" in key:
            lines.append("prefixes = [" + ", ".join(f'"{p}"' for p in key["prefixes"]) + "]")
        lines.append("verbs = [" + ", ".join(f'"{v}"' for v in key["verbs"]) + "]")
        tables.append("[[keys]]\n" + "\n".join(lines) + "\n")
    path.write_text("\n".join(tables))
    return path


@contextmanager
def keyed_server(
    source: str, keys_path: Path, keys: Sequence[dict[str, Any]]
) -> Iterator[FencedServer]:
    """A ``fenced serve`` process on ``source`` that takes the ``keys`` (see write_keys)."""
    with FencedServer(source, args=["--api-keys", str(write_keys(keys_path, keys))]) as s:
        yield s  # type: ignore[misc]


def until_closed(conn: socket.socket, data: bytes) -> tuple[bytes, float]:
    """Send ``data``, read until the server closes the connection: what it sent, and the
    seconds that took."""
    started = time.monotonic()
    conn.sendall(data)
    reply = b""
    while piece := conn.recv(65536):
        reply += piece
    return reply, time.monotonic() - started
