"""The RPC front end: ``torch.distributed.rpc``'s functions on ringlet's agent.

This module starts and stops the agent (``init_rpc``, ``shutdown``: the
job's store, the rendezvous of the workers, their barriers) and offers the
calls (``rpc_sync``, ``rpc_async``, ``remote``) and queries. What messages
carry and how they travel is ``ringlet.rpc._agent``'s; RRefs are
``ringlet.rpc.rref``'s, distributed autograd ``ringlet.rpc.autograd``'s.
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import secrets
import threading
from datetime import timedelta
from typing import Any, Callable, Optional, Union

from torch.futures import Future

from .. import _core
from . import _agent
from . import rref as _rref
from ._agent import (
    WorkerInfo,
    _agent_timeout,
    _current_agent_state,
    _drain,
    _fail_pending,
    _on_request,
    _on_response,
    _Pending,
    _require,
    _send,
    _send_sync,
    _State,
    _timeout_of,
    _track,
    _validate_name,
)
from .backend_registry import (
    BackendType,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
)
from .constants import DEFAULT_RPC_TIMEOUT_SEC, UNSET_RPC_TIMEOUT
from .rref import RRef

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

_atexit_registered = False
_init_lock = threading.Lock()


def is_available() -> bool:
    """True: ringlet's RPC is always built in.

    Returns:
      bool: ``True``.

    Example::

        >>> rpc.is_available()
        True
    """
    return True


# ----------------------------------------------------------------- bootstrap


def _store_for(init_method: str, rank: int, world: int, timeout: float) -> tuple[Any, bool]:
    from ..core.store import make_store

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
    store = make_store(addr, int(p_raw), rank, world, timeout)
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
    from ..core import connection
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
        if _agent._state is not None:
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
        ip = connection.local_ip(master)
        agent = _core.RpcAgent(
            rank, token, "0.0.0.0:0", _on_request, _on_response,
            request_threads=threads,
            completion_threads=4,
            single_copy_min=_single_copy_min(),
        )
        me = {"name": name, "addr": f"{ip}:{agent.port}", "host": connection.host_id()}
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
        st = _State(
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
        _agent._set_state(st)
        _rref._start()
        if not _atexit_registered:
            atexit.register(_exit_shutdown)
            globals()["_atexit_registered"] = True
        # Every worker is reachable before anyone calls.
        _store_barrier(st, "init", wait)


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
    st = _agent._state
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
    return _agent._state is not None


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


# ----------------------------------------------------------------- calling


def _call(func: Callable[..., Any], args: Any, kwargs: Any) -> tuple[Any, ...]:
    """The request that runs ``func(*args, **kwargs)`` on the callee."""
    if not callable(func):
        raise TypeError(f"function should be callable, got {type(func).__name__}")
    return ("call", func, tuple(args or ()), dict(kwargs or {}))


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
    call = _call(func, args, kwargs)
    return _send(_worker(to), call, timeout, torch_exc=True)


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
    call = _call(func, args, kwargs)
    return _send_sync(_worker(to), call, timeout, torch_exc=True)


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
    call = _call(func, args, kwargs)
    return RRef._remote(_worker(to), call, timeout)


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
        _agent._set_state(None)
        if graceful:
            _leave(st, wait)


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


def _exit_shutdown() -> None:
    """At interpreter exit: close the agent (no waiting) so that no agent
    thread calls into a finalising interpreter."""
    if _agent._state is not None:
        try:
            shutdown(graceful=False)
        except Exception:
            pass


def __getattr__(name: str) -> Any:
    # The agent's internals lived here before ``_agent`` took them; code that
    # reads them from this module still finds them (``_state`` too, which
    # ``init_rpc`` and ``shutdown`` rebind there).
    if name.startswith("_") and not name.startswith("__") and hasattr(_agent, name):
        return getattr(_agent, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
