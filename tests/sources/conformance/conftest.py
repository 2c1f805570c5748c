"""Run the conformance suite once per token source: ``tests/sources/envs/<name>.py`` provides each."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator

import pytest

from tests.sources.envs.base import BackendEnv

ALL_SOURCES = [
    *("memory", "sqlite", "etcd", "zookeeper", "postgresql", "redis"),
    *("http_sqlite", "http_etcd", "http_postgresql"),  # the same, through `fenced serve`
]
SOURCES = [
    n for n in ALL_SOURCES if importlib.util.find_spec(f"tests.sources.envs.{n}") is not None
]
# The sources the sync API drives by the caller (the portal's fast mode) run once more with
# that mode forced off: the portal's portable mode, public asyncio only (``_portal``).
PORTABLE = [f"{n}+portable" for n in ("memory", "sqlite") if n in SOURCES]


@pytest.fixture(params=[*SOURCES, *PORTABLE])
def env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[BackendEnv]:
    name, _, portal = str(request.param).partition("+")
    if portal:
        monkeypatch.setenv("FENCED_PORTAL", portal)
    module = importlib.import_module(f"tests.sources.envs.{name}")
    yield from module.make_env(request)


# (Each source's tests are one xdist group: tests/conftest.py, pytest_itemcollected.)
