"""Data-parallel training of a small MLP with ringlet, on local processes.

Each rank trains on its own shard of a synthetic regression problem; after
every backward pass `ringlet.optimizer_step` averages the gradients across
ranks (one coalesced all-reduce) and steps the optimizer. Rank 0 prints the
loss and the communication throughput.

Run:
  torchrun --nproc_per_node 2 examples/train_ddp.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

import ringlet


def main(steps: int = 60, batch: int = 64) -> None:
    ringlet.init()
    rank, world = ringlet.get_ordinal(), ringlet.world_size()
    torch.manual_seed(0)  # same initial weights everywhere...
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 1))
    ringlet.broadcast_master_param(model)  # ...and made sure of it
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    true_w = torch.randn(32, 1)
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    comm_time = 0.0
    for step in range(steps):
        x = torch.randn(batch, 32, generator=data)
        y = x @ true_w + 0.01 * torch.randn(batch, 1, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        t0 = time.perf_counter()
        ringlet.reduce_gradients(optimizer)
        comm_time += time.perf_counter() - t0
        optimizer.step()
        mean_loss = ringlet.mesh_reduce("loss", loss.item(), lambda v: sum(v) / len(v))
        if step % 10 == 0 or step == steps - 1:
            ringlet.master_print(f"step {step:3d}  loss {mean_loss:.4f}")
    rate = grad_bytes * steps / comm_time / 1e9
    ringlet.master_print(
        f"world {world} over {ringlet.transport()}: all-reduced {grad_bytes / 1e6:.2f} MB of "
        f"gradients per step, {comm_time / steps * 1e3:.2f} ms per step ({rate:.2f} GB/s)"
    )
    # every rank ends with identical weights
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = ringlet.all_gather(flat.reshape(1, -1))
    assert torch.equal(copies, flat.expand_as(copies)), "replicas diverged"
    ringlet.shutdown()


if __name__ == "__main__":
    main()
