"""Asynchronous model averaging (Bagua's ``AsyncModelAverageAlgorithm``):
after an optional warm-up of exact gradient averaging, every rank trains
on its own and a thread of ringlet's engine averages the weights with every
rank every ``sync_interval_ms`` milliseconds, without the training loop
waiting for the network. The training loop holds the weights' lock from
each forward until its ``optimizer.step()`` returns; a round takes it only to
copy the weights and to apply ``w += mean - copy`` (progress made meanwhile
is kept).

Stop it with ``model.bagua_algorithm.abort(model)`` (collective: it returns
once every rank asked to stop, all after the same round) and start it again
with ``resume(model)``. A rank lost while averaging makes the survivors
raise :class:`ringlet.PeerLostError` naming it at their next forward;
``abort`` then returns.

Example:
  >>> algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=100, warmup_steps=50)
  >>> model = model.with_bagua([opt], algorithm)
  >>> train(model)
  >>> model.bagua_algorithm.abort(model)
"""

from __future__ import annotations

import logging
from enum import IntEnum
from typing import Any, Callable

import torch

from ..bucket import AsyncModelAverageOp, BaguaBucket
from ..communication import BaguaProcessGroup
from .base import Algorithm, AlgorithmImpl, _grad, _set_grad, ensure_tensor

__all__ = ["AsyncModelAverageAlgorithm", "AsyncModelAverageAlgorithmImpl"]

_log = logging.getLogger(__name__)


class _AsyncInternalState(IntEnum):
    NEW = 0
    SCHEDULED = 1
    STARTED = 2
    STOPPED = 3


def _ddp_of(model: Any) -> Any:
    """The BaguaDistributedDataParallel of a model wrapped with ``with_bagua``,
    of Bagua's ``data_parallel.DistributedDataParallel`` wrapper (its
    ``inner``, as Bagua unwraps it), or the object itself."""
    from ..data_parallel import BaguaDistributedDataParallel, DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.inner
    if isinstance(model, BaguaDistributedDataParallel):
        return model
    inner = getattr(model, "__dict__", {}).get("bagua_ddp")
    if inner is not None:
        return inner
    raise TypeError(
        f"expected a model wrapped with with_bagua, a data_parallel.DistributedDataParallel "
        f"or a BaguaDistributedDataParallel, got {type(model).__name__}"
    )


class AsyncModelAverageAlgorithmImpl(AlgorithmImpl):
    """The implementation of :class:`AsyncModelAverageAlgorithm`.

    Args:
      process_group (BaguaProcessGroup): The group to work on.
      peer_selection_mode (str): ``"all"``, the only one. Default: "all".
      sync_interval_ms (int): Milliseconds between averaging rounds.
        Default: 500.
      warmup_steps (int): Steps of exact gradient averaging first. Default: 0.
    """

    def __init__(self, process_group: BaguaProcessGroup, peer_selection_mode: str = "all",
                 sync_interval_ms: int = 500, warmup_steps: int = 0) -> None:
        super().__init__(process_group)
        if peer_selection_mode != "all":
            raise ValueError(f"asynchronous model averaging supports peer_selection_mode "
                             f"\"all\" only, got {peer_selection_mode!r}")
        if sync_interval_ms < 0 or warmup_steps < 0:
            raise ValueError(f"sync_interval_ms and warmup_steps must not be negative, got "
                             f"{sync_interval_ms} and {warmup_steps}")
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.step_id = 0
        self.warmup_steps = warmup_steps
        self.status = _AsyncInternalState.NEW
        self._locked = False
        self._op: AsyncModelAverageOp | None = None

    def _warming(self) -> bool:
        return self.step_id < self.warmup_steps

    def _is_running(self) -> bool:
        return self._op is not None and self.status == _AsyncInternalState.STARTED

    def need_reset(self) -> bool:
        self.step_id += 1
        if self.warmup_steps > 0 and self.step_id == self.warmup_steps + 1:
            _log.info("Async model average starts from step %d", self.step_id)
            return True
        return False

    def init_tensors(self, bagua_ddp: Any) -> list[torch.Tensor]:
        tensors = []
        for name, param in reversed(bagua_ddp.bagua_build_params()):
            if self._warming():
                param = param.ringlet_ensure_grad()
                tensors.append(ensure_tensor(param, name, bagua_ddp.bagua_module_name, _grad,
                                             _set_grad))
            else:
                tensors.append(ensure_tensor(param, name, bagua_ddp.bagua_module_name))
        self._communication_tensor_names = {t._ringlet_name for t in tensors}
        return tensors

    def tensors_to_buckets(self, tensors: list[list[Any]], do_flatten: bool) -> list[BaguaBucket]:
        if not do_flatten:
            raise ValueError("Async algorithm supports `do_flatten=True` only")
        if self._warming():
            return super().tensors_to_buckets(tensors, do_flatten)
        everything = [t for b in tensors for t in b]
        return [BaguaBucket(everything, flatten=True, name="0")] if everything else []

    def _lock(self) -> None:
        if self._op is not None and not self._locked:
            self._op.lock_weight()
            self._locked = True

    def _unlock(self) -> None:
        if self._op is not None and self._locked:
            self._locked = False
            self._op.unlock_weight()

    def _start(self) -> None:
        if self._op is None:
            self.status = _AsyncInternalState.SCHEDULED
            return
        self._op.start(self.sync_interval_ms)
        self.status = _AsyncInternalState.STARTED

    def init_forward_pre_hook(self, bagua_ddp: Any) -> Callable[[Any], None]:
        def hook(inputs: Any) -> None:
            if self.step_id > self.warmup_steps and self.sync_interval_ms > 0:
                if self.status in (_AsyncInternalState.NEW, _AsyncInternalState.SCHEDULED):
                    self._start()
                self._lock()

        return hook

    def init_backward_hook(self, bagua_ddp: Any) -> Callable[[str, torch.Tensor], None]:
        def hook(parameter_name: str, parameter: torch.Tensor) -> None:
            if self.step_id <= self.warmup_steps:
                parameter.ringlet_mark_communication_ready()

        return hook

    def init_post_backward_hook(self, bagua_ddp: Any) -> Callable[[], None]:
        base = super().init_post_backward_hook(bagua_ddp)

        def hook() -> None:
            if self.step_id <= self.warmup_steps:
                base()

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp: Any) -> Callable[[Any], None]:
        def hook(optimizer: Any) -> None:
            self._unlock()

        return hook

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        bagua_ddp._bagua_backend.wait_pending_comm_ops()
        bucket.clear_ops()
        if self._warming():
            bucket.append_centralized_synchronous_op(
                hierarchical=False, average=True, group=self.process_group
            )
            return
        self._op = bucket.append_asynchronous_model_average_op(
            peer_selection_mode=self.peer_selection_mode, group=self.process_group
        )
        bucket._async_op = self._op
        # Rounds run on the averager's thread, not when the bucket is marked.
        bucket.clear_ops()

    def abort(self, bagua_ddp: Any) -> None:
        """Stops the averaging thread (collective: returns once every rank
        asked to stop); nothing when it is not running. Raises the thread's
        error if it failed and nothing raised it yet.

        Args:
          bagua_ddp: The model wrapped with ``with_bagua``, Bagua's
            ``data_parallel.DistributedDataParallel`` wrapping it, or its
            ``BaguaDistributedDataParallel``.

        Raises:
          TypeError: ``bagua_ddp`` is none of those.

        Example:
          >>> net = bagua.data_parallel.DistributedDataParallel(model, optimizers=[opt],
          ...                                                   algorithm=algorithm)
          >>> net.bagua_algorithm.abort(net)
        """
        _ddp_of(bagua_ddp)
        if self.status == _AsyncInternalState.SCHEDULED:
            self.status = _AsyncInternalState.STOPPED
            return
        if self.status != _AsyncInternalState.STARTED or self._op is None:
            return
        self._unlock()
        self.status = _AsyncInternalState.STOPPED
        self._op.abort()

    def resume(self, bagua_ddp: Any) -> None:
        """Starts the averaging thread again after :meth:`abort` (or
        schedules it to start after the warm-up).

        Args:
          bagua_ddp: The model, its Bagua ``DistributedDataParallel`` wrapper or
            its ``BaguaDistributedDataParallel`` (as :meth:`abort`).

        Raises:
          TypeError: ``bagua_ddp`` is none of those.

        Example:
          >>> net.bagua_algorithm.resume(net)
        """
        _ddp_of(bagua_ddp)
        if self.status in (_AsyncInternalState.NEW, _AsyncInternalState.STOPPED):
            if self._op is not None:
                self._op.reset()
            self._start()


class AsyncModelAverageAlgorithm(Algorithm):
    """Asynchronous model averaging on a background thread.

    Args:
      peer_selection_mode (str): ``"all"``, the only one. Default: "all".
      sync_interval_ms (int): Milliseconds between averaging rounds.
        Default: 500.
      warmup_steps (int): Steps of exact gradient averaging before the
        asynchronous averaging starts. Default: 0.

    Example:
      >>> model.with_bagua([opt], AsyncModelAverageAlgorithm(sync_interval_ms=200))
      >>> model.bagua_algorithm.abort(model)
    """

    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500,
                 warmup_steps: int = 0) -> None:
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps

    def reify(self, process_group: BaguaProcessGroup) -> AsyncModelAverageAlgorithmImpl:
        return AsyncModelAverageAlgorithmImpl(
            process_group, peer_selection_mode=self.peer_selection_mode,
            sync_interval_ms=self.sync_interval_ms, warmup_steps=self.warmup_steps,
        )
