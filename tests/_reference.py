"""Plain-torch references for the collectives (no ringlet involved)."""

from __future__ import annotations

import torch

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
]
OPS = ["sum", "mul", "min", "max", "and", "or"]


def supported(dtype: torch.dtype, op: str) -> bool:
    return not (op in ("and", "or") and dtype.is_floating_point)


def make_input(dtype: torch.dtype, rank: int, count: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt + count)
    if dtype == torch.bool:
        return torch.rand(count, generator=g) < 0.5
    if dtype.is_floating_point:
        # Values near 1 keep products of up to four ranks well inside range.
        return (torch.rand(count, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    lo, hi = (0, 7) if dtype == torch.uint8 else (-5, 6)
    return torch.randint(lo, hi, (count,), generator=g, dtype=torch.int64).to(dtype)


def reduce(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Element-wise reduction; half floats accumulate in float32 and round once."""
    dtype = tensors[0].dtype
    work = [t.float() if dtype in (torch.float16, torch.bfloat16) else t for t in tensors]
    acc = work[0].clone()
    for t in work[1:]:
        if dtype == torch.bool:
            acc = acc | t if op in ("sum", "max", "or") else acc & t
        elif op == "sum":
            acc = acc + t
        elif op == "mul":
            acc = acc * t
        elif op == "min":
            acc = torch.minimum(acc, t)
        elif op == "max":
            acc = torch.maximum(acc, t)
        elif op == "and":
            acc = acc & t
        else:
            acc = acc | t
    return acc.to(dtype)


def assert_matches(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if want.dtype.is_floating_point:
        tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(want.dtype, 1e-5)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=what)
    else:
        assert torch.equal(got, want), f"{what}: values differ"
