"""torch.ops.ringlet.*: values against plain torch on real processes, fake
(meta) shapes, gradients of every differentiable collective, torch.compile
without graph breaks, and torch.library.opcheck's registration checks."""

from __future__ import annotations

import pytest
import torch

import ringlet

from conftest import launch

ops = torch.ops.ringlet


def per_rank(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def values(rank: int, world: int) -> None:
    xs = [per_rank(r, (4 * world, 3)) for r in range(world)]
    x = xs[rank]
    total = sum(xs)
    torch.testing.assert_close(ops.all_reduce(x), total)
    torch.testing.assert_close(ops.all_reduce(x, "max", 0.5), torch.stack(xs).amax(0) * 0.5)
    assert torch.equal(x, xs[rank])  # inputs are never modified
    torch.testing.assert_close(ops.all_gather(x, 1), torch.cat(xs, 1))
    torch.testing.assert_close(ops.all_gather(x.t(), -1), torch.cat([t.t() for t in xs], -1))
    torch.testing.assert_close(ops.reduce_scatter(x), total.chunk(world)[rank])
    torch.testing.assert_close(
        ops.reduce_scatter(x, "sum", 2.0, 0), 2 * total.chunk(world)[rank]
    )
    torch.testing.assert_close(ops.broadcast(x, world - 1), xs[world - 1])
    want = torch.cat([t.chunk(world, 0)[rank] for t in xs], 1)
    torch.testing.assert_close(ops.all_to_all(x, 0, 1), want)
    ints = torch.tensor([rank + 1, 2 * rank], dtype=torch.int32)
    assert ops.all_reduce(ints, "min").tolist() == [1, 0]
    # fake tensors: shapes without communication
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        f = torch.empty(4 * world, 6)
        assert ops.all_gather(f, 1).shape == (4 * world, 6 * world)
        assert ops.reduce_scatter(f, "sum", 1.0, 0).shape == (4, 6)
        assert ops.all_to_all(f, 0, 1).shape == (4, 6 * world)
        assert ops.all_reduce(f).shape == f.shape


def gradients(rank: int, world: int) -> None:
    # Each rank's loss weights the collective's output by its own w; the
    # gradients below are worked out by hand from the definitions.
    ws = [per_rank(10 + r, (2 * world, 3)) for r in range(world)]
    w = ws[rank]
    x = per_rank(rank, (2 * world, 3)).requires_grad_()
    (ops.all_reduce(x, "sum", 3.0) * w).sum().backward()
    torch.testing.assert_close(x.grad, 3.0 * sum(ws))

    x = per_rank(rank, (2, 3)).requires_grad_()
    (ops.all_gather(x, 0) * w).sum().backward()
    torch.testing.assert_close(x.grad, sum(t.chunk(world)[rank] for t in ws))

    x = per_rank(rank, (2 * world, 3)).requires_grad_()
    wb = w.chunk(world)[0]
    (ops.reduce_scatter(x, "sum", 0.5, 0) * wb).sum().backward()
    torch.testing.assert_close(x.grad, 0.5 * torch.cat([t.chunk(world)[0] for t in ws]))

    x = per_rank(rank, (2 * world, 3)).requires_grad_()
    (ops.broadcast(x, 0) * w).sum().backward()
    torch.testing.assert_close(x.grad, sum(ws) if rank == 0 else torch.zeros_like(w))

    x = per_rank(rank, (2 * world, 3)).requires_grad_()
    y = ops.all_to_all(x, 0, 0)  # block j of x goes to rank j
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([t.chunk(world)[rank] for t in ws]))

    x = per_rank(rank, (2,)).requires_grad_()
    with pytest.raises(RuntimeError, match="differentiable for reduce_type 'sum' only"):
        ops.all_reduce(x, "max").sum().backward()


def eager_calls(rank: int, world: int) -> None:
    # Plain eager calls skip the dispatcher; everything that would see the
    # call in the dispatcher (modes, the profiler, transforms) still does,
    # and the results are those of the kernels.
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    xs = [per_rank(r, (2 * world, 3)) for r in range(world)]
    x, total = xs[rank], sum(xs)
    torch.testing.assert_close(ops.all_reduce(x.t()), total.t())  # not contiguous
    torch.testing.assert_close(ops.all_reduce(x, reduce_type="max"), torch.stack(xs).amax(0))
    torch.testing.assert_close(ops.all_reduce(x, "sum", 2), 2 * total)  # an int scale
    want = 0.5 * total.chunk(world)[rank]
    torch.testing.assert_close(ops.reduce_scatter(x, "sum", 0.5, -2), want)
    torch.testing.assert_close(ops.all_gather(x, -2), torch.cat(xs))
    torch.testing.assert_close(ops.broadcast(x, 0), xs[0])
    with torch.no_grad():  # needs no gradient: the direct path, no history
        y = ops.all_reduce(x.clone().requires_grad_())
    assert not y.requires_grad
    torch.testing.assert_close(y, total)
    with pytest.raises(RuntimeError, match="expected at most 3 argument"):
        ops.all_reduce(x, "sum", 1.0, 0)
    with pytest.raises(RuntimeError, match="Expected a value of type 'float'"):
        ops.all_reduce(x, "sum", "2")

    seen: list[str] = []

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(f"function {func}")
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(f"dispatch {func}")
            return func(*args, **(kwargs or {}))

    with Functions():
        torch.testing.assert_close(ops.all_gather(x, 0), torch.cat(xs))
    with Dispatch():
        torch.testing.assert_close(ops.all_reduce(x), total)
    assert "function ringlet.all_gather" in seen, seen
    assert "dispatch ringlet.all_reduce.default" in seen, seen
    with torch.profiler.profile() as prof:
        torch.testing.assert_close(ops.broadcast(x, 1), xs[1])
    assert any(e.name == "ringlet::broadcast" for e in prof.events())
    # vmap: the batched rule is the per-sample loop of the fallback
    batched = torch.vmap(lambda t: ops.all_reduce(t, "sum", 1.0))(x)
    torch.testing.assert_close(batched, total)


def compiled(rank: int, world: int) -> None:
    def step(x: torch.Tensor) -> torch.Tensor:
        y = ops.all_reduce(x * 2, "sum", 1.0)
        return ops.all_gather(y + 1, 0)

    fn = torch.compile(step, backend="aot_eager", fullgraph=True)  # no graph breaks
    x = per_rank(rank, (3,))
    want = torch.cat([2 * sum(per_rank(r, (3,)) for r in range(world)) + 1] * world)
    torch.testing.assert_close(fn(x), want)
    torch.testing.assert_close(step(x), want)


def opchecks(rank: int, world: int) -> None:
    x = per_rank(rank, (2 * world, 3)).requires_grad_()
    for op, args in (
        (ops.all_reduce.default, (x, "sum", 1.0)),
        (ops.all_gather.default, (x, 1)),
        (ops.reduce_scatter.default, (x, "sum", 1.0, 0)),
        (ops.broadcast.default, (x, 0)),
        (ops.all_to_all.default, (x, 0, 1)),
    ):
        torch.library.opcheck(
            op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor")
        )


def everything(rank: int, world: int) -> None:
    values(rank, world)
    eager_calls(rank, world)
    gradients(rank, world)
    if world == 2:  # registration checks and compilation do not depend on the size
        opchecks(rank, world)
        compiled(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_ops_on_ranks(world: int) -> None:
    """Values and fake shapes, gradients; on 2 ranks also opcheck and
    torch.compile(fullgraph=True). One launch per world size."""
    launch(world, everything, timeout=240)


def test_world_of_one_without_init() -> None:
    ringlet.shutdown()
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(ops.all_reduce(x, "sum", 2.0), 2 * x)
    assert torch.equal(ops.all_gather(x, 1), x) and ops.all_gather(x, 1) is not x
    assert torch.equal(ops.broadcast(x, 0), x)
