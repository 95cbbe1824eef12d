"""A parameter server and trainers on ringlet.rpc (batch-synchronous SGD).

Rank 0 hosts the parameter server; every other rank is a trainer with its
own shard of the data. Each step a trainer computes its gradient and calls
``ParameterServer.update_and_fetch_model`` on the server through an RRef; the
server (an ``@rpc.functions.async_execution`` function, so no request thread
waits) averages the gradients of all trainers, takes one SGD step and answers
every trainer with the new parameters. At the end rank 0 trains the same model
locally on the whole data set and checks that the parameters agree.

    torchrun --nproc_per_node 3 examples/rpc_parameter_server.py
    # the same code runs on torch.distributed.rpc:  ... --torch
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from typing import Any

import torch
from torch import nn

STEPS = 30
LR = 0.1
SAMPLES = 240


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 1))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 20, generator=g)
    y = (x[:, :5].sum(1, keepdim=True) > 0).float()
    return x, y


def shard(trainer: int, trainers: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = make_data()
    n = SAMPLES // trainers
    return x[trainer * n:(trainer + 1) * n], y[trainer * n:(trainer + 1) * n]


class ParameterServer:
    """Holds the model; applies one averaged step when every trainer has sent
    its gradients for the current step."""

    def __init__(self, trainers: int) -> None:
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.trainers = trainers
        self.lock = threading.Lock()
        self.pending = 0
        self.future = torch.futures.Future()
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    @staticmethod
    def update_and_fetch_model(rpc_mod: str, ps_rref: Any, grads: list[torch.Tensor]) -> Any:
        self = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            self.pending += 1
            fut = self.future
            if self.pending == self.trainers:
                for p in self.model.parameters():
                    p.grad /= self.trainers
                self.opt.step()
                for p in self.model.parameters():
                    p.grad.zero_()
                self.pending = 0
                self.future = torch.futures.Future()
                fut.set_result(self.get_model())
        return fut


def _decorate(rpc: Any) -> None:
    # Decorated here so the same class serves both RPC frameworks.
    fn = ParameterServer.__dict__["update_and_fetch_model"].__func__
    ParameterServer.update_and_fetch_model = staticmethod(rpc.functions.async_execution(fn))


def run_trainer(rpc_mod: str, ps_rref: Any, trainer: int, trainers: int) -> float:
    import importlib

    rpc = importlib.import_module(rpc_mod)
    model = make_model()
    x, y = shard(trainer, trainers)
    params = ps_rref.rpc_sync().get_model()
    loss = torch.tensor(0.0)
    for _ in range(STEPS):
        with torch.no_grad():
            for p, v in zip(model.parameters(), params):
                p.copy_(v)
        model.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        params = rpc.rpc_sync(ps_rref.owner(), ParameterServer.update_and_fetch_model,
                              args=(rpc_mod, ps_rref, grads))
    return float(loss.detach())


def train_locally(trainers: int) -> list[torch.Tensor]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        for t in range(trainers):  # the mean of the shards' mean losses
            x, y = shard(t, trainers)
            loss = nn.functional.binary_cross_entropy_with_logits(model(x), y) / trainers
            loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--torch", action="store_true", help="use torch.distributed.rpc instead")
    args = ap.parse_args()
    if args.torch:
        import torch.distributed.rpc as rpc
    else:
        import ringlet.rpc as rpc
    rpc_mod = rpc.__name__
    _decorate(rpc)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainers = world - 1
    if trainers < 1:
        raise SystemExit("needs at least 2 processes (a server and a trainer)")
    rpc.init_rpc("ps" if rank == 0 else f"trainer{rank}", rank=rank, world_size=world)
    if rank == 0:
        t0 = time.perf_counter()
        ps_rref = rpc.RRef(ParameterServer(trainers))
        futs = [rpc.rpc_async(f"trainer{t + 1}", run_trainer, args=(rpc_mod, ps_rref, t, trainers))
                for t in range(trainers)]
        losses = [f.wait() for f in futs]
        took = time.perf_counter() - t0
        got = ps_rref.local_value().get_model()
        want = train_locally(trainers)
        diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
        print(f"[{rpc_mod}] {trainers} trainers, {STEPS} steps in {took:.2f} s; "
              f"final losses {[round(v, 4) for v in losses]}; "
              f"max |distributed - local| = {diff:.2e}", flush=True)
        if diff > 1e-5:
            raise SystemExit("parameters differ from local training")
    rpc.shutdown()


if __name__ == "__main__":
    main()
