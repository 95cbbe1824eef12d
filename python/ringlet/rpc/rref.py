"""Remote references (``torch.distributed.rpc.RRef``) and their counting.

Protocol. An RRef is ``(owner, rref_id)``; the value lives on the owner only.
Every copy of an RRef held by another worker (a *user*) carries a fork id
registered with the owner; the owner's table maps ``rref_id`` to the value
and a count per fork, and drops the value once no fork is left (the owner's
own ``RRef`` objects keep it alive locally as ordinary Python references).

* ``remote()``: the caller picks ``rref_id`` and its fork id; the owner
  registers the fork when it runs the request.
* Pickling an RRef into a message to worker ``d``: the owner registers a new
  fork locally before sending; a user sending to a third worker registers
  it with the owner synchronously first, so the owner never sees the
  sender's fork deleted before the new one exists. A user sending a request
  to the owner itself registers nothing: the sender keeps its RRef alive
  until the response, so its own fork covers the message.
* Deleting a user RRef (garbage collection) queues a ``del`` message; a
  background thread sends it. Counts may go negative transiently (a ``del``
  processed before the ``remote`` that created the fork); the value is
  dropped only when every count is back to zero.
* ``shutdown(graceful=True)`` deletes every live user RRef and waits for
  the ``del`` messages to be acknowledged before the workers part.
"""

from __future__ import annotations

import gc
import itertools
import queue
import threading
import weakref
from typing import Any, Generic, Optional, TypeVar

import torch
from torch.futures import Future

from . import _agent
from . import autograd as _autograd
from .constants import UNSET_RPC_TIMEOUT
from .functions import async_execution

__all__ = ["RRef"]

T = TypeVar("T")

_ids = itertools.count()
_lock = threading.RLock()


class _Entry:
    """The owner's copy of a value and its forks."""

    __slots__ = ("__weakref__", "forks", "fut")

    def __init__(self) -> None:
        self.fut: Future = Future()
        self.forks: dict[tuple[int, int], int] = {}


# rref_id -> entry, while some fork exists (or a remote() to self runs).
_owners: dict[tuple[int, int], _Entry] = {}
# rref_id -> entry, while some owner RRef object of this process holds it.
_local_entries: weakref.WeakValueDictionary[tuple[int, int], _Entry] = (
    weakref.WeakValueDictionary()
)
_users: weakref.WeakSet[RRef[Any]] = weakref.WeakSet()
_del_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
_del_futs: set[Future] = set()
_deleter: Optional[threading.Thread] = None


def _new_id() -> tuple[int, int]:
    return (_agent._require().me.id, next(_ids))


def _get_or_create(rid: tuple[int, int]) -> _Entry:
    with _lock:
        e = _owners.get(rid) or _local_entries.get(rid)
        if e is None:
            e = _Entry()
            _local_entries[rid] = e
        _owners[rid] = e
        return e


def _change_fork(rid: tuple[int, int], fid: tuple[int, int], delta: int,
                 entry: Optional[_Entry] = None) -> None:
    with _lock:
        e = entry or _owners.get(rid) or _local_entries.get(rid)
        if e is None:
            if delta > 0:
                raise RuntimeError(f"RRef {rid} is unknown on its owner")
            e = _Entry()
            _local_entries[rid] = e
        _owners[rid] = e
        n = e.forks.get(fid, 0) + delta
        if n == 0:
            e.forks.pop(fid, None)
        else:
            e.forks[fid] = n
        if not e.forks:
            _owners.pop(rid, None)


def _chain(src: Future, fn: Any) -> Future:
    """A future completed with ``fn(value)`` once ``src`` completes, or with
    ``src``'s (or ``fn``'s) exception as it is (``Future.then`` would wrap it
    in a RuntimeError)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            v = fn(f.wait())
        except BaseException as e:
            out.set_exception(e)
        else:
            out.set_result(v)

    src.add_done_callback(done)
    return out


def _local_invoke(rref: RRef[Any], name: str, args: tuple, kwargs: dict) -> Any:
    # torch's name: a proxy call run on the owner.
    return getattr(rref.local_value(), name)(*args, **kwargs)


@async_execution
def _local_invoke_async_execution(rref: RRef[Any], name: str, args: tuple, kwargs: dict,
                                  ) -> Any:
    # A proxy call of an @async_execution method: the owner answers with the
    # result of the future the method returns.
    return getattr(rref.local_value(), name)(*args, **kwargs)


def _handle(kind: str, body: tuple[Any, ...], sender: int) -> Any:
    """Runs an RRef request on the owner; returns the result or a Future."""
    if kind == "remote":
        _, rid, fid, inner = body
        e = _get_or_create(rid)
        if fid is not None:
            _change_fork(rid, fid, +1, e)
        try:
            is_async, out = _agent._run_call(*inner[1:])
        except BaseException as exc:
            if not e.fut.done():
                e.fut.set_exception(exc)
            _settle(rid, e)
            return None
        if is_async:
            def fill(f: Future) -> None:
                try:
                    v = f.wait()
                except BaseException as exc:
                    e.fut.set_exception(exc)
                else:
                    e.fut.set_result(v)
                _settle(rid, e)

            done = out.then(lambda f: (fill(f), None)[1])
            return done
        e.fut.set_result(out)
        _settle(rid, e)
        return None
    if kind == "fetch":
        e = _get_or_create(body[1])
        if e.fut.done():
            return e.fut.wait()
        return _chain(e.fut, lambda v: v)
    if kind == "type":
        return _chain(_get_or_create(body[1]).fut, type)
    if kind == "fork":
        _change_fork(body[1], body[2], +1)
        return None
    if kind == "del":
        _change_fork(body[1], body[2], -1)
        return None
    raise RuntimeError(f"unknown RPC request kind {kind!r}")


def _settle(rid: tuple[int, int], e: _Entry) -> None:
    with _lock:
        if not e.forks:
            _owners.pop(rid, None)


class RRef(Generic[T]):
    """A reference to a value on one worker (its owner), as
    ``torch.distributed.rpc.RRef``.

    ``RRef(value)`` makes this worker the owner of ``value``. RRefs come back
    from :func:`ringlet.rpc.remote` and can be passed to any worker as
    arguments and results; the owner frees the value once no worker holds a
    reference.

    Args:
      value (object): The value to own locally.
      type_hint (type, optional): Recorded, not checked.

    Example::

        >>> rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
        >>> rref.owner_name(), rref.is_owner()
        ('worker1', False)
        >>> rref.to_here()
        tensor([4., 4.])
        >>> rref.rpc_sync().size()          # runs value.size() on the owner
        torch.Size([2])
    """

    _type: Optional[type] = None  # the value's type, once asked for

    def __init__(self, value: Any = None, type_hint: Optional[type] = None) -> None:
        st = _agent._current_agent_state()
        if type_hint is not None and not isinstance(value, torch.jit.ScriptModule):
            raise RuntimeError("type_hint should only be specified when the RRef being created "
                               "contains a ScriptModule.")
        self._owner = st.me.id
        self._rid = _new_id()
        self._fid: Optional[tuple[int, int]] = None
        self._entry: Optional[_Entry] = _Entry()
        self._entry.fut.set_result(value)
        with _lock:
            _local_entries[self._rid] = self._entry
        self._confirm: Optional[Future] = None
        self._deleted = False

    def __class_getitem__(cls, item: Any) -> Any:  # RRef[int] in annotations
        return cls

    # ------------------------------------------------------------ builders
    @classmethod
    def _owner_ref(cls, rid: tuple[int, int], entry: _Entry) -> RRef[Any]:
        r = cls.__new__(cls)
        r._owner, r._rid, r._fid, r._entry = _agent._require().me.id, rid, None, entry
        r._confirm, r._deleted = None, False
        with _lock:
            _local_entries[rid] = entry
        return r

    @classmethod
    def _user_ref(cls, owner: int, rid: tuple[int, int], fid: tuple[int, int],
                  confirm: Optional[Future]) -> RRef[Any]:
        r = cls.__new__(cls)
        r._owner, r._rid, r._fid, r._entry = owner, rid, fid, None
        r._confirm, r._deleted = confirm, False
        _users.add(r)
        return r

    @classmethod
    def _remote(cls, to: Any, body: tuple[Any, ...], timeout: float,
                keep: Any = None) -> RRef[Any]:
        st = _agent._require()
        rid = _new_id()
        if to.id == st.me.id:
            e = _get_or_create(rid)
            r = cls._owner_ref(rid, e)
            r._confirm = _agent._send(to, ("remote", rid, None, body), timeout, keep)
            return r
        fid = _new_id()
        r = cls._user_ref(to.id, rid, fid, None)
        r._confirm = _agent._send(to, ("remote", rid, fid, body), timeout, keep)
        return r

    @classmethod
    def _from_fork(cls, owner: int, rid: tuple[int, int], fid: Optional[tuple[int, int]],
                   ) -> RRef[Any]:
        st = _agent._require()
        rid, fid = tuple(rid), (tuple(fid) if fid is not None else None)  # type: ignore[assignment]
        if owner == st.me.id:
            # Known, or about to be created by a remote() still running here.
            e = _get_or_create(rid)
            r = cls._owner_ref(rid, e)
            if fid is not None:
                _change_fork(rid, fid, -1, e)
            return r
        assert fid is not None
        return cls._user_ref(owner, rid, fid, None)

    def _fork_for(self, dest: int) -> tuple[Any, ...]:
        """Registers the copy about to be sent to ``dest``; returns what the
        message carries."""
        self._check_live()
        keep = getattr(_agent._local, "keep", None)
        if dest == self._owner and keep is not None:
            keep.append(self)  # a request to the owner: our own fork covers it
            return (self._owner, self._rid, None)
        fid = _new_id()
        if self._entry is not None:
            _change_fork(self._rid, fid, +1, self._entry)
        else:
            owner = _agent._require().workers[self._owner]
            _agent._send_sync(owner, ("fork", self._rid, fid), UNSET_RPC_TIMEOUT)
        return (self._owner, self._rid, fid)

    def _check_live(self) -> None:
        if self._deleted:
            raise RuntimeError(f"{self!r} was deleted at RPC shutdown")

    def _check_created(self) -> None:
        """Raises at once when the ``remote()`` that creates the value failed
        to reach its owner (timed out, owner gone)."""
        c = self._confirm
        if c is None or not c.done():
            return
        try:
            c.wait()
        except Exception as e:
            if getattr(e, "_rpc_timeout", False):
                raise RuntimeError(
                    "RRef creation via rpc.remote() timed out, and it is possible that the RRef "
                    "on the owner node does not exist.") from None
            raise

    def _get_type(self, timeout: float = UNSET_RPC_TIMEOUT, blocking: bool = True) -> Any:
        """The type of the value (asked of the owner once, then remembered).

        Args:
          timeout (float): Seconds for the owner's answer; -1: the default.
          blocking (bool): Wait for the type; ``False`` returns a future.

        Returns:
          type, or a ``torch.futures.Future`` of it when not ``blocking``.

        Example::

            >>> rpc.remote("worker1", torch.ones, args=(2,))._get_type()
            <class 'torch.Tensor'>
        """
        if self._type is None:
            self._check_live()
            self._check_created()
            if self._entry is not None:
                fut = _chain(self._entry.fut, type)
            else:
                fut = _agent._send(self.owner(), ("type", self._rid), timeout, self,
                                   torch_exc=True)

            def remember(t: type) -> type:
                self._type = t
                return t

            fut = _chain(fut, remember)
        else:
            fut = Future()
            fut.set_result(self._type)
        return fut.wait() if blocking else fut

    # ------------------------------------------------------------- queries
    def is_owner(self) -> bool:
        """Whether this worker owns the value.

        Returns:
          bool: ``True`` on the owner.

        Example::

            >>> rpc.RRef(3).is_owner()
            True
        """
        return self._entry is not None

    def owner(self) -> Any:
        """The owner's ``WorkerInfo``.

        Returns:
          WorkerInfo: the worker holding the value.

        Example::

            >>> rpc.remote("worker1", min, args=(1, 2)).owner()
            WorkerInfo(id=1, name=worker1)
        """
        return _agent._require().workers[self._owner]

    def owner_name(self) -> str:
        """The owner's worker name.

        Returns:
          str: the name given to ``init_rpc`` on the owner.

        Example::

            >>> rref.owner_name()
            'worker1'
        """
        return str(self.owner().name)

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has acknowledged this reference (always true on
        the owner and for RRefs received from other workers).

        Returns:
          bool: ``True`` once the owner knows of it.

        Example::

            >>> rref = rpc.remote("worker1", min, args=(1, 2)); rref.to_here()
            >>> rref.confirmed_by_owner()
            True
        """
        c = self._confirm
        if c is None:
            return True
        if not c.done():
            return False
        try:
            c.wait()
        except Exception:
            return False
        return True

    def local_value(self) -> Any:
        """The value itself, on the owner.

        Returns:
          The owned value.

        Raises:
          RuntimeError: on a worker that is not the owner.

        Example::

            >>> rpc.RRef(torch.ones(2)).local_value()
            tensor([1., 1.])
        """
        if self._entry is None:
            me = _agent._require().me
            raise RuntimeError(
                f"For {self!r}, can't call localValue() on user {me}. "
                f"Call it on owner {self.owner()}")
        return self._entry.fut.wait()

    def to_here(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """Copies the value from the owner (blocking).

        Args:
          timeout (float): Seconds; 0: none; -1: the agent's default.

        Returns:
          A copy of the value (the value itself on the owner).

        Example::

            >>> rpc.remote("worker1", torch.add, args=(torch.ones(2), 3)).to_here()
            tensor([4., 4.])
        """
        self._check_live()
        self._check_created()  # re-raises a failed creation (e.g. its timeout)
        c = self._confirm
        if self._entry is not None:
            return self._entry.fut.wait()
        to = self.owner()
        try:
            return _agent._send_sync(to, ("fetch", self._rid), timeout, self)
        finally:
            if c is not None:
                # The owner may answer the fetch before the creation's own
                # reply: confirmed once to_here returns, whatever its outcome.
                _agent._wait_all([c], _agent._timeout_of(_agent._require(), timeout) or 60.0)

    def _get_future(self) -> Future:
        """The creation future (torch's private name)."""
        if self._confirm is not None:
            return self._confirm
        f: Future = Future()
        f.set_result(None)
        return f

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Runs backward from the value (a scalar tensor) on its owner: plain
        autograd with ``dist_autograd_ctx_id=-1``, else distributed autograd
        in that context.

        Args:
          dist_autograd_ctx_id (int): A distributed autograd context id, or -1.
          retain_graph (bool): As in ``Tensor.backward``.

        Returns:
          None.

        Raises:
          RuntimeError: on a user RRef without ``dist_autograd_ctx_id``.

        Example::

            >>> with dist_autograd.context() as context_id:
            ...     rref = rpc.remote("worker1", loss_fn, args=(x,))
            ...     rref.backward(context_id)
        """
        if self.is_owner():
            _rref_backward(self, dist_autograd_ctx_id, retain_graph)
            return
        if dist_autograd_ctx_id == -1:
            raise RuntimeError("User RRefs require 'dist_autograd_ctx_id' to be specified")
        with _autograd._using(None):
            _agent._send_sync(self.owner(), ("call", _rref_backward,
                                             (self, dist_autograd_ctx_id, retain_graph), {}),
                              UNSET_RPC_TIMEOUT, self)

    # ------------------------------------------------------------- proxies
    def rpc_sync(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """A proxy: ``rref.rpc_sync().method(*args)`` runs
        ``value.method(*args)`` on the owner and returns the result.

        Args:
          timeout (float): Seconds each call may block: for the value's type
            (asked of the owner once) and for the result; -1: the default.

        Returns:
          A proxy whose method calls block until the result is here.

        Example::

            >>> rref = rpc.remote("worker1", torch.ones, args=(2, 2))
            >>> rref.rpc_sync().size()
            torch.Size([2, 2])
        """
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """A proxy whose method calls return ``torch.futures.Future``\\ s.

        Args:
          timeout (float): Seconds for the value's type and for the call,
            after which the future holds the timeout error; -1: the default.

        Returns:
          A proxy whose method calls return at once, without waiting even for
          the value's type.

        Example::

            >>> fut = rref.rpc_async().view(-1)  # rref as in rpc_sync's example
            >>> fut.wait()
            tensor([1., 1., 1., 1.])
        """
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        """A proxy whose method calls return an ``RRef`` to the result, owned
        by this RRef's owner.

        Args:
          timeout (float): Seconds for the value's type, then for the owner to
            create the result; -1: the default.

        Returns:
          A proxy whose method calls return the new ``RRef`` without waiting
          for the result; its ``to_here()`` fetches it.

        Example::

            >>> flat = rref.remote().view(-1)  # an RRef owned by worker1
            >>> flat.to_here()
            tensor([1., 1., 1., 1.])
        """
        return _Proxy(self, "remote", timeout)

    # ------------------------------------------------------------- lifetime
    def _delete(self) -> None:
        if self._deleted or self._entry is not None or self._fid is None:
            return
        self._deleted = True
        _del_queue.put((self._owner, self._rid, self._fid))

    def __del__(self) -> None:
        try:
            self._delete()
        except Exception:
            pass

    def __reduce__(self) -> Any:
        raise RuntimeError("RRef can only be pickled by ringlet.rpc when sent in an RPC")

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self._entry is not None else "UserRRef"
        fork = f", fork_id={self._fid}" if self._fid is not None else ""
        return f"{kind}(rref_id=(created_on={self._rid[0]}, local_id={self._rid[1]}){fork})"


def _rref_backward(rref: RRef[Any], cid: int, retain_graph: bool) -> None:
    value = rref.local_value()
    if cid == -1:
        value.backward(retain_graph=retain_graph)
    else:
        _autograd.backward(cid, [value], retain_graph)


def _invoke_func(rref_type: type, name: str) -> Any:
    """What runs a proxy call on the owner (as torch picks it): the method
    looked up on the value's type here first, so a missing one raises
    ``AttributeError`` on the caller."""
    if issubclass(rref_type, (torch.jit.ScriptModule, torch._C.ScriptModule)):
        return _local_invoke
    if hasattr(getattr(rref_type, name), "_wrapped_async_rpc_function"):
        return _local_invoke_async_execution
    return _local_invoke


class _Proxy:
    def __init__(self, rref: RRef[Any], mode: str, timeout: float) -> None:
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, name: str) -> Any:
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def call(*args: Any, **kwargs: Any) -> Any:
            rref._check_live()
            to = rref.owner()
            if mode != "async":
                func = _invoke_func(rref._get_type(timeout), name)
                body = ("call", func, (rref, name, args, kwargs), {})
                if mode == "remote":
                    return RRef._remote(to, body, timeout, rref)
                return _agent._send_sync(to, body, timeout, rref, torch_exc=True)
            result: Future = Future()
            cid = _autograd._current_id()

            def send(f: Future) -> None:
                try:
                    func = _invoke_func(f.wait(), name)
                    with _autograd._using(cid):
                        inner = _agent._send(to, ("call", func, (rref, name, args, kwargs), {}),
                                             timeout, rref, torch_exc=True)
                except BaseException as e:
                    result.set_exception(e)
                    return
                inner.add_done_callback(lambda g: _transfer(g, result))

            rref._get_type(timeout, blocking=False).add_done_callback(send)
            return result

        return call


def _transfer(src: Future, dst: Future) -> None:
    try:
        v = src.wait()
    except BaseException as e:
        dst.set_exception(e)
    else:
        dst.set_result(v)


# --------------------------------------------------------------- deletions


def _deleter_loop() -> None:
    while True:
        item = _del_queue.get()
        if item is None:
            return
        if isinstance(item, threading.Event):
            item.set()
            continue
        owner, rid, fid = item
        st = _agent._state
        if st is None or st.agent is None:
            continue
        try:
            if owner == st.me.id:
                _change_fork(rid, fid, -1)
                continue
            f = _agent._send(st.workers[owner], ("del", rid, fid), 0)
        except Exception:
            continue
        with _lock:
            _del_futs.add(f)
        f.add_done_callback(_forget_del)


def _forget_del(f: Future) -> None:
    with _lock:
        _del_futs.discard(f)


def _start() -> None:
    global _deleter
    _deleter = threading.Thread(target=_deleter_loop, name="ringlet-rpc-rref-del", daemon=True)
    _deleter.start()


def _release_all(wait: float, live: bool = True) -> None:
    """Sends the deletions of garbage user RRefs (and, with ``live``, of every
    user RRef still referenced) and waits until the owners acknowledged."""
    gc.collect()
    if live:
        for r in list(_users):
            r._delete()
    flushed = threading.Event()
    _del_queue.put(flushed)
    flushed.wait(wait)
    with _lock:
        futs = list(_del_futs)
    if futs:
        done = threading.Event()
        torch.futures.collect_all(futs).add_done_callback(lambda _f: done.set())
        done.wait(wait)


def _stop() -> None:
    global _deleter
    _del_queue.put(None)
    if _deleter is not None:
        _deleter.join(5.0)
    _deleter = None
    with _lock:
        _owners.clear()
        _del_futs.clear()


# ------------------------------------------------------- the agent's hooks


def _reduce_rref(r: RRef[Any]) -> Any:
    """Pickles an RRef into a message (``_agent._local.dest``: its destination)."""
    return (RRef._from_fork, r._fork_for(_agent._local.dest))


# What this module serves the agent: the RRef requests, and RRefs in messages.
_agent._register_kinds(("remote", "fetch", "type", "fork", "del"), _handle)
_agent._register_reducer(RRef, _reduce_rref)
