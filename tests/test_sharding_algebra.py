"""Tests for ringlet.xla.sharding: meshes, partition specs and the sharding algebra.

Expected values are worked out by hand from torch_xla's rules:

* tile assignment: transpose the logical mesh so that the axes used by the
  spec come first (in spec order) followed by the unused axes (ascending),
  then merge the axes of each tuple entry;
* sharding type: PARTIAL when the tile assignment has more axes than the
  spec has entries, else MAXIMAL for a 1-device mesh, REPLICATED when every
  entry is None, PARTIAL when some are, TILED otherwise;
* replication groups: one per tile, listing (row-major) the ranks along the
  unused axes; the group assignment numbers them row-major over the tile
  grid, with 1 on unsplit tensor dimensions.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import pytest
import torch

import ringlet
from ringlet import errors
from ringlet.errors import ShardingSpecError
from ringlet.xla.sharding import (
    HybridMesh,
    Mesh,
    OpSharding,
    ShardIndices,
    ShardingSpec,
    ShardingType,
    _read_back_sharding_type,
    _translate_named_partition_spec,
    all_shard_indices,
    assemble_shards,
    extract_shard,
    get_1d_mesh,
    get_global_mesh,
    normalize_partition_spec,
    set_global_mesh,
    shard_indices,
)

P = ShardingType.PARTIAL
T = ShardingType.TILED
R = ShardingType.REPLICATED
M = ShardingType.MAXIMAL


def check(mesh: Mesh, spec, tile, groups_grid, groups, kind, text) -> None:
    """Assert every field of mesh.get_op_sharding(spec) and its text form."""
    op = mesh.get_op_sharding(spec)
    assert op.tile_assignment == tile
    assert op.group_assignment == groups_grid
    assert op.replication_groups == groups
    assert op.sharding_type is kind
    assert repr(op) == text


# --------------------------------------------------------------------- Mesh


def test_mesh_basic_named():
    mesh = Mesh(np.arange(8), (4, 2), ("x", "y"))
    assert mesh.size() == 8
    assert isinstance(mesh.size(), int)
    assert mesh.shape() == OrderedDict([("x", 4), ("y", 2)])
    assert list(mesh.shape().items()) == [("x", 4), ("y", 2)]
    assert mesh.get_logical_mesh().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.mesh_shape == (4, 2)
    assert mesh.axis_names == ("x", "y")
    assert mesh.get_axis_name_idx("x") == 0
    assert mesh.get_axis_name_idx("y") == 1
    assert mesh.get_axis_name_idx("z") is None
    assert mesh.device_ids.tolist() == list(range(8))


def test_mesh_unnamed_custom_order():
    mesh = Mesh([3, 1, 0, 2], [2, 2])
    assert mesh.shape() == OrderedDict([(0, 2), (1, 2)])
    assert mesh.get_logical_mesh().tolist() == [[3, 1], [0, 2]]
    assert mesh.get_axis_name_idx("x") is None
    assert mesh.axis_names is None
    assert mesh.mesh_shape == (2, 2)
    assert mesh.rank_coords(0) == (1, 0)
    assert mesh.rank_coords(2) == (1, 1)


def test_mesh_flattens_nd_ids_and_is_read_only():
    mesh = Mesh(np.array([[0, 2], [1, 3]]), (4,))
    assert mesh.get_logical_mesh().tolist() == [0, 2, 1, 3]
    with pytest.raises(ValueError, match="read-only"):
        mesh.device_ids[0] = 3
    logical = mesh.get_logical_mesh()
    logical[0] = 99  # a copy: the mesh is unchanged
    assert mesh.get_logical_mesh().tolist() == [0, 2, 1, 3]


def test_mesh_equality_and_hash():
    a = Mesh(range(4), (2, 2), ("x", "y"))
    b = Mesh([0, 1, 2, 3], [2, 2], ["x", "y"])
    assert a == b and hash(a) == hash(b)
    assert a != Mesh(range(4), (2, 2))
    assert a != Mesh([1, 0, 2, 3], (2, 2), ("x", "y"))
    assert a != Mesh(range(4), (4,), ("x",))
    assert "mesh_shape=(2, 2)" in repr(a)


@pytest.mark.parametrize(
    "ids, shape, names, match",
    [
        (range(4), (2, 2), ("x",), r"got 1 axis names \('x',\) for a mesh of rank 2"),
        (range(4), (4,), ("x", "y"), "got 2 axis names"),
        (range(4), (2, 2), ("x", "x"), r"axis names must be distinct; \['x'\]"),
        (range(4), (2, 2), "xy", "not a single string"),
        (range(4), (2, 2), (0, 1), "axis names must be strings"),
        (range(6), (2, 2), None, r"got 6 device ids but mesh_shape \(2, 2\) has 4"),
        (range(3), (2, 2), None, "got 3 device ids"),
        ([0, 0, 1, 2], (2, 2), None, r"device ids must be distinct; repeated: \[0\]"),
        ([0, 1, 2, 7], (2, 2), None, r"must lie in \[0, 4\).*out of range: \[7\]"),
        ([-1, 0, 1, 2], (2, 2), None, r"out of range: \[-1\]"),
        ([0.0, 1.0], (2,), None, "device_ids must be integers"),
        (range(4), (2, 0), None, "positive ints"),
        (range(4), (2, -2), None, "positive ints"),
        ([0], (), None, "at least one axis"),
    ],
)
def test_mesh_errors(ids, shape, names, match):
    with pytest.raises(ValueError, match=match):
        Mesh(ids, shape, names)


def test_mesh_shape_wrong_kind():
    with pytest.raises(TypeError, match="mesh_shape must be a sequence of positive ints"):
        Mesh(range(4), 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mesh_shape must be a sequence"):
        Mesh(range(4), "4")  # type: ignore[arg-type]


def test_rank_coords_errors():
    mesh = Mesh(range(4), (2, 2))
    with pytest.raises(ValueError, match="rank 4 is not in this mesh"):
        mesh.rank_coords(4)
    with pytest.raises(ValueError, match="is not in this mesh"):
        mesh.rank_coords("0")


def test_axis_index():
    mesh = Mesh(range(4), (2, 2), ("x", "y"))
    assert mesh.axis_index("y") == 1
    assert mesh.axis_index(np.int64(0)) == 0
    with pytest.raises(ValueError, match="axis name 'z' is not defined"):
        mesh.axis_index("z")
    with pytest.raises(ValueError, match="mesh axis 2 is out of range"):
        mesh.axis_index(2)
    with pytest.raises(ValueError, match="must be an int or a str"):
        mesh.axis_index(1.0)
    with pytest.raises(ValueError, match="axis name 'x' is not defined"):
        Mesh(range(4), (2, 2)).axis_index("x")


# ----------------------------------------------------- global mesh, 1d mesh


@pytest.fixture
def restore_global_mesh():
    saved = get_global_mesh()
    yield
    set_global_mesh(saved)


def test_global_mesh(restore_global_mesh):
    set_global_mesh(None)
    assert get_global_mesh() is None
    mesh = Mesh(range(2), (2,), ("data",))
    set_global_mesh(mesh)
    assert get_global_mesh() is mesh
    with pytest.raises(TypeError, match="expected a Mesh"):
        set_global_mesh((2,))


def test_get_1d_mesh(monkeypatch):
    monkeypatch.setattr(ringlet.core.groups, "world_size", lambda: 4, raising=False)
    mesh = get_1d_mesh("data")
    assert mesh.mesh_shape == (4,)
    assert mesh.axis_names == ("data",)
    assert mesh.get_logical_mesh().tolist() == [0, 1, 2, 3]
    unnamed = get_1d_mesh()
    assert unnamed.axis_names is None
    assert unnamed.shape() == OrderedDict([(0, 4)])
    monkeypatch.setattr(ringlet.core.groups, "world_size", lambda: 1, raising=False)
    assert get_1d_mesh().get_logical_mesh().tolist() == [0]


# ----------------------------------------------------------- partition specs


def test_normalize_partition_spec():
    mesh = Mesh(range(8), (2, 2, 2), ("a", "b", "c"))
    assert normalize_partition_spec(mesh, (("c", "a"), None, "b")) == ((2, 0), None, 1)
    assert normalize_partition_spec(mesh, [0, (1, "c")]) == (0, (1, 2))  # the spec may be a list
    # ...but an axis group is a tuple, as torch_xla requires: list entries are refused
    for bad in ([0, [1, "c"]], ([0], None), (None, ["b"])):
        with pytest.raises(ValueError, match=r"list \(.*\) is not supported"):
            normalize_partition_spec(mesh, bad)
        with pytest.raises(ValueError, match="list"):
            _translate_named_partition_spec(mesh, bad)
        with pytest.raises(ValueError, match="list"):
            mesh.get_op_sharding(bad)
    assert normalize_partition_spec(mesh, (np.int64(1),)) == (1,)
    assert normalize_partition_spec(mesh, ()) == ()
    assert normalize_partition_spec(mesh, (("b",),)) == ((1,),)


@pytest.mark.parametrize(
    "spec, match",
    [
        (("q", None), "axis name 'q' is not defined in the given mesh"),
        (((0, (1,)),), "cannot contain nested tuples"),
        (((0, None),), "None cannot appear inside an axis tuple"),
        ((1.5,), "float .* is not supported"),
        ((True,), "bool .* is not supported"),
        ((2,), "refers to mesh axis 2, out of range for a mesh of rank 2"),
        ((-1, None), "refers to mesh axis -1, out of range"),
        (((0, 2),), "refers to mesh axis 2"),
        ((0, 0), r"at most once.*axis \[0\]"),
        (("x", 0), r"at most once.*axis \[0\]"),
        ((("x", "y"), "y"), r"at most once.*axis \[1\]"),
        (((), None), "empty tuple"),
    ],
)
def test_partition_spec_errors(spec, match):
    mesh = Mesh(range(4), (2, 2), ("x", "y"))
    with pytest.raises(ValueError, match=match):
        mesh.get_op_sharding(spec)


@pytest.mark.parametrize("spec", ["x", 0, None, {0: 1}])
def test_partition_spec_wrong_kind(spec):
    mesh = Mesh(range(4), (2, 2), ("x", "y"))
    with pytest.raises(TypeError, match="partition_spec must be a tuple"):
        mesh.get_op_sharding(spec)


def test_name_on_unnamed_mesh_rejected():
    with pytest.raises(ValueError, match="axis name 'x' is not defined"):
        Mesh(range(4), (2, 2)).get_op_sharding(("x", None))


# ------------------------------------------------------- op sharding, rank 1


def test_rank1_mesh():
    mesh = Mesh(range(4), (4,), ("x",))
    check(mesh, ("x",), [0, 1, 2, 3], [], [], T, "{devices=[4]0,1,2,3}")
    check(mesh, (0, None), [0, 1, 2, 3], [[0], [1], [2], [3]],
          [[0], [1], [2], [3]], P, "{devices=[4,1]0,1,2,3}")
    check(mesh, (None, "x"), [0, 1, 2, 3], [[0, 1, 2, 3]],
          [[0], [1], [2], [3]], P, "{devices=[1,4]0,1,2,3}")
    check(mesh, (None,), [0, 1, 2, 3], [], [], R, "{replicated}")
    check(mesh, (None, None), [0, 1, 2, 3], [], [], R, "{replicated}")
    check(mesh, (), [], [], [], R, "{replicated}")


def test_rank1_mesh_custom_order():
    mesh = Mesh([2, 0, 3, 1], (4,))
    check(mesh, (0,), [2, 0, 3, 1], [], [], T, "{devices=[4]2,0,3,1}")
    check(mesh, (0, None), [2, 0, 3, 1], [[0], [1], [2], [3]],
          [[2], [0], [3], [1]], P, "{devices=[4,1]2,0,3,1}")


def test_single_device_mesh():
    mesh = Mesh([0], (1,))
    check(mesh, (0,), [0], [], [], M, "{replicated}")
    check(mesh, (None, None), [0], [], [], M, "{replicated}")
    # A mesh with more axes than the spec uses is PARTIAL even on 1 device.
    mesh2 = Mesh([0], (1, 1))
    check(mesh2, (0,), [[0]], [0], [[0]], P, "{replicated}")
    check(mesh2, (0, 1), [[0]], [], [], M, "{replicated}")


# ------------------------------------------------------- op sharding, rank 2


def test_rank2_named_mesh():
    mesh = Mesh(range(8), (4, 2), ("x", "y"))
    check(mesh, ("x", "y"), [[0, 1], [2, 3], [4, 5], [6, 7]], [], [], T,
          "{devices=[4,2]0,1,2,3,4,5,6,7}")
    check(mesh, ("y", "x"), [[0, 2, 4, 6], [1, 3, 5, 7]], [], [], T,
          "{devices=[2,4]0,2,4,6,1,3,5,7}")
    check(mesh, ("x", None), [[0, 1], [2, 3], [4, 5], [6, 7]],
          [[0], [1], [2], [3]], [[0, 1], [2, 3], [4, 5], [6, 7]], P,
          "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}")
    check(mesh, (None, "y"), [[0, 2, 4, 6], [1, 3, 5, 7]], [[0, 1]],
          [[0, 2, 4, 6], [1, 3, 5, 7]], P,
          "{devices=[1,2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}")
    # A 1-d tensor over a 2-d mesh: the unused axis replicates.
    check(mesh, ("x",), [[0, 1], [2, 3], [4, 5], [6, 7]], [0, 1, 2, 3],
          [[0, 1], [2, 3], [4, 5], [6, 7]], P,
          "{devices=[4,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}")
    check(mesh, ("y",), [[0, 2, 4, 6], [1, 3, 5, 7]], [0, 1],
          [[0, 2, 4, 6], [1, 3, 5, 7]], P,
          "{devices=[2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}")
    check(mesh, (None, None), [[0, 1], [2, 3], [4, 5], [6, 7]], [], [], R,
          "{replicated}")
    # All-None spec shorter than the mesh: PARTIAL with a single group,
    # which XLA prints as replicated.
    check(mesh, (None,), [[0, 1], [2, 3], [4, 5], [6, 7]], [0],
          [[0, 1, 2, 3, 4, 5, 6, 7]], P, "{replicated}")


def test_rank2_tuple_specs():
    mesh = Mesh(range(8), (4, 2), ("x", "y"))
    check(mesh, (("x", "y"),), [0, 1, 2, 3, 4, 5, 6, 7], [], [], T,
          "{devices=[8]0,1,2,3,4,5,6,7}")
    check(mesh, (("y", "x"),), [0, 2, 4, 6, 1, 3, 5, 7], [], [], T,
          "{devices=[8]0,2,4,6,1,3,5,7}")
    check(mesh, (("x", "y"), None), [0, 1, 2, 3, 4, 5, 6, 7],
          [[0], [1], [2], [3], [4], [5], [6], [7]],
          [[0], [1], [2], [3], [4], [5], [6], [7]], P,
          "{devices=[8,1]0,1,2,3,4,5,6,7}")
    # A one-axis tuple is the same as the bare axis.
    assert mesh.get_op_sharding((("x",), None)) == mesh.get_op_sharding(("x", None))


def test_rank2_unnamed_custom_order():
    mesh = Mesh([3, 1, 0, 2], (2, 2))
    check(mesh, (0, 1), [[3, 1], [0, 2]], [], [], T, "{devices=[2,2]3,1,0,2}")
    check(mesh, (1, 0), [[3, 0], [1, 2]], [], [], T, "{devices=[2,2]3,0,1,2}")
    # XLA sorts the ranks inside each replication group; we keep the
    # tile-assignment order in replication_groups.
    check(mesh, (1, None), [[3, 0], [1, 2]], [[0], [1]], [[3, 0], [1, 2]], P,
          "{devices=[2,1,2]0,3,1,2 last_tile_dim_replicate}")
    check(mesh, (None, 0), [[3, 1], [0, 2]], [[0, 1]], [[3, 1], [0, 2]], P,
          "{devices=[1,2,2]1,3,0,2 last_tile_dim_replicate}")


def test_brief_examples():
    mesh = Mesh(range(4), (2, 2))
    assert repr(mesh.get_op_sharding((0, None))) == \
        "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"
    assert repr(mesh.get_op_sharding((0, 1))) == "{devices=[2,2]0,1,2,3}"
    assert repr(mesh.get_op_sharding((None, None))) == "{replicated}"


# ------------------------------------------------------- op sharding, rank 3


def test_rank3_mesh():
    # Logical mesh L[i, j, k] = 4i + 2j + k.
    mesh = Mesh(range(8), (2, 2, 2), ("a", "b", "c"))
    # order (b, a, c): T[j, i, k] = L[i, j, k]
    check(mesh, ("b", None, "a"), [[[0, 1], [4, 5]], [[2, 3], [6, 7]]],
          [[[0, 1]], [[2, 3]]], [[0, 1], [4, 5], [2, 3], [6, 7]], P,
          "{devices=[2,1,2,2]0,1,4,5,2,3,6,7 last_tile_dim_replicate}")
    # order (c, a, b), merge (c, a) -> row = 2k + i
    check(mesh, (("c", "a"), "b"), [[0, 2], [4, 6], [1, 3], [5, 7]], [], [], T,
          "{devices=[4,2]0,2,4,6,1,3,5,7}")
    check(mesh, ("c",), [[[0, 2], [4, 6]], [[1, 3], [5, 7]]], [0, 1],
          [[0, 2, 4, 6], [1, 3, 5, 7]], P,
          "{devices=[2,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}")
    check(mesh, (("a", "c"), None), [[0, 2], [1, 3], [4, 6], [5, 7]],
          [[0], [1], [2], [3]], [[0, 2], [1, 3], [4, 6], [5, 7]], P,
          "{devices=[4,1,2]0,2,1,3,4,6,5,7 last_tile_dim_replicate}")
    check(mesh, (("a", "b", "c"),), list(range(8)), [], [], T,
          "{devices=[8]0,1,2,3,4,5,6,7}")
    check(mesh, (("c", "b", "a"),), [0, 4, 2, 6, 1, 5, 3, 7], [], [], T,
          "{devices=[8]0,4,2,6,1,5,3,7}")
    check(mesh, (None, None, None), [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], [], [],
          R, "{replicated}")


# ------------------------------------------------------- op sharding, rank 4


def test_rank4_mesh():
    # Logical mesh L[a, b, c, d] = 4a + 2c + d (axis x has size 1).
    mesh = Mesh(range(8), (2, 1, 2, 2), ("w", "x", "y", "z"))
    check(mesh, ("w", "x", "y", "z"),
          [[[[0, 1], [2, 3]]], [[[4, 5], [6, 7]]]], [], [], T,
          "{devices=[2,1,2,2]0,1,2,3,4,5,6,7}")
    # Axis x is unused but has size 1: PARTIAL with singleton groups, which
    # XLA prints as a plain tiling.
    check(mesh, ("z", ("w", "y")),
          [[[0], [2], [4], [6]], [[1], [3], [5], [7]]],
          [[0, 1, 2, 3], [4, 5, 6, 7]],
          [[0], [2], [4], [6], [1], [3], [5], [7]], P,
          "{devices=[2,4]0,2,4,6,1,3,5,7}")
    # order (x, y, z, w): T[b, c, d, a]
    check(mesh, (None, "x", "y", "z"),
          [[[[0, 4], [1, 5]], [[2, 6], [3, 7]]]],
          [[[[0, 1], [2, 3]]]], [[0, 4], [1, 5], [2, 6], [3, 7]], P,
          "{devices=[1,1,2,2,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}")
    check(mesh, ("y", None), [[[[0, 1]], [[4, 5]]], [[[2, 3]], [[6, 7]]]],
          [[0], [1]], [[0, 1, 4, 5], [2, 3, 6, 7]], P,
          "{devices=[2,1,4]0,1,4,5,2,3,6,7 last_tile_dim_replicate}")


def test_rank4_mesh_custom_order():
    ids = [7, 6, 5, 4, 3, 2, 1, 0, 8, 9, 10, 11, 12, 13, 14, 15]
    mesh = Mesh(ids, (2, 2, 2, 2))
    # Spec uses axes 3 then 0; unused 1, 2 -> groups of 4.
    op = mesh.get_op_sharding((3, 0))
    logical = np.array(ids).reshape(2, 2, 2, 2)
    expected = logical.transpose(3, 0, 1, 2)
    assert op.tile_assignment == expected.tolist()
    assert op.sharding_type is P
    # group (d, a) lists ids[8a + 4b + 2c + d] over (b, c)
    assert op.replication_groups == [[7, 5, 3, 1], [8, 10, 12, 14],
                                     [6, 4, 2, 0], [9, 11, 13, 15]]
    assert op.group_assignment == [[0, 1], [2, 3]]
    assert repr(op) == ("{devices=[2,2,4]1,3,5,7,8,10,12,14,0,2,4,6,9,11,13,15"
                        " last_tile_dim_replicate}")


# -------------------------------------------------------- OpSharding object


def test_op_sharding_value_object():
    mesh = Mesh(range(4), (2, 2), ("x", "y"))
    a = mesh.get_op_sharding(("x", None))
    b = OpSharding([[0, 1], [2, 3]], [[0], [1]], [[0, 1], [2, 3]], 5)
    assert a == b and hash(a) == hash(b)
    assert b.sharding_type is ShardingType.PARTIAL
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.sharding_type = ShardingType.TILED  # type: ignore[misc]
    assert a.xla_tile_assignment().tolist() == [[[0, 1]], [[2, 3]]]
    assert a.replicate_on_last_tile_dim is True
    tiled = mesh.get_op_sharding(("x", "y"))
    assert tiled.xla_tile_assignment().tolist() == [[0, 1], [2, 3]]
    assert tiled.replicate_on_last_tile_dim is False
    assert mesh.get_op_sharding((None, None)).xla_tile_assignment() is None
    assert str(tiled) == repr(tiled)


def test_op_sharding_other_kinds():
    assert repr(OpSharding.replicated()) == "{replicated}"
    assert OpSharding.replicated().sharding_type is R
    assert repr(OpSharding.manual()) == "{manual}"
    assert OpSharding.manual().sharding_type is ShardingType.MANUAL
    assert repr(OpSharding([], [], [], ShardingType.UNKNOWN)) == "{unknown}"
    assert repr(OpSharding([], [], [], ShardingType.TUPLE)) == "{tuple}"
    bad = OpSharding([0, 1], [0, 1], [[0, 1]], ShardingType.PARTIAL)
    assert "invalid" in repr(bad)
    with pytest.raises(ValueError, match="one replication group per entry"):
        bad.xla_tile_assignment()


def test_sharding_type_values():
    assert [(t.name, int(t)) for t in ShardingType] == [
        ("REPLICATED", 0), ("MAXIMAL", 1), ("TUPLE", 2), ("TILED", 3),
        ("MANUAL", 4), ("PARTIAL", 5), ("UNKNOWN", 6)]


def test_op_sharding_is_cached():
    mesh = Mesh(range(8), (4, 2), ("x", "y"))
    first = mesh.get_op_sharding(("x", None))
    assert mesh.get_op_sharding(("x", None)) is first
    assert mesh.get_op_sharding((0, None)) is first  # same after resolving
    assert mesh.get_op_sharding([0, None]) is first
    assert mesh.get_op_sharding(("y", None)) is not first


# ------------------------------------------------------------ ShardingSpec


def test_sharding_spec():
    mesh = Mesh(range(8), (4, 2), ("x", "y"))
    spec = ShardingSpec(mesh, ("x", None))
    assert spec.minibatch is False
    assert spec._tile_assignment == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert spec._group_assignment == [[0], [1], [2], [3]]
    assert spec._replication_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert spec._sharding_type is P
    assert spec.op_sharding is mesh.get_op_sharding(("x", None))
    assert spec.can_apply(torch.zeros(8, 3))
    assert not spec.can_apply(torch.zeros(8))
    assert not spec.can_apply(torch.zeros(8, 3, 1))
    assert spec.shard_indices((8, 3), 3).indices == (slice(2, 4), slice(0, 3))
    assert spec == ShardingSpec(Mesh(range(8), (4, 2), ("x", "y")), ("x", None))
    assert spec != ShardingSpec(mesh, ("x", None), minibatch=True)
    # A 1-d spec on a 2-d mesh follows get_op_sharding (PARTIAL).
    assert ShardingSpec(mesh, ("x",))._sharding_type is P
    listed = ShardingSpec(mesh, [None, "y"], True)
    assert listed.partition_spec == (None, "y") and listed.minibatch is True
    scalar = ShardingSpec(mesh, ())
    assert scalar._sharding_type is R and scalar._tile_assignment == []
    assert scalar.can_apply(torch.tensor(1.0))


def test_sharding_spec_xla_spec():
    mesh = Mesh(range(8), (4, 2), ("x", "y"))
    spec = ShardingSpec(mesh, ("x", None))
    # None when the spec does not fit the tensor (torch_xla's can_apply check)
    assert spec.xla_spec(torch.zeros(8)) is None
    assert spec.xla_spec(torch.zeros(8, 3, 1)) is None
    op = spec.xla_spec(torch.zeros(8, 3))
    assert op is mesh.get_op_sharding(("x", None))
    assert repr(op) == "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"


def test_op_sharding_args_and_helper_keywords():
    """torch_xla's private helpers, called with its argument names."""
    from ringlet.xla.sharding import _get_group_assignment, _get_sharding_type, _get_tile_assignment

    mesh = Mesh(range(8), (2, 2, 2), ("a", "b", "c"))
    # a 2-d spec over a 3-d mesh: axis c (the unused one) replicates
    assert mesh._get_op_sharding_args(("b", "a")) == (
        [[[0, 1], [4, 5]], [[2, 3], [6, 7]]],
        [[0, 1], [2, 3]],
        [[0, 1], [4, 5], [2, 3], [6, 7]],
        5,
    )
    assert mesh._get_op_sharding_args((("a", "b", "c"),)) == (
        [0, 1, 2, 3, 4, 5, 6, 7], [], [], 3)
    assert mesh._get_op_sharding_args((None, None, None)) == (
        [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], [], [], 0)
    assert type(mesh._get_op_sharding_args(("a", None, None))[3]) is int
    with pytest.raises(ValueError, match="not defined"):
        mesh._get_op_sharding_args(("q",))
    tiles = _get_tile_assignment(mesh=mesh, partition_spec=(2, None))
    assert tiles.tolist() == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]
    assert _get_sharding_type(partition_spec=(2, None), num_devices=8) is P
    assert _get_sharding_type(partition_spec=(None, None), num_devices=8) is R
    assert _get_sharding_type(partition_spec=(0, 1), num_devices=1) is M
    assert _get_group_assignment(sharding_type=P, tile_assignment=tiles, tensor_rank=2,
                                 replicate_dims={1}) == ([[0], [1]], [[0, 2, 4, 6], [1, 3, 5, 7]])
    assert _get_group_assignment(sharding_type=T, tile_assignment=tiles, tensor_rank=2,
                                 replicate_dims=set()) == ([], [])


def test_sharding_spec_rejects_bad_spec():
    mesh = Mesh(range(4), (2, 2), ("x", "y"))
    with pytest.raises(ValueError, match="axis name 'q' is not defined"):
        ShardingSpec(mesh, ("q",))
    with pytest.raises(ValueError, match="at most once"):
        ShardingSpec(mesh, ("x", "x"))


# --------------------------------------------------------------- HybridMesh


@pytest.fixture
def one_host(monkeypatch):
    monkeypatch.setattr(ringlet.core.groups, "host_layout", lambda: [[0, 1, 2, 3]],
                        raising=False)


def test_hybrid_mesh_one_host_default_layout(one_host):
    mesh = HybridMesh(ici_mesh_shape=(2, 2), axis_names=("data", "model"))
    assert mesh.dcn_mesh_shape == (1, 1)
    assert mesh.ici_mesh_shape == (2, 2)
    assert mesh.host_layout == ((0, 1, 2, 3),)
    assert mesh.get_logical_mesh().tolist() == [[0, 1], [2, 3]]
    assert mesh.shape() == OrderedDict([("data", 2), ("model", 2)])
    assert isinstance(mesh, Mesh)
    assert mesh.groups_along("model") == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="all ranks are on a single host"):
        HybridMesh(ici_mesh_shape=(2, 1), dcn_mesh_shape=(2, 1))
    with pytest.raises(ValueError, match=r"the host has 4 ranks .* ici_mesh_shape \(2, 1\)"):
        HybridMesh(ici_mesh_shape=(2, 1))


def test_hybrid_mesh_before_init(monkeypatch):
    monkeypatch.setattr(ringlet.core.groups, "host_layout", lambda: [[0]], raising=False)
    mesh = HybridMesh(ici_mesh_shape=(1,))
    assert mesh.get_logical_mesh().tolist() == [0]
    assert mesh.host_layout == ((0,),)


def test_hybrid_mesh_one_host_explicit_layout():
    mesh = HybridMesh(ici_mesh_shape=(1, 4, 1), dcn_mesh_shape=(1, 1, 1),
                      host_layout=[[0, 1, 2, 3]])
    assert mesh.get_logical_mesh().tolist() == [[[0], [1], [2], [3]]]
    assert mesh.shape() == OrderedDict([(0, 1), (1, 4), (2, 1)])


def test_hybrid_mesh_two_hosts():
    layout = [[0, 1], [2, 3]]
    mesh = HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1),
                      axis_names=("dcn", "ici"), host_layout=layout)
    assert mesh.get_logical_mesh().tolist() == [[0, 1], [2, 3]]
    assert mesh.groups_along("ici") == [[0, 1], [2, 3]]  # inside a host
    assert mesh.groups_along("dcn") == [[0, 2], [1, 3]]  # across hosts
    # Hosts side by side along the second axis instead.
    mesh = HybridMesh(ici_mesh_shape=(2, 1), dcn_mesh_shape=(1, 2),
                      host_layout=layout)
    assert mesh.get_logical_mesh().tolist() == [[0, 2], [1, 3]]
    assert mesh.mesh_shape == (2, 2)
    # Ranks assigned round-robin to hosts.
    mesh = HybridMesh(ici_mesh_shape=(2,), dcn_mesh_shape=(2,),
                      host_layout=[[0, 2], [1, 3]])
    assert mesh.get_logical_mesh().tolist() == [0, 2, 1, 3]


def test_hybrid_mesh_two_hosts_three_axes():
    layout = [[0, 1, 2, 3], [4, 5, 6, 7]]
    mesh = HybridMesh(ici_mesh_shape=(1, 2, 2), dcn_mesh_shape=(2, 1, 1),
                      axis_names=("data", "fsdp", "tensor"), host_layout=layout)
    assert mesh.shape() == OrderedDict([("data", 2), ("fsdp", 2), ("tensor", 2)])
    assert mesh.get_logical_mesh().tolist() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert mesh.groups_along("data") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Both ICI and DCN parts on one axis: host blocks placed like np.block.
    mesh = HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(1, 2),
                      host_layout=layout)
    assert mesh.get_logical_mesh().tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    blocks = [np.array(h).reshape(2, 2) for h in layout]
    assert np.array_equal(mesh.get_logical_mesh(), np.block([blocks]))
    mesh = HybridMesh(ici_mesh_shape=(2, 2), dcn_mesh_shape=(2, 1),
                      host_layout=layout)
    assert mesh.get_logical_mesh().tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_hybrid_mesh_four_hosts_grid():
    layout = [[0, 1], [2, 3], [4, 5], [6, 7]]
    mesh = HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 2),
                      host_layout=layout)
    blocks = [np.array(h).reshape(1, 2) for h in layout]
    expected = np.block([[blocks[0], blocks[1]], [blocks[2], blocks[3]]])
    assert mesh.get_logical_mesh().tolist() == expected.tolist() == \
        [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ici_mesh_shape": (2, 1)}, "span 2 hosts: give a dcn_mesh_shape"),
        ({"ici_mesh_shape": (2,), "dcn_mesh_shape": (1,)}, "span 2 hosts"),
        ({"ici_mesh_shape": (1, 2), "dcn_mesh_shape": (4, 1)},
         r"there are 2 hosts, which must equal the product of dcn_mesh_shape \(4, 1\)"),
        ({"ici_mesh_shape": (2, 2), "dcn_mesh_shape": (2, 1)},
         r"host 0 has 2 ranks \[0, 1\], which must equal the product of ici_mesh_shape"),
        ({"ici_mesh_shape": (2, 1), "dcn_mesh_shape": (2,)},
         "must have the same number of axes"),
        ({"ici_mesh_shape": (2, 0), "dcn_mesh_shape": (1, 2)}, "positive ints"),
        ({"ici_mesh_shape": (1, 2), "dcn_mesh_shape": (2, 1), "axis_names": ("a",)},
         "got 1 axis names"),
    ],
)
def test_hybrid_mesh_errors_two_hosts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HybridMesh(host_layout=[[0, 1], [2, 3]], **kwargs)


@pytest.mark.parametrize(
    "layout, match",
    [
        ([[0, 1], [1, 2]], "each rank 0..3 exactly once"),
        ([[0, 1], [3, 4]], "each rank 0..3 exactly once"),
        ([[0], []], r"host_layout\[1\] lists no ranks"),
        ([], "lists no hosts"),
        ([[0, 1.0]], "must hold int ranks"),
    ],
)
def test_hybrid_mesh_bad_layout(layout, match):
    with pytest.raises(ValueError, match=match):
        HybridMesh(ici_mesh_shape=(2,), host_layout=layout)


@pytest.mark.parametrize(
    "layout, match",
    [
        ([0, 1], r"host_layout\[0\] must be a list of ranks"),
        ("01", "must be a list of lists"),
        (None, "must be a list of lists"),
    ],
)
def test_hybrid_mesh_layout_wrong_kind(layout, match, monkeypatch):
    monkeypatch.setattr(ringlet.core.groups, "host_layout", lambda: layout, raising=False)
    with pytest.raises(TypeError, match=match):
        HybridMesh(ici_mesh_shape=(2,))


def test_hybrid_mesh_is_keyword_only():
    with pytest.raises(TypeError):
        HybridMesh((2,), (1,))  # type: ignore[misc]


# -------------------------------------------------------------- groups_along


def test_groups_along():
    mesh = Mesh(range(8), (2, 2, 2), ("a", "b", "c"))
    assert mesh.groups_along(1) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.groups_along("b") == mesh.groups_along(1)
    assert mesh.groups_along("a") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.groups_along("c") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.groups_along(("c", "a")) == [[0, 4, 1, 5], [2, 6, 3, 7]]
    assert mesh.groups_along(("a", "b", "c")) == [list(range(8))]
    custom = Mesh([3, 1, 0, 2], (2, 2))
    assert custom.groups_along(0) == [[3, 0], [1, 2]]
    assert custom.groups_along(1) == [[3, 1], [0, 2]]
    assert Mesh(range(6), (2, 3)).groups_along(1) == [[0, 1, 2], [3, 4, 5]]
    assert Mesh(range(6), (2, 3)).groups_along(0) == [[0, 3], [1, 4], [2, 5]]
    # Replication groups of a spec are the groups along its unused axes.
    assert mesh.get_op_sharding(("b",)).replication_groups == \
        mesh.groups_along(("a", "c"))


def test_groups_along_errors():
    mesh = Mesh(range(8), (2, 2, 2), ("a", "b", "c"))
    with pytest.raises(ValueError, match="axis name 'q' is not defined"):
        mesh.groups_along("q")
    with pytest.raises(ValueError, match="mesh axis 3 is out of range"):
        mesh.groups_along(3)
    with pytest.raises(ValueError, match="mesh axes repeated"):
        mesh.groups_along(("a", 0))
    with pytest.raises(ValueError, match="must be an int or a str"):
        mesh.groups_along(0.5)


# ------------------------------------------------------------ shard indices


def test_shard_indices_uneven_1d():
    mesh = Mesh(range(4), (4,), ("x",))
    got = [shard_indices((10,), mesh, ("x",), r) for r in range(4)]
    assert [s.indices for s in got] == [(slice(0, 3),), (slice(3, 6),),
                                        (slice(6, 9),), (slice(9, 10),)]
    assert all(s.shard_shape == (3,) for s in got)
    assert [s.unpadded_shape for s in got] == [(3,), (3,), (3,), (1,)]
    assert [s.padding for s in got] == [(0,), (0,), (0,), (2,)]
    assert [s.tile_index for s in got] == [(0,), (1,), (2,), (3,)]
    assert [s.replica_id for s in got] == [0, 0, 0, 0]
    assert got[2] == ShardIndices(2, (slice(6, 9),), (3,), (2,), 0)


def test_shard_indices_wholly_past_end():
    mesh = Mesh(range(4), (4,))
    got = all_shard_indices((5,), mesh, (0,))
    assert [s.indices for s in got] == [(slice(0, 2),), (slice(2, 4),),
                                        (slice(4, 5),), (slice(5, 5),)]
    assert got[3].unpadded_shape == (0,) and got[3].padding == (2,)
    tiny = all_shard_indices((2,), mesh, (0,))
    assert [s.indices for s in tiny] == [(slice(0, 1),), (slice(1, 2),),
                                         (slice(2, 2),), (slice(2, 2),)]
    assert [s.shard_shape for s in tiny] == [(1,)] * 4
    empty = shard_indices((0, 3), mesh, (0, None), 2)
    assert empty.indices == (slice(0, 0), slice(0, 3))
    assert empty.shard_shape == (0, 3)


def test_shard_indices_tuple_spec_rank3_mesh():
    mesh = Mesh(range(8), (2, 2, 2), ("a", "b", "c"))
    s = shard_indices((10, 3), mesh, (("c", "a"), "b"), 5)  # coords (1, 0, 1)
    assert s.indices == (slice(9, 10), slice(0, 2))
    assert s.shard_shape == (3, 2)
    assert s.tile_index == (3, 0)
    assert s.padding == (2, 0)
    assert s.replica_id == 0
    s = shard_indices((10, 3), mesh, (("c", "a"), "b"), 6)  # coords (1, 1, 0)
    assert s.indices == (slice(3, 6), slice(2, 3))
    assert s.tile_index == (1, 1)
    assert s.padding == (0, 1)


def test_shard_indices_partial_replica_ids():
    mesh = Mesh(range(8), (2, 2, 2), ("a", "b", "c"))
    s6 = shard_indices((5,), mesh, ("c",), 6)  # c = 0; replicas 0, 2, 4, 6
    assert s6.indices == (slice(0, 3),) and s6.replica_id == 3
    s1 = shard_indices((5,), mesh, ("c",), 1)  # c = 1; replicas 1, 3, 5, 7
    assert s1.indices == (slice(3, 5),) and s1.replica_id == 0
    assert s1.padding == (1,)
    named = Mesh(range(8), (4, 2), ("x", "y"))
    s = shard_indices((7, 5), named, (None, "x"), 5)  # coords (2, 1)
    assert s.indices == (slice(0, 7), slice(4, 5))  # chunk ceil(5 / 4) = 2
    assert s.shard_shape == (7, 2) and s.padding == (0, 1)
    assert s.tile_index == (0, 2)
    assert s.replica_id == 1  # replicas 4, 5


def test_shard_indices_custom_order_and_replicated():
    mesh = Mesh([3, 1, 0, 2], (2, 2))
    # groups [[3, 0], [1, 2]]: replica ids count in sorted rank order.
    s3 = shard_indices((4, 4), mesh, (1, None), 3)
    assert s3.indices == (slice(0, 2), slice(0, 4)) and s3.replica_id == 1
    s0 = shard_indices((4, 4), mesh, (1, None), 0)
    assert s0.indices == (slice(0, 2), slice(0, 4)) and s0.replica_id == 0
    s2 = shard_indices((4, 4), mesh, (1, None), 2)
    assert s2.indices == (slice(2, 4), slice(0, 4)) and s2.replica_id == 1
    # Fully replicated: every rank holds all of it; replica id == rank.
    for r in range(4):
        s = shard_indices((3, 2), mesh, (None, None), r)
        assert s.indices == (slice(0, 3), slice(0, 2))
        assert s.shard_shape == (3, 2) and s.replica_id == r
    scalar = shard_indices((), mesh, (), 2)
    assert scalar.indices == () and scalar.shard_shape == () and scalar.replica_id == 2
    single = shard_indices((3,), Mesh([0], (1,)), (0,), 0)
    assert single.indices == (slice(0, 3),) and single.replica_id == 0


def test_shard_indices_errors():
    mesh = Mesh(range(4), (2, 2), ("x", "y"))
    with pytest.raises(ValueError,
                       match=r"spec length \(1\) should be equal to the tensor rank \(2\)"):
        shard_indices((4, 4), mesh, ("x",), 0)
    with pytest.raises(ValueError, match="rank 4 is not in this mesh"):
        shard_indices((4, 4), mesh, ("x", "y"), 4)
    with pytest.raises(ValueError, match="non-negative ints"):
        shard_indices((4, -1), mesh, ("x", "y"), 0)
    with pytest.raises(ValueError, match="non-negative ints"):
        shard_indices(4, mesh, ("x",), 0)
    with pytest.raises(ValueError, match="axis name 'q'"):
        shard_indices((4,), mesh, ("q",), 0)
    assert shard_indices(torch.Size([4, 4]), mesh, ("x", "y"), 3).indices == \
        (slice(2, 4), slice(2, 4))


def _xla_reference(op: OpSharding, global_shape: Sequence[int],
                   size: int) -> list[tuple[tuple[slice, ...], int]]:
    """Shard slices and replica ids the way torch_xla derives them from the
    canonical XLA device tile (an independent path from shard_indices)."""
    tile = op.xla_tile_assignment()
    result: list[tuple[tuple[slice, ...], int] | None] = [None] * size
    if tile is None:
        for r in range(size):
            result[r] = (tuple(slice(0, d) for d in global_shape), r)
        return result  # type: ignore[return-value]
    data_dims = tile.shape[:-1] if op.replicate_on_last_tile_dim else tile.shape
    chunk = [-(-d // n) for d, n in zip(global_shape, data_dims)]
    for pos in itertools.product(*(range(n) for n in tile.shape)):
        rank = int(tile[pos])
        idx = pos[:len(data_dims)]
        rid = pos[-1] if op.replicate_on_last_tile_dim else 0
        slices = tuple(slice(min(i * c, d), min((i + 1) * c, d))
                       for i, c, d in zip(idx, chunk, global_shape))
        result[rank] = (slices, rid)
    return result  # type: ignore[return-value]


@pytest.mark.parametrize(
    "ids, shape, spec, global_shape",
    [
        (range(8), (4, 2), (0, None), (7, 3)),
        (range(8), (4, 2), (None, 1), (7, 3)),
        (range(8), (4, 2), ((1, 0),), (13,)),
        (range(8), (4, 2), (1,), (5,)),
        ([3, 1, 0, 2], (2, 2), (1, None), (3, 5)),
        ([3, 1, 0, 2], (2, 2), (None, 0), (3, 5)),
        (range(8), (2, 2, 2), (1, None, 0), (3, 2, 5)),
        (range(8), (2, 2, 2), ((2, 0), 1), (10, 3)),
        (range(8), (2, 2, 2), (2,), (5,)),
        (range(8), (2, 1, 2, 2), (3, (0, 2)), (3, 9)),
        (range(8), (2, 1, 2, 2), (None, 1, 2, 3), (2, 2, 3, 1)),
        ([7, 6, 5, 4, 3, 2, 1, 0, 8, 9, 10, 11, 12, 13, 14, 15], (2, 2, 2, 2),
         (3, 0), (5, 3)),
        ([5, 2, 7, 0, 3, 6, 1, 4], (2, 2, 2), ((1, 2), None, 0), (7, 2, 1)),
    ],
)
def test_shard_indices_match_xla_tile(ids, shape, spec, global_shape):
    mesh = Mesh(ids, shape)
    ref = _xla_reference(mesh.get_op_sharding(spec), global_shape, mesh.size())
    for r in range(mesh.size()):
        s = shard_indices(global_shape, mesh, spec, r)
        assert (s.indices, s.replica_id) == ref[r]


def test_extract_and_assemble_round_trip():
    mesh = Mesh([5, 2, 7, 0, 3, 6, 1, 4], (2, 2, 2), ("a", "b", "c"))
    full = torch.arange(7 * 5 * 3, dtype=torch.float32).reshape(7, 5, 3)
    for spec in [("a", ("c", "b"), None), (None, "b", None), ("c", None, "a"),
                 (None, None, None), (("a", "b", "c"), None, None)]:
        shards = [extract_shard(full, mesh, spec, r) for r in range(8)]
        for r, shard in enumerate(shards):
            info = shard_indices(full.shape, mesh, spec, r)
            assert tuple(shard.shape) == info.shard_shape
            assert shard.is_contiguous()
            core = shard[tuple(slice(0, n) for n in info.unpadded_shape)]
            assert torch.equal(core, full[info.indices])
            assert shard.sum() == core.sum()  # padding is zero
        assert torch.equal(assemble_shards(shards, full.shape, mesh, spec), full)


def test_extract_shard_padding_values():
    mesh = Mesh(range(4), (4,))
    t = torch.arange(1, 6)
    assert extract_shard(t, mesh, (0,), 2).tolist() == [5, 0]
    assert extract_shard(t, mesh, (0,), 3).tolist() == [0, 0]
    shard = extract_shard(torch.ones(5, 2, dtype=torch.bfloat16), mesh, (0, None), 2)
    assert shard.dtype == torch.bfloat16
    assert shard.tolist() == [[1, 1], [0, 0]]


def test_assemble_shards_errors():
    mesh = Mesh(range(2), (2,))
    with pytest.raises(ValueError, match=r"one shard per rank \(2\), got 1"):
        assemble_shards([torch.zeros(2)], (3,), mesh, (0,))
    with pytest.raises(ValueError,
                       match=r"rank 1 has shape \(1,\), expected the padded shard shape \(2,\)"):
        assemble_shards([torch.zeros(2), torch.zeros(1)], (3,), mesh, (0,))


# ------------------------------------------- torch_xla's asserts, private names


@pytest.mark.parametrize(
    "ids, shape, names, match",
    [
        (range(4), (2, 2), ("x",), r"got 1 axis names \('x',\) for a mesh of rank 2"),
        (range(4), (2, 2), ("x", "x"), r"axis names must be distinct; \['x'\]"),
        (range(6), (2, 2), None, r"got 6 device ids but mesh_shape \(2, 2\) has 4"),
        ([0, 0, 1, 2], (2, 2), None, r"device ids must be distinct; repeated: \[0\]"),
        ([0, 1, 2, 7], (2, 2), None, r"out of range: \[7\]"),
    ],
)
def test_mesh_assert_sites_raise_sharding_spec_error(ids, shape, names, match):
    # torch_xla asserts here: AssertionError and ValueError both catch it.
    with pytest.raises(AssertionError, match=match):
        Mesh(ids, shape, names)
    with pytest.raises(ValueError, match=match) as info:
        Mesh(ids, shape, names)
    assert type(info.value) is ShardingSpecError


def test_sharding_spec_error_is_value_and_assertion_error():
    assert issubclass(ShardingSpecError, ValueError)
    assert issubclass(ShardingSpecError, AssertionError)
    assert "ShardingSpecError" in errors.__all__
    # errors torch_xla raises as ValueError stay plain ValueErrors
    with pytest.raises(ValueError, match="positive ints") as info:
        Mesh(range(4), (2, 0))
    assert not isinstance(info.value, AssertionError)
    mesh = Mesh(range(4), (2, 2), ("x", "y"))
    with pytest.raises(ValueError, match="axis name 'q' is not defined") as info:
        mesh.get_op_sharding(("q", None))
    assert not isinstance(info.value, AssertionError)


@pytest.mark.parametrize(
    "spec, match",
    [
        (((0, (1,)),), "cannot contain nested tuples"),
        ((2,), "refers to mesh axis 2, out of range for a mesh of rank 2"),
        ((-1, None), "refers to mesh axis -1, out of range"),
        ((0, 0), r"at most once.*axis \[0\]"),
        ((("x", "y"), "y"), r"at most once.*axis \[1\]"),
    ],
)
def test_partition_spec_assert_sites(spec, match):
    mesh = Mesh(range(4), (2, 2), ("x", "y"))
    with pytest.raises(AssertionError, match=match):
        mesh.get_op_sharding(spec)
    with pytest.raises(ShardingSpecError, match=match):
        ShardingSpec(mesh, spec)


def test_hybrid_mesh_axis_count_mismatch_asserts():
    with pytest.raises(AssertionError, match="must have the same number of axes"):
        HybridMesh(ici_mesh_shape=(2, 1), dcn_mesh_shape=(2,), host_layout=[[0, 1], [2, 3]])


def test_shard_indices_spec_length_asserts():
    with pytest.raises(AssertionError, match=r"length \(1\) should be equal .* rank \(2\)"):
        shard_indices((4, 4), Mesh(range(2), (2,)), (0,), 0)


def test_translate_named_partition_spec():
    mesh = Mesh(range(8), (2, 2, 2), ("a", "b", "c"))
    assert _translate_named_partition_spec(mesh, (("c", "a"), None, "b")) == ((2, 0), None, 1)
    assert _translate_named_partition_spec(mesh, (0, "c")) == (0, 2)
    assert _translate_named_partition_spec(mesh, ()) == ()
    with pytest.raises(ValueError, match="axis name 'q' is not defined"):
        _translate_named_partition_spec(mesh, ("q",))
    with pytest.raises(AssertionError, match="nested tuples"):
        _translate_named_partition_spec(mesh, ((0, (1, 2)),))


def test_read_back_sharding_type():
    # what torch_xla reads back from the sharding XLA builds; the OpSharding keeps its type
    one = Mesh([0], (1,), ("x",))
    maximal = one.get_op_sharding(("x", None))
    assert maximal.sharding_type is M
    assert _read_back_sharding_type(maximal) is R
    mesh14 = Mesh(range(4), (1, 4))
    single_group = mesh14.get_op_sharding((0, None))
    assert single_group.sharding_type is P
    assert single_group.replication_groups == [[0, 1, 2, 3]]
    assert _read_back_sharding_type(single_group) is R
    mesh41 = Mesh(range(4), (4, 1))
    singletons = mesh41.get_op_sharding((0, None))
    assert singletons.sharding_type is P
    assert singletons.replication_groups == [[0], [1], [2], [3]]
    assert _read_back_sharding_type(singletons) is T
    mesh22 = Mesh(range(4), (2, 2))
    assert _read_back_sharding_type(mesh22.get_op_sharding((0, None))) is P
    assert _read_back_sharding_type(mesh22.get_op_sharding((0, 1))) is T
    assert _read_back_sharding_type(mesh22.get_op_sharding((None, None))) is R
    assert _read_back_sharding_type(mesh22.get_op_sharding(())) is R
    assert _read_back_sharding_type(OpSharding.manual()) is ShardingType.MANUAL
