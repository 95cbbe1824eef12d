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
  >>> import ringlet.bagua.compat as bagua
  >>> bagua.init_process_group()
  >>> g = bagua.communication.new_group(ranks=[1, 3])
  >>> t = torch.ones(4) * bagua.get_rank()
  >>> bagua.communication.allreduce(t, t, comm=g.get_global_communicator())
  >>> t                                  # on ranks 1 and 3: 1 + 3
  tensor([4., 4., 4., 4.])
"""

from __future__ import annotations

import functools
import inspect
import io
import pickle
from typing import Any, Callable, Optional, TypeVar, cast

import torch

from ..core import engine, groups
from ..core.engine import check
from . import process_group as _pg
from .env import get_rank
from .process_group import (
    _OP_NAMES,
    BaguaProcessGroup,
    CommMember,
    Communicator,
    ReduceOp,
    _get_default_group,
    _rank_not_in_comm,
    from_torch_group,
    get_backend,
    get_communicator,
    init_process_group,
    is_initialized,
    new_group,
)

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


def __getattr__(name: str) -> Any:
    """The process-group half's other names (its state included, read live:
    ``communication._default_pg`` is the group now, not a copy)."""
    try:
        return getattr(_pg, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


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


_F = TypeVar("_F", bound=Callable[..., Any])


def _members_only(fn: _F) -> _F:
    """Runs the collective ``fn`` with its ``comm`` argument resolved to a
    :class:`Communicator` (:func:`_resolve`); on a rank outside it, returns
    None at once, as Bagua's collectives do."""
    at = list(inspect.signature(fn).parameters).index("comm")

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if len(args) > at:
            c = _resolve(args[at])
            args = (*args[:at], c, *args[at + 1:])
        else:
            c = kwargs["comm"] = _resolve(kwargs.get("comm"))
        if c is None:
            return None
        return fn(*args, **kwargs)

    return cast(_F, run)


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


def _point_to_point(op: Callable[..., None], what: str, to: str, tensor: torch.Tensor,
                    peer: int, c: Communicator) -> None:
    """:func:`send` or :func:`recv` (``op``: the engine's) with rank ``peer``
    of ``c``, over the pair's own communicator."""
    name = check(tensor, f"{what} tensor")
    if not 0 <= peer < c.nranks() or peer == c.rank():
        raise ValueError(
            f"rank {get_rank()}: {what} {to} {peer} of a {c.nranks()}-rank communicator")
    pair, pair_peer = groups.pair_comm(c.ranks[peer])
    op(pair, tensor, pair_peer, 0, name)


def _coalesced(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], None]) -> None:
    """Runs ``collective`` in place on the tensors flattened into one buffer,
    then copies the result back into them."""
    if not tensors:
        return
    flat = torch._utils._flatten_dense_tensors(tensors)
    collective(flat)
    for t, synced in zip(tensors, torch._utils._unflatten_dense_tensors(flat, tensors)):
        t.copy_(synced)


@_members_only
def send(tensor: torch.Tensor, dst: int, comm: Any = None) -> None:
    """Sends ``tensor`` to rank ``dst`` of the communicator (blocking).

    The two ranks talk over a communicator of their own, connected the first
    time either of them needs it; the group's other ranks take no part.

    Args:
      tensor (torch.Tensor): What to send.
      dst (int): The receiver's rank in the communicator; not this rank's
        (``ValueError``).
      comm (Communicator, optional): Default: the default group's.

    Example:
      >>> t = torch.arange(4.) if bagua.get_rank() == 0 else torch.zeros(4)
      >>> if bagua.get_rank() == 0:
      ...     bagua.communication.send(t, dst=1)
      ... elif bagua.get_rank() == 1:
      ...     bagua.communication.recv(t, src=0)   # t: tensor([0., 1., 2., 3.])
    """
    _point_to_point(engine.send, "send", "to", tensor, dst, comm)


@_members_only
def recv(tensor: torch.Tensor, src: int, comm: Any = None) -> None:
    """Receives into ``tensor`` what rank ``src`` of the communicator sends
    with :func:`send` (blocking; the pair is :func:`send`'s, and so is the
    example).

    Args:
      tensor (torch.Tensor): Where to receive: as many bytes, of the same
        dtype, as ``src`` sends.
      src (int): The sender's rank in the communicator; not this rank's
        (``ValueError``).
      comm (Communicator, optional): Default: the default group's.
    """
    _point_to_point(engine.recv, "recv", "from", tensor, src, comm)


@_members_only
def broadcast(tensor: torch.Tensor, src: int = 0, comm: Any = None) -> None:
    """Copies rank ``src``'s ``tensor`` into every rank's ``tensor``.

    Args:
      tensor (torch.Tensor): Sent on ``src``, received elsewhere.
      src (int): The root's rank in the communicator. Default: 0.
      comm (Communicator, optional): Default: the default group's.
    """
    name = check(tensor, "broadcast tensor")
    engine.broadcast(comm._core, tensor, int(src), name)


@_members_only
def broadcast_coalesced(tensors: list[torch.Tensor], src: int = 0, comm: Any = None) -> None:
    """Broadcasts several tensors as one buffer.

    Args:
      tensors (list[torch.Tensor]): Tensors of one dtype.
      src (int): The root's rank in the communicator. Default: 0.
      comm (Communicator, optional): Default: the default group's.
    """
    _coalesced(tensors, lambda flat: broadcast(flat, src, comm))


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


@_members_only
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
    _same_size(send_tensor, recv_tensor, "reduce")
    tmp = send_tensor.detach().clone()
    allreduce_inplace(tmp, op, comm)
    if comm.rank() == dst:
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


@_members_only
def allreduce_coalesced_inplace(tensors: list[torch.Tensor], op: ReduceOp = ReduceOp.SUM,
                                comm: Any = None) -> None:
    """All-reduces several tensors as one buffer, in place.

    Args:
      tensors (list[torch.Tensor]): Tensors of one dtype.
      op (ReduceOp): Default: ``SUM``.
      comm (Communicator, optional): Default: the default group's.
    """
    _coalesced(tensors, lambda flat: allreduce_inplace(flat, op, comm))


@_members_only
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
    _same_size(send_tensor, recv_tensor, "allreduce")
    if engine.ptr(recv_tensor) != engine.ptr(send_tensor):
        recv_tensor.copy_(send_tensor.view_as(recv_tensor))
    allreduce_inplace(recv_tensor, op, comm)


@_members_only
def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Any = None) -> None:
    """All-reduces ``tensor`` in place.

    Args:
      tensor (torch.Tensor): Input and output.
      op (ReduceOp): Default: ``SUM``.
      comm (Communicator, optional): Default: the default group's.
    """
    name = check(tensor, "allreduce tensor")
    engine.all_reduce(comm._core, tensor, _op_name(op, tensor.dtype), name)
    _finish(op, tensor, comm.nranks())


@_members_only
def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Any = None) -> None:
    """Gathers every rank's ``send_tensor`` into ``recv_tensor`` (block r
    from rank r; ``nranks`` times the size).

    Args:
      send_tensor (torch.Tensor): This rank's block.
      recv_tensor (torch.Tensor): The blocks of all ranks.
      comm (Communicator, optional): Default: the default group's.
    """
    name = check(send_tensor, "allgather send tensor")
    check(recv_tensor, "allgather recv tensor")
    engine.all_gather(comm._core, send_tensor, recv_tensor, name)


def _block(tensor: torch.Tensor, n: int, what: str) -> int:
    if tensor.numel() % n:
        raise ValueError(
            f"rank {get_rank()}: {what} holds {tensor.numel()} elements, not a multiple of the "
            f"communicator's {n} ranks"
        )
    return tensor.numel() // n


@_members_only
def allgather_inplace(tensor: torch.Tensor, comm: Any = None) -> None:
    """:func:`allgather` where this rank's block is its slot of ``tensor``.

    Args:
      tensor (torch.Tensor): ``nranks`` blocks; block ``rank`` is sent.
      comm (Communicator, optional): Default: the default group's.
    """
    check(tensor, "allgather tensor")
    b = _block(tensor, comm.nranks(), "allgather tensor")
    mine = tensor.view(-1)[comm.rank() * b:(comm.rank() + 1) * b].clone()
    allgather(mine, tensor, comm)


@_members_only
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
    out = torch.empty(send_tensor.numel() * comm.nranks(), dtype=send_tensor.dtype)
    allgather(send_tensor.contiguous(), out, comm)
    if comm.rank() == dst:
        recv_tensor.view(-1).copy_(out)


@_members_only
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
    flat = tensor.view(-1)
    mine = flat[dst * count:(dst + 1) * count] if comm.rank() == dst else flat[:count]
    out = torch.empty(count * comm.nranks(), dtype=tensor.dtype)
    allgather(mine.clone(), out, comm)
    if comm.rank() == dst:
        flat.copy_(out)


@_members_only
def scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, src: int,
            comm: Any = None) -> None:
    """Sends block r of rank ``src``'s ``send_tensor`` to rank r's ``recv_tensor``.

    Args:
      send_tensor (torch.Tensor): ``nranks`` blocks (on ``src``).
      recv_tensor (torch.Tensor): This rank's block.
      src (int): The root's rank in the communicator.
      comm (Communicator, optional): Default: the default group's.
    """
    n = recv_tensor.numel()
    full = (send_tensor.detach().contiguous().view(-1).clone() if comm.rank() == src
            else torch.empty(n * comm.nranks(), dtype=recv_tensor.dtype))
    broadcast(full, src, comm)
    recv_tensor.view(-1).copy_(full[comm.rank() * n:(comm.rank() + 1) * n])


@_members_only
def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm: Any = None) -> None:
    """:func:`scatter` of ``count`` elements per rank within ``tensor``.

    Args:
      tensor (torch.Tensor): ``nranks * count`` elements on ``src``, at
        least ``count`` elsewhere (the first ``count`` receive the block).
      count (int): Elements per rank.
      src (int): The root's rank in the communicator.
      comm (Communicator, optional): Default: the default group's.
    """
    flat = tensor.view(-1)
    full = (flat.clone() if comm.rank() == src
            else torch.empty(count * comm.nranks(), dtype=tensor.dtype))
    broadcast(full, src, comm)
    if comm.rank() != src:
        flat[:count].copy_(full[comm.rank() * count:(comm.rank() + 1) * count])


@_members_only
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
    name = check(send_tensor, "reduce_scatter send tensor")
    check(recv_tensor, "reduce_scatter recv tensor")
    engine.reduce_scatter(comm._core, send_tensor, recv_tensor, _op_name(op, send_tensor.dtype),
                          name)
    _finish(op, recv_tensor, comm.nranks())


@_members_only
def reduce_scatter_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                           comm: Any = None) -> None:
    """:func:`reduce_scatter` whose result lands in this rank's block of
    ``tensor``.

    Args:
      tensor (torch.Tensor): ``nranks`` blocks.
      op (ReduceOp): Default: ``SUM``.
      comm (Communicator, optional): Default: the default group's.
    """
    check(tensor, "reduce_scatter tensor")
    b = _block(tensor, comm.nranks(), "reduce_scatter tensor")
    out = torch.empty(b, dtype=tensor.dtype)
    reduce_scatter(tensor.clone(), out, op, comm)
    tensor.view(-1)[comm.rank() * b:(comm.rank() + 1) * b].copy_(out)


@_members_only
def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Any = None) -> None:
    """Sends block j of ``send_tensor`` to rank j, receiving block i of
    ``recv_tensor`` from rank i (equal blocks).

    Args:
      send_tensor (torch.Tensor): ``nranks`` blocks.
      recv_tensor (torch.Tensor): ``nranks`` blocks.
      comm (Communicator, optional): Default: the default group's.
    """
    n = comm.nranks()
    b = _block(send_tensor, n, "alltoall send tensor")
    _same_size(send_tensor, recv_tensor, "alltoall")
    alltoall_v(send_tensor, [b] * n, [i * b for i in range(n)],
               recv_tensor, [b] * n, [i * b for i in range(n)], comm)


@_members_only
def alltoall_inplace(tensor: torch.Tensor, comm: Any = None) -> None:
    """:func:`alltoall` with ``tensor`` as input and output.

    Args:
      tensor (torch.Tensor): ``nranks`` blocks.
      comm (Communicator, optional): Default: the default group's.
    """
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


@_members_only
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
    check(send_tensor, "alltoall_v send tensor")
    check(recv_tensor, "alltoall_v recv tensor")
    n = comm.nranks()
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
    engine.all_to_all_v(comm._core, packed_in, list(send_counts), packed_out, list(recv_counts))
    dst = recv_tensor.view(-1)
    at = 0
    for d, k in zip(recv_displs, recv_counts):
        dst[d:d + k].copy_(packed_out[at:at + k])
        at += k


@_members_only
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
    alltoall_v(tensor.clone(), counts, displs, tensor, counts, displs, comm)


@_members_only
def barrier(comm: Any = None) -> None:
    """Blocks until every rank of the communicator reached it.

    Args:
      comm (Communicator, optional): Default: the default group's.
    """
    comm.barrier()

