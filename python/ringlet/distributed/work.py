"""The ``Work`` of ringlet's ``torch.distributed`` process group, the threads
that complete its futures, and errors raised as torch's process groups raise
them.

A :class:`Work` is the handle of one operation queued on a group's progress
thread (``ProcessGroupRinglet._submit``), as a Python job or as the engine
call itself (a native job: ``Work._native``, whose outcome the work reads from
the job once its ticket is done); a synchronous call that ran at once returns
the finished ``_DONE``. Futures (``Work.get_future()``) are completed
off the progress threads, by :class:`_Completions`, so that their callbacks
may issue and wait for later operations of the same group.

Example:
  >>> work = dist.all_reduce(t, async_op=True)
  >>> work.get_future().then(lambda f: f.value()[0] * 2).wait()
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work as _CWork

from .. import errors
from ..core import groups


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


def runtime_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else groups.get_ordinal()


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
        self._job: Any = None  # a native job (_core.NativeJob) not yet settled
        self._settling = threading.Lock()  # held while a native job's outcome is recorded
        self._rename: Optional[Callable[[BaseException], BaseException]] = None  # of its error

    @classmethod
    def _native(
        cls, queue: Any, job: Any, result: list[Any], timeout: float,
        rename: Optional[Callable[[BaseException], BaseException]] = None,
    ) -> Work:
        """The work of ``job``, an engine call queued on ``queue`` as it is
        (``core.engine.submit``): no Python runs when it ends; the
        work learns its outcome when asked (``wait``, ``is_completed``) or, once
        a future was asked for, from a completion thread that waits for it.
        ``rename`` rewrites the engine's error (naming the user's collective)."""
        work = cls(queue, result, timeout)
        work._job = job
        work._ticket = job.ticket
        work._rename = rename
        return work

    def _settle(self, ran: bool = False) -> bool:
        """For a native job: whether it has run (``ran``: the caller knows it
        has); if so its outcome is recorded, once, before this returns. True
        for other work."""
        with self._settling:
            job = self._job
            if job is None:
                return True
            if not ran:
                try:
                    ran = self._queue.is_done(self._ticket)
                except Exception:  # the queue closed: it ran its jobs first
                    ran = True
                if not ran:
                    return False
            try:
                exc = job.error()
            except Exception as e:  # never ran: its group was closed first
                exc = e
            if exc is not None and self._rename is not None:
                exc = self._rename(exc)
            self._finish(_DistErrors.convert(exc) if exc is not None else None)
            self._job = None
            return True

    def _watch(self) -> None:
        """On a completion thread: waits for the native job, then settles it
        (which completes the future asked for). Waits in short slices: at
        interpreter exit the thread must not sit in the engine's wait while
        Python finalizes (``_Completions.close``)."""
        while self._job is not None:
            try:
                if self._queue.wait(self._ticket, 0.5, False):
                    break
            except Exception:  # the queue closed: it ran its jobs first
                break
            if _COMPLETIONS.closing:
                return
        self._settle(ran=True)

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
        if self._job is not None:  # a native job: the thread runs it (never this waiter)
            return self._queue.wait(self._ticket, secs, False) and self._settle(ran=True) and (
                waiting.wait(secs))
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
            finished = self._done or (
                self._queue.wait(self._ticket, limit) and self._settle(ran=True) and (
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
        if self._job is not None:
            self._settle()
        return self._done

    def is_success(self) -> bool:
        """Whether the operation finished without an error."""
        return self.is_completed() and self._exc is None

    def exception(self) -> Optional[BaseException]:
        """The error the operation failed with, or None."""
        if self._job is not None:
            self._settle()
        return self._exc

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` completed with the operation's output
        tensors (a list), or with its error.

        Returns:
          The future (the same object on every call).
        """
        watch = False
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
                else:
                    watch = self._job is not None
        if watch:  # nothing runs when a native job ends: a thread waits for it
            _COMPLETIONS.submit(self._watch)
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
        self._threads: list[threading.Thread] = []
        self._closing = False

    def submit(self, task: Callable[[], None]) -> None:
        with self._cv:
            self._tasks.append(task)
            if self._free:
                self._free -= 1
                self._cv.notify()
                return
            thread = threading.Thread(target=self._serve, name="ringlet-completions",
                                      daemon=True)
            self._threads.append(thread)
        thread.start()

    @property
    def closing(self) -> bool:
        """Whether the interpreter is exiting (``close`` was called)."""
        return self._closing

    def close(self, timeout: float = 5.0) -> None:
        """At interpreter exit: lets the threads finish the completions queued
        and stop. A daemon thread still completing a future while the
        interpreter finalizes is killed as it re-takes the GIL inside torch's
        C++ future code, which aborts the process ("terminate called without
        an active exception")."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._tasks:
                    if self._closing:
                        return
                    self._free += 1
                    self._cv.wait()
                task = self._tasks.popleft()
            try:
                task()
            except BaseException as e:  # a future's own errors stay in the future
                print(f"ringlet: completing a future failed: {e!r}", file=sys.stderr)


_COMPLETIONS = _Completions()
atexit.register(_COMPLETIONS.close)

# A finished Work returned by synchronous calls.
_DONE = Work(None, [], 0.0)
_DONE._finish(None)
