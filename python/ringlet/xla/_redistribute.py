"""Moving shards between ranks: the all-gather of a global tensor and resharding.

A reshard is planned once per (shape, source layout, destination layout) and
cached: for every destination rank and every distinct stored tile (one per set
of replicas), the overlap of the two is taken from the destination itself when
it holds that tile, otherwise from one replica only. The plan is the same on
every rank; each rank then copies its local pieces and sends the rest in a
single all-to-all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import xla_model
from ._shard_layout import (
    Box,
    axis_parts,
    box_of,
    intersect,
    local_slices,
    rank_world,
    volume,
)
from .mesh import Mesh, ShardIndices, all_shard_indices

__all__ = [
    "ReshardPlan",
    "Transfer",
    "all_gather_shards",
    "exchange",
    "reshard_plan",
    "run_plan",
]


def all_gather_shards(data: torch.Tensor, mesh: Mesh, norm_spec: tuple[Any, ...],
                      global_shape: Sequence[int]) -> torch.Tensor:
    """The whole tensor from this rank's padded shard ``data`` (a collective call).

    The padded shards are all-gathered dimension by dimension, each along the
    mesh axes that split it (``groups=mesh.groups_along(axes)``), then the
    padding is cut off; the result never shares storage with ``data``.
    """
    out = data
    for dim, entry in enumerate(norm_spec):
        axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        if axis_parts(mesh, entry) == 1:
            continue
        out = xla_model.all_gather(out.contiguous(), dim=dim, groups=mesh.groups_along(axes))
    crop = out[tuple(slice(0, n) for n in global_shape)]
    return crop.clone() if out is data else crop.contiguous()


@dataclass(frozen=True)
class Transfer:
    """Rank ``src`` gives rank ``dst`` the global ``box`` (``src == dst``: a local copy)."""

    src: int
    dst: int
    box: Box


@dataclass(frozen=True)
class ReshardPlan:
    """Who sends which global box to whom; identical on every rank."""

    src: tuple[ShardIndices, ...]
    dst: tuple[ShardIndices, ...]
    transfers: tuple[Transfer, ...]
    remote: bool  # whether any piece crosses ranks

    def moved_elements(self) -> int:
        """Elements that cross ranks (pieces a rank copies to itself left out)."""
        return sum(volume(t.box) for t in self.transfers if t.src != t.dst)


@functools.lru_cache(maxsize=256)
def reshard_plan(shape: tuple[int, ...], src_mesh: Mesh, src_spec: tuple[Any, ...],
                  dst_mesh: Mesh, dst_spec: tuple[Any, ...]) -> ReshardPlan:
    src = all_shard_indices(shape, src_mesh, src_spec)
    dst = all_shard_indices(shape, dst_mesh, dst_spec)
    # Distinct stored tiles, each with the ranks holding it (its replicas).
    tiles: dict[Box, list[int]] = {}
    for info in src:
        box = box_of(info)
        if volume(box) > 0:
            tiles.setdefault(box, []).append(info.rank)
    transfers: list[Transfer] = []
    for d, info in enumerate(dst):
        need = box_of(info)
        if volume(need) == 0:
            continue
        for tile, holders in tiles.items():
            overlap = intersect(tile, need)
            if overlap is None:
                continue
            source = d if d in holders else holders[d % len(holders)]
            transfers.append(Transfer(source, d, overlap))
    remote = any(t.src != t.dst for t in transfers)
    return ReshardPlan(tuple(src), tuple(dst), tuple(transfers), remote)


def run_plan(plan: ReshardPlan, data: torch.Tensor, me: int,
             exchange: Callable[[list[torch.Tensor], list[torch.Tensor]], None]) -> torch.Tensor:
    """Execute ``plan`` on this rank: returns the new padded shard.

    Pieces that stay on this rank are copied locally; the others travel in one
    call of ``exchange`` (an all-to-all such as :func:`exchange`), made only when
    some piece crosses ranks.
    """
    src_origin = box_of(plan.src[me])
    dst_origin = box_of(plan.dst[me])
    out = data.new_zeros(plan.dst[me].shard_shape)
    n = len(plan.src)
    outgoing: list[list[Box]] = [[] for _ in range(n)]
    incoming: list[list[Box]] = [[] for _ in range(n)]
    for t in plan.transfers:
        if t.src == me and t.dst == me:
            out[local_slices(t.box, dst_origin)] = data[local_slices(t.box, src_origin)]
        elif t.src == me:
            outgoing[t.dst].append(t.box)
        elif t.dst == me:
            incoming[t.src].append(t.box)
    if not plan.remote:
        return out
    empty = data.new_empty(0)
    send = [
        torch.cat([data[local_slices(b, src_origin)].reshape(-1) for b in boxes])
        if boxes else empty
        for boxes in outgoing
    ]
    recv = [data.new_empty(sum(volume(b) for b in boxes)) for boxes in incoming]
    exchange(send, recv)
    for boxes, flat in zip(incoming, recv):
        offset = 0
        for b in boxes:
            region = out[local_slices(b, dst_origin)]
            k = volume(b)
            region.copy_(flat[offset:offset + k].view(region.shape))
            offset += k
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def exchange(send: list[torch.Tensor], recv: list[torch.Tensor]) -> None:
    """All-to-all of 1-D tensors: ``send[j]`` goes to rank ``j``, ``recv[i]`` comes from rank ``i``.

    Both sides must agree on every size (the engine's ``all_to_all_v`` checks
    it on every rank); only the bytes each rank needs travel.
    """
    rank, world = rank_world()
    if len(send) != world or len(recv) != world:
        raise ValueError(
            f"rank {rank}: exchange needs one send and one recv tensor per rank ({world}), got "
            f"{len(send)} and {len(recv)}"
        )
    xla_model.all_to_all_v(
        [as_bytes(s) for s in send], [r.view(-1).view(torch.uint8) for r in recv]
    )
