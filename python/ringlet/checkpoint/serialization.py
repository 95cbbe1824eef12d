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
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import runtime
from ..xla.xla_model import rendezvous
from . import _encoding as enc
from . import _geometry as geo
from ._storage import (
    exchange_dirs,
    fsync_dir,
    list_dir,
    write_bytes_atomic,
    write_safetensors,
)
from .core import CheckpointingException
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from .validation import StrictHandling, parse_strict_flag, report_mismatch

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

logger = logging.getLogger(__name__)

FORMAT_NAME = "ringlet.checkpoint"
FORMAT_VERSION = 1
INDEX_FILE = "ringlet_metadata.json"
MARKER_FILE = "ringlet_complete"
COMMON_JSON = "common.json"
COMMON_TENSORS = "common.safetensors"

#: Stored global view of a checkpoint: key (unique key for objects) -> data-less ShardedBase.
CkptShardedMetadata = dict[str, ShardedBase]

# Test-only hook, called with a phase name at points where a crash is interesting.
_TEST_HOOK: Callable[[str], None] | None = None


def _hook(phase: str) -> None:
    if _TEST_HOOK is not None:
        _TEST_HOOK(phase)


# ---------------------------------------------------------------------------------------------
# Coordination between ranks


_CALL_COUNTER = itertools.count()


class _Comm:
    """Rank, world size and an all-gather of bytes; one process without ringlet initialised."""

    def __init__(self) -> None:
        self._engine = runtime.is_initialized()
        if not self._engine:
            self.rank, self.world_size = 0, 1
        else:
            self.rank, self.world_size = int(runtime.get_ordinal()), int(runtime.world_size())

    def allgather(self, name: str, payload: bytes) -> list[bytes]:
        if not self._engine:
            return [payload]
        tag = f"ringlet.checkpoint.{name}.{next(_CALL_COUNTER)}"
        return [bytes(p) for p in rendezvous(tag, payload)]

    def allgather_status(
        self, name: str, error: BaseException | None, extra: Any = None
    ) -> list[dict[str, Any]]:
        """Gather (ok, message, extra) from all ranks; every rank calls it, failed or not."""
        payload = {
            "ok": error is None,
            "error": None if error is None else _describe(error),
            "extra": extra,
        }
        return [
            json.loads(raw.decode("utf-8"))
            for raw in self.allgather(name, json.dumps(payload).encode("utf-8"))
        ]


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _raise_if_failed(
    statuses: list[dict[str, Any]], error: BaseException | None, what: str
) -> None:
    if error is not None:
        if isinstance(error, CheckpointingException):
            raise error
        raise CheckpointingException(f"{what} failed: {_describe(error)}") from error
    failed = [(r, s["error"]) for r, s in enumerate(statuses) if not s["ok"]]
    if failed:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise CheckpointingException(f"{what} failed on rank(s) {[r for r, _ in failed]}: {detail}")


# ---------------------------------------------------------------------------------------------
# Progress reporting


class _Progress:
    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self._bar = None
        if not enabled or total <= 0:
            return
        try:
            if not sys.stderr.isatty():
                return
        except (AttributeError, ValueError):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(
            total=total,
            desc=desc,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            delay=1.0,
            leave=False,
        )

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# ---------------------------------------------------------------------------------------------
# Walking nested state dicts


def _copy_tree(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy_tree(v) for v in tree]
    return tree


def _leaves(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, (*path, i))
    else:
        yield path, tree


def _path_str(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path) or "<root>"


def _extract_factories(tree: Any) -> Any:
    """Sub-tree holding only the factories; list positions become int dict keys."""
    if isinstance(tree, ShardedTensorFactory):
        return tree
    if isinstance(tree, (dict, list)):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        out = {}
        for k, v in items:
            sub = _extract_factories(v)
            if sub is not None:
                out[k] = sub
        return out or None
    return None


def _common_tree(tree: Any) -> Any:
    """The tree without sharded and local-only values (dict entries dropped, list slots as "
    "holes)."""

    def skip(value: Any) -> bool:
        return isinstance(value, (ShardedBase, LocalNonpersistentObject))

    if isinstance(tree, dict):
        return {k: _common_tree(v) for k, v in tree.items() if not skip(v)}
    if isinstance(tree, list):
        return [enc.HOLE if skip(v) else _common_tree(v) for v in tree]
    return tree


# ---------------------------------------------------------------------------------------------
# Checkpoint directory helpers


def _shard_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def _objects_file(rank: int) -> str:
    return f"rank_{rank:05d}.objects.json"


def _looks_like_checkpoint(path: str) -> bool:
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


def _backup_candidates(final: str) -> list[str]:
    parent, name = os.path.split(final)
    prefix = f".{name}.ringlet-old-"
    return [os.path.join(parent, n) for n in list_dir(parent) if n.startswith(prefix)]


def _check_destination(final: str) -> None:
    if os.path.lexists(final):
        if not os.path.isdir(final):
            raise CheckpointingException(
                f"checkpoint destination {final} exists and is not a directory"
            )
        if list_dir(final) and not _looks_like_checkpoint(final):
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


def _tensor_record(sh: ShardedTensor, rank: int, name: str) -> dict[str, Any]:
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
        "file": _shard_file(rank),
        "name": name,
        "rank": rank,
    }


def _plan_save(sharded_state_dict: ShardedStateDict, rank: int) -> _SavePlan:
    """Build factories, pick main replicas and encode everything, without touching the disk."""
    if not isinstance(sharded_state_dict, dict):
        raise CheckpointingException(
            f"save expects a dict, got {type(sharded_state_dict).__name__}"
        )
    tree = _copy_tree(sharded_state_dict)
    apply_factories(tree)
    plan = _SavePlan()

    def object_sink(tensor: torch.Tensor) -> str:
        name = f"o{len(plan.items)}"
        plan.items.append((name, tensor))
        return name

    encoded_objects: dict[str, Any] = {}
    for path, leaf in _leaves(tree):
        if isinstance(leaf, ShardedTensor):
            leaf.validate_metadata_integrity()
            if not is_main_replica(leaf.replica_id):
                continue
            if leaf.data is None:
                raise CheckpointingException(f"{leaf} at {_path_str(path)} has no data to save")
            name = f"t{len(plan.items)}"
            plan.items.append((name, leaf.data))
            plan.tensor_records.append(_tensor_record(leaf, rank, name))
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
                    "file": _objects_file(rank),
                    "tensors": _shard_file(rank),
                    "rank": rank,
                }
            )
        elif isinstance(leaf, ShardedBase):
            raise CheckpointingException(f"cannot save {type(leaf).__name__} at {_path_str(path)}")
    if encoded_objects:
        plan.objects_json = enc.dumps(encoded_objects)
    if rank == 0:

        def common_sink(tensor: torch.Tensor) -> str:
            name = f"c{len(plan.common_items)}"
            plan.common_items.append((name, tensor))
            return name

        plan.common_json = enc.dumps(enc.encode(_common_tree(tree), common_sink))
    return plan


def _write_rank_files(tmp: str, plan: _SavePlan, rank: int, progress: _Progress) -> dict[str, int]:
    """Write this rank's files into ``tmp``; returns their sizes by name."""
    files: dict[str, int] = {}
    if plan.objects_json is not None:
        path = os.path.join(tmp, _objects_file(rank))
        files[_objects_file(rank)] = write_bytes_atomic(path, plan.objects_json)
    if plan.items:
        path = os.path.join(tmp, _shard_file(rank))
        meta = {"format": FORMAT_NAME}
        files[_shard_file(rank)] = write_safetensors(path, plan.items, meta, progress.update, _hook)
    if plan.common_json is not None:
        files[COMMON_JSON] = write_bytes_atomic(os.path.join(tmp, COMMON_JSON), plan.common_json)
        if plan.common_items:
            path = os.path.join(tmp, COMMON_TENSORS)
            meta = {"format": FORMAT_NAME}
            files[COMMON_TENSORS] = write_safetensors(path, plan.common_items, meta)
    return files


def _shard_pieces(record: dict[str, Any]) -> list[geo.Piece]:
    box = (1,) * record["prepend_axis_num"] + tuple(record["local_shape"])
    flat = record["flattened_range"]
    return geo.pieces(record["global_offset"], box, None if flat is None else tuple(flat))


def _build_index(per_rank: list[dict[str, Any]], validate_access_integrity: bool) -> dict[str, Any]:
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
            _validate_tensor_coverage(key, entry)
        _validate_object_coverage(objects)
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


def _validate_tensor_coverage(key: str, entry: dict[str, Any]) -> None:
    global_shape = tuple(entry["global_shape"])
    origin = (0,) * len(global_shape)
    boxes: list[tuple[geo.Index, geo.Index]] = []
    owners: list[dict[str, Any]] = []
    total = 0
    for shard in entry["shards"]:
        for piece in _shard_pieces(shard):
            if piece.numel == 0:
                continue
            start, stop = piece.start, piece.stop
            if any(s < 0 for s in start) or any(e > g for e, g in zip(stop, global_shape)):
                raise CheckpointingException(
                    f"ShardedTensor {key!r}: shard at offset {shard['global_offset']} with local "
                    "shape "
                    f"{shard['local_shape']} (rank {shard['rank']}) lies outside global shape "
                    f"{global_shape}"
                )
            boxes.append((start, stop))
            owners.append(shard)
            total += piece.numel
    overlap = geo.find_overlap(boxes)
    if overlap is not None:
        a, b = (owners[i] for i in overlap)
        raise CheckpointingException(
            f"ShardedTensor {key!r}: shards overlap (offset {a['global_offset']} on rank "
            f"{a['rank']} and "
            f"offset {b['global_offset']} on rank {b['rank']}); each element needs exactly one "
            "main replica"
        )
    expected = geo.volume(origin, global_shape)
    if total != expected:
        raise CheckpointingException(
            f"ShardedTensor {key!r}: main replicas cover {total} of the {expected} elements of "
            "global "
            f"shape {global_shape}; some shards are missing (check replica_id and offsets)"
        )


def _validate_object_coverage(objects: dict[str, dict[str, Any]]) -> None:
    by_key: dict[str, list[dict[str, Any]]] = {}
    for obj in objects.values():
        by_key.setdefault(obj["key"], []).append(obj)
    for key, cells in by_key.items():
        shape = tuple(cells[0]["global_shape"])
        if any(tuple(c["global_shape"]) != shape for c in cells):
            raise CheckpointingException(
                f"ShardedObject {key!r}: ranks disagree on the global shape"
            )
        if any(not 0 <= o < s for c in cells for o, s in zip(c["global_offset"], shape)):
            raise CheckpointingException(
                f"ShardedObject {key!r}: an offset lies outside global shape {shape}"
            )
        if len(cells) != math.prod(shape):
            raise CheckpointingException(
                f"ShardedObject {key!r}: {len(cells)} of {math.prod(shape)} cells of global "
                f"shape {shape} "
                "are saved; some shards are missing"
            )


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
    comm = _Comm()
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
                f"{_describe(exc)}"
            ) from exc
        try:
            _raise_if_failed(statuses, error, f"saving checkpoint {final}")
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
        index = _build_index([b[1] for b in begun], validate_access_integrity)
    except Exception as err:  # identical on every rank, but raised together below
        error = err
    _hook("after_begin")

    # 2. Every rank writes its own files.
    sizes = None
    if error is None:
        bar = _Progress(plan.nbytes, "save", progress and comm.rank == 0)
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


# ---------------------------------------------------------------------------------------------
# Reading


class _Checkpoint:
    """An opened checkpoint directory: its index and lazily opened files."""

    def __init__(self, checkpoint_dir: str | os.PathLike) -> None:
        path = os.path.abspath(os.fspath(checkpoint_dir))
        if not os.path.lexists(path):
            backups = [b for b in _backup_candidates(path) if check_is_distributed_checkpoint(b)]
            if len(backups) == 1:
                logger.warning(
                    "checkpoint %s is missing; using %s left by an interrupted save",
                    path,
                    backups[0],
                )
                path = backups[0]
            else:
                raise CheckpointingException(f"checkpoint directory {path} does not exist")
        if not os.path.isdir(path):
            raise CheckpointingException(f"checkpoint path {path} is not a directory")
        self.dir = path
        marker_path = os.path.join(path, MARKER_FILE)
        index_path = os.path.join(path, INDEX_FILE)
        if not os.path.isfile(marker_path):
            if os.path.isfile(index_path):
                raise CheckpointingException(
                    f"{path} is an incomplete checkpoint (no completion marker {MARKER_FILE}; "
                    "the save did not finish)"
                )
            raise CheckpointingException(
                f"{path} is not a ringlet checkpoint (no {MARKER_FILE} / {INDEX_FILE})"
            )
        if not os.path.isfile(index_path):
            raise CheckpointingException(f"checkpoint {path} lacks its index {INDEX_FILE}")
        with open(marker_path, "rb") as f:
            marker = enc.loads(f.read(), f"completion marker {marker_path}")
        with open(index_path, "rb") as f:
            raw_index = f.read()
        if (
            not isinstance(marker, dict)
            or marker.get("index_sha256") != hashlib.sha256(raw_index).hexdigest()
        ):
            raise CheckpointingException(
                f"index {index_path} does not match its completion marker (damaged?)"
            )
        index = enc.loads(raw_index, f"index {index_path}")
        if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
            raise CheckpointingException(f"{index_path} is not a ringlet checkpoint index")
        if index.get("version") != FORMAT_VERSION:
            raise CheckpointingException(
                f"checkpoint {path} has format version {index.get('version')}; this ringlet "
                f"reads {FORMAT_VERSION}"
            )
        self.index: dict[str, Any] = index
        self._handles: dict[str, Any] = {}
        self._json: dict[str, Any] = {}

    def close(self) -> None:
        for handle in self._handles.values():
            with contextlib.suppress(Exception):  # closing a read-only mapping
                handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def path_of(self, name: str) -> str:
        info = self.index["files"].get(name)
        if info is None or os.path.basename(name) != name or name in ("", ".", ".."):
            raise CheckpointingException(
                f"checkpoint {self.dir}: index refers to unknown file {name!r}"
            )
        path = os.path.join(self.dir, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            raise CheckpointingException(
                f"checkpoint {self.dir}: shard file {name} is missing"
            ) from None
        if size != info["size"]:
            raise CheckpointingException(
                f"checkpoint {self.dir}: shard file {name} is truncated or damaged "
                f"({size} bytes on disk, {info['size']} recorded)"
            )
        return path

    def tensors(self, name: str) -> Any:
        handle = self._handles.get(name)
        if handle is None:
            from safetensors import safe_open

            path = self.path_of(name)
            try:
                handle = safe_open(path, framework="pt", device="cpu")
                handle.__enter__()
            except Exception as err:
                raise CheckpointingException(
                    f"checkpoint {self.dir}: cannot read shard file {name}: {err}"
                ) from err
            self._handles[name] = handle
        return handle

    def json_file(self, name: str) -> Any:
        if name not in self._json:
            with open(self.path_of(name), "rb") as f:
                self._json[name] = enc.loads(
                    f.read(), f"checkpoint file {os.path.join(self.dir, name)}"
                )
        return self._json[name]

    def tensor_source(self, name: str) -> enc.TensorSource:
        def get(entry: str) -> torch.Tensor:
            try:
                return self.tensors(name).get_tensor(entry)
            except CheckpointingException:
                raise
            except Exception as err:
                raise CheckpointingException(
                    f"checkpoint {self.dir}: cannot read {entry!r} from {name}: {err}"
                ) from err

        return get

    def common(self) -> Any:
        info = self.index.get("common")
        if not info:
            return {}
        source = self.tensor_source(info["tensors"]) if info.get("tensors") else None
        return enc.decode(self.json_file(info["json"]), source)

    def read_tensor_region(
        self, shard: dict[str, Any], piece: geo.Piece, start: geo.Index, stop: geo.Index
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` (global coordinates) of a stored shard piece."""
        name = shard["name"]
        try:
            sl = self.tensors(shard["file"]).get_slice(name)
            shape = tuple(hi - lo for lo, hi in zip(start, stop))
            if shard["flattened_range"] is None:
                p = shard["prepend_axis_num"]
                offset = shard["global_offset"]
                index = tuple(
                    slice(lo - o, hi - o) for lo, hi, o in zip(start[p:], stop[p:], offset[p:])
                )
                data = sl[index] if index else sl[()]
                return data.reshape(shape)
            if not piece.shape:
                return sl[piece.offset : piece.offset + 1].reshape(())
            row = math.prod(piece.shape[1:])
            r0 = start[0] - piece.start[0]
            r1 = stop[0] - piece.start[0]
            flat = sl[piece.offset + r0 * row : piece.offset + r1 * row]
            block = flat.reshape((r1 - r0, *piece.shape[1:]))
            rest = tuple(
                slice(lo - s, hi - s) for lo, hi, s in zip(start[1:], stop[1:], piece.start[1:])
            )
            return block[(slice(None), *rest)]
        except CheckpointingException:
            raise
        except Exception as err:
            raise CheckpointingException(
                f"checkpoint {self.dir}: cannot read {name!r} of key {shard['key']!r} from "
                f"{shard['file']}: {err}"
            ) from err


def _numel(sh: ShardedTensor) -> int:
    if sh.flattened_range is None:
        return math.prod(sh.local_shape)
    return sh.flattened_range.stop - sh.flattened_range.start


def _load_tensor(ckpt: _Checkpoint, sh: ShardedTensor, progress: _Progress) -> torch.Tensor:
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
        for sp in _shard_pieces(shard):
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


def _load_object(ckpt: _Checkpoint, obj: ShardedObject) -> Any:
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


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


@dataclass
class _Loaded:
    value: Any


def _merge(common: Any, loaded: Any) -> Any:
    """Combine the stored common tree with the tree of loaded values (``_Loaded`` leaves)."""
    if isinstance(loaded, _Loaded):
        return loaded.value
    if isinstance(loaded, dict):
        base = common if isinstance(common, dict) else {}
        out = {}
        for k in itertools.chain(loaded, (k for k in base if k not in loaded)):
            value = _merge(base.get(k, _ABSENT), loaded.get(k, _ABSENT))
            if value is not _ABSENT:
                out[k] = value
        return out
    if isinstance(loaded, list):
        base = common if isinstance(common, list) else []
        n = max(len(base), len(loaded))
        merged = [
            _merge(base[i] if i < len(base) else _ABSENT, loaded[i] if i < len(loaded) else _ABSENT)
            for i in range(n)
        ]
        return [None if v is _ABSENT else v for v in merged]
    # Nothing was loaded here: the stored common value, if any.
    if common is enc.HOLE or common is _ABSENT:
        return _ABSENT
    if isinstance(common, dict):
        return {
            k: v
            for k, v in ((k, _merge(v, _ABSENT)) for k, v in common.items())
            if v is not _ABSENT
        }
    if isinstance(common, list):
        return [None if v is _ABSENT else v for v in (_merge(c, _ABSENT) for c in common)]
    return common


def _loaded_tree(tree: Any, values: dict[int, Any]) -> Any:
    """The request tree with loaded leaves wrapped in ``_Loaded``, everything else ``_ABSENT``."""
    if isinstance(tree, dict):
        return {k: _loaded_tree(v, values) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_loaded_tree(v, values) for v in tree]
    if id(tree) in values:
        return _Loaded(values[id(tree)])
    return _ABSENT


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
    comm = _Comm()
    with _Checkpoint(checkpoint_dir) as ckpt:
        tree = _copy_tree(sharded_state_dict)
        factories = _extract_factories(tree)
        apply_factories(tree)
        requested: list[ShardedBase] = []
        for path, leaf in _leaves(tree):
            if isinstance(leaf, (ShardedTensor, ShardedObject)):
                requested.append(leaf)
            elif isinstance(leaf, ShardedBase):
                raise CheckpointingException(
                    f"cannot load {type(leaf).__name__} at {_path_str(path)}"
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
        bar = _Progress(total, "load", progress and comm.rank == 0)
        values: dict[int, Any] = {}
        try:
            for leaf in requested:
                if isinstance(leaf, ShardedTensor):
                    values[id(leaf)] = _load_tensor(ckpt, leaf, bar)
                else:
                    values[id(leaf)] = _load_object(ckpt, leaf)
        finally:
            bar.close()
        for _, leaf in _leaves(tree):
            if isinstance(leaf, LocalNonpersistentObject):
                values[id(leaf)] = leaf.unwrap()
        result = _merge(ckpt.common(), _loaded_tree(tree, values))
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
    with _Checkpoint(checkpoint_dir) as ckpt:
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
    with _Checkpoint(checkpoint_dir) as ckpt:
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
    with _Checkpoint(checkpoint_dir) as ckpt:
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
    with _Checkpoint(checkpoint_dir) as ckpt:
        common = _merge(ckpt.common(), _ABSENT)
        return {} if common is _ABSENT else common
