"""torch_xla's SPMD sharding API (``torch_xla.distributed.spmd``), eager and multi-process.

One import for the whole API: the mesh and partition-spec algebra
(:mod:`ringlet.xla.mesh`: :class:`Mesh`, :class:`HybridMesh`, partition specs,
:class:`OpSharding`, :func:`shard_indices`; nothing there communicates), the eager
sharded tensors built on it (:mod:`ringlet.xla.sharded_tensor`:
:func:`mark_sharding`, :class:`XLAShardedTensor`, :class:`ShardingSpec`), and
torch_xla's module helpers (:class:`XLAPatchedLinear`, ...), defined here.

Example:
    >>> import ringlet.xla.sharding as xs          # or ringlet.xla.sharding
    >>> mesh = xs.Mesh(range(4), (2, 2), ("data", "model"))
    >>> xs.shard_indices((8, 8), mesh, ("data", "model"), rank=3).indices
    (slice(4, 8, None), slice(4, 8, None))
"""

from __future__ import annotations

from typing import Any

import torch

from . import mesh as _mesh
from . import sharded_tensor as _sharded_tensor
from .mesh import *  # noqa: F403  (the algebra: Mesh, HybridMesh, shard_indices, ...)

# torch_xla's xla_sharding module carries these private helpers too; code and tests
# written against it reach them here.
from .mesh import _compute_op_sharding as _compute_op_sharding
from .mesh import _get_group_assignment as _get_group_assignment
from .mesh import _get_sharding_type as _get_sharding_type
from .mesh import _get_tile_assignment as _get_tile_assignment
from .mesh import _read_back_sharding_type as _read_back_sharding_type
from .mesh import _translate_named_partition_spec as _translate_named_partition_spec
from .sharded_tensor import *  # noqa: F403  (mark_sharding, XLAShardedTensor, ShardingSpec, ...)

__all__ = ["XLAPatchedLinear", "apply_backward_optimization_barrier",
           "xla_patched_nn_linear_forward"]
__all__ += _mesh.__all__
__all__ += _sharded_tensor.__all__


class XLAPatchedLinear(torch.autograd.Function):
    """``torch.nn.functional.linear`` written with einsum, as in torch_xla
    (there it keeps sharded dimensions from being flattened by matmul; on
    eager CPU tensors it computes the same values as ``F.linear``).

    Example:
        >>> y = XLAPatchedLinear.apply(x, layer.weight, layer.bias)
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: Any = None
    ) -> torch.Tensor:
        ctx.save_for_backward(input, weight, bias)
        with torch.no_grad():
            product = torch.einsum("...n,mn->...m", input, weight)
            return product if bias is None else product + bias

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:  # type: ignore[override]
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = torch.einsum("...m,mn->...n", grad_output, weight)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.einsum("...m,...n->mn", grad_output, input)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = torch.einsum("...m->m", grad_output)
        return grad_input, grad_weight, grad_bias


def xla_patched_nn_linear_forward(m: torch.nn.Module, input: torch.Tensor) -> torch.Tensor:
    """The forward of ``nn.Linear`` ``m`` through :class:`XLAPatchedLinear`.

    Args:
        m (torch.nn.Module): an ``nn.Linear`` (anything with ``weight`` and ``bias``).
        input (torch.Tensor): the input.

    Returns:
        torch.Tensor: ``input @ m.weight.T + m.bias``.

    Example:
        >>> y = xla_patched_nn_linear_forward(torch.nn.Linear(4, 2), torch.ones(3, 4))
    """
    return XLAPatchedLinear.apply(input, m.weight, m.bias)


def apply_backward_optimization_barrier(m: torch.nn.Module) -> None:
    """Registers a full backward hook on ``m`` marking an optimisation barrier
    after its backward, as torch_xla does to stop the compiler fusing it with
    other modules' backward. Eager execution never fuses across modules, so
    the hook only forces the module's gradients to be materialised; values are
    unchanged.

    Args:
        m (torch.nn.Module): the module.

    Example:
        >>> apply_backward_optimization_barrier(model.layers[0])
    """

    def optimization_barrier(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        return None

    m.register_full_backward_hook(optimization_barrier)


def __getattr__(name: str) -> Any:
    # The rest of the algebra's private names, as ``ringlet.xla.sharding`` had them
    # before the split (read live from ringlet.xla.mesh, e.g. ``_GLOBAL_MESH``).
    if name.startswith("_") and not name.startswith("__"):
        if hasattr(_mesh, name):
            return getattr(_mesh, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
