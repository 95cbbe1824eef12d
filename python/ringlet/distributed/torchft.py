"""ringlet for torchft: fault-tolerant training with ringlet's collectives.

`torchft <https://github.com/pytorch/torchft>`_ (``pip install torchft``, an
optional dependency: ``pip install "ringlet[torchft]"``) runs replica groups
that can fail and rejoin; its ``Manager`` reconfigures a process group on
every quorum change through a class it is given (``ProcessGroupGloo``,
``ProcessGroupNCCL``, ...). :class:`ProcessGroupRinglet` is that class for
ringlet, built as torchft's ``ProcessGroupGloo`` is: each ``configure`` gives
up the previous group (``abort``) and builds a new
:class:`ringlet.distributed.c10d.ProcessGroupRinglet` on the quorum's store.

Example:
  >>> from torchft import Manager, DistributedDataParallel
  >>> from torchft.optim import OptimizerWrapper
  >>> from ringlet.distributed.torchft import ProcessGroupRinglet
  >>> manager = Manager(pg=ProcessGroupRinglet(), min_replica_size=2,
  ...                   load_state_dict=load, state_dict=save, ...)
  >>> model = DistributedDataParallel(manager, model)
  >>> opt = OptimizerWrapper(manager, torch.optim.AdamW(model.parameters()))
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

try:
    from torchft.process_group import ProcessGroupWrapper
except ImportError as e:  # an optional dependency
    raise ImportError(
        "ringlet.distributed.torchft needs torchft: pip install torchft (or pip install "
        f"'ringlet[torchft]'); importing it failed: {e}"
    ) from e

from . import c10d

__all__ = ["ProcessGroupRinglet"]


class ProcessGroupRinglet(ProcessGroupWrapper):
    """A reconfigurable ringlet process group for torchft's ``Manager``
    (as torchft's ``ProcessGroupGloo``).

    ``Manager`` calls ``configure(store_addr, replica_id, rank, world_size,
    ...)`` on every new quorum: the previous group is aborted (a collective
    blocked on a lost replica raises at once) and a new one built on the
    quorum's store. Collectives (``allreduce``, ``allgather``,
    ``broadcast``, ``reduce_scatter``, ``alltoall_base``, ``send`` /
    ``recv``, ``barrier``) go to that group; unlike torchft's gloo group,
    ``reduce_scatter`` and ``reduce_scatter_tensor_coalesced`` work.

    Args:
      timeout (timedelta, optional): How long the store connection and each
        operation may wait for a peer. Default: 60 seconds (torchft's).
      pg (torchft.process_group.ProcessGroup, optional): A torchft process
        group to configure instead (torchft's wrapper argument). Default:
        ``None``.

    Raises:
      TypeError: ``timeout`` is not a ``timedelta``.
      ValueError: ``timeout`` is not positive.

    Example:
      >>> pg = ProcessGroupRinglet(timeout=timedelta(seconds=30))
      >>> manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load,
      ...                   state_dict=save, replica_id="a", ...)
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60), pg: Optional[Any] = None,
                 ) -> None:
        if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
            raise (ValueError if isinstance(timeout, timedelta) else TypeError)(
                f"ringlet.distributed.torchft.ProcessGroupRinglet: timeout must be a positive "
                f"datetime.timedelta, got {timeout!r}"
            )
        super().__init__(timeout=timeout, pg=pg)

    def _create_pg(self, store: Any, rank: int, world_size: int) -> c10d.ProcessGroupRinglet:
        """The quorum's group: a :class:`ringlet.distributed.c10d.ProcessGroupRinglet` on
        ``store`` (the quorum's prefix of the replica group's store)."""
        ranks = list(self._global_ranks or [])  # torchft's numbers of the replicas' ranks
        named = len(set(ranks)) == len(ranks) == world_size  # one distinct number per rank
        pg = c10d.ProcessGroupRinglet(store, rank, world_size, self._timeout,
                                      ranks if named else None)
        # Errors name the quorum and replica, as torchft's gloo group names itself.
        pg.setGroupDesc(f"torchft quorum {self._quorum_id} (replica {self._replica_id})")
        return pg

    def getBackendName(self) -> str:
        """torchft's name for the backend: ``"torchft-ringlet"``.

        Returns:
          str: ``"torchft-ringlet"``.

        Example:
          >>> ProcessGroupRinglet().getBackendName()
          'torchft-ringlet'
        """
        return "torchft-ringlet"

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the timeout of later groups and of the current one.

        Args:
          timeout (timedelta): The new timeout.

        Returns:
          None.

        Example:
          >>> pg.set_timeout(timedelta(seconds=10))
        """
        super().set_timeout(timeout)
        if isinstance(self._pg, c10d.ProcessGroupRinglet):
            self._pg.set_timeout(timeout)
