"""One rank of the namespace-hosts tests (tests/test_netns.py), run by torchrun
inside a network namespace: checks every collective against plain torch on the
two-level paths (the torch_xla-style API and a torch.distributed "ringlet"
group), reports the layout and transports, then, when asked, keeps running
large (pipelined) all-reduces until the link is cut and reports the error.
Results go to ``$RINGLET_TEST_OUT/<name><rank>.json``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ringlet

sys.path.insert(0, str(Path(__file__).parent))
from _reference import assert_matches, make_input, reduce, supported

out = Path(os.environ["RINGLET_TEST_OUT"])
# Around the pipeline's piece size (256 KiB - 2 MiB) and odd: padded pieces,
# more than one piece for 4-byte elements.
COUNTS = (0, 1, 7, 70001, 300007)
DTYPES = (torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.int64, torch.bool)
C10D_DTYPES = (torch.float32, torch.bfloat16, torch.int32)
C10D_COUNTS = (3, 300007)
# Many hosts on two cores (RINGLET_TEST_MANY=1): one dtype per class (float,
# half, integer, bool) and smaller counts, then one pipelined all-reduce.
MANY = os.environ.get("RINGLET_TEST_MANY") == "1"
if MANY:
    COUNTS = (0, 7, 20001)
    DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
    C10D_DTYPES = (torch.float32, torch.int32)
    C10D_COUNTS = (3, 20001)


def write(name: str, value: object) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(value))
    tmp.rename(out / name)


def check_xla_api(r: int, n: int) -> None:
    for dtype in DTYPES:
        for op in ("sum", "max", "min", "mul", "or"):
            if not supported(dtype, op) or (op == "mul" and dtype == torch.bool):
                continue
            for count in COUNTS:
                if count > 70001 and op not in ("sum", "max"):
                    continue
                inputs = [make_input(dtype, q, count, salt=3) for q in range(n)]
                got = ringlet.all_reduce(op, inputs[r])
                assert_matches(got, reduce(op, inputs), f"all_reduce {dtype} {op} {count}")
        for count in COUNTS:
            inputs = [make_input(dtype, q, count, salt=5) for q in range(n)]
            assert torch.equal(ringlet.all_gather(inputs[r]), torch.cat(inputs)), (dtype, count)
            for root in (0, n - 1):
                t = inputs[r].clone()
                ringlet.collective_broadcast([t], root_ordinal=root)
                assert torch.equal(t, inputs[root]), (dtype, count, root)
            if dtype != torch.bool:
                full = [make_input(dtype, q, n * count, salt=7) for q in range(n)]
                got = ringlet.reduce_scatter("sum", full[r], 1.0, 0, n)
                want = reduce("sum", full).view(n, -1)[r] if count else full[0][:0]
                assert_matches(got, want, f"reduce_scatter {dtype} {count}")
    if MANY:
        inputs = [make_input(torch.float32, q, 300007, salt=9) for q in range(n)]
        got = ringlet.all_reduce("sum", inputs[r])
        assert_matches(got, reduce("sum", inputs), "pipelined all_reduce")
    a2a = ringlet.all_to_all(torch.arange(n * 3.0) + 10 * r, 0, 0, n)
    assert torch.equal(a2a, torch.cat([torch.arange(3.0) + 3 * r + 10 * q for q in range(n)]))
    g = ringlet.all_reduce("sum", torch.tensor([float(r)]), groups=[[q] for q in range(n)])
    assert g.item() == r
    # A replica group that spans hosts (two levels, uneven) and one alone.
    groups = [list(range(n - 1)), [n - 1]]
    mine = next(g for g in groups if r in g)
    for count in (5, 300007):
        inputs = [make_input(torch.float32, q, count, salt=17) for q in range(n)]
        got = ringlet.all_reduce("sum", inputs[r], groups=groups)
        assert_matches(got, reduce("sum", [inputs[q] for q in mine]), f"group {count}")
        got = ringlet.all_gather(inputs[r], groups=groups)
        assert torch.equal(got, torch.cat([inputs[q] for q in mine]))
    peer = (r + 1) % n  # send/recv around a ring that crosses every host boundary
    t = torch.full((5,), float(r))
    got = torch.empty(5)
    if r % 2 == 0:
        ringlet.send(t, peer)
        ringlet.recv(got, (r - 1) % n)
    else:
        ringlet.recv(got, (r - 1) % n)
        ringlet.send(t, peer)
    assert torch.equal(got, torch.full((5,), float((r - 1) % n)))
    ringlet.barrier()


def check_c10d(r: int, n: int) -> list[list[int]] | None:
    for dtype in C10D_DTYPES:
        for count in C10D_COUNTS:
            inputs = [make_input(dtype, q, count, salt=11) for q in range(n)]
            t = inputs[r].clone()
            dist.all_reduce(t)
            assert_matches(t, reduce("sum", inputs), f"c10d all_reduce {dtype} {count}")
            gathered = torch.empty(n * count, dtype=dtype)
            dist.all_gather_into_tensor(gathered, inputs[r])
            assert torch.equal(gathered, torch.cat(inputs))
            full = [make_input(dtype, q, n * count, salt=13) for q in range(n)]
            shard = torch.empty(count, dtype=dtype)
            dist.reduce_scatter_tensor(shard, full[r])
            assert_matches(shard, reduce("sum", full).view(n, -1)[r], f"c10d rs {dtype}")
            b = inputs[r].clone()
            dist.broadcast(b, src=n - 1)
            assert torch.equal(b, inputs[n - 1])
            x = torch.arange(n * count, dtype=torch.float64) + 1000 * r
            y = torch.empty_like(x)
            dist.all_to_all_single(y, x)
            want = torch.cat([torch.arange(r * count, (r + 1) * count, dtype=torch.float64)
                              + 1000 * q for q in range(n)])
            assert torch.equal(y, want)
    from ringlet.distributed.c10d import python_group

    layout = python_group()._comm.host_layout()
    dist.destroy_process_group()
    return layout


def main() -> None:
    ringlet.init()
    r, n = ringlet.get_ordinal(), ringlet.world_size()
    check_xla_api(r, n)
    dist.init_process_group("ringlet")
    c10d_layout = check_c10d(r, n)
    write(f"ok{r}.json", {
        "layout": ringlet.host_layout(),
        "engine_layout": ringlet.core.groups.world_comm().host_layout(),
        "c10d_layout": c10d_layout, "transport": ringlet.transport(),
        "peers": {str(k): v for k, v in ringlet.peer_transports().items()},
    })
    if os.environ.get("RINGLET_TEST_CUT") != "1":
        ringlet.shutdown()
        return
    # Phase 2: large (pipelined) all-reduces until the link between the hosts
    # goes down.
    last_ok = time.monotonic()
    x = torch.ones(1 << 20)
    write(f"running{r}.json", {})
    try:
        while True:
            ringlet.all_reduce(ringlet.REDUCE_SUM, [x])
            x.fill_(1.0)
            last_ok = time.monotonic()
    except ringlet.RingletError as e:
        write(f"cut{r}.json", {
            "type": type(e).__name__, "msg": str(e), "culprit": e.culprit, "cause": e.cause,
            "after": time.monotonic() - last_ok,
        })
    os._exit(0)  # the store is across the cut for some ranks: leave without it


if __name__ == "__main__":
    main()
