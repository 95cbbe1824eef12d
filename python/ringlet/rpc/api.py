"""The RPC front end: ``torch.distributed.rpc``'s functions on ringlet's agent.

The Rust agent (``_core.RpcAgent``) owns connections, framing, the job token,
the request and completion thread pools, deadlines and peer-death detection.
This module gives payloads their meaning: a request is a pickled
``(kind, ...)`` tuple whose tensors are pulled out by ``persistent_id`` and
travel as raw bytes beside it (same-host large tensors single-copy), and a
response is the pickled result or a description of the remote exception.
"""

from __future__ import annotations

import atexit
import io
import itertools
import json
import os
import pickle
import re
import secrets
import threading
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, ClassVar, Optional, Union

import torch
from torch.futures import Future

from .. import _core
from .backend_registry import (
    BackendType,
    RpcBackendOptions,
)
from .constants import DEFAULT_RPC_TIMEOUT_SEC, UNSET_RPC_TIMEOUT

__all__ = [
    "UNSET_RPC_TIMEOUT",
    "WorkerInfo",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9_:\-]*$")


class WorkerInfo:
    """A worker's name and id (its rank), as ``torch.distributed.rpc.WorkerInfo``.

    Args:
      name (str): The worker's name given to ``init_rpc``.
      id (int): The worker's rank.

    Example::

        >>> info = rpc.get_worker_info("worker1")
        >>> info.name, info.id
        ('worker1', 1)
    """

    __slots__ = ("_id", "_name")

    def __init__(self, name: str, id: int) -> None:
        _validate_name(name)
        self._name = name
        self._id = int(id)

    @property
    def name(self) -> str:
        """The worker's name (read-only)."""
        return self._name

    @property
    def id(self) -> int:
        """The worker's id, its rank (read-only)."""
        return self._id

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerInfo) and (self.name, self.id) == (other.name, other.id)

    def __hash__(self) -> int:
        return hash((self.name, self.id))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerInfo, (self.name, self.id))


@dataclass
class _Pending:
    fut: Future
    to: int
    timeout: float
    keep: Any = None
    torch_exc: bool = False  # remote exceptions in rpc_sync/rpc_async's form


@dataclass
class _State:
    me: WorkerInfo
    workers: list[WorkerInfo]
    by_name: dict[str, WorkerInfo]
    agent: Any
    timeout: float
    store: Any
    prefix: str
    hosts_store: bool
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: dict[int, _Pending] = field(default_factory=dict)
    early: dict[int, Any] = field(default_factory=dict)
    active: int = 0
    idle: threading.Condition = field(default_factory=threading.Condition)
    shutting_down: bool = False
    closed: bool = False  # the agent is closed: no reply will come
    threads: int = 16


_state: Optional[_State] = None
_atexit_registered = False
_init_lock = threading.Lock()
_local = threading.local()


def is_available() -> bool:
    """True: ringlet's RPC is always built in.

    Returns:
      bool: ``True``.

    Example::

        >>> rpc.is_available()
        True
    """
    return True


def _require() -> _State:
    st = _state
    if st is None:
        raise RuntimeError("RPC has not been initialized. Call ringlet.rpc.init_rpc first.")
    return st


# ----------------------------------------------------------------- bootstrap


def _validate_name(name: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"worker name must be a str, got {type(name).__name__}")
    if not name or not _NAME_RE.match(name) or len(name) >= 128:
        raise RuntimeError("Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty "
                           f"and shorter than 128 chars, but got {name}")


def _store_for(init_method: str, rank: int, world: int, timeout: float) -> tuple[Any, bool]:
    from .. import runtime

    if init_method.startswith("tcp://"):
        from torch.distributed import TCPStore

        host, _, port = init_method[len("tcp://"):].rpartition(":")
        # An explicit address: rank 0 hosts the store (torchrun's agent store
        # lives at MASTER_PORT, not here).
        store = TCPStore(host.strip("[]"), int(port), world, rank == 0,
                         timedelta(seconds=timeout), wait_for_workers=False, multi_tenant=True)
        return store, rank == 0
    if init_method.startswith("file://"):
        from torch.distributed import FileStore

        return FileStore(init_method[len("file://"):], world), False
    if init_method != "env://":
        raise ValueError(f"unsupported init_method {init_method!r} "
                         "(use env://, tcp://host:port or file:///path)")
    addr = os.environ.get("MASTER_ADDR") or ""
    p_raw = os.environ.get("MASTER_PORT") or ""
    if not addr or not p_raw:
        raise ValueError("init_rpc with init_method='env://' needs MASTER_ADDR and MASTER_PORT set")
    store = runtime._make_store(addr, int(p_raw), rank, world, timeout)
    hosts = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    return store, hosts


def _single_copy_min() -> int:
    if os.environ.get("RINGLET_CMA", "1") in ("0", "false", "False"):
        return 1 << 62  # never: every tensor travels inline
    return int(os.environ.get("RINGLET_RPC_SINGLE_COPY_MIN", 64 << 10))


def init_rpc(
    name: str,
    backend: Optional[BackendType] = None,
    rank: int = -1,
    world_size: Optional[int] = None,
    rpc_backend_options: Optional[RpcBackendOptions] = None,
) -> None:
    """Starts this process's RPC agent and waits for every worker of the job.

    Args:
      name (str): A globally unique name (letters, digits, ``_``, ``:``,
        ``-``; shorter than 128 characters).
      backend (BackendType, optional): ``BackendType.RINGLET`` (default) or
        ``BackendType.TENSORPIPE`` (same agent).
      rank (int): This worker's id, 0 .. world_size-1. Default: ``$RANK``.
      world_size (int, optional): Number of workers. Default: ``$WORLD_SIZE``.
      rpc_backend_options (RpcBackendOptions, optional): ``rpc_timeout``
        (default 60 s), ``init_method`` (default ``env://``),
        ``num_worker_threads`` (default 16). torch's
        ``TensorPipeRpcBackendOptions`` is accepted too.

    Returns:
      None.

    Example::

        >>> import ringlet.rpc as rpc
        >>> rpc.init_rpc("worker0", rank=0, world_size=2)   # MASTER_ADDR/PORT set
        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
        tensor([4., 4.])
        >>> rpc.shutdown()
    """
    global _state
    from .. import runtime
    _validate_name(name)
    opts = _check_backend_and_options(backend, rpc_backend_options)
    init_method = str(getattr(opts, "init_method", "env://") or "env://")
    if rank == -1:
        raw = os.environ.get("RANK")
        if raw is None:
            if init_method == "env://":
                raise ValueError("Error initializing torch.distributed using env:// rendezvous: "
                                 "environment variable RANK expected, but not set")
            raise ValueError(f"Error initializing torch.distributed using {init_method}: "
                             "rank parameter missing")
        rank = int(raw)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "-1"))
        if world_size == -1:
            raise ValueError(
                "init_rpc needs world_size (or $WORLD_SIZE): ringlet.rpc has no dynamic "
                "membership (world_size=None)")
    if rank < 0 or world_size <= 0 or rank >= world_size:
        raise ValueError(f"init_rpc needs 0 <= rank < world_size, got rank={rank}, "
                         f"world_size={world_size}")
    timeout = float(getattr(opts, "rpc_timeout", DEFAULT_RPC_TIMEOUT_SEC))
    threads = int(getattr(opts, "num_worker_threads", 16))
    with _init_lock:
        if _state is not None:
            raise RuntimeError("RPC is already initialized")
        wait = max(timeout, 60.0) if timeout > 0 else 1800.0
        store, hosts_store = _store_for(init_method, rank, world_size, wait)
        gen = int(store.add(f"ringlet_rpc/gen/{rank}", 1))
        prefix = f"ringlet_rpc/{gen}"
        if rank == 0:
            store.set(f"{prefix}/token", str(secrets.randbits(63)))
        token = int(bytes(store.get(f"{prefix}/token")).decode())
        master = os.environ.get("MASTER_ADDR", "127.0.0.1")
        if init_method.startswith("tcp://"):
            master = init_method[len("tcp://"):].rpartition(":")[0].strip("[]")
        ip = runtime._local_ip(master)
        agent = _core.RpcAgent(
            rank, token, "0.0.0.0:0", _on_request, _on_response,
            request_threads=threads,
            completion_threads=4,
            single_copy_min=_single_copy_min(),
        )
        me = {"name": name, "addr": f"{ip}:{agent.port}", "host": runtime._host_id()}
        store.set(f"{prefix}/worker/{rank}", json.dumps(me))
        infos = [
            json.loads(bytes(store.get(f"{prefix}/worker/{r}")).decode())
            for r in range(world_size)
        ]
        names = [i["name"] for i in infos]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            agent.shutdown()
            # Everyone has read the names before the store's host may leave.
            _count_barrier(store, f"{prefix}/names", world_size, "init", wait)
            _leave_store(store, f"{prefix}/left", world_size, hosts_store, wait)
            raise RuntimeError(
                f"RPC worker name {', '.join(dups)} is not unique: used by ranks "
                f"{[r for r, n in enumerate(names) if n in dups]}"
            )
        force_tcp = os.environ.get("RINGLET_TRANSPORT", "").lower() == "tcp"
        agent.set_peers(
            [i["addr"] for i in infos],
            [(not force_tcp) and i["host"] == me["host"] for i in infos],
        )
        workers = [WorkerInfo(n, r) for r, n in enumerate(names)]
        _state = _State(
            me=workers[rank],
            workers=workers,
            by_name={w.name: w for w in workers},
            agent=agent,
            timeout=timeout,
            store=store,
            prefix=prefix,
            hosts_store=hosts_store,
            threads=threads,
        )
        _rref._start()
        if not _atexit_registered:
            atexit.register(_exit_shutdown)
            globals()["_atexit_registered"] = True
        # Every worker is reachable before anyone calls.
        _store_barrier(_state, "init", wait)


def _torch_options_classes() -> tuple[type, ...]:
    """torch's own option classes (base, TensorPipe), when torch has RPC."""
    try:
        from torch._C._distributed_rpc import RpcBackendOptions as TorchBase
        from torch._C._distributed_rpc import _TensorPipeRpcBackendOptionsBase as TorchTP
    except ImportError:
        return ()
    return (TorchBase, TorchTP)


def _check_backend_and_options(backend: Any, opts: Any) -> Any:
    """torch's checks of ``init_rpc``'s ``backend`` and ``rpc_backend_options``
    (the same exception types and messages); returns the options to use."""
    from .backend_registry import TensorPipeRpcBackendOptions

    if backend is not None and not isinstance(backend, BackendType) and not (
            type(backend).__name__ == "BackendType" and str(backend) == "BackendType.TENSORPIPE"):
        raise TypeError("Argument backend must be a member of BackendType")
    torch_classes = _torch_options_classes()
    if opts is None:
        return RpcBackendOptions()
    if not isinstance(opts, (RpcBackendOptions, *torch_classes)):
        raise TypeError("Argument rpc_backend_options must be an instance of RpcBackendOptions")
    tensorpipe = isinstance(opts, (TensorPipeRpcBackendOptions, *torch_classes[1:]))
    if backend is not None and str(backend) == "BackendType.TENSORPIPE":
        if not tensorpipe:
            raise TypeError(
                f"`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`. Got {type(opts)}.")
    elif backend is None and not tensorpipe and type(opts) is not RpcBackendOptions:
        # ringlet's own RpcBackendOptions selects ringlet's backend; other
        # classes name no backend.
        raise TypeError(f"Could not infer backend for options {opts}")
    return opts


def _store_barrier(st: _State, what: str, timeout: float) -> None:
    _count_barrier(st.store, f"{st.prefix}/{what}", len(st.workers), what, timeout)


def _count_barrier(store: Any, key: str, n: int, what: str, timeout: float) -> None:
    if int(store.add(key, 1)) == n:
        store.set(f"{key}/done", "1")
    try:
        store.wait([f"{key}/done"], timedelta(seconds=timeout))
    except Exception as e:
        arrived = int(store.add(key, 0))
        raise RuntimeError(
            f"RPC {what}: only {arrived} of {n} workers arrived within {timeout:.0f} s ({e})"
        ) from None


def _worker(to: Union[str, int, WorkerInfo]) -> WorkerInfo:
    st = _require()
    if isinstance(to, WorkerInfo):
        if 0 <= to.id < len(st.workers) and st.workers[to.id] == to:
            return to
        raise RuntimeError(f"name:{st.me.name},rank:{st.me.id} could not find destination {to}")
    if isinstance(to, str):
        w = st.by_name.get(to)
        if w is None:
            raise RuntimeError(
                f"name:{st.me.name},rank:{st.me.id} could not find destination name {to}"
            )
        return w
    if isinstance(to, int) and not isinstance(to, bool):
        if 0 <= to < len(st.workers):
            return st.workers[to]
        raise RuntimeError(f"name:{st.me.name},rank:{st.me.id} could not find destination id {to}")
    raise TypeError(f"'to' must be a worker name, rank or WorkerInfo, got {type(to).__name__}")


def get_worker_info(worker_name: Optional[str] = None) -> WorkerInfo:
    """The ``WorkerInfo`` of a worker by name, or of this worker.

    Args:
      worker_name (str, optional): A worker's name. Default: this worker.

    Returns:
      WorkerInfo: with ``name`` and ``id``.

    Example::

        >>> rpc.get_worker_info()
        WorkerInfo(id=0, name=worker0)
        >>> rpc.get_worker_info("worker1").id
        1
    """
    st = _require()
    w = st.me if worker_name is None else _worker(worker_name)
    return WorkerInfo(w.name, w.id)  # a copy, as torch hands out


class _AgentHandle:
    """The current agent as ``_get_current_rpc_agent()`` hands it out: torch's
    agent queries (``get_worker_info(s)``, ``get_debug_info``) and, through
    attribute lookup, ringlet's Rust agent."""

    def __init__(self, st: _State) -> None:
        self._st = st

    def __getattr__(self, name: str) -> Any:
        agent = self._st.agent
        if agent is None:
            raise RuntimeError("RPC agent is shut down")
        return getattr(agent, name)

    def get_worker_info(self, worker: Union[str, int, None] = None) -> WorkerInfo:
        """A worker's ``WorkerInfo`` by name or id (this worker's by default).

        Args:
          worker (str or int, optional): Name or id.

        Returns:
          WorkerInfo: the worker's name and id.

        Example::

            >>> rpc._get_current_rpc_agent().get_worker_info(1).name
            'worker1'
        """
        w = self._st.me if worker is None else _worker(worker)
        return WorkerInfo(w.name, w.id)

    def get_worker_infos(self) -> list[WorkerInfo]:
        """Every worker's ``WorkerInfo``, by id.

        Returns:
          list[WorkerInfo]: one per worker.

        Example::

            >>> [w.name for w in rpc._get_current_rpc_agent().get_worker_infos()]
            ['worker0', 'worker1']
        """
        return [WorkerInfo(w.name, w.id) for w in self._st.workers]

    def get_debug_info(self) -> dict[str, str]:
        """Counters of the agent, as strings (torch's key names).

        Returns:
          dict[str, str]: ``agent.thread_pool_size``, ``agent.num_pending_requests``,
          ``agent.server_active_calls``, ``agent.client_active_calls``.

        Example::

            >>> rpc._get_current_rpc_agent().get_debug_info()["agent.thread_pool_size"]
            '16'
        """
        st = self._st
        with st.lock:
            pending = len(st.pending)
        return {
            "agent.thread_pool_size": str(st.threads),
            "agent.num_pending_requests": str(pending),
            "agent.client_active_calls": str(pending),
            "agent.server_active_calls": str(st.active),
        }


def _get_current_rpc_agent() -> Any:
    """The current RPC agent (torch's private helper).

    Returns:
      The agent: ``get_worker_info``, ``get_worker_infos``, ``get_debug_info``.

    Raises:
      RuntimeError: when RPC is not initialized.

    Example::

        >>> len(rpc._get_current_rpc_agent().get_worker_infos())
        2
    """
    st = _state
    if st is None:
        raise RuntimeError("Current RPC agent is not set! Did you initialize the RPC framework "
                           "(e.g. by calling `rpc.init_rpc`)?")
    return _AgentHandle(st)


def _is_current_rpc_agent_set() -> bool:
    """Whether RPC is initialized (torch's private helper).

    Returns:
      bool: ``True`` between ``init_rpc`` and ``shutdown``.

    Example::

        >>> rpc._is_current_rpc_agent_set()
        True
    """
    return _state is not None


def get_rpc_timeout() -> float:
    """The default timeout of calls, in seconds (``rpc_timeout`` of the
    options, or as set by :func:`_set_rpc_timeout`).

    Returns:
      float: seconds; 0 means none.

    Raises:
      RuntimeError: when RPC is not initialized.

    Example::

        >>> rpc.get_rpc_timeout()
        60.0
    """
    return float(_current_agent_state().timeout)


def _set_rpc_timeout(rpc_timeout: float) -> None:
    """Sets the default timeout of later calls (torch's private helper).

    Args:
      rpc_timeout (float): Seconds; 0 means none.

    Returns:
      None.

    Example::

        >>> rpc._set_rpc_timeout(5)
        >>> rpc.get_rpc_timeout()
        5.0
    """
    _current_agent_state().timeout = float(rpc_timeout)


def _current_agent_state() -> _State:
    st = _state
    if st is None:
        raise RuntimeError("Current RPC agent is not set! Did you initialize the RPC framework "
                           "(e.g. by calling `rpc.init_rpc`)?")
    return st


_gather_seq: dict[str, int] = {}
_gather_lock = threading.Lock()


def _all_gather(obj: Any, worker_names: Optional[Any] = None,
                timeout: float = UNSET_RPC_TIMEOUT) -> dict[str, Any]:
    """Gathers one picklable object from each named worker (all by default);
    every one of them must call it, in the same order (torch's private
    helper).

    Args:
      obj (object): This worker's contribution.
      worker_names (iterable of str, optional): The workers taking part.
      timeout (float): Seconds to wait for the others; -1: the default
        timeout; 0: none.

    Returns:
      dict[str, object]: worker name -> its object.

    Raises:
      RuntimeError: ``timed out in _all_gather after ... seconds``.

    Example::

        >>> rpc.api._all_gather(rpc.get_worker_info().id)
        {'worker0': 0, 'worker1': 1}
    """
    st = _require()
    names = sorted(w.name for w in st.workers) if worker_names is None else sorted(
        set(worker_names))
    for n in names:
        _worker(n)
    group = ",".join(names)
    with _gather_lock:
        seq = _gather_seq.get(group, 0)
        _gather_seq[group] = seq + 1
    t = st.timeout if timeout is None or timeout == UNSET_RPC_TIMEOUT else float(timeout)
    key = f"{st.prefix}/all_gather/{group}/{seq}"
    st.store.set(f"{key}/{st.me.name}", pickle.dumps(obj))
    keys = [f"{key}/{n}" for n in names]
    try:
        st.store.wait(keys, timedelta(seconds=t if t > 0 else 1e7))
    except Exception:
        raise RuntimeError(f"timed out in _all_gather after {t:.2f} seconds") from None
    out = {n: pickle.loads(bytes(st.store.get(k))) for n, k in zip(names, keys)}
    if int(st.store.add(f"{key}/read", 1)) == len(names):
        for k in keys:
            try:
                st.store.delete_key(k)
            except Exception:
                pass
    return out


def _barrier(worker_names: Any) -> None:
    """Waits until every named worker has called it (torch's private helper).

    Args:
      worker_names (iterable of str): The workers taking part.

    Returns:
      None.

    Example::

        >>> rpc.api._barrier(["worker0", "worker1"])
    """
    try:
        _all_gather(None, set(worker_names))
    except RuntimeError as e:
        raise RuntimeError(f"Failed to complete barrier, got error {e}") from None


def _wait_all_workers(timeout: float = 0) -> None:
    """Waits until every worker has called it (torch's private helper).

    Args:
      timeout (float): Seconds; 0 (default): none.

    Returns:
      None.

    Example::

        >>> rpc.api._wait_all_workers()
    """
    _all_gather(None, timeout=timeout)


# ------------------------------------------------------------- serialization


def _cpu_only(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        dest = getattr(_local, "dest_name", "?")
        raise RuntimeError(
            "TensorPipe RPC backend only supports CPU tensors by default, please move your "
            "tensors to CPU before sending them over RPC, or call `set_device_map` on "
            "`TensorPipeRpcBackendOptions` to explicitly configure device mapping. Request "
            f"device mapping is not available for destination {dest}, but found tensor on "
            f"device: {t.device}"
        )


def _load_script_function(qualified: str) -> Any:
    import importlib
    import sys

    path = qualified[len("__torch__."):] if qualified.startswith("__torch__.") else qualified
    module, _, fn = path.rpartition(".")
    mod = importlib.import_module(module) if module else sys.modules["__main__"]
    return getattr(mod, fn)


# Pickling runs in C: tensors, parameters, RRefs and TorchScript functions are
# found through a dispatch table (exact types), not a Python hook called for
# every object. Per-message state lives in thread-locals.


# As torch's RPC: a tensor travels with its whole storage (so views keep their
# strides and offset, and views of one storage in a message share it on
# arrival) unless the storage is large and mostly unused by the tensor; then
# a compact copy travels instead.
_RECOPY_MIN_BYTES = 8 << 10


def _reduce_tensor(t: torch.Tensor) -> Any:
    _cpu_only(t)
    if t.layout != torch.strided or t.is_quantized:
        return t.__reduce_ex__(5)
    d = t.detach()
    if d.is_conj() or d.is_neg():
        d = d.resolve_conj().resolve_neg()
    itemsize = d.element_size()
    useful = d.numel() * itemsize
    storage = d.untyped_storage()
    size = storage.nbytes()
    if size >= _RECOPY_MIN_BYTES and size >= 2 * useful:
        d = d.clone()  # keeps a dense layout's strides
        storage = d.untyped_storage()
        size = storage.nbytes()
    out: list[torch.Tensor] = _local.out
    seen: dict[tuple[int, int], int] = _local.storages
    key = (storage.data_ptr(), size)
    i = seen.get(key)
    if i is None:
        if useful == size and d.storage_offset() == 0 and d.is_contiguous():
            buf = d  # the tensor is its storage
        else:
            buf = torch.empty(0, dtype=torch.uint8).set_(storage)
        out.append(buf)
        i = seen[key] = len(out) - 1
    grad_out = getattr(_local, "grad_out", None)
    if grad_out is not None and t.requires_grad:
        grad_out.append(t)  # still attached to its graph: distributed autograd's send
    return (_rebuild_tensor, (i, size, t.dtype, tuple(d.shape), tuple(d.stride()),
                              d.storage_offset(), bool(t.requires_grad),
                              isinstance(t, torch.nn.Parameter)))


def _rebuild_tensor(i: int, size: int, dtype: torch.dtype, shape: tuple[int, ...],
                    stride: tuple[int, ...], offset: int, requires_grad: bool,
                    is_param: bool) -> torch.Tensor:
    lens: list[int] = _local.lens
    bufs: dict[int, torch.Tensor] = _local.bufs
    base = bufs.get(i)
    out: Optional[torch.Tensor] = None
    if base is None:
        if i >= len(lens) or lens[i] != size:
            raise RuntimeError("malformed RPC message: tensor size does not match its bytes")
        numel = 1
        for n in shape:
            numel *= n
        if (offset == 0 and numel * dtype.itemsize == size
                and stride == _contiguous_strides(shape)):
            base = out = torch.empty(shape, dtype=dtype)  # the tensor is its storage
        else:
            base = torch.empty(size, dtype=torch.uint8)
        if size:
            _local.msg.fetch(i, base.data_ptr(), size)
        bufs[i] = base
    if out is None:  # a view of the storage (shared with the message's other views)
        try:
            out = torch.empty(0, dtype=dtype).set_(base.untyped_storage(), offset, shape, stride)
        except RuntimeError as e:
            raise RuntimeError(f"malformed RPC message: {e}") from None
    recv = getattr(_local, "recv", None)
    if is_param:
        out = torch.nn.Parameter(out, requires_grad=requires_grad)
    elif requires_grad:
        if recv is not None and getattr(_local, "recv_ctx", None) is not None:
            # In a distributed autograd context: a graph node whose backward
            # hands the gradient to the sender (torch's RecvRpcBackward).
            out, anchor = _autograd._recv_node(out)
            recv.append(anchor)
            return out
        out.requires_grad_(True)
    if recv is not None and requires_grad:
        recv.append(out)  # distributed autograd's recv: a new leaf
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _reduce_rref(r: Any) -> Any:
    from .rref import RRef

    return (RRef._from_fork, r._fork_for(_local.dest))


def _reduce_script_function(f: Any) -> Any:
    return (_load_script_function, (f.qualified_name,))


class _Pickler(pickle.Pickler):
    dispatch_table: ClassVar[dict[Any, Any]] = {}


def _dispatch_table() -> dict[Any, Any]:
    import copyreg

    from .rref import RRef

    table = copyreg.dispatch_table.copy()
    table[torch.Tensor] = _reduce_tensor
    table[torch.nn.Parameter] = _reduce_tensor
    table[RRef] = _reduce_rref
    table[torch.jit.ScriptFunction] = _reduce_script_function
    return table


def _dumps(obj: Any, dest: int, grad_out: Optional[list[torch.Tensor]] = None,
           ) -> tuple[bytes, list[torch.Tensor]]:
    if not _Pickler.dispatch_table:
        _Pickler.dispatch_table = _dispatch_table()
    prev = (getattr(_local, "out", None), getattr(_local, "dest", None),
            getattr(_local, "grad_out", None), getattr(_local, "storages", None))
    tensors: list[torch.Tensor] = []
    _local.out, _local.dest, _local.grad_out, _local.storages = tensors, dest, grad_out, {}
    try:
        f = io.BytesIO()
        _Pickler(f, 5).dump(obj)
        return f.getvalue(), tensors
    finally:
        _local.out, _local.dest, _local.grad_out, _local.storages = prev


def _loads(msg: Any) -> Any:
    return _loads_leaves(msg)[0]


def _loads_leaves(msg: Any) -> tuple[Any, list[torch.Tensor]]:
    """Unpickles a message; also returns the leaves of its received tensors
    that require grad: in a distributed autograd context the input of each
    tensor's recv node (whose gradient goes back to the sender), else the
    tensors themselves."""
    prev = (getattr(_local, "msg", None), getattr(_local, "lens", None),
            getattr(_local, "recv", None), getattr(_local, "bufs", None),
            getattr(_local, "recv_ctx", None))
    leaves: list[torch.Tensor] = []
    _local.msg, _local.lens, _local.recv, _local.bufs = msg, msg.tensor_lens, leaves, {}
    _local.recv_ctx = None
    try:
        return pickle.loads(msg.payload()), leaves
    finally:
        (_local.msg, _local.lens, _local.recv, _local.bufs, _local.recv_ctx) = prev
        msg.release()


class _CtxMark:
    """Pickled before a message's payload in a distributed autograd
    context: unpickling it first tells the tensors that follow that they are
    the context's (so they arrive as graph nodes); it arrives as
    ``(cid, key)``."""

    __slots__ = ("cid", "key")

    def __init__(self, cid: int, key: Any) -> None:
        self.cid, self.key = cid, key

    def __reduce__(self) -> Any:
        return (_enter_ctx, (self.cid, self.key))


def _enter_ctx(cid: int, key: Any) -> tuple[int, Any]:
    _local.recv_ctx = (cid, key)
    return cid, key


class _CtxResult:
    """A response inside a distributed autograd context: the value and the key
    under which the responder recorded its send."""

    __slots__ = ("cid", "key", "value")

    def __init__(self, cid: int, key: Any, value: Any) -> None:
        self.cid, self.key, self.value = cid, key, value

    def __reduce__(self) -> Any:
        return (_ctx_result, (_CtxMark(self.cid, self.key), self.value))


def _ctx_result(mark: tuple[int, Any], value: Any) -> _CtxResult:
    return _CtxResult(mark[0], mark[1], value)


def _tensor_bufs(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]


# ----------------------------------------------------------------- calling


def _timeout_of(st: _State, timeout: float) -> float:
    """The timeout of a call: the default for -1 (``UNSET_RPC_TIMEOUT``) or
    ``None``; any other negative value times the call out at once (as
    torch)."""
    if timeout is None or timeout == UNSET_RPC_TIMEOUT:
        return st.timeout
    return float(timeout)


def _agent_timeout(t: float) -> float:
    return t if t >= 0 else 1e-6


def _prepare(to: WorkerInfo, body: Any, timeout: float) -> tuple[_State, float, bytes,
                                                                  list[torch.Tensor], list[Any]]:
    st = _require()
    if st.agent is None:
        raise RuntimeError("RPC agent is shut down")
    t = _timeout_of(st, timeout)
    cid = _autograd._current_id()
    grad_out: Optional[list[torch.Tensor]] = None
    # An RRef fetch records too (torch's to_here forces grad recording): the
    # owner's answer carries the value's graph.
    if cid is not None and body[0] in ("call", "remote", "fetch") and not _plain_builtin(body):
        key = (st.me.id, next(_ids))
        body = ("ctx", _CtxMark(cid, key), body)  # type: ignore[arg-type]
        grad_out = []
    prev = (getattr(_local, "dest_name", None), getattr(_local, "keep", None))
    _local.dest_name, _local.keep = to.name, []
    try:
        payload, tensors = _dumps(body, to.id, grad_out)
        kept = _local.keep
    finally:
        _local.dest_name, _local.keep = prev
    if grad_out is not None:
        _autograd._record_send(cid, key, to.id, grad_out)  # type: ignore[arg-type]
    return st, t, payload, tensors, kept


def _plain_builtin(body: Any) -> bool:
    """Whether a request runs a torch builtin op on arguments none of which
    requires grad: torch sends those without the autograd context (Python
    functions always carry it)."""
    call = body[3] if body[0] == "remote" else body
    if call[0] != "call" or torch.jit._builtins._find_builtin(call[1]) is None:
        return False
    # torch's check is autograd's: under no_grad nothing requires grad
    return not torch.is_grad_enabled() or not _any_requires_grad((call[2], call[3]))


def _any_requires_grad(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.requires_grad
    if isinstance(v, (list, tuple)):
        return any(_any_requires_grad(x) for x in v)
    if isinstance(v, dict):
        return any(_any_requires_grad(x) for x in v.values())
    return False


def _send(to: WorkerInfo, body: Any, timeout: float, keep: Any = None,
          torch_exc: bool = False) -> Future:
    """Sends one request; the returned future completes with its outcome
    (a remote exception as :func:`_as_rpc_error` makes it with ``torch_exc``)."""
    st, t, payload, tensors, kept = _prepare(to, body, timeout)
    fut: Future = Future()
    entry = _Pending(fut, to.id, t, (keep, kept), torch_exc)
    try:
        cid = st.agent.call(to.id, payload, _tensor_bufs(tensors), _agent_timeout(t), tensors)
    except (RuntimeError, AttributeError) as e:
        raise RuntimeError(f"RPC to {to.name} failed: {e}") from None
    _track(st, cid, entry)
    return fut


def _track(st: Any, cid: int, entry: Any) -> None:
    """Registers ``entry`` as waiting for the reply to call ``cid``, or
    completes it at once when the reply already arrived."""
    with st.lock:
        early = st.early.pop(cid, None)
        closed = early is None and st.closed
        if early is None and not closed:
            st.pending[cid] = entry
    if early is not None:
        _complete(st, entry, early)
    elif closed:
        entry.fut.set_exception(RuntimeError(
            f"RPC to {st.workers[entry.to].name} failed: the RPC agent shut down before the "
            "call completed"))


def _send_sync(to: WorkerInfo, body: Any, timeout: float, keep: Any = None,
               torch_exc: bool = False) -> Any:
    """Sends one request and returns its result (raises its error). The
    calling thread waits in the agent with the GIL released; the reader
    thread hands it the response directly."""
    st, t, payload, tensors, kept = _prepare(to, body, timeout)
    try:
        msg = st.agent.call_wait(to.id, payload, _tensor_bufs(tensors), _agent_timeout(t),
                                 tensors)
    except (RuntimeError, AttributeError) as e:
        raise RuntimeError(f"RPC to {to.name} failed: {e}") from None
    ok, value = _outcome(st, to.id, t, msg, torch_exc)
    del keep, kept
    if ok:
        return value
    raise value


def _invoke(to: Any, func: Callable[..., Any], args: Any, kwargs: Any, timeout: float) -> Future:
    if not callable(func):
        raise TypeError(f"function should be callable, got {type(func).__name__}")
    w = _worker(to)
    return _send(w, ("call", func, tuple(args or ()), dict(kwargs or {})), timeout,
                 torch_exc=True)


def rpc_async(
    to: Union[str, int, WorkerInfo],
    func: Callable[..., Any],
    args: Optional[tuple[Any, ...]] = None,
    kwargs: Optional[dict[str, Any]] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future:
    """Runs ``func(*args, **kwargs)`` on worker ``to``; returns at once.

    Args:
      to (str or WorkerInfo or int): Name, ``WorkerInfo`` or rank of the callee.
      func (Callable): A module-level Python function, a builtin or torch op
        (``torch.add``, ``min``), a TorchScript function, or an
        ``@rpc.functions.async_execution`` function.
      args (tuple): Positional arguments (tensors travel as raw bytes).
      kwargs (dict): Keyword arguments.
      timeout (float): Seconds; 0 means none; -1 (default) uses the
        ``rpc_timeout`` given to ``init_rpc``.

    Returns:
      torch.futures.Future: completes with the result; ``wait()`` raises the
      remote exception (its type, with the remote traceback), or a
      ``RuntimeError`` saying the call timed out or the callee died.

    Example::

        >>> fut1 = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 3))
        >>> fut2 = rpc.rpc_async("worker1", min, args=(1, 2))
        >>> fut1.wait() + fut2.wait()
        tensor([5., 5.])
    """
    return _invoke(to, func, args, kwargs, timeout)


def rpc_sync(
    to: Union[str, int, WorkerInfo],
    func: Callable[..., Any],
    args: Optional[tuple[Any, ...]] = None,
    kwargs: Optional[dict[str, Any]] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Runs ``func(*args, **kwargs)`` on worker ``to`` and returns its result.
    Thread-safe; may be called from inside an RPC (nested calls).

    Args:
      to (str or WorkerInfo or int): Name, ``WorkerInfo`` or rank of the callee.
      func (Callable): Function to run (see :func:`rpc_async`).
      args (tuple): Positional arguments.
      kwargs (dict): Keyword arguments.
      timeout (float): Seconds; 0: none; -1 (default): the agent's default.

    Returns:
      The result of ``func``.

    Example::

        >>> rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 3))
        tensor([4., 4.])
    """
    if not callable(func):
        raise TypeError(f"function should be callable, got {type(func).__name__}")
    return _send_sync(_worker(to), ("call", func, tuple(args or ()), dict(kwargs or {})), timeout,
                      torch_exc=True)


def remote(
    to: Union[str, int, WorkerInfo],
    func: Callable[..., Any],
    args: Optional[tuple[Any, ...]] = None,
    kwargs: Optional[dict[str, Any]] = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Runs ``func`` on worker ``to``, which keeps the result; returns an
    ``RRef`` to it at once.

    Args:
      to (str or WorkerInfo or int): The callee, owner of the result.
      func (Callable): Function to run (see :func:`rpc_async`).
      args (tuple): Positional arguments.
      kwargs (dict): Keyword arguments.
      timeout (float): Seconds for the owner to create the value; a failure
        or timeout is raised by the next use of the RRef (``to_here``).

    Returns:
      RRef: a reference to the result, owned by ``to``.

    Example::

        >>> rref1 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        >>> rref2 = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
        >>> rref1.to_here() + rref2.to_here()
        tensor([6., 6.])
    """
    from .rref import RRef

    if not callable(func):
        raise TypeError(f"function should be callable, got {type(func).__name__}")
    return RRef._remote(_worker(to), ("call", func, tuple(args or ()), dict(kwargs or {})),
                        timeout)


# --------------------------------------------------------- receiving side


def _rebuild_exception(exc_type: Optional[type], text: str) -> BaseException:
    """The remote exception rebuilt as its own type with the remote traceback
    as message (as torch.distributed.rpc does); ``RuntimeError`` when the type
    cannot be rebuilt."""
    if exc_type is None or not isinstance(exc_type, type) or not issubclass(exc_type, Exception):
        return RuntimeError(text)
    try:
        return exc_type(text)
    except Exception as e:
        return RuntimeError(
            f"Failed to create original exception type. Error msg was {e} "
            f"Original exception on remote side was {text}")


class _PlainError(RuntimeError):
    """An error the caller receives as a plain ``RuntimeError`` with this
    message as is (torch's errors raised by its C++ side, not Python's)."""


def _exception_payload(st: _State, e: BaseException) -> bytes:
    if isinstance(e, (torch.jit.Error, _PlainError)):
        # torch answers a TorchScript function's error as a RuntimeError
        # carrying the interpreter's message as is.
        return pickle.dumps((None, str(e)))
    text = (f"On {st.me}:\n{e!r}\n"
            + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
    etype = RuntimeError if getattr(type(e), "_rpc_remote_type", None) else type(e)
    try:
        return pickle.dumps((etype, text))
    except Exception:
        return pickle.dumps((None, text))


_twins: dict[type, Optional[type]] = {}
_twins_lock = threading.Lock()


def _runtime_twin(etype: type) -> Optional[type]:
    """A class deriving from ``RuntimeError`` and ``etype`` (cached; named
    ``RuntimeError`` as torch shows it), or ``None`` when Python cannot make
    one (instance layouts that conflict, e.g. ``OSError``)."""
    with _twins_lock:
        if etype in _twins:
            return _twins[etype]
    bases = (etype,) if issubclass(etype, RuntimeError) else (RuntimeError, etype)
    try:
        twin: Optional[type] = type("RuntimeError", bases, {
            "__module__": "builtins",
            "__qualname__": "RuntimeError",
            "__str__": BaseException.__str__,
            "__reduce__": lambda self: (RuntimeError, self.args),
            "_rpc_remote_type": etype,
        })
    except Exception:
        twin = None
    with _twins_lock:
        return _twins.setdefault(etype, twin)


def _as_rpc_error(exc: BaseException) -> BaseException:
    """A remote exception as ``rpc_sync`` and ``rpc_async(...).wait()`` raise
    it in torch: ``ValueError("<TypeName>: ...")`` for the ValueError family,
    ``TypeError(...)`` for the TypeError family, ``RuntimeError(...)`` for
    every other type; the latter is an instance of a class deriving from
    both ``RuntimeError`` and the remote type where Python allows, so that
    ``except KeyError`` still catches it."""
    etype = type(exc)
    msg = f"{etype.__name__}: {exc}"
    if issubclass(etype, ValueError):
        return ValueError(msg)
    if issubclass(etype, TypeError):
        return TypeError(msg)
    twin = None if etype is RuntimeError else _runtime_twin(etype)
    if twin is None:
        return RuntimeError(msg)
    try:
        out = BaseException.__new__(twin, msg)
        out.args = (msg,)
        return out  # type: ignore[no-any-return]
    except Exception:
        return RuntimeError(msg)


def _reply(st: _State, reply: Any, ok: bool, value: Any, cid: Optional[int] = None) -> None:
    agent = st.agent
    if agent is None:
        return
    if ok:
        grad_out: Optional[list[torch.Tensor]] = None
        if cid is not None:
            key = (st.me.id, next(_ids))
            value = _CtxResult(cid, key, value)
            grad_out = []
        prev = (getattr(_local, "dest_name", None), getattr(_local, "keep", None))
        _local.dest_name, _local.keep = st.workers[reply.peer].name, None
        try:
            payload, tensors = _dumps(value, reply.peer, grad_out)
        except Exception as e:
            # torch: the result's pickling error reaches the caller as a
            # RuntimeError("<Type>: <message>") whatever the call.
            ok, value = False, _PlainError(f"{type(e).__name__}: {e}")
        finally:
            _local.dest_name, _local.keep = prev
        if ok and grad_out is not None:
            _autograd._record_send(cid, key, reply.peer, grad_out,  # type: ignore[arg-type]
                                   known=bool(grad_out))
    if not ok:
        payload, tensors = _exception_payload(st, value), []
    try:
        agent.respond(reply, _core.RPC_OK if ok else _core.RPC_ERROR, payload,
                      _tensor_bufs(tensors), tensors)
    except RuntimeError:
        pass  # the caller is gone; its side reports the loss


def _reply_when_done(st: _State, reply: Any, fut: Any, cid: Optional[int] = None) -> None:
    def done(f: Future) -> None:
        try:
            v = f.wait()
        except BaseException as e:
            _reply(st, reply, False, e)
        else:
            _reply(st, reply, True, v, cid)
        _finish(st)

    fut.add_done_callback(done)


def _finish(st: _State) -> None:
    with st.idle:
        st.active -= 1
        if st.active == 0:
            st.idle.notify_all()


def _run_call(func: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[bool, Any]:
    """Runs a request's function; (True, future) when it is asynchronous."""
    if getattr(func, "_wrapped_async_rpc_function", None) is not None:
        fut = func(*args, **kwargs)
        if not isinstance(fut, (Future, torch._C.Future)):
            raise _PlainError(
                f"Functions decorated with @rpc.functions.async_execution must return a "
                f"torch.futures.Future object, but got {type(fut)}")
        return True, fut
    try:
        return False, func(*args, **kwargs)
    except Exception as e:
        # torch runs its builtin ops (torch.add, ...) through TorchScript: their
        # errors arrive as a RuntimeError with the op's own message.
        if torch.jit._builtins._find_builtin(func) is not None:
            raise _PlainError(str(e)) from e
        raise


def _on_request(msg: Any) -> None:
    """Runs on an agent request thread (holding the GIL only while Python runs)."""
    st = _state
    if st is None:
        return
    reply = msg.reply_to()
    with st.idle:
        st.active += 1
    try:
        try:
            body, leaves = _loads_leaves(msg)
            kind = body[0]
        except Exception as e:
            _reply(st, reply, False, RuntimeError(
                f"malformed RPC message from {st.workers[reply.peer].name}: {e}"))
            _finish(st)
            return
        cid = None
        if kind == "ctx":
            _, (cid, key), body = body
            kind = body[0]
            _autograd._record_recv(cid, reply.peer, key, leaves)
        try:
            with _autograd._using(cid):
                if kind == "call":
                    is_async, out = _run_call(*body[1:])
                else:
                    out = _rref._handle(kind, body, reply.peer)
                    is_async = isinstance(out, (Future, torch._C.Future))
            if is_async:
                _reply_when_done(st, reply, out, cid)
                return
        except BaseException as e:
            _reply(st, reply, False, e)
        else:
            _reply(st, reply, True, out, cid)
        _finish(st)
    except BaseException:  # never let an exception escape into the agent thread
        _finish(st)
        raise


def _outcome(st: _State, to: int, timeout: float, msg: Any, torch_exc: bool = False,
             ) -> tuple[bool, Any]:
    """(True, value) or (False, exception) from a response or local failure;
    with ``torch_exc`` a remote exception as rpc_sync/rpc_async raise it."""
    name = st.workers[to].name if 0 <= to < len(st.workers) else str(to)
    status = msg.status
    try:
        if status == _core.RPC_OK:
            value, leaves = _loads_leaves(msg)
            if isinstance(value, _CtxResult):
                _autograd._record_recv(value.cid, to, value.key, leaves)
                value = value.value
            return True, value
        if status == _core.RPC_ERROR:
            etype, text = _loads(msg)
            if etype is None:  # a TorchScript error, or a type that cannot travel
                return False, RuntimeError(text)
            exc = _rebuild_exception(etype, text)
            return False, (_as_rpc_error(exc) if torch_exc else exc)
        detail = bytes(msg.payload()).decode("utf-8", "replace")
        msg.release()
    except BaseException as e:
        return False, RuntimeError(f"malformed RPC response from {name}: {e}")
    if status == _core.RPC_TIMEOUT:
        err = RuntimeError(
            f"RPC to {name} timed out: RPC ran for more than set timeout "
            f"({int(timeout * 1000)} ms) and will now be marked with an error")
        err._rpc_timeout = True  # type: ignore[attr-defined]  # RRef creation reads it
        return False, err
    if status == _core.RPC_PEER_LOST:
        return False, RuntimeError(
            f"RPC to {name} failed: worker {name} (rank {to}) is gone: {detail}")
    return False, RuntimeError(f"RPC to {name} failed: {detail}")


def _complete(st: _State, entry: _Pending, msg: Any) -> None:
    ok, value = _outcome(st, entry.to, entry.timeout, msg, entry.torch_exc)
    if entry.fut.done():
        return  # completed by its holder meanwhile (set_result): the reply is dropped
    try:
        if ok:
            entry.fut.set_result(value)
        else:
            entry.fut.set_exception(value)
    except RuntimeError:
        pass  # completed meanwhile


def _on_response(msg: Any) -> None:
    """Runs on an agent completion thread."""
    st = _state
    if st is None:
        return
    with st.lock:
        entry = st.pending.pop(msg.id, None)
        if entry is None:
            st.early[msg.id] = msg
            return
    _complete(st, entry, msg)


def _send_raw(to: Union[str, int, WorkerInfo], payload: bytes, timeout: float = -1.0) -> Future:
    """Sends an arbitrary payload as a request (tests of malformed messages)."""
    st = _require()
    w = _worker(to)
    t = _timeout_of(st, timeout)
    fut: Future = Future()
    cid = st.agent.call(w.id, payload, [], _agent_timeout(t), None)
    entry = _Pending(fut, w.id, t)
    _track(st, cid, entry)
    return fut


# ------------------------------------------------------------------ shutdown


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Stops this worker's agent.

    With ``graceful=True`` it first releases this worker's RRefs, waits until
    every worker of the job has called ``shutdown`` and until all outstanding
    calls (and RRef deletions) have completed, then closes. With
    ``graceful=False`` it closes at once. Either way no future is left
    pending: calls still outstanding when the agent closes fail with
    ``RuntimeError``.

    Args:
      graceful (bool): Wait for the other workers and outstanding work.
      timeout (float): Seconds to wait for the others; 0 (default): the
        agent's ``rpc_timeout`` (at least 60 s).

    Returns:
      None.

    Raises:
      RuntimeError: when RPC is not initialized (before ``init_rpc``, or a
        second ``shutdown``).

    Example::

        >>> result = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1), 1))
        >>> rpc.shutdown()
    """
    global _state
    st = _require()
    wait = float(timeout) if timeout and timeout > 0 else max(st.timeout, 60.0)
    try:
        if graceful:
            # Requests from other workers may still use this worker's RRefs
            # until everyone has arrived and drained: only garbage goes first.
            _rref._release_all(wait, live=False)
            _store_barrier(st, "shutdown/arrive", wait)
            _drain(st, wait)
            _rref._release_all(wait, live=True)
            _store_barrier(st, "shutdown/drained", wait)
    finally:
        st.shutting_down = True
        _rref._stop()
        agent, st.agent = st.agent, None
        if agent is not None:
            agent.shutdown()
        _fail_pending(st)
        _state = None
        if graceful:
            _leave(st, wait)


def _fail_pending(st: _State) -> None:
    """Fails every call still waiting for its reply (the agent is closed:
    none will come)."""
    with st.lock:
        st.closed = True
        left = list(st.pending.values())
        st.pending.clear()
        st.early.clear()
    for entry in left:
        name = st.workers[entry.to].name
        if not entry.fut.done():
            try:
                entry.fut.set_exception(RuntimeError(
                    f"RPC to {name} failed: the RPC agent shut down before the call completed"))
            except RuntimeError:
                pass  # completed meanwhile


def _drain(st: _State, wait: float) -> None:
    """Waits until this worker's calls have completed and no request runs."""
    import time

    deadline = time.monotonic() + wait
    with st.idle:
        while st.active > 0 and time.monotonic() < deadline:
            st.idle.wait(0.05)
    while True:
        with st.lock:
            futs = [p.fut for p in st.pending.values()]
        if not futs:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            return
        _wait_all(futs, left)


def _wait_all(futs: list[Future], timeout: float) -> None:
    done = threading.Event()
    torch.futures.collect_all(futs).add_done_callback(lambda _f: done.set())
    done.wait(timeout)


def _leave(st: _State, wait: float) -> None:
    _leave_store(st.store, f"{st.prefix}/left", len(st.workers), st.hosts_store, wait)


def _leave_store(store: Any, key: str, n: int, hosts_store: bool, wait: float) -> None:
    """The worker hosting the store keeps it up until every worker has left."""
    try:
        if int(store.add(key, 1)) == n:
            store.set(f"{key}/done", "1")
        if hosts_store:
            store.wait([f"{key}/done"], timedelta(seconds=min(wait, 30.0)))
    except Exception:
        pass


_ids = itertools.count()


def _exit_shutdown() -> None:
    """At interpreter exit: close the agent (no waiting) so that no agent
    thread calls into a finalising interpreter."""
    if _state is not None:
        try:
            shutdown(graceful=False)
        except Exception:
            pass


# Imported last: both modules use this one.
from . import autograd as _autograd  # noqa: E402
from . import rref as _rref  # noqa: E402
