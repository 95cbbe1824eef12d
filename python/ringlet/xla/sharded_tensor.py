"""Eager sharded tensors: each rank of a :class:`~ringlet.xla.sharding.Mesh` keeps only its shard.

This is torch_xla's ``mark_sharding`` API made real for eager, multi-process
execution: every mesh device id is a rank, and a tensor sharded by a partition
spec is held as one padded shard per rank (see
:func:`ringlet.xla.sharding.shard_indices` for the layout rules). Communication
happens only where a value has to move:

* :attr:`XLAShardedTensor.global_tensor` all-gathers the shards along the mesh
  axes of each sharded dimension (``groups=mesh.groups_along(...)``);
* :meth:`XLAShardedTensor.reshard` moves, for every pair of ranks, only the
  overlap of what the source stores with what the destination needs, taking
  each piece from a single replica; a reshard that is pure slicing moves nothing;
* :func:`disable_manual_sharding` and ``mark_sharding(..., from_local_shards=True)``
  build a sharded tensor from local shards without communicating.

Differences from torch_xla worth knowing:

* :class:`XLAShardedTensor` is a plain object, not a ``torch.Tensor`` subclass;
  compute on ``local_shards[0].data`` (or on a sharded ``nn.Parameter``) and
  write the collectives by hand.
* ``mark_sharding`` on an ``nn.Parameter`` shards it in place: the parameter's
  ``data`` becomes this rank's padded shard, so modules train on shards and
  :func:`ringlet.checkpoint.sharded_state_dict` finds them. Other tensors are
  left unchanged and the returned sharded tensor owns a copy of the shard.
* ``sharding_spec`` is a :class:`~ringlet.xla.sharding.ShardingSpec`;
  ``str(t.sharding_spec.op_sharding)`` gives XLA's textual form.
* ``XLAShard.indices`` follows torch_xla (a list of ``slice(start, stop, 1)``,
  or ``...`` when the tensor is replicated or 0-d); ``XLAShard.data`` shares
  storage with the rank's shard (no snapshot).
* Invalid meshes and specs, where torch_xla asserts, raise
  :class:`~ringlet.errors.ShardingSpecError` (a ``ValueError`` and an
  ``AssertionError``) naming the rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from ..checkpoint.integration import LAYOUT_ATTR
from ._redistribute import all_gather_shards, exchange, reshard_plan, run_plan
from ._shard_checkpoint import checkpoint_mapping, grid_intervals
from ._shard_layout import (
    ShardIndexList,
    as_spec,
    axis_parts,
    box_of,
    check_mesh,
    check_rank_of_spec,
    normalize,
    pad_local_shard,
    padded_shard,
    rank_world,
    resolve_mesh,
    xla_indices,
)
from .mesh import (
    Mesh,
    OpSharding,
    PartitionSpec,
    PartitionSpecEntry,
    ShardIndices,
    ShardingType,
    _read_back_sharding_type,
    get_1d_mesh,
    get_global_mesh,
    shard_indices,
)

__all__ = [
    "ShardingSpec",
    "XLAShard",
    "XLAShardedTensor",
    "clear_sharding",
    "disable_manual_sharding",
    "enable_manual_sharding",
    "mark_sharding",
    "unwrap_sharded_tensor",
    "wrap_as_sharded_tensor",
    "wrap_if_sharded",
]

# Attribute set on an ``nn.Parameter`` sharded in place, pointing at its XLAShardedTensor
# (the checkpoint layer finds the layout there).
_PARAM_ATTR = LAYOUT_ATTR

# The reshard's single data-movement function, looked up here at every reshard
# (tests wrap it to count what travels).
_exchange = exchange
# The names these helpers had when they lived here.
_reshard_plan = reshard_plan
_grid_intervals = grid_intervals


@dataclass
class ShardingSpec:
    """A reusable (mesh, partition spec) pair, e.g. for input pipelines.

    The derived ``_tile_assignment``, ``_group_assignment``,
    ``_replication_groups`` and ``_sharding_type`` fields are those of
    ``mesh.get_op_sharding(partition_spec)``, so the spec is validated on
    construction. ``minibatch`` is carried for the eager layer (True: the
    tensor given to it is this process's slice of the batch dimension).

    Args:
        mesh (Mesh): the mesh to shard over.
        partition_spec (PartitionSpec): one entry per tensor dimension.
        minibatch (bool): whether inputs are per-process minibatches.

    Raises:
        ValueError: when the partition spec is invalid for the mesh.

    Example:
        >>> spec = ShardingSpec(Mesh(range(4), (4,), ("data",)), ("data", None))
        >>> spec.can_apply(torch.zeros(8, 3))
        True
        >>> spec.op_sharding
        {devices=[4,1]0,1,2,3}
    """

    mesh: Mesh
    partition_spec: tuple[PartitionSpecEntry, ...]
    minibatch: bool = False
    _tile_assignment: list[Any] = field(init=False, repr=False, compare=False)
    _group_assignment: list[Any] = field(init=False, repr=False, compare=False)
    _replication_groups: list[list[int]] = field(init=False, repr=False,
                                                 compare=False)
    _sharding_type: ShardingType = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.partition_spec, list):
            self.partition_spec = tuple(self.partition_spec)
        op = self.mesh.get_op_sharding(self.partition_spec)
        self._tile_assignment = op.tile_assignment
        self._group_assignment = op.group_assignment
        self._replication_groups = op.replication_groups
        self._sharding_type = op.sharding_type

    @property
    def op_sharding(self) -> OpSharding:
        """The sharding this spec describes (stands in for ``xla_spec``).

        Returns:
            OpSharding: ``mesh.get_op_sharding(partition_spec)``.

        Example:
            >>> ShardingSpec(Mesh(range(2), (2,)), (None,)).op_sharding
            {replicated}
        """
        return self.mesh.get_op_sharding(self.partition_spec)

    def xla_spec(self, t: torch.Tensor) -> OpSharding | None:
        """The sharding for ``t``, or None when the spec does not fit it.

        torch_xla returns its native ``XlaShardingSpec`` here; ringlet returns
        the :class:`OpSharding` it stands for.

        Args:
            t (torch.Tensor): the tensor to shard.

        Returns:
            Optional[OpSharding]: :attr:`op_sharding`, or None when
            :meth:`can_apply` is False.

        Example:
            >>> ShardingSpec(Mesh(range(2), (2,)), (0,)).xla_spec(torch.zeros(2, 2)) is None
            True
        """
        if not self.can_apply(t):
            return None
        return self.op_sharding

    def can_apply(self, t: torch.Tensor) -> bool:
        """Whether the spec fits a tensor: one entry per dimension.

        Args:
            t (torch.Tensor): the tensor to test.

        Returns:
            bool: ``len(t.shape) == len(partition_spec)``.

        Example:
            >>> ShardingSpec(Mesh(range(2), (2,)), (0,)).can_apply(torch.zeros(2, 2))
            False
        """
        return len(t.shape) == len(self.partition_spec)

    def apply(self, t: torch.Tensor) -> Any:
        """Shards ``t`` with this spec's mesh and partition spec (as
        ``mark_sharding(t, self.mesh, self.partition_spec)``).

        Args:
            t (torch.Tensor): the full tensor, the same on every rank.

        Returns:
            XLAShardedTensor: this rank's view of the sharded tensor.

        Example:
            >>> ShardingSpec(get_1d_mesh(), (0,)).apply(torch.arange(8.0))
        """
        return mark_sharding(t, self.mesh, self.partition_spec)

    def shard_indices(self, global_shape: Sequence[int],
                      rank: int) -> ShardIndices:
        """Where ``rank``'s shard of a tensor of ``global_shape`` lies.

        Args:
            global_shape (Sequence[int]): shape of the whole tensor.
            rank (int): a rank of the mesh.

        Returns:
            ShardIndices: see :func:`shard_indices`.

        Example:
            >>> spec = ShardingSpec(Mesh(range(2), (2,)), (0,))
            >>> spec.shard_indices((5,), 1).indices
            (slice(3, 5, None),)
        """
        return shard_indices(global_shape, self.mesh, self.partition_spec, rank)


@dataclass
class XLAShard:
    """One rank's shard of an :class:`XLAShardedTensor`.

    Args:
        data (torch.Tensor): the padded shard (``ceil(size / parts)`` on every
            split dimension, zeros past the end of the tensor); shares storage
            with the sharded tensor.
        indices (Union[ellipsis, List[slice]]): ``...`` (``Ellipsis``) when
            the shard is the whole tensor (a replicated or 0-d tensor);
            otherwise a list with, per dimension, the ``slice(start, stop, 1)``
            of the global tensor the shard holds (without padding, possibly
            empty), as torch_xla gives it.
        shard_device (str): where the shard lives, ``"rank:<r>"``.
        replica_id (int): 0 when no other rank holds the same data, else this
            rank's position among the ranks holding it (sorted by rank).

    Example:
        >>> shard = XLAShard(torch.tensor([3, 4, 0]), [slice(3, 5, 1)], "rank:1", 0)
        >>> shard.unpadded_data
        tensor([3, 4])
    """

    data: torch.Tensor
    indices: ShardIndexList
    shard_device: str
    replica_id: int

    @property
    def unpadded_data(self) -> torch.Tensor:
        """The shard without its padding (a view of ``data``).

        Returns:
            torch.Tensor: ``data`` cut to ``stop - start`` along every
            dimension (all of ``data`` when ``indices`` is ``...``).

        Example:
            >>> shard = XLAShard(torch.zeros(4, 3), [slice(4, 7, 1), slice(0, 3, 1)], "rank:1", 0)
            >>> shard.unpadded_data.shape
            torch.Size([3, 3])
        """
        if self.indices is Ellipsis:
            return self.data[...]
        return self.data[tuple(slice(0, s.stop - s.start) for s in self.indices)]


class XLAShardedTensor:
    """A global tensor of which this rank holds one (padded) shard.

    Build one with :func:`mark_sharding` (from the full tensor, or from local
    shards with ``from_local_shards=True``), :meth:`from_local_shards`,
    :func:`wrap_as_sharded_tensor` or :func:`disable_manual_sharding`; the
    constructor takes an already padded shard and communicates nothing.

    Args:
        local_shard (torch.Tensor): this rank's padded shard, of exactly the
            shape given by :func:`ringlet.xla.sharding.shard_indices`.
        mesh (Mesh): the mesh; its size must equal the world size.
        partition_spec (PartitionSpec): one entry per tensor dimension.
        global_shape (Sequence[int]): shape of the whole tensor.

    Raises:
        ValueError: for a mesh that does not match the job, an invalid spec, or
            a shard of the wrong shape (the message names the rank).

    Example:
        >>> mesh = Mesh([0], (1,), ("x",))   # a single-process job
        >>> st = XLAShardedTensor(torch.arange(3.0), mesh, ("x",), (3,))
        >>> st.global_tensor
        tensor([0., 1., 2.])
    """

    def __init__(self, local_shard: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec,
                 global_shape: Sequence[int]) -> None:
        self._init(local_shard, mesh, partition_spec, global_shape, manual=False)

    def _init(self, local_shard: torch.Tensor, mesh: Mesh, partition_spec: PartitionSpec,
              global_shape: Sequence[int], manual: bool) -> None:
        if not isinstance(local_shard, torch.Tensor):
            raise TypeError(
                f"rank {rank_world()[0]}: a local shard must be a torch.Tensor, got "
                f"{type(local_shard).__name__}"
            )
        self._mesh = check_mesh(mesh, "sharded tensor")
        spec = as_spec(partition_spec)
        self._rank = rank_world()[0]
        shape = tuple(int(d) for d in global_shape)
        check_rank_of_spec(spec, len(shape))
        self._norm_spec = normalize(mesh, spec)
        self._partition_spec = spec
        self._info = shard_indices(shape, mesh, spec, self._rank)
        self._manual = manual
        self._global_shape = torch.Size(tuple(local_shard.shape) if manual else shape)
        if tuple(local_shard.shape) != self._info.shard_shape:
            raise ValueError(
                f"rank {self._rank}: local shard has shape {tuple(local_shard.shape)}, expected "
                f"the padded shard shape {self._info.shard_shape} of global shape {shape} "
                f"under spec {spec!r}"
            )
        self._data: torch.Tensor | None = local_shard
        self._param: torch.nn.Parameter | None = None
        # The tensor wrap_as_sharded_tensor wrapped (its global tensor, as in torch_xla).
        self._wrapped: torch.Tensor | None = None

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_local_shards(cls, local_shards: torch.Tensor | XLAShard | Sequence[Any], mesh: Mesh,
                          partition_spec: PartitionSpec,
                          global_shape: Sequence[int] | None = None) -> XLAShardedTensor:
        """Build a sharded tensor from this rank's shard, without communicating.

        Every rank calls it with its own shard: padded (the shard shape) or
        unpadded (the slice of the global tensor it stands for; zero padding is
        added).

        Args:
            local_shards (Union[torch.Tensor, XLAShard, Sequence]): this rank's
                shard, or a one-element list holding it (as ``local_shards``
                returns).
            mesh (Mesh): the mesh; its size must equal the world size.
            partition_spec (PartitionSpec): one entry per tensor dimension.
            global_shape (Optional[Sequence[int]]): shape of the whole tensor.
                Default: the shard shape times the number of parts on every
                dimension, i.e. an even split; give it for uneven sizes.

        Returns:
            XLAShardedTensor: the sharded tensor (it shares storage with a
            padded shard that is passed in).

        Raises:
            ValueError: when the shard fits neither the padded nor the unpadded
                shape of this rank, or for an invalid mesh or spec.

        Example:
            >>> # on 2 ranks: rank r holds rows [2r, 2r + 2) of a 4 x 3 tensor
            >>> mesh = ringlet.xla.sharding.get_1d_mesh("x")
            >>> local = torch.full((2, 3), float(ringlet.get_ordinal()))
            >>> XLAShardedTensor.from_local_shards(local, mesh, ("x", None)).global_shape
            torch.Size([4, 3])
        """
        local = local_shards
        if isinstance(local, (list, tuple)):
            if len(local) != 1:
                raise ValueError(
                    f"rank {rank_world()[0]}: expected this rank's single shard, got "
                    f"{len(local)} shards"
                )
            local = local[0]
        if isinstance(local, XLAShard):
            local = local.data
        if not isinstance(local, torch.Tensor):
            raise TypeError(
                f"rank {rank_world()[0]}: a local shard must be a torch.Tensor, got "
                f"{type(local).__name__}"
            )
        spec = as_spec(partition_spec)
        shard, global_shape = pad_local_shard(local, mesh, spec, global_shape)
        return cls(shard, mesh, spec, global_shape)

    @classmethod
    def _manual_of(cls, local_shard: torch.Tensor, mesh: Mesh,
                   partition_spec: PartitionSpec) -> XLAShardedTensor:
        """A MANUAL sharded tensor: its global value is this rank's shard."""
        obj = cls.__new__(cls)
        full = tuple(local_shard.shape)
        # Pretend the shard is the whole tensor for the layout bookkeeping.
        obj._init(local_shard, check_mesh(mesh, "enable_manual_sharding"),
                  (None,) * local_shard.dim(), full, manual=True)
        obj._partition_spec = as_spec(partition_spec)
        obj._norm_spec = normalize(mesh, obj._partition_spec)
        return obj

    # -- data ---------------------------------------------------------------------------------

    def _local(self) -> torch.Tensor:
        if self._param is not None:
            data = self._param.data
            if tuple(data.shape) != self._info.shard_shape:
                raise RuntimeError(
                    f"rank {self._rank}: the sharded parameter's data was replaced by a tensor "
                    f"of shape {tuple(data.shape)}; expected the shard shape "
                    f"{self._info.shard_shape} (use mark_sharding to reshard it)"
                )
            return data
        assert self._data is not None
        return self._data

    def _bind(self, param: torch.nn.Parameter) -> None:
        """Make ``param`` hold this rank's shard and point back at this tensor."""
        old = getattr(param, _PARAM_ATTR, None)
        if isinstance(old, XLAShardedTensor) and old is not self:
            old._data, old._param = param.data, None
        param.data = self._local()
        self._param, self._data = param, None
        setattr(param, _PARAM_ATTR, self)

    def _unbind(self) -> None:
        if self._param is not None:
            param = self._param
            self._data, self._param = param.data, None
            if getattr(param, _PARAM_ATTR, None) is self:
                delattr(param, _PARAM_ATTR)

    # -- properties ----------------------------------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        """The mesh the tensor is sharded over.

        Returns:
            Mesh: the mesh.

        Example:
            >>> st.mesh.mesh_shape
            (2, 2)
        """
        return self._mesh

    @property
    def partition_spec(self) -> tuple[Any, ...]:
        """The partition spec, as given.

        Returns:
            Tuple: one entry per tensor dimension.

        Example:
            >>> st.partition_spec
            ('data', None)
        """
        return self._partition_spec

    @property
    def sharding_spec(self) -> ShardingSpec:
        """The (mesh, partition spec) pair; ``str(.op_sharding)`` is XLA's text form.

        Returns:
            ShardingSpec: the sharding spec.

        Example:
            >>> str(st.sharding_spec.op_sharding)
            '{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}'
        """
        return ShardingSpec(self._mesh, self._partition_spec)

    @property
    def sharding_type(self) -> ShardingType:
        """The kind of sharding, as torch_xla reads it back from the tensor.

        This is the type of the sharding XLA builds from
        ``mesh.get_op_sharding(partition_spec)``, which XLA simplifies: a
        MAXIMAL sharding (a one-device mesh) and a PARTIAL one with a single
        replication group read back as REPLICATED, a PARTIAL one whose groups
        have one member each as TILED. MANUAL after
        :func:`enable_manual_sharding`. (``OpSharding.sharding_type`` keeps the
        unsimplified type.)

        Returns:
            ShardingType: REPLICATED, TILED, PARTIAL or MANUAL.

        Example:
            >>> st = mark_sharding(torch.zeros(8, 4), Mesh(range(4), (2, 2)), (0, None))
            >>> st.sharding_type
            <ShardingType.PARTIAL: 5>
            >>> mark_sharding(torch.zeros(8, 4), Mesh(range(4), (4,)), (0, None)).sharding_type
            <ShardingType.TILED: 3>
        """
        if self._manual:
            return ShardingType.MANUAL
        return _read_back_sharding_type(self._mesh.get_op_sharding(self._partition_spec))

    @property
    def global_shape(self) -> torch.Size:
        """Shape of the whole tensor (the shard shape for a MANUAL tensor).

        Returns:
            torch.Size: the global shape.

        Example:
            >>> st.global_shape
            torch.Size([7, 5])
        """
        return self._global_shape

    shape = global_shape
    """Same as :attr:`global_shape`, as for torch_xla's sharded tensors
    (``st.shape == st.global_shape``)."""

    @property
    def dtype(self) -> torch.dtype:
        """Element type of the tensor.

        Returns:
            torch.dtype: the dtype of the shards.

        Example:
            >>> st.dtype
            torch.float32
        """
        return self._local().dtype

    @property
    def ndim(self) -> int:
        """Number of dimensions of the global tensor.

        Returns:
            int: ``len(global_shape)``.

        Example:
            >>> st.ndim
            2
        """
        return len(self._global_shape)

    @property
    def local_shards(self) -> list[XLAShard]:
        """This rank's shard, in a one-element list.

        ``indices`` is ``...`` when :attr:`sharding_type` is REPLICATED (this
        includes 0-d tensors), otherwise a list of ``slice(start, stop, 1)``,
        one per dimension, as in torch_xla. ``replica_id`` is the rank for a
        replicated tensor.

        Returns:
            List[XLAShard]: the shard with its padded ``data``, ``indices``,
            ``shard_device`` and ``replica_id``.

        Example:
            >>> shard = st.local_shards[0]
            >>> shard.indices, shard.replica_id
            ([slice(4, 7, 1), slice(0, 5, 1)], 0)
        """
        data = self._local()
        if self._manual:
            full = [slice(0, n) for n in data.shape]
            return [XLAShard(data, xla_indices(full, False), f"rank:{self._rank}", 0)]
        replicated = self.sharding_type is ShardingType.REPLICATED
        return [XLAShard(data, xla_indices(self._info.indices, replicated),
                         f"rank:{self._rank}", self._info.replica_id)]

    @property
    def global_tensor(self) -> torch.Tensor:
        """The whole tensor, materialised on every rank (a collective call).

        The padded shards are all-gathered dimension by dimension, each along
        the mesh axes that split it (``groups=mesh.groups_along(axes)``), then
        the padding is cut off. For a MANUAL tensor this is the local shard;
        for a tensor made by :func:`wrap_as_sharded_tensor`, the wrapped tensor.

        Returns:
            torch.Tensor: a new tensor of :attr:`global_shape` (the local shard
            or the wrapped tensor in those two cases).

        Example:
            >>> st = mark_sharding(torch.arange(6.0).view(3, 2), mesh, ("x", None))
            >>> st.global_tensor
            tensor([[0., 1.], [2., 3.], [4., 5.]])
        """
        if self._wrapped is not None and self._param is None:
            return self._wrapped
        data = self._local()
        if self._manual:
            return data
        return all_gather_shards(data, self._mesh, self._norm_spec, self._global_shape)

    def dim(self) -> int:
        """Number of dimensions of the global tensor.

        Returns:
            int: ``len(global_shape)``.

        Example:
            >>> st.dim()
            2
        """
        return self.ndim

    def size(self, dim: int | None = None) -> torch.Size | int:
        """The global shape, or its size along ``dim``.

        Args:
            dim (Optional[int]): a dimension, or None for the whole shape.

        Returns:
            Union[torch.Size, int]: the global shape or one of its sizes.

        Example:
            >>> st.size(0)
            7
        """
        return self._global_shape if dim is None else self._global_shape[dim]

    def __repr__(self) -> str:
        kind = self.sharding_type.name
        return (f"XLAShardedTensor(global_shape={tuple(self._global_shape)}, "
                f"spec={self._partition_spec!r}, type={kind}, rank={self._rank}, "
                f"shard={self._info.indices if not self._manual else 'manual'})")

    # -- resharding -----------------------------------------------------------------------------

    def reshard(self, partition_spec: PartitionSpec,
                mesh: Mesh | None = None) -> XLAShardedTensor:
        """Lay the tensor out by another spec (and mesh), moving the fewest bytes.

        For every destination rank and every distinct stored tile (one per set
        of replicas), the overlap of that tile with what the destination needs
        is taken from the destination itself when it holds that tile, otherwise
        from one replica only; pieces that stay on a rank are copied locally and
        the rest travel in a single all-to-all (nothing is exchanged when no
        rank needs remote data, e.g. going from replicated to tiled). A sharded
        ``nn.Parameter`` is resharded in place.

        Args:
            partition_spec (PartitionSpec): the new spec.
            mesh (Optional[Mesh]): the new mesh; default the current one.

        Returns:
            XLAShardedTensor: the tensor under the new sharding.

        Raises:
            ValueError: for an invalid mesh or spec, or a MANUAL tensor.

        Example:
            >>> st = mark_sharding(torch.arange(8.0).view(4, 2), mesh, (0, None))
            >>> st.reshard((None, 0)).local_shards[0].indices   # on 2 ranks, rank 1
            [slice(0, 4, 1), slice(1, 2, 1)]
        """
        if self._manual:
            raise ValueError(
                f"rank {self._rank}: cannot reshard a MANUAL sharded tensor; call "
                "disable_manual_sharding first"
            )
        new_mesh = self._mesh if mesh is None else check_mesh(mesh, "reshard")
        spec = as_spec(partition_spec)
        check_rank_of_spec(spec, self.ndim)
        norm = normalize(new_mesh, spec)
        plan = reshard_plan(tuple(self._global_shape), self._mesh, self._norm_spec, new_mesh,
                            norm)
        data = run_plan(plan, self._local(), self._rank, _exchange)
        out = XLAShardedTensor(data, new_mesh, spec, self._global_shape)
        if self._param is not None:
            out._bind(self._param)
        return out

    # -- checkpointing ---------------------------------------------------------------------------

    def sharded_checkpoint_tensor(self, key: str, *, allow_shape_mismatch: bool = False) -> Any:
        """The ``ringlet.checkpoint`` mapping of this rank's shard.

        The result can be put in a sharded state dict for
        :func:`ringlet.checkpoint.save` and :func:`ringlet.checkpoint.load`; it
        refers to the shard's storage, so loading fills the shard in place.
        Padding is never stored. A shard that lies on the chunk grid (every
        even split, and most uneven ones) gives one
        :class:`~ringlet.checkpoint.ShardedTensor`; the short last shard of an
        uneven split gives a :class:`~ringlet.checkpoint.ShardedTensorFactory`
        that stores it as a few grid-aligned pieces and returns the shard when
        loaded. Replicas other than ``replica_id == 0`` are not written.

        Args:
            key (str): the global name of the tensor in the checkpoint.
            allow_shape_mismatch (bool): see ``ShardedTensor``.

        Returns:
            Union[ShardedTensor, ShardedTensorFactory]: the mapping.

        Raises:
            ValueError: for a MANUAL tensor (it has no global layout).

        Example:
            >>> sd = {"w": st.sharded_checkpoint_tensor("w")}
            >>> ringlet.checkpoint.save(sd, "/tmp/ckpt")
        """
        if self._manual:
            raise ValueError(
                f"rank {self._rank}: a MANUAL sharded tensor has no global layout to checkpoint; "
                "call disable_manual_sharding first"
            )
        shard = self.local_shards[0]
        parts = [axis_parts(self._mesh, e) for e in self._norm_spec]
        return checkpoint_mapping(key, shard.unpadded_data, box_of(self._info),
                                  tuple(self._global_shape), parts, shard.replica_id,
                                  allow_shape_mismatch)


# -- the torch_xla-style functions -------------------------------------------------------------


ShardableTensor = Union[torch.Tensor, XLAShardedTensor]


def _shard_full(t: torch.Tensor, mesh: Mesh, spec: tuple[Any, ...]) -> XLAShardedTensor:
    return XLAShardedTensor(padded_shard(t, mesh, spec), mesh, spec, tuple(t.shape))


def mark_sharding(t: ShardableTensor, mesh: Mesh, partition_spec: PartitionSpec, *,
                  from_local_shards: bool = False,
                  global_shape: Sequence[int] | None = None) -> XLAShardedTensor:
    """Shard a tensor over ``mesh``: each rank keeps only its shard.

    Every rank passes the same full tensor (nothing is communicated: each rank
    slices its own shard), or, with ``from_local_shards=True``, its own shard.
    An :class:`XLAShardedTensor` (or a parameter sharded earlier) is resharded
    to the new spec, moving the fewest bytes. An ``nn.Parameter`` is sharded in
    place: its ``data`` becomes this rank's padded shard (shard parameters
    before creating the optimizer, whose state takes the parameter's shape).

    Args:
        t (Union[torch.Tensor, XLAShardedTensor]): the tensor to shard.
        mesh (Mesh): the mesh; every rank is one device, so its size must equal
            the world size.
        partition_spec (Tuple[Tuple, int, str, None]): one entry per tensor
            dimension: a mesh axis (index or name), a tuple of mesh axes (the
            dimension is split over all of them, the first major), or None
            (not split).
        from_local_shards (bool): ``t`` is this rank's shard (padded or
            unpadded) rather than the full tensor. Default: False.
        global_shape (Optional[Sequence[int]]): with ``from_local_shards``, the
            shape of the whole tensor (default: an even split).

    Returns:
        XLAShardedTensor: the sharded tensor.

    Raises:
        ShardingSpecError: (a ValueError and an AssertionError) when the mesh
            size differs from the world size, the spec length differs from the
            tensor rank, or the spec uses an axis out of range, twice, or in a
            nested tuple.
        ValueError: for other invalid specs (e.g. an unknown axis name).

    Example:
        >>> mesh = Mesh(range(4), (2, 2), ("data", "model"))   # on 4 ranks
        >>> st = mark_sharding(torch.randn(8, 32), mesh, ("data", None))
        >>> st.local_shards[0].data.shape
        torch.Size([4, 32])
        >>> linear = torch.nn.Linear(32, 10)
        >>> mark_sharding(linear.weight, mesh, ("model", None)).sharding_type
        <ShardingType.PARTIAL: 5>
        >>> linear.weight.shape                                  # sharded in place
        torch.Size([5, 32])
    """
    check_mesh(mesh, "mark_sharding")
    spec = as_spec(partition_spec)
    if isinstance(t, XLAShardedTensor):
        if from_local_shards:
            raise ValueError(
                f"rank {rank_world()[0]}: from_local_shards=True needs a torch.Tensor shard, "
                "got an XLAShardedTensor"
            )
        return t.reshard(spec, mesh)
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"rank {rank_world()[0]}: mark_sharding needs a torch.Tensor or XLAShardedTensor, "
            f"got {type(t).__name__}"
        )
    existing = getattr(t, _PARAM_ATTR, None)
    if isinstance(existing, XLAShardedTensor) and not from_local_shards:
        return existing.reshard(spec, mesh)
    if from_local_shards:
        out = XLAShardedTensor.from_local_shards(t, mesh, spec, global_shape)
    else:
        out = _shard_full(t, mesh, spec)
    if isinstance(t, torch.nn.Parameter):
        out._bind(t)
    return out


def clear_sharding(t: ShardableTensor) -> torch.Tensor:
    """Drop the sharding and return the full tensor.

    For an :class:`XLAShardedTensor` this is its :attr:`~XLAShardedTensor.global_tensor`
    (a collective call). A parameter sharded in place gets the full tensor back
    as its ``data`` and is returned itself; any other tensor is returned as is.

    Args:
        t (Union[torch.Tensor, XLAShardedTensor]): the tensor to unshard.

    Returns:
        torch.Tensor: the full tensor.

    Example:
        >>> st = mark_sharding(torch.arange(4.0), ringlet.xla.sharding.get_1d_mesh(), (0,))
        >>> clear_sharding(st)
        tensor([0., 1., 2., 3.])
    """
    if isinstance(t, XLAShardedTensor):
        full = t.global_tensor
        if t._param is not None:
            param = t._param
            t._unbind()
            param.data = full
            return param
        return full
    existing = getattr(t, _PARAM_ATTR, None)
    if isinstance(existing, XLAShardedTensor) and isinstance(t, torch.Tensor):
        full = existing.global_tensor
        existing._unbind()
        t.data = full
    return t


def wrap_as_sharded_tensor(t: ShardableTensor) -> XLAShardedTensor:
    """View a tensor as an :class:`XLAShardedTensor`.

    A sharded tensor is returned as is, a parameter sharded in place gives its
    sharded tensor, and any other tensor (the same on every rank) becomes a
    replicated sharded tensor over the global mesh (or a 1-D mesh of all ranks)
    that shares its storage and whose ``global_tensor`` is ``t`` itself (so
    :func:`unwrap_sharded_tensor` and :func:`clear_sharding` give ``t`` back,
    as in torch_xla).

    Args:
        t (Union[torch.Tensor, XLAShardedTensor]): the tensor.

    Returns:
        XLAShardedTensor: the wrapped tensor.

    Example:
        >>> wrap_as_sharded_tensor(torch.zeros(2, 2)).sharding_type   # on 2 ranks
        <ShardingType.REPLICATED: 0>
    """
    if isinstance(t, XLAShardedTensor):
        return t
    existing = wrap_if_sharded(t)
    if isinstance(existing, XLAShardedTensor):
        return existing
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"rank {rank_world()[0]}: wrap_as_sharded_tensor needs a tensor, got "
            f"{type(t).__name__}"
        )
    mesh = get_global_mesh()
    if mesh is None or mesh.size() != rank_world()[1]:
        mesh = get_1d_mesh()
    out = XLAShardedTensor(t.detach(), mesh, (None,) * t.dim(), tuple(t.shape))
    out._wrapped = t
    return out


def unwrap_sharded_tensor(t: ShardableTensor) -> torch.Tensor:
    """The plain tensor behind ``t``: the global tensor of a sharded one.

    Args:
        t (Union[torch.Tensor, XLAShardedTensor]): the tensor.

    Returns:
        torch.Tensor: ``t.global_tensor`` (a collective call) for an
        :class:`XLAShardedTensor`, otherwise ``t``.

    Example:
        >>> unwrap_sharded_tensor(torch.ones(2))
        tensor([1., 1.])
    """
    if isinstance(t, XLAShardedTensor):
        return t.global_tensor
    return t


def wrap_if_sharded(x: Any) -> Any:
    """If ``x`` is a parameter sharded in place, return its :class:`XLAShardedTensor`.

    Args:
        x (Any): any value.

    Returns:
        Any: the sharded tensor for a sharded parameter, otherwise ``x``.

    Example:
        >>> linear = torch.nn.Linear(4, 4)
        >>> wrap_if_sharded(linear.weight) is linear.weight
        True
    """
    if isinstance(x, torch.Tensor):
        existing = getattr(x, _PARAM_ATTR, None)
        if isinstance(existing, XLAShardedTensor):
            return existing
    return x


def enable_manual_sharding(t: ShardableTensor, partition_spec: PartitionSpec, *,
                           mesh: Mesh | None = None) -> XLAShardedTensor:
    """Shard ``t`` and hand this rank's padded shard over for hand-written collectives.

    The result is a MANUAL sharded tensor whose global value is the local
    shard: compute on ``result.global_tensor`` (or ``local_shards[0].data``)
    and call :func:`disable_manual_sharding` to make it a sharded tensor again.
    Parameters are not modified.

    Args:
        t (Union[torch.Tensor, XLAShardedTensor]): a full tensor (the same on
            every rank) or a sharded tensor (resharded as needed).
        partition_spec (Tuple[Tuple, int, str, None]): the sharding to apply.
        mesh (Optional[Mesh]): the mesh; default the global mesh.

    Returns:
        XLAShardedTensor: a MANUAL sharded tensor holding the padded shard.

    Raises:
        ValueError: with no mesh given or set, or an invalid mesh or spec.

    Example:
        >>> m = enable_manual_sharding(torch.arange(8.0), (0,), mesh=mesh)  # 2 ranks
        >>> m.global_tensor                                                 # rank 1
        tensor([4., 5., 6., 7.])
    """
    mesh = resolve_mesh(mesh, "enable_manual_sharding")
    spec = as_spec(partition_spec)
    if isinstance(t, XLAShardedTensor):
        sharded = t.reshard(spec, mesh) if (t._mesh, t._partition_spec) != (mesh, spec) else t
        local = sharded._local()
    else:
        local = _shard_full(unwrap_sharded_tensor(t), mesh, spec)._local()
    return XLAShardedTensor._manual_of(local, mesh, spec)


def disable_manual_sharding(t: ShardableTensor, partition_spec: PartitionSpec,
                            full_shape: torch.Size | Sequence[int], *,
                            mesh: Mesh | None = None) -> XLAShardedTensor:
    """Turn this rank's shard back into a sharded tensor of ``full_shape``.

    Nothing is communicated; the shard (padded or unpadded) is taken as this
    rank's part of the global tensor under ``partition_spec``.

    Args:
        t (Union[torch.Tensor, XLAShardedTensor]): the local shard, or the
            MANUAL sharded tensor from :func:`enable_manual_sharding`.
        partition_spec (Tuple[Tuple, int, str, None]): the sharding.
        full_shape (torch.Size): shape of the whole tensor.
        mesh (Optional[Mesh]): the mesh; default the global mesh.

    Returns:
        XLAShardedTensor: the sharded tensor.

    Raises:
        ValueError: when the shard does not fit ``full_shape`` and the spec.

    Example:
        >>> m = enable_manual_sharding(x, (0, None), mesh=mesh)
        >>> y = disable_manual_sharding(m.global_tensor * 2, (0, None), x.shape, mesh=mesh)
        >>> torch.equal(y.global_tensor, x * 2)
        True
    """
    mesh = resolve_mesh(mesh, "disable_manual_sharding")
    if isinstance(t, XLAShardedTensor) and t._manual:
        local = t._local()
    else:
        local = unwrap_sharded_tensor(t)
    return XLAShardedTensor.from_local_shards(local, mesh, partition_spec, tuple(full_shape))
