"""Flat buckets of an outer algorithm: a fragment's parameters of one dtype,
their flat global copy, pseudo-gradient and average (engine memory the Rust
core reads and writes through :class:`ringlet._core.OuterSync`)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import _core
from .._engine import _DTYPE_NAMES

_CODECS = {None: None, "int8": "MinMaxUInt8", "int4": "MinMaxUInt4"}


def _spans(params: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(p.data_ptr(), p.numel() * p.element_size()) for p in params]


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
        if self.dtype not in _DTYPE_NAMES or not self.dtype.is_floating_point:
            raise TypeError(f"{what}: parameters of {self.dtype} cannot be averaged (float32, "
                            "float64, float16 and bfloat16 can)")
        self.name = _DTYPE_NAMES[self.dtype]
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
        self.sync = _core.OuterSync(
            comms, self.name, (self.pseudo.data_ptr(), self.nbytes, self.pseudo),
            (self.avg.data_ptr(), self.nbytes, self.avg),
            _CODECS[quantization], error_feedback,
        )

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The piece of ``flat`` that parameter ``i`` maps to, shaped like it."""
        p = self.params[i]
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    def save(self) -> None:
        """The parameters into the global copy."""
        _core.flat_gather(_spans(self.params), (self.glob.data_ptr(), self.nbytes))

    def restore(self) -> None:
        """The global copy into the parameters."""
        _core.flat_scatter((self.glob.data_ptr(), self.nbytes), _spans(self.params))

    def keep_local(self) -> None:
        """The parameters into the local copy (for the merge)."""
        if self.local is None:
            self.local = torch.empty(self.numel, dtype=self.dtype)
        _core.flat_gather(_spans(self.params), (self.local.data_ptr(), self.nbytes))

    def pseudo_gradient(self) -> None:
        """``pseudo = global - parameters``."""
        _core.pseudo_gradient((self.glob.data_ptr(), self.nbytes), _spans(self.params),
                              (self.pseudo.data_ptr(), self.nbytes), self.name)

    def close(self) -> None:
        if self.sync is not None:
            try:
                self.sync.wait()
            except Exception:
                pass
            self.sync = None
