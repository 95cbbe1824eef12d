"""Run under torchrun by tests/test_runtime.py: init() with no arguments,
alongside torch.distributed on the same store."""

import torch
import torch.distributed as dist

import ringlet

ringlet.init()
dist.init_process_group("gloo")
rank, world = ringlet.get_ordinal(), ringlet.world_size()
assert (rank, world) == (dist.get_rank(), dist.get_world_size())
x = torch.full((1000,), float(rank))
y = ringlet.all_reduce(ringlet.REDUCE_SUM, x)
z = x.clone()
dist.all_reduce(z)
assert torch.equal(y, z), (y, z)
dist.destroy_process_group()
ringlet.shutdown()
print(f"torchrun ok rank {rank} of {world}", flush=True)
