"""The torch_xla door: ``xla_model``'s collectives and helpers, SPMD sharding, sharded tensors.

* :mod:`ringlet.xla.xla_model`: torch_xla's ``torch_xla.core.xla_model``
  collectives and helpers over ringlet's engine (also exported from here and
  from the package root: ``ringlet.all_reduce``, ...).
* :mod:`ringlet.xla.sharding`: torch_xla's SPMD API in one import; built from
  :mod:`ringlet.xla.mesh` (the mesh and partition-spec algebra, no
  communication) and :mod:`ringlet.xla.sharded_tensor` (eager sharded tensors).
  Imported on first use, not by ``import ringlet``.

Example:
    >>> import torch
    >>> import ringlet.xla as xm
    >>> xm.all_reduce(xm.REDUCE_SUM, torch.ones(3))   # on every rank of the job
"""

from .xla_model import *  # noqa: F403  (the xla_model API, as torch_xla's xm)
from .xla_model import __all__ as __all__
