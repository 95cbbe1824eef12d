"""Bagua's ``bagua.torch_api.data_parallel.bagua_distributed``: the
:class:`BaguaDistributedDataParallel` behind ``with_bagua`` and the
``inner`` of :class:`ringlet.bagua.data_parallel.DistributedDataParallel`.

Example:
  >>> from ringlet.bagua.compat.data_parallel.bagua_distributed import (
  ...     BaguaDistributedDataParallel)
  >>> isinstance(model.with_bagua([opt], algorithm).bagua_ddp, BaguaDistributedDataParallel)
  True
"""

from __future__ import annotations

from . import BaguaDistributedDataParallel

__all__ = ["BaguaDistributedDataParallel"]
