"""Two-level all-reduce on multi-host jobs (hosts simulated with
RINGLET_HOST_ID): shared memory within a host, TCP across hosts, checked
against plain torch for every dtype and reduce type, odd sizes, and every
rank raising together when ranks disagree."""

from __future__ import annotations

import pytest
import torch

import ringlet
from ringlet.core import groups

from _reference import DTYPES, OPS, assert_matches, make_input, reduce, supported
from conftest import launch

# Above the two-level threshold (256 KiB for float32) and odd: the host-level
# shards need padding.
COUNTS = [0, 5, 70001, 300007]


def two_level(rank: int, world: int, expect_hier: bool) -> None:
    state = groups.require_state()
    assert (state.hier is not None) == expect_hier
    if state.hier is not None:
        layout = groups.host_layout()
        assert state.comm.host_layout() == layout
        mine = next(g for g in layout if rank in g)
        assert state.hier.size == len(mine) and state.comm.transport == "tcp"
        assert state.hier.transport.startswith("shm") or len(mine) == 1
    for dtype in DTYPES:
        for op in OPS:
            if not supported(dtype, op):
                continue
            for count in COUNTS:
                # The largest count (several pipeline pieces) for a few
                # dtypes; every path is also covered bit for bit by the Rust
                # tests on simulated hosts (cargo test --test hierarchy).
                if count > 70001 and (op not in ("sum", "max") or dtype not in (
                        torch.float32, torch.bfloat16, torch.int64)):
                    continue
                inputs = [make_input(dtype, r, count, salt=7) for r in range(world)]
                got = ringlet.all_reduce(op, inputs[rank])
                assert_matches(got, reduce(op, inputs), f"{dtype} {op} {count}")
                # Every rank ends with the same bits.
                same = ringlet.all_gather(got.view(-1)[:3].clone().view(torch.uint8).view(-1))
                assert torch.equal(same.view(world, -1), same.view(world, -1)[0].expand(world, -1))
    # all_gather (dim 0 and 1) and broadcast from every root, two-level too.
    for dtype in (torch.float32, torch.int8, torch.bool):
        inputs = [make_input(dtype, r, 300007, salt=3) for r in range(world)]
        got = ringlet.all_gather(inputs[rank])
        assert torch.equal(got, torch.cat(inputs)), dtype
        got = ringlet.all_gather(inputs[rank].view(1, -1), dim=1)
        assert torch.equal(got, torch.cat(inputs).view(1, -1)), dtype
        if dtype != torch.bool:
            for op in ("sum", "max"):
                full = [make_input(dtype, r, world * 70001, salt=5) for r in range(world)]
                got = ringlet.reduce_scatter(op, full[rank], 1.0, 0, world)
                want = reduce(op, full).view(world, -1)[rank]
                assert_matches(got, want, f"reduce_scatter {dtype} {op}")
        for root in range(world):
            t = inputs[rank].clone()
            ringlet.collective_broadcast([t], root_ordinal=root)
            assert torch.equal(t, inputs[root]), (dtype, root)
    x = torch.full((300001,), float(rank + 1))
    out = ringlet.all_reduce("sum", [x, torch.ones(3)], scale=0.5)
    assert out[0][0].item() == sum(range(1, world + 1)) * 0.5
    assert out[1].tolist() == [world * 0.5] * 3
    # Ranks that disagree about the size all raise, on every host.
    n = 300000 + (1 if rank == world - 1 else 0)
    with pytest.raises(ringlet.CollectiveMismatchError, match="disagree"):
        ringlet.all_reduce("sum", torch.ones(n))
    assert ringlet.all_reduce("sum", torch.ones(300000))[0].item() == world
    with pytest.raises(ringlet.CollectiveMismatchError, match="disagree"):
        ringlet.all_gather(torch.ones(n))
    with pytest.raises(ringlet.CollectiveMismatchError, match="disagree"):
        ringlet.collective_broadcast([torch.ones(300000)], root_ordinal=rank % 2)


def test_two_hosts_two_ranks_each() -> None:
    hosts = [{"RINGLET_HOST_ID": h} for h in ("a", "a", "b", "b")]
    launch(4, two_level, True, per_rank_env=hosts)


def test_interleaved_hosts() -> None:
    hosts = [{"RINGLET_HOST_ID": h} for h in ("a", "b", "a", "b")]
    launch(4, two_level, True, per_rank_env=hosts)


def test_unequal_hosts() -> None:
    hosts = [{"RINGLET_HOST_ID": h} for h in ("a", "a", "b")]
    launch(3, two_level, True, per_rank_env=hosts)


def test_one_rank_per_host_stays_flat() -> None:
    hosts = [{"RINGLET_HOST_ID": h} for h in ("a", "b", "c")]
    launch(3, two_level, False, per_rank_env=hosts)
