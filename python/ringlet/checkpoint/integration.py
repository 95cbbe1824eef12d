"""Checkpointing modules whose parameters are sharded with :mod:`ringlet.xla.sharding`.

:func:`sharded_state_dict` turns a module into a sharded state dict in one
call: parameters and buffers sharded with ``mark_sharding`` contribute their
local shard (see :meth:`ringlet.xla.sharding.XLAShardedTensor.sharded_checkpoint_tensor`),
everything else is treated as replicated and written by rank 0 only. The entries
refer to the module's own storage, so :func:`ringlet.checkpoint.load` restores
the module in place, whatever mesh layout (or world size) the checkpoint was
saved with.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import groups
from .mapping import ShardedStateDict, ShardedTensor

__all__ = ["sharded_state_dict", "sharded_tensor_mapping"]

#: The attribute under which a tensor sharded in place (``mark_sharding`` on an
#: ``nn.Parameter``) keeps the sharded tensor that describes its layout. That object,
#: like any object with a ``sharded_checkpoint_tensor(key)`` method (an
#: ``XLAShardedTensor``), gives its own checkpoint mapping; this module needs no more
#: of the sharding layer than that.
LAYOUT_ATTR = "_ringlet_sharded_tensor"


def _layout_of(x: Any) -> Any:
    """The object that maps ``x`` into a checkpoint itself, or None."""
    owner = getattr(x, LAYOUT_ATTR, None) if isinstance(x, torch.Tensor) else x
    return owner if callable(getattr(owner, "sharded_checkpoint_tensor", None)) else None


def _rank() -> int:
    return int(groups.get_ordinal()) if groups.is_initialized() else 0


def sharded_tensor_mapping(key: str, tensor: Any) -> Any:
    """The checkpoint mapping of one (possibly sharded) tensor.

    Args:
        key (str): global name of the tensor in the checkpoint.
        tensor (Union[torch.Tensor, XLAShardedTensor]): a sharded tensor, a
            parameter sharded in place, or a plain tensor that is the same on
            every rank (only rank 0's copy is written).

    Returns:
        Union[ShardedTensor, ShardedTensorFactory]: an entry for a sharded state dict.

    Example:
        >>> sd = {"step_scale": sharded_tensor_mapping("step_scale", torch.ones(3))}
        >>> ringlet.checkpoint.save(sd, "/tmp/ckpt")
    """
    layout = _layout_of(tensor)
    if layout is not None:
        return layout.sharded_checkpoint_tensor(key)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{key!r}: expected a tensor, got {type(tensor).__name__}")
    return ShardedTensor.from_rank_offsets(key, tensor.detach(), replica_id=_rank())


def sharded_state_dict(module: torch.nn.Module, prefix: str = "") -> ShardedStateDict:
    """A sharded state dict of ``module`` for :func:`ringlet.checkpoint.save` / ``load``.

    Every entry of ``module.state_dict()`` becomes a mapping under
    ``prefix + name``: sharded parameters and buffers give their shard, plain
    tensors are replicated (rank 0 writes them), and non-tensor extra state is
    stored as a common value. Loading the checkpoint with the state dict of a
    module sharded differently (another mesh, spec or world size) fills each
    rank's shard with exactly its part.

    Args:
        module (torch.nn.Module): the module; call it on every rank.
        prefix (str): prepended to every key. Default: ``""``.

    Returns:
        ShardedStateDict: ``{key: ShardedTensor | ShardedTensorFactory | value}``.

    Example:
        >>> model = torch.nn.Linear(32, 8)
        >>> mark_sharding(model.weight, mesh, ("model", None))
        >>> ringlet.checkpoint.save(sharded_state_dict(model), "/tmp/ckpt")
        >>> ringlet.checkpoint.load(sharded_state_dict(model), "/tmp/ckpt")  # in place
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"sharded_state_dict needs an nn.Module, got {type(module).__name__}")
    out: ShardedStateDict = {}
    for name, value in module.state_dict(keep_vars=True).items():
        key = prefix + name
        if isinstance(value, torch.Tensor):
            out[key] = sharded_tensor_mapping(key, value)
        else:
            out[key] = value
    return out
