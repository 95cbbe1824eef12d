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

import io
import pickle
from typing import Any, Optional

import torch

from ..core import groups
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
    name = check(tensor, "send tensor")
    if not 0 <= dst < c.nranks() or dst == c.rank():
        raise ValueError(f"rank {get_rank()}: send to {dst} of a {c.nranks()}-rank communicator")
    pair, peer = groups.pair_comm(c.ranks[dst])
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
    name = check(tensor, "recv tensor")
    if not 0 <= src < c.nranks() or src == c.rank():
        raise ValueError(f"rank {get_rank()}: recv from {src} of a {c.nranks()}-rank communicator")
    pair, peer = groups.pair_comm(c.ranks[src])
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
    name = check(tensor, "broadcast tensor")
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
    name = check(tensor, "allreduce tensor")
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
    name = check(send_tensor, "allgather send tensor")
    check(recv_tensor, "allgather recv tensor")
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
    check(tensor, "allgather tensor")
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
    name = check(send_tensor, "reduce_scatter send tensor")
    check(recv_tensor, "reduce_scatter recv tensor")
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
    check(tensor, "reduce_scatter tensor")
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
    name = check(send_tensor, "alltoall_v send tensor")
    check(recv_tensor, "alltoall_v recv tensor")
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

