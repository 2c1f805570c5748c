"""What the tests of ``fenced serve`` share: HTTP calls with a bearer key, and key files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from fenced.server import hash_secret


def post(url: str, body: object = None, key: str | None = None, **kw: Any) -> httpx.Response:
    """POST ``body`` as JSON, with ``key`` (a secret) as the bearer token if given."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url, json=body, headers=headers, timeout=30, **kw)


def get(url: str, key: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url, headers=headers, timeout=30)


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
