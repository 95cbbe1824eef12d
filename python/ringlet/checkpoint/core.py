"""Exception type and small helpers shared by the ``ringlet.checkpoint`` modules."""

from __future__ import annotations

__all__ = ["CheckpointingException"]


class CheckpointingException(Exception):
    """Raised for every inconsistency found while describing, saving or loading a checkpoint.

    This covers metadata that contradicts itself (for example a local shape that
    does not match the tensor it describes), sharding that does not cover a global
    tensor exactly, and problems with the files on disk (a missing or truncated
    shard, a directory that is not a checkpoint, a key that was never saved).
    The message always names the offending key, file or directory.

    Example:
        >>> from ringlet.checkpoint import CheckpointingException, ShardedTensor
        >>> import torch
        >>> try:
        ...     ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 3, 2))
        ... except CheckpointingException as err:
        ...     print("rejected")
        rejected
    """
