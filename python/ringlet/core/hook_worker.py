"""The worker behind ringlet's torch DDP communication hooks
(:mod:`ringlet.parallel.comm_hooks`, :mod:`ringlet.distributed.hooks`).

DDP hands each gradient bucket to a hook as soon as backward has filled it
and wants a ``torch.futures.Future`` back at once. A hook's state queues the
bucket on its :class:`HookWorker`, a thread of its own that reduces the
buckets in the order they came and completes each future with the bucket
(or with the error that stopped it), so communication overlaps the rest of
backward and never interleaves with the training loop's collectives.
:class:`HookStates` keeps a hook's open states, to close them all at
shutdown.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

import torch

__all__ = ["HookStates", "HookWorker"]


class HookWorker:
    """A thread that reduces queued gradient buckets in order, each one
    completing the future :meth:`submit` returned for it.

    Args:
      name (str): The thread's name.
      reduce (Callable): Run on the thread as ``reduce(buffer, *args)``; it
        reduces ``buffer`` in place. What it raises goes to the bucket's
        future (DDP raises it in backward).

    Example:
      >>> worker = HookWorker("ringlet-comm-hook", lambda buf: comm_all_reduce(buf))
      >>> fut = worker.submit(bucket.buffer())
    """

    def __init__(self, name: str, reduce: Callable[..., None]) -> None:
        self._reduce = reduce
        self._queue: queue.SimpleQueue[
            Optional[tuple[torch.Tensor, tuple[Any, ...], torch.futures.Future]]
        ] = queue.SimpleQueue()
        self.closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, buffer: torch.Tensor, *args: Any) -> torch.futures.Future:
        """Queues ``reduce(buffer, *args)`` on the thread.

        Args:
          buffer (torch.Tensor): The bucket, reduced in place.
          *args: Passed on to ``reduce``.

        Returns:
          torch.futures.Future: Completes with ``buffer`` once ``reduce``
          returned, or with the error it raised.
        """
        fut: torch.futures.Future = torch.futures.Future()
        self._queue.put((buffer, args, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            buf, args, fut = item
            try:
                self._reduce(buf, *args)
                fut.set_result(buf)
            except BaseException as e:  # handed to DDP, which raises it in backward
                fut.set_exception(e)

    def close(self) -> bool:
        """Stops the thread once the queued buckets are done.

        Returns:
          bool: True if this call stopped it, False if it was closed already.
        """
        if self.closed:
            return False
        self.closed = True
        self._queue.put(None)
        self._thread.join()
        return True


class HookStates:
    """A hook's open states (anything with a ``close()``), closed together at
    shutdown.

    Example:
      >>> _states = HookStates()
      >>> _states.add(state)
      >>> _states.close_all()
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: list[Any] = []

    def add(self, state: Any) -> None:
        """Keeps ``state`` until :meth:`close_all`."""
        with self._lock:
            self._states.append(state)

    def close_all(self) -> None:
        """Closes every state added since the last call, in the order added."""
        with self._lock:
            states = list(self._states)
            self._states.clear()
        for s in states:
            s.close()
