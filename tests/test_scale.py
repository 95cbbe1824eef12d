"""Costs that grow with the rank count: the store operations a rank makes to
connect a group (a counting store wrapped around torch's TCPStore) stay a
small constant, whatever the world size, over logical hosts
(``RINGLET_HOST_ID``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from conftest import free_port, launch


def counted_init(rank: int, world: int, port: int) -> dict[str, Any]:
    from torch.distributed import TCPStore

    import ringlet
    from ringlet.bench.scale import CountingStore, store_ops

    real = TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60),
                    wait_for_workers=False)
    store = CountingStore(real)
    ringlet.init(rank=rank, world_size=world, store=store)
    at_init = dict(store.counts)
    peers = ringlet.peer_transports()
    world_comm = ringlet.runtime._world()
    streams = [world_comm.open_streams()]  # none yet past 3 ranks over TCP
    ringlet.barrier()  # the dissemination partners: rank +- 2^k
    streams.append(world_comm.open_streams())
    t = torch.full((5,), float(rank + 1))
    ringlet.all_reduce(ringlet.REDUCE_SUM, [t])
    ringlet.barrier()
    streams.append(world_comm.open_streams())
    mismatch = ""
    if world >= 4:
        # Past 3 ranks the agreement is a digest all-reduce in log2 p rounds;
        # a rank that calls another collective is still named on every rank.
        with pytest.raises(ringlet.CollectiveMismatchError) as info:
            if rank == 2:
                ringlet.all_gather(torch.ones(3))
            else:
                ringlet.all_reduce(ringlet.REDUCE_SUM, [torch.ones(3)])
        mismatch = str(info.value)
        u = torch.ones(2)
        ringlet.all_reduce(ringlet.REDUCE_SUM, [u])  # the communicator still works
        assert u.tolist() == [float(world)] * 2
    ringlet.shutdown()
    return {"ops": store_ops(at_init), "counts": at_init, "streams": streams,
            "sum": t.tolist(), "mismatch": mismatch, "peers": peers}


@pytest.mark.parametrize("layout", ["2 hosts x 1", "4 hosts x 1", "2 hosts x 2", "6 hosts x 1",
                                    "16 hosts x 1"])
def test_connecting_costs_a_constant_number_of_store_operations_per_rank(layout: str) -> None:
    """Store operations per rank stay constant as the world grows; TCP
    streams open on demand: none at start-up, the dissemination partners
    after a barrier."""
    hosts, per = (int(w) for w in layout.split(" hosts x "))
    world = hosts * per
    env = [{"RINGLET_HOST_ID": f"logical-{r // per}"} for r in range(world)]
    out = launch(world, counted_init, free_port(), init=False, per_rank_env=env, timeout=240)
    want = float(world * (world + 1) // 2)
    for r in range(world):
        assert out[r]["sum"] == [want] * 5, out[r]
        # the job's arrival (1), then the world's table: rank 0 sets its own
        # record, waits for the others' (one blocking wait: the world connects
        # at start-up), reads all in one multi_get, publishes (4); the others
        # set, wait and get (3). Two levels add a host group of the same kind.
        limit = 1 + 4 + (4 if per > 1 else 0)
        assert out[r]["counts"].get("wait", 0) == (2 if per > 1 else 1), out[r]["counts"]
        assert "check" not in out[r]["counts"], out[r]["counts"]  # nothing polled
        assert out[r]["ops"] <= limit, (r, out[r]["counts"])
        assert out[r]["counts"].get("get", 0) <= (2 if per > 1 else 1), out[r]["counts"]
        if per == 1:
            assert out[r]["peers"] == {q: "tcp" for q in range(world) if q != r}, out[r]
        # the world's mesh spans hosts: streams open as collectives need them
        partners = {(r + s * (1 << k)) % world for k in range((world - 1).bit_length())
                    for s in (1, -1)}
        first, after_barrier, after_all_reduce = out[r]["streams"]
        assert after_barrier == len(partners), (r, out[r]["streams"])
        # an all-reduce may add its own partners (the odd ranks' fold past a
        # power of two); with the listener and the store's connection, a rank
        # holds at most 2 ceil(log2 p) + 2 sockets
        assert after_all_reduce + 2 <= 2 * (world - 1).bit_length() + 2, out[r]["streams"]
        # two levels agree on the layout over the world's mesh at start-up; up
        # to 3 ranks the mesh is full from the start
        lazy = world > 3 and per == 1
        assert first == (0 if lazy else len(partners)), (r, out[r]["streams"])
        if world >= 4:
            assert "rank 0 called all_reduce" in out[r]["mismatch"], out[r]["mismatch"]
            assert "rank 2 called all_gather" in out[r]["mismatch"], out[r]["mismatch"]


def test_a_store_without_a_blocking_wait_is_polled() -> None:
    """Start-up's blocking wait falls back to polling on a store that has no
    wait of its own (a Python ``Store`` with set, get and check), and still
    times out."""
    import time

    import torch.distributed as dist

    from ringlet import runtime

    class Plain(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self.data: dict[str, bytes] = {}

        def set(self, key: str, value: Any) -> None:
            self.data[key] = value

        def get(self, key: str) -> bytes:
            return self.data[key]

        def check(self, keys: list[str]) -> bool:
            return all(k in self.data for k in keys)

    store = Plain()
    store.set("a", b"1")
    runtime._await(store, ["a"], 5.0, block=True)  # set already: returns at once
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not set within 0\.3s"):
        runtime._await(store, ["a", "b"], 0.3, block=True)
    assert 0.25 < time.monotonic() - t0 < 5


def test_poll_floor_follows_the_launchers_local_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small group's waits poll every 1 ms at most where the launcher says
    this machine has a CPU per local rank, else every 10 ms."""
    from ringlet import runtime

    monkeypatch.setattr(runtime, "_cores", lambda: 8)
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert runtime._poll_floor() == 1e-2  # no launcher says: maybe crowded
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.setenv(name, "8")
        assert runtime._poll_floor() == 1e-3
        monkeypatch.setenv(name, "9")
        assert runtime._poll_floor() == 1e-2
        monkeypatch.setenv(name, "many")  # not ours to reject: the safe default
        assert runtime._poll_floor() == 1e-2
        monkeypatch.delenv(name)
