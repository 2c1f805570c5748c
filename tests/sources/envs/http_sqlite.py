"""The sqlite source behind a ``fenced serve`` gateway (see tests/sources/envs/_http.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sources.envs._http import make_http_env
from tests.sources.envs.base import BackendEnv


def make_env(request: pytest.FixtureRequest) -> Iterator[BackendEnv]:
    yield from make_http_env(request, "sqlite")
