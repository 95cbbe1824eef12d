"""LocalSGD with torchft's names and semantics over any process group."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn, optim
from torch.utils.hooks import RemovableHandle

from ..core import engine
from ._sync import ArgumentError, HookedAlgorithm, OuterAverage, buckets_of, unique_params

__all__ = ["LocalSGD"]


class LocalSGD(HookedAlgorithm):
    """LocalSGD (Lin et al., 2018): every replica trains on its own and the
    parameters are averaged over the replicas every ``sync_every`` optimizer
    steps (after the step), in one engine operation per dtype.

    torchft's ``LocalSGD`` with a process group in place of its Manager. A
    replica lost during an average is named and the survivors finish it
    among themselves. Creating it is collective over the group: the
    replicas agree on ``sync_every`` and the parameters' sizes.

    Args:
      model (torch.nn.Module): Its contiguous CPU floating-point parameters
        are averaged.
      optimizer (torch.optim.Optimizer): The optimizer whose ``step`` counts.
      sync_every (int): Optimizer steps between averages (at least 1).
      group (torch.distributed.ProcessGroup, optional): The replicas (any
        backend). Default: the default group.
      hierarchical (bool): Average within each host first. Default: True.

    Example:
      >>> with LocalSGD(model, optimizer, sync_every=8):
      ...     for x, y in data:
      ...         loss_fn(model(x), y).backward()
      ...         optimizer.step()
      ...         optimizer.zero_grad()
    """

    def __init__(self, model: nn.Module, optimizer: optim.Optimizer, sync_every: int, *,
                 group: Any = None, hierarchical: bool = True) -> None:
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ArgumentError(f"sync_every must be greater than or equal to 1, got "
                                f"{sync_every!r}")
        self._model = model
        self._local_optimizer = optimizer
        self._sync_every = sync_every
        self._local_step = 0
        self._hooks: list[RemovableHandle] = []
        self._buckets = buckets_of(unique_params(model), None, "LocalSGD")
        self._outer = OuterAverage(group, "LocalSGD", hierarchical, None, False, self._buckets)
        self._outer.replicas.agree("LocalSGD's arguments", {
            "sync_every": sync_every,
            "parameters": [[b.name, b.numel] for b in self._buckets],
        })

    def __enter__(self) -> LocalSGD:
        self._hooks.append(self._local_optimizer.register_step_post_hook(self._step_post_hook))
        return self

    def _step_post_hook(self, _optim: optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._local_step += 1
        if self._local_step >= self._sync_every:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Averages the parameters over the replicas now.

        Example:
          >>> local_sgd.sync()
        """
        for b in self._buckets:
            engine.gather(b.params, b.pseudo)
        self._outer.start(self._buckets)
        self._outer.finish(self._buckets)
        for b in self._buckets:
            engine.scatter(b.avg, b.params)
        self._local_step = 0

