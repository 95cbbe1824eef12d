"""Bucket all-reduce of gradients in CUDA memory against the same gradients
in host memory (the tensor API's worker stages CUDA tensors through host
memory after waiting on the CUDA event recorded when they are marked ready).
Rank 0 prints the median time per bucket and the algbw (bytes of the bucket
per second). Without CUDA only the host rows run.

Example:
  torchrun --nproc_per_node 2 -m ringlet.bench cuda
  torchrun --nproc_per_node 2 -m ringlet.bench cuda --sizes 1048576 --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ringlet
from ringlet.parallel.tensor import get_module

SIZES = [1 << 20, 64 << 20]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(devices: list[str], sizes: list[int], rounds: int) -> list[tuple[str, int, float]]:
    """Times one bucket all-reduce (sum) per round for every device and size;
    checks each result; returns ``(device, bytes, median seconds)`` rows."""
    rank, world = ringlet.get_ordinal(), ringlet.world_size()
    want = float(sum(r + 1 for r in range(world)))
    rows = []
    for size in sizes:
        for device in devices:
            n = size // 4
            name = f"bench_cuda_{device}_{size}"
            p = torch.nn.Parameter(torch.zeros(n, device=device)).ensure_ringlet_tensor(
                "grad", name, lambda t: t.grad
            )
            module = get_module(name)
            module.set_buckets([[p]])
            module.set_all_reduce(average=False)
            times = []
            for _ in range(rounds + 2):
                p.grad = torch.full((n,), float(rank + 1), device=device)
                _sync(device)
                ringlet.barrier()
                t0 = time.perf_counter()
                p.ringlet_mark_communication_ready()
                module.wait_pending_comm_ops()
                _sync(device)
                times.append(time.perf_counter() - t0)
                if not torch.all(p.grad == want).item():
                    raise RuntimeError(f"wrong bucket sum on {device}: {p.grad[:4].tolist()}")
            module.close()
            rows.append((device, size, statistics.median(times[2:])))
    return rows


def table(rows: list[tuple[str, int, float]], world: int) -> str:
    """Renders the rows as a Markdown table."""
    lines = [
        f"bucket all_reduce of one gradient, world size {world}",
        "",
        "| gradient on | size | ms per bucket (median) | algbw GB/s |",
        "|---|---:|---:|---:|",
    ]
    for device, size, secs in rows:
        gbs = size / secs / 1e9
        lines.append(f"| {device} | {size >> 20} MiB | {secs * 1e3:.2f} | {gbs:.2f} |")
    return "\n".join(lines)


def main() -> None:
    """Entry point of ``python -m ringlet.bench cuda``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="bytes, comma list")
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args()
    ringlet.init()
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    rows = run(devices, [int(s) for s in args.sizes.split(",")], args.rounds)
    if ringlet.get_ordinal() == 0:
        print(table(rows, ringlet.world_size()), flush=True)
    ringlet.shutdown()


if __name__ == "__main__":
    main()
