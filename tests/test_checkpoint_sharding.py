"""Checkpointing mesh-sharded modules: save in one layout, load into others and other world sizes.

The module mixes even and uneven shards (so some shards are stored as several
grid-aligned pieces), replicated parameters, a buffer and a shard that is all
padding. Expected values are the plain module's tensors.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import ringlet
from ringlet.checkpoint import (
    ShardedTensor,
    load,
    load_tensors_metadata,
    save,
    sharded_state_dict,
)
from ringlet.xla.sharding import Mesh, mark_sharding, wrap_if_sharded

from conftest import launch


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(6, 7)
        self.c = nn.Parameter(torch.zeros(7, 5))
        self.register_buffer("steps", torch.tensor(0))


def reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.c.copy_(torch.arange(35.0).view(7, 5) - 3.5)
        net.steps.fill_(11)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def build(values: dict[str, torch.Tensor] | None, layout: str) -> Net:
    """A Net holding ``values`` (zeros when None), sharded by ``layout``."""
    net = Net()
    with torch.no_grad():
        for k, v in net.state_dict(keep_vars=True).items():
            v.copy_(values[k] if values is not None else torch.zeros_like(v))
    if layout == "A":  # 4 ranks, (data, model) = (2, 2)
        mesh = Mesh(list(range(4)), (2, 2), ("data", "model"))
        mark_sharding(net.a.weight, mesh, ("model", None))
        mark_sharding(net.a.bias, mesh, ("model",))
        mark_sharding(net.b.weight, mesh, (("data", "model"), None))  # 7 rows in 4: on grid
        mark_sharding(net.c, mesh, ("data", "model"))  # 7 x 5 in 2 x 2: off grid
    elif layout == "B":  # 4 ranks, 1-D mesh in a custom order
        mesh = Mesh([3, 1, 0, 2], (4,), ("x",))
        mark_sharding(net.a.weight, mesh, (None, "x"))
        mark_sharding(net.b.weight, mesh, ("x", None))
        mark_sharding(net.b.bias, mesh, ("x",))
        mark_sharding(net.c, mesh, (None, "x"))  # 5 columns in 4: one shard all padding
    elif layout == "C":  # 2 ranks
        mesh = Mesh([0, 1], (2,), ("x",))
        mark_sharding(net.a.weight, mesh, ("x", None))
        mark_sharding(net.b.weight, mesh, (None, "x"))
        mark_sharding(net.c, mesh, ("x", None))  # 7 rows in 2: off grid
    elif layout != "plain":
        raise ValueError(layout)
    return net


def check_module(net: Net, want: dict[str, torch.Tensor], what: str) -> None:
    for k, v in net.state_dict(keep_vars=True).items():
        sharded = wrap_if_sharded(v)
        got = sharded.global_tensor if sharded is not v else v.detach()
        assert torch.equal(got, want[k]), f"{what}: {k} differs"


def four_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    want = reference()
    model = build(want, "A")
    sd = sharded_state_dict(model, prefix="net.")
    kinds = {k: type(v).__name__ for k, v in sd.items()}
    save(sd, os.path.join(root, "A"), progress=False)  # one call

    # Same layout, another layout on the same ranks, and unsharded copies on every rank.
    for layout in ("A", "B", "plain"):
        fresh = build(None, layout)
        loaded = load(sharded_state_dict(fresh, prefix="net."), os.path.join(root, "A"))
        check_module(fresh, want, f"rank {rank}: A -> {layout}")
        for k, v in fresh.state_dict(keep_vars=True).items():
            sharded = wrap_if_sharded(v)
            local = sharded.local_shards[0].unpadded_data if sharded is not v else v
            assert torch.equal(loaded["net." + k], local), f"{layout}: returned {k}"
    layout_b = build(want, "B")
    save(sharded_state_dict(layout_b, prefix="net."), os.path.join(root, "B"))
    return kinds


def two_ranks(rank: int, world: int, root: str) -> bool:
    want = reference()
    for src in ("A", "B"):
        fresh = build(None, "C")
        load(sharded_state_dict(fresh, prefix="net."), os.path.join(root, src))
        check_module(fresh, want, f"rank {rank}: {src} (4 ranks) -> C (2 ranks)")
    save(sharded_state_dict(fresh, prefix="net."), os.path.join(root, "C"))
    return True


def test_sharded_module_checkpoint_across_layouts_and_world_sizes(tmp_path: Any) -> None:
    root = str(tmp_path)
    kinds = launch(4, four_ranks, root)
    # The off-grid shards of c need a factory on some ranks; on-grid ones are single tensors.
    assert kinds[0]["net.a.weight"] == "ShardedTensor"
    assert kinds[0]["net.b.weight"] == "ShardedTensor"
    assert kinds[0]["net.c"] == "ShardedTensor"  # rows [0, 4), columns [0, 3)
    assert kinds[3]["net.c"] == "ShardedTensorFactory"  # rows [4, 7), columns [3, 5)
    assert launch(2, two_ranks, root) == {0: True, 1: True}

    # Stored global view, then a single process (no ringlet.init) reads every layout back whole.
    want = reference()
    meta = load_tensors_metadata(os.path.join(root, "A"))
    assert {k: tuple(v.global_shape) for k, v in meta.items()} == {
        "net." + k: tuple(v.shape) for k, v in want.items()
    }
    assert not ringlet.is_initialized()
    for layout in ("A", "B", "C"):
        fresh = build(None, "plain")
        load(sharded_state_dict(fresh, prefix="net."), os.path.join(root, layout))
        check_module(fresh, want, f"single process <- {layout}")


def test_single_process_mapping_of_sharded_tensor(tmp_path: Any) -> None:
    mesh = Mesh([0], (1,), ("x",))
    st = mark_sharding(torch.arange(12.0).view(3, 4), mesh, ("x", None))
    mapping = st.sharded_checkpoint_tensor("t")
    assert isinstance(mapping, ShardedTensor)
    assert mapping.global_shape == (3, 4) and mapping.global_offset == (0, 0)
    assert mapping.axis_fragmentations == (1, 1) and mapping.replica_id == 0
    assert mapping.data is not None
    assert mapping.data.data_ptr() == st.local_shards[0].data.data_ptr()
    path = str(tmp_path / "ckpt")
    save({"t": mapping}, path)
    target = mark_sharding(torch.zeros(3, 4), mesh, ("x", None))
    out = load({"t": target.sharded_checkpoint_tensor("t")}, path)
    assert torch.equal(target.global_tensor, torch.arange(12.0).view(3, 4))
    assert torch.equal(out["t"], torch.arange(12.0).view(3, 4))

