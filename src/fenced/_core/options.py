"""Options of a token source, from its URL query and from keywords, merged and checked once.

Each backend declares a schema (option name -> :class:`Option`); :func:`merge_options` reads
the URL query strictly, lets keyword options override it, refuses unknown names and values
of the wrong type or range with one-line :class:`~fenced.ConfigurationError`\\s, and returns
every option of the schema (defaults filled in). So a bad option is the caller's error at
``connect()``, never a client library's error (or a ``BackendUnavailable``) later.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal
from urllib.parse import parse_qsl

from .errors import ConfigurationError

__all__ = ["SECRET_QUERY_KEYS", "Option", "merge_options", "parse_query"]

Kind = Literal["number", "int", "bool", "str"]

_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"0", "false", "no", "off"})


@dataclasses.dataclass(frozen=True, slots=True)
class Option:
    """One option: its kind, default, bounds and an extra check.

    ``low``/``high`` bound numbers (``low_open``: strictly above ``low``); ``check`` returns
    what is wrong with a value of the right kind, or None. ``default=None`` with
    ``required=False`` means "not set": the option is then left out of the result.
    """

    kind: Kind
    default: Any = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    check: Callable[[Any], str | None] | None = None

    def convert(self, value: object, *, text: bool = False) -> Any:
        """``value`` as this option's kind, or raise ValueError saying what it must be.

        ``text=True`` for values from a URL query, which are parsed; a keyword value must
        already have the right Python type (``"false"`` is not a bool: it is truthy).
        """
        if not text and self.kind != "str" and isinstance(value, str):
            raise ValueError(
                f"must be {'True or False' if self.kind == 'bool' else 'a number'}, not text"
            )
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
                return value.lower() in _TRUE
            raise ValueError("must be true or false")
        if self.kind == "str":
            if not isinstance(value, str):
                raise ValueError("must be text")
            number: Any = value
        elif isinstance(value, bool):
            raise ValueError(f"must be {'an integer' if self.kind == 'int' else 'a number'}")
        elif self.kind == "int":
            if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
                value = int(value)
            if not isinstance(value, int):
                raise ValueError("must be an integer")
            number = value
        else:
            try:
                number = float(value) if isinstance(value, (str, int, float)) else None
            except ValueError:
                number = None
            if number is None or not math.isfinite(number):
                raise ValueError("must be a finite number")
        if self.kind in ("int", "number"):
            if self.low is not None and (
                number < self.low or (self.low_open and number == self.low)
            ):
                raise ValueError(f"must be {'>' if self.low_open else '>='} {self.low:g}")
            if self.high is not None and number > self.high:
                raise ValueError(f"must be <= {self.high:g}")
        if self.check is not None:
            problem = self.check(number)
            if problem:
                raise ValueError(problem)
        return number


SECRET_QUERY_KEYS: Final = frozenset(
    {"password", "pass", "pwd", "sslpassword", "api_key", "apikey", "token", "secret"}
)
"""Query parameters whose value is a secret (libpq's password/sslpassword, the http://
source's api_key), masked wherever a URL is shown and refused in a URL file others may read."""


def parse_query(scheme: str, query: str) -> dict[str, str]:
    """A URL query as a dict; malformed or repeated parameters are ConfigurationErrors."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        # (not shown: it may hold api_key=... or password=..., or be a secret pasted alone)
        raise ConfigurationError(
            f"malformed {scheme}:// URL query: each parameter is name=value, joined by &"
        ) from None
    out: dict[str, str] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigurationError(f"{scheme}:// URL option {key!r} is given twice")
        out[key] = value
    return out


def merge_options(
    scheme: str,
    schema: Mapping[str, Option],
    query: Mapping[str, str],
    given: Mapping[str, Any],
) -> dict[str, Any]:
    """Every option of ``schema``: from ``given`` (keywords), else the URL query, else default.

    Options whose default is None and that were not given are left out.
    """
    unknown = sorted((set(query) | set(given)) - set(schema))
    if unknown:
        known = ", ".join(sorted(schema)) or "none"
        raise ConfigurationError(
            f"unknown {scheme}:// option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}; known: {known}"
        )
    out: dict[str, Any] = {}
    for name, option in schema.items():
        if name in given:
            raw, where, text = given[name], "keyword", False
        elif name in query:
            raw, where, text = query[name], "URL", True
        elif option.default is None:
            continue
        else:
            out[name] = option.default
            continue
        try:
            out[name] = option.convert(raw, text=text)
        except ValueError as exc:
            raise ConfigurationError(
                f"{scheme}:// option {name}={_show(name, raw)} ({where}): {exc}"
            ) from None
    return out


def _show(name: str, value: object) -> str:
    # Never echo a secret into an error message (and from there into logs).
    secret = name in SECRET_QUERY_KEYS or "password" in name or "secret" in name
    return "'***'" if secret else repr(value)[:60]
