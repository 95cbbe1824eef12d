"""Where a rank's shard of a sharded tensor lies, and the checks that name the rank.

Every mesh device is a rank. A partition spec splits each tensor dimension over
some mesh axes into equal parts (:func:`ringlet.xla.mesh.shard_indices`); a rank
holds its part padded to the common shard shape. Shards and their overlaps are
handled here as boxes: one ``(start, stop)`` pair per dimension, in global
coordinates. Nothing here communicates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Union

import torch

from ..core import groups
from ..errors import ShardingSpecError
from .mesh import (
    Mesh,
    ShardIndices,
    get_global_mesh,
    normalize_partition_spec,
    shard_indices,
)

__all__ = [
    "Box",
    "ShardIndexList",
    "as_spec",
    "axis_parts",
    "box_of",
    "check_mesh",
    "check_rank_of_spec",
    "intersect",
    "local_slices",
    "normalize",
    "pad_local_shard",
    "padded_shard",
    "rank_world",
    "resolve_mesh",
    "volume",
    "xla_indices",
]

Box = tuple[tuple[int, int], ...]

#: ``XLAShard.indices``: ``...`` (replicated or 0-d) or one slice per dimension.
ShardIndexList = Union[type(Ellipsis), list[slice]]


def rank_world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when ringlet is not initialised."""
    if not groups.is_initialized():
        return 0, 1
    return int(groups.get_ordinal()), int(groups.world_size())


def check_mesh(mesh: Any, what: str) -> Mesh:
    rank, world = rank_world()
    if not isinstance(mesh, Mesh):
        raise TypeError(f"rank {rank}: {what} needs a Mesh, got {type(mesh).__name__}")
    if mesh.size() != world:
        raise ShardingSpecError(
            f"rank {rank}: {what}: mesh {tuple(mesh.mesh_shape)} has {mesh.size()} devices but "
            f"the job has {world} ranks; every rank must be exactly one mesh device"
        )
    return mesh


def resolve_mesh(mesh: Mesh | None, what: str) -> Mesh:
    if mesh is None:
        mesh = get_global_mesh()
        if mesh is None:
            rank, _ = rank_world()
            raise ValueError(
                f"rank {rank}: {what}: no mesh given and no global mesh set "
                "(pass mesh= or call ringlet.xla.sharding.set_global_mesh)"
            )
    return check_mesh(mesh, what)


def as_spec(partition_spec: Any) -> tuple[Any, ...]:
    if isinstance(partition_spec, list):
        return tuple(partition_spec)
    if not isinstance(partition_spec, tuple):
        rank, _ = rank_world()
        raise TypeError(
            f"rank {rank}: partition_spec must be a tuple, got {type(partition_spec).__name__} "
            f"({partition_spec!r})"
        )
    return partition_spec


def check_rank_of_spec(spec: tuple[Any, ...], ndim: int) -> None:
    if len(spec) != ndim:
        rank, _ = rank_world()
        raise ShardingSpecError(
            f"rank {rank}: partition spec length ({len(spec)}) should be equal to the input "
            f"rank ({ndim}); got spec {spec!r}"
        )


def normalize(mesh: Mesh, spec: tuple[Any, ...]) -> tuple[Any, ...]:
    """Validate a partition spec against ``mesh``; errors name the rank."""
    try:
        return normalize_partition_spec(mesh, spec)
    except (ValueError, TypeError) as err:
        raise type(err)(f"rank {rank_world()[0]}: invalid partition spec: {err}") from err


def box_of(info: ShardIndices) -> Box:
    return tuple((s.start, s.stop) for s in info.indices)


def volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def xla_indices(slices: Sequence[slice], replicated: bool) -> ShardIndexList:
    """torch_xla's form of shard indices: ``...`` or a list of step-1 slices."""
    if replicated or len(slices) == 0:
        return Ellipsis
    return [slice(s.start, s.stop, 1) for s in slices]


def local_slices(box: Box, origin: Box) -> tuple[slice, ...]:
    """Slices selecting the global ``box`` inside a shard whose data starts at ``origin``."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def axis_parts(mesh: Mesh, entry: Any) -> int:
    """Number of parts a spec entry (None, an axis or a tuple of axes) splits a dimension into."""
    if entry is None:
        return 1
    axes = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.mesh_shape[a] for a in axes)


def padded_shard(t: torch.Tensor, mesh: Mesh, spec: tuple[Any, ...]) -> torch.Tensor:
    """This rank's padded shard of ``t``, the full tensor (the same on every rank)."""
    # torch_xla's order: the spec's length is asserted before its entries are read.
    check_rank_of_spec(spec, t.dim())
    normalize(mesh, spec)
    rank = rank_world()[0]
    local = t.detach()
    info = shard_indices(tuple(local.shape), mesh, spec, rank)
    shard = local.new_zeros(info.shard_shape)
    shard[tuple(slice(0, n) for n in info.unpadded_shape)] = local[info.indices]
    return shard


def pad_local_shard(local: torch.Tensor, mesh: Mesh, spec: tuple[Any, ...],
                    global_shape: Sequence[int] | None) -> tuple[torch.Tensor, Sequence[int]]:
    """This rank's shard ``local`` (padded or unpadded) as a padded shard, with the global shape.

    ``global_shape`` None means an even split: the shard shape times the number
    of parts on every dimension.
    """
    check_mesh(mesh, "from_local_shards")
    check_rank_of_spec(spec, local.dim())
    norm = normalize(mesh, spec)
    if global_shape is None:
        parts = [axis_parts(mesh, e) for e in norm]
        global_shape = tuple(n * p for n, p in zip(local.shape, parts))
    rank = rank_world()[0]
    info = shard_indices(tuple(global_shape), mesh, spec, rank)
    shard = local.detach()
    if tuple(shard.shape) != info.shard_shape:
        if tuple(shard.shape) != info.unpadded_shape:
            raise ValueError(
                f"rank {rank}: local shard has shape {tuple(shard.shape)}, but global shape "
                f"{tuple(global_shape)} under spec {spec!r} gives this rank the padded shape "
                f"{info.shard_shape} (unpadded {info.unpadded_shape})"
            )
        padded = shard.new_zeros(info.shard_shape)
        padded[tuple(slice(0, n) for n in info.unpadded_shape)] = shard
        shard = padded
    return shard, global_shape
