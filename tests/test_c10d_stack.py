"""torch's own stack on the "ringlet" backend, checked against the same
program on gloo in the same processes: torch DDP (its options), FSDP2, DTensor
on 1-D and 2-D meshes, tensor parallelism, functional collectives (eager and
compiled) and torch.distributed.checkpoint of an FSDP2 model."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from conftest import free_port, launch


class MLP(torch.nn.Module):
    def __init__(self, d: int = 16, unused: bool = False) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(d, 4 * d)
        self.l2 = torch.nn.Linear(4 * d, d)
        if unused:
            self.unused = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def _ddp(rank: int, **kw: object) -> list[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(MLP(unused=bool(kw.get("find_unused_parameters"))), **kw)  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        if step == 1:
            with model.no_sync():
                model(_batch(rank, 50)).square().mean().backward()
        model(_batch(rank, step)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _powersgd(rank: int) -> list[torch.Tensor]:
    # PowerSGD's hook issues collectives and waits for them inside future
    # callbacks: those must not run on the thread that runs the collectives.
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(MLP())
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                               start_powerSGD_iter=2, min_compression_rate=0.5)
    model.register_comm_hook(state, psgd.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        opt.zero_grad()
        model(_batch(rank, step)).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _fsdp(rank: int, world: int) -> list[torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        opt.zero_grad()
        model(_batch(rank, step)).square().mean().backward()
        opt.step()
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _dtensor(rank: int, world: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = []
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(world * 6.0).view(world * 2, 3)
    d = distribute_tensor(full, mesh, [Shard(0)])
    out.append(d.to_local().clone())
    out.append(d.redistribute(mesh, [Replicate()]).to_local().clone())
    out.append((d * 2).full_tensor().clone())
    out.append(distribute_tensor(full, mesh, [Replicate()]).redistribute(mesh, [Shard(1)])
               .full_tensor().clone())
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        d2 = distribute_tensor(full, mesh2, [Shard(0), Shard(1)])
        out.append(d2.to_local().clone())
        out.append(d2.redistribute(mesh2, [Replicate(), Shard(0)]).to_local().clone())
        out.append(d2.full_tensor().clone())
        s = d2.sum()
        out.append(s.full_tensor().reshape(1).clone())
    return out


def _tp(rank: int, world: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(MLP(), mesh, {"l1": ColwiseParallel(), "l2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _batch(0, 7)  # tensor parallelism: the same batch on every rank
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return [model.l1.weight.full_tensor().clone(), model.l2.weight.full_tensor().clone(),
            model(x).detach().clone()]


def _funcol(rank: int, world: int) -> list[torch.Tensor]:
    import torch.distributed._functional_collectives as fc

    group = dist.group.WORLD
    x = torch.arange(6.0) + rank
    out = [fc.all_reduce(x, "sum", group).wait(),
           fc.all_gather_tensor(x, 0, group).wait(),
           fc.reduce_scatter_tensor(torch.arange(6.0 * world), "sum", 0, group).wait(),
           fc.all_to_all_single(torch.arange(2.0 * world) + rank, None, None, group).wait(),
           fc.broadcast(x, 0, group).wait()]

    @torch.compile(fullgraph=True)
    def step(t: torch.Tensor) -> torch.Tensor:
        y = fc.all_reduce(t * 2, "sum", group)
        return fc.all_gather_tensor(y + 1, 0, group)

    out.append(step(x).clone())
    return out


def _dcp(rank: int, world: int, path: str) -> list[torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    torch.manual_seed(2)
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    for layer in fresh:
        fully_shard(layer)
    fully_shard(fresh)
    sd = get_model_state_dict(fresh)
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(fresh, sd)
    # The group's device types (what async_save and broadcasting a full state
    # dict from rank 0 ask for), then both of those.
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    assert torch.device("cpu") in dist.group.WORLD._device_types
    dcp.async_save(get_model_state_dict(model), checkpoint_id=path + "-async").result()
    again = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    for layer in again:
        fully_shard(layer)
    fully_shard(again)
    full = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
    set_model_state_dict(again, full if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for a, b in zip(again.parameters(), model.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())
    return [p.full_tensor().detach().clone() for p in fresh.parameters()] + [
        p.full_tensor().detach().clone() for p in model.parameters()]


def _stack_job(rank: int, world: int, port: int, tmp: str) -> dict[str, list]:
    results: dict[str, dict[str, list[torch.Tensor]]] = {}
    for backend in ("ringlet", "gloo"):
        import ringlet  # noqa: F401

        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=90),
        )
        r = results[backend] = {}
        r["ddp"] = _ddp(rank)
        r["ddp_opts"] = _ddp(rank, bucket_cap_mb=0.001, find_unused_parameters=True,
                             gradient_as_bucket_view=True)
        r["ddp_static"] = _ddp(rank, static_graph=True)
        r["powersgd"] = _powersgd(rank)
        r["fsdp"] = _fsdp(rank, world)
        r["dtensor"] = _dtensor(rank, world)
        r["tp"] = _tp(rank, world)
        r["funcol"] = _funcol(rank, world)
        r["dcp"] = _dcp(rank, world, os.path.join(tmp, backend))
        dist.destroy_process_group()
    for key, ours in results["ringlet"].items():
        theirs = results["gloo"][key]
        assert len(ours) == len(theirs), key
        for i, (a, b) in enumerate(zip(ours, theirs)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{key}[{i}]")
    # DCP round trip: the loaded model equals the saved one.
    dcp_out = results["ringlet"]["dcp"]
    half = len(dcp_out) // 2
    for a, b in zip(dcp_out[:half], dcp_out[half:]):
        assert torch.equal(a, b)
    return {k: [t.sum().item() for t in v] for k, v in results["ringlet"].items()}


def test_torch_stack_on_ringlet_equals_gloo() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = launch(2, _stack_job, free_port(), tmp, init=False, timeout=400)
    for key in ("ddp", "ddp_opts", "ddp_static", "fsdp", "tp"):  # replicated results
        assert out[0][key] == out[1][key], key


def test_torch_stack_on_ringlet_equals_gloo_2d_mesh() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = launch(4, _stack_job, free_port(), tmp, init=False, timeout=500)
    assert out[0]["fsdp"] == out[3]["fsdp"]
