"""ringlet's collectives as PyTorch operators: ``torch.ops.ringlet.*``.

Defined with ``torch.library.Library``, so they carry a schema, a fake
(meta) implementation for shape inference and an autograd formula. That makes
them traceable by ``torch.compile`` without graph breaks and differentiable in
eager mode, as the collectives of tensor parallelism need (the backward of an
all-gather is a reduce-scatter, and so on). They run over the whole world;
use :mod:`ringlet.xla.xla_model` for replica groups.

Operators (each returns a new tensor; inputs are never modified):

* ``torch.ops.ringlet.all_reduce(x, reduce_type="sum", scale=1.0)``
* ``torch.ops.ringlet.all_gather(x, dim=0)``
* ``torch.ops.ringlet.reduce_scatter(x, reduce_type="sum", scale=1.0, dim=0)``
* ``torch.ops.ringlet.broadcast(x, root=0)``
* ``torch.ops.ringlet.all_to_all(x, split_dim=0, concat_dim=0)``

Gradients flow for ``sum`` reductions (any ``scale``); other reduce types
raise in backward.

Example:
  >>> import ringlet.ops  # registers the operators
  >>> w = torch.randn(4, 3, requires_grad=True)
  >>> full = torch.ops.ringlet.all_gather(w, 0)      # (4 * world, 3)
  >>> full.sum().backward()                          # w.grad == world
"""

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from .core import groups
from .core.engine import (
    apply_scale,
    world_all_gather,
    world_all_reduce_into,
    world_broadcast,
    world_reduce_scatter,
)
from .xla import xla_model as _c

__all__ = ["all_gather", "all_reduce", "all_to_all", "broadcast", "reduce_scatter"]

# Each operator has a CPU kernel (the collective), a fake kernel and a lean
# Autograd kernel of our own. torch.library.custom_op would add two Python
# layers per call (6.5 us of a 10 us 4 KiB all_reduce); here a call that
# needs no gradient costs one Python hop.
_lib = torch.library.Library("ringlet", "DEF")  # kept for the life of the process
_lib.define("all_reduce(Tensor x, str reduce_type='sum', float scale=1.0) -> Tensor")
_lib.define("all_gather(Tensor x, int dim=0) -> Tensor")
_lib.define(
    "reduce_scatter(Tensor x, str reduce_type='sum', float scale=1.0, int dim=0) -> Tensor"
)
_lib.define("broadcast(Tensor x, int root=0) -> Tensor")
_lib.define("all_to_all(Tensor x, int split_dim=0, int concat_dim=0) -> Tensor")


def _world() -> int:
    return groups.world_size()


def _dim(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


# -- the collectives (CPU kernels) -------------------------------------------


def _all_reduce_direct(x: Tensor, reduce_type: str, scale: float) -> Optional[Tensor]:
    """The world all-reduce of plain ``x`` into a new tensor, scaled (one
    engine call that reads ``x`` itself); None when the general path must run."""
    out = world_all_reduce_into(x, reduce_type)
    if out is not None and scale != 1.0:
        apply_scale(out, scale)
    return out


def _all_reduce_cpu(x: Tensor, reduce_type: str = "sum", scale: float = 1.0) -> Tensor:
    out = _all_reduce_direct(x, reduce_type, scale)
    if out is not None:
        return out
    out = x.clone(memory_format=torch.contiguous_format)
    if _world() > 1:
        _c.all_reduce(reduce_type, [out], scale=scale)
    elif scale != 1.0:
        apply_scale(out, scale)
    return out


def _all_gather_cpu(x: Tensor, dim: int = 0) -> Tensor:
    x = x.contiguous()
    if _world() == 1:
        return x.clone()
    return _c.all_gather(x, dim=dim)


def _reduce_scatter_cpu(
    x: Tensor, reduce_type: str = "sum", scale: float = 1.0, dim: int = 0
) -> Tensor:
    x = x.contiguous()
    n = _world()
    if n == 1:
        out = x.clone()
        if scale != 1.0:
            apply_scale(out, scale)
        return out
    return _c.reduce_scatter(reduce_type, x, scale, dim, n)


def _broadcast_cpu(x: Tensor, root: int = 0) -> Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    if _world() > 1:
        _c.collective_broadcast([out], root_ordinal=root)
    return out


def _all_to_all_cpu(x: Tensor, split_dim: int = 0, concat_dim: int = 0) -> Tensor:
    x = x.contiguous()
    n = _world()
    if n == 1:
        return x.clone()
    return _c.all_to_all(x, split_dim, concat_dim, n)


# -- fake (meta) kernels: shapes for torch.compile and FakeTensor ------------


def _same_fake(x: Tensor, *args: Any) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_gather_fake(x: Tensor, dim: int = 0) -> Tensor:
    shape = list(x.shape)
    shape[_dim(dim, x.dim())] *= _world()
    return x.new_empty(shape)


def _reduce_scatter_fake(
    x: Tensor, reduce_type: str = "sum", scale: float = 1.0, dim: int = 0
) -> Tensor:
    shape = list(x.shape)
    shape[_dim(dim, x.dim())] //= _world()
    return x.new_empty(shape)


def _all_to_all_fake(x: Tensor, split_dim: int = 0, concat_dim: int = 0) -> Tensor:
    shape = list(x.shape)
    n = _world()
    shape[_dim(split_dim, x.dim())] //= n
    shape[_dim(concat_dim, x.dim())] *= n
    return x.new_empty(shape)


# -- the public functions ------------------------------------------------------


def all_reduce(x: Tensor, reduce_type: str = "sum", scale: float = 1.0) -> Tensor:
    """All-reduce over every rank, out of place (see :func:`ringlet.all_reduce`);
    the same as ``torch.ops.ringlet.all_reduce``.

    Args:
      x (Tensor): The input (a contiguous copy is used if needed).
      reduce_type (str): ``"sum"``, ``"mul"``, ``"min"``, ``"max"``, ``"and"``
        or ``"or"``. Default: ``"sum"``
      scale (float): Multiplies the result. Default: 1.0

    Returns:
      Tensor: The reduced tensor, identical on every rank.

    Example:
      >>> torch.ops.ringlet.all_reduce(torch.ones(2))   # on 2 ranks
      tensor([2., 2.])
    """
    return torch.ops.ringlet.all_reduce(x, reduce_type, scale)


def all_gather(x: Tensor, dim: int = 0) -> Tensor:
    """All-gather over every rank along ``dim`` (see :func:`ringlet.all_gather`);
    the same as ``torch.ops.ringlet.all_gather``.

    Args:
      x (Tensor): This rank's block.
      dim (int): The gather dimension (negative counts from the end). Default: 0

    Returns:
      Tensor: Every rank's block in rank order along ``dim``.

    Example:
      >>> torch.ops.ringlet.all_gather(torch.tensor([rank]))   # on 2 ranks
      tensor([0, 1])
    """
    return torch.ops.ringlet.all_gather(x, dim)


def reduce_scatter(x: Tensor, reduce_type: str = "sum", scale: float = 1.0, dim: int = 0) -> Tensor:
    """Reduce-scatter over every rank along ``dim`` (see
    :func:`ringlet.reduce_scatter`); ``x.shape[dim]`` must divide by the world
    size. The same as ``torch.ops.ringlet.reduce_scatter``.

    Args:
      x (Tensor): The full input on every rank.
      reduce_type (str): As in :func:`all_reduce`. Default: ``"sum"``
      scale (float): Multiplies the result. Default: 1.0
      dim (int): The scatter dimension. Default: 0

    Returns:
      Tensor: Block ``rank`` of the reduction.

    Example:
      >>> torch.ops.ringlet.reduce_scatter(torch.ones(4))  # on 2 ranks
      tensor([2., 2.])
    """
    return torch.ops.ringlet.reduce_scatter(x, reduce_type, scale, dim)


def broadcast(x: Tensor, root: int = 0) -> Tensor:
    """Every rank gets rank ``root``'s tensor (see
    :func:`ringlet.collective_broadcast`); the same as
    ``torch.ops.ringlet.broadcast``.

    Args:
      x (Tensor): The tensor (its value matters on ``root`` only).
      root (int): The source rank. Default: 0

    Returns:
      Tensor: A copy of ``root``'s ``x``.

    Example:
      >>> torch.ops.ringlet.broadcast(torch.tensor([rank]), 1)   # on 2 ranks
      tensor([1])
    """
    return torch.ops.ringlet.broadcast(x, root)


def all_to_all(x: Tensor, split_dim: int = 0, concat_dim: int = 0) -> Tensor:
    """All-to-all over every rank (see :func:`ringlet.all_to_all`): ``x`` is
    split in world-size blocks along ``split_dim``, block ``j`` goes to rank
    ``j``, and the received blocks are concatenated along ``concat_dim``. The
    same as ``torch.ops.ringlet.all_to_all``.

    Args:
      x (Tensor): The input.
      split_dim (int): The split dimension. Default: 0
      concat_dim (int): The concatenation dimension. Default: 0

    Returns:
      Tensor: The concatenated blocks.

    Example:
      >>> torch.ops.ringlet.all_to_all(torch.arange(2) + 2 * rank)   # on 2 ranks
      tensor([0, 2])   # rank 0; rank 1 gets tensor([1, 3])
    """
    return torch.ops.ringlet.all_to_all(x, split_dim, concat_dim)


# -- autograd ----------------------------------------------------------------


def _sum_only(ctx: Any, what: str) -> None:
    if ctx.reduce_type != "sum":
        raise RuntimeError(
            f"ringlet::{what} is differentiable for reduce_type 'sum' only, got "
            f"{ctx.reduce_type!r}"
        )


def _save_reduce(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.reduce_type, ctx.scale = inputs[1], inputs[2]
    if len(inputs) > 3:
        ctx.dim = inputs[3]


def _all_reduce_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    # Every rank's output depends on every rank's input: the gradient of x_r
    # is scale times the sum over ranks of their output gradients.
    _sum_only(ctx, "all_reduce")
    return torch.ops.ringlet.all_reduce(grad, "sum", ctx.scale), None, None


def _save_dim(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.dim = inputs[1]


def _all_gather_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    # Block r of every rank's output is x_r: its gradient is the sum of those blocks.
    return torch.ops.ringlet.reduce_scatter(grad, "sum", 1.0, ctx.dim), None


def _reduce_scatter_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    _sum_only(ctx, "reduce_scatter")
    return torch.ops.ringlet.all_gather(grad * ctx.scale, ctx.dim), None, None, None


def _save_root(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.root = inputs[1]


def _broadcast_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    # Only the root's input reaches the outputs: it collects every gradient.
    total = torch.ops.ringlet.all_reduce(grad, "sum", 1.0)
    return (total if groups.get_ordinal() == ctx.root else torch.zeros_like(total)), None


def _save_dims(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.split_dim, ctx.concat_dim = inputs[1], inputs[2]


def _all_to_all_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    # The exchange is a permutation of blocks: send the gradients back.
    return torch.ops.ringlet.all_to_all(grad, ctx.concat_dim, ctx.split_dim), None, None


_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd
_grad_enabled = torch.is_grad_enabled
_modes = torch._C._len_torch_dispatch_stack


def _register(
    name: str,
    cpu: Callable[..., Tensor],
    fake: Callable[..., Tensor],
    setup: Callable[..., None],
    backward: Callable[..., tuple[Any, ...]],
    defaults: tuple[Any, ...],
) -> None:
    """Registers operator ``name``'s kernels: CPU, fake, and an Autograd kernel
    that records ``backward`` when the input needs a gradient, calls the CPU
    kernel directly for a plain CPU tensor (nothing else would run between),
    and otherwise passes the call on below autograd (tensor subclasses,
    dispatch modes, other devices)."""
    op = getattr(torch.ops.ringlet, name).default

    class _Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Tensor:
            with _BELOW_AUTOGRAD():
                out = op(*args)
            setup(ctx, args, out)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
            return backward(ctx, grad)

    _Fn.__name__ = _Fn.__qualname__ = f"{name}_backward"

    def autograd_kernel(keyset: Any, x: Tensor, *args: Any) -> Tensor:
        if len(args) < len(defaults):  # the dispatcher passes what the caller gave
            args += defaults[len(args):]
        if x.requires_grad and _grad_enabled():
            return _Fn.apply(x, *args)
        if type(x) is Tensor and x.is_cpu and not _modes():
            return cpu(x, *args)
        return op.redispatch(keyset & _AFTER_AUTOGRAD, x, *args)

    _lib.impl(name, cpu, "CPU")
    _lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    torch.library.register_fake(f"ringlet::{name}", fake, lib=_lib)


# -- eager calls without the dispatcher ------------------------------------
#
# Between a Python call of torch.ops.ringlet.X and the CPU kernel, torch's
# dispatcher spends about 2 us (argument boxing, the Autograd key, the hop
# back into Python), three times the engine's 4 KiB all-reduce. When none of
# what it would do applies - the input is a plain tensor that needs no
# gradient, and no dispatch or function mode, functorch transform or
# profiler is active - the call goes to the engine's fast path directly and
# gives the same result. Anything else (tensor subclasses, FakeTensor,
# torch.compile's tracing, vmap, keyword arguments, other devices, a world of
# one, any argument the fast path does not take as it is) goes through the
# dispatcher as before.

_tf_modes = torch._C._is_torch_function_mode_enabled
_transforms = torch._C._functorch.peek_interpreter_stack
_profiling = torch._C._autograd._profiler_enabled
_NUMBER = (float, int)


class _EagerPacket(torch._ops.OpOverloadPacket):
    """``torch.ops.ringlet.<op>`` with the eager fast path above."""

    _fast: Callable[..., Optional[Tensor]]
    _most: int  # the schema's argument count (more: the dispatcher's error)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        if args and not kwargs and len(args) <= self._most:
            x = args[0]
            if (type(x) is Tensor and not (x.requires_grad and _grad_enabled()) and not _modes()
                    and not _tf_modes() and _transforms() is None and not _profiling()):
                out = self._fast(*args)
                if out is not None:
                    return out
        return super().__call__(*args, **kwargs)


def _all_reduce_fast(x: Tensor, reduce_type: Any = "sum", scale: Any = 1.0) -> Optional[Tensor]:
    return _all_reduce_direct(x, reduce_type, scale) if type(scale) in _NUMBER else None


def _all_gather_fast(x: Tensor, dim: Any = 0) -> Optional[Tensor]:
    if type(dim) is not int or x.dim() == 0 or dim % x.dim():
        return None
    return world_all_gather(x, None)


def _reduce_scatter_fast(
    x: Tensor, reduce_type: Any = "sum", scale: Any = 1.0, dim: Any = 0
) -> Optional[Tensor]:
    if type(scale) not in _NUMBER or type(dim) is not int or x.dim() == 0 or dim % x.dim():
        return None
    return world_reduce_scatter(reduce_type, x, scale, groups.world_size(), None)


def _broadcast_fast(x: Tensor, root: Any = 0) -> Optional[Tensor]:
    out = x.clone()
    return out if world_broadcast(out, root) else None


def _eager(name: str, fast: Callable[..., Optional[Tensor]]) -> None:
    packet = getattr(torch.ops.ringlet, name)
    packet.__class__ = _EagerPacket  # the same object, so references taken earlier agree
    packet._fast = fast
    packet._most = fast.__code__.co_argcount


_register("all_reduce", _all_reduce_cpu, _same_fake, _save_reduce, _all_reduce_backward,
          ("sum", 1.0))
_register("all_gather", _all_gather_cpu, _all_gather_fake, _save_dim, _all_gather_backward, (0,))
_register("reduce_scatter", _reduce_scatter_cpu, _reduce_scatter_fake, _save_reduce,
          _reduce_scatter_backward, ("sum", 1.0, 0))
_register("broadcast", _broadcast_cpu, _same_fake, _save_root, _broadcast_backward, (0,))
_register("all_to_all", _all_to_all_cpu, _all_to_all_fake, _save_dims, _all_to_all_backward,
          (0, 0))

_eager("all_reduce", _all_reduce_fast)
_eager("all_gather", _all_gather_fast)
_eager("reduce_scatter", _reduce_scatter_fast)
_eager("broadcast", _broadcast_fast)
