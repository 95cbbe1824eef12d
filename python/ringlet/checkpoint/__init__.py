"""Sharded checkpoints: describe how local pieces map onto global tensors, save and load them.

The mapping classes follow the model of Megatron-Core's ``dist_checkpointing``:
wrap each local tensor in a :class:`ShardedTensor` (usually with
:meth:`ShardedTensor.from_rank_offsets`), then call :func:`save` on every rank.
:func:`load` reads the checkpoint back into any other layout. A module whose
parameters are sharded with :func:`ringlet.xla.sharding.mark_sharding` is
checkpointed with ``save(sharded_state_dict(module), dir)``.

Example:
    >>> import torch, tempfile
    >>> from ringlet.checkpoint import ShardedTensor, save, load
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2, 2))}, d)
    >>> load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(2, 2))}, d)["w"].sum().item()
    4.0
"""

from . import mapping, serialization
from .core import CheckpointingException
from .integration import sharded_state_dict, sharded_tensor_mapping
from .mapping import *  # noqa: F403 (its __all__: the mapping classes)
from .serialization import *  # noqa: F403 (its __all__: save, load and the metadata readers)
from .validation import StrictHandling, parse_strict_flag

__all__ = [
    "CheckpointingException",
    "StrictHandling",
    "parse_strict_flag",
    "sharded_state_dict",
    "sharded_tensor_mapping",
    *mapping.__all__,
    *serialization.__all__,
]
