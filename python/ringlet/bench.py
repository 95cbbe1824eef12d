"""Side-by-side benchmark of ringlet and torch.distributed's gloo backend.

Run under torchrun; both libraries run in the same processes, alternating
call by call, and rank 0 prints the median over samples (each a block of back-to-back calls,
as nccl-tests times them) of latency, algbw and busbw (nccl-tests
definitions: algbw = bytes / time; busbw = algbw * 2(n-1)/n for all_reduce and
* (n-1)/n for all_gather and reduce_scatter, where bytes is the larger of
input and output: the gathered output, the full reduce_scatter input).
reduce_scatter runs with --ops all_reduce,all_gather,reduce_scatter.

Example:
  torchrun --nproc_per_node 2 -m ringlet.bench
  torchrun --nproc_per_node 2 -m ringlet.bench --ops all_reduce --plot busbw.png
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

import ringlet

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _iters(size: int, budget: float) -> int:
    return max(5, min(1000, int(budget * 4e8 / max(size, 1))))


def _time(fn: Callable[[], None], reps: int) -> float:
    """Seconds per call over a block of ``reps`` back-to-back calls."""
    ringlet.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def run(ops: list[str], sizes: list[int], budget: float) -> list[dict[str, float]]:
    """Times every op at every size for both libraries; returns rows (rank 0)."""
    n = ringlet.world_size()
    rows = []
    for op in ops:
        for size in sizes:
            if op == "all_reduce":
                x = torch.ones(size // 4)
                y = x.clone()

                def ours(x: torch.Tensor = x) -> None:
                    ringlet.all_reduce(ringlet.REDUCE_SUM, [x])

                def theirs(y: torch.Tensor = y) -> None:
                    dist.all_reduce(y)
            elif op == "reduce_scatter":
                full = torch.ones(size // 4 // n * n)
                mine = torch.empty(size // 4 // n)

                def ours(full: torch.Tensor = full, mine: torch.Tensor = mine) -> None:
                    ringlet.reduce_scatter(ringlet.REDUCE_SUM, full, 1.0, 0, n, output=mine)

                def theirs(full: torch.Tensor = full, mine: torch.Tensor = mine) -> None:
                    dist.reduce_scatter_tensor(mine, full)
            elif op == "all_gather":
                x = torch.ones(size // 4 // n)
                out = torch.empty(size // 4 // n * n)
                outs = list(out.chunk(n))

                def ours(x: torch.Tensor = x, out: torch.Tensor = out) -> None:
                    ringlet.all_gather(x, output=out)

                def theirs(x: torch.Tensor = x, outs: list[torch.Tensor] = outs) -> None:
                    dist.all_gather(outs, x)
            else:
                raise SystemExit(f"unknown op {op!r}: use all_reduce, all_gather, reduce_scatter")

            ours()
            theirs()  # warm-up (page faults, connections)
            t_ours, t_theirs = [], []
            iters = _iters(size, budget)
            reps = max(1, iters // 10)
            for _ in range(max(5, iters // reps)):
                t_ours.append(_time(ours, reps))
                t_theirs.append(_time(theirs, reps))
            a, b = statistics.median(t_ours), statistics.median(t_theirs)
            f = _bus_factor(op, n)
            rows.append(
                {
                    "op": op, "bytes": size, "ringlet_us": a * 1e6, "gloo_us": b * 1e6,
                    "ringlet_busbw": size / a * f / 1e9, "gloo_busbw": size / b * f / 1e9,
                    "ringlet_algbw": size / a / 1e9, "gloo_algbw": size / b / 1e9,
                }
            )
    return rows


def table(rows: list[dict[str, float]], n: int, transport: str) -> str:
    """Renders the rows as a Markdown table."""
    lines = [
        f"world size {n}, ringlet transport {transport}, gloo over loopback TCP",
        "",
        "| op | size | ringlet µs | gloo µs | ringlet algbw GB/s | ringlet busbw GB/s "
        "| gloo busbw GB/s | busbw ringlet/gloo |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {_fmt_size(int(r['bytes']))} | {r['ringlet_us']:.1f} | "
            f"{r['gloo_us']:.1f} | {r['ringlet_algbw']:.2f} | {r['ringlet_busbw']:.2f} | "
            f"{r['gloo_busbw']:.2f} | {r['ringlet_busbw'] / r['gloo_busbw']:.1f}x |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, float]], path: str) -> None:
    """Writes a PNG of busbw against message size (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for op in sorted({str(r["op"]) for r in rows}):
        mine = [r for r in rows if r["op"] == op]
        xs = [r["bytes"] for r in mine]
        ax.plot(xs, [r["ringlet_busbw"] for r in mine], marker="o", label=f"ringlet {op}")
        ax.plot(xs, [r["gloo_busbw"] for r in mine], marker="x", ls="--", label=f"gloo {op}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    """Entry point of ``python -m ringlet.bench``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", default="all_reduce,all_gather")
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="bytes, comma list")
    p.add_argument("--budget", type=float, default=1.0, help="scales the iteration counts")
    p.add_argument("--plot", default=None, help="write a PNG of busbw vs size here")
    args = p.parse_args()
    ringlet.init()
    dist.init_process_group("gloo")
    rows = run(args.ops.split(","), [int(s) for s in args.sizes.split(",")], args.budget)
    if ringlet.get_ordinal() == 0:
        print(table(rows, ringlet.world_size(), ringlet.transport()), flush=True)
        if args.plot:
            plot(rows, args.plot)
    dist.destroy_process_group()
    ringlet.shutdown()


if __name__ == "__main__":
    main()
