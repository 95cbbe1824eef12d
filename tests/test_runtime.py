"""Bootstrap: world of one without a launcher, explicit init, torchrun, and
side by side with torch.distributed's gloo backend."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ringlet

from conftest import free_port, launch


def test_world_of_one_needs_no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    ringlet.shutdown()
    assert not ringlet.is_initialized()
    ringlet.init()
    ringlet.init()  # twice is harmless
    assert ringlet.is_initialized()
    assert (ringlet.get_ordinal(), ringlet.world_size()) == (0, 1)
    assert (ringlet.get_local_ordinal(), ringlet.local_world_size()) == (0, 1)
    assert ringlet.transport() == "local"
    x = torch.arange(4.0)
    y = ringlet.all_reduce("sum", x, scale=3.0)
    assert torch.equal(y, x) and y is not x  # torch_xla: a clone, unscaled
    lst = [x]
    assert ringlet.all_reduce("sum", lst) is lst
    assert torch.equal(ringlet.all_gather(x.reshape(2, 2), dim=1), x.reshape(2, 2))
    assert torch.equal(ringlet.reduce_scatter("sum", x, 2.0, 0, 1), x * 2)
    ringlet.collective_broadcast([x])
    ringlet.barrier()
    assert ringlet.rendezvous("one", b"p") == [b"p"]
    assert ringlet.mesh_reduce("m", 3, sum) == 3
    assert ringlet.is_master_ordinal() and ringlet.is_master_ordinal(local=False)
    ringlet.shutdown()
    assert not ringlet.is_initialized()


def test_bad_init_arguments() -> None:
    ringlet.shutdown()
    with pytest.raises(ValueError, match="rank 3 is out of range for world_size 2"):
        ringlet.init(rank=3, world_size=2)
    with pytest.raises(ValueError, match="timeout must be positive"):
        ringlet.init(rank=0, world_size=1, timeout=0)


def info(rank: int, world: int) -> tuple[int, int, int, int, list[list[int]], str]:
    return (
        ringlet.get_ordinal(),
        ringlet.world_size(),
        ringlet.get_local_ordinal(),
        ringlet.local_world_size(),
        ringlet.host_layout(),
        ringlet.transport(),
    )


def test_explicit_init_and_topology() -> None:
    out = launch(3, info)
    for r in range(3):
        assert out[r] == (r, 3, r, 3, [[0, 1, 2]], "shm+cma")


def test_simulated_hosts_use_tcp_and_report_layout() -> None:
    # Two "hosts" on one machine: ranks 0,1 on A and 2,3 on B.
    hosts = [{"RINGLET_HOST_ID": f"host-{r // 2}"} for r in range(4)]
    out = launch(4, fake_hosts, per_rank_env=hosts)
    for r in range(4):
        assert out[r] == (r, 4, r % 2, 2, [[0, 1], [2, 3]], "tcp")


def fake_hosts(rank: int, world: int) -> tuple[int, int, int, int, list[list[int]], str]:
    return info(rank, world)


def beside_gloo(rank: int, world: int, port: int) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        x = torch.tensor([float(rank + 1)])
        mine = ringlet.all_reduce("sum", x)
        theirs = x.clone()
        dist.all_reduce(theirs)
        return [mine.item(), theirs.item()]
    finally:
        dist.destroy_process_group()


def late_pair(rank: int, world: int, gate: object) -> list[float]:
    if rank == 0:
        # Rank 0's process hosts the store. It shuts down first; the others
        # only then connect a pair through the store, which must still be there.
        gate.set()  # type: ignore[attr-defined]
        ringlet.shutdown()
        return []
    gate.wait()  # type: ignore[attr-defined]
    peer = 3 - rank
    buf = torch.full((4,), float(rank))
    if rank == 1:
        ringlet.send(buf, dst=peer)
        return ringlet.recv(torch.empty(4), src=peer).tolist()
    got = ringlet.recv(torch.empty(4), src=peer).tolist()
    ringlet.send(buf, dst=peer)
    return got


def test_store_host_waits_for_late_connections() -> None:
    import torch.multiprocessing as mp

    gate = mp.get_context("spawn").Event()
    out = launch(3, late_pair, gate)
    assert out == {0: [], 1: [2.0] * 4, 2: [1.0] * 4}


def test_side_by_side_with_torch_distributed() -> None:
    out = launch(2, beside_gloo, free_port())
    assert out == {0: [3.0, 3.0], 1: [3.0, 3.0]}


def test_torchrun_launch() -> None:
    script = Path(__file__).parent / "scripts" / "torchrun_job.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(free_port()), str(script),
        ],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torchrun ok rank 0 of 2" in proc.stdout and "torchrun ok rank 1 of 2" in proc.stdout


# -- start-up never hangs on a taken port (issue 39) --

_START_TIMEOUT = 3.0
# What a rank may take beyond its timeout: rank 0 looks at what holds its port
# (at most 2 x 1 s), rank 1 at what answers at the store's address; both on a
# loaded machine.
_START_MARGIN = 2.5


def _starts(rank: int, world: int, ports: dict[str, int]) -> dict[str, Any]:
    """Tries ``ringlet.init`` and ``init_process_group("ringlet")`` against
    each held port in turn; returns what each attempt raised and how long it
    took."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    out: dict[str, Any] = {}
    for case, port in ports.items():
        for door in ("init", "c10d"):
            t0 = time.monotonic()
            try:
                if door == "init":
                    ringlet.init(
                        rank,
                        world,
                        master_addr="127.0.0.1",
                        master_port=port,
                        timeout=_START_TIMEOUT,
                    )
                else:
                    dist.init_process_group(
                        "ringlet",
                        init_method=f"tcp://127.0.0.1:{port}",
                        rank=rank,
                        world_size=world,
                        timeout=timedelta(seconds=_START_TIMEOUT),
                    )
                out[f"{case}/{door}"] = ("returned", "", time.monotonic() - t0)
            except Exception as e:
                took = time.monotonic() - t0
                out[f"{case}/{door}"] = (type(e).__name__, str(e), took)
            finally:
                ringlet.shutdown()
                if dist.is_initialized():
                    dist.destroy_process_group()
    return out


def test_start_up_on_a_taken_port_ends_within_the_timeout() -> None:
    """A port held by a listener that never answers, by another job's live
    torch store, or bound by a program that does not listen: on both ranks,
    ``ringlet.init`` and ``init_process_group("ringlet")`` raise within the
    timeout, naming the address and what holds it (torch's own client waited
    without limit on the silent listener)."""
    import contextlib
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    with contextlib.ExitStack() as held:
        silent = held.enter_context(socket.socket())
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel completes connections; nobody accepts or reads
        bound = held.enter_context(socket.socket())
        bound.bind(("127.0.0.1", 0))  # the port is taken, nothing accepts there
        # Another job's live store (its server stops with the last reference).
        other = [
            TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
        ]
        held.callback(other.clear)
        other[0].set("another/job", "running")
        ports = {
            "silent": silent.getsockname()[1],
            "store": other[0].port,
            "bound": bound.getsockname()[1],
        }
        out = launch(2, _starts, ports, init=False, timeout=180)
    for r in (0, 1):
        for key, (kind, msg, took) in out[r].items():
            case = key.split("/")[0]
            where = f"127.0.0.1:{ports[case]}"
            assert took < _START_TIMEOUT + _START_MARGIN, (r, key, took, msg)
            assert where in msg, (r, key, msg)
            if r == 0:  # cannot host the store: torch's type, what holds the port
                assert kind == "DistNetworkError", (r, key, kind, msg)
                assert f"rank 0: could not listen on port {ports[case]}" in msg, msg
                holder = {
                    "silent": "accepts connections at 127.0.0.1:{} but does not answer",
                    "store": "a torch store (TCPStore) already answers at 127.0.0.1:{}",
                    "bound": "does not accept connections at 127.0.0.1:{}",
                }[case].format(ports[case])
                assert holder in msg, (key, msg)
            elif case == "store":  # joined another job's store: its rank 0 never comes
                assert kind == "CollectiveTimeoutError", (r, key, kind, msg)
                assert "answers, but rank 0 never registered in it" in msg, msg
                assert "pick another MASTER_PORT" in msg, msg
            else:  # no store answers at the address
                assert kind == "DistNetworkError", (r, key, kind, msg)
                assert f"rank 1: Timed out after 3s waiting for the store at {where}" in msg
                why = (
                    "accepts connections but does not answer as a torch store"
                    if case == "silent"
                    else "nothing accepts connections there"
                )
                assert why in msg, (key, msg)
