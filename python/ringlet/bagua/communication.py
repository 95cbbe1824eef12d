"""Bagua's ``bagua.torch_api.communication``: process groups, their
communicators, and collectives on tensors, over ringlet's engine.

:func:`init_process_group` joins ringlet (:func:`ringlet.init`, from the
launcher's environment or a given store), starts ``torch.distributed`` on
the ``"ringlet"`` backend when nothing started it yet (Bagua starts it too),
and makes the default group. :func:`new_group` names a subset of ranks; as
in Bagua, creating it costs nothing, and each of its three communicators
(``get_global_communicator()``, ``get_intra_node_communicator()``,
``get_inter_node_communicator()``) connects its members the first time they
ask for it. A rank outside a communicator gets
:attr:`CommMember.NON_COMM_MEMBER`, and every collective called with it
returns at once, as in Bagua.

The collectives take CPU tensors (ringlet's engine works in host memory;
Bagua's take CUDA ones). ``src``/``dst`` are ranks *in the communicator*.

Example:
  >>> import ringlet.compat.bagua as bagua
  >>> bagua.init_process_group()
  >>> g = bagua.communication.new_group(ranks=[1, 3])
  >>> t = torch.ones(4) * bagua.get_rank()
  >>> bagua.communication.allreduce(t, t, comm=g.get_global_communicator())
  >>> t                                  # on ranks 1 and 3: 1 + 3
  tensor([4., 4., 4., 4.])
"""

from __future__ import annotations

import io
import itertools
import pickle
import threading
import weakref
from datetime import timedelta
from enum import IntEnum
from functools import cache
from typing import Any, Optional

import torch

from .. import runtime
from .._engine import _check
from ..core import connect_members
from ..errors import NotInitializedError
from . import env
from .env import get_rank

__all__ = [
    "BaguaProcessGroup",
    "CommMember",
    "Communicator",
    "ReduceOp",
    "allgather",
    "allgather_inplace",
    "allreduce",
    "allreduce_coalesced_inplace",
    "allreduce_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "barrier",
    "broadcast",
    "broadcast_coalesced",
    "broadcast_object",
    "from_torch_group",
    "gather",
    "gather_inplace",
    "get_backend",
    "get_communicator",
    "init_process_group",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "scatter",
    "scatter_inplace",
    "send",
]


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
    return runtime._require().hosts


def _connect(key: str, members: list[int], name: str, levels: bool = True) -> Any:
    """Connects ``members`` (global ranks, this rank among them) under
    ``key`` of ringlet's store (two levels inside the engine when they span
    hosts and ``levels``)."""
    state = runtime._require()
    c, _ = runtime._connect_members(state.store, key, members, state.rank, state.addr,
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
        state = runtime._require()
        key = f"{state.prefix}/bagua/pg{self.group_name}/{tag}"
        title = f"algorithm {tag} of process group {self.group_name} {self.ranks}"
        hosts = _hosts()
        mine = runtime._HostTable(hosts[r] for r in self.ranks)
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
        state = runtime._require()
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
      >>> import ringlet.compat.bagua as bagua
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
            runtime.init(rank=rank, world_size=world_size, store=store)
        else:
            runtime.init()
        state = runtime._require()
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


runtime.on_shutdown(_shutdown)


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
    state = runtime._require()
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
      ringlet.tensor.TensorModule: The module, created on first use.

    Example:
      >>> bagua.communication.get_backend(model.bagua_module_name).wait_pending_comm_ops()
    """
    from .tensor import get_module

    return get_module(model_name)


# -- collectives ---------------------------------------------------------------


def _resolve(c: Any) -> Optional[Communicator]:
    """The communicator to run on (None: this rank is outside it)."""
    if _rank_not_in_comm(c):
        return None
    if c is None or c is CommMember.WORLD:
        c = _get_default_group().get_global_communicator()
        if c is CommMember.NON_COMM_MEMBER:
            return None
    if not isinstance(c, Communicator):
        raise TypeError(f"comm must be a Communicator of a process group, got {type(c).__name__}")
    return c


def _op_name(op: Any, dtype: torch.dtype) -> str:
    try:
        op = ReduceOp(int(op))
    except ValueError:
        raise ValueError(f"unknown reduce op {op!r}: use bagua.ReduceOp") from None
    name = _OP_NAMES.get(op)
    if name is None:
        raise ValueError(f"reduce op {op.name} is not supported by ringlet")
    if op is ReduceOp.AVG and not dtype.is_floating_point:
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {dtype}")
    return name


def _finish(op: Any, t: torch.Tensor, n: int) -> None:
    if int(op) == ReduceOp.AVG and n > 1:
        t.div_(n)


def _same_size(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.numel() != b.numel() or a.dtype != b.dtype:
        raise ValueError(
            f"rank {get_rank()}: {what}: the send tensor holds {a.numel()} {a.dtype} elements "
            f"and the receive tensor {b.numel()} {b.dtype}"
        )


def send(tensor: torch.Tensor, dst: int, comm: Any = None) -> None:
    """Sends ``tensor`` to rank ``dst`` of the communicator (blocking).

    Args:
      tensor (torch.Tensor): What to send.
      dst (int): The receiver's rank in the communicator.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    name = _check(tensor, "send tensor")
    if not 0 <= dst < c.nranks() or dst == c.rank():
        raise ValueError(f"rank {get_rank()}: send to {dst} of a {c.nranks()}-rank communicator")
    pair, peer = runtime._pair(c.ranks[dst])
    pair.send(tensor.data_ptr(), tensor.nbytes, name, peer, 0)


def recv(tensor: torch.Tensor, src: int, comm: Any = None) -> None:
    """Receives into ``tensor`` what rank ``src`` of the communicator sends.

    Args:
      tensor (torch.Tensor): Where to receive.
      src (int): The sender's rank in the communicator.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    name = _check(tensor, "recv tensor")
    if not 0 <= src < c.nranks() or src == c.rank():
        raise ValueError(f"rank {get_rank()}: recv from {src} of a {c.nranks()}-rank communicator")
    pair, peer = runtime._pair(c.ranks[src])
    pair.recv(tensor.data_ptr(), tensor.nbytes, name, peer, 0)


def broadcast(tensor: torch.Tensor, src: int = 0, comm: Any = None) -> None:
    """Copies rank ``src``'s ``tensor`` into every rank's ``tensor``.

    Args:
      tensor (torch.Tensor): Sent on ``src``, received elsewhere.
      src (int): The root's rank in the communicator. Default: 0.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    name = _check(tensor, "broadcast tensor")
    c._core.broadcast(tensor.data_ptr(), tensor.nbytes, name, int(src))


def broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0, comm: Any = None) -> None:
    """Broadcasts several tensors as one buffer.

    Args:
      tensors (list[torch.Tensor]): Tensors of one dtype.
      src (int): The root's rank in the communicator. Default: 0.
      comm (Communicator, optional): Default: the default group's.
    """
    if _resolve(comm) is None or not tensors:
        return
    flat = torch._utils._flatten_dense_tensors(tensors)
    broadcast(flat, src, comm)
    for t, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)


def broadcast_object(obj: object, src: int = 0, comm: Any = None) -> object:
    """Pickles ``obj`` on rank ``src`` and returns it on every rank.

    Args:
      obj (object): Anything picklable (on ``src``).
      src (int): The root's rank in the communicator. Default: 0.
      comm (Communicator, optional): Default: the default group's.

    Returns:
      object: ``src``'s object.
    """
    c = _resolve(comm)
    if c is None:
        return obj
    if c.rank() == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    broadcast(size, src, c)
    if c.rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    broadcast(payload, src, c)
    if c.rank() == src:
        return obj
    return pickle.load(io.BytesIO(payload.numpy().tobytes()))


def reduce(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    comm: Any = None,
) -> None:
    """Reduces every rank's ``send_tensor`` into rank ``dst``'s
    ``recv_tensor`` (other ranks' ``recv_tensor`` is left as it was).

    Args:
      send_tensor (torch.Tensor): This rank's input.
      recv_tensor (torch.Tensor): The result, on ``dst``.
      dst (int): The receiver's rank in the communicator.
      op (ReduceOp): Default: ``SUM``.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    _same_size(send_tensor, recv_tensor, "reduce")
    tmp = send_tensor.detach().clone()
    allreduce_inplace(tmp, op, c)
    if c.rank() == dst:
        recv_tensor.copy_(tmp.view_as(recv_tensor))


def reduce_inplace(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM,
                   comm: Any = None) -> None:
    """:func:`reduce` with ``tensor`` as input and (on ``dst``) output.

    Args:
      tensor (torch.Tensor): Input, and the result on ``dst``.
      dst (int): The receiver's rank in the communicator.
      op (ReduceOp): Default: ``SUM``.
      comm (Communicator, optional): Default: the default group's.
    """
    reduce(tensor, tensor, dst, op, comm)


def allreduce_coalesced_inplace(tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                                comm: Any = None) -> None:
    """All-reduces several tensors as one buffer, in place.

    Args:
      tensors (list[torch.Tensor]): Tensors of one dtype.
      op (ReduceOp): Default: ``SUM``.
      comm (Communicator, optional): Default: the default group's.
    """
    if _resolve(comm) is None or not tensors:
        return
    flat = torch._utils._flatten_dense_tensors(tensors)
    allreduce_inplace(flat, op, comm)
    for t, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)


def allreduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor,
              op: ReduceOp = ReduceOp.SUM, comm: Any = None) -> None:
    """Reduces every rank's ``send_tensor`` into every rank's ``recv_tensor``
    (they may be the same tensor).

    Args:
      send_tensor (torch.Tensor): This rank's input.
      recv_tensor (torch.Tensor): The result.
      op (ReduceOp): Default: ``SUM``.
      comm (Communicator, optional): Default: the default group's.

    Example:
      >>> bagua.allreduce(t, t)      # in place: the sum over the ranks
    """
    c = _resolve(comm)
    if c is None:
        return
    _same_size(send_tensor, recv_tensor, "allreduce")
    if recv_tensor.data_ptr() != send_tensor.data_ptr():
        recv_tensor.copy_(send_tensor.view_as(recv_tensor))
    allreduce_inplace(recv_tensor, op, c)


def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Any = None) -> None:
    """All-reduces ``tensor`` in place.

    Args:
      tensor (torch.Tensor): Input and output.
      op (ReduceOp): Default: ``SUM``.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    name = _check(tensor, "allreduce tensor")
    c._core.all_reduce(tensor.data_ptr(), tensor.nbytes, name, _op_name(op, tensor.dtype))
    _finish(op, tensor, c.nranks())


def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Any = None) -> None:
    """Gathers every rank's ``send_tensor`` into ``recv_tensor`` (block r
    from rank r; ``nranks`` times the size).

    Args:
      send_tensor (torch.Tensor): This rank's block.
      recv_tensor (torch.Tensor): The blocks of all ranks.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    name = _check(send_tensor, "allgather send tensor")
    _check(recv_tensor, "allgather recv tensor")
    c._core.all_gather(send_tensor.data_ptr(), send_tensor.nbytes, recv_tensor.data_ptr(),
                       recv_tensor.nbytes, name)


def _block(tensor: torch.Tensor, n: int, what: str) -> int:
    if tensor.numel() % n:
        raise ValueError(
            f"rank {get_rank()}: {what} holds {tensor.numel()} elements, not a multiple of the "
            f"communicator's {n} ranks"
        )
    return tensor.numel() // n


def allgather_inplace(tensor: torch.Tensor, comm: Any = None) -> None:
    """:func:`allgather` where this rank's block is its slot of ``tensor``.

    Args:
      tensor (torch.Tensor): ``nranks`` blocks; block ``rank`` is sent.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    _check(tensor, "allgather tensor")
    b = _block(tensor, c.nranks(), "allgather tensor")
    mine = tensor.view(-1)[c.rank() * b:(c.rank() + 1) * b].clone()
    allgather(mine, tensor, c)


def gather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int,
           comm: Any = None) -> None:
    """Gathers every rank's ``send_tensor`` into rank ``dst``'s ``recv_tensor``.

    Args:
      send_tensor (torch.Tensor): This rank's block.
      recv_tensor (torch.Tensor): The blocks of all ranks (on ``dst``; its
        size matters there only, as in Bagua).
      dst (int): The receiver's rank in the communicator.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    out = torch.empty(send_tensor.numel() * c.nranks(), dtype=send_tensor.dtype)
    allgather(send_tensor.contiguous(), out, c)
    if c.rank() == dst:
        recv_tensor.view(-1).copy_(out)


def gather_inplace(tensor: torch.Tensor, count: int, dst: int, comm: Any = None) -> None:
    """:func:`gather` of ``count`` elements per rank; on ``dst`` ``tensor``
    holds ``nranks * count`` elements (its own block at its rank), elsewhere
    ``count``.

    Args:
      tensor (torch.Tensor): Input (and output on ``dst``).
      count (int): Elements per rank.
      dst (int): The receiver's rank in the communicator.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    flat = tensor.view(-1)
    mine = flat[dst * count:(dst + 1) * count] if c.rank() == dst else flat[:count]
    out = torch.empty(count * c.nranks(), dtype=tensor.dtype)
    allgather(mine.clone(), out, c)
    if c.rank() == dst:
        flat.copy_(out)


def scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, src: int,
            comm: Any = None) -> None:
    """Sends block r of rank ``src``'s ``send_tensor`` to rank r's ``recv_tensor``.

    Args:
      send_tensor (torch.Tensor): ``nranks`` blocks (on ``src``).
      recv_tensor (torch.Tensor): This rank's block.
      src (int): The root's rank in the communicator.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    n = recv_tensor.numel()
    full = (send_tensor.detach().contiguous().view(-1).clone() if c.rank() == src
            else torch.empty(n * c.nranks(), dtype=recv_tensor.dtype))
    broadcast(full, src, c)
    recv_tensor.view(-1).copy_(full[c.rank() * n:(c.rank() + 1) * n])


def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm: Any = None) -> None:
    """:func:`scatter` of ``count`` elements per rank within ``tensor``.

    Args:
      tensor (torch.Tensor): ``nranks * count`` elements on ``src``, at
        least ``count`` elsewhere (the first ``count`` receive the block).
      count (int): Elements per rank.
      src (int): The root's rank in the communicator.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    flat = tensor.view(-1)
    full = (flat.clone() if c.rank() == src
            else torch.empty(count * c.nranks(), dtype=tensor.dtype))
    broadcast(full, src, c)
    if c.rank() != src:
        flat[:count].copy_(full[c.rank() * count:(c.rank() + 1) * count])


def reduce_scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor,
                   op: ReduceOp = ReduceOp.SUM, comm: Any = None) -> None:
    """Reduces block r of every rank's ``send_tensor`` into rank r's
    ``recv_tensor``.

    Args:
      send_tensor (torch.Tensor): ``nranks`` blocks.
      recv_tensor (torch.Tensor): This rank's reduced block.
      op (ReduceOp): Default: ``SUM``.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    name = _check(send_tensor, "reduce_scatter send tensor")
    _check(recv_tensor, "reduce_scatter recv tensor")
    c._core.reduce_scatter(send_tensor.data_ptr(), send_tensor.nbytes, recv_tensor.data_ptr(),
                           recv_tensor.nbytes, name, _op_name(op, send_tensor.dtype))
    _finish(op, recv_tensor, c.nranks())


def reduce_scatter_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                           comm: Any = None) -> None:
    """:func:`reduce_scatter` whose result lands in this rank's block of
    ``tensor``.

    Args:
      tensor (torch.Tensor): ``nranks`` blocks.
      op (ReduceOp): Default: ``SUM``.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    _check(tensor, "reduce_scatter tensor")
    b = _block(tensor, c.nranks(), "reduce_scatter tensor")
    out = torch.empty(b, dtype=tensor.dtype)
    reduce_scatter(tensor.clone(), out, op, c)
    tensor.view(-1)[c.rank() * b:(c.rank() + 1) * b].copy_(out)


def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Any = None) -> None:
    """Sends block j of ``send_tensor`` to rank j, receiving block i of
    ``recv_tensor`` from rank i (equal blocks).

    Args:
      send_tensor (torch.Tensor): ``nranks`` blocks.
      recv_tensor (torch.Tensor): ``nranks`` blocks.
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    n = c.nranks()
    b = _block(send_tensor, n, "alltoall send tensor")
    _same_size(send_tensor, recv_tensor, "alltoall")
    alltoall_v(send_tensor, [b] * n, [i * b for i in range(n)],
               recv_tensor, [b] * n, [i * b for i in range(n)], c)


def alltoall_inplace(tensor: torch.Tensor, comm: Any = None) -> None:
    """:func:`alltoall` with ``tensor`` as input and output.

    Args:
      tensor (torch.Tensor): ``nranks`` blocks.
      comm (Communicator, optional): Default: the default group's.
    """
    if _resolve(comm) is None:
        return
    alltoall(tensor.clone(), tensor, comm)


def _displacements(displs: list[int], n: int, what: str) -> list[int]:
    """The first ``n`` displacements: Bagua's callers pass ``n`` or ``n + 1``
    (the last one the total, which Bagua reads past); anything else raises."""
    if len(displs) not in (n, n + 1):
        raise ValueError(
            f"rank {get_rank()}: {what} needs {n} entries (or {n + 1}, Bagua's form with the "
            f"total last), got {len(displs)}"
        )
    return list(displs[:n])


def alltoall_v(send_tensor: torch.Tensor, send_counts: list[int], send_displs: list[int],
               recv_tensor: torch.Tensor, recv_counts: list[int], recv_displs: list[int],
               comm: Any = None) -> None:
    """All-to-all with per-rank counts and displacements (in elements).

    Args:
      send_tensor (torch.Tensor): The blocks to send.
      send_counts (list[int]): Elements for each rank.
      send_displs (list[int]): Where each rank's block starts: ``n`` entries, or
        ``n + 1`` as Bagua's examples pass them (the last one is not read).
      recv_tensor (torch.Tensor): Where blocks land.
      recv_counts (list[int]): Elements from each rank.
      recv_displs (list[int]): Where each rank's block goes (``n`` or ``n + 1``
        entries, as ``send_displs``).
      comm (Communicator, optional): Default: the default group's.

    Raises:
      ValueError: Counts without ``n`` entries, or displacements with neither
        ``n`` nor ``n + 1``.

    Example:
      >>> bagua.alltoall_v(send, [2, 2], [0, 2, 4], recv, [2, 2], [0, 2, 4])
    """
    c = _resolve(comm)
    if c is None:
        return
    name = _check(send_tensor, "alltoall_v send tensor")
    _check(recv_tensor, "alltoall_v recv tensor")
    n = c.nranks()
    for what, v in (("send_counts", send_counts), ("recv_counts", recv_counts)):
        if len(v) != n:
            raise ValueError(f"rank {get_rank()}: {what} needs {n} entries, got {len(v)}")
    send_displs = _displacements(send_displs, n, "send_displs")
    recv_displs = _displacements(recv_displs, n, "recv_displs")
    for what, displs, counts, t in (("send", send_displs, send_counts, send_tensor),
                                    ("recv", recv_displs, recv_counts, recv_tensor)):
        for peer, (d, k) in enumerate(zip(displs, counts)):
            if d < 0 or k < 0 or d + k > t.numel():
                raise ValueError(
                    f"rank {get_rank()}: {what}_displs[{peer}] = {d} with {what}_counts[{peer}] "
                    f"= {k} falls outside the {what} tensor's {t.numel()} elements"
                )
    src = send_tensor.view(-1)
    packed_in = torch.cat([src[d:d + k] for d, k in zip(send_displs, send_counts)]) if n else src
    packed_out = torch.empty(sum(recv_counts), dtype=recv_tensor.dtype)
    c._core.all_to_all_v(packed_in.data_ptr(), packed_in.nbytes, list(send_counts),
                         packed_out.data_ptr(), packed_out.nbytes, list(recv_counts), name)
    dst = recv_tensor.view(-1)
    at = 0
    for d, k in zip(recv_displs, recv_counts):
        dst[d:d + k].copy_(packed_out[at:at + k])
        at += k


def alltoall_v_inplace(tensor: torch.Tensor, counts: list[int], displs: list[int],
                       comm: Any = None) -> None:
    """:func:`alltoall_v` with ``tensor`` as input and output.

    Args:
      tensor (torch.Tensor): Input and output.
      counts (list[int]): Elements for (and from) each rank.
      displs (list[int]): Where each rank's block starts (``n`` or ``n + 1``
        entries, as in :func:`alltoall_v`).
      comm (Communicator, optional): Default: the default group's.
    """
    if _resolve(comm) is None:
        return
    alltoall_v(tensor.clone(), counts, displs, tensor, counts, displs, comm)


def barrier(comm: Any = None) -> None:
    """Blocks until every rank of the communicator reached it.

    Args:
      comm (Communicator, optional): Default: the default group's.
    """
    c = _resolve(comm)
    if c is None:
        return
    c.barrier()

