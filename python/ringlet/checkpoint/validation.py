"""How ``load`` treats keys that do not match between a request and a checkpoint.

Two kinds of mismatch exist. An *unexpected* key is requested by the state dict
passed to ``load`` (on this rank) but absent from the checkpoint. A *missing*
key is stored in the checkpoint but requested by no rank; finding those needs
the requests of all ranks, hence a collective exchange.

On save, the records of all ranks are checked to cover every global tensor and
every ShardedObject grid exactly once (``validate_access_integrity``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from enum import Enum
from typing import Any

from . import _geometry as geo
from .core import CheckpointingException

__all__ = ["StrictHandling", "parse_strict_flag"]

logger = logging.getLogger(__name__)


class StrictHandling(Enum):
    """Policy of ``load`` for missing and unexpected keys.

    Members:
        ASSUME_OK_UNEXPECTED: no check beforehand; a requested key absent from the
            checkpoint fails while loading (the default, and the cheapest).
        LOG_UNEXPECTED: log unexpected keys as warnings, skip them; missing keys are ignored.
        LOG_ALL: log unexpected and missing keys, skip the unexpected ones.
        RAISE_UNEXPECTED: raise ``CheckpointingException`` before loading if a key is unexpected.
        RAISE_ALL: raise ``CheckpointingException`` before loading on any mismatch.
        RETURN_UNEXPECTED: skip unexpected keys and return them: ``load`` gives
            ``(state_dict, missing_keys, unexpected_keys)`` with ``missing_keys`` empty.
        RETURN_ALL: like RETURN_UNEXPECTED, and missing keys are computed and returned too.
        IGNORE_ALL: skip unexpected keys silently.

    Example:
        >>> from ringlet.checkpoint import StrictHandling
        >>> StrictHandling("raise_all") is StrictHandling.RAISE_ALL
        True
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: StrictHandling) -> bool:
        """Whether ``val`` compares requested keys with the checkpoint before loading.

        Args:
            val: the policy.

        Returns:
            False only for ASSUME_OK_UNEXPECTED.

        Example:
            >>> from ringlet.checkpoint import StrictHandling
            >>> StrictHandling.requires_explicit_ckpt_mismatch_check(StrictHandling.LOG_ALL)
            True
        """
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: StrictHandling) -> bool:
        """Whether ``val`` needs the requests of all ranks (to find missing keys).

        Args:
            val: the policy.

        Returns:
            True for LOG_ALL, RAISE_ALL and RETURN_ALL.

        Example:
            >>> from ringlet.checkpoint import StrictHandling
            >>> StrictHandling.requires_global_app_metadata(StrictHandling.RAISE_UNEXPECTED)
            False
        """
        return val in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        """Whether ``load`` returns ``(state_dict, missing_keys, unexpected_keys)`` under ``val``.

        Args:
            val: the policy.

        Returns:
            True for RETURN_UNEXPECTED and RETURN_ALL.

        Example:
            >>> from ringlet.checkpoint import StrictHandling
            >>> StrictHandling.requires_returning_mismatch_keys(StrictHandling.RETURN_ALL)
            True
        """
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: str | StrictHandling) -> StrictHandling:
    """Turn a ``StrictHandling`` member or its name (``"raise_all"``, ``"RAISE_ALL"``) into one.

    Args:
        strict: the member or its value/name.

    Returns:
        The StrictHandling member. Raises ``ValueError`` for anything else.

    Example:
        >>> from ringlet.checkpoint import parse_strict_flag
        >>> parse_strict_flag("log_unexpected")
        <StrictHandling.LOG_UNEXPECTED: 'log_unexpected'>
    """
    if isinstance(strict, StrictHandling):
        return strict
    if isinstance(strict, str):
        try:
            return StrictHandling(strict)
        except ValueError:
            if strict in StrictHandling.__members__:
                return StrictHandling[strict]
    choices = ", ".join(m.value for m in StrictHandling)
    raise ValueError(
        f"invalid strict flag {strict!r}; expected a StrictHandling or one of: {choices}"
    )


def format_mismatch(missing_keys: Iterable[str], unexpected_keys: Iterable[str]) -> str:
    """Human-readable list of mismatched keys."""
    parts = []
    unexpected = sorted(unexpected_keys)
    missing = sorted(missing_keys)
    if unexpected:
        parts.append(f"requested but not in the checkpoint (unexpected): {unexpected}")
    if missing:
        parts.append(f"in the checkpoint but requested by no rank (missing): {missing}")
    return "; ".join(parts)


def report_mismatch(missing_keys: set[str], unexpected_keys: set[str], raise_error: bool) -> None:
    """Raise or log (as a warning) the mismatched keys; nothing when there are none."""
    if not missing_keys and not unexpected_keys:
        return
    message = "checkpoint key mismatch: " + format_mismatch(missing_keys, unexpected_keys)
    if raise_error:
        raise CheckpointingException(message)
    logger.warning(message)


def validate_tensor_coverage(key: str, entry: dict[str, Any]) -> None:
    """Check that the main replicas of tensor ``key`` (its index entry) tile it exactly once.

    Raises ``CheckpointingException`` naming the shard that lies outside the global
    shape, the two shards that overlap, or the number of elements left uncovered.
    """
    global_shape = tuple(entry["global_shape"])
    origin = (0,) * len(global_shape)
    boxes: list[tuple[geo.Index, geo.Index]] = []
    owners: list[dict[str, Any]] = []
    total = 0
    for shard in entry["shards"]:
        for piece in geo.shard_pieces(shard):
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


def validate_object_coverage(objects: dict[str, dict[str, Any]]) -> None:
    """Check that the saved cells of every ShardedObject key fill its grid exactly once.

    ``objects`` maps unique keys to index records; raises ``CheckpointingException``
    when ranks disagree on a grid, an offset lies outside it, or cells are missing.
    """
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
