"""The engine on torch tensors: the one adapter every door calls.

Tensor checks, dtype and reduce-type names, and the native module's
operations called with tensors instead of data pointers, with the GIL
released (coalesced for many small tensors; jobs that span hosts run in two
levels inside the engine). The torch_xla-style API (:mod:`ringlet.xla`),
``torch.ops.ringlet`` (:mod:`ringlet.ops`), the ``torch.distributed`` backend,
DDP, Bagua's API and DiLoCo all go through here, so a check or a dtype rule
lives once, and the doors pass tensors, never raw pointers. (The old path
``ringlet._engine`` is this module, deprecated.)

Every engine call takes contiguous CPU tensors the caller keeps alive for
the call, and blocks with the GIL released.

Example:
  >>> from ringlet.core import engine
  >>> engine.all_reduce(comm, torch.ones(4))       # in place, a sum
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Callable, Optional, TypeVar, Union

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.autograd import profiler as _profiler

from .. import _core
from . import groups
from .groups import get_ordinal

__all__ = [
    "COALESCE_BYTES", "DTYPE_NAMES", "REDUCE_AND", "REDUCE_MAX", "REDUCE_MIN", "REDUCE_MUL",
    "REDUCE_OR", "REDUCE_SUM", "REDUCE_TYPES", "STRIDED", "TensorLike", "all_gather",
    "all_reduce", "all_reduce_coalesced", "all_to_all_v", "apply", "apply_scale", "as_tensor",
    "broadcast", "check", "check_int", "check_reduce_type", "disjoint", "dtype_name",
    "error_rank", "gather", "nbytes", "outer_sync", "overlaps", "plain_dtype", "ptr",
    "pseudo_gradient", "recv", "reduce_scatter", "scatter", "send", "span", "storage_ptr",
    "submit",
    "traced", "world_all_gather", "world_all_reduce", "world_all_reduce_into",
    "world_broadcast", "world_reduce_scatter",
]
REDUCE_SUM = "sum"
REDUCE_MUL = "mul"
REDUCE_AND = "and"
REDUCE_OR = "or"
REDUCE_MIN = "min"
REDUCE_MAX = "max"

REDUCE_TYPES = (REDUCE_SUM, REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, REDUCE_MAX)

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
}

# Tensors at most this large are flattened together into one collective call.
COALESCE_BYTES = 4 << 20

TensorLike = Union[torch.Tensor, np.ndarray]


def error_rank() -> int:
    """This process's rank for error messages: ringlet's, else the default
    torch.distributed group's (the c10d backend without ringlet.init())."""
    if groups.is_initialized():
        return get_ordinal()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


_F = TypeVar("_F", bound=Callable[..., Any])


def traced(fn: _F) -> _F:
    """Shows every call of ``fn`` as a ``ringlet::<name>`` range in
    ``torch.profiler`` traces; costs one flag check when no profiler runs."""
    label = f"ringlet::{fn.__name__.lstrip('_')}"

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if not _profiler._is_profiler_enabled:
            return fn(*args, **kwargs)
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return traced  # type: ignore[return-value]


def as_tensor(x: Any, what: str, write: bool = False) -> torch.Tensor:
    """``x`` as a tensor (numpy arrays share memory); ``write``: the engine
    writes into it, so a read-only array is refused instead of faulting."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if x.flags.writeable:
            return torch.from_numpy(x)
        if write:
            raise ValueError(
                f"rank {error_rank()}: {what} is a read-only numpy array and ringlet writes into "
                "it; pass a writable copy (np.array(x))"
            )
        with warnings.catch_warnings():  # torch warns about non-writable arrays
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(x)
    raise TypeError(
        f"rank {error_rank()}: {what} must be a torch.Tensor or numpy.ndarray, "
        f"got {type(x).__name__}"
    )


def check(t: torch.Tensor, what: str) -> str:
    """Validates a tensor the engine will touch; returns its dtype name."""
    if not t.is_cpu:
        raise ValueError(
            f"rank {error_rank()}: {what} is on device '{t.device}'; ringlet collectives take CPU "
            "tensors (move it with .cpu())"
        )
    if t.layout != torch.strided:
        raise ValueError(
            f"rank {error_rank()}: {what} has layout {t.layout}; only dense tensors work"
        )
    name = DTYPE_NAMES.get(t.dtype)
    if name is None:
        supported = ", ".join(str(d).replace("torch.", "") for d in DTYPE_NAMES)
        raise TypeError(
            f"rank {error_rank()}: {what} has unsupported dtype {t.dtype} (supported: {supported})"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"rank {error_rank()}: {what} is not contiguous; call .contiguous() on it first"
        )
    return name


def check_reduce_type(reduce_type: Any) -> str:
    """``reduce_type`` when it is one of :data:`REDUCE_TYPES`; ValueError else."""
    if reduce_type not in REDUCE_TYPES:
        raise ValueError(
            f"rank {error_rank()}: unknown reduce type {reduce_type!r}; expected one of "
            + ", ".join(f"REDUCE_{r.upper()}" for r in REDUCE_TYPES)
        )
    return str(reduce_type)


def nbytes(t: torch.Tensor) -> int:
    """``t``'s size in bytes."""
    return t.nbytes


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte of memory."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def apply_scale(t: torch.Tensor, scale: float) -> None:
    """Multiplies ``t`` by ``scale`` in place (integers through float64)."""
    if scale == 1.0:
        return
    if t.dtype == torch.bool:
        raise ValueError(f"rank {error_rank()}: cannot scale a bool tensor by {scale}")
    t = t.detach()
    if t.is_floating_point():
        t.mul_(scale)
    else:
        t.copy_(t.double().mul_(scale).to(t.dtype))


STRIDED = torch.strided


def world_all_reduce(t: Any, reduce_type: str) -> bool:
    """All-reduces a contiguous CPU tensor in place over the whole world with
    the fewest Python steps. Returns False, having done nothing, when
    anything needs the general path: not initialised or a world of one, or a
    dtype, layout, reduce type or device the checks of that path must name
    (a job spanning hosts runs it in two levels inside the engine). The
    hottest call of all: the checks of _world_plain are written out here
    (each call and attribute read costs 30-100 ns, a third of a 4 KiB
    call's Python time)."""
    state = groups._state
    if (state is None or type(t) is not torch.Tensor or state.world_size == 1
            or reduce_type not in REDUCE_TYPES):
        return False
    name = DTYPE_NAMES.get(t.dtype)
    if name is None or t.layout is not STRIDED or not t.is_cpu or not t.is_contiguous():
        return False
    state.comm.all_reduce(t.data_ptr(), t.nbytes, name, reduce_type)
    return True


def world_all_reduce_into(t: Any, reduce_type: str) -> Optional[torch.Tensor]:
    """The out-of-place twin of world_all_reduce: a new tensor holding the
    world's reduction of contiguous CPU tensor ``t`` (``t`` untouched; a small
    one is read straight into the engine's slot, no copy first), or None,
    having done nothing, when the general path must run."""
    plain = _world_plain(t)
    if plain is None or reduce_type not in REDUCE_TYPES:
        return None
    state, name = plain
    out = torch.empty_like(t)
    state.comm.all_reduce_into(t.data_ptr(), out.data_ptr(), t.nbytes, name, reduce_type)
    return out


def plain_dtype(t: Any) -> Optional[str]:
    """The dtype name of a tensor the engine can take as it is (a plain
    contiguous dense CPU tensor), else None (the general path then checks
    and names the problem)."""
    if type(t) is not torch.Tensor:
        return None
    name = DTYPE_NAMES.get(t.dtype)
    if name is None or t.layout is not STRIDED or not t.is_cpu or not t.is_contiguous():
        return None
    return name


def _world_plain(t: Any) -> Any:
    """``(world state, dtype name)`` when plain tensor ``t`` (see plain_dtype) may
    take a world collective's fast path (initialised, more than one rank),
    else None: the checks of plain_dtype and of the world in one call (each call
    costs about 60 ns of a 3 us one)."""
    state = groups._state
    if state is None or type(t) is not torch.Tensor or state.world_size == 1:
        return None
    name = DTYPE_NAMES.get(t.dtype)
    if name is None or t.layout is not STRIDED or not t.is_cpu or not t.is_contiguous():
        return None
    return state, name


def _fits(value: torch.Tensor, output: Any, nbytes: int, rows: int) -> bool:
    """Whether ``output`` can take the result as it is: a plain tensor of
    ``value``'s dtype, ``nbytes`` long, ``rows`` rows and ``value``'s other
    dimensions, not overlapping ``value``."""
    if (type(output) is not torch.Tensor or output.dtype is not value.dtype
            or output.layout is not STRIDED or not output.is_cpu
            or not output.is_contiguous() or output.nbytes != nbytes):
        return False
    if (value.dim() != 1 or output.dim() != 1) and output.shape != (rows, *value.shape[1:]):
        return False
    pa, pb = value.data_ptr(), output.data_ptr()
    return pa + value.nbytes <= pb or pb + nbytes <= pa


def disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share no byte."""
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa + a.nbytes <= pb or pb + b.nbytes <= pa


def world_all_gather(value: Any, output: Any) -> Optional[torch.Tensor]:
    """Fast path of the world all-gather along dim 0 (see world_all_reduce);
    returns the output, or None having done nothing."""
    plain = _world_plain(value)
    if plain is None or value.dim() == 0:
        return None
    state, name = plain
    nb = value.nbytes
    total = nb * state.world_size
    rows = value.shape[0] * state.world_size
    if output is None:
        output = torch.empty((rows, *value.shape[1:]), dtype=value.dtype)
    elif not _fits(value, output, total, rows):
        return None
    state.comm.all_gather(value.data_ptr(), nb, output.data_ptr(), total, name)
    return output


def world_reduce_scatter(
    reduce_type: str, value: Any, scale: float, shards: int, output: Any
) -> Optional[torch.Tensor]:
    """Fast path of the world reduce-scatter along dim 0 into ``shards``
    blocks (see world_all_reduce); returns the output, or None having done
    nothing (also when ``shards`` is not the world size: the general path
    names that)."""
    plain = _world_plain(value)
    if plain is None or reduce_type not in REDUCE_TYPES or value.dim() == 0:
        return None
    state, name = plain
    nb = value.nbytes
    if shards != state.world_size:
        return None
    rows = value.shape[0]
    if rows % shards:
        return None
    if output is None:
        output = torch.empty((rows // shards, *value.shape[1:]), dtype=value.dtype)
    elif not _fits(value, output, nb // shards, rows // shards):
        return None
    state.comm.reduce_scatter(
        value.data_ptr(), nb, output.data_ptr(), nb // shards, name, reduce_type
    )
    if scale != 1.0:
        apply_scale(output, scale)
    return output


def world_broadcast(t: Any, root: Any) -> bool:
    """Fast path of the world broadcast of one tensor in place (see
    world_all_reduce); False, having done nothing, when it does not apply."""
    plain = _world_plain(t)
    if plain is None or type(root) is not int:
        return False
    state, name = plain
    nb = t.nbytes
    if not 0 <= root < state.world_size:
        return False
    state.comm.broadcast(t.data_ptr(), nb, name, root)
    return True


def all_reduce_coalesced(
    comm: Any, tensors: list[torch.Tensor], reduce_type: str, scale: float
) -> None:
    """All-reduces contiguous CPU tensors in place; small tensors of one dtype
    are flattened into a single collective call."""
    if len(tensors) == 1:  # fast path: no grouping, no copies
        t = tensors[0]
        all_reduce(comm, t, reduce_type, check(t, "input"))
        apply_scale(t, scale)
        return
    # The engine writes through raw pointers; the flatten/copy-back below goes
    # through torch, so it works on views autograd does not track.
    tensors = [t.detach() for t in tensors]
    names = [check(t, f"inputs[{i}]") for i, t in enumerate(tensors)]
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    for t, name in zip(tensors, names):
        if nbytes(t) > COALESCE_BYTES:
            all_reduce(comm, t, reduce_type, name)
            apply_scale(t, scale)
        else:
            small.setdefault(t.dtype, []).append(t)
    for dtype, group in small.items():
        name = DTYPE_NAMES[dtype]
        if len(group) == 1:
            flat = group[0]
        else:
            flat = _flatten_dense_tensors(group)  # one C++ call, not one per tensor
        all_reduce(comm, flat, reduce_type, name)
        apply_scale(flat, scale)
        if len(group) > 1:
            views = _unflatten_dense_tensors(flat, group)
            if hasattr(torch, "_foreach_copy_"):
                torch._foreach_copy_(group, views)  # one call instead of one per tensor
            else:  # torch < 2.2
                for g, v in zip(group, views):
                    g.copy_(v)



def check_int(value: Any, what: str) -> int:
    """``value`` when it is an int (not a bool); TypeError naming ``what`` else."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"rank {error_rank()}: {what} must be an int, got {type(value).__name__}")
    return value


def dtype_name(t: torch.Tensor) -> str:
    """The engine's name of ``t``'s dtype (``"float32"``, ...); TypeError for
    a dtype the engine does not carry."""
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(f"ringlet's engine does not carry {t.dtype} tensors") from None


#: ``ptr(t)``: the address of tensor ``t``'s first element, for the engine and
#: to tell tensors' memory apart (``torch.Tensor.data_ptr`` itself, so a hot
#: path pays no call of ours for it).
ptr: Callable[[torch.Tensor], int] = torch.Tensor.data_ptr


def storage_ptr(t: torch.Tensor) -> int:
    """The address of the storage ``t`` views (tensors viewing one storage share it)."""
    return t.untyped_storage().data_ptr()


def span(t: torch.Tensor) -> tuple[int, int]:
    """``t``'s (data pointer, bytes)."""
    return t.data_ptr(), t.numel() * t.element_size()


def all_reduce(comm: Any, t: torch.Tensor, op: str = "sum", dtype: Optional[str] = None) -> None:
    """``t`` reduced over ``comm``'s ranks, in place (a communicator that spans
    hosts runs it in two levels inside the engine).

    Args:
      comm (ringlet._core.Communicator): The ranks.
      t (torch.Tensor): Contiguous CPU tensor.
      op (str): ``"sum"``, ``"min"``, ``"max"``, ...
      dtype (str, optional): The engine's name of ``t``'s dtype, where the
        caller has it (see :func:`check`); default: :func:`dtype_name`.

    Example:
      >>> all_reduce(comm, flags, "sum")
    """
    comm.all_reduce(t.data_ptr(), t.nbytes, dtype or dtype_name(t), op)


def submit(queue: Any, comm: Any, call: str, tensors: Sequence[torch.Tensor], dtype: str,
           arg: Any, keep: Any, wake: bool = True,
           before: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
           after: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), divide: int = 0) -> Any:
    """Queues one engine call on the progress queue ``queue`` as the call
    itself: the queue's thread (or a waiter) runs it with no Python in
    between and never takes the GIL for it.

    Args:
      queue (ringlet._core.Progress): The group's queue (issue order).
      comm (ringlet._core.Communicator): The ranks.
      call (str): ``"all_reduce"`` (``arg``: the reduce op) or ``"broadcast"``
        (``arg``: the root) in place on ``tensors[0]``; ``"all_gather"``,
        ``"reduce_scatter"`` (``arg``: the reduce op) or ``"all_to_all_v"``
        (``arg``: the send and receive counts in elements) from ``tensors[0]``
        into ``tensors[1]`` (disjoint); ``"list"`` (``arg``: ``(kind, inputs,
        root, reduce op)``, ``kind`` one of ``all_gather``, ``gather``,
        ``scatter``, ``all_to_all``, ``reduce_scatter``; ``tensors``: the
        list's inputs, then its outputs, which may alias; staged through
        buffers the running thread keeps); ``"barrier"`` (no tensors).
      tensors (list[torch.Tensor]): Contiguous CPU tensors, untouched until
        the job ran.
      dtype (str): The engine's name of their dtype.
      arg (str | int | None): As ``call`` says.
      keep (object): What owns the tensors, including those of ``before``
        and ``after`` (held until the job ended).
      wake (bool): Wake the queue's thread (False: the caller waits at once).
      before (list[tuple[torch.Tensor, torch.Tensor]]): ``(source,
        destination)`` pairs of contiguous tensors of equal byte size, copied
        in order by the job before the call (a list staged into one flat
        buffer).
      after (list[tuple[torch.Tensor, torch.Tensor]]): Likewise, copied once
        the call succeeded (a flat result out into a list).
      divide (int): When non-zero, the result of an ``"all_reduce"`` (the
        tensor) or ``"reduce_scatter"`` (the output) is divided by it before
        ``after`` (ReduceOp.AVG: true division for floating point, float16
        and bfloat16 through float32; truncating for integers).

    Returns:
      ringlet._core.NativeJob: Its ticket, and its error once it ran; None
      when ``wake`` is False and the queue was idle: the call then ran at once
      on this thread (GIL released) and raised its error, if any.

    Example:
      >>> job = submit(queue, comm, "all_reduce", [t], "float32", "sum", [t])
      >>> queue.wait(job.ticket) and job.error() is None
      True
    """
    return queue.submit_engine(comm, call, [(t.data_ptr(), t.nbytes) for t in tensors], dtype,
                               arg, keep, wake, _copies(before), _copies(after), divide)


def _copies(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[int, int, int]]:
    """``(source, destination)`` tensor pairs as the byte copies a native job
    runs: ``(source address, destination address, bytes)``."""
    out = []
    for src, dst in pairs:
        if not (src.is_contiguous() and dst.is_contiguous()) or src.nbytes != dst.nbytes:
            raise ValueError(
                f"rank {error_rank()}: a staged copy needs contiguous tensors of equal size, "
                f"got {src.nbytes} and {dst.nbytes} bytes"
            )
        out.append((src.data_ptr(), dst.data_ptr(), src.nbytes))
    return out


def broadcast(comm: Any, t: torch.Tensor, root: int, dtype: Optional[str] = None) -> None:
    """``t`` of ``comm``'s rank ``root`` on every rank, in place.

    Example:
      >>> broadcast(comm, weights, 0)
    """
    comm.broadcast(t.data_ptr(), t.nbytes, dtype or dtype_name(t), root)


def all_gather(comm: Any, inp: torch.Tensor, out: torch.Tensor,
               dtype: Optional[str] = None) -> None:
    """All-gathers contiguous ``inp`` into ``out`` (rank blocks in rank order).

    Example:
      >>> all_gather(comm, mine, everyone)
    """
    comm.all_gather(inp.data_ptr(), inp.nbytes, out.data_ptr(), out.nbytes,
                    dtype or dtype_name(inp))


def reduce_scatter(comm: Any, inp: torch.Tensor, out: torch.Tensor, op: str = "sum",
                   dtype: Optional[str] = None) -> None:
    """Reduce-scatters contiguous ``inp`` (one block per rank, in rank order)
    into ``out``.

    Example:
      >>> reduce_scatter(comm, blocks, mine, "sum")
    """
    comm.reduce_scatter(inp.data_ptr(), inp.nbytes, out.data_ptr(), out.nbytes,
                        dtype or dtype_name(inp), op)


def all_to_all_v(
    comm: Any,
    send: torch.Tensor,
    send_counts: list[int],
    recv: torch.Tensor,
    recv_counts: list[int],
) -> None:
    """One engine all-to-all between flat contiguous buffers (``send_counts[r]``
    bytes to rank ``r``, ``recv_counts[r]`` from it).

    Example:
      >>> all_to_all_v(comm, packed_in, [4, 4], packed_out, [4, 4])
    """
    name = check(send, "send buffer")
    comm.all_to_all_v(
        send.data_ptr(), send.nbytes, send_counts,
        recv.data_ptr(), recv.nbytes, recv_counts, name,
    )


def send(comm: Any, t: torch.Tensor, peer: int, tag: int = 0,
         dtype: Optional[str] = None) -> None:
    """Sends contiguous ``t`` to ``comm``'s rank ``peer``.

    Example:
      >>> send(pair, t, 1)
    """
    comm.send(t.data_ptr(), t.nbytes, dtype or dtype_name(t), peer, tag)


def recv(comm: Any, t: torch.Tensor, peer: int, tag: int = 0,
         dtype: Optional[str] = None) -> None:
    """Receives into contiguous ``t`` from ``comm``'s rank ``peer``.

    Example:
      >>> recv(pair, t, 0)
    """
    comm.recv(t.data_ptr(), t.nbytes, dtype or dtype_name(t), peer, tag)


def apply(op: Any, t: torch.Tensor, key: int) -> None:
    """A bucket operation (``CentralizedOp``, ...) on ``t``, in place.

    Example:
      >>> apply(centralized_op, bucket, 0)
    """
    op.apply(t.data_ptr(), t.numel() * t.element_size(), dtype_name(t), key)


def gather(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """``params`` one after the other into ``flat``.

    Example:
      >>> gather(list(model.parameters()), flat)
    """
    _core.flat_gather([span(p) for p in params], span(flat))


def scatter(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Consecutive pieces of ``flat`` into ``params``.

    Example:
      >>> scatter(flat, list(model.parameters()))
    """
    _core.flat_scatter(span(flat), [span(p) for p in params])


def pseudo_gradient(glob: torch.Tensor, params: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out = glob - concat(params)`` (DiLoCo's pseudo-gradient).

    Example:
      >>> pseudo_gradient(global_copy, params, pseudo)
    """
    _core.pseudo_gradient(span(glob), [span(p) for p in params], span(out), dtype_name(glob))


def outer_sync(comms: Any, pseudo: torch.Tensor, avg: torch.Tensor,
               compression: Optional[str], error_feedback: bool) -> Any:
    """The engine's outer average of ``pseudo`` into ``avg`` over ``comms``
    (started with ``start()``, finished with ``wait()``); the tensors are
    kept alive by it.

    Example:
      >>> s = outer_sync(comms, pseudo, avg, "MinMaxUInt8", False); s.start(); s.wait()
    """
    return _core.OuterSync(comms, dtype_name(pseudo), (*span(pseudo), pseudo),
                           (*span(avg), avg), compression, error_feedback)
