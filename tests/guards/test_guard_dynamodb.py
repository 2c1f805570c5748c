"""The DynamoDB guard against moto's server mode (an emulator in its own process: no real
DynamoDB is reachable here), beyond the guard conformance suite: the fence-item form in one
TransactWriteItems, update and delete, corrupt marks, reserved attributes, an unreachable
endpoint, asyncio, fence on acquire."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import fenced
from fenced import FencingToken
from fenced.guards.dynamodb import AsyncDynamoDBGuard, DynamoDBGuard
from tests.guards.processes import history_violations, race
from tests.helpers import aws_client, dead_port

FENCE = {"pk": {"S": "fenced#orders"}}


def tok(value: int) -> FencingToken:
    return FencingToken("orders", value)


def item(client: Any, table: str, pk: str) -> dict[str, Any] | None:
    got = client.get_item(TableName=table, Key={"pk": {"S": pk}}, ConsistentRead=True)
    return got.get("Item")  # type: ignore[no-any-return]


def put(table: str, pk: str, value: str) -> dict[str, Any]:
    return {"Put": {"TableName": table, "Item": {"pk": {"S": pk}, "v": {"S": value}}}}


def test_the_fence_item_form_writes_all_or_nothing(dynamodb_table: tuple[Any, str]) -> None:
    client, table = dynamodb_table
    guard = DynamoDBGuard(client, table, lock="orders", fence_key=FENCE)
    guard.transact([put(table, "a", "1"), put(table, "b", "1")], token=tok(5))
    guard.transact([put(table, "a", "2")], token=tok(5))  # equal: the holder again
    with pytest.raises(fenced.StaleTokenError) as stale:
        guard.transact([put(table, "a", "stale"), put(table, "c", "stale")], token=tok(4))
    assert stale.value.high_water == tok(5)
    assert item(client, table, "a")["v"] == {"S": "2"}  # type: ignore[index]
    assert item(client, table, "c") is None  # nothing of the refused transaction
    assert guard.high_water() == tok(5)
    # the caller's own condition failing: their error, nothing written, the mark unmoved
    own = {
        "ConditionCheck": {
            "TableName": table,
            "Key": {"pk": {"S": "missing"}},
            "ConditionExpression": "attribute_exists(pk)",
        }
    }
    with pytest.raises(client.exceptions.TransactionCanceledException):
        guard.transact([put(table, "d", "x"), own], token=tok(9))
    assert item(client, table, "d") is None and guard.high_water() == tok(5)
    with pytest.raises(fenced.ConfigurationError, match="fence item"):
        guard.transact([put(table, "fenced#orders", "x")], token=tok(9))


def test_update_and_delete_in_the_item(dynamodb_table: tuple[Any, str]) -> None:
    client, table = dynamodb_table
    guard = DynamoDBGuard(client, table, lock="orders")
    key = {"pk": {"S": "order#1"}}
    guard.update_item(key, {"status": {"S": "new"}}, token=tok(3))  # creates it
    guard.update_item(key, {"status": {"S": "paid"}}, token=tok(4))
    with pytest.raises(fenced.StaleTokenError):
        guard.update_item(key, {"status": {"S": "stale"}}, token=tok(3))
    with pytest.raises(fenced.StaleTokenError):
        guard.delete_item(key, token=tok(3))
    got = item(client, table, "order#1")
    assert got is not None and got["status"] == {"S": "paid"} and got["fencing_token"] == {"N": "4"}
    guard.delete_item(key, token=tok(4))
    assert item(client, table, "order#1") is None


@pytest.mark.parametrize(
    "damage",
    [
        {"fencing_token": {"S": "9"}, "fencing_lock": {"S": "orders"}},
        {"fencing_token": {"N": "0"}, "fencing_lock": {"S": "orders"}},
        {"fencing_token": {"N": "-5"}, "fencing_lock": {"S": "orders"}},
        {"fencing_lock": {"S": "orders"}},
        {"fencing_token": {"N": "5"}},
        {"fencing_token": {"N": "5"}, "fencing_lock": {"N": "1"}},
    ],
    ids=["string", "zero", "negative", "lock-without-token", "token-without-lock", "lock-number"],
)
def test_a_corrupt_mark_refuses_every_write(
    dynamodb_table: tuple[Any, str], damage: dict[str, Any]
) -> None:
    client, table = dynamodb_table
    client.put_item(TableName=table, Item={"pk": {"S": "x"}, "v": {"S": "kept"}, **damage})
    guard = DynamoDBGuard(client, table, lock="orders")
    for value in (1, 5, 10**6):
        with pytest.raises(fenced.CorruptMarkError):
            guard.put_item({"pk": {"S": "x"}, "v": {"S": "over"}}, token=tok(value))
    assert item(client, table, "x")["v"] == {"S": "kept"}  # type: ignore[index]


def test_bad_input_and_an_unreachable_endpoint(dynamodb_table: tuple[Any, str]) -> None:
    client, table = dynamodb_table
    guard = DynamoDBGuard(client, table, lock="orders")
    with pytest.raises(fenced.ConfigurationError, match="fencing_token"):
        guard.put_item({"pk": {"S": "y"}, "fencing_token": {"N": "99"}}, token=tok(1))
    with pytest.raises(fenced.ConfigurationError, match="reserved"):
        guard.put_item(
            {"pk": {"S": "y"}},
            token=tok(1),
            condition="#fenced_x = :a",
            ExpressionAttributeNames={"#fenced_x": "v"},
        )
    with pytest.raises(fenced.WrongLockError):
        guard.put_item({"pk": {"S": "y"}}, token=tok(1))  # binds the item to "orders"
        guard.put_item({"pk": {"S": "y"}}, token=FencingToken("other", 5))
    with pytest.raises(fenced.ConfigurationError, match="does not exist"):
        DynamoDBGuard(client, "no-such-table", lock="orders").put_item(
            {"pk": {"S": "y"}}, token=tok(1)
        )
    with pytest.raises(fenced.ConfigurationError, match="fence_key"):
        guard.fence(tok(1))
    with pytest.raises(fenced.ConfigurationError):
        DynamoDBGuard(client, table, lock="not a lock name")
    with dead_port() as port, pytest.raises(fenced.BackendUnavailable):
        dead = aws_client("dynamodb", f"http://127.0.0.1:{port}", dead=True)
        DynamoDBGuard(dead, table, lock="orders").put_item({"pk": {"S": "y"}}, token=tok(1))


def test_the_async_guard_is_the_same_code(dynamodb_table: tuple[Any, str]) -> None:
    client, table = dynamodb_table
    guard = AsyncDynamoDBGuard(client, table, lock="orders", fence_key=FENCE)

    async def go() -> None:
        await guard.put_item({"pk": {"S": "k"}, "v": {"S": "a"}}, token=tok(2))
        with pytest.raises(fenced.StaleTokenError):
            await guard.put_item({"pk": {"S": "k"}, "v": {"S": "b"}}, token=tok(1))
        await guard.fence(tok(3))
        assert await guard.high_water() == tok(3)
        await guard.transact([put(table, "k2", "c")], token=tok(3))

    asyncio.run(go())
    assert item(client, table, "k")["v"] == {"S": "a"}  # type: ignore[index]


def test_fence_on_acquire_raises_the_fence_item(
    dynamodb_table: tuple[Any, str], tmp_path: Path
) -> None:
    client, table = dynamodb_table
    guard = DynamoDBGuard(client, table, lock="orders", fence_key=FENCE)
    with fenced.connect(f"sqlite:///{tmp_path}/locks.db") as locks:
        with locks.lock("orders", ttl=5, fence=[guard]) as first:
            pass
        with locks.lock("orders", ttl=5, fence=[guard]) as second:
            assert guard.high_water() == second.token
            with pytest.raises(fenced.StaleTokenError):
                guard.transact([put(table, "late", "x")], token=first.token)


@pytest.mark.slow  # (dispatched first under xdist: tests/conftest.py)
def test_racing_processes_commit_tokens_in_order(
    moto_server: Any, dynamodb_table: tuple[Any, str]
) -> None:
    """Four processes offer interleaved tokens; each accepted transaction appends its token to
    a log item in the same TransactWriteItems: the order DynamoDB (here moto) applied them."""
    client, table = dynamodb_table
    accepted = race(f"dynamodb:{moto_server.url}|{table}", "race", writers=4, per_writer=25)
    log_item = item(client, table, "log#race")
    assert log_item is not None
    log = [int(v["N"]) for v in log_item["tokens"]["L"]]
    data = item(client, table, "race")["v"]["S"]  # type: ignore[index]
    assert sum(accepted) == len(log) > 0
    assert history_violations(log, data) == []


def test_extra_request_fields_never_replace_the_guards(dynamodb_table: tuple[Any, str]) -> None:
    """Bug: put_item(**extra) with a ConditionExpression had it silently replaced by the
    fence's (an existing item overwritten), and update_item with an UpdateExpression had it
    replace the guard's SET of the mark: acknowledged, the mark left at 5, and a stale token
    6 accepted afterwards. Now a caller's condition is ANDed with the fence's, and a field
    that would replace the guard's (or be replaced by it) is refused, nothing sent."""
    client, table = dynamodb_table
    guard = DynamoDBGuard(client, table, lock="orders")
    key = {"pk": {"S": "e"}}
    guard.put_item({**key, "v": {"S": "first"}}, token=tok(5))

    # the caller's own condition, given as ConditionExpression: ANDed, so it holds
    with pytest.raises(client.exceptions.ConditionalCheckFailedException):
        guard.put_item(
            {**key, "v": {"S": "overwritten"}},
            token=tok(7),
            ConditionExpression="attribute_not_exists(pk)",
        )
    got = item(client, table, "e")
    assert got is not None and got["v"] == {"S": "first"} and got["fencing_token"] == {"N": "5"}
    # ... and it passes when it holds, with the fence's rule still applied
    guard.put_item(
        {**key, "v": {"S": "second"}},
        token=tok(7),
        ConditionExpression="#v = :first",
        ExpressionAttributeNames={"#v": "v"},
        ExpressionAttributeValues={":first": {"S": "first"}},
        ReturnValues="ALL_OLD",
    )
    with pytest.raises(fenced.StaleTokenError):
        guard.put_item(
            {**key, "v": {"S": "stale"}},
            token=tok(6),
            ConditionExpression="attribute_exists(pk)",
        )
    with pytest.raises(fenced.ConfigurationError, match="both"):
        guard.put_item(key, token=tok(8), condition="attribute_exists(pk)", ConditionExpression="x")

    # fields that are the guard's own: refused before anything is sent
    refused: list[tuple[str, dict[str, Any]]] = [
        ("update_item", {"UpdateExpression": "SET #v = :x"}),
        ("update_item", {"AttributeUpdates": {"v": {"Value": {"S": "x"}}}}),
        ("update_item", {"Key": {"pk": {"S": "other"}}}),
        ("put_item", {"Item": {"pk": {"S": "e"}, "v": {"S": "unfenced"}}}),
        ("put_item", {"TableName": "elsewhere"}),
        ("put_item", {"ReturnValuesOnConditionCheckFailure": "NONE"}),
        ("put_item", {"Expected": {"v": {"Exists": False}}}),
        ("delete_item", {"Key": {"pk": {"S": "other"}}}),
        ("delete_item", {"ConditionalOperator": "OR"}),
    ]
    for op, extra in refused:
        args: tuple[Any, ...] = (key, {"v": {"S": "x"}}) if op == "update_item" else (key,)
        if op == "put_item":
            args = ({**key, "v": {"S": "x"}},)
        with pytest.raises(fenced.ConfigurationError, match="does not take"):
            getattr(guard, op)(*args, token=tok(9), **extra)
    got = item(client, table, "e")
    assert got is not None and got["v"] == {"S": "second"} and got["fencing_token"] == {"N": "7"}

    # the update's rule, both sides, after all that: the mark is 7
    guard.update_item(key, {"v": {"S": "third"}}, token=tok(7), ReturnValues="ALL_NEW")
    with pytest.raises(fenced.StaleTokenError):
        guard.update_item(key, {"v": {"S": "stale"}}, token=tok(6))
    assert item(client, table, "e")["v"] == {"S": "third"}  # type: ignore[index]


def test_async_guard_refuses_the_same_extra_fields(dynamodb_table: tuple[Any, str]) -> None:
    client, table = dynamodb_table
    guard = AsyncDynamoDBGuard(client, table, lock="orders")

    async def go() -> None:
        await guard.update_item({"pk": {"S": "a"}}, {"v": {"S": "1"}}, token=tok(5))
        with pytest.raises(fenced.ConfigurationError, match="UpdateExpression"):
            await guard.update_item(
                {"pk": {"S": "a"}}, {}, token=tok(5), UpdateExpression="SET v = :x"
            )

    asyncio.run(go())
    assert item(client, table, "a")["fencing_token"] == {"N": "5"}  # type: ignore[index]
