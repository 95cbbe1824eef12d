"""ringlet's own data parallelism: the tensor API, distributed data parallel
and torch DDP communication hooks, over the engine layer (:mod:`ringlet.core`).

* :mod:`ringlet.parallel.tensor`: proxy tensors registered by name, buckets
  and ready-marking, installed as ``torch.Tensor`` methods (``ringlet_``
  names) when imported.
* :mod:`ringlet.parallel.ddp`: :class:`DistributedDataParallel`, gradients
  all-reduced in buckets while backward runs.
* :mod:`ringlet.parallel.comm_hooks`: torch DDP communication hooks on ringlet.

Bagua's look-alike (:mod:`ringlet.bagua`) is built on these and sits above
them: this package never imports it (``DistributedDataParallel``'s
``algorithm`` argument uses what ``import ringlet.bagua`` installs, see
:func:`ringlet.parallel.ddp.set_algorithm_wrapper`). Their earlier paths
``ringlet.bagua.tensor``, ``ringlet.bagua.ddp`` and ``ringlet.bagua.comm_hooks``
are deprecated.

Example:
  >>> import torch, ringlet.parallel
  >>> t = torch.zeros(3).ensure_ringlet_tensor("t")
  >>> t.is_ringlet_tensor()
  True
"""

from . import comm_hooks, ddp, tensor
from .ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel", "comm_hooks", "ddp", "tensor"]
