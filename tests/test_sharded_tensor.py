"""Eager sharded tensors on real processes: layouts, round trips, resharding, manual sharding.

Each multi-process test launches 4 ranks once and runs many cases inside, to
keep the file short on small machines. Expected shards are computed here with
plain torch slicing (an independent re-statement of the layout rules, plus
hand-worked literals), never with the algebra under test.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import traceback
from typing import Any

import numpy as np
import pytest
import torch

import ringlet
from ringlet.errors import ShardingSpecError
from ringlet.xla import sharded_tensor as stm
from ringlet.xla.sharding import (
    Mesh,
    ShardingSpec,
    ShardingType,
    XLAShardedTensor,
    clear_sharding,
    disable_manual_sharding,
    enable_manual_sharding,
    mark_sharding,
    set_global_mesh,
    unwrap_sharded_tensor,
    wrap_as_sharded_tensor,
    wrap_if_sharded,
)

from conftest import launch

MESH_SHAPES = [(4,), (2, 2), (1, 4)]
SPECS_2D = [(0, None), (None, 1), ((0, 1), None), (1, 0), (None, None)]
SPECS_1D = [(0, None), (None, 0), (None, None)]
SHAPES = [(7, 5), (8, 4)]

# Hand-worked layouts of a 7 x 5 tensor on the (2, 2) mesh [[0, 1], [2, 3]] and the
# (1, 4) mesh [[0, 1, 2, 3]]: rank -> (row slice, column slice, padded shape, replica id).
HAND_WORKED: dict[tuple[tuple[int, ...], Any], dict[int, tuple[Any, ...]]] = {
    ((2, 2), ((0, 1), None)): {
        0: ((0, 2), (0, 5), (2, 5), 0),
        1: ((2, 4), (0, 5), (2, 5), 0),
        2: ((4, 6), (0, 5), (2, 5), 0),
        3: ((6, 7), (0, 5), (2, 5), 0),
    },
    ((2, 2), (1, 0)): {
        0: ((0, 4), (0, 3), (4, 3), 0),
        1: ((4, 7), (0, 3), (4, 3), 0),
        2: ((0, 4), (3, 5), (4, 3), 0),
        3: ((4, 7), (3, 5), (4, 3), 0),
    },
    ((2, 2), (0, None)): {
        0: ((0, 4), (0, 5), (4, 5), 0),
        1: ((0, 4), (0, 5), (4, 5), 1),
        2: ((4, 7), (0, 5), (4, 5), 0),
        3: ((4, 7), (0, 5), (4, 5), 1),
    },
    ((1, 4), (None, 1)): {
        0: ((0, 7), (0, 2), (7, 2), 0),
        1: ((0, 7), (2, 4), (7, 2), 0),
        2: ((0, 7), (4, 5), (7, 2), 0),
        3: ((0, 7), (5, 5), (7, 2), 0),  # wholly padding
    },
    # PARTIAL with a single replication group: read back as REPLICATED, indices are `...`
    ((1, 4), (0, None)): {r: (None, None, (7, 5), r) for r in range(4)},
}

R = ShardingType.REPLICATED
T = ShardingType.TILED
P = ShardingType.PARTIAL

# (mesh shape, spec) -> (type built by get_op_sharding, type torch_xla reads back), by hand.
HAND_TYPES: dict[tuple[tuple[int, ...], Any], tuple[ShardingType, ShardingType]] = {
    ((4,), (0, None)): (P, T),            # four singleton replication groups
    ((4,), (None, 0)): (P, T),
    ((4,), (None, None)): (R, R),
    ((2, 2), (0, None)): (P, P),          # two groups of two
    ((2, 2), (None, 1)): (P, P),
    ((2, 2), ((0, 1), None)): (P, T),
    ((2, 2), (1, 0)): (T, T),
    ((2, 2), (None, None)): (R, R),
    ((1, 4), (0, None)): (P, R),          # a single group of four
    ((1, 4), (None, 1)): (P, T),
    ((1, 4), ((0, 1), None)): (P, T),
    ((1, 4), (1, 0)): (T, T),
    ((1, 4), (None, None)): (R, R),
}


def specs_for(mesh_shape: tuple[int, ...]) -> list[Any]:
    return SPECS_1D if len(mesh_shape) == 1 else SPECS_2D


def make_mesh(mesh_shape: tuple[int, ...]) -> Mesh:
    return Mesh(list(range(math.prod(mesh_shape))), mesh_shape)


def full_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = torch.arange(1, math.prod(shape) + 1, dtype=torch.float64).reshape(shape) * 1.5
    return t.to(dtype) if dtype != torch.bool else (t.long() % 3 == 0)


def ref_layout(shape: tuple[int, ...], mesh_shape: tuple[int, ...], spec: Any,
               rank: int) -> tuple[tuple[slice, ...], tuple[int, ...], int]:
    """(slices into the global tensor, padded shard shape, replica id) by the rules of the issue."""
    grid = np.arange(math.prod(mesh_shape)).reshape(mesh_shape)
    coords = [int(c) for c in np.argwhere(grid == rank)[0]]
    slices, padded, used = [], [], set()
    for n, entry in zip(shape, spec):
        axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        used.update(axes)
        parts, idx = 1, 0
        for a in axes:
            parts *= mesh_shape[a]
            idx = idx * mesh_shape[a] + coords[a]
        chunk = -(-n // parts)
        lo = min(idx * chunk, n)
        slices.append(slice(lo, min(lo + chunk, n)))
        padded.append(chunk)
    same = [r for r in range(grid.size)
            if all(np.argwhere(grid == r)[0][a] == coords[a] for a in used)]
    replica = same.index(rank) if len(same) > 1 else 0
    return tuple(slices), tuple(padded), replica


def ref_kind(shape: tuple[int, ...], mesh_shape: tuple[int, ...], spec: Any) -> ShardingType:
    """The read-back type: REPLICATED when no dimension is split, TILED when no rank
    shares its tile, PARTIAL otherwise."""
    tiles = 1
    for entry in spec:
        axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        tiles *= math.prod(mesh_shape[a] for a in axes)
    if tiles == 1:
        return ShardingType.REPLICATED
    return ShardingType.TILED if tiles == math.prod(mesh_shape) else ShardingType.PARTIAL


def ref_indices(shape: tuple[int, ...], mesh_shape: tuple[int, ...], spec: Any,
                rank: int) -> Any:
    """torch_xla's XLAShard.indices: `...` when replicated, else a list of step-1 slices."""
    if len(shape) == 0 or ref_kind(shape, mesh_shape, spec) is ShardingType.REPLICATED:
        return Ellipsis
    return [slice(s.start, s.stop, 1) for s in ref_layout(shape, mesh_shape, spec, rank)[0]]


def expected_shard(full: torch.Tensor, mesh_shape: tuple[int, ...], spec: Any,
                   rank: int) -> torch.Tensor:
    slices, padded, _ = ref_layout(tuple(full.shape), mesh_shape, spec, rank)
    out = torch.zeros(padded, dtype=full.dtype)
    out[tuple(slice(0, s.stop - s.start) for s in slices)] = full[slices]
    return out


def expected_received(shape: tuple[int, ...], src: tuple[Any, Any], dst: tuple[Any, Any],
                      rank: int) -> int:
    """Elements this rank must receive: what it needs minus what it already stores."""
    have = torch.zeros(shape, dtype=torch.bool)
    need = torch.zeros(shape, dtype=torch.bool)
    have[ref_layout(shape, src[0], src[1], rank)[0]] = True
    need[ref_layout(shape, dst[0], dst[1], rank)[0]] = True
    return int((need & ~have).sum())


class ExchangeSpy:
    """Wraps the module's single data-movement function and counts what it receives."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self._orig = stm._exchange

    def __call__(self, send: list[torch.Tensor], recv: list[torch.Tensor]) -> None:
        self.calls.append(sum(r.numel() for r in recv))
        self._orig(send, recv)

    def __enter__(self) -> ExchangeSpy:
        stm._exchange = self
        return self

    def __exit__(self, *exc: object) -> None:
        stm._exchange = self._orig


def check_layout(st: XLAShardedTensor, full: torch.Tensor, mesh_shape: tuple[int, ...],
                 spec: Any, rank: int, what: str) -> None:
    slices, padded, replica = ref_layout(tuple(full.shape), mesh_shape, spec, rank)
    shards = st.local_shards
    assert len(shards) == 1, what
    shard = shards[0]
    want = ref_indices(tuple(full.shape), mesh_shape, spec, rank)
    if want is Ellipsis:
        assert shard.indices is Ellipsis, f"{what}: indices {shard.indices} != ..."
    else:
        assert isinstance(shard.indices, list), f"{what}: indices {shard.indices!r}"
        assert shard.indices == want, f"{what}: indices {shard.indices} != {want}"
        assert all(s.step == 1 for s in shard.indices), what
    assert st.sharding_type is ref_kind(tuple(full.shape), mesh_shape, spec), what
    assert tuple(shard.data.shape) == padded, f"{what}: padded shape {shard.data.shape}"
    assert shard.replica_id == replica, f"{what}: replica {shard.replica_id} != {replica}"
    assert torch.equal(shard.data, expected_shard(full, mesh_shape, spec, rank)), what
    assert torch.equal(shard.unpadded_data, full[slices]), what
    assert st.global_shape == full.shape and st.shape == full.shape, what
    assert st.dtype == full.dtype, what


def sweep(rank: int, world: int, quick: bool) -> int:
    """Layouts, round trips and every reshard; returns the number of cases checked."""
    return _sweep(rank, quick)


def _sweep(rank: int, quick: bool) -> int:
    checked = 0
    mesh_shapes = [(2, 2)] if quick else MESH_SHAPES
    shapes = [(7, 5)] if quick else SHAPES
    for mesh_shape, shape in itertools.product(mesh_shapes, shapes):
        mesh = make_mesh(mesh_shape)
        full = full_tensor(shape)
        specs = specs_for(mesh_shape)
        sharded = {}
        for spec in specs:
            what = f"rank {rank} mesh {mesh_shape} shape {shape} spec {spec}"
            st = mark_sharding(full, mesh, spec)
            check_layout(st, full, mesh_shape, spec, rank, what)
            hand = HAND_WORKED.get((mesh_shape, spec)) if shape == (7, 5) else None
            if hand is not None:
                rows, cols, padded, replica = hand[rank]
                shard = st.local_shards[0]
                if rows is None:
                    assert shard.indices is Ellipsis, what
                else:
                    assert shard.indices == [slice(*rows, 1), slice(*cols, 1)], what
                assert tuple(shard.data.shape) == padded and shard.replica_id == replica, what
            built, read_back = HAND_TYPES[(mesh_shape, spec)]
            assert mesh.get_op_sharding(spec).sharding_type is built, what
            assert st.sharding_type is read_back, what
            assert torch.equal(st.global_tensor, full), f"{what}: global round trip"
            assert torch.equal(clear_sharding(st), full), what
            # from local shards: unpadded and padded, with and without the global shape
            slices = ref_layout(shape, mesh_shape, spec, rank)[0]
            again = mark_sharding(full[slices].clone(), mesh, spec, from_local_shards=True,
                                  global_shape=shape)
            check_layout(again, full, mesh_shape, spec, rank, what + " from_local_shards")
            padded_again = XLAShardedTensor.from_local_shards(
                st.local_shards, mesh, spec, shape)
            assert torch.equal(padded_again.global_tensor, full), what
            sharded[spec] = st
            checked += 1
        # every pair of specs, bytes moved = what is needed and not already held
        for src, dst in itertools.product(specs, specs):
            what = f"rank {rank} mesh {mesh_shape} shape {shape} reshard {src} -> {dst}"
            with ExchangeSpy() as spy:
                out = sharded[src].reshard(dst)
            check_layout(out, full, mesh_shape, dst, rank, what)
            assert torch.equal(out.global_tensor, full), what
            want = expected_received(shape, (mesh_shape, src), (mesh_shape, dst), rank)
            assert sum(spy.calls) == want, f"{what}: received {spy.calls}, expected {want}"
            everyone = [
                expected_received(shape, (mesh_shape, src), (mesh_shape, dst), r)
                for r in range(4)
            ]
            assert len(spy.calls) == (1 if any(everyone) else 0), f"{what}: {spy.calls}"
            checked += 1
    if quick:
        return checked
    # resharding across meshes, other dtypes, and mark_sharding on a sharded tensor
    for dtype in (torch.int64, torch.bool, torch.bfloat16):
        full = full_tensor((7, 5), dtype)
        st = mark_sharding(full, make_mesh((2, 2)), (1, 0))
        out = mark_sharding(st, make_mesh((4,)), (None, 0))
        check_layout(out, full, (4,), (None, 0), rank, f"cross-mesh {dtype}")
        out = out.reshard(((0, 1), None), make_mesh((1, 4)))
        check_layout(out, full, (1, 4), ((0, 1), None), rank, f"cross-mesh {dtype}")
        assert torch.equal(out.global_tensor, full)
        checked += 1
    # a named mesh with a custom device order
    named = Mesh([3, 1, 2, 0], (2, 2), ("data", "model"))
    full = full_tensor((7, 5))
    st = mark_sharding(full, named, ("model", "data"))
    coords = {3: (0, 0), 1: (0, 1), 2: (1, 0), 0: (1, 1)}[rank]
    rows = [(0, 4), (4, 7)][coords[1]]
    cols = [(0, 3), (3, 5)][coords[0]]
    assert st.local_shards[0].indices == [slice(*rows, 1), slice(*cols, 1)]
    assert torch.equal(st.global_tensor, full)
    assert torch.equal(st.reshard((("data", "model"), None)).global_tensor, full)
    checked += 1
    return checked


def api_checks(rank: int, world: int) -> int:
    """clear/wrap/unwrap, parameters sharded in place, manual sharding, and error cases."""
    mesh = Mesh(list(range(4)), (2, 2), ("data", "model"))
    full = full_tensor((7, 5))
    checked = 0

    # plain tensors: wrap as replicated, unwrap, wrap_if_sharded is the identity
    plain = full.clone()
    wrapped = wrap_as_sharded_tensor(plain)
    assert wrapped.sharding_type == ShardingType.REPLICATED
    assert wrapped.local_shards[0].replica_id == rank
    assert wrapped.local_shards[0].indices is Ellipsis
    assert torch.equal(wrapped.local_shards[0].unpadded_data, full)
    assert torch.equal(wrapped.global_tensor, full)
    assert wrap_as_sharded_tensor(wrapped) is wrapped
    assert unwrap_sharded_tensor(plain) is plain
    # as torch_xla's XLAShardedTensor(t): the wrapper's global tensor is t itself
    assert wrapped.global_tensor is plain
    assert unwrap_sharded_tensor(wrapped) is plain and clear_sharding(wrapped) is plain
    with torch.no_grad():
        wrapped.local_shards[0].data.add_(1)  # the wrapper shares plain's storage
    assert torch.equal(plain, full + 1)
    plain.sub_(1)
    assert wrap_if_sharded(plain) is plain and wrap_if_sharded(3) == 3
    assert clear_sharding(plain) is plain
    st = mark_sharding(full, mesh, ("data", "model"))
    assert torch.equal(unwrap_sharded_tensor(st), full)
    assert torch.equal(plain, full), "mark_sharding must not modify a plain tensor"
    checked += 1

    # an nn.Parameter is sharded in place and found again by wrap_if_sharded
    param = torch.nn.Parameter(full.clone())
    pst = mark_sharding(param, mesh, (None, "model"))
    slices = ref_layout((7, 5), (2, 2), (None, 1), rank)[0]
    assert tuple(param.shape) == (7, 3)
    assert wrap_if_sharded(param) is pst and wrap_as_sharded_tensor(param) is pst
    assert param.data.data_ptr() == pst.local_shards[0].data.data_ptr()
    with torch.no_grad():
        param.mul_(2)  # updates through the parameter are seen by the sharded tensor
    assert torch.equal(pst.local_shards[0].unpadded_data, full[slices] * 2)
    again = mark_sharding(param, mesh, ("data", None))  # reshards the parameter in place
    assert wrap_if_sharded(param) is again and tuple(param.shape) == (4, 5)
    assert torch.equal(again.global_tensor, full * 2)
    back = clear_sharding(param)
    assert back is param and torch.equal(param.data, full * 2)
    assert wrap_if_sharded(param) is param
    checked += 1

    # manual sharding round trip, with an explicit and with the global mesh
    read_back = {("data", None): P, (None, ("data", "model")): T, ("model", "data"): T}
    for spec in [("data", None), (None, ("data", "model")), ("model", "data")]:
        m = enable_manual_sharding(full, spec, mesh=mesh)
        assert m.sharding_type == ShardingType.MANUAL
        local = m.global_tensor
        assert torch.equal(local, expected_shard(full, (2, 2), _index_spec(spec), rank))
        assert m.global_shape == local.shape
        y = disable_manual_sharding(local * 3 + 1, spec, full.shape, mesh=mesh)
        assert y.sharding_type is read_back[spec]
        assert torch.equal(y.global_tensor, full * 3 + 1), spec
        z = disable_manual_sharding(m, spec, full.shape, mesh=mesh)
        assert torch.equal(z.global_tensor, full)
        with pytest.raises(ValueError, match="MANUAL"):
            m.reshard(spec)
        checked += 1
    set_global_mesh(mesh)
    try:
        m = enable_manual_sharding(mark_sharding(full, mesh, (None, None)), ("data", "model"))
        y = disable_manual_sharding(m, ("data", "model"), (7, 5))
        assert torch.equal(y.global_tensor, full)
    finally:
        set_global_mesh(None)
    with pytest.raises(ValueError, match="no global mesh"):
        enable_manual_sharding(full, (0, None))
    checked += 1

    # error cases: each names the rank and the problem
    with pytest.raises(ValueError, match=rf"rank {rank}: .*2 devices but the job has 4 ranks"):
        mark_sharding(full, Mesh([0, 1], (2,)), (0, None))
    with pytest.raises(AssertionError, match="2 devices but the job has 4 ranks"):
        mark_sharding(full, Mesh([0, 1], (2,)), (0, None))
    with pytest.raises(AssertionError, match=r"spec length \(1\).*input rank \(2\)"):
        mark_sharding(full, mesh, ("data",))
    with pytest.raises(ShardingSpecError, match=rf"rank {rank}: .*at most once"):
        mark_sharding(full, mesh, ("data", "data"))
    with pytest.raises(AssertionError, match="out of range"):
        mark_sharding(full, Mesh(list(range(4)), (4,)), (None, 1))
    with pytest.raises(ValueError, match=rf"rank {rank}: .*axis name 'nope'"):
        mark_sharding(full, mesh, ("nope", None))
    with pytest.raises(ValueError, match=rf"rank {rank}: .*spec length \(1\).*input rank \(2\)"):
        mark_sharding(full, mesh, ("data",))
    with pytest.raises(ValueError, match="repeat"):
        mark_sharding(full, mesh, ("data", "data"))
    with pytest.raises(ValueError, match=r"out of range|out of bound"):
        mark_sharding(full, Mesh(list(range(4)), (4,)), (None, 1))
    with pytest.raises(ValueError, match=rf"rank {rank}: local shard has shape \(3, 3\)"):
        mark_sharding(torch.zeros(3, 3), mesh, ("data", None), from_local_shards=True,
                      global_shape=(7, 5))
    with pytest.raises(TypeError, match="partition_spec must be a tuple"):
        mark_sharding(full, mesh, "data")
    with pytest.raises(TypeError, match=r"needs a torch\.Tensor"):
        mark_sharding([1, 2], mesh, (0,))
    checked += 1
    return checked


def read_back_checks(rank: int, world: int) -> int:
    """XLAShard.indices forms and the read-back sharding type, against hand-worked values."""
    checked = 0
    # an uneven split over 4 ranks: 10 = 3 + 3 + 3 + 1, the last shard zero padded
    st = mark_sharding(torch.arange(1.0, 11.0), Mesh(range(4), (4,)), (0,))
    shard = st.local_shards[0]
    assert st.sharding_type is ShardingType.TILED and shard.replica_id == 0
    assert shard.indices == [[slice(0, 3, 1)], [slice(3, 6, 1)], [slice(6, 9, 1)],
                             [slice(9, 10, 1)]][rank]
    data = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [10.0, 0.0, 0.0]][rank]
    assert shard.data.tolist() == data
    assert shard.unpadded_data.tolist() == (data if rank < 3 else [10.0])
    checked += 1

    # a PARTIAL spec whose replication groups have one member each reads back as TILED
    mesh41 = Mesh(range(4), (4, 1), ("x", "y"))
    st = mark_sharding(full_tensor((4, 2)), mesh41, ("x", None))
    assert mesh41.get_op_sharding(("x", None)).sharding_type is ShardingType.PARTIAL
    assert mesh41.get_op_sharding(("x", None)).replication_groups == [[0], [1], [2], [3]]
    assert st.sharding_type is ShardingType.TILED
    assert st.local_shards[0].indices == [slice(rank, rank + 1, 1), slice(0, 2, 1)]
    assert st.local_shards[0].replica_id == 0
    checked += 1

    # a PARTIAL spec with a single replication group reads back as REPLICATED
    mesh14 = Mesh(range(4), (1, 4), ("x", "y"))
    st = mark_sharding(full_tensor((3, 2)), mesh14, ("x", None))
    assert mesh14.get_op_sharding(("x", None)).replication_groups == [[0, 1, 2, 3]]
    assert mesh14.get_op_sharding(("x", None)).sharding_type is ShardingType.PARTIAL
    assert st.sharding_type is ShardingType.REPLICATED
    assert st.local_shards[0].indices is Ellipsis and st.local_shards[0].replica_id == rank
    assert torch.equal(st.local_shards[0].unpadded_data, full_tensor((3, 2)))
    checked += 1

    # a 0-d tensor is always replicated: indices are `...`
    st = mark_sharding(torch.tensor(2.5), Mesh(range(4), (2, 2)), ())
    assert st.sharding_type is ShardingType.REPLICATED
    shard = st.local_shards[0]
    assert shard.indices is Ellipsis and shard.replica_id == rank
    assert shard.data.shape == torch.Size([]) and shard.unpadded_data.item() == 2.5
    assert st.global_tensor.item() == 2.5
    checked += 1

    # a MANUAL tensor stays MANUAL; its indices cover the local shard
    m = enable_manual_sharding(full_tensor((7, 5)), ("x", None), mesh=Mesh(range(4), (4, 1),
                                                                          ("x", "y")))
    assert m.sharding_type is ShardingType.MANUAL
    assert m.local_shards[0].indices == [slice(0, 2, 1), slice(0, 5, 1)]
    checked += 1
    return checked


def _index_spec(spec: Any) -> Any:
    names = {"data": 0, "model": 1}

    def one(e: Any) -> Any:
        if isinstance(e, tuple):
            return tuple(names[x] for x in e)
        return None if e is None else names[e]

    return tuple(one(e) for e in spec)


def run_linear_example(rank: int, world: int) -> dict[str, float]:
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "sharded_linear.py")
    spec = importlib.util.spec_from_file_location("sharded_linear_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.check_against_unsharded()


def shm_suite(rank: int, world: int) -> dict[str, tuple[str, Any]]:
    """Every 4-rank check in one launch (process start-up dominates on small machines)."""
    parts = {
        "sweep": lambda: sweep(rank, world, False),
        "api": lambda: api_checks(rank, world),
        "read_back": lambda: read_back_checks(rank, world),
        "linear": lambda: run_linear_example(rank, world),
    }
    results: dict[str, tuple[str, Any]] = {}
    for name, part in parts.items():
        try:
            results[name] = ("ok", part())
        except Exception:
            results[name] = ("error", traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def shm_results() -> dict[int, dict[str, tuple[str, Any]]]:
    return launch(4, shm_suite, transport="shm")


def part(results: dict[int, dict[str, tuple[str, Any]]], name: str) -> dict[int, Any]:
    failed = {r: v[name][1] for r, v in results.items() if v[name][0] != "ok"}
    if failed:
        pytest.fail("\n".join(f"rank {r}: {tb}" for r, tb in failed.items()))
    return {r: v[name][1] for r, v in results.items()}


def test_layouts_round_trips_and_resharding_shm(shm_results: Any) -> None:
    out = part(shm_results, "sweep")
    assert len(set(out.values())) == 1 and out[0] > 100


def test_api_manual_sharding_and_errors(shm_results: Any) -> None:
    assert part(shm_results, "api") == {r: 7 for r in range(4)}


def test_shard_indices_forms_and_read_back_sharding_type(shm_results: Any) -> None:
    assert part(shm_results, "read_back") == {r: 5 for r in range(4)}


def test_sharded_linear_example_matches_unsharded(shm_results: Any) -> None:
    for rank, errs in part(shm_results, "linear").items():
        assert set(errs) >= {"output", "loss", "grad_weight", "grad_bias", "grad_input"}
        assert all(v < 1e-5 for v in errs.values()), (rank, errs)


def test_resharding_tcp() -> None:
    out = launch(4, sweep, True, transport="tcp")
    assert out == {r: 30 for r in range(4)}


# ---- single process: no communication needed ---------------------------------------------------


def test_single_process_world_of_one() -> None:
    assert not ringlet.is_initialized()
    mesh = Mesh([0], (1,), ("x",))
    full = full_tensor((3, 2))
    st = mark_sharding(full, mesh, ("x", None))
    # built as MAXIMAL (one device); torch_xla reads it back as REPLICATED
    assert mesh.get_op_sharding(("x", None)).sharding_type is ShardingType.MAXIMAL
    assert st.sharding_type is ShardingType.REPLICATED
    shard = st.local_shards[0]
    assert shard.indices is Ellipsis and shard.replica_id == 0
    assert torch.equal(shard.unpadded_data, full) and torch.equal(shard.data, full)
    assert torch.equal(st.global_tensor, full) and torch.equal(clear_sharding(st), full)
    scalar = mark_sharding(torch.tensor(7.0), mesh, ())
    assert scalar.sharding_type is ShardingType.REPLICATED
    assert scalar.local_shards[0].indices is Ellipsis
    assert scalar.local_shards[0].unpadded_data.item() == 7.0
    with pytest.raises(ValueError, match=r"rank 0: .*2 devices but the job has 1 ranks"):
        mark_sharding(full, Mesh([0, 1], (2,)), (0, None))
    with pytest.raises(AssertionError, match=r"rank 0: .*2 devices but the job has 1 ranks"):
        mark_sharding(full, Mesh([0, 1], (2,)), (0, None))
    with pytest.raises(AssertionError, match=r"spec length \(1\).*input rank \(2\)"):
        mark_sharding(full, mesh, ("x",))
    # torch_xla asserts the spec's length before it reads the entries
    with pytest.raises(AssertionError, match=r"spec length \(1\).*input rank \(2\)"):
        mark_sharding(full, mesh, ("no_such_axis",))
    with pytest.raises(AssertionError, match=r"spec length \(3\).*input rank \(2\)"):
        mark_sharding(full, mesh, (1.5, None, None))
    with pytest.raises(ValueError, match="not defined"):
        mark_sharding(full, mesh, ("no_such_axis", None))


def test_xla_shard_indices_and_unpadded_data() -> None:
    padded = stm.XLAShard(torch.tensor([[4.0, 5.0], [0.0, 0.0]]),
                          [slice(3, 4, 1), slice(0, 2, 1)], "rank:1", 0)
    assert padded.unpadded_data.tolist() == [[4.0, 5.0]]
    replicated = stm.XLAShard(torch.tensor([1.0, 2.0]), Ellipsis, "rank:0", 0)
    assert replicated.unpadded_data.tolist() == [1.0, 2.0]
    scalar = stm.XLAShard(torch.tensor(3.0), Ellipsis, "rank:0", 0)
    assert scalar.unpadded_data.item() == 3.0


@pytest.mark.parametrize("src_mesh,dst_mesh", [((2, 2), (2, 2)), ((4,), (1, 4)), ((2, 2), (4,))])
def test_reshard_plan_covers_each_needed_element_once(src_mesh: Any, dst_mesh: Any) -> None:
    shape = (7, 5)
    for src, dst in itertools.product(specs_for(src_mesh), specs_for(dst_mesh)):
        plan = stm._reshard_plan(shape, make_mesh(src_mesh), src, make_mesh(dst_mesh), dst)
        for d in range(4):
            count = torch.zeros(shape, dtype=torch.int64)
            for t in plan.transfers:
                if t.dst != d:
                    continue
                box = tuple(slice(lo, hi) for lo, hi in t.box)
                count[box] += 1
                held = torch.zeros(shape, dtype=torch.bool)
                held[ref_layout(shape, src_mesh, src, t.src)[0]] = True
                assert bool(held[box].all()), (src, dst, t)
            need = torch.zeros(shape, dtype=torch.int64)
            need[ref_layout(shape, dst_mesh, dst, d)[0]] = 1
            assert torch.equal(count, need), (src, dst, d)


def test_checkpoint_grid_pieces_cover_exactly() -> None:
    for start in range(0, 40):
        for stop in range(start, 60):
            pieces = stm._grid_intervals(start, stop)
            covered = [i for lo, hi in pieces for i in range(lo, hi)]
            assert covered == list(range(start, stop))
            assert all(hi == lo or lo % (hi - lo) == 0 for lo, hi in pieces)
    assert stm._grid_intervals(4, 7) == [(4, 6), (6, 7)]


def test_patched_linear_matches_f_linear_and_barrier_hook() -> None:
    from ringlet.xla.sharding import (
        XLAPatchedLinear,
        apply_backward_optimization_barrier,
        xla_patched_nn_linear_forward,
    )

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 5, 4, requires_grad=True)
    g = torch.randn(2, 5, 3)
    ours = xla_patched_nn_linear_forward(layer, x)
    ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(ours, ref)
    got = torch.autograd.grad(ours, [x, layer.weight, layer.bias], g)
    want = torch.autograd.grad(ref, [x, layer.weight, layer.bias], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    no_bias = XLAPatchedLinear.apply(x, layer.weight)
    torch.testing.assert_close(no_bias, x @ layer.weight.T)
    apply_backward_optimization_barrier(layer)
    layer(x).sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((3,), 10.0))


def test_sharding_spec_apply_on_world_of_one() -> None:
    mesh = Mesh([0], (1,), ("x",))
    st = ShardingSpec(mesh, ("x", None)).apply(torch.arange(6.0).view(3, 2))
    assert torch.equal(st.global_tensor, torch.arange(6.0).view(3, 2))
