"""Bagua's fused optimizer (``bagua.torch_api.contrib.fuse_optimizer``):
any ``torch.optim.Optimizer`` updates runs of parameters that lie next to
each other in memory as one tensor.

:func:`fuse_optimizer` flattens each parameter group's parameters, their
gradients and their per-element optimizer state (``exp_avg``,
``square_avg``, ``momentum_buffer``, ...) into one buffer per dtype and
device (``do_flatten=True``) and gives the optimizer a ``fuse_step`` method.
``optimizer.fuse_step()`` finds the runs of parameters whose weights and
per-element state are adjacent in memory and whose other state (a step
count, ...) is equal, updates each run as one parameter (its gradient a view
of the run's gradients where they are adjacent too, else their
concatenation) with a shadow of the optimizer (its own parameter groups and state, the
hyperparameters copied from the optimizer's groups at every step), and writes
the state back to the original parameters: the per-element state as views
of the run's state (so the next step finds it adjacent again), the rest as
a copy for each parameter. Parameters outside any run are updated one by
one, as ``step()`` does. The update is element-wise the same as ``step()``'s,
so training with ``fuse_step`` gives what ``step`` gives.

Gradients stay adjacent while they are zeroed in place
(``optimizer.zero_grad(set_to_none=False)``); after ``zero_grad()`` (torch's
default, ``set_to_none=True``) backward allocates new ones, and a run's
gradient is their concatenation (one copy; Bagua's ``fuse_step`` then
updates parameter by parameter instead: it was written when ``zero_grad()``
zeroed in place). torch's optimizers only read gradients, so the update is
the same either way. With ``model.with_bagua`` use ``do_flatten=False``
there (Bagua's advice: both would move the parameters' storage); the
algorithm's hook after ``optimizer.step()`` also runs after ``fuse_step()``.

Example:
  >>> optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
  >>> model = model.with_bagua([optimizer], algorithm, do_flatten=False)
  >>> optimizer = bagua.contrib.fuse_optimizer(optimizer)
  >>> loss_fn(model(x), y).backward()
  >>> optimizer.fuse_step()
"""

from __future__ import annotations

import copy
import logging
from collections import defaultdict
from typing import Any, Callable, Optional

import torch

from ....core.engine import storage_ptr

__all__ = ["fuse_optimizer", "fuse_step", "is_fused_optimizer"]

_log = logging.getLogger(__name__)

# Attributes of the optimizer that its shadow must not copy: the shadow runs
# the class's own step, not a wrapper installed on the instance.
_NOT_COPIED = ("step", "fuse_step")


def is_fused_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Returns whether :func:`fuse_optimizer` was applied to ``optimizer``.

    Args:
      optimizer (torch.optim.Optimizer): The optimizer.

    Returns:
      bool: True for a fused optimizer.

    Example:
      >>> is_fused_optimizer(fuse_optimizer(torch.optim.SGD(model.parameters(), lr=0.1)))
      True
    """
    return hasattr(optimizer, "_bagua_fused_optimizer")


def fuse_optimizer(
    optimizer: torch.optim.Optimizer, do_flatten: bool = True, check_flatten: bool = True
) -> torch.optim.Optimizer:
    """Makes ``optimizer`` a fused optimizer (Bagua's ``fuse_optimizer``): it
    keeps ``step()`` and gains ``fuse_step()``, which updates runs of
    adjacent parameters as one.

    Args:
      optimizer (torch.optim.Optimizer): Any optimizer.
      do_flatten (bool): Flatten each group's parameters, gradients (created
        as zeros where missing) and per-element state into one buffer per
        dtype and device, so they can be fused. Default: True.
      check_flatten (bool): With ``do_flatten``, log a warning at
        ``fuse_step`` when a group's parameters are no longer one contiguous
        buffer. Default: True.

    Returns:
      torch.optim.Optimizer: ``optimizer`` itself.

    Raises:
      TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
      RuntimeError: It is fused already.

    Example:
      >>> optimizer = bagua.contrib.fuse_optimizer(torch.optim.Adam(model.parameters()))
      >>> optimizer.fuse_step()
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"fuse_optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if is_fused_optimizer(optimizer):
        raise RuntimeError(
            f"fuse_optimizer: this {type(optimizer).__name__} is fused already (trying to fuse "
            "an optimizer twice)"
        )
    optimizer._bagua_check_flatten = do_flatten and check_flatten  # type: ignore[attr-defined]
    optimizer._bagua_fused_count = 0  # type: ignore[attr-defined]
    optimizer._bagua_fused_optimizer = _shadow(optimizer)  # type: ignore[attr-defined]
    if do_flatten:
        _flatten_params_and_states(optimizer)
    if not hasattr(type(optimizer), "fuse_step"):
        # as Bagua: the method goes on the class (it refuses unfused instances)
        type(optimizer).fuse_step = fuse_step  # type: ignore[attr-defined]
    return optimizer


def fuse_step(optimizer: torch.optim.Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
    """Updates the parameters as ``optimizer.step(closure)`` does, each run of
    adjacent parameters as one tensor (Bagua's ``fuse_step``; also the
    method ``optimizer.fuse_step()``). Then runs the hook ``with_bagua``'s
    algorithm attached to ``optimizer.step()``.

    Args:
      optimizer (torch.optim.Optimizer): A fused optimizer.
      closure (Callable, optional): Re-evaluates the model and returns the
        loss, as for ``step``.

    Returns:
      The closure's loss, or None.

    Raises:
      RuntimeError: ``optimizer`` was not made by :func:`fuse_optimizer`.

    Example:
      >>> optimizer.fuse_step()
    """
    if not is_fused_optimizer(optimizer):
        raise RuntimeError(
            f"fuse_step: this {type(optimizer).__name__} is not a fused optimizer: call "
            "contrib.fuse_optimizer(optimizer) first"
        )
    shadow = optimizer._bagua_fused_optimizer  # type: ignore[attr-defined]
    runs = _prepare(optimizer, shadow)
    result = type(optimizer).step(shadow, closure)
    _write_back(optimizer, shadow, runs)
    post = optimizer.__dict__.get("_bagua_post_step_hook")
    if post is not None:
        post(optimizer)
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        # what a learning-rate scheduler's wrapper of step() records: a step was taken
        optimizer._opt_called = True  # type: ignore[attr-defined]
    return result


# -- the shadow optimizer --------------------------------------------------------


def _shadow(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A copy of the optimizer with its own (empty) groups and state; the
    instance attributes a subclass keeps are shared."""
    shadow = copy.copy(optimizer)
    for name, value in optimizer.__dict__.items():
        if name in _NOT_COPIED or name.startswith("_bagua_"):
            continue
        if name not in shadow.__dict__:
            shadow.__dict__[name] = value
    for name in _NOT_COPIED:
        shadow.__dict__.pop(name, None)
    shadow.param_groups = []
    shadow.state = defaultdict(dict)
    return shadow


def _view(t: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements over ``t``'s storage from ``t``'s start."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        out.set_(t.untyped_storage(), t.storage_offset(), (numel,))
    return out


def _per_element(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim() > 0


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` starts where ``a`` ends, in the same storage, both contiguous."""
    return (
        a.dtype == b.dtype
        and a.device == b.device
        and a.is_contiguous()
        and b.is_contiguous()
        and storage_ptr(a) == storage_ptr(b)
        and b.storage_offset() == a.storage_offset() + a.numel()
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and bool(torch.equal(a, b))
        )
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _joins(optimizer: torch.optim.Optimizer, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` can extend a run ending in ``a``."""
    if not _adjacent(a, b) or not _dense_grad(a) or not _dense_grad(b):
        return False
    sa, sb = optimizer.state.get(a, {}), optimizer.state.get(b, {})
    if sa.keys() != sb.keys():
        return False
    for key, va in sa.items():
        vb = sb[key]
        if _per_element(va, a):
            if not _per_element(vb, b) or not _adjacent(va, vb):
                return False
        elif _per_element(vb, b) or not _same(va, vb):
            return False
    return True


def _dense_grad(p: torch.Tensor) -> bool:
    g = p.grad
    return (
        g is not None
        and g.layout == torch.strided
        and g.dtype == p.dtype
        and g.device == p.device
        and g.shape == p.shape
    )


def _run_grad(members: list[torch.Tensor], numel: int) -> torch.Tensor:
    """The run's gradient: a view where the gradients are adjacent, else
    their concatenation (read by the update, never written)."""
    grads = [p.grad for p in members]
    if all(_adjacent(a, b) for a, b in zip(grads, grads[1:])):  # type: ignore[arg-type]
        return _view(grads[0], numel)  # type: ignore[arg-type]
    return torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]


def _runs(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[list[int]]:
    """Indices of the group's parameters that form runs (at least two) of
    adjacent parameters, in memory order."""
    order = sorted(
        (i for i, p in enumerate(params) if p.grad is not None),
        key=lambda i: (storage_ptr(params[i]), params[i].storage_offset()),
    )
    runs: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and _joins(optimizer, params[current[-1]], params[i]):
            current.append(i)
            continue
        if len(current) > 1:
            runs.append(current)
        current = [i]
    if len(current) > 1:
        runs.append(current)
    return runs


def _prepare(
    optimizer: torch.optim.Optimizer, shadow: torch.optim.Optimizer
) -> list[tuple[torch.nn.Parameter, list[torch.Tensor]]]:
    """Fills the shadow's groups and state for one step; returns each fused
    parameter with the parameters it stands for."""
    shadow.param_groups = []
    shadow.state = defaultdict(dict)
    fused: list[tuple[torch.nn.Parameter, list[torch.Tensor]]] = []
    for index, group in enumerate(optimizer.param_groups):
        params = list(group["params"])
        if optimizer._bagua_check_flatten and not _one_buffer(params):  # type: ignore[attr-defined]
            _log.warning(
                "fused optimizer: the parameters of group %d no longer share one buffer "
                "(their storage changed after fuse_optimizer); fewer updates are fused",
                index,
            )
            optimizer._bagua_check_flatten = False  # type: ignore[attr-defined]
        runs = _runs(optimizer, params)
        if runs:
            optimizer._bagua_fused_count += 1  # type: ignore[attr-defined]
        in_run = {i for run in runs for i in run}
        new_params: list[torch.Tensor] = []
        for run in runs:
            members = [params[i] for i in run]
            numel = sum(p.numel() for p in members)
            first = members[0]
            fp = torch.nn.Parameter(_view(first.data, numel), requires_grad=False)
            fp.grad = _run_grad(members, numel)
            state: dict[str, Any] = {}
            for key, value in optimizer.state.get(first, {}).items():
                if _per_element(value, first):
                    state[key] = _view(value, numel)
                elif isinstance(value, torch.Tensor):
                    state[key] = value.clone()
                else:
                    state[key] = value
            shadow.state[fp] = state
            new_params.append(fp)
            fused.append((fp, members))
        for i, p in enumerate(params):
            if i not in in_run:
                new_params.append(p)
                # the same dict: the step's updates land in the optimizer's state
                shadow.state[p] = optimizer.state[p]
        settings = {k: v for k, v in group.items() if k != "params"}
        shadow.param_groups.append({**settings, "params": new_params})
    return fused


def _write_back(
    optimizer: torch.optim.Optimizer,
    shadow: torch.optim.Optimizer,
    fused: list[tuple[torch.nn.Parameter, list[torch.Tensor]]],
) -> None:
    """Gives each fused parameter's state back to the parameters it stands for."""
    for fp, members in fused:
        for key, value in shadow.state[fp].items():
            if _per_element(value, fp):
                at = 0
                for p in members:
                    optimizer.state[p][key] = value.narrow(0, at, p.numel()).view(p.shape)
                    at += p.numel()
            elif isinstance(value, torch.Tensor):
                for p in members:
                    optimizer.state[p][key] = value.clone()
            else:
                for p in members:
                    optimizer.state[p][key] = value
    shadow.state = defaultdict(dict)


def _one_buffer(params: list[torch.Tensor]) -> bool:
    """Whether the parameters of each dtype and device are one contiguous run
    in group order (as flattening left them)."""
    last: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    for p in params:
        key = (p.dtype, p.device)
        prev = last.get(key)
        if prev is not None and not _adjacent(prev, p):
            return False
        last[key] = p
    return True


# -- flattening --------------------------------------------------------------------


def _flatten(tensors: list[torch.Tensor]) -> Optional[list[torch.Tensor]]:
    """Views of one new buffer holding ``tensors`` in order, or None when they
    are one contiguous run already."""
    if all(_adjacent(a, b) for a, b in zip(tensors, tensors[1:])) and tensors[0].is_contiguous():
        return None
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    out, at = [], 0
    for t in tensors:
        out.append(flat.narrow(0, at, t.numel()).view(t.shape))
        at += t.numel()
    return out


def _flatten_params_and_states(optimizer: torch.optim.Optimizer) -> None:
    """Flattens each group's parameters, gradients and per-element state,
    per dtype and device, in group order."""
    for group in optimizer.param_groups:
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
        for p in group["params"]:
            by_kind[(p.dtype, p.device)].append(p)
        for params in by_kind.values():
            keys = {k for p in params for k in optimizer.state.get(p, {})}
            if any(optimizer.state.get(p, {}).keys() != keys for p in params):
                _log.warning(
                    "fused optimizer: parameters of one group have different optimizer state "
                    "(%s); not flattened",
                    sorted(keys),
                )
                continue
            with torch.no_grad():
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                views = _flatten([p.data for p in params])
                if views is not None:
                    for p, v in zip(params, views):
                        p.data = v
                grads = _flatten([p.grad for p in params])  # type: ignore[misc]
                if grads is not None:
                    for p, g in zip(params, grads):
                        p.grad = g
                for key in sorted(keys):
                    values = [optimizer.state[p][key] for p in params]
                    if not all(_per_element(v, p) for v, p in zip(values, params)):
                        continue
                    flat = _flatten(values)
                    if flat is not None:
                        for p, v in zip(params, flat):
                            optimizer.state[p][key] = v
