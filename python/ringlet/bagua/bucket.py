"""Bagua's ``bagua.torch_api.bucket``: a bucket of ringlet tensors and the
operations run on it once all of them are marked ready.

A :class:`BaguaBucket` groups tensors of one model (one dtype and device),
optionally flattens them into one buffer (padded to a multiple of
``alignment`` elements by a padding tensor that counts as ready in every
round), and keeps an ordered list of operations: ``append_*_op`` adds one,
:meth:`BaguaBucket.clear_ops` empties it. Once the model's buckets are
registered in order (:func:`register_ordered_buckets`, done by
``with_bagua``), the model's worker thread runs each bucket's operations, in
order, as soon as all of its tensors are ready, buckets in order.

The operations run in ringlet's engine (see ``rust/ringlet-core/src/algorithms``):
exact or MinMaxUInt8-compressed all-reduce, gossip averaging into a peer
weight, the low-precision ring exchange and asynchronous averaging, on
communicators of their own (one level, or Bagua's two: this host's ranks,
and one rank per host). State they keep (peer weights, replicas) must be
CPU tensors.

Example:
  >>> bucket = BaguaBucket(tensors, name="0", flatten=True, alignment=world)
  >>> bucket.append_centralized_synchronous_op(compression="MinMaxUInt8")
  >>> register_ordered_buckets(module, [bucket])
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import _core
from ..core import engine, groups
from ..core.engine import DTYPE_NAMES
from ..parallel.tensor import (
    TensorModule,
    effective_tensor,
    ensure_ringlet_tensor,
    get_module,
    is_ringlet_tensor,
    set_storage,
)
from . import process_group
from .process_group import BaguaProcessGroup

__all__ = ["BaguaBucket", "register_ordered_buckets"]


def check_contiguous(tensors: list[torch.Tensor]) -> bool:
    """Returns whether ``tensors`` lie back to back in memory, in order."""
    end = None
    for t in tensors:
        start, size = engine.span(t)
        if end is not None and start != end:
            return False
        end = start + size
    return True


def get_flattened_tensor(tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """Returns a new 1-D tensor holding ``tensors``' values back to back."""
    if not tensors:
        return None
    flat = torch.zeros(sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                       device=tensors[0].device)
    at = 0
    with torch.no_grad():
        for t in tensors:
            flat[at:at + t.numel()].copy_(t.reshape(-1))
            at += t.numel()
    return flat


def _default_group() -> BaguaProcessGroup:
    """The default process group; made over every rank on first use when
    ringlet was initialised without Bagua's ``init_process_group``."""
    if not process_group.is_initialized():
        groups.require_state()
        with process_group._lock:
            if process_group._default_pg is None:
                process_group._default_pg = process_group.new_group()
    return process_group._get_default_group()


def _state_tensor(t: Any, what: str) -> torch.Tensor:
    """The CPU tensor behind an algorithm state argument (a ringlet tensor's
    effective tensor, or a plain tensor)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    eff = effective_tensor(t) if is_ringlet_tensor(t) else t
    if eff is None or not eff.is_cpu or not eff.is_contiguous():
        raise ValueError(
            f"{what} must be a contiguous CPU tensor: ringlet keeps algorithm state in host "
            f"memory (got one on {None if eff is None else eff.device})"
        )
    if eff.dtype not in DTYPE_NAMES:
        raise TypeError(f"{what} has unsupported dtype {eff.dtype}")
    return eff


class DecentralizedOp:
    """Handle of a bucket's decentralized operation (what
    :meth:`BaguaBucket.append_decentralized_synchronous_op` returns)."""

    def __init__(self, core: Any, peer_weight: torch.Tensor) -> None:
        self._core = core
        self.peer_weight = peer_weight

    @property
    def step(self) -> int:
        """Communication steps run so far."""
        return int(self._core.step)

    def copy_back_peer_weight(self, bucket: BaguaBucket) -> None:
        """Copies the peer weight (the result of the last step) into the
        bucket's tensors. Collective over the host in hierarchical mode (the
        host leader's result reaches its other ranks).

        Args:
          bucket (BaguaBucket): The bucket the operation belongs to.
        """
        self._core.share_peer_weight()
        bucket._write(self.peer_weight)


class AsyncModelAverageOp:
    """Handle of a bucket's asynchronous averaging (what
    :meth:`BaguaBucket.append_asynchronous_model_average_op` returns): a
    thread of ringlet's engine that averages the bucket with every rank
    every interval once :meth:`start`-ed, and a lock the training loop holds
    while it uses the weights."""

    def __init__(self, core: Any) -> None:
        self._core = core

    def start(self, sync_interval_ms: float) -> None:
        """Starts averaging every ``sync_interval_ms`` milliseconds."""
        self._core.start(float(sync_interval_ms))

    def lock_weight(self) -> None:
        """Takes the weight lock; raises the thread's error if it failed."""
        self._core.lock_weight()

    def unlock_weight(self) -> None:
        """Releases the weight lock."""
        self._core.unlock_weight()

    def abort(self) -> None:
        """Stops once every rank asked to (collective)."""
        self._core.abort()

    def reset(self) -> None:
        """Clears the abort flag."""
        self._core.reset()

    def get_status(self) -> bool:
        """Returns whether the thread is averaging."""
        return bool(self._core.status() == "running")

    @property
    def rounds(self) -> int:
        """Averaging rounds completed."""
        return int(self._core.rounds)


class BaguaBucket:
    """A bucket of ringlet tensors of one model and its operations (Bagua's
    ``BaguaBucket``).

    Args:
      tensors (list[torch.Tensor]): Ringlet tensors of one module (one
        dtype and device).
      name (str): The bucket's name, unique in its model.
      flatten (bool): Make the tensors' effective tensors views of one
        buffer (operations then run on it in place).
      alignment (int): Pad the bucket with a zero tensor to a multiple of
        this many elements. Default: 1.

    Example:
      >>> b = BaguaBucket(model_tensors, name="0", flatten=True)
      >>> b.append_centralized_synchronous_op(average=True)
    """

    def __init__(self, tensors: list[torch.Tensor], name: str, flatten: bool,
                 alignment: int = 1) -> None:
        if not tensors:
            raise ValueError(f"bucket {name!r} needs at least one tensor")
        self.tensors = list(tensors)
        self.bagua_module_name = tensors[0]._ringlet_module_name
        for t in self.tensors:
            if not is_ringlet_tensor(t) or t._ringlet_module_name != self.bagua_module_name:
                raise ValueError("every tensor in the same bucket should have the same model name")
        self.ringlet_module_name = self.bagua_module_name
        self._module: TensorModule = get_module(self.bagua_module_name)
        self._bagua_backend = self._module
        self.name = name
        self.padding_tensor: Optional[torch.Tensor] = None
        if alignment > 1:
            total = sum(effective_tensor(t).numel() for t in self.tensors)
            pad = (alignment - total % alignment) % alignment
            if pad:
                first = effective_tensor(self.tensors[0])
                base = f"bagua_padding_tensor_bucket_{name}"
                pname, k = base, 0
                while pname in self._module._proxies:
                    k += 1
                    pname = f"{base}_{k}"
                self.padding_tensor = ensure_ringlet_tensor(
                    torch.zeros(pad, dtype=first.dtype, device=first.device), pname,
                    self.bagua_module_name,
                )
                self._module._core.set_always_ready(pname)
        self._all_tensors = self.tensors + ([self.padding_tensor] if self.padding_tensor
                                            is not None else [])
        self.backend_tensor: Optional[torch.Tensor] = None
        self._offsets: Optional[dict[int, int]] = None
        self.flatten = flatten
        if flatten:
            self._flatten_()
        self._ops: list[Any] = []
        self.backend_bucket = self
        for t in self._all_tensors:
            t._bagua_bucket = self

    # -- memory ---------------------------------------------------------------

    def flattened_tensor(self) -> torch.Tensor:
        """Returns a new 1-D tensor with the effective tensors' values (the
        padding included), back to back."""
        flat = get_flattened_tensor([effective_tensor(t) for t in self._all_tensors])
        assert flat is not None
        return flat

    def _flatten_(self) -> None:
        """Makes the effective tensors views of one buffer, in place."""
        effs = [effective_tensor(t) for t in self._all_tensors]
        self._offsets, at = {}, 0
        for t, e in zip(self._all_tensors, effs):
            self._offsets[id(t)] = at
            at += e.numel()
        if self.check_flatten():
            self.backend_tensor = torch.empty(0, dtype=effs[0].dtype, device=effs[0].device)
            self.backend_tensor.set_(effs[0].untyped_storage(), effs[0].storage_offset(),
                                     (sum(e.numel() for e in effs),))
            return
        flat = self.flattened_tensor()
        offset = 0
        for t in self._all_tensors:
            n = effective_tensor(t).numel()
            set_storage(t, flat.untyped_storage(), offset)
            offset += n
        self.backend_tensor = flat
        if not self.check_flatten():
            raise RuntimeError(f"bucket {self.name!r}: flattening left the tensors apart")

    def check_flatten(self) -> bool:
        """Returns whether the effective tensors lie back to back in memory."""
        return check_contiguous([effective_tensor(t) for t in self._all_tensors])

    def _rebind(self, t: torch.Tensor) -> None:
        """Makes ``t``'s effective tensor its view of the flattened bucket
        again (copying the values in) when it was replaced, e.g. a gradient
        that ``zero_grad()`` set to None and backward made anew: the bucket
        then runs in place instead of through a staging copy each step (what
        torch DDP's ``gradient_as_bucket_view`` does)."""
        flat = self.backend_tensor
        if flat is None or t._ringlet_setter is None:
            return
        eff = effective_tensor(t)
        if eff is None or eff.device != flat.device or eff.dtype != flat.dtype:
            return
        at = (self._offsets or {}).get(id(t))
        if at is None:
            return
        view = flat[at:at + eff.numel()]
        if engine.ptr(eff) == engine.ptr(view):
            return
        with torch.no_grad():
            view.copy_(eff.reshape(-1))
        t.ringlet_setter_closure(view.view_as(eff))

    def _write(self, values: torch.Tensor) -> None:
        """Copies a flat tensor of the bucket's size into its tensors."""
        flat = values.reshape(-1)
        at = 0
        with torch.no_grad():
            for t in self._all_tensors:
                eff = effective_tensor(t)
                eff.view(-1).copy_(flat[at:at + eff.numel()])
                at += eff.numel()

    def bytes(self) -> int:
        """Returns the bucket's size in bytes (its tensors, not the padding)."""
        effs = [effective_tensor(t) for t in self.tensors]
        return sum(e.numel() * e.element_size() for e in effs)

    # -- operations -------------------------------------------------------------

    def _comms(self, group: Optional[BaguaProcessGroup], hierarchical: bool) -> Any:
        """The communicators of this model's operations on ``group`` (made
        once per model, group and level; collective over the group)."""
        group = _default_group() if group is None else group
        cache = self._module.__dict__.setdefault("_algorithm_comms", {})
        key = (id(group), bool(hierarchical))
        comms = cache.get(key)
        if comms is None:
            comms = cache[key] = group._algorithm_comms(group._next_tag(), hierarchical)
        return comms

    def _append(self, op: Any) -> None:
        self._ops.append(op)
        _refresh(self._module)

    def append_python_op(self, python_function: Callable[[str], None],
                         group: Optional[BaguaProcessGroup] = None) -> BaguaBucket:
        """Appends a Python function, called as ``python_function(bucket_name)``
        on the worker thread.

        Args:
          python_function (Callable[[str], None]): The operation.
          group (BaguaProcessGroup, optional): Unused (kept for Bagua).

        Returns:
          BaguaBucket: ``self``.
        """
        name = self.name

        def run(_index: int, _names: list[str]) -> None:
            python_function(name)

        self._append(run)
        return self

    def append_centralized_synchronous_op(
        self,
        hierarchical: bool = False,
        average: bool = True,
        scattergather: bool = False,
        compression: Optional[str] = None,
        group: Optional[BaguaProcessGroup] = None,
        error_feedback: bool = False,
    ) -> Any:
        """Appends a sum (or mean) of the bucket over the group.

        Args:
          hierarchical (bool): Sum exactly within each host first and
            exchange between hosts only (compressed, with ``compression``).
            Default: False.
          average (bool): Divide by the group's size. Default: True.
          scattergather (bool): Bagua's reduce-scatter + all-gather; ringlet's
            all-reduce is one already, so it changes nothing. Default: False.
          compression (str, optional): ``"MinMaxUInt8"``: 8-bit compression
            (ByteGrad). Default: None (exact).
          group (BaguaProcessGroup, optional): Default: the default group.
          error_feedback (bool): ringlet's addition: carry each
            quantization's residual into the next call. Default: False.

        Returns:
          The operation (its ``residuals(bucket_index)`` shows the error
          feedback state).
        """
        op = _core.CentralizedOp(self._comms(group, hierarchical), bool(average), compression,
                                 bool(error_feedback))
        self._append(op)
        return op

    def append_decentralized_synchronous_op(
        self,
        peer_weight: torch.Tensor,
        hierarchical: bool = True,
        peer_selection_mode: str = "all",
        group: Optional[BaguaProcessGroup] = None,
    ) -> DecentralizedOp:
        """Appends gossip averaging of the bucket into ``peer_weight``
        (``"all"``: with every rank; ``"shift_one"``: with one peer, a
        different one each step); the bucket is only read, copy the result
        back with ``op.copy_back_peer_weight(bucket)``.

        Args:
          peer_weight (torch.Tensor): A CPU tensor of the bucket's size
            (``bucket.flattened_tensor()``).
          hierarchical (bool): Average within hosts exactly, exchange between
            hosts' leaders. Default: True.
          peer_selection_mode (str): ``"all"`` or ``"shift_one"``. Default: "all".
          group (BaguaProcessGroup, optional): Default: the default group.

        Returns:
          DecentralizedOp: The operation.
        """
        peer = _state_tensor(peer_weight, "peer_weight")
        core = _core.DecentralizedOp(self._comms(group, hierarchical), str(peer_selection_mode),
                                     *engine.span(peer), DTYPE_NAMES[peer.dtype], peer)
        self._append(core)
        return DecentralizedOp(core, peer)

    def append_low_precision_decentralized_synchronous_op(
        self,
        weight: torch.Tensor,
        left_peer_weight: torch.Tensor,
        right_peer_weight: torch.Tensor,
        hierarchical: bool = True,
        compression: str = "MinMaxUInt8",
        group: Optional[BaguaProcessGroup] = None,
    ) -> Any:
        """Appends the low-precision ring exchange: compressed differences to
        both neighbours, replicas of their weights kept in
        ``left_peer_weight`` / ``right_peer_weight``.

        Args:
          weight (torch.Tensor): This rank's replica (a CPU copy of the bucket).
          left_peer_weight (torch.Tensor): The left neighbour's replica.
          right_peer_weight (torch.Tensor): The right neighbour's replica.
          hierarchical (bool): Average within hosts exactly, ring between
            hosts' leaders. Default: True.
          compression (str): ``"MinMaxUInt8"``, the only one. Default.
          group (BaguaProcessGroup, optional): Default: the default group.

        Returns:
          The operation.
        """
        if compression != "MinMaxUInt8":
            raise ValueError(f"unknown compression {compression!r}: ringlet implements "
                             "\"MinMaxUInt8\"")
        ts = [_state_tensor(t, what) for t, what in ((weight, "weight"),
              (left_peer_weight, "left_peer_weight"), (right_peer_weight, "right_peer_weight"))]
        if len({(t.dtype, t.numel()) for t in ts}) != 1:
            raise ValueError("weight, left_peer_weight and right_peer_weight must have one "
                             "dtype and size")
        core = _core.LowPrecisionOp(self._comms(group, hierarchical),
                                    *[(*engine.span(t), t) for t in ts],
                                    DTYPE_NAMES[ts[0].dtype])
        self._append(core)
        return core

    def append_asynchronous_model_average_op(
        self, peer_selection_mode: str, group: Optional[BaguaProcessGroup] = None
    ) -> AsyncModelAverageOp:
        """Appends asynchronous model averaging of the (flattened, CPU)
        bucket with every rank. Each time the bucket is ready the worker runs
        one round (after agreeing whether to stop); ``op.start(interval_ms)``
        runs rounds on a thread of their own instead.

        Args:
          peer_selection_mode (str): ``"all"``, the only one.
          group (BaguaProcessGroup, optional): Default: the default group.

        Returns:
          AsyncModelAverageOp: The operation (``lock_weight``,
          ``unlock_weight``, ``abort``, ``reset``, ``get_status``).
        """
        if peer_selection_mode != "all":
            raise ValueError(f"asynchronous model averaging supports peer_selection_mode "
                             f"\"all\" only, got {peer_selection_mode!r}")
        if not self.flatten or self.backend_tensor is None:
            raise ValueError("asynchronous model averaging needs a flattened bucket "
                             "(do_flatten=True)")
        flat = _state_tensor(self.backend_tensor, "the bucket")
        group = _default_group() if group is None else group
        comm = group._dedicated(group._next_tag())
        core = _core.AsyncAverager(comm, *engine.span(flat),
                                   DTYPE_NAMES[flat.dtype], flat)
        self._append(core)
        return AsyncModelAverageOp(core)

    def clear_ops(self) -> BaguaBucket:
        """Removes every operation of the bucket.

        Returns:
          BaguaBucket: ``self``.
        """
        self._ops = []
        _refresh(self._module)
        return self


def register_ordered_buckets(module: TensorModule, buckets: list[BaguaBucket]) -> None:
    """Makes ``buckets`` the module's buckets, in communication order, with
    their operations (Bagua's ``register_ordered_buckets``).

    Args:
      module (TensorModule): The model's tensor module.
      buckets (list[BaguaBucket]): Its buckets.
    """
    module.register_ordered_buckets(list(buckets))


def _refresh(module: TensorModule) -> None:
    """Hands the registered buckets' operation lists to the worker."""
    buckets = module.__dict__.get("_bagua_buckets")
    if buckets is None:
        return
    module._core.set_bucket_ops([list(b._ops) for b in buckets])

