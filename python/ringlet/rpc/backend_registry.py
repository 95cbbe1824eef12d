"""Backend types and options, named as in ``torch.distributed.rpc``.

ringlet has one backend (its own agent); ``BackendType.TENSORPIPE`` is
accepted as an alias so that code written for torch runs unchanged.
"""

from __future__ import annotations

import enum
from typing import Any, Optional

__all__ = [
    "DEFAULT_INIT_METHOD",
    "DEFAULT_NUM_WORKER_THREADS",
    "DEFAULT_RPC_TIMEOUT_SEC",
    "BackendType",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
]

from .constants import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
)


class BackendType(enum.Enum):
    """RPC backends. ``RINGLET`` is the only implementation; ``TENSORPIPE``
    selects it too."""

    RINGLET = "RINGLET"
    TENSORPIPE = "TENSORPIPE"

    def __repr__(self) -> str:
        return f"BackendType.{self.name}"  # as torch shows its members


class RpcBackendOptions:
    """Options of the RPC agent.

    Args:
      rpc_timeout (float): Default timeout in seconds of every call
        (``rpc_sync``, ``rpc_async``, ``remote``, ``to_here``). 0: none.
        Default: 60.
      init_method (str): How workers find each other: ``"env://"``
        (``MASTER_ADDR`` / ``MASTER_PORT``, or torchrun's store) or
        ``"tcp://host:port"``. Default: ``"env://"``.
      num_worker_threads (int): Threads that run incoming requests. Default: 16.

    Example::

        >>> opts = rpc.RpcBackendOptions(rpc_timeout=5, init_method="tcp://10.0.0.1:29500")
        >>> rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=opts)
    """

    def __init__(
        self,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        **_ignored: Any,
    ) -> None:
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method
        self.num_worker_threads = int(num_worker_threads)

    def __repr__(self) -> str:
        return (
            f"RpcBackendOptions(rpc_timeout={self.rpc_timeout}, "
            f"init_method={self.init_method!r}, num_worker_threads={self.num_worker_threads})"
        )


def _cpu_device(d: Any) -> Any:
    import torch

    dev = torch.device(d)  # as torch: an accelerator index fails without one
    if dev.type != "cpu":
        raise ValueError("ringlet RPC moves CPU tensors only; device maps to "
                         f"{dev} are not supported")
    return dev


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch's option class name, accepted for ported code. ``device_maps``
    and ``devices`` are kept (CPU devices only: ringlet RPC moves CPU
    tensors); ``_transports`` and ``_channels`` are accepted and ignored.

    Args:
      num_worker_threads (int): Threads that run incoming requests. Default: 16.
      rpc_timeout (float): Default timeout in seconds. Default: 60.
      init_method (str): ``"env://"`` or ``"tcp://host:port"``.

    Example::

        >>> opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=20)
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        device_maps: Optional[dict[str, Any]] = None,
        devices: Optional[list[Any]] = None,
        _transports: Optional[list[str]] = None,
        _channels: Optional[list[str]] = None,
    ) -> None:
        super().__init__(rpc_timeout, init_method, num_worker_threads)
        self.device_maps: dict[str, dict[Any, Any]] = {}
        for to, m in (device_maps or {}).items():
            self.set_device_map(to, m)
        self.devices: list[Any] = [_cpu_device(d) for d in (devices or [])]

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        """Records a device map for calls to ``to``; CPU to CPU only (the
        only mapping ringlet RPC has).

        Args:
          to (str): Callee name.
          device_map (dict): Caller device -> callee device.

        Returns:
          None.

        Raises:
          ValueError: a device that is not the CPU (``RuntimeError`` from
            ``torch.device`` for an accelerator index without one, as torch).

        Example::

            >>> opts.set_device_map("worker1", {"cpu": "cpu"})
            >>> opts.device_maps
            {'worker1': {device(type='cpu'): device(type='cpu')}}
        """
        full = dict(self.device_maps.get(to, {}))
        full.update({_cpu_device(k): _cpu_device(v) for k, v in device_map.items()})
        self.device_maps[to] = full
