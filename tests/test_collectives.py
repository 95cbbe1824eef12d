"""Every collective on real processes: world sizes 1-4, both transports, every
dtype and reduce type, element counts 0, 1, 7 and 1000003, checked against
plain torch on every rank."""

from __future__ import annotations

import pytest
import torch

import ringlet

from _reference import DTYPES, OPS, assert_matches, make_input, reduce, supported
from conftest import TRANSPORTS, launch

COUNTS = [0, 1, 7, 1000003]
LARGE_CASES = {
    (torch.float32, "sum"),
    (torch.bfloat16, "sum"),
    (torch.float16, "max"),
    (torch.int64, "mul"),
    (torch.uint8, "min"),
    (torch.bool, "or"),
}


def sweep_all_reduce(rank: int, world: int) -> int:
    checked = 0
    for dtype in DTYPES:
        for op in OPS:
            if not supported(dtype, op):
                continue
            for count in COUNTS:
                if count == 1000003 and (dtype, op) not in LARGE_CASES:
                    continue  # a representative subset keeps the suite short
                inputs = [make_input(dtype, r, count) for r in range(world)]
                want = reduce(op, inputs)
                what = f"all_reduce {op} {dtype} n={count} rank={rank}"
                mine = inputs[rank].clone()
                got = ringlet.all_reduce(op, mine)
                assert_matches(got, want, what)
                assert torch.equal(mine, inputs[rank]), f"{what}: input modified"
                # list form: in place, returns the list itself
                pair = [inputs[rank].clone(), inputs[rank].clone().reshape(-1, 1)]
                back = ringlet.all_reduce(op, pair)
                assert back is pair
                assert_matches(pair[0], want, what + " (list)")
                assert_matches(pair[1].reshape(-1), want, what + " (list, 2-d)")
                checked += 1
    # scale, and numpy input
    x = make_input(torch.float32, rank, 5)
    want = reduce("sum", [make_input(torch.float32, r, 5) for r in range(world)])
    # torch_xla's world-size-1 shortcut returns an unscaled clone
    scaled = want * 0.5 if world > 1 else want
    assert_matches(ringlet.all_reduce("sum", x, scale=0.5), scaled, "scale")
    assert_matches(torch.from_numpy(ringlet.all_reduce("sum", x.numpy())), want, "numpy")
    return checked


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_reduce_every_dtype_and_op(world: int, transport: str) -> None:
    out = launch(world, sweep_all_reduce, transport=transport)
    assert len(out) == world and min(out.values()) > 50


def sweep_gather_scatter_broadcast(rank: int, world: int) -> None:
    for dtype in DTYPES:
        for count in COUNTS:
            if count == 1000003 and dtype not in (torch.float32, torch.int16):
                continue
            what = f"{dtype} n={count} rank={rank}"
            # all_gather along dim 0 and along a negative inner dim
            inputs = [make_input(dtype, r, count, salt=1) for r in range(world)]
            got = ringlet.all_gather(inputs[rank])
            assert_matches(got, torch.cat(inputs), "all_gather " + what)
            inputs2 = [t.reshape(1, -1) for t in inputs]
            got = ringlet.all_gather(inputs2[rank], dim=-1)
            assert_matches(got, torch.cat(inputs2, dim=-1), "all_gather dim=-1 " + what)
            out = torch.empty(world * count, dtype=dtype)
            assert ringlet.all_gather(inputs[rank], output=out) is out
            assert_matches(out, torch.cat(inputs), "all_gather output= " + what)
            # reduce_scatter along dim 0 and dim 1 (uneven element counts per row)
            for op in ("sum", "min"):
                full = [make_input(dtype, r, count * world, salt=2) for r in range(world)]
                want = reduce(op, full).chunk(world) if count else [full[0][:0]] * world
                got = ringlet.reduce_scatter(op, full[rank], 1.0, 0, world)
                assert_matches(got, want[rank], f"reduce_scatter {op} " + what)
                cols = [f.reshape(1, -1) for f in full]
                wantc = reduce(op, cols).tensor_split(world, dim=1)
                got = ringlet.reduce_scatter(op, cols[rank], 1.0, 1, world)
                assert_matches(got, wantc[rank], f"reduce_scatter dim=1 {op} " + what)
            # broadcast from the last rank, several tensors at once
            tensors = [make_input(dtype, rank, count, salt=3), make_input(dtype, rank, 3, salt=4)]
            root = world - 1
            ringlet.collective_broadcast(tensors, root_ordinal=root)
            assert_matches(tensors[0], make_input(dtype, root, count, salt=3), "broadcast " + what)
            assert_matches(tensors[1], make_input(dtype, root, 3, salt=4), "broadcast " + what)
    ringlet.barrier()
    payloads = ringlet.rendezvous("sweep", b"x" * rank * 3)
    assert payloads == [b"x" * r * 3 for r in range(world)]
    assert ringlet.rendezvous("empty") == [b""] * world


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gather_scatter_broadcast(world: int, transport: str) -> None:
    launch(world, sweep_gather_scatter_broadcast, transport=transport)


def large(rank: int, world: int) -> None:
    n = 64 << 20 // 4 + 3  # a little over 64 MiB of float32
    x = torch.full((n,), float(rank + 1))
    x[-1] = rank * 10.0
    got = ringlet.all_reduce("sum", x)
    assert torch.all(got[:-1] == world * (world + 1) / 2)
    assert got[-1].item() == 10.0 * sum(range(world))
    g = ringlet.all_gather(torch.full((n // world,), rank, dtype=torch.int32))
    assert torch.equal(g, torch.arange(world, dtype=torch.int32).repeat_interleave(n // world))
    b = x.clone() if rank == 0 else torch.zeros(n)
    ringlet.collective_broadcast([b])
    assert b[0].item() == 1.0 and b[-1].item() == 0.0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_large_tensor_64mib(transport: str) -> None:
    launch(2, large, transport=transport)


def large_single_copy(rank: int, world: int) -> None:
    large(rank, world)


def test_large_tensor_single_copy_path() -> None:
    # Cross-memory attach from 128 KiB (off by default): single-copy reads
    # and writes of peers' buffers carry the big messages.
    launch(3, large_single_copy, env={"RINGLET_CMA_THRESHOLD": str(128 << 10)})


def groups_check(rank: int, world: int) -> None:
    for groups in ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[3, 2, 1, 0]]):
        mine = next(g for g in groups if rank in g)
        x = torch.tensor([float(rank + 1)])
        assert ringlet.all_reduce("sum", x, groups=groups).item() == sum(r + 1 for r in mine)
        got = ringlet.all_gather(torch.tensor([rank]), groups=groups)
        assert got.tolist() == list(mine)
        full = torch.arange(len(mine) * 2, dtype=torch.float32) * (rank + 1)
        got = ringlet.reduce_scatter("sum", full, 1.0, 0, len(mine), groups=groups)
        i = mine.index(rank)
        scale = sum(r + 1 for r in mine)
        assert got.tolist() == [(2 * i) * scale, (2 * i + 1) * scale]
        t = torch.tensor([rank])
        ringlet.collective_broadcast([t], root_ordinal=mine[-1], groups=groups)
        assert t.item() == mine[-1]


def test_replica_groups() -> None:
    launch(4, groups_check)
