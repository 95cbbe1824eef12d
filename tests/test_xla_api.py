"""The torch_xla ``xla_model`` surface of ringlet (seed 002), on real processes.

Each launched run does many checks at once (one run per world size and
transport) so the file stays short; every expected value is worked out by
hand or with plain torch on every rank. Bucketing is compared with the seed's
rules, transcribed below (``seed_coalescing_buckets``,
``seed_gradient_buckets``) and checked by hand-worked cases too.
"""

from __future__ import annotations

import collections
import io
import math
import os
import types
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn

import ringlet
import ringlet.xla.xla_model as C

from conftest import launch

MIB = 1 << 20
WORLD_TRANSPORTS = [(1, "shm"), (2, "shm"), (2, "tcp"), (3, "shm"), (3, "tcp"), (4, "shm"),
                    (4, "tcp")]


# ---------------------------------------------------------------------------
# The seed's bucketing rules, transcribed (sizes in bytes -> lists of indices)
# ---------------------------------------------------------------------------


def seed_coalescing_buckets(sizes: list[int], cap_mb: float) -> list[list[int]]:
    """CoalescingBuckets.__call__ of the seed, on byte sizes."""
    cap = cap_mb * 1024 * 1024
    buckets: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, nbytes in enumerate(sizes):
        new = total + nbytes
        if nbytes > cap and total < 0.5 * cap and new <= 2 * cap:
            cur.append(i)
            buckets.append(cur)
            cur, total = [], 0
        else:
            if new > cap:
                if cur:
                    buckets.append(cur)
                cur, total = [], 0
            cur.append(i)
            total += nbytes
    if cur:
        buckets.append(cur)
    return buckets


def seed_gradient_buckets(sizes: list[int], cap_mb: float) -> list[list[int]]:
    """all_reduce_bucketized_gradients of the seed, on byte sizes."""
    cap = cap_mb * 1024 * 1024
    buckets: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, nbytes in enumerate(sizes):
        total += nbytes
        if total > cap and cur:
            buckets.append(cur)
            total, cur = nbytes, []
        cur.append(i)
    if cur:
        buckets.append(cur)
    return buckets


def _bytes_tensor(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


class Recorder:
    """A CoalescingBuckets ``func`` that records the buckets by input index."""

    def __init__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor] | None = None):
        self.index = {id(t): i for i, t in enumerate(inputs)}
        self.out_index = {id(t): i for i, t in enumerate(outputs or [])}
        self.calls: list[tuple[str, list[int], Any]] = []

    def __call__(self, x: Any, out: Any) -> Any:
        if isinstance(x, torch.Tensor):
            o = None if out is None else [self.out_index[id(out)]]
            self.calls.append(("single", [self.index[id(x)]], o))
            return ("r", self.index[id(x)])
        o = None if out is None else [self.out_index[id(t)] for t in out]
        self.calls.append(("list", [self.index[id(t)] for t in x], o))
        return [("r", self.index[id(t)]) for t in x]

    def buckets(self) -> list[list[int]]:
        return [c[1] for c in self.calls]


# Hand-worked cases: (sizes in MiB, cap in MiB, expected buckets).
HAND_CASES = [
    # fill until the next tensor would spill over the cap
    ([0.25] * 5, 1, [[0, 1, 2, 3], [4]]),
    ([0.5, 0.5, 0.5], 1, [[0, 1], [2]]),
    # exactly the cap stays in; a zero-byte tensor joins the open bucket
    ([1.0, 0.0], 1, [[0, 1]]),
    # a big tensor joins a bucket under half the cap when the sum is <= 2x cap
    ([0.25, 1.5, 0.25], 1, [[0, 1], [2]]),
    ([0.25, 1.75], 1, [[0, 1]]),  # exactly twice the cap still joins
    ([1.5, 0.25], 1, [[0], [1]]),
    # ... not when the bucket is at least half full
    ([0.5, 1.2], 1, [[0], [1]]),
    ([0.6, 1.5], 1, [[0], [1]]),
    # ... nor when the sum would pass twice the cap
    ([0.25, 1.9], 1, [[0], [1]]),
    ([2.5], 1, [[0]]),
    ([0.1, 2.5, 0.1], 1, [[0], [1], [2]]),
    # cap 0: one tensor per bucket, zero-byte tensors included
    ([0.1, 0.2, 0.3], 0, [[0], [1], [2]]),
    ([0.0, 0.1, 0.0], 0, [[0], [1], [2]]),
    # the default cap (160 MiB) takes all small tensors in one bucket
    ([0.5] * 7, 160, [list(range(7))]),
    ([], 1, []),
]


@pytest.mark.parametrize(("sizes_mb", "cap", "want"), HAND_CASES)
def test_coalescing_buckets_hand_cases(sizes_mb: list[float], cap: int, want: Any) -> None:
    sizes = [int(s * MIB) for s in sizes_mb]
    assert seed_coalescing_buckets(sizes, cap) == want  # the transcription agrees
    inputs = [_bytes_tensor(n) for n in sizes]
    rec = Recorder(inputs)
    out = ringlet.CoalescingBuckets(rec, inputs, bucket_cap_mb=cap)()
    assert rec.buckets() == want
    # a one-tensor bucket gets the tensor itself, larger ones a list
    assert [c[0] for c in rec.calls] == ["single" if len(b) == 1 else "list" for b in want]
    assert out == [("r", i) for i in range(len(sizes))]


def test_coalescing_buckets_matches_seed_rule_on_random_sizes() -> None:
    g = torch.Generator().manual_seed(7)
    dtypes = [torch.float32, torch.float64, torch.int16, torch.uint8, torch.bfloat16]
    for trial in range(60):
        n = int(torch.randint(1, 14, (1,), generator=g))
        inputs = []
        for _ in range(n):
            dt = dtypes[int(torch.randint(0, len(dtypes), (1,), generator=g))]
            numel = int(torch.randint(0, 3 * MIB // 8, (1,), generator=g))
            inputs.append(torch.empty(numel, dtype=dt))
        outputs = [torch.empty(0) for _ in inputs]
        cap = [0, 1, 2, 160][trial % 4]
        want = seed_coalescing_buckets([t.numel() * t.element_size() for t in inputs], cap)
        rec = Recorder(inputs, outputs)
        ringlet.CoalescingBuckets(rec, inputs, outputs, bucket_cap_mb=cap)()
        assert rec.buckets() == want, (trial, cap)
        # the outputs travel with their inputs, bucket by bucket
        assert [c[2] for c in rec.calls] == want


def test_coalescing_buckets_argument_checks() -> None:
    t = [torch.zeros(2), torch.zeros(3)]

    def f(x: Any, o: Any) -> Any:
        return x

    with pytest.raises(TypeError, match="`input_list` needs to be a list of Tensors"):
        ringlet.CoalescingBuckets(f, tuple(t))
    with pytest.raises(TypeError, match="`input_list` needs to be a list of Tensors"):
        ringlet.CoalescingBuckets(f, [torch.zeros(1), 3])
    with pytest.raises(TypeError, match="`input_list` needs to be a list of Tensors"):
        ringlet.CoalescingBuckets(f, torch.zeros(3))
    with pytest.raises(TypeError, match="`output_list` needs to be a list of Tensors"):
        ringlet.CoalescingBuckets(f, t, output_list=torch.zeros(2))
    with pytest.raises(TypeError, match="`output_list` needs to be a list of Tensors"):
        ringlet.CoalescingBuckets(f, t, output_list=[torch.zeros(1), "x"])
    with pytest.raises(ValueError, match=r"`output_list` length doesn't match .* 1 vs 2"):
        ringlet.CoalescingBuckets(f, t, output_list=[torch.zeros(1)])
    # the default cap is the seed's 160 MiB
    assert ringlet.CoalescingBuckets(f, t)._bucket_cap == 160 * MIB
    assert ringlet.CoalescingBuckets(f, [])() == []
    # all_gather_bucketized rejects pin_layout=True before communicating
    with pytest.raises(RuntimeError, match="pin_layout=True is not yet supported"):
        ringlet.all_gather_bucketized(t, pin_layout=True)


def test_gradient_bucket_rule_hand_cases() -> None:
    # the gradient rule has no "big tensor" exception: a bucket closes when
    # the running total passes the cap
    rule = seed_gradient_buckets
    assert rule([int(0.4 * MIB)] * 5, 1) == [[0, 1], [2, 3], [4]]
    assert rule([int(0.25 * MIB), int(1.5 * MIB), int(0.25 * MIB)], 1) == [[0], [1], [2]]
    assert rule([4, 4, 4], 0) == [[0], [1], [2]]
    assert rule([MIB, 0], 1) == [[0, 1]]


# ---------------------------------------------------------------------------
# RateTracker (no communication)
# ---------------------------------------------------------------------------


def test_rate_tracker(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(C, "time", types.SimpleNamespace(time=lambda: clock[0]))
    monkeypatch.delenv("RATE_TRACKER_SMOOTHING", raising=False)
    rt = ringlet.RateTracker()
    rt.add(10)
    clock[0] = 102.0
    assert rt.rate() == pytest.approx(5.0)  # first rate: no smoothing
    rt.add(30)
    clock[0] = 104.0
    assert rt.rate() == pytest.approx(0.6 * 15.0 + 0.4 * 5.0)  # default factor 0.4
    assert rt.rate() == 0.0  # no time passed: 0, nothing updated
    assert rt.global_rate() == pytest.approx(40 / 4)
    rt.add(6)
    clock[0] = 106.0
    assert rt.global_rate() == pytest.approx(46 / 6)  # counts not yet rated too
    assert rt.rate() == pytest.approx(0.6 * 3.0 + 0.4 * 11.0)
    monkeypatch.setenv("RATE_TRACKER_SMOOTHING", "0.5")
    rt2 = ringlet.RateTracker()
    rt2.add(4)
    clock[0] = 108.0
    assert rt2.rate() == pytest.approx(2.0)
    rt2.add(8)
    clock[0] = 110.0
    assert rt2.rate() == pytest.approx(0.5 * 4.0 + 0.5 * 2.0)
    rt3 = ringlet.RateTracker(smooth_factor=0.0)
    rt3.add(1)
    clock[0] = 111.0
    rt3.rate()
    rt3.add(9)
    clock[0] = 112.0
    assert rt3.rate() == pytest.approx(9.0)
    # torch_xla's private pieces: _smooth blends, _update folds the count in
    rt4 = ringlet.RateTracker(smooth_factor=0.25)
    assert rt4._smooth(8.0) == 8.0  # no previous rate yet
    rt4.add(5)
    rt4._update(120.0, 4.0)
    assert (rt4._partial_count, rt4._count, rt4._partial_time, rt4._partial_rate) == (
        5.0, 0.0, 120.0, 4.0)
    assert rt4._smooth(8.0) == pytest.approx(0.75 * 8.0 + 0.25 * 4.0)


# ---------------------------------------------------------------------------
# Helpers used inside the launched ranks
# ---------------------------------------------------------------------------


def _ranks_value(world: int, fn: Callable[[int], torch.Tensor]) -> list[torch.Tensor]:
    return [fn(r) for r in range(world)]


class CallLog:
    """Wraps a module-level collective of ringlet.xla.xla_model to record the
    tensors (by identity) of each call; restores it on exit."""

    def __init__(self, name: str, index: dict[int, int]):
        self.name, self.index, self.calls = name, index, []

    def __enter__(self) -> CallLog:
        self.orig = getattr(C, self.name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            value = kwargs.get("value", kwargs.get("input", None))
            if value is None:
                value = args[1] if self.name in ("all_reduce", "reduce_scatter") else args[0]
            items = value if isinstance(value, list) else [value]
            self.calls.append([self.index.get(id(t), -1) for t in items])
            return self.orig(*args, **kwargs)

        setattr(C, self.name, wrapper)
        return self

    def __exit__(self, *exc: Any) -> None:
        setattr(C, self.name, self.orig)


def plain_optimizer(params: list[nn.Parameter], on_step: Callable[[], Any] | None = None) -> Any:
    """What reduce_gradients / optimizer_step use of an optimizer (``param_groups``
    and ``step``), without torch.optim: its first use imports torch._dynamo,
    seconds per rank on a small box. The training tests use real optimizers."""
    return types.SimpleNamespace(param_groups=[{"params": params}],
                                 step=on_step or (lambda: None))


def check_gather_scatter(rank: int, world: int) -> None:
    # --- all_gather on every dim, negative dims, 3-d, output=, lists ----------
    def x_of(r: int) -> torch.Tensor:
        return torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100 * r

    xs = _ranks_value(world, x_of)
    for dim in (0, 1, 2, -1, -2, -3):
        want = torch.cat(xs, dim=dim)
        got = ringlet.all_gather(xs[rank], dim=dim)
        assert torch.equal(got, want), f"all_gather dim={dim}"
        out = torch.full(want.shape, -1.0)
        assert ringlet.all_gather(xs[rank], dim=dim, output=out) is out
        assert torch.equal(out, want), f"all_gather output= dim={dim}"
    # hand-worked: 1-d on dim -1
    assert ringlet.all_gather(torch.tensor([rank, 10 * rank]), dim=-1).tolist() == [
        v for r in range(world) for v in (r, 10 * r)
    ]
    # a list of tensors with different dtypes and shapes (pin_layout=False)
    ints = _ranks_value(world, lambda r: torch.full((3, 2), r, dtype=torch.int64))
    halfs = _ranks_value(world, lambda r: torch.tensor([[r + 0.5]], dtype=torch.bfloat16))
    got = ringlet.all_gather([ints[rank], halfs[rank]], dim=1, pin_layout=False)
    assert isinstance(got, list) and len(got) == 2
    assert torch.equal(got[0], torch.cat(ints, dim=1))
    assert torch.equal(got[1], torch.cat(halfs, dim=1))
    outs = [torch.empty(3, 2 * world, dtype=torch.int64),
            torch.empty(1, world, dtype=torch.bfloat16)]
    back = ringlet.all_gather([ints[rank], halfs[rank]], dim=-1, output=outs, pin_layout=False)
    assert back is outs
    assert torch.equal(outs[0], torch.cat(ints, dim=1))
    assert torch.equal(outs[1], torch.cat(halfs, dim=1))
    assert ringlet.all_gather([], pin_layout=False) == []

    # --- reduce_scatter on every dim, negative dims, scale, output=, lists ----
    def full_of(r: int, shape: list[int]) -> torch.Tensor:
        return torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) * (r + 1)

    total = world * (world + 1) / 2  # sum over ranks of (r + 1)
    for shape, dim in (([2 * world, 3], 0), ([3, 2 * world], 1), ([3, 2 * world], -1),
                       ([2, world, 2], 1), ([2, world, 2], -2), ([world, 1, 3], -3)):
        base = full_of(0, shape)
        mine = full_of(rank, shape)
        want_sum = base.mul(total).chunk(world, dim=dim)[rank]
        got = ringlet.reduce_scatter(ringlet.REDUCE_SUM, mine, 0.5, dim, world)
        assert torch.equal(got, want_sum * 0.5), f"reduce_scatter shape={shape} dim={dim}"
        want_max = base.mul(world).chunk(world, dim=dim)[rank]
        out = torch.empty(want_max.shape, dtype=torch.float64)
        got = ringlet.reduce_scatter(ringlet.REDUCE_MAX, mine, 1.0, dim, world, output=out)
        assert got is out and torch.equal(out, want_max)
        out = torch.empty(want_sum.shape, dtype=torch.float64)
        got = ringlet.reduce_scatter(ringlet.REDUCE_SUM, mine, 0.5, dim, world, output=out)
        assert got is out and torch.equal(out, want_sum * 0.5)
    # an output that overlaps the input (here: another rank's block of it) is safe
    mine = torch.arange(4.0 * world) + rank
    want = sum(torch.arange(4.0 * world) + r for r in range(world)).chunk(world)[rank]
    alias = mine[4 * ((rank + 1) % world): 4 * ((rank + 1) % world) + 4]
    got = ringlet.reduce_scatter(ringlet.REDUCE_SUM, mine, 1.0, 0, world, output=alias)
    assert got is alias and torch.equal(alias, want)
    # list input (in place is the seed's wording: the results come back as a list)
    a = torch.arange(2 * world, dtype=torch.int32) * (rank + 1)
    b = torch.ones(3, 2 * world) * (rank + 1)
    got = ringlet.reduce_scatter(ringlet.REDUCE_SUM, [a, b], 1.0, -1, world)
    assert isinstance(got, list) and len(got) == 2
    assert got[0].tolist() == [int((2 * rank) * total), int((2 * rank + 1) * total)]
    assert torch.equal(got[1], torch.full((3, 2), total))
    outs = [torch.empty(2, dtype=torch.int32), torch.empty(3, 2)]
    back = ringlet.reduce_scatter(ringlet.REDUCE_MIN, [a, b], 1.0, -1, world, output=outs)
    assert back is outs
    assert outs[0].tolist() == [2 * rank, 2 * rank + 1]
    assert torch.equal(outs[1], torch.ones(3, 2))

    # --- bucketized variants: caps 0, small (1 MiB) and the default ----------
    sizes = [int(0.3 * MIB) // 4] * 5 + [7, int(1.2 * MIB) // 4, 3]  # float32 element counts
    ins = [torch.full((n,), float(rank + 1 + i)) for i, n in enumerate(sizes)]
    index = {id(t): i for i, t in enumerate(ins)}
    nbytes = [4 * n for n in sizes]
    for cap in (0, 1, None):
        kwargs = {} if cap is None else {"bucket_cap_mb": cap}
        want_buckets = seed_coalescing_buckets(nbytes, 160 if cap is None else cap)
        with CallLog("all_gather", index) as log:
            got = ringlet.all_gather_bucketized(ins, **kwargs)
        assert log.calls == want_buckets, f"all_gather_bucketized cap={cap}"
        assert len(got) == len(ins)
        for i, g in enumerate(got):
            assert torch.equal(g, torch.cat([torch.full((sizes[i],), float(r + 1 + i))
                                             for r in range(world)])), (cap, i)
        outs = [torch.empty(world * n) for n in sizes]
        got = ringlet.all_gather_bucketized(ins, output=outs, **kwargs)
        assert all(g is o for g, o in zip(got, outs))
        assert outs[5].tolist() == [float(r + 6) for r in range(world) for _ in range(7)]
        # reduce_scatter: every tensor is rank-independent up to the (r + 1 + i) factor
        rs_in = [torch.full((world * n,), float(rank + 1 + i)) for i, n in enumerate(sizes)]
        rs_index = {id(t): i for i, t in enumerate(rs_in)}
        rs_bytes = [4 * world * n for n in sizes]
        with CallLog("reduce_scatter", rs_index) as log:
            got = ringlet.reduce_scatter_bucketized(
                ringlet.REDUCE_SUM, rs_in, 1.0 / world, 0, world, **kwargs
            )
        assert log.calls == seed_coalescing_buckets(rs_bytes, 160 if cap is None else cap)
        for i, g in enumerate(got):
            want = sum(r + 1 + i for r in range(world)) / world
            assert g.shape == (sizes[i],) and torch.allclose(g, torch.full_like(g, want))
        outs = [torch.empty(n) for n in sizes]
        got = ringlet.reduce_scatter_bucketized(
            ringlet.REDUCE_MAX, rs_in, 1.0, 0, world, output=outs, **kwargs
        )
        assert all(g is o for g, o in zip(got, outs))
        assert outs[6].eq(float(world + 6)).all()

    # --- all_reduce_bucketized_gradients: caps 0 (default), small, large -----
    gsizes = [int(0.4 * MIB) // 4] * 5 + [5]
    for cap in (None, 0, 1, 160):
        grads = [torch.full((n,), float((rank + 1) * (i + 1))) for i, n in enumerate(gsizes)]
        index = {id(t): i for i, t in enumerate(grads)}
        args = () if cap is None else (cap,)
        with CallLog("all_reduce", index) as log:
            back = ringlet.all_reduce_bucketized_gradients(grads, 1.0 / world, None, True, *args)
        assert back is None
        want_buckets = seed_gradient_buckets([4 * n for n in gsizes], cap or 0)
        assert log.calls == want_buckets, f"gradient buckets cap={cap}"
        if cap == 1:
            assert want_buckets == [[0, 1], [2, 3], [4, 5]]
        for i, gr in enumerate(grads):
            assert torch.allclose(gr, torch.full_like(gr, total * (i + 1) / world))


def check_rendezvous_mesh_save(rank: int, world: int, tmp: str) -> None:
    # unequal payloads, in rank order
    got = ringlet.rendezvous("unequal", bytes([65 + rank]) * (3 * rank))
    assert got == [bytes([65 + r]) * (3 * r) for r in range(world)]
    # one rank with data, the others empty
    got = ringlet.rendezvous("one", b"\x00\x01" if rank == world - 1 else b"")
    assert got == [b""] * (world - 1) + [b"\x00\x01"]
    # all empty: empty bytes for everyone
    assert ringlet.rendezvous("empty") == [b""] * world
    assert ringlet.rendezvous("empty2", b"", []) == [b""] * world
    # every rank listed (any order) is a global rendezvous
    assert ringlet.rendezvous("all", b"%d" % rank, list(range(world))[::-1]) == [
        b"%d" % r for r in range(world)
    ]
    # non-bytes payloads: TypeError, nothing sent
    for bad in ("text", [1, 2], 7, None):
        with pytest.raises(TypeError, match="`payload` must be bytes"):
            ringlet.rendezvous("bad", bad)  # type: ignore[arg-type]
    # as torch_xla: only the whole world; a list of another length is refused
    if world >= 2:
        for part in ([rank], [*range(world), world]):
            with pytest.raises(ValueError, match="Only global rendezvous is supported"):
                ringlet.rendezvous("part", b"x", part)
            with pytest.raises(ValueError, match="Only global rendezvous is supported"):
                ringlet.xla_rendezvous(b"x", part)
    ringlet.barrier()

    # mesh_reduce: scalars, tensors, containers; reduce_fn sees ordinal order
    assert ringlet.mesh_reduce("order", rank, list) == list(range(world))
    assert ringlet.mesh_reduce("mean", rank + 0.5, np.mean) == pytest.approx(world / 2)
    assert ringlet.mesh_reduce("sum", rank * 2, sum) == world * (world - 1)
    assert ringlet.mesh_reduce("max", float(rank), max) == world - 1
    t = torch.arange(4.0).reshape(2, 2) * (rank + 1)
    got = ringlet.mesh_reduce("tensor", t, lambda ts: torch.stack(ts).sum(0))
    assert torch.equal(got, torch.arange(4.0).reshape(2, 2) * (world * (world + 1) / 2))
    got = ringlet.mesh_reduce(
        "dict", {"n": rank, "t": torch.tensor([rank])},
        lambda ds: {"n": sum(d["n"] for d in ds), "t": torch.cat([d["t"] for d in ds])},
    )
    assert got["n"] == world * (world - 1) // 2 and got["t"].tolist() == list(range(world))

    # save: master_only (default) -> only the master writes; everyone reads it back
    path = os.path.join(tmp, f"w{world}_master.pt")
    data = {"rank": rank, "w": torch.full((3,), float(rank)), "nested": [torch.tensor([rank])]}
    assert ringlet.save(data, path) is None
    ringlet.rendezvous("saved")
    back = torch.load(path, weights_only=False)
    assert back["rank"] == 0 and torch.equal(back["w"], torch.zeros(3))
    assert back["nested"][0].tolist() == [0]
    path_g = os.path.join(tmp, f"w{world}_global.pt")
    ringlet.save(data, path_g, master_only=True, global_master=True)
    ringlet.rendezvous("saved-global")
    assert torch.load(path_g, weights_only=False)["rank"] == 0
    # master_only=False: every rank writes its own file; every rank reads all
    ringlet.save(data, os.path.join(tmp, f"w{world}_r{rank}.pt"), master_only=False)
    ringlet.rendezvous("saved-all")
    for r in range(world):
        other = torch.load(os.path.join(tmp, f"w{world}_r{r}.pt"), weights_only=False)
        assert other["rank"] == r and torch.equal(other["w"], torch.full((3,), float(r)))
    # a file object: written on the master only
    buf = io.BytesIO()
    ringlet.save(data, buf)
    assert (len(buf.getvalue()) > 0) == (rank == 0)
    ringlet.barrier()


def check_shortcuts_and_misc(rank: int, world: int) -> None:
    # master ordinals on one host: local and global master is rank 0
    assert ringlet.is_master_ordinal() == (rank == 0)
    assert ringlet.is_master_ordinal(local=True) == (rank == 0)
    assert ringlet.is_master_ordinal(local=False) == (rank == 0)
    assert ringlet.get_local_ordinal() == rank and ringlet.get_ordinal() == rank
    assert ringlet.world_size() == world
    fd = io.StringIO()
    ringlet.master_print("hello", rank, fd=fd)
    assert fd.getvalue() == ("hello 0\n" if rank == 0 else "")
    assert ringlet.wait_device_ops() is None and ringlet.wait_device_ops(["xla:0"]) is None

    x = torch.tensor([1.0, 2.0]) * (rank + 1)
    if world == 1:
        # world-size-1 shortcuts: a single tensor returns a clone (unscaled),
        # a list is returned as is (untouched, unscaled)
        got = ringlet.all_reduce(ringlet.REDUCE_SUM, x, scale=3.0)
        assert got is not x and got.data_ptr() != x.data_ptr() and torch.equal(got, x)
        lst = [x.clone(), torch.ones(2)]
        assert ringlet.all_reduce(ringlet.REDUCE_SUM, lst, scale=3.0) is lst
        assert torch.equal(lst[0], x) and torch.equal(lst[1], torch.ones(2))
        # all_gather at one replica also returns a new tensor
        got = ringlet.all_gather(x)
        assert got is not x and torch.equal(got, x)
        # XLA_ALWAYS_ALLREDUCE=1 turns the shortcut off (so scale applies); 0 keeps it
        os.environ["XLA_ALWAYS_ALLREDUCE"] = "1"
        try:
            assert torch.equal(ringlet.all_reduce(ringlet.REDUCE_SUM, x, scale=3.0), x * 3)
            os.environ["XLA_ALWAYS_ALLREDUCE"] = "0"
            assert torch.equal(ringlet.all_reduce(ringlet.REDUCE_SUM, x, scale=3.0), x)
        finally:
            del os.environ["XLA_ALWAYS_ALLREDUCE"]
        # collective_broadcast and mesh_reduce at one replica
        t = torch.arange(3)
        ringlet.collective_broadcast([t])
        assert t.tolist() == [0, 1, 2]
        assert ringlet.rendezvous("solo", b"abc") == [b"abc"]
        assert ringlet.mesh_reduce("solo", 5, sum) == 5
    else:
        got = ringlet.all_reduce(ringlet.REDUCE_SUM, x, scale=0.5)
        assert torch.equal(got, torch.tensor([1.0, 2.0]) * world * (world + 1) / 4)
        assert torch.equal(x, torch.tensor([1.0, 2.0]) * (rank + 1))  # input untouched
        # the single-tensor form on sizes below and above the one-phase limit,
        # integer and float, with gradients: a new tensor, the input untouched
        for n, dtype in ((3, torch.int32), (100_000, torch.float64)):
            src = (torch.arange(n) % 7 + rank).to(dtype)
            keep = src.clone()
            got = ringlet.all_reduce(ringlet.REDUCE_MAX, src)
            assert got is not src and torch.equal(src, keep)
            assert torch.equal(got, (torch.arange(n) % 7 + world - 1).to(dtype))
        w = torch.ones(4, requires_grad=True)
        got = ringlet.all_reduce(ringlet.REDUCE_SUM, w, scale=2.0)
        assert not got.requires_grad and got.tolist() == [2.0 * world] * 4
        lst = [x.clone(), torch.ones(2, dtype=torch.int64)]
        assert ringlet.all_reduce(ringlet.REDUCE_MAX, lst) is lst
        assert torch.equal(lst[0], torch.tensor([1.0, 2.0]) * world)
        assert lst[1].tolist() == [1, 1]

    # broadcast_master_param: every parameter and buffer becomes rank 0's
    def model_for(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
        m[1].running_mean.fill_(float(seed))
        m[1].num_batches_tracked.fill_(seed * 7)
        return m

    mine, ref = model_for(rank), model_for(0)
    assert ringlet.broadcast_master_param(mine) is None
    for (n1, a), (_, b) in zip(mine.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), n1
    ringlet.barrier()


def check_groups(rank: int, world: int) -> None:
    assert world == 4
    for groups in ([[0, 1], [2, 3]], [[0, 2], [1, 3]]):
        mine = next(g for g in groups if rank in g)
        i = mine.index(rank)
        gsum = sum(r + 1 for r in mine)
        # all_reduce single and list, with scale
        x = torch.tensor([float(rank + 1)])
        assert ringlet.all_reduce("sum", x, scale=2.0, groups=groups).item() == 2 * gsum
        lst = [torch.tensor([rank]), torch.tensor([[float(rank)]])]
        ringlet.all_reduce("max", lst, groups=groups)
        assert lst[0].item() == max(mine) and lst[1].item() == float(max(mine))
        # all_gather on an inner dim, with output=, and as a list
        v = torch.tensor([[rank, 10 * rank]])
        want = torch.tensor([[r, 10 * r] for r in mine]).reshape(1, -1)
        assert torch.equal(ringlet.all_gather(v, dim=-1, groups=groups), want)
        out = torch.empty(1, 4, dtype=torch.int64)
        assert ringlet.all_gather(v, dim=1, groups=groups, output=out) is out
        assert torch.equal(out, want)
        got = ringlet.all_gather([v, v * 2], dim=0, groups=groups, pin_layout=False)
        assert torch.equal(got[1], torch.tensor([[2 * r, 20 * r] for r in mine]))
        # reduce_scatter on the last dim: shard i of the group's sum
        full = torch.arange(6.0).reshape(3, 2) * (rank + 1)
        got = ringlet.reduce_scatter("sum", full, 1.0, -1, 2, groups=groups)
        assert torch.equal(got, (torch.arange(6.0).reshape(3, 2) * gsum)[:, i : i + 1])
        # collective_broadcast from the group's last member
        t = torch.full((2,), rank)
        ringlet.collective_broadcast([t], root_ordinal=mine[-1], groups=groups)
        assert t.tolist() == [mine[-1]] * 2
        # bucketized variants inside groups
        ins = [torch.full((3,), float(rank)), torch.full((2, 2), float(rank))]
        got = ringlet.all_gather_bucketized(ins, dim=0, groups=groups, bucket_cap_mb=0)
        assert torch.equal(got[0], torch.cat([torch.full((3,), float(r)) for r in mine]))
        got = ringlet.reduce_scatter_bucketized("sum", [torch.ones(4) * (rank + 1)], 1.0, 0, 2,
                                                groups=groups)
        assert torch.equal(got[0], torch.full((2,), float(gsum)))
        grads = [torch.full((5,), float(rank + 1)), torch.full((3,), 2.0 * (rank + 1))]
        ringlet.all_reduce_bucketized_gradients(grads, 0.5, groups, True, 0)
        assert torch.equal(grads[0], torch.full((5,), gsum / 2))
        assert torch.equal(grads[1], torch.full((3,), float(gsum)))
        # reduce_gradients sums in the group and scales by 1 / world size,
        # as torch_xla does
        p = nn.Parameter(torch.zeros(3))
        p.grad = torch.full((3,), float(rank + 1))
        ringlet.reduce_gradients(plain_optimizer([p]), groups=groups)
        assert torch.equal(p.grad, torch.full((3,), gsum / world))
    # unequal groups are fine where the seed does not require equal sizes
    groups = [[0], [1, 2, 3]]
    mine = next(g for g in groups if rank in g)
    assert ringlet.all_reduce("sum", torch.tensor([1]), groups=groups).item() == len(mine)
    # one group listing every rank in another order: the group order decides
    groups = [[3, 2, 1, 0]]
    assert ringlet.all_gather(torch.tensor([rank]), groups=groups).tolist() == [3, 2, 1, 0]
    ringlet.barrier()


def check_errors(rank: int, world: int) -> None:
    """Every error the seed defines (and the bad-groups ones the issue adds):
    raised on every rank, before anything is sent, so nothing hangs."""
    everyone = list(range(world))
    x = torch.zeros(2 * world)
    bad_groups = [
        ([everyone, everyone], "appears in replica groups 0 and 1"),  # every rank in two
        ([everyone[1:]], "in no replica group"),  # rank 0 in none
        ([[*everyone, world]], "out of range for world size"),  # a rank out of range
        ([[-1, *everyone]], "out of range for world size"),
        # sizes differ too: gather/scatter report that first
        ([[], everyone], "is empty|same number of replicas"),
        ([0, 1], "must be a list of lists"),
        ([["a", *everyone]], "not a rank"),
    ]
    if world >= 2:
        calls: list[Callable[[Any], Any]] = [
            lambda g: ringlet.all_reduce("sum", x, groups=g),
            lambda g: ringlet.all_reduce("sum", [x.clone()], groups=g),
            lambda g: ringlet.all_gather(x, groups=g),
            lambda g: ringlet.all_gather([x], groups=g, pin_layout=False),
            lambda g: ringlet.reduce_scatter("sum", x, 1.0, 0, world, groups=g),
            lambda g: ringlet.collective_broadcast([x.clone()], groups=g),
            lambda g: ringlet.all_gather_bucketized([x], groups=g),
            lambda g: ringlet.reduce_scatter_bucketized("sum", [x], 1.0, 0, world, groups=g),
            lambda g: ringlet.all_reduce_bucketized_gradients([x.clone()], 1.0, g, True),
        ]
        for groups, msg in bad_groups:
            for call in calls:
                with pytest.raises(ValueError, match=msg):
                    call(groups)
        p = nn.Parameter(torch.zeros(2))
        p.grad = torch.ones(2)
        steps: list[int] = []
        opt = plain_optimizer([p], on_step=lambda: steps.append(1))
        with pytest.raises(ValueError, match="appears in replica groups"):
            ringlet.optimizer_step(opt, groups=[everyone, everyone])
        assert steps == [] and torch.equal(p.grad, torch.ones(2)), "no step after a failure"
        with pytest.raises(ValueError, match="in no replica group"):
            ringlet.reduce_gradients(opt, groups=[[0]])
    if world >= 3:
        # unequal group sizes where the seed requires equal ones
        uneq = [[0], everyone[1:]]
        for call in (
            lambda: ringlet.all_gather(torch.zeros(1), groups=uneq, pin_layout=False),
            lambda: ringlet.all_gather(torch.zeros(1), groups=uneq, output=torch.zeros(1)),
            lambda: ringlet.all_gather([torch.zeros(1)], groups=uneq, pin_layout=False),
            lambda: ringlet.reduce_scatter("sum", torch.zeros(2), 1.0, 0, 1, groups=uneq),
            lambda: ringlet.all_gather_bucketized([torch.zeros(1)], groups=uneq),
            lambda: ringlet.reduce_scatter_bucketized("sum", [torch.zeros(2)], 1.0, 0, 1,
                                                      groups=uneq),
        ):
            with pytest.raises(ValueError, match="same number of replicas"):
                call()
            with pytest.raises(AssertionError, match="same number of replicas"):
                call()  # both, as torch_xla asserts
        # the default form gathers through an all-reduce: any group sizes
        mine = [0] if rank == 0 else everyone[1:]
        got = ringlet.all_gather(torch.tensor([rank, -rank]), groups=uneq)
        assert got.tolist() == [v for r in mine for v in (r, -r)]
    # argument errors of the seed (type / value checks)
    with pytest.raises(TypeError, match="`value` needs to be a Tensor or a list of Tensors"):
        ringlet.all_gather((x,))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`value` needs to be a Tensor or a list of Tensors"):
        ringlet.all_gather([x, 1.0], pin_layout=False)  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match="pin_layout=True is not yet supported"):
        ringlet.all_gather([x])
    with pytest.raises(TypeError, match="`output` needs to be a list of Tensors"):
        ringlet.all_gather([x], output=torch.zeros(1), pin_layout=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`output` length doesn't match `input` length: 2 vs 1"):
        ringlet.all_gather([x], output=[x, x], pin_layout=False)
    with pytest.raises(TypeError, match="`input` needs to be a Tensor or a list of Tensors"):
        ringlet.reduce_scatter("sum", "x", 1.0, 0, world)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`output` needs to be a list of Tensors"):
        ringlet.reduce_scatter("sum", [x], 1.0, 0, world, output=(x,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`output` length doesn't match `input` length: 0 vs 1"):
        ringlet.reduce_scatter("sum", [x], 1.0, 0, world, output=[])
    with pytest.raises(TypeError, match="`output_list` needs to be a list of Tensors"):
        ringlet.all_gather_bucketized([x], output=x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`output_list` length doesn't match"):
        ringlet.reduce_scatter_bucketized("sum", [x, x], 1.0, 0, world, output=[x])
    with pytest.raises(TypeError, match="`input_list` needs to be a list of Tensors"):
        ringlet.reduce_scatter_bucketized("sum", x, 1.0, 0, world)
    with pytest.raises(RuntimeError, match="pin_layout=True is not yet supported"):
        ringlet.all_gather_bucketized([x], pin_layout=True)
    with pytest.raises(ValueError, match=f"shard_count={world + 1} must equal"):
        ringlet.reduce_scatter("sum", torch.zeros(world * (world + 1)), 1.0, 0, world + 1)
    if world > 1:
        with pytest.raises(ValueError, match="not divisible by shard_count"):
            ringlet.reduce_scatter("sum", torch.zeros(3, 2 * world + 1), 1.0, 1, world)
    # An output of another shape is overwritten outright, as torch_xla's
    # out-variants do (its reduce_scatter test passes outputs of the input's
    # shape); one that cannot be resized, or shares the input's memory, is an
    # error. The one-call fast paths hand all of these to the checked path.
    full = torch.arange(2.0 * world * 3).reshape(2 * world, 3) + rank
    want = sum(torch.arange(2.0 * world * 3).reshape(2 * world, 3) + r for r in range(world))
    out = torch.full((2 * world, 3), -1.0)  # the input's shape
    assert ringlet.reduce_scatter("sum", full, 0.5, 0, world, output=out) is out
    assert torch.equal(out, 0.5 * want[2 * rank: 2 * rank + 2])
    outs = [torch.zeros(1), torch.zeros(5, 5)]
    got = ringlet.reduce_scatter("sum", [full, 2 * full], 1.0, 0, world, output=outs)
    assert got is outs and torch.equal(outs[0], want[2 * rank: 2 * rank + 2])
    assert torch.equal(outs[1], 2 * want[2 * rank: 2 * rank + 2])
    out = torch.zeros(3, 2 * world)  # the right byte count in another shape
    assert ringlet.all_gather(torch.zeros(2, 3) + rank, output=out) is out
    assert torch.equal(out, torch.cat([torch.zeros(2, 3) + r for r in range(world)]))
    with pytest.raises(ValueError, match="output has shape"):
        ringlet.reduce_scatter("sum", x, 1.0, 0, world, output=np.zeros(3, dtype=x.numpy().dtype))
    if world > 1:
        with pytest.raises(ValueError, match="output has shape"):
            ringlet.all_gather(full, output=full)  # its own input
    if world > 1:
        with pytest.raises(ValueError, match="not divisible by shard_count"):
            ringlet.reduce_scatter("sum", torch.zeros(2 * world + 1, 2), 1.0, 0, world)
    with pytest.raises(ValueError, match="dimension -3 is out of range"):
        ringlet.all_gather(torch.zeros(2, 2), dim=-3)
    with pytest.raises(ValueError, match="unknown reduce type 'avg'"):
        ringlet.reduce_scatter("avg", x, 1.0, 0, world)
    with pytest.raises(ValueError, match="out of range"):
        ringlet.collective_broadcast([x], root_ordinal=world)
    with pytest.raises(TypeError, match="`payload` must be bytes"):
        ringlet.rendezvous("bad", "str")  # type: ignore[arg-type]
    # nothing was communicated by any failed call: the next collective is correct
    assert ringlet.all_reduce("sum", torch.ones(1)).item() == world


def api_run(rank: int, world: int, tmp: str) -> str:
    torch.set_num_threads(1)  # ranks share the cores: no intra-op thread oversubscription
    check_gather_scatter(rank, world)
    check_rendezvous_mesh_save(rank, world, tmp)
    check_shortcuts_and_misc(rank, world)
    if world == 4:
        check_groups(rank, world)
    check_errors(rank, world)
    return "ok"


@pytest.mark.parametrize(("world", "transport"), WORLD_TRANSPORTS)
def test_xla_api(world: int, transport: str, tmp_path: Path) -> None:
    out = launch(world, api_run, str(tmp_path), transport=transport)
    assert out == {r: "ok" for r in range(world)}


def two_hosts(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    # RINGLET_HOST_ID fakes hosts a = {0, 1}, b = {2, 3}
    host = 0 if rank < 2 else 1
    assert ringlet.host_layout() == [[0, 1], [2, 3]]
    assert ringlet.get_local_ordinal() == rank % 2
    assert ringlet.is_master_ordinal() == (rank % 2 == 0)
    assert ringlet.is_master_ordinal(local=True) == (rank % 2 == 0)
    assert ringlet.is_master_ordinal(local=False) == (rank == 0)
    fd = io.StringIO()
    ringlet.master_print("g", fd=fd)  # global master by default
    ringlet.master_print("l", fd=fd, local=True)
    assert fd.getvalue() == {0: "g\nl\n", 1: "", 2: "l\n", 3: ""}[rank]
    # save, master_only: each host's local master writes "its" file (a path per
    # host stands for each host's own disk); global_master: only rank 0 writes
    data = {"rank": rank}
    ringlet.save(data, os.path.join(tmp, f"local_h{host}.pt"))
    ringlet.save(data, os.path.join(tmp, f"global_h{host}.pt"), global_master=True)
    ringlet.rendezvous("saved")
    for h, writer in ((0, 0), (1, 2)):
        assert torch.load(os.path.join(tmp, f"local_h{h}.pt"))["rank"] == writer
    assert torch.load(os.path.join(tmp, "global_h0.pt"))["rank"] == 0
    assert not os.path.exists(os.path.join(tmp, "global_h1.pt"))
    # collectives across the two "hosts" still agree
    assert ringlet.all_reduce("sum", torch.tensor([rank])).item() == 6
    got = ringlet.all_gather(torch.tensor([rank]), groups=[[0, 2], [1, 3]])
    assert got.tolist() == [rank % 2, rank % 2 + 2]


def test_local_and_global_master_on_two_hosts(tmp_path: Path) -> None:
    hosts = [{"RINGLET_HOST_ID": h} for h in ("host-a", "host-a", "host-b", "host-b")]
    launch(4, two_hosts, str(tmp_path), per_rank_env=hosts)


# ---------------------------------------------------------------------------
# Training: optimizer_step on N ranks == one process on the full batch
# ---------------------------------------------------------------------------

STEPS = 5
BATCH = 12


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # Linear(512, 512) has a 1 MiB weight, so a 1 MiB bucket cap splits the
    # gradients into several buckets
    return nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                         nn.Linear(512, 4))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, BATCH, 16, generator=g), torch.randn(STEPS, BATCH, 4, generator=g)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    xs: torch.Tensor,
    ys: torch.Tensor,
    step: Callable[[torch.optim.Optimizer], Any],
) -> list[float]:
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        step(opt)
        losses.append(loss.item())
    return losses


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def assert_same_params(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-5, msg=f"{what}: {name}")


def training_run(rank: int, world: int) -> list[list[int]]:
    torch.set_num_threads(1)
    xs, ys = make_data()
    per = BATCH // world
    mine = slice(rank * per, (rank + 1) * per)

    def reference(make_opt: Callable[[nn.Module], torch.optim.Optimizer],
                  xs_: torch.Tensor = xs, ys_: torch.Tensor = ys) -> nn.Module:
        model = make_model()
        train(model, make_opt(model), xs_, ys_, lambda o: o.step())
        return model

    ref_sgd, ref_adam = reference(sgd), reference(adam)

    # (a) optimizer_step, coalesced (no bucket env)
    os.environ.pop("ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB", None)
    model = make_model()
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(params)}
    calls: list[list[int]] = []
    orig = C.all_reduce

    def logged(reduce_type: str, inputs: Any, *a: Any, **k: Any) -> Any:
        items = inputs if isinstance(inputs, list) else [inputs]
        calls.append([index.get(id(_param_of(t, params)), -1) for t in items])
        return orig(reduce_type, inputs, *a, **k)

    C.all_reduce = logged
    try:
        train(model, sgd(model), xs[:, mine], ys[:, mine], ringlet.optimizer_step)
        assert_same_params(model, ref_sgd, f"optimizer_step world={world}")
        if world == 1:
            # a no-op reduction: nothing is called, the result is plain training
            assert calls == []
            for p, q in zip(model.parameters(), ref_sgd.parameters()):
                assert torch.equal(p, q)
        else:
            # all gradients in one all_reduce call per step, in parameter order
            assert calls == [list(range(len(params)))] * STEPS, calls

        # (b) bucketed path: ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB > 0, last layer first
        os.environ["ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB"] = "1"
        calls.clear()
        model = make_model()
        params[:] = list(model.parameters())
        index.clear()
        index.update({id(p): i for i, p in enumerate(params)})
        train(model, sgd(model), xs[:, mine], ys[:, mine], ringlet.optimizer_step)
        assert_same_params(model, ref_sgd, f"bucketed optimizer_step world={world}")
        if world > 1:
            # params: W1 b1 W2(1 MiB) b2 W3 b3 -> reversed, 1 MiB buckets
            assert calls == [[5, 4, 3], [2], [1, 0]] * STEPS, calls
        else:
            assert calls == []

        # (c) reduce_gradients + optimizer.step(), with Adam, bucketed env still set
        model = make_model()
        train(model, adam(model), xs[:, mine], ys[:, mine],
              lambda o: (ringlet.reduce_gradients(o), o.step()))
        assert_same_params(model, ref_adam, f"reduce_gradients world={world}")
        os.environ.pop("ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB")
        model = make_model()
        train(model, adam(model), xs[:, mine], ys[:, mine],
              lambda o: (ringlet.reduce_gradients(o), o.step()))
        assert_same_params(model, ref_adam, f"reduce_gradients coalesced world={world}")
    finally:
        C.all_reduce = orig
        os.environ.pop("ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB", None)

    # (d) optimizer_args and the return value; barrier=True
    model = make_model()
    opt = sgd(model)
    x, y = xs[0, mine], ys[0, mine]

    def closure() -> torch.Tensor:
        return torch.tensor(42.0 + rank)

    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    ran: list[int] = []
    ringlet.add_step_closure(ran.append, (rank,))
    got = ringlet.optimizer_step(opt, barrier=True, optimizer_args={"closure": closure})
    assert got.item() == 42.0 + rank
    assert ran == [rank]  # barrier=True ends with mark_step(), which runs the closures

    # (e) groups: each half of 4 ranks trains on its own half of the batch.
    # As in torch_xla the group's sum is scaled by 1 / world size (not the
    # group's), i.e. half the half-batch mean: SGD with half the rate.
    if world == 4:
        groups = [[0, 1], [2, 3]]
        half = slice(0, BATCH // 2) if rank < 2 else slice(BATCH // 2, BATCH)

        def half_rate(model: nn.Module) -> torch.optim.Optimizer:
            return torch.optim.SGD(model.parameters(), lr=0.025, momentum=0.9)

        ref = reference(half_rate, xs[:, half], ys[:, half])
        model = make_model()
        train(model, sgd(model), xs[:, mine], ys[:, mine],
              lambda o: ringlet.optimizer_step(o, groups=groups))
        assert_same_params(model, ref, "optimizer_step groups")
    return calls


def _param_of(t: torch.Tensor, params: list[nn.Parameter]) -> Any:
    for p in params:
        if p.grad is not None and p.grad.data_ptr() == t.data_ptr():
            return p
    return None


@pytest.mark.parametrize(("world", "transport"), [(1, "shm"), (2, "tcp"), (4, "shm")])
def test_optimizer_step_matches_full_batch_training(world: int, transport: str) -> None:
    out = launch(world, training_run, transport=transport)
    assert len(out) == world


def eager_helpers(rank: int, world: int) -> None:
    seen: list[int] = []
    ringlet.add_step_closure(seen.append, (1,))
    ringlet.add_step_closure(lambda: seen.append(2))
    assert seen == []
    ringlet.mark_step()
    assert seen == [1, 2]
    ringlet.mark_step()
    assert seen == [1, 2]
    # a closure queued by a closure runs at the next step, as in torch_xla
    # (which swaps the list out before running it)
    steps: list[int] = []

    def again() -> None:
        steps.append(len(steps))
        if len(steps) < 3:
            ringlet.add_step_closure(again)

    ringlet.add_step_closure(again)
    for want in ([0], [0, 1], [0, 1, 2], [0, 1, 2]):
        ringlet.mark_step()
        assert steps == want
    # a raising closure drops the rest of that step's closures
    ringlet.add_step_closure(lambda: 1 / 0)
    ringlet.add_step_closure(steps.append, (-1,))
    with pytest.raises(ZeroDivisionError):
        ringlet.mark_step()
    ringlet.mark_step()
    assert steps == [0, 1, 2]
    assert ringlet.xla_rendezvous(b"r%d" % rank) == [b"r%d" % r for r in range(world)]
    with pytest.raises(ValueError, match="Only global rendezvous"):
        ringlet.xla_rendezvous(b"", ordinals=[0])
    with pytest.raises(TypeError, match="must be bytes"):
        ringlet.xla_rendezvous("text")  # type: ignore[arg-type]
    got = ringlet.do_on_ordinals(lambda a, b: a + b + rank, (1, 2), ordinals=[world - 1])
    assert got == (3 + rank if rank == world - 1 else None)
    assert ringlet.do_on_ordinals(lambda: rank, ordinals=0) == (0 if rank == 0 else None)
    got = ringlet.do_on_ordinals(lambda a, b: a * b, [3, 4], ordinals={0})  # a list unpacks too
    assert got == (12 if rank == 0 else None)
    assert ringlet.do_on_ordinals(len, "abc", ordinals=[0]) == (3 if rank == 0 else None)
    assert ringlet.xrt_world_size() == world
    ringlet.optimization_barrier_([torch.ones(1)])
    assert ringlet.xla_device() == torch.device("cpu")
    assert ringlet.xla_device_hw(ringlet.xla_device()) == "CPU"
    ringlet.set_rng_state(1234)
    assert ringlet.get_rng_state() == 1234
    # every collective shows up as a named range in torch.profiler traces
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ringlet.all_reduce(ringlet.REDUCE_SUM, torch.ones(3))
        ringlet.all_gather(torch.ones(2))
        ringlet.barrier()
    ranges = [e.name for e in prof.events() if e.name.startswith("ringlet::")]
    assert ranges == ["ringlet::all_reduce", "ringlet::all_gather", "ringlet::barrier"]


def gather_via_all_reduce(rank: int, world: int) -> None:
    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
        for shape, dim in (((3,), 0), ((2, 3), 1), ((2, 3), -2), ((0, 4), 0)):
            value = (torch.arange(math.prod(shape)).reshape(shape) + 10 * rank + 1).to(dtype)
            got = ringlet._all_gather_using_all_reduce(value, dim=dim)
            assert torch.equal(got, ringlet.all_gather(value, dim=dim)), (dtype, shape, dim)
    if world == 4:
        got = ringlet._all_gather_using_all_reduce(torch.tensor([rank]), groups=[[0, 2], [1, 3]])
        assert got.tolist() == [rank % 2, rank % 2 + 2]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_all_gather_using_all_reduce(world: int) -> None:
    launch(world, gather_via_all_reduce)


def test_eager_helpers() -> None:
    launch(2, eager_helpers)


def test_device_and_data_helpers() -> None:
    t = torch.ones(2)
    assert not ringlet.is_xla_tensor(t)
    assert ringlet.get_xla_supported_devices() == ["cpu"]
    assert ringlet.get_xla_supported_devices(max_devices=1) == ["cpu"]
    assert ringlet.get_xla_supported_devices("TPU") is None
    assert ringlet.xla_real_devices() == ["CPU:0"]
    assert ringlet.xla_real_devices(["cpu", "cuda:1"]) == ["CPU:0", "CUDA:1"]
    world = ringlet.world_size() if ringlet.is_initialized() else 1
    assert ringlet.xla_replication_devices(["cpu"]) == [f"CPU:{r}" for r in range(world)]
    with pytest.raises(RuntimeError, match="different device types"):
        ringlet.xla_replication_devices(["cpu", "cuda:0"])
    with pytest.raises(RuntimeError, match="number of devices"):
        ringlet.xla_replication_devices(["cpu", "cpu:1"])
    ringlet.set_replication("cpu", ["cpu"])
    ringlet.set_replication("cpu", [])
    with pytest.raises(ValueError):
        ringlet.set_replication("cpu:3", ["cpu"])
    ringlet.unlazy([t])
    with pytest.raises(TypeError):
        ringlet.unlazy(t)  # type: ignore[arg-type]
    info = ringlet.get_memory_info()
    assert set(info) == {"bytes_used", "bytes_limit"}
    assert 0 < info["bytes_used"] <= info["bytes_limit"]
    # fork_rng restores the exact generator state, not just the seed
    torch.manual_seed(3)
    torch.rand(5)
    with ringlet.fork_rng():
        inner = torch.rand(4)
    again = torch.rand(4)
    assert torch.equal(inner, again)
    with ringlet.fork_rng(enabled=False):
        torch.rand(4)
    assert not torch.equal(torch.rand(4), again)
    # nested transforms keep structure; a lone tensor comes back in a list
    Pair = collections.namedtuple("Pair", "a b")
    data = {"x": t, "y": [t, (t, 3)], "z": Pair(t, "s"), "w": "keep"}
    moved = ringlet.send_cpu_data_to_device(data, ringlet.xla_device())
    assert moved["w"] == "keep" and moved["y"][1][1] == 3 and isinstance(moved["z"], Pair)
    assert torch.equal(moved["z"].a, t)
    single = ringlet.send_cpu_data_to_device(t, "cpu")
    assert isinstance(single, list) and torch.equal(single[0], t)
    arena = ringlet.ToXlaTensorArena(
        lambda ts: [x * (i + 2) for i, x in enumerate(ts)],
        lambda v: isinstance(v, torch.Tensor),
    )
    out = arena.transform({"a": torch.ones(1), "b": [torch.ones(1)]})
    assert out["a"].item() == 2 and out["b"][0].item() == 3
    # each tensor converted once (by identity), the same result wherever it appears
    batches: list[int] = []
    counting = ringlet.ToXlaTensorArena(
        lambda ts: (batches.append(len(ts)), [x + 1 for x in ts])[1],
        lambda v: isinstance(v, torch.Tensor),
    )
    one = torch.zeros(1)
    got = counting.transform([one, (one, {"k": one}), torch.zeros(2)])
    assert batches == [2]
    assert got[0] is got[1][0] and got[0] is got[1][1]["k"]
    assert got[0].tolist() == [1.0] and got[2].tolist() == [1.0, 1.0]
    bad = ringlet.ToXlaTensorArena(lambda ts: [], lambda v: isinstance(v, torch.Tensor))
    with pytest.raises(ValueError, match="returned 0 tensors for 1"):
        bad.transform([t])
    # view sharing
    w = torch.ones(4)
    ringlet.check_view_sharing({"w": w, "again": w, "other": torch.ones(4), "e": torch.ones(0)})
    shared = r"is sharing a view with tensor ID \d+ \(torch.float32\[4\]\)"
    with pytest.raises(RuntimeError, match=shared):
        ringlet.check_view_sharing([w, w[:2]])
    # dict keys are looked at too
    with pytest.raises(RuntimeError, match=shared):
        ringlet.check_view_sharing({w: "key", "v": w[1:]})
    # only plain tensors (type(x) is torch.Tensor): parameters, tied or not, are skipped
    p = nn.Parameter(torch.ones(3))
    ringlet.check_view_sharing([p, p.data, {"tied": p}])
    ringlet.check_view_sharing([*nn.Linear(2, 2).parameters(), w])
