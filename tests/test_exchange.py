"""all_to_all, all_to_all_v, collective_permute and send/recv on real
processes: world sizes 1-4, both transports, every dtype, odd and empty
sizes, replica groups, and every error case, against plain torch."""

from __future__ import annotations

import pytest
import torch

import ringlet

from _reference import DTYPES, make_input
from conftest import TRANSPORTS, launch


def rank_tensor(
    rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0
) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return make_input(dtype, rank, n, salt).reshape(shape)


def reference_all_to_all(
    inputs: list[torch.Tensor], me: int, split: int, concat: int
) -> torch.Tensor:
    n = len(inputs)
    return torch.cat([x.chunk(n, dim=split)[me] for x in inputs], dim=concat)


def sweep_exchange(rank: int, world: int) -> None:
    # all_to_all: every dtype, split/concat dims equal, different, negative.
    for dtype in DTYPES:
        for shape, split, concat in [
            ((world * 3, 5), 0, 0),
            ((2, world * 2, 3), 1, 0),
            ((world, 7), 0, -1),
            ((3, 1, world), -1, 1),
            ((world * 2, 0), 0, 1),
        ]:
            inputs = [rank_tensor(r, shape, dtype, salt=len(shape)) for r in range(world)]
            got = ringlet.all_to_all(inputs[rank], split, concat, world)
            want = reference_all_to_all(inputs, rank, split, concat)
            assert got.dtype == dtype and torch.equal(got, want), (dtype, shape, split, concat)
    # all_to_all_v: ragged blocks (0, 1, odd) in both directions.
    sizes = [[(i * 7 + j * 3) % 5 for j in range(world)] for i in range(world)]
    send = [torch.arange(sizes[rank][j], dtype=torch.float64) + 100 * rank + 10 * j
            for j in range(world)]
    recv = [torch.full((sizes[i][rank],), -1.0, dtype=torch.float64) for i in range(world)]
    out = ringlet.all_to_all_v(send, recv)
    assert out is recv
    for i in range(world):
        assert torch.equal(recv[i], torch.arange(sizes[i][rank], dtype=torch.float64)
                           + 100 * i + 10 * rank)
    # collective_permute: a ring, a reversed ring, a partial permutation.
    for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
        x = rank_tensor(rank, (3, 5), dtype, salt=9)
        allx = [rank_tensor(r, (3, 5), dtype, salt=9) for r in range(world)]
        ring = [[i, (i + 1) % world] for i in range(world)]
        assert torch.equal(ringlet.collective_permute(x, ring), allx[(rank - 1) % world])
        back = [[(i + 1) % world, i] for i in range(world)]
        assert torch.equal(ringlet.collective_permute(x, back), allx[(rank + 1) % world])
    partial = [[0, world - 1]]
    got = ringlet.collective_permute(torch.full((4,), rank + 1.0), partial)
    want = torch.full((4,), 1.0) if rank == world - 1 else torch.zeros(4)
    assert torch.equal(got, want)
    # send/recv around a ring (even ranks send first, so no pair waits on
    # each other), several dtypes and sizes, tags.
    if world > 1:
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        for dtype in (torch.float32, torch.int8, torch.float16):
            for count in (0, 1, 7, 100003):
                msg = make_input(dtype, rank, count, salt=3)
                inbox = torch.empty(count, dtype=dtype)
                if rank % 2 == 0:
                    assert ringlet.send(msg, nxt, tag=count) is msg
                    ringlet.recv(inbox, prv, tag=count)
                else:
                    ringlet.recv(inbox, prv, tag=count)
                    ringlet.send(msg, nxt, tag=count)
                assert torch.equal(inbox, make_input(dtype, prv, count, salt=3))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exchange(world: int, transport: str) -> None:
    launch(world, sweep_exchange, transport=transport)


def groups_exchange(rank: int, world: int) -> None:
    for groups in ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[3, 2, 1, 0]]):
        mine = next(g for g in groups if rank in g)
        k = len(mine)
        x = torch.arange(k * 2, dtype=torch.float32).reshape(k, 2) + 100 * rank
        got = ringlet.all_to_all(x, 0, 1, k, groups=groups)
        i = mine.index(rank)
        want = torch.cat(
            [torch.arange(2 * i, 2 * i + 2, dtype=torch.float32).reshape(1, 2) + 100 * r
             for r in mine], dim=1)
        assert torch.equal(got, want), (groups, got, want)
        # torch_xla semantics: a group without the root ends with zeros.
        t = torch.full((3,), rank + 1.0)
        ringlet.collective_broadcast([t], root_ordinal=0, groups=groups)
        assert t.tolist() == ([1.0] * 3 if 0 in mine else [0.0] * 3)


def test_exchange_replica_groups() -> None:
    launch(4, groups_exchange)


def large_exchange(rank: int, world: int) -> None:
    n = (64 << 20) // 4 + 6  # a little over 64 MiB of int32, divisible by 2
    x = torch.arange(n, dtype=torch.int32) + rank
    got = ringlet.all_to_all(x, 0, 0, world)
    half = n // world
    want = torch.cat([torch.arange(rank * half, (rank + 1) * half, dtype=torch.int32) + r
                      for r in range(world)])
    assert torch.equal(got, want)
    got = ringlet.collective_permute(x, [[0, 1], [1, 0]])
    assert torch.equal(got, torch.arange(n, dtype=torch.int32) + (1 - rank))
    if rank == 0:
        ringlet.send(x, 1)
    else:
        y = torch.empty_like(x)
        ringlet.recv(y, 0)
        assert torch.equal(y, torch.arange(n, dtype=torch.int32))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_large_exchange_64mib(transport: str) -> None:
    launch(2, large_exchange, transport=transport)


def exchange_errors(rank: int, world: int) -> None:
    x = torch.ones(world * 2)
    with pytest.raises(ValueError, match=f"rank {rank}: all_to_all split_count is 3"):
        ringlet.all_to_all(x, 0, 0, 3)
    with pytest.raises(ValueError, match="cannot split dimension 0 of size 5 into 2"):
        ringlet.all_to_all(torch.ones(5), 0, 0, world)
    with pytest.raises(ValueError, match="out of range"):
        ringlet.all_to_all(x, 1, 0, world)
    with pytest.raises(ValueError, match="not contiguous"):
        ringlet.all_to_all(torch.ones(4, 2).t(), 0, 0, world)
    with pytest.raises(ValueError, match="source of two pairs"):
        ringlet.collective_permute(x, [[0, 1], [0, 0]])
    with pytest.raises(ValueError, match="target of two pairs"):
        ringlet.collective_permute(x, [[0, 1], [1, 1]])
    with pytest.raises(ValueError, match="out of range"):
        ringlet.collective_permute(x, [[0, 5]])
    with pytest.raises(ValueError, match="cannot message itself"):
        ringlet.send(x, rank)
    with pytest.raises(ValueError, match="out of range"):
        ringlet.recv(x, 7)
    with pytest.raises(ValueError, match="tag must be"):
        ringlet.send(x, 1 - rank, tag=-1)
    with pytest.raises(TypeError, match="must share one dtype"):
        ringlet.all_to_all_v([torch.ones(1), torch.ones(1, dtype=torch.int32)],
                             [torch.ones(1), torch.ones(1)])
    # Mismatches reach both sides as CollectiveMismatchError, and the
    # connections stay usable afterwards.
    with pytest.raises(ringlet.CollectiveMismatchError, match=r"tag=1.*tag=2|tag=2.*tag=1"):
        if rank == 0:
            ringlet.send(torch.ones(3), 1, tag=1)
        else:
            ringlet.recv(torch.ones(3), 0, tag=2)
    with pytest.raises(ringlet.CollectiveMismatchError, match="from rank"):
        ringlet.send(torch.ones(3), 1 - rank)  # both send: neither would receive
    with pytest.raises(ringlet.CollectiveMismatchError, match=r"count=3.*count=4|count=4.*count=3"):
        if rank == 0:
            ringlet.send(torch.ones(3), 1)
        else:
            ringlet.recv(torch.ones(4), 0)
    with pytest.raises(ringlet.CollectiveMismatchError, match="rank 0 sends 1 elements to rank 1"):
        want = 2 if rank == 1 else 1
        ringlet.all_to_all_v([torch.ones(1), torch.ones(1)], [torch.ones(want), torch.ones(1)])
    t = torch.tensor([rank + 1.0])
    if rank == 0:
        ringlet.send(t, 1, tag=4)
    else:
        ringlet.recv(t, 0, tag=4)
    assert t.item() == 1.0
    got = ringlet.all_to_all(torch.tensor([rank * 2.0, rank * 2.0 + 1]), 0, 0, 2)
    assert got.tolist() == [float(rank), 2.0 + rank]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_exchange_errors(transport: str) -> None:
    launch(2, exchange_errors, transport=transport)
