"""A mixed ``cpu:ringlet,cuda:nccl`` group (the native C++ Backend beside
NCCL in one torch ProcessGroup): CPU tensors go to ringlet's Backend, CUDA
tensors to NCCL's, and both all-reduces give the sum computed here. Needs
CUDA, NCCL and the native Backend (skipped otherwise; ``.ci/gpu`` runs it on
a GPU machine). With one GPU the group has one rank (NCCL refuses two ranks
on one device); with two or more, two ranks, one GPU each.

``_mixed_job`` also runs without CUDA on a ``cpu:ringlet,cuda:gloo`` group
(its CPU half), which is how it was checked on a machine with no GPU."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from conftest import free_port, launch

pytestmark = pytest.mark.cuda


def _mixed_job(rank: int, world: int, port: int, spec: str, cuda: bool) -> dict[str, Any]:
    import ringlet  # noqa: F401  (registers the backend)
    from ringlet.distributed import backend_kind

    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        spec, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=60),
    )
    pg = dist.group.WORLD
    cpu_backend = pg._get_backend(torch.device("cpu"))
    out: dict[str, Any] = {
        "kind": backend_kind(),
        "backend": dist.get_backend(),
        "cpu": (type(cpu_backend).__name__, cpu_backend.name()),
    }
    x = torch.arange(6.0) * (rank + 1)
    dist.all_reduce(x)
    out["cpu_sum"] = x.tolist()
    if cuda:
        cuda_backend = pg._get_backend(torch.device("cuda"))
        out["cuda"] = (type(cuda_backend).__name__, cuda_backend.name())
        y = torch.arange(6.0, device="cuda") * (rank + 1)
        dist.all_reduce(y)
        torch.cuda.synchronize()
        out["cuda_sum"] = (y.device.type, y.cpu().tolist())
    dist.destroy_process_group()
    return out


def _expected_sum(world: int) -> list[float]:
    return [float(i * sum(r + 1 for r in range(world))) for i in range(6)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is unavailable")
def test_mixed_cpu_ringlet_cuda_nccl_group() -> None:
    from ringlet.distributed import _native

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    if _native.load() is None:
        pytest.skip(f"the native backend is not available here: {_native.reason()}")
    world = 2 if torch.cuda.device_count() >= 2 else 1
    spec = "cpu:ringlet,cuda:nccl"
    out = launch(world, _mixed_job, free_port(), spec, True, init=False, timeout=180)
    for r in range(world):
        o = out[r]
        assert o["kind"] == "native", o
        assert o["backend"] == spec, o
        assert o["cpu"] == ("RingletBackend", "ringlet"), o
        assert o["cuda"] == ("ProcessGroupNCCL", "nccl"), o
        assert o["cpu_sum"] == _expected_sum(world), o
        assert o["cuda_sum"] == ("cuda", _expected_sum(world)), o
