"""Distributed autograd and the distributed optimizer on ringlet.rpc.

A model split over three workers (nested calls and fan-out) trained with
``ringlet.rpc.autograd`` + ``DistributedOptimizer`` must end with the same
parameters as the same model trained locally; two trainers sharing a
parameter server get independent contexts; unknown contexts and a worker that
dies before backward raise.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

import ringlet.rpc as rpc
import ringlet.rpc.autograd as dist_autograd
from ringlet.rpc.optim import DistributedOptimizer

from conftest import free_port, launch

STEPS = 3


def _layers() -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Linear(6, 5), torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)


def _make(i: int) -> torch.nn.Module:
    return _layers()[i]


def _param_rrefs(m: Any) -> list[Any]:
    return [rpc.RRef(p) for p in m.local_value().parameters()]


def _state(m: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.local_value().parameters()]


def _stage2(m2: Any, m3: Any, h: torch.Tensor) -> torch.Tensor:
    # Nested: worker1 calls worker2 for the last layer.
    z = torch.tanh(m2.local_value()(h))
    return rpc.rpc_sync("w2", _stage3, args=(m3, z))


def _stage3(m3: Any, z: torch.Tensor) -> torch.Tensor:
    return m3.local_value()(z)


def _side(m3: Any, x: torch.Tensor) -> torch.Tensor:
    # Fan-out: worker0 also calls worker2 directly, with its own input.
    return (m3.local_value().weight.sum() * x).sum(1, keepdim=True)


def _grads_none(m: Any) -> bool:
    return all(p.grad is None for p in m.local_value().parameters())


def _num_contexts() -> int:
    return len(dist_autograd._contexts)


class _DieInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        os._exit(3)  # this worker dies while the backward pass runs through it


def _fragile(x: torch.Tensor) -> torch.Tensor:
    return _DieInBackward.apply(x)


_release_w1 = threading.Event()


def _hold() -> None:
    _release_w1.wait(60)


def _split_model(rank: int, world: int, port: int) -> dict[str, Any]:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    if rank == 0:
        l1 = _layers()[0]
        m2 = rpc.remote("w1", _make, args=(1,))
        m3 = rpc.remote("w2", _make, args=(2,))
        params = [rpc.RRef(p) for p in l1.parameters()]
        params += rpc.rpc_sync("w1", _param_rrefs, args=(m2,))
        params += rpc.rpc_sync("w2", _param_rrefs, args=(m3,))
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(8, 6, generator=g) for _ in range(STEPS)]
        for step, x in enumerate(xs):
            with dist_autograd.context() as cid:
                y = rpc.rpc_sync("w1", _stage2, args=(m2, m3, torch.relu(l1(x))))
                s = rpc.rpc_sync("w2", _side, args=(m3, x))
                loss = ((y + s) ** 2).mean()
                dist_autograd.backward(cid, [loss])
                if step == 0:
                    out["first_cid"] = cid  # torch's first id on worker r: r << 48
                    out["grad_untouched"] = (
                        l1.weight.grad is None
                        and rpc.rpc_sync("w1", _grads_none, args=(m2,))
                        and rpc.rpc_sync("w2", _grads_none, args=(m3,)))
                    out["local_grads"] = len(dist_autograd.get_gradients(cid))
                opt.step(cid)
        out["finished_ctx"] = _err(lambda: dist_autograd.get_gradients(cid))
        out["contexts_left"] = [rpc.rpc_sync(f"w{r}", _num_contexts) for r in range(3)]
        out["unknown_ctx"] = _err(lambda: dist_autograd.backward(
            123456789, [torch.ones(1, requires_grad=True).sum()]))
        got = [p.detach().clone() for p in l1.parameters()]
        got += rpc.rpc_sync("w1", _state, args=(m2,)) + rpc.rpc_sync("w2", _state, args=(m3,))
        # The same model trained locally.
        r1, r2, r3 = _layers()
        lopt = torch.optim.SGD([*r1.parameters(), *r2.parameters(), *r3.parameters()], lr=0.05)
        for x in xs:
            lopt.zero_grad()
            y = r3(torch.tanh(r2(torch.relu(r1(x)))))
            s = (r3.weight.sum() * x).sum(1, keepdim=True)
            ((y + s) ** 2).mean().backward()
            lopt.step()
        want = [p.detach() for m in (r1, r2, r3) for p in m.parameters()]
        out["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(got, want))
        # The functional optimizers (SGD here) leave .grad as it was, as torch.
        out["grad_after_step"] = (l1.weight.grad is None
                                  and rpc.rpc_sync("w1", _grads_none, args=(m2,)))
        # Gradients through remote().to_here() and a proxy's remote().
        t = torch.ones(3, requires_grad=True)
        with dist_autograd.context() as cid:
            v = rpc.remote("w1", torch.mul, args=(t, 2)).to_here().sum()
            dist_autograd.backward(cid, [v])
            out["to_here_grad"] = dist_autograd.get_gradients(cid)[t].tolist()
        h = torch.ones(2, 5, requires_grad=True)
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [m2.remote().forward(h).to_here().sum()])
            w2 = rpc.rpc_sync("w1", _state, args=(m2,))[0]
            out["proxy_remote_grad"] = bool(torch.allclose(
                dist_autograd.get_gradients(cid)[h], torch.ones(2, 4) @ w2))
        # A step on owners no message of the context reached does nothing.
        before = rpc.rpc_sync("w1", _state, args=(m2,))
        with dist_autograd.context() as cid:
            dist_autograd.backward(cid, [(t * 3).sum()])
            opt.step(cid)
        after = rpc.rpc_sync("w1", _state, args=(m2,))
        out["untouched_step"] = all(torch.equal(a, b) for a, b in zip(before, after))
        # torch's argument checks.
        with dist_autograd.context() as cid:
            out["nested_ctx"] = _err(lambda: dist_autograd.context().__enter__())
            y = rpc.rpc_sync("w1", torch.mul, args=(t, 2))
            out["non_scalar"] = _err(lambda: dist_autograd.backward(cid, [y]))
            out["leaf_root"] = _err(lambda: dist_autograd.backward(
                cid, [torch.ones((), requires_grad=True)]))
            out["no_grad_root"] = _err(lambda: dist_autograd.backward(cid, [torch.ones(())]))
            out["no_roots"] = _err(lambda: dist_autograd.backward(cid, []))
        # A second pass without retain_graph fails as torch's freed graph does
        # (and adds nothing); with retain_graph gradients accumulate.
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync("w1", torch.mul, args=(t, 2)).sum()
            dist_autograd.backward(cid, [loss])
            out["second_pass"] = _err(lambda: dist_autograd.backward(cid, [loss]))
            out["after_second"] = dist_autograd.get_gradients(cid)[t].tolist()
        with dist_autograd.context() as cid:
            loss = rpc.rpc_sync("w1", torch.mul, args=(t, 2)).sum()
            dist_autograd.backward(cid, [loss], retain_graph=True)
            dist_autograd.backward(cid, [loss])
            out["retained"] = dist_autograd.get_gradients(cid)[t].tolist()
        out["available"] = dist_autograd.is_available()
        # RRef.backward in a context.
        with dist_autograd.context() as cid:
            w = torch.ones(3, requires_grad=True)
            loss_rref = rpc.remote("w1", torch.sum, args=(w * 3,))
            loss_rref.backward(cid)
            out["rref_backward"] = dist_autograd.get_gradients(cid)[w].tolist()
        # A worker that dies in the middle of backward fails it, naming the worker.
        with dist_autograd.context() as cid:
            x = torch.ones(2, requires_grad=True)
            y = rpc.rpc_sync("w2", _fragile, args=(x,))
            out["dead_backward"] = _err(lambda: dist_autograd.backward(cid, [y.sum()]))
        rpc.rpc_async("w1", _release)
        rpc.shutdown(graceful=False)
    elif rank == 1:
        try:
            rpc.rpc_sync("w1", _hold)  # until w0 is done
        except RuntimeError:
            pass
        rpc.shutdown(graceful=False)
    else:
        threading.Event().wait(60)  # w0 ends this worker
    return out


def _release() -> None:
    _release_w1.set()


def _err(f: Any) -> tuple[str, str]:
    try:
        f()
    except Exception as e:
        return (type(e).__name__, str(e))
    return ("none", "")


def test_split_model_equals_local_training() -> None:
    r = launch(3, _split_model, free_port(), init=False, expect_dead=(1, 2), timeout=150)[0]
    assert r["max_diff"] < 1e-6, r["max_diff"]
    assert r["grad_untouched"] is True
    assert r["local_grads"] == 2  # l1.weight, l1.bias on this worker
    assert r["finished_ctx"][0] == "RuntimeError"
    assert r["contexts_left"] == [0, 0, 0]
    assert r["unknown_ctx"][0] == "RuntimeError" and "123456789" in r["unknown_ctx"][1]
    assert r["rref_backward"] == [3.0, 3.0, 3.0]
    assert r["first_cid"] == 0 and r["available"] is True
    assert r["grad_after_step"] is True
    assert r["to_here_grad"] == [2.0, 2.0, 2.0]
    assert r["proxy_remote_grad"] is True
    assert r["untouched_step"] is True
    assert r["nested_ctx"] == ("RuntimeError",
                               "Already have an autograd context id for this thread.")
    assert r["non_scalar"] == ("RuntimeError", " is not a scalar, all roots need to be scalar")
    assert r["leaf_root"] == ("RuntimeError", " does not have a valid gradient function.")
    assert r["no_grad_root"] == ("RuntimeError", "requires_grad not set on root")
    assert r["no_roots"] == ("RuntimeError", "No tensors provided for gradient computation.")
    assert r["second_pass"][0] == "RuntimeError"
    assert r["second_pass"][1].startswith("Error on Node 0: Error on Node 1: Trying to backward "
                                          "through the graph a second time"), r["second_pass"]
    assert r["after_second"] == [2.0, 2.0, 2.0]
    assert r["retained"] == [4.0, 4.0, 4.0]
    assert r["dead_backward"][0] == "RuntimeError" and "w2" in r["dead_backward"][1], r


# ------------------------------------------------------- parameter server


class _PS:
    def __init__(self) -> None:
        torch.manual_seed(3)
        self.model = torch.nn.Linear(4, 2)
        self.barrier = threading.Barrier(2)


def _ps_forward(ps: Any, x: torch.Tensor) -> torch.Tensor:
    return ps.local_value().model(x)


def _ps_grads(ps: Any, cid: int) -> list[torch.Tensor]:
    g = dist_autograd.get_gradients(cid)
    return [g[p] for p in ps.local_value().model.parameters()]


def _ps_params(ps: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in ps.local_value().model.parameters()]


def _ps_param_rrefs(ps: Any) -> list[Any]:
    return [rpc.RRef(p) for p in ps.local_value().model.parameters()]


def _ps_wait(ps: Any) -> None:
    ps.local_value().barrier.wait(30)


def _trainer(ps: Any, rank: int) -> tuple[float, list[torch.Tensor]]:
    x = torch.full((3, 4), float(rank))
    p0 = rpc.rpc_sync("w0", _ps_params, args=(ps,))
    opt = DistributedOptimizer(torch.optim.SGD, rpc.rpc_sync("w0", _ps_param_rrefs, args=(ps,)),
                               lr=0.1)
    with dist_autograd.context() as cid:
        loss = (rpc.rpc_sync("w0", _ps_forward, args=(ps, x)) ** 2).sum()
        dist_autograd.backward(cid, [loss])
        got = rpc.rpc_sync("w0", _ps_grads, args=(ps, cid))
        w, b = (t.clone().requires_grad_(True) for t in p0)
        ((x @ w.t() + b) ** 2).sum().backward()
        diff = max(float((got[0] - w.grad).abs().max()), float((got[1] - b.grad).abs().max()))
        rpc.rpc_sync("w0", _ps_wait, args=(ps,))  # both trainers computed theirs
        opt.step(cid)
    return diff, [w.grad, b.grad]


def _ps_job(rank: int, world: int, port: int) -> Any:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world)
    out: Any = None
    if rank == 0:
        ps = rpc.RRef(_PS())
        p0 = _ps_params(ps)
        futs = [rpc.rpc_async(f"w{t}", _trainer, args=(ps, t)) for t in (1, 2)]
        res = [f.wait() for f in futs]
        final = _ps_params(ps)
        want = [p - 0.1 * (res[0][1][i] + res[1][1][i]) for i, p in enumerate(p0)]
        out = {"grad_diffs": [r[0] for r in res],
               "final_diff": max(float((a - b).abs().max()) for a, b in zip(final, want))}
    rpc.shutdown()
    return out


def test_two_trainers_share_a_parameter_server() -> None:
    r = launch(3, _ps_job, free_port(), init=False, timeout=150)[0]
    assert max(r["grad_diffs"]) < 1e-6, r
    assert r["final_diff"] < 1e-6, r


# ------------------------------------ RPC results as graph nodes, vs torch


def _ag(rpc_name: str) -> Any:
    import importlib

    return importlib.import_module("torch.distributed.autograd" if rpc_name.startswith("torch")
                                   else "ringlet.rpc.autograd")


def _loss_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w) ** 2).sum()


def _mul(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


def _nested_loss(rpc_name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    import importlib

    rpc_mod = importlib.import_module(rpc_name)
    # The result of a call to w2 goes back as it came: a received tensor.
    return rpc_mod.rpc_sync("w2", _loss_fn, args=(x * 2, w))


def _nested_sum(rpc_name: str, x: torch.Tensor) -> torch.Tensor:
    import importlib

    rpc_mod = importlib.import_module(rpc_name)
    return rpc_mod.rpc_sync("w2", _mul, args=(x, 3.0)) + x.sin()


def _arg_info(x: torch.Tensor) -> tuple[bool, bool, bool]:
    return (x.requires_grad, x.is_leaf, "RecvRpcBackward" in x.grad_fn.name()
            if x.grad_fn is not None else False)


def _node(t: torch.Tensor) -> tuple[bool, bool, bool]:
    return (t.requires_grad, t.is_leaf, "RecvRpcBackward" in t.grad_fn.name()
            if t.grad_fn is not None else False)


def _outcome_of(f: Any) -> Any:
    try:
        f()
    except Exception as e:  # the error's type and torch's words
        return (type(e).__name__, "Trying to backward through the graph a second time" in str(e))
    return ("none", False)


def _rpc_results_as_nodes(rank: int, world: int, rpc_name: str, port: int) -> dict[str, Any]:
    import importlib

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    rpc_mod = importlib.import_module(rpc_name)
    ag = _ag(rpc_name)
    rpc_mod.init_rpc(f"w{rank}", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    if rank == 0:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(2, 3, generator=g).requires_grad_()
        w = torch.randn(3, 4, generator=g).requires_grad_()

        def run(name: str, forward: Any, retain: bool = False, passes: int = 1) -> None:
            with ag.context() as cid:
                roots = forward()
                out[name + ":root"] = [_node(r) for r in roots]
                outcomes = []
                for p in range(passes):
                    keep = retain and p < passes - 1
                    outcomes.append(_outcome_of(
                        lambda keep=keep: ag.backward(cid, roots, retain_graph=keep)))
                out[name + ":outcome"] = outcomes
                grads = ag.get_gradients(cid)
                out[name] = [grads[t].tolist() if t in grads else None for t in (x, w)]

        # the RPC result itself is the root (rpc_sync, rpc_async, to_here)
        run("direct", lambda: [rpc_mod.rpc_sync("w1", _loss_fn, args=(x, w))])
        run("async", lambda: [rpc_mod.rpc_async("w1", _loss_fn, args=(x, w)).wait()])
        run("to_here", lambda: [rpc_mod.remote("w1", _loss_fn, args=(x, w)).to_here()])
        # views of it
        run("view_index", lambda: [rpc_mod.rpc_sync("w1", _mul, args=(x, 2.0))[1, 2]])
        run("view_flat", lambda: [rpc_mod.rpc_sync("w1", _mul, args=(x, 2.0)).view(-1)[4:5]])
        run("view_t", lambda: [rpc_mod.rpc_sync("w1", _mul, args=(x @ w, 0.5)).t()[3, 1]])
        # sums of several results, and several results as roots
        run("sum", lambda: [rpc_mod.rpc_sync("w1", _loss_fn, args=(x, w))
                            + rpc_mod.rpc_sync("w2", _loss_fn, args=(x * 3, w))
                            + rpc_mod.rpc_async("w1", _loss_fn, args=(x, w * w)).wait()])
        run("roots", lambda: [rpc_mod.rpc_sync("w1", _loss_fn, args=(x, w)),
                              rpc_mod.rpc_sync("w2", _loss_fn, args=(x, 2 * w))])
        # nested: w1's result is what w2 sent it; or w1 adds to it
        run("nested", lambda: [rpc_mod.rpc_sync("w1", _nested_loss, args=(rpc_name, x, w))])
        run("nested_sum", lambda: [rpc_mod.rpc_sync(
            "w1", _nested_sum, args=(rpc_name, x)).pow(2).sum()])
        # changed in place on the caller
        run("in_place", lambda: [rpc_mod.rpc_sync("w1", _mul, args=(x, 2.0)).mul_(3).sum()])
        # retain_graph: passes accumulate; after the last (not retained) one
        # torch's graph on w1 is freed
        run("retain", lambda: [rpc_mod.rpc_sync("w1", _loss_fn, args=(x, w))],
            retain=True, passes=3)
        run("retain_sum", lambda: [rpc_mod.rpc_sync("w1", _loss_fn, args=(x, w))
                                   + rpc_mod.rpc_sync("w2", _mul, args=(x, 2.0)).sum()],
            retain=True, passes=2)
        run("no_retain", lambda: [rpc_mod.rpc_sync("w1", _loss_fn, args=(x, w))], passes=2)
        # the callee's argument is a node too; outside a context, leaves
        with ag.context():
            out["callee_arg"] = rpc_mod.rpc_sync("w1", _arg_info, args=(x,))
            with torch.no_grad():  # a builtin under no_grad carries no context
                out["no_grad_builtin"] = _node(rpc_mod.rpc_sync("w1", torch.mul, args=(x, 2)))
        out["no_context"] = _node(rpc_mod.rpc_sync("w1", _mul, args=(x, 2.0)))
        out["no_context_arg"] = rpc_mod.rpc_sync("w1", _arg_info, args=(x,))
    rpc_mod.shutdown()
    return out


def test_rpc_results_are_graph_nodes_as_in_torch() -> None:
    """A tensor an RPC returns (requiring grad, in a context) is a node
    whose backward sends its gradient to the sender: backward from it, its
    views, sums of several, nested calls, retain_graph passes and in-place
    changes give torch.distributed.rpc's gradients, in the same run."""
    ref = launch(3, _rpc_results_as_nodes, "torch.distributed.rpc", free_port(), init=False,
                 timeout=150)[0]
    got = launch(3, _rpc_results_as_nodes, "ringlet.rpc", free_port(), init=False,
                 timeout=150)[0]
    assert set(got) == set(ref)
    for key, want in ref.items():
        if key.endswith(":root") or key.endswith(":outcome") or not isinstance(want, list):
            assert got[key] == want, (key, got[key], want)
            continue
        for a, b in zip(got[key], want):
            assert (a is None) == (b is None), (key, got[key], want)
            if a is not None:
                torch.testing.assert_close(torch.tensor(a), torch.tensor(b), msg=key)
    # real values: the direct root's gradients are those of the local loss
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(2, 3, generator=g).requires_grad_()
    w0 = torch.randn(3, 4, generator=g).requires_grad_()
    _loss_fn(x0, w0).backward()
    torch.testing.assert_close(torch.tensor(got["direct"][0]), x0.grad)
    torch.testing.assert_close(torch.tensor(got["direct"][1]), w0.grad)
    assert got["direct:root"] == [(True, False, True)]
    assert got["retain:outcome"] == [("none", False)] * 3
    torch.testing.assert_close(torch.tensor(got["retain"][0]), 3 * x0.grad)
    assert got["no_retain:outcome"][1] == ("RuntimeError", True)
    assert got["callee_arg"] == (True, False, True)
    assert got["no_context"] == (True, True, False)
