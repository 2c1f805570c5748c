"""DynamoDB guard: every write is one conditional request that checks and raises the mark.

Two forms, on a boto3 DynamoDB *client* (items in its typed form, ``{"S": "..."}``)::

    guard = DynamoDBGuard(client, "orders", lock="orders")
    guard.put_item({"pk": {"S": "order#17"}, "status": {"S": "paid"}}, token=lease.token)
    guard.update_item({"pk": {"S": "order#17"}}, {"status": {"S": "shipped"}}, token=lease.token)
    guard.delete_item({"pk": {"S": "order#3"}}, token=lease.token)

    fenced_tx = DynamoDBGuard(client, "orders", lock="orders", fence_key={"pk": {"S": "fenced#orders"}})
    fenced_tx.transact([{"Put": {...}}, {"Update": {...}}], token=lease.token)

* **Mark in the item** (``put_item``/``update_item``/``delete_item``): the item carries its own
  token and lock (``fencing_token`` N, ``fencing_lock`` S) and the write's
  ``ConditionExpression`` accepts it only if the item was never fenced or its token is at most
  ours and of our lock; the write sets both. One request, applied atomically by DynamoDB.
* **Fence item** (``transact``, needs ``fence_key``): one ``TransactWriteItems`` whose first
  action updates the resource's fence item under the same condition, followed by the caller's
  actions (up to 99): all or nothing.

The condition, on the stored ``t`` and ``l``::

    (attribute_not_exists(t) AND attribute_not_exists(l))
    OR (attribute_type(t, N) AND attribute_type(l, S) AND t >= 1 AND t <= :token AND l = :lock)

A stored token of the wrong type (a string) or below 1, or a lock without a token, matches
neither branch: refused and reported as :class:`~fenced.CorruptMarkError` (fail closed). A
refusal asks for the old item (``ReturnValuesOnConditionCheckFailure=ALL_OLD``) to say why, so
it costs no second request. Writes never read first: there is no check-then-write.

Tested against moto's server mode (an emulator in its own process, ``MotoServer``): no real
DynamoDB is reachable from the test machines. The requests are the ones sent to AWS; nothing
branches on the endpoint.

:class:`AsyncDynamoDBGuard` takes an aiobotocore client (``session.create_client("dynamodb")``)
and awaits it; given a boto3 client it runs each request on a worker thread. Both guards run
the same request plans (``_aws``): each operation is written once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from .._core.errors import (
    BackendUnavailable,
    ConfigurationError,
    CorruptMarkError,
    FenceConflictError,
    FencedError,
    InvalidTokenError,
    StaleTokenError,
    WrongLockError,
)
from .._core.signing import TokenVerifier
from .._core.token import MAX_TOKEN, FencingToken, TokenLike, validate_lock_name
from ._aws import Call, Plan, arun, is_transport_error, run

__all__ = ["AsyncDynamoDBGuard", "DynamoDBGuard"]

Item = Mapping[str, Mapping[str, Any]]
_T, _L, _TOK, _LOCK, _ONE = "#fenced_t", "#fenced_l", ":fenced_tok", ":fenced_lock", ":fenced_one"
_N, _S = ":fenced_type_n", ":fenced_type_s"
_EXTRA_PASSED: Final = frozenset(
    {
        "ExpressionAttributeNames",  # merged with the guard's (its own are #fenced_/:fenced_)
        "ExpressionAttributeValues",
        "ReturnValues",
        "ReturnConsumedCapacity",
        "ReturnItemCollectionMetrics",
    }
)
"""The request fields a caller may add (``**extra``): none of them changes what is checked
or written. ``ConditionExpression`` is taken too, and ANDed with the fence's condition."""
_GUARD_FIELDS: Final = {
    "put_item": "TableName, Item (with the mark), ConditionExpression and "
    "ReturnValuesOnConditionCheckFailure",
    "update_item": "TableName, Key, UpdateExpression (values= and the mark), "
    "ConditionExpression and ReturnValuesOnConditionCheckFailure",
    "delete_item": "TableName, Key, ConditionExpression and ReturnValuesOnConditionCheckFailure",
}
_CONFLICT: Final = frozenset(
    {
        "TransactionConflictException",
        "ProvisionedThroughputExceededException",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TransactionInProgressException",
    }
)


class _Plans:
    """The guard's state and its operations as request plans (run by the two classes below)."""

    def __init__(
        self,
        client: Any,
        table: str,
        *,
        lock: str,
        fence_key: Item | None = None,
        token_attribute: str = "fencing_token",
        lock_attribute: str = "fencing_lock",
        verify: TokenVerifier | None = None,
    ) -> None:
        if not isinstance(table, str) or not table:
            raise ConfigurationError(f"table must be a table name, not {table!r}")
        try:
            self.lock = validate_lock_name(lock)
        except InvalidTokenError as exc:
            raise ConfigurationError(f"lock of table {table!r}: {exc}") from None
        if token_attribute == lock_attribute or not token_attribute or not lock_attribute:
            raise ConfigurationError("token_attribute and lock_attribute must be two names")
        self.client = client
        self.table = table
        self.fence_key = dict(fence_key) if fence_key is not None else None
        self.token_attribute = token_attribute
        self.lock_attribute = lock_attribute
        self.verifier = verify

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.table!r}, lock={self.lock!r})"

    # -- the condition, once ------------------------------------------------------------------

    def _condition(self) -> str:
        # (attribute_type first: a mark of another type is refused by name, not by how a
        # comparison across types happens to evaluate)
        return (
            f"(attribute_not_exists({_T}) AND attribute_not_exists({_L})) OR "
            f"(attribute_type({_T}, {_N}) AND attribute_type({_L}, {_S}) AND "
            f"{_T} >= {_ONE} AND {_T} <= {_TOK} AND {_L} = {_LOCK})"
        )

    def _fenced(self, tok: FencingToken, request: dict[str, Any], theirs: str | None) -> None:
        """Add the fence's condition (ANDed with the caller's own) and placeholders."""
        names = dict(request.get("ExpressionAttributeNames") or {})
        values = dict(request.get("ExpressionAttributeValues") or {})
        if any(k.startswith(("#fenced_", ":fenced_")) for k in (*names, *values)):
            raise ConfigurationError("placeholders starting with #fenced_/:fenced_ are reserved")
        names |= {_T: self.token_attribute, _L: self.lock_attribute}
        values |= {
            _TOK: {"N": str(tok.value)},
            _LOCK: {"S": tok.lock},
            _ONE: {"N": "1"},
            _N: {"S": "N"},
            _S: {"S": "S"},
        }
        ours = self._condition()
        request["ConditionExpression"] = f"({ours}) AND ({theirs})" if theirs else ours
        request["ExpressionAttributeNames"] = names
        request["ExpressionAttributeValues"] = values
        request["ReturnValuesOnConditionCheckFailure"] = "ALL_OLD"

    def _extra(
        self, op: str, extra: Mapping[str, Any], condition: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The caller's extra request fields, and the condition to AND with the fence's.

        Only fields that cannot change what the guard writes or checks pass through; a
        ``ConditionExpression`` among them is the caller's condition (the same as
        ``condition=``: both at once is ambiguous). Anything else would replace the guard's
        own field or be replaced by it (an ``UpdateExpression`` that leaves the mark alone,
        a dropped condition that lets an item be overwritten), so it is refused."""
        refused = sorted(set(extra) - _EXTRA_PASSED - {"ConditionExpression"})
        if refused:
            raise ConfigurationError(
                f"{op}() does not take {', '.join(map(repr, refused))}: the guard writes "
                f"{_GUARD_FIELDS.get(op, 'the request')} itself; extra fields may only be "
                f"{', '.join(sorted(_EXTRA_PASSED | {'ConditionExpression'}))}"
            )
        passed = dict(extra)
        theirs = passed.pop("ConditionExpression", None)
        if theirs is not None:
            if condition is not None:
                raise ConfigurationError(
                    f"{op}() got both condition= and ConditionExpression=: pass one"
                )
            if not isinstance(theirs, str) or not theirs.strip():
                raise ConfigurationError(f"ConditionExpression must be a non-empty str: {theirs!r}")
            condition = theirs
        return passed, condition

    def _token(self, token: TokenLike) -> FencingToken:
        return FencingToken.coerce(token, self.lock, self.verifier)

    def _no_reserved(self, attributes: Mapping[str, Any], what: str) -> None:
        for a in (self.token_attribute, self.lock_attribute):
            if a in attributes:
                raise ConfigurationError(
                    f"{what} may not set {a!r}: the guard keeps the mark there"
                )

    # -- the outcome, once ----------------------------------------------------------------------

    def _refusal(self, tok: FencingToken, old: Mapping[str, Any] | None, where: str) -> FencedError:
        old = old or {}
        stored, lock = old.get(self.token_attribute), old.get(self.lock_attribute)
        if stored is None:
            if lock is not None:
                return CorruptMarkError(where, f"lock {lock!r} bound, token missing")
            return FenceConflictError(f"the mark of {where} changed while writing; try again")
        try:
            value = int(stored["N"]) if set(stored) == {"N"} else None
        except ValueError:
            value = None
        if value is None or not 0 < value <= MAX_TOKEN or str(value) != stored.get("N"):
            return CorruptMarkError(where, f"token {stored!r}")
        lock_name = lock.get("S") if isinstance(lock, Mapping) else None
        if lock_name != tok.lock:
            if lock_name is None:
                return CorruptMarkError(where, f"lock {lock!r}")
            return WrongLockError(
                f"{where} is fenced by lock {lock_name!r}; token {tok} belongs to lock {tok.lock!r}"
            )
        if value > tok.value:
            return StaleTokenError(tok, FencingToken(lock_name, value), where)
        return FenceConflictError(f"the mark of {where} changed while writing; try again")

    def _send(self, op: str, request: dict[str, Any], tok: FencingToken, where: str) -> Plan[Any]:
        theirs = request.get("ConditionExpression") not in (None, self._condition())
        try:
            return (yield Call(op, request))
        except Exception as exc:
            mapped = self._mapped(exc, tok, where, theirs)
            if mapped is exc:
                raise  # the caller's own error, as the client raised it (not its own cause)
            raise mapped from exc

    def _mapped(
        self, exc: Exception, tok: FencingToken, where: str, theirs: bool = False
    ) -> Exception:
        response = getattr(exc, "response", None)
        if not isinstance(response, Mapping):
            if is_transport_error(exc):
                return BackendUnavailable(f"DynamoDB unreachable: {type(exc).__name__}: {exc}")
            return exc
        code = response.get("Error", {}).get("Code", "")
        if code == "ConditionalCheckFailedException":
            refusal = self._refusal(tok, response.get("Item"), where)
            if isinstance(refusal, FenceConflictError) and theirs:
                # The old item (as the condition saw it) passes the fence: the caller's own
                # condition failed. Theirs to read, as in transact().
                return exc
            return refusal
        if code == "TransactionCanceledException":
            reasons = response.get("CancellationReasons") or []
            if reasons and reasons[0].get("Code") == "ConditionalCheckFailed":
                return self._refusal(tok, reasons[0].get("Item"), where)
            if any(r.get("Code") == "TransactionConflict" for r in reasons):
                return FenceConflictError(f"a concurrent transaction on {where}: try again")
            return exc  # the caller's own condition or item failed: theirs to read
        if code in _CONFLICT:
            return FenceConflictError(f"DynamoDB refused for now ({code}) on {where}: try again")
        if code == "ResourceNotFoundException":
            return ConfigurationError(f"DynamoDB table {self.table!r} does not exist")
        return exc

    # -- mark in the item -----------------------------------------------------------------------

    def _where(self, key: Mapping[str, Any]) -> str:
        return f"{self.table}{dict(key)!r}"

    def _put_item(
        self, item: Item, token: TokenLike, condition: str | None, extra: dict[str, Any]
    ) -> Plan[FencingToken]:
        tok = self._token(token)
        extra, condition = self._extra("put_item", extra, condition)
        self._no_reserved(item, "put_item")
        body = {
            **dict(item),
            self.token_attribute: {"N": str(tok.value)},
            self.lock_attribute: {"S": tok.lock},
        }
        request: dict[str, Any] = {"TableName": self.table, "Item": body, **extra}
        self._fenced(tok, request, condition)
        yield from self._send("put_item", request, tok, self._where(item))
        return tok

    def _update_item(
        self,
        key: Item,
        values: Mapping[str, Mapping[str, Any]],
        token: TokenLike,
        condition: str | None,
        extra: dict[str, Any],
    ) -> Plan[FencingToken]:
        tok = self._token(token)
        extra, condition = self._extra("update_item", extra, condition)
        self._no_reserved(values, "update_item")
        names = {f"#fenced_a{i}": n for i, n in enumerate(values)}
        vals = {f":fenced_a{i}": v for i, v in enumerate(values.values())}
        sets = [f"#fenced_a{i} = :fenced_a{i}" for i in range(len(values))]
        sets += [f"{_T} = {_TOK}", f"{_L} = {_LOCK}"]
        request: dict[str, Any] = {
            "TableName": self.table,
            "Key": dict(key),
            "UpdateExpression": "SET " + ", ".join(sets),
            **extra,
        }
        self._fenced(tok, request, condition)
        request["ExpressionAttributeNames"] |= names
        request["ExpressionAttributeValues"] |= vals
        yield from self._send("update_item", request, tok, self._where(key))
        return tok

    def _delete_item(
        self, key: Item, token: TokenLike, condition: str | None, extra: dict[str, Any]
    ) -> Plan[FencingToken]:
        tok = self._token(token)
        extra, condition = self._extra("delete_item", extra, condition)
        request: dict[str, Any] = {"TableName": self.table, "Key": dict(key), **extra}
        self._fenced(tok, request, condition)
        yield from self._send("delete_item", request, tok, self._where(key))
        return tok

    def _high_water(self, key: Item | None) -> Plan[FencingToken | None]:
        key = key if key is not None else self._fence_key()
        request = {"TableName": self.table, "Key": dict(key), "ConsistentRead": True}
        got = yield Call("get_item", request)
        item = got.get("Item")
        if not item or self.token_attribute not in item:
            return None
        stored = item[self.token_attribute]
        try:
            return FencingToken(item[self.lock_attribute]["S"], int(stored["N"]))
        except (KeyError, ValueError, TypeError, InvalidTokenError) as exc:
            raise CorruptMarkError(self._where(key), f"token {stored!r}") from exc

    # -- fence item -----------------------------------------------------------------------------

    def _fence_key(self) -> dict[str, Any]:
        if self.fence_key is None:
            raise ConfigurationError("this needs fence_key= (the fence item's key)")
        return self.fence_key

    def _fence_update(self, tok: FencingToken) -> dict[str, Any]:
        update: dict[str, Any] = {
            "TableName": self.table,
            "Key": self._fence_key(),
            "UpdateExpression": f"SET {_T} = {_TOK}, {_L} = {_LOCK}",
        }
        self._fenced(tok, update, None)
        return update

    def _transact(
        self, actions: Sequence[Mapping[str, Any]], token: TokenLike
    ) -> Plan[FencingToken]:
        tok = self._token(token)
        fence = self._fence_key()
        if not 0 < len(actions) <= 99:
            raise ConfigurationError("transact() takes 1 to 99 actions")
        for a in actions:
            if not isinstance(a, Mapping) or len(a) != 1:
                raise ConfigurationError(f"an action is one {{kind: request}} mapping, not {a!r}")
            ((kind, body),) = a.items()
            target = body.get("Key") or {
                k: body["Item"][k] for k in fence if k in body.get("Item", {})
            }
            if body.get("TableName") == self.table and dict(target) == fence:
                raise ConfigurationError(
                    f"{kind} targets the fence item: the guard keeps the mark there"
                )
        where = self._where(fence)
        yield from self._send(
            "transact_write_items",
            {"TransactItems": [{"Update": self._fence_update(tok)}, *actions]},
            tok,
            where,
        )
        return tok

    def _fence(self, token: TokenLike) -> Plan[None]:
        tok = self._token(token)
        yield from self._send(
            "update_item", self._fence_update(tok), tok, self._where(self._fence_key())
        )


class DynamoDBGuard(_Plans):
    """Fenced writes to DynamoDB table ``table`` for the lock ``lock`` (see the module doc),
    on a boto3 DynamoDB client."""

    def put_item(
        self, item: Item, *, token: TokenLike, condition: str | None = None, **extra: Any
    ) -> FencingToken:
        """Put ``item`` (typed form) with the token and lock in it, iff it is not stale.
        ``condition`` (or ``ConditionExpression=``; with ``ExpressionAttributeNames/Values``)
        is ANDed with the fence's. ``extra`` may also carry ``ReturnValues``,
        ``ReturnConsumedCapacity`` and ``ReturnItemCollectionMetrics``; any other field
        would replace the guard's own (or be replaced by it): ConfigurationError."""
        return run(self.client, self._put_item(item, token, condition, extra))

    def update_item(
        self,
        key: Item,
        values: Mapping[str, Mapping[str, Any]],
        *,
        token: TokenLike,
        condition: str | None = None,
        **extra: Any,
    ) -> FencingToken:
        """``SET`` each of ``values`` (typed form) and the mark on the item ``key``, iff the
        token is not stale (a missing item is created, as UpdateItem does). ``condition`` and
        ``extra`` as for :meth:`put_item`; the guard writes the ``UpdateExpression`` itself
        (an ``UpdateExpression=`` is refused: it would leave the mark where it was)."""
        return run(self.client, self._update_item(key, values, token, condition, extra))

    def delete_item(
        self, key: Item, *, token: TokenLike, condition: str | None = None, **extra: Any
    ) -> FencingToken:
        """Delete the item ``key`` iff its mark is not above the token. (The mark goes with
        the item: a later stale put_item would be accepted. Delete with the fence-item form,
        ``transact``, where that matters.)"""
        return run(self.client, self._delete_item(key, token, condition, extra))

    def transact(self, actions: Sequence[Mapping[str, Any]], *, token: TokenLike) -> FencingToken:
        """One ``TransactWriteItems``: the fence item's conditional update, then ``actions``
        (``{"Put": ...}``, ``{"Update": ...}``, ``{"Delete": ...}``, ``{"ConditionCheck":
        ...}``, at most 99), all or nothing."""
        return run(self.client, self._transact(actions, token))

    def fence(self, token: TokenLike) -> None:
        """Raise the fence item's mark to ``token`` (fence on acquire)."""
        run(self.client, self._fence(token))

    def high_water(self, key: Item | None = None) -> FencingToken | None:
        """The mark of the item ``key`` (default: the fence item), strongly consistent."""
        return run(self.client, self._high_water(key))


class AsyncDynamoDBGuard(_Plans):
    """:class:`DynamoDBGuard` for asyncio, on an aiobotocore client (or a boto3 client, each
    request on a worker thread): the same request plans, awaited."""

    async def put_item(
        self, item: Item, *, token: TokenLike, condition: str | None = None, **extra: Any
    ) -> FencingToken:
        return await arun(self.client, self._put_item(item, token, condition, extra))

    async def update_item(
        self,
        key: Item,
        values: Mapping[str, Mapping[str, Any]],
        *,
        token: TokenLike,
        condition: str | None = None,
        **extra: Any,
    ) -> FencingToken:
        return await arun(self.client, self._update_item(key, values, token, condition, extra))

    async def delete_item(
        self, key: Item, *, token: TokenLike, condition: str | None = None, **extra: Any
    ) -> FencingToken:
        return await arun(self.client, self._delete_item(key, token, condition, extra))

    async def transact(
        self, actions: Sequence[Mapping[str, Any]], *, token: TokenLike
    ) -> FencingToken:
        return await arun(self.client, self._transact(actions, token))

    async def fence(self, token: TokenLike) -> None:
        await arun(self.client, self._fence(token))

    async def high_water(self, key: Item | None = None) -> FencingToken | None:
        return await arun(self.client, self._high_water(key))
