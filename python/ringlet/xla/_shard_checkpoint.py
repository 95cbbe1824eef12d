"""A sharded tensor's shard as ``ringlet.checkpoint`` mappings, on the checkpoint grid.

Padding is never stored. A shard whose box lies on the chunk grid (every offset
a multiple of the box's size along its dimension: every even split, and most
uneven ones) is one :class:`~ringlet.checkpoint.ShardedTensor`; the short last
shard of an uneven split becomes a :class:`~ringlet.checkpoint.ShardedTensorFactory`
storing a few grid-aligned pieces and giving the shard back when loaded.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checkpoint.mapping import ShardedTensor, ShardedTensorFactory
from ..core.engine import ptr
from ._shard_layout import Box, local_slices

__all__ = ["checkpoint_mapping", "grid_intervals", "grid_pieces"]


def largest_divisor_at_most(n: int, limit: int) -> int:
    best = 1
    i = 1
    while i * i <= n:
        if n % i == 0:
            for d in (i, n // i):
                if best < d <= limit:
                    best = d
        i += 1
    return best


def grid_intervals(start: int, stop: int) -> list[tuple[int, int]]:
    """Split ``[start, stop)`` into intervals whose start is a multiple of their length."""
    if stop <= start:
        return [(start, stop)]
    out = []
    o = start
    while o < stop:
        size = stop - o if o == 0 else largest_divisor_at_most(o, stop - o)
        out.append((o, o + size))
        o += size
    return out


def grid_pieces(box: Box) -> list[Box]:
    """Cover a box with boxes whose offsets are multiples of their sizes (checkpoint grid)."""
    pieces: list[Box] = [()]
    for lo, hi in box:
        pieces = [(*p, iv) for p in pieces for iv in grid_intervals(lo, hi)]
    return pieces


def checkpoint_mapping(key: str, region: torch.Tensor, box: Box, global_shape: tuple[int, ...],
                       parts: list[int], replica_id: int,
                       allow_shape_mismatch: bool) -> ShardedTensor | ShardedTensorFactory:
    """The checkpoint mapping of ``region``, the unpadded shard stored at global ``box``.

    ``parts`` gives, per dimension, the number of parts the spec splits it into;
    the entries refer to ``region``'s storage, so loading fills it in place.
    """
    even = all(n % p == 0 for n, p in zip(global_shape, parts))
    common = {"replica_id": replica_id, "allow_shape_mismatch": allow_shape_mismatch}

    def piece(sub: Box, fragm: tuple[int, ...] | None) -> ShardedTensor:
        view = region[local_slices(sub, box)]
        return ShardedTensor(key, view, view.dtype, tuple(view.shape), global_shape,
                             tuple(lo for lo, _ in sub), fragm, **common)

    pieces = grid_pieces(box)
    if len(pieces) == 1:
        return piece(pieces[0], tuple(parts) if even else None)

    def build(k: str, data: torch.Tensor, replica_id: Any, flattened_range: Any) -> Any:
        return {str(i): piece(sub, None) for i, sub in enumerate(pieces)}

    def merge(loaded: dict[str, torch.Tensor]) -> torch.Tensor:
        for i, sub in enumerate(pieces):
            dst = region[local_slices(sub, box)]
            src = loaded[str(i)]
            if ptr(src) != ptr(dst) or src.stride() != dst.stride():
                dst.copy_(src)
        return region

    return ShardedTensorFactory(key, region, build, merge, replica_id)
