"""DiLoCo through Bagua's door: ``model.with_bagua([inner], DiLoCoAlgorithm(...))``
runs :class:`ringlet.algorithms.DiLoCo` after each ``optimizer.step()``,
with no per-step gradient communication (ringlet's addition; Bagua has no
DiLoCo).

Example:
  >>> model = model.with_bagua([adamw], DiLoCoAlgorithm(sync_every=20, should_quantize=True))
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..bucket import BaguaBucket
from ..communication import BaguaProcessGroup
from .base import Algorithm, AlgorithmImpl, _no_op

__all__ = ["DiLoCoAlgorithm", "DiLoCoAlgorithmImpl"]


def _split(module: nn.Module, n: int) -> list[nn.Module]:
    """The module's parameters in ``n`` consecutive fragments of about equal
    size, each a module holding the same parameter objects."""
    named = list(module.named_parameters())
    if n > len(named):
        raise ValueError(f"DiLoCoAlgorithm: {n} fragments of a model with {len(named)} "
                         "parameters")
    total = max(sum(p.numel() for _, p in named), 1)
    at, place = 0, []
    for _, p in named:  # by size: the fragment where the parameter starts
        place.append(min(n - 1, at * n // total))
        at += p.numel()
    if len(set(place)) < n:  # one huge parameter: by count instead
        place = [i * n // len(named) for i in range(len(named))]
    frags: list[nn.Module] = [nn.Module() for _ in range(n)]
    for (name, p), k in zip(named, place):
        frags[k].register_parameter(name.replace(".", "_"), p)
    return frags


class DiLoCoAlgorithmImpl(AlgorithmImpl):
    """The implementation of :class:`DiLoCoAlgorithm` (its arguments)."""

    def __init__(self, process_group: BaguaProcessGroup, sync_every: int, *,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, fragments: int = 1,
                 **diloco: Any) -> None:
        super().__init__(process_group)
        self.sync_every = sync_every
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.fragments = fragments
        self.diloco_kwargs = diloco
        self.diloco: Optional[Any] = None

    def init_tensors(self, bagua_ddp: Any) -> list[torch.Tensor]:
        if self.diloco is None:
            from ...algorithms import DiLoCo

            if not bagua_ddp.bagua_optimizers:
                raise ValueError("DiLoCoAlgorithm needs the inner optimizer: "
                                 "with_bagua([optimizer], DiLoCoAlgorithm(...))")
            frags = _split(bagua_ddp.module, self.fragments)
            outers = [torch.optim.SGD(f.parameters(), lr=self.outer_lr,
                                      momentum=self.outer_momentum,
                                      nesterov=self.outer_momentum > 0) for f in frags]
            self.diloco = DiLoCo(frags, bagua_ddp.bagua_optimizers[0], outers,
                                 self.sync_every, group=self.process_group,
                                 **self.diloco_kwargs)
        return []  # nothing is communicated per step

    def tensors_to_buckets(self, tensors: list[list[Any]],
                           do_flatten: bool) -> list[BaguaBucket]:
        return []

    def init_backward_hook(self, bagua_ddp: Any) -> Callable[[str, torch.Tensor], None]:
        return _no_op

    def init_post_backward_hook(self, bagua_ddp: Any) -> Callable[[], None]:
        return _no_op

    def init_post_optimizer_step_hook(self, bagua_ddp: Any) -> Callable[[Any], None]:
        def hook(optimizer: Any) -> None:
            if self.diloco is not None and optimizer is self.diloco._local_optimizer:
                self.diloco._step_post_hook(optimizer, (), {})

        return hook


class DiLoCoAlgorithm(Algorithm):
    """DiLoCo (Streaming DiLoCo with ``fragments > 1``): each rank takes
    ``sync_every`` steps of its own optimizer (the inner one, passed to
    ``with_bagua``), then the ranks average the pseudo-gradient and an outer
    SGD with Nesterov momentum steps the global copy. See
    :class:`ringlet.algorithms.DiLoCo` for the schedule and the options.

    Args:
      sync_every (int): Inner steps per sync of a fragment, times ``fragments``.
      outer_lr (float): The outer SGD's learning rate. Default: 0.7.
      outer_momentum (float): Its Nesterov momentum (0: plain SGD). Default: 0.9.
      fragments (int): Consecutive fragments of the model's parameters, of
        about equal size. Default: 1.
      **diloco: ``should_quantize``, ``quantization``, ``error_feedback``,
        ``fragment_sync_delay``, ``fragment_update_alpha``, ``hierarchical``,
        as :class:`ringlet.algorithms.DiLoCo` takes them.

    Example:
      >>> model.with_bagua([adamw], DiLoCoAlgorithm(sync_every=20, quantization="int4"))
    """

    def __init__(self, sync_every: int, *, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                 fragments: int = 1, **diloco: Any) -> None:
        self.sync_every = sync_every
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.fragments = fragments
        self.diloco = diloco

    def reify(self, process_group: BaguaProcessGroup) -> DiLoCoAlgorithmImpl:
        return DiLoCoAlgorithmImpl(process_group, self.sync_every, outer_lr=self.outer_lr,
                                   outer_momentum=self.outer_momentum,
                                   fragments=self.fragments, **self.diloco)
