"""Bagua's ``bagua.torch_api.utils``: flattening helpers.

Example:
  >>> from ringlet.bagua.compat.utils import flatten, unflatten
  >>> flat = flatten([torch.ones(2), torch.zeros(3)])
  >>> [t.shape for t in unflatten(flat, [torch.ones(2), torch.zeros(3)])]
  [torch.Size([2]), torch.Size([3])]
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .bucket import check_contiguous, get_flattened_tensor

__all__ = [
    "apply_flattened_call",
    "apply_flattened_call_all",
    "check_contiguous",
    "flatten",
    "get_flattened_tensor",
    "to_bagua_datatype",
    "unflatten",
]

flatten = _flatten_dense_tensors
unflatten = _unflatten_dense_tensors


def apply_flattened_call(bucket: list[torch.Tensor], call: Callable[..., Any],
                         extra_args: Optional[tuple[Any, ...]] = None) -> None:
    """Calls ``call`` on the tensors flattened into one, then copies the
    result back into them (averaged over the world when ``call`` is
    ``torch.distributed.all_reduce``, as in Bagua).

    Args:
      bucket (list[torch.Tensor]): Tensors of one dtype.
      call (Callable): Gets the flat tensor (and ``extra_args``).
      extra_args (tuple, optional): More arguments for ``call``.
    """
    coalesced = flatten(bucket)
    if extra_args is not None:
        call(coalesced, *extra_args)
    else:
        call(coalesced)
    import torch.distributed as dist

    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    for buf, synced in zip(bucket, unflatten(coalesced, bucket)):
        buf.copy_(synced)


def apply_flattened_call_all(tensors: list[torch.Tensor], call: Callable[..., Any]) -> None:
    """:func:`apply_flattened_call` on each group of tensors of one type.

    Args:
      tensors (list[torch.Tensor]): The tensors.
      call (Callable): Gets each flat tensor.
    """
    groups: OrderedDict[str, list[torch.Tensor]] = OrderedDict()
    for t in tensors:
        groups.setdefault(t.type(), []).append(t)
    for group in groups.values():
        apply_flattened_call(group, call)


def to_bagua_datatype(datatype: torch.dtype) -> str:
    """Bagua's short dtype names (``"f32"``, ``"f16"``, ``"u8"``, ``"i64"``).

    Args:
      datatype (torch.dtype): The dtype.

    Returns:
      str: Its name.

    Raises:
      ValueError: Another dtype.
    """
    names = {torch.float32: "f32", torch.float16: "f16", torch.uint8: "u8", torch.long: "i64"}
    if datatype not in names:
        raise ValueError(f"unsupported data type {datatype}.")
    return names[datatype]
