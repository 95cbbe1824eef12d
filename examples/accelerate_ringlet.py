"""Hugging Face accelerate training on ringlet's process group (CPU).

accelerate checks the backend name against its own list and refuses
``"ringlet"`` (``ValueError: Your assigned backend ringlet is not available,
please use gloo``). The route that works: create the process group *before*
the ``Accelerator``; accelerate finds torch.distributed initialised and keeps
that group. The trap: ``acc.state.backend`` then still says ``"gloo"`` (the
name accelerate would have chosen); ``torch.distributed.get_backend()`` says
``"ringlet"``, and every collective runs on ringlet. See
``docs/recipes/accelerate.md``.

Needs ``pip install accelerate`` (not a ringlet dependency; CI does not run
this file). Run:
  torchrun --nproc_per_node 2 examples/accelerate_ringlet.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate import Accelerator

import ringlet  # noqa: F401  (registers the "ringlet" backend; installed, torch does too)


def main(epochs: int = 2, batch: int = 8) -> None:
    dist.init_process_group("ringlet")  # first: accelerate keeps an existing group
    acc = Accelerator(cpu=True)
    assert dist.get_backend() == "ringlet"  # while acc.state.backend reports "gloo"

    torch.manual_seed(0)  # same initial weights and the same data on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(256, 16)
    y = x @ torch.randn(16, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                         batch_size=batch, shuffle=False)
    # accelerate shards the loader over the ranks and wraps the model in DDP
    model, opt, loader = acc.prepare(model, opt, loader)
    for epoch in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            acc.backward(loss)  # DDP averages the gradients over ringlet
            opt.step()
        mean = acc.reduce(loss.detach(), reduction="mean")  # a ringlet all_reduce
        acc.print(f"epoch {epoch}  loss {mean.item():.4f}")

    # every replica ends with the same weights
    flat = torch.cat([p.detach().reshape(-1) for p in acc.unwrap_model(model).parameters()])
    copies = acc.gather(flat.unsqueeze(0))
    assert torch.equal(copies, flat.expand_as(copies)), "replicas diverged"
    acc.print(f"torch.distributed backend: {dist.get_backend()}; "
              f"accelerate's state says: {acc.state.backend}")
    acc.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
