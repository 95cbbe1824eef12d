"""Bad input, disagreeing ranks, dead and missing peers: each gives a clear
Python exception on every rank, within the timeout, and leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

import ringlet

from conftest import TRANSPORTS, launch


def bad_inputs(rank: int, world: int) -> None:
    x = torch.arange(12.0).reshape(3, 4)
    with pytest.raises(ValueError, match=r"rank \d: input is not contiguous"):
        ringlet.all_reduce("sum", x.t())
    with pytest.raises(ValueError, match="on device 'meta'"):
        ringlet.all_reduce("sum", torch.empty(3, device="meta"))
    with pytest.raises(TypeError, match=r"unsupported dtype torch\.complex64"):
        ringlet.all_reduce("sum", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="'and' is not defined for float32"):
        ringlet.all_reduce("and", torch.zeros(2))
    with pytest.raises(ValueError, match="unknown reduce type 'avg'"):
        ringlet.all_reduce("avg", torch.zeros(2))
    with pytest.raises(TypeError, match="must be a tensor or a list"):
        ringlet.all_reduce("sum", 3.0)
    with pytest.raises(ValueError, match="output has shape"):  # a numpy array cannot grow
        ringlet.all_gather(torch.zeros(2), output=np.zeros(3, dtype=np.float32))
    out = torch.full((3,), 7.0)  # a torch tensor is overwritten outright, as in torch_xla
    assert ringlet.all_gather(torch.zeros(2), output=out) is out
    assert out.shape == (2 * world,) and not out.any()
    with pytest.raises(ValueError, match=r"output has shape .* and dtype torch\.int32"):
        ringlet.all_gather(torch.zeros(2), output=torch.zeros(2 * world, dtype=torch.int32))
    with pytest.raises(ValueError, match="shard_count=7 must equal"):
        ringlet.reduce_scatter("sum", torch.zeros(14), 1.0, 0, 7)
    with pytest.raises(ValueError, match="not divisible by shard_count"):
        ringlet.reduce_scatter("sum", torch.zeros(world * 2 + 1), 1.0, 0, world)
    with pytest.raises(ValueError, match="dimension 2 is out of range"):
        ringlet.all_gather(torch.zeros(2), dim=2)
    with pytest.raises(ValueError, match="root_ordinal 9 is out of range"):
        ringlet.collective_broadcast([torch.zeros(1)], root_ordinal=9)
    with pytest.raises(TypeError, match="payload"):
        ringlet.rendezvous("t", "not bytes")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="pin_layout=True is not yet supported"):
        ringlet.all_gather([torch.zeros(1)])
    with pytest.raises(TypeError, match="`value` needs to be a Tensor"):
        ringlet.all_gather("x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="appears in replica groups 0 and 1"):
        ringlet.all_reduce("sum", torch.zeros(1), groups=[[0, 1], [1]])
    with pytest.raises(ValueError, match="in no replica group"):
        ringlet.all_reduce("sum", torch.zeros(1), groups=[[0]])
    with pytest.raises(ValueError, match="out of range for world size"):
        ringlet.all_reduce("sum", torch.zeros(1), groups=[[0, 1, 5]])
    with pytest.raises(ValueError, match="same number of replicas"):
        ringlet.all_gather(torch.zeros(1), groups=[[0], [1, 2]], pin_layout=False)
    frozen = np.frombuffer(np.ones(4, dtype=np.float32).tobytes(), dtype=np.float32)
    with pytest.raises(ValueError, match=r"rank \d: inputs\[0\] is a read-only numpy array"):
        ringlet.all_reduce("sum", [frozen])
    with pytest.raises(ValueError, match="output is a read-only numpy array"):
        ringlet.all_gather(np.ones(1, dtype=np.float32), output=frozen[:world])
    # Nothing was communicated by the failed calls: the next collective works.
    assert ringlet.all_reduce("sum", torch.ones(1)).item() == world
    # a read-only array is fine where ringlet only reads it
    assert ringlet.all_reduce("sum", frozen).tolist() == [float(world)] * 4


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bad_inputs_raise_before_communicating(transport: str) -> None:
    launch(3, bad_inputs, transport=transport)


def mismatch(rank: int, world: int) -> str:
    n = 5 if rank == 1 else 4
    with pytest.raises(ringlet.CollectiveMismatchError) as info:
        ringlet.all_reduce("sum", torch.ones(n))
    msg = str(info.value)
    assert f"rank {rank}:" in msg and "rank 1 called all_reduce" in msg and "count=5" in msg
    dt = torch.int32 if rank == 2 else torch.float32
    with pytest.raises(ringlet.CollectiveMismatchError, match="dtype=int32"):
        ringlet.all_reduce("sum", torch.ones(4, dtype=dt))
    op = "max" if rank == 0 else "sum"
    with pytest.raises(ringlet.CollectiveMismatchError, match="op=max"):
        ringlet.all_reduce(op, torch.ones(4))
    with pytest.raises(ringlet.CollectiveMismatchError, match="rank 2 called barrier"):
        if rank == 2:
            ringlet.barrier()
        else:
            ringlet.all_gather(torch.ones(2))
    # Detected before any data moved: the communicator is still good.
    assert ringlet.all_reduce("sum", torch.ones(2)).tolist() == [3.0, 3.0]
    return msg


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_disagreeing_ranks_all_raise(transport: str) -> None:
    out = launch(3, mismatch, transport=transport)
    assert all("rank 1 called all_reduce" in m for m in out.values())


def shm_entries() -> set[str]:
    """/dev/shm entries other than Python multiprocessing's semaphores (which
    any concurrently running test may create): ringlet must add none."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {e for e in os.listdir("/dev/shm") if not e.startswith("sem.mp-")}


def killed_mid_collective(rank: int, world: int) -> str:
    if rank == 1:
        # Die by SIGKILL while the collective is running.
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while True:
            ringlet.all_reduce("sum", torch.ones(1 << 22))
    start = time.monotonic()
    with pytest.raises(ringlet.PeerLostError) as info:
        while True:
            ringlet.all_reduce("sum", torch.ones(1 << 22))
    assert time.monotonic() - start < 20
    # The communicator is now unusable, with a clear error, and shuts down cleanly.
    with pytest.raises(ringlet.CommunicatorAbortedError):
        ringlet.barrier()
    ringlet.shutdown()
    return str(info.value)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_peer_killed_mid_collective(transport: str) -> None:
    before = shm_entries()
    out = launch(3, killed_mid_collective, transport=transport, expect_dead=(1,), comm_timeout=30)
    assert set(out) == {0, 2}
    for rank, msg in out.items():
        assert f"rank {rank}:" in msg and "lost rank" in msg, msg
    assert "lost rank 1" in out[0] or "lost rank 1" in out[2]
    assert shm_entries() <= before, "shared memory left behind in /dev/shm"


def missing_rank(rank: int, world: int, gate: object) -> str:
    if rank == 2:
        gate.wait()  # type: ignore[attr-defined]  # stay alive, never join the collective
        return ""
    start = time.monotonic()
    with pytest.raises(ringlet.CollectiveTimeoutError) as info:
        ringlet.barrier()
    waited = time.monotonic() - start
    assert 1.5 <= waited < 10, waited
    gate.wait()  # type: ignore[attr-defined]
    return str(info.value)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_missing_rank_times_out_naming_it(transport: str) -> None:
    import torch.multiprocessing as mp

    gate = mp.get_context("spawn").Barrier(3)
    out = launch(3, missing_rank, gate, transport=transport, comm_timeout=2.0)
    for rank in (0, 1):
        assert "waiting for rank 2" in out[rank] and f"rank {rank}:" in out[rank], out[rank]
        assert re.search(r" Timed out (after [0-9.]+ s )?waiting for rank 2: ", out[rank]), (
            out[rank])  # torch's word for it, then the culprit


def test_collective_before_init_raises() -> None:
    ringlet.shutdown()
    with pytest.raises(ringlet.NotInitializedError, match=r"call ringlet.init\(\) first"):
        ringlet.barrier()
    with pytest.raises(ringlet.NotInitializedError):
        ringlet.transport()


def unanswered_send(rank: int, world: int, gate: object) -> str:
    msg = ""
    if rank == 0:
        # Rank 1 never posts a receive: the send times out naming it.
        want = "rank 0: Timed out waiting for rank 1: rank 1 did not join"
        with pytest.raises(ringlet.CollectiveTimeoutError, match=want) as e:
            ringlet.send(torch.ones(3), 1)
        msg = str(e.value)
    gate.wait()  # type: ignore[attr-defined]  # rank 1 stays alive meanwhile
    ringlet.barrier()  # the world communicator still works
    return msg


def test_send_without_receiver_times_out_naming_the_peer() -> None:
    import torch.multiprocessing as mp

    gate = mp.get_context("spawn").Barrier(2)
    out = launch(2, unanswered_send, gate, comm_timeout=3.0)
    assert "did not join within 3s" in out[0]
    assert re.search(r" (Timed out|closed|timeout) ", out[0]), out[0]  # as torch's tests match


def different_groups(rank: int, world: int, gate: Any) -> str:
    groups = [[0], [1]] if rank == 0 else [[0, 1]]
    if rank == 0:
        ringlet.all_reduce("sum", torch.ones(2), groups=groups)  # a group of one: at once
        gate.wait()  # stays alive until rank 1 has given up
        return "alone"
    with pytest.raises(ringlet.CollectiveTimeoutError) as e:
        ringlet.all_reduce("sum", torch.ones(2), groups=groups)
    gate.wait()
    return str(e.value)


def test_replica_groups_that_differ_across_ranks_wait_for_the_timeout() -> None:
    """docs/limits.md: ranks passing different ``groups`` are not told apart;
    the rank waiting for a peer that never joins times out, naming it."""
    import torch.multiprocessing as mp

    gate = mp.get_context("spawn").Barrier(2)
    out = launch(2, different_groups, gate, comm_timeout=2.0)
    assert out[0] == "alone" and "rank 0" in out[1], out
