"""Arguments as torch's ``ProcessGroup`` methods take them, shared by the
method families of :class:`ringlet.distributed.process_group.ProcessGroupRinglet`:
torch's other call forms (a lone tensor, a reduce op or root rank for the
options object), the reduce-op table, and results written back into
non-contiguous tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C._distributed_c10d import ReduceOp

_RED = ReduceOp.RedOpType
_OPS: dict[Any, str] = {
    _RED.SUM: "sum",
    _RED.PRODUCT: "mul",
    _RED.MIN: "min",
    _RED.MAX: "max",
    _RED.BAND: "and",
    _RED.BOR: "or",
    _RED.BXOR: "xor",
    _RED.AVG: "sum",
    _RED.PREMUL_SUM: "sum",
}


def _write_back(t: torch.Tensor, w: torch.Tensor) -> None:
    """Copies ``w`` into ``t``, also when elements of ``t`` share memory (an
    expanded tensor: its aliased elements held equal values, so they reduce
    to equal results and any of them may land)."""
    if torch._debug_has_internal_overlap(t) == 0:  # no element shares memory
        t.copy_(w)
        return
    cells = t.untyped_storage().nbytes() // t.element_size()
    where = torch.arange(cells).as_strided(t.shape, t.stride(), t.storage_offset())
    t.as_strided((cells,), (1,), 0).index_put_((where.reshape(-1),), w.reshape(-1))


def _opts(cls: Any, opts: Any, op: Any = None, root: Any = None) -> Any:
    """``opts`` as torch's options object ``cls``, accepting the other call
    forms of torch's ``ProcessGroup`` methods: nothing (defaults), a reduce op
    (``pg.allreduce([t], ReduceOp.MAX)``) or a root rank
    (``pg.broadcast(t, 1)``, ``pg.reduce(t, 1, op)``)."""
    if opts is not None and type(opts) is cls:
        return opts
    out = cls()
    if opts is None:
        pass
    elif isinstance(opts, int) and not isinstance(opts, bool) and hasattr(out, "rootRank"):
        out.rootRank = opts
    elif hasattr(out, "reduceOp") and not hasattr(opts, "reduceOp"):
        out.reduceOp = opts
    else:
        return opts  # another options-like object: used as it is
    if op is not None and hasattr(out, "reduceOp"):
        out.reduceOp = op
    if root is not None:
        out.rootRank = root
    return out


def _as_list(t: Any) -> Any:
    """A lone tensor as a one-element list (torch's single-tensor overloads)."""
    return [t] if isinstance(t, torch.Tensor) else t


def _is_async(opts: Any) -> bool:
    """Whether the caller returns the Work (``async_op=True``; C++ callers
    such as functional collectives and DDP leave the option at True)."""
    return bool(getattr(opts, "asyncOp", True)) if opts is not None else True


def _split_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Copies consecutive pieces of flat ``flat`` into ``outs``, in order."""
    start = 0
    for o in outs:
        o.copy_(flat[start:start + o.numel()].view(o.shape))
        start += o.numel()


def _reduce_name(op: Any, what: str) -> str:
    kind = getattr(op, "op", op)
    name = _OPS.get(kind)
    if name is None:
        raise ValueError(f"{what}: unsupported reduce op {op!r}")
    return name
