"""The soak program, short: a seeded random mix of every collective, random
dtypes and sizes (0 and odd counts included), replica groups, send/recv, the
bucket worker and a sharded checkpoint, on 4 ranks over both transports, every
result checked against torch, file descriptors and /dev/shm flat. The long
run: ``python -m ringlet.bench.soak`` (``RINGLET_SOAK_OPS``, default 10,000)."""

from __future__ import annotations

import os

import pytest

from ringlet.bench import soak

from conftest import TRANSPORTS


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_short_soak_is_correct_and_leaks_nothing(transport: str) -> None:
    ops = int(os.environ.get("RINGLET_SOAK_OPS", 600))
    out = soak.run(ops=ops, world=4, transport=transport, seed=14, timeout=300)
    assert set(out) == {0, 1, 2, 3}
    for rank, r in out.items():
        (rss0, fd0, shm0), (rss1, fd1, shm1) = r["before"], r["after"]
        assert fd1 <= fd0, (rank, r)
        assert shm1 <= shm0, (rank, r)
        assert rss1 - rss0 < 64 << 10, (rank, r)  # KiB: allocator noise, not a leak
        assert sum(r["counts"].values()) == ops
        assert {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
                "send_recv", "bucket", "checkpoint"} <= set(r["counts"]), r["counts"]
