"""The distributed optimizer (``torch.distributed.optim.DistributedOptimizer``)."""

from __future__ import annotations

import threading
from typing import Any

from . import api as _api
from . import autograd as _autograd

__all__ = ["DistributedOptimizer"]


# torch steps these with a functional optimizer, which never sets ``.grad``.
_FUNCTIONAL = ("Adagrad", "Adam", "AdamW", "SGD", "Adadelta", "RMSprop", "Rprop", "Adamax")


def _is_functional(optimizer_class: type) -> bool:
    import torch

    return any(optimizer_class is getattr(torch.optim, n, None) for n in _FUNCTIONAL)


class _LocalOptimizer:
    # One lock for all: two optimizers over the same parameters (two trainers)
    # must not interleave setting .grad and stepping (torch does the same).
    global_lock = threading.Lock()

    def __init__(self, optimizer_class: type, params: list[Any], args: tuple,
                 kwargs: dict) -> None:
        self.params = [r.local_value() for r in params]
        self.optim = optimizer_class(self.params, *args, **kwargs)
        self.functional = _is_functional(optimizer_class)

    def step(self, context_id: int) -> None:
        ctx = _autograd._find(context_id)
        if ctx is None:
            return  # no message of that context reached this worker: no gradient here
        grads = _autograd.get_gradients(context_id)
        with _LocalOptimizer.global_lock:
            old = [p.grad for p in self.params]
            for p in self.params:
                p.grad = grads.get(p) if self.functional else grads.get(p, p.grad)
            try:
                self.optim.step()
            finally:
                if self.functional:  # as torch's functional optimizers: .grad untouched
                    for p, g in zip(self.params, old):
                        p.grad = g


def _local_step(opt_rref: Any, context_id: int) -> None:
    opt_rref.local_value().step(context_id)


class DistributedOptimizer:
    """One local optimizer per owner of the given parameter RRefs; ``step``
    applies each worker's gradients of a distributed autograd context.
    For the optimizers torch runs functionally (SGD, Adam, AdamW, Adagrad,
    Adadelta, RMSprop, Rprop, Adamax; ``is_functional_optim``) the
    parameters' ``.grad`` stays as it was, as in torch; an owner that no
    message of the context reached does not step.

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
        self.is_functional_optim = _is_functional(optimizer_class)
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

