"""Plain-torch references of Bagua's algorithms, written from Bagua's
formulas (its CUDA kernels and tests/internal/compressor.py): every rank
of a test simulates every replica of the job in one process and compares
its own weights with its replica's."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

EPS = 1e-7
LEVELS = 255.0


class Net(torch.nn.Module):
    """Bagua's test network."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(2, 10, bias=False)
        self.fc2 = torch.nn.Linear(10, 50, bias=True)
        self.fc3 = torch.nn.Linear(50, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.softmax(self.fc3(x), dim=1)


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 2, generator=g), torch.randn(4, 4, generator=g)


def compress(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MinMaxUInt8 of one chunk (float32 math, a true division for the
    scale as Bagua's kernel): ``(min, max)`` and the bytes."""
    xf = x.float()
    mn, mx = xf.min(), xf.max()
    scale = torch.div(torch.tensor(LEVELS), (mx - mn) + torch.tensor(EPS))
    upper = torch.round(mx * scale)
    lower = upper - LEVELS
    level = torch.minimum(torch.round(xf * scale), upper)
    return torch.stack([mn, mx]), (level - lower).clamp(0, 255).to(torch.uint8)


def decompress(minmax: torch.Tensor, q: torch.Tensor, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    mn, mx = minmax[0], minmax[1]
    scale = torch.div(torch.tensor(LEVELS), (mx - mn) + torch.tensor(EPS))
    upper = torch.round(mx * scale)
    lower = upper - LEVELS
    return torch.div(q.float() + lower, scale).to(dtype)


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    return decompress(*compress(x), x.dtype)


def chunks(n: int, p: int) -> list[slice]:
    return [slice(n * j // p, n * (j + 1) // p) for j in range(p)]


def bytegrad_mean(buckets: list[torch.Tensor], average: bool = True) -> torch.Tensor:
    """Bagua's centralized low-precision all-reduce of equal buckets (one
    per rank): per chunk, every rank's round trip summed in rank order,
    divided, then the owner's round trip."""
    p, n = len(buckets), buckets[0].numel()
    out = torch.empty_like(buckets[0])
    for s in chunks(n, p):
        acc = roundtrip(buckets[0][s]).float()
        for b in buckets[1:]:
            acc = acc + roundtrip(b[s]).float()
        mean = (acc / p if average else acc).to(buckets[0].dtype)
        out[s] = roundtrip(mean)
    return out


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflat(vec: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, at = [], 0
    for t in like:
        out.append(vec[at:at + t.numel()].view_as(t))
        at += t.numel()
    return out


def replicas(world: int) -> list[Net]:
    torch.manual_seed(0)
    first = Net()
    models = []
    for _ in range(world):
        m = Net()
        m.load_state_dict(first.state_dict())
        models.append(m)
    return models


def grads(models: list[Net], step: int) -> list[list[torch.Tensor]]:
    """Each replica's gradients at its current weights (parameter order)."""
    out = []
    for r, m in enumerate(models):
        m.zero_grad()
        x, y = data(r, step)
        F.mse_loss(m(x), y).backward()
        out.append([p.grad.detach().clone() for p in m.parameters()])
    return out


def rev(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Bucket order: parameters reversed."""
    return list(reversed(params))


def sgd(model: Net, g: list[torch.Tensor], lr: float = 0.01) -> None:
    with torch.no_grad():
        for p, gi in zip(model.parameters(), g):
            p.sub_(gi * lr)


def centralized(world: int, steps: int,
                reduce: Callable[[list[torch.Tensor]], torch.Tensor],
                align: int = 1) -> list[torch.Tensor]:
    """SGD where the buckets (reversed gradients, flattened, then the
    bucket's padding to a multiple of ``align``, which keeps the values the
    reduction leaves in it, as Bagua's padding tensor does) are reduced by
    ``reduce``; returns the final weights (identical on every replica)."""
    models = replicas(world)
    pads: list[Optional[torch.Tensor]] = [None] * world
    for step in range(steps):
        gs = grads(models, step)
        like = rev(gs[0])
        n = flat(like).numel()
        buckets = []
        for r, g in enumerate(gs):
            b = padded(flat(rev(g)), align)
            if pads[r] is not None:
                b[n:] = pads[r]
            buckets.append(b)
        out = reduce(buckets)
        pads = [out[n:].clone() for _ in range(world)]
        avg = list(reversed(unflat(out[:n], like)))
        for m in models:
            sgd(m, avg)
    return [p.detach() for p in models[0].parameters()]


def padded(b: torch.Tensor, align: int) -> torch.Tensor:
    pad = (align - b.numel() % align) % align
    return torch.cat([b, torch.zeros(pad, dtype=b.dtype)])


def shift_one_peer(rank: int, n: int, comm_step: int) -> int:
    if rank < n // 2:
        return ((comm_step + rank) % ((n + 1) // 2)) + (n // 2)
    return (rank - (n // 2) - comm_step) % (n // 2)


def decentralized(world: int, steps: int, mode: str, interval: int) -> list[list[torch.Tensor]]:
    """Bagua's DecentralizedAlgor reference: every replica's final weights."""
    models = replicas(world)
    comm_step = 0
    for step in range(steps):
        talk = step % interval == 0
        if talk:
            ws = [flat(rev(list(m.parameters()))) for m in models]
            if mode == "all":
                total = ws[0].clone()
                for w in ws[1:]:
                    total = total + w
                peers = [total / world for _ in ws]
            else:
                peers = [(ws[shift_one_peer(r, world, comm_step)] + ws[r]) / 2
                         for r in range(world)]
            comm_step += 1
        gs = grads(models, step)
        for r, m in enumerate(models):
            if talk:
                like = rev(list(m.parameters()))
                with torch.no_grad():
                    for p, v in zip(reversed(like), reversed(unflat(peers[r], like))):
                        p.copy_(v)
            sgd(m, gs[r])
    return [[p.detach() for p in m.parameters()] for m in models]


def low_precision(world: int, steps: int, interval: int = 1) -> tuple[
        list[list[torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Bagua's low-precision decentralized reference (ring, one bucket):
    every replica's final weights and (weight, left, right) replicas."""
    models = replicas(world)
    w0 = flat(rev(list(models[0].parameters())))
    state = [[w0.clone(), w0.clone(), w0.clone()] for _ in range(world)]
    third = torch.tensor(1.0 / 3.0, dtype=torch.float32)
    five_thirds = torch.tensor(-5.0 / 3.0, dtype=torch.float32)
    for step in range(steps):
        gs = grads(models, step)
        for r, m in enumerate(models):
            sgd(m, gs[r])
        if step % interval:
            continue
        ts = [flat(rev(list(m.parameters()))) for m in models]
        cs = []
        for r in range(world):
            w, left, right = state[r]
            d = ts[r] + left * third
            d = d + right * third
            d = d + w * five_thirds
            cs.append(compress(d))
        for r in range(world):
            w, left, right = state[r]
            lpeer, rpeer = (r - 1) % world, (r + 1) % world
            left = left + decompress(*cs[lpeer])
            right = right + decompress(*cs[rpeer])
            t = w + decompress(*cs[r])
            state[r] = [t.clone(), left, right]
            like = rev(list(models[r].parameters()))
            with torch.no_grad():
                for p, v in zip(reversed(like), reversed(unflat(t, like))):
                    p.copy_(v)
    weights = [[p.detach() for p in m.parameters()] for m in models]
    return weights, [tuple(s) for s in state]  # type: ignore[misc]


def adam_step(p: torch.Tensor, grad: torch.Tensor, st: dict, lr: float, betas: tuple[float, float],
              eps: float, update_moments: bool) -> None:
    """torch.optim.Adam's single-tensor arithmetic (moments optional)."""
    b1, b2 = betas
    st["step"] += 1
    if update_moments:
        st["m"].lerp_(grad, 1 - b1)
        st["v"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
    bc1 = 1 - b1 ** float(st["step"])
    bc2 = 1 - b2 ** float(st["step"])
    denom = (st["v"].sqrt() / (bc2 ** 0.5)).add_(eps)
    with torch.no_grad():
        p.addcdiv_(st["m"], denom, value=-(lr / bc1))


def qadam(world: int, steps: int, warmup: int, lr: float = 1e-3,
          betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> list[torch.Tensor]:
    """QAdam (flat, exact warm-up then compressed momentum), weights after
    ``steps`` (identical on every replica)."""
    models = replicas(world)
    states = [[{"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)}
               for p in m.parameters()] for m in models]
    pads: list[Optional[torch.Tensor]] = [None] * world
    for step in range(steps):
        gs = grads(models, step)
        opt_step = states[0][0]["step"]
        if opt_step < warmup:
            like = rev(gs[0])
            total = bytegrad_free_mean([flat(rev(g)) for g in gs])
            avg = list(reversed(unflat(total, like)))
            for r, m in enumerate(models):
                for p, g, st in zip(m.parameters(), avg, states[r]):
                    adam_step(p, g, st, lr, betas, eps, st["step"] + 1 < warmup)
        else:
            b1 = betas[0]
            for r in range(world):
                for st, g in zip(states[r], gs[r]):
                    st["m"].mul_(b1).add_(g, alpha=1 - b1)
            like = rev([st["m"] for st in states[0]])
            n = flat(like).numel()
            buckets = []
            for r in range(world):
                b = padded(flat(rev([st["m"] for st in states[r]])), world)
                if pads[r] is not None:
                    b[n:] = pads[r]
                buckets.append(b)
            out = bytegrad_mean(buckets)
            pads = [out[n:].clone() for _ in range(world)]
            mean = out[:n]
            ms = list(reversed(unflat(mean, like)))
            for r, m in enumerate(models):
                for p, g, st, mm in zip(m.parameters(), gs[r], states[r], ms):
                    st["m"] = mm.clone()
                    adam_step(p, g, st, lr, betas, eps, False)
    return [p.detach() for p in models[0].parameters()]


def bytegrad_free_mean(buckets: list[torch.Tensor]) -> torch.Tensor:
    total = buckets[0].clone()
    for b in buckets[1:]:
        total = total + b
    return total / len(buckets)


def close(a: list[torch.Tensor], b: list[torch.Tensor], atol: float = 1e-5,
          what: Optional[str] = None) -> None:
    for x, y in zip(a, b):
        if not torch.allclose(x, y, atol=atol, rtol=1e-5):
            diff = (x - y).abs().max().item()
            raise AssertionError(f"{what or 'weights'} differ from the reference by {diff}")
