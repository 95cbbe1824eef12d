"""``ringlet.rpc``: torch.distributed.rpc's framework on ringlet's engine.

Same names, signatures and errors as ``torch.distributed.rpc``, so code
written for torch runs after ``import ringlet.rpc as rpc``. The Rust agent
moves the messages (TCP, same-host tensors single-copy); see docs/getting-started/rpc.md.

Security: an RPC runs a pickled callable sent by any worker of the job.
Only processes that know the job's token (handed out through the job's
key-value store) can connect.
"""

from . import autograd, constants, functions, optim
from .api import (
    UNSET_RPC_TIMEOUT,
    WorkerInfo,
    _get_current_rpc_agent,
    _is_current_rpc_agent_set,
    _set_rpc_timeout,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .backend_registry import (
    BackendType,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
)
from .rref import RRef

__all__ = [
    "UNSET_RPC_TIMEOUT",
    "BackendType",
    "RRef",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "_get_current_rpc_agent",
    "_is_current_rpc_agent_set",
    "_set_rpc_timeout",
    "autograd",
    "constants",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "optim",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]
