"""torchft training with two replica groups, on ringlet or gloo process groups.

Used by ``tests/test_torchft.py`` (a replica killed mid-step and healed,
results compared across backends) and as the step-time script of
``docs/recipes/torchft.md``::

  python tests/torchft_job.py --steps 60 --width 1024 --repeat 3

which trains the same model with torchft's ``Manager`` (2 replica groups of
one process each, DDP over the replicas, asynchronous quorum as torchft
defaults) once on ``torchft.process_group.ProcessGroupGloo`` and once on
``ringlet.distributed.torchft.ProcessGroupRinglet``, alternating, and prints the median
step time of each.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
from datetime import timedelta
from typing import Any

STORE_HOST = "127.0.0.1"


def replica_main(replica: int, backend: str, lighthouse: str, steps: int, die_at: int,
                 results: Any, width: int = 32, batch: int = 16, async_quorum: bool = False,
                 mode: str = "ddp") -> None:
    """Trains replica group ``replica`` (one process) until ``steps`` steps
    are committed; puts ``(replica, result)`` in ``results``.

    ``mode="ddp"``: torchft's ``DistributedDataParallel``; at step
    ``die_at`` the process kills itself (SIGKILL) before the step starts,
    as torchft's own recovery tests fail a replica between steps (its DDP
    comm hook cannot return a failed allreduce: it asserts).
    ``mode="diloco"``: torchft's own ``DiLoCo`` (two fragments, a delay of
    one step), nobody killed.
    ``mode="allreduce"``: each gradient goes through ``manager.allreduce``
    (torchft's fault-tolerant collective, whose error reaches
    ``should_commit``); at step ``die_at`` the process kills itself after
    its forward pass, so the other replica's allreduce loses its peer."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchft.ddp import DistributedDataParallel
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    from ringlet.distributed.torchft import ProcessGroupRinglet

    store = dist.TCPStore(STORE_HOST, 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                              torch.nn.Linear(width, width), torch.nn.Tanh(),
                              torch.nn.Linear(width, 4))
    adam = torch.optim.Adam(net.parameters(), lr=1e-2)

    def state_dict() -> dict[str, Any]:
        return {"model": net.state_dict(), "optim": adam.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        net.load_state_dict(sd["model"])
        adam.load_state_dict(sd["optim"])

    timeout = timedelta(seconds=30)
    pg = ProcessGroupRinglet(timeout=timeout) if backend == "ringlet" else ProcessGroupGloo(
        timeout=timeout)
    manager = Manager(
        pg=pg, min_replica_size=2, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"replica_{replica}", store_addr=STORE_HOST, store_port=store.port, rank=0,
        world_size=1, lighthouse_addr=lighthouse, use_async_quorum=async_quorum,
        timeout=timeout, quorum_timeout=timedelta(seconds=120), hostname=STORE_HOST,
    )
    times: list[tuple[int, float, bool]] = []
    if mode == "diloco":
        # torchft's own DiLoCo on the replica group's process group: two
        # fragments, the second's average started a step early.
        from torchft.local_sgd import DiLoCo

        frags = [net[0], net[2:]]
        outers = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
                  for f in frags]
        inner_step = 0
        with DiLoCo(manager, frags, adam, outers, sync_every=4, fragment_sync_delay=1):
            while manager.current_step() < steps:
                g = torch.Generator().manual_seed(1000 * inner_step + replica)
                x = torch.randn(batch, width, generator=g)
                y = torch.randint(0, 4, (batch,), generator=g)
                F.cross_entropy(net(x), y).backward()
                adam.step()
                adam.zero_grad()
                inner_step += 1
        times.append((inner_step, 0.0, True))
    model = DistributedDataParallel(manager, net) if mode == "ddp" else net
    opt = OptimizerWrapper(manager, adam)
    while manager.current_step() < steps:
        if mode == "ddp" and manager.current_step() == die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # between steps
        t0 = time.perf_counter()
        opt.zero_grad()
        step = manager.current_step()
        g = torch.Generator().manual_seed(1000 * step + replica)
        x = torch.randn(batch, width, generator=g)
        y = torch.randint(0, 4, (batch,), generator=g)
        loss = F.cross_entropy(model(x), y)
        if mode != "ddp" and step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the peer's allreduce loses us
        loss.backward()
        if mode != "ddp":
            works = [manager.allreduce(p.grad) for p in net.parameters()]
            for w in works:
                w.wait()  # an error is reported to the manager: should_commit says no
        opt.step()
        times.append((step, time.perf_counter() - t0, manager.current_step() > step))
    result = {
        # plain lists: a tensor in the queue would need this process alive
        "state": {k: v.tolist() for k, v in net.state_dict().items()},
        "step": manager.current_step(),
        "times": times,
        "pg": pg.getBackendName(),
    }
    manager.shutdown(wait=False)
    results.put((replica, result))


def run(backend: str, steps: int, die_at: int = -1, width: int = 32, batch: int = 16,
        async_quorum: bool = False, timeout: float = 240.0, mode: str = "ddp",
        ) -> dict[str, Any]:
    """Runs two replica groups (processes) with a lighthouse in this
    process; replica 1 dies at step ``die_at`` (-1: never) and is started
    again at once. Returns ``{"results": {replica: result}, "restarts": n,
    "exitcode": exit code of the killed replica or None}``."""
    import torch.multiprocessing as mp
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=200,
                                  heartbeat_timeout_ms=2000)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    deadline = time.monotonic() + timeout

    def start(replica: int, die: int) -> Any:
        p = ctx.Process(target=replica_main, daemon=True, args=(
            replica, backend, lighthouse.address(), steps, die, results, width, batch,
            async_quorum, mode))
        p.start()
        return p

    procs = {0: start(0, -1), 1: start(1, die_at)}
    out: dict[int, Any] = {}
    exitcode = None
    restarts = 0
    try:
        if die_at >= 0:
            procs[1].join(timeout=max(deadline - time.monotonic(), 0))
            if procs[1].is_alive():
                raise TimeoutError(f"{backend}: replica 1 did not die at step {die_at}")
            exitcode = procs[1].exitcode
            procs[1] = start(1, -1)  # the replacement heals from replica 0
            restarts += 1
        while len(out) < 2:
            try:
                replica, res = results.get(timeout=1.0)
                out[replica] = res
            except queue.Empty:
                dead = [r for r, p in procs.items() if not p.is_alive() and r not in out]
                if dead and results.empty():
                    raise RuntimeError(
                        f"{backend}: replica {dead} exited ({[procs[r].exitcode for r in dead]}) "
                        "without a result") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{backend}: replicas did not finish within {timeout}s; "
                                       f"finished: {sorted(out)}") from None
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        lighthouse.shutdown()
    return {"results": out, "restarts": restarts, "exitcode": exitcode}


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def bench(steps: int, width: int, batch: int, repeat: int) -> dict[str, list[float]]:
    """Median step time (ms) of replica 0, after 5 warm-up steps, per run:
    gloo and ringlet alternating ``repeat`` times."""
    out: dict[str, list[float]] = {"gloo": [], "ringlet": []}
    for _ in range(repeat):
        for backend in ("gloo", "ringlet"):
            r = run(backend, steps, width=width, batch=batch, async_quorum=True, timeout=900)
            times = [t for step, t, committed in r["results"][0]["times"] if step >= 5]
            out[backend].append(1000 * _median(times))
    return out


def main(argv: list[str]) -> int:
    import argparse

    import torch

    parser = argparse.ArgumentParser(description="torchft step time: gloo vs ringlet")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    params = 2 * (args.width * args.width + args.width) + 4 * args.width + 4
    res = bench(args.steps, args.width, args.batch, args.repeat)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, 2 replica groups x 1 process, "
          f"{params} parameters ({params * 4 / 2**20:.1f} MiB of gradients), batch {args.batch}")
    for backend, ms in res.items():
        print(f"{backend:8s} median step {_median(ms):8.2f} ms  (runs: "
              f"{', '.join(f'{m:.2f}' for m in ms)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
