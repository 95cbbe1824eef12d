"""The torch.distributed API on a ringlet group against a gloo group of the same
ranks, in the same processes, alternating blocks of back-to-back calls: the
collective table (latency, algbw, busbw by nccl-tests definitions), training
steps of torch DDP and FSDP2 on a model where communication matters, and
(``--what doors``) one all_reduce through every door ringlet has: the native
C++ Backend, the Python ProcessGroup, the engine's in-place call, the C++
operator ``torch.ops.ringlet.all_reduce_`` and DeepSpeed's
``torch.ops.deepspeed.inference_all_reduce_`` (when deepspeed is installed),
beside torch's own floor (a no-op C++ Backend).

Example:
  torchrun --nproc_per_node 2 -m ringlet.bench c10d
  torchrun --nproc_per_node 4 -m ringlet.bench c10d --what ops --budget 1
  torchrun --nproc_per_node 2 -m ringlet.bench c10d --what doors --dtypes float32,bfloat16
  torchrun --nproc_per_node 2 -m ringlet.bench c10d --what train --busy 2 --width 1024 --depth 3
  torchrun --nproc_per_node 2 -m ringlet.bench c10d --what train --loader-workers 2 --no-fsdp
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

import ringlet  # registers the backend
from ringlet.bench.busy import neighbours
from ringlet.core import engine

# torch 2.13 renamed these (the old names warn on every call).
_AG = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_RS = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
OPS = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
       "broadcast"]
# The list forms (one tensor per rank), by --ops: the same bytes as their
# one-tensor forms above (``bytes``: the all-reduce's, the gathered whole).
LIST_OPS = ["all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"]


def _fmt(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _bus(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    return 1.0 if op == "broadcast" else (n - 1) / n


def _block(fn: Callable[[], Any], reps: int, group: Any) -> float:
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _calls(op: str, size: int, n: int, group: Any, async_op: bool = False) -> Callable[[], Any]:
    """One call of ``op`` moving ``size`` bytes on ``group``; with ``async_op``
    issued asynchronously and waited for at once."""
    call = _call(op, size, n, group, async_op)
    return (lambda: call().wait()) if async_op else call


def _call(op: str, size: int, n: int, group: Any, a: bool) -> Callable[[], Any]:
    k = max(n, size // 4 // n * n)  # float32 elements, a multiple of n
    if op == "all_reduce":
        x = torch.ones(k)
        return lambda: dist.all_reduce(x, group=group, async_op=a)
    if op == "all_gather_into_tensor":
        x, out = torch.ones(k // n), torch.empty(k)
        return lambda: _AG(out, x, group=group, async_op=a)
    if op == "reduce_scatter_tensor":
        x, out = torch.ones(k), torch.empty(k // n)
        return lambda: _RS(out, x, group=group, async_op=a)
    if op == "all_to_all_single":
        x, out = torch.ones(k), torch.empty(k)
        return lambda: dist.all_to_all_single(out, x, group=group, async_op=a)
    if op == "broadcast":
        x = torch.ones(k)
        return lambda: dist.broadcast(x, group_src=0, group=group, async_op=a)
    x, parts = torch.ones(k // n), [torch.empty(k // n) for _ in range(n)]
    mine = dist.get_rank(group) if group is not None else dist.get_rank()
    root_parts = parts if mine == 0 else None
    if op == "all_gather":
        return lambda: dist.all_gather(parts, x, group=group, async_op=a)
    if op == "reduce_scatter":
        ins = [torch.ones(k // n) for _ in range(n)]
        return lambda: dist.reduce_scatter(x, ins, group=group, async_op=a)
    if op == "all_to_all":
        ins = [torch.ones(k // n) for _ in range(n)]
        return lambda: dist.all_to_all(parts, ins, group=group, async_op=a)
    if op == "gather":
        return lambda: dist.gather(x, root_parts, group_dst=0, group=group, async_op=a)
    if op == "scatter":
        return lambda: dist.scatter(x, root_parts, group_src=0, group=group, async_op=a)
    raise SystemExit(f"unknown op {op!r}; one of {', '.join(OPS + LIST_OPS)}")


def collectives(ops: list[str], sizes: list[int], budget: float, gloo: Any,
                async_op: bool = False) -> list[dict]:
    """Times each op and size on the ringlet (default) group and on ``gloo``
    (with ``async_op``: each call issued asynchronously, then waited for)."""
    n = dist.get_world_size()
    rows = []
    for op in ops:
        for size in sizes:
            ours, theirs = _calls(op, size, n, None, async_op), _calls(op, size, n, gloo, async_op)
            ours()
            theirs()
            iters = max(5, min(2000, int(budget * 4e8 / size)))
            reps = max(1, iters // 10)
            a, b = [], []
            for _ in range(max(5, iters // reps)):
                a.append(_block(ours, reps, None))
                b.append(_block(theirs, reps, gloo))
            ta, tb = statistics.median(a), statistics.median(b)
            f = _bus(op, n)
            rows.append({"op": op, "bytes": size, "ours": ta * 1e6, "gloo": tb * 1e6,
                         "algbw": size / ta / 1e9, "busbw": size / ta * f / 1e9,
                         "gloo_busbw": size / tb * f / 1e9})
    return rows


def overhead(reps: int = 10000) -> dict[str, float]:
    """4 KiB all_reduce: the engine call alone on the group's own communicator
    vs ``dist.all_reduce`` through the backend, alternating blocks (µs)."""
    from ringlet.distributed.c10d import python_group

    x = torch.ones(1024)
    dist.all_reduce(x)
    comm = python_group()._world()
    ptr, nbytes = engine.span(x)
    eng, api = [], []
    for _ in range(50):
        eng.append(_block(lambda: comm.all_reduce(ptr, nbytes, "float32", "sum"), reps // 50, None))
        api.append(_block(lambda: dist.all_reduce(x), reps // 50, None))
    e, a = statistics.median(eng), statistics.median(api)
    return {"engine_us": e * 1e6, "backend_us": a * 1e6, "added_us": (a - e) * 1e6}


DOOR_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
DOORS = ["deepspeed op", "ringlet op", "engine call", "group engine", "dist native",
         "dist python", "torch floor", "group engine + floor"]


def _deepspeed_op() -> Optional[Callable[[torch.Tensor], Any]]:
    """DeepSpeed's CPU shared-memory all-reduce (``inference_all_reduce_``,
    SUM only), loaded as DeepSpeed's tensor-parallel inference loads it; None
    when deepspeed is not installed or its op does not build. Its shared
    memory is per host and crashes unless ``LOCAL_SIZE`` is the world size."""
    try:
        os.environ.setdefault("LOCAL_SIZE", str(dist.get_world_size()))
        os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
        from deepspeed.accelerator import get_accelerator

        # DeepSpeed >= 0.16 names the builder ShareMemCommBuilder (older: ShmCommBuilder)
        builder = (get_accelerator().create_op_builder("ShareMemCommBuilder")
                   or get_accelerator().create_op_builder("ShmCommBuilder"))
        if builder is None:
            raise ImportError("no shared-memory comm op builder for this accelerator")
        shm = builder.load()
        shm.initialize(dist.get_world_size(), dist.get_rank())
        op = torch.ops.deepspeed.inference_all_reduce_
    except Exception as e:  # not installed, no compiler, another API
        print(f"rank {dist.get_rank()}: DeepSpeed's op is not available: "
              f"{type(e).__name__}: {e}", file=sys.stderr)
        return None
    return op


def doors(sizes: list[int], dtypes: list[str], rounds: int, budget: float,
          group: Any = None) -> list[dict]:
    """``all_reduce`` (sum, in place) of each size and dtype through every
    door, alternating blocks of back-to-back calls after a barrier, ``rounds``
    rounds, the doors' order shuffled each round (:func:`_round_order`);
    the median µs per call of each door. ``dist native`` and
    ``dist python`` are ``dist.all_reduce`` on a group whose CPU backend is
    the native C++ Backend / the Python ProcessGroup; ``torch floor`` is
    ``dist.all_reduce`` on a C++ Backend that does nothing (torch's own
    wrapper and dispatch: a lower bound for any backend); ``engine call`` is
    ``ringlet.all_reduce(REDUCE_SUM, [t])``; ``ringlet op`` is
    ``torch.ops.ringlet.all_reduce_(t)``. With ``group`` (a ``"ringlet"``
    group made by ``new_group`` beside another default backend) the op names
    it (``all_reduce_(t, "sum", group.group_name)``) and ``dist native`` runs on
    it. ``group engine`` is the engine's call on the communicator of the group
    ``dist native`` runs on; ``group engine + floor`` is that call followed by
    the no-op Backend's ``dist.all_reduce``, so that their difference is
    torch's floor in the conditions of a real call (its wrapper runs right
    after a collective's data went through the caches: at 1 MiB and up that
    costs it several µs more than back to back on its own)."""
    from ringlet.distributed import _native
    from ringlet.distributed.c10d import ProcessGroupRinglet, backend_kind

    ext = _native.build()
    dist.Backend.register_backend(
        "ringlet_python", lambda o, p=None: ProcessGroupRinglet(
            o.store, o.group_rank, o.group_size, o.timeout), extended_api=True, devices=["cpu"])
    python_pg = dist.new_group(backend="ringlet_python")
    gname = group.group_name if group is not None else ""
    floor_pg = None
    if ext is not None:
        dist.Backend.register_backend(
            "ringlet_noop", lambda o, p=None: ext.NoopBackend(o.group_rank, o.group_size),
            extended_api=True, devices=["cpu"])
        floor_pg = dist.new_group(backend="ringlet_noop")
    native = backend_kind(group) == "native"
    ds = _deepspeed_op()
    rows = []
    for name in dtypes:
        dtype = getattr(torch, name)
        for size in sizes:
            x = torch.zeros(size // dtype.itemsize, dtype=dtype)  # sums stay finite
            calls = _door_calls(x, python_pg, floor_pg if native else None, native, ds,
                                group, gname)
            for f in calls.values():
                f()
                f()
            reps = max(5, min(200, int(budget * 2e7 / size)))
            times: dict[str, list[float]] = {k: [] for k in calls}
            for r in range(rounds):
                for k in _round_order(list(calls), r):
                    times[k].append(_block(calls[k], reps, None))
            row = {"dtype": name, "bytes": size,
                   **{k: statistics.median(v) * 1e6 for k, v in times.items()}}
            # Paired within each round (the doors of a round run back to back,
            # so the VM's drift between rounds cancels): the median ratio and
            # difference are steadier than ratios and differences of medians.
            if "deepspeed op" in times:
                row["paired ratio"] = _paired(times, "deepspeed op", "ringlet op", ratio=True)
            if "dist native" in times and "group engine + floor" in times:
                row["paired net"] = _paired(times, "dist native", "group engine + floor")
            rows.append(row)
    return rows


def _round_order(doors: list[str], r: int) -> list[str]:
    """The doors of round ``r`` in a shuffled order, the same on every rank
    (seeded by ``r``): over the rounds each door runs after every other door
    about equally often. A fixed (or merely rotated) order would put each
    door after the same neighbour nearly every round, and a door run after
    the Python group's, whose own communicator and progress thread leave the
    caches cold, would carry that cost every time."""
    order = list(doors)
    random.Random(r).shuffle(order)
    return order


def _paired(times: dict[str, list[float]], a: str, b: str, ratio: bool = False) -> float:
    """The median over rounds of door ``a``'s time over door ``b``'s (``ratio``)
    or minus it (in µs)."""
    pairs = zip(times[a], times[b])
    return statistics.median(x / y if ratio else (x - y) * 1e6 for x, y in pairs)


def _door_calls(x: torch.Tensor, python_pg: Any, floor_pg: Any, native: bool,
                ds: Optional[Callable[[torch.Tensor], Any]], group: Any = None,
                gname: str = "") -> dict[str, Callable[[], Any]]:
    """One in-place sum of ``x`` per door (see :func:`doors`)."""
    op = torch.ops.ringlet.all_reduce_  # looked up once, as DeepSpeed's op (``ds``)
    calls: dict[str, Callable[[], Any]] = {
        "ringlet op": (lambda: op(x, "sum", gname)) if gname else (lambda: op(x)),
        "engine call": lambda: ringlet.all_reduce(ringlet.REDUCE_SUM, [x]),
        "dist python": lambda: dist.all_reduce(x, group=python_pg),
    }
    if native:
        calls["dist native"] = lambda: dist.all_reduce(x, group=group)
    if group is not None or native:
        from ringlet.distributed.c10d import python_group

        comm = python_group(group if group is not None else dist.group.WORLD)._world()
        dt = str(x.dtype).removeprefix("torch.")
        ptr, nbytes = engine.span(x)
        calls["group engine"] = lambda: comm.all_reduce(ptr, nbytes, dt, "sum")
    if floor_pg is not None:
        calls["torch floor"] = lambda: dist.all_reduce(x, group=floor_pg)
        if "group engine" in calls:
            group_engine = calls["group engine"]

            def engine_then_floor() -> None:
                # torch's wrapper in the conditions of a real call: right after
                # the collective's data went through the caches
                group_engine()
                dist.all_reduce(x, group=floor_pg)

            calls["group engine + floor"] = engine_then_floor
    if ds is not None:
        calls["deepspeed op"] = lambda: ds(x)
    return calls


def _doors_table(rows: list[dict], n: int) -> str:
    """The doors result as a markdown table (µs; x: DeepSpeed's time over
    ringlet's op; +µs: dist native over the engine call, and torch's floor)."""
    cols = [d for d in DOORS if any(d in r for r in rows)]
    head = "| dtype | size | " + " | ".join(f"{c} µs" for c in cols)
    head += (" | op vs DeepSpeed | op - engine call | dist native - engine call "
             "| dist native - engine call - floor | floor after the engine call "
             "| dist native - group engine - floor after "
             "| op vs DeepSpeed, paired | dist native - (group engine + floor), paired |")
    lines = [f"all_reduce (sum, in place), world size {n}, median µs per call of alternating "
             "blocks; paired: the median over rounds of each round's ratio or difference",
             "", head, "|---|---|" + "---:|" * (len(cols) + 8)]
    for r in rows:
        cells = [f"{r[c]:.2f}" if c in r else "-" for c in cols]
        ratio = (f"{r['deepspeed op'] / r['ringlet op']:.2f}x" if "deepspeed op" in r else "-")
        op = f"{r['ringlet op'] - r['engine call']:+.2f}"
        extra = (f"{r['dist native'] - r['engine call']:+.2f}" if "dist native" in r else "-")
        net = (f"{r['dist native'] - r['engine call'] - r['torch floor']:+.2f}"
               if "dist native" in r and "torch floor" in r else "-")
        after, net_after = "-", "-"
        if "group engine + floor" in r:
            floor_after = r["group engine + floor"] - r["group engine"]
            after = f"{floor_after:.2f}"
            if "dist native" in r:
                net_after = f"{r['dist native'] - r['group engine'] - floor_after:+.2f}"
        pr = f"{r['paired ratio']:.2f}x" if "paired ratio" in r else "-"
        pn = f"{r['paired net']:+.2f}" if "paired net" in r else "-"
        lines.append(f"| {r['dtype']} | {_fmt(r['bytes'])} | " + " | ".join(cells)
                     + f" | {ratio} | {op} | {extra} | {net} | {after} | {net_after} "
                     f"| {pr} | {pn} |")
    return "\n".join(lines)


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


class _Augmented(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Samples that cost CPU to make (``work_ms`` of small matrix products
    each), as a data-loader worker that decodes and augments images does."""

    def __init__(self, width: int, work_ms: float) -> None:
        self.width, self.work_ms = width, work_ms

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        a = torch.randn(64, 64, generator=g)
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1e3 < self.work_ms:
            a = torch.tanh(a @ a.T / 64)
        return torch.randn(self.width, generator=g) + a.mean()


def _batches(width: int, batch: int, workers: int, work_ms: float) -> Callable[[], torch.Tensor]:
    """The next input batch: a fixed tensor, or (``workers`` > 0) one from a
    real ``DataLoader`` whose worker processes do CPU work per sample."""
    if workers <= 0:
        x = torch.randn(batch, width)
        return lambda: x
    loader = torch.utils.data.DataLoader(
        _Augmented(width, work_ms), batch_size=batch, num_workers=workers,
        persistent_workers=True, prefetch_factor=2)
    it = iter(loader)
    return lambda: next(it)


def training(steps: int, width: int, depth: int, batch: int, gloo: Any,
             loader_workers: int = 0, work_ms: float = 5.0, fsdp2: bool = True) -> list[dict]:
    """Median step time of torch DDP and FSDP2 on ringlet vs gloo; with
    ``loader_workers`` the DDP steps take their inputs from a ``DataLoader``
    whose workers do ``work_ms`` of CPU work per sample (busy cores)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    n = dist.get_world_size()
    x = torch.randn(batch, width)

    def ddp(group: Any) -> Callable[[], None]:
        m = DDP(_model(width, depth), process_group=group)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        data = _batches(width, batch, loader_workers, work_ms)

        def step() -> None:
            opt.zero_grad()
            m(data()).square().mean().backward()
            opt.step()

        return step

    def fsdp(mesh: Any) -> Callable[[], None]:
        m = _model(width, depth)
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()

        return step

    params = sum(p.numel() for p in _model(width, depth).parameters())
    rows = []
    loader = f", DataLoader with {loader_workers} workers" if loader_workers else ""
    cases = [(f"torch DDP{loader}", ddp(None), ddp(gloo))]
    if fsdp2:
        cases.append(("FSDP2 fully_shard", fsdp(init_device_mesh("cpu", (n,))),
                      fsdp(DeviceMesh.from_group(gloo, "cpu"))))
    for name, ours, theirs in cases:
        ours()
        theirs()
        a, b = [], []
        for _ in range(steps):
            a.append(_block(ours, 1, None))
            b.append(_block(theirs, 1, gloo))
        ta, tb = statistics.median(a), statistics.median(b)
        rows.append({"what": name, "params": params, "ours_ms": ta * 1e3, "gloo_ms": tb * 1e3})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--what", default="ops,overhead,train",
                   help="comma list of ops, overhead, train, doors")
    p.add_argument("--dtypes", default="float32,bfloat16", help="doors: comma list")
    p.add_argument("--door-sizes", default=",".join(str(s) for s in DOOR_SIZES),
                   help="doors: bytes, comma list")
    p.add_argument("--rounds", type=int, default=25, help="doors: alternating rounds")
    p.add_argument("--default", default="ringlet", choices=["ringlet", "gloo"],
                   help="doors: the default group's backend; with gloo the doors run on a "
                        "named ringlet group from new_group")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    p.add_argument("--budget", type=float, default=1.0, help="rough seconds per size")
    p.add_argument("--async-op", action="store_true",
                   help="ops: issue each call with async_op=True and wait for it at once")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--busy", type=int, default=0,
                   help="K processes spinning on the CPU beside the job (per host): busy cores")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="train: DDP takes its inputs from a DataLoader with this many worker "
                        "processes, each doing --work-ms of CPU work per sample")
    p.add_argument("--work-ms", type=float, default=5.0, help="train: see --loader-workers")
    p.add_argument("--no-fsdp", action="store_true", help="train: DDP only")
    args = p.parse_args()
    with neighbours(args.busy):
        _run(args)


def _run(args: argparse.Namespace) -> None:
    dist.init_process_group(args.default)
    gloo = dist.new_group(backend="gloo")
    named = dist.new_group(backend="ringlet") if args.default == "gloo" else None
    n, me = dist.get_world_size(), dist.get_rank()
    what = args.what.split(",")
    if "ops" in what:
        rows = collectives(args.ops.split(","), [int(s) for s in args.sizes.split(",")],
                           args.budget, gloo, args.async_op)
        if me == 0:
            print(f"\ntorch.distributed API, world size {n}: ringlet group vs gloo group\n")
            print("| op | size | ringlet µs | gloo µs | ringlet algbw GB/s | ringlet busbw GB/s "
                  "| gloo busbw GB/s | busbw ringlet/gloo |")
            print("|---|---|---:|---:|---:|---:|---:|---:|")
            for r in rows:
                print(f"| {r['op']} | {_fmt(r['bytes'])} | {r['ours']:.1f} | {r['gloo']:.1f} | "
                      f"{r['algbw']:.2f} | {r['busbw']:.2f} | {r['gloo_busbw']:.2f} | "
                      f"{r['gloo'] / r['ours']:.1f}x |")
    if "overhead" in what:
        o = overhead()
        if me == 0:
            print(f"\n4 KiB all_reduce, world size {n}: engine call {o['engine_us']:.2f} µs, "
                  f"dist.all_reduce on ringlet {o['backend_us']:.2f} µs, "
                  f"added by the backend {o['added_us']:.2f} µs")
    if "doors" in what:
        ringlet.init()
        rows = doors([int(s) for s in args.door_sizes.split(",")], args.dtypes.split(","),
                     args.rounds, args.budget, named)
        if me == 0:
            print("\n" + _doors_table(rows, n))
    if "train" in what:
        rows = training(args.steps, args.width, args.depth, args.batch, gloo,
                        args.loader_workers, args.work_ms, not args.no_fsdp)
        if me == 0:
            busy = f", {args.busy} busy process(es) beside the job" if args.busy else ""
            print(f"\ntraining step, world size {n}, batch {args.batch} per rank{busy}\n")
            print("| wrapper | parameters | ringlet ms | gloo ms | speed-up |")
            print("|---|---:|---:|---:|---:|")
            for r in rows:
                print(f"| {r['what']} | {r['params'] / 1e6:.1f} M | {r['ours_ms']:.1f} | "
                      f"{r['gloo_ms']:.1f} | {r['gloo_ms'] / r['ours_ms']:.2f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
