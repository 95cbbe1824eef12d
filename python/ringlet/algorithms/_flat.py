"""Flat buckets of an outer algorithm: a fragment's parameters of one dtype,
their flat global copy, pseudo-gradient and average (engine memory the Rust
core reads and writes through :class:`ringlet._core.OuterSync`)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..core import engine

_CODECS = {None: None, "int8": "MinMaxUInt8", "int4": "MinMaxUInt4"}


class FlatBucket:
    """The parameters of one dtype of a fragment (CPU, contiguous), with the
    flat buffers DiLoCo keeps for them."""

    def __init__(self, params: list[torch.Tensor], backup_device: Optional[torch.device],
                 what: str) -> None:
        self.params = params
        p0 = params[0]
        self.dtype = p0.dtype
        for p in params:
            if p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError(f"{what}: ringlet averages contiguous CPU parameters; got one "
                                 f"of shape {tuple(p.shape)} on {p.device}")
        if self.dtype not in engine.DTYPE_NAMES or not self.dtype.is_floating_point:
            raise TypeError(f"{what}: parameters of {self.dtype} cannot be averaged (float32, "
                            "float64, float16 and bfloat16 can)")
        self.name = engine.DTYPE_NAMES[self.dtype]
        self.numel = sum(p.numel() for p in params)
        self.nbytes = self.numel * p0.element_size()
        device = torch.device(backup_device) if backup_device is not None else None
        if device is not None and device.type != "cpu":
            raise ValueError(f"{what}: backup_device {device}: ringlet keeps the global copy "
                             "in host memory (backup_device=None or 'cpu')")
        self.glob = torch.empty(self.numel, dtype=self.dtype)
        self.pseudo = torch.zeros(self.numel, dtype=self.dtype)
        self.avg = torch.zeros(self.numel, dtype=self.dtype)
        self.local: Optional[torch.Tensor] = None
        self.sync: Any = None
        self.offsets: list[int] = []
        at = 0
        for p in params:
            self.offsets.append(at)
            at += p.numel()

    def connect(self, comms: Any, quantization: Optional[str], error_feedback: bool) -> None:
        """(Re)creates the engine's average over ``comms``."""
        self.sync = engine.outer_sync(comms, self.pseudo, self.avg, _CODECS[quantization],
                                      error_feedback)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The piece of ``flat`` that parameter ``i`` maps to, shaped like it."""
        p = self.params[i]
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    def save(self) -> None:
        """The parameters into the global copy."""
        engine.gather(self.params, self.glob)

    def restore(self) -> None:
        """The global copy into the parameters."""
        engine.scatter(self.glob, self.params)

    def keep_local(self) -> None:
        """The parameters into the local copy (for the merge)."""
        if self.local is None:
            self.local = torch.empty(self.numel, dtype=self.dtype)
        engine.gather(self.params, self.local)

    def pseudo_gradient(self) -> None:
        """``pseudo = global - parameters``."""
        engine.pseudo_gradient(self.glob, self.params, self.pseudo)

    def close(self) -> None:
        if self.sync is not None:
            try:
                self.sync.wait()
            except Exception:
                pass
            self.sync = None
