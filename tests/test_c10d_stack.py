"""torch's own stack on the "ringlet" backend, checked against the same
program on gloo in the same processes: torch DDP (its options), FSDP2, DTensor
on 1-D and 2-D meshes, tensor parallelism, functional collectives (eager and
compiled) and torch.distributed.checkpoint of an FSDP2 model."""

from __future__ import annotations

import os
import subprocess
import sys
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


def _init(backend: str, rank: int, world: int, port: int) -> None:
    import ringlet  # noqa: F401  (registers the backend)

    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=90),
    )


def _stack_job(rank: int, world: int, port: int, tmp: str) -> dict[str, list]:
    results: dict[str, dict[str, list[torch.Tensor]]] = {}
    for backend in ("ringlet", "gloo"):
        _init(backend, rank, world, port)
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


# Deeper: uneven DTensor placements and redistributions on 1-D and 2-D meshes,
# sequence parallelism, FSDP2's options and HSDP, DCP across shardings and
# groups, DDP's uneven inputs and options, the autograd-aware collectives.


def _uneven_model(seed: int = 0) -> torch.nn.Sequential:
    # dim 0 of every weight (7, 13, 3) is not divisible by 2 or 4
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.ReLU(), torch.nn.Linear(7, 13),
                               torch.nn.ReLU(), torch.nn.Linear(13, 3))


def _x10(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 10, generator=torch.Generator().manual_seed(100 * step + rank))


def _sharded(seed: int = 0, **kw: object) -> torch.nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    model = _uneven_model(seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kw)  # type: ignore[arg-type]
    fully_shard(model, **kw)  # type: ignore[arg-type]
    return model


def _full(ps: object) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for p in ps]  # type: ignore[attr-defined]


def _dtensor_deep(rank: int, world: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    out: list[torch.Tensor] = []
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(5))
    kinds = [Replicate(), Shard(0), Shard(1)]
    for a in kinds:
        for b in kinds:  # Shard(0) -> Shard(1) is an all-to-all, uneven
            d = distribute_tensor(full, mesh, [a]).redistribute(mesh, [b])
            out += [d.to_local().clone(), d.full_tensor()]
        # Partial -> Replicate / Shard: all_reduce / reduce_scatter, uneven
        p = DTensor.from_local(full * (rank + 1), mesh, [Partial()]).redistribute(mesh, [a])
        out.append(p.to_local().clone())
        p = DTensor.from_local(full * (rank + 1), mesh, [Partial("avg")]).redistribute(mesh, [a])
        out.append(p.to_local().clone())
    d = distribute_tensor(full, mesh, [Shard(0)])
    e = DTensor.from_local(d.to_local(), mesh, [Shard(0)], run_check=True, shape=d.shape,
                           stride=d.stride())
    assert e.shape == full.shape and e.stride() == full.stride()
    d1 = distribute_tensor(full, mesh, [Shard(1)])
    w = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    mixed = d1 @ distribute_tensor(w, mesh, [Shard(0)])
    assert mixed.placements == (Partial(),)
    out += [e.full_tensor(), d.sum(0).full_tensor(), d.sum(1).full_tensor(),
            d.sum().full_tensor().reshape(1), mixed.full_tensor(),
            (d @ distribute_tensor(w, mesh, [Shard(1)])).full_tensor()]
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    target = torch.tensor([0, 3, 7, 1, 2, 5])
    dl = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        loss = torch.nn.functional.cross_entropy(dl, target)
        loss.backward()
    ref = logits.clone().requires_grad_()
    torch.nn.functional.cross_entropy(ref, target).backward()
    torch.testing.assert_close(dl.grad.full_tensor(), ref.grad)
    out += [loss.full_tensor().reshape(1), dl.grad.full_tensor()]
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    flat = mesh2["dp", "tp"]._flatten("dp_tp")
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t, group=flat.get_group())
    ranks = dist.get_process_group_ranks(mesh2.get_group("dp"))
    out += [t, torch.tensor([mesh2["dp"].get_local_rank(), mesh2.get_local_rank("tp"),
                             mesh2["tp"].size(), *ranks])]
    for a in kinds:
        for b in kinds:
            d2 = distribute_tensor(full, mesh2, [a, b])
            out.append(d2.to_local().clone())
            for target2 in ([Replicate(), Shard(0)], [Shard(1), Shard(0)], [Shard(0), Shard(1)]):
                out.append(d2.redistribute(mesh2, target2).to_local().clone())
    pp = DTensor.from_local(full * (rank + 1), mesh2, [Partial(), Partial()])
    out += [pp.redistribute(mesh2, [Shard(0), Shard(1)]).to_local().clone(),
            pp.full_tensor()]
    return out


def _sequence_parallel(rank: int, world: int) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 12)
            self.norm = torch.nn.LayerNorm(12)
            self.w1 = torch.nn.Linear(12, 20)
            self.w2 = torch.nn.Linear(20, 12)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            return self.w2(torch.relu(self.w1(self.norm(x)))) + x

    mesh = init_device_mesh("cpu", (world,))
    ids = torch.randint(0, 10, (2, 8), generator=torch.Generator().manual_seed(1))
    out = []
    for sequence in (True, False):
        torch.manual_seed(0)
        ref = Block()
        model = Block()
        model.load_state_dict(ref.state_dict())
        plan: dict[str, object]
        if sequence:  # activations sharded along the sequence between the layers
            plan = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                    "norm": SequenceParallel(), "w1": ColwiseParallel(input_layouts=Shard(1)),
                    "w2": RowwiseParallel(output_layouts=Shard(1))}
        else:
            plan = {"": PrepareModuleInput(input_layouts=(Replicate(),),
                                           desired_input_layouts=(Replicate(),)),
                    "emb": RowwiseParallel(input_layouts=Replicate()),
                    "w1": ColwiseParallel(), "w2": RowwiseParallel()}
        parallelize_module(model, mesh, plan)  # type: ignore[arg-type]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            ref_opt.zero_grad()
            y = model(ids)  # this rank's part of the sequence when sequence-parallel
            (y.square().sum() / (2 * 8 * 12)).backward()
            ref(ids).square().mean().backward()
            opt.step()
            ref_opt.step()
        got = _full(p.grad for p in model.parameters()) + _full(model.parameters())
        want = [p.grad for p in ref.parameters()] + list(ref.parameters())
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-5)
        out += got
    return out


def _train10(model: torch.nn.Module, rank: int, steps: int = 2,
             accumulate: bool = False) -> list[torch.Tensor]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        if accumulate:  # a micro-batch without reduce-scatter first
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
            model(_x10(rank, 50 + step)).square().mean().backward()
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
        loss = model(_x10(rank, step)).float().square().mean()
        loss.backward()
        losses.append(loss.detach().reshape(1))
        opt.step()
    return losses + _full(model.parameters())


def _fsdp_deep(rank: int, world: int) -> list[torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    out: list[torch.Tensor] = []
    for reshard in (False, 2):
        out += _train10(_sharded(reshard_after_forward=reshard), rank)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out += _train10(_sharded(mp_policy=mp), rank)
    out += _train10(_sharded(offload_policy=CPUOffloadPolicy(pin_memory=False)), rank)
    out += _train10(_sharded(), rank, accumulate=True)
    hsdp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    out += _train10(_sharded(mesh=hsdp), rank, accumulate=True)
    model = _sharded()
    _train10(model, rank, steps=1)
    fresh = _sharded(seed=3)
    fresh.load_state_dict(model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(_full(model.parameters()),
                                                  _full(fresh.parameters())))
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    assert (len(full) == 6) == (rank == 0), len(full)  # cpu_offload: rank 0 only
    return out + list(full.values())


def _dcp_deep(rank: int, world: int, path: str) -> list[torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemWriter
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    out: list[torch.Tensor] = []
    # FSDP2 saved (one file for all ranks' shards), read into a plain model
    model = _sharded()
    dcp.save(get_model_state_dict(model), planner=None,
             storage_writer=FileSystemWriter(path + "-one", single_file_per_rank=False))
    plain = _uneven_model(seed=5)
    sd = plain.state_dict()
    dcp.load(sd, checkpoint_id=path + "-one", planner=DefaultLoadPlanner())
    plain.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(_full(model.parameters()), plain.parameters()))
    out += _full(plain.parameters())
    # FSDP1's sharded state dict (ShardedTensors, none local on some ranks
    # for the 3-element bias) saved and loaded
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    def fsdp1(seed: int) -> FSDP:
        return FSDP(_uneven_model(seed), auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                    device_id=torch.device("cpu"))

    saved = fsdp1(0)
    with FSDP.state_dict_type(saved, StateDictType.SHARDED_STATE_DICT):
        dcp.save(saved.state_dict(), checkpoint_id=path + "-fsdp1")
    loaded = fsdp1(4)
    with FSDP.state_dict_type(loaded, StateDictType.SHARDED_STATE_DICT):
        sd = loaded.state_dict()
        dcp.load(sd, checkpoint_id=path + "-fsdp1")
        loaded.load_state_dict(sd)
    with FSDP.summon_full_params(loaded):
        out += _full(loaded.parameters())
    # saved and loaded by a subgroup whose coordinator is not global rank 0
    sub = dist.new_group([1, 3])
    if rank in (1, 3):
        save(_uneven_model(seed=7).state_dict(), checkpoint_id=path + "-sub", process_group=sub)
        sd = _uneven_model(seed=8).state_dict()
        load(sd, checkpoint_id=path + "-sub", process_group=sub)
        out += list(sd.values())
    dist.barrier()
    # Adam's state saved and loaded: training resumes identically
    def step(m: torch.nn.Module, opt: torch.optim.Optimizer, s: int) -> torch.Tensor:
        opt.zero_grad()
        loss = m(_x10(rank, s)).square().mean()
        loss.backward()
        opt.step()
        return loss.detach().reshape(1)

    model = _sharded()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for s in range(2):
        step(model, opt, s)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path + "-adam")
    went_on = [step(model, opt, s) for s in (2, 3)] + _full(model.parameters())
    again = _sharded(seed=11)
    opt2 = torch.optim.Adam(again.parameters(), lr=1e-2)
    msd, osd = get_state_dict(again, opt2)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path + "-adam")
    set_state_dict(again, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = [step(again, opt2, s) for s in (2, 3)] + _full(again.parameters())
    assert all(torch.equal(a, b) for a, b in zip(went_on, resumed))
    return out + went_on


class _Branch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)
        self.c = torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, branch: bool = True) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.c(self.b(h) if branch else h)


def _x6(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(1000 * step + rank))


def _ddp_deep(rank: int, world: int, backend: str) -> list[torch.Tensor]:
    import warnings

    from torch.distributed.algorithms.join import Join
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    out: list[torch.Tensor] = []
    torch.manual_seed(0)
    model = DDP(_Branch())
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    with Join([model, zero]):  # uneven inputs: rank r has 2 + r batches
        for s in range(2 + rank):
            zero.zero_grad()
            model(_x6(rank, s)).square().mean().backward()
            zero.step()
    out += _full(model.parameters())
    for kw in ({"find_unused_parameters": True}, {"static_graph": True},
               {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0001}):
        torch.manual_seed(rank)  # DDP starts from rank 0's parameters
        model = DDP(_Branch(), **kw)  # type: ignore[arg-type]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for s in range(4):
            opt.zero_grad()
            branch = not (kw.get("find_unused_parameters") and s % 2)  # b unused then
            if s == 2:
                with model.no_sync():
                    model(_x6(rank, 77), branch).square().mean().backward()
            model(_x6(rank, s), branch).square().mean().backward()
            out += [torch.zeros(0) if p.grad is None else p.grad.clone()
                    for p in model.parameters()]
            opt.step()
        out += _full(model.parameters())
    # sparse gradients (an all_reduce of sparse tensors), without warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True),
                                        torch.nn.Linear(4, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for s in range(2):
            opt.zero_grad()
            ids = torch.randint(0, 20, (6,), generator=torch.Generator().manual_seed(10 * rank + s))
            model(ids).square().mean().backward()
            opt.step()
    sparse_warnings = [str(w.message) for w in caught if "Sparse invariant" in str(w.message)]
    assert not sparse_warnings, sparse_warnings
    out += _full(model.parameters())
    if backend == "ringlet":  # ZeRO's step overlapped with DDP (gloo refuses it)
        from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def train(overlap: bool) -> list[torch.Tensor]:
            torch.manual_seed(0)
            model = DDP(_Branch(), bucket_cap_mb=0.0001)
            if overlap:
                opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(
                    model.parameters(), optimizer_class=torch.optim.SGD, overlap_with_ddp=True,
                    lr=0.1)
                model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, opt))
            else:
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for s in range(4):
                model(_x6(rank, s)).square().mean().backward()
                if overlap or s >= 2:  # the overlapped optimizer starts at step 2
                    opt.step()
                for p in model.parameters():
                    p.grad = None
            return _full(model.parameters())

        for a, b in zip(train(True), train(False)):
            torch.testing.assert_close(a, b)
    return out


def _autograd_collectives(rank: int, world: int) -> list[torch.Tensor]:
    import torch.distributed.nn.functional as F

    group = dist.group.WORLD  # F's default group is bound once, at import
    out = []
    x = (torch.arange(6.0).view(2, 3) + rank).requires_grad_()
    y = F.all_reduce(x * (rank + 1), group=group)
    (y * torch.arange(6.0).view(2, 3)).sum().backward()
    out += [y.detach(), x.grad]
    x = (torch.arange(6.0).view(2, 3) + rank).requires_grad_()
    ys = F.all_gather(x * (rank + 1), group=group)
    sum((t * (i + 1)).sum() for i, t in enumerate(ys)).backward()
    out += [torch.stack(ys).detach(), x.grad]
    parts = [torch.full((2, 3), float(i + rank)).requires_grad_() for i in range(world)]
    y = F.reduce_scatter(torch.empty(2, 3), [p * 2 for p in parts], group=group)
    (y * (rank + 1)).sum().backward()
    out += [y.detach(), *(p.grad for p in parts)]
    x = (torch.arange(2.0 * world) + 10 * rank).requires_grad_()
    y = F.all_to_all_single(torch.empty(2 * world), x * 1, group=group)
    (y * torch.arange(2.0 * world)).sum().backward()
    out += [y.detach(), x.grad]
    x = (torch.arange(6.0) + rank).requires_grad_()
    y = F.broadcast(x * (rank + 1), src=1, group=group)
    (y * (rank + 1)).sum().backward()
    return [*out, y.detach(), x.grad]


def _deep_job(rank: int, world: int, ports: list, tmp: str) -> str:
    results: dict[str, dict[str, list[torch.Tensor]]] = {}
    # a free port each (port + 1 may be another socket's: an ephemeral source port)
    for backend, port in zip(("ringlet", "gloo"), ports):
        _init(backend, rank, world, port)
        r = results[backend] = {}
        r["dtensor"] = _dtensor_deep(rank, world)
        r["sequence_parallel"] = _sequence_parallel(rank, world)
        r["fsdp"] = _fsdp_deep(rank, world)
        r["dcp"] = _dcp_deep(rank, world, os.path.join(tmp, backend))
        r["ddp"] = _ddp_deep(rank, world, backend)
        r["autograd"] = _autograd_collectives(rank, world)
        dist.destroy_process_group()
    for key, ours in results["ringlet"].items():
        theirs = results["gloo"][key]
        assert len(ours) == len(theirs), key
        for i, (a, b) in enumerate(zip(ours, theirs)):
            # 4 float32 terms summed in another order: a few ulps apart
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{key}[{i}]")
    return "ok"


def test_torch_stack_deeper_on_ringlet_equals_gloo() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ports = [free_port(), free_port()]
        while ports[1] == ports[0]:
            ports[1] = free_port()
        out = launch(4, _deep_job, ports, tmp, init=False, timeout=300)
    assert set(out.values()) == {"ok"}


_SHARDED_FIX = """
import sys, torch
import ringlet.distributed.c10d as c
{before}
c._sharded_tensors_on_cpu_when_used()   # what creating a ringlet group does
assert ("torch.distributed._shard.sharded_tensor" in sys.modules) == {loaded}
import torch.distributed.checkpoint     # imports the sharded tensors
from torch.distributed._shard.sharded_tensor.api import _SHARDED_OPS
op = _SHARDED_OPS[torch.Tensor.device.__get__]
assert op.__module__ == "ringlet.distributed.c10d", op
assert c._sharded_hook is None and c._sharded_hook not in sys.meta_path
print("ok")
"""


def test_sharded_tensor_device_fix_applies_whenever_they_are_imported() -> None:
    # creating a group no longer imports torch's sharded tensors (15 ms of
    # every rank's start-up); the fix applies when they load, before or after
    for before, loaded in (("", False),
                           ("import torch.distributed._shard.sharded_tensor", True)):
        code = _SHARDED_FIX.format(before=before, loaded=loaded)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]
