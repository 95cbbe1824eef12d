"""Bagua's gradient all-reduce (flat and hierarchical) on a CUDA model: the
buckets hold CUDA gradients, staged through host memory, and the weights after
training equal the plain-torch reference of Bagua's semantics computed on the
CPU (``_bagua_reference``: every rank simulates every replica). Two ranks,
one GPU each where there are two, both on one GPU otherwise (no NCCL is
involved). Skipped without CUDA; ``.ci/gpu`` runs it.

``bagua_job`` also runs with ``device="cpu"``, which is how it was checked on
a machine with no GPU."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from _bagua_reference import Net, centralized, close, data

from conftest import free_port, launch

pytestmark = pytest.mark.cuda

WORLD = 2
STEPS = 6


def _mean(buckets: list[torch.Tensor]) -> torch.Tensor:
    return sum(buckets[1:], buckets[0].clone()) / len(buckets)


def bagua_job(rank: int, world: int, port: int, device: str) -> dict[str, Any]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    import ringlet.bagua.compat as bagua
    from ringlet.bagua.compat.algorithms import gradient_allreduce

    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    bagua.init_process_group()
    ref = centralized(world, STEPS, _mean)
    out: dict[str, Any] = {}
    for hier in (False, True):
        torch.manual_seed(rank)  # wrapping broadcasts rank 0's weights
        model = Net().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model = model.with_bagua(
            [opt], gradient_allreduce.GradientAllReduceAlgorithm(hierarchical=hier)
        )
        for step in range(STEPS):
            x, y = data(rank, step)
            opt.zero_grad()
            F.mse_loss(model(x.to(device)), y.to(device)).backward()
            opt.step()
        weights = [p.detach().cpu() for p in model.parameters()]
        out[f"devices hierarchical={hier}"] = sorted({p.device.type for p in model.parameters()})
        # GPU and CPU kernels round differently: a tolerance above float32's noise
        close(weights, ref, atol=1e-4, what=f"gradient_allreduce(hierarchical={hier})")
        out[f"first hierarchical={hier}"] = weights[0].flatten()[:4].tolist()
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is unavailable")
def test_bagua_gradient_allreduce_on_cuda_buckets() -> None:
    out = launch(WORLD, bagua_job, free_port(), "cuda", init=False, timeout=180,
                 env={"OMP_NUM_THREADS": "1"})
    for rank in range(WORLD):
        for hier in (False, True):
            assert out[rank][f"devices hierarchical={hier}"] == ["cuda"], out[rank]
            assert out[rank][f"first hierarchical={hier}"] == out[0][f"first hierarchical={hier}"]
