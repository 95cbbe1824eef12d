"""Decentralized SGD (gossip): every rank trains its own replica and, every
``communication_interval`` steps, averages its weights with peers instead of
averaging gradients with everyone (Bagua's ``DecentralizedAlgorithm``);
and its low-precision variant, which exchanges 8-bit compressed weight
differences with the two ring neighbours only
(``LowPrecisionDecentralizedAlgorithm``).

``DecentralizedAlgorithm``: at a communicating step, the forward pass
starts the exchange of the current weights (``"all"``: the mean over every
rank; ``"shift_one"``: the mean with one peer, a different one each step,
which needs an even number of ranks, or of hosts with
``hierarchical=True``); after backward the result replaces the weights and
the optimizer steps from there.

``LowPrecisionDecentralizedAlgorithm``: after each communicating
``optimizer.step()``, each rank sends its neighbours the compressed
difference between its new weights and the ring's mix, and keeps replicas
of their weights up to date with theirs.

Example:
  >>> model.with_bagua([opt], DecentralizedAlgorithm(peer_selection_mode="shift_one",
  ...                                                hierarchical=False))
  >>> model.with_bagua([opt], LowPrecisionDecentralizedAlgorithm(hierarchical=False))
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...parallel.tensor import ensure_ringlet_tensor
from ..bucket import BaguaBucket
from ..communication import BaguaProcessGroup
from .base import Algorithm, AlgorithmImpl, _no_op, ensure_tensor

__all__ = [
    "DecentralizedAlgorithm",
    "DecentralizedAlgorithmImpl",
    "LowPrecisionDecentralizedAlgorithm",
    "LowPrecisionDecentralizedAlgorithmImpl",
]


def _check_interval(interval: Any) -> int:
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"communication_interval must be a positive int, got {interval!r}")
    return interval


def _state(bucket: BaguaBucket, name: str) -> torch.Tensor:
    """A CPU copy of the bucket's values, as a named ringlet tensor."""
    return ensure_ringlet_tensor(bucket.flattened_tensor().cpu(), name)


class DecentralizedAlgorithmImpl(AlgorithmImpl):
    """The implementation of :class:`DecentralizedAlgorithm`.

    Args:
      process_group (BaguaProcessGroup): The group to work on.
      hierarchical (bool): Average within hosts exactly, exchange between
        hosts. Default: True.
      peer_selection_mode (str): ``"all"`` or ``"shift_one"``. Default: "all".
      communication_interval (int): Steps between exchanges. Default: 1.
    """

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool = True,
                 peer_selection_mode: str = "all", communication_interval: int = 1) -> None:
        super().__init__(process_group)
        if peer_selection_mode not in ("all", "shift_one"):
            raise ValueError(f"unknown peer_selection_mode {peer_selection_mode!r}: expected "
                             "\"all\" or \"shift_one\"")
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = _check_interval(communication_interval)
        self.tensors: list[torch.Tensor] = []

    def _should_communicate(self, bagua_ddp: Any) -> bool:
        return (bagua_ddp.bagua_train_step_counter - 1) % self.communication_interval == 0

    def init_tensors(self, bagua_ddp: Any) -> list[torch.Tensor]:
        self.tensors = [ensure_tensor(p, name, bagua_ddp.bagua_module_name)
                        for name, p in reversed(bagua_ddp.bagua_build_params())]
        return self.tensors

    def tensors_to_buckets(self, tensors: list[list[Any]], do_flatten: bool) -> list[BaguaBucket]:
        everything = [t for b in tensors for t in b]
        return [BaguaBucket(everything, flatten=do_flatten, name="0")] if everything else []

    def init_forward_pre_hook(self, bagua_ddp: Any) -> Callable[[Any], None]:
        def hook(inputs: Any) -> None:
            if self._should_communicate(bagua_ddp):
                for t in self.tensors:
                    t.ringlet_mark_communication_ready()

        return hook

    def init_backward_hook(self, bagua_ddp: Any) -> Callable[[str, torch.Tensor], None]:
        return _no_op

    def init_post_backward_hook(self, bagua_ddp: Any) -> Callable[[], None]:
        def hook() -> None:
            if self._should_communicate(bagua_ddp):
                bagua_ddp._bagua_backend.wait_pending_comm_ops()
                for bucket in bagua_ddp.bagua_buckets:
                    bucket._decentralized_op.copy_back_peer_weight(bucket)

        return hook

    def _init_states(self, bucket: BaguaBucket) -> None:
        bucket._peer_weight = _state(bucket, "peer_weight")

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        self._init_states(bucket)
        bucket.clear_ops()
        bucket._decentralized_op = bucket.append_decentralized_synchronous_op(
            peer_weight=bucket._peer_weight,
            hierarchical=self.hierarchical,
            peer_selection_mode=self.peer_selection_mode,
            group=self.process_group,
        )


class LowPrecisionDecentralizedAlgorithmImpl(AlgorithmImpl):
    """The implementation of :class:`LowPrecisionDecentralizedAlgorithm`.

    Args:
      process_group (BaguaProcessGroup): The group to work on.
      hierarchical (bool): Average within hosts exactly, ring between hosts.
        Default: True.
      communication_interval (int): Steps between exchanges. Default: 1.
    """

    def __init__(self, process_group: BaguaProcessGroup, hierarchical: bool = True,
                 communication_interval: int = 1) -> None:
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.communication_interval = _check_interval(communication_interval)
        self.tensors: list[torch.Tensor] = []

    def _should_communicate(self, bagua_ddp: Any) -> bool:
        return (bagua_ddp.bagua_train_step_counter - 1) % self.communication_interval == 0

    def init_tensors(self, bagua_ddp: Any) -> list[torch.Tensor]:
        parameters = bagua_ddp.bagua_build_params()
        self.tensors = [ensure_tensor(p, name, bagua_ddp.bagua_module_name)
                        for name, p in reversed(parameters)]
        optimized = {id(p) for opt in bagua_ddp.bagua_optimizers
                     for g in opt.param_groups for p in g["params"]}
        for name, p in parameters:
            if id(p) not in optimized:
                raise RuntimeError(
                    f"Module parameter {name} is not used by your optimizer(s), need to exclude "
                    "it by adding the parameter name to the `List` attribute "
                    "`_bagua_params_and_buffers_to_ignore` of your module."
                )
        return self.tensors

    def init_backward_hook(self, bagua_ddp: Any) -> Callable[[str, torch.Tensor], None]:
        return _no_op

    def init_post_backward_hook(self, bagua_ddp: Any) -> Callable[[], None]:
        return _no_op

    def init_post_optimizer_step_hook(self, bagua_ddp: Any) -> Callable[[Any], None]:
        mine = {id(t) for t in self.tensors}

        def hook(optimizer: Any) -> None:
            if self._should_communicate(bagua_ddp):
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if id(p) in mine:
                            p.ringlet_mark_communication_ready()
                bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook

    def _init_states(self, bucket: BaguaBucket) -> None:
        bucket._weight = _state(bucket, "weight")
        bucket._left_peer_weight = _state(bucket, "left_peer_weight")
        bucket._right_peer_weight = _state(bucket, "right_peer_weight")

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        self._init_states(bucket)
        bucket.clear_ops()
        bucket.append_low_precision_decentralized_synchronous_op(
            weight=bucket._weight,
            left_peer_weight=bucket._left_peer_weight,
            right_peer_weight=bucket._right_peer_weight,
            hierarchical=self.hierarchical,
            compression="MinMaxUInt8",
            group=self.process_group,
        )


class DecentralizedAlgorithm(Algorithm):
    """Decentralized SGD: average weights with peers instead of gradients
    with everyone.

    Args:
      hierarchical (bool): Average within each host exactly, exchange
        between hosts (``"shift_one"`` then pairs hosts). Default: True.
      peer_selection_mode (str): ``"all"`` (every rank's weights averaged
        each exchange) or ``"shift_one"`` (pairs, a different peer each
        exchange). Default: "all".
      communication_interval (int): Training steps between exchanges.
        Default: 1.

    Example:
      >>> model.with_bagua([opt], DecentralizedAlgorithm(peer_selection_mode="shift_one"))
    """

    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all",
                 communication_interval: int = 1) -> None:
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval

    def reify(self, process_group: BaguaProcessGroup) -> DecentralizedAlgorithmImpl:
        return DecentralizedAlgorithmImpl(
            process_group, hierarchical=self.hierarchical,
            peer_selection_mode=self.peer_selection_mode,
            communication_interval=self.communication_interval,
        )


class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Low-precision decentralized SGD: 8-bit compressed weight differences
    exchanged with the two ring neighbours after each optimizer step.

    Args:
      hierarchical (bool): Average within each host exactly, ring between
        hosts. Default: True.
      communication_interval (int): Training steps between exchanges.
        Default: 1.

    Example:
      >>> model.with_bagua([opt], LowPrecisionDecentralizedAlgorithm(hierarchical=False))
    """

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1) -> None:
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval

    def reify(self, process_group: BaguaProcessGroup) -> LowPrecisionDecentralizedAlgorithmImpl:
        return LowPrecisionDecentralizedAlgorithmImpl(
            process_group, hierarchical=self.hierarchical,
            communication_interval=self.communication_interval,
        )
