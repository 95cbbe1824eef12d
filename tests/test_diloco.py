"""ringlet.algorithms' DiLoCo, Streaming DiLoCo and LocalSGD on real
processes, against a plain-torch simulation of every replica under torchft's
semantics (``torchft/local_sgd.py``, 0.2.0): every rank simulates all the
replicas and compares its own weights with its replica's."""

from __future__ import annotations

import os
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import free_port, launch

WORLD = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def fragments(net: Net, n: int) -> list[nn.Module]:
    return [net] if n == 1 else [net.a, net.b]


def outers_for(net: Net, n: int, per_fragment: bool, lr: float = 0.7,
               momentum: float = 0.9) -> Any:
    def sgd(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    if per_fragment:
        return [sgd(m.parameters()) for m in fragments(net, n)]
    return sgd(net.parameters())


def simulate(world: int, steps: int, sync_every: int, n_frag: int, delay: int, alpha: float,
             per_fragment: bool, lr: float = 0.7, momentum: float = 0.9,
             split: Any = None) -> list[Net]:
    """Every replica under torchft's DiLoCo semantics, averaged exactly
    (``split(net)``: its fragments as lists of parameters, default
    ``fragments``)."""
    nets = [make_net() for _ in range(world)]
    inners = [torch.optim.AdamW(n.parameters(), lr=1e-2) for n in nets]
    split = split or (lambda n: [list(f.parameters()) for f in fragments(n, n_frag)])
    frags = [[_Params(ps) for ps in split(n)] for n in nets]
    if per_fragment:
        outers = [[torch.optim.SGD(f.parameters(), lr=lr, momentum=momentum,
                                   nesterov=momentum > 0) for f in fr] for fr in frags]
    else:
        outers = [outers_for(n, n_frag, False, lr, momentum) for n in nets]
    original = [[[p.detach().clone() for p in f.parameters()] for f in fr] for fr in frags]
    s = sync_every // n_frag
    local_step, syncs = 0, 0
    pending: Optional[list[torch.Tensor]] = None
    for step in range(steps):
        for r in range(world):
            x, y = data(r, step)
            F.mse_loss(nets[r](x), y).backward()
            inners[r].step()
        local_step += 1
        k = syncs % n_frag
        with torch.no_grad():
            if local_step == s - delay:
                pgs = [[o - p for o, p in zip(original[r][k], frags[r][k].parameters())]
                       for r in range(world)]
                pending = [sum(pg[i] for pg in pgs) / world for i in range(len(pgs[0]))]
            if local_step == s:
                assert pending is not None
                for r in range(world):
                    params = list(frags[r][k].parameters())
                    local = [p.detach().clone() for p in params]
                    for p, o, g in zip(params, original[r][k], pending):
                        p.copy_(o)
                        p.grad = g.clone()
                    outer = outers[r][k] if per_fragment else outers[r]
                    outer.step()
                    original[r][k] = [p.detach().clone() for p in params]
                    for p, lp in zip(params, local):
                        p.lerp_(lp, alpha)
                    outer.zero_grad()
                syncs += 1
                local_step = 0
        for r in range(world):
            inners[r].zero_grad()
    return nets


class _Params:
    """A fragment of the simulation: a list of parameters."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params

    def parameters(self) -> list[torch.Tensor]:
        return self.params


def simulate_local_sgd(world: int, steps: int, sync_every: int) -> list[Net]:
    nets = [make_net() for _ in range(world)]
    opts = [torch.optim.SGD(n.parameters(), lr=0.05) for n in nets]
    for step in range(steps):
        for r in range(world):
            x, y = data(r, step)
            F.mse_loss(nets[r](x), y).backward()
            opts[r].step()
            opts[r].zero_grad()
        if (step + 1) % sync_every == 0:
            with torch.no_grad():
                mean = [sum(ps) / world for ps in zip(*(n.parameters() for n in nets))]
                for n in nets:
                    for p, m in zip(n.parameters(), mean):
                        p.copy_(m)
    return nets


def _flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def _train(net: Net, inner: torch.optim.Optimizer, rank: int, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        x, y = data(rank, step)
        F.mse_loss(net(x), y).backward()
        inner.step()
        inner.zero_grad()


def _gather(t: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    import torch.distributed as dist

    n = dist.get_world_size(group)
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t, group=group)
    return out


SCENARIOS = [
    # name, steps, sync_every, fragments, delay, alpha, per-fragment outer optimizers
    ("one fragment", 9, 3, 1, 0, 0.0, False),
    ("average started early", 10, 4, 1, 2, 0.0, False),
    ("two fragments in turn", 8, 4, 2, 0, 0.0, True),
    ("two fragments, one outer optimizer", 8, 4, 2, 0, 0.0, False),
    ("delay with alpha 0.5", 12, 6, 2, 1, 0.5, True),
]


def diloco_job(rank: int, world: int, port: int) -> dict[str, Any]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    import ringlet  # noqa: F401  (registers the backend)
    from ringlet.algorithms import DiLoCo, LocalSGD
    from ringlet.errors import CollectiveMismatchError

    dist.init_process_group("ringlet", rank=rank, world_size=world)
    report: dict[str, Any] = {}

    # Against the simulation, on the default ringlet group.
    for name, steps, every, n_frag, delay, alpha, per in SCENARIOS:
        net = make_net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        with DiLoCo(fragments(net, n_frag), inner, outers_for(net, n_frag, per), every,
                    fragment_sync_delay=delay, fragment_update_alpha=alpha) as d:
            _train(net, inner, rank, 0, steps)
        d.close()
        ref = simulate(world, steps, every, n_frag, delay, alpha, per)[rank]
        err = (_flat(net) - _flat(ref)).abs().max().item()
        assert err < 1e-5, f"{name}: rank {rank} weights differ from the simulation by {err}"
        report[name] = err

    # LocalSGD, on a gloo subgroup of every rank (any process group works).
    gloo = dist.new_group(backend="gloo")
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with LocalSGD(net, opt, 3, group=gloo) as ls:
        for step in range(7):
            x, y = data(rank, step)
            F.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
    ls.close()
    ref = simulate_local_sgd(world, 7, 3)[rank]
    err = (_flat(net) - _flat(ref)).abs().max().item()
    assert err < 1e-5, f"LocalSGD: rank {rank} differs from the simulation by {err}"

    # A subgroup of two replicas: the others do not take part.
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        net = make_net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        with DiLoCo([net], inner, outers_for(net, 1, False), 2, group=pair) as d:
            _train(net, inner, rank, 0, 4)
        d.close()
        ref = simulate(2, 4, 2, 1, 0, 0.0, False)[rank]
        err = (_flat(net) - _flat(ref)).abs().max().item()
        assert err < 1e-5, f"subgroup: rank {rank} differs by {err}"

    # Quantized averages (across "hosts": flat, so every exchange is
    # quantized): every rank bit-equal, the average within the codec's bound.
    for quant, levels in (("int8", 255.0), ("int4", 15.0)):
        net = make_net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        outer = torch.optim.SGD(net.parameters(), lr=1.0)  # new = global - average
        with DiLoCo([net], inner, outer, 3, quantization=quant, hierarchical=False,
                    fragment_sync_delay=1) as d:
            start = _flat(net).clone()
            _train(net, inner, rank, 0, 2)  # the average starts after the 2nd step
            pseudo = start - _flat(net)
            _train(net, inner, rank, 2, 1)  # and is used after the 3rd
        d.close()
        got = start - _flat(net)
        everyone = _gather(pseudo)
        exact = sum(everyone) / world
        bound = 0.5 * max((p.max() - p.min()).item() for p in everyone) / levels
        bound += 0.5 * (exact.max() - exact.min()).item() / levels
        err = (got - exact).abs().max().item()
        assert err <= bound * 1.02 + 1e-6, f"{quant}: average off by {err} > bound {bound}"
        weights = _gather(_flat(net))
        assert all(torch.equal(w, weights[0]) for w in weights), f"{quant}: ranks differ"
        report[quant] = (err, bound)

    # should_quantize=True is 8-bit, with error feedback as an option.
    net = make_net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    with DiLoCo([net], inner, outers_for(net, 1, False), 2, should_quantize=True,
                error_feedback=True, hierarchical=False) as d:
        assert d.quantization == "int8"
        _train(net, inner, rank, 0, 6)
    d.close()
    weights = _gather(_flat(net))
    assert all(torch.equal(w, weights[0]) for w in weights), "error feedback: ranks differ"

    # A replica that starts elsewhere (joins) takes the first rank's global copy.
    net = make_net(seed=1 if rank == 2 else 0)
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    d = DiLoCo([net], inner, outers_for(net, 1, False), 2)
    assert torch.equal(_flat(net), _flat(make_net())), "the joining replica was not updated"
    d.close()

    # Checkpoint and resume in the middle of a sync cycle (an average in
    # flight) gives the uninterrupted run's weights.
    def run(steps: int, resume_at: Optional[int]) -> torch.Tensor:
        net = make_net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        outer = outers_for(net, 1, False)
        d = DiLoCo([net], inner, outer, 4, fragment_sync_delay=2)
        with d:
            if resume_at is None:
                _train(net, inner, rank, 0, steps)
            else:
                _train(net, inner, rank, 0, resume_at)
                saved = {"model": {k: v.clone() for k, v in net.state_dict().items()},
                         "inner": inner.state_dict(), "diloco": d.state_dict()}
                saved = torch.load(_roundtrip(saved, rank), weights_only=False)
        d.close()
        if resume_at is None:
            return _flat(net)
        net = make_net(seed=5)
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        outer = outers_for(net, 1, False)
        d = DiLoCo([net], inner, outer, 4, fragment_sync_delay=2)
        net.load_state_dict(saved["model"])
        inner.load_state_dict(saved["inner"])
        d.load_state_dict(saved["diloco"])
        with d:
            _train(net, inner, rank, resume_at, steps - resume_at)
        d.close()
        return _flat(net)

    whole = run(9, None)
    resumed = run(9, 3)
    assert torch.equal(whole, resumed), \
        f"resume: differs by {(whole - resumed).abs().max().item()}"

    # After a restart, a replica without a checkpoint (a new host) takes the
    # global copy, outer optimizer state and schedule of the first replica
    # that resumed, before its first inner step.
    net = make_net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    d = DiLoCo([net], inner, outers_for(net, 1, False), 4, fragment_sync_delay=1)
    with d:
        _train(net, inner, rank, 0, 7)  # one sync, the next average in flight
        saved = torch.load(_roundtrip({"model": net.state_dict(), "inner": inner.state_dict(),
                                       "diloco": d.state_dict()}, rank), weights_only=False)
    d.close()
    net = make_net(seed=7)
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    outer = outers_for(net, 1, False)
    d = DiLoCo([net], inner, outer, 4, fragment_sync_delay=1)
    if rank != 3:
        net.load_state_dict(saved["model"])
        inner.load_state_dict(saved["inner"])
        d.load_state_dict(saved["diloco"])
    glob = d._fragments[0].buckets[0].glob
    with d:
        d._step_pre_hook(inner, (), {})  # what the first inner step runs first
        if rank == 3:
            assert torch.equal(_flat(net), glob), "the joiner does not start from the global copy"
        states = _gather(torch.cat([glob, *(s["momentum_buffer"].reshape(-1)
                                            for s in outer.state_dict()["state"].values())]))
        assert all(torch.equal(s, states[0]) for s in states), "joiner's state differs"
        assert d._syncs == 1 and d._local_step == 3, (d._syncs, d._local_step)
        _train(net, inner, rank, 7, 5)  # the pending sync, then another
    weights = _gather(d._fragments[0].buckets[0].glob.clone())
    assert all(torch.equal(w, weights[0]) for w in weights), "global copies differ"
    d.close()

    # Mismatched arguments across ranks: an error naming the ranks, on every rank.
    net = make_net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    try:
        DiLoCo([net], inner, outers_for(net, 1, False), 6 if rank == 3 else 4)
    except CollectiveMismatchError as e:
        assert "[0, 1, 2]" in str(e) and "[3]" in str(e) and "sync_every" in str(e), str(e)
        report["mismatch"] = str(e)
    else:
        raise AssertionError("mismatched sync_every was not refused")
    dist.destroy_process_group()
    return report


def _roundtrip(obj: Any, rank: int) -> Any:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_diloco_against_simulation_quantized_join_resume_and_mismatch() -> None:
    out = launch(WORLD, diloco_job, free_port(), init=False, timeout=300,
                 env={"OMP_NUM_THREADS": "1"})
    assert set(out) == set(range(WORLD))
    assert "sync_every" in out[0]["mismatch"]


def dead_replica_job(rank: int, world: int, port: int) -> dict[str, Any]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    import ringlet  # noqa: F401
    from ringlet.algorithms import DiLoCo

    dist.init_process_group("ringlet", rank=rank, world_size=world, timeout=__import__(
        "datetime").timedelta(seconds=30))
    net = make_net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    d = DiLoCo([net], inner, outers_for(net, 1, False), 3, fragment_sync_delay=1)
    with d:
        for step in range(12):
            if rank == world - 1 and step == 5:
                os._exit(3)  # lost while the second sync's average is in flight
            x, y = data(rank, step)
            F.mse_loss(net(x), y).backward()
            inner.step()
            inner.zero_grad()
    out = {"weights": _flat(net).tolist(), "lost": d.lost_replicas, "replicas": d.replicas}
    d.close()
    return out


def test_diloco_survivors_go_on_without_a_lost_replica() -> None:
    out = launch(3, dead_replica_job, free_port(), init=False, timeout=180,
                 expect_dead=(2,), env={"OMP_NUM_THREADS": "1"})
    assert set(out) == {0, 1}
    for r in (0, 1):
        assert out[r]["lost"] == [2], out[r]["lost"]
        assert out[r]["replicas"] == [0, 1]
    assert out[0]["weights"] == out[1]["weights"]  # bit for bit


def test_argument_checks() -> None:
    from ringlet.algorithms import DiLoCo, LocalSGD

    net = make_net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    outer = outers_for(net, 2, True)
    frags = fragments(net, 2)
    with pytest.raises(ValueError, match="divisible"):
        DiLoCo(frags, inner, outer, 5)
    with pytest.raises(ValueError, match="at a time"):
        DiLoCo(frags, inner, outer, 1)
    with pytest.raises(ValueError, match="synced before"):
        DiLoCo(frags, inner, outer, 4, fragment_sync_delay=2)
    with pytest.raises(ValueError, match="between 0 and 1"):
        DiLoCo(frags, inner, outer, 4, fragment_update_alpha=1.5)
    with pytest.raises(ValueError, match="outer optimizers"):
        DiLoCo(frags, inner, outer[:1], 4)
    with pytest.raises(ValueError, match="quantization"):
        DiLoCo(frags, inner, outer, 4, quantization="int2")
    with pytest.raises(ValueError, match="error_feedback needs quantization"):
        DiLoCo(frags, inner, outer, 4, error_feedback=True)
    with pytest.raises(ValueError, match="fragment 0 and in fragment 1"):
        DiLoCo([net, net.b], inner, [outers_for(net, 1, False)] * 2, 4)
    partial = torch.optim.AdamW(net.a.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="inner optimizer does not step parameter 'weight' "
                                         "of fragment 1"):
        DiLoCo(frags, partial, outer, 4)
    with pytest.raises(ValueError, match="outer optimizer of fragment 1 does not step"):
        DiLoCo(frags, inner, [outer[0], outer[0]], 4)
    with pytest.raises(AssertionError, match="sync_every"):
        LocalSGD(net, inner, 0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        DiLoCo(frags, inner, outer, 4)


def two_level_job(rank: int, world: int, port: int) -> dict[str, Any]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    import ringlet  # noqa: F401
    from ringlet.algorithms import DiLoCo

    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    for quant, levels in (("int8", 255.0), ("int4", 15.0)):
        net = make_net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        outer = torch.optim.SGD(net.parameters(), lr=1.0)
        with DiLoCo([net], inner, outer, 3, quantization=quant, fragment_sync_delay=1) as d:
            start = _flat(net).clone()
            _train(net, inner, rank, 0, 2)
            pseudo = start - _flat(net)
            _train(net, inner, rank, 2, 1)
        d.close()
        got = start - _flat(net)
        everyone = _gather(pseudo)
        exact = sum(everyone) / world
        # Exact within a host; each host's mean quantized across hosts, then
        # the mean of the hosts' means by its owner.
        hosts = [(everyone[0] + everyone[1]) / 2, (everyone[2] + everyone[3]) / 2]
        bound = 0.5 * max((h.max() - h.min()).item() for h in hosts) / levels
        bound += 0.5 * (exact.max() - exact.min()).item() / levels
        err = (got - exact).abs().max().item()
        assert err <= bound * 1.02 + 1e-6, f"{quant}: average off by {err} > bound {bound}"
        weights = _gather(_flat(net))
        assert all(torch.equal(w, weights[0]) for w in weights), f"{quant}: ranks differ"
        out[quant] = (err, bound)

    # DiLoCo's state through torch.distributed.checkpoint (every replica holds
    # the same global copies and outer state: DCP writes them once).
    import torch.distributed.checkpoint as dcp

    net = make_net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    outer = outers_for(net, 1, False)
    with DiLoCo([net], inner, outer, 4, fragment_sync_delay=2) as d:
        _train(net, inner, rank, 0, 6)  # a sync done, the next average in flight
        state = d.state_dict()
        path = f"/tmp/ringlet-test-dcp-{port}"
        dcp.save({"diloco": state}, checkpoint_id=path)
        back = {"diloco": d.state_dict()}
        for f in back["diloco"]["fragments"]:
            for t in f["original_parameters"].values():
                t.zero_()
        dcp.load(back, checkpoint_id=path)
        for a, b in zip(state["fragments"], back["diloco"]["fragments"]):
            for k in a["original_parameters"]:
                assert torch.equal(a["original_parameters"][k], b["original_parameters"][k]), k
        d.load_state_dict(back["diloco"])
        _train(net, inner, rank, 6, 2)
    d.close()
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
    dist.destroy_process_group()
    return out


def test_diloco_two_level_quantized_across_hosts_only() -> None:
    hosts = [{"RINGLET_HOST_ID": f"host{r // 2}"} for r in range(4)]
    out = launch(4, two_level_job, free_port(), init=False, timeout=180,
                 per_rank_env=hosts, env={"OMP_NUM_THREADS": "1"})
    assert set(out) == set(range(4))
    assert 0 < out[0]["int4"][0], "the exchange across hosts was not quantized"


def bagua_job(rank: int, world: int, port: int) -> dict[str, Any]:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    import ringlet.bagua.compat as bagua
    from ringlet.bagua.algorithms import Algorithm
    from ringlet.bagua.algorithms.diloco import DiLoCoAlgorithm

    bagua.init_process_group()
    out: dict[str, Any] = {}
    # One fragment, and two (Streaming DiLoCo: Net's a.* then b.*, by size).
    for frags, every, delay, per in ((1, 3, 0, False), (2, 4, 1, True)):
        net = make_net()
        inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
        algo = (DiLoCoAlgorithm(every, fragment_sync_delay=delay) if frags == 1 else
                Algorithm.init("diloco", sync_every=every, fragments=2,
                               fragment_sync_delay=delay))
        model = net.with_bagua([inner], algo)
        for step in range(8):
            x, y = data(rank, step)
            F.mse_loss(model(x), y).backward()
            inner.step()
            inner.zero_grad()
        # The door cuts the parameters where a fragment's share of the
        # elements (212 / 2) begins: a.weight (128) alone, then the rest.
        def split(n: Net, frags: int = frags) -> list[list[torch.Tensor]]:
            ps = list(n.parameters())
            return [ps] if frags == 1 else [ps[:1], ps[1:]]

        ref = simulate(world, 8, every, frags, delay, 0.0, per, split=split)[rank]
        err = (_flat(net) - _flat(ref)).abs().max().item()
        assert err < 1e-5, f"Bagua door, {frags} fragment(s): differs by {err}"
        out[frags] = err
    return out


def test_diloco_through_baguas_door() -> None:
    out = launch(2, bagua_job, free_port(), init=False, timeout=180,
                 env={"OMP_NUM_THREADS": "1"})
    assert set(out) == {0, 1}
