"""Checkpoint throughput: ringlet.checkpoint on N ranks vs torch.save / torch.load on one rank.

Every rank builds its share of a state dict of ``--size-mb`` MiB (``--tensors``
float32 tensors, each split by rows over the ranks). One repetition, in this
order, separated by barriers:

1. ``ringlet.checkpoint.save`` of the sharded state dict on every rank (each rank
   writes its half), timed from a barrier to a barrier;
2. ``ringlet.checkpoint.load`` of it into empty shards, same timing;
3. ``torch.save`` of the same full state dict on rank 0 (flushed and fsynced,
   as ringlet's save is, unless ``--torch-no-fsync``);
4. ``torch.load`` of that file on rank 0.

The table reports medians over ``--reps`` repetitions; GB/s is the state dict
size (10^9 bytes per GB) over the median time. Both loads read files that the
preceding save has just written, so they usually come from the page cache.

Run:
    torchrun --nproc_per_node 2 -m ringlet.bench checkpoint --size-mb 1024
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

import ringlet

from ..checkpoint.mapping import ShardedTensor
from ..checkpoint.serialization import load, save

ROW = 1024  # float32 elements per row: 4 KiB


def _shard(index: int, rank: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * index + rank)
    return torch.randn(rows, ROW, generator=gen)


def _timed(fn: Callable[[], object]) -> float:
    ringlet.barrier()
    start = time.perf_counter()
    fn()
    ringlet.barrier()
    return time.perf_counter() - start


def _torch_save(state: dict[str, torch.Tensor], path: str, fsync: bool) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark under torchrun and print a markdown table on rank 0.

    Args:
        argv (Optional[List[str]]): command line arguments (default ``sys.argv``).

    Returns:
        None

    Example:
        >>> # torchrun --nproc_per_node 2 -m ringlet.bench checkpoint --size-mb 16
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=256.0,
                        help="size of the whole state dict in MiB (default 256)")
    parser.add_argument("--tensors", type=int, default=8,
                        help="number of tensors in the state dict (default 8)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    parser.add_argument("--dir", default=None,
                        help="where to write (default: a new temporary directory)")
    parser.add_argument("--torch-no-fsync", action="store_true",
                        help="do not fsync the torch.save file")
    args = parser.parse_args(argv)

    ringlet.init()
    rank, world = ringlet.get_ordinal(), ringlet.world_size()
    total_rows = max(world, int(args.size_mb * 2**20 / (4 * ROW * args.tensors)))
    rows = -(-total_rows // world)  # rows per rank and tensor
    nbytes = args.tensors * rows * world * ROW * 4

    root = args.dir
    if root is None:
        made = tempfile.mkdtemp(prefix="ringlet-ckpt-bench-") if rank == 0 else ""
        root = ringlet.rendezvous("bench.dir", made.encode())[0].decode()
    os.makedirs(root, exist_ok=True)

    local = {f"t{i}": _shard(i, rank, rows) for i in range(args.tensors)}
    sharded = {
        k: ShardedTensor.from_rank_offsets(k, v, (0, rank, world)) for k, v in local.items()
    }
    full: dict[str, torch.Tensor] = {}
    if rank == 0:
        full = {f"t{i}": torch.cat([_shard(i, r, rows) for r in range(world)])
                for i in range(args.tensors)}
    torch_file = os.path.join(root, "torch_full.pt")

    times: dict[str, list[float]] = {"save": [], "load": [], "torch.save": [], "torch.load": []}
    for rep in range(args.reps):
        path = os.path.join(root, f"ringlet_{rep}")
        times["save"].append(_timed(lambda path=path: save(sharded, path, progress=False)))
        target = {
            k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v), (0, rank, world))
            for k, v in local.items()
        }
        times["load"].append(_timed(lambda path=path, target=target: load(target, path,
                                                                          progress=False)))
        if rep == 0:
            for k, v in local.items():
                if not torch.equal(target[k].data, v):
                    raise RuntimeError(f"rank {rank}: {k} did not load back bit-exact")
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            start = time.perf_counter()
            _torch_save(full, torch_file, not args.torch_no_fsync)
            times["torch.save"].append(time.perf_counter() - start)
            start = time.perf_counter()
            back = torch.load(torch_file, weights_only=True)
            times["torch.load"].append(time.perf_counter() - start)
            del back
            os.remove(torch_file)
        ringlet.barrier()

    if rank == 0:
        fsync_note = "" if args.torch_no_fsync else " + fsync"
        rows_out = [
            ("ringlet.checkpoint.save", world, "save"),
            (f"torch.save{fsync_note}", 1, "torch.save"),
            ("ringlet.checkpoint.load", world, "load"),
            ("torch.load", 1, "torch.load"),
        ]
        print(f"\nstate dict: {args.tensors} float32 tensors, {nbytes / 2**20:.1f} MiB, "
              f"{args.reps} repetitions, directory {root}\n")
        print("| operation | ranks | median time (s) | GB/s | vs torch |")
        print("|---|---:|---:|---:|---:|")
        for name, ranks, key in rows_out:
            med = statistics.median(times[key])
            base = statistics.median(times["torch." + key.split(".")[-1]])
            print(f"| {name} | {ranks} | {med:.4f} | {nbytes / med / 1e9:.2f} | "
                  f"{base / med:.2f}x |")
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    ringlet.shutdown()


if __name__ == "__main__":
    main()
