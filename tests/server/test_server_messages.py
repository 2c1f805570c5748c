"""The HTTP API's refusals are read by JavaScript, Java and curl users: one line in the API's
own terms, no Python (``None``, a float's ``repr``, ``3.1536e+07``) — the class of issue 29's
"no Python terms in CLI messages", at the other door of the same checks."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from fenced.server import ServerSettings, create_app

PYTHON = ("None", ".0 ", ".0,", "e+0", "float", "int value", "repr")


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"timeout": -1}, "timeout must be from 0 to 31536000 seconds (a year)"),
        ({"timeout": 1e9}, "not 1000000000"),
        ({"ttl": -1}, "ttl must be from 0.1 to 86400 seconds, not -1"),
        ({"ttl": 0}, "not 0"),
        ({"ttl": 1e12}, "not 1000000000000"),
    ],
)
async def test_api_refusals_speak_no_python(
    tmp_path: Path, body: dict[str, object], words: str
) -> None:
    app = create_app(ServerSettings(url=f"sqlite:///{tmp_path / 'locks.db'}"))
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        r = await client.post("/v1/locks/a/-/acquire", json=body)
        assert r.status_code == 400 and r.json()["error"] == "invalid_request", r.text
        message = r.json()["message"]
        assert words in message and "\n" not in message, message
        for python in PYTHON:
            assert python not in message + " ", message
        # nothing was granted by the refused request; a good one is served
        assert (await client.get("/v1/locks/a")).json()["held"] is False
        assert (await client.post("/v1/locks/a/-/acquire", json={"ttl": 5})).status_code == 200
