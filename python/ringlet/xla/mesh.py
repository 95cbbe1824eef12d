"""SPMD device meshes and the partition-spec algebra.

This module describes *where* the pieces of a tensor live when it is split
over the ranks of a job, following the model of torch_xla's SPMD API:

* a :class:`Mesh` arranges the ranks ``0 .. n-1`` in an N-dimensional grid
  whose axes may carry names;
* a *partition spec* says, for each dimension of a tensor, which mesh axis
  (or ordered tuple of mesh axes) that dimension is split over, or ``None``
  when the dimension is not split;
* :meth:`Mesh.get_op_sharding` turns a partition spec into an
  :class:`OpSharding`: the tile assignment, the group assignment and
  replication groups used for partial replication, and a
  :class:`ShardingType`, computed with the same rules as torch_xla;
* :func:`shard_indices` and friends are the pure helpers that the eager
  sharded-tensor layer builds on: which slice of the global tensor a rank
  holds, how much zero padding its shard carries, and which replica it is.

Nothing here communicates. ``ringlet.world_size()`` and
``ringlet.host_layout()`` are only consulted, lazily, by :func:`get_1d_mesh`
and :class:`HybridMesh`.

Differences from torch_xla worth knowing:

* Every invalid mesh or partition spec raises :class:`ValueError` with a
  message naming the problem. Where torch_xla uses a bare ``assert`` (mesh
  axis names, device ids and size; out-of-range, repeated or nested axes in
  a partition spec; ICI/DCN shape lengths of a :class:`HybridMesh`) the
  error is a :class:`~ringlet.errors.ShardingSpecError`, which is both a
  :class:`ValueError` and an :class:`AssertionError`; an argument
  of the wrong kind altogether (a ``mesh_shape`` that is not a sequence, a
  ``partition_spec`` that is not a tuple or list, a ``host_layout`` that is
  not a list of lists) raises :class:`TypeError`. Partition-spec *entries*
  of an unsupported type raise :class:`ValueError`, as in torch_xla.
* ``get_axis_name_idx`` returns ``None`` on an unnamed mesh instead of
  failing.
* Lists are accepted wherever torch_xla wants a tuple (the partition spec
  itself and the axis groups inside it); an empty axis group ``()`` and a
  mesh with no axes are rejected.
* :class:`ShardingSpec` derives its fields from :meth:`Mesh.get_op_sharding`
  (so it uses the mesh size and the partial-replication rule for meshes with
  more axes than the spec uses); ``xla_spec`` returns that
  :class:`OpSharding` (also as ``op_sharding``) instead of XLA's native spec.
* :class:`HybridMesh` reads the host topology from ``ringlet.host_layout()``
  (or a ``host_layout=`` argument); the ranks of one host are laid out in
  row-major order since there is no physical torus to map onto.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Union

import numpy as np
import torch

from ..core import groups as core_groups
from ..errors import ShardingSpecError

__all__ = [
    "HybridMesh",
    "Mesh",
    "MeshAxis",
    "OpSharding",
    "PartitionSpec",
    "PartitionSpecEntry",
    "ShardIndices",
    "ShardingType",
    "all_shard_indices",
    "assemble_shards",
    "extract_shard",
    "get_1d_mesh",
    "get_global_mesh",
    "normalize_partition_spec",
    "set_global_mesh",
    "shard_indices",
]

#: A mesh axis, given by position or by name.
MeshAxis = Union[int, str]
#: One entry of a partition spec: an axis, an ordered group of axes, or
#: ``None`` for a dimension that is not split.
PartitionSpecEntry = Union[MeshAxis, tuple[MeshAxis, ...], None]
#: A partition spec: one entry per tensor dimension.
PartitionSpec = Sequence[PartitionSpecEntry]

# A validated partition spec: mesh axes resolved to positions.
_NormalizedSpec = tuple[Union[int, tuple[int, ...], None], ...]


def _is_int(value: Any) -> bool:
    """True for Python and numpy integers, but not for booleans."""
    return isinstance(value, (int, np.integer)) and not isinstance(
        value, (bool, np.bool_))


def _as_shape(shape: Any, what: str) -> tuple[int, ...]:
    """Validate a shape-like sequence of positive integers."""
    if isinstance(shape, (str, bytes)) or not isinstance(
            shape, (Sequence, np.ndarray)):
        raise TypeError(
            f"{what} must be a sequence of positive ints, got {shape!r}")
    dims = tuple(shape)
    if not dims:
        raise ValueError(f"{what} must have at least one axis, got {dims!r}")
    for d in dims:
        if not _is_int(d) or int(d) <= 0:
            raise ValueError(
                f"{what} must contain positive ints only, got {dims!r}")
    return tuple(int(d) for d in dims)


class Mesh:
    """A logical grid of ranks that tensors can be sharded over.

    The flat list of rank ids is laid into ``mesh_shape`` in row-major
    (C) order, so the last mesh axis varies fastest. Axes can be named so
    that partition specs may refer to them by name.

    Args:
        device_ids (np.ndarray | Sequence[int]): the ranks of the mesh
            in row-major order. They must be ``0 .. size-1`` in any order;
            a multi-dimensional array is flattened first.
        mesh_shape (Sequence[int]): the size of each mesh axis; the product
            must equal the number of ids.
        axis_names (Optional[Sequence[str]]): one distinct name per mesh
            axis, or None for an unnamed mesh.

    Raises:
        ShardingSpecError: (a ValueError and an AssertionError) when the
            names do not match the mesh rank or repeat, when the number of
            ids differs from the mesh size, or when ids repeat or fall
            outside ``[0, size)``.
        ValueError: when ids are not integers, names are not strings, or
            the shape has no axes or a non-positive size.
        TypeError: when ``mesh_shape`` is not a sequence.

    Example:
        >>> mesh = Mesh(list(range(8)), (4, 2), ("data", "model"))
        >>> mesh.get_logical_mesh().tolist()
        [[0, 1], [2, 3], [4, 5], [6, 7]]
        >>> mesh.shape()
        OrderedDict([('data', 4), ('model', 2)])
    """

    def __init__(self,
                 device_ids: np.ndarray | Sequence[int],
                 mesh_shape: Sequence[int],
                 axis_names: Sequence[str] | None = None) -> None:
        shape = _as_shape(mesh_shape, "mesh_shape")
        ids = np.asarray(device_ids)
        if ids.size > 0 and ids.dtype.kind not in "iu":
            raise ValueError(
                f"device_ids must be integers, got dtype {ids.dtype}")
        ids = ids.reshape(-1).astype(np.int64)

        names: tuple[str, ...] | None = None
        if axis_names is not None:
            if isinstance(axis_names, str):
                raise ValueError(
                    "axis_names must be a sequence of names, not a single "
                    f"string ({axis_names!r}); write ({axis_names!r},)")
            names = tuple(axis_names)
            if not all(isinstance(n, str) for n in names):
                raise ValueError(f"axis names must be strings, got {names!r}")
            if len(names) != len(shape):
                raise ShardingSpecError(
                    f"got {len(names)} axis names {names!r} for a mesh of "
                    f"rank {len(shape)} (mesh_shape={shape})")
            if len(set(names)) != len(names):
                dup = sorted({n for n in names if names.count(n) > 1})
                raise ShardingSpecError(
                    f"axis names must be distinct; {dup} repeated in {names!r}")

        size = math.prod(shape)
        if ids.size != size:
            raise ShardingSpecError(
                f"got {ids.size} device ids but mesh_shape {shape} has "
                f"{size} positions")
        uniq, counts = np.unique(ids, return_counts=True)
        if len(uniq) != len(ids):
            raise ShardingSpecError(
                "device ids must be distinct; repeated: "
                f"{uniq[counts > 1].tolist()}")
        bad = ids[(ids < 0) | (ids >= size)]
        if bad.size:
            raise ShardingSpecError(
                f"device ids must lie in [0, {size}) for a mesh of size "
                f"{size}; out of range: {bad.tolist()}")

        ids.setflags(write=False)
        self._device_ids: np.ndarray = ids
        self._mesh_shape: tuple[int, ...] = shape
        self._axis_names: tuple[str, ...] | None = names
        self._op_sharding_cache: dict[_NormalizedSpec, OpSharding] = {}

    @property
    def device_ids(self) -> np.ndarray:
        """The ranks in row-major order (a read-only int64 array).

        Returns:
            np.ndarray: the flat device ids.

        Example:
            >>> Mesh([1, 0], (2,)).device_ids.tolist()
            [1, 0]
        """
        return self._device_ids

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The size of each mesh axis.

        Returns:
            Tuple[int, ...]: the mesh shape.

        Example:
            >>> Mesh(range(4), (2, 2)).mesh_shape
            (2, 2)
        """
        return self._mesh_shape

    @property
    def axis_names(self) -> tuple[str, ...] | None:
        """The axis names, or None for an unnamed mesh.

        Returns:
            Optional[Tuple[str, ...]]: the names.

        Example:
            >>> Mesh(range(4), (2, 2), ("x", "y")).axis_names
            ('x', 'y')
        """
        return self._axis_names

    def size(self) -> int:
        """Number of ranks in the mesh.

        Returns:
            int: the product of the mesh shape.

        Example:
            >>> Mesh(range(8), (4, 2)).size()
            8
        """
        return math.prod(self._mesh_shape)

    def shape(self) -> OrderedDict[str | int, int]:
        """The mesh axes and their sizes, in axis order.

        Returns:
            OrderedDict: axis name (or axis index for an unnamed mesh) to size.

        Example:
            >>> Mesh(range(8), (4, 2)).shape()
            OrderedDict([(0, 4), (1, 2)])
        """
        keys: Sequence[str | int] = (
            self._axis_names if self._axis_names is not None else range(
                len(self._mesh_shape)))
        return OrderedDict(zip(keys, self._mesh_shape))

    def get_logical_mesh(self) -> np.ndarray:
        """The device ids reshaped, row-major, to the mesh shape.

        Returns:
            np.ndarray: a fresh array of shape ``mesh_shape``.

        Example:
            >>> Mesh([0, 2, 1, 3], (2, 2)).get_logical_mesh().tolist()
            [[0, 2], [1, 3]]
        """
        return self._device_ids.reshape(self._mesh_shape).copy()

    def get_axis_name_idx(self, name: str) -> int | None:
        """Position of the axis called ``name``.

        Args:
            name (str): an axis name.

        Returns:
            Optional[int]: the axis position, or None when the mesh has no
            such axis (or no names at all).

        Example:
            >>> Mesh(range(4), (2, 2), ("x", "y")).get_axis_name_idx("y")
            1
        """
        if self._axis_names is None or name not in self._axis_names:
            return None
        return self._axis_names.index(name)

    def get_op_sharding(self, partition_spec: PartitionSpec) -> OpSharding:
        """Compute the sharding of a tensor laid out by ``partition_spec``.

        The result is cached per mesh and (validated) spec, since the tile
        and group computations grow with the mesh.

        Args:
            partition_spec (PartitionSpec): one entry per tensor dimension:
                a mesh axis (position or name), a tuple of mesh axes (the
                dimension is split over their product, the first axis
                major), or None (not split). An empty spec describes a
                scalar and is always replicated.

        Returns:
            OpSharding: tile assignment, group assignment, replication groups
            and sharding type.

        Raises:
            ValueError: for unknown axis names, nested tuples, empty tuples,
                unsupported entry types, axes out of range, or an axis used
                more than once.
            TypeError: when ``partition_spec`` is not a tuple or list.

        Example:
            >>> mesh = Mesh(range(4), (2, 2), ("x", "y"))
            >>> mesh.get_op_sharding(("x", None))
            {devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}
        """
        if isinstance(partition_spec, (tuple, list)) and len(partition_spec) == 0:
            return OpSharding([], [], [], ShardingType.REPLICATED)
        spec = normalize_partition_spec(self, partition_spec)
        cached = self._op_sharding_cache.get(spec)
        if cached is None:
            cached = _compute_op_sharding(self, spec)
            self._op_sharding_cache[spec] = cached
        return cached

    def _get_op_sharding_args(
        self, partition_spec: PartitionSpec
    ) -> tuple[list[Any], list[Any], list[list[int]], int]:
        """The pieces of :meth:`get_op_sharding` as torch_xla hands them on.

        Args:
            partition_spec (PartitionSpec): one entry per tensor dimension.

        Returns:
            Tuple[List, List, List[List[int]], int]: the tile assignment, the
            group assignment, the replication groups and the sharding type as
            an int.

        Raises:
            ValueError: for an invalid spec (see :meth:`get_op_sharding`).

        Example:
            >>> Mesh(range(4), (2, 2))._get_op_sharding_args((0, None))
            ([[0, 1], [2, 3]], [[0], [1]], [[0, 1], [2, 3]], 5)
        """
        op = self.get_op_sharding(partition_spec)
        return (op.tile_assignment, op.group_assignment, op.replication_groups,
                int(op.sharding_type))

    def axis_index(self, axis: MeshAxis) -> int:
        """Resolve a mesh axis given by position or by name.

        Args:
            axis (MeshAxis): an axis position or an axis name.

        Returns:
            int: the axis position.

        Raises:
            ValueError: when the axis does not exist.

        Example:
            >>> Mesh(range(4), (2, 2), ("x", "y")).axis_index("y")
            1
        """
        if isinstance(axis, str):
            idx = self.get_axis_name_idx(axis)
            if idx is None:
                raise ValueError(
                    f"axis name {axis!r} is not defined in this mesh "
                    f"(axis names: {self._axis_names})")
            return idx
        if _is_int(axis):
            if not 0 <= int(axis) < len(self._mesh_shape):
                raise ValueError(
                    f"mesh axis {int(axis)} is out of range for a mesh of "
                    f"rank {len(self._mesh_shape)}")
            return int(axis)
        raise ValueError(
            f"a mesh axis must be an int or a str, got {type(axis).__name__}")

    def rank_coords(self, rank: int) -> tuple[int, ...]:
        """Coordinates of ``rank`` in the logical mesh.

        Args:
            rank (int): a rank of the mesh.

        Returns:
            Tuple[int, ...]: one coordinate per mesh axis.

        Raises:
            ValueError: when the rank is not in the mesh.

        Example:
            >>> Mesh([0, 2, 1, 3], (2, 2)).rank_coords(2)
            (0, 1)
        """
        where = np.flatnonzero(self._device_ids == rank) if _is_int(
            rank) else np.empty(0)
        if where.size != 1:
            raise ValueError(
                f"rank {rank!r} is not in this mesh (ids 0..{self.size() - 1})")
        return tuple(
            int(c) for c in np.unravel_index(int(where[0]), self._mesh_shape))

    def groups_along(
            self, axis: MeshAxis | Sequence[MeshAxis]) -> list[list[int]]:
        """Replica groups for a collective along one (or several) mesh axes.

        Each group holds the ranks whose coordinates differ only on the
        given axis, ordered by that coordinate; groups are listed in
        row-major order of the remaining coordinates. The result can be
        passed as ``groups=`` to ringlet's collectives. Several axes may be
        given as a tuple: a group then spans their product, the first axis
        major.

        Args:
            axis (MeshAxis | Sequence[MeshAxis]): an axis position or
                name, or a sequence of distinct ones.

        Returns:
            List[List[int]]: the groups, each a list of ranks.

        Raises:
            ValueError: for an unknown or repeated axis.

        Example:
            >>> mesh = Mesh(range(6), (2, 3), ("x", "y"))
            >>> mesh.groups_along("y")
            [[0, 1, 2], [3, 4, 5]]
            >>> mesh.groups_along("x")
            [[0, 3], [1, 4], [2, 5]]
        """
        raw = list(axis) if isinstance(axis, (tuple, list)) else [axis]
        axes = [self.axis_index(a) for a in raw]
        if len(set(axes)) != len(axes):
            raise ValueError(f"mesh axes repeated in {tuple(raw)!r}")
        rest = [a for a in range(len(self._mesh_shape)) if a not in axes]
        width = math.prod(self._mesh_shape[a] for a in axes)
        grid = self.get_logical_mesh().transpose(rest + axes)
        return grid.reshape(-1, width).tolist()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(device_ids={self._device_ids.tolist()}, "
                f"mesh_shape={self._mesh_shape}, axis_names={self._axis_names})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return (self._mesh_shape == other._mesh_shape and
                self._axis_names == other._axis_names and
                bool(np.array_equal(self._device_ids, other._device_ids)))

    def __hash__(self) -> int:
        return hash((self._mesh_shape, self._axis_names,
                     self._device_ids.tobytes()))


_GLOBAL_MESH: Mesh | None = None


def set_global_mesh(mesh: Mesh | None) -> None:
    """Make ``mesh`` the default mesh of this process.

    Args:
        mesh (Optional[Mesh]): the mesh to remember; None forgets it.

    Returns:
        None

    Example:
        >>> set_global_mesh(Mesh([0], (1,), ("data",)))
        >>> get_global_mesh().axis_names
        ('data',)
    """
    global _GLOBAL_MESH
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"expected a Mesh or None, got {type(mesh).__name__}")
    _GLOBAL_MESH = mesh


def get_global_mesh() -> Mesh | None:
    """The default mesh of this process.

    Returns:
        Optional[Mesh]: the mesh given to :func:`set_global_mesh`, or None.

    Example:
        >>> set_global_mesh(None)
        >>> get_global_mesh() is None
        True
    """
    return _GLOBAL_MESH


def get_1d_mesh(axis_name: str | None = None) -> Mesh:
    """A one-axis mesh over every rank of the job, in rank order.

    Args:
        axis_name (Optional[str]): name of the single axis, or None.

    Returns:
        Mesh: ``Mesh(range(world_size), (world_size,), (axis_name,))``.

    Example:
        >>> import ringlet
        >>> mesh = get_1d_mesh("data")
        >>> mesh.mesh_shape == (ringlet.world_size(),), mesh.axis_names
        (True, ('data',))
    """
    world = int(core_groups.world_size())
    names = None if axis_name is None else (axis_name,)
    return Mesh(np.arange(world), (world,), names)


def _validate_host_layout(layout: Any) -> tuple[tuple[int, ...], ...]:
    """Check that a host layout partitions ``0 .. n-1`` into non-empty hosts."""
    if isinstance(layout, (str, bytes)) or not isinstance(layout, Sequence):
        raise TypeError(f"host_layout must be a list of lists of ranks, got "
                        f"{layout!r}")
    hosts: list[tuple[int, ...]] = []
    for h, ranks in enumerate(layout):
        if isinstance(ranks, (str, bytes)) or not isinstance(
                ranks, (Sequence, np.ndarray)):
            raise TypeError(
                f"host_layout[{h}] must be a list of ranks, got {ranks!r}")
        if len(ranks) == 0:
            raise ValueError(f"host_layout[{h}] lists no ranks")
        if not all(_is_int(r) for r in ranks):
            raise ValueError(
                f"host_layout[{h}] must hold int ranks, got {list(ranks)!r}")
        hosts.append(tuple(int(r) for r in ranks))
    if not hosts:
        raise ValueError("host_layout lists no hosts")
    flat = [r for host in hosts for r in host]
    if sorted(flat) != list(range(len(flat))):
        raise ValueError(
            "host_layout must list each rank 0.."
            f"{len(flat) - 1} exactly once, got {[list(h) for h in hosts]}")
    return tuple(hosts)


class HybridMesh(Mesh):
    """A mesh over several hosts with a fast inner and a slow outer network.

    Each mesh axis ``i`` has size ``ici_mesh_shape[i] * dcn_mesh_shape[i]``.
    The ICI part of the coordinate moves between ranks of one host (shared
    memory); the DCN part moves between hosts. Concretely, the ranks of each
    host are laid row-major into ``ici_mesh_shape``, the hosts (in layout
    order) are laid row-major into ``dcn_mesh_shape``, and host blocks are
    placed so that coordinate ``dcn_index * ici_size + ici_index`` holds the
    host's rank at ``ici_index``. Order axes by increasing communication
    volume, e.g. ``(replica, data, model)``.

    Args:
        ici_mesh_shape (Sequence[int]): the mesh of the ranks of one host.
        dcn_mesh_shape (Optional[Sequence[int]]): the mesh of hosts, with as
            many axes as ``ici_mesh_shape``; defaults to all ones (one host).
        axis_names (Optional[Sequence[str]]): names of the mesh axes.
        host_layout (Optional[Sequence[Sequence[int]]]): the global ranks of
            each host, hosts in order. Defaults to ``ringlet.host_layout()``;
            pass it explicitly to build a mesh for a simulated topology.

    Raises:
        ShardingSpecError: (a ValueError and an AssertionError) when the two
            shapes differ in length.
        ValueError: when several hosts
            are present but ``dcn_mesh_shape`` has product 1, when one host is
            present but ``dcn_mesh_shape`` asks for more, when the number of
            hosts is not the product of ``dcn_mesh_shape``, or when a host's
            rank count is not the product of ``ici_mesh_shape``; also when
            the host layout does not list each rank ``0..n-1`` exactly once.
        TypeError: when a shape or the host layout is not a sequence.

    Example:
        >>> mesh = HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1),
        ...                   axis_names=("dcn", "ici"),
        ...                   host_layout=[[0, 1], [2, 3]])
        >>> mesh.get_logical_mesh().tolist()
        [[0, 1], [2, 3]]
        >>> mesh.shape()
        OrderedDict([('dcn', 2), ('ici', 2)])
    """

    ici_mesh_shape: tuple[int, ...]
    dcn_mesh_shape: tuple[int, ...]
    host_layout: tuple[tuple[int, ...], ...]

    def __init__(self,
                 *,
                 ici_mesh_shape: Sequence[int],
                 dcn_mesh_shape: Sequence[int] | None = None,
                 axis_names: Sequence[str] | None = None,
                 host_layout: Sequence[Sequence[int]] | None = None) -> None:
        ici = _as_shape(ici_mesh_shape, "ici_mesh_shape")
        dcn = ((1,) * len(ici) if dcn_mesh_shape is None else _as_shape(
            dcn_mesh_shape, "dcn_mesh_shape"))
        if len(ici) != len(dcn):
            raise ShardingSpecError(
                f"ici_mesh_shape {ici} and dcn_mesh_shape {dcn} must have "
                "the same number of axes")
        if host_layout is None:
            host_layout = core_groups.host_layout()
        hosts = _validate_host_layout(host_layout)
        n_dcn = math.prod(dcn)
        if len(hosts) > 1 and n_dcn == 1:
            raise ValueError(
                f"the ranks span {len(hosts)} hosts: give a dcn_mesh_shape "
                "whose product is the number of hosts")
        if len(hosts) == 1 and n_dcn > 1:
            raise ValueError(
                f"dcn_mesh_shape {dcn} spreads the mesh over {n_dcn} hosts, "
                "but all ranks are on a single host")
        self.ici_mesh_shape = ici
        self.dcn_mesh_shape = dcn
        self.host_layout = hosts
        if n_dcn > 1:
            grid = self._create_hybrid_device_mesh(ici, dcn, hosts)
        else:
            grid = self._create_device_mesh(ici, hosts[0], "the host")
        mesh_shape = tuple(a * b for a, b in zip(ici, dcn))
        super().__init__(grid.reshape(-1), mesh_shape, axis_names)

    @staticmethod
    def _create_device_mesh(shape: tuple[int, ...], ranks: Sequence[int],
                            where: str) -> np.ndarray:
        """Lay the ranks of one host row-major into ``shape``."""
        if math.prod(shape) != len(ranks):
            raise ValueError(
                f"{where} has {len(ranks)} ranks {list(ranks)}, which must "
                f"equal the product of ici_mesh_shape {shape}")
        return np.asarray(ranks, dtype=np.int64).reshape(shape)

    @classmethod
    def _create_hybrid_device_mesh(cls, ici: tuple[int, ...],
                                   dcn: tuple[int, ...],
                                   hosts: Sequence[Sequence[int]]) -> np.ndarray:
        """Place one ``ici``-shaped block per host on a ``dcn``-shaped grid."""
        if math.prod(dcn) != len(hosts):
            raise ValueError(
                f"there are {len(hosts)} hosts, which must equal the product "
                f"of dcn_mesh_shape {dcn}")
        blocks = np.stack([
            cls._create_device_mesh(ici, ranks, f"host {h}")
            for h, ranks in enumerate(hosts)
        ]).reshape(dcn + ici)
        # Interleave (d0, ..., dk, i0, ..., ik) -> (d0, i0, d1, i1, ...), so
        # merging each pair gives coordinate d * ici_size + i on every axis.
        k = len(ici)
        order = [ax for pair in zip(range(k), range(k, 2 * k)) for ax in pair]
        return blocks.transpose(order).reshape(
            tuple(a * b for a, b in zip(dcn, ici)))


class ShardingType(IntEnum):
    """The kind of a sharding; values match XLA's ``OpSharding.Type`` ids.

    ``REPLICATED``: every rank holds the whole tensor. ``MAXIMAL``: a
    single-device mesh. ``TUPLE``: a sharding per tuple element (not
    produced here). ``TILED``: every rank holds a distinct tile. ``MANUAL``:
    partitioned by the user. ``PARTIAL``: tiled, with each tile replicated
    within a group of ranks. ``UNKNOWN``: left to be inferred.

    Example:
        >>> int(ShardingType.PARTIAL)
        5
    """

    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    TILED = 3
    MANUAL = 4
    PARTIAL = 5
    UNKNOWN = 6


def _freeze(value: Any) -> Any:
    """Nested lists to nested tuples, for hashing."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


@dataclass(frozen=True)
class OpSharding:
    """The sharding of one tensor: what torch_xla hands to XLA as OpSharding.

    Treat the list fields as read-only: values are cached and shared.

    Args:
        tile_assignment (List[Any]): nested list of rank ids; the mesh
            permuted so that the axes sharding tensor dimensions come first
            (one per sharded dimension, tuple groups merged) followed by the
            unused mesh axes. Empty for scalars.
        group_assignment (List[Any]): for PARTIAL, nested list of group ids
            shaped like the tensor's tile grid (1 on unsplit dimensions);
            empty otherwise.
        replication_groups (List[List[int]]): for PARTIAL, the ranks of each
            group, in tile-assignment order; every rank of a group holds the
            same tile. Empty otherwise.
        sharding_type (ShardingType): the kind of sharding.

    Example:
        >>> OpSharding([[0, 1], [2, 3]], [], [], ShardingType.TILED)
        {devices=[2,2]0,1,2,3}
    """

    tile_assignment: list[Any]
    group_assignment: list[Any]
    replication_groups: list[list[int]]
    sharding_type: ShardingType

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding_type",
                           ShardingType(int(self.sharding_type)))

    @classmethod
    def replicated(cls) -> OpSharding:
        """A fully replicated sharding.

        Returns:
            OpSharding: ``OpSharding([], [], [], ShardingType.REPLICATED)``.

        Example:
            >>> OpSharding.replicated()
            {replicated}
        """
        return cls([], [], [], ShardingType.REPLICATED)

    @classmethod
    def manual(cls) -> OpSharding:
        """A manual sharding (the user partitions the tensor).

        Returns:
            OpSharding: ``OpSharding([], [], [], ShardingType.MANUAL)``.

        Example:
            >>> OpSharding.manual()
            {manual}
        """
        return cls([], [], [], ShardingType.MANUAL)

    def _hlo_form(self) -> tuple[str, np.ndarray | None, bool]:
        """(kind, device tile, last_tile_dim_replicate) as XLA canonicalises.

        XLA builds a partial tile from the group assignment (group grid plus
        a trailing replication axis holding each group's ranks), then turns a
        single group into ``replicated``, drops a trailing axis of size 1,
        and sorts the ranks of each group. MAXIMAL is built as replicated.
        """
        kind = self.sharding_type
        if kind in (ShardingType.REPLICATED, ShardingType.MAXIMAL):
            return "replicated", None, False
        if kind is ShardingType.MANUAL:
            return "manual", None, False
        if kind is ShardingType.UNKNOWN:
            return "unknown", None, False
        if kind is ShardingType.TUPLE:
            return "tuple", None, False
        if kind is ShardingType.TILED:
            return "tiled", np.asarray(self.tile_assignment, dtype=np.int64), False
        groups = [list(g) for g in self.replication_groups]
        group_tile = np.asarray(self.group_assignment, dtype=np.int64)
        if not groups or group_tile.size != len(groups):
            raise ValueError(
                "a PARTIAL sharding needs one replication group per entry of "
                f"group_assignment; got {group_tile.size} entries and "
                f"{len(groups)} groups")
        if len({len(g) for g in groups}) != 1:
            raise ValueError("replication groups must all have the same size")
        if len(groups) == 1:
            return "replicated", None, False
        width = len(groups[0])
        tile = np.array([sorted(groups[g]) for g in group_tile.reshape(-1)],
                        dtype=np.int64).reshape((*group_tile.shape, width))
        if width == 1:
            return "tiled", tile.reshape(group_tile.shape), False
        return "tiled", tile, True

    def xla_tile_assignment(self) -> np.ndarray | None:
        """The device tile XLA would use for this sharding.

        For PARTIAL this is the group grid with a trailing replication axis
        (see :attr:`replicate_on_last_tile_dim`), ranks sorted within each
        group, after XLA's simplifications.

        Returns:
            Optional[np.ndarray]: the device tile, or None when the sharding
            is (or reduces to) replicated, manual, unknown or tuple.

        Example:
            >>> Mesh(range(4), (2, 2)).get_op_sharding((0,)).xla_tile_assignment().tolist()
            [[0, 1], [2, 3]]
        """
        return self._hlo_form()[1]

    @property
    def replicate_on_last_tile_dim(self) -> bool:
        """Whether the last axis of :meth:`xla_tile_assignment` replicates.

        Returns:
            bool: True for a partially replicated tiling.

        Example:
            >>> Mesh(range(4), (2, 2)).get_op_sharding((0,)).replicate_on_last_tile_dim
            True
        """
        return self._hlo_form()[2]

    def __repr__(self) -> str:
        try:
            kind, tile, last = self._hlo_form()
        except ValueError as err:
            return (f"OpSharding({self.sharding_type.name}, invalid: {err})")
        if tile is None:
            return "{" + kind + "}"
        dims = ",".join(str(d) for d in tile.shape)
        ids = ",".join(str(int(d)) for d in tile.reshape(-1))
        return "{devices=[" + dims + "]" + ids + (
            " last_tile_dim_replicate" if last else "") + "}"

    __str__ = __repr__

    def __hash__(self) -> int:
        return hash((_freeze(self.tile_assignment),
                     _freeze(self.group_assignment),
                     _freeze(self.replication_groups), int(self.sharding_type)))


def _read_back_sharding_type(op: OpSharding) -> ShardingType:
    """The type torch_xla reads back from the sharding XLA builds from ``op``.

    MAXIMAL and a PARTIAL sharding with a single replication group are built
    as replicated, a PARTIAL sharding whose groups have one member each as a
    plain tiling; see :meth:`OpSharding._hlo_form`.
    """
    kind, _, last_tile_dim_replicate = op._hlo_form()
    if kind == "replicated":
        return ShardingType.REPLICATED
    if kind == "tiled":
        return ShardingType.PARTIAL if last_tile_dim_replicate else ShardingType.TILED
    return op.sharding_type


def _normalize_entry(mesh: Mesh, entry: Any, inside_group: bool) -> Any:
    """Resolve one partition-spec entry to None, an int or a tuple of ints."""
    if entry is None:
        if inside_group:
            raise ValueError(
                "None cannot appear inside an axis tuple of a partition spec; "
                "leave the axis out instead")
        return None
    if isinstance(entry, list):
        # torch_xla accepts only tuples here (_translate_named_partition_spec
        # raises ValueError for any other type); a list is not an axis group.
        raise ValueError(
            f"partition spec entries must be int, str, tuple or None; list "
            f"({entry!r}) is not supported (write a tuple to split one "
            f"dimension over several mesh axes)")
    if isinstance(entry, tuple):
        if inside_group:
            raise ShardingSpecError(
                f"partition spec cannot contain nested tuples, got {entry!r}")
        if len(entry) == 0:
            raise ValueError(
                "an empty tuple in a partition spec names no mesh axis; use "
                "None to leave a dimension unsplit")
        return tuple(_normalize_entry(mesh, e, True) for e in entry)
    if isinstance(entry, str):
        idx = mesh.get_axis_name_idx(entry)
        if idx is None:
            raise ValueError(
                f"axis name {entry!r} is not defined in the given mesh "
                f"(axis names: {mesh.axis_names})")
        return idx
    if _is_int(entry):
        return int(entry)
    raise ValueError(
        f"partition spec entries must be int, str, tuple or None; "
        f"{type(entry).__name__} ({entry!r}) is not supported")


def normalize_partition_spec(mesh: Mesh,
                             partition_spec: PartitionSpec) -> _NormalizedSpec:
    """Validate a partition spec against a mesh and resolve axis names.

    Args:
        mesh (Mesh): the mesh the spec refers to.
        partition_spec (PartitionSpec): a tuple (or list) with one entry per
            tensor dimension: an axis position, an axis name, a tuple of
            those, or None.

    Returns:
        Tuple: the spec with names replaced by axis positions; single axes
        stay ints, groups stay tuples, None stays None.

    Raises:
        ShardingSpecError: (a ValueError and an AssertionError) for nested
            tuples, axes outside ``[0, mesh rank)``, or an axis used more
            than once.
        ValueError: for unknown names, empty tuples, None inside a tuple,
            or unsupported entry types.
        TypeError: when ``partition_spec`` is not a tuple or list.

    Example:
        >>> mesh = Mesh(range(8), (2, 2, 2), ("a", "b", "c"))
        >>> normalize_partition_spec(mesh, (("c", "a"), None, "b"))
        ((2, 0), None, 1)
    """
    if not isinstance(partition_spec, (tuple, list)):
        raise TypeError(
            "partition_spec must be a tuple with one entry per tensor "
            f"dimension, got {type(partition_spec).__name__} "
            f"({partition_spec!r})")
    spec = tuple(_normalize_entry(mesh, e, False) for e in partition_spec)
    used: list[int] = []
    for entry in spec:
        if entry is not None:
            used.extend(entry if isinstance(entry, tuple) else (entry,))
    rank = len(mesh.mesh_shape)
    for axis in used:
        if not 0 <= axis < rank:
            raise ShardingSpecError(
                f"partition_spec {tuple(partition_spec)!r} refers to mesh "
                f"axis {axis}, out of range for a mesh of rank {rank}")
    repeated = sorted({a for a in used if used.count(a) > 1})
    if repeated:
        raise ShardingSpecError(
            f"each mesh axis may appear at most once in a partition spec; "
            f"axis {repeated} repeats in {tuple(partition_spec)!r}")
    return spec


def _translate_named_partition_spec(mesh: Mesh,
                                    partition_spec: PartitionSpec) -> _NormalizedSpec:
    """torch_xla's private name for :func:`normalize_partition_spec`.

    Args:
        mesh (Mesh): the mesh the spec refers to.
        partition_spec (PartitionSpec): one entry per tensor dimension.

    Returns:
        Tuple: the spec with axis names replaced by axis positions.

    Raises:
        ShardingSpecError: for nested tuples, out-of-range or repeated axes
            (ringlet validates the axes here; torch_xla does it later).
        ValueError: for unknown names or unsupported entry types.

    Example:
        >>> mesh = Mesh(range(4), (2, 2), ("x", "y"))
        >>> _translate_named_partition_spec(mesh, (("y", "x"), None))
        ((1, 0), None)
    """
    return normalize_partition_spec(mesh, partition_spec)


def _get_sharding_type(partition_spec: _NormalizedSpec, num_devices: int) -> ShardingType:
    """The sharding type from the spec alone (torch_xla's base rule).

    Args:
        partition_spec (Tuple): a translated partition spec.
        num_devices (int): the number of devices.

    Returns:
        ShardingType: MAXIMAL on one device, REPLICATED when no dimension is
        split, PARTIAL when some are, TILED when all are.

    Example:
        >>> _get_sharding_type((0, None), 4)
        <ShardingType.PARTIAL: 5>
    """
    if num_devices == 1:
        return ShardingType.MAXIMAL
    if all(d is None for d in partition_spec):
        return ShardingType.REPLICATED
    if any(d is None for d in partition_spec):
        return ShardingType.PARTIAL
    return ShardingType.TILED


def _get_tile_assignment(mesh: Mesh, partition_spec: _NormalizedSpec) -> np.ndarray:
    """Permute the logical mesh into the tile assignment for ``partition_spec``.

    The mesh axes used by the spec come first, in spec order, followed by
    the unused axes in increasing order; the axes of each tuple entry are
    then merged into one (the first listed axis major).

    Args:
        mesh (Mesh): the mesh.
        partition_spec (Tuple): a translated partition spec.

    Returns:
        np.ndarray: the permuted (and merged) logical mesh.

    Example:
        >>> _get_tile_assignment(Mesh(range(4), (2, 2)), (1, 0)).tolist()
        [[0, 2], [1, 3]]
    """
    tiled = [d for d in partition_spec if d is not None]
    order: list[int] = []
    for d in tiled:
        order.extend(d if isinstance(d, tuple) else (d,))
    unused = [a for a in range(len(mesh.mesh_shape)) if a not in order]
    tiles = mesh.get_logical_mesh().transpose(order + unused)
    for i, d in enumerate(tiled):
        if isinstance(d, tuple):
            shape = tiles.shape
            tiles = tiles.reshape((*shape[:i], -1, *shape[i + len(d):]))
    return tiles


def _get_group_assignment(sharding_type: ShardingType, tile_assignment: np.ndarray,
                          tensor_rank: int,
                          replicate_dims: set[int]) -> tuple[list[Any], list[list[int]]]:
    """Group grid and replication groups for PARTIAL shardings.

    The leading axes of ``tile_assignment`` (one per split tensor dimension)
    select a tile; the trailing axes enumerate the ranks that all hold that
    tile. Groups are numbered row-major over the leading axes, and the group
    grid puts a 1 on every unsplit tensor dimension.

    Args:
        sharding_type (ShardingType): the sharding type; anything but
            PARTIAL has no groups.
        tile_assignment (np.ndarray): from :func:`_get_tile_assignment`.
        tensor_rank (int): the number of tensor dimensions.
        replicate_dims (Set[int]): the tensor dimensions not split.

    Returns:
        Tuple[List, List]: the group assignment and the replication groups
        (both empty unless PARTIAL).

    Example:
        >>> tiles = np.arange(4).reshape(2, 2)
        >>> _get_group_assignment(ShardingType.PARTIAL, tiles, 2, {1})
        ([[0], [1]], [[0, 1], [2, 3]])
    """
    if sharding_type is not ShardingType.PARTIAL:
        return [], []
    tiles = tile_assignment
    n_split = tensor_rank - len(replicate_dims)
    lead = tiles.shape[:n_split]
    width = math.prod(tiles.shape[n_split:])
    groups = tiles.reshape(-1, width).tolist()
    sizes = iter(lead)
    grid = tuple(1 if d in replicate_dims else next(sizes)
                 for d in range(tensor_rank))
    return np.arange(len(groups)).reshape(grid).tolist(), groups


def _compute_op_sharding(mesh: Mesh, spec: _NormalizedSpec) -> OpSharding:
    """Tile assignment, groups and type for a validated, non-empty spec."""
    tiles = _get_tile_assignment(mesh, spec)
    if tiles.ndim > len(spec):
        # The mesh has axes the spec leaves unused: those replicate.
        sharding_type = ShardingType.PARTIAL
    else:
        sharding_type = _get_sharding_type(spec, mesh.size())
    replicate_dims = {i for i, d in enumerate(spec) if d is None}
    group_assignment, replication_groups = _get_group_assignment(
        sharding_type, tiles, len(spec), replicate_dims)
    return OpSharding(tiles.tolist(), group_assignment, replication_groups,
                      sharding_type)


@dataclass(frozen=True)
class ShardIndices:
    """The part of a global tensor that one rank holds.

    Every shard has the same padded shape: ``ceil(size / parts)`` on each
    split dimension, the full size elsewhere. A shard that runs past the end
    of a dimension (or starts past it) is zero padded at the end.

    Args:
        rank (int): the rank holding the shard.
        indices (Tuple[slice, ...]): per dimension, the unpadded slice of
            the global tensor held (possibly empty).
        shard_shape (Tuple[int, ...]): the padded shape of the shard.
        tile_index (Tuple[int, ...]): per dimension, the index of the shard
            along that dimension (0 on unsplit dimensions).
        replica_id (int): 0 when no other rank holds the same data;
            otherwise the rank's position among the ranks holding the same
            data, sorted by rank (as XLA numbers replicas).

    Example:
        >>> s = shard_indices((5,), Mesh(range(2), (2,)), (0,), 1)
        >>> s.indices, s.shard_shape, s.unpadded_shape, s.padding
        ((slice(3, 5, None),), (3,), (2,), (1,))
    """

    rank: int
    indices: tuple[slice, ...]
    shard_shape: tuple[int, ...]
    tile_index: tuple[int, ...]
    replica_id: int

    @property
    def unpadded_shape(self) -> tuple[int, ...]:
        """The shape of the real data in the shard.

        Returns:
            Tuple[int, ...]: ``stop - start`` of each slice.

        Example:
            >>> shard_indices((5,), Mesh(range(2), (2,)), (0,), 0).unpadded_shape
            (3,)
        """
        return tuple(s.stop - s.start for s in self.indices)

    @property
    def padding(self) -> tuple[int, ...]:
        """Zero padding at the end of each dimension of the shard.

        Returns:
            Tuple[int, ...]: ``shard_shape - unpadded_shape`` per dimension.

        Example:
            >>> shard_indices((5,), Mesh(range(2), (2,)), (0,), 1).padding
            (1,)
        """
        return tuple(p - u for p, u in zip(self.shard_shape, self.unpadded_shape))


def shard_indices(global_shape: Sequence[int], mesh: Mesh,
                  partition_spec: PartitionSpec, rank: int) -> ShardIndices:
    """Locate ``rank``'s shard of a tensor sharded by ``partition_spec``.

    A dimension split over mesh axes ``(a0, a1, ...)`` is cut into
    ``parts = size(a0) * size(a1) * ...`` chunks of ``ceil(dim / parts)``;
    the rank takes chunk ``c(a0) * size(a1) * ... + c(a1) * ... + ...`` where
    ``c`` are its mesh coordinates, which is its position in the tile
    assignment. Slices are clamped to the tensor, so trailing shards may be
    short or empty and are zero padded to the common shard shape.

    Args:
        global_shape (Sequence[int]): shape of the whole tensor.
        mesh (Mesh): the mesh.
        partition_spec (PartitionSpec): one entry per tensor dimension.
        rank (int): a rank of the mesh.

    Returns:
        ShardIndices: slices, padded shape, tile index and replica id.

    Raises:
        ValueError: for an invalid spec, a spec whose length differs from the
            tensor rank (a :class:`~ringlet.errors.ShardingSpecError`), a
            negative dimension, or a rank not in the mesh.

    Example:
        >>> mesh = Mesh(range(4), (4,), ("x",))
        >>> shard_indices((10, 3), mesh, ("x", None), 3).indices
        (slice(9, 10, None), slice(0, 3, None))
        >>> shard_indices((2,), mesh, ("x",), 3).indices  # wholly padding
        (slice(2, 2, None),)
    """
    if isinstance(global_shape, torch.Size):
        global_shape = tuple(global_shape)
    if not isinstance(global_shape, (tuple, list)) or not all(
            _is_int(d) and int(d) >= 0 for d in global_shape):
        raise ValueError(
            f"global_shape must be a tuple of non-negative ints, got "
            f"{global_shape!r}")
    shape = tuple(int(d) for d in global_shape)
    spec = normalize_partition_spec(mesh, partition_spec)
    if len(spec) != len(shape):
        raise ShardingSpecError(
            f"partition spec length ({len(spec)}) should be equal to the "
            f"tensor rank ({len(shape)})")
    coords = mesh.rank_coords(rank)
    sizes = mesh.mesh_shape

    slices: list[slice] = []
    padded: list[int] = []
    tile_index: list[int] = []
    used: list[int] = []
    for dim, entry in zip(shape, spec):
        axes = () if entry is None else (
            entry if isinstance(entry, tuple) else (entry,))
        used.extend(axes)
        parts, idx = 1, 0
        for a in axes:
            parts *= sizes[a]
            idx = idx * sizes[a] + coords[a]
        chunk = -(-dim // parts)
        start = min(idx * chunk, dim)
        stop = min(start + chunk, dim)
        slices.append(slice(start, stop))
        padded.append(chunk)
        tile_index.append(idx)

    # Replicas share every coordinate on the used axes; number them by rank.
    grid = mesh.get_logical_mesh()
    same = tuple(coords[a] if a in used else slice(None)
                 for a in range(len(sizes)))
    replicas = sorted(int(r) for r in np.asarray(grid[same]).reshape(-1))
    replica_id = replicas.index(int(rank)) if len(replicas) > 1 else 0
    return ShardIndices(int(rank), tuple(slices), tuple(padded),
                        tuple(tile_index), replica_id)


def all_shard_indices(global_shape: Sequence[int], mesh: Mesh,
                      partition_spec: PartitionSpec) -> list[ShardIndices]:
    """:func:`shard_indices` for every rank of the mesh, in rank order.

    Args:
        global_shape (Sequence[int]): shape of the whole tensor.
        mesh (Mesh): the mesh.
        partition_spec (PartitionSpec): one entry per tensor dimension.

    Returns:
        List[ShardIndices]: entry ``r`` describes rank ``r``.

    Example:
        >>> [s.indices for s in all_shard_indices((3,), Mesh(range(2), (2,)), (0,))]
        [(slice(0, 2, None),), (slice(2, 3, None),)]
    """
    return [
        shard_indices(global_shape, mesh, partition_spec, r)
        for r in range(mesh.size())
    ]


def extract_shard(tensor: torch.Tensor, mesh: Mesh,
                  partition_spec: PartitionSpec, rank: int) -> torch.Tensor:
    """Cut ``rank``'s padded shard out of a full tensor.

    Args:
        tensor (torch.Tensor): the whole (global) tensor.
        mesh (Mesh): the mesh.
        partition_spec (PartitionSpec): one entry per tensor dimension.
        rank (int): a rank of the mesh.

    Returns:
        torch.Tensor: a new contiguous tensor of the padded shard shape, on
        the tensor's device and dtype, zero past the end of the data.

    Example:
        >>> extract_shard(torch.arange(5), Mesh(range(2), (2,)), (0,), 1)
        tensor([3, 4, 0])
    """
    info = shard_indices(tuple(tensor.shape), mesh, partition_spec, rank)
    out = tensor.new_zeros(info.shard_shape)
    out[tuple(slice(0, n) for n in info.unpadded_shape)] = tensor[info.indices]
    return out


def assemble_shards(shards: Sequence[torch.Tensor], global_shape: Sequence[int],
                    mesh: Mesh, partition_spec: PartitionSpec) -> torch.Tensor:
    """Rebuild the full tensor from every rank's padded shard.

    Only the replica with ``replica_id == 0`` of each piece is read; padding
    is dropped.

    Args:
        shards (Sequence[torch.Tensor]): ``shards[r]`` is rank ``r``'s padded
            shard, for every rank of the mesh.
        global_shape (Sequence[int]): shape of the whole tensor.
        mesh (Mesh): the mesh.
        partition_spec (PartitionSpec): one entry per tensor dimension.

    Returns:
        torch.Tensor: the global tensor, with the first shard's dtype and
        device.

    Raises:
        ValueError: when the number of shards or a shard's shape is wrong.

    Example:
        >>> mesh = Mesh(range(2), (2,))
        >>> assemble_shards([torch.tensor([0, 1, 2]), torch.tensor([3, 4, 0])],
        ...                 (5,), mesh, (0,))
        tensor([0, 1, 2, 3, 4])
    """
    if len(shards) != mesh.size():
        raise ValueError(
            f"expected one shard per rank ({mesh.size()}), got {len(shards)}")
    infos = all_shard_indices(global_shape, mesh, partition_spec)
    out = shards[0].new_zeros(tuple(int(d) for d in global_shape))
    for info, shard in zip(infos, shards):
        if tuple(shard.shape) != info.shard_shape:
            raise ValueError(
                f"shard of rank {info.rank} has shape {tuple(shard.shape)}, "
                f"expected the padded shard shape {info.shard_shape}")
        if info.replica_id == 0:
            out[info.indices] = shard[tuple(
                slice(0, n) for n in info.unpadded_shape)]
    return out
