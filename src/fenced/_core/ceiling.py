"""A guard's ``verify=`` that asks the token source instead of checking a signature.

Apart from :mod:`fenced._core.signing` because it makes tokens to ask with, and the token module
stands on the signing module's text forms: the one order is signing, token, ceiling.
"""

from __future__ import annotations

from typing import Protocol

from .backend import TokenCheck
from .errors import ConfigurationError, InvalidTokenError
from .signing import Signature
from .token import FencingToken

__all__ = ["AboveCeilingError", "Ceiling", "CheckingSource"]


class CheckingSource(Protocol):
    """What a :class:`Ceiling` asks: a connection (``fenced.connect(...)``) whose
    ``check(token)`` says the highest grant of the token's lock."""

    def check(self, token: FencingToken) -> TokenCheck: ...


class AboveCeilingError(InvalidTokenError):
    """A token further above the source's highest grant of its lock than a
    :class:`Ceiling` allows (or a token the source cannot vouch for at all)."""


class Ceiling:
    """Refuse a token more than ``slack`` above the highest grant the token source has made
    for its lock: for resources that cannot hold a signing key. An unsigned token then cannot
    raise a mark far beyond what the source issued (the permanent outage a huge forged token
    causes), at the price of asking the source when a token is above the highest it has seen
    (``source.check``: a round trip, on the guard's thread; async guards are briefly blocked).
    When the source cannot say (etcd and ZooKeeper forget a free lock's highest grant), the
    token is refused: when in doubt, fail closed.

    ``slack`` > 0 accepts tokens a little ahead of the last answer without asking again.
    Weaker than signing: a token up to ``slack`` above a real grant still passes, and a writer
    that can reach the source can still get real tokens.
    """

    def __init__(self, source: CheckingSource, *, slack: int = 0) -> None:
        if isinstance(slack, bool) or not isinstance(slack, int) or slack < 0:
            raise ConfigurationError(f"slack must be an int >= 0, not {slack!r}")
        self._source = source
        self.slack = slack
        self._highest: dict[str, int] = {}

    def verify(self, lock: str, value: int, signature: Signature | None) -> None:
        if value <= self._highest.get(lock, 0) + self.slack:
            return
        # With its signature: a source that signs refuses an unsigned token in check().
        result = self._source.check(FencingToken(lock, value, signature))
        if result.highest is not None:
            self._highest[lock] = max(self._highest.get(lock, 0), result.highest.value)
        if result.highest is None or value > result.highest.value + self.slack:
            known = "unknown" if result.highest is None else str(result.highest)
            raise AboveCeilingError(
                f"fencing token {lock}:{value} is above the highest the source granted "
                f"({known}) by more than {self.slack}"
            )

    def __repr__(self) -> str:
        return f"Ceiling(slack={self.slack})"
