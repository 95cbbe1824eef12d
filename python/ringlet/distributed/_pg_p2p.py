"""Point-to-point messages of ringlet's ``torch.distributed`` process group:
``send``, ``recv`` and ``recv_anysource``, as a mixin that
:class:`ringlet.distributed.process_group.ProcessGroupRinglet` inherits (it
gives them ``_channel``, ``_pair``, ``_submit``, ``_tensor``, ``_dense`` and the
group's state).

Messages run on a queue per direction and peer, over a two-rank communicator
per direction, so sends and receives in any order between any ranks never
deadlock; a message whose tag no receive names yet is received aside and kept.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .. import _core, errors
from ..core import engine
from ..core.engine import DTYPE_NAMES, check
from ._pg_args import _as_list
from .work import Work, _DistErrors, _torch_errors

# Sends up to this size are copied and complete at once (as gloo's sends
# complete once the bytes are in the socket buffer), so two ranks that both
# send before they receive do not wait for each other.
_EAGER_SEND_BYTES = 1 << 20

_DTYPE_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class _PointToPoint:
    """The point-to-point methods of :class:`ProcessGroupRinglet` (a mixin:
    the group supplies its state and the methods ``_channel``, ``_pair``,
    ``_submit``, ``_tensor``, ``_dense`` and ``_where``)."""

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
                engine.send(self._pair(self._rank, dst, slot), data, 1, tag,
                            check(data, "send tensor"))
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
            name = check(dense[0], "recv tensor")
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
            engine.recv(pair, flat, 0, tag, name)
            back()

        return run

    @staticmethod
    def _receive_aside(pair: Any, slot: list[Any], tag: int, count: int, dtype: str) -> None:
        """Receives the waiting message (``tag``, ``count`` x ``dtype``) into a
        buffer of its own, kept for the receive that names its tag."""
        aside = torch.empty(count, dtype=_DTYPE_BY_NAME[dtype])
        engine.recv(pair, aside, 0, tag, dtype)
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
