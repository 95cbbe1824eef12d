"""One rank of the namespace-hosts test of Bagua's algorithms
(tests/test_netns.py), run by torchrun inside a network namespace: ByteGrad
(hierarchical: exact within hosts, compressed between them; and flat) and
decentralized SGD across real hosts, against the plain-torch references.
Writes ``$RINGLET_TEST_OUT/alg<rank>.json`` when every check passed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _bagua_reference import (
    Net,
    bytegrad_mean,
    centralized,
    close,
    data,
    decentralized,
)

STEPS = 4


def host_bytegrad(layout: list[int]):  # type: ignore[no-untyped-def]
    """ByteGrad with hierarchical=True: the hosts' exact sums over (ranks /
    hosts), then MinMaxUInt8 between the hosts: of the whole bucket by the
    hosts' first ranks (uneven hosts), or of each of the L shares by the
    ranks at the same position on every host (hosts of L ranks each)."""
    def reduce(buckets: list[torch.Tensor]) -> torch.Tensor:
        sums, at = [], 0
        for lh in layout:
            s = buckets[at].clone()
            for b in buckets[at + 1:at + lh]:
                s = s + b
            sums.append(s / (sum(layout) / len(layout)))
            at += lh
        if len(set(layout)) > 1 or layout[0] == 1:
            return bytegrad_mean(sums)
        n, per = sums[0].numel(), layout[0]
        shares = [slice(n * i // per, n * (i + 1) // per) for i in range(per)]
        return torch.cat([bytegrad_mean([x[s] for x in sums]) for s in shares])

    return reduce


def main() -> None:
    import ringlet.bagua.compat as bagua
    from ringlet.bagua.compat.algorithms import bytegrad
    from ringlet.bagua.compat.algorithms import decentralized as dec

    torch.set_num_threads(1)
    bagua.init_process_group()
    r, n = bagua.get_rank(), bagua.get_world_size()
    layout = [len(g) for g in __import__("ringlet").host_layout()]

    def run(algorithm):  # type: ignore[no-untyped-def]
        torch.manual_seed(r)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        model = model.with_bagua([opt], algorithm)
        for step in range(STEPS):
            x, y = data(r, step)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        return [p.detach() for p in model.parameters()]

    got = run(bytegrad.ByteGradAlgorithm(hierarchical=True))
    close(got, centralized(n, STEPS, host_bytegrad(layout), align=n), what="bytegrad hier")
    got = run(bytegrad.ByteGradAlgorithm(hierarchical=False))
    close(got, centralized(n, STEPS, bytegrad_mean, align=n), what="bytegrad flat")
    got = run(dec.DecentralizedAlgorithm(hierarchical=True))
    close(got, decentralized(n, STEPS, "all", 1)[r], what="decentralized all, hierarchical")
    if layout == [2, 2]:
        got = run(dec.DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="shift_one"))
        close(got, decentralized(n, STEPS, "shift_one", 1)[r], what="shift_one")
    bagua.barrier()
    out = Path(os.environ["RINGLET_TEST_OUT"])
    (out / f".alg{r}").write_text(json.dumps({"layout": layout}))
    (out / f".alg{r}").rename(out / f"alg{r}.json")



if __name__ == "__main__":
    main()
