"""Bagua's tensor API names on top of ringlet.

Importing this module adds to :class:`torch.Tensor` the exact method names of
``bagua.torch_api.tensor.BaguaTensor`` (``ensure_bagua_tensor``,
``to_bagua_tensor``, ``is_bagua_tensor``, ``bagua_getter_closure``,
``bagua_setter_closure``, ``bagua_backend_tensor``, ``bagua_ensure_grad``,
``bagua_mark_communication_ready``,
``bagua_mark_communication_ready_without_synchronization``,
``bagua_set_storage``), each the same function as its ``ringlet_`` twin; the
attributes Bagua sets on a tensor (``bagua_tensor_name``, ``""`` when no name
was given, ``bagua_module_name`` and ``bagua_backend``, the tensor's
:class:`ringlet.tensor.TensorModule` or ``None``), readable on every ringlet
tensor and absent on others; and ``bagua_module_name`` to
:class:`torch.nn.Module` (an alias of ``ringlet_module_name``, assignable), so
code written for Bagua's tensor API runs unchanged.

It also stands for ``bagua.torch_api`` itself, so Bagua code runs after
replacing ``import bagua.torch_api as bagua`` with ``import
ringlet.compat.bagua as bagua``: ``init_process_group``, ``get_rank``,
``get_world_size``, ``get_local_rank``, ``get_local_size``, the collectives
and ``ReduceOp``, and the submodules ``algorithms`` (with ``base``,
``gradient_allreduce``, ``bytegrad``, ``decentralized``, ``q_adam``,
``async_model_average``), ``communication``, ``bucket``, ``env``,
``utils``, ``tensor`` and ``data_parallel``, importable under this name
(``from ringlet.compat.bagua.algorithms.q_adam import QAdamOptimizer``);
and ``with_bagua`` with ``bagua_algorithm``, ``bagua_buckets`` and
``bagua_optimizers`` on :class:`torch.nn.Module`.

Example:
  >>> import torch, ringlet.compat.bagua
  >>> t = torch.zeros(3).ensure_bagua_tensor("t")
  >>> t.is_bagua_tensor(), t.is_ringlet_tensor()
  (True, True)
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch

from . import algorithms, bucket, communication, data_parallel, env, tensor, utils
from .communication import (
    ReduceOp,
    allgather,
    allgather_inplace,
    allreduce,
    allreduce_inplace,
    alltoall,
    alltoall_inplace,
    alltoall_v,
    alltoall_v_inplace,
    barrier,
    broadcast,
    gather,
    gather_inplace,
    get_backend,
    init_process_group,
    recv,
    reduce,
    reduce_inplace,
    reduce_scatter,
    reduce_scatter_inplace,
    scatter,
    scatter_inplace,
    send,
)
from .env import get_local_rank, get_local_size, get_rank, get_world_size
from .tensor import (
    Getter,
    Setter,
    _reensure,
    _registered_module,
    ensure_ringlet_tensor,
    install,
    is_ringlet_tensor,
)

__all__ = [
    "ReduceOp",
    "algorithms",
    "allgather",
    "allgather_inplace",
    "allreduce",
    "allreduce_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "barrier",
    "broadcast",
    "bucket",
    "communication",
    "data_parallel",
    "env",
    "gather",
    "gather_inplace",
    "get_backend",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "recv",
    "reduce",
    "reduce_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "scatter",
    "scatter_inplace",
    "send",
    "tensor",
    "utils",
]


class _TensorAttribute:
    """A read-only view of a ringlet tensor's state, as the attribute Bagua
    sets on the tensor. Absent (``AttributeError``) on other tensors; an
    assignment stores a plain attribute that hides it, as in Bagua."""

    def __init__(self, read: Callable[[torch.Tensor], Any]) -> None:
        self._read = read
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: Optional[torch.Tensor], owner: Optional[type] = None) -> Any:
        if obj is None:
            return self
        if not is_ringlet_tensor(obj):
            raise AttributeError(
                f"'{type(obj).__name__}' object has no attribute '{self._name}' "
                "(not a ringlet tensor: call ensure_bagua_tensor() first)"
            )
        return self._read(obj)


_ATTRIBUTES = {
    "bagua_tensor_name": _TensorAttribute(lambda t: t._ringlet_given_name),
    "bagua_module_name": _TensorAttribute(lambda t: t._ringlet_module_name),
    "bagua_backend": _TensorAttribute(_registered_module),
}


def _get_module_name(self: torch.nn.Module) -> Optional[str]:
    """The module's name for the tensor API (``ringlet_module_name``)."""
    return self.__dict__.get("ringlet_module_name")


def _set_module_name(self: torch.nn.Module, value: Optional[str]) -> None:
    self.ringlet_module_name = value


def _del_module_name(self: torch.nn.Module) -> None:
    self.__dict__.pop("ringlet_module_name", None)


def ensure_bagua_tensor(
    self: torch.Tensor,
    name: Optional[str] = None,
    module_name: Optional[str] = None,
    getter_closure: Optional[Getter] = None,
    setter_closure: Optional[Setter] = None,
) -> torch.Tensor:
    """Bagua's ``ensure_bagua_tensor``: :func:`ringlet.tensor.ensure_ringlet_tensor`
    with Bagua's rule for a tensor that already is one: the closures are set
    to the ones given, ``None`` being the identity getter and no setter
    (``ensure_ringlet_tensor`` keeps a closure passed as ``None``).

    Args:
      name (str, optional): The tensor's unique name; must not change.
      module_name (str, optional): Its module; must not change.
      getter_closure (Callable, optional): Proxy -> effective tensor. Default:
        ``None``, the identity.
      setter_closure (Callable, optional): ``(proxy, new_tensor) -> None``.
        Default: ``None``, none.

    Returns:
      torch.Tensor: ``self``.

    Example:
      >>> p.ensure_bagua_tensor("w", getter_closure=lambda t: t.grad) is p
      True
      >>> p.ensure_bagua_tensor("w").bagua_getter_closure() is p   # the identity again
      True
    """
    if is_ringlet_tensor(self):
        _reensure(self, name, module_name, getter_closure, setter_closure, keep=False)
        return self
    return ensure_ringlet_tensor(self, name, module_name, getter_closure, setter_closure)


install("bagua")
torch.Tensor.ensure_bagua_tensor = ensure_bagua_tensor  # type: ignore[attr-defined]
for _name, _attr in _ATTRIBUTES.items():
    _attr.__set_name__(torch.Tensor, _name)
    setattr(torch.Tensor, _name, _attr)
torch.nn.Module.bagua_module_name = property(  # type: ignore[attr-defined]
    _get_module_name, _set_module_name, _del_module_name, _get_module_name.__doc__
)
data_parallel.install("bagua")

# Bagua's submodules under this module's names (both of them), so
# ``from ringlet.compat.bagua.algorithms.q_adam import QAdamOptimizer``
# finds ringlet's modules.
_SUBMODULES = {
    "algorithms": algorithms,
    "algorithms.base": algorithms.base,
    "algorithms.gradient_allreduce": algorithms.gradient_allreduce,
    "algorithms.bytegrad": algorithms.bytegrad,
    "algorithms.decentralized": algorithms.decentralized,
    "algorithms.q_adam": algorithms.q_adam,
    "algorithms.async_model_average": algorithms.async_model_average,
    "bucket": bucket,
    "communication": communication,
    "data_parallel": data_parallel,
    "env": env,
    "tensor": tensor,
    "utils": utils,
}
for _home in ("ringlet.bagua.compat", "ringlet.compat.bagua"):
    for _rel, _mod in _SUBMODULES.items():
        sys.modules.setdefault(f"{_home}.{_rel}", _mod)
