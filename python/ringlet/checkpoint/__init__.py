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

from .core import CheckpointingException
from .integration import sharded_state_dict, sharded_tensor_mapping
from .mapping import (
    CommonStateDict,
    FactoryBuildFn,
    FactoryMergeFn,
    LocalNonpersistentObject,
    ReplicaId,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from .serialization import (
    CkptShardedMetadata,
    check_is_distributed_checkpoint,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_sharded_metadata,
    load_tensors_metadata,
    save,
)
from .validation import StrictHandling, parse_strict_flag

__all__ = [
    "CheckpointingException",
    "CkptShardedMetadata",
    "CommonStateDict",
    "FactoryBuildFn",
    "FactoryMergeFn",
    "LocalNonpersistentObject",
    "ReplicaId",
    "ShardedBase",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StateDict",
    "StrictHandling",
    "apply_factories",
    "apply_factory_merges",
    "check_is_distributed_checkpoint",
    "is_main_replica",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "parse_strict_flag",
    "save",
    "sharded_state_dict",
    "sharded_tensor_mapping",
]
