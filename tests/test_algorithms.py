"""Bagua's algorithms on ringlet (``ringlet.bagua.compat``), on real
processes, against plain-torch references of Bagua's semantics
(``_bagua_reference``: every rank simulates every replica of the job and
compares its own weights with its replica's): gradient all-reduce,
ByteGrad (with and without error feedback), decentralized SGD (``all``,
``shift_one`` at intervals 1 and 2), low-precision decentralized SGD on
the ring, QAdam, asynchronous averaging; the extension API; bad input."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _bagua_reference import (
    EPS,
    Net,
    bytegrad_mean,
    centralized,
    close,
    compress,
    data,
    decentralized,
    decompress,
    flat,
    low_precision,
    padded,
    qadam,
    rev,
    roundtrip,
)

from conftest import free_port, launch

STEPS = 10


def _init(rank: int, world: int, port: int) -> Any:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    import ringlet.bagua.compat as bagua

    bagua.init_process_group()
    return bagua


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int,
           first: int = 0) -> None:
    for step in range(first, first + steps):
        x, y = data(rank, step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def _wrap(bagua: Any, rank: int, algorithm: Any, opt_cls: Any = None, **kw: Any) -> tuple:
    torch.manual_seed(rank)  # wrapping broadcasts rank 0's weights
    model = Net()
    opt = (opt_cls or torch.optim.SGD)(model.parameters(), lr=kw.pop("lr", 0.01))
    if callable(algorithm) and not hasattr(algorithm, "reify"):
        algorithm = algorithm(opt)
    return model.with_bagua([opt], algorithm, **kw), opt


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _gathered(bagua: Any, t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` stacked (over the default group)."""
    out = torch.empty(bagua.get_world_size() * t.numel(), dtype=t.dtype)
    bagua.allgather(t.contiguous().view(-1), out)
    return out.view(bagua.get_world_size(), -1)


def _same_everywhere(bagua: Any, ws: list[torch.Tensor]) -> None:
    every = _gathered(bagua, flat(ws))
    assert torch.equal(every, every[0].expand_as(every)), "replicas differ"


def algorithms_job(rank: int, world: int, port: int) -> dict[str, Any]:
    bagua = _init(rank, world, port)
    from ringlet.bagua.compat.algorithms import (
        bytegrad,
        gradient_allreduce,
        q_adam,
    )
    from ringlet.bagua.compat.algorithms import (
        decentralized as dec,
    )

    out: dict[str, Any] = {}

    # Gradient all-reduce, flat and hierarchical (one host: exact either way).
    for hier in (False, True):
        model, opt = _wrap(bagua, rank, gradient_allreduce.GradientAllReduceAlgorithm(
            hierarchical=hier))
        assert model.bagua_module_name and model.bagua_buckets
        _train(model, opt, rank, STEPS)
        ref = centralized(world, STEPS, lambda bs: sum(bs[1:], bs[0].clone()) / len(bs))
        close(_weights(model), ref, what=f"gradient_allreduce(hierarchical={hier})")
        _same_everywhere(bagua, _weights(model))

    # ByteGrad, flat: compressed exactly as Bagua's reference does it.
    model, opt = _wrap(bagua, rank, bytegrad.ByteGradAlgorithm(hierarchical=False))
    _train(model, opt, rank, STEPS)
    ref = centralized(world, STEPS, bytegrad_mean, align=world)
    close(_weights(model), ref, what="bytegrad")
    _same_everywhere(bagua, _weights(model))
    bucket = model.bagua_buckets[0]
    assert bucket.padding_tensor is not None or flat(ref).numel() % world == 0

    # ByteGrad on one host, hierarchical: an exact all-reduce.
    model, opt = _wrap(bagua, rank, bytegrad.ByteGradAlgorithm())
    _train(model, opt, rank, STEPS)
    ref = centralized(world, STEPS, lambda bs: sum(bs[1:], bs[0].clone()) / len(bs), world)
    close(_weights(model), ref, what="bytegrad hierarchical on one host")

    # Error feedback: the residual each quantization leaves is carried exactly.
    model, opt = _wrap(bagua, rank, bytegrad.ByteGradAlgorithm(hierarchical=False,
                                                               error_feedback=True))
    op = model.bagua_buckets[0]._ops[0]
    x0, y0 = data(rank, 0)
    opt.zero_grad()
    F.mse_loss(model(x0), y0).backward()
    grads0 = [g.clone() for g in _gathered_grads(bagua, model)]
    worker, server = op.residuals(0)
    n_all = grads0[0].numel()
    mine = padded(grads0[rank], world)
    expect_worker = torch.cat([mine[s] - roundtrip(mine[s]) for s in _chunks(n_all, world)])
    got_worker = torch.frombuffer(bytearray(worker), dtype=torch.float32)
    assert torch.equal(got_worker, expect_worker), "sender residual"
    s_me = _chunks(n_all, world)[rank]
    acc = roundtrip(padded(grads0[0], world)[s_me]).float()
    for r in range(1, world):
        acc = acc + roundtrip(padded(grads0[r], world)[s_me]).float()
    mean = acc / world
    got_server = torch.frombuffer(bytearray(server), dtype=torch.float32)
    assert torch.equal(got_server, mean - roundtrip(mean)), "owner residual"
    # the next step starts from gradient + residual (the padding keeps what
    # the last reduction left in it, as Bagua's padding tensor)
    pad = model.bagua_buckets[0].padding_tensor
    pad0 = pad.detach().clone() if pad is not None else torch.zeros(0)
    opt.step()
    x1, y1 = data(rank, 1)
    opt.zero_grad()
    F.mse_loss(model(x1), y1).backward()
    grads1 = _gathered_grads(bagua, model)
    worker1, _ = op.residuals(0)
    x = torch.cat([grads1[rank], pad0]) + expect_worker
    expect1 = torch.cat([x[s] - roundtrip(x[s]) for s in _chunks(n_all, world)])
    assert torch.equal(torch.frombuffer(bytearray(worker1), dtype=torch.float32), expect1)

    # Decentralized SGD.
    modes = [("all", 1), ("shift_one", 1), ("shift_one", 2)] if world % 2 == 0 else [("all", 1)]
    for mode, interval in modes:
        model, opt = _wrap(bagua, rank, dec.DecentralizedAlgorithm(
            hierarchical=False, peer_selection_mode=mode, communication_interval=interval))
        _train(model, opt, rank, STEPS)
        ref = decentralized(world, STEPS, mode, interval)
        close(_weights(model), ref[rank], what=f"decentralized {mode}/{interval}")
        peer = model.bagua_buckets[0]._peer_weight
        assert peer.is_cpu and peer.numel() == flat(ref[rank]).numel()
        out[f"dec-{mode}-{interval}"] = model.bagua_buckets[0]._decentralized_op.step

    # Low-precision decentralized SGD on the ring.
    model, opt = _wrap(bagua, rank, dec.LowPrecisionDecentralizedAlgorithm(hierarchical=False))
    _train(model, opt, rank, STEPS)
    ref_w, ref_state = low_precision(world, STEPS)
    close(_weights(model), ref_w[rank], what="low precision decentralized")
    b = model.bagua_buckets[0]
    for got, want, what in zip((b._weight, b._left_peer_weight, b._right_peer_weight),
                               ref_state[rank], ("weight", "left", "right")):
        close([got], [want], what=f"low precision {what} replica")
    # my replica of my right neighbour is exactly its own weight replica
    every = _gathered(bagua, b._weight)
    lefts = _gathered(bagua, b._left_peer_weight)
    assert torch.equal(lefts[(rank + 1) % world], every[rank])

    # QAdam: exact warm-up, then compressed momentum (2 ranks: the exact
    # warm-up sums two numbers, the same in any order).
    if world == 2:
        model, opt = _wrap(bagua, rank, lambda o: q_adam.QAdamAlgorithm(o, hierarchical=False),
                           opt_cls=lambda ps, lr: q_adam.QAdamOptimizer(ps, lr=1e-3,
                                                                        warmup_steps=4))
        _train(model, opt, rank, STEPS)
        close(_weights(model), qadam(world, STEPS, warmup=4), what="qadam")
        _same_everywhere(bagua, _weights(model))
    return out


def _chunks(n: int, p: int) -> list[slice]:
    n = n + (p - n % p) % p
    return [slice(n * j // p, n * (j + 1) // p) for j in range(p)]


def _gathered_grads(bagua: Any, model: torch.nn.Module) -> list[torch.Tensor]:
    """Every rank's (reversed, flattened) gradients before communication:
    recomputed locally from the data, as the reference does."""
    from _bagua_reference import grads, replicas

    models = replicas(bagua.get_world_size())
    with torch.no_grad():
        for m in models:
            for p, q in zip(m.parameters(), model.parameters()):
                p.copy_(q)
    step = model.bagua_ddp.bagua_train_step_counter - 1
    return [flat(rev(g)) for g in grads(models, step)]


@pytest.mark.parametrize("world", [2, 4])
def test_algorithms_match_the_reference(world: int) -> None:
    out = launch(world, algorithms_job, free_port(), init=False, timeout=300,
                 env={"OMP_NUM_THREADS": "1"})
    assert out[0]["dec-shift_one-2"] == STEPS // 2 if world % 2 == 0 else True


def test_codec_is_bagua_minmax_uint8() -> None:
    """The engine's MinMaxUInt8 against the formula, bit for bit."""
    from ringlet import _core

    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(1000, generator=g), torch.rand(37, generator=g) * 1e-3 + 5.0,
             torch.full((9,), 2.5), -torch.rand(64, generator=g), torch.zeros(1)]
    for x in cases:
        n = _core.minmax_uint8_compressed_len("float32", x.numel())
        buf = torch.empty(n, dtype=torch.uint8)
        _core.minmax_uint8_compress(x.data_ptr(), x.nbytes, "float32", buf.data_ptr(), n)
        header = n - x.numel()
        minmax, q = compress(x)
        assert torch.equal(buf[header:], q)
        back = torch.empty_like(x)
        _core.minmax_uint8_decompress(buf.data_ptr(), n, back.data_ptr(), back.nbytes, "float32")
        assert torch.equal(back, decompress(minmax, q))
        assert (back - x).abs().max() <= (x.max() - x.min() + EPS) / 255
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(300, generator=g).to(dtype)
        name = str(dtype).replace("torch.", "")
        n = _core.minmax_uint8_compressed_len(name, x.numel())
        buf = torch.empty(n, dtype=torch.uint8)
        _core.minmax_uint8_compress(x.data_ptr(), x.nbytes, name, buf.data_ptr(), n)
        back = torch.empty_like(x)
        _core.minmax_uint8_decompress(buf.data_ptr(), n, back.data_ptr(), back.nbytes, name)
        assert torch.equal(back, decompress(*compress(x), dtype))
    # non-finite chunks decompress to NaN (documented); ints are refused
    x = torch.tensor([1.0, float("inf"), 3.0])
    buf = torch.empty(_core.minmax_uint8_compressed_len("float32", 3), dtype=torch.uint8)
    _core.minmax_uint8_compress(x.data_ptr(), x.nbytes, "float32", buf.data_ptr(), buf.numel())
    back = torch.empty(3)
    _core.minmax_uint8_decompress(buf.data_ptr(), buf.numel(), back.data_ptr(), 12, "float32")
    assert torch.isnan(back).all()
    i = torch.ones(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="float"):
        _core.minmax_uint8_compress(i.data_ptr(), 16, "int32", buf.data_ptr(), buf.numel())


def test_qadam_is_adam_during_warmup() -> None:
    """Bagua's own check: QAdamOptimizer in warm-up trains exactly as
    torch.optim.Adam (same losses, bit for bit)."""
    from ringlet.bagua.algorithms.q_adam import QAdamOptimizer

    def run(opt_cls: Any, **flags: Any) -> float:
        torch.manual_seed(13)
        model = Net()
        opt = opt_cls(model.parameters(), **flags)
        for _ in range(300):
            x, y = torch.randn(4, 2), torch.randn(4, 4)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        return float(loss.item())

    a = run(torch.optim.Adam, lr=0.001, weight_decay=0.1)
    b = run(QAdamOptimizer, lr=0.001, weight_decay=0.1, warmup_steps=2000)
    assert a == b
    for bad in ({"lr": -1.0}, {"warmup_steps": 0}, {"betas": (1.0, 0.9)}, {"eps": -1.0}):
        with pytest.raises(ValueError):
            QAdamOptimizer(Net().parameters(), **bad)


def api_job(rank: int, world: int, port: int) -> dict[str, Any]:
    """The extension API, algorithm switching, asynchronous averaging and
    every bad input, on 4 ranks."""
    bagua = _init(rank, world, port)
    import ringlet
    from ringlet.bagua.compat.algorithms import (
        Algorithm,
        AlgorithmImpl,
        async_model_average,
        bytegrad,
        gradient_allreduce,
    )
    from ringlet.bagua.compat.algorithms import (
        decentralized as dec,
    )
    from ringlet.bagua.compat.bucket import BaguaBucket, register_ordered_buckets
    from ringlet.bagua.compat.communication import _rank_not_in_group, new_group

    out: dict[str, Any] = {}

    # A user-written algorithm through the extension API: sum the gradients,
    # then halve them in a Python operation.
    class SumHalfImpl(AlgorithmImpl):
        def init_operations(self, bagua_ddp: Any, bucket: Any) -> None:
            bucket.clear_ops()
            bucket.append_centralized_synchronous_op(average=False, group=self.process_group)
            bucket.append_python_op(
                lambda name: [t.grad.mul_(0.5) for t in bucket.tensors], self.process_group)

    class SumHalf(Algorithm):
        def reify(self, process_group: Any) -> AlgorithmImpl:
            return SumHalfImpl(process_group)

    model, opt = _wrap(bagua, rank, SumHalf())
    _train(model, opt, rank, 3)
    ref = centralized(world, 3, lambda bs: sum(bs[1:], bs[0].clone()) * 0.5)
    close(_weights(model), ref, what="user-written algorithm")

    # The registry: by name, and an unknown name lists the known ones.
    assert isinstance(Algorithm.init("bytegrad", hierarchical=False), bytegrad.ByteGradAlgorithm)
    try:
        Algorithm.init("nope")
        raise AssertionError("unknown algorithm accepted")
    except KeyError as e:
        assert "Available names" in str(e) and "bytegrad" in str(e), e
    try:
        Net().with_bagua([], "nope")
        raise AssertionError("unknown algorithm name accepted by with_bagua")
    except KeyError as e:
        assert "gradient_allreduce" in str(e)

    # Ranks that choose different algorithms, or intervals: every rank raises,
    # naming who chose what.
    for a, b in ((bytegrad.ByteGradAlgorithm(), gradient_allreduce.GradientAllReduceAlgorithm()),
                 (dec.DecentralizedAlgorithm(communication_interval=1),
                  dec.DecentralizedAlgorithm(communication_interval=2))):
        try:
            _wrap(bagua, rank, a if rank == 0 else b)
            raise AssertionError("mismatched algorithms accepted")
        except ringlet.CollectiveMismatchError as e:
            assert "ranks [0]" in str(e) and "ranks [1, 2, 3]" in str(e), e

    # A torch.distributed group's Bagua twin (Bagua's test_from_torch_group).
    import torch.distributed as dist

    from ringlet.bagua.compat.communication import from_torch_group

    for members in ([1], [0, 2]):
        tg = dist.new_group(members)
        bg = from_torch_group(tg)
        if rank in members:
            c = bg.get_global_communicator()
            assert (c.rank(), c.nranks()) == (dist.get_rank(tg), dist.get_world_size(tg))
        else:
            assert _rank_not_in_group(bg)

    # shift_one needs an even number of ranks: a 3-rank group refuses, on
    # every member, before any exchange.
    group = new_group([0, 1, 2])
    if not _rank_not_in_group(group):
        try:
            _wrap(bagua, rank, dec.DecentralizedAlgorithm(hierarchical=False,
                                                          peer_selection_mode="shift_one"),
                  process_group=group)
            raise AssertionError("odd shift_one accepted")
        except ValueError as e:
            assert "even" in str(e), e

    # Non-finite gradients through ByteGrad: the chunk holding them is NaN
    # on every rank (defined, documented), the others are finite.
    model, opt = _wrap(bagua, rank, bytegrad.ByteGradAlgorithm(hierarchical=False))
    if rank == 0:
        model.fc3.weight.register_hook(lambda g: g.index_fill(1, torch.tensor([0]), float("nan")))
    x, y = data(rank, 0)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    g = flat(rev([p.grad for p in model.parameters()]))
    n = g.numel() + (world - g.numel() % world) % world
    first = slice(0, n // world)
    assert torch.isnan(g[first]).all() and torch.isfinite(g[n // world:]).all()

    # Switching algorithms on one model (Bagua's test_model_switch).
    torch.manual_seed(rank)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for algorithm in (bytegrad.ByteGradAlgorithm(hierarchical=False),
                      dec.DecentralizedAlgorithm(hierarchical=False),
                      gradient_allreduce.GradientAllReduceAlgorithm(),
                      dec.LowPrecisionDecentralizedAlgorithm(hierarchical=False)):
        model = model.with_bagua([opt], algorithm)
        _train(model, opt, rank, 3)
    assert all(torch.isfinite(p).all() for p in model.parameters())

    # Asynchronous averaging: rounds run while training; abort is collective
    # (every rank stops after the same round); resume and abort again.
    torch.manual_seed(rank)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = model.with_bagua([opt], async_model_average.AsyncModelAverageAlgorithm(
        sync_interval_ms=2, warmup_steps=3))
    _train(model, opt, rank, 30)
    try:
        model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
        raise AssertionError("re-wrapped while averaging")
    except RuntimeError as e:
        assert "abort" in str(e)
    model.bagua_algorithm.abort(model)
    model.bagua_algorithm.abort(model)  # a second abort does nothing
    rounds = model.bagua_buckets[0]._async_op.rounds
    every = _gathered(bagua, torch.tensor([rounds]))
    assert torch.equal(every, every[0].expand_as(every)) and rounds >= 1, every
    model.bagua_algorithm.resume(model)
    _train(model, opt, rank, 5, first=30)
    model.bagua_algorithm.abort(model)
    out["async_rounds"] = model.bagua_buckets[0]._async_op.rounds

    # One asynchronous round driven by marking the bucket ready (Bagua's op):
    # w += sum / n - w_at_start, exactly.
    from ringlet.bagua.compat import tensor as tensor_api

    w = torch.arange(6, dtype=torch.float32) * (rank + 1) + rank
    start = w.clone()
    w.ensure_ringlet_tensor("w", "async_round_module")
    module = tensor_api.get_module("async_round_module")
    bucket = BaguaBucket([w], name="0", flatten=True)
    bucket.append_asynchronous_model_average_op("all")
    register_ordered_buckets(module, [bucket])
    w.ringlet_mark_communication_ready()
    module.wait_pending_comm_ops()
    total = _gathered(bagua, start).sum(0)
    assert torch.equal(bucket.backend_tensor, start + (total / world - start))

    # ringlet.DistributedDataParallel with an algorithm.
    torch.manual_seed(rank)
    ddp = ringlet.DistributedDataParallel(Net(), algorithm="bytegrad")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    _train(ddp, opt, rank, 3)
    _same_everywhere(bagua, _weights(ddp))
    assert ddp.buckets and ddp.ringlet_algorithm is not None
    return out


def test_extension_api_switching_async_and_bad_input() -> None:
    launch(4, api_job, free_port(), init=False, timeout=300, env={"OMP_NUM_THREADS": "1"})


def hook_job(rank: int, world: int, port: int) -> list[float]:
    """torch DDP on the ringlet backend with the ByteGrad hook: replicas
    stay equal and the residual is carried."""
    import torch.distributed as dist

    from ringlet.distributed import hooks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("ringlet", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Net())
    state = hooks.ByteGradState(hierarchical=False, error_feedback=True)
    model.register_comm_hook(state, hooks.bytegrad_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(model, opt, rank, 4)
    assert state.residuals(0) is not None
    weights = flat(_weights(model))
    every = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(every, weights)
    assert all(torch.equal(every[0], e) for e in every)
    state.close()
    dist.destroy_process_group()
    return weights[:4].tolist()


def test_bytegrad_ddp_hook() -> None:
    launch(2, hook_job, free_port(), init=False, timeout=120)


def digits_job(rank: int, world: int, port: int) -> dict[str, float]:
    """Every algorithm trains an MLP on scikit-learn's digits (shipped with
    the package) to the exact all-reduce's accuracy."""
    from sklearn.datasets import load_digits

    bagua = _init(rank, world, port)
    from ringlet.bagua.compat.algorithms import (
        async_model_average,
        bytegrad,
        gradient_allreduce,
        q_adam,
    )
    from ringlet.bagua.compat.algorithms import (
        decentralized as dec,
    )

    x_all, y_all = load_digits(return_X_y=True)
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(0))
    x_all = torch.tensor(x_all, dtype=torch.float32)[order] / 16.0
    y_all = torch.tensor(y_all)[order]
    x_train, y_train = x_all[:1400][rank::world], y_all[:1400][rank::world]
    x_test, y_test = x_all[1400:], y_all[1400:]

    def net() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                   torch.nn.Linear(128, 10))

    runs = {
        "exact": lambda o: gradient_allreduce.GradientAllReduceAlgorithm(),
        "bytegrad": lambda o: bytegrad.ByteGradAlgorithm(hierarchical=False),
        "bytegrad+ef": lambda o: bytegrad.ByteGradAlgorithm(hierarchical=False,
                                                            error_feedback=True),
        "decentralized": lambda o: dec.DecentralizedAlgorithm(hierarchical=False,
                                                              peer_selection_mode="shift_one"),
        "low_precision": lambda o: dec.LowPrecisionDecentralizedAlgorithm(hierarchical=False),
        "qadam": lambda o: q_adam.QAdamAlgorithm(o, hierarchical=False),
        "async": lambda o: async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=5),
    }
    accuracy = {}
    for name, make in runs.items():
        model = net()
        opt: torch.optim.Optimizer = (
            q_adam.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=20)
            if name == "qadam" else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        )
        model = model.with_bagua([opt], make(opt))
        for _epoch in range(4):
            for i in range(0, len(y_train), 32):
                opt.zero_grad()
                F.cross_entropy(model(x_train[i:i + 32]), y_train[i:i + 32]).backward()
                opt.step()
        if name == "async":
            model.bagua_algorithm.abort(model)
        with torch.no_grad():
            accuracy[name] = float((model(x_test).argmax(1) == y_test).float().mean())
    bagua.barrier()
    return accuracy


def test_every_algorithm_learns_digits() -> None:
    accuracy = launch(2, digits_job, free_port(), init=False, timeout=300,
                      env={"OMP_NUM_THREADS": "1"})
    for rank, acc in accuracy.items():
        assert acc["exact"] > 0.9, acc
        for name, a in acc.items():
            if name == "async":
                # how often it averaged, and how stale the averages it mixed
                # in were, depends on the machine's load: each replica must
                # learn (chance is 0.1), not match the synchronous runs
                # (0.88-0.95 here; 0.82 seen once in a loaded CI run)
                assert a > 0.75, (rank, name, acc)
            else:
                assert a >= acc["exact"] - 0.03, (rank, name, acc)


def async_dead_rank_job(rank: int, world: int, port: int) -> dict[str, Any]:
    """Asynchronous averaging while rank 2 dies: the survivors raise
    PeerLostError naming it at a forward, and abort returns."""
    import time

    bagua = _init(rank, world, port)
    import ringlet
    from ringlet.bagua.compat.algorithms import async_model_average

    model, opt = _wrap(bagua, rank, async_model_average.AsyncModelAverageAlgorithm(
        sync_interval_ms=1))
    _train(model, opt, rank, 5)
    if rank == 2:
        os._exit(1)
    deadline = time.monotonic() + 60
    step = 5
    try:
        while time.monotonic() < deadline:
            _train(model, opt, rank, 1, first=step)
            step += 1
        raise AssertionError("no rank noticed that rank 2 died")
    except ringlet.PeerLostError as e:
        assert e.culprit == 2 and "rank 2" in str(e), e
    model.bagua_algorithm.abort(model)  # returns: the thread is gone
    return {"steps": step}


def test_async_averaging_names_a_dead_rank() -> None:
    out = launch(3, async_dead_rank_job, free_port(), init=False, timeout=120,
                 expect_dead=(2,))
    assert set(out) == {0, 1}
