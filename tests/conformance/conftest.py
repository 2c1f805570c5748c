"""Run the conformance suite once per token source: ``tests/envs/<name>.py`` provides each."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator

import pytest

from tests.envs.base import BackendEnv

ALL_SOURCES = [
    *("memory", "sqlite", "etcd", "zookeeper", "postgresql", "redis"),
    *("http_sqlite", "http_etcd", "http_postgresql"),  # the same, through `fenced serve`
]
SOURCES = [n for n in ALL_SOURCES if importlib.util.find_spec(f"tests.envs.{n}") is not None]


@pytest.fixture(params=SOURCES)
def env(request: pytest.FixtureRequest) -> Iterator[BackendEnv]:
    module = importlib.import_module(f"tests.envs.{request.param}")
    yield from module.make_env(request)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Keep one source's tests on one xdist worker, so each worker starts few servers.
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "env" in callspec.params:
            item.add_marker(pytest.mark.xdist_group(f"source-{callspec.params['env']}"))
