"""The RPC agent's Python side: its state, and the meaning of its messages.

The Rust agent (``_core.RpcAgent``) owns connections, framing, the job token,
the request and completion thread pools, deadlines and peer-death detection.
This module owns this process's agent state (set by ``init_rpc``, cleared
by ``shutdown``) and gives payloads their meaning: a request is a pickled
``(kind, ...)`` tuple whose tensors are pulled out by ``persistent_id`` and
travel as raw bytes beside it (same-host large tensors single-copy), and a
response is the pickled result or a description of the remote exception.

It depends on no other part of ``ringlet.rpc`` but distributed autograd's
records (``_dist_context``): the modules above register what they serve,
request kinds (``_register_kinds``) and pickling of their types
(``_register_reducer``), as ``ringlet.rpc.rref`` does for RRefs.
"""

from __future__ import annotations

import io
import itertools
import pickle
import re
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

import torch
from torch.futures import Future

from .. import _core
from . import _dist_context as _ctx
from .constants import UNSET_RPC_TIMEOUT

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


_state: Optional[_State] = None  # set by init_rpc, cleared by shutdown
_local = threading.local()
_ids = itertools.count()  # this worker's message keys in distributed autograd contexts

# What the modules above this one serve: request kind -> handler(kind, body,
# sender) returning the result or a Future (``"call"`` is this module's),
# and type -> reducer of the message pickler (exact types).
_handlers: dict[str, Callable[[str, tuple[Any, ...], int], Any]] = {}
_reducers: dict[type, Callable[[Any], Any]] = {}


def _set_state(st: Optional[_State]) -> None:
    """Installs (``init_rpc``) or clears (``shutdown``) this process's agent state."""
    global _state
    _state = st


def _register_kinds(kinds: tuple[str, ...],
                    handler: Callable[[str, tuple[Any, ...], int], Any]) -> None:
    """Makes ``handler(kind, body, sender)`` run the requests of ``kinds``
    (``body`` is the request tuple, ``body[0] == kind``); it returns the
    result, or a Future the reply waits for."""
    for kind in kinds:
        _handlers[kind] = handler


def _register_reducer(cls: type, reduce: Callable[[Any], Any]) -> None:
    """Makes messages pickle instances of exactly ``cls`` with ``reduce``
    (a ``copyreg`` reducer; ``_local.dest`` is the destination's rank)."""
    _reducers[cls] = reduce
    if _Pickler.dispatch_table:
        _Pickler.dispatch_table[cls] = reduce


def _require() -> _State:
    st = _state
    if st is None:
        raise RuntimeError("RPC has not been initialized. Call ringlet.rpc.init_rpc first.")
    return st


def _current_agent_state() -> _State:
    st = _state
    if st is None:
        raise RuntimeError("Current RPC agent is not set! Did you initialize the RPC framework "
                           "(e.g. by calling `rpc.init_rpc`)?")
    return st


def _validate_name(name: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"worker name must be a str, got {type(name).__name__}")
    if not name or not _NAME_RE.match(name) or len(name) >= 128:
        raise RuntimeError("Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty "
                           f"and shorter than 128 chars, but got {name}")


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
            out, anchor = _ctx._recv_node(out)
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


def _reduce_script_function(f: Any) -> Any:
    return (_load_script_function, (f.qualified_name,))


class _Pickler(pickle.Pickler):
    dispatch_table: ClassVar[dict[Any, Any]] = {}


def _dispatch_table() -> dict[Any, Any]:
    import copyreg

    table = copyreg.dispatch_table.copy()
    table[torch.Tensor] = _reduce_tensor
    table[torch.nn.Parameter] = _reduce_tensor
    table.update(_reducers)  # RRefs (ringlet.rpc.rref)
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
    cid = _ctx._current_id()
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
        _ctx._record_send(cid, key, to.id, grad_out)  # type: ignore[arg-type]
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
            _ctx._record_send(cid, key, reply.peer, grad_out,  # type: ignore[arg-type]
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


def _handler(kind: Any) -> Callable[[str, tuple[Any, ...], int], Any]:
    handler = _handlers.get(kind) if isinstance(kind, str) else None
    if handler is None:
        raise RuntimeError(f"unknown RPC request kind {kind!r}")
    return handler


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
            _ctx._record_recv(cid, reply.peer, key, leaves)
        try:
            with _ctx._using(cid):
                if kind == "call":
                    is_async, out = _run_call(*body[1:])
                else:
                    out = _handler(kind)(kind, body, reply.peer)
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
                _ctx._record_recv(value.cid, to, value.key, leaves)
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


# ------------------------------------------------------------------ shutdown


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
