"""The S3 version store against moto's server mode (no real S3 here), beyond the guard
conformance suite: a stale publisher that loses the race uploads an orphan that never becomes
current, corrupt marks fail closed, fence, prune, the store check that can fail, bad input."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

import fenced
from fenced import FencingToken
from fenced.guards.files import Version
from fenced.guards.s3 import AsyncS3VersionStore, S3VersionStore
from fenced.testing.servers import MotoServer
from tests.guards.processes import LOCK, history_violations, race
from tests.helpers import aws_client, dead_port


def tok(value: int) -> FencingToken:
    return FencingToken("reports", value)


def test_a_stale_publisher_that_loses_the_race_never_becomes_current(
    s3_bucket: tuple[Any, str],
) -> None:
    client, bucket = s3_bucket
    newer = S3VersionStore(client, bucket, lock="reports")
    newer.publish("daily", b"v5", token=tok(5))

    class PausedBeforeTheSwap(S3VersionStore):
        """The stale holder uploads, then pauses; the new holder publishes meanwhile."""

        def _swap_mark(self, name: str, mark: Any, token: FencingToken, version: Any) -> bool:
            if token.value == 6 and not hasattr(self, "paused"):
                self.paused = True
                newer.publish("daily", b"v7", token=tok(7))
            return super()._swap_mark(name, mark, token, version)

    stale = PausedBeforeTheSwap(client, bucket, lock="reports")
    with pytest.raises(fenced.StaleTokenError) as refused:
        stale.publish("daily", b"v6", token=tok(6))
    assert refused.value.high_water == tok(7)
    assert newer.read("daily") == (tok(7), b"v7")
    names = [v.filename for v in newer.versions("daily")]
    assert "0000000000000000006.000000" in names  # the orphan was uploaded ...
    assert newer.latest("daily") == Version(tok(7))  # ... and never became current
    pruned = newer.prune("daily", keep=1)
    assert [v.token.value for v in pruned] == [5, 6]
    assert newer.read("daily") == (tok(7), b"v7")


def test_the_same_holder_publishes_again_and_fence_cuts_off_the_old_one(
    s3_bucket: tuple[Any, str],
) -> None:
    client, bucket = s3_bucket
    store = S3VersionStore(client, bucket, lock="reports", prefix="team/")
    assert store.publish("daily", b"a", token=tok(3)) == Version(tok(3), 0)
    assert store.publish("daily", b"b", token=tok(3)) == Version(tok(3), 1)
    store.fence(tok(4))  # every name under the prefix
    with pytest.raises(fenced.StaleTokenError):
        store.publish("daily", b"late", token=tok(3))
    assert store.read("daily") == (tok(3), b"b") and store.high_water("daily") == tok(4)
    assert store.publish("daily", b"c", token=tok(4)) == Version(tok(4), 0)
    assert store.names() == ["daily"]


@pytest.mark.parametrize(
    "mark",
    [
        b"not json",
        json.dumps({"lock": "reports", "token": 0, "version": None}).encode(),
        json.dumps({"lock": "reports", "token": "5", "version": None}).encode(),
        json.dumps(
            {"lock": "reports", "token": 5, "version": "0000000000000000009.000000"}
        ).encode(),
        json.dumps({"lock": "reports", "token": 5, "version": None, "x": 1}).encode(),
        json.dumps({"lock": "re ports", "token": 5, "version": None}).encode(),
    ],
    ids=["garbage", "zero", "string", "version-above-mark", "extra-field", "bad-lock"],
)
def test_a_corrupt_mark_refuses_every_publish(s3_bucket: tuple[Any, str], mark: bytes) -> None:
    client, bucket = s3_bucket
    store = S3VersionStore(client, bucket, lock="reports")
    store.publish("daily", b"kept", token=tok(2))
    client.put_object(Bucket=bucket, Key="daily/.mark", Body=mark)
    for value in (1, 5, 10**6):
        with pytest.raises(fenced.CorruptMarkError):
            store.publish("daily", b"over", token=tok(value))
    with pytest.raises(fenced.CorruptMarkError):
        store.read("daily")


class IgnoresConditions:
    """A store that drops conditional headers (as one without the feature would)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def put_object(self, **kw: Any) -> Any:
        kw.pop("IfNoneMatch", None)
        kw.pop("IfMatch", None)
        return self.inner.put_object(**kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_the_store_check_passes_here_and_fails_on_a_store_without_conditions(
    s3_bucket: tuple[Any, str],
) -> None:
    client, bucket = s3_bucket
    S3VersionStore(client, bucket, lock="reports").verify_conditional()
    with pytest.raises(fenced.ConfigurationError, match="ignores"):
        S3VersionStore(IgnoresConditions(client), bucket, lock="reports").verify_conditional()


def test_bad_input_missing_bucket_and_unreachable_store(s3_bucket: tuple[Any, str]) -> None:
    client, bucket = s3_bucket
    store = S3VersionStore(client, bucket, lock="reports")
    for name in ("", ".mark", "a/b", "x" * 201, 5):
        with pytest.raises(fenced.ConfigurationError):
            store.publish(name, b"x", token=tok(1))  # type: ignore[arg-type]
    with pytest.raises(fenced.ConfigurationError):
        S3VersionStore(client, bucket, lock="reports", prefix="no-slash")
    with pytest.raises(fenced.ResourceNotFoundError):
        store.read("never")
    with pytest.raises(fenced.ConfigurationError, match="does not exist"):
        S3VersionStore(client, "no-such-bucket", lock="reports").publish("d", b"x", token=tok(1))
    with pytest.raises(fenced.WrongLockError):
        store.publish("daily", b"x", token=tok(1))
        S3VersionStore(client, bucket, lock="other").publish(
            "daily", b"x", token=FencingToken("other", 9)
        )
    with dead_port() as port, pytest.raises(fenced.BackendUnavailable):
        dead = aws_client("s3", f"http://127.0.0.1:{port}", dead=True)
        S3VersionStore(dead, bucket, lock="reports").publish("d", b"x", token=tok(1))


def test_the_async_store_is_the_same_code(s3_bucket: tuple[Any, str]) -> None:
    store = AsyncS3VersionStore(*s3_bucket, lock="reports")

    async def go() -> None:
        await store.publish("daily", b"a", token=tok(2))
        with pytest.raises(fenced.StaleTokenError):
            await store.publish("daily", b"b", token=tok(1))
        assert await store.read("daily") == (tok(2), b"a")

    asyncio.run(go())


def committed_log(client: Any, bucket: str, name: str) -> list[dict[str, Any]]:
    """Every version the mark object ever had, oldest first: with bucket versioning on, S3's
    own record of the committed publishes, in the order the store applied them (a listing
    gives a key's versions newest first)."""
    got = client.list_object_versions(Bucket=bucket, Prefix=f"{name}/.mark")
    assert not got.get("IsTruncated")
    marks = []
    for v in reversed(got.get("Versions", [])):
        body = client.get_object(Bucket=bucket, Key=f"{name}/.mark", VersionId=v["VersionId"])
        marks.append(json.loads(body["Body"].read()))
    return marks


def race_violations(
    moto: MotoServer, client: Any, bucket: str, kind: str, per_writer: int
) -> list[str]:
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    accepted = race(f"{kind}:{moto.url}|{bucket}", "race", writers=4, per_writer=per_writer)
    marks = committed_log(client, bucket, "race")
    log = [int(m["version"][:19]) for m in marks]  # the token of each version made current
    _, data = S3VersionStore(client, bucket, lock=LOCK).read("race")
    bad = history_violations(log, data.decode())
    if sum(accepted) != len(marks) or not marks:
        bad.append(f"{sum(accepted)} publishes acknowledged, {len(marks)} committed")
    if len({m["version"] for m in marks}) != len(marks):
        bad.append("a version was made current twice")
    return bad


@pytest.mark.slow  # (dispatched first under xdist: tests/conftest.py)
def test_racing_publisher_processes_commit_in_token_order(
    moto_server: MotoServer, s3_bucket: tuple[Any, str]
) -> None:
    """Four processes publish interleaved tokens at once. The mark object's versions (bucket
    versioning) are the commit log: the versions made current never go down in token, each
    acknowledged publish is there once, and the current data is the highest token's."""
    assert race_violations(moto_server, *s3_bucket, "s3", 60) == []


@pytest.mark.slow  # (dispatched first under xdist: tests/conftest.py)
def test_the_race_check_catches_a_store_whose_mark_never_refuses(
    moto_server: MotoServer, s3_bucket: tuple[Any, str]
) -> None:
    assert any(
        "accepted after" in v for v in race_violations(moto_server, *s3_bucket, "s3-unfenced", 20)
    )
