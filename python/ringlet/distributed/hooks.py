"""torch DDP communication hooks that send fewer bytes: ByteGrad's 8-bit
compressed all-reduce, with error feedback, for
``DistributedDataParallel.register_comm_hook`` (beside torch's own
``fp16_compress_hook`` and PowerSGD).

:func:`bytegrad_hook` averages each gradient bucket through MinMaxUInt8
compression (a chunk per rank, each chunk's min and max, one byte per
element: a quarter of float32's bytes). With ``hierarchical=True`` (the
default) the ranks of a host sum exactly over shared memory and only the
hosts' first ranks exchange compressed bytes; on one host the hook is an
exact all-reduce. ``error_feedback=True`` (the default) adds what each
quantization lost to the next step's gradient, so compression loses
nothing in the long run (torch's ``fp16_compress_hook`` has no such
memory; PowerSGD has its own).

The hook runs on a thread and communicators of its own, connected through
torch's default store over the process group's ranks, so it works with any
backend (``"ringlet"``, ``"gloo"``) and never interleaves with the training
loop's collectives. CPU tensors, floating point.

Example:
  >>> import torch.distributed as dist
  >>> from ringlet.distributed import hooks
  >>> dist.init_process_group("ringlet")
  >>> ddp = torch.nn.parallel.DistributedDataParallel(model)
  >>> ddp.register_comm_hook(hooks.ByteGradState(), hooks.bytegrad_hook)
"""


import atexit
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import _core
from ..core import connect_members, engine, group_timeout, local_address
from ..core.engine import DTYPE_NAMES
from ..core.hook_worker import HookStates, HookWorker

__all__ = ["ByteGradState", "bytegrad_hook"]

_states = HookStates()


class ByteGradState:
    """The state :func:`bytegrad_hook` runs with: its communicators, its
    thread, and the error-feedback residuals of each bucket.

    Collective: create it on every rank of the process group, in the same
    order relative to other such states (e.g. right before
    ``register_comm_hook``).

    Args:
      process_group (torch.distributed.ProcessGroup, optional): The DDP
        model's group. Default: the default group.
      hierarchical (bool): Exact within each host, compressed between hosts.
        Default: True.
      error_feedback (bool): Carry each quantization's residual into the
        next step. Default: True.
      average (bool): Divide by the group's size, as DDP's default hook.
        Default: True.

    Example:
      >>> state = hooks.ByteGradState(error_feedback=True)
      >>> ddp.register_comm_hook(state, hooks.bytegrad_hook)
    """

    def __init__(self, process_group: Any = None, hierarchical: bool = True,
                 error_feedback: bool = True, average: bool = True) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ByteGradState needs torch.distributed: call init_process_group first"
            )
        pg = process_group if process_group is not None else dist.group.WORLD
        members = [int(r) for r in dist.get_process_group_ranks(pg)]
        me = dist.get_rank()
        if me not in members:
            raise ValueError(f"rank {me} is not in the DDP process group {members}")
        store = dist.distributed_c10d._get_default_store()
        timeout = group_timeout(pg)
        name = f"ringlet's ByteGrad hook over ranks {members}"
        # Members create states in the same order: the count agrees.
        count = int(store.add(f"ringlet/hooks/{','.join(map(str, members))}/{me}", 1))
        key = f"ringlet/hooks/{','.join(map(str, members))}/{count}"
        self._members = connect_members(
            store, key, members, me, addr=local_address(store), timeout=timeout, name=name,
            hierarchical=hierarchical, flat=True)
        comms = self._members.comms
        self.process_group = pg
        self.hierarchical = hierarchical
        self.error_feedback = error_feedback
        self.average = average
        self.op = _core.CentralizedOp(comms, average, "MinMaxUInt8", error_feedback)
        self._worker = HookWorker("ringlet-bytegrad-hook", self._reduce)
        _states.add(self)

    def residuals(self, bucket_index: int) -> Optional[tuple[bytes, bytes]]:
        """Returns the error-feedback residuals of a bucket as raw bytes of
        the bucket's dtype: the sender's (the whole bucket) and the owner's
        (this rank's chunk); None before the bucket's first call (or on a
        host's other ranks with ``hierarchical=True``).

        Args:
          bucket_index (int): ``GradBucket.index()``.

        Example:
          >>> w, s = state.residuals(0)
          >>> torch.frombuffer(bytearray(w), dtype=torch.float32)
        """
        return self.op.residuals(int(bucket_index))

    def submit(self, buffer: torch.Tensor, key: int) -> torch.futures.Future:
        """Queues the compressed all-reduce of ``buffer`` (in place).

        Args:
          buffer (torch.Tensor): A contiguous floating-point CPU tensor.
          key (int): Picks its error-feedback residuals (the bucket index).

        Returns:
          torch.futures.Future: Completes with ``buffer`` once it holds the
          mean (or sum), or with the error that stopped it.
        """
        if self._worker.closed:
            raise RuntimeError("this ByteGradState was closed")
        if not buffer.is_cpu or not buffer.is_contiguous():
            raise ValueError(f"rank {dist.get_rank()}: the ByteGrad hook takes contiguous CPU "
                             f"gradient buckets, got one on {buffer.device}")
        if not buffer.dtype.is_floating_point or buffer.dtype not in DTYPE_NAMES:
            raise TypeError(f"rank {dist.get_rank()}: the ByteGrad hook compresses float32, "
                            f"float64, float16 and bfloat16 gradients, not {buffer.dtype}")
        return self._worker.submit(buffer, key)

    def _reduce(self, buf: torch.Tensor, key: int) -> None:
        engine.apply(self.op, buf, key)

    def close(self) -> None:
        """Stops the thread and closes the communicators (idempotent)."""
        if self._worker.close():
            self._members.close()


def bytegrad_hook(state: ByteGradState,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook averaging each gradient bucket through
    8-bit MinMaxUInt8 compression (ByteGrad), with error feedback as the
    state says. Register it with ``register_comm_hook(state, bytegrad_hook)``.

    Args:
      state (ByteGradState): Its communicators and residuals.
      bucket (torch.distributed.GradBucket): The bucket DDP hands over; its
        ``buffer()`` is reduced in place.

    Returns:
      torch.futures.Future: Completes with the averaged buffer.

    Example:
      >>> ddp.register_comm_hook(hooks.ByteGradState(), hooks.bytegrad_hook)
    """
    return state.submit(bucket.buffer(), bucket.index())


def close_states() -> None:
    """Closes every :class:`ByteGradState` (at interpreter exit)."""
    _states.close_all()


atexit.register(close_states)
