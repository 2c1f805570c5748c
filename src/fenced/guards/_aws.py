"""One AWS request plan, two ways to run it: the DynamoDB guard and the S3 store, sync and async.

A guard's operation is written once, as a plan (``_plan``: the one shape of every guard) that
yields :class:`Call` (an API operation and its keyword arguments) and gets back the response,
or has the client's exception thrown in at the ``yield`` as it is (the plan maps it where it
has the context)::

    def _publish(...) -> Plan[Version]:
        got = yield Call("get_object", {"Bucket": b, "Key": k}, body=True)
        ...

:func:`run` drives a plan on a boto3 client; :func:`arun` on an aiobotocore client (its
methods are coroutines), or on a boto3 client by running each call on a worker thread. The
requests are the same either way: no branch depends on the client or the endpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ._plan import adrive, drive

__all__ = ["Call", "Plan", "arun", "error_code", "is_async_client", "is_transport_error", "run"]

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """One API operation (``op`` is the client's method name) and its arguments. ``body``:
    the response's streaming ``Body`` is read to ``bytes`` before the plan sees it."""

    op: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    body: bool = False


Plan = Generator[Call, Any, T]


def run(client: Any, plan: Plan[T]) -> T:
    """Drive ``plan`` on a synchronous (boto3) client."""
    return drive(plan, lambda call: _sync_call(getattr(client, call.op), call), None)


async def arun(client: Any, plan: Plan[T]) -> T:
    """Drive ``plan`` on an aiobotocore client, or on a boto3 client through worker threads."""
    if not is_async_client(client):
        return await adrive(
            plan, lambda call: asyncio.to_thread(_sync_call, getattr(client, call.op), call), None
        )

    async def send(call: Call) -> Any:
        value = await getattr(client, call.op)(**call.kwargs)
        if call.body:
            stream = value["Body"]
            async with stream:  # back to the pool, read or not
                value = {**value, "Body": await stream.read()}
        return value

    return await adrive(plan, send, None)


def is_async_client(client: Any) -> bool:
    """An aiobotocore client (its API methods return coroutines; they are not declared
    ``async def``, so the class tells, not the method)."""
    return any(c.__module__.startswith("aiobotocore") for c in type(client).__mro__)


def _sync_call(method: Any, call: Call) -> Any:
    value = method(**call.kwargs)
    if call.body:
        value = {**value, "Body": value["Body"].read()}
    return value


def error_code(exc: BaseException) -> str | None:
    """The service's error code of a botocore ``ClientError`` (None for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    code = response.get("Error", {}).get("Code")
    return str(code) if code is not None else None


def is_transport_error(exc: BaseException) -> bool:
    """No answer from the service (connection, timeout): botocore's, urllib3's or aiohttp's."""
    return getattr(exc, "response", None) is None and type(exc).__module__.startswith(
        ("botocore", "urllib3", "aiobotocore", "aiohttp")
    )
