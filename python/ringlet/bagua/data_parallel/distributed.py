"""Bagua's ``bagua.torch_api.data_parallel.distributed``: the
``DistributedDataParallel`` wrapper with torch DDP's interface and Bagua's
``optimizers`` and ``algorithm`` arguments, and ``to_bagua_process_group``.

``DistributedDataParallel_V1_9_0`` (Bagua's name for the wrapper class) is
the same class here; Bagua's fallback to torch's own DDP for arguments it
does not support is not taken: those arguments are accepted and unused.

Example:
  >>> from ringlet.bagua.compat.data_parallel.distributed import DistributedDataParallel
  >>> net = DistributedDataParallel(model, optimizers=[opt], algorithm=algorithm)
  >>> net.bagua_algorithm.abort(net)        # asynchronous averaging: the wrapper is accepted
"""

from __future__ import annotations

from typing import Any

from ..communication import BaguaProcessGroup
from . import BaguaDistributedDataParallel, DistributedDataParallel, _to_bagua_group

__all__ = [
    "BaguaDistributedDataParallel",
    "DistributedDataParallel",
    "DistributedDataParallel_V1_9_0",
    "to_bagua_process_group",
]

DistributedDataParallel_V1_9_0 = DistributedDataParallel


def to_bagua_process_group(process_group: Any = None) -> BaguaProcessGroup:
    """Returns the Bagua process group for a torch process group, a Bagua
    process group or ``None`` (the default group), as Bagua's function.

    Args:
      process_group (torch.distributed.ProcessGroup or BaguaProcessGroup, optional):
        The group. Default: the default Bagua group.

    Returns:
      BaguaProcessGroup: The Bagua group (a torch group's is made once, collectively).

    Raises:
      TypeError: Anything else.

    Example:
      >>> to_bagua_process_group(torch.distributed.new_group([0, 1])).ranks
      [0, 1]
    """
    import torch.distributed as dist

    if process_group is not None and not isinstance(
        process_group, (BaguaProcessGroup, dist.ProcessGroup)
    ):
        raise TypeError(
            f"to_bagua_process_group: expected a torch.distributed ProcessGroup, a "
            f"BaguaProcessGroup or None, got {type(process_group).__name__}"
        )
    return _to_bagua_group(process_group)
