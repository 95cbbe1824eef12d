"""What DiLoCo and LocalSGD share: their argument checks, the flat buckets
of a module's parameters, and an outer average that survives a lost
replica."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from types import TracebackType
from typing import Any, Optional

import torch
from torch import nn

from ..core import engine
from ._flat import FlatBucket
from ._replicas import Replicas, lost_replica

logger = logging.getLogger("ringlet.algorithms")

QUANTIZATIONS = (None, "int8", "int4")


class ArgumentError(ValueError, AssertionError):
    """An argument torchft refuses with ``assert`` (caught as either)."""


def unique_params(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters, each once (tied weights counted once)."""
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def covered(optimizer: torch.optim.Optimizer) -> set[int]:
    """The ids of the parameters an optimizer steps."""
    return {id(p) for g in optimizer.param_groups for p in g["params"]}


def buckets_of(params: list[torch.Tensor], backup_device: Any, what: str) -> list[FlatBucket]:
    """One flat bucket per dtype, in the order the dtypes first appear."""
    by: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by.setdefault(p.dtype, []).append(p)
    return [FlatBucket(ps, backup_device, what) for ps in by.values()]


class HookedAlgorithm:
    """What DiLoCo and LocalSGD share as context managers over an inner
    optimizer: the hooks' removal on exit, the replicas' state, ``close``."""

    _hooks: list[Any]
    _outer: OuterAverage

    def __exit__(self, exc_type: Optional[type[BaseException]],
                 exc_value: Optional[BaseException], traceback: Optional[TracebackType]) -> bool:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return False

    @property
    def lost_replicas(self) -> list[int]:
        """The ranks lost so far (the survivors went on without them)."""
        return list(self._outer.lost)

    @property
    def replicas(self) -> list[int]:
        """The global ranks of the replicas now averaging."""
        return list(self._outer.replicas.members)

    def close(self) -> None:
        """Waits for any average in flight and closes the communicators."""
        self._outer.close()


class OuterAverage:
    """The replicas, and the averages of flat buckets over them that finish
    among the survivors when a replica is lost."""

    def __init__(self, group: Any, what: str, hierarchical: bool,
                 quantization: Optional[str], error_feedback: bool,
                 buckets: Iterable[FlatBucket]) -> None:
        self.what = what
        self.quantization = quantization
        self.error_feedback = error_feedback
        self.replicas = Replicas(group, what, hierarchical)
        self.buckets = list(buckets)
        self.lost: list[int] = []
        self._flag = torch.zeros(1, dtype=torch.int32)
        for b in self.buckets:
            b.connect(self.replicas.comms, quantization, error_feedback)

    def broadcast(self, root: int = 0, avg: bool = False) -> None:
        """Every bucket's global copy (and, with ``avg``, its average) from
        replica ``root`` (an index among the replicas)."""
        if self.replicas.size == 1:
            return
        for b in self.buckets:
            engine.broadcast(self.replicas.flat, b.glob, root)
            if avg:
                engine.broadcast(self.replicas.flat, b.avg, root)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        """``obj`` of replica ``root`` (an index), on every replica (pickled
        by ``torch.save``, sent by the engine)."""
        import io

        flat = self.replicas.flat
        if self.replicas.index == root:
            buf = io.BytesIO()
            torch.save(obj, buf)
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        engine.broadcast(flat, size, root)
        if self.replicas.index != root:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        engine.broadcast(flat, data, root)
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)

    def start(self, buckets: list[FlatBucket]) -> None:
        for b in buckets:
            b.sync.start()

    def finish(self, buckets: list[FlatBucket]) -> None:
        """Waits for the averages of ``buckets``; if a replica is lost, the
        survivors agree on who is left, connect again and average the same
        pseudo-gradients among themselves."""
        while True:
            try:
                for b in buckets:
                    b.sync.wait()
                # Nobody keeps a result another survivor had to redo: a
                # one-element all-reduce every replica reaches only after
                # its averages succeeded (a lost replica fails it for all).
                if self.replicas.size > 1:
                    engine.all_reduce(self.replicas.flat, self._flag)
                return
            except Exception as e:
                if not lost_replica(e):
                    raise
                for b in buckets:
                    try:
                        b.sync.wait()
                    except Exception:
                        pass
                gone = self.replicas.survivors(e)
                self.lost.extend(gone)
                logger.warning("rank %d: %s: replica(s) %s lost (%s); the sync goes on among "
                               "ranks %s", self.replicas.me, self.what, gone, e,
                               self.replicas.members)
                for b in self.buckets:
                    b.connect(self.replicas.comms, self.quantization, self.error_feedback)
                self.start(buckets)

    def close(self) -> None:
        for b in self.buckets:
            b.close()
        self.replicas.close()
