"""Bagua's tensor API names on top of ringlet.

Importing this module adds to :class:`torch.Tensor` the exact method names of
``bagua.torch_api.tensor.BaguaTensor`` (``ensure_bagua_tensor``,
``to_bagua_tensor``, ``is_bagua_tensor``, ``bagua_getter_closure``,
``bagua_setter_closure``, ``bagua_backend_tensor``, ``bagua_ensure_grad``,
``bagua_mark_communication_ready``,
``bagua_mark_communication_ready_without_synchronization``,
``bagua_set_storage``), each the same function as its ``ringlet_`` twin, and
``bagua_module_name`` to :class:`torch.nn.Module` (an alias of
``ringlet_module_name``), so code written for Bagua's tensor API runs unchanged.

Example:
  >>> import torch, ringlet.compat.bagua
  >>> t = torch.zeros(3).ensure_bagua_tensor("t")
  >>> t.is_bagua_tensor(), t.is_ringlet_tensor()
  (True, True)
"""

from __future__ import annotations

from typing import Optional

import torch

from ..tensor import install

__all__: list[str] = []


def _bagua_module_name(self: torch.nn.Module) -> Optional[str]:
    """The module's name for the tensor API (``ringlet_module_name``)."""
    return self.__dict__.get("ringlet_module_name")


install("bagua")
torch.nn.Module.bagua_module_name = property(_bagua_module_name)  # type: ignore[attr-defined]
