"""Bagua's ``bagua.torch_api.contrib`` on ringlet:

* :func:`fuse_optimizer` (:mod:`.fuse.optimizer`): any optimizer updates
  adjacent parameters as one tensor with ``optimizer.fuse_step()``.
* :class:`LoadBalancingDistributedSampler` and
  :class:`LoadBalancingDistributedBatchSampler`
  (:mod:`.load_balancing_data_loader`): ranks get samples of balanced
  complexity, Bagua's partition exactly.
* :class:`CacheLoader` and :class:`CachedDataset`: a cache of computed values
  and samples; ``backend="local"`` (in-process, the default here) or
  ``"redis"`` (needs the ``redis`` package and running servers).

``contrib.sync_batchnorm`` is not provided: importing it raises
``ImportError`` naming ``torch.nn.SyncBatchNorm`` over
``torch.distributed.init_process_group("ringlet")``.

Example:
  >>> import ringlet.bagua.compat as bagua
  >>> optimizer = bagua.contrib.fuse_optimizer(optimizer)
"""

from . import cache_loader, cached_dataset, fuse, load_balancing_data_loader, utils
from .cache_loader import CacheLoader
from .cached_dataset import CachedDataset
from .fuse.optimizer import fuse_optimizer
from .load_balancing_data_loader import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
)

__all__ = [
    "CacheLoader",
    "CachedDataset",
    "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler",
    "cache_loader",
    "cached_dataset",
    "fuse",
    "fuse_optimizer",
    "load_balancing_data_loader",
    "utils",
]
