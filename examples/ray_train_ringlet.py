"""Ray Train's TorchTrainer on ringlet's process group (CPU workers).

Ray Train creates the process group in each worker from its ``TorchConfig``;
``TorchConfig(backend="ringlet")`` is the whole change. ringlet must be
installed where the workers run: its ``torch.backends`` entry point registers
the backend when a worker imports torch, so the training loop needs no
``import ringlet``. See ``docs/recipes/ray-train.md``.

Needs ``pip install "ray[train]"`` (not a ringlet dependency; CI does not run
this file). Run (one machine, a local Ray cluster of 2 CPUs; ``gloo`` as the
argument trains the same model on gloo, with the same weights at the end):
  python examples/ray_train_ringlet.py [ringlet|gloo]
"""

from __future__ import annotations

import sys
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.train import ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer, prepare_model


def train_loop(config: dict[str, Any]) -> None:
    """Runs in every Ray worker, inside the process group Ray made."""
    torch.manual_seed(0)  # same initial weights everywhere
    model = prepare_model(torch.nn.Linear(8, 1))  # torch's DDP over the group
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1 + dist.get_rank())  # each worker its own data
    for _ in range(config["steps"]):
        opt.zero_grad()
        x, y = torch.randn(8, 8, generator=data), torch.randn(8, 1, generator=data)
        torch.nn.functional.mse_loss(model(x), y).backward()  # all_reduce on the group
        opt.step()
    if dist.get_rank() == 0:
        params = torch.cat([p.detach().flatten() for p in model.parameters()])
        print(f"backend {dist.get_backend()}: parameters {params.tolist()}", flush=True)


def main(backend: str = "ringlet", workers: int = 2) -> None:
    ray.init(num_cpus=workers, include_dashboard=False)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"steps": 5},
        torch_config=TorchConfig(backend=backend),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
    )
    trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:2])
