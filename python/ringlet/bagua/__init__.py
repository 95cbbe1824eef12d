"""The Bagua door: the tensor API, Bagua's algorithms, distributed data
parallel and communication hooks.

* :mod:`ringlet.bagua.tensor`: proxy tensors registered by name, buckets and
  ready-marking, installed as ``torch.Tensor`` methods (``ringlet_`` names).
* :mod:`ringlet.bagua.algorithms`: Bagua's communication algorithms
  (gradient all-reduce, ByteGrad, decentralized and low-precision
  decentralized SGD, QAdam, asynchronous averaging) and the extension API;
  ``model.with_ringlet(optimizers, algorithm)`` (``with_bagua`` with
  :mod:`ringlet.bagua.compat`) trains with one (:mod:`.data_parallel`), over
  :mod:`.communication`'s process groups and :mod:`.bucket`'s operations.
* :mod:`ringlet.bagua.ddp`: :class:`DistributedDataParallel` over those
  buckets.
* :mod:`ringlet.bagua.comm_hooks`: torch DDP communication hooks on ringlet.
* :mod:`ringlet.bagua.compat`: Bagua's own names (``bagua_`` tensor
  methods, ``with_bagua``, ``bagua.torch_api``'s functions and submodules);
  installed only when imported.

Example:
  >>> import torch, ringlet.bagua
  >>> t = torch.zeros(3).ensure_ringlet_tensor("t")
  >>> t.is_ringlet_tensor()
  True
"""

from . import (
    algorithms,
    bucket,
    comm_hooks,
    communication,
    data_parallel,
    ddp,
    env,
    tensor,
    utils,
)
from .ddp import DistributedDataParallel

__all__ = [
    "DistributedDataParallel",
    "algorithms",
    "bucket",
    "comm_hooks",
    "communication",
    "data_parallel",
    "ddp",
    "env",
    "tensor",
    "utils",
]
