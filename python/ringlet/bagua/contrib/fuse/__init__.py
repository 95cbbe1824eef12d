"""Bagua's ``bagua.torch_api.contrib.fuse``: the fused optimizer
(:mod:`.optimizer`)."""

from .optimizer import fuse_optimizer, fuse_step, is_fused_optimizer

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer"]
