"""Boxes in global index space, and the boxes making up a flattened range.

Every stored or requested piece of a global tensor is described as a list of
``Piece`` objects: a box (start and shape, in global coordinates, prepended
axes included) whose elements lie contiguously, in row-major order, in the
piece's 1-D data starting at ``offset``. A regular piece is one box with
offset 0. A flattened range ``[a, b)`` of a local box splits into at most
``2 * ndim - 1`` such boxes: partial rows at both ends, whole blocks between.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

Index = tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """A box ``[start, start + shape)`` stored contiguously at ``offset`` of 1-D data."""

    start: Index
    shape: Index
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> Index:
        return tuple(s + n for s, n in zip(self.start, self.shape))


def _flat_boxes(shape: Index, a: int, b: int) -> list[tuple[Index, Index, int]]:
    """Boxes (local start, shape, flat start) covering flat indices ``[a, b)`` of ``shape``."""
    if a >= b:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)
    out: list[tuple[Index, Index, int]] = []

    def nested(row: int, lo: int, hi: int) -> None:
        for st, sh, flat in _flat_boxes(shape[1:], lo, hi):
            out.append(((row, *st), (1, *sh), row * inner + flat))

    if i0 == i1:
        nested(i0, r0, r1)
        return out
    if r0:
        nested(i0, r0, inner)
        i0 += 1
    if i1 > i0:
        out.append(((i0,) + (0,) * (len(shape) - 1), (i1 - i0, *tuple(shape[1:])), i0 * inner))
    if r1:
        nested(i1, 0, r1)
    return out


def pieces(
    global_offset: Sequence[int], box_shape: Sequence[int], flat: tuple[int, int] | None
) -> list[Piece]:
    """Pieces of a local box at ``global_offset``, whole or restricted to flat range ``flat``."""
    offset = tuple(global_offset)
    box = tuple(box_shape)
    if flat is None:
        return [Piece(offset, box, 0)]
    a, b = flat
    return [
        Piece(tuple(o + s for o, s in zip(offset, st)), sh, flat_start - a)
        for st, sh, flat_start in _flat_boxes(box, a, b)
    ]


def shard_pieces(record: dict[str, Any]) -> list[Piece]:
    """Pieces of a stored shard, from its index record (offset, local shape, flat range)."""
    box = (1,) * record["prepend_axis_num"] + tuple(record["local_shape"])
    flat = record["flattened_range"]
    return pieces(record["global_offset"], box, None if flat is None else tuple(flat))


def intersect(
    a_start: Index, a_stop: Index, b_start: Index, b_stop: Index
) -> tuple[Index, Index] | None:
    """Intersection ``(start, stop)`` of two boxes, or None when it is empty."""
    start = tuple(max(x, y) for x, y in zip(a_start, b_start))
    stop = tuple(min(x, y) for x, y in zip(a_stop, b_stop))
    if any(hi <= lo for lo, hi in zip(start, stop)):
        return None
    return start, stop


def volume(start: Index, stop: Index) -> int:
    return math.prod(hi - lo for lo, hi in zip(start, stop))


def find_overlap(boxes: list[tuple[Index, Index]]) -> tuple[int, int] | None:
    """Indices of two overlapping boxes, or None. Sweeps along the most varied axis."""
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    if ndim == 0:
        return (0, 1)
    axis = max(range(ndim), key=lambda d: len({b[0][d] for b in boxes}))
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][axis])
    for pos, i in enumerate(order):
        start_i, stop_i = boxes[i]
        for j in order[pos + 1 :]:
            start_j, stop_j = boxes[j]
            if start_j[axis] >= stop_i[axis]:
                break
            if intersect(start_i, stop_i, start_j, stop_j) is not None:
                return (i, j)
    return None
