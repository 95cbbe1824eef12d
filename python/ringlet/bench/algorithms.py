"""What each of Bagua's algorithms buys across hosts: ``python -m ringlet.bench
algorithms`` (as root).

The launcher makes hosts of network namespaces joined by tbf rate-limited
links (:mod:`ringlet.bench.netns`, as ``ringlet.bench hosts`` does) and
runs ``torchrun`` inside each. Every rank joins a ``"ringlet"`` process group,
a gloo group of the same ranks and ringlet's Bagua API in the same
processes, then measures, for each way of training:

* ``local``: no communication at all (the floor);
* ``ddp-gloo``, ``ddp-ringlet``: torch's DDP on gloo, on ringlet;
* ``fp16-gloo``, ``powersgd-gloo``: torch DDP on gloo with torch's own
  ``fp16_compress_hook`` and PowerSGD (rank 1) communication hooks;
* ``bytegrad-hook``: torch DDP on ringlet with ringlet's ByteGrad hook
  (:mod:`ringlet.distributed.hooks`, error feedback on);
* ``gradient_allreduce``, ``bytegrad``, ``decentralized``,
  ``low_precision_decentralized``, ``qadam``, ``async``: ``with_bagua`` and
  each of Bagua's algorithms at its defaults (``hierarchical=True`` where it
  has the option; QAdam after a 2-step warm-up, asynchronous averaging every
  500 ms).

``--part steps`` (default): the median training step of an MLP whose
gradients dominate (``--width 2048 --layers 2``: 8.4 M parameters, batch 16),
the ways taking turns in blocks of ``--steps`` steps for ``--rounds`` rounds
(the first round is warm-up); the table gives each way's median step (the
slowest rank's) and its speed-up over ``ddp-gloo`` and ``ddp-ringlet``.

``--part lm``: a character-level transformer LM across slow links (20 Mbit):
DDP against DiLoCo, Streaming DiLoCo (8- and 4-bit) and LocalSGD, eval loss
over time and bytes per host; its own options (:mod:`ringlet.bench.lm`,
``--part lm --help``).

``--part accuracy``: time to accuracy on scikit-learn's digits (shipped with
the package: nothing is downloaded): an MLP (64-512-512-10) trained for
``--epochs`` epochs by each way (SGD with momentum 0.9; QAdam, eps 1e-6,
compressing after ``--qadam-warmup`` steps; asynchronous averaging every 50 ms), test
accuracy (rank 0's replica) after every epoch against the training time so
far; the table gives each way's final accuracy and the time it first came
within a point of ``ddp-gloo``'s final accuracy.

Example:
  sudo python -m ringlet.bench algorithms --layout 2,2 --rate 1gbit
  sudo python -m ringlet.bench algorithms --part accuracy --rate 100mbit --plot acc.png
  python -m ringlet.bench algorithms --layout 4 --modes ddp-ringlet,gradient_allreduce,bytegrad
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from . import netns
from .hosts import finish_worker, launch, layout_and_rate, report

PROGRESS = "ringlet.bench algorithms:"
NEED_ROOT = "ringlet.bench algorithms needs root to create network namespaces (run it with sudo)"

STEP_MODES = ("local", "ddp-gloo", "ddp-ringlet", "fp16-gloo", "powersgd-gloo", "bytegrad-hook",
              "gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
              "qadam", "async")
ACCURACY_MODES = ("ddp-gloo", "ddp-ringlet", "bytegrad-hook", "bytegrad", "qadam",
                  "decentralized", "low_precision_decentralized", "async")
BAGUA = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
         "qadam", "async")


def mlp(width: int, layers: int, classes: int = 10, inputs: Optional[int] = None) -> Any:
    """``layers`` Linear(width, width) + ReLU, then a Linear(width, classes)
    head (a first Linear(inputs, width) when ``inputs`` differs)."""
    import torch

    mods: list[Any] = []
    if inputs is not None and inputs != width:
        mods += [torch.nn.Linear(inputs, width), torch.nn.ReLU()]
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(width, classes))
    return torch.nn.Sequential(*mods)


class Way:
    """One way of training a model: ``step(x, y)`` and the hooks around a
    block of steps (asynchronous averaging stops between blocks)."""

    def __init__(self, model: Any, opt: Any, wrapped: Any = None) -> None:
        self.model, self.opt, self.wrapped = model, opt, wrapped

    def step(self, x: Any, y: Any) -> None:
        import torch.nn.functional as F

        self.opt.zero_grad()
        F.cross_entropy(self.model(x), y).backward()
        self.opt.step()

    def begin(self) -> None:
        if self.wrapped is not None:
            self.wrapped.bagua_algorithm.resume(self.wrapped)

    def end(self) -> None:
        if self.wrapped is not None:
            self.wrapped.bagua_algorithm.abort(self.wrapped)


def make_way(mode: str, net: Callable[[], Any], gloo: Any, lr: float, momentum: float = 0.0,
             qadam_warmup: int = 2, sync_interval_ms: int = 500) -> Way:
    """Builds ``mode`` (see the module documentation) on a fresh ``net()``:
    SGD (``lr``, ``momentum``), or QAdam (``lr / 100``, ``qadam_warmup``
    steps of warm-up); asynchronous averaging every ``sync_interval_ms``."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ringlet.bagua.compat as bagua
    from ringlet.distributed import hooks

    torch.manual_seed(0)
    model = net()
    def sgd(params: Any) -> Any:
        return torch.optim.SGD(params, lr=lr, momentum=momentum)

    if mode == "local":
        return Way(model, sgd(model.parameters()))
    if mode in ("ddp-gloo", "fp16-gloo", "powersgd-gloo"):
        import torch.distributed as dist

        gloo = dist.new_group(backend="gloo")  # one per DDP: no two share a gloo queue
        # PowerSGD chains collectives in future callbacks: with several buckets
        # they reach gloo in an order that differs across ranks, so one bucket.
        ddp = DDP(model, process_group=gloo,
                  bucket_cap_mb=1024 if mode == "powersgd-gloo" else 25)
        if mode == "fp16-gloo":
            ddp.register_comm_hook(gloo, default_hooks.fp16_compress_hook)
        elif mode == "powersgd-gloo":
            state = powerSGD_hook.PowerSGDState(process_group=gloo, matrix_approximation_rank=1,
                                                start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return Way(ddp, sgd(ddp.parameters()))
    if mode in ("ddp-ringlet", "bytegrad-hook"):
        ddp = DDP(model)
        if mode == "bytegrad-hook":
            ddp.register_comm_hook(hooks.ByteGradState(), hooks.bytegrad_hook)
        return Way(ddp, sgd(ddp.parameters()))
    algorithms = bagua.algorithms
    if mode == "qadam":
        # eps 1e-6: with the second moment frozen after the warm-up, 1e-8
        # lets quantization noise in the momentum of near-zero-variance
        # weights blow up (the same with exact averaging: QAdam's own trait)
        opt: Any = algorithms.q_adam.QAdamOptimizer(model.parameters(), lr=lr / 100,
                                                    warmup_steps=qadam_warmup, eps=1e-6)
        algorithm: Any = algorithms.q_adam.QAdamAlgorithm(opt)
    elif mode == "async":
        opt = sgd(model.parameters())
        algorithm = algorithms.async_model_average.AsyncModelAverageAlgorithm(
            sync_interval_ms=sync_interval_ms)
    else:
        opt = sgd(model.parameters())
        algorithm = {
            "gradient_allreduce": algorithms.gradient_allreduce.GradientAllReduceAlgorithm,
            "bytegrad": algorithms.bytegrad.ByteGradAlgorithm,
            "decentralized": algorithms.decentralized.DecentralizedAlgorithm,
            "low_precision_decentralized":
                algorithms.decentralized.LowPrecisionDecentralizedAlgorithm,
        }[mode]()
    model = model.with_bagua([opt], algorithm)
    return Way(model, opt, model if mode == "async" else None)


def _steps_part(cfg: dict[str, Any], gloo: Any, rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    width, layers, batch = cfg["width"], cfg["layers"], cfg["batch"]
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    ways: dict[str, Way] = {}
    times: dict[str, list[float]] = {m: [] for m in cfg["modes"]}
    for rnd in range(cfg["rounds"]):
        for mode in cfg["modes"]:
            if mode not in ways:
                ways[mode] = make_way(mode, lambda: mlp(width, layers), gloo, 0.01)
            way = ways[mode]
            dist.barrier(group=gloo)
            way.begin()
            for _ in range(cfg["steps"]):
                t = time.perf_counter()
                way.step(x, y)
                if rnd > 0:
                    times[mode].append(time.perf_counter() - t)
            way.end()
        if rank == 0:
            print(f"{PROGRESS} round {rnd + 1}/{cfg['rounds']} done", flush=True)
    mine = {m: statistics.median(v) * 1e3 for m, v in times.items() if v}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=gloo)
    params = sum(p.numel() for p in mlp(width, layers).parameters())
    return {"median_ms": {m: max(e[m] for e in every) for m in mine},
            "per_rank_ms": every, "parameters": params}


def _accuracy_part(cfg: dict[str, Any], gloo: Any, rank: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits

    world = dist.get_world_size()
    xs, ys = load_digits(return_X_y=True)
    order = torch.randperm(len(ys), generator=torch.Generator().manual_seed(0))
    xs = torch.tensor(xs, dtype=torch.float32)[order] / 16.0
    ys = torch.tensor(ys)[order]
    x_train, y_train = xs[:1400][rank::world], ys[:1400][rank::world]
    x_test, y_test = xs[1400:], ys[1400:]
    curves: dict[str, list[tuple[float, float]]] = {}
    for mode in cfg["modes"]:
        way = make_way(mode, lambda: mlp(cfg["hidden"], 1, 10, 64), gloo, 0.05, momentum=0.9,
                       qadam_warmup=cfg["qadam_warmup"], sync_interval_ms=50)
        dist.barrier(group=gloo)
        way.begin()
        elapsed, curve = 0.0, []
        for _epoch in range(cfg["epochs"]):
            t = time.perf_counter()
            for i in range(0, len(y_train), cfg["batch"]):
                way.step(x_train[i:i + cfg["batch"]], y_train[i:i + cfg["batch"]])
            elapsed += time.perf_counter() - t
            with torch.no_grad():
                acc = float((way.model(x_test).argmax(1) == y_test).float().mean())
            curve.append((elapsed, acc))
        way.end()
        curves[mode] = curve
        if rank == 0:
            print(f"{PROGRESS} {mode}: accuracy {curve[-1][1]:.3f} after {elapsed:.1f} s",
                  flush=True)
    return {"curves": curves}


def worker(out: Path) -> None:
    """One rank of the bench (under the launcher's torchrun inside a host).

    Args:
      out (Path): The launcher's directory (``config.json`` in,
        ``result.json`` out from rank 0).
    """
    import torch
    import torch.distributed as dist

    import ringlet.bagua.compat as bagua

    cfg = json.loads((out / "config.json").read_text())
    torch.set_num_threads(1)
    dist.init_process_group("ringlet")
    gloo = dist.new_group(backend="gloo")
    bagua.init_process_group()
    rank = dist.get_rank()
    part = _steps_part if cfg["part"] == "steps" else _accuracy_part
    result = part(cfg, gloo, rank)
    finish_worker(out, cfg, result, gloo)


def time_to(curve: list[tuple[float, float]], target: float) -> Optional[float]:
    """The training time at which ``curve`` first reached ``target``."""
    return next((t for t, acc in curve if acc >= target), None)


def tables(result: dict[str, Any]) -> str:
    """Markdown tables of a result."""
    cfg = result["config"]
    if len(result["layout"]) == 1:
        head = f"one host, {result['layout'][0]} ranks, torch {result['torch']}"
    else:
        head = (f"{len(result['layout'])} hosts {result['layout']}, link "
                f"{cfg['rate'] or 'raw veth'} each way, torch {result['torch']}")
    lines = [f"`{result.get('command', '')}`", "", head, ""]
    if cfg["part"] == "steps":
        med = result["median_ms"]
        lines += [f"Step of an MLP of {result['parameters'] / 1e6:.1f} M parameters "
                  f"(width {cfg['width']}, {cfg['layers']} hidden layers, batch {cfg['batch']}), "
                  "median of the slowest rank:", "",
                  "| way | step (ms) | vs ddp-gloo | vs ddp-ringlet |", "|---|---:|---:|---:|"]
        for mode in cfg["modes"]:
            if mode not in med:
                continue
            rel = [f"{med[b] / med[mode]:.2f}x" if b in med else "-"
                   for b in ("ddp-gloo", "ddp-ringlet")]
            lines.append(f"| {mode} | {med[mode]:.1f} | {rel[0]} | {rel[1]} |")
        return "\n".join(lines)
    curves = result["curves"]
    ref = curves.get("ddp-gloo") or next(iter(curves.values()))
    target = ref[-1][1] - 0.01
    base = time_to(ref, target)
    h = cfg["hidden"]
    lines += [f"digits, MLP 64-{h}-{h}-10, {cfg['epochs']} epochs, batch {cfg['batch']} "
              f"per rank; target: ddp-gloo's final accuracy - 1 point = {target:.3f}", "",
              "| way | final accuracy | time to target (s) | vs ddp-gloo |",
              "|---|---:|---:|---:|"]
    for mode, curve in curves.items():
        t = time_to(curve, target)
        speed = f"{base / t:.2f}x" if (t and base) else "-"
        lines.append(f"| {mode} | {curve[-1][1]:.3f} | "
                     f"{'not reached' if t is None else f'{t:.2f}'} | {speed} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Draws the result: bars of step times, or accuracy against time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if cfg["part"] == "steps":
        med = result["median_ms"]
        modes = [m for m in cfg["modes"] if m in med]
        ax.barh(modes, [med[m] for m in modes],
                color=["#888" if ("gloo" in m or m == "local") else "#2a7" for m in modes])
        ax.invert_yaxis()
        ax.set_xlabel("median training step (ms)")
    else:
        for mode, curve in result["curves"].items():
            ax.plot([t for t, _ in curve], [a for _, a in curve], marker=".", label=mode)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("test accuracy")
        ax.legend(fontsize=8)
    ax.set_title(f"{len(result['layout'])} hosts {result['layout']}, link {cfg['rate']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    """Entry point of ``python -m ringlet.bench algorithms`` (and, with
    ``--worker DIR``, of each rank under torchrun)."""
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]))
        return
    argv = sys.argv[1:]
    if any(a == "--part=lm" or (a == "--part" and b == "lm")
           for a, b in zip(argv, [*argv[1:], ""])):
        from . import lm  # the LM across slow links: its own options (ringlet.bench.lm)

        lm.main(argv)
        return
    p = argparse.ArgumentParser(prog="python -m ringlet.bench algorithms", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="steps", choices=["steps", "accuracy", "lm"],
                   help="lm: a language model across slow links, with its own options "
                        "(--part lm --help; ringlet.bench.lm)")
    p.add_argument("--layout", default="2,2",
                   help="ranks per host (default 2,2); one number: one host, no namespaces "
                        "(no root needed)")
    p.add_argument("--rate", default=None,
                   help="tbf rate of each host link (default 1gbit for steps, 100mbit for "
                        "accuracy; 'none' for the raw veth)")
    p.add_argument("--modes", default=None, help="comma list of ways (default: all of the part)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=None, help="per rank (default 16)")
    p.add_argument("--steps", type=int, default=5, help="steps per block")
    p.add_argument("--rounds", type=int, default=4, help="rounds of blocks (the first: warm-up)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--qadam-warmup", type=int, default=40,
                   help="QAdam's warm-up steps in the accuracy part (default 40)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--tag", default=netns.PREFIX)
    p.add_argument("--keep", default=None)
    args = p.parse_args()
    steps = args.part == "steps"
    rate = args.rate or ("1gbit" if steps else "100mbit")
    rate = None if netns.parse_rate(rate) is None else rate
    known = STEP_MODES if steps else ACCURACY_MODES
    modes = known if args.modes is None else tuple(m.strip() for m in args.modes.split(","))
    bad = [m for m in modes if m not in STEP_MODES]
    if bad:
        raise SystemExit(f"{PROGRESS} unknown ways {bad}: choose from {', '.join(STEP_MODES)}")
    layout, rate = layout_and_rate(args.layout, rate, args.tag, PROGRESS, NEED_ROOT)
    cfg = {"part": args.part, "layout": layout, "rate": rate, "modes": list(modes),
           "width": args.width, "layers": args.layers,
           "batch": args.batch or 16, "steps": args.steps,
           "rounds": args.rounds, "hidden": args.hidden, "epochs": args.epochs,
           "qadam_warmup": args.qadam_warmup}
    out = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ringlet-bench-alg-"))
    result = launch("ringlet.bench.algorithms", layout, rate, cfg, out, args, PROGRESS)
    report(result, "python -m ringlet.bench algorithms", sys.argv[1:], tables, args.json)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
