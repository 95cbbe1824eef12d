"""The one adapter every front end calls: tensor checks, dtype and reduce-type
names, and engine calls with the GIL released (coalesced for many small
tensors; jobs that span hosts run in two levels inside the engine).

The torch_xla-style API (``collectives.py``), ``torch.ops.ringlet``
(``ops.py``), the ``torch.distributed`` backend (``c10d.py``), DDP and the
tensor API all go through here, so a check or a dtype rule lives once.
"""

from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable, Optional, TypeVar, Union

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.autograd import profiler as _profiler

from . import runtime
from .runtime import get_ordinal

REDUCE_SUM = "sum"
REDUCE_MUL = "mul"
REDUCE_AND = "and"
REDUCE_OR = "or"
REDUCE_MIN = "min"
REDUCE_MAX = "max"

_REDUCE_TYPES = (REDUCE_SUM, REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, REDUCE_MAX)

_DTYPE_NAMES = {
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
_COALESCE_BYTES = 4 << 20

TensorLike = Union[torch.Tensor, np.ndarray]


def _rank() -> int:
    """This process's rank for error messages: ringlet's, else the default
    torch.distributed group's (the c10d backend without ringlet.init())."""
    if runtime.is_initialized():
        return get_ordinal()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


_F = TypeVar("_F", bound=Callable[..., Any])


def _traced(fn: _F) -> _F:
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


def _as_tensor(x: Any, what: str, write: bool = False) -> torch.Tensor:
    """``x`` as a tensor (numpy arrays share memory); ``write``: the engine
    writes into it, so a read-only array is refused instead of faulting."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if x.flags.writeable:
            return torch.from_numpy(x)
        if write:
            raise ValueError(
                f"rank {_rank()}: {what} is a read-only numpy array and ringlet writes into "
                "it; pass a writable copy (np.array(x))"
            )
        with warnings.catch_warnings():  # torch warns about non-writable arrays
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(x)
    raise TypeError(
        f"rank {_rank()}: {what} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}"
    )


def _check(t: torch.Tensor, what: str) -> str:
    """Validates a tensor the engine will touch; returns its dtype name."""
    if not t.is_cpu:
        raise ValueError(
            f"rank {_rank()}: {what} is on device '{t.device}'; ringlet collectives take CPU "
            "tensors (move it with .cpu())"
        )
    if t.layout != torch.strided:
        raise ValueError(f"rank {_rank()}: {what} has layout {t.layout}; only dense tensors work")
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        supported = ", ".join(str(d).replace("torch.", "") for d in _DTYPE_NAMES)
        raise TypeError(
            f"rank {_rank()}: {what} has unsupported dtype {t.dtype} (supported: {supported})"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"rank {_rank()}: {what} is not contiguous; call .contiguous() on it first"
        )
    return name


def _check_reduce_type(reduce_type: Any) -> str:
    if reduce_type not in _REDUCE_TYPES:
        raise ValueError(
            f"rank {_rank()}: unknown reduce type {reduce_type!r}; expected one of "
            + ", ".join(f"REDUCE_{r.upper()}" for r in _REDUCE_TYPES)
        )
    return str(reduce_type)


def _nbytes(t: torch.Tensor) -> int:
    return t.nbytes


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte of memory."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def _apply_scale(t: torch.Tensor, scale: float) -> None:
    if scale == 1.0:
        return
    if t.dtype == torch.bool:
        raise ValueError(f"rank {_rank()}: cannot scale a bool tensor by {scale}")
    t = t.detach()
    if t.is_floating_point():
        t.mul_(scale)
    else:
        t.copy_(t.double().mul_(scale).to(t.dtype))


_STRIDED = torch.strided


def _world_all_reduce(t: Any, reduce_type: str) -> bool:
    """All-reduces a contiguous CPU tensor in place over the whole world with
    the fewest Python steps. Returns False, having done nothing, when
    anything needs the general path: not initialised or a world of one, or a
    dtype, layout, reduce type or device the checks of that path must name
    (a job spanning hosts runs it in two levels inside the engine). The
    hottest call of all: the checks of _world_plain are written out here
    (each call and attribute read costs 30-100 ns, a third of a 4 KiB
    call's Python time)."""
    state = runtime._state
    if (state is None or type(t) is not torch.Tensor or state.world_size == 1
            or reduce_type not in _REDUCE_TYPES):
        return False
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None or t.layout is not _STRIDED or not t.is_cpu or not t.is_contiguous():
        return False
    state.comm.all_reduce(t.data_ptr(), t.nbytes, name, reduce_type)
    return True


def _world_all_reduce_into(t: Any, reduce_type: str) -> Optional[torch.Tensor]:
    """The out-of-place twin of _world_all_reduce: a new tensor holding the
    world's reduction of contiguous CPU tensor ``t`` (``t`` untouched; a small
    one is read straight into the engine's slot, no copy first), or None,
    having done nothing, when the general path must run."""
    plain = _world_plain(t)
    if plain is None or reduce_type not in _REDUCE_TYPES:
        return None
    state, name = plain
    out = torch.empty_like(t)
    state.comm.all_reduce_into(t.data_ptr(), out.data_ptr(), t.nbytes, name, reduce_type)
    return out


def _plain(t: Any) -> Optional[str]:
    """The dtype name of a tensor the engine can take as it is (a plain
    contiguous dense CPU tensor), else None (the general path then checks
    and names the problem)."""
    if type(t) is not torch.Tensor:
        return None
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None or t.layout is not _STRIDED or not t.is_cpu or not t.is_contiguous():
        return None
    return name


def _world_plain(t: Any) -> Any:
    """``(world state, dtype name)`` when plain tensor ``t`` (see _plain) may
    take a world collective's fast path (initialised, more than one rank),
    else None: the checks of _plain and of the world in one call (each call
    costs about 60 ns of a 3 us one)."""
    state = runtime._state
    if state is None or type(t) is not torch.Tensor or state.world_size == 1:
        return None
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None or t.layout is not _STRIDED or not t.is_cpu or not t.is_contiguous():
        return None
    return state, name


def _fits(value: torch.Tensor, output: Any, nbytes: int, rows: int) -> bool:
    """Whether ``output`` can take the result as it is: a plain tensor of
    ``value``'s dtype, ``nbytes`` long, ``rows`` rows and ``value``'s other
    dimensions, not overlapping ``value``."""
    if (type(output) is not torch.Tensor or output.dtype is not value.dtype
            or output.layout is not _STRIDED or not output.is_cpu
            or not output.is_contiguous() or output.nbytes != nbytes):
        return False
    if (value.dim() != 1 or output.dim() != 1) and output.shape != (rows, *value.shape[1:]):
        return False
    pa, pb = value.data_ptr(), output.data_ptr()
    return pa + value.nbytes <= pb or pb + nbytes <= pa


def _disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share no byte."""
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa + a.nbytes <= pb or pb + b.nbytes <= pa


def _world_all_gather(value: Any, output: Any) -> Optional[torch.Tensor]:
    """Fast path of the world all-gather along dim 0 (see _world_all_reduce);
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


def _world_reduce_scatter(
    reduce_type: str, value: Any, scale: float, shards: int, output: Any
) -> Optional[torch.Tensor]:
    """Fast path of the world reduce-scatter along dim 0 into ``shards``
    blocks (see _world_all_reduce); returns the output, or None having done
    nothing (also when ``shards`` is not the world size: the general path
    names that)."""
    plain = _world_plain(value)
    if plain is None or reduce_type not in _REDUCE_TYPES or value.dim() == 0:
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
        _apply_scale(output, scale)
    return output


def _world_broadcast(t: Any, root: Any) -> bool:
    """Fast path of the world broadcast of one tensor in place (see
    _world_all_reduce); False, having done nothing, when it does not apply."""
    plain = _world_plain(t)
    if plain is None or type(root) is not int:
        return False
    state, name = plain
    nb = t.nbytes
    if not 0 <= root < state.world_size:
        return False
    state.comm.broadcast(t.data_ptr(), nb, name, root)
    return True


def _engine_all_reduce(comm: Any, t: torch.Tensor, name: str, reduce_type: str) -> None:
    """One all-reduce of a contiguous tensor, in place (a communicator that
    spans hosts runs it in two levels inside the engine)."""
    comm.all_reduce(t.data_ptr(), t.nbytes, name, reduce_type)


def _engine_all_gather(comm: Any, inp: torch.Tensor, out: torch.Tensor, name: str) -> None:
    """All-gathers contiguous ``inp`` into ``out`` (rank blocks in rank order)."""
    comm.all_gather(inp.data_ptr(), inp.nbytes, out.data_ptr(), out.nbytes, name)


def _engine_reduce_scatter(
    comm: Any, inp: torch.Tensor, out: torch.Tensor, name: str, reduce_type: str
) -> None:
    """Reduce-scatters contiguous ``inp`` (one block per rank, in rank order)
    into ``out``."""
    comm.reduce_scatter(inp.data_ptr(), inp.nbytes, out.data_ptr(), out.nbytes, name, reduce_type)


def _engine_broadcast(comm: Any, t: torch.Tensor, name: str, root: int) -> None:
    """Broadcasts contiguous ``t`` from group rank ``root``."""
    comm.broadcast(t.data_ptr(), t.nbytes, name, root)


def _reduce_inplace(comm: Any, tensors: list[torch.Tensor], reduce_type: str, scale: float) -> None:
    """All-reduces contiguous CPU tensors in place; small tensors of one dtype
    are flattened into a single collective call."""
    if len(tensors) == 1:  # fast path: no grouping, no copies
        t = tensors[0]
        _engine_all_reduce(comm, t, _check(t, "input"), reduce_type)
        _apply_scale(t, scale)
        return
    # The engine writes through raw pointers; the flatten/copy-back below goes
    # through torch, so it works on views autograd does not track.
    tensors = [t.detach() for t in tensors]
    names = [_check(t, f"inputs[{i}]") for i, t in enumerate(tensors)]
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    for t, name in zip(tensors, names):
        if _nbytes(t) > _COALESCE_BYTES:
            _engine_all_reduce(comm, t, name, reduce_type)
            _apply_scale(t, scale)
        else:
            small.setdefault(t.dtype, []).append(t)
    for dtype, group in small.items():
        name = _DTYPE_NAMES[dtype]
        if len(group) == 1:
            flat = group[0]
        else:
            flat = _flatten_dense_tensors(group)  # one C++ call, not one per tensor
        _engine_all_reduce(comm, flat, name, reduce_type)
        _apply_scale(flat, scale)
        if len(group) > 1:
            views = _unflatten_dense_tensors(flat, group)
            if hasattr(torch, "_foreach_copy_"):
                torch._foreach_copy_(group, views)  # one call instead of one per tensor
            else:  # torch < 2.2
                for g, v in zip(group, views):
                    g.copy_(v)



def _check_ints(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"rank {_rank()}: {what} must be an int, got {type(value).__name__}")
    return value


def _exchange(
    comm: Any,
    send: torch.Tensor,
    send_counts: list[int],
    recv: torch.Tensor,
    recv_counts: list[int],
) -> None:
    """One engine all-to-all between flat contiguous buffers."""
    name = _check(send, "send buffer")
    comm.all_to_all_v(
        send.data_ptr(), _nbytes(send), send_counts,
        recv.data_ptr(), _nbytes(recv), recv_counts, name,
    )
