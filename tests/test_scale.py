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
    world_comm = ringlet.core.groups.world_comm()
    streams = [world_comm.open_streams()]  # none yet past 3 ranks over TCP
    ringlet.barrier()  # the doubling partners: rank xor 2^k
    streams.append(world_comm.open_streams())
    t = torch.full((5,), float(rank + 1))
    ringlet.all_reduce(ringlet.REDUCE_SUM, [t])
    ringlet.barrier()
    streams.append(world_comm.open_streams())
    # the rings (a large all_reduce, all_gather, reduce_scatter) and the
    # broadcast tree: values against plain torch, and the streams they add
    n = 20_000 * world  # 80 KiB a rank and up: the TCP ring
    base = torch.arange(n, dtype=torch.float32) % 1000  # sums stay exact in float32
    big = base * (rank + 1)
    ringlet.all_reduce(ringlet.REDUCE_SUM, [big])
    ring_ok = torch.equal(big, base * want_sum(world))
    gathered = ringlet.all_gather(torch.full((3,), float(rank)), dim=0)
    ring_ok &= torch.equal(gathered, torch.arange(world, dtype=torch.float32).repeat_interleave(3))
    scattered = ringlet.reduce_scatter(ringlet.REDUCE_SUM, torch.arange(4.0 * world), 1.0, 0,
                                       world)
    ring_ok &= torch.equal(scattered, torch.arange(4.0 * rank, 4.0 * rank + 4) * world)
    root = world - 1
    b = torch.full((300_000,), float(rank))  # 1.2 MB: several pieces down the tree
    ringlet.collective_broadcast([b], root_ordinal=root)
    ring_ok &= torch.equal(b, torch.full((300_000,), float(root)))
    streams.append(world_comm.open_streams())
    groups_ok, listening, sockets = True, 0, 0
    if world >= 4 and len(ringlet.host_layout()) == world:  # one rank a host
        # Two more groups (halves and evens/odds: each rank is in both),
        # created in turn, then first used at once from two threads: their
        # streams open concurrently through the process's one listener, and
        # each connection reaches its group whichever thread accepted it.
        import threading

        from ringlet.bench.scale import _sockets
        from ringlet.core import groups

        halves = [list(range(world // 2)), list(range(world // 2, world))]
        parity = [list(range(0, world, 2)), list(range(1, world, 2))]
        for g in (halves, parity):
            groups.group_comm(g)
        results: dict[str, Any] = {}

        def run(name: str, groups: list[list[int]]) -> None:
            try:
                x = torch.full((3,), float(rank + 1))
                for _ in range(3):
                    y = x.clone()
                    ringlet.all_reduce(ringlet.REDUCE_SUM, [y], groups=groups)
                mine = next(g for g in groups if rank in g)
                results[name] = torch.equal(y, torch.full((3,), float(sum(r + 1 for r in mine))))
            except Exception as e:  # reported, not lost in the thread
                results[name] = repr(e)

        threads = [threading.Thread(target=run, args=a) for a in
                   (("halves", halves), ("parity", parity))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        groups_ok = results == {"halves": True, "parity": True} or results
        sockets, listening = _sockets(), _listening()
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
            "sum": t.tolist(), "mismatch": mismatch, "peers": peers, "ring_ok": ring_ok,
            "groups_ok": groups_ok, "listening": listening, "sockets": sockets}


def _listening() -> int:
    """Listening TCP sockets this process holds (the store may listen on ::)."""
    from ringlet.bench.scale import _sockets

    return _sockets(listening=True)


def want_sum(world: int) -> float:
    return float(world * (world + 1) // 2)


def doubling_partners(p: int, me: int) -> set[int]:
    """The peers of ``me`` in a recursive-doubling all-reduce over ``p``
    ranks (the core's pairing): the first 2(p - q) ranks fold in pairs, q
    the largest power of two <= p; the q participants swap with index xor
    2^k."""
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    if me < 2 * extra and me % 2 == 0:
        return {me + 1}
    out = {me - 1} if me < 2 * extra else set()
    i = me // 2 if me < 2 * extra else me - extra
    k = 1
    while k < q:
        j = i ^ k
        out.add(2 * j + 1 if j < extra else j + extra)
        k <<= 1
    return out


@pytest.mark.parametrize("layout", ["2 hosts x 1", "4 hosts x 1", "2 hosts x 2", "6 hosts x 1",
                                    "16 hosts x 1"])
def test_connecting_costs_a_constant_number_of_store_operations_per_rank(layout: str) -> None:
    """Store operations per rank stay constant as the world grows; TCP
    streams open on demand: none at start-up, the doubling partners after a
    barrier, no more after rings and a broadcast at 16 hosts."""
    hosts, per = (int(w) for w in layout.split(" hosts x "))
    world = hosts * per
    env = [{"RINGLET_HOST_ID": f"logical-{r // per}"} for r in range(world)]
    out = launch(world, counted_init, free_port(), init=False, per_rank_env=env, timeout=240)
    want = want_sum(world)
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
        assert out[r]["ring_ok"], r
        # the world's mesh spans hosts: streams open as collectives need them;
        # past 3 ranks the agreement (a barrier) opens the doubling partners
        partners = (doubling_partners(world, r) if world > 3
                    else set(range(world)) - {r})
        first, after_barrier, after_all_reduce, after_rings = out[r]["streams"]
        assert after_barrier == len(partners), (r, out[r]["streams"])
        # a small all-reduce below 8 ranks exchanges with every peer; with the
        # listener and the store's connection, a rank holds at most
        # 2 ceil(log2 p) + 2 sockets
        assert after_all_reduce + 2 <= 2 * (world - 1).bit_length() + 2, out[r]["streams"]
        assert after_rings + 2 <= 2 * (world - 1).bit_length() + 2, out[r]["streams"]
        assert out[r]["groups_ok"] is True, (r, out[r]["groups_ok"])
        if world >= 4 and per == 1:
            # one listening socket for the world and both groups (rank 0 also
            # serves the store); the world's streams, the two groups'
            # doubling partners, the listener and the store's connection
            assert out[r]["listening"] == (2 if r == 0 else 1), (r, out[r])
            half = world // 2
            if world & (world - 1) == 0 and world >= 16 and r > 0:  # rank 0 serves the store
                assert out[r]["sockets"] == (
                    2 + (world.bit_length() - 1) + 2 * (half.bit_length() - 1)), \
                    (r, out[r]["sockets"])
        if world >= 8 and world & (world - 1) == 0 and per == 1:
            # a power of two: the small all-reduce, the Gray-ordered rings and
            # the broadcast tree all run over the log2 p doubling partners
            assert after_rings == world.bit_length() - 1, (r, out[r]["streams"])
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

    from ringlet.core.store import await_keys

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
    await_keys(store, ["a"], 5.0, block=True)  # set already: returns at once
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"not set within 0\.3s"):
        await_keys(store, ["a", "b"], 0.3, block=True)
    assert 0.25 < time.monotonic() - t0 < 5


def test_poll_floor_follows_the_launchers_local_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small group's waits poll every 1 ms at most where the launcher says
    this machine has a CPU per local rank, else every 10 ms."""
    from ringlet.core import store

    monkeypatch.setattr(store, "cores", lambda: 8)
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert store.poll_floor() == 1e-2  # no launcher says: maybe crowded
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.setenv(name, "8")
        assert store.poll_floor() == 1e-3
        monkeypatch.setenv(name, "9")
        assert store.poll_floor() == 1e-2
        monkeypatch.setenv(name, "many")  # not ours to reject: the safe default
        assert store.poll_floor() == 1e-2
        monkeypatch.delenv(name)
