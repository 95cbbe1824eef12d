"""What a lost replica costs DiLoCo's survivors: ``python -m ringlet.bench replicas``.

``--ranks`` processes (default 4) on this machine train an MLP of about
``--params`` parameters (default 1.9 M) with :class:`ringlet.algorithms.DiLoCo`
(AdamW inside, H = ``--sync-every``, ``--delay`` steps of overlap, ``--quantization``)
for ``--steps`` steps, twice: once with every replica, once with the last rank
exiting (``os._exit``) right after the average of sync ``--lose-at`` started,
while it is in flight. The store lives in this launcher, not in a rank, so it
outlives any of them. Per run the table gives the survivors' total time, the
median time of a sync step (the inner step that waits for the average and
applies it) and the time of the step of sync ``--lose-at``: with a loss, the
survivors detect it, agree on who is left, connect again and average among
themselves within that step; the difference to their other sync steps is what
the loss cost them.

Example:
  python -m ringlet.bench replicas
  python -m ringlet.bench replicas --ranks 3 --params 500000 --quantization int8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch


def _model(params: int) -> torch.nn.Module:
    width = max(8, int((params / 3) ** 0.5))
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width), torch.nn.Tanh(),
                               torch.nn.Linear(width, width))


def worker(cfg: dict[str, Any]) -> None:
    """One rank (run by the launcher with RANK, WORLD_SIZE and the store's port)."""
    import torch.distributed as dist

    import ringlet  # noqa: F401  (registers the backend)
    from ringlet.algorithms import DiLoCo

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["STORE_PORT"]), is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("ringlet", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg["timeout"]))
    net = _model(cfg["params"])
    width = net[0].in_features
    inner = torch.optim.AdamW(net.parameters(), lr=1e-3)
    outer = torch.optim.SGD(net.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    h, delay = cfg["sync_every"], cfg["delay"]
    victim = world - 1 if cfg["lose"] else -1
    lose_step = h * (cfg["lose_at"] - 1) + (h - delay)  # right after that sync's start
    g = torch.Generator().manual_seed(rank)
    times = []
    d = DiLoCo([net], inner, outer, h, fragment_sync_delay=delay,
               quantization=cfg["quantization"])
    dist.barrier()
    start = time.perf_counter()
    with d:
        for step in range(1, cfg["steps"] + 1):
            t = time.perf_counter()
            x = torch.randn(cfg["batch"], width, generator=g)
            torch.nn.functional.mse_loss(net(x), x).backward()
            inner.step()
            inner.zero_grad()
            times.append(time.perf_counter() - t)
            if rank == victim and step == lose_step:
                os._exit(3)
    total = time.perf_counter() - start
    syncs = [times[i] for i in range(h - 1, len(times), h)]
    others = [t for i, t in enumerate(times) if (i + 1) % h]
    out = {"rank": rank, "total": total, "sync_median": statistics.median(syncs),
           "sync_max": max(syncs), "step_median": statistics.median(others),
           "interrupted": times[h * cfg["lose_at"] - 1],
           "lost": d.lost_replicas}
    Path(cfg["out"]).joinpath(f"r{rank}.json").write_text(json.dumps(out))
    d.close()
    os._exit(0)  # the default group still names the lost rank: no collective teardown


def _run(cfg: dict[str, Any], lose: bool) -> list[dict[str, Any]]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    with tempfile.TemporaryDirectory() as tmp:
        spec = json.dumps({**cfg, "lose": lose, "out": tmp})
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", "import json,sys; from ringlet.bench.replicas import "
                 "worker; worker(json.loads(sys.argv[1]))", spec],
                env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(cfg["ranks"]),
                     "STORE_PORT": str(store.port), "OMP_NUM_THREADS": "1"},
            )
            for r in range(cfg["ranks"])
        ]
        deadline = time.monotonic() + cfg["timeout"] * 4
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        results = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("r*.json"))]
    del store
    return results


def main(argv: list[str] | None = None) -> None:
    """Runs the two runs and prints the table."""
    p = argparse.ArgumentParser(prog="python -m ringlet.bench replicas",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--params", type=int, default=1_900_000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--delay", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lose-at", type=int, default=2, help="the sync the last rank dies in")
    p.add_argument("--quantization", default="int8", choices=["none", "int8", "int4"])
    p.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args(argv)
    cfg = {"ranks": a.ranks, "params": a.params, "batch": a.batch, "sync_every": a.sync_every,
           "delay": a.delay, "steps": a.steps, "lose_at": a.lose_at, "timeout": a.timeout,
           "quantization": None if a.quantization == "none" else a.quantization}
    rows = []
    for lose in (False, True):
        res = _run(cfg, lose)
        rows.append((lose, res))
    print(f"DiLoCo, {a.ranks} ranks, {a.params / 1e6:.1f} M parameters, H = {a.sync_every}, "
          f"delay {a.delay}, {a.quantization}, {a.steps} steps; the last rank exits while "
          f"sync {a.lose_at}'s average is in flight\n")
    print("| run | survivors | total s | inner step ms | sync step ms (median) | "
          f"sync {a.lose_at}'s step ms | lost |")
    print("|---|---:|---:|---:|---:|---:|---|")
    base = max(r["total"] for r in rows[0][1])
    for lose, res in rows:
        total = max(r["total"] for r in res)
        print(f"| {'a replica lost' if lose else 'all replicas'} | {len(res)} | {total:.2f} | "
              f"{statistics.median(r['step_median'] for r in res) * 1e3:.1f} | "
              f"{statistics.median(r['sync_median'] for r in res) * 1e3:.1f} | "
              f"{max(r['interrupted'] for r in res) * 1e3:.1f} | {res[0]['lost']} |")
    lost_total = max(r["total"] for r in rows[1][1])
    hit = max(r["interrupted"] for r in rows[1][1])
    normal = statistics.median(r["sync_median"] for r in rows[1][1])
    print(f"\nthe interrupted sync's step: {hit * 1e3:.0f} ms, against {normal * 1e3:.0f} ms for "
          f"the survivors' other sync steps: the loss cost them {(hit - normal) * 1e3:+.0f} ms "
          f"(total {lost_total:.2f} s against {base:.2f} s with every replica)")


if __name__ == "__main__":
    main()
