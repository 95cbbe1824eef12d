"""Bagua's process groups and their communicators (the first half of
``bagua.torch_api.communication``; :mod:`ringlet.bagua.communication` holds
the collectives and re-exports everything here): the default group,
:func:`new_group`, :func:`from_torch_group`, each group's global, intra- and
inter-node communicators, connected on first use, and what
:func:`ringlet.shutdown` closes.

Example:
  >>> from ringlet.bagua import process_group
  >>> g = process_group.new_group(ranks=[0, 2])
  >>> g.get_global_communicator()
"""

from __future__ import annotations

import itertools
import threading
import weakref
from datetime import timedelta
from enum import IntEnum
from functools import cache
from typing import Any, Optional

from ..core import connect_members, connection, groups
from ..errors import NotInitializedError
from . import env
from .env import get_rank


class ReduceOp(IntEnum):
    """Bagua's reduction operations: ``SUM``, ``PRODUCT``, ``MIN``, ``MAX``,
    ``BOR``, ``BAND``, ``BXOR`` and ``AVG`` (Aluminum's numbering).
    ``BXOR`` is refused: ringlet's engine has no exclusive or."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


_OP_NAMES = {
    ReduceOp.SUM: "sum",
    ReduceOp.PRODUCT: "mul",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.BOR: "or",
    ReduceOp.BAND: "and",
    ReduceOp.AVG: "sum",
}


class comm:
    """Bagua's ``comm.WORLD``: the default group's global communicator."""

    WORLD = object()


class CommMember:
    """``WORLD`` (the default group's global communicator) and
    ``NON_COMM_MEMBER``, what a rank outside a communicator gets."""

    WORLD = comm.WORLD
    NON_COMM_MEMBER = object()


class Communicator:
    """One rank's endpoint in a communicator of a process group (Bagua's
    ``BaguaSingleCommunicatorPy``).

    Example:
      >>> c = bagua.communication.new_group([0, 1]).get_global_communicator()
      >>> c.rank(), c.nranks()
      (0, 2)
    """

    def __init__(self, core: Any, ranks: list[int], name: str) -> None:
        self._core = core
        self.ranks = list(ranks)
        self.name = name

    def rank(self) -> int:
        """Returns this rank's position in the communicator."""
        return int(self._core.rank)

    def nranks(self) -> int:
        """Returns the number of ranks in the communicator."""
        return int(self._core.size)

    def device_id(self) -> int:
        """Returns the local rank (Bagua's CUDA device index)."""
        return env.get_local_rank()

    def barrier(self) -> None:
        """Blocks until every rank of the communicator reached it."""
        self._core.barrier()

    def abort(self) -> None:
        """Closes the communicator; later collectives on it raise."""
        self._core.close()

    def check_abort(self) -> bool:
        """Returns whether the communicator failed or was closed."""
        return bool(self._core.failed())

    def __repr__(self) -> str:
        return f"Communicator({self.name!r}, ranks={self.ranks})"


_pg_group_ranks: dict[BaguaProcessGroup, dict[int, int]] = {}
_pg_map: dict[str, BaguaProcessGroup] = {}
_default_pg: Optional[BaguaProcessGroup] = None
_default_store: Any = None
_group_count = 0
_torch_to_bagua_pg_map: weakref.WeakKeyDictionary[Any, BaguaProcessGroup] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.RLock()


def _hosts() -> Any:
    return groups.require_state().hosts


def _connect(key: str, members: list[int], name: str, levels: bool = True) -> Any:
    """Connects ``members`` (global ranks, this rank among them) under
    ``key`` of ringlet's store (two levels inside the engine when they span
    hosts and ``levels``)."""
    state = groups.require_state()
    c, _ = connection.connect_group(state.store, key, members, state.rank, state.addr,
                                    state.timeout, name, state.domain, levels)
    return c


class BaguaProcessGroup:
    """A process group: its ranks and, on request, its communicators
    (Bagua's ``BaguaProcessGroup``). Make one with :func:`new_group`.

    Example:
      >>> g = bagua.communication.new_group(ranks=[0, 2])
      >>> g.ranks
      [0, 2]
    """

    def __init__(self, ranks: list[int], stream: Any, group_name: str) -> None:
        self.ranks = list(ranks)
        self.stream = stream
        self.group_name = group_name
        self._tags = itertools.count()
        self._closers: list[Any] = []

    def __repr__(self) -> str:
        return f"BaguaProcessGroup({self.group_name!r}, ranks={self.ranks})"

    def _get_intra_ranks(self) -> list[int]:
        """The group's ranks on this rank's host."""
        hosts = _hosts()
        mine = hosts[get_rank()]
        return [r for r in self.ranks if hosts[r] == mine]

    def _get_inter_ranks(self) -> list[int]:
        """The group's first rank on each host (the hosts' leaders), in
        group order (Bagua: the ranks at the first rank's local index,
        the same for groups with the same ranks on every host)."""
        hosts = _hosts()
        seen: dict[str, int] = {}
        for r in self.ranks:
            seen.setdefault(hosts[r], r)
        return list(seen.values())

    def get_global_communicator(self) -> Any:
        """Returns the communicator of all the group's ranks
        (:attr:`CommMember.NON_COMM_MEMBER` on other ranks)."""
        return get_communicator(self.group_name, "global")

    def get_inter_node_communicator(self) -> Any:
        """Returns the communicator of the hosts' leaders (the group's first
        rank on each host); :attr:`CommMember.NON_COMM_MEMBER` elsewhere."""
        return get_communicator(self.group_name, "inter")

    def get_intra_node_communicator(self) -> Any:
        """Returns the communicator of the group's ranks on this host."""
        return get_communicator(self.group_name, "intra")

    # -- ringlet: dedicated communicators for one algorithm instance --------

    def _require_member(self, what: str) -> None:
        if get_rank() not in self.ranks:
            raise ValueError(
                f"rank {get_rank()} is not in process group {self.group_name} "
                f"(ranks {self.ranks}): it cannot run {what}"
            )

    def _next_tag(self) -> str:
        """A name every member computes alike for the next algorithm
        instance made on this group (members make them in the same order)."""
        return f"a{next(self._tags)}"

    def _algorithm_comms(self, tag: str, hierarchical: bool) -> Any:
        """Connects the communicators of one algorithm instance (used by
        its worker thread only): the group's ranks (``hierarchical=False``),
        or Bagua's two levels. Collective over the group's members."""
        self._require_member("an algorithm")
        state = groups.require_state()
        key = f"{state.prefix}/bagua/pg{self.group_name}/{tag}"
        title = f"algorithm {tag} of process group {self.group_name} {self.ranks}"
        hosts = _hosts()
        mine = connection.HostTable(hosts[r] for r in self.ranks)
        mine.machine_ranks = getattr(hosts, "machine_ranks", 0)
        got = connect_members(state.store, key, self.ranks, state.rank, addr=state.addr,
                              timeout=state.timeout, name=title, domain=state.domain,
                              hierarchical=hierarchical, hosts=mine, flat=not hierarchical)
        self._closers.extend(got.closers)
        return got.comms

    def _dedicated(self, tag: str) -> Any:
        """Connects one communicator of all the group's ranks for one
        algorithm thread. Collective over the group's members."""
        self._require_member("an algorithm")
        state = groups.require_state()
        c = _connect(f"{state.prefix}/bagua/pg{self.group_name}/{tag}", self.ranks,
                     f"thread {tag} of process group {self.group_name} {self.ranks}")
        self._closers.append(c)
        return c


def _check_default_pg() -> None:
    if _default_pg is None:
        raise NotInitializedError(
            "Default process group is not initialized: call init_process_group() first"
        )


def is_initialized() -> bool:
    """Returns whether :func:`init_process_group` made the default group.

    Example:
      >>> bagua.communication.is_initialized()
      True
    """
    return _default_pg is not None


def _get_default_group() -> BaguaProcessGroup:
    if _default_pg is None:
        raise RuntimeError(
            "Default process group has not been initialized, "
            "please make sure to call init_process_group."
        )
    return _default_pg


def init_process_group(
    store: Any = None, rank: int = -1, world_size: int = -1, local_world_size: int = -1
) -> None:
    """Joins the job and makes the default process group (Bagua's
    ``init_process_group``).

    Without a store, ringlet reads the launcher's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: torchrun's, or set by
    hand); with one, ``rank``, ``world_size`` and ``local_world_size`` are
    required and exported to the environment, as Bagua does. When
    ``torch.distributed`` is not initialised yet it is started on the
    ``"ringlet"`` backend over the same store (Bagua starts it too, for
    :func:`from_torch_group` and the user's own calls).

    Args:
      store (torch.distributed.Store, optional): A store every rank shares.
        Default: None (the environment's).
      rank (int): This process's rank (with ``store``).
      world_size (int): Number of processes (with ``store``).
      local_world_size (int): Processes per host (with ``store``).

    Raises:
      RuntimeError: The default group exists already.
      ValueError: A store without a valid ``rank``, ``world_size`` and
        ``local_world_size``.

    Example:
      >>> import ringlet.bagua.compat as bagua
      >>> bagua.init_process_group()          # under torchrun
      >>> bagua.get_world_size()
      4
    """
    global _default_pg, _default_store
    import os

    with _lock:
        if _default_pg is not None:
            raise RuntimeError("trying to initialize the default process group twice!")
        if store is not None:
            if rank < 0 or world_size <= 0 or local_world_size <= 0:
                raise ValueError(
                    "init_process_group with a store needs rank >= 0, world_size > 0 and "
                    f"local_world_size > 0, got {rank}, {world_size}, {local_world_size}"
                )
            os.environ["RANK"] = str(rank)
            os.environ["WORLD_SIZE"] = str(world_size)
            os.environ["LOCAL_RANK"] = str(rank % local_world_size)
            os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
            groups.init(rank=rank, world_size=world_size, store=store)
        else:
            groups.init()
        state = groups.require_state()
        _default_store = state.store
        import torch.distributed as dist

        if dist.is_available() and not dist.is_initialized():
            if state.world_size == 1 or state.store is None:
                dist.init_process_group(
                    "ringlet", store=dist.HashStore(), rank=0, world_size=1
                )
            else:
                dist.init_process_group(
                    "ringlet",
                    store=dist.PrefixStore(f"{state.prefix}/torch", state.store),
                    rank=state.rank,
                    world_size=state.world_size,
                    timeout=timedelta(seconds=state.timeout),
                )
        _default_pg = new_group()


def _shutdown() -> None:
    """Forgets the default group and closes every group's communicators
    (run by :func:`ringlet.shutdown`)."""
    global _default_pg, _default_store, _group_count
    with _lock:
        for pg in list(_pg_map.values()):
            for c in pg._closers:
                c.close()
            pg._closers.clear()
        _pg_map.clear()
        _pg_group_ranks.clear()
        _default_pg = None
        _default_store = None
        _group_count = 0
        get_communicator.cache_clear()


groups.on_shutdown(_shutdown)


def new_group(ranks: Optional[list[int]] = None, stream: Any = None) -> BaguaProcessGroup:
    """Creates a process group of ``ranks`` (Bagua's ``new_group``).

    Every rank of the job must call it, in the same order, members or not
    (it only names the group; communicators connect their members when
    first asked for).

    Args:
      ranks (list[int], optional): Global ranks of the members. Default:
        every rank.
      stream: Bagua's CUDA stream; kept, unused (ringlet's engine works in
        host memory).

    Returns:
      BaguaProcessGroup: The group.

    Raises:
      ValueError: A rank outside ``[0, world_size)``.

    Example:
      >>> g = bagua.communication.new_group(ranks=[0, 1])
      >>> g.get_global_communicator().nranks()
      2
    """
    global _group_count
    world = env.get_world_size()
    with _lock:
        _group_count += 1
        if ranks is None:
            ranks = list(range(world))
        else:
            for r in ranks:
                if not isinstance(r, int) or not 0 <= r < world:
                    raise ValueError(
                        f"Invalid rank {r}, should be non-negative and less than world "
                        f"size {world}."
                    )
            ranks = sorted(set(ranks))
        if stream is None and _default_pg is not None:
            stream = _default_pg.stream
        pg = BaguaProcessGroup(ranks, stream, str(_group_count))
        _pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
        _pg_map[pg.group_name] = pg
    return pg


_torch_group_id = itertools.count()


def from_torch_group(group: Any, stream: Any = None) -> BaguaProcessGroup:
    """Returns the Bagua process group of a ``torch.distributed`` group's
    ranks (Bagua's ``from_torch_group``; collective over the whole job).

    Args:
      group (torch.distributed.ProcessGroup): The torch group.
      stream: Unused (see :func:`new_group`).

    Returns:
      BaguaProcessGroup: A group of the same ranks, in the same order.

    Example:
      >>> g = bagua.communication.from_torch_group(torch.distributed.new_group([1, 2]))
      >>> g.ranks
      [1, 2]
    """
    import torch.distributed as dist

    next(_torch_group_id)
    if group is None or group is dist.GroupMember.WORLD:
        return new_group(None, stream)
    try:
        ranks = list(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, AttributeError):
        # torch hands a rank outside a group a placeholder: the group is
        # named all the same (every rank counts groups alike), without it
        ranks = []
    return new_group(ranks, stream)


@cache
def get_communicator(group_name: str, comm_name: str) -> Any:
    """Returns one of a group's communicators, connecting it on first use
    (by its members only; Bagua's ``get_communicator``).

    Args:
      group_name (str): The group's ``group_name``.
      comm_name (str): ``"global"``, ``"inter"`` or ``"intra"``.

    Returns:
      Communicator: The communicator, or ``CommMember.NON_COMM_MEMBER``
      on a rank outside it.

    Raises:
      ValueError: Another ``comm_name``.

    Example:
      >>> bagua.communication.get_communicator("1", "global").nranks()
      4
    """
    pg = _pg_map[group_name]
    if comm_name == "global":
        ranks = pg.ranks
    elif comm_name == "inter":
        ranks = pg._get_inter_ranks()
    elif comm_name == "intra":
        ranks = pg._get_intra_ranks()
    else:
        raise ValueError("comm_name should be one of ['global', 'inter', 'intra']")
    if get_rank() not in ranks:
        return CommMember.NON_COMM_MEMBER
    state = groups.require_state()
    tag = ",".join(map(str, ranks))
    key = f"{state.prefix}/bagua/pg{group_name}/{comm_name}/{tag}"
    c = _connect(key, ranks, f"the {comm_name} communicator of process group "
                 f"{group_name} {ranks}", levels=comm_name == "global")
    pg._closers.append(c)
    return Communicator(c, ranks, f"{group_name}/{comm_name}")


def _rank_not_in_comm(comm: Any = None) -> bool:
    """Returns whether this rank is outside ``comm`` (``None`` counts as in)."""
    if comm is None:
        return False
    return comm is CommMember.NON_COMM_MEMBER


def _rank_not_in_group(group: Optional[BaguaProcessGroup] = None) -> bool:
    """Returns whether this rank is outside ``group`` (``None`` counts as in)."""
    if group is None:
        return False
    return _rank_not_in_comm(group.get_global_communicator())


def _bagua_backend_comm(comm: Any = None) -> Any:
    """``None`` when this rank is outside ``comm``, else ``comm``."""
    return None if _rank_not_in_comm(comm) else comm


def get_backend(model_name: str) -> Any:
    """Returns the tensor module (buckets and ordered worker) of a model
    (Bagua's per-model backend).

    Args:
      model_name (str): The model's ``bagua_module_name``.

    Returns:
      ringlet.parallel.tensor.TensorModule: The module, created on first use.

    Example:
      >>> bagua.communication.get_backend(model.bagua_module_name).wait_pending_comm_ops()
    """
    from ..parallel.tensor import get_module

    return get_module(model_name)
