"""Collectives on busy cores: with processes spinning beside the job (as a
neighbour's job or CPU-bound data-loader workers would), results stay exact and
a rank that waits long for a late peer parks instead of spinning (its CPU time
stays a small part of the wait). The speed on busy cores is the bench's
(``python -m ringlet.bench collectives --busy 1``), not asserted here."""

from __future__ import annotations

import os
import time

import pytest
import torch

import ringlet
from ringlet.bench.busy import neighbours

from conftest import launch

SIZES = [1, 1000, 16_384, 262_147]  # elements: one phase, several pieces, uneven
STEPS = 12


def _inputs(rank: int, step: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if dtype.is_floating_point:
        # small integers in float: every sum is exact whatever the order
        return torch.randint(-64, 64, (count,), generator=g).to(dtype)
    return torch.randint(-(1 << 40), 1 << 40, (count,), generator=g, dtype=dtype)


def _exact_and_parked(rank: int, world: int, late_s: float) -> dict[str, float]:
    checked = 0
    for step in range(STEPS):
        for count in SIZES:
            for dtype in (torch.float32, torch.int64):
                want = sum(_inputs(r, step, count, dtype) for r in range(world))
                got = ringlet.all_reduce("sum", _inputs(rank, step, count, dtype))
                assert torch.equal(got, want), f"rank {rank} step {step} n={count} {dtype}"
                checked += 1
    # A late peer: every rank but the last enters at once and waits while
    # the last one computes for late_s (its own busy loop, not a sleep).
    ringlet.barrier()
    if rank == world - 1:
        t0 = time.perf_counter()
        x = 0
        while time.perf_counter() - t0 < late_s:
            x += 1
    wall0, cpu0 = time.perf_counter(), time.process_time()
    got = ringlet.all_reduce("sum", torch.full((1024,), float(rank)))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    assert torch.equal(got, torch.full((1024,), float(sum(range(world)))))
    return {"checked": checked, "wall": wall, "cpu": cpu}


@pytest.mark.parametrize("world,busy", [(2, 1), (4, 1)])
def test_busy_neighbours_exact_results_and_parked_waits(world: int, busy: int) -> None:
    late = 0.6
    with neighbours(busy) as pids:
        assert len(pids) == busy
        out = launch(world, _exact_and_parked, late, timeout=180)
    for rank, r in out.items():
        assert r["checked"] == STEPS * len(SIZES) * 2
        if rank == world - 1:
            continue
        # The waiting ranks waited about as long as the late one computed...
        assert r["wall"] > 0.5 * late, (rank, r)
        # ...and parked: a rank that spun would burn about as much CPU as wall.
        assert r["cpu"] < 0.25 * r["wall"], (rank, r)


def test_busy_neighbours_stop_with_the_block() -> None:
    with neighbours(2) as pids:
        assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(ValueError, match="--busy -1"):
        with neighbours(-1):
            pass
