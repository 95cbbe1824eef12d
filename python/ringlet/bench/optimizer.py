"""Optimizer-step benchmark for a model with many small gradients.

Run under torchrun. Every process builds the same model (``--layers``
``Linear(width, width)`` layers: two gradients each, 16 KiB + 256 B at the
default width 64), fills its gradients once, then times whole steps (gradient
averaging + ``optimizer.step()``) for each variant, alternating variant by
variant, sample by sample; rank 0 prints the median step time as a Markdown
table. Each process uses one intra-op thread (``torch.set_num_threads(1)``),
so ranks sharing a few cores do not oversubscribe them:

- ``ringlet optimizer_step (coalesced)``: :func:`ringlet.optimizer_step`, all
  small gradients flattened into one collective call;
- ``ringlet optimizer_step (1 MiB buckets)``: the same with
  ``ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB=1`` (torch_xla's bucketed path);
- ``ringlet all_reduce per gradient``: one :func:`ringlet.all_reduce` call
  per gradient, then ``step()``;
- ``gloo all_reduce per gradient``: one ``torch.distributed.all_reduce`` per
  gradient, then ``step()``;
- ``gloo flatten + one all_reduce``: gloo with coalescing by hand (flatten,
  one call, copy back);
- ``local step only``: ``step()`` with no communication (the floor).

Example:
  torchrun --nproc_per_node 2 -m ringlet.bench optimizer
  torchrun --nproc_per_node 4 -m ringlet.bench optimizer --layers 200 --samples 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import ringlet

BUCKET_ENV = "ALLREDUCE_GRADIENTS_BUCKET_SIZE_MB"


def make_model(layers: int, width: int) -> nn.Module:
    """Builds the benchmark model: ``layers`` ``Linear(width, width)`` in a row.

    Args:
      layers (int): Number of linear layers (two gradients each).
      width (int): Input and output features of every layer.

    Returns:
      The model, with every parameter's ``.grad`` filled (same on every rank).

    Example:
      >>> len(list(make_model(200, 64).parameters()))
      400
    """
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def variants(
    model: nn.Module, opt: torch.optim.Optimizer
) -> dict[str, tuple[Callable[[], None], int]]:
    """The step functions to compare, each with its collective calls per step.

    Args:
      model (nn.Module): Model whose gradients are averaged.
      opt (torch.optim.Optimizer): Optimizer over ``model``'s parameters.

    Returns:
      ``{name: (step function, collective calls per step)}``.

    Example:
      >>> steps = variants(model, opt)
      >>> steps["ringlet optimizer_step (coalesced)"][0]()
    """
    n = ringlet.world_size()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    bucket_calls = _bucket_calls([g.nbytes for g in reversed(grads)], 1)

    def ringlet_coalesced() -> None:
        os.environ.pop(BUCKET_ENV, None)
        ringlet.optimizer_step(opt)

    def ringlet_bucketed() -> None:
        os.environ[BUCKET_ENV] = "1"
        try:
            ringlet.optimizer_step(opt)
        finally:
            os.environ.pop(BUCKET_ENV, None)

    def ringlet_per_grad() -> None:
        for g in grads:
            ringlet.all_reduce(ringlet.REDUCE_SUM, [g], scale=1.0 / n)
        opt.step()

    def gloo_per_grad() -> None:
        for g in grads:
            dist.all_reduce(g)
            g.div_(n)
        opt.step()

    def gloo_flat() -> None:
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(n)
        for g, f in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(f)
        opt.step()

    def local_only() -> None:
        opt.step()

    return {
        "ringlet optimizer_step (coalesced)": (ringlet_coalesced, 1),
        "ringlet optimizer_step (1 MiB buckets)": (ringlet_bucketed, bucket_calls),
        "ringlet all_reduce per gradient": (ringlet_per_grad, len(grads)),
        "gloo all_reduce per gradient": (gloo_per_grad, len(grads)),
        "gloo flatten + one all_reduce": (gloo_flat, 1),
        "local step only": (local_only, 0),
    }


def _bucket_calls(sizes: list[int], cap_mb: int) -> int:
    """Collective calls of torch_xla's gradient bucketing for ``sizes``."""
    cap, total, calls, open_bucket = cap_mb << 20, 0, 0, False
    for size in sizes:
        total += size
        if total > cap and open_bucket:
            calls, total = calls + 1, size
        open_bucket = True
    return calls + int(open_bucket)


def _time(fn: Callable[[], None], reps: int) -> float:
    """Seconds per call over a block of ``reps`` back-to-back calls."""
    ringlet.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def run(layers: int, width: int, samples: int, reps: int) -> list[dict[str, object]]:
    """Times every variant; returns one row per variant (meaningful on rank 0).

    Args:
      layers (int): Linear layers in the model.
      width (int): Features of every layer.
      samples (int): Timed blocks per variant (the median is reported).
      reps (int): Steps per block.

    Returns:
      Rows with ``variant``, ``calls`` (collectives per step), ``median_ms``.

    Example:
      >>> rows = run(200, 64, samples=20, reps=5)
    """
    model = make_model(layers, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    steps = variants(model, opt)
    for fn, _ in steps.values():  # warm-up: connections, page faults, momentum buffers
        fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(samples):
        for name, (fn, _) in steps.items():
            times[name].append(_time(fn, reps))
    return [
        {"variant": name, "calls": calls, "median_ms": statistics.median(times[name]) * 1e3}
        for name, (_, calls) in steps.items()
    ]


def table(rows: list[dict[str, object]], layers: int, width: int, n: int, transport: str) -> str:
    """Renders the rows as a Markdown table.

    Args:
      rows (list): Output of :func:`run`.
      layers (int): Linear layers in the model.
      width (int): Features of every layer.
      n (int): World size.
      transport (str): ringlet's transport (:func:`ringlet.transport`).

    Returns:
      The table, with a header line naming the setup.

    Example:
      >>> print(table(run(200, 64, 20, 5), 200, 64, 2, "shm"))
    """
    grads = 2 * layers
    kib = layers * (width * width + width) * 4 / 1024
    base = next(r for r in rows if str(r["variant"]).endswith("(coalesced)"))["median_ms"]
    lines = [
        f"world size {n}, ringlet transport {transport}, gloo over loopback TCP; "
        f"{layers} x Linear({width}, {width}): {grads} gradients, {kib:.0f} KiB; SGD momentum",
        "",
        "| variant | collective calls / step | median step ms | vs ringlet coalesced |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        ms = float(r["median_ms"])  # type: ignore[arg-type]
        lines.append(
            f"| {r['variant']} | {r['calls']} | {ms:.3f} | {ms / float(base):.2f}x |"  # type: ignore[arg-type]
        )
    return "\n".join(lines)


def main() -> None:
    """Entry point of ``python -m ringlet.bench optimizer`` (under torchrun)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=200, help="Linear(width, width) layers")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--samples", type=int, default=30, help="timed blocks per variant")
    p.add_argument("--reps", type=int, default=5, help="steps per timed block")
    args = p.parse_args()
    torch.set_num_threads(1)
    ringlet.init()
    dist.init_process_group("gloo")
    rows = run(args.layers, args.width, args.samples, args.reps)
    if ringlet.get_ordinal() == 0:
        print(
            table(rows, args.layers, args.width, ringlet.world_size(), ringlet.transport()),
            flush=True,
        )
    dist.destroy_process_group()
    ringlet.shutdown()


if __name__ == "__main__":
    main()
