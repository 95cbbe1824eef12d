"""Data-parallel training: gradients all-reduced in buckets while backward runs.

:class:`DistributedDataParallel` registers every trainable parameter as a
ringlet proxy tensor whose effective tensor is its gradient
(``getter_closure=lambda p: p.grad``), groups them into buckets in reverse
registration order (roughly the order backward produces gradients), and marks
each gradient ready from a post-accumulate-grad hook, so each bucket is
averaged by the module's worker thread as soon as it is complete, overlapping
the rest of backward.

The wait cannot be forgotten: an autograd callback queued at the first
gradient of each backward runs when backward finishes, marks the parameters
that got no gradient (with zero gradients, so no rank hangs) and waits for
every bucket. ``loss.backward()`` therefore returns with averaged gradients,
ready for any optimizer.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from ..core import engine, groups
from .tensor import get_module, new_communicator

__all__ = ["DistributedDataParallel", "set_algorithm_wrapper"]

_names = itertools.count()

# Wraps a model to train through an algorithm (``algorithm=``): Bagua's algorithms
# live in ringlet.bagua, a layer above this package, which installs it on import.
_algorithm_wrapper: Optional[Callable[..., Any]] = None


def set_algorithm_wrapper(wrapper: Optional[Callable[..., Any]]) -> None:
    """Installs what :class:`DistributedDataParallel` trains through when given
    an ``algorithm`` (``import ringlet.bagua`` installs Bagua's, done by
    ``import ringlet``).

    Args:
      wrapper (Callable, optional): Called as ``wrapper(module, optimizers,
        algorithm, name=..., bucket_bytes=..., broadcast_buffers=...)``; returns
        the object that trains ``module`` (with ``bagua_algorithm``,
        ``bagua_buckets`` and ``require_backward_grad_sync``). ``None`` removes it.

    Example:
      >>> import ringlet.bagua   # installs ringlet.bagua.data_parallel.wrap_for_ddp
    """
    global _algorithm_wrapper
    _algorithm_wrapper = wrapper


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad  # type: ignore[return-value]


def _set_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    p.grad = g


class DistributedDataParallel(torch.nn.Module):
    """Wraps ``module`` so that backward averages gradients over all ranks.

    Parameters are broadcast from rank 0 when wrapping (buffers too, once).
    Every rank must wrap the same model, in the same order (wrapping is a
    collective). Gradients are averaged in buckets of about ``bucket_cap_mb``
    MiB by a worker thread over a communicator of the model's own, as backward
    produces them; ``loss.backward()`` returns once all are averaged.

    Args:
      module (torch.nn.Module): The model.
      bucket_cap_mb (float): Bucket size cap in MiB. Default: 25.
      average (bool): Average (``True``) or sum the gradients. Default: True.
      broadcast_parameters (bool): Copy rank 0's parameters and buffers to the
        other ranks when wrapping. Default: True.
      name (str, optional): The module name for the tensor API. Default:
        ``"ddp0"``, ``"ddp1"``, ... in wrapping order.
      find_unused_parameters (bool): As in torch DDP: after each backward,
        agree across ranks (one small all-reduce) on which parameters got no
        gradient on any rank and leave their ``.grad`` as it was before the
        step (``None`` after ``zero_grad()``), so optimizers skip them.
        Without it such parameters get zero gradients. Either way a parameter
        unused on some ranks never hangs the job. Default: False.

    Example:
      >>> ringlet.init()
      >>> model = ringlet.DistributedDataParallel(torch.nn.Linear(4, 2))
      >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
      >>> model(x).sum().backward()     # gradients averaged on return
      >>> opt.step()
      >>> with model.no_sync():         # accumulate locally
      ...     model(x).sum().backward()
    """

    def __init__(
        self,
        module: torch.nn.Module,
        bucket_cap_mb: float = 25,
        average: bool = True,
        broadcast_parameters: bool = True,
        name: str | None = None,
        find_unused_parameters: bool = False,
        algorithm: Any = None,
        optimizers: list[torch.optim.Optimizer] | None = None,
    ) -> None:
        super().__init__()
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        groups.require_state()
        self.module = module
        self.ringlet_module_name: str = name if name is not None else f"ddp{next(_names)}"
        module.ringlet_module_name = self.ringlet_module_name
        self._algorithm: Any = None
        if algorithm is not None:
            self._wrap_with(algorithm, optimizers, bucket_cap_mb, broadcast_parameters)
            return
        self._sync = True
        self._callback_queued = False
        self._marked: set[str] = set()
        self._find_unused = find_unused_parameters
        self._filled: dict[str, Any] = {}
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._params = dict(named)
        comm = new_communicator(self.ringlet_module_name)
        if broadcast_parameters:
            _broadcast(comm, [p for _, p in module.named_parameters()] + list(module.buffers()))
        self._tensors = get_module(self.ringlet_module_name)
        for n, p in named:
            p.ensure_ringlet_tensor(n, self.ringlet_module_name, _grad, _set_grad)
        order = [p for _, p in reversed(named)]
        self._tensors.set_buckets(
            self._tensors.plan_buckets(order, int(bucket_cap_mb * (1 << 20)))
        )
        self._tensors.set_all_reduce(average=average, comm=comm)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(n)) for n, p in named
        ]

    def _wrap_with(self, algorithm: Any, optimizers: Any, bucket_cap_mb: float,
                   broadcast_parameters: bool) -> None:
        """Trains through one of Bagua's algorithms (``with_ringlet``)."""
        if _algorithm_wrapper is None:
            raise RuntimeError("DistributedDataParallel(algorithm=...) needs Bagua's "
                               "algorithms: import ringlet.bagua")
        inner = _algorithm_wrapper(
            self.module, list(optimizers or []), algorithm,
            name=self.ringlet_module_name, bucket_bytes=int(bucket_cap_mb * (1 << 20)),
            broadcast_buffers=broadcast_parameters,
        )
        self.module.__dict__["bagua_ddp"] = inner
        self._algorithm = inner
        self._sync = True

    @property
    def ringlet_algorithm(self) -> Any:
        """The algorithm implementation (``None`` for exact averaging)."""
        return None if self._algorithm is None else self._algorithm.bagua_algorithm

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the wrapped module."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Context manager: backward passes inside it accumulate gradients
        locally without communicating; the first backward outside averages the
        accumulated sum.

        Example:
          >>> with model.no_sync():
          ...     model(x1).sum().backward()
          >>> model(x2).sum().backward()   # averages the grads of x1 and x2
        """
        before, self._sync = self._sync, False
        inner = self._algorithm
        if inner is not None:
            inner.require_backward_grad_sync = False
        try:
            yield
        finally:
            self._sync = before
            if inner is not None:
                inner.require_backward_grad_sync = before

    @property
    def buckets(self) -> list[list[str]]:
        """The parameter names of each bucket, in communication order."""
        if self._algorithm is not None:
            return [[t.ringlet_tensor_name for t in b.tensors]
                    for b in self._algorithm.bagua_buckets]
        return [[t.ringlet_tensor_name for t in b] for b in self._tensors.buckets()]

    def _make_hook(self, name: str) -> Any:
        def hook(p: torch.Tensor) -> None:
            if not self._sync:
                return
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._marked.add(name)
            p.ringlet_mark_communication_ready()

        return hook

    def _finish(self) -> None:
        """End of backward: mark parameters that got no gradient, then wait."""
        try:
            for n, p in self._params.items():
                if n not in self._marked:
                    self._filled[n] = p.grad  # None unless gradients accumulate
                    p.ringlet_ensure_grad()
                    p.ringlet_mark_communication_ready()
        finally:
            used = [n in self._marked for n in self._params]
            self._marked.clear()
            self._callback_queued = False
            self._tensors.wait_pending_comm_ops()
        filled, self._filled = self._filled, {}
        if self._find_unused:
            flags = torch.tensor(used, dtype=torch.uint8)
            engine.all_reduce(groups.world_comm(), flags, "max")
            for (n, p), anywhere in zip(self._params.items(), flags.tolist()):
                if not anywhere:  # no rank produced a gradient: restore it
                    p.grad = filled.get(n)


def _broadcast(comm: Any, tensors: list[torch.Tensor]) -> None:
    """Copies rank 0's values of ``tensors`` to every rank over ``comm``."""
    with torch.no_grad():
        for t in tensors:
            if t.numel() == 0:
                continue
            host = t.detach().to("cpu", copy=True).contiguous()
            engine.broadcast(comm, host, 0)
            t.copy_(host)
