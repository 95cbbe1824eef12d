"""All-reduce GB/s by element type, the types alternating in the same
processes (so a drift of the machine's speed hits them alike): float32,
bfloat16 and float16 by default, at 16, 64 and 256 MiB. Rank 0 prints the
median algbw of each (bytes of the buffer per second) and its ratio to the
first type's.

Example:
  torchrun --nproc_per_node 2 -m ringlet.bench dtypes
  torchrun --nproc_per_node 2 -m ringlet.bench dtypes --dtypes float32,bfloat16 --sizes 1048576
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ringlet

SIZES = [16 << 20, 64 << 20, 256 << 20]


def run(dtypes: list[torch.dtype], sizes: list[int], rounds: int) -> list[dict[str, float]]:
    """Times world all_reduces of every dtype at every size; returns rows
    (``bytes``, then ``<dtype name>`` -> algbw GB/s)."""
    rows = []
    for size in sizes:
        bufs = {d: torch.ones(size // torch.empty(0, dtype=d).element_size(), dtype=d)
                for d in dtypes}
        for x in bufs.values():
            ringlet.all_reduce(ringlet.REDUCE_SUM, [x])  # warm-up: page faults
        reps = max(2, int(2e8 // size))
        samples: dict[torch.dtype, list[float]] = {d: [] for d in dtypes}
        for _ in range(rounds):
            for d, x in bufs.items():
                x.fill_(1)  # (float16 reaches inf after 16 sums; SIMD speed does not change)
                ringlet.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    ringlet.all_reduce(ringlet.REDUCE_SUM, [x])
                samples[d].append((time.perf_counter() - t0) / reps)
        row: dict[str, float] = {"bytes": float(size)}
        for d, v in samples.items():
            row[str(d).split(".")[-1]] = size / statistics.median(v) / 1e9
        rows.append(row)
    return rows


def table(rows: list[dict[str, float]], names: list[str], n: int) -> str:
    """Renders the rows as a Markdown table."""
    lines = [
        f"all_reduce algbw GB/s by element type, world size {n}, types alternating",
        "",
        "| size | " + " | ".join(names) + " | " + " | ".join(
            f"{m} / {names[0]}" for m in names[1:]) + " |",
        "|---|" + "---:|" * (2 * len(names) - 1),
    ]
    for r in rows:
        base = r[names[0]]
        lines.append(
            f"| {int(r['bytes']) >> 20} MiB | " + " | ".join(f"{r[m]:.2f}" for m in names)
            + " | " + " | ".join(f"{r[m] / base:.2f}x" for m in names[1:]) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    """Entry point of ``python -m ringlet.bench dtypes``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16,float16")
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="bytes, comma list")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    names = args.dtypes.split(",")
    dtypes = []
    for name in names:
        d = getattr(torch, name, None)
        if not isinstance(d, torch.dtype):
            raise SystemExit(f"unknown dtype {name!r}")
        dtypes.append(d)
    ringlet.init()
    rows = run(dtypes, [int(s) for s in args.sizes.split(",")], args.rounds)
    if ringlet.get_ordinal() == 0:
        print(table(rows, [str(d).split(".")[-1] for d in dtypes], ringlet.world_size()),
              flush=True)
    ringlet.shutdown()


if __name__ == "__main__":
    main()
