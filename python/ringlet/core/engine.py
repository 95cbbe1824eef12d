"""The engine on torch tensors: the native module's operations called with
CPU tensors instead of data pointers (the adapter the doors use; the older
adapter, ``ringlet._engine``, is to move here).

Every function takes contiguous CPU tensors the caller keeps alive for the
call, and blocks with the GIL released.

Example:
  >>> from ringlet.core import engine
  >>> engine.all_reduce(comm, torch.ones(4))       # in place, a sum
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import _core
from .._engine import _DTYPE_NAMES as DTYPE_NAMES

__all__ = ["DTYPE_NAMES", "all_reduce", "apply", "broadcast", "dtype_name", "gather",
           "outer_sync", "pseudo_gradient", "scatter", "span"]


def dtype_name(t: torch.Tensor) -> str:
    """The engine's name of ``t``'s dtype (``"float32"``, ...); TypeError for
    a dtype the engine does not carry."""
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(f"ringlet's engine does not carry {t.dtype} tensors") from None


def span(t: torch.Tensor) -> tuple[int, int]:
    """``t``'s (data pointer, bytes)."""
    return t.data_ptr(), t.numel() * t.element_size()


def all_reduce(comm: Any, t: torch.Tensor, op: str = "sum") -> None:
    """``t`` reduced over ``comm``'s ranks, in place.

    Args:
      comm (ringlet._core.Communicator): The ranks.
      t (torch.Tensor): Contiguous CPU tensor.
      op (str): ``"sum"``, ``"min"``, ``"max"``, ...

    Example:
      >>> all_reduce(comm, flags, "sum")
    """
    comm.all_reduce(t.data_ptr(), t.numel() * t.element_size(), dtype_name(t), op)


def broadcast(comm: Any, t: torch.Tensor, root: int) -> None:
    """``t`` of ``comm``'s rank ``root`` on every rank, in place.

    Example:
      >>> broadcast(comm, weights, 0)
    """
    comm.broadcast(t.data_ptr(), t.numel() * t.element_size(), dtype_name(t), root)


def apply(op: Any, t: torch.Tensor, key: int) -> None:
    """A bucket operation (``CentralizedOp``, ...) on ``t``, in place.

    Example:
      >>> apply(centralized_op, bucket, 0)
    """
    op.apply(t.data_ptr(), t.numel() * t.element_size(), dtype_name(t), key)


def gather(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """``params`` one after the other into ``flat``.

    Example:
      >>> gather(list(model.parameters()), flat)
    """
    _core.flat_gather([span(p) for p in params], span(flat))


def scatter(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Consecutive pieces of ``flat`` into ``params``.

    Example:
      >>> scatter(flat, list(model.parameters()))
    """
    _core.flat_scatter(span(flat), [span(p) for p in params])


def pseudo_gradient(glob: torch.Tensor, params: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out = glob - concat(params)`` (DiLoCo's pseudo-gradient).

    Example:
      >>> pseudo_gradient(global_copy, params, pseudo)
    """
    _core.pseudo_gradient(span(glob), [span(p) for p in params], span(out), dtype_name(glob))


def outer_sync(comms: Any, pseudo: torch.Tensor, avg: torch.Tensor,
               compression: Optional[str], error_feedback: bool) -> Any:
    """The engine's outer average of ``pseudo`` into ``avg`` over ``comms``
    (started with ``start()``, finished with ``wait()``); the tensors are
    kept alive by it.

    Example:
      >>> s = outer_sync(comms, pseudo, avg, "MinMaxUInt8", False); s.start(); s.wait()
    """
    return _core.OuterSync(comms, dtype_name(pseudo), (*span(pseudo), pseudo),
                           (*span(avg), avg), compression, error_feedback)
