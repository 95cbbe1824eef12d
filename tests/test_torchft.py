"""torchft on ringlet: ``ringlet.distributed.torchft.ProcessGroupRinglet`` under torchft's
Manager, against torchft's own ``ProcessGroupGloo`` in the same run.

Two replica groups (one process each) train the same model; replica 1 is
killed (SIGKILL) mid-training and started again, heals from replica 0, and
both finish. The final parameters must be the same on both replicas and the
same as gloo's, bit for bit (the data of each step is a function of the
step; the killed step is not committed on either backend)."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import pytest

import torchft_job

STEPS, DIE_AT = 6, 3


@pytest.mark.parametrize("mode", ["ddp", "allreduce"])
def test_killed_replica_heals_and_training_equals_gloo(mode: str) -> None:
    """``ddp``: torchft's DistributedDataParallel, replica 1 killed between
    steps (as torchft's own recovery tests). ``allreduce``: gradients through
    ``manager.allreduce``, replica 1 killed after its forward pass, so
    replica 0's allreduce loses its peer: ringlet's error reaches
    ``should_commit`` (the step is not committed) and the next quorum heals."""
    pytest.importorskip("torchft", reason="optional: pip install 'ringlet[torchft]'")
    runs = {b: torchft_job.run(b, STEPS, DIE_AT, mode=mode, timeout=240)
            for b in ("gloo", "ringlet")}
    for backend, r in runs.items():
        res = r["results"]
        assert r["exitcode"] == -signal.SIGKILL and r["restarts"] == 1, (backend, r["exitcode"])
        assert res[0]["pg"] == f"torchft-{backend}"
        assert res[0]["step"] == res[1]["step"] == STEPS, backend
        # the replacement started at the step it healed to, not at 0
        assert res[1]["times"][0][0] == DIE_AT, (backend, res[1]["times"])
        assert res[0]["state"] == res[1]["state"], f"{backend}: replicas differ after healing"
        # the step the kill interrupted was retried, not committed
        uncommitted = [s for s, _, committed in res[0]["times"] if not committed]
        assert uncommitted == ([DIE_AT] if mode == "allreduce" else []), (backend, uncommitted)
    mine, gloo = runs["ringlet"]["results"][0]["state"], runs["gloo"]["results"][0]["state"]
    assert mine.keys() == gloo.keys()
    for k in mine:
        assert mine[k] == gloo[k], f"{k}: ringlet's training differs from gloo's"


def test_torchfts_own_diloco_on_ringlet_equals_gloo() -> None:
    """torchft's ``DiLoCo`` (Streaming: two fragments, a delay) under its
    Manager keeps working on ringlet's process group: each replica ends
    with the weights it has on torchft's gloo group, bit for bit (the
    replicas differ from each other: the fragment not synced last keeps its
    local weights)."""
    pytest.importorskip("torchft", reason="optional: pip install 'ringlet[torchft]'")
    runs = {b: torchft_job.run(b, 4, -1, mode="diloco", timeout=240)
            for b in ("gloo", "ringlet")}
    for backend, r in runs.items():
        assert r["results"][0]["step"] == r["results"][1]["step"] == 4, backend
    for replica in (0, 1):
        mine = runs["ringlet"]["results"][replica]["state"]
        assert mine == runs["gloo"]["results"][replica]["state"], f"replica {replica} differs"


def test_import_without_torchft_names_the_package() -> None:
    code = ("import sys; sys.modules['torchft'] = sys.modules['torchft.process_group'] = None\n"
            "try:\n    import ringlet.distributed.torchft\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "ringlet.distributed.torchft needs torchft: pip install torchft" in out.stdout, out


def _wrapper_job(rank: int, world: int, port: int) -> dict:
    """torchft's ProcessGroupWrapper protocol by hand: configure, collectives,
    reconfigure (the old group is given up), against torchft's gloo group."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import AllgatherOptions
    from torchft.process_group import ProcessGroupGloo

    from ringlet.distributed.torchft import ProcessGroupRinglet

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    got: dict = {}
    for name, pg in (("ringlet", ProcessGroupRinglet(timedelta(seconds=30))),
                     ("gloo", ProcessGroupGloo(timedelta(seconds=30)))):
        res = []
        for quorum in (1, 2):  # a new quorum: configure again
            # as torchft's quorum: every replica has finished the previous step
            # before any replica reconfigures (and so aborts the old group)
            store.set(f"{name}/{quorum}/{rank}", "1")
            store.wait([f"{name}/{quorum}/{r}" for r in range(world)])
            pg.configure(f"127.0.0.1:{port}/{name}/{quorum}", f"replica_{rank}", rank, world,
                         quorum_id=quorum)
            t = torch.arange(4.0) * (rank + 1) * quorum
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            pg.allreduce([t], opts).wait()
            outs = [torch.zeros(2) for _ in range(world)]
            pg.allgather([outs], [torch.full((2,), float(rank))], AllgatherOptions()).wait()
            b = torch.full((3,), float(rank + quorum))
            bo = dist.BroadcastOptions()
            bo.rootRank = 1
            pg.broadcast([b], bo).wait()
            res.append([t.tolist(), [o.tolist() for o in outs], b.tolist()])
        got[name] = res
        got[name + ":name"] = pg.getBackendName()
        if name == "ringlet":
            out = torch.zeros(2)
            ro = dist.ReduceScatterOptions()
            ro.reduceOp = dist.ReduceOp.SUM
            pg.reduce_scatter([out], [[torch.full((2,), float(r + rank)) for r in range(world)]],
                              ro).wait()
            got["reduce_scatter"] = out.tolist()
        store.set(f"{name}/done/{rank}", "1")
        store.wait([f"{name}/done/{r}" for r in range(world)])
        pg.abort()
    got["bad_timeout"] = [type(e).__name__ for e in _errors(
        lambda: ProcessGroupRinglet(5.0),  # type: ignore[arg-type]
        lambda: ProcessGroupRinglet(timedelta(0)))]
    del store
    return got


def _errors(*calls: Any) -> list[BaseException]:
    out = []
    for call in calls:
        try:
            call()
        except Exception as e:  # the point
            out.append(e)
    return out


def test_wrapper_configures_collectives_as_torchft_gloo() -> None:
    pytest.importorskip("torchft", reason="optional: pip install 'ringlet[torchft]'")
    from conftest import free_port, launch

    out = launch(2, _wrapper_job, free_port(), init=False, timeout=120)
    for rank in range(2):
        r = out[rank]
        assert r["ringlet"] == r["gloo"], r
        assert r["ringlet"][1][0] == [float(3 * 2 * i) for i in range(4)]  # (1 + 2) x 2 x i
        assert r["ringlet"][0][1] == [[0.0, 0.0], [1.0, 1.0]]
        assert r["ringlet"][1][2] == [3.0] * 3  # rank 1's, in quorum 2
        assert (r["ringlet:name"], r["gloo:name"]) == ("torchft-ringlet", "torchft-gloo")
        assert r["reduce_scatter"] == [float(rank) * 2 + 1] * 2  # sum over r of (rank + r)
        assert r["bad_timeout"] == ["TypeError", "ValueError"]
