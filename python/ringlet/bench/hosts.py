"""ringlet across hosts against gloo, on hosts made of network namespaces:
``python -m ringlet.bench hosts`` (as root).

The launcher makes H hosts (:mod:`ringlet.bench.netns`: two joined by a veth
pair, three or more on a bridge), limits every host's link to ``--rate`` each
way with tbf (``--rate none``: the raw veth), and starts ``torchrun --nnodes H
--nproc_per_node L_h --node_rank h`` inside each host (``RINGLET_HOST_ID``,
``GLOO_SOCKET_IFNAME`` per host). Every rank joins a ``"ringlet"`` process
group (the default group), a gloo group of the same ranks, and
``ringlet.init()`` for the torch_xla-style API, all in the same processes.

For each op and size the three take turns, sample by sample (a sample is a
block of back-to-back calls after a barrier; its time is the slowest rank's),
and the tables show medians: torch.distributed on ringlet, the torch_xla-style
call on ringlet (``xla``), torch.distributed on gloo. Before timing, the first
call of each is checked against torch's result; a wrong one is reported as
such and never timed.

Sizes (``S``, nccl-tests' "bytes": the larger of input and output, the whole
tensor; for all_to_all_single the input of one rank); algbw = S / time, busbw
= algbw x 2(p-1)/p for all_reduce, x (p-1)/p for all_gather, reduce_scatter
and all_to_all, x 1 for broadcast (p ranks in all).

Link limit: the bytes that must cross the busiest host link in one direction,
divided by the rate (bytes/s = gbit x 1e9 / 8), with H hosts, L_h ranks on
host h and p = sum of L_h:

* all_reduce: 2 S (H-1) / H (S for 2 hosts): each host sends the partial sums
  of the (H-1)/H of the tensor that the other hosts reduce, and the reduced
  1/H it owns to each of the H-1 others; the ranks per host do not enter;
* all_gather_into_tensor, reduce_scatter_tensor: max over h of S (p - L_h) / p
  (host h receives, or sends, every other host's share);
* broadcast: S (the root's host sends everything once);
* all_to_all_single: max over h of S L_h (p - L_h) / p (each of the L_h ranks
  sends the blocks of the p - L_h ranks elsewhere).

"% of limit" is limit time / measured time: 100% is the link's speed.

Example:
  sudo python -m ringlet.bench hosts
  sudo python -m ringlet.bench hosts --layout 1,3 --rate 1gbit --ops all_reduce
  sudo python -m ringlet.bench hosts --hosts 3 --per-host 2 --json out.json --plot out.png
  sudo python -m ringlet.bench hosts --rate none --sizes 4096,1048576 --budget 0.2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from . import netns

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
       "all_to_all_single")
"""The ops, by their torch.distributed names."""

ALIASES = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
           "all_to_all": "all_to_all_single"}

SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]

BACKENDS = ("ringlet", "xla", "gloo")
"""torch.distributed on a ringlet group, the torch_xla-style API, gloo."""

NEED_ROOT = "ringlet.bench hosts needs root to create network namespaces (run it with sudo)"
PROGRESS = "ringlet.bench hosts:"
_MAX_REPS = 100
_PORT = 29500  # in a namespace of our own: always free


# --- what the link allows ----------------------------------------------------------------


def busiest_link_bytes(op: str, nbytes: float, layout: list[int]) -> float:
    """Bytes that must cross the busiest host link, in one direction, for one
    call of ``op`` (the formulas in the module docstring).

    Args:
      op (str): One of :data:`OPS`.
      nbytes (float): S: the larger of input and output (the whole tensor);
        for ``all_to_all_single`` the input of one rank.
      layout (list[int]): Ranks on each host.

    Returns:
      The bytes; 0 for one host.

    Example:
      >>> busiest_link_bytes("all_reduce", 1 << 20, [2, 2])
      1048576.0
      >>> busiest_link_bytes("all_gather_into_tensor", 4096, [1, 3])
      3072.0
    """
    hosts, p = len(layout), sum(layout)
    if hosts < 2:
        return 0.0
    s = float(nbytes)
    if op == "all_reduce":
        return 2 * s * (hosts - 1) / hosts
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return max(s * (p - lh) / p for lh in layout)
    if op == "broadcast":
        return s
    if op == "all_to_all_single":
        return max(s * lh * (p - lh) / p for lh in layout)
    raise ValueError(f"unknown op {op!r}: one of {', '.join(OPS)}")


def link_limit_s(op: str, nbytes: float, layout: list[int],
                 rate: Optional[float]) -> Optional[float]:
    """The shortest time the links allow for one call.

    Args:
      op (str): One of :data:`OPS`.
      nbytes (float): S, as in :func:`busiest_link_bytes`.
      layout (list[int]): Ranks on each host.
      rate (float, optional): Each host link's rate per direction in bytes/s
        (:func:`ringlet.bench.netns.parse_rate`); ``None`` for no limit.

    Returns:
      Seconds, or ``None`` without a rate.

    Example:
      >>> link_limit_s("all_reduce", 64 << 20, [2, 2], 2e9 / 8)   # 64 MiB, 2 Gbit
      0.268435456
    """
    if rate is None:
        return None
    return busiest_link_bytes(op, nbytes, layout) / rate


def bus_factor(op: str, p: int) -> float:
    """nccl-tests' busbw / algbw for ``op`` on ``p`` ranks.

    Args:
      op (str): One of :data:`OPS`.
      p (int): Ranks.

    Returns:
      2(p-1)/p for all_reduce, 1 for broadcast, (p-1)/p otherwise.

    Example:
      >>> bus_factor("all_reduce", 4)
      1.5
    """
    if op == "all_reduce":
        return 2 * (p - 1) / p
    return 1.0 if op == "broadcast" else (p - 1) / p


def parse_layout(layout: Optional[str], hosts: Optional[int], per_host: Optional[int]
                 ) -> list[int]:
    """Ranks per host from the command line.

    Args:
      layout (str, optional): ``"2,2"``, ``"1,3"``, ``"2,2,2"``.
      hosts (int, optional): Number of hosts (default 2; must agree with
        ``layout`` when both are given).
      per_host (int, optional): Ranks on every host (default 2).

    Returns:
      One count per host.

    Example:
      >>> parse_layout(None, 3, None)
      [2, 2, 2]
    """
    if layout:
        counts = [int(x) for x in layout.split(",") if x.strip()]
        if per_host is not None:
            raise ValueError("give --layout or --per-host, not both")
        if hosts is not None and hosts != len(counts):
            raise ValueError(f"--hosts {hosts} but --layout {layout} names {len(counts)} hosts")
    else:
        counts = [2 if per_host is None else per_host] * (2 if hosts is None else hosts)
    if len(counts) < 2 or min(counts) < 1:
        raise ValueError(f"need at least 2 hosts with at least 1 rank each, got {counts}")
    return counts


def namespaces_ready(rate: Optional[str], tag: str, progress: str, need_root: str) -> list[str]:
    """Ends the program (``SystemExit``) unless network namespaces can be
    made here (root, iproute2, and ``tc`` for a ``rate``), then deletes the
    ones an earlier run with this ``tag`` left.

    Args:
      rate (str, optional): The host links' tbf rate (None: the raw veth).
      tag (str): The namespaces' name prefix (``--tag``).
      progress (str): The prefix of the bench's messages.
      need_root (str): What to say without root.

    Returns:
      list[str]: The namespaces it deleted.

    Example:
      >>> namespaces_ready("1gbit", netns.PREFIX, PROGRESS, NEED_ROOT)
      []
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise SystemExit(need_root)
    why = netns.why_not(rate is not None)
    if why:
        raise SystemExit(f"{progress} {why}")
    return netns.cleanup_stale(tag)


def layout_and_rate(layout: str, rate: Optional[str], tag: str, progress: str,
                    need_root: str) -> tuple[list[int], Optional[str]]:
    """The ``--layout`` of a bench that runs on one host too: one number is
    one host (no namespaces, no link rate), a list is ranks per host, in
    namespaces that :func:`namespaces_ready` makes sure of. A bad layout ends
    the program (``SystemExit``).

    Args:
      layout (str): ``"4"`` (one host) or ``"2,2"``.
      rate (str, optional): The host links' tbf rate (None: the raw veth).
      tag (str): The namespaces' name prefix (``--tag``).
      progress (str): The prefix of the bench's messages.
      need_root (str): What to say without root.

    Returns:
      tuple: The ranks per host, and the rate (None on one host).

    Example:
      >>> layout_and_rate("4", "1gbit", netns.PREFIX, PROGRESS, NEED_ROOT)
      ([4], None)
    """
    one_host = layout.strip().isdigit()
    try:
        counts = [int(layout)] if one_host else parse_layout(layout, None, None)
    except ValueError as e:
        raise SystemExit(f"{progress} {e}") from None
    if one_host:
        return counts, None
    namespaces_ready(rate, tag, progress, need_root)
    return counts, rate


def parse_ops(ops: str) -> list[str]:
    """Op names from a comma list (``all`` for every op; ``all_gather``,
    ``reduce_scatter`` and ``all_to_all`` are accepted for the c10d names).

    Args:
      ops (str): E.g. ``"all_reduce,all_gather"``.

    Returns:
      Names from :data:`OPS`, in the order given.

    Example:
      >>> parse_ops("all_reduce,all_gather")
      ['all_reduce', 'all_gather_into_tensor']
    """
    if ops.strip() == "all":
        return list(OPS)
    out = []
    for op in (o.strip() for o in ops.split(",") if o.strip()):
        op = ALIASES.get(op, op)
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}: one of {', '.join(OPS)} (or all)")
        out.append(op)
    return out


# --- the worker: one rank, under torchrun, inside a host -----------------------------------


def _elements(op: str, size: int, p: int, esz: int) -> int:
    """Elements of the whole tensor (a multiple of ``p``, at least ``p``)."""
    return max(p, size // esz // p * p)


def _inputs(op: str, k: int, p: int, rank: int, dtype: Any) -> tuple[Any, Any]:
    """This rank's input for an op on ``k`` elements and torch's answer.

    Values are small integers (exact in every dtype, also summed): ``i % m +
    rank`` (``+ m * rank`` for all_to_all, so each block names its sender)."""
    import torch

    m = 8 if torch.empty(0, dtype=dtype).element_size() <= 2 else 256

    def pattern(n: int, start: int = 0) -> torch.Tensor:
        return torch.arange(start, start + n, dtype=torch.int64) % m

    if op == "all_to_all_single":
        b = k // p
        x = (pattern(k) + m * rank).to(dtype)
        want = torch.cat([pattern(b, rank * b) + m * q for q in range(p)]).to(dtype)
        return x, want
    n = k // p if op == "all_gather_into_tensor" else k
    x = (pattern(n) + rank).to(dtype)
    if op == "all_reduce":
        return x, (pattern(k) * p + p * (p - 1) // 2).to(dtype)
    if op == "broadcast":
        return x, pattern(k).to(dtype)
    if op == "all_gather_into_tensor":
        return x, torch.cat([pattern(n) + q for q in range(p)]).to(dtype)
    total = pattern(k) * p + p * (p - 1) // 2  # reduce_scatter_tensor
    return x, total.view(p, -1)[rank].contiguous().to(dtype)


def _call(backend: str, op: str, x: Any, p: int, gloo: Any) -> Callable[[], Any]:
    """One call of ``op`` on ``x`` through ``backend``; it returns the result."""
    import torch
    import torch.distributed as dist

    import ringlet

    ag = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    rs = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    k = x.numel()
    out = torch.empty(k * p if op == "all_gather_into_tensor" else
                      k // p if op == "reduce_scatter_tensor" else
                      k if op == "all_to_all_single" else 0, dtype=x.dtype)
    if backend == "xla":
        if op == "all_reduce":
            return lambda: ringlet.all_reduce(ringlet.REDUCE_SUM, [x])[0]
        if op == "all_gather_into_tensor":
            return lambda: ringlet.all_gather(x, output=out)
        if op == "reduce_scatter_tensor":
            return lambda: ringlet.reduce_scatter(ringlet.REDUCE_SUM, x, 1.0, 0, p, output=out)
        if op == "broadcast":
            return lambda: (ringlet.collective_broadcast([x], root_ordinal=0), x)[1]
        return lambda: ringlet.all_to_all(x, 0, 0, p)
    g = gloo if backend == "gloo" else None  # None: the default group, ringlet's
    if op == "all_reduce":
        return lambda: (dist.all_reduce(x, group=g), x)[1]
    if op == "all_gather_into_tensor":
        return lambda: (ag(out, x, group=g), out)[1]
    if op == "reduce_scatter_tensor":
        return lambda: (rs(out, x, group=g), out)[1]
    if op == "broadcast":
        return lambda: (dist.broadcast(x, src=0, group=g), x)[1]
    return lambda: (dist.all_to_all_single(out, x, group=g), out)[1]


def _barrier(backend: str, gloo: Any) -> None:
    import torch.distributed as dist

    import ringlet

    if backend == "xla":
        ringlet.barrier()
    else:
        dist.barrier(group=gloo if backend == "gloo" else None)


def _max_all(values: list[float], gloo: Any) -> list[float]:
    """Element-wise maximum over every rank (through gloo)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
    return [float(v) for v in t]


def measure_cell(op: str, size: int, budget: float, dtype: Any, gloo: Any,
                 backends: tuple[str, ...] = BACKENDS) -> dict[str, Any]:
    """Times one op at one size for every backend, alternating sample by
    sample (every rank calls it; collective).

    Args:
      op (str): One of :data:`OPS`.
      size (int): S in bytes (rounded down to whole elements, a multiple of
        the world size).
      budget (float): Seconds of timed calls per backend (at least 3 samples
        of one call each, however long they take).
      dtype (torch.dtype): Element type.
      gloo: The gloo process group (also used to agree on counts).
      backends (tuple): Which of :data:`BACKENDS` to time.

    Returns:
      ``{"op", "bytes", "nbytes", "elements", <backend>: {"ok", "samples_ms",
      "median_ms", "reps"}}``; a backend whose first result was wrong has
      ``ok`` False and no samples.

    Example:
      >>> measure_cell("all_reduce", 1 << 20, 1.0, torch.float32, gloo)["ringlet"]["median_ms"]
      8.9
    """
    import torch
    import torch.distributed as dist

    rank, p = dist.get_rank(), dist.get_world_size()
    esz = torch.empty(0, dtype=dtype).element_size()
    k = _elements(op, size, p, esz)
    x0, want = _inputs(op, k, p, rank, dtype)
    xs = {b: x0.clone() for b in backends}
    fns = {b: _call(b, op, xs[b], p, gloo) for b in backends}
    bad = []
    for b in backends:  # first call: connections, page faults, and the check
        _barrier(b, gloo)
        got = fns[b]()
        bad.append(0.0 if torch.equal(got, want) else 1.0)
    del want
    ok = {b: v == 0.0 for b, v in zip(backends, _max_all(bad, gloo))}
    timed = [b for b in backends if ok[b]]
    est = []
    for b in timed:
        xs[b].copy_(x0)
        _barrier(b, gloo)
        t0 = time.perf_counter()
        fns[b]()
        est.append(time.perf_counter() - t0)
    est = _max_all(est, gloo) if timed else []
    reps = {b: max(1, min(_MAX_REPS, int(budget / 10 / max(t, 1e-7))))
            for b, t in zip(timed, est)}
    longest = max((reps[b] * t for b, t in zip(timed, est)), default=1.0)
    rounds = max(3, min(30, int(budget / max(longest, 1e-9))))
    samples: dict[str, list[float]] = {b: [] for b in timed}
    for _ in range(rounds):
        for b in timed:
            if op == "all_reduce":
                xs[b].copy_(x0)  # in place: start each block from the same values
            fn, n = fns[b], reps[b]
            _barrier(b, gloo)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            samples[b].append((time.perf_counter() - t0) / n)
    flat = _max_all([s for b in timed for s in samples[b]], gloo) if timed else []
    cell: dict[str, Any] = {"op": op, "bytes": size, "nbytes": k * esz, "elements": k}
    for b in backends:
        if not ok[b]:
            cell[b] = {"ok": False, "samples_ms": [], "median_ms": None, "reps": 0}
            continue
        mine = [s * 1e3 for s in flat[:rounds]]
        flat = flat[rounds:]
        cell[b] = {"ok": True, "samples_ms": mine, "median_ms": statistics.median(mine),
                   "reps": reps[b]}
    return cell


def worker(out: Path) -> None:
    """One rank of the bench (started by the launcher's torchrun inside a
    host): reads ``out/config.json``, times every cell, and rank 0 writes
    ``out/result.json``.

    Args:
      out (Path): The launcher's directory.

    Example:
      >>> worker(Path("/tmp/ringlet-bench-hosts-x"))   # under torchrun
    """
    import torch
    import torch.distributed as dist

    import ringlet

    cfg = json.loads((out / "config.json").read_text())
    dist.init_process_group("ringlet")
    gloo = dist.new_group(backend="gloo")
    ringlet.init()
    dtype = getattr(torch, cfg["dtype"])
    rank = dist.get_rank()
    cells = []
    for op in cfg["ops"]:
        for size in cfg["sizes"]:
            cell = measure_cell(op, size, cfg["budget"], dtype, gloo)
            cells.append(cell)
            if rank == 0:
                ms = ", ".join(
                    f"{b} " + (f"{cell[b]['median_ms']:.3f} ms" if cell[b]["ok"] else "WRONG")
                    for b in BACKENDS)
                print(f"{PROGRESS} {op} {_fmt_size(size)}: {ms}", flush=True)
    finish_worker(out, cfg, {"transport": ringlet.transport(), "cells": cells}, gloo)


def finish_worker(out: Path, cfg: dict[str, Any], result: dict[str, Any], gloo: Any) -> None:
    """A bench worker's end: rank 0 adds the run's ``config``, ``world``,
    ``host_layout`` and ``torch`` version to ``result`` and writes it to
    ``out/result.json`` (whole or not at all), then every rank waits for the
    others and leaves ringlet and ``torch.distributed``.

    Args:
      out (Path): The launcher's directory.
      cfg (dict): The run's ``config.json``.
      result (dict): What the ranks measured (rank 0's is written).
      gloo (ProcessGroup): The gloo group the ranks wait on.

    Example:
      >>> finish_worker(out, cfg, {"cells": cells}, gloo)   # under torchrun
    """
    import torch
    import torch.distributed as dist

    import ringlet

    if dist.get_rank() == 0:
        result.update(config=cfg, world=dist.get_world_size(),
                      host_layout=ringlet.host_layout(), torch=torch.__version__)
        tmp = out / ".result.json"
        tmp.write_text(json.dumps(result, indent=1))
        tmp.rename(out / "result.json")
    dist.barrier(group=gloo)
    ringlet.shutdown()
    dist.destroy_process_group()


# --- the launcher --------------------------------------------------------------------------


def _fmt_size(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20} MiB"
    if n >= 1 << 10 and n % (1 << 10) == 0:
        return f"{n >> 10} KiB"
    return f"{n} B"


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(procs: list[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    """SIGTERMs every torchrun's process group (torchrun passes it on to its
    workers), then SIGKILLs what is left after ``grace`` seconds; the
    namespaces' teardown kills any worker that outlived its torchrun."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)


def run_hosts(layout: list[int], rate: Optional[str], ops: list[str], sizes: list[int],
              budget: float, dtype: str = "float32", timeout: float = 3600.0,
              tag: str = netns.PREFIX, keep: Optional[Path] = None) -> dict[str, Any]:
    """Makes the hosts, runs the bench in them and returns rank 0's results
    (the launcher's side; needs root).

    Args:
      layout (list[int]): Ranks on each host.
      rate (str, optional): tbf rate of every host link, each way; ``None``
        for the raw veth.
      ops (list[str]): Names from :data:`OPS`.
      sizes (list[int]): S in bytes.
      budget (float): Seconds of timed calls per op, size and backend.
      dtype (str): A torch dtype name. Default: ``"float32"``
      timeout (float): Seconds before every process is killed. Default: 3600
      tag (str): Namespace name prefix. Default: ``"rlbench"``
      keep (Path, optional): Keep the run's directory (config, logs) here.

    Returns:
      The result dict (``config``, ``host_layout``, ``cells``, ...) with
      ``layout``, ``rate_bytes_per_s``, ``cpus``, ``loadavg`` (1-minute,
      before and after) and ``others_cpu_share`` (the share of the CPUs that
      processes other than the bench's used during the run) added.

    Example:
      >>> r = run_hosts([2, 2], "2gbit", ["all_reduce"], [1 << 20], 1.0)
      >>> r["cells"][0]["gloo"]["median_ms"]
      6.6
    """
    out = Path(tempfile.mkdtemp(prefix="ringlet-bench-hosts-")) if keep is None else keep
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"layout": layout, "rate": rate, "ops": ops, "sizes": sizes, "budget": budget,
           "dtype": dtype}
    result = launch_in_hosts(layout, rate, "ringlet.bench.hosts", cfg, out, timeout, tag,
                             keep is not None, PROGRESS)
    return result


def launch_here(module: str, n: int, cfg: dict[str, Any], out: Path,
                timeout: float) -> dict[str, Any]:
    """One host (``--layout N``): ``torchrun`` on this machine, no namespaces,
    running ``python -m <module> --worker <out>`` with ``cfg`` in
    ``out/config.json``; returns the ``out/result.json`` the ranks wrote.

    Args:
      module (str): The bench module (``ringlet.bench.algorithms``, ...).
      n (int): Ranks.
      cfg (dict): The workers' configuration.
      out (Path): The run's directory.
      timeout (float): Seconds for the whole launch.

    Returns:
      dict: The result, with ``layout`` = ``[n]``.

    Example:
      >>> launch_here("ringlet.bench.lm", 2, cfg, Path("/tmp/run"), 600.0)
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
            "RINGLET_HOST_ID", "GLOO_SOCKET_IFNAME")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(n), "-m", module, "--worker", str(out)]
    res = subprocess.run(argv, env=env, timeout=timeout, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{module}: torchrun failed:\n{res.stdout[-4000:]}{res.stderr[-4000:]}")
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    result["layout"] = [n]
    return result


def launch(module: str, layout: list[int], rate: Optional[str], cfg: dict[str, Any], out: Path,
           args: argparse.Namespace, progress: str) -> dict[str, Any]:
    """A bench's ranks as its command line asks: :func:`launch_here` for one
    host (``layout == [n]``), else :func:`launch_in_hosts` (``args`` gives
    ``timeout``, ``tag`` and ``keep``). Ctrl-C, or a launch that failed or
    ran out of time, ends the program (``SystemExit``).

    Args:
      module (str): The bench module (``ringlet.bench.algorithms``, ...).
      layout (list[int]): Ranks per host.
      rate (str, optional): The host links' tbf rate (None: the raw veth).
      cfg (dict): The workers' configuration.
      out (Path): The run's directory.
      args (argparse.Namespace): The parsed command line.
      progress (str): The prefix of its progress lines.

    Returns:
      dict: The result rank 0 wrote.

    Example:
      >>> launch("ringlet.bench.lm", [2], None, cfg, Path("/tmp/run"), args, PROGRESS)
    """
    try:
        if len(layout) == 1:
            return launch_here(module, layout[0], cfg, out, args.timeout)
        return launch_in_hosts(layout, rate, module, cfg, out, args.timeout, args.tag,
                               args.keep is not None, progress)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    except (RuntimeError, TimeoutError) as e:
        raise SystemExit(str(e)) from None


def report(result: dict[str, Any], command: str, argv: list[str],
           tables: Callable[[dict[str, Any]], str], json_path: Optional[str]) -> None:
    """Prints a run's tables and saves its raw result (``--json``), with
    the command line that ran it as ``result["command"]``.

    Args:
      result (dict): The run's result.
      command (str): The bench's command (``python -m ringlet.bench hosts``).
      argv (list[str]): Its arguments.
      tables (Callable): Renders the result as text.
      json_path (str, optional): Where to save it (None: nowhere).

    Example:
      >>> report(result, "python -m ringlet.bench hosts", sys.argv[1:], tables, args.json)
    """
    result["command"] = " ".join([command, *argv])
    print(tables(result), flush=True)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))


def launch_in_hosts(layout: list[int], rate: Optional[str], module: str, cfg: dict[str, Any],
                    out: Path, timeout: float, tag: str, keep: bool, progress: str,
                    extra_env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Makes the hosts, runs ``torchrun -m <module> --worker <out>`` in each
    (``out/config.json`` holds ``cfg``) and returns the ``out/result.json``
    rank 0 wrote, with the run's conditions added (the launcher's side of
    every benchmark across namespace hosts; needs root).

    Args:
      layout (list[int]): Ranks on each host.
      rate (str, optional): tbf rate of every host link, each way.
      module (str): The worker's module (``main()`` handles ``--worker``).
      cfg (dict): Written to ``out/config.json`` for the workers.
      out (Path): The run's directory.
      timeout (float): Seconds before every process is killed.
      tag (str): Namespace name prefix.
      keep (bool): Keep ``out`` after a successful run.
      progress (str): Prefix of the lines rank 0 prints to echo.
      extra_env (dict, optional): More environment for the workers.

    Returns:
      The result dict with ``layout``, ``rate_bytes_per_s``, ``cpus``,
      ``loadavg`` and ``others_cpu_share`` added.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    procs: list[subprocess.Popen[bytes]] = []
    logs = [out / f"host{h}.log" for h in range(len(layout))]
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items()
            if k not in drop and not k.startswith("TORCHELASTIC_")}
    base.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(extra_env or {}))
    base.setdefault("RINGLET_TIMEOUT", "300")
    ok = False
    load = [os.getloadavg()[0]]
    cpu0 = _cpu_snapshot()
    try:
        with netns.Hosts(len(layout), rate, tag=tag) as net:
            try:
                for h, lh in enumerate(layout):
                    env = {**base, "RINGLET_HOST_ID": f"host{h}",
                           "GLOO_SOCKET_IFNAME": net.ifnames[h]}
                    argv = [
                        *net.exec_argv(h), sys.executable, "-m", "torch.distributed.run",
                        "--nnodes", str(len(layout)), "--nproc_per_node", str(lh),
                        "--node_rank", str(h),
                        "--master_addr", net.addrs[0], "--master_port", str(_PORT),
                        "-m", module, "--worker", str(out)]
                    with open(logs[h], "wb") as log:
                        procs.append(subprocess.Popen(
                            argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True))
                _supervise(procs, logs, time.monotonic() + timeout, progress)
            finally:
                _stop(procs)
        result = json.loads((out / "result.json").read_text())
        load.append(os.getloadavg()[0])
        others = _others_share(cpu0, _cpu_snapshot())
        ok = True
    finally:
        if not keep and ok:
            shutil.rmtree(out, ignore_errors=True)
        elif not ok:
            print(f"{progress} logs kept in {out}", file=sys.stderr)
    result["layout"] = layout
    result["rate_bytes_per_s"] = netns.parse_rate(rate)
    result["loadavg"] = load  # 1-minute load average before and after
    result["cpus"] = os.cpu_count()
    result["others_cpu_share"] = others
    return result


def _cpu_snapshot() -> Optional[tuple[float, float, float]]:
    """(wall seconds, CPU seconds every process on the machine used, CPU
    seconds this process and its waited-for descendants used)."""
    import resource

    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    mine = sum(getattr(resource.getrusage(w), a) for w in (resource.RUSAGE_SELF,
               resource.RUSAGE_CHILDREN) for a in ("ru_utime", "ru_stime"))
    return time.monotonic(), busy, mine


def _others_share(a: Optional[tuple[float, float, float]],
                  b: Optional[tuple[float, float, float]]) -> Optional[float]:
    """The share of the machine's CPUs that other processes used between two
    snapshots (0: the bench had the machine to itself)."""
    if a is None or b is None or b[0] <= a[0]:
        return None
    other = (b[1] - a[1]) - (b[2] - a[2])
    return max(0.0, other / ((b[0] - a[0]) * (os.cpu_count() or 1)))


def _supervise(procs: list[subprocess.Popen[bytes]], logs: list[Path], deadline: float,
               progress: str = PROGRESS) -> None:
    """Waits for every torchrun; echoes rank 0's progress lines (those
    starting with ``progress``) to stderr; raises when one fails or the
    deadline passes."""
    seen = 0
    while True:
        try:
            text = logs[0].read_text(errors="replace")
        except OSError:
            text = ""
        lines = text.splitlines(keepends=True)
        done = [ln for ln in lines if ln.endswith("\n")]
        for ln in done[seen:]:
            if ln.startswith(progress):
                print(ln.rstrip(), file=sys.stderr, flush=True)
        seen = len(done)
        codes = [p.poll() for p in procs]
        failed = [h for h, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            tails = "\n".join(f"--- host {h} (exit {codes[h]}) ---\n{_tail(logs[h])}"
                              for h in range(len(procs)))
            raise RuntimeError(f"{progress} torchrun failed on host(s) {failed}\n{tails}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- host {h} ---\n{_tail(logs[h])}" for h in range(len(procs)))
            raise TimeoutError(f"{progress} not done within the timeout\n{tails}")
        time.sleep(0.2)  # supervising child processes, bounded by the deadline


# --- reporting ------------------------------------------------------------------------------


def _cell_stats(cell: dict[str, Any], layout: list[int], rate: Optional[float]
                ) -> dict[str, Optional[float]]:
    p = sum(layout)
    s = float(cell["nbytes"])
    limit = link_limit_s(cell["op"], s, layout, rate)
    st: dict[str, Optional[float]] = {"limit_ms": None if limit is None else limit * 1e3}
    for b in BACKENDS:
        ms = cell.get(b, {}).get("median_ms")
        st[f"{b}_ms"] = ms
        st[f"{b}_pct"] = None if ms is None or limit is None else limit * 1e3 / ms * 100
        st[f"{b}_algbw"] = None if ms is None else s / (ms * 1e-3) / 1e9
        st[f"{b}_busbw"] = (None if ms is None else
                            s / (ms * 1e-3) / 1e9 * bus_factor(cell["op"], p))
    r, g = st["ringlet_ms"], st["gloo_ms"]
    st["speedup"] = None if r is None or g is None else g / r
    return st


def tables(result: dict[str, Any]) -> str:
    """Renders the results as Markdown: a title line, then one table per op.

    Args:
      result (dict): What :func:`run_hosts` returned (or its ``--json`` file).

    Returns:
      Markdown text.

    Example:
      >>> print(tables(run_hosts([2, 2], "2gbit", ["all_reduce"], [1 << 20], 1.0)))
    """
    layout, rate = result["layout"], result.get("rate_bytes_per_s")
    cfg = result["config"]
    link = (f"each host link {cfg['rate']} each way (tbf burst {netns.BURST} latency "
            f"{netns.LATENCY})" if rate else "raw veth (no rate limit)")
    lines = [
        f"{len(layout)} hosts, ranks per host {layout} (world {sum(layout)}, ringlet layout "
        f"{result.get('host_layout')}), {link}, {cfg['dtype']}; medians of per-sample times "
        f"(slowest rank); xla = the torch_xla-style call on ringlet",
    ]
    if result.get("cpus"):
        lines[0] += f"; {result['cpus']} CPUs"
    if result.get("others_cpu_share") is not None:
        lines[0] += (f", other processes used {result['others_cpu_share']:.0%} of them "
                     f"during the run")

    def f(v: Optional[float], fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for op in cfg["ops"]:
        lines += [
            "", f"**{op}**", "",
            "| size | ringlet ms | xla ms | gloo ms | ringlet / gloo | link limit ms | "
            "ringlet % of limit | xla % of limit | gloo % of limit | ringlet algbw GB/s | "
            "ringlet busbw GB/s | gloo busbw GB/s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for cell in (c for c in result["cells"] if c["op"] == op):
            st = _cell_stats(cell, layout, rate)

            def ms(b: str, cell: dict[str, Any] = cell, st: dict[str, Any] = st) -> str:
                return "WRONG" if not cell[b]["ok"] else f(st[f"{b}_ms"], ".3f")

            lines.append(
                f"| {_fmt_size(int(cell['bytes']))} | {ms('ringlet')} | {ms('xla')} | "
                f"{ms('gloo')} | {f(st['speedup'], '.2f')}x | {f(st['limit_ms'], '.3f')} | "
                f"{f(st['ringlet_pct'], '.0f')} | {f(st['xla_pct'], '.0f')} | "
                f"{f(st['gloo_pct'], '.0f')} | {f(st['ringlet_algbw'], '.3f')} | "
                f"{f(st['ringlet_busbw'], '.3f')} | {f(st['gloo_busbw'], '.3f')} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str, metric: str = "time") -> None:
    """Draws time (ms, with the link limit dashed) or % of the link limit
    against size, one panel per op, for ringlet, the xla-style call and gloo
    (needs matplotlib: the ``bench`` extra).

    Args:
      result (dict): What :func:`run_hosts` returned.
      path (str): The PNG to write.
      metric (str): ``"time"`` or ``"limit"`` (needs a rate). Default: ``"time"``

    Example:
      >>> plot(result, "hosts.png", metric="limit")
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout, rate = result["layout"], result.get("rate_bytes_per_s")
    if metric == "limit" and rate is None:
        raise ValueError("--plot-metric limit needs a rate (not --rate none)")
    ops = result["config"]["ops"]
    cols = min(3, len(ops))
    rows = -(-len(ops) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.4 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(ops):]:
        ax.set_visible(False)
    for ax, op in zip(axes.flat, ops):
        cells = [c for c in result["cells"] if c["op"] == op]
        xs = [c["bytes"] for c in cells]
        stats = [_cell_stats(c, layout, rate) for c in cells]
        for b, style in (("ringlet", "o-"), ("xla", "s:"), ("gloo", "x--")):
            key = f"{b}_ms" if metric == "time" else f"{b}_pct"
            pts = [(x, s[key]) for x, s in zip(xs, stats) if s[key] is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=b)
        if metric == "time" and rate is not None:
            ax.plot(xs, [s["limit_ms"] for s in stats], "k--", lw=1, label="link limit")
        ax.set_xscale("log", base=2)
        if metric == "time":
            ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("S (bytes)")
        ax.set_ylabel("ms per call" if metric == "time" else "% of link limit")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{len(layout)} hosts {layout}, link {result['config']['rate'] or 'raw veth'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    """Entry point of ``python -m ringlet.bench hosts`` (and, with
    ``--worker DIR``, of each rank under torchrun).

    Example:
      >>> # sudo python -m ringlet.bench hosts --layout 1,3 --ops all_reduce
    """
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]))
        return
    p = argparse.ArgumentParser(prog="python -m ringlet.bench hosts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=None, help="number of hosts (default 2)")
    p.add_argument("--layout", default=None, help="ranks per host, e.g. 2,2 (default) or 1,3")
    p.add_argument("--per-host", type=int, default=None, help="ranks on every host (default 2)")
    p.add_argument("--rate", default="2gbit", help="tbf rate of each host link, each way; "
                   "'none' for the raw veth (default 2gbit)")
    p.add_argument("--ops", default="all", help=f"comma list of {', '.join(OPS)}, or all")
    p.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="bytes, comma list")
    p.add_argument("--budget", type=float, default=1.0,
                   help="seconds of timed calls per op, size and backend (at least 3 samples)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    p.add_argument("--json", default=None, help="save the raw results here")
    p.add_argument("--plot", default=None, help="draw a PNG here (needs matplotlib)")
    p.add_argument("--plot-metric", default="time", choices=["time", "limit"],
                   help="the plot's y axis: ms per call or %% of the link limit")
    p.add_argument("--tag", default=netns.PREFIX, help="namespace name prefix")
    p.add_argument("--keep", default=None, help="keep the run's directory (logs) here")
    args = p.parse_args()
    try:
        layout = parse_layout(args.layout, args.hosts, args.per_host)
        ops = parse_ops(args.ops)
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        rate = None if netns.parse_rate(args.rate) is None else args.rate
    except ValueError as e:
        raise SystemExit(f"{PROGRESS} {e}") from None
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit(f"{PROGRESS} --plot needs matplotlib: pip install "
                             "'ringlet[bench]' (or pip install matplotlib)") from None
    if args.plot_metric == "limit" and rate is None:
        raise SystemExit(f"{PROGRESS} --plot-metric limit needs a rate (not --rate none)")
    import torch

    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        raise SystemExit(f"{PROGRESS} unknown dtype {args.dtype!r}")
    stale = namespaces_ready(rate, args.tag, PROGRESS, NEED_ROOT)
    if stale:
        print(f"{PROGRESS} deleted namespaces left by an earlier run: {stale}", file=sys.stderr)
    try:
        result = run_hosts(layout, rate, ops, sizes, args.budget, args.dtype, args.timeout,
                           args.tag, Path(args.keep) if args.keep else None)
    except KeyboardInterrupt:
        print(f"{PROGRESS} interrupted; every process and namespace is gone", file=sys.stderr)
        raise SystemExit(130) from None
    except (RuntimeError, TimeoutError) as e:
        raise SystemExit(str(e)) from None
    report(result, "python -m ringlet.bench hosts", sys.argv[1:], tables, args.json)
    if args.plot:
        plot(result, args.plot, args.plot_metric)


if __name__ == "__main__":
    main()
