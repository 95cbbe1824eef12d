"""ringlet's collectives side by side with gloo (torch.distributed) or Open MPI
(mpi4py), in the same processes, alternating.

For every op and size rank 0 prints the median over samples of back-to-back
blocks (as nccl-tests times them: latency, algbw = bytes / time, busbw =
algbw * 2(n-1)/n for all_reduce, * (n-1)/n for all_gather and reduce_scatter,
* 1 for broadcast; bytes = the larger of input and output) and, up to 64 KiB,
the median of single calls each made right after a barrier (as the OSU
benchmarks time latency) and of single calls made 0.5 ms after a barrier
(``--idle-us``: cold caches, ranks that gave their cores away).
Before that it times the first all_reduce calls after start-up at the
first size (``--first-calls``; each after a barrier, taking turns with the
peer): calls 0-149 against the last 150, and how long each start-up took, so
a slow first pass through fresh memory shows beside the steady state.
``--front`` picks ringlet's front end (the torch_xla-style API, torch.ops.ringlet
or torch.distributed on a "ringlet" group), ``--dtype`` the element type.

Example:
  torchrun --nproc_per_node 2 -m ringlet.bench collectives --budget 2
  torchrun --nproc_per_node 2 -m ringlet.bench collectives --ops all_reduce --plot busbw.png
  mpirun -np 2 python -m ringlet.bench collectives --against mpi
  mpirun -np 2 python -m ringlet.bench collectives --against mpi --front c10d --sizes 4096
  torchrun --nproc_per_node 2 -m ringlet.bench collectives --ops all_reduce --dtype bfloat16
  mpirun -np 2 python -m ringlet.bench collectives --against mpi --busy 1 --first-calls 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Callable

import torch

import ringlet
from ringlet.bench.busy import neighbours

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
_LATENCY_MAX = 64 << 10


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _iters(size: int, budget: float) -> int:
    return max(5, min(1000, int(budget * 4e8 / max(size, 1))))


def _bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    return 1.0 if op == "broadcast" else (n - 1) / n


class _Gloo:
    """torch.distributed's gloo backend."""

    name = "gloo"

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        dist.init_process_group("gloo")

    def barrier(self) -> None:
        self.dist.barrier()

    def call(self, op: str, x: torch.Tensor, out: torch.Tensor) -> Callable[[], Any]:
        d, n = self.dist, ringlet.world_size()
        if op == "all_reduce":
            return lambda: d.all_reduce(x)
        if op == "all_gather":
            return lambda: getattr(d, "all_gather_single", d.all_gather_into_tensor)(out, x)
        if op == "reduce_scatter":
            return lambda: getattr(d, "reduce_scatter_single", d.reduce_scatter_tensor)(out, x)
        assert n > 0
        return lambda: d.broadcast(x, 0)

    def close(self) -> None:
        self.dist.destroy_process_group()


class _Mpi:
    """Open MPI through mpi4py (the ``bench`` extra)."""

    name = "Open MPI"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.mpi, self.comm = MPI, MPI.COMM_WORLD

    def barrier(self) -> None:
        self.comm.Barrier()

    def call(self, op: str, x: torch.Tensor, out: torch.Tensor) -> Callable[[], Any]:
        c, m = self.comm, self.mpi
        a, b = x.numpy(), out.numpy()
        if op == "all_reduce":
            return lambda: c.Allreduce(m.IN_PLACE, a, op=m.SUM)
        if op == "all_gather":
            return lambda: c.Allgather(a, b)
        if op == "reduce_scatter":
            return lambda: c.Reduce_scatter_block(a, b, op=m.SUM)
        return lambda: c.Bcast(a, root=0)

    def close(self) -> None:
        pass


def _ours(op: str, x: torch.Tensor, out: torch.Tensor, front: str = "xla",
          group: Any = None) -> Callable[[], Any]:
    """ringlet's call for ``op`` through front end ``front``: ``xla`` (the
    torch_xla-style API, in place where it can be), ``ops``
    (``torch.ops.ringlet``, out of place) or ``c10d`` (``torch.distributed``
    on a ``"ringlet"`` process group ``group``)."""
    n = ringlet.world_size()
    if front == "ops":
        ops = torch.ops.ringlet
        return {
            "all_reduce": lambda: ops.all_reduce(x),
            "all_gather": lambda: ops.all_gather(x),
            "reduce_scatter": lambda: ops.reduce_scatter(x),
            "broadcast": lambda: ops.broadcast(x),
        }[op]
    if front == "c10d":
        import torch.distributed as dist

        return {
            "all_reduce": lambda: dist.all_reduce(x, group=group),
            "all_gather": lambda: dist.all_gather_into_tensor(out, x, group=group),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, x, group=group),
            "broadcast": lambda: dist.broadcast(x, 0, group=group),
        }[op]
    if op == "all_reduce":
        return lambda: ringlet.all_reduce(ringlet.REDUCE_SUM, [x])
    if op == "all_gather":
        return lambda: ringlet.all_gather(x, output=out)
    if op == "reduce_scatter":
        return lambda: ringlet.reduce_scatter(ringlet.REDUCE_SUM, x, 1.0, 0, n, output=out)
    return lambda: ringlet.collective_broadcast([x], root_ordinal=0)


def _buffers(op: str, size: int, n: int, dtype: torch.dtype = torch.float32
             ) -> tuple[torch.Tensor, torch.Tensor]:
    esz = torch.empty(0, dtype=dtype).element_size()
    k = max(n, size // esz // n * n)  # elements, a multiple of n
    if op == "all_gather":
        return torch.ones(k // n, dtype=dtype), torch.empty(k, dtype=dtype)
    if op == "reduce_scatter":
        return torch.ones(k, dtype=dtype), torch.empty(k // n, dtype=dtype)
    return torch.ones(k, dtype=dtype), torch.empty(0, dtype=dtype)


def _block(fn: Callable[[], Any], reps: int, barrier: Callable[[], None]) -> float:
    """Seconds per call over a block of ``reps`` back-to-back calls."""
    barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _single(fn: Callable[[], Any], barrier: Callable[[], None], idle: float = 0.0) -> float:
    """Seconds of one call made right after a barrier, or ``idle`` seconds
    after it (every rank sleeps as long: the call then meets cold caches
    and ranks that gave their cores away)."""
    barrier()
    if idle:
        time.sleep(idle)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(ops: list[str], sizes: list[int], budget: float, peer: Any, front: str = "xla",
        group: Any = None, dtype: torch.dtype = torch.float32, idle: float = 500e-6,
        ) -> list[dict[str, Any]]:
    """Times every op at every size for ringlet and ``peer``; returns rows."""
    n = ringlet.world_size()
    rows = []
    for op in ops:
        if op not in OPS:
            raise SystemExit(f"unknown op {op!r}: one of {', '.join(OPS)}")
        for size in sizes:
            x, out = _buffers(op, size, n, dtype)
            y, out2 = x.clone(), out.clone()
            ours, theirs = _ours(op, x, out, front, group), peer.call(op, y, out2)
            ours()
            theirs()  # warm-up (page faults, connections)
            iters = _iters(size, budget)
            reps = max(1, iters // 10)
            a, b = [], []
            for _ in range(max(5, iters // reps)):
                a.append(_block(ours, reps, ringlet.barrier))
                b.append(_block(theirs, reps, peer.barrier))
            la, lb, ia, ib = [], [], [], []
            if size <= _LATENCY_MAX:
                for _ in range(max(20, min(200, iters))):
                    la.append(_single(ours, ringlet.barrier))
                    lb.append(_single(theirs, peer.barrier))
                for _ in range(20 if idle else 0):
                    ia.append(_single(ours, ringlet.barrier, idle))
                    ib.append(_single(theirs, peer.barrier, idle))
            ta, tb = statistics.median(a), statistics.median(b)
            f = _bus_factor(op, n)
            rows.append({
                "op": op, "bytes": size, "ringlet_us": ta * 1e6, "peer_us": tb * 1e6,
                "ringlet_lat_us": statistics.median(la) * 1e6 if la else None,
                "peer_lat_us": statistics.median(lb) * 1e6 if lb else None,
                "ringlet_idle_us": statistics.median(ia) * 1e6 if ia else None,
                "peer_idle_us": statistics.median(ib) * 1e6 if ib else None,
                "ringlet_algbw": size / ta / 1e9, "ringlet_busbw": size / ta * f / 1e9,
                "peer_busbw": size / tb * f / 1e9,
            })
    return rows


def first_calls(size: int, peer: Any, calls: int = 1150, front: str = "xla", group: Any = None,
                dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """The first ``calls`` all_reduce calls of ``size`` bytes after start-up,
    each right after a barrier, ringlet's and the peer's taking turns (as a
    harness that times one size per launch sees them). Returns the medians of
    calls 0-149 and of the last 150 (steady state), in µs."""
    x, out = _buffers("all_reduce", size, ringlet.world_size(), dtype)
    y, out2 = x.clone(), out.clone()
    ours, theirs = _ours("all_reduce", x, out, front, group), peer.call("all_reduce", y, out2)
    a, b = [], []
    for _ in range(calls):
        a.append(_single(ours, ringlet.barrier))
        b.append(_single(theirs, peer.barrier))
    k = min(150, calls // 2)
    return {
        "bytes": size, "calls": calls,
        "ringlet_first_us": statistics.median(a[:k]) * 1e6,
        "ringlet_steady_us": statistics.median(a[-k:]) * 1e6,
        "peer_first_us": statistics.median(b[:k]) * 1e6,
        "peer_steady_us": statistics.median(b[-k:]) * 1e6,
    }


def first_table(r: dict[str, float], peer: str, init_s: tuple[float, float]) -> str:
    """Renders :func:`first_calls`' medians and the start-up times."""
    k = min(150, int(r["calls"]) // 2)
    last = f"{int(r['calls']) - k}-{int(r['calls']) - 1}"
    return "\n".join([
        f"first calls after start-up: all_reduce of {_fmt_size(int(r['bytes']))}, each right "
        f"after a barrier, taking turns",
        "",
        f"| library | start-up ms | calls 0-{k - 1} µs | calls {last} µs | first / steady |",
        "|---|---:|---:|---:|---:|",
        f"| ringlet | {init_s[0] * 1e3:.1f} | {r['ringlet_first_us']:.2f} | "
        f"{r['ringlet_steady_us']:.2f} | {r['ringlet_first_us'] / r['ringlet_steady_us']:.2f} |",
        f"| {peer} | {init_s[1] * 1e3:.1f} | {r['peer_first_us']:.2f} | "
        f"{r['peer_steady_us']:.2f} | {r['peer_first_us'] / r['peer_steady_us']:.2f} |",
        "",
        f"ringlet / {peer} over the first calls: "
        f"{r['peer_first_us'] / r['ringlet_first_us']:.2f}x",
    ])


def table(rows: list[dict[str, Any]], n: int, transport: str, peer: str,
          front: str = "xla", dtype: str = "float32") -> str:
    """Renders the rows as a Markdown table."""
    lines = [
        f"world size {n}, ringlet transport {transport}, front end {front}, against {peer}, "
        f"{dtype}",
        "",
        f"| op | size | ringlet µs | {peer} µs | ringlet µs after barrier | {peer} µs after "
        f"barrier | ringlet µs after idle | {peer} µs after idle | ringlet algbw GB/s | "
        f"ringlet busbw GB/s | {peer} busbw GB/s | busbw ringlet/{peer} |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lat = (f"{r['ringlet_lat_us']:.1f} | {r['peer_lat_us']:.1f}"
               if r["ringlet_lat_us"] is not None else "- | -")
        lat += (f" | {r['ringlet_idle_us']:.1f} | {r['peer_idle_us']:.1f}"
                if r.get("ringlet_idle_us") is not None else " | - | -")
        lines.append(
            f"| {r['op']} | {_fmt_size(int(r['bytes']))} | {r['ringlet_us']:.1f} | "
            f"{r['peer_us']:.1f} | {lat} | {r['ringlet_algbw']:.2f} | "
            f"{r['ringlet_busbw']:.2f} | {r['peer_busbw']:.2f} | "
            f"{r['ringlet_busbw'] / r['peer_busbw']:.2f}x |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str, peer: str) -> None:
    """Writes a PNG of busbw against message size (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for op in sorted({str(r["op"]) for r in rows}):
        mine = [r for r in rows if r["op"] == op]
        xs = [r["bytes"] for r in mine]
        ax.plot(xs, [r["ringlet_busbw"] for r in mine], marker="o", label=f"ringlet {op}")
        ax.plot(xs, [r["peer_busbw"] for r in mine], marker="x", ls="--", label=f"{peer} {op}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _c10d_group(against: str) -> Any:
    """A ``"ringlet"`` process group over every rank: a new group beside gloo's
    default one, or (under mpirun) the default group itself."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.new_group(backend="ringlet")
    port = int(os.environ.get("MASTER_PORT", "29555")) + 1
    dist.init_process_group(
        "ringlet", init_method=f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}",
        rank=ringlet.get_ordinal(), world_size=ringlet.world_size(),
    )
    return None


def _start(against: str) -> tuple[Any, tuple[float, float]]:
    """Initialises ringlet and returns the peer library to time it against:
    Open MPI (``"mpi"``, ranks from mpirun) or gloo (``"gloo"``, under
    torchrun), with the seconds each start-up took (ringlet's, the peer's)."""
    if against == "mpi":
        t0 = time.perf_counter()
        peer: Any = _Mpi()
        t1 = time.perf_counter()
        ringlet.init(
            rank=peer.comm.Get_rank(), world_size=peer.comm.Get_size(),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", "29555")),
        )
        return peer, (time.perf_counter() - t1, t1 - t0)
    t0 = time.perf_counter()
    ringlet.init()
    t1 = time.perf_counter()
    peer = _Gloo()
    return peer, (t1 - t0, time.perf_counter() - t1)


def main() -> None:
    """Entry point of ``python -m ringlet.bench collectives``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ops", default="all_reduce,all_gather")
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="bytes, comma list")
    p.add_argument("--budget", type=float, default=1.0, help="scales the iteration counts")
    p.add_argument("--against", default="gloo", choices=["gloo", "mpi"])
    p.add_argument("--plot", default=None, help="write a PNG of busbw vs size here")
    p.add_argument("--dtype", default="float32",
                   help="element type (float16/bfloat16 need --against gloo: MPI has no "
                        "such reductions)")
    p.add_argument("--idle-us", type=float, default=500.0,
                   help="the 'after idle' column: single calls this long after a barrier "
                        "(0: skip)")
    p.add_argument("--front", default="xla", choices=["xla", "ops", "c10d"],
                   help="ringlet's front end: the torch_xla-style API, torch.ops.ringlet, "
                        "or torch.distributed on a 'ringlet' process group")
    p.add_argument("--busy", type=int, default=0,
                   help="K processes spinning on the CPU beside the job (per host) while it "
                        "is timed: busy cores")
    p.add_argument("--first-calls", type=int, default=1150,
                   help="before anything else, this many all_reduce calls of the first size "
                        "(each after a barrier): the first 150 against the last 150 (0: skip)")
    args = p.parse_args()
    peer, init_s = _start(args.against)
    group = _c10d_group(args.against) if args.front == "c10d" else None
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise SystemExit(f"unknown dtype {args.dtype!r}")
    sizes = [int(s) for s in args.sizes.split(",")]
    with neighbours(args.busy):
        if args.first_calls:
            first = first_calls(sizes[0], peer, args.first_calls, args.front, group, dtype)
            if ringlet.get_ordinal() == 0:
                print(first_table(first, peer.name, init_s), "\n", flush=True)
        rows = run(args.ops.split(","), sizes, args.budget, peer,
                   args.front, group, dtype, args.idle_us * 1e-6)
    if ringlet.get_ordinal() == 0:
        busy = f", {args.busy} busy process(es) beside the job" if args.busy else ""
        print(table(rows, ringlet.world_size(), ringlet.transport(), peer.name, args.front,
                    args.dtype + busy), flush=True)
        if args.plot:
            plot(rows, args.plot, peer.name)
    if args.front == "c10d" and args.against == "mpi":
        import torch.distributed as dist

        dist.destroy_process_group()
    peer.close()
    ringlet.shutdown()


if __name__ == "__main__":
    main()
