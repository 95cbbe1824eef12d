"""Loading a checkpoint into any layout (resharding on load), and reading its metadata.

:func:`load` fills each requested ShardedTensor from whichever stored shards
overlap it (the saving and loading layouts may differ in world size, offsets,
prepended axes and flattened ranges), finds ShardedObjects by their unique key
and merges the common values back. The ``load_*_metadata`` functions and
:func:`load_common_state_dict` read the index or the common state only.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from . import _encoding as enc
from . import _geometry as geo
from ._comm import Comm
from ._progress import Progress
from ._reader import CheckpointReader
from ._tree import ABSENT, copy_tree, extract_factories, leaves, loaded_tree, merge, path_str
from .core import CheckpointingException
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from .validation import StrictHandling, parse_strict_flag, report_mismatch

__all__ = [
    "CkptShardedMetadata",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_sharded_metadata",
    "load_tensors_metadata",
]

#: Stored global view of a checkpoint: key (unique key for objects) -> data-less ShardedBase.
CkptShardedMetadata = dict[str, ShardedBase]


def _numel(sh: ShardedTensor) -> int:
    if sh.flattened_range is None:
        return math.prod(sh.local_shape)
    return sh.flattened_range.stop - sh.flattened_range.start


def _load_tensor(ckpt: CheckpointReader, sh: ShardedTensor, progress: Progress) -> torch.Tensor:
    entry = ckpt.index["tensors"].get(sh.key)
    if entry is None:
        raise CheckpointingException(f"key {sh.key!r} is not in checkpoint {ckpt.dir}")
    stored_shape = tuple(entry["global_shape"])
    if stored_shape != sh.global_shape and (
        not sh.allow_shape_mismatch or len(stored_shape) != len(sh.global_shape)
    ):
        raise CheckpointingException(
            f"{sh}: global shape {sh.global_shape} requested but {stored_shape} stored "
            f"in {ckpt.dir} (set allow_shape_mismatch=True to pad or crop)"
        )
    box = (1,) * sh.prepend_axis_num + sh.local_shape
    rng = sh.flattened_range
    targets = [
        p
        for p in geo.pieces(sh.global_offset, box, None if rng is None else (rng.start, rng.stop))
        if p.numel
    ]

    if sh.data is not None:
        result = sh.data
    elif rng is not None:
        result = torch.empty(rng.stop - rng.start, dtype=sh.dtype)
    else:
        result = torch.empty(sh.local_shape, dtype=sh.dtype)
    in_place = result.device.type == "cpu" and result.is_contiguous()
    buf = result.view(-1) if in_place else torch.empty(result.numel(), dtype=result.dtype)
    if stored_shape != sh.global_shape:
        buf.zero_()

    origin = (0,) * len(stored_shape)
    expected = 0
    for t in targets:
        inside = geo.intersect(t.start, t.stop, origin, stored_shape)
        expected += 0 if inside is None else geo.volume(*inside)
    box_start = sh.global_offset
    box_stop = tuple(o + n for o, n in zip(box_start, box))
    covered = 0
    for shard in entry["shards"]:
        shard_box = (1,) * shard["prepend_axis_num"] + tuple(shard["local_shape"])
        shard_stop = tuple(o + n for o, n in zip(shard["global_offset"], shard_box))
        if geo.intersect(tuple(shard["global_offset"]), shard_stop, box_start, box_stop) is None:
            continue
        for sp in geo.shard_pieces(shard):
            for tp in targets:
                region = geo.intersect(sp.start, sp.stop, tp.start, tp.stop)
                if region is None:
                    continue
                start, stop = region
                src = ckpt.read_tensor_region(shard, sp, start, stop)
                dst = buf[tp.offset : tp.offset + tp.numel].view(tp.shape)
                dst[tuple(slice(lo - s, hi - s) for lo, hi, s in zip(start, stop, tp.start))].copy_(
                    src
                )
                n = geo.volume(start, stop)
                covered += n
                progress.update(n * buf.element_size())
    if covered < expected:
        raise CheckpointingException(
            f"{sh}: checkpoint {ckpt.dir} holds only {covered} of the {expected} requested "
            "elements "
            f"(offset {sh.global_offset}, local shape {sh.local_shape}, flattened range {rng})"
        )
    if not in_place:
        result.copy_(buf.view(result.shape))
    return result


def _load_object(ckpt: CheckpointReader, obj: ShardedObject) -> Any:
    entry = ckpt.index["objects"].get(obj.unique_key)
    if entry is None:
        stored = sorted(k for k, v in ckpt.index["objects"].items() if v["key"] == obj.key)
        hint = f"; stored cells of this key: {stored}" if stored else ""
        raise CheckpointingException(
            f"ShardedObject {obj.unique_key!r} is not in checkpoint {ckpt.dir}{hint}"
        )
    data = ckpt.json_file(entry["file"])
    if obj.unique_key not in data:
        raise CheckpointingException(
            f"ShardedObject {obj.unique_key!r} is missing from {entry['file']}"
        )
    return enc.decode(data[obj.unique_key], ckpt.tensor_source(entry["tensors"]))


def _stored_keys(index: dict[str, Any]) -> set[str]:
    return set(index["tensors"]) | {obj["key"] for obj in index["objects"].values()}


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | os.PathLike,
    *,
    strict: str | StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    progress: bool = True,
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """Load a checkpoint into the layout described by ``sharded_state_dict``.

    Every ShardedTensor is filled from whichever stored shards overlap it, so the
    saving and loading layouts (world size, rank offsets, prepended axes,
    flattened ranges) may differ; data is read through memory maps, only the
    needed slices. A ShardedTensor with data is filled in place; one without
    data gets a new CPU tensor; a stored dtype different from the requested one is
    converted (as ``Tensor.copy_`` does). ShardedObjects are found by their unique key,
    ``LocalNonpersistentObject`` values are unwrapped, the stored common values
    are merged in, and factories are merged back. The state dict passed in is
    not changed.

    Args:
        sharded_state_dict: the layout to load, with ShardedTensor / ShardedObject /
            ShardedTensorFactory / LocalNonpersistentObject leaves.
        checkpoint_dir: directory written by :func:`save`.
        strict: a :class:`StrictHandling` or its value name (e.g. ``"raise_all"``).
            Modes ending in ``_ALL`` exchange the requested keys of all ranks.
        progress: show a progress bar on rank 0 for long loads (only when stderr is a terminal).

    Returns:
        The loaded state dict, or ``(state_dict, missing_keys, unexpected_keys)`` for
        RETURN_UNEXPECTED and RETURN_ALL.

    Example:
        >>> import torch, tempfile
        >>> from ringlet.checkpoint import ShardedTensor, save, load
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.).view(2, 3))}, d)
        >>> out = load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(1, 3), (0, 1, 2))}, d)
        >>> out["w"]
        tensor([[3., 4., 5.]])
    """
    mode = parse_strict_flag(strict)
    comm = Comm()
    with CheckpointReader(checkpoint_dir) as ckpt:
        tree = copy_tree(sharded_state_dict)
        factories = extract_factories(tree)
        apply_factories(tree)
        requested: list[ShardedBase] = []
        for path, leaf in leaves(tree):
            if isinstance(leaf, (ShardedTensor, ShardedObject)):
                requested.append(leaf)
            elif isinstance(leaf, ShardedBase):
                raise CheckpointingException(
                    f"cannot load {type(leaf).__name__} at {path_str(path)}"
                )

        missing: set[str] = set()
        unexpected: set[str] = set()
        if StrictHandling.requires_explicit_ckpt_mismatch_check(mode):
            stored = _stored_keys(ckpt.index)
            local_keys = {leaf.key for leaf in requested}
            unexpected = local_keys - stored
            if StrictHandling.requires_global_app_metadata(mode):
                payload = json.dumps(sorted(local_keys)).encode("utf-8")
                everyone = set().union(
                    *(json.loads(p) for p in comm.allgather("load.keys", payload))
                )
                missing = stored - everyone
            if mode in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
                report_mismatch(missing, unexpected, raise_error=True)
            elif mode in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
                report_mismatch(missing, unexpected, raise_error=False)
            requested = [leaf for leaf in requested if leaf.key not in unexpected]
            if mode == StrictHandling.IGNORE_ALL:
                missing, unexpected = set(), set()

        total = sum(
            _numel(leaf) * leaf.dtype.itemsize
            for leaf in requested
            if isinstance(leaf, ShardedTensor)
        )
        bar = Progress(total, "load", progress and comm.rank == 0)
        values: dict[int, Any] = {}
        try:
            for leaf in requested:
                if isinstance(leaf, ShardedTensor):
                    values[id(leaf)] = _load_tensor(ckpt, leaf, bar)
                else:
                    values[id(leaf)] = _load_object(ckpt, leaf)
        finally:
            bar.close()
        for _, leaf in leaves(tree):
            if isinstance(leaf, LocalNonpersistentObject):
                values[id(leaf)] = leaf.unwrap()
        result = merge(ckpt.common(), loaded_tree(tree, values))
    if factories is not None:
        result = apply_factory_merges(result, factories)
    if StrictHandling.requires_returning_mismatch_keys(mode):
        return result, missing, unexpected
    return result


def load_tensors_metadata(checkpoint_dir: str | os.PathLike) -> CkptShardedMetadata:
    """Global view of the stored tensors, without reading any tensor data.

    Each stored key maps to a data-less ShardedTensor covering the whole global
    tensor (offset 0, local shape = global shape, no fragmentation).

    Args:
        checkpoint_dir: directory written by :func:`save`.

    Returns:
        A dict from tensor key to ``ShardedTensor`` with ``data=None``.

    Example:
        >>> import torch, tempfile
        >>> from ringlet.checkpoint import ShardedTensor, save, load_tensors_metadata
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> save({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3))}, d)
        >>> load_tensors_metadata(d)["w"].global_shape
        (2, 3)
    """
    with CheckpointReader(checkpoint_dir) as ckpt:
        out: CkptShardedMetadata = {}
        for key, entry in ckpt.index["tensors"].items():
            meta = torch.empty(
                tuple(entry["global_shape"]), dtype=enc.name_to_dtype(entry["dtype"]), device="meta"
            )
            out[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
        return out


def load_sharded_metadata(checkpoint_dir: str | os.PathLike) -> CkptShardedMetadata:
    """Global view of all stored sharded entries, without data.

    Tensors are described as in :func:`load_tensors_metadata`; every stored
    ShardedObject cell appears under its unique key as a data-less ShardedObject.

    Args:
        checkpoint_dir: directory written by :func:`save`.

    Returns:
        A dict from tensor key / object unique key to a data-less ShardedBase.

    Example:
        >>> import tempfile
        >>> from ringlet.checkpoint import ShardedObject, save, load_sharded_metadata
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> save({"o": ShardedObject("o", [1, 2], (1,), (0,))}, d)
        >>> load_sharded_metadata(d)["o/shard_0_1"].global_shape
        (1,)
    """
    out = load_tensors_metadata(checkpoint_dir)
    with CheckpointReader(checkpoint_dir) as ckpt:
        for unique_key, entry in ckpt.index["objects"].items():
            out[unique_key] = ShardedObject(
                entry["key"], None, tuple(entry["global_shape"]), tuple(entry["global_offset"])
            )
    return out


def load_content_metadata(checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ``content_metadata`` given to :func:`save`, or None when none was given.

    Args:
        checkpoint_dir: directory written by :func:`save`.

    Returns:
        The stored dict or None.

    Example:
        >>> import tempfile
        >>> from ringlet.checkpoint import save, load_content_metadata
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> save({"step": 1}, d, content_metadata={"layout": "tp2"})
        >>> load_content_metadata(d)
        {'layout': 'tp2'}
    """
    with CheckpointReader(checkpoint_dir) as ckpt:
        return enc.decode(ckpt.index.get("content_metadata"), None)


def load_common_state_dict(checkpoint_dir: str | os.PathLike) -> StateDict:
    """The non-sharded values saved by rank 0, without any sharded entry.

    Args:
        checkpoint_dir: directory written by :func:`save`.

    Returns:
        The common state dict (tensors in it are CPU tensors).

    Example:
        >>> import tempfile
        >>> from ringlet.checkpoint import save, load_common_state_dict
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> save({"step": 3, "cfg": ("a", b"x")}, d)
        >>> load_common_state_dict(d)
        {'step': 3, 'cfg': ('a', b'x')}
    """
    with CheckpointReader(checkpoint_dir) as ckpt:
        common = merge(ckpt.common(), ABSENT)
        return {} if common is ABSENT else common
