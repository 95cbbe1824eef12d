"""ringlet.DistributedDataParallel on 2 and 3 real processes: several training
steps of a small model, with gradient accumulation under ``no_sync`` and a
parameter that never gets a gradient, equal to single-process training on the
concatenated batch and to torch's DDP over gloo."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import ringlet

from conftest import free_port, launch

STEPS = 4
LOCAL_BATCH = 5


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 32)
        self.unused = torch.nn.Linear(4, 4)  # never gets a gradient
        self.fc2 = torch.nn.Linear(32, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.tanh(self.fc1(x)))))


def batch(step: int, micro: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one (micro-)step: ``world * LOCAL_BATCH`` samples."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    n = world * LOCAL_BATCH
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def local(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]


def train(
    model: torch.nn.Module, rank: int, world: int, sharded: bool, device: str = "cpu"
) -> list[torch.Tensor]:
    """STEPS steps; odd steps accumulate two micro-batches (the first under
    ``no_sync`` when the model has it); the batches are moved to ``device``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.MSELoss()
    for step in range(STEPS):
        opt.zero_grad()
        micros = 2 if step % 2 else 1
        for micro in range(micros):
            x, y = batch(step, micro, world)
            if sharded:
                x, y = local(x, rank), local(y, rank)
            x, y = x.to(device), y.to(device)
            last = micro == micros - 1
            ctx = model.no_sync() if (sharded and not last) else contextlib.nullcontext()
            with ctx:
                loss_fn(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def ddp_ranks(rank: int, world: int, gloo_port: int) -> list[list[float]]:
    torch.manual_seed(0)
    reference = Net()
    # every rank starts from different weights: wrapping broadcasts rank 0's
    torch.manual_seed(rank)
    mine = Net()
    model = ringlet.DistributedDataParallel(mine, bucket_cap_mb=0.002)
    assert mine.ringlet_module_name == model.ringlet_module_name
    for a, b in zip(mine.parameters(), reference.parameters()):
        assert torch.equal(a, b), "parameters not broadcast from rank 0"
    # buckets follow reverse registration order and cover every parameter
    names = [n for n, _ in mine.named_parameters()]
    flat = [n for b in model.buckets for n in b]
    assert flat == names[::-1] and len(model.buckets) > 2, model.buckets

    got = train(model, rank, world, sharded=True)
    want = train(copy.deepcopy(reference), rank, world, sharded=False)
    for (n, _), g, w in zip(mine.named_parameters(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=f"{n} vs single process")
    unused_before = dict(reference.named_parameters())["unused.weight"]
    assert torch.equal(dict(mine.named_parameters())["unused.weight"], unused_before)

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world
    )
    try:
        torch_model = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(reference), find_unused_parameters=True
        )
        theirs = train(torch_model, rank, world, sharded=True)
        del torch_model
    finally:
        dist.destroy_process_group()
    for (n, _), g, t in zip(mine.named_parameters(), got, theirs):
        torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-6, msg=f"{n} vs torch DDP")

    # the tensor API sees the model's parameters by module name
    m = ringlet.parallel.tensor.get_module(mine.ringlet_module_name)
    assert [t.ringlet_tensor_name for t in m.tensors()] == names
    return [p.flatten()[:3].tolist() for p in got]


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_single_process_and_torch_ddp(world: int) -> None:
    out = launch(world, ddp_ranks, free_port(), timeout=120)
    assert all(out[r] == out[0] for r in range(world)), "ranks diverged"


def cuda_ddp_ranks(rank: int, world: int) -> list[list[float]]:
    dev = f"cuda:{rank % torch.cuda.device_count()}"
    torch.manual_seed(0)
    reference = Net()
    torch.manual_seed(rank)
    mine = Net().to(dev)
    model = ringlet.DistributedDataParallel(mine, bucket_cap_mb=0.002)
    for a, b in zip(mine.parameters(), reference.parameters()):
        assert a.is_cuda and torch.equal(a.cpu(), b), "parameters not broadcast from rank 0"
    got = [p.cpu() for p in train(model, rank, world, sharded=True, device=dev)]
    want = train(copy.deepcopy(reference), rank, world, sharded=False)
    for (n, _), g, w in zip(mine.named_parameters(), got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=f"{n} vs single process")
    # the torch_xla-style collectives name the device they refuse
    with pytest.raises(ValueError, match="cuda"):
        ringlet.all_reduce(ringlet.REDUCE_SUM, [torch.ones(3, device=dev)])
    return [p.flatten()[:3].tolist() for p in got]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is unavailable")
def test_cuda_model_trains_as_the_cpu_reference() -> None:
    """CUDA only: gradients staged through host memory after the CUDA events."""
    out = launch(2, cuda_ddp_ranks, timeout=180)
    assert out[0] == out[1], "ranks diverged"


def test_ddp_needs_init_and_a_positive_cap() -> None:
    ringlet.shutdown()
    with pytest.raises(ringlet.NotInitializedError):
        ringlet.DistributedDataParallel(torch.nn.Linear(2, 2))
    ringlet.init()
    try:
        with pytest.raises(ValueError, match="bucket_cap_mb"):
            ringlet.DistributedDataParallel(torch.nn.Linear(2, 2), bucket_cap_mb=0)
        # a world of one: backward works, gradients are untouched by averaging
        lin = torch.nn.Linear(3, 1)
        model = ringlet.DistributedDataParallel(lin, name="solo")
        assert lin.ringlet_module_name == "solo"
        x = torch.ones(2, 3)
        model(x).sum().backward()
        assert torch.equal(lin.weight.grad, torch.full((1, 3), 2.0))
        model(x).sum().backward()  # accumulates, like plain torch
        assert torch.equal(lin.weight.grad, torch.full((1, 3), 4.0))
        # gradients are marked ready while backward still runs: when the
        # input's gradient is computed the last layer's bucket is marked
        net = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.Linear(64, 2))
        overlapped = ringlet.DistributedDataParallel(net, bucket_cap_mb=0.001)
        assert overlapped.buckets == [["1.bias", "1.weight", "0.bias"], ["0.weight"]]
        seen: list[set[str]] = []
        xi = torch.ones(2, 3, requires_grad=True)
        xi.register_hook(lambda g: seen.append(set(overlapped._marked)))
        overlapped(xi).sum().backward()
        assert {"1.bias", "1.weight"} <= seen[0], seen
        assert not overlapped._marked  # the round finished
    finally:
        ringlet.parallel.tensor.close_modules()
        ringlet.shutdown()


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(3, 2)  # used on rank 0 only
        self.c = torch.nn.Linear(3, 2)  # used on no rank

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + (self.b(x) if use_b else 0)


def find_unused(rank: int, world: int, find: bool) -> None:
    torch.manual_seed(0)
    model = ringlet.DistributedDataParallel(Branchy(), find_unused_parameters=find)
    x = torch.full((2, 3), float(rank + 1))
    model(x, rank == 0).sum().backward()
    inner = model.module
    # Used everywhere: the average of every rank's gradient.
    want_a = sum(torch.full((2, 3), 2.0 * (r + 1)) for r in range(world)) / world
    torch.testing.assert_close(inner.a.weight.grad, want_a)
    # Used on rank 0 only: rank 0's gradient averaged with zeros.
    torch.testing.assert_close(inner.b.weight.grad, torch.full((2, 3), 2.0) / world)
    if find:
        assert inner.c.weight.grad is None and inner.c.bias.grad is None
    else:
        assert torch.equal(inner.c.weight.grad, torch.zeros(2, 3))


@pytest.mark.parametrize("find", [True, False])
def test_unused_parameters(find: bool) -> None:
    launch(2, find_unused, find)


class Plain(torch.nn.Module):
    """Every parameter gets a gradient (torch DDP's default mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 32)
        self.fc2 = torch.nn.Linear(32, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.tanh(self.fc1(x)))))


def comm_hook_ranks(rank: int, world: int, gloo_port: int) -> list[float]:
    torch.manual_seed(0)
    reference = Plain()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world
    )
    try:
        # torch DDP with its own gloo all-reduce, then with ringlet's hook:
        # small buckets, so several hooks are in flight during backward
        plain = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(reference), bucket_cap_mb=0.002
        )
        theirs = train(plain, rank, world, sharded=True)
        hooked = torch.nn.parallel.DistributedDataParallel(
            copy.deepcopy(reference), bucket_cap_mb=0.002
        )
        state = ringlet.parallel.comm_hooks.AllReduceState()
        hooked.register_comm_hook(state, ringlet.parallel.comm_hooks.allreduce_hook)
        ours = train(hooked, rank, world, sharded=True)
        single = train(copy.deepcopy(reference), rank, world, sharded=False)
        for g, t, s in zip(ours, theirs, single):
            torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(g, s, rtol=1e-5, atol=1e-6)
        # the default (shared) state, and average=False giving sums
        summed = ringlet.parallel.comm_hooks.AllReduceState(average=False)
        buf = torch.full((5,), float(rank + 1))
        assert summed.submit(buf).wait() is buf
        assert buf.tolist() == [world * (world + 1) / 2] * 5
        solo = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(reference))
        solo.register_comm_hook(None, ringlet.parallel.comm_hooks.allreduce_hook)
        x, y = batch(0, 0, world)
        torch.nn.functional.mse_loss(solo(local(x, rank)), local(y, rank)).backward()
        want = copy.deepcopy(reference)
        torch.nn.functional.mse_loss(want(x), y).backward()
        for p, q in zip(solo.parameters(), want.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
        # bad buckets fail on the spot, naming the problem and the rank
        with pytest.raises(ValueError, match=rf"rank {rank}: .*contiguous CPU"):
            summed.submit(torch.zeros(4, 2).t())
        with pytest.raises(TypeError, match="complex64 is not supported"):
            summed.submit(torch.zeros(2, dtype=torch.complex64))
        del plain, hooked, solo
    finally:
        dist.destroy_process_group()
    ringlet.shutdown()  # stops the hook workers
    with pytest.raises(RuntimeError, match="closed"):
        summed.submit(torch.zeros(1))
    return [p.flatten()[0].item() for p in ours]


@pytest.mark.parametrize("world", [2, 3])
def test_torch_ddp_with_ringlet_comm_hook(world: int) -> None:
    out = launch(world, comm_hook_ranks, free_port(), timeout=120)
    assert all(out[r] == out[0] for r in range(world)), "ranks diverged"
