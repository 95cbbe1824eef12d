"""Training-step time of a small MLP: ringlet DDP vs torch DDP over gloo, and
torch DDP with ringlet's comm hook.

Run under torchrun. The three train identical copies of the model in the same
processes, alternating block by block (``--steps`` steps each), and rank 0
prints the median step time of each (forward, backward with gradient
averaging, optimizer step) as a markdown table.

Example:
  torchrun --nproc_per_node 2 -m ringlet.bench ddp
  torchrun --nproc_per_node 2 -m ringlet.bench ddp --hidden 2048 --rounds 20
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

import ringlet


def mlp(width: int, hidden: int, depth: int, classes: int) -> torch.nn.Module:
    """The benchmark model: ``depth`` hidden layers of ``hidden`` units.

    Args:
      width (int): Input features.
      hidden (int): Units per hidden layer.
      depth (int): Hidden layers.
      classes (int): Output classes.

    Returns:
      torch.nn.Module: The model.
    """
    layers: list[torch.nn.Module] = [torch.nn.Linear(width, hidden), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(hidden, classes))
    return torch.nn.Sequential(*layers)


def _stepper(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def _block(step: Callable[[], None], steps: int) -> float:
    """Seconds per step over ``steps`` back-to-back steps (ranks aligned first)."""
    ringlet.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps


def run(args: argparse.Namespace) -> dict[str, float]:
    """Times both wrappers; returns the median seconds per step of each.

    Args:
      args (argparse.Namespace): Parsed command line (see :func:`main`).

    Returns:
      dict[str, float]: median step seconds of ``"ringlet"`` (ringlet's DDP),
      ``"torch"`` (torch DDP over gloo) and ``"hook"`` (torch DDP with
      :func:`ringlet.parallel.comm_hooks.allreduce_hook`).
    """
    torch.manual_seed(0)
    base = mlp(args.width, args.hidden, args.depth, args.classes)
    g = torch.Generator().manual_seed(ringlet.get_ordinal())
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, args.classes, (args.batch,), generator=g)
    ours = ringlet.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=args.bucket_cap_mb)
    theirs = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(base), bucket_cap_mb=args.bucket_cap_mb
    )
    hooked = torch.nn.parallel.DistributedDataParallel(
        copy.deepcopy(base), bucket_cap_mb=args.bucket_cap_mb
    )
    hooks = ringlet.parallel.comm_hooks
    hooked.register_comm_hook(hooks.AllReduceState(), hooks.allreduce_hook)
    steppers = {
        "ringlet": _stepper(ours, x, y),
        "torch": _stepper(theirs, x, y),
        "hook": _stepper(hooked, x, y),
    }
    for step in steppers.values():  # warm up
        _block(step, max(1, args.steps // 2))
    times: dict[str, list[float]] = {k: [] for k in steppers}
    for r in range(args.rounds):
        order = list(steppers) if r % 2 == 0 else list(steppers)[::-1]
        for k in order:
            times[k].append(_block(steppers[k], args.steps))
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    """Command line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512, help="input features")
    ap.add_argument("--hidden", type=int, default=1024, help="units per hidden layer")
    ap.add_argument("--depth", type=int, default=4, help="hidden layers")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=10, help="timed blocks per wrapper")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: keep)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ringlet.init()
    dist.init_process_group("gloo")
    try:
        med = run(args)
    finally:
        dist.destroy_process_group()
    if ringlet.get_ordinal() == 0:
        params = sum(
            p.numel() for p in mlp(args.width, args.hidden, args.depth, args.classes).parameters()
        )
        print(
            f"MLP {args.width}-{'x'.join([str(args.hidden)] * args.depth)}-{args.classes}, "
            f"{params / 1e6:.2f} M parameters ({params * 4 / 2**20:.1f} MiB of gradients), "
            f"batch {args.batch}/rank, {ringlet.world_size()} ranks, "
            f"transport {ringlet.transport()}, bucket cap {args.bucket_cap_mb} MiB, "
            f"median of {args.rounds} blocks of {args.steps} steps\n"
        )
        print("| wrapper | step time (ms) | relative |")
        print("| --- | ---: | ---: |")
        labels = {
            "ringlet": "ringlet DDP",
            "torch": "torch DDP (gloo)",
            "hook": "torch DDP + ringlet comm hook",
        }
        for k, label in labels.items():
            print(f"| {label} | {med[k] * 1e3:.2f} | {med[k] / med['torch']:.2f} |")
    ringlet.shutdown()


if __name__ == "__main__":
    main()
