"""Tests of ringlet.checkpoint.mapping: metadata of sharded tensors, objects and factories.

Every expected value below is worked out by hand in the comment next to it.
"""

from __future__ import annotations

import pytest
import torch

from ringlet.checkpoint import (
    CheckpointingException,
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)

# --------------------------------------------------------------------------------------------
# from_rank_offsets


def test_from_rank_offsets_single_axis() -> None:
    data = torch.zeros(2, 3)
    sh = ShardedTensor.from_rank_offsets("w", data, (0, 1, 4))
    # 4 chunks of 2 rows along axis 0 -> 8 rows; chunk 1 starts at row 2.
    assert sh.key == "w"
    assert sh.data is data
    assert sh.dtype == torch.float32
    assert sh.local_shape == (2, 3)
    assert sh.global_shape == (8, 3)
    assert sh.global_offset == (2, 0)
    assert sh.axis_fragmentations == (4, 1)
    assert sh.replica_id == 0
    assert sh.prepend_axis_num == 0
    assert sh.allow_shape_mismatch is False
    assert sh.flattened_range is None
    assert sh.has_regular_grid


def test_from_rank_offsets_two_axes_and_prepended_axis() -> None:
    data = torch.zeros(2, 3, dtype=torch.bfloat16)
    sh = ShardedTensor.from_rank_offsets(
        "layers", data, (0, 5, 6), (1, 1, 2), (2, 2, 3), prepend_axis_num=1, replica_id=(0, 1)
    )
    # axis 0 is prepended (size 1): 6 chunks -> 6, offset 5
    # axis 1 is data axis 0 (size 2): 2 chunks -> 4, offset 2
    # axis 2 is data axis 1 (size 3): 3 chunks -> 9, offset 6
    assert sh.local_shape == (2, 3)
    assert sh.global_shape == (6, 4, 9)
    assert sh.global_offset == (5, 2, 6)
    assert sh.axis_fragmentations == (6, 2, 3)
    assert sh.replica_id == (0, 1)
    assert sh.dtype == torch.bfloat16
    assert sh.global_slice() == (5, slice(2, 4), slice(6, 9))
    assert sh.local_chunk_offset_in_global() == (5, 1, 2)
    assert sh.max_allowed_chunks() == (1, 2, 3)


def test_from_rank_offsets_without_offsets_is_whole_tensor() -> None:
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(3, 5))
    assert sh.global_shape == (3, 5)
    assert sh.global_offset == (0, 0)
    assert sh.axis_fragmentations == (1, 1)
    assert sh.global_slice() == (slice(0, 3), slice(0, 5))


def test_from_rank_offsets_passes_init_kwargs() -> None:
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 0, 2), allow_shape_mismatch=True)
    assert sh.allow_shape_mismatch is True
    assert sh.global_shape == (4,)


@pytest.mark.parametrize(
    "offsets",
    [
        [(0, 2, 2)],  # offset not below fragmentation
        [(0, -1, 2)],  # negative offset
        [(0, 0, 0)],  # fragmentation below 1
        [(-1, 0, 2)],  # negative axis
        [(2, 0, 2)],  # axis beyond the 2 axes
    ],
)
def test_from_rank_offsets_invalid(offsets: list) -> None:
    with pytest.raises(CheckpointingException, match=r"Invalid rank offsets.*'w'"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), *offsets)


def test_from_rank_offsets_duplicate_axis() -> None:
    with pytest.raises(CheckpointingException, match="axis 0 given twice"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 0, 2), (0, 1, 2))


def test_from_rank_offsets_rejects_flattened_range() -> None:
    with pytest.raises(CheckpointingException, match="from_rank_offsets_flat"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(4), flattened_range=slice(0, 4))
    with pytest.raises(ValueError, match="from_rank_offsets_flat"):  # Megatron's type
        ShardedTensor.from_rank_offsets("w", torch.zeros(4), flattened_range=slice(0, 4))


# --------------------------------------------------------------------------------------------
# from_rank_offsets_flat


def test_from_rank_offsets_flat() -> None:
    data = torch.arange(4.0)
    sh = ShardedTensor.from_rank_offsets_flat(
        "w", data, (2, 3), (0, 1, 2), flattened_range=slice(2, 6)
    )
    # local chunk (2, 3) is chunk 1 of 2 along axis 0 -> global (4, 3), offset (2, 0)
    assert sh.data is data
    assert sh.local_shape == (2, 3)
    assert sh.global_shape == (4, 3)
    assert sh.global_offset == (2, 0)
    assert sh.axis_fragmentations == (2, 1)
    assert sh.flattened_range == slice(2, 6)


def test_from_rank_offsets_flat_with_prepended_axis_and_replica() -> None:
    sh = ShardedTensor.from_rank_offsets_flat(
        "w",
        torch.zeros(3),
        (4,),
        (0, 2, 3),
        flattened_range=slice(1, 4),
        prepend_axis_num=1,
        replica_id=2,
    )
    assert sh.local_shape == (4,)
    assert sh.global_shape == (3, 4)
    assert sh.global_offset == (2, 0)
    assert sh.replica_id == 2
    assert sh.prepend_axis_num == 1
    assert sh.flattened_range == slice(1, 4)


def test_from_rank_offsets_flat_errors() -> None:
    with pytest.raises(CheckpointingException, match="needs a flattened_range"):
        ShardedTensor.from_rank_offsets_flat("w", torch.zeros(4), (2, 3))
    with pytest.raises(CheckpointingException, match="1-D data"):
        ShardedTensor.from_rank_offsets_flat(
            "w", torch.zeros(2, 2), (2, 3), flattened_range=slice(0, 4)
        )
    with pytest.raises(CheckpointingException, match="step"):
        ShardedTensor.from_rank_offsets_flat(
            "w", torch.zeros(2), (2, 3), flattened_range=slice(0, 4, 2)
        )
    with pytest.raises(
        CheckpointingException, match=r"data has 4 elements but the flattened range .* length 3"
    ):
        ShardedTensor.from_rank_offsets_flat(
            "w", torch.zeros(4), (2, 3), flattened_range=slice(0, 3)
        )
    # (2, 3) has 6 elements: range [4, 8) runs past the end.
    with pytest.raises(CheckpointingException, match="does not lie within the 6 elements"):
        ShardedTensor.from_rank_offsets_flat(
            "w", torch.zeros(4), (2, 3), flattened_range=slice(4, 8)
        )


# --------------------------------------------------------------------------------------------
# Direct construction and validate_metadata_integrity


def _make(**overrides: object) -> ShardedTensor:
    fields: dict = dict(
        key="w",
        data=torch.zeros(2, 3),
        dtype=torch.float32,
        local_shape=(2, 3),
        global_shape=(4, 3),
        global_offset=(2, 0),
        axis_fragmentations=(2, 1),
    )
    fields.update(overrides)
    return ShardedTensor(**fields)  # type: ignore[arg-type]


def test_direct_construction_normalises_shapes() -> None:
    sh = _make(local_shape=torch.Size([2, 3]), global_shape=[4, 3], replica_id=[0, 0])
    assert sh.local_shape == (2, 3)
    assert sh.global_shape == (4, 3)
    assert sh.replica_id == (0, 0)
    assert "data=" not in repr(sh)  # the tensor is left out of the repr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(global_offset=(2,)), "global_offset .* and global_shape .* different number of axes"),
        (dict(global_shape=(4, 3, 1), global_offset=(2, 0, 0)), "plus prepend_axis_num=0"),
        (dict(prepend_axis_num=1), "plus prepend_axis_num=1"),
        (dict(data=torch.zeros(3, 2)), r"data shape \(3, 2\) does not match local_shape \(2, 3\)"),
        (
            dict(data=torch.zeros(2, 3, dtype=torch.float16)),
            "data dtype torch.float16 does not match",
        ),
        (
            dict(global_offset=(3, 0)),
            "global offset 3 along axis 0 is not a multiple of the local size 2",
        ),
        (
            dict(global_offset=(2, 1)),
            "global offset 1 along axis 1 is not a multiple of the local size 3",
        ),
        (dict(axis_fragmentations=(2,)), "axis_fragmentations .* different number of axes"),
        (dict(data=torch.zeros(4), flattened_range=slice(0, 4, 1)), "with a step"),
        (
            dict(data=torch.zeros(4), flattened_range=slice(0, 5)),
            "length 5 but data has 4 elements",
        ),
        (dict(data=torch.zeros(2, 2), flattened_range=slice(0, 4)), "must be 1-D"),
        (
            dict(data=torch.zeros(4), flattened_range=slice(3, 7)),
            "does not lie within the 6 elements",
        ),
    ],
)
def test_metadata_errors(overrides: dict, message: str) -> None:
    with pytest.raises(CheckpointingException, match=message):
        _make(**overrides)


def test_irregular_pieces_without_a_grid() -> None:
    # Without axis_fragmentations a piece may start anywhere (Megatron allows
    # uneven pieces, e.g. for the distributed optimizer's flat state).
    sh = _make(data=torch.zeros(3), local_shape=(3,), global_shape=(10,), global_offset=(4,),
               axis_fragmentations=None)
    assert sh.global_slice() == (slice(4, 7),)
    assert not sh.has_regular_grid
    with pytest.raises(CheckpointingException, match="not a multiple of the local size 3"):
        _make(data=torch.zeros(3), local_shape=(3,), global_shape=(10,), global_offset=(4,),
              axis_fragmentations=(3,))


def test_validate_metadata_integrity_after_mutation() -> None:
    sh = _make()
    sh.validate_metadata_integrity()
    sh.local_shape = (1, 3)
    with pytest.raises(CheckpointingException, match="does not match local_shape"):
        sh.validate_metadata_integrity()


def test_empty_local_piece_may_sit_anywhere() -> None:
    # A rank without any part of the parameter: local size 0 at offset 5.
    sh = ShardedTensor("w", torch.zeros(0), torch.float32, (0,), (8,), (5,), None)
    assert sh.global_slice() == (slice(5, 5),)


# --------------------------------------------------------------------------------------------
# Grid helpers


def test_local_chunk_offset_and_max_allowed_chunks() -> None:
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 3, 4), (1, 1, 2))
    # global (8, 6); rows 6..8, cols 3..6 -> chunk (3, 1); chunk size (2, 3)
    assert sh.global_slice() == (slice(6, 8), slice(3, 6))
    assert sh.local_chunk_offset_in_global() == (3, 1)
    assert sh.max_allowed_chunks() == (2, 3)


def test_local_chunk_offset_off_grid_is_an_assertion() -> None:
    # Megatron asserts the offset is a multiple of the local size
    sh = ShardedTensor("w", torch.zeros(3), torch.float32, (3,), (10,), (4,), None)
    with pytest.raises(AssertionError, match="offset 4 is not a multiple of local size 3"):
        sh.local_chunk_offset_in_global()
    with pytest.raises(CheckpointingException):
        sh.local_chunk_offset_in_global()


def test_local_and_global_coordinates_of_a_flat_piece() -> None:
    # local shape (2, 3) holds flat elements 2..4: (0, 2), (1, 0), (1, 1)
    sh = ShardedTensor.from_rank_offsets_flat(
        "w", torch.zeros(3), (2, 3), (0, 3, 4), (1, 1, 2), flattened_range=slice(2, 5),
        prepend_axis_num=1,
    )
    local = sh.local_coordinates()
    assert isinstance(local, tuple) and len(local) == 2
    assert [c.tolist() for c in local] == [[0, 1, 1], [2, 0, 1]]
    # global offset (3, 2, 0): the prepended axis gives its offset alone
    assert sh.global_offset == (3, 2, 0)
    glob = sh.global_coordinates()
    assert glob[0] == 3
    assert [c.tolist() for c in glob[1:]] == [[2, 3, 3], [2, 0, 1]]
    whole = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 1, 2))
    for method in (whole.local_coordinates, whole.global_coordinates):
        with pytest.raises(CheckpointingException, match="without `flattened_range`"):
            method()


def test_max_allowed_chunks_not_divisible() -> None:
    sh = _make(global_shape=(7, 3), global_offset=(2, 0), axis_fragmentations=(4, 1))
    with pytest.raises(
        CheckpointingException, match=r"axis size 7 is not divisible by the axis fragmentation 4"
    ):
        sh.max_allowed_chunks()
    padded = _make(global_shape=(7, 3), axis_fragmentations=(4, 1), allow_shape_mismatch=True)
    assert padded.max_allowed_chunks() == (1, 3)  # 7 // 4, 3 // 1


def test_irregular_grid() -> None:
    sh = _make(axis_fragmentations=None)
    assert not sh.has_regular_grid
    with pytest.raises(CheckpointingException, match="regular grid"):
        sh.max_allowed_chunks()


def test_without_data_and_init_data() -> None:
    sh = ShardedTensor.from_rank_offsets("w", torch.ones(2, 3), (0, 1, 2))
    empty = sh.without_data()
    assert empty.data is None
    assert sh.data is not None
    assert (empty.local_shape, empty.global_shape, empty.global_offset) == ((2, 3), (4, 3), (2, 0))
    assert isinstance(empty, ShardedBase)
    empty.init_data("cpu", torch.zeros)
    assert empty.data is not None and empty.data.shape == (2, 3) and empty.data.sum().item() == 0
    kept = empty.data
    empty.init_data("cpu", torch.ones)  # data present: nothing happens
    assert empty.data is kept

    flat = ShardedTensor.from_rank_offsets_flat(
        "f", torch.zeros(3), (2, 3), flattened_range=slice(2, 5)
    )
    flat = flat.without_data()
    flat.init_data("meta")
    assert flat.data is not None and flat.data.shape == (3,) and flat.data.device.type == "meta"


# --------------------------------------------------------------------------------------------
# narrow


def test_narrow_regular() -> None:
    data = torch.arange(8.0).view(4, 2)
    sh = ShardedTensor.from_rank_offsets("w", data, (0, 1, 2))  # global (8, 2), offset (4, 0)
    [rows] = sh.narrow(0, 1, 2)
    # 2 of 4 local rows -> global 8 * 2 / 4 = 4 rows, offset 4 * 2 / 4 = 2
    assert rows.local_shape == (2, 2)
    assert rows.global_shape == (4, 2)
    assert rows.global_offset == (2, 0)
    assert rows.data is not None and rows.data.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    [cols] = sh.narrow(1, 1, 1)
    assert (cols.local_shape, cols.global_shape, cols.global_offset) == ((4, 1), (8, 1), (4, 0))
    assert cols.data is not None and cols.data.flatten().tolist() == [1.0, 3.0, 5.0, 7.0]


def test_narrow_with_prepended_axis() -> None:
    sh = ShardedTensor.from_rank_offsets(
        "w", torch.zeros(4, 2), (0, 3, 4), (1, 1, 2), prepend_axis_num=1
    )
    assert (sh.global_shape, sh.global_offset) == ((4, 8, 2), (3, 4, 0))
    [n] = sh.narrow(0, 2, 2)  # local axis 0 is global axis 1
    assert (n.local_shape, n.global_shape, n.global_offset) == ((2, 2), (4, 4, 2), (3, 2, 0))


def test_narrow_without_data() -> None:
    [n] = _make().without_data().narrow(1, 0, 2)
    assert n.data is None
    assert (n.local_shape, n.global_shape, n.global_offset) == ((2, 2), (4, 2), (2, 0))


def test_narrow_flattened() -> None:
    # Local chunk (4, 3), chunk 1 of 2 -> global (8, 3), offset (4, 0); holds flat [5, 10).
    data = torch.arange(5.0, 10.0)
    sh = ShardedTensor.from_rank_offsets_flat(
        "w", data, (4, 3), (0, 1, 2), flattened_range=slice(5, 10)
    )
    # Rows 1..3 are flat [3, 9); overlap with [5, 10) is [5, 9), i.e. [2, 6) of the narrowed block.
    [mid] = sh.narrow(0, 1, 2)
    assert mid.local_shape == (2, 3)
    assert mid.global_shape == (4, 3)
    assert mid.global_offset == (2, 0)
    assert mid.flattened_range == slice(2, 6)
    assert mid.data is not None and mid.data.tolist() == [5.0, 6.0, 7.0, 8.0]
    # Row 0 is flat [0, 3): no overlap at all.
    assert sh.narrow(0, 0, 1) == []
    # Row 3 is flat [9, 12): overlap [9, 10) -> [0, 1).
    [last] = sh.narrow(0, 3, 1)
    assert (last.local_shape, last.global_shape, last.global_offset) == ((1, 3), (2, 3), (1, 0))
    assert last.flattened_range == slice(0, 1)
    assert last.data is not None and last.data.tolist() == [9.0]
    with pytest.raises(CheckpointingException, match="only be narrowed along axis 0"):
        sh.narrow(1, 0, 1)


def test_narrow_out_of_bounds() -> None:
    with pytest.raises(CheckpointingException, match="out of bounds"):
        _make().narrow(0, 1, 2)
    with pytest.raises(CheckpointingException, match="cannot narrow axis 2"):
        _make().narrow(2, 0, 1)


# --------------------------------------------------------------------------------------------
# Replicas, non-persistent values, objects


@pytest.mark.parametrize(
    ("replica_id", "expected"),
    [
        (0, True),
        (1, False),
        ((0, 0), True),
        ((0, 1), False),
        ((2, 0, 0), False),
        ((), True),
        ([0, 0], True),
    ],
)
def test_is_main_replica(replica_id: object, expected: bool) -> None:
    assert is_main_replica(replica_id) is expected  # type: ignore[arg-type]


def test_local_nonpersistent_object() -> None:
    value = {"seed": 3}
    wrapped = LocalNonpersistentObject(value)
    assert wrapped.unwrap() is value
    assert wrapped.obj is value


def test_sharded_object_unique_key_round_trip() -> None:
    obj = ShardedObject("rng", {"state": 1}, (2, 4), (1, 3), replica_id=(0, 1))
    assert obj.unique_key == "rng/shard_1.3_2.4"
    assert str(obj) == "ShardedObject(key='rng')"
    back = ShardedObject.empty_from_unique_key(obj.unique_key, replica_id=5)
    assert back == ShardedObject("rng", None, (2, 4), (1, 3), 5)
    assert back.without_data() == back
    assert obj.without_data().data is None


def test_sharded_object_key_with_slashes_and_legacy_keys() -> None:
    obj = ShardedObject("optimizer/state/0", None, (4,), (2,))
    assert obj.unique_key == "optimizer/state/0/shard_2_4"
    back = ShardedObject.empty_from_unique_key(obj.unique_key)
    assert (back.key, back.global_offset, back.global_shape) == ("optimizer/state/0", (2,), (4,))
    # A key written without its last global dimension gets -1 there.
    legacy = ShardedObject.empty_from_unique_key("a/shard_1.2_3")
    assert (legacy.global_offset, legacy.global_shape) == ((1, 2), (3, -1))


@pytest.mark.parametrize(
    "bad", ["noslash", "a/shard_1", "a/chunk_1_2", "a/shard_x_2", "/shard_0_1"]
)
def test_sharded_object_bad_unique_key(bad: str) -> None:
    with pytest.raises(CheckpointingException, match="is not a ShardedObject unique key"):
        ShardedObject.empty_from_unique_key(bad)


def test_sharded_object_metadata_error() -> None:
    with pytest.raises(CheckpointingException, match="different number of axes"):
        ShardedObject("o", 1, (2, 2), (0,))


# --------------------------------------------------------------------------------------------
# Factories


def _split_build(key: str, data: torch.Tensor, replica_id: object, flattened_range: object) -> dict:
    top, bottom = data.chunk(2)
    return {
        "top": ShardedTensor.from_rank_offsets(f"{key}.top", top, replica_id=replica_id),
        "bottom": ShardedTensor.from_rank_offsets(f"{key}.bottom", bottom, replica_id=replica_id),
    }


def _split_merge(loaded: dict) -> torch.Tensor:
    return torch.cat([loaded["top"], loaded["bottom"]])


def test_factory_build_receives_its_fields() -> None:
    seen = []

    def build(key: str, data: torch.Tensor, replica_id: object, flattened_range: object) -> dict:
        seen.append((key, data, replica_id, flattened_range))
        return {}

    data = torch.zeros(2)
    factory = ShardedTensorFactory(
        "w", data, build, _split_merge, replica_id=(0, 1), flattened_range=slice(0, 1)
    )
    assert factory.build() == {}
    assert seen == [("w", data, (0, 1), slice(0, 1))]
    factory.validate_metadata_integrity()
    assert factory.without_data().data is None


def test_apply_factories_and_merges() -> None:
    weight = torch.arange(12.0).view(4, 3)
    sd = {
        "layer": {"w": ShardedTensorFactory("w", weight, _split_build, _split_merge), "n": 1},
        "lst": [2],
    }
    apply_factories(sd)
    built = sd["layer"]["w"]
    assert set(built) == {"top", "bottom"}
    assert built["top"].key == "w.top" and built["top"].global_shape == (2, 3)
    assert built["bottom"].data.tolist() == [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]

    factories = {"layer": {"w": ShardedTensorFactory("w", None, _split_build, _split_merge)}}
    loaded = {
        "layer": {"w": {"top": weight[:2].clone(), "bottom": weight[2:].clone()}, "n": 1},
        "lst": [2],
    }
    out = apply_factory_merges(loaded, factories)
    assert out is loaded
    assert torch.equal(out["layer"]["w"], weight)
    assert out["layer"]["n"] == 1


def test_apply_factories_inside_lists() -> None:
    sd = {"params": [ShardedTensorFactory("p", torch.zeros(2, 1), _split_build, _split_merge), 5]}
    apply_factories(sd)
    assert sd["params"][1] == 5
    assert sd["params"][0]["top"].key == "p.top"
    merged = apply_factory_merges(
        {"params": [{"top": torch.ones(1, 1), "bottom": torch.zeros(1, 1)}, 5]},
        {"params": {0: ShardedTensorFactory("p", None, _split_build, _split_merge)}},
    )
    assert merged["params"][0].flatten().tolist() == [1.0, 0.0]
    merged = apply_factory_merges(
        [{"top": torch.ones(1), "bottom": torch.ones(1)}],
        [ShardedTensorFactory("p", None, _split_build, _split_merge)],
    )
    assert merged[0].tolist() == [1.0, 1.0]


def test_apply_factory_merges_errors() -> None:
    f = ShardedTensorFactory("w", None, _split_build, _split_merge)
    with pytest.raises(CheckpointingException, match="key 'b' at <root> is missing"):
        apply_factory_merges({"a": 1}, {"b": f})
    with pytest.raises(CheckpointingException, match=r"lengths \(1 and 2\) at x"):
        apply_factory_merges({"x": [1]}, {"x": [f, f]})
    with pytest.raises(CheckpointingException, match="non-integer key 'k'"):
        apply_factory_merges([1], {"k": f})
    with pytest.raises(CheckpointingException, match="index 3 out of range"):
        apply_factory_merges([1], {3: f})
    with pytest.raises(CheckpointingException, match="cannot merge int with dict at a"):
        apply_factory_merges({"a": 1}, {"a": {"b": f}})
    # Megatron raises ValueError for all of these: the errors are both
    with pytest.raises(ValueError, match="index -2 out of range"):
        apply_factory_merges([1], {-2: f})
    with pytest.raises(ValueError, match="missing"):
        apply_factory_merges({"a": 1}, {"b": f})
    # a negative index addresses the list from its end, as Python indexing does
    merged = apply_factory_merges(
        [0, {"top": torch.ones(1), "bottom": torch.zeros(1)}], {-1: f}
    )
    assert merged[1].tolist() == [1.0, 0.0]
