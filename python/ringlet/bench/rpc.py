"""ringlet.rpc vs torch.distributed.rpc, alternating in one run.

Rank 0 calls, rank 1 serves; both frameworks are initialised side by side
and measured in turns (round robin), so drift of the machine hits both.

* ``noop``: round trip of ``rpc_sync(1, noop)`` (median µs per call).
* ``echo``: ``rpc_sync(1, echo, args=(tensor,))`` for 1 KiB, 1 MiB, 64 MiB
  float32 tensors; GB/s counts the bytes moved both ways.
* ``in flight``: calls per second of ``rpc_async`` no-ops, 64 outstanding.

Run::

    python -m ringlet.bench rpc                       # spawns 2 processes
    torchrun --nproc_per_node 2 -m ringlet.bench rpc  # or under torchrun
    RINGLET_TRANSPORT=tcp python -m ringlet.bench rpc # ringlet over TCP only
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time
from typing import Any, Callable

import torch

_SIZES = [("1 KiB", 1 << 10), ("1 MiB", 1 << 20), ("64 MiB", 64 << 20)]


def noop() -> None:
    """Does nothing (the no-op target).

    Returns:
      None.

    Example::

        >>> rpc.rpc_sync(1, noop)
    """
    return None


def echo(x: Any) -> Any:
    """Returns its argument (the echo target).

    Args:
      x (Any): Anything.

    Returns:
      ``x``.

    Example::

        >>> rpc.rpc_sync(1, echo, args=(torch.ones(2),))
        tensor([1., 1.])
    """
    return x


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _in_flight(rpc: Any, calls: int, window: int) -> float:
    q: collections.deque[Any] = collections.deque()
    t0 = time.perf_counter()
    for _ in range(calls):
        if len(q) >= window:
            q.popleft().wait()
        q.append(rpc.rpc_async(1, noop))
    while q:
        q.popleft().wait()
    return calls / (time.perf_counter() - t0)


def _run(rank: int, world: int, addr: str, port: int, rounds: int) -> None:
    import torch.distributed.rpc as trpc

    import ringlet.rpc as rrpc
    from ringlet.bench.rpc import echo, noop  # by module name, not __main__

    # Under torchrun both rendezvous through its store (env://); spawned
    # processes use two fresh ports.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    trpc.init_rpc(f"w{rank}", rank=rank, world_size=world,
                  rpc_backend_options=trpc.TensorPipeRpcBackendOptions(
                      init_method="env://" if agent else f"tcp://{addr}:{port}",
                      rpc_timeout=300))
    rrpc.init_rpc(f"w{rank}", rank=rank, world_size=world,
                  rpc_backend_options=rrpc.RpcBackendOptions(
                      init_method="env://" if agent else f"tcp://{addr}:{port + 1}",
                      rpc_timeout=300))
    if rank == 0:
        sides = {"torch.distributed.rpc": trpc, "ringlet.rpc": rrpc}
        res: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
        tensors = {name: torch.randn(n // 4) for name, n in _SIZES}
        for _ in range(rounds):
            for side, rpc in sides.items():
                rpc.rpc_sync(1, noop)  # warm
                res[("noop", side)] += _timed(lambda rpc=rpc: rpc.rpc_sync(1, noop), 200)
                for name, n in _SIZES:
                    t = tensors[name]
                    reps = 100 if n <= 1 << 20 else 3
                    res[(name, side)] += _timed(
                        lambda rpc=rpc, t=t: rpc.rpc_sync(1, echo, args=(t,)), reps)
                res[("in flight", side)].append(_in_flight(rpc, 2000, 64))
        got = rrpc.rpc_sync(1, echo, args=(tensors["64 MiB"],))
        assert torch.equal(got, tensors["64 MiB"])
        t_name, r_name = "torch.distributed.rpc", "ringlet.rpc"
        print(f"\nringlet.rpc vs torch.distributed.rpc, 2 processes, medians over {rounds} "
              f"alternating rounds (transport: {os.environ.get('RINGLET_TRANSPORT', 'auto')})\n")
        print("| measurement | torch.distributed.rpc | ringlet.rpc | ringlet advantage |")
        print("|---|---:|---:|---:|")
        t, r = statistics.median(res[("noop", t_name)]), statistics.median(res[("noop", r_name)])
        print(f"| no-op rpc_sync round trip | {t * 1e6:.1f} µs | {r * 1e6:.1f} µs | {t / r:.1f}x |")
        for name, n in _SIZES:
            t = statistics.median(res[(name, t_name)])
            r = statistics.median(res[(name, r_name)])
            print(f"| echo {name} | {t * 1e6:.1f} µs, {2 * n / t / 1e9:.2f} GB/s | "
                  f"{r * 1e6:.1f} µs, {2 * n / r / 1e9:.2f} GB/s | {t / r:.1f}x |")
        t = statistics.median(res[("in flight", t_name)])
        r = statistics.median(res[("in flight", r_name)])
        print(f"| no-op calls/s, 64 in flight | {t:,.0f} | {r:,.0f} | {r / t:.1f}x |",
              flush=True)
    rrpc.shutdown()
    trpc.shutdown()


def _spawned(rank: int, world: int, addr: str, port: int, rounds: int) -> None:
    _run(rank, world, addr, port, rounds)


def main() -> None:
    """Runs the benchmark (under torchrun, or spawning 2 local processes).

    Returns:
      None.

    Example::

        $ python -m ringlet.bench rpc --rounds 5
    """
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=0, help="first of two free ports")
    args = ap.parse_args()
    if "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = args.port or int(os.environ.get("MASTER_PORT", "29500")) + 1
        _run(rank, world, addr, port, args.rounds)
        return
    import socket

    import torch.multiprocessing as mp

    port = args.port
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
    mp.spawn(_spawned, args=(2, "127.0.0.1", port, args.rounds), nprocs=2)


if __name__ == "__main__":
    main()
