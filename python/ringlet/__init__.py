"""ringlet: collective communication for PyTorch.

A Rust engine (shared memory within a host, TCP between hosts) behind five
front doors, one sub-package each over the shared core (``runtime``,
``errors``, ``_engine``): :mod:`ringlet.xla` (torch_xla's collectives, SPMD
sharding), :mod:`ringlet.distributed` (``init_process_group("ringlet")``),
:mod:`ringlet.bagua` (tensor API, DDP), :mod:`ringlet.rpc`,
:mod:`ringlet.checkpoint`; plus ``torch.ops.ringlet`` (:mod:`ringlet.ops`).
The torch_xla-style collectives are also exported here. Launch with
``torchrun`` and call :func:`init`.

Example:
  >>> import torch, ringlet
  >>> ringlet.init()
  >>> ringlet.all_reduce(ringlet.REDUCE_SUM, torch.ones(3))
"""

from typing import Any

from . import _core, _legacy, bagua, distributed, ops, xla
from .bagua.ddp import DistributedDataParallel
from .errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorAbortedError,
    NotInitializedError,
    PeerLostError,
    ReplicaGroupError,
    RingletError,
    ShardingSpecError,
    TensorRegistrationError,
    TensorStateError,
)
from .runtime import (
    abort,
    get_local_ordinal,
    get_ordinal,
    host_layout,
    init,
    is_initialized,
    local_world_size,
    peer_transports,
    shutdown,
    transport,
    world_size,
)
from .xla.xla_model import (
    REDUCE_AND,
    REDUCE_MAX,
    REDUCE_MIN,
    REDUCE_MUL,
    REDUCE_OR,
    REDUCE_SUM,
    CoalescingBuckets,
    RateTracker,
    ToXlaTensorArena,
    add_step_closure,
    all_gather,
    all_gather_bucketized,
    all_reduce,
    all_reduce_bucketized_gradients,
    all_to_all,
    all_to_all_v,
    barrier,
    broadcast_master_param,
    check_view_sharing,
    collective_broadcast,
    collective_permute,
    do_on_ordinals,
    fork_rng,
    get_memory_info,
    get_rng_state,
    get_xla_supported_devices,
    is_master_ordinal,
    is_xla_tensor,
    mark_step,
    master_print,
    mesh_reduce,
    optimization_barrier_,
    optimizer_step,
    recv,
    reduce_gradients,
    reduce_scatter,
    reduce_scatter_bucketized,
    rendezvous,
    save,
    send,
    send_cpu_data_to_device,
    set_replication,
    set_rng_state,
    unlazy,
    wait_device_ops,
    xla_device,
    xla_device_hw,
    xla_real_devices,
    xla_rendezvous,
    xla_replication_devices,
    xrt_world_size,
)
from .xla.xla_model import (
    _all_gather_using_all_reduce as _all_gather_using_all_reduce,
)

__version__ = _core.__version__

distributed.c10d.register()  # init_process_group("ringlet")

# The modules' import paths from before the door sub-packages (ringlet.c10d,
# ringlet.sharding, ringlet.tensor, ...): one table in ringlet._legacy, each the
# home module itself, with a DeprecationWarning naming the new path.
_legacy.install()


def __getattr__(name: str) -> Any:
    """``ringlet.c10d`` and the other old paths as attributes (deprecated: see
    :mod:`ringlet._legacy`)."""
    return _legacy.attribute(__name__, name)


__all__ = [
    "abort",
    "bagua",
    "distributed",
    "xla",
    "ops",
    "CoalescingBuckets",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommunicatorAbortedError",
    "DistributedDataParallel",
    "NotInitializedError",
    "PeerLostError",
    "REDUCE_AND",
    "REDUCE_MAX",
    "REDUCE_MIN",
    "REDUCE_MUL",
    "REDUCE_OR",
    "REDUCE_SUM",
    "RateTracker",
    "ReplicaGroupError",
    "RingletError",
    "ShardingSpecError",
    "TensorRegistrationError",
    "TensorStateError",
    "ToXlaTensorArena",
    "add_step_closure",
    "all_gather",
    "all_gather_bucketized",
    "all_reduce",
    "all_reduce_bucketized_gradients",
    "all_to_all",
    "all_to_all_v",
    "barrier",
    "broadcast_master_param",
    "check_view_sharing",
    "collective_broadcast",
    "collective_permute",
    "do_on_ordinals",
    "fork_rng",
    "get_local_ordinal",
    "get_memory_info",
    "get_ordinal",
    "get_rng_state",
    "get_xla_supported_devices",
    "host_layout",
    "init",
    "is_initialized",
    "is_master_ordinal",
    "is_xla_tensor",
    "local_world_size",
    "mark_step",
    "master_print",
    "mesh_reduce",
    "optimization_barrier_",
    "optimizer_step",
    "recv",
    "reduce_gradients",
    "reduce_scatter",
    "reduce_scatter_bucketized",
    "rendezvous",
    "save",
    "send",
    "send_cpu_data_to_device",
    "set_rng_state",
    "peer_transports",
    "shutdown",
    "transport",
    "unlazy",
    "wait_device_ops",
    "world_size",
    "xla_device",
    "xla_device_hw",
    "xla_real_devices",
    "xla_replication_devices",
    "set_replication",
    "xla_rendezvous",
    "xrt_world_size",
]
