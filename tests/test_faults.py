"""Faults an operator can trust: the culprit named on every surviving rank,
hung ranks, ringlet.abort(), no silent world of one, recovery in-process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import ringlet
from test_errors import shm_entries

from conftest import TRANSPORTS, launch

# -- 1. never a silent world of one -------------------------------------------


def _entry_points() -> dict[str, object]:
    x = torch.ones(4)
    return {
        "all_reduce": lambda: ringlet.all_reduce(ringlet.REDUCE_SUM, x),
        "all_reduce list": lambda: ringlet.all_reduce(ringlet.REDUCE_SUM, [x]),
        "all_gather": lambda: ringlet.all_gather(x),
        "reduce_scatter": lambda: ringlet.reduce_scatter(ringlet.REDUCE_SUM, x, 1.0, 0, 1),
        "all_to_all": lambda: ringlet.all_to_all(x, 0, 0, 1),
        "collective_broadcast": lambda: ringlet.collective_broadcast([x]),
        "barrier": lambda: ringlet.barrier(),
        "rendezvous": lambda: ringlet.rendezvous("tag"),
        "mesh_reduce": lambda: ringlet.mesh_reduce("tag", 1.0, sum),
        "send": lambda: ringlet.send(x, 0),
        "recv": lambda: ringlet.recv(x, 0),
        "collective_permute": lambda: ringlet.collective_permute(x, [(0, 0)]),
        "reduce_gradients": lambda: ringlet.reduce_gradients(_opt()),
        "optimizer_step": lambda: ringlet.optimizer_step(_opt()),
        "broadcast_master_param": lambda: ringlet.broadcast_master_param(torch.nn.Linear(2, 2)),
        "all_to_all_v": lambda: ringlet.all_to_all_v([x, x], [x.clone(), x.clone()]),
        "all_gather_bucketized": lambda: ringlet.all_gather_bucketized([x]),
        "reduce_scatter_bucketized": lambda: ringlet.reduce_scatter_bucketized(
            ringlet.REDUCE_SUM, [x], 1.0, 0, 2),
        "comm hook state": lambda: ringlet.parallel.comm_hooks.AllReduceState(),
        "ops.all_reduce": lambda: torch.ops.ringlet.all_reduce(x),
        "ops.all_gather": lambda: torch.ops.ringlet.all_gather(x, 0),
        "ops.reduce_scatter": lambda: torch.ops.ringlet.reduce_scatter(x),
        "ops.broadcast": lambda: torch.ops.ringlet.broadcast(x, 0),
        "ops.all_to_all": lambda: torch.ops.ringlet.all_to_all(x, 0, 0),
        "tensor API set_all_reduce": (
            lambda: ringlet.parallel.tensor.get_module("w1").set_all_reduce()),
        "DistributedDataParallel": lambda: ringlet.DistributedDataParallel(torch.nn.Linear(2, 2)),
        "world_size": ringlet.world_size,
        "get_ordinal": ringlet.get_ordinal,
        "xrt_world_size": ringlet.xrt_world_size,
    }


def _opt() -> torch.optim.Optimizer:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    return torch.optim.SGD([p], lr=0.1)


def test_launcher_world_without_init_raises_at_every_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ringlet.shutdown()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    for name, call in _entry_points().items():
        with pytest.raises(ringlet.NotInitializedError, match=r"WORLD_SIZE=2") as e:
            call()  # type: ignore[operator]
        assert "call ringlet.init() first" in str(e.value) and "rank 1" in str(e.value), name


@pytest.mark.parametrize("world", [None, "1"])
def test_world_of_one_without_a_launcher_still_computes(
    monkeypatch: pytest.MonkeyPatch, world: str | None
) -> None:
    ringlet.shutdown()
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    x = torch.arange(4.0)
    assert ringlet.world_size() == 1 and ringlet.get_ordinal() == 0
    assert torch.equal(ringlet.all_reduce(ringlet.REDUCE_SUM, x), x)
    assert torch.equal(torch.ops.ringlet.all_reduce(x), x)
    # entry points that need a communicator say so (as before)
    with pytest.raises(ringlet.NotInitializedError, match=r"call ringlet.init\(\) first"):
        ringlet.barrier()


def _torchrun_without_init(rank: int, world: int) -> str:
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    with pytest.raises(ringlet.NotInitializedError) as e:
        ringlet.all_reduce(ringlet.REDUCE_SUM, torch.ones(2))
    return str(e.value)


def test_launched_ranks_without_init_raise_not_compute_alone() -> None:
    out = launch(2, _torchrun_without_init, init=False, timeout=60)
    for r in (0, 1):
        assert f"rank {r}:" in out[r] and "WORLD_SIZE=2" in out[r], out[r]


# -- 2. the culprit, named; 5. recovery in the same process -------------------

VICTIM = 2


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _workload(scenario: str, rank: int, world: int) -> object:
    """One step of the scenario's collectives (every rank calls it alike)."""
    if scenario == "world":
        return lambda: ringlet.all_reduce(ringlet.REDUCE_SUM, [torch.ones(1 << 20)])
    if scenario == "two-level":  # two simulated hosts: shm within, TCP across
        assert ringlet.core.groups.require_state().hier is not None
        return lambda: ringlet.all_reduce(ringlet.REDUCE_SUM, [torch.ones(1 << 18)])
    if scenario == "small":
        return lambda: ringlet.all_reduce(ringlet.REDUCE_SUM, [torch.ones(7)])
    if scenario == "groups":
        groups = [[0, 2], [1, 3]]
        peer = rank ^ 1

        def step() -> None:
            ringlet.all_reduce(ringlet.REDUCE_SUM, [torch.ones(1 << 16)], groups=groups)
            t = torch.ones(1000)
            if rank % 2 == 0:
                ringlet.send(t, peer)
                ringlet.recv(t, peer)
            else:
                ringlet.recv(t, peer)
                ringlet.send(t, peer)
            ringlet.all_gather(torch.ones(3))

        return step
    if scenario == "bucket":
        ts = [torch.ones(1 << 16).ensure_ringlet_tensor(f"b{i}", "faults") for i in range(3)]
        m = ringlet.parallel.tensor.get_module("faults")
        m.set_buckets([[t] for t in ts])
        m.set_all_reduce(average=False)

        def bucket_step() -> None:
            for t in ts:
                t.ringlet_mark_communication_ready()
            m.wait_pending_comm_ops()

        return bucket_step
    raise AssertionError(scenario)


def _die_and_recover(
    rank: int, world: int, scenario: str, port: int, victim: int = VICTIM
) -> dict[str, object]:
    step = _workload(scenario, rank, world)
    step()  # type: ignore[operator]  # everyone is up
    threads, fds = threading.active_count(), _fds()
    if rank == victim:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        while True:
            step()  # type: ignore[operator]
    start = time.monotonic()
    with pytest.raises(ringlet.RingletError) as info:
        while time.monotonic() - start < 60:
            step()  # type: ignore[operator]
    e = info.value
    out: dict[str, object] = {
        "type": type(e).__name__, "msg": str(e), "culprit": e.culprit, "cause": e.cause,
        "op": e.op, "group": e.group, "rank": e.rank, "after": time.monotonic() - start,
    }
    with pytest.raises(ringlet.CommunicatorAbortedError) as again:
        ringlet.barrier()
    out["again_culprit"] = again.value.culprit
    # 5. Recovery: the survivors form a new world in the same process; in the
    # "world" scenario a replacement process joins them as the new last rank.
    ringlet.shutdown()
    survivors = [r for r in range(world) if r != victim]
    me = survivors.index(rank)
    size = len(survivors) + (scenario == "world")
    replacement = None
    if scenario == "world" and me == 0:
        replacement = subprocess.Popen([
            sys.executable, "-c",
            "import ringlet, torch;"
            f"ringlet.init(rank={size - 1}, world_size={size}, master_addr='127.0.0.1',"
            f" master_port={port}, timeout=30);"
            f"x = ringlet.all_reduce('sum', torch.arange(10.0) * {size});"
            f"assert torch.equal(x, torch.arange(10.0) * {sum(range(1, size + 1))});"
            "g = ringlet.all_gather(torch.tensor([-1.0]));"
            "ringlet.shutdown()",
        ])
    ringlet.init(rank=me, world_size=size, master_addr="127.0.0.1",
                 master_port=port, timeout=30)
    x = torch.arange(10.0) * (me + 1)
    got = ringlet.all_reduce(ringlet.REDUCE_SUM, x)
    assert torch.equal(got, torch.arange(10.0) * sum(range(1, size + 1)))
    want = [float(r) for r in survivors] + [-1.0] * (size - len(survivors))
    assert torch.equal(ringlet.all_gather(torch.tensor([float(rank)])), torch.tensor(want))
    ringlet.shutdown()
    if replacement is not None:
        assert replacement.wait(timeout=60) == 0
    if scenario == "bucket":
        ringlet.parallel.tensor.close_modules()
    out["leaked_fds"] = _fds() - fds
    out["leaked_threads"] = threading.active_count() - threads
    return out


@pytest.mark.parametrize(
    "transport,scenario",
    [(t, s) for t in TRANSPORTS for s in ("world", "small", "groups", "bucket")]
    + [("shm", "two-level")],
)
def test_killed_rank_is_named_on_every_survivor_then_recovery(
    transport: str, scenario: str
) -> None:
    from conftest import free_port

    before = shm_entries()
    hosts = None
    if scenario == "two-level":
        hosts = [{"RINGLET_HOST_ID": f"host{r // 2}"} for r in range(4)]
    out = launch(4, _die_and_recover, scenario, free_port(), transport=transport,
                 expect_dead=(VICTIM,), comm_timeout=20, timeout=120, per_rank_env=hosts)
    assert set(out) == {0, 1, 3}
    for rank, r in out.items():
        msg = str(r["msg"])
        assert r["culprit"] == VICTIM and r["cause"] == "exited", (rank, msg)
        assert f"rank {rank}:" in msg, msg
        assert f"lost rank {VICTIM}: rank {VICTIM} exited or was killed" in msg, msg
        assert r["type"] == "PeerLostError" and r["op"] and r["group"], r
        assert r["again_culprit"] == VICTIM, r  # later calls still name it
        assert float(r["after"]) < 15, r  # type: ignore[arg-type]
        assert int(r["leaked_fds"]) <= 0 and int(r["leaked_threads"]) <= 0, r  # type: ignore[call-overload]
    assert shm_entries() <= before


@pytest.mark.parametrize("transport,victim", [("tcp", 0), ("shm", 0), ("shm", 3)])
def test_any_killed_rank_is_named_even_the_store_host(transport: str, victim: int) -> None:
    from conftest import free_port

    out = launch(4, _die_and_recover, "world", free_port(), victim, transport=transport,
                 expect_dead=(victim,), comm_timeout=20, timeout=120)
    assert set(out) == set(range(4)) - {victim}
    for rank, r in out.items():
        assert r["culprit"] == victim and r["cause"] == "exited", (rank, r)
        assert f"lost rank {victim}: rank {victim} exited or was killed" in str(r["msg"]), r


# -- 3. hung, not dead; ringlet.abort() ----------------------------------------


def _stopped_rank(rank: int, world: int, count: int = 5000) -> dict[str, object]:
    pids = ringlet.all_gather(torch.tensor([os.getpid()])).tolist()
    ok = 0
    last_ok = time.monotonic()
    try:
        while True:
            if rank == 0 and ok == 20:
                os.kill(pids[VICTIM], signal.SIGSTOP)
            got = ringlet.all_reduce(ringlet.REDUCE_SUM, torch.full((count,), float(rank)))
            assert torch.equal(got, torch.full((count,), float(sum(range(world)))))
            ok += 1
            last_ok = time.monotonic()
    except ringlet.RingletError as e:
        err = e
    after = time.monotonic() - last_ok  # since this rank's last completed collective
    if rank == 0:
        os.kill(pids[VICTIM], signal.SIGCONT)
    return {"type": type(err).__name__, "culprit": err.culprit, "cause": err.cause,
            "msg": str(err), "ok": ok, "after": after}


@pytest.mark.parametrize("transport", [*TRANSPORTS, "two-level"])
def test_stopped_rank_times_out_named_and_raises_after_sigcont(transport: str) -> None:
    # two-level: two simulated hosts, 1 MiB all-reduces (shared memory within
    # each host, then across): the ranks wait on the stopped one through others
    hosts = [{"RINGLET_HOST_ID": f"host{r // 2}"} for r in range(4)]
    two = transport == "two-level"
    out = launch(4, _stopped_rank, *((1 << 18,) if two else ()),
                 transport="shm" if two else transport, comm_timeout=2.0, timeout=90,
                 per_rank_env=hosts if two else None)
    for rank, r in out.items():
        assert r["type"] == "CollectiveTimeoutError", (rank, r)
        assert r["culprit"] == VICTIM and r["cause"] == "timeout", (rank, r)
        assert "did not arrive within the timeout" in str(r["msg"]), r
    for rank in (0, 1, 3):
        # the timeout, the blame grace (1 s here), the wait for the blamed rank's
        # answer (one more grace), and slack for a loaded machine
        assert 1.9 < float(out[rank]["after"]) < 2.0 + 1.0 + 1.0 + 2.0, out[rank]  # type: ignore[arg-type]
    # the stopped rank never returned a result its peers did not get
    assert int(out[VICTIM]["ok"]) <= min(int(out[r]["ok"]) for r in (0, 1, 3)), out  # type: ignore[call-overload]


def _chain_of_waits(rank: int, world: int, gave_up: object) -> dict[str, object]:
    # Rank 0 waits for rank 1, which (busy for a while first) waits for rank
    # 2, which hangs outside ringlet: rank 0 times out first and blames rank
    # 1, whose own verdict (rank 2) comes later and must win everywhere.
    msg = torch.empty(4)
    if rank == 0:
        ringlet.send(torch.ones(4), 1)  # connect the pairs 0-1 and 1-2
    elif rank == 1:
        ringlet.recv(msg, 0)
        ringlet.send(torch.ones(4), 2)
    else:
        ringlet.recv(msg, 1)
    start = time.monotonic()
    try:
        if rank == 0:
            ringlet.recv(msg, 1)
        elif rank == 1:
            while time.monotonic() - start < 0.6:  # work before its own wait
                torch.ones(256, 256).sum()
            ringlet.recv(msg, 2)
        else:
            gave_up.wait(60)  # type: ignore[attr-defined]  # hung until the others gave up
            ringlet.send(msg, 1)
        raise AssertionError("returned")
    except ringlet.RingletError as e:
        err = e
    after = time.monotonic() - start
    if rank != 2:
        gave_up.wait(60)  # type: ignore[attr-defined]
    return {"type": type(err).__name__, "culprit": err.culprit, "cause": err.cause,
            "msg": str(err), "after": after, "again": _culprit_of_next_call()}


def _culprit_of_next_call() -> object:
    try:
        ringlet.barrier()
    except ringlet.RingletError as e:
        return e.culprit
    return None


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_chain_of_waits_is_blamed_on_the_rank_it_ends_at(transport: str) -> None:
    import torch.multiprocessing as mp

    gave_up = mp.get_context("spawn").Barrier(3)
    out = launch(3, _chain_of_waits, gave_up, transport=transport, comm_timeout=2.0,
                 timeout=90)
    for rank, r in out.items():
        assert r["culprit"] == 2 and r["cause"] == "timeout", (rank, r)
        assert "rank 2 did not arrive within the timeout" in str(r["msg"]), (rank, r)
        assert r["again"] == 2, (rank, r)
    # rank 0: its timeout, its grace, then rank 1's answer (0.6 s later)
    assert 2.0 < float(out[0]["after"]) < 2.0 + 1.0 + 1.0 + 2.0, out[0]  # type: ignore[arg-type]


def _aborted_from_a_thread(rank: int, world: int) -> dict[str, object]:
    groups = [[0, 1], [2]]
    ringlet.all_reduce(ringlet.REDUCE_SUM, [torch.ones(3)], groups=groups)  # connect
    start = time.monotonic()
    try:
        if rank == 1:
            # blocked: rank 0 never joins this one
            threading.Timer(0.5, ringlet.abort).start()
            ringlet.all_reduce(ringlet.REDUCE_SUM, [torch.ones(3)], groups=groups)
        else:
            ringlet.barrier()  # rank 1 never joins
        raise AssertionError("returned")
    except ringlet.RingletError as e:
        err = e
    return {"type": type(err).__name__, "culprit": err.culprit, "cause": err.cause,
            "msg": str(err), "after": time.monotonic() - start}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_from_another_thread_unblocks_and_peers_learn_the_origin(transport: str) -> None:
    out = launch(3, _aborted_from_a_thread, transport=transport, comm_timeout=30, timeout=90)
    assert out[1]["type"] == "CommunicatorAbortedError" and "ringlet.abort()" in str(out[1]["msg"])
    assert float(out[1]["after"]) < 2.0, out[1]  # type: ignore[arg-type]
    for rank in (0, 2):
        r = out[rank]
        assert r["type"] == "PeerLostError" and r["culprit"] == 1 and r["cause"] == "aborted", r
        assert "rank 1 called ringlet.abort()" in str(r["msg"]), r
        assert float(r["after"]) < 5.0, r  # type: ignore[arg-type]  # not the 30 s timeout


def _abort_in_signal_handler(rank: int, world: int, aborted: object) -> dict[str, object]:
    start = time.monotonic()
    if rank == 0:
        signal.signal(signal.SIGUSR1, lambda *_: ringlet.abort())
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
    else:
        aborted.wait(60)  # type: ignore[attr-defined]  # rank 0 gave up: now join
    try:
        ringlet.barrier()  # rank 0's main thread blocks here: rank 1 is not there yet
        raise AssertionError("returned")
    except ringlet.RingletError as e:
        err = e
    if rank == 0:
        aborted.set()  # type: ignore[attr-defined]
    return {"type": type(err).__name__, "msg": str(err), "after": time.monotonic() - start,
            "culprit": err.culprit, "cause": err.cause}


def test_abort_from_a_signal_handler_reaches_the_blocked_main_thread() -> None:
    import torch.multiprocessing as mp

    aborted = mp.get_context("spawn").Event()
    out = launch(2, _abort_in_signal_handler, aborted, comm_timeout=30, timeout=90)
    assert out[0]["type"] == "CommunicatorAbortedError", out
    assert float(out[0]["after"]) < 3, out  # type: ignore[arg-type]
    assert out[1]["type"] == "PeerLostError", out
    assert out[1]["culprit"] == 0 and out[1]["cause"] == "aborted", out


# -- 7. bad input stays an error: a fuzzer at the TCP endpoints ----------------


def _fuzz_listeners(port: int, world: int, gate: object, report: dict[str, int]) -> None:
    """Sends random and truncated hellos (with and without the job token) to
    every listening rank while the job connects, then lets the last rank in."""
    import json
    import random
    import socket
    import struct
    from datetime import timedelta

    from torch.distributed import TCPStore

    try:
        store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30),
                         wait_for_workers=False)
        prefix = f"ringlet/w{world}/g0/world"
        store.wait([f"{prefix}/peer/{r}" for r in range(world - 1)])
        token = int(json.loads(store.get(f"{prefix}/peer/0"))["token"])  # rank 0's record
        addrs = [json.loads(store.get(f"{prefix}/peer/{r}"))["addr"] for r in range(world - 1)]
        rng = random.Random(14)
        magic = 0x5249_4E47_4C45_5401

        def hello(m: int, t: int, r: int) -> bytes:
            return struct.pack("<QQQ", m, t, r)

        good = hello(magic, token, world - 1)
        frames: list[tuple[bytes, bool]] = []  # (bytes, keep the connection open)
        frames += [(rng.randbytes(rng.randrange(0, 80)), False) for _ in range(12)]
        frames += [(good[:k], False) for k in (1, 8, 16, 23)]  # truncated, with the token
        frames += [(good[:k], True) for k in (0, 5, 20)]  # truncated and then silent
        frames += [(hello(magic, token ^ 1, world - 1), False)]  # wrong token
        frames += [(hello(magic ^ 1, token, world - 1) + rng.randbytes(64), False)]
        frames += [(hello(magic, token, r), False) for r in (0, world, 2**64 - 1)]
        frames += [(hello(magic, token, 0) + rng.randbytes(4096), False)]
        kept = []
        for addr in addrs:
            host, p = addr.rsplit(":", 1)
            for data, keep in frames:
                s = socket.create_connection((host, int(p)), timeout=5)
                s.sendall(data)
                if keep:
                    kept.append(s)
                else:
                    s.close()
                report["sent"] = report.get("sent", 0) + 1
        report["kept_open"] = len(kept)
        gate.set()  # type: ignore[attr-defined]
        # silent connections stay open while the job finishes connecting
        store.wait([f"{prefix}/peer/{world - 1}"])
    finally:
        gate.set()  # type: ignore[attr-defined]


def _fuzzed_job(rank: int, world: int, port: int, gate: object) -> dict[str, int]:
    report: dict[str, int] = {}
    if rank == 0:
        fuzzer = threading.Thread(target=_fuzz_listeners, args=(port, world, gate, report))
        fuzzer.start()
    if rank == world - 1:
        assert gate.wait(60)  # type: ignore[attr-defined]
    start = time.monotonic()
    ringlet.init(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                 timeout=20)
    report["init_s"] = int(time.monotonic() - start)
    for n in (0, 1, 7, 1 << 16):
        x = torch.arange(n, dtype=torch.float64) + rank
        want = sum(torch.arange(n, dtype=torch.float64) + r for r in range(world))
        assert torch.equal(ringlet.all_reduce(ringlet.REDUCE_SUM, x), want)
        got = ringlet.all_gather(torch.full((n,), float(rank)))
        assert torch.equal(got, torch.cat([torch.full((n,), float(r)) for r in range(world)]))
    if rank == 0:
        fuzzer.join(30)
    return report


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fuzzed_hellos_are_dropped_without_delay_or_damage(transport: str) -> None:
    import torch.multiprocessing as mp

    from conftest import free_port

    gate = mp.get_context("spawn").Event()
    out = launch(3, _fuzzed_job, free_port(), gate, transport=transport, init=False,
                 timeout=120)
    assert out[0]["sent"] == 2 * 25 and out[0]["kept_open"] == 6, out
    assert all(r["init_s"] < 10 for r in out.values()), out


def _ctrl_c(rank: int, world: int, aborted: object) -> dict[str, object]:
    if rank == 0:
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            ringlet.barrier()  # rank 1 is not there: blocked until Ctrl-C
        except KeyboardInterrupt:
            after = time.monotonic() - start
        aborted.set()  # type: ignore[attr-defined]
        return {"after": after}
    aborted.wait(60)  # type: ignore[attr-defined]
    with pytest.raises(ringlet.PeerLostError) as e:
        ringlet.barrier()
    return {"culprit": e.value.culprit, "cause": e.value.cause}


def test_ctrl_c_interrupts_a_blocked_collective_and_peers_learn_it() -> None:
    import torch.multiprocessing as mp

    aborted = mp.get_context("spawn").Event()
    out = launch(2, _ctrl_c, aborted, comm_timeout=30, timeout=90)
    assert float(out[0]["after"]) < 3, out  # type: ignore[arg-type]
    assert out[1] == {"culprit": 0, "cause": "aborted"}, out
