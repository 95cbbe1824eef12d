"""One rank of the two-host test (tests/test_netns.py), run by torchrun inside a
network namespace: checks every collective against torch, reports the layout and
transports, then keeps running collectives until the link is cut and reports
the error. Results go to ``$RINGLET_TEST_OUT/rank<r>.json``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import ringlet
import ringlet._engine as engine

out = Path(os.environ["RINGLET_TEST_OUT"])
used_two_level: list[str] = []
_two_level = engine._two_level


def _spy(comm: object, nbytes: int) -> object:
    hier = _two_level(comm, nbytes)
    if hier is not None:
        used_two_level.append(sys._getframe(1).f_code.co_name)
    return hier


engine._two_level = _spy


def write(name: str, value: object) -> None:
    tmp = out / f".{name}.tmp"
    tmp.write_text(json.dumps(value))
    tmp.rename(out / name)


def check_collectives(r: int, n: int) -> None:
    for numel in (0, 1, 7, 1 << 18):  # 1 MiB: the two-level paths
        x = torch.arange(numel, dtype=torch.float32) + r
        want = sum(torch.arange(numel, dtype=torch.float32) + q for q in range(n))
        assert torch.equal(ringlet.all_reduce(ringlet.REDUCE_SUM, x), want), numel
        got = ringlet.all_gather(torch.full((numel,), float(r)))
        assert torch.equal(got, torch.cat([torch.full((numel,), float(q)) for q in range(n)]))
        full = torch.arange(n * max(numel, 1), dtype=torch.float64)
        shard = ringlet.reduce_scatter(ringlet.REDUCE_SUM, full * (r + 1), 1.0, 0, n)
        total = full * sum(range(1, n + 1))
        assert torch.equal(shard, total.view(n, -1)[r]), numel
        b = torch.full((numel,), float(r))
        ringlet.collective_broadcast([b], root_ordinal=2)
        assert torch.equal(b, torch.full((numel,), 2.0))
    a2a = ringlet.all_to_all(torch.arange(n * 3.0) + 10 * r, 0, 0, n)
    assert torch.equal(a2a, torch.cat([torch.arange(3.0) + 3 * r + 10 * q for q in range(n)]))
    g = ringlet.all_reduce(ringlet.REDUCE_SUM, torch.tensor([float(r)]), groups=[[0, 2], [1, 3]])
    assert g.item() == (0 + 2 if r in (0, 2) else 1 + 3)
    # send/recv across the hosts: 0 <-> 2, 1 <-> 3
    peer = (r + 2) % n
    t = torch.full((5,), float(r))
    if r < 2:
        ringlet.send(t, peer)
        ringlet.recv(t, peer)
    else:
        ringlet.recv(t, peer)
        ringlet.send(torch.full((5,), float(r)), peer)
    assert torch.equal(t, torch.full((5,), float(peer)))
    ringlet.barrier()


def main() -> None:
    ringlet.init()
    r, n = ringlet.get_ordinal(), ringlet.world_size()
    check_collectives(r, n)
    write(f"ok{r}.json", {
        "layout": ringlet.host_layout(), "transport": ringlet.transport(),
        "peers": {str(k): v for k, v in ringlet.peer_transports().items()},
        "two_level": sorted(set(used_two_level)),
    })
    # Phase 2: collectives until the link between the hosts goes down.
    last_ok = time.monotonic()
    write(f"running{r}.json", {})
    try:
        while True:
            ringlet.all_reduce(ringlet.REDUCE_SUM, [torch.ones(1 << 18)])
            ringlet.barrier()
            last_ok = time.monotonic()
    except ringlet.RingletError as e:
        write(f"cut{r}.json", {
            "type": type(e).__name__, "msg": str(e), "culprit": e.culprit, "cause": e.cause,
            "after": time.monotonic() - last_ok,
        })
    os._exit(0)  # the store is across the cut for some ranks: leave without it


if __name__ == "__main__":
    main()
