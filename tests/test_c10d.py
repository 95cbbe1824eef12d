"""ringlet as a torch.distributed backend, on real processes: every c10d
operation on a ringlet group compared with the same call on a gloo group of
the same ranks in the same run (exact for integers, min/max and bitwise ops;
float tolerance for sums), asynchronous work and futures, subgroups, errors."""

from __future__ import annotations

import os
import pickle
from datetime import timedelta
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist

from conftest import free_port, launch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def _init(rank: int, world: int, port: int, backend: str = "ringlet") -> None:
    import ringlet  # noqa: F401  (registers the backend)

    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )


def _data(rank: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    hi = 4 if dtype in (torch.int8, torch.uint8) else 100
    return torch.randint(1 if dtype == torch.uint8 else -hi, hi, (n,), generator=g).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor, what: str, exact: bool = False) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    )
    if exact or not a.is_floating_point():
        assert torch.equal(a, b), f"{what}: {a} != {b}"
    else:
        tol = 5e-2 if a.dtype in (torch.float16, torch.bfloat16) else 1e-5
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=what)


def _list_forms_as_native_jobs(rank: int, world: int, gloo: dist.ProcessGroup) -> None:
    """The list forms, the coalesced forms, the multi-device forms and AVG
    are queued as one engine call each (the job stages and copies the
    tensors itself: a native job, not a Python one); issued asynchronously
    one after another, dropped or polled, their results equal gloo's (or
    plain torch's for AVG, which gloo lacks), and a size mismatch found by
    the engine names the user's collective, whether the call waits at once
    or not."""
    from ringlet.distributed.process_group import python_group
    from ringlet.distributed.work import _DONE

    pg, R = python_group(), dist.ReduceOp
    last, total = world - 1, world * (world + 1) // 2

    def native(work: Any) -> Any:
        assert work is _DONE or work._job is not None, "queued as a Python job"
        return work

    def x(n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _data(rank, n, dtype, seed=seed)

    def both(run: Callable[[Optional[dist.ProcessGroup]], list[torch.Tensor]], what: str) -> None:
        mine, ref = run(None), run(gloo)
        for i, (a, b) in enumerate(zip(mine, ref)):
            _same(a, b, f"{what} [{i}]", exact=True)

    # issued back to back, asynchronously, one of them dropped: the list
    # forms through the Python group (checked native), against gloo's
    outs = {}

    def lists(group: Optional[dist.ProcessGroup]) -> list[torch.Tensor]:
        g = pg if group is None else group
        check = native if group is None else (lambda w: w)
        ag = [torch.full((3,), -1.0) for _ in range(world)]
        g2 = [torch.empty(4) for _ in range(world)] if rank == last else []
        sc = torch.empty(2, dtype=torch.float64)
        a2a = [torch.empty(3) for _ in range(world)]
        rs = torch.empty(3)
        works = [
            check(g.allgather([ag], [x(3, 1)])),
            check(g.gather([g2] if rank == last else [], [x(4, 2)], _gather_opts(last))),
            check(g.scatter([sc], [[torch.full((2,), float(r), dtype=torch.float64)
                                    for r in range(world)]] if rank == 0 else [],
                            _scatter_opts(0))),
            check(g.alltoall(a2a, [torch.full((3,), float(10 * rank + j))
                                   for j in range(world)])),
            check(g.reduce_scatter([rs], [[x(3, 10 + j) for j in range(world)]],
                                   _rs_opts(R.MAX))),
        ]
        dropped = [torch.empty(5) for _ in range(world)]
        check(g.allgather([dropped], [x(5, 3)]))  # never waited for
        for w in works[::-1]:
            w.wait()
        g.barrier().wait()
        outs[group] = dropped
        return [*ag, *g2, sc, *a2a, rs]

    both(lists, "list form")
    for a, b in zip(outs[None], outs[gloo]):
        _same(a, b, "dropped all_gather", exact=True)
    # ragged forms (gloo refuses them): rank r's block holds r + 1 elements
    ag_ragged = [torch.empty(r + 1, dtype=torch.int64) for r in range(world)]
    rs_ragged = torch.empty(rank + 1, dtype=torch.int32)
    w1 = native(pg.allgather([ag_ragged], [torch.arange(rank + 1) * (rank + 1)]))
    w2 = native(pg.reduce_scatter([rs_ragged], [[torch.full((j + 1,), rank + j, dtype=torch.int32)
                                                 for j in range(world)]], _rs_opts(R.SUM)))
    w2.wait()
    w1.wait()
    for r in range(world):
        _same(ag_ragged[r], torch.arange(r + 1) * (r + 1), "ragged all_gather", exact=True)
    _same(rs_ragged, torch.full((rank + 1,), total - world + world * rank, dtype=torch.int32),
          "ragged reduce_scatter", exact=True)

    # coalesced and multi-device forms: one engine call each
    ins = [x(3, 20), x(5, 21)]
    lists_out = [[torch.empty(3), torch.empty(5)] for _ in range(world)]
    native(pg.allgather_coalesced(lists_out, ins)).wait()
    for r in range(world):
        _same(lists_out[r][0], _data(r, 3, torch.float32, seed=20), "allgather_coalesced", True)
        _same(lists_out[r][1], _data(r, 5, torch.float32, seed=21), "allgather_coalesced", True)
    flat_outs = [torch.empty(3 * world), torch.empty(5 * world)]
    native(pg.allgather_into_tensor_coalesced(flat_outs, ins)).wait()
    _same(flat_outs[0], torch.cat([_data(r, 3, torch.float32, seed=20) for r in range(world)]),
          "allgather_into_tensor_coalesced", exact=True)
    # FSDP2's in-place form: the input is this rank's slot of the output
    slots = torch.zeros(2 * world)
    slots[2 * rank:2 * rank + 2] = float(rank + 1)
    native(pg._allgather_base(slots, slots[2 * rank:2 * rank + 2]))
    dist.all_gather_into_tensor(slots, slots[2 * rank:2 * rank + 2])
    _same(slots, torch.arange(1.0, world + 1).repeat_interleave(2), "in-place all_gather", True)
    rs_outs = [torch.empty(2), torch.empty(1, dtype=torch.float32)]
    rs_ins = [torch.arange(2.0 * world) * (rank + 1), torch.arange(1.0 * world) + rank]
    native(pg.reduce_scatter_tensor_coalesced(rs_outs, rs_ins, _rs_opts(R.SUM))).wait()
    _same(rs_outs[0], torch.arange(2.0 * rank, 2.0 * rank + 2) * total, "rs coalesced", True)
    _same(rs_outs[1], torch.tensor([float(world * rank + total - world)]), "rs coalesced", True)
    co = [x(4, 30), x(2, 31)]
    native(pg.allreduce_coalesced(co, _ar_opts(R.MAX))).wait()
    for t, seed, n in zip(co, (30, 31), (4, 2)):
        want = torch.stack([_data(r, n, torch.float32, seed=seed) for r in range(world)]).amax(0)
        _same(t, want, "allreduce_coalesced", exact=True)
    devices = [torch.full((3,), float(rank)), torch.full((3,), float(rank + 10))]
    native(pg.broadcast(devices, _bcast_opts(last, 1))).wait()
    for t in devices:
        _same(t, torch.full((3,), float(last + 10)), "multi-device broadcast", exact=True)

    # AVG (gloo has none): plain torch's sum then true (or truncating) division
    n = 6 * world
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.int8):
        every = [_data(r, n, dtype, seed=40) for r in range(world)]
        wide = torch.stack([e.double() if dtype.is_floating_point else e for e in every]).sum(0)
        want = (wide.to(dtype).div(world) if dtype.is_floating_point
                else torch.div(wide, world, rounding_mode="trunc").to(dtype))
        exact = not dtype.is_floating_point or world == 2  # a sum of two rounds once
        a = every[rank].clone()
        native(pg.allreduce([a], _ar_opts(R.AVG))).wait()
        _same(a, want, f"AVG all_reduce {dtype}", exact=exact)
        red = every[rank].clone()
        native(pg.reduce([red], _reduce_opts(last, R.AVG))).wait()
        _same(red, want if rank == last else every[rank], f"AVG reduce {dtype}", exact=exact)
        out = torch.empty(6, dtype=dtype)
        native(pg._reduce_scatter_base(out, every[rank], _rs_opts(R.AVG))).wait()
        _same(out, want[6 * rank:6 * rank + 6], f"AVG reduce_scatter {dtype}", exact=exact)
    with pytest.raises(RuntimeError, match="AVG on a bool"):
        dist.all_reduce(torch.ones(2, dtype=torch.bool), op=R.AVG)

    # a size mismatch found by the engine names gather, whether the call
    # waits at once or its work is waited for; the group stays usable
    for at_once in (True, False):
        sent = torch.ones(2 + (rank == 0))
        got = [torch.empty(2) for _ in range(world)] if rank == last else None
        with pytest.raises(RuntimeError, match="gather: the ranks' tensor sizes do not fit"):
            work = dist.gather(sent, got, dst=last, async_op=not at_once)
            if not at_once:
                work.wait()
    ok = torch.ones(1)
    dist.all_reduce(ok)
    _same(ok, torch.full((1,), float(world)), "usable after a gather mismatch", exact=True)


def _options(cls: Any, **fields: Any) -> Any:
    """A torch options object (``dist.AllreduceOptions`` ...) with ``fields`` set."""
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


def _ar_opts(op: Any) -> dist.AllreduceOptions:
    return _options(dist.AllreduceOptions, reduceOp=op)


def _rs_opts(op: Any) -> dist.ReduceScatterOptions:
    return _options(dist.ReduceScatterOptions, reduceOp=op)


def _reduce_opts(root: int, op: Any) -> dist.ReduceOptions:
    return _options(dist.ReduceOptions, rootRank=root, reduceOp=op)


def _bcast_opts(root: int, tensor: int) -> dist.BroadcastOptions:
    return _options(dist.BroadcastOptions, rootRank=root, rootTensor=tensor)


def _gather_opts(root: int) -> dist.GatherOptions:
    return _options(dist.GatherOptions, rootRank=root)


def _scatter_opts(root: int) -> dist.ScatterOptions:
    return _options(dist.ScatterOptions, rootRank=root)


def _ops_job(rank: int, world: int, port: int) -> str:
    _init(rank, world, port)
    assert dist.get_backend() == "ringlet"
    gloo = dist.new_group(backend="gloo")
    R = dist.ReduceOp

    # all_reduce: every op on every dtype, odd sizes and 0; against plain torch
    # and against gloo where gloo supports the dtype.
    fold = {R.SUM: lambda a, b: a + b, R.PRODUCT: lambda a, b: a * b,
            R.MIN: torch.minimum, R.MAX: torch.maximum, R.BAND: lambda a, b: a & b,
            R.BOR: lambda a, b: a | b, R.BXOR: lambda a, b: a ^ b}
    for dtype in DTYPES:
        ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
        if not dtype.is_floating_point:
            ops += [R.BAND, R.BOR, R.BXOR]
        for op in ops:
            if dtype == torch.bool and op in (R.SUM, R.PRODUCT):
                continue  # torch's bool + and * are not reductions
            for n in (0, 1, 37, 5000):
                every = [_data(r, n, dtype, seed=n) for r in range(world)]
                wide = [x.double() if dtype.is_floating_point else x for x in every]
                want = wide[0]
                for x in wide[1:]:
                    want = fold[op](want, x)
                a = every[rank].clone()
                dist.all_reduce(a, op=op)
                exact = op not in (R.SUM, R.PRODUCT) or not dtype.is_floating_point
                _same(a, want.to(dtype), f"all_reduce {op} {dtype} n={n}", exact=exact)
                b = every[rank].clone()
                try:
                    dist.all_reduce(b, op=op, group=gloo)
                except RuntimeError as e:  # gloo lacks some dtypes
                    assert "Invalid scalar type" in str(e) or "not supported" in str(e), e
                    continue
                _same(a, b, f"all_reduce {op} {dtype} n={n} vs gloo", exact=exact)

    # AVG and PREMUL_SUM (gloo has neither): against plain torch.
    every = [_data(r, 33, torch.float32, seed=5) for r in range(world)]
    a = every[rank].clone()
    dist.all_reduce(a, op=R.AVG)
    _same(a, sum(every) / world, "all_reduce AVG")
    a = every[rank].clone()
    dist.all_reduce(a, op=dist._make_nccl_premul_sum(0.5))
    _same(a, sum(every) * 0.5, "all_reduce PREMUL_SUM")
    # complex sums as real views
    c = torch.complex(every[rank], every[rank] * 2)
    dist.all_reduce(c)
    _same(torch.view_as_real(c), torch.view_as_real(torch.complex(sum(every), sum(every) * 2)),
          "complex sum")
    with pytest.raises(ValueError):
        dist.all_reduce(torch.complex(a, a), op=R.MAX)
    # non-contiguous input
    m = _data(rank, 24, torch.float32, seed=9).view(4, 6)
    a, b = m.t(), m.clone().t()
    dist.all_reduce(a)
    dist.all_reduce(b.contiguous(), group=gloo)
    ref = b.contiguous().clone()
    dist.all_reduce(ref, group=gloo)
    # coalesced
    ts = [_data(rank, n, torch.float32, seed=n) for n in (3, 0, 17)]
    ref = [t.clone() for t in ts]
    dist.all_reduce_coalesced(ts)
    dist.all_reduce_coalesced(ref, group=gloo)
    for x, y in zip(ts, ref):
        _same(x, y, "all_reduce_coalesced")
    with dist._coalescing_manager(async_ops=True) as cm:
        ts2 = [_data(rank, 9, torch.float32, seed=3), _data(rank, 4, torch.float32, seed=4)]
        for t in ts2:
            dist.all_reduce(t)
    cm.wait()
    for i, t in enumerate(ts2):
        want = sum(_data(r, t.numel(), torch.float32, seed=3 + i) for r in range(world))
        _same(t, want, "coalescing manager")

    # all_gather (list, ragged list), all_gather_into_tensor, all_gather_object
    for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
        x = _data(rank, 7, dtype, seed=2)
        outs = [torch.empty_like(x) for _ in range(world)]
        refs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(outs, x)
        dist.all_gather(refs, x, group=gloo)
        for o, r in zip(outs, refs):
            _same(o, r, f"all_gather {dtype}", exact=True)
        out = torch.empty(world * 7, dtype=dtype)
        dist.all_gather_into_tensor(out, x)
        _same(out, torch.cat(refs), f"all_gather_into_tensor {dtype}", exact=True)
    ragged = [torch.empty(r + 1) for r in range(world)]
    dist.all_gather(ragged, torch.full((rank + 1,), float(rank)))
    for r, o in enumerate(ragged):
        _same(o, torch.full((r + 1,), float(r)), "ragged all_gather", exact=True)
    objs: list = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    assert objs == [{"rank": r, "s": "x" * r} for r in range(world)]

    # reduce_scatter, reduce_scatter_tensor
    for op in (R.SUM, R.MAX, R.AVG):
        x = _data(rank, 6 * world, torch.float32, seed=7)
        out = torch.empty(6)
        dist.reduce_scatter_tensor(out, x, op=op)
        every = [_data(r, 6 * world, torch.float32, seed=7) for r in range(world)]
        full = {R.SUM: sum(every), R.MAX: torch.stack(every).amax(0),
                R.AVG: sum(every) / world}[op]
        _same(out, full[6 * rank:6 * rank + 6], f"reduce_scatter_tensor {op}")
        out2 = torch.empty(6)
        dist.reduce_scatter(out2, list(x.chunk(world)), op=op)
        _same(out2, out, f"reduce_scatter {op}")
    x = _data(rank, 5 * world, torch.int32, seed=8)
    out, ref = torch.empty(5, dtype=torch.int32), torch.empty(5, dtype=torch.int32)
    dist.reduce_scatter_tensor(out, x)
    dist.reduce_scatter_tensor(ref, x, group=gloo)
    _same(out, ref, "reduce_scatter_tensor int32 vs gloo", exact=True)

    # broadcast, broadcast_object_list, reduce, gather, scatter
    for root in range(world):
        for dtype in (torch.float32, torch.int8, torch.bool):
            x = _data(rank, 11, dtype, seed=root)
            a, b = x.clone(), x.clone()
            dist.broadcast(a, src=root)
            dist.broadcast(b, src=root, group=gloo)
            _same(a, b, f"broadcast root={root} {dtype}", exact=True)
        objs = [f"from {rank}", {"k": rank}]
        dist.broadcast_object_list(objs, src=root)
        assert objs == [f"from {root}", {"k": root}]
        x = _data(rank, 13, torch.int64, seed=root)
        a, b = x.clone(), x.clone()
        dist.reduce(a, dst=root, op=R.SUM)
        dist.reduce(b, dst=root, op=R.SUM, group=gloo)
        if rank == root:
            _same(a, b, "reduce", exact=True)
        else:
            _same(a, x, "reduce leaves non-roots' input alone", exact=True)
        g_out = [torch.empty(4) for _ in range(world)] if rank == root else None
        dist.gather(torch.full((4,), float(rank)), g_out, dst=root)
        if rank == root:
            for r, o in enumerate(g_out):
                _same(o, torch.full((4,), float(r)), "gather", exact=True)
        s_out = torch.empty(3, dtype=torch.int64)
        s_in = [torch.arange(3) + 10 * r for r in range(world)] if rank == root else None
        dist.scatter(s_out, s_in, src=root)
        _same(s_out, torch.arange(3) + 10 * rank, "scatter", exact=True)
        go = [None] * world if rank == root else None
        dist.gather_object({"r": rank}, go, dst=root)
        if rank == root:
            assert go == [{"r": r} for r in range(world)]

    # all_to_all_single (equal and uneven), all_to_all (lists)
    x = torch.arange(4 * world, dtype=torch.float32) + 100 * rank
    a, b = torch.empty_like(x), torch.empty_like(x)
    dist.all_to_all_single(a, x)
    dist.all_to_all_single(b, x, group=gloo)
    _same(a, b, "all_to_all_single", exact=True)
    in_splits = [(rank + j) % 3 + 1 for j in range(world)]
    out_splits = [(j + rank) % 3 + 1 for j in range(world)]
    x = torch.arange(sum(in_splits) * 2, dtype=torch.int32).view(-1, 2) + 1000 * rank
    a = torch.empty(sum(out_splits), 2, dtype=torch.int32)
    b = torch.empty_like(a)
    dist.all_to_all_single(a, x, out_splits, in_splits)
    dist.all_to_all_single(b, x, out_splits, in_splits, group=gloo)
    _same(a, b, "uneven all_to_all_single", exact=True)
    ins = [torch.full((j + 1,), float(rank * 10 + j)) for j in range(world)]
    outs = [torch.empty(rank + 1) for _ in range(world)]
    dist.all_to_all(outs, ins)
    for j, o in enumerate(outs):
        _same(o, torch.full((rank + 1,), float(j * 10 + rank)), "all_to_all", exact=True)

    # point to point: send/recv both ways at once, isend/irecv ring, batch_isend_irecv
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    mine = torch.full((5,), float(rank))
    got = torch.empty(5)
    s = dist.isend(mine, nxt)
    r = dist.irecv(got, prv)
    s.wait()
    r.wait()
    _same(got, torch.full((5,), float(prv)), "isend/irecv ring", exact=True)
    for peer in range(world):
        if peer == rank:
            continue
        dist.send(torch.full((3,), float(rank)), peer, tag=4)  # both send first: no deadlock
        buf = torch.empty(3)
        dist.recv(buf, peer, tag=4)
        _same(buf, torch.full((3,), float(peer)), "send/recv both ways", exact=True)
    big = torch.arange(600_000, dtype=torch.float32) + rank  # past the eager size
    bigr = torch.empty_like(big)
    ops = [dist.P2POp(dist.isend, big, nxt), dist.P2POp(dist.irecv, bigr, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    _same(bigr, torch.arange(600_000, dtype=torch.float32) + prv, "batch_isend_irecv", exact=True)

    # async work and futures
    t = torch.ones(8) * (rank + 1)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)
    seen = []
    fut.add_done_callback(lambda f: seen.append(f.value()[0].sum().item()))
    assert work.wait() is True
    total = world * (world + 1) / 2
    _same(t, torch.full((8,), total), "async all_reduce", exact=True)
    _same(chained.wait(), torch.full((8,), 2 * total), "future.then", exact=True)
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert fut.done() and seen == [8 * total]
    works = [dist.all_reduce(torch.full((3,), float(i)), async_op=True) for i in range(50)]
    for i, w in enumerate(works):
        w.wait()
        _same(w.result()[0], torch.full((3,), float(i * world)), "issue order", exact=True)
    # queued as the engine call itself (a native job): the work dropped at
    # once (its tensor lives on in the job), then a broadcast's future and a
    # work polled with is_completed(), a later operation behind them all
    kept = [torch.full((50_000,), float(rank + i)) for i in range(4)]
    for x in kept:
        dist.all_reduce(x, async_op=True)
    dist.all_reduce(torch.ones(1 << 18), async_op=True)  # nothing but the job holds it
    b = torch.arange(4.0) * (rank + 1)
    bfut = dist.broadcast(b, src=world - 1, async_op=True).get_future()
    polled = dist.all_reduce(torch.full((2,), float(rank)), op=dist.ReduceOp.MAX, async_op=True)
    gathered = torch.zeros(3 * world)
    gfut = dist.all_gather_into_tensor(gathered, torch.full((3,), float(rank)),
                                       async_op=True).get_future()
    shard = torch.zeros(2)
    swork = dist.reduce_scatter_tensor(shard, torch.arange(2.0 * world) * (rank + 1),
                                       async_op=True)
    # all_to_all_single with uneven splits: rank r sends r + 1 + j elements to rank j
    sends = [rank + 1 + j for j in range(world)]
    recvs = [r + 1 + rank for r in range(world)]
    a2a_in = torch.cat([torch.full((n,), float(10 * rank + j)) for j, n in enumerate(sends)])
    a2a_out = torch.zeros(sum(recvs))
    awork = dist.all_to_all_single(a2a_out, a2a_in, recvs, sends, async_op=True)
    bwork = dist.barrier(async_op=True)
    red = torch.full((3,), float(rank + 1))
    rwork = dist.reduce(red, dst=world - 1, op=dist.ReduceOp.MAX, async_op=True)
    sync = torch.ones(2)
    dist.all_reduce(sync)
    assert awork.is_completed() and bwork.is_completed() and bwork.is_success()
    assert rwork.is_completed() and rwork.result() == [red]
    _same(red, torch.full((3,), float(world if rank == world - 1 else rank + 1)),
          "native reduce (the root's result, the others' tensors as they were)", exact=True)
    _same(a2a_out, torch.cat([torch.full((n,), float(10 * r + rank)) for r, n in enumerate(recvs)]),
          "native all_to_all_single", exact=True)
    assert swork.is_completed() and swork.result() == [shard]
    _same(shard, torch.arange(2.0 * rank, 2.0 * rank + 2) * total, "native reduce_scatter",
          exact=True)
    assert [c.tolist() for c in gfut.wait()] == [[float(r)] * 3 for r in range(world)]
    _same(gathered, torch.arange(world, dtype=torch.float32).repeat_interleave(3),
          "native all_gather_into_tensor", exact=True)
    assert polled.is_completed() and polled.is_success() and polled.exception() is None
    _same(polled.result()[0], torch.full((2,), float(world - 1)), "native job polled", exact=True)
    for i, x in enumerate(kept):
        _same(x, torch.full((50_000,), float(total - world + i * world)), "native job dropped",
              exact=True)
    _same(bfut.wait()[0], torch.arange(4.0) * world, "native broadcast future", exact=True)
    _same(sync, torch.full((2,), float(world)), "after native jobs", exact=True)
    _list_forms_as_native_jobs(rank, world, gloo)

    dist.barrier()
    dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)

    # ProcessGroup methods called directly, in each of torch's call forms
    # (lone tensors, a reduce op or a root rank instead of an options object),
    # on the ringlet group and on the gloo group: the same results.
    mine_pg, gloo_pg = dist.group.WORLD, gloo
    peer = (rank + 1) % world
    last = world - 1

    def direct(pg: dist.ProcessGroup) -> list[torch.Tensor]:
        x = _data(rank, 5, torch.float32, seed=7)
        got = []
        a = x.clone()
        pg.allreduce(a).wait()
        b = x.clone()
        pg.allreduce([b], dist.ReduceOp.MAX).wait()
        c = x.clone()
        pg.broadcast(c, last).wait()
        d = x.clone()
        pg.reduce(d, last, dist.ReduceOp.MIN).wait()
        gathered = [torch.empty(5) for _ in range(world)]
        pg.allgather(gathered, x).wait()
        e = torch.empty(5)
        pg.reduce_scatter(e, [x * (j + 1) for j in range(world)], dist.ReduceOp.MAX).wait()
        g = [torch.empty(5) for _ in range(world)] if rank == last else []
        pg.gather(g, x, last).wait()
        f = torch.empty(5)
        pg.scatter(f, [x + j for j in range(world)] if rank == last else [], last).wait()
        h = x.clone()
        pg.reduce([h]).wait()  # no options: root 0, SUM
        got += [a, b, c, gathered[peer], e, f, h if rank == 0 else x]
        if rank == last:
            got += [d, g[peer]]
        return got

    for i, (m, w) in enumerate(zip(direct(mine_pg), direct(gloo_pg))):
        _same(m, w, f"direct ProcessGroup call {i}")

    # subgroups: new_group, new_subgroups, split_group-like layouts
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    if rank % 2 == 0:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=evens)
        _same(t, torch.tensor([float(sum(range(0, world, 2)))]), "new_group", exact=True)
    sub, _ = dist.new_subgroups(group_size=2)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=sub)
    base = rank - rank % 2
    _same(t, torch.tensor([float(base + base + 1)]), "new_subgroups", exact=True)

    # mismatched sizes: an error on every rank, not corruption or a hang
    bad = torch.ones(4 + rank)
    with pytest.raises(RuntimeError) as e:
        dist.all_reduce(bad)
    assert "rank" in str(e.value)
    assert isinstance(e.value, dist.DistBackendError)
    t = torch.ones(3)
    dist.all_reduce(t)  # still usable afterwards
    _same(t, torch.full((3,), float(world)), "usable after mismatch", exact=True)
    # argument errors: ValueError / TypeError, and RuntimeError as gloo raises them
    with pytest.raises(ValueError, match="output tensors") as e:
        dist.all_gather([torch.empty(2)] * (world + 1), torch.ones(2))
    assert isinstance(e.value, RuntimeError)
    with pytest.raises(TypeError, match="dtype") as e:
        dist.all_reduce(torch.zeros(2, dtype=torch.uint32))
    assert isinstance(e.value, RuntimeError)
    _any_source(rank, world, gloo)
    _tags_out_of_order(rank, world, gloo)
    _tensor_kinds_and_results(rank, world, gloo)
    # DDP's logging data names the group's backend, as gloo's does (torch's
    # ProcessGroup says "custom" for any registered backend)
    for group, name in ((None, "ringlet"), (gloo, "gloo")):
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2),
                                                        process_group=group)
        assert ddp._get_ddp_logging_data()["backend_name"] == name
    dist.destroy_process_group()
    return "ok"


def _tensor_kinds_and_results(rank: int, world: int, gloo: dist.ProcessGroup) -> None:
    # Sparse COO all_reduce (summed into each tensor), an expanded tensor
    # (its aliased elements), meta tensors (nothing happens, as torch's meta
    # kernels), the values of async work, all_gather_coalesced's layout:
    # each against gloo in the same run.
    for group in (None, gloo):
        sp = torch.sparse_coo_tensor([[0, 2 + rank % 2]], [1.0 * rank, 2.0], (4,))
        empty = torch.sparse_coo_tensor(torch.zeros(1, 0, dtype=torch.long), [], (4,))
        mats = torch.sparse_coo_tensor([[rank % 3], [1]], [[1.0 + rank, -1.0]], (3, 2, 2))
        for t in (sp, empty, mats):
            dense = t.to_dense()
            sums = [torch.zeros_like(dense) for _ in range(world)]
            dist.all_gather(sums, dense, group=group)
            dist.all_reduce(t, group=group)
            assert t.is_sparse
            _same(t.to_dense(), sum(sums), f"sparse all_reduce ({group})")
        ex = torch.tensor([float(rank + 1)]).expand(3)
        dist.all_reduce(ex, group=group)
        assert ex.tolist() == [world * (world + 1) / 2] * 3, ex
        m = torch.empty(4, device="meta")
        assert dist.all_reduce(m, group=group) is None
        assert dist.broadcast(m, 0, group=group) is None
        assert dist.all_gather([torch.empty(4, device="meta")] * world, m, group=group) is None
        outs = [torch.empty(1) for _ in range(world)]
        work = dist.all_gather(outs, torch.tensor([float(rank)]), group=group, async_op=True)
        got = work.get_future().wait()
        assert [v.item() for v in got] == list(range(world)) and got[0] is not None
        out = torch.empty(2 * world)
        work = dist.all_gather_into_tensor(out, torch.tensor([float(rank), 9.0]), group=group,
                                           async_op=True)
        got = work.get_future().wait()
        assert [v.tolist() for v in got] == [[float(r), 9.0] for r in range(world)], got
        lists = [[torch.empty(2), torch.empty(1)] for _ in range(world)]
        dist.all_gather_coalesced(lists, [torch.full((2,), float(rank)),
                                          torch.tensor([10.0 + rank])], group=group)
        assert [[v.tolist() for v in lst] for lst in lists] == [
            [[float(r)] * 2, [10.0 + r]] for r in range(world)]
    # a receive buffer larger than the message: the front is filled (gloo, MPI)
    for group in (None, gloo):
        if rank == 0:
            dist.send(torch.tensor([1.0, 2.0, 3.0]), 1, group=group)
        elif rank == 1:
            buf = torch.zeros(5)
            dist.recv(buf, 0, group=group)
            assert buf.tolist() == [1.0, 2.0, 3.0, 0.0, 0.0], buf
    if rank == 0:  # also for a message received aside (another tag's receive came first)
        dist.send(torch.tensor([4.0, 5.0, 6.0]), 1, tag=5)
        dist.send(torch.tensor([7.0]), 1, tag=6)
    elif rank == 1:
        short, first = torch.zeros(2), torch.zeros(4)
        dist.recv(short, 0, tag=6)
        dist.recv(first, 0, tag=5)
        assert short.tolist() == [7.0, 0.0] and first.tolist() == [4.0, 5.0, 6.0, 0.0]
    # a future's callback that issues and waits for more collectives (as DDP's
    # PowerSGD hook does), asynchronously and synchronously
    for group in (None, gloo):
        fut = dist.all_reduce(torch.ones(2), async_op=True, group=group).get_future()

        def callback(f: torch.futures.Future, group: object = group) -> float:
            inner = torch.full((1,), float(rank))
            dist.all_reduce(inner, async_op=True, group=group).get_future().wait()
            sync = torch.ones(1)
            dist.all_reduce(sync, group=group)
            return inner.item() + sync.item()

        assert fut.then(callback).wait() == world * (world - 1) / 2 + world
    # errors pickle, as their type (DCP gathers errors with all_gather_object)
    with pytest.raises(RuntimeError) as caught:
        dist.all_to_all_single(torch.empty(2 * world), torch.ones(2 * world), [1] * world,
                               [3] * world)
    back = pickle.loads(pickle.dumps(caught.value))
    assert type(back).__name__ == type(caught.value).__name__ and str(back) == str(caught.value)
    # a size mismatch inside all_gather names all_gather (gloo aborts the process)
    with pytest.raises(RuntimeError, match="all_gather: the ranks' tensor sizes"):
        dist.all_gather([torch.empty(2) for _ in range(world)], torch.ones(2 + rank % 2))
    with pytest.raises(RuntimeError, match="all_reduce of a sparse tensor supports"):
        dist.all_reduce(torch.sparse_coo_tensor([[0]], [1.0], (2,)), op=dist.ReduceOp.MAX)


def _any_source(rank: int, world: int, gloo: dist.ProcessGroup) -> None:
    """dist.recv / irecv without a source, on the ringlet group and on gloo's:
    rank 0 takes one message from every other rank in whatever order they
    come, then (after a barrier, so each sender has exactly one message in
    flight) a large one from each through irecv; plus a tagged message."""
    for group in (None, gloo):
        if rank == 0:
            seen = []
            for _ in range(world - 1):
                t = torch.zeros(3)
                src = dist.recv(t, group=group)
                assert t.tolist() == [float(src)] * 3, (src, t)
                seen.append(src)
            assert sorted(seen) == list(range(1, world)), seen
            dist.barrier(group=group)
            seen = []
            for _ in range(world - 1):
                t = torch.zeros(300_000)  # 1.2 MB: past the eager-send size
                w = dist.irecv(t, group=group)
                w.wait()
                src = w._source_rank()
                assert float(t[0]) == float(t[-1]) == src + 0.5, (src, t[0], t[-1])
                seen.append(src)
            assert sorted(seen) == list(range(1, world)), seen
            dist.barrier(group=group)
            # a receive for tag 7 passes over rank 1's waiting tag-0 message
            # and over the tag-9 message rank world-1 sent before its tag 7
            t = torch.zeros(2, dtype=torch.int64)
            assert dist.recv(t, group=group, tag=7) == world - 1
            assert t.tolist() == [7, world - 1]
            assert dist.recv(t, group=group, tag=9) == world - 1
            assert t.tolist() == [9, world - 1]
            if world > 2:
                assert dist.recv(t, group=group) == 1
                assert t.tolist() == [0, 1]
        else:
            dist.send(torch.full((3,), float(rank)), 0, group=group)
            dist.barrier(group=group)
            dist.send(torch.full((300_000,), rank + 0.5), 0, group=group)
            dist.barrier(group=group)
            if rank == 1 and world > 2:
                dist.send(torch.tensor([0, 1]), 0, group=group)
            if rank == world - 1:
                w = dist.isend(torch.tensor([9, rank]), 0, group=group, tag=9)
                dist.send(torch.tensor([7, rank]), 0, group=group, tag=7)
                w.wait()


def _tags_out_of_order(rank: int, world: int, gloo: dist.ProcessGroup) -> None:
    """Rank 0 isends tags 1, 2, 3, a 2 MB message with tag 4 (past the eager
    size) and tag 5 to rank 1, which receives 3, 1, 2, 5, 4: later messages
    with the tag asked for overtake, on ringlet as on gloo."""
    for group in (None, gloo):
        if rank == 0:
            sizes = {1: 4, 2: 4, 3: 4, 4: 500_000, 5: 2}
            works = [dist.isend(torch.full((n,), float(tag)), 1, group=group, tag=tag)
                     for tag, n in sizes.items()]
            for w in works:
                w.wait()
        elif rank == 1:
            for tag, n in ((3, 4), (1, 4), (2, 4), (5, 2), (4, 500_000)):
                t = torch.zeros(n)
                dist.recv(t, 0, group=group, tag=tag)
                assert float(t.min()) == float(t.max()) == float(tag), (tag, t)
        dist.barrier(group=group)


def _any_source_job(rank: int, world: int, port: int) -> str:
    _init(rank, world, port)
    gloo = dist.new_group(backend="gloo")
    _any_source(rank, world, gloo)
    _tags_out_of_order(rank, world, gloo)
    _tensor_kinds_and_results(rank, world, gloo)
    dist.destroy_process_group()
    return "ok"


def test_receive_from_any_source_over_tcp() -> None:
    """Receives from any source and tag matching over TCP, 3 ranks; also the
    tensor kinds, future values and receive sizes of _ops_job over TCP."""
    out = launch(3, _any_source_job, free_port(), init=False, timeout=120, transport="tcp")
    assert out == {r: "ok" for r in range(3)}


@pytest.mark.parametrize("world", [2, 4])
def test_every_c10d_operation_matches_gloo(world: int) -> None:
    out = launch(world, _ops_job, free_port(), init=False, timeout=300)
    assert out == {r: "ok" for r in range(world)}


def _lifecycle_job(rank: int, world: int, ports: list[int], path: str) -> list:
    import ringlet

    port = ports[0]
    seen = []
    # init_process_group("ringlet") and ringlet.init() side by side.
    ringlet.init(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=ports[1])
    _init(rank, world, port)
    t = torch.ones(2)
    dist.all_reduce(t)
    seen.append(t.tolist())
    seen.append(ringlet.all_reduce("sum", torch.ones(2)).tolist())
    dist.destroy_process_group()
    # init again after destroy, with a mixed backend string, on a new port: on
    # the old one a rank done destroying may reach the peer's old store, still
    # up until that peer destroys its group too, and wait on the new one forever
    dist.init_process_group(
        "cpu:ringlet", init_method=f"tcp://127.0.0.1:{ports[3]}", rank=rank, world_size=world
    )
    t = torch.ones(2) * 3
    dist.all_reduce(t)
    seen.append(t.tolist())
    dist.destroy_process_group()
    # file:// and an explicit store= hand the backend other kinds of store.
    dist.init_process_group("ringlet", init_method=f"file://{path}", rank=rank,
                            world_size=world)
    t = torch.ones(2) * 5
    dist.all_reduce(t)
    seen.append(t.tolist())
    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", ports[2], world, rank == 0, timedelta(seconds=30))
    dist.init_process_group("ringlet", store=store, rank=rank, world_size=world)
    t = torch.ones(2) * 7
    dist.all_reduce(t)
    seen.append(t.tolist())
    dist.destroy_process_group()
    ringlet.shutdown()
    shm = [f for f in os.listdir("/dev/shm") if "ringlet" in f]
    seen.append(shm)
    return seen


def test_init_destroy_init_beside_ringlet_init(tmp_path) -> None:
    ports = [free_port() for _ in range(4)]  # each its own: a neighbour port may be taken
    out = launch(2, _lifecycle_job, ports, str(tmp_path / "store"), init=False, timeout=120)
    for r in range(2):
        assert out[r] == [[2.0, 2.0], [2.0, 2.0], [6.0, 6.0], [10.0, 10.0], [14.0, 14.0], []]


def _dead_peer_job(rank: int, world: int, port: int) -> str:
    _init(rank, world, port)
    if rank == 0:  # receives from any source connect every sender's direction
        assert sorted(dist.recv(torch.zeros(1)) for _ in range(world - 1)) == [1, 2]
    else:
        dist.send(torch.ones(1), 0)
    t = torch.ones(1 << 16)
    dist.all_reduce(t)
    # a dtype mismatch raises on every rank and leaves the group usable
    with pytest.raises(RuntimeError, match="rank"):
        dist.all_reduce(torch.ones(8, dtype=torch.float64 if rank else torch.float32))
    dist.all_reduce(t)
    if rank == world - 1:
        os._exit(0)  # dies between collectives
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    with pytest.raises(RuntimeError) as e:
        work.wait()
    assert isinstance(e.value, dist.DistBackendError), type(e.value)
    assert work.is_completed() and not work.is_success()
    assert work.exception() is e.value
    with pytest.raises(RuntimeError):
        fut.wait()
    with pytest.raises(RuntimeError):  # the group stays failed, with an error, not a hang
        dist.all_reduce(t)
    if rank == 0:  # a receive from any source names the dead sender instead of waiting
        with pytest.raises(RuntimeError, match=f"rank {world - 1}"):
            dist.recv(torch.zeros(1))
    return str(e.value)


def test_dead_peer_fails_the_work_naming_it() -> None:
    out = launch(3, _dead_peer_job, free_port(), init=False, timeout=120, expect_dead=(2,))
    for r in (0, 1):
        assert "rank 2" in out[r], out[r]


def _absent_rank_job(rank: int, world: int, ports: list, gate: Any) -> dict:
    """Rank 2 never calls init_process_group (it stays alive, at the gate):
    ranks 0 and 1 call it with a 2 s timeout, on ringlet then on gloo."""
    import time

    seen: dict = {}
    # a free port each (port + 1 may be another socket's: an ephemeral source port)
    for backend, port in zip(("ringlet", "gloo"), ports):
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60),
                              wait_for_workers=False)
        if rank < 2:
            t0 = time.monotonic()
            try:
                dist.init_process_group(backend, store=dist.PrefixStore(backend, store),
                                        rank=rank, world_size=world,
                                        timeout=timedelta(seconds=2))
                seen[backend] = ("joined",)
            except Exception as e:  # the outcome is the point
                seen[backend] = (isinstance(e, RuntimeError), time.monotonic() - t0,
                                 str(e).split("Exception raised from")[0])
        gate.wait()  # rank 0 serves the store until every rank is done with it
        del store
    return seen


def test_default_group_meets_its_peers_in_init_process_group() -> None:
    """The job's default group connects inside init_process_group (its waits
    block on the store), as gloo's does: a rank that never joins is named
    there, within the timeout, on every rank that did; gloo also raises."""
    import torch.multiprocessing as mp

    gate = mp.get_context("spawn").Barrier(3)
    ports = [free_port(), free_port()]
    while ports[1] == ports[0]:
        ports[1] = free_port()
    out = launch(3, _absent_rank_job, ports, gate, init=False, timeout=120)
    for r in (0, 1):
        ok, took, msg = out[r]["ringlet"]
        # rank 0 waits its full timeout for the records; rank 1 hears its
        # verdict, however much later it arrived
        assert ok and (1.5 if r == 0 else 0.0) < took < 10, out[r]
        assert f"rank {r}: Timed out waiting for rank 2: rank 2 did not join" in msg, msg
        assert out[r]["gloo"][0] is True, out[r]  # gloo raises a RuntimeError too


def test_entry_point_registers_the_backend_without_import() -> None:
    import subprocess
    import sys

    code = ("import sys, torch.distributed as dist; "
            "print('RINGLET' in dist.Backend._plugins, dist.Backend.RINGLET)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split() == ["True", "ringlet"], out


def _two_host_job(rank: int, world: int, port: int) -> list:
    _init(rank, world, port)
    pg = dist.distributed_c10d._get_default_group()
    n = 1 << 17  # 512 KiB of float32: past the two-level threshold
    every = [_data(r, n, torch.float32, seed=3) for r in range(world)]
    t = every[rank].clone()
    dist.all_reduce(t)
    _same(t, sum(every), "two-level all_reduce")
    ints = [_data(r, n, torch.int32, seed=4) for r in range(world)]
    t = ints[rank].clone()
    dist.all_reduce(t, op=dist.ReduceOp.BXOR)
    want = ints[0]
    for x in ints[1:]:
        want = want ^ x
    _same(t, want, "two-level BXOR", exact=True)
    out = torch.empty(world * n)
    dist.all_gather_into_tensor(out, every[rank])
    _same(out, torch.cat(every), "two-level all_gather", exact=True)
    mine = torch.empty(n // world)
    dist.reduce_scatter_tensor(mine, every[rank])
    _same(mine, sum(every)[rank * (n // world):(rank + 1) * (n // world)], "two-level rs")
    b = every[rank].clone()
    dist.broadcast(b, src=1)
    _same(b, every[1], "two-level broadcast", exact=True)
    from ringlet.distributed.c10d import python_group

    comm = python_group(pg)._comm  # the Python group (behind the native Backend)
    layout = comm.host_layout()
    transport = comm.transport
    dist.destroy_process_group()
    return [layout, transport]


def test_group_spanning_simulated_hosts_runs_in_two_levels() -> None:
    hosts = [{"RINGLET_HOST_ID": h} for h in ("a", "b", "a", "b")]
    out = launch(4, _two_host_job, free_port(), init=False, timeout=180, per_rank_env=hosts)
    for r in range(4):
        assert out[r] == [[[0, 2], [1, 3]], "tcp"]


def _abort_job(rank: int, world: int, port: int) -> str:
    import threading

    _init(rank, world, port)
    pg = dist.distributed_c10d._get_default_group()
    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 0:
        # Rank 1 never joins this all_reduce: abort() from another thread
        # makes the blocked call raise at once instead of at the timeout.
        threading.Timer(0.5, pg.abort).start()
        with pytest.raises(RuntimeError) as e:
            dist.all_reduce(t)
        store.set("aborted", "1")
        return str(e.value)
    store.wait(["aborted"])
    with pytest.raises(RuntimeError) as e:
        dist.all_reduce(t)
    return str(e.value)


def test_abort_unblocks_and_names_the_aborting_rank() -> None:
    out = launch(2, _abort_job, free_port(), init=False, timeout=120)
    assert "abort" in out[0]
    assert "rank 0" in out[1], out[1]


def _outcome(fn: object, *args: object, **kwargs: object) -> object:
    """What a call gives, comparable across backends: its value as lists, or
    for an error whether it is a RuntimeError (the type gloo raises)."""
    try:
        value = fn(*args, **kwargs)  # type: ignore[operator]
    except Exception as e:  # the outcome is the point
        return ("raised", isinstance(e, RuntimeError))
    return _plain_value(value)


def _plain_value(v: object) -> object:
    if isinstance(v, torch.Tensor):
        return (str(v.dtype), list(v.shape), v.tolist())
    if isinstance(v, (list, tuple)):
        return [_plain_value(x) for x in v]
    return v


def _less_common_forms(rank: int, world: int, group: object) -> list:
    """torch.distributed's less common call forms on ``group`` (3 ranks);
    the caller compares ringlet's results with gloo's."""
    pg = group if group is not None else dist.group.WORLD
    R = dist.ReduceOp
    got: list = []
    # complex tensors: reduce ops other than SUM/AVG are refused on every rank
    for op in (R.MAX, R.MIN, R.PRODUCT):
        c = torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1)
        got.append(_outcome(dist.reduce, c, 1, op=op, group=group))
        got.append(_plain_value(torch.view_as_real(c)))
    c = torch.tensor([1 + 2j, 3 - 1j]) * (rank + 1)
    dist.reduce(c, 1, group=group)
    if rank == 1:
        got.append(_plain_value(torch.view_as_real(c)))
    # reduce of a non-contiguous tensor (the root's result; gloo's non-roots
    # hold partial sums, ringlet's keep their input)
    m = (torch.arange(6.0).view(2, 3) + rank).t()
    dist.reduce(m, 2, group=group)
    if rank == 2:
        got.append(_plain_value(m))
    # the future of an asynchronous gather: the root's gathered tensors
    outs = [torch.zeros(2) for _ in range(world)] if rank == 0 else None
    work = dist.gather(torch.full((2,), float(rank)), outs, 0, group=group, async_op=True)
    got.append(_plain_value(work.get_future().wait()))
    # Work.source_rank: receives only
    got.append(_outcome(dist.all_reduce(torch.ones(1), group=group, async_op=True)._source_rank))
    if rank == 0:
        dist.send(torch.ones(2), 1, group=group)
    elif rank == 1:
        w = dist.irecv(torch.zeros(2), 0, group=group)
        w.wait()
        got.append(w._source_rank())
    # ProcessGroup calls with several tensors (torch's multi-device form):
    # reduced together, broadcast from the root tensor, gathered per input
    for op in (R.SUM, R.MAX, R.PRODUCT):
        a, b = torch.tensor([1.0 + rank, 2.0]), torch.tensor([10.0 * rank, 3.0])
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        pg.allreduce([a, b], opts).wait()
        got.append(_plain_value([a, b]))
    a, b = torch.tensor([1, 2]) + rank, torch.tensor([5, 6]) * rank
    pg.allreduce([a, b]).wait()
    got.append(_plain_value([a, b]))
    a, b = torch.tensor([1.0 + rank, 2.0]), torch.tensor([10.0 * rank, 3.0])
    pg.allreduce_coalesced([a, b], dist.AllreduceCoalescedOptions()).wait()  # each on its own
    got.append(_plain_value([a, b]))
    for which in (0, 1):
        a, b = torch.tensor([1.0 + rank, 2.0]), torch.tensor([10.0 * rank, 3.0])
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 1, which
        pg.broadcast([a, b], opts).wait()
        got.append(_plain_value([a, b]))
    outs = [[torch.zeros(1) for _ in range(2 * world)] for _ in range(2)]
    work = pg.allgather(outs, [torch.tensor([1.0 + rank]), torch.tensor([10.0 * rank])])
    work.wait()
    got.append(_plain_value(outs))
    got.append(_plain_value(work.get_future().wait()))
    # argument errors: raised at once on every rank, as RuntimeError
    bad_root = dist.BroadcastOptions()
    bad_root.rootTensor = 1
    got.append(_outcome(lambda: pg.broadcast([torch.ones(1)], bad_root).wait()))
    got.append(_outcome(lambda: pg.allreduce([torch.ones(2), torch.ones(3)]).wait()))
    got.append(_outcome(lambda: pg.allreduce([torch.ones(2), torch.ones(2).long()]).wait()))
    got.append(_outcome(lambda: pg.broadcast([torch.ones(2), torch.ones(3)],
                                             dist.BroadcastOptions()).wait()))
    got.append(_outcome(lambda: pg.reduce([torch.ones(1), torch.ones(1)],
                                          dist.ReduceOptions()).wait()))
    got.append(_outcome(lambda: pg.allgather([[torch.zeros(1)] * world], [torch.ones(1)] * 2)))
    for kind, call in ((dist.BroadcastOptions, pg.broadcast), (dist.ReduceOptions, pg.reduce)):
        opts = kind()
        opts.rootRank = world
        with pytest.raises(RuntimeError, match="invalid root rank"):
            call([torch.ones(1)], opts).wait()
    # Work.wait(timeout) raises once the caller's limit passed, while the
    # other ranks have not joined yet; the work then finishes normally
    store = dist.distributed_c10d._get_default_store()
    key = f"joined/{pg.name()}"
    t = torch.full((2,), float(rank + 1))
    if rank == 0:
        work = dist.all_reduce(t, group=group, async_op=True)
        with pytest.raises(RuntimeError) as e:
            work.wait(timedelta(milliseconds=300))
        got.append([work.is_completed(), "timed out" in str(e.value).lower()])
        store.set(key, "1")
        work.wait()
    else:
        store.wait([key])
        dist.all_reduce(t, group=group)
    got.append(_plain_value(t))
    dist.barrier(group=group)
    return got


def _less_common_job(rank: int, world: int, port: int) -> str:
    _init(rank, world, port)
    gloo = dist.new_group(backend="gloo")
    mine = _less_common_forms(rank, world, None)
    theirs = _less_common_forms(rank, world, gloo)
    assert len(mine) == len(theirs)
    for i, (m, g) in enumerate(zip(mine, theirs)):
        assert m == g, f"item {i}: ringlet {m} != gloo {g}"
    # reduce_scatter refuses complex MAX too (gloo's raises the same error,
    # but may abort the process afterwards: checked on ringlet only)
    with pytest.raises(RuntimeError, match="does not support MAX on complex"):
        dist.reduce_scatter_tensor(torch.zeros(2, dtype=torch.complex64),
                                   torch.ones(2 * world, dtype=torch.complex64),
                                   op=dist.ReduceOp.MAX)
    with pytest.raises(RuntimeError, match="does not support PRODUCT on complex"):
        dist.reduce_scatter(torch.zeros(2, dtype=torch.complex64),
                            [torch.ones(2, dtype=torch.complex64)] * world,
                            op=dist.ReduceOp.PRODUCT)
    dist.destroy_process_group()
    return "ok"


def test_less_common_forms_match_gloo() -> None:
    """Complex reduce ops refused, a non-contiguous reduce, the gather
    future, Work.source_rank and Work.wait(timeout), ProcessGroup calls with
    several tensors and their argument errors: ringlet as gloo, 3 ranks."""
    out = launch(3, _less_common_job, free_port(), init=False, timeout=180)
    assert out == {r: "ok" for r in range(3)}


# torch's own tests look for these in timeout errors (distributed_test.py)
_TIMED_OUT = r" (Timed out|closed|timeout) "


def _timeouts(rank: int, backend: str, store: object) -> dict:
    """monitored_barrier and barrier timeouts on fresh groups of ``backend``
    (gloo's groups are unusable after one): what each rank saw. Rank 1 stays
    out of every barrier; ranks meet through the store between cases."""
    import re
    import time
    import warnings

    seen: dict = {}

    def case(name: str, call: Any, limit: float) -> None:
        t0 = time.monotonic()
        try:
            call()
            seen[name] = ("passed",)
        except Exception as e:  # the outcome is the point
            took = time.monotonic() - t0
            msg = str(e).split("Exception raised from")[0]
            seen[name] = (isinstance(e, RuntimeError),
                          [bool(re.search(p, msg)) for p in patterns[name]],
                          took <= limit + 2.0, took >= min_time.get(name, 0.0))
            seen[name + ":msg"] = msg

    def meet(name: str) -> None:
        store.set(f"{backend}/{name}/{rank}", "1")  # type: ignore[attr-defined]
        store.wait([f"{backend}/{name}/{r}" for r in range(3)])  # type: ignore[attr-defined]

    patterns = {
        # test_monitored_barrier_gloo_rank_0_timeout
        "zero": ["Rank 0 timed out in monitoredBarrier",
                 "Rank 1 failed to pass monitoredBarrier in 0 ms"],
        # test_monitored_barrier_gloo: the first missing rank; the others' wording
        "first": ["Rank 1 failed to pass monitoredBarrier in 1000 ms"],
        "others": ["Rank 2 successfully reached monitoredBarrier, but received errors while "
                   "waiting for send/recv from rank 0"],
        # test_monitored_barrier_wait_all_ranks
        "all": ["Ranks 1, 2 failed to pass monitoredBarrier in 300 ms"],
        "all_one": ["Ranks 1 failed to pass monitoredBarrier"],
        "all_one_peer": ["Rank 2 successfully reached monitoredBarrier"],
        # test_barrier_timeout_full_group: a group never connected, and one that was
        "barrier": [_TIMED_OUT],
        "barrier_connected": [_TIMED_OUT],
    }
    min_time = {"barrier": 0.9, "barrier_connected": 0.9}
    if rank == 0:
        g = dist.new_group(backend=backend)
        case("zero", lambda: g.monitored_barrier(timedelta(seconds=0)), 0.0)
    else:
        dist.new_group(backend=backend)
    meet("zero")
    g = dist.new_group(backend=backend)
    if rank == 0:
        case("first", lambda: dist.monitored_barrier(g, timedelta(seconds=1)), 1.0)
    elif rank == 2:
        case("others", lambda: dist.monitored_barrier(g, timedelta(seconds=1)), 1.0)
    meet("first")
    g = dist.new_group(backend=backend)
    if rank == 0:
        case("all", lambda: dist.monitored_barrier(g, timedelta(seconds=0.3), True), 0.3)
    meet("all")
    g = dist.new_group(backend=backend)
    if rank == 0:
        case("all_one", lambda: dist.monitored_barrier(g, timedelta(seconds=0.3), True), 0.3)
    elif rank == 2:
        with warnings.catch_warnings(record=True) as w:  # a float: converted, warned
            warnings.simplefilter("always")
            case("all_one_peer", lambda: dist.monitored_barrier(
                g, 0.3, wait_all_ranks=True), 0.3)  # type: ignore[arg-type]
        seen["float_warned"] = any("timedelta" in str(x.message) for x in w)
    meet("all_one")
    # torch's own argument check: an int is not a timedelta
    try:
        dist.monitored_barrier(g, 5)  # type: ignore[arg-type]
    except TypeError as e:
        seen["int"] = str(e)
    # a monitored barrier that every rank reaches passes, on every rank
    g = dist.new_group(backend=backend)
    case("everyone", lambda: dist.monitored_barrier(g, timedelta(seconds=30)), 30.0)
    g = dist.new_group(backend=backend, timeout=timedelta(seconds=1))
    if rank == 0:
        case("barrier", lambda: dist.barrier(g), 1.0)
    meet("barrier")
    g = dist.new_group(backend=backend, timeout=timedelta(seconds=1))
    dist.barrier(g)
    meet("connected")
    if rank == 0:
        case("barrier_connected", lambda: dist.barrier(g), 1.0)
    meet("barrier_connected")
    return seen


def _timeouts_job(rank: int, world: int, path: str) -> dict:
    import ringlet  # noqa: F401

    # file://, as torch's suite runs: a file store takes a zero wait as "no limit"
    dist.init_process_group("ringlet", init_method=f"file://{path}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    store = dist.distributed_c10d._get_default_store()
    return {"ringlet": _timeouts(rank, "ringlet", store),
            "gloo": _timeouts(rank, "gloo", store)}


def test_monitored_barrier_and_barrier_timeouts_match_gloo(tmp_path) -> None:
    """monitored_barrier raises as gloo's does, with gloo's wording, and
    never waits past its timeout (zero: at once); barrier timeouts say
    " Timed out " as torch's tests expect; on a file store, 3 ranks."""
    out = launch(3, _timeouts_job, str(tmp_path / "store"), init=False, timeout=180)
    for rank in range(3):
        mine, gloo = out[rank]["ringlet"], out[rank]["gloo"]
        plain = {k: v for k, v in mine.items() if not k.endswith(":msg")}
        theirs = {k: v for k, v in gloo.items() if not k.endswith(":msg")}
        assert plain == theirs, (rank, mine, gloo)
        for name, outcome in plain.items():
            if name in ("int", "float_warned") or outcome == ("passed",):
                continue
            assert outcome[0] and all(outcome[1]) and outcome[2] and outcome[3], (
                rank, name, outcome, mine.get(name + ":msg"))
    assert out[0]["ringlet"]["zero"][0] is True
    assert set(out[0]["ringlet"]) >= {"zero", "first", "all", "all_one", "barrier",
                                      "barrier_connected"}
    assert out[2]["ringlet"]["others"][0] is True and out[2]["ringlet"]["float_warned"]
    # ringlet's own details after gloo's words: the culprit by its rank
    assert "rank 1 did not arrive" in out[0]["ringlet"]["first:msg"]
    assert "rank 1" in out[0]["ringlet"]["barrier_connected:msg"]


def _hand_built_job(rank: int, world: int, port: int) -> dict:
    """ProcessGroupRinglet built by hand, as torch's ProcessGroupGloo is,
    beside a gloo group built the same way; no init_process_group."""
    from ringlet.distributed.c10d import ProcessGroupRinglet

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world,
                                 timedelta(seconds=60))
    mine = ProcessGroupRinglet(dist.PrefixStore("mine", store), rank, world,
                               timedelta(seconds=60))
    got: dict = {"name": mine.getBackendName(), "size": mine.size(), "rank": mine.rank(),
                 "initialized": dist.is_initialized()}
    for key, pg in (("ringlet", mine), ("gloo", gloo)):
        t = torch.arange(5.0) * (rank + 1)
        pg.allreduce([t]).wait()
        b = torch.full((3,), float(rank))
        pg.broadcast([b], dist.BroadcastOptions()).wait()
        outs = [torch.zeros(2) for _ in range(world)]
        pg.allgather([outs], [torch.full((2,), float(rank))]).wait()
        pg.barrier().wait()
        got[key] = [t.tolist(), b.tolist(), [o.tolist() for o in outs]]
    # a second group on the same prefix is a new group (the k-th with the k-th)
    again = ProcessGroupRinglet(dist.PrefixStore("mine", store), rank, world)
    t = torch.ones(2)
    again.allreduce([t]).wait()
    got["again"] = t.tolist()
    errors = []
    for args in ((object(), 0, 2), (store, 2, 2), (store, -1, 2), (store, 0, 0),
                 (store, 0, 2, 5.0), (store, 0, 2, timedelta(seconds=-1))):
        try:
            ProcessGroupRinglet(*args)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            errors.append((type(e).__name__, str(e)))
    got["errors"] = errors
    for pg in (mine, again):
        pg.shutdown()
    return got


def test_process_group_built_by_hand_matches_gloo() -> None:
    """The public constructor ProcessGroupRinglet(store, rank, size, timeout):
    the same results as torch's ProcessGroupGloo built the same way, and
    clear errors for arguments a group cannot be built from."""
    out = launch(2, _hand_built_job, free_port(), init=False, timeout=120)
    for rank in range(2):
        r = out[rank]
        assert r["ringlet"] == r["gloo"], r
        assert r["ringlet"][0] == [float(i * 3) for i in range(5)]  # (1 + 2) * arange
        assert r["ringlet"][1] == [0.0] * 3 and r["ringlet"][2] == [[0.0, 0.0], [1.0, 1.0]]
        assert (r["name"], r["size"], r["rank"], r["initialized"]) == ("ringlet", 2, rank, False)
        assert r["again"] == [2.0, 2.0]
        kinds = [k for k, _ in r["errors"]]
        assert kinds == ["TypeError", "ValueError", "ValueError", "ValueError", "TypeError",
                         "ValueError"], r["errors"]
        assert "needs a torch.distributed.Store" in r["errors"][0][1]
        assert "rank 2 is outside [0, 2)" in r["errors"][1][1]
        assert "must not be negative" in r["errors"][5][1]
