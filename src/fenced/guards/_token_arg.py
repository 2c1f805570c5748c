"""One convention for every guard: the token is the keyword argument ``token=``, and the
lock whose tokens a guard accepts is the constructor's keyword argument ``lock=``.

fenced 0.1 took the token by position, in different places (``check(conn, token)``,
``set(key, value, token)``, ``publish(name, token, data)``), and the Redis, etcd and ZooKeeper
guards their lock as a third positional argument. :func:`token_keyword` and
:func:`lock_keyword` let a method whose ``token`` (a constructor whose ``lock``) is now
keyword-only still take it the old way for one release, with a :class:`DeprecationWarning`
that names the call to change. (``fence(token)``, what ``fence=`` on acquire calls, takes its
token by position: it is the method's one subject, and the core calls it so.)
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["lock_keyword", "token_keyword", "warn_positional"]

F = TypeVar("F", bound=Callable[..., Any])

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def token_keyword(*old_tail: str) -> Callable[[F], F]:
    """Accept 0.1's positional ``token`` (followed by the ``old_tail`` parameters, which were
    positional too) after the method's positional parameters, with a DeprecationWarning."""
    return _keyword_from("token", old_tail, "the fencing token")


def lock_keyword() -> Callable[[F], F]:
    """Accept 0.1's positional ``lock`` after a guard constructor's positional parameters
    (the client and the resource), with a DeprecationWarning."""
    return _keyword_from("lock", (), "the lock name")


def _keyword_from(first: str, old_tail: tuple[str, ...], what: str) -> Callable[[F], F]:
    def decorate(fn: F) -> F:
        params = list(inspect.signature(fn).parameters.values())[1:]  # (without self)
        n = sum(1 for p in params if p.kind in _POSITIONAL)
        names = (first, *old_tail)
        qualname = fn.__qualname__.removesuffix(".__init__")

        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if len(args) > n:
                extra, args = args[n:], args[:n]
                if len(extra) > len(names):
                    raise TypeError(f"{qualname}() takes {n} positional arguments and {first}=...")
                for name, value in zip(names, extra, strict=False):
                    if name in kwargs:
                        raise TypeError(f"{qualname}() got multiple values for {name!r}")
                    kwargs[name] = value
                warn_positional(qualname, first, what)
            return fn(self, *args, **kwargs)

        if inspect.iscoroutinefunction(fn) and hasattr(inspect, "markcoroutinefunction"):
            inspect.markcoroutinefunction(wrapper)  # (Python 3.12+)
        return wrapper  # type: ignore[return-value]

    return decorate


def warn_positional(qualname: str, name: str = "token", what: str = "the fencing token") -> None:
    warnings.warn(
        f"{qualname}(): pass {what} as {name}=...; a positional {name} is "
        "deprecated and will be refused in fenced 0.3",
        DeprecationWarning,
        stacklevel=3,
    )
