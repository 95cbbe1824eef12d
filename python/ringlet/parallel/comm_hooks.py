"""Communication hooks for torch's own ``DistributedDataParallel``.

Keep ``torch.nn.parallel.DistributedDataParallel`` (over a gloo process group,
for everything else in the job) and let ringlet move its gradients: register
:func:`allreduce_hook` with ``register_comm_hook``. DDP hands each gradient
bucket to the hook as soon as backward has filled it; the hook queues the
bucket on a worker thread and returns a :class:`torch.futures.Future` at once,
so communication overlaps the rest of backward. DDP waits on the futures before
``backward()`` returns. The worker owns its own communicator, so the hook never
interleaves with collectives the training loop runs itself.

Example:
  >>> import torch.distributed as dist, ringlet
  >>> dist.init_process_group("gloo"); ringlet.init()
  >>> ddp = torch.nn.parallel.DistributedDataParallel(model)
  >>> ddp.register_comm_hook(ringlet.parallel.comm_hooks.AllReduceState(),
  ...                        ringlet.parallel.comm_hooks.allreduce_hook)
"""

from typing import Optional

import torch
import torch.distributed as dist

from ..core import engine, groups
from ..core.engine import DTYPE_NAMES
from ..core.hook_worker import HookStates, HookWorker
from .tensor import new_communicator

__all__ = ["AllReduceState", "allreduce_hook"]

_states = HookStates()


class AllReduceState:
    """The state :func:`allreduce_hook` runs with: a worker thread and a
    communicator of its own over every rank.

    Collective: create it on every rank, in the same order relative to other
    ringlet communicator creations (e.g. right before ``register_comm_hook``).

    Args:
      average (bool, optional): Divide the summed gradients by the world size,
        as DDP's built-in hook does. Default: True

    Example:
      >>> state = ringlet.parallel.comm_hooks.AllReduceState()
      >>> ddp.register_comm_hook(state, ringlet.parallel.comm_hooks.allreduce_hook)
    """

    def __init__(self, average: bool = True) -> None:
        self.average = average
        self.world_size = groups.require_state().world_size
        self._comm = new_communicator("comm_hook")
        self._worker = HookWorker("ringlet-comm-hook", self._reduce)
        _states.add(self)

    def submit(self, buffer: torch.Tensor) -> torch.futures.Future:
        """Queues one all-reduce of ``buffer`` (in place) on the worker.

        Args:
          buffer (torch.Tensor): A contiguous CPU tensor of a supported dtype.

        Returns:
          torch.futures.Future: Completes with ``buffer`` once it holds the
          sum (or mean) over all ranks, or with the error that stopped it.
        """
        if self._worker.closed:
            raise RuntimeError("this AllReduceState was closed (ringlet.shutdown() ran)")
        if not buffer.is_cpu or not buffer.is_contiguous():
            raise ValueError(
                f"rank {groups.get_ordinal()}: ringlet's comm hook takes contiguous CPU "
                f"gradient buckets, got one on {buffer.device}"
            )
        if buffer.dtype not in DTYPE_NAMES:
            raise TypeError(
                f"rank {groups.get_ordinal()}: gradient bucket dtype {buffer.dtype} is not "
                "supported by ringlet"
            )
        return self._worker.submit(buffer)

    def _reduce(self, buf: torch.Tensor) -> None:
        engine.all_reduce(self._comm, buf, "sum")
        if self.average and self.world_size > 1:
            buf.div_(self.world_size)

    def close(self) -> None:
        """Stops the worker (after the queued buckets) and closes the
        communicator. Idempotent; :func:`ringlet.shutdown` calls it."""
        if self._worker.close():
            self._comm.close()


def allreduce_hook(
    state: Optional[AllReduceState], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that averages each gradient bucket with
    ringlet (``DistributedDataParallel.register_comm_hook``). Its annotations
    are the ones torch checks: ``bucket: dist.GradBucket`` and a
    ``torch.futures.Future[torch.Tensor]`` result.

    Args:
      state (AllReduceState, optional): The worker and communicator to use.
        ``None`` uses one shared state, created on the first bucket (every rank
        reaches it at the same point of its first backward).
      bucket (torch.distributed.GradBucket): The bucket DDP hands over; its
        ``buffer()`` is reduced in place.

    Returns:
      torch.futures.Future: Completes with the averaged buffer.

    Example:
      >>> ddp.register_comm_hook(None, ringlet.parallel.comm_hooks.allreduce_hook)
    """
    if state is None:
        state = _default_state()
    return state.submit(bucket.buffer())


_default: Optional[AllReduceState] = None


def _default_state() -> AllReduceState:
    global _default
    if _default is None or _default._worker.closed:
        _default = AllReduceState()
    return _default


def close_states() -> None:
    """Closes every :class:`AllReduceState` (run by :func:`ringlet.shutdown`)."""
    _states.close_all()


groups.on_shutdown(close_states)
