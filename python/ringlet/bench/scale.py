"""What start-up and small collectives cost as the rank count grows, on
*logical hosts*: ``p`` processes on this machine, each its own host by
``RINGLET_HOST_ID`` (so ringlet connects them over loopback TCP, as it would
across real hosts), against gloo in a launch of its own, launches taking turns.

For each rank count and backend one ``torchrun --nproc_per_node p`` launch
reports, the maximum over ranks:

* ``init``: from ``init_process_group`` to the first ``all_reduce`` done (the
  job's start-up as its training loop sees it; gloo connects its full mesh
  inside ``init_process_group``, or, with ``TORCH_GLOO_LAZY_INIT=1``, on each
  pair's first use). The ranks first meet at the job's store (torch's
  ``env://`` rendezvous, done before the clock starts and handed to
  ``init_process_group``) and start their clocks as the last one arrives,
  so that ``init`` measures the library, not how far apart the processes
  finished importing torch, nor torch's rendezvous (a rank that comes
  before rank 0 serves the store backs off: 2.5 s at 16 ranks started
  together, 10 s at 64); ``--no-align`` starts each clock as its process
  gets there, before torch's rendezvous. ``init, last arrival``: the same for the rank
  that got there last (the least over ranks), which waited for no one's
  arrival: the protocol's own cost;
* ``new_group``: a group of every rank, to its first ``all_reduce`` done;
* ``store ops``: the store operations ringlet made to connect the world (a
  counting wrapper around the default group's store: ringlet's own
  connection, each blocking wait one; torch's rendezvous is the same for
  every backend);
* ``sockets``: TCP sockets the process holds after the collectives;
* ``4 KiB`` / ``1 MiB``: median all_reduce, blocks of back-to-back calls
  after a barrier, slowest rank.

A second table splits ringlet's start-up for the rank that arrived last
into phases: torch's ``init_process_group`` and the Backend until the
address exchange, the exchange (its record set, the table read), and
connecting + the first all_reduce.

With ``--netns L`` (as root) the hosts are network namespaces on a bridge
(:mod:`ringlet.bench.netns`, ``--rate`` per link, raw veth by default), L
ranks each, one ``torchrun --nnodes H --node_rank h`` per host, so the
connections cross real (virtual) links with their own addresses.

Example:
  python -m ringlet.bench scale --ranks 4,16
  sudo python -m ringlet.bench scale --netns 1 --ranks 8,16
  python -m ringlet.bench scale --ranks 16 --repeat 3 --gloo-lazy
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .soak import _free_port

SIZES = (4 << 10, 1 << 20)


def _sockets(listening: bool = False) -> int:
    """TCP sockets this process holds (listening ones included), or with
    ``listening`` only those that listen."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    tcp = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                tcp.update(w[9] for w in map(str.split, f) if not listening or w[3] == "0A")
        except OSError:
            pass
    return len(inodes & tcp)


class CountingStore:
    """Forwards to a torch store and counts each call by method: what
    ringlet's address exchange asks of the store."""

    def __init__(self, store: Any, counts: Counter[str] | None = None) -> None:
        self._store, self.counts = store, counts if counts is not None else Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return method(*args, **kwargs)

        return counted


def store_ops(counts: Mapping[str, int]) -> int:
    """Store operations among ``counts``, not counting the polls of
    ``check`` while a rank waits (one round trip each, whatever the rank
    count)."""
    return sum(v for k, v in counts.items() if k != "check")


def _gate(world: int) -> Any:
    """With ``RINGLET_BENCH_ALIGN=1``: the job's store as torch's
    ``init_process_group`` would make it (``env://``: rank 0 or torchrun's
    agent serves it), after the ranks have met at it and left together (the
    last to arrive opens the gate; every rank's blocking wait returns as the
    server tells it). Else None."""
    if os.environ.get("RINGLET_BENCH_ALIGN") != "1":
        return None
    import torch.distributed as dist

    store, _, _ = next(dist.rendezvous("env://"))
    if int(store.add("bench/arrived", 1)) == world:
        store.set("bench/open", "1")
    store.wait(["bench/open"])
    return store


def worker(out: str, backend: str, iters: int) -> None:
    """One rank of a launch: times start-up, a new group and the all_reduces,
    and appends its numbers to ``out`` (JSON lines)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    os.environ.setdefault("RINGLET_HOST_ID", f"logical-{rank}")  # namespaces: set per host
    from ringlet.core import connection

    counts: Counter[str] = Counter()
    marks: dict[str, float] = {}
    if backend == "ringlet":
        real = connection.exchange

        def counting(store: Any, *a: Any, **k: Any) -> Any:
            marks.setdefault("exchange", time.perf_counter())  # the world's is the first
            got = real(CountingStore(store, counts), *a, **k)
            marks.setdefault("table", time.perf_counter())
            return got

        connection.exchange = counting  # type: ignore[assignment]
    t = torch.ones(1024)
    world = int(os.environ["WORLD_SIZE"])
    store = _gate(world)
    t0 = time.perf_counter()
    if store is None:
        dist.init_process_group(backend)
    else:  # the store the gate met at: torch's rendezvous is behind every rank
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    dist.all_reduce(t)
    done = time.perf_counter()
    init_s = done - t0
    world_ops = store_ops(counts)
    # ringlet's start-up by phase: torch's part and the Backend's before the
    # address exchange, the exchange (set the record, wait for the table),
    # and connecting + the first all_reduce
    phases = {"before_s": marks["exchange"] - t0, "exchange_s": marks["table"] - marks["exchange"],
              "first_s": done - marks["table"]} if "table" in marks else {}
    t0 = time.perf_counter()
    g = dist.new_group(backend=backend)
    dist.all_reduce(t, group=g)
    group_s = time.perf_counter() - t0
    times = {}
    for size in SIZES:
        x = torch.ones(size // 4)
        dist.all_reduce(x)
        reps = max(2, iters * 4096 // size)
        samples = []
        for _ in range(15):
            dist.barrier()
            a = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(x)
            samples.append((time.perf_counter() - a) / reps)
        times[size] = statistics.median(samples)
    row = {"rank": rank, "init_s": init_s, "group_s": group_s, "store_ops": world_ops,
           "sockets": _sockets(), **{f"us_{s}": v * 1e6 for s, v in times.items()},
           **phases}
    dist.destroy_process_group()
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def _summary(rows: list[dict[str, float]]) -> dict[str, float]:
    """The maximum over ranks of each number, and the start-up of the rank
    that arrived last (the least: it waited for no one's arrival), with its
    phases (ringlet: ``last_before_s``, ``last_exchange_s``, ``last_first_s``)."""
    phases = ("before_s", "exchange_s", "first_s")
    out = {k: max(r[k] for r in rows) for k in rows[0] if k != "rank" and k not in phases}
    last = min(rows, key=lambda r: r["init_s"])
    out["init_last_s"] = last["init_s"]
    out.update({f"last_{k}": last[k] for k in phases if k in last})
    return out


def launch(p: int, backend: str, iters: int, env: dict[str, str], timeout: float,
           align: bool = True) -> dict[str, float]:
    """One launch of ``p`` ranks; the maximum over ranks of each number.
    ``align``: the ranks start their clocks together (``_gate``)."""
    env = {**env, "RINGLET_BENCH_ALIGN": "1" if align else "0"}
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={p}",
               "--master-port", str(_free_port()), "-m", "ringlet.bench.scale",
               "--worker", str(out), backend, str(iters)]
        subprocess.run(cmd, check=True, timeout=timeout, env={**os.environ, **env},
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    if len(rows) != p:
        raise RuntimeError(f"{len(rows)} of {p} ranks reported")
    return _summary(rows)


def launch_netns(net: Any, per_host: int, backend: str, iters: int, env: dict[str, str],
                 timeout: float, port: int, align: bool = True) -> dict[str, float]:
    """One launch over the network-namespace hosts of ``net``
    (:class:`ringlet.bench.netns.Hosts`), ``per_host`` ranks on each: a
    ``torchrun --nnodes H --node_rank h`` inside each host; the maximum over
    ranks of each number. ``align``: the ranks start their clocks together
    (``_gate``)."""
    env = {**env, "RINGLET_BENCH_ALIGN": "1" if align else "0"}
    hosts = len(net.names)
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items()
            if k not in drop and not k.startswith("TORCHELASTIC_")}
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.jsonl"
        procs = []
        try:
            for h in range(hosts):
                argv = [*net.exec_argv(h), sys.executable, "-m", "torch.distributed.run",
                        "--nnodes", str(hosts), "--nproc_per_node", str(per_host),
                        "--node_rank", str(h), "--master_addr", net.addrs[0],
                        "--master_port", str(port), "-m", "ringlet.bench.scale",
                        "--worker", str(out), backend, str(iters)]
                host_env = {**base, **env, "OMP_NUM_THREADS": "1",
                            "RINGLET_HOST_ID": f"host{h}", "GLOO_SOCKET_IFNAME": net.ifnames[h]}
                procs.append(subprocess.Popen(argv, env=host_env, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.PIPE, start_new_session=True))
            deadline = time.monotonic() + timeout
            for proc in procs:
                _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                if proc.returncode:
                    raise RuntimeError(f"a host's launch failed ({proc.returncode}): "
                                       f"{err.decode(errors='replace')[-2000:]}")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait()
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    if len(rows) != hosts * per_host:
        raise RuntimeError(f"{len(rows)} of {hosts * per_host} ranks reported")
    return _summary(rows)


def main() -> None:
    """Entry point of ``python -m ringlet.bench scale``."""
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", default="4,16", help="rank counts, comma list")
    p.add_argument("--repeat", type=int, default=2, help="launches per backend and count")
    p.add_argument("--iters", type=int, default=200, help="4 KiB calls per sample")
    p.add_argument("--gloo-lazy", action="store_true",
                   help="also gloo with TORCH_GLOO_LAZY_INIT=1")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--netns", type=int, default=0, metavar="L",
                   help="network-namespace hosts of L ranks each on a bridge (as root) "
                        "instead of logical hosts")
    p.add_argument("--rate", default="none", help="with --netns: each host link's tc rate")
    p.add_argument("--only", default="", help="comma list of rows to run (ringlet, gloo, "
                   "'gloo lazy'): all by default")
    p.add_argument("--no-align", action="store_true",
                   help="start each rank's clock as its process gets there, not together")
    args = p.parse_args()
    ways = [("ringlet", "ringlet", {}), ("gloo", "gloo", {})]
    if args.gloo_lazy:
        ways.append(("gloo lazy", "gloo", {"TORCH_GLOO_LAZY_INIT": "1"}))
    if args.only:
        ways = [w for w in ways if w[0] in args.only.split(",")]
    print("| ranks | backend | init s | init, last arrival s | new_group s | store ops | "
          "sockets | 4 KiB µs | 1 MiB µs |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    phased: list[tuple[int, list[dict[str, float]]]] = []
    for n in (int(x) for x in args.ranks.split(",")):
        got: dict[str, list[dict[str, float]]] = {w[0]: [] for w in ways}
        with contextlib.ExitStack() as stack:
            net = None
            if args.netns:
                from . import netns

                if n % args.netns or n // args.netns < 2:
                    raise SystemExit(f"--netns {args.netns}: {n} ranks make no 2+ hosts")
                net = stack.enter_context(netns.Hosts(n // args.netns, args.rate, tag="rlscale"))
            port = 29500
            for _ in range(args.repeat):
                for label, backend, env in ways:
                    port += 1  # a fresh port: the last launch's may linger in TIME_WAIT
                    got[label].append(
                        launch_netns(net, args.netns, backend, args.iters, env, args.timeout, port,
                                     not args.no_align)
                        if net is not None else
                        launch(n, backend, args.iters, env, args.timeout, not args.no_align))
        for label, _, _ in ways:
            runs = got[label]

            def med(k: str, runs: list[dict[str, float]] = runs) -> float:
                return statistics.median(r[k] for r in runs)

            ops = f"{med('store_ops'):.0f}" if label == "ringlet" else "-"
            print(f"| {n} | {label} | {med('init_s'):.3f} | {med('init_last_s'):.3f} | "
                  f"{med('group_s'):.3f} | {ops} | "
                  f"{med('sockets'):.0f} | {med('us_4096'):.1f} | {med('us_1048576'):.1f} |",
                  flush=True)
        if "ringlet" in got and "last_first_s" in got["ringlet"][0]:
            phased.append((n, got["ringlet"]))
    if phased:
        print("\nringlet's start-up for the rank that arrived last, by phase (ms, median "
              "launch): torch's init_process_group and the Backend until the address "
              "exchange; the exchange (its record set, the table read); connecting and "
              "the first all_reduce")
        print("| ranks | before the exchange | exchange | connect + first all_reduce | total |")
        print("|---:|---:|---:|---:|---:|")
        for n, runs in phased:
            def ms(k: str, runs: list[dict[str, float]] = runs) -> str:
                return f"{1e3 * statistics.median(r[k] for r in runs):.1f}"

            print(f"| {n} | {ms('last_before_s')} | {ms('last_exchange_s')} | "
                  f"{ms('last_first_s')} | {ms('init_last_s')} |")


if __name__ == "__main__":
    main()
