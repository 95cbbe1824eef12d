"""Bagua's extension API for algorithms: :class:`Algorithm` (what users
pass to ``with_bagua``; :meth:`Algorithm.reify` makes the implementation
for a process group) and :class:`AlgorithmImpl` (the hooks ``with_bagua``
calls), and the registry behind :meth:`Algorithm.init`.

A new algorithm subclasses both: ``AlgorithmImpl`` picks the tensors to
communicate (``init_tensors``), buckets them (``tensors_to_buckets``), gives
each bucket operations (``init_operations``, with the bucket's
``append_*_op`` methods) and decides when tensors are marked ready (the
hooks). The defaults are gradient averaging's.

Example:
  >>> class Halve(AlgorithmImpl):
  ...     def init_operations(self, ddp, bucket):
  ...         bucket.clear_ops()
  ...         bucket.append_centralized_synchronous_op(average=True, group=self.process_group)
  ...         bucket.append_python_op(lambda name: [t.grad.mul_(0.5) for t in bucket.tensors])
  >>> class HalveAlgorithm(Algorithm):
  ...     def reify(self, process_group):
  ...         return Halve(process_group)
  >>> model.with_bagua([opt], HalveAlgorithm())
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...parallel.tensor import ensure_ringlet_tensor, is_ringlet_tensor, reensure_ringlet_tensor
from ..bucket import BaguaBucket
from ..communication import BaguaProcessGroup

__all__ = ["Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry"]


def _grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    return p.grad


def _set_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    p.grad = g


def _no_op(*args: Any) -> None:
    """A hook that does nothing (any of the hooks' signatures)."""


def ensure_tensor(
    t: torch.Tensor,
    name: str,
    module_name: Optional[str],
    getter: Optional[Callable[..., Any]] = None,
    setter: Optional[Callable[..., Any]] = None,
) -> torch.Tensor:
    """Bagua's ``ensure_bagua_tensor``: makes ``t`` a ringlet tensor, or, if
    it is one, gives it exactly these closures (``None``: the identity
    getter, no setter), so an algorithm switch replaces the previous
    algorithm's closures."""
    if is_ringlet_tensor(t):
        reensure_ringlet_tensor(t, name, module_name, getter, setter, keep=False)
        return t
    return ensure_ringlet_tensor(t, name, module_name, getter, setter)


def aligned_buckets(tensors: list[list[torch.Tensor]], do_flatten: bool,
                    alignment: int) -> list[BaguaBucket]:
    """One bucket per suggested group, padded to a multiple of
    ``alignment`` elements (compressing algorithms pass the group's size,
    as Bagua's do, so every rank's chunk is equal)."""
    return [BaguaBucket(b, flatten=do_flatten, name=str(i), alignment=alignment)
            for i, b in enumerate(tensors)]


class Algorithm:
    """The base class of every algorithm (Bagua's ``Algorithm``).

    Example:
      >>> algorithm = Algorithm.init("gradient_allreduce", hierarchical=True)
    """

    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        """Makes the algorithm's implementation for a process group.

        Args:
          process_group (BaguaProcessGroup): The group to work on.

        Returns:
          AlgorithmImpl: The implementation.
        """
        raise NotImplementedError(f"{type(self).__name__}.reify is not implemented")

    @classmethod
    def init(cls, name: str, **kwargs: Any) -> Algorithm:
        """Makes a registered algorithm by name.

        Args:
          name (str): Its registered name (``str(GlobalAlgorithmRegistry)``
            lists them).
          **kwargs: Its constructor's arguments.

        Returns:
          Algorithm: The algorithm.

        Raises:
          KeyError: No algorithm of that name (the registered names listed).

        Example:
          >>> Algorithm.init("bytegrad", hierarchical=False)
        """
        return GlobalAlgorithmRegistry.get(name)(**kwargs)


class AlgorithmImpl:
    """The base class of algorithm implementations (Bagua's
    ``AlgorithmImpl``): the hooks ``with_bagua`` calls. The defaults average
    gradients.

    Args:
      process_group (BaguaProcessGroup): The group to work on.
    """

    def __init__(self, process_group: BaguaProcessGroup) -> None:
        self.process_group = process_group

    def need_reset(self) -> bool:
        """Returns True when every initialisation hook should run again
        (asked before each training forward).

        Returns:
          bool: Default False.
        """
        return False

    def init_tensors(self, bagua_ddp: Any) -> list[torch.Tensor]:
        """Returns the ringlet tensors to communicate. Default: every
        trainable parameter, in reverse order, with its gradient as the
        effective tensor.

        Args:
          bagua_ddp (BaguaDistributedDataParallel): The wrapped model.

        Returns:
          list[torch.Tensor]: The tensors.
        """
        parameters = bagua_ddp.bagua_build_params()
        tensors = []
        for name, param in reversed(parameters):
            param = param.ringlet_ensure_grad()
            tensors.append(ensure_tensor(param, name, bagua_ddp.bagua_module_name, _grad,
                                         _set_grad))
        self._communication_tensor_names = {name for name, _ in parameters}
        return tensors

    def tensors_to_buckets(self, tensors: list[list[torch.Tensor]],
                           do_flatten: bool) -> list[BaguaBucket]:
        """Turns the suggested grouping into buckets. Default: one bucket
        per group.

        Args:
          tensors (list[list[torch.Tensor]]): The suggested buckets.
          do_flatten (bool): Flatten each bucket.

        Returns:
          list[BaguaBucket]: The buckets.
        """
        return aligned_buckets(tensors, do_flatten, 1)

    def init_forward_pre_hook(self, bagua_ddp: Any) -> Callable[[Any], None]:
        """Returns the function run before each training forward, with the
        model's inputs. Default: nothing.

        Args:
          bagua_ddp (BaguaDistributedDataParallel): The wrapped model.

        Returns:
          Callable: ``hook(inputs)``.
        """
        return _no_op

    def init_backward_hook(self, bagua_ddp: Any) -> Callable[[str, torch.Tensor], None]:
        """Returns the function run when a parameter's gradient is ready.
        Default: mark it ready for communication.

        Args:
          bagua_ddp (BaguaDistributedDataParallel): The wrapped model.

        Returns:
          Callable: ``hook(parameter_name, parameter)``.
        """
        names = getattr(self, "_communication_tensor_names", set())
        marked = self.__dict__.setdefault("_marked", set())

        def hook(parameter_name: str, parameter: torch.Tensor) -> None:
            if parameter_name in names:
                marked.add(parameter_name)
                parameter.ringlet_mark_communication_ready()

        return hook

    def init_post_backward_hook(self, bagua_ddp: Any) -> Callable[[], None]:
        """Returns the function run when backward is done. Default: mark the
        parameters backward gave no gradient this time (so no rank hangs on
        them; their gradient is zero), then wait for every bucket.

        Args:
          bagua_ddp (BaguaDistributedDataParallel): The wrapped model.

        Returns:
          Callable: ``hook()``.
        """

        marked = self.__dict__.setdefault("_marked", set())

        def hook() -> None:
            backend = bagua_ddp._bagua_backend
            names = getattr(self, "_communication_tensor_names", None)
            try:
                if names and marked:
                    for t in bagua_ddp._bagua_tensors:
                        if t._ringlet_name in names and t._ringlet_name not in marked:
                            t.ringlet_ensure_grad()
                            t.ringlet_mark_communication_ready()
            finally:
                marked.clear()
            backend.wait_pending_comm_ops()

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp: Any) -> Callable[[Any], None]:
        """Returns the function run after each ``optimizer.step()``, with the
        optimizer. Default: nothing.

        Args:
          bagua_ddp (BaguaDistributedDataParallel): The wrapped model.

        Returns:
          Callable: ``hook(optimizer)``.
        """
        return _no_op

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        """Gives a bucket its operations (``bucket.append_*_op``). Default:
        none.

        Args:
          bagua_ddp (BaguaDistributedDataParallel): The wrapped model.
          bucket (BaguaBucket): The bucket.
        """


class _AlgorithmRegistry(dict):  # type: ignore[type-arg]
    """Algorithms by name (Bagua's registry)."""

    def register(self, name: str, algorithm: Callable[..., Any],
                 description: Optional[str] = None) -> None:
        """Registers an algorithm class under ``name``.

        Args:
          name (str): The name.
          algorithm (Callable): The algorithm's class.
          description (str, optional): What it does.

        Raises:
          TypeError: ``name`` is not a string.
          ValueError: ``name`` is taken.
        """
        if not (name is None or isinstance(name, str)):
            raise TypeError(f"`name` must be a str, found {name}")
        if name in self:
            raise ValueError(f"'{name}' is already present in the registry.")
        self[name] = {"algorithm": algorithm, "description": description or ""}

    def get(self, name: str) -> Callable[..., Any]:  # type: ignore[override]
        """Returns the algorithm class registered under ``name``.

        Raises:
          KeyError: Unknown name (the registered names listed).
        """
        if name in self:
            return self[name]["algorithm"]  # type: ignore[no-any-return]
        available = ", ".join(sorted(self.keys())) or "none"
        raise KeyError(f"'{name}' not found in registry. Available names: {available}")

    def available_algorithms(self) -> list[str]:
        """Returns the registered names."""
        return list(self.keys())

    def __str__(self) -> str:
        return "Registered Algorithms: {}".format(", ".join(self.keys()))


GlobalAlgorithmRegistry = _AlgorithmRegistry()
