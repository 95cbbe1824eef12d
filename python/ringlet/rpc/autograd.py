"""Distributed autograd on ringlet.rpc (names as ``torch.distributed.autograd``).

Inside ``with context() as context_id:``, every RPC request and response
that carries tensors requiring grad records a *send* on the sending worker
(the original tensors, still attached to its graph) and a *recv* on the
receiving worker, both under the context id and a message key. A received
tensor that requires grad is a graph node, as torch's: its ``grad_fn`` is a
``RecvRpcBackward`` whose input is a private leaf of the tensor's shape (no
memory: all strides zero), the *recv leaf*; so an RPC result can itself be
the root of ``backward``, be viewed, summed with others or changed in
place. ``backward(context_id, roots)`` runs the local graph from the roots
to its leaves with ``torch.autograd.grad`` (so no ``.grad`` changes);
gradients of ordinary leaves accumulate in the context, gradients of recv
leaves are sent to the worker that sent those tensors, which continues from
its recorded send, and so on across every worker the forward pass touched
(nested and fan-out alike; by linearity each message's gradient is
propagated on its own and the results add up). ``backward`` returns when
every worker has finished.

Contexts are independent; leaving the ``with`` block frees the context on
this worker and on every worker it exchanged messages with.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any, Optional

import torch

from . import _agent

# The records of the contexts live in _dist_context (the message layer writes
# them); RecvRpc, _record_send, _record_recv and _recv_node stay importable here
# (RecvRpc in __all__: still documented with this module).
from ._dist_context import RecvRpc as RecvRpc
from ._dist_context import (
    _Context,
    _contexts,
    _current_id,
    _ensure,
    _find,
    _get,
    _lock,
    _tls,
    _using,
)
from ._dist_context import _record_recv as _record_recv
from ._dist_context import _record_send as _record_send
from ._dist_context import _recv_node as _recv_node

__all__ = ["RecvRpc", "backward", "context", "get_gradients", "is_available"]

_ids = itertools.count()  # torch's first context id on worker r is r << 48
_passes = itertools.count()


def is_available() -> bool:
    """True: distributed autograd is always built in.

    Returns:
      bool: ``True``.

    Example::

        >>> dist_autograd.is_available()
        True
    """
    return True


class DistAutogradContext:
    """A distributed autograd context as torch's private helpers hand it out.

    Args:
      ctx (_Context): The context's record on this worker.

    Example::

        >>> with dist_autograd.context() as context_id:
        ...     dist_autograd._current_context()._context_id() == context_id
        True
    """

    def __init__(self, ctx: _Context) -> None:
        self._ctx = ctx

    def _context_id(self) -> int:
        return self._ctx.id

    def _known_worker_ids(self) -> set[int]:
        with self._ctx.lock:
            return set(self._ctx.known)


def _retrieve_context(context_id: int) -> DistAutogradContext:
    """The context with that id on this worker (torch's private helper).

    Args:
      context_id (int): A context id.

    Returns:
      DistAutogradContext: the context.

    Raises:
      RuntimeError: ``Could not find autograd context with id: <id>``.

    Example::

        >>> dist_autograd._retrieve_context(context_id)._context_id() == context_id
        True
    """
    return DistAutogradContext(_get(context_id))


def _current_context() -> DistAutogradContext:
    """This thread's current context (torch's private helper).

    Returns:
      DistAutogradContext: the context of the enclosing ``with context()``.

    Raises:
      RuntimeError: outside a context.

    Example::

        >>> with dist_autograd.context() as context_id:
        ...     dist_autograd._current_context()._context_id() == context_id
        True
    """
    cid = _current_id()
    ctx = None if cid is None else _find(cid)
    if ctx is None:
        raise RuntimeError(
            "Current thread doesn't have a valid autograd context. Please wrap your code using: "
            "`with torch.distributed.autograd.context() as context_id` to generate a valid "
            "context")
    return DistAutogradContext(ctx)


def _get_max_id() -> int:
    """The largest context id this worker can hand out (torch's private helper).

    Returns:
      int: ``(worker_id << 48) + 2**48 - 1``.

    Example::

        >>> dist_autograd._get_max_id() >> 48 == rpc.get_worker_info().id
        True
    """
    return (_agent._require().me.id << 48) + (1 << 48) - 1


def _new_context() -> DistAutogradContext:
    """Starts a context and makes it this thread's current one (what
    :func:`context` does on entry; torch's private helper).

    Returns:
      DistAutogradContext: the new context.

    Raises:
      RuntimeError: when this thread already has one.

    Example::

        >>> ctx = dist_autograd._new_context()
        >>> dist_autograd._release_context(ctx._context_id())
    """
    st = _agent._require()
    if _current_id() is not None:
        raise RuntimeError("Already have an autograd context id for this thread.")
    cid = (st.me.id << 48) | next(_ids)
    ctx = _ensure(cid)
    _tls.cur = cid
    return DistAutogradContext(ctx)


def _release_context(context_id: int) -> None:
    """Frees a context here and on the workers it reached (what leaving
    :func:`context` does; torch's private helper).

    Args:
      context_id (int): The context's id.

    Returns:
      None.

    Raises:
      RuntimeError: ``Could not find autograd context with id: <id>``.

    Example::

        >>> ctx = dist_autograd._new_context()
        >>> dist_autograd._release_context(ctx._context_id())
    """
    _get(context_id)
    if _current_id() == context_id:
        _tls.cur = None
    _release(context_id)


@contextlib.contextmanager
def context() -> Iterator[int]:
    """A distributed autograd context; yields its id.

    Returns:
      A context manager yielding ``context_id`` (int).

    Raises:
      RuntimeError: inside another context on this thread ("Already have an
        autograd context id for this thread.").

    Example::

        >>> import ringlet.rpc.autograd as dist_autograd
        >>> with dist_autograd.context() as context_id:
        ...     t1 = torch.rand((3, 3), requires_grad=True)
        ...     t2 = torch.rand((3, 3), requires_grad=True)
        ...     loss = rpc.rpc_sync("worker1", torch.add, args=(t1, t2)).sum()
        ...     dist_autograd.backward(context_id, [loss])
        ...     grads = dist_autograd.get_gradients(context_id)  # {t1: ones, t2: ones}
    """
    st = _agent._require()
    if _current_id() is not None:
        raise RuntimeError("Already have an autograd context id for this thread.")
    cid = (st.me.id << 48) | next(_ids)
    _ensure(cid)
    with _using(cid):
        try:
            yield cid
        finally:
            _release(cid)


def _release(cid: int, notified: frozenset[int] = frozenset()) -> None:
    """Frees a context here and on the peers it exchanged messages with that
    are not in ``notified`` (already told by whoever told us)."""
    with _lock:
        ctx = _contexts.pop(cid, None)
    if ctx is None:
        return
    st = _agent._state
    if st is None or st.agent is None:
        return
    todo = [p for p in ctx.peers if p != st.me.id and p not in notified]
    told = notified | set(todo) | {st.me.id}
    futs = []
    with _using(None):
        for peer in todo:
            try:
                futs.append(_agent._send(st.workers[peer], ("call", _release, (cid, told), {}), 0))
            except Exception:
                pass  # the peer is gone: nothing to free there
    for f in futs:  # freed everywhere when the context's `with` block ends
        try:
            f.wait()
        except Exception:
            pass


def _graph_leaves(roots: list[torch.Tensor], seen: set[Any]) -> list[torch.Tensor]:
    """The leaves the graph of ``roots`` reaches; its nodes go into ``seen``."""
    leaves: list[torch.Tensor] = []
    seen_leaf: set[int] = set()
    stack: list[Any] = []
    for r in roots:
        if r.grad_fn is None:
            if r.requires_grad and id(r) not in seen_leaf:
                seen_leaf.add(id(r))
                leaves.append(r)
        else:
            stack.append(r.grad_fn)
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            if id(var) not in seen_leaf:
                seen_leaf.add(id(var))
                leaves.append(var)
            continue
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                stack.append(nxt)
    return leaves


_saved_attrs: dict[type, list[str]] = {}


def _saves_tensors(node: Any) -> bool:
    """Whether a graph node holds saved tensors (that a backward pass without
    retain_graph frees)."""
    names = _saved_attrs.get(type(node))
    if names is None:
        names = [a for a in dir(node) if a.startswith("_saved_") or a == "saved_tensors"]
        _saved_attrs[type(node)] = names
    for a in names:
        try:
            v = getattr(node, a)
        except RuntimeError:
            return True  # already freed
        except Exception:
            continue
        if isinstance(v, torch.Tensor) or (
                isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v)):
            return True
    return False


def _check_not_freed(ctx: _Context, nodes: set[Any], pass_id: Any) -> None:
    with ctx.lock:
        stale = [n for n in nodes if ctx.freed.get(n, pass_id) != pass_id]
    if any(_saves_tensors(n) for n in stale):
        me = _agent._require().me.id
        raise RuntimeError(
            f"Error on Node {me}: Trying to backward through the graph a second time (or "
            "directly access saved tensors after they have already been freed). Saved "
            "intermediate values of the graph are freed when you call .backward() or "
            "autograd.grad(). Specify retain_graph=True if you need to backward through the "
            "graph a second time or if you need to access saved tensors after calling backward.")


def _backprop(ctx: _Context, tensors: list[torch.Tensor], grads: list[Optional[torch.Tensor]],
              retain_graph: bool = True, pass_id: Any = None) -> None:
    pairs = [(t, g) for t, g in zip(tensors, grads) if g is not None and t.requires_grad]
    if not pairs:
        return
    roots = [t for t, _ in pairs]
    nodes: set[Any] = set()
    leaves = _graph_leaves(roots, nodes)
    if ctx.freed:
        _check_not_freed(ctx, nodes, pass_id)
    if not retain_graph:
        with ctx.lock:
            for n in nodes:
                ctx.freed.setdefault(n, pass_id)
    if not leaves:
        return
    # The graph is kept (a node may be reached again by another message of
    # this pass); a pass without retain_graph marks its nodes instead.
    gs = torch.autograd.grad(roots, leaves, grad_outputs=[g for _, g in pairs],
                             retain_graph=True, allow_unused=True)
    outgoing: dict[tuple[int, Any], dict[int, torch.Tensor]] = {}
    with ctx.lock:
        for leaf, g in zip(leaves, gs):
            if g is None:
                continue
            src = ctx.recv_of.get(id(leaf))
            if src is None:
                prev = ctx.grads.get(leaf)
                ctx.grads[leaf] = g if prev is None else prev + g
            else:
                sender, key, i = src
                outgoing.setdefault((sender, key), {})[i] = g
    st = _agent._require()
    with _using(None):
        futs = [_agent._send(st.workers[sender],
                             ("call", _backward_step, (ctx.id, key, g, retain_graph, pass_id),
                              {}),
                             0)
                for (sender, key), g in outgoing.items()]
        failed = [r for r in [f.wait() for f in futs] if r is not None]
    if failed:
        raise RuntimeError(f"Error on Node {st.me.id}: {failed[0]}")


def _backward_step(cid: int, key: Any, grads: dict[int, torch.Tensor], retain_graph: bool = True,
                   pass_id: Any = None) -> Optional[str]:
    """Continues a backward pass from a recorded send; returns ``None``, or
    the error's message prefixed with this node (the caller prefixes its
    own, as torch does: ``Error on Node 0: Error on Node 1: ...``)."""
    ctx = _get(cid)
    with ctx.lock:
        tensors = ctx.sends.get(key)
    if tensors is None:
        raise RuntimeError(f"autograd context {cid} has no record of message {key}")
    try:
        _backprop(ctx, tensors, [grads.get(i) for i in range(len(tensors))], retain_graph,
                  pass_id)
    except Exception as e:
        prefix = f"Error on Node {_agent._require().me.id}: "
        return str(e) if str(e).startswith(prefix) else prefix + str(e)
    return None


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Runs the backward pass from ``roots`` across every worker the forward
    pass of this context reached. Gradients accumulate in the context (see
    :func:`get_gradients`); ``.grad`` is not touched.

    Args:
      context_id (int): The id yielded by :func:`context`.
      roots (list[Tensor]): Scalar tensors to differentiate (each requires
        grad and has a gradient function).
      retain_graph (bool): Without it, another backward pass in this context
        through a part of the graph that saved tensors raises as torch does.

    Returns:
      None.

    Raises:
      RuntimeError: an unknown context, no roots, a root that does not
        require grad, is not a scalar or is a leaf, or a second pass through
        a graph a pass without ``retain_graph`` went through.

    Example::

        >>> with dist_autograd.context() as context_id:
        ...     loss = rpc.rpc_sync("worker1", torch.mul, args=(w, 2)).sum()
        ...     dist_autograd.backward(context_id, [loss])
    """
    ctx = _get(context_id)
    roots = list(roots)
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation.")
    for r in roots:
        if not isinstance(r, torch.Tensor):
            raise TypeError(f"backward roots must be tensors, got {type(r).__name__}")
        # torch's checks and messages (the root's name is empty).
        if not r.requires_grad:
            raise RuntimeError("requires_grad not set on root")
        if r.numel() != 1:
            raise RuntimeError(" is not a scalar, all roots need to be scalar")
        if r.grad_fn is None:
            raise RuntimeError(" does not have a valid gradient function.")
    pass_id = (_agent._require().me.id, next(_passes))
    _backprop(ctx, roots, [torch.ones_like(r) for r in roots], retain_graph, pass_id)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's gradients accumulated in a context.

    Args:
      context_id (int): The context's id.

    Returns:
      dict[Tensor, Tensor]: leaf tensor of this worker -> its gradient.

    Example::

        >>> grads = dist_autograd.get_gradients(context_id)
        >>> grads[t1]
        tensor([[1., 1., 1.], ...])
    """
    ctx = _get(context_id)
    with ctx.lock:
        return dict(ctx.grads)
