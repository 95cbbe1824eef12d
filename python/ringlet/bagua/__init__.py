"""The Bagua door: the tensor API, distributed data parallel and communication hooks.

* :mod:`ringlet.bagua.tensor`: proxy tensors registered by name, buckets and
  ready-marking, installed as ``torch.Tensor`` methods (``ringlet_`` names;
  also ``ringlet.tensor``).
* :mod:`ringlet.bagua.ddp`: :class:`DistributedDataParallel` over those
  buckets (also ``ringlet.ddp``).
* :mod:`ringlet.bagua.comm_hooks`: torch DDP communication hooks on ringlet
  (also ``ringlet.comm_hooks``).
* :mod:`ringlet.bagua.compat`: Bagua's own ``bagua_`` names on ``torch.Tensor``;
  installed only when imported (also ``ringlet.compat.bagua``).

Example:
    >>> import torch, ringlet.bagua
    >>> t = torch.zeros(3).ensure_ringlet_tensor("t")
    >>> t.is_ringlet_tensor()
    True
"""

from . import comm_hooks, ddp, tensor
from .ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel", "comm_hooks", "ddp", "tensor"]
