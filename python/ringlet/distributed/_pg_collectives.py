"""The collectives of ringlet's ``torch.distributed`` process group: all-reduce,
broadcast, reduce, the all-gathers, the reduce-scatters, gather, scatter, the
all-to-alls and the barrier, as a mixin that
:class:`ringlet.distributed.process_group.ProcessGroupRinglet` inherits (it
gives them ``_world``, ``_submit``, ``_tensor`` and the group's state).

Each method checks its arguments on the calling thread, then queues the work
on the group's queue. On a connected group, plain tensors (contiguous, dense,
CPU, of one dtype) go as one engine call itself (``_submit_engine``, a native
job: no Python runs for it on the queue): the list, coalesced and
multi-device forms are staged through a flat buffer by byte copies the job
runs before and after the call, and ReduceOp.AVG is a sum the job divides.
Anything else (the group's first, connecting call; PREMUL_SUM; AVG of complex
tensors; sparse, non-contiguous or mixed-dtype tensors; the multi-device
all-reduce, which folds its list first) is one Python job that runs the
engine calls (``_submit``). A synchronous call runs at once on the calling
thread when the queue is idle.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ReduceOp

from .. import errors
from ..core import engine
from ..core.engine import (
    DTYPE_NAMES,
    STRIDED,
    all_reduce_coalesced,
    check,
    disjoint,
    overlaps,
    plain_dtype,
    ptr,
)
from ._pg_args import _OPS, _RED, _as_list, _is_async, _opts, _reduce_name, _split_into, _write_back
from .work import _DONE, Work, _DistErrors, _torch_errors, runtime_rank

# Reduce ops the engine runs as they are (AVG and PREMUL_SUM need a step more).
_SIMPLE = {k: v for k, v in _OPS.items() if k not in (_RED.AVG, _RED.PREMUL_SUM)}
# A list's tensors folded into one before the engine reduces across ranks.
_FOLDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add, "mul": torch.mul, "min": torch.minimum, "max": torch.maximum,
    "and": torch.bitwise_and, "or": torch.bitwise_or, "xor": torch.bitwise_xor,
}
_SUM = _RED.SUM  # compared first: pybind enum hashing costs more than one ==
_ANY_DTYPE = ("sum", "mul", "min", "max")  # the others need integer or bool tensors
_AllreduceOptions = dist.AllreduceOptions


def _engine_op(op: Any, t: torch.Tensor) -> Optional[str]:
    """The engine's name of torch reduce op ``op`` when the engine runs it on
    ``t`` as it is (not AVG or PREMUL_SUM; the bitwise ops on integer or bool
    tensors only), else None: the general path then scales, or names the
    problem."""
    red = "sum" if op == _SUM else _SIMPLE.get(getattr(op, "op", op))
    if red is None or (red not in _ANY_DTYPE and t.is_floating_point()):
        return None
    return red


def _renamer(op: str, rule: str) -> Callable[[BaseException], BaseException]:
    """What names the user's collective in a size mismatch found by the
    engine call that implements it (an all-to-all, or a count exchange);
    other errors pass unchanged."""

    def rename(e: BaseException) -> BaseException:
        if not isinstance(e, errors.CollectiveMismatchError):
            return e
        where, _, detail = str(e).partition(": ")
        if not (where.startswith("rank ") and detail):
            where, detail = f"rank {runtime_rank()}", str(e)
        new = type(e)(f"{where}: {op}: the ranks' tensor sizes do not fit together "
                      f"({rule}); the engine found: {detail}")
        new.__dict__.update(e.__dict__)
        return new

    return rename


@contextlib.contextmanager
def _sizes_of(op: str, rule: str) -> Iterator[None]:
    """Names the user's collective in a size mismatch (see ``_renamer``)."""
    try:
        yield
    except errors.CollectiveMismatchError as e:
        raise _renamer(op, rule)(e) from None


_GATHER_RULE = ("all_gather", "output tensor r must have rank r's input size")
_GATHER_ROOT_RULE = ("gather", "the root's output tensor r must have rank r's input size")
_SCATTER_RULE = ("scatter", "rank r's output must have the size of the root's input tensor r")


def _one_dtype(ts: Iterable[torch.Tensor]) -> Optional[str]:
    """The engine's dtype name when every tensor of ``ts`` is one the engine
    takes as it is (see ``plain_dtype``) and all share one dtype, else None
    (the Python job then converts, stages or names the problem)."""
    name, dtype = None, None
    for t in ts:
        n = plain_dtype(t)
        if n is None or (dtype is not None and t.dtype != dtype):
            return None
        name, dtype = n, t.dtype
    return name


def _pieces(flat: torch.Tensor, sizes: Iterable[int]) -> list[torch.Tensor]:
    """Consecutive slices of flat ``flat``, one of each size."""
    out, start = [], 0
    for n in sizes:
        out.append(flat[start:start + n])
        start += n
    return out


def _staged(ts: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A fresh flat buffer for ``ts`` back to back, and the copies (for a
    native job's ``before``) that fill it."""
    flat = torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype)
    return flat, list(zip(ts, _pieces(flat, (t.numel() for t in ts))))


def _gather_ragged(comm: Any, size: int, inp: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every rank's ``inp`` (rank r's holding ``counts[r]`` elements),
    concatenated flat in rank order: one all-to-all sending ``inp`` to all."""
    flat = torch.empty(sum(counts), dtype=inp.dtype)
    engine.all_to_all_v(comm, inp.reshape(-1).repeat(size), [inp.numel()] * size, flat, counts)
    return flat


class _Collectives:
    """The collectives of :class:`ProcessGroupRinglet` (a mixin: the group
    supplies its state and the methods ``_world``, ``_submit``,
    ``_submit_engine``, ``_tensor``, ``_root``, ``_dense`` and ``_where``)."""

    # -- argument checks -----------------------------------------------------

    def _real_op(self, op: Any, tensors: Any, what: str) -> None:
        """Refuses complex tensors for the reduce ops that do not act on a
        complex number's real and imaginary parts alone (all but SUM, AVG and
        PREMUL_SUM), as torch and gloo do, instead of reducing the parts."""
        kind = getattr(op, "op", op)
        if kind in (_RED.SUM, _RED.AVG, _RED.PREMUL_SUM):
            return
        stack = [tensors]
        while stack:
            t = stack.pop()
            if isinstance(t, (list, tuple)):
                stack.extend(t)
            elif isinstance(t, torch.Tensor) and t.is_complex():
                raise ValueError(
                    f"{self._where()}: {what} does not support {kind.name} on complex tensors"
                )


    def _reduce_args(self, op: Any, ts: list[torch.Tensor], what: str) -> tuple[str, Callable]:
        """The engine reduce type for a torch ReduceOp, and what to do to each
        input before (PREMUL_SUM) and after (AVG) the sum."""
        name = _reduce_name(op, what)
        kind = getattr(op, "op", op)
        for t in ts:
            if name in ("and", "or", "xor") and t.is_floating_point():
                raise ValueError(
                    f"{self._where()}: {what}: reduce op {kind.name} needs integer or bool "
                    f"tensors, got {t.dtype}"
                )
            if kind in (_RED.AVG, _RED.PREMUL_SUM) and t.dtype == torch.bool:
                raise ValueError(f"{self._where()}: {what}: {kind.name} on a bool tensor")
        size = self._size

        def post(t: torch.Tensor) -> None:
            if kind == _RED.AVG:
                if t.is_floating_point():
                    t.div_(size)
                else:
                    t.copy_(torch.div(t, size, rounding_mode="trunc"))

        if kind == _RED.PREMUL_SUM:
            factor = getattr(op, "factor", None)
            if factor is None:
                raise ValueError(f"{self._where()}: {what}: PREMUL_SUM without a factor")
            for t in ts:
                t.mul_(factor)
        return name, post

    def _submit_list(
        self, kind: str, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], name: str,
        result: list[Any], wake: bool, root: int = 0, red: str = "sum",
        after: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> Work:
        """List form ``kind`` (``all_gather``, ``gather``, ``scatter``,
        ``all_to_all``, ``reduce_scatter``) as one native job: the engine's
        list call, which stages ``ins`` and ``outs`` (plain tensors of dtype
        ``name``; they may alias) through buffers the running thread keeps,
        and names a size mismatch by the form and its rule (as the native
        Backend's synchronous list forms do); then the copies ``after``."""
        return self._submit_engine(self._comm, "list", [*ins, *outs], name,
                                   (kind, len(ins), root, red), result, wake, after=list(after))

    def _native_op(self, op: Any, ts: Iterable[torch.Tensor]) -> Optional[tuple[str, int]]:
        """The engine's reduce op and divisor (ReduceOp.AVG: the group size;
        else 0) when a native job runs ``op`` on ``ts`` (the tensors as the
        caller gave them) by itself, else None: PREMUL_SUM, AVG on complex or
        bool tensors and a bitwise op on floating point go to the Python job,
        which scales them or names the problem."""
        ts = list(ts)
        if not ts:
            return None
        if getattr(op, "op", op) == _RED.AVG:
            if any(t.is_complex() or t.dtype == torch.bool for t in ts):
                return None
            return "sum", self._size
        red = _engine_op(op, ts[0])
        return None if red is None else (red, 0)

    # -- collectives ---------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        # The blocking all_reduce of one plain tensor on a connected one-level
        # group (what dist.all_reduce does most), before any wrapper: the
        # engine call on this thread when the queue is idle. Else _allreduce.
        # Written out (no helper calls): each saves about 0.1 us of a 4 us call.
        comm = self._comm
        if (comm is not None and type(opts) is _AllreduceOptions and type(tensors) is list
                and len(tensors) == 1 and not opts.asyncOp):
            t = tensors[0]
            name = DTYPE_NAMES.get(t.dtype) if type(t) is torch.Tensor else None
            if name is not None and t.layout is STRIDED and t.is_cpu and t.is_contiguous():
                op = opts.reduceOp
                red = "sum" if op == _SUM else _SIMPLE.get(op.op)
                if red is not None and (red in _ANY_DTYPE or not t.is_floating_point()):
                    try:
                        if self._queue.all_reduce_now(comm, ptr(t), t.nbytes, name, red):
                            return _DONE
                    except BaseException as e:
                        raise _DistErrors.convert(e) from None
        return self._allreduce(tensors, opts, together=True)

    @_torch_errors
    def _allreduce(
        self, tensors: list[torch.Tensor], opts: Any = None, together: bool = False
    ) -> Work:
        """All-reduces each of ``tensors`` (``allreduce_coalesced``), or, with
        ``together``, all of them as one (``allreduce`` of several tensors,
        torch's multi-device form, as gloo: every tensor of every rank
        reduced, the result written into each)."""
        if type(opts) is not dist.AllreduceOptions:  # another of torch's call forms
            tensors, opts = _as_list(tensors), _opts(dist.AllreduceOptions, opts)
        op = opts.reduceOp
        if len(tensors) == 1:  # the common case, with the fewest steps
            t = tensors[0]
            name = DTYPE_NAMES.get(t.dtype)
            red = _engine_op(op, t)
            if (name is not None and red is not None and t.is_cpu and t.is_contiguous()
                    and t.layout == torch.strided):
                # One engine call (in two levels on a group spanning hosts),
                # queued as it is once the group is connected.
                wake, comm = _is_async(opts), self._comm
                if comm is None:
                    return self._submit(lambda: engine.all_reduce(self._world(), t, red, name),
                                        [t], wake=wake)
                return self._submit_engine(comm, "all_reduce", [t], name, red, [t], wake)
        if self._comm is not None and not (together and len(tensors) != 1):
            # Plain tensors of one dtype (AVG, or several tensors): one engine
            # call on them (several staged through one flat buffer).
            work = self._allreduce_native(tensors, op, opts)
            if work is not None:
                return work
        if any(isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, op, opts)
        self._real_op(op, tensors, "all_reduce")
        ts = [self._tensor(t, f"all_reduce tensors[{i}]") for i, t in enumerate(tensors)]
        if together and len(ts) != 1:
            return self._allreduce_together(tensors, ts, op, opts)

        def run() -> None:
            dense, back = self._dense(ts)
            name, post = self._reduce_args(op, dense, "all_reduce")
            all_reduce_coalesced(self._world(), dense, name, 1.0)
            for t in dense:
                post(t)
            back()

        return self._submit(run, list(tensors), wake=_is_async(opts))

    def _allreduce_native(self, tensors: list[torch.Tensor], op: Any, opts: Any) -> Optional[Work]:
        """``allreduce_coalesced`` (or AVG of one tensor) as one native job
        when the tensors are plain and of one dtype, else None."""
        name = _one_dtype(tensors) if all(type(t) is torch.Tensor for t in tensors) else None
        nop = self._native_op(op, tensors) if name is not None else None
        if nop is None:
            return None
        red, divide = nop
        if len(tensors) == 1:
            return self._submit_engine(self._comm, "all_reduce", tensors, name, red,
                                       list(tensors), _is_async(opts), divide=divide)
        flat, before = _staged(tensors)
        return self._submit_engine(self._comm, "all_reduce", [flat], name, red, list(tensors),
                                   _is_async(opts), before, [(d, t) for t, d in before],
                                   divide)

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: Any, opts: Any) -> Work:
        """The sum of sparse COO tensors, written into each (as gloo): every
        rank's indices and values are gathered and coalesced."""
        if getattr(op, "op", op) != _RED.SUM:
            raise ValueError(
                f"{self._where()}: all_reduce of a sparse tensor supports ReduceOp.SUM only"
            )
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.layout != torch.sparse_coo or not t.is_cpu:
                raise ValueError(
                    f"{self._where()}: all_reduce tensors[{i}]: a sparse all_reduce takes "
                    "sparse COO CPU tensors only"
                )

        def gather_rows(rows: torch.Tensor, counts: list[int], comm: Any) -> torch.Tensor:
            # every rank's rows (dim 0), ragged, concatenated in rank order
            rows = rows.contiguous()
            if rows.is_complex():
                rows = torch.view_as_real(rows)
            per = math.prod(rows.shape[1:])
            flat = _gather_ragged(comm, self._size, rows, [c * per for c in counts])
            return flat.view(sum(counts), *rows.shape[1:])

        def run() -> None:
            comm = self._world()
            for t in tensors:
                x = t.coalesce()
                nnz = torch.tensor([x._nnz()], dtype=torch.int64)
                counts = torch.empty(self._size, dtype=torch.int64)
                engine.all_gather(comm, nnz, counts, "int64")
                n = counts.tolist()
                idx = gather_rows(x.indices().t(), n, comm).t()
                val = gather_rows(x.values(), n, comm)
                if x.values().is_complex():
                    val = torch.view_as_complex(val)
                # invariants named (gloo's result warns of nothing): the
                # indices come from coalesced tensors, in bounds
                t.copy_(torch.sparse_coo_tensor(idx, val, t.shape, check_invariants=False)
                        .coalesce())

        return self._submit(run, list(tensors), wake=_is_async(opts))

    def _allreduce_together(
        self, tensors: list[torch.Tensor], ts: list[torch.Tensor], op: Any, opts: Any
    ) -> Work:
        """One reduction over all of ``ts`` on every rank (``tensors`` as the
        caller gave them; ``ts`` as the engine takes them), written into each:
        the list is folded here, the fold all-reduced, and AVG divides by
        every tensor taking part (ranks x list length)."""
        self._same_tensors(ts, "all_reduce")
        name, _ = self._reduce_args(op, [ts[0].new_empty(0)], "all_reduce")  # checks only
        fold = _FOLDS[name]
        count = len(ts)

        def run() -> None:
            acc = ts[0].clone(memory_format=torch.contiguous_format)
            for t in ts[1:]:
                acc.copy_(fold(acc, t))
            _, post = self._reduce_args(op, [acc], "all_reduce")  # PREMUL_SUM scales the fold
            all_reduce_coalesced(self._world(), [acc], name, 1.0)
            post(acc)
            if getattr(op, "op", op) == _RED.AVG:
                if acc.is_floating_point():
                    acc.div_(count)
                else:
                    acc.copy_(torch.div(acc, count, rounding_mode="trunc"))
            for t in ts:
                _write_back(t, acc)

        return self._submit(run, list(tensors), wake=_is_async(opts))

    def _same_tensors(self, ts: list[torch.Tensor], what: str) -> None:
        """Checks that the tensors of a multi-device call (one list entry per
        device in torch's form) agree in dtype and shape, as gloo requires."""
        if not ts:
            raise ValueError(f"{self._where()}: {what} needs at least one tensor")
        first = ts[0]
        for i, t in enumerate(ts[1:], 1):
            for part, want, got in (("type", first.dtype, t.dtype),
                                    ("size", tuple(first.shape), tuple(t.shape))):
                if want != got:
                    raise ValueError(
                        f"{self._where()}: {what}: invalid tensor {part} at index {i} (expected "
                        f"{want} as tensor 0, got {got}): the tensors of one call act as one"
                    )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        return self._allreduce(tensors, opts)

    @_torch_errors
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        if type(opts) is not dist.BroadcastOptions:  # another of torch's call forms
            tensors, opts = _as_list(tensors), _opts(dist.BroadcastOptions, opts)
        root = self._root(opts.rootRank, "broadcast")
        if len(tensors) == 1:
            t = tensors[0]
            name, comm = plain_dtype(t), self._comm
            if (name is not None and comm is not None
                    and getattr(opts, "rootTensor", 0) == 0):
                # The engine call itself: queued, or at once when synchronous
                # on an idle queue.
                return self._submit_engine(comm, "broadcast", [t], name, root, [t],
                                           _is_async(opts))
        ts = [self._tensor(t, f"broadcast tensors[{i}]") for i, t in enumerate(tensors)]
        # Several tensors are torch's multi-device form (as gloo): the root's
        # tensor rootTensor goes into every tensor of every rank.
        if len(ts) != 1:
            self._same_tensors(ts, "broadcast")
        pick = getattr(opts, "rootTensor", 0)
        if not 0 <= pick < len(ts):
            raise ValueError(
                f"{self._where()}: broadcast: invalid root tensor: {pick} (the call has "
                f"{len(ts)} tensors)"
            )
        name = _one_dtype(ts) if self._comm is not None else None
        if name is not None:
            # One broadcast of the root tensor, copied into the others by the job.
            src = ts[pick]
            return self._submit_engine(self._comm, "broadcast", [src], name, root,
                                       list(tensors), _is_async(opts),
                                       after=[(src, t) for t in ts if t is not src])

        def run() -> None:
            dense, back = self._dense(ts)
            src = dense[pick]
            engine.broadcast(self._world(), src, root, check(src, "broadcast tensor"))
            for t in dense:
                if t is not src:
                    t.copy_(src)
            back()

        return self._submit(run, list(tensors), wake=_is_async(opts))

    @_torch_errors
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None, op: Any = None) -> Work:
        tensors, opts = _as_list(tensors), _opts(dist.ReduceOptions, opts, op=op)
        root = self._root(opts.rootRank, "reduce")
        op = opts.reduceOp
        if len(tensors) != 1:
            raise ValueError(
                f"{self._where()}: reduce requires a single-element tensor list, got "
                f"{len(tensors)} tensors"
            )
        mine = self._rank == root
        t, comm = tensors[0], self._comm
        name = plain_dtype(t) if comm is not None else None
        nop = self._native_op(op, [t]) if name is not None else None
        if nop is not None:
            # The engine call itself: an all-reduce into the root's tensor, or
            # into a copy elsewhere (the other ranks' tensors stay as they were).
            return self._submit_engine(comm, "all_reduce", [t if mine else t.clone()], name,
                                       nop[0], [t], _is_async(opts), divide=nop[1])
        self._real_op(op, tensors, "reduce")
        ts = [self._tensor(t, f"reduce tensors[{i}]") for i, t in enumerate(tensors)]

        def run() -> None:
            # Non-roots reduce a (contiguous) copy: their tensors stay as they were.
            dense, back = self._dense(ts) if mine else (
                [t.clone(memory_format=torch.contiguous_format) for t in ts], lambda: None)
            name, post = self._reduce_args(op, dense, "reduce")
            all_reduce_coalesced(self._world(), dense, name, 1.0)
            if mine:
                for t in dense:
                    post(t)
                back()

        return self._submit(run, list(tensors), wake=_is_async(opts))

    def _gather_into(self, inp: torch.Tensor, outs: list[torch.Tensor], what: str) -> None:
        """All-gathers ``inp`` into ``outs`` (one tensor per rank)."""
        comm = self._world()
        inp = inp.contiguous()
        n = inp.numel()
        if all(o.numel() == n for o in outs) and all(o.dtype == inp.dtype for o in outs):
            flat = torch.empty(self._size * n, dtype=inp.dtype)
            with _sizes_of("all_gather", "output tensor r must have rank r's input size"):
                engine.all_gather(comm, inp, flat, check(inp, what))
            for r, o in enumerate(outs):
                o.view(-1).copy_(flat[r * n:(r + 1) * n]) if o.is_contiguous() else o.copy_(
                    flat[r * n:(r + 1) * n].view(o.shape)
                )
            return
        # Ragged: every rank sends its input to every rank.
        with _sizes_of("all_gather", "output tensor r must have rank r's input size"):
            flat = _gather_ragged(comm, self._size, inp, [o.numel() for o in outs])
        _split_into(flat, outs)

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        if isinstance(input_tensors, torch.Tensor):  # allgather(outputs, input)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        # As gloo's future: the output list itself for one input, else all of them.
        result = output_tensors[0] if len(output_tensors) == 1 else output_tensors
        if len(input_tensors) > 1:
            return self._allgather_devices(output_tensors, input_tensors, opts, result)
        return self._allgather(output_tensors, input_tensors, opts, result)

    @_torch_errors
    def _allgather_devices(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: Any, result: Any,
    ) -> Work:
        """``allgather`` of several inputs, torch's multi-device form (as
        gloo): ``output_tensors[i][r * k + j]`` receives rank r's input j
        (k inputs), the same in each of the k output lists."""
        k, size = len(input_tensors), self._size
        if len(output_tensors) != k:
            raise ValueError(
                f"{self._where()}: all_gather requires input/output tensor lists to have the "
                f"same length ({k} inputs, {len(output_tensors)} output lists)"
            )
        for i, lst in enumerate(output_tensors):
            if len(lst) != size * k:
                raise ValueError(
                    f"{self._where()}: all_gather: invalid output tensor list at index {i} "
                    f"(expected length {size * k}: {size} ranks x {k} inputs, got {len(lst)})"
                )
        self._same_tensors([self._tensor(t, "all_gather input") for t in input_tensors],
                           "all_gather")
        first = output_tensors[0]
        per_input = [[first[r * k + j] for r in range(size)] for j in range(k)]
        mirrors = [(src, o) for lst in output_tensors[1:] for o, src in zip(lst, first)]
        return self._allgather(per_input, input_tensors, opts, result, mirrors)

    @_torch_errors
    def _allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: Any, result: Any, mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> Work:
        """All-gathers each input into its list of outputs (one per rank),
        then copies each ``(source, destination)`` of ``mirrors``."""
        ins = [self._tensor(t, "all_gather input") for t in input_tensors]
        outs = [[self._tensor(o, "all_gather output") for o in lst] for lst in output_tensors]
        for lst in outs:
            if len(lst) != self._size:
                raise ValueError(
                    f"{self._where()}: all_gather needs {self._size} output tensors (one per "
                    f"rank), got {len(lst)}"
                )
        if self._comm is not None and ins:
            work = self._allgather_native(ins, outs, opts, result, mirrors)
            if work is not None:
                return work

        def run() -> None:
            for inp, lst in zip(ins, outs):
                self._gather_into(inp, lst, "all_gather input")
            for src, o in mirrors:
                o.copy_(src)

        return self._submit(run, list(result), wake=_is_async(opts))

    def _allgather_native(
        self, ins: list[torch.Tensor], outs: list[list[torch.Tensor]], opts: Any, result: Any,
        mirrors: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> Optional[Work]:
        """``_allgather`` as one native job when every tensor is plain and of
        one dtype: for one input, the engine's list form (even or ragged
        outputs); for several (the multi-device form) with even outputs, an
        all-gather of the inputs staged back to back, the job copying the flat
        result into the outputs. None otherwise."""
        name = _one_dtype([*ins, *(o for lst in outs for o in lst), *(o for _, o in mirrors)])
        if name is None:
            return None
        wake = _is_async(opts)
        if len(ins) == 1:
            return self._submit_list("all_gather", ins, outs[0], name, list(result), wake,
                                     after=mirrors)
        size, sizes = self._size, [t.numel() for t in ins]
        if any(o.numel() != n for lst, n in zip(outs, sizes) for o in lst):
            return None
        total = sum(sizes)
        src, before = _staged(ins)
        flat = torch.empty(size * total, dtype=ins[0].dtype)
        after = [(piece, lst[r]) for r in range(size)
                 for lst, piece in zip(outs, _pieces(flat[r * total:(r + 1) * total], sizes))]
        return self._submit_engine(self._comm, "all_gather", [src, flat], name, None,
                                   list(result), wake, before, after + list(mirrors),
                                   rename=_renamer(*_GATHER_RULE))

    @_torch_errors
    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        # torch's layout: output_lists[rank][i] receives input_list[i] of that rank.
        if len(output_lists) != self._size:
            raise ValueError(
                f"{self._where()}: all_gather_coalesced needs {self._size} output lists (one "
                f"per rank), got {len(output_lists)}"
            )
        for r, lst in enumerate(output_lists):
            if len(lst) != len(input_list):
                raise ValueError(
                    f"{self._where()}: all_gather_coalesced output list {r} holds {len(lst)} "
                    f"tensors for {len(input_list)} inputs"
                )
        per_input = [[lst[i] for lst in output_lists] for i in range(len(input_list))]
        return self._allgather(per_input, input_list, opts, output_lists)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        name = plain_dtype(input)
        comm = self._comm
        if (name is not None and comm is not None and plain_dtype(output) == name
                and output.nbytes == input.nbytes * self._size and disjoint(input, output)):
            # Queued as the engine call itself (run here at once when
            # synchronous on an idle queue); the future's value as gloo's (one
            # tensor per rank).
            return self._submit_engine(comm, "all_gather", [input, output], name, None,
                                       lambda: list(output.chunk(self._size)), _is_async(opts))
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    @_torch_errors
    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        pairs = []
        for o, i in zip(outputs, inputs):
            i, o = self._tensor(i, "all_gather_into_tensor input"), self._tensor(
                o, "all_gather_into_tensor output")
            if o.numel() != i.numel() * self._size or o.dtype != i.dtype:
                raise ValueError(
                    f"{self._where()}: all_gather_into_tensor: output holds {o.numel()} x "
                    f"{o.dtype}, expected {self._size} x {i.numel()} x {i.dtype} (group size "
                    "x input)"
                )
            pairs.append((o, i))
        # As gloo's future (its all_gather_into_tensor is an all_gather into
        # the output's chunks): one tensor per rank for a single output.
        result = list(outputs[0].chunk(self._size)) if len(outputs) == 1 else list(outputs)
        name = _one_dtype([t for pair in pairs for t in pair]) if self._comm is not None else None
        if name is not None and pairs:
            # One engine call: the inputs back to back (staged when several,
            # or when the input lies in the output), the job copying each
            # rank's block into the outputs.
            ins = [i for _, i in pairs]
            if len(pairs) == 1:
                o, i = pairs[0]
                src, before = (i, []) if disjoint(i, o) else _staged([i])
                return self._submit_engine(self._comm, "all_gather", [src, o], name, None, result,
                                           _is_async(opts), before)
            src, before = _staged(ins)
            sizes = [i.numel() for i in ins]
            total = sum(sizes)
            flat = torch.empty(self._size * total, dtype=src.dtype)
            after = [(piece, o.view(-1)[r * n:(r + 1) * n]) for r in range(self._size)
                     for (o, _), n, piece in zip(pairs, sizes,
                                                 _pieces(flat[r * total:(r + 1) * total], sizes))]
            return self._submit_engine(self._comm, "all_gather", [src, flat], name, None, result,
                                       _is_async(opts), before, after)

        def run() -> None:
            comm = self._world()
            for o, i in pairs:
                dense, back = self._dense([o])
                src = i.contiguous()
                if overlaps(src, dense[0]):  # in place (FSDP2: input is a slot of output)
                    src = src.clone()
                engine.all_gather(comm, src, dense[0], check(src, "all_gather_into_tensor input"))
                back()

        return self._submit(run, result, wake=_is_async(opts))

    all_gather_single_coalesced = allgather_into_tensor_coalesced
    all_gather_single = _allgather_base

    def _scatter_reduce(
        self, inp: torch.Tensor, out: torch.Tensor, op: Any, what: str,
        blocks: Optional[list[int]] = None,
    ) -> None:
        """Reduce-scatters flat ``inp`` (one block per rank) into ``out``."""
        comm = self._world()
        inp = inp.contiguous()
        if getattr(op, "op", op) == _RED.PREMUL_SUM or overlaps(inp, out):
            inp = inp.clone()  # scaled, or written over: the caller's input stays
        name, post = self._reduce_args(op, [inp], what)
        if blocks is None or len(set(blocks)) == 1:
            dense, back = self._dense([out])
            engine.reduce_scatter(comm, inp.view(-1), dense[0].view(-1), name, check(inp, what))
            post(dense[0])
            back()
            return
        # Ragged blocks: reduce everything, keep this rank's block.
        all_reduce_coalesced(comm, [inp], name, 1.0)
        start = sum(blocks[: self._rank])
        mine = inp.view(-1)[start:start + blocks[self._rank]].clone()
        post(mine)
        out.copy_(mine.view(out.shape))

    @_torch_errors
    def reduce_scatter(  # the list form: inputs are concatenated into a fresh buffer
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Work:
        if isinstance(output_tensors, torch.Tensor):  # reduce_scatter(output, inputs, op)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        op = _opts(dist.ReduceScatterOptions, opts).reduceOp
        self._real_op(op, [output_tensors, input_tensors], "reduce_scatter")
        outs = [self._tensor(o, "reduce_scatter output") for o in output_tensors]
        ins = [[self._tensor(t, "reduce_scatter input") for t in lst] for lst in input_tensors]
        for o, lst in zip(outs, ins):
            if len(lst) != self._size:
                raise ValueError(
                    f"{self._where()}: reduce_scatter needs {self._size} input tensors (one "
                    f"per rank), got {len(lst)}"
                )
            if lst[self._rank].numel() != o.numel():
                raise ValueError(
                    f"{self._where()}: reduce_scatter output holds {o.numel()} elements but "
                    f"this rank's input block holds {lst[self._rank].numel()}"
                )

        name = (_one_dtype([*outs, *ins[0]]) if self._comm is not None and len(outs) == 1
                else None)
        nop = (self._native_op(op, [output_tensors[0], *input_tensors[0]]) if name is not None
               else None)
        if nop is not None and not nop[1]:
            return self._submit_list("reduce_scatter", ins[0], outs, name,
                                     list(output_tensors), _is_async(opts), red=nop[0])
        if nop is not None:
            # AVG: one engine call on the inputs staged back to back, the job
            # dividing: a reduce-scatter into the output, or (blocks differing
            # in size) an all-reduce whose block of this rank it copies out.
            (red, divide), o = nop, outs[0]
            flat, before = _staged(ins[0])
            blocks = [t.numel() for t in ins[0]]
            if len(set(blocks)) == 1:
                return self._submit_engine(self._comm, "reduce_scatter", [flat, o], name, red,
                                           list(output_tensors), _is_async(opts), before,
                                           divide=divide)
            mine = _pieces(flat, blocks)[self._rank]
            return self._submit_engine(self._comm, "all_reduce", [flat], name, red,
                                       list(output_tensors), _is_async(opts), before,
                                       [(mine, o)], divide)

        def run() -> None:
            for o, lst in zip(outs, ins):
                flat = torch.cat([t.reshape(-1) for t in lst])
                self._scatter_reduce(flat, o, op, "reduce_scatter", [t.numel() for t in lst])

        return self._submit(run, list(output_tensors), wake=_is_async(opts))

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Work:
        name = plain_dtype(input)
        comm = self._comm if opts is not None else None
        if name is not None and comm is not None and plain_dtype(output) == name:
            red = _engine_op(opts.reduceOp, input)
            if (red is not None and output.nbytes * self._size == input.nbytes
                    and disjoint(input, output)):
                # Queued as the engine call itself (run here at once when
                # synchronous on an idle queue).
                return self._submit_engine(comm, "reduce_scatter", [input, output], name, red,
                                           [output], _is_async(opts))
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    @_torch_errors
    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        self._real_op(op, [outputs, inputs], "reduce_scatter_tensor")
        pairs = []
        for o, i in zip(outputs, inputs):
            i, o = self._tensor(i, "reduce_scatter_tensor input"), self._tensor(
                o, "reduce_scatter_tensor output")
            if i.numel() != o.numel() * self._size or o.dtype != i.dtype:
                raise ValueError(
                    f"{self._where()}: reduce_scatter_tensor: input holds {i.numel()} x "
                    f"{i.dtype}, expected {self._size} x {o.numel()} x {o.dtype} (group size x "
                    "output)"
                )
            pairs.append((o, i))
        name = _one_dtype([t for pair in pairs for t in pair]) if self._comm is not None else None
        nop = (self._native_op(op, [*outputs, *inputs]) if name is not None and pairs
               else None)
        if nop is not None:
            # One engine call: each rank's blocks of the inputs staged side by
            # side (unless one input lies apart from its output), the job
            # copying the reduced blocks into the outputs.
            (red, divide), size = nop, self._size
            if len(pairs) == 1 and disjoint(pairs[0][1], pairs[0][0]):
                o, i = pairs[0]
                return self._submit_engine(self._comm, "reduce_scatter", [i, o], name, red,
                                           list(outputs), _is_async(opts), divide=divide)
            sizes = [o.numel() for o, _ in pairs]
            total = sum(sizes)
            flat = torch.empty(size * total, dtype=pairs[0][0].dtype)
            before = [(i.view(-1)[r * m:(r + 1) * m], piece) for r in range(size)
                      for (_, i), m, piece in zip(pairs, sizes,
                                                  _pieces(flat[r * total:(r + 1) * total], sizes))]
            mine = flat.new_empty(total)
            after = [(piece, o) for (o, _), piece in zip(pairs, _pieces(mine, sizes))]
            return self._submit_engine(self._comm, "reduce_scatter", [flat, mine], name, red,
                                       list(outputs), _is_async(opts), before, after, divide)

        def run() -> None:
            for o, i in pairs:
                self._scatter_reduce(i, o, op, "reduce_scatter_tensor")

        return self._submit(run, list(outputs), wake=_is_async(opts))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base

    @_torch_errors
    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        if isinstance(input_tensors, torch.Tensor):  # gather(outputs, input, root)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        opts = _opts(dist.GatherOptions, opts)
        root = self._root(opts.rootRank, "gather")
        inp = self._tensor(input_tensors[0], "gather input")
        outs: list[torch.Tensor] = []
        if self._rank == root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != self._size:
                raise ValueError(
                    f"{self._where()}: gather needs a list of {self._size} output tensors on "
                    "the root"
                )
            outs = [self._tensor(o, "gather output") for o in output_tensors[0]]
        elif output_tensors and any(output_tensors):
            raise ValueError(f"{self._where()}: gather output tensors are only given on the root")
        # As gloo's future: the root's list of gathered tensors.
        result = list(output_tensors[0]) if outs else list(output_tensors)
        name = _one_dtype([inp, *outs]) if self._comm is not None else None
        if name is not None:
            return self._submit_list("gather", [inp], outs, name, result, _is_async(opts), root)

        def run() -> None:
            # One all-to-all: every rank sends its input to the root only.
            send = inp.contiguous().view(-1)
            counts = [0] * self._size
            counts[root] = send.numel()
            recv_counts = [o.numel() for o in outs] if outs else [0] * self._size
            flat = torch.empty(sum(recv_counts), dtype=inp.dtype)
            with _sizes_of(*_GATHER_ROOT_RULE):
                engine.all_to_all_v(self._world(), send, counts, flat, recv_counts)
            _split_into(flat, outs)

        return self._submit(run, result, wake=_is_async(opts))

    @_torch_errors
    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Work:
        if isinstance(output_tensors, torch.Tensor):  # scatter(output, inputs, root)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        opts = _opts(dist.ScatterOptions, opts)
        root = self._root(opts.rootRank, "scatter")
        out = self._tensor(output_tensors[0], "scatter output")
        ins: list[torch.Tensor] = []
        if self._rank == root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
                raise ValueError(
                    f"{self._where()}: scatter needs a list of {self._size} input tensors on "
                    "the root"
                )
            ins = [self._tensor(t, "scatter input") for t in input_tensors[0]]
        elif input_tensors and any(input_tensors):
            raise ValueError(f"{self._where()}: scatter input tensors are only given on the root")
        name = _one_dtype([out, *ins]) if self._comm is not None else None
        if name is not None:
            return self._submit_list("scatter", ins, [out], name, list(output_tensors),
                                     _is_async(opts), root)

        def run() -> None:
            # One all-to-all: the root sends block r to rank r.
            send = (torch.cat([t.reshape(-1) for t in ins]) if ins
                    else torch.empty(0, dtype=out.dtype))
            counts = [t.numel() for t in ins] if ins else [0] * self._size
            recv_counts = [0] * self._size
            recv_counts[root] = out.numel()
            dense, back = self._dense([out])
            with _sizes_of(*_SCATTER_RULE):
                engine.all_to_all_v(self._world(), send, counts, dense[0].view(-1), recv_counts)
            back()

        return self._submit(run, list(output_tensors), wake=_is_async(opts))

    @_torch_errors
    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
        input_split_sizes: list[int], opts: Any = None,
    ) -> Work:
        inp = self._tensor(input, "all_to_all_single input")
        out = self._tensor(output, "all_to_all_single output")
        if inp.dtype != out.dtype:
            raise ValueError(
                f"{self._where()}: all_to_all_single input is {inp.dtype} but output is {out.dtype}"
            )

        def counts(t: torch.Tensor, splits: list[int], what: str) -> list[int]:
            rows = t.shape[0] if t.dim() else 1
            row = t.numel() // rows if rows else 0
            if not splits:
                if rows % self._size:
                    raise ValueError(
                        f"{self._where()}: all_to_all_single {what} has {rows} rows, not "
                        f"divisible by the group size {self._size}; pass split sizes"
                    )
                return [rows // self._size * row] * self._size
            if len(splits) != self._size or sum(splits) != rows or min(splits) < 0:
                raise ValueError(
                    f"{self._where()}: all_to_all_single {what} split sizes {list(splits)} must "
                    f"be {self._size} non-negative numbers adding up to dim 0 ({rows})"
                )
            return [s * row for s in splits]

        send_counts = counts(inp, list(input_split_sizes), "input")
        recv_counts = counts(out, list(output_split_sizes), "output")
        name, comm = plain_dtype(input), self._comm
        if (name is not None and comm is not None and plain_dtype(output) == name
                and disjoint(input, output)):  # queued as the engine call itself
            return self._submit_engine(comm, "all_to_all_v", [input, output], name,
                                       (send_counts, recv_counts), [output], _is_async(opts))

        def run() -> None:
            dense, back = self._dense([out])
            engine.all_to_all_v(self._world(), inp.contiguous().view(-1), send_counts,
                      dense[0].view(-1), recv_counts)
            back()

        return self._submit(run, [output], wake=_is_async(opts))

    all_to_all_single = alltoall_base

    @_torch_errors
    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        ins = [self._tensor(t, "all_to_all input") for t in input_tensors]
        outs = [self._tensor(t, "all_to_all output") for t in output_tensors]
        if len(ins) != self._size or len(outs) != self._size:
            raise ValueError(
                f"{self._where()}: all_to_all needs {self._size} input and output tensors, got "
                f"{len(ins)} and {len(outs)}"
            )
        dtypes = {t.dtype for t in ins + outs}
        if len(dtypes) != 1:
            raise ValueError(
                f"{self._where()}: all_to_all tensors mix dtypes {sorted(map(str, dtypes))}"
            )
        name = _one_dtype(ins + outs) if self._comm is not None else None
        if name is not None:
            return self._submit_list("all_to_all", ins, outs, name, list(output_tensors),
                                     _is_async(opts))

        def run() -> None:
            send = torch.cat([t.reshape(-1) for t in ins])
            flat = torch.empty(sum(o.numel() for o in outs), dtype=outs[0].dtype)
            engine.all_to_all_v(self._world(), send, [t.numel() for t in ins], flat,
                      [o.numel() for o in outs])
            _split_into(flat, outs)

        return self._submit(run, list(output_tensors), wake=_is_async(opts))

    def barrier(self, opts: Any = None) -> Work:
        comm = self._comm
        if comm is not None:  # queued as the engine call itself
            return self._submit_engine(comm, "barrier", [], "uint8", None, [], _is_async(opts))
        return self._submit(lambda: self._world().barrier(), [], wake=_is_async(opts))
