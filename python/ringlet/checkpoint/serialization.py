"""Saving and loading sharded state dicts, with resharding.

On-disk layout of a checkpoint directory::

    ringlet_metadata.json      index: every stored shard (key, dtype, global shape,
                               offsets, local shape, flattened range, file, entry name),
                               every stored ShardedObject, the file sizes, content metadata
    ringlet_complete           completion marker, written last by rank 0; holds the
                               SHA-256 of the index
    common.json                non-sharded values (rank 0), tagged JSON
    common.safetensors         tensors referenced from common.json
    rank_00003.safetensors     main-replica ShardedTensor data of rank 3 (plus tensors
                               found inside its ShardedObjects)
    rank_00003.objects.json    ShardedObjects of rank 3, tagged JSON

A save writes everything into a hidden sibling directory and moves it into
place only after all ranks finished and rank 0 wrote the marker, so an
interrupted save never damages a previous checkpoint at the same path.

This module holds the save path (plan, write, gather, index, marker, install) and
is the public face of saving and loading; the jobs around it live beside it:
``_format`` (file names, records, the index), ``validation`` (coverage checks),
``_comm`` (exchanges between ranks), ``_tree`` (walking state dicts),
``_storage`` (writing files), ``_reader`` (reading them) and ``loading`` (the
load path, resharding on load).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _encoding as enc
from ._comm import Comm, describe, raise_if_failed
from ._format import (
    COMMON_JSON,
    COMMON_TENSORS,
    FORMAT_NAME,
    INDEX_FILE,
    MARKER_FILE,
    build_index,
    check_is_distributed_checkpoint,
    looks_like_checkpoint,
    objects_file,
    shard_file,
    tensor_record,
)
from ._progress import Progress
from ._reader import CheckpointReader
from ._storage import (
    exchange_dirs,
    fsync_dir,
    list_dir,
    write_bytes_atomic,
    write_safetensors,
)
from ._tree import common_tree, copy_tree, leaves, path_str
from .core import CheckpointingException
from .loading import (
    CkptShardedMetadata,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_sharded_metadata,
    load_tensors_metadata,
)
from .mapping import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    apply_factories,
    is_main_replica,
)

__all__ = [
    "CkptShardedMetadata",
    "check_is_distributed_checkpoint",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "save",
]

# The names these helpers had when they lived here (tests reach them through this module).
_build_index = build_index
_Checkpoint = CheckpointReader
_Progress = Progress

# Test-only hook, called with a phase name at points where a crash is interesting.
_TEST_HOOK: Callable[[str], None] | None = None


def _hook(phase: str) -> None:
    if _TEST_HOOK is not None:
        _TEST_HOOK(phase)


# ---------------------------------------------------------------------------------------------
# Installing the finished directory


def _check_destination(final: str) -> None:
    if os.path.lexists(final):
        if not os.path.isdir(final):
            raise CheckpointingException(
                f"checkpoint destination {final} exists and is not a directory"
            )
        if list_dir(final) and not looks_like_checkpoint(final):
            raise CheckpointingException(
                f"checkpoint destination {final} is a non-empty directory that is not a ringlet "
                "checkpoint; refusing to replace it"
            )


def _install(tmp: str, final: str, token: str) -> None:
    """Move the finished checkpoint ``tmp`` to ``final``, replacing what is there atomically."""
    parent = os.path.dirname(final)
    if not os.path.lexists(final):
        os.rename(tmp, final)
    elif exchange_dirs(tmp, final):
        _hook("after_swap")
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        # No atomic exchange here: park the old one first; `load` can fall back to it.
        backup = os.path.join(parent, f".{os.path.basename(final)}.ringlet-old-{token}")
        os.rename(final, backup)
        fsync_dir(parent)
        os.rename(tmp, final)
        fsync_dir(parent)
        shutil.rmtree(backup, ignore_errors=True)
    fsync_dir(parent)
    # Leftovers of earlier interrupted saves to this path are superseded now.
    name = os.path.basename(final)
    for entry in list_dir(parent):
        if entry.startswith(
            (f".{name}.ringlet-old-", f".{name}.ringlet-tmp-")
        ) and not entry.endswith(token):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Saving


@dataclass
class _SavePlan:
    """What one rank writes: tensors for its safetensors file, encoded objects and common state."""

    items: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    tensor_records: list[dict[str, Any]] = field(default_factory=list)
    object_records: list[dict[str, Any]] = field(default_factory=list)
    objects_json: bytes | None = None
    common_json: bytes | None = None
    common_items: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.items)

    def metadata(self) -> dict[str, Any]:
        """The part of the plan every rank needs to validate the whole checkpoint."""
        return {"tensors": self.tensor_records, "objects": self.object_records}


def _plan_save(sharded_state_dict: ShardedStateDict, rank: int) -> _SavePlan:
    """Build factories, pick main replicas and encode everything, without touching the disk."""
    if not isinstance(sharded_state_dict, dict):
        raise CheckpointingException(
            f"save expects a dict, got {type(sharded_state_dict).__name__}"
        )
    tree = copy_tree(sharded_state_dict)
    apply_factories(tree)
    plan = _SavePlan()

    def object_sink(tensor: torch.Tensor) -> str:
        name = f"o{len(plan.items)}"
        plan.items.append((name, tensor))
        return name

    encoded_objects: dict[str, Any] = {}
    for path, leaf in leaves(tree):
        if isinstance(leaf, ShardedTensor):
            leaf.validate_metadata_integrity()
            if not is_main_replica(leaf.replica_id):
                continue
            if leaf.data is None:
                raise CheckpointingException(f"{leaf} at {path_str(path)} has no data to save")
            name = f"t{len(plan.items)}"
            plan.items.append((name, leaf.data))
            plan.tensor_records.append(tensor_record(leaf, rank, name))
        elif isinstance(leaf, ShardedObject):
            leaf.validate_metadata_integrity()
            if not is_main_replica(leaf.replica_id):
                continue
            if leaf.unique_key in encoded_objects:
                raise CheckpointingException(
                    f"ShardedObject {leaf.unique_key!r} appears twice as main replica "
                    f"in the state dict of rank {rank}"
                )
            encoded_objects[leaf.unique_key] = enc.encode(leaf.data, object_sink, leaf.unique_key)
            plan.object_records.append(
                {
                    "unique_key": leaf.unique_key,
                    "key": leaf.key,
                    "global_shape": list(leaf.global_shape),
                    "global_offset": list(leaf.global_offset),
                    "file": objects_file(rank),
                    "tensors": shard_file(rank),
                    "rank": rank,
                }
            )
        elif isinstance(leaf, ShardedBase):
            raise CheckpointingException(f"cannot save {type(leaf).__name__} at {path_str(path)}")
    if encoded_objects:
        plan.objects_json = enc.dumps(encoded_objects)
    if rank == 0:

        def common_sink(tensor: torch.Tensor) -> str:
            name = f"c{len(plan.common_items)}"
            plan.common_items.append((name, tensor))
            return name

        plan.common_json = enc.dumps(enc.encode(common_tree(tree), common_sink))
    return plan


def _write_rank_files(tmp: str, plan: _SavePlan, rank: int, progress: Progress) -> dict[str, int]:
    """Write this rank's files into ``tmp``; returns their sizes by name."""
    files: dict[str, int] = {}
    if plan.objects_json is not None:
        path = os.path.join(tmp, objects_file(rank))
        files[objects_file(rank)] = write_bytes_atomic(path, plan.objects_json)
    if plan.items:
        path = os.path.join(tmp, shard_file(rank))
        meta = {"format": FORMAT_NAME}
        files[shard_file(rank)] = write_safetensors(path, plan.items, meta, progress.update, _hook)
    if plan.common_json is not None:
        files[COMMON_JSON] = write_bytes_atomic(os.path.join(tmp, COMMON_JSON), plan.common_json)
        if plan.common_items:
            path = os.path.join(tmp, COMMON_TENSORS)
            meta = {"format": FORMAT_NAME}
            files[COMMON_TENSORS] = write_safetensors(path, plan.common_items, meta)
    return files


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str | os.PathLike,
    *,
    validate_access_integrity: bool = True,
    content_metadata: dict[str, Any] | None = None,
    progress: bool = True,
) -> None:
    """Save a sharded state dict; called by every rank with its own pieces.

    Each rank writes the main replicas (:func:`is_main_replica`) of its
    ShardedTensors and ShardedObjects to its own files, in parallel; rank 0 also
    writes the non-sharded ("common") values. Factories are built first;
    ``LocalNonpersistentObject`` values are not stored. The metadata of all
    ranks is gathered and checked, an index is written, and a completion marker
    last. Everything happens in a hidden sibling directory that replaces
    ``checkpoint_dir`` atomically at the end, so a save that dies midway leaves
    a previous checkpoint there intact. The state dict passed in is not changed.

    Args:
        sharded_state_dict: nested dicts/lists whose leaves are ShardedTensor,
            ShardedObject, ShardedTensorFactory, LocalNonpersistentObject or plain values.
        checkpoint_dir: destination; created if missing. An existing ringlet checkpoint
            or empty directory there is replaced; anything else is refused.
        validate_access_integrity: check that the main replicas of all ranks cover every
            global tensor and object grid exactly once.
        content_metadata: optional JSON-like dict stored in the index
            (read back with :func:`load_content_metadata`).
        progress: show a progress bar on rank 0 for long saves (only when stderr is a terminal).

    Returns:
        None. Raises ``CheckpointingException`` on every rank if any rank failed.

    Example:
        >>> import torch, tempfile
        >>> from ringlet.checkpoint import ShardedTensor, save, load
        >>> d = tempfile.mkdtemp() + "/ckpt"
        >>> save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.)), "step": 7}, d)
        >>> load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(4))}, d)
        {'w': tensor([0., 1., 2., 3.]), 'step': 7}
    """
    comm = Comm()
    final = os.path.abspath(os.fspath(checkpoint_dir))
    error: BaseException | None = None
    plan: _SavePlan | None = None
    tmp: str | None = None
    token = uuid.uuid4().hex[:12]
    encoded_content = None
    try:
        plan = _plan_save(sharded_state_dict, comm.rank)
        encoded_content = enc.encode(content_metadata, None, "content_metadata")
        if comm.rank == 0:
            _check_destination(final)
            parent = os.path.dirname(final)
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, f".{os.path.basename(final)}.ringlet-tmp-{token}")
            os.mkdir(tmp)
    except Exception as err:  # any failure must reach the other ranks
        error = err

    def cleanup() -> None:
        if comm.rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    def exchange(step: str, extra: Any = None) -> list[Any]:
        """All-gather ``extra`` (and this rank's error); raise everywhere if a rank failed."""
        try:
            statuses = comm.allgather_status(step, error, extra)
        except Exception as exc:  # a peer died or timed out: nothing will be installed
            cleanup()
            raise CheckpointingException(
                f"saving checkpoint {final}: exchange with the other ranks failed at {step}: "
                f"{describe(exc)}"
            ) from exc
        try:
            raise_if_failed(statuses, error, f"saving checkpoint {final}")
        except CheckpointingException:
            cleanup()
            raise
        return [s["extra"] for s in statuses]

    # 1. Agree on the temporary directory and check the metadata of all ranks before writing.
    begun = exchange("save.begin", [tmp, None if plan is None else plan.metadata()])
    tmp = begun[0][0]
    assert tmp is not None and plan is not None
    index: dict[str, Any] = {}
    try:
        index = build_index([b[1] for b in begun], validate_access_integrity)
    except Exception as err:  # identical on every rank, but raised together below
        error = err
    _hook("after_begin")

    # 2. Every rank writes its own files.
    sizes = None
    if error is None:
        bar = Progress(plan.nbytes, "save", progress and comm.rank == 0)
        try:
            sizes = _write_rank_files(tmp, plan, comm.rank, bar)
        except Exception as err:  # any failure must reach the other ranks
            error = err
        finally:
            bar.close()
    _hook("after_write")
    written = exchange("save.written", sizes)

    # 3. Rank 0 writes the index, then the completion marker, then moves the directory in place.
    if comm.rank == 0:
        try:
            for rank, files in enumerate(written):
                for name, size in files.items():
                    index["files"][name] = {"size": size, "rank": rank}
            if plan.common_json is not None:
                index["common"] = {
                    "json": COMMON_JSON,
                    "tensors": COMMON_TENSORS if plan.common_items else None,
                }
            index["content_metadata"] = encoded_content
            _hook("before_index")
            raw_index = json.dumps(index, separators=(",", ":")).encode("utf-8")
            write_bytes_atomic(os.path.join(tmp, INDEX_FILE), raw_index)
            fsync_dir(tmp)
            _hook("before_marker")
            marker = {"format": FORMAT_NAME, "index_sha256": hashlib.sha256(raw_index).hexdigest()}
            write_bytes_atomic(os.path.join(tmp, MARKER_FILE), json.dumps(marker).encode("utf-8"))
            fsync_dir(tmp)
            _hook("before_swap")
            _install(tmp, final, token)
        except Exception as err:  # any failure must reach the other ranks
            error = err
    exchange("save.done")
