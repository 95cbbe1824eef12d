"""The distributed optimizer (``torch.distributed.optim.DistributedOptimizer``)."""

from __future__ import annotations

import threading
from typing import Any

from . import api as _api
from . import autograd as _autograd

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    # One lock for all: two optimizers over the same parameters (two trainers)
    # must not interleave setting .grad and stepping (torch does the same).
    global_lock = threading.Lock()

    def __init__(self, optimizer_class: type, params: list[Any], args: tuple,
                 kwargs: dict) -> None:
        self.params = [r.local_value() for r in params]
        self.optim = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        grads = _autograd.get_gradients(context_id)
        with _LocalOptimizer.global_lock:
            for p in self.params:
                if p in grads:
                    p.grad = grads[p]
            self.optim.step()


def _local_step(opt_rref: Any, context_id: int) -> None:
    opt_rref.local_value().step(context_id)


class DistributedOptimizer:
    """One local optimizer per owner of the given parameter RRefs; ``step``
    applies each worker's gradients of a distributed autograd context.

    Args:
      optimizer_class (type): A ``torch.optim.Optimizer`` class.
      params_rref (list[RRef]): RRefs to the parameters (any owners).
      *args: Passed to ``optimizer_class``.
      **kwargs: Passed to ``optimizer_class``.

    Example::

        >>> with dist_autograd.context() as context_id:
        ...     loss = model(x).sum()                      # forward through RPCs
        ...     dist_autograd.backward(context_id, [loss])
        ...     dist_optim.step(context_id)
        >>> dist_optim = DistributedOptimizer(torch.optim.SGD, param_rrefs, lr=0.05)
    """

    def __init__(self, optimizer_class: type, params_rref: list[Any], *args: Any,
                 **kwargs: Any) -> None:
        by_owner: dict[int, list[Any]] = {}
        for r in params_rref:
            by_owner.setdefault(r.owner().id, []).append(r)
        self.remote_optimizers = [
            _api.remote(owner, _LocalOptimizer, args=(optimizer_class, rrefs, args, kwargs))
            for owner, rrefs in by_owner.items()
        ]

    def step(self, context_id: int) -> None:
        """Applies one step on every owner with that context's gradients.

        Args:
          context_id (int): The distributed autograd context.

        Returns:
          None.

        Example::

            >>> dist_optim.step(context_id)
        """
        _autograd._get(context_id)
        with _autograd._using(None):
            futs = [_api.rpc_async(o.owner(), _local_step, args=(o, context_id))
                    for o in self.remote_optimizers if not o.is_owner()]
        errors = []
        for o in self.remote_optimizers:
            if o.is_owner():  # this worker's own parameters: no round trip
                try:
                    o._get_future().wait()
                    _local_step(o, context_id)
                except Exception as e:
                    errors.append(e)
        for f in futs:
            try:
                f.wait()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

