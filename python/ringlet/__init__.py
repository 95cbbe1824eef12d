"""ringlet: collective communication for PyTorch.

A Rust engine (shared memory within a host, TCP between hosts) behind
torch_xla-style collectives. Launch with ``torchrun`` and call :func:`init`.

Example:
  >>> import torch, ringlet
  >>> ringlet.init()
  >>> ringlet.all_reduce(ringlet.REDUCE_SUM, torch.ones(3))
"""

from . import _core, tensor
from .collectives import (
    REDUCE_AND,
    REDUCE_MAX,
    REDUCE_MIN,
    REDUCE_MUL,
    REDUCE_OR,
    REDUCE_SUM,
    CoalescingBuckets,
    RateTracker,
    all_gather,
    all_gather_bucketized,
    all_reduce,
    all_reduce_bucketized_gradients,
    all_to_all,
    all_to_all_v,
    barrier,
    broadcast_master_param,
    collective_broadcast,
    collective_permute,
    is_master_ordinal,
    master_print,
    mesh_reduce,
    optimizer_step,
    recv,
    reduce_gradients,
    reduce_scatter,
    reduce_scatter_bucketized,
    rendezvous,
    save,
    send,
    wait_device_ops,
)
from .ddp import DistributedDataParallel
from .errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorAbortedError,
    NotInitializedError,
    PeerLostError,
    RingletError,
)
from .runtime import (
    get_local_ordinal,
    get_ordinal,
    host_layout,
    init,
    is_initialized,
    local_world_size,
    shutdown,
    transport,
    world_size,
)

__version__ = _core.__version__

__all__ = [
    "REDUCE_AND",
    "REDUCE_MAX",
    "REDUCE_MIN",
    "REDUCE_MUL",
    "REDUCE_OR",
    "REDUCE_SUM",
    "CoalescingBuckets",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommunicatorAbortedError",
    "DistributedDataParallel",
    "NotInitializedError",
    "PeerLostError",
    "RateTracker",
    "RingletError",
    "all_gather",
    "all_gather_bucketized",
    "all_reduce",
    "all_reduce_bucketized_gradients",
    "all_to_all",
    "all_to_all_v",
    "barrier",
    "broadcast_master_param",
    "collective_broadcast",
    "collective_permute",
    "get_local_ordinal",
    "get_ordinal",
    "host_layout",
    "init",
    "is_initialized",
    "is_master_ordinal",
    "local_world_size",
    "master_print",
    "mesh_reduce",
    "optimizer_step",
    "recv",
    "reduce_gradients",
    "reduce_scatter",
    "reduce_scatter_bucketized",
    "rendezvous",
    "save",
    "send",
    "shutdown",
    "tensor",
    "transport",
    "wait_device_ops",
    "world_size",
]
