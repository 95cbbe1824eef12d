"""Decorators for RPC target functions (``torch.distributed.rpc.functions``)."""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Marks ``fn`` as returning a ``torch.futures.Future``: the callee
    answers when that future completes, and the request thread is free in
    between (so a function can wait on nested RPCs without holding a thread).

    Args:
      fn (Callable): A function that returns a ``torch.futures.Future``.

    Returns:
      The wrapped function (it still returns the future when called locally).

    Example::

        >>> @rpc.functions.async_execution
        ... def async_add_chained(to, x, y, z):
        ...     return rpc.rpc_async(to, torch.add, args=(x, y)).then(
        ...         lambda fut: fut.wait() + z)
        >>> rpc.rpc_sync("worker1", async_add_chained,
        ...              args=("worker2", torch.ones(2), 1, 1))  # tensor([3., 3.])
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    # The attribute torch uses, so functions decorated with either module work.
    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
