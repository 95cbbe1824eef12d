"""Reading a checkpoint directory: its completion marker and index checked, files
opened lazily (safetensors through memory maps), regions of stored shards read.

A missing directory whose save was interrupted between its two renames (no atomic
exchange on this file system) is found again through the parked copy it left.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
from typing import Any

import torch

from . import _encoding as enc
from . import _geometry as geo
from ._format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_FILE,
    MARKER_FILE,
    backup_candidates,
    check_is_distributed_checkpoint,
)
from .core import CheckpointingException

__all__ = ["CheckpointReader"]

logger = logging.getLogger(__name__)


class CheckpointReader:
    """An opened checkpoint directory: its index and lazily opened files."""

    def __init__(self, checkpoint_dir: str | os.PathLike) -> None:
        path = os.path.abspath(os.fspath(checkpoint_dir))
        if not os.path.lexists(path):
            backups = [b for b in backup_candidates(path) if check_is_distributed_checkpoint(b)]
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

    def __enter__(self) -> CheckpointReader:
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
