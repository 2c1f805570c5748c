"""A planted gateway bug, for tests/server/test_server_gateways.py: the etcd source unable to resume
a grant made through another gateway (so a holder whose gateway died loses its grant)."""

from __future__ import annotations

from typing import Any

import fenced
from fenced._core.backend import Grant
from fenced.backends.etcd import EtcdBackend


class NoResumeEtcd(EtcdBackend):
    async def resume(self, name: str, token: Any, request_id: str, ttl: float) -> Grant:
        raise fenced.LeaseLostError("planted: this gateway cannot resume grants")
