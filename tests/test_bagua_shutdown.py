"""``ringlet.shutdown()`` closes the communicators of Bagua's process groups
(the hook ``bagua.communication`` registers with ``core.groups.on_shutdown``): the
default group's and a new group's global, intra- and inter-node communicators
and an algorithm's dedicated one report ``failed()`` (closed) afterwards, a
collective on a closed one raises, and Bagua's group table is empty."""

from __future__ import annotations

import os
from typing import Any

import torch

from conftest import free_port, launch

WORLD = 2


def shutdown_job(rank: int, world: int, port: int) -> dict[str, Any]:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import ringlet
    import ringlet.bagua.compat as bagua

    bagua.init_process_group()
    comm = bagua.communication
    pg = comm.new_group(list(range(world)))
    communicators = [
        comm._get_default_group().get_global_communicator(),
        pg.get_global_communicator(),
        pg.get_intra_node_communicator(),
        pg.get_inter_node_communicator(),
    ]
    dedicated = pg._dedicated("shutdown-test")
    sums = []
    for c in communicators:
        if c is comm.CommMember.NON_COMM_MEMBER:
            continue  # the inter-node communicator on a rank that leads no host
        t = torch.full((4,), float(rank + 1))
        bagua.allreduce_inplace(t, comm=c)
        sums.append((list(c.ranks), t.tolist()))
    cores = [c._core for c in communicators if c is not comm.CommMember.NON_COMM_MEMBER]
    cores.append(dedicated)
    open_before = [core.failed() for core in cores]
    groups_before = len(comm._pg_map)

    ringlet.shutdown()

    closed_after = [core.failed() for core in cores]
    try:
        cores[0].barrier()
        raised = ""
    except Exception as e:  # what a closed communicator raises
        raised = type(e).__name__
    return {
        "sums": sums,
        "open_before": open_before,
        "closed_after": closed_after,
        "raised": raised,
        "groups": (groups_before, len(comm._pg_map)),
        "initialized": comm.is_initialized(),
    }


def test_shutdown_closes_bagua_groups_communicators() -> None:
    out = launch(WORLD, shutdown_job, free_port(), init=False, timeout=120,
                 env={"OMP_NUM_THREADS": "1"})
    for rank in range(WORLD):
        got = out[rank]
        assert got["sums"], got
        for ranks, s in got["sums"]:  # each communicator's members' rank + 1, summed
            assert s == [float(sum(r + 1 for r in ranks))] * 4, (ranks, s)
        # default global, group global, intra, (inter on rank 0), dedicated
        assert len(got["open_before"]) == len(got["sums"]) + 1
        assert got["open_before"] == [False] * len(got["open_before"])
        assert got["closed_after"] == [True] * len(got["closed_after"])
        assert got["raised"], "a collective on a closed communicator did not raise"
        assert got["groups"] == (2, 0)
        assert got["initialized"] is False
