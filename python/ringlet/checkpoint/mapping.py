"""Describing how local tensors and objects map onto global ones.

A training job usually holds only a piece of each parameter or optimizer state.
Wrapping the local piece in a :class:`ShardedTensor` records where it sits in
the global tensor (offsets, global shape, replication), so that a checkpoint can
be written by every process in parallel and read back with a different layout.
:class:`ShardedTensor.from_rank_offsets` is the usual way to build one.

The same idea applies to arbitrary Python objects (:class:`ShardedObject`),
values that must not be stored at all (:class:`LocalNonpersistentObject`) and
tensors that are transformed around serialisation (:class:`ShardedTensorFactory`).
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import numpy as np
import torch

from .core import CheckpointingException

__all__ = [
    "CommonStateDict",
    "FactoryBuildFn",
    "FactoryMergeFn",
    "LocalNonpersistentObject",
    "ReplicaId",
    "ShardedBase",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StateDict",
    "apply_factories",
    "apply_factory_merges",
    "is_main_replica",
]

logger = logging.getLogger(__name__)

#: A (possibly nested) dict of plain values: what ``load`` returns.
StateDict = dict[str, Any]
#: The part of a state dict that is not sharded; stored once, by rank 0.
CommonStateDict = dict[str, Any]
#: A (possibly nested) dict whose leaves may be ``ShardedBase`` instances.
ShardedStateDict = dict[str, Any]
#: Replication index of a local piece: ``0`` or a tuple of zeros marks the main replica.
ReplicaId = Union[int, tuple[int, ...]]
#: Deprecation warnings already logged (message -> True), so each is logged
#: once per process, as in Megatron.
_logged_deprecations: dict[str, bool] = {}


def _as_int_tuple(value: Any, what: str, owner: str) -> tuple[int, ...]:
    """Normalise a shape-like value (list, tuple, ``torch.Size``) to a tuple of ints."""
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError) as err:
        raise CheckpointingException(
            f"{what} of {owner} must be a sequence of ints, got {value!r}"
        ) from err


def _prod(values: tuple[int, ...]) -> int:
    return math.prod(values) if values else 1


class ShardedBase(ABC):
    """Common interface of everything that can stand for a piece of a global entity.

    Subclasses carry a global ``key``, the local ``data`` (``None`` when only the
    metadata matters) and a ``replica_id`` telling whether this process holds the
    copy that is written to disk.

    Example:
        >>> import torch
        >>> from ringlet.checkpoint import ShardedBase, ShardedTensor
        >>> isinstance(ShardedTensor.from_rank_offsets("w", torch.zeros(2)), ShardedBase)
        True
    """

    key: str
    data: object
    replica_id: ReplicaId

    @abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Check that the metadata attributes agree with one another.

        Returns:
            None. Raises ``CheckpointingException`` when they do not.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor
            >>> ShardedTensor.from_rank_offsets("w", torch.zeros(2)).validate_metadata_integrity()
        """

    @abstractmethod
    def without_data(self) -> ShardedBase:
        """Return a copy of this instance whose ``data`` is ``None``.

        Returns:
            A new instance of the same class with identical metadata and no data.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor
            >>> ShardedTensor.from_rank_offsets("w", torch.zeros(2)).without_data().data is None
            True
        """



class _MergeError(CheckpointingException, ValueError):
    """A state dict that does not fit the factories merging into it (also a
    ValueError, as Megatron raises)."""


class _FactoryArgumentError(CheckpointingException, ValueError):
    """A constructor argument the factory does not accept (also a ValueError,
    as Megatron raises)."""


class _OffGridError(CheckpointingException, AssertionError):
    """A piece whose offset is off its chunk grid (also an AssertionError, as
    Megatron asserts it)."""

@dataclass
class ShardedTensor(ShardedBase):
    """A local tensor together with its place in a global tensor.

    The global tensor is the union of local tensors held by many processes. Each
    local tensor is a box of the global one, optionally restricted to a
    contiguous range of its row-major flattening (``flattened_range``), which is
    how distributed optimizers store their state.

    Args:
        key: name of the global tensor, shared by all its pieces.
        data: the local tensor; ``None`` is allowed for metadata-only instances.
        dtype: element type of the tensor.
        local_shape: shape of the local box (before flattening, without prepended axes).
        global_shape: shape of the whole global tensor.
        global_offset: where the local box starts in the global tensor, in elements,
            one entry per global axis (prepended axes included).
        axis_fragmentations: number of equal chunks along each global axis when the
            tensor is split on a regular grid; ``None`` otherwise.
        replica_id: replication index of this piece; only the main replica (see
            :func:`is_main_replica`) is written.
        prepend_axis_num: number of leading global axes that the local tensor lacks,
            as if it had been unsqueezed that many times.
        allow_shape_mismatch: when loading, accept a stored tensor whose global shape
            differs from ``global_shape`` (missing elements are zero, extra ones dropped).
        flattened_range: ``slice(start, stop)`` of the flattened local box that ``data``
            holds; ``data`` is then 1-D with ``stop - start`` elements.

    Example:
        >>> import torch
        >>> from ringlet.checkpoint import ShardedTensor
        >>> sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 1, 4))
        >>> sh.global_shape, sh.global_offset
        ((8, 3), (2, 0))
    """

    key: str
    data: torch.Tensor | None = field(repr=False)
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        owner = f"ShardedTensor(key={self.key!r})"
        self.local_shape = _as_int_tuple(self.local_shape, "local_shape", owner)
        self.global_shape = _as_int_tuple(self.global_shape, "global_shape", owner)
        self.global_offset = _as_int_tuple(self.global_offset, "global_offset", owner)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = _as_int_tuple(
                self.axis_fragmentations, "axis_fragmentations", owner
            )
        if isinstance(self.replica_id, list):
            self.replica_id = tuple(self.replica_id)
        self.validate_metadata_integrity()

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key={self.key!r})"

    def validate_metadata_integrity(self) -> None:
        """Check that shapes, offsets, dtype, data and flattened range agree.

        The constraints are: global offset and global shape have the same number
        of axes, which is the number of local axes plus ``prepend_axis_num``; every
        local axis offset is a multiple of the local size along it (pieces sit on
        the chunk grid); ``data`` (when present) has ``dtype`` and ``local_shape``,
        or, for a flattened tensor, is 1-D with exactly ``stop - start`` elements;
        a flattened range has no step and lies inside the local box. The
        constructors :meth:`from_rank_offsets` and :meth:`from_rank_offsets_flat`
        always produce instances that satisfy them.

        Returns:
            None. Raises ``CheckpointingException`` naming the key on a violation.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor
            >>> sh = ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, 1, 2))
            >>> sh.validate_metadata_integrity()
        """
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"{self}: global_offset {self.global_offset} and global_shape {self.global_shape} "
                "have a different number of axes"
            )
        if self.prepend_axis_num < 0 or len(self.local_shape) + self.prepend_axis_num != len(
            self.global_shape
        ):
            raise CheckpointingException(
                f"{self}: local_shape {self.local_shape} plus "
                f"prepend_axis_num={self.prepend_axis_num} "
                f"does not give the number of axes of global_shape {self.global_shape}"
            )
        if self.axis_fragmentations is not None and len(self.axis_fragmentations) != len(
            self.global_shape
        ):
            raise CheckpointingException(
                f"{self}: axis_fragmentations {self.axis_fragmentations} and global_shape "
                f"{self.global_shape} have a different number of axes"
            )
        for axis, (off, size) in enumerate(
            zip(self.global_offset[self.prepend_axis_num :], self.local_shape)
        ):
            # Only a tensor that declares a chunk grid must sit on it; without
            # axis_fragmentations any box is allowed (as in Megatron), and an
            # empty local piece (size 0) may sit anywhere.
            if self.axis_fragmentations is not None and size != 0 and off % size != 0:
                raise CheckpointingException(
                    f"{self}: global offset {off} along axis {axis + self.prepend_axis_num} is "
                    "not a "
                    f"multiple of the local size {size}; the piece is not on the chunk grid"
                )
        if self.flattened_range is not None:
            rng = self.flattened_range
            if not isinstance(rng, slice):
                raise CheckpointingException(
                    f"{self}: flattened_range must be a slice, got {rng!r}"
                )
            if rng.step is not None:
                raise CheckpointingException(
                    f"{self}: a flattened range with a step ({rng}) is not supported"
                )
            if rng.start is None or rng.stop is None:
                raise CheckpointingException(
                    f"{self}: flattened range {rng} needs explicit start and stop"
                )
            if not 0 <= rng.start <= rng.stop <= _prod(self.local_shape):
                raise CheckpointingException(
                    f"{self}: flattened range {rng} does not lie within the "
                    f"{_prod(self.local_shape)} "
                    f"elements of local_shape {self.local_shape}"
                )
        if self.data is not None:
            if not isinstance(self.data, torch.Tensor):
                raise CheckpointingException(
                    f"{self}: data must be a torch.Tensor, got {type(self.data).__name__}"
                )
            if self.data.dtype != self.dtype:
                raise CheckpointingException(
                    f"{self}: data dtype {self.data.dtype} does not match dtype {self.dtype}"
                )
            if self.flattened_range is None:
                if tuple(self.data.shape) != self.local_shape:
                    raise CheckpointingException(
                        f"{self}: data shape {tuple(self.data.shape)} does not match local_shape "
                        f"{self.local_shape}"
                    )
            else:
                if self.data.ndim != 1:
                    raise CheckpointingException(
                        f"{self}: data of a flattened tensor must be 1-D, got shape "
                        f"{tuple(self.data.shape)}"
                    )
                expected = self.flattened_range.stop - self.flattened_range.start
                if self.data.numel() != expected:
                    raise CheckpointingException(
                        f"{self}: flattened range {self.flattened_range} has length {expected} "
                        f"but data has {self.data.numel()} elements"
                    )

    @property
    def has_regular_grid(self) -> bool:
        """Whether the global tensor is split on a regular grid (``axis_fragmentations`` is set).

        Returns:
            True when ``axis_fragmentations`` is not ``None``.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor
            >>> ShardedTensor.from_rank_offsets("w", torch.zeros(2)).has_regular_grid
            True
        """
        return self.axis_fragmentations is not None

    def global_slice(self) -> tuple[int | slice, ...]:
        """Index of the global tensor covered by this piece.

        Prepended axes give a plain int (the piece has size 1 there), the other
        axes a ``slice(offset, offset + local_size)``.

        Returns:
            A tuple with one int or slice per global axis.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor
            >>> sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 5, 6), (1, 1, 2),
            ...                                      (2, 1, 3), prepend_axis_num=1)
            >>> sh.global_slice()
            (5, slice(2, 4, None), slice(3, 6, None))
        """
        p = self.prepend_axis_num
        head: tuple[int | slice, ...] = tuple(self.global_offset[:p])
        tail = tuple(
            slice(off, off + size) for off, size in zip(self.global_offset[p:], self.local_shape)
        )
        return head + tail

    def _require_flattened(self, method: str) -> None:
        if self.flattened_range is None:
            raise CheckpointingException(
                f"`{method}` is undefined for {type(self).__name__} without `flattened_range`"
            )

    def local_coordinates(self) -> tuple[np.ndarray, ...]:
        """Local indices of the elements a flattened piece holds.

        Returns:
            One array per local axis (as ``np.nonzero``): the coordinates,
            within ``local_shape``, of the elements in ``flattened_range``.

        Raises:
            CheckpointingException: when the piece has no ``flattened_range``.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor
            >>> sh = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(3), (2, 3), (0, 1, 2),
            ...                                           flattened_range=slice(2, 5))
            >>> [c.tolist() for c in sh.local_coordinates()]
            [[0, 1, 1], [2, 0, 1]]
        """
        self._require_flattened("local_coordinates")
        mask = np.zeros(_prod(tuple(self.local_shape)), dtype=bool)
        mask[self.flattened_range] = True
        return tuple(np.nonzero(mask.reshape(tuple(self.local_shape))))

    def global_coordinates(self) -> tuple[Any, ...]:
        """Global indices of the elements a flattened piece holds.

        Returns:
            One entry per global axis: :meth:`local_coordinates` shifted by
            ``global_offset``; a prepended axis gives its offset (an int).

        Raises:
            CheckpointingException: as :meth:`local_coordinates` does.

        Example:
            :meth:`local_coordinates`'s piece, as rank 5 of 6 along a prepended axis:

            >>> sh = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(3), (2, 3), (0, 5, 6),
            ...                                           (1, 1, 2), flattened_range=slice(2, 5),
            ...                                           prepend_axis_num=1)
            >>> sh.global_coordinates()
            (5, array([2, 3, 3]), array([2, 0, 1]))
        """
        self._require_flattened("global_coordinates")
        local = self.local_coordinates()
        return tuple(
            c + off
            for c, off in zip((0,) * self.prepend_axis_num + local, self.global_offset)
        )

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """Position of this piece in the global grid of chunks.

        Prepended axes keep their element offset; every other axis gives
        ``offset // local_size``.

        Returns:
            The chunk index of this piece along every global axis.

        Raises:
            CheckpointingException: (also an AssertionError, as Megatron
                asserts) when an offset is not a multiple of the local size.

        Example:
            :meth:`global_slice`'s piece (global offset ``(5, 2, 3)``, local
            shape ``(2, 3)``, one prepended axis):

            >>> sh.local_chunk_offset_in_global()
            (5, 1, 1)
        """
        p = self.prepend_axis_num
        chunks = list(self.global_offset[:p])
        for off, size in zip(self.global_offset[p:], self.local_shape):
            if size == 0:
                chunks.append(0)
                continue
            if off % size != 0:
                raise _OffGridError(f"{self}: offset {off} is not a multiple of local size {size}")
            chunks.append(off // size)
        return tuple(chunks)

    def max_allowed_chunks(self) -> tuple[int, ...]:
        """Size of one chunk along every axis of the regular grid.

        Each entry is ``global_shape[i] // axis_fragmentations[i]``.

        Returns:
            One chunk size per global axis.

        Raises:
            CheckpointingException: when the piece has no ``axis_fragmentations``,
                or (unless ``allow_shape_mismatch``) an axis does not divide evenly.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor
            >>> sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 0, 4))
            >>> sh.max_allowed_chunks()
            (2, 3)
        """
        if self.axis_fragmentations is None:
            raise CheckpointingException(
                f"{self}: max_allowed_chunks needs a regular grid (axis_fragmentations)"
            )
        chunks = []
        for axis_size, fragm in zip(self.global_shape, self.axis_fragmentations):
            if not self.allow_shape_mismatch and axis_size % fragm != 0:
                raise CheckpointingException(
                    f"{self}: axis size {axis_size} is not divisible by the axis fragmentation "
                    f"{fragm}"
                )
            chunks.append(axis_size // fragm)
        return tuple(chunks)

    def without_data(self) -> ShardedTensor:
        """Return a copy with ``data=None`` and the same metadata.

        Returns:
            A new ``ShardedTensor`` without data.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor
            >>> ShardedTensor.from_rank_offsets("w", torch.zeros(2)).without_data().local_shape
            (2,)
        """
        return replace(self, data=None)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """Build a ShardedTensor from the position of this process in a grid of chunks.

        Each ``(axis, axis_rank_offset, axis_fragm)`` says: cut the global tensor
        into ``axis_fragm`` equal chunks along global axis ``axis``; ``data`` is the
        chunk number ``axis_rank_offset``. Axes not mentioned are not split. Axes
        below ``prepend_axis_num`` do not exist in ``data`` and have local size 1.

        Args:
            key: name of the global tensor.
            data: the local chunk.
            *rank_offsets: ``(axis, axis_rank_offset, axis_fragm)`` triples, at most one per axis.
            replica_id: see :class:`ShardedTensor`.
            prepend_axis_num: see :class:`ShardedTensor`.
            flattened_range: must stay ``None``; use :meth:`from_rank_offsets_flat` instead.
            **init_kwargs: other ``ShardedTensor`` fields (e.g. ``allow_shape_mismatch``).

        Returns:
            The ShardedTensor; global shape is local size times fragmentation on every axis.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor
            >>> sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (1, 2, 3))
            >>> sh.global_shape, sh.global_offset, sh.axis_fragmentations
            ((2, 9), (0, 6), (1, 3))
        """
        if flattened_range is not None:
            raise _FactoryArgumentError(
                f"ShardedTensor(key={key!r}): from_rank_offsets builds non-flat tensors only; "
                "use from_rank_offsets_flat for a flattened range"
            )
        ndim = data.ndim + prepend_axis_num
        global_offset = [0] * ndim
        global_shape = [1] * prepend_axis_num + list(data.shape)
        axis_fragmentations = [1] * ndim
        seen_axes = set()
        for entry in rank_offsets:
            if len(entry) != 3:
                raise CheckpointingException(
                    f"Invalid rank offsets {rank_offsets} for key {key!r}: each entry must be "
                    "(axis, offset, fragm)"
                )
            axis, axis_rank_offset, axis_fragm = (int(v) for v in entry)
            if (
                not (0 <= axis < ndim)
                or axis_rank_offset < 0
                or axis_fragm < 1
                or axis_rank_offset >= axis_fragm
            ):
                raise CheckpointingException(f"Invalid rank offsets {rank_offsets} for key {key!r}")
            if axis in seen_axes:
                raise CheckpointingException(
                    f"Invalid rank offsets {rank_offsets} for key {key!r}: axis {axis} given twice"
                )
            seen_axes.add(axis)
            local_size = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = axis_fragm * local_size
            global_offset[axis] = axis_rank_offset * local_size
            axis_fragmentations[axis] = axis_fragm
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(axis_fragmentations),
            replica_id,
            prepend_axis_num,
            flattened_range=None,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: tuple[int, ...],
        *rank_offsets: tuple[int, int, int],
        flattened_range: slice | None = None,
        **kwargs: Any,
    ) -> ShardedTensor:
        """Build a flattened ShardedTensor: a contiguous range of a flattened local chunk.

        The chunk grid is given exactly as in :meth:`from_rank_offsets`, but for a
        chunk of shape ``non_flat_local_shape``; ``data`` holds only the elements
        ``flattened_range`` of that chunk in row-major order.

        Args:
            key: name of the global tensor.
            data: 1-D tensor with ``flattened_range.stop - flattened_range.start`` elements.
            non_flat_local_shape: shape of the whole local chunk.
            *rank_offsets: ``(axis, axis_rank_offset, axis_fragm)`` triples.
            flattened_range: ``slice(start, stop)`` without step; required.
            **kwargs: passed to :meth:`from_rank_offsets` (``replica_id``,
                ``prepend_axis_num``, ...).

        Returns:
            The flattened ShardedTensor.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor
            >>> sh = ShardedTensor.from_rank_offsets_flat("w", torch.zeros(4), (2, 3), (0, 1, 2),
            ...                                           flattened_range=slice(2, 6))
            >>> sh.local_shape, sh.global_shape, sh.global_offset
            ((2, 3), (4, 3), (2, 0))
        """
        if flattened_range is None:
            raise CheckpointingException(
                f"ShardedTensor(key={key!r}): from_rank_offsets_flat needs a flattened_range; "
                "use from_rank_offsets for non-flat tensors"
            )
        if data.ndim != 1:
            raise CheckpointingException(
                f"ShardedTensor(key={key!r}): a flattened tensor needs 1-D data, got shape "
                f"{tuple(data.shape)}"
            )
        if flattened_range.step is not None:
            raise CheckpointingException(
                f"ShardedTensor(key={key!r}): a flattened range with a step ({flattened_range}) "
                "is not supported"
            )
        if flattened_range.stop - flattened_range.start != data.numel():
            raise CheckpointingException(
                f"ShardedTensor(key={key!r}): data has {data.numel()} elements but the flattened "
                "range "
                f"{flattened_range} has length {flattened_range.stop - flattened_range.start}"
            )
        meta = torch.empty(tuple(non_flat_local_shape), dtype=data.dtype, device="meta")
        template = cls.from_rank_offsets(key, meta, *rank_offsets, **kwargs)
        return replace(template, data=data, flattened_range=flattened_range)

    def init_data(
        self, device: str | torch.device, init_fn: Callable[..., torch.Tensor] = torch.empty
    ) -> None:
        """Allocate ``data`` when it is ``None``; does nothing otherwise.

        Args:
            device: device for the new tensor.
            init_fn: allocator called as ``init_fn(local_shape, dtype=..., device=...)``;
                ``torch.empty`` by default. A flattened tensor keeps only its range.

        Returns:
            None; ``self.data`` is set.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor
            >>> sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 2)).without_data()
            >>> sh.init_data("cpu", torch.ones)
            >>> sh.data.sum().item()
            4.0
        """
        if self.data is not None:
            return
        data = init_fn(self.local_shape, dtype=self.dtype, device=device)
        if self.flattened_range is not None:
            data = data.flatten()[self.flattened_range.start : self.flattened_range.stop]
        self.data = data

    def narrow(self, dim: int, start: int, length: int) -> list[ShardedTensor]:
        """Sharded counterpart of ``torch.narrow``: every process narrows its own piece.

        Narrowing the local piece to ``length`` of its ``n`` elements along ``dim``
        scales the global size and offset along that axis by ``length / n``. For a
        flattened tensor only ``dim == 0`` is supported; the result keeps the part
        of the flattened range that falls into the narrowed block, which may be
        nothing.

        Args:
            dim: local axis to narrow (prepended axes are not counted).
            start: first kept element along ``dim``.
            length: number of kept elements.

        Returns:
            A list with one ShardedTensor for a regular tensor; for a flattened one
            a list with zero or one element.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor
            >>> sh = ShardedTensor.from_rank_offsets("w", torch.arange(8.).view(4, 2), (0, 1, 2))
            >>> [n] = sh.narrow(0, 1, 2)
            >>> n.local_shape, n.global_shape, n.global_offset
            ((2, 2), (4, 2), (2, 0))
        """
        if not 0 <= dim < len(self.local_shape):
            raise CheckpointingException(
                f"{self}: cannot narrow axis {dim} of local shape {self.local_shape}"
            )
        local_size = self.local_shape[dim]
        if start < 0 or length < 0 or start + length > local_size:
            raise CheckpointingException(
                f"{self}: narrow({dim}, {start}, {length}) is out of bounds for local size "
                f"{local_size}"
            )
        axis = dim + self.prepend_axis_num
        if (
            local_size == 0
            or self.global_shape[axis] % local_size
            or self.global_offset[axis] % local_size
        ):
            raise CheckpointingException(
                f"{self}: narrowing needs a regular grid of local pieces along axis {axis}"
            )

        def with_axis(values: tuple[int, ...], new: int) -> tuple[int, ...]:
            out = list(values)
            out[axis] = new
            return tuple(out)

        global_shape = with_axis(self.global_shape, self.global_shape[axis] // local_size * length)
        global_offset = with_axis(
            self.global_offset, self.global_offset[axis] // local_size * length
        )
        local_shape = list(self.local_shape)
        local_shape[dim] = length

        def narrowed(data: Optional[torch.Tensor], **extra: Any) -> ShardedTensor:
            """This piece with the narrowed shapes and offset, holding ``data``."""
            return replace(
                self,
                data=data,
                local_shape=tuple(local_shape),
                global_shape=global_shape,
                global_offset=global_offset,
                **extra,
            )

        if self.flattened_range is None:
            return [narrowed(None if self.data is None else self.data.narrow(dim, start, length))]

        if dim != 0:
            raise CheckpointingException(
                f"{self}: a flattened tensor can only be narrowed along axis 0"
            )
        row = _prod(self.local_shape[1:])
        keep_start, keep_stop = start * row, (start + length) * row
        lo = max(self.flattened_range.start, keep_start)
        hi = min(self.flattened_range.stop, keep_stop)
        if hi <= lo:
            return []
        data = None
        if self.data is not None:
            data = self.data[lo - self.flattened_range.start : hi - self.flattened_range.start]
        return [narrowed(data, flattened_range=slice(lo - keep_start, hi - keep_start))]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """Tell whether ``replica_id`` designates the main replica, the one that is written.

    The main replica is the integer ``0`` or a sequence whose entries are all
    ``0``. Setting replica ids consistently across processes is up to the caller.

    Args:
        replica_id: an int or a tuple of ints.

    Returns:
        True for a main replica.

    Example:
        >>> from ringlet.checkpoint import is_main_replica
        >>> is_main_replica(0), is_main_replica((0, 0)), is_main_replica((0, 1))
        (True, True, False)
    """
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class LocalNonpersistentObject:
    """Wrapper for a value that is kept out of the checkpoint and restored locally.

    When saving, a wrapped value is skipped; when loading, the wrapped value of
    the state dict passed to ``load`` is placed in the result as is.

    Args:
        obj: the value to keep local.

    Example:
        >>> from ringlet.checkpoint import LocalNonpersistentObject
        >>> LocalNonpersistentObject({"seed": 3}).unwrap()
        {'seed': 3}
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        """Return the wrapped value.

        Returns:
            The object given to the constructor.

        Example:
            >>> from ringlet.checkpoint import LocalNonpersistentObject
            >>> LocalNonpersistentObject(5).unwrap()
            5
        """
        return self.obj

    def __repr__(self) -> str:
        return f"LocalNonpersistentObject({self.obj!r})"


@dataclass
class ShardedObject(ShardedBase):
    """A local Python object together with its place in a grid of objects.

    Think of it as a ShardedTensor whose elements are whole objects: each process
    owns the cell at ``global_offset`` (counted in cells) of a grid of shape
    ``global_shape``. Unlike a ShardedTensor, the grid cannot change between save
    and load; each cell is found again by :attr:`unique_key`.

    Args:
        key: name of the global object.
        data: the local object; ``None`` for metadata-only instances.
        global_shape: shape of the grid of objects.
        global_offset: cell of this object in the grid.
        replica_id: replication index; only the main replica is written.

    Example:
        >>> from ringlet.checkpoint import ShardedObject
        >>> ShardedObject("rng", {"seed": 1}, (2, 4), (1, 3)).unique_key
        'rng/shard_1.3_2.4'
    """

    key: str
    data: object
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        owner = f"ShardedObject(key={self.key!r})"
        self.global_shape = _as_int_tuple(self.global_shape, "global_shape", owner)
        self.global_offset = _as_int_tuple(self.global_offset, "global_offset", owner)
        if isinstance(self.replica_id, list):
            self.replica_id = tuple(self.replica_id)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Check that global shape and global offset have the same number of axes.

        Returns:
            None. Raises ``CheckpointingException`` otherwise.

        Example:
            >>> from ringlet.checkpoint import ShardedObject
            >>> ShardedObject("o", 1, (2,), (0,)).validate_metadata_integrity()
        """
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(
                f"{self}: global_offset {self.global_offset} and global_shape {self.global_shape} "
                "have a different number of axes"
            )

    def without_data(self) -> ShardedObject:
        """Return a copy with ``data=None``.

        Returns:
            A new ShardedObject with the same metadata.

        Example:
            >>> from ringlet.checkpoint import ShardedObject
            >>> ShardedObject("o", 1, (2,), (0,)).without_data().data is None
            True
        """
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """Key of this cell: ``<key>/shard_<offsets>_<shape>`` with dot-separated numbers.

        Returns:
            The unique key string.

        Example:
            >>> from ringlet.checkpoint import ShardedObject
            >>> ShardedObject("opt/state", None, (4,), (2,)).unique_key
            'opt/state/shard_2_4'
        """
        offsets = ".".join(str(v) for v in self.global_offset)
        shape = ".".join(str(v) for v in self.global_shape)
        return f"{self.key}/shard_{offsets}_{shape}"

    def __str__(self) -> str:
        return f"{self.__class__.__name__}(key={self.key!r})"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """Rebuild a data-less ShardedObject from its :attr:`unique_key`.

        Args:
            unique_key: a string ``<key>/shard_<offsets>_<shape>``; ``key`` may itself
                contain ``/``.
            replica_id: replica id of the new instance.

        Returns:
            A ShardedObject with ``data=None``.

        Example:
            >>> from ringlet.checkpoint import ShardedObject
            >>> o = ShardedObject.empty_from_unique_key("rng/shard_1.3_2.4")
            >>> o.key, o.global_offset, o.global_shape
            ('rng', (1, 3), (2, 4))
        """
        key, sep, shard = unique_key.rpartition("/")
        parts = shard.split("_")
        if not sep or not key or len(parts) != 3 or parts[0] != "shard":
            raise CheckpointingException(f"{unique_key!r} is not a ShardedObject unique key")
        try:
            offset = tuple(int(v) for v in parts[1].split(".")) if parts[1] else ()
            shape = tuple(int(v) for v in parts[2].split(".")) if parts[2] else ()
        except ValueError as err:
            raise CheckpointingException(
                f"{unique_key!r} is not a ShardedObject unique key"
            ) from err
        if len(shape) + 1 == len(offset):
            # Keys written without the last global dimension: it is unknown.
            shape += (-1,)
        return cls(key, None, shape, offset, replica_id)


#: ``build_fn(key, data, replica_id, flattened_range)`` returning a sharded sub-state-dict.
FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, Optional[slice]], ShardedStateDict]
#: ``merge_fn(loaded_sub_state_dict)`` returning the original tensor (inverse of the build).
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor that is turned into a sharded sub-state-dict for saving and back after loading.

    ``build_fn(key, data, replica_id, flattened_range)`` produces what is really
    saved (e.g. a fused weight split into its parts); ``merge_fn`` receives the
    loaded sub-state-dict and returns the tensor. Optimizer state can reuse the
    model's factories because the result depends only on those four arguments.

    Args:
        key: name of the factory.
        data: the original tensor.
        build_fn: transformation applied before saving.
        merge_fn: inverse transformation applied after loading.
        replica_id: replication index passed to ``build_fn``.
        flattened_range: flattening applied to the produced tensors, passed to ``build_fn``.

    Example:
        >>> import torch
        >>> from ringlet.checkpoint import ShardedTensor, ShardedTensorFactory
        >>> def build(key, data, replica_id, flattened_range):
        ...     return {"a": ShardedTensor.from_rank_offsets(key + ".a", data[0]),
        ...             "b": ShardedTensor.from_rank_offsets(key + ".b", data[1])}
        >>> def merge(d):
        ...     return torch.stack([d["a"], d["b"]])
        >>> f = ShardedTensorFactory("w", torch.zeros(2, 3), build, merge)
        >>> sorted(f.build())
        ['a', 'b']
    """

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> ShardedStateDict:
        """Run ``build_fn`` on this factory's key, data, replica id and flattened range.

        Returns:
            The sharded sub-state-dict to save in place of this factory.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensor, ShardedTensorFactory
            >>> def build(key, data, replica_id, flattened_range):
            ...     return ShardedTensor.from_rank_offsets(key, data)
            >>> f = ShardedTensorFactory("w", torch.zeros(2), build, lambda x: x)
            >>> f.build().key
            'w'
        """
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """No consistency rule applies to a factory; always passes.

        Returns:
            None.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensorFactory
            >>> ShardedTensorFactory("w", torch.zeros(1), None, None).validate_metadata_integrity()
        """

    def without_data(self) -> ShardedTensorFactory:
        """Return a copy with ``data=None``.

        Returns:
            A new ShardedTensorFactory with the same functions.

        Example:
            >>> import torch
            >>> from ringlet.checkpoint import ShardedTensorFactory
            >>> ShardedTensorFactory("w", torch.zeros(1), None, None).without_data().data is None
            True
        """
        return replace(self, data=None)


def _map_leaves_inplace(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Apply ``fn`` to every non-container leaf of nested dicts/lists, in place."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            tree[k] = _map_leaves_inplace(fn, v)
        return tree
    if isinstance(tree, list):
        for i, v in enumerate(tree):
            tree[i] = _map_leaves_inplace(fn, v)
        return tree
    return fn(tree)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every ShardedTensorFactory in the nested dicts/lists by what it builds, in place.

    Args:
        sharded_state_dict: state dict that may contain ``ShardedTensorFactory`` leaves.

    Returns:
        None; the dict is modified in place.

    Example:
        >>> import torch
        >>> from ringlet.checkpoint import ShardedTensor, ShardedTensorFactory, apply_factories
        >>> def build(key, data, replica_id, flattened_range):
        ...     return {"x": ShardedTensor.from_rank_offsets(key, data)}
        >>> sd = {"w": ShardedTensorFactory("w", torch.zeros(2), build, lambda x: x["x"])}
        >>> apply_factories(sd)
        >>> type(sd["w"]["x"]).__name__
        'ShardedTensor'
    """

    def build(value: Any) -> Any:
        return value.build() if isinstance(value, ShardedTensorFactory) else value

    _map_leaves_inplace(build, sharded_state_dict)


def apply_factory_merges(
    x1: StateDict, x2: ShardedStateDict, key: tuple[str, ...] = ()
) -> StateDict:
    """Undo factories after loading: call ``merge_fn`` on the loaded sub-trees, in place.

    ``x2`` holds the factories (in the same positions as in the state dict given
    to ``load``); ``x1`` is the loaded state dict, where each factory position
    holds what its ``build_fn`` produced, now loaded. A dict in ``x2`` may also
    address list positions of ``x1`` by integer key.

    Args:
        x1: the loaded state dict.
        x2: subset of ``x1``'s structure whose leaves are ``ShardedTensorFactory``.
        key: path of the current node, only used in error messages.

    Returns:
        ``x1``, modified in place (or the merged value when ``x2`` is itself a factory).

    Example:
        >>> import torch
        >>> from ringlet.checkpoint import ShardedTensorFactory, apply_factory_merges
        >>> f = ShardedTensorFactory("w", None, None, lambda d: d["a"] + d["b"])
        >>> apply_factory_merges({"w": {"a": 1, "b": 2}, "other": 0}, {"w": f})
        {'w': 3, 'other': 0}
    """
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    where = "/".join(str(k) for k in key) or "<root>"
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise _MergeError(
                    f"apply_factory_merges: key {k!r} at {where} is missing from the loaded "
                    "state dict "
                    f"(loaded keys: {sorted(map(str, x1))})"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key=(*key, k))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise _MergeError(
                f"apply_factory_merges: lists of different lengths ({len(x1)} and {len(x2)}) at "
                f"{where}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key=(*key, i))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not isinstance(k, int):
                raise _MergeError(
                    f"apply_factory_merges: non-integer key {k!r} addresses a list at {where}"
                )
            if not -len(x1) <= k < len(x1):
                raise _MergeError(
                    f"apply_factory_merges: index {k} out of range for a list of length "
                    f"{len(x1)} at {where}"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key=(*key, k))
    else:
        raise _MergeError(
            f"apply_factory_merges: cannot merge {type(x1).__name__} with {type(x2).__name__} at "
            f"{where}"
        )
    return x1
