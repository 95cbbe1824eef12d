"""ringlet as a ``torch.distributed`` backend: ``init_process_group("ringlet")``.

Importing ringlet registers the backend ``"ringlet"`` for CPU tensors (and the
package's ``torch.backends`` entry point registers it when torch is imported,
so ``pip install ringlet`` alone is enough). torch's own collectives, DDP,
FSDP2, DTensor, tensor parallelism, functional collectives and
``torch.distributed.checkpoint`` then run on ringlet's engine.

Each process group connects its own communicator through the store that
``init_process_group`` / ``new_group`` hands it (no second rendezvous), the
first time it is used, by its members only. Operations run in issue order on
the group's progress thread (``ringlet._core.Progress``, in the Rust core);
``Work.wait()`` blocks with the GIL released, and a caller that waits for an
operation nobody has started yet runs it itself, so a synchronous call costs
no thread switch. Point-to-point messages run on a queue per direction and
peer, so sends and receives in any order between any ranks never deadlock.

Example:
  >>> import torch, torch.distributed as dist, ringlet
  >>> dist.init_process_group("ringlet")          # under torchrun
  >>> t = torch.ones(4) * (dist.get_rank() + 1)
  >>> dist.all_reduce(t)                            # 1 + 2 on 2 ranks
  >>> t
  tensor([3., 3., 3., 3.])
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.abc
import importlib.util
import math
import os
import sys
import threading
import weakref
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ReduceOp
from torch._C._distributed_c10d import Work as _CWork

from .. import _core, errors, runtime
from .._engine import (
    _DTYPE_NAMES,
    _STRIDED,
    _check,
    _disjoint,
    _engine_all_gather,
    _engine_all_reduce,
    _engine_broadcast,
    _engine_reduce_scatter,
    _exchange,
    _overlaps,
    _plain,
    _reduce_inplace,
)
from . import _native

__all__ = ["BACKEND_NAME", "ProcessGroupRinglet", "Work", "backend_kind", "python_group",
           "register"]

BACKEND_NAME = "ringlet"

# Sends up to this size are copied and complete at once (as gloo's sends
# complete once the bytes are in the socket buffer), so two ranks that both
# send before they receive do not wait for each other.
_EAGER_SEND_BYTES = 1 << 20

_RED = ReduceOp.RedOpType
_OPS: dict[Any, str] = {
    _RED.SUM: "sum",
    _RED.PRODUCT: "mul",
    _RED.MIN: "min",
    _RED.MAX: "max",
    _RED.BAND: "and",
    _RED.BOR: "or",
    _RED.BXOR: "xor",
    _RED.AVG: "sum",
    _RED.PREMUL_SUM: "sum",
}


# Reduce ops the engine runs as they are (AVG and PREMUL_SUM need a step more).
_SIMPLE = {k: v for k, v in _OPS.items() if k not in (_RED.AVG, _RED.PREMUL_SUM)}
# A list's tensors folded into one before the engine reduces across ranks.
_FOLDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add, "mul": torch.mul, "min": torch.minimum, "max": torch.maximum,
    "and": torch.bitwise_and, "or": torch.bitwise_or, "xor": torch.bitwise_xor,
}
_SUM = _RED.SUM  # compared first: pybind enum hashing costs more than one ==
_ANY_DTYPE = ("sum", "mul", "min", "max")  # the others need integer or bool tensors
_AllreduceOptions = dist.AllreduceOptions
_DTYPE_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


class _DistErrors:
    """Errors as torch's process groups raise them. ringlet's typed exceptions
    become also ``torch.distributed.DistBackendError``; argument errors
    (``ValueError`` / ``TypeError``) become also ``RuntimeError``, the type
    gloo raises for them. ``except ValueError`` and ``except RuntimeError``
    both work."""

    _cache: dict[type, type] = {}  # noqa: RUF012

    @classmethod
    def convert(cls, exc: BaseException) -> BaseException:
        if isinstance(exc, errors.RingletError):
            extra: type = dist.DistBackendError
        elif isinstance(exc, (ValueError, TypeError)):
            extra = RuntimeError
        else:
            return exc
        kind = type(exc)
        if issubclass(kind, extra):
            return exc
        both = cls._cache.get(kind)
        if both is None:
            both = type(kind.__name__, (kind, extra), {
                "__module__": kind.__module__,
                "__doc__": kind.__doc__,
                # pickled as the original type (all_gather_object of errors,
                # as DCP collects them): this class exists only here
                "__reduce__": functools.partialmethod(_reduce_as, kind),
            })
            cls._cache[kind] = both
        new = both(*exc.args)
        new.__dict__.update(exc.__dict__)  # rank, culprit, cause, op, group
        new.__cause__ = exc.__cause__
        return new.with_traceback(exc.__traceback__)


def _reduce_as(exc: BaseException, kind: type) -> tuple[Any, ...]:
    """Pickles ``exc`` as an instance of ``kind`` with its args and attributes."""
    return kind, exc.args, exc.__dict__ or None


_F = TypeVar("_F", bound=Callable[..., Any])


def _torch_errors(fn: _F) -> _F:
    """Raises ``fn``'s argument errors as torch's process groups do."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as e:
            if _only_meta((args[1:], kwargs)):
                # torch's meta kernels of its c10d ops (which gloo gets) do
                # nothing for meta tensors: neither do we.
                return _DONE
            raise _DistErrors.convert(e) from None

    return wrapper  # type: ignore[return-value]


def _write_back(t: torch.Tensor, w: torch.Tensor) -> None:
    """Copies ``w`` into ``t``, also when elements of ``t`` share memory (an
    expanded tensor: its aliased elements held equal values, so they reduce
    to equal results and any of them may land)."""
    if torch._debug_has_internal_overlap(t) == 0:  # no element shares memory
        t.copy_(w)
        return
    cells = t.untyped_storage().nbytes() // t.element_size()
    where = torch.arange(cells).as_strided(t.shape, t.stride(), t.storage_offset())
    t.as_strided((cells,), (1,), 0).index_put_((where.reshape(-1),), w.reshape(-1))


@contextlib.contextmanager
def _sizes_of(op: str, rule: str) -> Iterator[None]:
    """Names the user's collective in a size mismatch found by the engine
    call that implements it (an all-to-all, or a count exchange)."""
    try:
        yield
    except errors.CollectiveMismatchError as e:
        where, _, detail = str(e).partition(": ")
        if not (where.startswith("rank ") and detail):
            where, detail = f"rank {runtime_rank()}", str(e)
        new = type(e)(f"{where}: {op}: the ranks' tensor sizes do not fit together "
                      f"({rule}); the engine found: {detail}")
        new.__dict__.update(e.__dict__)
        raise new from None


def _gather_ragged(comm: Any, size: int, inp: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every rank's ``inp`` (rank r's holding ``counts[r]`` elements),
    concatenated flat in rank order: one all-to-all sending ``inp`` to all."""
    flat = torch.empty(sum(counts), dtype=inp.dtype)
    _exchange(comm, inp.reshape(-1).repeat(size), [inp.numel()] * size, flat, counts)
    return flat


def _only_meta(args: Any) -> bool:
    """Whether ``args`` (nested lists, tuples, dicts) hold tensors, all on
    the meta device."""
    found = False
    stack = [args]
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            if not a.is_meta:
                return False
            found = True
        elif isinstance(a, (list, tuple)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
    return found


class Work(_CWork):
    """The handle of one asynchronous operation (``async_op=True``), as
    torch's ``Work``: ``wait()``, ``is_completed()``, ``is_success()``,
    ``exception()``, ``get_future()``, ``result()``.

    Example:
      >>> work = dist.all_reduce(t, async_op=True)
      >>> fut = work.get_future().then(lambda f: f.value()[0] * 2)
      >>> work.wait()
      True
    """

    def __init__(
        self, queue: Any, result: list[Any], timeout: float, rank: Optional[int] = None
    ) -> None:
        super().__init__()
        self._queue = queue
        self._result = result
        self._timeout = timeout
        self._ticket = -1
        self._done = False
        self._exc: Optional[BaseException] = None
        self._fut: Optional[torch.futures.Future] = None  # what get_future() returns
        self._src: Optional[torch.futures.Future] = None  # completed by _complete
        self._lock = threading.Lock()
        self._source = rank  # None: not a receive (-1: a receive from any source, not yet matched)
        self._completing: Optional[threading.Event] = None  # set once the future's callbacks ran
        self._woken = True  # the progress thread was woken for the job (else a waiter runs it)
        self._waiting: Optional[threading.Event] = None  # set once done, for wait(timeout)

    # Runs on the progress thread (or in a waiter that runs queued jobs).
    def _run(self, fn: Callable[[], Any]) -> Callable[[], None]:
        def job() -> None:
            try:
                fn()
            except BaseException as e:  # handed to wait() and the future
                self._finish(_DistErrors.convert(e))
            else:
                self._finish(None)

        return job

    def _finish(self, exc: Optional[BaseException]) -> None:
        with self._lock:
            self._exc = exc
            fut = self._src
            if fut is None:
                self._set_done()
                return
            self._completing = threading.Event()
        # The future's callbacks may issue and wait for later operations of
        # this group (DDP's PowerSGD hook does): they must not run on the
        # thread that has to run those operations. As with gloo, the work
        # counts as completed (wait() returns) once they have run.
        _COMPLETIONS.submit(functools.partial(self._complete_then_done, fut))

    def _complete_then_done(self, fut: torch.futures.Future) -> None:
        try:
            self._complete(fut)
        finally:
            with self._lock:
                self._set_done()
            self._completing.set()

    def _set_done(self) -> None:
        """Marks the work done (the caller holds ``_lock``) and wakes a
        ``wait(timeout)``."""
        self._done = True
        if self._waiting is not None:
            self._waiting.set()

    def _wait_on_thread(self, secs: float) -> bool:
        """Whether the work finishes within ``secs``, run by the progress
        thread: unlike the queue's wait, the caller never runs the job itself,
        so a job blocked on its peers cannot hold it past ``secs``."""
        with self._lock:
            if self._done:
                return True
            if self._waiting is None:
                self._waiting = threading.Event()
            waiting = self._waiting
        if not self._woken:  # queued for a waiter to run: have the thread run it
            self._woken = True
            with contextlib.suppress(Exception):  # a closed queue has run its jobs
                self._queue.submit(_nothing, True)
        return waiting.wait(secs)

    def _complete(self, fut: torch.futures.Future) -> None:
        if self._exc is not None:
            fut.set_exception(self._exc)
        else:
            fut.set_result(self._result)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Blocks (GIL released) until the operation finished; raises its error.

        Args:
          timeout (timedelta, optional): How long to wait; ``timedelta(0)``
            (the default) waits up to the group's timeout.

        Returns:
          True.
        """
        secs = timeout.total_seconds() if timeout else 0.0
        limit = secs if secs > 0 else self._timeout
        if secs > 0:  # the caller's own limit: raise once it passed (as gloo)
            finished = self._wait_on_thread(secs)
        else:
            finished = self._done or (self._queue.wait(self._ticket, limit) and (
                self._completing is None or self._completing.wait(limit)))
        if not finished:
            raise _DistErrors.convert(errors.CollectiveTimeoutError(
                f"rank {runtime_rank()}: Work.wait: Timed out after "
                f"{limit:g}s; the operation has not finished"
            ))
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        """Whether the operation has finished (successfully or not)."""
        return self._done

    def is_success(self) -> bool:
        """Whether the operation finished without an error."""
        return self._done and self._exc is None

    def exception(self) -> Optional[BaseException]:
        """The error the operation failed with, or None."""
        return self._exc

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` completed with the operation's output
        tensors (a list), or with its error.

        Returns:
          The future (the same object on every call).
        """
        with self._lock:
            fut = self._fut
            if fut is None:
                # The future handed out follows one this work completes: a
                # Python future's set_exception only stores the exception as
                # its value (C++ readers such as DDP's reducer then take it
                # for tensors and crash), while a follower whose callback
                # raises is failed in C++ too.
                self._src = torch.futures.Future()
                fut = self._fut = self._src.then(_future_value)
                if self._done:
                    self._complete(self._src)
        return fut

    def result(self) -> list[Any]:
        """The operation's output tensors (valid once it completed)."""
        return self._result

    def source_rank(self) -> int:
        """The rank a receive got its message from (-1 while a receive from
        any source has not matched a message yet).

        Raises:
          RuntimeError: The work is not a receive (as gloo's).
        """
        if self._source is None:
            raise RuntimeError(
                "sourceRank() may only be called on work objects that correspond to a recv "
                "or recv-from-any call."
            )
        return self._source

    _source_rank = source_rank

    def synchronize(self) -> None:
        """No-op: CPU operations need no stream synchronisation."""


def _nothing() -> None:
    """A job that only wakes a progress thread for the jobs queued before it."""


def _future_value(fut: torch.futures.Future) -> Any:
    """The value of a completed future (raises its exception)."""
    return fut.value()


class _Completions:
    """Threads that complete futures (and so run their callbacks) off the
    progress threads. A completion never waits for a thread that is busy:
    when none is free a new one starts, so a callback blocked on a later
    operation (whose own completion comes here too) cannot deadlock. Threads
    stay for later completions; there are as many as callbacks ever blocked
    at once, plus one."""

    def __init__(self) -> None:
        self._reset()
        # A forked child has none of the parent's threads: start afresh there.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cv = threading.Condition()
        self._tasks: collections.deque[Callable[[], None]] = collections.deque()
        self._free = 0  # threads waiting for a task and not yet claimed

    def submit(self, task: Callable[[], None]) -> None:
        with self._cv:
            self._tasks.append(task)
            if self._free:
                self._free -= 1
                self._cv.notify()
                return
        threading.Thread(target=self._serve, name="ringlet-completions", daemon=True).start()

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._tasks:
                    self._free += 1
                    self._cv.wait()
                task = self._tasks.popleft()
            try:
                task()
            except BaseException as e:  # a future's own errors stay in the future
                print(f"ringlet: completing a future failed: {e!r}", file=sys.stderr)


_COMPLETIONS = _Completions()

_DONE: Work  # a finished Work returned by synchronous calls (set below)


def _opts(cls: Any, opts: Any, op: Any = None, root: Any = None) -> Any:
    """``opts`` as torch's options object ``cls``, accepting the other call
    forms of torch's ``ProcessGroup`` methods: nothing (defaults), a reduce op
    (``pg.allreduce([t], ReduceOp.MAX)``) or a root rank
    (``pg.broadcast(t, 1)``, ``pg.reduce(t, 1, op)``)."""
    if opts is not None and type(opts) is cls:
        return opts
    out = cls()
    if opts is None:
        pass
    elif isinstance(opts, int) and not isinstance(opts, bool) and hasattr(out, "rootRank"):
        out.rootRank = opts
    elif hasattr(out, "reduceOp") and not hasattr(opts, "reduceOp"):
        out.reduceOp = opts
    else:
        return opts  # another options-like object: used as it is
    if op is not None and hasattr(out, "reduceOp"):
        out.reduceOp = op
    if root is not None:
        out.rootRank = root
    return out


def _run_now(queue: Any, fn: Callable[[], Any]) -> bool:
    """Runs ``fn`` on this thread at once when ``queue`` is idle, in queue
    order; False, having done nothing, when earlier operations are still
    queued. Its errors are raised as torch's process groups raise them."""
    try:
        return bool(queue.run_now(fn))
    except BaseException as e:
        raise _DistErrors.convert(e) from None


def _as_list(t: Any) -> Any:
    """A lone tensor as a one-element list (torch's single-tensor overloads)."""
    return [t] if isinstance(t, torch.Tensor) else t


def _is_async(opts: Any) -> bool:
    """Whether the caller returns the Work (``async_op=True``; C++ callers
    such as functional collectives and DDP leave the option at True)."""
    return bool(getattr(opts, "asyncOp", True)) if opts is not None else True


def runtime_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else runtime.get_ordinal()


def _store_host(store: Any) -> Optional[str]:
    """The host of the TCPStore under (possibly nested) prefix stores."""
    while store is not None:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
    return None


def _store_wait(store: Any, key: str, deadline: float) -> tuple[bool, Optional[str]]:
    """Whether ``key`` is set in ``store`` by ``deadline`` (a ``time.monotonic``
    value), and the store's own error if it failed otherwise. A store takes
    a zero wait as "no limit" (its default timeout, minutes): with less than
    a millisecond left this only looks."""
    import time

    while True:
        left = deadline - time.monotonic()
        if left < 1e-3:
            return bool(store.check([key])), None
        try:
            store.wait([key], timedelta(seconds=left))
            return True, None
        except Exception as e:  # timed out, or the store itself failed
            if store.check([key]):
                return True, None
            if "timeout" not in str(e).lower() and time.monotonic() < deadline - 1e-3:
                return False, f"{type(e).__name__}: {e}"


def _split_into(flat: torch.Tensor, outs: list[torch.Tensor]) -> None:
    """Copies consecutive pieces of flat ``flat`` into ``outs``, in order."""
    start = 0
    for o in outs:
        o.copy_(flat[start:start + o.numel()].view(o.shape))
        start += o.numel()


def _reduce_name(op: Any, what: str) -> str:
    kind = getattr(op, "op", op)
    name = _OPS.get(kind)
    if name is None:
        raise ValueError(f"{what}: unsupported reduce op {op!r}")
    return name


def _check_group_args(store: Any, rank: Any, size: Any, timeout: Any,
                      global_ranks: Optional[list[int]]) -> None:
    """Refuses arguments a group cannot be built from, naming the problem."""
    if not isinstance(store, dist.Store):
        raise TypeError(
            f"ringlet: ProcessGroupRinglet needs a torch.distributed.Store (TCPStore, FileStore, "
            f"HashStore, PrefixStore), got {type(store).__name__}"
        )
    for name, v in (("rank", rank), ("size", size)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"ringlet: ProcessGroupRinglet {name} must be an int, got {v!r}")
    if size < 1:
        raise ValueError(f"ringlet: ProcessGroupRinglet size must be at least 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(
            f"ringlet: ProcessGroupRinglet rank {rank} is outside [0, {size}) for a group of "
            f"{size}"
        )
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"ringlet: ProcessGroupRinglet timeout must be a datetime.timedelta, got {timeout!r}"
        )
    if timeout.total_seconds() < 0:
        raise ValueError(
            f"rank {rank}: ProcessGroupRinglet timeout must not be negative, got {timeout}"
        )
    if global_ranks and len(global_ranks) != size:
        raise ValueError(
            f"rank {rank}: ProcessGroupRinglet global_ranks {list(global_ranks)} must name "
            f"{size} ranks (one per group rank)"
        )


_live: weakref.WeakSet[ProcessGroupRinglet] = weakref.WeakSet()


class ProcessGroupRinglet(ProcessGroup):
    """A ``torch.distributed`` process group whose collectives run on
    ringlet's engine.

    ``init_process_group("ringlet")`` and ``new_group(..., backend="ringlet")``
    make these; it can also be built by hand, as torch's
    ``ProcessGroupGloo(store, rank, size, timeout)``, by code that manages its
    own groups (torchft's Manager, see :mod:`ringlet.torchft`; a group per
    job phase). Every rank builds one with the same store (or stores with
    the same prefix on one server) and its own rank; the group connects
    through the store on its first operation, so ranks may build it at
    different times within ``timeout``. Call its methods directly
    (``pg.allreduce([t]).wait()``, ``pg.barrier().wait()``); torch's
    ``dist.*`` functions take only groups that torch made. ``abort()``
    gives it up at once, ``shutdown()`` after queued operations.

    Args:
      store (torch.distributed.Store): A store all ranks of the group reach:
        a ``TCPStore``, ``FileStore``, ``HashStore`` (one process) or a
        ``PrefixStore`` over one. Each group built on one store prefix is
        a new group (the k-th built by each rank connects with the k-th of
        the others).
      rank (int): This process's rank in the group, ``0 <= rank < size``.
      size (int): Number of ranks in the group (at least 1).
      timeout (timedelta, optional): How long an operation (and the first
        connection) may wait for a peer. Default: 30 minutes, torch's
        default for gloo.
      global_ranks (list of int, optional): Rank of each group rank in a
        larger job, named in errors. Default: ``range(size)``.

    Raises:
      TypeError: ``store`` is not a ``torch.distributed.Store`` or
        ``timeout`` not a ``timedelta``.
      ValueError: ``size`` below 1, ``rank`` outside ``[0, size)``, a
        negative ``timeout``, or ``global_ranks`` of another length than
        ``size``.

    Example:
      >>> from datetime import timedelta
      >>> import torch, torch.distributed as dist
      >>> from ringlet.c10d import ProcessGroupRinglet
      >>> store = dist.TCPStore("127.0.0.1", 29500, 2, is_master=(rank == 0))
      >>> pg = ProcessGroupRinglet(store, rank, 2, timedelta(seconds=60))
      >>> t = torch.ones(4) * (rank + 1)
      >>> pg.allreduce([t]).wait()                  # 1 + 2 on 2 ranks
      True
      >>> t
      tensor([3., 3., 3., 3.])
      >>> pg.shutdown()
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: timedelta = timedelta(minutes=30),
        global_ranks: Optional[list[int]] = None,
    ) -> None:
        _check_group_args(store, rank, size, timeout, global_ranks)
        super().__init__(rank, size)
        self._store = store
        self._rank = rank
        self._size = size
        self._timeout = max(timeout.total_seconds(), 1e-3)
        self._members = list(global_ranks) if global_ranks else list(range(size))
        # The k-th group created at this store prefix by this rank; members
        # create groups in the same order, so k agrees and a store reused
        # after destroy_process_group() never hands out stale addresses.
        self._key = f"ringlet/{int(store.add(f'ringlet/incarnation/{rank}', 1))}"
        # The group's communicators (its world, levels and pairs) fail
        # together: a failure in one aborts the others, naming its origin.
        self._domain = runtime._new_domain()
        self._comm: Any = None
        # The host level its communicator took over, on a group spanning hosts.
        self._levels: Optional[Any] = None
        self._lock = threading.Lock()
        self._queue = _core.Progress("ringlet-pg")
        self._p2p: dict[tuple[int, int], tuple[Any, Any]] = {}
        self._any: Any = None  # the queue of receives from any source (made on first use)
        self._any_next = 0  # the rank an any-source receive looks at first (round robin)
        self._name = ""
        self._desc = ""
        self._coalescing: Optional[list[Work]] = None
        self._barriers = 0
        self._shrinks = 0
        self._closed = False
        self._kind = "python"  # "native" behind the C++ Backend (see ringlet._native)
        # torch asks a group which devices it serves (`_device_types`: DCP's
        # async_save, state dicts broadcast from rank 0, the group's default
        # device). The group itself runs its operations, so the device is
        # recorded without a separate Backend object.
        self._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, None)
        _live.add(self)

    # -- identity ------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def __repr__(self) -> str:
        return (f"ProcessGroupRinglet(rank={self._rank}, size={self._size}, name={self._name!r}, "
                f"backend={self._kind!r})")

    # -- connections ---------------------------------------------------------

    def _where(self) -> str:
        return f"rank {self._members[self._rank]}"

    def _destroyed(self) -> errors.CommunicatorAbortedError:
        return errors.CommunicatorAbortedError(
            f"{self._where()}: the process group was destroyed"
        )

    def _title(self) -> str:
        """How errors name this group."""
        label = self._desc or self._name
        return f"process group {label!r} (ranks {self._members})" if label else (
            f"a process group of ranks {self._members}")

    def _addr(self) -> str:
        master = os.environ.get("MASTER_ADDR") or _store_host(self._store) or "127.0.0.1"
        return runtime._local_ip(master)

    def _world(self, block: bool = False) -> Any:
        """The group's communicator, connected on first use (on the progress
        thread, through the group's store, by its members only), or at once
        for the job's default group (``_create``), whose waits on the store
        then ``block`` (see ``runtime._await``)."""
        comm = self._comm
        if comm is None:
            with self._lock:
                if self._closed:
                    raise self._destroyed()
                if self._comm is None:
                    if self._size == 1:
                        self._comm = _core.Communicator.single(self._domain)
                    else:
                        addr = self._addr()
                        comm, hosts = runtime._connect(
                            self._store, self._key, self._rank, self._size, addr,
                            self._timeout, members=self._members, name=self._title(),
                            domain=self._domain, block=block,
                        )
                        # A group spanning hosts: collectives run in two levels
                        # inside the engine (shared memory within hosts, TCP across).
                        hier = runtime._hierarchy(
                            self._store, self._key, self._rank, hosts, addr, self._timeout,
                            self._domain, members=self._members, block=block,
                        )
                        if hier is not None:
                            comm.attach_levels(hier, runtime._layout(hosts))
                            self._levels = hier
                        self._comm = comm
                comm = self._comm
        return comm

    def _channel(self, src: int, dst: int) -> tuple[Any, Any]:
        """The (queue, communicator slot) of messages from group rank ``src``
        to ``dst``: one two-rank communicator and one queue per direction."""
        with self._lock:
            ch = self._p2p.get((src, dst))
            if ch is None:
                if self._closed:
                    raise self._destroyed()
                # [communicator, error of an eager send, lock for connecting,
                #  messages received ahead of their receive: tag -> [tensors]]
                ch = (_core.Progress("ringlet-p2p"), [None, None, threading.Lock(), {}])
                self._p2p[(src, dst)] = ch
        return ch

    def _pair(self, src: int, dst: int, slot: list[Any]) -> Any:
        """The two-rank communicator of messages from ``src`` to ``dst``,
        connected on first use (once, whichever thread asks first: that
        direction's queue, or a receive from any source)."""
        if slot[0] is None:
            with slot[2]:
                if slot[0] is None:
                    me = 0 if self._rank == src else 1
                    pair = [self._members[src], self._members[dst]]
                    slot[0], _ = runtime._connect(
                        self._store, f"{self._key}/p2p/{src}-{dst}", me, 2, self._addr(),
                        self._timeout, members=pair,
                        name=f"messages from rank {pair[0]} to rank {pair[1]} in "
                             f"{self._title()}",
                        domain=self._domain,
                    )
        return slot[0]

    def _submit(
        self, fn: Callable[[], Any], result: list[Any], queue: Any = None,
        source: Optional[int] = None, wake: bool = True,
    ) -> Work:
        """Queues ``fn`` in issue order. ``wake=False`` for synchronous calls
        (c10d waits at once): the waiting caller runs it without waking the
        progress thread, unless the thread is busy with earlier operations."""
        q = self._queue if queue is None else queue
        if not wake and _run_now(q, fn):  # synchronous and nothing queued: run it here
            return _DONE
        work = Work(q, result, self._timeout, source)
        work._woken = wake
        work._ticket = q.submit(work._run(fn), wake)
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    def _sync_comm(self, opts: Any, nbytes: int) -> Any:
        """The group's communicator when a call with ``opts`` can run as one
        engine call on the calling thread (synchronous, connected, one level
        for ``nbytes``), else None."""
        comm = self._comm
        if comm is None or opts is None or getattr(opts, "asyncOp", True):
            return None
        return comm

    def _run_now(self, call: Callable[..., Any], *args: Any) -> bool:
        """Runs the engine call ``call(*args)`` on this thread when the group's
        queue is idle (no Python job, no Work); see the module's _run_now."""
        return _run_now(self._queue, functools.partial(call, *args))

    # -- argument checks -----------------------------------------------------

    def _tensor(self, t: Any, what: str) -> torch.Tensor:
        """``t`` checked for the engine (complex tensors as real views);
        non-contiguous tensors are accepted and staged through a copy."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{self._where()}: {what} must be a torch.Tensor, got {type(t).__name__}"
            )
        if t.is_complex():
            t = torch.view_as_real(t)
        _check(t if t.is_contiguous() else t[:0], what)
        return t

    def _root(self, root: int, what: str) -> int:
        if not 0 <= root < self._size:
            raise ValueError(
                f"{self._where()}: {what}: invalid root rank: {root} (a group of {self._size} "
                "ranks)"
            )
        return root

    def _real_op(self, op: Any, tensors: Any, what: str) -> None:
        """Refuses complex tensors for the reduce ops that do not act on a
        complex number's real and imaginary parts alone (all but SUM, AVG and
        PREMUL_SUM), as torch and gloo do, instead of reducing the parts."""
        kind = getattr(op, "op", op)
        if kind in (_RED.SUM, _RED.AVG, _RED.PREMUL_SUM):
            return
        stack = [tensors]
        while stack:
            t = stack.pop()
            if isinstance(t, (list, tuple)):
                stack.extend(t)
            elif isinstance(t, torch.Tensor) and t.is_complex():
                raise ValueError(
                    f"{self._where()}: {what} does not support {kind.name} on complex tensors"
                )

    @staticmethod
    def _dense(ts: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """Contiguous stand-ins for ``ts`` and a function that copies results
        back into the non-contiguous originals."""
        work = [t if t.is_contiguous() else t.contiguous() for t in ts]

        def back() -> None:
            for t, w in zip(ts, work):
                if w is not t:
                    _write_back(t, w)

        return work, back

    def _reduce_args(self, op: Any, ts: list[torch.Tensor], what: str) -> tuple[str, Callable]:
        """The engine reduce type for a torch ReduceOp, and what to do to each
        input before (PREMUL_SUM) and after (AVG) the sum."""
        name = _reduce_name(op, what)
        kind = getattr(op, "op", op)
        for t in ts:
            if name in ("and", "or", "xor") and t.is_floating_point():
                raise ValueError(
                    f"{self._where()}: {what}: reduce op {kind.name} needs integer or bool "
                    f"tensors, got {t.dtype}"
                )
            if kind in (_RED.AVG, _RED.PREMUL_SUM) and t.dtype == torch.bool:
                raise ValueError(f"{self._where()}: {what}: {kind.name} on a bool tensor")
        size = self._size

        def post(t: torch.Tensor) -> None:
            if kind == _RED.AVG:
                if t.is_floating_point():
                    t.div_(size)
                else:
                    t.copy_(torch.div(t, size, rounding_mode="trunc"))

        if kind == _RED.PREMUL_SUM:
            factor = getattr(op, "factor", None)
            if factor is None:
                raise ValueError(f"{self._where()}: {what}: PREMUL_SUM without a factor")
            for t in ts:
                t.mul_(factor)
        return name, post

    # -- collectives ---------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        # The blocking all_reduce of one plain tensor on a connected one-level
        # group (what dist.all_reduce does most), before any wrapper: the
        # engine call on this thread when the queue is idle. Else _allreduce.
        # Written out (no helper calls): each saves about 0.1 us of a 4 us call.
        comm = self._comm
        if (comm is not None and type(opts) is _AllreduceOptions and type(tensors) is list
                and len(tensors) == 1 and not opts.asyncOp):
            t = tensors[0]
            name = _DTYPE_NAMES.get(t.dtype) if type(t) is torch.Tensor else None
            if name is not None and t.layout is _STRIDED and t.is_cpu and t.is_contiguous():
                op = opts.reduceOp
                red = "sum" if op == _SUM else _SIMPLE.get(op.op)
                if red is not None and (red in _ANY_DTYPE or not t.is_floating_point()):
                    try:
                        if self._queue.all_reduce_now(comm, t.data_ptr(), t.nbytes, name, red):
                            return _DONE
                    except BaseException as e:
                        raise _DistErrors.convert(e) from None
        return self._allreduce(tensors, opts, together=True)

    @_torch_errors
    def _allreduce(
        self, tensors: list[torch.Tensor], opts: Any = None, together: bool = False
    ) -> Work:
        """All-reduces each of ``tensors`` (``allreduce_coalesced``), or, with
        ``together``, all of them as one (``allreduce`` of several tensors,
        torch's multi-device form, as gloo: every tensor of every rank
        reduced, the result written into each)."""
        if type(opts) is not dist.AllreduceOptions:  # another of torch's call forms
            tensors, opts = _as_list(tensors), _opts(dist.AllreduceOptions, opts)
        op = opts.reduceOp
        if len(tensors) == 1:  # the common case, with the fewest steps
            t = tensors[0]
            name = _DTYPE_NAMES.get(t.dtype)
            red = "sum" if op == _SUM else _SIMPLE.get(getattr(op, "op", op))
            if (name is not None and red is not None and t.is_cpu and t.is_contiguous()
                    and t.layout == torch.strided
                    and (red in _ANY_DTYPE or not t.is_floating_point())):
                # One engine call (in two levels on a group spanning hosts).
                return self._submit(lambda: _engine_all_reduce(self._world(), t, name, red),
                                    [t], wake=_is_async(opts))
        if any(isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo for t in tensors):
            return self._sparse_allreduce(tensors, op, opts)
        self._real_op(op, tensors, "all_reduce")
        ts = [self._tensor(t, f"all_reduce tensors[{i}]") for i, t in enumerate(tensors)]
        if together and len(ts) != 1:
            return self._allreduce_together(tensors, ts, op, opts)

        def run() -> None:
            dense, back = self._dense(ts)
            name, post = self._reduce_args(op, dense, "all_reduce")
            _reduce_inplace(self._world(), dense, name, 1.0)
            for t in dense:
                post(t)
            back()

        return self._submit(run, list(tensors), wake=_is_async(opts))

    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: Any, opts: Any) -> Work:
        """The sum of sparse COO tensors, written into each (as gloo): every
        rank's indices and values are gathered and coalesced."""
        if getattr(op, "op", op) != _RED.SUM:
            raise ValueError(
                f"{self._where()}: all_reduce of a sparse tensor supports ReduceOp.SUM only"
            )
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or t.layout != torch.sparse_coo or not t.is_cpu:
                raise ValueError(
                    f"{self._where()}: all_reduce tensors[{i}]: a sparse all_reduce takes "
                    "sparse COO CPU tensors only"
                )

        def gather_rows(rows: torch.Tensor, counts: list[int], comm: Any) -> torch.Tensor:
            # every rank's rows (dim 0), ragged, concatenated in rank order
            rows = rows.contiguous()
            if rows.is_complex():
                rows = torch.view_as_real(rows)
            per = math.prod(rows.shape[1:])
            flat = _gather_ragged(comm, self._size, rows, [c * per for c in counts])
            return flat.view(sum(counts), *rows.shape[1:])

        def run() -> None:
            comm = self._world()
            for t in tensors:
                x = t.coalesce()
                nnz = torch.tensor([x._nnz()], dtype=torch.int64)
                counts = torch.empty(self._size, dtype=torch.int64)
                _engine_all_gather(comm, nnz, counts, "int64")
                n = counts.tolist()
                idx = gather_rows(x.indices().t(), n, comm).t()
                val = gather_rows(x.values(), n, comm)
                if x.values().is_complex():
                    val = torch.view_as_complex(val)
                # invariants named (gloo's result warns of nothing): the
                # indices come from coalesced tensors, in bounds
                t.copy_(torch.sparse_coo_tensor(idx, val, t.shape, check_invariants=False)
                        .coalesce())

        return self._submit(run, list(tensors), wake=_is_async(opts))

    def _allreduce_together(
        self, tensors: list[torch.Tensor], ts: list[torch.Tensor], op: Any, opts: Any
    ) -> Work:
        """One reduction over all of ``ts`` on every rank (``tensors`` as the
        caller gave them; ``ts`` as the engine takes them), written into each:
        the list is folded here, the fold all-reduced, and AVG divides by
        every tensor taking part (ranks x list length)."""
        self._same_tensors(ts, "all_reduce")
        name, _ = self._reduce_args(op, [ts[0].new_empty(0)], "all_reduce")  # checks only
        fold = _FOLDS[name]
        count = len(ts)

        def run() -> None:
            acc = ts[0].clone(memory_format=torch.contiguous_format)
            for t in ts[1:]:
                acc.copy_(fold(acc, t))
            _, post = self._reduce_args(op, [acc], "all_reduce")  # PREMUL_SUM scales the fold
            _reduce_inplace(self._world(), [acc], name, 1.0)
            post(acc)
            if getattr(op, "op", op) == _RED.AVG:
                if acc.is_floating_point():
                    acc.div_(count)
                else:
                    acc.copy_(torch.div(acc, count, rounding_mode="trunc"))
            for t in ts:
                _write_back(t, acc)

        return self._submit(run, list(tensors), wake=_is_async(opts))

    def _same_tensors(self, ts: list[torch.Tensor], what: str) -> None:
        """Checks that the tensors of a multi-device call (one list entry per
        device in torch's form) agree in dtype and shape, as gloo requires."""
        if not ts:
            raise ValueError(f"{self._where()}: {what} needs at least one tensor")
        first = ts[0]
        for i, t in enumerate(ts[1:], 1):
            for part, want, got in (("type", first.dtype, t.dtype),
                                    ("size", tuple(first.shape), tuple(t.shape))):
                if want != got:
                    raise ValueError(
                        f"{self._where()}: {what}: invalid tensor {part} at index {i} (expected "
                        f"{want} as tensor 0, got {got}): the tensors of one call act as one"
                    )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        return self._allreduce(tensors, opts)

    @_torch_errors
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        if type(opts) is not dist.BroadcastOptions:  # another of torch's call forms
            tensors, opts = _as_list(tensors), _opts(dist.BroadcastOptions, opts)
        root = self._root(opts.rootRank, "broadcast")
        if len(tensors) == 1:
            t = tensors[0]
            name = _plain(t)
            comm = self._sync_comm(opts, t.nbytes) if name is not None else None
            if comm is not None and self._run_now(
                    comm.broadcast, t.data_ptr(), t.nbytes, name, root):
                return _DONE
        ts = [self._tensor(t, f"broadcast tensors[{i}]") for i, t in enumerate(tensors)]
        # Several tensors are torch's multi-device form (as gloo): the root's
        # tensor rootTensor goes into every tensor of every rank.
        if len(ts) != 1:
            self._same_tensors(ts, "broadcast")
        pick = getattr(opts, "rootTensor", 0)
        if not 0 <= pick < len(ts):
            raise ValueError(
                f"{self._where()}: broadcast: invalid root tensor: {pick} (the call has "
                f"{len(ts)} tensors)"
            )

        def run() -> None:
            dense, back = self._dense(ts)
            src = dense[pick]
            _engine_broadcast(self._world(), src, _check(src, "broadcast tensor"), root)
            for t in dense:
                if t is not src:
                    t.copy_(src)
            back()

        return self._submit(run, list(tensors), wake=_is_async(opts))

    @_torch_errors
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None, op: Any = None) -> Work:
        tensors, opts = _as_list(tensors), _opts(dist.ReduceOptions, opts, op=op)
        root = self._root(opts.rootRank, "reduce")
        op = opts.reduceOp
        if len(tensors) != 1:
            raise ValueError(
                f"{self._where()}: reduce requires a single-element tensor list, got "
                f"{len(tensors)} tensors"
            )
        self._real_op(op, tensors, "reduce")
        ts = [self._tensor(t, f"reduce tensors[{i}]") for i, t in enumerate(tensors)]
        mine = self._rank == root

        def run() -> None:
            # Non-roots reduce a (contiguous) copy: their tensors stay as they were.
            dense, back = self._dense(ts) if mine else (
                [t.clone(memory_format=torch.contiguous_format) for t in ts], lambda: None)
            name, post = self._reduce_args(op, dense, "reduce")
            _reduce_inplace(self._world(), dense, name, 1.0)
            if mine:
                for t in dense:
                    post(t)
                back()

        return self._submit(run, list(tensors), wake=_is_async(opts))

    def _gather_into(self, inp: torch.Tensor, outs: list[torch.Tensor], what: str) -> None:
        """All-gathers ``inp`` into ``outs`` (one tensor per rank)."""
        comm = self._world()
        inp = inp.contiguous()
        n = inp.numel()
        if all(o.numel() == n for o in outs) and all(o.dtype == inp.dtype for o in outs):
            flat = torch.empty(self._size * n, dtype=inp.dtype)
            with _sizes_of("all_gather", "output tensor r must have rank r's input size"):
                _engine_all_gather(comm, inp, flat, _check(inp, what))
            for r, o in enumerate(outs):
                o.view(-1).copy_(flat[r * n:(r + 1) * n]) if o.is_contiguous() else o.copy_(
                    flat[r * n:(r + 1) * n].view(o.shape)
                )
            return
        # Ragged: every rank sends its input to every rank.
        with _sizes_of("all_gather", "output tensor r must have rank r's input size"):
            flat = _gather_ragged(comm, self._size, inp, [o.numel() for o in outs])
        _split_into(flat, outs)

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        if isinstance(input_tensors, torch.Tensor):  # allgather(outputs, input)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        # As gloo's future: the output list itself for one input, else all of them.
        result = output_tensors[0] if len(output_tensors) == 1 else output_tensors
        if len(input_tensors) > 1:
            return self._allgather_devices(output_tensors, input_tensors, opts, result)
        return self._allgather(output_tensors, input_tensors, opts, result)

    @_torch_errors
    def _allgather_devices(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: Any, result: Any,
    ) -> Work:
        """``allgather`` of several inputs, torch's multi-device form (as
        gloo): ``output_tensors[i][r * k + j]`` receives rank r's input j
        (k inputs), the same in each of the k output lists."""
        k, size = len(input_tensors), self._size
        if len(output_tensors) != k:
            raise ValueError(
                f"{self._where()}: all_gather requires input/output tensor lists to have the "
                f"same length ({k} inputs, {len(output_tensors)} output lists)"
            )
        for i, lst in enumerate(output_tensors):
            if len(lst) != size * k:
                raise ValueError(
                    f"{self._where()}: all_gather: invalid output tensor list at index {i} "
                    f"(expected length {size * k}: {size} ranks x {k} inputs, got {len(lst)})"
                )
        self._same_tensors([self._tensor(t, "all_gather input") for t in input_tensors],
                           "all_gather")
        first = output_tensors[0]
        per_input = [[first[r * k + j] for r in range(size)] for j in range(k)]

        def copies() -> None:
            for lst in output_tensors[1:]:
                for o, src in zip(lst, first):
                    o.copy_(src)

        return self._allgather(per_input, input_tensors, opts, result, then=copies)

    @_torch_errors
    def _allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: Any, result: Any, then: Optional[Callable[[], None]] = None,
    ) -> Work:
        ins = [self._tensor(t, "all_gather input") for t in input_tensors]
        outs = [[self._tensor(o, "all_gather output") for o in lst] for lst in output_tensors]
        for lst in outs:
            if len(lst) != self._size:
                raise ValueError(
                    f"{self._where()}: all_gather needs {self._size} output tensors (one per "
                    f"rank), got {len(lst)}"
                )

        def run() -> None:
            for inp, lst in zip(ins, outs):
                self._gather_into(inp, lst, "all_gather input")
            if then is not None:
                then()

        return self._submit(run, list(result), wake=_is_async(opts))

    @_torch_errors
    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        # torch's layout: output_lists[rank][i] receives input_list[i] of that rank.
        if len(output_lists) != self._size:
            raise ValueError(
                f"{self._where()}: all_gather_coalesced needs {self._size} output lists (one "
                f"per rank), got {len(output_lists)}"
            )
        for r, lst in enumerate(output_lists):
            if len(lst) != len(input_list):
                raise ValueError(
                    f"{self._where()}: all_gather_coalesced output list {r} holds {len(lst)} "
                    f"tensors for {len(input_list)} inputs"
                )
        per_input = [[lst[i] for lst in output_lists] for i in range(len(input_list))]
        return self._allgather(per_input, input_list, opts, output_lists)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:
        name = _plain(input)
        if name is not None and _plain(output) == name:
            nb = input.nbytes
            comm = self._sync_comm(opts, nb * self._size)
            if (comm is not None and output.nbytes == nb * self._size
                    and _disjoint(input, output)
                    and self._run_now(comm.all_gather, input.data_ptr(), nb,
                                      output.data_ptr(), output.nbytes, name)):
                return _DONE
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    @_torch_errors
    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        pairs = []
        for o, i in zip(outputs, inputs):
            i, o = self._tensor(i, "all_gather_into_tensor input"), self._tensor(
                o, "all_gather_into_tensor output")
            if o.numel() != i.numel() * self._size or o.dtype != i.dtype:
                raise ValueError(
                    f"{self._where()}: all_gather_into_tensor: output holds {o.numel()} x "
                    f"{o.dtype}, expected {self._size} x {i.numel()} x {i.dtype} (group size "
                    "x input)"
                )
            pairs.append((o, i))

        def run() -> None:
            comm = self._world()
            for o, i in pairs:
                dense, back = self._dense([o])
                src = i.contiguous()
                if _overlaps(src, dense[0]):  # in place (FSDP2: input is a slot of output)
                    src = src.clone()
                _engine_all_gather(comm, src, dense[0], _check(src, "all_gather_into_tensor input"))
                back()

        # As gloo's future (its all_gather_into_tensor is an all_gather into
        # the output's chunks): one tensor per rank for a single output.
        result = list(outputs[0].chunk(self._size)) if len(outputs) == 1 else list(outputs)
        return self._submit(run, result, wake=_is_async(opts))

    all_gather_single_coalesced = allgather_into_tensor_coalesced
    all_gather_single = _allgather_base

    def _scatter_reduce(
        self, inp: torch.Tensor, out: torch.Tensor, op: Any, what: str,
        blocks: Optional[list[int]] = None,
    ) -> None:
        """Reduce-scatters flat ``inp`` (one block per rank) into ``out``."""
        comm = self._world()
        inp = inp.contiguous()
        if getattr(op, "op", op) == _RED.PREMUL_SUM or _overlaps(inp, out):
            inp = inp.clone()  # scaled, or written over: the caller's input stays
        name, post = self._reduce_args(op, [inp], what)
        if blocks is None or len(set(blocks)) == 1:
            dense, back = self._dense([out])
            _engine_reduce_scatter(comm, inp.view(-1), dense[0].view(-1), _check(inp, what), name)
            post(dense[0])
            back()
            return
        # Ragged blocks: reduce everything, keep this rank's block.
        _reduce_inplace(comm, [inp], name, 1.0)
        start = sum(blocks[: self._rank])
        mine = inp.view(-1)[start:start + blocks[self._rank]].clone()
        post(mine)
        out.copy_(mine.view(out.shape))

    @_torch_errors
    def reduce_scatter(  # the list form: inputs are concatenated into a fresh buffer
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Work:
        if isinstance(output_tensors, torch.Tensor):  # reduce_scatter(output, inputs, op)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        op = _opts(dist.ReduceScatterOptions, opts).reduceOp
        self._real_op(op, [output_tensors, input_tensors], "reduce_scatter")
        outs = [self._tensor(o, "reduce_scatter output") for o in output_tensors]
        ins = [[self._tensor(t, "reduce_scatter input") for t in lst] for lst in input_tensors]
        for o, lst in zip(outs, ins):
            if len(lst) != self._size:
                raise ValueError(
                    f"{self._where()}: reduce_scatter needs {self._size} input tensors (one "
                    f"per rank), got {len(lst)}"
                )
            if lst[self._rank].numel() != o.numel():
                raise ValueError(
                    f"{self._where()}: reduce_scatter output holds {o.numel()} elements but "
                    f"this rank's input block holds {lst[self._rank].numel()}"
                )

        def run() -> None:
            for o, lst in zip(outs, ins):
                flat = torch.cat([t.reshape(-1) for t in lst])
                self._scatter_reduce(flat, o, op, "reduce_scatter", [t.numel() for t in lst])

        return self._submit(run, list(output_tensors), wake=_is_async(opts))

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Work:
        name = _plain(input)
        comm = self._sync_comm(opts, input.nbytes) if name is not None else None
        if comm is not None and _plain(output) == name:
            op = opts.reduceOp
            red = "sum" if op == _SUM else _SIMPLE.get(getattr(op, "op", op))
            nb = input.nbytes
            if (red is not None and (red in _ANY_DTYPE or not input.is_floating_point())
                    and output.nbytes * self._size == nb and _disjoint(input, output)
                    and self._run_now(comm.reduce_scatter, input.data_ptr(), nb,
                                      output.data_ptr(), output.nbytes, name, red)):
                return _DONE
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    @_torch_errors
    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        self._real_op(op, [outputs, inputs], "reduce_scatter_tensor")
        pairs = []
        for o, i in zip(outputs, inputs):
            i, o = self._tensor(i, "reduce_scatter_tensor input"), self._tensor(
                o, "reduce_scatter_tensor output")
            if i.numel() != o.numel() * self._size or o.dtype != i.dtype:
                raise ValueError(
                    f"{self._where()}: reduce_scatter_tensor: input holds {i.numel()} x "
                    f"{i.dtype}, expected {self._size} x {o.numel()} x {o.dtype} (group size x "
                    "output)"
                )
            pairs.append((o, i))

        def run() -> None:
            for o, i in pairs:
                self._scatter_reduce(i, o, op, "reduce_scatter_tensor")

        return self._submit(run, list(outputs), wake=_is_async(opts))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base

    @_torch_errors
    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        if isinstance(input_tensors, torch.Tensor):  # gather(outputs, input, root)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        opts = _opts(dist.GatherOptions, opts)
        root = self._root(opts.rootRank, "gather")
        inp = self._tensor(input_tensors[0], "gather input")
        outs: list[torch.Tensor] = []
        if self._rank == root:
            if len(output_tensors) != 1 or len(output_tensors[0]) != self._size:
                raise ValueError(
                    f"{self._where()}: gather needs a list of {self._size} output tensors on "
                    "the root"
                )
            outs = [self._tensor(o, "gather output") for o in output_tensors[0]]
        elif output_tensors and any(output_tensors):
            raise ValueError(f"{self._where()}: gather output tensors are only given on the root")

        def run() -> None:
            send = inp.contiguous().view(-1)
            counts = [0] * self._size
            counts[root] = send.numel()
            recv_counts = [o.numel() for o in outs] if outs else [0] * self._size
            flat = torch.empty(sum(recv_counts), dtype=inp.dtype)
            with _sizes_of("gather", "the root's output tensor r must have rank r's input size"):
                _exchange(self._world(), send, counts, flat, recv_counts)
            _split_into(flat, outs)

        # As gloo's future: the root's list of gathered tensors.
        result = list(output_tensors[0]) if outs else list(output_tensors)
        return self._submit(run, result, wake=_is_async(opts))

    @_torch_errors
    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Work:
        if isinstance(output_tensors, torch.Tensor):  # scatter(output, inputs, root)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        opts = _opts(dist.ScatterOptions, opts)
        root = self._root(opts.rootRank, "scatter")
        out = self._tensor(output_tensors[0], "scatter output")
        ins: list[torch.Tensor] = []
        if self._rank == root:
            if len(input_tensors) != 1 or len(input_tensors[0]) != self._size:
                raise ValueError(
                    f"{self._where()}: scatter needs a list of {self._size} input tensors on "
                    "the root"
                )
            ins = [self._tensor(t, "scatter input") for t in input_tensors[0]]
        elif input_tensors and any(input_tensors):
            raise ValueError(f"{self._where()}: scatter input tensors are only given on the root")

        def run() -> None:
            send = (torch.cat([t.reshape(-1) for t in ins]) if ins
                    else torch.empty(0, dtype=out.dtype))
            counts = [t.numel() for t in ins] if ins else [0] * self._size
            recv_counts = [0] * self._size
            recv_counts[root] = out.numel()
            dense, back = self._dense([out])
            with _sizes_of("scatter", "rank r's output must have the size of the root's input "
                                      "tensor r"):
                _exchange(self._world(), send, counts, dense[0].view(-1), recv_counts)
            back()

        return self._submit(run, list(output_tensors), wake=_is_async(opts))

    @_torch_errors
    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
        input_split_sizes: list[int], opts: Any = None,
    ) -> Work:
        inp = self._tensor(input, "all_to_all_single input")
        out = self._tensor(output, "all_to_all_single output")
        if inp.dtype != out.dtype:
            raise ValueError(
                f"{self._where()}: all_to_all_single input is {inp.dtype} but output is {out.dtype}"
            )

        def counts(t: torch.Tensor, splits: list[int], what: str) -> list[int]:
            rows = t.shape[0] if t.dim() else 1
            row = t.numel() // rows if rows else 0
            if not splits:
                if rows % self._size:
                    raise ValueError(
                        f"{self._where()}: all_to_all_single {what} has {rows} rows, not "
                        f"divisible by the group size {self._size}; pass split sizes"
                    )
                return [rows // self._size * row] * self._size
            if len(splits) != self._size or sum(splits) != rows or min(splits) < 0:
                raise ValueError(
                    f"{self._where()}: all_to_all_single {what} split sizes {list(splits)} must "
                    f"be {self._size} non-negative numbers adding up to dim 0 ({rows})"
                )
            return [s * row for s in splits]

        send_counts = counts(inp, list(input_split_sizes), "input")
        recv_counts = counts(out, list(output_split_sizes), "output")

        def run() -> None:
            dense, back = self._dense([out])
            _exchange(self._world(), inp.contiguous().view(-1), send_counts,
                      dense[0].view(-1), recv_counts)
            back()

        return self._submit(run, [output], wake=_is_async(opts))

    all_to_all_single = alltoall_base

    @_torch_errors
    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Work:
        ins = [self._tensor(t, "all_to_all input") for t in input_tensors]
        outs = [self._tensor(t, "all_to_all output") for t in output_tensors]
        if len(ins) != self._size or len(outs) != self._size:
            raise ValueError(
                f"{self._where()}: all_to_all needs {self._size} input and output tensors, got "
                f"{len(ins)} and {len(outs)}"
            )
        dtypes = {t.dtype for t in ins + outs}
        if len(dtypes) != 1:
            raise ValueError(
                f"{self._where()}: all_to_all tensors mix dtypes {sorted(map(str, dtypes))}"
            )

        def run() -> None:
            send = torch.cat([t.reshape(-1) for t in ins])
            flat = torch.empty(sum(o.numel() for o in outs), dtype=outs[0].dtype)
            _exchange(self._world(), send, [t.numel() for t in ins], flat,
                      [o.numel() for o in outs])
            _split_into(flat, outs)

        return self._submit(run, list(output_tensors), wake=_is_async(opts))

    def barrier(self, opts: Any = None) -> Work:
        return self._submit(lambda: self._world().barrier(), [], wake=_is_async(opts))

    @_torch_errors
    def monitored_barrier(
        self, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False
    ) -> None:
        """gloo's ``monitored_barrier``: rank 0 waits for every other rank
        within ``timeout`` and raises naming the ranks that did not arrive
        (all of them with ``wait_all_ranks=True``, else the first); the other
        ranks wait for rank 0's release. Runs through the group's store, so a
        hung rank cannot stall it. Every wait ends at one deadline,
        ``timeout`` after the call (zero: rank 0 looks once, waits for
        nobody); a rank 0 that fails posts its error, so the others raise at
        once instead of at their own deadline. Messages are gloo's (group
        ranks), followed by ringlet's (global ranks).

        Args:
          timeout (timedelta, optional): How long rank 0 waits for the
            others, and they for its release. Default: the group's timeout.
          wait_all_ranks (bool, optional): Rank 0 names every rank missing
            at the deadline instead of the first. Default: ``False``.

        Returns:
          None.

        Example:
          >>> pg.monitored_barrier(timedelta(seconds=10), wait_all_ranks=True)
        """
        import time

        secs = max(timeout.total_seconds(), 0.0) if timeout is not None else self._timeout
        ms = int(secs * 1000)
        deadline = time.monotonic() + secs
        self._barriers += 1
        key = f"{self._key}/monitored/{self._barriers}"
        store = self._store
        if self._rank != 0:
            store.set(f"{key}/{self._rank}", "1")
            arrived, why = _store_wait(store, f"{key}/release", deadline)
            if arrived:
                verdict = bytes(store.get(f"{key}/release")).decode()
                if verdict == "1":
                    return
                why = f"rank {self._members[0]} reported: {verdict}"
            elif why is None:
                why = (f"{self._where()}: monitored_barrier: Timed out after {secs:g}s waiting "
                       f"for rank {self._members[0]} to release the barrier")
            raise self._monitored_error(
                f"Rank {self._rank} successfully reached monitoredBarrier, but received errors "
                "while waiting for send/recv from rank 0. Please check rank 0 logs for faulty "
                f"rank.\n Original exception: \n{why}", self._members[0])
        processed: list[int] = []
        missing: list[int] = []
        for r in range(1, self._size):
            k = f"{key}/{r}"
            if not wait_all_ranks and time.monotonic() >= deadline and not store.check([k]):
                # No time left before this rank (gloo checks before each wait).
                done = (f"Successfully processed ranks: {', '.join(map(str, processed))}"
                        if processed else "No ranks successfully processed in monitoredBarrier.")
                why = f"Rank 0 timed out in monitoredBarrier after {ms} ms.\n{done}"
                err = self._monitored_error(
                    f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {ms} ms\n Original "
                    f"exception: \n{why}\n({self._where()}: monitored_barrier: rank "
                    f"{self._members[r]} did not arrive)", self._members[r])
                store.set(f"{key}/release", str(err))
                raise err
            arrived, why = _store_wait(store, k, deadline)
            if arrived:
                processed.append(r)
                continue
            if not wait_all_ranks:
                why = why or (f"{self._where()}: monitored_barrier: Timed out after {secs:g}s "
                              f"waiting for rank {self._members[r]}: rank {self._members[r]} did "
                              "not arrive")
                err = self._monitored_error(
                    f"[Rank 0]: Rank {r} failed to pass monitoredBarrier in {ms} ms\n Original "
                    f"exception: \n{why}", self._members[r])
                store.set(f"{key}/release", str(err))
                raise err
            missing.append(r)
        if missing:
            err = self._monitored_error(
                f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier "
                f"in {ms} ms\n({self._where()}: monitored_barrier: Timed out after {secs:g}s "
                f"waiting for ranks {[self._members[r] for r in missing]})",
                self._members[missing[0]])
            store.set(f"{key}/release", str(err))
            raise err
        store.set(f"{key}/release", "1")

    def _monitored_error(self, msg: str, culprit: int) -> BaseException:
        err = errors.CollectiveTimeoutError(msg)
        err.rank, err.culprit, err.cause = self._members[self._rank], culprit, "timeout"
        err.op, err.group = "monitored_barrier", self._title()
        return _DistErrors.convert(err)

    # -- point-to-point ------------------------------------------------------

    def _peer(self, peer: int, what: str) -> int:
        if not 0 <= peer < self._size or peer == self._rank:
            raise ValueError(
                f"{self._where()}: {what} rank {peer} is not another rank of this group of "
                f"{self._size}"
            )
        return peer

    @staticmethod
    def _tag(tag: int) -> int:
        if not 0 <= tag < 2**31:
            raise ValueError(f"ringlet: message tag must be in [0, 2**31), got {tag}")
        return tag

    @_torch_errors
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Work:
        dst, tag = self._peer(dstRank, "send to"), self._tag(tag)
        t = self._tensor(tensors[0], "send tensor")
        queue, slot = self._channel(self._rank, dst)
        if slot[1] is not None:  # an earlier eager send of this direction failed
            raise slot[1]
        eager = t.nbytes <= _EAGER_SEND_BYTES
        data = t.contiguous().clone() if eager or not t.is_contiguous() else t

        def run() -> None:
            try:
                self._pair(self._rank, dst, slot).send(
                    data.data_ptr(), data.nbytes, _check(data, "send tensor"), 1, tag
                )
            except BaseException as e:
                slot[1] = _DistErrors.convert(e)
                raise

        work = self._submit(run, list(tensors), queue)
        if not eager:
            return work
        # The copy is ours: the send completes now, as gloo's does once the
        # bytes are in the socket. A failed delivery is raised by the next
        # message in this direction.
        done = Work(queue, list(tensors), self._timeout)
        done._finish(None)
        return done

    @_torch_errors
    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Work:
        src, tag = self._peer(srcRank, "receive from"), self._tag(tag)
        t = self._tensor(tensors[0], "recv tensor")
        queue, slot = self._channel(src, self._rank)
        return self._submit(self._recv_job(src, t, tag, slot), list(tensors), queue, source=src)

    def _recv_job(self, src: int, t: torch.Tensor, tag: int, slot: list[Any]) -> Callable[[], None]:
        """Receives the next message with ``tag`` from ``src`` into ``t``.
        Messages between two ranks arrive in send order; one with another
        tag that comes first is received aside (its size is in its
        descriptor) and kept for the receive that names its tag, as gloo's
        and MPI's tag matching lets later messages overtake."""
        def run() -> None:
            dense, back = self._dense([t])
            name = _check(dense[0], "recv tensor")
            flat = dense[0].view(-1)
            kept = slot[3].get(tag)
            if kept:
                msg = kept.pop(0)
                if msg.numel() > flat.numel() or msg.dtype != flat.dtype:
                    raise errors.CollectiveMismatchError(
                        f"{self._where()}: rank {self._members[src]} sent a message of "
                        f"{msg.numel()} x {msg.dtype} with tag {tag}, but this receive takes "
                        f"{flat.numel()} x {flat.dtype}"
                    )
                flat[:msg.numel()].copy_(msg.view(-1))
                back()
                return
            pair = self._pair(src, self._rank, slot)
            while True:
                mtag, count, dtype = pair.wait_message(0)  # the sender is rank 0
                if mtag == tag:
                    break
                self._receive_aside(pair, slot, mtag, count, dtype)
            if dtype == name and count < flat.numel():
                flat = flat[:count]  # a shorter message fills the front, as in gloo and MPI
            pair.recv(flat.data_ptr(), flat.nbytes, name, 0, tag)
            back()

        return run

    @staticmethod
    def _receive_aside(pair: Any, slot: list[Any], tag: int, count: int, dtype: str) -> None:
        """Receives the waiting message (``tag``, ``count`` x ``dtype``) into a
        buffer of its own, kept for the receive that names its tag."""
        aside = torch.empty(count, dtype=_DTYPE_BY_NAME[dtype])
        pair.recv(aside.data_ptr(), aside.nbytes, dtype, 0, tag)
        slot[3].setdefault(tag, []).append(aside)

    @_torch_errors
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Work:
        """Receives the next message with ``tag`` sent to this rank by any rank
        of the group (``dist.recv(t)`` without ``src``); ``Work._source_rank()``
        names the sender. The job watches every incoming direction without
        taking part in it: the descriptor of a message a sender has started
        (readable in shared memory once its phase runs ahead, or waiting in
        its TCP stream), connecting directions whose senders are connecting
        (their address is in the store); then it receives from the first
        sender whose next message has ``tag``, in that direction's order.
        Directions with receives of their own still queued are skipped (those
        receives take their messages first)."""
        tag = self._tag(tag)
        t = self._tensor(_as_list(tensors)[0], "recv tensor")
        with self._lock:
            if self._any is None:
                self._any = _core.Progress("ringlet-p2p-any")
            queue = self._any
        work = Work(queue, list(_as_list(tensors)), self._timeout, -1)

        def run() -> None:
            src = self._next_sender(tag)
            work._source = src
            q, slot = self._channel(src, self._rank)
            receive, failed = self._recv_job(src, t, tag, slot), []

            def inner() -> None:  # in that direction's order; its error comes back here
                try:
                    receive()
                except BaseException as e:
                    failed.append(e)

            if not q.wait(q.submit(inner, True), self._timeout):
                raise errors.CollectiveTimeoutError(
                    f"{self._where()}: receive from any source: Timed out after "
                    f"{self._timeout:g}s receiving from rank {self._members[src]}"
                )
            if failed:
                raise failed[0]

        work._ticket = queue.submit(work._run(run), True)
        return work

    def _next_sender(self, tag: int) -> int:
        """The group rank of a sender whose next message for this rank has
        ``tag``, polling (backing off to 1 ms) until one appears or the
        timeout passes. Messages with other tags are left for the receives
        that name them; a direction whose sender is still connecting is
        connected here, so that its first message can be looked at too."""
        import time

        me, n = self._rank, self._size
        deadline = time.monotonic() + self._timeout
        pause = 1e-5
        start = self._any_next
        while True:
            for k in range(n):
                src = (start + k) % n
                if src == me:
                    continue
                queue, slot = self._channel(src, me)
                if queue.pending():  # receives from src queued earlier go first
                    continue
                if slot[3].get(tag):  # received aside earlier, waiting for this tag
                    self._any_next = (src + 1) % n
                    return src
                pair = slot[0]
                if pair is None:
                    if not self._store.check([f"{self._key}/p2p/{src}-{me}/peer/0"]):
                        continue
                    pair = self._pair(src, me, slot)  # the sender is connecting
                msg = pair.pending_message(0)  # the sender is rank 0 of the pair
                while msg is not None and msg[0] != tag:
                    # Another tag first: receive it aside (kept for its own
                    # receive) and look at the sender's next message.
                    self._receive_aside(pair, slot, *msg)
                    msg = pair.pending_message(0)
                if msg is not None:
                    self._any_next = (src + 1) % n
                    return src
            if self._closed:
                raise self._destroyed()
            if time.monotonic() > deadline:
                raise errors.CollectiveTimeoutError(
                    f"{self._where()}: receive from any source: Timed out after "
                    f"{self._timeout:g}s: no rank sent a message with tag {tag} to rank "
                    f"{self._members[me]}"
                )
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    # -- coalescing, lifetime ------------------------------------------------

    def _start_coalescing(self, device: Any) -> None:
        if self._coalescing is not None:
            raise RuntimeError(f"{self._where()}: coalescing already started on this group")
        self._coalescing = []

    def _end_coalescing(self, device: Any) -> Work:
        works, self._coalescing = self._coalescing or [], None

        def run() -> None:
            for w in works:
                w.wait()

        return self._submit(run, [])  # wakes the thread for the queued ones too

    def shutdown(self) -> None:
        """Lets queued operations finish, then closes the group's connections."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            channels = list(self._p2p.values())
        self._queue.close()
        for queue, slot in channels:
            queue.close()
            if slot[0] is not None:
                slot[0].close()
        if self._comm is not None:
            self._comm.close()
        if self._any is not None:
            self._any.close()

    def abort(self) -> None:
        """Gives up on the group at once (as ``ncclCommAbort``): a blocked
        operation raises within milliseconds, the peers learn that this rank
        aborted, and the connections close."""
        if not self._closed:
            _core.abort_domain(self._domain, self._members[self._rank])
        self.shutdown()

    def _set_default_timeout(self, timeout: timedelta) -> None:
        """Sets the timeout of the operations issued from now on (the
        engine's wait for a peer, ``Work.wait``'s default, connections);
        queued operations keep theirs."""
        self._timeout = secs = max(timeout.total_seconds(), 1e-3)
        with self._lock:
            targets = [(self._queue, None), *self._p2p.values()]
        for queue, slot in targets:
            def job(slot: Optional[list[Any]] = slot) -> None:
                comm = self._comm if slot is None else slot[0]
                if comm is not None:
                    with contextlib.suppress(Exception):  # closed meanwhile
                        comm.set_timeout(secs)

            with contextlib.suppress(Exception):  # a closed queue runs nothing more
                queue.submit(job, True)

    # -- the native Backend (ringlet._native) ----------------------------------

    def _native_handle(self) -> int:
        """A C ABI handle over this group's queue and communicator for the
        C++ Backend (which owns and frees it), or 0 before it is connected."""
        comm = self._comm
        if comm is None or self._closed:
            return 0
        try:
            return int(_core.native_group(self._queue, comm))
        except ValueError:  # closed meanwhile
            return 0

    def _shrink(self, excluded: list[int], flags: int = 0,
                timeout_s: Optional[float] = None) -> ProcessGroupRinglet:
        """The group of this group's ranks not in ``excluded`` (group ranks),
        for ``torch.distributed.shrink_group``: every survivor calls it (the
        excluded ranks must not), and the survivors connect through this
        group's store, as a new group, on its first operation. With
        ``SHRINK_ABORT`` in ``flags`` this group is aborted first (operations
        blocked on a dead rank raise at once)."""
        gone = sorted({int(r) for r in excluded})
        if not gone or any(not 0 <= r < self._size for r in gone) or self._rank in gone:
            raise ValueError(
                f"{self._where()}: shrink: cannot exclude {list(excluded)} from a group of "
                f"{self._size} ranks as rank {self._rank}"
            )
        if flags & 1:  # torch.distributed.SHRINK_ABORT
            self.abort()
        keep = [r for r in range(self._size) if r not in gone]
        self._shrinks += 1
        store = dist.PrefixStore(f"{self._key}/shrink/{self._shrinks}", self._store)
        secs = timeout_s if timeout_s else self._timeout
        return ProcessGroupRinglet(store, keep.index(self._rank), len(keep),
                                   timedelta(seconds=secs), [self._members[r] for r in keep])

    def _split(
        self, store: Any, ranks: list[int], timeout_s: float
    ) -> Optional[ProcessGroupRinglet]:
        """The group of this group's ranks ``ranks`` on ``store`` (torch's
        ``split_group``), or None on the ranks outside it."""
        ranks = [int(r) for r in ranks]
        if self._rank not in ranks:
            return None
        return ProcessGroupRinglet(store, ranks.index(self._rank), len(ranks),
                                   timedelta(seconds=timeout_s), [self._members[r] for r in ranks])

    def set_timeout(self, timeout: timedelta) -> None:
        self._set_default_timeout(timeout)


_DONE = Work(None, [], 0.0)
_DONE._finish(None)


_SHARDED = "torch.distributed._shard.sharded_tensor"
_sharded_device_done = False
_sharded_hook: Optional[_AfterImport] = None


def _sharded_tensors_on_cpu() -> None:
    """A ``ShardedTensor`` with no local shard names the CPU as its device
    when its group is ringlet's, as torch's own op does for gloo's groups (it
    asks CUDA for any other backend's: DCP's load of an FSDP1 sharded state
    dict failed on a rank holding no part of a small parameter)."""
    global _sharded_device_done
    if _sharded_device_done:
        return
    _sharded_device_done = True
    try:
        from torch.distributed._shard.sharded_tensor import _ops  # noqa: F401  (fills the table)
        from torch.distributed._shard.sharded_tensor.api import _SHARDED_OPS
    except ImportError:  # torch without the (deprecated) sharded tensors
        return
    key = torch.Tensor.device.__get__  # type: ignore[attr-defined]
    torch_op = _SHARDED_OPS.get(key)
    if torch_op is None:
        return

    def device(types: Any, args: Any = (), kwargs: Any = None, pg: Any = None) -> Any:
        st = args[0] if args else None
        if not getattr(st, "_local_shards", True) and python_group(pg) is not None:
            return torch.device("cpu")
        return torch_op(types, args, kwargs, pg)

    _SHARDED_OPS[key] = device


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_sharded_tensors_on_cpu` right after torch's sharded
    tensors are imported: importing them costs a process about 15 ms at
    start-up (on every rank, before its first collective), and only a job
    that uses them (FSDP1, DCP) needs the fix."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        global _sharded_hook
        if name != _SHARDED:
            return None
        with contextlib.suppress(ValueError):  # once: the real finders from here on
            sys.meta_path.remove(self)
        _sharded_hook = None
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _sharded_tensors_on_cpu()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _sharded_tensors_on_cpu_when_used() -> None:
    """The fix now if torch's sharded tensors are loaded, else once they are."""
    global _sharded_hook
    if _sharded_device_done or _sharded_hook is not None:
        return
    if _SHARDED in sys.modules:
        _sharded_tensors_on_cpu()
        return
    _sharded_hook = _AfterImport()
    sys.meta_path.insert(0, _sharded_hook)


def _create(opts: Any, pg_options: Any = None) -> ProcessGroupRinglet:
    _sharded_tensors_on_cpu_when_used()
    pg = ProcessGroupRinglet(
        opts.store, opts.group_rank, opts.group_size, opts.timeout,
        list(opts.global_ranks_in_group) or None,
    )
    if not dist.is_initialized():
        # The job's default group, made inside init_process_group, where
        # every rank waits for the others anyway (gloo connects its mesh
        # there): it meets its peers now, on the main thread, before any
        # other group of this process exists, so its waits on the store can
        # block instead of polling (runtime._await). The streams still open
        # on demand. A later group connects on first use, polling: a
        # blocking wait there could stall another group's thread that a
        # peer needs.
        try:
            pg._world(block=True)
        except BaseException:
            pg.abort()
            raise
    # The native C++ Backend around the Python group when it builds, else
    # the Python group itself (see ringlet._native).
    return _native.wrap(pg)


_original_monitored_barrier: Optional[Callable[..., Any]] = None
_original_set_pg_timeout: Optional[Callable[..., Any]] = None


def _set_pg_timeout(timeout: timedelta, group: Any = None) -> None:
    """``torch.distributed.distributed_c10d._set_pg_timeout`` for ringlet
    groups (torch's own sets gloo's and NCCL's only and warns for any
    other): the operations issued from now on wait ``timeout`` for a peer."""
    pg = python_group(group)
    if pg is None:
        assert _original_set_pg_timeout is not None
        return _original_set_pg_timeout(timeout, group)
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"Expected timeout argument to be of type datetime.timedelta, got {timeout}"
        )
    torch_group = group if group is not None else dist.distributed_c10d._get_default_group()
    if pg._kind == "native":  # the C++ Backend's own limit too (it tells the Python group)
        torch_group._get_backend(torch.device("cpu"))._set_default_timeout(timeout)
    else:
        pg._set_default_timeout(timeout)
    return None


def _monitored_barrier(
    group: Any = None, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False
) -> Any:
    """``torch.distributed.monitored_barrier`` for ringlet groups (torch's own
    accepts only gloo groups); any other group goes to torch's."""
    pg = python_group(group)
    if pg is not None:
        # torch's own checks and defaults (which gloo's groups get)
        if timeout is None:
            timeout = dist.distributed_c10d.default_pg_timeout
        elif isinstance(timeout, float):
            import warnings

            warnings.warn(
                "Please specify timeout arg as a timedelta. "
                f"Converting current value of {timeout} assuming it represents seconds",
                stacklevel=2,
            )
            timeout = timedelta(seconds=timeout)
        if not isinstance(timeout, timedelta):
            raise TypeError(
                f"Expected timeout argument to be of type datetime.timedelta, got {timeout}"
            )
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
    assert _original_monitored_barrier is not None
    return _original_monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


_original_create_c10d_store: Optional[Callable[..., Any]] = None


def _for_ringlet() -> bool:
    """Whether the ``init_process_group`` call that is making a store asked
    for ringlet (its ``backend`` argument names it): only ringlet's start-up
    is bounded by :func:`_create_c10d_store`, other backends' are torch's."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "init_process_group" and "distributed_c10d" in code.co_filename:
            backend = frame.f_locals.get("backend")
            return isinstance(backend, str) and BACKEND_NAME in backend.lower()
        frame = frame.f_back
    return False


def _create_c10d_store(
    hostname: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: timedelta,
    use_libuv: bool = True,
) -> Any:
    """torch's ``rendezvous._create_c10d_store`` (the store of
    ``init_process_group``'s ``tcp://`` and ``env://`` methods), bounded by
    ``timeout`` when the backend asked for is ringlet: torch's client waits with no limit for
    the first answer of a port held by a program that accepts connections and
    never answers, and a rank that cannot listen on a taken port says what
    holds it (``runtime._open_store``). Same store, same error types
    (``DistNetworkError``) as torch's."""
    assert _original_create_c10d_store is not None
    make = functools.partial(
        _original_create_c10d_store, hostname, port, rank, world_size, timeout, use_libuv
    )
    if not _for_ringlet():  # another backend's start-up stays torch's own
        return make()
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    secs = timeout.total_seconds() if isinstance(timeout, timedelta) else 0.0
    if secs <= 0 or not 0 <= port < 2**16:  # torch's own answer (no limit, bad port)
        return make()
    return runtime._open_store(make, hostname, port, rank, rank == 0 and not agent, secs)


def register() -> None:
    """Registers the backend ``"ringlet"`` with ``torch.distributed`` for CPU
    tensors (done by ``import ringlet`` and by the package's entry point;
    calling it again does nothing). It also bounds the wait for the store of
    ``init_process_group("ringlet")``'s ``tcp://`` and ``env://`` methods by the
    group's timeout (``_create_c10d_store``; other backends' start-up is left
    as torch has it).

    Example:
      >>> import ringlet.c10d
      >>> ringlet.c10d.register()
      >>> dist.init_process_group("ringlet")      # or "cpu:ringlet"
    """
    global _original_monitored_barrier, _original_set_pg_timeout, _original_create_c10d_store
    if not dist.is_available():
        return
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
    if _original_monitored_barrier is None:
        _original_monitored_barrier = dist.monitored_barrier
        dist.monitored_barrier = _monitored_barrier
        dist.distributed_c10d.monitored_barrier = _monitored_barrier
    if _original_set_pg_timeout is None:
        _original_set_pg_timeout = dist.distributed_c10d._set_pg_timeout
        dist.distributed_c10d._set_pg_timeout = _set_pg_timeout
    if _original_create_c10d_store is None:
        rdzv = importlib.import_module("torch.distributed.rendezvous")
        _original_create_c10d_store = rdzv._create_c10d_store
        rdzv._create_c10d_store = _create_c10d_store


def _close_all() -> None:
    for pg in list(_live):
        try:
            pg.shutdown()
        except Exception:
            pass


import atexit  # noqa: E402

atexit.register(_close_all)


# -- which door a group takes (the Python group, or the native Backend around it) --


def python_group(group: Any = None) -> Any:
    """The :class:`ringlet.c10d.ProcessGroupRinglet` behind a torch group.

    Args:
      group (ProcessGroup, optional): A group made by ``init_process_group``
        / ``new_group`` / ``shrink_group``, a Python ringlet group, or None
        for the default group.

    Returns:
      The Python group (behind the native Backend, or the group itself), or
      None when ``group``'s CPU backend is not ringlet's.

    Example:
      >>> python_group(dist.group.WORLD)._comm.transport
      'shm'
    """
    if group is None:
        if not dist.is_initialized():
            return None
        group = dist.distributed_c10d._get_default_group()
    if isinstance(group, ProcessGroupRinglet):
        return group
    native = _native.backend_class()
    if native is None or not isinstance(group, dist.ProcessGroup):
        return None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except Exception:  # no CPU backend
        return None
    if isinstance(backend, native):
        return backend.python_group()
    return None


def backend_kind(group: Any = None) -> Optional[str]:
    """Which door a group's CPU collectives take.

    Args:
      group (ProcessGroup, optional): As :func:`python_group`.

    Returns:
      ``"native"`` (the C++ Backend), ``"python"`` (the Python
      ``ProcessGroup``), or None when the group is not ringlet's.

    Example:
      >>> dist.init_process_group("ringlet")
      >>> ringlet.c10d.backend_kind()
      'native'
    """
    pg = python_group(group)
    return None if pg is None else getattr(pg, "_kind", "python")


def native_error(err: int) -> BaseException:
    """The exception the Python group would raise for an engine error the
    C ABI returned to the C++ Backend (called by it; ``err`` is taken)."""
    return _DistErrors.convert(_core.native_error(err))


def backend_of(name: str) -> Any:
    """The native Backend of the c10d group named ``name`` ("" for the
    default group), for ``torch.ops.ringlet.all_reduce_`` (called by it).

    Raises:
      ValueError: No such group, or its CPU backend is not ringlet's native one.
    """
    where = f"group {name!r}" if name else "the default process group"
    try:
        if not name:
            pg = dist.distributed_c10d._get_default_group()
        else:
            pg = dist.distributed_c10d._resolve_process_group(name)
        backend = pg._get_backend(torch.device("cpu"))
    except Exception as e:
        raise ValueError(f"torch.ops.ringlet.all_reduce_: {where}: {e}") from None
    native = _native.backend_class()
    if native is None or not isinstance(backend, native):
        raise ValueError(
            f"torch.ops.ringlet.all_reduce_: the CPU backend of {where} is not ringlet's native "
            f"Backend ({backend_kind(pg) or type(backend).__name__}); use "
            "init_process_group('ringlet') with the native backend available"
        )
    return backend
