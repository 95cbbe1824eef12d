"""Bagua's ``bagua.torch_api.distributed``: :class:`BaguaModule`, the
methods Bagua adds to :class:`torch.nn.Module` (``with_bagua``,
``bagua_module_name``, ``bagua_algorithm``, ``bagua_optimizers``,
``bagua_buckets``).

As in Bagua, importing ``ringlet.bagua.compat`` installs them on every
module; :class:`BaguaModule` holds the same functions for code that names
the class (type hints, ``BaguaModule.with_bagua(model, ...)``). A model is
never an instance of it, in Bagua either.

Example:
  >>> from ringlet.bagua.compat.distributed import BaguaModule
  >>> model = BaguaModule.with_bagua(model, [opt], GradientAllReduceAlgorithm())
  >>> model.bagua_algorithm is model.bagua_ddp.bagua_algorithm
  True
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .bucket import BaguaBucket
from .data_parallel import BaguaDistributedDataParallel, with_ringlet

__all__ = ["BaguaDistributedDataParallel", "BaguaModule"]


def _ddp(module: Any) -> BaguaDistributedDataParallel:
    ddp = module.__dict__.get("bagua_ddp")
    if ddp is None:
        raise AttributeError(
            f"{type(module).__name__} is not wrapped: call with_bagua(optimizers, algorithm) first"
        )
    return ddp


class BaguaModule:
    """The methods Bagua patches onto :class:`torch.nn.Module` (Bagua's
    ``BaguaModule``); the same functions are on every ``torch.nn.Module``
    once ``ringlet.bagua.compat`` is imported.

    Example:
      >>> model = model.with_bagua([opt], bytegrad.ByteGradAlgorithm())
      >>> model.bagua_buckets
    """

    with_bagua = with_ringlet

    @property
    def bagua_module_name(self) -> Optional[str]:
        """The module's name for the tensor API (assignable)."""
        return self.__dict__.get("ringlet_module_name")

    @bagua_module_name.setter
    def bagua_module_name(self, name: str) -> None:
        self.__dict__["ringlet_module_name"] = name

    @property
    def bagua_algorithm(self) -> Any:
        """The algorithm implementation of the wrapped module."""
        return _ddp(self).bagua_algorithm

    @property
    def bagua_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers passed to ``with_bagua``."""
        return _ddp(self).bagua_optimizers

    @property
    def bagua_buckets(self) -> list[BaguaBucket]:
        """The module's buckets."""
        return _ddp(self).bagua_buckets
