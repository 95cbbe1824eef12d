"""ringlet's ``torch.distributed`` process group, :class:`ProcessGroupRinglet`:
its identity, connections (the group's communicator, connected through the
store on first use, and a two-rank communicator per direction for messages),
the queue its operations run on, argument checks shared by its methods, the
monitored barrier, lifetime (shutdown, abort, timeouts) and what the native
C++ Backend asks of it. Its collectives are in ``_pg_collectives`` and its
point-to-point messages in ``_pg_p2p`` (mixins it inherits).

:func:`python_group` and :func:`backend_kind` say which group, and which door,
a torch group's CPU collectives take.

Example:
  >>> from ringlet.distributed.process_group import ProcessGroupRinglet
  >>> pg = ProcessGroupRinglet(store, rank, 2, timedelta(seconds=60))
  >>> pg.allreduce([t]).wait()
  True
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

from .. import _core, errors
from ..core import connection, engine, local_address
from ..core.engine import check
from . import _native
from ._pg_args import _write_back
from ._pg_collectives import _Collectives
from ._pg_p2p import _PointToPoint
from .work import _DONE, Work, _DistErrors, _torch_errors

BACKEND_NAME = "ringlet"


def _run_now(queue: Any, fn: Callable[[], Any]) -> bool:
    """Runs ``fn`` on this thread at once when ``queue`` is idle, in queue
    order; False, having done nothing, when earlier operations are still
    queued. Its errors are raised as torch's process groups raise them."""
    try:
        return bool(queue.run_now(fn))
    except BaseException as e:
        raise _DistErrors.convert(e) from None


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


class ProcessGroupRinglet(_Collectives, _PointToPoint, ProcessGroup):
    """A ``torch.distributed`` process group whose collectives run on
    ringlet's engine.

    ``init_process_group("ringlet")`` and ``new_group(..., backend="ringlet")``
    make these; it can also be built by hand, as torch's
    ``ProcessGroupGloo(store, rank, size, timeout)``, by code that manages its
    own groups (torchft's Manager, see :mod:`ringlet.distributed.torchft`; a group per
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
      >>> from ringlet.distributed.c10d import ProcessGroupRinglet
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
        self._domain = connection.new_domain()
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
        self._kind = "python"  # "native" behind the C++ Backend (see ringlet.distributed._native)
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
        return local_address(self._store)

    def _world(self, block: bool = False) -> Any:
        """The group's communicator, connected on first use (on the progress
        thread, through the group's store, by its members only), or at once
        for the job's default group (``_create``), whose waits on the store
        then ``block`` (see ``core.store.await_keys``)."""
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
                        comm, hosts = connection.connect(
                            self._store, self._key, self._rank, self._size, addr,
                            self._timeout, members=self._members, name=self._title(),
                            domain=self._domain, block=block,
                        )
                        # A group spanning hosts: collectives run in two levels
                        # inside the engine (shared memory within hosts, TCP across).
                        hier = connection.connect_host_level(
                            self._store, self._key, self._rank, hosts, addr, self._timeout,
                            self._domain, members=self._members, block=block,
                        )
                        if hier is not None:
                            comm.attach_levels(hier, connection.ranks_by_host(hosts))
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
                    slot[0], _ = connection.connect(
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

    def _submit_engine(
        self, comm: Any, call: str, tensors: list[torch.Tensor], dtype: str, arg: Any,
        result: Union[list[Any], Callable[[], list[Any]]], wake: bool,
        before: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
        after: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), divide: int = 0,
        rename: Optional[Callable[[BaseException], BaseException]] = None,
    ) -> Work:
        """Queues one engine call as it is (``engine.submit``: no Python job
        runs for it on the queue), with the byte copies ``before`` and
        ``after`` it and the division ``divide`` (ReduceOp.AVG) that the job
        runs itself; the work's result (and its future's value) is ``result``
        (or what calling it gives: made only when a work is). ``rename``
        rewrites the engine's error (naming the user's collective). A
        synchronous call (``wake`` False) on an idle queue runs at once on
        this thread and returns the finished ``_DONE``."""
        keep = (tensors, before, after) if before or after else tensors
        try:
            job = engine.submit(self._queue, comm, call, tensors, dtype, arg, keep, wake,
                                before, after, divide)
        except errors.RingletError as e:
            if rename is None:
                raise
            raise rename(e) from None
        if job is None:
            return _DONE
        if callable(result):
            result = result()
        work = Work._native(self._queue, job, result, self._timeout, rename)
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

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
        check(t if t.is_contiguous() else t[:0], what)
        return t

    def _root(self, root: int, what: str) -> int:
        if not 0 <= root < self._size:
            raise ValueError(
                f"{self._where()}: {what}: invalid root rank: {root} (a group of {self._size} "
                "ranks)"
            )
        return root

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

    # -- monitored barrier ---------------------------------------------------

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

    # -- the native Backend (ringlet.distributed._native) ----------------------------------

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


# -- which door a group takes (the Python group, or the native Backend around it) --


def python_group(group: Any = None) -> Any:
    """The :class:`ringlet.distributed.c10d.ProcessGroupRinglet` behind a torch group.

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
      >>> ringlet.distributed.c10d.backend_kind()
      'native'
    """
    pg = python_group(group)
    return None if pg is None else getattr(pg, "_kind", "python")
