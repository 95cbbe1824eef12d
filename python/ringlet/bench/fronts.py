"""One small all-reduce through each of ringlet's front ends and the peer
library, alternating in the same processes (so a drift of the machine's speed
hits them alike): the torch_xla-style API (in place, ``all_reduce("sum",
[t])``), ``torch.ops.ringlet.all_reduce(t)`` (out of place), and
``dist.all_reduce(t)`` on a ``"ringlet"`` process group, against Open MPI
(``--against mpi``, under mpirun) or gloo (under torchrun). Rank 0 prints
the median µs per call back to back and after ``--idle-us`` of idle.

Example:
  mpirun -np 2 python -m ringlet.bench fronts --against mpi
  torchrun --nproc_per_node 2 -m ringlet.bench fronts --size 65536
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

import ringlet
import ringlet.ops  # registers torch.ops.ringlet

from .collectives import _c10d_group, _start


def calls(x: torch.Tensor, peer: Any, group: Any) -> dict[str, Callable[[], Any]]:
    """The timed calls, by label: each front end on ``x``, then the peer."""
    import torch.distributed as dist

    y, out = x.clone(), x.clone()
    theirs = peer.call("all_reduce", y, out)
    return {
        "torch_xla-style `ringlet.all_reduce(\"sum\", [t])`":
            lambda: ringlet.all_reduce("sum", [x]),
        "`torch.ops.ringlet.all_reduce(t)`": lambda: torch.ops.ringlet.all_reduce(x),
        "`dist.all_reduce(t)` on a ringlet group": lambda: dist.all_reduce(x, group=group),
        f"{peer.name} (same processes)": theirs,
    }


def run(fns: dict[str, Callable[[], Any]], barrier: Callable[[], None], rounds: int,
        reps: int, idle: float) -> dict[str, tuple[float, float]]:
    """Median µs per call of each function: back to back (``rounds`` blocks of
    ``reps`` calls, functions alternating) and single calls ``idle`` seconds
    after a barrier."""
    back: dict[str, list[float]] = {k: [] for k in fns}
    after: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        for _ in range(max(1, reps // 10)):
            f()  # warm-up
    for _ in range(rounds):
        for k, f in fns.items():
            barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            back[k].append((time.perf_counter() - t0) / reps * 1e6)
            for _ in range(5 if idle else 0):
                barrier()
                time.sleep(idle)
                t0 = time.perf_counter()
                f()
                after[k].append((time.perf_counter() - t0) * 1e6)
    return {k: (statistics.median(back[k]),
                statistics.median(after[k]) if after[k] else float("nan")) for k in fns}


def table(res: dict[str, tuple[float, float]], size: int, n: int, idle_us: float) -> str:
    """Renders the medians as a Markdown table."""
    lines = [
        f"all_reduce of {size} bytes (float32), world size {n}, front ends alternating",
        "",
        f"| call | µs back to back | µs after {idle_us:g} µs idle |",
        "|---|---:|---:|",
    ]
    lines += [f"| {k} | {a:.2f} | {b:.2f} |" for k, (a, b) in res.items()]
    return "\n".join(lines)


def main() -> None:
    """Entry point of ``python -m ringlet.bench fronts``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--against", default="gloo", choices=["gloo", "mpi"])
    p.add_argument("--size", type=int, default=4096, help="bytes")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--reps", type=int, default=5000)
    p.add_argument("--idle-us", type=float, default=500.0)
    args = p.parse_args()
    peer = _start(args.against)
    group = _c10d_group(args.against)
    x = torch.ones(args.size // 4)
    res = run(calls(x, peer, group), peer.barrier, args.rounds, args.reps, args.idle_us * 1e-6)
    if ringlet.get_ordinal() == 0:
        print(table(res, args.size, ringlet.world_size(), args.idle_us), flush=True)
    if args.against == "mpi":
        import torch.distributed as dist

        dist.destroy_process_group()
    peer.close()
    ringlet.shutdown()


if __name__ == "__main__":
    main()
