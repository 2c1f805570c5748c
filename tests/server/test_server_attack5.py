"""Attacks on ``fenced serve``'s direct lane from outside (session 5, attack 5): each test is a
finding reproduced over real sockets against the server as it runs (uvicorn with fenced's
HTTP protocol), with the rightful request served beside it."""

from __future__ import annotations

import tempfile

import pytest

from fenced.server._app import ServerSettings
from tests.server.test_direct_lane import read_answer, request, serving

# A JSON document nested deeper than Python's recursion limit: json's scanner raises
# RecursionError (not ValueError) on it; 200 KB, well within the 1 MiB body limit.
_DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "asgi"])
@pytest.mark.parametrize(
    "path", ["/v1/locks/deep/-/acquire", "/v1/locks/deep/-/renew", "/v1/locks/deep/-/release"]
)
@pytest.mark.parametrize(
    "body",
    [_DEEP, b'{"ttl": ' + _DEEP + b"}", b'{"ttl": 1' + b"0" * 5000 + b"}"],
    ids=["deep", "deep-field", "digits"],
)
async def test_a_body_json_cannot_parse_is_a_400_invalid_request_never_a_500(
    path: str, body: bytes, direct: bool
) -> None:
    """docs/server.md: a bad body is a 400 ``invalid_request`` (no 5xx). A body nested
    deeper than the recursion limit was a 500 Internal Server Error with a traceback logged
    (the lane's parser let RecursionError through) on acquire, renew and release; an integer
    of 5000 digits a 400 with an undocumented code ``http_error``. The connection serves a
    rightful acquire after it."""
    settings = ServerSettings(url=f"sqlite:///{tempfile.mkdtemp()}/locks.db")
    async with serving(settings, direct) as served:
        reader, writer = await served.connect()
        writer.write(request(path, body))
        status, _, answer = await read_answer(reader)
        assert status == b"HTTP/1.1 400 Bad Request", (status, answer[:200])
        assert b'"error":"invalid_request"' in answer.replace(b" ", b"")
        writer.write(request("/v1/locks/deep/-/acquire", b'{"ttl": 5}'))
        status, _, answer = await read_answer(reader)
        assert status == b"HTTP/1.1 200 OK" and b'"token":"deep:1"' in answer
        writer.close()


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "asgi"])
@pytest.mark.parametrize("path", ["/v1/check", "/v1/records/r/-/swap"])
async def test_other_routes_answer_a_body_json_cannot_parse_400_invalid_request(
    path: str, direct: bool
) -> None:
    """The same class on FastAPI's routes: their parse error was a 400 with the undocumented
    code ``http_error``; now ``invalid_request`` as docs/server.md lists it."""
    settings = ServerSettings(url=f"sqlite:///{tempfile.mkdtemp()}/locks.db")
    async with serving(settings, direct) as served:
        reader, writer = await served.connect()
        writer.write(request(path, _DEEP))
        status, _, answer = await read_answer(reader)
        assert status == b"HTTP/1.1 400 Bad Request"
        assert b'"error":"invalid_request"' in answer.replace(b" ", b"")
        writer.close()


def test_a_claim_record_nested_too_deep_reads_as_no_claims() -> None:
    """The gateway reads a lock's expiry-claim record (a record anyone with the records API
    may write by hand) as JSON: one nested deeper than the recursion limit raised
    RecursionError out of the expiry sweep; now it reads as no claims, as any bad value."""
    from fenced.server._gateway import _values

    assert _values((b"[" * 50_000 + b"]" * 50_000).decode()) == []
    assert _values("[3, 1, 2]") == [1, 2, 3]
