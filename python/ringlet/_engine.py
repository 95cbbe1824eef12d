"""The one adapter every front end calls: tensor checks, dtype and reduce-type
names, and engine calls with the GIL released (two-level on multi-host jobs,
coalesced for many small tensors).

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
from .errors import CollectiveMismatchError
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


# World all-reduces from this size up take the two-level path on multi-host jobs.
_HIER_MIN_BYTES = 256 << 10


class Levels:
    """The two levels of a communicator that spans several hosts: ``local``
    (this host's ranks, shared memory) and ``cross`` (this local index on
    every host, TCP); ``layout`` lists each host's ranks (in the group's
    ranks) and ``rank`` is this process's rank in the group."""

    __slots__ = ("cross", "layout", "local", "rank")

    def __init__(self, local: Any, cross: Any, layout: list[list[int]], rank: int) -> None:
        self.local, self.cross, self.layout, self.rank = local, cross, layout, rank

    def local_index(self) -> int:
        return next(g.index(self.rank) for g in self.layout if self.rank in g)


# Communicators other than ringlet.init()'s world that have two levels (the
# c10d backend's groups), by id; registered and dropped by their owners.
_LEVELS: dict[int, Levels] = {}

# reduce types in the order the two-level agreement encodes them
_ENGINE_OPS = (*_REDUCE_TYPES, "xor")


_STRIDED = torch.strided


def _world_all_reduce(t: Any, reduce_type: str) -> bool:
    """All-reduces a contiguous CPU tensor in place over the whole world with
    the fewest Python steps. Returns False, having done nothing, when
    anything needs the general path: not initialised or a world of one, a
    dtype, layout, reduce type or device the checks of that path must name,
    or a two-level job. The hottest call of all: the checks of _world_plain
    are written out here (each call and attribute read costs 30-100 ns, a
    third of a 4 KiB call's Python time)."""
    state = runtime._state
    if (state is None or type(t) is not torch.Tensor or state.world_size == 1
            or reduce_type not in _REDUCE_TYPES):
        return False
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None or t.layout is not _STRIDED or not t.is_cpu or not t.is_contiguous():
        return False
    nbytes = t.nbytes
    if state.hier is not None and nbytes >= _HIER_MIN_BYTES:
        return False
    state.comm.all_reduce(t.data_ptr(), nbytes, name, reduce_type)
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
    nbytes = t.nbytes
    if state.hier is not None and nbytes >= _HIER_MIN_BYTES:
        return None
    out = torch.empty_like(t)
    state.comm.all_reduce_into(t.data_ptr(), out.data_ptr(), nbytes, name, reduce_type)
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
    costs about 60 ns of a 3 us one). The caller still checks the two-level
    size limit (``state.hier``)."""
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
    if state.hier is not None and total >= _HIER_MIN_BYTES:
        return None
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
    if shards != state.world_size or (state.hier is not None and nb >= _HIER_MIN_BYTES):
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
    if not 0 <= root < state.world_size or (state.hier is not None and nb >= _HIER_MIN_BYTES):
        return False
    state.comm.broadcast(t.data_ptr(), nb, name, root)
    return True


def _two_level(comm: Any, nbytes: int) -> Optional[Levels]:
    """The levels to use when a collective of ``nbytes`` on ``comm`` should
    run in two (multi-host jobs, large messages); None otherwise."""
    if nbytes < _HIER_MIN_BYTES:
        return None
    levels = _LEVELS.get(id(comm))
    if levels is not None:
        return levels
    state = runtime._state  # ringlet.init()'s world
    if state is None or state.hier is None or comm is not state.comm:
        return None
    return Levels(state.hier[0], state.hier[1], runtime.host_layout(), state.rank)


def _agree(comm: Any, op: str, fields: list[int], what: str) -> None:
    """One small world-wide check before a two-level collective, so ranks
    that disagree raise together, whichever host they are on."""
    probe = torch.tensor(fields + [-f for f in fields], dtype=torch.int64)
    comm.all_reduce(probe.data_ptr(), _nbytes(probe), "int64", "max")
    k = len(fields)
    if probe[:k].tolist() != (-probe[k:]).tolist():
        raise CollectiveMismatchError(
            f"rank {_rank()}: ranks disagree about the {op} ({what} differ between ranks)"
        )


def _engine_all_reduce(comm: Any, t: torch.Tensor, name: str, reduce_type: str) -> None:
    """One all-reduce of a contiguous tensor, in place: two-level (within
    hosts, then across) for large world all-reduces on multi-host jobs."""
    hier = _two_level(comm, _nbytes(t))
    if hier is None:
        comm.all_reduce(t.data_ptr(), _nbytes(t), name, reduce_type)
        return
    local, cross = hier.local, hier.cross
    code = [t.numel(), list(_DTYPE_NAMES).index(t.dtype), _ENGINE_OPS.index(reduce_type)]
    _agree(comm, "all_reduce", code, f"element count, dtype or reduce type; this rank has "
           f"{t.numel()} x {name}, {reduce_type}")
    # Reduce-scatter within the host, all-reduce each shard across hosts,
    # all-gather within the host; the tail is padded to a multiple of the host size.
    k = -(-t.numel() // local.size)
    work = torch.zeros(k * local.size, dtype=t.dtype)
    work[: t.numel()] = t.view(-1)
    shard = torch.empty(k, dtype=t.dtype)
    local.reduce_scatter(
        work.data_ptr(), _nbytes(work), shard.data_ptr(), _nbytes(shard), name, reduce_type
    )
    cross.all_reduce(shard.data_ptr(), _nbytes(shard), name, reduce_type)
    local.all_gather(shard.data_ptr(), _nbytes(shard), work.data_ptr(), _nbytes(work), name)
    t.view(-1).copy_(work[: t.numel()])


def _engine_all_gather(comm: Any, inp: torch.Tensor, out: torch.Tensor, name: str) -> None:
    """All-gathers contiguous ``inp`` into ``out`` (rank blocks in rank
    order): two-level on multi-host jobs (within hosts over shared memory,
    then whole host blocks across hosts), else one engine call."""
    hier = _two_level(comm, _nbytes(out))
    if hier is None:
        comm.all_gather(inp.data_ptr(), _nbytes(inp), out.data_ptr(), _nbytes(out), name)
        return
    local, cross = hier.local, hier.cross
    _agree(comm, "all_gather", [inp.numel(), list(_DTYPE_NAMES).index(inp.dtype)],
           f"element count or dtype; this rank has {inp.numel()} x {name}")
    block = torch.empty(local.size * inp.numel(), dtype=inp.dtype)
    local.all_gather(inp.data_ptr(), _nbytes(inp), block.data_ptr(), _nbytes(block), name)
    layout = hier.layout
    flat = out.view(-1)
    if [r for g in layout for r in g] == list(range(comm.size)):
        # Hosts hold consecutive ranks: the host blocks are already in order.
        cross.all_gather(block.data_ptr(), _nbytes(block), flat.data_ptr(), _nbytes(out), name)
        return
    hosts = torch.empty(len(layout), local.size, inp.numel(), dtype=inp.dtype)
    cross.all_gather(block.data_ptr(), _nbytes(block), hosts.data_ptr(), _nbytes(hosts), name)
    per_rank = flat.view(-1, inp.numel()) if inp.numel() else None
    if per_rank is not None:
        for h, g in enumerate(layout):
            for i, r in enumerate(g):
                per_rank[r].copy_(hosts[h, i])


def _engine_reduce_scatter(
    comm: Any, inp: torch.Tensor, out: torch.Tensor, name: str, reduce_type: str
) -> None:
    """Reduce-scatters contiguous ``inp`` (one block per rank, in rank order)
    into ``out``: two-level on multi-host jobs, else one engine call. In two
    levels the blocks are regrouped by local index, reduce-scattered within
    the host (local index i keeps the blocks of every host's i-th rank), then
    reduce-scattered across hosts."""
    hier = _two_level(comm, _nbytes(inp))
    if hier is None:
        comm.reduce_scatter(
            inp.data_ptr(), _nbytes(inp), out.data_ptr(), _nbytes(out), name, reduce_type
        )
        return
    local, cross = hier.local, hier.cross
    code = [inp.numel(), list(_DTYPE_NAMES).index(inp.dtype), _ENGINE_OPS.index(reduce_type)]
    _agree(comm, "reduce_scatter", code, f"element count, dtype or reduce type; this rank "
           f"has {inp.numel()} x {name}, {reduce_type}")
    layout = hier.layout
    blocks = inp.view(comm.size, -1)
    order = [layout[h][i] for i in range(local.size) for h in range(len(layout))]
    regrouped = blocks[order].contiguous()  # local index major, host minor
    mine = torch.empty(len(layout) * blocks.shape[1], dtype=inp.dtype)
    local.reduce_scatter(
        regrouped.data_ptr(), _nbytes(regrouped), mine.data_ptr(), _nbytes(mine), name,
        reduce_type,
    )
    cross.reduce_scatter(
        mine.data_ptr(), _nbytes(mine), out.data_ptr(), _nbytes(out), name, reduce_type
    )


def _engine_broadcast(comm: Any, t: torch.Tensor, name: str, root: int) -> None:
    """Broadcasts contiguous ``t`` from group rank ``root``: two-level on
    multi-host jobs (across hosts among the root's local index, then within
    every host), else one engine call."""
    hier = _two_level(comm, _nbytes(t))
    if hier is None:
        comm.broadcast(t.data_ptr(), _nbytes(t), name, root)
        return
    local, cross = hier.local, hier.cross
    _agree(comm, "broadcast", [t.numel(), list(_DTYPE_NAMES).index(t.dtype), root],
           f"element count, dtype or root; this rank has {t.numel()} x {name} from {root}")
    layout = hier.layout
    root_host = next(h for h, g in enumerate(layout) if root in g)
    root_local = layout[root_host].index(root)
    if hier.local_index() == root_local:
        cross.broadcast(t.data_ptr(), _nbytes(t), name, root_host)
    local.broadcast(t.data_ptr(), _nbytes(t), name, root_local)


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
