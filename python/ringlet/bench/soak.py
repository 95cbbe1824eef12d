"""A seeded random program of mixed operations on several ranks, every result
checked against plain torch, with resident memory, file descriptors and
``/dev/shm`` measured before and after.

Run ``python -m ringlet.bench.soak`` (10,000 operations on 4 ranks over shared memory
and TCP; ``--ops``, ``--ranks``, ``--transports``, ``--seed``; or
``RINGLET_SOAK_OPS``). The test suite runs a short version.

Every rank draws the same operation sequence from the seed, and each rank's
input from ``(seed, step, rank)``, so every rank can compute every other rank's
input, and with it the expected result, in torch alone. Values are small
integers, so every dtype (float16 and bfloat16 included) reduces exactly.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import shutil
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

import torch

__all__ = ["main", "run"]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int32, torch.int64, torch.int8, torch.uint8]
SIZES = [0, 1, 2, 3, 7, 33, 257, 1001, 4099, 65537]
SIZE_WEIGHTS = [3, 3, 2, 2, 3, 3, 2, 2, 1, 1]
KINDS = ["all_reduce", "all_reduce_list", "all_gather", "reduce_scatter", "broadcast",
         "all_to_all", "all_to_all_v", "collective_permute", "rendezvous", "barrier",
         "send_recv", "bucket", "checkpoint"]
KIND_WEIGHTS = [6, 3, 4, 3, 3, 2, 2, 2, 1, 1, 2, 2, 0]


def _partitions(rng: random.Random, world: int, equal: bool, count: int) -> list[list[list[int]]]:
    """``count`` random partitions of the ranks into replica groups (of one
    size when ``equal``: all_gather and reduce_scatter need that)."""
    out: list[list[list[int]]] = []
    for _ in range(count):
        ranks = list(range(world))
        rng.shuffle(ranks)
        if equal:
            size = rng.choice([d for d in range(1, world + 1) if world % d == 0])
            bounds = list(range(0, world + 1, size))
        else:
            cut = sorted(rng.sample(range(1, world), rng.randrange(0, world - 1)))
            bounds = [0, *cut, world]
        out.append(sorted(sorted(ranks[a:b]) for a, b in zip(bounds, bounds[1:])))
    return out


def _ints(seed: int, step: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 97 + rank)
    lo = 0 if dtype == torch.uint8 else -3
    return torch.randint(lo, 4, (n,), generator=g, dtype=torch.int64)


def _reduce(values: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack(values)
    if op == "sum":
        return stack.sum(0)
    if op == "max":
        return stack.amax(0)
    return stack.amin(0)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _shm() -> int:
    if not os.path.isdir("/dev/shm"):
        return 0
    return sum(1 for e in os.listdir("/dev/shm") if not e.startswith("sem.mp-"))


class _Program:
    """One rank's view of the seeded program."""

    def __init__(self, rank: int, world: int, seed: int, ckpt_dir: str) -> None:
        import ringlet

        self.r, self.n, self.seed, self.ckpt_dir = rank, world, seed, ckpt_dir
        self.rl = ringlet
        self.counts: dict[str, int] = {}
        self.bucket = [torch.zeros(n).ensure_ringlet_tensor(f"soak{i}", "soak")
                       for i, n in enumerate((1, 31, 1000))]
        self.module = ringlet.parallel.tensor.get_module("soak")
        self.module.set_buckets([[self.bucket[0], self.bucket[1]], [self.bucket[2]]])
        self.module.set_all_reduce(average=False)
        # A fixed menu of replica groups, all connected by prime(): groups are
        # cached communicators, so a new partition late in the run would show
        # up as new file descriptors.
        menu = random.Random(seed + 1)
        self.equal = _partitions(menu, world, True, 4) if world > 1 else []
        self.any = _partitions(menu, world, False, 4) if world > 1 else []

    def prime(self) -> None:
        """Connects every replica group of the menu and every send/recv pair."""
        for groups in self.equal + self.any:
            self.rl.all_reduce("sum", [torch.zeros(1)], groups=groups)
        for a in range(self.n):
            for b in range(a + 1, self.n):
                if self.r in (a, b):
                    buf = torch.zeros(1)
                    if self.r == a:
                        self.rl.send(buf, b)
                    else:
                        self.rl.recv(buf, a)
                self.rl.barrier()

    def _groups(self, rng: random.Random, equal: bool = False) -> Optional[list[list[int]]]:
        """None (the world) or a partition from the menu."""
        menu = self.equal if equal else self.equal + self.any
        if rng.random() < 0.5 or not menu:
            return None
        return rng.choice(menu)

    def step(self, i: int, rng: random.Random) -> None:
        kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
        if i % 250 == 249:
            kind = "checkpoint"
        self.counts[kind] = self.counts.get(kind, 0) + 1
        getattr(self, "_" + kind)(i, rng)

    def _inputs(self, i: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
        return [_ints(self.seed, i, q, n, dtype) for q in range(self.n)]

    def _mine(self, groups: Optional[list[list[int]]]) -> list[int]:
        return list(range(self.n)) if groups is None else next(g for g in groups if self.r in g)

    def _all_reduce(self, i: int, rng: random.Random, as_list: bool = False) -> None:
        n, dtype = rng.choices(SIZES, SIZE_WEIGHTS)[0], rng.choice(DTYPES)
        op, groups = rng.choice(["sum", "max", "min"]), self._groups(rng)
        vals = self._inputs(i, n, dtype)
        want = _reduce([vals[q] for q in self._mine(groups)], op).to(dtype)
        x = vals[self.r].to(dtype)
        if as_list:
            self.rl.all_reduce(op, [x], groups=groups)
            got = x
        else:
            got = self.rl.all_reduce(op, x, groups=groups)
        assert torch.equal(got, want), (i, "all_reduce", n, dtype, op, groups)

    def _all_reduce_list(self, i: int, rng: random.Random) -> None:
        self._all_reduce(i, rng, as_list=True)

    def _all_gather(self, i: int, rng: random.Random) -> None:
        n, dtype = rng.choices(SIZES, SIZE_WEIGHTS)[0], rng.choice(DTYPES)
        groups = self._groups(rng, equal=True)
        vals = self._inputs(i, n, dtype)
        got = self.rl.all_gather(vals[self.r].to(dtype), dim=0, groups=groups)
        want = torch.cat([vals[q] for q in self._mine(groups)]).to(dtype)
        assert torch.equal(got, want), (i, "all_gather", n, dtype, groups)

    def _reduce_scatter(self, i: int, rng: random.Random) -> None:
        groups = self._groups(rng, equal=True)
        mine = self._mine(groups)
        k, dtype = rng.choices(SIZES, SIZE_WEIGHTS)[0] // len(mine), rng.choice(DTYPES)
        vals = self._inputs(i, k * len(mine), dtype)
        got = self.rl.reduce_scatter("sum", vals[self.r].to(dtype), 1.0, 0, len(mine),
                                     groups=groups)
        total = _reduce([vals[q] for q in mine], "sum").to(dtype)
        want = total.view(len(mine), k)[mine.index(self.r)] if k else total
        assert torch.equal(got, want), (i, "reduce_scatter", k, dtype, groups)

    def _broadcast(self, i: int, rng: random.Random) -> None:
        n, dtype = rng.choices(SIZES, SIZE_WEIGHTS)[0], rng.choice(DTYPES)
        root = rng.randrange(self.n)
        vals = self._inputs(i, n, dtype)
        x = vals[self.r].to(dtype)
        self.rl.collective_broadcast([x], root_ordinal=root)
        assert torch.equal(x, vals[root].to(dtype)), (i, "broadcast", n, dtype, root)

    def _all_to_all(self, i: int, rng: random.Random) -> None:
        k, dtype = rng.choice([0, 1, 3, 250]), rng.choice(DTYPES)
        vals = self._inputs(i, k * self.n, dtype)
        got = self.rl.all_to_all(vals[self.r].to(dtype), 0, 0, self.n)
        want = torch.cat([vals[q].view(self.n, k)[self.r] for q in range(self.n)]).to(dtype)
        assert torch.equal(got, want), (i, "all_to_all", k, dtype)

    def _all_to_all_v(self, i: int, rng: random.Random) -> None:
        dtype, groups = rng.choice(DTYPES), self._groups(rng)
        mine = self._mine(groups)
        size = {(s, d): rng.randrange(0, 40) for s in range(self.n) for d in range(self.n)}
        blocks = {s: self._inputs(i, sum(size[s, d] for d in mine), dtype)[s]
                  for s in mine}

        def block(s: int, d: int) -> torch.Tensor:
            start = sum(size[s, e] for e in mine[:mine.index(d)])
            return blocks[s][start:start + size[s, d]].to(dtype)

        send = [block(self.r, d) for d in mine]
        recv = [torch.empty(size[s, self.r], dtype=dtype) for s in mine]
        self.rl.all_to_all_v(send, recv, groups=groups)
        for s, got in zip(mine, recv):
            assert torch.equal(got, block(s, self.r)), (i, "all_to_all_v", s, groups)

    def _collective_permute(self, i: int, rng: random.Random) -> None:
        n, dtype = rng.choices(SIZES, SIZE_WEIGHTS)[0], rng.choice(DTYPES)
        targets = list(range(self.n))
        rng.shuffle(targets)
        pairs = [[s, t] for s, t in enumerate(targets) if rng.random() < 0.8]
        vals = self._inputs(i, n, dtype)
        got = self.rl.collective_permute(vals[self.r].to(dtype), pairs)
        src = [s for s, t in pairs if t == self.r]
        want = vals[src[0]].to(dtype) if src else torch.zeros(n, dtype=dtype)
        assert torch.equal(got, want), (i, "collective_permute", pairs)

    def _rendezvous(self, i: int, rng: random.Random) -> None:
        payloads = [bytes(_ints(self.seed, i, q, q * 3 + 1, torch.uint8).tolist())
                    for q in range(self.n)]
        assert self.rl.rendezvous(f"soak{i}", payloads[self.r]) == payloads, (i, "rendezvous")
        got = self.rl.mesh_reduce(f"soak{i}", self.r + 1, sum)
        assert got == sum(range(1, self.n + 1)), (i, "mesh_reduce")

    def _barrier(self, i: int, rng: random.Random) -> None:
        self.rl.barrier()

    def _send_recv(self, i: int, rng: random.Random) -> None:
        order = list(range(self.n))
        rng.shuffle(order)
        pairs = [(order[j], order[j + 1]) for j in range(0, self.n - 1, 2)]
        n, dtype = rng.choices(SIZES, SIZE_WEIGHTS)[0], rng.choice(DTYPES)
        vals = self._inputs(i, n, dtype)
        for a, b in pairs:
            if self.r in (a, b):
                peer = b if self.r == a else a
                buf = torch.empty(n, dtype=dtype)
                if self.r == a:
                    self.rl.send(vals[a].to(dtype), peer)
                    self.rl.recv(buf, peer)
                else:
                    self.rl.recv(buf, peer)
                    self.rl.send(vals[b].to(dtype), peer)
                assert torch.equal(buf, vals[peer].to(dtype)), (i, "send/recv", a, b)

    def _bucket(self, i: int, rng: random.Random) -> None:
        for j, t in enumerate(self.bucket):
            t.copy_(_ints(self.seed, i, self.r + 100 * j, t.numel(), torch.float32))
        for t in reversed(self.bucket):
            t.ringlet_mark_communication_ready()
        self.module.wait_pending_comm_ops()
        for j, t in enumerate(self.bucket):
            want = sum(_ints(self.seed, i, q + 100 * j, t.numel(), torch.float32)
                       for q in range(self.n))
            assert torch.equal(t, want.to(torch.float32)), (i, "bucket", j)

    def _checkpoint(self, i: int, rng: random.Random) -> None:
        from ..checkpoint import ShardedTensor, load, save

        rows = rng.randrange(1, 5)
        full = torch.arange(self.n * rows * 3, dtype=torch.float32).view(self.n * rows, 3) + i
        mine = full[self.r * rows:(self.r + 1) * rows].clone()
        path = os.path.join(self.ckpt_dir, f"step{i}")
        save({"w": ShardedTensor.from_rank_offsets("w", mine, (0, self.r, self.n))}, path)
        back = torch.zeros_like(full)
        out = load({"w": ShardedTensor.from_rank_offsets("w", back)}, path)
        assert torch.equal(out["w"], full), (i, "checkpoint")
        self.rl.barrier()
        if self.r == 0:
            shutil.rmtree(path, ignore_errors=True)


def _rank(rank: int, world: int, port: int, transport: str, ops: int, seed: int,
          ckpt_dir: str, results: Any) -> None:
    os.environ["RINGLET_TRANSPORT"] = "tcp" if transport == "tcp" else "auto"
    try:
        import ringlet

        ringlet.init(rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                     timeout=120)
        prog = _Program(rank, world, seed, ckpt_dir)
        prog.prime()
        rng = random.Random(seed)
        warm = min(200, max(ops // 10, 1))
        for i in range(warm):  # caches, lazily connected groups and pairs
            prog.step(i, rng)
        ringlet.barrier()
        prog.counts.clear()
        before = (_rss_kib(), _fds(), _shm())
        start = time.monotonic()
        mid = before
        for i in range(warm, warm + ops):
            if i == warm + ops // 2:
                mid = (_rss_kib(), _fds(), _shm())
            prog.step(i, rng)
        ringlet.barrier()
        took = time.monotonic() - start
        after = (_rss_kib(), _fds(), _shm())
        results.put((rank, "ok", {"before": before, "mid": mid, "after": after, "seconds": took,
                                  "counts": prog.counts, "transport": ringlet.transport()}))
        prog.module.close()
        ringlet.shutdown()
    except BaseException as e:  # report everything to the parent
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(ops: int = 10_000, world: int = 4, transport: str = "shm", seed: int = 14,
        timeout: float = 3600.0) -> dict[int, dict[str, Any]]:
    """Runs the soak program on ``world`` fresh processes over one transport.

    Args:
      ops (int): Operations measured (after a warm-up of up to 200 more).
      world (int): Number of ranks. Default: 4
      transport (str): ``"shm"`` or ``"tcp"``.
      seed (int): Seeds the program and the data.
      timeout (float): Seconds before every rank is killed and ``TimeoutError``
        raised.

    Returns:
      dict: per rank, ``before``, ``mid`` (half-way) and ``after`` (resident
      KiB, open fds, /dev/shm entries), ``seconds``, ``counts`` per operation kind and the
      world ``transport``.

    Example:
      >>> r = ringlet.bench.soak.run(ops=300, transport="tcp")
      >>> r[0]["after"][1] - r[0]["before"][1]    # file descriptors leaked
      0
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port, ckpt = _free_port(), tempfile.mkdtemp(prefix="ringlet-soak-")
    procs = [ctx.Process(target=_rank, args=(r, world, port, transport, ops, seed, ckpt, results),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"soak did not finish in {timeout} s") from None
                if errors and all(not p.is_alive() for p in procs):
                    break
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors.append(f"rank {rank}: {value}")
                break
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(ckpt, ignore_errors=True)
    if errors:
        raise AssertionError("\n".join(errors))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m ringlet.bench.soak``: runs the soak and prints its figures.

    Args:
      argv (list, optional): Command-line arguments. Default: ``sys.argv[1:]``.

    Returns:
      int: The exit status (0 when every result matched and nothing grew).

    Example:
      >>> main(["--ops", "300", "--transports", "tcp"])
      0
    """
    ap = argparse.ArgumentParser(prog="python -m ringlet.bench.soak", description=__doc__)
    ap.add_argument("--ops", type=int, default=int(os.environ.get("RINGLET_SOAK_OPS", 10_000)))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--transports", default="shm,tcp")
    ap.add_argument("--seed", type=int, default=14)
    args = ap.parse_args(argv)
    status = 0
    for transport in args.transports.split(","):
        res = run(args.ops, args.ranks, transport, args.seed)
        print(f"{transport}: {args.ops} ops on {args.ranks} ranks "
              f"(world transport {res[0]['transport']}), {res[0]['seconds']:.1f} s, "
              f"kinds {dict(sorted(res[0]['counts'].items()))}")
        for r, v in sorted(res.items()):
            (rss0, fd0, shm0), (rss1, fd1, shm1) = v["before"], v["after"]
            print(f"  rank {r}: RSS {rss0} -> {v['mid'][0]} (half-way) -> {rss1} KiB "
                  f"({rss1 - rss0:+d}; second half {rss1 - v['mid'][0]:+d}), "
                  f"fds {fd0} -> {fd1}, /dev/shm {shm0} -> {shm1}")
            if fd1 > fd0 or shm1 > shm0:
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
