"""A sharded ``nn.Linear`` on a (data, model) mesh of 4 ranks, checked against an unsharded run.

The weight (and bias) are split by output features over the ``model`` axis, the
input batch over the ``data`` axis:

    mesh = [[0, 1],      axis 0: "data"  (ranks 0, 2 hold different halves of the batch)
            [2, 3]]      axis 1: "model" (ranks 0, 1 hold different halves of the weight)

Forward on each rank: ``y_local = x_local @ W_local.T + b_local`` gives its
batch rows and its output columns; an all-gather along ``model`` completes the
columns. Backward: the gather's gradient is this rank's column slice; the input
gradient is the sum of every model shard's contribution (an all-reduce along
``model``); weight and bias gradients are summed over the batch halves (an
all-reduce along ``data``). Every collective uses ``groups=mesh.groups_along(axis)``.

Run:
    torchrun --nproc_per_node 4 examples/sharded_linear.py
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ringlet
from ringlet.xla.sharding import Mesh, XLAShardedTensor, mark_sharding, wrap_if_sharded

IN_FEATURES, OUT_FEATURES, BATCH = 16, 8, 12


class _CopyToModelAxis(torch.autograd.Function):
    """Identity forward; backward sums the input gradient over the model axis."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ringlet.all_reduce(ringlet.REDUCE_SUM, grad.contiguous(), groups=ctx.groups), None


class _GatherFromModelAxis(torch.autograd.Function):
    """All-gather of the last dimension over the model axis; backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, groups: list[list[int]], index: int) -> torch.Tensor:
        ctx.index, ctx.width = index, y.shape[-1]
        return ringlet.all_gather(y.contiguous(), dim=-1, groups=groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.narrow(-1, ctx.index * ctx.width, ctx.width).contiguous(), None, None


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` whose output features are split over one mesh axis.

    Args:
        linear: the full layer (the same on every rank); its parameters are copied.
        mesh: the mesh.
        model_axis: the mesh axis splitting the output features.
    """

    def __init__(self, linear: nn.Linear, mesh: Mesh, model_axis: str = "model") -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().clone())
        self.bias = nn.Parameter(linear.bias.detach().clone())
        # Each rank now keeps only its rows of the weight and its part of the bias.
        mark_sharding(self.weight, mesh, (model_axis, None))
        mark_sharding(self.bias, mesh, (model_axis,))
        self.groups = mesh.groups_along(model_axis)
        self.index = mesh.rank_coords(ringlet.get_ordinal())[mesh.axis_index(model_axis)]

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        x = _CopyToModelAxis.apply(x_local, self.groups)
        y_local = F.linear(x, self.weight, self.bias)
        return _GatherFromModelAxis.apply(y_local, self.groups, self.index)


def check_against_unsharded() -> dict[str, float]:
    """Run the sharded layer and the plain one; assert they agree and return the max errors."""
    mesh = Mesh(list(range(4)), (2, 2), ("data", "model"))
    data_groups = mesh.groups_along("data")
    torch.manual_seed(0)  # the same values on every rank
    reference = nn.Linear(IN_FEATURES, OUT_FEATURES)
    x = torch.randn(BATCH, IN_FEATURES)
    target = torch.randn(BATCH, OUT_FEATURES)

    # Unsharded: loss is a mean over the global batch.
    x_ref = x.clone().requires_grad_()
    y_ref = reference(x_ref)
    loss_ref = ((y_ref - target) ** 2).sum() / BATCH
    loss_ref.backward()

    # Sharded: the batch over "data", the weight over "model".
    layer = ColumnParallelLinear(reference, mesh)
    x_sharded = mark_sharding(x, mesh, ("data", None))
    rows = x_sharded.local_shards[0].indices[0]
    x_local = x_sharded.local_shards[0].unpadded_data.clone().requires_grad_()
    y = layer(x_local)
    loss_local = ((y - target[rows]) ** 2).sum() / BATCH
    loss_local.backward()
    # Gradients of replicated-over-data parameters: sum the batch halves.
    for p in (layer.weight, layer.bias):
        assert p.grad is not None
        p.grad = ringlet.all_reduce(ringlet.REDUCE_SUM, p.grad, groups=data_groups)
    loss = ringlet.all_reduce(ringlet.REDUCE_SUM, loss_local.detach(), groups=data_groups)

    # Materialise the sharded gradients and compare everything with the plain run.
    grad_w = XLAShardedTensor.from_local_shards(layer.weight.grad, mesh, ("model", None))
    grad_b = XLAShardedTensor.from_local_shards(layer.bias.grad, mesh, ("model",))
    assert reference.weight.grad is not None and reference.bias.grad is not None
    assert x_ref.grad is not None and x_local.grad is not None
    errors = {
        "output": (y - y_ref[rows]).abs().max().item(),
        "loss": (loss - loss_ref).abs().item(),
        "grad_weight": (grad_w.global_tensor - reference.weight.grad).abs().max().item(),
        "grad_bias": (grad_b.global_tensor - reference.bias.grad).abs().max().item(),
        "grad_input": (x_local.grad - x_ref.grad[rows]).abs().max().item(),
        "weight": (wrap_if_sharded(layer.weight).global_tensor - reference.weight)
        .abs()
        .max()
        .item(),
    }
    for name, err in errors.items():
        assert err < 1e-5, f"rank {ringlet.get_ordinal()}: {name} differs by {err}"
    return errors


def main() -> None:
    ringlet.init()
    if ringlet.world_size() != 4:
        raise SystemExit(
            f"run with 4 ranks (torchrun --nproc_per_node 4), not {ringlet.world_size()}"
        )
    errors = check_against_unsharded()
    ringlet.master_print(
        "sharded Linear matches the unsharded run; max abs errors: "
        + ", ".join(f"{k}={v:.2e}" for k, v in errors.items())
    )
    ringlet.shutdown()


if __name__ == "__main__":
    main()
