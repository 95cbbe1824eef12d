"""Data-parallel training of a small MLP with ringlet, on local processes.

Each rank trains on its own shard of a synthetic regression problem; after
every backward pass `ringlet.reduce_gradients` averages the gradients across
ranks (one coalesced all-reduce) and the optimizer steps. Rank 0 prints the
falling loss, then what the all-reduce cost:

- communication alone: each step's all-reduce is timed after a barrier, so a
  rank that finished its backward first does not count its wait for the
  slower one (that wait, the barrier's time, is printed on its own line);
- the algorithm bandwidth, as nccl-tests defines it: the gradients' bytes
  divided by that time (median over the steps);
- the transport, in words (`ringlet.info.describe_transport`).

Run:
  torchrun --nproc_per_node 2 examples/train_ddp.py
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

import ringlet
from ringlet.info import describe_transport


def main(steps: int = 60, batch: int = 64) -> None:
    ringlet.init()
    rank, world = ringlet.get_ordinal(), ringlet.world_size()
    torch.manual_seed(0)  # same initial weights everywhere...
    model = nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)
    )
    ringlet.broadcast_master_param(model)  # ...and made sure of it
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    true_w = torch.randn(32, 1)
    data = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    comm, wait = [], []  # seconds per step: the all-reduce alone; the wait before it
    for step in range(steps):
        x = torch.randn(batch, 32, generator=data)
        y = x @ true_w + 0.01 * torch.randn(batch, 1, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        t0 = time.perf_counter()
        ringlet.barrier()  # waits for the slower rank: not communication time
        t1 = time.perf_counter()
        ringlet.reduce_gradients(optimizer)
        comm.append(time.perf_counter() - t1)
        wait.append(t1 - t0)
        optimizer.step()
        mean_loss = ringlet.mesh_reduce("loss", loss.item(), lambda v: sum(v) / len(v))
        if step % 10 == 0 or step == steps - 1:
            ringlet.master_print(f"step {step:3d}  loss {mean_loss:.4f}")
    median = statistics.median(comm)
    ringlet.master_print(f"world {world} over {describe_transport(ringlet.transport())}")
    ringlet.master_print(
        f"all-reduce of the gradients ({grad_bytes / 1e6:.2f} MB per step, one coalesced "
        f"call): {median * 1e3:.3f} ms per step in communication alone (median of {steps}), "
        f"algorithm bandwidth {grad_bytes / median / 1e9:.2f} GB/s (bytes / time)"
    )
    ringlet.master_print(
        f"waiting for the slower rank before it (a barrier, not counted above): "
        f"{statistics.mean(wait) * 1e3:.3f} ms per step (mean)"
    )
    # every rank ends with identical weights
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    copies = ringlet.all_gather(flat.reshape(1, -1))
    assert torch.equal(copies, flat.expand_as(copies)), "replicas diverged"
    ringlet.shutdown()


if __name__ == "__main__":
    main()
