"""Distributed autograd contexts as the message layer records them.

The thread's current context, and for each context the tensors its messages
sent (still attached to the sender's graph) and the recv leaves of the
tensors they brought in. No messaging here: ``ringlet.rpc._agent`` records
into these tables while it pickles and unpickles messages, and
``ringlet.rpc.autograd`` runs backward passes over them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Optional

import torch

_lock = threading.Lock()
_tls = threading.local()


class _Context:
    def __init__(self, cid: int) -> None:
        self.id = cid
        self.lock = threading.Lock()
        self.sends: dict[Any, list[torch.Tensor]] = {}
        self.recv_of: dict[int, tuple[int, Any, int]] = {}
        self.keep: list[torch.Tensor] = []
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.peers: set[int] = set()
        # Workers this one sent a message of the context to (torch's known
        # worker ids: requests, and responses that carry tensors with grad).
        self.known: set[int] = set()
        # Graph nodes a backward pass without retain_graph went through
        # (node -> pass): another pass through one that saved tensors fails
        # as torch's freed graph does.
        self.freed: dict[Any, Any] = {}


_contexts: dict[int, _Context] = {}


def _current_id() -> Optional[int]:
    return getattr(_tls, "cur", None)


@contextlib.contextmanager
def _using(cid: Optional[int]) -> Iterator[None]:
    prev = getattr(_tls, "cur", None)
    _tls.cur = cid
    try:
        yield
    finally:
        _tls.cur = prev


def _ensure(cid: int) -> _Context:
    with _lock:
        ctx = _contexts.get(cid)
        if ctx is None:
            ctx = _contexts[cid] = _Context(cid)
        return ctx


def _find(cid: int) -> Optional[_Context]:
    with _lock:
        return _contexts.get(cid)


def _get(cid: int) -> _Context:
    ctx = _find(cid)
    if ctx is None:
        raise RuntimeError(f"Could not find autograd context with id: {cid}")
    return ctx


def _record_send(cid: int, key: Any, dest: int, tensors: list[torch.Tensor],
                 known: bool = True) -> None:
    ctx = _ensure(cid)
    with ctx.lock:
        ctx.peers.add(dest)
        if known:
            ctx.known.add(dest)
        if tensors:
            ctx.sends[key] = tensors


class RecvRpc(torch.autograd.Function):
    """The node a received tensor hangs from (its ``grad_fn`` is a
    ``RecvRpcBackward``, as torch's): the gradient flows to the node's input,
    the message's recv leaf, whose gradient the backward pass sends to the
    tensor's sender."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor, holder: list[torch.Tensor]) -> torch.Tensor:
        # The received tensor travels in a list: returned as an input it
        # would come out as a view of itself (and refuse in-place changes).
        return holder[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _recv_node(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Makes the received tensor ``t`` (not requiring grad) a graph node;
    returns it and its recv leaf."""
    leaf = torch.empty_strided(t.shape, (0,) * t.dim(), dtype=t.dtype).requires_grad_()
    with torch.enable_grad():  # torch attaches the node whatever the grad mode
        out = RecvRpc.apply(leaf, [t])
    return out, leaf


def _record_recv(cid: int, sender: int, key: Any, leaves: list[torch.Tensor]) -> None:
    ctx = _ensure(cid)
    with ctx.lock:
        ctx.peers.add(sender)
        for i, leaf in enumerate(leaves):
            ctx.recv_of[id(leaf)] = (sender, key, i)
            ctx.keep.append(leaf)
