"""One worker of an elastic job (tests/test_elastic.py), launched by
``torchrun --nnodes 1:3 --max-restarts N --rdzv-backend c10d``.

Full-batch gradient descent on a least-squares problem, data-parallel over
the ranks of the current round: rank r takes rows r, r + world, ... of the
batch, the gradients are summed with ``dist.all_reduce`` on the ringlet
backend, so each step's result does not depend on the world size. Every
step ends with a ``torch.distributed.checkpoint`` save (every rank takes
part, over ringlet); a worker that starts (first or after a restart) loads
the newest complete one, written by a world of another size.

The test paces the steps through ``release`` (the number of steps the job
may have done; a worker polls it between steps) and reads ``progress``
(one JSON line per step and per start). A peer that leaves makes the next
collective raise: the worker exits with an error, and torchrun restarts the
workers in the new world.

Usage: python elastic_job.py WORKDIR TOTAL_STEPS TIMEOUT_S

TIMEOUT_S is the process group's timeout: how long a survivor waits for a
host whose link went down (a crashed process resets its connections at once).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ringlet  # noqa: F401  (registers the "ringlet" backend)

ROWS, COLS, LR = 48, 6, 0.05


def problem() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(31)
    x = torch.randn(ROWS, COLS, generator=g, dtype=torch.float64)
    y = x @ torch.randn(COLS, generator=g, dtype=torch.float64)
    return x, y + 0.01 * torch.randn(ROWS, generator=g, dtype=torch.float64)


def log(path: Path, **record: object) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def main() -> None:
    work, total = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("ringlet", timeout=timedelta(seconds=float(sys.argv[3])))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    host = os.environ.get("RINGLET_HOST_ID", "")
    (work / "pids").mkdir(exist_ok=True)
    (work / "pids" / f"{host}.{os.getpid()}").touch()  # the test kills a host's workers
    x, y = problem()
    state = {"w": torch.zeros(COLS, dtype=torch.float64),
             "step": torch.zeros((), dtype=torch.int64)}
    done = sorted(int(p.name[5:]) for p in work.glob("step-*") if (p / ".metadata").exists())
    if done:  # the newest complete checkpoint (a save the crash cut short has no .metadata)
        dcp.load(state, checkpoint_id=str(work / f"step-{done[-1]}"))
    w, step = state["w"], int(state["step"])
    if rank == 0:
        log(work / "progress", event="start", attempt=attempt, world=world, step=step,
            host=host, master=os.environ["MASTER_ADDR"])
    mine = slice(rank, ROWS, world)
    while step < total:
        # the test says how far the job may go
        while step >= int((work / "release").read_text() or 0):
            time.sleep(0.01)
        residual = x[mine] @ w - y[mine]
        grad = x[mine].T @ residual
        dist.all_reduce(grad)
        w = w - LR * grad / ROWS
        step += 1
        dcp.save({"w": w, "step": torch.tensor(step)}, checkpoint_id=str(work / f"step-{step}"))
        if rank == 0:
            log(work / "progress", event="step", attempt=attempt, world=world, step=step)
    if rank == 0:
        torch.save(w, work / "result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
