"""XLA-style collectives on eager CPU tensors, following ``torch_xla``'s
``xla_model`` names, signatures, defaults and return conventions, so code
written for it ports by changing the import.

Data never passes through Python: the engine reads and writes the tensors'
memory directly, with the GIL released while it communicates.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, Callable, Optional, TextIO, TypedDict, Union

import numpy as np
import torch
from torch.autograd import profiler as _profiler

from .. import errors
from ..core import engine
from ..core import groups as core_groups
from ..core.engine import (
    REDUCE_AND,
    REDUCE_MAX,
    REDUCE_MIN,
    REDUCE_MUL,
    REDUCE_OR,
    REDUCE_SUM,
    TensorLike,
    all_reduce_coalesced,
    apply_scale,
    as_tensor,
    check,
    check_int,
    check_reduce_type,
    error_rank,
    overlaps,
    storage_ptr,
    traced,
    world_all_gather,
    world_all_reduce,
    world_all_reduce_into,
    world_broadcast,
    world_reduce_scatter,
)
from ..core.groups import get_local_ordinal, get_ordinal, world_size

__all__ = [
    "REDUCE_AND",
    "REDUCE_MAX",
    "REDUCE_MIN",
    "REDUCE_MUL",
    "REDUCE_OR",
    "REDUCE_SUM",
    "CoalescingBuckets",
    "RateTracker",
    "add_step_closure",
    "all_gather",
    "all_gather_bucketized",
    "all_reduce",
    "all_reduce_bucketized_gradients",
    "all_to_all",
    "all_to_all_v",
    "barrier",
    "broadcast_master_param",
    "collective_broadcast",
    "collective_permute",
    "do_on_ordinals",
    "get_rng_state",
    "is_master_ordinal",
    "mark_step",
    "master_print",
    "mesh_reduce",
    "optimization_barrier_",
    "optimizer_step",
    "recv",
    "reduce_gradients",
    "reduce_scatter",
    "reduce_scatter_bucketized",
    "rendezvous",
    "save",
    "send",
    "set_rng_state",
    "wait_device_ops",
    "xla_device",
    "xla_device_hw",
    "xla_rendezvous",
]

def _always_allreduce() -> bool:
    """``$XLA_ALWAYS_ALLREDUCE`` read as torch_xla reads it (an integer flag:
    ``0`` or unset keeps the world-size-1 shortcut)."""
    raw = os.environ.get("XLA_ALWAYS_ALLREDUCE", "").strip()
    try:
        return bool(int(raw)) if raw else False
    except ValueError:
        return raw.lower() in ("true", "yes", "on")


def all_reduce(
    reduce_type: str,
    inputs: Union[TensorLike, list[TensorLike]],
    scale: float = 1.0,
    groups: Optional[list[list[int]]] = None,
    pin_layout: bool = True,
) -> Union[TensorLike, list[TensorLike]]:
    """Reduces tensors element-wise across replicas.

    Args:
      reduce_type (str): One of ``REDUCE_SUM``, ``REDUCE_MUL``, ``REDUCE_AND``,
        ``REDUCE_OR``, ``REDUCE_MIN`` and ``REDUCE_MAX`` (``AND``/``OR`` need bool
        or integer tensors: logical for bool, bitwise for integers).
      inputs: A single tensor (or numpy array), or a list of them.
      scale (float): Multiplies the reduced result. Default: 1.0
      groups (list, optional): Replica groups, e.g. ``[[0, 1], [2, 3]]``; the
        reduction runs independently inside each group. ``None``: one group
        with every replica.
      pin_layout (bool, optional): Accepted for compatibility; no effect.

    Returns:
      For a single tensor, a new tensor holding the reduced value. For a list,
      the tensors are reduced in place and the list itself is returned. With
      one replica, a single tensor is returned cloned (unscaled) and a list
      untouched, as in torch_xla.

    Example:
      >>> t = torch.ones(4) * (ringlet.get_ordinal() + 1)
      >>> ringlet.all_reduce(ringlet.REDUCE_SUM, t)   # on 2 ranks
      tensor([3., 3., 3., 3.])
    """
    # The common call in the fewest steps: one plain tensor in a list, over
    # the world, no profiler recording (which the general path reports to).
    if (type(inputs) is list and len(inputs) == 1 and not groups
            and not _profiler._is_profiler_enabled and world_all_reduce(inputs[0], reduce_type)):
        if scale != 1.0:
            apply_scale(inputs[0], scale)
        return inputs
    if type(inputs) is torch.Tensor and not groups and not _profiler._is_profiler_enabled:
        out = world_all_reduce_into(inputs, reduce_type)  # a new tensor, input untouched
        if out is not None:
            if scale != 1.0:
                apply_scale(out, scale)
            return out
    return _all_reduce(reduce_type, inputs, scale, groups, pin_layout)


@traced
def _all_reduce(
    reduce_type: str,
    inputs: Union[TensorLike, list[TensorLike]],
    scale: float,
    groups: Optional[list[list[int]]],
    pin_layout: bool,
) -> Union[TensorLike, list[TensorLike]]:
    """The general path of :func:`all_reduce` (checked, any group)."""
    if world_size() == 1 and not _always_allreduce():
        if isinstance(inputs, (torch.Tensor, np.ndarray)):
            return inputs.clone() if isinstance(inputs, torch.Tensor) else inputs.copy()
        return inputs
    reduce_type = check_reduce_type(reduce_type)
    comm = core_groups.group_comm(groups)
    if isinstance(inputs, (torch.Tensor, np.ndarray)):
        src = as_tensor(inputs, "input")
        check(src, "input")
        out = src.detach().clone()
        all_reduce_coalesced(comm, [out], reduce_type, scale)
        return out.numpy() if isinstance(inputs, np.ndarray) else out
    if isinstance(inputs, (list, tuple)):
        tensors = [  # tensors skip as_tensor: no name to format on the hot path
            t if isinstance(t, torch.Tensor) else as_tensor(t, f"inputs[{i}]", write=True)
            for i, t in enumerate(inputs)
        ]
        all_reduce_coalesced(comm, tensors, reduce_type, scale)
        return inputs
    raise TypeError(
        f"rank {error_rank()}: inputs must be a tensor or a list of tensors, "
        f"got {type(inputs).__name__}"
    )


def _norm_dim(dim: int, ndim: int, what: str) -> int:
    if ndim == 0:
        raise ValueError(f"rank {error_rank()}: {what} needs a tensor with at least one dimension")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"rank {error_rank()}: dimension {dim} is out of range for a {ndim}-d tensor in {what}"
        )
    return dim % ndim


def _output_for(output: Any, value: torch.Tensor, shape: list[int], what: str) -> torch.Tensor:
    """``output`` checked to take a result of ``shape`` and ``value``'s dtype.
    torch_xla's out-variants overwrite their output outright, so a torch
    tensor of the right dtype but another shape is resized to the result
    (not one sharing memory with ``value``, which is still to be read)."""
    if (isinstance(output, torch.Tensor) and list(output.shape) != shape
            and output.dtype == value.dtype and output.layout == torch.strided
            and storage_ptr(output) != storage_ptr(value)):
        output.resize_(shape)
    output = as_tensor(output, "output", write=True)
    check(output, "output")
    if list(output.shape) != shape or output.dtype != value.dtype:
        raise ValueError(
            f"rank {error_rank()}: {what} output has shape {tuple(output.shape)} and dtype "
            f"{output.dtype}; expected {tuple(shape)} and {value.dtype}"
        )
    return output


def _gather_one(
    comm: Any, value: torch.Tensor, dim: int, output: Optional[torch.Tensor]
) -> torch.Tensor:
    name = check(value, "value")
    n = comm.size
    dim = _norm_dim(dim, value.dim(), "all_gather")
    shape = list(value.shape)
    shape[dim] *= n
    if output is not None:
        output = _output_for(output, value, shape, "all_gather")
    if dim == 0:
        target = output if output is not None else torch.empty(shape, dtype=value.dtype)
        engine.all_gather(comm, value, target, name)
        return target
    stacked = torch.empty([n, *value.shape], dtype=value.dtype)
    engine.all_gather(comm, value, stacked, name)
    result = stacked.movedim(0, dim).reshape(shape)
    if output is not None:
        output.copy_(result)
        return output
    return result


def all_gather(
    value: Union[torch.Tensor, list[torch.Tensor]],
    dim: int = 0,
    groups: Optional[list[list[int]]] = None,
    output: Optional[Union[torch.Tensor, list[torch.Tensor]]] = None,
    pin_layout: bool = True,
) -> Union[torch.Tensor, list[torch.Tensor]]:
    """Concatenates every replica's tensor along a dimension.

    Args:
      value (torch.Tensor or list): The input tensor, or a list of tensors
        (gathered one by one; needs ``pin_layout=False`` as in torch_xla).
      dim (int): The gather dimension (negative counts from the end). Default: 0
      groups (list, optional): Replica groups; they must all have the same size.
      output (torch.Tensor or list, optional): Where to write the result.
      pin_layout (bool, optional): No effect on a single tensor; a list input
        requires ``False``.

    Returns:
      A tensor whose ``dim`` holds every replica's values in replica order
      (``output`` itself when given), or a list of such tensors.

    Example:
      >>> t = torch.tensor([ringlet.get_ordinal()])
      >>> ringlet.all_gather(t)     # on 2 ranks
      tensor([0, 1])
    """
    if not groups and dim == 0 and not _profiler._is_profiler_enabled:
        fast = world_all_gather(value, output)  # the common call, in the fewest steps
        if fast is not None:
            return fast
    return _all_gather(value, dim, groups, output, pin_layout)


@traced
def _all_gather(
    value: Union[torch.Tensor, list[torch.Tensor]],
    dim: int,
    groups: Optional[list[list[int]]],
    output: Optional[Union[torch.Tensor, list[torch.Tensor]]],
    pin_layout: bool,
) -> Union[torch.Tensor, list[torch.Tensor]]:
    """The general path of :func:`all_gather` (checked, any group or dim)."""
    if not (pin_layout and output is None and isinstance(value, (torch.Tensor, np.ndarray))):
        # torch_xla's default form gathers through an all-reduce, which takes
        # groups of any sizes; its other forms assert equal ones.
        _check_equal_groups(groups)
    if isinstance(value, (torch.Tensor, np.ndarray)):
        value = as_tensor(value, "value")
        comm = core_groups.group_comm(groups)
        if not isinstance(output, (torch.Tensor, np.ndarray, type(None))):
            raise TypeError(
                f"rank {error_rank()}: output must be a tensor, got {type(output).__name__}"
            )
        return _gather_one(comm, value, dim, output)
    if isinstance(value, list) and all(isinstance(v, torch.Tensor) for v in value):
        if pin_layout:
            raise RuntimeError(
                "For xm.all_gather with list of tensors input, pin_layout=True is not yet "
                "supported."
            )
        outputs = _check_output_list(output, value)
        comm = core_groups.group_comm(groups)
        gathered = [
            _gather_one(comm, v, dim, outputs[i] if outputs is not None else None)
            for i, v in enumerate(value)
        ]
        return output if outputs is not None else gathered  # torch_xla returns `output`
    raise TypeError(
        f"`value` needs to be a Tensor or a list of Tensors, but given {type(value)}."
    )


def _check_output_list(output: Any, inputs: list[Any]) -> Optional[list[torch.Tensor]]:
    if output is None:
        return None
    if not isinstance(output, list) or any(not isinstance(v, torch.Tensor) for v in output):
        raise TypeError(f"`output` needs to be a list of Tensors, but given {type(output)}.")
    if len(output) != len(inputs):
        raise ValueError(
            f"`output` length doesn't match `input` length: {len(output)} vs {len(inputs)}."
        )
    return output


def _check_equal_groups(groups: Optional[list[list[int]]]) -> None:
    if groups and isinstance(groups, (list, tuple)):
        sizes = {len(g) for g in groups if isinstance(g, (list, tuple))}
        if len(sizes) > 1:
            raise errors.ReplicaGroupError(
                f"rank {error_rank()}: Replica groups must have the same number of replicas/shards "
                f"(group sizes {sorted(sizes)})."
            )


def _scatter_one(
    comm: Any,
    reduce_type: str,
    value: torch.Tensor,
    scale: float,
    scatter_dim: int,
    shard_count: int,
    output: Optional[torch.Tensor],
) -> torch.Tensor:
    name = check(value, "input")
    n = comm.size
    if shard_count != n:
        raise ValueError(
            f"rank {error_rank()}: reduce_scatter shard_count={shard_count} must equal the "
            f"number of replicas in the group ({n})"
        )
    dim = _norm_dim(scatter_dim, value.dim(), "reduce_scatter")
    if value.shape[dim] % shard_count != 0:
        raise ValueError(
            f"rank {error_rank()}: reduce_scatter dimension {dim} of size {value.shape[dim]} is "
            f"not divisible by shard_count={shard_count}"
        )
    shape = list(value.shape)
    shape[dim] //= shard_count
    if output is not None:
        output = _output_for(output, value, shape, "reduce_scatter")
    front = value if dim == 0 else value.movedim(dim, 0).contiguous()
    if output is not None and dim == 0 and not overlaps(output, front):
        # the engine writes straight into `output`
        engine.reduce_scatter(comm, front, output, reduce_type, name)
        apply_scale(output, scale)
        return output
    block = torch.empty([front.shape[0] // n, *front.shape[1:]], dtype=value.dtype)
    engine.reduce_scatter(comm, front, block, reduce_type, name)
    apply_scale(block, scale)
    result = block if dim == 0 else block.movedim(0, dim)
    if output is not None:
        output.copy_(result)
        return output
    return result.contiguous()


def reduce_scatter(
    reduce_type: str,
    input: Union[torch.Tensor, list[torch.Tensor]],
    scale: float,
    scatter_dim: int,
    shard_count: int,
    groups: Optional[list[list[int]]] = None,
    output: Optional[Union[torch.Tensor, list[torch.Tensor]]] = None,
    pin_layout: bool = True,
) -> Union[torch.Tensor, list[torch.Tensor]]:
    """Reduces across replicas, then gives each replica one shard of the result.

    Args:
      reduce_type (str): One of the ``REDUCE_*`` constants.
      input (torch.Tensor or list): The input tensor, or a list of them.
      scale (float): Multiplies the reduced result.
      scatter_dim (int): The dimension split into ``shard_count`` shards.
      shard_count (int): Number of shards; must equal the group size.
      groups (list, optional): Replica groups of equal size.
      output (torch.Tensor or list, optional): Where to write the shard(s).
      pin_layout (bool, optional): Accepted for compatibility; no effect.

    Returns:
      This replica's shard (shard ``i`` for the ``i``-th replica of its group)
      of the scaled reduction, with every other dimension unchanged; ``output``
      when given; a list for a list input.

    Example:
      >>> x = torch.arange(4.)            # same on 2 ranks
      >>> ringlet.reduce_scatter(ringlet.REDUCE_SUM, x, 1.0, 0, 2)
      tensor([0., 2.])                    # rank 0; rank 1 gets tensor([4., 6.])
    """
    if not groups and scatter_dim == 0 and not _profiler._is_profiler_enabled:
        fast = world_reduce_scatter(reduce_type, input, scale, shard_count, output)
        if fast is not None:  # the common call, in the fewest steps
            return fast
    return _reduce_scatter(
        reduce_type, input, scale, scatter_dim, shard_count, groups, output, pin_layout
    )


@traced
def _reduce_scatter(
    reduce_type: str,
    input: Union[torch.Tensor, list[torch.Tensor]],
    scale: float,
    scatter_dim: int,
    shard_count: int,
    groups: Optional[list[list[int]]],
    output: Optional[Union[torch.Tensor, list[torch.Tensor]]],
    pin_layout: bool,
) -> Union[torch.Tensor, list[torch.Tensor]]:
    """The general path of :func:`reduce_scatter` (checked, any group or dim)."""
    reduce_type = check_reduce_type(reduce_type)
    _check_equal_groups(groups)
    if isinstance(input, (torch.Tensor, np.ndarray)):
        value = as_tensor(input, "input")
        comm = core_groups.group_comm(groups)
        return _scatter_one(comm, reduce_type, value, scale, scatter_dim, shard_count, output)
    if isinstance(input, list) and all(isinstance(v, torch.Tensor) for v in input):
        outputs = _check_output_list(output, input)
        comm = core_groups.group_comm(groups)
        shards = [
            _scatter_one(
                comm,
                reduce_type,
                v,
                scale,
                scatter_dim,
                shard_count,
                outputs[i] if outputs is not None else None,
            )
            for i, v in enumerate(input)
        ]
        return output if outputs is not None else shards  # torch_xla returns `output`
    raise TypeError(
        f"`input` needs to be a Tensor or a list of Tensors, but given {type(input)}."
    )


def collective_broadcast(
    tensors: list[torch.Tensor],
    root_ordinal: int = 0,
    groups: Optional[list[list[int]]] = None,
    pin_layout: bool = True,
) -> None:
    """Overwrites ``tensors`` on every replica with the root replica's values.

    Args:
      tensors (list): Tensors to broadcast, in place.
      root_ordinal (int): Global ordinal of the replica whose values win.
        With ``groups``, a group that does not contain the root ends with
        zeros, as in torch_xla (which multiplies non-root values by 0 and
        all-reduces within each group).
      groups (list, optional): Replica groups.
      pin_layout (bool, optional): Accepted for compatibility; no effect.

    Example:
      >>> t = torch.full((2,), float(ringlet.get_ordinal()))
      >>> ringlet.collective_broadcast([t], root_ordinal=1)
      >>> t
      tensor([1., 1.])
    """
    if (not groups and type(tensors) is list and len(tensors) == 1
            and not _profiler._is_profiler_enabled and world_broadcast(tensors[0], root_ordinal)):
        return  # the common call, in the fewest steps
    _collective_broadcast(tensors, root_ordinal, groups, pin_layout)


@traced
def _collective_broadcast(
    tensors: list[torch.Tensor],
    root_ordinal: int,
    groups: Optional[list[list[int]]],
    pin_layout: bool,
) -> None:
    """The general path of :func:`collective_broadcast` (checked, any group)."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"rank {error_rank()}: tensors must be a list of tensors")
    if world_size() == 1:
        if root_ordinal != 0:
            raise ValueError(f"rank 0: root_ordinal {root_ordinal} is out of range for 1 replica")
        return
    if not isinstance(root_ordinal, int) or not 0 <= root_ordinal < world_size():
        raise ValueError(
            f"rank {error_rank()}: root_ordinal {root_ordinal} is out of range for world size "
            f"{world_size()}"
        )
    comm = core_groups.group_comm(groups)
    root: Optional[int] = root_ordinal
    if groups:
        mine = list(next(g for g in groups if error_rank() in g))
        root = mine.index(root_ordinal) if root_ordinal in mine else None
    checked = [as_tensor(t, f"tensors[{i}]", write=True).detach() for i, t in enumerate(tensors)]
    names = [check(t, f"tensors[{i}]") for i, t in enumerate(checked)]
    for t, name in zip(checked, names):
        if root is None:
            t.zero_()  # the whole group lacks the root: all of it ends with zeros
        else:
            engine.broadcast(comm, t, root, name)


@traced
def barrier() -> None:
    """Blocks until every replica has called it.

    Example:
      >>> ringlet.barrier()
    """
    core_groups.world_comm().barrier()


@traced
def rendezvous(tag: str, payload: bytes = b"", replicas: list[int] = []) -> list[bytes]:  # noqa: B006
    """Waits for every replica to reach the named rendezvous and exchanges payloads.

    Args:
      tag (str): Name of the rendezvous (used in messages only).
      payload (bytes, optional): This replica's payload; lengths may differ.
      replicas (list, optional): The replica ordinals taking part; empty means
        all. As in torch_xla, only the whole world is supported: a list of
        another length raises ``ValueError``.

    Returns:
      The payloads of every replica, in ordinal order.

    Example:
      >>> ringlet.rendezvous("init", b"hi")     # on 2 ranks
      [b'hi', b'hi']
    """
    if replicas and len(replicas) != world_size():
        raise ValueError("Only global rendezvous is supported")
    if not isinstance(payload, (bytes, bytearray)):
        raise TypeError(f"`payload` must be bytes, not {type(payload)}")
    if world_size() == 1:
        return [bytes(payload)]
    comm = core_groups.world_comm()
    n = comm.size
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = torch.empty(n, dtype=torch.int64)
    engine.all_gather(comm, size, sizes, "int64")
    longest = int(sizes.max())
    if longest == 0:
        return [b"" for _ in range(n)]
    data = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    everything = torch.empty(n * longest, dtype=torch.uint8)
    engine.all_gather(comm, data, everything, "uint8")
    raw = everything.numpy().tobytes()
    return [raw[i * longest : i * longest + int(sizes[i])] for i in range(n)]


@traced
def mesh_reduce(tag: str, data: Any, reduce_fn: Callable[[list[Any]], Any]) -> Any:
    """Reduces an arbitrary picklable value across replicas.

    Args:
      tag (str): Name of the rendezvous.
      data: The value (tensors, numbers, containers) to reduce.
      reduce_fn (callable): Receives the list of every replica's ``data`` (in
        ordinal order) and returns the result.

    Returns:
      ``reduce_fn`` applied to every replica's value.

    Example:
      >>> ringlet.mesh_reduce("acc", 0.5 + ringlet.get_ordinal(), np.mean)   # 2 ranks
      1.0
    """
    buf = io.BytesIO()
    torch.save(data, buf)
    payloads = rendezvous(tag, buf.getvalue())
    # Peers of one job are trusted: their values may be arbitrary objects.
    values = [torch.load(io.BytesIO(p), weights_only=False) for p in payloads]
    return reduce_fn(values) if values else data


def is_master_ordinal(local: bool = True) -> bool:
    """Returns whether this process is the master (ordinal 0).

    Args:
      local (bool): Check the ordinal within this host (True) or the global one.
    """
    ordinal = get_local_ordinal() if local else get_ordinal()
    return ordinal == 0


def master_print(
    *args: Any, fd: TextIO = sys.stdout, local: bool = False, flush: bool = False
) -> None:
    """Prints ``args`` on the master ordinal only (global master by default)."""
    if is_master_ordinal(local=local):
        print(*args, file=fd, flush=flush)


def wait_device_ops(devices: list[str] = []) -> None:  # noqa: B006
    """Waits for pending device work. CPU collectives are synchronous, so this
    returns at once; it exists so torch_xla code ports unchanged."""
    del devices


def save(
    data: Any,
    file_or_path: Union[str, os.PathLike, Any],
    master_only: bool = True,
    global_master: bool = False,
) -> None:
    """Saves ``data`` with ``torch.save`` from the master ordinal(s).

    Args:
      data: Any nested structure of tensors and Python objects.
      file_or_path: A path or a writable file object.
      master_only (bool): Only the master writes (else every process writes,
        so each needs its own destination). Default: True
      global_master (bool): With ``master_only``, only global ordinal 0 writes
        (instead of each host's local master). Default: False

    Example:
      >>> ringlet.save(model.state_dict(), "model.pt")
      >>> ringlet.rendezvous("saved")   # others wait before reading it
    """
    if not master_only or is_master_ordinal(local=not global_master):
        torch.save(data, file_or_path)


class RateTracker:
    """Tracks a smoothed rate of events per second (e.g. samples/s).

    Args:
      smooth_factor (float, optional): Weight of the previous rate when
        smoothing. Default: ``$RATE_TRACKER_SMOOTHING`` or 0.4.
    """

    def __init__(self, smooth_factor: Optional[float] = None) -> None:
        env = float(os.environ.get("RATE_TRACKER_SMOOTHING", "0.4"))
        self._smooth_factor = env if smooth_factor is None else smooth_factor
        self._start_time = time.time()
        self._partial_time = self._start_time
        self._partial_count = 0.0
        self._partial_rate: Optional[float] = None
        self._count = 0.0

    def add(self, count: float) -> None:
        """Records ``count`` more events."""
        self._count += count

    def _update(self, now: float, rate: float) -> None:
        """Folds the events counted so far into the totals at time ``now``."""
        self._partial_count += self._count
        self._count = 0.0
        self._partial_time = now
        self._partial_rate = rate

    def _smooth(self, current_rate: float) -> float:
        """``current_rate`` blended with the previous rate by the smoothing factor."""
        if self._partial_rate is None:
            return current_rate
        return (1 - self._smooth_factor) * current_rate + (
            self._smooth_factor * self._partial_rate
        )

    def rate(self) -> float:
        """Returns the smoothed rate since the previous call."""
        now = time.time()
        delta = now - self._partial_time
        report = 0.0
        if delta > 0:
            report = self._smooth(self._count / delta)
            self._update(now, report)
        return report

    def global_rate(self) -> float:
        """Returns the average rate since the tracker was created."""
        delta = time.time() - self._start_time
        count = self._partial_count + self._count
        return count / delta if delta > 0 else 0.0


class CoalescingBuckets:
    """Groups a list of tensors into buckets of about ``bucket_cap_mb`` and runs
    ``func`` once per bucket (on the lone tensor for one-tensor buckets).

    A tensor larger than the cap joins the current bucket (then flushes it)
    when that bucket is under half the cap and the sum stays within twice the
    cap; otherwise a bucket is flushed before it would spill over the cap.

    Args:
      func (callable): ``func(inputs, outputs)`` for a bucket.
      input_list (list): Tensors to process.
      output_list (list, optional): Matching output tensors.
      bucket_cap_mb (int): Bucket size target in MiB. Default: 160

    Example:
      >>> CoalescingBuckets(lambda x, o: x, [torch.ones(2)] * 3, bucket_cap_mb=0)()
      [tensor([1., 1.]), tensor([1., 1.]), tensor([1., 1.])]
    """

    def __init__(
        self,
        func: Callable[[Any, Any], Any],
        input_list: Any,
        output_list: Optional[Any] = None,
        bucket_cap_mb: int = 160,
    ) -> None:
        if not isinstance(input_list, list) or any(
            not isinstance(v, torch.Tensor) for v in input_list
        ):
            raise TypeError(
                f"`input_list` needs to be a list of Tensors, but given {type(input_list)}."
            )
        if output_list is not None:
            if not isinstance(output_list, list) or any(
                not isinstance(v, torch.Tensor) for v in output_list
            ):
                raise TypeError(
                    f"`output_list` needs to be a list of Tensors, but given {type(output_list)}."
                )
            if len(output_list) != len(input_list):
                raise ValueError(
                    "`output_list` length doesn't match `input_list` length: "
                    f"{len(output_list)} vs {len(input_list)}."
                )
        self._func = func
        self._input_list = input_list
        self._output_list = output_list
        self._total = 0
        self._tensor_bucket: list[torch.Tensor] = []
        self._output_bucket: Optional[list[torch.Tensor]] = [] if output_list else None
        self._bucket_cap = bucket_cap_mb * 1024 * 1024
        self._out_tensors: list[Any] = []

    def flush(self) -> None:
        """Runs ``func`` on the current bucket and starts a new one."""
        if len(self._tensor_bucket) == 1:
            out = self._output_bucket[0] if self._output_bucket else None
            self._out_tensors.append(self._func(self._tensor_bucket[0], out))
        elif self._tensor_bucket:
            self._out_tensors.extend(self._func(self._tensor_bucket, self._output_bucket))
        self._total = 0
        self._tensor_bucket = []
        self._output_bucket = [] if self._output_list else None

    def add(self, tensor: torch.Tensor, idx: int) -> None:
        """Adds ``tensor`` (input number ``idx``) to the current bucket."""
        self._total += tensor.numel() * tensor.element_size()
        self._tensor_bucket.append(tensor)
        if self._output_list is not None and self._output_bucket is not None:
            self._output_bucket.append(self._output_list[idx])

    def __call__(self) -> list[Any]:
        for idx, tensor in enumerate(self._input_list):
            size = tensor.numel() * tensor.element_size()
            total = self._total + size
            if (
                size > self._bucket_cap
                and self._total < 0.5 * self._bucket_cap
                and total <= 2 * self._bucket_cap
            ):
                self.add(tensor, idx)
                self.flush()
            else:
                if total > self._bucket_cap:
                    self.flush()
                self.add(tensor, idx)
        self.flush()
        assert len(self._out_tensors) == len(self._input_list)
        return self._out_tensors


@traced
def all_gather_bucketized(
    input_list: list[torch.Tensor],
    dim: int = 0,
    groups: Optional[list[list[int]]] = None,
    output: Optional[list[torch.Tensor]] = None,
    pin_layout: bool = False,
    bucket_cap_mb: int = 160,
) -> list[torch.Tensor]:
    """All-gathers a list of tensors in buckets of about ``bucket_cap_mb`` MiB.

    Args:
      input_list (list): Input tensors.
      dim (int): As in :func:`all_gather`.
      groups (list, optional): As in :func:`all_gather`.
      output (list, optional): As in :func:`all_gather`.
      pin_layout (bool): As in :func:`all_gather`, but ``True`` raises
        ``RuntimeError`` (as in torch_xla).
      bucket_cap_mb (int): Bucket size target in MiB. Default: 160

    Returns:
      One gathered tensor per input.
    """
    if pin_layout:
        raise RuntimeError("For xm.all_gather_bucketized, pin_layout=True is not yet supported.")

    def gather(inputs: Any, outputs: Any = None) -> Any:
        return all_gather(inputs, dim=dim, groups=groups, output=outputs, pin_layout=pin_layout)

    return CoalescingBuckets(gather, input_list, output, bucket_cap_mb=bucket_cap_mb)()


@traced
def reduce_scatter_bucketized(
    reduce_type: str,
    input_list: list[torch.Tensor],
    scale: float,
    scatter_dim: int,
    shard_count: int,
    groups: Optional[list[list[int]]] = None,
    output: Optional[list[torch.Tensor]] = None,
    pin_layout: bool = False,
    bucket_cap_mb: int = 160,
) -> list[torch.Tensor]:
    """Reduce-scatters a list of tensors in buckets of about ``bucket_cap_mb`` MiB.

    Args:
      reduce_type (str): As in :func:`reduce_scatter`.
      input_list (list): Input tensors.
      scale (float): As in :func:`reduce_scatter`.
      scatter_dim (int): As in :func:`reduce_scatter`.
      shard_count (int): As in :func:`reduce_scatter`.
      groups (list, optional): As in :func:`reduce_scatter`.
      output (list, optional): Output tensors.
      pin_layout (bool): As in :func:`reduce_scatter`.
      bucket_cap_mb (int): Bucket size target in MiB. Default: 160

    Returns:
      One shard per input.
    """

    def scatter(inputs: Any, outputs: Any = None) -> Any:
        return reduce_scatter(
            reduce_type, inputs, scale, scatter_dim, shard_count, groups, outputs, pin_layout
        )

    return CoalescingBuckets(scatter, input_list, output, bucket_cap_mb=bucket_cap_mb)()


@traced
def all_reduce_bucketized_gradients(
    gradients: list[torch.Tensor],
    scale: float,
    groups: Optional[list[list[int]]],
    pin_layout: bool,
    bucket_cap_mb: int = 0,
) -> None:
    """Sums gradients in place, one collective call per bucket of about
    ``bucket_cap_mb`` MiB (a bucket closes when the next gradient would spill
    over the cap; a cap of 0 gives one gradient per call), scaling by ``scale``.
    """
    cap = bucket_cap_mb * 1024 * 1024
    total = 0
    bucket: list[torch.Tensor] = []
    for grad in gradients:
        size = grad.numel() * grad.element_size()
        total += size
        if total > cap and bucket:
            all_reduce(REDUCE_SUM, bucket, scale=scale, groups=groups, pin_layout=pin_layout)
            total = size
            bucket = []
        bucket.append(grad)
    if bucket:
        all_reduce(REDUCE_SUM, bucket, scale=scale, groups=groups, pin_layout=pin_layout)


def _fetch_gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        p.grad.data
        for group in optimizer.param_groups
        for p in group["params"]
        if isinstance(p, torch.Tensor) and p.grad is not None
    ]


@traced
def reduce_gradients(
    optimizer: torch.optim.Optimizer,
    groups: Optional[list[list[int]]] = None,
    pin_layout: bool = True,
) -> None:
    """Averages the gradients of ``optimizer``'s parameters over the replicas.

    With ``ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB`` > 0 the gradients are reduced
    in buckets of that size, last layer first; otherwise all of them go in as
    few collective calls as possible (one per dtype for small gradients).

    Args:
      optimizer (torch.optim.Optimizer): Holds the parameters whose ``.grad``
        is reduced.
      groups (list, optional): Replica groups to sum within; the scale is
        ``1 / world_size`` either way, as in torch_xla.
      pin_layout (bool, optional): Accepted for compatibility; no effect.
    """
    count = world_size()  # as torch_xla: the world size, also with groups
    if count <= 1:
        return
    gradients = _fetch_gradients(optimizer)
    cap = int(os.environ.get("ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB", "0"))
    if cap > 0:
        all_reduce_bucketized_gradients(
            list(reversed(gradients)), 1.0 / count, groups, pin_layout, bucket_cap_mb=cap
        )
    elif gradients:
        all_reduce(REDUCE_SUM, gradients, scale=1.0 / count, groups=groups, pin_layout=pin_layout)


@traced
def optimizer_step(
    optimizer: torch.optim.Optimizer,
    barrier: bool = False,
    optimizer_args: dict[str, Any] = {},  # noqa: B006
    groups: Optional[list[list[int]]] = None,
    pin_layout: bool = True,
) -> Any:
    """Averages gradients across replicas, then runs ``optimizer.step()``.

    Args:
      optimizer (torch.optim.Optimizer): The optimizer to step.
      barrier (bool, optional): Run :func:`mark_step` after the step, as
        torch_xla does (eager ringlet has no graph to cut, so this runs the
        closures queued with :func:`add_step_closure`). Default: False
      optimizer_args (dict, optional): Keyword arguments of ``step()``.
      groups (list, optional): Replica groups for the gradient sum (see
        :func:`reduce_gradients`).
      pin_layout (bool, optional): Accepted for compatibility; no effect.

    Returns:
      What ``optimizer.step()`` returned.

    Example:
      >>> loss.backward()
      >>> ringlet.optimizer_step(optimizer)
    """
    reduce_gradients(optimizer, groups=groups, pin_layout=pin_layout)
    result = optimizer.step(**optimizer_args)
    if barrier:
        mark_step()
    return result


@traced
def broadcast_master_param(model: torch.nn.Module) -> None:
    """Copies every parameter and buffer of ``model`` from ordinal 0 to all.

    Example:
      >>> ringlet.broadcast_master_param(model)
    """
    tensors = [t.data for t in list(model.parameters()) + list(model.buffers())]
    collective_broadcast(tensors)
    mark_step()


# ----------------------------------------------------------------------------
# All-to-all, permute and point-to-point messages.


@traced
def all_to_all(
    value: torch.Tensor,
    split_dimension: int,
    concat_dimension: int,
    split_count: int,
    groups: Optional[list[list[int]]] = None,
    pin_layout: bool = True,
) -> torch.Tensor:
    """Performs an all-to-all: splits ``value`` into ``split_count`` blocks
    along ``split_dimension``, sends block ``j`` to the ``j``-th replica of
    the group, and concatenates the blocks received from every replica (in
    replica order) along ``concat_dimension``.

    Args:
      value (torch.Tensor): The input tensor (contiguous, CPU).
      split_dimension (int): The dimension to split; its size must be a
        multiple of ``split_count``. Negative values count from the end.
      concat_dimension (int): The dimension the received blocks are
        concatenated along.
      split_count (int): The number of blocks; must equal the group size.
      groups (list, optional): A list of lists of replica ordinals; the
        all-to-all runs independently inside each group. Example:
        ``[[0, 1], [2, 3]]``. ``None`` means one group of every replica.
      pin_layout (bool, optional): Accepted for compatibility; eager CPU
        tensors have one layout.

    Returns:
      A new tensor whose ``split_dimension`` is ``split_count`` times smaller
      and whose ``concat_dimension`` is ``split_count`` times larger (both
      changes apply when the dimensions coincide, leaving it unchanged).

    Example:
      >>> # 2 ranks; rank r holds [[2r, 2r+1]] (shape 1x2)
      >>> ringlet.all_to_all(x, split_dimension=1, concat_dimension=0, split_count=2)
      >>> # rank 0 gets [[0], [2]], rank 1 gets [[1], [3]]
    """
    value = as_tensor(value, "value")
    comm = core_groups.group_comm(groups)
    n = comm.size
    split_count = check_int(split_count, "split_count")
    if split_count != n:
        raise ValueError(
            f"rank {error_rank()}: all_to_all split_count is {split_count} but the replica group "
            f"has {n} members; they must be equal"
        )
    sd = _norm_dim(split_dimension, value.dim(), "all_to_all split_dimension")
    cd = _norm_dim(concat_dimension, value.dim(), "all_to_all concat_dimension")
    check(value, "value")
    if value.shape[sd] % n:
        raise ValueError(
            f"rank {error_rank()}: all_to_all cannot split dimension {sd} of size "
            f"{value.shape[sd]} into {n} equal blocks"
        )
    if n == 1:
        return value.clone()
    # Blocks become the leading dimension: one copy, then one engine call.
    blocks = value.unflatten(sd, (n, value.shape[sd] // n)).movedim(sd, 0).contiguous()
    received = torch.empty_like(blocks)
    per = blocks[0].numel()
    engine.all_to_all_v(comm, blocks, [per] * n, received, [per] * n)
    return received.movedim(0, cd).flatten(cd, cd + 1)


@traced
def all_to_all_v(
    send: list[torch.Tensor],
    recv: list[torch.Tensor],
    groups: Optional[list[list[int]]] = None,
) -> list[torch.Tensor]:
    """All-to-all with blocks of any size (MPI's ``alltoallv``): ``send[j]``
    goes to the ``j``-th replica of the group and ``recv[i]`` is filled from
    the ``i``-th. A ringlet extension, not in ``xla_model``.

    Args:
      send (list): One tensor per group member, any shapes, one dtype.
      recv (list): One preallocated tensor per group member, same dtype;
        ``recv[i]`` must have as many elements as member ``i`` sends here.
        Members that exchange nothing pass empty tensors.
      groups (list, optional): Replica groups, as in :func:`all_reduce`.

    Returns:
      ``recv``, filled in place.

    Raises:
      CollectiveMismatchError: on every rank when a sender and a receiver
        disagree about a block's size.

    Example:
      >>> # 2 ranks: rank 0 sends 1 element to itself and 2 to rank 1
      >>> ringlet.all_to_all_v([torch.ones(1), torch.ones(2)], [torch.empty(1), torch.empty(3)])
    """
    comm = core_groups.group_comm(groups)
    n = comm.size
    for what, lst in (("send", send), ("recv", recv)):
        if not isinstance(lst, (list, tuple)) or len(lst) != n:
            raise ValueError(
                f"rank {error_rank()}: all_to_all_v needs a list of {n} {what} tensors "
                f"(one per group member), got {lst!r:.80}"
            )
    sends = [as_tensor(t, f"send[{i}]") for i, t in enumerate(send)]
    recvs = [as_tensor(t, f"recv[{i}]", write=True) for i, t in enumerate(recv)]
    dtype = sends[0].dtype
    for i, t in enumerate([*sends, *recvs]):
        what = f"send[{i}]" if i < n else f"recv[{i - n}]"
        check(t, what)
        if t.dtype != dtype:
            raise TypeError(
                f"rank {error_rank()}: all_to_all_v tensors must share one dtype; {what} is "
                f"{t.dtype}, send[0] is {dtype}"
            )
    flat_send = torch.cat([t.reshape(-1) for t in sends])
    flat_recv = torch.empty(sum(t.numel() for t in recvs), dtype=dtype)
    engine.all_to_all_v(comm, flat_send, [t.numel() for t in sends], flat_recv,
                        [t.numel() for t in recvs])
    offset = 0
    for t in recvs:
        t.view(-1).copy_(flat_recv[offset : offset + t.numel()])
        offset += t.numel()
    return recv


@traced
def collective_permute(value: torch.Tensor, pairs: list[list[int]]) -> torch.Tensor:
    """Performs a collective permute: for every ``(source, target)`` pair the
    source replica's ``value`` is sent to the target replica. Every replica
    calls it with the same ``pairs``; a replica that is no pair's target gets
    zeros.

    Args:
      value (torch.Tensor): The input tensor (same shape and dtype on every
        replica).
      pairs (list): A list of ``(source_replica_id, target_replica_id)``
        pairs; each replica is the source of at most one pair and the target
        of at most one pair. Example: ``[[0, 1], [1, 2], [2, 0]]`` sends from
        0 to 1, from 1 to 2 and from 2 to 0.

    Returns:
      A new tensor holding what this replica received.

    Example:
      >>> n = ringlet.world_size()
      >>> ringlet.collective_permute(x, [[i, (i + 1) % n] for i in range(n)])
    """
    value = as_tensor(value, "value")
    check(value, "value")
    world = world_size()
    me = error_rank()
    if not isinstance(pairs, (list, tuple)):
        raise TypeError(f"rank {me}: pairs must be a list of [source, target] pairs")
    sources: dict[int, int] = {}
    targets: dict[int, int] = {}
    for p in pairs:
        if not isinstance(p, (list, tuple)) or len(p) != 2:
            raise ValueError(f"rank {me}: collective_permute pair {p!r} is not [source, target]")
        src, dst = (check_int(x, "a collective_permute replica id") for x in p)
        for x in (src, dst):
            if not 0 <= x < world:
                raise ValueError(
                    f"rank {me}: collective_permute pair {list(p)} names replica {x}, out of "
                    f"range for world size {world}"
                )
        if src in sources:
            raise ValueError(f"rank {me}: replica {src} is the source of two pairs in {pairs}")
        if dst in targets:
            raise ValueError(f"rank {me}: replica {dst} is the target of two pairs in {pairs}")
        sources[src], targets[dst] = dst, src
    out = torch.zeros_like(value, memory_format=torch.contiguous_format)
    if world == 1:
        if sources.get(0) == 0:
            out.copy_(value)
        return out
    k = value.numel()
    send_counts = [0] * world
    recv_counts = [0] * world
    if me in sources:
        send_counts[sources[me]] = k
    if me in targets:
        recv_counts[targets[me]] = k
    engine.all_to_all_v(
        core_groups.world_comm(),
        value if me in sources else value[:0].reshape(0),
        send_counts,
        out if me in targets else out.reshape(-1)[:0],
        recv_counts,
    )
    return out


def _check_peer(peer: Any, what: str) -> int:
    peer = check_int(peer, what)
    world, me = world_size(), error_rank()
    if not 0 <= peer < world:
        raise ValueError(f"rank {me}: {what} {peer} is out of range for world size {world}")
    if peer == me:
        raise ValueError(f"rank {me}: {what} {peer} is this rank; a rank cannot message itself")
    return peer


def _check_tag(tag: Any) -> int:
    tag = check_int(tag, "tag")
    if not 0 <= tag < 2**31:
        raise ValueError(f"rank {error_rank()}: tag must be in [0, 2**31), got {tag}")
    return tag


@traced
def send(value: torch.Tensor, dst: int, tag: int = 0) -> torch.Tensor:
    """Sends ``value`` to rank ``dst``; returns once ``dst`` has received it.

    Messages between two ranks are matched in order: the n-th ``send`` to a
    rank meets that rank's n-th ``recv`` from this one, and the two must agree
    on size, dtype and tag (else both raise ``CollectiveMismatchError``).
    torch_xla's ``send(value, channel_id)`` maps to ``send(value, dst,
    tag=channel_id)``. Each pair of ranks gets its own connection the first
    time it exchanges a message.

    Args:
      value (torch.Tensor): The tensor to send (contiguous, CPU).
      dst (int): The destination rank.
      tag (int, optional): A label both sides must agree on, in
        ``[0, 2**31)``. Default: 0

    Returns:
      ``value`` itself, as torch_xla's ``send`` returns its input.

    Example:
      >>> if ringlet.get_ordinal() == 0:
      ...     ringlet.send(torch.arange(4.0), dst=1)
      ... else:
      ...     ringlet.recv(torch.empty(4), src=0)
    """
    value = as_tensor(value, "value")
    name = check(value, "value")
    dst, tag = _check_peer(dst, "destination rank"), _check_tag(tag)
    comm, peer = core_groups.pair_comm(dst)
    engine.send(comm, value, peer, tag, name)
    return value


@traced
def recv(output: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
    """Receives into ``output`` the tensor rank ``src`` sends with ``tag``.

    Args:
      output (torch.Tensor): A contiguous CPU tensor with the size and dtype of
        the message; filled in place.
      src (int): The source rank.
      tag (int, optional): Must equal the sender's tag. Default: 0

    Returns:
      ``output``.

    Example:
      >>> buf = ringlet.recv(torch.empty(4), src=0)
    """
    output = as_tensor(output, "output", write=True)
    name = check(output, "output")
    src, tag = _check_peer(src, "source rank"), _check_tag(tag)
    comm, peer = core_groups.pair_comm(src)
    engine.recv(comm, output, peer, tag, name)
    return output


# ----------------------------------------------------------------------------
# Step closures, ordinals and devices: torch_xla's eager-meaningful helpers.

_step_closures: list[Callable[[], Any]] = []


def add_step_closure(
    closure: Callable[..., Any], args: tuple[Any, ...] = (), run_async: bool = False
) -> None:
    """Queues ``closure(*args)`` to run at the next :func:`mark_step`, in the
    order queued (torch_xla runs them after the step's graph executes; eager
    tensors are always materialised, so ringlet just defers the call).

    Args:
      closure (callable): The function to call.
      args (tuple): Its positional arguments. Default: ()
      run_async (bool): Accepted for compatibility; closures run in order on
        the calling thread.

    Example:
      >>> ringlet.add_step_closure(print, ("loss", loss.item()))
      >>> ringlet.mark_step()
    """
    _step_closures.append(lambda a=args: closure(*a))


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """Ends a step: runs the closures queued with :func:`add_step_closure`
    before this call, in order (a closure queued by one of them runs at the
    next step, as in torch_xla). Eager execution has no pending graph to cut,
    so nothing else happens.

    Args:
      wait (bool): Accepted for compatibility (collectives are synchronous).
      reset_scope (bool): Accepted for compatibility.

    Example:
      >>> ringlet.mark_step()
    """
    # As torch_xla: the closures queued so far run; those they queue wait for
    # the next step (and if one raises, the rest of this step's are dropped).
    closures = list(_step_closures)
    _step_closures.clear()
    for closure in closures:
        closure()


def optimization_barrier_(tensors: list[torch.Tensor]) -> None:
    """torch_xla's compiler barrier; eager execution never fuses across it,
    so this returns without touching ``tensors``.

    Args:
      tensors (list): The tensors the barrier would apply to.

    Example:
      >>> ringlet.optimization_barrier_([grad])
    """
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"rank {error_rank()}: tensors must be a list of tensors")


def xla_rendezvous(
    payload: bytes = b"", ordinals: Optional[list[int]] = None, tag: Optional[str] = None
) -> list[bytes]:
    """Shares ``payload`` with every replica; torch_xla's global-only form of
    :func:`rendezvous`.

    Args:
      payload (bytes): This replica's bytes.
      ordinals (list, optional): Must be ``None``/empty or name every replica.
      tag (str, optional): A name, for logging only.

    Returns:
      Every replica's payload, in ordinal order.

    Raises:
      ValueError: ``ordinals`` names only some replicas.
      TypeError: ``payload`` is not bytes.

    Example:
      >>> ringlet.xla_rendezvous(b"ready")
    """
    if ordinals and len(ordinals) != world_size():
        raise ValueError("Only global rendezvous is supported")
    if not isinstance(payload, bytes):
        raise TypeError(f"`payload` must be bytes, not {type(payload)}")
    return rendezvous(tag or "xla_rendezvous", payload)


def do_on_ordinals(
    target: Callable[..., Any],
    data: Any = (),
    ordinals: Union[list[int], set[int], tuple[int, ...], int] = (0,),
) -> Optional[Any]:
    """Runs ``target(*data)`` only on the given ordinals, then has every
    replica meet in a rendezvous.

    Args:
      target (callable): The function to run.
      data: Its arguments: a tuple or list is unpacked into them, anything
        else is passed as the only argument. Default: ()
      ordinals (list, set or int): The ordinals that run it. Default: (0,)

    Returns:
      ``target``'s result on the ordinals that ran it, else ``None``.

    Example:
      >>> ringlet.do_on_ordinals(print, ("hello from 0",))
    """
    wanted = {ordinals} if isinstance(ordinals, int) else set(ordinals)
    args = tuple(data) if isinstance(data, (tuple, list)) else (data,)
    result = target(*args) if get_ordinal() in wanted else None
    rendezvous("ringlet.do_on_ordinals")
    return result



def xrt_world_size(defval: int = 1) -> int:
    """The number of replicas: torch_xla's deprecated alias of
    :func:`ringlet.world_size`, kept for ports.

    Args:
      defval (int, optional): Accepted for compatibility. Default: 1

    Returns:
      The world size.

    Example:
      >>> ringlet.xrt_world_size()
      2
    """
    return world_size()

def xla_device(n: Optional[int] = None, devkind: Optional[str] = None) -> torch.device:
    """The device ringlet's collectives work on: the CPU (so ``t.to(xla_device())``
    in ported code keeps tensors where ringlet can reach them).

    Args:
      n (int, optional): Accepted for compatibility.
      devkind (str, optional): Accepted for compatibility.

    Returns:
      ``torch.device("cpu")``.

    Example:
      >>> x = torch.ones(2, device=ringlet.xla_device())
    """
    return torch.device("cpu")


def set_rng_state(seed: int, device: Optional[str] = None) -> None:
    """Seeds torch's default generator (``torch.manual_seed``).

    Args:
      seed (int): The seed.
      device (str, optional): Accepted for compatibility.

    Example:
      >>> ringlet.set_rng_state(1234)
    """
    torch.manual_seed(seed)


def get_rng_state(device: Optional[str] = None) -> int:
    """The seed of torch's default generator (``torch.initial_seed()``).

    Args:
      device (str, optional): Accepted for compatibility.

    Returns:
      The seed, as an int.

    Example:
      >>> ringlet.set_rng_state(7); ringlet.get_rng_state()
      7
    """
    return int(torch.initial_seed())


def xla_device_hw(device: Union[str, torch.device]) -> str:
    """The hardware type of a device, as torch_xla reports it: ``"CPU"`` for
    the CPU (where ringlet's collectives run), else the device type upper-cased.

    Args:
      device (str or torch.device): The device.

    Returns:
      A string such as ``"CPU"`` or ``"CUDA"``.

    Example:
      >>> ringlet.xla_device_hw(ringlet.xla_device())
      'CPU'
    """
    return torch.device(device).type.upper()


@traced
def _all_gather_using_all_reduce(
    value: torch.Tensor,
    dim: int = 0,
    groups: Optional[list[list[int]]] = None,
    pin_layout: bool = True,
) -> torch.Tensor:
    """All-gather built from an all-reduce, as torch_xla's private helper does
    it: each replica zero-pads its tensor to its own slot along ``dim`` and the
    padded tensors are summed. Same result as :func:`all_gather`, more traffic.

    Args:
      value (torch.Tensor): The input tensor.
      dim (int): The gather dimension (negative counts from the end). Default: 0
      groups (list, optional): Replica groups, e.g. ``[[0, 1], [2, 3]]``.
      pin_layout (bool, optional): Accepted for compatibility; no effect.

    Returns:
      A tensor holding every replica's ``value`` along ``dim``, in replica
      order within the group.

    Example:
      >>> ringlet._all_gather_using_all_reduce(torch.tensor([ringlet.get_ordinal()]))
      tensor([0, 1])   # on 2 ranks
    """
    value = as_tensor(value, "value")
    dim = _norm_dim(dim, value.dim(), "_all_gather_using_all_reduce")
    comm = core_groups.group_comm(groups)
    index, count = comm.rank, comm.size
    shape = list(value.shape)
    size = shape[dim]
    shape[dim] = size * count
    padded = torch.zeros(shape, dtype=value.dtype)
    padded.narrow(dim, index * size, size).copy_(value)
    if count == 1:
        return padded
    op = REDUCE_SUM if value.dtype != torch.bool else REDUCE_OR
    all_reduce_coalesced(comm, [padded], op, 1.0)
    return padded


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on an XLA device (never true for the tensors
    ringlet works on, which are CPU tensors).

    Args:
      tensor (torch.Tensor): The tensor.

    Returns:
      ``tensor.device.type == "xla"``.

    Example:
      >>> ringlet.is_xla_tensor(torch.ones(1))
      False
    """
    return tensor.device.type == "xla"


def get_xla_supported_devices(
    devkind: Optional[str] = None, max_devices: Optional[int] = None
) -> Optional[list[str]]:
    """The devices this process drives: one, the CPU (see :func:`xla_device`).

    Args:
      devkind (str, optional): A device kind such as ``"CPU"``; any other kind
        has no devices here, so the result is ``None`` (as in torch_xla).
      max_devices (int, optional): Return at most this many devices.

    Returns:
      ``["cpu"]`` (cut to ``max_devices``), or ``None`` for another ``devkind``.

    Example:
      >>> ringlet.get_xla_supported_devices()
      ['cpu']
    """
    if devkind and devkind.upper() != "CPU":
        return None
    devices = [str(xla_device())]
    return devices[:max_devices] if max_devices else devices


def xla_real_devices(devices: Optional[list[Union[str, torch.device]]] = None) -> list[str]:
    """The hardware names of devices, torch_xla style (``"CPU:0"``).

    Args:
      devices (list, optional): Devices such as ``["cpu"]``. Default: the
        devices of :func:`get_xla_supported_devices`.

    Returns:
      One ``"<KIND>:<index>"`` string per device.

    Example:
      >>> ringlet.xla_real_devices()
      ['CPU:0']
    """
    if not devices:
        devices = list(get_xla_supported_devices() or [])
    out = []
    for d in devices:
        dev = torch.device(d)
        out.append(f"{xla_device_hw(dev)}:{dev.index or 0}")
    return out


def xla_replication_devices(
    local_devices: Optional[list[Union[str, torch.device]]] = None,
) -> list[str]:
    """The hardware names of every device a collective replicates over (one
    per rank, sorted by ordinal), after checking that ``local_devices`` are
    this process's devices, all of one kind, as torch_xla does.

    Args:
      local_devices (list, optional): This process's devices, such as
        ``["cpu"]``. Default: :func:`get_xla_supported_devices`.

    Returns:
      ``["CPU:0", "CPU:1", ...]``: one per rank of the world.

    Raises:
      RuntimeError: The devices are of several kinds, or not as many as this
        process drives.

    Example:
      >>> ringlet.xla_replication_devices(["cpu"])   # world size 2
      ['CPU:0', 'CPU:1']
    """
    real = xla_real_devices(local_devices)
    kinds = {d.split(":")[0] for d in real}
    if len(kinds) != 1:
        raise RuntimeError(
            f"Cannot replicate across different device types: devices={local_devices}/{real}"
        )
    kind = kinds.pop()
    mine = list(get_xla_supported_devices() or [])
    count = len(local_devices) if local_devices is not None else len(mine)
    if count != len(mine):
        raise RuntimeError(
            f"Cannot replicate if number of devices ({count}) is different from {len(mine)}"
        )
    return [f"{kind}:{r}" for r in range(world_size())]


def set_replication(
    device: Union[str, torch.device], devices: Optional[list[Union[str, torch.device]]]
) -> None:
    """Sets the devices a process replicates over, as torch_xla's
    ``set_replication`` (which a multi-process launcher calls once per
    process): checks them with :func:`xla_replication_devices`; ringlet's
    replication is the world, so there is nothing else to set.

    Args:
      device (str or torch.device): This process's device; must be in
        ``devices`` when that is not empty.
      devices (list, optional): The process's devices (empty or None: no
        replication).

    Raises:
      RuntimeError: As :func:`xla_replication_devices`.
      ValueError: ``device`` is not in ``devices``.

    Example:
      >>> ringlet.set_replication("cpu", ["cpu"])
    """
    names = [str(d) for d in devices or []]
    if names:
        xla_replication_devices(names)
        names.index(str(device))


def unlazy(tensors: list[torch.Tensor]) -> None:
    """Blocks until ``tensors`` are materialised: eager tensors always are, so
    this returns at once.

    Args:
      tensors (list): The tensors.

    Example:
      >>> ringlet.unlazy([torch.ones(2)])
    """
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"unlazy takes a list of tensors, got {type(tensors).__name__}")


@contextlib.contextmanager
def fork_rng(device: Optional[str] = None, enabled: bool = True) -> Iterator[None]:
    """Forks torch's default random generator: when the block exits, the
    generator is back in the exact state it had on entry.

    Args:
      device (str, optional): Accepted for compatibility.
      enabled (bool): ``False`` makes this a no-op (handy to switch forking
        off without re-indenting). Default: True

    Example:
      >>> with ringlet.fork_rng():
      ...     noise = torch.rand(3)   # does not advance the outer stream
    """
    if not enabled:
        yield
        return
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


class MemoryInfo(TypedDict):
    """Memory usage of a device, in bytes."""

    bytes_used: int
    bytes_limit: int


def get_memory_info(device: Optional[torch.device] = None) -> MemoryInfo:
    """Memory usage of the device ringlet works on: the host's memory.

    Args:
      device (torch.device, optional): Accepted for compatibility (ringlet's
        device is the CPU).

    Returns:
      ``{"bytes_used": ..., "bytes_limit": ...}``: memory in use (total minus
      available) and total memory, from ``/proc/meminfo``.

    Example:
      >>> ringlet.get_memory_info()
      {'bytes_used': 3925868544, 'bytes_limit': 25769803776}
    """
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    total = fields.get("MemTotal")
    if total is None:
        pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        total = int(pages) * int(os.sysconf("SC_PAGE_SIZE")) if pages else 0
    available = fields.get("MemAvailable", fields.get("MemFree", total))
    return {"bytes_used": total - available, "bytes_limit": total}


def _rewrite(
    obj: Any, select: Callable[[Any], bool], fn: Callable[[Any], Any],
    memo: Optional[dict[int, Any]] = None,
) -> Any:
    """``obj`` with every leaf for which ``select`` holds replaced by ``fn(leaf)``,
    through lists, tuples (named ones too), dicts (keys and values) and sets.
    As torch_xla's ``for_each_instance_rewrite``, an object met twice (by
    identity) is rewritten once: a tensor listed twice maps to one result."""
    memo = {} if memo is None else memo
    key = id(obj)
    if key in memo:
        return memo[key]
    if select(obj):
        result = fn(obj)
    elif isinstance(obj, dict):
        result = type(obj)(
            (_rewrite(k, select, fn, memo), _rewrite(v, select, fn, memo)) for k, v in obj.items()
        )
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        result = type(obj)(*(_rewrite(v, select, fn, memo) for v in obj))
    elif isinstance(obj, (list, tuple, set)):
        result = type(obj)(_rewrite(v, select, fn, memo) for v in obj)
    else:
        return obj
    memo[key] = result
    return result


def _leaves(obj: Any, select: Callable[[Any], bool]) -> list[Any]:
    """The leaves for which ``select`` holds, each object once (by identity),
    in the order torch_xla's ``for_each_instance`` visits them (dict keys too)."""
    seen: set[int] = set()
    found: list[Any] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if select(item):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(reversed([x for kv in item.items() for x in kv]))
        elif isinstance(item, (list, tuple, set)):
            stack.extend(reversed(list(item)))
    return found


class ToXlaTensorArena:
    """Converts every selected tensor inside a nested structure in one batch,
    as torch_xla does before moving data to a device.

    Args:
      convert_fn (callable): Takes the list of selected tensors, returns the
        list of their replacements (same length, same order).
      select_fn (callable): Which leaves to convert.

    Example:
      >>> arena = ringlet.ToXlaTensorArena(lambda ts: [t * 2 for t in ts],
      ...                                  lambda x: isinstance(x, torch.Tensor))
      >>> arena.transform({"a": torch.ones(1), "b": [torch.ones(1)]})
      {'a': tensor([2.]), 'b': [tensor([2.])]}
    """

    def __init__(
        self,
        convert_fn: Callable[[list[torch.Tensor]], list[torch.Tensor]],
        select_fn: Callable[[Any], bool],
    ) -> None:
        self._convert_fn = convert_fn
        self._select_fn = select_fn

    def transform(self, inputs: Any) -> Any:
        """Returns ``inputs`` with every selected tensor replaced by its
        converted counterpart."""
        tensors = _leaves(inputs, self._select_fn)
        converted = list(self._convert_fn(tensors)) if tensors else []
        if len(converted) != len(tensors):
            raise ValueError(
                f"convert_fn returned {len(converted)} tensors for {len(tensors)} inputs"
            )
        by_id = {id(t): c for t, c in zip(tensors, converted)}
        return _rewrite(inputs, self._select_fn, lambda t: by_id[id(t)])


def send_cpu_data_to_device(
    datas: Any, device: Union[str, torch.device], input_sharding: Any = None
) -> Any:
    """Moves every CPU tensor inside a nested structure to ``device``.

    Args:
      datas: A tensor, or any nesting of lists, tuples, dicts and sets holding
        tensors. A lone tensor is wrapped in a list, as in torch_xla.
      device (str or torch.device): The destination device.
      input_sharding (ShardingSpec, optional): When given, each moved tensor
        is also marked sharded with it (``input_sharding.apply``).

    Returns:
      The same structure with the tensors moved.

    Example:
      >>> ringlet.send_cpu_data_to_device({"x": torch.ones(2)}, ringlet.xla_device())
      {'x': tensor([1., 1.])}
    """

    def convert(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        moved = [t.to(device) for t in tensors]
        if input_sharding is not None:
            moved = [input_sharding.apply(t) for t in moved]
        return moved

    if type(datas) is torch.Tensor:
        datas = [datas]
    select = lambda v: type(v) is torch.Tensor and v.device.type == "cpu"  # noqa: E731
    return ToXlaTensorArena(convert, select).transform(datas)


def check_view_sharing(obj: Any) -> None:
    """Raises if two different tensors inside ``obj`` share storage (views of
    one another), which a checkpoint would silently duplicate or break.

    Args:
      obj: Any nesting of lists, tuples, dicts (keys too) and sets holding
        tensors. As in torch_xla, only plain ``torch.Tensor`` objects are
        looked at (``nn.Parameter`` and other subclasses are skipped).

    Raises:
      RuntimeError: naming the two tensors (id, dtype and shape).

    Example:
      >>> w = torch.ones(4)
      >>> ringlet.check_view_sharing({"w": w, "v": w[:2]})
      Traceback (most recent call last):
      RuntimeError: Tensor ID ... (torch.float32[2]) is sharing a view with tensor ID ...
    """
    seen: set[int] = set()
    owners: dict[int, torch.Tensor] = {}

    def info(t: torch.Tensor) -> str:
        return f"{t.dtype}{list(t.size())}"

    # As torch_xla: plain tensors only (type(x) is torch.Tensor: parameters are
    # not looked at), dict keys included.
    for t in _leaves(obj, lambda x: type(x) is torch.Tensor):
        if id(t) in seen:
            continue
        seen.add(id(t))
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        key = storage_ptr(t)
        other = owners.get(key)
        if other is not None:
            raise RuntimeError(
                f"Tensor ID {id(t)} ({info(t)}) is sharing a view with tensor ID "
                f"{id(other)} ({info(other)})"
            )
        owners[key] = t

