"""Bagua's last gaps on ringlet (``ringlet.bagua.compat``), under Bagua's own
usage: ``alltoall_v`` with Bagua's n + 1 displacements, ``abort`` /
``resume`` given the ``data_parallel.DistributedDataParallel`` wrapper, the
names ``BaguaTensor``, ``BaguaModule``, ``data_parallel.distributed`` /
``bagua_distributed``, ``get_backend(name).register_ordered_buckets`` and
``ProcessGroup.bagua_patch``, ``contrib``'s fused optimizer (training equal to
the unfused run), load-balancing samplers (against an independent
re-computation of Bagua's partition) and cache loader, and the errors of the
parts ringlet does not provide. The multi-process checks run in one 2-rank
launch."""

from __future__ import annotations

import importlib
import math
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from conftest import free_port, launch

WORLD = 2


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 10)
        self.fc2 = torch.nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# -- alltoall_v: the expected blocks, from the counts alone -----------------------


def _counts(src: int, dst: int) -> int:
    """Elements rank ``src`` sends to rank ``dst``."""
    return src + 2 * dst + 1


def _send_tensor(rank: int) -> torch.Tensor:
    return torch.arange(32, dtype=torch.float32) + 100 * rank


def _displs(counts: list[int]) -> list[int]:
    """Blocks in order with a one-element gap before each."""
    out, at = [], 0
    for k in counts:
        out.append(at + 1)
        at += k + 1
    return out


def _expected_alltoall_v(rank: int, world: int) -> torch.Tensor:
    recv_counts = [_counts(s, rank) for s in range(world)]
    rd = _displs(recv_counts)
    out = torch.full((32,), -1.0)
    for s in range(world):
        sd = _displs([_counts(s, d) for d in range(world)])
        block = _send_tensor(s)[sd[rank] : sd[rank] + _counts(s, rank)]
        out[rd[s] : rd[s] + recv_counts[s]] = block
    return out


def gaps_job(rank: int, world: int, port: int, port2: int) -> dict[str, Any]:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import torch.distributed as dist

    import ringlet.bagua.compat as bagua
    from ringlet.bagua.compat.algorithms import async_model_average, gradient_allreduce

    bagua.init_process_group()
    out: dict[str, Any] = {}

    # 1. alltoall_v with n and with Bagua's n + 1 displacements.
    send_counts = [_counts(rank, d) for d in range(world)]
    recv_counts = [_counts(s, rank) for s in range(world)]
    sd, rd = _displs(send_counts), _displs(recv_counts)
    results = []
    for extra in (False, True):
        send = _send_tensor(rank)
        recv = torch.full((32,), -1.0)
        s_d = [*sd, sd[-1] + send_counts[-1]] if extra else sd
        r_d = [*rd, rd[-1] + recv_counts[-1]] if extra else rd
        bagua.alltoall_v(send, send_counts, s_d, recv, recv_counts, r_d)
        results.append(recv)
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[1], _expected_alltoall_v(rank, world)), results[1]
    # Bagua's communication_primitives example: counts of 2, n + 1 displacements, in place.
    t = torch.arange(2 * world, dtype=torch.float32) + 10 * rank
    bagua.alltoall_v_inplace(t, [2] * world, [2 * i for i in range(world + 1)])
    want = torch.cat([torch.arange(2 * rank, 2 * rank + 2.0) + 10 * s for s in range(world)])
    assert torch.equal(t, want), t
    for bad in ([0] * (world + 2), [0] * (world - 1)):
        with pytest.raises(ValueError, match="send_displs needs 2 entries"):
            bagua.alltoall_v(send, send_counts, bad, recv, recv_counts, rd)
    with pytest.raises(ValueError, match="falls outside"):
        bagua.alltoall_v(send, send_counts, [0, 31], recv, recv_counts, rd)

    # 2. abort / resume given Bagua's DistributedDataParallel wrapper, as the
    # mnist example does with its model (resume each epoch, abort after).
    torch.manual_seed(rank)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    net = bagua.data_parallel.DistributedDataParallel(
        model,
        optimizers=[opt],
        algorithm=async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=2),
    )
    impl = net.bagua_algorithm
    rounds = []
    for _epoch in range(2):  # twice each, as Bagua's test_multiple_aborts
        impl.resume(net)
        impl.resume(net)
        for step in range(4):
            x, y = _data(rank, step)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
        impl.abort(net)
        impl.abort(net)
        assert impl.status == async_model_average._AsyncInternalState.STOPPED
        rounds.append(net.bagua_buckets[0]._async_op.rounds)
    every = torch.empty(world, dtype=torch.int64)
    bagua.allgather(torch.tensor([rounds[-1]]), every)
    assert torch.equal(every, every[0].expand_as(every)) and rounds[-1] >= rounds[0] >= 1, every
    impl.abort(net.inner)  # the inner form, and a second abort: nothing to do
    impl.resume(model)  # the module form
    assert impl.status == async_model_average._AsyncInternalState.STARTED
    impl.abort(model)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        impl.abort(object())
    out["async_rounds"] = rounds

    # 3. The names: BaguaModule, data_parallel.distributed / bagua_distributed,
    # get_backend(name).register_ordered_buckets, ProcessGroup.bagua_patch.
    from ringlet.bagua.compat.data_parallel.bagua_distributed import BaguaDistributedDataParallel
    from ringlet.bagua.compat.data_parallel.distributed import DistributedDataParallel
    from ringlet.bagua.compat.distributed import BaguaModule

    assert DistributedDataParallel is bagua.data_parallel.DistributedDataParallel
    assert isinstance(net.inner, BaguaDistributedDataParallel)
    torch.manual_seed(rank)
    model = Net()
    local = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model = BaguaModule.with_bagua(model, [opt], gradient_allreduce.GradientAllReduceAlgorithm())
    local.load_state_dict(model.state_dict())  # rank 0's weights, broadcast by wrapping
    assert model.bagua_algorithm is model.bagua_ddp.bagua_algorithm
    # Bagua's own re-registration of the model's buckets, then one step: the
    # gradients are the mean of every rank's local gradients.
    backend = bagua.get_backend(model.bagua_module_name)
    backend.register_ordered_buckets([b.backend_bucket for b in model.bagua_buckets])
    with pytest.raises(TypeError, match="not a BaguaBucket"):
        backend.register_ordered_buckets([object()])
    x, y = _data(rank, 0)
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(local(x), y).backward()
    mine = torch.cat([p.grad.reshape(-1) for p in local.parameters()])
    every = torch.empty(world * mine.numel())
    bagua.allgather(mine, every)
    mean = every.view(world, -1).mean(0)
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.allclose(got, mean, atol=1e-6), (got - mean).abs().max()
    pg = dist.new_group(list(range(world)))
    assert pg.bagua_patch() is pg and pg in bagua.communication._torch_to_bagua_pg_map
    assert pg.bagua_pg.ranks == list(range(world))
    v = torch.tensor([float(rank + 1)])
    bagua.allreduce_inplace(v, comm=pg.bagua_get_global_communicator())
    assert v.item() == world * (world + 1) / 2
    with pytest.raises(RuntimeError, match="bagua_patch"):
        dist.new_group(list(range(world))).bagua_pg  # noqa: B018

    # 4. fuse_optimizer as Bagua's mnist example (with_bagua(do_flatten=False),
    # Adadelta, fuse_step): equal to the same training with step().
    from ringlet.bagua.compat.contrib import fuse_optimizer

    runs: dict[tuple[bool, bool], torch.Tensor] = {}
    fused_counts = {}
    for set_to_none in (True, False):
        for fuse in (False, True):
            torch.manual_seed(rank)
            model = Net()
            opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
            model = model.with_bagua(
                [opt], gradient_allreduce.GradientAllReduceAlgorithm(), do_flatten=not fuse
            )
            if fuse:
                opt = fuse_optimizer(opt)
            for step in range(3):
                x, y = _data(rank, step)
                opt.zero_grad(set_to_none=set_to_none)
                F.nll_loss(F.log_softmax(model(x), 1), y).backward()
                opt.fuse_step() if fuse else opt.step()
            runs[(set_to_none, fuse)] = _flat(model)
            if fuse:
                fused_counts[set_to_none] = opt._bagua_fused_count
    for set_to_none in (True, False):
        diff = (runs[(set_to_none, True)] - runs[(set_to_none, False)]).abs().max().item()
        assert diff <= 1e-6, (set_to_none, diff)
    assert fused_counts == {True: 3, False: 3}, fused_counts  # every step fused
    every = torch.empty(world * runs[(False, True)].numel())
    bagua.allgather(runs[(False, True)], every)
    assert torch.equal(every.view(world, -1)[0], every.view(world, -1)[1])  # replicas agree

    # 5. The load-balancing sampler with the job's world and rank (Bagua reads
    # them from torch.distributed).
    from ringlet.bagua.compat.contrib import LoadBalancingDistributedSampler

    dataset = torch.utils.data.TensorDataset(torch.arange(23), torch.arange(23) % 7)
    sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lambda s: int(s[1]))
    sampler.set_epoch(3)
    out["sampler"] = (sampler.num_replicas, sampler.rank, list(sampler))

    # 6. ringlet.shutdown() closes Bagua's groups too (a hook the door
    # registers): Bagua's init works again afterwards, on a new store.
    import ringlet

    ringlet.shutdown()
    os.environ["MASTER_PORT"] = str(port2)
    bagua.init_process_group()
    again = torch.full((3,), float(rank + 1))
    bagua.allreduce(again, again)
    out["again"] = again.tolist()
    return out


def test_bagua_gaps_on_two_ranks() -> None:
    out = launch(
        WORLD, gaps_job, free_port(), free_port(), init=False, timeout=120,
        env={"OMP_NUM_THREADS": "1"},
    )
    complexities = [i % 7 for i in range(23)]
    for rank in range(WORLD):
        replicas, me, indices = out[rank]["sampler"]
        assert (replicas, me) == (WORLD, rank)
        assert indices == _reference_indices(complexities, WORLD, rank, epoch=3)
        assert out[rank]["again"] == [float(sum(range(1, WORLD + 1)))] * 3


# -- the samplers against an independent re-computation of Bagua's partition -----


def _reference_indices(
    complexities: list[int],
    replicas: int,
    rank: int,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
    drop_last: bool = False,
    random_level: float = 0.0,
) -> list[int]:
    """Bagua's partition, written from its description: order the samples
    by (complexity + noise, index), lay them out cyclically in rows of
    ``replicas``, permute the rows, take column ``rank``."""
    n = len(complexities)
    if drop_last and n % replicas:
        num_samples = math.ceil((n - replicas) / replicas)
    else:
        num_samples = math.ceil(n / replicas)
    keys = list(complexities)
    rows = max(1, num_samples)
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        spread = int((max(complexities) - min(complexities)) * random_level + 1)
        noise = torch.randint(spread, (n,), generator=g)
        keys = [k + int(r) for k, r in zip(keys, noise)]
        perm = torch.randperm(rows, generator=g).tolist()
    else:
        perm = list(range(rows))
    order = sorted(range(n), key=lambda i: (keys[i], i))
    table = [order[i % n] for i in range(rows * replicas)]
    return [table[row * replicas + rank] for row in perm[:num_samples]]


@pytest.mark.parametrize(
    "n,replicas,shuffle,drop_last,random_level,epoch",
    [
        (23, 2, True, False, 0.0, 0),
        (23, 3, True, True, 0.5, 4),
        (10, 4, False, False, 0.0, 0),
        (10, 4, False, True, 1.0, 1),
        (7, 2, True, False, 1.0, 2),
    ],
)
def test_load_balancing_sampler_is_baguas_partition(
    n: int, replicas: int, shuffle: bool, drop_last: bool, random_level: float, epoch: int
) -> None:
    from ringlet.bagua.compat.contrib import LoadBalancingDistributedSampler

    complexities = [(i * 37) % 11 for i in range(n)]
    dataset = [(torch.tensor(i), c) for i, c in enumerate(complexities)]
    seen: list[int] = []
    for rank in range(replicas):
        s = LoadBalancingDistributedSampler(
            dataset,
            complexity_fn=lambda x: x[1],
            num_replicas=replicas,
            rank=rank,
            shuffle=shuffle,
            seed=5,
            drop_last=drop_last,
            random_level=random_level,
        )
        s.set_epoch(epoch)
        got = list(s)
        want = _reference_indices(
            complexities, replicas, rank, shuffle, 5, epoch, drop_last, random_level
        )
        assert got == want and len(s) == len(want)
        seen += got
    if not drop_last:
        assert set(seen) == set(range(n))  # every sample somewhere
    else:
        assert len(set(seen)) == len(seen)  # none twice


def test_load_balancing_batch_sampler_pads_to_the_same_count() -> None:
    from ringlet.bagua.compat.contrib import (
        LoadBalancingDistributedBatchSampler,
        LoadBalancingDistributedSampler,
    )

    complexities = [(i * 5) % 9 for i in range(21)]
    dataset = [(i, c) for i, c in enumerate(complexities)]

    def batch_fn(indices: list[int]) -> list[list[int]]:
        # batches of total complexity at most 12: a different count per rank
        out: list[list[int]] = [[]]
        for i in indices:
            if out[-1] and sum(complexities[j] for j in out[-1]) + complexities[i] > 12:
                out.append([])
            out[-1].append(i)
        return out

    for drop_last in (False, True):
        per_rank = [batch_fn(_reference_indices(complexities, 2, r, epoch=1)) for r in range(2)]
        total = (min if drop_last else max)(len(b) for b in per_rank)
        for rank in range(2):
            sampler = LoadBalancingDistributedSampler(
                dataset, complexity_fn=lambda x: x[1], num_replicas=2, rank=rank
            )
            batches = LoadBalancingDistributedBatchSampler(sampler, batch_fn, drop_last=drop_last)
            batches.set_epoch(1)
            want = [per_rank[rank][i % len(per_rank[rank])] for i in range(total)]
            assert list(batches) == want and len(batches) == total
    with pytest.raises(ValueError, match="drop_last of sampler"):
        LoadBalancingDistributedBatchSampler(
            LoadBalancingDistributedSampler(dataset, lambda x: x[1], 2, 0, drop_last=True),
            batch_fn,
        )
    with pytest.raises(ValueError, match="Invalid rank"):
        LoadBalancingDistributedSampler(dataset, lambda x: x[1], num_replicas=2, rank=2)


# -- the cache loader ---------------------------------------------------------------


def test_cache_loader_and_cached_dataset_return_the_same_items() -> None:
    from ringlet.bagua.compat.contrib import CachedDataset, CacheLoader

    calls: list[int] = []

    def load(k: int) -> dict[str, Any]:
        calls.append(k)
        return {"k": k, "t": torch.arange(k + 1) * k}

    loader = CacheLoader(dataset_name="sq", writer_buffer_size=3)
    loader.store.clear()  # the process's store, shared by every local loader
    for k in (1, 2, 1, 4, 2, 5, 1):
        v = loader.get(k, load)
        assert v["k"] == k and torch.equal(v["t"], torch.arange(k + 1) * k)
    assert calls == [1, 2, 4, 5]  # each key computed once
    assert loader.num_keys() == 3  # written in batches of 3; the 4th still buffered
    assert CacheLoader(dataset_name="other").get(1, lambda k: "fresh") == "fresh"
    assert CacheLoader(dataset_name="sq").get(2, lambda k: "fresh")["k"] == 2  # shared

    # Bagua's test_cached_dataset: two datasets, the store counts both.
    loader.store.clear()
    bases = [
        torch.utils.data.TensorDataset(torch.randn(102, 3), torch.arange(102)) for _ in range(2)
    ]
    cached = [CachedDataset(b, dataset_name=f"d{i}") for i, b in enumerate(bases)]
    for i, (base, c) in enumerate(zip(bases, cached)):
        assert len(c) == 102
        for _ in range(10):
            for _ in c:  # __getitem__ until IndexError, as Bagua's test iterates
                pass
        for j in range(102):
            x, y = c[j]
            assert torch.equal(x, base[j][0]) and int(y) == j
        assert c.cache_loader.num_keys() == 102 * (i + 1)
    got = torch.cat([x for x, _ in torch.utils.data.DataLoader(cached[0], batch_size=4)])
    assert torch.equal(got, bases[0].tensors[0])

    with pytest.raises(ValueError, match="Invalid backend 'memcached'"):
        CacheLoader(backend="memcached")
    try:
        import redis  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install redis"):
            CacheLoader(backend="redis", hosts=[{"host": "127.0.0.1", "port": "1"}])
    else:
        with pytest.raises(ValueError, match="does not start Redis servers"):
            CacheLoader(backend="redis", hosts=None)


# -- fuse_optimizer on one process: any optimizer, equal to step() -----------------


@pytest.mark.parametrize("name", ["sgd", "adam", "adadelta", "rmsprop"])
def test_fuse_step_equals_step(name: str) -> None:
    from ringlet.bagua.compat.contrib import fuse_optimizer
    from ringlet.bagua.compat.contrib.fuse import is_fused_optimizer

    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01),
        "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
        "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    }[name]
    finals = []
    for fuse in (False, True):
        torch.manual_seed(0)
        model = Net()
        opt = make(model.parameters())
        if fuse:
            fuse_optimizer(opt)
            assert is_fused_optimizer(opt)
        for step in range(4):
            x, y = _data(0, step)
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            opt.fuse_step() if fuse else opt.step()
        finals.append((_flat(model), opt.state_dict()["state"]))
        if fuse:
            assert opt._bagua_fused_count == 4
    assert (finals[0][0] - finals[1][0]).abs().max().item() <= 1e-6
    for pid, state in finals[0][1].items():  # the state written back per parameter
        for key, value in state.items():
            other = finals[1][1][pid][key]
            if isinstance(value, torch.Tensor):
                assert torch.allclose(value, other, atol=1e-6), (pid, key)
            else:
                assert value == other


# Bagua's tests/contrib/test_fused_optimizer.py on CPU: every optimizer and
# setting it lists, two parameter groups (weights with decay, biases
# without), fuse_step() and step() alternating: bit-equal to step() alone,
# each fuse_step fusing both groups.
BAGUA_OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.2, momentum=1, dampening=0, weight_decay=1, nesterov=True)),
    (torch.optim.SGD, dict(lr=0.2, momentum=1, dampening=0.5, weight_decay=1, nesterov=False)),
    (torch.optim.Adam, dict(weight_decay=1.0, amsgrad=True)),
    (torch.optim.Adam, dict(weight_decay=0.0, amsgrad=False)),
    (torch.optim.AdamW, dict(weight_decay=1.0, amsgrad=True)),
    (torch.optim.AdamW, dict(weight_decay=0.0, amsgrad=False)),
    (torch.optim.RMSprop, dict(weight_decay=1, momentum=1, centered=True)),
    (torch.optim.RMSprop, dict(weight_decay=0, momentum=1, centered=False)),
    (torch.optim.Rprop, dict(lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50))),
    (torch.optim.ASGD, dict(weight_decay=1)),
    (torch.optim.Adamax, dict(weight_decay=1)),
    (torch.optim.Adadelta, dict(weight_decay=1)),
]


@pytest.mark.parametrize(
    "opt_cls,settings",
    BAGUA_OPTIMIZERS,
    ids=[f"{c.__name__}{i}" for i, (c, _) in enumerate(BAGUA_OPTIMIZERS)],
)
def test_baguas_fused_optimizer_cases(opt_cls: Any, settings: dict[str, Any]) -> None:
    from ringlet.bagua.compat.contrib import fuse_optimizer

    steps = 11
    x = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).reshape(3, 2)
    finals = []
    for fuse in (False, True):
        torch.manual_seed(3)
        model = torch.nn.Sequential(
            torch.nn.Linear(2, 3), torch.nn.Sigmoid(), torch.nn.Linear(3, 1), torch.nn.Sigmoid()
        )
        named = list(model.named_parameters())
        groups = [
            {"params": [p for n, p in named if "bias" not in n], "weight_decay": 0.1},
            {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0},
        ]
        opt = opt_cls(groups, **settings)
        if fuse:
            opt = fuse_optimizer(opt)
        for step in range(steps):
            opt.zero_grad()
            model(x).sum().backward()
            opt.fuse_step() if fuse and step % 2 == 0 else opt.step()
        finals.append(_flat(model))
        if fuse:
            assert opt._bagua_fused_count == 2 * ((steps + 1) // 2)
    assert torch.equal(finals[0], finals[1])


def test_fuse_step_is_a_step_for_lr_schedulers() -> None:
    # Bagua's mnist example: StepLR over the fused optimizer, fuse_step() each
    # batch; torch warns (an error here) if the scheduler saw no step.
    from ringlet.bagua.compat.contrib import fuse_optimizer

    model = Net()
    opt = fuse_optimizer(torch.optim.Adadelta(model.parameters(), lr=1.0))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for epoch in range(2):
        x, y = _data(0, epoch)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.fuse_step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.25


def test_fuse_optimizer_bad_input() -> None:
    from ringlet.bagua.compat.contrib import fuse_optimizer
    from ringlet.bagua.compat.contrib.fuse import fuse_step

    opt = torch.optim.SGD(Net().parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="not a fused optimizer"):
        fuse_step(opt)
    fuse_optimizer(opt)
    with pytest.raises(RuntimeError, match="fused already"):
        fuse_optimizer(opt)
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        fuse_optimizer(object())  # type: ignore[arg-type]


# -- names --------------------------------------------------------------------------


def test_bagua_tensor_and_module_names() -> None:
    import ringlet.bagua.compat as bagua
    from ringlet.bagua.compat.tensor import BaguaTensor

    assert BaguaTensor is bagua.BaguaTensor
    assert BaguaTensor.ensure_bagua_tensor is torch.Tensor.ensure_bagua_tensor
    t = BaguaTensor.ensure_bagua_tensor(torch.zeros(3), "gaps_t")
    assert BaguaTensor.is_bagua_tensor(t) and t.bagua_tensor_name == "gaps_t"
    assert bagua.BaguaModule.with_bagua is torch.nn.Module.with_bagua
    m = Net()
    bagua.BaguaModule.bagua_module_name.fset(m, "gaps_net")
    assert m.bagua_module_name == "gaps_net"
    with pytest.raises(AttributeError, match="with_bagua"):
        bagua.BaguaModule.bagua_algorithm.fget(m)


# -- the parts ringlet does not provide ---------------------------------------------


@pytest.mark.parametrize(
    "statement,module,instead",
    [
        ("import ringlet.bagua.compat.moe", "ringlet.bagua.compat.moe", "all_to_all_single"),
        ("from ringlet.bagua.compat import moe", "ringlet.bagua.compat.moe", "deepspeed.moe"),
        (
            "from ringlet.bagua.compat.model_parallel import moe",
            "ringlet.bagua.compat.model_parallel",
            "all_to_all_single",
        ),
        (
            "import ringlet.bagua.compat.checkpoint",
            "ringlet.bagua.compat.checkpoint",
            "torch.distributed.checkpoint",
        ),
        (
            "from ringlet.bagua.compat.checkpoint import save_checkpoint",
            "ringlet.bagua.compat.checkpoint",
            "ringlet.checkpoint",
        ),
        (
            "from ringlet.bagua.compat.contrib import sync_batchnorm",
            "ringlet.bagua.compat.contrib.sync_batchnorm",
            "torch.nn.SyncBatchNorm",
        ),
        (
            "import ringlet.bagua.compat.contrib.sync_batchnorm",
            "ringlet.bagua.compat.contrib.sync_batchnorm",
            'init_process_group("ringlet")',
        ),
        (
            "from ringlet.bagua.compat.data_parallel import functional",
            "ringlet.bagua.compat.data_parallel.functional",
            "torch.distributed.nn.functional",
        ),
    ],
)
def test_not_provided_parts_say_so(statement: str, module: str, instead: str) -> None:
    importlib.import_module("ringlet.bagua.compat")
    with pytest.raises(ImportError) as info:
        exec(statement, {})
    text = str(info.value)
    assert f"No module named '{module}'" in text, text
    assert "ringlet does not provide" in text and instead in text, text
    assert "ringlet.compat.bagua" not in text and "is not a package" not in text, text
    assert type(info.value).__module__ == "ringlet.bagua.compat"


def test_unknown_submodule_and_attribute() -> None:
    import ringlet.bagua.compat as bagua

    with pytest.raises(ModuleNotFoundError) as info:
        importlib.import_module("ringlet.bagua.compat.no_such_part")
    assert "is not a package" not in str(info.value)
    with pytest.raises(AttributeError, match="ringlet does not provide Bagua's checkpointing"):
        bagua.checkpoint  # noqa: B018
