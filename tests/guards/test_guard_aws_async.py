"""The DynamoDB guard and the S3 store on aiobotocore, against moto's server mode: the same
request plans as the boto3 classes, awaited on the event loop — no worker thread (the loop's
executor refuses work in these tests, so a thread hop would fail them) — with both sides of
each guard, the typed refusals, and an unreachable endpoint within its connect timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest

import fenced
from fenced import FencingToken
from fenced.guards.dynamodb import AsyncDynamoDBGuard
from fenced.guards.s3 import AsyncS3VersionStore
from fenced.testing.servers import MotoServer
from tests.helpers import aio_aws_client, unique_name

T = TypeVar("T")
FENCE = {"pk": {"S": "fenced#orders"}}


class NoThreads(ThreadPoolExecutor):
    """A default executor that refuses fenced's own calls: a request of the guard run on a
    worker thread fails the test (aiobotocore's set-up calls, e.g. building its SSL contexts
    or resolving names, still run)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        parts = [fn, *args, *(getattr(fn, "args", ())), getattr(fn, "func", None)]
        if any((getattr(p, "__module__", None) or "").startswith("fenced") for p in parts):
            raise AssertionError(f"a worker thread was used ({fn!r}): the async path is not native")
        return super().submit(fn, *args, **kwargs)


def on_loop(main: Callable[[], Awaitable[T]]) -> T:
    async def go() -> T:
        asyncio.get_running_loop().set_default_executor(NoThreads())
        return await main()

    return asyncio.run(go())


def test_the_no_threads_executor_catches_a_thread_hop() -> None:
    from fenced.guards import _aws

    async def hop() -> None:  # what the guards did before: the boto3 call on a thread
        await asyncio.to_thread(_aws.run, None, iter(()))

    with pytest.raises(AssertionError, match="worker thread"):
        on_loop(hop)


def test_dynamodb_on_aiobotocore_refuses_the_stale_and_accepts_the_holder(
    moto_server: MotoServer,
) -> None:
    async def main() -> None:
        async with aio_aws_client("dynamodb", moto_server.url) as client:
            table = unique_name("t")
            await client.create_table(
                TableName=table,
                KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
                AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
                BillingMode="PAY_PER_REQUEST",
            )
            guard = AsyncDynamoDBGuard(client, table, lock="orders", fence_key=FENCE)
            t = {v: FencingToken("orders", v) for v in range(1, 7)}
            await guard.put_item({"pk": {"S": "k"}, "v": {"S": "a"}}, token=t[3])
            with pytest.raises(fenced.StaleTokenError) as stale:
                await guard.put_item({"pk": {"S": "k"}, "v": {"S": "b"}}, token=t[2])
            assert stale.value.token == t[2] and stale.value.high_water == t[3]
            await guard.put_item({"pk": {"S": "k"}, "v": {"S": "c"}}, token=t[3])  # again: ok
            await guard.update_item({"pk": {"S": "k"}}, {"v": {"S": "d"}}, token=t[4])
            with pytest.raises(fenced.WrongLockError):
                await guard.put_item({"pk": {"S": "k"}}, token=FencingToken("other", 9))
            assert await guard.high_water({"pk": {"S": "k"}}) == t[4]
            got = await client.get_item(TableName=table, Key={"pk": {"S": "k"}})
            assert got["Item"]["v"] == {"S": "d"}

            put = {"Put": {"TableName": table, "Item": {"pk": {"S": "x"}, "v": {"S": "1"}}}}
            await guard.transact([put], token=t[5])
            with pytest.raises(fenced.StaleTokenError):
                await guard.transact([put | {}], token=t[4])
            await guard.fence(t[5])
            assert await guard.high_water() == t[5]
            with pytest.raises(fenced.StaleTokenError):
                await guard.delete_item({"pk": {"S": "k"}}, token=t[1])
            await guard.delete_item({"pk": {"S": "k"}}, token=t[5])
            assert "Item" not in await client.get_item(TableName=table, Key={"pk": {"S": "k"}})

    on_loop(main)


def test_s3_on_aiobotocore_refuses_the_stale_and_accepts_the_holder(
    moto_server: MotoServer,
) -> None:
    async def main() -> None:
        async with aio_aws_client("s3", moto_server.url) as client:
            bucket = unique_name("b").lower().replace("_", "-")
            await client.create_bucket(Bucket=bucket)
            store = AsyncS3VersionStore(client, bucket, lock="reports", prefix="r/")
            await store.verify_conditional()
            t = {v: FencingToken("reports", v) for v in range(1, 7)}
            first = await store.publish("daily", b"v3", token=t[3])
            with pytest.raises(fenced.StaleTokenError):
                await store.publish("daily", b"old", token=t[2])
            second = await store.publish("daily", b"v3 again", token=t[3])
            assert second.seq == first.seq + 1
            await store.publish("daily", b"v4", token=t[4])
            assert await store.read("daily") == (t[4], b"v4")
            assert await store.read_version("daily", first) == b"v3"
            assert await store.versions("daily") == [first, second, await store.latest("daily")]
            assert await store.names() == ["daily"]
            await store.fence(t[5])
            assert await store.high_water("daily") == t[5]
            with pytest.raises(fenced.StaleTokenError):
                await store.publish("daily", b"late", token=t[4])
            assert await store.prune("daily", keep=1) == [first, second]
            assert await store.read("daily") == (t[4], b"v4")
            with pytest.raises(fenced.ResourceNotFoundError):
                await store.read_version("daily", first)

    on_loop(main)


def test_an_unreachable_endpoint_is_backend_unavailable_within_its_connect_timeout(
    refused_port: int,
) -> None:
    dead = f"http://127.0.0.1:{refused_port}"

    async def main() -> None:
        async with aio_aws_client("dynamodb", dead, dead=True) as client:
            t0 = time.monotonic()
            with pytest.raises(fenced.BackendUnavailable):
                await AsyncDynamoDBGuard(client, "t", lock="orders").put_item(
                    {"pk": {"S": "k"}}, token=FencingToken("orders", 1)
                )
            assert time.monotonic() - t0 < 10
        async with aio_aws_client("s3", dead, dead=True) as client:
            with pytest.raises(fenced.BackendUnavailable):
                await AsyncS3VersionStore(client, "b", lock="reports").publish(
                    "d", b"x", token=FencingToken("reports", 1)
                )

    on_loop(main)
