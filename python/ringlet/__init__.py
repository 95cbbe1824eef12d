"""ringlet: collective communication for PyTorch.

A Rust engine (shared memory within a host, TCP between hosts) behind five
front doors, one sub-package each over the shared core (:mod:`ringlet.core`,
the engine adapter and the job's groups; ``errors``): :mod:`ringlet.xla`
(torch_xla's collectives, SPMD sharding), :mod:`ringlet.distributed`
(``init_process_group("ringlet")``), :mod:`ringlet.bagua` (Bagua's look-alike:
its algorithms and names), :mod:`ringlet.rpc`, :mod:`ringlet.checkpoint`; plus
:mod:`ringlet.parallel` (ringlet's own tensor API, DDP and DDP hooks) and
``torch.ops.ringlet`` (:mod:`ringlet.ops`).
The torch_xla-style collectives are also exported here. Launch with
``torchrun`` and call :func:`init`.

Example:
  >>> import torch, ringlet
  >>> ringlet.init()
  >>> ringlet.all_reduce(ringlet.REDUCE_SUM, torch.ones(3))
"""

from typing import Any

from . import _core, _legacy, bagua, distributed, errors, ops, parallel, xla
from .core.groups import (
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
from .errors import *  # noqa: F403 (its __all__: the exception types)
from .parallel.ddp import DistributedDataParallel
from .xla.xla_model import *  # noqa: F403 (its __all__: torch_xla's collectives)
from .xla.xla_model import (
    ToXlaTensorArena,
    check_view_sharing,
    fork_rng,
    get_memory_info,
    get_xla_supported_devices,
    is_xla_tensor,
    send_cpu_data_to_device,
    set_replication,
    unlazy,
    xla_real_devices,
    xla_replication_devices,
    xrt_world_size,
)
from .xla.xla_model import (
    _all_gather_using_all_reduce as _all_gather_using_all_reduce,
)

__version__ = _core.__version__

distributed.c10d.register()  # init_process_group("ringlet")

# The modules' import paths from before the door sub-packages (ringlet.c10d,
# ringlet.sharding, ringlet.bagua.tensor, ...): one table in ringlet._legacy, each the
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
    "parallel",
    "DistributedDataParallel",
    "ToXlaTensorArena",
    "check_view_sharing",
    "fork_rng",
    "get_local_ordinal",
    "get_memory_info",
    "get_ordinal",
    "get_xla_supported_devices",
    "host_layout",
    "init",
    "is_initialized",
    "is_xla_tensor",
    "local_world_size",
    "send_cpu_data_to_device",
    "peer_transports",
    "shutdown",
    "transport",
    "unlazy",
    "world_size",
    "xla_real_devices",
    "xla_replication_devices",
    "set_replication",
    "xrt_world_size",
    *errors.__all__,
    *xla.xla_model.__all__,  # torch_xla's collectives, as ringlet.xla.xla_model has them
]
