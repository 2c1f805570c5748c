"""One convention for every guard: the token is the keyword argument ``token=``.

fenced 0.1 took it by position, in different places (``check(conn, token)``,
``set(key, value, token)``, ``publish(name, token, data)``). :func:`token_keyword` lets a
method whose ``token`` is now keyword-only still take it the old way for one release, with a
:class:`DeprecationWarning` that names the call to change.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["token_keyword"]

F = TypeVar("F", bound=Callable[..., Any])

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def token_keyword(*old_tail: str) -> Callable[[F], F]:
    """Accept 0.1's positional ``token`` (followed by the ``old_tail`` parameters, which were
    positional too) after the method's positional parameters, with a DeprecationWarning."""

    def decorate(fn: F) -> F:
        params = list(inspect.signature(fn).parameters.values())[1:]  # (without self)
        n = sum(1 for p in params if p.kind in _POSITIONAL)
        names = ("token", *old_tail)

        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if len(args) > n:
                extra, args = args[n:], args[:n]
                if len(extra) > len(names):
                    raise TypeError(
                        f"{fn.__qualname__}() takes {n} positional arguments and token=..."
                    )
                for name, value in zip(names, extra, strict=False):
                    if name in kwargs:
                        raise TypeError(f"{fn.__qualname__}() got multiple values for {name!r}")
                    kwargs[name] = value
                warn_positional(fn.__qualname__)
            return fn(self, *args, **kwargs)

        if inspect.iscoroutinefunction(fn) and hasattr(inspect, "markcoroutinefunction"):
            inspect.markcoroutinefunction(wrapper)  # (Python 3.12+)
        return wrapper  # type: ignore[return-value]

    return decorate


def warn_positional(qualname: str) -> None:
    warnings.warn(
        f"{qualname}(): pass the fencing token as token=...; a positional token is "
        "deprecated and will be refused in fenced 0.3",
        DeprecationWarning,
        stacklevel=3,
    )
