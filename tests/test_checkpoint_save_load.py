"""Tests of ringlet.checkpoint save/load: round trips, resharding, strictness, safety.

Single-process tests simulate several ranks by putting several pieces of the same
global tensor (same key, different offsets) into one state dict. Multi-process
tests (at the end) need ``ringlet.init`` and are skipped without it.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import socket
import sys
import time
import traceback
from typing import Any

import numpy as np
import pytest
import torch

import ringlet.checkpoint.serialization as serialization
from ringlet.checkpoint import (
    CheckpointingException,
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    StrictHandling,
    check_is_distributed_checkpoint,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_sharded_metadata,
    load_tensors_metadata,
    parse_strict_flag,
    save,
)

from conftest import start_context

W = torch.arange(48, dtype=torch.float32).view(8, 6)


def _rows(key: str, full: torch.Tensor, parts: int) -> dict[str, ShardedTensor]:
    """One piece per simulated rank: ``full`` split along axis 0 into ``parts`` chunks."""
    return {
        f"{key}.{r}": ShardedTensor.from_rank_offsets(key, chunk.clone(), (0, r, parts))
        for r, chunk in enumerate(full.chunk(parts))
    }


def _flat_pieces(
    key: str, full: torch.Tensor, bounds: list[int], empty: bool = False
) -> dict[str, ShardedTensor]:
    """Pieces holding flat ranges ``[bounds[i], bounds[i+1])`` of the whole of ``full``."""
    flat = full.flatten()
    out = {}
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        data = torch.zeros(b - a, dtype=full.dtype) if empty else flat[a:b].clone()
        out[f"{key}.{i}"] = ShardedTensor.from_rank_offsets_flat(
            key, data, tuple(full.shape), flattened_range=slice(a, b)
        )
    return out


def _ckpt(tmp_path: pathlib.Path, name: str = "ckpt") -> str:
    return str(tmp_path / name)


# --------------------------------------------------------------------------------------------
# Round trips


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]


def test_round_trip_dtypes_bit_exact(tmp_path: pathlib.Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for dt in DTYPES:
        raw = torch.randint(
            0,
            256,
            (5, 7 * torch.empty((), dtype=dt).element_size()),
            dtype=torch.uint8,
            generator=gen,
        )
        if dt == torch.bool:
            raw = raw % 2  # only 0 and 1 are valid booleans
        tensors[str(dt)] = raw.view(dt)  # arbitrary bit patterns, NaNs included
    sd = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}
    save(sd, _ckpt(tmp_path))
    request = {
        k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in tensors.items()
    }
    out = load(request, _ckpt(tmp_path))
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype
        assert torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)), k


def test_round_trip_scalar_empty_and_fills_in_place(tmp_path: pathlib.Path) -> None:
    sd = {
        "scalar": ShardedTensor.from_rank_offsets("scalar", torch.tensor(2.5)),
        "empty": ShardedTensor.from_rank_offsets("empty", torch.zeros(0, 3)),
        "w": ShardedTensor.from_rank_offsets("w", W.clone()),
    }
    save(sd, _ckpt(tmp_path))
    target = torch.zeros(8, 6)
    noncontig = torch.zeros(6, 8).t()
    out = load(
        {
            "scalar": ShardedTensor.from_rank_offsets("scalar", torch.tensor(0.0)),
            "empty": ShardedTensor.from_rank_offsets("empty", torch.ones(0, 3)),
            "w": ShardedTensor.from_rank_offsets("w", target),
            "w2": ShardedTensor("w", noncontig, torch.float32, (8, 6), (8, 6), (0, 0), (1, 1)),
            "w3": ShardedTensor.from_rank_offsets("w", W).without_data(),
        },
        _ckpt(tmp_path),
    )
    assert out["scalar"].item() == 2.5 and out["scalar"].shape == ()
    assert out["empty"].shape == (0, 3)
    assert out["w"] is target and torch.equal(target, W)
    assert out["w2"] is noncontig and torch.equal(noncontig, W)
    assert torch.equal(out["w3"], W)  # allocated for a data-less request


def test_common_state_round_trip(tmp_path: pathlib.Path) -> None:
    common = {
        "int": 7,
        "float": 0.1,
        "nan": float("nan"),
        "inf": float("-inf"),
        "str": "héllo",
        "none": None,
        "bool": True,
        "tuple": (1, (2, "x")),
        "bytes": b"\x00\xffab",
        "bytearray": bytearray(b"zz"),
        "nested": {"a": [1, {"b": 2}], 3: "int key", ("t", 1): "tuple key"},
        "tagged-looking": {"__ringlet__": "tuple"},
        "set": {1, 2, 3},
        "frozenset": frozenset({"a"}),
        "complex": 1 + 2j,
        "tensor": torch.arange(4, dtype=torch.int16),
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "ndarray": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "npscalar": np.float16(1.5),
        "namespace": argparse.Namespace(lr=0.1, layers=[1, 2]),
        "path": pathlib.Path("/a/b"),
    }
    save(dict(common), _ckpt(tmp_path))
    out = load({}, _ckpt(tmp_path))
    assert out.keys() == common.keys()
    assert math.isnan(out.pop("nan"))
    expected = dict(common)
    expected.pop("nan")
    for key in ("tensor", "ndarray"):
        got, want = out.pop(key), expected.pop(key)
        assert type(got) is type(want) and got.dtype == want.dtype and (got == want).all()
    assert type(out["npscalar"]) is np.float16
    assert out == expected
    assert load_common_state_dict(_ckpt(tmp_path))["tuple"] == (1, (2, "x"))


def test_unsupported_common_value_is_rejected(tmp_path: pathlib.Path) -> None:
    class Opaque:
        pass

    with pytest.raises(CheckpointingException, match="Opaque at <root>/cfg/0 cannot be stored"):
        save({"cfg": [Opaque()]}, _ckpt(tmp_path))
    assert not os.path.exists(_ckpt(tmp_path))
    assert os.listdir(tmp_path) == []  # the temporary directory was removed


def test_common_state_nonpersistent_and_list_positions(tmp_path: pathlib.Path) -> None:
    sd = {
        "model": {"w": ShardedTensor.from_rank_offsets("w", W.clone()), "cfg": {"hidden": 6}},
        "rng": LocalNonpersistentObject("saved-side"),
        "step": 5,
        "lst": [
            ShardedTensor.from_rank_offsets("v", torch.ones(3)),
            7,
            LocalNonpersistentObject("x"),
        ],
    }
    save(sd, _ckpt(tmp_path))
    assert load_common_state_dict(_ckpt(tmp_path)) == {
        "model": {"cfg": {"hidden": 6}},
        "step": 5,
        "lst": [None, 7, None],
    }
    request = {
        "model": {"w": ShardedTensor.from_rank_offsets("w", torch.empty(8, 6)), "cfg": "ignored"},
        "rng": LocalNonpersistentObject("load-side"),
        "lst": [
            ShardedTensor.from_rank_offsets("v", torch.empty(3)),
            0,
            LocalNonpersistentObject("y"),
        ],
    }
    out = load(request, _ckpt(tmp_path))
    assert torch.equal(out["model"]["w"], W)
    assert out["model"]["cfg"] == {"hidden": 6}  # stored common values win over the request's
    assert out["rng"] == "load-side"
    assert out["step"] == 5
    assert out["lst"][0].tolist() == [1.0, 1.0, 1.0] and out["lst"][1:] == [7, "y"]
    # The request is not modified.
    assert (
        isinstance(request["rng"], LocalNonpersistentObject)
        and request["model"]["cfg"] == "ignored"
    )


def test_sharded_objects(tmp_path: pathlib.Path) -> None:
    cells = {
        f"rng.{i}": ShardedObject(
            "rng", {"rank": i, "state": np.arange(i + 1), "t": torch.full((2,), i)}, (3,), (i,)
        )
        for i in range(3)
    }
    cells["replica"] = ShardedObject("rng", "never written", (3,), (1,), replica_id=1)
    save(cells, _ckpt(tmp_path))
    out = load(
        {
            "b": ShardedObject("rng", None, (3,), (2,)),
            "a": ShardedObject.empty_from_unique_key("rng/shard_0_3"),
        },
        _ckpt(tmp_path),
    )
    assert out["a"]["rank"] == 0 and out["a"]["state"].tolist() == [0]
    assert (
        out["b"]["rank"] == 2
        and out["b"]["state"].tolist() == [0, 1, 2]
        and out["b"]["t"].tolist() == [2, 2]
    )
    with pytest.raises(
        CheckpointingException, match=r"'rng/shard_5_6' is not in checkpoint .*stored cells"
    ):
        load({"x": ShardedObject("rng", None, (6,), (5,))}, _ckpt(tmp_path))


def test_sharded_object_access_errors(tmp_path: pathlib.Path) -> None:
    dup = {"a": ShardedObject("o", 1, (2,), (0,)), "b": ShardedObject("o", 2, (2,), (0,))}
    with pytest.raises(
        CheckpointingException,
        match="'o/shard_0_2' appears twice as main replica in the state dict of rank 0",
    ):
        save(dup, _ckpt(tmp_path))
    with pytest.raises(CheckpointingException, match="'o': 1 of 2 cells"):
        save({"a": ShardedObject("o", 1, (2,), (0,))}, _ckpt(tmp_path))
    assert os.listdir(tmp_path) == []  # checked before anything was written
    save({"a": ShardedObject("o", 1, (2,), (0,))}, _ckpt(tmp_path), validate_access_integrity=False)
    # The same cell saved by two ranks (metadata as gathered from ranks 0 and 1).
    cell = {"unique_key": "o/shard_0_1", "key": "o", "global_shape": [1], "global_offset": [0]}
    per_rank = [{"tensors": [], "objects": [dict(cell, rank=r)]} for r in range(2)]
    with pytest.raises(CheckpointingException, match="main replica by ranks 0 and 1"):
        serialization._build_index(per_rank, validate_access_integrity=True)


def test_factories_on_save_and_load(tmp_path: pathlib.Path) -> None:
    def build(key: str, data: torch.Tensor, replica_id: Any, flattened_range: Any) -> dict:
        top, bottom = data.chunk(2)
        return {
            "top": ShardedTensor.from_rank_offsets(f"{key}.top", top, replica_id=replica_id),
            "bottom": ShardedTensor.from_rank_offsets(
                f"{key}.bottom", bottom, replica_id=replica_id
            ),
        }

    def merge(loaded: dict) -> torch.Tensor:
        return torch.cat([loaded["top"], loaded["bottom"]])

    sd = {
        "layer": {"qkv": ShardedTensorFactory("qkv", W.clone(), build, merge)},
        "lst": [ShardedTensorFactory("p", W[:2].clone(), build, merge)],
    }
    save(sd, _ckpt(tmp_path))
    assert isinstance(sd["layer"]["qkv"], ShardedTensorFactory)  # the caller's dict is untouched
    assert set(load_tensors_metadata(_ckpt(tmp_path))) == {
        "qkv.top",
        "qkv.bottom",
        "p.top",
        "p.bottom",
    }
    request = {
        "layer": {"qkv": ShardedTensorFactory("qkv", torch.empty(8, 6), build, merge)},
        "lst": [ShardedTensorFactory("p", torch.empty(2, 6), build, merge)],
    }
    out = load(request, _ckpt(tmp_path))
    assert torch.equal(out["layer"]["qkv"], W)
    assert torch.equal(out["lst"][0], W[:2])
    assert isinstance(request["layer"]["qkv"], ShardedTensorFactory)


# --------------------------------------------------------------------------------------------
# Resharding


def test_reshard_rows_to_columns_and_blocks(tmp_path: pathlib.Path) -> None:
    save(_rows("w", W, 4), _ckpt(tmp_path))  # 4 "ranks" with 2 rows each
    cols = load(
        {
            f"c{r}": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 3), (1, r, 2))
            for r in range(2)
        },
        _ckpt(tmp_path),
    )
    assert torch.equal(cols["c0"], W[:, :3]) and torch.equal(cols["c1"], W[:, 3:])
    # A 2 x 3 grid of (4, 2) blocks: block (1, 2) is rows 4..8, cols 4..6.
    block = load(
        {"b": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 2), (0, 1, 2), (1, 2, 3))},
        _ckpt(tmp_path),
    )
    assert torch.equal(block["b"], W[4:, 4:])
    assert block["b"][0, 0].item() == 28.0  # W[4, 4] = 4 * 6 + 4


def test_reshard_prepended_axes(tmp_path: pathlib.Path) -> None:
    layers = torch.arange(24, dtype=torch.bfloat16).view(4, 3, 2)
    sd = {
        f"l{i}": ShardedTensor.from_rank_offsets(
            "layers", layers[i].clone(), (0, i, 4), prepend_axis_num=1
        )
        for i in range(4)
    }
    save(sd, _ckpt(tmp_path))
    meta = load_tensors_metadata(_ckpt(tmp_path))["layers"]
    assert (meta.global_shape, meta.dtype) == ((4, 3, 2), torch.bfloat16)
    # Load without prepended axes: split the last axis in two.
    out = load(
        {
            f"h{r}": ShardedTensor.from_rank_offsets(
                "layers", torch.zeros(4, 3, 1, dtype=torch.bfloat16), (2, r, 2)
            )
            for r in range(2)
        },
        _ckpt(tmp_path),
    )
    assert torch.equal(out["h0"], layers[:, :, :1]) and torch.equal(out["h1"], layers[:, :, 1:])
    # Load with two prepended axes (layer, row) and a 1-D local tensor.
    one = load(
        {
            "x": ShardedTensor.from_rank_offsets(
                "layers",
                torch.zeros(2, dtype=torch.bfloat16),
                (0, 3, 4),
                (1, 1, 3),
                prepend_axis_num=2,
            )
        },
        _ckpt(tmp_path),
    )
    assert one["x"].tolist() == [20.0, 21.0]  # layers[3, 1] = [3*6 + 2, 3*6 + 3]


def test_reshard_flattened_ranges(tmp_path: pathlib.Path) -> None:
    # Distributed-optimizer style: each of 2 row chunks (4, 6) is flattened and split unevenly.
    sd = {}
    for chunk_index, chunk in enumerate(W.chunk(2)):
        flat = chunk.flatten()
        for j, (a, b) in enumerate([(0, 7), (7, 24)]):
            sd[f"s{chunk_index}{j}"] = ShardedTensor.from_rank_offsets_flat(
                "opt", flat[a:b].clone(), (4, 6), (0, chunk_index, 2), flattened_range=slice(a, b)
            )
    save(sd, _ckpt(tmp_path))
    # Regular layout.
    out = load({"w": ShardedTensor.from_rank_offsets("opt", torch.zeros(8, 6))}, _ckpt(tmp_path))
    assert torch.equal(out["w"], W)
    # A different flat layout over a (2, 6) chunk grid: chunk 2 is rows 4..6 = values 24..35.
    out = load(
        {
            "a": ShardedTensor.from_rank_offsets_flat(
                "opt", torch.zeros(5), (2, 6), (0, 2, 4), flattened_range=slice(0, 5)
            ),
            "b": ShardedTensor.from_rank_offsets_flat(
                "opt", torch.zeros(7), (2, 6), (0, 2, 4), flattened_range=slice(5, 12)
            ),
        },
        _ckpt(tmp_path),
    )
    assert out["a"].tolist() == [24.0, 25.0, 26.0, 27.0, 28.0]
    assert out["b"].tolist() == [29.0, 30.0, 31.0, 32.0, 33.0, 34.0, 35.0]
    # Flat over the whole tensor with ranges crossing the stored chunk boundary (row 4 = 24).
    out = load(_flat_pieces("opt", W, [0, 10, 30, 48], empty=True), _ckpt(tmp_path))
    assert torch.equal(torch.cat([out["opt.0"], out["opt.1"], out["opt.2"]]), W.flatten())


def test_reshard_uneven_1d(tmp_path: pathlib.Path) -> None:
    vec = torch.arange(10, dtype=torch.int64) * 3
    save(_flat_pieces("vec", vec, [0, 3, 10]), _ckpt(tmp_path))
    out = load(_flat_pieces("vec", vec, [0, 1, 2, 10], empty=True), _ckpt(tmp_path))
    assert [out[f"vec.{i}"].tolist() for i in range(3)] == [
        [0],
        [3],
        [6, 9, 12, 15, 18, 21, 24, 27],
    ]
    halves = load(
        {
            f"h{r}": ShardedTensor.from_rank_offsets(
                "vec", torch.zeros(5, dtype=torch.int64), (0, r, 2)
            )
            for r in range(2)
        },
        _ckpt(tmp_path),
    )
    assert halves["h0"].tolist() == [0, 3, 6, 9, 12] and halves["h1"].tolist() == [
        15,
        18,
        21,
        24,
        27,
    ]


def test_irregular_pieces_round_trip(tmp_path: pathlib.Path) -> None:
    # Pieces off any chunk grid (axis_fragmentations=None): rows 0..3 and 3..10.
    full = torch.arange(40, dtype=torch.float32).reshape(10, 4)

    def piece(start: int, stop: int, data: torch.Tensor) -> ShardedTensor:
        return ShardedTensor(
            key="m", data=data, dtype=torch.float32, local_shape=tuple(data.shape),
            global_shape=(10, 4), global_offset=(start, 0), axis_fragmentations=None,
        )

    save({"a": piece(0, 3, full[0:3].clone()), "b": piece(3, 10, full[3:10].clone())},
         _ckpt(tmp_path))
    halves = load(
        {f"h{r}": ShardedTensor.from_rank_offsets("m", torch.zeros(5, 4), (0, r, 2))
         for r in range(2)},
        _ckpt(tmp_path),
    )
    assert torch.equal(halves["h0"], full[:5]) and torch.equal(halves["h1"], full[5:])
    odd = load({"x": piece(1, 8, torch.zeros(7, 4))}, _ckpt(tmp_path))
    assert torch.equal(odd["x"], full[1:8])


def test_reshard_random_layouts_bit_exact(tmp_path: pathlib.Path) -> None:
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(6, 4, 10, generator=gen).to(torch.bfloat16)
    # Saved as a (3, 2) grid over the first two axes, each block flattened into 3 uneven ranges.
    sd = {}
    for i in range(3):
        for j in range(2):
            block = full[2 * i : 2 * i + 2, 2 * j : 2 * j + 2].flatten()
            for a, b in [(0, 11), (11, 12), (12, 40)]:
                sd[f"{i}{j}{a}"] = ShardedTensor.from_rank_offsets_flat(
                    "x",
                    block[a:b].clone(),
                    (2, 2, 10),
                    (0, i, 3),
                    (1, j, 2),
                    flattened_range=slice(a, b),
                )
    save(sd, _ckpt(tmp_path))
    # Loaded as 5 chunks along the last axis with the first axis prepended per slice.
    request = {
        f"{i}.{k}": ShardedTensor.from_rank_offsets(
            "x", torch.zeros(4, 2, dtype=torch.bfloat16), (0, i, 6), (2, k, 5), prepend_axis_num=1
        )
        for i in range(6)
        for k in range(5)
    }
    out = load(request, _ckpt(tmp_path))
    for i in range(6):
        for k in range(5):
            assert torch.equal(
                out[f"{i}.{k}"].view(torch.int16), full[i, :, 2 * k : 2 * k + 2].view(torch.int16)
            )


def test_missing_region_is_reported(tmp_path: pathlib.Path) -> None:
    pieces = _rows("w", W, 4)
    del pieces["w.3"]
    with pytest.raises(
        CheckpointingException, match="'w': main replicas cover 36 of the 48 elements"
    ):
        save(pieces, _ckpt(tmp_path))
    save(pieces, _ckpt(tmp_path), validate_access_integrity=False)
    ok = load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 0, 2))}, _ckpt(tmp_path)
    )
    assert torch.equal(ok["w"], W[:4])
    with pytest.raises(CheckpointingException, match=r"holds only 12 of the 24 requested elements"):
        load(
            {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 1, 2))},
            _ckpt(tmp_path),
        )


def test_overlapping_and_inconsistent_shards_are_rejected(tmp_path: pathlib.Path) -> None:
    pieces = _rows("w", W, 2)
    pieces["again"] = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 1, 2))
    with pytest.raises(CheckpointingException, match="'w': shards overlap"):
        save(pieces, _ckpt(tmp_path))
    pieces["again"] = ShardedTensor.from_rank_offsets(
        "w", torch.zeros(4, 6), (0, 1, 2), replica_id=1
    )
    save(pieces, _ckpt(tmp_path))  # a second replica is not written
    with pytest.raises(
        CheckpointingException, match=r"ranks disagree on dtype \(float32 vs float64"
    ):
        save(
            {
                "a": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 0, 2)),
                "b": ShardedTensor.from_rank_offsets(
                    "w", torch.zeros(4, 6, dtype=torch.float64), (0, 1, 2)
                ),
            },
            _ckpt(tmp_path, "c2"),
        )
    with pytest.raises(CheckpointingException, match="ranks disagree on global_shape"):
        save(
            {
                "a": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 0, 2)),
                "b": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 1, 3)),
            },
            _ckpt(tmp_path, "c3"),
        )


def test_shape_mismatch_loading(tmp_path: pathlib.Path) -> None:
    stored = W[:4].clone()  # (4, 6), values 0..23
    save({"w": ShardedTensor.from_rank_offsets("w", stored)}, _ckpt(tmp_path))
    with pytest.raises(
        CheckpointingException, match=r"global shape \(6, 6\) requested but \(4, 6\) stored"
    ):
        load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 6))}, _ckpt(tmp_path))
    bigger = load(
        {
            "w": ShardedTensor.from_rank_offsets(
                "w", torch.full((6, 8), 9.0), allow_shape_mismatch=True
            )
        },
        _ckpt(tmp_path),
    )
    assert torch.equal(bigger["w"][:4, :6], stored)
    assert bigger["w"][4:].abs().sum() == 0 and bigger["w"][:, 6:].abs().sum() == 0  # zero padding
    smaller = load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), allow_shape_mismatch=True)},
        _ckpt(tmp_path),
    )
    assert torch.equal(smaller["w"], stored[:2, :3])
    # Sharded padded template: global (6, 6) in 2 row chunks; chunk 1 is rows 3..6,
    # of which only row 3 is stored.
    part = load(
        {
            "w": ShardedTensor.from_rank_offsets(
                "w", torch.ones(3, 6), (0, 1, 2), allow_shape_mismatch=True
            )
        },
        _ckpt(tmp_path),
    )
    assert (
        part["w"][0].tolist() == [18.0, 19.0, 20.0, 21.0, 22.0, 23.0]
        and part["w"][1:].abs().sum() == 0
    )
    with pytest.raises(CheckpointingException, match="requested but"):
        load(
            {
                "w": ShardedTensor.from_rank_offsets(
                    "w", torch.zeros(4, 6, 1), allow_shape_mismatch=True
                )
            },
            _ckpt(tmp_path),
        )


# --------------------------------------------------------------------------------------------
# Metadata


def test_metadata_functions(tmp_path: pathlib.Path) -> None:
    sd = {**_rows("w", W, 2), "o": ShardedObject("opt/state", [1], (1,), (0,)), "step": 1}
    save(sd, _ckpt(tmp_path), content_metadata={"layout": "tp2", "version": (1, 2)})
    tensors = load_tensors_metadata(_ckpt(tmp_path))
    assert list(tensors) == ["w"]
    meta = tensors["w"]
    assert meta.data is None
    assert (
        meta.dtype,
        meta.local_shape,
        meta.global_shape,
        meta.global_offset,
        meta.axis_fragmentations,
    ) == (
        torch.float32,
        (8, 6),
        (8, 6),
        (0, 0),
        (1, 1),
    )
    sharded = load_sharded_metadata(_ckpt(tmp_path))
    assert set(sharded) == {"w", "opt/state/shard_0_1"}
    assert sharded["opt/state/shard_0_1"] == ShardedObject("opt/state", None, (1,), (0,))
    assert load_content_metadata(_ckpt(tmp_path)) == {"layout": "tp2", "version": (1, 2)}
    save({"step": 2}, _ckpt(tmp_path, "other"))
    assert load_content_metadata(_ckpt(tmp_path, "other")) is None
    assert check_is_distributed_checkpoint(_ckpt(tmp_path))
    assert not check_is_distributed_checkpoint(tmp_path)


def test_on_disk_format(tmp_path: pathlib.Path) -> None:
    save({**_rows("w", W, 2), "step": 3, "t": torch.ones(2)}, _ckpt(tmp_path))
    names = sorted(os.listdir(_ckpt(tmp_path)))
    assert names == [
        "common.json",
        "common.safetensors",
        "rank_00000.safetensors",
        "ringlet_complete",
        "ringlet_metadata.json",
    ]
    index = json.loads(pathlib.Path(_ckpt(tmp_path), "ringlet_metadata.json").read_text())
    shards = index["tensors"]["w"]["shards"]
    assert [s["global_offset"] for s in shards] == [[0, 0], [4, 0]]
    assert [s["local_shape"] for s in shards] == [[4, 6], [4, 6]]
    assert index["tensors"]["w"]["dtype"] == "float32" and index["tensors"]["w"][
        "global_shape"
    ] == [8, 6]
    from safetensors import safe_open

    with safe_open(os.path.join(_ckpt(tmp_path), "rank_00000.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor(shards[1]["name"]), W[4:])
    assert json.loads(pathlib.Path(_ckpt(tmp_path), "common.json").read_text())["step"] == 3


# --------------------------------------------------------------------------------------------
# Strict handling


@pytest.fixture
def ab_checkpoint(tmp_path: pathlib.Path) -> str:
    save(
        {
            "a": ShardedTensor.from_rank_offsets("a", torch.ones(2)),
            "b": ShardedTensor.from_rank_offsets("b", torch.ones(3)),
        },
        _ckpt(tmp_path),
    )
    return _ckpt(tmp_path)


def _request_ac() -> dict:
    return {
        "a": ShardedTensor.from_rank_offsets("a", torch.zeros(2)),
        "c": ShardedTensor.from_rank_offsets("c", torch.zeros(1)),
    }


def test_strict_assume_ok_unexpected(ab_checkpoint: str) -> None:
    with pytest.raises(CheckpointingException, match="key 'c' is not in checkpoint"):
        load(_request_ac(), ab_checkpoint)


@pytest.mark.parametrize(
    "strict", [StrictHandling.RAISE_UNEXPECTED, "raise_unexpected", "RAISE_UNEXPECTED"]
)
def test_strict_raise_unexpected(ab_checkpoint: str, strict: Any) -> None:
    with pytest.raises(CheckpointingException, match=r"\(unexpected\): \['c'\]$"):
        load(_request_ac(), ab_checkpoint, strict=strict)
    out = load(
        {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(2))}, ab_checkpoint, strict=strict
    )
    assert out["a"].tolist() == [1.0, 1.0]  # 'b' missing is fine here


def test_strict_raise_all(ab_checkpoint: str) -> None:
    with pytest.raises(
        CheckpointingException, match=r"\(unexpected\): \['c'\].*\(missing\): \['b'\]"
    ):
        load(_request_ac(), ab_checkpoint, strict="raise_all")
    with pytest.raises(CheckpointingException, match=r"\(missing\): \['b'\]"):
        load(
            {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(2))},
            ab_checkpoint,
            strict="raise_all",
        )


def test_strict_log_modes(ab_checkpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ringlet.checkpoint"):
        out = load(_request_ac(), ab_checkpoint, strict="log_unexpected")
    assert set(out) == {"a"}
    assert "['c']" in caplog.text and "missing" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ringlet.checkpoint"):
        load(_request_ac(), ab_checkpoint, strict=StrictHandling.LOG_ALL)
    assert "(unexpected): ['c']" in caplog.text and "(missing): ['b']" in caplog.text


def test_strict_return_and_ignore_modes(
    ab_checkpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    out, missing, unexpected = load(_request_ac(), ab_checkpoint, strict="return_unexpected")
    assert (set(out), missing, unexpected) == ({"a"}, set(), {"c"})
    out, missing, unexpected = load(_request_ac(), ab_checkpoint, strict=StrictHandling.RETURN_ALL)
    assert (set(out), missing, unexpected) == ({"a"}, {"b"}, {"c"})
    with caplog.at_level(logging.DEBUG, logger="ringlet.checkpoint"):
        out = load(_request_ac(), ab_checkpoint, strict="ignore_all")
    assert set(out) == {"a"} and out["a"].tolist() == [1.0, 1.0]
    assert caplog.text == ""


def test_parse_strict_flag() -> None:
    assert parse_strict_flag("assume_ok_unexpected") is StrictHandling.ASSUME_OK_UNEXPECTED
    assert parse_strict_flag(StrictHandling.IGNORE_ALL) is StrictHandling.IGNORE_ALL
    assert parse_strict_flag("LOG_ALL") is StrictHandling.LOG_ALL
    assert [m.value for m in StrictHandling] == [
        "assume_ok_unexpected",
        "log_unexpected",
        "log_all",
        "raise_unexpected",
        "raise_all",
        "return_unexpected",
        "return_all",
        "ignore_all",
    ]
    with pytest.raises(ValueError, match="invalid strict flag 'nope'"):
        parse_strict_flag("nope")


def test_strict_mode_with_objects(tmp_path: pathlib.Path) -> None:
    save({"o": ShardedObject("o", 1, (1,), (0,))}, _ckpt(tmp_path))
    _, missing, unexpected = load(
        {"p": ShardedObject("p", None, (1,), (0,))}, _ckpt(tmp_path), strict="return_all"
    )
    assert (missing, unexpected) == ({"o"}, {"p"})


# --------------------------------------------------------------------------------------------
# Damaged and invalid checkpoints


def test_missing_directory(tmp_path: pathlib.Path) -> None:
    missing = str(tmp_path / "nowhere")
    with pytest.raises(
        CheckpointingException, match=f"checkpoint directory {missing} does not exist"
    ):
        load({}, missing)
    with pytest.raises(CheckpointingException, match="does not exist"):
        load_tensors_metadata(missing)


def test_not_a_checkpoint(tmp_path: pathlib.Path) -> None:
    (tmp_path / "junk.txt").write_text("hello")
    with pytest.raises(CheckpointingException, match=f"{tmp_path} is not a ringlet checkpoint"):
        load({}, str(tmp_path))
    with pytest.raises(CheckpointingException, match="is not a directory"):
        load({}, str(tmp_path / "junk.txt"))
    # Saving over it is refused, and nothing is lost.
    with pytest.raises(
        CheckpointingException, match="not a ringlet checkpoint; refusing to replace it"
    ):
        save({"a": 1}, str(tmp_path))
    assert (tmp_path / "junk.txt").read_text() == "hello"


def test_truncated_and_missing_shard(tmp_path: pathlib.Path) -> None:
    save(_rows("w", W, 2), _ckpt(tmp_path))
    shard = pathlib.Path(_ckpt(tmp_path), "rank_00000.safetensors")
    data = shard.read_bytes()
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6))}
    shard.write_bytes(data[:-10])
    with pytest.raises(
        CheckpointingException,
        match=r"shard file rank_00000\.safetensors is truncated or damaged "
        r"\(\d+ bytes on disk, \d+ recorded\)",
    ):
        load(request, _ckpt(tmp_path))
    # Same size, damaged header: safetensors refuses it.
    shard.write_bytes(b"\xff" * len(data))
    with pytest.raises(
        CheckpointingException, match=r"cannot read shard file rank_00000\.safetensors"
    ):
        load(request, _ckpt(tmp_path))
    shard.unlink()
    with pytest.raises(
        CheckpointingException, match=r"shard file rank_00000\.safetensors is missing"
    ):
        load(request, _ckpt(tmp_path))
    # Metadata needs no shard file.
    assert load_tensors_metadata(_ckpt(tmp_path))["w"].global_shape == (8, 6)


def test_damaged_index_and_missing_marker(tmp_path: pathlib.Path) -> None:
    save({"step": 1}, _ckpt(tmp_path))
    index = pathlib.Path(_ckpt(tmp_path), "ringlet_metadata.json")
    index.write_text(index.read_text().replace('"world_size":1', '"world_size":2'))
    with pytest.raises(CheckpointingException, match="does not match its completion marker"):
        load({}, _ckpt(tmp_path))
    pathlib.Path(_ckpt(tmp_path), "ringlet_complete").unlink()
    with pytest.raises(CheckpointingException, match="is an incomplete checkpoint"):
        load({}, _ckpt(tmp_path))
    assert not check_is_distributed_checkpoint(_ckpt(tmp_path))


def test_index_cannot_point_outside_the_directory(tmp_path: pathlib.Path) -> None:
    (tmp_path / "secret.safetensors").write_bytes(b"x")
    save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, _ckpt(tmp_path))
    ckpt = serialization._Checkpoint(_ckpt(tmp_path))
    with pytest.raises(CheckpointingException, match=r"unknown file '\.\./secret\.safetensors'"):
        ckpt.path_of("../secret.safetensors")


def test_save_overwrites_previous_checkpoint(tmp_path: pathlib.Path) -> None:
    target = _ckpt(tmp_path)
    os.mkdir(target)  # an empty directory may be used
    save({"w": ShardedTensor.from_rank_offsets("w", W.clone()), "v": 1}, target)
    save({"w": ShardedTensor.from_rank_offsets("w", W + 1), "v": 2}, target)
    out = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6))}, target)
    assert out["v"] == 2 and torch.equal(out["w"], W + 1)
    assert os.listdir(tmp_path) == ["ckpt"]  # no temporary or backup directory left


def test_failed_save_keeps_previous_checkpoint(tmp_path: pathlib.Path) -> None:
    target = _ckpt(tmp_path)
    save({"w": ShardedTensor.from_rank_offsets("w", W.clone())}, target)
    with pytest.raises(CheckpointingException, match="has no data to save"):
        save({"w": ShardedTensor.from_rank_offsets("w", W).without_data()}, target)
    out = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6))}, target)
    assert torch.equal(out["w"], W)
    assert os.listdir(tmp_path) == ["ckpt"]


def test_swap_fallback_and_recovery(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an atomic exchange, the old checkpoint is parked and found again by load."""
    target = _ckpt(tmp_path)
    save({"v": 1}, target)
    monkeypatch.setattr(serialization, "exchange_dirs", lambda a, b: False)
    save({"v": 2}, target)
    assert load({}, target) == {"v": 2}
    assert os.listdir(tmp_path) == ["ckpt"]

    real_rename = os.rename
    calls = []

    def rename(src: str, dst: str) -> None:
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError("simulated crash between the two renames")
        real_rename(src, dst)

    monkeypatch.setattr(serialization.os, "rename", rename)
    with pytest.raises(CheckpointingException, match="simulated crash"):
        save({"v": 3}, target)
    assert not os.path.exists(target)
    assert load({}, target) == {"v": 2}  # recovered from the parked copy


def test_progress_bar_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    class Tty:
        def isatty(self) -> bool:
            return True

        def write(self, text: str) -> int:
            return len(text)

        def flush(self) -> None:
            pass

    # stderr is not a terminal under pytest: no bar.
    assert serialization._Progress(100, "x", True)._bar is None
    pytest.importorskip("tqdm")
    monkeypatch.setattr(sys, "stderr", Tty())
    bar = serialization._Progress(100, "x", True)
    assert bar._bar is not None
    bar.update(10)
    bar.close()
    assert serialization._Progress(100, "x", False)._bar is None
    monkeypatch.setitem(sys.modules, "tqdm", None)  # tqdm not installed
    assert serialization._Progress(100, "x", True)._bar is None


# --------------------------------------------------------------------------------------------
# Crash safety (single process, killed at chosen points of a save)


def _crash_child(target: str, phase: str) -> None:
    def hook(current: str) -> None:
        if current == phase:
            os._exit(17)

    serialization._TEST_HOOK = hook
    save({"w": ShardedTensor.from_rank_offsets("w", W + 100), "v": "new"}, target)
    os._exit(0)


def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path: pathlib.Path) -> None:
    ctx = start_context()  # conftest: forked from a preloaded server
    phases = ["mid_write", "before_swap", "after_swap"]
    procs = []
    for phase in phases:
        target = str(tmp_path / phase / "ckpt")
        os.makedirs(os.path.dirname(target))
        save({"w": ShardedTensor.from_rank_offsets("w", W.clone()), "v": "old"}, target)
        proc = ctx.Process(target=_crash_child, args=(target, phase))
        proc.start()
        procs.append(proc)
    try:
        for proc in procs:
            proc.join(timeout=60)
            assert not proc.is_alive(), "crashing child did not finish"
            assert proc.exitcode == 17
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    for phase in phases:
        target = str(tmp_path / phase / "ckpt")
        out = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6))}, target)
        if phase == "after_swap":  # the new checkpoint was already in place
            assert out["v"] == "new" and torch.equal(out["w"], W + 100)
        else:
            assert out["v"] == "old" and torch.equal(out["w"], W)
        leftovers = [n for n in os.listdir(tmp_path / phase) if n != "ckpt"]
        if phase == "mid_write":
            # The hidden temporary directory of the dead save is not a valid checkpoint.
            assert len(leftovers) == 1 and ".ringlet-tmp-" in leftovers[0]
            assert not check_is_distributed_checkpoint(tmp_path / phase / leftovers[0])
        # The next successful save clears what the dead one left behind.
        save({"v": "next"}, target)
        assert os.listdir(tmp_path / phase) == ["ckpt"]


# --------------------------------------------------------------------------------------------
# Multi-process tests (need ringlet.init from the engine)


def _has_ringlet_init() -> bool:
    import ringlet

    return callable(getattr(ringlet, "init", None))


needs_engine = pytest.mark.skipif(
    not _has_ringlet_init(), reason="ringlet.init is not available (engine not built)"
)

VEC = torch.arange(10, dtype=torch.int64) * 7
LAYERS = torch.arange(24, dtype=torch.float32).view(4, 3, 2)
FLAT = (torch.arange(48, dtype=torch.float64) * 0.5).view(8, 6)
FLAT_BOUNDS = {2: [0, 29, 48], 4: [0, 5, 20, 33, 48]}
VEC_BOUNDS = {2: [0, 7, 10], 4: [0, 1, 4, 9, 10]}


def _layout(rank: int, world: int, empty: bool) -> dict:
    """The state dict of one rank in a ``world``-rank job (empty=True: a load request)."""

    def fill(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if empty else t.clone()

    if world == 4:
        layers = ShardedTensor.from_rank_offsets(
            "layers", fill(LAYERS[rank]), (0, rank, 4), prepend_axis_num=1
        )
    else:
        layers = ShardedTensor.from_rank_offsets(
            "layers", fill(LAYERS[:, :, rank : rank + 1]), (2, rank, 2)
        )
    a, b = FLAT_BOUNDS[world][rank : rank + 2]
    c, d = VEC_BOUNDS[world][rank : rank + 2]
    return {
        "w": ShardedTensor.from_rank_offsets("w", fill(W.chunk(world)[rank]), (0, rank, world)),
        "layers": layers,
        "flat": ShardedTensor.from_rank_offsets_flat(
            "flat", fill(FLAT.flatten()[a:b]), (8, 6), flattened_range=slice(a, b)
        ),
        "vec": ShardedTensor.from_rank_offsets_flat(
            "vec", fill(VEC[c:d]), (10,), flattened_range=slice(c, d)
        ),
        "bias": ShardedTensor.from_rank_offsets("bias", fill(torch.arange(6.0)), replica_id=rank),
        "step": 100 + rank,
        "local": LocalNonpersistentObject(f"rank{rank}"),
    }


def _save_rank(rank: int, world: int, ckpt: str, crash: str) -> None:
    sd = _layout(rank, world, empty=False)
    sd["rng"] = ShardedObject("rng", {"rank": rank, "arr": np.arange(rank + 1)}, (world,), (rank,))
    if crash:
        victim, phase = crash.split(":")

        def hook(current: str) -> None:
            if current == phase and rank == int(victim):
                os._exit(17)

        serialization._TEST_HOOK = hook
        sd["w"].data.add_(1000)
    save(sd, ckpt)


def _load_rank(rank: int, world: int, ckpt: str, saved_world: int) -> None:
    request = _layout(rank, world, empty=True)
    cells = [i for i in range(saved_world) if i % world == rank]
    request["rng"] = [ShardedObject("rng", None, (saved_world,), (i,)) for i in cells]
    out = load(request, ckpt, strict="raise_all")
    expected = _layout(rank, world, empty=False)
    for key in ("w", "layers", "flat", "vec", "bias"):
        assert torch.equal(out[key], expected[key].data), key
    assert out["step"] == 100  # rank 0's common value
    assert out["local"] == f"rank{rank}"
    assert [o["rank"] for o in out["rng"]] == cells
    assert [o["arr"].tolist() for o in out["rng"]] == [list(range(i + 1)) for i in cells]


def _mp_entry(rank: int, phases: list) -> None:
    """Body of one spawned rank.

    ``phases`` is a list of ``(world, port, actions)``: ranks below ``world`` join a
    ``world``-rank job on ``port``, run the actions (``("save", dir, crash)`` or
    ``("load", dir, saved_world)``) and leave it again; the other ranks skip the phase.
    """
    try:
        import ringlet

        for world, port, actions in phases:
            if rank >= world:
                continue
            ringlet.init(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port)
            for kind, ckpt, arg in actions:
                if kind == "save":
                    _save_rank(rank, world, ckpt, arg)
                else:
                    _load_rank(rank, world, ckpt, arg)
            ringlet.shutdown()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(
    nprocs: int, phases: list, crash: str = "", timeout: float = 90.0
) -> list[int | None]:
    """Run ``phases`` (see ``_mp_entry``; ports are filled in) on ``nprocs`` spawned processes.

    With ``crash`` ("rank:phase") only the victim is waited for; the others are killed.
    """
    ctx = start_context()  # conftest: forked from a preloaded server
    phases = [(world, _free_port(), actions) for world, actions in phases]
    procs = [ctx.Process(target=_mp_entry, args=(r, phases)) for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        if crash:
            victim = procs[int(crash.split(":")[0])]
            victim.join(timeout=max(0.0, deadline - time.monotonic()))
            assert victim.exitcode == 17, f"victim exit code {victim.exitcode}"
            time.sleep(0.5)  # the survivors are now stuck waiting for the victim
        else:
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            assert not alive, f"ranks {alive} did not finish within {timeout} s"
        return [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


@needs_engine
def test_multiprocess_reshard_4_to_2_to_4(tmp_path: pathlib.Path) -> None:
    """Saved by 4 ranks, loaded by 2 which save again, loaded by 4: bit-exact every time."""
    four, two = _ckpt(tmp_path, "four"), _ckpt(tmp_path, "two")
    # Fresh processes for each job: ringlet.init after shutdown is not used here.
    assert _run_ranks(4, [(4, [("save", four, "")])]) == [0] * 4
    assert _run_ranks(2, [(2, [("load", four, 4), ("save", two, "")])]) == [0] * 2
    assert _run_ranks(4, [(4, [("load", two, 2)])]) == [0] * 4
    index = json.loads(pathlib.Path(four, "ringlet_metadata.json").read_text())
    assert index["world_size"] == 4
    assert len(index["tensors"]["bias"]["shards"]) == 1  # only replica 0 wrote the bias
    assert sorted({s["rank"] for s in index["tensors"]["w"]["shards"]}) == [0, 1, 2, 3]
    assert json.loads(pathlib.Path(two, "ringlet_metadata.json").read_text())["world_size"] == 2
    # Both checkpoints read whole in this single process.
    for ckpt in (four, two):
        whole = {
            "w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6)),
            "layers": ShardedTensor.from_rank_offsets("layers", torch.zeros(4, 3, 2)),
            "flat": ShardedTensor.from_rank_offsets("flat", torch.zeros(8, 6, dtype=torch.float64)),
            "vec": ShardedTensor.from_rank_offsets("vec", torch.zeros(10, dtype=torch.int64)),
        }
        out = load(whole, ckpt)
        for key, full in (("w", W), ("layers", LAYERS), ("flat", FLAT), ("vec", VEC)):
            assert torch.equal(out[key], full), (ckpt, key)


@needs_engine
@pytest.mark.parametrize("crash", ["1:mid_write", "0:before_swap"])
def test_multiprocess_killed_save_keeps_previous(tmp_path: pathlib.Path, crash: str) -> None:
    """One of 2 ranks dies during a save (rank:phase); the previous checkpoint stays valid."""
    ckpt = _ckpt(tmp_path)
    save({"w": ShardedTensor.from_rank_offsets("w", W.clone())}, ckpt)  # the previous checkpoint
    _run_ranks(2, [(2, [("save", ckpt, crash)])], crash=crash)
    out = load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 6))}, ckpt)
    assert torch.equal(out["w"], W)  # the interrupted save (w + 1000) never became visible
    leftovers = [n for n in os.listdir(tmp_path) if n != "ckpt"]
    assert all(n.startswith(".ckpt.ringlet-tmp-") for n in leftovers), leftovers
    if crash.endswith("mid_write"):  # data incomplete: a hidden leftover is no checkpoint
        assert not any(check_is_distributed_checkpoint(tmp_path / n) for n in leftovers)
