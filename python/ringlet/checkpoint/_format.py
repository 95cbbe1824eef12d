"""The on-disk format of a checkpoint directory: file names, records, the index.

Each rank describes what it stores as records (one per ShardedTensor shard,
one per ShardedObject cell); :func:`build_index` merges the records of all
ranks into the index that rank 0 writes as ``ringlet_metadata.json``, checking
that they agree and (optionally) cover every global tensor and object grid
exactly once. The completion marker ``ringlet_complete`` holds the SHA-256 of
the index; a directory without it is no checkpoint.
"""

from __future__ import annotations

import os
from typing import Any

from . import _encoding as enc
from ._storage import list_dir
from .core import CheckpointingException
from .mapping import ShardedTensor
from .validation import validate_object_coverage, validate_tensor_coverage

__all__ = [
    "COMMON_JSON",
    "COMMON_TENSORS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "MARKER_FILE",
    "backup_candidates",
    "build_index",
    "check_is_distributed_checkpoint",
    "looks_like_checkpoint",
    "objects_file",
    "shard_file",
    "tensor_record",
]

FORMAT_NAME = "ringlet.checkpoint"
FORMAT_VERSION = 1
INDEX_FILE = "ringlet_metadata.json"
MARKER_FILE = "ringlet_complete"
COMMON_JSON = "common.json"
COMMON_TENSORS = "common.safetensors"


def shard_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def objects_file(rank: int) -> str:
    return f"rank_{rank:05d}.objects.json"


def looks_like_checkpoint(path: str) -> bool:
    names = set(list_dir(path))
    return INDEX_FILE in names or MARKER_FILE in names


def check_is_distributed_checkpoint(checkpoint_dir: str | os.PathLike) -> bool:
    """Tell whether ``checkpoint_dir`` holds a complete ringlet checkpoint.

    A directory counts only when its completion marker exists, i.e. the save
    that wrote it finished on every rank.

    Args:
        checkpoint_dir: directory to inspect.

    Returns:
        True when the directory has an index and a completion marker.

    Example:
        >>> from ringlet.checkpoint import check_is_distributed_checkpoint
        >>> check_is_distributed_checkpoint("/nonexistent/dir")
        False
    """
    path = os.fspath(checkpoint_dir)
    return os.path.isfile(os.path.join(path, MARKER_FILE)) and os.path.isfile(
        os.path.join(path, INDEX_FILE)
    )


def backup_candidates(final: str) -> list[str]:
    parent, name = os.path.split(final)
    prefix = f".{name}.ringlet-old-"
    return [os.path.join(parent, n) for n in list_dir(parent) if n.startswith(prefix)]


def tensor_record(sh: ShardedTensor, rank: int, name: str) -> dict[str, Any]:
    rng = sh.flattened_range
    return {
        "key": sh.key,
        "dtype": enc.dtype_to_name(sh.dtype),
        "global_shape": list(sh.global_shape),
        "global_offset": list(sh.global_offset),
        "local_shape": list(sh.local_shape),
        "prepend_axis_num": sh.prepend_axis_num,
        "axis_fragmentations": None
        if sh.axis_fragmentations is None
        else list(sh.axis_fragmentations),
        "flattened_range": None if rng is None else [rng.start, rng.stop],
        "allow_shape_mismatch": sh.allow_shape_mismatch,
        "file": shard_file(rank),
        "name": name,
        "rank": rank,
    }


def build_index(per_rank: list[dict[str, Any]], validate_access_integrity: bool) -> dict[str, Any]:
    """Merge the metadata of all ranks into the index; raise on any inconsistency."""
    tensors: dict[str, dict[str, Any]] = {}
    objects: dict[str, dict[str, Any]] = {}
    for rank, record in enumerate(per_rank):
        for shard in record["tensors"]:
            entry = tensors.setdefault(
                shard["key"],
                {"dtype": shard["dtype"], "global_shape": shard["global_shape"], "shards": []},
            )
            for attr in ("dtype", "global_shape"):
                if entry[attr] != shard[attr]:
                    raise CheckpointingException(
                        f"ShardedTensor {shard['key']!r}: ranks disagree on {attr} "
                        f"({entry[attr]} vs {shard[attr]} on rank {rank})"
                    )
            entry["shards"].append(shard)
        for obj in record["objects"]:
            if obj["unique_key"] in objects:
                raise CheckpointingException(
                    f"ShardedObject {obj['unique_key']!r} is saved as main replica by ranks "
                    f"{objects[obj['unique_key']]['rank']} and {rank}; "
                    "set replica_id on all but one"
                )
            objects[obj["unique_key"]] = obj
    if validate_access_integrity:
        for key, entry in tensors.items():
            validate_tensor_coverage(key, entry)
        validate_object_coverage(objects)
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "world_size": len(per_rank),
        "files": {},
        "tensors": tensors,
        "objects": objects,
        "common": None,
        "content_metadata": None,
    }
