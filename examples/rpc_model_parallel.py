"""Model parallel training with distributed autograd, ringlet.rpc vs torch.distributed.rpc.

Rank 0 runs the first stage of an MLP and drives training; rank 1 owns the
second stage (an RRef). Each step: forward through an RPC, the loss on rank 0,
``dist_autograd.backward`` across both workers and
``DistributedOptimizer.step``. The same code runs on ringlet.rpc and on
torch.distributed.rpc (both initialised in the same processes, timed one after
the other), and both must end with the parameters of the same model trained
locally.

    torchrun --nproc_per_node 2 examples/rpc_model_parallel.py
    HIDDEN=64 BATCH=16 torchrun --nproc_per_node 2 examples/rpc_model_parallel.py  # RPC-bound
"""

from __future__ import annotations

import importlib
import os
import statistics
import time
from typing import Any

import torch
from torch import nn

STEPS = 30
BATCH = int(os.environ.get("BATCH", "64"))
HIDDEN = int(os.environ.get("HIDDEN", "512"))


def make_stages() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(256, HIDDEN), nn.ReLU())
    second = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))
    return first, second


def make_second() -> nn.Module:
    return make_stages()[1]


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 256, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(STEPS)]


def forward_second(stage: Any, h: torch.Tensor) -> torch.Tensor:
    return stage.local_value()(h)


def param_rrefs(rpc_name: str, stage: Any) -> list[Any]:
    rpc = importlib.import_module(rpc_name)
    return [rpc.RRef(p) for p in stage.local_value().parameters()]


def params_of(stage: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in stage.local_value().parameters()]


def train(rpc_name: str, autograd_name: str, optim_name: str) -> tuple[list[float], list[Any]]:
    rpc = importlib.import_module(rpc_name)
    dist_autograd = importlib.import_module(autograd_name)
    optim = importlib.import_module(optim_name)
    first, _ = make_stages()
    second = rpc.remote(1, make_second)
    params = [rpc.RRef(p) for p in first.parameters()]
    params += rpc.rpc_sync(1, param_rrefs, args=(rpc_name, second))
    opt = optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    times = []
    for x, y in batches():
        t0 = time.perf_counter()
        with dist_autograd.context() as cid:
            out = rpc.rpc_sync(1, forward_second, args=(second, first(x)))
            loss = nn.functional.cross_entropy(out, y)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        times.append(time.perf_counter() - t0)
    final = [p.detach().clone() for p in first.parameters()]
    final += rpc.rpc_sync(1, params_of, args=(second,))
    return times, final


def train_locally() -> list[torch.Tensor]:
    first, second = make_stages()
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.05)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.cross_entropy(second(first(x)), y).backward()
        opt.step()
    return [p.detach() for m in (first, second) for p in m.parameters()]


def main() -> None:
    import torch.distributed.rpc as trpc

    import ringlet.rpc as rrpc

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        raise SystemExit("run with 2 processes")
    trpc.init_rpc(f"w{rank}", rank=rank, world_size=world)
    rrpc.init_rpc(f"w{rank}", rank=rank, world_size=world)
    if rank == 0:
        want = train_locally()
        runs = {
            "ringlet.rpc": ("ringlet.rpc", "ringlet.rpc.autograd", "ringlet.rpc.optim"),
            "torch.distributed.rpc": ("torch.distributed.rpc", "torch.distributed.autograd",
                                      "torch.distributed.optim"),
        }
        steps: dict[str, list[float]] = {name: [] for name in runs}
        diffs: dict[str, float] = {}
        for _ in range(3):  # alternate, so that drift of the machine hits both
            for name, mods in runs.items():
                times, got = train(*mods)
                steps[name] += times[3:]
                diffs[name] = max(float((a - b).abs().max()) for a, b in zip(got, want))
        med = {}
        for name in runs:
            med[name] = statistics.median(steps[name])
            print(f"{name:22s} median step {med[name] * 1e3:7.2f} ms; "
                  f"max |distributed - local| = {diffs[name]:.1e}", flush=True)
            if diffs[name] > 1e-5:
                raise SystemExit(f"{name}: parameters differ from local training")
        print(f"ringlet.rpc step time: {med['torch.distributed.rpc'] / med['ringlet.rpc']:.1f}x "
              "faster than torch.distributed.rpc", flush=True)
    rrpc.shutdown()
    trpc.shutdown()


if __name__ == "__main__":
    main()
